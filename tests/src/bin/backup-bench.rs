//! What `provledger backup` and `provledger restore --verify` cost on one stream, in one
//! run (docs/operating.md, "Backup and restore": the RPO and RTO they give): the backup of
//! a stream of N commits, the check of the backup, its restore onto a second server, the
//! read back and the audit of the restored stream; next to them, the reference: the same
//! stream read and decoded whole by batch direct get (what any full read costs) and the
//! audit of the source. Then the same from a replica's copy of the stream (as serve's
//! copier writes it): `backup --from-copy` and the restore of that backup.
//!
//! `cargo run --release -p provledger-tests --bin backup-bench [-- --commits N]`

use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_client::backup;
use provledger_events::{
    AggregateId, CommitDraft, EventLog, Expectation, JetStreamConfig, JetStreamLog, Timestamp,
};
use provledger_serve::{audit_log, OnChainViolation};
use provledger_tests::{workload, NatsServer};
use uuid::Uuid;

/// Commits per provider: its registration, then claims and releases.
const COMMITS_PER_PROVIDER: u64 = 20;

async fn write(log: &JetStreamLog, commits: u64) {
    let providers = commits.div_ceil(COMMITS_PER_PROVIDER);
    futures::stream::iter(0..providers)
        .for_each_concurrent(64, |p| async move {
            let provider = AggregateId::provider(Uuid::from_u128(u128::from(p) + 1));
            for c in 0..COMMITS_PER_PROVIDER {
                let draft = CommitDraft::now("bench", workload::provider_churn(p, c));
                log.append(provider, Expectation::Any, draft)
                    .await
                    .expect("append");
            }
        })
        .await;
}

fn row(what: &str, took: Duration, commits: u64) {
    println!(
        "| {what} | {:.2} s | {:.0} commits/s |",
        took.as_secs_f64(),
        commits as f64 / took.as_secs_f64()
    );
}

/// The audit of `log` as `provledger audit` runs it, and how long it took.
async fn audit(log: &JetStreamLog) -> (provledger_projections::audit::AuditReport, Duration) {
    let since = Instant::now();
    let report = audit_log(
        log,
        OnChainViolation::Quarantine,
        None,
        Timestamp::now(),
        |_, _| {},
    )
    .await
    .expect("audit");
    (report, since.elapsed())
}

