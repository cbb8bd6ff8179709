//! Stuck-state recovery, rule by rule: given an instance's events and the time, when the
//! sweep looks at it, then this recovery (or none). And recovering is idempotent: after
//! a recovery's events are folded, the next sweep finds nothing to do.

use proptest::prelude::*;
use provledger_events::catalogue::{PowerState, TaskState, VmState};
use provledger_events::{AggregateId, Event, Timestamp};
use provledger_projections::instance::InstanceState;
use provledger_projections::recovery::{recover, Recovery, Reissue};
use provledger_projections::Entity;
use provledger_tests::{script, workload};
use uuid::Uuid;

const LEASE: i64 = 1_800_000_100_000;

fn instance_id() -> AggregateId {
    AggregateId::instance(Uuid::from_u128(5))
}

fn provider() -> Uuid {
    Uuid::from_u128(2)
}

/// Created and placed on [`provider`], still scheduling.
fn created() -> Vec<Event> {
    // The running fixture's first two events: the create request and the host.
    workload::instance_running_on(provider())
        .into_iter()
        .take(2)
        .collect()
}

/// Active and running on [`provider`].
fn active() -> Vec<Event> {
    let mut e = workload::instance_running_on(provider());
    e.push(Event::PowerStateChanged {
        power_state: PowerState::Running,
    });
    e
}

fn started(task: TaskState) -> Event {
    Event::TaskStarted {
        task_state: task,
        worker_id: "compute-1".into(),
        lease_until: Timestamp::from_unix_ms(LEASE),
    }
}

fn given(steps: Vec<Vec<Event>>) -> InstanceState {
    let script: Vec<_> = steps.into_iter().map(|e| (instance_id(), e)).collect();
    match Entity::fold(instance_id(), &script::seal(&script)) {
        Some(Entity::Instance(i)) => *i,
        other => panic!("{other:?}"),
    }
}

fn after_lease() -> Timestamp {
    Timestamp::from_unix_ms(LEASE + 1)
}

fn recovered(steps: Vec<Vec<Event>>) -> Recovery {
    recover(&given(steps), after_lease()).expect("a recovery")
}

#[test]
fn a_task_whose_lease_has_not_expired_is_untouched() {
    let i = given(vec![active(), vec![started(TaskState::PoweringOff)]]);
    assert_eq!(recover(&i, Timestamp::from_unix_ms(LEASE - 1)), None);
    assert!(recover(&i, after_lease()).is_some());
}

#[test]
fn deleting_is_re_driven() {
    let r = recovered(vec![
        active(),
        vec![Event::InstanceDeleteRequested {
            reason: "user".into(),
        }],
        vec![started(TaskState::Deleting)],
    ]);
    assert_eq!(r.reissue, Some(Reissue::Delete));
    assert!(r.rule.starts_with("deleting"));
}

#[test]
fn a_delete_queued_but_never_started_is_re_driven_too() {
    let r = recovered(vec![
        active(),
        vec![Event::InstanceDeleteRequested {
            reason: "user".into(),
        }],
    ]);
    assert_eq!(r.reissue, Some(Reissue::Delete));
}

#[test]
fn a_build_started_whose_lease_expired_goes_to_error_and_releases_its_claim() {
    let r = recovered(vec![created(), vec![started(TaskState::Spawning)]]);
    assert!(r.events.iter().any(|e| matches!(
        e,
        Event::VmStateChanged {
            vm_state: VmState::Error,
            ..
        }
    )));
    assert_eq!(r.release_claim_on, Some(provider()));
    assert_eq!(r.reissue, None);
}

#[test]
fn a_build_never_started_is_left_alone() {
    // Queued (create sets scheduling) and never started: it may still be in the queue.
    assert_eq!(recover(&given(vec![created()]), after_lease()), None);
}

#[test]
fn an_image_upload_is_cleared() {
    let r = recovered(vec![active(), vec![started(TaskState::ImageUploading)]]);
    assert_eq!(r.events.len(), 1);
    assert_eq!(r.reissue, None);
}

#[test]
fn powering_on_and_off_are_re_issued() {
    for (task, reissue) in [
        (TaskState::PoweringOn, Reissue::PowerOn),
        (TaskState::PoweringOff, Reissue::PowerOff),
    ] {
        let r = recovered(vec![active(), vec![started(task)]]);
        assert_eq!(r.reissue, Some(reissue), "{task:?}");
    }
}

#[test]
fn a_pending_reboot_is_retried() {
    let r = recovered(vec![active(), vec![started(TaskState::RebootPending)]]);
    assert_eq!(r.reissue, Some(Reissue::Reboot));
}

#[test]
fn a_started_reboot_with_the_guest_down_is_hard_rebooted_and_with_it_up_cleared() {
    let down = recovered(vec![
        active(),
        vec![
            started(TaskState::RebootStarted),
            Event::PowerStateChanged {
                power_state: PowerState::Shutdown,
            },
        ],
    ]);
    assert_eq!(down.reissue, Some(Reissue::HardReboot));
    let up = recovered(vec![active(), vec![started(TaskState::RebootStarted)]]);
    assert_eq!(up.reissue, None);
    assert_eq!(up.events.len(), 1, "only the task is cleared");
}

