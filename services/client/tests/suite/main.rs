//! provledger-client's integration tests (the write path, leases, placement, inventory,
//! the pure-core rule), one test binary with a module per file. Run one file's tests with
//! `cargo test -p provledger-client --test suite <module>::`.
mod drift_fold;
mod folded_head;
mod inventory;
mod lease;
mod placement;
mod pure_core;
mod reissue_race;
mod runner_lease;
mod write;
