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
//!
//! # Modules
//! - `store.rs`: the projection store, one sled tree `projection`: the copy of the log
//!   (`c`) and the per-aggregate history index (`h`) where the store copies the log
//!   (embedded; serve's does not: `copies_log`; its copy is `log_copy.rs`'s tree, which
//!   the store's history readers read too), entities (`e`), allocations by consumer
//!   (`b`), the quarantine (`q`), the time watermark index (`w`), snapshots (`s`, marker
//!   `S`), the operation indexes (`o`, `O`, `k`, `t`, `n`), losses held (`l`) and metadata
//!   (`m`: checkpoint, source). It is the `StateView` of serve's placement commands and
//!   recovery sweep.
//! - `log_copy.rs`: serve's copy of the stream (issue 39), in the sled tree `log_copy`
//!   of the data dir: the commits the projector applied, handed over a bounded queue
//!   (never waited for) and written by the copier on its own thread, chain-checked per
//!   aggregate, with what was dropped or missed read back from the stream; `--no-log-copy`
//!   removes it. Offline `history`, `state --at` and `audit` read it. Its commits are kept
//!   in packs of up to 64 under one key (`log_copy/pack.rs`: the layout and its reader).
//! - `copy_backup.rs`: `backup --from-copy`: an ordinary backup written from a stopped
//!   replica's copy, each commit checked (decodes, hash, bytes, chain) and given the
//!   subject and `Nats-Msg-Id` its writer gave it; what the copy lacks becomes holes.
//! - `handoff.rs`: the queue from the projector to the feed and to the copier, bounded in
//!   batches and in commits, never waited for; one piece for both.
//! - `projector.rs`: the `Projector` folds batches (at most `BATCH_ENTRIES_MAX`) with an
//!   entity cache and writes each with one `apply_batch`; under load it gathers entries for
//!   up to `GROUP_COMMIT_LINGER`, because sled's cost per commit falls steeply with the
//!   batch. It tells the rollback worker what changed (`Touched`, at most `TOUCHED_MAX`).
//! - `service.rs`: `run` wires the replica (data dir and bootstrap, the projector on a
//!   thread of its own, the HTTP listeners, catch-up, the workers and sweeps, the queue
//!   group, the request loop) and drains it in reverse order on SIGINT/SIGTERM.
//! - `replica.rs`: the replica's shared state (`QueryContext`: store, log and `Writer`,
//!   readiness, metrics, workers ready, the last drift sweep and audit), which the
//!   endpoints, the console, the metrics and the sweeps read; it depends on none of them.
//! - `endpoints/`: the contract's queries, one file per group (health, entities,
//!   allocation, history and state_at, cmd.append, placement), the request parsing in its
//!   own file. `messages.rs` (depending on nothing of `endpoints/`) holds every request,
//!   reply, error code and error as types; `tests/schemas.rs` generates `docs/schemas/` and
//!   `docs/asyncapi.json` from them and validates every JSON example in `docs/`.
//! - `rollback_worker.rs` drives every stopped operation's rollback and advances
//!   deletions, racing other replicas safely; `recovery_loop.rs` runs the client's recovery
//!   round on start and every `--recovery-interval`, and delivers re-issues in between.
//! - `metrics.rs`: the Prometheus registry and `/metrics`, `/health`; it only reads.
//! - `bootstrap.rs`: snapshots published for new replicas and the bootstrap from one: the
//!   head checked (`check_head`, pure), the body imported unfinished while the chain tips
//!   are checked (`check_tips`, pure) and sampled against the stream by direct get, then
//!   finished; a refusal is abandoned and the replica catches up from position 1.
//! - `drift_sweep.rs` (`--drift-interval`) and `audit.rs` (`audit_log`, and serve's own
//!   `--audit-interval`): they only read.
//! - `http.rs`: both HTTP listeners on hyper, with a connection cap per listener, a header
//!   read timeout and a bounded drain. `trace.rs` reads a request's `traceparent`;
//!   `otlp.rs` exports spans over OTLP/HTTP when configured (`--otlp-endpoint`).
//! - `console/`: the operator's console (docs/console.md), GET routes only. `html.rs` owns
//!   markup: `Html` can only be made by escaping text, from markup in the source, or by
//!   joining markup, and `html!` renders each argument by its type, so a page cannot show
//!   a value unescaped (`tests/tests/console_markup.rs` checks the source). `pages.rs` and
//!   `plan.rs` (the rollback plan as SVG) are pure renderers; `mod.rs` reads, bounds
//!   (pages, requests in flight, live connections) and serves `/events`.

mod audit;
pub mod bootstrap;
mod console;
pub mod copy_backup;
pub mod drift_sweep;
mod endpoints;
pub mod feed;
pub mod handoff;
mod http;
pub mod log_copy;
pub mod messages;
mod metrics;
pub mod otlp;
mod projector;
mod recovery_loop;
mod replica;
mod rollback_worker;
mod scrape;
mod service;
mod store;
mod trace;

pub use audit::{audit_copy, audit_log, AuditError};
pub use console::{
    ALLOCATIONS_SHOWN_MAX, ATTENTION_SHOWN_MAX, CHAINS_KEPT_MAX, HISTORY_PAGE, LIST_SCAN_MAX,
    LIVE_CONNECTIONS_MAX, LIVE_EVENT_SPACING, OPERATIONS_PAGE, OPERATIONS_PAGE_MAX,
    QUARANTINE_SHOWN_MAX, REQUESTS_MAX, VIOLATIONS_SHOWN_MAX,
};
pub use endpoints::endpoint_subjects;
pub use otlp::{OtlpError, OtlpOptions};
pub use projector::{
    BatchOutcome, OnChainViolation, Projector, ProjectorError, Touched, BATCH_ENTRIES_MAX,
    GROUP_COMMIT_LINGER, SNAPSHOT_EVERY_POSITIONS_DEFAULT, TOUCHED_MAX,
};
pub use replica::{LastAudit, LastAudits, AUDIT_VIOLATIONS_KEPT};
pub use service::{open_service_store, run, ServeError, ServeOptions, QUEUE_GROUP, SERVICE_NAME};
pub use store::{
    decode_entity, encode_entity, HistoryCopy, IdMatches, OperationFilter, ProjectionStore,
    QuarantineRecord, RawCommits, StoreError, ENTITY_FORMAT, ID_MATCHES_MAX,
};
