//! The write boundary over NATS, against a real nats-server and `provledger serve`: what
//! `cmd.append` acknowledges is what the fold applies, decided at the version appended.
//! Given racing writers / when they append / then the log holds only what was acknowledged.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use provledger_client::Writer;
use provledger_events::catalogue::{samples, ClusterStatus};
use provledger_events::{AggregateId, Event, EventLog, JetStreamConfig, JetStreamLog};
use provledger_projections::Entity;
use provledger_tests::NatsServer;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::common;
use crate::common::Serve;

const CMD: &str = "provledger.cmd.append";

async fn open_log(nats: &NatsServer) -> JetStreamLog {
    JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("open JetStream log")
}

/// One `cmd.append`; the reply's JSON.
async fn cmd(client: &async_nats::Client, body: Value) -> Value {
    let reply = tokio::time::timeout(
        Duration::from_secs(20),
        client.request(CMD, body.to_string().into()),
    )
    .await
    .expect("reply in time")
    .expect("request");
    serde_json::from_slice(&reply.payload).expect("JSON reply")
}

fn error_code(reply: &Value) -> Option<&str> {
    reply["error"]["code"].as_str()
}

async fn started(nats: &NatsServer, dir: &tempfile::TempDir) -> (Serve, async_nats::Client) {
    let serve = Serve::start(nats, &dir.path().join("serve"));
    let client = nats.client().await;
    common::wait_ready(&client).await;
    (serve, client)
}

