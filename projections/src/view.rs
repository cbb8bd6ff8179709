//! The contract's JSON forms of the entities, as types: what `q.*.get`, the lists and
//! `state` answer. Each entity's `view()` serializes one of these, and the JSON Schemas
//! in `docs/schemas/` are derived from them, so the documented form is the sent form.
//!
//! These are copies made for the wire, not the folded state: the state's own bookkeeping
//! (`Header::hash`, `late_effects`, lease internals) stays off it unless listed here.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    BlockingAllocation, ClusterStatus, Compensation, CompensationAction, ConsumerKind, Effect,
    Executor, Inventory, OperationKind, Origin, PowerState, RollbackOutcome, RollbackPlan,
    StageSpec, TaskState, VmState,
};
use provledger_events::{AggregateId, Timestamp};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::cluster::ClusterState;
use crate::entity::{Anomaly, Header};
use crate::instance::{InstanceState, PendingReissue};
use crate::operation::{
    CompensationProgress, OperationError, OperationState, OperationStatus, StepProgress,
};
use crate::provider::{ProviderState, ProviderStatus};

/// The fields every entity's view carries besides its own.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct FoldProgress {
    /// The aggregate's version: the number of its commits folded.
    pub version: u64,
    /// The log position of the last commit folded.
    pub last_position: u64,
    /// Events that made no sense where they came (the newest 64).
    pub anomalies: Vec<Anomaly>,
    /// Every anomaly met, including those no longer listed.
    pub anomaly_count: u64,
}

impl FoldProgress {
    fn of(header: &Header) -> Self {
        FoldProgress {
            version: header.version,
            last_position: header.last_position,
            anomalies: header.anomalies.clone(),
            anomaly_count: header.anomaly_count,
        }
    }
}

/// A cluster (`q.cluster.get`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ClusterView {
    pub id: Uuid,
    pub name: String,
    pub plugin: String,
    /// Null before `cluster_create_requested` is folded.
    pub status: Option<ClusterStatus>,
    pub status_description: String,
    pub node_groups: Vec<NodeGroupView>,
    /// The operation in flight on the cluster.
    pub operation_id: Option<Uuid>,
    pub operation_kind: Option<OperationKind>,
    #[serde(flatten)]
    pub progress: FoldProgress,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct NodeGroupView {
    pub name: String,
    /// The desired count: the spec's, or the last scale target.
    pub count: u32,
    pub flavor: String,
    pub processes: Vec<String>,
    pub instance_ids: Vec<Uuid>,
}

impl ClusterView {
    pub fn of(state: &ClusterState) -> Self {
        ClusterView {
            id: state.header.id.id,
            name: state.name.clone(),
            plugin: state.plugin.clone(),
            status: state.status,
            status_description: state.status_description.clone(),
            node_groups: state
                .node_groups
                .iter()
                .map(|g| NodeGroupView {
                    name: g.spec.name.clone(),
                    count: g.count,
                    flavor: g.spec.flavor.clone(),
                    processes: g.spec.processes.clone(),
                    instance_ids: g.instance_ids.clone(),
                })
                .collect(),
            operation_id: state.in_flight.as_ref().map(|f| f.operation_id),
            operation_kind: state.in_flight.as_ref().map(|f| f.kind),
            progress: FoldProgress::of(&state.header),
        }
    }
}

