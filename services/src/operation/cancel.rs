//! Cancellation notices: `<prefix>.cancel.<operation_id>` on NATS, or an in-process
//! broadcast when embedded. A notice only wakes a running operation early; the log is
//! what decides (the runner also sees `CancellationRequested` or `TargetDeletionNoticed`
//! through its next append's version conflict), so a lost notice delays a cancellation
//! by at most one step and never loses it.

use std::sync::Arc;

use futures::StreamExt;
use tokio::sync::{broadcast, watch};
use uuid::Uuid;

/// Notices in flight per in-process bus; a slow receiver that lags only loses wake-ups.
const LOCAL_NOTICES_MAX: usize = 1024;

#[derive(Clone)]
pub enum CancelNotices {
    Local(Arc<broadcast::Sender<Uuid>>),
    Nats {
        client: async_nats::Client,
        subject_prefix: String,
    },
}

impl CancelNotices {
    pub fn local() -> Self {
        let (tx, _) = broadcast::channel(LOCAL_NOTICES_MAX);
        CancelNotices::Local(Arc::new(tx))
    }

    pub fn nats(client: async_nats::Client, subject_prefix: &str) -> Self {
        CancelNotices::Nats {
            client,
            subject_prefix: subject_prefix.to_string(),
        }
    }

    pub fn subject(subject_prefix: &str, operation: Uuid) -> String {
        format!("{subject_prefix}.cancel.{operation}")
    }

    /// Tells running workers that `operation` is cancelled. Best effort by design: the
    /// cancellation itself is already in the log.
    pub async fn publish(&self, operation: Uuid, reason: &str) {
        match self {
            CancelNotices::Local(tx) => {
                // No receiver means no runner in this process: nothing to wake.
                let _ = tx.send(operation);
            }
            CancelNotices::Nats {
                client,
                subject_prefix,
            } => {
                let subject = Self::subject(subject_prefix, operation);
                if let Err(e) = client
                    .publish(subject.clone(), reason.to_string().into())
                    .await
                {
                    tracing::warn!(%subject, error = %e, "cancel notice not published");
                }
                let _ = client.flush().await;
            }
        }
    }

    /// A flag that turns true when a notice for `operation` arrives. The listening task
    /// ends when the returned receiver is dropped.
    pub async fn watch(&self, operation: Uuid) -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        match self {
            CancelNotices::Local(bus) => {
                let mut sub = bus.subscribe();
                tokio::spawn(async move {
                    loop {
                        tokio::select! {
                            got = sub.recv() => match got {
                                Ok(id) if id == operation => {
                                    let _ = tx.send(true);
                                    return;
                                }
                                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                                Err(broadcast::error::RecvError::Closed) => return,
                            },
                            _ = tx.closed() => return,
                        }
                    }
                });
            }
            CancelNotices::Nats {
                client,
                subject_prefix,
            } => {
                let subject = Self::subject(subject_prefix, operation);
                match client.subscribe(subject.clone()).await {
                    Ok(mut sub) => {
                        tokio::spawn(async move {
                            tokio::select! {
                                got = sub.next() => if got.is_some() {
                                    let _ = tx.send(true);
                                },
                                _ = tx.closed() => {}
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(%subject, error = %e, "cannot listen for cancel notices; the log still carries them")
                    }
                }
            }
        }
        rx
    }
}
