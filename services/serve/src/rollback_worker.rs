//! The rollback and deletion worker of `serve`. It watches what the projector applies and:
//! - drives every stopped operation's rollback (plans it with an expected version, requests
//!   each compensation from its executor over NATS, confirms it with an event), so a
//!   restart in the middle of a rollback resumes it from the log;
//! - for every target being deleted, tells the operation in flight on it to stop
//!   (`TargetDeletionNoticed` and the `provledger.cancel.<id>` notice), and records
//!   `Deleted` once no instance and no operation of it remains.
//!
//! Several replicas run this worker at once; the driver's expected-version decisions and
//! deterministic ids make their races safe (one plan, one request per attempt).

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use provledger_events::{AggregateId, AggregateKind, EventLog};
use provledger_projections::operation::{OperationState, OperationStatus};
use provledger_projections::{DeletionState, Entity};
use tokio::sync::watch;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::projector::Touched;
use crate::store::ProjectionStore;
use provledger_client::{deletion, CancelNotices, Ledger, RollbackDriver, Stamper, Writer};

/// How often open rollbacks and deletions are looked at without a new commit (backoff
/// timers and lost replies come due without any commit).
const SWEEP_INTERVAL: Duration = Duration::from_millis(500);
/// Rollbacks driven at once by one replica.
const DRIVES_IN_FLIGHT_MAX: usize = 256;
/// Commits read from the copy per wake-up; the rest waits for the next one.
const COMMITS_PER_WAKE_MAX: u64 = 10_000;
const ACTOR: &str = "provledger-serve";

/// Whether serve has work on this operation: it stopped and is not closed, or a
/// cancellation waits for an operation runner that may have died.
pub(crate) fn needs_driving(op: &OperationState) -> bool {
    !op.is_closed()
        && (matches!(
            op.status,
            Some(OperationStatus::Failed)
                | Some(OperationStatus::Cancelled)
                | Some(OperationStatus::RollingBack)
        ) || op.cancellation_pending())
}

/// Keeps a changed aggregate in view: an operation may need driving, a cluster or
/// instance may be being deleted (each is checked against the store before acting).
fn note_changed(
    aggregate: AggregateId,
    open: &mut BTreeSet<Uuid>,
    deleting: &mut BTreeSet<AggregateId>,
) {
    match aggregate.kind {
        AggregateKind::Operation => {
            open.insert(aggregate.id);
        }
        AggregateKind::Cluster | AggregateKind::Instance => {
            deleting.insert(aggregate);
        }
        AggregateKind::Provider => {}
    }
}

fn is_deleting(entity: &Entity) -> bool {
    entity.deletion_state() == Some(DeletionState::Deleting)
}

pub(crate) struct RollbackWorker {
    pub(crate) store: ProjectionStore,
    pub(crate) ledger: Writer<Ledger>,
    pub(crate) driver: Arc<RollbackDriver>,
    pub(crate) notices: CancelNotices,
    pub(crate) applied: watch::Receiver<u64>,
    pub(crate) touched: Arc<Touched>,
    pub(crate) stamper: Stamper,
}

