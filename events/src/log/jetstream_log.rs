//! The distributed backend: one JetStream stream, one subject per aggregate.
//!
//! - Subjects are `<prefix>.ev.<kind>.<uuid>`, one message per commit, `Nats-Msg-Id` =
//!   commit_id, and the payload is the codec's bytes.
//! - An aggregate's version counts its commits. An expected version is mapped onto the
//!   stream sequence of the aggregate's last message and sent as
//!   `Nats-Expected-Last-Subject-Sequence`, so a writer that raced in between fails.
//! - Heads (version, sequence, hash) are cached per aggregate; a stale cache entry is
//!   caught by the server's sequence check and refreshed, never trusted for a conflict.
//! - Publishes are bounded by a window of in-flight acks below async-nats'
//!   `max_ack_inflight`, because reaching that limit makes publishing fail or block.
//! - Idempotency: inside the duplicate window JetStream drops a retried `Nats-Msg-Id`.
//!   After it, a retry would conflict (its expectation is stale) or, with `Any`, be written
//!   twice; so a conflicting append, and an `Any` append whose UUID v7 commit_id is older
//!   than the window, first scan the aggregate's commits since that commit_id was minted.
//! - Reads use batch direct gets (`direct.rs`), never a consumer: reading an aggregate, its
//!   tail, a retry scan or the whole stream creates nothing on the server. Only the live
//!   tail (`subscribe`) holds a consumer, at most [`SUBSCRIPTIONS_MAX`] per log handle.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use tokio::sync::Semaphore;
use uuid::Uuid;

use super::direct::{DirectReader, Start, DIRECT_BATCH_MESSAGES_MAX};
use super::group_commit::{self, GroupCommit, GroupStats, SetAnswer, SetWriter};
use super::{
    encode_for_append, recognise_batch_retry, validate_batch, AppendError, AppendOutcome,
    AppendStatus, AtomicItem, ChainTip, CommitStream, EventLog, Expectation, HistoryEntry,
    ReadError, VersionConflict,
};
use crate::codec;
use crate::commit::{Commit, CommitDraft};
use crate::ids::{uuid_v7_unix_ms, AggregateId, Hash, Timestamp, CLOCK_SKEW_MS_MAX};
use crate::loss::{LostVersions, OpenLosses};

/// async-nats' limit of unacknowledged publishes per context.
pub const MAX_ACK_INFLIGHT: usize = 5000;
/// Our window of in-flight publishes; must stay below [`MAX_ACK_INFLIGHT`].
pub const ACK_WINDOW_DEFAULT: usize = 1024;
const _: () = assert!(ACK_WINDOW_DEFAULT < MAX_ACK_INFLIGHT);
/// The oldest server that honours every stream setting we verify and answers batch direct
/// gets (2.11), which every read uses instead of a consumer, and atomic batch publish
/// (2.12), which facts on several aggregates are written with.
pub const SERVER_VERSION_MIN: (u64, u64, u64) = (2, 12, 0);
/// The oldest server that commits an atomic batch by an end-of-batch marker
/// ([`StreamedBatch`]): with an older one, a group is written once it is whole.
const SERVER_VERSION_EOB: (u64, u64, u64) = (2, 14, 0);
/// How often an append retries after losing a race (`Any`), or after finding the subject
/// moved by a message outside the chain while the version still admits it.
const APPEND_ATTEMPTS_MAX: usize = 16;
/// Live tails (`subscribe`, each one JetStream consumer) one log handle holds at once: the
/// only consumers provledger creates, so a process's consumers stay bounded whatever its
/// write rate.
pub const SUBSCRIPTIONS_MAX: usize = 4;
/// How many heads the cache keeps before it is cleared.
const HEAD_CACHE_ENTRIES_MAX: usize = 200_000;
/// The longest a retry scan may take before the append answers `Unavailable`.
const RETRY_SCAN_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and how the stream lives.
#[derive(Debug, Clone)]
pub struct JetStreamConfig {
    pub stream: String,
    pub subject_prefix: String,
    pub replicas: usize,
    pub duplicate_window: Duration,
    /// In-flight publishes; clamped below [`MAX_ACK_INFLIGHT`].
    pub ack_window: usize,
}

impl Default for JetStreamConfig {
    fn default() -> Self {
        JetStreamConfig {
            stream: "PROVLEDGER".into(),
            subject_prefix: "provledger".into(),
            replicas: 1,
            duplicate_window: Duration::from_secs(120),
            ack_window: ACK_WINDOW_DEFAULT,
        }
    }
}

/// The subject of an aggregate's commits under a prefix: where every writer publishes
/// them, and where a restore from a replica's copy puts them back.
pub fn subject_for(prefix: &str, aggregate: &AggregateId) -> String {
    aggregate.subject(prefix, COMMITS_FAMILY)
}

/// The family of the subjects commits are published on: `PREFIX.ev.KIND.ID`.
const COMMITS_FAMILY: &str = "ev";

/// The `Nats-Msg-Id` a commit is published with: its commit id, hyphenated, as every
/// writer sends it (one commit, or an atomic batch), so that JetStream's duplicate window
/// recognises a retry; a restore from a replica's copy sends the same.
pub fn message_id(commit_id: &Uuid) -> String {
    commit_id.to_string()
}

impl JetStreamConfig {
    pub fn subject_for(&self, aggregate: &AggregateId) -> String {
        subject_for(&self.subject_prefix, aggregate)
    }

    pub fn all_subjects(&self) -> String {
        format!("{}.{COMMITS_FAMILY}.>", self.subject_prefix)
    }

    pub(crate) fn stream_config(&self) -> stream::Config {
        stream::Config {
            name: self.stream.clone(),
            subjects: vec![self.all_subjects()],
            storage: stream::StorageType::File,
            retention: stream::RetentionPolicy::Limits,
            num_replicas: self.replicas,
            duplicate_window: self.duplicate_window,
            deny_delete: true,
            deny_purge: true,
            allow_direct: true,
            allow_atomic_publish: true,
            allow_rollup: false,
            max_messages: -1,
            max_bytes: -1,
            max_age: Duration::ZERO,
            ..Default::default()
        }
    }
}

/// JetStream's error code for a publish whose expected last subject sequence is not the
/// subject's.
const ERR_WRONG_LAST_SEQUENCE: u64 = 10071;
/// JetStream's error code (replicated streams) for a batch whose expected last sequence
/// names a subject with a publish still in flight: a lost race like 10071.
const ERR_BATCH_SEQUENCE_IN_FLIGHT: u64 = 10164;
/// JetStream's error code for an atomic batch holding a message id already in the
/// duplicate window (the whole batch is refused).
const ERR_BATCH_DUPLICATE_ID: u64 = 10201;
/// JetStream's error code for an atomic batch refused because the stream (or the server)
/// already has as many batches in flight as it allows (nats-server's
/// `max_batch_inflight_per_stream`, 50 by default): nothing of it was stored.
const ERR_BATCH_TOO_MANY_IN_FLIGHT: u64 = 10210;
/// JetStream's error code for an atomic batch holding more messages than the server's
/// `max_batch_size` (1,000 by default; a server may be configured lower).
const ERR_BATCH_TOO_LARGE: u64 = 10199;
/// JetStream's error code for an atomic batch the server does not know at its commit (its
/// opening refused, a message lost, or abandoned): nothing of it was stored.
const ERR_BATCH_INCOMPLETE: u64 = 10176;
/// JetStream's error code for a batch commit header the server does not know (an end-of-batch
/// marker sent to a server before 2.14): nothing of the batch was stored.
const ERR_BATCH_INVALID_COMMIT: u64 = 10200;
/// How many times a group of atomic sets is sent as one batch before its sets go alone: a
/// first refusal for a moved subject removes the sets it refuses and sends the others
/// again once; a second means a subject is hot or the heads do not tell.
const GROUP_ROUNDS_MAX: usize = 2;
/// Commit ids a handle remembers as sent without an answer; past it the set is cleared
/// (a retry then forgotten is still recognised by the write path's re-read).
const UNANSWERED_IDS_MAX: usize = 4096;
/// How long an atomic batch's opening or commit waits for its answer.
const BATCH_REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// Atomic batches one process has in flight at once, below the server's default per
/// stream (50), so that one busy writer queues its batches instead of having them refused.
pub const ATOMIC_BATCHES_IN_FLIGHT_MAX: usize = 32;
/// How long a batch refused because too many are in flight (other processes' included)
/// is sent again, with a growing pause, before the append answers `unavailable`.
const BATCH_BUSY_WAIT_MAX: Duration = Duration::from_secs(10);

/// What an atomic batch came to.
enum BatchAck {
    Stored {
        last_sequence: u64,
    },
    WrongLastSequence,
    DuplicateId,
    /// Refused whole because too many batches are in flight; may be sent again.
    Busy,
    /// Refused whole: more messages than the server takes in one batch.
    TooLarge,
    Unavailable(String),
}

/// A [`StreamedBatch`] unknown to the server at its commit (its opening refused, a message
/// lost), or committed in a way this server does not take: nothing of it was stored, and it
/// may be sent again as a batch whose opening is answered.
struct NotOpened;

impl BatchAck {
    /// The refusal of a batch's commit (or of its answered opening) with `err_code`, where
    /// it is one the writer acts on.
    fn of_refusal(err_code: u64) -> Option<BatchAck> {
        match err_code {
            ERR_WRONG_LAST_SEQUENCE | ERR_BATCH_SEQUENCE_IN_FLIGHT => {
                Some(BatchAck::WrongLastSequence)
            }
            ERR_BATCH_DUPLICATE_ID => Some(BatchAck::DuplicateId),
            ERR_BATCH_TOO_MANY_IN_FLIGHT => Some(BatchAck::Busy),
            ERR_BATCH_TOO_LARGE => Some(BatchAck::TooLarge),
            _ => None,
        }
    }

    /// The refusal of a batch's answered opening with `err_code`, where it is one the
    /// writer acts on. An opening refused as an incomplete batch was never opened: that is
    /// how nats-server 2.12 turns one away when too many batches are in flight (2.14 says
    /// so with its own code), or when it cannot stage it; nothing is stored, and it waits
    /// its turn as a busy one does.
    fn of_opening_refusal(err_code: u64) -> Option<BatchAck> {
        match err_code {
            ERR_BATCH_INCOMPLETE => Some(BatchAck::Busy),
            other => BatchAck::of_refusal(other),
        }
    }
}

/// The headers of message `sequence` (from 1) of atomic batch `batch_id`, expecting
/// `expected_sequence` as its subject's last, with its commit id as `Nats-Msg-Id`.
fn batch_headers(
    batch_id: &str,
    sequence: usize,
    expected_sequence: u64,
    commit_id: &Uuid,
) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Batch-Id", batch_id);
    headers.insert("Nats-Batch-Sequence", sequence.to_string().as_str());
    headers.insert(
        "Nats-Expected-Last-Subject-Sequence",
        expected_sequence.to_string().as_str(),
    );
    headers.insert("Nats-Msg-Id", message_id(commit_id).as_str());
    headers
}

/// An atomic batch sent as its sets become ready, no message waiting for the server: ADR-50
/// lets the opening message go without a reply (a refused opening or a lost message leaves
/// the batch unknown or gapped, which its commit is refused for, nothing stored). It is
/// committed by an end-of-batch marker (`Nats-Batch-Commit: eob`, nats-server 2.14 and
/// later), which the server does not store: its pub ack names the last stored message.
struct StreamedBatch {
    id: String,
    sent: usize,
    last_subject: Option<String>,
}

impl StreamedBatch {
    fn open() -> StreamedBatch {
        StreamedBatch {
            id: Uuid::new_v4().to_string(),
            sent: 0,
            last_subject: None,
        }
    }

