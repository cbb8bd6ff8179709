//! `drift-bench`: what `provledger drift` costs on a large ledger, next to a raw read of the
//! same log (issue 22).
//!
//! Setup (timed only to say how long it took): an embedded `SledLog` in a temp dir, written
//! through `EventLog::append_atomic` as a ledger writes it, holding `--ops` successful
//! boot-like operations, one commit each on its own operation aggregate, each with 4 effects
//! at 4 executors (`ipam`: an IP, `dhcp`: an entry, `dns`: a name, `hypervisor`: the VM,
//! named by the node's UUID), every effect with a compensation whose args carry a unique
//! `idempotency_key` and a `detail.node`. At the default 250,000 operations that is
//! 1,000,000 recorded effects. The executors' inventories hold what each would answer (key,
//! entity, attrs, undo) for every effect, plus injected drift: 10 leaked, 10 missing and 10
//! mismatched resources. Drift must find exactly those, or the run fails.
//!
//! Measured, each phase in a child process of this binary (`--phase`), so that each one's
//! peak memory (`VmHWM`) is its own:
//!
//! - `raw`: `read_all(1)` of the whole log, every commit decoded: the reference.
//! - `drift`: what `provledger drift` does with a data dir, less NATS: every operation
//!   commit folded by `fold_log` into a `DriftFold` (each operation reduced to its
//!   resources once it closes), `DriftFold::resources`, then
//!   each executor's inventory compared a page of 1,000 at a time (`Comparison`). Each
//!   inventory is generated in the child from the same deterministic recipe, one executor
//!   at a time, untimed (an executor's answer, not drift's work; it does count in the
//!   peak memory, as one executor's whole inventory, which the CLI never holds).
//! - `drift-nats`: the same, each inventory read and compared page by page with
//!   `compare_inventory` (what `provledger drift` and serve's sweep run) from executors
//!   this process (the parent) serves on a private nats-server.
//!
//! `--endless CLI [CLI ...]` measures something else (issue 35): each given `provledger`
//! binary running `drift --executor endless` against an executor whose inventory never
//! ends (every page 1,000 unknown items of ~250 bytes, always one more page), served by
//! this process on a private nats-server: its peak RSS (`/usr/bin/time`), its wall time and
//! its exit code, side by side, one binary after the other.
//!
//! Usage: `cargo run --release -p provledger-tests --bin drift-bench [-- --ops N]
//! [--no-nats]`, or `drift-bench --endless target/release/provledger [OLD/provledger]`. The NATS row needs `NATS_SERVER_BIN` (or `.tools/nats-server`).
//! Temp data goes under `DRIFT_BENCH_DIR` (default: the system temp dir).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_client::inventory::{
    compare_inventory, confirmed, fold_log, InventoryPage, InventoryRequest, LogFolded,
    INVENTORY_PAGE_ITEMS_MAX,
};
use provledger_events::catalogue::{
    Compensation, CompensationAction, DetailKey, Effect, EffectKind, Executor, OperationKind,
    Origin,
};
use provledger_events::{
    AggregateId, AtomicItem, CommitDraft, Event, EventLog, Expectation, SledLog, Timestamp,
    ATOMIC_COMMITS_MAX,
};
use provledger_projections::drift::{Comparison, DriftFold, FindingKind, InventoryItem};
use provledger_projections::stages::{stage, stages_of};
use serde_json::{json, Value};
use uuid::Uuid;

const USAGE: &str =
    "usage: drift-bench [--ops N] [--no-nats] | drift-bench --endless CLI [CLI ...]";
const OPS_DEFAULT: usize = 250_000;
/// Injected drift of each kind: ten findings per kind spread over the log needs ten
/// operations apart from one another by at least two.
const INJECTED_PER_KIND: usize = 10;
const OPS_MIN: usize = 2 * INJECTED_PER_KIND;
/// Atomic appends in flight during setup: the log's flusher gathers them into one flush.
const APPENDS_IN_FLIGHT: usize = 4;
const SUBJECT_PREFIX: &str = "provledger";
/// As `provledger drift` waits for one page; a page here takes milliseconds.
const INVENTORY_REPLY_WAIT: Duration = Duration::from_secs(30);
/// What a child prints before its one JSON result line, so progress can go anywhere else.
const RESULT_MARK: &str = "drift-bench-result ";

// Deterministic ids, UUID v7-shaped so that the operations sort in the order written.
const OPERATION_BASE: u128 = 0x0190_0000_0000_7000_8000_0000_0000_0000;
const NODE_BASE: u128 = 0x0190_0000_0001_7000_8000_0000_0000_0000;
const KEY_BASE: u128 = 0x0190_0000_0002_7000_8000_0000_0000_0000;
const LEAKED_BASE: u128 = 0x0190_0000_0003_7000_8000_0000_0000_0000;

