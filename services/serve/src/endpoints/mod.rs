//! The query and command endpoints, one file per group, each answering its request from
//! the [`QueryContext`]. Every request is JSON; a malformed one answers `bad_request`
//! naming the field (`request`), and every refusal carries one of the contract's error
//! codes (`error`).

mod allocation;
mod append;
pub(crate) mod caller;
mod entities;
pub(crate) mod error;
mod health;
mod history;
mod placement;
mod request;
mod worker;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use provledger_client::{Ledger, Writer};
use provledger_events::{AggregateKind, EventLog, JetStreamLog};
use serde_json::Value;
use tokio::sync::watch;

use crate::store::ProjectionStore;
pub use error::ErrorCode;
use error::QueryError;

/// The endpoints under `<prefix>.q.` and `<prefix>.cmd.`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Health,
    ClusterGet,
    ClusterList,
    InstanceGet,
    InstanceList,
    ProviderGet,
    AllocationByConsumer,
    OperationGet,
    History,
    StateAt,
    CmdAppend,
    ProviderList,
    ProviderDelete,
    HealAllocations,
    FixOrphans,
    WorkerReady,
    OperationList,
    Drift,
}

/// Every subject the service answers, below the prefix (`q.health`, ..., `cmd.append`).
pub fn endpoint_subjects() -> Vec<&'static str> {
    Endpoint::ALL.iter().map(|e| e.suffix()).collect()
}

impl Endpoint {
    pub(crate) const ALL: [Endpoint; 18] = [
        Endpoint::Health,
        Endpoint::ClusterGet,
        Endpoint::ClusterList,
        Endpoint::InstanceGet,
        Endpoint::InstanceList,
        Endpoint::ProviderGet,
        Endpoint::AllocationByConsumer,
        Endpoint::OperationGet,
        Endpoint::History,
        Endpoint::StateAt,
        Endpoint::CmdAppend,
        Endpoint::ProviderList,
        Endpoint::ProviderDelete,
        Endpoint::HealAllocations,
        Endpoint::FixOrphans,
        Endpoint::WorkerReady,
        Endpoint::OperationList,
        Endpoint::Drift,
    ];

    /// The subject below the prefix, e.g. `q.cluster.get`.
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Endpoint::Health => "q.health",
            Endpoint::ClusterGet => "q.cluster.get",
            Endpoint::ClusterList => "q.cluster.list",
            Endpoint::InstanceGet => "q.instance.get",
            Endpoint::InstanceList => "q.instance.list",
            Endpoint::ProviderGet => "q.provider.get",
            Endpoint::AllocationByConsumer => "q.allocation.by_consumer",
            Endpoint::OperationGet => "q.operation.get",
            Endpoint::History => "q.history",
            Endpoint::StateAt => "q.state_at",
            Endpoint::CmdAppend => "cmd.append",
            Endpoint::ProviderList => "q.provider.list",
            Endpoint::ProviderDelete => "cmd.provider.delete",
            Endpoint::HealAllocations => "cmd.heal_allocations",
            Endpoint::FixOrphans => "cmd.fix_orphans",
            Endpoint::WorkerReady => "cmd.worker.ready",
            Endpoint::OperationList => "q.operation.list",
            Endpoint::Drift => "q.drift",
        }
    }

    /// The micro-service endpoint name (letters, digits, `-` and `_` only).
    pub(crate) fn name(self) -> String {
        self.suffix().replace('.', "-")
    }
}

/// What every handler reads.
pub(crate) struct QueryContext {
    pub(crate) store: ProjectionStore,
    pub(crate) applied: watch::Receiver<u64>,
    pub(crate) log: JetStreamLog,
    /// This replica's write path over `log` (one per process: its writers of one
    /// aggregate take turns, and what it knows of each serves every write).
    pub(crate) writer: Writer<Ledger>,
    pub(crate) stream: String,
    /// The replica's id: its micro service id, set once the service has started (no
    /// request is answered before).
    pub(crate) served_by: std::sync::OnceLock<String>,
    pub(crate) min_position_wait: Duration,
    /// Set when the projector stopped for good: from then on this replica's state is
    /// frozen, so every request is answered `unavailable` while serve drains and exits.
    pub(crate) projector_failed: std::sync::OnceLock<String>,
    /// The stream's end when this replica started, set once it had applied it and joined
    /// the queue group: `ready` in q.health.
    pub(crate) caught_up_to: std::sync::OnceLock<u64>,
    /// The largest reply this service sends; lists fill pages up to half of it.
    pub(crate) reply_bytes_max: usize,
    /// Queries waiting for a `min_position` right now (at most [`MIN_POSITION_WAITS_MAX`]).
    pub(crate) min_position_waits: AtomicUsize,
    /// Workers that said they listen again, for the re-issue delivery to serve first.
    pub(crate) workers_ready: WorkersReady,
    pub(crate) metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// The NATS connection, whose state says whether this replica can be ready.
    pub(crate) client: async_nats::Client,
    /// The drift sweep's last findings (`q.drift`).
    pub(crate) drift: crate::drift_sweep::DriftSweeps,
    /// The last audit this replica ran (`--audit-interval`), for the console.
    pub(crate) audits: crate::audit::LastAudits,
}

