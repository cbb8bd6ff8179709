//! The envelope as bytes: the one borrowed view of a commit that both the encoder and the
//! hash read, generic over the event enum so the evolution tests run this same code.
//!
//! Layouts (after the format byte, every part is bincode 2, standard config):
//! - format 1: header ‖ varint n ‖ n events, each at layout 1, delimited by decoding ‖
//!   prev_hash ‖ hash. These are the bytes of the single-struct encoding used before event
//!   versions existed, and format 1 never changes.
//! - format 2: header ‖ varint n ‖ n × (varint version ‖ varint length ‖ event bytes) ‖
//!   prev_hash ‖ hash: the bincode of a struct whose events are `{ version: u16, bytes:
//!   Vec<u8> }`. Each event is length-prefixed, so a reader names the (tag, version) it
//!   cannot read.
//! - format 3: header ‖ trace context (16-byte trace id ‖ 8-byte span id ‖ flags byte) ‖
//!   the rest as in format 2. Written only for a commit that records the W3C trace it was
//!   written in (`trace.rs`); a commit without one keeps the smallest of formats 1 and 2,
//!   so nothing written before, and no golden file, changes.
//!
//! Sharing one body for both keeps the rule "hash = BLAKE3(bincode(domain) ‖ payload[1 ..
//! len-32])" true by construction, for either format, so a reader can check a hash from the
//! raw bytes alone. The body is built from each event *as it was stored* when the commit
//! keeps its stored form ([`Stored`]), so an upcast commit hashes and re-encodes as written.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::stored::{self, Stored, StoredEvent, StoredForm};
use super::{config, DecodeError, EncodeError, FORMAT_1, FORMAT_2, FORMAT_3};
use crate::catalogue::versions::Versioned;
use crate::ids::{AggregateId, Hash, Timestamp};
use crate::trace::{TraceContext, WireTrace};

/// The hash domain of format 1: it separates commit hashes from any other BLAKE3 use.
pub(crate) const DOMAIN_1: &str = "provledger.commit.v1";
/// The hash domain of format 2: a format-2 payload never hashes like a format-1 one.
pub(crate) const DOMAIN_2: &str = "provledger.commit.v2";
/// The hash domain of format 3 (a trace context after the header).
pub(crate) const DOMAIN_3: &str = "provledger.commit.v3";

/// The hash domain of a format, `None` for a format this build does not know.
pub fn domain(format: u8) -> Option<&'static str> {
    match format {
        FORMAT_1 => Some(DOMAIN_1),
        FORMAT_2 => Some(DOMAIN_2),
        FORMAT_3 => Some(DOMAIN_3),
        _ => None,
    }
}

/// Every field of a commit that is written, borrowed, without `hash` (which follows them on
/// the wire) and without `position` (which the log assigns after writing).
pub struct EnvelopeRef<'a, E> {
    pub commit_id: &'a Uuid,
    pub aggregate: &'a AggregateId,
    pub version: u64,
    pub operation_id: &'a Option<Uuid>,
    pub causation_id: &'a Option<Uuid>,
    pub actor: &'a str,
    pub recorded_at: Timestamp,
    pub trace: &'a Option<TraceContext>,
    pub events: &'a [E],
    pub prev_hash: &'a Hash,
    pub stored: &'a Stored,
}

/// A decoded envelope, owned: what [`decode`] returns and what a `Commit` is built from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<E> {
    pub commit_id: Uuid,
    pub aggregate: AggregateId,
    pub version: u64,
    pub operation_id: Option<Uuid>,
    pub causation_id: Option<Uuid>,
    pub actor: String,
    pub recorded_at: Timestamp,
    pub trace: Option<TraceContext>,
    pub events: Vec<E>,
    pub prev_hash: Hash,
    pub hash: Hash,
    pub stored: Stored,
}

/// The header fields in wire order, borrowed for writing.
#[derive(Serialize)]
struct HeaderRef<'a> {
    commit_id: &'a Uuid,
    aggregate: &'a AggregateId,
    version: u64,
    operation_id: &'a Option<Uuid>,
    causation_id: &'a Option<Uuid>,
    actor: &'a str,
    recorded_at: Timestamp,
}

/// The header fields in wire order, owned, for reading.
#[derive(Deserialize)]
struct Header {
    commit_id: Uuid,
    aggregate: AggregateId,
    version: u64,
    operation_id: Option<Uuid>,
    causation_id: Option<Uuid>,
    actor: String,
    recorded_at: Timestamp,
}

/// A whole format-1 commit in one struct: the single decode of the fast path, used while
/// no event of the commit can be at an old layout.
#[derive(Deserialize)]
struct WholeFormat1<E> {
    header: Header,
    events: Vec<E>,
    prev_hash: Hash,
    hash: Hash,
}

