//! Placement's pure decisions decide from what they are given: the providers or instances
//! they walk and a lookup of the consumers by id, never the whole state. Given a small
//! state / when asked through a lookup that records what it is asked / then the answer is
//! the one the whole fold gives, and only the consumers were looked up.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use provledger_events::catalogue::{AllocationHold, ConsumerKind, VmState};
use provledger_events::{AggregateId, Event};
use provledger_projections::placement::{consumer_entity, holds, orphans, plan_heal, Hold};
use provledger_projections::{Entity, Projection};
use provledger_tests::script;
use uuid::Uuid;

fn provider(n: u128) -> AggregateId {
    AggregateId::provider(Uuid::from_u128(0xaa00 + n))
}

fn instance(n: u128) -> AggregateId {
    AggregateId::instance(Uuid::from_u128(0xbb00 + n))
}

fn registered(host: &str) -> Vec<Event> {
    provledger_tests::workload::provider_on(host, 16)
}

fn claim(consumer: Uuid, kind: ConsumerKind) -> Vec<Event> {
    vec![Event::AllocationClaimed {
        consumer,
        consumer_kind: kind,
        resources: BTreeMap::from([("VCPU".to_string(), 2)]),
    }]
}

/// An active instance running on `on`.
fn running_on(on: AggregateId) -> Vec<Event> {
    provledger_tests::workload::instance_running_on(on.id)
}

/// P holds: I1 running there, I2 evacuated to Q (residue), a migration M whose operation
/// was never recorded, I4 deleted, I5 never recorded. Q holds I2. I3 runs on P with no
/// allocation.
fn state() -> Projection {
    let (p, q) = (provider(1), provider(2));
    let m = Uuid::from_u128(0xcc01);
    let deleted = vec![Event::VmStateChanged {
        vm_state: VmState::Deleted,
        reason: "gone".into(),
    }];
    let commits = script::seal(&[
        (p, registered("cn-p")),
        (q, registered("cn-q")),
        (instance(1), running_on(p)),
        (instance(2), running_on(q)),
        (instance(3), running_on(p)),
        (instance(4), running_on(p)),
        (instance(4), deleted),
        (p, claim(instance(1).id, ConsumerKind::Instance)),
        (p, claim(instance(2).id, ConsumerKind::Instance)),
        (p, claim(m, ConsumerKind::Migration)),
        (p, claim(instance(4).id, ConsumerKind::Instance)),
        (p, claim(instance(5).id, ConsumerKind::Instance)),
        (q, claim(instance(2).id, ConsumerKind::Instance)),
    ]);
    let mut projection = Projection::new();
    for c in &commits {
        projection.apply(c);
    }
    projection
}

fn provider_state(
    projection: &Projection,
    id: AggregateId,
) -> &provledger_projections::provider::ProviderState {
    match projection.get(&id) {
        Some(Entity::Provider(p)) => p,
        other => panic!("{other:?}"),
    }
}

#[test]
fn holds_look_up_each_consumer_by_id_and_nothing_else() {
    let projection = state();
    let p = provider_state(&projection, provider(1));
    let asked = RefCell::new(BTreeSet::new());
    let found = holds(
        |id| {
            asked.borrow_mut().insert(*id);
            projection.get(id)
        },
        p,
    );
    let expected: BTreeSet<AggregateId> = p
        .allocations
        .iter()
        .map(|(c, a)| consumer_entity(*c, a.consumer_kind))
        .collect();
    assert_eq!(asked.into_inner(), expected);
    let kinds: BTreeMap<Uuid, AllocationHold> =
        found.iter().map(|h| (h.consumer, h.hold)).collect();
    assert_eq!(
        kinds,
        BTreeMap::from([
            (instance(1).id, AllocationHold::Instance),
            (instance(2).id, AllocationHold::EvacuationResidue),
            (
                Uuid::from_u128(0xcc01),
                AllocationHold::UnconfirmedMigration
            ),
            (instance(4).id, AllocationHold::Orphan),
            (instance(5).id, AllocationHold::Orphan),
        ])
    );

    // Given only the consumers' entities (what a store reads by id), the answer is the same.
    let few: BTreeMap<AggregateId, Entity> = expected
        .iter()
        .filter_map(|id| projection.get(id).map(|e| (*id, e.clone())))
        .collect();
    assert_eq!(holds(|id| few.get(id), p), found);
}

#[test]
fn orphans_walk_the_providers_given_with_their_consumers_looked_up() {
    let projection = state();
    let providers = projection.providers();
    let found: Vec<(Uuid, Uuid)> = orphans(providers.iter().copied(), |id| projection.get(id))
        .into_iter()
        .map(|(p, h): (Uuid, Hold)| (p, h.consumer))
        .collect();
    assert_eq!(
        found,
        vec![
            (provider(1).id, instance(4).id),
            (provider(1).id, instance(5).id)
        ]
    );
}

#[test]
fn heal_plans_from_the_instances_given_and_who_holds_an_allocation() {
    let projection = state();
    let consumers: BTreeSet<Uuid> = projection
        .providers()
        .iter()
        .flat_map(|p| p.allocations.keys().copied())
        .collect();
    let all = plan_heal(projection.instances(), |c| consumers.contains(&c));
    // I3 runs on P with no allocation: claimed there; I1, I2, I4 hold one: not listed.
    assert_eq!(
        all.claims,
        vec![(
            instance(3).id,
            provider(1).id,
            BTreeMap::from([("VCPU".to_string(), 2)])
        )]
    );
    assert!(all.skipped.is_empty(), "{:?}", all.skipped);

    // One instance asked for: only it is looked at, and only its allocation asked about.
    let asked = RefCell::new(Vec::new());
    let one = match projection.get(&instance(3)) {
        Some(Entity::Instance(i)) => &**i,
        other => panic!("{other:?}"),
    };
    let plan = plan_heal([one], |c| {
        asked.borrow_mut().push(c);
        consumers.contains(&c)
    });
    assert_eq!(plan, all);
    assert_eq!(asked.into_inner(), vec![instance(3).id]);

    // An instance that lost its allocation but is deleted is listed with why.
    let deleted = match projection.get(&instance(4)) {
        Some(Entity::Instance(i)) => &**i,
        other => panic!("{other:?}"),
    };
    let plan = plan_heal([deleted], |_| false);
    assert_eq!(
        plan.skipped,
        vec![(instance(4).id, "deleted or being deleted".to_string())]
    );
}
