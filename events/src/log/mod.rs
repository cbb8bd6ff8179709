//! The `EventLog` API and its two backends: embedded [`SledLog`] and distributed
//! [`JetStreamLog`]. Both pass the same conformance suite (`tests/tests/conformance.rs`).
//!
//! Only this module writes to the log. Everything above it sees commits, never bytes.

mod direct;
pub mod group_commit;
pub mod jetstream_log;
pub mod mem_log;
pub mod raw;
pub mod sled_log;

use std::fmt;
use std::future::Future;
use std::str::FromStr;

use futures::stream::BoxStream;
use uuid::Uuid;

use crate::codec::{DecodeError, EncodeError};
use crate::commit::{Commit, CommitDraft, InvalidCommit};
use crate::ids::AggregateId;

pub use group_commit::{GroupCommit, GroupStats, GROUP_COMMITTERS_MAX, GROUP_MESSAGES_MAX};
pub use jetstream_log::{
    message_id, parse_server_version, subject_for, JetStreamConfig, JetStreamLog, MissingStream,
    OpenJetStreamError, SERVER_VERSION_MIN,
};
pub use mem_log::{FaultCounts, FaultPlan, MemLog};
pub use raw::{RestoreStreamError, RestoreTarget, StreamBounds, RESTORE_WINDOW};
pub use sled_log::{OpenSledError, SledLog};

/// What the writer believes the aggregate's version to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expectation {
    /// No check: append after whatever is there.
    Any,
    /// The aggregate must have no commit yet.
    NoStream,
    /// The aggregate's current version must be exactly this (its number of commits).
    Exactly(u64),
}

impl Expectation {
    pub fn admits(self, current_version: u64) -> bool {
        match self {
            Expectation::Any => true,
            Expectation::NoStream => current_version == 0,
            Expectation::Exactly(v) => current_version == v,
        }
    }
}

impl fmt::Display for Expectation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expectation::Any => f.write_str("any"),
            Expectation::NoStream => f.write_str("none"),
            Expectation::Exactly(v) => write!(f, "{v}"),
        }
    }
}

impl FromStr for Expectation {
    type Err = crate::ids::InvalidText;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "any" => Ok(Expectation::Any),
            "none" => Ok(Expectation::NoStream),
            n => n
                .parse::<u64>()
                .map(Expectation::Exactly)
                .map_err(|e| crate::ids::InvalidText {
                    what: "an expectation (\"any\", \"none\" or a version number)",
                    text: s.to_string(),
                    reason: e.to_string(),
                }),
        }
    }
}

/// Whether an append wrote a new commit or recognised a retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendStatus {
    Appended,
    /// The same commit_id with the same payload was already in the log; nothing was written.
    AlreadyAppended,
}

/// The durable result of an append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOutcome {
    pub position: u64,
    pub version: u64,
    pub status: AppendStatus,
}

/// Most commits one atomic append may carry. JetStream takes up to 1,000 messages in an
/// atomic batch; facts that move together are a handful (a claim and its step, a
/// migration's moves, a cascade), and a bound keeps one request's cost known.
pub const ATOMIC_COMMITS_MAX: usize = 100;

/// One commit of an atomic append: `draft` on `aggregate`, if `expect` admits the
/// aggregate's version when the whole batch is written.
#[derive(Debug, Clone)]
pub struct AtomicItem {
    pub aggregate: AggregateId,
    pub expect: Expectation,
    pub draft: CommitDraft,
}

/// One aggregate whose expectation an atomic append did not meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VersionConflict {
    pub aggregate: AggregateId,
    pub expected: Expectation,
    pub actual: u64,
}

impl fmt::Display for VersionConflict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} expected version {}, actual version is {}",
            self.aggregate, self.expected, self.actual
        )
    }
}

/// Why a set of commits cannot be one atomic append, before anything is tried.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidBatch {
    #[error("an atomic append needs at least one commit")]
    Empty,
    #[error("an atomic append holds at most {max} commits, this one has {count}")]
    TooManyCommits { count: usize, max: usize },
    #[error(
        "{aggregate} appears more than once in one atomic append (put its events in one commit)"
    )]
    AggregateTwice { aggregate: AggregateId },
    #[error("commit id {commit_id} appears more than once in one atomic append")]
    CommitIdTwice { commit_id: Uuid },
}

