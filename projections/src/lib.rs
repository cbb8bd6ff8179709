//! provledger-projections owns the pure folds from commits to current state: clusters,
//! instances, providers with their allocations, and operations (`Entity`, `Projection`),
//! their JSON views (the contract's entity forms), and the timeline rendering.
//!
//! Projections never perform IO, never read the clock and never panic on an event that
//! makes no sense: such an event is kept as an anomaly on the entity. Storing entities,
//! checkpoints and the sled copy of the log is the projector's job (`provledger-serve`'s `Projector`).

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
