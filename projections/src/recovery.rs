//! Stuck-state recovery (Nova seed "recover stuck states", design 5): what to do with an
//! instance whose task was interrupted. Pure: a function of the instance's folded events
//! and the time, so every replica and every sweep decides the same.
//!
//! The seed's hard part, telling "still queued" from "started and interrupted", is made
//! unambiguous by leases: a worker records `task_started` (worker, lease expiry) when it
//! really starts and renews the lease while it works. So:
//! - a lease not yet expired: the worker is alive; untouched;
//! - a task started whose lease expired: interrupted; the rules below apply;
//! - a task queued and never started: it may still be in a queue; left alone, except a
//!   delete (always safe to re-drive) and tasks a recovery already re-queued (left to their
//!   worker, so a second sweep writes nothing).
//!
//! | task | rule |
//! |---|---|
//! | deleting | re-drive the delete, pending until its worker acknowledges; one no worker ever started: error. Never dropped |
//! | building (scheduling, spawning, networking), started, lease expired | error, and release the build's claim |
//! | building, never started | leave alone |
//! | image uploading (snapshot) | clear the task |
//! | powering on / off | re-issue (idempotent) |
//! | reboot pending | retry |
//! | reboot started, guest not running | hard reboot |
//! | reboot started, guest running | clear the task |
//! | rebuilding | error |
//! | resize migrating | revert to the source |
//! | live migrating | abort; the migration goes to error |

use provledger_events::catalogue::{PowerState, TaskOutcome, TaskState, VmState};
use provledger_events::{Event, Timestamp};
use serde::Serialize;
use uuid::Uuid;

use crate::instance::{is_build_task, InstanceState};
use crate::lease::{LEASE_MS_MAX, LEASE_MS_MIN};
use crate::operation::{OperationState, OperationStatus};

pub use provledger_events::catalogue::Reissue;

/// One instance's recovery: the rule that matched, the events recording it (with the
/// reason), and what else the shell does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recovery {
    pub instance: Uuid,
    pub rule: &'static str,
    pub reason: String,
    pub events: Vec<Event>,
    /// Sent to the owning worker after the events are recorded.
    pub reissue: Option<Reissue>,
    /// The build's claim to release on this provider.
    pub release_claim_on: Option<Uuid>,
}

/// The recovery `instance` needs at `now`, if any.
pub fn recover(instance: &InstanceState, now: Timestamp) -> Option<Recovery> {
    let task = instance.task_state?;
    if matches!(instance.vm_state, Some(VmState::Deleted) | None) {
        return None;
    }
    let started = instance.task_worker.is_some();
    if instance.task_lease_until.is_some_and(|until| until > now) {
        return None; // the worker is alive
    }
    let requeued = !started && instance.last_task_outcome == Some(TaskOutcome::Recovered);
    if requeued {
        return None; // a previous sweep re-drove it; its worker picks it up
    }
    Interrupted::of(instance, task).recovery(instance, started)
}

/// A task no live worker holds: the instance, the task, and the sentence every reason of
/// its recovery begins with.
struct Interrupted {
    instance: Uuid,
    task: TaskState,
    /// "task … of worker … interrupted (lease expired …)".
    text: String,
}

impl Interrupted {
    /// The interruption of `task`, the task of `instance`.
    fn of(instance: &InstanceState, task: TaskState) -> Self {
        let worker = instance.task_worker.as_deref().unwrap_or("unknown");
        let text = format!(
            "task {task:?} of worker {worker} interrupted (lease expired{})",
            instance
                .task_lease_until
                .map(|t| format!(" at {t}"))
                .unwrap_or_default()
        );
        Interrupted {
            instance: instance.header.id.id,
            task,
            text,
        }
    }

