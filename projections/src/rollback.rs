//! The rollback driver's decider: given an operation's folded state and the time, what
//! the driver does next. Pure, so every replica and every restart takes the same decision
//! from the same log, and the retry and backoff rules are tested without a clock.
//!
//! Compensations run one at a time in plan order, because the order is part of the plan
//! (a VM is terminated before its IP is released). A compensation that keeps failing is
//! retried with exponential backoff up to `attempts_max`; then the rollback finishes as
//! `needs_attention`, listing that compensation and every one after it. Nothing loops
//! forever and no step is dropped silently.

use provledger_events::catalogue::{Executor, PlannedCompensation, RollbackOutcome};
use provledger_events::{Event, Timestamp};
use uuid::Uuid;

use crate::operation::{CompensationProgress, OperationState, OperationStatus};

/// Bounds of the retry loop. Every field is a limit with its unit last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts per compensation before the rollback needs attention.
    pub attempts_max: u32,
    /// Wait after the first failed attempt; doubled after each further one.
    pub backoff_base_ms: i64,
    /// Upper bound of one backoff wait.
    pub backoff_max_ms: i64,
    /// How long a requested attempt may go without an outcome before it counts as lost
    /// (its requester died) and is requested again.
    pub reply_wait_ms: i64,
    /// How long an operation with a pending cancellation may stay quiet before a driver
    /// concludes that its runner died and records the cancellation itself. Much longer
    /// than a reply wait: a live runner inside a long step (a VM boot) is quiet too, and
    /// stopping it under its feet would record that step's effect after the plan.
    pub runner_stop_wait_ms: i64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts_max: 5,
            backoff_base_ms: 500,
            backoff_max_ms: 30_000,
            reply_wait_ms: 30_000,
            runner_stop_wait_ms: 600_000,
        }
    }
}

impl RetryPolicy {
    /// The wait after `failed_attempts` failures: base × 2^(n−1), capped.
    pub fn backoff_ms(&self, failed_attempts: u32) -> i64 {
        let exponent = failed_attempts.saturating_sub(1).min(30);
        self.backoff_base_ms
            .saturating_mul(1_i64 << exponent)
            .min(self.backoff_max_ms)
    }
}

/// What the driver does next for one operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollbackAction {
    /// Nothing: the operation runs, succeeded, or its rollback finished.
    Nothing,
    /// Still running with a cancellation pending, and quiet for the runner stop wait: its
    /// runner died, so the driver records the cancellation itself (this event).
    CancelForSilentRunner(Box<Event>),
    /// Failed or cancelled with no plan: compute and record one.
    Plan,
    /// Request this attempt of this compensation now.
    Request {
        compensation: PlannedCompensation,
        attempt: u32,
    },
    /// Look again at this time (a backoff, or another driver's request in flight).
    WaitUntil(Timestamp),
    /// Every compensation is done, or one ran out of attempts: apply the target outcome
    /// and record the end.
    Finish {
        outcome: RollbackOutcome,
        remaining: Vec<Uuid>,
    },
}

pub fn next_rollback_action(
    op: &OperationState,
    now: Timestamp,
    policy: &RetryPolicy,
) -> RollbackAction {
    if op.is_closed() {
        return RollbackAction::Nothing;
    }
    match op.status {
        Some(OperationStatus::Running) if op.cancellation_pending() => {
            // The runner stops at its next step. If it died, nobody will: once the
            // operation has been quiet for the runner stop wait, the driver records it.
            let quiet_since = op.header.updated_at.unwrap_or(now);
            let give_up_at = quiet_since.plus_ms(policy.runner_stop_wait_ms);
            if now < give_up_at {
                return RollbackAction::WaitUntil(give_up_at);
            }
            return RollbackAction::CancelForSilentRunner(Box::new(Event::OperationCancelled {
                reason: format!(
                    "{}; the runner did not stop within {} ms",
                    op.cancellation_reason.clone().unwrap_or_default(),
                    policy.runner_stop_wait_ms
                ),
            }));
        }
        Some(OperationStatus::Failed) | Some(OperationStatus::Cancelled)
            if op.rollback_plan.is_none() =>
        {
            return RollbackAction::Plan
        }
        Some(OperationStatus::RollingBack) => {}
        _ => return RollbackAction::Nothing,
    }
    for (i, c) in op.compensations.iter().enumerate() {
        let request = |attempt: u32| RollbackAction::Request {
            compensation: c.planned.clone(),
            attempt,
        };
        let exhausted = || RollbackAction::Finish {
            outcome: RollbackOutcome::NeedsAttention,
            remaining: op.compensations[i..]
                .iter()
                .filter(|r| r.progress != CompensationProgress::Done)
                .map(|r| r.planned.compensation_id)
                .collect(),
        };
        match c.progress {
            CompensationProgress::Done => continue,
            CompensationProgress::Planned => return request(1),
            CompensationProgress::Requested => {
                let lost_at = c
                    .requested_at
                    .map_or(now, |t| t.plus_ms(policy.reply_wait_ms));
                if now < lost_at {
                    return RollbackAction::WaitUntil(lost_at);
                }
                if c.attempts_in_budget() >= policy.attempts_max {
                    return exhausted();
                }
                return request(c.attempts + 1);
            }
            CompensationProgress::Failed => {
                if c.attempts_in_budget() >= policy.attempts_max {
                    return exhausted();
                }
                let retry_at = c.failed_at.map_or(now, |t| {
                    t.plus_ms(policy.backoff_ms(c.attempts_in_budget()))
                });
                if now < retry_at {
                    return RollbackAction::WaitUntil(retry_at);
                }
                return request(c.attempts + 1);
            }
        }
    }
    let held = op
        .rollback_plan
        .as_ref()
        .is_some_and(|p| !p.retained.is_empty());
    RollbackAction::Finish {
        outcome: if held {
            RollbackOutcome::Held
        } else {
            RollbackOutcome::RolledBack
        },
        remaining: Vec::new(),
    }
}

