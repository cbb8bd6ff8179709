//! The ledger's side of drift, kept small enough for a million resources: each operation
//! reduced to what drift needs of it ([`OperationResources`]: what its steps created and
//! removed, what it started without an outcome, what its compensations undid), and
//! [`LedgerResources`], what those say each executor holds now, indexed by key and by name.
//!
//! Memory is what it must be and no more: one shared record per resource (names interned,
//! UUIDs and short strings inline, see [`Text`]), and per executor a slot and two hash
//! chains per record. Nothing of an operation's state beyond its resources is kept.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use provledger_events::catalogue::{
    Compensation, DetailKey, EffectKind, Executor, Origin, PlannedCompensation,
};
use provledger_events::AggregateId;
use uuid::Uuid;

use super::text::{hash_str, Text};
use super::{Standing, LEDGER_EXECUTOR};
use crate::operation::{CompensationProgress, OperationState};
use crate::planner::{NODE_DETAIL, REMOVAL_DETAIL, RESOURCE_REMOVED_EFFECT};

/// Interned names (executors, steps, attribute names): a handful of distinct strings
/// shared by a million records.
#[derive(Debug, Default)]
pub struct Names(HashSet<Arc<str>>);

impl Names {
    pub fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.0.get(name) {
            return known.clone();
        }
        let new: Arc<str> = name.into();
        self.0.insert(new.clone());
        new
    }
}

/// One resource as the ledger recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedResource {
    pub executor: Arc<str>,
    /// Empty for a step whose outcome is unknown and whose executor chose the name.
    pub resource: Text,
    pub key: Option<Text>,
    pub entity: Option<Text>,
    pub operation_id: Uuid,
    pub step: Arc<str>,
    /// The effect's `detail` (without the removal list), sorted by name.
    pub attrs: Box<[(Arc<str>, Text)]>,
}

/// What undid a resource, for a `leaked` finding's "already compensated".
#[derive(Debug, Clone, PartialEq, Eq)]
enum By {
    /// A forward removal: this step of the removing operation.
    Step(Arc<str>),
    /// This compensation of the removing operation.
    Compensation(Uuid),
}

/// A removal or a compensation done: what it names at an executor.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Removal {
    executor: Arc<str>,
    key: Option<Text>,
    resource: Text,
    entity: Option<Text>,
    by: By,
}

impl Removal {
    /// Whether it names `r`: by key when both have one, else by resource (and entity,
    /// when both name one: a reused IP belongs to another node).
    fn names(&self, r: &RecordedResource) -> bool {
        if let (Some(key), Some(theirs)) = (&self.key, &r.key) {
            return key == theirs;
        }
        let same_entity = match (&self.entity, &r.entity) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        };
        !self.resource.is_empty() && self.resource == r.resource && same_entity
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    /// An effect that holds a resource: recorded as existing unless something moves it.
    Holds(Arc<RecordedResource>),
    /// A step started with an intent and no outcome: it may or may not exist.
    Started(Arc<RecordedResource>),
    Removes(Box<Removal>),
}

/// One operation as drift needs it: its resource actions in the order they apply (its
/// steps, then its steps started without an outcome, then its compensations done), and,
/// while it is not closed, what it is moving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationResources {
    id: Uuid,
    open: bool,
    target: Option<AggregateId>,
    /// While open: the entities its steps name.
    moving_entities: Vec<String>,
    actions: Box<[Action]>,
}

fn key_of(c: &Compensation) -> Option<Text> {
    c.args
        .get(DetailKey::IdempotencyKey.as_str())
        .map(|k| Text::new(k))
}

fn service_of(c: &Compensation) -> Option<&str> {
    match &c.executor {
        Executor::Service(name) => Some(name),
        Executor::Ledger => None,
    }
}

