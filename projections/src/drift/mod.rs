//! Drift: what the ledger says the executors hold, against what they answer they hold
//! (their inventory, `docs/drift.md`). Pure: the ledger side is derived from folded
//! operations ([`recorded_resources`]), the executor side is handed in as inventory items,
//! and [`compare`] returns the findings. Nothing here reads a log or asks an executor.
//!
//! The join key is the idempotency key: the client records it before asking an executor
//! to act (`step_started`) and in the done step's compensation (`args.idempotency_key`),
//! and an executor keeps what it made under it. A resource on either side without a key
//! (a step recorded without intent by an outside service, a record made by hand) is joined
//! by its name in the executor's terms (the effect's `resource`).

use std::collections::BTreeMap;

use provledger_events::catalogue::CompensationAction;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

mod fold;
mod ledger;
mod text;

pub use fold::{DriftFold, Folded, Refolded};
pub use ledger::{
    recorded_resources, LedgerResources, Names, OperationResources, RecordedResource,
};
pub use text::Text;

use ledger::{AtExecutor, GoneResource};

/// The executor name of effects the ledger itself holds (allocations): `audit` checks
/// those, drift never asks anyone about them.
pub const LEDGER_EXECUTOR: &str = "ledger";

/// One resource an executor holds, as its inventory answers it (`docs/drift.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct InventoryItem {
    /// The executor's own word for what it is (`ip`, `vm`, `dns_record`): for people.
    pub kind: String,
    /// The resource in the executor's terms, unique within the executor; what the
    /// ledger records as the effect's (and the compensation's) `resource`.
    pub resource: String,
    /// The idempotency key it was made under, if any.
    #[serde(default)]
    pub key: Option<String>,
    /// The entity it belongs to (an instance's or node's UUID), if the executor knows.
    #[serde(default)]
    pub entity: Option<String>,
    /// Attributes the ledger may also record in the effect's `detail` (`node`, `ip`).
    #[serde(default)]
    pub attrs: BTreeMap<String, String>,
    /// The compensation action that removes it at this executor (`release_ip`), as its
    /// compensation protocol takes it: what `drift --fix leaked` asks for. Without it a
    /// leaked item is reported, never removed by drift.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undo: Option<CompensationAction>,
}

/// How sure the ledger is that a resource exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Standing {
    /// Recorded as existing, nothing undoes it now: its absence is `missing`.
    Recorded,
    /// Its operation (or another on the same target or entity) is in flight, or the step's
    /// outcome was never learnt: it may or may not exist, so neither its absence nor its
    /// presence is a finding.
    Uncertain,
}

/// The three kinds of finding.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// Held by the executor, unknown to the ledger or already undone in it.
    Leaked,
    /// Recorded as existing, not held by the executor.
    Missing,
    /// Both know it, with different attributes.
    Mismatched,
}

impl FindingKind {
    pub const ALL: [FindingKind; 3] = [
        FindingKind::Leaked,
        FindingKind::Missing,
        FindingKind::Mismatched,
    ];

    /// Its JSON word.
    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::Leaked => "leaked",
            FindingKind::Missing => "missing",
            FindingKind::Mismatched => "mismatched",
        }
    }
}

/// One attribute both sides name, with different values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Difference {
    pub attr: String,
    pub ledger: String,
    pub executor: String,
}

/// One finding: what, where, which operation and step made it (when known), why, and
/// what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Finding {
    pub kind: FindingKind,
    pub executor: String,
    /// The resource in the executor's terms (the ledger's name for `missing`).
    pub resource: String,
    pub key: Option<String>,
    pub entity: Option<String>,
    pub operation_id: Option<Uuid>,
    pub step: Option<String>,
    /// For `mismatched`: each attribute (`resource` included) whose values differ.
    pub differences: Vec<Difference>,
    pub reason: String,
    pub action: String,
    /// For `leaked`: the action the executor named to remove it (its inventory's `undo`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub undo: Option<CompensationAction>,
}

