//! The pure auditor, as given a log / when audited / then these violations.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    samples, ConsumerKind, Inventory, OperationKind, Ratio, StagePolicy, StageSpec, TaskState,
};
use provledger_events::{AggregateId, Commit, Event, Timestamp};
use provledger_projections::audit::{AuditReport, Auditor, Check};
use provledger_tests::script::{self, ScriptStep};
use uuid::Uuid;

fn provider() -> AggregateId {
    AggregateId::provider(Uuid::from_u128(2))
}

fn instance() -> AggregateId {
    AggregateId::instance(Uuid::from_u128(5))
}

fn vcpu(total: u64) -> Event {
    Event::InventorySet {
        resource_class: "VCPU".into(),
        inventory: Inventory {
            total,
            reserved: 0,
            allocation_ratio: Ratio::ONE,
            min_unit: 1,
            max_unit: 64,
            step_size: 1,
        },
    }
}

fn claim(consumer: AggregateId, n: u64) -> Event {
    Event::AllocationClaimed {
        consumer: consumer.id,
        consumer_kind: ConsumerKind::Instance,
        resources: BTreeMap::from([("VCPU".to_string(), n)]),
    }
}

fn registered() -> Event {
    Event::ProviderRegistered {
        name: "cn1".into(),
        host: "cn1".into(),
    }
}

/// The instance sample: created (building), on no host.
fn create_instance() -> Event {
    samples::all()
        .into_iter()
        .find(|e| matches!(e, Event::InstanceCreateRequested { .. }))
        .expect("sample")
}

fn audit(commits: &[Commit], now_ms: i64) -> AuditReport {
    let mut auditor = Auditor::new();
    for c in commits {
        auditor.commit(c);
    }
    let end = commits.last().map_or(0, |c| c.position);
    auditor.finish(end, Timestamp::from_unix_ms(now_ms))
}

fn checks(report: &AuditReport) -> Vec<Check> {
    report.violations.iter().map(|v| v.check).collect()
}

const LATER: i64 = 1_900_000_000_000;

#[test]
fn a_clean_log_has_no_violation() {
    let commits = script::seal(&[
        (provider(), vec![registered(), vcpu(8)]),
        (instance(), vec![create_instance()]),
        (provider(), vec![claim(instance(), 4)]),
    ]);
    let report = audit(&commits, LATER);
    assert_eq!(checks(&report), vec![]);
    assert_eq!(
        (report.commits, report.position, report.aggregates),
        (3, 3, 2)
    );
}

#[test]
fn a_missing_position_and_a_modified_commit_are_named() {
    let mut commits = script::seal(&[
        (provider(), vec![registered()]),
        (provider(), vec![vcpu(8)]),
        (provider(), vec![vcpu(16)]),
    ]);
    commits[2].position = 5; // positions 3 and 4 lost
    commits[1].actor = "mallory".into(); // v2 altered
    let report = audit(&commits, LATER);
    let found: Vec<(Check, Option<u64>, Option<u64>)> = report
        .violations
        .iter()
        .map(|v| (v.check, v.version, v.position))
        .collect();
    assert_eq!(
        found,
        vec![
            (Check::HashChain, Some(2), Some(2)),
            // v3 is intact and follows a v2 that cannot be folded: v2 is lost to every
            // reader, who answers `integrity` for the provider until it is acknowledged.
            (Check::LostCommits, Some(2), Some(5)),
            (Check::PositionContinuity, None, Some(3)),
        ]
    );
    assert_eq!(report.violations[0].aggregate, Some(provider().to_string()));
}

#[test]
fn on_a_shared_log_a_link_break_is_quarantined_not_a_broken_chain() {
    let mut commits = script::seal(&[
        (provider(), vec![registered()]),
        (provider(), vec![vcpu(8)]),
    ]);
    let mut replay = commits[0].clone();
    replay.position = 3;
    commits.push(replay);
    let mut auditor = Auditor::new().quarantining_link_breaks();
    for c in &commits {
        auditor.commit(c);
    }
    let report = auditor.finish(3, Timestamp::from_unix_ms(LATER));
    assert_eq!(checks(&report), vec![Check::Quarantine]);
    assert_eq!(report.violations[0].position, Some(3));
    assert_eq!(report.quarantined, 1);
}

