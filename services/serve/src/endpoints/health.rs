//! `q.health`: readiness, the applied position, the lag behind the stream's end, the
//! quarantine and the snapshots of the replica that answers. A replica joins the queue
//! group only once it has caught up with the stream's end as read at its start; after
//! that, `ready` is false while it lags more than [`READY_LAG_MAX`] positions behind.

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
    let readiness = ctx.readiness().await;
    let Some(lag) = readiness.lag else {
        return Err(QueryError::new(
            ErrorCode::Unavailable,
            readiness
                .reason
                .unwrap_or_else(|| "the stream's end cannot be read".into()),
        ));
    };
    Ok(json!({
        "ready": readiness.ready,
        "reason": readiness.reason,
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