/// The entity a step's resource belongs to: the node named in its detail, else the
/// resource itself when it is an id (a VM, a plugin's node).
pub(super) fn entity_of<'a>(
    resource: &str,
    node: impl FnOnce() -> Option<&'a String>,
) -> Option<String> {
    node()
        .cloned()
        .or_else(|| Uuid::parse_str(resource).ok().map(|u| u.to_string()))
}

fn is_removal(kind: &EffectKind) -> bool {
    *kind == EffectKind::NodeTerminated
        || *kind == EffectKind::Custom(RESOURCE_REMOVED_EFFECT.into())
}

impl OperationResources {
    /// What `op` contributes. What counts as held: a step's effect at a service (not
    /// `ledger`) that declares a compensation, or that was `discovered`. A step started
    /// and never settled is held uncertainly under its key.
    pub fn of(op: &OperationState, names: &mut Names) -> Self {
        let id = op.header.id.id;
        let mut actions = Vec::new();
        for step in &op.steps {
            let effect = &step.effect;
            if effect.executor == LEDGER_EXECUTOR {
                continue;
            }
            let entity = entity_of(&effect.resource, || effect.detail.get(NODE_DETAIL));
            if is_removal(&effect.kind) {
                actions.push(Action::Removes(Box::new(Removal {
                    executor: names.get(&effect.executor),
                    key: None,
                    resource: Text::new(&effect.resource),
                    entity: entity.as_deref().map(Text::new),
                    by: By::Step(names.get(&step.name)),
                })));
                continue;
            }
            if step.compensation.is_none() && effect.origin != Origin::Discovered {
                continue;
            }
            let attrs: Box<[(Arc<str>, Text)]> = effect
                .detail
                .iter()
                .filter(|(k, _)| k.as_str() != REMOVAL_DETAIL)
                .map(|(k, v)| (names.get(k), Text::new(v)))
                .collect();
            actions.push(Action::Holds(Arc::new(RecordedResource {
                executor: names.get(&effect.executor),
                resource: Text::new(&effect.resource),
                key: step.compensation.as_ref().and_then(key_of),
                entity: entity.as_deref().map(Text::new),
                operation_id: id,
                step: names.get(&step.name),
                attrs,
            })));
        }
        for started in &op.started {
            let resource = started
                .compensation
                .as_ref()
                .map(|c| c.resource.as_str())
                .unwrap_or_default();
            actions.push(Action::Started(Arc::new(RecordedResource {
                executor: names.get(&started.executor),
                resource: Text::new(resource),
                key: Some(Text::new(&started.idempotency_key)),
                entity: entity_of(resource, || None).as_deref().map(Text::new),
                operation_id: id,
                step: names.get(&started.name),
                attrs: Box::new([]),
            })));
        }
        for c in op
            .compensations
            .iter()
            .filter(|c| c.progress == CompensationProgress::Done)
        {
            if let Some(removal) = compensated(&c.planned, names) {
                actions.push(Action::Removes(Box::new(removal)));
            }
        }
        let open = !op.is_closed();
        OperationResources {
            id,
            open,
            target: op.target,
            moving_entities: if open { moving(op) } else { Vec::new() },
            actions: actions.into_boxed_slice(),
        }
    }
}

fn compensated(planned: &PlannedCompensation, names: &mut Names) -> Option<Removal> {
    let c = &planned.compensation;
    Some(Removal {
        executor: names.get(service_of(c)?),
        key: key_of(c),
        resource: Text::new(&c.resource),
        entity: None,
        by: By::Compensation(planned.compensation_id),
    })
}

/// The entities an operation in flight works on: its target, and what its steps name.
fn moving(op: &OperationState) -> Vec<String> {
    let mut entities = Vec::new();
    if let Some(t) = op.target {
        entities.push(t.id.to_string());
    }
    for step in &op.steps {
        entities.extend(entity_of(&step.effect.resource, || {
            step.effect.detail.get(NODE_DETAIL)
        }));
    }
    for started in &op.started {
        if let Some(c) = &started.compensation {
            entities.extend(entity_of(&c.resource, || None));
        }
    }
    entities
}

