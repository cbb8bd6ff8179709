//! `feed-bench`: what following the ledger costs and how fast it is (issue 38), measured in
//! one run against a real nats-server, with `provledger serve` in a child process of its
//! own (so that its memory is its own):
//!
//! 1. **Catch-up**: a [`Follower`] from position 0 over a stream of `--commits` commits
//!    (`q.changes` pages, decoded JSON), against the raw reference: the same stream read
//!    and decoded as serve's projector follows it (one ordered consumer from position 1,
//!    bincode), A B A B.
//! 2. **Live latency**: one follower, current, while `--rate` commits/s go through
//!    `cmd.append` (open loop, each a fresh provider): from the request's send to the
//!    change's delivery to the follower, and from the append's reply to the delivery;
//!    alone, then beside `--followers` other followers.
//! 3. **Followers and writes**: `cmd.append` from 64 clients in a closed loop for
//!    `--load-secs`, with no follower and with `--followers` followers (each its own
//!    connection, unfiltered, as `provledger watch` follows), B A B A: commits/s, and
//!    serve's resident memory (sampled from /proc every 200 ms, the largest seen). Then
//!    the physical reference, B A B A: the raw server doing the same work (a JetStream
//!    publish per write, the change's JSON on core NATS, followers as plain subscribers
//!    decoding every message).
//!
//! `cargo run --release -p provledger-tests --bin feed-bench [-- --commits N --rate R
//! --live-secs S --load-secs D --followers F --only catch-up,live,load]`. Needs `NATS_SERVER_BIN` (or
//! `.tools/nats-server`).

use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use provledger_client::follow::{Change, ChangeFilter, Followed, Follower};
use provledger_events::catalogue::ConsumerKind;
use provledger_events::{
    AggregateId, CommitDraft, Event, EventLog, Expectation, JetStreamConfig, JetStreamLog,
};
use provledger_serve::ServeOptions;
use provledger_tests::bench::percentile;
use provledger_tests::{workload, NatsServer};
use serde_json::{json, Value};
use uuid::Uuid;

// serve runs in the child on the allocator `provledger serve` runs on, as deployed.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const PREFIX: &str = "provledger";
const APPEND_SUBJECT: &str = "provledger.cmd.append";
const HEALTH_SUBJECT: &str = "provledger.q.health";
/// Commits per provider while the stream is filled: its registration, then claims and
/// releases in turn (as bootstrap-bench writes it).
const COMMITS_PER_PROVIDER: u64 = 20;
const WRITERS: usize = 64;
/// Writers per NATS connection in the closed loop.
const WRITERS_PER_CONNECTION: usize = 16;
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

struct Options {
    commits: u64,
    rate: u64,
    live: Duration,
    load: Duration,
    followers: usize,
    /// Which of `catch-up`, `live`, `load` to run (all by default).
    phases: Vec<String>,
}

impl Options {
    fn runs(&self, phase: &str) -> bool {
        self.phases.iter().any(|p| p == phase)
    }
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--serve") {
        let (Some(url), Some(dir), Some(metrics)) =
            (args.get(i + 1), args.get(i + 2), args.get(i + 3))
        else {
            eprintln!("usage: feed-bench --serve NATS_URL DATA_DIR METRICS_PORT");
            std::process::exit(2);
        };
        serve_child(url.clone(), dir.as_ref(), metrics.parse().ok());
        return;
    }
    let options = Options {
        commits: arg(&args, "--commits", 1_000_000),
        rate: arg(&args, "--rate", 1_000),
        live: Duration::from_secs(arg(&args, "--live-secs", 30)),
        load: Duration::from_secs(arg(&args, "--load-secs", 20)),
        followers: arg(&args, "--followers", 100) as usize,
        phases: args
            .iter()
            .position(|a| a == "--only")
            .and_then(|i| args.get(i + 1))
            .map_or("catch-up,live,load", String::as_str)
            .split(',')
            .map(str::to_string)
            .collect(),
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the bench's runtime")
        .block_on(bench(options));
}

