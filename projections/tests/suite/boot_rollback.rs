//! A boot that fails and is rolled back, as given commits / when the rollback's records are
//! folded / then what the instance says (issue 37, item 10: a rolled-back instance showed
//! `task_state: scheduling` and its old host after its allocation was released).
//!
//! The rollback's records are those the driver writes, decided by the same pure functions
//! it asks (`plan_rollback`, `rollback_target_events`, `resumed_target_marker`): the plan,
//! each compensation requested and done (the claim's release on the provider), the target's
//! outcome on the instance, and the rollback's end; for a rollback that needed attention,
//! the operator's resume (with the boot's marker on the instance again) and the rest of it.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    Compensation, CompensationAction, ConsumerKind, Effect, EffectKind, Executor, OperationKind,
    Origin, PowerState, RollbackOutcome, TaskOutcome, TaskState, VmState,
};
use provledger_events::{AggregateId, Event, Timestamp};
use provledger_projections::facts::{
    deletion_completion, resumed_target_marker, rollback_target_events, rollback_target_fact,
    DeletionCompletion,
};
use provledger_projections::instance::InstanceState;
use provledger_projections::operation::{CompensationProgress, OperationState, OperationStatus};
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

/// When a driver rolls the stopped boot back and it ends as `outcome`: the plan (unless
/// recorded already), then every compensation not done yet requested (its next attempt)
/// and done (the claim's release recorded on the provider), or for `needs_attention` the
/// first of them failed; then the target's outcome on the instance and the rollback's end.
/// After a resume this is the rest of the rollback.
fn rolled_back(mut steps: Vec<ScriptStep>, outcome: RollbackOutcome) -> Vec<ScriptStep> {
    let op = operation_of(&fold(&steps));
    if op.rollback_plan.is_none() {
        let plan = plan_rollback(&op, &[]).expect("a plan");
        steps.push(on_operation(vec![Event::rollback_planned(plan)]));
    }
    let op = operation_of(&fold(&steps));
    let open: Vec<_> = op
        .compensations
        .iter()
        .filter(|c| c.progress != CompensationProgress::Done)
        .collect();
    let mut remaining = Vec::new();
    for c in &open {
        let id = c.planned.compensation_id;
        let attempt = c.attempts + 1;
        steps.push(on_operation(vec![Event::compensation_requested(
            id, attempt,
        )]));
        if outcome == RollbackOutcome::NeedsAttention {
            steps.push(on_operation(vec![Event::CompensationFailed {
                compensation_id: id,
                attempt,
                error: "executor unreachable".into(),
            }]));
            remaining = open.iter().map(|c| c.planned.compensation_id).collect();
            break;
        }
        if c.planned.compensation.action == CompensationAction::ReleaseAllocation {
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

/// When an operator resumes the rollback that needed attention (the executors work
/// again), as `resume_needs_attention` records it: `rollback_resumed` on the operation
/// and, in the same atomic set, the boot's in-flight marker on the instance again if
/// `resumed_target_marker` says so.
fn resumed(mut steps: Vec<ScriptStep>) -> Vec<ScriptStep> {
    let p = fold(&steps);
    let marker = resumed_target_marker(&operation_of(&p), p.get(&instance()));
    steps.push(on_operation(vec![Event::rollback_resumed(
        "the executors are back",
    )]));
    steps.extend(marker.map(|m| (instance(), vec![m])));
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

#[test]
fn a_boot_whose_rollback_needed_attention_ends_with_no_task_and_no_host_once_rolled_back() {
    // Given a boot on cn1 that failed in spawn, whose rollback stopped at its first
    // compensation and needs attention: the instance is in error and still on its host
    let steps = rolled_back(
        failed(given_a_boot_in_spawn(true)),
        RollbackOutcome::NeedsAttention,
    );
    let i = instance_of(&fold(&steps));
    assert_eq!(
        i.in_flight, None,
        "a stuck rollback holds nothing: a delete may go on"
    );
    assert_eq!(
        (i.vm_state, i.host.as_deref()),
        (Some(VmState::Error), Some(HOST))
    );
    // When an operator resumes it and it runs to its end (the VM terminated, the IP and
    // the claim released)
    let p = fold(&rolled_back(resumed(steps), RollbackOutcome::RolledBack));
    assert_eq!(operation_of(&p).status, Some(OperationStatus::RolledBack));
    assert_eq!(allocations_on_the_provider(&p), 0, "the claim is released");
    // Then the instance ends as a boot rolled back at once does: in error, no task in
    // progress, no host, nothing in flight
    let i = instance_of(&p);
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(i.vm_state, Some(VmState::Error));
    assert_eq!(i.task_state, None, "no task is in progress");
    assert_eq!(i.last_task_outcome, Some(TaskOutcome::Failed));
    assert_eq!((i.host.as_deref(), i.provider_id), (None, None));
    assert_eq!(i.power_state, PowerState::NoState);
    assert_eq!(i.in_flight, None);
    assert_eq!(heal_claim(&i), Err(HealSkip::NoHost));
    assert_eq!(recover(&i, later()), None);
}

#[test]
fn a_rollback_that_needs_attention_again_after_a_resume_lets_go_of_the_instance_again() {
    // Given a boot whose rollback needed attention, was resumed, and stopped again
    let steps = rolled_back(
        failed(given_a_boot_in_spawn(true)),
        RollbackOutcome::NeedsAttention,
    );
    let steps = rolled_back(resumed(steps), RollbackOutcome::NeedsAttention);
    let p = fold(&steps);
    assert_eq!(
        operation_of(&p).status,
        Some(OperationStatus::NeedsAttention)
    );
    // Then the instance is as after the first stop: in error, on its host, held by nothing
    let i = instance_of(&p);
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(
        i.in_flight, None,
        "a stuck rollback holds nothing: a delete may go on"
    );
    assert_eq!(i.task_state, Some(TaskState::Scheduling));
    assert_eq!(i.host.as_deref(), Some(HOST));
    // When it is resumed once more and runs to its end
    let i = instance_of(&fold(&rolled_back(
        resumed(steps),
        RollbackOutcome::RolledBack,
    )));
    // Then the build is over on the instance
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(
        (i.task_state, i.host.as_deref(), i.provider_id, i.in_flight),
        (None, None, None, None)
    );
}

#[test]
fn a_rollback_resumed_after_the_user_deleted_the_instance_leaves_the_delete_to_finish() {
    // Given a boot whose rollback needs attention, and then the user deleted the instance
    let mut steps = rolled_back(
        failed(given_a_boot_in_spawn(true)),
        RollbackOutcome::NeedsAttention,
    );
    steps.push((
        instance(),
        vec![Event::InstanceDeleteRequested {
            reason: "the user deleted it".into(),
        }],
    ));
    // When the rollback is resumed and runs to its end
    let p = fold(&rolled_back(resumed(steps), RollbackOutcome::RolledBack));
    assert_eq!(allocations_on_the_provider(&p), 0);
    // Then the delete is the task in progress, nothing is refused, and the deletion can
    // complete: nothing of the instance remains
    let i = instance_of(&p);
    assert_eq!(i.header.anomaly_count, 0, "{:?}", i.header.anomalies);
    assert_eq!(i.task_state, Some(TaskState::Deleting));
    assert_eq!(i.in_flight, None);
    assert_eq!(
        deletion_completion(&Entity::Instance(Box::new(i)), None),
        DeletionCompletion::Record(Box::new(Event::InstanceDeleted {}))
    );
}

#[test]
fn each_end_of_a_rollback_on_its_instance_is_its_own_fact_and_a_retry_keeps_its_name() {
    // Given a boot whose rollback needed attention, needed it again after a resume, and
    // ended rolled_back after a second resume
    let first = rolled_back(
        failed(given_a_boot_in_spawn(true)),
        RollbackOutcome::NeedsAttention,
    );
    let second = rolled_back(resumed(first.clone()), RollbackOutcome::NeedsAttention);
    let last = rolled_back(resumed(second.clone()), RollbackOutcome::RolledBack);
    // When a driver decides each end on the operation as it was then (before its
    // `rollback_finished`, the last commit of each)
    let name = |steps: &[ScriptStep], outcome| {
        let p = fold(&steps[..steps.len() - 1]);
        let fact = rollback_target_fact(&operation_of(&p), p.get(&instance()), outcome)
            .expect("a fact on the instance");
        assert_eq!(fact.aggregate, instance());
        fact.name
    };
    let names = [
        name(&first, RollbackOutcome::NeedsAttention),
        name(&second, RollbackOutcome::NeedsAttention),
        name(&last, RollbackOutcome::RolledBack),
    ];
    // Then each end has its own name (its own commit id), none the name every end had
    // before (so a rollback stopped under it still gets its final end written), and a
    // retry of an end decided on the same state names it the same
    assert_eq!(
        names
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        3,
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n == "target_outcome"), "{names:?}");
    assert_eq!(name(&second, RollbackOutcome::NeedsAttention), names[1]);
}

#[test]
fn a_resume_takes_back_an_instance_only_if_nothing_else_holds_it() {
    // Given a boot whose rollback needs attention
    let steps = rolled_back(
        failed(given_a_boot_in_spawn(true)),
        RollbackOutcome::NeedsAttention,
    );
    let marker = |steps: &[ScriptStep]| {
        let p = fold(steps);
        resumed_target_marker(&operation_of(&p), p.get(&instance()))
    };
    // Then its resume holds the free instance again, for the boot
    assert_eq!(
        marker(&steps),
        Some(Event::in_flight_operation_set(
            operation().id,
            OperationKind::BootInstance
        ))
    );
    // But not once another operation holds it (it is not taken away from that one)
    let mut held = steps.clone();
    held.push((
        instance(),
        vec![Event::in_flight_operation_set(
            Uuid::from_u128(0x0C),
            OperationKind::RebootInstance,
        )],
    ));
    assert_eq!(marker(&held), None);
    // Nor once it is being deleted (its delete finishes it)
    let mut deleting = steps.clone();
    deleting.push((
        instance(),
        vec![Event::InstanceDeleteRequested {
            reason: "the user deleted it".into(),
        }],
    ));
    assert_eq!(marker(&deleting), None);
    // Nor when the rollback does not need attention (it already holds it, or is over)
    assert_eq!(marker(&resumed(steps.clone())), None);
    assert_eq!(
        marker(&rolled_back(resumed(steps), RollbackOutcome::RolledBack)),
        None
    );
}
