//! provledger-client: the library a provisioning service links.
//!
//! It owns:
//! - [`Ledger`]: the configured event log (embedded sled, or JetStream when a NATS URL is
//!   given) behind one `EventLog`; storage only;
//! - [`write`]: the one write path, [`Writer`]: a process's turns per aggregate and what it
//!   knows of each (an aggregate's current state, folded from the log itself, is
//!   [`Writer::read_current`]); read, decide with the pure append decider, append at
//!   exactly that version;
//! - [`OperationRunner`]: the one entry point through which a service runs an operation.
//!   It records the start, each stage and step with its effect and compensation, and
//!   catches every error, panic and cancellation in one place (Sahara's problems 1 and 2);
//! - [`RollbackDriver`]: carries out a stopped operation's rollback plan, deciding with
//!   expected versions so that racing drivers agree;
//! - [`deletion`]: deletion as an event (request, notice to the operation in flight,
//!   `deleted`), and [`CancelNotices`], the cancel notices on NATS or in process;
//! - the executor port: [`Infrastructure`] (forward actions) and [`CompensationExecutor`]
//!   (compensations), with [`NatsExecutors`], the NATS transport of compensations;
//! - [`inventory`]: the inventory protocol's client (an executor's resources, page by
//!   page, for drift);
//! - [`placement`]: deleting a resource provider without orphaning an allocation (refusal
//!   listing each consumer, or a crash-safe cascade), heal-allocations and orphan release;
//! - [`recovery`]: the stuck-state recovery sweep (the pure rules applied, recorded once at
//!   exact versions, re-issues to the owning worker over NATS);
//! - [`view`]: [`view::StateView`], the current state placement and recovery decide from
//!   (the log folded by [`view::LogView`], or a projection store), which only tells what to
//!   try: writes are still decided against the log;
//! - [`Stamper`]: the injected clock and id source every draft is stamped with.
//!
//! It never depends on the simulator (`provledger-sim`), the projection store or the CLI,
//! and it never decides rollback plans itself: the planner and the deciders are pure
//! functions in `provledger-projections`; this crate does the IO around them.
//!
//! # Modules
//! - `ledger.rs`: `Ledger` (the configured backend behind one `EventLog`) and
//!   `open_jetstream`.
//! - `write/`: the one write path. `Writer` (one per process and log; clones share it) owns,
//!   per aggregate, a turn and what is known of it (`turns.rs`, `known.rs`: entity, chain
//!   tip, ids of the last 256 commits). `record`, `record_fact` and `record_atomic` run the
//!   same rounds (`Attempts`: refresh what is stale by reading only what is newer, recognise
//!   a retry, decide, append at exactly the version decided on, classify the answer; a
//!   bounded re-decide); they differ only in one append or one atomic append, and in how a
//!   refusal is named.
//! - `runner.rs`: the `OperationRunner` (`OperationCtx`, `OperationError`). A step whose
//!   effect is a commit on another aggregate (a claim) is written with its record in one
//!   atomic set (`step_recording`; `OperationCtx::claim`).
//! - `driver.rs`: the `RollbackDriver`, the shell around the pure planner and decider.
//! - `deletion.rs` (the deletion steps), `cancel.rs` (cancel notices, NATS or in process),
//!   `allocation.rs` (an allocation released at the provider's exact version).
//! - `port.rs` (`Infrastructure`: forward actions) and `executors.rs` (the compensation
//!   side: `CompensationExecutor`, the request/reply JSON, `NatsExecutors`). Every port
//!   answers `PeerError`: unreachable, refused with the peer's reason, or a reply that is
//!   not the protocol's.
//! - `inventory.rs`: the inventory protocol's client (page by page, bounded, a malformed
//!   reply a typed error), `compare_inventory`, which `provledger drift` and serve's sweep
//!   share, and `fold_log`, the shell around the pure `DriftFold`.
//! - `recovery.rs`: the recovery round (`recovery_round`: the sweep, and the provider
//!   deletes a crash left half done finished; serve and `recover` both run it), the sweep
//!   (each recovery recorded once at the instance's exact version, its re-issue pending in
//!   the same commit) and the re-issue delivery (each attempt recorded, retried with backoff
//!   until the worker acknowledges, at most 4 in flight per worker). `lease.rs` is a
//!   worker's `TaskLease`.
//! - `placement.rs`: provider registration and inventory; provider delete (refusal or
//!   crash-safe cascade); heal-allocations, each claim atomic with the instance's version;
//!   orphan release.
//! - `view.rs`: `StateView`; `LogView` folds the log (CLI, library), serve's store reads
//!   sled, so no request path folds the log.
//! - `backup.rs`: `provledger backup` and `restore`, the shell around
//!   `provledger_events::backup`: the stream read at one position into `stream.bin` and
//!   `manifest.json` (each written to a `.partial` name, synced, renamed), the backup
//!   checked before anything is published, published into an empty stream at the same
//!   positions, and read back.
//! - `clock.rs`: `Stamper` (`SystemClock`/`RandomIds` in services, `SeededIds` in the demo),
//!   the one place that calls `Timestamp::now` and `Uuid::now_v7`.

mod allocation;
pub mod backup;
mod cancel;
mod clock;
pub mod deletion;
pub mod denials;
mod driver;
mod executors;
pub mod follow;
pub mod inventory;
mod lease;
mod ledger;
pub mod placement;
mod port;
pub mod recovery;
mod runner;
pub mod view;
pub mod write;

pub use allocation::release_allocation;
pub use cancel::CancelNotices;
pub use clock::{Clock, IdSource, RandomIds, SeededIds, Stamper, SystemClock};
pub use driver::{
    plan_for, read_operation, record_leak_removal, resolve_compensation, resume_needs_attention,
    DriveError, RollbackDriver,
};
pub use executors::{
    CompensationExecutor, CompensationFuture, CompensationReply, CompensationRequest,
    NatsExecutors, PeerError, RequestTrace,
};
pub use lease::TaskLease;
pub use ledger::{
    connect_nats, derived_commit_id, open_jetstream, parse_nats_urls, redacted_nats_url, Ledger,
    LedgerOptions, NatsAuth, OpenLedgerError,
};
pub use port::{ActionFuture, Infrastructure};
pub use runner::{
    idempotency_key, ActOutput, OperationCtx, OperationError, OperationRunner, OperationSpec,
    RunReport, StepError, StepHook, StepOutput,
};
pub use write::Writer;
