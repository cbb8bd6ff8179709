//! Operations in the client library: the one entry point through which a provisioning
//! service runs an operation ([`OperationRunner::run`]), the rollback driver that carries
//! out a recorded plan ([`driver::RollbackDriver`]), the executors compensations are sent
//! to ([`executors`]), cancellation notices ([`cancel`]) and the deletion flow
//! ([`deletion`]).
//!
//! Error handling for rollback lives here and nowhere else (Sahara's problems 1 and 2):
//! a provisioning service writes its stages and steps, returns errors with `?`, and the
//! runner records the failure, hands the operation to the planner and drives the plan.

pub mod cancel;
pub mod deletion;
pub mod driver;
pub mod executors;
mod runner;

pub use runner::{
    OperationCtx, OperationError, OperationRunner, OperationSpec, RunReport, StepError, StepHook,
    StepOutput,
};

use provledger_events::{
    AggregateId, AppendError, CommitDraft, Event, EventLog, Expectation, ReadError,
};
use provledger_projections::Entity;

/// The current state of one aggregate, folded from the log (not from a projection, so it
/// is as fresh as the log). `None` when the aggregate has no commit.
pub async fn read_entity<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
) -> Result<Option<Entity>, ReadError> {
    let commits = log.read_aggregate(aggregate).await?;
    if commits.is_empty() {
        return Ok(None);
    }
    let mut entity = Entity::new(aggregate);
    for commit in &commits {
        entity.apply(commit);
    }
    Ok(Some(entity))
}

/// A deterministic commit id for a driver or deleter write, so that a retry or a racing
/// replica writing the same fact is recognised as the same commit (UUID v5).
pub fn derived_commit_id(base: uuid::Uuid, what: &str) -> uuid::Uuid {
    uuid::Uuid::new_v5(&base, what.as_bytes())
}

/// Releases `consumer`'s allocation on `provider` if it is still there (idempotent: no
/// provider or no allocation is success). The release is appended with the provider's exact
/// version and re-checked after a conflict, at most `attempts_max` times. `draft` stamps the
/// commit (actor, operation). Shared by the driver's ledger-internal compensation and the
/// provisioning flows' terminations.
pub async fn release_allocation<L: EventLog>(
    log: &L,
    provider: uuid::Uuid,
    consumer: uuid::Uuid,
    reason: &str,
    attempts_max: usize,
    draft: impl Fn(Vec<Event>) -> CommitDraft,
) -> Result<(), String> {
    let provider = AggregateId::provider(provider);
    for _ in 0..attempts_max {
        let state = match read_entity(log, provider)
            .await
            .map_err(|e| e.to_string())?
        {
            Some(Entity::Provider(p)) => p,
            _ => return Ok(()),
        };
        if !state.allocations.contains_key(&consumer) {
            return Ok(());
        }
        let released = Event::AllocationReleased {
            consumer,
            reason: reason.to_string(),
        };
        match log
            .append(
                provider,
                Expectation::Exactly(state.header.version),
                draft(vec![released]),
            )
            .await
        {
            Ok(_) => return Ok(()),
            Err(AppendError::Conflict { .. }) => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    Err(format!(
        "{provider}: {attempts_max} releases in a row met a newer version"
    ))
}
