//! Request parsing: every request is a JSON object (an empty payload counts as `{}`), and
//! a malformed one answers `bad_request` naming the field.

use provledger_events::AggregateId;
use serde_json::{Map, Value};
use uuid::Uuid;

use super::error::{bad, ErrorCode, QueryError};

pub(crate) fn object(payload: &[u8]) -> Result<Map<String, Value>, QueryError> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(payload) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(QueryError::new(
            ErrorCode::BadRequest,
            "the request must be a JSON object",
        )),
        Err(e) => Err(QueryError::new(
            ErrorCode::BadRequest,
            format!("the request is not JSON: {e}"),
        )),
    }
}

pub(crate) fn opt_str<'a>(
    req: &'a Map<String, Value>,
    field: &str,
) -> Result<Option<&'a str>, QueryError> {
    match req.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(bad(field, format!("expected a string, got {other}"))),
    }
}

pub(crate) fn opt_u64(req: &Map<String, Value>, field: &str) -> Result<Option<u64>, QueryError> {
    match req.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(field, format!("expected a non-negative integer, got {v}"))),
    }
}

pub(crate) fn req_uuid(req: &Map<String, Value>, field: &str) -> Result<Uuid, QueryError> {
    opt_uuid(req, field)?.ok_or_else(|| bad(field, "missing"))
}

pub(crate) fn opt_uuid(req: &Map<String, Value>, field: &str) -> Result<Option<Uuid>, QueryError> {
    opt_str(req, field)?
        .map(|s| Uuid::parse_str(s).map_err(|e| bad(field, format!("not a UUID: {e}"))))
        .transpose()
}

pub(crate) fn req_aggregate(req: &Map<String, Value>) -> Result<AggregateId, QueryError> {
    let s = opt_str(req, "aggregate")?.ok_or_else(|| bad("aggregate", "missing"))?;
    s.parse().map_err(|e| bad("aggregate", e))
}

pub(crate) fn check_fields(req: &Map<String, Value>, allowed: &[&str]) -> Result<(), QueryError> {
    match req.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(unknown) => Err(bad(
            unknown,
            format!("unknown field; expected one of {}", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}