/// The child: `provledger serve` with the CLI's defaults (and its metrics on
/// 127.0.0.1:`metrics_port`), until killed.
fn serve_child(nats_url: String, dir: &Path, metrics_port: Option<u16>) {
    let mut options = ServeOptions::new(nats_url, dir.to_path_buf());
    options.metrics_addr =
        metrics_port.map(|port| std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("serve's runtime")
        .block_on(provledger_serve::run(options, std::future::pending::<()>()));
    if let Err(e) = result {
        eprintln!("serve stopped: {e}");
        std::process::exit(1);
    }
}

/// serve in a child process of this binary, with its metrics port; killed when dropped.
struct ServeProcess(Child, u16);

impl ServeProcess {
    fn start(nats_url: &str, dir: &Path) -> ServeProcess {
        let exe = std::env::current_exe().expect("this binary's path");
        let port = provledger_tests::free_port();
        let child = Command::new(exe)
            .arg("--serve")
            .arg(nats_url)
            .arg(dir)
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting serve's child process");
        ServeProcess(child, port)
    }

    /// Entries `q.changes` read from the stream so far (`provledger_changes_read_total`).
    fn changes_read_from_stream(&self) -> Option<f64> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.1)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut scrape = String::new();
        stream.read_to_string(&mut scrape).ok()?;
        Some(
            scrape
                .lines()
                .find_map(|l| {
                    l.strip_prefix("provledger_changes_read_total{source=\"stream\"}")?
                        .trim()
                        .parse()
                        .ok()
                })
                .unwrap_or(0.0),
        )
    }

    /// Waits until serve's copy of the stream holds `end` (a `q.changes` of the last
    /// position reads nothing from the stream): a replica in its steady state, whose
    /// copier is not reading the stream back beside the catch-up measured.
    async fn copy_whole(&self, client: &async_nats::Client, end: u64) -> Duration {
        let since = Instant::now();
        let probe = Bytes::from(json!({"after": end.saturating_sub(1), "limit": 1}).to_string());
        loop {
            let before = self.changes_read_from_stream();
            let reply = request(client, "provledger.q.changes", probe.clone()).await;
            assert!(reply["data"].is_object(), "q.changes: {reply}");
            if before.is_some() && self.changes_read_from_stream() == before {
                return since.elapsed();
            }
            assert!(
                since.elapsed() < Duration::from_secs(1800),
                "serve's copy did not reach {end}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Resident memory now (VmRSS), bytes.
    fn rss(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.0.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn request(client: &async_nats::Client, subject: &'static str, payload: Bytes) -> Value {
    let request = async_nats::Request::new()
        .payload(payload)
        .timeout(Some(REQUEST_TIMEOUT));
    match client.send_request(subject, request).await {
        Ok(reply) => serde_json::from_slice(&reply.payload).unwrap_or(Value::Null),
        Err(e) => json!({"error": {"code": "request_failed", "message": e.to_string()}}),
    }
}

/// Waits until serve answers ready with everything up to `end` applied.
async fn ready_at(client: &async_nats::Client, end: u64) {
    let deadline = Instant::now() + Duration::from_secs(1800);
    loop {
        let health = request(client, HEALTH_SUBJECT, Bytes::from_static(b"{}")).await;
        if health["data"]["ready"] == true && health["position"].as_u64() >= Some(end) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "serve did not catch up: {health}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn inventory(total: u64) -> Value {
    json!({"inventory_set": {"resource_class": "VCPU", "inventory": {
        "total": total, "reserved": 0, "allocation_ratio": 1.0,
        "min_unit": 1, "max_unit": total, "step_size": 1}}})
}

fn append(id: Uuid, events: Value) -> Bytes {
    Bytes::from(
        json!({"aggregate": format!("provider/{id}"), "expect": "any", "events": events})
            .to_string(),
    )
}

fn registration(id: Uuid) -> Bytes {
    append(
        id,
        json!([
            {"provider_registered": {"name": format!("fb-{}", id.simple()), "host": "fb.example"}},
            inventory(64)
        ]),
    )
}

/// Fills the stream with `commits` commits over providers, 64 appends at a time.
async fn fill(log: &JetStreamLog, commits: u64) {
    let providers = commits.div_ceil(COMMITS_PER_PROVIDER);
    let written = AtomicU64::new(0);
    let started = Instant::now();
    futures::stream::iter(0..providers)
        .for_each_concurrent(64, |p| {
            let (log, written) = (log.clone(), &written);
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
                    .expect("filling the stream");
                    let n = written.fetch_add(1, Ordering::Relaxed) + 1;
                    if n % 100_000 == 0 {
                        eprintln!(
                            "  {n} commits written ({:.0}/s)",
                            n as f64 / started.elapsed().as_secs_f64()
                        );
                    }
                }
            }
        })
        .await;
}

/// The raw reference: every commit up to `end` read and decoded from an ordered consumer.
async fn raw_read(log: &JetStreamLog, end: u64) -> (Duration, u64) {
    let started = Instant::now();
    let mut commits = 0;
    let mut tail = log.subscribe(1).await.expect("an ordered consumer");
    while let Some(commit) = tail.next().await {
        let commit = commit.expect("a decoded commit");
        commits += 1;
        if commit.position >= end {
            break;
        }
    }
    (started.elapsed(), commits)
}

/// A follower from position 0 until it is current at `end` or later.
async fn catch_up(client: async_nats::Client, end: u64) -> (Duration, u64) {
    let started = Instant::now();
    let mut follower = Follower::start(client, PREFIX, ChangeFilter::default(), 0)
        .await
        .expect("a follower");
    let mut changes = 0;
    let mut last = 0;
    loop {
        match follower.next().await.expect("following") {
            Followed::Change(change) => {
                assert!(change.commit.position > last, "out of order");
                last = change.commit.position;
                changes += 1;
            }
            Followed::Current { position } if position >= end => break,
            Followed::Current { .. } => {}
        }
    }
    (started.elapsed(), changes)
}

/// Each request's send time and its reply's, by the provider it registers.
type SendTimes = Arc<Mutex<HashMap<Uuid, (Instant, Option<Instant>)>>>;

/// Latencies of the live feed at `rate` commits/s for `live`: (send → delivery, reply →
/// delivery, commits delivered, commits sent).
async fn live_latency(
    nats_url: &str,
    rate: u64,
    live: Duration,
) -> (Vec<Duration>, Vec<Duration>, usize, usize) {
    let writer = async_nats::connect(nats_url).await.expect("writer");
    let reader = async_nats::connect(nats_url).await.expect("follower");
    let sent: SendTimes = Arc::default();
    let health = request(&writer, HEALTH_SUBJECT, Bytes::from_static(b"{}")).await;
    let from = health["position"].as_u64().unwrap_or(0);
    let mut follower = Follower::start(reader, PREFIX, ChangeFilter::default(), from)
        .await
        .expect("a follower");
    // Current first: the catch-up is not what is measured.
    while !matches!(follower.next().await, Ok(Followed::Current { .. })) {}
    let done = Arc::new(AtomicBool::new(false));
    let delivered = {
        let (sent, done) = (sent.clone(), done.clone());
        tokio::spawn(async move {
            let mut from_send = Vec::new();
            let mut from_reply = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let next = tokio::time::timeout(Duration::from_millis(200), follower.next()).await;
                let Ok(Ok(Followed::Change(change))) = next else {
                    continue;
                };
                let at = Instant::now();
                let AggregateId { id, .. } = change.commit.aggregate;
                if let Some((send, reply)) = sent.lock().expect("not poisoned").get(&id) {
                    from_send.push(at - *send);
                    if let Some(reply) = reply {
                        from_reply.push(at.saturating_duration_since(*reply));
                    }
                }
            }
            (from_send, from_reply)
        })
    };
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut requests = Vec::new();
    while started.elapsed() < live {
        ticks.tick().await;
        let id = Uuid::now_v7();
        sent.lock()
            .expect("not poisoned")
            .insert(id, (Instant::now(), None));
        let (writer, sent) = (writer.clone(), sent.clone());
        requests.push(tokio::spawn(async move {
            let reply = request(&writer, APPEND_SUBJECT, registration(id)).await;
            if let Some(entry) = sent.lock().expect("not poisoned").get_mut(&id) {
                entry.1 = Some(Instant::now());
            }
            reply["error"].is_null()
        }));
    }
    let mut ok = 0;
    for r in requests {
        ok += usize::from(r.await.unwrap_or(false));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    done.store(true, Ordering::Relaxed);
    let (from_send, from_reply) = delivered.await.expect("the follower's task");
    let count = from_send.len();
    (from_send, from_reply, count, ok)
}

/// What a closed-loop writer saw.
#[derive(Default)]
struct Outcomes {
    ok: u64,
    errors: u64,
}

impl Outcomes {
    fn count(&mut self, ok: bool) {
        if ok {
            self.ok += 1;
        } else {
            self.errors += 1;
        }
    }

    async fn sum(tasks: Vec<tokio::task::JoinHandle<Outcomes>>) -> Outcomes {
        let mut total = Outcomes::default();
        for t in tasks {
            let o = t.await.expect("a writer's task");
            total.ok += o.ok;
            total.errors += o.errors;
        }
        total
    }
}

/// `cmd.append` from [`WRITERS`] clients in a closed loop for `load`, each writing an
/// inventory to its own provider; commits/s and errors.
async fn write_load(nats_url: &str, providers: &[Uuid], load: Duration) -> (f64, u64) {
    let mut connections = Vec::new();
    for _ in 0..WRITERS.div_ceil(WRITERS_PER_CONNECTION) {
        connections.push(async_nats::connect(nats_url).await.expect("a writer"));
    }
    let started = Instant::now();
    let tasks: Vec<_> = providers
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let client = connections[n / WRITERS_PER_CONNECTION].clone();
            let payload = append(*id, json!([inventory(64)]));
            tokio::spawn(async move {
                let mut outcomes = Outcomes::default();
                while started.elapsed() < load {
                    let reply = request(&client, APPEND_SUBJECT, payload.clone()).await;
                    outcomes.count(reply["error"].is_null());
                }
                outcomes
            })
        })
        .collect();
    let outcomes = Outcomes::sum(tasks).await;
    (
        outcomes.ok as f64 / started.elapsed().as_secs_f64(),
        outcomes.errors,
    )
}

/// The physical reference of the write path with followers: the raw server doing the same
/// work without provledger. [`WRITERS`] clients in a closed loop, each publishing a
/// change's JSON to a JetStream stream (waiting for its ack) and then the same bytes on a
/// core NATS subject, which `followers` plain subscribers (each its own connection) decode
/// as a follower decodes a change. Writes/s.
async fn raw_write_load(
    nats_url: &str,
    change: &Bytes,
    followers: usize,
    following: Following,
    load: Duration,
) -> (f64, u64) {
    let stop = Arc::new(AtomicBool::new(false));
    let decoded = Arc::new(AtomicU64::new(0));
    let mut subscribers = Vec::new();
    for i in 0..followers {
        let client = async_nats::connect(nats_url).await.expect("a raw follower");
        let subject = match following {
            Following::All => "fbraw.feed.>".to_string(),
            // The subject one writer publishes on, as a follower of one provider.
            Following::OneProvider => format!("fbraw.feed.{}", i % WRITERS),
        };
        let mut feed = client
            .subscribe(subject)
            .await
            .expect("a raw feed subscription");
        client.flush().await.expect("the subscription in effect");
        let (stop, decoded) = (stop.clone(), decoded.clone());
        subscribers.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let next = tokio::time::timeout(Duration::from_millis(200), feed.next()).await;
                if let Ok(Some(message)) = next {
                    if serde_json::from_slice::<Change>(&message.payload).is_ok() {
                        decoded.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            drop(client);
        }));
    }
    let mut connections = Vec::new();
    for _ in 0..WRITERS.div_ceil(WRITERS_PER_CONNECTION) {
        connections.push(async_nats::connect(nats_url).await.expect("a raw writer"));
    }
    let started = Instant::now();
    let tasks: Vec<_> = (0..WRITERS)
        .map(|n| {
            let client = connections[n / WRITERS_PER_CONNECTION].clone();
            let js = async_nats::jetstream::new(client.clone());
            let change = change.clone();
            tokio::spawn(async move {
                let mut outcomes = Outcomes::default();
                while started.elapsed() < load {
                    let stored = match js.publish(format!("fbraw.ev.{n}"), change.clone()).await {
                        Ok(ack) => ack.await.is_ok(),
                        Err(_) => false,
                    };
                    let published = client
                        .publish(format!("fbraw.feed.{n}"), change.clone())
                        .await
                        .is_ok();
                    outcomes.count(stored && published);
                }
                outcomes
            })
        })
        .collect();
    let Outcomes { ok, errors } = Outcomes::sum(tasks).await;
    let rate = ok as f64 / started.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for s in subscribers {
        let _ = s.await;
    }
    (rate, errors)
}