/// Checks what can be checked of an atomic batch without the log: each commit (its
/// aggregate and draft) valid, 1 to [`ATOMIC_COMMITS_MAX`] of them, no aggregate and no
/// commit id twice.
pub fn validate_batch<'a>(
    commits: impl ExactSizeIterator<Item = (AggregateId, &'a CommitDraft)>,
) -> Result<(), AppendError> {
    let count = commits.len();
    if count == 0 {
        return Err(InvalidBatch::Empty.into());
    }
    if count > ATOMIC_COMMITS_MAX {
        return Err(InvalidBatch::TooManyCommits {
            count,
            max: ATOMIC_COMMITS_MAX,
        }
        .into());
    }
    let mut aggregates = std::collections::HashSet::new();
    let mut ids = std::collections::HashSet::new();
    for (aggregate, draft) in commits {
        draft.validate(&aggregate)?;
        if !aggregates.insert(aggregate) {
            return Err(InvalidBatch::AggregateTwice { aggregate }.into());
        }
        if !ids.insert(draft.commit_id) {
            return Err(InvalidBatch::CommitIdTwice {
                commit_id: draft.commit_id,
            }
            .into());
        }
    }
    Ok(())
}

impl Commit {
    /// The retry rule, the one place it is written: a draft whose commit id is already this
    /// commit's is the same append again (answered `AlreadyAppended` at this commit's
    /// position and version, nothing written) if it is on the same aggregate with the same
    /// payload; otherwise it reuses the id.
    pub fn retry_outcome(
        &self,
        aggregate: AggregateId,
        draft: &CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        debug_assert_eq!(self.commit_id, draft.commit_id);
        if self.aggregate == aggregate && self.same_payload_as(draft) {
            return Ok(AppendOutcome {
                position: self.position,
                version: self.version,
                status: AppendStatus::AlreadyAppended,
            });
        }
        Err(AppendError::CommitIdReused {
            commit_id: draft.commit_id,
            position: self.position,
        })
    }
}

/// The answer to an atomic batch some of whose commit ids are already in the log, from
/// what each lookup found (`None`: not there). The same batch again is recognised, each
/// commit `AlreadyAppended`; anything else reused an id.
pub fn recognise_batch_retry(
    items: &[AtomicItem],
    found: &[Option<Commit>],
) -> Result<Vec<AppendOutcome>, AppendError> {
    let mut outcomes = Vec::with_capacity(items.len());
    for (item, earlier) in items.iter().zip(found) {
        match earlier {
            Some(c) => outcomes.push(c.retry_outcome(item.aggregate, &item.draft)?),
            None => {
                // Part of the batch is in the log and part is not: the ids found were
                // written by another append, so this batch reuses them.
                let position = found.iter().flatten().map(|c| c.position).next();
                let commit_id = items
                    .iter()
                    .zip(found)
                    .find(|(_, f)| f.is_some())
                    .map(|(i, _)| i.draft.commit_id);
                return match (commit_id, position) {
                    (Some(commit_id), Some(position)) => Err(AppendError::CommitIdReused {
                        commit_id,
                        position,
                    }),
                    _ => Err(AppendError::Unavailable {
                        reason: "the log reported a duplicate commit id that no read finds; retry"
                            .into(),
                    }),
                };
            }
        }
    }
    Ok(outcomes)
}

/// A sealed commit's bytes, refused if they exceed what one stored message may hold.
pub(crate) fn encode_for_append(commit: &Commit) -> Result<Vec<u8>, AppendError> {
    let bytes = crate::codec::encode(commit)?;
    if bytes.len() > crate::codec::ENCODED_COMMIT_BYTES_MAX {
        return Err(InvalidCommit::TooLarge {
            size: bytes.len(),
            max: crate::codec::ENCODED_COMMIT_BYTES_MAX,
        }
        .into());
    }
    Ok(bytes)
}

