//! `projection-bench`: the projector and the query service against baselines.
//!
//! - Catch-up: 1,000,000 events (7 per instance: create, host, task start/finish, vm
//!   and power state, and an allocation claim on one of 10,000 providers). Measured:
//!   the projector applying them and persisting each batch (copy + entities + checkpoint),
//!   the raw loop that only reads and decodes the sled copy, and a rebuild (read,
//!   decode, fold in memory) from the copy.
//! - Memory: resident memory of 1,000,000 instances projected in memory.
//! - Query latency: `cluster.get` at a fixed 5,000 requests/s against a trivial NATS echo
//!   micro service answering a payload of the same size, in the same run.
//! - Freshness: append, then `cluster.get` with `min_position`: append-to-queryable.
//!
//! Usage: `cargo bench -p provledger-serve --bench projection-bench [-- --quick]
//! [--catch-up-only] [--memory-only] [--events N]]`; `--no-default-features` builds it on glibc's malloc instead of
//! jemalloc (what `provledger serve` runs).

use std::time::{Duration, Instant};

use async_nats::service::ServiceExt;
use futures::StreamExt;
use hdrhistogram::Histogram;
use provledger_events::catalogue::ClusterStatus;
use provledger_events::{
    codec, AggregateId, Commit, CommitDraft, Event, EventLog, Expectation, Hash, JetStreamConfig,
    JetStreamLog, Timestamp,
};
use provledger_projections::Projection;
use provledger_serve::ProjectionStore;
use provledger_serve::Projector;
use provledger_serve::{self as serve, ServeOptions};
use provledger_tests::workload::{compute_node, instance_claim, instance_lifecycle};
use provledger_tests::NatsServer;
use uuid::Uuid;

const PROVIDERS: u128 = 10_000;

/// The allocator `provledger serve` runs with (services/cli's main.rs); built with
/// `--no-default-features`, the bench measures glibc's malloc instead.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn seal(
    aggregate: AggregateId,
    version: u64,
    prev: Hash,
    position: u64,
    events: Vec<Event>,
) -> Commit {
    let draft = CommitDraft {
        trace: None,
        commit_id: Uuid::from_u128(position as u128),
        operation_id: None,
        causation_id: None,
        actor: "bench".into(),
        recorded_at: Timestamp::from_unix_ms(1_800_000_000_000 + position as i64),
        events,
    };
    // Chained like a real log: the projector checks every link before folding.
    let mut c = Commit::seal(aggregate, version, prev, draft);
    c.position = position;
    c
}

/// The commits of the workload, generated lazily: providers first, then two commits per
/// instance (its lifecycle, and its claim on a provider).
struct Workload {
    instances: u128,
    next: u64,
    provider_versions: Vec<u64>,
    provider_hashes: Vec<Hash>,
}

impl Workload {
    fn new(instances: u128) -> Self {
        Workload {
            instances,
            next: 0,
            provider_versions: vec![0; PROVIDERS as usize],
            provider_hashes: vec![Hash::ZERO; PROVIDERS as usize],
        }
    }
}

impl Iterator for Workload {
    type Item = Commit;
    fn next(&mut self) -> Option<Commit> {
        let n = self.next;
        self.next += 1;
        let position = n + 1;
        if (n as u128) < PROVIDERS {
            let id = AggregateId::provider(Uuid::from_u128(n as u128 + 1));
            self.provider_versions[n as usize] = 1;
            let commit = seal(id, 1, Hash::ZERO, position, compute_node(n as u128));
            self.provider_hashes[n as usize] = commit.hash;
            return Some(commit);
        }
        let k = (n as u128 - PROVIDERS) / 2;
        if k >= self.instances {
            return None;
        }
        let instance = Uuid::from_u128(1 << 64 | k);
        let provider = (k % PROVIDERS) as usize;
        let provider_id = Uuid::from_u128(provider as u128 + 1);
        if (n as u128 - PROVIDERS).is_multiple_of(2) {
            let events = instance_lifecycle(k, provider as u128, provider_id);
            Some(seal(
                AggregateId::instance(instance),
                1,
                Hash::ZERO,
                position,
                events,
            ))
        } else {
            self.provider_versions[provider] += 1;

            let id = AggregateId::provider(provider_id);
            let commit = seal(
                id,
                self.provider_versions[provider],
                self.provider_hashes[provider],
                position,
                instance_claim(instance),
            );
            self.provider_hashes[provider] = commit.hash;
            Some(commit)
        }
    }
}