/// One of the four executors of a boot: what it is asked and what it answers.
struct Role {
    executor: &'static str,
    /// The boot stage its step runs in.
    stage: &'static str,
    step: &'static str,
    effect: EffectKind,
    undo: CompensationAction,
    /// The executor's word for what it holds (its inventory's `kind`).
    item_kind: &'static str,
}

const ROLES: [Role; 4] = [
    Role {
        executor: "ipam",
        stage: stage::NETWORK,
        step: "acquire_ip",
        effect: EffectKind::IpAcquired,
        undo: CompensationAction::ReleaseIp,
        item_kind: "ip",
    },
    Role {
        executor: "dhcp",
        stage: stage::NETWORK,
        step: "register_dhcp",
        effect: EffectKind::DhcpRegistered,
        undo: CompensationAction::UnregisterDhcp,
        item_kind: "dhcp_entry",
    },
    Role {
        executor: "dns",
        stage: stage::NETWORK,
        step: "register_dns",
        effect: EffectKind::DnsRegistered,
        undo: CompensationAction::UnregisterDns,
        item_kind: "dns_record",
    },
    Role {
        executor: "hypervisor",
        stage: stage::SPAWN,
        step: "create_vm",
        effect: EffectKind::VmCreated,
        undo: CompensationAction::TerminateVm,
        item_kind: "vm",
    },
];
const IPAM: usize = 0;
const DHCP: usize = 1;

fn operation_id(op: usize) -> Uuid {
    Uuid::from_u128(OPERATION_BASE | op as u128)
}

fn node_of(op: usize) -> Uuid {
    Uuid::from_u128(NODE_BASE | op as u128)
}

/// The idempotency key the boot's client made effect `role` of operation `op` under.
fn key_of(op: usize, role: usize) -> String {
    Uuid::from_u128(KEY_BASE | (op * ROLES.len() + role) as u128).to_string()
}

/// `10.a.b.c` from the operation's number: unique below 16,777,216 operations.
fn ip_of(op: usize) -> String {
    format!("10.{}.{}.{}", (op >> 16) & 255, (op >> 8) & 255, op & 255)
}

/// The resource in its executor's terms, as the sim's boot names them.
fn resource_of(op: usize, role: usize) -> String {
    let node = node_of(op);
    match ROLES[role].executor {
        "ipam" => ip_of(op),
        "dhcp" => format!("node-{node}"),
        "dns" => format!("node-{node}.example"),
        _ => node.to_string(),
    }
}

/// The effect's detail, which is also what the executor reports as its item's attrs.
fn detail_of(op: usize, role: usize) -> BTreeMap<String, String> {
    let mut detail = BTreeMap::from([(DetailKey::Node.to_string(), node_of(op).to_string())]);
    if role == DHCP {
        detail.insert(DetailKey::Ip.to_string(), ip_of(op));
    }
    detail
}

fn compensation_of(op: usize, role: usize) -> Compensation {
    let r = &ROLES[role];
    Compensation {
        action: r.undo.clone(),
        executor: Executor::Service(r.executor.into()),
        resource: resource_of(op, role),
        args: BTreeMap::from([(DetailKey::IdempotencyKey.to_string(), key_of(op, role))]),
    }
}

/// The one commit of boot `op`: started, each step's intent then outcome, succeeded.
fn boot_events(op: usize) -> Vec<Event> {
    let node = node_of(op);
    let mut events = vec![Event::OperationStarted {
        kind: OperationKind::BootInstance,
        target: AggregateId::instance(node),
        parent_id: None,
        stages: stages_of(OperationKind::BootInstance),
        bundle_policy: None,
    }];
    let mut current_stage: Option<&str> = None;
    for (role, r) in ROLES.iter().enumerate() {
        if current_stage != Some(r.stage) {
            if let Some(done) = current_stage {
                events.push(Event::StageCompleted { stage: done.into() });
            }
            events.push(Event::StageStarted {
                stage: r.stage.into(),
            });
            current_stage = Some(r.stage);
        }
        let step = format!("{}:{node}", r.step);
        let compensation = compensation_of(op, role);
        events.push(Event::step_started(
            r.stage,
            &step,
            r.executor,
            key_of(op, role),
            Some(compensation.clone()),
        ));
        let effect = Effect {
            kind: r.effect.clone(),
            resource: resource_of(op, role),
            executor: r.executor.into(),
            origin: Origin::Created,
            detail: detail_of(op, role),
        };
        events.push(Event::step_done(r.stage, step, effect, Some(compensation)));
    }
    if let Some(done) = current_stage {
        events.push(Event::StageCompleted { stage: done.into() });
    }
    events.push(Event::OperationSucceeded {});
    events
}

