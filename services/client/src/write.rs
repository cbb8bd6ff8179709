//! The one write path: read the aggregate, decide, append at exactly the version decided
//! on. `cmd.append`, `provledger append` and this library's own writes all go through
//! [`record`], so a commit is acknowledged only if the fold applies it, and no decision is
//! taken against a state older than the version the commit lands on.

use std::time::Duration;

use provledger_events::{
    AggregateId, AppendError, AppendOutcome, AppendStatus, CommitDraft, EventLog, Expectation,
    ReadError,
};
use provledger_projections::decide::{
    decide_append_with, Admission, AlreadyDone, AppendRejection, DecideOptions,
};
use provledger_projections::Entity;

/// How many times a write with `expect any` re-reads and re-decides after another writer
/// appended in between. Each round one racer wins, so this bounds the wait, not progress.
pub const DECIDE_ATTEMPTS_MAX: usize = 16;
/// How many times a write whose read or append came back `Unavailable` (the ack may be lost
/// while the commit is durable) is tried again with the same commit id. The re-read recognises
/// a commit that did land, so nothing is written twice and nothing leaks.
pub const UNAVAILABLE_RETRIES_MAX: usize = 3;
/// The longest pause between two rounds; the pause is spread by commit id so that racers
/// do not collide again in lockstep.
const DECIDE_BACKOFF_MAX: Duration = Duration::from_millis(20);

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The commit is durable (or was already: a retry with the same commit id).
    Appended(AppendOutcome),
    /// The commit asked for what is already true (a repeated delete request); nothing was
    /// written. `version` is the aggregate's version it was decided at, `position` that
    /// of its last commit.
    AlreadyDone {
        outcome: AlreadyDone,
        version: u64,
        position: u64,
    },
}

impl Recorded {
    /// The aggregate's version after this write (or at which nothing needed writing).
    pub fn version(&self) -> u64 {
        match self {
            Recorded::Appended(outcome) => outcome.version,
            Recorded::AlreadyDone { version, .. } => *version,
        }
    }

    /// The outcome of an append, if one happened or had happened.
    pub fn appended(&self) -> Option<AppendOutcome> {
        match self {
            Recorded::Appended(outcome) => Some(*outcome),
            Recorded::AlreadyDone { .. } => None,
        }
    }
}

/// Why a write did not happen. Nothing was written in any case.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error(transparent)]
    Rejected(#[from] AppendRejection),
    #[error("conflict on {aggregate}: expected version {expected}, actual version is {actual}")]
    Conflict {
        aggregate: AggregateId,
        expected: Expectation,
        actual: u64,
    },
    #[error("{aggregate}: {attempts} decisions in a row met a newer version; retry later")]
    Contended {
        aggregate: AggregateId,
        attempts: usize,
    },
    /// NATS refused this user the aggregate's subject: retrying cannot help.
    #[error("{aggregate}: NATS denied this user publishing its commit ({message}); write through cmd.append or connect as a designated writer")]
    PermissionDenied {
        aggregate: AggregateId,
        message: String,
    },
    #[error(transparent)]
    Append(AppendError),
    #[error(transparent)]
    Read(#[from] ReadError),
}

impl From<AppendError> for RecordError {
    fn from(e: AppendError) -> Self {
        match e {
            AppendError::Conflict {
                aggregate,
                expected,
                actual,
            } => RecordError::Conflict {
                aggregate,
                expected,
                actual,
            },
            other => RecordError::Append(other),
        }
    }
}

/// The permissions violation NATS reported for this aggregate's subject, if an
/// unavailable append was in fact refused.
fn denied_append(aggregate: AggregateId, since: std::time::Instant) -> Option<String> {
    crate::denials::denied(&format!(".ev.{}.{}", aggregate.kind, aggregate.id), since)
}

fn backoff(draft: &CommitDraft, attempt: usize) -> Duration {
    let spread = u64::from(draft.commit_id.as_bytes()[15]) + 1; // 1..=256
    let micros = spread * 40 * attempt as u64;
    Duration::from_micros(micros).min(DECIDE_BACKOFF_MAX)
}

/// Writes `draft` to `aggregate` if `expect` admits its version and the decider admits
/// the commit in its state at that version; the append then carries `Exactly(version)`.
/// With `expect any`, losing a race re-reads and re-decides, at most
/// [`DECIDE_ATTEMPTS_MAX`] times. A retry of a commit already in the log (same commit id
/// and payload) is recognised before anything is decided.
pub async fn record<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
) -> Result<Recorded, RecordError> {
    record_inner(
        log,
        aggregate,
        expect,
        draft,
        false,
        DecideOptions::default(),
    )
    .await
}

