//! serve's metrics listener (`serve --metrics-addr`): `GET /metrics`, the registry in the
//! OpenMetrics text format with the gauges read from the store and the stream at each
//! scrape, and `GET /health`, this replica's readiness as JSON, for when NATS itself is
//! what is lost (then `q.health` cannot be asked).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use provledger_events::Timestamp;

use crate::metrics::{Gauges, AGED_STATUSES};
use crate::replica::QueryContext;
use crate::store::HistoryCopy;

/// The content type of the OpenMetrics text format Prometheus scrapes.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// How long a scrape may wait for the stream's end (the lag gauge) before answering
/// without it.
const STREAM_END_WAIT: Duration = Duration::from_secs(2);

/// Serves `/metrics` and `/health` on `addr` until `shutdown`; the address it bound (for
/// `--metrics-addr 127.0.0.1:0`) goes to the log.
pub(crate) async fn serve_metrics(
    addr: SocketAddr,
    ctx: Arc<QueryContext>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tracing::info!(addr = %local, "metrics on http://{local}/metrics");
    let app = Router::new()
        .route("/metrics", get(scrape))
        .route("/health", get(health))
        .with_state(ctx);
    Ok(tokio::spawn(async move {
        crate::http::serve(
            "metrics",
            listener,
            app,
            crate::http::METRICS_LIMITS,
            shutdown,
        )
        .await;
    }))
}

async fn scrape(State(ctx): State<Arc<QueryContext>>) -> axum::response::Response {
    ctx.metrics.set_gauges(gauges(&ctx).await);
    match ctx.metrics.encode() {
        Ok(text) => ([(header::CONTENT_TYPE, OPENMETRICS)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn health(State(ctx): State<Arc<QueryContext>>) -> axum::response::Response {
    let readiness = ctx.readiness().await;
    let status = match readiness.ready {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    };
    let body = serde_json::json!({
        "ready": readiness.ready,
        "nats_connected": readiness.nats_connected,
        "reason": readiness.reason,
        "position": readiness.position,
        "served_by": ctx.served_by.get(),
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The gauges as the store and the stream say now. One read of the stream's end serves
/// the lag and readiness alike.
async fn gauges(ctx: &QueryContext) -> Gauges {
    let (position, end_and_lag, ready, nats_connected) =
        match tokio::time::timeout(STREAM_END_WAIT, ctx.readiness()).await {
            Ok(readiness) => (
                readiness.position,
                readiness.end.zip(readiness.lag()),
                readiness.ready,
                readiness.nats_connected,
            ),
            Err(_) => {
                tracing::debug!("metrics: reading the stream's end timed out");
                (ctx.position(), None, false, ctx.nats_connected())
            }
        };
    let operation_counts = match ctx.store.operation_counts() {
        Ok(counts) => Some(counts),
        Err(e) => {
            tracing::warn!(error = %e, "metrics: reading operation counts");
            None
        }
    };
    let oldest_started = AGED_STATUSES
        .iter()
        .map(|status| Ok((status.to_string(), ctx.store.oldest_started(status)?)))
        .collect::<Result<Vec<_>, crate::store::StoreError>>()
        .map_err(|e| tracing::warn!(error = %e, "metrics: reading the oldest operations"))
        .ok();
    let copy_behind = match ctx.store.history_copy() {
        // The copy's `copied` mark, as the copier last wrote it.
        Ok(HistoryCopy::Separate(extent)) => position.saturating_sub(extent.through),
        Ok(HistoryCopy::InProjection | HistoryCopy::None) => 0,
        Err(e) => {
            tracing::warn!(error = %e, "metrics: reading the copy's extent");
            0
        }
    };
    Gauges {
        position,
        end_and_lag,
        ready,
        nats_connected,
        operation_counts,
        oldest_started,
        now: Timestamp::now(),
        quarantined: ctx.store.quarantine_count() as u64,
        copy_behind,
        consumers: ctx.log.consumers_held() as u64,
        races_lost: ctx.writer.races_lost(),
    }
}
