//! The failure half of `provledger demo`: one create that fails and rolls back, one scale
//! failing in each of its three stages, and a delete arriving while a create configures
//! its nodes. Each runs through the operation runner against the simulated executors,
//! embedded, and is reported with its operation's timeline, its plan and what remained.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use provledger_events::catalogue::NodeGroupSpec;
use provledger_events::{AggregateId, EventLog, SledLog};
use provledger_projections::planner::render_plan;
use provledger_projections::rollback::RetryPolicy;
use provledger_projections::stages::stage;
use provledger_projections::{timeline, Entity};
use uuid::Uuid;

use crate::operation::cancel::CancelNotices;
use crate::operation::deletion;
use crate::operation::driver::RollbackDriver;
use crate::operation::{read_entity, OperationRunner, StepHook};
use crate::provision::{register_compute_node, ClusterRequest, Provisioner};
use crate::sim::SimInfrastructure;
use crate::Ledger;

const ACTOR: &str = "demo";

/// One scenario's story, ready to print.
#[derive(Debug, serde::Serialize)]
pub struct ScenarioReport {
    pub title: String,
    pub operations: Vec<OperationStory>,
    /// What the simulated executors still hold afterwards, by executor.
    pub executors_after: BTreeMap<String, usize>,
    pub cluster_after: serde_json::Value,
}

#[derive(Debug, serde::Serialize)]
pub struct OperationStory {
    pub id: Uuid,
    pub kind: String,
    pub status: String,
    pub timeline: Vec<String>,
    pub plan: Option<String>,
}

struct Stage {
    ledger: Ledger,
    infra: Arc<SimInfrastructure>,
    prov: Provisioner,
    provider: Uuid,
    delete_at: Arc<Mutex<Option<(Uuid, String)>>>,
}

fn demo_group(count: u32) -> NodeGroupSpec {
    NodeGroupSpec {
        name: "workers".into(),
        count,
        flavor: "m1.large".into(),
        resources: BTreeMap::from([("VCPU".to_string(), 2)]),
        processes: vec!["datanode".into(), "nodemanager".into()],
    }
}

async fn setup(log: &SledLog) -> Result<Stage, String> {
    let ledger = Ledger::Embedded(log.clone());
    let infra = Arc::new(SimInfrastructure::default());
    let notices = CancelNotices::local();
    let policy = RetryPolicy {
        backoff_base_ms: 10,
        backoff_max_ms: 100,
        ..RetryPolicy::default()
    };
    let driver = Arc::new(RollbackDriver::new(
        ledger.clone(),
        infra.clone(),
        policy,
        ACTOR,
    ));
    // The demo's user deletes a cluster when its create reaches a chosen stage.
    let delete_at: Arc<Mutex<Option<(Uuid, String)>>> = Arc::new(Mutex::new(None));
    let hook: StepHook = {
        let (ledger, notices, delete_at) = (ledger.clone(), notices.clone(), delete_at.clone());
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
            let (ledger, notices) = (ledger.clone(), notices.clone());
            Box::pin(async move {
                if let Some(cluster) = fire {
                    let target = AggregateId::cluster(cluster);
                    let reason = "the user deleted the cluster while it was being configured";
                    if let Err(e) =
                        deletion::request_delete(&ledger, &notices, target, reason, "user").await
                    {
                        tracing::warn!(error = %e, "demo delete request failed");
                    }
                }
            })
        })
    };
    let runner =
        OperationRunner::new(ledger.clone(), notices, Some(driver), ACTOR).with_step_hook(hook);
    let prov = Provisioner::new(runner, infra.clone(), ACTOR);
    let provider = Uuid::now_v7();
    register_compute_node(&ledger, provider, "cmp-2", 64, ACTOR)
        .await
        .map_err(|e| e.to_string())?;
    Ok(Stage {
        ledger,
        infra,
        prov,
        provider,
        delete_at,
    })
}

impl Stage {
    fn request(&self, name: &str, nodes: u32) -> ClusterRequest {
        ClusterRequest {
            cluster_id: Uuid::now_v7(),
            name: name.into(),
            plugin: "vanilla".into(),
            node_groups: vec![demo_group(nodes)],
            provider: self.provider,
        }
    }

    async fn story(&self, id: Uuid) -> Result<OperationStory, String> {
        let commits = self
            .ledger
            .read_aggregate(AggregateId::operation(id))
            .await
            .map_err(|e| e.to_string())?;
        let mut op = Entity::new(AggregateId::operation(id));
        let mut lines = Vec::new();
        for c in &commits {
            op.apply(c);
            lines.extend(timeline::render(c));
        }
        let Entity::Operation(op) = op else {
            return Err("not an operation".into());
        };
        Ok(OperationStory {
            id,
            kind: op.view()["kind"].as_str().unwrap_or("?").to_string(),
            status: op.view()["status"].as_str().unwrap_or("?").to_string(),
            timeline: lines,
            plan: op.rollback_plan.as_ref().map(render_plan),
        })
    }