    /// The rule for this task (the table at the top of this module); `None`: left alone.
    fn recovery(&self, instance: &InstanceState, started: bool) -> Option<Recovery> {
        let interrupted = &self.text;
        Some(match self.task {
            TaskState::Deleting => self.requeue(
                format!("{interrupted}; the delete is re-driven"),
                Reissue::Delete,
                "deleting: re-drive the delete",
            ),
            t if is_build_task(t) && !started => return None,
            t if is_build_task(t) => self.error(
                format!("{interrupted}; the build is put in error and its claim released"),
                "building, started, lease expired: error and release the claim",
                instance.provider_id,
            ),
            _ if !started => return None,
            TaskState::ImageUploading => self.clear(
                format!("{interrupted}; the snapshot task is cleared"),
                "image snapshot or upload: clear the task",
            ),
            TaskState::PoweringOn => self.requeue(
                format!("{interrupted}; power on re-issued"),
                Reissue::PowerOn,
                "powering on: re-issue",
            ),
            TaskState::PoweringOff => self.requeue(
                format!("{interrupted}; power off re-issued"),
                Reissue::PowerOff,
                "powering off: re-issue",
            ),
            TaskState::RebootPending => self.requeue(
                format!("{interrupted}; the reboot is retried"),
                Reissue::Reboot,
                "reboot pending: retry",
            ),
            TaskState::RebootStarted if instance.power_state == PowerState::Running => self.clear(
                format!("{interrupted}; the guest is running, so the reboot is done"),
                "reboot started, guest running: clear the task",
            ),
            TaskState::RebootStarted => self.requeue(
                format!("{interrupted}; the guest is not running: hard reboot"),
                Reissue::HardReboot,
                "reboot started, guest not running: hard reboot",
            ),
            TaskState::Rebuilding => self.error(
                format!("{interrupted}; a half-done rebuild is put in error"),
                "rebuild: error",
                None,
            ),
            TaskState::ResizeMigrating => Recovery {
                reissue: Some(Reissue::RevertResize),
                ..self.clear(
                    format!("{interrupted}; the resize is reverted to the source"),
                    "resize migrating: revert to the source",
                )
            },
            TaskState::Migrating => Recovery {
                reissue: Some(Reissue::AbortLiveMigration),
                ..self.clear(
                    format!("{interrupted}; the live migration is aborted and goes to error"),
                    "live migrating: abort, the migration goes to error",
                )
            },
            // Cluster node tasks belong to a cluster operation, which its own rollback covers.
            TaskState::Decommissioning | TaskState::Configuring => return None,
            // Build tasks (`is_build_task`) are matched above; named here for exhaustiveness.
            TaskState::Scheduling | TaskState::Spawning | TaskState::Networking => return None,
        })
    }

    /// The task ended as recovered, for `reason`.
    fn finished(&self, reason: &str) -> Event {
        Event::TaskFinished {
            task_state: self.task,
            outcome: TaskOutcome::Recovered,
            reason: reason.to_string(),
        }
    }

    /// The task ended and queued again, and `reissue` sent to its worker.
    fn requeue(&self, reason: String, reissue: Reissue, rule: &'static str) -> Recovery {
        Recovery {
            instance: self.instance,
            rule,
            events: vec![
                self.finished(&reason),
                Event::TaskQueued {
                    task_state: self.task,
                },
            ],
            reason,
            reissue: Some(reissue),
            release_claim_on: None,
        }
    }

    /// The task ended and the instance put in error; a build's claim released on
    /// `release`.
    fn error(&self, reason: String, rule: &'static str, release: Option<Uuid>) -> Recovery {
        Recovery {
            instance: self.instance,
            rule,
            events: vec![
                self.finished(&reason),
                Event::VmStateChanged {
                    vm_state: VmState::Error,
                    reason: reason.clone(),
                },
            ],
            reason,
            reissue: None,
            release_claim_on: release,
        }
    }

    /// The task ended; nothing else.
    fn clear(&self, reason: String, rule: &'static str) -> Recovery {
        Recovery {
            instance: self.instance,
            rule,
            events: vec![self.finished(&reason)],
            reason,
            reissue: None,
            release_claim_on: None,
        }
    }
}

