//! Cancellation notices: `<prefix>.cancel.<operation_id>` on NATS, or an in-process
//! broadcast when embedded. A notice only wakes a running operation early; the log is
//! what decides (the runner also sees `CancellationRequested` or `TargetDeletionNoticed`
//! through its next append's version conflict), so a lost notice delays a cancellation
//! by at most one step and never loses it.
//!
//! In process, a notice is delivered before `publish` returns (the watchers' flags are set
//! directly), so an embedded run sees a cancellation at the very next step, the same way
//! every run: the demo and the tests are deterministic.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use tokio::sync::watch;
use uuid::Uuid;

/// The in-process watchers, by operation. Watchers whose receiver was dropped are pruned on
/// every `watch` and `publish`, so the map holds at most the operations being watched.
type LocalWatchers = Arc<Mutex<HashMap<Uuid, Vec<watch::Sender<bool>>>>>;

#[derive(Clone)]
pub enum CancelNotices {
    Local(LocalWatchers),
    Nats {
        client: async_nats::Client,
        subject_prefix: String,
    },
}

impl CancelNotices {
    pub fn local() -> Self {
        CancelNotices::Local(Arc::default())
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
            CancelNotices::Local(watchers) => {
                // No watcher means no runner in this process: nothing to wake.
                let mut map = lock(watchers);
                prune(&mut map);
                for sender in map.get(&operation).into_iter().flatten() {
                    let _ = sender.send(true);
                }
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
            CancelNotices::Local(watchers) => {
                let mut map = lock(watchers);
                prune(&mut map);
                map.entry(operation).or_default().push(tx);
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

/// Drops the watchers whose receiver is gone.
fn prune(map: &mut HashMap<Uuid, Vec<watch::Sender<bool>>>) {
    map.retain(|_, senders| {
        senders.retain(|s| !s.is_closed());
        !senders.is_empty()
    });
}

fn lock(
    watchers: &LocalWatchers,
) -> std::sync::MutexGuard<'_, HashMap<Uuid, Vec<watch::Sender<bool>>>> {
    // Nothing panics while holding the lock; recover the map if something did.
    watchers.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_local_notice_is_seen_before_publish_returns() {
        // Given a watcher for one operation and one for another
        let notices = CancelNotices::local();
        let (op, other) = (Uuid::from_u128(1), Uuid::from_u128(2));
        let watched = notices.watch(op).await;
        let bystander = notices.watch(other).await;
        // When the notice for `op` is published
        notices.publish(op, "deleted").await;
        // Then its flag is already set, with no task switch in between, and only its own
        assert!(*watched.borrow());
        assert!(!*bystander.borrow());
    }

    #[tokio::test]
    async fn dropped_watchers_are_pruned() {
        let notices = CancelNotices::local();
        for i in 0..100 {
            drop(notices.watch(Uuid::from_u128(i)).await);
        }
        let _kept = notices.watch(Uuid::from_u128(1000)).await;
        let CancelNotices::Local(watchers) = &notices else {
            unreachable!("a local bus")
        };
        assert_eq!(lock(watchers).len(), 1);
    }
}
