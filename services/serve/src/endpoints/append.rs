//! `cmd.append` for publishers not written in Rust: validated against the catalogue and
//! the target's state, then appended like any other writer would.

use provledger_events::{AppendError, AppendStatus, CommitDraft, Event, EventLog, Expectation};
use provledger_projections::decide::{admit_append, AppendRejection};
use serde_json::{json, Value};

use super::error::{bad, ErrorCode, QueryError};
use super::request::{check_fields, object, opt_str, opt_uuid, req_aggregate};
use super::QueryContext;

pub(crate) async fn append(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(
        &req,
        &[
            "aggregate",
            "expect",
            "commit_id",
            "operation_id",
            "causation_id",
            "actor",
            "events",
        ],
    )?;
    let aggregate = req_aggregate(&req)?;
    let expect = match req.get("expect") {
        None => return Err(bad("expect", "missing")),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Expectation::Exactly)
            .ok_or_else(|| bad("expect", "must be \"any\", \"none\" or a version"))?,
        Some(Value::String(s)) => s.parse().map_err(|e| bad("expect", e))?,
        Some(other) => return Err(bad("expect", format!("unexpected {other}"))),
    };
    let events_json = req.get("events").ok_or_else(|| bad("events", "missing"))?;
    let events: Vec<Event> = serde_json::from_value(events_json.clone())
        .map_err(|e| bad("events", format!("not catalogue events: {e}")))?;
    let mut draft = CommitDraft::now(opt_str(&req, "actor")?.unwrap_or("nats:cmd.append"), events);
    if let Some(id) = opt_uuid(&req, "commit_id")? {
        draft.commit_id = id;
    }
    draft.operation_id = opt_uuid(&req, "operation_id")?;
    draft.causation_id = opt_uuid(&req, "causation_id")?;
    draft
        .validate(&aggregate)
        .map_err(|e| bad("events", e.to_string()))?;
    let current = ctx.store.entity(&aggregate)?;
    admit_append(current.as_ref(), &draft.events).map_err(|e| match e {
        AppendRejection::TargetDeleted { .. } => {
            QueryError::new(ErrorCode::TargetDeleted, e.to_string())
        }
    })?;
    match ctx.log.append(aggregate, expect, draft).await {
        Ok(outcome) => Ok(json!({
            "position": outcome.position,
            "version": outcome.version,
            "already_appended": matches!(outcome.status, AppendStatus::AlreadyAppended),
        })),
        Err(AppendError::Conflict { actual, .. }) => Err(QueryError::new(
            ErrorCode::Conflict,
            format!("{aggregate} is at version {actual}, not {expect}; re-read and retry"),
        )
        .with("actual_version", actual.into())),
        Err(e @ AppendError::CommitIdReused { .. }) => {
            Err(QueryError::new(ErrorCode::Conflict, e.to_string()))
        }
        Err(e @ (AppendError::Invalid(_) | AppendError::Encode(_))) => {
            Err(bad("events", e.to_string()))
        }
        Err(e @ AppendError::Unavailable { .. }) => {
            Err(QueryError::new(ErrorCode::Unavailable, e.to_string()))
        }
        Err(e @ AppendError::Corrupt { .. }) => {
            Err(QueryError::new(ErrorCode::Internal, e.to_string()))
        }
    }
}
