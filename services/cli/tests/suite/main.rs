//! The `provledger` command's integration tests, one test binary with a module per file
//! (one link instead of one per file: the suite's build time was mostly linking), run
//! against real nats-servers, serve processes and sled data dirs. `common` holds what they
//! share. Run one file's tests with `cargo test -p provledger --features demo --test suite
//! <module>::`.

mod common;

mod auth;
mod backup;
mod bootstrap;
mod changes;
mod cli;
mod cluster;
mod console;
mod copy_restore;
mod demo;
mod docs_examples;
mod drift;
mod follow;
mod log_copy;
mod lost_commit;
mod messages;
mod no_traps;
mod operation_cancel;
mod operator;
mod otlp;
mod permissions;
mod placement;
mod python_follower;
mod recover;
mod rollback_serve;
mod runner_lease;
mod schema_replies;
mod serve;
mod short_ids;
mod suggestions;
mod watch;
mod write_boundary;