/// Projects the workload of `instances` into `store` in batches of BATCH_ENTRIES_MAX, as
/// the projector's catch-up does; returns the seconds it took (generation included: about
/// 1.5 µs per commit).
fn project(store: &ProjectionStore, instances: u128, snapshot_every: u64) -> f64 {
    project_handing(store, instances, snapshot_every, None)
}

/// [`project`], handing each batch to serve's copier when `copy` is given (as serve does).
fn project_handing(
    store: &ProjectionStore,
    instances: u128,
    snapshot_every: u64,
    copy: Option<serve::log_copy::CopySender>,
) -> f64 {
    let mut projector = Projector::new(store.clone(), snapshot_every).expect("projector");
    if let Some(copy) = copy {
        projector = projector.with_copy(copy);
    }
    let started = Instant::now();
    let mut workload = Workload::new(instances);
    loop {
        let chunk: Vec<_> = workload
            .by_ref()
            .take(serve::BATCH_ENTRIES_MAX)
            .map(Ok)
            .collect();
        if chunk.is_empty() {
            break;
        }
        projector.apply_batch(chunk).expect("batch");
    }
    store.flush().expect("flush");
    started.elapsed().as_secs_f64()
}

/// The events of the workload of `instances`: 2 per provider, 7 per instance.
fn events_of(instances: u128) -> u64 {
    (2 * PROVIDERS + 7 * instances) as u64
}

/// A projection store on a sled of its own in a temp dir (kept alive by the caller).
fn fresh_store() -> (tempfile::TempDir, sled::Db, ProjectionStore) {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sled::Config::new()
        .path(dir.path())
        .cache_capacity(512 << 20)
        .open()
        .expect("sled");
    let store = ProjectionStore::open(&db).expect("store");
    (dir, db, store)
}

fn catch_up(events_target: u64) {
    // 7 events per instance, 2 per provider registration.
    let instances = ((events_target - 2 * PROVIDERS as u64) / 7) as u128;
    let (_dir, _db, store) = fresh_store(); // kept open until the reads below
    let projector_secs = project(&store, instances, 0);
    // Again into a fresh store, as serve runs it: a snapshot of every entity each time the
    // checkpoint crosses a multiple of SNAPSHOT_EVERY_POSITIONS_DEFAULT.
    let (serve_dir, serve_db, serve_store) = fresh_store();
    // serve's store keeps no copy of the log (the stream holds it).
    serve_store.keep_no_copy().expect("no copy");
    let serve_secs = project(
        &serve_store,
        instances,
        serve::SNAPSHOT_EVERY_POSITIONS_DEFAULT,
    );
    let snapshots = serve_store.snapshots().expect("snapshots");
    drop((serve_store, serve_db, serve_dir));
    // Again, handing each batch to serve's copier on a thread of its own (as serve runs
    // it by default). A batch the copier has no room for is dropped here and counted: serve
    // reads those back from the stream.
    let (copy_dir, copy_db, copy_store) = fresh_store();
    copy_store
        .keep_no_copy()
        .expect("no copy in the projection");
    let mut copy = serve::log_copy::LogCopy::open(&copy_db, 1).expect("copy");
    let (sender, mut batches) = serve::log_copy::queue();
    let started = Instant::now();
    let copier = std::thread::spawn(move || {
        let mut dropped = 0u64;
        while let Some(batch) = batches.blocking_recv() {
            dropped += batch.after - copy.extent().through;
            copy.write(&batch.commits, batch.through).expect("copy");
        }
        copy.flush(true).expect("flush");
        (dropped, started.elapsed().as_secs_f64())
    });
    let copying_secs = project_handing(
        &copy_store,
        instances,
        serve::SNAPSHOT_EVERY_POSITIONS_DEFAULT,
        Some(sender),
    );
    let (dropped, copied_secs) = copier.join().expect("copier");
    drop((copy_store, copy_db, copy_dir));
    let events = events_of(instances);
    let end = store.checkpoint().expect("checkpoint");

    let started = Instant::now();
    let mut raw_events = 0u64;
    for entry in store.raw_commits(1, end) {
        let (position, bytes) = entry.expect("read");
        raw_events += codec::decode(&bytes, position)
            .expect("decode")
            .events
            .len() as u64;
    }
    let raw_secs = started.elapsed().as_secs_f64();

    let started = Instant::now();
    let mut projection = Projection::new();
    for commit in store.commits(1, end) {
        projection.apply(&commit.expect("decode"));
    }
    let rebuild_secs = started.elapsed().as_secs_f64();
    assert_eq!(raw_events, events);
    assert_eq!(projection.entities.len() as u128, PROVIDERS + instances);

    let raw_rate = raw_events as f64 / raw_secs;
    let rebuild_rate = events as f64 / rebuild_secs;
    let projector_rate = events as f64 / projector_secs;
    println!("\n## catch-up ({events} events, {end} commits, {instances} instances)\n");
    println!("| measurement | events/s | vs raw read+decode | wall |");
    println!("|---|---:|---:|---:|");
    println!("| raw read + decode of the sled copy | {raw_rate:.0} | 1.00x | {raw_secs:.2} s |");
    println!(
        "| rebuild from the sled copy (read, decode, fold) | {rebuild_rate:.0} | {:.2}x | {rebuild_secs:.2} s |",
        rebuild_rate / raw_rate
    );
    println!(
        "| projector catch-up (fold + persist copy, entities, checkpoint per batch) | {projector_rate:.0} | {:.2}x | {projector_secs:.2} s |",
        projector_rate / raw_rate
    );
    let serve_rate = events as f64 / serve_secs;
    println!(
        "| as serve runs it: no copy of the log, snapshots every {} positions (kept: {snapshots:?}) | {serve_rate:.0} | {:.2}x | {serve_secs:.2} s |",
        serve::SNAPSHOT_EVERY_POSITIONS_DEFAULT,
        serve_rate / raw_rate
    );
    let copying_rate = events as f64 / copying_secs;
    println!(
        "| as serve runs it now: the same, handing each batch to its copier (thread of its own) | {copying_rate:.0} | {:.2}x | {copying_secs:.2} s |",
        copying_rate / raw_rate
    );
    let copied_rate = events as f64 / copied_secs;
    println!(
        "| ... until the copy is whole and flushed ({dropped} positions dropped, to read back from the stream) | {copied_rate:.0} | {:.2}x | {copied_secs:.2} s |",
        copied_rate / raw_rate
    );
}

