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

use provledger_events::{AggregateId, EventLog, ReadError};
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
