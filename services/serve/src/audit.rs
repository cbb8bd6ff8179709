//! The audit's shell: reads the whole log once through the pure `Auditor` and, when a
//! projection store copies that log, compares the copy entry by entry.

use std::collections::HashSet;

use futures::StreamExt;
use provledger_events::{codec, EventLog, ReadError, Timestamp};
use provledger_projections::audit::{AuditReport, Auditor, Check, Violation};

use crate::projector::OnChainViolation;
use crate::store::{HistoryCopy, ProjectionStore, StoreError};

/// Why the audit could not run (a finding is never an error: it is in the report).
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// An offline audit of a replica's copy that does not begin at position 1.
    #[error(
        "this data dir's copy of the stream starts at position {from}: it cannot be audited whole offline (audit the stream: `--nats`)"
    )]
    PartialCopy { from: u64 },
}

/// A sled copy to compare, from `from` up to its checkpoint.
struct Copy<'a> {
    store: &'a ProjectionStore,
    from: u64,
    checkpoint: u64,
    quarantined: HashSet<u64>,
}

impl Copy<'_> {
    /// Whether the copy holds the same commit at its position; a violation otherwise.
    fn compare(&self, commit: &provledger_events::Commit) -> Option<Violation> {
        // A commit readers quarantine (outside its chain) is in no copy: the quarantine
        // record stands for it.
        if commit.position > self.checkpoint
            || commit.position < self.from
            || self.quarantined.contains(&commit.position)
        {
            return None;
        }
        let stored = self
            .store
            .raw_commits(commit.position, commit.position)
            .next();
        let problem = match (stored, codec::encode(commit)) {
            (Some(Ok((_, bytes))), Ok(expected)) if bytes.as_ref() == expected.as_slice() => {
                return None
            }
            (Some(Ok(_)), _) => "the copy's bytes differ from the log's".to_string(),
            (Some(Err(e)), _) => format!("the copy cannot be read: {e}"),
            (None, _) => "the copy lacks this commit".to_string(),
        };
        Some(copy_violation(
            Some(commit.aggregate.to_string()),
            Some(commit.version),
            commit.position,
            problem,
        ))
    }

    fn compare_quarantined(&self, position: u64) -> Option<Violation> {
        if position > self.checkpoint
            || position < self.from
            || self.quarantined.contains(&position)
        {
            return None;
        }
        Some(copy_violation(
            None,
            None,
            position,
            "the log quarantines this entry but the copy has no quarantine record".into(),
        ))
    }
}

fn copy_violation(
    aggregate: Option<String>,
    version: Option<u64>,
    position: u64,
    problem: String,
) -> Violation {
    Violation {
        check: Check::Copy,
        aggregate,
        version,
        position: Some(position),
        problem,
        action: "the sled copy was altered or damaged: stop the service, move its data dir aside and let it rebuild from the stream".into(),
    }
}

/// Audits `log` from position 1 to its end as of the start. `on_violation`: what a commit
/// outside its aggregate's chain is on this log, as for the projector (JetStream:
/// quarantined; embedded: a broken chain). `copy`: a projection store
/// that copies this log (a service's data dir, or the embedded projection), compared up to
/// its checkpoint. `progress(done, end)` is called as positions are read.
pub async fn audit_log<L: EventLog>(
    log: &L,
    on_violation: OnChainViolation,
    copy: Option<&ProjectionStore>,
    now: Timestamp,
    mut progress: impl FnMut(u64, u64),
) -> Result<AuditReport, AuditError> {
    let end = log.last_position().await?;
    let copy = match copy {
        Some(store) => {
            let (from, checkpoint) = match store.history_copy()? {
                HistoryCopy::InProjection => (1, store.checkpoint()?),
                // serve's copy, which may end before its projection.
                HistoryCopy::Separate(extent) => (extent.from, extent.through),
                // No copy (`--no-log-copy`): nothing to compare.
                HistoryCopy::None => (1, 0),
            };
            Some(Copy {
                store,
                from,
                checkpoint,
                quarantined: store.quarantined()?.iter().map(|q| q.position).collect(),
            })
        }
        None => None,
    };
    let mut auditor = match on_violation {
        OnChainViolation::Quarantine => Auditor::new().quarantining_link_breaks(),
        OnChainViolation::Fail => Auditor::new(),
    };
    let mut entries = log.read_all(1).await?;
    while let Some(entry) = entries.next().await {
        let position = match &entry {
            Ok(commit) => {
                auditor.commit(commit);
                if let Some(v) = copy.as_ref().and_then(|c| c.compare(commit)) {
                    auditor.record(v);
                }
                commit.position
            }
            Err(e) => match e.quarantine_parts() {
                Some((position, subject, reason, payload)) => {
                    if let ReadError::Undecodable { error, .. } = e {
                        // Named in the report: garbage, or a commit of a newer build.
                        auditor.undecodable(
                            position,
                            subject,
                            payload.first().copied(),
                            &error.to_string(),
                        );
                    } else {
                        auditor.quarantined(position, subject, &reason);
                    }
                    if let Some(v) = copy.as_ref().and_then(|c| c.compare_quarantined(position)) {
                        auditor.record(v);
                    }
                    position
                }
                None => return Err(AuditError::Read(e.clone())),
            },
        };
        if position % 4096 == 0 || position == end {
            progress(position, end);
        }
        if position >= end {
            break;
        }
    }
    let report = auditor.finish(end, now);
    tracing::info!(
        position = report.position,
        commits = report.commits,
        violations = report.violations.len(),
        "audit finished"
    );
    Ok(report)
}

