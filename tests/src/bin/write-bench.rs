//! `write-bench`: the write path as a service outside Rust uses it: `provledger.cmd.append`
//! (NATS request/reply, JSON) answered by a real `provledger serve` running in this process
//! (`provledger_serve::run` on its own 2-thread runtime, a temp data dir, the CLI's defaults)
//! against a private nats-server, each figure next to its reference from the same run:
//!
//! 1. Throughput: closed-loop clients (1, 16, 64, 256) each appending an `inventory_set`
//!    with `expect: "any"` to its share of 1,000 providers for D seconds; next to raw
//!    JetStream doing the same work on async-nats (direct get of the subject's last message,
//!    then a publish with `Nats-Expected-Last-Subject-Sequence` and `Nats-Msg-Id`) and
//!    PostgreSQL (one `INSERT ... SELECT coalesce(max(version), 0) + 1` per write); a relay
//!    micro service doing only the NATS work of a `cmd.append` (request, publish expecting
//!    its kept sequence, ack, reply), the floor of any service of serve's shape; the client
//!    library's `Writer::record` from as many tasks (a service linking provledger); plus the
//!    load generator's own ceiling against a trivial echo micro service.
//! 2. Latency vs aggregate depth: 200 sequential cmd.append on providers of 10, 1,000 and
//!    100,000 commits (built through `JetStreamLog` with `Exactly(v)` appends).
//! 3. Hot aggregate: 64 clients writing one provider, next to PostgreSQL doing
//!    `SELECT ... FOR UPDATE`, insert, update in one transaction on 64 connections.
//! 4. Sustained: 64 clients for S seconds, per 5-second window, with nats-server's own
//!    figures from its monitoring endpoint (consumers on the stream, memory); then again
//!    under `deploy/nats/accounts.conf` (serve as `serve`, the clients as `provisioner`),
//!    twice on one server: from an empty stream, then on the stream the first round left.
//! 5. Atomic: 1, 16, 64 and 256 clients writing two providers per request (`cmd.append`
//!    with `commits`: atomic sets, grouped into shared JetStream atomic batches) next to one
//!    provider per request; the same through the client library (`record_atomic` vs
//!    `record`, 64 tasks); raw JetStream atomic batches as the ceiling (two messages per
//!    batch from as many publishers as clients, and one group's worth per batch); and the
//!    first write on a provider another process deepened after serve last wrote it.
//!
//! `--only wide` (not in a whole run): claims on providers holding 1,000 to 100,000
//! allocations next to one holding none, and what `q.provider.get` answers for each.
//! `--only pairs` (not in a whole run): the first table of 5. alone.
//! `--clients N,...`: the throughput phase and the pairs table at those client counts only.
//!
//! Clients share one NATS connection per 16. Tables go to stdout, progress to stderr.
//! PostgreSQL is 127.0.0.1:5432, user postgres, database test (trust auth); the bench
//! creates and drops its own `wb_*` tables, and skips PostgreSQL if it is unreachable.
//!
//! Usage: `cargo run --release -p provledger-tests --bin write-bench -- [--quick]
//! [--duration SECS] [--sustained SECS]
//! [--only throughput|alternating|depth|hot|sustained|atomic|mixed|pairs|deep|wide] [--no-log-copy]
//! [--clients N,...]`
//! (`--no-log-copy`: serve keeps no copy of the stream in its data dir, as
//! `provledger serve --no-log-copy`).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream::DirectGetErrorKind;
use bytes::Bytes;
use futures::StreamExt;
use provledger_events::catalogue::ConsumerKind;
use provledger_events::{
    AggregateId, Commit, CommitDraft, Event, EventLog, Expectation, Hash, JetStreamConfig,
    JetStreamLog,
};
use provledger_serve::ServeOptions;
use provledger_tests::bench::{percentile, publish_expecting};
use provledger_tests::NatsServer;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use uuid::Uuid;

// serve runs here in process: on the allocator `provledger serve` runs on, as deployed.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const USAGE: &str = "usage: write-bench [--quick] [--duration SECS] [--sustained SECS] \
                     [--only throughput|alternating|depth|hot|sustained|atomic|mixed|pairs|deep|wide] \
                     [--no-log-copy] \
                     [--clients N,N,...]";
const AGGREGATES: usize = 1000;
const CLIENT_COUNTS: [usize; 4] = [1, 16, 64, 256];
const CLIENTS_PER_CONNECTION: usize = 16;
const HOT_CLIENTS: usize = 64;
const SUSTAINED_CLIENTS: usize = 64;
const WINDOW: Duration = Duration::from_secs(5);
/// Slices of each system in the alternating phase: enough that the median of their ratios
/// holds still on a machine whose speed moves by a third from one run to the next.
const ALTERNATING_ROUNDS: usize = 10;
/// How long the alternating phase lets serve's copier finish after its projector caught up
/// (the copier writes each batch once the projector hands it over: milliseconds).
const COPIER_SETTLE: Duration = Duration::from_millis(200);
const DEPTH_SAMPLES: usize = 200;
/// Longer than anything serve should take, so a slow reply is measured, not dropped.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const STREAM: &str = "PROVLEDGER";
const APPEND_SUBJECT: &str = "provledger.cmd.append";
const HEALTH_SUBJECT: &str = "provledger.q.health";
const ECHO_SUBJECT: &str = "wb.echo";
const RAW_STREAM: &str = "WB_RAW";
const RAW_PREFIX: &str = "wbraw";
const RELAY_SUBJECT: &str = "wb.relay";
const RELAY_STREAM: &str = "WB_RELAY";
const RELAY_PREFIX: &str = "wbrelay";
const RAW_BATCH_STREAM: &str = "WB_RAW_BATCH";
const RAW_BATCH_PREFIX: &str = "wbbatch";
const PG_CONFIG: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test connect_timeout=3";
const PG_CONNECTIONS_CAP: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    Throughput,
    Depth,
    Hot,
    Sustained,
    Atomic,
    /// Only the sustained run with half of the requests atomic pairs.
    Mixed,
    /// Only atomic pairs against single commits through serve (the first table of
    /// `atomic`), at `--clients`' counts: a quick side-by-side run.
    Pairs,
    /// Only the first write after another process deepened a provider (also in `atomic`).
    Deep,
    /// Only claims on providers that hold many allocations, next to one that holds none.
    Wide,
    /// Only `cmd.append` against raw JetStream, in slices of `--duration` that alternate
    /// ([`ALTERNATING_ROUNDS`] of each), at `--clients`' counts.
    Alternating,
}

struct Options {
    quick: bool,
    /// serve keeps its copy of the stream (the default; `--no-log-copy`: not).
    log_copy: bool,
    duration: Duration,
    sustained: Duration,
    depths: Vec<usize>,
    only: Option<Phase>,
    /// The throughput phase's and the pairs table's client counts (`--clients 64`: one row, for
    /// side-by-side runs).
    clients: Vec<usize>,
}

impl Options {
    fn runs(&self, phase: Phase) -> bool {
        self.only.is_none_or(|p| p == phase)
    }
}

fn parse_options() -> Options {
    let fail = |message: String| -> ! {
        eprintln!("{message}\n{USAGE}");
        std::process::exit(2)
    };
    let seconds = |flag: &str, value: Option<String>| -> u64 {
        match value.as_deref().map(str::parse::<u64>) {
            Some(Ok(s)) if s > 0 => s,
            _ => fail(format!("{flag} needs a number of seconds > 0")),
        }
    };
    let (mut quick, mut duration, mut sustained, mut only) = (false, None, None, None);
    let mut log_copy = true;
    let mut clients = CLIENT_COUNTS.to_vec();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => quick = true,
            "--no-log-copy" => log_copy = false,
            "--clients" => {
                let value = args.next().unwrap_or_default();
                clients = value
                    .split(',')
                    .map(|n| n.parse::<usize>().ok().filter(|n| *n > 0))
                    .collect::<Option<Vec<_>>>()
                    .filter(|c| !c.is_empty())
                    .unwrap_or_else(|| {
                        fail(format!(
                            "--clients takes client counts > 0, comma-separated, not {value:?}"
                        ))
                    });
            }
            "--duration" => duration = Some(seconds("--duration", args.next())),
            "--sustained" => sustained = Some(seconds("--sustained", args.next())),
            "--only" => {
                only = Some(match args.next().as_deref() {
                    Some("throughput") => Phase::Throughput,
                    Some("depth") => Phase::Depth,
                    Some("hot") => Phase::Hot,
                    Some("sustained") => Phase::Sustained,
                    Some("atomic") => Phase::Atomic,
                    Some("mixed") => Phase::Mixed,
                    Some("pairs") => Phase::Pairs,
                    Some("deep") => Phase::Deep,
                    Some("wide") => Phase::Wide,
                    Some("alternating") => Phase::Alternating,
                    other => fail(format!(
                        "--only takes throughput, alternating, depth, hot, sustained, atomic, mixed, pairs, deep or wide, not {other:?}"
                    )),
                })
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            other => fail(format!("unknown argument {other}")),
        }
    }
    let depths = match quick {
        true => vec![10, 1_000, 10_000],
        false => vec![10, 1_000, 100_000],
    };
    Options {
        quick,
        log_copy,
        duration: Duration::from_secs(duration.unwrap_or(if quick { 2 } else { 10 })),
        sustained: Duration::from_secs(sustained.unwrap_or(if quick { 10 } else { 60 })),
        depths,
        only,
        clients,
    }
}

// ---------------------------------------------------------------------------------------
// Requests

fn inventory(total: u64) -> Value {
    json!({"inventory_set": {"resource_class": "VCPU", "inventory": {
        "total": total, "reserved": 0, "allocation_ratio": 1.0,
        "min_unit": 1, "max_unit": total, "step_size": 1}}})
}

fn registration(n: usize) -> Value {
    json!([
        {"provider_registered": {"name": format!("wb-{n}"), "host": format!("wb-{n}.example")}},
        inventory(64)
    ])
}

fn append_request(id: Uuid, expect: Value, events: Value) -> Bytes {
    let request =
        json!({"aggregate": format!("provider/{id}"), "expect": expect, "events": events});
    Bytes::from(request.to_string())
}

/// The write every phase measures: an inventory that is always admitted, `expect: "any"`.
fn bench_write(id: Uuid) -> Bytes {
    append_request(id, json!("any"), json!([inventory(64)]))
}

/// The encoded size of the commit a bench write appends: the raw and PostgreSQL
/// references store payloads of this size.
fn commit_bytes() -> usize {
    let events: Vec<Event> = serde_json::from_value(json!([inventory(64)]))
        .expect("the bench's event is in the catalogue");
    let commit = Commit::seal(
        AggregateId::provider(Uuid::now_v7()),
        2,
        Hash::ZERO,
        CommitDraft::now("nats:cmd.append", events),
    );
    provledger_events::codec::encode(&commit)
        .map(|b| b.len())
        .expect("encoding the bench commit")
}

/// The error of a micro-service reply, as its `Nats-Service-Error` header says it:
/// `code: message`.
fn reply_error(reply: &async_nats::Message) -> Option<String> {
    let header = reply
        .headers
        .as_ref()?
        .get(async_nats::service::NATS_SERVICE_ERROR)?;
    Some(header.as_str().to_string())
}

fn request_error(e: &async_nats::RequestError) -> String {
    let code = match e.kind() {
        async_nats::RequestErrorKind::TimedOut => "timeout",
        async_nats::RequestErrorKind::NoResponders => "no_responders",
        _ => "request_failed",
    };
    format!("{code}: {e}")
}

/// The code of an error written `code: message`.
fn code_of(error: &str) -> &str {
    error.split(':').next().unwrap_or(error).trim()
}

async fn request(
    client: &async_nats::Client,
    subject: &'static str,
    payload: Bytes,
) -> Result<async_nats::Message, async_nats::RequestError> {
    let request = async_nats::Request::new()
        .payload(payload)
        .timeout(Some(REQUEST_TIMEOUT));
    client.send_request(subject, request).await
}

// ---------------------------------------------------------------------------------------
// The closed loop

/// One client's writes; an error is `code: message`.
trait Writer: Send + 'static {
    fn write(&mut self) -> impl Future<Output = Result<(), String>> + Send;
}

/// What a closed-loop run saw, with every outcome's completion time from its start.
#[derive(Default)]
struct Run {
    duration: Duration,
    /// (completed at, latency) of every success.
    ok: Vec<(Duration, Duration)>,
    /// (completed at, `code: message`) of every error.
    errors: Vec<(Duration, String)>,
    /// The whole machine's busy CPU time from the run's start until its last write ended
    /// (every process: serve, nats-server, the load generator), when /proc/stat says.
    machine_cpu: Option<Duration>,
    /// The same span's CPU by part ([`Parts`]), when /proc says.
    parts: Option<Parts>,
}

impl Run {
    /// Successes completed within the run's duration, per second.
    fn rate(&self) -> f64 {
        self.done_in_time() as f64 / self.duration.as_secs_f64()
    }

    /// Successes completed within the run's duration.
    fn done_in_time(&self) -> usize {
        self.ok
            .iter()
            .filter(|(at, _)| *at <= self.duration)
            .count()
    }