    async fn send<'m>(
        &mut self,
        client: &async_nats::Client,
        messages: impl Iterator<Item = &'m BatchMessage>,
    ) -> Result<(), String> {
        for (subject, expected_sequence, commit_id, bytes) in messages {
            let headers = batch_headers(&self.id, self.sent + 1, *expected_sequence, commit_id);
            client
                .publish_with_headers(subject.clone(), headers, bytes.clone().into())
                .await
                .map_err(|e| format!("batch to {subject}: {e}"))?;
            self.sent += 1;
            self.last_subject = Some(subject.clone());
        }
        Ok(())
    }

    async fn commit(self, client: &async_nats::Client) -> Result<BatchAck, NotOpened> {
        let Some(subject) = self.last_subject else {
            return Ok(BatchAck::Unavailable(
                "an atomic batch needs at least one commit".into(),
            ));
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Batch-Id", self.id.as_str());
        headers.insert("Nats-Batch-Sequence", (self.sent + 1).to_string().as_str());
        headers.insert("Nats-Batch-Commit", "eob");
        let reply = match batch_request(client, &subject, headers, bytes::Bytes::new()).await {
            Ok(reply) => reply,
            Err(ack) => return Ok(ack),
        };
        match reply {
            BatchReply::Refused { err_code, .. }
                if err_code == ERR_BATCH_INCOMPLETE || err_code == ERR_BATCH_INVALID_COMMIT =>
            {
                Err(NotOpened)
            }
            reply => Ok(reply.commit_ack(&subject, self.sent)),
        }
    }
}

/// Sends one message of an atomic batch on `subject` as a request: the server's answer, or
/// the batch unavailable when none came.
async fn batch_request(
    client: &async_nats::Client,
    subject: &str,
    headers: async_nats::HeaderMap,
    payload: bytes::Bytes,
) -> Result<BatchReply, BatchAck> {
    let reply = tokio::time::timeout(
        BATCH_REPLY_TIMEOUT,
        client.request_with_headers(subject.to_string(), headers, payload),
    )
    .await;
    match reply {
        Ok(Ok(reply)) => Ok(parse_batch_reply(&reply.payload)),
        Ok(Err(e)) => Err(BatchAck::Unavailable(format!("batch to {subject}: {e}"))),
        Err(_) => Err(BatchAck::Unavailable(format!(
            "no answer to the atomic batch within {BATCH_REPLY_TIMEOUT:?}"
        ))),
    }
}

/// The server's answer to one message of an atomic batch.
#[derive(Debug)]
enum BatchReply {
    /// The empty answer to the batch's opening message.
    Started,
    Stored {
        sequence: u64,
        /// The batch's size as the server counted it (`count`; 0 when not given).
        count: u64,
    },
    Refused {
        err_code: u64,
        description: String,
    },
    Unreadable(String),
}

impl BatchReply {
    /// What the answer to the commit of a batch of `sent` stored messages says of it. A
    /// server that counted another size stored what was not sent (a 2.12.0 leader stores
    /// an end-of-batch marker as a message): the positions the ack implies are not the
    /// commits', so the outcome is unknown to the writer, which a retry finds out.
    fn commit_ack(self, subject: &str, sent: usize) -> BatchAck {
        if let BatchReply::Refused { err_code, .. } = &self {
            if let Some(ack) = BatchAck::of_refusal(*err_code) {
                return ack;
            }
        }
        match self {
            BatchReply::Stored { count, .. } if count != 0 && count != sent as u64 => {
                BatchAck::Unavailable(format!(
                    "atomic batch to {subject}: the server stored {count} messages of a batch of {sent}"
                ))
            }
            BatchReply::Stored { sequence, .. } => BatchAck::Stored {
                last_sequence: sequence,
            },
            other => {
                BatchAck::Unavailable(format!("atomic batch to {subject}: {}", other.describe()))
            }
        }
    }

    fn describe(&self) -> String {
        match self {
            BatchReply::Started => "the batch was only opened".into(),
            BatchReply::Stored { sequence, .. } => format!("stored early, at {sequence}"),
            BatchReply::Refused {
                err_code,
                description,
            } => format!("refused: {description} (error {err_code})"),
            BatchReply::Unreadable(text) => format!("unreadable answer {text:?}"),
        }
    }
}

fn parse_batch_reply(payload: &[u8]) -> BatchReply {
    if payload.is_empty() {
        return BatchReply::Started;
    }
    #[derive(serde::Deserialize)]
    struct ApiError {
        #[serde(default)]
        err_code: u64,
        #[serde(default)]
        description: String,
    }
    #[derive(serde::Deserialize)]
    struct Reply {
        error: Option<ApiError>,
        #[serde(default)]
        seq: u64,
        #[serde(default)]
        count: u64,
    }
    match serde_json::from_slice::<Reply>(payload) {
        Ok(Reply {
            error: Some(error), ..
        }) => BatchReply::Refused {
            err_code: error.err_code,
            description: error.description,
        },
        Ok(Reply { seq, count, .. }) if seq > 0 => BatchReply::Stored {
            sequence: seq,
            count,
        },
        _ => BatchReply::Unreadable(String::from_utf8_lossy(payload).into_owned()),
    }
}

/// Why the JetStream log could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenJetStreamError {
    #[error("nats-server {found} is too old: provledger needs {}.{}.{} or later (batch direct get needs 2.11, atomic batch publish 2.12; older servers silently ignore stream settings it relies on)", SERVER_VERSION_MIN.0, SERVER_VERSION_MIN.1, SERVER_VERSION_MIN.2)]
    ServerTooOld { found: String },
    #[error("stream {stream} has {setting} = {found}, provledger needs {expected}; fix the stream or use another --stream")]
    StreamConfigMismatch {
        stream: String,
        setting: &'static str,
        expected: String,
        found: String,
    },
    #[error("stream {stream} not found on this NATS server: nothing was created, since a read never creates one; give the stream that holds the log (--stream, default PROVLEDGER), or create {stream} by writing to it first (`provledger serve` or `provledger append` with --stream {stream})")]
    StreamNotFound { stream: String },
    #[error("stream {stream} cannot be created: its subjects {subjects} are already those of another stream on this server; use that stream (--stream, default PROVLEDGER) or another --subject-prefix")]
    SubjectsTaken { stream: String, subjects: String },
    #[error("JetStream unavailable: {0}")]
    Unavailable(String),
}

/// What opening a log does when its stream does not exist yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingStream {
    /// Create it: what a writer (serve, append, the client library) does.
    Create,
    /// Refuse with [`OpenJetStreamError::StreamNotFound`]: what a read-only command does, so
    /// that a mistyped `--stream` never leaves a permanent (deny_delete) stream behind.
    Refuse,
}

/// An aggregate's head: the tip of its valid chain (`version`, `hash`) and the stream
/// sequence of the last message on its subject (`sequence`, valid or not), which the next
/// publish expects. They differ when something outside the chain was published last.
/// `open` holds the losses found on the way (`crate::loss`) that no commit after them
/// acknowledges: while there is one, nothing but its acknowledgement is appended and reads
/// answer `integrity`.
#[derive(Debug, Clone)]
struct Head {
    version: u64,
    sequence: u64,
    hash: Hash,
    open: OpenLosses,
}

impl Head {
    /// Whether `draft`, expecting `expect`, may be sealed on this head: no open loss that it
    /// does not acknowledge, and a version `expect` admits. A cached head that does not is
    /// read again from the server before anything is refused: the cache may be stale, on a
    /// loss (acknowledged since by another process) as on a version.
    fn admits(&self, expect: Expectation, draft: &CommitDraft) -> bool {
        crate::loss::admits(draft, self.open.as_slice()).is_ok() && expect.admits(self.version)
    }

    fn at(version: u64, sequence: u64, hash: Hash) -> Head {
        Head {
            version,
            sequence,
            hash,
            open: OpenLosses::EMPTY,
        }
    }
}

/// Whether a message on `aggregate`'s subject extends the chain whose tip is `head`, pushed
/// onto `out` as one entry (two for a loss: the missing versions, then the commit after).
/// An intact commit of this aggregate past the next version reveals a loss
/// (`crate::loss`): it opens one on the head and the chain goes on from it, so readers
/// answer `integrity` and writers refuse until it is acknowledged. Anything else (garbage,
/// another aggregate's commit, a modified commit, a replay of an earlier version, a commit
/// at the next version that does not link) is quarantined: readers skip it and the chain
/// goes on from its last valid commit, so no such message stops an aggregate.
fn classify(
    aggregate: &AggregateId,
    subject: &str,
    head: &mut Head,
    payload: &[u8],
    sequence: u64,
    out: &mut Vec<HistoryEntry>,
) {
    // Any message moves the subject: the next publish must expect it as the last one, or
    // every append after it would fail its sequence check.
    head.sequence = sequence;
    let quarantined = |reason: String| HistoryEntry::Quarantined {
        position: sequence,
        subject: subject.to_string(),
        reason,
    };
    let commit = match codec::decode(payload, sequence) {
        Ok(c) => c,
        Err(e) => return out.push(quarantined(format!("undecodable: {e}"))),
    };
    let reason = if commit.aggregate != *aggregate {
        format!("foreign: a commit of {}", commit.aggregate)
    } else if !commit.hash_is_valid() {
        format!("modified: v{} does not match its hash", commit.version)
    } else if commit.version <= head.version {
        format!(
            "replayed: v{} again after v{}",
            commit.version, head.version
        )
    } else if let Some(loss) = LostVersions::before(aggregate, head.version, &commit) {
        head.open.open(loss);
        out.push(HistoryEntry::Lost(loss));
        head.version = commit.version;
        head.hash = commit.hash;
        return out.push(HistoryEntry::Commit(commit));
    } else if commit.prev_hash != head.hash {
        format!(
            "forged: v{} does not link to v{}",
            commit.version, head.version
        )
    } else {
        head.version = commit.version;
        head.hash = commit.hash;
        head.open.close_by(&commit);
        return out.push(HistoryEntry::Commit(commit));
    };
    out.push(quarantined(reason))
}

const EMPTY_HEAD: Head = Head {
    version: 0,
    sequence: 0,
    hash: Hash::ZERO,
    open: OpenLosses::EMPTY,
};

struct Inner {
    context: jetstream::Context,
    stream: stream::Stream,
    direct: DirectReader,
    config: JetStreamConfig,
    heads: Mutex<HashMap<AggregateId, Head>>,
    window: Semaphore,
    /// Atomic batches in flight ([`ATOMIC_BATCHES_IN_FLIGHT_MAX`]).
    batches: Semaphore,
    subscriptions: Arc<Semaphore>,
    /// Concurrent atomic sets waiting to share one batch (`group_commit.rs`).
    groups: GroupCommit,
    /// Commit ids whose publish this handle sent without learning its outcome (a lost ack,
    /// a timeout), at most [`UNANSWERED_IDS_MAX`]: a retry of one of them that the server
    /// refuses for its sequence is looked for where it would have landed.
    unanswered: Mutex<HashSet<Uuid>>,
    server_version: String,
    /// Whether the server takes a batch committed by an end-of-batch marker
    /// ([`SERVER_VERSION_EOB`]), so that a group can open before it is whole.
    opens_early: bool,
}

/// The JetStream event log. Cheap to clone.
#[derive(Clone)]
pub struct JetStreamLog {
    inner: Arc<Inner>,
}

/// The (major, minor, patch) of a nats-server version as the server reports it (`2.14.6`,
/// `v2.14.6`, `2.12.0-beta.1`), parsed as semver. A pre-release counts as its release: a
/// 2.12.0 beta already has what 2.12 added.
pub fn parse_server_version(v: &str) -> Option<(u64, u64, u64)> {
    let version = semver::Version::parse(v.trim().trim_start_matches('v')).ok()?;
    Some((version.major, version.minor, version.patch))
}