/// Why an operator's resolve is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveRefusal {
    #[error("operation {operation} is {status}, not needs_attention: only a rollback that stopped needs a compensation resolved by hand")]
    NotNeedingAttention { operation: Uuid, status: String },
    #[error("operation {operation} has no compensation {compensation}")]
    UnknownCompensation { operation: Uuid, compensation: Uuid },
    #[error("compensation {compensation} of operation {operation} is already done")]
    AlreadyDone { operation: Uuid, compensation: Uuid },
    #[error("a resolve needs a reason: say what was done by hand")]
    NoReason,
    #[error("compensation {compensation} of operation {operation} is the ledger's own ({action}): provledger applies it when the rollback resumes; resolve the executors' compensations")]
    LedgerCompensation {
        operation: Uuid,
        compensation: Uuid,
        action: String,
    },
}

/// Whether an operator may record `compensation` as done by hand: an executor's, yes; the
/// ledger's own (a claim's release, a migration's return to its source) no, since
/// provledger applies it itself when the rollback resumes, and a resolve would end the
/// rollback with the claim still held. The decider refuses such a resolve on every write
/// path (`decide::decide_append_with`), not only `rollback resolve`.
pub fn resolvable_by_hand(compensation: &provledger_events::catalogue::Compensation) -> bool {
    compensation.executor != Executor::Ledger
}

/// An operator resolves a stuck compensation of a rollback in `needs_attention` (done by
/// hand): `compensation_resolved`, and, when it was the last compensation not done,
/// `rollback_resumed` too, so that a driver (serve, `rollback run`) finishes the rollback
/// with nothing left to request. Recorded at the operation's exact version.
pub fn resolve(
    op: &OperationState,
    compensation_id: Uuid,
    reason: &str,
) -> Result<Vec<Event>, ResolveRefusal> {
    let operation = op.header.id.id;
    if reason.trim().is_empty() {
        return Err(ResolveRefusal::NoReason);
    }
    if op.status != Some(OperationStatus::NeedsAttention) {
        let status = op
            .status
            .and_then(|s| serde_json::to_value(s).ok())
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| "without a status".into());
        return Err(ResolveRefusal::NotNeedingAttention { operation, status });
    }
    let Some(c) = op
        .compensations
        .iter()
        .find(|c| c.planned.compensation_id == compensation_id)
    else {
        return Err(ResolveRefusal::UnknownCompensation {
            operation,
            compensation: compensation_id,
        });
    };
    if c.progress == CompensationProgress::Done {
        return Err(ResolveRefusal::AlreadyDone {
            operation,
            compensation: compensation_id,
        });
    }
    if !resolvable_by_hand(&c.planned.compensation) {
        return Err(ResolveRefusal::LedgerCompensation {
            operation,
            compensation: compensation_id,
            action: crate::planner::action_word(&c.planned.compensation.action),
        });
    }
    let mut events = vec![Event::CompensationResolved {
        compensation_id,
        reason: reason.to_string(),
    }];
    // The ledger's own compensations run when the rollback resumes: it resumes once no
    // executor's compensation is left open.
    let others_open = op.compensations.iter().any(|other| {
        other.planned.compensation_id != compensation_id
            && other.progress != CompensationProgress::Done
            && other.planned.compensation.executor != Executor::Ledger
    });
    if !others_open {
        events.push(Event::RollbackResumed {
            reason: format!("every stuck compensation resolved by hand (last: {reason})"),
        });
    }
    Ok(events)
}

/// The record of a compensation attempt's outcome: done (`failure` None), or failed with
/// the executor's reason (each written once: its commit id derives from the returned name).
pub fn attempt_outcome(
    compensation_id: Uuid,
    attempt: u32,
    failure: Option<String>,
) -> (String, Event) {
    match failure {
        None => (
            "done".to_string(),
            Event::CompensationDone { compensation_id },
        ),
        Some(error) => (
            format!("failed/{attempt}"),
            Event::CompensationFailed {
                compensation_id,
                attempt,
                error,
            },
        ),
    }
}
