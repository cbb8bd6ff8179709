//! provledger-sim: everything that stands in for the real world.
//!
//! It owns:
//! - the simulated executors (`executors`): IPAM, DHCP, DNS, a hypervisor and a cluster
//!   plugin that really keep their resources in memory, carry out compensations
//!   idempotently, can be told to fail a chosen call, and can answer compensation
//!   requests over NATS like a real owning service;
//! - the reference provisioning flows (`flows`): Sahara's create, scale and delete of a
//!   cluster, Nova's boot and delete of an instance, and a bundle, written against the
//!   client library's port the way a provisioning service would write them;
//! - the demo scenarios (`demo`) that `provledger demo` runs and prints, and the benches
//!   that need flows and executors;
//! - the seeded simulation (`simulation`): many operations under a fault-injecting log,
//!   faulty executors, racing deletes and racing drivers, replayable from its seed, with
//!   the invariants checked after each run.
//!
//! Nothing in `provledger-client` or `provledger-serve` depends on this crate; it is never
//! linked into a provisioning service. The flows contain no rollback code: error handling
//! lives in the client library's operation runner.

pub mod demo;
mod executors;
mod flows;
pub mod simulation;

pub use executors::{SimExecutor, SimInfrastructure, DHCP, DNS, HYPERVISOR, IPAM, PLUGIN};
pub use flows::{
    register_compute_node, register_compute_node_stamped, ClusterRequest, DeleteReport,
    InstanceRequest, Provisioner,
};
