//! The scenarios `provledger demo` runs, embedded, in a fresh data dir: a cluster created
//! by the reference flow (with a stale claim refused and a retried commit recognised), a
//! create that fails and rolls back, a scale failing in each of its three stages, and a
//! delete arriving while a create configures its nodes.
//!
//! Each scenario has its own simulated executors and compute node, so what remained
//! afterwards is that scenario's alone. Ids come from one seeded id source and cancel
//! notices are delivered in process before the next step, so every run writes the same
//! number of commits and ends with the same counts. This module only runs and reports;
//! printing is the CLI's.

mod names;
mod scenarios;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use provledger_projections::drift::{compare, recorded_resources, Finding, InventoryItem};
use provledger_projections::Projection;

use crate::SimInfrastructure;

use futures::StreamExt;
use provledger_events::catalogue::RollbackPlan;
use provledger_events::{verify_chain, AggregateId, Commit, EventLog, SledLog};
use uuid::Uuid;

pub use names::{short, wrap, Names, LINE_COLUMNS_MAX};

/// The seed of the demo's id source: the same seed, the same id tails every run.
pub const DEMO_SEED: u64 = 0x5EED_0001;

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
    pub data_dir: PathBuf,
    pub scenarios: Vec<ScenarioReport>,
    pub commits: usize,
    pub aggregates: usize,
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
    /// The first scenario's cluster: what the closing hint shows how to inspect.
    pub fn first_cluster(&self) -> Option<AggregateId> {
        self.scenarios.first().map(|s| s.afterwards.cluster)
    }
}

/// Runs every scenario in a fresh `demo-<id>` directory under `base_dir`, then reads the
/// log back and checks every hash chain.
pub async fn run(base_dir: &Path) -> Result<DemoReport, DemoError> {
    let dir = base_dir.join(format!("demo-{}", Uuid::now_v7()));
    let log = SledLog::open(&dir).map_err(|e| DemoError::DataDir {
        dir: dir.clone(),
        reason: e.to_string(),
    })?;
    let result = run_in(&log, dir).await;
    log.close();
    result
}

async fn run_in(log: &SledLog, dir: PathBuf) -> Result<DemoReport, DemoError> {
    let (mut scenarios, infras) = scenarios::run_all(log).await?;
    let read_back = |e: &dyn std::fmt::Display| DemoError::ReadBack(e.to_string());
    let mut commits: Vec<Commit> = Vec::new();
    let mut stream = log.read_all(1).await.map_err(|e| read_back(&e))?;
    while let Some(c) = stream.next().await {
        commits.push(c.map_err(|e| read_back(&e))?);
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
        let chain = log.read_aggregate(*agg).await.map_err(|e| read_back(&e))?;
        chain_violations.extend(verify_chain(agg, &chain).iter().map(|v| v.to_string()));
    }
    let (drift, held) = drift_at_end(&commits, &infras);
    Ok(DemoReport {
        data_dir: dir,
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
