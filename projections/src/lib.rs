//! provledger-projections owns the pure folds from commits to current state: clusters,
//! instances, providers with allocations, and operations (issue 3 grows them), and later
//! the rollback planner.
//!
//! Projections never perform IO, never read the clock and never panic on an event that
//! makes no sense: such an event is kept as an anomaly on the entity.

pub mod timeline;
