//! The keys of an effect's `detail` and a compensation's `args` that provledger itself
//! reads or writes. A service writes them as strings in JSON; inside provledger they are
//! named here once, so the planner, the rollback driver and the reference flows cannot
//! drift apart on a spelling (docs/writing-operations.md, section 5, lists each).

/// A key of `detail` or `args` with a meaning to provledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DetailKey {
    /// The provider holding a node's or an instance's allocation: the planner plans a
    /// `release_allocation` with it; the driver releases there.
    ProviderId,
    /// The cluster a node belongs to; copied into a planned `terminate_vm`.
    ClusterId,
    /// The node group a node belongs to; copied into a planned `terminate_vm`.
    NodeGroup,
    /// The node a resource belongs to (an IP or a DNS name does not say).
    Node,
    /// A decommissioned node's removal list (a JSON array of compensations).
    Removal,
    /// The action word of a removal entry already removed forward.
    Action,
    /// The service that terminates a node's VM (default `hypervisor`).
    TerminateExecutor,
    /// An IP, for people and tools.
    Ip,
    /// The key a step's action was asked for under (`StepStarted`): an executor undoes,
    /// by this key, what it did for a step whose outcome the ledger never learnt.
    IdempotencyKey,
    /// The migration (its operation's id) whose source a `return_to_source` gives back;
    /// by default the operation rolled back.
    MigrationId,
}

impl DetailKey {
    pub const ALL: [DetailKey; 10] = [
        DetailKey::ProviderId,
        DetailKey::ClusterId,
        DetailKey::NodeGroup,
        DetailKey::Node,
        DetailKey::Removal,
        DetailKey::Action,
        DetailKey::TerminateExecutor,
        DetailKey::Ip,
        DetailKey::IdempotencyKey,
        DetailKey::MigrationId,
    ];

    /// The key as written in `detail` and `args`.
    pub const fn as_str(self) -> &'static str {
        match self {
            DetailKey::ProviderId => "provider_id",
            DetailKey::ClusterId => "cluster_id",
            DetailKey::NodeGroup => "node_group",
            DetailKey::Node => "node",
            DetailKey::Removal => "removal",
            DetailKey::Action => "action",
            DetailKey::TerminateExecutor => "terminate_executor",
            DetailKey::Ip => "ip",
            DetailKey::IdempotencyKey => "idempotency_key",
            DetailKey::MigrationId => "migration_id",
        }
    }
}

impl std::fmt::Display for DetailKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
