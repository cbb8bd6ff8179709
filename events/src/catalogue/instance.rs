//! Value types of the `instance` aggregate (Nova instances).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Nova's `vm_state`: the stable state of the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    Building,
    Active,
    Stopped,
    Error,
    Deleted,
}

/// Nova's `task_state`: the transition in progress, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Scheduling,
    Spawning,
    Networking,
    Deleting,
    PoweringOn,
    PoweringOff,
    RebootPending,
    RebootStarted,
    ImageUploading,
    Rebuilding,
    ResizeMigrating,
    Migrating,
    Decommissioning,
    Configuring,
}

/// Nova's `power_state`: what the hypervisor last reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PowerState {
    NoState,
    Running,
    Paused,
    Shutdown,
    Crashed,
    Suspended,
}

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskOutcome {
    Succeeded,
    Failed,
    Cancelled,
    /// Cleared or re-driven by the restart recovery sweep.
    Recovered,
}

/// What the worker that owns an instance is asked to do again by a recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Reissue {
    Delete,
    PowerOn,
    PowerOff,
    Reboot,
    HardReboot,
    RevertResize,
    AbortLiveMigration,
}