// ---------------------------------------------------------------------------------------
// The executors' side, with the injected drift

/// Where drift is injected: the `k`th of each kind, at executor `k % 4`, on operations
/// spread over the log (a missing one at `k * stride`, a mismatched one just after).
struct Injected {
    ops: usize,
}

impl Injected {
    fn stride(&self) -> usize {
        self.ops / INJECTED_PER_KIND
    }

    fn missing(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..INJECTED_PER_KIND).map(|k| (k * self.stride(), k % ROLES.len()))
    }

    fn mismatched(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..INJECTED_PER_KIND).map(|k| (k * self.stride() + 1, k % ROLES.len()))
    }

    /// A resource made behind the ledger's back: half with a key no step recorded, half
    /// without a key (joined by name, and no name matches).
    fn leaked(&self) -> impl Iterator<Item = (usize, InventoryItem)> {
        (0..INJECTED_PER_KIND).map(|k| {
            let role = k % ROLES.len();
            let r = &ROLES[role];
            let stray = Uuid::from_u128(LEAKED_BASE | k as u128);
            let resource = match r.executor {
                "ipam" => format!("192.168.0.{k}"),
                "dhcp" => format!("node-{stray}"),
                "dns" => format!("node-{stray}.example"),
                _ => stray.to_string(),
            };
            let item = InventoryItem {
                kind: r.item_kind.into(),
                resource,
                key: (k % 2 == 0)
                    .then(|| Uuid::from_u128(LEAKED_BASE | 0xffff_0000 | k as u128).to_string()),
                entity: Some(stray.to_string()),
                attrs: BTreeMap::new(),
                undo: Some(r.undo.clone()),
            };
            (role, item)
        })
    }

    /// Changes a held item so that it disagrees with its record: IPAM holds another IP
    /// under the key, the others name another node.
    fn mismatch(item: &mut InventoryItem, role: usize, k_node: Uuid) {
        if role == IPAM {
            item.resource = format!(
                "172.16.{}.{}",
                (k_node.as_u128() >> 8) & 255,
                k_node.as_u128() & 255
            );
        } else {
            item.attrs
                .insert(DetailKey::Node.to_string(), k_node.to_string());
        }
    }

    /// The findings drift must report: (kind, executor, resource), and nothing else.
    fn expected(&self) -> BTreeSet<(FindingKind, String, String)> {
        let mut expected = BTreeSet::new();
        for (op, role) in self.missing() {
            expected.insert((
                FindingKind::Missing,
                ROLES[role].executor.to_string(),
                resource_of(op, role),
            ));
        }
        for (k, (op, role)) in self.mismatched().enumerate() {
            let mut item = held_item(op, role);
            Injected::mismatch(
                &mut item,
                role,
                Uuid::from_u128(LEAKED_BASE | 0x1_0000 | k as u128),
            );
            expected.insert((
                FindingKind::Mismatched,
                ROLES[role].executor.to_string(),
                item.resource,
            ));
        }
        for (role, item) in self.leaked() {
            expected.insert((
                FindingKind::Leaked,
                ROLES[role].executor.to_string(),
                item.resource,
            ));
        }
        expected
    }
}

/// What executor `role` answers it holds for effect `role` of operation `op`.
fn held_item(op: usize, role: usize) -> InventoryItem {
    let r = &ROLES[role];
    InventoryItem {
        kind: r.item_kind.into(),
        resource: resource_of(op, role),
        key: Some(key_of(op, role)),
        entity: Some(node_of(op).to_string()),
        attrs: detail_of(op, role),
        undo: Some(r.undo.clone()),
    }
}

/// Every executor's inventory, in `ROLES` order, each sorted by resource as the protocol
/// answers it.
fn inventories(ops: usize) -> Vec<Vec<InventoryItem>> {
    (0..ROLES.len())
        .map(|role| inventory_of(ops, role))
        .collect()
}