/// A provider of capacity (8 - 2) * 4 = 24 VCPU.
fn provider_events() -> Value {
    json!([
        {"provider_registered": {"name": "cn1", "host": "cn1"}},
        {"inventory_set": {"resource_class": "VCPU", "inventory": {
            "total": 8, "reserved": 2, "allocation_ratio": 4.0,
            "min_unit": 1, "max_unit": 8, "step_size": 1}}}
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_racing_claims_with_expect_any_never_overcommit_and_every_ack_is_held() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let provider = Uuid::now_v7();
    let created = cmd(
        &client,
        json!({"aggregate": format!("provider/{provider}"), "expect": "none", "events": provider_events()}),
    )
    .await;
    assert!(error_code(&created).is_none(), "{created}");

    // Given 30 writers claiming 2 VCPU each with `expect any` on 24 VCPU...
    let consumers: Vec<Uuid> = (0..30).map(|_| Uuid::now_v7()).collect();
    let writers = consumers.iter().map(|consumer| {
        let client = client.clone();
        let body = json!({
            "aggregate": format!("provider/{provider}"),
            "expect": "any",
            "events": [{"allocation_claimed": {
                "consumer": consumer, "consumer_kind": "instance", "resources": {"VCPU": 2}}}]
        });
        async move { (*consumer, cmd(&client, body).await) }
    });
    let replies = futures::future::join_all(writers).await;

    let mut acknowledged = BTreeSet::new();
    let mut over_capacity = 0;
    for (consumer, reply) in &replies {
        match error_code(reply) {
            None => {
                acknowledged.insert(*consumer);
            }
            Some("rejected") => {
                assert_eq!(reply["error"]["reason"], "over_capacity", "{reply}");
                assert_eq!(reply["error"]["classes"][0]["resource_class"], "VCPU");
                over_capacity += 1;
            }
            // Lost the race more often than the bound allows: nothing written, retryable.
            Some("unavailable") => {}
            Some(other) => panic!("unexpected {other}: {reply}"),
        }
    }

    // ...then every acknowledged claim is held, and nothing else.
    let log = open_log(&nats).await;
    let Some(Entity::Provider(state)) = Writer::new(log.clone())
        .read_current(AggregateId::provider(provider))
        .await
        .unwrap()
    else {
        panic!("provider missing")
    };
    let held: BTreeSet<Uuid> = state.allocations.keys().copied().collect();
    assert_eq!(
        held, acknowledged,
        "acknowledged claims are exactly those held"
    );
    let used = state.usage.get("VCPU").copied().unwrap_or(0);
    assert_eq!(used, 2 * acknowledged.len() as u64);
    assert!(used <= 24, "usage {used} over capacity 24");
    assert_eq!(acknowledged.len(), 12, "the capacity is used up, not less");
    assert!(over_capacity > 0, "the late writers were refused");
    assert_eq!(
        state.header.anomaly_count, 0,
        "the fold dropped nothing: {:?}",
        state.header.anomalies
    );
    // Every commit on the provider is one acknowledged write: creation plus 12 claims.
    assert_eq!(state.header.version, 1 + acknowledged.len() as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_change_racing_a_delete_is_never_acknowledged_after_it() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let log = open_log(&nats).await;

    let mut accepted_before = 0;
    let mut refused = 0;
    for _ in 0..40 {
        let cluster = Uuid::now_v7();
        let aggregate = format!("cluster/{cluster}");
        let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
        let created = cmd(
            &client,
            json!({"aggregate": aggregate, "expect": "none", "events": create}),
        )
        .await;
        assert!(error_code(&created).is_none(), "{created}");
        // When a delete and a move to `active` race...
        let delete = cmd(
            &client,
            json!({"aggregate": aggregate, "expect": "any",
                   "events": [{"cluster_delete_requested": {"reason": "user"}}]}),
        );
        let activate = cmd(
            &client,
            json!({"aggregate": aggregate, "expect": "any",
                   "events": [{"cluster_status_changed": {"status": "active", "description": "up"}}]}),
        );
        let (deleted, activated) = futures::join!(delete, activate);
        assert!(error_code(&deleted).is_none(), "{deleted}");
        match error_code(&activated) {
            None => accepted_before += 1,
            Some("target_deleted") => refused += 1,
            Some(other) => panic!("unexpected {other}: {activated}"),
        }
        // ...then no acknowledged change follows the delete in the log.
        let commits = log
            .read_aggregate(AggregateId::cluster(cluster))
            .await
            .unwrap();
        let delete_at = commits
            .iter()
            .position(|c| matches!(c.events.as_slice(), [Event::ClusterDeleteRequested { .. }]))
            .expect("delete recorded");
        for later in &commits[delete_at + 1..] {
            for event in &later.events {
                if let Event::ClusterStatusChanged { status, .. } = event {
                    assert!(
                        status.is_terminal(),
                        "{status:?} acknowledged after the delete"
                    );
                }
            }
        }
        let Some(Entity::Cluster(state)) = Writer::new(log.clone())
            .read_current(AggregateId::cluster(cluster))
            .await
            .unwrap()
        else {
            panic!("cluster missing")
        };
        // serve completes an empty cluster's deletion on its own.
        assert!(
            matches!(
                state.status,
                Some(ClusterStatus::Deleting | ClusterStatus::Deleted)
            ),
            "{:?}",
            state.status
        );
        assert_eq!(
            state.header.anomaly_count, 0,
            "{:?}",
            state.header.anomalies
        );
    }
    assert_eq!(accepted_before + refused, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_over_nats_is_idempotent_and_says_so() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let log = open_log(&nats).await;
    let delete = json!([{"cluster_delete_requested": {"reason": "user"}}]);

    // Given nothing under this id, when it is deleted, then not_found and nothing written.
    let before = log.last_position().await.unwrap();
    let unknown = cmd(
        &client,
        json!({"aggregate": format!("cluster/{}", Uuid::now_v7()), "expect": "any", "events": delete}),
    )
    .await;
    assert_eq!(error_code(&unknown), Some("not_found"), "{unknown}");
    assert_eq!(log.last_position().await.unwrap(), before);

    // Given a cluster, the first delete is written, the second says already_deleting.
    let cluster = Uuid::now_v7();
    let aggregate = format!("cluster/{cluster}");
    let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
    cmd(
        &client,
        json!({"aggregate": aggregate, "expect": "none", "events": create}),
    )
    .await;
    let first = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": "any", "events": delete}),
    )
    .await;
    assert_eq!(first["data"]["outcome"], "appended", "{first}");
    let second = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": "any", "events": delete}),
    )
    .await;
    // serve may already have completed the empty cluster's deletion.
    let outcome = second["data"]["outcome"].as_str().unwrap_or_default();
    assert!(
        ["already_deleting", "already_deleted"].contains(&outcome),
        "{second}"
    );

    // Given it is deleted, a delete says already_deleted.
    let target = AggregateId::cluster(cluster);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(Entity::Cluster(c)) =
            Writer::new(log.clone()).read_current(target).await.unwrap()
        {
            if c.status == Some(ClusterStatus::Deleted) {
                break;
            }
        }
        assert!(std::time::Instant::now() < deadline, "never deleted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let at = log.last_position().await.unwrap();
    let third = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": "any", "events": delete}),
    )
    .await;
    assert_eq!(third["data"]["outcome"], "already_deleted", "{third}");
    assert_eq!(log.last_position().await.unwrap(), at, "nothing written");

    // Three delete requests, one recorded.
    let requests = log
        .read_aggregate(target)
        .await
        .unwrap()
        .iter()
        .flat_map(|c| c.events.iter())
        .filter(|e| matches!(e, Event::ClusterDeleteRequested { .. }))
        .count();
    assert_eq!(requests, 1);
}

/// Publishes raw bytes on a subject through JetStream, as a rogue or broken publisher
/// would (no provledger code involved); returns the stream sequence.
async fn publish_raw(nats: &NatsServer, subject: String, payload: Vec<u8>) -> u64 {
    let js = async_nats::jetstream::new(nats.client().await);
    js.publish(subject, payload.into())
        .await
        .expect("publish")
        .await
        .expect("ack")
        .sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_replayed_and_foreign_commits_on_a_subject_are_quarantined_and_appends_go_on() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let log = open_log(&nats).await;
    let cluster = Uuid::now_v7();
    let other = Uuid::now_v7();
    let aggregate = format!("cluster/{cluster}");
    let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
    for (agg, events, expect) in [
        (aggregate.clone(), create.clone(), json!("none")),
        (
            aggregate.clone(),
            json!([{"cluster_status_changed": {"status": "spawning", "description": "v2"}}]),
            json!(1),
        ),
        (format!("cluster/{other}"), create.clone(), json!("none")),
    ] {
        let reply = cmd(
            &client,
            json!({"aggregate": agg, "expect": expect, "events": events}),
        )
        .await;
        assert!(error_code(&reply).is_none(), "{reply}");
    }
    let subject = format!("provledger.ev.cluster.{cluster}");
    let mine = log
        .read_aggregate(AggregateId::cluster(cluster))
        .await
        .unwrap();
    let theirs = log
        .read_aggregate(AggregateId::cluster(other))
        .await
        .unwrap();
    let v2_bytes = provledger_events::codec::encode(&mine[1]).unwrap();
    let foreign_bytes = provledger_events::codec::encode(&theirs[0]).unwrap();

    // Given garbage, its own v2 again and another aggregate's commit on its subject...
    let garbage = publish_raw(&nats, subject.clone(), b"\x00garbage!".to_vec()).await;
    let replayed = publish_raw(&nats, subject.clone(), v2_bytes).await;
    let foreign = publish_raw(&nats, subject.clone(), foreign_bytes).await;

    // ...when the aggregate is written again, with an exact version and with `any`...
    let exact = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": 2,
               "events": [{"cluster_status_changed": {"status": "configuring", "description": "v3"}}]}),
    )
    .await;
    assert!(error_code(&exact).is_none(), "{exact}");
    assert_eq!(exact["data"]["version"], 3);
    let any = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": "any",
               "events": [{"cluster_status_changed": {"status": "active", "description": "v4"}}]}),
    )
    .await;
    assert!(error_code(&any).is_none(), "{any}");
    assert_eq!(any["data"]["version"], 4);

    // ...then its chain is intact and continues from its last valid commit.
    let target = AggregateId::cluster(cluster);
    let commits = log.read_aggregate(target).await.unwrap();
    assert_eq!(
        commits.iter().map(|c| c.version).collect::<Vec<_>>(),
        vec![1, 2, 3, 4]
    );
    provledger_events::check_chain(&target, &commits).expect("chain intact");
    let history = log.aggregate_history(target).await.unwrap();
    let quarantined: Vec<(u64, String)> = history
        .iter()
        .filter_map(|e| match e {
            provledger_events::HistoryEntry::Quarantined {
                position, reason, ..
            } => Some((*position, reason.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        quarantined.iter().map(|q| q.0).collect::<Vec<_>>(),
        vec![garbage, replayed, foreign]
    );
    assert!(
        quarantined[0].1.starts_with("undecodable"),
        "{quarantined:?}"
    );
    assert!(quarantined[1].1.starts_with("replayed"), "{quarantined:?}");
    assert!(quarantined[2].1.starts_with("foreign"), "{quarantined:?}");

    // `history` shows them in place; serve quarantined them and folded the rest.
    let out = common::provledger(&["--nats", &nats.url(), "history", &aggregate], "");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert_eq!(text.matches("QUARANTINED").count(), 3, "{text}");
    let last = any["data"]["position"].as_u64().unwrap();
    let state = cmd_query(
        &client,
        "cluster.get",
        json!({"id": cluster, "min_position": last}),
    )
    .await;
    assert_eq!(state["data"]["status"], "active", "{state}");
    assert_eq!(state["data"]["version"], 4);
    assert_eq!(state["data"]["anomaly_count"], 0, "{state}");
    let health = cmd_query(&client, "health", json!({})).await;
    assert_eq!(health["data"]["quarantined"], 3, "{health}");

    // `audit` reports the three quarantined entries, and nothing wrong with the chain.
    let nowhere = dir.path().join("no-copy");
    let out = common::provledger(
        &[
            "--json",
            "--nats",
            &nats.url(),
            "--data-dir",
            nowhere.to_str().unwrap(),
            "audit",
        ],
        "",
    );
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let audit: Value = serde_json::from_slice(&out.stdout).unwrap();
    let violations = audit["violations"].as_array().unwrap();
    let quarantine: Vec<u64> = violations
        .iter()
        .filter(|v| v["check"] == "quarantine")
        .map(|v| v["position"].as_u64().unwrap())
        .collect();
    assert_eq!(quarantine, vec![garbage, replayed, foreign], "{audit}");
    assert!(
        violations.iter().all(|v| v["check"] == "quarantine"),
        "{audit}"
    );
    // The one entry it could not decode is named, with its format byte; every commit it
    // decoded was of format 1: those folded, and the replayed one (the read path sets the
    // foreign one aside as outside its subject's chain before the audit sees a commit).
    assert_eq!(audit["undecodable"], 1, "{audit}");
    assert_eq!(audit["first_undecodable"]["position"], garbage, "{audit}");
    assert_eq!(audit["first_undecodable"]["format"], 0, "{audit}");
    let formats = audit["formats"].as_object().unwrap();
    assert_eq!(formats.keys().collect::<Vec<_>>(), vec!["1"], "{audit}");
    assert_eq!(
        formats["1"].as_u64(),
        audit["commits"].as_u64().map(|c| c + 1),
        "{audit}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!("the first at position {garbage}")),
        "{stderr}"
    );
}

async fn cmd_query(client: &async_nats::Client, endpoint: &str, body: Value) -> Value {
    let reply = tokio::time::timeout(
        Duration::from_secs(20),
        client.request(format!("provledger.q.{endpoint}"), body.to_string().into()),
    )
    .await
    .expect("reply in time")
    .expect("request");
    serde_json::from_slice(&reply.payload).expect("JSON reply")
}

/// The projection tree's keys with `tag` in a stopped process's data dir.
fn keys_tagged(db: &sled::Db, tag: u8) -> usize {
    let tree = db.open_tree("projection").expect("projection tree");
    tree.scan_prefix([tag]).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_services_data_dir_keeps_no_copy_of_the_log_and_history_comes_from_the_stream() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("serve");
    // A replica told to keep no copy of the stream (by default it keeps one, in a tree of
    // its own: log_copy.rs).
    let mut serve = Serve::start_with(&nats, &data, &["--no-log-copy"]);
    let client = nats.client().await;
    common::wait_ready(&client).await;
    let cluster = Uuid::now_v7();
    let aggregate = format!("cluster/{cluster}");
    let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
    cmd(
        &client,
        json!({"aggregate": aggregate, "expect": "none", "events": create}),
    )
    .await;
    let second = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": 1,
               "events": [{"cluster_status_changed": {"status": "spawning", "description": "v2"}}]}),
    )
    .await;
    let last = second["data"]["position"].as_u64().unwrap();
    cmd_query(&client, "health", json!({"min_position": last})).await;
    assert!(serve.terminate().success());

    // Given a stopped service's data dir: its entities, and no copy of the commits
    // (`c`) nor their index (`h`), which the stream holds...
    {
        let db = common::open_stopped_data_dir(&data);
        assert!(keys_tagged(&db, b'e') >= 1);
        assert_eq!(keys_tagged(&db, b'c'), 0, "a copy of the log was written");
        assert_eq!(keys_tagged(&db, b'h'), 0, "a history index was written");
    }

    // ...offline `state --at` and `replay` on that data dir say where the history is
    // (exit 1)...
    let data_arg = data.to_str().unwrap();
    for args in [
        vec![
            "--data-dir",
            data_arg,
            "state",
            aggregate.as_str(),
            "--at",
            "1",
        ],
        vec!["--data-dir", data_arg, "replay"],
    ] {
        let out = common::provledger(&args, "");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(1), "{args:?}: {text}");
        assert!(
            text.contains("keeps no copy of the log"),
            "{args:?}: {text}"
        );
        assert!(text.contains("--nats"), "{args:?}: {text}");
    }

    // ...`audit` of the stream with that data dir finds nothing wrong (no copy to differ)...
    let out = common::provledger(
        &[
            "--json",
            "--nats",
            &nats.url(),
            "--data-dir",
            data_arg,
            "audit",
        ],
        "",
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // ...and the restarted service answers the history and an earlier state from the
    // stream.
    let _serve = Serve::start_with(&nats, &data, &["--no-log-copy"]);
    common::wait_ready(&client).await;
    let history = cmd_query(&client, "history", json!({"aggregate": aggregate})).await;
    let versions: Vec<u64> = history["data"]
        .as_array()
        .expect("a history")
        .iter()
        .map(|c| c["version"].as_u64().unwrap())
        .collect();
    assert_eq!(versions, vec![1, 2], "{history}");
    let first = cmd_query(
        &client,
        "state_at",
        json!({"aggregate": aggregate, "position": last - 1}),
    )
    .await;
    assert_eq!(first["data"]["state"]["version"], 1, "{first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_whose_projector_dies_stops_answering_and_exits_non_zero() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("serve");
    let (mut serve, client) = started(&nats, &dir).await;
    let cluster = Uuid::now_v7();
    let aggregate = format!("cluster/{cluster}");
    let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
    let created = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": "none", "events": create}),
    )
    .await;
    let at = created["data"]["position"].as_u64().unwrap();
    cmd_query(&client, "health", json!({"min_position": at})).await;
    assert!(serve.terminate().success());

    // Given the stored entity of that cluster damaged while serve was stopped...
    {
        let db = common::open_stopped_data_dir(&data);
        let tree = db.open_tree("projection").unwrap();
        let mut key = vec![b'e'];
        key.extend_from_slice(&AggregateId::cluster(cluster).key_bytes());
        let value = tree.get(&key).unwrap().expect("entity stored");
        tree.insert(key, vec![value[0], 0xff, 0xff, 0xff]).unwrap();
        db.flush().unwrap();
    }
    // (with console and metrics connections holding half a request, which must not keep
    // serve alive)
    let (console, metrics) = (provledger_tests::free_port(), provledger_tests::free_port());
    let mut serve = Serve::start_with(
        &nats,
        &data,
        &[
            "--http",
            &format!("127.0.0.1:{console}"),
            "--metrics-addr",
            &format!("127.0.0.1:{metrics}"),
            "--min-position-wait",
            "20s",
        ],
    );
    common::wait_ready(&client).await;
    let _held: Vec<std::net::TcpStream> = [console, metrics]
        .iter()
        .flat_map(|&port| std::iter::repeat_n(port, 25))
        .map(|port| {
            use std::io::Write;
            let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
            s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .expect("half a request");
            s
        })
        .collect();
    // (and a query in hand, waiting for the projection to reach the next commit)
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move {
            let query = json!({"id": cluster, "min_position": at + 1});
            cmd_query(&client, "cluster.get", query).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...when a commit for it arrives, the projector cannot fold it and stops...
    let changed = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": 1,
               "events": [{"cluster_status_changed": {"status": "spawning", "description": "v2"}}]}),
    )
    .await;
    assert!(error_code(&changed).is_none(), "{changed}");
    // ...then serve does not go on answering from a frozen state: it exits non-zero.
    let status = tokio::task::spawn_blocking(move || {
        let status = serve.wait_for_exit(Duration::from_secs(20));
        (serve, status)
    })
    .await
    .unwrap()
    .1
    .expect("serve exited on its own");
    assert!(!status.success(), "{status:?}");
    let log = std::fs::read_to_string(data.with_extension("log")).unwrap_or_default();
    assert!(log.contains("the projector stopped"), "{log}");
    // And the query that waited is answered `unavailable`, not `stale`: this replica will
    // never get there.
    let waited = waiting.await.unwrap();
    assert_eq!(error_code(&waited), Some("unavailable"), "{waited}");
    let message = waited["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("projector stopped"), "{waited}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_requests_and_answers_always_get_a_reply() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;

    // An error that would echo a 700 kB aggregate string (twice: body and header) is
    // answered, with the echo cut.
    let huge = format!("cluster/{}", "x".repeat(700_000));
    let reply = cmd(
        &client,
        json!({"aggregate": huge, "expect": "any", "events": []}),
    )
    .await;
    assert_eq!(
        error_code(&reply),
        Some("bad_request"),
        "{:.300}",
        reply.to_string()
    );
    assert!(reply.to_string().len() < 4096, "the echo is bounded");
    // An error says which replica answered, as every reply does.
    assert!(reply["served_by"].is_string(), "{reply}");

    // A step naming an executor that would forge metric lines, or address another
    // executor's subjects, is refused naming the grammar; nothing is written.
    let mut step = samples::all()
        .into_iter()
        .find(|e| matches!(e, Event::StepStarted { .. }))
        .expect("a step_started sample");
    if let Event::StepStarted { executor, .. } = &mut step {
        *executor = "evil\"} 7\nprovledger_ready 0\nprovledger_injected{a=\"".into();
    }
    let operation = format!("operation/{}", Uuid::now_v7());
    let reply = cmd(
        &client,
        json!({"aggregate": operation, "expect": "any", "events": [step]}),
    )
    .await;
    assert_eq!(error_code(&reply), Some("bad_request"), "{reply}");
    assert!(
        reply.to_string().contains("not an executor name"),
        "{reply}"
    );

    // Three clusters whose descriptions weigh 400 kB each: lists and histories would
    // exceed a reply; they come in pages bounded by bytes, and nothing is lost.
    let big = "d".repeat(400_000);
    let mut ids = Vec::new();
    let mut last = 0;
    for _ in 0..3 {
        let cluster = Uuid::now_v7();
        let aggregate = format!("cluster/{cluster}");
        let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
        let created = cmd(
            &client,
            json!({"aggregate": aggregate, "expect": "none", "events": create}),
        )
        .await;
        assert!(error_code(&created).is_none(), "{created}");
        for v in 1..=2 {
            let changed = cmd(
                &client,
                json!({"aggregate": aggregate, "expect": v,
                       "events": [{"cluster_status_changed": {"status": "spawning", "description": big}}]}),
            )
            .await;
            assert!(
                error_code(&changed).is_none(),
                "{:.300}",
                changed.to_string()
            );
            last = changed["data"]["position"].as_u64().unwrap();
        }
        ids.push(cluster);
    }
    cmd_query(&client, "health", json!({"min_position": last})).await;
    // The list, page by page with `after`.
    let mut listed = BTreeSet::new();
    let mut after: Option<String> = None;
    for _ in 0..10 {
        let mut request = json!({"limit": 100});
        if let Some(a) = &after {
            request["after"] = json!(a);
        }
        let page = cmd_query(&client, "cluster.list", request).await;
        assert!(page["error"].is_null(), "{:.300}", page.to_string());
        let items = page["data"].as_array().unwrap();
        if items.is_empty() {
            break;
        }
        for item in items {
            listed.insert(item["id"].as_str().unwrap().to_string());
        }
        after = items.last().map(|i| i["id"].as_str().unwrap().to_string());
    }
    for id in &ids {
        assert!(listed.contains(&id.to_string()), "{id} listed");
    }
    // A history of 800 kB, page by page with `from_version`.
    let aggregate = format!("cluster/{}", ids[0]);
    let mut versions = Vec::new();
    let mut from = 1;
    for _ in 0..10 {
        let page = cmd_query(
            &client,
            "history",
            json!({"aggregate": aggregate, "from_version": from}),
        )
        .await;
        assert!(page["error"].is_null(), "{:.300}", page.to_string());
        let items = page["data"].as_array().unwrap();
        if items.is_empty() {
            break;
        }
        for item in items {
            versions.push(item["version"].as_u64().unwrap());
        }
        from = versions.last().unwrap() + 1;
    }
    assert_eq!(versions, vec![1, 2, 3]);
}

