//! Placement's writes: deleting a resource provider without ever orphaning an allocation,
//! healing missing allocations, and releasing orphans. The decisions are the pure
//! functions of `provledger_projections::placement`; every write goes through the one
//! decided write path at the provider's exact version, so a racing claim is never lost
//! and a provider that gained an allocation meanwhile is never deleted.
//!
//! What the decisions look at besides the provider (its consumers, the other providers,
//! the instances) comes from a [`StateView`]: [`LogView`] folds the log, serve passes its
//! projection store, so a refused delete costs its allocations and heal or orphans the
//! entities of the kinds involved, never the log's length. The provider itself is always
//! read from the log, and the view only tells what to try: each claim and release is
//! written with `record`/`record_fact`, decided against the log at the provider's exact
//! version, so a view that lags the log can make a write be refused, never wrong.
//!
//! A delete is decided in the pure core (`facts::provider_delete_step`) and written at the
//! provider's exact version: with no allocation (or a cascade of at most
//! `CASCADE_RELEASES_PER_COMMIT`) in one commit, `provider_delete_requested`, each release
//! and `provider_deleted` together, so no crash can leave half of it. A larger cascade spans
//! several commits, the first recording the delete (claims refused from then on); one
//! stopped half way is finished by whoever finds it (`finish_provider_deletes`, run by
//! serve's sweep), each allocation released once.

use provledger_events::catalogue::{AllocationHold, Inventory};
use provledger_events::{AggregateId, Event, EventLog, Expectation};
use provledger_projections::decide::DecideOptions;
use provledger_projections::facts::{heal_facts, provider_delete_step, ProviderDeleteStep};
use provledger_projections::instance::InstanceState;
use provledger_projections::placement::{consumer_entity, holds, orphans, plan_heal, Hold};
use provledger_projections::provider::{ProviderState, ProviderStatus};
use provledger_projections::{Entity, Projection};
use uuid::Uuid;

use crate::clock::Stamper;
use crate::ledger::derived_commit_id;
use crate::view::{entities, fold_log, StateView, ViewError};
use crate::write::{Fact, FromTheLog, RecordError, Recorded, Writer};

#[doc(no_inline)]
pub use crate::view::LogView;

