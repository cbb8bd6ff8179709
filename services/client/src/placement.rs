//! Placement's writes: deleting a resource provider without ever orphaning an allocation,
//! healing missing allocations, and releasing orphans. The decisions are the pure
//! functions of `provledger_projections::placement`; every write goes through the one
//! decided write path at the provider's exact version, so a racing claim is never lost
//! and a provider that gained an allocation meanwhile is never deleted.
//!
//! A cascade is ordered so that a crash anywhere leaves no orphan and a re-run finishes:
//! `provider_delete_requested` first (from then on claims are refused), then each
//! allocation released with its reason, then `provider_deleted`.

use provledger_events::catalogue::{AllocationHold, BlockingAllocation};
use provledger_events::{AggregateId, Event, EventLog, Expectation};
use provledger_projections::placement::{holds, orphans, plan_heal, Hold};
use provledger_projections::provider::{ProviderState, ProviderStatus};
use provledger_projections::{Entity, Projection};
use uuid::Uuid;

use crate::clock::Stamper;
use crate::ledger::{derived_commit_id, read_entity};
use crate::write::{record, record_fact, RecordError};

/// How many times a placement write re-reads and decides again after another writer
/// changed the provider in between.
pub const PLACEMENT_ATTEMPTS_MAX: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("provider {0} does not exist")]
    NotFound(Uuid),
    #[error(transparent)]
    Write(#[from] RecordError),
    #[error("reading the log: {0}")]
    Read(String),
    #[error("provider {provider}: {attempts} attempts in a row met a newer version; retry")]
    Contended { provider: Uuid, attempts: usize },
}

/// What `delete_provider` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderDeletion {
    Deleted {
        released: Vec<Hold>,
    },
    AlreadyDeleted,
    /// Allocations remain and no cascade was asked for: nothing was written.
    Refused {
        holds: Vec<Hold>,
    },
}

/// The whole state folded from the log: placement decisions need instances and
/// operations as well as the provider.
pub async fn read_projection<L: EventLog>(log: &L) -> Result<Projection, PlacementError> {
    use futures::StreamExt;
    let mut projection = Projection::new();
    let mut stream = log
        .read_all(1)
        .await
        .map_err(|e| PlacementError::Read(e.to_string()))?;
    while let Some(entry) = stream.next().await {
        match entry {
            Ok(commit) => {
                // What readers quarantine is not folded here either.
                let _ = projection.apply_checked(&commit);
            }
            Err(e) if e.quarantine_parts().is_some() => {}
            Err(e) => return Err(PlacementError::Read(e.to_string())),
        }
    }
    Ok(projection)
}

async fn provider_state<L: EventLog>(
    log: &L,
    provider: Uuid,
) -> Result<ProviderState, PlacementError> {
    match read_entity(log, AggregateId::provider(provider)).await {
        Ok(Some(Entity::Provider(p))) if p.status.is_some() => Ok(p),
        Ok(_) => Err(PlacementError::NotFound(provider)),
        Err(e) => Err(PlacementError::Read(e.to_string())),
    }
}