/// Why an append did not happen. Nothing was written in any of these cases.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error("conflict on {aggregate}: expected version {expected}, actual version is {actual}")]
    Conflict {
        aggregate: AggregateId,
        expected: Expectation,
        actual: u64,
    },
    /// An atomic append whose expectations some aggregates did not meet: every one of
    /// them, with its actual version.
    #[error("conflict: {}", conflicts.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("; "))]
    Conflicts { conflicts: Vec<VersionConflict> },
    #[error(transparent)]
    InvalidBatch(#[from] InvalidBatch),
    #[error("commit_id {commit_id} is already used at position {position} by a commit with a different payload")]
    CommitIdReused { commit_id: Uuid, position: u64 },
    #[error("invalid commit: {0}")]
    Invalid(#[from] InvalidCommit),
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error(
        "stored commit at position {position} cannot be decoded: {error}; run `provledger audit`"
    )]
    Corrupt { position: u64, error: DecodeError },
    #[error("event log unavailable: {reason}")]
    Unavailable { reason: String },
    /// The aggregate has a lost commit not yet acknowledged (and this draft is not its
    /// acknowledgement), or the draft acknowledges a loss the aggregate does not have.
    #[error(transparent)]
    Loss(#[from] crate::loss::LossRefusal),
}

/// Why reading the log failed, or one entry that could not be decoded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// Garbage at a position: the reader decides whether to skip (quarantine) or stop.
    #[error("position {position} on {subject} cannot be decoded: {error}")]
    Undecodable {
        position: u64,
        subject: String,
        error: DecodeError,
        payload: bytes::Bytes,
    },
    /// A decodable entry that is not part of its aggregate's chain (a commit of another
    /// aggregate on this subject, or one whose hash does not match its content). Like
    /// garbage, readers quarantine it and go on.
    #[error("position {position} on {subject} is outside its aggregate's chain: {reason}")]
    OutsideChain {
        position: u64,
        subject: String,
        reason: String,
        payload: bytes::Bytes,
    },
    #[error("event log unavailable: {reason}")]
    Unavailable { reason: String },
    /// Versions of the aggregate read are missing from the log and no operator has
    /// acknowledged it (`crate::loss`): nothing past them is folded.
    #[error("integrity: {0}")]
    Lost(crate::loss::LostVersions),
}

impl ReadError {
    /// For an entry that readers quarantine and go past: its position, subject, why, and
    /// payload. `None` for an unavailable log, which readers retry instead.
    pub fn quarantine_parts(&self) -> Option<(u64, &str, String, &bytes::Bytes)> {
        match self {
            ReadError::Undecodable {
                position,
                subject,
                error,
                payload,
            } => Some((*position, subject, format!("undecodable: {error}"), payload)),
            ReadError::OutsideChain {
                position,
                subject,
                reason,
                payload,
            } => Some((*position, subject, reason.clone(), payload)),
            ReadError::Unavailable { .. } | ReadError::Lost(_) => None,
        }
    }
}

/// One entry of an aggregate's history as stored: a commit of its chain, or something else
/// found on its subject (garbage, a replayed, forged or foreign commit), kept in place so
/// that `history` can show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HistoryEntry {
    Commit(Commit),
    Quarantined {
        position: u64,
        subject: String,
        reason: String,
    },
    /// Versions missing before the next entry (`crate::loss`), in place.
    Lost(crate::loss::LostVersions),
}

impl HistoryEntry {
    /// The commit, if this entry is one of the chain.
    pub fn commit(&self) -> Option<&Commit> {
        match self {
            HistoryEntry::Commit(c) => Some(c),
            HistoryEntry::Quarantined { .. } | HistoryEntry::Lost(_) => None,
        }
    }

    /// Where the entry lies in the log (a loss: where the commit after it lies).
    pub fn position(&self) -> u64 {
        match self {
            HistoryEntry::Commit(c) => c.position,
            HistoryEntry::Quarantined { position, .. } => *position,
            HistoryEntry::Lost(l) => l.next_position,
        }
    }

