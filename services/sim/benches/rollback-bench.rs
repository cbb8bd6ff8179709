//! Rollback benchmark: how long the pure planner takes on large operations, and how fast
//! an embedded rollback runs end to end (runner, driver, sled, simulated executors).
//! `cargo bench -p provledger-sim --bench rollback-bench [-- --quick]` prints a table.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use provledger_client::CancelNotices;
use provledger_client::Ledger;
use provledger_client::OperationRunner;
use provledger_client::RollbackDriver;
use provledger_events::catalogue::{
    Compensation, CompensationAction, Effect, EffectKind, Executor, NodeGroupSpec, OperationKind,
    Origin,
};
use provledger_events::{
    AggregateId, Commit, CommitDraft, Event, EventLog, Hash, SledLog, Timestamp,
};
use provledger_projections::planner::plan_rollback;
use provledger_projections::rollback::RetryPolicy;
use provledger_projections::stages::{stage, stages_of};
use provledger_projections::Entity;
use provledger_sim::SimInfrastructure;
use provledger_sim::{register_compute_node, ClusterRequest, Provisioner};
use uuid::Uuid;

/// A failed create with `nodes` VMs, each with a claim, a VM and an IP.
fn failed_create(nodes: usize) -> provledger_projections::operation::OperationState {
    let id = AggregateId::operation(Uuid::from_u128(1));
    let mut events = vec![
        Event::OperationStarted {
            kind: OperationKind::CreateCluster,
            target: AggregateId::cluster(Uuid::from_u128(2)),
            parent_id: None,
            stages: stages_of(OperationKind::CreateCluster),
            bundle_policy: None,
        },
        Event::StageStarted {
            stage: stage::SPAWN.into(),
        },
    ];
    for n in 0..nodes {
        for (kind, action, executor) in [
            (
                EffectKind::AllocationClaimed,
                CompensationAction::ReleaseAllocation,
                Executor::Ledger,
            ),
            (
                EffectKind::VmCreated,
                CompensationAction::TerminateVm,
                Executor::Service("hypervisor".into()),
            ),
            (
                EffectKind::IpAcquired,
                CompensationAction::ReleaseIp,
                Executor::Service("ipam".into()),
            ),
        ] {
            events.push(Event::StepDone {
                stage: stage::SPAWN.into(),
                step: format!("{action:?}:{n}"),
                effect: Effect {
                    kind,
                    resource: format!("r-{n}"),
                    executor: "x".into(),
                    origin: Origin::Created,
                    detail: BTreeMap::new(),
                },
                compensation: Some(Compensation {
                    action,
                    executor,
                    resource: format!("r-{n}"),
                    args: BTreeMap::new(),
                }),
            });
        }
    }
    events.push(Event::OperationFailed {
        stage: stage::SPAWN.into(),
        step: None,
        error: "boom".into(),
    });
    let mut entity = Entity::new(id);
    let mut prev = Hash::ZERO;
    for (i, chunk) in events.chunks(512).enumerate() {
        let mut commit = Commit::seal(
            id,
            i as u64 + 1,
            prev,
            CommitDraft {
                trace: None,
                commit_id: Uuid::from_u128(1000 + i as u128),
                operation_id: None,
                causation_id: None,
                actor: "bench".into(),
                recorded_at: Timestamp(0),
                events: chunk.to_vec(),
            },
        );
        commit.position = i as u64 + 1;
        prev = commit.hash;
        entity.apply(&commit);
    }
    match entity {
        Entity::Operation(op) => *op,
        _ => unreachable!("an operation aggregate folds into an operation"),
    }
}

async fn embedded_rollback(nodes: u32) -> (f64, usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger =
        provledger_client::Writer::new(Ledger::Embedded(SledLog::open(dir.path()).expect("sled")));
    let infra = Arc::new(SimInfrastructure::default());
    let driver = Arc::new(RollbackDriver::new(
        ledger.clone(),
        infra.clone(),
        RetryPolicy::default(),
        "bench",
    ));
    let runner = OperationRunner::new(
        ledger.clone(),
        CancelNotices::local(),
        Some(driver),
        "bench",
    );
    let prov = Provisioner::new(runner, infra.clone(), "bench");
    let provider = Uuid::now_v7();
    register_compute_node(&ledger, provider, "cn", 1 << 20, "bench")
        .await
        .expect("provider");
    // The last VM fails: every other node's claim, VM, IP, DHCP and DNS is undone.
    infra.hypervisor.fail_call("create_vm", nodes);
    let request = ClusterRequest {
        cluster_id: Uuid::now_v7(),
        name: "bench".into(),
        plugin: "vanilla".into(),
        node_groups: vec![NodeGroupSpec {
            name: "workers".into(),
            count: nodes,
            flavor: "m".into(),
            resources: BTreeMap::from([("VCPU".to_string(), 1)]),
            processes: vec![],
        }],
        provider,
    };
    let report = prov.create_cluster(request).await;
    // Time the rollback alone: from the failure to the finish, both recorded in the log.
    let commits = ledger
        .log()
        .read_aggregate(AggregateId::operation(report.operation_id))
        .await
        .expect("history");
    let failed_at = commits
        .iter()
        .find(|c| {
            c.events
                .iter()
                .any(|e| matches!(e, Event::OperationFailed { .. }))
        })
        .map(|c| c.recorded_at.unix_ms())
        .unwrap_or(0);
    let finished_at = commits.last().map(|c| c.recorded_at.unix_ms()).unwrap_or(0);
    let compensations = report.plan.map(|p| p.compensations.len()).unwrap_or(0);
    assert!(infra.inventory().is_empty(), "the rollback left resources");
    ((finished_at - failed_at) as f64 / 1000.0, compensations)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    println!("| measurement | size | result |");
    println!("|---|---|---|");
    let sizes: &[usize] = if quick {
        &[100, 1_000]
    } else {
        &[100, 1_000, 10_000]
    };
    for &nodes in sizes {
        let op = failed_create(nodes);
        let rounds = if nodes >= 10_000 { 5 } else { 50 };
        let start = Instant::now();
        let mut planned = 0;
        for _ in 0..rounds {
            planned = plan_rollback(&op, &[]).expect("plan").compensations.len();
        }
        let per = start.elapsed().as_secs_f64() / rounds as f64;
        println!(
            "| plan_rollback (pure) | {} steps -> {planned} compensations | {:.3} ms |",
            nodes * 3,
            per * 1000.0
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let node_counts: &[u32] = if quick { &[10] } else { &[10, 50] };
    for &nodes in node_counts {
        let (secs, compensations) = runtime.block_on(embedded_rollback(nodes));
        println!(
            "| embedded rollback, create failing at its last VM | {nodes} nodes, {compensations} compensations | {:.3} s, {:.0} compensations/s |",
            secs,
            compensations as f64 / secs.max(1e-9)
        );
    }
}
