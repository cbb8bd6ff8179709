//! The stuck-state recovery sweep: the pure rules of `provledger_projections::recovery`
//! applied to every instance of the log. Each recovery is written as one atomic set of
//! facts (`provledger_projections::facts::recovery_facts`): the recovery on the instance at
//! its exact version, the build's claim released, an interrupted migration's allocations
//! moved back to the source and its operation failed, so a crash never leaves half of it.
//! A task to do again is recorded in the same commit as a pending re-issue
//! (`reissue_requested`).
//!
//! Re-issues are delivered, not just sent ([`deliver_reissues`]): each pending one is sent
//! to its worker, attempt by attempt (each attempt decided at the instance's exact version,
//! so racing replicas send it once), retried with backoff until the worker acknowledges
//! (`reissue_delivered`), concurrently across workers and at most
//! [`REISSUES_IN_FLIGHT_PER_WORKER`] at once per worker, so a worker that never answers
//! delays only its own. A worker that (re)connects receives its pending re-issues within
//! the backoff's bound, at once if it says so (`cmd.worker.ready`). `audit` reports a
//! re-issue still pending past `REISSUE_UNDELIVERED_AFTER_MS`.
//!
//! Racing sweeps (two `serve` replicas) derive the same commit id from the same version
//! and write the same payload (actor `provledger-recovery`), so each recovery is recorded
//! once.
//!
//! The instances come from a [`StateView`] (serve's projection store: the sweep costs the
//! instances, never the log's length). A recovery decided from a view that lags the log
//! is still safe: it is recorded at the version the view saw, so if the instance moved on
//! the write path refuses it (`raced`) and the next sweep decides again.
//!
//! Workers answer `<prefix>.worker.<worker_id>.reissue` requests (`ReissueRequest`, reply
//! `{"ok": true}` or `{"ok": false, "error": "..."}`) and must be idempotent by
//! `request_id`.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt;
use provledger_events::{AggregateId, AggregateKind, AppendStatus, Event, EventLog, Expectation};
use provledger_projections::decide::DecideOptions;
use provledger_projections::facts::recovery_facts;
use provledger_projections::operation::OperationState;
use provledger_projections::provider::ProviderState;
use provledger_projections::recovery::{
    fail_silent_runner, recover, reissue_due, Reissue, ReissuePolicy, REISSUE_ATTEMPTS_MAX,
};
use provledger_projections::Entity;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::clock::Stamper;
use crate::executors::{request_ok, PeerError};
use crate::ledger::derived_commit_id;
use crate::placement::PlacementError;
use crate::view::{entities, StateView};
use crate::write::{Fact, FromTheLog, RecordError, Writer};

/// The actor every sweep records with: racing replicas then write identical payloads.
pub const RECOVERY_ACTOR: &str = "provledger-recovery";

/// What a worker is asked to do again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ReissueRequest {
    /// Idempotency key: the same recovery always carries the same id.
    pub request_id: Uuid,
    pub instance_id: Uuid,
    pub action: Reissue,
    pub reason: String,
    /// Which attempt this is (1 for the first); a worker needs nothing but `request_id`.
    #[serde(default)]
    pub attempt: u32,
    /// Continues the instance's trace (the latest trace context its commits recorded,
    /// such as the worker's `task_started`); sent as the `traceparent` header, not in the
    /// body.
    #[serde(skip)]
    pub trace: Option<crate::executors::RequestTrace>,
}

pub type ReissueFuture<'a> = Pin<Box<dyn Future<Output = Result<(), PeerError>> + Send + 'a>>;

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
            let trace = request.trace.map(|t| t.sent);
            request_ok(&self.client, subject, request, trace, self.reply_wait).await
        })
    }
}

/// No worker reachable (embedded, no NATS): every re-issue fails with what to do.
pub struct NoWorkers;

impl Reissuer for NoWorkers {
    fn reissue<'a>(&'a self, worker: &'a str, _request: &'a ReissueRequest) -> ReissueFuture<'a> {
        Box::pin(async move {
            Err(PeerError::Unreachable(format!(
                "worker {worker:?} is not reachable: run the sweep with --nats where it listens"
            )))
        })
    }
}

