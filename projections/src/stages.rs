//! The stages every shipped operation kind runs through, each with its rollback policy.
//!
//! The policies follow Sahara's error-handling spec (seed `sahara-error-handling-spec`):
//! a failure in an infrastructure stage is undone, a failure where nodes may already hold
//! data keeps them, and a failure in the middle of a removal finishes the removal. The
//! policy of the stage that failed decides the shape of the whole rollback plan (see
//! `planner`); the operation records these specs in `OperationStarted`, so the planner reads
//! them from the log and never from this table.

use provledger_events::catalogue::{OperationKind, StagePolicy, StageSpec};

/// Stage names, shared by the operation runner, the planner and the tests.
pub mod stage {
    /// Claim allocations on resource providers (Placement).
    pub const ALLOCATE: &str = "allocate";
    /// Create VMs, acquire their IPs, register DHCP and DNS.
    pub const SPAWN: &str = "spawn";
    /// Configure the cluster's processes on its nodes: from here nodes may hold data.
    pub const CONFIGURE: &str = "configure";
    /// Start the cluster's services.
    pub const START: &str = "start";
    /// Move data off the nodes that a scale-in removes (by the plugin).
    pub const DECOMMISSION: &str = "decommission";
    /// Terminate the removed nodes and create the new ones (by the engine).
    pub const TERMINATE_AND_CREATE: &str = "terminate_and_create";
    /// Configure and start the nodes a scale-out created.
    pub const CONFIGURE_NEW: &str = "configure_new";
    /// Terminate every node of a target being deleted.
    pub const TERMINATE: &str = "terminate";
    /// Pick a host and claim its resources.
    pub const SCHEDULE: &str = "schedule";
    /// Acquire an IP, register DHCP and DNS.
    pub const NETWORK: &str = "network";
    /// Run the child operations of a bundle.
    pub const CHILDREN: &str = "children";
    /// A single-step instance action (reboot, snapshot).
    pub const ACT: &str = "act";
    /// Move a running instance's guest to the destination (live migration).
    pub const MIGRATE: &str = "migrate";
    /// The resources drift found leaked, adopted as discovered to be removed.
    pub const REMOVE_LEAKED: &str = "remove_leaked";
}

fn spec(name: &str, policy: StagePolicy) -> StageSpec {
    StageSpec {
        name: name.to_string(),
        policy,
    }
}

/// The declared stages of an operation kind, in order.
pub fn stages_of(kind: OperationKind) -> Vec<StageSpec> {
    use stage::*;
    use StagePolicy::*;
    match kind {
        // Sahara create: infrastructure failures terminate everything created; a failure
        // while configuring or starting keeps the instances, which may hold data.
        OperationKind::CreateCluster => vec![
            spec(ALLOCATE, Compensate),
            spec(SPAWN, Compensate),
            spec(CONFIGURE, Hold),
            spec(START, Hold),
        ],
        // Sahara scale: 1 decommission (Error, delete no node), 2 terminate/create (delete
        // the new nodes, finish removing the decommissioned ones, back to Active),
        // 3 configure new nodes (Error, keep them).
        OperationKind::ScaleCluster => vec![
            spec(DECOMMISSION, Hold),
            spec(TERMINATE_AND_CREATE, RollForward),
            spec(CONFIGURE_NEW, Hold),
        ],
        // A removal the user asked for is never undone: a failure finishes it.
        OperationKind::DeleteCluster | OperationKind::DeleteInstance => {
            vec![spec(TERMINATE, RollForward)]
        }
        // ManageIQ's VM provisioning: every acquired resource is released on failure.
        OperationKind::BootInstance => vec![
            spec(SCHEDULE, Compensate),
            spec(NETWORK, Compensate),
            spec(SPAWN, Compensate),
        ],
        OperationKind::ResizeInstance => vec![spec(SCHEDULE, Compensate), spec(ACT, Hold)],
        // Nova's live migration: a failure while migrating rolls back (the destination's
        // claim released, the source given back to the instance); the guest never stopped.
        OperationKind::LiveMigrateInstance => {
            vec![spec(SCHEDULE, Compensate), spec(MIGRATE, Compensate)]
        }
        OperationKind::RebootInstance | OperationKind::SnapshotInstance => {
            vec![spec(ACT, Hold)]
        }
        // The bundle's own policy (`BundlePolicy`) decides about the siblings.
        OperationKind::Bundle => vec![spec(CHILDREN, Compensate)],
        // Cancelled as soon as recorded: its rollback removes what it adopted.
        OperationKind::RemoveLeaked => vec![spec(REMOVE_LEAKED, Compensate)],
    }
}