/// Executor `role`'s inventory, sorted by resource as the protocol answers it.
fn inventory_of(ops: usize, role: usize) -> Vec<InventoryItem> {
    let injected = Injected { ops };
    let missing: BTreeSet<(usize, usize)> = injected.missing().collect();
    let mismatched: BTreeMap<(usize, usize), usize> = injected
        .mismatched()
        .enumerate()
        .map(|(k, at)| (at, k))
        .collect();
    let mut items = Vec::with_capacity(ops);
    for op in 0..ops {
        if missing.contains(&(op, role)) {
            continue;
        }
        let mut item = held_item(op, role);
        if let Some(k) = mismatched.get(&(op, role)) {
            Injected::mismatch(
                &mut item,
                role,
                Uuid::from_u128(LEAKED_BASE | 0x1_0000 | *k as u128),
            );
        }
        items.push(item);
    }
    items.extend(
        injected
            .leaked()
            .filter(|(r, _)| *r == role)
            .map(|(_, item)| item),
    );
    items.sort_by(|a, b| a.resource.cmp(&b.resource));
    items
}

// ---------------------------------------------------------------------------------------
// Memory

/// A `kB` field of /proc/self/status (`VmHWM`: peak resident set), in MB.
fn status_mb(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb * 1024.0 / 1e6)
}

fn peak_rss_mb() -> f64 {
    status_mb("VmHWM:")
}

/// The heap this process's own allocations hold now, in MB (RSS also counts sled's page
/// cache and what the allocator keeps after frees).
fn live_heap_mb() -> f64 {
    LIVE_HEAP_BYTES.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e6
}

static LIVE_HEAP_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The system allocator, counting the bytes it holds for this process.
struct Counting;

