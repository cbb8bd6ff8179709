//! provledger-serve: the read side and `provledger serve`.
//!
//! It owns:
//! - the projection store (`store`): one sled tree holding the copy of the log, the
//!   projected entities, their indexes, the quarantine, the time index, the snapshots and
//!   the checkpoint, each batch written atomically;
//! - the [`Projector`]: follows the log from the store's checkpoint and folds it into the
//!   store (a rebuild from position 0 equals the incremental state);
//! - the query and command endpoints (`endpoints/`, one file per group), answering the
//!   contract's `provledger.q.*` and `provledger.cmd.append` as the NATS micro service
//!   `provledger` ([`run`]);
//! - serve's rollback and deletion worker (`rollback_worker`), which drives stopped
//!   operations' rollbacks with the client library's driver;
//! - the audit's shell ([`audit_log`]): the whole log through the pure auditor, and the
//!   store's copy compared with the log;
//! - the drift sweep (`drift_sweep`, `--drift-interval`): the executors' inventories
//!   against the store's operations, kept for `q.drift` and the metrics; it writes nothing;
//! - the operator's console (`console`, `--http`): read-only HTML pages over the store
//!   and the stream, live through server-sent events;
//! - snapshots published for new replicas and a new replica's bootstrap from one
//!   (`bootstrap`, `--snapshot-bucket`): checked by hash and against the stream's chain
//!   tips before anything is written.
//!
//! It never depends on the simulator or the CLI, never writes to the log except through
//! `EventLog::append` (in `cmd.append` and through the client library's driver and
//! deletion steps), and its queries only read the store: the projector is the store's
//! one writer.

mod audit;
pub mod bootstrap;
mod console;
pub mod drift_sweep;
mod endpoints;
mod http;
pub mod messages;
mod metrics;
mod projector;
mod recovery_loop;
mod replica;
mod rollback_worker;
mod service;
mod store;
mod trace;

pub use audit::{audit_log, AuditError, LastAudit, LastAudits, AUDIT_VIOLATIONS_KEPT};
pub use console::{
    ALLOCATIONS_SHOWN_MAX, ATTENTION_SHOWN_MAX, CHAINS_KEPT_MAX, HISTORY_PAGE, LIST_SCAN_MAX,
    LIVE_CONNECTIONS_MAX, LIVE_EVENT_SPACING, OPERATIONS_PAGE, OPERATIONS_PAGE_MAX,
    QUARANTINE_SHOWN_MAX, REQUESTS_MAX, VIOLATIONS_SHOWN_MAX,
};
pub use endpoints::endpoint_subjects;
pub use projector::{
    BatchOutcome, OnChainViolation, Projector, ProjectorError, Touched, BATCH_ENTRIES_MAX,
    GROUP_COMMIT_LINGER, SNAPSHOT_EVERY_POSITIONS_DEFAULT, TOUCHED_MAX,
};
pub use service::{open_service_store, run, ServeError, ServeOptions, QUEUE_GROUP, SERVICE_NAME};
pub use store::{
    decode_entity, encode_entity, OperationFilter, ProjectionStore, QuarantineRecord, StoreError,
    ENTITY_FORMAT,
};
