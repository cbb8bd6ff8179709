//! The append decider, as given events / when a commit is proposed / then admitted,
//! refused (with which reason) or already done.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    samples, ClusterStatus, ConsumerKind, Effect, EffectKind, Inventory, OperationKind, Origin,
    Ratio, StagePolicy, StageSpec,
};
use provledger_events::{AggregateId, CommitDraft, Event};
use provledger_projections::decide::{decide_append, Admission, AlreadyDone, AppendRejection};
use provledger_projections::Entity;
use provledger_tests::script::{self, draft_for, ScriptStep};
use uuid::Uuid;

fn cluster() -> AggregateId {
    AggregateId::cluster(Uuid::from_u128(1))
}

fn provider() -> AggregateId {
    AggregateId::provider(Uuid::from_u128(2))
}

fn operation() -> AggregateId {
    AggregateId::operation(Uuid::from_u128(3))
}

/// Given these commits, the state of `target` (None if it has none).
fn given(target: AggregateId, steps: Vec<ScriptStep>) -> Option<Entity> {
    let commits = script::seal(&steps);
    Entity::fold(target, commits.iter().filter(|c| c.aggregate == target))
}

fn propose(events: Vec<Event>) -> CommitDraft {
    draft_for(1000, events)
}

fn inventory(total: u64, reserved: u64, ratio: u32, min: u64, max: u64, step: u64) -> Event {
    Event::InventorySet {
        resource_class: "VCPU".into(),
        inventory: Inventory {
            total,
            reserved,
            allocation_ratio: Ratio(ratio * 1000),
            min_unit: min,
            max_unit: max,
            step_size: step,
        },
    }
}

fn memory(total: u64) -> Event {
    Event::InventorySet {
        resource_class: "MEMORY_MB".into(),
        inventory: Inventory {
            total,
            reserved: 0,
            allocation_ratio: Ratio(1000),
            min_unit: 1,
            max_unit: total,
            step_size: 1,
        },
    }
}

fn claim(consumer: u128, resources: &[(&str, u64)]) -> Event {
    Event::AllocationClaimed {
        consumer: Uuid::from_u128(consumer),
        consumer_kind: ConsumerKind::Instance,
        resources: resources
            .iter()
            .map(|(rc, n)| (rc.to_string(), *n))
            .collect::<BTreeMap<_, _>>(),
    }
}

fn registered() -> Event {
    Event::ProviderRegistered {
        name: "cn1".into(),
        host: "cn1".into(),
    }
}

/// A provider of capacity (8 - 2) * 4 = 24 VCPU, holding `held` VCPU for consumer 100.
fn provider_holding(held: u64) -> Option<Entity> {
    let mut steps = vec![(provider(), vec![registered(), inventory(8, 2, 4, 1, 24, 1)])];
    if held > 0 {
        steps.push((provider(), vec![claim(100, &[("VCPU", held)])]));
    }
    given(provider(), steps)
}

fn refused(target: AggregateId, entity: Option<&Entity>, events: Vec<Event>) -> AppendRejection {
    match decide_append(target, entity, &propose(events)) {
        Err(rejection) => rejection,
        Ok(admission) => panic!("expected a refusal, got {admission:?}"),
    }
}

#[test]
fn a_claim_that_fits_exactly_is_admitted_and_one_unit_more_is_refused_over_capacity() {
    let state = provider_holding(20);
    assert_eq!(
        decide_append(
            provider(),
            state.as_ref(),
            &propose(vec![claim(1, &[("VCPU", 4)])])
        ),
        Ok(Admission::Append)
    );
    let rejection = refused(provider(), state.as_ref(), vec![claim(1, &[("VCPU", 5)])]);
    assert_eq!(rejection.reason(), "over_capacity");
    assert!(rejection.to_string().contains("25 > 24"), "{rejection}");
}

#[test]
fn a_claim_outside_the_units_is_refused_with_the_units_reason() {
    let given = given(
        provider(),
        vec![(provider(), vec![registered(), inventory(64, 0, 1, 2, 8, 2)])],
    );
    for (amount, reason) in [
        (1, "below_min_unit"),
        (10, "above_max_unit"),
        (3, "step_size"),
    ] {
        let rejection = refused(
            provider(),
            given.as_ref(),
            vec![claim(1, &[("VCPU", amount)])],
        );
        assert_eq!(rejection.reason(), reason, "{amount}: {rejection}");
    }
    assert_eq!(
        decide_append(
            provider(),
            given.as_ref(),
            &propose(vec![claim(1, &[("VCPU", 4)])])
        ),
        Ok(Admission::Append)
    );
}

#[test]
fn a_claim_is_all_or_nothing_and_names_every_class_that_does_not_fit() {
    let state = given(
        provider(),
        vec![(
            provider(),
            vec![registered(), inventory(8, 0, 1, 1, 8, 1), memory(1024)],
        )],
    );
    let rejection = refused(
        provider(),
        state.as_ref(),
        vec![claim(
            1,
            &[("DISK_GB", 10), ("MEMORY_MB", 512), ("VCPU", 9)],
        )],
    );
    let AppendRejection::ClaimRefused { refusal, .. } = &rejection else {
        panic!("expected a claim refusal, got {rejection:?}")
    };
    let classes: Vec<(&str, &str)> = refusal
        .classes
        .iter()
        .map(|c| (c.resource_class.as_str(), c.reason.as_str()))
        .collect();
    assert_eq!(
        classes,
        vec![("DISK_GB", "no_inventory"), ("VCPU", "above_max_unit")]
    );
}

