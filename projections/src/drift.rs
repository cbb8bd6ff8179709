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

use std::collections::{BTreeMap, BTreeSet};

use provledger_events::catalogue::{
    Compensation, CompensationAction, DetailKey, EffectKind, Executor, Origin, PlannedCompensation,
};
use provledger_events::AggregateId;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::operation::{CompensationProgress, OperationState};
use crate::planner::{NODE_DETAIL, REMOVAL_DETAIL, RESOURCE_REMOVED_EFFECT};

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

/// One resource as the ledger knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedResource {
    pub executor: String,
    /// `""` for a step whose outcome is unknown and whose executor chose the name.
    pub resource: String,
    pub key: Option<String>,
    pub entity: Option<String>,
    pub operation_id: Uuid,
    pub step: String,
    /// The effect's `detail` (without the removal list), sorted by name. A sorted `Vec`,
    /// not a map: most effects carry one or two details, and a map's smallest node holds
    /// room for eleven, which at a million resources is half a gigabyte of nothing.
    pub attrs: Vec<(String, String)>,
    pub standing: Standing,
}

/// A resource the ledger once recorded and no longer counts as existing, kept to explain
/// a `leaked` finding ("already compensated").
#[derive(Debug, Clone, PartialEq, Eq)]
struct GoneResource {
    resource: String,
    key: Option<String>,
    operation_id: Uuid,
    step: String,
    /// What made it gone: a compensation (`compensation <id> of operation <op>`) or a
    /// forward removal (`step <name> of operation <op>`).
    by: String,
}

/// Everything the ledger says the executors hold, by executor.
#[derive(Debug, Default, Clone)]
pub struct LedgerResources {
    live: BTreeMap<String, Vec<RecordedResource>>,
    gone: BTreeMap<String, Vec<GoneResource>>,
}

impl LedgerResources {
    /// The executors the ledger records anything at (created or removed).
    pub fn executors(&self) -> BTreeSet<String> {
        self.live.keys().chain(self.gone.keys()).cloned().collect()
    }

    /// The resources recorded at `executor` (existing or uncertain).
    pub fn at(&self, executor: &str) -> &[RecordedResource] {
        self.live.get(executor).map(Vec::as_slice).unwrap_or(&[])
    }

    fn add(&mut self, r: RecordedResource) {
        self.live.entry(r.executor.clone()).or_default().push(r);
    }

    /// Takes away what `undo` names at `executor`: by key when it has one, else by
    /// resource (and entity, when both sides name one: a reused IP belongs to another
    /// node).
    fn remove(&mut self, executor: &str, undo: &Undo<'_>, by: String) {
        let Some(live) = self.live.get_mut(executor) else {
            return;
        };
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(live)
            .into_iter()
            .partition(|r| undo.names(r));
        *live = kept;
        let gone_here = self.gone.entry(executor.to_string()).or_default();
        for r in gone {
            gone_here.push(GoneResource {
                resource: r.resource,
                key: r.key,
                operation_id: r.operation_id,
                step: r.step,
                by: by.clone(),
            });
        }
    }
}

/// What a removal or a compensation names.
struct Undo<'a> {
    key: Option<&'a str>,
    resource: &'a str,
    entity: Option<&'a str>,
}

impl Undo<'_> {
    fn names(&self, r: &RecordedResource) -> bool {
        if let (Some(key), Some(theirs)) = (self.key, r.key.as_deref()) {
            return key == theirs;
        }
        let same_entity = match (self.entity, r.entity.as_deref()) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        !self.resource.is_empty() && self.resource == r.resource && same_entity
    }
}

fn key_of(c: &Compensation) -> Option<String> {
    c.args.get(DetailKey::IdempotencyKey.as_str()).cloned()
}

fn service_of(c: &Compensation) -> Option<&str> {
    match &c.executor {
        Executor::Service(name) => Some(name),
        Executor::Ledger => None,
    }
}

/// The entity a step's resource belongs to: the node named in its detail, else the
/// resource itself when it is an id (a VM, a plugin's node).
fn entity_of(resource: &str, detail: &BTreeMap<String, String>) -> Option<String> {
    detail
        .get(NODE_DETAIL)
        .cloned()
        .or_else(|| Uuid::parse_str(resource).ok().map(|u| u.to_string()))
}

fn is_removal(kind: &EffectKind) -> bool {
    *kind == EffectKind::NodeTerminated
        || *kind == EffectKind::Custom(RESOURCE_REMOVED_EFFECT.into())
}

