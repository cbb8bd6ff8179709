//! `provledger demo`: an end-to-end scenario, embedded, in a fresh data dir. It provisions a
//! cluster of three instances on one compute node under a create-cluster operation, shows
//! optimistic concurrency refusing a stale allocation claim and an idempotent retry being
//! recognised, then prints the timeline and checks every hash chain.
//!
//! Then the failure scenarios (`demo_failures`): a create that fails and rolls back, a scale
//! failing in each stage, and a delete during a create, each with its timeline and plan.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use futures::StreamExt;
use provledger_events::catalogue::{
    ClusterStatus, Compensation, CompensationAction, ConsumerKind, Effect, EffectKind, Executor,
    Inventory, NodeGroupSpec, OperationKind, OperationOutcome, Origin, PowerState, Ratio,
    StagePolicy, StageSpec, TaskOutcome, TaskState, VmState,
};
use provledger_events::{
    verify_chain, AggregateId, AppendError, AppendOutcome, AppendStatus, Commit, CommitDraft,
    Event, EventLog, Expectation, SledLog, Timestamp,
};
use provledger_projections::timeline;
use uuid::Uuid;

use super::{print_json, CommandError};

const ACTOR: &str = "demo";
const LEASE_MS: i64 = 60_000;

/// Appends on behalf of one operation, stamping its id on every commit.
struct Writer<'a> {
    log: &'a SledLog,
    operation_id: Uuid,
}

impl Writer<'_> {
    async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        events: Vec<Event>,
    ) -> Result<AppendOutcome, AppendError> {
        let draft = CommitDraft::now(ACTOR, events).with_operation(self.operation_id);
        self.log.append(aggregate, expect, draft).await
    }
}

fn infra(e: impl std::fmt::Display) -> CommandError {
    CommandError::Infrastructure(e.to_string())
}

fn resources() -> BTreeMap<String, u64> {
    BTreeMap::from([("VCPU".to_string(), 4), ("MEMORY_MB".to_string(), 8192)])
}

async fn register_provider(w: &Writer<'_>, provider: AggregateId) -> Result<(), AppendError> {
    let inventory = |total| Inventory {
        total,
        reserved: 0,
        allocation_ratio: Ratio::from_f64(2.0).unwrap_or(Ratio::ONE),
        min_unit: 1,
        max_unit: total,
        step_size: 1,
    };
    w.append(
        provider,
        Expectation::NoStream,
        vec![
            Event::ProviderRegistered {
                name: "cmp-1".into(),
                host: "cmp-1.example".into(),
            },
            Event::InventorySet {
                resource_class: "VCPU".into(),
                inventory: inventory(16),
            },
            Event::InventorySet {
                resource_class: "MEMORY_MB".into(),
                inventory: inventory(65536),
            },
        ],
    )
    .await?;
    Ok(())
}

/// Claims on the provider with an exact expectation; on a conflict, re-reads and retries,
/// which is what keeps concurrent schedulers from overcommitting.
async fn claim(
    w: &Writer<'_>,
    provider: AggregateId,
    consumer: Uuid,
    notes: &mut Vec<String>,
    stale_version: Option<u64>,
) -> Result<(), AppendError> {
    let mut expected = match stale_version {
        Some(v) => v,
        None => w
            .log
            .read_aggregate(provider)
            .await
            .map_err(|e| AppendError::Unavailable {
                reason: e.to_string(),
            })?
            .len() as u64,
    };
    loop {
        let claim = vec![Event::AllocationClaimed {
            consumer,
            consumer_kind: ConsumerKind::Instance,
            resources: resources(),
        }];
        match w
            .append(provider, Expectation::Exactly(expected), claim)
            .await
        {
            Ok(_) => return Ok(()),
            Err(AppendError::Conflict { actual, .. }) => {
                notes.push(format!(
                    "stale claim on {provider} refused: expected v{expected}, actual v{actual}; re-read and retried"
                ));
                expected = actual;
            }
            Err(e) => return Err(e),
        }
    }
}

