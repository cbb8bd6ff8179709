//! The fold says what it did ([`Folded`]), and the decider trusts it: a refused event
//! refuses the commit, an event applied with an anomaly does not. So, for every sample
//! event folded onto many states (each kind fresh, each kind after every sample of its
//! own in turn, a few states the other tests reason about, and random scripts):
//! - `Refused`: the state is exactly as it was;
//! - `AppliedWithAnomaly`: the state changed (else the decider would accept an event that
//!   did nothing, where it refused it when it compared the states before and after);
//! - `Applied`: folded in a commit, the entity keeps no anomaly; otherwise it keeps
//!   exactly one, with the fold's text.

use std::collections::BTreeMap;

use proptest::prelude::*;
use provledger_events::catalogue::{
    samples, ClusterStatus, ConsumerKind, Inventory, NodeGroupTarget, OperationKind,
    RollbackOutcome, TaskOutcome, TaskState,
};
use provledger_events::{AggregateId, AggregateKind, Commit, CommitDraft, Event, Timestamp};
use provledger_tests::script::{self, ScriptStep};
use provledger_tests::workload;
use uuid::Uuid;

use super::{EventContext, Folded};
use crate::{Entity, Projection};

/// How many times each outcome was seen, so a test that checks nothing fails.
#[derive(Debug, Default)]
struct Seen {
    applied: usize,
    with_anomaly: usize,
    refused: usize,
}

/// Events beyond the samples that reach the folds' other answers: a scale naming a
/// missing group after an existing one (with a new count, and with the count it has), an
/// inventory with inconsistent units, one below the usage of the samples' claim, and a
/// claim and a release of another consumer.
fn edge_events() -> Vec<Event> {
    let scale = |count| Event::ClusterScaleRequested {
        targets: vec![
            NodeGroupTarget {
                name: "workers".into(),
                count,
            },
            NodeGroupTarget {
                name: "missing".into(),
                count: 1,
            },
        ],
    };
    let vcpu = |total, step_size| Event::InventorySet {
        resource_class: "VCPU".into(),
        inventory: Inventory {
            step_size,
            ..workload::vcpu_inventory(total)
        },
    };
    vec![
        scale(3),
        scale(7),
        vcpu(32, 0),
        vcpu(1, 1),
        Event::AllocationClaimed {
            consumer: Uuid::from_u128(77),
            consumer_kind: ConsumerKind::Instance,
            resources: BTreeMap::from([("VCPU".to_string(), 1)]),
        },
        Event::AllocationReleased {
            consumer: Uuid::from_u128(77),
            reason: "edge".into(),
        },
    ]
}

/// Every event the check folds onto each state.
fn events() -> Vec<Event> {
    let mut events = samples::all();
    events.extend(edge_events());
    events
}

/// The aggregate of `kind` the catalogue's samples are folded into.
fn id_of(kind: AggregateKind) -> AggregateId {
    AggregateId::new(kind, Uuid::from_u128(0xF0))
}

/// The states `steps` leave their aggregates in, after each commit.
fn states_along(steps: &[ScriptStep]) -> Vec<Entity> {
    let mut projection = Projection::new();
    let mut states = Vec::new();
    for commit in script::seal(steps) {
        projection.apply(&commit);
        states.extend(projection.get(&commit.aggregate).cloned());
    }
    states
}

/// Each kind fresh; each kind after every sample of its own, one commit at a time in
/// catalogue order, with the edge events of its kind right after the creating one (before
/// a deletion refuses them); and states other tests reason about.
fn given_states() -> Vec<Entity> {
    let mut states: Vec<Entity> = AggregateKind::ALL
        .iter()
        .map(|k| Entity::new(id_of(*k)))
        .collect();
    for kind in AggregateKind::ALL {
        let mut own: Vec<Event> = samples::all()
            .into_iter()
            .filter(|e| e.belongs_to(kind))
            .collect();
        let edges = edge_events().into_iter().filter(|e| e.belongs_to(kind));
        own.splice(1..1, edges);
        let steps: Vec<ScriptStep> = own.into_iter().map(|e| (id_of(kind), vec![e])).collect();
        states.extend(states_along(&steps));
    }
    states.extend(states_along(&reasoned_about()));
    states
}

