//! Request parsing: every request is a JSON object (an empty payload counts as `{}`),
//! deserialized into its type of `crate::messages`; a malformed one answers `bad_request`
//! naming the field by its path (`commits[1].events`).
//!
//! The payload is read as JSON first, then into its type: a payload that is not JSON is
//! refused as such whatever its fields, a key given twice counts once (the last), and
//! `cmd.append` picks its form by the keys sent.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use serde_path_to_error::Segment;

use super::error::{bad, ErrorCode, QueryError};

/// The request as its type.
pub(crate) fn parse<T: DeserializeOwned>(payload: &[u8]) -> Result<T, QueryError> {
    if let Some(req) = read_directly(payload) {
        return Ok(req);
    }
    from_object(object(payload)?)
}

/// A well-formed request object read straight into its type, without the JSON tree first
/// (which costs about as much again, on every write). Only what the tree would have read
/// to the same value is taken here: a JSON object whose every key is a field of `T`, given
/// once (request types deny unknown fields, and serde refuses a field given twice, which
/// the tree reads as its last). Everything else, a fault included, is `None`, and goes
/// the general way, which answers for it.
pub(crate) fn read_directly<T: DeserializeOwned>(payload: &[u8]) -> Option<T> {
    // serde reads a struct from an array of its fields too; a request is an object.
    let first = payload.iter().find(|b| !b.is_ascii_whitespace())?;
    if *first != b'{' {
        return None;
    }
    serde_json::from_slice(payload).ok()
}

/// The request as a JSON object, before it is read into its type. JSON that breaks off
/// inside a field (bytes that are not UTF-8 in a string, say) names that field.
pub(crate) fn object(payload: &[u8]) -> Result<Map<String, Value>, QueryError> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    let mut json = serde_json::Deserializer::from_slice(payload);
    let value = serde_path_to_error::deserialize(&mut json)
        .map_err(|e| not_json(&field_path(e.path()), e.inner()))?;
    json.end().map_err(|e| not_json("", &e))?;
    match value {
        Value::Object(map) => Ok(map),
        _ => Err(QueryError::new(
            ErrorCode::BadRequest,
            "the request must be a JSON object",
        )),
    }
}

/// Refuses a payload that is not JSON, naming the field it breaks off in, if any.
fn not_json(field: &str, e: &serde_json::Error) -> QueryError {
    match field {
        "" => QueryError::new(
            ErrorCode::BadRequest,
            format!("the request is not JSON: {e}"),
        ),
        field => bad(field, format!("not JSON: {e}")),
    }
}

/// A JSON object read into the request type `T`.
pub(crate) fn from_object<T: DeserializeOwned>(req: Map<String, Value>) -> Result<T, QueryError> {
    serde_path_to_error::deserialize(Value::Object(req)).map_err(refusal)
}

/// `bad_request` naming the field where deserializing stopped. Serde names a missing
/// field in its message, at the path of the object that lacks it: the field is named from
/// there. An unknown field is at its own path; its message lists the fields expected.
fn refusal(e: serde_path_to_error::Error<serde_json::Error>) -> QueryError {
    let mut path = field_path(e.path());
    let message = e.into_inner().to_string();
    if let Some((field, _)) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split_once('`'))
    {
        push_field(&mut path, field);
        return bad(&path, "missing");
    }
    if let Some((_, expected)) = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once("`, "))
    {
        let expected = expected.replace('`', "");
        return bad(&path, format!("unknown field; {expected}"));
    }
    match path.is_empty() {
        true => QueryError::new(ErrorCode::BadRequest, message),
        false => bad(&path, message),
    }
}

/// `commits[1].events`: the path as the request's fields name it, up to the last segment
/// known (a key that broke off is not).
fn field_path(path: &serde_path_to_error::Path) -> String {
    let mut segments: Vec<&Segment> = path.iter().collect();
    while let Some(Segment::Unknown) = segments.last() {
        segments.pop();
    }
    let mut named = String::new();
    for segment in segments {
        match segment {
            Segment::Seq { index } => named.push_str(&format!("[{index}]")),
            Segment::Map { key } => push_field(&mut named, key),
            Segment::Enum { variant } => push_field(&mut named, variant),
            Segment::Unknown => push_field(&mut named, "?"),
        }
    }
    named
}