fn memory(instances: u128) {
    let before = rss_kib();
    let mut projection = Projection::new();
    let mut workload = Workload::new(instances);
    for commit in workload.by_ref() {
        projection.apply(&commit);
    }
    let after = rss_kib();
    let instances_projected = projection.entities.len() as u128 - PROVIDERS;
    println!("\n## memory\n");
    println!(
        "| {instances_projected} instances (+{PROVIDERS} providers with their allocations) projected in memory | RSS {:.0} MiB (+{:.0} MiB, {:.0} bytes per instance) |",
        after as f64 / 1024.0,
        (after - before) as f64 / 1024.0,
        (after - before) as f64 * 1024.0 / instances_projected as f64
    );
    drop(projection);
}

fn percentile(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64
}

/// Sends requests at `rate` per second for `duration`, open loop, and records latencies.
async fn fixed_rate(
    client: &async_nats::Client,
    subject: &str,
    body: &str,
    rate: u64,
    duration: Duration,
) -> Histogram<u64> {
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut interval = tokio::time::interval(Duration::from_nanos(1_000_000_000 / rate));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let total = rate * duration.as_secs();
    for _ in 0..total {
        interval.tick().await;
        let client = client.clone();
        let subject = subject.to_string();
        let body = body.to_string();
        let tx = tx.clone();
        tokio::spawn(async move {
            let sent = Instant::now();
            let ok = client.request(subject, body.into()).await.is_ok();
            let _ = tx.send((ok, sent.elapsed().as_micros() as u64));
        });
    }
    drop(tx);
    let mut failed = 0;
    while let Some((ok, us)) = rx.recv().await {
        if ok {
            let _ = hist.record(us.max(1));
        } else {
            failed += 1;
        }
    }
    assert_eq!(failed, 0, "requests failed on {subject}");
    hist
}

