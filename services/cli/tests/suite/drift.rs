//! `provledger drift` against a private nats-server: the reference flows run in this test
//! process on a JetStream ledger, the simulated executors answer compensation and
//! inventory requests over NATS, and the binary compares the two:
//! - a successful create (and boot) reports nothing, exit 0;
//! - a record made behind the ledger's back is `leaked`;
//! - a VM deleted by hand is `missing`, and nothing is written to the log;
//! - an IP changed by hand under the step's key is `mismatched`;
//! - `--fix leaked --dry-run` prints the removal and writes nothing; `--fix leaked` removes
//!   the leaked record through the compensation path, recorded, and drift is then clean;
//! - serve's drift sweep (`--drift-interval`) reports the same finding in `q.drift` and its
//!   metrics, and reports it gone once it is;
//! - an executor the ledger never named, answering inventories, is discovered and its
//!   record found `leaked`; also under the deployed accounts, as the `writer`;
//! - serve's sweep discovers it too (q.drift, metrics);
//! - a hostile answer to discovery (thousands of replies, forged names with control
//!   characters and markup) is bounded: drift ends, asks at most the bound, asks no
//!   forged name, prints none raw, and says the comparison is incomplete (exit 3).

use std::sync::Arc;

use provledger_client::{CancelNotices, Ledger, OperationRunner};
use provledger_events::catalogue::NodeGroupSpec;
use provledger_events::EventLog;
use provledger_sim::{ClusterRequest, InstanceRequest, Provisioner, SimInfrastructure};
use provledger_tests::NatsServer;
use uuid::Uuid;

use crate::common;
use crate::common::{http_get, provledger, sample, text, wait_ready, Serve};

struct Env {
    nats: NatsServer,
    ledger: provledger_client::Writer<Ledger>,
    infra: Arc<SimInfrastructure>,
    provisioner: Provisioner,
    provider: Uuid,
}

/// Given a ledger on a private nats-server, the simulated executors answering on it, and
/// a compute node.
async fn env() -> Env {
    let nats = NatsServer::start().await;
    let (_client, ledger, infra, provider) = common::ledger_with_executors(&nats, 256).await;
    let runner = OperationRunner::new(ledger.clone(), CancelNotices::local(), None, "test");
    let provisioner = Provisioner::new(runner, infra.clone(), "test-service");
    Env {
        nats,
        ledger,
        infra,
        provisioner,
        provider,
    }
}

impl Env {
    /// Boots one instance, successfully; its id and its operation's.
    async fn booted(&self) -> (Uuid, Uuid) {
        let instance = Uuid::now_v7();
        let report = self
            .provisioner
            .boot_instance(
                InstanceRequest {
                    instance_id: instance,
                    name: "web".into(),
                    resources: [("VCPU".to_string(), 2)].into(),
                    provider: self.provider,
                },
                None,
            )
            .await;
        assert!(report.result.is_ok(), "{:?}", report.result);
        (instance, report.operation_id)
    }

    /// Creates a two-node cluster, successfully.
    async fn cluster_created(&self) {
        let report = self
            .provisioner
            .create_cluster(ClusterRequest {
                cluster_id: Uuid::now_v7(),
                name: "analytics".into(),
                plugin: "vanilla".into(),
                node_groups: vec![NodeGroupSpec {
                    name: "workers".into(),
                    flavor: "m1.small".into(),
                    count: 2,
                    resources: [("VCPU".to_string(), 2)].into(),
                    processes: vec!["datanode".into()],
                }],
                provider: self.provider,
            })
            .await;
        assert!(report.result.is_ok(), "{:?}", report.result);
    }

    /// `provledger --nats URL --json drift ARGS`: its exit code and its JSON report.
    fn drift(&self, args: &[&str]) -> (i32, serde_json::Value) {
        let url = self.nats.url();
        let mut all = vec!["--nats", url.as_str(), "--json", "drift"];
        all.extend_from_slice(args);
        let out = provledger(&all, "");
        let report = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("drift printed no JSON report ({e}): {}", text(&out)));
        (out.status.code().unwrap_or(-1), report)
    }
}

