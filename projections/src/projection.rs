//! The fold over commits: one [`Entity`] per aggregate, and [`Projection`], the whole
//! projected state. Each commit changes exactly one entity, which is what lets the
//! runner load, fold and store entities one at a time.

use std::collections::{BTreeMap, HashMap};

use provledger_events::{AggregateId, AggregateKind, ChainViolation, Commit, Event};
use serde::{Deserialize, Serialize};

use crate::cluster::ClusterState;
use crate::entity::{EventContext, Folded, Header};
use crate::instance::InstanceState;
use crate::operation::OperationState;
use crate::provider::ProviderState;

/// How far a target's deletion has come. `Deleting` is terminal for clusters and
/// instances: nothing may bring them back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeletionState {
    Deleting,
    Deleted,
}

impl DeletionState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeletionState::Deleting => "deleting",
            DeletionState::Deleted => "deleted",
        }
    }
}

/// The projected state of one aggregate. Each state is boxed: an `Entity` is held in maps
/// of a million (a projection, serve's cache), where an unboxed enum would make every
/// entry as large as the largest state (an operation's, 496 bytes) and every empty slot
/// of the map too. Boxed it is 16 bytes; serialised, a box is its content (stored
/// entities keep their format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Entity {
    Cluster(Box<ClusterState>),
    Instance(Box<InstanceState>),
    Provider(Box<ProviderState>),
    Operation(Box<OperationState>),
}

impl Entity {
    /// The state of an aggregate before its first commit.
    pub fn new(id: AggregateId) -> Self {
        match id.kind {
            AggregateKind::Cluster => Entity::Cluster(Box::new(ClusterState::new(id))),
            AggregateKind::Instance => Entity::Instance(Box::new(InstanceState::new(id))),
            AggregateKind::Provider => Entity::Provider(Box::new(ProviderState::new(id))),
            AggregateKind::Operation => Entity::Operation(Box::new(OperationState::new(id))),
        }
    }

