//! Placement through the `provledger` binary, embedded on real sled files and against a
//! private nats-server: a provider delete refused and naming each consumer with why it is
//! there, the cascade, heal-allocations and its dry run, and the orphan fix.

use std::process::Output;

use provledger_tests::NatsServer;
use serde_json::{json, Value};

use crate::common;
use crate::common::{ask, provledger, text};

const P: &str = "0190c0de-0000-7000-8000-00000000aa01";
const Q: &str = "0190c0de-0000-7000-8000-00000000aa02";
/// An instance running on P.
const I1: &str = "0190c0de-0000-7000-8000-00000000bb01";
/// An instance evacuated from P to Q, whose source allocation on P stayed.
const I2: &str = "0190c0de-0000-7000-8000-00000000bb02";
/// An instance on P whose allocation is missing (heal-allocations' case).
const I3: &str = "0190c0de-0000-7000-8000-00000000bb03";
/// A migration in progress, holding its source on P.
const M: &str = "0190c0de-0000-7000-8000-00000000cc01";

struct Ledger {
    global: Vec<String>,
}

impl Ledger {
    fn run(&self, args: &[&str], stdin: &str) -> Output {
        let all: Vec<String> = self
            .global
            .iter()
            .cloned()
            .chain(args.iter().map(|s| s.to_string()))
            .collect();
        provledger(&all, stdin)
    }

    fn append(&self, aggregate: &str, events: Value) {
        let out = self.run(
            &["append", aggregate, "--expect", "any", "--events", "-"],
            &events.to_string(),
        );
        assert_eq!(out.status.code(), Some(0), "{aggregate}: {}", text(&out));
    }

    fn json(&self, args: &[&str]) -> (Option<i32>, Value) {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.run(&all, "");
        let value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (out.status.code(), value)
    }

    fn version(&self, aggregate: &str) -> u64 {
        let (code, v) = self.json(&["state", aggregate]);
        assert_eq!(code, Some(0), "{v}");
        v["state"]["version"].as_u64().unwrap()
    }
}

fn vcpus(total: u64) -> Value {
    json!({"inventory_set": {"resource_class": "VCPU", "inventory": {
        "total": total, "reserved": 0, "allocation_ratio": 1.0,
        "min_unit": 1, "max_unit": total, "step_size": 1}}})
}

fn claim(consumer: &str, kind: &str, n: u64) -> Value {
    json!([{"allocation_claimed": {"consumer": consumer, "consumer_kind": kind, "resources": {"VCPU": n}}}])
}

/// The events that register provider `name` (its host too) with `total` VCPUs and claim
/// one of them for each of `consumers`, as instances.
fn registered_holding(name: &str, total: u64, consumers: &[String]) -> Value {
    let mut events = vec![
        json!({"provider_registered": {"name": name, "host": name}}),
        vcpus(total),
    ];
    for c in consumers {
        events.extend(
            claim(c, "instance", 1)
                .as_array()
                .cloned()
                .unwrap_or_default(),
        );
    }
    Value::Array(events)
}

fn instance_on(name: &str, provider: &str) -> Value {
    json!([
        {"instance_create_requested": {"name": name, "cluster_id": null, "node_group": null,
            "flavor": "m1", "resources": {"VCPU": 2}, "image": "img"}},
        {"host_assigned": {"host": "cn-p", "provider_id": provider}},
        {"task_finished": {"task_state": "scheduling", "outcome": "succeeded", "reason": ""}},
        {"vm_state_changed": {"vm_state": "active", "reason": ""}}
    ])
}

