//! W3C Trace Context (`traceparent`) on incoming requests: a caller that traces its own
//! work sends the header, and serve carries its trace id into the span of that request,
//! so that the commits the request produced are logged under the caller's trace.
//! (Exporting spans to a collector, OTLP, is not built: the ids in the logs join them.)

/// The header, as W3C Trace Context names it.
pub(crate) const TRACEPARENT: &str = "traceparent";

/// A valid `traceparent`: `version-traceid-parentid-flags`, lower-case hex.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TraceParent {
    pub(crate) trace_id: String,
    pub(crate) parent_id: String,
    pub(crate) sampled: bool,
}

impl TraceParent {
    /// Parses a header value; `None` for anything W3C says to ignore (a malformed value, an
    /// all-zero id, the forbidden version `ff`): a bad header never fails the request.
    pub(crate) fn parse(value: &str) -> Option<TraceParent> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, parent_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, len: usize| {
            s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        };
        let nonzero = |s: &str| s.bytes().any(|b| b != b'0');
        // Version 00 has exactly four fields; a later version may append more.
        if !hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        if !hex(trace_id, 32) || !nonzero(trace_id) || !hex(parent_id, 16) || !nonzero(parent_id) {
            return None;
        }
        if !hex(flags, 2) {
            return None;
        }
        let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
        Some(TraceParent {
            trace_id: trace_id.to_string(),
            parent_id: parent_id.to_string(),
            sampled,
        })
    }

    /// The `traceparent` of a request's headers, when it has a valid one.
    pub(crate) fn of(headers: Option<&async_nats::HeaderMap>) -> Option<TraceParent> {
        TraceParent::parse(headers?.get(TRACEPARENT)?.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_the_w3c_example_when_parsed_then_its_ids_and_flag_are_read() {
        let t = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the specification's own example");
        assert_eq!(t.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent_id, "00f067aa0ba902b7");
        assert!(t.sampled);
    }

    #[test]
    fn given_malformed_values_when_parsed_then_they_are_ignored() {
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
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn given_a_later_version_with_more_fields_when_parsed_then_the_known_ones_are_read() {
        let t = TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-later")
            .expect("later versions may append fields");
        assert!(!t.sampled);
    }
}
