//! Placement's pure decisions over the folded state (Nova seed "compute service delete"):
//! why each allocation pins its provider and what to do about it, which allocations are
//! orphans, and which instances heal-allocations would claim for.
//!
//! Consumers: an instance holds the allocation on the provider it runs on; a migration
//! (consumer kind `migration`, the consumer id is the migrating operation's id) holds the
//! source while the instance holds the destination, until it is confirmed (the source is
//! released) or reverted (the destination is released); an instance evacuated elsewhere
//! whose source allocation was never cleaned leaves evacuation residue.
//!
//! Every function here takes only what it decides from: the providers or instances it
//! walks and a `lookup` of the other entities by id (`|id| projection.get(id)` over a
//! whole fold, or a few entities a projection store read by id). None of them needs the
//! whole state, so a caller never has to fold the whole log to ask.

use std::collections::{BTreeMap, BTreeSet};

use provledger_events::catalogue::{AllocationHold, ConsumerKind, VmState};
use provledger_events::AggregateId;
use serde::Serialize;
use uuid::Uuid;

use crate::instance::InstanceState;
use crate::provider::{ProviderState, ProviderStatus};
use crate::Entity;

/// One allocation on a provider, why it is there, and what an operator does about it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Hold {
    pub consumer: Uuid,
    pub consumer_kind: ConsumerKind,
    pub hold: AllocationHold,
    pub resources: BTreeMap<String, u64>,
    pub why: String,
    pub what_to_do: String,
}

/// The ids [`classify`] looks up for an allocation of `consumer`: its operation for a
/// migration, the instance otherwise.
pub fn consumer_entity(consumer: Uuid, kind: ConsumerKind) -> AggregateId {
    match kind {
        ConsumerKind::Migration => AggregateId::operation(consumer),
        ConsumerKind::Instance => AggregateId::instance(consumer),
    }
}

/// Why `consumer`'s allocation is on `provider`. `lookup` answers the consumer's entity
/// ([`consumer_entity`]) by id; nothing else is looked up.
pub fn classify<'a>(
    lookup: impl Fn(&AggregateId) -> Option<&'a Entity>,
    provider: Uuid,
    consumer: Uuid,
    kind: ConsumerKind,
) -> (AllocationHold, String, String) {
    match kind {
        ConsumerKind::Migration => {
            match lookup(&AggregateId::operation(consumer)) {
                Some(Entity::Operation(op)) if op.is_closed() => (
                    AllocationHold::Orphan,
                    format!("migration {consumer} finished ({:?}) but its allocation stayed", op.status),
                    "release it: `provledger audit --fix-orphans`".into(),
                ),
                _ => (
                    AllocationHold::UnconfirmedMigration,
                    format!("migration {consumer} is not confirmed or reverted: it holds the source"),
                    "confirm the migration (releases this source allocation) or revert it".into(),
                ),
            }
        }
        ConsumerKind::Instance => match lookup(&AggregateId::instance(consumer)) {
            None => (
                AllocationHold::Orphan,
                format!("instance {consumer} was never recorded"),
                "release it: `provledger audit --fix-orphans`".into(),
            ),
            Some(Entity::Instance(i)) if i.vm_state == Some(VmState::Deleted) => (
                AllocationHold::Orphan,
                format!("instance {consumer} is deleted"),
                "release it: `provledger audit --fix-orphans`".into(),
            ),
            Some(Entity::Instance(i)) if i.provider_id.is_some_and(|p| p != provider) => (
                AllocationHold::EvacuationResidue,
                format!(
                    "instance {consumer} runs on provider {} now (evacuated); this source allocation was never cleaned",
                    i.provider_id.map(|p| p.to_string()).unwrap_or_default()
                ),
                "release it: `provledger provider delete --cascade` does, with this reason".into(),
            ),
            _ => (
                AllocationHold::Instance,
                format!("instance {consumer} runs here"),
                "migrate the instance elsewhere or delete it first".into(),
            ),
        },
    }
}

/// Every allocation on `provider`, in consumer order, with why it is there (`lookup`: each
/// consumer's entity, see [`consumer_entity`]).
pub fn holds<'a>(
    lookup: impl Fn(&AggregateId) -> Option<&'a Entity>,
    provider: &ProviderState,
) -> Vec<Hold> {
    let id = provider.header.id.id;
    provider
        .allocations
        .iter()
        .map(|(consumer, allocation)| {
            let (hold, why, what_to_do) =
                classify(&lookup, id, *consumer, allocation.consumer_kind);
            Hold {
                consumer: *consumer,
                consumer_kind: allocation.consumer_kind,
                hold,
                resources: allocation.resources.to_map(),
                why,
                what_to_do,
            }
        })
        .collect()
}