/// States the fold, decide and recovery tests reason about: a cluster deleting with a
/// member, a provider holding claims, an instance whose task a worker holds with a
/// re-issue pending, and an operation whose rollback needs attention.
fn reasoned_about() -> Vec<ScriptStep> {
    let cluster = AggregateId::cluster(Uuid::from_u128(1));
    let provider = AggregateId::provider(Uuid::from_u128(2));
    let instance = AggregateId::instance(Uuid::from_u128(3));
    let operation = AggregateId::operation(Uuid::from_u128(4));
    let all = samples::all();
    let sample = |name: &str| -> Event {
        all.iter()
            .find(|e| e.name() == name)
            .cloned()
            .unwrap_or_else(|| panic!("no sample {name}"))
    };
    let mut provider_events = workload::provider_on("cn", 8);
    provider_events.extend(workload::vcpu_claim(instance.id, ConsumerKind::Instance, 2));
    provider_events.extend(workload::vcpu_claim(
        Uuid::from_u128(9),
        ConsumerKind::Migration,
        1,
    ));
    let mut instance_events = workload::instance_running_on(provider.id);
    instance_events.extend([
        Event::TaskStarted {
            task_state: TaskState::PoweringOff,
            worker_id: "w1".into(),
            lease_until: Timestamp::from_unix_ms(1_800_000_060_000),
        },
        sample("reissue_requested"),
        sample("reissue_attempted"),
        Event::InFlightOperationSet {
            operation_id: operation.id,
            operation_kind: OperationKind::RebootInstance,
        },
    ]);
    vec![
        (
            cluster,
            vec![
                sample("cluster_create_requested"),
                sample("instance_joined"),
            ],
        ),
        (cluster, vec![sample("cluster_delete_requested")]),
        (provider, provider_events),
        (provider, vec![sample("provider_delete_requested")]),
        (instance, instance_events),
        (
            instance,
            vec![Event::TaskFinished {
                task_state: TaskState::PoweringOff,
                outcome: TaskOutcome::Failed,
                reason: "gone".into(),
            }],
        ),
        (
            operation,
            vec![
                sample("operation_started"),
                sample("stage_started"),
                sample("step_done"),
                sample("operation_failed"),
                sample("rollback_planned"),
                sample("compensation_requested"),
                sample("compensation_failed"),
                Event::RollbackFinished {
                    outcome: RollbackOutcome::NeedsAttention,
                    remaining: vec![Uuid::from_bytes([7; 16])],
                },
            ],
        ),
        (
            cluster,
            vec![Event::ClusterStatusChanged {
                status: ClusterStatus::Deleted,
                description: "gone".into(),
            }],
        ),
    ]
}

/// Folds `event` onto a copy of `state` both ways the crate does (the decider's trial
/// fold, and a commit folded into the entity) and checks the outcome against what
/// happened to the state; returns the outcome.
fn check(state: &Entity, event: &Event) -> Folded {
    let header = state.header();
    let recorded_at = Timestamp::from_unix_ms(1_800_000_030_000);
    let ctx = EventContext {
        position: header.last_position + 1,
        version: header.version + 1,
        recorded_at,
        operation_id: None,
    };
    let mut trial = state.clone();
    let folded = trial.fold_event(event, &ctx);
    match &folded {
        Folded::Refused(problem) => assert_eq!(
            &trial,
            state,
            "{} refused ({problem}) but it changed the state",
            event.name()
        ),
        Folded::AppliedWithAnomaly(problem) => assert_ne!(
            &trial,
            state,
            "{} applied with an anomaly ({problem}) but it changed nothing",
            event.name()
        ),
        Folded::Applied => {}
    }
    // A loss acknowledgement is kept on the header by `Entity::apply` itself, whatever
    // the fold would say; every other event is recorded as the fold says.
    if !matches!(event, Event::LossAcknowledged { .. }) {
        let draft = CommitDraft {
            trace: None,
            commit_id: Uuid::from_u128(header.version as u128 + 1),
            operation_id: None,
            causation_id: None,
            actor: "test".into(),
            recorded_at,
            events: vec![event.clone()],
        };
        let mut commit = Commit::seal(state.id(), header.version + 1, header.hash, draft);
        commit.position = header.last_position + 1;
        let mut folded_in = state.clone();
        folded_in.apply(&commit);
        let after = folded_in.header();
        let kept = after.anomaly_count - header.anomaly_count;
        match folded.clone().anomaly() {
            None => assert_eq!(kept, 0, "{} applied but kept an anomaly", event.name()),
            Some(problem) => {
                assert_eq!(kept, 1, "{}: one anomaly kept", event.name());
                assert_eq!(after.anomalies.last().map(|a| &a.problem), Some(&problem));
            }
        }
    }
    folded
}

