//! `q.health`: readiness, the applied position, the lag behind the stream's end, the
//! quarantine and the snapshots of the replica that answers. A replica joins the queue
//! group only once ready, so `ready` is false only while it is stopping.

use provledger_events::EventLog;
use serde_json::{json, Value};

use super::error::{ErrorCode, QueryError};
use super::request::{check_fields, object};
use super::QueryContext;

pub(crate) async fn health(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    check_fields(&object(payload)?, &[])?;
    let position = ctx.position();
    let end = ctx
        .log
        .last_position()
        .await
        .map_err(|e| QueryError::new(ErrorCode::Unavailable, e.to_string()))?;
    let ready = ctx.caught_up_to.get().is_some() && ctx.projector_failed.get().is_none();
    Ok(json!({
        "ready": ready,
        "caught_up_to": ctx.caught_up_to.get(),
        "position": position,
        "stream": ctx.stream,
        "nats_server_version": ctx.log.server_version(),
        "lag": end.saturating_sub(position),
        "quarantined": ctx.store.quarantine_count(),
        "snapshots": ctx.store.snapshots()?,
        "served_by": ctx.served_by,
    }))
}