/// One instance's recovery, as the sweep reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct Recovered {
    pub instance: Uuid,
    pub rule: String,
    pub reason: String,
    pub reissue: Option<Reissue>,
    /// "recorded", "already_recorded" (another sweep did), "raced" (the instance changed;
    /// the next sweep decides again), "would_record" (dry run), or "failed: ...".
    #[schemars(with = "String")]
    pub outcome: RecoveryOutcome,
}

/// What a sweep did with one recovery. Shown (and serialized) as the words of
/// [`Recovered::outcome`]: the JSON form is a string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryOutcome {
    /// A dry run: nothing written.
    WouldRecord,
    Recorded,
    /// Another sweep (a replica, `recover`) recorded it first.
    AlreadyRecorded,
    /// The instance changed since the view: nothing written, decided again next time.
    Raced,
    /// Not recorded, and why (the log unavailable, the view unreadable).
    Failed(String),
}

impl std::fmt::Display for RecoveryOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecoveryOutcome::WouldRecord => f.write_str("would_record"),
            RecoveryOutcome::Recorded => f.write_str("recorded"),
            RecoveryOutcome::AlreadyRecorded => f.write_str("already_recorded"),
            RecoveryOutcome::Raced => f.write_str("raced"),
            RecoveryOutcome::Failed(why) => write!(f, "failed: {why}"),
        }
    }
}

impl Serialize for RecoveryOutcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct SweepReport {
    pub examined: usize,
    pub recoveries: Vec<Recovered>,
}

impl SweepReport {
    /// How many recoveries this sweep wrote.
    pub fn written(&self) -> usize {
        self.recoveries
            .iter()
            .filter(|r| r.outcome == RecoveryOutcome::Recorded)
            .count()
    }
}

/// What one recovery round did: the sweep over every instance, and the provider deletes a
/// crash left half done, finished (none in a dry run). Each part answers on its own: a
/// sweep that failed does not keep the deletes from being finished.
#[derive(Debug)]
pub struct RecoveryRound {
    pub sweep: Result<SweepReport, PlacementError>,
    pub provider_deletes_finished: Result<Vec<Uuid>, PlacementError>,
}

/// One recovery round, the one serve runs on start and every `--recovery-interval` and
/// `provledger recover` runs once: [`sweep`], then
/// [`crate::placement::finish_provider_deletes`]. Re-issues are delivered apart
/// ([`deliver_reissues`], [`deliver_to_worker`]): serve keeps delivering between rounds.
pub async fn recovery_round<L: EventLog, V: StateView>(
    writer: &Writer<L>,
    view: &V,
    dry_run: bool,
    stamper: &Stamper,
) -> RecoveryRound {
    let sweep = sweep(writer, view, dry_run, stamper).await;
    let provider_deletes_finished = match dry_run {
        true => Ok(Vec::new()),
        false => {
            crate::placement::finish_provider_deletes(writer, view, RECOVERY_ACTOR, stamper).await
        }
    };
    RecoveryRound {
        sweep,
        provider_deletes_finished,
    }
}

/// One sweep over every instance of `view`. `dry_run` writes nothing. Re-issues are
/// recorded as pending; [`deliver_reissues`] sends them.
pub async fn sweep<L: EventLog, V: StateView>(
    writer: &Writer<L>,
    view: &V,
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
            outcome: RecoveryOutcome::WouldRecord,
        };
        if dry_run {
            report.recoveries.push(entry);
            continue;
        }
        let facts = match recovery_writes(view, instance, &decision, stamper).await {
            Ok(facts) => facts,
            Err(e) => {
                entry.outcome =
                    RecoveryOutcome::Failed(format!("reading what the recovery moves: {e}"));
                report.recoveries.push(entry);
                continue;
            }
        };
        entry.outcome = match writer
            .record_atomic(facts, DecideOptions::default(), &FromTheLog)
            .await
        {
            Ok(recorded)
                if recorded.iter().all(|r| {
                    r.appended()
                        .is_some_and(|o| o.status == AppendStatus::AlreadyAppended)
                }) =>
            {
                RecoveryOutcome::AlreadyRecorded
            }
            Ok(_) => RecoveryOutcome::Recorded,
            // The instance moved on, or what the view showed is no longer so in the log
            // (a claim released meanwhile): nothing was written; the next sweep decides
            // again on fresher state.
            Err(RecordError::Conflict { .. })
            | Err(RecordError::Conflicts { .. })
            | Err(RecordError::Rejections { .. })
            | Err(RecordError::Rejected(_)) => RecoveryOutcome::Raced,
            Err(e) => RecoveryOutcome::Failed(e.to_string()),
        };
        report.recoveries.push(entry);
    }
    Ok(report)
}