/// Whom the followers of the load phase follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Following {
    /// The whole feed, unfiltered.
    All,
    /// Each one provider the writers write (follower `n` the provider `n` modulo their
    /// number), on that provider's subject alone.
    OneProvider,
}

/// `followers` followers from the current end, each on its own connection, counting what
/// they are handed until `stop`; their total (changes, gaps, catch-up pages).
async fn start_followers(
    nats_url: &str,
    followers: usize,
    following: Following,
    providers: &[Uuid],
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<(u64, u64, u64)>> {
    let mut tasks = Vec::new();
    for n in 0..followers {
        let client = async_nats::connect(nats_url).await.expect("a follower");
        let health = request(&client, HEALTH_SUBJECT, Bytes::from_static(b"{}")).await;
        let from = health["position"].as_u64().unwrap_or(0);
        let filter = match following {
            Following::All => ChangeFilter::default(),
            Following::OneProvider => ChangeFilter {
                aggregate: Some(AggregateId::provider(providers[n % providers.len()])),
                ..Default::default()
            },
        };
        let mut follower = Follower::start(client, PREFIX, filter, from)
            .await
            .expect("a follower");
        while !matches!(follower.next().await, Ok(Followed::Current { .. })) {}
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut changes = 0;
            while !stop.load(Ordering::Relaxed) {
                let next = tokio::time::timeout(Duration::from_millis(200), follower.next()).await;
                if let Ok(Ok(Followed::Change(_))) = next {
                    changes += 1;
                }
            }
            let stats = follower.stats();
            (changes, stats.gaps, stats.catch_ups)
        }));
    }
    tasks
}

