//! `provledger backup --to DIR` and `provledger restore --from DIR --verify` against real
//! nats-servers and real files: a backup taken under writes restores onto a fresh server
//! with the source's tips at the backup's position, a fresh serve becomes ready on it, a
//! damaged backup is refused before anything is published, and a hole the source's server
//! left keeps its position.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use provledger_events::backup::{encode_frame, FrameReader, Manifest, STREAM_FILE_MAGIC};
use provledger_events::{EventLog, JetStreamLog};
use provledger_tests::NatsServer;

use crate::common;

fn cli(nats: &NatsServer, args: &[&str]) -> std::process::Output {
    let url = nats.url();
    let mut all = vec!["--nats", url.as_str()];
    all.extend_from_slice(args);
    common::provledger(&all, "")
}

fn manifest(dir: &Path) -> Manifest {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

/// Each aggregate's last commit (version, position, hash) among positions 1..=`to`.
async fn tips(log: &JetStreamLog, to: u64) -> BTreeMap<String, (u64, u64, String)> {
    let mut out = BTreeMap::new();
    let mut commits = log.read_range(1, to);
    while let Some(commit) = commits.next().await {
        let c = commit.expect("a clean log");
        out.insert(
            c.aggregate.to_string(),
            (c.version, c.position, c.hash.to_hex()),
        );
    }
    out
}

fn manifest_tips(m: &Manifest) -> BTreeMap<String, (u64, u64, String)> {
    m.content
        .tips
        .iter()
        .map(|t| {
            (
                t.aggregate.clone(),
                (t.version, t.position, t.hash.to_hex()),
            )
        })
        .collect()
}

/// Writers appending to the stream of `nats` until `stop` is set.
fn keep_writing(nats: &NatsServer, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    let url = nats.url();
    tokio::spawn(async move {
        let client = async_nats::connect(url).await.unwrap();
        let log = JetStreamLog::open(client, Default::default())
            .await
            .unwrap();
        let mut written = 0;
        let mut cluster = provledger_events::AggregateId::cluster(uuid::Uuid::now_v7());
        while !stop.load(Ordering::Relaxed) {
            if written % 20 == 0 {
                cluster = provledger_events::AggregateId::cluster(uuid::Uuid::now_v7());
            }
            let event = provledger_events::Event::ClusterStatusChanged {
                status: provledger_events::catalogue::ClusterStatus::Spawning,
                description: format!("commit {written}"),
            };
            let draft = provledger_events::CommitDraft::now("writer", vec![event]);
            log.append(cluster, provledger_events::Expectation::Any, draft)
                .await
                .expect("append");
            written += 1;
        }
        written
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_taken_under_writes_restores_onto_a_fresh_server_with_the_same_tips() {
    // Given a ledger being written to (a few hundred commits already),
    let source = NatsServer::start().await;
    common::write_concurrently(&source, 2, 150).await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = keep_writing(&source, stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;

    // when it is backed up while the writes go on,
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("backup");
    let backup = cli(&source, &["backup", "--to", to.to_str().unwrap()]);
    assert!(backup.status.success(), "{}", common::text(&backup));
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    assert!(
        writer.await.unwrap() > 0,
        "writes went on during the backup"
    );

    // then the backup is consistent at one position, with the source's tips there, and
    // the source went on past it;
    let m = manifest(&to);
    let log = common::stream(&source).await;
    let at = m.content.last_position;
    assert!(at >= 300, "{at}");
    assert!(
        log.last_position().await.unwrap() > at,
        "writes after it are not in it"
    );
    assert_eq!(m.content.messages, at);
    assert_eq!(manifest_tips(&m), tips(&log, at).await);

    // when it is restored onto a fresh server with --verify,
    let fresh = NatsServer::start().await;
    let restore = cli(
        &fresh,
        &["restore", "--from", to.to_str().unwrap(), "--verify"],
    );
    let out = common::text(&restore);
    assert!(restore.status.success(), "{out}");
    assert!(
        out.contains("audit: ok") && out.contains("verified:"),
        "{out}"
    );

    // then `audit` is clean, the restored stream has the source's tips at the backup's
    // position, every commit at its position,
    let audit = cli(&fresh, &["audit"]);
    assert!(audit.status.success(), "{}", common::text(&audit));
    let restored = common::stream(&fresh).await;
    assert_eq!(restored.last_position().await.unwrap(), at);
    assert_eq!(tips(&restored, at).await, tips(&log, at).await);
    let (a, b) = (log.read_range(1, at), restored.read_range(1, at));
    let same = a
        .zip(b)
        .all(|(x, y)| async move { x.unwrap() == y.unwrap() })
        .await;
    assert!(same, "the same commits at the same positions");

    // and a fresh serve becomes ready on it, at the backup's position,
    let bucket = ["--snapshot-bucket", "PROVLEDGER_SNAPSHOTS"];
    let _serve = common::Serve::start_with(&fresh, &dir.path().join("serve"), &bucket);
    let client = fresh.client().await;
    common::wait_ready(&client).await;
    let reply = client
        .request("provledger.q.health", "{}".into())
        .await
        .unwrap();
    let health: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(health["data"]["position"], at, "{health}");
    // and publishes its snapshot in the bucket, from which a new replica bootstraps.
    let js = async_nats::jetstream::new(client.clone());
    wait_for(|| async {
        let Ok(store) = js.get_object_store("PROVLEDGER_SNAPSHOTS").await else {
            return false;
        };
        store.info("projection").await.is_ok()
    })
    .await;
    let second = dir.path().join("second");
    let _second = common::Serve::start_with(&fresh, &second, &bucket);
    wait_for(|| async {
        std::fs::read_to_string(second.with_extension("log"))
            .unwrap_or_default()
            .contains("bootstrapped from a published snapshot")
    })
    .await;
}

/// Waits up to 30 s for `ready` to answer true.
async fn wait_for<F: std::future::Future<Output = bool>>(mut ready: impl FnMut() -> F) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !ready().await {
        assert!(std::time::Instant::now() < deadline, "not within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A copy of the backup in `from` at `to`, its `stream.bin` passed through `edit`.
fn copy_backup(from: &Path, to: &Path, edit: impl FnOnce(Vec<u8>) -> Vec<u8>) {
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(from.join("manifest.json"), to.join("manifest.json")).unwrap();
    let bytes = std::fs::read(from.join("stream.bin")).unwrap();
    std::fs::write(to.join("stream.bin"), edit(bytes)).unwrap();
}

/// `stream.bin`'s bytes without the message at `position` (every other frame as it was).
fn without(bytes: Vec<u8>, position: u64) -> Vec<u8> {
    let mut reader = FrameReader::new(bytes.as_slice());
    let mut out = STREAM_FILE_MAGIC.to_vec();
    while let Some(m) = reader.next_message().unwrap() {
        if m.position != position {
            encode_frame(&m, &mut out).unwrap();
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_with_a_flipped_byte_or_a_dropped_message_is_refused_naming_it() {
    // Given a backup of a small ledger,
    let source = NatsServer::start().await;
    common::write_concurrently(&source, 1, 60).await;
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    let backup = cli(&source, &["backup", "--to", good.to_str().unwrap()]);
    assert!(backup.status.success(), "{}", common::text(&backup));
    // (a second backup into the same directory is refused: it is not empty)
    let again = cli(&source, &["backup", "--to", good.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(2), "{}", common::text(&again));
    // (nor into a file)
    let file = good.join("manifest.json");
    let into_file = cli(&source, &["backup", "--to", file.to_str().unwrap()]);
    assert_eq!(
        into_file.status.code(),
        Some(2),
        "{}",
        common::text(&into_file)
    );

    // and two damaged copies: one byte flipped in the payload of the commit at position
    // 8 (its description), and the message at position 20 dropped,
    // (one writer: its commit i is at position i + 1; no other description starts so)
    let marker = b"writer 0 commit 7";
    let flipped = dir.path().join("flipped");
    copy_backup(&good, &flipped, |mut bytes| {
        let at = bytes
            .windows(marker.len())
            .position(|w| w == marker)
            .expect("the marker is in stream.bin");
        bytes[at] ^= 0x20;
        bytes
    });
    let dropped = dir.path().join("dropped");
    copy_backup(&good, &dropped, |bytes| without(bytes, 20));

    // when each is restored with --verify onto a fresh server,
    let fresh = NatsServer::start().await;
    let flip = cli(
        &fresh,
        &["restore", "--from", flipped.to_str().unwrap(), "--verify"],
    );
    let drop = cli(
        &fresh,
        &["restore", "--from", dropped.to_str().unwrap(), "--verify"],
    );

    // then each is refused (exit 1), naming the position and the check that failed,
    assert_eq!(flip.status.code(), Some(1), "{}", common::text(&flip));
    assert!(
        common::text(&flip).contains("position 8: its frame's checksum does not match"),
        "{}",
        common::text(&flip)
    );
    assert_eq!(drop.status.code(), Some(1), "{}", common::text(&drop));
    assert!(
        common::text(&drop).contains("position 20 is missing from stream.bin"),
        "{}",
        common::text(&drop)
    );
    // (as `--check-only` says without a server, the good one passing)
    let offline = common::provledger(
        &[
            "restore",
            "--check-only",
            "--from",
            flipped.to_str().unwrap(),
        ],
        "",
    );
    assert_eq!(offline.status.code(), Some(1), "{}", common::text(&offline));
    assert!(common::text(&offline).contains("position 8: its frame's checksum"));
    let offline = common::provledger(
        &["restore", "--check-only", "--from", good.to_str().unwrap()],
        "",
    );
    assert!(offline.status.success(), "{}", common::text(&offline));
    // and nothing was published: the fresh server has no stream yet;
    let client = fresh.client().await;
    let js = async_nats::jetstream::new(client);
    assert!(js.get_stream("PROVLEDGER").await.is_err(), "no stream");

    // while the good backup restores there, into the stream a first writer created empty,
    // once: the stream then holds it.
    let _created = common::stream(&fresh).await;
    let ok = cli(
        &fresh,
        &["restore", "--from", good.to_str().unwrap(), "--verify"],
    );
    assert!(ok.status.success(), "{}", common::text(&ok));
    let twice = cli(&fresh, &["restore", "--from", good.to_str().unwrap()]);
    assert_eq!(twice.status.code(), Some(1), "{}", common::text(&twice));
    assert!(
        common::text(&twice).contains("already holds 60 message(s)"),
        "{}",
        common::text(&twice)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deployed_auditor_user_can_take_a_backup() {
    // Given the deployed accounts, and a commit appended by the designated writer,
    let nats = NatsServer::start_hardened(true, false).await;
    let dir = tempfile::tempdir().unwrap();
    let (writer, auditor) = (nats.url_as("writer"), nats.url_as("auditor"));
    let create =
        r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#;
    let cluster = format!("cluster/{}", uuid::Uuid::now_v7());
    let append = [
        "--nats", &writer, "append", &cluster, "--expect", "none", "--events", "-",
    ];
    let out = common::provledger(&append, create);
    assert!(out.status.success(), "{}", common::text(&out));

    // when the auditor (stream reads only) backs it up,
    let to = dir.path().join("backup");
    let out = common::provledger(
        &["--nats", &auditor, "backup", "--to", to.to_str().unwrap()],
        "",
    );

    // then the backup is whole.
    assert!(out.status.success(), "{}", common::text(&out));
    assert_eq!(manifest(&to).content.commits, 1);
    let check = common::provledger(
        &["restore", "--check-only", "--from", to.to_str().unwrap()],
        "",
    );
    assert!(check.status.success(), "{}", common::text(&check));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hole_the_source_server_left_is_restored_as_a_hole_at_its_position() {
    // Given a stream whose server dropped cluster X's v2 (position 2; X's v3 at 3, Y at 4),
    let (source, x, _) = crate::lost_commit::x_lost_its_v2().await;

    // when it is backed up,
    let dir = tempfile::tempdir().unwrap();
    let to = dir.path().join("backup");
    let backup = cli(&source, &["backup", "--to", to.to_str().unwrap()]);
    assert!(backup.status.success(), "{}", common::text(&backup));

    // then the manifest names the hole and the loss it reveals;
    let m = manifest(&to);
    assert_eq!(m.content.holes.len(), 1);
    assert_eq!((m.content.holes[0].from, m.content.holes[0].to), (2, 2));
    assert_eq!((m.content.messages, m.content.losses), (3, 1));

    // when it is restored with --verify onto a fresh server,
    let fresh = NatsServer::start().await;
    let restore = cli(
        &fresh,
        &["restore", "--from", to.to_str().unwrap(), "--verify"],
    );
    let out = common::text(&restore);

    // then the same bytes are read back, and the audit reports the loss, as on the source
    // (exit 1),
    assert_eq!(restore.status.code(), Some(1), "{out}");
    assert!(
        out.contains("1 hole(s) kept") && out.contains("read back: the same"),
        "{out}"
    );
    assert!(out.contains("[lost_commits]"), "{out}");

    // and position 2 is a hole there too, X's v3 still at position 3: nothing renumbered,
    // in a stream of the log's configuration (deletes denied again).
    let restored = common::stream(&fresh).await;
    let stream = restored.context().get_stream("PROVLEDGER").await.unwrap();
    assert!(stream.direct_get(2).await.is_err(), "a hole at 2");
    let info = stream.cached_info();
    assert!(info.config.deny_delete && info.config.deny_purge);
    let v3 = restored
        .read_position(3)
        .await
        .unwrap()
        .expect("a commit at 3");
    assert_eq!((v3.aggregate, v3.version), (x, 3));
    assert_eq!(restored.last_position().await.unwrap(), 4);
}
