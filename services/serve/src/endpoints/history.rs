//! `q.history` and `q.state_at`: an aggregate's commits, and its state at a position or
//! a time.

use provledger_events::{AggregateId, Commit, EventLog};
use provledger_projections::{timeline, Entity};
use serde_json::{json, Value};

use super::error::{bad, to_data, ErrorCode, QueryError};
use super::request::parse;
use crate::messages::{HistoryRequest, StateAtData, StateAtRequest};
use crate::replica::QueryContext;

/// Every commit of the aggregate, each with its rendered timeline.
pub(crate) async fn history(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let HistoryRequest {
        aggregate: id,
        min_position,
        from_version,
        limit,
    } = parse(payload)?;
    let from = from_version.unwrap_or(1).max(1);
    let limit = limit.unwrap_or(u64::MAX);
    if limit == 0 {
        return Err(bad("limit", "must be at least 1"));
    }
    ctx.wait_for(min_position).await?;
    let commits = aggregate_commits(ctx, &id, ctx.position()).await?;
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

/// One aggregate's commits up to position `to`: from the stream itself, which holds them
/// (serve keeps no second copy of what it can read back), or from the store's copy in a
/// data dir made before serve stopped copying.
async fn aggregate_commits(
    ctx: &QueryContext,
    id: &AggregateId,
    to: u64,
) -> Result<Vec<Commit>, QueryError> {
    if ctx.store.copies_log()? {
        return Ok(ctx.store.aggregate_commits(id, to)?);
    }
    let mut commits = ctx.log.read_aggregate(*id).await.map_err(|e| match e {
        provledger_events::ReadError::Lost(loss) => loss.into(),
        e => QueryError::new(
            ErrorCode::Unavailable,
            format!("reading {id}'s history from the stream: {e}"),
        ),
    })?;
    commits.retain(|c| c.position <= to);
    Ok(commits)
}

/// The aggregate's state at `position`, at the last position by `time`, or now.
pub(crate) async fn state_at(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let StateAtRequest {
        aggregate: id,
        position,
        time,
    } = parse(payload)?;
    let position = match (position, time) {
        (Some(_), Some(_)) => return Err(bad("time", "give either position or time, not both")),
        (Some(p), None) => p,
        (None, Some(at)) => ctx.store.position_at_time(at)?,
        (None, None) => ctx.position(),
    };
    let entity = Entity::fold(
        id,
        &aggregate_commits(ctx, &id, position.min(ctx.position())).await?,
    );
    match entity {
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