/// The mean rate of the two runs with no follower (`None`) or with followers following
/// `wanted`, of rows (followers, following, rate).
fn mean_rate(
    rows: impl Iterator<Item = (usize, Following, f64)>,
    wanted: Option<Following>,
) -> f64 {
    rows.filter(|(followers, following, _)| match wanted {
        None => *followers == 0,
        Some(w) => *followers != 0 && *following == w,
    })
    .map(|(_, _, rate)| rate)
    .sum::<f64>()
        / 2.0
}

/// How a row's followers follow, for a table ("-" with none).
fn label(followers: usize, following: Following) -> String {
    if followers == 0 {
        "-".to_string()
    } else {
        format!("{following:?}")
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn bench(options: Options) {
    let nats = NatsServer::start().await;
    let url = nats.url();
    let client = nats.client().await;
    let log = JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("the stream");
    eprintln!("filling the stream with {} commits", options.commits);
    let filled = Instant::now();
    fill(&log, options.commits).await;
    let end = log.last_position().await.expect("the stream's end");
    eprintln!("filled in {:.1?}", filled.elapsed());

    let dir = tempfile::tempdir().expect("serve's data dir");
    let serve = ServeProcess::start(&url, &dir.path().join("serve"));
    let since = Instant::now();
    ready_at(&client, end).await;
    eprintln!("serve ready at {end} after {:.1?}", since.elapsed());
    let whole = serve.copy_whole(&client, end).await;
    eprintln!("serve's copy of the stream whole {whole:.1?} later");

    // 1. Catch-up, A B A B.
    let mut rows = Vec::new();
    for round in 0..if options.runs("catch-up") { 2 } else { 0 } {
        eprintln!("catch-up round {}", round + 1);
        let (raw, raw_commits) = raw_read(&log, end).await;
        let (followed, changes) = catch_up(nats.client().await, end).await;
        assert_eq!(raw_commits, end, "the raw read saw every commit");
        assert_eq!(changes, end, "the follower was handed every commit");
        rows.push((raw, followed));
    }

    // 2. Live latency, alone and beside the other followers.
    let mut live_rows = Vec::new();
    let crowds = if options.runs("live") {
        vec![0, options.followers]
    } else {
        Vec::new()
    };
    for others in crowds {
        eprintln!(
            "live delivery at {} commits/s for {:?}, {others} other followers",
            options.rate, options.live
        );
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = start_followers(&url, others, Following::All, &[], stop.clone()).await;
        let measured = live_latency(&url, options.rate, options.live).await;
        stop.store(true, Ordering::Relaxed);
        let mut gaps = 0;
        for t in tasks {
            gaps += t.await.expect("a follower's task").1;
        }
        live_rows.push((others, measured, gaps));
    }

    // 3. Writes with and without followers, B A B A.
    let providers: Vec<Uuid> = (0..WRITERS).map(|_| Uuid::now_v7()).collect();
    for id in &providers {
        let reply = request(&client, APPEND_SUBJECT, registration(*id)).await;
        assert!(reply["error"].is_null(), "registering a provider: {reply}");
    }
    let serve = Arc::new(serve);
    let mut load_rows = Vec::new();
    let f = options.followers;
    let loads: Vec<(usize, Following)> = if options.runs("load") {
        [0, f, f, 0, f, f]
            .into_iter()
            .zip([Following::All, Following::All, Following::OneProvider].repeat(2))
            .collect()
    } else {
        Vec::new()
    };
    for (followers, following) in loads.clone() {
        eprintln!(
            "writes for {:?} with {followers} followers ({following:?})",
            options.load
        );
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = start_followers(&url, followers, following, &providers, stop.clone()).await;
        let sampling = Arc::new(AtomicBool::new(true));
        let sampler = {
            let (serve, sampling) = (serve.clone(), sampling.clone());
            tokio::spawn(async move {
                let mut peak = 0;
                while sampling.load(Ordering::Relaxed) {
                    peak = peak.max(serve.rss());
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                peak
            })
        };
        let (rate, errors) = write_load(&url, &providers, options.load).await;
        sampling.store(false, Ordering::Relaxed);
        let peak = sampler.await.unwrap_or(0);
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.store(true, Ordering::Relaxed);
        let (mut changes, mut gaps, mut pages) = (0, 0, 0);
        for t in tasks {
            let (c, g, p) = t.await.expect("a follower's task");
            changes += c;
            gaps += g;
            pages += p;
        }
        load_rows.push((
            followers, following, rate, errors, peak, changes, gaps, pages,
        ));
    }

    // The physical reference: the raw server, same loads, with a real change's JSON.
    let mut raw_rows = Vec::new();
    let mut change = Bytes::new();
    if options.runs("load") {
        let end = request(&client, HEALTH_SUBJECT, Bytes::from_static(b"{}")).await["position"]
            .as_u64()
            .unwrap_or(1);
        let page = request(
            &client,
            "provledger.q.changes",
            Bytes::from(json!({"after": end - 1, "limit": 1}).to_string()),
        )
        .await;
        let mut one = page["data"]["changes"][0].clone();
        one["prev"] = json!(end - 1);
        change = Bytes::from(one.to_string());
        log.context()
            .create_stream(async_nats::jetstream::stream::Config {
                name: "FB_RAW".into(),
                subjects: vec!["fbraw.ev.>".into()],
                ..Default::default()
            })
            .await
            .expect("the raw stream");
        for (followers, following) in loads.clone() {
            eprintln!(
                "raw writes for {:?} with {followers} plain subscribers ({following:?})",
                options.load
            );
            let (rate, errors) =
                raw_write_load(&url, &change, followers, following, options.load).await;
            raw_rows.push((followers, following, rate, errors));
        }
    }

    println!(
        "\n## feed-bench: nats-server {}, {} commits, {}\n",
        log.server_version(),
        end,
        provledger_tests::cpu_model()
    );
    println!("catch-up from position 0 (a Follower through q.changes, JSON) against a raw read + decode of the stream (ordered consumer, bincode):\n");
    println!("| round | raw read + decode | commits/s | follower catch-up | commits/s | follower / raw |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for (round, (raw, followed)) in rows.iter().enumerate() {
        let raw_rate = end as f64 / raw.as_secs_f64();
        let followed_rate = end as f64 / followed.as_secs_f64();
        println!(
            "| {} | {:.2} s | {:.0} | {:.2} s | {:.0} | **{:.2}x** |",
            round + 1,
            raw.as_secs_f64(),
            raw_rate,
            followed.as_secs_f64(),
            followed_rate,
            followed_rate / raw_rate
        );
    }
    println!(
        "\nlive delivery to one follower, {} commits/s offered through cmd.append (open loop, each a new provider) for {} s, alone and with {} other followers (each its own connection, unfiltered):\n",
        options.rate,
        options.live.as_secs(),
        options.followers
    );
    println!(
        "| other followers | appended | delivered | from | p50 | p99 | p99.9 | max | their gaps |"
    );
    println!("|---:|---:|---:|---|---:|---:|---:|---:|---:|");
    for (others, (from_send, from_reply, delivered, sent), gaps) in &live_rows {
        for (what, latencies) in [
            ("the request's send", from_send),
            ("the append's reply", from_reply),
        ] {
            println!(
                "| {others} | {sent} | {delivered} | {what} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {gaps} |",
                ms(percentile(latencies, 0.5)),
                ms(percentile(latencies, 0.99)),
                ms(percentile(latencies, 0.999)),
                ms(percentile(latencies, 1.0)),
            );
        }
    }
    println!(
        "\ncmd.append from {WRITERS} clients on {WRITERS} providers (closed loop, {} s each), with and without followers (each its own connection; `All`: unfiltered, `OneProvider`: each follows one of the providers written, on its subject alone):\n",
        options.load.as_secs()
    );
    println!("| followers | following | commits/s | errors | serve's peak RSS | changes handed to followers | gaps caught up | catch-up pages |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    for (followers, following, rate, errors, peak, changes, gaps, pages) in &load_rows {
        let following = label(*followers, *following);
        println!(
            "| {followers} | {following} | {rate:.0} | {errors} | {:.1} MB | {changes} | {gaps} | {pages} |",
            mb(*peak)
        );
    }
    let mean = |wanted| mean_rate(load_rows.iter().map(|r| (r.0, r.1, r.2)), wanted);
    let none = mean(None);
    let with = mean(Some(Following::All));
    // (no ratio when the load phase did not run: `--only`)
    if !load_rows.is_empty() {
        println!(
        "\nwrite rate with {} followers / none (means of two runs each): **{:.2}x** unfiltered, **{:.2}x** each following one provider",
        options.followers,
            with / none,
            mean(Some(Following::OneProvider)) / none
        );
    }
    if !raw_rows.is_empty() {
        println!(
            "\nthe physical reference, the same run: the raw server doing the same work without provledger ({WRITERS} clients, closed loop: a JetStream publish of a change's JSON ({} bytes) awaiting its ack, then the same bytes on a core NATS subject; each follower a plain subscriber on its own connection decoding every message as a follower does, `All` on every writer's subject, `OneProvider` on one writer's):\n",
            change.len()
        );
        println!("| followers | following | writes/s | errors |");
        println!("|---:|---|---:|---:|");
        for (followers, following, rate, errors) in &raw_rows {
            let following = label(*followers, *following);
            println!("| {followers} | {following} | {rate:.0} | {errors} |");
        }
        let raw_mean = |wanted| mean_rate(raw_rows.iter().map(|r| (r.0, r.1, r.2)), wanted);
        let raw_none = raw_mean(None);
        for following in [Following::All, Following::OneProvider] {
            println!(
                "\n{following:?}: raw write rate with {} followers / none: **{:.2}x** (provledger's: {:.2}x; provledger with followers / raw with followers: {:.2}x)",
                options.followers,
                raw_mean(Some(following)) / raw_none,
                mean(Some(following)) / none,
                mean(Some(following)) / raw_mean(Some(following)),
            );
        }
    }
}
