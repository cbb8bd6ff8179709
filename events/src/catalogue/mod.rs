//! The event catalogue: every fact provledger records, for the four aggregate kinds.
//!
//! This enum is a wire contract. The bincode encoding uses the variant's index, so variants
//! are only ever appended at the end, and a changed field layout takes a new version of that
//! event in `versions.rs`, with an upcaster for the old layout (docs/events.md, "How to
//! change an event"). The golden tests in `codec` fail on any accidental change. The JSON form is
//! serde's external tagging with snake_case names: `{"cluster_create_requested": {...}}`.
//! Every event is documented in `docs/events.md`.

pub mod cluster;
mod constructors;
pub mod detail;
#[doc(hidden)]
pub mod golden_log;
pub mod instance;
mod name;
pub mod operation;
pub mod provider;
#[doc(hidden)]
pub mod samples;
pub mod versions;

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

pub use cluster::{ClusterStatus, NodeGroupSpec, NodeGroupTarget};
pub use detail::DetailKey;
pub use instance::{PowerState, Reissue, TaskOutcome, TaskState, VmState};
pub use operation::{
    BundlePolicy, Compensation, CompensationAction, Effect, EffectKind, Executor, OperationKind,
    OperationOutcome, Origin, PlannedCompensation, RetainedResource, RollbackOutcome, RollbackPlan,
    StagePolicy, StageSpec, TargetOutcome,
};
pub use provider::{AllocationHold, BlockingAllocation, ConsumerKind, Inventory, Ratio};

use crate::ids::{AggregateId, AggregateKind, Timestamp};