#[test]
fn a_provider_over_capacity_and_an_allocation_of_a_deleted_instance_are_found() {
    let commits = script::seal(&[
        (provider(), vec![registered(), vcpu(8)]),
        (instance(), vec![create_instance()]),
        (provider(), vec![claim(instance(), 6)]),
        // The hardware shrank: a fact, applied although usage no longer fits.
        (provider(), vec![vcpu(4)]),
        (
            instance(),
            vec![
                Event::InstanceDeleteRequested {
                    reason: "user".into(),
                },
                Event::InstanceDeleted {},
            ],
        ),
    ]);
    let report = audit(&commits, LATER);
    assert_eq!(
        checks(&report),
        vec![Check::ProviderCapacity, Check::OrphanAllocation]
    );
    assert!(report.violations[0].problem.contains("used 6 > capacity 4"));
    assert!(report.violations[1].problem.contains("is deleted"));
}

#[test]
fn a_failed_operation_without_a_finished_rollback_is_found() {
    let op = AggregateId::operation(Uuid::from_u128(3));
    let steps: Vec<ScriptStep> = vec![
        (
            op,
            vec![Event::OperationStarted {
                kind: OperationKind::CreateCluster,
                target: AggregateId::cluster(Uuid::from_u128(1)),
                parent_id: None,
                stages: vec![StageSpec {
                    name: "spawn".into(),
                    policy: StagePolicy::Compensate,
                }],
                bundle_policy: None,
            }],
        ),
        (
            op,
            vec![Event::OperationFailed {
                stage: "spawn".into(),
                step: None,
                error: "boom".into(),
            }],
        ),
    ];
    let report = audit(&script::seal(&steps), LATER);
    assert_eq!(checks(&report), vec![Check::RollbackUnfinished]);
    assert!(report.violations[0].action.contains("rollback run"));
}

#[test]
fn a_task_past_its_lease_is_found_and_one_within_it_is_not() {
    let until = Timestamp::from_unix_ms(1_800_000_100_000);
    let commits = script::seal(&[
        (instance(), vec![create_instance()]),
        (
            instance(),
            vec![Event::TaskStarted {
                task_state: TaskState::Spawning,
                worker_id: "compute-1".into(),
                lease_until: until,
            }],
        ),
    ]);
    assert_eq!(checks(&audit(&commits, until.unix_ms() - 1)), vec![]);
    assert_eq!(
        checks(&audit(&commits, until.unix_ms() + 1)),
        vec![Check::TaskLeaseExpired]
    );
}

#[test]
fn an_instance_claim_where_it_neither_runs_nor_migrates_is_found() {
    // Given an instance running on provider 3 that also holds a claim on provider 2.
    let elsewhere = AggregateId::provider(Uuid::from_u128(3));
    let on_elsewhere = Event::HostAssigned {
        host: "cn2".into(),
        provider_id: elsewhere.id,
    };
    let given = vec![
        (provider(), vec![registered(), vcpu(8)]),
        (elsewhere, vec![registered(), vcpu(8)]),
        (instance(), vec![create_instance(), on_elsewhere]),
        (elsewhere, vec![claim(instance(), 2)]),
        (provider(), vec![claim(instance(), 2)]),
    ];
    // When audited with no migration of it in flight, then the claim on provider 2 is
    // misplaced (and the one where it runs is not).
    let report = audit(&script::seal(&given), LATER);
    assert_eq!(checks(&report), vec![Check::MisplacedAllocation]);
    assert_eq!(
        report.violations[0].aggregate.as_deref(),
        Some(provider().to_string().as_str())
    );

    // When a resize of it is in flight, the claim is its destination: nothing is found.
    let mut migrating = given.clone();
    migrating.push((
        instance(),
        vec![Event::InFlightOperationSet {
            operation_id: Uuid::from_u128(77),
            operation_kind: OperationKind::ResizeInstance,
        }],
    ));
    let report = audit(&script::seal(&migrating), LATER);
    assert_eq!(checks(&report), vec![]);

    // When that resize ends and the claim stays, it is misplaced again.
    migrating.push((
        instance(),
        vec![Event::InFlightOperationCleared {
            operation_id: Uuid::from_u128(77),
            outcome: provledger_events::catalogue::OperationOutcome::RolledBack,
        }],
    ));
    let report = audit(&script::seal(&migrating), LATER);
    assert_eq!(checks(&report), vec![Check::MisplacedAllocation]);
}