fn push_field(path: &mut String, field: &str) {
    if !path.is_empty() {
        path.push('.');
    }
    path.push_str(field);
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::messages::{
        AllocationByConsumerRequest, CmdAppendRequest, GetRequest, HealAllocationsRequest,
        HealthRequest, InstanceListRequest, WorkerReadyRequest,
    };

    /// The refusal's code and the message its reply sends (`{"error": {"code", "message"}}`).
    fn refused(what: &str, result: Result<(), QueryError>) -> (ErrorCode, String) {
        let Err(e) = result else {
            panic!("{what}: accepted");
        };
        let body = e.body();
        let fields: Vec<&String> = body["error"]
            .as_object()
            .map_or(vec![], |e| e.keys().collect());
        assert_eq!(fields, ["code", "message"], "{body}");
        let message = body["error"]["message"].as_str().unwrap_or_default();
        (e.code(), message.to_string())
    }

    fn commit() -> Value {
        json!({
            "aggregate": format!("cluster/{}", uuid::Uuid::now_v7()),
            "expect": "any",
            "events": [{"cluster_status_changed": {"status": "active", "description": "x"}}],
        })
    }

    fn append(payload: &Value) -> Result<crate::messages::CmdAppendRequest, QueryError> {
        super::super::append::request(payload.to_string().as_bytes())
    }

    #[test]
    fn hostile_or_malformed_requests_are_bad_requests_naming_the_field() {
        let id = uuid::Uuid::now_v7();
        let mut wrong_nested = vec![commit(), commit()];
        wrong_nested[1]["events"] = json!({"not": "a list"});
        let mut unknown_nested = vec![commit(), commit()];
        unknown_nested[1]["expected"] = json!(3);
        let mut missing_nested = vec![commit(), commit()];
        missing_nested[1]
            .as_object_mut()
            .map(|c| c.remove("events"));
        let mut bad_event = vec![commit(), commit()];
        bad_event[1]["events"][0] = json!({"cluster_exploded": {}});
        // Given payloads each wrong in one field, sent to the parsing of their endpoint
        let cases: Vec<(&str, Result<(), QueryError>, &str)> = vec![
            (
                "a field of the wrong type",
                parse::<GetRequest>(json!({"id": 5}).to_string().as_bytes()).map(drop),
                "field `id`: invalid type: integer `5`",
            ),
            (
                "an id that is not a UUID",
                parse::<AllocationByConsumerRequest>(br#"{"consumer": "x"}"#).map(drop),
                "field `consumer`: UUID parsing failed",
            ),
            (
                "an unknown field",
                parse::<GetRequest>(json!({"id": id, "idd": id}).to_string().as_bytes())
                    .map(drop),
                "field `idd`: unknown field; expected one of id, min_position, steps_from",
            ),
            (
                "an unknown field where there is none",
                parse::<HealthRequest>(br#"{"verbose": true}"#).map(drop),
                "field `verbose`: unknown field",
            ),
            (
                "a missing field",
                parse::<WorkerReadyRequest>(b"{}").map(drop),
                "field `worker`: missing",
            ),
            (
                "a huge number",
                parse::<InstanceListRequest>(br#"{"limit": 123456789012345678901234567890}"#)
                    .map(drop),
                "field `limit`: invalid type: floating point",
            ),
            (
                "a negative number",
                parse::<GetRequest>(json!({"id": id, "min_position": -1}).to_string().as_bytes())
                    .map(drop),
                "field `min_position`: invalid value: integer `-1`, expected u64",
            ),
            (
                "a flag that is null",
                parse::<HealAllocationsRequest>(br#"{"dry_run": null}"#).map(drop),
                "field `dry_run`: invalid type: null, expected a boolean",
            ),
            (
                "bytes that are not UTF-8",
                parse::<WorkerReadyRequest>(b"{\"worker\": \"w\xff\xfe1\"}").map(drop),
                "field `worker`: not JSON: invalid unicode code point",
            ),
            (
                "JSON that breaks off inside a field",
                parse::<InstanceListRequest>(br#"{"host": "cn1", "cluster_id": "#).map(drop),
                "field `cluster_id`: not JSON: EOF while parsing a value",
            ),
            (
                "a non-object",
                parse::<HealthRequest>(b"[1, 2]").map(drop),
                "the request must be a JSON object",
            ),
            (
                "a payload that is not JSON",
                parse::<HealthRequest>(b"{not json").map(drop),
                "the request is not JSON: key must be a string",
            ),
            (
                "an aggregate without its kind",
                append(&json!({"aggregate": id, "expect": "any", "events": []})).map(drop),
                "field `aggregate`: ",
            ),
            (
                "an expectation of a negative version",
                append(&json!({"aggregate": format!("cluster/{id}"), "expect": -1, "events": []}))
                    .map(drop),
                "field `expect`: invalid value: integer `-1`, expected \"any\", \"none\" or a version",
            ),
            (
                "a nested field of the wrong type in commits[1]",
                append(&json!({"commits": wrong_nested})).map(drop),
                "field `commits[1].events`: invalid type: map, expected a sequence",
            ),
            (
                "an unknown nested field in commits[1]",
                append(&json!({"commits": unknown_nested})).map(drop),
                "field `commits[1].expected`: unknown field; expected one of aggregate, expect,",
            ),
            (
                "a missing nested field in commits[1]",
                append(&json!({"commits": missing_nested})).map(drop),
                "field `commits[1].events`: missing",
            ),
            (
                "an event the catalogue does not have in commits[1]",
                append(&json!({"commits": bad_event})).map(drop),
                "field `commits[1].events[0]`: unknown variant `cluster_exploded`",
            ),
            (
                "a commit that is not an object",
                append(&json!({"commits": [commit(), [1, 2]]})).map(drop),
                "field `commits[1]`: must be an object",
            ),
        ];
        for (what, result, expected) in cases {
            // When it is parsed
            let (code, message) = refused(what, result);
            // Then it is a bad request whose message names the field and what is wrong
            assert_eq!(code, ErrorCode::BadRequest, "{what}: {message}");
            assert!(
                message.starts_with(expected),
                "{what}: {message:?} does not start with {expected:?}"
            );
        }
    }

    #[test]
    fn a_request_read_directly_is_the_request_the_json_tree_reads() {
        use crate::messages::AppendRequest;
        use provledger_events::catalogue::samples;
        use provledger_events::AggregateKind;
        // Given one append of every event of the catalogue, with and without its optional
        // fields, in several layouts
        let id = uuid::Uuid::now_v7();
        let mut payloads = Vec::new();
        for event in samples::all() {
            let kind = event.home_kind().unwrap_or(AggregateKind::Cluster);
            let aggregate = format!("{kind}/{id}");
            let event = serde_json::to_value(&event).expect("an event serializes");
            payloads.push(json!({"aggregate": aggregate, "expect": "any", "events": [event]}));
            payloads.push(json!({
                "aggregate": aggregate, "expect": 7, "commit_id": id, "operation_id": id,
                "causation_id": id, "actor": "a\"\u{0}ctor", "events": [event, event],
                "force": true,
            }));
            payloads.push(json!({"events": [event], "expect": "none", "aggregate": aggregate}));
        }
        for payload in &payloads {
            for text in [payload.to_string(), format!("\n {:#}\t", payload)] {
                // When it is read straight into its type, and through the JSON tree
                let direct = read_directly::<AppendRequest>(text.as_bytes())
                    .unwrap_or_else(|| panic!("not read directly: {text}"));
                let tree: AppendRequest =
                    from_object(object(text.as_bytes()).expect("an object")).expect("a request");
                // Then both are the same request
                assert_eq!(
                    serde_json::to_value(&direct).expect("serializes"),
                    serde_json::to_value(&tree).expect("serializes"),
                    "{text}"
                );
            }
        }
        // And what the tree reads differently, or refuses, is not read directly: a key
        // given twice, the atomic form, an array of the fields, trailing bytes
        let one = payloads[0].to_string();
        let twice = one.replacen('{', r#"{"expect": 3, "#, 1);
        let atomic = json!({"commits": [payloads[0]]}).to_string();
        let fields = r#"["cluster/0190a0c8-7a37-7f4c-8c7e-000000000000", "any", null, null, null, null, []]"#;
        for text in [
            twice.clone(),
            atomic,
            fields.to_string(),
            format!("{one} {{}}"),
        ] {
            assert!(
                read_directly::<AppendRequest>(text.as_bytes()).is_none(),
                "{text}"
            );
        }
        // (the key given twice counts once, the last)
        let CmdAppendRequest::One(req) =
            super::super::append::request(twice.as_bytes()).expect("the last key")
        else {
            panic!("one commit");
        };
        assert!(
            matches!(req.expect, crate::messages::Expect::Word(_)),
            "{req:?}"
        );
    }

    #[test]
    fn well_formed_requests_are_read_as_they_always_were() {
        // Given an empty payload, the string forms of an expectation, and a status word
        // the catalogue does not have
        let id = uuid::Uuid::now_v7();
        // When they are parsed, then they are accepted, as before
        parse::<HealthRequest>(b" \n\t").expect("an empty payload is {}");
        let by_text =
            append(&json!({"aggregate": format!("cluster/{id}"), "expect": "3", "events": []}))
                .expect("a version as text");
        assert!(
            matches!(
                by_text,
                crate::messages::CmdAppendRequest::One(ref r)
                    if matches!(r.expect, crate::messages::Expect::Version(3))
            ),
            "{by_text:?}"
        );
        let list = parse::<InstanceListRequest>(br#"{"task_state": "dancing", "limit": null}"#)
            .expect("any word filters");
        assert_eq!(list.task_state.as_deref(), Some("dancing"));
        assert_eq!(list.limit, None);
        // And a key given twice counts once, the last
        let twice = parse::<GetRequest>(
            format!(r#"{{"id": "{}", "id": "{id}"}}"#, uuid::Uuid::nil()).as_bytes(),
        )
        .expect("the last key");
        assert_eq!(twice.id, id);
    }
}