    fn latencies(&self, from: Duration, to: Duration) -> Vec<Duration> {
        let mut l: Vec<Duration> = self
            .ok
            .iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|(_, l)| *l)
            .collect();
        l.sort();
        l
    }

    fn all_latencies(&self) -> Vec<Duration> {
        self.latencies(Duration::ZERO, Duration::MAX)
    }

    fn errors_by_code(&self) -> String {
        by_code(self.errors.iter().map(|(_, c)| c.as_str()))
    }

    /// The machine's CPU per success, in µs: every success is counted, also those that
    /// ended after the duration, because the CPU is measured until the last one ended.
    /// Steadier than a rate on a saturated machine, where the rate of two runs moves with
    /// whatever else the cores did, while the work per commit does not.
    fn cpu_per_success(&self) -> String {
        match (self.machine_cpu, self.ok.len()) {
            (Some(cpu), n) if n > 0 => format!("{:.0}", cpu.as_secs_f64() * 1e6 / n as f64),
            _ => "-".into(),
        }
    }
}

/// The machine's busy CPU time so far (user, nice, system, irq, softirq and steal of every
/// core, from /proc/stat), or `None` where there is no /proc/stat.
fn machine_busy() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    // Fields after "cpu": user nice system idle iowait irq softirq steal ...
    let ticks: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let busy: u64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| ticks.get(i))
        .sum();
    // USER_HZ is 100 on every Linux this runs on (the kernel's ABI for /proc/stat).
    Some(Duration::from_millis(busy * 10))
}

/// The parts of the system under test whose CPU the throughput table splits a commit's
/// cost into; [`Part::ALL`] is the table's order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    NatsServer,
    ServeRequests,
    Projector,
    Copier,
    Sled,
    Relay,
    LoadGenerator,
}

impl Part {
    const ALL: [Part; 7] = [
        Part::NatsServer,
        Part::ServeRequests,
        Part::Projector,
        Part::Copier,
        Part::Sled,
        Part::Relay,
        Part::LoadGenerator,
    ];

    fn label(self) -> &'static str {
        match self {
            Part::NatsServer => "nats-server",
            Part::ServeRequests => "serve: request threads",
            Part::Projector => "serve: projector",
            Part::Copier => "serve: copier",
            Part::Sled => "serve: sled's threads",
            Part::Relay => "relay",
            Part::LoadGenerator => "load generator",
        }
    }

    /// The part a thread of this process belongs to, by the name its runtime or spawner
    /// gave it (`None`: the echo service's, outside every row).
    fn of_thread(name: &str) -> Option<Part> {
        Some(match name {
            "serve" => Part::ServeRequests,
            "projector" => Part::Projector,
            "log-copy" => Part::Copier,
            // sled's own threads and provledger's (`provledger-sled-flush`, cut to 15
            // characters in /proc).
            n if n.contains("sled") => Part::Sled,
            "relay" => Part::Relay,
            "echo" => return None,
            _ => Part::LoadGenerator,
        })
    }
}

/// CPU time spent by part, indexed by [`Part`].
#[derive(Clone, Copy, Default)]
struct Parts([Duration; Part::ALL.len()]);

/// CPU time so far of each thread of this process (by its name's part) and of each process
/// it started (the nats-server), by thread or process id: threads come and go (sled's
/// I/O threads, tokio's blocking pool), so what a part spent over a span is taken thread
/// by thread, never from totals that drop when one ends.
#[derive(Clone, Default)]
struct CpuSnapshot(HashMap<u32, (Part, Duration)>);

/// The thread or process id a /proc entry names (`None`: not a number, such as `self`).
fn proc_id(entry: &std::fs::DirEntry) -> Option<u32> {
    entry.file_name().to_str()?.parse().ok()
}

impl CpuSnapshot {
    fn now() -> Option<CpuSnapshot> {
        let mut threads = HashMap::new();
        for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
            let Some(id) = proc_id(&task) else { continue };
            if let Some(stat) = TaskStat::read(&task.path()) {
                if let Some(part) = Part::of_thread(&stat.name) {
                    threads.insert(id, (part, stat.cpu));
                }
            }
        }
        let me = std::process::id();
        for process in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(id) = proc_id(&process) else {
                continue;
            };
            if let Some(stat) = TaskStat::read(&process.path()).filter(|s| s.parent == me) {
                threads.insert(id, (Part::NatsServer, stat.cpu));
            }
        }
        Some(CpuSnapshot(threads))
    }

    /// What each part spent between `before` and `self`: each thread or process alive at
    /// `self` over what it had at `before` (all of it if it started since). One that ended
    /// in between is not here: its time since `before` is left out (the throughput table
    /// shows it in "rest of the machine").
    fn since(&self, before: &CpuSnapshot) -> Parts {
        let mut spent = Parts::default();
        for (id, (part, cpu)) in &self.0 {
            let was = before
                .0
                .get(id)
                .filter(|(was_part, _)| was_part == part)
                .map_or(Duration::ZERO, |(_, was)| *was);
            spent.0[*part as usize] += cpu.saturating_sub(was);
        }
        spent
    }
}

impl Parts {
    fn add(&mut self, more: &Parts) {
        for (cpu, more) in self.0.iter_mut().zip(more.0) {
            *cpu += more;
        }
    }
}

/// What a thread's or process's `stat` file says that the CPU tables use.
struct TaskStat {
    name: String,
    parent: u32,
    /// User + system time.
    cpu: Duration,
}

impl TaskStat {
    fn read(dir: &std::path::Path) -> Option<TaskStat> {
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        // The name may hold ')' or spaces: the fields start after the last ')'.
        let (head, rest) = stat.rsplit_once(')')?;
        let name = head.split_once('(')?.1.to_string();
        // Fields after the name: state is the first, the parent's pid the 2nd, utime the
        // 12th, stime the 13th.
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let parent = fields.get(1)?.parse().ok()?;
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        // USER_HZ is 100 on every Linux this runs on, as for /proc/stat.
        Some(TaskStat {
            name,
            parent,
            cpu: Duration::from_millis(ticks * 10),
        })
    }
}

/// Counts errors (`code: message`) by code: `unavailable 3, timeout 1`, or `none`.
fn by_code<'a>(errors: impl Iterator<Item = &'a str>) -> String {
    let mut counts = BTreeMap::new();
    for e in errors {
        *counts.entry(code_of(e)).or_insert(0u64) += 1;
    }
    match counts.is_empty() {
        true => "none".into(),
        false => counts
            .iter()
            .map(|(c, n)| format!("{c} {n}"))
            .collect::<Vec<_>>()
            .join(", "),
    }
}

/// Every writer writes, one write at a time, until `duration` has passed.
async fn closed_loop<W: Writer>(writers: Vec<W>, duration: Duration) -> Run {
    closed_loop_keeping(writers, duration).await.0
}

/// [`closed_loop`], giving the writers back for another run.
async fn closed_loop_keeping<W: Writer>(writers: Vec<W>, duration: Duration) -> (Run, Vec<W>) {
    let busy_before = machine_busy();
    let parts_before = CpuSnapshot::now();
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = writers
        .into_iter()
        .map(|mut writer| {
            tokio::spawn(async move {
                let (mut ok, mut errors) = (Vec::new(), Vec::new());
                while Instant::now() < deadline {
                    let sent = Instant::now();
                    let result = writer.write().await;
                    let done = Instant::now();
                    match result {
                        Ok(()) => ok.push((done - start, done - sent)),
                        Err(error) => errors.push((done - start, error)),
                    }
                }
                (ok, errors, writer)
            })
        })
        .collect();
    let mut run = Run {
        duration,
        ..Default::default()
    };
    let mut writers = Vec::with_capacity(tasks.len());
    for task in tasks {
        let (ok, errors, writer) = task.await.expect("a bench client task");
        run.ok.extend(ok);
        run.errors.extend(errors);
        writers.push(writer);
    }
    run.machine_cpu = busy_before
        .zip(machine_busy())
        .map(|(before, after)| after.saturating_sub(before));
    run.parts = parts_before
        .zip(CpuSnapshot::now())
        .map(|(before, after)| after.since(&before));
    (run, writers)
}

/// A NATS request/reply client (cmd.append or the echo service), cycling over its payloads.
struct Requester {
    client: async_nats::Client,
    subject: &'static str,
    payloads: Vec<Bytes>,
    next: usize,
}

impl Writer for Requester {
    async fn write(&mut self) -> Result<(), String> {
        let payload = self.payloads[self.next % self.payloads.len()].clone();
        self.next += 1;
        match request(&self.client, self.subject, payload).await {
            Ok(reply) => reply_error(&reply).map_or(Ok(()), Err),
            Err(e) => Err(request_error(&e)),
        }
    }
}

/// One connection per [`CLIENTS_PER_CONNECTION`] clients, as `user`.
async fn connections(nats: &NatsServer, user: &str, clients: usize) -> Vec<async_nats::Client> {
    let mut out = Vec::new();
    for _ in 0..clients.div_ceil(CLIENTS_PER_CONNECTION) {
        out.push(nats.client_as(user).await);
    }
    out
}

/// Client `i` of `clients` writes the aggregates `i`, `i + clients`, ...: no two clients
/// share one, so nothing conflicts but the work itself.
fn share<T: Clone>(items: &[T], clients: usize, i: usize) -> Vec<T> {
    items
        .iter()
        .skip(i % items.len())
        .step_by(clients)
        .cloned()
        .collect()
}

async fn requesters(
    nats: &NatsServer,
    user: &str,
    clients: usize,
    subject: &'static str,
    payloads: &[Bytes],
) -> Vec<Requester> {
    let conns = connections(nats, user, clients).await;
    (0..clients)
        .map(|i| Requester {
            client: conns[i / CLIENTS_PER_CONNECTION].clone(),
            subject,
            payloads: share(payloads, clients, i),
            next: 0,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// provledger serve, in process

/// Runs `work` on a runtime of its own (2 threads) on a thread of its own, so that the
/// service under test and the load generator do not share a scheduler.
fn side_runtime<T: Send + 'static>(
    name: &str,
    work: impl Future<Output = T> + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let thread_name = name.to_string();
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name(thread_name)
                .enable_all()
                .build()
                .expect("building a side runtime")
                .block_on(work)
        })
        .expect("spawning a side runtime's thread")
}

/// A micro service `name` on `client` with one endpoint on `subject` (the service is
/// returned to be held: dropping it stops the endpoint).
async fn micro_endpoint(
    client: &async_nats::Client,
    name: &str,
    subject: &'static str,
) -> (
    async_nats::service::Service,
    async_nats::service::endpoint::Endpoint,
) {
    let service = async_nats::service::ServiceExt::service_builder(client)
        .start(name, "1.0.0")
        .await
        .expect("starting a micro service");
    let endpoint = service
        .endpoint(subject)
        .await
        .expect("a micro service's endpoint");
    (service, endpoint)
}

