//! provledger-events owns the wire contract and the log: the event catalogue, the commit
//! envelope and its per-aggregate hash chain, the one codec, and the `EventLog` API with
//! its two backends (`SledLog`, `JetStreamLog`).
//!
//! It never interprets events (that is `provledger-projections`), never decides whether a
//! command is allowed (deciders live above it), and never reads the clock inside pure code:
//! time and ids come in with the `CommitDraft`.

pub mod catalogue;
pub mod codec;
pub mod commit;
pub mod ids;
pub mod log;
pub mod loss;

pub use catalogue::Event;
pub use commit::{
    check_chain, verify_chain, ChainViolation, Commit, CommitDraft, IntegrityError, InvalidCommit,
};
pub use ids::{short_aggregate, short_id, AggregateId, AggregateKind, Hash, Timestamp};
pub use log::{
    AppendError, AppendOutcome, AppendStatus, AtomicItem, ChainTip, CommitStream, EventLog,
    Expectation, GroupStats, HistoryEntry, InvalidBatch, JetStreamConfig, JetStreamLog, MemLog,
    ReadError, SledLog, VersionConflict, ATOMIC_COMMITS_MAX, GROUP_COMMITTERS_MAX,
    GROUP_MESSAGES_MAX,
};
pub use loss::{HeldChain, HeldChains, HeldStep, LossRefusal, LostVersions, OpenLosses, Passage};
