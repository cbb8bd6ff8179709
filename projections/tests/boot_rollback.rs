//! A boot that fails and is rolled back, as given commits / when the rollback's records are
//! folded / then what the instance says (issue 37, item 10: a rolled-back instance showed
//! `task_state: scheduling` and its old host after its allocation was released).
//!
//! The rollback's records are those the driver writes, decided by the same pure functions
//! it asks (`plan_rollback`, `rollback_target_events`): the plan, each compensation
//! requested and done (the claim's release on the provider), the target's outcome on the
//! instance, and the rollback's end.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    Compensation, CompensationAction, ConsumerKind, Effect, EffectKind, Executor, OperationKind,
    Origin, PowerState, RollbackOutcome, TaskOutcome, TaskState, VmState,
};
use provledger_events::{AggregateId, Event, Timestamp};
use provledger_projections::facts::{
    deletion_completion, rollback_target_events, DeletionCompletion,
};
use provledger_projections::instance::InstanceState;
use provledger_projections::operation::{OperationState, OperationStatus};
use provledger_projections::placement::{heal_claim, HealSkip};
use provledger_projections::planner::plan_rollback;
use provledger_projections::recovery::recover;
use provledger_projections::stages::{stage, stages_of};
use provledger_projections::{Entity, Projection};
use provledger_tests::script::{self, ScriptStep};
use provledger_tests::workload;
use uuid::Uuid;

const HOST: &str = "cn1";

fn instance() -> AggregateId {
    AggregateId::instance(Uuid::from_u128(0xAA))
}

fn provider() -> AggregateId {
    AggregateId::provider(Uuid::from_u128(0xBB))
}

fn operation() -> AggregateId {
    AggregateId::operation(Uuid::from_u128(0x0B))
}

/// A time well after every commit of these scripts.
fn later() -> Timestamp {
    Timestamp::from_unix_ms(1_900_000_000_000)
}

fn on_operation(events: Vec<Event>) -> ScriptStep {
    (operation(), events)
}

fn step_done(stage: &str, step: &str, effect: Effect, compensation: Compensation) -> ScriptStep {
    on_operation(vec![Event::StepDone {
        stage: stage.into(),
        step: step.into(),
        effect,
        compensation: Some(compensation),
    }])
}

fn effect(kind: EffectKind, resource: &str, executor: &str) -> Effect {
    Effect {
        kind,
        resource: resource.into(),
        executor: executor.into(),
        origin: Origin::Created,
        detail: BTreeMap::new(),
    }
}

fn undo(action: CompensationAction, executor: &str, resource: &str) -> Compensation {
    Compensation {
        action,
        executor: Executor::Service(executor.into()),
        resource: resource.into(),
        args: BTreeMap::new(),
    }
}