/// Which events the body is written from.
enum Form<'a> {
    /// Today's layout at version 1 for every event and no trace context: the events are
    /// serialized directly, in format 1 (the common case).
    Plain,
    /// The form the commit was stored in, still matching its events.
    Kept(&'a StoredForm),
    /// Each event freshly encoded at its current version, in the minimal format.
    Fresh(StoredForm),
}

impl Form<'_> {
    fn format(&self) -> u8 {
        match self {
            Form::Plain => FORMAT_1,
            Form::Kept(form) => form.format,
            Form::Fresh(form) => form.format,
        }
    }

    fn versions(&self, events: usize) -> Vec<u16> {
        match self {
            Form::Plain => vec![1; events],
            Form::Kept(form) => form.events.iter().map(|e| e.version).collect(),
            Form::Fresh(form) => form.events.iter().map(|e| e.version).collect(),
        }
    }
}

/// Format 3 when the commit records a trace context (only format 3 holds one); else
/// format 1 while every event is at layout 1 (so old readers read it), else format 2.
pub(crate) fn minimal_format(versions: impl IntoIterator<Item = u16>, traced: bool) -> u8 {
    if traced {
        FORMAT_3
    } else if versions.into_iter().all(|version| version == 1) {
        FORMAT_1
    } else {
        FORMAT_2
    }
}

impl<'a, E: Versioned> EnvelopeRef<'a, E> {
    fn header(&self) -> HeaderRef<'a> {
        HeaderRef {
            commit_id: self.commit_id,
            aggregate: self.aggregate,
            version: self.version,
            operation_id: self.operation_id,
            causation_id: self.causation_id,
            actor: self.actor,
            recorded_at: self.recorded_at,
        }
    }

    /// The stored form when it still reads back to these events; otherwise the events as
    /// this build writes them.
    fn form(&self) -> Result<Form<'a>, EncodeError> {
        if let Some(kept) = self.stored.0.as_deref() {
            // The trace context is written by format 3 only: a stored form of another
            // format cannot hold one that was added (nor drop one that was removed).
            let intact = (kept.format == FORMAT_3) == self.trace.is_some()
                && kept.events.len() == self.events.len()
                && kept
                    .events
                    .iter()
                    .zip(self.events)
                    .all(|(stored, event)| stored::reads_back_to(stored, event));
            if intact {
                return Ok(Form::Kept(kept));
            }
        }
        if !E::registry().any_changed() && self.trace.is_none() {
            return Ok(Form::Plain);
        }
        self.fresh_form(None)
    }

    /// Every event at its current version, in `format` or else the minimal one.
    fn fresh_form(&self, format: Option<u8>) -> Result<Form<'a>, EncodeError> {
        let events = self
            .events
            .iter()
            .map(stored::fresh)
            .collect::<Result<Vec<StoredEvent>, EncodeError>>()?;
        let traced = self.trace.is_some();
        let minimal = minimal_format(events.iter().map(|e| e.version), traced);
        let format = format.unwrap_or(minimal);
        if domain(format).is_none() {
            return Err(EncodeError::UnknownFormat { format });
        }
        if traced != (format == FORMAT_3) {
            return Err(EncodeError::TraceNeedsFormat3 { format, traced });
        }
        if let Some((index, event)) = (format == FORMAT_1)
            .then(|| events.iter().enumerate().find(|(_, e)| e.version != 1))
            .flatten()
        {
            return Err(EncodeError::NeedsFormat2 {
                index,
                version: event.version,
            });
        }
        Ok(Form::Fresh(StoredForm { format, events }))
    }

    /// The payload's middle, everything between the format byte and the hash.
    fn body(&self, form: &Form<'_>) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::with_capacity(128);
        write(&self.header(), &mut out)?;
        if form.format() == FORMAT_3 {
            // `form` checked that format 3 goes with a trace context and no other does.
            if let Some(trace) = self.trace {
                write(&WireTrace::from(trace), &mut out)?;
            }
        }
        match form {
            Form::Plain => write(self.events, &mut out)?,
            Form::Kept(stored) => write_events(stored, &mut out)?,
            Form::Fresh(stored) => write_events(stored, &mut out)?,
        }
        // A `Hash` is bincode-written as its 32 raw bytes (a `[u8; 32]`, no length).
        out.extend_from_slice(&self.prev_hash.0);
        Ok(out)
    }

    /// `[format] ‖ body ‖ hash`.
    pub fn encode(&self, hash: &Hash) -> Result<Vec<u8>, EncodeError> {
        let form = self.form()?;
        Ok(payload(form.format(), &self.body(&form)?, hash))
    }

    /// The payload in `format`, with every event at its current version, sealed with the
    /// hash of that payload (which is not the commit's own `hash` unless `format` is the
    /// minimal one): for the golden pins of formats a writer would not choose.
    pub fn encode_as(&self, format: u8) -> Result<(Vec<u8>, Hash), EncodeError> {
        let form = self.fresh_form(Some(format))?;
        let body = self.body(&form)?;
        let hash = hash_body(domain_of(&form), &body);
        Ok((payload(format, &body, &hash), hash))
    }

    /// BLAKE3 over the bincode of the format's domain string, then the body.
    pub fn hash(&self) -> Hash {
        // Encoding cannot fail: every field and event is a plain serde value whose
        // Serialize has no error path (the catalogue's hand-written ones never call
        // `Error::custom`), sequences always know their length, bincode's limit applies to
        // decoding only, and a fresh form only ever picks a format `domain` knows. If it
        // ever did, every commit would hash the same input and a chain would no longer
        // tell one commit from another: stop rather than seal that.
        let form = self
            .form()
            .expect("the events of a commit (plain serde values) encode");
        let body = self
            .body(&form)
            .expect("the hash input (plain serde values) encodes");
        assert!(
            !body.is_empty(),
            "the hash input of v{} of {} encoded to nothing",
            self.version,
            self.aggregate
        );
        hash_body(domain_of(&form), &body)
    }

    /// The format this commit is written in.
    pub fn format(&self) -> u8 {
        // Cannot fail, for the reasons given in `hash`.
        self.form()
            .expect("the events of a commit (plain serde values) encode")
            .format()
    }

    /// Each event's layout version as written.
    pub fn event_versions(&self) -> Vec<u16> {
        // Cannot fail, for the reasons given in `hash`.
        self.form()
            .expect("the events of a commit (plain serde values) encode")
            .versions(self.events.len())
    }
}