/// Deletes `provider`. Without `cascade`, refused while any allocation exists, listing each
/// with why it is there and what to do (nothing written). With `cascade`: the delete
/// request, each allocation released with its reason, then the delete; re-running after a
/// crash finishes the job.
pub async fn delete_provider<L: EventLog>(
    log: &L,
    provider: Uuid,
    cascade: bool,
    actor: &str,
    stamper: &Stamper,
) -> Result<ProviderDeletion, PlacementError> {
    let aggregate = AggregateId::provider(provider);
    let state = provider_state(log, provider).await?;
    if state.status == Some(ProviderStatus::Deleted) {
        return Ok(ProviderDeletion::AlreadyDeleted);
    }
    if !state.allocations.is_empty() && !cascade {
        // The whole state is read only to say why each allocation is there.
        let projection = read_projection(log).await?;
        return Ok(ProviderDeletion::Refused {
            holds: holds(&projection, &state),
        });
    }
    if state.status != Some(ProviderStatus::Deleting) {
        // From here on claims are refused, so the releases below cannot be outrun.
        let request = Event::ProviderDeleteRequested {
            cascade,
            reason: if cascade {
                "deleted with --cascade".into()
            } else {
                "deleted".into()
            },
        };
        let mut draft = stamper.draft(actor, vec![request]);
        draft.commit_id = derived_commit_id(provider, "delete_requested");
        record_fact(log, aggregate, draft).await?;
    }
    let mut released = Vec::new();
    for _ in 0..PLACEMENT_ATTEMPTS_MAX {
        let state = provider_state(log, provider).await?;
        if state.status == Some(ProviderStatus::Deleted) {
            return Ok(ProviderDeletion::Deleted { released });
        }
        if !state.allocations.is_empty() {
            // With a cascade, what the provider holds now is released here (first round:
            // every allocation; later ones: none, since claims are refused once the delete
            // is requested). Without one, only a claim that raced the request can be here.
            let projection = read_projection(log).await?;
            let late = holds(&projection, &state);
            if !cascade {
                // The provider goes back to active (claims accepted again), and the refusal
                // names what blocked it.
                let blocking = late
                    .iter()
                    .map(|h| BlockingAllocation {
                        consumer: h.consumer,
                        consumer_kind: h.consumer_kind,
                        hold: h.hold,
                    })
                    .collect();
                let draft = stamper.draft(actor, vec![Event::ProviderDeleteRefused { blocking }]);
                match record(
                    log,
                    aggregate,
                    Expectation::Exactly(state.header.version),
                    draft,
                )
                .await
                {
                    Ok(_) => return Ok(ProviderDeletion::Refused { holds: late }),
                    Err(RecordError::Conflict { .. }) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            for hold in late {
                release(
                    log,
                    provider,
                    &hold,
                    "provider deleted with --cascade",
                    actor,
                    stamper,
                )
                .await?;
                released.push(hold);
            }
            continue;
        }
        let mut draft = stamper.draft(actor, vec![Event::ProviderDeleted {}]);
        draft.commit_id = derived_commit_id(provider, "deleted");
        match record(
            log,
            aggregate,
            Expectation::Exactly(state.header.version),
            draft,
        )
        .await
        {
            Ok(_) => return Ok(ProviderDeletion::Deleted { released }),
            Err(RecordError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(PlacementError::Contended {
        provider,
        attempts: PLACEMENT_ATTEMPTS_MAX,
    })
}

/// Releases one allocation with its reason, once (a derived commit id: a re-run after a
/// crash finds it recorded).
async fn release<L: EventLog>(
    log: &L,
    provider: Uuid,
    hold: &Hold,
    why: &str,
    actor: &str,
    stamper: &Stamper,
) -> Result<(), PlacementError> {
    let event = Event::AllocationReleased {
        consumer: hold.consumer,
        reason: format!("{why}: {}", hold.why),
    };
    let mut draft = stamper.draft(actor, vec![event]);
    draft.commit_id = derived_commit_id(provider, &format!("release/{}/{}", hold.consumer, why));
    match record_fact(log, AggregateId::provider(provider), draft).await {
        Ok(_) => Ok(()),
        // Released meanwhile by someone else: what was asked for is true.
        Err(RecordError::Rejected(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// What heal-allocations did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct HealReport {
    pub healed: Vec<(Uuid, Uuid)>,
    pub skipped: Vec<(Uuid, String)>,
    pub failed: Vec<(Uuid, String)>,
}

/// Claims the missing allocation of every instance that has a host, none anywhere, and no
/// task in progress (`only`: one instance). `dry_run` writes nothing.
pub async fn heal_allocations<L: EventLog>(
    log: &L,
    only: Option<Uuid>,
    dry_run: bool,
    actor: &str,
    stamper: &Stamper,
) -> Result<HealReport, PlacementError> {
    let projection = read_projection(log).await?;
    let plan = plan_heal(&projection, only);
    let mut report = HealReport {
        skipped: plan.skipped,
        ..Default::default()
    };
    for (instance, provider, resources) in plan.claims {
        if dry_run {
            report.healed.push((instance, provider));
            continue;
        }
        let claim = Event::AllocationClaimed {
            consumer: instance,
            consumer_kind: provledger_events::catalogue::ConsumerKind::Instance,
            resources,
        };
        let mut draft = stamper.draft(actor, vec![claim]);
        draft.commit_id = derived_commit_id(instance, &format!("healed-on/{provider}"));
        match record_fact(log, AggregateId::provider(provider), draft).await {
            Ok(_) => report.healed.push((instance, provider)),
            Err(RecordError::Rejected(r)) => report.failed.push((instance, r.to_string())),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(report)
}

/// Releases the orphan allocations (consumer or provider gone), only those, each with its
/// reason, on the provider it was found on. `dry_run` writes nothing.
pub async fn fix_orphans<L: EventLog>(
    log: &L,
    dry_run: bool,
    actor: &str,
    stamper: &Stamper,
) -> Result<Vec<(Uuid, Hold)>, PlacementError> {
    let projection = read_projection(log).await?;
    let found = orphans(&projection);
    if !dry_run {
        for (provider, hold) in &found {
            debug_assert_eq!(hold.hold, AllocationHold::Orphan);
            release(
                log,
                *provider,
                hold,
                "orphan released by audit --fix-orphans",
                actor,
                stamper,
            )
            .await?;
        }
    }
    Ok(found)
}

/// The provider ids registered on `host` (a compute service with many providers, such as
/// ironic nodes), in id order.
pub fn providers_on_host(projection: &Projection, host: &str) -> Vec<Uuid> {
    projection
        .providers()
        .into_iter()
        .filter(|p| p.host == host && p.status != Some(ProviderStatus::Deleted))
        .map(|p| p.header.id.id)
        .collect()
}
