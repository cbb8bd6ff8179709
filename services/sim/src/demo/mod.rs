//! The scenarios `provledger demo` runs: a cluster created by the reference flow (with a
//! stale claim refused and a retried commit recognised), a create that fails and rolls back,
//! a scale failing in each of its three stages, and a delete arriving while a create
//! configures its nodes.
//!
//! It runs embedded in a fresh data dir ([`run`]), or on a log it is given ([`run_on`]: the
//! JetStream stream a `provledger serve` consumes), which may hold other commits, earlier
//! demos' among them. There its ids are random (every run makes new aggregates, so it can
//! run twice on one stream) and it reports only the aggregates whose ids it minted.
//!
//! Each scenario has its own simulated executors (in this process) and compute node, so what
//! remained afterwards is that scenario's alone. Embedded, ids come from one seeded id
//! source and cancel notices are delivered in process before the next step, so every run
//! writes the same number of commits and ends with the same counts. This module only runs
//! and reports; printing is the CLI's.

mod names;
mod scenarios;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use provledger_projections::drift::{compare, recorded_resources, Finding, InventoryItem};
use provledger_projections::Projection;

use crate::SimInfrastructure;

use provledger_client::{IdSource, Ledger, RandomIds, SeededIds, Stamper, SystemClock};
use provledger_events::catalogue::RollbackPlan;
use provledger_events::{verify_chain, AggregateId, Commit, EventLog, SledLog, Timestamp};
use uuid::Uuid;

pub use names::{short, wrap, Names, LINE_COLUMNS_MAX};

/// The seed of the embedded demo's id source: the same seed, the same id tails every run.
pub const DEMO_SEED: u64 = 0x5EED_0001;

/// The most ids one run may mint (aggregates and commits): one run mints a few hundred, so
/// more is a bug in the scenarios, not a bigger demo.
const DEMO_IDS_MAX: usize = 100_000;

/// Why the demo could not run to its end.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("cannot open the demo's data dir {dir}: {reason}")]
    DataDir { dir: PathBuf, reason: String },
    #[error("scenario {scenario:?}: {reason}")]
    Scenario { scenario: String, reason: String },
    #[error("reading the demo's log back: {0}")]
    ReadBack(String),
}

/// What one operation of a scenario ended as.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OperationOutcome {
    pub id: Uuid,
    /// Its kind and short id (`create_cluster 71eec13912d3`), as the CLI prints ids.
    pub label: String,
    pub kind: String,
    pub status: String,
    /// The recorded rollback plan, rendered, if the operation was rolled back.
    pub plan: Option<String>,
    /// The same plan, for a summary (the JSON report carries it rendered, in `plan`).
    #[serde(skip)]
    pub rollback_plan: Option<RollbackPlan>,
    /// Where and why the operation failed, if it did.
    pub failure: Option<String>,
}

/// What remained after a scenario.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Afterwards {
    pub cluster: AggregateId,
    pub cluster_label: String,
    pub status: String,
    pub description: String,
    pub members: usize,
    /// Resources the scenario's executors still hold, by executor.
    pub executors: BTreeMap<String, usize>,
    /// Resources still held at an executor that belong to a node the scenario removed
    /// (its VM, IP, DHCP or DNS entry, or its plugin record). Empty when removal is clean.
    pub left_of_removed_nodes: Vec<String>,
}

/// One scenario, ready to print.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScenarioReport {
    pub title: String,
    /// Whether this scenario shows a failure (numbered "failure scenario N" when printed).
    pub failure: bool,
    /// The commits the scenario wrote, in log order.
    pub commits: Vec<Commit>,
    pub operations: Vec<OperationOutcome>,
    pub notes: Vec<String>,
    pub afterwards: Afterwards,
}

