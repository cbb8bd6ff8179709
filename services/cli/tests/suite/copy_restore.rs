//! `provledger backup --from-copy DATA_DIR --to DIR` (issue 39, item 4), against real
//! nats-servers and a real replica's data dir: a stopped replica's copy of the stream
//! restores onto a fresh server with the source's commits at their positions (a garbage
//! message's position held by a placeholder readers quarantine again), the same subjects
//! and message ids, so that an old
//! request retried after the restore is still recognised; a copy held by a running serve,
//! a directory that is no data dir and a copy with one flipped byte are refused, the last
//! naming its position.

use std::path::{Path, PathBuf};

use futures::StreamExt;
use provledger_events::backup::{Manifest, RawMessage};
use provledger_events::{EventLog, JetStreamLog};
use provledger_tests::NatsServer;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::common;
use crate::common::ask;

fn cli(nats: Option<&NatsServer>, args: &[&str]) -> std::process::Output {
    let url = nats.map(|n| n.url());
    let mut all = Vec::new();
    if let Some(url) = &url {
        all.extend(["--nats", url.as_str()]);
    }
    all.extend_from_slice(args);
    common::provledger(&all, "")
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every message of `log` as stored, in position order.
async fn raw_messages(log: &JetStreamLog) -> Vec<RawMessage> {
    let end = log.last_position().await.unwrap();
    let mut out: Vec<RawMessage> = Vec::new();
    let mut next = 1;
    while next <= end {
        let batch = log.read_raw_batch(next, end).await.unwrap();
        next = batch.last().unwrap().position + 1;
        out.extend(batch);
    }
    out
}

/// A replica that applied and copied commits written through its `cmd.append` and by
/// writers on the stream, one garbage message among them, then stopped; its data dir, the
/// garbage's position, and one `cmd.append` request with the reply it got.
struct StoppedReplica {
    data: PathBuf,
    garbage_at: u64,
    request: Value,
    reply: Value,
}

async fn stopped_replica(nats: &NatsServer, dir: &Path) -> StoppedReplica {
    let data = dir.join("replica");
    let metrics = provledger_tests::free_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut serve = common::Serve::start_with(nats, &data, &["--metrics-addr", &metrics_addr]);
    let client = nats.client().await;
    common::wait_ready(&client).await;
    common::write_concurrently(nats, 2, 60).await;
    let garbage = format!("provledger.ev.cluster.{}", Uuid::now_v7());
    let js = async_nats::jetstream::new(client.clone());
    let garbage_at = js
        .publish(garbage, "not a commit".into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    let cluster = format!("cluster/{}", Uuid::now_v7());
    let create = serde_json::to_value(vec![provledger_events::Event::ClusterCreateRequested {
        name: "through-serve".into(),
        plugin: "vanilla".into(),
        node_groups: vec![],
    }])
    .unwrap();
    let request = json!({"aggregate": cluster, "expect": "any", "commit_id": Uuid::now_v7(), "events": create});
    let reply = ask(&client, "provledger.cmd.append", request.clone()).await;
    assert!(reply["error"].is_null(), "{reply}");
    common::write_concurrently(nats, 2, 40).await;
    let end = common::stream(nats).await.last_position().await.unwrap();
    common::wait_position(&client, end).await;
    copy_caught_up(metrics, end).await;
    assert!(serve.terminate().success());
    StoppedReplica {
        data,
        garbage_at,
        request,
        reply,
    }
}

/// Waits (30 s at most) until serve's metrics on `port` say its projection applied `end`
/// and its copy holds all of it (`provledger_log_copy_behind_positions` 0), and that none
/// of its batches were dropped.
async fn copy_caught_up(port: u16, end: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let scrape = common::http_get(port, "/metrics").map(|(_, body)| body);
        let scrape = scrape.unwrap_or_default();
        let behind = common::sample(&scrape, "provledger_log_copy_behind_positions");
        let dropped = common::sample(&scrape, "provledger_log_copy_dropped_batches_total");
        let applied = common::sample(&scrape, "provledger_log_position");
        if applied == Some(end as f64) && behind == Some(0.0) {
            assert_eq!(dropped, Some(0.0), "{scrape}");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the copy never caught up: {behind:?} behind\n{scrape}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replicas_copy_restores_onto_a_fresh_server_as_the_stream_was() {
    // Given a replica that copied 201 commits and one garbage message, then stopped,
    let source = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let replica = stopped_replica(&source, dir.path()).await;
    let log = common::stream(&source).await;
    let end = log.last_position().await.unwrap();
    assert_eq!(end, 202);

    // when a backup is written from its copy, offline (no --nats),
    let to = dir.path().join("backup");
    let out = cli(
        None,
        &[
            "--json",
            "backup",
            "--from-copy",
            path(&replica.data),
            "--to",
            path(&to),
        ],
    );
    assert!(out.status.success(), "{}", common::text(&out));

    // then it covers the copy's positions, with the garbage's position as its one hole,
    let m: Manifest =
        serde_json::from_slice(&std::fs::read(to.join("manifest.json")).unwrap()).unwrap();
    let origin = m.from_copy.clone().expect("written from a copy");
    assert_eq!((origin.copied_from, origin.copied_through), (1, end));
    assert_eq!(
        (m.content.first_position, m.content.last_position),
        (1, end)
    );
    assert_eq!(origin.placeholders, 1);
    assert_eq!(m.content.holes, vec![]);
    assert_eq!((m.content.commits, m.content.quarantined), (end - 1, 1));

    // when it is restored onto a fresh server with --verify,
    let fresh = NatsServer::start().await;
    let restore = cli(Some(&fresh), &["restore", "--from", path(&to), "--verify"]);
    let text = common::text(&restore);
    assert!(
        text.contains("from a replica's copy through position 202"),
        "{text}"
    );

    // then the restored stream holds exactly the source's messages, positions, subjects,
    // message ids and bytes (the garbage's bytes from the replica's quarantine record),
    let restored = common::stream(&fresh).await;
    assert_eq!(raw_messages(&restored).await, raw_messages(&log).await);
    // so its audit finds what the source's does: the garbage, at its position, only (the
    // restore's --verify says so, exit 1, as it would for the source);
    assert_eq!(restore.status.code(), Some(1), "{text}");
    assert!(
        text.contains("audit: 1 violation(s) (quarantine 1)"),
        "{text}"
    );
    let audit = |nats: &NatsServer| {
        let out = cli(Some(nats), &["--json", "audit"]);
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        let violations: Vec<_> = report["violations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| (v["check"].clone(), v["position"].clone()))
            .collect();
        let counts =
            ["position", "commits", "quarantined", "undecodable"].map(|f| report[f].clone());
        (violations, counts)
    };
    let (violations, counts) = audit(&fresh);
    assert_eq!(
        violations,
        vec![(json!("quarantine"), json!(replica.garbage_at))]
    );
    assert_eq!((violations, counts), audit(&source));
    let mut tips = std::collections::BTreeMap::new();
    let mut commits = log.read_range(1, end);
    while let Some(c) = commits.next().await {
        // The garbage is no commit.
        let Ok(c) = c else { continue };
        tips.insert(c.aggregate.to_string(), (c.version, c.position, c.hash));
    }
    let restored_tips: std::collections::BTreeMap<_, _> = m
        .content
        .tips
        .iter()
        .map(|t| (t.aggregate.clone(), (t.version, t.position, t.hash)))
        .collect();
    assert_eq!(restored_tips, tips);

    // and the request written through the source's serve, retried on a serve of the
    // restored stream, is recognised as already appended, at its first position.
    let _serve = common::Serve::start(&fresh, &dir.path().join("serve"));
    let client = fresh.client().await;
    common::wait_ready(&client).await;
    let again = ask(&client, "provledger.cmd.append", replica.request).await;
    assert_eq!(again["data"]["already_appended"], true, "{again}");
    assert_eq!(
        again["data"]["position"], replica.reply["data"]["position"],
        "{again}"
    );
    assert_eq!(restored.last_position().await.unwrap(), end);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_held_by_serve_no_data_dir_or_a_flipped_byte_is_refused() {
    // Given a directory that is no data dir, then a serve running on its data dir,
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("backup");
    let backup_from = |data: &Path| {
        cli(
            None,
            &["backup", "--from-copy", path(data), "--to", path(&to)],
        )
    };
    let out = backup_from(dir.path());
    assert_eq!(out.status.code(), Some(1), "{}", common::text(&out));
    assert!(
        common::text(&out).contains("no provledger data dir"),
        "{}",
        common::text(&out)
    );
    let data = dir.path().join("running");
    let mut running = common::Serve::start(&nats, &data);
    common::wait_ready(&nats.client().await).await;
    // when a backup is asked of a running serve's copy, then it is refused (exit 3), the
    // data dir untouched;
    let out = backup_from(&data);
    assert_eq!(out.status.code(), Some(3), "{}", common::text(&out));
    assert!(
        common::text(&out).contains("backed up only once that replica is stopped"),
        "{}",
        common::text(&out)
    );
    assert!(!to.join("manifest.json").exists());
    assert!(running.terminate().success());

    // Given a stopped replica's copy with one byte flipped in the commit at position 50,
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let replica = stopped_replica(&nats, &other).await;
    let sled = provledger_events::SledLog::open(&replica.data).unwrap();
    let tree = sled
        .db()
        .open_tree(provledger_serve::log_copy::COPY_TREE)
        .unwrap();
    let (key, commit) = provledger_serve::log_copy::locate(&tree, 50)
        .unwrap()
        .expect("a commit at 50");
    let mut bytes = tree.get(&key).unwrap().expect("its pack").to_vec();
    let middle = (commit.start + commit.end) / 2;
    bytes[middle] ^= 0x01;
    tree.insert(&key, bytes).unwrap();
    drop(tree);
    sled.close();
    // when a backup is written from it, then it is refused naming position 50, and no
    // backup is left finished.
    let out = backup_from(&replica.data);
    let text = common::text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("position 50:"), "{text}");
    assert!(!to.join("manifest.json").exists(), "{text}");
}
