//! Releasing an allocation with the provider's exact version: shared by the rollback
//! driver's ledger-internal compensation and the provisioning flows' terminations.

use provledger_events::{AggregateId, CommitDraft, Event, EventLog, Expectation};
use provledger_projections::Entity;

use crate::ledger::read_entity;
use crate::write::{record, RecordError};

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
        match record(
            log,
            provider,
            Expectation::Exactly(state.header.version),
            draft(vec![released]),
        )
        .await
        {
            Ok(_) => return Ok(()),
            Err(RecordError::Conflict { .. }) => continue,
            Err(e) => return Err(e.to_string()),
        }
    }
    Err(format!(
        "{provider}: {attempts_max} releases in a row met a newer version"
    ))
}