/// The orphan allocations on `providers` (every provider, for the whole state): (provider,
/// hold). A provider that is gone orphans all it holds. `lookup`: the consumers' entities.
pub fn orphans<'a, 'p>(
    providers: impl IntoIterator<Item = &'p ProviderState>,
    lookup: impl Fn(&AggregateId) -> Option<&'a Entity>,
) -> Vec<(Uuid, Hold)> {
    let mut out = Vec::new();
    for p in providers {
        let gone = p.status == Some(ProviderStatus::Deleted);
        for mut hold in holds(&lookup, p) {
            if gone {
                hold.hold = AllocationHold::Orphan;
                hold.why = format!("its provider {} is deleted", p.header.id.id);
            }
            if hold.hold == AllocationHold::Orphan {
                out.push((p.header.id.id, hold));
            }
        }
    }
    out
}

/// What heal-allocations would do.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HealPlan {
    /// (instance, provider, resources) to claim.
    pub claims: Vec<(Uuid, Uuid, BTreeMap<String, u64>)>,
    /// (instance, why it is left alone).
    pub skipped: Vec<(Uuid, String)>,
}

/// Instances that have a host, no allocation anywhere and no task in progress get their
/// allocation claimed on their host; the others are listed with why (Nova's
/// `heal_allocations`). `instances`: those to look at (every one, or the one asked for);
/// `has_allocation`: whether a consumer holds an allocation on any provider.
pub fn plan_heal<'i>(
    instances: impl IntoIterator<Item = &'i InstanceState>,
    has_allocation: impl Fn(Uuid) -> bool,
) -> HealPlan {
    let mut plan = HealPlan::default();
    for i in instances {
        let id = i.header.id.id;
        if has_allocation(id) {
            continue; // has its allocation: nothing to heal, not worth listing
        }
        match heal_claim(i) {
            Ok(resources) => plan
                .claims
                .push((id, i.provider_id.unwrap_or_default(), resources)),
            Err(reason) => plan.skipped.push((id, reason.to_string())),
        }
    }
    plan
}

/// Why `heal-allocations` leaves an instance alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HealSkip {
    #[error("deleted or being deleted")]
    Deleted,
    #[error("task {0:?} in progress; heal it once the task ends")]
    TaskInProgress(provledger_events::catalogue::TaskState),
    #[error("no host: it was never scheduled")]
    NoHost,
    #[error("its flavor records no resources to claim")]
    NoResources,
}

/// For an instance that holds no allocation: the resources to claim on its host
/// (`provider_id`), or why it is left alone.
pub fn heal_claim(i: &InstanceState) -> Result<BTreeMap<String, u64>, HealSkip> {
    if matches!(i.vm_state, Some(VmState::Deleted) | None) || i.delete_requested {
        Err(HealSkip::Deleted)
    } else if let Some(task) = i.task_state {
        Err(HealSkip::TaskInProgress(task))
    } else if i.provider_id.is_none() {
        Err(HealSkip::NoHost)
    } else if i.resources.is_empty() {
        Err(HealSkip::NoResources)
    } else {
        Ok(i.resources.to_map())
    }
}

/// The migration of `instance` still holding a source allocation: (the migration's
/// consumer id, which is its operation, the source provider, the resources held there).
/// `providers`: every provider; `lookup`: the migrations' operations
/// ([`migration_consumers`] names them).
pub fn migration_source<'a, 'p>(
    providers: impl IntoIterator<Item = &'p ProviderState>,
    lookup: impl Fn(&AggregateId) -> Option<&'a Entity>,
    instance: Uuid,
) -> Option<(Uuid, Uuid, BTreeMap<String, u64>)> {
    let mut found: Vec<(Uuid, Uuid, BTreeMap<String, u64>)> = providers
        .into_iter()
        .flat_map(|p| {
            p.allocations
                .iter()
                .filter(|(_, a)| a.consumer_kind == ConsumerKind::Migration)
                .map(move |(consumer, a)| (*consumer, p.header.id.id, a.resources.to_map()))
        })
        .filter(|(consumer, _, _)| {
            matches!(
                lookup(&AggregateId::operation(*consumer)),
                Some(Entity::Operation(op)) if op.target == Some(AggregateId::instance(instance))
            )
        })
        .collect();
    found.sort_by_key(|(consumer, provider, _)| (*consumer, *provider));
    found.into_iter().next()
}

/// The operations of the migrations holding allocations on `providers`: what
/// [`migration_source`] looks up.
pub fn migration_consumers<'p>(
    providers: impl IntoIterator<Item = &'p ProviderState>,
) -> BTreeSet<AggregateId> {
    providers
        .into_iter()
        .flat_map(|p| p.allocations.iter())
        .filter(|(_, a)| a.consumer_kind == ConsumerKind::Migration)
        .map(|(consumer, _)| AggregateId::operation(*consumer))
        .collect()
}