fn unavailable(e: impl std::fmt::Display) -> AppendError {
    AppendError::Unavailable {
        reason: e.to_string(),
    }
}

fn read_unavailable(e: impl std::fmt::Display) -> ReadError {
    ReadError::Unavailable {
        reason: e.to_string(),
    }
}

/// Compares what the server echoed back with what we need; names the first difference.
pub(crate) fn verify_stream_config(
    want: &stream::Config,
    got: &stream::Config,
) -> Result<(), OpenJetStreamError> {
    let mismatch = |setting: &'static str, expected: String, found: String| {
        Err(OpenJetStreamError::StreamConfigMismatch {
            stream: want.name.clone(),
            setting,
            expected,
            found,
        })
    };
    if got.storage != want.storage {
        return mismatch("storage", "file".into(), format!("{:?}", got.storage));
    }
    // Exactly the event subjects: a message on any other subject would take a stream
    // sequence that is no commit's position (a gap the audit reports), and the stream's
    // end would be a position no projector ever reaches (serve would never be ready).
    if got.subjects != want.subjects {
        return mismatch(
            "subjects",
            format!("{:?}", want.subjects),
            format!("{:?}", got.subjects),
        );
    }
    let flags = [
        ("deny_delete", want.deny_delete, got.deny_delete),
        ("deny_purge", want.deny_purge, got.deny_purge),
        ("allow_direct", want.allow_direct, got.allow_direct),
        (
            "allow_atomic",
            want.allow_atomic_publish,
            got.allow_atomic_publish,
        ),
        ("allow_rollup", want.allow_rollup, got.allow_rollup),
    ];
    for (setting, expected, found) in flags {
        if expected != found {
            return mismatch(setting, expected.to_string(), found.to_string());
        }
    }
    if got.num_replicas.max(1) != want.num_replicas.max(1) {
        return mismatch(
            "num_replicas",
            want.num_replicas.to_string(),
            got.num_replicas.to_string(),
        );
    }
    if got.duplicate_window != want.duplicate_window {
        return mismatch(
            "duplicate_window",
            format!("{:?}", want.duplicate_window),
            format!("{:?}", got.duplicate_window),
        );
    }
    if got.retention != want.retention {
        return mismatch("retention", "limits".into(), format!("{:?}", got.retention));
    }
    if got.max_age != Duration::ZERO || got.max_messages > 0 || got.max_bytes > 0 {
        return mismatch(
            "limits (max_age/max_msgs/max_bytes)",
            "unlimited: a ledger never expires commits".into(),
            format!("{:?}/{}/{}", got.max_age, got.max_messages, got.max_bytes),
        );
    }
    Ok(())
}

/// A stored message as a commit, or why it is not one. What can be told without the
/// chain: whether it decodes, whose subject it is on, and whether it is intact; readers
/// check the link to the tip.
fn stored_commit(
    prefix: &str,
    subject: &str,
    position: u64,
    payload: &bytes::Bytes,
) -> Result<Commit, ReadError> {
    let outside = |reason: String| ReadError::OutsideChain {
        position,
        subject: subject.to_string(),
        reason,
        payload: payload.clone(),
    };
    match codec::decode(payload, position) {
        Err(error) => Err(ReadError::Undecodable {
            position,
            subject: subject.to_string(),
            error,
            payload: payload.clone(),
        }),
        Ok(c) if !c.aggregate.is_subject(prefix, COMMITS_FAMILY, subject) => {
            Err(outside(format!("foreign: a commit of {}", c.aggregate)))
        }
        Ok(c) if !c.hash_is_valid() => Err(outside(format!(
            "modified: v{} does not match its hash",
            c.version
        ))),
        Ok(c) => Ok(c),
    }
}

fn is_subject_overlap(e: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP
    )
}

fn is_stream_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// A direct get's filter for every subject of the stream.
const ALL_SUBJECTS: &str = ">";
/// How long `open` waits for the stream to answer direct gets. A stream just created (an
/// R3 one above all) answers `503 no responders` until its replicas have subscribed to the
/// direct get API: seen as a first append failing right after the open that created it.
const DIRECT_RESPONDERS_WAIT: Duration = Duration::from_secs(10);