/// Given a boot, as the reference flow records it, that got as far as `spawn`: the
/// instance created with the boot in flight (task `scheduling`), its claim on the provider
/// and its host assigned, an IP acquired, and the VM's creation recorded when `vm_created`.
fn given_a_boot_in_spawn(vm_created: bool) -> Vec<ScriptStep> {
    let kind = OperationKind::BootInstance;
    let id = instance().id.to_string();
    let release = Compensation {
        action: CompensationAction::ReleaseAllocation,
        executor: Executor::Ledger,
        resource: id.clone(),
        args: BTreeMap::from([("provider_id".into(), provider().id.to_string())]),
    };
    let mut steps = vec![
        (provider(), workload::provider_on(HOST, 8)),
        on_operation(vec![Event::operation_started(
            kind,
            instance(),
            None,
            stages_of(kind),
            None,
        )]),
        (
            instance(),
            vec![
                Event::InstanceCreateRequested {
                    name: "vm".into(),
                    cluster_id: None,
                    node_group: None,
                    flavor: "m1.small".into(),
                    resources: BTreeMap::from([("VCPU".to_string(), 2)]),
                    image: "img".into(),
                },
                Event::in_flight_operation_set(operation().id, kind),
            ],
        ),
        on_operation(vec![Event::stage_started(stage::SCHEDULE)]),
        (
            provider(),
            workload::vcpu_claim(instance().id, ConsumerKind::Instance, 2),
        ),
        step_done(
            stage::SCHEDULE,
            &format!("claim:{id}"),
            effect(EffectKind::AllocationClaimed, &id, "ledger"),
            release,
        ),
        (
            instance(),
            vec![Event::HostAssigned {
                host: HOST.into(),
                provider_id: provider().id,
            }],
        ),
        on_operation(vec![
            Event::stage_completed(stage::SCHEDULE),
            Event::stage_started(stage::NETWORK),
        ]),
        step_done(
            stage::NETWORK,
            &format!("acquire_ip:{id}"),
            effect(EffectKind::IpAcquired, "10.0.0.5", "ipam"),
            undo(CompensationAction::ReleaseIp, "ipam", "10.0.0.5"),
        ),
        on_operation(vec![
            Event::stage_completed(stage::NETWORK),
            Event::stage_started(stage::SPAWN),
        ]),
    ];
    if vm_created {
        steps.push(step_done(
            stage::SPAWN,
            &format!("create_vm:{id}"),
            effect(EffectKind::VmCreated, &id, "hypervisor"),
            undo(CompensationAction::TerminateVm, "hypervisor", &id),
        ));
    }
    steps
}

/// The boot fails in `spawn` (its runner records the failure).
fn failed(mut steps: Vec<ScriptStep>) -> Vec<ScriptStep> {
    steps.push(on_operation(vec![Event::operation_failed(
        stage::SPAWN,
        Some("create_vm".into()),
        "hypervisor: image corrupt",
    )]));
    steps
}

/// The user deletes the instance while it boots: the delete request on the instance, and
/// the boot cancelled because its target is being deleted.
fn deleted_by_the_user(mut steps: Vec<ScriptStep>) -> Vec<ScriptStep> {
    steps.push((
        instance(),
        vec![Event::InstanceDeleteRequested {
            reason: "the user deleted it".into(),
        }],
    ));
    steps.push(on_operation(vec![
        Event::TargetDeletionNoticed {
            reason: "instance deleted by the user".into(),
        },
        Event::operation_cancelled("instance deleted by the user"),
    ]));
    steps
}

fn fold(steps: &[ScriptStep]) -> Projection {
    Projection::rebuild(&script::seal(steps))
}

fn operation_of(p: &Projection) -> OperationState {
    match p.get(&operation()) {
        Some(Entity::Operation(op)) => (**op).clone(),
        other => panic!("not an operation: {other:?}"),
    }
}

fn instance_of(p: &Projection) -> InstanceState {
    match p.get(&instance()) {
        Some(Entity::Instance(i)) => (**i).clone(),
        other => panic!("not an instance: {other:?}"),
    }
}

/// When a driver rolls the stopped boot back and it ends as `outcome`: the plan, then
/// every compensation requested and done (the claim's release recorded on the provider),
/// or for `needs_attention` none done; then the target's outcome on the instance and the
/// rollback's end.
fn rolled_back(mut steps: Vec<ScriptStep>, outcome: RollbackOutcome) -> Vec<ScriptStep> {
    let plan = plan_rollback(&operation_of(&fold(&steps)), &[]).expect("a plan");
    let ids: Vec<Uuid> = plan
        .compensations
        .iter()
        .map(|c| c.compensation_id)
        .collect();
    steps.push(on_operation(vec![Event::rollback_planned(plan.clone())]));
    let mut remaining = Vec::new();
    for c in &plan.compensations {
        let id = c.compensation_id;
        steps.push(on_operation(vec![Event::compensation_requested(id, 1)]));
        if outcome == RollbackOutcome::NeedsAttention {
            steps.push(on_operation(vec![Event::CompensationFailed {
                compensation_id: id,
                attempt: 1,
                error: "executor unreachable".into(),
            }]));
            remaining = ids.clone();
            break;
        }
        if c.compensation.action == CompensationAction::ReleaseAllocation {
            steps.push((
                provider(),
                vec![Event::allocation_released(
                    instance().id,
                    "rollback of the boot",
                )],
            ));
        }
        steps.push(on_operation(vec![Event::CompensationDone {
            compensation_id: id,
        }]));
    }
    let p = fold(&steps);
    let target = p.get(&instance()).cloned();
    let events = rollback_target_events(&operation_of(&p), target.as_ref(), outcome);
    if !events.is_empty() {
        steps.push((instance(), events));
    }
    steps.push(on_operation(vec![Event::rollback_finished(
        outcome, remaining,
    )]));
    steps
}