    /// The state of `id` folded from its commits, oldest first; `None` without commits.
    pub fn fold<'a>(
        id: AggregateId,
        commits: impl IntoIterator<Item = &'a Commit>,
    ) -> Option<Self> {
        let mut commits = commits.into_iter().peekable();
        commits.peek()?;
        let mut entity = Entity::new(id);
        for commit in commits {
            entity.apply(commit);
        }
        Some(entity)
    }

    pub fn header(&self) -> &Header {
        match self {
            Entity::Cluster(s) => &s.header,
            Entity::Instance(s) => &s.header,
            Entity::Provider(s) => &s.header,
            Entity::Operation(s) => &s.header,
        }
    }

    fn header_mut(&mut self) -> &mut Header {
        match self {
            Entity::Cluster(s) => &mut s.header,
            Entity::Instance(s) => &mut s.header,
            Entity::Provider(s) => &mut s.header,
            Entity::Operation(s) => &mut s.header,
        }
    }

    pub fn id(&self) -> AggregateId {
        self.header().id
    }

    /// Whether this target is being deleted or is deleted. A provider counts only once
    /// deleted: its delete request may still be refused (it holds allocations) and it then
    /// goes back to active. Operations are never deleted.
    pub fn deletion_state(&self) -> Option<DeletionState> {
        use provledger_events::catalogue::{ClusterStatus, VmState};
        match self {
            Entity::Cluster(c) => match c.status {
                Some(ClusterStatus::Deleted) => Some(DeletionState::Deleted),
                Some(ClusterStatus::Deleting) => Some(DeletionState::Deleting),
                _ => None,
            },
            Entity::Instance(i) => match (i.vm_state, i.delete_requested) {
                (Some(VmState::Deleted), _) => Some(DeletionState::Deleted),
                (_, true) => Some(DeletionState::Deleting),
                _ => None,
            },
            Entity::Provider(p) => (p.status == Some(crate::provider::ProviderStatus::Deleted))
                .then_some(DeletionState::Deleted),
            Entity::Operation(_) => None,
        }
    }

    /// Folds one commit of this aggregate. Never panics: a commit for another aggregate,
    /// a version already folded, a gap, or an event that makes no sense is recorded as
    /// an anomaly.
    pub fn apply(&mut self, commit: &Commit) {
        let header = self.header_mut();
        let ctx = EventContext {
            position: commit.position,
            version: commit.version,
            recorded_at: commit.recorded_at,
            operation_id: commit.operation_id,
        };
        if commit.aggregate != header.id {
            header.record_anomaly(
                &ctx,
                "commit".into(),
                format!(
                    "commit for {} folded into {}; not applied",
                    commit.aggregate, header.id
                ),
            );
            return;
        }
        if commit.version <= header.version {
            // The runner's checkpoint makes this impossible; if it happens anyway the
            // commit is not folded twice.
            let problem = format!(
                "version {} already folded (at version {}); not applied",
                commit.version, header.version
            );
            header.record_anomaly(&ctx, "commit".into(), problem);
            return;
        }
        if commit.version != header.version + 1 {
            let problem = format!(
                "version gap: expected {}, got {}",
                header.version + 1,
                commit.version
            );
            header.record_anomaly(&ctx, "commit".into(), problem);
        }
        header.version = commit.version;
        header.last_position = commit.position;
        header.hash = commit.hash;
        header.updated_at = Some(commit.recorded_at);
        if commit.trace.is_some() {
            header.trace = commit.trace;
        }
        for event in &commit.events {
            if let Event::LossAcknowledged {
                from_version,
                to_version,
                reason,
            } = event
            {
                // Not a change of state but a note that stays with it: the state was
                // folded without the lost versions, on someone's word.
                let problem = format!(
                    "versions {from_version} to {to_version} were lost from the log; {} acknowledged the loss: {reason}",
                    commit.actor
                );
                self.header_mut()
                    .record_anomaly(&ctx, event.name().into(), problem);
                continue;
            }
            // Applied with an anomaly or refused, the entity keeps the problem alike.
            if let Some(problem) = self.fold_event(event, &ctx).anomaly() {
                self.header_mut()
                    .record_anomaly(&ctx, event.name().into(), problem);
            }
        }
    }

    /// Folds one event into the entity's own state (not the header's bookkeeping), and
    /// says whether it was applied.
    pub(crate) fn fold_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        match self {
            Entity::Cluster(s) => s.apply_event(event, ctx),
            Entity::Instance(s) => s.apply_event(event, ctx),
            Entity::Provider(s) => s.apply_event(event, ctx),
            Entity::Operation(s) => s.apply_event(event, ctx),
        }
    }

    /// Whether the aggregate's creating event has been folded (a cluster requested, an
    /// instance booted, a provider registered, an operation started).
    pub fn is_created(&self) -> bool {
        match self {
            Entity::Cluster(s) => s.status.is_some(),
            Entity::Instance(s) => s.vm_state.is_some(),
            Entity::Provider(s) => s.status.is_some(),
            Entity::Operation(s) => s.status.is_some(),
        }
    }

    /// Whether `commit` is the next link of this aggregate's chain: its own, at the next
    /// version, linked to the tip's hash, and unmodified. Readers check this before
    /// folding, so a replayed, forged or altered commit is never folded.
    pub fn check_next(&self, commit: &Commit) -> Result<(), ChainViolation> {
        self.header().check_next(commit)
    }

    /// The contract's form of this entity, as a type (`crate::view`).
    pub fn view_typed(&self) -> crate::view::EntityView {
        use crate::view::{ClusterView, EntityView, InstanceView, OperationView, ProviderView};
        match self {
            Entity::Cluster(s) => EntityView::Cluster(ClusterView::of(s)),
            Entity::Instance(s) => EntityView::Instance(InstanceView::of(s)),
            Entity::Provider(s) => EntityView::Provider(ProviderView::of(s)),
            Entity::Operation(s) => EntityView::Operation(Box::new(OperationView::of(s))),
        }
    }

    /// The contract's JSON form of this entity.
    pub fn view(&self) -> serde_json::Value {
        match self {
            Entity::Cluster(s) => s.view(),
            Entity::Instance(s) => s.view(),
            Entity::Provider(s) => s.view(),
            Entity::Operation(s) => s.view(),
        }
    }

    /// The status word used in summaries: cluster status, vm_state, provider status,
    /// operation status; "absent" before creation.
    pub fn status_word(&self) -> String {
        let value = match self {
            Entity::Cluster(s) => serde_json::to_value(s.status),
            Entity::Instance(s) => serde_json::to_value(s.vm_state),
            Entity::Provider(s) => serde_json::to_value(s.status),
            Entity::Operation(s) => serde_json::to_value(s.status),
        };
        match value {
            Ok(serde_json::Value::String(s)) => s,
            _ => "absent".into(),
        }
    }
}

/// Every entity, folded from position 1. Used for rebuilds, replays and tests; the
/// runner keeps the same entities in sled instead of in memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Projection {
    pub entities: HashMap<AggregateId, Entity>,
    /// The position of the last commit folded.
    pub position: u64,
}

impl Projection {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn apply(&mut self, commit: &Commit) {
        self.entities
            .entry(commit.aggregate)
            .or_insert_with(|| Entity::new(commit.aggregate))
            .apply(commit);
        self.position = self.position.max(commit.position);
    }

