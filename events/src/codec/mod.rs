//! The one place that turns commits into bytes and back.
//!
//! Layout: one format byte, then the bincode 2 (serde, standard config) encoding of the
//! commit without its position. Format 1 holds every event at layout 1 and is what this
//! build writes while every event of a commit is at version 1; format 2 records each event's
//! layout version and is written only for a commit holding a changed event (see
//! `envelope.rs` for the layouts and `catalogue/versions.rs` for event versions). Format 3
//! adds the W3C trace context the commit was written in, and is written only for a commit
//! that records one (`trace.rs`). All three are read forever. Decoding never panics and never allocates beyond [`ENCODED_COMMIT_BYTES_MAX`]:
//! any bad input gives a [`DecodeError`].
//!
//! - `envelope.rs`: the borrowed and owned envelope, generic over the event enum; the body
//!   that both the encoder and the hash read; the readers of formats 1 to 3.
//! - `stored.rs`: an event as stored (its version and bytes) and how it is read into
//!   today's layout through the registry.

pub mod envelope;
pub mod stored;

use serde::Deserialize;
use uuid::Uuid;

use crate::catalogue::versions::Versioned;
use crate::commit::Commit;
use crate::ids::{AggregateId, Hash};

/// Format 1: `[1] ‖ header ‖ events at layout 1 ‖ prev_hash ‖ hash`. Frozen.
pub const FORMAT_1: u8 = 1;
/// Format 2: `[2] ‖ header ‖ events as (version, length, bytes) ‖ prev_hash ‖ hash`.
pub const FORMAT_2: u8 = 2;
/// Format 3: `[3] ‖ header ‖ trace context ‖ events as in format 2 ‖ prev_hash ‖ hash`.
pub const FORMAT_3: u8 = 3;
/// The newest format this build reads and may write.
pub const FORMAT_NEWEST: u8 = FORMAT_3;
/// Upper bound on one encoded commit; NATS' default max payload is 1 MiB.
pub const ENCODED_COMMIT_BYTES_MAX: usize = 1 << 20;

const DECODE_LIMIT_BYTES: usize = 4 << 20;

pub(crate) fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DECODE_LIMIT_BYTES>()
}

/// Why bytes could not be turned into a commit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty payload: expected a format-version byte then a bincode commit")]
    Empty,
    #[error(
        "unknown format version {found} (this build reads formats {FORMAT_1} to {FORMAT_NEWEST})"
    )]
    UnknownFormat { found: u8 },
    #[error("malformed commit: {0}")]
    Malformed(String),
    #[error("{count} trailing bytes after the commit")]
    TrailingBytes { count: usize },
    #[error("payload of {size} bytes exceeds the {max}-byte limit")]
    TooLarge { size: usize, max: usize },
    /// An event stored at a layout this build cannot read: newer than the one it knows
    /// (written by a newer build), or an old one without an upcaster.
    #[error("event #{index} (tag {tag}) is stored at layout version {version}, which this build cannot read (it knows up to version {newest})")]
    UnknownEventVersion {
        index: usize,
        tag: u32,
        version: u16,
        newest: u16,
    },
}

impl DecodeError {
    /// True when the bytes were most likely written by a newer build: a format or an event
    /// layout above what this build knows. Upgrading the reader fixes it; the bytes are not
    /// damaged.
    pub fn written_by_newer_build(&self) -> bool {
        match self {
            DecodeError::UnknownFormat { found } => *found > FORMAT_NEWEST,
            DecodeError::UnknownEventVersion {
                version, newest, ..
            } => version > newest,
            _ => false,
        }
    }
}

/// Why a commit could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("cannot encode commit: {0}")]
    Bincode(String),
    #[error(
        "cannot encode in format {format}: this build writes formats {FORMAT_1} to {FORMAT_NEWEST}"
    )]
    UnknownFormat { format: u8 },
    /// Format 3 is the one that holds a trace context: a traced commit is written in it, an
    /// untraced one never is.
    #[error("cannot encode in format {format}: a commit {} a trace context is written in format {FORMAT_3} {}", if *traced { "with" } else { "without" }, if *traced { "only" } else { "never" })]
    TraceNeedsFormat3 { format: u8, traced: bool },
    #[error("cannot encode in format 1: event #{index} is at layout version {version}, which only format 2 records")]
    NeedsFormat2 { index: usize, version: u16 },
}

/// The bytes of a commit, in the format it was stored in when it was decoded, else the
/// minimal one for its events.
pub fn encode(commit: &Commit) -> Result<Vec<u8>, EncodeError> {
    commit.envelope().encode(&commit.hash)
}

/// A commit in a given format with every event at its current version, sealed with the hash
/// of those bytes: for the golden pins of a format a writer would not pick. Not for writing
/// to a log (the written hash differs from `commit.hash` unless the format is the minimal
/// one, which breaks the link of the next commit).
#[doc(hidden)]
pub fn encode_as(commit: &Commit, format: u8) -> Result<Vec<u8>, EncodeError> {
    commit.envelope().encode_as(format).map(|(bytes, _)| bytes)
}

/// The hash of a commit: see `envelope.rs` for what it covers.
pub fn hash(commit: &Commit) -> Hash {
    commit.envelope().hash()
}

/// The leading fields of both formats: what a reader that only sorts commits by aggregate
/// decodes, without the events.
#[derive(Deserialize)]
struct WireHead {
    #[allow(dead_code)] // decoded only to reach the aggregate, which follows it
    commit_id: Uuid,
    aggregate: AggregateId,
}

/// The format byte, checked to be one this build reads, and the body after it.
fn split_format(bytes: &[u8]) -> Result<(u8, &[u8]), DecodeError> {
    let (&format, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if envelope::domain(format).is_none() {
        return Err(DecodeError::UnknownFormat { found: format });
    }
    Ok((format, body))
}

/// The aggregate of an encoded commit, decoding only the fields before it (a scan that
/// only needs to know which aggregates changed pays no event decoding).
pub fn decode_aggregate(bytes: &[u8]) -> Result<AggregateId, DecodeError> {
    let (_, body) = split_format(bytes)?;
    let (head, _): (WireHead, usize) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    Ok(head.aggregate)
}

/// Decodes an envelope of any event enum that has a registry.
pub fn decode_envelope<E: Versioned>(bytes: &[u8]) -> Result<envelope::Envelope<E>, DecodeError> {
    let (format, body) = split_format(bytes)?;
    if bytes.len() > DECODE_LIMIT_BYTES {
        return Err(DecodeError::TooLarge {
            size: bytes.len(),
            max: DECODE_LIMIT_BYTES,
        });
    }
    envelope::decode(format, body)
}

/// Decodes a commit stored at `position`.
pub fn decode(bytes: &[u8], position: u64) -> Result<Commit, DecodeError> {
    decode_envelope(bytes).map(|envelope| Commit::from_envelope(envelope, position))
}
