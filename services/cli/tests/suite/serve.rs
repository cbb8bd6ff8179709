//! `provledger serve` as a child process against a private nats-server: every endpoint,
//! read-your-writes and `stale`, a provider at capacity, quarantined garbage, two
//! replicas in one queue group, SIGTERM drain, and SIGKILL during a load.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use proptest::strategy::{Strategy, ValueTree};
use provledger_events::catalogue::{samples, NodeGroupSpec};
use provledger_events::catalogue::{ClusterStatus, ConsumerKind};
use provledger_events::{
    AggregateId, CommitDraft, Event, EventLog, Expectation, JetStreamConfig, JetStreamLog,
};
use provledger_projections::Projection;
use provledger_tests::{script, NatsServer};

use crate::common;
use crate::common::Serve;
use serde_json::{json, Value};
use uuid::Uuid;

async fn open_log(nats: &NatsServer) -> JetStreamLog {
    JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("open JetStream log")
}

/// One request; the reply parsed, with the error headers when present.
async fn ask(client: &async_nats::Client, subject: &str, body: Value) -> (Value, Option<String>) {
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.request(subject.to_string(), body.to_string().into()),
    )
    .await
    .expect("reply in time")
    .expect("request");
    let code = reply
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Service-Error-Code"))
        .map(|v| v.to_string());
    (
        serde_json::from_slice(&reply.payload).expect("JSON reply"),
        code,
    )
}

async fn query(client: &async_nats::Client, endpoint: &str, body: Value) -> Value {
    let (v, code) = ask(client, &format!("provledger.q.{endpoint}"), body).await;
    assert!(code.is_none(), "{endpoint}: unexpected error {v}");
    v
}

async fn append(log: &JetStreamLog, agg: AggregateId, events: Vec<Event>) -> u64 {
    log.append(agg, Expectation::Any, CommitDraft::now("test", events))
        .await
        .expect("append")
        .position
}

fn vcpu_inventory(total: u64) -> Event {
    Event::InventorySet {
        resource_class: "VCPU".into(),
        inventory: provledger_tests::workload::vcpu_inventory(total),
    }
}

fn claim(consumer: Uuid, vcpus: u64) -> Event {
    Event::AllocationClaimed {
        consumer,
        consumer_kind: ConsumerKind::Instance,
        resources: BTreeMap::from([("VCPU".to_string(), vcpus)]),
    }
}

fn create_instance(cluster: Uuid) -> Event {
    Event::InstanceCreateRequested {
        name: "worker".into(),
        cluster_id: Some(cluster),
        node_group: Some("workers".into()),
        flavor: "m1.small".into(),
        resources: BTreeMap::from([("VCPU".to_string(), 2)]),
        image: "img".into(),
    }
}