/// An instance (`q.instance.get`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct InstanceView {
    pub id: Uuid,
    pub name: String,
    /// `created` by provledger or `discovered` on a host; null before either.
    pub origin: Option<Origin>,
    pub cluster_id: Option<Uuid>,
    pub node_group: Option<String>,
    pub flavor: String,
    /// The resources it claims, by resource class.
    pub resources: BTreeMap<String, u64>,
    pub vm_state: Option<VmState>,
    pub task_state: Option<TaskState>,
    pub power_state: PowerState,
    pub host: Option<String>,
    /// The resource provider backing `host` (`host_assigned`).
    pub provider_id: Option<Uuid>,
    /// The worker that started the task in progress (`task_started`): its holder.
    pub task_worker: Option<String>,
    /// When the current lease was granted (the commit of `task_started` or the last renewal).
    pub task_lease_since: Option<Timestamp>,
    /// When the current lease ends; past it the recovery sweep may take the task.
    pub task_lease_until: Option<Timestamp>,
    /// A delete was requested: the instance is `deleting`, terminal.
    pub delete_requested: bool,
    /// Re-issues a recovery recorded that the worker has not acknowledged.
    pub pending_reissues: Vec<PendingReissue>,
    /// The operation in flight on the instance.
    pub operation_id: Option<Uuid>,
    #[serde(flatten)]
    pub progress: FoldProgress,
}

impl InstanceView {
    pub fn of(state: &InstanceState) -> Self {
        InstanceView {
            id: state.header.id.id,
            name: state.name.clone(),
            origin: state.origin,
            cluster_id: state.cluster_id,
            node_group: state.node_group.clone(),
            flavor: state.flavor.clone(),
            resources: state.resources.to_map(),
            vm_state: state.vm_state,
            task_state: state.task_state,
            power_state: state.power_state,
            host: state.host.clone(),
            provider_id: state.provider_id,
            task_worker: state.task_worker.clone(),
            task_lease_since: state.task_lease_since,
            task_lease_until: state.task_lease_until,
            delete_requested: state.delete_requested,
            pending_reissues: state.pending_reissues.clone(),
            operation_id: state.in_flight.as_ref().map(|f| f.operation_id),
            progress: FoldProgress::of(&state.header),
        }
    }
}

/// A resource provider (`q.provider.get`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ProviderView {
    pub id: Uuid,
    pub name: String,
    pub host: String,
    pub status: Option<ProviderStatus>,
    /// By resource class.
    pub inventories: BTreeMap<String, Inventory>,
    /// `(total - reserved) * allocation_ratio`, rounded down, by resource class.
    pub capacity: BTreeMap<String, u64>,
    /// What is allocated, by resource class.
    pub usage: BTreeMap<String, u64>,
    /// In consumer id order: all of them, or one part (`allocations_total` then says how
    /// many there are).
    pub allocations: Vec<AllocationView>,
    /// How many allocations the provider holds, when `allocations` is one part of them
    /// (`q.provider.get` with `allocations_after` or `parts_limit`); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocations_total: Option<usize>,
    /// The allocations that blocked the last refused delete.
    pub last_delete_refusal: Option<Vec<BlockingAllocation>>,
    #[serde(flatten)]
    pub progress: FoldProgress,
}

/// One consumer's allocation on a provider.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct AllocationView {
    pub consumer: Uuid,
    pub consumer_kind: ConsumerKind,
    pub resources: BTreeMap<String, u64>,
}

impl ProviderView {
    pub fn of(state: &ProviderState) -> Self {
        Self::with_allocations(state, state.allocations.iter(), None)
    }

    /// The view with at most `limit` of the provider's allocations after consumer `after`
    /// (from the first without it), and their total: a provider of any size in parts a
    /// reply can carry. Reads only the part, not every allocation.
    pub fn part(state: &ProviderState, after: Option<Uuid>, limit: usize) -> Self {
        use std::ops::Bound;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        let part = state
            .allocations
            .range((from, Bound::Unbounded))
            .take(limit);
        Self::with_allocations(state, part, Some(state.allocations.len()))
    }

