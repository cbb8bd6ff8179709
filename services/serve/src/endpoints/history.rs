//! `q.history` and `q.state_at`: an aggregate's commits, and its state at a position or
//! a time.

use provledger_events::Timestamp;
use provledger_projections::timeline;
use serde_json::{json, Value};

use super::error::{bad, ErrorCode, QueryError};
use super::request::{check_fields, object, opt_str, opt_u64, req_aggregate};
use super::QueryContext;

/// Every commit of the aggregate, each with its rendered timeline.
pub(crate) async fn history(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(&req, &["aggregate", "min_position"])?;
    let id = req_aggregate(&req)?;
    ctx.wait_for(opt_u64(&req, "min_position")?).await?;
    let commits = ctx.store.aggregate_commits(&id, u64::MAX)?;
    if commits.is_empty() {
        return Err(QueryError::new(
            ErrorCode::NotFound,
            format!("{id} has no commit"),
        ));
    }
    Ok(Value::Array(
        commits
            .iter()
            .map(|c| {
                let mut v = serde_json::to_value(c).unwrap_or(Value::Null);
                v["timeline"] = json!(timeline::render(c));
                v
            })
            .collect(),
    ))
}

/// The aggregate's state at `position`, at the last position by `time`, or now.
pub(crate) fn state_at(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(&req, &["aggregate", "position", "time"])?;
    let id = req_aggregate(&req)?;
    let position = match (opt_u64(&req, "position")?, opt_str(&req, "time")?) {
        (Some(_), Some(_)) => return Err(bad("time", "give either position or time, not both")),
        (Some(p), None) => p,
        (None, Some(t)) => {
            let at = Timestamp::parse_rfc3339(t).map_err(|e| bad("time", e))?;
            ctx.store.position_at_time(at)?
        }
        (None, None) => ctx.position(),
    };
    match ctx.store.entity_at(&id, position)? {
        Some(e) => Ok(json!({ "at_position": position, "state": e.view() })),
        None => Err(QueryError::new(
            ErrorCode::NotFound,
            format!("{id} has no commit at or before position {position}"),
        )),
    }
}
