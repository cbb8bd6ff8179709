//! Facts decided in the pure core, as given state / when / then.

use std::sync::Arc;

use provledger_events::catalogue::{
    ClusterStatus, NodeGroupSpec, NodeGroupTarget, OperationKind, OperationOutcome,
    RollbackOutcome, RollbackPlan, TargetOutcome,
};
use provledger_events::{AggregateId, Event};
use provledger_projections::facts::rollback_target_events;
use provledger_projections::operation::OperationState;
use provledger_projections::{Entity, Projection};
use provledger_tests::script;
use uuid::Uuid;

fn cluster() -> AggregateId {
    AggregateId::cluster(Uuid::from_u128(1))
}

fn operation() -> AggregateId {
    AggregateId::operation(Uuid::from_u128(9))
}

fn node(n: u128) -> Uuid {
    Uuid::from_u128(100 + n)
}

fn group(name: &str, count: u32) -> NodeGroupSpec {
    NodeGroupSpec {
        name: name.into(),
        count,
        flavor: "m1.large".into(),
        resources: Default::default(),
        processes: vec!["datanode".into()],
    }
}

fn joined(group: &str, n: u128) -> Event {
    Event::InstanceJoined {
        node_group: group.into(),
        instance_id: node(n),
    }
}

fn left(group: &str, n: u128) -> Event {
    Event::InstanceLeft {
        node_group: group.into(),
        instance_id: node(n),
        reason: "rolled back".into(),
    }
}

/// Given a cluster with `compute` (1 node) and `data` (2 nodes), a scale of `kind` asking
/// compute 3 and data 1, and what happened to the members since.
fn given(kind: OperationKind, since: Vec<Event>) -> (OperationState, Entity) {
    let mut events = vec![
        Event::ClusterCreateRequested {
            name: "analytics".into(),
            plugin: "vanilla".into(),
            node_groups: vec![group("compute", 1), group("data", 2)],
        },
        joined("compute", 1),
        joined("data", 2),
        joined("data", 3),
        Event::ClusterStatusChanged {
            status: ClusterStatus::Active,
            description: "ready".into(),
        },
        Event::InFlightOperationSet {
            operation_id: operation().id,
            operation_kind: kind,
        },
        Event::ClusterScaleRequested {
            targets: vec![
                NodeGroupTarget {
                    name: "compute".into(),
                    count: 3,
                },
                NodeGroupTarget {
                    name: "data".into(),
                    count: 1,
                },
            ],
        },
    ];
    events.extend(since);
    let steps = vec![
        (cluster(), events),
        (
            operation(),
            vec![Event::OperationStarted {
                kind,
                target: cluster(),
                parent_id: None,
                stages: vec![],
                bundle_policy: None,
            }],
        ),
    ];
    let projection = Projection::rebuild(&script::seal(&steps));
    let Some(Entity::Operation(mut op)) = projection.get(&operation()).cloned() else {
        panic!("the operation folds");
    };
    op.rollback_plan = Some(Arc::new(RollbackPlan {
        rule: "terminate new nodes, finish the removal".into(),
        target: cluster(),
        compensations: vec![],
        retained: vec![],
        target_outcome: TargetOutcome::Active {
            description: "scale failed; rolled back".into(),
        },
    }));
    let target = projection
        .get(&cluster())
        .cloned()
        .expect("the cluster folds");
    (op, target)
}

fn counts(events: &[Event]) -> Option<Vec<(String, u32)>> {
    events.iter().find_map(|e| match e {
        Event::ClusterScaleRequested { targets } => {
            Some(targets.iter().map(|t| (t.name.clone(), t.count)).collect())
        }
        _ => None,
    })
}

#[test]
fn a_rolled_back_scale_puts_each_group_count_back_to_its_members() {
    // Given a scale that added compute nodes 4 and 5, then failed: its rollback removed
    // them again and finished the data node's removal.
    let (op, cluster) = given(
        OperationKind::ScaleCluster,
        vec![
            joined("compute", 4),
            joined("compute", 5),
            left("compute", 4),
            left("compute", 5),
            left("data", 3),
        ],
    );
    // When the rollback ends.
    let events = rollback_target_events(&op, Some(&cluster), RollbackOutcome::RolledBack);
    // Then compute is back to 1 (what the scale added was undone), data stays at 1 (the
    // removal was finished), the cluster is active and the in-flight marker cleared.
    assert_eq!(counts(&events), Some(vec![("compute".into(), 1)]));
    assert!(events.contains(&Event::ClusterStatusChanged {
        status: ClusterStatus::Active,
        description: "scale failed; rolled back".into(),
    }));
    assert_eq!(
        events.last(),
        Some(&Event::InFlightOperationCleared {
            operation_id: operation().id,
            outcome: OperationOutcome::RolledBack,
        })
    );
}

#[test]
fn a_scale_whose_members_match_its_counts_restores_nothing() {
    // Given a scale whose rollback left every group at the count it asked for.
    let (op, cluster) = given(
        OperationKind::ScaleCluster,
        vec![joined("compute", 4), joined("compute", 5), left("data", 3)],
    );
    // When the rollback ends (held: the new nodes were kept), then no count changes.
    let events = rollback_target_events(&op, Some(&cluster), RollbackOutcome::Held);
    assert_eq!(counts(&events), None);
}

#[test]
fn a_rollback_that_needs_attention_leaves_the_cluster_in_error_saying_where_to_look() {
    let (op, cluster) = given(
        OperationKind::ScaleCluster,
        vec![joined("compute", 4), left("data", 3)],
    );
    let events = rollback_target_events(&op, Some(&cluster), RollbackOutcome::NeedsAttention);
    assert_eq!(counts(&events), Some(vec![("compute".into(), 2)]));
    assert!(events.iter().any(|e| matches!(e,
        Event::ClusterStatusChanged { status: ClusterStatus::Error, description }
            if description.contains("needs attention") && description.contains(&operation().id.to_string()))));
}

#[test]
fn a_create_rollback_never_rewrites_counts() {
    // Given a create whose members are fewer than asked (its rollback terminated them).
    let (op, cluster) = given(OperationKind::CreateCluster, vec![left("compute", 1)]);
    let events = rollback_target_events(&op, Some(&cluster), RollbackOutcome::RolledBack);
    assert_eq!(counts(&events), None);
}