/// A task that is cancelled when its handle is dropped: a batch asked for ahead that the
/// reader no longer wants (it stopped reading) is not fetched to the end.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl JetStreamLog {
    /// Checks the server version, then creates the stream or verifies the existing one.
    pub async fn open(
        client: async_nats::Client,
        config: JetStreamConfig,
    ) -> Result<Self, OpenJetStreamError> {
        Self::open_with(client, config, MissingStream::Create).await
    }

    /// Checks the server version, then verifies the existing stream; a missing one is
    /// created or refused as `missing` says.
    pub async fn open_with(
        client: async_nats::Client,
        mut config: JetStreamConfig,
        missing: MissingStream,
    ) -> Result<Self, OpenJetStreamError> {
        let server_version = client.server_info().version;
        if server_version.is_empty() {
            // A client built to connect lazily has no server yet: that is not an old one.
            return Err(OpenJetStreamError::Unavailable(
                "the NATS client is not connected to any server yet".into(),
            ));
        }
        let opens_early = match parse_server_version(&server_version) {
            Some(v) if v >= SERVER_VERSION_MIN => v >= SERVER_VERSION_EOB,
            _ => {
                return Err(OpenJetStreamError::ServerTooOld {
                    found: server_version,
                })
            }
        };
        config.ack_window = config.ack_window.clamp(1, MAX_ACK_INFLIGHT - 1);
        let context = jetstream::ContextBuilder::new()
            .max_ack_inflight(MAX_ACK_INFLIGHT)
            .timeout(Duration::from_secs(10))
            .build(client.clone());
        let want = config.stream_config();
        let stream = match context.get_stream(&config.stream).await {
            Ok(s) => s,
            Err(e) if is_stream_not_found(&e) && missing == MissingStream::Refuse => {
                return Err(OpenJetStreamError::StreamNotFound {
                    stream: config.stream.clone(),
                })
            }
            Err(e) if is_stream_not_found(&e) => {
                context.create_stream(want.clone()).await.map_err(|e| {
                    if is_subject_overlap(&e) {
                        OpenJetStreamError::SubjectsTaken {
                            stream: config.stream.clone(),
                            subjects: config.all_subjects(),
                        }
                    } else {
                        OpenJetStreamError::Unavailable(format!("create stream: {e}"))
                    }
                })?
            }
            Err(e) => return Err(OpenJetStreamError::Unavailable(format!("get stream: {e}"))),
        };
        // A stream created by an earlier provledger lacks atomic publish: turning it on
        // changes nothing already stored, so it is done here rather than refused.
        let stream = match stream.cached_info().config.clone() {
            mut found if !found.allow_atomic_publish => {
                found.allow_atomic_publish = true;
                context.update_stream(found).await.map_err(|e| {
                    OpenJetStreamError::Unavailable(format!(
                        "turning on atomic publish (allow_atomic) on stream {}: {e}",
                        config.stream
                    ))
                })?;
                tracing::info!(stream = %config.stream, "atomic publish turned on");
                context
                    .get_stream(&config.stream)
                    .await
                    .map_err(|e| OpenJetStreamError::Unavailable(format!("get stream: {e}")))?
            }
            _ => stream,
        };
        verify_stream_config(&want, &stream.cached_info().config)?;
        let direct = DirectReader::new(client, &config.stream);
        direct
            .wait_for_responders(DIRECT_RESPONDERS_WAIT)
            .await
            .map_err(|e| {
                OpenJetStreamError::Unavailable(format!("stream {}: {e}", config.stream))
            })?;
        tracing::info!(stream = %config.stream, server = %server_version, "jetstream log ready");
        Ok(JetStreamLog {
            inner: Arc::new(Inner {
                context,
                stream,
                direct,
                window: Semaphore::new(config.ack_window),
                batches: Semaphore::new(ATOMIC_BATCHES_IN_FLIGHT_MAX),
                subscriptions: Arc::new(Semaphore::new(SUBSCRIPTIONS_MAX)),
                groups: GroupCommit::default(),
                unanswered: Mutex::new(HashSet::new()),
                config,
                heads: Mutex::new(HashMap::new()),
                server_version,
                opens_early,
            }),
        })
    }

    pub fn config(&self) -> &JetStreamConfig {
        &self.inner.config
    }

    pub fn server_version(&self) -> &str {
        &self.inner.server_version
    }

    /// JetStream consumers this handle holds now (live tails; at most
    /// [`SUBSCRIPTIONS_MAX`]).
    pub fn consumers_held(&self) -> usize {
        SUBSCRIPTIONS_MAX.saturating_sub(self.inner.subscriptions.available_permits())
    }

    pub fn context(&self) -> &jetstream::Context {
        &self.inner.context
    }

    /// The batch direct-get reader, for the raw reads of a backup (`raw.rs`).
    pub(crate) fn direct(&self) -> &DirectReader {
        &self.inner.direct
    }

    /// The position of the last message on `aggregate`'s subject at or before `position`
    /// (a commit or not; `None`: none), from the server's per-subject index: one request,
    /// whatever the stream's length.
    pub async fn last_position_of(
        &self,
        aggregate: AggregateId,
        position: u64,
    ) -> Result<Option<u64>, ReadError> {
        let subject = self.inner.config.subject_for(&aggregate);
        self.inner
            .direct
            .last_up_to(&subject, position)
            .await
            .map_err(|e| read_unavailable(format!("reading {aggregate}'s last message: {e}")))
    }

    /// A commit_id minted longer ago than (most of) the duplicate window may be a late retry
    /// that JetStream's dedupe no longer recognises; so may one whose age is unknown: not a
    /// UUID v7, or minted ahead of this clock by more than the tolerated skew (its writer's
    /// clock runs ahead, so its time says nothing about when it was stored).
    fn maybe_late_retry(&self, commit_id: &Uuid) -> bool {
        let window_ms =
            i64::try_from(self.inner.config.duplicate_window.as_millis()).unwrap_or(i64::MAX);
        let now = Timestamp::now().unix_ms();
        uuid_v7_unix_ms(commit_id)
            .is_none_or(|ms| now - ms > window_ms / 2 || ms - now > CLOCK_SKEW_MS_MAX)
    }

    /// Where a scan for a retry of `commit_id` may start: the id's mint time less the
    /// tolerated skew, when the id tells its age; from the beginning otherwise.
    fn retry_scan_since(commit_id: &Uuid) -> Option<Timestamp> {
        let now = Timestamp::now().unix_ms();
        uuid_v7_unix_ms(commit_id)
            .filter(|ms| ms - now <= CLOCK_SKEW_MS_MAX)
            .map(|ms| Timestamp::from_unix_ms(ms.saturating_sub(CLOCK_SKEW_MS_MAX)))
    }

    fn cached_head(&self, aggregate: &AggregateId) -> Option<Head> {
        self.inner
            .heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(aggregate)
            .cloned()
    }

    /// Caches a head read or written. Heads only move forward: a slow reader that read an
    /// older head never replaces a newer one a concurrent append or read left.
    fn remember_head(&self, aggregate: AggregateId, head: Head) {
        let mut heads = self.inner.heads.lock().unwrap_or_else(|p| p.into_inner());
        if heads
            .get(&aggregate)
            .is_some_and(|old| old.sequence > head.sequence)
        {
            return;
        }
        if heads.len() >= HEAD_CACHE_ENTRIES_MAX {
            heads.clear();
        }
        heads.insert(aggregate, head);
    }

    /// The aggregate's whole subject, classified, and the losses it leaves open.
    async fn whole_history(
        &self,
        aggregate: AggregateId,
    ) -> Result<(Vec<HistoryEntry>, OpenLosses), ReadError> {
        let last = self.last_subject_sequence(&aggregate).await?;
        if last == 0 {
            return Ok((Vec::new(), OpenLosses::EMPTY));
        }
        let (entries, head) = self.scan_subject(&aggregate, 1, last, EMPTY_HEAD).await?;
        let open = head.open.clone();
        // A whole read is the freshest head there is: the next append needs no lookup.
        self.remember_head(aggregate, head);
        Ok((entries, open))
    }

    fn forget_head(&self, aggregate: &AggregateId) {
        self.inner
            .heads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(aggregate);
    }

    /// The stream sequence of the last message on the aggregate's subject, 0 for none.
    async fn last_subject_sequence(&self, aggregate: &AggregateId) -> Result<u64, ReadError> {
        Ok(self
            .last_message(aggregate)
            .await?
            .map_or(0, |m| m.sequence))
    }

    /// The last message on the aggregate's subject, `None` for none.
    async fn last_message(
        &self,
        aggregate: &AggregateId,
    ) -> Result<Option<jetstream::message::StreamMessage>, ReadError> {
        let subject = self.inner.config.subject_for(aggregate);
        match self.inner.stream.direct_get_last_for_subject(subject).await {
            Ok(msg) => Ok(Some(msg)),
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => Ok(None),
            Err(e) => Err(read_unavailable(format!(
                "reading head of {aggregate}: {e}"
            ))),
        }
    }

    /// Reads the aggregate's subject from `from` to `end` (stream sequences, inclusive),
    /// classifying each message against the chain starting at `head`.
    /// The messages on `aggregate`'s subject after `before.position` (a subject sequence)
    /// up to `to` (default: the subject's last), each classified as
    /// [`EventLog::aggregate_history`] classifies them, against the chain as it stood at
    /// `before` (its version and hash): a commit that extends it, or a message outside it
    /// (quarantined, in place). A reader that has already classified the subject up to
    /// `before` reads only what follows ([`ChainTip::EMPTY`]: the whole subject).
    pub async fn aggregate_history_between(
        &self,
        aggregate: AggregateId,
        before: ChainTip,
        to: Option<u64>,
    ) -> Result<Vec<HistoryEntry>, ReadError> {
        let to = match to {
            Some(to) => to,
            None => self.last_subject_sequence(&aggregate).await?,
        };
        let head = Head::at(before.version, before.position, before.hash);
        let (entries, _) = self
            .scan_subject(&aggregate, before.position + 1, to, head)
            .await?;
        Ok(entries)
    }

    async fn scan_subject(
        &self,
        aggregate: &AggregateId,
        from: u64,
        end: u64,
        mut head: Head,
    ) -> Result<(Vec<HistoryEntry>, Head), ReadError> {
        let mut entries = Vec::new();
        if from > end {
            return Ok((entries, head));
        }
        let subject = self.inner.config.subject_for(aggregate);
        let messages = self
            .inner
            .direct
            .range(from, end, &subject)
            .await
            .map_err(|e| read_unavailable(format!("reading {aggregate}: {e}")))?;
        for msg in messages {
            classify(
                aggregate,
                &subject,
                &mut head,
                &msg.payload,
                msg.sequence,
                &mut entries,
            );
        }
        Ok((entries, head))
    }

    /// The subject's last message: its sequence (0: none) and, if it is an intact commit of
    /// this aggregate, its version. Only a refusal is decided on that version, never a head
    /// (a writer's re-read verifies the chain before it decides again): it spares reading
    /// every message after a stale cached head (another process may have written thousands
    /// since this one last did) just to answer `conflict`.
    async fn tail(&self, aggregate: &AggregateId) -> Result<(u64, Option<Commit>), AppendError> {
        let subject = self.inner.config.subject_for(aggregate);
        let Some(last) = self
            .last_message(aggregate)
            .await
            .map_err(|e| unavailable(e.to_string()))?
        else {
            return Ok((0, None));
        };
        let commit = stored_commit(
            &self.inner.config.subject_prefix,
            &subject,
            last.sequence,
            &last.payload,
        )
        .ok();
        Ok((last.sequence, commit))
    }

    /// Remembers commit ids sent without an answer.
    fn note_unanswered<'a>(&self, ids: impl Iterator<Item = &'a Uuid>) {
        let mut unanswered = self
            .inner
            .unanswered
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for id in ids {
            if unanswered.len() >= UNANSWERED_IDS_MAX {
                unanswered.clear();
            }
            unanswered.insert(*id);
        }
    }

    fn was_unanswered(&self, id: &Uuid) -> bool {
        self.inner
            .unanswered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }

    /// After the server refused a batch for a moved subject: each item whose subject moved
    /// past the sequence it was sealed on is a conflict if its tail is a commit beyond the
    /// head it was sealed on that its expectation does not admit; else (a message outside
    /// the chain, a replay of an older commit) its head is read again for the next seal. A
    /// tail before the sealed sequence is a lagging replica's answer, not a move.
    async fn recheck(
        &self,
        items: &[AtomicItem],
        sealed_on: Vec<SealedOn>,
    ) -> Result<Recheck, AppendError> {
        let mut conflicts = Vec::new();
        let mut moved = false;
        for (item, on) in items.iter().zip(sealed_on) {
            let (sequence, last) = self.tail(&item.aggregate).await?;
            let version = last.map(|c| c.version);
            if sequence <= on.sequence {
                continue;
            }
            moved = true;
            match version {
                Some(actual) if actual > on.version && !item.expect.admits(actual) => conflicts
                    .push(VersionConflict {
                        aggregate: item.aggregate,
                        expected: item.expect,
                        actual,
                    }),
                _ => {
                    self.fetch_head(&item.aggregate).await?;
                }
            }
        }
        Ok(match (conflicts.is_empty(), moved) {
            (false, _) => Recheck::Conflicts(conflicts),
            (true, moved) => Recheck::Moved(moved),
        })
    }

    /// The commit stored right after `sequence` on the aggregate's subject, if it is the
    /// draft's (same commit id): where an earlier attempt sealed on that sequence landed,
    /// its ack lost. nats-server checks a publish's expected sequence before its id on a
    /// one-replica stream, and an atomic batch stops at its first failing message, so a
    /// refused retry must be looked for; the server accepted that attempt only as the
    /// subject's next message, so one direct get finds it.
    async fn landed_after(
        &self,
        aggregate: &AggregateId,
        sequence: u64,
        draft: &CommitDraft,
    ) -> Result<Option<Commit>, AppendError> {
        let subject = self.inner.config.subject_for(aggregate);
        // One plain direct get (a batch get's end-of-batch count costs the server a walk of
        // the subject's index).
        let next = match self
            .inner
            .stream
            .direct_get_next_for_subject(subject.clone(), Some(sequence + 1))
            .await
        {
            Ok(msg) => msg,
            Err(e) if e.kind() == stream::DirectGetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(unavailable(format!("reading {aggregate}: {e}"))),
        };
        Ok(stored_commit(
            &self.inner.config.subject_prefix,
            &subject,
            next.sequence,
            &next.payload,
        )
        .ok()
        .filter(|c| c.commit_id == draft.commit_id))
    }

    /// The aggregate's head, read from the server. A cached head that is still the last
    /// message on the subject is used as it is; otherwise the messages after it (all of
    /// them, without one) are read and classified, so a head is never taken from a
    /// message outside the chain.
    async fn fetch_head(&self, aggregate: &AggregateId) -> Result<Head, AppendError> {
        let last = self
            .last_subject_sequence(aggregate)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        if last == 0 {
            return Ok(EMPTY_HEAD);
        }
        let (from, start) = match self.cached_head(aggregate) {
            Some(h) if h.sequence == last => return Ok(h),
            Some(h) if h.sequence < last => (h.sequence + 1, h),
            _ => (1, EMPTY_HEAD),
        };
        let (_, head) = self
            .scan_subject(aggregate, from, last, start)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        self.remember_head(*aggregate, head.clone());
        Ok(head)
    }

    /// Whether the log holds `tip`'s commit as the caller says (its version and hash at its
    /// position).
    async fn tip_is_stored(&self, aggregate: &AggregateId, tip: ChainTip) -> bool {
        if tip.version == 0 {
            return tip.hash == Hash::ZERO;
        }
        matches!(
            self.commit_at(tip.position).await,
            Ok(c) if c.aggregate == *aggregate && c.version == tip.version && c.hash == tip.hash
        )
    }

    async fn commit_at(&self, sequence: u64) -> Result<Commit, AppendError> {
        let msg = self
            .inner
            .stream
            .direct_get(sequence)
            .await
            .map_err(|e| unavailable(format!("reading position {sequence}: {e}")))?;
        codec::decode(&msg.payload, sequence).map_err(|error| AppendError::Corrupt {
            position: sequence,
            error,
        })
    }

    /// An earlier append of `draft` ([`EventLog::find_commit`]) as this append's outcome.
    async fn find_retry(
        &self,
        aggregate: &AggregateId,
        draft: &CommitDraft,
    ) -> Result<Option<AppendOutcome>, AppendError> {
        let found = self
            .find_commit(*aggregate, draft.commit_id)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        found
            .map(|commit| commit.retry_outcome(*aggregate, draft))
            .transpose()
    }

    /// The aggregate's own, intact commit with this id stored at or after `since` (the
    /// server's clock), read in batches up to the subject's last message as read before
    /// the scan starts (a scan that went on after it could wait for ever).
    async fn scan_for_commit(
        &self,
        aggregate: &AggregateId,
        commit_id: Uuid,
        since: Option<Timestamp>,
    ) -> Result<Option<Commit>, ReadError> {
        let subject = self.inner.config.subject_for(aggregate);
        let Some(last) = self.last_message(aggregate).await? else {
            return Ok(None);
        };
        let since = since.and_then(|t| {
            time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(t.unix_ms()) * 1_000_000)
                .ok()
        });
        let mut start = match since {
            // Nothing was recorded since then: it cannot be there.
            Some(since) if last.time < since => return Ok(None),
            Some(since) => Start::Time(since),
            None => Start::Sequence(1),
        };
        loop {
            let batch = self
                .inner
                .direct
                .batch(start, &subject, DIRECT_BATCH_MESSAGES_MAX)
                .await
                .map_err(|e| read_unavailable(format!("scanning {aggregate}: {e}")))?;
            let Some(tail) = batch.messages.last().map(|m| m.sequence) else {
                return Ok(None);
            };
            for msg in batch.messages {
                if msg.sequence > last.sequence {
                    return Ok(None);
                }
                if let Ok(commit) = codec::decode(&msg.payload, msg.sequence) {
                    // Only this aggregate's own, intact commits count as an earlier append.
                    if commit.aggregate == *aggregate
                        && commit.hash_is_valid()
                        && commit.commit_id == commit_id
                    {
                        return Ok(Some(commit));
                    }
                }
            }
            if tail >= last.sequence {
                return Ok(None);
            }
            start = Start::Sequence(tail + 1);
        }
    }

    /// An ordered consumer for the live tail (`subscribe` holds its permit, one of
    /// [`SUBSCRIPTIONS_MAX`]).
    async fn ordered(
        &self,
        filter_subject: String,
        deliver_policy: consumer::DeliverPolicy,
    ) -> Result<consumer::pull::Ordered, String> {
        self.inner
            .stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subject,
                deliver_policy,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("creating ordered consumer: {e}"))?
            .messages()
            .await
            .map_err(|e| format!("starting ordered consumer: {e}"))
    }

    /// Publishes sealed commits as one JetStream atomic batch (ADR-50): the first message
    /// opens the batch (a request, acknowledged empty), the middle ones follow without a
    /// reply (a lost one leaves a gap the server refuses the batch for), the last commits
    /// it and is answered with the batch's pub ack. Each message carries its subject's
    /// expected last sequence and its commit id as `Nats-Msg-Id`.
    /// A batch refused because too many are in flight is sent again (a new batch id; the
    /// refused one stored nothing) with a growing pause, for at most
    /// [`BATCH_BUSY_WAIT_MAX`]: a writer waits its turn rather than being told the log is
    /// unavailable because others write.
    async fn publish_batch(&self, messages: Vec<BatchMessage>) -> BatchAck {
        // An empty batch has no last message to commit it: the server would never answer.
        assert!(!messages.is_empty(), "an atomic batch of no message");
        let Ok(_turn) = self.inner.batches.acquire().await else {
            return BatchAck::Unavailable("the append window is closed".into());
        };
        let started = std::time::Instant::now();
        let mut pause = Duration::from_millis(2);
        loop {
            match self.publish_batch_once(&messages).await {
                BatchAck::Busy if started.elapsed() < BATCH_BUSY_WAIT_MAX => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                BatchAck::Busy => {
                    return BatchAck::Unavailable(format!(
                    "the stream had too many atomic batches in flight for {BATCH_BUSY_WAIT_MAX:?}"
                ))
                }
                other => return other,
            }
        }
    }

    async fn publish_batch_once(&self, messages: &[BatchMessage]) -> BatchAck {
        let client = self.inner.context.client();
        let batch_id = Uuid::new_v4().to_string();
        let count = messages.len();
        // One permit for the batch, like one append (see MAX_ACK_INFLIGHT).
        let Ok(_permit) = self.inner.window.acquire().await else {
            return BatchAck::Unavailable("the append window is closed".into());
        };
        for (i, (subject, expected_sequence, commit_id, bytes)) in messages.iter().enumerate() {
            let mut headers = batch_headers(&batch_id, i + 1, *expected_sequence, commit_id);
            let last = i + 1 == count;
            if last {
                headers.insert("Nats-Batch-Commit", "1");
            }
            if i == 0 || last {
                let reply =
                    match batch_request(&client, subject, headers, bytes.clone().into()).await {
                        Ok(reply) => reply,
                        Err(ack) => return ack,
                    };
                match reply {
                    BatchReply::Started if !last => {}
                    early @ BatchReply::Stored { .. } if !last => {
                        return BatchAck::Unavailable(format!(
                            "atomic batch to {subject}: {}",
                            early.describe()
                        ))
                    }
                    BatchReply::Refused { err_code, .. } if i == 0 => {
                        return BatchAck::of_opening_refusal(err_code)
                            .unwrap_or_else(|| reply.commit_ack(subject, count))
                    }
                    reply => return reply.commit_ack(subject, count),
                }
            } else if let Err(e) = client
                .publish_with_headers(subject.clone(), headers, bytes.clone().into())
                .await
            {
                return BatchAck::Unavailable(format!("batch to {subject}: {e}"));
            }
        }
        BatchAck::Unavailable("an atomic batch needs at least one commit".into())
    }

    /// The heads of the batch's aggregates: cached, or read for those not known (a new
    /// aggregate expected empty needs no read).
    async fn batch_heads(&self, items: &[AtomicItem]) -> Result<Vec<Head>, AppendError> {
        let mut heads = Vec::with_capacity(items.len());
        for item in items {
            heads.push(match self.cached_head(&item.aggregate) {
                Some(h) => h,
                None if item.expect == Expectation::NoStream => EMPTY_HEAD,
                None => self.fetch_head(&item.aggregate).await?,
            });
        }
        Ok(heads)
    }

    /// A batch refused for its expectations, unless it is a retry of one already written
    /// (its ack lost): then each commit's earlier outcome.
    async fn conflicts_or_retry(
        &self,
        items: &[AtomicItem],
        conflicts: Vec<VersionConflict>,
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        let found = self.find_batch(items).await?;
        if found.iter().any(Option::is_some) {
            return recognise_batch_retry(items, &found);
        }
        Err(AppendError::Conflicts { conflicts })
    }

    /// A set the server refused for its expectations once published. If this handle sent
    /// one of its ids without an answer, the set is first looked for where that attempt,
    /// sealed on the same heads, would have landed ([`Self::landed_after`]): found whole, it
    /// is that attempt's outcome. Else a refusal at once when every id is young enough for
    /// the duplicate window (another process's attempt that landed is found by the write
    /// path's re-read, `record_atomic`), or as [`Self::conflicts_or_retry`] (a scan since
    /// each id was minted).
    async fn refused_after_publish(
        &self,
        items: &[AtomicItem],
        sealed_on: &[SealedOn],
        conflicts: Vec<VersionConflict>,
    ) -> SetAnswer {
        if items
            .iter()
            .any(|i| self.was_unanswered(&i.draft.commit_id))
        {
            let mut landed = Vec::with_capacity(items.len());
            for (item, on) in items.iter().zip(sealed_on) {
                landed.push(
                    self.landed_after(&item.aggregate, on.sequence, &item.draft)
                        .await?,
                );
            }
            if landed.iter().all(Option::is_some) {
                return recognise_batch_retry(items, &landed);
            }
        }
        if items
            .iter()
            .all(|i| !self.maybe_late_retry(&i.draft.commit_id))
        {
            return Err(AppendError::Conflicts { conflicts });
        }
        self.conflicts_or_retry(items, conflicts).await
    }

    /// Each item's commit id looked up on its aggregate.
    async fn find_batch(&self, items: &[AtomicItem]) -> Result<Vec<Option<Commit>>, AppendError> {
        let mut found = Vec::with_capacity(items.len());
        for item in items {
            found.push(
                self.find_commit(item.aggregate, item.draft.commit_id)
                    .await
                    .map_err(|e| unavailable(e.to_string()))?,
            );
        }
        Ok(found)
    }

    async fn conflict_or_retry(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: &CommitDraft,
        actual: u64,
    ) -> Result<AppendOutcome, AppendError> {
        match self.find_retry(&aggregate, draft).await? {
            Some(outcome) => Ok(outcome),
            None => Err(AppendError::Conflict {
                aggregate,
                expected: expect,
                actual,
            }),
        }
    }

    /// The live tail: consumer messages decoded into commits. The permit (one of
    /// [`SUBSCRIPTIONS_MAX`]) is held as long as the stream lives.
    fn live_stream(
        &self,
        messages: consumer::pull::Ordered,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> CommitStream {
        let prefix = self.inner.config.subject_prefix.clone();
        futures::stream::unfold(
            (messages, permit, false),
            move |(mut messages, permit, done)| {
                let prefix = prefix.clone();
                async move {
                    if done {
                        return None;
                    }
                    let (item, done) = match messages.next().await? {
                        Ok(msg) => {
                            let position = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
                            let item = stored_commit(&prefix, &msg.subject, position, &msg.payload);
                            (item, false)
                        }
                        // An unavailable tail ends the stream: its reader re-subscribes.
                        Err(e) => (Err(read_unavailable(e)), true),
                    };
                    Some((item, (messages, permit, done)))
                }
            },
        )
        .boxed()
    }

    /// Every commit from `from` to `to` (inclusive), for a reader that knows `to` is stored
    /// (a position it applied): [`EventLog::read_all`] without asking the stream for its end
    /// first, which costs a page reader (`q.changes`) a round trip per page.
    pub fn read_range(&self, from: u64, to: u64) -> CommitStream {
        if from.max(1) > to {
            return futures::stream::empty().boxed();
        }
        self.range_stream(from, to, None)
    }

    /// `aggregate`'s commits from position `from` to `to` (inclusive), for a reader that
    /// knows `to` is stored: read by its subject, so what it costs follows the aggregate's
    /// commits in the range, not the range (a follower of one aggregate checking it missed
    /// nothing since its position).
    pub fn read_aggregate_range(&self, aggregate: AggregateId, from: u64, to: u64) -> CommitStream {
        if from.max(1) > to {
            return futures::stream::empty().boxed();
        }
        self.range_stream(from, to, Some(self.inner.config.subject_for(&aggregate)))
    }

    /// Every message from `from` to `end` (inclusive) on the event subjects, or on the one
    /// `subject` given, decoded, read in batch direct gets: no consumer.
    fn range_stream(&self, from: u64, end: u64, subject: Option<String>) -> CommitStream {
        let direct = self.inner.direct.clone();
        let prefix = self.inner.config.subject_prefix.clone();
        // On every subject, a message is stored at each position up to `end`, so a batch
        // that ends early comes from a replica behind; on one subject the batch ends where
        // the subject's messages do.
        let one_subject = subject.is_some();
        let filter: std::sync::Arc<str> =
            subject.unwrap_or_else(|| ALL_SUBJECTS.to_string()).into();
        // Every subject (`ALL_SUBJECTS`): the stream holds exactly the event subjects
        // (`verify_stream_config`), so this reads the same messages as `<prefix>.ev.>`; but
        // the server counts what remains after each batch in O(1) for `>`, where for
        // `<prefix>.ev.>` it walks every aggregate's subject (seconds per 100 batches on a
        // million-commit stream). Up to the batch size, never past `end`: a reader of a few
        // commits asks for a few.
        let fetch = move |direct: DirectReader, next: u64| {
            let max = usize::try_from(end - next + 1).map_or(DIRECT_BATCH_MESSAGES_MAX, |n| {
                n.min(DIRECT_BATCH_MESSAGES_MAX)
            });
            let filter = filter.clone();
            AbortOnDrop(tokio::spawn(async move {
                let batch = direct.batch(Start::Sequence(next), &filter, max).await;
                (next, batch)
            }))
        };
        let first = (from.max(1) <= end).then(|| fetch(direct.clone(), from.max(1)));
        // Each batch is asked for as soon as the one before it arrived, before that one is
        // decoded: the server sends the next while this reader decodes (and its caller
        // writes) the last.
        let batches = futures::stream::unfold(first, move |asked| {
            let direct = direct.clone();
            let prefix = prefix.clone();
            let fetch = fetch.clone();
            async move {
                let mut asked = asked?;
                let (next, batch) = match (&mut asked.0).await {
                    Ok(answer) => answer,
                    Err(e) => {
                        let error = read_unavailable(format!("a batch read's task failed: {e}"));
                        return Some((vec![Err(error)], None));
                    }
                };
                let batch = match batch {
                    Ok(batch) => batch,
                    Err(e) => {
                        let error = read_unavailable(format!("reading from position {next}: {e}"));
                        return Some((vec![Err(error)], None));
                    }
                };
                let Some(last) = batch.messages.last().map(|m| m.sequence) else {
                    if one_subject {
                        // Nothing more on the subject.
                        return None;
                    }
                    // Nothing where the leader said there is: a lagging replica answered.
                    let error = read_unavailable(super::direct::behind(next, end));
                    return Some((vec![Err(error)], None));
                };
                let more = !one_subject || batch.pending > 0;
                let following = (last < end && more).then(|| fetch(direct, last + 1));
                let items: Vec<_> = batch
                    .messages
                    .iter()
                    .filter(|m| m.sequence <= end)
                    .map(|m| stored_commit(&prefix, &m.subject, m.sequence, &m.payload))
                    .collect();
                Some((items, following))
            }
        });
        batches.flat_map(futures::stream::iter).boxed()
    }

    async fn stream_last_sequence(&self) -> Result<u64, ReadError> {
        let info = self
            .inner
            .stream
            .get_info()
            .await
            .map_err(read_unavailable)?;
        Ok(info.state.last_sequence)
    }
}

