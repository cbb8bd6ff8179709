//! The resource-provider projection (Placement): inventories, allocations by consumer,
//! and usage against capacity, where capacity is `(total - reserved) * allocation_ratio`.

use std::collections::BTreeMap;

use provledger_events::catalogue::{BlockingAllocation, ConsumerKind, Inventory};
use provledger_events::{AggregateId, Event};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::entity::{json_or_null, not_created, EventContext, Folded, Header};
use crate::resource_map::ResourceMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ProviderStatus {
    Active,
    Deleting,
    Deleted,
}

/// Why one resource class of a claim does not fit. The snake_case names are stable: they
/// are the `reason` of a refused claim at the NATS boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClaimReason {
    NoInventory,
    BelowMinUnit,
    AboveMaxUnit,
    StepSize,
    OverCapacity,
}

impl ClaimReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimReason::NoInventory => "no_inventory",
            ClaimReason::BelowMinUnit => "below_min_unit",
            ClaimReason::AboveMaxUnit => "above_max_unit",
            ClaimReason::StepSize => "step_size",
            ClaimReason::OverCapacity => "over_capacity",
        }
    }
}

/// One resource class of a claim that does not fit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ClassRefusal {
    pub resource_class: String,
    pub requested: u64,
    pub reason: ClaimReason,
    pub detail: String,
}

/// A claim that does not fit, with every class that does not, in class order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{}", self.classes.iter().map(|c| c.detail.as_str()).collect::<Vec<_>>().join("; "))]
pub struct ClaimRefusal {
    pub classes: Vec<ClassRefusal>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub consumer_kind: ConsumerKind,
    pub resources: ResourceMap,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderState {
    pub header: Header,
    pub name: String,
    pub host: String,
    pub status: Option<ProviderStatus>,
    pub inventories: BTreeMap<String, Inventory>,
    /// Kept in step with `allocations` so a claim check does not sum every allocation.
    pub usage: BTreeMap<String, u64>,
    /// Every consumer's allocation, in id order. A persistent map: the state is cloned for
    /// each write's trial fold (`crate::decide`), and a shared provider (an address pool,
    /// shared storage) holds an allocation of every instance; a `BTreeMap` made each claim
    /// on a provider of 100,000 allocations copy them all (18 ms, docs/benchmarks.md). It
    /// encodes as the `BTreeMap` did (a serde map in key order): stored states keep their
    /// bytes.
    #[serde(deserialize_with = "allocations_as_read")]
    pub allocations: imbl::OrdMap<Uuid, Allocation>,
    pub last_delete_refusal: Option<Vec<BlockingAllocation>>,
    /// The delete being carried out releases every allocation (`--cascade`): whoever finds
    /// it half done (a crash between two of its commits) finishes it.
    pub deleting_cascade: bool,
}

/// Reads allocations through a `BTreeMap`, which allocates as entries arrive: imbl's own
/// reader reserves room for as many entries as the bytes claim, so a damaged length in a
/// stored state or a snapshot would abort the process where it must be refused as corrupt.
fn allocations_as_read<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<imbl::OrdMap<Uuid, Allocation>, D::Error> {
    BTreeMap::<Uuid, Allocation>::deserialize(d).map(|m| m.into_iter().collect())
}

impl ProviderState {
    pub fn new(id: AggregateId) -> Self {
        ProviderState {
            header: Header::new(id),
            name: String::new(),
            host: String::new(),
            status: None,
            inventories: BTreeMap::new(),
            usage: BTreeMap::new(),
            allocations: imbl::OrdMap::new(),
            last_delete_refusal: None,
            deleting_cascade: false,
        }
    }

    /// Resource classes whose usage exceeds capacity (after an inventory shrank).
    pub fn over_capacity(&self) -> Vec<String> {
        self.usage
            .iter()
            .filter(|(rc, used)| {
                self.inventories
                    .get(*rc)
                    .is_none_or(|inv| **used > inv.capacity())
                    && **used > 0
            })
            .map(|(rc, _)| rc.clone())
            .collect()
    }

