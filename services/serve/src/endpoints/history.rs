//! `q.history` and `q.state_at`: an aggregate's commits, and its state at a position or
//! a time.

use provledger_events::Timestamp;
use provledger_projections::timeline;
use serde_json::{json, Value};

use super::error::{bad, to_data, ErrorCode, QueryError};
use super::request::{check_fields, object, opt_str, opt_u64, req_aggregate};
use super::QueryContext;
use crate::messages::{HistoryRequest, RequestFields, StateAtData, StateAtRequest};

/// Every commit of the aggregate, each with its rendered timeline.
pub(crate) async fn history(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(&req, HistoryRequest::FIELDS)?;
    let id = req_aggregate(&req)?;
    let from = opt_u64(&req, "from_version")?.unwrap_or(1).max(1);
    let limit = opt_u64(&req, "limit")?.unwrap_or(u64::MAX);
    if limit == 0 {
        return Err(bad("limit", "must be at least 1"));
    }
    ctx.wait_for(opt_u64(&req, "min_position")?).await?;
    let commits = ctx.store.aggregate_commits(&id, u64::MAX)?;
    if commits.is_empty() {
        return Err(QueryError::new(
            ErrorCode::NotFound,
            format!("{id} has no commit"),
        ));
    }
    // A page from `from_version`, bounded by `limit` and by bytes: a caller reading a long
    // or bulky history asks again from the last version + 1 until the page is empty.
    let budget = ctx.page_bytes_max();
    let mut page = Vec::new();
    let mut bytes = 0;
    for c in commits.iter().filter(|c| c.version >= from) {
        let mut v = serde_json::to_value(c).unwrap_or(Value::Null);
        v["timeline"] = json!(timeline::render(c));
        let size = serde_json::to_vec(&v).map_or(0, |b| b.len());
        if !page.is_empty() && (bytes + size > budget || page.len() as u64 >= limit) {
            break;
        }
        bytes += size;
        page.push(v);
    }
    Ok(Value::Array(page))
}

/// The aggregate's state at `position`, at the last position by `time`, or now.
pub(crate) fn state_at(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(&req, StateAtRequest::FIELDS)?;
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
        Some(e) => Ok(to_data(&StateAtData {
            at_position: position,
            state: e.view_typed(),
        })),
        None => Err(QueryError::new(
            ErrorCode::NotFound,
            format!("{id} has no commit at or before position {position}"),
        )),
    }
}