    async fn report(
        &self,
        title: &str,
        cluster: Uuid,
        ops: &[Uuid],
    ) -> Result<ScenarioReport, String> {
        let mut operations = Vec::new();
        for op in ops {
            operations.push(self.story(*op).await?);
        }
        let cluster_after = match read_entity(&self.ledger, AggregateId::cluster(cluster))
            .await
            .map_err(|e| e.to_string())?
        {
            Some(e) => e.view(),
            None => serde_json::Value::Null,
        };
        Ok(ScenarioReport {
            title: title.into(),
            operations,
            executors_after: self
                .infra
                .inventory()
                .into_iter()
                .map(|(k, v)| (k, v.len()))
                .collect(),
            cluster_after,
        })
    }

    async fn active_cluster(&self, name: &str) -> Result<(Uuid, Vec<Uuid>, Uuid), String> {
        let request = self.request(name, 3);
        let report = self.prov.create_cluster(request.clone()).await;
        let nodes = report.result.map_err(|e| e.to_string())?;
        Ok((request.cluster_id, nodes, report.operation_id))
    }
}

/// Runs the five failure scenarios on `log`, each with its own simulated executors and
/// compute node so that "what remained" is that scenario's alone.
pub async fn run(log: &SledLog) -> Result<Vec<ScenarioReport>, String> {
    let mut reports = Vec::new();
    let s = setup(log).await?;

    // 1. A create whose third VM fails to boot: everything created is undone.
    s.infra.hypervisor.fail_call("create_vm", 3);
    let request = s.request("create-fails", 3);
    let create = s.prov.create_cluster(request.clone()).await;
    reports.push(
        s.report(
            "create fails in spawn (the hypervisor cannot boot node 3) and rolls back",
            request.cluster_id,
            &[create.operation_id],
        )
        .await?,
    );

    // 2-4. A scale (remove 2 nodes, add 1) failing in each of its stages.
    let scales = [
        (
            "scale fails in decommission: error, no node deleted",
            "plugin",
            "decommission",
            2,
        ),
        (
            "scale fails in terminate_and_create: new node deleted, removal finished, active",
            "hypervisor",
            "terminate_vm",
            2,
        ),
        (
            "scale fails in configure_new: error, new node kept",
            "plugin",
            "configure",
            1,
        ),
    ];
    for (i, (title, executor, action, call)) in scales.into_iter().enumerate() {
        let s = setup(log).await?;
        let (cluster, nodes, created) = s.active_cluster(&format!("scale-{}", i + 1)).await?;
        if let Some(e) = s.infra.executor(executor) {
            e.fail_call(action, call);
        }
        let scale = s
            .prov
            .scale_cluster(cluster, "workers", nodes[..2].to_vec(), 1, s.provider)
            .await;
        reports.push(
            s.report(title, cluster, &[created, scale.operation_id])
                .await?,
        );
    }

    // 5. A delete arriving while a create configures its nodes.
    let s = setup(log).await?;
    let request = s.request("deleted-mid-create", 3);
    *s.delete_at.lock().unwrap_or_else(|p| p.into_inner()) =
        Some((request.cluster_id, stage::CONFIGURE.to_string()));
    let create = s.prov.create_cluster(request.clone()).await;
    let delete = s
        .prov
        .delete_cluster(request.cluster_id, "the user deleted the cluster")
        .await
        .map_err(|e| e.to_string())?;
    let mut ops = vec![create.operation_id];
    if let Some(d) = &delete.delete_operation {
        ops.push(d.operation_id);
    }
    reports.push(
        s.report(
            "delete during create (in configure): the create is cancelled, all it made is removed, the cluster is deleted",
            request.cluster_id,
            &ops,
        )
        .await?,
    );
    Ok(reports)
}

/// Prints the scenarios for a person to follow.
pub fn print(reports: &[ScenarioReport]) {
    for (i, r) in reports.iter().enumerate() {
        println!();
        println!("== failure scenario {}: {}", i + 1, r.title);
        for op in &r.operations {
            println!("-- operation {} ({}): {}", op.id, op.kind, op.status);
            for line in &op.timeline {
                println!("   {line}");
            }
            if let Some(plan) = &op.plan {
                println!("   rollback plan:");
                for line in plan.lines() {
                    println!("     {line}");
                }
            }
        }
        println!(
            "   afterwards: cluster {} ({}), members {}, executors hold {:?}",
            r.cluster_after["status"].as_str().unwrap_or("?"),
            r.cluster_after["status_description"].as_str().unwrap_or(""),
            r.cluster_after["node_groups"]
                .as_array()
                .map(|g| g
                    .iter()
                    .map(|g| g["instance_ids"].as_array().map_or(0, |a| a.len()))
                    .sum::<usize>())
                .unwrap_or(0),
            r.executors_after
        );
    }
}