/// One running operation whose runner lease lapsed, as the sweep reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct SilentRunnerFailed {
    pub operation: Uuid,
    /// The version the failure was decided on (and recorded at, exactly).
    pub version: u64,
    pub reason: String,
    /// As [`Recovered::outcome`]: "recorded", "already_recorded", "raced" (the runner
    /// wrote meanwhile: it is alive, nothing was written), "would_record", "failed: ...".
    #[schemars(with = "String")]
    pub outcome: RecoveryOutcome,
}

/// Fails each of `operations` whose runner lease lapsed at the stamper's time
/// (`provledger_projections::recovery::fail_silent_runner`, `runner_lease_ms`): its
/// `operation_failed` is recorded at the operation's exact version, with a commit id
/// derived from that version (racing replicas write it once), so a runner that renewed in
/// between wins and nothing is written (`raced`). The rollback is then the rollback
/// worker's, as for any failed operation. `operations` come from a view (serve's store,
/// the running ones): the decision is made on what it shows, the write on the log's head.
pub async fn fail_silent_runners<L: EventLog>(
    writer: &Writer<L>,
    operations: impl IntoIterator<Item = OperationState>,
    runner_lease_ms: i64,
    dry_run: bool,
    stamper: &Stamper,
) -> Vec<SilentRunnerFailed> {
    let now = stamper.now();
    let mut report = Vec::new();
    for op in operations {
        let Some(silent) = fail_silent_runner(&op, now, runner_lease_ms) else {
            continue;
        };
        let mut entry = SilentRunnerFailed {
            operation: silent.operation,
            version: silent.version,
            reason: silent.reason.clone(),
            outcome: RecoveryOutcome::WouldRecord,
        };
        if !dry_run {
            let aggregate = AggregateId::operation(silent.operation);
            let mut draft = stamper
                .draft(RECOVERY_ACTOR, silent.events)
                .with_operation(silent.operation);
            draft.commit_id = derived_commit_id(
                silent.operation,
                &format!("runner-silent@{}", silent.version),
            );
            entry.outcome = match writer
                .record(aggregate, Expectation::Exactly(silent.version), draft)
                .await
            {
                Ok(r)
                    if r.appended()
                        .is_some_and(|o| o.status == AppendStatus::AlreadyAppended) =>
                {
                    RecoveryOutcome::AlreadyRecorded
                }
                Ok(_) => RecoveryOutcome::Recorded,
                // The runner (or a canceller) wrote meanwhile: nothing was written.
                Err(RecordError::Conflict { .. })
                | Err(RecordError::Conflicts { .. })
                | Err(RecordError::Rejections { .. })
                | Err(RecordError::Rejected(_)) => RecoveryOutcome::Raced,
                Err(e) => RecoveryOutcome::Failed(e.to_string()),
            };
        }
        report.push(entry);
    }
    report
}

/// Re-issues sent to one worker at once: a worker that never answers holds only its own
/// re-issues, each for at most the reply wait, and never another worker's.
pub const REISSUES_IN_FLIGHT_PER_WORKER: usize = 4;