    fn with_allocations<'a>(
        state: &'a ProviderState,
        allocations: impl Iterator<Item = (&'a Uuid, &'a crate::provider::Allocation)>,
        allocations_total: Option<usize>,
    ) -> Self {
        ProviderView {
            id: state.header.id.id,
            name: state.name.clone(),
            host: state.host.clone(),
            status: state.status,
            inventories: state.inventories.clone(),
            capacity: state
                .inventories
                .iter()
                .map(|(rc, inv)| (rc.clone(), inv.capacity()))
                .collect(),
            usage: state.usage.clone(),
            allocations: allocations
                .map(|(consumer, a)| AllocationView {
                    consumer: *consumer,
                    consumer_kind: a.consumer_kind,
                    resources: a.resources.to_map(),
                })
                .collect(),
            allocations_total,
            last_delete_refusal: state.last_delete_refusal.clone(),
            progress: FoldProgress::of(&state.header),
        }
    }
}

/// An operation (`q.operation.get`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct OperationView {
    pub id: Uuid,
    pub kind: Option<OperationKind>,
    pub target: Option<AggregateId>,
    /// The bundle this operation is a child of.
    pub parent_id: Option<Uuid>,
    /// A bundle's child operations.
    pub children: Vec<Uuid>,
    pub status: Option<OperationStatus>,
    /// The current stage.
    pub stage: Option<String>,
    pub stages: Vec<StageSpec>,
    /// Completed steps with their effects and compensations, in order.
    pub steps: Vec<StepView>,
    /// Steps started (intent recorded) whose outcome is unknown.
    pub started: Vec<StartedStepView>,
    pub error: Option<OperationError>,
    pub cancellation_reason: Option<String>,
    /// The target is being deleted by a user.
    pub target_deleted: bool,
    pub rollback_plan: Option<RollbackPlan>,
    pub rollback_outcome: Option<RollbackOutcome>,
    /// The plan's compensations with their progress, in plan order.
    pub compensations: Vec<CompensationView>,
    /// The compensations left when a rollback finished `needs_attention`.
    pub remaining: Vec<Uuid>,
    /// When it started: the `recorded_at` of its `operation_started` commit.
    pub started_at: Option<Timestamp>,
    /// When it failed: the `recorded_at` of its `operation_failed` commit.
    pub failed_at: Option<Timestamp>,
    /// When it closed: the `recorded_at` of its `operation_succeeded` or
    /// `rollback_finished` commit; null while anything may still happen to it (a resumed
    /// rollback clears it).
    pub finished_at: Option<Timestamp>,
    /// The `recorded_at` of its last commit: how long it has been quiet.
    pub last_commit_at: Option<Timestamp>,
    /// Present when the view was asked for in parts (`q.operation.get` with `steps_from`,
    /// `compensations_from`, `parts_limit`): where each list starts and its total.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<Box<ViewParts>>,
    #[serde(flatten)]
    pub progress: FoldProgress,
}

/// Which part of an operation's lists a view holds.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct ViewParts {
    pub steps_from: usize,
    pub steps_total: usize,
    /// `started` is windowed from `steps_from` too.
    pub started_total: usize,
    pub compensations_from: usize,
    pub compensations_total: usize,
    pub limit: usize,
}