/// How many times a placement write re-reads and decides again after another writer
/// changed the provider in between.
pub const PLACEMENT_ATTEMPTS_MAX: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("provider {0} does not exist")]
    NotFound(Uuid),
    #[error(transparent)]
    Write(#[from] RecordError),
    #[error("reading the state: {0}")]
    Read(#[from] ViewError),
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

/// Registers a resource provider (a compute node) with its inventories in one commit, as a
/// compute service does when a node comes up: `provider_registered` then one
/// `inventory_set` per resource class, on a provider that must not exist yet.
pub async fn register_provider<L: EventLog>(
    writer: &Writer<L>,
    provider: Uuid,
    name: &str,
    host: &str,
    inventories: &std::collections::BTreeMap<String, Inventory>,
    actor: &str,
    stamper: &Stamper,
) -> Result<Recorded, RecordError> {
    let mut events = vec![Event::provider_registered(name, host)];
    events.extend(
        inventories
            .iter()
            .map(|(class, inventory)| Event::inventory_set(class.clone(), *inventory)),
    );
    writer
        .record(
            AggregateId::provider(provider),
            Expectation::NoStream,
            stamper.draft(actor, events),
        )
        .await
}

/// Sets one inventory of a provider (the hardware changed), decided at the provider's
/// exact version: an inventory below what is allocated is refused (`below_usage`) unless
/// `force` says the hardware really shrank.
pub async fn set_inventory<L: EventLog>(
    writer: &Writer<L>,
    provider: Uuid,
    resource_class: &str,
    inventory: Inventory,
    force: bool,
    actor: &str,
    stamper: &Stamper,
) -> Result<Recorded, RecordError> {
    let event = Event::inventory_set(resource_class, inventory);
    writer
        .record_with(
            AggregateId::provider(provider),
            Expectation::Any,
            stamper.draft(actor, vec![event]),
            DecideOptions {
                force,
                ..Default::default()
            },
        )
        .await
}

/// The whole state folded from the log (for the CLI's `--host` and tools; placement's
/// decisions read a [`StateView`]).
pub async fn read_projection<L: EventLog>(log: &L) -> Result<Projection, PlacementError> {
    Ok(fold_log(log).await?)
}

/// Every allocation on `provider` with why it is there: the provider as given (read from
/// the log), each consumer looked up in `view` by id. Costs the provider's allocations.
pub async fn holds_on<V: StateView>(
    view: &V,
    provider: &ProviderState,
) -> Result<Vec<Hold>, PlacementError> {
    // Collected before the reads: an iterator with closures held across an await would
    // make the future not `Send` for serve.
    let ids: Vec<AggregateId> = provider
        .allocations
        .iter()
        .map(|(consumer, a)| consumer_entity(*consumer, a.consumer_kind))
        .collect();
    let consumers = entities(view, ids).await?;
    Ok(holds(|id| consumers.get(id), provider))
}

async fn provider_state<L: EventLog>(
    writer: &Writer<L>,
    provider: Uuid,
) -> Result<ProviderState, PlacementError> {
    match writer.read_current(AggregateId::provider(provider)).await {
        Ok(Some(Entity::Provider(p))) if p.status.is_some() => Ok(*p),
        Ok(_) => Err(PlacementError::NotFound(provider)),
        Err(e) => Err(PlacementError::Read(ViewError::Log(e))),
    }
}

/// Deletes `provider`. Without `cascade`, refused while any allocation exists, listing each
/// with why it is there and what to do (nothing written). With `cascade`: the delete
/// request, each allocation released with its reason, then the delete; re-running after a
/// crash finishes the job. `view` says why each allocation is there (each consumer read by
/// id); the provider and every write are decided from the log.
pub async fn delete_provider<L: EventLog, V: StateView>(
    writer: &Writer<L>,
    view: &V,
    provider: Uuid,
    cascade: bool,
    actor: &str,
    stamper: &Stamper,
) -> Result<ProviderDeletion, PlacementError> {
    let aggregate = AggregateId::provider(provider);
    let mut released: Vec<Hold> = Vec::new();
    let mut conflicts = 0;
    loop {
        let state = provider_state(writer, provider).await?;
        // The view is read only to say why each allocation is there: one consumer each.
        let holds = match state.allocations.is_empty() {
            true => Vec::new(),
            false => holds_on(view, &state).await?,
        };
        let why = |consumer: Uuid| match holds.iter().find(|h| h.consumer == consumer) {
            Some(h) => (h.hold, h.why.clone()),
            None => (AllocationHold::Orphan, "no longer classified".to_string()),
        };
        let (events, deletes, freed) = match provider_delete_step(&state, cascade, why) {
            ProviderDeleteStep::AlreadyDeleted if released.is_empty() => {
                return Ok(ProviderDeletion::AlreadyDeleted)
            }
            ProviderDeleteStep::AlreadyDeleted => {
                return Ok(ProviderDeletion::Deleted { released })
            }
            ProviderDeleteStep::Refused => return Ok(ProviderDeletion::Refused { holds }),
            ProviderDeleteStep::Write {
                events,
                released,
                deletes,
            } => (events, deletes, released),
        };
        let refusal = events
            .iter()
            .any(|e| matches!(e, Event::ProviderDeleteRefused { .. }));
        // One commit id per version: a retry whose answer was lost is recognised.
        let mut draft = stamper.draft(actor, events);
        draft.commit_id = derived_commit_id(provider, &format!("delete/{}", state.header.version));
        match writer
            .record(aggregate, Expectation::Exactly(state.header.version), draft)
            .await
        {
            Ok(_) if refusal => return Ok(ProviderDeletion::Refused { holds }),
            Ok(_) => {
                released.extend(holds.into_iter().filter(|h| freed.contains(&h.consumer)));
                if deletes {
                    return Ok(ProviderDeletion::Deleted { released });
                }
            }
            // A claim or another deleter got in: decide again on the newer provider.
            Err(RecordError::Conflict { .. }) => {
                conflicts += 1;
                if conflicts >= PLACEMENT_ATTEMPTS_MAX {
                    return Err(PlacementError::Contended {
                        provider,
                        attempts: PLACEMENT_ATTEMPTS_MAX,
                    });
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Finishes every provider delete found half done in `view` (`deleting`: a cascade whose
/// releases span several commits, or any delete, stopped by a crash): serve's sweep runs
/// it, so a delete is never left in the middle. Returns the providers it finished.
pub async fn finish_provider_deletes<L: EventLog, V: StateView>(
    writer: &Writer<L>,
    view: &V,
    actor: &str,
    stamper: &Stamper,
) -> Result<Vec<Uuid>, PlacementError> {
    let mut finished = Vec::new();
    for p in view.providers().await? {
        if p.status != Some(ProviderStatus::Deleting) {
            continue;
        }
        let id = p.header.id.id;
        match delete_provider(writer, view, id, false, actor, stamper).await {
            Ok(ProviderDeletion::Deleted { released }) => {
                tracing::info!(provider = %id, released = released.len(), "a provider delete found half done was finished");
                finished.push(id);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(provider = %id, error = %e, "finishing a provider delete failed; the next sweep tries again")
            }
        }
    }
    Ok(finished)
}

/// Releases one allocation with its reason, once (a derived commit id: a re-run after a
/// crash finds it recorded).
async fn release<L: EventLog>(
    writer: &Writer<L>,
    provider: Uuid,
    hold: &Hold,
    why: &str,
    actor: &str,
    stamper: &Stamper,
) -> Result<(), PlacementError> {
    let event = Event::allocation_released(hold.consumer, format!("{why}: {}", hold.why));
    let mut draft = stamper.draft(actor, vec![event]);
    draft.commit_id = derived_commit_id(provider, &format!("release/{}/{}", hold.consumer, why));
    match writer
        .record_fact(AggregateId::provider(provider), draft)
        .await
    {
        Ok(_) => Ok(()),
        // Released meanwhile by someone else: what was asked for is true.
        Err(RecordError::Rejected(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// What heal-allocations did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct HealReport {
    pub healed: Vec<(Uuid, Uuid)>,
    pub skipped: Vec<(Uuid, String)>,
    pub failed: Vec<(Uuid, String)>,
}

/// Claims the missing allocation of every instance that has a host, none anywhere, and no
/// task in progress (`only`: one instance). `dry_run` writes nothing. The instances and
/// who holds allocations come from `view` (the instances, or the one asked for, and each
/// one's allocations by consumer); each claim is decided against the log by the write path
/// (capacity at the provider's exact version).
pub async fn heal_allocations<L: EventLog, V: StateView>(
    writer: &Writer<L>,
    view: &V,
    only: Option<Uuid>,
    dry_run: bool,
    actor: &str,
    stamper: &Stamper,
) -> Result<HealReport, PlacementError> {
    let instances = match only {
        Some(id) => match view.entity(&AggregateId::instance(id)).await? {
            Some(Entity::Instance(i)) => vec![*i],
            _ => Vec::new(),
        },
        None => view.instances().await?,
    };
    let mut held = std::collections::BTreeSet::new();
    for i in &instances {
        let id = i.header.id.id;
        if !view.allocation_providers(id).await?.is_empty() {
            held.insert(id);
        }
    }
    let plan = plan_heal(&instances, |consumer| held.contains(&consumer));
    let mut report = HealReport {
        skipped: plan.skipped,
        ..Default::default()
    };
    let by_id: std::collections::BTreeMap<Uuid, &InstanceState> =
        instances.iter().map(|i| (i.header.id.id, i)).collect();
    for (instance, provider, resources) in plan.claims {
        if dry_run {
            report.healed.push((instance, provider));
            continue;
        }
        let Some(state) = by_id.get(&instance) else {
            continue; // the plan names only instances it was given
        };
        // The instance's fact at the version the view saw; the claim wherever the provider
        // is (the write path decides it at the provider's exact version).
        let facts = heal_facts(state, provider, resources)
            .into_iter()
            .map(|f| {
                let mut draft = stamper.draft(actor, f.events);
                draft.commit_id = derived_commit_id(instance, &f.name);
                Fact {
                    aggregate: f.aggregate,
                    expect: match f.aggregate.kind {
                        provledger_events::AggregateKind::Instance => {
                            Expectation::Exactly(state.header.version)
                        }
                        _ => Expectation::Any,
                    },
                    draft,
                }
            })
            .collect();
        match writer.record_atomic(facts, DecideOptions::default(), &FromTheLog).await {
            Ok(_) => report.healed.push((instance, provider)),
            Err(RecordError::Rejections { rejections }) => report.failed.push((
                instance,
                rejections
                    .iter()
                    .map(|(a, r)| format!("{a}: {r}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            )),
            // The instance changed after the view was read (deleted, moved, claimed
            // elsewhere): nothing was written; a later heal decides again.
            Err(RecordError::Conflicts { .. }) => report.failed.push((
                instance,
                format!("instance {instance} changed since it was read; nothing claimed, run heal again"),
            )),
            Err(e) => return Err(e.into()),
        }
    }
    Ok(report)
}

/// Releases the orphan allocations (consumer or provider gone), only those, each with its
/// reason, on the provider it was found on. `dry_run` writes nothing. The providers and
/// their consumers come from `view`; each release is written on the provider through the
/// write path (a consumer released meanwhile is left as it is).
pub async fn fix_orphans<L: EventLog, V: StateView>(
    writer: &Writer<L>,
    view: &V,
    dry_run: bool,
    actor: &str,
    stamper: &Stamper,
) -> Result<Vec<(Uuid, Hold)>, PlacementError> {
    let providers = view.providers().await?;
    let ids: Vec<AggregateId> = providers
        .iter()
        .flat_map(|p| p.allocations.iter())
        .map(|(consumer, a)| consumer_entity(*consumer, a.consumer_kind))
        .collect();
    let consumers = entities(view, ids).await?;
    let found = orphans(&providers, |id| consumers.get(id));
    if !dry_run {
        for (provider, hold) in &found {
            debug_assert_eq!(hold.hold, AllocationHold::Orphan);
            release(
                writer,
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