/// The end of a hash chain (no slot index reaches it: a `Vec` of slots is shorter than
/// `usize::MAX`, each slot being larger than a byte).
const NONE: usize = usize::MAX;

/// Which of a slot's two chains.
#[derive(Debug, Clone, Copy)]
enum ChainOf {
    Key,
    Resource,
}

/// One recorded resource at an executor, and its links in the two hash chains (by key, by
/// resource) of resources still held.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub(crate) record: Arc<RecordedResource>,
    pub(crate) standing: Standing,
    held: bool,
    next_by_key: usize,
    next_by_resource: usize,
}

/// A resource the ledger once recorded and no longer counts as existing, kept to explain
/// a `leaked` finding.
#[derive(Debug, Clone)]
pub(crate) struct GoneResource {
    pub(crate) record: Arc<RecordedResource>,
    removed_by: Uuid,
    by: By,
}

impl GoneResource {
    /// What made it gone: `compensation <id> of operation <op>` or `step <name> of
    /// operation <op>`.
    pub(crate) fn by(&self) -> impl fmt::Display + '_ {
        struct Show<'a>(&'a GoneResource);
        impl fmt::Display for Show<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let op = self.0.removed_by;
                match &self.0.by {
                    By::Step(step) => write!(f, "step {step} of operation {op}"),
                    By::Compensation(id) => write!(f, "compensation {id} of operation {op}"),
                }
            }
        }
        Show(self)
    }
}

/// What the ledger says one executor holds. Chains link the slots of held resources
/// whose key (or resource) hashes alike, newest first; a removed resource is unlinked, so
/// a chain is as long as the resources held under one name, whatever the history.
#[derive(Debug, Default, Clone)]
pub(crate) struct AtExecutor {
    pub(crate) slots: Vec<Slot>,
    by_key: HashMap<u64, usize>,
    by_resource: HashMap<u64, usize>,
    gone: Vec<GoneResource>,
    /// The newest gone resource per key, per resource, and per resource among those
    /// without a key. A 64-bit hash collision would lose an explanation, never a finding.
    gone_by_key: HashMap<u64, usize>,
    gone_by_resource: HashMap<u64, usize>,
    gone_unkeyed_by_resource: HashMap<u64, usize>,
}

impl AtExecutor {
    fn heads(&self, of: ChainOf) -> &HashMap<u64, usize> {
        match of {
            ChainOf::Key => &self.by_key,
            ChainOf::Resource => &self.by_resource,
        }
    }

