//! The stuck-state recovery sweep: the pure rules of `provledger_projections::recovery`
//! applied to every instance of the log, each recovery recorded at the instance's exact
//! version under a commit id derived from that version, then its action carried out: the
//! build's claim released, the task re-issued to the worker that owns the instance.
//!
//! Racing sweeps (two `serve` replicas) derive the same commit id from the same version
//! and write the same payload (actor `provledger-recovery`), so each recovery is recorded
//! once and only the sweep that recorded it re-issues. A re-issued delete that cannot be
//! delivered puts the instance in error: a delete is never dropped.
//!
//! The instances come from a [`StateView`] (serve's projection store: the sweep costs the
//! instances, never the log's length). A recovery decided from a view that lags the log
//! is still safe: it is recorded at the version the view saw, so if the instance moved on
//! the write path refuses it (`raced`) and the next sweep decides again.
//!
//! Workers answer `<prefix>.worker.<worker_id>.reissue` requests (`ReissueRequest`, reply
//! `{"ok": true}` or `{"ok": false, "error": "..."}`) and must be idempotent by
//! `request_id`.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use provledger_events::catalogue::VmState;
use provledger_events::{AggregateId, AppendStatus, Event, EventLog, Expectation};
use provledger_projections::recovery::{recover, Reissue};
use provledger_projections::Entity;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::clock::Stamper;
use crate::executors::request_ok;
use crate::ledger::derived_commit_id;
use crate::placement::PlacementError;
use crate::view::{entities, StateView};
use crate::write::{record, record_fact, RecordError, Recorded};

/// The actor every sweep records with: racing replicas then write identical payloads.
pub const RECOVERY_ACTOR: &str = "provledger-recovery";

/// What a worker is asked to do again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReissueRequest {
    /// Idempotency key: the same recovery always carries the same id.
    pub request_id: Uuid,
    pub instance_id: Uuid,
    pub action: Reissue,
    pub reason: String,
}

pub type ReissueFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;

/// Delivers re-issued tasks to the worker that owns the instance.
pub trait Reissuer: Send + Sync {
    fn reissue<'a>(&'a self, worker: &'a str, request: &'a ReissueRequest) -> ReissueFuture<'a>;
}

/// Over NATS: a request on `<prefix>.worker.<worker>.reissue`.
pub struct NatsReissuer {
    pub client: async_nats::Client,
    pub subject_prefix: String,
    pub reply_wait: Duration,
}

impl NatsReissuer {
    pub fn subject(subject_prefix: &str, worker: &str) -> String {
        format!("{subject_prefix}.worker.{worker}.reissue")
    }
}

impl Reissuer for NatsReissuer {
    fn reissue<'a>(&'a self, worker: &'a str, request: &'a ReissueRequest) -> ReissueFuture<'a> {
        Box::pin(async move {
            let subject = Self::subject(&self.subject_prefix, worker);
            request_ok(&self.client, subject, request, self.reply_wait).await
        })
    }
}

/// No worker reachable (embedded, no NATS): every re-issue fails with what to do.
pub struct NoWorkers;

impl Reissuer for NoWorkers {
    fn reissue<'a>(&'a self, worker: &'a str, _request: &'a ReissueRequest) -> ReissueFuture<'a> {
        Box::pin(async move {
            Err(format!(
                "worker {worker:?} is not reachable: run the sweep with --nats where it listens"
            ))
        })
    }
}

/// One instance's recovery, as the sweep reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Recovered {
    pub instance: Uuid,
    pub rule: String,
    pub reason: String,
    pub reissue: Option<Reissue>,
    /// "recorded", "already_recorded" (another sweep did), "raced" (the instance changed;
    /// the next sweep decides again), "would_record" (dry run), or "failed: ...".
    pub outcome: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    pub examined: usize,
    pub recoveries: Vec<Recovered>,
}

impl SweepReport {
    /// How many recoveries this sweep wrote.
    pub fn written(&self) -> usize {
        self.recoveries
            .iter()
            .filter(|r| r.outcome == "recorded")
            .count()
    }
}

/// One sweep over every instance of `view`. `dry_run` writes nothing and re-issues nothing.
pub async fn sweep<L: EventLog, V: StateView>(
    log: &L,
    view: &V,
    reissuer: &dyn Reissuer,
    dry_run: bool,
    stamper: &Stamper,
) -> Result<SweepReport, PlacementError> {
    let now = stamper.now();
    let instances = view.instances().await?;
    let mut report = SweepReport {
        examined: instances.len(),
        ..Default::default()
    };
    for instance in &instances {
        let Some(decision) = recover(instance, now) else {
            continue;
        };
        let id = instance.header.id;
        let version = instance.header.version;
        let mut entry = Recovered {
            instance: id.id,
            rule: decision.rule.to_string(),
            reason: decision.reason.clone(),
            reissue: decision.reissue,
            outcome: "would_record".into(),
        };
        if dry_run {
            report.recoveries.push(entry);
            continue;
        }
        let commit_id = derived_commit_id(id.id, &format!("recovery/{version}"));
        let mut draft = stamper.draft(RECOVERY_ACTOR, decision.events.clone());
        draft.commit_id = commit_id;
        entry.outcome = match record(log, id, Expectation::Exactly(version), draft).await {
            Ok(Recorded::Appended(o)) if o.status == AppendStatus::AlreadyAppended => {
                "already_recorded".into()
            }
            Ok(_) => {
                let mut outcome = "recorded".to_string();
                if let Some(provider) = decision.release_claim_on {
                    if let Err(e) =
                        release_build_claim(log, provider, id.id, &decision.reason, stamper).await
                    {
                        outcome = format!("failed: releasing the claim: {e}");
                    }
                }
                if matches!(
                    decision.reissue,
                    Some(Reissue::RevertResize | Reissue::AbortLiveMigration)
                ) {
                    if let Err(e) =
                        return_to_source(log, view, instance, &decision.reason, stamper).await
                    {
                        outcome = format!("failed: moving the allocations back: {e}");
                    }
                }
                let worker = instance.task_worker.as_deref().unwrap_or("unknown");
                if let Some(action) = decision.reissue {
                    let request = ReissueRequest {
                        request_id: commit_id,
                        instance_id: id.id,
                        action,
                        reason: decision.reason.clone(),
                    };
                    if let Err(e) = reissuer.reissue(worker, &request).await {
                        outcome = format!("failed: re-issuing {action:?}: {e}");
                        if action == Reissue::Delete {
                            // Never dropped: a delete that cannot be re-driven is an error.
                            put_in_error(
                                log,
                                id,
                                &format!("the delete could not be re-driven: {e}"),
                                stamper,
                            )
                            .await;
                        }
                    }
                }
                outcome
            }
            Err(RecordError::Conflict { .. }) => "raced".into(),
            Err(e) => format!("failed: {e}"),
        };
        report.recoveries.push(entry);
    }
    Ok(report)
}

