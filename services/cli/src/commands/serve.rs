//! `provledger serve`: runs the projection service until SIGINT or SIGTERM.

use super::CommandError;
use provledger_serve::{self as serve, ServeError, ServeOptions};

/// Resolves on the first SIGINT or SIGTERM.
async fn termination() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only SIGINT stops serve");
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
    tracing::info!("termination signal received");
}

pub async fn run(options: ServeOptions) -> Result<(), CommandError> {
    serve::run(options, termination())
        .await
        .map_err(|e| match e {
            ServeError::Open(open) => open.into(),
            ServeError::Store(provledger_serve::StoreError::SourceMismatch { .. }) => {
                CommandError::BadInput(e.to_string())
            }
            other => CommandError::Infrastructure(other.to_string()),
        })
}
