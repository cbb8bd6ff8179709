//! The folds, as given events / when / then, and the property that folding in pieces
//! (with each entity encoded and decoded in between, as the runner stores it) equals one
//! rebuild from position 1.

use std::collections::BTreeMap;

use proptest::prelude::*;
use provledger_events::catalogue::{
    samples, ClusterStatus, ConsumerKind, Effect, EffectKind, Inventory, OperationKind, Origin,
    Ratio, StagePolicy, StageSpec,
};
use provledger_events::{AggregateId, Event};
use provledger_projections::{Entity, Projection};
use provledger_tests::script::{self, ScriptStep};
use uuid::Uuid;

/// Given these commits (one per step), fold them and return the projection.
fn given(steps: Vec<ScriptStep>) -> Projection {
    Projection::rebuild(&script::seal(&steps))
}

fn cluster_id() -> AggregateId {
    AggregateId::cluster(Uuid::from_u128(1))
}

fn provider_id() -> AggregateId {
    AggregateId::provider(Uuid::from_u128(2))
}

fn create_cluster() -> Event {
    samples::all().remove(0)
}

fn vcpu(total: u64, ratio: u32) -> Event {
    Event::InventorySet {
        resource_class: "VCPU".into(),
        inventory: Inventory {
            total,
            reserved: 0,
            allocation_ratio: Ratio(ratio),
            min_unit: 1,
            max_unit: 64,
            step_size: 1,
        },
    }
}

fn claim(consumer: u128, vcpus: u64) -> Event {
    Event::AllocationClaimed {
        consumer: Uuid::from_u128(consumer),
        consumer_kind: ConsumerKind::Instance,
        resources: BTreeMap::from([("VCPU".to_string(), vcpus)]),
    }
}

fn registered() -> Event {
    Event::ProviderRegistered {
        name: "cn1".into(),
        host: "cn1".into(),
    }
}

#[test]
fn deleting_is_terminal_and_a_later_active_is_an_anomaly() {
    let p = given(vec![
        (cluster_id(), vec![create_cluster()]),
        (
            cluster_id(),
            vec![Event::ClusterDeleteRequested {
                reason: "user".into(),
            }],
        ),
        (
            cluster_id(),
            vec![Event::ClusterStatusChanged {
                status: ClusterStatus::Active,
                description: "late worker".into(),
            }],
        ),
    ]);
    let Some(Entity::Cluster(c)) = p.get(&cluster_id()) else {
        panic!("cluster missing")
    };
    assert_eq!(c.status, Some(ClusterStatus::Deleting));
    assert_eq!(c.header.anomaly_count, 1);
    assert!(c.header.anomalies[0]
        .problem
        .contains("deleting is terminal"));
    assert_eq!(c.view()["status"], "deleting");
}

#[test]
fn a_repeated_delete_request_is_idempotent_not_an_anomaly() {
    let delete = Event::ClusterDeleteRequested {
        reason: "user".into(),
    };
    let p = given(vec![
        (cluster_id(), vec![create_cluster()]),
        (cluster_id(), vec![delete.clone()]),
        (cluster_id(), vec![delete]),
    ]);
    let c = p.get(&cluster_id()).unwrap();
    assert_eq!(c.header().anomaly_count, 0);
    assert_eq!(c.header().version, 3);
}

#[test]
fn claims_fill_capacity_exactly_and_the_next_one_is_refused() {
    // Capacity is (total - reserved) * ratio = 4 * 1.5 = 6.
    let p = given(vec![
        (provider_id(), vec![registered(), vcpu(4, 1500)]),
        (provider_id(), vec![claim(10, 4), claim(11, 2)]),
        (provider_id(), vec![claim(12, 1)]),
    ]);
    let Some(Entity::Provider(pr)) = p.get(&provider_id()) else {
        panic!("provider missing")
    };
    assert_eq!(pr.usage["VCPU"], 6);
    assert_eq!(pr.allocations.len(), 2);
    assert_eq!(pr.header.anomaly_count, 1);
    assert!(pr.header.anomalies[0].problem.contains("over capacity"));
    assert_eq!(pr.view()["capacity"]["VCPU"], 6);
}

#[test]
fn a_claim_replaces_the_consumers_previous_allocation() {
    let p = given(vec![
        (provider_id(), vec![registered(), vcpu(4, 1000)]),
        (provider_id(), vec![claim(10, 3), claim(10, 4)]),
    ]);
    let Some(Entity::Provider(pr)) = p.get(&provider_id()) else {
        panic!("provider missing")
    };
    assert_eq!(
        pr.usage["VCPU"], 4,
        "the 3 were given back before the 4 were taken"
    );
    assert_eq!(pr.header.anomaly_count, 0);
}