fn create_cluster() -> Event {
    Event::ClusterCreateRequested {
        name: "analytics".into(),
        plugin: "vanilla".into(),
        node_groups: vec![NodeGroupSpec {
            name: "workers".into(),
            count: 2,
            flavor: "m1.small".into(),
            resources: BTreeMap::new(),
            processes: vec!["datanode".into()],
        }],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_every_endpoint_and_drains_on_sigterm() {
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let log = open_log(&nats).await;
    let client = nats.client().await;
    let mut serve = Serve::start(&nats, &tmp.path().join("serve"));
    common::wait_position(&client, 0).await;

    // Given a provider filled to capacity, a cluster with two instances, an operation,
    // and garbage published straight onto an event subject.
    let (p, c, i1, i2, i3, op) = (
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
    );
    let provider = AggregateId::provider(p);
    let cluster = AggregateId::cluster(c);
    let register = Event::ProviderRegistered {
        name: "cn1".into(),
        host: "cn1".into(),
    };
    append(&log, provider, vec![register, vcpu_inventory(4)]).await;
    let created_at = append(&log, cluster, vec![create_cluster()]).await;
    for i in [i1, i2] {
        append(&log, AggregateId::instance(i), vec![create_instance(c)]).await;
    }
    let host = Event::HostAssigned {
        host: "cn1".into(),
        provider_id: p,
    };
    append(&log, AggregateId::instance(i1), vec![host]).await;
    append(&log, provider, vec![claim(i1, 2), claim(i2, 2)]).await;
    append(&log, provider, vec![claim(i3, 1)]).await;
    let joined = Event::InstanceJoined {
        node_group: "workers".into(),
        instance_id: i1,
    };
    append(&log, cluster, vec![joined]).await;
    let op_events: Vec<Event> = samples::all()
        .into_iter()
        .filter(|e| matches!(e, Event::OperationStarted { .. }))
        .collect();
    append(&log, AggregateId::operation(op), op_events).await;
    let garbage_subject = format!("provledger.ev.cluster.{}", Uuid::now_v7());
    let ack = log
        .context()
        .publish(garbage_subject, "\u{1}garbage".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let spawning = Event::ClusterStatusChanged {
        status: ClusterStatus::Spawning,
        description: "booting".into(),
    };
    let last = append(&log, cluster, vec![spawning]).await;
    assert_eq!(last, ack.sequence + 1);

    // When a cluster is read with min_position = the last write, it reflects it.
    let v = query(
        &client,
        "cluster.get",
        json!({"id": c, "min_position": last}),
    )
    .await;
    assert_eq!(v["position"], last);
    assert_eq!(v["data"]["status"], "spawning");
    assert_eq!(v["data"]["node_groups"][0]["instance_ids"], json!([i1]));

    // Then every endpoint answers as the contract says.
    let health = query(&client, "health", json!({})).await["data"].clone();
    assert_eq!(
        health["quarantined"], 1,
        "the garbage is quarantined: {health}"
    );
    assert_eq!(health["lag"], 0);
    assert_eq!(health["stream"], "PROVLEDGER");
    assert_eq!(health["nats_server_version"], log.server_version());

    let list = query(&client, "cluster.list", json!({"status": "spawning"})).await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    let list = query(&client, "cluster.list", json!({"status": "active"})).await;
    assert_eq!(list["data"], json!([]));

    // Operations by status: the one started is running; none needs attention.
    let running = query(&client, "operation.list", json!({"status": "running"})).await;
    assert_eq!(running["data"].as_array().unwrap().len(), 1, "{running}");
    assert_eq!(running["data"][0]["id"], json!(op.to_string()));
    let kind = running["data"][0]["kind"].clone();
    let by_kind = query(&client, "operation.list", json!({"kind": kind})).await;
    assert_eq!(by_kind["data"].as_array().unwrap().len(), 1, "{by_kind}");
    let stuck = query(
        &client,
        "operation.list",
        json!({"status": "needs_attention"}),
    )
    .await;
    assert_eq!(stuck["data"], json!([]));

    let inst = query(&client, "instance.get", json!({"id": i1})).await["data"].clone();
    assert_eq!(inst["host"], "cn1");
    assert_eq!(inst["vm_state"], "building");
    let by_cluster = query(&client, "instance.list", json!({"cluster_id": c})).await;
    assert_eq!(by_cluster["data"].as_array().unwrap().len(), 2);
    let by_host = query(&client, "instance.list", json!({"host": "cn1"})).await;
    assert_eq!(by_host["data"].as_array().unwrap().len(), 1);
    let one = query(
        &client,
        "instance.list",
        json!({"cluster_id": c, "limit": 1}),
    )
    .await;
    let first = one["data"][0]["id"].as_str().unwrap().to_string();
    let next = query(
        &client,
        "instance.list",
        json!({"cluster_id": c, "limit": 1, "after": first}),
    )
    .await;
    assert_ne!(next["data"][0]["id"], json!(first), "pagination moves on");

    let prov = query(&client, "provider.get", json!({"id": p})).await["data"].clone();
    assert_eq!(prov["usage"]["VCPU"], 4);
    assert_eq!(prov["capacity"]["VCPU"], 4);
    assert_eq!(prov["allocations"].as_array().unwrap().len(), 2);
    assert_eq!(
        prov["anomaly_count"], 1,
        "the claim past capacity is an anomaly"
    );

    let allocs = query(&client, "allocation.by_consumer", json!({"consumer": i1})).await;
    assert_eq!(allocs["data"][0]["provider_id"], json!(p));
    assert_eq!(allocs["data"][0]["resources"]["VCPU"], 2);
    let none = query(&client, "allocation.by_consumer", json!({"consumer": i3})).await;
    assert_eq!(none["data"], json!([]));

    let o = query(&client, "operation.get", json!({"id": op})).await["data"].clone();
    assert_eq!(o["status"], "running");

    let history = query(
        &client,
        "history",
        json!({"aggregate": cluster.to_string()}),
    )
    .await;
    assert_eq!(history["data"].as_array().unwrap().len(), 3);
    let then = query(
        &client,
        "state_at",
        json!({"aggregate": cluster.to_string(), "position": created_at}),
    )
    .await;
    assert_eq!(then["data"]["state"]["status"], "requested");

    // Read-your-writes has a bound: a position never reached answers `stale`.
    let (v, code) = ask(
        &client,
        "provledger.q.cluster.get",
        json!({"id": c, "min_position": last + 1000}),
    )
    .await;
    assert_eq!(v["error"]["code"], "stale");
    assert_eq!(v["error"]["position"], last);
    assert_eq!(code.as_deref(), Some("408"));

    // Malformed requests name the field; unknown ids are not_found.
    let (v, _) = ask(&client, "provledger.q.cluster.get", json!({"idd": c})).await;
    assert_eq!(v["error"]["code"], "bad_request");
    assert!(v["error"]["message"].as_str().unwrap().contains("idd"));
    let (v, _) = ask(&client, "provledger.q.instance.get", json!({"id": "x"})).await;
    assert!(v["error"]["message"].as_str().unwrap().contains("`id`"));
    let (v, code) = ask(
        &client,
        "provledger.q.cluster.get",
        json!({"id": Uuid::now_v7()}),
    )
    .await;
    assert_eq!(v["error"]["code"], "not_found");
    assert_eq!(code.as_deref(), Some("404"));
    let garbage = client
        .request("provledger.q.health", "{not json".into())
        .await
        .unwrap();
    let v: Value = serde_json::from_slice(&garbage.payload).unwrap();
    assert_eq!(v["error"]["code"], "bad_request");

    // cmd.append: appends, refuses a stale expect with the actual version, and refuses
    // to revive a cluster that is being deleted.
    let cmd = "provledger.cmd.append";
    let (v, code) = ask(
        &client,
        cmd,
        json!({"aggregate": cluster.to_string(), "expect": 3, "events": [{"cluster_delete_requested": {"reason": "user"}}]}),
    )
    .await;
    assert!(code.is_none(), "{v}");
    let deleting_at = v["data"]["position"].as_u64().unwrap();
    let (v, _) = ask(
        &client,
        cmd,
        json!({"aggregate": cluster.to_string(), "expect": 3, "events": [{"cluster_delete_requested": {"reason": "again"}}]}),
    )
    .await;
    assert_eq!(v["error"]["code"], "conflict");
    assert_eq!(v["error"]["actual_version"], 4);
    common::wait_position(&client, deleting_at).await;
    let (v, code) = ask(
        &client,
        cmd,
        json!({"aggregate": cluster.to_string(), "expect": 4, "events": [{"cluster_status_changed": {"status": "active", "description": "x"}}]}),
    )
    .await;
    assert_eq!(v["error"]["code"], "target_deleted", "{v}");
    assert_eq!(code.as_deref(), Some("410"));
    let (v, _) = ask(
        &client,
        cmd,
        json!({"aggregate": cluster.to_string(), "expect": "any", "events": [{"no_such_event": {}}]}),
    )
    .await;
    assert_eq!(v["error"]["code"], "bad_request");
    assert!(v["error"]["message"].as_str().unwrap().contains("events"));

    // $SRV discovery works like `nats micro ls`.
    let pings =
        crate::common::gather(&client, "$SRV.PING.provledger", Duration::from_millis(500)).await;
    assert_eq!(pings.len(), 1);
    assert_eq!(pings[0]["name"], "provledger");
    let info =
        crate::common::gather(&client, "$SRV.INFO.provledger", Duration::from_millis(500)).await;
    let subjects: Vec<&str> = info[0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["subject"].as_str().unwrap())
        .collect();
    assert!(subjects.contains(&"provledger.q.cluster.get"));
    assert!(subjects.contains(&"provledger.cmd.append"));
    assert!(info[0]["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["queue_group"] == "provledger"));

    // SIGTERM drains and exits 0.
    assert!(serve.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_the_queue_group_and_agree() {
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let log = open_log(&nats).await;
    let client = nats.client().await;
    let _a = Serve::start(&nats, &tmp.path().join("a"));
    let _b = Serve::start(&nats, &tmp.path().join("b"));

    let mut ids = Vec::new();
    let mut last = 0;
    for _ in 0..10 {
        let id = Uuid::now_v7();
        last = append(&log, AggregateId::cluster(id), vec![create_cluster()]).await;
        ids.push(id);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while crate::common::gather(&client, "$SRV.PING.provledger", Duration::from_millis(300))
        .await
        .len()
        < 2
    {
        assert!(
            Instant::now() < deadline,
            "two replicas never answered PING"
        );
    }

    // (80 queries at least, and on until both replicas answered: a replica answers PING a
    // moment before its endpoints join the queue group)
    let mut seen: BTreeMap<String, BTreeMap<Uuid, Value>> = BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    for round in 0.. {
        if round >= 80 && (seen.len() == 2 || Instant::now() > deadline) {
            break;
        }
        let id = ids[round % ids.len()];
        let v = query(
            &client,
            "cluster.get",
            json!({"id": id, "min_position": last}),
        )
        .await;
        let by = v["served_by"].as_str().unwrap().to_string();
        seen.entry(by).or_default().insert(id, v["data"].clone());
    }
    assert_eq!(seen.len(), 2, "both replicas answered");
    let mut replicas = seen.values();
    let (a, b) = (replicas.next().unwrap(), replicas.next().unwrap());
    for (id, data) in a {
        if let Some(other) = b.get(id) {
            assert_eq!(data, other, "replicas agree on {id}");
        }
    }
    let stats =
        crate::common::gather(&client, "$SRV.STATS.provledger", Duration::from_millis(500)).await;
    assert_eq!(stats.len(), 2);
    for s in &stats {
        let served: u64 = s["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["num_requests"].as_u64().unwrap_or(0))
            .sum();
        assert!(served > 0, "every replica took a share: {s}");
    }

    // The replica each reply names (`served_by`) is the one `$SRV.INFO` names, and INFO
    // says what each replica serves and where it keeps its copy.
    let info =
        crate::common::gather(&client, "$SRV.INFO.provledger", Duration::from_millis(500)).await;
    let info_ids: BTreeSet<&str> = info.iter().map(|i| i["id"].as_str().unwrap()).collect();
    let served_by: BTreeSet<&str> = seen.keys().map(String::as_str).collect();
    assert_eq!(info_ids, served_by, "$SRV ids are the served_by of replies");
    let data_dirs: BTreeSet<&str> = info
        .iter()
        .map(|i| i["metadata"]["data_dir"].as_str().unwrap())
        .collect();
    assert_eq!(
        data_dirs.len(),
        2,
        "each replica names its own data dir: {info:?}"
    );
    for i in &info {
        assert_eq!(i["metadata"]["version"], env!("CARGO_PKG_VERSION"), "{i}");
        assert_eq!(i["metadata"]["stream"], "PROVLEDGER", "{i}");
        assert_eq!(i["metadata"]["subject_prefix"], "provledger", "{i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_joins_the_queue_group_only_once_caught_up() {
    const COMMITS: u64 = 4000;
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let log = open_log(&nats).await;
    let client = nats.client().await;
    // Given a stream of a few thousand commits and replica A serving it...
    let ids: Vec<Uuid> = (0..200).map(|_| Uuid::now_v7()).collect();
    futures::stream::iter(0..COMMITS as usize)
        .map(|n| {
            let log = log.clone();
            let id = ids[n % ids.len()];
            let first = n < ids.len();
            async move {
                let event = if first {
                    create_cluster()
                } else {
                    Event::ClusterStatusChanged {
                        status: ClusterStatus::Active,
                        description: format!("step {n}"),
                    }
                };
                append(&log, AggregateId::cluster(id), vec![event]).await
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await;
    let _a = Serve::start(&nats, &tmp.path().join("a"));
    common::wait_position(&client, COMMITS).await;
    let a_id = query(&client, "health", json!({})).await["served_by"]
        .as_str()
        .unwrap()
        .to_string();

    // When replica B starts from nothing...
    let ready_file = tmp.path().join("b.ready");
    let _b = Serve::start_with(
        &nats,
        &tmp.path().join("b"),
        &["--ready-file", ready_file.to_str().unwrap()],
    );
    // ...then every answer B gives, from its first, is from caught-up state and says ready.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut from_b = 0;
    while from_b < 5 {
        assert!(Instant::now() < deadline, "replica B never answered");
        let v = query(&client, "health", json!({})).await;
        if v["served_by"] == a_id.as_str() {
            continue;
        }
        from_b += 1;
        assert!(
            v["data"]["position"].as_u64().unwrap() >= COMMITS,
            "B answered before it had caught up: {v}"
        );
        assert_eq!(v["data"]["ready"], true, "{v}");
        assert!(ready_file.exists(), "B answers, so its ready file is there");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_a_load_loses_and_duplicates_nothing() {
    const ROUNDS: usize = 5;
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let log = open_log(&nats).await;
    let client = nats.client().await;
    let dir = tmp.path().join("serve");

    // A deterministic random script over a small pool of aggregates.
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut steps = Vec::new();
    while steps.len() < 2500 {
        steps.extend(
            script::script(1000)
                .new_tree(&mut runner)
                .unwrap()
                .current(),
        );
    }
    assert!(
        steps.len() >= 1000,
        "a long enough load: {} steps",
        steps.len()
    );
    let per_round = steps.len() / ROUNDS;
    let mut serve = Serve::start(&nats, &dir);
    let mut kills = 0;
    for round in 0..ROUNDS {
        let chunk = &steps[round * per_round..(round + 1) * per_round];
        common::wait_position(&client, 0).await;
        // The kill lands after a round-dependent share of the chunk is appended, and the
        // load waits for it before going on: during the load on any machine, however fast
        // (a timer could fire after a fast machine's load had already finished).
        let kill_after = chunk.len() * (1 + round) / (ROUNDS + 2);
        let (reached, reached_rx) = tokio::sync::oneshot::channel::<()>();
        let (killed_tx, killed_rx) = tokio::sync::oneshot::channel::<()>();
        let load = async {
            let (mut reached, mut killed_rx) = (Some(reached), Some(killed_rx));
            for (i, (agg, events)) in chunk.iter().enumerate() {
                if i == kill_after {
                    if let (Some(r), Some(k)) = (reached.take(), killed_rx.take()) {
                        let _ = r.send(());
                        let _ = k.await;
                    }
                }
                append(&log, *agg, events.clone()).await;
            }
            Instant::now()
        };
        let killer = async {
            let _ = reached_rx.await;
            serve.kill();
            let killed = Instant::now();
            let _ = killed_tx.send(());
            killed
        };
        let (load_done, killed) = tokio::join!(load, killer);
        assert!(
            killed < load_done,
            "round {round}: the kill must land during the load"
        );
        kills += 1;

        // After a restart, the projection equals a fresh rebuild of the whole log. serve's
        // own rollback worker may append meanwhile (the script leaves operations rolling
        // back): a difference counts only if the log did not move during the comparison.
        serve = Serve::start(&nats, &dir);
        let mut checked = HashSet::new();
        for attempt in 0.. {
            let end = log.last_position().await.unwrap();
            common::wait_position(&client, end).await;
            let commits: Vec<_> = log
                .read_all(1)
                .await
                .unwrap()
                .map(|c| c.unwrap())
                .collect()
                .await;
            let rebuilt = Projection::rebuild(&commits);
            let mut difference = None;
            checked.clear();
            for agg in script::aggregate_pool() {
                let Some(expected) = rebuilt.get(&agg) else {
                    continue;
                };
                let endpoint = format!("{}.get", agg.kind);
                let v = query(&client, &endpoint, json!({"id": agg.id})).await;
                let h = query(&client, "history", json!({"aggregate": agg.to_string()})).await;
                let copied = h["data"].as_array().unwrap().len() as u64;
                if v["data"] != expected.view() || copied != expected.header().version {
                    difference = Some((agg, v["data"].clone(), expected.view(), copied));
                    break;
                }
                checked.insert(agg);
            }
            let Some((agg, served, expected, copied)) = difference else {
                break;
            };
            let moved = log.last_position().await.unwrap() > end;
            assert!(
                moved && attempt < 20,
                "round {round}: {agg} differs from a rebuild after SIGKILL (copy holds {copied} commits)\nserved:  {served}\nrebuilt: {expected}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!checked.is_empty());
    }
    assert_eq!(kills, ROUNDS);
    assert!(serve.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_a_far_min_position_are_bounded_and_health_still_answers() {
    // Given a serve replica whose waits are bounded at 4 s (longer than the burst below
    // takes to arrive on a slow machine: no wait ends, and frees its slot, before the last
    // query is in),
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start_with(
        &nats,
        &dir.path().join("serve"),
        &["--min-position-wait-ms", "4000"],
    );
    let client = nats.client().await;
    common::wait_ready(&client).await;
    let cluster = Uuid::now_v7();
    // when 600 queries wait for a position the log will not reach,
    let waiting = (0..600).map(|_| {
        let client = client.clone();
        async move {
            let (reply, _) = ask(
                &client,
                "provledger.q.cluster.get",
                json!({"id": cluster, "min_position": 1_000_000}),
            )
            .await;
            (reply, ())
        }
    });
    let waiting = tokio::spawn(futures::future::join_all(waiting));
    tokio::time::sleep(Duration::from_millis(50)).await;
    // then health answers while they wait,
    let health = query(&client, "health", json!({})).await;
    assert!(health["error"].is_null(), "{health}");
    assert!(
        !waiting.is_finished(),
        "the waits ended before health was asked"
    );
    // every query answers `stale`, and those beyond the bound without waiting.
    let replies = waiting.await.unwrap();
    assert!(
        replies.iter().all(|(r, _)| r["error"]["code"] == "stale"),
        "{:?}",
        replies.first()
    );
    let turned_away = replies
        .iter()
        .filter(|(r, _)| {
            r["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("MIN_POSITION_WAITS_MAX"))
        })
        .count();
    // (exactly: the 256 slots, MIN_POSITION_WAITS_MAX, were all held while the rest came)
    assert_eq!(turned_away, 600 - 256, "turned away");
}

/// Raises this process's soft limit of open files to `files` (at most its hard limit).
fn raise_own_open_files_to(files: u64) {
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < files {
            limit.rlim_cur = files.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_requests_holding_the_console_leave_metrics_writes_and_shutdown_working() {
    use std::io::Write;
    // Given serve with the console and the metrics on listeners of their own...
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (console, metrics) = (provledger_tests::free_port(), provledger_tests::free_port());
    // at the soft limit of open files a unit without LimitNOFILE gets (1,024)...
    let mut serve = Serve::start_with_open_files(
        &nats,
        &dir.path().join("serve"),
        &[
            "--http",
            &format!("127.0.0.1:{console}"),
            "--metrics-addr",
            &format!("127.0.0.1:{metrics}"),
        ],
        1_024,
    );
    let client = nats.client().await;
    common::wait_ready(&client).await;
    // (This process holds the other end of every connection: it needs more than 1,100.)
    raise_own_open_files_to(4_096);
    let files = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let before = files(serve.pid());

    // ...when 1,100 connections each send half a request to the console and hold it...
    let held: Vec<std::net::TcpStream> = (0..1_100)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(("127.0.0.1", console)).expect("connect");
            s.write_all(b"GET /operations HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .expect("half a request");
            s
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // ...then serve holds at most the console's cap of them (the rest wait in the kernel's
    // backlog, holding none of its file handles)...
    let during = files(serve.pid());
    assert!(
        during <= before + 256 + 8,
        "{during} open files, {before} before"
    );
    // ...the metrics listener answers, and says the replica is ready...
    let (status, body) = common::http_get(metrics, "/metrics").expect("a scrape");
    assert_eq!(status, 200);
    assert_eq!(
        common::sample(&body, "provledger_ready"),
        Some(1.0),
        "{body}"
    );
    // ...writes and reads over NATS go on (the projector keeps its file handles)...
    let mut last = 0;
    for _ in 0..11 {
        let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
        let (reply, code) = ask(
            &client,
            "provledger.cmd.append",
            json!({"aggregate": format!("cluster/{}", Uuid::now_v7()), "expect": "none", "events": create}),
        )
        .await;
        assert!(code.is_none(), "{reply}");
        last = reply["data"]["position"].as_u64().expect("appended");
    }
    common::wait_position(&client, last).await;

    // ...and SIGTERM still stops serve, the half requests held: it drains within bounds.
    let started = Instant::now();
    assert!(serve.terminate().success());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_of_five_thousand_steps_never_hides_the_others_from_the_worklist() {
    // Given a running operation of 5,000 steps (its view weighs megabytes) and a small one...
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &tmp.path().join("serve"));
    let client = nats.client().await;
    common::wait_ready(&client).await;
    let log = open_log(&nats).await;
    let started = |target: Uuid| -> Event {
        serde_json::from_value(json!({"operation_started": {
            "kind": "boot_instance", "target": format!("instance/{target}"), "parent_id": null,
            "stages": [{"name": "act", "policy": "compensate"}], "bundle_policy": null}}))
        .unwrap()
    };
    let big = Uuid::now_v7();
    let big_op = AggregateId::operation(big);
    append(&log, big_op, vec![started(Uuid::now_v7())]).await;
    append(
        &log,
        big_op,
        vec![serde_json::from_value(json!({"stage_started": {"stage": "act"}})).unwrap()],
    )
    .await;
    let step = |n: usize| -> Event {
        serde_json::from_value(json!({"step_done": {
            "stage": "act", "step": format!("acquire_ip:{n:05}"),
            "effect": {"kind": "ip_acquired", "resource": format!("10.{}.{}.{}", n / 65536, (n / 256) % 256, n % 256),
                "executor": "ipam", "origin": "created", "detail": {"node": format!("node-{n:05}")}},
            "compensation": {"action": "release_ip", "executor": {"service": "ipam"},
                "resource": format!("10.{}.{}.{}", n / 65536, (n / 256) % 256, n % 256), "args": {}}}}))
        .unwrap()
    };
    for chunk in (0..5_000).collect::<Vec<_>>().chunks(1_000) {
        append(&log, big_op, chunk.iter().map(|&n| step(n)).collect()).await;
    }
    let small = Uuid::now_v7();
    let end = append(
        &log,
        AggregateId::operation(small),
        vec![started(Uuid::now_v7())],
    )
    .await;
    common::wait_position(&client, end).await;

    // ...when the worklist is asked for the running operations...
    let (listed, code) = ask(
        &client,
        "provledger.q.operation.list",
        json!({"status": "running"}),
    )
    .await;
    // ...then both are there, each as a summary that counts the big one's steps.
    assert!(code.is_none(), "{listed:.300}");
    let items = listed["data"].as_array().expect("a page");
    assert_eq!(items.len(), 2, "{listed:.300}");
    let big_summary = items
        .iter()
        .find(|o| o["id"] == json!(big.to_string()))
        .expect("the big one");
    assert_eq!(big_summary["steps"], 5_000, "{big_summary}");
    assert!(
        listed.to_string().len() < 16 * 1024,
        "{} bytes",
        listed.to_string().len()
    );
    // And the CLI's worklist lists both, over NATS.
    let url = nats.url();
    let out = tokio::task::spawn_blocking(move || {
        common::provledger(
            &[
                "--nats",
                url.as_str(),
                "operation",
                "list",
                "--status",
                "running",
            ],
            "",
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", common::text(&out));
    let said = common::text(&out);
    assert!(
        said.contains(&big.to_string()) && said.contains(&small.to_string()),
        "{said}"
    );

    // The big one's view comes in parts (whole, it may be over a reply: `too_large` then
    // says to ask for parts): in parts of 1,000 steps it comes whole, each step once, in
    // order.
    let mut steps = Vec::new();
    for _ in 0..10 {
        let part = query(
            &client,
            "operation.get",
            json!({"id": big, "steps_from": steps.len(), "parts_limit": 1_000}),
        )
        .await;
        assert_eq!(
            part["data"]["parts"]["steps_total"],
            5_000,
            "{:.300}",
            part.to_string()
        );
        let page = part["data"]["steps"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if page.is_empty() {
            break;
        }
        steps.extend(page);
    }
    assert_eq!(steps.len(), 5_000);
    assert!(steps
        .iter()
        .enumerate()
        .all(|(n, s)| s["name"] == json!(format!("acquire_ip:{n:05}"))));
    // Parts are for operations only.
    let (refused, code) = ask(
        &client,
        "provledger.q.cluster.get",
        json!({"id": Uuid::now_v7(), "steps_from": 0}),
    )
    .await;
    assert!(code.is_some(), "{refused}");
    assert_eq!(refused["error"]["code"], "bad_request", "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_are_listed_newest_first_with_their_times_and_since_a_time() {
    use provledger_events::Timestamp;
    // Given serve with a metrics listener, and three operations, in id (start) order: one
    // started an hour ago and still running (its writer long gone), one started and failed
    // a moment ago, and one started just now...
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let port = provledger_tests::free_port();
    let _serve = Serve::start_with(
        &nats,
        &tmp.path().join("serve"),
        &["--metrics-addr", &format!("127.0.0.1:{port}")],
    );
    let client = nats.client().await;
    common::wait_ready(&client).await;
    let log = open_log(&nats).await;
    let started: Event = serde_json::from_value(json!({"operation_started": {
        "kind": "boot_instance", "target": format!("instance/{}", Uuid::now_v7()),
        "parent_id": null, "stages": [{"name": "act", "policy": "compensate"}],
        "bundle_policy": null}}))
    .unwrap();
    let failed: Event = serde_json::from_value(json!({"operation_failed": {
        "stage": "act", "step": null, "error": "hypervisor gone"}}))
    .unwrap();
    let mut ids = [Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7()];
    ids.sort();
    let [old, failing, newest] = ids.map(AggregateId::operation);
    let now = Timestamp::now();
    let at = |ms_ago: i64| now.plus_ms(-ms_ago);
    let append_at = |op: AggregateId, recorded_at: Timestamp, event: Event| {
        let log = log.clone();
        async move {
            let mut draft = CommitDraft::now("test", vec![event]);
            draft.recorded_at = recorded_at;
            log.append(op, Expectation::Any, draft)
                .await
                .expect("append")
                .position
        }
    };
    append_at(old, at(3_600_000), started.clone()).await;
    append_at(failing, at(2_000), started.clone()).await;
    append_at(failing, at(1_000), failed).await;
    let end = append_at(newest, now, started).await;
    common::wait_position(&client, end).await;

    // ...when the operations are listed, then the newest comes first, each with its times...
    let listed = query(&client, "operation.list", json!({})).await;
    let order = |page: &Value| -> Vec<String> {
        page["data"]
            .as_array()
            .expect("a page")
            .iter()
            .map(|o| o["id"].as_str().unwrap_or("-").to_string())
            .collect()
    };
    let id = |op: AggregateId| op.id.to_string();
    assert_eq!(order(&listed), vec![id(newest), id(failing), id(old)]);
    let time = |t: Timestamp| json!(t.to_string());
    let times = |o: &Value| {
        ["started_at", "failed_at", "finished_at", "last_commit_at"].map(|f| o[f].clone())
    };
    // (serve's rollback worker goes on with the failed one: its later commits, and when
    // its rollback finishes, are serve's to tell.)
    let failed_summary = &listed["data"][1];
    assert_eq!(
        times(failed_summary)[..2],
        [time(at(2_000)), time(at(1_000))],
        "{failed_summary}"
    );
    assert_eq!(
        times(&listed["data"][0]),
        [time(now), Value::Null, Value::Null, time(now)],
        "{listed}"
    );
    assert_eq!(
        times(&listed["data"][2]),
        [
            time(at(3_600_000)),
            Value::Null,
            Value::Null,
            time(at(3_600_000))
        ],
        "{listed}"
    );
    // ...the next page goes on to older ones...
    let next = query(
        &client,
        "operation.list",
        json!({"limit": 1, "after": id(newest)}),
    )
    .await;
    assert_eq!(order(&next), vec![id(failing)]);
    // ...`since` leaves out the one started an hour ago...
    let recent = query(
        &client,
        "operation.list",
        json!({"since": at(600_000).to_string()}),
    )
    .await;
    assert_eq!(order(&recent), vec![id(newest), id(failing)]);
    // ...and the view carries the same times.
    let view = query(&client, "operation.get", json!({"id": failing.id})).await;
    assert_eq!(view["data"]["started_at"], time(at(2_000)), "{view}");
    assert_eq!(view["data"]["failed_at"], time(at(1_000)), "{view}");
    let last = view["data"]["last_commit_at"].as_str().unwrap_or("-");
    assert!(
        Timestamp::parse_rfc3339(last).is_ok_and(|t| t >= at(1_000)),
        "{view}"
    );

    // The CLI lists the recent ones under a header, newest first, each with its age...
    let url = nats.url();
    let cli = |args: &'static [&'static str]| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let mut all = vec!["--nats", url.as_str()];
            all.extend(args);
            common::provledger(&all, "")
        })
    };
    let out = cli(&["operation", "list", "--since", "10m"]).await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", common::text(&out));
    let said = common::text(&out);
    let lines: Vec<&str> = said.lines().collect();
    assert!(
        lines.len() == 3 && lines[0].starts_with("ID ") && lines[0].contains(" AGE "),
        "{said}"
    );
    assert!(lines[1].starts_with(&id(newest)), "{said}");
    assert!(lines[2].starts_with(&id(failing)), "{said}");
    assert!(!said.contains(&id(old)), "{said}");
    // ...and under --json, with their times.
    let out = cli(&["--json", "operation", "list", "--since", "10m"])
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", common::text(&out));
    let json: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(json[0]["id"], json!(id(newest)), "{json}");
    assert_eq!(json[0]["started_at"], time(now), "{json}");
    assert_eq!(json[1]["failed_at"], time(at(1_000)), "{json}");

    // And the metrics give the age of the oldest running operation: the hour-old one.
    let scrape = common::http_get(port, "/metrics")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let age = common::sample(
        &scrape,
        "provledger_operation_oldest_age_seconds{status=\"running\"}",
    );
    assert!(
        age.is_some_and(|s| (3_600.0..3_900.0).contains(&s)),
        "{scrape}"
    );
}
