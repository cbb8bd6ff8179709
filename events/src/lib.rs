//! provledger-events owns the wire contract and the log: the event catalogue, the commit
//! envelope and its per-aggregate hash chain, the one codec, and the `EventLog` API with
//! its two backends (`SledLog`, `JetStreamLog`).
//!
//! It never interprets events (that is `provledger-projections`), never decides whether a
//! command is allowed (deciders live above it), and never reads the clock inside pure code:
//! time and ids come in with the `CommitDraft`.
//!
//! # Modules
//! - `backup.rs`: a backup's format (`stream.bin` frames, `manifest.json`), the fold that
//!   builds a manifest from the stream's messages in order, and the check of a backup's
//!   content against it (pure: the shell reads the stream and the files).
//! - `catalogue/`: the `Event` enum (one place, append-only, documented in
//!   `docs/events.md`) and its value types per aggregate kind; `samples.rs` has one example
//!   per event for the golden tests, `constructors.rs` the constructors through which the
//!   client records what a caller did (a stage, a step, a lease, a re-issue attempt).
//! - `ids.rs`: `AggregateId`, `Timestamp` (injected, ms), `Hash`, and `InvalidText`, the
//!   parse error of each.
//! - `commit.rs`: the envelope, `CommitDraft` (what writers submit), sealing and
//!   `verify_chain`.
//! - `trace.rs`: `TraceContext`, the W3C trace a commit records it was written in (format
//!   3), with the one `traceparent` grammar.
//! - `loss.rs`: tells a lost commit from a forged one (an intact commit past the chain's
//!   next version), the one write an aggregate with an open loss accepts (its
//!   `loss_acknowledged`), and `HeldChains`, what a reader in log order keeps past a loss.
//! - `codec/`: the only place that turns commits into bytes (format byte + bincode 2):
//!   `envelope.rs`, the body that both the encoder and the hash read, for formats 1 and 2;
//!   `stored.rs`, events as stored (layout version and bytes) and how they are read.
//! - `catalogue/versions.rs`: each event's layout version and the upcasters of its old
//!   layouts (docs/events.md, "How to change an event").
//! - `catalogue/golden_log.rs` (hidden, for tests): reads the golden logs, the streams of
//!   commits kept in `tests/golden/log/` that every build must decode, verify and fold as
//!   the build that wrote them did (docs/events.md, "The golden log"), and pins each file.
//! - `log/`: the `EventLog` trait (storage only: the write path's turns and known states
//!   live in the client's `Writer`); `sled_log.rs`, `jetstream_log.rs` and `mem_log.rs` (in
//!   memory, with seeded fault injection, for the simulation; it passes the same
//!   conformance suite). `group_commit.rs` is the group commit of atomic sets: the
//!   `append_atomic` calls one handle gets at once are written as one backend write (one
//!   JetStream atomic batch of up to 1,000 messages, one sled batch), each set answered on
//!   its own (a set refused for its expectations is refused alone; a batch the server
//!   refuses is split). `direct.rs` reads JetStream by batch direct get (no consumer);
//!   `raw.rs` reads the stream's messages as stored (a backup) and publishes a restore into
//!   an empty stream at the same positions. A log
//!   reads an aggregate whole, or only after a chain tip (`read_aggregate_after`), and finds
//!   a commit id (`find_commit`: sled's index, a time-bounded JetStream scan).

pub mod backup;
pub mod catalogue;
pub mod codec;
pub mod commit;
pub mod ids;
pub mod log;
pub mod loss;
pub mod trace;

pub use catalogue::Event;
pub use commit::{
    check_chain, verify_chain, ChainViolation, Commit, CommitDraft, IntegrityError, InvalidCommit,
};
pub use ids::{
    short_aggregate, short_id, AggregateId, AggregateKind, AggregateRef, Hash, IdRef, Timestamp,
    ID_REF_HEX_DIGITS_MIN,
};
pub use log::{
    AppendError, AppendOutcome, AppendStatus, AtomicItem, ChainTip, CommitStream, EventLog,
    Expectation, GroupStats, HistoryEntry, InvalidBatch, JetStreamConfig, JetStreamLog, MemLog,
    ReadError, SledLog, VersionConflict, ATOMIC_COMMITS_MAX, GROUP_COMMITTERS_MAX,
    GROUP_MESSAGES_MAX,
};
pub use loss::{HeldChain, HeldChains, HeldStep, LossRefusal, LostVersions, OpenLosses, Passage};
pub use trace::TraceContext;
