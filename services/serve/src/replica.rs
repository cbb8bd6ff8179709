//! One replica's shared state: what its request handlers, its console, its metrics, its
//! sweeps and `service::run` all read ([`QueryContext`]), and whether it can answer from
//! current state ([`Readiness`]). It answers no request itself (`endpoints` does) and
//! writes nothing: it is the state those read and the handles they write through.

use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;
use std::time::Duration;

use provledger_client::{Ledger, Writer};
use provledger_events::{EventLog, JetStreamLog};
use tokio::sync::watch;

use crate::messages::DriftSweep;
use crate::store::ProjectionStore;

/// How far behind the stream's end a replica may fall and still say it is ready: a busy
/// stream keeps every replica a few batches behind, which is not "not ready".
pub(crate) const READY_LAG_MAX: u64 = 1_000;

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
    /// Woken once `projector_failed` is set: a query waiting for a position the frozen
    /// projection will never reach is answered then, not at the end of its wait.
    pub(crate) projector_stopped: tokio::sync::Notify,
    /// The stream's end when this replica started, set once it had applied it and joined
    /// the queue group: `ready` in q.health.
    pub(crate) caught_up_to: std::sync::OnceLock<u64>,
    /// The largest reply this service sends; lists fill pages up to half of it.
    pub(crate) reply_bytes_max: usize,
    /// Queries waiting for a `min_position` right now (at most
    /// [`MIN_POSITION_WAITS_MAX`]).
    pub(crate) min_position_waits: AtomicUsize,
    /// Workers that said they listen again, for the re-issue delivery to serve first.
    pub(crate) workers_ready: WorkersReady,
    pub(crate) metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// The NATS connection, whose state says whether this replica can be ready.
    pub(crate) client: async_nats::Client,
    /// The drift sweep's last findings (`q.drift`).
    pub(crate) drift: DriftSweeps,
    /// The last audit this replica ran (`--audit-interval`), for the console.
    pub(crate) audits: LastAudits,
    /// serve's spans, when it exports them (`--otlp-endpoint`).
    pub(crate) spans: Option<crate::otlp::Spans>,
    /// Whether `cmd.append` records the caller's trace in its commits (`--no-trace-record`).
    pub(crate) record_traces: bool,
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

/// Requests handled at once; more wait for a slot, which pushes back on NATS.
pub const REQUESTS_IN_FLIGHT_MAX: usize = 1024;
/// Health checks handled at once, apart from the other requests.
pub const HEALTH_IN_FLIGHT_MAX: usize = 64;
/// Followers' catch-ups (`q.changes`) handled at once, apart from the other requests: each
/// reads up to `CHANGES_SCAN_MAX` positions of the stream, and however many followers catch
/// up at once, the writers' and readers' requests keep their slots (one more answers
/// `unavailable`, busy, at once: the follower retries).
pub const CHANGES_IN_FLIGHT_MAX: usize = 16;
/// Queries that may wait for a `min_position` at once. Well below serve's requests in
/// flight, so that waiting queries can never take every slot from health checks and
/// commands.
pub const MIN_POSITION_WAITS_MAX: usize = 256;
const _: () = assert!(MIN_POSITION_WAITS_MAX < REQUESTS_IN_FLIGHT_MAX / 2);

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
    /// connected to NATS, and no more than [`READY_LAG_MAX`] positions behind.
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
                Some(lag) if lag > READY_LAG_MAX => Some(format!(
                    "{lag} positions behind the stream's end (more than {})",
                    READY_LAG_MAX
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
}

/// The last sweep of this replica, and whether it sweeps at all.
#[derive(Default)]
pub(crate) struct DriftSweeps {
    pub(crate) interval: Option<Duration>,
    last: Mutex<Option<DriftSweep>>,
}

impl DriftSweeps {
    pub(crate) fn new(interval: Option<Duration>) -> Self {
        DriftSweeps {
            interval,
            last: Mutex::new(None),
        }
    }

    pub(crate) fn last(&self) -> Option<DriftSweep> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn keep(&self, sweep: DriftSweep) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(sweep);
    }
}

/// What the last audit of this replica found (`serve --audit-interval`), for the console's
/// health page and the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastAudit {
    pub finished_at: provledger_events::Timestamp,
    pub took_ms: u64,
    /// The last position audited.
    pub position: u64,
    pub commits: u64,
    pub violations: usize,
    /// The first violations, as an operator reads them (at most [`AUDIT_VIOLATIONS_KEPT`]).
    pub first: Vec<String>,
}

/// Violations kept word for word from one audit (all are counted).
pub const AUDIT_VIOLATIONS_KEPT: usize = 20;

impl LastAudit {
    pub fn of(
        report: &provledger_projections::audit::AuditReport,
        finished_at: provledger_events::Timestamp,
        took_ms: u64,
    ) -> LastAudit {
        LastAudit {
            finished_at,
            took_ms,
            position: report.position,
            commits: report.commits,
            violations: report.violations.len(),
            first: report
                .violations
                .iter()
                .take(AUDIT_VIOLATIONS_KEPT)
                .map(|v| {
                    format!(
                        "{}{}: {} ({})",
                        v.aggregate.as_deref().unwrap_or("log"),
                        v.position.map(|p| format!(" at #{p}")).unwrap_or_default(),
                        v.problem,
                        v.action
                    )
                })
                .collect(),
        }
    }
}

/// The audits this replica runs: how often, and the last one's result.
#[derive(Debug, Default)]
pub struct LastAudits {
    pub interval: Option<std::time::Duration>,
    last: std::sync::Mutex<Option<LastAudit>>,
    /// When and why the latest audit could not run, if it could not (cleared by the next
    /// that finishes): the last result is then older than it looks.
    failed: std::sync::Mutex<Option<(provledger_events::Timestamp, String)>>,
}

impl LastAudits {
    pub fn new(interval: Option<std::time::Duration>) -> Self {
        LastAudits {
            interval,
            last: Default::default(),
            failed: Default::default(),
        }
    }

    pub fn last(&self) -> Option<LastAudit> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn record(&self, audit: LastAudit) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(audit);
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    pub fn record_failure(&self, at: provledger_events::Timestamp, reason: String) {
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some((at, reason));
    }

    pub fn failed(&self) -> Option<(provledger_events::Timestamp, String)> {
        self.failed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