/// What one delivery round did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct DeliveryReport {
    /// Re-issues pending when the round started.
    pub pending: usize,
    /// Attempts this round sent.
    pub sent: usize,
    pub delivered: usize,
    pub failed: usize,
    /// Attempts another replica took (or that the instance no longer needs: its task
    /// moved on meanwhile); this round sent nothing for them.
    pub raced: usize,
}

/// What `provledger recover --json` prints: the sweep, what the delivery round did, what
/// is still pending and the provider deletes finished. A type so that its JSON Schema
/// (`docs/schemas/cli.recover.json`) is derived from what is printed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct RecoverReport {
    #[serde(flatten)]
    pub sweep: SweepReport,
    pub dry_run: bool,
    /// Recoveries this run wrote.
    pub written: usize,
    /// The delivery round (over `--nats` only; null embedded or in a dry run).
    pub delivery: Option<DeliveryReport>,
    /// Re-issues still pending once the command is done.
    pub pending_reissues: Vec<PendingReissueLine>,
    /// Providers whose delete, left half done by a crash, this run finished.
    pub provider_deletes_finished: Vec<Uuid>,
}

/// One re-issue still pending, as `recover` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct PendingReissueLine {
    pub instance: Uuid,
    pub request_id: Uuid,
    pub worker: String,
    pub action: Reissue,
    pub attempts: u32,
    pub last_error: Option<String>,
}

/// One pending re-issue whose next attempt is due.
pub struct Due {
    instance: AggregateId,
    request: ReissueRequest,
    worker: String,
}

/// The pending re-issues of `view` whose next attempt is due at the stamper's time
/// (`provledger_projections::recovery::reissue_due`; `ready`: workers that just said they
/// listen, whose backoff is skipped), by worker, and how many are still retried on their
/// own (not given up after `REISSUE_ATTEMPTS_MAX`). One attempt per instance and round.
pub async fn due_reissues<V: StateView>(
    view: &V,
    policy: &ReissuePolicy,
    ready: &BTreeMap<String, provledger_events::Timestamp>,
    stamper: &Stamper,
) -> Result<(BTreeMap<String, Vec<Due>>, usize), PlacementError> {
    let now = stamper.now();
    let mut pending_count = 0;
    let mut by_worker: BTreeMap<String, Vec<Due>> = BTreeMap::new();
    for instance in view.instances().await? {
        let mut taken = false;
        for pending in &instance.pending_reissues {
            // Counted while retried on its own: the caller looks again soon only then.
            if pending.attempts < REISSUE_ATTEMPTS_MAX {
                pending_count += 1;
            }
            if taken {
                continue;
            }
            let ready_at = ready.get(&pending.worker).copied();
            let Some(attempt) = reissue_due(pending, now, policy, ready_at) else {
                continue;
            };
            taken = true;
            by_worker
                .entry(pending.worker.clone())
                .or_default()
                .push(Due {
                    instance: instance.header.id,
                    worker: pending.worker.clone(),
                    request: ReissueRequest {
                        request_id: pending.request_id,
                        instance_id: instance.header.id.id,
                        action: pending.action,
                        reason: pending.reason.clone(),
                        attempt,
                        trace: instance
                            .header
                            .trace
                            .map(crate::executors::RequestTrace::continuing),
                    },
                });
        }
    }
    Ok((by_worker, pending_count))
}

/// Sends one worker's due re-issues, at most [`REISSUES_IN_FLIGHT_PER_WORKER`] at once:
/// each attempt recorded before it is sent, its outcome after.
pub async fn deliver_to_worker<L: EventLog>(
    writer: &Writer<L>,
    reissuer: &dyn Reissuer,
    dues: Vec<Due>,
    stamper: &Stamper,
) -> DeliveryReport {
    let outcomes: Vec<Attempt> = futures::stream::iter(dues)
        .map(|due| deliver_one(writer, reissuer, due, stamper))
        .buffer_unordered(REISSUES_IN_FLIGHT_PER_WORKER)
        .collect()
        .await;
    let mut report = DeliveryReport::default();
    for outcome in outcomes {
        match outcome {
            Attempt::Raced => report.raced += 1,
            Attempt::Delivered => {
                report.sent += 1;
                report.delivered += 1;
            }
            Attempt::Failed => {
                report.sent += 1;
                report.failed += 1;
            }
        }
    }
    report
}

