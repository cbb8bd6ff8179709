//! serve's drift sweep (`serve --drift-interval`): every interval, the same comparison
//! `provledger drift` makes (`docs/drift.md`), with the ledger's side read from this
//! replica's store (never the log), its findings kept for `q.drift` and exported as
//! metrics. It writes nothing to the ledger.
//!
//! Order matters as in the CLI: each inventory is compared a page at a time with the store
//! as read before asking, and the findings are then confirmed against the store as read
//! after, so that whatever an executor answered it holds had its intent recorded (and
//! applied here) before a finding is reported (intent before effect).

use std::time::Duration;

use provledger_client::inventory::{
    compare_inventories, confirmed, discover_executors, ReadBounds, INVENTORY_READ_MAX,
};
use provledger_events::{AggregateKind, Timestamp};
use provledger_projections::drift::{LedgerResources, Names, OperationResources};
use provledger_projections::Entity;

pub(crate) use crate::messages::{DriftSweep, ExecutorRead};
use crate::store::{ProjectionStore, StoreError};

/// What the store's operations say the executors hold: each operation read and reduced
/// in turn (`OperationResources`), never all of them whole at once.
fn stored_resources(store: &ProjectionStore) -> Result<LedgerResources, StoreError> {
    let mut names = Names::default();
    let mut ops = Vec::new();
    for entity in store.entities_of(AggregateKind::Operation, None) {
        if let Entity::Operation(op) = entity? {
            ops.push(OperationResources::of(&op, &mut names));
        }
    }
    Ok(LedgerResources::build(&ops))
}

/// Where the executors are asked.
pub(crate) struct Inventories<'a> {
    pub(crate) client: &'a async_nats::Client,
    pub(crate) subject_prefix: &'a str,
    pub(crate) reply_wait: Duration,
}

/// One sweep: asks every executor the ledger names and every one discovered answering the
/// inventory subject (as `provledger drift` does; a failed or incomplete discovery is
/// logged), comparing each page as it comes with the store's operations, then confirms
/// the findings against the store as it is after.
pub(crate) async fn sweep_once(
    store: &ProjectionStore,
    applied: &tokio::sync::watch::Receiver<u64>,
    at: Inventories<'_>,
) -> Result<DriftSweep, StoreError> {
    let started = std::time::Instant::now();
    let before = stored_resources(store)?;
    let mut executors = before.executors();
    match discover_executors(at.client, at.subject_prefix, &executors).await {
        Ok(found) => {
            if !found.incomplete.is_empty() || !found.rejected.is_empty() {
                tracing::warn!(incomplete = ?found.incomplete, rejected = ?found.rejected,
                    "drift sweep: discovery may have missed executors (docs/drift.md)");
            }
            executors.extend(found.discovered);
        }
        Err(e) => {
            tracing::warn!(error = %e, "drift sweep: no discovery; asking the executors the ledger names")
        }
    }
    let executors: Vec<String> = executors.into_iter().collect();
    let bounds = ReadBounds {
        reply_wait: at.reply_wait,
        whole: INVENTORY_READ_MAX,
    };
    let asked = compare_inventories(
        at.client,
        at.subject_prefix,
        &executors,
        bounds,
        &before,
        &|_, _| {},
    )
    .await;
    drop(before);
    // After the inventories: the store has applied at least every intent recorded before
    // an executor acted on it.
    let position = *applied.borrow();
    let findings = confirmed(&stored_resources(store)?, &asked);
    let executors = asked
        .into_iter()
        .map(|a| match a.held {
            Ok(held) => ExecutorRead {
                name: a.executor,
                held: Some(held),
                error: None,
                leaks_not_listed: a.suspects_not_kept,
            },
            Err(e) => ExecutorRead {
                name: a.executor,
                held: None,
                error: Some(e.to_string()),
                leaks_not_listed: 0,
            },
        })
        .collect();
    Ok(DriftSweep {
        finished_at: Timestamp::now().to_rfc3339(),
        took_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        position,
        executors,
        findings,
    })
}

/// Sweeps every `sweeps.interval` until `shutdown` changes or its sender is dropped (serve
/// returning early), keeping the last sweep and exporting
/// it as metrics.
pub(crate) async fn run(
    ctx: std::sync::Arc<crate::replica::QueryContext>,
    subject_prefix: String,
    reply_wait: Duration,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let Some(interval) = ctx.drift.interval else {
        return;
    };
    loop {
        let at = Inventories {
            client: &ctx.client,
            subject_prefix: &subject_prefix,
            reply_wait,
        };
        match sweep_once(&ctx.store, &ctx.applied, at).await {
            Ok(sweep) => {
                let unread = sweep.executors.iter().filter(|e| e.error.is_some()).count();
                if sweep.findings.is_empty() && unread == 0 {
                    tracing::info!(
                        executors = sweep.executors.len(),
                        took_ms = sweep.took_ms,
                        "drift sweep: no drift"
                    );
                } else {
                    tracing::warn!(
                        findings = sweep.findings.len(),
                        unread,
                        "drift sweep found drift; see q.drift or provledger drift"
                    );
                }
                ctx.metrics.drift_swept(&sweep);
                ctx.drift.keep(sweep);
            }
            Err(e) => {
                ctx.metrics.drift_sweep_failed();
                tracing::warn!(error = %e, "drift sweep failed");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.changed() => return,
        }
    }
}
