//! A new replica bootstrapped from a snapshot another replica published
//! (`--snapshot-bucket`), against a private nats-server: it answers every query as a
//! replica that caught up from position 1, and a snapshot with one byte flipped is refused,
//! the replica then catching up from position 1 to the same state.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use proptest::strategy::{Strategy, ValueTree};
use provledger_events::catalogue::ConsumerKind;
use provledger_events::{AggregateId, CommitDraft, Event, EventLog, Expectation, JetStreamLog};
use provledger_projections::Projection;
use provledger_tests::{script, NatsServer};
use serde_json::{json, Value};
use tokio::io::AsyncReadExt;
use uuid::Uuid;

use crate::common;
use crate::common::{quiet_end, Serve};

const BUCKET: &str = "PROVLEDGER_SNAPSHOTS";

async fn ask(client: &async_nats::Client, endpoint: &str, body: Value) -> Value {
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.request(format!("provledger.q.{endpoint}"), body.to_string().into()),
    )
    .await
    .expect("reply in time")
    .expect("request");
    serde_json::from_slice(&reply.payload).expect("JSON reply")
}

/// Waits until a replica answers health at `position` exactly, ready.
async fn wait_ready_at(client: &async_nats::Client, position: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = Value::Null;
    loop {
        let reply = tokio::time::timeout(
            Duration::from_secs(1),
            client.request("provledger.q.health", "{}".into()),
        )
        .await;
        if let Ok(Ok(msg)) = reply {
            if let Ok(v) = serde_json::from_slice::<Value>(&msg.payload) {
                if v["position"].as_u64() >= Some(position) && v["data"]["ready"] == json!(true) {
                    return;
                }
                last = v;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no replica became ready at {position}: {last}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Given a stream holding a script of commits over the script's pool and 150 providers
/// of their own (each its inventory and a few claims): the aggregates written.
async fn write_history(log: &JetStreamLog, steps: usize, seed_round: usize) -> Vec<AggregateId> {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut script_steps = Vec::new();
    for _ in 0..=seed_round {
        script_steps.clear();
        while script_steps.len() < steps {
            script_steps.extend(script::script(400).new_tree(&mut runner).unwrap().current());
        }
    }
    let mut aggregates = script::aggregate_pool();
    let providers: Vec<AggregateId> = (0..150u128)
        .map(|n| AggregateId::provider(Uuid::from_u128(0xB00 + n + 1000 * seed_round as u128)))
        .collect();
    for (i, (agg, events)) in script_steps.into_iter().take(steps).enumerate() {
        append(log, agg, events).await;
        let provider = providers[i % providers.len()];
        let event = match i / providers.len() {
            0 => Event::InventorySet {
                resource_class: "VCPU".into(),
                inventory: provledger_tests::workload::vcpu_inventory(64),
            },
            _ => Event::AllocationClaimed {
                consumer: Uuid::from_u128(i as u128 + 1),
                consumer_kind: ConsumerKind::Instance,
                resources: BTreeMap::from([("VCPU".to_string(), 1)]),
            },
        };
        append(log, provider, vec![event]).await;
    }
    aggregates.extend(providers);
    aggregates
}

async fn append(log: &JetStreamLog, agg: AggregateId, events: Vec<Event>) {
    log.append(agg, Expectation::Any, CommitDraft::now("test", events))
        .await
        .expect("append");
}

/// The position of the snapshot published in the bucket, once there is one.
async fn published_position(log: &JetStreamLog) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(store) = log.context().get_object_store(BUCKET).await {
            if let Ok(info) = store.info("projection").await {
                if let Some(p) = info.metadata.get("position").and_then(|p| p.parse().ok()) {
                    return p;
                }
            }
        }
        assert!(Instant::now() < deadline, "no snapshot was published");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The bytes of the snapshot published in the bucket.
async fn published_bytes(log: &JetStreamLog) -> Vec<u8> {
    let store = log.context().get_object_store(BUCKET).await.unwrap();
    let mut bytes = Vec::new();
    let mut object = store.get("projection").await.unwrap();
    object.read_to_end(&mut bytes).await.unwrap();
    bytes
}

/// Publishes `bytes` in place of the bucket's snapshot (the object store's own digest
/// then matches them).
async fn republish(log: &JetStreamLog, bytes: &[u8]) {
    let store = log.context().get_object_store(BUCKET).await.unwrap();
    store.put("projection", &mut &bytes[..]).await.unwrap();
}

/// Everything a replica answers about each aggregate: its state, its whole history,
/// and its state at `earlier` (a position the snapshot covers).
async fn answers(
    client: &async_nats::Client,
    aggregates: &[AggregateId],
    earlier: u64,
) -> Vec<(AggregateId, Value, Value, Value)> {
    let mut out = Vec::new();
    for agg in aggregates {
        let get = ask(client, &format!("{}.get", agg.kind), json!({"id": agg.id})).await;
        let mut history = Vec::new();
        let mut from = 1;
        loop {
            let page = ask(
                client,
                "history",
                json!({"aggregate": agg.to_string(), "from_version": from}),
            )
            .await;
            let Some(commits) = page["data"].as_array().filter(|c| !c.is_empty()) else {
                break;
            };
            from += commits.len() as u64;
            history.extend(commits.iter().cloned());
        }
        let at = ask(
            client,
            "state_at",
            json!({"aggregate": agg.to_string(), "position": earlier}),
        )
        .await;
        // Everything but which replica answered.
        let answered = |v: Value| json!({"data": v["data"], "position": v["position"]});
        out.push((*agg, answered(get), Value::Array(history), answered(at)));
    }
    out
}

/// Where two JSON values first differ, and how.
fn difference(a: &Value, b: &Value) -> String {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) if w == v => {}
                    Some(w) => return format!("{k}/{}", difference(v, w)),
                    None => return format!("{k} (only in the first)"),
                }
            }
            let extra: Vec<_> = y.keys().filter(|k| !x.contains_key(*k)).collect();
            format!("{extra:?} (only in the second)")
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            let i = x.iter().zip(y).position(|(v, w)| v != w).unwrap_or(0);
            format!("[{i}]/{}", difference(&x[i], &y[i]))
        }
        _ => format!(": {a} vs {b}"),
    }
}