/// Given a recovery's re-issue recorded at the script's second commit (1_800_000_001_000),
/// when audited past `REISSUE_UNDELIVERED_AFTER_MS`, then it is reported while pending and
/// not once its worker acknowledged it.
#[test]
fn a_reissue_pending_past_its_age_is_found_and_a_delivered_one_is_not() {
    use provledger_events::catalogue::Reissue;
    use provledger_projections::recovery::REISSUE_UNDELIVERED_AFTER_MS;
    let request_id = Uuid::from_u128(77);
    let requested = vec![
        (instance(), vec![create_instance()]),
        (
            instance(),
            vec![Event::ReissueRequested {
                request_id,
                worker: "compute-1".into(),
                action: Reissue::PowerOff,
                reason: "interrupted".into(),
            }],
        ),
        (
            instance(),
            vec![Event::ReissueAttempted {
                request_id,
                attempt: 1,
            }],
        ),
        (
            instance(),
            vec![Event::ReissueFailed {
                request_id,
                attempt: 1,
                error: "no responders".into(),
            }],
        ),
    ];
    let at = 1_800_000_001_000 + REISSUE_UNDELIVERED_AFTER_MS;
    let pending = script::seal(&requested);
    assert_eq!(checks(&audit(&pending, at - 1)), vec![]);
    let report = audit(&pending, at + 1);
    assert_eq!(checks(&report), vec![Check::ReissueUndelivered]);
    assert!(
        report.violations[0].problem.contains("compute-1")
            && report.violations[0].problem.contains("no responders"),
        "{:?}",
        report.violations[0]
    );
    let mut delivered = requested.clone();
    delivered.push((instance(), vec![Event::ReissueDelivered { request_id }]));
    assert_eq!(checks(&audit(&script::seal(&delivered), at + 1)), vec![]);
    // An operator who carried the task out by hand records its end: nothing is pending.
    let mut by_hand = requested;
    by_hand.push((
        instance(),
        vec![Event::TaskFinished {
            task_state: TaskState::Scheduling,
            outcome: provledger_events::catalogue::TaskOutcome::Succeeded,
            reason: "done by hand".into(),
        }],
    ));
    assert_eq!(checks(&audit(&script::seal(&by_hand), at + 1)), vec![]);
}

/// Given an operation whose rollback was planned and finished, when a runner presumed
/// dead records a step's effect (with its compensation) after the plan, then audit reports
/// it as a late effect nothing undoes, naming its compensation.
#[test]
fn an_effect_recorded_after_its_rollback_was_planned_is_found() {
    use provledger_events::catalogue::{
        Compensation, CompensationAction, Effect, EffectKind, Executor, Origin, RollbackOutcome,
        RollbackPlan, TargetOutcome,
    };
    let op = AggregateId::operation(Uuid::from_u128(3));
    let target = AggregateId::cluster(Uuid::from_u128(1));
    let done = Event::StepDone {
        stage: "spawn".into(),
        step: "create_vm:n1".into(),
        effect: Effect {
            kind: EffectKind::VmCreated,
            resource: "n1".into(),
            executor: "hypervisor".into(),
            origin: Origin::Created,
            detail: Default::default(),
        },
        compensation: Some(Compensation {
            action: CompensationAction::TerminateVm,
            executor: Executor::Service("hypervisor".into()),
            resource: "n1".into(),
            args: Default::default(),
        }),
    };
    let mut steps: Vec<ScriptStep> = vec![(
        op,
        vec![
            Event::OperationStarted {
                kind: OperationKind::CreateCluster,
                target,
                parent_id: None,
                stages: vec![StageSpec {
                    name: "spawn".into(),
                    policy: StagePolicy::Compensate,
                }],
                bundle_policy: None,
            },
            Event::StageStarted {
                stage: "spawn".into(),
            },
            Event::OperationFailed {
                stage: "spawn".into(),
                step: None,
                error: "cancelled; the runner did not stop".into(),
            },
            Event::RollbackPlanned {
                plan: RollbackPlan {
                    rule: "compensate".into(),
                    target,
                    compensations: vec![],
                    retained: vec![],
                    target_outcome: TargetOutcome::Error {
                        description: "failed".into(),
                    },
                },
            },
            Event::RollbackFinished {
                outcome: RollbackOutcome::RolledBack,
                remaining: vec![],
            },
        ],
    )];
    assert_eq!(checks(&audit(&script::seal(&steps), LATER)), vec![]);
    steps.push((op, vec![done]));
    let report = audit(&script::seal(&steps), LATER);
    assert_eq!(checks(&report), vec![Check::LateEffect]);
    assert!(
        report.violations[0]
            .problem
            .contains("terminate_vm n1 at hypervisor"),
        "{:?}",
        report.violations[0]
    );
}

