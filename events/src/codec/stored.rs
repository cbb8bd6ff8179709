//! Events as they were stored: their layout version and their bytes, and how to read them
//! into today's layout.

use std::sync::Arc;

use super::{config, DecodeError, EncodeError};
use crate::catalogue::versions::Versioned;

/// One event as written: its layout version and its bincode at that layout, tag first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEvent {
    pub version: u16,
    pub bytes: Box<[u8]>,
}

/// How a whole commit was written: its format byte and each event as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredForm {
    pub format: u8,
    pub events: Vec<StoredEvent>,
}

/// A commit's stored form, kept only when re-encoding its fields would not give its bytes
/// back (an event was upcast, or the format is not the minimal one for its versions), so the
/// hash and any re-encoding use what was written. Usually `None`, which costs one word.
///
/// Equality ignores it on purpose: how a commit was written is not part of what it is, and
/// its `hash` already says which bytes it came from.
#[derive(Debug, Clone, Default)]
pub struct Stored(pub(crate) Option<Arc<StoredForm>>);

impl Stored {
    pub(crate) fn new(form: StoredForm) -> Self {
        Stored(Some(Arc::new(form)))
    }

    /// True when this is the stored form of a decoded commit (for tests and the audit).
    pub fn is_kept(&self) -> bool {
        self.0.is_some()
    }
}

impl PartialEq for Stored {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Stored {}

/// The tag (variant index varint) at the start of an event's bytes, and its length.
pub(crate) fn peek_tag(bytes: &[u8]) -> Result<(u32, usize), DecodeError> {
    bincode::serde::decode_from_slice::<u32, _>(bytes, config())
        .map_err(|e| DecodeError::Malformed(format!("event tag: {e}")))
}

/// Reads event `index` of a commit, stored at layout `version`, from bytes that start at its
/// tag (and may run past its end in format 1, where events are delimited by decoding).
/// Returns the event in today's layout, the bytes it used, and whether it was upcast.
pub(crate) fn read_event<E: Versioned>(
    index: usize,
    version: u16,
    bytes: &[u8],
) -> Result<(E, usize, bool), DecodeError> {
    let (tag, tag_len) = peek_tag(bytes)?;
    let registry = E::registry();
    let newest = registry.current_version(tag);
    if version == newest {
        let (event, used) = bincode::serde::decode_from_slice::<E, _>(bytes, config())
            .map_err(|e| DecodeError::Malformed(format!("event #{index}: {e}")))?;
        return Ok((event, used, false));
    }
    let upcaster = (version < newest)
        .then(|| registry.upcaster(tag, version))
        .flatten()
        .ok_or(DecodeError::UnknownEventVersion {
            index,
            tag,
            version,
            newest,
        })?;
    let (event, used) = (upcaster.read)(&bytes[tag_len..]).map_err(|e| {
        DecodeError::Malformed(format!("event #{index} (tag {tag}, layout {version}): {e}"))
    })?;
    Ok((event, tag_len + used, true))
}

/// An event as this build writes it: today's layout at its current version.
pub(crate) fn fresh<E: Versioned>(event: &E) -> Result<StoredEvent, EncodeError> {
    let bytes = bincode::serde::encode_to_vec(event, config())
        .map_err(|e| EncodeError::Bincode(e.to_string()))?;
    let (tag, _) = peek_tag(&bytes).map_err(|e| EncodeError::Bincode(e.to_string()))?;
    Ok(StoredEvent {
        version: E::registry().current_version(tag),
        bytes: bytes.into_boxed_slice(),
    })
}

/// True when `stored` reads back to exactly `event`: the condition for writing and hashing
/// an event as it was stored rather than as it is now. An edited event fails it, so editing
/// a decoded commit still changes its hash.
pub(crate) fn reads_back_to<E: Versioned>(stored: &StoredEvent, event: &E) -> bool {
    matches!(
        read_event::<E>(0, stored.version, &stored.bytes),
        Ok((read, used, _)) if used == stored.bytes.len() && read == *event
    )
}