/// Waits (at most 10 s) until a service answers on `subject`: its subscription reached the
/// server, so requests no longer fail with no responders.
async fn until_answers(client: &async_nats::Client, subject: &'static str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while request(client, subject, Bytes::new()).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "nothing answered on {subject} within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `provledger serve` with the CLI's defaults in a temp data dir.
struct Serve {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
    _dir: tempfile::TempDir,
}

impl Serve {
    fn start(nats_url: String, log_copy: bool) -> Serve {
        let dir = tempfile::tempdir().expect("serve's data dir");
        let options = ServeOptions {
            log_copy,
            ..ServeOptions::new(nats_url, dir.path().join("serve"))
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = side_runtime("serve", async move {
            provledger_serve::run(options, async {
                let _ = stopped.await;
            })
            .await
            .map_err(|e| e.to_string())
        });
        Serve {
            stop: Some(stop),
            thread: Some(thread),
            _dir: dir,
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let result = tokio::task::spawn_blocking(move || thread.join())
                .await
                .expect("joining serve's thread");
            match result {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("serve stopped with an error: {e}"),
                Err(_) => eprintln!("serve panicked"),
            }
        }
    }
}

/// Waits until serve answers `q.health` ready with no lag: it has folded every commit.
async fn wait_caught_up(client: &async_nats::Client) {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let answer = request(client, HEALTH_SUBJECT, Bytes::from_static(b"{}")).await;
        if let Ok(reply) = answer {
            let body: Value = serde_json::from_slice(&reply.payload).unwrap_or(Value::Null);
            if body["data"]["ready"] == json!(true) && body["data"]["lag"] == json!(0) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "serve did not catch up with the stream within 15 minutes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until serve has folded every commit of `run`, counting the machine's CPU meanwhile
/// in the run's: the projector's tail is the commits' work too (a projector that fell
/// behind during the run would otherwise make the row look cheaper than it was).
async fn with_projector_tail(client: &async_nats::Client, run: &mut Run) {
    let started = Instant::now();
    counting_into(run, wait_caught_up(client)).await;
    eprintln!(
        "  serve's projector caught up {} ms after the row",
        started.elapsed().as_millis()
    );
}

/// [`closed_loop`] on writers whose commits serve folds, then [`with_projector_tail`].
async fn closed_loop_through_the_tail<W: Writer>(
    client: &async_nats::Client,
    writers: Vec<W>,
    duration: Duration,
) -> Run {
    let mut run = closed_loop(writers, duration).await;
    with_projector_tail(client, &mut run).await;
    run
}

/// Runs `work`, adding the machine's and each part's CPU meanwhile to `run`'s.
async fn counting_into(run: &mut Run, work: impl Future<Output = ()>) {
    let busy = machine_busy();
    let parts = CpuSnapshot::now();
    work.await;
    if let (Some(cpu), Some(before), Some(after)) = (&mut run.machine_cpu, busy, machine_busy()) {
        *cpu += after.saturating_sub(before);
    }
    if let (Some(sum), Some(before), Some(after)) = (&mut run.parts, parts, CpuSnapshot::now()) {
        sum.add(&after.since(&before));
    }
}

/// Registers `count` fresh providers through cmd.append (one `provider_registered` +
/// `inventory_set` commit each, 64 at a time); returns their ids and a reply's size.
async fn register(client: &async_nats::Client, count: usize) -> (Vec<Uuid>, usize) {
    let ids: Vec<Uuid> = (0..count).map(|_| Uuid::now_v7()).collect();
    let replies: Vec<_> = futures::stream::iter(ids.iter().enumerate().map(|(n, id)| {
        let payload = append_request(*id, json!("none"), registration(n));
        async move { request(client, APPEND_SUBJECT, payload).await }
    }))
    .buffer_unordered(64)
    .collect()
    .await;
    let mut reply_bytes = 0;
    for reply in replies {
        let reply = reply.expect("registering a provider through cmd.append");
        if let Some(error) = reply_error(&reply) {
            panic!("registering a provider through cmd.append: {error}");
        }
        reply_bytes = reply.payload.len();
    }
    (ids, reply_bytes)
}

// ---------------------------------------------------------------------------------------
// Raw JetStream

struct RawWriter {
    js: jetstream::Context,
    stream: jetstream::stream::Stream,
    subjects: Vec<String>,
    payload: Bytes,
    next: usize,
}

fn publish_error(e: async_nats::jetstream::context::PublishError) -> String {
    let code = match e.kind() {
        PublishErrorKind::WrongLastSequence => "wrong_last_sequence",
        PublishErrorKind::TimedOut => "ack_timeout",
        _ => "publish_failed",
    };
    format!("{code}: {e}")
}

/// The sequence of `subject`'s last message, by direct get (0 when it has none).
async fn last_sequence(stream: &jetstream::stream::Stream, subject: &str) -> Result<u64, String> {
    match stream.direct_get_last_for_subject(subject).await {
        Ok(message) => Ok(message.sequence),
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(0),
        Err(e) => Err(format!("direct_get_failed: {e}")),
    }
}

/// The subject of a reference stream's aggregate `token` under `prefix`.
fn reference_subject(prefix: &str, token: &str) -> String {
    format!("{prefix}.ev.provider.{token}")
}

impl Writer for RawWriter {
    async fn write(&mut self) -> Result<(), String> {
        let subject = self.subjects[self.next % self.subjects.len()].clone();
        self.next += 1;
        let last = last_sequence(&self.stream, &subject).await?;
        let ack = publish_expecting(&self.js, subject, self.payload.clone(), last)
            .await
            .map_err(publish_error)?;
        ack.await.map(|_| ()).map_err(publish_error)
    }
}

/// A stream named `name` over `<prefix>.>` (as PROVLEDGER: file storage, direct gets), and
/// 1,000 fresh subjects `<prefix>.ev.provider.<token>` holding one message each, as the
/// registered providers hold one commit: the tokens.
async fn seeded_stream(
    nats: &NatsServer,
    name: &str,
    prefix: &str,
    payload: &Bytes,
) -> Vec<String> {
    let js = jetstream::new(nats.client().await);
    js.get_or_create_stream(jetstream::stream::Config {
        name: name.into(),
        subjects: vec![format!("{prefix}.>")],
        storage: jetstream::stream::StorageType::File,
        allow_direct: true,
        deny_delete: true,
        deny_purge: true,
        ..Default::default()
    })
    .await
    .expect("creating a reference stream");
    let tokens: Vec<String> = (0..AGGREGATES)
        .map(|_| Uuid::now_v7().to_string())
        .collect();
    let mut acks = Vec::new();
    for token in &tokens {
        acks.push(
            js.publish(reference_subject(prefix, token), payload.clone())
                .await
                .expect("publishing a reference subject's first message"),
        );
    }
    for ack in acks {
        ack.await
            .expect("the ack of a reference subject's first message");
    }
    tokens
}

/// The raw stream and `clients` writers over its 1,000 subjects.
async fn raw_writers(nats: &NatsServer, clients: usize, payload: &Bytes) -> Vec<RawWriter> {
    let subjects: Vec<String> = seeded_stream(nats, RAW_STREAM, RAW_PREFIX, payload)
        .await
        .into_iter()
        .map(|token| reference_subject(RAW_PREFIX, &token))
        .collect();
    let mut writers = Vec::new();
    for (i, conn) in connections(nats, "bench", clients)
        .await
        .into_iter()
        .enumerate()
    {
        let js = jetstream::new(conn);
        let stream = js
            .get_stream(RAW_STREAM)
            .await
            .expect("the raw stream's handle");
        let first = i * CLIENTS_PER_CONNECTION;
        for c in first..clients.min(first + CLIENTS_PER_CONNECTION) {
            writers.push(RawWriter {
                js: js.clone(),
                stream: stream.clone(),
                subjects: share(&subjects, clients, c),
                payload: payload.clone(),
                next: 0,
            });
        }
    }
    writers
}

// ---------------------------------------------------------------------------------------
// The least a service of serve's shape does: a relay

/// A micro service that does, per request, only what the NATS path of a `cmd.append`
/// must: take the request, publish its payload to JetStream on the subject it names
/// (expecting the subject's last sequence, kept from its own last publish, with a message
/// id), wait for the ack and reply. No decision, no hash chain, no projection, no feed,
/// no copy: what is left of provledger's cost once those are gone is the architecture's
/// (a service between the client and the stream), which this row measures.
struct Relay {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// A relay request: the subject's token (36 bytes, a UUID) and then the bytes to store.
fn relay_request(token: &str, payload: &Bytes) -> Bytes {
    let mut request = Vec::with_capacity(token.len() + payload.len());
    request.extend_from_slice(token.as_bytes());
    request.extend_from_slice(payload);
    Bytes::from(request)
}

impl Relay {
    /// Starts the relay on its own runtime (as serve runs) and waits until it answers.
    async fn start(nats: &NatsServer, reply_bytes: usize) -> Relay {
        let url = nats.url();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = side_runtime("relay", async move {
            let client = async_nats::connect(url)
                .await
                .expect("the relay's connection");
            let js = jetstream::new(client.clone());
            let stream = js
                .get_stream(RELAY_STREAM)
                .await
                .expect("the relay stream's handle");
            let (_service, mut endpoint) = micro_endpoint(&client, "wb-relay", RELAY_SUBJECT).await;
            // Each subject's last sequence, as serve keeps each aggregate's head.
            let heads = std::sync::Arc::new(std::sync::Mutex::new(std::collections::HashMap::<
                String,
                u64,
            >::new()));
            let reply = Bytes::from(vec![b'x'; reply_bytes]);
            tokio::pin!(stopped);
            loop {
                let request = tokio::select! {
                    next = endpoint.next() => match next {
                        Some(request) => request,
                        None => break,
                    },
                    _ = &mut stopped => break,
                };
                let (js, stream, heads, reply) =
                    (js.clone(), stream.clone(), heads.clone(), reply.clone());
                tokio::spawn(async move {
                    let answer = relay_one(&js, &stream, &heads, &request.message.payload).await;
                    let _ = request
                        .respond(answer.map(|()| reply).map_err(|e| {
                            async_nats::service::error::Error {
                                status: e,
                                code: 500,
                            }
                        }))
                        .await;
                });
            }
        });
        // A request without a token is refused by the relay itself, once it listens.
        until_answers(&nats.client().await, RELAY_SUBJECT).await;
        Relay {
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            tokio::task::spawn_blocking(move || thread.join())
                .await
                .expect("joining the relay")
                .expect("the relay panicked");
        }
    }
}

/// One relayed write: the head kept (or read by direct get once), the publish expecting
/// it, the ack; a refused expectation reads the head again and tries once more.
async fn relay_one(
    js: &jetstream::Context,
    stream: &jetstream::stream::Stream,
    heads: &std::sync::Mutex<std::collections::HashMap<String, u64>>,
    request: &Bytes,
) -> Result<(), String> {
    let token = request
        .get(..36)
        .and_then(|t| std::str::from_utf8(t).ok())
        .ok_or_else(|| "bad_request: no subject token".to_string())?;
    let subject = reference_subject(RELAY_PREFIX, token);
    let payload = request.slice(36..);
    for _ in 0..2 {
        let kept = heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&subject)
            .copied();
        let last = match kept {
            Some(last) => last,
            None => last_sequence(stream, &subject).await?,
        };
        let ack = publish_expecting(js, subject.clone(), payload.clone(), last)
            .await
            .map_err(publish_error)?;
        match ack.await {
            Ok(ack) => {
                heads
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(subject, ack.sequence);
                return Ok(());
            }
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                heads
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&subject);
            }
            Err(e) => return Err(publish_error(e)),
        }
    }
    Err("wrong_last_sequence: twice".into())
}

/// The relay's stream over 1,000 subjects, and `clients` requesters, each with its own
/// share of them.
async fn relay_requesters(nats: &NatsServer, clients: usize, payload: &Bytes) -> Vec<Requester> {
    let tokens = seeded_stream(nats, RELAY_STREAM, RELAY_PREFIX, payload).await;
    let requests: Vec<Bytes> = tokens.iter().map(|t| relay_request(t, payload)).collect();
    requesters(nats, "bench", clients, RELAY_SUBJECT, &requests).await
}

// ---------------------------------------------------------------------------------------
// PostgreSQL

struct Postgres {
    version: String,
    max_connections: usize,
    synchronous_commit: String,
}

async fn pg_connect() -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(PG_CONFIG, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("PostgreSQL connection: {e}");
        }
    });
    Ok(client)
}

fn pg_error(e: tokio_postgres::Error) -> String {
    use tokio_postgres::error::SqlState;
    let code = match e.code() {
        Some(c) if *c == SqlState::UNIQUE_VIOLATION => "unique_violation".into(),
        Some(c) if *c == SqlState::T_R_DEADLOCK_DETECTED => "deadlock".into(),
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE => "serialization_failure".into(),
        Some(c) => format!("sqlstate_{}", c.code()),
        None => "pg_connection".into(),
    };
    format!("{code}: {e}")
}

const PG_SCHEMA: &str = "
    DROP TABLE IF EXISTS wb_events, wb_streams;
    CREATE TABLE wb_events (
        stream_id uuid NOT NULL,
        version bigint NOT NULL,
        payload bytea NOT NULL,
        UNIQUE (stream_id, version)
    );
    CREATE TABLE wb_streams (id uuid PRIMARY KEY, version bigint NOT NULL);
";
const PG_APPEND: &str = "INSERT INTO wb_events (stream_id, version, payload) \
     SELECT $1::uuid, coalesce(max(version), 0) + 1, $2::bytea FROM wb_events WHERE stream_id = $1::uuid";
const PG_LOCK: &str = "SELECT version FROM wb_streams WHERE id = $1 FOR UPDATE";
const PG_INSERT: &str = "INSERT INTO wb_events (stream_id, version, payload) VALUES ($1, $2, $3)";
const PG_UPDATE: &str = "UPDATE wb_streams SET version = $2 WHERE id = $1";

impl Postgres {
    /// Connects, reads the settings that matter and creates the bench's tables; `None`
    /// (and says so) when the server cannot be reached.
    async fn open() -> Option<Postgres> {
        let client = match pg_connect().await {
            Ok(c) => c,
            Err(e) => {
                println!("PostgreSQL unreachable: skipped ({e})");
                return None;
            }
        };
        let show = |name: &'static str| {
            let client = &client;
            async move {
                client
                    .query_one(&format!("SHOW {name}"), &[])
                    .await
                    .map(|row| row.get::<_, String>(0))
                    .unwrap_or_else(|e| format!("? ({e})"))
            }
        };
        let pg = Postgres {
            version: show("server_version").await,
            max_connections: show("max_connections").await.parse().unwrap_or(100),
            synchronous_commit: show("synchronous_commit").await,
        };
        client
            .batch_execute(PG_SCHEMA)
            .await
            .expect("creating the PostgreSQL bench tables");
        Some(pg)
    }

    /// How many connections a row of `clients` uses: all of them, or [`PG_CONNECTIONS_CAP`]
    /// when they would exceed `max_connections`.
    fn connections_for(&self, clients: usize) -> usize {
        match clients > self.max_connections {
            true => PG_CONNECTIONS_CAP,
            false => clients,
        }
    }

    async fn drop_tables(&self) {
        if let Ok(client) = pg_connect().await {
            let _ = client
                .batch_execute("DROP TABLE IF EXISTS wb_events, wb_streams")
                .await;
        }
    }
}