// SAFETY: every call is passed to the system allocator unchanged; only a counter is kept.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        use std::sync::atomic::Ordering::Relaxed;
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if !p.is_null() {
            LIVE_HEAP_BYTES.fetch_add(layout.size(), Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        use std::sync::atomic::Ordering::Relaxed;
        // SAFETY: as for `alloc`.
        unsafe { std::alloc::System.dealloc(ptr, layout) };
        LIVE_HEAP_BYTES.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        use std::sync::atomic::Ordering::Relaxed;
        // SAFETY: as for `alloc`.
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new) };
        if !p.is_null() {
            LIVE_HEAP_BYTES.fetch_add(new, Relaxed);
            LIVE_HEAP_BYTES.fetch_sub(layout.size(), Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

// ---------------------------------------------------------------------------------------
// Setup

async fn write_log(dir: &Path, ops: usize) {
    let log = SledLog::open(dir).expect("open the bench's sled log");
    let started = Instant::now();
    let batches = (0..ops).step_by(ATOMIC_COMMITS_MAX).map(|first| {
        let log = log.clone();
        async move {
            let items: Vec<AtomicItem> = (first..(first + ATOMIC_COMMITS_MAX).min(ops))
                .map(|op| AtomicItem {
                    aggregate: AggregateId::operation(operation_id(op)),
                    expect: Expectation::NoStream,
                    draft: CommitDraft {
                        trace: None,
                        commit_id: Uuid::now_v7(),
                        operation_id: Some(operation_id(op)),
                        causation_id: None,
                        actor: "drift-bench".into(),
                        recorded_at: Timestamp::now(),
                        events: boot_events(op),
                    },
                })
                .collect();
            log.append_atomic(items)
                .await
                .expect("append a batch of boots");
        }
    });
    let mut pending = futures::stream::iter(batches).buffer_unordered(APPENDS_IN_FLIGHT);
    let mut written = 0usize;
    while pending.next().await.is_some() {
        written += ATOMIC_COMMITS_MAX;
        if written.is_multiple_of(25_000) {
            eprintln!(
                "setup: {written} / {ops} operations written ({:.0} s)",
                started.elapsed().as_secs_f64()
            );
        }
    }
    drop(pending);
    let end = log.last_position().await.expect("the log's end");
    assert_eq!(end, ops as u64, "one commit per operation");
    log.close();
}

// ---------------------------------------------------------------------------------------
// The phases (children)

/// `raw`: every commit read and decoded, nothing kept.
async fn phase_raw(dir: &Path) -> Value {
    let log = SledLog::open_existing(dir).expect("open the bench's log");
    let started = Instant::now();
    let mut stream = log.read_all(1).await.expect("read_all");
    let (mut commits, mut events) = (0u64, 0u64);
    while let Some(commit) = stream.next().await {
        let commit = commit.expect("every commit decodes");
        commits += 1;
        events += commit.events.len() as u64;
    }
    let secs = started.elapsed().as_secs_f64();
    json!({"secs": secs, "commits": commits, "events": events, "peak_mb": peak_rss_mb(),
        "heap_mb": live_heap_mb()})
}

/// `drift` / `drift-nats`: fold, the ledger's side, the inventories, compare; then checks
/// that the findings are exactly the injected drift.
async fn phase_drift(dir: &Path, ops: usize, nats: Option<&str>) -> Value {
    let log = SledLog::open_existing(dir).expect("open the bench's log");
    let started = Instant::now();
    // As `provledger drift` folds the log: each operation reduced once it closes.
    let mut fold = DriftFold::new();
    let mut done = LogFolded::default();
    let end = log.last_position().await.expect("the log's end");
    fold_log(&log, &mut fold, &mut done, end, |_| {})
        .await
        .expect("read the log");
    let fold_secs = started.elapsed().as_secs_f64();
    let fold_peak_mb = peak_rss_mb();
    let fold_heap_mb = live_heap_mb();
    assert_eq!(done.quarantined, 0, "the bench's commits all fold");
    assert_eq!(fold.counts(), (0, ops), "every boot closed and reduced");

    let t = Instant::now();
    let ledger = fold.resources();
    let ledger_secs = t.elapsed().as_secs_f64();
    let executors = ledger.executors();
    let expected_executors: BTreeSet<String> =
        ROLES.iter().map(|r| r.executor.to_string()).collect();
    assert_eq!(
        executors, expected_executors,
        "the executors the ledger names"
    );
    let ledger_peak_mb = peak_rss_mb();
    let ledger_heap_mb = live_heap_mb();

    // The inventories, compared a page at a time as `provledger drift` and serve's sweep
    // do (`Comparison`, `compare_inventory`): never held whole by the reader.
    let mut findings = Vec::new();
    let mut items = 0.0;
    let mut generate_secs = 0.0;
    let t = Instant::now();
    match nats {
        None => {
            for (role, r) in ROLES.iter().enumerate() {
                // Generating the executor's answer is not drift's work: not counted.
                let g = Instant::now();
                let inventory = inventory_of(ops, role);
                generate_secs += g.elapsed().as_secs_f64();
                let mut comparison = Comparison::new(&ledger, r.executor);
                for page in inventory.chunks(INVENTORY_PAGE_ITEMS_MAX as usize) {
                    findings.extend(comparison.items(page));
                }
                items += inventory.len() as f64;
                findings.extend(comparison.finish());
            }
        }
        Some(url) => {
            let client = async_nats::connect(url)
                .await
                .expect("connect to the bench's nats-server");
            // Confirmed against the same ledger, as the CLI confirms against the one it
            // reads after asking (nothing is appended meanwhile here).
            let mut asked = Vec::new();
            for r in &ROLES {
                let one = compare_inventory(
                    &client,
                    SUBJECT_PREFIX,
                    r.executor,
                    provledger_client::inventory::ReadBounds {
                        reply_wait: INVENTORY_REPLY_WAIT,
                        whole: provledger_client::inventory::INVENTORY_READ_MAX,
                    },
                    &ledger,
                    |n| items += n as f64,
                )
                .await;
                if let Err(e) = &one.held {
                    panic!("the inventory of {}: {e}", r.executor);
                }
                asked.push(one);
            }
            findings.extend(confirmed(&ledger, &asked));
        }
    }
    let compare_secs = t.elapsed().as_secs_f64() - generate_secs;
    let peak_mb = peak_rss_mb();

    let found: Vec<(FindingKind, String, String)> = findings
        .iter()
        .map(|f| (f.kind, f.executor.clone(), f.resource.clone()))
        .collect();
    let found_set: BTreeSet<_> = found.iter().cloned().collect();
    let expected = Injected { ops }.expected();
    if found.len() != found_set.len() || found_set != expected {
        eprintln!("drift found:    {found:?}");
        eprintln!("drift expected: {expected:?}");
        panic!(
            "drift found {} findings, not exactly the {} injected",
            found.len(),
            expected.len()
        );
    }
    let count = |kind| found.iter().filter(|f| f.0 == kind).count();
    json!({
        "fold_secs": fold_secs, "ledger_secs": ledger_secs, "read_secs": 0.0,
        "compare_secs": compare_secs,
        "fold_peak_mb": fold_peak_mb, "ledger_peak_mb": ledger_peak_mb, "peak_mb": peak_mb,
        "fold_heap_mb": fold_heap_mb, "ledger_heap_mb": ledger_heap_mb,
        "items": items,
        "leaked": count(FindingKind::Leaked), "missing": count(FindingKind::Missing),
        "mismatched": count(FindingKind::Mismatched),
    })
}

// ---------------------------------------------------------------------------------------
// The executors over NATS (in the parent, while a child reads)

/// Answers `<prefix>.exec.<executor>.inventory` for each executor from `held`, a page of
/// at most `limit` items after `after` at a time. Subscribed before it returns, so that a
/// reader started afterwards finds every executor.
async fn start_executors(
    client: async_nats::Client,
    held: Vec<Vec<InventoryItem>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut executors = Vec::new();
    for (r, items) in ROLES.iter().zip(held) {
        let subject = provledger_client::inventory::inventory_subject(SUBJECT_PREFIX, r.executor);
        let mut requests = client.subscribe(subject).await.expect("subscribe");
        let client = client.clone();
        executors.push(tokio::spawn(async move {
            while let Some(message) = requests.next().await {
                let Some(reply) = message.reply else { continue };
                // A request that does not parse is read as the first page: this executor
                // only ever answers the bench's own reader.
                let request: InventoryRequest =
                    serde_json::from_slice(&message.payload).unwrap_or_default();
                let from = match &request.after {
                    Some(after) => items.partition_point(|i| i.resource.as_str() <= after.as_str()),
                    None => 0,
                };
                let to = (from + request.page_items()).min(items.len());
                let page = InventoryPage {
                    items: items[from..to].to_vec(),
                    next: (to < items.len()).then(|| items[to - 1].resource.clone()),
                };
                let body = serde_json::to_vec(&page).expect("a page serializes");
                client
                    .publish(reply, body.into())
                    .await
                    .expect("publish a page");
            }
        }));
    }
    client
        .flush()
        .await
        .expect("the subscriptions reach the server");
    executors
}

// ---------------------------------------------------------------------------------------
// The parent

struct Options {
    ops: usize,
    nats: bool,
    phase: Option<String>,
    dir: Option<PathBuf>,
    nats_url: Option<String>,
    endless: Vec<PathBuf>,
}

fn parse_options() -> Options {
    let fail = |message: String| -> ! {
        eprintln!("{message}\n{USAGE}");
        std::process::exit(2)
    };
    let mut o = Options {
        ops: OPS_DEFAULT,
        nats: true,
        phase: None,
        dir: None,
        nats_url: None,
        endless: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ops" => {
                o.ops = match args.next().map(|v| v.replace('_', "").parse::<usize>()) {
                    Some(Ok(n)) if n >= OPS_MIN => n,
                    _ => fail(format!("--ops takes a number of operations >= {OPS_MIN}")),
                }
            }
            "--no-nats" => o.nats = false,
            // The child's side: which phase, on which log, against which server.
            "--phase" => o.phase = args.next(),
            "--dir" => o.dir = args.next().map(PathBuf::from),
            "--nats-url" => o.nats_url = args.next(),
            "--endless" => {
                o.endless = args.by_ref().map(PathBuf::from).collect();
                if o.endless.is_empty() {
                    fail("--endless takes one or more provledger binaries".into())
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            other => fail(format!("unknown argument {other}")),
        }
    }
    o
}

/// Runs `--phase phase` in a child of this binary and returns its result line.
async fn child(phase: &str, dir: &Path, ops: usize, nats_url: Option<&str>) -> Value {
    let exe = std::env::current_exe().expect("this binary's path");
    let mut command = tokio::process::Command::new(exe);
    command
        .args(["--phase", phase, "--ops", &ops.to_string(), "--dir"])
        .arg(dir)
        .stderr(std::process::Stdio::inherit());
    if let Some(url) = nats_url {
        command.args(["--nats-url", url]);
    }
    eprintln!("phase {phase} ...");
    let output = command.output().await.expect("run a phase");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "phase {phase} failed ({}): {stdout}",
        output.status
    );
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(RESULT_MARK))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("phase {phase} printed no result: {stdout}"))
}