fn allocations_on_the_provider(p: &Projection) -> usize {
    match p.get(&provider()) {
        Some(Entity::Provider(pr)) => pr.allocations.len(),
        other => panic!("not a provider: {other:?}"),
    }
}

#[test]
fn a_rolled_back_boot_has_no_task_in_progress_and_no_host() {
    // Given a boot that created its VM on cn1 and failed in spawn
    let steps = failed(given_a_boot_in_spawn(true));
    // When its rollback terminated the VM, released the IP and the claim, and ended
    let p = fold(&rolled_back(steps, RollbackOutcome::RolledBack));
    assert_eq!(
        operation_of(&p).status,
        Some(OperationStatus::RolledBack),
        "the rollback ran to its end"
    );
    assert_eq!(allocations_on_the_provider(&p), 0, "the claim is released");
    // Then the instance is in error with no task in progress, and no longer names the host
    // whose allocation was released (Nova: vm_state error, task_state None, host None)
    let i = instance_of(&p);
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(i.vm_state, Some(VmState::Error));
    assert_eq!(i.task_state, None, "no task is in progress");
    assert_eq!(i.last_task_outcome, Some(TaskOutcome::Failed));
    assert_eq!(i.host, None, "its allocation on {HOST} was released");
    assert_eq!(i.provider_id, None);
    assert_eq!(i.power_state, PowerState::NoState, "its VM was terminated");
    assert_eq!(i.in_flight, None);
    let view = i.view();
    assert_eq!(view["task_state"], serde_json::Value::Null, "{view}");
    assert_eq!(view["host"], serde_json::Value::Null, "{view}");
    // And nothing acts on it as if the boot were still there: heal-allocations does not
    // claim on the old host again, and the recovery sweep finds no stuck task
    assert_eq!(heal_claim(&i), Err(HealSkip::NoHost));
    assert_eq!(recover(&i, later()), None);
}

#[test]
fn a_boot_rolled_back_before_its_vm_existed_ends_the_same_way() {
    // Given a boot that failed in spawn before its VM was created
    let steps = failed(given_a_boot_in_spawn(false));
    // When its rollback ended
    let i = instance_of(&fold(&rolled_back(steps, RollbackOutcome::RolledBack)));
    // Then no task is in progress and no host is named
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(
        (i.vm_state, i.task_state, i.host.as_deref(), i.provider_id),
        (Some(VmState::Error), None, None, None)
    );
}

#[test]
fn a_spawning_task_a_worker_held_ends_with_the_rollback_and_its_lease_goes_with_it() {
    // Given a boot whose spawning task a worker started, holding a lease, then failed
    let mut steps = given_a_boot_in_spawn(true);
    steps.push((
        instance(),
        vec![Event::task_started(
            TaskState::Spawning,
            "compute-1",
            later(),
        )],
    ));
    let steps = failed(steps);
    // When the boot is rolled back (its VM terminated, its claim released)
    let mut steps = rolled_back(steps, RollbackOutcome::RolledBack);
    let i = instance_of(&fold(&steps));
    // Then the task, its worker and its lease are gone with it
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(
        (i.task_state, i.task_worker.as_deref(), i.task_lease_until),
        (None, None, None)
    );
    assert_eq!(i.host, None);
    // And the worker cannot take the task back: its late renewal is not applied
    steps.push((
        instance(),
        vec![Event::TaskLeaseRenewed {
            worker_id: "compute-1".into(),
            lease_until: later(),
        }],
    ));
    let i = instance_of(&fold(&steps));
    assert_eq!(i.task_state, None);
    assert_eq!(i.header.anomaly_count, 1, "{:?}", i.header.anomalies);
}

