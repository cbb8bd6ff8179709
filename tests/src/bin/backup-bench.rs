//! What `provledger backup` and `provledger restore --verify` cost on one stream (docs/
//! operating.md, "Backup and restore": the RPO and RTO they give), and what the replica's
//! copy of the stream costs a new replica (docs/benchmarks.md, issue 39), in one run, for
//! each size given:
//!
//! - the references: the stream read and decoded whole by batch direct get (what any full
//!   read costs); the same read as serve follows the stream (one ordered consumer from
//!   position 1: the reference of a catch-up); a raw copy of the stream's files (its store
//!   directory copied, each file fsynced: what a file-level copy costs); the source's audit;
//! - `backup --to`, the check of the backup, its restore onto a second server, the read back
//!   and the audit of the restored stream (what `restore --verify` does);
//! - a new serve replica from position 1 keeping no copy, then one keeping it (the default,
//!   right after the ordered-consumer read, each phase after a `sync`): time
//!   to ready, time until its copy is whole and flushed, and its data dir's bytes against
//!   the stream's;
//! - `backup --from-copy` of that stopped replica's data dir, and, up to
//!   `--from-copy-restore-max` commits (default 2,000,000), its restore onto a third server.
//!
//! `cargo run --release -p provledger-tests --bin backup-bench [-- --commits N[,N...]]`
//! (`--catch-up-only`: each size's replicas and their reference only)

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_client::backup;
use provledger_events::{
    AggregateId, CommitDraft, EventLog, Expectation, JetStreamConfig, JetStreamLog, SledLog,
    Timestamp,
};
use provledger_serve::{audit_log, OnChainViolation, ServeOptions};
use provledger_tests::bench::{dir_bytes, ready_at, stream_bytes, InProcessServe};
use provledger_tests::{workload, NatsServer};
use uuid::Uuid;

// serve runs here in process: on the allocator `provledger serve` runs on, as deployed.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Commits per provider: its registration, then claims and releases.
const COMMITS_PER_PROVIDER: u64 = 20;