#[test]
fn a_provider_holding_allocations_is_never_deleted() {
    let p = given(vec![
        (
            provider_id(),
            vec![registered(), vcpu(8, 1000), claim(10, 2)],
        ),
        (
            provider_id(),
            vec![
                Event::ProviderDeleteRequested {
                    cascade: false,
                    reason: "decommission".into(),
                },
                Event::ProviderDeleted {},
            ],
        ),
    ]);
    let pr = p.get(&provider_id()).unwrap();
    assert_eq!(pr.status_word(), "deleting");
    assert_eq!(pr.header().anomaly_count, 1);
}

#[test]
fn a_shrunk_inventory_is_applied_and_reported_over_capacity() {
    let p = given(vec![
        (
            provider_id(),
            vec![registered(), vcpu(8, 1000), claim(10, 6)],
        ),
        (provider_id(), vec![vcpu(4, 1000)]),
    ]);
    let Some(Entity::Provider(pr)) = p.get(&provider_id()) else {
        panic!("provider missing")
    };
    assert_eq!(pr.over_capacity(), vec!["VCPU".to_string()]);
    assert_eq!(pr.header.anomaly_count, 1);
}

#[test]
fn an_effect_outside_its_stage_is_still_recorded_for_the_planner() {
    let op = AggregateId::operation(Uuid::from_u128(3));
    let p = given(vec![
        (
            op,
            vec![Event::OperationStarted {
                kind: OperationKind::CreateCluster,
                target: cluster_id(),
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
            vec![Event::StepDone {
                stage: "spawn".into(),
                step: "ip".into(),
                effect: Effect {
                    kind: EffectKind::IpAcquired,
                    resource: "10.0.0.9".into(),
                    executor: "ipam".into(),
                    origin: Origin::Created,
                    detail: BTreeMap::new(),
                },
                compensation: None,
            }],
        ),
    ]);
    let Some(Entity::Operation(o)) = p.get(&op) else {
        panic!("operation missing")
    };
    assert_eq!(o.steps.len(), 1, "the effect happened and is kept");
    assert_eq!(o.header.anomaly_count, 1, "stage 'spawn' was never started");
}

#[test]
fn a_commit_folded_twice_is_not_applied_twice() {
    let commits = script::seal(&[
        (provider_id(), vec![registered(), vcpu(8, 1000)]),
        (provider_id(), vec![claim(10, 2)]),
    ]);
    let mut p = Projection::rebuild(&commits);
    p.apply(&commits[1]);
    let Some(Entity::Provider(pr)) = p.get(&provider_id()) else {
        panic!("provider missing")
    };
    assert_eq!(pr.usage["VCPU"], 2);
    assert_eq!(pr.header.anomaly_count, 1);
}

fn roundtrip(entity: &Entity) -> Entity {
    let config = bincode::config::standard();
    let bytes = bincode::serde::encode_to_vec(entity, config).expect("encode");
    let (back, _) = bincode::serde::decode_from_slice(&bytes, config).expect("decode");
    back
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Folding in arbitrary pieces, with every entity stored and loaded between pieces,
    /// gives exactly the state of one rebuild from position 1.
    #[test]
    fn rebuild_equals_incremental_folding(steps in script::script(80), cuts in proptest::collection::vec(1usize..20, 1..10)) {
        let commits = script::seal(&steps);
        let rebuilt = Projection::rebuild(&commits);

        let mut incremental = Projection::new();
        let mut rest: &[_] = &commits;
        let mut cut = cuts.iter().cycle();
        while !rest.is_empty() {
            let n = (*cut.next().unwrap()).min(rest.len());
            let (piece, tail) = rest.split_at(n);
            for commit in piece {
                incremental.apply(commit);
            }
            incremental.entities = incremental
                .entities
                .iter()
                .map(|(id, e)| (*id, roundtrip(e)))
                .collect();
            rest = tail;
        }
        prop_assert_eq!(&incremental, &rebuilt);
        prop_assert_eq!(incremental.summary(), rebuilt.summary());
    }
}

#[test]
fn an_operation_whose_target_was_deleted_closes_cancelled_even_if_a_step_failed_first() {
    use provledger_events::catalogue::{RollbackOutcome, RollbackPlan, TargetOutcome};
    use provledger_projections::operation::OperationStatus;
    let op = AggregateId::operation(Uuid::from_u128(3));
    let started = Event::OperationStarted {
        kind: OperationKind::CreateCluster,
        target: cluster_id(),
        parent_id: None,
        stages: vec![StageSpec {
            name: "spawn".into(),
            policy: StagePolicy::Compensate,
        }],
        bundle_policy: None,
    };
    // Given a delete noticed while a step was failing anyway...
    let p = given(vec![
        (op, vec![started]),
        (
            op,
            vec![Event::TargetDeletionNoticed {
                reason: "user deleted the cluster".into(),
            }],
        ),
        (
            op,
            vec![Event::OperationFailed {
                stage: "spawn".into(),
                step: Some("create_vm".into()),
                error: "hypervisor gone".into(),
            }],
        ),
        (
            op,
            vec![Event::RollbackPlanned {
                plan: RollbackPlan {
                    rule: "terminate everything created".into(),
                    target: cluster_id(),
                    compensations: vec![],
                    retained: vec![],
                    target_outcome: TargetOutcome::Deleted,
                },
            }],
        ),
        // ...when its rollback finishes...
        (
            op,
            vec![Event::RollbackFinished {
                outcome: RollbackOutcome::RolledBack,
                remaining: vec![],
            }],
        ),
    ]);
    // ...then it closes cancelled, as the design says for a deleted target.
    let Some(Entity::Operation(o)) = p.get(&op) else {
        panic!("operation missing")
    };
    assert_eq!(o.status, Some(OperationStatus::Cancelled));
    assert!(o.is_closed());
    assert_eq!(o.header.anomaly_count, 0, "{:?}", o.header.anomalies);
}

/// The time `script::seal` records commit `index` at.
fn time_of_commit(index: i64) -> provledger_events::Timestamp {
    provledger_events::Timestamp::from_unix_ms(1_800_000_000_000 + index * 1000)
}

#[test]
fn an_operations_times_are_those_of_its_start_failure_close_and_last_commit() {
    use provledger_events::catalogue::{RollbackOutcome, RollbackPlan, TargetOutcome};
    use provledger_projections::view::{OperationSummary, OperationView};
    let op = AggregateId::operation(Uuid::from_u128(4));
    let started = Event::OperationStarted {
        kind: OperationKind::CreateCluster,
        target: cluster_id(),
        parent_id: None,
        stages: vec![StageSpec {
            name: "spawn".into(),
            policy: StagePolicy::Compensate,
        }],
        bundle_policy: None,
    };
    let finished = |outcome| Event::RollbackFinished {
        outcome,
        remaining: vec![],
    };
    // Given an operation started (commit 1, after a cluster's commit 0), a stage (2), a
    // failure (3), its rollback planned (4) and stopped needing attention (5), and a
    // commit on another aggregate (6)...
    let mut steps: Vec<ScriptStep> = vec![
        (cluster_id(), vec![create_cluster()]),
        (op, vec![started]),
        (
            op,
            vec![Event::StageStarted {
                stage: "spawn".into(),
            }],
        ),
        (
            op,
            vec![Event::OperationFailed {
                stage: "spawn".into(),
                step: None,
                error: "hypervisor gone".into(),
            }],
        ),
        (
            op,
            vec![Event::RollbackPlanned {
                plan: RollbackPlan {
                    rule: "terminate everything created".into(),
                    target: cluster_id(),
                    compensations: vec![],
                    retained: vec![],
                    target_outcome: TargetOutcome::Deleted,
                },
            }],
        ),
        (op, vec![finished(RollbackOutcome::NeedsAttention)]),
        (provider_id(), vec![registered()]),
    ];
    let view = |steps: &[ScriptStep]| {
        let p = given(steps.to_vec());
        let Some(Entity::Operation(o)) = p.get(&op) else {
            panic!("operation missing")
        };
        (OperationView::of(o), OperationSummary::of(o))
    };
    // ...when it is viewed, then its view and its summary carry the times of those commits.
    let (v, s) = view(&steps);
    let times = |started, failed, finished, last| (started, failed, finished, last);
    let expected = times(
        Some(time_of_commit(1)),
        Some(time_of_commit(3)),
        Some(time_of_commit(5)),
        Some(time_of_commit(5)),
    );
    assert_eq!(
        times(v.started_at, v.failed_at, v.finished_at, v.last_commit_at),
        expected
    );
    assert_eq!(
        times(s.started_at, s.failed_at, s.finished_at, s.last_commit_at),
        expected
    );
    // Given its rollback then resumed (commit 7): it is not finished any more...
    steps.push((
        op,
        vec![Event::RollbackResumed {
            reason: "executor back".into(),
        }],
    ));
    let (v, _) = view(&steps);
    assert_eq!(
        times(v.started_at, v.failed_at, v.finished_at, v.last_commit_at),
        times(
            Some(time_of_commit(1)),
            Some(time_of_commit(3)),
            None,
            Some(time_of_commit(7))
        )
    );
    // ...and once it finishes again (commit 8), it finished then.
    steps.push((op, vec![finished(RollbackOutcome::RolledBack)]));
    let (v, _) = view(&steps);
    assert_eq!(
        (v.finished_at, v.last_commit_at),
        (Some(time_of_commit(8)), Some(time_of_commit(8)))
    );
    // A JSON view says each time in RFC 3339.
    let json = serde_json::to_value(&v).expect("a view is JSON");
    assert_eq!(json["started_at"], "2027-01-15T08:00:01Z");
}
