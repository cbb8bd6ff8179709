//! The append decider, as given events / when a commit is proposed / then admitted,
//! refused (with which reason) or already done.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    samples, ClusterStatus, ConsumerKind, Effect, EffectKind, Inventory, OperationKind, Origin,
    Ratio, StagePolicy, StageSpec, TaskOutcome, TaskState, VmState,
};
use provledger_events::{AggregateId, Commit, CommitDraft, Event, Timestamp};
use provledger_projections::decide::{
    decide_append, decide_append_with, Admission, AlreadyDone, AppendRejection, DecideOptions,
};
use provledger_projections::lease::{CallerWorker, LEASE_MS_MAX, LEASE_MS_MIN};
use provledger_projections::recovery::recover;
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
            DecideOptions {
                force: true,
                ..DecideOptions::default()
            }
        ),
        Ok(Admission::Append)
    );
}

// ---- task leases (docs/recovery.md) ----

/// When worker w1 started its task in the scenarios below.
const T0: i64 = 1_800_000_000_000;
/// w1's lease: 60 s from T0.
const LEASE_MS: i64 = 60_000;

fn instance() -> AggregateId {
    AggregateId::instance(Uuid::from_u128(4))
}

fn ms(at: i64) -> Timestamp {
    Timestamp::from_unix_ms(at)
}

fn started(worker: &str, until: i64) -> Event {
    Event::TaskStarted {
        task_state: TaskState::PoweringOff,
        worker_id: worker.into(),
        lease_until: ms(until),
    }
}

fn renewed(worker: &str, until: i64) -> Event {
    Event::TaskLeaseRenewed {
        worker_id: worker.into(),
        lease_until: ms(until),
    }
}

fn finished(outcome: TaskOutcome) -> Event {
    Event::TaskFinished {
        task_state: TaskState::PoweringOff,
        outcome,
        reason: String::new(),
    }
}

/// A commit by `actor` recorded at `at`.
fn draft_at(at: i64, actor: &str, events: Vec<Event>) -> CommitDraft {
    let mut draft = draft_for((at - T0).unsigned_abs() as usize, events);
    draft.recorded_at = ms(at);
    draft.actor = actor.into();
    draft
}

/// Appends `draft` to `entity` as the log would (the next version and position).
fn fold_onto(entity: &mut Entity, draft: CommitDraft) {
    let header = entity.header();
    let mut commit = Commit::seal(instance(), header.version + 1, header.hash, draft);
    commit.position = header.last_position + 1;
    entity.apply(&commit);
}

/// An active instance, created at T0 - 10 s, with no task in progress.
fn idle_instance() -> Entity {
    let mut entity = Entity::new(instance());
    fold_onto(
        &mut entity,
        draft_at(
            T0 - 10_000,
            "provisioner",
            vec![
                Event::InstanceCreateRequested {
                    name: "vm".into(),
                    cluster_id: None,
                    node_group: None,
                    flavor: "m1".into(),
                    resources: BTreeMap::new(),
                    image: "img".into(),
                },
                Event::TaskFinished {
                    task_state: TaskState::Scheduling,
                    outcome: TaskOutcome::Succeeded,
                    reason: String::new(),
                },
                Event::VmStateChanged {
                    vm_state: VmState::Active,
                    reason: String::new(),
                },
            ],
        ),
    );
    entity
}

/// Given worker w1 started powering off at T0 with a lease until T0 + 60 s.
fn held_by_w1() -> Entity {
    let mut entity = idle_instance();
    fold_onto(
        &mut entity,
        draft_at(T0, "w1", vec![started("w1", T0 + LEASE_MS)]),
    );
    entity
}

/// When `events` are proposed at `at` by `actor`, sent by the authenticated worker of
/// `identity` (None: a library write or an unauthenticated request).
fn decide_at(
    state: &Entity,
    at: i64,
    actor: &str,
    identity: Option<&str>,
    events: Vec<Event>,
) -> Result<Admission, AppendRejection> {
    let options = DecideOptions {
        caller_worker: identity.map(|i| CallerWorker::from_identity(i).expect("a worker")),
        ..DecideOptions::default()
    };
    decide_append_with(
        instance(),
        Some(state),
        &draft_at(at, actor, events),
        options,
    )
}

fn refused_at(
    state: &Entity,
    at: i64,
    actor: &str,
    identity: Option<&str>,
    events: Vec<Event>,
) -> AppendRejection {
    match decide_at(state, at, actor, identity, events) {
        Err(rejection) => rejection,
        Ok(admission) => panic!("expected a refusal, got {admission:?}"),
    }
}

