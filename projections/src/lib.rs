//! provledger-projections owns the pure folds from commits to current state: clusters,
//! instances, providers with their allocations, and operations (`Entity`, `Projection`),
//! their JSON views (the contract's entity forms), and the timeline rendering.
//!
//! Projections never perform IO, never read the clock and never panic on an event that
//! makes no sense: such an event is kept as an anomaly on the entity. Storing entities,
//! checkpoints and the sled copy of the log is the projector's job (`provledger-serve`'s `Projector`).
//!
//! # Modules
//! - One fold per entity kind: `cluster.rs`, `instance.rs`, `provider.rs` (inventories,
//!   allocations by consumer, usage against capacity), `operation.rs` (stages, steps with
//!   effects and compensations, plan progress). A fold answers `Folded` per event
//!   (`entity.rs`): applied, applied with an anomaly (a fact about the world, an effect or
//!   changed hardware, is applied anyway so that nothing real is forgotten), or refused (an
//!   impossible transition, not applied); both of the last two are kept as anomalies.
//! - `projection.rs`: `Entity` (each state boxed; version bookkeeping, anomalies for gaps,
//!   replays and foreign commits) and `Projection` (all entities, `rebuild`, `summary`).
//!   `resource_map.rs`'s `ResourceMap` holds resources by class.
//! - `view.rs`: the contract's JSON forms as types (`ClusterView`, ..., `EntityView`), from
//!   which the published JSON Schemas are derived.
//! - `decide.rs`: the append decider every write path asks (idempotent delete, terminal
//!   deletion, the lease protocol on task events, and a trial fold: a commit with an event
//!   the fold refuses is refused with the fold's reason).
//! - `stages.rs` (each operation kind's stages and policies), `planner.rs` (the rollback
//!   planner: `plan_rollback`, `render_plan`, deterministic v5 compensation ids),
//!   `rollback.rs` (the driver's decider: `next_rollback_action`, `RetryPolicy`). Plans are
//!   pinned by snapshot tests (`tests/snapshots/`).
//! - `recovery.rs`: the stuck-state recovery rules (leases tell "queued" from
//!   "interrupted"; one rule per task state) and when a pending re-issue is due;
//!   `lease.rs`: the lease bounds the decider enforces and who a caller is as a worker.
//! - `facts.rs`: facts decided from state, returning the events to record, so the shell
//!   composes none (a rollback's outcome on its target, everything one recovery records,
//!   a migration's source given back, the next commit of a provider's delete, a terminated
//!   VM's record, a deletion's completion).
//! - `placement.rs`: why each allocation pins its provider, which are orphans, and what
//!   heal-allocations would claim, from the entities it walks (never a whole `Projection`).
//! - `drift/`: drift's pure core: what the ledger says each executor holds (`ledger.rs`),
//!   the log folded a commit at a time (`fold.rs`'s `DriftFold`), the comparison with an
//!   inventory (leaked, missing, mismatched), and `leak_removal.rs`, the one commit of a
//!   `remove_leaked` operation.
//! - `audit.rs`: the audit's pure core (`Auditor`: positions, chains, losses, quarantine,
//!   invariants). `timeline.rs`: one line of text per event, for `history` and the console.

pub mod audit;
pub mod cluster;
pub mod decide;
pub mod drift;
pub mod entity;
pub mod facts;
pub mod instance;
pub mod leak_removal;
pub mod lease;
pub mod operation;
pub mod placement;
pub mod planner;
pub mod projection;
pub mod provider;
pub mod recovery;
pub mod resource_map;
pub mod rollback;
pub mod stages;
pub mod timeline;
pub mod view;

pub use entity::{Anomaly, Header};
pub use projection::{DeletionState, Entity, Projection, Summary};
pub use resource_map::ResourceMap;
