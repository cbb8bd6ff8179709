//! The one place that turns commits into bytes and back.
//!
//! Layout: one format-version byte, then the bincode 2 (serde, standard config) encoding of
//! the commit without its position. Decoding never panics and never allocates beyond
//! [`ENCODED_COMMIT_BYTES_MAX`]: any bad input gives a [`DecodeError`].

pub mod envelope;

use serde::Deserialize;
use uuid::Uuid;

use crate::catalogue::Event;
use crate::commit::Commit;
use crate::ids::{AggregateId, Hash, Timestamp};

/// The current encoding. Bump it (and keep a decoder for the old one) on any layout change.
pub const FORMAT_VERSION: u8 = 1;
/// Format 1: `[1] ‖ bincode(header, events, prev_hash) ‖ hash`.
pub(crate) const FORMAT_1: u8 = FORMAT_VERSION;
/// Upper bound on one encoded commit; NATS' default max payload is 1 MiB.
pub const ENCODED_COMMIT_BYTES_MAX: usize = 1 << 20;

const DECODE_LIMIT_BYTES: usize = 4 << 20;

pub(crate) fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DECODE_LIMIT_BYTES>()
}

#[derive(Deserialize)]
struct WireCommit {
    commit_id: Uuid,
    aggregate: AggregateId,
    version: u64,
    operation_id: Option<Uuid>,
    causation_id: Option<Uuid>,
    actor: String,
    recorded_at: Timestamp,
    events: Vec<Event>,
    prev_hash: Hash,
    hash: Hash,
}

/// Why bytes could not be turned into a commit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty payload: expected a format-version byte then a bincode commit")]
    Empty,
    #[error("unknown format version {found} (this build reads version {FORMAT_VERSION})")]
    UnknownFormat { found: u8 },
    #[error("malformed commit: {0}")]
    Malformed(String),
    #[error("{count} trailing bytes after the commit")]
    TrailingBytes { count: usize },
    #[error("payload of {size} bytes exceeds the {max}-byte limit")]
    TooLarge { size: usize, max: usize },
}

/// Why a commit could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("cannot encode commit: {0}")]
    Bincode(String),
}

pub fn encode(commit: &Commit) -> Result<Vec<u8>, EncodeError> {
    envelope::encode(&commit.envelope(), &commit.hash)
}

/// The hash of a commit: see [`envelope`] for what it covers.
pub fn hash(commit: &Commit) -> Hash {
    envelope::hash(&commit.envelope())
}

/// The leading fields of [`WireCommit`], in its order: what a reader that only sorts
/// commits by aggregate decodes, without the events.
#[derive(Deserialize)]
struct WireHead {
    #[allow(dead_code)] // decoded only to reach the aggregate, which follows it
    commit_id: Uuid,
    aggregate: AggregateId,
}

/// The aggregate of an encoded commit, decoding only the fields before it (a scan that
/// only needs to know which aggregates changed pays no event decoding).
pub fn decode_aggregate(bytes: &[u8]) -> Result<AggregateId, DecodeError> {
    let (&format, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if format != FORMAT_VERSION {
        return Err(DecodeError::UnknownFormat { found: format });
    }
    let (head, _): (WireHead, usize) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    Ok(head.aggregate)
}

/// Decodes a commit stored at `position`.
pub fn decode(bytes: &[u8], position: u64) -> Result<Commit, DecodeError> {
    let (&format, body) = bytes.split_first().ok_or(DecodeError::Empty)?;
    if format != FORMAT_VERSION {
        return Err(DecodeError::UnknownFormat { found: format });
    }
    if bytes.len() > DECODE_LIMIT_BYTES {
        return Err(DecodeError::TooLarge {
            size: bytes.len(),
            max: DECODE_LIMIT_BYTES,
        });
    }
    let (wire, read): (WireCommit, usize) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if read != body.len() {
        return Err(DecodeError::TrailingBytes {
            count: body.len() - read,
        });
    }
    Ok(Commit {
        commit_id: wire.commit_id,
        aggregate: wire.aggregate,
        version: wire.version,
        position,
        operation_id: wire.operation_id,
        causation_id: wire.causation_id,
        actor: wire.actor,
        recorded_at: wire.recorded_at,
        events: wire.events,
        prev_hash: wire.prev_hash,
        hash: wire.hash,
    })
}
