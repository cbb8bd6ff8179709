//! Deletion is an event (design 4). A delete request moves the target to `deleting`, which
//! is terminal; every operation in flight on it is told to stop (`TargetDeletionNoticed` in
//! the log, then the `provledger.cancel.<id>` notice); its runner stops with the typed
//! `TargetDeleted` error and its rollback removes what it created. `Deleted` is recorded
//! once no instance and no allocation of the target remains.
//!
//! These functions are the shared steps; a provisioning flow runs the whole of it (the
//! reference one is `provledger-sim`'s `delete_cluster`),
//! and `serve` re-runs the idempotent ones it can (noticing, completing) from the log.

use provledger_events::catalogue::OperationKind;
use provledger_events::{AggregateId, Event, Expectation};
use provledger_projections::decide::{AlreadyDone, AppendRejection};
use provledger_projections::facts::{delete_request, deletion_completion, DeletionCompletion};
use provledger_projections::Entity;
use uuid::Uuid;

use crate::cancel::CancelNotices;
use crate::clock::Stamper;
use crate::ledger::{derived_commit_id, Ledger};
use crate::write::{RecordError, Recorded, Writer};

/// What a delete request found. Repeating a delete is idempotent and says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeleteRequestOutcome {
    Requested,
    AlreadyDeleting,
    AlreadyDeleted,
    /// Nothing was ever recorded under this id; nothing is written.
    Unknown,
}

#[derive(Debug, thiserror::Error)]
pub enum DeleteError {
    #[error("{0} cannot be deleted this way: only clusters and instances are")]
    WrongKind(AggregateId),
    /// The target's state could not be read from the log.
    #[error("reading the log: {0}")]
    Read(#[from] provledger_events::ReadError),
    /// A deletion step could not be written (nothing of it was).
    #[error("writing to the log: {0}")]
    Write(#[from] crate::write::RecordError),
}

/// The operation in flight on a target, unless it is the target's own delete.
pub fn cancellable_in_flight(entity: &Entity) -> Option<Uuid> {
    let in_flight = match entity {
        Entity::Cluster(c) => c.in_flight.as_ref(),
        Entity::Instance(i) => i.in_flight.as_ref(),
        _ => None,
    }?;
    match in_flight.kind {
        OperationKind::DeleteCluster | OperationKind::DeleteInstance => None,
        _ => Some(in_flight.operation_id),
    }
}

/// Records the delete request (unless the target is already deleting or deleted) and
/// cancels the operation in flight on it. Returns the outcome and the cancelled operation.
pub async fn request_delete(
    ledger: &Writer<Ledger>,
    notices: &CancelNotices,
    target: AggregateId,
    reason: &str,
    actor: &str,
    stamper: &Stamper,
) -> Result<(DeleteRequestOutcome, Option<Uuid>), DeleteError> {
    let entity = ledger.read_current(target).await?;
    let Some(entity) = entity else {
        return Ok((DeleteRequestOutcome::Unknown, None));
    };
    let Some(request) = delete_request(target.kind, reason) else {
        return Err(DeleteError::WrongKind(target));
    };
    // Decided at the exact version appended: a delete racing another one is recorded once,
    // and the loser learns it is already deleting.
    let outcome = match ledger
        .record(
            target,
            Expectation::Any,
            stamper.draft(actor, vec![request]),
        )
        .await
    {
        Ok(Recorded::Appended(_)) => DeleteRequestOutcome::Requested,
        Ok(Recorded::AlreadyDone {
            outcome: AlreadyDone::AlreadyDeleting,
            ..
        }) => DeleteRequestOutcome::AlreadyDeleting,
        Ok(Recorded::AlreadyDone {
            outcome: AlreadyDone::AlreadyDeleted,
            ..
        }) => DeleteRequestOutcome::AlreadyDeleted,
        Err(RecordError::Rejected(AppendRejection::NotFound { .. })) => {
            return Ok((DeleteRequestOutcome::Unknown, None))
        }
        Err(e) => return Err(e.into()),
    };
    let cancelled = match cancellable_in_flight(&entity) {
        Some(op) => notice_target_deletion(ledger, notices, op, reason, actor, stamper)
            .await?
            .then_some(op),
        None => None,
    };
    Ok((outcome, cancelled))
}

/// Tells operation `op` that its target is being deleted: `TargetDeletionNoticed` in the
/// log (once: a deterministic commit id), then the cancel notice. `Ok(false)` when the
/// operation is already closed or already noticed.
pub async fn notice_target_deletion(
    ledger: &Writer<Ledger>,
    notices: &CancelNotices,
    op: Uuid,
    reason: &str,
    actor: &str,
    stamper: &Stamper,
) -> Result<bool, DeleteError> {
    let Some(Entity::Operation(state)) = ledger.read_current(AggregateId::operation(op)).await?
    else {
        return Ok(false);
    };
    if state.target_deleted || state.is_closed() {
        return Ok(false);
    }
    let mut draft = stamper
        .draft(actor, vec![Event::target_deletion_noticed(reason)])
        .with_operation(op);
    draft.commit_id = derived_commit_id(op, "target_deletion_noticed");
    ledger
        .record_fact(AggregateId::operation(op), draft)
        .await?;
    notices.publish(op, reason).await;
    tracing::info!(operation = %op, %reason, "operation cancelled: its target is being deleted");
    Ok(true)
}

/// Records `Deleted` on a deleting target once nothing of it remains: no instance in its
/// node groups and no operation in flight (a cluster), or no allocation (an instance).
/// Returns whether the target is deleted now.
pub async fn complete_deletion(
    ledger: &Writer<Ledger>,
    target: AggregateId,
    actor: &str,
    stamper: &Stamper,
) -> Result<bool, DeleteError> {
    let Some(entity) = ledger.read_current(target).await? else {
        return Ok(false);
    };
    let runs_on = match &entity {
        Entity::Instance(i) => match i.provider_id {
            Some(provider) => match ledger.read_current(AggregateId::provider(provider)).await? {
                Some(Entity::Provider(p)) => Some(p),
                _ => None,
            },
            None => None,
        },
        _ => None,
    };
    let event = match deletion_completion(&entity, runs_on.as_deref()) {
        DeletionCompletion::AlreadyDeleted => return Ok(true),
        DeletionCompletion::NotYet => return Ok(false),
        DeletionCompletion::Record(event) => event,
    };
    let mut draft = stamper.draft(actor, vec![*event]);
    draft.commit_id = derived_commit_id(target.id, "deleted");
    ledger.record_fact(target, draft).await?;
    Ok(true)
}