/// One delivery round, every worker at once, returning when each due attempt has its
/// outcome (the CLI's round; serve runs each worker's on its own task, so that a worker
/// that never answers holds no other's, nor the next round).
pub async fn deliver_reissues<L: EventLog, V: StateView>(
    writer: &Writer<L>,
    view: &V,
    reissuer: &dyn Reissuer,
    policy: &ReissuePolicy,
    ready: &BTreeMap<String, provledger_events::Timestamp>,
    stamper: &Stamper,
) -> Result<DeliveryReport, PlacementError> {
    let (by_worker, pending) = due_reissues(view, policy, ready, stamper).await?;
    let reports = futures::future::join_all(
        by_worker
            .into_values()
            .map(|dues| deliver_to_worker(writer, reissuer, dues, stamper)),
    )
    .await;
    let mut report = DeliveryReport {
        pending,
        ..Default::default()
    };
    for r in reports {
        report.sent += r.sent;
        report.delivered += r.delivered;
        report.failed += r.failed;
        report.raced += r.raced;
    }
    Ok(report)
}

enum Attempt {
    Raced,
    Delivered,
    Failed,
}

/// Records the attempt at the instance's version, sends it, records its outcome.
async fn deliver_one<L: EventLog>(
    writer: &Writer<L>,
    reissuer: &dyn Reissuer,
    due: Due,
    stamper: &Stamper,
) -> Attempt {
    let request_id = due.request.request_id;
    let attempt = due.request.attempt;
    let mut draft = stamper.draft(
        RECOVERY_ACTOR,
        vec![Event::reissue_attempted(request_id, attempt)],
    );
    draft.commit_id = derived_commit_id(request_id, &format!("attempt/{attempt}"));
    // Decided on the instance's current state, not at the version the view showed: the
    // fold applies an attempt only to a re-issue still pending, at exactly the next
    // attempt number, so an unrelated commit on the instance meanwhile (the rollback
    // worker clearing an operation) no longer races it away; a replica that took this
    // attempt first holds its derived commit id, and this one then sends nothing.
    let fact = Fact {
        aggregate: due.instance,
        expect: Expectation::Any,
        draft,
    };
    match writer
        .record_atomic(vec![fact], DecideOptions::default(), &FromTheLog)
        .await
    {
        // Only the writer whose append took the attempt sends it; a replica that finds it
        // already appended (same derived id) leaves it to that one.
        Ok(recorded)
            if recorded.iter().all(|r| {
                r.appended()
                    .is_some_and(|o| o.status == AppendStatus::Appended)
            }) => {}
        Ok(_) | Err(_) => return Attempt::Raced,
    }
    let outcome = reissuer.reissue(&due.worker, &due.request).await;
    let (event, what, attempt_outcome) = match outcome {
        Ok(()) => (
            Event::reissue_delivered(request_id),
            "delivered".to_string(),
            Attempt::Delivered,
        ),
        Err(error) => {
            tracing::warn!(instance = %due.instance, worker = %due.worker, %request_id, attempt, %error, "re-issue not delivered; retried after the backoff");
            (
                Event::reissue_failed(request_id, attempt, error.to_string()),
                format!("failed/{attempt}"),
                Attempt::Failed,
            )
        }
    };
    let mut draft = stamper.draft(RECOVERY_ACTOR, vec![event]);
    draft.commit_id = derived_commit_id(request_id, &what);
    if let Err(e) = writer.record_fact(due.instance, draft).await {
        // The instance was deleted meanwhile (nothing is pending on it any more), or the
        // log is unavailable: an attempt without an outcome is sent again after the reply
        // wait, and the worker is idempotent by request id.
        tracing::info!(instance = %due.instance, %request_id, error = %e, "the re-issue's outcome was not recorded");
    }
    attempt_outcome
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
            Some(Entity::Provider(p)) => vec![*p],
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