    /// The slots of chain `of` whose name hashes to `hash`, newest first.
    fn chain(&self, of: ChainOf, hash: u64) -> Chain<'_> {
        Chain {
            slots: &self.slots,
            next: self.heads(of).get(&hash).copied().unwrap_or(NONE),
            of,
        }
    }

    /// The held slots recorded under `key`.
    pub(crate) fn with_key<'a>(&'a self, key: &str) -> impl Iterator<Item = usize> + 'a {
        let wanted = Text::new(key);
        self.chain(ChainOf::Key, hash_str(key))
            .filter(move |&i| self.slots[i].record.key.as_ref() == Some(&wanted))
    }

    /// The held slots of `resource`.
    pub(crate) fn named<'a>(&'a self, resource: &str) -> impl Iterator<Item = usize> + 'a {
        let wanted = Text::new(resource);
        self.chain(ChainOf::Resource, hash_str(resource))
            .filter(move |&i| self.slots[i].record.resource == wanted)
    }

    fn add(&mut self, record: Arc<RecordedResource>, standing: Standing) {
        let i = self.slots.len();
        let next_by_key = match &record.key {
            Some(k) => self.by_key.insert(k.with_str(hash_str), i).unwrap_or(NONE),
            None => NONE,
        };
        let next_by_resource = if record.resource.is_empty() {
            NONE
        } else {
            self.by_resource
                .insert(record.resource.with_str(hash_str), i)
                .unwrap_or(NONE)
        };
        self.slots.push(Slot {
            record,
            standing,
            held: true,
            next_by_key,
            next_by_resource,
        });
    }

    fn remove(&mut self, removal: &Removal, removed_by: Uuid) {
        let mut named: Vec<usize> = Vec::new();
        if let Some(key) = &removal.key {
            named.extend(
                self.chain(ChainOf::Key, key.with_str(hash_str))
                    .filter(|&i| removal.names(&self.slots[i].record)),
            );
        }
        if !removal.resource.is_empty() {
            named.extend(
                self.chain(ChainOf::Resource, removal.resource.with_str(hash_str))
                    .filter(|&i| removal.names(&self.slots[i].record)),
            );
        }
        named.sort_unstable();
        named.dedup();
        for i in named {
            self.unlink(i);
            let record = self.slots[i].record.clone();
            self.remember_gone(GoneResource {
                record,
                removed_by,
                by: removal.by.clone(),
            });
        }
    }

    /// Takes slot `i` out of both chains.
    fn unlink(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        slot.held = false;
        let (key, resource) = (slot.record.key.clone(), slot.record.resource.clone());
        if let Some(key) = key {
            self.unlink_from(ChainOf::Key, key.with_str(hash_str), i);
        }
        if !resource.is_empty() {
            self.unlink_from(ChainOf::Resource, resource.with_str(hash_str), i);
        }
    }

    /// Takes slot `i` out of chain `of` under `hash`.
    fn unlink_from(&mut self, of: ChainOf, hash: u64, i: usize) {
        let after = self.slots[i].next_in(of);
        let heads = match of {
            ChainOf::Key => &mut self.by_key,
            ChainOf::Resource => &mut self.by_resource,
        };
        let Some(head) = heads.get_mut(&hash) else {
            return;
        };
        if *head == i {
            if after == NONE {
                heads.remove(&hash);
            } else {
                *head = after;
            }
            return;
        }
        let mut at = *head;
        while at != NONE {
            let s = &mut self.slots[at];
            if s.next_in(of) == i {
                *s.next_in_mut(of) = after;
                return;
            }
            at = s.next_in(of);
        }
    }

    fn remember_gone(&mut self, gone: GoneResource) {
        let g = self.gone.len();
        let record = &gone.record;
        if let Some(key) = &record.key {
            self.gone_by_key.insert(key.with_str(hash_str), g);
        }
        if !record.resource.is_empty() {
            let h = record.resource.with_str(hash_str);
            self.gone_by_resource.insert(h, g);
            if record.key.is_none() {
                self.gone_unkeyed_by_resource.insert(h, g);
            }
        }
        self.gone.push(gone);
    }

    /// The newest gone resource an item held under `key` and `resource` is: by key when
    /// both have one, else by resource.
    pub(crate) fn gone_as(&self, key: Option<&str>, resource: &str) -> Option<&GoneResource> {
        let at = |map: &HashMap<u64, usize>, s: &str| {
            map.get(&hash_str(s))
                .and_then(|&g| self.gone.get(g).map(|r| (g, r)))
        };
        let candidates = match key {
            Some(key) => [
                at(&self.gone_by_key, key)
                    .filter(|(_, g)| g.record.key.as_ref().is_some_and(|k| k.is(key))),
                at(&self.gone_unkeyed_by_resource, resource)
                    .filter(|(_, g)| g.record.key.is_none() && g.record.resource.is(resource)),
            ],
            None => [
                at(&self.gone_by_resource, resource)
                    .filter(|(_, g)| g.record.resource.is(resource)),
                None,
            ],
        };
        candidates
            .into_iter()
            .flatten()
            .max_by_key(|(g, _)| *g)
            .map(|(_, r)| r)
    }
}

/// The slots of one hash chain, newest first.
struct Chain<'a> {
    slots: &'a [Slot],
    next: usize,
    of: ChainOf,
}