/// One write = `INSERT ... SELECT coalesce(max(version), 0) + 1`, autocommit (its own
/// transaction), on a connection of its own.
struct PgAppend {
    client: tokio_postgres::Client,
    statement: tokio_postgres::Statement,
    ids: Vec<Uuid>,
    payload: Vec<u8>,
    next: usize,
}

impl Writer for PgAppend {
    async fn write(&mut self) -> Result<(), String> {
        let id = self.ids[self.next % self.ids.len()];
        self.next += 1;
        self.client
            .execute(&self.statement, &[&id, &self.payload])
            .await
            .map(|_| ())
            .map_err(pg_error)
    }
}

/// `connections` writers over 1,000 fresh streams holding one event each.
async fn pg_append_writers(connections: usize, payload_bytes: usize) -> Vec<PgAppend> {
    let ids: Vec<Uuid> = (0..AGGREGATES).map(|_| Uuid::now_v7()).collect();
    let payload = vec![7u8; payload_bytes];
    let setup = pg_connect().await.expect("a PostgreSQL connection");
    setup
        .execute(
            "INSERT INTO wb_events (stream_id, version, payload) \
             SELECT id, 1, $2 FROM unnest($1::uuid[]) AS id",
            &[&ids, &payload],
        )
        .await
        .expect("the PostgreSQL streams' first events");
    let mut writers = Vec::new();
    for c in 0..connections {
        let client = pg_connect().await.expect("a PostgreSQL connection");
        let statement = client
            .prepare(PG_APPEND)
            .await
            .expect("preparing the append");
        writers.push(PgAppend {
            client,
            statement,
            ids: share(&ids, connections, c),
            payload: payload.clone(),
            next: 0,
        });
    }
    writers
}

/// One write = `BEGIN; SELECT ... FOR UPDATE; INSERT version + 1; UPDATE; COMMIT`.
struct PgLocked {
    client: tokio_postgres::Client,
    lock: tokio_postgres::Statement,
    insert: tokio_postgres::Statement,
    update: tokio_postgres::Statement,
    id: Uuid,
    payload: Vec<u8>,
}

impl Writer for PgLocked {
    async fn write(&mut self) -> Result<(), String> {
        let tx = self.client.transaction().await.map_err(pg_error)?;
        let row = tx
            .query_one(&self.lock, &[&self.id])
            .await
            .map_err(pg_error)?;
        let version = row.get::<_, i64>(0) + 1;
        tx.execute(&self.insert, &[&self.id, &version, &self.payload])
            .await
            .map_err(pg_error)?;
        tx.execute(&self.update, &[&self.id, &version])
            .await
            .map_err(pg_error)?;
        tx.commit().await.map_err(pg_error)
    }
}

async fn pg_locked_writers(connections: usize, payload_bytes: usize) -> Vec<PgLocked> {
    let id = Uuid::now_v7();
    let setup = pg_connect().await.expect("a PostgreSQL connection");
    setup
        .execute(
            "INSERT INTO wb_streams (id, version) VALUES ($1, 0)",
            &[&id],
        )
        .await
        .expect("the hot PostgreSQL stream");
    let mut writers = Vec::new();
    for _ in 0..connections {
        let client = pg_connect().await.expect("a PostgreSQL connection");
        let lock = client.prepare(PG_LOCK).await.expect("preparing the lock");
        let insert = client
            .prepare(PG_INSERT)
            .await
            .expect("preparing the insert");
        let update = client
            .prepare(PG_UPDATE)
            .await
            .expect("preparing the update");
        writers.push(PgLocked {
            client,
            lock,
            insert,
            update,
            id,
            payload: vec![7u8; payload_bytes],
        });
    }
    writers
}

// ---------------------------------------------------------------------------------------
// nats-server's own figures

/// `GET path` on the monitoring endpoint, as JSON.
async fn monitor_get(addr: &str, path: &str) -> Result<Value, String> {
    let mut socket = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    socket
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .map_err(|e| format!("sending GET {path}: {e}"))?;
    let mut response = Vec::new();
    socket
        .read_to_end(&mut response)
        .await
        .map_err(|e| format!("reading GET {path}: {e}"))?;
    let body = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| &response[at + 4..])
        .ok_or_else(|| format!("GET {path}: no HTTP body"))?;
    serde_json::from_slice(body).map_err(|e| format!("GET {path}: {e}"))
}

/// What nats-server has moved so far, from its `/varz`: messages and bytes, in and out.
#[derive(Clone, Copy)]
struct Traffic {
    in_msgs: u64,
    out_msgs: u64,
    in_bytes: u64,
    out_bytes: u64,
}

impl Traffic {
    async fn read(addr: &str) -> Option<Traffic> {
        let varz = monitor_get(addr, "/varz").await.ok()?;
        let count = |field: &str| varz[field].as_u64();
        Some(Traffic {
            in_msgs: count("in_msgs")?,
            out_msgs: count("out_msgs")?,
            in_bytes: count("in_bytes")?,
            out_bytes: count("out_bytes")?,
        })
    }

    /// Runs a row (`run`), giving what nats-server moved meanwhile per commit of it.
    async fn around(addr: &str, run: impl Future<Output = Run>) -> (Run, String) {
        let before = Traffic::read(addr).await;
        let run = run.await;
        let moved = Traffic::per_commit(before, Traffic::read(addr).await, run.ok.len());
        (run, moved)
    }

    /// Per commit between `before` and `after`: messages in, out, bytes in, out.
    fn per_commit(before: Option<Traffic>, after: Option<Traffic>, commits: usize) -> String {
        match (before, after) {
            (Some(b), Some(a)) if commits > 0 => {
                let each = |later: u64, earlier: u64| {
                    later.saturating_sub(earlier) as f64 / commits as f64
                };
                format!(
                    "{:.2} | {:.2} | {:.0} | {:.0}",
                    each(a.in_msgs, b.in_msgs),
                    each(a.out_msgs, b.out_msgs),
                    each(a.in_bytes, b.in_bytes),
                    each(a.out_bytes, b.out_bytes),
                )
            }
            _ => "- | - | - | -".into(),
        }
    }
}

/// Consumers on the PROVLEDGER stream, the server's memory and the CPU by part, at one
/// moment.
#[derive(Clone, Default)]
struct Figures {
    consumers: Option<u64>,
    mem_bytes: Option<u64>,
    /// CPU time so far by thread (`None` without /proc), read at the same bound.
    parts: Option<CpuSnapshot>,
}

async fn figures(addr: &str) -> Figures {
    // First: the CPU at the bound itself, before the monitoring requests below take theirs.
    let parts = CpuSnapshot::now();
    let consumers = monitor_get(addr, "/jsz?accounts=true&streams=true")
        .await
        .ok()
        .and_then(|jsz| {
            jsz["account_details"]
                .as_array()?
                .iter()
                .flat_map(|a| a["stream_detail"].as_array().into_iter().flatten())
                .find(|s| s["name"] == json!(STREAM))
                .and_then(|s| s["state"]["consumer_count"].as_u64())
        });
    let mem_bytes = monitor_get(addr, "/varz")
        .await
        .ok()
        .and_then(|v| v["mem"].as_u64());
    Figures {
        consumers,
        mem_bytes,
        parts,
    }
}

fn show_consumers(f: &Figures) -> String {
    f.consumers.map_or("?".into(), |c| c.to_string())
}

fn show_mem(f: &Figures) -> String {
    f.mem_bytes
        .map_or("?".into(), |b| format!("{:.0} MiB", b as f64 / 1048576.0))
}

/// What one window of a sustained run cost per request answered in it, in µs of CPU, by
/// part (serve: all of its threads).
#[derive(Clone, Copy)]
struct WindowCost {
    serve: f64,
    /// Of `serve`: its projector, copier and sled threads (following the stream).
    serve_following: f64,
    nats_server: f64,
    load_generator: f64,
}

impl WindowCost {
    /// `None` without /proc or without a request answered in the window.
    fn between(start: &Figures, end: &Figures, requests: usize) -> Option<WindowCost> {
        let spent = end.parts.as_ref()?.since(start.parts.as_ref()?);
        if requests == 0 {
            return None;
        }
        let per_request = |parts: &[Part]| {
            let cpu: Duration = parts.iter().map(|&p| spent.0[p as usize]).sum();
            cpu.as_secs_f64() * 1e6 / requests as f64
        };
        Some(WindowCost {
            serve: per_request(&[
                Part::ServeRequests,
                Part::Projector,
                Part::Copier,
                Part::Sled,
            ]),
            serve_following: per_request(&[Part::Projector, Part::Copier, Part::Sled]),
            nats_server: per_request(&[Part::NatsServer]),
            load_generator: per_request(&[Part::LoadGenerator]),
        })
    }

    fn show(cost: Option<WindowCost>) -> String {
        cost.map_or("-".into(), |c| {
            format!(
                "{:.1} ({:.1}) / {:.1} / {:.1}",
                c.serve, c.serve_following, c.nats_server, c.load_generator
            )
        })
    }
}

/// The boundaries of the sustained run's windows: 0, 5 s, 10 s, ..., `total`.
fn boundaries(total: Duration) -> Vec<Duration> {
    let windows = total.as_millis().div_ceil(WINDOW.as_millis()) as u32;
    (0..=windows).map(|k| (WINDOW * k).min(total)).collect()
}

/// Reads the figures at each window boundary of a run starting now.
async fn watch_server(addr: String, total: Duration) -> Vec<Figures> {
    let start = tokio::time::Instant::now();
    let mut out = Vec::new();
    for at in boundaries(total) {
        tokio::time::sleep_until(start + at).await;
        out.push(figures(&addr).await);
    }
    out
}

// ---------------------------------------------------------------------------------------
// Phases

fn row(clients: usize, system: &str, run: &Run, ratio: &str) {
    let l = run.all_latencies();
    println!(
        "| {clients} | {system} | {:.0} | {} | {} | {} | {ratio} | {} |",
        run.rate(),
        quantile(&l, 0.50),
        quantile(&l, 0.99),
        run.errors_by_code(),
        run.cpu_per_success(),
    );
}

/// Prints the first error of each code seen, so that a table's codes say what happened.
fn print_examples<'a>(errors: impl Iterator<Item = &'a str>) {
    const SHOWN_CHARS_MAX: usize = 300;
    let mut first = BTreeMap::new();
    for e in errors {
        first.entry(code_of(e)).or_insert(e);
    }
    for (code, e) in first {
        let shown: String = e.chars().take(SHOWN_CHARS_MAX).collect();
        let cut = if shown.len() < e.len() { " ..." } else { "" };
        println!("- first `{code}` error: {shown}{cut}");
    }
}

fn run_errors<'a>(runs: impl Iterator<Item = &'a Run>) -> impl Iterator<Item = &'a str> {
    runs.flat_map(|r| r.errors.iter().map(|(_, e)| e.as_str()))
}

/// The `p` quantile of sorted latencies, or `-` when there are none.
fn quantile(sorted: &[Duration], p: f64) -> String {
    match sorted.is_empty() {
        true => "-".into(),
        false => format!("{:.2?}", percentile(sorted, p)),
    }
}

fn ratio(a: f64, b: f64) -> String {
    match b > 0.0 {
        true => format!("{:.2}x", a / b),
        false => "-".into(),
    }
}