    /// Whether a claim fits, Placement's way: every class inventoried, within
    /// min_unit..=max_unit, a multiple of step_size, and within capacity once the
    /// consumer's previous allocation (which the claim replaces) is given back. A claim is
    /// all or nothing: every class that does not fit is named, with its reason.
    pub fn check_claim(
        &self,
        consumer: &Uuid,
        resources: &BTreeMap<String, u64>,
    ) -> Result<(), ClaimRefusal> {
        let previous = self.allocations.get(consumer);
        let mut classes = Vec::new();
        for (rc, amount) in resources {
            let refuse = |reason: ClaimReason, detail: String| ClassRefusal {
                resource_class: rc.clone(),
                requested: *amount,
                reason,
                detail,
            };
            let Some(inv) = self.inventories.get(rc) else {
                classes.push(refuse(
                    ClaimReason::NoInventory,
                    format!("no {rc} inventory"),
                ));
                continue;
            };
            if *amount < inv.min_unit {
                classes.push(refuse(
                    ClaimReason::BelowMinUnit,
                    format!("{rc} {amount} is below min_unit {}", inv.min_unit),
                ));
                continue;
            }
            if *amount > inv.max_unit {
                classes.push(refuse(
                    ClaimReason::AboveMaxUnit,
                    format!("{rc} {amount} is above max_unit {}", inv.max_unit),
                ));
                continue;
            }
            if inv.step_size > 1 && amount % inv.step_size != 0 {
                classes.push(refuse(
                    ClaimReason::StepSize,
                    format!(
                        "{rc} {amount} is not a multiple of step_size {}",
                        inv.step_size
                    ),
                ));
                continue;
            }
            let used = self.usage.get(rc).copied().unwrap_or(0);
            let given_back = previous
                .and_then(|p| p.resources.get(rc))
                .copied()
                .unwrap_or(0);
            let after = used.saturating_sub(given_back).saturating_add(*amount);
            if after > inv.capacity() {
                classes.push(refuse(
                    ClaimReason::OverCapacity,
                    format!("{rc} over capacity: {after} > {}", inv.capacity()),
                ));
            }
        }
        if classes.is_empty() {
            Ok(())
        } else {
            Err(ClaimRefusal { classes })
        }
    }

    fn remove_allocation(&mut self, consumer: &Uuid) -> Option<Allocation> {
        let removed = self.allocations.remove(consumer)?;
        for (rc, amount) in &removed.resources {
            if let Some(used) = self.usage.get_mut(rc) {
                *used = used.saturating_sub(*amount);
                if *used == 0 {
                    self.usage.remove(rc);
                }
            }
        }
        Some(removed)
    }

    /// Folds one event into this provider's state, and says whether it was applied.
    pub(crate) fn apply_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        if let Event::ProviderRegistered { name, host } = event {
            if self.status.is_some() {
                return Folded::Refused(
                    "the provider is already registered; event not applied".into(),
                );
            }
            self.name = name.clone();
            self.host = host.clone();
            self.status = Some(ProviderStatus::Active);
            self.header.created_at = Some(ctx.recorded_at);
            return Folded::Applied;
        }
        let Some(status) = self.status else {
            return not_created("provider");
        };
        if status == ProviderStatus::Deleted {
            return Folded::Refused("the provider is deleted; event not applied".into());
        }
        match event {
            Event::InventorySet {
                resource_class,
                inventory,
            } => self.set_inventory(resource_class, inventory),
            Event::InventoryRemoved { resource_class } => {
                let used = self.usage.get(resource_class).copied().unwrap_or(0);
                if used > 0 {
                    return Folded::Refused(format!(
                        "{resource_class} inventory removed while {used} is allocated; not applied"
                    ));
                }
                if self.inventories.remove(resource_class).is_none() {
                    return Folded::Refused(format!("no {resource_class} inventory to remove"));
                }
                Folded::Applied
            }
            Event::AllocationClaimed {
                consumer,
                consumer_kind,
                resources,
            } => self.claim(status, consumer, *consumer_kind, resources),
            Event::AllocationReleased { consumer, .. } => {
                if self.remove_allocation(consumer).is_none() {
                    return Folded::Refused(format!(
                        "consumer {consumer} holds no allocation here"
                    ));
                }
                Folded::Applied
            }
            Event::ProviderDeleteRequested { cascade, .. } => {
                self.status = Some(ProviderStatus::Deleting);
                self.deleting_cascade |= *cascade;
                Folded::Applied
            }
            Event::ProviderDeleteRefused { blocking } => {
                self.status = Some(ProviderStatus::Active);
                self.deleting_cascade = false;
                self.last_delete_refusal = Some(blocking.clone());
                Folded::Applied
            }
            Event::ProviderDeleted {} => {
                // Never orphan an allocation: a provider goes only once it holds none.
                if !self.allocations.is_empty() {
                    return Folded::Refused(format!(
                        "deleted while {} allocation(s) remain; not applied",
                        self.allocations.len()
                    ));
                }
                self.status = Some(ProviderStatus::Deleted);
                Folded::Applied
            }
            other => Folded::Refused(format!("{} is not a provider event", other.name())),
        }
    }