async fn service_benches(quick: bool) {
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let log = JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("log");
    let dir = tempfile::tempdir().expect("tempdir");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = ServeOptions {
        snapshot_every: 0,
        executor_reply_wait: Duration::from_secs(10),
        recovery_interval: None,
        ..ServeOptions::new(nats.url(), dir.path().join("serve"))
    };
    let serve_task = tokio::spawn(serve::run(options, async {
        let _ = stopped.await;
    }));

    let mut ids = Vec::new();
    let mut last = 0;
    for n in 0..1000 {
        let id = Uuid::now_v7();
        let events = vec![Event::ClusterCreateRequested {
            name: format!("cluster-{n}"),
            plugin: "vanilla".into(),
            node_groups: Vec::new(),
        }];
        last = log
            .append(
                AggregateId::cluster(id),
                Expectation::NoStream,
                CommitDraft::now("bench", events),
            )
            .await
            .expect("append")
            .position;
        ids.push(id);
    }
    // Wait until the service is up and has applied everything.
    let probe = serde_json::json!({"id": ids[0], "min_position": last}).to_string();
    loop {
        if let Ok(r) = client
            .request("provledger.q.cluster.get", probe.clone().into())
            .await
        {
            if !r.payload.is_empty() {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reply = client
        .request("provledger.q.cluster.get", probe.clone().into())
        .await
        .expect("query");
    let echo_payload = bytes::Bytes::from(vec![b'x'; reply.payload.len()]);

    let echo = client
        .service_builder()
        .start("echo", "1.0.0")
        .await
        .expect("echo service");
    let mut endpoint = echo.endpoint("bench.echo").await.expect("echo endpoint");
    let echo_task = tokio::spawn(async move {
        while let Some(request) = endpoint.next().await {
            let _ = request.respond(Ok(echo_payload.clone())).await;
        }
    });

    let duration = Duration::from_secs(if quick { 2 } else { 5 });
    let query_body = serde_json::json!({"id": ids[17]}).to_string();
    let echo_hist = fixed_rate(&client, "bench.echo", "{}", 5000, duration).await;
    let query_hist = fixed_rate(
        &client,
        "provledger.q.cluster.get",
        &query_body,
        5000,
        duration,
    )
    .await;
    println!(
        "\n## query latency at 5,000 requests/s for {} s ({} byte replies)\n",
        duration.as_secs(),
        reply.payload.len()
    );
    println!("| service | p50 | p99 | p99 ratio |");
    println!("|---|---:|---:|---:|");
    println!(
        "| echo micro service | {:.0} us | {:.0} us | 1.00x |",
        percentile(&echo_hist, 0.5),
        percentile(&echo_hist, 0.99)
    );
    println!(
        "| provledger cluster.get | {:.0} us | {:.0} us | {:.2}x |",
        percentile(&query_hist, 0.5),
        percentile(&query_hist, 0.99),
        percentile(&query_hist, 0.99) / percentile(&echo_hist, 0.99)
    );

    let mut total = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram");
    let mut visible = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram");
    let rounds = if quick { 300 } else { 1000 };
    for n in 0..rounds {
        let id = ids[n % ids.len()];
        let started = Instant::now();
        let events = vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Spawning,
            description: format!("round {n}"),
        }];
        let position = log
            .append(
                AggregateId::cluster(id),
                Expectation::Any,
                CommitDraft::now("bench", events),
            )
            .await
            .expect("append")
            .position;
        let appended = Instant::now();
        let body = serde_json::json!({"id": id, "min_position": position}).to_string();
        let reply = client
            .request("provledger.q.cluster.get", body.into())
            .await
            .expect("query");
        let v: serde_json::Value = serde_json::from_slice(&reply.payload).expect("JSON");
        assert!(v["position"].as_u64().unwrap_or(0) >= position, "{v}");
        let _ = total.record(started.elapsed().as_micros() as u64);
        let _ = visible.record(appended.elapsed().as_micros() as u64);
    }
    println!("\n## freshness ({rounds} rounds: append, then cluster.get with min_position)\n");
    println!("| measurement | p50 | p99 |");
    println!("|---|---:|---:|");
    println!(
        "| append to queryable (append + query) | {:.0} us | {:.0} us |",
        percentile(&total, 0.5),
        percentile(&total, 0.99)
    );
    println!(
        "| acknowledged append to answer | {:.0} us | {:.0} us |",
        percentile(&visible, 0.5),
        percentile(&visible, 0.99)
    );

    let _ = stop.send(());
    serve_task
        .await
        .expect("serve task")
        .expect("serve stopped cleanly");
    echo_task.abort();
}

fn main() {
    println!(
        "allocator: {}",
        if cfg!(feature = "jemalloc") {
            "jemalloc"
        } else {
            "glibc malloc (--no-default-features)"
        }
    );
    let quick = std::env::args().any(|a| a == "--quick");
    let events = if quick { 200_000 } else { 1_000_000 };
    // `--events N`: the catch-up on another size (issue 23 asks 1M and 10M).
    let args: Vec<String> = std::env::args().collect();
    let events = args
        .iter()
        .position(|a| a == "--events")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(events);
    // `--memory-only`: the memory of a projection alone (to set two builds side by side).
    if args.iter().any(|a| a == "--memory-only") {
        memory(if quick { 100_000 } else { 1_000_000 });
        return;
    }
    catch_up(events);
    // Only the catch-up: to set two builds side by side (allocators) without the rest.
    if std::env::args().any(|a| a == "--catch-up-only") {
        return;
    }
    memory(if quick { 100_000 } else { 1_000_000 });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(service_benches(quick));
}