/// A set sealed on its aggregates' heads, ready to publish: its commits and their messages
/// (subject, expected last subject sequence, commit id, bytes).
struct SealedSet {
    commits: Vec<Commit>,
    messages: Vec<BatchMessage>,
}

type BatchMessage = (String, u64, Uuid, Vec<u8>);

/// The messages of sealed sets, in order.
fn messages_in(ready: &[(usize, SealedSet)]) -> impl Iterator<Item = &BatchMessage> {
    ready.iter().flat_map(|(_, set)| set.messages.iter())
}

/// What one message of a set was sealed on: its subject's expected last sequence and the
/// version of the head it extends.
#[derive(Clone, Copy)]
struct SealedOn {
    sequence: u64,
    version: u64,
}

impl SealedSet {
    fn sealed_on(&self) -> Vec<SealedOn> {
        self.commits
            .iter()
            .zip(&self.messages)
            .map(|(c, (_, sequence, _, _))| SealedOn {
                sequence: *sequence,
                version: c.version - 1,
            })
            .collect()
    }
}

/// What reading a refused batch's subjects again found.
enum Recheck {
    /// Sets refused: their aggregates moved to versions their expectations do not admit.
    Conflicts(Vec<VersionConflict>),
    /// Whether any subject moved (its head was read again for the next seal).
    Moved(bool),
}