/// Whether this replica can answer from current state, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Readiness {
    pub(crate) ready: bool,
    pub(crate) nats_connected: bool,
    /// Why it is not ready (`None` when it is).
    pub(crate) reason: Option<String>,
    /// The position applied when it looked.
    pub(crate) position: u64,
    /// The stream's end, when it could be read.
    pub(crate) end: Option<u64>,
}

impl Readiness {
    /// Positions between the stream's end and what was applied, when the end was read.
    pub(crate) fn lag(&self) -> Option<u64> {
        self.end.map(|end| end.saturating_sub(self.position))
    }
}

/// Workers that said they are listening (`cmd.worker.ready`) since the delivery loop last
/// looked, each with when it last said so (a ready grants one attempt sent after it:
/// `provledger_projections::recovery::reissue_due`), and the wake-up of that loop.
/// Bounded: past [`WORKERS_READY_MAX`] names the newest are dropped (their re-issues still
/// go within the backoff's bound).
#[derive(Default)]
pub(crate) struct WorkersReady {
    /// `None` when this replica delivers no re-issues (recovery off).
    names: std::sync::Mutex<Option<ReadyWorkers>>,
    pub(crate) wake: tokio::sync::Notify,
}

/// Ready workers, with when each last said so.
pub(crate) type ReadyWorkers = std::collections::BTreeMap<String, provledger_events::Timestamp>;

/// Distinct ready workers remembered between two delivery rounds.
pub const WORKERS_READY_MAX: usize = 4_096;

impl WorkersReady {
    /// Makes this replica deliver re-issues (its recovery runs).
    pub(crate) fn enable(&self) {
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        names.get_or_insert_with(Default::default);
    }

    /// Notes `worker`; whether this replica delivers re-issues.
    pub(crate) fn note(&self, worker: &str) -> bool {
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        let Some(names) = names.as_mut() else {
            return false;
        };
        if names.len() < WORKERS_READY_MAX || names.contains_key(worker) {
            names.insert(worker.to_string(), provledger_events::Timestamp::now());
        }
        self.wake.notify_one();
        true
    }