    /// `InventorySet`. Inventory is a fact about the hardware, so it is applied even when
    /// it leaves usage above capacity; the anomaly (and `audit`) say so. Setting the very
    /// inventory already held changes nothing, so its anomaly is then a refusal.
    fn set_inventory(&mut self, resource_class: &str, inventory: &Inventory) -> Folded {
        let previous = self
            .inventories
            .insert(resource_class.to_string(), *inventory);
        let changed = previous != Some(*inventory);
        let used = self.usage.get(resource_class).copied().unwrap_or(0);
        if inventory.min_unit > inventory.max_unit || inventory.step_size == 0 {
            return Folded::anomaly_or_refused(
                changed,
                format!("{resource_class} inventory has inconsistent units"),
            );
        }
        if used > inventory.capacity() {
            return Folded::anomaly_or_refused(
                changed,
                format!(
                    "{resource_class} capacity {} is below usage {used}",
                    inventory.capacity()
                ),
            );
        }
        Folded::Applied
    }

    /// `AllocationClaimed`: all or nothing (see [`Self::check_claim`]), replacing the
    /// consumer's previous allocation here.
    fn claim(
        &mut self,
        status: ProviderStatus,
        consumer: &Uuid,
        consumer_kind: ConsumerKind,
        resources: &BTreeMap<String, u64>,
    ) -> Folded {
        if status != ProviderStatus::Active {
            return Folded::Refused("claim on a provider being deleted; not applied".into());
        }
        if let Err(refusal) = self.check_claim(consumer, resources) {
            return Folded::Refused(format!("{refusal}; claim not applied"));
        }
        self.remove_allocation(consumer);
        for (rc, amount) in resources {
            *self.usage.entry(rc.clone()).or_insert(0) += amount;
        }
        self.allocations.insert(
            *consumer,
            Allocation {
                consumer_kind,
                resources: ResourceMap::from(resources),
            },
        );
        Folded::Applied
    }

    /// The contract's JSON form of a provider.
    pub fn view(&self) -> serde_json::Value {
        json_or_null(&crate::view::ProviderView::of(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_encode_as_the_ordered_map_they_replaced() {
        // Given the same allocations in the persistent map and in a BTreeMap,
        let allocation = |n: u128| Allocation {
            consumer_kind: ConsumerKind::Instance,
            resources: ResourceMap::from(BTreeMap::from([("VCPU".to_string(), n as u64)])),
        };
        let ids = [9u128, 3, 7, 1];
        let persistent: imbl::OrdMap<Uuid, Allocation> = ids
            .iter()
            .map(|&n| (Uuid::from_u128(n), allocation(n)))
            .collect();
        let ordered: BTreeMap<Uuid, Allocation> = ids
            .iter()
            .map(|&n| (Uuid::from_u128(n), allocation(n)))
            .collect();
        // when both are encoded for the store and as JSON, then the bytes are the same,
        // so a state stored before the change reads back, and one stored after reads the same.
        let config = bincode::config::standard();
        assert_eq!(
            bincode::serde::encode_to_vec(&persistent, config).expect("bincode"),
            bincode::serde::encode_to_vec(&ordered, config).expect("bincode")
        );
        assert_eq!(
            serde_json::to_string(&persistent).expect("json"),
            serde_json::to_string(&ordered).expect("json")
        );
        let (decoded, _): (imbl::OrdMap<Uuid, Allocation>, usize) =
            bincode::serde::decode_from_slice(
                &bincode::serde::encode_to_vec(&ordered, config).expect("bincode"),
                config,
            )
            .expect("decode");
        assert_eq!(decoded, persistent);
    }

    #[test]
    fn allocations_whose_stored_length_is_damaged_are_refused_not_reserved() {
        // Given stored allocations whose length says u64::MAX entries (bincode's varint:
        // 0xFD, then 8 bytes) and holds none,
        #[derive(Debug, serde::Deserialize)]
        struct Stored(
            #[serde(deserialize_with = "allocations_as_read")]
            #[allow(dead_code)]
            imbl::OrdMap<Uuid, Allocation>,
        );
        let mut bytes = vec![0xFD];
        bytes.extend_from_slice(&u64::MAX.to_le_bytes());
        // when they are read, then the read fails with an error (imbl's own reader would
        // reserve room for that many entries first, and abort).
        let read: Result<(Stored, usize), _> =
            bincode::serde::decode_from_slice(&bytes, bincode::config::standard());
        assert!(read.is_err(), "{read:?}");
    }
}