/// A reverted resize or an aborted live migration: the instance's allocation goes back to
/// the source (the migration's source allocation becomes the instance's again, in one
/// commit, so the capacity it frees cannot be taken in between), the destination's is
/// released, the instance's host is the source again, and a migration operation still
/// running goes to error. Finding the migration walks the providers of `view` (only for
/// an interrupted resize or live migration).
async fn return_to_source<L: EventLog, V: StateView>(
    log: &L,
    view: &V,
    instance: &provledger_projections::instance::InstanceState,
    reason: &str,
    stamper: &Stamper,
) -> Result<(), ReturnError> {
    use provledger_projections::placement::{migration_consumers, migration_source};
    let id = instance.header.id.id;
    let providers = view.providers().await?;
    let operations = entities(view, migration_consumers(&providers)).await?;
    let Some((migration, source, resources)) =
        migration_source(&providers, |op| operations.get(op), id)
    else {
        return Ok(()); // nothing held for a migration: nothing to move back
    };
    let why = format!("recovery: back to the source: {reason}");
    let back = vec![
        Event::AllocationReleased {
            consumer: migration,
            reason: why.clone(),
        },
        Event::AllocationClaimed {
            consumer: id,
            consumer_kind: provledger_events::catalogue::ConsumerKind::Instance,
            resources,
        },
    ];
    let mut draft = stamper.draft(RECOVERY_ACTOR, back);
    draft.commit_id = derived_commit_id(migration, "recovery-back-to-source");
    record_fact(log, AggregateId::provider(source), draft).await?;
    if let Some(destination) = instance.provider_id.filter(|d| *d != source) {
        release_build_claim(log, destination, id, reason, stamper).await?;
    }
    let source_host = providers
        .iter()
        .find(|p| p.header.id.id == source)
        .map(|p| p.host.clone())
        .unwrap_or_default();
    let mut draft = stamper.draft(
        RECOVERY_ACTOR,
        vec![Event::HostAssigned {
            host: source_host,
            provider_id: source,
        }],
    );
    draft.commit_id = derived_commit_id(migration, "recovery-host-back");
    record_fact(log, AggregateId::instance(id), draft).await?;
    if let Some(Entity::Operation(op)) = operations.get(&AggregateId::operation(migration)) {
        if op.status == Some(provledger_projections::operation::OperationStatus::Running) {
            let failed = Event::OperationFailed {
                stage: op.current_stage.clone().unwrap_or_else(|| "migrate".into()),
                step: None,
                error: why,
            };
            let mut draft = stamper
                .draft(RECOVERY_ACTOR, vec![failed])
                .with_operation(migration);
            draft.commit_id = derived_commit_id(migration, "recovery-migration-error");
            record_fact(log, AggregateId::operation(migration), draft).await?;
        }
    }
    Ok(())
}

/// Why the allocations could not be moved back: the view could not be read, or a write
/// failed.
#[derive(Debug, thiserror::Error)]
enum ReturnError {
    #[error(transparent)]
    View(#[from] crate::view::ViewError),
    #[error(transparent)]
    Write(#[from] RecordError),
}

async fn release_build_claim<L: EventLog>(
    log: &L,
    provider: Uuid,
    instance: Uuid,
    reason: &str,
    stamper: &Stamper,
) -> Result<(), RecordError> {
    let event = Event::AllocationReleased {
        consumer: instance,
        reason: format!("recovery: {reason}"),
    };
    let mut draft = stamper.draft(RECOVERY_ACTOR, vec![event]);
    draft.commit_id = derived_commit_id(instance, &format!("recovery-release/{provider}"));
    match record_fact(log, AggregateId::provider(provider), draft).await {
        // No claim there (never made, or released already): nothing to release.
        Err(RecordError::Rejected(_)) => Ok(()),
        other => other.map(|_| ()),
    }
}

async fn put_in_error<L: EventLog>(log: &L, id: AggregateId, reason: &str, stamper: &Stamper) {
    let event = Event::VmStateChanged {
        vm_state: VmState::Error,
        reason: reason.to_string(),
    };
    let mut draft = stamper.draft(RECOVERY_ACTOR, vec![event]);
    draft.commit_id = derived_commit_id(id.id, &format!("recovery-error/{reason}"));
    if let Err(e) = record_fact(log, id, draft).await {
        tracing::error!(instance = %id, error = %e, "could not record that a re-driven delete failed");
    }
}