#[tokio::main]
async fn main() {
    let commits = std::env::args()
        .skip_while(|a| a != "--commits")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    let source = NatsServer::start().await;
    let log = JetStreamLog::open(source.client().await, JetStreamConfig::default())
        .await
        .expect("stream");
    eprintln!("writing {commits} commits");
    write(&log, commits).await;
    let end = log.last_position().await.expect("end");
    let stream_bytes = log.stream_bounds().await.expect("bounds");
    eprintln!("written: positions 1..={end} ({stream_bytes:?})");

    // The reference: every commit read by batch direct get and decoded.
    let since = Instant::now();
    let mut read = 0u64;
    let mut all = log.read_all(1).await.expect("read");
    while let Some(c) = all.next().await {
        c.expect("a commit");
        read += 1;
    }
    let read_whole = since.elapsed();
    assert_eq!(read, end);
    let (report, audit_source) = audit(&log).await;
    // The workload's allocations name instances the log never creates: the audit lists
    // them as orphans, on the source and on the restored stream alike.
    let source_violations = report.violations.len();

    let dir = tempfile::tempdir().expect("tempdir");
    let to = dir.path().join("backup");
    let since = Instant::now();
    let summary = backup::backup(&log, &to, Timestamp::now(), |_, _| {})
        .await
        .expect("backup");
    let took_backup = since.elapsed();
    let bytes = std::fs::metadata(to.join(backup::STREAM_FILE))
        .expect("stream.bin")
        .len();
    let manifest_bytes = std::fs::metadata(to.join(backup::MANIFEST_FILE))
        .expect("manifest.json")
        .len();

    let since = Instant::now();
    let manifest = backup::read_manifest(&to).expect("manifest");
    backup::check(&to, &manifest, |_| {}).expect("check");
    let took_check = since.elapsed();

    let target = NatsServer::start().await;
    let config = JetStreamConfig::default();
    let since = Instant::now();
    backup::restore(
        target.client().await,
        config.clone(),
        &to,
        &manifest,
        |_, _| {},
    )
    .await
    .expect("restore");
    let took_restore = since.elapsed();
    let since = Instant::now();
    let (restored, _) = backup::read_back(target.client().await, config, &manifest, |_, _| {})
        .await
        .expect("read back");
    let took_read_back = since.elapsed();
    let (report, took_audit) = audit(&restored).await;
    assert_eq!(report.violations.len(), source_violations);
    assert_eq!(report.commits, end);

    let from_copy = from_copy(&log, end, source_violations).await;

    println!(
        "{end} commits, {} aggregates; stream.bin {bytes} bytes, manifest.json {manifest_bytes} bytes; machine: {} ({} cores)",
        summary.manifest.content.aggregates,
        provledger_tests::cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| step | time | rate |\n|---|---|---|");
    row(
        "reference: read and decode the whole stream",
        read_whole,
        end,
    );
    row("reference: audit of the source", audit_source, end);
    row("backup --to (read, frame, fsync)", took_backup, end);
    row("restore: check of the backup", took_check, end);
    row("restore: publish into the empty stream", took_restore, end);
    row("restore --verify: read back", took_read_back, end);
    row("restore --verify: audit", took_audit, end);
    row(
        "restore --verify, whole",
        took_check + took_restore + took_read_back + took_audit,
        end,
    );
    println!("\nfrom a replica's copy:\n| step | time | rate |\n|---|---|---|");
    row(
        "the copy: read back from the stream (serve's copier)",
        from_copy.copy,
        end,
    );
    row(
        "backup --from-copy (read, check, frame, fsync)",
        from_copy.backup,
        end,
    );
    row(
        "restore --verify of it, whole",
        from_copy.restore_verify,
        end,
    );
}

struct FromCopy {
    copy: Duration,
    backup: Duration,
    restore_verify: Duration,
}

/// A replica's copy of `log` as serve's copier writes it (read back from the stream, as a
/// new replica's is), then `backup --from-copy` of it, and its restore onto a third server
/// with what `--verify` does; the restored stream must audit as the source did.
async fn from_copy(log: &JetStreamLog, end: u64, source_violations: usize) -> FromCopy {
    use provledger_serve::log_copy::{self, LogCopy};
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sled::open(dir.path().join("sled")).expect("sled");
    let store = provledger_serve::ProjectionStore::open(&db).expect("store");
    store.claim_source("jetstream:PROVLEDGER").expect("source");
    store.keep_no_copy().expect("no copy in the projection");
    let since = Instant::now();
    let mut copy = LogCopy::open(&db, 1).expect("copy");
    log_copy::read_back(&mut copy, log, end)
        .await
        .expect("read back");
    copy.flush(true).expect("flush");
    let took_copy = since.elapsed();
    assert_eq!(copy.extent().through, end);

    let to = dir.path().join("backup");
    let since = Instant::now();
    let done = provledger_serve::copy_backup::backup_from_copy(
        &db,
        dir.path(),
        "provledger",
        &to,
        Timestamp::now(),
        |_, _| {},
    )
    .expect("backup --from-copy");
    let took_backup = since.elapsed();
    assert_eq!(done.summary.manifest.content.commits, end);

    let target = NatsServer::start().await;
    let config = JetStreamConfig::default();
    let since = Instant::now();
    let manifest = backup::read_manifest(&to).expect("manifest");
    backup::check(&to, &manifest, |_| {}).expect("check");
    let client = target.client().await;
    backup::restore(client.clone(), config.clone(), &to, &manifest, |_, _| {})
        .await
        .expect("restore");
    let (restored, _) = backup::read_back(client, config, &manifest, |_, _| {})
        .await
        .expect("read back");
    let (report, _) = audit(&restored).await;
    let took_restore = since.elapsed();
    assert_eq!(report.violations.len(), source_violations);
    assert_eq!(report.commits, end);
    FromCopy {
        copy: took_copy,
        backup: took_backup,
        restore_verify: took_restore,
    }
}