fn num(v: &Value, field: &str) -> f64 {
    v[field]
        .as_f64()
        .unwrap_or_else(|| panic!("a phase's result has no {field}: {v}"))
}

fn machine() -> String {
    let cpu = provledger_tests::cpu_model();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cores} cores ({cpu})")
}

/// `1.20M what/s`, `850k what/s`.
fn per_second(count: f64, secs: f64, what: &str) -> String {
    let rate = count / secs;
    if rate >= 1e6 {
        format!("{:.2}M {what}/s", rate / 1e6)
    } else {
        format!("{:.0}k {what}/s", rate / 1e3)
    }
}

/// `1,000,030`.
fn thousands(n: f64) -> String {
    let digits = format!("{:.0}", n);
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn seconds(secs: f64) -> String {
    if secs < 1.0 {
        format!("{:.0} ms", secs * 1e3)
    } else {
        format!("{secs:.2} s")
    }
}

struct Row {
    phase: String,
    secs: f64,
    rate: String,
    /// The process's peak RSS at the end of this phase; `None` where it says nothing new.
    peak_mb: Option<f64>,
    /// The heap the process's allocations held at the end of this phase.
    heap_mb: Option<f64>,
}

fn drift_rows(label: &str, d: &Value, effects: f64) -> Vec<Row> {
    let (fold, ledger, read, cmp) = (
        num(d, "fold_secs"),
        num(d, "ledger_secs"),
        num(d, "read_secs"),
        num(d, "compare_secs"),
    );
    let items = num(d, "items");
    let mut rows = vec![
        Row {
            phase: format!("{label}: DriftFold over the log (fold_log)"),
            secs: fold,
            rate: per_second(effects, fold, "effects"),
            peak_mb: Some(num(d, "fold_peak_mb")),
            heap_mb: Some(num(d, "fold_heap_mb")),
        },
        Row {
            phase: format!("{label}: DriftFold::resources"),
            secs: ledger,
            rate: per_second(effects, ledger, "effects"),
            peak_mb: Some(num(d, "ledger_peak_mb")),
            heap_mb: Some(num(d, "ledger_heap_mb")),
        },
    ];
    if read > 0.0 {
        rows.push(Row {
            phase: format!("{label}: read_inventory ×4 (pages of 1,000)"),
            secs: read,
            rate: per_second(items, read, "items"),
            peak_mb: None,
            heap_mb: None,
        });
    }
    rows.push(Row {
        phase: format!(
            "{label}: inventories compared page by page ×4 ({} items)",
            thousands(items)
        ),
        secs: cmp,
        rate: per_second(items, cmp, "items"),
        peak_mb: None,
        heap_mb: None,
    });
    let total = fold + ledger + read + cmp;
    rows.push(Row {
        phase: format!("**{label}: total**"),
        secs: total,
        rate: per_second(effects, total, "effects"),
        peak_mb: Some(num(d, "peak_mb")),
        heap_mb: None,
    });
    rows
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = parse_options();
    if !o.endless.is_empty() {
        return endless(&o.endless).await;
    }
    if let Some(phase) = &o.phase {
        let dir = o
            .dir
            .as_deref()
            .unwrap_or_else(|| panic!("--phase needs --dir"));
        let result = match phase.as_str() {
            "raw" => phase_raw(dir).await,
            "drift" => phase_drift(dir, o.ops, None).await,
            "drift-nats" => {
                let url = o
                    .nats_url
                    .as_deref()
                    .expect("--phase drift-nats needs --nats-url");
                phase_drift(dir, o.ops, Some(url)).await
            }
            other => panic!("unknown phase {other}"),
        };
        println!("{RESULT_MARK}{result}");
        return;
    }

    let effects = (o.ops * ROLES.len()) as f64;
    let temp = match std::env::var_os("DRIFT_BENCH_DIR") {
        Some(parent) => tempfile::tempdir_in(parent),
        None => tempfile::tempdir(),
    }
    .expect("a temp dir for the log");
    let dir = temp.path().join("data");
    let started = Instant::now();
    write_log(&dir, o.ops).await;
    let setup_secs = started.elapsed().as_secs_f64();
    let on_disk_mb = sled_size_mb(&dir);

    let raw = child("raw", &dir, o.ops, None).await;
    let drift = child("drift", &dir, o.ops, None).await;
    let over_nats = match o.nats {
        true => Some(drift_over_nats(&dir, o.ops).await),
        false => None,
    };

    let raw_secs = num(&raw, "secs");
    let raw_peak = num(&raw, "peak_mb");
    let events = num(&raw, "events");
    let mut rows = vec![Row {
        phase: "**raw: read_all(1), every commit decoded**".into(),
        secs: raw_secs,
        rate: per_second(events, raw_secs, "events"),
        peak_mb: Some(raw_peak),
        heap_mb: Some(num(&raw, "heap_mb")),
    }];
    rows.extend(drift_rows("drift", &drift, effects));
    if let Some(d) = &over_nats {
        rows.extend(drift_rows("drift over NATS", d, effects));
    }

    println!("# drift-bench --ops {}", o.ops);
    println!();
    println!("- machine: {}", machine());
    println!(
        "- log: {} operations, one commit each ({} events, {} recorded effects at 4 executors), sled {on_disk_mb:.0} MB on disk; setup (append_atomic, {} commits per batch) took {:.1} s",
        thousands(o.ops as f64), thousands(events), thousands(effects), ATOMIC_COMMITS_MAX, setup_secs
    );
    println!(
        "- inventories: {} items (4 × {} recorded, less {INJECTED_PER_KIND} made missing, {INJECTED_PER_KIND} made mismatched, plus {INJECTED_PER_KIND} leaked); drift found exactly the injected ones: leaked {}, missing {}, mismatched {}",
        thousands(num(&drift, "items")),
        thousands(o.ops as f64),
        num(&drift, "leaked"),
        num(&drift, "missing"),
        num(&drift, "mismatched"),
    );
    println!();
    println!("| phase | time | rate | time / raw | peak RSS | peak RSS / raw | live heap |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for row in &rows {
        let (peak, peak_ratio) = match row.peak_mb {
            Some(mb) => (format!("{mb:.0} MB"), format!("{:.1}×", mb / raw_peak)),
            None => ("".into(), "".into()),
        };
        let heap = row
            .heap_mb
            .map(|mb| format!("{mb:.0} MB"))
            .unwrap_or_default();
        println!(
            "| {} | {} | {} | {:.1}× | {peak} | {peak_ratio} | {heap} |",
            row.phase,
            seconds(row.secs),
            row.rate,
            row.secs / raw_secs,
        );
    }
    println!();
    println!("Each row group is one child process; a sub-phase's peak RSS is that process's VmHWM when the sub-phase ended (so far), the total's at its end. Live heap: the bytes its own allocations held at the end of the sub-phase (RSS also counts sled's page cache and what the allocator keeps after frees).");
}

/// An executor named `endless` whose inventory never ends: every page 1,000 items no
/// operation made, each ~250 bytes, and always a next page.
async fn endless_executor(client: async_nats::Client) {
    let mut requests = client
        .subscribe("provledger.exec.endless.inventory")
        .await
        .expect("subscribe");
    let mut page = 0u64;
    while let Some(request) = requests.next().await {
        page += 1;
        let items: Vec<Value> = (0..1_000)
            .map(|i| {
                json!({"kind": "ip", "resource": format!("10.{page}.{i}.{}", "x".repeat(200)),
                       "key": format!("unknown-{page}-{i}")})
            })
            .collect();
        let reply = json!({"items": items, "next": format!("{page:012}")});
        if let Some(to) = request.reply {
            let _ = client.publish(to, reply.to_string().into()).await;
        }
    }
}

/// `--endless`: each binary's `drift --executor endless`, its peak RSS and wall time.
async fn endless(binaries: &[PathBuf]) {
    let nats = provledger_tests::NatsServer::start().await;
    // The stream exists (drift reads the ledger first).
    let log = provledger_events::JetStreamLog::open(
        nats.client().await,
        provledger_events::JetStreamConfig::default(),
    )
    .await
    .expect("the stream");
    drop(log);
    let executor = tokio::spawn(endless_executor(nats.client().await));
    println!("| binary | exit | wall time | peak RSS | what it says of `endless` |");
    println!("|---|---:|---:|---:|---|");
    for binary in binaries {
        let out = tokio::process::Command::new("/usr/bin/time")
            .args(["-f", "%M %e"])
            .arg(binary)
            .args([
                "--nats",
                &nats.url(),
                "--json",
                "drift",
                "--executor",
                "endless",
            ])
            .output()
            .await
            .expect("run /usr/bin/time");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().last().unwrap_or_default().to_string();
        let mut parts = last.split_whitespace();
        let kb: f64 = parts
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        let secs: f64 = parts
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        let report: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let said = report["executors"]
            .as_array()
            .and_then(|e| e.first())
            .map_or_else(
                || stderr.lines().next().unwrap_or_default().to_string(),
                Value::to_string,
            );
        let said: String = said.chars().take(160).collect();
        println!(
            "| {} | {} | {secs:.1} s | {:.0} MiB | {} |",
            binary.display(),
            out.status.code().map_or("signal".into(), |c| c.to_string()),
            kb / 1024.0,
            said.replace('|', "/")
        );
    }
    executor.abort();
}

/// `drift-nats`: a private nats-server, the four executors answering from the parent.
async fn drift_over_nats(dir: &Path, ops: usize) -> Value {
    let nats = provledger_tests::NatsServer::start().await;
    let held = inventories(ops);
    let executors = start_executors(nats.client().await, held).await;
    let result = child("drift-nats", dir, ops, Some(&nats.url())).await;
    for executor in executors {
        executor.abort();
    }
    result
}

fn sled_size_mb(dir: &Path) -> f64 {
    fn walk(p: &Path) -> u64 {
        match std::fs::read_dir(p) {
            Ok(entries) => entries
                .filter_map(Result::ok)
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => walk(&e.path()),
                    Ok(m) => m.len(),
                    Err(_) => 0,
                })
                .sum(),
            Err(_) => 0,
        }
    }
    walk(dir) as f64 / 1e6
}