/// One fact. Each variant belongs to exactly one aggregate kind (see [`Event::kind`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    // ---- cluster ----
    ClusterCreateRequested {
        name: String,
        plugin: String,
        node_groups: Vec<NodeGroupSpec>,
    },
    ClusterStatusChanged {
        status: ClusterStatus,
        description: String,
    },
    ClusterScaleRequested {
        targets: Vec<NodeGroupTarget>,
    },
    NodeGroupAdded {
        spec: NodeGroupSpec,
    },
    InstanceJoined {
        node_group: String,
        instance_id: Uuid,
    },
    InstanceLeft {
        node_group: String,
        instance_id: Uuid,
        reason: String,
    },
    ClusterDeleteRequested {
        reason: String,
    },
    ClusterDeleted {},

    // ---- instance ----
    InstanceCreateRequested {
        name: String,
        cluster_id: Option<Uuid>,
        node_group: Option<String>,
        flavor: String,
        resources: BTreeMap<String, u64>,
        image: String,
    },
    InstanceDiscovered {
        name: String,
        host: String,
        resources: BTreeMap<String, u64>,
    },
    VmStateChanged {
        vm_state: VmState,
        reason: String,
    },
    PowerStateChanged {
        power_state: PowerState,
    },
    HostAssigned {
        host: String,
        provider_id: Uuid,
    },
    TaskQueued {
        task_state: TaskState,
    },
    TaskStarted {
        task_state: TaskState,
        worker_id: String,
        lease_until: Timestamp,
    },
    TaskLeaseRenewed {
        worker_id: String,
        lease_until: Timestamp,
    },
    TaskFinished {
        task_state: TaskState,
        outcome: TaskOutcome,
        reason: String,
    },
    InstanceDeleteRequested {
        reason: String,
    },
    InstanceDeleted {},

    // ---- provider ----
    ProviderRegistered {
        name: String,
        host: String,
    },
    InventorySet {
        resource_class: String,
        inventory: Inventory,
    },
    InventoryRemoved {
        resource_class: String,
    },
    AllocationClaimed {
        consumer: Uuid,
        consumer_kind: ConsumerKind,
        resources: BTreeMap<String, u64>,
    },
    AllocationReleased {
        consumer: Uuid,
        reason: String,
    },
    ProviderDeleteRequested {
        cascade: bool,
        reason: String,
    },
    ProviderDeleteRefused {
        blocking: Vec<BlockingAllocation>,
    },
    ProviderDeleted {},

    // ---- operation ----
    OperationStarted {
        kind: OperationKind,
        target: AggregateId,
        parent_id: Option<Uuid>,
        stages: Vec<StageSpec>,
        bundle_policy: Option<BundlePolicy>,
    },
    ChildOperationAdded {
        child_id: Uuid,
    },
    StageStarted {
        stage: String,
    },
    StepDone {
        stage: String,
        step: String,
        effect: Effect,
        compensation: Option<Compensation>,
    },
    StageCompleted {
        stage: String,
    },
    OperationSucceeded {},
    OperationFailed {
        stage: String,
        step: Option<String>,
        error: String,
    },
    CancellationRequested {
        reason: String,
    },
    OperationCancelled {
        reason: String,
    },
    RollbackPlanned {
        plan: RollbackPlan,
    },
    CompensationRequested {
        compensation_id: Uuid,
        attempt: u32,
    },
    CompensationDone {
        compensation_id: Uuid,
    },
    CompensationFailed {
        compensation_id: Uuid,
        attempt: u32,
        error: String,
    },
    RollbackFinished {
        outcome: RollbackOutcome,
        remaining: Vec<Uuid>,
    },

    // ---- target side of an operation (cluster or instance) ----
    // Appended at the end of the enum because the encoding uses the variant index.
    InFlightOperationSet {
        operation_id: Uuid,
        operation_kind: OperationKind,
    },
    InFlightOperationCleared {
        operation_id: Uuid,
        outcome: OperationOutcome,
    },

    // ---- operation (appended later) ----
    /// The operation's target is being deleted by a user. The operation must stop at its
    /// next step, and its rollback removes everything it created, data-holding nodes
    /// included, because the user asked for the target to go (Sahara seed, design 4).
    TargetDeletionNoticed {
        reason: String,
    },
    /// An operator asks a rollback that ended `needs_attention` to go on (after fixing
    /// what made its compensations fail): it is rolling back again, and each compensation
    /// not done gets a fresh budget of attempts (attempt numbers keep counting).
    RollbackResumed {
        reason: String,
    },
    /// Intent before effect: a step is about to ask an executor for an action, under this
    /// idempotency key (the executor records what it does under it). Written before the
    /// action, so that a runner dying between the action and its `StepDone` still leaves
    /// the action known to the ledger: until a `StepDone` of the same stage and step
    /// records its outcome, the step's outcome is unknown, and a rollback asks the
    /// executor to undo whatever it did under the key (`compensation`, whose args carry
    /// `idempotency_key`; an executor that did nothing answers that there was nothing to
    /// undo).
    StepStarted {
        stage: String,
        step: String,
        executor: String,
        idempotency_key: String,
        compensation: Option<Compensation>,
    },

    // ---- instance: re-issues delivered, not just sent (appended later) ----
    /// A recovery asks the worker that owns the instance to do `action` again. Recorded
    /// with the recovery, pending until a `ReissueDelivered`: serve retries it with backoff
    /// until the worker acknowledges (idempotent by `request_id`).
    ReissueRequested {
        request_id: Uuid,
        worker: String,
        action: Reissue,
        reason: String,
    },
    /// Attempt `attempt` of a pending re-issue is being sent. Decided at the instance's
    /// exact version, so that racing replicas send each attempt once.
    ReissueAttempted {
        request_id: Uuid,
        attempt: u32,
    },
    /// The worker acknowledged the re-issue: it is no longer pending.
    ReissueDelivered {
        request_id: Uuid,
    },
    /// Attempt `attempt` found no worker, timed out or was refused; the next waits for the
    /// backoff.
    ReissueFailed {
        request_id: Uuid,
        attempt: u32,
        error: String,
    },

    // ---- operation: an operator's hand (appended later) ----
    /// An operator handled a stuck compensation by hand (removed the IP, the VM, the DNS
    /// record at its executor), so the rollback that needs attention can finish without it
    /// (CloudFormation's continue-rollback with resources to skip). Only on an operation in
    /// `needs_attention`, for a compensation not done; the commit's actor says who, `reason`
    /// what was done. The compensation then counts as done; `drift` still checks the
    /// resource at its executor.
    CompensationResolved {
        compensation_id: Uuid,
        reason: String,
    },

    // ---- any aggregate: an operator's hand on a damaged chain ----
    /// An operator acknowledged that versions `from_version..=to_version` of this
    /// aggregate are lost from the log (the server dropped their messages, e.g. a damaged
    /// store block): until then every read and write of the aggregate answers `integrity`.
    /// Appended only by `provledger integrity acknowledge`, right after the chain's tip past
    /// the gap, naming exactly one open loss; the commit's actor says who, `reason` why
    /// the state is trusted without them. The aggregate then continues, its state folded
    /// without the lost commits (each projection notes the gap as an anomaly).
    LossAcknowledged {
        from_version: u64,
        to_version: u64,
        reason: String,
    },

    // ---- operation: the runner's heartbeat (appended later) ----
    /// The operation's runner is alive and still running it, in a step that writes
    /// nothing for a while. Every commit on an operation renews its **runner lease**
    /// (the lease runs from the `recorded_at` of the operation's last commit); this event
    /// renews it when the runner has nothing else to record. Only while the operation is
    /// `running`. serve's recovery sweep fails an operation whose runner lease lapsed
    /// (`--runner-lease-ms`), at its exact version, with "runner silent since …".
    OperationHeartbeat {},
}

