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
use provledger_tests::{script, workload};
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

fn started(kind: OperationKind, target: AggregateId) -> Event {
    Event::OperationStarted {
        kind,
        target,
        parent_id: None,
        stages: vec![],
        bundle_policy: None,
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
        (operation(), vec![started(kind, cluster())]),
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
    (*op, target)
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

// ---- an interrupted migration's recovery (Nova: revert to the source) ----

mod migration {
    use provledger_events::catalogue::{ConsumerKind, OperationKind, TaskState};
    use provledger_events::{AggregateId, Event, Timestamp};
    use provledger_projections::facts::{recovery_facts, Fact};
    use provledger_projections::recovery::recover;
    use provledger_projections::{Entity, Projection};
    use provledger_tests::{script, workload};
    use uuid::Uuid;

    const LEASE: i64 = 1_800_000_100_000;

    fn vm() -> AggregateId {
        AggregateId::instance(Uuid::from_u128(5))
    }
    fn source() -> AggregateId {
        AggregateId::provider(Uuid::from_u128(21))
    }
    fn destination() -> AggregateId {
        AggregateId::provider(Uuid::from_u128(22))
    }
    fn resize() -> AggregateId {
        AggregateId::operation(Uuid::from_u128(31))
    }

    fn on(provider: AggregateId, host: &str) -> Event {
        Event::HostAssigned {
            host: host.into(),
            provider_id: provider.id,
        }
    }

    /// Given an active VM on `host_on` whose resize from the source to the destination was
    /// interrupted (the worker's lease expired), with the source held by `source_holder`
    /// (the migration, or the VM itself) and the destination by the VM.
    fn given(host_on: (AggregateId, &str), source_holder: (Uuid, ConsumerKind)) -> Vec<Fact> {
        given_migration(
            OperationKind::ResizeInstance,
            TaskState::ResizeMigrating,
            host_on,
            source_holder,
        )
    }

    fn given_migration(
        kind: OperationKind,
        task: TaskState,
        host_on: (AggregateId, &str),
        source_holder: (Uuid, ConsumerKind),
    ) -> Vec<Fact> {
        let mut vm_events = workload::instance_running_on(source().id);
        vm_events.extend([
            Event::InFlightOperationSet {
                operation_id: resize().id,
                operation_kind: kind,
            },
            on(host_on.0, host_on.1),
            Event::TaskStarted {
                task_state: task,
                worker_id: "compute-1".into(),
                lease_until: Timestamp::from_unix_ms(LEASE),
            },
        ]);
        let steps = vec![
            (source(), workload::compute_node(21)),
            (destination(), workload::compute_node(22)),
            (resize(), vec![super::started(kind, vm())]),
            (vm(), vm_events),
            (
                source(),
                workload::vcpu_claim(source_holder.0, source_holder.1, 2),
            ),
            (
                destination(),
                workload::vcpu_claim(vm().id, ConsumerKind::Instance, 4),
            ),
        ];
        let state = Projection::rebuild(&script::seal(&steps));
        let Some(Entity::Instance(instance)) = state.get(&vm()) else {
            panic!("the VM folds");
        };
        let recovery = recover(instance, Timestamp::from_unix_ms(LEASE + 1)).expect("recovered");
        recovery_facts(&recovery, instance, state.providers(), |id| state.get(id))
    }

    fn on_aggregate(facts: &[Fact], aggregate: AggregateId) -> Vec<Event> {
        facts
            .iter()
            .filter(|f| f.aggregate == aggregate)
            .flat_map(|f| f.events.clone())
            .collect()
    }

    fn released(events: &[Event], consumer: Uuid) -> bool {
        events
            .iter()
            .any(|e| matches!(e, Event::AllocationReleased { consumer: c, .. } if *c == consumer))
    }

    #[test]
    fn with_the_host_still_on_the_source_the_destination_claim_is_released() {
        // When recovered with the host on the source and the source held by the migration.
        let facts = given((source(), "cn21"), (resize().id, ConsumerKind::Migration));
        // Then the source goes back to the VM in one commit, the destination is released,
        // the host is not rewritten, the resize fails, and the VM is never put in error.
        let src = on_aggregate(&facts, source());
        assert!(released(&src, resize().id), "{src:?}");
        assert!(src.iter().any(|e| matches!(e,
            Event::AllocationClaimed { consumer, consumer_kind: ConsumerKind::Instance, .. } if *consumer == vm().id)));
        assert!(released(&on_aggregate(&facts, destination()), vm().id));
        let on_vm = on_aggregate(&facts, vm());
        assert!(
            !on_vm
                .iter()
                .any(|e| matches!(e, Event::HostAssigned { .. })),
            "{on_vm:?}"
        );
        assert!(
            !on_vm
                .iter()
                .any(|e| matches!(e, Event::VmStateChanged { .. })),
            "{on_vm:?}"
        );
        assert!(matches!(
            on_aggregate(&facts, resize()).as_slice(),
            [Event::OperationFailed { .. }]
        ));
        assert_eq!(facts[0].aggregate, vm(), "the instance's fact comes first");
    }

    #[test]
    fn an_interrupted_live_migration_is_aborted_to_the_source_and_only_the_migration_fails() {
        use provledger_projections::recovery::Reissue;
        for host_on in [(source(), "cn21"), (destination(), "cn22")] {
            // Given a live migration interrupted with the host on either side...
            let facts = given_migration(
                OperationKind::LiveMigrateInstance,
                TaskState::Migrating,
                host_on,
                (resize().id, ConsumerKind::Migration),
            );
            // ...then the source goes back to the VM, the destination is released, the
            // migration fails, the VM is never put in error, and the abort is re-issued.
            let src = on_aggregate(&facts, source());
            assert!(released(&src, resize().id), "{src:?}");
            assert!(released(&on_aggregate(&facts, destination()), vm().id));
            let on_vm = on_aggregate(&facts, vm());
            assert!(
                !on_vm
                    .iter()
                    .any(|e| matches!(e, Event::VmStateChanged { .. })),
                "{on_vm:?}"
            );
            assert!(on_vm.iter().any(|e| matches!(
                e,
                Event::ReissueRequested {
                    action: Reissue::AbortLiveMigration,
                    ..
                }
            )));
            let moved_back = on_vm.contains(&Event::HostAssigned {
                host: "cn21".into(),
                provider_id: source().id,
            });
            assert_eq!(moved_back, host_on.0 == destination(), "{on_vm:?}");
            assert!(matches!(
                on_aggregate(&facts, resize()).as_slice(),
                [Event::OperationFailed { .. }]
            ));
        }
    }

    #[test]
    fn with_the_host_already_moved_the_host_goes_back_to_the_source_too() {
        let facts = given(
            (destination(), "cn22"),
            (resize().id, ConsumerKind::Migration),
        );
        assert!(released(&on_aggregate(&facts, destination()), vm().id));
        assert!(on_aggregate(&facts, vm()).contains(&Event::HostAssigned {
            host: "cn21".into(),
            provider_id: source().id,
        }));
    }

    #[test]
    fn a_resize_claiming_the_destination_under_the_vm_itself_releases_only_the_destination() {
        // Given the source held by the VM itself (no migration consumer): the claim on the
        // destination is the only one released, and the resize (in flight) fails.
        let facts = given((source(), "cn21"), (vm().id, ConsumerKind::Instance));
        assert!(on_aggregate(&facts, source()).is_empty(), "{facts:?}");
        assert!(released(&on_aggregate(&facts, destination()), vm().id));
        assert!(matches!(
            on_aggregate(&facts, resize()).as_slice(),
            [Event::OperationFailed { .. }]
        ));
    }
}

#[test]
fn a_failed_migration_leaves_its_instance_where_it_runs_unless_its_rollback_needs_attention() {
    for kind in [
        OperationKind::ResizeInstance,
        OperationKind::LiveMigrateInstance,
    ] {
        a_failed_migration_of_kind(kind);
    }
}

fn a_failed_migration_of_kind(kind: OperationKind) {
    // Given a migration of an active VM that failed; its plan would put the target in error.
    let vm = AggregateId::instance(Uuid::from_u128(5));
    let mut running = workload::instance_running_on(Uuid::from_u128(2));
    running.push(Event::InFlightOperationSet {
        operation_id: operation().id,
        operation_kind: kind,
    });
    let steps = vec![(vm, running), (operation(), vec![started(kind, vm)])];
    let projection = Projection::rebuild(&script::seal(&steps));
    let Some(Entity::Operation(mut op)) = projection.get(&operation()).cloned() else {
        panic!("the operation folds");
    };
    op.rollback_plan = Some(Arc::new(RollbackPlan {
        rule: "act held".into(),
        target: vm,
        compensations: vec![],
        retained: vec![],
        target_outcome: TargetOutcome::Error {
            description: "resize failed".into(),
        },
    }));
    let target = projection.get(&vm).cloned();
    let in_error = |events: &[Event]| {
        events
            .iter()
            .any(|e| matches!(e, Event::VmStateChanged { .. }))
    };
    // When its rollback ends, then the VM is not put in error (only the migration is), and
    // its in-flight marker is cleared.
    let events = rollback_target_events(&op, target.as_ref(), RollbackOutcome::RolledBack);
    assert!(!in_error(&events), "{kind:?}: {events:?}");
    assert!(matches!(
        events.as_slice(),
        [Event::InFlightOperationCleared { .. }]
    ));
    // When the rollback itself needs attention, then the VM is put in error, saying where.
    let events = rollback_target_events(&op, target.as_ref(), RollbackOutcome::NeedsAttention);
    assert!(in_error(&events), "{kind:?}: {events:?}");
}

// ---- provider deletes ----

const PROVIDER: u128 = 7;

/// The commits of a provider holding `allocations` claims of 1 VCPU.
fn provider_holding(allocations: usize) -> Vec<script::ScriptStep> {
    use std::collections::BTreeMap;
    let p = AggregateId::provider(Uuid::from_u128(PROVIDER));
    let mut steps = vec![(p, workload::provider_on("cn", allocations as u64 + 1))];
    for n in 0..allocations {
        steps.push((
            p,
            vec![Event::AllocationClaimed {
                consumer: Uuid::from_u128(1_000 + n as u128),
                consumer_kind: provledger_events::catalogue::ConsumerKind::Instance,
                resources: BTreeMap::from([("VCPU".to_string(), 1)]),
            }],
        ));
    }
    steps
}

fn provider_after(steps: &[script::ScriptStep]) -> provledger_projections::provider::ProviderState {
    let p = AggregateId::provider(Uuid::from_u128(PROVIDER));
    match Entity::fold(p, &script::seal(steps)) {
        Some(Entity::Provider(s)) => *s,
        other => panic!("{other:?}"),
    }
}

fn instance_hold(_: Uuid) -> (provledger_events::catalogue::AllocationHold, String) {
    (
        provledger_events::catalogue::AllocationHold::Instance,
        "instance runs here".into(),
    )
}

#[test]
fn a_plain_delete_of_a_provider_holding_allocations_is_refused_and_writes_nothing() {
    use provledger_projections::facts::{provider_delete_step, ProviderDeleteStep};
    let provider = provider_after(&provider_holding(2));
    assert_eq!(
        provider_delete_step(&provider, false, instance_hold),
        ProviderDeleteStep::Refused
    );
}

#[test]
fn an_empty_provider_is_requested_and_deleted_in_one_commit() {
    use provledger_projections::facts::{provider_delete_step, ProviderDeleteStep};
    let provider = provider_after(&provider_holding(0));
    let ProviderDeleteStep::Write {
        events, deletes, ..
    } = provider_delete_step(&provider, false, instance_hold)
    else {
        panic!("no write");
    };
    assert!(deletes);
    assert!(matches!(
        events.as_slice(),
        [
            Event::ProviderDeleteRequested { cascade: false, .. },
            Event::ProviderDeleted {}
        ]
    ));
}

/// Given a provider holding more allocations than one commit releases; when its cascade
/// is decided commit by commit, each applied before the next is decided; then the first
/// records the delete, every allocation is released once with its reason, only the last
/// deletes the provider, and a cascade found half done goes on even when the caller did
/// not ask for one (the recorded intent wins).
#[test]
fn a_large_cascade_is_decided_commit_by_commit_and_goes_on_once_recorded() {
    use provledger_projections::facts::{
        provider_delete_step, ProviderDeleteStep, CASCADE_RELEASES_PER_COMMIT,
    };
    use provledger_projections::provider::ProviderStatus;
    let many = 2 * CASCADE_RELEASES_PER_COMMIT + 3;
    let mut steps = provider_holding(many);
    let p = steps[0].0;
    let mut released = std::collections::BTreeSet::new();
    let mut commits = 0;
    loop {
        let provider = provider_after(&steps);
        // After the first commit the caller "forgets" it asked for a cascade.
        let ProviderDeleteStep::Write {
            events,
            released: freed,
            deletes,
        } = provider_delete_step(&provider, commits == 0, instance_hold)
        else {
            panic!("commit {commits}: no write");
        };
        commits += 1;
        assert_eq!(
            matches!(
                events.first(),
                Some(Event::ProviderDeleteRequested { cascade: true, .. })
            ),
            commits == 1
        );
        for e in &events {
            if let Event::AllocationReleased { consumer, reason } = e {
                assert!(released.insert(*consumer), "{consumer} released twice");
                assert!(reason.contains("--cascade: instance runs here"), "{reason}");
            }
        }
        assert_eq!(
            freed.len(),
            events
                .iter()
                .filter(|e| matches!(e, Event::AllocationReleased { .. }))
                .count()
        );
        steps.push((p, events));
        if deletes {
            break;
        }
        assert!(commits < 10, "never ends");
    }
    assert_eq!(commits, 3);
    assert_eq!(released.len(), many);
    let provider = provider_after(&steps);
    assert_eq!(provider.status, Some(ProviderStatus::Deleted));
    assert_eq!(
        provider.header.anomaly_count, 0,
        "{:?}",
        provider.header.anomalies
    );
    assert_eq!(
        provider_delete_step(&provider, true, instance_hold),
        ProviderDeleteStep::AlreadyDeleted
    );
}

/// Given a source holding a migration's allocation, when it is given back, then the
/// migration's is released and the instance claims the same resources, in one commit;
/// given it back already (or confirmed), nothing is left to do.
#[test]
fn a_source_given_back_moves_the_migrations_allocation_to_the_instance_once() {
    use provledger_events::catalogue::ConsumerKind;
    use provledger_projections::facts::return_to_source_events;
    let source = AggregateId::provider(Uuid::from_u128(PROVIDER));
    let (instance, migration) = (Uuid::from_u128(5), Uuid::from_u128(31));
    let mut steps = vec![
        (source, workload::provider_on("cn", 8)),
        (
            source,
            workload::vcpu_claim(migration, ConsumerKind::Migration, 2),
        ),
    ];
    let events = return_to_source_events(&provider_after(&steps), instance, migration, "revert")
        .expect("something to give back");
    assert!(matches!(
        events.as_slice(),
        [
            Event::AllocationReleased { consumer: m, .. },
            Event::AllocationClaimed { consumer: i, consumer_kind: ConsumerKind::Instance, resources }
        ] if *m == migration && *i == instance && resources.get("VCPU") == Some(&2)
    ));
    steps.push((source, events));
    let after = provider_after(&steps);
    assert_eq!(
        after.header.anomaly_count, 0,
        "{:?}",
        after.header.anomalies
    );
    assert_eq!(
        return_to_source_events(&after, instance, migration, "revert again"),
        None
    );
}

// ---- a terminated VM, a deletion completed ----

/// Given node 2 of the `data` group (on provider 7, holding 2 VCPU there) and the scale
/// operation of `given`.
fn node_two_in_cluster() -> (OperationState, Projection) {
    let (op, _) = given(OperationKind::ScaleCluster, vec![]);
    let vm = AggregateId::instance(node(2));
    let provider = AggregateId::provider(Uuid::from_u128(PROVIDER));
    let mut vm_events = workload::instance_running_on(provider.id);
    if let Event::InstanceCreateRequested {
        cluster_id,
        node_group,
        ..
    } = &mut vm_events[0]
    {
        *cluster_id = Some(cluster().id);
        *node_group = Some("data".into());
    }
    let steps = vec![
        (
            cluster(),
            vec![
                Event::ClusterCreateRequested {
                    name: "analytics".into(),
                    plugin: "vanilla".into(),
                    node_groups: vec![group("data", 2)],
                },
                joined("data", 2),
            ],
        ),
        (vm, vm_events),
        (provider, workload::provider_on("cn", 8)),
        (
            provider,
            workload::vcpu_claim(
                vm.id,
                provledger_events::catalogue::ConsumerKind::Instance,
                2,
            ),
        ),
    ];
    (op, Projection::rebuild(&script::seal(&steps)))
}

#[test]
fn a_terminated_vm_is_closed_and_leaves_its_group_together() {
    use provledger_projections::facts::vm_gone_facts;
    let (op, state) = node_two_in_cluster();
    let vm = AggregateId::instance(node(2));
    let (Some(Entity::Instance(i)), Some(Entity::Cluster(c))) =
        (state.get(&vm), state.get(&cluster()))
    else {
        panic!("folds");
    };
    // When its VM is gone, then its record closes and it leaves `data`, as two facts.
    let facts = vm_gone_facts(&op, i, Some(c));
    assert_eq!(facts.len(), 2, "{facts:?}");
    assert_eq!(facts[0].aggregate, vm);
    assert!(matches!(
        facts[0].events.as_slice(),
        [
            Event::InstanceDeleteRequested { .. },
            Event::InstanceDeleted {}
        ]
    ));
    assert_eq!(facts[1].aggregate, cluster());
    assert!(matches!(
        facts[1].events.as_slice(),
        [Event::InstanceLeft { node_group, instance_id, .. }] if node_group == "data" && *instance_id == node(2)
    ));
    // When the VM is the operation's own target, its record stays (only the group changes).
    let mut own = op.clone();
    own.target = Some(vm);
    let facts = vm_gone_facts(&own, i, Some(c));
    assert_eq!(facts.len(), 1);
    assert_eq!(facts[0].aggregate, cluster());
}

#[test]
fn an_instance_is_deleted_only_once_nothing_of_it_remains() {
    use provledger_projections::facts::{deletion_completion, DeletionCompletion};
    let (_, state) = node_two_in_cluster();
    let vm = AggregateId::instance(node(2));
    let provider = AggregateId::provider(Uuid::from_u128(PROVIDER));
    let Some(Entity::Provider(p)) = state.get(&provider) else {
        panic!("folds");
    };
    let entity = state.get(&vm).cloned().expect("folds");
    // Not being deleted: not yet.
    assert_eq!(
        deletion_completion(&entity, Some(p)),
        DeletionCompletion::NotYet
    );
    let Entity::Instance(mut deleting) = entity else {
        panic!("an instance");
    };
    deleting.delete_requested = true;
    let deleting = Entity::Instance(deleting);
    // Still holding its allocation: not yet; once released: deleted.
    assert_eq!(
        deletion_completion(&deleting, Some(p)),
        DeletionCompletion::NotYet
    );
    let mut released = p.clone();
    released.allocations.clear();
    assert_eq!(
        deletion_completion(&deleting, Some(&released)),
        DeletionCompletion::Record(Box::new(Event::InstanceDeleted {}))
    );
    // A cluster with a member left is not deleted either.
    let cluster_entity = state.get(&cluster()).cloned().expect("folds");
    assert_eq!(
        deletion_completion(&cluster_entity, None),
        DeletionCompletion::NotYet
    );
}