/// `cmd.append` against raw JetStream (direct get + publish), the throughput table's first
/// two rows, in slices of `o.duration` that alternate: a machine whose speed drifts between
/// one row and the next moves both sides of each round alike. Rounds go A-B, B-A, ... so
/// that neither side always follows the other.
async fn alternating(nats: &NatsServer, o: &Options, payload_bytes: usize) {
    let client = nats.client().await;
    let payload = Bytes::from(vec![7u8; payload_bytes]);
    println!();
    println!(
        "## 1b. Single commits, `cmd.append` ÷ raw JetStream, alternating: {ALTERNATING_ROUNDS} slices of {} s of each",
        o.duration.as_secs()
    );
    println!();
    println!("| clients | round | cmd.append commits/s | raw commits/s | cmd.append ÷ raw | machine CPU per commit, µs: cmd.append / raw | errors |");
    println!("|---:|---:|---:|---:|---:|---:|---|");
    let mut summaries = Vec::new();
    for &clients in &o.clients {
        let (ids, _) = register(&client, AGGREGATES).await;
        wait_caught_up(&client).await;
        let payloads: Vec<Bytes> = ids.iter().map(|id| bench_write(*id)).collect();
        let mut ledger_writers =
            requesters(nats, "bench", clients, APPEND_SUBJECT, &payloads).await;
        let mut raw_writers = raw_writers(nats, clients, &payload).await;
        let mut ratios = Vec::new();
        let (mut ledger_commits, mut raw_commits) = (0, 0);
        for round in 0..ALTERNATING_ROUNDS {
            eprintln!(
                "alternating: {clients} clients, round {} of {ALTERNATING_ROUNDS} ...",
                round + 1
            );
            let mut ledger = Run::default();
            let mut raw = Run::default();
            for side in [round % 2, 1 - round % 2] {
                if side == 0 {
                    let (mut run, writers) = closed_loop_keeping(ledger_writers, o.duration).await;
                    with_projector_tail(&client, &mut run).await;
                    // serve's copier writes behind its projector: its last writes would
                    // otherwise fall in raw's slice, on raw's cores.
                    counting_into(&mut run, tokio::time::sleep(COPIER_SETTLE)).await;
                    (ledger, ledger_writers) = (run, writers);
                } else {
                    (raw, raw_writers) = closed_loop_keeping(raw_writers, o.duration).await;
                }
            }
            // A slice in which raw completed nothing has no ratio (it is shown, not counted).
            let ratio_of_round = (raw.rate() > 0.0).then(|| ledger.rate() / raw.rate());
            ratios.extend(ratio_of_round);
            ledger_commits += ledger.done_in_time();
            raw_commits += raw.done_in_time();
            println!(
                "| {clients} | {} | {:.0} | {:.0} | {} | {} / {} | {} / {} |",
                round + 1,
                ledger.rate(),
                raw.rate(),
                ratio_of_round.map_or("-".into(), |r| format!("{r:.2}x")),
                ledger.cpu_per_success(),
                raw.cpu_per_success(),
                ledger.errors_by_code(),
                raw.errors_by_code(),
            );
        }
        ratios.sort_by(f64::total_cmp);
        summaries.push((clients, ratios, ledger_commits, raw_commits));
    }
    println!();
    println!("| clients | median of the rounds' ratios | lowest - highest | rounds at 0.5x or more | all cmd.append commits ÷ all raw commits |");
    println!("|---:|---:|---:|---:|---:|");
    for (clients, ratios, ledger_commits, raw_commits) in &summaries {
        let median = match ratios.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => ratios[n / 2],
            n => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
        };
        println!(
            "| {clients} | **{median:.2}x** | {:.2} - {:.2}x | {} of {} | {} |",
            ratios.first().copied().unwrap_or(f64::NAN),
            ratios.last().copied().unwrap_or(f64::NAN),
            ratios.iter().filter(|r| **r >= 0.5).count(),
            ratios.len(),
            ratio(*ledger_commits as f64, *raw_commits as f64),
        );
    }
    println!();
    println!(
        "- Each round is one slice of each system with the same writers as the throughput table's first two rows (one request at a time per client, 1,000 providers; raw: direct get last + publish expecting it, with a message id). cmd.append's slice is followed by serve's projector's catch-up and {} ms for its copier to finish, outside both slices (their CPU counted in cmd.append's). Odd rounds run cmd.append first, even rounds raw first. A round whose raw slice completed nothing has no ratio and is left out of the summary.",
        COPIER_SETTLE.as_millis()
    );
}

async fn throughput(nats: &NatsServer, o: &Options, pg: Option<&Postgres>, payload_bytes: usize) {
    let client = nats.client().await;
    let payload = Bytes::from(vec![7u8; payload_bytes]);

    eprintln!("throughput: load generator ceiling (echo micro service) ...");
    let (_, reply_bytes) = register(&client, 1).await;
    let (stop_echo, echo_stopped) = oneshot::channel::<()>();
    let echo_url = nats.url();
    let echo = side_runtime("echo", async move {
        let client = async_nats::connect(echo_url)
            .await
            .expect("the echo service's connection");
        let (_service, mut endpoint) = micro_endpoint(&client, "wb-echo", ECHO_SUBJECT).await;
        let reply = Bytes::from(vec![b'x'; reply_bytes]);
        tokio::pin!(echo_stopped);
        loop {
            tokio::select! {
                next = endpoint.next() => match next {
                    Some(request) => { let _ = request.respond(Ok(reply.clone())).await; }
                    None => break,
                },
                _ = &mut echo_stopped => break,
            }
        }
    });
    until_answers(&client, ECHO_SUBJECT).await;
    let echo_clients = *CLIENT_COUNTS.last().unwrap_or(&256);
    let echo_payloads = vec![bench_write(Uuid::now_v7())];
    let writers = requesters(nats, "bench", echo_clients, ECHO_SUBJECT, &echo_payloads).await;
    let echo_run = closed_loop(writers, o.duration).await;
    let _ = stop_echo.send(());
    tokio::task::spawn_blocking(move || echo.join())
        .await
        .expect("joining the echo service")
        .expect("the echo service panicked");

    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let monitor = nats.monitor_addr();
    let mut traffic = Vec::new();
    for &clients in &o.clients {
        eprintln!("throughput: {clients} clients: provledger cmd.append ...");
        let (ids, _) = register(&client, AGGREGATES).await;
        wait_caught_up(&client).await;
        let payloads: Vec<Bytes> = ids.iter().map(|id| bench_write(*id)).collect();
        let writers = requesters(nats, "bench", clients, APPEND_SUBJECT, &payloads).await;
        let (ledger, ledger_traffic) = Traffic::around(
            &monitor,
            closed_loop_through_the_tail(&client, writers, o.duration),
        )
        .await;

        eprintln!("throughput: {clients} clients: raw JetStream ...");
        let raw_writers = raw_writers(nats, clients, &payload).await;
        let (raw, raw_traffic) =
            Traffic::around(&monitor, closed_loop(raw_writers, o.duration)).await;

        eprintln!("throughput: {clients} clients: a relay service ...");
        let relay_writers = relay_requesters(nats, clients, &payload).await;
        let relay_service = Relay::start(nats, reply_bytes).await;
        let (relay, relay_traffic) =
            Traffic::around(&monitor, closed_loop(relay_writers, o.duration)).await;
        relay_service.stop().await;

        eprintln!("throughput: {clients} clients: the client library's record ...");
        let library_writers = library_writers(nats, clients, false).await;
        let (library, library_traffic) = Traffic::around(
            &monitor,
            closed_loop_through_the_tail(&client, library_writers, o.duration),
        )
        .await;
        traffic.push((
            clients,
            [ledger_traffic, raw_traffic, relay_traffic, library_traffic],
        ));

        let pg_run = match pg {
            Some(pg) => {
                let conns = pg.connections_for(clients);
                if conns < clients {
                    notes.push(format!(
                        "PostgreSQL with {clients} clients: {clients} connections exceed max_connections = {}, so that row uses {conns} connections (one client each)",
                        pg.max_connections
                    ));
                }
                eprintln!("throughput: {clients} clients: PostgreSQL ({conns} connections) ...");
                let run =
                    closed_loop(pg_append_writers(conns, payload_bytes).await, o.duration).await;
                Some((conns, run))
            }
            None => None,
        };
        rows.push((clients, ledger, raw, relay, library, pg_run));
    }

    println!();
    println!(
        "## 1. Throughput: cmd.append vs raw JetStream and PostgreSQL ({} s per row, 1,000 providers, expect any)",
        o.duration.as_secs()
    );
    println!();
    println!("| clients | system | commits/s | p50 | p99 | errors by code | provledger ÷ this | machine CPU per commit (µs) |");
    println!("|---:|---|---:|---:|---:|---|---:|---:|");
    for (clients, ledger, raw, relay, library, pg_run) in &rows {
        row(*clients, "provledger cmd.append", ledger, "1.00x");
        row(
            *clients,
            "raw JetStream: direct get last + publish (expected seq, msg id)",
            raw,
            &ratio(ledger.rate(), raw.rate()),
        );
        row(
            *clients,
            "relay service: request, publish (expected seq, msg id), ack, reply",
            relay,
            &ratio(ledger.rate(), relay.rate()),
        );
        row(
            *clients,
            "client library: `Writer::record` (one JetStreamLog for all clients' tasks)",
            library,
            &ratio(ledger.rate(), library.rate()),
        );
        match pg_run {
            Some((conns, run)) => row(
                *conns,
                "PostgreSQL: INSERT ... SELECT max(version)+1 (autocommit)",
                run,
                &ratio(ledger.rate(), run.rate()),
            ),
            None => println!("| {clients} | PostgreSQL | skipped (unreachable) | | | | | |"),
        }
    }
    row(
        echo_clients,
        &format!("load generator ceiling: echo micro service ({reply_bytes}-byte reply)"),
        &echo_run,
        // Against provledger at the same client count only (`--clients` may leave it out).
        &rows
            .iter()
            .find(|r| r.0 == echo_clients)
            .map_or("-".into(), |r| ratio(r.1.rate(), echo_run.rate())),
    );
    println!();
    println!(
        "- Clients share one NATS connection per {CLIENTS_PER_CONNECTION}; each client writes its own share of the providers (no two clients write one), one request at a time; a request times out after {} s.",
        REQUEST_TIMEOUT.as_secs()
    );
    println!(
        "- Every row starts on 1,000 fresh aggregates holding one commit; raw and PostgreSQL payloads are {payload_bytes} bytes, the size of the encoded commit."
    );
    println!(
        "- Machine CPU per commit: every core's busy time (/proc/stat) during the row, all processes (serve, nats-server, PostgreSQL, the load generator; for provledger and the client library also serve's projector's tail after the row), over the row's commits: the machine must be otherwise idle. serve's copier writes behind, so part of its work falls in the next row. Once the cores are saturated, the rate is about busy cores × 10^6 ÷ this figure."
    );
    println!(
        "- The relay row is the least a service between the client and the stream does per write (request, publish expecting the kept sequence, ack, reply; no decision, chain, projection, feed or copy), on a runtime of its own with one connection, as serve: provledger ÷ relay is provledger's own cost, relay ÷ raw the architecture's."
    );
    println!(
        "- The client library's row is a service linking provledger (`provledger_client::Writer` over one `JetStreamLog`, in this process) writing the same commits on 1,000 providers of its own: the decision, the hash chain and the encoding as serve's, the aggregate's state kept between writes, no request, reply or projection."
    );
    for note in notes {
        println!("- {note}");
    }
    println!();
    println!("### Single commits ÷ raw JetStream, by path (same runs)");
    println!();
    println!("| clients | `cmd.append` (NATS + JSON, through serve) | client library `record` | relay (the floor of a service in the path) |");
    println!("|---:|---:|---:|---:|");
    for (clients, ledger, raw, relay, library, _) in &rows {
        println!(
            "| {clients} | {} | {} | {} |",
            ratio(ledger.rate(), raw.rate()),
            ratio(library.rate(), raw.rate()),
            ratio(relay.rate(), raw.rate()),
        );
    }
    println!();
    println!("### Where a commit's CPU goes: µs per commit, by part (same runs)");
    println!();
    let labels: Vec<&str> = Part::ALL.iter().map(|p| p.label()).collect();
    println!(
        "| clients | row | {} | rest of the machine | machine |",
        labels.join(" | ")
    );
    println!("|---:|---|{}---:|---:|", "---:|".repeat(labels.len()));
    for (clients, ledger, raw, relay, library, _) in &rows {
        parts_row(*clients, "provledger cmd.append", ledger);
        parts_row(*clients, "raw JetStream", raw);
        parts_row(*clients, "relay", relay);
        parts_row(*clients, "client library `record`", library);
    }
    println!();
    println!(
        "- Each part's CPU time (user + system, from /proc: the threads of this process by name, and the nats-server it started) over the row, plus serve's projector's tail after it for provledger and the client library, over the row's commits. The load generator is every thread of this process that is not serve's or the relay's. Rest of the machine: what /proc/stat counts busy that no part's threads were charged with (interrupts, PostgreSQL, anything else running)."
    );
    println!();
    println!("### What nats-server moves per commit (same runs)");
    println!();
    println!("| clients | row | messages in | messages out | bytes in | bytes out |");
    println!("|---:|---|---:|---:|---:|---:|");
    for (clients, [ledger, raw, relay, library]) in &traffic {
        println!("| {clients} | provledger cmd.append | {ledger} |");
        println!("| {clients} | raw JetStream | {raw} |");
        println!("| {clients} | relay | {relay} |");
        println!("| {clients} | client library `record` | {library} |");
    }
    println!();
    println!(
        "- nats-server's `/varz` (`in_msgs`, `out_msgs`, `in_bytes`, `out_bytes`: every client connection's, JetStream's own deliveries included) read before and after each row (for provledger and the client library, after serve's projector caught up), over the row's commits: the hops a commit takes through nats-server on that path (on 2 cores shared with it, each one is CPU the row's rate pays for)."
    );
    let runs = rows
        .iter()
        .flat_map(|(_, l, r, y, b, p)| {
            [Some(l), Some(r), Some(y), Some(b), p.as_ref().map(|p| &p.1)]
        })
        .flatten()
        .chain([&echo_run]);
    print_examples(run_errors(runs));
}

/// One row of the CPU-by-part table: each part's CPU over the run's commits, in µs.
fn parts_row(clients: usize, system: &str, run: &Run) {
    let commits = run.ok.len();
    let (Some(parts), Some(machine)) = (&run.parts, run.machine_cpu) else {
        println!("| {clients} | {system} | no /proc here |");
        return;
    };
    if commits == 0 {
        println!("| {clients} | {system} | no commit |");
        return;
    }
    let per_commit = |cpu: Duration| format!("{:.1}", cpu.as_secs_f64() * 1e6 / commits as f64);
    let cells: Vec<String> = parts
        .0
        .iter()
        .map(|cpu| match cpu.is_zero() {
            true => "-".into(),
            false => per_commit(*cpu),
        })
        .collect();
    let counted: Duration = parts.0.iter().sum();
    println!(
        "| {clients} | {system} | {} | {} | {} |",
        cells.join(" | "),
        per_commit(machine.saturating_sub(counted)),
        per_commit(machine)
    );
}