#[test]
fn a_claim_replacing_the_consumers_own_allocation_counts_what_it_gives_back() {
    let state = provider_holding(20);
    // Consumer 100 resizes from 20 to 24: 24 in use afterwards, which fits.
    assert_eq!(
        decide_append(
            provider(),
            state.as_ref(),
            &propose(vec![claim(100, &[("VCPU", 24)])])
        ),
        Ok(Admission::Append)
    );
}

#[test]
fn events_on_an_aggregate_that_does_not_exist_are_not_found_and_its_creation_is_admitted() {
    let rejection = refused(provider(), None, vec![claim(1, &[("VCPU", 1)])]);
    assert!(
        matches!(rejection, AppendRejection::NotFound { .. }),
        "{rejection:?}"
    );
    assert_eq!(rejection.reason(), "not_found");
    assert_eq!(
        decide_append(provider(), None, &propose(vec![registered()])),
        Ok(Admission::Append)
    );
    // Creation and use in one commit: the trial fold sees the creation first.
    assert_eq!(
        decide_append(
            provider(),
            None,
            &propose(vec![
                registered(),
                inventory(8, 0, 1, 1, 8, 1),
                claim(1, &[("VCPU", 2)])
            ])
        ),
        Ok(Admission::Append)
    );
}

#[test]
fn a_delete_request_is_not_found_on_nothing_and_already_done_on_a_deleting_or_deleted_target() {
    let delete = || Event::ClusterDeleteRequested {
        reason: "user".into(),
    };
    let rejection = refused(cluster(), None, vec![delete()]);
    assert_eq!(rejection.reason(), "not_found");

    let created = vec![(cluster(), vec![samples::all().remove(0)])];
    let live = given(cluster(), created.clone());
    assert_eq!(
        decide_append(cluster(), live.as_ref(), &propose(vec![delete()])),
        Ok(Admission::Append)
    );

    let mut steps = created;
    steps.push((cluster(), vec![delete()]));
    let deleting = given(cluster(), steps.clone());
    assert_eq!(
        decide_append(cluster(), deleting.as_ref(), &propose(vec![delete()])),
        Ok(Admission::AlreadyDone(AlreadyDone::AlreadyDeleting))
    );

    steps.push((cluster(), vec![Event::ClusterDeleted {}]));
    let deleted = given(cluster(), steps);
    assert_eq!(
        decide_append(cluster(), deleted.as_ref(), &propose(vec![delete()])),
        Ok(Admission::AlreadyDone(AlreadyDone::AlreadyDeleted))
    );
}

#[test]
fn nothing_brings_a_deleting_cluster_back() {
    let deleting = given(
        cluster(),
        vec![
            (cluster(), vec![samples::all().remove(0)]),
            (
                cluster(),
                vec![Event::ClusterDeleteRequested {
                    reason: "user".into(),
                }],
            ),
        ],
    );
    let rejection = refused(
        cluster(),
        deleting.as_ref(),
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Active,
            description: "up".into(),
        }],
    );
    assert_eq!(rejection.reason(), "target_deleted");
}

fn started_operation() -> Option<Entity> {
    given(
        operation(),
        vec![(
            operation(),
            vec![Event::OperationStarted {
                kind: OperationKind::CreateCluster,
                target: cluster(),
                parent_id: None,
                stages: vec![StageSpec {
                    name: "spawn".into(),
                    policy: StagePolicy::Compensate,
                }],
                bundle_policy: None,
            }],
        )],
    )
}

#[test]
fn an_effect_the_fold_records_although_out_of_place_is_admitted_because_it_happened() {
    let step = Event::StepDone {
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
    };
    // The stage was never started: the fold keeps the effect and flags an anomaly.
    assert_eq!(
        decide_append(
            operation(),
            started_operation().as_ref(),
            &propose(vec![step])
        ),
        Ok(Admission::Append)
    );
}

#[test]
fn an_impossible_transition_is_refused_as_not_applicable() {
    let mut state = started_operation();
    if let Some(entity) = state.as_mut() {
        let commits = script::seal(&[
            (operation(), vec![Event::OperationSucceeded {}]),
            (operation(), vec![Event::OperationSucceeded {}]),
        ]);
        // Only the first: the operation has succeeded once.
        let mut first = commits[0].clone();
        first.version = entity.header().version + 1;
        entity.apply(&first);
    }
    let rejection = refused(
        operation(),
        state.as_ref(),
        vec![Event::OperationSucceeded {}],
    );
    assert_eq!(rejection.reason(), "not_applicable");
    assert!(
        matches!(rejection, AppendRejection::NotApplicable { index: 0, .. }),
        "{rejection:?}"
    );
}

#[test]
fn an_inventory_below_usage_is_refused_unless_forced() {
    use provledger_projections::decide::{decide_append_with, DecideOptions};
    let state = provider_holding(20);
    // Capacity (8 - 2) * 2 = 12 is below the 20 in use.
    let shrink = vec![inventory(8, 2, 2, 1, 24, 1)];
    let rejection = refused(provider(), state.as_ref(), shrink.clone());
    assert_eq!(rejection.reason(), "below_usage");
    assert!(
        rejection.to_string().contains("12, below the 20"),
        "{rejection}"
    );
    assert_eq!(
        decide_append_with(
            provider(),
            state.as_ref(),
            &propose(shrink),
            DecideOptions { force: true }
        ),
        Ok(Admission::Append)
    );
}