impl OperationView {
    /// This view with at most `limit` of its steps and started steps from `steps_from`,
    /// and of its compensations from `compensations_from`: an operation of any size in
    /// parts a reply can carry.
    pub fn part(mut self, steps_from: usize, compensations_from: usize, limit: usize) -> Self {
        fn window<T>(list: &mut Vec<T>, from: usize, limit: usize) {
            let from = from.min(list.len());
            list.drain(..from);
            list.truncate(limit);
        }
        self.parts = Some(Box::new(ViewParts {
            steps_from,
            steps_total: self.steps.len(),
            started_total: self.started.len(),
            compensations_from,
            compensations_total: self.compensations.len(),
            limit,
        }));
        window(&mut self.steps, steps_from, limit);
        window(&mut self.started, steps_from, limit);
        window(&mut self.compensations, compensations_from, limit);
        self
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct StepView {
    pub stage: String,
    pub name: String,
    pub effect: Effect,
    pub compensation: Option<Compensation>,
    pub state: StepProgress,
    /// The planned compensation's id, once a rollback plans it.
    pub compensation_id: Option<Uuid>,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct StartedStepView {
    pub stage: String,
    pub name: String,
    pub executor: String,
    pub idempotency_key: String,
    pub compensation: Option<Compensation>,
    pub state: OutcomeUnknown,
}

/// The one state of a started step: its outcome is not recorded.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeUnknown {
    OutcomeUnknown,
}

#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct CompensationView {
    pub compensation_id: Uuid,
    pub stage: String,
    pub step: String,
    pub action: CompensationAction,
    /// `"ledger"` (provledger applies it itself) or `{"service": NAME}`.
    pub executor: Executor,
    pub resource: String,
    pub state: CompensationProgress,
    pub attempts: u32,
    pub last_error: Option<String>,
    /// Why an operator handled it by hand (`compensation_resolved`), if one did.
    pub resolved: Option<String>,
}

impl OperationView {
    pub fn of(state: &OperationState) -> Self {
        OperationView {
            id: state.header.id.id,
            kind: state.kind,
            target: state.target,
            parent_id: state.parent_id,
            children: state.children.clone(),
            status: state.status,
            stage: state.current_stage.clone(),
            stages: state.stages.clone(),
            steps: state
                .steps
                .iter()
                .map(|s| StepView {
                    stage: s.stage.clone(),
                    name: s.name.clone(),
                    effect: s.effect.clone(),
                    compensation: s.compensation.clone(),
                    state: s.progress,
                    compensation_id: s.compensation_id,
                })
                .collect(),
            started: state
                .started
                .iter()
                .map(|s| StartedStepView {
                    stage: s.stage.clone(),
                    name: s.name.clone(),
                    executor: s.executor.clone(),
                    idempotency_key: s.idempotency_key.clone(),
                    compensation: s.compensation.clone(),
                    state: OutcomeUnknown::OutcomeUnknown,
                })
                .collect(),
            error: state.error.clone(),
            cancellation_reason: state.cancellation_reason.clone(),
            target_deleted: state.target_deleted,
            rollback_plan: state.rollback_plan.as_deref().cloned(),
            rollback_outcome: state.rollback_outcome,
            compensations: state
                .compensations
                .iter()
                .map(|c| CompensationView::of(c))
                .collect(),
            remaining: state.remaining.clone(),
            started_at: state.header.created_at,
            failed_at: state.failed_at,
            finished_at: state.finished_at,
            last_commit_at: state.header.updated_at,
            parts: None,
            progress: FoldProgress::of(&state.header),
        }
    }
}

impl CompensationView {
    fn of(c: &crate::operation::CompensationState) -> Self {
        CompensationView {
            compensation_id: c.planned.compensation_id,
            stage: c.planned.stage.clone(),
            step: c.planned.step.clone(),
            action: c.planned.compensation.action.clone(),
            executor: c.planned.compensation.executor.clone(),
            resource: c.planned.compensation.resource.clone(),
            state: c.progress,
            attempts: c.attempts,
            last_error: c.last_error.clone(),
            resolved: c.resolved.clone(),
        }
    }
}

/// The most compensations not done an [`OperationSummary`] lists (the others are counted):
/// a list holds many operations, and one of 5,000 steps must not fill a reply.
pub const SUMMARY_NOT_DONE_MAX: usize = 20;

/// An operation as lists show it (`q.operation.list`, `provledger operation list`): what an
/// operator triages by, bounded whatever the operation's size. Its steps, effects, plan
/// and every compensation are in its view (`q.operation.get`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct OperationSummary {
    pub id: Uuid,
    pub kind: Option<OperationKind>,
    pub target: Option<AggregateId>,
    pub parent_id: Option<Uuid>,
    pub status: Option<OperationStatus>,
    /// The current stage.
    pub stage: Option<String>,
    pub error: Option<OperationError>,
    pub cancellation_reason: Option<String>,
    pub target_deleted: bool,
    pub rollback_outcome: Option<RollbackOutcome>,
    /// Completed steps.
    pub steps: usize,
    /// Steps started whose outcome is unknown.
    pub started: usize,
    pub children: usize,
    /// The rollback plan's compensations, and how many of them are not done.
    pub compensations: usize,
    pub compensations_not_done: usize,
    /// The first [`SUMMARY_NOT_DONE_MAX`] compensations not done, in plan order.
    pub not_done: Vec<CompensationView>,
    /// When it started: the `recorded_at` of its `operation_started` commit.
    pub started_at: Option<Timestamp>,
    /// When it failed: the `recorded_at` of its `operation_failed` commit.
    pub failed_at: Option<Timestamp>,
    /// When it closed: the `recorded_at` of its `operation_succeeded` or
    /// `rollback_finished` commit; null while anything may still happen to it (a resumed
    /// rollback clears it).
    pub finished_at: Option<Timestamp>,
    /// The `recorded_at` of its last commit: how long it has been quiet.
    pub last_commit_at: Option<Timestamp>,
    #[serde(flatten)]
    pub progress: FoldProgress,
}