/// Facts on two aggregates at once: `cmd.append` with `commits` (atomic sets, which serve
/// groups into shared JetStream atomic batches) next to single commits, in the same run,
/// over the same 1,000 providers; then the same through the client library from 64 tasks;
/// then raw JetStream atomic batches as the ceiling; then a first write after another
/// process deepened a provider.
async fn atomic(nats: &NatsServer, o: &Options) {
    pairs(nats, o).await;
    if o.only == Some(Phase::Pairs) {
        return;
    }
    library_atomic(nats, o).await;
    raw_atomic(nats, o).await;
    deep_first_write(nats, o).await;
}

/// Two providers per `cmd.append` against one, at each of `--clients`' counts.
async fn pairs(nats: &NatsServer, o: &Options) {
    let client = nats.client().await;
    let mut rows = Vec::new();
    for &clients in &o.clients {
        eprintln!("atomic: {clients} clients: single commits ...");
        let (ids, _) = register(&client, AGGREGATES).await;
        wait_caught_up(&client).await;
        let singles: Vec<Bytes> = ids.iter().map(|id| bench_write(*id)).collect();
        let writers = requesters(nats, "bench", clients, APPEND_SUBJECT, &singles).await;
        let single = closed_loop(writers, o.duration).await;
        wait_caught_up(&client).await;

        eprintln!("atomic: {clients} clients: two providers per request ...");
        let (ids, _) = register(&client, AGGREGATES).await;
        wait_caught_up(&client).await;
        let half = ids.len() / 2;
        let pairs: Vec<Bytes> = (0..half)
            .map(|i| {
                let commit = |id: Uuid| {
                    json!({"aggregate": format!("provider/{id}"), "expect": "any",
                           "events": [inventory(64)]})
                };
                Bytes::from(json!({"commits": [commit(ids[i]), commit(ids[i + half])]}).to_string())
            })
            .collect();
        let writers = requesters(nats, "bench", clients, APPEND_SUBJECT, &pairs).await;
        let paired = closed_loop(writers, o.duration).await;
        wait_caught_up(&client).await;
        rows.push((clients, single, paired));
    }
    println!();
    println!(
        "## 5. Facts on several aggregates: cmd.append with `commits` (atomic sets, grouped by serve) vs single commits ({} s per row, 1,000 providers, expect any)",
        o.duration.as_secs()
    );
    println!();
    println!("| clients | form | requests/s | commits/s | p50 | p99 | errors by code | commits/s ÷ single |");
    println!("|---:|---|---:|---:|---:|---:|---|---:|");
    for (clients, single, paired) in &rows {
        for (form, run, per_request) in [
            ("one commit per request", single, 1.0),
            ("two providers per request (`commits`)", paired, 2.0),
        ] {
            let l = run.all_latencies();
            println!(
                "| {clients} | {form} | {:.0} | {:.0} | {} | {} | {} | {} |",
                run.rate(),
                run.rate() * per_request,
                quantile(&l, 0.50),
                quantile(&l, 0.99),
                run.errors_by_code(),
                ratio(run.rate() * per_request, single.rate()),
            );
        }
    }
    print_examples(run_errors(rows.iter().flat_map(|(_, a, b)| [a, b])));
}

// ---------------------------------------------------------------------------------------
// The client library's record_atomic, in process

/// One task of the library workload: `record` on one provider, or `record_atomic` on two.
struct LibraryWriter {
    log: provledger_client::Writer<JetStreamLog>,
    providers: Vec<(AggregateId, AggregateId)>,
    paired: bool,
    next: usize,
}

fn inventory_draft() -> CommitDraft {
    let events: Vec<Event> =
        serde_json::from_value(json!([inventory(64)])).expect("inventory event");
    CommitDraft::now("bench", events)
}

impl Writer for LibraryWriter {
    async fn write(&mut self) -> Result<(), String> {
        use provledger_client::write::{Fact, FromTheLog};
        let (a, b) = self.providers[self.next % self.providers.len()];
        self.next += 1;
        let result = match self.paired {
            false => self
                .log
                .record(a, Expectation::Any, inventory_draft())
                .await
                .map(|_| ()),
            true => {
                let fact = |aggregate| Fact {
                    aggregate,
                    expect: Expectation::Any,
                    draft: inventory_draft(),
                };
                self.log
                    .record_atomic(vec![fact(a), fact(b)], Default::default(), &FromTheLog)
                    .await
                    .map(|_| ())
            }
        };
        result.map_err(|e| format!("library: {e}"))
    }
}

/// `clients` tasks sharing one `JetStreamLog` (as a service linking the library does), over
/// 1,000 providers registered through it.
async fn library_writers(nats: &NatsServer, clients: usize, paired: bool) -> Vec<LibraryWriter> {
    let log = provledger_client::Writer::new(
        JetStreamLog::open(nats.client().await, JetStreamConfig::default())
            .await
            .expect("opening the PROVLEDGER stream"),
    );
    let ids: Vec<AggregateId> = (0..AGGREGATES)
        .map(|_| AggregateId::provider(Uuid::now_v7()))
        .collect();
    futures::stream::iter(ids.iter().enumerate().map(|(n, id)| {
        let log = log.clone();
        async move {
            let events: Vec<Event> =
                serde_json::from_value(registration(n)).expect("registration events");
            log.record(
                *id,
                Expectation::NoStream,
                CommitDraft::now("bench", events),
            )
            .await
            .expect("registering a provider through the library")
        }
    }))
    .buffer_unordered(64)
    .collect::<Vec<_>>()
    .await;
    // Single commits write every provider (the second of each "pair" is unused).
    let pairs: Vec<(AggregateId, AggregateId)> = if paired {
        let half = ids.len() / 2;
        (0..half).map(|i| (ids[i], ids[i + half])).collect()
    } else {
        ids.iter().map(|id| (*id, *id)).collect()
    };
    (0..clients)
        .map(|c| LibraryWriter {
            log: log.clone(),
            providers: share(&pairs, clients, c),
            paired,
            next: 0,
        })
        .collect()
}

async fn library_atomic(nats: &NatsServer, o: &Options) {
    let clients = 64;
    eprintln!("atomic: the client library, {clients} tasks: single commits ...");
    let single = closed_loop(library_writers(nats, clients, false).await, o.duration).await;
    eprintln!("atomic: the client library, {clients} tasks: record_atomic on two providers ...");
    let paired = closed_loop(library_writers(nats, clients, true).await, o.duration).await;
    println!();
    println!(
        "### The same through the client library: one `JetStreamLog` shared by {clients} tasks, `record` vs `record_atomic` ({} s each)",
        o.duration.as_secs()
    );
    println!();
    println!("| form | calls/s | commits/s | p50 | p99 | errors by code | commits/s ÷ single |");
    println!("|---|---:|---:|---:|---:|---|---:|");
    for (form, run, per_call) in [
        ("`record`, one provider", &single, 1.0),
        ("`record_atomic`, two providers", &paired, 2.0),
    ] {
        let l = run.all_latencies();
        println!(
            "| {form} | {:.0} | {:.0} | {} | {} | {} | {} |",
            run.rate(),
            run.rate() * per_call,
            quantile(&l, 0.50),
            quantile(&l, 0.99),
            run.errors_by_code(),
            ratio(run.rate() * per_call, single.rate()),
        );
    }
    print_examples(run_errors([&single, &paired].into_iter()));
}

// ---------------------------------------------------------------------------------------
// Raw JetStream atomic batches

/// Publishes atomic batches of `per_batch` messages, each on its own subject of this
/// writer with the subject's expected last sequence (tracked here: no other writer touches
/// them), as provledger's batches do.
struct RawBatchWriter {
    client: async_nats::Client,
    /// (subject, its last sequence)
    subjects: Vec<(String, u64)>,
    payload: Bytes,
    per_batch: usize,
    next: usize,
}

impl Writer for RawBatchWriter {
    async fn write(&mut self) -> Result<(), String> {
        let batch_id = Uuid::new_v4().to_string();
        let count = self.per_batch;
        let picked: Vec<usize> = (0..count)
            .map(|i| (self.next + i) % self.subjects.len())
            .collect();
        self.next += count;
        for (i, &at) in picked.iter().enumerate() {
            let (subject, last) = &self.subjects[at];
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Batch-Id", batch_id.as_str());
            headers.insert("Nats-Batch-Sequence", (i + 1).to_string().as_str());
            headers.insert(
                "Nats-Expected-Last-Subject-Sequence",
                last.to_string().as_str(),
            );
            headers.insert("Nats-Msg-Id", Uuid::now_v7().to_string().as_str());
            let is_last = i + 1 == count;
            if is_last {
                headers.insert("Nats-Batch-Commit", "1");
            }
            if i == 0 || is_last {
                let reply = tokio::time::timeout(
                    REQUEST_TIMEOUT,
                    self.client.request_with_headers(
                        subject.clone(),
                        headers,
                        self.payload.clone(),
                    ),
                )
                .await
                .map_err(|_| "timeout: no answer to the batch".to_string())?
                .map_err(|e| format!("request_failed: {e}"))?;
                let body: Value = match reply.payload.is_empty() {
                    true => Value::Null,
                    false => serde_json::from_slice(&reply.payload)
                        .map_err(|e| format!("unreadable: {e}"))?,
                };
                if let Some(error) = body.get("error") {
                    return Err(format!("refused: {error}"));
                }
                if is_last {
                    let seq = body["seq"].as_u64().ok_or("unreadable: no seq")?;
                    let first = seq + 1 - count as u64;
                    for (k, &at) in picked.iter().enumerate() {
                        self.subjects[at].1 = first + k as u64;
                    }
                }
            } else {
                self.client
                    .publish_with_headers(subject.clone(), headers, self.payload.clone())
                    .await
                    .map_err(|e| format!("publish_failed: {e}"))?;
            }
        }
        Ok(())
    }
}

/// `writers` raw batch writers of `per_batch` messages on the raw stream, each over
/// subjects of its own holding one message.
async fn raw_batch_writers(
    nats: &NatsServer,
    writers: usize,
    per_batch: usize,
    payload: &Bytes,
) -> Vec<RawBatchWriter> {
    let js = jetstream::new(nats.client().await);
    let mut config = jetstream::stream::Config {
        name: RAW_BATCH_STREAM.into(),
        subjects: vec![format!("{RAW_BATCH_PREFIX}.>")],
        storage: jetstream::stream::StorageType::File,
        allow_direct: true,
        deny_delete: true,
        deny_purge: true,
        ..Default::default()
    };
    config.allow_atomic_publish = true;
    js.get_or_create_stream(config)
        .await
        .expect("creating the raw batch stream");
    let conns = connections(nats, "bench", writers).await;
    let mut out = Vec::new();
    for w in 0..writers {
        let mut subjects = Vec::new();
        for _ in 0..(per_batch * 2).max(16) {
            let subject = format!("{RAW_BATCH_PREFIX}.ev.provider.{}", Uuid::now_v7());
            let ack = js
                .publish(subject.clone(), payload.clone())
                .await
                .expect("publishing a raw subject's first message")
                .await
                .expect("the ack of a raw subject's first message");
            subjects.push((subject, ack.sequence));
        }
        out.push(RawBatchWriter {
            client: conns[w / CLIENTS_PER_CONNECTION].clone(),
            subjects,
            payload: payload.clone(),
            per_batch,
            next: 0,
        });
    }
    out
}

/// The ceiling: raw atomic batches of two messages from as many publishers as clients
/// (one request's set per batch), next to batches of `clients` messages from
/// `GROUP_COMMITTERS_MAX` publishers (what a group commit of those clients' sets sends),
/// and raw single publishes with an expectation as the reference of single commits.
async fn raw_atomic(nats: &NatsServer, o: &Options) {
    let payload = Bytes::from(vec![b'x'; commit_bytes()]);
    let committers = provledger_events::GROUP_COMMITTERS_MAX;
    let mut rows = Vec::new();
    for clients in CLIENT_COUNTS {
        eprintln!("atomic: raw JetStream, {clients} publishers of 2-message batches ...");
        let per_request = closed_loop(
            raw_batch_writers(nats, clients, 2, &payload).await,
            o.duration,
        )
        .await;
        let per_group = (2 * clients / committers).clamp(2, provledger_events::GROUP_MESSAGES_MAX);
        eprintln!(
            "atomic: raw JetStream, {committers} publishers of {per_group}-message batches ..."
        );
        let grouped = closed_loop(
            raw_batch_writers(nats, committers, per_group, &payload).await,
            o.duration,
        )
        .await;
        eprintln!("atomic: raw JetStream, {clients} publishers of single messages ...");
        let single = closed_loop(raw_writers(nats, clients, &payload).await, o.duration).await;
        rows.push((clients, per_request, per_group, grouped, single));
    }
    println!();
    println!(
        "### The ceiling: raw JetStream atomic batches, no provledger ({} s per row, {}-byte messages, each on its own subject with `Nats-Expected-Last-Subject-Sequence`)",
        o.duration.as_secs(),
        payload.len()
    );
    println!();
    println!("| clients | raw single publishes (direct get + publish) msgs/s | 2-message batches from `clients` publishers: msgs/s (p50) | batches of the group's size from {committers} publishers: size, msgs/s (p50) | grouped ÷ per-request |");
    println!("|---:|---:|---:|---:|---:|");
    for (clients, per_request, per_group, grouped, single) in &rows {
        let (lr, lg) = (per_request.all_latencies(), grouped.all_latencies());
        println!(
            "| {clients} | {:.0} | {:.0} ({}) | {per_group}: {:.0} ({}) | {} |",
            single.rate(),
            per_request.rate() * 2.0,
            quantile(&lr, 0.5),
            grouped.rate() * *per_group as f64,
            quantile(&lg, 0.5),
            ratio(grouped.rate() * *per_group as f64, per_request.rate() * 2.0),
        );
    }
    print_examples(run_errors(
        rows.iter().flat_map(|(_, a, _, b, c)| [a, b, c]),
    ));
}