/// Given: P holds an instance's allocation, an unconfirmed migration's source and an
/// evacuated instance's residue; Q holds the evacuated instance; I3 runs on P without an
/// allocation.
fn given_a_compute_node_with_every_kind_of_consumer(ledger: &Ledger) {
    for (id, host) in [(P, "cn-p"), (Q, "cn-q")] {
        ledger.append(
            &format!("provider/{id}"),
            json!([{"provider_registered": {"name": host, "host": host}}, vcpus(16)]),
        );
    }
    ledger.append(&format!("instance/{I1}"), instance_on("i1", P));
    ledger.append(&format!("instance/{I2}"), instance_on("i2", Q));
    ledger.append(&format!("instance/{I3}"), instance_on("i3", P));
    ledger.append(&format!("provider/{P}"), claim(I1, "instance", 2));
    ledger.append(&format!("provider/{P}"), claim(M, "migration", 2));
    ledger.append(&format!("provider/{P}"), claim(I2, "instance", 2));
    ledger.append(&format!("provider/{Q}"), claim(I2, "instance", 2));
}

fn delete_is_refused_naming_each_consumer_then_cascades(ledger: &Ledger) {
    given_a_compute_node_with_every_kind_of_consumer(ledger);
    let before = ledger.version(&format!("provider/{P}"));

    // When the provider is deleted without --cascade, it is refused (exit 1), each
    // consumer named with why it is there, and nothing is written.
    let out = ledger.run(&["provider", "delete", P], "");
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("NOT deleted"), "{said}");
    assert!(
        said.contains(&format!("instance {I1} (instance)")),
        "{said}"
    );
    assert!(
        said.contains(&format!("migration {M} (unconfirmed_migration)")),
        "{said}"
    );
    assert!(
        said.contains(&format!("instance {I2} (evacuation_residue)")),
        "{said}"
    );
    assert!(said.contains("nothing was written"), "{said}");
    assert_eq!(ledger.version(&format!("provider/{P}")), before);

    // With --cascade: every allocation released with its reason, then the provider goes.
    let (code, v) = ledger.json(&["provider", "delete", P, "--cascade"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["providers"][0]["outcome"], "deleted", "{v}");
    assert_eq!(v["providers"][0]["released"].as_array().unwrap().len(), 3);
    let (_, state) = ledger.json(&["state", &format!("provider/{P}")]);
    assert_eq!(state["state"]["status"], "deleted", "{state}");
    assert_eq!(state["state"]["allocations"], json!([]));
    // The evacuated instance keeps its allocation on Q.
    let (_, q) = ledger.json(&["state", &format!("provider/{Q}")]);
    assert_eq!(
        q["state"]["allocations"].as_array().unwrap().len(),
        1,
        "{q}"
    );
    // A re-run says so and writes nothing.
    let (code, v) = ledger.json(&["provider", "delete", P, "--cascade"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["providers"][0]["outcome"], "already_deleted");
}

#[test]
fn provider_delete_embedded() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger {
        global: vec!["--data-dir".into(), dir.path().to_str().unwrap().into()],
    };
    delete_is_refused_naming_each_consumer_then_cascades(&ledger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_delete_against_nats() {
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger {
        global: vec![
            "--nats".into(),
            server.url(),
            "--data-dir".into(),
            dir.path().to_str().unwrap().into(),
        ],
    };
    tokio::task::spawn_blocking(move || {
        delete_is_refused_naming_each_consumer_then_cascades(&ledger)
    })
    .await
    .unwrap();
}

#[test]
fn heal_allocations_dry_run_writes_nothing_then_heals_with_nova_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger {
        global: vec!["--data-dir".into(), dir.path().to_str().unwrap().into()],
    };
    given_a_compute_node_with_every_kind_of_consumer(&ledger);
    let before = ledger.version(&format!("provider/{P}"));

    // Given I3 on P with no allocation: the dry run says it would claim, and writes nothing.
    let (code, v) = ledger.json(&["heal-allocations", "--dry-run"]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["healed"], json!([[I3, P]]), "{v}");
    assert_eq!(
        ledger.version(&format!("provider/{P}")),
        before,
        "dry run wrote"
    );

    // The real run claims it (exit 0); the next finds nothing to do (exit 4).
    let (code, v) = ledger.json(&["heal-allocations", "--instance", I3]);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(ledger.version(&format!("provider/{P}")), before + 1);
    let (code, v) = ledger.json(&["heal-allocations"]);
    assert_eq!(code, Some(4), "{v}");

    // An instance whose host is full cannot be healed: exit 1, named.
    const I4: &str = "0190c0de-0000-7000-8000-00000000bb04";
    ledger.append(
        &format!("provider/{Q}"),
        json!([{"allocation_claimed": {"consumer": "0190c0de-0000-7000-8000-00000000dd01",
            "consumer_kind": "instance", "resources": {"VCPU": 14}}}]),
    );
    ledger.append(&format!("instance/{I4}"), instance_on("i4", Q));
    let out = ledger.run(&["heal-allocations", "--instance", I4], "");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("instance {I4}: NOT healed")),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("over capacity"), "{}", text(&out));
}