fn findings(report: &serde_json::Value) -> Vec<serde_json::Value> {
    report["findings"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_successful_create_and_boot_report_no_drift() {
    // Given a cluster created and an instance booted, both successful
    let env = env().await;
    env.cluster_created().await;
    env.booted().await;
    // When drift compares every executor the ledger names
    let (code, report) = env.drift(&[]);
    // Then nothing is found, every executor was read, and it exits 0
    assert_eq!(
        findings(&report),
        Vec::<serde_json::Value>::new(),
        "{report:#}"
    );
    let names: Vec<&str> = report["executors"]
        .as_array()
        .expect("executors")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(
        names,
        ["dhcp", "dns", "hypervisor", "ipam", "plugin"],
        "{report:#}"
    );
    assert_eq!(code, 0, "{report:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_made_behind_the_ledgers_back_is_leaked() {
    // Given a booted instance, and a DNS record someone made by hand
    let env = env().await;
    env.booted().await;
    env.infra.dns.create_by_hand("rogue.example", "by hand");
    // When drift runs
    let (code, report) = env.drift(&[]);
    // Then that record, and only it, is leaked, with no operation behind it; exit 1
    let found = findings(&report);
    assert_eq!(found.len(), 1, "{report:#}");
    assert_eq!(found[0]["kind"], "leaked");
    assert_eq!(found[0]["executor"], "dns");
    assert_eq!(found[0]["resource"], "rogue.example");
    assert!(found[0]["operation_id"].is_null(), "{report:#}");
    assert_eq!(code, 1);
    // And the text form says what it is and what to do
    let url = env.nats.url();
    let out = provledger(&["--nats", url.as_str(), "drift"], "");
    let shown = text(&out);
    println!("{shown}");
    assert!(shown.contains("leaked     dns rogue.example"), "{shown}");
    assert!(
        shown.contains("  do:  made behind the ledger's back"),
        "{shown}"
    );
    assert_eq!(out.status.code(), Some(1), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_deleted_by_hand_is_missing_and_nothing_is_written() {
    // Given a booted instance whose VM someone deleted at the hypervisor
    let env = env().await;
    let (instance, boot) = env.booted().await;
    assert!(env.infra.hypervisor.remove_by_hand(&instance.to_string()));
    let end = env.ledger.log().last_position().await.expect("end");
    // When drift asks only the hypervisor
    let (code, report) = env.drift(&["--executor", "hypervisor"]);
    // Then the VM is missing, naming the instance, the boot and its step; exit 1
    let found = findings(&report);
    assert_eq!(found.len(), 1, "{report:#}");
    let f = &found[0];
    assert_eq!(f["kind"], "missing");
    assert_eq!(f["resource"], instance.to_string());
    assert_eq!(f["entity"], instance.to_string());
    assert_eq!(f["operation_id"], boot.to_string());
    assert_eq!(f["step"], format!("create_vm:{instance}"));
    assert_eq!(code, 1);
    // And nothing was written to the log
    assert_eq!(env.ledger.log().last_position().await.expect("end"), end);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ip_changed_by_hand_is_mismatched() {
    // Given a booted instance whose IP someone changed in IPAM (same key, another IP)
    let env = env().await;
    let (instance, boot) = env.booted().await;
    let ips = env.infra.ipam.resources();
    assert_eq!(ips.len(), 1, "{ips:?}");
    assert!(env.infra.ipam.rename_by_hand(&ips[0], "10.9.9.9"));
    // When drift runs
    let (code, report) = env.drift(&[]);
    // Then one mismatch: the ledger's IP against IPAM's, for the instance's acquire_ip
    let found = findings(&report);
    assert_eq!(found.len(), 1, "{report:#}");
    let f = &found[0];
    assert_eq!(f["kind"], "mismatched");
    assert_eq!(f["executor"], "ipam");
    assert_eq!(f["entity"], instance.to_string());
    assert_eq!(f["operation_id"], boot.to_string());
    assert_eq!(f["step"], format!("acquire_ip:{instance}"));
    assert_eq!(
        f["differences"],
        serde_json::json!([{"attr": "resource", "ledger": ips[0], "executor": "10.9.9.9"}])
    );
    assert_eq!(code, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fix_leaked_never_removes_what_the_ledger_recorded_even_under_another_key() {
    // Given a booted instance whose DNS record (made by the ledger's boot) was filed again
    // at DNS under another idempotency key,
    let env = env().await;
    env.booted().await;
    let records = env.infra.dns.resources();
    assert_eq!(records.len(), 1, "{records:?}");
    let name = records[0].clone();
    assert!(env.infra.dns.rekey_by_hand(&name, "imported-by-hand-0001"));
    // when drift --fix leaked runs with a reason,
    let (_, report) = env.drift(&[
        "--executor",
        "dns",
        "--fix",
        "leaked",
        "--reason",
        "cleanup",
    ]);
    // then the record is a mismatch (the ledger made it), never a leak, and it is still
    // held at DNS: nothing was sent to remove it.
    let found = findings(&report);
    assert!(found.iter().all(|f| f["kind"] != "leaked"), "{report:#}");
    assert!(
        found
            .iter()
            .any(|f| f["kind"] == "mismatched" && f["resource"] == name.as_str()),
        "{report:#}"
    );
    assert!(env.infra.dns.has(&name), "{report:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fix_leaked_removes_a_leaked_record_through_a_recorded_compensation() {
    // Given a booted instance, and a DNS record someone made by hand
    let env = env().await;
    env.booted().await;
    env.infra.dns.create_by_hand("rogue.example", "by hand");
    let end = env.ledger.log().last_position().await.expect("end");
    // When drift --fix leaked --dry-run runs
    let (code, report) = env.drift(&["--fix", "leaked", "--dry-run"]);
    // Then it plans the removal, writes nothing and asks nothing: the record is still there
    let removals = report["fix"]["removals"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(removals.len(), 1, "{report:#}");
    assert_eq!(removals[0]["resource"], "rogue.example");
    assert_eq!(removals[0]["compensation"]["action"], "unregister_dns");
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(env.ledger.log().last_position().await.expect("end"), end);
    assert!(env.infra.dns.has("rogue.example"));
    // And without a reason, a real fix is refused before anything is read or written
    let url = env.nats.url();
    let out = provledger(&["--nats", url.as_str(), "drift", "--fix", "leaked"], "");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--reason"), "{}", text(&out));
    // When drift --fix leaked runs with a reason
    let (code, report) = env.drift(&[
        "--fix",
        "leaked",
        "--reason",
        "ticket 42: checked, unused",
        "--actor",
        "alice",
    ]);
    // Then the record is gone at DNS, through a compensation request
    assert!(!env.infra.dns.has("rogue.example"), "{report:#}");
    assert_eq!(code, 0, "{report:#}");
    // And the ledger holds the removal: a remove_leaked operation, cancelled with the
    // reason and rolled back, whose one
    // step adopted the record as discovered and whose compensation is done, by alice
    let op = &report["fix"]["operation"];
    assert_eq!(op["kind"], "remove_leaked", "{report:#}");
    assert_eq!(op["status"], "cancelled", "{report:#}");
    assert_eq!(op["rollback_outcome"], "rolled_back", "{report:#}");
    let id: Uuid = op["id"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("the operation's id");
    let out = provledger(
        &[
            "--nats",
            url.as_str(),
            "--json",
            "history",
            &format!("operation/{id}"),
        ],
        "",
    );
    let history = text(&out);
    assert!(history.contains("\"discovered\""), "{history}");
    assert!(history.contains("compensation_done"), "{history}");
    assert!(history.contains("\"alice\""), "{history}");
    assert!(history.contains("ticket 42"), "{history}");
    // And drift is now clean, and audit finds nothing wrong with the removal
    let (code, report) = env.drift(&[]);
    assert_eq!(
        findings(&report),
        Vec::<serde_json::Value>::new(),
        "{report:#}"
    );
    assert_eq!(code, 0);
    let out = provledger(&["--nats", url.as_str(), "audit"], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// `q.drift`'s data, asked of serve.
async fn q_drift(client: &async_nats::Client) -> serde_json::Value {
    let reply = client
        .request("provledger.q.drift", "{}".into())
        .await
        .expect("q.drift answers");
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).expect("JSON");
    reply["data"].clone()
}

/// Polls `q.drift` until its last sweep satisfies `done`.
async fn sweep_until(
    client: &async_nats::Client,
    what: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let data = q_drift(client).await;
        if !data["last"].is_null() && done(&data["last"]) {
            return data;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no sweep {what}: {data:#}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_drift_sweep_reports_a_leak_in_q_drift_and_its_metrics_until_it_is_gone() {
    // Given a booted instance, and serve sweeping every second with metrics
    let env = env().await;
    env.booted().await;
    let dir = tempfile::tempdir().unwrap();
    let port = provledger_tests::free_port();
    let _serve = Serve::start_with(
        &env.nats,
        &dir.path().join("serve"),
        &[
            "--drift-interval",
            "1s",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
    );
    let client = env.nats.client().await;
    wait_ready(&client).await;
    // When a clean sweep has run, then someone makes a DNS record by hand
    let clean = sweep_until(&client, "clean", |last| {
        last["findings"] == serde_json::json!([])
    })
    .await;
    assert_eq!(clean["interval_s"], 1, "{clean:#}");
    env.infra.dns.create_by_hand("rogue.example", "by hand");
    // Then a later sweep reports it leaked, in q.drift and in the metrics
    let found = sweep_until(&client, "with the leak", |last| {
        last["findings"].as_array().is_some_and(|f| !f.is_empty())
    })
    .await;
    let findings = found["last"]["findings"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(findings.len(), 1, "{found:#}");
    assert_eq!(findings[0]["kind"], "leaked");
    assert_eq!(findings[0]["resource"], "rogue.example");
    let leaked = r#"provledger_drift_findings{executor="dns",kind="leaked"}"#;
    let scrape = http_get(port, "/metrics").expect("a scrape").1;
    assert_eq!(sample(&scrape, leaked), Some(1.0), "{scrape}");
    // And once it is removed, the next sweep is clean and the metric reads 0
    assert!(env.infra.dns.remove_by_hand("rogue.example"));
    sweep_until(&client, "clean again", |last| {
        last["findings"] == serde_json::json!([])
    })
    .await;
    let scrape = http_get(port, "/metrics").expect("a scrape").1;
    assert_eq!(sample(&scrape, leaked), Some(0.0), "{scrape}");
}

/// An executor named `name` that the ledger never named, on `client`: it answers
/// `provledger.exec.<name>.inventory` with one record, `rogue.example`, as a reference
/// executor would (its subscription is `provledger.exec.<name>.*`).
async fn unnamed_executor(client: async_nats::Client, name: &str) {
    use futures::StreamExt;
    let mut requests = client
        .subscribe(format!("provledger.exec.{name}.*"))
        .await
        .expect("the executor subscribes");
    // (a flush, not `subscriptions_in_effect`: an executor's account may not use inboxes;
    // who asks it is a process started after this, by which time the server has it)
    client.flush().await.expect("flush");
    tokio::spawn(async move {
        while let Some(request) = requests.next().await {
            let page = serde_json::json!({"items": [{"kind": "dns_record",
                "resource": "rogue.example", "key": null, "undo": "unregister_dns"}],
                "next": null});
            if let Some(reply) = request.reply {
                let _ = client.publish(reply, page.to_string().into()).await;
            }
        }
    });
}

fn discovered(report: &serde_json::Value) -> Vec<String> {
    report["discovery"]["discovered"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Like [`env`], but each simulated executor answers inventories on its own subject, as
/// deployed executors do (`env`'s answer for every name on one wildcard subscription, so
/// they would also answer, with an error, for a name that is not theirs).
async fn env_one_subscription_per_executor() -> Env {
    use futures::StreamExt;
    let nats = NatsServer::start().await;
    let (client, log) = provledger_client::open_jetstream(
        &nats.url(),
        "test",
        "PROVLEDGER",
        "provledger",
        1,
        &Default::default(),
    )
    .await
    .expect("jetstream");
    let ledger = provledger_client::Writer::new(provledger_client::Ledger::JetStream(log));
    let infra = Arc::new(SimInfrastructure::default());
    for i in 0..infra.all().len() {
        let subject = format!("provledger.exec.{}.inventory", infra.all()[i].name());
        let mut requests = client.subscribe(subject).await.expect("subscribe");
        let (infra, client) = (infra.clone(), client.clone());
        tokio::spawn(async move {
            while let Some(request) = requests.next().await {
                let asked: provledger_client::inventory::InventoryRequest =
                    serde_json::from_slice(&request.payload).expect("an inventory request");
                let page = infra.all()[i].inventory_page(&asked);
                let body = serde_json::to_vec(&page).expect("a page");
                if let Some(reply) = request.reply {
                    let _ = client.publish(reply, body.into()).await;
                }
            }
        });
    }
    provledger_tests::subscriptions_in_effect(&client).await;
    let provider = Uuid::now_v7();
    provledger_sim::register_compute_node(&ledger, provider, "cn", 256, "test")
        .await
        .expect("a compute node");
    let runner = OperationRunner::new(ledger.clone(), CancelNotices::local(), None, "test");
    let provisioner = Provisioner::new(runner, infra.clone(), "test-service");
    Env {
        nats,
        ledger,
        infra,
        provisioner,
        provider,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leak_at_an_executor_the_ledger_never_named_is_found() {
    // Given a booted instance (the ledger names the executors it used), each executor on
    // its own subscription, and a running executor `rogue-dns`, never named by any
    // commit, holding a record
    let env = env_one_subscription_per_executor().await;
    env.booted().await;
    unnamed_executor(env.nats.client().await, "rogue-dns").await;
    // When drift runs without --executor
    let (code, report) = env.drift(&[]);
    // Then it discovered rogue-dns (and plugin, running but not used by a boot), asked
    // them, and found rogue-dns's record leaked; exit 1
    assert_eq!(discovered(&report), ["plugin", "rogue-dns"], "{report:#}");
    let rogue: Vec<&serde_json::Value> = report["executors"]
        .as_array()
        .expect("executors")
        .iter()
        .filter(|e| e["name"] == "rogue-dns")
        .collect();
    assert_eq!(
        rogue,
        [&serde_json::json!({"name": "rogue-dns", "held": 1, "discovered": true})],
        "{report:#}"
    );
    let found = findings(&report);
    assert_eq!(found.len(), 1, "{report:#}");
    assert_eq!(found[0]["kind"], "leaked");
    assert_eq!(found[0]["executor"], "rogue-dns");
    assert_eq!(found[0]["resource"], "rogue.example");
    assert_eq!(code, 1, "{report:#}");
    // And the text says whom it asked, which it discovered, and the leak
    let url = env.nats.url();
    let out = provledger(&["--nats", url.as_str(), "drift"], "");
    let shown = text(&out);
    assert!(
        shown.contains(
            "asked 6 executor(s): 4 named by the ledger, 2 discovered (plugin, rogue-dns)"
        ),
        "{shown}"
    );
    assert!(
        shown.contains("rogue-dns: 1 held (discovered: the ledger does not name it)"),
        "{shown}"
    );
    assert!(
        shown.contains("leaked     rogue-dns rogue.example"),
        "{shown}"
    );
    assert_eq!(out.status.code(), Some(1), "{shown}");
    // And --executor asks only the one named: no discovery
    let (code, report) = env.drift(&["--executor", "dns"]);
    assert!(report["discovery"].is_null(), "{report:#}");
    assert_eq!(findings(&report), Vec::<serde_json::Value>::new());
    assert_eq!(code, 0, "{report:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_deployed_accounts_the_writer_discovers_an_executor() {
    // Given nats-server with deploy/nats/accounts.conf, an empty embedded ledger, and the
    // executor `compute` connected as its own user (it may only receive
    // provledger.exec.compute.> and answer), holding a record
    let nats = NatsServer::start_hardened(true, false).await;
    let dir = tempfile::tempdir().expect("tempdir");
    unnamed_executor(nats.client_as("executor-compute").await, "compute").await;
    // When drift runs as the designated writer
    let data = dir.path().join("ledger");
    drop(provledger_events::SledLog::open(&data).expect("an empty data dir"));
    let url = nats.url_as("writer");
    let out = provledger(
        &[
            "--data-dir",
            data.to_str().expect("utf-8"),
            "--json",
            "drift",
            "--executors-url",
            url.as_str(),
        ],
        "",
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("no JSON report ({e}): {}", text(&out)));
    // Then its discovery request was allowed, compute was discovered and its record leaked
    assert_eq!(discovered(&report), ["compute"], "{report:#}");
    let found = findings(&report);
    assert_eq!(found.len(), 1, "{report:#}");
    assert_eq!(
        (&found[0]["kind"], &found[0]["executor"]),
        (&"leaked".into(), &"compute".into()),
        "{report:#}"
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let refused: Vec<String> = nats
        .log()
        .lines()
        .filter(|l| l.contains("Violation"))
        .map(str::to_string)
        .collect();
    assert!(refused.is_empty(), "{refused:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_discovery_responder_is_bounded() {
    // Given a ledger naming the executors of a boot, and a client that answers every discovery
    // request 2,000 times with forged connection lists: 100 well-formed executor names
    // each (200,000 in all), and names full of control characters and markup
    let env = env().await;
    env.booted().await;
    let hostile = hostile_discovery_responder(&env.nats).await;
    // When drift runs (again, a few times at most, while only the server's own reply came:
    // discovery ends DISCOVERY_QUIET after the last reply, and on a loaded machine the
    // responder's first reply can come later than that; the suite failed so once)
    let (code, report, took) = until_the_responder_answered(
        || {
            let started = std::time::Instant::now();
            let (code, report) = env.drift(&[]);
            (code, report, started.elapsed())
        },
        |(_, report, _)| report["discovery"]["servers"].as_u64() != Some(1),
    );
    // Then it ends (bounded in time, not waiting for all replies): it read at most
    // DISCOVERY_REPLIES_MAX replies, asked at most DISCOVERED_EXECUTORS_MAX discovered
    // executors, listed at most DISCOVERY_REJECTED_LISTED_MAX forged names and counted
    // the rest
    assert!(took < std::time::Duration::from_secs(60), "took {took:?}");
    let discovery = &report["discovery"];
    assert!(discovery["servers"].as_u64() <= Some(32), "{discovery:#}");
    assert_eq!(discovered(&report).len(), 64, "{discovery:#}");
    assert!(discovery["not_asked"].as_u64() > Some(0), "{discovery:#}");
    let rejected = discovery["rejected"].as_array().expect("rejected");
    assert!(
        !rejected.is_empty() && rejected.len() <= 10,
        "{discovery:#}"
    );
    assert!(
        discovery["rejected_not_listed"].as_u64() > Some(0),
        "{discovery:#}"
    );
    let asked = report["executors"].as_array().expect("executors");
    let flagged = asked.iter().filter(|e| e["discovered"] == true).count();
    assert_eq!(flagged, 64, "{report:#}");
    // And no forged name was turned into a subject: every name asked follows the grammar
    for name in asked.iter().filter_map(|e| e["name"].as_str()) {
        assert!(
            provledger_events::catalogue::operation::executor_name_is_valid(name),
            "{name:?} was asked"
        );
    }
    // And it says the comparison is incomplete: exit 3
    assert!(
        discovery["incomplete"]
            .as_array()
            .is_some_and(|i| !i.is_empty()),
        "{discovery:#}"
    );
    assert_eq!(code, 3, "{report:#}");
    // And the text form prints no forged name raw: control characters come escaped
    hostile.abort();
    let _hostile = hostile_discovery_responder(&env.nats).await;
    let url = env.nats.url();
    // (again while the responder's replies came too late, as above)
    let (out, shown) = until_the_responder_answered(
        || {
            let out = provledger(&["--nats", url.as_str(), "drift"], "");
            let shown = text(&out);
            (out, shown)
        },
        |(_, shown)| shown.contains("is not an executor name"),
    );
    assert!(
        !shown.contains('\u{1b}') && !shown.contains('\u{7}'),
        "a raw control character was printed"
    );
    assert!(shown.contains("\\u{1b}[2J\\u{7}<script>"), "{shown}");
    assert!(
        shown.contains("is not an executor name: not asked"),
        "{shown}"
    );
    assert_eq!(out.status.code(), Some(3), "{shown}");
}

/// `run` (a drift), again while `answered` says the hostile responder's replies were not in
/// it, five times at most: discovery ends DISCOVERY_QUIET after the last reply, and on a
/// loaded machine the responder's first reply can come later than that.
fn until_the_responder_answered<T>(mut run: impl FnMut() -> T, answered: impl Fn(&T) -> bool) -> T {
    let mut last = run();
    for _ in 1..5 {
        if answered(&last) {
            break;
        }
        last = run();
    }
    last
}

/// A client that answers every discovery request 2,000 times with forged connection lists:
/// 100 well-formed executor names each (200,000 in all), and a name full of control
/// characters and markup. Each request is answered on a task of its own, so that a drift
/// run again finds its first reply at once, not behind the 2,000 of an earlier run (which
/// took every retry of the suite's run that failed so). Aborting the task ends them all.
async fn hostile_discovery_responder(nats: &NatsServer) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let hostile = nats.client().await;
    let mut asks = hostile
        .subscribe("$SYS.REQ.ACCOUNT.PING.CONNZ")
        .await
        .expect("subscribe");
    provledger_tests::subscriptions_in_effect(&hostile).await;
    tokio::spawn(async move {
        // Dropped with this task when it is aborted, which aborts every flood in it.
        let mut floods = tokio::task::JoinSet::new();
        while let Some(ask) = asks.next().await {
            let Some(reply) = ask.reply else { continue };
            let hostile = hostile.clone();
            floods.spawn(async move { flood(&hostile, reply).await });
        }
    })
}

/// Answers one discovery request with the hostile responder's 2,000 forged replies.
async fn flood(hostile: &async_nats::Client, reply: async_nats::Subject) {
    for i in 0..2_000 {
        let mut subs: Vec<String> = (0..100)
            .map(|j| format!("provledger.exec.forged-{i}-{j}.inventory"))
            .collect();
        subs.push(format!(
            "provledger.exec.\u{1b}[2J\u{7}<script>alert({i})</script>.inventory"
        ));
        let forged = serde_json::json!({"data": {"connections": [
            {"subscriptions_list": subs}]}});
        if hostile
            .publish(reply.clone(), forged.to_string().into())
            .await
            .is_err()
        {
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_drift_sweep_finds_a_leak_at_an_executor_the_ledger_never_named() {
    // Given a booted instance, each executor on its own subscription, serve sweeping
    // every second, and a running executor `rogue-dns` no commit names, holding a record
    let env = env_one_subscription_per_executor().await;
    env.booted().await;
    unnamed_executor(env.nats.client().await, "rogue-dns").await;
    let dir = tempfile::tempdir().unwrap();
    let port = provledger_tests::free_port();
    let _serve = Serve::start_with(
        &env.nats,
        &dir.path().join("serve"),
        &[
            "--drift-interval",
            "1s",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ],
    );
    let client = env.nats.client().await;
    wait_ready(&client).await;
    // When a sweep has run
    let found = sweep_until(&client, "with the leak", |last| {
        last["findings"].as_array().is_some_and(|f| !f.is_empty())
    })
    .await;
    // Then it asked rogue-dns too and reports its record leaked, in q.drift and metrics
    let last = &found["last"];
    assert!(
        last["executors"]
            .as_array()
            .is_some_and(|e| e.iter().any(|e| e["name"] == "rogue-dns" && e["held"] == 1)),
        "{found:#}"
    );
    let findings = last["findings"].as_array().cloned().unwrap_or_default();
    assert_eq!(findings.len(), 1, "{found:#}");
    assert_eq!(
        (&findings[0]["executor"], &findings[0]["resource"]),
        (&"rogue-dns".into(), &"rogue.example".into()),
        "{found:#}"
    );
    let leaked = r#"provledger_drift_findings{executor="rogue-dns",kind="leaked"}"#;
    let scrape = http_get(port, "/metrics").expect("a scrape").1;
    assert_eq!(sample(&scrape, leaked), Some(1.0), "{scrape}");
}