#[test]
fn a_rebuild_goes_to_error() {
    let r = recovered(vec![active(), vec![started(TaskState::Rebuilding)]]);
    assert!(r.rule.starts_with("rebuild"));
    assert!(r.events.iter().any(|e| matches!(
        e,
        Event::VmStateChanged {
            vm_state: VmState::Error,
            ..
        }
    )));
}

#[test]
fn a_resize_is_reverted_and_a_live_migration_aborted() {
    let resize = recovered(vec![active(), vec![started(TaskState::ResizeMigrating)]]);
    assert_eq!(resize.reissue, Some(Reissue::RevertResize));
    let live = recovered(vec![active(), vec![started(TaskState::Migrating)]]);
    assert_eq!(live.reissue, Some(Reissue::AbortLiveMigration));
}

fn any_task() -> impl Strategy<Value = TaskState> {
    prop_oneof![
        Just(TaskState::Spawning),
        Just(TaskState::Deleting),
        Just(TaskState::PoweringOn),
        Just(TaskState::PoweringOff),
        Just(TaskState::RebootPending),
        Just(TaskState::RebootStarted),
        Just(TaskState::ImageUploading),
        Just(TaskState::Rebuilding),
        Just(TaskState::ResizeMigrating),
        Just(TaskState::Migrating),
    ]
}

proptest! {
    /// Given any interrupted task, when its recovery's events are folded, then the next
    /// sweep (at any later time) finds nothing to do: a second sweep writes nothing.
    #[test]
    fn recovery_is_idempotent(task in any_task(), running in any::<bool>(), later in 1i64..1_000_000) {
        let mut steps = vec![active()];
        if task == TaskState::Deleting {
            steps.push(vec![Event::InstanceDeleteRequested { reason: "user".into() }]);
        }
        let mut last = vec![started(task)];
        if !running {
            last.push(Event::PowerStateChanged { power_state: PowerState::Shutdown });
        }
        steps.push(last);
        let first = recover(&given(steps.clone()), after_lease());
        prop_assert!(first.is_some());
        steps.push(first.unwrap().events);
        let again = recover(&given(steps), Timestamp::from_unix_ms(LEASE + later));
        prop_assert_eq!(again, None);
    }
}

/// Given a pending re-issue, when is its next attempt due: the first at once; after a
/// failure, after the backoff (1 s, 2 s, ... capped), or at once when its worker said it is
/// ready; an attempt in flight only once the reply wait has passed.
#[test]
fn a_pending_reissue_is_due_by_its_backoff_its_worker_or_a_lost_attempt() {
    use provledger_projections::instance::PendingReissue;
    use provledger_projections::recovery::{reissue_due, ReissuePolicy};
    let t = |ms: i64| provledger_events::Timestamp::from_unix_ms(1_800_000_000_000 + ms);
    let policy = ReissuePolicy::new(10_000);
    let mut p = PendingReissue {
        request_id: uuid::Uuid::from_u128(1),
        worker: "w".into(),
        action: Reissue::PowerOn,
        reason: String::new(),
        requested_at: t(0),
        attempts: 0,
        attempted_at: None,
        last_failed_at: None,
        last_error: None,
    };
    assert_eq!(reissue_due(&p, t(0), &policy, None), Some(1));
    // Attempt 1 in flight: not again before the reply wait, then it counts as lost; a
    // ready said before it was sent grants nothing more.
    p.attempts = 1;
    p.attempted_at = Some(t(0));
    assert_eq!(reissue_due(&p, t(9_999), &policy, Some(t(-1))), None);
    assert_eq!(reissue_due(&p, t(10_000), &policy, None), Some(2));
    // Attempt 3 sent at 4 s, failed at 5 s: the backoff is 4 s, skipped if the worker
    // said it listens since the attempt was sent.
    p.attempts = 3;
    p.attempted_at = Some(t(4_000));
    p.last_failed_at = Some(t(5_000));
    assert_eq!(reissue_due(&p, t(8_999), &policy, None), None);
    assert_eq!(reissue_due(&p, t(8_999), &policy, Some(t(6_000))), Some(4));
    assert_eq!(reissue_due(&p, t(8_999), &policy, Some(t(3_000))), None);
    assert_eq!(reissue_due(&p, t(9_000), &policy, None), Some(4));
    // Capped: after 19 failures the wait is 30 s, not 2^18 s.
    p.attempts = 19;
    assert_eq!(reissue_due(&p, t(34_999), &policy, None), None);
    assert_eq!(reissue_due(&p, t(35_000), &policy, None), Some(20));
    // Given up after REISSUE_ATTEMPTS_MAX attempts: only its worker's "ready" sends it,
    // one attempt per ready said after the last attempt, never a series.
    p.attempts = provledger_projections::recovery::REISSUE_ATTEMPTS_MAX;
    p.attempted_at = Some(t(3_000_000));
    assert_eq!(reissue_due(&p, t(3_600_000), &policy, None), None);
    assert_eq!(
        reissue_due(&p, t(3_600_000), &policy, Some(t(3_500_000))),
        Some(21)
    );
    p.attempts += 1;
    p.attempted_at = Some(t(3_600_000));
    assert_eq!(
        reissue_due(&p, t(3_600_001), &policy, Some(t(3_500_000))),
        None
    );
}