/// Every aggregate as served equals a rebuild of the whole stream, its history whole.
/// serve's rollback worker may still write while this compares (a compensation retried
/// after its backoff, which can outlast `quiet_end`'s second): a comparison during which
/// the stream moved is taken again at the new end, a few times at most; one taken on a
/// stream that did not move must hold.
async fn assert_answers_the_rebuild(
    client: &async_nats::Client,
    log: &JetStreamLog,
    aggregates: &[AggregateId],
    end: u64,
) {
    const ATTEMPTS: usize = 5;
    let mut compared = 0;
    for attempt in 1..=ATTEMPTS {
        let commits = crate::common::stream_commits(log).await;
        let at = commits.last().map_or(end, |c| c.position.max(end));
        wait_ready_at(client, at).await;
        let rebuilt = Projection::rebuild(&commits);
        let served = answers(client, aggregates, at).await;
        let moved = log.last_position().await.unwrap() != at;
        let mut mismatch = None;
        compared = 0;
        for (agg, get, history, _) in &served {
            let Some(expected) = rebuilt.get(agg) else {
                continue;
            };
            let versions = history.as_array().map(Vec::len);
            if get["data"] != expected.view()
                || versions != Some(expected.header().version as usize)
            {
                mismatch = Some(format!(
                    "{agg} at position {at}: served {} ({versions:?} commits in its history), rebuilt {}",
                    get["data"],
                    expected.view()
                ));
                break;
            }
            compared += 1;
        }
        match mismatch {
            None => break,
            Some(_) if moved && attempt < ATTEMPTS => continue,
            Some(m) => panic!("{m} (the stream moved meanwhile: {moved})"),
        }
    }
    assert!(compared > 150, "{compared} aggregates compared");
    // The stream holds nothing outside a chain: a replica that folded it from position 1
    // on a fresh store (nothing left of a refused import) quarantined nothing.
    let health: Value = serde_json::from_slice(
        &client
            .request("provledger.q.health", "{}".into())
            .await
            .unwrap()
            .payload,
    )
    .unwrap();
    assert_eq!(health["data"]["quarantined"], json!(0), "{health}");
}

