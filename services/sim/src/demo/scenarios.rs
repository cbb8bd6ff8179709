//! The demo's scenarios, each on its own simulated executors and compute node.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use provledger_client::{
    deletion, CancelNotices, Ledger, OperationRunner, RollbackDriver, Stamper, StepHook, Writer,
};
use provledger_events::catalogue::{ConsumerKind, NodeGroupSpec};
use provledger_events::{
    AggregateId, AppendError, AppendStatus, Commit, Event, EventLog, Expectation,
};
use provledger_projections::planner::render_plan;
use provledger_projections::rollback::RetryPolicy;
use provledger_projections::stages::stage;
use provledger_projections::Entity;
use uuid::Uuid;

use super::{Afterwards, DemoError, Minted, OperationOutcome, ScenarioReport};
use crate::executors::{SimExecutor, SimInfrastructure, HYPERVISOR, PLUGIN};
use crate::flows::{register_compute_node, ClusterRequest, Provisioner};

const ACTOR: &str = "demo";
/// VCPUs of each scenario's compute node: room for every node a scenario makes.
const NODE_VCPUS: u64 = 64;

/// A failure to inject before a scale: (executor, action, the failing call).
type Fault = (&'static str, &'static str, u32);

/// One scenario's world: its executors, its compute node and its provisioning service.
struct World {
    ledger: Writer<Ledger>,
    infra: Arc<SimInfrastructure>,
    prov: Provisioner,
    provider: Uuid,
    /// When set, the user deletes this cluster as its create reaches this stage.
    delete_at: Arc<Mutex<Option<(Uuid, String)>>>,
    /// Where the log ended before the scenario began.
    start: u64,
    /// The ids of this demo run: its aggregates are those, whatever else the log holds.
    minted: Arc<Minted>,
}

fn failed(scenario: &str) -> impl Fn(String) -> DemoError + '_ {
    move |reason| DemoError::Scenario {
        scenario: scenario.to_string(),
        reason,
    }
}

fn workers(count: u32) -> NodeGroupSpec {
    NodeGroupSpec {
        name: "workers".into(),
        count,
        flavor: "m1.large".into(),
        resources: BTreeMap::from([("VCPU".to_string(), 2)]),
        processes: vec!["datanode".into(), "nodemanager".into()],
    }
}

/// The step hook through which the demo's user deletes a cluster mid-create.
fn delete_hook(
    ledger: &Writer<Ledger>,
    notices: &CancelNotices,
    stamper: &Stamper,
    delete_at: &Arc<Mutex<Option<(Uuid, String)>>>,
) -> StepHook {
    let (ledger, notices, stamper, delete_at) = (
        ledger.clone(),
        notices.clone(),
        stamper.clone(),
        delete_at.clone(),
    );
    Arc::new(move |_op, stage, _step| {
        let fire = {
            let mut at = delete_at.lock().unwrap_or_else(|p| p.into_inner());
            match at.take() {
                Some((cluster, s)) if s == stage => Some(cluster),
                other => {
                    *at = other;
                    None
                }
            }
        };
        let (ledger, notices, stamper) = (ledger.clone(), notices.clone(), stamper.clone());
        Box::pin(async move {
            if let Some(cluster) = fire {
                let target = AggregateId::cluster(cluster);
                let reason = "the user deleted the cluster while it was being configured";
                if let Err(e) =
                    deletion::request_delete(&ledger, &notices, target, reason, "user", &stamper)
                        .await
                {
                    tracing::warn!(error = %e, "demo delete request failed");
                }
            }
        })
    })
}

