//! provledger-projections' integration tests (the pure core: folds, deciders, the planner,
//! recovery rules, facts, placement, drift), one test binary with a module per file (one
//! link instead of one per file). Run one file's tests with
//! `cargo test -p provledger-projections --test suite <module>::`.
mod audit;
mod boot_rollback;
mod cancellation;
mod decide;
mod drift;
mod facts;
mod fold;
mod golden_log;
mod placement;
mod planner;
mod recovery;