/// Audits a stopped replica's copy of the stream (`crate::log_copy`) offline: its commits
/// and the projection's quarantine records in position order through the auditor, as
/// `audit_log` reads the stream, up to the copy's end. The same stream gives the same
/// report through the copy's end. Refused for a copy that does not begin at position 1
/// (its chains would all look broken) or a data dir without one.
pub fn audit_copy(
    store: &ProjectionStore,
    now: Timestamp,
    mut progress: impl FnMut(u64, u64),
) -> Result<AuditReport, AuditError> {
    let extent = match store.history_copy()? {
        HistoryCopy::Separate(extent) => extent,
        HistoryCopy::InProjection | HistoryCopy::None => {
            return Err(StoreError::HistoryNotCopied.into())
        }
    };
    if !extent.is_whole() {
        return Err(AuditError::PartialCopy { from: extent.from });
    }
    let end = extent.through;
    // Keyed by position: in position order.
    let mut quarantined = store
        .quarantined()?
        .into_iter()
        .filter(|q| q.position <= end)
        .peekable();
    let mut auditor = Auditor::new().quarantining_link_breaks();
    let mut take_quarantined_before = |position: u64, auditor: &mut Auditor| {
        while let Some(q) = quarantined.next_if(|q| q.position < position) {
            auditor.quarantined(q.position, &q.subject, &q.error);
        }
    };
    for commit in store.commits(1, end) {
        let commit = commit?;
        take_quarantined_before(commit.position, &mut auditor);
        auditor.commit(&commit);
        if commit.position % 4096 == 0 {
            progress(commit.position, end);
        }
    }
    take_quarantined_before(u64::MAX, &mut auditor);
    progress(end, end);
    Ok(auditor.finish(end, now))
}

/// serve's audit (`--audit-interval`): the whole log through the auditor once caught up,
/// then every interval, each result kept for the console and logged. It only reads.
pub(crate) async fn audit_sweeps(
    ctx: std::sync::Arc<crate::replica::QueryContext>,
    interval: std::time::Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let started = std::time::Instant::now();
        let store = ctx.store.clone();
        let mut last_logged = std::time::Instant::now();
        let result = audit_log(
            &ctx.log,
            OnChainViolation::Quarantine,
            Some(&store),
            Timestamp::now(),
            |position, end| {
                // A long audit says where it is, every few seconds.
                if last_logged.elapsed() >= std::time::Duration::from_secs(5) {
                    last_logged = std::time::Instant::now();
                    tracing::info!(position, end, "audit in progress");
                }
            },
        )
        .await;
        match result {
            Ok(report) => {
                let took_ms = started.elapsed().as_millis() as u64;
                if !report.violations.is_empty() {
                    tracing::warn!(
                        violations = report.violations.len(),
                        position = report.position,
                        "the audit found violations: see the console's health page or run `provledger audit`"
                    );
                }
                ctx.audits.record(crate::replica::LastAudit::of(
                    &report,
                    Timestamp::now(),
                    took_ms,
                ));
            }
            Err(e) => {
                tracing::warn!(error = %e, "the audit could not run");
                ctx.audits.record_failure(Timestamp::now(), e.to_string());
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
    }
}