impl<E: Versioned> Envelope<E> {
    pub fn as_ref(&self) -> EnvelopeRef<'_, E> {
        EnvelopeRef {
            commit_id: &self.commit_id,
            aggregate: &self.aggregate,
            version: self.version,
            operation_id: &self.operation_id,
            causation_id: &self.causation_id,
            actor: &self.actor,
            recorded_at: self.recorded_at,
            trace: &self.trace,
            events: &self.events,
            prev_hash: &self.prev_hash,
            stored: &self.stored,
        }
    }

    pub fn compute_hash(&self) -> Hash {
        self.as_ref().hash()
    }

    pub fn hash_is_valid(&self) -> bool {
        self.compute_hash() == self.hash
    }

    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        self.as_ref().encode(&self.hash)
    }

    pub fn format(&self) -> u8 {
        self.as_ref().format()
    }

    pub fn event_versions(&self) -> Vec<u16> {
        self.as_ref().event_versions()
    }
}

fn domain_of(form: &Form<'_>) -> &'static str {
    // A form's format is 1 (plain), one decoded from a payload (checked against `domain`
    // before reading), or one `fresh_form` checked: it always has a domain.
    domain(form.format()).expect("a form's format is a known one")
}

fn payload(format: u8, body: &[u8], hash: &Hash) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + body.len() + hash.0.len());
    out.push(format);
    out.extend_from_slice(body);
    out.extend_from_slice(&hash.0);
    out
}

fn write<T: Serialize + ?Sized>(value: &T, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    bincode::serde::encode_into_std_write(value, out, config())
        .map(|_| ())
        .map_err(|e| EncodeError::Bincode(e.to_string()))
}

fn write_events(form: &StoredForm, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    write(&form.events.len(), out)?;
    for event in &form.events {
        if form.format != FORMAT_1 {
            write(&event.version, out)?;
            write(&event.bytes.len(), out)?;
        }
        out.extend_from_slice(&event.bytes);
    }
    Ok(())
}

/// The hash of a body under a domain; `pub` so tests can check the rule on raw bytes.
pub fn hash_body(domain: &str, body: &[u8]) -> Hash {
    let domain = bincode::serde::encode_to_vec(domain, config())
        .expect("a short &str always encodes (a varint length and its bytes)");
    let mut hasher = blake3::Hasher::new();
    hasher.update(&domain);
    hasher.update(body);
    Hash(*hasher.finalize().as_bytes())
}

/// A cursor over a payload's body: each read decodes one bincode value and moves past it.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn value<T: serde::de::DeserializeOwned>(&mut self, what: &str) -> Result<T, DecodeError> {
        let (value, used) = bincode::serde::decode_from_slice(self.rest(), config())
            .map_err(|e| DecodeError::Malformed(format!("{what}: {e}")))?;
        self.at += used;
        Ok(value)
    }

    fn raw(&mut self, len: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(len)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| DecodeError::Malformed(format!("{what}: {len} bytes past the end")))?;
        let raw = &self.bytes[self.at..end];
        self.at = end;
        Ok(raw)
    }

    fn rest(&self) -> &'a [u8] {
        &self.bytes[self.at..]
    }
}