impl JetStreamLog {
    /// How many group writes of atomic sets this handle (and its clones) made, and how many
    /// sets they held.
    pub fn group_stats(&self) -> GroupStats {
        self.inner.groups.written()
    }

    /// Seals `items` on their heads (cached, or read), each checked first: a head that
    /// does not admit its item ([`Head::admits`]) is read again from the server, and only
    /// then is the set refused (a loss, or `Err(conflicts)`), because the cache may be
    /// stale.
    async fn seal_set(
        &self,
        items: &[AtomicItem],
    ) -> Result<Result<SealedSet, Vec<VersionConflict>>, AppendError> {
        let mut heads = self.batch_heads(items).await?;
        let mut conflicts = Vec::new();
        for (item, head) in items.iter().zip(heads.iter_mut()) {
            if !head.admits(item.expect, &item.draft) {
                *head = self.fetch_head(&item.aggregate).await?;
            }
            crate::loss::admits(&item.draft, head.open.as_slice())?;
            if !item.expect.admits(head.version) {
                conflicts.push(VersionConflict {
                    aggregate: item.aggregate,
                    expected: item.expect,
                    actual: head.version,
                });
            }
        }
        if !conflicts.is_empty() {
            return Ok(Err(conflicts));
        }
        let mut commits = Vec::with_capacity(items.len());
        let mut messages = Vec::with_capacity(items.len());
        for (item, head) in items.iter().zip(&heads) {
            let commit = Commit::seal(
                item.aggregate,
                head.version + 1,
                head.hash,
                item.draft.clone(),
            );
            let bytes = encode_for_append(&commit)?;
            let subject = self.inner.config.subject_for(&item.aggregate);
            messages.push((subject, head.sequence, item.draft.commit_id, bytes));
            commits.push(commit);
        }
        Ok(Ok(SealedSet { commits, messages }))
    }

    /// The outcomes of sets stored together by one batch whose last message got
    /// `last_sequence`: the batch's messages take consecutive sequences, set after set.
    fn stored_outcomes(&self, sets: &[&SealedSet], last_sequence: u64) -> Vec<Vec<AppendOutcome>> {
        let total: usize = sets.iter().map(|s| s.commits.len()).sum();
        assert!(
            total as u64 <= last_sequence,
            "a batch of {total} messages acknowledged at sequence {last_sequence}"
        );
        let mut sequence = last_sequence + 1 - total as u64;
        let mut outcomes = Vec::with_capacity(sets.len());
        for set in sets {
            let mut answer = Vec::with_capacity(set.commits.len());
            for commit in &set.commits {
                if crate::loss::acknowledged_range(&commit.events).is_some() {
                    // Which losses remain open is learnt by the next read of the subject.
                    self.forget_head(&commit.aggregate);
                } else {
                    self.remember_head(
                        commit.aggregate,
                        Head::at(commit.version, sequence, commit.hash),
                    );
                }
                answer.push(AppendOutcome {
                    position: sequence,
                    version: commit.version,
                    status: AppendStatus::Appended,
                });
                sequence += 1;
            }
            outcomes.push(answer);
        }
        outcomes
    }

    /// One atomic set in a batch of its own.
    async fn append_set(&self, items: Vec<AtomicItem>) -> SetAnswer {
        for _ in 0..APPEND_ATTEMPTS_MAX {
            let sealed = match self.seal_set(&items).await? {
                Ok(sealed) => sealed,
                Err(conflicts) => return self.conflicts_or_retry(&items, conflicts).await,
            };
            match self.publish_batch(sealed.messages.clone()).await {
                BatchAck::Stored { last_sequence } => {
                    let mut outcomes = self.stored_outcomes(&[&sealed], last_sequence);
                    return Ok(outcomes.remove(0));
                }
                // A subject moved since the heads used: read them again; the expectations
                // are checked on what is read (a message outside a chain moves its subject
                // but not its version, and the batch then goes on after it).
                BatchAck::WrongLastSequence => {
                    let on = sealed.sealed_on();
                    if let Recheck::Conflicts(conflicts) = self.recheck(&items, on.clone()).await? {
                        return self.refused_after_publish(&items, &on, conflicts).await;
                    }
                }
                BatchAck::DuplicateId => return self.duplicate_in_set(&items).await,
                BatchAck::TooLarge => {
                    return Err(unavailable(format!(
                        "nats-server takes fewer than {} messages in one atomic batch (its max_batch_size)",
                        items.len()
                    )))
                }
                BatchAck::Unavailable(reason) => {
                    self.note_unanswered(items.iter().map(|i| &i.draft.commit_id));
                    return Err(AppendError::Unavailable { reason });
                }
                // publish_batch has already waited its bound for a turn.
                BatchAck::Busy => {
                    return Err(unavailable(
                        "the stream had too many atomic batches in flight",
                    ))
                }
            }
        }
        Err(unavailable(format!(
            "an atomic batch of {} commits lost the race {APPEND_ATTEMPTS_MAX} times in a row; retry later",
            items.len()
        )))
    }

    /// A set refused because one of its commit ids is in the duplicate window: the earlier
    /// append's outcome, if it is the same set.
    async fn duplicate_in_set(&self, items: &[AtomicItem]) -> SetAnswer {
        let found = self.find_batch(items).await?;
        // An atomic batch is stored whole or not at all: finding part of it, each part the
        // same commit, means a reader lagged (a follower answered); a found commit that
        // differs is a reused id.
        let same = items.iter().zip(&found).all(|(item, f)| {
            f.as_ref()
                .is_none_or(|c| c.retry_outcome(item.aggregate, &item.draft).is_ok())
        });
        if same && found.iter().any(Option::is_none) && found.iter().any(Option::is_some) {
            return Err(unavailable(
                "part of an atomic batch found after a duplicate id; retry",
            ));
        }
        recognise_batch_retry(items, &found)
    }

    /// Several atomic sets in one batch, each answered on its own. A set whose expectation
    /// fails on the heads is refused alone before anything is sent. A batch the server
    /// refuses for a moved subject is sent again without the sets refused on the heads read
    /// then; when the heads do not tell which set was refused (a lagging replica answered,
    /// or a publish was still in flight), or a commit id is a duplicate, each set is sent
    /// in a batch of its own, so one stale set never sinks the others.
    async fn write_group(&self, sets: Vec<Vec<AtomicItem>>) -> Vec<SetAnswer> {
        let answers: Vec<Option<SetAnswer>> = (0..sets.len()).map(|_| None).collect();
        let open: Vec<usize> = (0..sets.len()).collect();
        self.write_rounds(&sets, answers, open, 0).await
    }

