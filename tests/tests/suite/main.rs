//! The workspace-level tests (conformance of the log backends, the deployed configuration,
//! a NATS cluster, source checks), one test binary with a module per file (one link instead
//! of one per file). Run one file's tests with `cargo test -p provledger-tests --test suite
//! <module>::`.
mod cluster;
mod conformance;
mod console_markup;
mod deployed_single;
mod signatures;