/// Decodes the body of a payload in `format` (1, 2 or 3, checked by the caller).
pub(crate) fn decode<E: Versioned>(format: u8, body: &[u8]) -> Result<Envelope<E>, DecodeError> {
    if format == FORMAT_1 {
        if !E::registry().any_changed() {
            // No event has an old layout yet: the whole commit decodes in one pass, as it
            // always has, and its errors are the final ones.
            return decode_whole(body);
        }
        // Some event has an old layout. If none of this commit's events is one, the one
        // pass is still right: events decode in order and a changed one would show up in
        // the result under its own tag (or fail), so any doubt falls to the piecewise path.
        if let Ok(envelope) = decode_whole::<E>(body) {
            if envelope.events.iter().all(|event| is_unchanged(event)) {
                return Ok(envelope);
            }
        }
    }
    decode_piecewise(format, body)
}

/// True when `event`'s tag is still at layout 1.
fn is_unchanged<E: Versioned>(event: &E) -> bool {
    matches!(stored::fresh(event), Ok(stored) if stored.version == 1)
}

fn decode_whole<E: Versioned>(body: &[u8]) -> Result<Envelope<E>, DecodeError> {
    let (whole, read): (WholeFormat1<E>, usize) = bincode::serde::decode_from_slice(body, config())
        .map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if read != body.len() {
        return Err(DecodeError::TrailingBytes {
            count: body.len() - read,
        });
    }
    Ok(envelope(
        whole.header,
        whole.events,
        whole.prev_hash,
        whole.hash,
        Stored::default(),
    ))
}

/// Reads the header, then each event on its own through the registry, keeping its bytes.
fn decode_piecewise<E: Versioned>(format: u8, body: &[u8]) -> Result<Envelope<E>, DecodeError> {
    let mut reader = Reader { bytes: body, at: 0 };
    let header: Header = reader.value("header")?;
    let trace = if format == FORMAT_3 {
        let wire: WireTrace = reader.value("trace context")?;
        Some(wire.context().ok_or_else(|| {
            DecodeError::Malformed("trace context: an all-zero trace or span id".into())
        })?)
    } else {
        None
    };
    let count: u64 = reader.value("event count")?;
    // Every event takes at least one byte, so the loop is bounded by the payload; the
    // reservation is bounded by what a writer may put in a commit.
    let reserve = usize::try_from(count)
        .unwrap_or(usize::MAX)
        .min(crate::commit::COMMIT_EVENTS_MAX);
    let mut events = Vec::with_capacity(reserve);
    let mut kept = Vec::with_capacity(reserve);
    let mut upcast_any = false;
    for index in 0..count {
        let index = usize::try_from(index).unwrap_or(usize::MAX);
        let (version, raw, event, upcast) = if format == FORMAT_1 {
            let (event, used, upcast) = stored::read_event::<E>(index, 1, reader.rest())?;
            (1, reader.raw(used, "event")?, event, upcast)
        } else {
            let version: u16 = reader.value("event version")?;
            let len: u64 = reader.value("event length")?;
            let len = usize::try_from(len).unwrap_or(usize::MAX);
            let raw = reader.raw(len, "event")?;
            let (event, used, upcast) = stored::read_event::<E>(index, version, raw)?;
            if used != raw.len() {
                return Err(DecodeError::Malformed(format!(
                    "event #{index}: {} bytes left after its fields",
                    raw.len() - used
                )));
            }
            (version, raw, event, upcast)
        };
        upcast_any |= upcast;
        events.push(event);
        kept.push(StoredEvent {
            version,
            bytes: raw.into(),
        });
    }
    let prev_hash: Hash = reader.value("prev_hash")?;
    let hash: Hash = reader.value("hash")?;
    if reader.at != body.len() {
        return Err(DecodeError::TrailingBytes {
            count: body.len() - reader.at,
        });
    }
    // Keep the stored form only when re-encoding the events would not give these bytes.
    let minimal = minimal_format(kept.iter().map(|e| e.version), trace.is_some());
    let stored = if upcast_any || format != minimal {
        Stored::new(StoredForm {
            format,
            events: kept,
        })
    } else {
        Stored::default()
    };
    let mut envelope = envelope(header, events, prev_hash, hash, stored);
    envelope.trace = trace;
    Ok(envelope)
}

fn envelope<E>(
    header: Header,
    events: Vec<E>,
    prev_hash: Hash,
    hash: Hash,
    stored: Stored,
) -> Envelope<E> {
    Envelope {
        commit_id: header.commit_id,
        aggregate: header.aggregate,
        version: header.version,
        operation_id: header.operation_id,
        causation_id: header.causation_id,
        actor: header.actor,
        recorded_at: header.recorded_at,
        trace: None,
        events,
        prev_hash,
        hash,
        stored,
    }
}