/// Checks every event on every state; counts the outcomes.
fn check_all(states: &[Entity], seen: &mut Seen) {
    let events = events();
    for state in states {
        for event in &events {
            match check(state, event) {
                Folded::Applied => seen.applied += 1,
                Folded::AppliedWithAnomaly(_) => seen.with_anomaly += 1,
                Folded::Refused(_) => seen.refused += 1,
            }
        }
    }
}

#[test]
fn a_refused_event_leaves_the_state_as_it_was_and_one_applied_with_an_anomaly_changed_it() {
    // Given each kind fresh, after each of its samples, and the states other tests use
    let states = given_states();
    // When every sample and edge event is folded onto each
    let mut seen = Seen::default();
    check_all(&states, &mut seen);
    // Then every outcome matched what happened to the state (checked in `check`), and
    // each outcome was met: the check did check something
    assert!(
        seen.applied > 0 && seen.with_anomaly > 0 && seen.refused > 0,
        "{seen:?}"
    );
}

/// The state the last commit of `steps` leaves its aggregate in.
fn last_state(steps: &[ScriptStep]) -> Entity {
    states_along(steps).pop().expect("a commit")
}

#[test]
fn a_fact_applied_anyway_that_changes_nothing_is_a_refusal() {
    // Given a provider holding 2 VCPU of a 4 VCPU inventory
    let provider = AggregateId::provider(Uuid::from_u128(2));
    let mut events = workload::provider_on("cn", 4);
    events.extend(workload::vcpu_claim(
        Uuid::from_u128(3),
        ConsumerKind::Instance,
        2,
    ));
    let holding = (provider, events);
    let below_usage = Event::InventorySet {
        resource_class: "VCPU".into(),
        inventory: workload::vcpu_inventory(1),
    };
    let problem = "VCPU capacity 1 is below usage 2".to_string();
    // When an inventory below usage is set
    // Then it is applied (the hardware did shrink), with an anomaly
    assert_eq!(
        check(&last_state(std::slice::from_ref(&holding)), &below_usage),
        Folded::AppliedWithAnomaly(problem.clone())
    );
    // When the same inventory is set again
    // Then it changes nothing: refused, with the same anomaly text
    let shrunk = last_state(&[holding, (provider, vec![below_usage.clone()])]);
    assert_eq!(check(&shrunk, &below_usage), Folded::Refused(problem));
}

#[test]
fn a_scale_naming_a_missing_group_is_applied_in_part_only_when_an_earlier_count_changed() {
    // Given a cluster whose "workers" group counts 3
    let cluster = AggregateId::cluster(Uuid::from_u128(1));
    let created = last_state(&[(cluster, vec![samples::all().remove(0)])]);
    let scale = |count| Event::ClusterScaleRequested {
        targets: vec![
            NodeGroupTarget {
                name: "workers".into(),
                count,
            },
            NodeGroupTarget {
                name: "missing".into(),
                count: 1,
            },
        ],
    };
    let missing = "node group \"missing\" does not exist; event not applied".to_string();
    // When the scale sets workers to 7, then names a missing group
    // Then workers' new count is kept: applied in part, with an anomaly
    assert_eq!(
        check(&created, &scale(7)),
        Folded::AppliedWithAnomaly(missing.clone())
    );
    // When it sets workers to the 3 they have: nothing changed, so it is refused
    assert_eq!(check(&created, &scale(3)), Folded::Refused(missing));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn on_random_scripts_every_outcome_matches_what_happened_to_the_state(
        steps in script::script(24)
    ) {
        // Given the states a random script leaves its aggregates in, after each commit
        let states = states_along(&steps);
        // When every sample and edge event is folded onto each
        // Then every outcome matches what happened to the state (checked in `check`)
        check_all(&states, &mut Seen::default());
    }
}
