//! The stuck-state recovery sweep: the pure rules of `provledger_projections::recovery`
//! applied to every instance of the log. Each recovery is written as one atomic set of
//! facts (`provledger_projections::facts::recovery_facts`): the recovery on the instance at
//! its exact version, the build's claim released, an interrupted migration's allocations
//! moved back to the source and its operation failed, so a crash never leaves half of it.
//! Then the task is re-issued to the worker that owns the instance.
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
use provledger_events::{AggregateId, AggregateKind, AppendStatus, Event, EventLog, Expectation};
use provledger_projections::decide::DecideOptions;
use provledger_projections::facts::recovery_facts;
use provledger_projections::provider::ProviderState;
use provledger_projections::recovery::{recover, Reissue};
use provledger_projections::Entity;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::clock::Stamper;
use crate::executors::request_ok;
use crate::ledger::derived_commit_id;
use crate::placement::PlacementError;
use crate::view::{entities, StateView};
use crate::write::{record_atomic, record_fact, Fact, FromTheLog, RecordError};

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
        let facts = match recovery_writes(view, instance, &decision, stamper).await {
            Ok(facts) => facts,
            Err(e) => {
                entry.outcome = format!("failed: reading what the recovery moves: {e}");
                report.recoveries.push(entry);
                continue;
            }
        };
        // The id of the recovery's own commit on the instance: the re-issue's key.
        let request_id = facts[0].draft.commit_id;
        entry.outcome = match record_atomic(log, facts, DecideOptions::default(), &FromTheLog).await
        {
            Ok(recorded)
                if recorded.iter().all(|r| {
                    r.appended()
                        .is_some_and(|o| o.status == AppendStatus::AlreadyAppended)
                }) =>
            {
                "already_recorded".into()
            }
            Ok(_) => {
                let mut outcome = "recorded".to_string();
                let worker = instance.task_worker.as_deref().unwrap_or("unknown");
                if let Some(action) = decision.reissue {
                    let request = ReissueRequest {
                        request_id,
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
            // The instance moved on, or what the view showed is no longer so in the log
            // (a claim released meanwhile): nothing was written; the next sweep decides
            // again on fresher state.
            Err(RecordError::Conflict { .. })
            | Err(RecordError::Conflicts { .. })
            | Err(RecordError::Rejections { .. })
            | Err(RecordError::Rejected(_)) => "raced".into(),
            Err(e) => format!("failed: {e}"),
        };
        report.recoveries.push(entry);
    }
    Ok(report)
}

/// The writes of one recovery, all or nothing (`facts::recovery_facts` decides them): the
/// instance's at the version the view showed, the others wherever their aggregates are.
/// For a build, the provider it claimed on is read; for an interrupted migration, the
/// providers of `view` (to find where the instance and its migration hold allocations) and
/// the operations involved.
async fn recovery_writes<V: StateView>(
    view: &V,
    instance: &provledger_projections::instance::InstanceState,
    decision: &provledger_projections::recovery::Recovery,
    stamper: &Stamper,
) -> Result<Vec<Fact>, crate::view::ViewError> {
    use provledger_projections::placement::migration_consumers;
    let migrating = matches!(
        decision.reissue,
        Some(Reissue::RevertResize | Reissue::AbortLiveMigration)
    );
    let providers: Vec<ProviderState> = match (migrating, decision.release_claim_on) {
        (true, _) => view.providers().await?,
        (false, Some(provider)) => match view.entity(&AggregateId::provider(provider)).await? {
            Some(Entity::Provider(p)) => vec![p],
            _ => Vec::new(),
        },
        (false, None) => Vec::new(),
    };
    // Only a migration's revert looks operations up: its own and the instance's in flight.
    let operations = match migrating {
        true => {
            let mut wanted = migration_consumers(&providers);
            wanted.extend(
                instance
                    .in_flight
                    .as_ref()
                    .map(|f| AggregateId::operation(f.operation_id)),
            );
            entities(view, wanted).await?
        }
        false => Default::default(),
    };
    let id = instance.header.id;
    Ok(
        recovery_facts(decision, instance, &providers, |a| operations.get(a))
            .into_iter()
            .map(|fact| {
                let mut draft = stamper.draft(RECOVERY_ACTOR, fact.events);
                draft.commit_id = derived_commit_id(id.id, &fact.name);
                if fact.aggregate.kind == AggregateKind::Operation {
                    draft = draft.with_operation(fact.aggregate.id);
                }
                Fact {
                    aggregate: fact.aggregate,
                    expect: match fact.aggregate == id {
                        true => Expectation::Exactly(instance.header.version),
                        false => Expectation::Any,
                    },
                    draft,
                }
            })
            .collect(),
    )
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
