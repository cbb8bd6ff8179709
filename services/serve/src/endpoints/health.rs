//! `q.health`: readiness, the applied position, the lag behind the stream's end, the
//! quarantine and the snapshots of the replica that answers. A replica joins the queue
//! group only once it has caught up with the stream's end as read at its start; after
//! that, `ready` is false while it lags more than [`READY_LAG_MAX`] positions behind.

use provledger_events::EventLog;
use serde_json::{json, Value};

use super::error::{ErrorCode, QueryError};
use super::request::{check_fields, object};
use super::QueryContext;

/// How far behind the stream's end a replica may fall and still say it is ready: a busy
/// stream keeps every replica a few batches behind, which is not "not ready".
pub(crate) const READY_LAG_MAX: u64 = 1_000;

pub(crate) async fn health(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    check_fields(&object(payload)?, &[])?;
    let position = ctx.position();
    let end = ctx
        .log
        .last_position()
        .await
        .map_err(|e| QueryError::new(ErrorCode::Unavailable, e.to_string()))?;
    let lag = end.saturating_sub(position);
    let ready = ctx.caught_up_to.get().is_some()
        && ctx.projector_failed.get().is_none()
        && lag <= READY_LAG_MAX;
    Ok(json!({
        "ready": ready,
        "caught_up_to": ctx.caught_up_to.get(),
        "position": position,
        "stream": ctx.stream,
        "nats_server_version": ctx.log.server_version(),
        "lag": lag,
        "quarantined": ctx.store.quarantine_count(),
        "snapshots": ctx.store.snapshots()?,
        "served_by": ctx.served_by.get(),
    }))
}
