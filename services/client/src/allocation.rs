//! Releasing an allocation with the provider's exact version, and giving a migration's
//! source back to its instance: the rollback driver's ledger-internal compensations, also
//! used by the provisioning flows' terminations.

use provledger_events::{AggregateId, CommitDraft, Event, EventLog, Expectation};
use provledger_projections::Entity;

use crate::write::{RecordError, Writer};

/// Releases `consumer`'s allocation on `provider` if it is still there (idempotent: no
/// provider or no allocation is success). The release is decided by the one write path on
/// the provider's state in this process's turn and appended at exactly that version, so
/// releases of one shared provider queue behind each other instead of losing races; only a
/// writer in another process can make it decide again. `draft` stamps the commit (actor,
/// operation). Shared by the driver's ledger-internal compensation and the provisioning
/// flows' terminations.
pub async fn release_allocation<L: EventLog>(
    writer: &Writer<L>,
    provider: uuid::Uuid,
    consumer: uuid::Uuid,
    reason: &str,
    draft: impl Fn(Vec<Event>) -> CommitDraft,
) -> Result<(), RecordError> {
    let provider = AggregateId::provider(provider);
    let released = Event::allocation_released(consumer, reason);
    match writer
        .record(provider, Expectation::Any, draft(vec![released]))
        .await
    {
        Ok(_) => Ok(()),
        // Refused: fine if there is nothing to release (no provider, no such allocation:
        // what was asked for is true); otherwise the refusal is the answer.
        Err(RecordError::Rejected(rejection)) => match writer.read_current(provider).await? {
            Some(Entity::Provider(p)) if p.allocations.contains_key(&consumer) => {
                Err(RecordError::Rejected(rejection))
            }
            _ => Ok(()),
        },
        Err(e) => Err(e),
    }
}

/// Appends to a provider attempted again after another writer changed it in between.
const RETURN_TO_SOURCE_ATTEMPTS_MAX: usize = 8;

/// Gives migration `migration`'s source on `provider` back to `instance`
/// (`facts::return_to_source_events`, decided at the provider's exact version; nothing to
/// do when the migration holds nothing there). Idempotent.
pub async fn return_to_source<L: EventLog>(
    writer: &Writer<L>,
    provider: uuid::Uuid,
    instance: uuid::Uuid,
    migration: uuid::Uuid,
    reason: &str,
    draft: impl Fn(Vec<Event>) -> CommitDraft,
) -> Result<(), RecordError> {
    let aggregate = AggregateId::provider(provider);
    for _ in 0..RETURN_TO_SOURCE_ATTEMPTS_MAX {
        let Some(Entity::Provider(source)) = writer.read_current(aggregate).await? else {
            return Ok(()); // no such provider: nothing is held there
        };
        let Some(events) = provledger_projections::facts::return_to_source_events(
            &source, instance, migration, reason,
        ) else {
            return Ok(());
        };
        match writer
            .record(
                aggregate,
                Expectation::Exactly(source.header.version),
                draft(events),
            )
            .await
        {
            Ok(_) => return Ok(()),
            Err(RecordError::Conflict { .. }) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(RecordError::Contended {
        aggregate,
        attempts: RETURN_TO_SOURCE_ATTEMPTS_MAX,
    })
}