/// How pending re-issues are retried until their worker acknowledges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReissuePolicy {
    /// Wait after the first failed attempt; doubled after each further one.
    pub backoff_base_ms: i64,
    /// Upper bound of one wait: an absent worker is tried at least this often, so it
    /// receives its re-issues within this long of subscribing, even without saying so.
    pub backoff_max_ms: i64,
    /// How long an attempt may go without an outcome before it counts as lost (its sender
    /// died) and the next one may go.
    pub reply_wait_ms: i64,
}

/// Backoff of the first failed re-issue attempt.
pub const REISSUE_BACKOFF_BASE_MS: i64 = 1_000;
/// Longest wait between two attempts of a re-issue.
pub const REISSUE_BACKOFF_MAX_MS: i64 = 30_000;
/// A re-issue still pending this long after its recovery is reported by `audit`.
pub const REISSUE_UNDELIVERED_AFTER_MS: i64 = 300_000;
/// Attempts after which a re-issue is no longer retried on its own (about 10 minutes at
/// the longest backoff): it stays pending and reported by `audit`, and is sent again
/// only when its worker says it listens (`cmd.worker.ready`). A retired worker's
/// re-issues then stop writing two commits a minute each, for ever.
pub const REISSUE_ATTEMPTS_MAX: u32 = 20;

impl ReissuePolicy {
    pub fn new(reply_wait_ms: i64) -> Self {
        ReissuePolicy {
            backoff_base_ms: REISSUE_BACKOFF_BASE_MS,
            backoff_max_ms: REISSUE_BACKOFF_MAX_MS,
            reply_wait_ms,
        }
    }

    /// The wait after `failed_attempts` failures: base × 2^(n−1), capped.
    pub fn backoff_ms(&self, failed_attempts: u32) -> i64 {
        let exponent = failed_attempts.saturating_sub(1).min(30);
        self.backoff_base_ms
            .saturating_mul(1_i64 << exponent)
            .min(self.backoff_max_ms)
    }
}

/// The attempt of a pending re-issue that is due at `now`, if one is: the first at once;
/// after a failure, once the backoff has passed (at once if the worker said it is
/// listening since the last attempt was sent: `ready_at`); after an attempt with no
/// outcome, once it counts as lost; after [`REISSUE_ATTEMPTS_MAX`] attempts, only when
/// the worker said it listens since the last attempt. So a ready call grants one attempt,
/// never a series: a worker that says it listens in a loop and never answers gets one
/// attempt per reply wait, not one per call.
pub fn reissue_due(
    pending: &crate::instance::PendingReissue,
    now: Timestamp,
    policy: &ReissuePolicy,
    ready_at: Option<Timestamp>,
) -> Option<u32> {
    let worker_ready =
        ready_at.is_some_and(|ready| pending.attempted_at.is_none_or(|sent| ready > sent));
    let next = pending.attempts + 1;
    if pending.attempts >= REISSUE_ATTEMPTS_MAX && !worker_ready {
        return None; // given up until the worker says it listens
    }
    match (pending.attempted_at, pending.last_failed_at) {
        (None, _) => Some(next),
        (Some(_), Some(failed)) => {
            let due = failed.plus_ms(policy.backoff_ms(pending.attempts));
            (worker_ready || now >= due).then_some(next)
        }
        (Some(sent), None) => (now >= sent.plus_ms(policy.reply_wait_ms)).then_some(next),
    }
}

// ---- an operation's runner lease ----

/// How long a running operation's runner may go without a commit on the operation before
/// serve's recovery sweep fails it (`--runner-lease-ms`): 5 minutes. The client library's
/// runner writes an `operation_heartbeat` every `RUNNER_HEARTBEAT_MS_DEFAULT` (60 s) of a
/// step that records nothing, so a live runner is 4 minutes (less the writers' clock skew)
/// inside it.
pub const RUNNER_LEASE_MS_DEFAULT: i64 = 5 * 60 * 1000;
/// The shortest runner lease serve accepts: a task lease's shortest ([`LEASE_MS_MIN`]).
pub const RUNNER_LEASE_MS_MIN: i64 = LEASE_MS_MIN;
/// The longest runner lease serve accepts: a task lease's longest ([`LEASE_MS_MAX`], 15
/// minutes), so a dead runner's operation is failed within 15 minutes plus one sweep.
pub const RUNNER_LEASE_MS_MAX: i64 = LEASE_MS_MAX;

