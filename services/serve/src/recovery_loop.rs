//! serve's recovery loop: a recovery round (`provledger_client::recovery::recovery_round`)
//! on start and every `--recovery-interval`, with the running operations whose runner
//! lease lapsed (`--runner-lease`) failed in the same round
//! (`provledger_client::recovery::fail_silent_runners`; their rollback is the rollback
//! worker's), and between rounds the delivery of pending re-issues, each worker's attempts
//! on a task of their own.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use provledger_client::recovery::{
    deliver_to_worker, due_reissues, fail_silent_runners, recovery_round, RecoveryOutcome, Reissuer,
};
use provledger_client::Stamper;
use provledger_projections::recovery::{
    ReissuePolicy, RUNNER_LEASE_MS_MAX, RUNNER_LEASE_MS_MIN, SILENT_RUNNER_RULE,
};
use provledger_projections::Entity;
use tokio::sync::{watch, Notify};

use crate::replica::QueryContext;
use crate::store::OperationFilter;

/// How often pending re-issues are looked at while some are pending (each is sent when
/// its backoff allows).
const REISSUE_ROUND_INTERVAL: Duration = Duration::from_secs(1);

/// Runs until `shutdown` turns true. The sweep walks the store's instances (never folds the
/// log); each recovery is recorded at the instance's exact version in the log, so one
/// decided from a store that lags is refused (`raced`) and decided again by the next round.
/// `reissues_news` is the projector's: woken by every re-issue recorded or failed, whoever
/// wrote it.
pub(crate) async fn run(
    ctx: Arc<QueryContext>,
    interval: Duration,
    reissuer: Arc<dyn Reissuer>,
    policy: ReissuePolicy,
    runner_lease: Duration,
    reissues_news: Arc<Notify>,
    mut shutdown: watch::Receiver<bool>,
) {
    let ledger = ctx.writer.clone();
    let store = ctx.store.clone();
    let runner_lease_ms = i64::try_from(runner_lease.as_millis())
        .unwrap_or(i64::MAX)
        .clamp(RUNNER_LEASE_MS_MIN, RUNNER_LEASE_MS_MAX);
    // On start, then every interval: racing replicas record each recovery once.
    // Between sweeps, pending re-issues are delivered: every second while some
    // are pending, at once when a worker says it is ready. Each worker's attempts
    // run on a task of their own: one that never answers holds only its own.
    let mut next_sweep = tokio::time::Instant::now();
    let mut busy: BTreeMap<String, tokio::task::JoinHandle<()>> = Default::default();
    let mut carried = crate::replica::ReadyWorkers::new();
    loop {
        let stamper = Stamper::system();
        if tokio::time::Instant::now() >= next_sweep {
            let round = recovery_round(&ledger, &store, false, &stamper).await;
            match round.sweep {
                Ok(report) if report.written() > 0 => {
                    for recovered in &report.recoveries {
                        if recovered.outcome == RecoveryOutcome::Recorded {
                            ctx.metrics.recovered(&recovered.rule);
                        }
                    }
                    tracing::info!(written = report.written(), "stuck-state recovery sweep")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "stuck-state recovery sweep failed"),
            }
            // Running operations whose runner went silent past its lease: failed at
            // their exact version (a runner that wrote meanwhile wins); the rollback
            // worker then rolls them back.
            let running = OperationFilter {
                status: Some("running".into()),
                ..Default::default()
            };
            let operations: Vec<_> = store
                .operations(&running, None)
                .filter_map(|e| match e {
                    Ok(Entity::Operation(op)) => Some(*op),
                    _ => None,
                })
                .collect();
            for failed in
                fail_silent_runners(&ledger, operations, runner_lease_ms, false, &stamper).await
            {
                match &failed.outcome {
                    RecoveryOutcome::Recorded => {
                        ctx.metrics.recovered(SILENT_RUNNER_RULE);
                        tracing::warn!(operation = %failed.operation, reason = %failed.reason, "operation failed: its runner went silent")
                    }
                    RecoveryOutcome::Failed(e) => {
                        tracing::warn!(operation = %failed.operation, error = %e, "failing a silent runner's operation failed")
                    }
                    _ => {}
                }
            }
            // A provider delete a crash left half done (a cascade spanning several
            // commits) is finished in the round: nobody has to run it again.
            if let Err(e) = round.provider_deletes_finished {
                tracing::warn!(error = %e, "finishing provider deletes failed");
            }
            next_sweep = tokio::time::Instant::now() + interval;
        }
        busy.retain(|_, task| !task.is_finished());
        let mut ready = ctx.workers_ready.take();
        ready.append(&mut carried);
        let pending = match due_reissues(&store, &policy, &ready, &stamper).await {
            Ok((by_worker, pending)) => {
                for (worker, dues) in by_worker {
                    if busy.contains_key(&worker) {
                        // Its previous attempts are still out; a "ready" it sent
                        // meanwhile counts for the next round.
                        if let Some(at) = ready.get(&worker) {
                            carried.insert(worker, *at);
                        }
                        continue;
                    }
                    let (ledger, reissuer, stamper) =
                        (ledger.clone(), reissuer.clone(), stamper.clone());
                    let name = worker.clone();
                    busy.insert(
                        worker,
                        tokio::spawn(async move {
                            let report =
                                deliver_to_worker(&ledger, reissuer.as_ref(), dues, &stamper)
                                    .await;
                            tracing::info!(worker = %name, sent = report.sent, delivered = report.delivered, failed = report.failed, "re-issues sent");
                        }),
                    );
                }
                pending
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading pending re-issues failed");
                1
            }
        };
        let wait = match pending {
            0 => next_sweep.saturating_duration_since(tokio::time::Instant::now()),
            _ => REISSUE_ROUND_INTERVAL
                .min(next_sweep.saturating_duration_since(tokio::time::Instant::now())),
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = ctx.workers_ready.wake.notified() => {}
            // A re-issue recorded or failed by anyone (`recover`, another replica):
            // its next attempt is due now or after its backoff, not at the next
            // sweep.
            _ = reissues_news.notified() => {}
            _ = shutdown.changed() => {
                for task in busy.values() {
                    task.abort();
                }
                return;
            }
        }
    }
}
