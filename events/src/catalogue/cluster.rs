//! Value types of the `cluster` aggregate (Sahara clusters and node groups).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A cluster's lifecycle status. `deleting` and `deleted` are terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ClusterStatus {
    Requested,
    Spawning,
    Configuring,
    Active,
    Scaling,
    Deleting,
    Deleted,
    Error,
}

impl ClusterStatus {
    /// Once a user asked for deletion nothing may bring the cluster back.
    pub fn is_terminal(self) -> bool {
        matches!(self, ClusterStatus::Deleting | ClusterStatus::Deleted)
    }
}

/// A node group as requested: how many nodes of which flavour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeGroupSpec {
    pub name: String,
    pub count: u32,
    pub flavor: String,
    /// Resources each node claims, by resource class (VCPU, MEMORY_MB, DISK_GB, ...).
    pub resources: BTreeMap<String, u64>,
    /// Processes the node runs (e.g. "datanode"): decides whether a node holds data.
    pub processes: Vec<String>,
}

/// The desired size of one node group in a scale request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct NodeGroupTarget {
    pub name: String,
    pub count: u32,
}