/// Compares what the ledger says `executor` holds with what it answered it holds.
/// Findings come sorted by kind, then resource.
pub fn compare(ledger: &LedgerResources, executor: &str, held: &[InventoryItem]) -> Vec<Finding> {
    let mut comparison = Comparison::new(ledger, executor);
    let mut findings = comparison.items(held);
    findings.extend(comparison.finish());
    findings.sort_by(|a, b| (a.kind, &a.resource).cmp(&(b.kind, &b.resource)));
    findings
}

/// One executor's comparison, fed its inventory a page at a time, so that a reader never
/// holds more of an inventory than a page: `items` reports what each page holds that the
/// ledger does not (`leaked`) or holds otherwise (`mismatched`); `finish` reports what no
/// page held (`missing`). Memory: one flag per record ever made at the executor (removed
/// ones included); the ledger's side brings its own indexes.
pub struct Comparison<'a> {
    executor: &'a str,
    at: Option<&'a AtExecutor>,
    seen: Vec<bool>,
}

impl<'a> Comparison<'a> {
    pub fn new(ledger: &'a LedgerResources, executor: &'a str) -> Self {
        let at = ledger.at(executor);
        Comparison {
            executor,
            at,
            seen: vec![false; at.map_or(0, |a| a.slots.len())],
        }
    }

    /// The record an item joins: by key (the newest recorded under it), else by name (the
    /// oldest record the ledger made without a key, or any record when the executor keeps
    /// no keys), else by name under another key: a resource the ledger holds at this
    /// executor is the ledger's whatever key the executor now files it under (the key then
    /// shows as a difference), never a leak that `drift --fix leaked` would remove.
    fn joined(&self, key: Option<&str>, resource: &str) -> Option<usize> {
        let at = self.at?;
        let keyed = key.and_then(|k| at.with_key(k).max());
        keyed
            .or_else(|| {
                at.named(resource)
                    .filter(|&i| key.is_none() || at.slots[i].record.key.is_none())
                    .min()
            })
            .or_else(|| at.named(resource).filter(|&i| at.slots[i].is_held()).min())
    }

    /// The findings of one page of the executor's inventory.
    pub fn items(&mut self, held: &[InventoryItem]) -> Vec<Finding> {
        let mut findings = Vec::new();
        for item in held {
            match (self.at, self.joined(item.key.as_deref(), &item.resource)) {
                (Some(at), Some(i)) => {
                    self.seen[i] = true;
                    let slot = &at.slots[i];
                    let differences = differences(&slot.record, item);
                    if !differences.is_empty() && slot.standing == Standing::Recorded {
                        findings.push(mismatched(self.executor, &slot.record, item, differences));
                    }
                }
                _ => findings.push(leaked(self.executor, item, self.at)),
            }
        }
        findings
    }

    /// What the ledger records as existing and no page held: `missing`.
    pub fn finish(self) -> Vec<Finding> {
        let Some(at) = self.at else {
            return Vec::new();
        };
        at.slots
            .iter()
            .zip(&self.seen)
            .filter(|(s, seen)| !**seen && s.is_held() && s.standing == Standing::Recorded)
            .map(|(s, _)| missing(self.executor, &s.record))
            .collect()
    }

    /// Whether a `missing` finding made against an earlier ledger still stands here: the
    /// resource is still recorded as existing (nothing removed or undid it since, and no
    /// operation is moving it).
    pub fn still_missing(&self, finding: &Finding) -> bool {
        let Some(at) = self.at else {
            return false;
        };
        self.joined(finding.key.as_deref(), &finding.resource)
            .is_some_and(|i| at.slots[i].standing == Standing::Recorded)
    }
}