// ---------------------------------------------------------------------------------------
// A first write after another process deepened a provider

/// Providers serve wrote 10 commits to, then another process (a `JetStreamLog` here) took to
/// `depth` commits; serve catches up; then one `cmd.append` on each, next to one on a
/// provider serve never wrote. A write to another provider goes first, unmeasured, so that
/// neither measured write is the first after the bulk load (that one ran up to 3x slower
/// whichever it was), and the pairs alternate which of the two goes first.
async fn deep_first_write(nats: &NatsServer, o: &Options) {
    const PROVIDERS: usize = 5;
    let depth = *o.depths.last().unwrap_or(&100_000) as u64;
    let client = nats.client().await;
    let (deep, _) = register(&client, PROVIDERS).await;
    for _ in 1..10 {
        for id in &deep {
            let reply = request(&client, APPEND_SUBJECT, bench_write(*id))
                .await
                .expect("a write through serve");
            assert!(reply_error(&reply).is_none(), "a write through serve");
        }
    }
    eprintln!("atomic: another process takes {PROVIDERS} providers from 10 to {depth} commits ...");
    let log = JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("opening the PROVLEDGER stream");
    let started = Instant::now();
    futures::future::join_all(deep.iter().map(|id| {
        let log = log.clone();
        async move {
            let aggregate = AggregateId::provider(*id);
            for v in 10..depth {
                log.append(aggregate, Expectation::Exactly(v), inventory_draft())
                    .await
                    .expect("deepening a provider");
            }
        }
    }))
    .await;
    let built = started.elapsed();
    wait_caught_up(&client).await;
    let (fresh, _) = register(&client, PROVIDERS + 1).await;
    wait_caught_up(&client).await;
    let warm_up = request(&client, APPEND_SUBJECT, bench_write(fresh[PROVIDERS]))
        .await
        .expect("a write through serve");
    assert!(reply_error(&warm_up).is_none(), "the warm-up write");
    let mut rows = Vec::new();
    for (n, (deep, fresh)) in deep.iter().zip(&fresh).enumerate() {
        let mut timed = vec![(Duration::ZERO, None); 2];
        let order = if n % 2 == 0 { [0, 1] } else { [1, 0] };
        for which in order {
            let id = [deep, fresh][which];
            let sent = Instant::now();
            let reply = request(&client, APPEND_SUBJECT, bench_write(*id))
                .await
                .expect("a write through serve");
            let error = reply_error(&reply);
            timed[which] = (sent.elapsed(), error);
        }
        rows.push(timed);
    }
    println!();
    println!(
        "### The first cmd.append on a provider another process took from 10 to {depth} commits after serve last wrote it, next to one on a provider serve never wrote (serve caught up first, then one unmeasured write elsewhere; {PROVIDERS} pairs, the deepened provider written first in odd pairs, second in even ones; building took {built:.1?})"
    );
    println!();
    println!("| pair | deepened provider | fresh provider | deepened ÷ fresh |");
    println!("|---:|---:|---:|---:|");
    for (n, timed) in rows.iter().enumerate() {
        let show = |(d, e): &(Duration, Option<String>)| match e {
            None => format!("{d:.2?}"),
            Some(e) => format!("{d:.2?} ({e})"),
        };
        println!(
            "| {} | {} | {} | {} |",
            n + 1,
            show(&timed[0]),
            show(&timed[1]),
            ratio(timed[0].0.as_secs_f64(), timed[1].0.as_secs_f64())
        );
    }
    // One write per provider is one sample each: a scheduling hiccup of a millisecond on a
    // shared machine is several times a write. The medians say what a deepened provider
    // costs; the rows above show the spread.
    let median =
        |which: usize| percentile(&rows.iter().map(|t| t[which].0).collect::<Vec<_>>(), 0.5);
    let (deep_median, fresh_median) = (median(0), median(1));
    println!(
        "| median | {deep_median:.2?} | {fresh_median:.2?} | {} |",
        ratio(deep_median.as_secs_f64(), fresh_median.as_secs_f64())
    );
}

/// A claim of one VCPU for a new instance, `expect: "any"`.
fn claim_request(provider: Uuid) -> Bytes {
    append_request(
        provider,
        json!("any"),
        json!([{"allocation_claimed": {
            "consumer": Uuid::now_v7(), "consumer_kind": "instance", "resources": {"VCPU": 1}}}]),
    )
}

/// Claims through serve on providers that already hold many allocations (a shared
/// provider: an address pool, shared storage, which every instance holds an allocation
/// on), next to claims on one that holds none: whether a write costs more as an
/// aggregate's state grows. Each wide provider is filled by another process through the
/// log, 1,000 claims per commit; serve catches up, takes one unmeasured claim on each,
/// then claims on every provider in turn.
async fn wide(nats: &NatsServer, o: &Options) {
    const CLAIMS: usize = 200;
    const CLAIMS_PER_COMMIT: usize = 1_000;
    const CAPACITY: u64 = 10_000_000;
    let widths: Vec<usize> = match o.quick {
        true => vec![0, 1_000, 10_000],
        false => vec![0, 1_000, 10_000, 100_000],
    };
    let client = nats.client().await;
    let log = JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("opening the PROVLEDGER stream");
    let mut providers = Vec::new();
    for &width in &widths {
        let id = Uuid::now_v7();
        let registration = json!([
            {"provider_registered": {"name": format!("wide-{width}"), "host": "pool.example"}},
            inventory(CAPACITY)
        ]);
        let reply = request(
            &client,
            APPEND_SUBJECT,
            append_request(id, json!("none"), registration),
        )
        .await
        .expect("registering a provider through serve");
        assert!(reply_error(&reply).is_none(), "registering a provider");
        eprintln!("wide: another process claims {width} allocations on one provider ...");
        let aggregate = AggregateId::provider(id);
        // Version 1 is the registration.
        for (version, start) in (1..).zip((0..width).step_by(CLAIMS_PER_COMMIT)) {
            let events: Vec<Event> = (start..width.min(start + CLAIMS_PER_COMMIT))
                .map(|_| {
                    Event::allocation_claimed(
                        Uuid::now_v7(),
                        ConsumerKind::Instance,
                        [("VCPU".to_string(), 1)].into(),
                    )
                })
                .collect();
            log.append(
                aggregate,
                Expectation::Exactly(version),
                CommitDraft::now("bench", events),
            )
            .await
            .expect("filling a wide provider");
        }
        providers.push((width, id));
    }
    wait_caught_up(&client).await;
    for (_, id) in &providers {
        let reply = request(&client, APPEND_SUBJECT, claim_request(*id))
            .await
            .expect("a claim through serve");
        assert!(reply_error(&reply).is_none(), "the unmeasured claim");
    }
    let mut timed: Vec<Vec<Duration>> = vec![Vec::new(); providers.len()];
    let mut errors: Vec<Vec<String>> = vec![Vec::new(); providers.len()];
    for round in 0..CLAIMS {
        for k in 0..providers.len() {
            // Alternate the order, so that no provider always follows another.
            let k = if round % 2 == 0 {
                k
            } else {
                providers.len() - 1 - k
            };
            let sent = Instant::now();
            match request(&client, APPEND_SUBJECT, claim_request(providers[k].1)).await {
                Ok(reply) => match reply_error(&reply) {
                    None => timed[k].push(sent.elapsed()),
                    Some(e) => errors[k].push(e),
                },
                Err(e) => errors[k].push(format!("request: {e}")),
            }
        }
    }
    println!();
    println!(
        "### Claims on a provider holding many allocations, next to one holding none ({CLAIMS} sequential `cmd.append` claims per provider, one client, the providers in turn; each filled by another process through the log, {CLAIMS_PER_COMMIT} claims per commit, then one unmeasured claim)"
    );
    println!();
    // What reading each provider back answers, once it holds what it was given.
    let mut reads = Vec::new();
    for (_, id) in &providers {
        let get = Bytes::from(json!({ "id": id }).to_string());
        reads.push(
            match request(&client, "provledger.q.provider.get", get).await {
                Ok(reply) => match reply_error(&reply) {
                    None => format!("{} bytes", reply.payload.len()),
                    Some(e) => format!("`{}`", code_of(&e)),
                },
                Err(e) => format!("request: {e}"),
            },
        );
    }
    // And the same read in parts of 1,000 allocations (`allocations_after`).
    let mut parts = Vec::new();
    for (_, id) in &providers {
        parts.push(read_in_parts(&client, *id).await);
    }
    println!("| allocations held at the start | p50 | p99 | max | errors by code | p50 ÷ the empty provider's | `q.provider.get` after the claims | the same in parts of 1,000 |");
    println!("|---:|---:|---:|---:|---|---:|---|---|");
    let base_p50 = {
        let mut b = timed[0].to_vec();
        b.sort();
        percentile(&b, 0.5)
    };
    for (k, (width, _)) in providers.iter().enumerate() {
        let mut l = timed[k].clone();
        l.sort();
        println!(
            "| {width} | {} | {} | {} | {} | {} | {} | {} |",
            quantile(&l, 0.50),
            quantile(&l, 0.99),
            quantile(&l, 1.0),
            by_code(errors[k].iter().map(String::as_str)),
            match l.is_empty() {
                true => "-".into(),
                false => ratio(percentile(&l, 0.5).as_secs_f64(), base_p50.as_secs_f64()),
            },
            reads[k],
            parts[k]
        );
    }
    print_examples(errors.iter().flatten().map(String::as_str));
}