    /// The `open` sets of `sets`, sealed and sent as one batch per round from round
    /// `first`, until each is answered; every set answered at the end.
    async fn write_rounds(
        &self,
        sets: &[Vec<AtomicItem>],
        mut answers: Vec<Option<SetAnswer>>,
        mut open: Vec<usize>,
        first: usize,
    ) -> Vec<SetAnswer> {
        for round in first..GROUP_ROUNDS_MAX {
            if open.is_empty() {
                break;
            }
            let ready = self.seal_open(sets, &open, &mut answers).await;
            if ready.is_empty() {
                break;
            }
            let ack = self
                .publish_batch(messages_in(&ready).cloned().collect())
                .await;
            open = self
                .settle_group(sets, &ready, round, ack, &mut answers)
                .await;
        }
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    Err(unavailable(format!(
                        "a group of atomic sets was refused {GROUP_ROUNDS_MAX} times in a row; retry later"
                    )))
                })
            })
            .collect()
    }

    /// A group written under load, as it comes: the batch opens with `head`'s sets without
    /// waiting for the server, while `more` lingers for the other writers' next sets; they
    /// follow in the same batch, and an end-of-batch marker commits it ([`StreamedBatch`]).
    /// Why: opening an atomic batch costs the server a store of its own to stage the batch
    /// in (2.3 ms on nats-server 2.15.1, measured with `write-bench --only pairs`), which
    /// overlaps the time the writers answered by the last write take to send their next
    /// sets. A batch the server did not know at its commit (nothing stored) is sent again
    /// as an ordinary one; any other answer is settled as an ordinary batch's.
    async fn write_group_streamed(
        &self,
        head: Vec<Vec<AtomicItem>>,
        more: impl Future<Output = Vec<Vec<AtomicItem>>> + Send,
    ) -> Vec<SetAnswer> {
        let mut sets = head;
        let mut answers: Vec<Option<SetAnswer>> = (0..sets.len()).map(|_| None).collect();
        let head_open: Vec<usize> = (0..sets.len()).collect();
        let mut ready = self.seal_open(&sets, &head_open, &mut answers).await;
        let client = self.inner.context.client();
        // One turn among the batches in flight and one permit of the ack window, like an
        // ordinary batch (see MAX_ACK_INFLIGHT).
        let turn = self.inner.batches.acquire().await;
        let permit = self.inner.window.acquire().await;
        self.inner.groups.count_opened_early();
        let mut batch = StreamedBatch::open();
        let mut sent = match (&turn, &permit) {
            (Ok(_), Ok(_)) => batch.send(&client, messages_in(&ready)).await,
            _ => Err("the append window is closed".to_string()),
        };
        sets.extend(more.await);
        answers.resize_with(sets.len(), || None);
        let rest_open: Vec<usize> = (head_open.len()..sets.len()).collect();
        // A set its heads refuse is answered after the commit: finding out whether it is a
        // retry may read the log, and the batch holds one of the server's in-flight slots.
        let (rest, refused) = self.seal_only(&sets, &rest_open, &mut answers).await;
        if sent.is_ok() {
            sent = batch.send(&client, messages_in(&rest)).await;
        }
        ready.extend(rest);
        let committed = match (ready.is_empty(), sent) {
            // Every set was answered on its heads: nothing was sent.
            (true, _) => None,
            (false, Ok(())) => Some(batch.commit(&client).await),
            (false, Err(reason)) => Some(Ok(BatchAck::Unavailable(reason))),
        };
        drop((permit, turn));
        self.answer_refused(&sets, refused, &mut answers).await;
        match committed {
            None => self.write_rounds(&sets, answers, Vec::new(), 0).await,
            Some(Ok(ack)) => {
                let open = self.settle_group(&sets, &ready, 0, ack, &mut answers).await;
                self.write_rounds(&sets, answers, open, 1).await
            }
            Some(Err(NotOpened)) => {
                tracing::debug!(
                    sets = ready.len(),
                    "an atomic batch opened early was unknown at its commit; sending it again"
                );
                self.inner.groups.count_sent_again();
                let open = ready.iter().map(|(s, _)| *s).collect();
                self.write_rounds(&sets, answers, open, 0).await
            }
        }
    }

    /// Seals each of the `open` sets on its aggregates' heads, side by side: the sets ready
    /// to publish. A set its heads refuse, or that cannot be sealed, is answered.
    async fn seal_open(
        &self,
        sets: &[Vec<AtomicItem>],
        open: &[usize],
        answers: &mut [Option<SetAnswer>],
    ) -> Vec<(usize, SealedSet)> {
        let (ready, refused) = self.seal_only(sets, open, answers).await;
        self.answer_refused(sets, refused, answers).await;
        ready
    }

    /// Seals each of the `open` sets on its aggregates' heads, side by side: the sets ready
    /// to publish, and those the heads refuse (to answer with [`Self::answer_refused`]). A
    /// set that cannot be sealed is answered.
    async fn seal_only(
        &self,
        sets: &[Vec<AtomicItem>],
        open: &[usize],
        answers: &mut [Option<SetAnswer>],
    ) -> (Vec<(usize, SealedSet)>, Vec<(usize, Vec<VersionConflict>)>) {
        let sealing =
            futures::future::join_all(open.iter().map(|&s| self.seal_set(&sets[s]))).await;
        let mut ready: Vec<(usize, SealedSet)> = Vec::with_capacity(open.len());
        let mut refused = Vec::new();
        for (&s, sealed) in open.iter().zip(sealing) {
            match sealed {
                Ok(Ok(sealed)) => ready.push((s, sealed)),
                Ok(Err(conflicts)) => refused.push((s, conflicts)),
                Err(e) => answers[s] = Some(Err(e)),
            }
        }
        (ready, refused)
    }

    /// Answers the sets the heads refused: refused, or the earlier outcome of a retry (which
    /// may read the log to find out).
    async fn answer_refused(
        &self,
        sets: &[Vec<AtomicItem>],
        refused: Vec<(usize, Vec<VersionConflict>)>,
        answers: &mut [Option<SetAnswer>],
    ) {
        for (s, conflicts) in refused {
            answers[s] = Some(self.conflicts_or_retry(&sets[s], conflicts).await);
        }
    }

    /// Answers the `ready` sets of round `round` that the server's answer `ack` to their
    /// batch settles: the sets left to seal and send again in the next round (none once
    /// every set is answered).
    async fn settle_group(
        &self,
        sets: &[Vec<AtomicItem>],
        ready: &[(usize, SealedSet)],
        round: usize,
        ack: BatchAck,
        answers: &mut [Option<SetAnswer>],
    ) -> Vec<usize> {
        match ack {
            BatchAck::Stored { last_sequence } => {
                let sealed: Vec<&SealedSet> = ready.iter().map(|(_, set)| set).collect();
                let outcomes = self.stored_outcomes(&sealed, last_sequence);
                for ((s, _), outcome) in ready.iter().zip(outcomes) {
                    answers[*s] = Some(Ok(outcome));
                }
                Vec::new()
            }
            BatchAck::WrongLastSequence => {
                self.after_group_moved(sets, ready, round, answers).await
            }
            // A duplicate id, or more messages than this server takes in one batch
            // (its `max_batch_size` below 1,000): each set alone.
            BatchAck::DuplicateId | BatchAck::TooLarge => {
                let open: Vec<usize> = ready.iter().map(|(s, _)| *s).collect();
                self.each_alone(sets, &open, answers).await;
                Vec::new()
            }
            BatchAck::Unavailable(reason) => {
                for (s, _) in ready {
                    self.note_unanswered(sets[*s].iter().map(|i| &i.draft.commit_id));
                    answers[*s] = Some(Err(AppendError::Unavailable {
                        reason: reason.clone(),
                    }));
                }
                Vec::new()
            }
            BatchAck::Busy => {
                for (s, _) in ready {
                    answers[*s] = Some(Err(unavailable(
                        "the stream had too many atomic batches in flight",
                    )));
                }
                Vec::new()
            }
        }
    }

    /// After the server refused a group's batch for a moved subject, in round `round`: a
    /// set sealed on a head that no longer admits it is refused alone, and the sets left to
    /// seal and send again are returned; none when each set went alone instead.
    async fn after_group_moved(
        &self,
        sets: &[Vec<AtomicItem>],
        ready: &[(usize, SealedSet)],
        round: usize,
        answers: &mut [Option<SetAnswer>],
    ) -> Vec<usize> {
        let rechecks = futures::future::join_all(
            ready
                .iter()
                .map(|(s, sealed)| self.recheck(&sets[*s], sealed.sealed_on())),
        )
        .await;
        let mut open = Vec::with_capacity(ready.len());
        let mut moved = false;
        for ((s, sealed), recheck) in ready.iter().zip(rechecks) {
            match recheck {
                // The set sealed on a moved head that no longer admits it is
                // refused alone.
                Ok(Recheck::Conflicts(conflicts)) => {
                    let on = sealed.sealed_on();
                    answers[*s] = Some(self.refused_after_publish(&sets[*s], &on, conflicts).await);
                    moved = true;
                }
                Ok(Recheck::Moved(m)) => {
                    moved |= m;
                    open.push(*s);
                }
                Err(e) => answers[*s] = Some(Err(e)),
            }
        }
        // No subject moved, the heads do not tell which set was refused; or a
        // subject moved again in the second round (a hot aggregate another
        // process writes): each set goes alone rather than the whole group
        // losing race after race.
        if !moved || round + 1 == GROUP_ROUNDS_MAX {
            self.each_alone(sets, &open, answers).await;
            return Vec::new();
        }
        open
    }

    /// Each of the `open` sets in a batch of its own, side by side.
    async fn each_alone(
        &self,
        sets: &[Vec<AtomicItem>],
        open: &[usize],
        answers: &mut [Option<SetAnswer>],
    ) {
        let alone =
            futures::future::join_all(open.iter().map(|&s| self.append_set(sets[s].clone()))).await;
        for (&s, answer) in open.iter().zip(alone) {
            answers[s] = Some(answer);
        }
    }
}

impl SetWriter for JetStreamLog {
    async fn write_sets(&self, mut sets: Vec<Vec<AtomicItem>>) -> Vec<SetAnswer> {
        match sets.len() {
            1 => vec![self.append_set(sets.remove(0)).await],
            _ => self.write_group(sets).await,
        }
    }

    async fn write_sets_streamed<'a>(
        &'a self,
        head: Vec<Vec<AtomicItem>>,
        more: impl Future<Output = Vec<Vec<AtomicItem>>> + Send + 'a,
    ) -> Vec<SetAnswer> {
        match self.inner.opens_early {
            true => self.write_group_streamed(head, more).await,
            false => group_commit::write_whole(self, head, more).await,
        }
    }

    fn group_commit(&self) -> &GroupCommit {
        &self.inner.groups
    }
}

/// One commit appended on its own (`EventLog::append`): the steps of its attempts.
impl JetStreamLog {
    /// The head an append of `draft` seals on: the cached one (a new aggregate needs none),
    /// read again from the server when it does not admit `draft` ([`Head::admits`]). Breaks with the earlier
    /// outcome of a retry the server's view refuses; a loss or a conflict is the error.
    async fn head_admitting(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: &CommitDraft,
    ) -> Result<ControlFlow<AppendOutcome, Head>, AppendError> {
        let mut head = match self.cached_head(&aggregate) {
            Some(h) => h,
            // A new aggregate needs no lookup: expected subject sequence 0 makes the
            // server refuse the publish if the aggregate exists after all.
            None if expect == Expectation::NoStream => EMPTY_HEAD,
            None => self.fetch_head(&aggregate).await?,
        };
        if !head.admits(expect, draft) {
            head = self.fetch_head(&aggregate).await?;
        }
        // A loss answers before any expectation: `conflict` would invite a write at
        // the version before the gap, which forks the chain.
        crate::loss::admits(draft, head.open.as_slice())?;
        if !expect.admits(head.version) {
            return self
                .conflict_or_retry(aggregate, expect, draft, head.version)
                .await
                .map(ControlFlow::Break);
        }
        Ok(ControlFlow::Continue(head))
    }

    /// Publishes `commit` on `subject`, expecting `expected_sequence` as the subject's last
    /// message, within the window of in-flight acks: the server's ack or refusal, or
    /// `Unavailable` when the publish could not be sent.
    async fn publish_commit(
        &self,
        subject: &str,
        commit: &Commit,
        expected_sequence: u64,
    ) -> Result<Result<PublishAck, PublishError>, AppendError> {
        let bytes = encode_for_append(commit)?;
        let publish = jetstream::message::PublishMessage::build()
            .payload(bytes.into())
            .message_id(message_id(&commit.commit_id))
            .expected_last_subject_sequence(expected_sequence);
        // The permit bounds sends plus outstanding acks (see MAX_ACK_INFLIGHT).
        let _permit = self.inner.window.acquire().await.map_err(unavailable)?;
        let ack_future = self
            .inner
            .context
            .send_publish(subject.to_string(), publish)
            .await
            .map_err(|e| unavailable(format!("publish to {subject}: {e}")))?;
        Ok(ack_future.await)
    }

    /// Remembers the head left by `commit`, sealed on `head` and stored at `sequence` (the
    /// losses it acknowledges closed), and answers the append.
    fn appended(
        &self,
        aggregate: AggregateId,
        head: &Head,
        commit: &Commit,
        sequence: u64,
    ) -> AppendOutcome {
        let mut open = head.open.clone();
        open.close_by(commit);
        self.remember_head(
            aggregate,
            Head {
                version: commit.version,
                sequence,
                hash: commit.hash,
                open,
            },
        );
        AppendOutcome {
            position: sequence,
            version: commit.version,
            status: AppendStatus::Appended,
        }
    }

    /// After the server refused a publish sealed on `head` because the subject moved:
    /// breaks with the outcome of an earlier attempt of this draft found landed, fails with
    /// a conflict when another writer's commit does not admit `expect`, or continues (the
    /// head read again) for another attempt.
    async fn after_subject_moved(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: &CommitDraft,
        head: &Head,
    ) -> Result<ControlFlow<AppendOutcome>, AppendError> {
        if let (_, Some(last)) = self.tail(&aggregate).await? {
            // This draft, landed by an earlier attempt whose answer was lost.
            if last.commit_id == draft.commit_id {
                return last.retry_outcome(aggregate, draft).map(ControlFlow::Break);
            }
            let actual = last.version;
            // Only a commit beyond the head sealed on is another writer's: an
            // older one is a replay outside the chain, for fetch_head below.
            if actual > head.version && !expect.admits(actual) {
                return self
                    .refused_by_another_writer(aggregate, expect, draft, head, actual)
                    .await
                    .map(ControlFlow::Break);
            }
        }
        // The cached head is still a valid prefix of the subject: only what
        // follows it is read.
        let fresh = self.fetch_head(&aggregate).await?;
        if !expect.admits(fresh.version) {
            return self
                .conflict_or_retry(aggregate, expect, draft, fresh.version)
                .await
                .map(ControlFlow::Break);
        }
        Ok(ControlFlow::Continue(()))
    }