impl Event {
    /// Every executor name this event carries (a step's executor, its effect's, its
    /// compensation's, a plan's compensations'): each becomes a NATS subject token, a
    /// metric label, HTML and log text, so each is checked against
    /// [`operation::executor_name_is_valid`] before it is written.
    pub fn executor_names(&self) -> Vec<&str> {
        fn of(c: &Compensation) -> Option<&str> {
            match &c.executor {
                Executor::Service(name) => Some(name),
                Executor::Ledger => None,
            }
        }
        match self {
            Event::StepDone {
                effect,
                compensation,
                ..
            } => std::iter::once(effect.executor.as_str())
                .chain(compensation.as_ref().and_then(of))
                .collect(),
            Event::StepStarted {
                executor,
                compensation,
                ..
            } => std::iter::once(executor.as_str())
                .chain(compensation.as_ref().and_then(of))
                .collect(),
            Event::RollbackPlanned { plan } => plan
                .compensations
                .iter()
                .filter_map(|p| of(&p.compensation))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The kinds of aggregate this event may be recorded on.
    pub fn belongs_to(&self, kind: AggregateKind) -> bool {
        match self {
            Event::InFlightOperationSet { .. } | Event::InFlightOperationCleared { .. } => {
                matches!(kind, AggregateKind::Cluster | AggregateKind::Instance)
            }
            Event::LossAcknowledged { .. } => true,
            other => other.home_kind() == Some(kind),
        }
    }

    /// The single aggregate kind an event belongs to, or `None` for events shared by
    /// several kinds.
    pub fn home_kind(&self) -> Option<AggregateKind> {
        use AggregateKind::*;
        Some(match self {
            Event::ClusterCreateRequested { .. }
            | Event::ClusterStatusChanged { .. }
            | Event::ClusterScaleRequested { .. }
            | Event::NodeGroupAdded { .. }
            | Event::InstanceJoined { .. }
            | Event::InstanceLeft { .. }
            | Event::ClusterDeleteRequested { .. }
            | Event::ClusterDeleted {} => Cluster,
            Event::InstanceCreateRequested { .. }
            | Event::InstanceDiscovered { .. }
            | Event::VmStateChanged { .. }
            | Event::PowerStateChanged { .. }
            | Event::HostAssigned { .. }
            | Event::TaskQueued { .. }
            | Event::TaskStarted { .. }
            | Event::TaskLeaseRenewed { .. }
            | Event::TaskFinished { .. }
            | Event::InstanceDeleteRequested { .. }
            | Event::InstanceDeleted {}
            | Event::ReissueRequested { .. }
            | Event::ReissueAttempted { .. }
            | Event::ReissueDelivered { .. }
            | Event::ReissueFailed { .. } => Instance,
            Event::ProviderRegistered { .. }
            | Event::InventorySet { .. }
            | Event::InventoryRemoved { .. }
            | Event::AllocationClaimed { .. }
            | Event::AllocationReleased { .. }
            | Event::ProviderDeleteRequested { .. }
            | Event::ProviderDeleteRefused { .. }
            | Event::ProviderDeleted {} => Provider,
            Event::OperationStarted { .. }
            | Event::ChildOperationAdded { .. }
            | Event::StageStarted { .. }
            | Event::StepDone { .. }
            | Event::StageCompleted { .. }
            | Event::OperationSucceeded {}
            | Event::OperationFailed { .. }
            | Event::CancellationRequested { .. }
            | Event::OperationCancelled { .. }
            | Event::RollbackPlanned { .. }
            | Event::CompensationRequested { .. }
            | Event::CompensationDone { .. }
            | Event::CompensationFailed { .. }
            | Event::RollbackFinished { .. }
            | Event::TargetDeletionNoticed { .. }
            | Event::RollbackResumed { .. }
            | Event::StepStarted { .. }
            | Event::CompensationResolved { .. }
            | Event::OperationHeartbeat {} => Operation,
            Event::InFlightOperationSet { .. }
            | Event::InFlightOperationCleared { .. }
            | Event::LossAcknowledged { .. } => return None,
        })
    }

    /// Every event's name in the JSON form (`vm_state_changed`, ...): what a filter by event
    /// type may name (`q.changes`, `provledger watch --event`). Taken from one sample of each
    /// event, which the catalogue's tests keep complete.
    pub fn names() -> &'static std::collections::BTreeSet<String> {
        static NAMES: std::sync::OnceLock<std::collections::BTreeSet<String>> =
            std::sync::OnceLock::new();
        NAMES.get_or_init(|| {
            samples::all()
                .iter()
                .map(|e| e.name().to_string())
                .collect()
        })
    }

    /// The event's name in the JSON form (snake_case), for timelines and errors.
    pub fn name(&self) -> &'static str {
        // Every `Event` is an enum variant, so this is always `Some`.
        name::variant_name(self).unwrap_or("unknown")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_form_is_externally_tagged_snake_case() {
        let e = Event::ClusterStatusChanged {
            status: ClusterStatus::Active,
            description: "ready".into(),
        };
        let j = serde_json::to_value(&e).unwrap();
        assert_eq!(
            j,
            serde_json::json!({"cluster_status_changed": {"status": "active", "description": "ready"}})
        );
        assert_eq!(e.name(), "cluster_status_changed");
        assert!(e.belongs_to(AggregateKind::Cluster));
        assert!(!e.belongs_to(AggregateKind::Instance));
    }

    #[test]
    fn shared_target_events_belong_to_clusters_and_instances_only() {
        let e = Event::InFlightOperationSet {
            operation_id: Uuid::nil(),
            operation_kind: OperationKind::CreateCluster,
        };
        assert!(e.belongs_to(AggregateKind::Cluster));
        assert!(e.belongs_to(AggregateKind::Instance));
        assert!(!e.belongs_to(AggregateKind::Provider));
        assert!(!e.belongs_to(AggregateKind::Operation));
    }

    #[test]
    fn ratio_json_is_a_number_and_capacity_is_exact() {
        let inv: Inventory = serde_json::from_value(serde_json::json!({
            "total": 16, "reserved": 2, "allocation_ratio": 1.5,
            "min_unit": 1, "max_unit": 16, "step_size": 1
        }))
        .unwrap();
        assert_eq!(inv.allocation_ratio, Ratio(1500));
        assert_eq!(inv.capacity(), 21);
    }
}