    /// Every break in the chain of a history (oldest entry first), as [`verify_chain`]
    /// finds them in its commits, except at a loss: the commit after a [`HistoryEntry::Lost`]
    /// starts the chain again (its predecessor is what is missing; the loss itself is
    /// reported by [`HistoryEntry::open_losses`] until acknowledged).
    ///
    /// [`verify_chain`]: crate::commit::verify_chain
    pub fn verify(
        aggregate: &AggregateId,
        entries: &[HistoryEntry],
    ) -> Vec<crate::commit::ChainViolation> {
        let mut violations = Vec::new();
        let mut start = (0, crate::ids::Hash::ZERO);
        let mut segment: Vec<&Commit> = Vec::new();
        for entry in entries {
            match entry {
                HistoryEntry::Commit(c) if segment.is_empty() && start.0 > 0 => {
                    start.1 = c.prev_hash;
                    segment.push(c);
                }
                HistoryEntry::Commit(c) => segment.push(c),
                HistoryEntry::Lost(l) => {
                    crate::commit::verify_segment(
                        aggregate,
                        start.0,
                        start.1,
                        segment.drain(..),
                        &mut violations,
                    );
                    start = (l.to_version, crate::ids::Hash::ZERO);
                }
                HistoryEntry::Quarantined { .. } => {}
            }
        }
        crate::commit::verify_segment(aggregate, start.0, start.1, segment, &mut violations);
        violations
    }

    /// The losses of a history (oldest entry first) that no later commit of it
    /// acknowledges: what makes its aggregate answer `integrity`.
    pub fn open_losses(entries: &[HistoryEntry]) -> crate::loss::OpenLosses {
        let mut open = crate::loss::OpenLosses::default();
        for entry in entries {
            match entry {
                HistoryEntry::Lost(l) => open.open(*l),
                HistoryEntry::Commit(c) => open.close_by(c),
                HistoryEntry::Quarantined { .. } => {}
            }
        }
        open
    }
}

/// The tip of an aggregate's chain as a reader last saw it: its version, the position of
/// its last commit and that commit's hash. Reading "after" a tip returns only what is newer,
/// checked to link to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainTip {
    pub version: u64,
    pub position: u64,
    pub hash: crate::ids::Hash,
}

impl ChainTip {
    /// The tip of an aggregate with no commit.
    pub const EMPTY: ChainTip = ChainTip {
        version: 0,
        position: 0,
        hash: crate::ids::Hash::ZERO,
    };

    /// The tip after `commit`.
    pub fn of(commit: &Commit) -> ChainTip {
        ChainTip {
            version: commit.version,
            position: commit.position,
            hash: commit.hash,
        }
    }
}

/// A stream of commits in position order. `read_all` ends at the log's end as of the call;
/// `subscribe` never ends. Neither skips nor reorders.
pub type CommitStream = BoxStream<'static, Result<Commit, ReadError>>;

/// An append-only, per-aggregate versioned, globally ordered log of commits.
pub trait EventLog: Send + Sync {
    /// Appends one commit if `expect` admits the aggregate's current version. Returns only
    /// once the commit is durable (JetStream ack, or sled flushed).
    fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> impl Future<Output = Result<AppendOutcome, AppendError>> + Send;

    /// Appends several commits on distinct aggregates all or nothing, each only if its
    /// expectation admits its aggregate's version when the batch is written (JetStream:
    /// one atomic batch, nats-server 2.12+; sled: one batch under the append lock). Returns
    /// only once all are durable, in the order given, at consecutive positions. A retry of
    /// the same batch (same commit ids, same payloads) answers each `AlreadyAppended`; a
    /// refusal names every aggregate whose expectation failed (`Conflicts`).
    /// Required of every log (a wrapper delegates it): a default that refused would turn
    /// every fact written together into a failure at run time.
    fn append_atomic(
        &self,
        items: Vec<AtomicItem>,
    ) -> impl Future<Output = Result<Vec<AppendOutcome>, AppendError>> + Send;

    /// Every commit of one aggregate, oldest first.
    fn read_aggregate(
        &self,
        aggregate: AggregateId,
    ) -> impl Future<Output = Result<Vec<Commit>, ReadError>> + Send;

    /// The commits of one aggregate after `after` (a tip an earlier read returned), oldest
    /// first. What the log holds after that tip is checked to extend it; anything else on
    /// the aggregate's subject is skipped as in `read_aggregate`. Costs what is newer than
    /// the tip, not the aggregate's length (the backends below override the default).
    fn read_aggregate_after(
        &self,
        aggregate: AggregateId,
        after: ChainTip,
    ) -> impl Future<Output = Result<Vec<Commit>, ReadError>> + Send {
        async move {
            let mut commits = self.read_aggregate(aggregate).await?;
            commits.retain(|c| c.version > after.version);
            Ok(commits)
        }
    }