    /// Folds `commit` only if it extends its aggregate's chain (see
    /// [`Entity::check_next`]); otherwise says why and leaves the projection as it was.
    pub fn apply_checked(&mut self, commit: &Commit) -> Result<(), ChainViolation> {
        match self.entities.get(&commit.aggregate) {
            Some(entity) => entity.check_next(commit)?,
            None => Entity::new(commit.aggregate).check_next(commit)?,
        }
        self.apply(commit);
        Ok(())
    }

    /// Folds commits in order into a fresh projection.
    pub fn rebuild<'a>(commits: impl IntoIterator<Item = &'a Commit>) -> Self {
        let mut projection = Projection::new();
        for commit in commits {
            projection.apply(commit);
        }
        projection
    }

    pub fn get(&self, id: &AggregateId) -> Option<&Entity> {
        self.entities.get(id)
    }

    /// Every operation, in no particular order.
    pub fn operations(&self) -> impl Iterator<Item = &OperationState> + '_ {
        self.entities.values().filter_map(|e| match e {
            Entity::Operation(op) => Some(&**op),
            _ => None,
        })
    }

    /// Every provider, in id order (placement's decisions walk them deterministically).
    pub fn providers(&self) -> Vec<&ProviderState> {
        let mut out: Vec<&ProviderState> = self
            .entities
            .values()
            .filter_map(|e| match e {
                Entity::Provider(p) => Some(&**p),
                _ => None,
            })
            .collect();
        out.sort_by_key(|p| p.header.id.id);
        out
    }

    /// Every instance, in id order.
    pub fn instances(&self) -> Vec<&InstanceState> {
        let mut out: Vec<&InstanceState> = self
            .entities
            .values()
            .filter_map(|e| match e {
                Entity::Instance(i) => Some(&**i),
                _ => None,
            })
            .collect();
        out.sort_by_key(|i| i.header.id.id);
        out
    }

    pub fn summary(&self) -> Summary {
        Summary::of(self.position, self.entities.values())
    }
}

/// Counts by kind and status, and the anomalies, for `replay` and health checks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub position: u64,
    /// kind -> status -> count
    pub counts: BTreeMap<String, BTreeMap<String, u64>>,
    pub anomaly_count: u64,
    /// The entities with anomalies, with their latest anomaly, at most `SUMMARY_ANOMALIES_MAX`.
    pub anomalies: Vec<serde_json::Value>,
}

/// Bound on the anomalies listed in a summary; the count covers them all.
pub const SUMMARY_ANOMALIES_MAX: usize = 50;

impl Summary {
    pub fn of<'a>(position: u64, entities: impl IntoIterator<Item = &'a Entity>) -> Self {
        let mut summary = Summary {
            position,
            ..Default::default()
        };
        let mut with_anomalies: Vec<&Entity> = Vec::new();
        for entity in entities {
            let kind = entity.id().kind.to_string();
            *summary
                .counts
                .entry(kind)
                .or_default()
                .entry(entity.status_word())
                .or_insert(0) += 1;
            let header = entity.header();
            if header.anomaly_count > 0 {
                summary.anomaly_count += header.anomaly_count;
                with_anomalies.push(entity);
            }
        }
        // Deterministic order whatever the iteration order of the caller's map.
        with_anomalies.sort_by_key(|e| e.id().to_string());
        summary.anomalies = with_anomalies
            .iter()
            .take(SUMMARY_ANOMALIES_MAX)
            .map(|e| {
                serde_json::json!({
                    "aggregate": e.id().to_string(),
                    "anomaly_count": e.header().anomaly_count,
                    "latest": e.header().anomalies.last(),
                })
            })
            .collect();
        summary
    }
}

impl Header {
    /// Whether `commit` is the next link of the chain whose tip this header is (see
    /// [`Entity::check_next`]).
    pub fn check_next(&self, commit: &Commit) -> Result<(), ChainViolation> {
        let header = self;
        if commit.aggregate != header.id {
            return Err(ChainViolation::ForeignCommit {
                aggregate: header.id,
                found: commit.aggregate,
                position: commit.position,
            });
        }
        if commit.version != header.version + 1 {
            return Err(ChainViolation::VersionGap {
                aggregate: header.id,
                expected: header.version + 1,
                found: commit.version,
                position: commit.position,
            });
        }
        if !commit.hash_is_valid() {
            return Err(ChainViolation::HashMismatch {
                aggregate: header.id,
                version: commit.version,
                position: commit.position,
            });
        }
        if commit.prev_hash != header.hash {
            return Err(ChainViolation::BrokenLink {
                aggregate: header.id,
                version: commit.version,
                position: commit.position,
            });
        }
        Ok(())
    }
}