impl OperationSummary {
    pub fn of(state: &OperationState) -> Self {
        let not_done: Vec<&crate::operation::CompensationState> = state
            .compensations
            .iter()
            .map(|c| &**c)
            .filter(|c| c.progress != CompensationProgress::Done)
            .collect();
        OperationSummary {
            id: state.header.id.id,
            kind: state.kind,
            target: state.target,
            parent_id: state.parent_id,
            status: state.status,
            stage: state.current_stage.clone(),
            error: state.error.clone(),
            cancellation_reason: state.cancellation_reason.clone(),
            target_deleted: state.target_deleted,
            rollback_outcome: state.rollback_outcome,
            steps: state.steps.len(),
            started: state.started.len(),
            children: state.children.len(),
            compensations: state.compensations.len(),
            compensations_not_done: not_done.len(),
            not_done: not_done
                .into_iter()
                .take(SUMMARY_NOT_DONE_MAX)
                .map(CompensationView::of)
                .collect(),
            started_at: state.header.created_at,
            failed_at: state.failed_at,
            finished_at: state.finished_at,
            last_commit_at: state.header.updated_at,
            progress: FoldProgress::of(&state.header),
        }
    }
}

/// Any entity's view, as `q.state_at` and the lists answer it: the kind is told by the
/// fields (a list holds one kind; `state_at` names the aggregate asked for).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum EntityView {
    Cluster(ClusterView),
    Instance(InstanceView),
    Provider(ProviderView),
    // Boxed: an operation's view is the largest by far (clippy's large_enum_variant).
    Operation(Box<OperationView>),
}

/// How long before `now` `at` was, in its two largest units (`42s`, `17m3s`, `3h12m`,
/// `2d4h`), as lists show an operation's age; `0s` for a time after `now` (a writer's
/// clock ahead of the reader's).
pub fn age(at: Timestamp, now: Timestamp) -> String {
    let s = now.unix_ms().saturating_sub(at.unix_ms()).max(0) / 1000;
    let (d, h, m, s) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s}s"),
        (0, _, _) => format!("{h}h{m}m"),
        _ => format!("{d}d{h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_age_is_told_in_its_two_largest_units() {
        // Given times before now, when told as ages, then each reads in two units at most.
        let now = Timestamp::from_unix_ms(1_800_000_000_000);
        let ago = |s: i64| age(now.plus_ms(-s * 1000), now);
        assert_eq!(ago(42), "42s");
        assert_eq!(ago(17 * 60 + 3), "17m3s");
        assert_eq!(ago(3 * 3600 + 12 * 60 + 5), "3h12m");
        assert_eq!(ago(2 * 86_400 + 4 * 3600), "2d4h");
        // A time ahead of this clock is no age at all, not a negative one.
        assert_eq!(age(now.plus_ms(5_000), now), "0s");
    }
}
