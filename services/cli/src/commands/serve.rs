//! `provledger serve`: runs the projection service until SIGINT or SIGTERM.

use super::CommandError;
use provledger_serve::{self as serve, ServeError, ServeOptions};

/// Resolves on the first SIGINT or SIGTERM.
async fn termination() {
    match super::signals::StopSignal::listen() {
        Ok(mut stop) => {
            stop.or(std::future::pending::<()>()).await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGTERM; only SIGINT stops serve");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("termination signal received");
}

pub async fn run(options: ServeOptions) -> Result<(), CommandError> {
    serve::run(options, termination())
        .await
        .map_err(|e| match e {
            ServeError::Open(open) => open.into(),
            ServeError::Store(provledger_serve::StoreError::SourceMismatch { .. })
            | ServeError::Otlp(_) => CommandError::BadInput(e.to_string()),
            other => CommandError::Infrastructure(other.to_string()),
        })
}