fn log_of(dir: &Path) -> String {
    std::fs::read_to_string(dir.with_extension("log")).unwrap_or_default()
}

/// A replica with the bucket, started on a stream, that publishes a snapshot and stops:
/// the snapshot's position.
async fn publish_a_snapshot(nats: &NatsServer, log: &JetStreamLog, dir: &Path) -> u64 {
    let end = log.last_position().await.unwrap();
    let mut publisher = Serve::start_with(nats, dir, &["--snapshot-bucket", BUCKET]);
    wait_ready_at(&nats.client().await, end).await;
    let position = published_position(log).await;
    assert!(publisher.terminate().success());
    position
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_bootstrapped_from_a_snapshot_answers_as_one_that_caught_up() {
    // Given a stream, a replica that published a snapshot of it, then more commits,
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let log = common::stream(&nats).await;
    let dir = tempfile::tempdir().unwrap();
    let mut aggregates = write_history(&log, 400, 0).await;
    let snapshot = publish_a_snapshot(&nats, &log, &dir.path().join("publisher")).await;
    assert!(
        snapshot > 100,
        "the snapshot covers the history: {snapshot}"
    );
    aggregates.extend(write_history(&log, 200, 1).await);
    let end = log.last_position().await.unwrap();

    // when a new replica starts with the bucket,
    let bootstrapped_dir = dir.path().join("bootstrapped");
    let mut bootstrapped =
        Serve::start_with(&nats, &bootstrapped_dir, &["--snapshot-bucket", BUCKET]);
    wait_ready_at(&client, end).await;
    // (serve's own writes, a rollback finished, all landed: the stream is quiet),
    let end = quiet_end(&log).await;
    wait_ready_at(&client, end).await;
    // then it bootstrapped from the snapshot and followed the stream from there,
    assert!(
        log_of(&bootstrapped_dir).contains("bootstrapped from a published snapshot"),
        "{}",
        log_of(&bootstrapped_dir)
    );
    let from_snapshot = answers(&client, &aggregates, snapshot / 2).await;
    assert!(bootstrapped.terminate().success());

    // and it answers every query exactly as a replica that caught up from position 1.
    let caught_up_dir = dir.path().join("caught-up");
    let mut caught_up = Serve::start(&nats, &caught_up_dir);
    wait_ready_at(&client, end).await;
    let from_the_start = answers(&client, &aggregates, snapshot / 2).await;
    assert!(caught_up.terminate().success());
    assert_eq!(from_snapshot.len(), from_the_start.len());
    for (a, b) in from_snapshot.iter().zip(&from_the_start) {
        for (what, x, y) in [
            ("state", &a.1, &b.1),
            ("history", &a.2, &b.2),
            ("earlier state", &a.3, &b.3),
        ] {
            assert!(
                x == y,
                "{}: its {what} differs at {}",
                a.0,
                difference(x, y)
            );
        }
    }
    let written: Vec<_> = from_the_start
        .iter()
        .filter(|(_, get, _, _)| get["data"].is_object())
        .collect();
    assert!(written.len() > 150, "{} aggregates compared", written.len());
}

/// A new replica started with the bucket in `dir`/replica: it refuses the published
/// snapshot (its log says why, with `why` in it), never says it bootstrapped from it, and
/// catches up from position 1 to the stream's state at `end`, entity by entity, its
/// history whole; then it stops cleanly.
async fn a_new_replica_refuses_the_snapshot(
    nats: &NatsServer,
    log: &JetStreamLog,
    dir: &Path,
    aggregates: &[AggregateId],
    end: u64,
    why: &str,
) {
    let client = nats.client().await;
    let replica_dir = dir.join("replica");
    let mut replica = Serve::start_with(nats, &replica_dir, &["--snapshot-bucket", BUCKET]);
    wait_ready_at(&client, end).await;
    let said = log_of(&replica_dir);
    assert!(
        said.contains("snapshot not used") && said.contains(why),
        "{said}"
    );
    assert!(
        !said.contains("bootstrapped from a published snapshot"),
        "{said}"
    );
    assert_answers_the_rebuild(&client, log, aggregates, end).await;
    assert!(replica.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_with_one_flipped_byte_is_refused_and_the_replica_catches_up_from_position_1() {
    // Given a published snapshot with one byte of its body flipped (republished, so the
    // object store's own digest matches what it holds),
    let nats = NatsServer::start().await;
    let log = common::stream(&nats).await;
    let dir = tempfile::tempdir().unwrap();
    let aggregates = write_history(&log, 300, 0).await;
    publish_a_snapshot(&nats, &log, &dir.path().join("publisher")).await;
    let mut bytes = published_bytes(&log).await;
    let flipped = bytes.len() - bytes.len() / 3;
    bytes[flipped] ^= 0x01;
    republish(&log, &bytes).await;
    let end = log.last_position().await.unwrap();

    // when a new replica starts with the bucket, then the snapshot is refused (blake3),
    // and the replica caught up from position 1.
    a_new_replica_refuses_the_snapshot(&nats, &log, dir.path(), &aggregates, end, "blake3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_whose_metadata_claims_an_implausible_size_is_refused_not_allocated() {
    // Given a published snapshot whose object metadata was rewritten to claim 2^62 bytes
    // (the metadata message of the object store's stream, rolled up in place),
    let nats = NatsServer::start().await;
    let log = common::stream(&nats).await;
    let dir = tempfile::tempdir().unwrap();
    let aggregates = write_history(&log, 300, 0).await;
    publish_a_snapshot(&nats, &log, &dir.path().join("publisher")).await;
    let js = log.context();
    let stream = js.get_stream(format!("OBJ_{BUCKET}")).await.unwrap();
    let meta_subject = format!("$O.{BUCKET}.M.>");
    let info = js.get_stream(format!("OBJ_{BUCKET}")).await.unwrap();
    let (subject, _) = info
        .info_with_subjects(meta_subject.as_str())
        .await
        .unwrap()
        .next()
        .await
        .expect("the object's metadata")
        .unwrap();
    let last = stream
        .get_last_raw_message_by_subject(&subject)
        .await
        .unwrap();
    let mut meta: Value = serde_json::from_slice(&last.payload).unwrap();
    meta["size"] = json!(1u64 << 62);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Rollup", "sub");
    js.publish_with_headers(subject, headers, meta.to_string().into())
        .await
        .unwrap()
        .await
        .unwrap();
    let end = log.last_position().await.unwrap();

    // when a new replica starts with the bucket, then it did not abort: the snapshot is
    // refused naming the bound, and the replica caught up from position 1.
    let bound = "SNAPSHOT_BYTES_MAX";
    a_new_replica_refuses_the_snapshot(&nats, &log, dir.path(), &aggregates, end, bound).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_from_a_published_snapshot_prints_what_a_replay_from_position_1_prints() {
    // Given a published snapshot, then more commits on the aggregates it covers and others,
    let nats = NatsServer::start().await;
    let log = common::stream(&nats).await;
    let dir = tempfile::tempdir().unwrap();
    write_history(&log, 300, 0).await;
    let covered = publish_a_snapshot(&nats, &log, &dir.path().join("publisher")).await;
    write_history(&log, 100, 1).await;
    assert!(log.last_position().await.unwrap() > covered);
    let url = nats.url();
    let replay = |extra: &[&str]| {
        let mut args = vec!["--nats", url.as_str(), "--json", "replay"];
        args.extend_from_slice(extra);
        let out = common::provledger(&args, "");
        assert!(out.status.success(), "{}", common::text(&out));
        out
    };
    // when replay folds from position 1, and from the snapshot,
    let full = replay(&[]);
    let from_snapshot = replay(&["--snapshot-bucket", BUCKET]);
    // then both print the same counts, anomalies and quarantine, the second from the
    // snapshot on;
    let said = String::from_utf8_lossy(&from_snapshot.stderr).to_string();
    assert!(
        said.contains(&format!(
            "from the published snapshot at position {covered}"
        )),
        "{said}"
    );
    assert_eq!(
        String::from_utf8_lossy(&from_snapshot.stdout),
        String::from_utf8_lossy(&full.stdout)
    );
    // a replay to a point before the snapshot does not use it;
    let to = (covered - 7).to_string();
    let early = replay(&["--to", &to, "--snapshot-bucket", BUCKET]);
    assert!(
        String::from_utf8_lossy(&early.stderr).contains("past --to"),
        "{}",
        common::text(&early)
    );
    assert_eq!(early.stdout, replay(&["--to", &to]).stdout);
    // and a snapshot with one byte flipped is refused, the replay folding from position 1.
    let mut bytes = published_bytes(&log).await;
    let flipped = bytes.len() - bytes.len() / 3;
    bytes[flipped] ^= 0x01;
    republish(&log, &bytes).await;
    let refused = replay(&["--snapshot-bucket", BUCKET]);
    let said = String::from_utf8_lossy(&refused.stderr).to_string();
    assert!(
        said.contains("snapshot not used") && said.contains("blake3"),
        "{said}"
    );
    assert_eq!(refused.stdout, full.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_claiming_a_later_position_than_its_chain_tips_cover_is_refused() {
    // Given a published snapshot, then more commits on the aggregates it covers, and the
    // snapshot's header rewritten to claim the stream's new end (its body, hash and tips
    // digest untouched: only the tips against the stream can tell),
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let log = common::stream(&nats).await;
    let dir = tempfile::tempdir().unwrap();
    let mut aggregates = write_history(&log, 300, 0).await;
    publish_a_snapshot(&nats, &log, &dir.path().join("publisher")).await;
    aggregates.extend(write_history(&log, 100, 1).await);
    let end = log.last_position().await.unwrap();
    let bytes = published_bytes(&log).await;
    let len = u32::from_be_bytes(bytes[8..12].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[12..12 + len]).unwrap();
    header["position"] = json!(end);
    let header = serde_json::to_vec(&header).unwrap();
    let mut forged = bytes[..8].to_vec();
    forged.extend_from_slice(&(header.len() as u32).to_be_bytes());
    forged.extend_from_slice(&header);
    forged.extend_from_slice(&bytes[12 + len..]);
    republish(&log, &forged).await;

    // when a new replica starts with the bucket,
    let replica_dir = dir.path().join("replica");
    let mut replica = Serve::start_with(&nats, &replica_dir, &["--snapshot-bucket", BUCKET]);
    let end = quiet_end(&log).await;
    wait_ready_at(&client, end).await;
    // then the snapshot is refused for a commit it misses,
    let said = log_of(&replica_dir);
    assert!(
        said.contains("snapshot not used") && said.contains("which the snapshot misses"),
        "{said}"
    );
    // and the replica caught up from position 1 to the stream's state,
    assert_answers_the_rebuild(&client, &log, &aggregates, end).await;
    assert!(replica.terminate().success());
    // and, stopped, starts again on the data dir it caught up into (what the refused
    // import wrote is gone, and the store is in this build's formats).
    let mut replica = Serve::start_with(&nats, &replica_dir, &["--snapshot-bucket", BUCKET]);
    wait_ready_at(&client, end).await;
    assert_answers_the_rebuild(&client, &log, &aggregates, end).await;
    assert!(replica.terminate().success());
}

/// Waits (bounded) until `dir`'s serve log holds `line`.
async fn wait_for_log_line(dir: &Path, line: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !log_of(dir).contains(line) {
        assert!(
            Instant::now() < deadline,
            "no {line:?} in {}:\n{}",
            dir.display(),
            log_of(dir)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_deployed_accounts_a_snapshot_is_published_and_a_new_replica_bootstraps_from_it()
{
    // Given nats-server with deploy/nats/accounts.conf, a stream the designated writer
    // filled, and serve (as user `serve`) publishing its snapshots to the bucket the
    // accounts allow...
    let nats = NatsServer::start_hardened(true, false).await;
    let writer = JetStreamLog::open(
        nats.client_as("writer").await,
        provledger_events::JetStreamConfig::default(),
    )
    .await
    .expect("the writer opens the stream");
    for n in 0..120u128 {
        append(
            &writer,
            AggregateId::provider(Uuid::from_u128(0xC00 + n)),
            vec![Event::InventorySet {
                resource_class: "VCPU".into(),
                inventory: provledger_tests::workload::vcpu_inventory(64),
            }],
        )
        .await;
    }
    let end = writer.last_position().await.unwrap();
    let auditor = nats.client_as("auditor").await;
    let dir = tempfile::tempdir().unwrap();
    let publisher_dir = dir.path().join("publisher");
    let mut publisher = Serve::start_at(
        &nats.url_as("serve"),
        &publisher_dir,
        &["--snapshot-bucket", BUCKET],
    );
    wait_ready_at(&auditor, end).await;
    // ...when it has published one, and a replica with a new data dir starts...
    wait_for_log_line(&publisher_dir, "projection snapshot published").await;
    assert!(publisher.terminate().success());
    let replica_dir = dir.path().join("replica");
    let _replica = Serve::start_at(
        &nats.url_as("serve"),
        &replica_dir,
        &["--snapshot-bucket", BUCKET],
    );
    // ...then the replica bootstraps from it and is ready, and nothing was refused.
    wait_ready_at(&auditor, end).await;
    wait_for_log_line(&replica_dir, "bootstrapped from a published snapshot").await;
    let refused = nats.log();
    assert!(
        !refused.contains("Permissions Violation"),
        "the accounts refused something: {refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_on_a_data_dir_of_an_older_entity_format_rebuilds_it_from_the_stream() {
    // Given a replica that caught up with a stream and stopped,
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let log = common::stream(&nats).await;
    let dir = tempfile::tempdir().unwrap();
    let aggregates = write_history(&log, 150, 0).await;
    let data = dir.path().join("replica");
    let mut serve = Serve::start(&nats, &data);
    wait_ready_at(&client, quiet_end(&log).await).await;
    assert!(serve.terminate().success());
    // whose data dir a newer build reads as an older entity format (and, to tell a rebuild
    // from a mere relabel, with one entity gone),
    {
        let db = common::open_stopped_data_dir(&data);
        let tree = db.open_tree("projection").unwrap();
        let format = tree
            .get(b"mentity_format")
            .unwrap()
            .expect("format recorded");
        assert_eq!(format[0], provledger_serve::ENTITY_FORMAT);
        tree.insert(b"mentity_format", &[format[0] - 1][..])
            .unwrap();
        let mut key = vec![b'e'];
        key.extend_from_slice(&aggregates[0].key_bytes());
        assert!(tree.remove(key).unwrap().is_some(), "the entity was stored");
        db.flush().unwrap();
    }

    // when serve starts on it again,
    let mut serve = Serve::start(&nats, &data);
    let end = quiet_end(&log).await;
    wait_ready_at(&client, end).await;

    // then it says it rebuilds, and answers as a rebuild of the whole stream, that entity
    // included.
    assert!(
        log_of(&data).contains("older format: rebuilding it from the stream"),
        "{}",
        log_of(&data)
    );
    assert_answers_the_rebuild(&client, &log, &aggregates, end).await;
    let first = ask(
        &client,
        &format!("{}.get", aggregates[0].kind),
        json!({"id": aggregates[0].id}),
    )
    .await;
    assert!(first["data"].is_object(), "{first}");
    assert!(serve.terminate().success());
}