/// The whole demo.
#[derive(Debug, serde::Serialize)]
pub struct DemoReport {
    /// The fresh data dir it ran in ([`run`]); empty when it ran on a log it was given
    /// ([`run_on`]). A path, not an `Option`, because tests and benchmarks open it as is.
    pub data_dir: PathBuf,
    /// Where the log ended before the demo wrote (0 in a fresh data dir).
    pub start_position: u64,
    pub scenarios: Vec<ScenarioReport>,
    /// The commits the demo wrote, and on how many aggregates (its own only).
    pub commits: usize,
    pub aggregates: usize,
    /// Hash-chain violations on the demo's aggregates, as read back.
    pub chain_violations: Vec<String>,
    /// Drift at the end: what every scenario's executors hold (together) against what
    /// the log records (`provledger drift`'s comparison). Empty when the demo is clean.
    pub drift: Vec<Finding>,
    /// How many resources the executors hold at the end, all scenarios together.
    pub held: usize,
    /// Labels of every aggregate, for printing.
    #[serde(skip)]
    pub names: Names,
}

impl DemoReport {
    /// The first scenario's cluster.
    pub fn first_cluster(&self) -> Option<AggregateId> {
        self.scenarios.first().map(|s| s.afterwards.cluster)
    }

    /// The first operation that was rolled back, and its scenario: what the closing
    /// commands show how to look at.
    pub fn first_rolled_back(&self) -> Option<(&ScenarioReport, &OperationOutcome)> {
        self.scenarios.iter().find_map(|s| {
            s.operations
                .iter()
                .find(|op| op.status == "rolled_back")
                .map(|op| (s, op))
        })
    }
}

/// The ids one run mints, kept so that its own aggregates can be told from other writers'
/// in a log it shares with them.
pub(crate) struct Minted {
    source: Box<dyn IdSource>,
    ids: Mutex<HashSet<Uuid>>,
}

impl Minted {
    fn new(source: Box<dyn IdSource>) -> Minted {
        Minted {
            source,
            ids: Mutex::new(HashSet::new()),
        }
    }

    /// Whether this run minted `id`.
    pub(crate) fn contains(&self, id: &Uuid) -> bool {
        self.ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }
}

impl IdSource for Minted {
    fn next_id(&self, at: Timestamp) -> Uuid {
        let id = self.source.next_id(at);
        let mut ids = self.ids.lock().unwrap_or_else(|p| p.into_inner());
        assert!(
            ids.len() < DEMO_IDS_MAX,
            "the demo minted {} ids, more than DEMO_IDS_MAX",
            ids.len()
        );
        assert!(ids.insert(id), "the demo's id source minted {id} twice");
        id
    }
}

/// Runs every scenario in a fresh `demo-<id>` directory under `base_dir`, with ids from
/// the seeded source, then reads the log back and checks every hash chain.
pub async fn run(base_dir: &Path) -> Result<DemoReport, DemoError> {
    let dir = base_dir.join(format!("demo-{}", Uuid::now_v7()));
    let log = SledLog::open(&dir).map_err(|e| DemoError::DataDir {
        dir: dir.clone(),
        reason: e.to_string(),
    })?;
    let ledger = Ledger::Embedded(log);
    let minted = Arc::new(Minted::new(Box::new(SeededIds::new(DEMO_SEED))));
    let result = run_in(&ledger, minted, Some(dir)).await;
    ledger.close();
    result
}

/// Runs every scenario on `ledger`, which may hold other commits (a JetStream stream that
/// `provledger serve` consumes), with random ids, so that every run makes new aggregates;
/// then reads back and checks what it wrote, and only that. The ledger stays open.
pub async fn run_on(ledger: &Ledger) -> Result<DemoReport, DemoError> {
    let minted = Arc::new(Minted::new(Box::new(RandomIds)));
    run_in(ledger, minted, None).await
}