#[test]
fn a_lease_ending_at_most_lease_ms_max_after_its_commit_is_admitted_and_the_year_9999_is_not() {
    let idle = idle_instance();
    assert_eq!(
        decide_at(
            &idle,
            T0,
            "w1",
            None,
            vec![started("w1", T0 + LEASE_MS_MAX)]
        ),
        Ok(Admission::Append)
    );
    let rejection = refused_at(
        &idle,
        T0,
        "w1",
        None,
        vec![started("w1", T0 + LEASE_MS_MAX + 1)],
    );
    assert_eq!(rejection.reason(), "lease_too_long");
    let year_9999 = Timestamp::parse_rfc3339("9999-12-31T23:59:59Z").unwrap();
    let rejection = refused_at(
        &idle,
        T0,
        "w1",
        None,
        vec![started("w1", year_9999.unix_ms())],
    );
    assert_eq!(rejection.reason(), "lease_too_long");
    assert!(
        rejection.to_string().contains("renew it instead"),
        "{rejection}"
    );
    // The same bound for a renewal, measured from the renewal's own time.
    let held = held_by_w1();
    let half = T0 + LEASE_MS / 2;
    assert_eq!(
        decide_at(
            &held,
            half,
            "w1",
            None,
            vec![renewed("w1", half + LEASE_MS_MAX)]
        ),
        Ok(Admission::Append)
    );
    let rejection = refused_at(
        &held,
        half,
        "w1",
        None,
        vec![renewed("w1", half + LEASE_MS_MAX + 1)],
    );
    assert_eq!(rejection.reason(), "lease_too_long");
}

#[test]
fn a_lease_shorter_than_lease_ms_min_or_not_after_its_commit_is_refused() {
    let idle = idle_instance();
    assert_eq!(
        decide_at(
            &idle,
            T0,
            "w1",
            None,
            vec![started("w1", T0 + LEASE_MS_MIN)]
        ),
        Ok(Admission::Append)
    );
    let rejection = refused_at(
        &idle,
        T0,
        "w1",
        None,
        vec![started("w1", T0 + LEASE_MS_MIN - 1)],
    );
    assert_eq!(rejection.reason(), "lease_too_short");
    for until in [T0, T0 - 1, T0 - 86_400_000] {
        let rejection = refused_at(&idle, T0, "w1", None, vec![started("w1", until)]);
        assert_eq!(rejection.reason(), "lease_in_past", "{until}");
    }
    // A renewal whose lease ends before it is recorded (a late worker): in the past too.
    let late = T0 + LEASE_MS + 5_000;
    let rejection = refused_at(
        &held_by_w1(),
        late,
        "w1",
        None,
        vec![renewed("w1", late - 1)],
    );
    assert_eq!(rejection.reason(), "lease_in_past");
    assert_eq!(
        decide_at(
            &held_by_w1(),
            late,
            "w1",
            None,
            vec![renewed("w1", late + LEASE_MS)]
        ),
        Ok(Admission::Append),
        "a late worker renews from now"
    );
}

#[test]
fn a_renewal_comes_no_sooner_than_half_the_current_lease_after_it_was_granted() {
    let held = held_by_w1();
    // w1's lease was granted at T0 for 60 s: renewable from T0 + 30 s.
    let rejection = refused_at(
        &held,
        T0 + 29_999,
        "w1",
        None,
        vec![renewed("w1", T0 + 89_999)],
    );
    assert_eq!(rejection.reason(), "renewal_too_soon");
    assert!(
        rejection.to_string().contains(&ms(T0 + 30_000).to_string()),
        "names when it may: {rejection}"
    );
    assert_eq!(
        decide_at(
            &held,
            T0 + 30_000,
            "w1",
            None,
            vec![renewed("w1", T0 + 90_000)]
        ),
        Ok(Admission::Append)
    );
    // The current lease is the one the last renewal granted: renewed at T0 + 30 s for 10 s,
    // it is renewable from T0 + 35 s, whatever the first lease's length was.
    let mut shorter = held;
    fold_onto(
        &mut shorter,
        draft_at(T0 + 30_000, "w1", vec![renewed("w1", T0 + 40_000)]),
    );
    let rejection = refused_at(
        &shorter,
        T0 + 34_999,
        "w1",
        None,
        vec![renewed("w1", T0 + 44_999)],
    );
    assert_eq!(rejection.reason(), "renewal_too_soon");
    assert_eq!(
        decide_at(
            &shorter,
            T0 + 35_000,
            "w1",
            None,
            vec![renewed("w1", T0 + 45_000)]
        ),
        Ok(Admission::Append)
    );
    // Started and renewed in one commit: the renewal comes at the start, too soon.
    let rejection = refused_at(
        &idle_instance(),
        T0,
        "w1",
        None,
        vec![
            started("w1", T0 + LEASE_MS),
            renewed("w1", T0 + LEASE_MS + 1),
        ],
    );
    assert_eq!(rejection.reason(), "renewal_too_soon");
    assert!(
        matches!(rejection, AppendRejection::RenewalTooSoon { index: 1, .. }),
        "{rejection:?}"
    );
}