/// The ledger's side of drift: every resource at an executor that an effect recorded and
/// nothing has undone since (a compensation done, a forward removal), from the folded
/// operations. Operations are taken in id order (UUID v7: start order), each one's steps
/// in order, then its compensations done.
///
/// What counts as held: a step's effect at a service (not `ledger`) that declares a
/// compensation, or that was `discovered`. A step started and never settled
/// (`step_started` without `step_done`) is `Uncertain` under its key. So is everything of
/// an operation that is not closed, and everything of a target or entity such an
/// operation works on: its resources are moving while drift looks.
pub fn recorded_resources<'a>(
    operations: impl IntoIterator<Item = &'a OperationState>,
) -> LedgerResources {
    let mut ops: Vec<&OperationState> = operations.into_iter().collect();
    ops.sort_by_key(|op| op.header.id.id);
    let (in_flight_targets, in_flight_entities) = in_flight(&ops);
    let mut ledger = LedgerResources::default();
    for op in ops {
        let id = op.header.id.id;
        let moving = !op.is_closed() || op.target.is_some_and(|t| in_flight_targets.contains(&t));
        for step in &op.steps {
            let effect = &step.effect;
            if effect.executor == LEDGER_EXECUTOR {
                continue;
            }
            let entity = entity_of(&effect.resource, &effect.detail);
            if is_removal(&effect.kind) {
                let undo = Undo {
                    key: None,
                    resource: &effect.resource,
                    entity: entity.as_deref(),
                };
                let by = format!("step {} of operation {id}", step.name);
                ledger.remove(&effect.executor, &undo, by);
                continue;
            }
            let holds = step.compensation.is_some() || effect.origin == Origin::Discovered;
            if !holds {
                continue;
            }
            let mut attrs: Vec<(String, String)> = effect
                .detail
                .iter()
                .filter(|(k, _)| k.as_str() != REMOVAL_DETAIL)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            attrs.shrink_to_fit();
            let uncertain = moving
                || entity
                    .as_ref()
                    .is_some_and(|e| in_flight_entities.contains(e));
            ledger.add(RecordedResource {
                executor: effect.executor.clone(),
                resource: effect.resource.clone(),
                key: step.compensation.as_ref().and_then(key_of),
                entity,
                operation_id: id,
                step: step.name.clone(),
                attrs,
                standing: if uncertain {
                    Standing::Uncertain
                } else {
                    Standing::Recorded
                },
            });
        }
        for started in &op.started {
            let compensation = started.compensation.as_ref();
            let resource = compensation.map(|c| c.resource.clone()).unwrap_or_default();
            ledger.add(RecordedResource {
                executor: started.executor.clone(),
                entity: entity_of(&resource, &BTreeMap::new()),
                resource,
                key: Some(started.idempotency_key.clone()),
                operation_id: id,
                step: started.name.clone(),
                attrs: Vec::new(),
                standing: Standing::Uncertain,
            });
        }
        for c in op
            .compensations
            .iter()
            .filter(|c| c.progress == CompensationProgress::Done)
        {
            remove_compensated(&mut ledger, id, &c.planned);
        }
    }
    ledger
}

fn remove_compensated(ledger: &mut LedgerResources, op: Uuid, planned: &PlannedCompensation) {
    let c = &planned.compensation;
    let Some(executor) = service_of(c) else {
        return;
    };
    let key = key_of(c);
    let undo = Undo {
        key: key.as_deref(),
        resource: &c.resource,
        entity: None,
    };
    let by = format!("compensation {} of operation {op}", planned.compensation_id);
    ledger.remove(executor, &undo, by);
}

/// The targets of the operations in flight, and the entities their steps name.
fn in_flight(ops: &[&OperationState]) -> (BTreeSet<AggregateId>, BTreeSet<String>) {
    let mut targets = BTreeSet::new();
    let mut entities = BTreeSet::new();
    for op in ops.iter().filter(|op| !op.is_closed()) {
        if let Some(t) = op.target {
            targets.insert(t);
            entities.insert(t.id.to_string());
        }
        for step in &op.steps {
            entities.extend(entity_of(&step.effect.resource, &step.effect.detail));
        }
        for started in &op.started {
            if let Some(c) = &started.compensation {
                entities.extend(entity_of(&c.resource, &BTreeMap::new()));
            }
        }
    }
    (targets, entities)
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
/// page held (`missing`). Memory: the ledger's side and one flag per recorded resource.
pub struct Comparison<'a> {
    executor: &'a str,
    recorded: &'a [RecordedResource],
    gone: &'a [GoneResource],
    by_key: BTreeMap<&'a str, usize>,
    by_resource: BTreeMap<&'a str, Vec<usize>>,
    seen: Vec<bool>,
}