#[test]
fn audit_fix_orphans_releases_only_the_orphans() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger {
        global: vec!["--data-dir".into(), dir.path().to_str().unwrap().into()],
    };
    given_a_compute_node_with_every_kind_of_consumer(&ledger);
    // Given I1 deleted while its allocation stayed (an orphan), and an allocation of an
    // instance that was never recorded (another)...
    ledger.append(
        &format!("instance/{I1}"),
        json!([{"instance_delete_requested": {"reason": "user"}}, {"instance_deleted": {}}]),
    );
    ledger.append(
        &format!("provider/{Q}"),
        claim("0190c0de-0000-7000-8000-00000000ee01", "instance", 1),
    );
    let (code, v) = ledger.json(&["audit"]);
    assert_eq!(code, Some(1), "{v}");
    let orphans = v["violations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["check"] == "orphan_allocation")
        .count();
    assert_eq!(orphans, 2, "{v}");

    // ...when fixed, only those two go: the migration, the residue and I2 on Q stay.
    let out = ledger.run(&["audit", "--fix-orphans"], "");
    let said = text(&out);
    assert!(said.contains(&format!("instance {I1}")), "{said}");
    let (_, p) = ledger.json(&["state", &format!("provider/{P}")]);
    let left: Vec<&str> = p["state"]["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["consumer"].as_str().unwrap())
        .collect();
    assert_eq!(left.len(), 2, "{p}");
    assert!(left.contains(&M) && left.contains(&I2), "{left:?}");
    let (_, q) = ledger.json(&["state", &format!("provider/{Q}")]);
    assert_eq!(
        q["state"]["allocations"].as_array().unwrap().len(),
        1,
        "{q}"
    );
    let (code, v) = ledger.json(&["audit"]);
    assert!(
        v["violations"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["check"] != "orphan_allocation"),
        "{v}"
    );
    let _ = code;
}

#[test]
fn an_inventory_below_usage_is_refused_unless_forced_and_then_audited_over_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger {
        global: vec!["--data-dir".into(), dir.path().to_str().unwrap().into()],
    };
    given_a_compute_node_with_every_kind_of_consumer(&ledger);
    let before = ledger.version(&format!("provider/{P}"));
    // P holds 6 VCPU; shrinking it to 4 is refused, nothing written...
    let shrink = json!([vcpus(4)]).to_string();
    let out = ledger.run(
        &[
            "append",
            &format!("provider/{P}"),
            "--expect",
            "any",
            "--events",
            "-",
        ],
        &shrink,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("below the 6 in use"), "{}", text(&out));
    assert_eq!(ledger.version(&format!("provider/{P}")), before);
    // ...unless forced, and then the audit reports it over capacity.
    let out = ledger.run(
        &[
            "append",
            &format!("provider/{P}"),
            "--expect",
            "any",
            "--force",
            "--events",
            "-",
        ],
        &shrink,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let (code, v) = ledger.json(&["audit"]);
    assert_eq!(code, Some(1), "{v}");
    assert!(
        v["violations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["check"] == "provider_capacity"
                && x["problem"]
                    .as_str()
                    .unwrap()
                    .contains("used 6 > capacity 4")),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_over_nats_for_services_not_written_in_rust() {
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = common::Serve::start(&server, &dir.path().join("serve"));
    let client = server.client().await;
    common::wait_ready(&client).await;
    let url = server.url();
    let data = dir.path().join("cli");
    tokio::task::spawn_blocking(move || {
        let ledger = Ledger {
            global: vec![
                "--nats".into(),
                url,
                "--data-dir".into(),
                data.to_str().unwrap().into(),
            ],
        };
        given_a_compute_node_with_every_kind_of_consumer(&ledger);
    })
    .await
    .unwrap();

    // A plain delete is refused with every hold, named and explained.
    let refused = ask(&client, "provledger.cmd.provider.delete", json!({"id": P})).await;
    assert_eq!(refused["error"]["code"], "conflict", "{refused}");
    assert_eq!(refused["error"]["reason"], "allocations_remain");
    let kinds: Vec<&str> = refused["error"]["holds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["hold"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.len(), 3, "{refused}");
    for kind in ["instance", "unconfirmed_migration", "evacuation_residue"] {
        assert!(kinds.contains(&kind), "{kind} missing: {refused}");
    }
    // heal-allocations, dry: I3 would be claimed on P.
    let healed = ask(
        &client,
        "provledger.cmd.heal_allocations",
        json!({"dry_run": true}),
    )
    .await;
    assert_eq!(healed["data"]["healed"], json!([[I3, P]]), "{healed}");
    // No orphans yet; providers listed.
    let orphans = ask(
        &client,
        "provledger.cmd.fix_orphans",
        json!({"dry_run": true}),
    )
    .await;
    assert_eq!(orphans["data"]["orphans"], json!([]), "{orphans}");
    let mut listed = json!(null);
    for _ in 0..100 {
        listed = ask(&client, "provledger.q.provider.list", json!({})).await;
        if listed["data"].as_array().is_some_and(|a| a.len() == 2) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(listed["data"].as_array().map(Vec::len), Some(2), "{listed}");
    // The cascade deletes it.
    let deleted = ask(
        &client,
        "provledger.cmd.provider.delete",
        json!({"id": P, "cascade": true}),
    )
    .await;
    assert_eq!(deleted["data"]["outcome"], "deleted", "{deleted}");
    assert_eq!(deleted["data"]["released"].as_array().unwrap().len(), 3);
}

#[test]
fn a_compute_service_with_many_providers_is_deleted_provider_by_provider() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger {
        global: vec!["--data-dir".into(), dir.path().to_str().unwrap().into()],
    };
    // Given three ironic nodes on one host, two of them holding an allocation...
    let nodes = [
        "0190c0de-0000-7000-8000-0000000ff001",
        "0190c0de-0000-7000-8000-0000000ff002",
        "0190c0de-0000-7000-8000-0000000ff003",
    ];
    for (i, node) in nodes.iter().enumerate() {
        ledger.append(
            &format!("provider/{node}"),
            json!([{"provider_registered": {"name": format!("node{i}"), "host": "ironic-1"}}, vcpus(4)]),
        );
    }
    ledger.append(&format!("provider/{}", nodes[0]), claim(I1, "instance", 4));
    ledger.append(&format!("provider/{}", nodes[2]), claim(I2, "instance", 4));
    // ...without --cascade the nodes holding one are refused (exit 1; the empty one goes)...
    let out = ledger.run(&["provider", "delete", "--host", "ironic-1"], "");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    // ...with it, every node goes, each released then deleted, none orphaned.
    let (code, v) = ledger.json(&["provider", "delete", "--host", "ironic-1", "--cascade"]);
    assert_eq!(code, Some(0), "{v}");
    for node in nodes {
        let (_, state) = ledger.json(&["state", &format!("provider/{node}")]);
        assert_eq!(state["state"]["status"], "deleted", "{node}: {state}");
        assert_eq!(state["state"]["allocations"], json!([]));
    }
    let (code, v) = ledger.json(&["audit"]);
    assert_eq!(code, Some(0), "{v}");
}

/// Given a provider whose cascade delete died after its first commit (the delete recorded,
/// one of its three allocations released: what a kill -9 between two of a large cascade's
/// commits leaves), when serve starts with its sweep on, then serve itself finishes it:
/// the provider deleted, each allocation released exactly once, the log clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_finishes_a_cascade_delete_it_finds_half_done() {
    const PROVIDER: &str = "0190c0de-0000-7000-8000-0000000ca5c0";
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let client = server.client().await;
    let _serve = common::Serve::start_sweeping(&server, &dir.path().join("serve"));
    common::wait_ready(&client).await;
    let consumers: Vec<String> = (1..=3)
        .map(|i| format!("0190c0de-0000-7000-8000-00000000c00{i}"))
        .collect();
    let append = |events: Value| json!({"aggregate": format!("provider/{PROVIDER}"), "expect": "any", "events": events});
    let reply = ask(
        &client,
        "provledger.cmd.append",
        append(registered_holding("cn-9", 8, &consumers)),
    )
    .await;
    assert!(reply["error"].is_null(), "{reply}");
    let reply = ask(
        &client,
        "provledger.cmd.append",
        append(json!([
            {"provider_delete_requested": {"cascade": true, "reason": "deleted with --cascade"}},
            {"allocation_released": {"consumer": consumers[0], "reason": "provider deleted with --cascade: instance"}}
        ])),
    )
    .await;
    assert!(reply["error"].is_null(), "{reply}");

    provider_deleted_within(&client, PROVIDER, 20).await;
    let history = ask(
        &client,
        "provledger.q.history",
        json!({"aggregate": format!("provider/{PROVIDER}")}),
    )
    .await;
    let text = history["data"].to_string();
    for c in &consumers {
        assert_eq!(
            text.matches(&format!("\"consumer\":\"{c}\"")).count(),
            2,
            "{c}: claimed once and released once: {history}"
        );
    }
}

/// Given a provider holding 2,048 allocations (eight commits of a cascade) and serve
/// sweeping every second; when `provider delete --cascade` is killed with SIGKILL as soon
/// as its first commit is in the log; then serve finishes the cascade by itself: the
/// provider deleted, each allocation released exactly once, audit clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascade_killed_half_way_is_finished_by_serve_with_each_release_once() {
    const PROVIDER: &str = "0190c0de-0000-7000-8000-0000000ca5c1";
    const ALLOCATIONS: usize = 2_048;
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let client = server.client().await;
    let _serve = common::Serve::start_sweeping(&server, &dir.path().join("serve"));
    common::wait_ready(&client).await;
    let aggregate = format!("provider/{PROVIDER}");
    let reply = ask(
        &client,
        "provledger.cmd.append",
        json!({"aggregate": aggregate, "expect": "none", "events": [
            {"provider_registered": {"name": "cn-8", "host": "cn-8"}}, vcpus(4096)]}),
    )
    .await;
    assert!(reply["error"].is_null(), "{reply}");
    let consumers: Vec<String> = (0..ALLOCATIONS)
        .map(|i| format!("0190c0de-0000-7000-8000-00000c{i:06x}"))
        .collect();
    for chunk in consumers.chunks(64) {
        let events: Vec<Value> = chunk
            .iter()
            .flat_map(|c| {
                claim(c, "instance", 1)
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .collect();
        let reply = ask(
            &client,
            "provledger.cmd.append",
            json!({"aggregate": aggregate, "expect": "any", "events": events}),
        )
        .await;
        assert!(reply["error"].is_null(), "{reply}");
    }
    let log = common::stream(&server).await;
    let provider = provledger_events::AggregateId::provider(PROVIDER.parse().unwrap());

    let cli_dir = dir.path().join("cli");
    let mut cascade = std::process::Command::new(env!("CARGO_BIN_EXE_provledger"))
        .args(["--nats", &server.url(), "--data-dir"])
        .arg(&cli_dir)
        .args(["provider", "delete", PROVIDER, "--cascade"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn provledger provider delete");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while common::releases_by_consumer(&log, provider)
        .await
        .is_empty()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the cascade never started"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    let _ = cascade.kill(); // SIGKILL
    let _ = cascade.wait();
    let at_kill = common::releases_by_consumer(&log, provider).await.len();
    eprintln!("{at_kill} of {ALLOCATIONS} allocations released when the cascade was killed");

    provider_deleted_within(&client, PROVIDER, 60).await;
    let all = common::releases_by_consumer(&log, provider).await;
    assert_eq!(all.len(), ALLOCATIONS);
    assert!(
        all.values().all(|n| *n == 1),
        "an allocation released twice"
    );
    let (url, d) = (server.url(), dir.path().join("audit"));
    let out = tokio::task::spawn_blocking(move || {
        provledger(
            &[
                "--nats",
                &url,
                "--data-dir",
                d.to_str().unwrap(),
                "--json",
                "audit",
            ],
            "",
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// Waits until serve shows `provider` deleted, with no anomaly, within `secs` seconds.
async fn provider_deleted_within(client: &async_nats::Client, provider: &str, secs: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        let p = ask(client, "provledger.q.provider.get", json!({"id": provider})).await;
        if p["data"]["status"] == "deleted" {
            assert_eq!(p["data"]["anomaly_count"], 0, "{p}");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not deleted within {secs} s: {}",
            p["data"]["status"]
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Given a provider holding 5 allocations, claimed in an order that is not their consumer
/// order; when `q.provider.get` is asked for parts of 2, each going on after the last
/// consumer of the one before; then the parts hold the 5 in consumer order, each once, each
/// with the total, the last part fewer than 2; the whole view is unchanged without paging;
/// and paging a kind that has no allocations is refused, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_allocations_are_read_in_parts_going_on_after_the_last_consumer() {
    const PROVIDER: &str = "0190c0de-0000-7000-8000-0000000ca5e1";
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let client = server.client().await;
    let _serve = common::Serve::start(&server, &dir.path().join("serve"));
    common::wait_ready(&client).await;
    let aggregate = format!("provider/{PROVIDER}");
    let consumers: Vec<String> = [4, 1, 5, 3, 2]
        .iter()
        .map(|i| format!("0190c0de-0000-7000-8000-00000d00000{i}"))
        .collect();
    let reply = ask(
        &client,
        "provledger.cmd.append",
        json!({"aggregate": aggregate, "expect": "none",
               "events": registered_holding("pool-1", 64, &consumers)}),
    )
    .await;
    assert!(reply["error"].is_null(), "{reply}");
    let position = reply["data"]["position"].clone();

    let mut read = Vec::new();
    let mut after: Option<String> = None;
    let mut parts = 0;
    loop {
        let mut request = json!({"id": PROVIDER, "parts_limit": 2, "min_position": position});
        if let Some(a) = &after {
            request["allocations_after"] = json!(a);
        }
        let p = ask(&client, "provledger.q.provider.get", request).await;
        assert!(p["error"].is_null(), "{p}");
        assert_eq!(p["data"]["allocations_total"], 5, "{p}");
        let part: Vec<String> = p["data"]["allocations"]
            .as_array()
            .expect("allocations")
            .iter()
            .map(|a| a["consumer"].as_str().expect("consumer").to_string())
            .collect();
        assert!(part.len() <= 2, "{p}");
        parts += 1;
        read.extend(part.iter().cloned());
        if part.len() < 2 {
            break;
        }
        after = part.last().cloned();
        assert!(parts < 10, "paging does not end: {read:?}");
    }
    let mut expected = consumers.clone();
    expected.sort();
    assert_eq!(read, expected);
    assert_eq!(parts, 3);

    let whole = ask(
        &client,
        "provledger.q.provider.get",
        json!({"id": PROVIDER, "min_position": position}),
    )
    .await;
    assert_eq!(
        whole["data"]["allocations"].as_array().map(Vec::len),
        Some(5),
        "{whole}"
    );
    assert!(whole["data"].get("allocations_total").is_none(), "{whole}");

    let refused = ask(
        &client,
        "provledger.q.cluster.get",
        json!({"id": PROVIDER, "allocations_after": consumers[0]}),
    )
    .await;
    assert_eq!(refused["error"]["code"], "bad_request", "{refused}");
    assert!(
        refused["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("allocations_after")),
        "{refused}"
    );
}
