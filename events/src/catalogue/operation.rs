//! Value types of the `operation` aggregate: stages, steps, effects and their declared
//! compensations, and rollback plans.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::ids::AggregateId;

/// What a provisioning operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OperationKind {
    CreateCluster,
    ScaleCluster,
    DeleteCluster,
    BootInstance,
    DeleteInstance,
    RebootInstance,
    SnapshotInstance,
    ResizeInstance,
    /// A service bundle of child operations.
    Bundle,
    /// Moves a running instance to another host without stopping it (Nova's live
    /// migration): the destination claimed under the instance, the source held under the
    /// migration (this operation's id) until it completes; on failure the instance stays
    /// on the source, ACTIVE, and only the migration is in error.
    LiveMigrateInstance,
    /// An operator removes resources that `provledger drift` found leaked (held by an
    /// executor, unknown to the ledger or already undone in it). Appended at the end: the
    /// encoding uses the variant index. Its target is the operation itself; its one stage
    /// (`remove_leaked`, policy `compensate`) records each resource as a `discovered`
    /// effect with the compensation that removes it, and the operation is cancelled in
    /// the same commit with the operator's reason, so its rollback, the ordinary
    /// compensation path (plan, requests with retries, `needs_attention`, `audit`),
    /// removes them. The one kind whose discovered resources the planner compensates:
    /// adopting them to remove them is its whole purpose (`docs/drift.md`).
    RemoveLeaked,
}

impl OperationKind {
    /// Whether the operation moves an instance between providers while it runs (the
    /// destination claimed under the instance, the source held under the migration).
    pub fn is_migration(self) -> bool {
        matches!(
            self,
            OperationKind::ResizeInstance | OperationKind::LiveMigrateInstance
        )
    }
}

/// What the rollback planner does with a stage's completed steps when the operation fails
/// inside that stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StagePolicy {
    /// Undo the completed steps in reverse order.
    Compensate,
    /// Keep the resources, move the target to Error and describe what remains.
    Hold,
    /// Finish the started removal instead of undoing it.
    RollForward,
}

/// What happens to a bundle's siblings when one child operation fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BundlePolicy {
    RollBackSiblings,
    RetainSiblings,
}

/// A stage as declared when the operation starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct StageSpec {
    pub name: String,
    pub policy: StagePolicy,
}

/// Whether provledger brought a resource into being. Discovered resources are never destroyed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    Created,
    Discovered,
}

/// What a completed step changed in the world.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum EffectKind {
    IpAcquired,
    DhcpRegistered,
    DnsRegistered,
    VmCreated,
    AllocationClaimed,
    NodeDecommissioned,
    NodeConfigured,
    NodeStarted,
    NodeTerminated,
    Custom(String),
}

/// The effect of one step: what kind, on which resource, done by which executor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Effect {
    pub kind: EffectKind,
    /// The resource's identifier in its owner's terms (an IP, a DNS name, an instance UUID).
    pub resource: String,
    /// The service that performed it (e.g. "ipam", "dhcp", "dns", "hypervisor", "ledger").
    pub executor: String,
    pub origin: Origin,
    pub detail: BTreeMap<String, String>,
}

/// The action that undoes an effect.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CompensationAction {
    ReleaseIp,
    UnregisterDhcp,
    UnregisterDns,
    TerminateVm,
    ReleaseAllocation,
    Custom(String),
    /// Gives a migration's source back to the instance (executor `ledger`; `resource`: the
    /// instance, `args.provider_id`: the source): the migration's allocation released and
    /// the instance's claimed there in one commit (Nova's revert and abort).
    ReturnToSource,
}

/// The longest executor name, in bytes.
pub const EXECUTOR_NAME_BYTES_MAX: usize = 64;

/// The grammar of an executor name: 1 to [`EXECUTOR_NAME_BYTES_MAX`] ASCII letters,
/// digits, `_` or `-`. A name is one NATS subject token (`<prefix>.exec.<name>.compensate`:
/// a `.`, `*` or `>` would address another executor's subjects), a metric label and a word
/// of HTML and logs: nothing in it may need escaping.
pub fn executor_name_is_valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= EXECUTOR_NAME_BYTES_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Who carries out a compensation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Executor {
    /// Applied as events by provledger itself (releasing an allocation, setting Error).
    Ledger,
    /// Requested over NATS from the named service and confirmed by an event.
    Service(String),
}

/// The compensation declared together with a step's effect, recorded in the same commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Compensation {
    pub action: CompensationAction,
    pub executor: Executor,
    pub resource: String,
    pub args: BTreeMap<String, String>,
}

/// One compensation the rollback plan will drive, with its deterministic id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PlannedCompensation {
    pub compensation_id: Uuid,
    pub stage: String,
    pub step: String,
    pub compensation: Compensation,
}

/// A resource the plan deliberately keeps, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RetainedResource {
    pub stage: String,
    pub step: String,
    pub resource: String,
    pub why: String,
}

/// Where the target ends up once the plan is driven.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TargetOutcome {
    /// The target goes to Error, with this description.
    Error { description: String },
    /// The target returns to Active, with the failure described.
    Active { description: String },
    /// The target was deleted by the user; it proceeds to Deleted.
    Deleted,
}

/// The deterministic output of the rollback planner, recorded by `RollbackPlanned`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RollbackPlan {
    /// The stage rule that produced this plan, in words, for operators.
    pub rule: String,
    pub target: AggregateId,
    pub compensations: Vec<PlannedCompensation>,
    pub retained: Vec<RetainedResource>,
    pub target_outcome: TargetOutcome,
}

/// How a rollback ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum RollbackOutcome {
    RolledBack,
    Held,
    NeedsAttention,
}

/// How an operation's hold on its target ended (recorded on the target).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OperationOutcome {
    Succeeded,
    Failed,
    RolledBack,
    Held,
    Cancelled,
    NeedsAttention,
}