#[test]
fn three_hundred_renewals_in_half_a_second_admit_one() {
    // The product owner's test: a worker asks to renew 300 times within 0.5 s, once its
    // lease is half gone; each admitted renewal is appended before the next is decided.
    let mut state = held_by_w1();
    let mut admitted = 0;
    for i in 0..300 {
        let at = T0 + LEASE_MS / 2 + i * 500 / 300;
        let events = vec![renewed("w1", at + LEASE_MS)];
        if decide_at(&state, at, "w1", Some("worker-w1@SERVICES"), events.clone()).is_ok() {
            admitted += 1;
            fold_onto(&mut state, draft_at(at, "w1", events));
        }
    }
    assert_eq!(admitted, 1);
}

#[test]
fn a_renewal_must_extend_the_lease() {
    let held = held_by_w1();
    let at = T0 + 40_000;
    for until in [T0 + LEASE_MS, T0 + LEASE_MS - 1_000] {
        let rejection = refused_at(&held, at, "w1", None, vec![renewed("w1", until)]);
        assert_eq!(rejection.reason(), "renewal_not_extending", "{until}");
    }
    assert_eq!(
        decide_at(
            &held,
            at,
            "w1",
            None,
            vec![renewed("w1", T0 + LEASE_MS + 1)]
        ),
        Ok(Admission::Append)
    );
}

#[test]
fn only_the_lease_holder_renews_finishes_or_replaces_a_task_while_its_lease_is_live() {
    let held = held_by_w1();
    let at = T0 + 30_000;
    // Renewing another worker's task by naming it: refused, whoever the actor.
    let rejection = refused_at(&held, at, "w2", None, vec![renewed("w2", at + LEASE_MS)]);
    assert_eq!(rejection.reason(), "not_lease_holder");
    assert!(
        rejection.to_string().contains("held by worker w1"),
        "{rejection}"
    );
    assert_eq!(
        decide_at(&held, at, "w1", None, vec![renewed("w1", at + LEASE_MS)]),
        Ok(Admission::Append)
    );
    // Renewing when no task is started (a recovery took it): nobody holds a lease.
    let rejection = refused_at(
        &idle_instance(),
        at,
        "w1",
        None,
        vec![renewed("w1", at + LEASE_MS)],
    );
    assert_eq!(rejection.reason(), "not_lease_holder");
    assert!(matches!(
        rejection,
        AppendRejection::NotLeaseHolder { holder: None, .. }
    ));
    // Finishing, re-queuing or re-starting it as someone else while the lease is live.
    let queued = Event::TaskQueued {
        task_state: TaskState::PoweringOn,
    };
    for (actor, events) in [
        ("w2", vec![finished(TaskOutcome::Succeeded)]),
        ("provisioner", vec![queued.clone()]),
        ("w2", vec![started("w2", at + LEASE_MS)]),
    ] {
        let rejection = refused_at(&held, at, actor, None, events.clone());
        assert_eq!(rejection.reason(), "not_lease_holder", "{events:?}");
    }
    for events in [vec![finished(TaskOutcome::Succeeded)], vec![queued.clone()]] {
        assert_eq!(
            decide_at(&held, at, "w1", None, events),
            Ok(Admission::Append)
        );
    }
    // Once the lease expired, another worker may take the task (no authenticated caller).
    let expired = T0 + LEASE_MS;
    assert_eq!(
        decide_at(
            &held,
            expired,
            "w2",
            None,
            vec![started("w2", expired + LEASE_MS)]
        ),
        Ok(Admission::Append)
    );
}