async fn run_in(
    ledger: &Ledger,
    minted: Arc<Minted>,
    data_dir: Option<PathBuf>,
) -> Result<DemoReport, DemoError> {
    let read_back = |e: &dyn std::fmt::Display| DemoError::ReadBack(e.to_string());
    let start_position = ledger.last_position().await.map_err(|e| read_back(&e))?;
    let stamper = Stamper::new(Arc::new(SystemClock), minted.clone());
    let (mut scenarios, infras) = scenarios::run_all(ledger, &stamper, &minted).await?;
    let commits = scenarios::commits_of(ledger, start_position, &minted)
        .await
        .map_err(|e| read_back(&e))?;
    if data_dir.is_some() {
        // A fresh data dir holds the demo's commits and nothing else.
        let end = ledger.last_position().await.map_err(|e| read_back(&e))?;
        if commits.len() as u64 != end {
            return Err(DemoError::ReadBack(format!(
                "the demo's data dir holds {end} commits, of which {} are on aggregates the \
                 demo made",
                commits.len()
            )));
        }
    }
    let mut names = Names::default();
    for c in &commits {
        names.learn(c);
    }
    for s in &mut scenarios {
        s.afterwards.cluster_label = names.label(&s.afterwards.cluster.id);
        for op in &mut s.operations {
            op.label = names.label(&op.id);
        }
    }
    let aggregates: BTreeSet<AggregateId> = commits.iter().map(|c| c.aggregate).collect();
    let mut chain_violations = Vec::new();
    for agg in &aggregates {
        let chain = ledger
            .read_aggregate(*agg)
            .await
            .map_err(|e| read_back(&e))?;
        chain_violations.extend(verify_chain(agg, &chain).iter().map(|v| v.to_string()));
    }
    let (drift, held) = drift_at_end(&commits, &infras);
    Ok(DemoReport {
        data_dir: data_dir.unwrap_or_default(),
        start_position,
        scenarios,
        commits: commits.len(),
        aggregates: aggregates.len(),
        chain_violations,
        drift,
        held,
        names,
    })
}

/// The executors of every scenario, taken together (the scenarios share executor names,
/// as one deployment's services would), compared with the log's operations; and how
/// many resources they hold.
fn drift_at_end(commits: &[Commit], infras: &[Arc<SimInfrastructure>]) -> (Vec<Finding>, usize) {
    let projection = Projection::rebuild(commits);
    let ledger = recorded_resources(projection.operations());
    let mut held: BTreeMap<String, Vec<InventoryItem>> = BTreeMap::new();
    for infra in infras {
        for executor in infra.all() {
            held.entry(executor.name().to_string())
                .or_default()
                .extend(executor.held_items());
        }
    }
    let count = held.values().map(Vec::len).sum();
    let names: BTreeSet<String> = ledger
        .executors()
        .into_iter()
        .chain(held.keys().cloned())
        .collect();
    let mut findings = Vec::new();
    for executor in &names {
        let items = held.get(executor).map(Vec::as_slice).unwrap_or(&[]);
        findings.extend(compare(&ledger, executor, items));
    }
    (findings, count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::MemLog;

    #[tokio::test]
    async fn run_twice_on_one_log_the_demo_makes_new_aggregates_and_reports_its_own() {
        // Given a log the demo already ran on (as a shared stream would be),
        let ledger = Ledger::Memory(MemLog::new());
        let first = run_on(&ledger).await.expect("the first run");
        // when it runs on it again,
        let second = run_on(&ledger).await.expect("the second run");
        // then the second run starts where the first ended, writes as many commits on as
        // many aggregates, none of them the first run's, and its chains are whole;
        assert_eq!(second.start_position, first.commits as u64);
        assert_eq!(
            (second.commits, second.aggregates),
            (first.commits, first.aggregates)
        );
        let aggregates = |r: &DemoReport| -> BTreeSet<AggregateId> {
            r.scenarios
                .iter()
                .flat_map(|s| s.commits.iter().map(|c| c.aggregate))
                .collect()
        };
        assert!(aggregates(&first).is_disjoint(&aggregates(&second)));
        // (short ids too, which is what people type: a seeded source would repeat them)
        let shorts = |r: &DemoReport| -> BTreeSet<String> {
            aggregates(r).iter().map(|a| short(&a.id)).collect()
        };
        assert!(shorts(&first).is_disjoint(&shorts(&second)));
        assert!(
            second.chain_violations.is_empty(),
            "{:?}",
            second.chain_violations
        );
        assert!(second.drift.is_empty(), "{:?}", second.drift);
        // and each operation is labelled by its kind and short id, as the CLI prints ids.
        for op in second.scenarios.iter().flat_map(|s| &s.operations) {
            assert_eq!(op.label, format!("{} {}", op.kind, short(&op.id)));
        }
    }
}