async fn write(log: &JetStreamLog, commits: u64) {
    let providers = commits.div_ceil(COMMITS_PER_PROVIDER);
    let written = std::sync::atomic::AtomicU64::new(0);
    let written = &written;
    futures::stream::iter(0..providers)
        .for_each_concurrent(64, |p| async move {
            let provider = AggregateId::provider(Uuid::from_u128(u128::from(p) + 1));
            for c in 0..COMMITS_PER_PROVIDER {
                let draft = CommitDraft::now("bench", workload::provider_churn(p, c));
                log.append(provider, Expectation::Any, draft)
                    .await
                    .expect("append");
            }
            let n = written.fetch_add(COMMITS_PER_PROVIDER, std::sync::atomic::Ordering::Relaxed);
            if (n + COMMITS_PER_PROVIDER) % 500_000 < COMMITS_PER_PROVIDER {
                eprintln!("  written {}", n + COMMITS_PER_PROVIDER);
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

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// Lets the disk settle between phases (the kernel's writeback of what the last one wrote
/// would otherwise run during the next one's measure).
fn settle() {
    let _ = std::process::Command::new("sync").status();
    std::thread::sleep(Duration::from_secs(1));
}

/// The stream's directory in a server's store (`.../jetstream/$G/streams/PROVLEDGER`).
fn stream_files(store: &Path) -> PathBuf {
    let streams = store.join("jetstream").join("$G").join("streams");
    streams.join("PROVLEDGER")
}

/// Copies `from` into `to` file by file, each file fsynced, then each directory: a raw copy
/// of a stream's files, as an operator makes one of a stopped server. Its bytes.
fn copy_files(from: &Path, to: &Path) -> u64 {
    std::fs::create_dir_all(to).expect("copy dir");
    let mut bytes = 0;
    for entry in std::fs::read_dir(from).expect("stream dir").flatten() {
        let (path, target) = (entry.path(), to.join(entry.file_name()));
        if entry.metadata().expect("metadata").is_dir() {
            bytes += copy_files(&path, &target);
        } else {
            bytes += std::fs::copy(&path, &target).expect("copy");
            std::fs::File::open(&target)
                .and_then(|f| f.sync_all())
                .expect("fsync");
        }
    }
    std::fs::File::open(to)
        .and_then(|d| d.sync_all())
        .expect("fsync dir");
    bytes
}

/// One size's figures, for the summary at the end.
struct Figures {
    commits: u64,
    stream_bytes: u64,
    read_direct: Duration,
    read_consumer: Duration,
    raw_copy: Duration,
    raw_copy_bytes: u64,
    backup: Duration,
    backup_bytes: u64,
    restore_verify: Duration,
    ready_bare: Duration,
    ready: Duration,
    copy_whole: Duration,
    data_dir_bytes: u64,
    from_copy: Duration,
    from_copy_restore: Option<Duration>,
}

#[tokio::main]
async fn main() {
    // serve's log on stderr (its catch-up, snapshots and copy), as `provledger serve` logs.
    provledger_tests::bench::log_serve_to_stderr();
    let sizes: Vec<u64> = arg("--commits")
        .unwrap_or_else(|| "100000".into())
        .split(',')
        .map(|n| {
            n.trim()
                .replace('_', "")
                .parse()
                .expect("--commits N[,N...]")
        })
        .collect();
    let restore_max: u64 = arg("--from-copy-restore-max")
        .map_or(2_000_000, |n| n.parse().expect("--from-copy-restore-max N"));
    let mut all = Vec::new();
    for commits in sizes {
        all.extend(run(commits, commits <= restore_max).await);
    }
    if all.is_empty() {
        return;
    }
    println!(
        "\n## Summary: machine {} ({} cores)\n",
        provledger_tests::cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| commits | stream | raw read (consumer) | new replica ready, no copy | with its copy | with copy ÷ raw rate | copy whole | data dir / stream |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for f in &all {
        println!(
            "| {} | {:.1} MB | {:.2} s | {:.2} s | {:.2} s | {:.2}x | {:.2} s | {:.2}x |",
            f.commits,
            f.stream_bytes as f64 / 1e6,
            f.read_consumer.as_secs_f64(),
            f.ready_bare.as_secs_f64(),
            f.ready.as_secs_f64(),
            f.read_consumer.as_secs_f64() / f.ready.as_secs_f64(),
            f.copy_whole.as_secs_f64(),
            f.data_dir_bytes as f64 / f.stream_bytes as f64,
        );
    }
    println!("\n| commits | raw copy of the stream's files | read by direct get | backup --to | backup ÷ raw copy | restore --verify | restore ÷ raw copy | backup --from-copy | its restore --verify |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for f in &all {
        println!(
            "| {} | {:.2} s ({:.1} MB) | {:.2} s | {:.2} s ({:.1} MB) | {:.2}x | {:.2} s | {:.2}x | {:.2} s | {} |",
            f.commits,
            f.raw_copy.as_secs_f64(),
            f.raw_copy_bytes as f64 / 1e6,
            f.read_direct.as_secs_f64(),
            f.backup.as_secs_f64(),
            f.backup_bytes as f64 / 1e6,
            f.backup.as_secs_f64() / f.raw_copy.as_secs_f64(),
            f.restore_verify.as_secs_f64(),
            f.restore_verify.as_secs_f64() / f.raw_copy.as_secs_f64(),
            f.from_copy.as_secs_f64(),
            f.from_copy_restore
                .map_or("not run".to_string(), |d| format!("{:.2} s", d.as_secs_f64())),
        );
    }
}

/// One size's run; `None` with `--catch-up-only`, once its catch-up line is printed.
async fn run(commits: u64, restore_from_copy: bool) -> Option<Figures> {
    let source = NatsServer::start().await;
    let client = source.client().await;
    let log = JetStreamLog::open(source.client().await, JetStreamConfig::default())
        .await
        .expect("stream");
    eprintln!("writing {commits} commits");
    let since = Instant::now();
    write(&log, commits).await;
    let end = log.last_position().await.expect("end");
    let bounds = log.stream_bounds().await.expect("bounds");
    eprintln!(
        "written: positions 1..={end} ({bounds:?}) in {:.1?}",
        since.elapsed()
    );
    let stream_bytes = stream_bytes(&log).await;

    // The reference of a catch-up, right before the replicas, in the same conditions: the
    // stream read and decoded as serve's projector follows it.
    settle();
    let since = Instant::now();
    {
        let mut tail = log.subscribe(1).await.expect("subscribe");
        while let Some(commit) = tail.next().await {
            if commit.expect("decoded commit").position >= end {
                break;
            }
        }
    }
    let read_consumer = since.elapsed();
    // A new replica from position 1 keeping no copy, then one keeping it (the default).
    let dir = tempfile::tempdir().expect("tempdir");
    let replica = |log_copy: bool| {
        let data = dir.path().join(format!("replica-{log_copy}"));
        let client = &client;
        let url = source.url();
        async move {
            settle();
            let since = Instant::now();
            let defaults = ServeOptions::new(url, data.clone());
            let serve = InProcessServe::start(ServeOptions {
                recovery_interval: None,
                // serve's own default unless told (0: no local snapshots)
                snapshot_every: arg("--snapshot-every").map_or(defaults.snapshot_every, |n| {
                    n.parse().expect("--snapshot-every N")
                }),
                log_copy,
                ..defaults
            });
            let ready = ready_at(client, end, since).await;
            eprintln!("replica (copy: {log_copy}) ready in {ready:.1?}");
            // Stopping waits for the copy to be whole through what was applied, flushed.
            serve.stop().expect("serve");
            (ready, since.elapsed(), data)
        }
    };
    let (ready_bare, _, bare) = replica(false).await;
    std::fs::remove_dir_all(bare).expect("remove a data dir");
    let (ready, copy_whole, data) = replica(true).await;
    let data_dir_bytes = dir_bytes(&data);
    if std::env::args().any(|a| a == "--catch-up-only") {
        println!(
            "{end} commits: raw read (consumer) {:.2} s; ready without a copy {:.2} s ({:.2}x), with it {:.2} s ({:.2}x); copy whole {:.2} s; data dir {:.2}x the stream",
            read_consumer.as_secs_f64(),
            ready_bare.as_secs_f64(),
            read_consumer.as_secs_f64() / ready_bare.as_secs_f64(),
            ready.as_secs_f64(),
            read_consumer.as_secs_f64() / ready.as_secs_f64(),
            copy_whole.as_secs_f64(),
            data_dir_bytes as f64 / stream_bytes as f64
        );
        // Returned, not exited: the servers of this run are stopped as they are dropped.
        return None;
    }

    // The references of a backup: every commit read by batch direct get and decoded; the
    // stream's files copied.
    settle();
    let since = Instant::now();
    let mut read = 0u64;
    let mut every = log.read_all(1).await.expect("read");
    while let Some(c) = every.next().await {
        c.expect("a commit");
        read += 1;
    }
    let read_direct = since.elapsed();
    assert_eq!(read, end);
    let since = Instant::now();
    let raw_copy_bytes = copy_files(
        &stream_files(&source.store_dir()),
        &dir.path().join("raw-copy"),
    );
    let raw_copy = since.elapsed();
    std::fs::remove_dir_all(dir.path().join("raw-copy")).expect("remove the raw copy");
    eprintln!("references read and copied");
    let (report, audit_source) = audit(&log).await;
    // The workload's allocations name instances the log never creates: the audit lists
    // them as orphans, on the source and on the restored stream alike.
    let source_violations = report.violations.len();

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
    eprintln!("backed up");

    let since = Instant::now();
    let manifest = backup::read_manifest(&to).expect("manifest");
    backup::check(&to, &manifest, |_| {}).expect("check");
    let took_check = since.elapsed();

    let (took_restore, took_read_back, took_audit) = {
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
        (took_restore, took_read_back, took_audit)
    };
    std::fs::remove_dir_all(&to).expect("remove the backup");
    eprintln!("restored and verified");

    let from_copy = from_copy(&data, end, source_violations, restore_from_copy).await;

    println!(
        "\n## {end} commits, {} aggregates, nats-server {}; stream {stream_bytes} bytes, stream.bin {bytes} bytes, manifest.json {manifest_bytes} bytes\n",
        summary.manifest.content.aggregates,
        log.server_version(),
    );
    println!("| step | time | rate |\n|---|---|---|");
    row(
        "reference: read and decode the whole stream (batch direct get)",
        read_direct,
        end,
    );
    row(
        "reference: read and decode it as serve follows it (ordered consumer)",
        read_consumer,
        end,
    );
    row(
        "reference: raw copy of the stream's files (fsynced)",
        raw_copy,
        end,
    );
    row("reference: audit of the source", audit_source, end);
    row("backup --to (read, frame, fsync)", took_backup, end);
    row("restore: check of the backup", took_check, end);
    row("restore: publish into the empty stream", took_restore, end);
    row("restore --verify: read back", took_read_back, end);
    row("restore --verify: audit", took_audit, end);
    let restore_verify = took_check + took_restore + took_read_back + took_audit;
    row("restore --verify, whole", restore_verify, end);
    row(
        "new replica keeping no copy (--no-log-copy): ready",
        ready_bare,
        end,
    );
    row("new replica with its copy: ready", ready, end);
    row(
        "new replica with its copy: copy whole and flushed",
        copy_whole,
        end,
    );
    row(
        "backup --from-copy of its data dir (read, check, frame, fsync)",
        from_copy.backup,
        end,
    );
    if let Some(took) = from_copy.restore_verify {
        row("restore --verify of that backup, whole", took, end);
    }
    println!(
        "data dir {data_dir_bytes} bytes: {:.2}x the stream's",
        data_dir_bytes as f64 / stream_bytes as f64
    );
    Some(Figures {
        commits: end,
        stream_bytes,
        read_direct,
        read_consumer,
        raw_copy,
        raw_copy_bytes,
        backup: took_backup,
        backup_bytes: bytes + manifest_bytes,
        restore_verify,
        ready_bare,
        ready,
        copy_whole,
        data_dir_bytes,
        from_copy: from_copy.backup,
        from_copy_restore: from_copy.restore_verify,
    })
}

struct FromCopy {
    backup: Duration,
    restore_verify: Option<Duration>,
}

/// `backup --from-copy` of a stopped replica's data dir, as the CLI opens it, then (when
/// `restore`) its restore onto a third server with what `--verify` does; the restored
/// stream must audit as the source did.
async fn from_copy(data: &Path, end: u64, source_violations: usize, restore: bool) -> FromCopy {
    let dir = tempfile::tempdir().expect("tempdir");
    let to = dir.path().join("backup");
    let since = Instant::now();
    {
        let data_dir = SledLog::open_existing(data).expect("the replica's data dir");
        let done = provledger_serve::copy_backup::backup_from_copy(
            data_dir.db(),
            data,
            "provledger",
            &to,
            Timestamp::now(),
            |_, _| {},
        )
        .expect("backup --from-copy");
        assert_eq!(done.summary.manifest.content.commits, end);
    }
    let took_backup = since.elapsed();
    if !restore {
        return FromCopy {
            backup: took_backup,
            restore_verify: None,
        };
    }

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
        backup: took_backup,
        restore_verify: Some(took_restore),
    }
}