    /// The workers noted since the last call.
    pub(crate) fn take(&self) -> ReadyWorkers {
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        names.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

/// Queries that may wait for a `min_position` at once. Well below serve's requests in
/// flight, so that waiting queries can never take every slot from health checks and
/// commands.
pub const MIN_POSITION_WAITS_MAX: usize = 256;
const _: () = assert!(MIN_POSITION_WAITS_MAX < crate::service::REQUESTS_IN_FLIGHT_MAX / 2);

/// One of the [`MIN_POSITION_WAITS_MAX`] places to wait, given back on drop.
struct WaitSlot<'a>(&'a AtomicUsize);

impl<'a> WaitSlot<'a> {
    fn take(waits: &'a AtomicUsize) -> Option<WaitSlot<'a>> {
        waits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MIN_POSITION_WAITS_MAX).then_some(n + 1)
            })
            .ok()
            .map(|_| WaitSlot(waits))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl QueryContext {
    /// The bytes of data a list or history page holds at most: half a reply, leaving
    /// room for the envelope.
    pub(crate) fn page_bytes_max(&self) -> usize {
        self.reply_bytes_max / 2
    }

    pub(crate) fn position(&self) -> u64 {
        *self.applied.borrow()
    }

    /// Ready means: caught up once and joined the queue group, the projector running,
    /// connected to NATS, and no more than [`health::READY_LAG_MAX`] positions behind.
    pub(crate) async fn readiness(&self) -> Readiness {
        let nats_connected = self.nats_connected();
        let position = self.position();
        let end = match nats_connected {
            true => self.log.last_position().await.ok(),
            false => None,
        };
        let lag = end.map(|end| end.saturating_sub(position));
        let reason = if let Some(why) = self.projector_failed.get() {
            Some(format!("the projector stopped: {why}"))
        } else if self.caught_up_to.get().is_none() {
            Some("catching up with the stream's end as read at start".to_string())
        } else if !nats_connected {
            Some("the NATS connection is lost; reconnecting".to_string())
        } else {
            match lag {
                None => Some("the stream's end cannot be read".to_string()),
                Some(lag) if lag > health::READY_LAG_MAX => Some(format!(
                    "{lag} positions behind the stream's end (more than {})",
                    health::READY_LAG_MAX
                )),
                Some(_) => None,
            }
        };
        Readiness {
            ready: reason.is_none(),
            nats_connected,
            reason,
            position,
            end,
        }
    }

    /// Whether the NATS connection is up now.
    pub(crate) fn nats_connected(&self) -> bool {
        matches!(
            self.client.connection_state(),
            async_nats::connection::State::Connected
        )
    }

    /// Read-your-writes: waits (bounded in time, and in how many wait at once) until the
    /// projection has applied `min`.
    async fn wait_for(&self, min: Option<u64>) -> Result<(), QueryError> {
        let Some(min) = min else { return Ok(()) };
        if self.position() >= min {
            return Ok(());
        }
        // Beyond the bound, a wait would only hold a request slot that others (health,
        // commands) need: the answer is `stale` at once, as it would be after the wait.
        let Some(_waiting) = WaitSlot::take(&self.min_position_waits) else {
            let position = self.position();
            return Err(QueryError::new(
                ErrorCode::Stale,
                format!(
                    "applied up to position {position}, below min_position {min}; {MIN_POSITION_WAITS_MAX} queries already wait for a position (MIN_POSITION_WAITS_MAX); retry later"
                ),
            )
            .with("position", position.into()));
        };
        let mut applied = self.applied.clone();
        let reached = tokio::time::timeout(self.min_position_wait, applied.wait_for(|p| *p >= min))
            .await
            .is_ok_and(|r| r.is_ok());
        match reached {
            true => Ok(()),
            false => {
                let position = self.position();
                Err(QueryError::new(
                    ErrorCode::Stale,
                    format!(
                        "applied up to position {position}, below min_position {min} after waiting {} ms; retry later",
                        self.min_position_wait.as_millis()
                    ),
                )
                .with("position", position.into()))
            }
        }
    }

    pub(crate) async fn handle(
        &self,
        endpoint: Endpoint,
        payload: &[u8],
        caller: &caller::Caller,
    ) -> Result<Value, QueryError> {
        if let Some(reason) = self.projector_failed.get() {
            return Err(QueryError::new(
                ErrorCode::Unavailable,
                format!(
                    "this replica's projector stopped ({reason}); it is exiting: ask another replica or restart it"
                ),
            ));
        }
        match endpoint {
            Endpoint::Health => health::health(self, payload).await,
            Endpoint::ClusterGet => entities::get(self, payload, AggregateKind::Cluster).await,
            Endpoint::InstanceGet => entities::get(self, payload, AggregateKind::Instance).await,
            Endpoint::ProviderGet => entities::get(self, payload, AggregateKind::Provider).await,
            Endpoint::OperationGet => entities::get(self, payload, AggregateKind::Operation).await,
            Endpoint::ClusterList => entities::cluster_list(self, payload),
            Endpoint::InstanceList => entities::instance_list(self, payload),
            Endpoint::AllocationByConsumer => allocation::by_consumer(self, payload).await,
            Endpoint::History => history::history(self, payload).await,
            Endpoint::StateAt => history::state_at(self, payload).await,
            Endpoint::CmdAppend => append::append(self, payload, caller).await,
            Endpoint::ProviderList => placement::provider_list(self, payload),
            Endpoint::ProviderDelete => placement::provider_delete(self, payload, caller).await,
            Endpoint::HealAllocations => placement::heal(self, payload, caller).await,
            Endpoint::FixOrphans => placement::orphans(self, payload, caller).await,
            Endpoint::WorkerReady => worker::ready(self, payload, caller),
            Endpoint::OperationList => entities::operation_list(self, payload),
            Endpoint::Drift => health::drift(self, payload),
        }
    }
}