fn differences(r: &RecordedResource, item: &InventoryItem) -> Vec<Difference> {
    let mut out = Vec::new();
    if let (Some(ours), Some(theirs)) = (&r.key, &item.key) {
        if !ours.is(theirs) {
            out.push(Difference {
                attr: "key".into(),
                ledger: ours.to_string(),
                executor: theirs.clone(),
            });
        }
    }
    if !r.resource.is_empty() && !r.resource.is(&item.resource) {
        out.push(Difference {
            attr: "resource".into(),
            ledger: r.resource.to_string(),
            executor: item.resource.clone(),
        });
    }
    for (attr, theirs) in &item.attrs {
        if let Some((_, ours)) = r.attrs.iter().find(|(name, _)| **name == **attr) {
            if !ours.is(theirs) {
                out.push(Difference {
                    attr: attr.clone(),
                    ledger: ours.to_string(),
                    executor: theirs.clone(),
                });
            }
        }
    }
    out
}

fn leaked(executor: &str, item: &InventoryItem, at: Option<&AtExecutor>) -> Finding {
    let undone: Option<&GoneResource> =
        at.and_then(|at| at.gone_as(item.key.as_deref(), &item.resource));
    let (operation_id, step, reason, action) = match undone {
        Some(g) => (
            Some(g.record.operation_id),
            Some(g.record.step.to_string()),
            format!(
                "{executor} still holds {} although the ledger records it undone ({})",
                item.resource,
                g.by()
            ),
            format!(
                "the undo did not take effect at {executor}: check that nothing uses {}, \
                 then remove it at {executor}",
                item.resource
            ),
        ),
        None => (
            None,
            None,
            format!(
                "{executor} holds {} and no operation in the ledger created it{}",
                item.resource,
                item.key
                    .as_ref()
                    .map(|k| format!(" (its key {k} is unknown)"))
                    .unwrap_or_default()
            ),
            format!(
                "made behind the ledger's back: check that nothing uses {}, then remove it \
                 at {executor}, or record it as a discovered effect if it is to stay",
                item.resource
            ),
        ),
    };
    Finding {
        kind: FindingKind::Leaked,
        executor: executor.to_string(),
        resource: item.resource.clone(),
        key: item.key.clone(),
        entity: item.entity.clone(),
        operation_id,
        step,
        differences: Vec::new(),
        reason,
        action,
        undo: item.undo.clone(),
    }
}

fn missing(executor: &str, r: &RecordedResource) -> Finding {
    Finding {
        kind: FindingKind::Missing,
        executor: executor.to_string(),
        resource: r.resource.to_string(),
        key: r.key.as_ref().map(Text::to_string),
        entity: r.entity.as_ref().map(Text::to_string),
        operation_id: Some(r.operation_id),
        step: Some(r.step.to_string()),
        differences: Vec::new(),
        reason: format!(
            "the ledger records {} at {executor} (step {} of operation {}) and {executor} \
             does not hold it",
            r.resource, r.step, r.operation_id
        ),
        action: format!(
            "drift writes nothing: if {} was removed on purpose, record its removal for \
             the entity; otherwise re-create it (re-drive the entity's operation)",
            r.resource
        ),
        undo: None,
    }
}

fn mismatched(
    executor: &str,
    r: &RecordedResource,
    item: &InventoryItem,
    differences: Vec<Difference>,
) -> Finding {
    let listed: Vec<String> = differences
        .iter()
        .map(|d| {
            format!(
                "{} {} in the ledger, {} at {executor}",
                d.attr, d.ledger, d.executor
            )
        })
        .collect();
    Finding {
        kind: FindingKind::Mismatched,
        executor: executor.to_string(),
        resource: item.resource.clone(),
        key: item
            .key
            .clone()
            .or_else(|| r.key.as_ref().map(Text::to_string)),
        entity: r
            .entity
            .as_ref()
            .map(Text::to_string)
            .or_else(|| item.entity.clone()),
        operation_id: Some(r.operation_id),
        step: Some(r.step.to_string()),
        reason: format!(
            "step {} of operation {} and {executor} disagree: {}",
            r.step,
            r.operation_id,
            listed.join("; ")
        ),
        action: format!(
            "decide which is right: correct it at {executor}, or record the change for the \
             entity; an undo by the ledger would ask for {}",
            if r.resource.is_empty() {
                item.resource.clone()
            } else {
                r.resource.to_string()
            }
        ),
        differences,
        undo: None,
    }
}