/// The rule's name, as the recovery metrics label it.
pub const SILENT_RUNNER_RULE: &str = "running, runner lease lapsed: fail the operation";

/// A running operation whose runner lease lapsed: the failure to record, at `version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SilentRunner {
    pub operation: Uuid,
    /// The operation's version the decision was made on: the failure is recorded with
    /// exactly this expectation, so a runner that wrote in between wins.
    pub version: u64,
    /// The `recorded_at` of the operation's last commit.
    pub silent_since: Timestamp,
    pub reason: String,
    /// `operation_failed`, naming the stage and the step left without an outcome.
    pub events: Vec<Event>,
}

/// Whether the runner of `op` went silent for longer than `runner_lease_ms` at `now`.
/// The lease runs from the `recorded_at` of the operation's last commit (any commit the
/// runner writes renews it, `operation_heartbeat` when it has nothing else to record).
/// Only a `running` operation with no cancellation asked for is concerned: a cancellation
/// waits for its runner under the rollback driver's `runner_stop_wait_ms` rule, and a
/// stopped or closed operation has no runner left to wait for.
pub fn fail_silent_runner(
    op: &OperationState,
    now: Timestamp,
    runner_lease_ms: i64,
) -> Option<SilentRunner> {
    if op.status != Some(OperationStatus::Running) || op.is_closed() || op.cancellation_pending() {
        return None;
    }
    let silent_since = op.header.updated_at?;
    if now < silent_since.plus_ms(runner_lease_ms) {
        return None; // the runner renewed in time
    }
    let stage = op.current_stage.clone().unwrap_or_else(|| "(none)".into());
    let step = op.started.last().map(|s| s.name.clone());
    let reason = format!(
        "runner silent since {silent_since}: no commit on the operation for {runner_lease_ms} ms \
         (runner lease lapsed at {})",
        silent_since.plus_ms(runner_lease_ms)
    );
    Some(SilentRunner {
        operation: op.header.id.id,
        version: op.header.version,
        silent_since,
        events: vec![Event::OperationFailed {
            stage,
            step,
            error: reason.clone(),
        }],
        reason,
    })
}

#[cfg(test)]
mod runner_lease_tests {
    use super::*;
    use crate::projection::Projection;
    use crate::Entity;
    use provledger_events::catalogue::OperationKind;
    use provledger_events::{AggregateId, Commit, CommitDraft, Hash};

