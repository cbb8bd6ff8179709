//! Time-to-ready of a new `provledger serve` replica, with and without a published
//! snapshot (`--snapshot-bucket`), on one stream, in one run: a replica catching up from
//! position 1 (the reference), then one bootstrapping from the snapshot another published.
//! Also each data dir's bytes next to the stream's, and a replica from position 1 that
//! keeps no copy of the stream (`--no-log-copy`) next to one that keeps it (the default):
//! time to ready, time until its copy is whole and flushed (it stops then), and bytes.
//!
//! Next to them, the raw reference of a catch-up: the stream read and decoded the way serve
//! follows it (one ordered consumer from position 1), folding and writing nothing.
//!
//! `cargo run --release -p provledger-tests --bin bootstrap-bench [-- --commits N]`

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_events::catalogue::ConsumerKind;
use provledger_events::{
    AggregateId, CommitDraft, Event, EventLog, Expectation, JetStreamConfig, JetStreamLog,
};
use provledger_serve::ServeOptions;
use provledger_tests::bench::{dir_bytes, ready_at, stream_bytes, InProcessServe};
use provledger_tests::{workload, NatsServer};
use uuid::Uuid;

// serve runs here in process: on the allocator `provledger serve` runs on, as deployed.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const BUCKET: &str = "PROVLEDGER_SNAPSHOTS";
/// Commits per provider: its registration with its inventory, then instances coming and
/// going (a claim, then the release of the one before it): 10 claims and 9 releases, so
/// each provider ends with one allocation, as a busy host with churn does.
const COMMITS_PER_PROVIDER: u64 = 20;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What a stopped replica's data dir holds, per sled tree and key tag (the first byte of
/// a key: `e` entities, `b` the allocation index, `w` the time index, `O`/`o`/`k`/`t`/`n`
/// the operation indexes, `q` the quarantine, `s`/`S` local snapshots, `m` meta; `c`/`h`
/// only in data dirs that copy the log): keys, and key + value bytes.
fn tree_costs(dir: &Path) -> BTreeMap<(String, char), (u64, u64)> {
    let mut costs = BTreeMap::new();
    let Ok(db) = sled::open(dir.join("sled")) else {
        return costs;
    };
    for name in db.tree_names() {
        let Ok(tree) = db.open_tree(&name) else {
            continue;
        };
        let name = String::from_utf8_lossy(&name).to_string();
        for (k, v) in tree.iter().flatten() {
            let tag = k.first().map_or('?', |b| *b as char);
            let cost: &mut (u64, u64) = costs.entry((name.clone(), tag)).or_default();
            cost.0 += 1;
            cost.1 += (k.len() + v.len()) as u64;
        }
    }
    costs
}

/// A serve in process, until its `stop`.
fn start_serve(
    url: String,
    dir: &Path,
    bucket: Option<&str>,
    snapshot_every: u64,
    log_copy: bool,
) -> InProcessServe {
    InProcessServe::start(ServeOptions {
        snapshot_every,
        recovery_interval: None,
        snapshot_bucket: bucket.map(str::to_string),
        log_copy,
        ..ServeOptions::new(url, dir.to_path_buf())
    })
}