async fn world(
    log: &Ledger,
    stamper: &Stamper,
    minted: &Arc<Minted>,
    node: &str,
) -> Result<World, String> {
    let ledger = Writer::new(log.clone());
    let start = log.last_position().await.map_err(|e| e.to_string())?;
    let infra = Arc::new(SimInfrastructure::default());
    let notices = CancelNotices::local();
    // Short backoffs: the demo's compensations do not fail, but a person waits for it.
    let policy = RetryPolicy {
        backoff_base_ms: 10,
        backoff_max_ms: 100,
        ..RetryPolicy::default()
    };
    let driver = RollbackDriver::new(ledger.clone(), infra.clone(), policy, ACTOR)
        .with_stamper(stamper.clone());
    let delete_at = Arc::new(Mutex::new(None));
    let hook = delete_hook(&ledger, &notices, stamper, &delete_at);
    let runner = OperationRunner::new(ledger.clone(), notices, Some(Arc::new(driver)), ACTOR)
        .with_stamper(stamper.clone())
        .with_step_hook(hook);
    let prov = Provisioner::new(runner, infra.clone(), ACTOR);
    let provider = stamper.id();
    register_compute_node(&ledger, provider, node, NODE_VCPUS, ACTOR)
        .await
        .map_err(|e| e.to_string())?;
    Ok(World {
        ledger,
        infra,
        prov,
        provider,
        delete_at,
        start,
        minted: minted.clone(),
    })
}

impl World {
    fn request(&self, name: &str, nodes: u32) -> ClusterRequest {
        ClusterRequest {
            cluster_id: self.prov.runner.stamper().id(),
            name: name.into(),
            plugin: "vanilla".into(),
            node_groups: vec![workers(nodes)],
            provider: self.provider,
        }
    }

    async fn active_cluster(&self, name: &str) -> Result<(Uuid, Vec<Uuid>, Uuid), String> {
        let request = self.request(name, 3);
        let report = self.prov.create_cluster(request.clone()).await;
        let nodes = report.result.map_err(|e| e.to_string())?;
        Ok((request.cluster_id, nodes, report.operation_id))
    }

    async fn commits_since_start(&self) -> Result<Vec<Commit>, String> {
        commits_of(self.ledger.log(), self.start, &self.minted).await
    }

    async fn outcome(&self, id: Uuid) -> Result<OperationOutcome, String> {
        let Some(Entity::Operation(op)) = self
            .ledger
            .read_current(AggregateId::operation(id))
            .await
            .map_err(|e| e.to_string())?
        else {
            return Err(format!("operation {id} is not in the log"));
        };
        let view = op.view();
        Ok(OperationOutcome {
            id,
            label: super::short(&id),
            kind: view["kind"].as_str().unwrap_or("?").to_string(),
            status: view["status"].as_str().unwrap_or("?").to_string(),
            plan: op.rollback_plan.as_deref().map(render_plan),
            rollback_plan: op.rollback_plan.as_deref().cloned(),
            failure: op.error.as_ref().map(|e| match &e.step {
                Some(step) => format!("stage {} step {step}: {}", e.stage, e.message),
                None => format!("stage {}: {}", e.stage, e.message),
            }),
        })
    }