#[test]
fn an_allocation_a_rolled_back_operation_released_only_by_hand_is_found() {
    use provledger_events::catalogue::{
        Compensation, CompensationAction, Effect, EffectKind, Executor, Origin,
        PlannedCompensation, RollbackOutcome, RollbackPlan, TargetOutcome,
    };
    // Given a boot whose claim's release (the ledger's own compensation) was resolved by
    // hand in a log written before the decider refused it, the rollback then finished...
    let op = AggregateId::operation(Uuid::from_u128(3));
    let release = Compensation {
        action: CompensationAction::ReleaseAllocation,
        executor: Executor::Ledger,
        resource: instance().id.to_string(),
        args: BTreeMap::from([("provider_id".to_string(), provider().id.to_string())]),
    };
    let compensation_id = Uuid::from_u128(77);
    let boot = vec![
        Event::OperationStarted {
            kind: OperationKind::BootInstance,
            target: instance(),
            parent_id: None,
            stages: vec![StageSpec {
                name: "schedule".into(),
                policy: StagePolicy::Compensate,
            }],
            bundle_policy: None,
        },
        Event::StageStarted {
            stage: "schedule".into(),
        },
        Event::StepDone {
            stage: "schedule".into(),
            step: "claim".into(),
            effect: Effect {
                kind: EffectKind::AllocationClaimed,
                resource: instance().id.to_string(),
                executor: "ledger".into(),
                origin: Origin::Created,
                detail: Default::default(),
            },
            compensation: Some(release.clone()),
        },
        Event::OperationFailed {
            stage: "schedule".into(),
            step: None,
            error: "no host".into(),
        },
        Event::RollbackPlanned {
            plan: RollbackPlan {
                rule: "compensate".into(),
                target: instance(),
                compensations: vec![PlannedCompensation {
                    compensation_id,
                    stage: "schedule".into(),
                    step: "claim".into(),
                    compensation: release,
                }],
                retained: vec![],
                target_outcome: TargetOutcome::Error {
                    description: "failed".into(),
                },
            },
        },
        Event::RollbackFinished {
            outcome: RollbackOutcome::NeedsAttention,
            remaining: vec![compensation_id],
        },
        Event::CompensationResolved {
            compensation_id,
            reason: "by hand".into(),
        },
        Event::RollbackResumed {
            reason: "every stuck compensation resolved by hand".into(),
        },
        Event::RollbackFinished {
            outcome: RollbackOutcome::RolledBack,
            remaining: vec![],
        },
    ];
    let mut steps: Vec<ScriptStep> = vec![
        (provider(), vec![registered(), vcpu(8)]),
        (instance(), vec![create_instance()]),
        (provider(), vec![claim(instance(), 1)]),
        (op, boot),
    ];
    // ...then audit names the allocation the rollback left held...
    let report = audit(&script::seal(&steps), LATER);
    assert!(
        checks(&report).contains(&Check::HeldAfterRollback),
        "{:?}",
        report.violations
    );
    // ...and once it is released, nothing is left to report.
    steps.push((
        provider(),
        vec![Event::AllocationReleased {
            consumer: instance().id,
            reason: "released by hand".into(),
        }],
    ));
    let report = audit(&script::seal(&steps), LATER);
    assert!(
        !checks(&report).contains(&Check::HeldAfterRollback),
        "{:?}",
        report.violations
    );
}

#[test]
fn the_formats_read_are_counted_and_the_first_undecodable_entry_is_named() {
    // Given a log of two commits with two undecodable entries after them;
    let commits = script::seal(&[
        (
            provider(),
            vec![Event::ProviderRegistered {
                name: "n".into(),
                host: "h".into(),
            }],
        ),
        (provider(), vec![vcpu(8)]),
    ]);
    let mut auditor = Auditor::new();
    for c in &commits {
        auditor.commit(c);
    }
    // when the shell reports them as it reads them,
    auditor.undecodable(
        3,
        "provledger.ev.provider.x",
        Some(9),
        "unknown format version 9",
    );
    auditor.undecodable(4, "provledger.ev.provider.y", None, "empty payload");
    let report = auditor.finish(4, Timestamp::from_unix_ms(LATER));
    // then both are quarantined, the first is named, and format 1 was read twice.
    assert_eq!(report.formats, BTreeMap::from([(1, 2)]));
    assert_eq!(report.undecodable, 2);
    assert_eq!(report.quarantined, 2);
    let first = report.first_undecodable.clone().expect("named");
    assert_eq!((first.position, first.format), (3, Some(9)));
    assert_eq!(first.subject, "provledger.ev.provider.x");
    assert_eq!(checks(&report), vec![Check::Quarantine, Check::Quarantine]);
}