impl RollbackWorker {
    pub(crate) async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut open: BTreeSet<Uuid> = BTreeSet::new();
        let mut deleting: BTreeSet<AggregateId> = BTreeSet::new();
        let mut seen = *self.applied.borrow();
        let mut scan_through = 0;
        self.initial_scan(&mut open, &mut deleting);
        tracing::info!(
            open_rollbacks = open.len(),
            deleting = deleting.len(),
            "rollback worker started"
        );
        let mut driving: HashSet<Uuid> = HashSet::new();
        let mut tasks: JoinSet<Uuid> = JoinSet::new();
        loop {
            tokio::select! {
                _ = self.applied.changed() => {}
                _ = tokio::time::sleep(SWEEP_INTERVAL) => {}
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Ok(op) = done {
                        driving.remove(&op);
                    }
                }
                _ = shutdown.changed() => break,
            }
            if *shutdown.borrow() {
                break;
            }
            // What the projector saw change, and how far the copy must be read back
            // for what did not fit in that set (positions up to `seen` were covered by
            // the initial scan or an earlier wake).
            // `now` first: everything applied up to it was recorded in `touched` before it
            // was announced, so the set taken next covers it (or marks it to read back).
            let now = *self.applied.borrow();
            let (changed, incomplete_through) = self.touched.take();
            for aggregate in changed {
                note_changed(aggregate, &mut open, &mut deleting);
            }
            scan_through = scan_through.max(incomplete_through);
            let to = now.min(scan_through).min(seen + COMMITS_PER_WAKE_MAX);
            if to > seen {
                for aggregate in self.aggregates_between(seen + 1, to).await {
                    note_changed(aggregate, &mut open, &mut deleting);
                }
                seen = to;
            }
            if scan_through <= seen {
                seen = seen.max(now);
            }
            self.refresh_open(&mut open);
            for op in open.iter().copied() {
                if driving.len() >= DRIVES_IN_FLIGHT_MAX {
                    break;
                }
                if driving.insert(op) {
                    let driver = Arc::clone(&self.driver);
                    tasks.spawn(async move {
                        if let Err(e) = driver.drive(op).await {
                            tracing::warn!(operation = %op, error = %e, "rollback not finished; retried on the next sweep");
                        }
                        op
                    });
                }
            }
            self.advance_deletions(&mut deleting).await;
        }
        // Rollbacks in hand stop here; their state is in the log and the next start (of
        // this replica or another) resumes them.
        tasks.abort_all();
        tracing::info!("rollback worker stopped");
    }

    /// The aggregates of the commits from `from` to `to`: read back from the store's copy,
    /// or from the stream when the store keeps none (serve's). An entry that cannot be
    /// read is skipped with a warning: the projector quarantined it too.
    async fn aggregates_between(&self, from: u64, to: u64) -> Vec<AggregateId> {
        let mut out = Vec::new();
        if self.store.copies_log().unwrap_or(false) {
            for aggregate in self.store.commit_aggregates(from, to) {
                match aggregate {
                    Ok(aggregate) => out.push(aggregate),
                    Err(e) => tracing::warn!(error = %e, "unreadable commit in the copy"),
                }
            }
            return out;
        }
        let mut stream = match self.ledger.log().read_all(from).await {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, from, to, "cannot read the stream back");
                return out;
            }
        };
        while let Some(entry) = stream.next().await {
            match entry {
                Ok(commit) if commit.position > to => break,
                Ok(commit) => out.push(commit.aggregate),
                Err(e) if e.quarantine_parts().is_some_and(|(p, ..)| p > to) => break,
                Err(e) if e.quarantine_parts().is_some() => {}
                Err(e) => {
                    tracing::warn!(error = %e, from, to, "cannot read the stream back");
                    break;
                }
            }
        }
        out
    }

    fn initial_scan(&self, open: &mut BTreeSet<Uuid>, deleting: &mut BTreeSet<AggregateId>) {
        for entity in self
            .store
            .entities_of(AggregateKind::Operation, None)
            .flatten()
        {
            if let Entity::Operation(op) = &entity {
                if needs_driving(op) {
                    open.insert(op.header.id.id);
                }
            }
        }
        for kind in [AggregateKind::Cluster, AggregateKind::Instance] {
            for entity in self.store.entities_of(kind, None).flatten() {
                if is_deleting(&entity) {
                    deleting.insert(entity.id());
                }
            }
        }
    }

    /// Keeps only the operations that still need driving, as the projection sees them.
    fn refresh_open(&self, open: &mut BTreeSet<Uuid>) {
        open.retain(|id| {
            matches!(
                self.store.entity(&AggregateId::operation(*id)),
                Ok(Some(Entity::Operation(op))) if needs_driving(&op)
            )
        });
    }

    async fn advance_deletions(&self, deleting: &mut BTreeSet<AggregateId>) {
        let mut finished = Vec::new();
        for target in deleting.iter().copied() {
            let entity = match self.store.entity(&target) {
                Ok(Some(e)) => e,
                _ => {
                    finished.push(target);
                    continue;
                }
            };
            if !is_deleting(&entity) {
                finished.push(target);
                continue;
            }
            let in_flight = match &entity {
                Entity::Cluster(c) => c.in_flight.is_some(),
                Entity::Instance(i) => i.in_flight.is_some(),
                _ => false,
            };
            // The target's own delete operation is left to finish; anything else stops.
            if let Some(op) = deletion::cancellable_in_flight(&entity) {
                // Once the projection shows the notice, there is nothing to re-check in
                // the log on every sweep.
                let noticed = matches!(
                    self.store.entity(&AggregateId::operation(op)),
                    Ok(Some(Entity::Operation(o))) if o.target_deleted || o.is_closed()
                );
                if noticed {
                    continue;
                }
                let reason = format!("{target} is being deleted");
                if let Err(e) = deletion::notice_target_deletion(
                    &self.ledger,
                    &self.notices,
                    op,
                    &reason,
                    ACTOR,
                    &self.stamper,
                )
                .await
                {
                    tracing::warn!(%target, error = %e, "cannot notice the deletion");
                }
                continue;
            }
            if in_flight {
                continue;
            }
            match deletion::complete_deletion(&self.ledger, target, ACTOR, &self.stamper).await {
                Ok(true) => {
                    tracing::info!(%target, "deleted: nothing of it remains");
                    finished.push(target);
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(%target, error = %e, "cannot complete the deletion"),
            }
        }
        for t in finished {
            deleting.remove(&t);
        }
    }
}