/// [`record`] with decider options (`force`: an inventory below usage).
pub async fn record_with<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
    options: DecideOptions,
) -> Result<Recorded, RecordError> {
    record_inner(log, aggregate, expect, draft, false, options).await
}

/// Writes a fact whose commit id is derived from what it records (a driver's or a
/// deleter's, see `derived_commit_id`): the id names the fact, so finding it already in
/// the log means the fact is recorded, even if this attempt would have worded it
/// differently (its events depend on state that the first attempt changed). A driver that
/// crashed between two such facts resumes instead of meeting `CommitIdReused` forever.
pub async fn record_fact<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    draft: CommitDraft,
) -> Result<Recorded, RecordError> {
    record_inner(
        log,
        aggregate,
        Expectation::Any,
        draft,
        true,
        DecideOptions::default(),
    )
    .await
}

async fn record_inner<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
    id_names_the_fact: bool,
    options: DecideOptions,
) -> Result<Recorded, RecordError> {
    draft.validate(&aggregate).map_err(AppendError::from)?;
    let mut unavailable = 0;
    for attempt in 0..DECIDE_ATTEMPTS_MAX {
        if attempt > 0 {
            tokio::time::sleep(backoff(&draft, attempt)).await;
        }
        let commits = match log.read_aggregate(aggregate).await {
            Ok(commits) => commits,
            // The read is part of the write: an unavailable log is retried like an
            // unavailable append, within the same bound.
            Err(e @ ReadError::Unavailable { .. }) => {
                unavailable += 1;
                if unavailable > UNAVAILABLE_RETRIES_MAX {
                    return Err(e.into());
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(earlier) = commits.iter().find(|c| c.commit_id == draft.commit_id) {
            if id_names_the_fact || earlier.same_payload_as(&draft) {
                return Ok(Recorded::Appended(AppendOutcome {
                    position: earlier.position,
                    version: earlier.version,
                    status: AppendStatus::AlreadyAppended,
                }));
            }
            return Err(AppendError::CommitIdReused {
                commit_id: draft.commit_id,
                position: earlier.position,
            }
            .into());
        }
        let version = commits.last().map_or(0, |c| c.version);
        if !expect.admits(version) {
            return Err(RecordError::Conflict {
                aggregate,
                expected: expect,
                actual: version,
            });
        }
        let entity = Entity::fold(aggregate, &commits);
        if let Admission::AlreadyDone(outcome) =
            decide_append_with(aggregate, entity.as_ref(), &draft, options)?
        {
            let position = commits.last().map_or(0, |c| c.position);
            return Ok(Recorded::AlreadyDone {
                outcome,
                version,
                position,
            });
        }
        let appending = std::time::Instant::now();
        match log
            .append(aggregate, Expectation::Exactly(version), draft.clone())
            .await
        {
            Ok(outcome) => return Ok(Recorded::Appended(outcome)),
            // Someone appended after our read: with `any` we decide again on the new
            // state; otherwise the caller's expectation is stale.
            Err(AppendError::Conflict { .. }) if expect == Expectation::Any => continue,
            Err(AppendError::Conflict { actual, .. }) => {
                return Err(RecordError::Conflict {
                    aggregate,
                    expected: expect,
                    actual,
                })
            }
            // The append may have landed with its ack lost: read again and see.
            Err(e @ AppendError::Unavailable { .. }) => {
                if let Some(message) = denied_append(aggregate, appending) {
                    return Err(RecordError::PermissionDenied { aggregate, message });
                }
                unavailable += 1;
                if unavailable > UNAVAILABLE_RETRIES_MAX {
                    return Err(e.into());
                }
                tracing::warn!(%aggregate, commit_id = %draft.commit_id, error = %e, "append unavailable; retrying with the same commit id");
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(RecordError::Contended {
        aggregate,
        attempts: DECIDE_ATTEMPTS_MAX,
    })
}