impl<'a> Comparison<'a> {
    pub fn new(ledger: &'a LedgerResources, executor: &'a str) -> Self {
        let recorded = ledger.at(executor);
        let gone = ledger.gone.get(executor).map(Vec::as_slice).unwrap_or(&[]);
        let by_key: BTreeMap<&str, usize> = recorded
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.key.as_deref().map(|k| (k, i)))
            .collect();
        let mut by_resource: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, r) in recorded.iter().enumerate() {
            if !r.resource.is_empty() {
                by_resource.entry(&r.resource).or_default().push(i);
            }
        }
        Comparison {
            executor,
            recorded,
            gone,
            by_key,
            by_resource,
            seen: vec![false; recorded.len()],
        }
    }

    /// The record an item joins: by key, else by name (to a record the ledger made
    /// without a key, or to any record when the executor keeps no keys).
    fn joined(&self, key: Option<&str>, resource: &str) -> Option<usize> {
        let keyed = key.and_then(|k| self.by_key.get(k).copied());
        keyed.or_else(|| {
            self.by_resource.get(resource).and_then(|ids| {
                ids.iter()
                    .copied()
                    .find(|&i| key.is_none() || self.recorded[i].key.is_none())
            })
        })
    }

    /// The findings of one page of the executor's inventory.
    pub fn items(&mut self, held: &[InventoryItem]) -> Vec<Finding> {
        let mut findings = Vec::new();
        for item in held {
            match self.joined(item.key.as_deref(), &item.resource) {
                Some(i) => {
                    self.seen[i] = true;
                    let r = &self.recorded[i];
                    let differences = differences(r, item);
                    if !differences.is_empty() && r.standing == Standing::Recorded {
                        findings.push(mismatched(self.executor, r, item, differences));
                    }
                }
                None => findings.push(leaked(self.executor, item, self.gone)),
            }
        }
        findings
    }

    /// What the ledger records as existing and no page held: `missing`.
    pub fn finish(self) -> Vec<Finding> {
        self.recorded
            .iter()
            .zip(&self.seen)
            .filter(|(r, seen)| !**seen && r.standing == Standing::Recorded)
            .map(|(r, _)| missing(self.executor, r))
            .collect()
    }

    /// Whether a `missing` finding made against an earlier ledger still stands here: the
    /// resource is still recorded as existing (nothing removed or undid it since, and no
    /// operation is moving it).
    pub fn still_missing(&self, finding: &Finding) -> bool {
        self.joined(finding.key.as_deref(), &finding.resource)
            .is_some_and(|i| self.recorded[i].standing == Standing::Recorded)
    }
}

fn differences(r: &RecordedResource, item: &InventoryItem) -> Vec<Difference> {
    let mut out = Vec::new();
    if !r.resource.is_empty() && r.resource != item.resource {
        out.push(Difference {
            attr: "resource".into(),
            ledger: r.resource.clone(),
            executor: item.resource.clone(),
        });
    }
    for (attr, theirs) in &item.attrs {
        if let Some((_, ours)) = r.attrs.iter().find(|(name, _)| name == attr) {
            if ours != theirs {
                out.push(Difference {
                    attr: attr.clone(),
                    ledger: ours.clone(),
                    executor: theirs.clone(),
                });
            }
        }
    }
    out
}

fn leaked(executor: &str, item: &InventoryItem, gone: &[GoneResource]) -> Finding {
    let undone = gone.iter().rev().find(|g| match (&item.key, &g.key) {
        (Some(a), Some(b)) => a == b,
        _ => g.resource == item.resource,
    });
    let (operation_id, step, reason, action) = match undone {
        Some(g) => (
            Some(g.operation_id),
            Some(g.step.clone()),
            format!(
                "{executor} still holds {} although the ledger records it undone ({})",
                item.resource, g.by
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
        resource: r.resource.clone(),
        key: r.key.clone(),
        entity: r.entity.clone(),
        operation_id: Some(r.operation_id),
        step: Some(r.step.clone()),
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
        key: item.key.clone().or_else(|| r.key.clone()),
        entity: r.entity.clone().or_else(|| item.entity.clone()),
        operation_id: Some(r.operation_id),
        step: Some(r.step.clone()),
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
                item.resource.as_str()
            } else {
                r.resource.as_str()
            }
        ),
        differences,
        undo: None,
    }
}