impl Iterator for Chain<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.next == NONE {
            return None;
        }
        let i = self.next;
        let slot = self.slots.get(i)?;
        self.next = slot.next_in(self.of);
        Some(i)
    }
}

/// Everything the ledger says the executors hold, by executor.
#[derive(Debug, Default, Clone)]
pub struct LedgerResources {
    at: BTreeMap<Arc<str>, AtExecutor>,
}

impl LedgerResources {
    /// What `operations` say is held now. Operations are taken in id order (UUID v7:
    /// start order), each one's actions in order. A resource is `Uncertain` when its
    /// operation is not closed, when an operation not closed works on its operation's
    /// target or on its entity (its resources are moving while drift looks), or when its
    /// step was started and never settled.
    pub fn build<'a>(operations: impl IntoIterator<Item = &'a OperationResources>) -> Self {
        let mut ops: Vec<&OperationResources> = operations.into_iter().collect();
        ops.sort_by_key(|op| op.id);
        let mut targets = BTreeSet::new();
        let mut entities: BTreeSet<&str> = BTreeSet::new();
        for op in ops.iter().filter(|op| op.open) {
            targets.extend(op.target);
            entities.extend(op.moving_entities.iter().map(String::as_str));
        }
        let mut ledger = LedgerResources::default();
        for op in ops {
            let moving = op.open || op.target.is_some_and(|t| targets.contains(&t));
            for action in op.actions.iter() {
                match action {
                    Action::Holds(r) => {
                        let uncertain = moving
                            || r.entity
                                .as_ref()
                                .is_some_and(|e| e.with_str(|e| entities.contains(e)));
                        let standing = if uncertain {
                            Standing::Uncertain
                        } else {
                            Standing::Recorded
                        };
                        ledger.at_mut(&r.executor).add(r.clone(), standing);
                    }
                    Action::Started(r) => {
                        ledger
                            .at_mut(&r.executor)
                            .add(r.clone(), Standing::Uncertain);
                    }
                    Action::Removes(removal) => {
                        if let Some(at) = ledger.at.get_mut(&removal.executor) {
                            at.remove(removal, op.id);
                        }
                    }
                }
            }
        }
        ledger
    }

    fn at_mut(&mut self, executor: &Arc<str>) -> &mut AtExecutor {
        self.at.entry(executor.clone()).or_default()
    }

    /// The executors the ledger records anything at (created or removed).
    pub fn executors(&self) -> BTreeSet<String> {
        self.at.keys().map(|e| e.to_string()).collect()
    }

    pub(crate) fn at(&self, executor: &str) -> Option<&AtExecutor> {
        self.at.get(executor)
    }

    /// The resources recorded at `executor` and still held (existing or uncertain), in
    /// the order recorded.
    pub fn held_at<'a>(
        &'a self,
        executor: &str,
    ) -> impl Iterator<Item = (&'a RecordedResource, Standing)> + 'a {
        self.at(executor)
            .into_iter()
            .flat_map(|at| at.slots.iter())
            .filter(|s| s.held)
            .map(|s| (s.record.as_ref(), s.standing))
    }
}

impl Slot {
    pub(crate) fn is_held(&self) -> bool {
        self.held
    }

    /// The next slot in chain `of` (NONE at its end).
    fn next_in(&self, of: ChainOf) -> usize {
        match of {
            ChainOf::Key => self.next_by_key,
            ChainOf::Resource => self.next_by_resource,
        }
    }

    fn next_in_mut(&mut self, of: ChainOf) -> &mut usize {
        match of {
            ChainOf::Key => &mut self.next_by_key,
            ChainOf::Resource => &mut self.next_by_resource,
        }
    }
}