/// A cluster created through cmd.append (version 1): its id and `cluster/<id>`.
async fn created_cluster(client: &async_nats::Client) -> (Uuid, String) {
    let cluster = Uuid::now_v7();
    let aggregate = format!("cluster/{cluster}");
    let create = serde_json::to_value(vec![samples::all().remove(0)]).unwrap();
    let reply = cmd(
        client,
        json!({"aggregate": aggregate, "expect": "none", "events": create}),
    )
    .await;
    assert!(error_code(&reply).is_none(), "{reply}");
    (cluster, aggregate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_a_subject_never_turns_a_right_expectation_into_a_conflict() {
    // Given a cluster at version 1 that serve has just written (so it knows its head),
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let (cluster, aggregate) = created_cluster(&client).await;
    let subject = format!("provledger.ev.cluster.{cluster}");
    for version in 1..=3u64 {
        // when garbage lands on its subject after that head (quarantined by readers),
        publish_raw(&nats, subject.clone(), b"not a commit".to_vec()).await;
        // then an append expecting the right version lands at the next one,
        let reply = cmd(
            &client,
            json!({"aggregate": aggregate, "expect": version, "events":
                [{"cluster_status_changed": {"status": "spawning", "description": format!("v{}", version + 1)}}]}),
        )
        .await;
        assert!(error_code(&reply).is_none(), "expect {version}: {reply}");
        assert_eq!(reply["data"]["version"], version + 1, "{reply}");
    }
    // and a wrong one is still a conflict naming the real version.
    let reply = cmd(
        &client,
        json!({"aggregate": aggregate, "expect": 2, "events":
            [{"cluster_status_changed": {"status": "spawning", "description": "stale"}}]}),
    )
    .await;
    assert_eq!(error_code(&reply), Some("conflict"), "{reply}");
    assert_eq!(reply["error"]["actual_version"], 4, "{reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_writers_racing_the_same_expectation_have_exactly_one_winner_each_round() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let (_, aggregate) = created_cluster(&client).await;
    for round in 1..=10u64 {
        // Given the cluster at version `round`, when 50 writers all expect it,
        let writers = (0..50).map(|w| {
            let client = client.clone();
            let body = json!({"aggregate": aggregate, "expect": round, "events":
                [{"cluster_status_changed": {"status": "spawning", "description": format!("round {round} writer {w}")}}]});
            async move { cmd(&client, body).await }
        });
        let replies = futures::future::join_all(writers).await;
        // then exactly one lands, at the next version, and every other one is a conflict
        // that names that version (never `unavailable`, never a second winner).
        let winners: Vec<&Value> = replies.iter().filter(|r| error_code(r).is_none()).collect();
        assert_eq!(winners.len(), 1, "round {round}: {replies:?}");
        assert_eq!(winners[0]["data"]["version"], round + 1, "{replies:?}");
        for loser in replies.iter().filter(|r| error_code(r).is_some()) {
            assert_eq!(
                error_code(loser),
                Some("conflict"),
                "round {round}: {loser}"
            );
            assert_eq!(loser["error"]["actual_version"], round + 1, "{loser}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_the_duplicate_window_answers_its_first_position() {
    use provledger_client::write::Recorded;
    use provledger_events::{AppendStatus, CommitDraft, Expectation};
    // Given a stream whose duplicate window is one second, and a commit written by one
    // process followed by more commits than another process keeps the ids of (so that only
    // the log can recognise the retry),
    let nats = NatsServer::start().await;
    let config = JetStreamConfig {
        stream: "SHORTDUP".into(),
        subject_prefix: "sd".into(),
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    };
    let first = Writer::new(
        JetStreamLog::open(nats.client().await, config.clone())
            .await
            .expect("open"),
    );
    let cluster = AggregateId::cluster(Uuid::now_v7());
    let create = CommitDraft::now("test", vec![samples::all().remove(0)]);
    first
        .record(cluster, Expectation::NoStream, create)
        .await
        .expect("create");
    let status = |n: usize| Event::ClusterStatusChanged {
        status: ClusterStatus::Spawning,
        description: format!("step {n}"),
    };
    let retried = CommitDraft::now("test", vec![status(0)]);
    let Recorded::Appended(original) = first
        .record(cluster, Expectation::Any, retried.clone())
        .await
        .expect("the original")
    else {
        panic!("the original was not appended");
    };
    let more = provledger_client::write::RECENT_COMMITS_MAX + 30;
    for n in 1..=more {
        let d = CommitDraft::now("test", vec![status(n)]);
        first
            .record(cluster, Expectation::Any, d)
            .await
            .expect("more");
    }
    // when another process retries it once the window has passed,
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let second = Writer::new(
        JetStreamLog::open(nats.client().await, config)
            .await
            .expect("open"),
    );
    let again = second
        .record(cluster, Expectation::Any, retried.clone())
        .await
        .expect("the retry");
    // then it answers the first position and nothing was written twice.
    let Recorded::Appended(outcome) = again else {
        panic!("the retry was not recognised: {again:?}");
    };
    assert_eq!(outcome.status, AppendStatus::AlreadyAppended);
    assert_eq!(outcome.position, original.position);
    let commits = second.log().read_aggregate(cluster).await.unwrap();
    assert_eq!(commits.len(), 2 + more);
    assert_eq!(
        commits
            .iter()
            .filter(|c| c.commit_id == retried.commit_id)
            .count(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_on_several_aggregates_are_written_all_or_nothing_over_nats() {
    // Given two clusters at version 1, written through serve.
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let (_, first) = created_cluster(&client).await;
    let (_, second) = created_cluster(&client).await;
    let status = |description: &str| json!([{"cluster_status_changed": {"status": "spawning", "description": description}}]);
    let log = open_log(&nats).await;
    let end = log.last_position().await.unwrap();

    // When one request carries a commit on each, one of them with a stale expectation,
    let reply = cmd(
        &client,
        json!({"commits": [
            {"aggregate": first, "expect": 1, "events": status("a")},
            {"aggregate": second, "expect": 0, "events": status("b")},
        ]}),
    )
    .await;
    // then nothing is written and the stale one is named with its actual version.
    assert_eq!(error_code(&reply), Some("conflict"), "{reply}");
    let conflicts = reply["error"]["conflicts"].as_array().expect("conflicts");
    assert_eq!(conflicts.len(), 1, "{reply}");
    assert_eq!(conflicts[0]["aggregate"], second, "{reply}");
    assert_eq!(conflicts[0]["actual_version"], 1, "{reply}");
    assert_eq!(log.last_position().await.unwrap(), end);

    // When a commit that cannot be on its aggregate rides with a good one, nothing is
    // written either, and the error says which commit.
    let reply = cmd(
        &client,
        json!({"commits": [
            {"aggregate": first, "expect": 1, "events": status("a")},
            {"aggregate": second, "expect": "any", "events": [{"instance_deleted": {}}]},
        ]}),
    )
    .await;
    assert_eq!(error_code(&reply), Some("bad_request"), "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("commits[1].events"),
        "{reply}"
    );
    assert_eq!(log.last_position().await.unwrap(), end);

    // When both expectations hold, both land at consecutive positions; the same request
    // again (same commit ids) is answered as already appended, writing nothing.
    let request = json!({"commits": [
        {"aggregate": first, "expect": 1, "commit_id": Uuid::now_v7(), "events": status("a")},
        {"aggregate": second, "expect": 1, "commit_id": Uuid::now_v7(), "events": status("b")},
    ]});
    let reply = cmd(&client, request.clone()).await;
    assert!(error_code(&reply).is_none(), "{reply}");
    let commits = reply["data"]["commits"].as_array().expect("commits");
    assert_eq!(commits[0]["position"], end + 1, "{reply}");
    assert_eq!(commits[1]["position"], end + 2, "{reply}");
    assert_eq!(commits[0]["version"], 2, "{reply}");
    assert_eq!(commits[1]["outcome"], "appended", "{reply}");
    let again = cmd(&client, request).await;
    assert_eq!(
        again["data"]["commits"][0]["outcome"], "already_appended",
        "{again}"
    );
    assert_eq!(again["data"]["commits"][1]["position"], end + 2, "{again}");
    assert_eq!(log.last_position().await.unwrap(), end + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_and_the_step_that_accounts_for_it_are_one_atomic_batch() {
    use provledger_sim::{register_compute_node, InstanceRequest, Provisioner, SimInfrastructure};
    // Given a boot on a JetStream ledger.
    let nats = NatsServer::start().await;
    let log = open_log(&nats).await;
    let ledger = Writer::new(provledger_client::Ledger::JetStream(log.clone()));
    let provider = Uuid::now_v7();
    register_compute_node(&ledger, provider, "cn", 64, "test")
        .await
        .expect("provider");
    let runner = provledger_client::OperationRunner::new(
        ledger.clone(),
        provledger_client::CancelNotices::local(),
        None,
        "test",
    );
    let prov = Provisioner::new(
        runner,
        std::sync::Arc::new(SimInfrastructure::default()),
        "test",
    );
    let instance = Uuid::now_v7();
    let report = prov
        .boot_instance(
            InstanceRequest {
                instance_id: instance,
                name: "vm".into(),
                resources: [("VCPU".to_string(), 2)].into(),
                provider,
            },
            None,
        )
        .await;
    assert!(report.result.is_ok(), "{:?}", report.result);
    // When the claim's and the step record's messages are read back from the stream,
    let claim = log
        .read_aggregate(AggregateId::provider(provider))
        .await
        .unwrap()
        .into_iter()
        .find(|c| matches!(c.events[0], Event::AllocationClaimed { .. }))
        .expect("the claim");
    let step = log
        .read_aggregate(AggregateId::operation(report.operation_id))
        .await
        .unwrap()
        .into_iter()
        .find(|c| {
            matches!(&c.events[0], Event::StepDone { step, .. } if step == &format!("claim:{instance}"))
        })
        .expect("the claim's step");
    let client = nats.client().await;
    let batch_of = |position: u64| {
        let client = client.clone();
        async move {
            let reply = client
                .request(
                    "$JS.API.DIRECT.GET.PROVLEDGER",
                    json!({ "seq": position }).to_string().into(),
                )
                .await
                .expect("direct get");
            reply
                .headers
                .and_then(|h| h.get("Nats-Batch-Id").map(|v| v.to_string()))
        }
    };
    // then they sit side by side and carry the same atomic batch id.
    assert_eq!(step.position, claim.position + 1);
    let batch = batch_of(claim.position).await;
    assert!(batch.is_some(), "the claim was written in an atomic batch");
    assert_eq!(batch_of(step.position).await, batch);
}

/// A request of commits on two clusters; the reply's JSON, or `None` when no answer came
/// within `wait` (serve gone, say).
async fn try_cmd(client: &async_nats::Client, body: &Value, wait: Duration) -> Option<Value> {
    let reply = tokio::time::timeout(wait, client.request(CMD, body.to_string().into())).await;
    match reply {
        Ok(Ok(reply)) => serde_json::from_slice(&reply.payload).ok(),
        _ => None,
    }
}

fn pair_request(first: &str, second: &str, expect_first: Value, n: usize) -> Value {
    let status =
        |d: String| json!([{"cluster_status_changed": {"status": "spawning", "description": d}}]);
    json!({"commits": [
        {"aggregate": first, "expect": expect_first, "commit_id": Uuid::now_v7(), "events": status(format!("a{n}"))},
        {"aggregate": second, "expect": "any", "commit_id": Uuid::now_v7(), "events": status(format!("b{n}"))},
    ]})
}

/// The commit ids of an aggregate's history, read from the stream.
async fn commit_ids(log: &JetStreamLog, aggregate: &str) -> Vec<Uuid> {
    let aggregate: AggregateId = aggregate.parse().unwrap();
    let commits = log.read_aggregate(aggregate).await.unwrap();
    commits.iter().map(|c| c.commit_id).collect()
}

fn ids_of(request: &Value) -> Vec<(String, Uuid)> {
    request["commits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let id = c["commit_id"].as_str().unwrap().parse().unwrap();
            (c["aggregate"].as_str().unwrap().to_string(), id)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_atomic_requests_at_once_one_in_eight_stale_only_the_stale_are_refused() {
    // Given 128 clusters at version 1 written through serve, four of which another process
    // then moved to version 2 behind serve's back (so serve's shared batch is refused by
    // the server, not by what serve knows, and must be split),
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, client) = started(&nats, &dir).await;
    let mut clusters = Vec::new();
    for _ in 0..128 {
        clusters.push(created_cluster(&client).await.1);
    }
    let log = open_log(&nats).await;
    let moved: BTreeSet<usize> = [1, 17, 33, 49].into();
    for &r in &moved {
        let status = samples::all()
            .into_iter()
            .find(|e| matches!(e, Event::ClusterStatusChanged { .. }))
            .unwrap();
        let draft = provledger_events::CommitDraft::now("other", vec![status]);
        log.append(
            clusters[2 * r].parse().unwrap(),
            provledger_events::Expectation::Exactly(1),
            draft,
        )
        .await
        .unwrap();
    }
    // when 64 requests on two clusters each arrive at once, every 8th expecting version 0
    // of its first cluster (stale), the moved ones expecting 2 (true), the rest 1,
    let stale = |r: usize| r % 8 == 6;
    let requests: Vec<Value> = (0..64)
        .map(|r| {
            let expect = match (stale(r), moved.contains(&r)) {
                (true, _) => json!(0),
                (false, true) => json!(2),
                (false, false) => json!(1),
            };
            pair_request(&clusters[2 * r], &clusters[2 * r + 1], expect, r)
        })
        .collect();
    let replies =
        futures::future::join_all(requests.iter().map(|body| cmd(&client, body.clone()))).await;

    // then exactly the stale ones are refused, naming their first cluster at version 1,
    for (r, reply) in replies.iter().enumerate() {
        if stale(r) {
            assert_eq!(error_code(reply), Some("conflict"), "request {r}: {reply}");
            let conflicts = reply["error"]["conflicts"].as_array().expect("conflicts");
            assert_eq!(conflicts.len(), 1, "{reply}");
            assert_eq!(conflicts[0]["aggregate"], clusters[2 * r], "{reply}");
            assert_eq!(conflicts[0]["actual_version"], 1, "{reply}");
        } else {
            assert!(error_code(reply).is_none(), "request {r}: {reply}");
            let commits = reply["data"]["commits"].as_array().unwrap();
            let first = commits[0]["position"].as_u64().unwrap();
            assert_eq!(commits[1]["position"], first + 1, "request {r}: {reply}");
        }
    }
    // and an independent read of every cluster's history finds each request whole or
    // absent, as answered.
    for (r, request) in requests.iter().enumerate() {
        for (aggregate, id) in ids_of(request) {
            let held = commit_ids(&log, &aggregate).await.contains(&id);
            assert_eq!(
                held,
                !stale(r),
                "request {r}: {aggregate} holds {id}: {held}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_killed_during_group_commits_leaves_every_request_whole_or_absent() {
    // Given 32 writers each sending atomic requests on its own two clusters through serve,
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (mut serve, client) = started(&nats, &dir).await;
    let mut clusters = Vec::new();
    for _ in 0..64 {
        clusters.push(created_cluster(&client).await.1);
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let appended_so_far = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writers: Vec<_> = (0..32)
        .map(|w| {
            let (client, stop) = (client.clone(), stop.clone());
            let appended_so_far = appended_so_far.clone();
            let (first, second) = (clusters[2 * w].clone(), clusters[2 * w + 1].clone());
            tokio::spawn(async move {
                let mut sent = Vec::new();
                let mut n = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let request = pair_request(&first, &second, json!("any"), n);
                    n += 1;
                    let reply = try_cmd(&client, &request, Duration::from_secs(2)).await;
                    let appended = reply
                        .as_ref()
                        .is_some_and(|r| r["data"]["commits"].is_array());
                    if appended {
                        appended_so_far.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    sent.push((request, appended));
                    if reply.is_none() {
                        break;
                    }
                }
                sent
            })
        })
        .collect();
    // when serve is killed with SIGKILL while they write (once 64 requests were answered,
    // whatever the machine's pace), then restarted,
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while appended_so_far.load(std::sync::atomic::Ordering::Relaxed) <= 64 {
        assert!(
            std::time::Instant::now() < deadline,
            "the writers never got 64 requests answered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    serve.kill();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut sent = Vec::new();
    for w in writers {
        sent.extend(w.await.unwrap());
    }
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    common::wait_ready(&client).await;

    // then every request answered as appended is there whole, every other one is whole or
    // absent,
    let log = open_log(&nats).await;
    let mut histories = std::collections::HashMap::new();
    for aggregate in &clusters {
        histories.insert(aggregate.clone(), commit_ids(&log, aggregate).await);
    }
    let answered = sent.iter().filter(|(_, a)| *a).count();
    assert!(
        answered > 32,
        "only {answered} requests were answered before the kill"
    );
    let mut unanswered = Vec::new();
    for (request, appended) in &sent {
        let held: Vec<bool> = ids_of(request)
            .iter()
            .map(|(aggregate, id)| histories[aggregate].contains(id))
            .collect();
        assert!(held[0] == held[1], "a request written in part: {request}");
        if *appended {
            assert!(
                held[0],
                "a request answered as appended is missing: {request}"
            );
        } else {
            unanswered.push((request.clone(), held[0]));
        }
    }
    eprintln!(
        "{} requests, {answered} answered, {} unanswered of which {} landed",
        sent.len(),
        unanswered.len(),
        unanswered.iter().filter(|(_, landed)| *landed).count()
    );
    // and a retry of each unanswered request (same commit ids) is recognised if it landed,
    // written once if it did not.
    for (request, landed) in &unanswered {
        let reply = cmd(&client, request.clone()).await;
        assert!(error_code(&reply).is_none(), "retry: {reply}");
        let outcome = &reply["data"]["commits"][0]["outcome"];
        match landed {
            true => assert_eq!(outcome, "already_appended", "{reply}"),
            false => assert_eq!(outcome, "appended", "{reply}"),
        }
        for (aggregate, id) in ids_of(request) {
            let ids = commit_ids(&log, &aggregate).await;
            assert_eq!(
                ids.iter().filter(|i| **i == id).count(),
                1,
                "{aggregate}: {id}"
            );
        }
    }
}

/// `provledger_append_races_lost_total` of serve on `port`.
fn races_lost(port: u16) -> f64 {
    let (_, scrape) = common::http_get(port, "/metrics").expect("a scrape");
    common::sample(&scrape, "provledger_append_races_lost_total").unwrap_or(-1.0)
}

/// Given a provider serve wrote to, then another process took 200 commits further, and
/// serve's projection followed, when serve is asked to write to it again, then the write
/// lands at the next version without an append refused on the state serve kept from its
/// own last write (`provledger_append_races_lost_total` stays 0, where it was 1 before
/// serve's projector told its writer what it folded), and without reading the stream
/// first: the projector read the provider's head from the stream, which the append
/// expects (it was a read after the store's tip and one of the tip itself before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_after_another_process_deepened_the_aggregate_appends_at_the_folded_head() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = provledger_tests::free_port();
    let metrics = ["--metrics-addr", &format!("127.0.0.1:{port}")];
    let _serve = Serve::start_with(&nats, &dir.path().join("serve"), &metrics);
    let client = nats.client().await;
    common::wait_ready(&client).await;
    let provider = Uuid::now_v7();
    let subject = format!("provider/{provider}");
    let inventory = |total: u64| {
        json!([{"inventory_set": {"resource_class": "VCPU", "inventory": {
            "total": total, "reserved": 0, "allocation_ratio": 1.0,
            "min_unit": 1, "max_unit": 8, "step_size": 1}}}])
    };
    let created = cmd(
        &client,
        json!({"aggregate": subject, "expect": "none", "events": provider_events()}),
    )
    .await;
    assert!(error_code(&created).is_none(), "{created}");
    let log = open_log(&nats).await;
    let aggregate = AggregateId::provider(provider);
    for v in 1..=200u64 {
        let draft = provledger_events::CommitDraft::now(
            "another process",
            vec![Event::InventorySet {
                resource_class: "VCPU".into(),
                inventory: provledger_events::catalogue::Inventory {
                    total: 8 + v % 2,
                    reserved: 0,
                    allocation_ratio: provledger_events::catalogue::Ratio::ONE,
                    min_unit: 1,
                    max_unit: 8,
                    step_size: 1,
                },
            }],
        );
        log.append(aggregate, provledger_events::Expectation::Exactly(v), draft)
            .await
            .expect("another process deepens the provider");
    }
    let end = log.last_position().await.unwrap();
    common::wait_position(&client, end).await;
    // (Every direct get of the stream is seen: of the provider's subject, or of its tip.)
    let mut direct_gets = client
        .subscribe("$JS.API.DIRECT.GET.PROVLEDGER.>")
        .await
        .unwrap();
    let mut batch_gets = client
        .subscribe("$JS.API.DIRECT.GET.PROVLEDGER")
        .await
        .unwrap();
    client.flush().await.unwrap();

    // ...when serve writes to it again...
    let written = cmd(
        &client,
        json!({"aggregate": subject, "expect": "any", "events": inventory(12)}),
    )
    .await;

    // ...then it lands at version 202, no append was refused on serve's old state...
    assert!(error_code(&written).is_none(), "{written}");
    assert_eq!(written["data"]["version"], 202, "{written}");
    assert_eq!(races_lost(port), 0.0);
    // ...and the provider was not read first.
    client.flush().await.unwrap();
    let tip = format!(r#""seq":{end}"#);
    let mut reads = Vec::new();
    while let Ok(Some(m)) =
        tokio::time::timeout(Duration::from_millis(200), direct_gets.next()).await
    {
        if m.subject.contains(&provider.to_string()) {
            reads.push(m.subject.to_string());
        }
    }
    while let Ok(Some(m)) =
        tokio::time::timeout(Duration::from_millis(200), batch_gets.next()).await
    {
        let body = String::from_utf8_lossy(&m.payload).replace(' ', "");
        if body.contains(&provider.to_string()) || body.contains(&tip) {
            reads.push(body);
        }
    }
    assert!(reads.is_empty(), "read before the append: {reads:?}");
}
