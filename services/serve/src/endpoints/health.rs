//! `q.health` and `q.drift`: what this replica says of itself. `q.health`: readiness, the applied position, the lag behind the stream's end, the
//! quarantine and the snapshots of the replica that answers. A replica joins the queue
//! group only once it has caught up with the stream's end as read at its start; after
//! that, `ready` is false while it lags more than [`crate::replica::READY_LAG_MAX`] positions behind.

use serde_json::Value;

use super::error::{to_data, ErrorCode, QueryError};
use super::request::parse;
use crate::messages::{DriftData, DriftRequest, HealthData, HealthRequest};
use crate::replica::QueryContext;

pub(crate) async fn health(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let HealthRequest {} = parse(payload)?;
    let readiness = ctx.readiness().await;
    let Some(lag) = readiness.lag() else {
        return Err(QueryError::new(
            ErrorCode::Unavailable,
            readiness
                .reason
                .unwrap_or_else(|| "the stream's end cannot be read".into()),
        ));
    };
    Ok(to_data(&HealthData {
        ready: readiness.ready,
        reason: readiness.reason,
        caught_up_to: ctx.caught_up_to.get().copied(),
        position: readiness.position,
        stream: ctx.stream.clone(),
        nats_server_version: ctx.log.server_version().to_string(),
        lag,
        quarantined: ctx.store.quarantine_count() as u64,
        snapshots: ctx.store.snapshots()?,
        served_by: ctx.served_by.get().cloned().unwrap_or_default(),
    }))
}

/// `q.drift`: this replica's last drift sweep (`serve --drift-interval`).
pub(crate) fn drift(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let DriftRequest {} = parse(payload)?;
    Ok(to_data(&DriftData {
        interval_s: ctx.drift.interval.map(|i| i.as_secs()),
        last: ctx.drift.last(),
        served_by: ctx.served_by.get().cloned().unwrap_or_default(),
    }))
}