    /// The commit of `aggregate` with this commit id, if the log holds it: how a late retry
    /// is recognised without reading the whole aggregate where the log can help (sled's
    /// commit-id index; JetStream scans only what was stored since the id was minted, less
    /// the tolerated clock skew, when the id tells its age).
    fn find_commit(
        &self,
        aggregate: AggregateId,
        commit_id: Uuid,
    ) -> impl Future<Output = Result<Option<Commit>, ReadError>> + Send {
        async move {
            Ok(self
                .read_aggregate(aggregate)
                .await?
                .into_iter()
                .find(|c| c.commit_id == commit_id))
        }
    }

    /// The commit stored at `position`, if it is a commit.
    fn read_position(
        &self,
        position: u64,
    ) -> impl Future<Output = Result<Option<Commit>, ReadError>> + Send {
        async move {
            use futures::StreamExt;
            let mut stream = self.read_all(position).await?;
            match stream.next().await {
                Some(Ok(c)) if c.position == position => Ok(Some(c)),
                Some(Err(e @ ReadError::Unavailable { .. })) => Err(e),
                _ => Ok(None),
            }
        }
    }

    /// Whether `tip` is still the aggregate's head as the log's authority (the stream
    /// leader) sees it. Reads may be answered by a replica that lags behind; a refusal
    /// decided on such a read is confirmed here first. Always true where every read is
    /// authoritative (sled, in memory).
    fn tip_is_current(
        &self,
        aggregate: AggregateId,
        tip: ChainTip,
    ) -> impl Future<Output = Result<bool, ReadError>> + Send {
        let _ = (aggregate, tip);
        async { Ok(true) }
    }

    /// A reader of this log's own stream in this process (serve's projector) found `tip`,
    /// a commit it checked and folded, as the aggregate's head. A log that keeps heads for
    /// its appends takes it if it is newer than the one it holds, so that a write decided
    /// on a state folded from the same stream appends at once ([`EventLog::holds_head`]).
    /// Nothing for a log that keeps none.
    fn note_head(&self, aggregate: AggregateId, tip: ChainTip) {
        let _ = (aggregate, tip);
    }

    /// Whether this handle holds `tip` as the aggregate's head, read or written by itself
    /// or noted by its own reader ([`EventLog::note_head`]): an append at `tip`'s version
    /// then goes out without a read first, and the log refuses it if anything came after.
    /// A hint, never a read: it says nothing of what the log holds now. False for a log
    /// whose reads cost no round trip (sled, in memory).
    fn holds_head(&self, aggregate: AggregateId, tip: ChainTip) -> bool {
        let _ = (aggregate, tip);
        false
    }

    /// Whether an append of a draft with this commit id would itself recognise an earlier
    /// commit with that id: always for sled (its commit-id index) and the in-memory log;
    /// for JetStream only while the id is young enough for its duplicate window. A retry
    /// the append would not recognise must be looked for before it is appended again.
    fn recognises_retry_on_append(&self, commit_id: &Uuid) -> bool {
        let _ = commit_id;
        true
    }

    /// The aggregate's history as stored, quarantined entries in place. A log where nothing
    /// but provledger writes (sled) has none.
    fn aggregate_history(
        &self,
        aggregate: AggregateId,
    ) -> impl Future<Output = Result<Vec<HistoryEntry>, ReadError>> + Send {
        async move {
            Ok(self
                .read_aggregate(aggregate)
                .await?
                .into_iter()
                .map(HistoryEntry::Commit)
                .collect())
        }
    }

    /// Every commit from `from` (inclusive, 1-based) to the current end.
    fn read_all(&self, from: u64) -> impl Future<Output = Result<CommitStream, ReadError>> + Send;

    /// Every commit from `from` on, then a live tail.
    fn subscribe(&self, from: u64) -> impl Future<Output = Result<CommitStream, ReadError>> + Send;

    /// The position of the last durable commit, 0 for an empty log.
    fn last_position(&self) -> impl Future<Output = Result<u64, ReadError>> + Send;
}