/// The ledger's side of drift from folded operations: [`OperationResources::of`] each,
/// then [`LedgerResources::build`].
pub fn recorded_resources<'a>(
    operations: impl IntoIterator<Item = &'a OperationState>,
) -> LedgerResources {
    let mut names = Names::default();
    let ops: Vec<OperationResources> = operations
        .into_iter()
        .map(|op| OperationResources::of(op, &mut names))
        .collect();
    LedgerResources::build(&ops)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What the chains must agree with: the resources held, found by scanning them all.
    fn scanned(actions: &[Action]) -> Vec<Arc<RecordedResource>> {
        let mut held: Vec<Arc<RecordedResource>> = Vec::new();
        for action in actions {
            match action {
                Action::Holds(r) | Action::Started(r) => held.push(r.clone()),
                Action::Removes(removal) => {
                    held.retain(|r| r.executor != removal.executor || !removal.names(r))
                }
            }
        }
        held
    }

    fn text(pick: u8, of: &[&str]) -> Text {
        Text::new(of[usize::from(pick) % of.len()])
    }

    fn action(
        (kind, executor, key, resource, entity): (u8, u8, u8, u8, u8),
        names: &mut Names,
    ) -> Action {
        let executor = names.get(["ipam", "dns"][usize::from(executor % 2)]);
        // Few distinct keys and resources, so that chains share names and removals hit
        let key = (key % 4 != 0).then(|| text(key, &["k1", "k2", "k3"]));
        let resource = text(resource, &["", "10.0.0.1", "10.0.0.2", "vm-a"]);
        let entity = (entity % 3 != 0).then(|| text(entity, &["n1", "n2"]));
        if kind % 3 == 0 {
            return Action::Removes(Box::new(Removal {
                executor,
                key,
                resource,
                entity,
                by: By::Compensation(Uuid::nil()),
            }));
        }
        Action::Holds(Arc::new(RecordedResource {
            executor,
            resource,
            key,
            entity,
            operation_id: Uuid::nil(),
            step: names.get("s"),
            attrs: Box::new([]),
        }))
    }

    proptest! {
        #[test]
        fn the_hash_chains_hold_what_a_scan_of_every_record_holds(
            given in proptest::collection::vec(any::<(u8, u8, u8, u8, u8)>(), 0..60)
        ) {
            // Given adds and removals over a few keys, resources and entities
            let mut names = Names::default();
            let actions: Vec<Action> = given.into_iter().map(|a| action(a, &mut names)).collect();
            let op = OperationResources {
                id: Uuid::nil(),
                open: false,
                target: None,
                moving_entities: Vec::new(),
                actions: actions.clone().into_boxed_slice(),
            };
            // When built with chains
            let ledger = LedgerResources::build([&op]);
            // Then each executor holds exactly what a scan finds, in the same order
            for executor in ["ipam", "dns"] {
                let chained: Vec<&RecordedResource> =
                    ledger.held_at(executor).map(|(r, _)| r).collect();
                let want = scanned(&actions);
                let want: Vec<&RecordedResource> =
                    want.iter().filter(|r| &*r.executor == executor).map(|r| r.as_ref()).collect();
                prop_assert_eq!(chained, want);
                // And every held record is found again by its key and by its name
                if let Some(at) = ledger.at(executor) {
                    for (i, slot) in at.slots.iter().enumerate().filter(|(_, s)| s.held) {
                        if let Some(k) = &slot.record.key {
                            prop_assert!(k.with_str(|k| at.with_key(k).any(|j| j == i)));
                        }
                        if !slot.record.resource.is_empty() {
                            let r = &slot.record.resource;
                            prop_assert!(r.with_str(|r| at.named(r).any(|j| j == i)));
                        }
                    }
                    // And the chains lead to held records only
                    for name in ["k1", "k2", "k3", "10.0.0.1", "10.0.0.2", "vm-a"] {
                        prop_assert!(at.with_key(name).all(|j| at.slots[j].held));
                        prop_assert!(at.named(name).all(|j| at.slots[j].held));
                    }
                }
            }
        }
    }
}
