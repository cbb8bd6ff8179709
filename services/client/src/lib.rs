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

mod allocation;
mod cancel;
mod clock;
pub mod deletion;
pub mod denials;
mod driver;
mod executors;
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
    NatsExecutors, PeerError,
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