/// Reads a provider's allocations in parts of 1,000 (`allocations_after`, `parts_limit`):
/// how many parts, how long in all, and whether they add up to `allocations_total`.
async fn read_in_parts(client: &async_nats::Client, id: Uuid) -> String {
    const PART: usize = 1_000;
    let started = Instant::now();
    let (mut read, mut parts) = (0, 0);
    // Set by every part: the last one's is what the parts must add up to.
    let mut total: Option<u64>;
    let mut after: Option<String> = None;
    loop {
        let mut get = json!({"id": id, "parts_limit": PART});
        if let Some(a) = &after {
            get["allocations_after"] = json!(a);
        }
        let reply = match request(
            client,
            "provledger.q.provider.get",
            Bytes::from(get.to_string()),
        )
        .await
        {
            Ok(reply) => reply,
            Err(e) => return format!("request: {e}"),
        };
        if let Some(e) = reply_error(&reply) {
            return format!("`{}` after {parts} parts", code_of(&e));
        }
        let Ok(view) = serde_json::from_slice::<Value>(&reply.payload) else {
            return "a reply that is not JSON".into();
        };
        let allocations = view["data"]["allocations"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        total = view["data"]["allocations_total"].as_u64();
        parts += 1;
        read += allocations.len();
        after = allocations
            .last()
            .and_then(|a| a["consumer"].as_str())
            .map(str::to_string);
        if allocations.len() < PART {
            break;
        }
    }
    let whole = match total {
        Some(t) if t as usize == read => "all",
        _ => "NOT all",
    };
    format!(
        "{parts} parts, {:.1?}, {whole} of {}",
        started.elapsed(),
        total.map_or("?".into(), |t| t.to_string())
    )
}

async fn depth(nats: &NatsServer, o: &Options) {
    let client = nats.client().await;
    let log = JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .expect("opening the PROVLEDGER stream");
    let (mut ids, mut builds) = (Vec::new(), Vec::new());
    for &depth in &o.depths {
        eprintln!("depth: building a provider of {depth} commits through JetStreamLog ...");
        let id = Uuid::now_v7();
        let aggregate = AggregateId::provider(id);
        let started = Instant::now();
        let first: Vec<Event> =
            serde_json::from_value(registration(0)).expect("registration events");
        let next: Vec<Event> =
            serde_json::from_value(json!([inventory(64)])).expect("inventory event");
        log.append(
            aggregate,
            Expectation::Exactly(0),
            CommitDraft::now("bench", first),
        )
        .await
        .expect("the deep provider's registration");
        for v in 1..depth as u64 {
            log.append(
                aggregate,
                Expectation::Exactly(v),
                CommitDraft::now("bench", next.clone()),
            )
            .await
            .expect("building the deep provider");
        }
        let built = format!(
            "{depth} commits in {:.1?} ({:.0}/s)",
            started.elapsed(),
            depth as f64 / started.elapsed().as_secs_f64()
        );
        eprintln!("depth: {built}");
        builds.push(built);
        ids.push((depth, id));
    }
    eprintln!("depth: waiting for serve to fold them ...");
    wait_caught_up(&client).await;
    let mut rows = Vec::new();
    for (depth, id) in ids {
        eprintln!("depth: {DEPTH_SAMPLES} sequential cmd.append on {depth} commits ...");
        let mut writer = Requester {
            client: client.clone(),
            subject: APPEND_SUBJECT,
            payloads: vec![bench_write(id)],
            next: 0,
        };
        let (mut latencies, mut errors) = (Vec::new(), Vec::new());
        for _ in 0..DEPTH_SAMPLES {
            let sent = Instant::now();
            match writer.write().await {
                Ok(()) => latencies.push(sent.elapsed()),
                Err(error) => errors.push(error),
            }
        }
        latencies.sort();
        rows.push((depth, latencies, errors));
    }

    println!();
    println!(
        "## 2. Latency vs aggregate depth: {DEPTH_SAMPLES} sequential cmd.append (expect any) on one provider"
    );
    println!();
    println!(
        "| depth (commits) | p50 | p99 | max | errors by code | p50 vs depth {} |",
        o.depths[0]
    );
    println!("|---:|---:|---:|---:|---|---:|");
    let base = rows
        .first()
        .map_or(Duration::ZERO, |r| percentile(&r.1, 0.5));
    for (depth, latencies, errors) in &rows {
        let p50 = percentile(latencies, 0.5);
        println!(
            "| {depth} | {} | {} | {} | {} | {} |",
            quantile(latencies, 0.5),
            quantile(latencies, 0.99),
            quantile(latencies, 1.0),
            by_code(errors.iter().map(String::as_str)),
            ratio(p50.as_secs_f64(), base.as_secs_f64())
        );
    }
    let p50s: Vec<f64> = rows
        .iter()
        .map(|r| percentile(&r.1, 0.5).as_secs_f64())
        .collect();
    let (min, max) = p50s
        .iter()
        .fold((f64::MAX, 0.0f64), |(lo, hi), &p| (lo.min(p), hi.max(p)));
    println!();
    println!("- p50 ratio max/min: {}", ratio(max, min));
    print_examples(rows.iter().flat_map(|r| r.2.iter().map(String::as_str)));
    println!(
        "- The providers were built with `JetStreamLog` appends at `Exactly(v)`, one at a time: appends to one aggregate cannot be pipelined (each needs the previous ack's sequence and hash): {}.",
        builds.join(", ")
    );
}

async fn hot(nats: &NatsServer, o: &Options, pg: Option<&Postgres>, payload_bytes: usize) {
    let client = nats.client().await;
    let (ids, _) = register(&client, 1).await;
    wait_caught_up(&client).await;
    eprintln!("hot: {HOT_CLIENTS} clients on one provider: provledger cmd.append ...");
    let writers = requesters(
        nats,
        "bench",
        HOT_CLIENTS,
        APPEND_SUBJECT,
        &[bench_write(ids[0])],
    )
    .await;
    let ledger = closed_loop(writers, o.duration).await;
    wait_caught_up(&client).await;
    let pg_run = match pg {
        Some(_) => {
            eprintln!("hot: {HOT_CLIENTS} connections on one stream: PostgreSQL ...");
            Some(
                closed_loop(
                    pg_locked_writers(HOT_CLIENTS, payload_bytes).await,
                    o.duration,
                )
                .await,
            )
        }
        None => None,
    };

    println!();
    println!(
        "## 3. Hot aggregate: {HOT_CLIENTS} clients writing one aggregate for {} s",
        o.duration.as_secs()
    );
    println!();
    println!("| clients | system | commits/s | p50 | p99 | errors by code | provledger ÷ this | machine CPU per commit (µs) |");
    println!("|---:|---|---:|---:|---:|---|---:|---:|");
    row(
        HOT_CLIENTS,
        "provledger cmd.append, expect any",
        &ledger,
        "1.00x",
    );
    match &pg_run {
        Some(run) => row(
            HOT_CLIENTS,
            "PostgreSQL: SELECT ... FOR UPDATE, INSERT, UPDATE, COMMIT",
            run,
            &ratio(ledger.rate(), run.rate()),
        ),
        None => println!("| {HOT_CLIENTS} | PostgreSQL | skipped (unreachable) | | | | | |"),
    }
    println!();
    println!(
        "- The provider ended at {} commits. Inside serve, writes to one aggregate take turns and each decides on the state kept from the previous one (no re-read, no lost race); only another replica could make one decide again.",
        1 + ledger.ok.len()
    );
    print_examples(run_errors([&ledger].into_iter().chain(pg_run.as_ref())));
}

/// 64 clients for `o.sustained` over 1,000 fresh providers, per 5-second window.
/// Sustained writes; `mixed`: every other request is an atomic set on two providers.
async fn sustained(nats: &NatsServer, o: &Options, user: &str, title: &str, mixed: bool) {
    let client = nats.client_as(user).await;
    let (ids, _) = register(&client, AGGREGATES).await;
    wait_caught_up(&client).await;
    let payloads: Vec<Bytes> = match mixed {
        false => ids.iter().map(|id| bench_write(*id)).collect(),
        true => ids
            .chunks(2)
            .flat_map(|two| {
                let commit = |id: &Uuid| {
                    json!({"aggregate": format!("provider/{id}"), "expect": "any",
                           "events": [inventory(64)]})
                };
                [
                    bench_write(two[0]),
                    Bytes::from(json!({"commits": [commit(&two[0]), commit(&two[1])]}).to_string()),
                ]
            })
            .collect(),
    };
    let writers = requesters(nats, user, SUSTAINED_CLIENTS, APPEND_SUBJECT, &payloads).await;
    eprintln!(
        "sustained ({title}): {SUSTAINED_CLIENTS} clients for {} s ...",
        o.sustained.as_secs()
    );
    let watcher = tokio::spawn(watch_server(nats.monitor_addr(), o.sustained));
    let run = closed_loop(writers, o.sustained).await;
    let figures = watcher.await.expect("the monitoring task");
    wait_caught_up(&client).await;

    println!();
    println!(
        "## 4. Sustained, {title}: {SUSTAINED_CLIENTS} clients for {} s over 1,000 providers",
        o.sustained.as_secs()
    );
    println!();
    let unit = match mixed {
        true => "requests/s (half of them atomic pairs)",
        false => "commits/s",
    };
    println!("| window | {unit} | p50 | p99 | errors by code | consumers on {STREAM} (start → end) | nats-server mem (start → end) | CPU per request, µs: serve (of it: projector, copier, sled) / nats-server / load generator |");
    println!("|---|---:|---:|---:|---|---:|---:|---:|");
    let bounds = boundaries(o.sustained);
    let mut rates = Vec::new();
    let mut costs = Vec::new();
    for (k, pair) in bounds.windows(2).enumerate() {
        let (from, to) = (pair[0], pair[1]);
        let latencies = run.latencies(from, to);
        let rate = latencies.len() as f64 / (to - from).as_secs_f64();
        rates.push(rate);
        let errors = by_code(
            run.errors
                .iter()
                .filter(|(at, _)| *at >= from && *at < to)
                .map(|(_, c)| c.as_str()),
        );
        let (start, end) = (&figures[k], &figures[k + 1]);
        let cost = WindowCost::between(start, end, latencies.len());
        println!(
            "| {}-{} s | {rate:.0} | {} | {} | {errors} | {} → {} | {} → {} | {} |",
            from.as_secs(),
            to.as_secs(),
            quantile(&latencies, 0.5),
            quantile(&latencies, 0.99),
            show_consumers(start),
            show_consumers(end),
            show_mem(start),
            show_mem(end),
            WindowCost::show(cost),
        );
        costs.push(cost);
    }
    let all = run.all_latencies();
    println!();
    println!(
        "- whole run: {:.0} {unit}, p50 {}, p99 {}, errors: {}",
        run.rate(),
        quantile(&all, 0.5),
        quantile(&all, 0.99),
        run.errors_by_code()
    );
    println!(
        "- last window / first window: {}",
        ratio(
            rates.last().copied().unwrap_or(0.0),
            rates.first().copied().unwrap_or(0.0)
        )
    );
    if let (Some(Some(first)), Some(Some(last))) = (costs.first(), costs.last()) {
        println!(
            "- CPU per request, last window / first window: serve {} (its projector, copier and sled {}), nats-server {}, load generator {}",
            ratio(last.serve, first.serve),
            ratio(last.serve_following, first.serve_following),
            ratio(last.nats_server, first.nats_server),
            ratio(last.load_generator, first.load_generator),
        );
    }
    println!(
        "- CPU per request: each part's CPU time (user + system, from /proc, thread by thread) over the window, over the requests that succeeded in it. serve is all of its threads (requests, projector, copier, sled). The load generator sends the same requests throughout, so its cost per request is a rough control for the machine (rough: a closed-loop client's cost per request also moves with the latency it sees): a window slower because the machine is (other tenants, caches) raises every column, one slower because provledger costs more raises serve's over the load generator's."
    );
    println!(
        "- nats-server's figures are read from its monitoring endpoint (`/jsz?accounts=true&streams=true`, `/varz` `mem`) at each window's bounds; they include what earlier phases on the same server left behind."
    );
    print_examples(run_errors([&run].into_iter()));
}

// ---------------------------------------------------------------------------------------

fn machine() -> String {
    let cpu = provledger_tests::cpu_model();
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
        })
        .map_or("?".into(), |kib| format!("{:.0} GiB", kib / 1048576.0));
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    format!("{host}: {cores} cores ({cpu}), {mem_gib}")
}

fn date() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| "?".into())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = parse_options();
    let binary = provledger_tests::nats_server_binary().unwrap_or_else(|e| panic!("{e}"));
    let nats = NatsServer::start().await;
    let probe = nats.client().await;
    let payload_bytes = commit_bytes();
    println!("# write-bench{}", if o.quick { " --quick" } else { "" });
    println!();
    println!("- machine: {}", machine());
    println!(
        "- nats-server {} ({}), JetStream file store with the server's default sync (every 2 min, not per write)",
        probe.server_info().version,
        binary.display()
    );
    println!("- date: {}", date());
    println!(
        "- provledger serve in process (own 2-thread runtime, CLI defaults), the load generator on another 2-thread runtime; D = {} s, sustained S = {} s, depths {:?}",
        o.duration.as_secs(),
        o.sustained.as_secs(),
        o.depths
    );
    let pg = match o.runs(Phase::Throughput) || o.runs(Phase::Hot) {
        true => Postgres::open().await,
        false => None,
    };
    if let Some(pg) = &pg {
        println!(
            "- PostgreSQL {} on 127.0.0.1:5432: max_connections = {}, synchronous_commit = {} (each commit waits for its WAL flush)",
            pg.version, pg.max_connections, pg.synchronous_commit
        );
    }

    let serve = Serve::start(nats.url(), o.log_copy);
    wait_caught_up(&probe).await;
    if o.runs(Phase::Throughput) {
        throughput(&nats, &o, pg.as_ref(), payload_bytes).await;
    }
    if o.runs(Phase::Depth) {
        depth(&nats, &o).await;
    }
    if o.runs(Phase::Hot) {
        hot(&nats, &o, pg.as_ref(), payload_bytes).await;
    }
    if o.runs(Phase::Atomic) || o.only == Some(Phase::Pairs) {
        atomic(&nats, &o).await;
    }
    if o.only == Some(Phase::Deep) {
        deep_first_write(&nats, &o).await;
    }
    if o.only == Some(Phase::Wide) {
        wide(&nats, &o).await;
    }
    if o.only == Some(Phase::Alternating) {
        alternating(&nats, &o, payload_bytes).await;
    }
    if o.runs(Phase::Sustained) {
        sustained(&nats, &o, "bench", "no accounts", false).await;
    }
    serve.stop().await;
    drop(nats);
    if let Some(pg) = &pg {
        pg.drop_tables().await;
    }

    if o.runs(Phase::Sustained) {
        eprintln!("sustained: restarting with deploy/nats/accounts.conf ...");
        let nats = NatsServer::start_hardened(true, false).await;
        let serve = Serve::start(nats.url_as("serve"), o.log_copy);
        wait_caught_up(&nats.client_as("provisioner").await).await;
        // Twice on the same server: the first round starts on an empty stream (the server
        // warms up as the stream grows), the second on what the first left, as a deployed
        // ledger's stream is.
        for round in [
            "first round, on a new server and an empty stream",
            "second round, on the stream the first round left",
        ] {
            sustained(
                &nats,
                &o,
                "provisioner",
                &format!(
                    "deploy/nats/accounts.conf (serve as `serve`, clients as `provisioner@SERVICES`), {round}"
                ),
                false,
            )
            .await;
        }
        serve.stop().await;
    }
    if o.runs(Phase::Sustained) || o.only == Some(Phase::Mixed) {
        eprintln!("sustained, mixed: a new server with deploy/nats/accounts.conf ...");
        let nats = NatsServer::start_hardened(true, false).await;
        let serve = Serve::start(nats.url_as("serve"), o.log_copy);
        wait_caught_up(&nats.client_as("provisioner").await).await;
        sustained(
            &nats,
            &o,
            "provisioner",
            "deploy/nats/accounts.conf, half of the requests atomic pairs (`commits` on two providers), a new server",
            true,
        )
        .await;
        serve.stop().await;
    }
}
