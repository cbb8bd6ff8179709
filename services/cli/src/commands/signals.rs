//! The signals that stop a long-running command (`serve`, `watch`), in one place.

use std::future::Future;

use super::CommandError;

/// SIGINT and SIGTERM, listened to from the start: a signal that came before the first
/// wait is not lost, and none ends the process before the command has done what it does
/// on a signal (`watch` says where to resume, `serve` drains).
pub struct StopSignal {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl StopSignal {
    pub fn listen() -> Result<Self, CommandError> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            let listen = |kind| {
                signal(kind).map_err(|e| {
                    CommandError::Infrastructure(format!("cannot listen for signals: {e}"))
                })
            };
            Ok(StopSignal {
                interrupt: listen(SignalKind::interrupt())?,
                terminate: listen(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        Ok(StopSignal {})
    }

    /// `work`'s output, or `None` if a signal came first (`work` is then dropped).
    pub async fn or<T>(&mut self, work: impl Future<Output = T>) -> Option<T> {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.interrupt.recv() => None,
                _ = self.terminate.recv() => None,
                done = work => Some(done),
            }
        }
        #[cfg(not(unix))]
        {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => None,
                done = work => Some(done),
            }
        }
    }
}