async fn boot_instance(
    w: &Writer<'_>,
    cluster: AggregateId,
    provider: AggregateId,
    index: usize,
    notes: &mut Vec<String>,
) -> Result<(), AppendError> {
    let instance = AggregateId::instance(Uuid::now_v7());
    let op = AggregateId::operation(w.operation_id);
    w.append(
        instance,
        Expectation::NoStream,
        vec![
            Event::InstanceCreateRequested {
                name: format!("analytics-workers-{index}"),
                cluster_id: Some(cluster.id),
                node_group: Some("workers".into()),
                flavor: "m1.large".into(),
                resources: resources(),
                image: "ubuntu-24.04".into(),
            },
            Event::TaskQueued {
                task_state: TaskState::Scheduling,
            },
        ],
    )
    .await?;
    // The second instance's scheduler works from a stale view of the provider.
    let stale = (index == 1).then_some(1);
    claim(w, provider, instance.id, notes, stale).await?;
    let now = Timestamp::now();
    w.append(
        instance,
        Expectation::Exactly(1),
        vec![
            Event::HostAssigned {
                host: "cmp-1".into(),
                provider_id: provider.id,
            },
            Event::TaskStarted {
                task_state: TaskState::Spawning,
                worker_id: "compute-cmp-1".into(),
                lease_until: now.plus_ms(LEASE_MS),
            },
        ],
    )
    .await?;
    w.append(
        op,
        Expectation::Any,
        vec![
            step(
                "claim_allocation",
                EffectKind::AllocationClaimed,
                instance.id,
                "placement",
                Executor::Ledger,
                CompensationAction::ReleaseAllocation,
            ),
            step(
                "create_vm",
                EffectKind::VmCreated,
                instance.id,
                "hypervisor",
                Executor::Service("hypervisor".into()),
                CompensationAction::TerminateVm,
            ),
        ],
    )
    .await?;
    w.append(
        instance,
        Expectation::Exactly(2),
        vec![
            Event::VmStateChanged {
                vm_state: VmState::Active,
                reason: "spawned".into(),
            },
            Event::PowerStateChanged {
                power_state: PowerState::Running,
            },
            Event::TaskFinished {
                task_state: TaskState::Spawning,
                outcome: TaskOutcome::Succeeded,
                reason: "booted".into(),
            },
        ],
    )
    .await?;
    w.append(
        cluster,
        Expectation::Any,
        vec![Event::InstanceJoined {
            node_group: "workers".into(),
            instance_id: instance.id,
        }],
    )
    .await?;
    Ok(())
}

fn step(
    name: &str,
    kind: EffectKind,
    instance: Uuid,
    executor: &str,
    compensator: Executor,
    action: CompensationAction,
) -> Event {
    Event::StepDone {
        stage: "spawn".into(),
        step: format!("{name}:{instance}"),
        effect: Effect {
            kind,
            resource: instance.to_string(),
            executor: executor.into(),
            origin: Origin::Created,
            detail: BTreeMap::new(),
        },
        compensation: Some(Compensation {
            action,
            executor: compensator,
            resource: instance.to_string(),
            args: BTreeMap::new(),
        }),
    }
}

