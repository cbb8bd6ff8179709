//! W3C Trace Context (`traceparent`) on incoming requests: a caller that traces its own
//! work sends the header, serve carries its trace id into the span of that request (every
//! line logged while it is handled names it), and `cmd.append` records it in the commits
//! the request writes (format 3), so what serve later sends on their behalf continues the
//! caller's trace. The grammar is `provledger_events::trace`'s; spans are exported by
//! `otlp.rs` when configured.

use provledger_events::trace::{TraceContext, TRACEPARENT};

/// The `traceparent` of a request's headers, when it has a valid one: a malformed or
/// oversized value is ignored (W3C says so), never a refusal.
pub(crate) fn of(headers: Option<&async_nats::HeaderMap>) -> Option<TraceContext> {
    TraceContext::parse(headers?.get(TRACEPARENT)?.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_valid_or_a_hostile_header_then_it_is_read_or_ignored() {
        let with = |value: &str| {
            let mut h = async_nats::HeaderMap::new();
            h.insert(TRACEPARENT, value);
            of(Some(&h))
        };
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(with(valid).map(|t| t.to_string()).as_deref(), Some(valid));
        assert_eq!(with("00-zz-00f067aa0ba902b7-01"), None);
        assert_eq!(with(&"0".repeat(10_000)), None);
        assert_eq!(of(None), None);
        assert_eq!(of(Some(&async_nats::HeaderMap::new())), None);
    }
}
