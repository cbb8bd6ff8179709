//! W3C Trace Context as a commit records it: the trace a commit was written in, so that
//! whatever is done later on its behalf (serve's rollback, a compensation request, a
//! re-issue to a worker, even days later) continues the same trace.
//!
//! One grammar, here: the `traceparent` header (`00-<trace-id>-<parent-id>-<flags>`,
//! lower-case hex) that serve reads on requests and sends to executors and workers, the
//! JSON form of a commit's `traceparent`, and the 25 bytes format 3 writes
//! (`codec/envelope.rs`). A value that breaks the grammar is ignored where it comes from
//! outside (W3C says so for the header) and refused where it is read back from storage.
//!
//! Pure: ids are never minted here (a shell draws a new span id and hands it in).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The header, as W3C Trace Context names it.
pub const TRACEPARENT: &str = "traceparent";

/// A valid trace context: a 16-byte trace id and an 8-byte span id, neither all zero, and
/// the trace flags byte (bit 0: sampled). Shown, and serialized, as a version-00
/// `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceContext {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
}

/// Why a value is not a trace context (storage and JSON; a header that fails is ignored).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "not a W3C traceparent (expected 00-<32 hex>-<16 hex>-<2 hex>, lower case, ids not all zero)"
)]
pub struct InvalidTraceContext;

impl TraceContext {
    /// A context from its parts; `None` when either id is all zero (W3C: invalid).
    pub fn new(trace_id: [u8; 16], span_id: [u8; 8], flags: u8) -> Option<TraceContext> {
        let zero = |b: &[u8]| b.iter().all(|x| *x == 0);
        (!zero(&trace_id) && !zero(&span_id)).then_some(TraceContext {
            trace_id,
            span_id,
            flags,
        })
    }

    /// Parses a `traceparent` value; `None` for anything W3C says to ignore (a malformed
    /// value, an all-zero id, the forbidden version `ff`, extra fields in version 00). A
    /// later version's extra fields are ignored and its first four are read.
    pub fn parse(value: &str) -> Option<TraceContext> {
        // A real header is 55 bytes; anything much longer is not worth splitting.
        if value.len() > TRACEPARENT_BYTES_MAX {
            return None;
        }
        let mut parts = value.trim().split('-');
        let (version, trace_id, span_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let version = hex::<1>(version)?[0];
        if version == 0xff || (version == 0 && parts.next().is_some()) {
            return None;
        }
        TraceContext::new(hex(trace_id)?, hex(span_id)?, hex::<1>(flags)?[0])
    }

    /// The same trace under another span: what a request sent on this context's behalf
    /// carries (`span_id` is that request's own, drawn by the shell). `None` for an
    /// all-zero id.
    pub fn with_span(&self, span_id: [u8; 8]) -> Option<TraceContext> {
        TraceContext::new(self.trace_id, span_id, self.flags)
    }

    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    pub fn span_id(&self) -> [u8; 8] {
        self.span_id
    }

    pub fn flags(&self) -> u8 {
        self.flags
    }

    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The trace id as 32 lower-case hex digits (as logs and collectors show it).
    pub fn trace_id_hex(&self) -> String {
        to_hex(&self.trace_id)
    }

    /// The span id as 16 lower-case hex digits.
    pub fn span_id_hex(&self) -> String {
        to_hex(&self.span_id)
    }
}

/// Upper bound on a `traceparent` value read: version 00 is 55 bytes; later versions may
/// append fields, and W3C lets a reader stop after the ones it knows.
pub const TRACEPARENT_BYTES_MAX: usize = 512;

fn hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    let digit = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    };
    let bytes = text.as_bytes();
    if bytes.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl fmt::Display for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            self.trace_id_hex(),
            self.span_id_hex(),
            self.flags
        )
    }
}

impl FromStr for TraceContext {
    type Err = InvalidTraceContext;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TraceContext::parse(s).ok_or(InvalidTraceContext)
    }
}

impl Serialize for TraceContext {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TraceContext {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl schemars::JsonSchema for TraceContext {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "TraceContext".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "description": "A W3C traceparent: the trace the commit was written in.",
            "pattern": "^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            "examples": ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"]
        })
    }
}

/// The trace context as format 3 writes it: 16 + 8 + 1 raw bytes (bincode writes fixed
/// arrays without a length).
#[derive(Serialize, Deserialize)]
pub(crate) struct WireTrace {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
}

impl From<&TraceContext> for WireTrace {
    fn from(t: &TraceContext) -> Self {
        WireTrace {
            trace_id: t.trace_id,
            span_id: t.span_id,
            flags: t.flags,
        }
    }
}

impl WireTrace {
    pub(crate) fn context(&self) -> Option<TraceContext> {
        TraceContext::new(self.trace_id, self.span_id, self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn given_the_w3c_example_when_parsed_then_its_ids_and_flag_are_read_and_shown_back() {
        let t = TraceContext::parse(EXAMPLE).expect("the specification's own example");
        assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.span_id_hex(), "00f067aa0ba902b7");
        assert!(t.sampled());
        assert_eq!(t.to_string(), EXAMPLE);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, format!("\"{EXAMPLE}\""));
        assert_eq!(serde_json::from_str::<TraceContext>(&json).unwrap(), t);
    }

    #[test]
    fn given_malformed_values_when_parsed_then_they_are_ignored() {
        let long = format!(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-{}",
            "x".repeat(600)
        );
        for bad in [
            "",
            "garbage",
            // all-zero trace id, all-zero parent id
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            // upper-case hex, short id, forbidden version, extra field in version 00
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            // a sign or a multi-byte character where a digit goes, a huge value
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
            &long,
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
            assert!(serde_json::from_str::<TraceContext>(&format!("{bad:?}")).is_err());
        }
    }

    #[test]
    fn given_a_later_version_with_more_fields_when_parsed_then_the_known_ones_are_read() {
        let t =
            TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-later")
                .expect("later versions may append fields");
        assert!(!t.sampled());
        // and it is recorded (and sent on) as the version this build knows.
        assert!(t.to_string().starts_with("00-"));
    }

    #[test]
    fn a_request_on_a_contexts_behalf_keeps_the_trace_and_flags_under_its_own_span() {
        let t = TraceContext::parse(EXAMPLE).unwrap();
        let child = t.with_span([7; 8]).unwrap();
        assert_eq!(child.trace_id(), t.trace_id());
        assert_eq!(child.flags(), t.flags());
        assert_eq!(child.span_id(), [7; 8]);
        assert_eq!(t.with_span([0; 8]), None);
    }
}