async fn scenario(log: &SledLog, notes: &mut Vec<String>) -> Result<AggregateId, AppendError> {
    let operation_id = Uuid::now_v7();
    let w = Writer { log, operation_id };
    let provider = AggregateId::provider(Uuid::now_v7());
    let cluster = AggregateId::cluster(Uuid::now_v7());
    let op = AggregateId::operation(operation_id);
    register_provider(&w, provider).await?;
    w.append(
        op,
        Expectation::NoStream,
        vec![
            Event::OperationStarted {
                kind: OperationKind::CreateCluster,
                target: cluster,
                parent_id: None,
                stages: vec![
                    StageSpec {
                        name: "spawn".into(),
                        policy: StagePolicy::Compensate,
                    },
                    StageSpec {
                        name: "configure".into(),
                        policy: StagePolicy::Hold,
                    },
                ],
                bundle_policy: None,
            },
            Event::StageStarted {
                stage: "spawn".into(),
            },
        ],
    )
    .await?;
    w.append(
        cluster,
        Expectation::NoStream,
        vec![
            Event::ClusterCreateRequested {
                name: "analytics".into(),
                plugin: "vanilla".into(),
                node_groups: vec![NodeGroupSpec {
                    name: "workers".into(),
                    count: 3,
                    flavor: "m1.large".into(),
                    resources: resources(),
                    processes: vec!["datanode".into()],
                }],
            },
            Event::InFlightOperationSet {
                operation_id,
                operation_kind: OperationKind::CreateCluster,
            },
            Event::ClusterStatusChanged {
                status: ClusterStatus::Spawning,
                description: "creating 3 workers".into(),
            },
        ],
    )
    .await?;
    for index in 0..3 {
        boot_instance(&w, cluster, provider, index, notes).await?;
    }
    w.append(
        op,
        Expectation::Any,
        vec![
            Event::StageCompleted {
                stage: "spawn".into(),
            },
            Event::StageStarted {
                stage: "configure".into(),
            },
        ],
    )
    .await?;
    let configured = CommitDraft::now(
        ACTOR,
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Configuring,
            description: "configuring services".into(),
        }],
    )
    .with_operation(operation_id);
    let first = log
        .append(cluster, Expectation::Any, configured.clone())
        .await?;
    // The writer lost the ack and retries with the same commit_id: nothing is written twice.
    let retry = log.append(cluster, Expectation::Any, configured).await?;
    if retry.status == AppendStatus::AlreadyAppended && retry.position == first.position {
        notes.push(format!(
            "retry of commit at #{} recognised as already appended; nothing written twice",
            first.position
        ));
    }
    w.append(
        op,
        Expectation::Any,
        vec![
            Event::StageCompleted {
                stage: "configure".into(),
            },
            Event::OperationSucceeded {},
        ],
    )
    .await?;
    w.append(
        cluster,
        Expectation::Any,
        vec![
            Event::ClusterStatusChanged {
                status: ClusterStatus::Active,
                description: "3 workers ready".into(),
            },
            Event::InFlightOperationCleared {
                operation_id,
                outcome: OperationOutcome::Succeeded,
            },
        ],
    )
    .await?;
    Ok(cluster)
}

pub async fn run(base_dir: &Path, json: bool) -> Result<(), CommandError> {
    let dir = base_dir.join(format!("demo-{}", Uuid::now_v7()));
    let log = SledLog::open(&dir).map_err(infra)?;
    let mut notes = Vec::new();
    let cluster = scenario(&log, &mut notes)
        .await
        .map_err(|e| CommandError::Problem(e.to_string()))?;
    let failures = super::demo_failures::run(&log)
        .await
        .map_err(CommandError::Problem)?;

    let mut commits: Vec<Commit> = Vec::new();
    let mut stream = log.read_all(1).await?;
    while let Some(c) = stream.next().await {
        commits.push(c?);
    }
    let aggregates: BTreeSet<AggregateId> = commits.iter().map(|c| c.aggregate).collect();
    let mut violations = Vec::new();
    for agg in &aggregates {
        violations.extend(verify_chain(agg, &log.read_aggregate(*agg).await?));
    }
    log.close();

    if json {
        print_json(&serde_json::json!({
            "data_dir": dir.display().to_string(),
            "cluster": cluster.to_string(),
            "commits": commits,
            "notes": notes,
            "failure_scenarios": failures,
            "audit": {"aggregates": aggregates.len(), "commits": commits.len(),
                      "violations": violations.iter().map(|v| v.to_string()).collect::<Vec<_>>()},
        }));
    } else {
        println!(
            "provledger demo: create a 3-node cluster on one compute node (embedded, {})",
            dir.display()
        );
        println!();
        println!("timeline:");
        for c in &commits {
            for line in timeline::render(c) {
                println!("  {line}");
            }
        }
        println!();
        for n in &notes {
            println!("note: {n}");
        }
        super::demo_failures::print(&failures);
        println!();
        println!(
            "audit: {} aggregates, {} commits, hash chains {}",
            aggregates.len(),
            commits.len(),
            if violations.is_empty() {
                "ok".to_string()
            } else {
                format!("{} VIOLATIONS", violations.len())
            }
        );
        println!(
            "inspect: provledger --data-dir {} history {cluster}",
            dir.display()
        );
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(CommandError::Problem(format!(
            "demo audit found {} violation(s)",
            violations.len()
        )))
    }
}