    /// Reports the scenario: its commits, its operations, and what remained.
    async fn report(
        &self,
        title: &str,
        failure: bool,
        cluster: Uuid,
        ops: &[Uuid],
        notes: Vec<String>,
    ) -> Result<ScenarioReport, String> {
        let commits = self.commits_since_start().await?;
        let mut operations = Vec::new();
        for op in ops {
            operations.push(self.outcome(*op).await?);
        }
        let target = AggregateId::cluster(cluster);
        let Some(Entity::Cluster(c)) = self
            .ledger
            .read_current(target)
            .await
            .map_err(|e| e.to_string())?
        else {
            return Err(format!("{target} is not in the log"));
        };
        let view = c.view();
        let members: BTreeSet<Uuid> = c
            .node_groups
            .iter()
            .flat_map(|g| g.instance_ids.iter().copied())
            .collect();
        // Every node the scenario ever claimed for that is no longer a member was removed:
        // nothing of it may remain at any executor.
        let removed: BTreeSet<Uuid> = commits
            .iter()
            .flat_map(|c| c.events.iter())
            .filter_map(|e| match e {
                Event::AllocationClaimed { consumer, .. } => Some(*consumer),
                _ => None,
            })
            .filter(|n| !members.contains(n))
            .collect();
        Ok(ScenarioReport {
            title: title.into(),
            failure,
            commits,
            operations,
            notes,
            afterwards: Afterwards {
                cluster: target,
                cluster_label: super::short(&cluster),
                status: view["status"].as_str().unwrap_or("?").to_string(),
                description: view["status_description"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                members: members.len(),
                executors: self
                    .infra
                    .inventory()
                    .into_iter()
                    .map(|(k, v)| (k, v.len()))
                    .collect(),
                left_of_removed_nodes: removed
                    .iter()
                    .flat_map(|n| self.infra.held_for(n))
                    .collect(),
            },
        })
    }

    /// Two schedulers claim on this compute node from the same version: the second is
    /// refused and re-reads; then a release is retried with its commit id and recognised.
    async fn race_two_claims(&self, notes: &mut Vec<String>) -> Result<(), String> {
        let provider = AggregateId::provider(self.provider);
        let stamper = self.prov.runner.stamper().clone();
        let version = self
            .ledger
            .log()
            .read_aggregate(provider)
            .await
            .map_err(|e| e.to_string())?
            .len() as u64;
        let claim = |consumer: Uuid| {
            stamper.draft(
                "scheduler",
                vec![Event::AllocationClaimed {
                    consumer,
                    consumer_kind: ConsumerKind::Instance,
                    resources: BTreeMap::from([("VCPU".to_string(), 1)]),
                }],
            )
        };
        let (first, second) = (stamper.id(), stamper.id());
        self.ledger
            .log()
            .append(provider, Expectation::Exactly(version), claim(first))
            .await
            .map_err(|e| e.to_string())?;
        match self
            .ledger
            .log()
            .append(provider, Expectation::Exactly(version), claim(second))
            .await
        {
            Err(AppendError::Conflict { actual, .. }) => {
                notes.push(format!(
                    "stale claim on provider cmp-1 refused: expected v{version}, actual v{actual}; \
                     the scheduler re-read and claimed at v{actual}"
                ));
                self.ledger
                    .log()
                    .append(provider, Expectation::Exactly(actual), claim(second))
                    .await
                    .map_err(|e| e.to_string())?;
            }
            other => return Err(format!("a stale claim was not refused: {other:?}")),
        }
        for consumer in [first, second] {
            let release = stamper.draft(
                "scheduler",
                vec![Event::AllocationReleased {
                    consumer,
                    reason: "demo: the scheduler's reservation ends".into(),
                }],
            );
            let once = self
                .ledger
                .log()
                .append(provider, Expectation::Any, release.clone())
                .await
                .map_err(|e| e.to_string())?;
            if consumer == first {
                // The scheduler lost the ack and retries with the same commit id.
                let again = self
                    .ledger
                    .log()
                    .append(provider, Expectation::Any, release)
                    .await
                    .map_err(|e| e.to_string())?;
                if again.status != AppendStatus::AlreadyAppended || again.position != once.position
                {
                    return Err("a retried commit was written twice".into());
                }
                notes.push(format!(
                    "retry of the release at #{} recognised as already appended; nothing written twice",
                    once.position
                ));
            }
        }
        Ok(())
    }
}

/// The commits after position `after` on aggregates this demo run made, in log order.
/// Entries readers quarantine (someone else's garbage on a shared stream) are not the
/// demo's and are passed over.
pub(super) async fn commits_of(
    log: &Ledger,
    after: u64,
    minted: &Minted,
) -> Result<Vec<Commit>, String> {
    let mut out = Vec::new();
    let mut stream = log.read_all(after + 1).await.map_err(|e| e.to_string())?;
    while let Some(entry) = stream.next().await {
        match entry {
            Ok(c) if minted.contains(&c.aggregate.id) => out.push(c),
            Ok(_) => {}
            Err(e) if e.quarantine_parts().is_some() => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(out)
}

fn inject(infra: &SimInfrastructure, (executor, action, call): Fault) {
    let executor: Option<&SimExecutor> = infra.executor(executor);
    if let Some(e) = executor {
        e.fail_call(action, call);
    }
}

/// Runs every scenario on `log`, every id from `stamper` (whose source is `minted`: seeded
/// in a fresh data dir, random on a shared stream); also hands back each scenario's
/// executors, for drift.
pub(super) async fn run_all(
    log: &Ledger,
    stamper: &Stamper,
    minted: &Arc<Minted>,
) -> Result<(Vec<ScenarioReport>, Vec<Arc<SimInfrastructure>>), DemoError> {
    let mut reports = Vec::new();
    let mut infras = Vec::new();

    let title = "create a 3-node cluster on one compute node";
    let e = failed(title);
    let w = world(log, stamper, minted, "cmp-1").await.map_err(&e)?;
    let (cluster, _, created) = w.active_cluster("analytics").await.map_err(&e)?;
    infras.push(w.infra.clone());
    let mut notes = Vec::new();
    w.race_two_claims(&mut notes).await.map_err(&e)?;
    reports.push(
        w.report(title, false, cluster, &[created], notes)
            .await
            .map_err(&e)?,
    );

    let title = "create fails in spawn (the hypervisor cannot boot node 3) and rolls back";
    let e = failed(title);
    let w = world(log, stamper, minted, "cmp-2").await.map_err(&e)?;
    infras.push(w.infra.clone());
    inject(&w.infra, (HYPERVISOR, "create_vm", 3));
    let request = w.request("create-fails", 3);
    let create = w.prov.create_cluster(request.clone()).await;
    reports.push(
        w.report(
            title,
            true,
            request.cluster_id,
            &[create.operation_id],
            vec![],
        )
        .await
        .map_err(&e)?,
    );

    let scales: [(&str, Fault); 3] = [
        (
            "scale fails in decommission: error, no node deleted",
            (PLUGIN, "decommission", 2),
        ),
        (
            "scale fails in terminate_and_create: new node deleted, removal finished, active",
            (HYPERVISOR, "terminate_vm", 2),
        ),
        (
            "scale fails in configure_new: error, new node kept",
            (PLUGIN, "configure", 1),
        ),
    ];
    for (i, (title, fault)) in scales.into_iter().enumerate() {
        let e = failed(title);
        let w = world(log, stamper, minted, &format!("cmp-{}", i + 3))
            .await
            .map_err(&e)?;
        infras.push(w.infra.clone());
        let (cluster, nodes, created) = w
            .active_cluster(&format!("scale-{}", i + 1))
            .await
            .map_err(&e)?;
        inject(&w.infra, fault);
        let scale = w
            .prov
            .scale_cluster(cluster, "workers", nodes[..2].to_vec(), 1, w.provider)
            .await;
        reports.push(
            w.report(title, true, cluster, &[created, scale.operation_id], vec![])
                .await
                .map_err(&e)?,
        );
    }

    let title = "delete during create (in configure): the create is cancelled, all it made is \
                 removed, the cluster is deleted";
    let e = failed(title);
    let w = world(log, stamper, minted, "cmp-6").await.map_err(&e)?;
    infras.push(w.infra.clone());
    let request = w.request("deleted-mid-create", 3);
    *w.delete_at.lock().unwrap_or_else(|p| p.into_inner()) =
        Some((request.cluster_id, stage::CONFIGURE.to_string()));
    let create = w.prov.create_cluster(request.clone()).await;
    let delete = w
        .prov
        .delete_cluster(request.cluster_id, "the user deleted the cluster")
        .await
        .map_err(|err| e(err.to_string()))?;
    let mut ops = vec![create.operation_id];
    ops.extend(delete.delete_operation.as_ref().map(|d| d.operation_id));
    reports.push(
        w.report(title, true, request.cluster_id, &ops, vec![])
            .await
            .map_err(&e)?,
    );
    Ok((reports, infras))
}