    const LEASE: i64 = 30_000;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_unix_ms(1_700_000_000_000 + ms)
    }

    /// Given the operation's commits, each (ms after the epoch above, events).
    fn given(commits: &[(i64, Vec<Event>)]) -> OperationState {
        let id = AggregateId::operation(Uuid::from_bytes([7; 16]));
        let mut projection = Projection::new();
        let mut prev = Hash::ZERO;
        for (i, (ms, events)) in commits.iter().enumerate() {
            let draft = CommitDraft {
                trace: None,
                commit_id: Uuid::from_u128(i as u128 + 1),
                operation_id: Some(id.id),
                causation_id: None,
                actor: "test".into(),
                recorded_at: at(*ms),
                events: events.clone(),
            };
            let mut commit = Commit::seal(id, i as u64 + 1, prev, draft);
            commit.position = i as u64 + 1;
            prev = commit.hash;
            projection.apply(&commit);
        }
        match projection.get(&id) {
            Some(Entity::Operation(op)) => (**op).clone(),
            other => panic!("not an operation: {other:?}"),
        }
    }

    fn started() -> (i64, Vec<Event>) {
        let target = AggregateId::cluster(Uuid::from_bytes([1; 16]));
        let kind = OperationKind::CreateCluster;
        let stages = crate::stages::stages_of(kind);
        let first = stages[0].name.clone();
        (
            0,
            vec![
                Event::operation_started(kind, target, None, stages, None),
                Event::StageStarted { stage: first },
            ],
        )
    }

    #[test]
    fn renewed_in_time_nothing() {
        // given a runner whose last commit is a heartbeat 20 s ago
        let op = given(&[started(), (40_000, vec![Event::operation_heartbeat()])]);
        // when the sweep looks within the lease, then nothing is written
        assert_eq!(fail_silent_runner(&op, at(60_000), LEASE), None);
        assert_eq!(fail_silent_runner(&op, at(69_999), LEASE), None);
    }

    #[test]
    fn lapsed_fails_at_the_exact_version() {
        // given a runner silent since its step started
        let mut commits = vec![started()];
        let stage = given(&commits).current_stage.unwrap();
        commits.push((
            5_000,
            vec![Event::StepStarted {
                stage: stage.clone(),
                step: "boot".into(),
                executor: "compute".into(),
                idempotency_key: "k".into(),
                compensation: None,
            }],
        ));
        let op = given(&commits);
        // when the lease has lapsed
        let failed = fail_silent_runner(&op, at(35_000), LEASE).expect("lapsed");
        // then the operation is failed at version 2, naming its stage, step and silence
        assert_eq!(failed.version, 2);
        assert_eq!(failed.silent_since, at(5_000));
        let Event::OperationFailed {
            stage: s,
            step,
            error,
        } = &failed.events[0]
        else {
            panic!("not a failure: {:?}", failed.events)
        };
        assert_eq!((s, step.as_deref()), (&stage, Some("boot")));
        assert!(
            error.starts_with(&format!("runner silent since {}", at(5_000))),
            "{error}"
        );
        // and, folded after the runner's commits, it fails the operation
        commits.push((35_000, failed.events.clone()));
        let op = given(&commits);
        assert_eq!(op.status, Some(OperationStatus::Failed));
        assert_eq!(fail_silent_runner(&op, at(10_000_000), LEASE), None);
    }

    #[test]
    fn closed_nothing() {
        // given an operation that succeeded long ago
        let op = given(&[started(), (1_000, vec![Event::OperationSucceeded {}])]);
        // then its silence means nothing
        assert_eq!(op.status, Some(OperationStatus::Succeeded));
        assert_eq!(fail_silent_runner(&op, at(10_000_000), LEASE), None);
    }

    #[test]
    fn failed_or_cancelled_nothing() {
        // given an operation already failed (its rollback is the driver's)
        let failed = given(&[
            started(),
            (1_000, vec![Event::operation_failed("s", None, "boom")]),
        ]);
        assert_eq!(fail_silent_runner(&failed, at(10_000_000), LEASE), None);
        // given a cancellation asked for: the runner-stop wait of the rollback rules
        let cancelling = given(&[
            started(),
            (
                1_000,
                vec![Event::CancellationRequested {
                    reason: "user".into(),
                }],
            ),
        ]);
        assert!(cancelling.cancellation_pending());
        assert_eq!(fail_silent_runner(&cancelling, at(10_000_000), LEASE), None);
        // given one cancelled
        let cancelled = given(&[started(), (1_000, vec![Event::operation_cancelled("user")])]);
        assert_eq!(fail_silent_runner(&cancelled, at(10_000_000), LEASE), None);
    }

    #[test]
    fn heartbeat_renews_and_is_refused_once_stopped() {
        // given a running operation, a heartbeat is applied and renews the lease
        let op = given(&[started(), (50_000, vec![Event::operation_heartbeat()])]);
        assert_eq!(op.header.anomaly_count, 0);
        assert_eq!(op.header.updated_at, Some(at(50_000)));
        assert_eq!(fail_silent_runner(&op, at(70_000), LEASE), None);
        // given a failed operation, a heartbeat is refused (an anomaly, nothing changes)
        let op = given(&[
            started(),
            (1_000, vec![Event::operation_failed("s", None, "boom")]),
            (2_000, vec![Event::operation_heartbeat()]),
        ]);
        assert_eq!(op.status, Some(OperationStatus::Failed));
        assert!(op.header.anomaly_count > 0);
    }
}
