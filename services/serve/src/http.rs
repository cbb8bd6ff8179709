//! serve's HTTP listeners (the console, and `/metrics` with `/health`), with the bounds a
//! careless or hostile client cannot lift:
//!
//! - at most [`Limits::connections`] connections per listener: past it, new connections
//!   wait in the kernel's backlog and hold none of serve's file handles, which sled and
//!   NATS need (a replica out of file handles loses its projector);
//! - a client has [`Limits::header_read`] to send a request's headers (also between two
//!   requests on a kept-alive connection), else its connection is closed: a connection
//!   that sends half a request holds its slot for that long, not for ever;
//! - at shutdown, connections get [`Limits::drain`] to finish, then they are cut: a
//!   client never keeps serve from exiting.
//!
//! Each listener has its own limits, so a flood of console connections never takes the
//! metrics listener (what alerts read) with it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// What one listener allows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) connections: usize,
    pub(crate) header_read: Duration,
    pub(crate) drain: Duration,
}

/// The console's: browsers open a few connections each, and live pages one more.
pub(crate) const CONSOLE_LIMITS: Limits = Limits {
    connections: 256,
    header_read: Duration::from_secs(10),
    drain: Duration::from_secs(3),
};

/// `/metrics` and `/health`: a few scrapers and probes.
pub(crate) const METRICS_LIMITS: Limits = Limits {
    connections: 32,
    header_read: Duration::from_secs(10),
    drain: Duration::from_secs(3),
};

/// How long the accept loop waits after an accept failed (out of file handles, say)
/// before it tries again, instead of spinning.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);

/// Serves `app` on `listener` within `limits` until `shutdown`, then drains within the
/// limit. `what` names the listener in logs.
pub(crate) async fn serve(
    what: &'static str,
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.connections));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read);
    // The connections' tasks, reaped as they end, aborted if the drain runs out.
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        while connections.try_join_next().is_some() {}
        // A slot first, then accept: past the cap, connections queue in the kernel.
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break, // closed: never, the semaphore lives here
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(listener = what, error = %e, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let connection =
            http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        connections.spawn(async move {
            let _slot = permit;
            if let Err(e) = connection.await {
                tracing::debug!(listener = what, error = %e, "connection ended");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::info!(
            listener = what,
            drain = ?limits.drain,
            open = connections.len(),
            "connections still open after the drain are cut"
        );
    }
    connections.abort_all();
}