#[test]
fn the_recovery_sweep_still_finishes_and_requeues_an_expired_task() {
    let held = held_by_w1();
    let Entity::Instance(state) = &held else {
        panic!("an instance")
    };
    let now = ms(T0 + LEASE_MS);
    let recovery = recover(state, now).expect("an expired lease is recovered");
    assert_eq!(
        decide_at(
            &held,
            now.unix_ms(),
            "provledger-recovery",
            None,
            recovery.events.clone()
        ),
        Ok(Admission::Append)
    );
    // A millisecond earlier the lease is live and the sweep leaves it alone anyway.
    assert_eq!(recover(state, ms(T0 + LEASE_MS - 1)), None);
    let rejection = refused_at(
        &held,
        T0 + LEASE_MS - 1,
        "provledger-recovery",
        None,
        recovery.events,
    );
    assert_eq!(rejection.reason(), "not_lease_holder");
}

#[test]
fn an_authenticated_worker_names_itself_in_its_task_events() {
    let idle = idle_instance();
    let rejection = refused_at(
        &idle,
        T0,
        "worker-w2@SERVICES",
        Some("worker-w2@SERVICES"),
        vec![started("w1", T0 + LEASE_MS)],
    );
    assert_eq!(rejection.reason(), "worker_mismatch");
    assert!(
        rejection.to_string().contains("names worker w1")
            && rejection.to_string().contains("as worker w2"),
        "{rejection}"
    );
    assert_eq!(
        decide_at(
            &idle,
            T0,
            "worker-w2@SERVICES",
            Some("worker-w2@SERVICES"),
            vec![started("w2", T0 + LEASE_MS)]
        ),
        Ok(Admission::Append)
    );
    // A renewal naming the holder, sent by another worker: the name is not the sender's.
    let held = held_by_w1();
    let at = T0 + 30_000;
    let rejection = refused_at(
        &held,
        at,
        "worker-w2@SERVICES",
        Some("worker-w2@SERVICES"),
        vec![renewed("w1", at + LEASE_MS)],
    );
    assert_eq!(rejection.reason(), "worker_mismatch");
    assert_eq!(
        decide_at(
            &held,
            at,
            "worker-w1@SERVICES",
            Some("worker-w1@SERVICES"),
            vec![renewed("w1", at + LEASE_MS)]
        ),
        Ok(Admission::Append)
    );
    // Any other vouched user is the worker of its own name.
    assert_eq!(
        decide_at(
            &idle,
            T0,
            "compute-1@SERVICES",
            Some("compute-1@SERVICES"),
            vec![started("compute-1", T0 + LEASE_MS)]
        ),
        Ok(Admission::Append)
    );
}

#[test]
fn an_authenticated_worker_finishes_or_takes_a_task_only_as_its_holder_even_after_expiry() {
    let held = held_by_w1();
    let w2 = Some("worker-w2@SERVICES");
    for at in [T0 + 30_000, T0 + LEASE_MS + 60_000] {
        // The actor a request names does not matter: the vouched worker does.
        let rejection = refused_at(&held, at, "w1", w2, vec![finished(TaskOutcome::Succeeded)]);
        assert_eq!(rejection.reason(), "not_lease_holder", "{at}");
        assert!(rejection.to_string().contains("by w2"), "{rejection}");
        let rejection = refused_at(&held, at, "w2", w2, vec![started("w2", at + LEASE_MS)]);
        assert_eq!(rejection.reason(), "not_lease_holder", "{at}");
        assert_eq!(
            decide_at(
                &held,
                at,
                "worker-w1@SERVICES",
                Some("worker-w1@SERVICES"),
                vec![finished(TaskOutcome::Succeeded)]
            ),
            Ok(Admission::Append),
            "{at}"
        );
    }
    // A task nobody started (still queued: scheduling) has no holder to protect.
    assert_eq!(
        decide_at(
            &Entity::new(instance()),
            T0,
            "provisioner@SERVICES",
            Some("provisioner@SERVICES"),
            vec![
                Event::InstanceCreateRequested {
                    name: "vm".into(),
                    cluster_id: None,
                    node_group: None,
                    flavor: "m1".into(),
                    resources: BTreeMap::new(),
                    image: "img".into(),
                },
                Event::TaskFinished {
                    task_state: TaskState::Scheduling,
                    outcome: TaskOutcome::Succeeded,
                    reason: String::new(),
                },
            ]
        ),
        Ok(Admission::Append)
    );
}