#[tokio::main]
async fn main() {
    // serve's log on stderr: the bootstrap's phases (fetch, check, verify, import).
    provledger_tests::bench::log_serve_to_stderr();
    let commits = arg("--commits", 200_000);
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let log = JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("stream");
    let providers = commits.div_ceil(COMMITS_PER_PROVIDER);
    eprintln!("writing {commits} commits over {providers} providers");
    let started = Instant::now();
    futures::stream::iter(0..providers)
        .for_each_concurrent(64, |p| {
            let log = log.clone();
            async move {
                let provider = AggregateId::provider(Uuid::from_u128(u128::from(p) + 1));
                let consumer = |c: u64| Uuid::from_u128((u128::from(p) << 32) + u128::from(c));
                for c in 0..COMMITS_PER_PROVIDER {
                    let events = match c {
                        0 => workload::provider_on(&format!("node-{p}"), 1_000),
                        c if c % 2 == 1 => {
                            workload::vcpu_claim(consumer(c), ConsumerKind::Instance, 1)
                        }
                        c => vec![Event::AllocationReleased {
                            consumer: consumer(c - 1),
                            reason: "instance deleted".into(),
                        }],
                    };
                    log.append(
                        provider,
                        Expectation::Any,
                        CommitDraft::now("bench", events),
                    )
                    .await
                    .expect("append");
                }
            }
        })
        .await;
    let end = log.last_position().await.expect("end");
    eprintln!("written in {:.1?}", started.elapsed());
    let stream_bytes = stream_bytes(&log).await;

    let dir = tempfile::tempdir().expect("tempdir");
    // The publisher: catches up from position 1, snapshots once caught up, publishes.
    let since = Instant::now();
    let serve = start_serve(
        nats.url(),
        &dir.path().join("publisher"),
        Some(BUCKET),
        end / 2,
        true,
    );
    let publisher_ready = ready_at(&client, end, since).await;
    let published = Instant::now();
    // The snapshot at the stream's end (one taken on the way may be there first).
    loop {
        if let Ok(store) = log.context().get_object_store(BUCKET).await {
            if let Ok(info) = store.info("projection").await {
                let at: Option<u64> = info.metadata.get("position").and_then(|p| p.parse().ok());
                if at >= Some(end) {
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let publish_wait = published.elapsed();
    let _ = serve.stop();

    // The raw reference: the stream read and decoded as serve's projector follows it.
    let since = Instant::now();
    let mut raw_events = 0usize;
    {
        let mut tail = log.subscribe(1).await.expect("subscribe");
        while let Some(commit) = tail.next().await {
            let commit = commit.expect("decoded commit");
            raw_events += commit.events.len();
            if commit.position >= end {
                break;
            }
        }
    }
    let raw = since.elapsed();

    // The reference: a new replica without a snapshot, from position 1, keeping no copy
    // of the stream, then one keeping it (the default), then again each (A B A B); the
    // rows are the second of each.
    let mut copy_runs = Vec::new();
    let (mut full, mut full_dir) = (Duration::ZERO, dir.path().join("full"));
    let (mut bare, mut bare_dir) = (Duration::ZERO, dir.path().join("bare"));
    let mut copy_whole = Duration::ZERO;
    for round in 0..2 {
        for log_copy in [false, true] {
            let path = dir.path().join(format!("full-{round}-{log_copy}"));
            let since = Instant::now();
            let serve = start_serve(nats.url(), &path, None, 0, log_copy);
            let ready = ready_at(&client, end, since).await;
            let _ = serve.stop();
            // Stopping waits for the copy to be whole through what was applied, flushed.
            let whole = since.elapsed();
            copy_runs.push((round, log_copy, ready, whole, dir_bytes(&path)));
            match log_copy {
                true => (full, full_dir, copy_whole) = (ready, path, whole),
                false => (bare, bare_dir) = (ready, path),
            }
        }
    }

    // A new replica bootstrapping from the published snapshot.
    let since = Instant::now();
    let boot_dir = dir.path().join("bootstrapped");
    let serve = start_serve(nats.url(), &boot_dir, Some(BUCKET), 0, true);
    let boot = ready_at(&client, end, since).await;
    // The workload is one the fold applies: a provider holds the allocation its last claim
    // made, and no anomaly (a refused event would be measured as an anomaly, not a state).
    let last = providers - 1;
    let reply = client
        .request(
            "provledger.q.provider.get",
            serde_json::json!({ "id": Uuid::from_u128(u128::from(last) + 1) })
                .to_string()
                .into(),
        )
        .await
        .expect("provider.get");
    let provider: serde_json::Value = serde_json::from_slice(&reply.payload).expect("JSON");
    assert_eq!(provider["data"]["anomaly_count"], 0, "{provider}");
    assert_eq!(
        provider["data"]["allocations"].as_array().map(Vec::len),
        Some(1),
        "{provider}"
    );
    let _ = serve.stop();

    println!(
        "| {end} commits ({providers} providers), nats-server {} | time to ready | data dir | data dir / stream ({:.1} MB) |",
        log.server_version(),
        stream_bytes as f64 / 1e6
    );
    println!("|---|---:|---:|---:|");
    for (what, took, path) in [
        (
            "new replica, from position 1, `--no-log-copy`",
            bare,
            &bare_dir,
        ),
        ("new replica, from position 1 (reference)", full, &full_dir),
        (
            "new replica, bootstrapped from the snapshot",
            boot,
            &boot_dir,
        ),
    ] {
        let bytes = dir_bytes(path);
        println!(
            "| {what} | {:.2} s | {:.1} MB | {:.2}x |",
            took.as_secs_f64(),
            bytes as f64 / 1e6,
            bytes as f64 / stream_bytes as f64
        );
    }
    println!("\nfrom position 1, each run (A B A B): copy kept | time to ready | until stopped with the copy whole | data dir / stream\n");
    println!("| run | copy | ready | stopped | data dir / stream |");
    println!("|---:|---|---:|---:|---:|");
    for (round, log_copy, ready, whole, bytes) in &copy_runs {
        println!(
            "| {} | {} | {:.2} s | {:.2} s | {:.2}x |",
            round + 1,
            if *log_copy { "kept" } else { "none" },
            ready.as_secs_f64(),
            whole.as_secs_f64(),
            *bytes as f64 / stream_bytes as f64
        );
    }
    println!(
        "copy kept: whole and flushed {:.2} s after the start, {:.2}x the raw read's time",
        copy_whole.as_secs_f64(),
        copy_whole.as_secs_f64() / raw.as_secs_f64()
    );
    for (what, path) in [
        ("from position 1, no copy", &bare_dir),
        ("from position 1", &full_dir),
        ("bootstrapped", &boot_dir),
    ] {
        println!("\nwhat the data dir of the replica {what} holds ({end} commits):\n");
        println!("| tree | key tag | keys | bytes (keys + values) | bytes per commit |");
        println!("|---|---|---:|---:|---:|");
        for ((tree, tag), (keys, bytes)) in tree_costs(path) {
            println!(
                "| {tree} | `{tag}` | {keys} | {bytes} | {:.1} |",
                bytes as f64 / end as f64
            );
        }
    }
    println!();
    println!(
        "raw read + decode of the stream as serve follows it (ordered consumer from position 1): {:.2} s, {:.0} events/s; from position 1 / raw: {:.2}x the time ({:.2}x the rate)",
        raw.as_secs_f64(),
        raw_events as f64 / raw.as_secs_f64(),
        full.as_secs_f64() / raw.as_secs_f64(),
        raw.as_secs_f64() / full.as_secs_f64()
    );
    println!(
        "bootstrapped / from position 1: {:.3}x; the publisher was ready after {:.2} s and published {:.2} s later",
        boot.as_secs_f64() / full.as_secs_f64(),
        publisher_ready.as_secs_f64(),
        publish_wait.as_secs_f64()
    );
}
