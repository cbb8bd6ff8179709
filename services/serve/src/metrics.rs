//! serve's Prometheus metrics (`serve --metrics-addr`): what an operator alerts on.
//!
//! Counters and histograms are updated where things happen (requests, appends, the
//! projector's folds, the recovery sweep); gauges that describe the store (operations by
//! status, the quarantine) or the stream (its end, the lag) are read when scraped, so a
//! scrape always says what the store says now. The exposition is the Prometheus project's
//! own client (`prometheus-client`, OpenMetrics text); the HTTP side is axum.
//!
//! This is the registry and what updates it; it reads nothing of the replica itself
//! (`scrape.rs` serves it over HTTP and reads the store and the stream for the gauges).

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use provledger_events::{Event, Timestamp};
use provledger_projections::operation::OperationStatus;

/// The statuses whose oldest operation's age is a gauge
/// (`provledger_operation_oldest_age_seconds`): a `running` operation hours old has likely
/// lost its writer, and a `needs_attention` one waits for an operator.
pub(crate) const AGED_STATUSES: [&str; 2] = ["running", "needs_attention"];

/// Request latency buckets, in seconds: 100 µs to about 13 s.
const LATENCY_BUCKET_START_SECONDS: f64 = 0.0001;
const LATENCY_BUCKETS: u16 = 18;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct EndpointLabels {
    pub(crate) endpoint: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    pub(crate) outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RefusalLabels {
    pub(crate) endpoint: String,
    pub(crate) code: String,
    pub(crate) reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SourceLabels {
    pub(crate) source: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StatusLabels {
    pub(crate) status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DriftLabels {
    pub(crate) executor: Escaped,
    pub(crate) kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ExecutorLabels {
    pub(crate) executor: Escaped,
}

/// How many executors get series of their own per drift sweep; the others are summed into
/// one series labelled [`OTHER_EXECUTORS`]. Executor names are chosen by whoever records a
/// step, so without a bound one service could make a scrape as large as it likes.
pub const DRIFT_EXECUTOR_SERIES_MAX: usize = 64;
/// The label of the executors past [`DRIFT_EXECUTOR_SERIES_MAX`] (not a valid executor
/// name, so it cannot be confused with one).
pub const OTHER_EXECUTORS: &str = "(other)";

/// A label value from outside (an executor's name, as recorded in the log). Names are
/// checked against their grammar when written, but the log may hold older or forged ones:
/// the value is encoded escaped as OpenMetrics requires (`\\`, `\"`, `\n`; the
/// exposition library writes values raw), so no value can end its series or start
/// another.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub(crate) struct Escaped(pub(crate) String);

impl EncodeLabelValue for Escaped {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RuleLabels {
    pub(crate) rule: String,
}

/// What the projector counts as it folds: shared handles, cheap to clone.
#[derive(Clone, Default)]
pub struct FoldMetrics {
    commits: Counter,
    /// Batches the live feed had no room for (`Projector::with_feed`).
    feed_dropped: Counter,
    /// Changes the live feed published.
    feed_published: Counter,
    /// Applied batches the replica's copy had no room for (read back from the stream).
    copy_dropped: Counter,
    compensations: Family<OutcomeLabels, Counter>,
    quarantined: Counter,
    integrity_errors: Counter,
}

impl FoldMetrics {
    /// One applied batch the live feed had no room for.
    pub(crate) fn feed_dropped(&self) {
        self.feed_dropped.inc();
    }

    /// One applied batch the copier's queue had no room for: the copier reads it back
    /// from the stream.
    pub(crate) fn copy_dropped(&self) {
        self.copy_dropped.inc();
    }

    /// Changes the live feed published.
    pub(crate) fn feed_published(&self, n: u64) {
        self.feed_published.inc_by(n);
    }

    /// One commit folded, with its events.
    pub(crate) fn folded(&self, events: &[Event]) {
        self.commits.inc();
        for event in events {
            let outcome = match event {
                Event::CompensationRequested { .. } => "requested",
                Event::CompensationDone { .. } => "done",
                Event::CompensationFailed { .. } => "failed",
                _ => continue,
            };
            self.compensations
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.into(),
                })
                .inc();
        }
    }

    /// A log entry quarantined; `integrity` when it broke its aggregate's chain (rather
    /// than not decoding at all).
    pub(crate) fn quarantined(&self, integrity: bool) {
        self.quarantined.inc();
        if integrity {
            self.integrity_errors.inc();
        }
    }
}

/// Every metric of one serve replica.
pub(crate) struct Metrics {
    registry: Registry,
    pub(crate) fold: FoldMetrics,
    requests: Family<EndpointLabels, Histogram>,
    appends: Family<OutcomeLabels, Counter>,
    refusals: Family<RefusalLabels, Counter>,
    recoveries: Family<RuleLabels, Counter>,
    operations: Family<StatusLabels, Gauge>,
    oldest_operation: Family<StatusLabels, Gauge>,
    log_position: Gauge,
    log_end: Gauge,
    log_lag: Gauge,
    log_copy_behind: Gauge,
    quarantine: Gauge,
    consumers: Gauge,
    append_races_lost: Counter,
    ready: Gauge,
    nats_connected: Gauge,
    drift_findings: Family<DriftLabels, Gauge>,
    drift_unread: Family<ExecutorLabels, Gauge>,
    drift_sweeps: Family<OutcomeLabels, Counter>,
    drift_last_sweep: Gauge,
    changes_read: Family<SourceLabels, Counter>,
    pub(crate) spans: SpanMetrics,
}

/// What the span export (`otlp.rs`) counts: shared handles, cheap to clone.
#[derive(Clone, Default, Debug)]
pub(crate) struct SpanMetrics {
    /// Spans ended while the export queue was full: dropped, never waited for.
    pub(crate) dropped: Counter,
    /// Spans in batches the collector did not take (refused, unreachable, past the
    /// export timeout).
    pub(crate) failed: Counter,
    /// Spans the collector took.
    pub(crate) exported: Counter,
}

fn latency_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        LATENCY_BUCKET_START_SECONDS,
        2.0,
        LATENCY_BUCKETS,
    ))
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let mut registry = Registry::with_prefix("provledger");
        let m = Metrics {
            fold: FoldMetrics::default(),
            requests: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            appends: Family::default(),
            refusals: Family::default(),
            recoveries: Family::default(),
            operations: Family::default(),
            oldest_operation: Family::default(),
            log_position: Gauge::default(),
            log_end: Gauge::default(),
            log_lag: Gauge::default(),
            log_copy_behind: Gauge::default(),
            quarantine: Gauge::default(),
            consumers: Gauge::default(),
            append_races_lost: Counter::default(),
            ready: Gauge::default(),
            nats_connected: Gauge::default(),
            drift_findings: Family::default(),
            drift_unread: Family::default(),
            drift_sweeps: Family::default(),
            drift_last_sweep: Gauge::default(),
            changes_read: Family::default(),
            spans: SpanMetrics::default(),
            registry: Registry::default(),
        };
        m.register(&mut registry);
        m.seed_alert_series();
        Metrics { registry, ..m }
    }

    /// Registers every metric with `registry`: one registration each, in the order a
    /// scrape lists them.
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "log_position",
            "The last log position this replica's projection has applied",
            self.log_position.clone(),
        );
        registry.register(
            "log_end",
            "The stream's last position, read at the scrape",
            self.log_end.clone(),
        );
        registry.register(
            "log_lag",
            "Positions between the stream's end and what this replica has applied",
            self.log_lag.clone(),
        );
        registry.register(
            "log_copy_behind_positions",
            "Positions between what this replica's projection applied and what its copy of the stream holds (0 without a copy, --no-log-copy)",
            self.log_copy_behind.clone(),
        );
        registry.register(
            "log_copy_dropped_batches",
            "Applied batches the copy's queue had no room for, each read back from the stream by the copier",
            self.fold.copy_dropped.clone(),
        );
        registry.register(
            "commits_folded",
            "Commits the projector folded since this replica started",
            self.fold.commits.clone(),
        );
        registry.register(
            "feed_published",
            "Changes this replica published on the live feed (<prefix>.feed.<kind>.<id>)",
            self.fold.feed_published.clone(),
        );
        registry.register(
            "feed_dropped_batches",
            "Applied batches the live feed had no room for (its followers fill the gap through q.changes)",
            self.fold.feed_dropped.clone(),
        );
        registry.register(
            "changes_read",
            "Entries q.changes read to answer followers, by source: copy (this replica's copy of the stream, local) or stream (JetStream, a direct get per message)",
            self.changes_read.clone(),
        );
        registry.register(
            "appends",
            "cmd.append requests by outcome (committed, duplicate, or the refusal's code)",
            self.appends.clone(),
        );
        registry.register(
            "refusals",
            "Requests refused, by endpoint, code and reason (the refusal's stable reason, or its code)",
            self.refusals.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time to answer a request, by endpoint",
            self.requests.clone(),
        );
        registry.register(
            "operations",
            "Operations by status, needs_attention included: rollbacks an operator must look at",
            self.operations.clone(),
        );
        registry.register(
            "operation_oldest_age_seconds",
            "Seconds since the oldest operation in the status (running, needs_attention) started; 0 when none is",
            self.oldest_operation.clone(),
        );
        registry.register(
            "compensation_events",
            "Compensation events folded (requested = an attempt asked of an executor, done, failed)",
            self.fold.compensations.clone(),
        );
        registry.register(
            "recoveries",
            "Stuck-state recoveries this replica recorded, by rule",
            self.recoveries.clone(),
        );
        registry.register(
            "quarantined_entries",
            "Log entries held in quarantine (undecodable, or outside their aggregate's chain)",
            self.quarantine.clone(),
        );
        registry.register(
            "quarantined",
            "Log entries quarantined since this replica started",
            self.fold.quarantined.clone(),
        );
        registry.register(
            "integrity_errors",
            "Commits outside their aggregate's hash chain met since this replica started",
            self.fold.integrity_errors.clone(),
        );
        registry.register(
            "consumers_held",
            "JetStream consumers this replica holds (its live tail)",
            self.consumers.clone(),
        );
        registry.register(
            "append_races_lost",
            "Appends of cmd.append the stream refused because another writer (a replica, a service with the library) had appended after the state they were decided on; each was read and decided again",
            self.append_races_lost.clone(),
        );
        registry.register(
            "ready",
            "1 when this replica is caught up, connected and in the queue group",
            self.ready.clone(),
        );
        registry.register(
            "spans_exported",
            "Spans the OTLP collector took (--otlp-endpoint)",
            self.spans.exported.clone(),
        );
        registry.register(
            "spans_dropped",
            "Spans dropped because the OTLP export queue was full (SPAN_QUEUE_MAX)",
            self.spans.dropped.clone(),
        );
        registry.register(
            "spans_export_failed",
            "Spans in batches the OTLP collector refused or did not take within the export timeout",
            self.spans.failed.clone(),
        );
        registry.register(
            "nats_connected",
            "1 while this replica's NATS connection is up",
            self.nats_connected.clone(),
        );
        registry.register(
            "drift_findings",
            "Findings of this replica's last drift sweep, by executor and kind (leaked, missing, mismatched)",
            self.drift_findings.clone(),
        );
        registry.register(
            "drift_executor_unread",
            "1 for each executor the last drift sweep could not read",
            self.drift_unread.clone(),
        );
        registry.register(
            "drift_sweeps",
            "Drift sweeps by outcome (clean, drift, failed)",
            self.drift_sweeps.clone(),
        );
        registry.register(
            "drift_last_sweep_timestamp_seconds",
            "When this replica's last drift sweep finished (Unix seconds; 0: none yet)",
            self.drift_last_sweep.clone(),
        );
    }

    /// Creates, at zero, the series of each label an alert reads.
    fn seed_alert_series(&self) {
        // Series an alert reads exist from the start, at zero: a rule on a series that
        // does not exist yet evaluates to nothing rather than to "none".
        for status in OperationStatus::ALL {
            if let Ok(serde_json::Value::String(status)) = serde_json::to_value(status) {
                drop(self.operations.get_or_create(&StatusLabels { status }));
            }
        }
        for status in AGED_STATUSES {
            drop(self.oldest_operation.get_or_create(&StatusLabels {
                status: status.into(),
            }));
        }
        for outcome in [
            "appended",
            "already_appended",
            "conflict",
            "rejected",
            "unavailable",
        ] {
            drop(self.appends.get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            }));
        }
        for outcome in ["requested", "done", "failed"] {
            drop(self.fold.compensations.get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            }));
        }
    }

    /// One answered request: its latency, and for a refusal its code and reason.
    pub(crate) fn answered(
        &self,
        endpoint: &str,
        elapsed: Duration,
        refusal: Option<(&str, Option<&str>)>,
        append_committed: Option<&str>,
    ) {
        self.requests
            .get_or_create(&EndpointLabels {
                endpoint: endpoint.into(),
            })
            .observe(elapsed.as_secs_f64());
        if let Some((code, reason)) = refusal {
            self.refusals
                .get_or_create(&RefusalLabels {
                    endpoint: endpoint.into(),
                    code: code.into(),
                    reason: reason.unwrap_or(code).into(),
                })
                .inc();
        }
        if endpoint == "cmd.append" {
            let outcome = match (refusal, append_committed) {
                (Some((code, _)), _) => code,
                (None, Some(outcome)) => outcome,
                (None, None) => "committed",
            };
            self.appends
                .get_or_create(&OutcomeLabels {
                    outcome: outcome.into(),
                })
                .inc();
        }
    }

    /// A drift sweep finished: its findings replace the last sweep's (an executor or kind
    /// no longer found reads 0, not its old count).
    pub(crate) fn drift_swept(&self, sweep: &crate::messages::DriftSweep) {
        use provledger_projections::drift::FindingKind;
        const KINDS: usize = FindingKind::ALL.len();
        self.drift_findings.clear();
        self.drift_unread.clear();
        // Findings and unread per executor; past the bound, the executors with the fewest
        // findings (then by name) share the `(other)` series.
        let mut by_executor: std::collections::BTreeMap<&str, ([usize; KINDS], bool)> =
            Default::default();
        for e in &sweep.executors {
            by_executor.entry(e.name.as_str()).or_default().1 |= e.error.is_some();
        }
        for f in &sweep.findings {
            let slot = FindingKind::ALL.iter().position(|k| *k == f.kind);
            if let (Some(counts), Some(slot)) = (by_executor.get_mut(f.executor.as_str()), slot) {
                counts.0[slot] += 1;
            }
        }
        let mut ranked: Vec<(&str, ([usize; KINDS], bool))> = by_executor.into_iter().collect();
        ranked.sort_by_key(|(name, (counts, _))| {
            (std::cmp::Reverse(counts.iter().sum::<usize>()), *name)
        });
        let mut series: Vec<(String, [usize; KINDS], bool)> = Vec::new();
        for (i, (name, (counts, unread))) in ranked.into_iter().enumerate() {
            if i < DRIFT_EXECUTOR_SERIES_MAX {
                series.push((name.to_string(), counts, unread));
                continue;
            }
            if series.len() == DRIFT_EXECUTOR_SERIES_MAX {
                series.push((OTHER_EXECUTORS.to_string(), [0; KINDS], false));
            }
            if let Some(other) = series.last_mut() {
                for (sum, n) in other.1.iter_mut().zip(counts) {
                    *sum += n;
                }
                other.2 |= unread;
            }
        }
        for (name, counts, unread) in series {
            for (kind, n) in FindingKind::ALL.iter().zip(counts) {
                self.drift_findings
                    .get_or_create(&DriftLabels {
                        executor: Escaped(name.clone()),
                        kind: kind.as_str().into(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            self.drift_unread
                .get_or_create(&ExecutorLabels {
                    executor: Escaped(name),
                })
                .set(i64::from(unread));
        }
        let outcome =
            match sweep.findings.is_empty() && sweep.executors.iter().all(|e| e.error.is_none()) {
                true => "clean",
                false => "drift",
            };
        self.drift_sweeps
            .get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            })
            .inc();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        self.drift_last_sweep.set(now);
    }

    /// A drift sweep could not read the store.
    pub(crate) fn drift_sweep_failed(&self) {
        self.drift_sweeps
            .get_or_create(&OutcomeLabels {
                outcome: "failed".into(),
            })
            .inc();
    }

    /// A recovery this replica recorded.
    /// `q.changes` read `copy` entries from the replica's copy and `stream` from the stream.
    pub(crate) fn changes_read(&self, copy: u64, stream: u64) {
        for (source, n) in [("copy", copy), ("stream", stream)] {
            if n > 0 {
                self.changes_read
                    .get_or_create(&SourceLabels { source })
                    .inc_by(n);
            }
        }
    }

    pub(crate) fn recovered(&self, rule: &str) {
        self.recoveries
            .get_or_create(&RuleLabels { rule: rule.into() })
            .inc();
    }

    /// Sets the gauges that describe the store and the stream to what a scrape read.
    pub(crate) fn set_gauges(&self, now: Gauges) {
        self.log_position.set(as_i64(now.position));
        // The stream's end could not be read (NATS lost): the lag is unknown, and the last
        // figures stay rather than a made-up zero.
        if let Some((end, lag)) = now.end_and_lag {
            self.log_end.set(as_i64(end));
            self.log_lag.set(as_i64(lag));
        }
        self.log_copy_behind.set(as_i64(now.copy_behind));
        self.ready.set(i64::from(now.ready));
        self.nats_connected.set(i64::from(now.nats_connected));
        for (status, count) in now.operation_counts.unwrap_or_default() {
            self.operations
                .get_or_create(&StatusLabels { status })
                .set(as_i64(count));
        }
        for (status, oldest) in now.oldest_started.unwrap_or_default() {
            let age_s = oldest.map_or(0, |at| {
                now.now.unix_ms().saturating_sub(at.unix_ms()).max(0) / 1000
            });
            self.oldest_operation
                .get_or_create(&StatusLabels { status })
                .set(age_s);
        }
        self.quarantine.set(as_i64(now.quarantined));
        self.consumers.set(as_i64(now.consumers));
        // The writer counts; the counter follows it at each scrape.
        let counted = self.append_races_lost.get();
        self.append_races_lost
            .inc_by(now.races_lost.saturating_sub(counted));
    }

    /// The registry in the OpenMetrics text format.
    pub(crate) fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// What a scrape read of the replica, for the gauges that describe the store and the
/// stream.
pub(crate) struct Gauges {
    pub(crate) position: u64,
    /// The stream's end and the lag behind it, when the end could be read.
    pub(crate) end_and_lag: Option<(u64, u64)>,
    pub(crate) ready: bool,
    pub(crate) nats_connected: bool,
    /// Operations by status word; `None` when the store could not be read.
    pub(crate) operation_counts: Option<Vec<(String, u64)>>,
    /// The earliest `started_at` in each of [`AGED_STATUSES`] (`None`: no operation in
    /// it); `None` when the store could not be read.
    pub(crate) oldest_started: Option<Vec<(String, Option<Timestamp>)>>,
    /// When the scrape read them: what the ages are counted to.
    pub(crate) now: Timestamp,
    pub(crate) quarantined: u64,
    /// Positions the replica's copy of the stream is behind its projection (0: no copy).
    pub(crate) copy_behind: u64,
    /// JetStream consumers the replica's log handle holds.
    pub(crate) consumers: u64,
    /// The write path's lost races since serve started (`Writer::races_lost`).
    pub(crate) races_lost: u64,
}

fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_operation_status_has_its_series_from_the_start() {
        let scrape = Metrics::new().encode().expect("encodes");
        for status in OperationStatus::ALL {
            let word = serde_json::to_value(status).expect("a status is JSON");
            let series = format!("provledger_operations{{status={word}}} 0");
            assert!(scrape.contains(&series), "no {series} in:\n{scrape}");
        }
    }

    #[test]
    fn the_oldest_operations_age_is_counted_from_its_start_to_the_scrape() {
        // Given a registry: the series exist from the start, at zero...
        let metrics = Metrics::new();
        let scrape = metrics.encode().expect("encodes");
        for status in AGED_STATUSES {
            let series =
                format!("provledger_operation_oldest_age_seconds{{status=\"{status}\"}} 0");
            assert!(
                scrape.lines().any(|l| l == series),
                "no {series} in:\n{scrape}"
            );
        }
        // ...when a scrape reads a running operation started 90 s before it and none
        // needing attention...
        let now = Timestamp::from_unix_ms(1_800_000_090_500);
        metrics.set_gauges(Gauges {
            position: 0,
            end_and_lag: None,
            ready: true,
            nats_connected: true,
            operation_counts: None,
            oldest_started: Some(vec![
                (
                    "running".into(),
                    Some(Timestamp::from_unix_ms(1_800_000_000_000)),
                ),
                ("needs_attention".into(), None),
            ]),
            now,
            quarantined: 0,
            copy_behind: 0,
            consumers: 0,
            races_lost: 0,
        });
        // ...then the running one's age is 90 s, and needs_attention's stays 0.
        let scrape = metrics.encode().expect("encodes");
        for series in [
            "provledger_operation_oldest_age_seconds{status=\"running\"} 90",
            "provledger_operation_oldest_age_seconds{status=\"needs_attention\"} 0",
        ] {
            assert!(
                scrape.lines().any(|l| l == series),
                "no {series} in:\n{scrape}"
            );
        }
    }

    #[test]
    fn a_scrape_parses_and_stays_bounded_whatever_executor_names_the_log_holds() {
        use provledger_projections::drift::{Finding, FindingKind};
        // Given a drift sweep over an executor whose name would forge metric lines (the log
        // may hold one written before names had a grammar, or forged) and 3,000 others,
        // each holding a leak (the hostile one five)...
        let hostile = "rt3evil\"} 7\nprovledger_ready 0\nprovledger_rt3_injected{a=\"";
        let names: Vec<String> = std::iter::once(hostile.to_string())
            .chain((0..3_000).map(|i| format!("svc-{i:04}")))
            .collect();
        let leak = |executor: &str, n: usize| Finding {
            kind: FindingKind::Leaked,
            executor: executor.into(),
            resource: format!("r{n}"),
            key: None,
            entity: None,
            operation_id: None,
            step: None,
            differences: Vec::new(),
            reason: String::new(),
            action: String::new(),
            undo: None,
        };
        let mut findings: Vec<Finding> = (0..5).map(|n| leak(hostile, n)).collect();
        findings.extend(names.iter().skip(1).map(|n| leak(n, 0)));
        let sweep = crate::messages::DriftSweep {
            finished_at: String::new(),
            took_ms: 0,
            position: 0,
            executors: names
                .iter()
                .map(|name| crate::messages::ExecutorRead {
                    name: name.clone(),
                    held: Some(1),
                    error: None,
                    leaks_not_listed: 0,
                })
                .collect(),
            findings,
        };
        let metrics = Metrics::new();
        metrics.drift_swept(&sweep);
        // ...when scraped, then the scrape parses as OpenMetrics...
        let scrape = metrics.encode().expect("encodes");
        let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&scrape)
            .unwrap_or_else(|e| panic!("{e:?} in:\n{scrape}"));
        // ...no line was forged...
        assert!(
            !parsed.families.contains_key("provledger_rt3_injected"),
            "{scrape}"
        );
        assert_eq!(
            parsed.families["provledger_ready"].iter_samples().count(),
            1
        );
        // ...the hostile name is one label value, as it was...
        let findings = &parsed.families["provledger_drift_findings"];
        let executors: std::collections::BTreeSet<String> = findings
            .iter_samples()
            .filter_map(|s| {
                s.get_labelset()
                    .ok()
                    .and_then(|l| l.get_label_value("executor").map(str::to_string))
            })
            .collect();
        assert!(executors.contains(hostile), "{executors:?}");
        // ...and the series are bounded: the executors past the bound share one.
        assert_eq!(executors.len(), DRIFT_EXECUTOR_SERIES_MAX + 1);
        assert!(executors.contains(OTHER_EXECUTORS));
        let leaked_elsewhere = findings
            .iter_samples()
            .find(|s| {
                s.get_labelset().is_ok_and(|l| {
                    l.get_label_value("executor") == Some(OTHER_EXECUTORS)
                        && l.get_label_value("kind") == Some("leaked")
                })
            })
            .map(|s| format!("{:?}", s.value));
        let expected = 3_000usize.saturating_sub(DRIFT_EXECUTOR_SERIES_MAX - 1);
        assert!(
            leaked_elsewhere
                .as_deref()
                .is_some_and(|v| v.contains(&expected.to_string())),
            "{leaked_elsewhere:?}, expected {expected}"
        );
        assert!(scrape.len() < 64 * 1024, "{} bytes", scrape.len());
    }
}