#[test]
fn a_boot_cancelled_by_its_deletion_keeps_the_delete_task_and_gives_up_the_host() {
    // Given a boot in spawn that the user deleted
    let steps = deleted_by_the_user(given_a_boot_in_spawn(true));
    // When its rollback removed everything it created and ended (cancelled)
    let p = fold(&rolled_back(steps, RollbackOutcome::RolledBack));
    assert_eq!(operation_of(&p).status, Some(OperationStatus::Cancelled));
    assert_eq!(allocations_on_the_provider(&p), 0);
    let i = instance_of(&p);
    // Then the delete is still the task in progress, and the host is no longer named
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(i.task_state, Some(TaskState::Deleting));
    assert_eq!((i.host.as_deref(), i.provider_id), (None, None));
    // And its deletion can complete: nothing of it remains anywhere
    assert_eq!(
        deletion_completion(&Entity::Instance(Box::new(i)), None),
        DeletionCompletion::Record(Box::new(Event::InstanceDeleted {}))
    );
}

#[test]
fn a_boot_whose_rollback_needs_attention_is_left_as_it_is() {
    // Given a boot that failed in spawn
    let steps = failed(given_a_boot_in_spawn(true));
    // When its rollback stopped at its first compensation and needs attention
    let p = fold(&rolled_back(steps, RollbackOutcome::NeedsAttention));
    assert_eq!(
        operation_of(&p).status,
        Some(OperationStatus::NeedsAttention)
    );
    assert_eq!(
        allocations_on_the_provider(&p),
        1,
        "the claim is still held"
    );
    // Then the instance is in error but still on its host with its task: the boot is not
    // cleaned up (the VM may still run there), and heal-allocations has nothing to claim
    let i = instance_of(&p);
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(i.vm_state, Some(VmState::Error));
    assert_eq!(i.task_state, Some(TaskState::Scheduling));
    assert_eq!(i.host.as_deref(), Some(HOST));
    assert_eq!(i.provider_id, Some(provider().id));
}

#[test]
fn a_boot_that_succeeded_keeps_its_host() {
    // Given a boot whose VM was created
    let mut steps = given_a_boot_in_spawn(true);
    // When the flow records it booted and the runner clears its marker
    steps.push((
        instance(),
        vec![
            Event::VmStateChanged {
                vm_state: VmState::Active,
                reason: "booted".into(),
            },
            Event::TaskFinished {
                task_state: TaskState::Scheduling,
                outcome: TaskOutcome::Succeeded,
                reason: "spawned".into(),
            },
        ],
    ));
    steps.push(on_operation(vec![
        Event::stage_completed(stage::SPAWN),
        Event::operation_succeeded(),
    ]));
    steps.push((
        instance(),
        vec![Event::in_flight_operation_cleared(
            operation().id,
            provledger_events::catalogue::OperationOutcome::Succeeded,
        )],
    ));
    let i = instance_of(&fold(&steps));
    // Then it is active on its host, its task done
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(i.vm_state, Some(VmState::Active));
    assert_eq!(i.task_state, None);
    assert_eq!(i.last_task_outcome, Some(TaskOutcome::Succeeded));
    assert_eq!(i.host.as_deref(), Some(HOST));
    assert_eq!(i.provider_id, Some(provider().id));
}