    /// An append sealed on `head` whose subject another writer took to version `actual`,
    /// which `expect` does not admit: the outcome of this draft if an earlier attempt of it
    /// landed, else the conflict.
    async fn refused_by_another_writer(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: &CommitDraft,
        head: &Head,
        actual: u64,
    ) -> Result<AppendOutcome, AppendError> {
        // An attempt of this handle whose answer was lost may have
        // landed right after that head, others writing after it.
        if self.was_unanswered(&draft.commit_id) {
            if let Some(earlier) = self.landed_after(&aggregate, head.sequence, draft).await? {
                return earlier.retry_outcome(aggregate, draft);
            }
        }
        // Else an id young enough for the duplicate window needs no
        // scan: another process's attempt that landed is found by the
        // write path's re-read (`record`), which reads what is new.
        if !self.maybe_late_retry(&draft.commit_id) {
            return Err(AppendError::Conflict {
                aggregate,
                expected: expect,
                actual,
            });
        }
        self.conflict_or_retry(aggregate, expect, draft, actual)
            .await
    }
}

impl EventLog for JetStreamLog {
    async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        draft.validate(&aggregate)?;
        let subject = self.inner.config.subject_for(&aggregate);
        if self.maybe_late_retry(&draft.commit_id) && expect == Expectation::Any {
            if let Some(outcome) = self.find_retry(&aggregate, &draft).await? {
                return Ok(outcome);
            }
        }

        for _ in 0..APPEND_ATTEMPTS_MAX {
            let head = match self.head_admitting(aggregate, expect, &draft).await? {
                ControlFlow::Continue(head) => head,
                ControlFlow::Break(outcome) => return Ok(outcome),
            };
            let version = head.version + 1;
            let commit = Commit::seal(aggregate, version, head.hash, draft.clone());
            match self
                .publish_commit(&subject, &commit, head.sequence)
                .await?
            {
                Ok(ack) if ack.duplicate => {
                    // (Decoded at the ack's sequence, which is its position.)
                    let stored = self.commit_at(ack.sequence).await?;
                    return stored.retry_outcome(aggregate, &draft);
                }
                Ok(ack) => return Ok(self.appended(aggregate, &head, &commit, ack.sequence)),
                // The subject moved since the head we expected. Only the chain's version
                // decides a conflict: a message outside the chain (garbage, a replay) moves
                // the subject but not the version, and the append then goes on after it.
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                    if let ControlFlow::Break(outcome) = self
                        .after_subject_moved(aggregate, expect, &draft, &head)
                        .await?
                    {
                        return Ok(outcome);
                    }
                }
                Err(e) => {
                    self.note_unanswered(std::iter::once(&draft.commit_id));
                    return Err(unavailable(format!("ack from {subject}: {e}")));
                }
            }
        }
        Err(unavailable(format!(
            "{aggregate}: lost the race {APPEND_ATTEMPTS_MAX} times in a row; retry later"
        )))
    }

    async fn append_atomic(
        &self,
        items: Vec<AtomicItem>,
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        validate_batch(items.iter().map(|i| (i.aggregate, &i.draft)))?;
        group_commit::submit(self, items).await
    }

    async fn read_aggregate(&self, aggregate: AggregateId) -> Result<Vec<Commit>, ReadError> {
        let (history, open) = self.whole_history(aggregate).await?;
        if let Some(loss) = open.first() {
            return Err(ReadError::Lost(*loss));
        }
        Ok(history
            .into_iter()
            .filter_map(|e| match e {
                HistoryEntry::Commit(c) => Some(c),
                HistoryEntry::Quarantined { .. } | HistoryEntry::Lost(_) => None,
            })
            .collect())
    }

    async fn aggregate_history(
        &self,
        aggregate: AggregateId,
    ) -> Result<Vec<HistoryEntry>, ReadError> {
        Ok(self.whole_history(aggregate).await?.0)
    }

    async fn read_aggregate_after(
        &self,
        aggregate: AggregateId,
        after: ChainTip,
    ) -> Result<Vec<Commit>, ReadError> {
        // Start after what is known of the subject: the cached head if it is this tip (it
        // may sit past quarantined messages), else the tip's own commit.
        let cached = self
            .cached_head(&aggregate)
            .filter(|h| h.version == after.version && h.hash == after.hash);
        let start = cached
            .clone()
            .unwrap_or(Head::at(after.version, after.position, after.hash));
        let subject = self.inner.config.subject_for(&aggregate);
        let mut head = start.clone();
        let mut commits = Vec::new();
        let mut next = start.sequence + 1;
        loop {
            let batch = self
                .inner
                .direct
                .batch(Start::Sequence(next), &subject, DIRECT_BATCH_MESSAGES_MAX)
                .await
                .map_err(|e| read_unavailable(format!("reading {aggregate}: {e}")))?;
            // The end-of-batch status says how many more match after this batch.
            let more = batch.pending > 0;
            let Some(tail) = batch.messages.last().map(|m| m.sequence) else {
                break;
            };
            let mut entries = Vec::with_capacity(batch.messages.len());
            for msg in batch.messages {
                classify(
                    &aggregate,
                    &subject,
                    &mut head,
                    &msg.payload,
                    msg.sequence,
                    &mut entries,
                );
            }
            commits.extend(entries.into_iter().filter_map(|e| match e {
                HistoryEntry::Commit(c) => Some(c),
                _ => None,
            }));
            if !more {
                break;
            }
            next = tail + 1;
        }
        // A tip the caller brought is cached only once the log has confirmed it (it was
        // already cached, a commit read here links to it, or its own message matches): a
        // wrong one must not become the head the next append expects. Checking the message
        // costs one direct get, once per aggregate and process; without a cached head the
        // next append would read the whole subject.
        let confirmed =
            cached.is_some() || !commits.is_empty() || self.tip_is_stored(&aggregate, after).await;
        let lost = head.open.first().copied();
        if confirmed {
            self.remember_head(aggregate, head);
        }
        match lost {
            Some(loss) => Err(ReadError::Lost(loss)),
            None => Ok(commits),
        }
    }

    async fn read_position(&self, position: u64) -> Result<Option<Commit>, ReadError> {
        match self.commit_at(position).await {
            Ok(c) => Ok(Some(c)),
            Err(AppendError::Corrupt { .. }) => Ok(None),
            Err(e) => Err(read_unavailable(e)),
        }
    }

    async fn tip_is_current(
        &self,
        aggregate: AggregateId,
        tip: ChainTip,
    ) -> Result<bool, ReadError> {
        // STREAM.MSG.GET is answered by the stream's leader only (a direct get may be
        // answered by a follower or a mirror that lags behind).
        let subject = self.inner.config.subject_for(&aggregate);
        let leader_last = match self
            .inner
            .stream
            .get_last_raw_message_by_subject(&subject)
            .await
        {
            Ok(msg) => msg.sequence,
            Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => 0,
            Err(e) => {
                return Err(read_unavailable(format!(
                    "reading head of {aggregate}: {e}"
                )))
            }
        };
        // The subject's last message is the tip, or a message outside the chain after it
        // that this process has already read past.
        let known = self
            .cached_head(&aggregate)
            .filter(|h| h.version == tip.version && h.hash == tip.hash)
            .map_or(tip.position, |h| h.sequence);
        Ok(leader_last == known)
    }

    async fn find_commit(
        &self,
        aggregate: AggregateId,
        commit_id: Uuid,
    ) -> Result<Option<Commit>, ReadError> {
        let since = Self::retry_scan_since(&commit_id);
        tokio::time::timeout(
            RETRY_SCAN_TIMEOUT,
            self.scan_for_commit(&aggregate, commit_id, since),
        )
        .await
        .map_err(|_| {
            read_unavailable(format!(
                "scanning {aggregate} for commit {commit_id} took over {RETRY_SCAN_TIMEOUT:?}"
            ))
        })?
    }

    fn recognises_retry_on_append(&self, commit_id: &Uuid) -> bool {
        !self.maybe_late_retry(commit_id)
    }

    fn note_head(&self, aggregate: AggregateId, tip: ChainTip) {
        // Forward only (`remember_head`): a head this handle read or wrote since, or a
        // message outside the chain after the tip, is never replaced by an older one.
        self.remember_head(aggregate, Head::at(tip.version, tip.position, tip.hash));
    }

    fn holds_head(&self, aggregate: AggregateId, tip: ChainTip) -> bool {
        self.cached_head(&aggregate).is_some_and(|h| {
            h.version == tip.version
                && h.sequence == tip.position
                && h.hash == tip.hash
                && h.open.as_slice().is_empty()
        })
    }

    async fn read_all(&self, from: u64) -> Result<CommitStream, ReadError> {
        let last = self.stream_last_sequence().await?;
        let from = from.max(1);
        if from > last {
            return Ok(futures::stream::empty().boxed());
        }
        Ok(self.range_stream(from, last, None))
    }

    async fn subscribe(&self, from: u64) -> Result<CommitStream, ReadError> {
        let permit = self
            .inner
            .subscriptions
            .clone()
            .try_acquire_owned()
            .map_err(|_| {
                read_unavailable(format!(
                    "this process already follows the stream {SUBSCRIPTIONS_MAX} times (SUBSCRIPTIONS_MAX); drop a live tail first"
                ))
            })?;
        let messages = self
            .ordered(
                self.inner.config.all_subjects(),
                consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from.max(1),
                },
            )
            .await
            .map_err(read_unavailable)?;
        Ok(self.live_stream(messages, permit))
    }

    async fn last_position(&self) -> Result<u64, ReadError> {
        self.stream_last_sequence().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_ack_counting_another_size_than_was_sent_appends_nothing_known() {
        // given a server's ack naming a batch of 3 messages
        let ack = |sent| {
            parse_batch_reply(br#"{"stream":"S","seq":10,"batch":"b","count":3}"#)
                .commit_ack("s", sent)
        };
        // when 2 were sent (a 2.12.0 leader stored the end-of-batch marker), then the outcome
        // is unknown; when 3 were, the last is at 10
        assert!(matches!(ack(2), BatchAck::Unavailable(_)));
        assert!(matches!(ack(3), BatchAck::Stored { last_sequence: 10 }));
    }

    #[test]
    fn an_opening_refused_as_an_incomplete_batch_waits_its_turn() {
        // given the server's refusal of a batch as incomplete (nats-server 2.12's answer to
        // an opening when too many batches are in flight)
        let refusal = br#"{"error":{"code":400,"err_code":10176,"description":"atomic publish batch is incomplete"}}"#;
        let BatchReply::Refused { err_code, .. } = parse_batch_reply(refusal) else {
            panic!("not read as a refusal");
        };
        // when it answers the opening, then the batch was never opened: busy, sent again;
        // when it answers a commit, then the set is answered unavailable as before
        assert!(matches!(
            BatchAck::of_opening_refusal(err_code),
            Some(BatchAck::Busy)
        ));
        assert!(matches!(
            parse_batch_reply(refusal).commit_ack("s", 2),
            BatchAck::Unavailable(_)
        ));
    }

    #[test]
    fn server_versions_are_compared_numerically() {
        assert!(parse_server_version("2.9.10").unwrap() < SERVER_VERSION_MIN);
        assert!(parse_server_version("2.10.26").unwrap() < SERVER_VERSION_MIN);
        assert!(parse_server_version("2.11.4").unwrap() < SERVER_VERSION_MIN);
        assert!(parse_server_version("2.12.0").unwrap() >= SERVER_VERSION_MIN);
        assert!(parse_server_version("v2.14.6").unwrap() >= SERVER_VERSION_MIN);
        assert!(parse_server_version("2.12.0-beta.1").unwrap() >= SERVER_VERSION_MIN);
        assert_eq!(parse_server_version("garbage"), None);
    }

    #[test]
    fn a_stream_without_deny_purge_is_refused_by_name() {
        let cfg = JetStreamConfig::default();
        let want = cfg.stream_config();
        let mut got = want.clone();
        got.deny_purge = false;
        let err = verify_stream_config(&want, &got).unwrap_err();
        assert!(err.to_string().contains("deny_purge = false"), "{err}");
    }
}
