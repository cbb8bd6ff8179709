//! The rollback driver: the effectful shell around the pure planner and decider. It reads
//! an operation from the log, asks `next_rollback_action` what to do, does it, records it,
//! and repeats until the operation is closed.
//!
//! Every write that decides something is appended with the operation's exact version
//! (`RollbackPlanned`, `CompensationRequested`, `RollbackFinished`), so when several
//! drivers race (serve replicas, a CLI `rollback run`, the runner itself) exactly one plan
//! is recorded and each attempt is requested by exactly one of them. Writes that confirm
//! a fact carry deterministic commit ids, so a retry is recognised as the same commit.

use std::sync::Arc;
use std::time::Duration;

use provledger_events::catalogue::{
    CompensationAction, DetailKey, Executor, OperationKind, PlannedCompensation, RollbackOutcome,
    RollbackPlan,
};
use provledger_events::{
    AggregateId, AggregateKind, CommitDraft, Event, EventLog, Expectation, Timestamp,
};
use provledger_projections::decide::DecideOptions;
use provledger_projections::facts::{resumed_target_marker, rollback_target_fact, vm_gone_facts};
use provledger_projections::operation::OperationState;
use provledger_projections::planner::{plan_rollback, PlanRefusal};
use provledger_projections::rollback::{
    attempt_outcome, next_rollback_action, RetryPolicy, RollbackAction,
};
use provledger_projections::Entity;
use uuid::Uuid;

use crate::allocation::{release_allocation, return_to_source};
use crate::clock::Stamper;
use crate::executors::{CompensationExecutor, CompensationRequest};
use crate::ledger::{derived_commit_id, Ledger};
use crate::write::{Fact, FromTheLog, RecordError, Writer};

/// Driver steps per `drive` call. Each step records something or waits at most
/// `RECHECK_MS_MAX`; a plan has at most a few thousand compensations with a bounded number
/// of attempts each, and the longest wait (the runner stop wait, 10 minutes by default) is
/// 1,200 rechecks, so this is never reached by a healthy rollback.
const DRIVE_STEPS_MAX: usize = 1_000_000;
/// Longest sleep inside `drive` before the operation is read again: another writer (the
/// runner recording its stop, another driver) may have moved it on meanwhile.
const RECHECK_MS_MAX: i64 = 500;
/// Attempts to record a terminated VM's facts when its instance or cluster keeps changing.
const VM_GONE_ATTEMPTS_MAX: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("operation {0} not found in the log")]
    NotFound(Uuid),
    #[error(transparent)]
    Plan(#[from] PlanRefusal),
    #[error("the event log failed: {0}")]
    Read(#[from] provledger_events::ReadError),
    #[error("operation {0}: gave up after {DRIVE_STEPS_MAX} driver steps")]
    StepsExhausted(Uuid),
    #[error(transparent)]
    Resolve(#[from] provledger_projections::rollback::ResolveRefusal),
    /// A write the write path refused or could not make, typed: a conflict, a rejection, a
    /// permissions refusal, the log unavailable (an operator's decision, or the driver's
    /// own record of an attempt).
    #[error(transparent)]
    Write(#[from] RecordError),
}

/// A started operation as folded from the log, or `NotFound`.
pub async fn read_operation<L: EventLog>(
    log: &Writer<L>,
    id: Uuid,
) -> Result<OperationState, DriveError> {
    match log.read_current(AggregateId::operation(id)).await? {
        Some(Entity::Operation(op)) if op.kind.is_some() => Ok(*op),
        _ => Err(DriveError::NotFound(id)),
    }
}

/// Resumes a rollback that ended `needs_attention` (an operator fixed what made its
/// compensations fail): `rollback_resumed`, decided at the operation's exact version, gives
/// every compensation not done a fresh budget of attempts; a driver then goes on from where
/// it stopped. `Ok(false)`: the operation does not need attention (nothing written).
pub async fn resume_needs_attention(
    ledger: &Writer<Ledger>,
    id: Uuid,
    reason: &str,
    actor: &str,
    stamper: &Stamper,
) -> Result<bool, DriveError> {
    let op = read_operation(ledger, id).await?;
    if op.status != Some(provledger_projections::operation::OperationStatus::NeedsAttention) {
        return Ok(false);
    }
    let events = vec![Event::rollback_resumed(reason)];
    record_at_version(ledger, &op, events, actor, stamper).await?;
    Ok(true)
}

/// An operator's decision about `op`, recorded at the version it was decided on: a
/// concurrent change makes it a conflict rather than a decision on stale state. A decision
/// that resumes the rollback (`rollback_resumed`) is recorded together with the operation's
/// in-flight marker on its target when `facts::resumed_target_marker` says to set it again
/// (the target free), both or neither, the target at the version that was read: the resumed
/// rollback holds its target as it did before it stopped, so its end reaches the target.
async fn record_at_version(
    ledger: &Writer<Ledger>,
    op: &OperationState,
    events: Vec<Event>,
    actor: &str,
    stamper: &Stamper,
) -> Result<(), DriveError> {
    let id = op.header.id.id;
    let draft = |events| stamper.draft(actor, events).with_operation(id);
    let resumes = events
        .iter()
        .any(|e| matches!(e, Event::RollbackResumed { .. }));
    let on_operation = Fact {
        aggregate: AggregateId::operation(id),
        expect: Expectation::Exactly(op.header.version),
        draft: draft(events),
    };
    let marker = match resumes {
        true => resumed_marker(ledger, op).await?,
        false => None,
    };
    match marker {
        Some((target, version, marker)) => {
            let on_target = Fact {
                aggregate: target,
                expect: Expectation::Exactly(version),
                draft: draft(vec![marker]),
            };
            let facts = vec![on_operation, on_target];
            ledger
                .record_atomic(facts, DecideOptions::default(), &FromTheLog)
                .await?;
        }
        None => {
            let Fact {
                aggregate,
                expect,
                draft,
            } = on_operation;
            ledger.record(aggregate, expect, draft).await?;
        }
    }
    Ok(())
}

/// The marker a resume of `op` sets on its target (`facts::resumed_target_marker`), with
/// the target and the version it was decided on; `None` for a target that is not a
/// cluster or an instance, or that is not free.
async fn resumed_marker(
    ledger: &Writer<Ledger>,
    op: &OperationState,
) -> Result<Option<(AggregateId, u64, Event)>, DriveError> {
    let Some(target) = op
        .target
        .filter(|t| matches!(t.kind, AggregateKind::Cluster | AggregateKind::Instance))
    else {
        return Ok(None);
    };
    let Some(entity) = ledger.read_current(target).await? else {
        return Ok(None);
    };
    Ok(resumed_target_marker(op, Some(&entity)).map(|m| (target, entity.header().version, m)))
}

/// An operator resolves a stuck compensation by hand (`rollback resolve`): decided by
/// [`provledger_projections::rollback::resolve`] and recorded at the operation's exact
/// version with the operator as actor. Returns the events recorded (with
/// `rollback_resumed` when it was the last compensation not done: a driver then finishes).
pub async fn resolve_compensation(
    ledger: &Writer<Ledger>,
    id: Uuid,
    compensation_id: Uuid,
    reason: &str,
    actor: &str,
    stamper: &Stamper,
) -> Result<Vec<Event>, DriveError> {
    let op = read_operation(ledger, id).await?;
    let events = provledger_projections::rollback::resolve(&op, compensation_id, reason)?;
    record_at_version(ledger, &op, events.clone(), actor, stamper).await?;
    Ok(events)
}

/// Records a `remove_leaked` operation (`drift --fix leaked`): the one commit of
/// [`provledger_projections::leak_removal::leak_removal_events`], on a new operation
/// aggregate, with the operator as actor. A [`RollbackDriver`] then carries the removals
/// out, as it does any rollback.
pub async fn record_leak_removal(
    ledger: &Writer<Ledger>,
    operation: Uuid,
    events: Vec<Event>,
    actor: &str,
    stamper: &Stamper,
) -> Result<(), DriveError> {
    let draft = stamper.draft(actor, events).with_operation(operation);
    ledger
        .record(
            AggregateId::operation(operation),
            Expectation::NoStream,
            draft,
        )
        .await?;
    Ok(())
}

/// The plan the planner gives for `op` now, with a bundle's children read from the log.
pub async fn plan_for<L: EventLog>(
    log: &Writer<L>,
    op: &OperationState,
) -> Result<RollbackPlan, DriveError> {
    let mut children = Vec::new();
    if op.kind == Some(OperationKind::Bundle) {
        for child in &op.children {
            children.push(read_operation(log, *child).await?);
        }
    }
    Ok(plan_rollback(op, &children)?)
}

/// What one driver step did.
#[derive(Debug)]
pub(crate) enum DriveStep {
    /// Nothing left to do: the operation is closed, running, or succeeded.
    Idle(Box<OperationState>),
    /// Something was recorded (by this driver or, on a conflict, by another one).
    Progressed,
    /// Nothing to do before this time.
    Wait(Timestamp),
}

pub struct RollbackDriver {
    ledger: Writer<Ledger>,
    executors: Arc<dyn CompensationExecutor>,
    policy: RetryPolicy,
    actor: String,
    stamper: Stamper,
}

impl RollbackDriver {
    pub fn new(
        ledger: Writer<Ledger>,
        executors: Arc<dyn CompensationExecutor>,
        policy: RetryPolicy,
        actor: &str,
    ) -> Self {
        RollbackDriver {
            ledger,
            executors,
            policy,
            actor: actor.to_string(),
            stamper: Stamper::system(),
        }
    }

    /// Reads "now" and mints commit ids from `stamper` instead of the wall clock.
    pub fn with_stamper(mut self, stamper: Stamper) -> Self {
        self.stamper = stamper;
        self
    }

    async fn operation(&self, id: Uuid) -> Result<OperationState, DriveError> {
        read_operation(&self.ledger, id).await
    }

    /// Drives the operation's rollback until it is closed (or, if it is not stopped,
    /// returns its state at once).
    pub async fn drive(&self, id: Uuid) -> Result<OperationState, DriveError> {
        for _ in 0..DRIVE_STEPS_MAX {
            match self.step(id).await? {
                DriveStep::Idle(op) => return Ok(*op),
                DriveStep::Progressed => {}
                DriveStep::Wait(until) => {
                    let ms =
                        (until.unix_ms() - self.stamper.now().unix_ms()).clamp(1, RECHECK_MS_MAX);
                    tokio::time::sleep(Duration::from_millis(ms as u64)).await;
                }
            }
        }
        Err(DriveError::StepsExhausted(id))
    }

    fn draft(&self, operation: Uuid, events: Vec<Event>) -> CommitDraft {
        self.stamper
            .draft(&self.actor, events)
            .with_operation(operation)
    }

    fn fact(&self, operation: Uuid, commit_id: Uuid, events: Vec<Event>) -> CommitDraft {
        let mut draft = self.draft(operation, events);
        draft.commit_id = commit_id;
        draft
    }

    /// Appends to the operation at `version`. `Ok(false)`: another writer got there first.
    async fn append_decision(
        &self,
        op: &OperationState,
        events: Vec<Event>,
    ) -> Result<bool, DriveError> {
        let id = op.header.id;
        match self
            .ledger
            .record(
                id,
                Expectation::Exactly(op.header.version),
                self.draft(id.id, events),
            )
            .await
        {
            Ok(_) => Ok(true),
            Err(RecordError::Conflict { .. }) => Ok(false),
            Err(e) => Err(DriveError::Write(e)),
        }
    }

    /// One decision and its effect.
    pub(crate) async fn step(&self, id: Uuid) -> Result<DriveStep, DriveError> {
        let op = self.operation(id).await?;
        let now = self.stamper.now();
        match next_rollback_action(&op, now, &self.policy) {
            RollbackAction::Nothing => Ok(DriveStep::Idle(Box::new(op))),
            RollbackAction::CancelForSilentRunner(cancelled) => {
                self.append_decision(&op, vec![*cancelled]).await?;
                Ok(DriveStep::Progressed)
            }
            RollbackAction::Plan => {
                let plan = plan_for(&self.ledger, &op).await?;
                if self
                    .append_decision(&op, vec![Event::rollback_planned(plan.clone())])
                    .await?
                {
                    tracing::info!(operation = %id, rule = %plan.rule, compensations = plan.compensations.len(), "rollback planned");
                }
                Ok(DriveStep::Progressed)
            }
            RollbackAction::Request {
                compensation,
                attempt,
            } => {
                let requested =
                    Event::compensation_requested(compensation.compensation_id, attempt);
                if !self.append_decision(&op, vec![requested]).await? {
                    return Ok(DriveStep::Progressed); // another driver took this attempt
                }
                let outcome = self.execute(&op, &compensation, attempt).await;
                let c = compensation.compensation_id;
                if let Err(error) = &outcome {
                    tracing::warn!(operation = %id, compensation = %c, attempt, %error, "compensation failed");
                }
                let (what, event) = attempt_outcome(c, attempt, outcome.err());
                let draft = self.fact(id, derived_commit_id(c, &what), vec![event]);
                self.ledger.record_fact(op.header.id, draft).await?;
                Ok(DriveStep::Progressed)
            }
            RollbackAction::WaitUntil(until) => Ok(DriveStep::Wait(until)),
            RollbackAction::Finish { outcome, remaining } => {
                self.apply_target_outcome(&op, outcome).await?;
                let finished = Event::rollback_finished(outcome, remaining.clone());
                if self.append_decision(&op, vec![finished]).await? {
                    tracing::info!(operation = %id, ?outcome, remaining = remaining.len(), "rollback finished");
                }
                Ok(DriveStep::Progressed)
            }
        }
    }

    async fn execute(
        &self,
        op: &OperationState,
        c: &PlannedCompensation,
        attempt: u32,
    ) -> Result<(), String> {
        match &c.compensation.executor {
            Executor::Ledger => self.ledger_compensation(op, c).await,
            Executor::Service(name) => {
                let request = CompensationRequest::new(op.header.id.id, c, attempt)
                    .with_trace(op.header.trace);
                self.executors.compensate(name, &request).await?;
                if c.compensation.action == CompensationAction::TerminateVm {
                    self.record_vm_gone(op, c)
                        .await
                        .map_err(|e| format!("VM terminated, but recording it failed: {e}"))?;
                }
                Ok(())
            }
        }
    }

    /// Ledger-internal compensations are applied as events.
    async fn ledger_compensation(
        &self,
        op: &OperationState,
        c: &PlannedCompensation,
    ) -> Result<(), String> {
        // Both ledger compensations name a provider in `args.provider_id` and a consumer
        // (the instance) as the resource.
        let word = provledger_projections::planner::action_word(&c.compensation.action);
        let provider = || -> Result<Uuid, String> {
            c.compensation
                .args
                .get(DetailKey::ProviderId.as_str())
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| format!("{word} needs a provider_id argument"))
        };
        let consumer = || -> Result<Uuid, String> {
            c.compensation
                .resource
                .parse()
                .map_err(|_| format!("consumer {:?} is not a UUID", c.compensation.resource))
        };
        let operation = op.header.id.id;
        let draft = |events| self.draft(operation, events);
        match c.compensation.action {
            CompensationAction::ReleaseAllocation => {
                let reason = format!(
                    "rollback of operation {operation} (compensation {})",
                    c.compensation_id
                );
                release_allocation(&self.ledger, provider()?, consumer()?, &reason, draft)
                    .await
                    .map_err(|e| e.to_string())
            }
            // The migration (its operation's id) is the consumer holding the source:
            // `args.migration_id`, or the operation being rolled back.
            CompensationAction::ReturnToSource => {
                let migration = match c.compensation.args.get(DetailKey::MigrationId.as_str()) {
                    Some(id) => id
                        .parse()
                        .map_err(|_| format!("migration_id {id:?} is not a UUID"))?,
                    None => operation,
                };
                let reason = format!(
                    "rollback of migration {migration}: back to the source (compensation {})",
                    c.compensation_id
                );
                return_to_source(
                    &self.ledger,
                    provider()?,
                    consumer()?,
                    migration,
                    &reason,
                    draft,
                )
                .await
                .map_err(|e| e.to_string())
            }
            ref other => Err(format!(
                "the ledger cannot carry out {other:?}; name the service that owns it"
            )),
        }
    }

    /// After the hypervisor confirmed a termination: the instance record closed and the
    /// instance out of its cluster, both in one atomic write (`facts::vm_gone_facts`
    /// decides them from the instance and its cluster as they are now).
    async fn record_vm_gone(
        &self,
        op: &OperationState,
        c: &PlannedCompensation,
    ) -> Result<(), String> {
        let Ok(instance_id) = c.compensation.resource.parse::<Uuid>() else {
            return Ok(());
        };
        let operation = op.header.id.id;
        for _ in 0..VM_GONE_ATTEMPTS_MAX {
            let Some(Entity::Instance(state)) = self
                .ledger
                .read_current(AggregateId::instance(instance_id))
                .await
                .map_err(|e| e.to_string())?
            else {
                return Ok(());
            };
            let cluster = match state.cluster_id {
                Some(id) => match self
                    .ledger
                    .read_current(AggregateId::cluster(id))
                    .await
                    .map_err(|e| e.to_string())?
                {
                    Some(Entity::Cluster(c)) => Some(c),
                    _ => None,
                },
                None => None,
            };
            let facts: Vec<Fact> = vm_gone_facts(op, &state, cluster.as_deref())
                .into_iter()
                .map(|f| Fact {
                    aggregate: f.aggregate,
                    expect: Expectation::Any,
                    draft: self.fact(
                        operation,
                        derived_commit_id(c.compensation_id, &f.name),
                        f.events,
                    ),
                })
                .collect();
            if facts.is_empty() {
                return Ok(());
            }
            match self
                .ledger
                .record_atomic(facts, DecideOptions::default(), &FromTheLog)
                .await
            {
                Ok(_) => return Ok(()),
                // The instance or its cluster moved on in between: decide again.
                Err(RecordError::Rejections { .. }) | Err(RecordError::Conflicts { .. }) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!(
            "instance {instance_id}: {VM_GONE_ATTEMPTS_MAX} attempts in a row met a change"
        ))
    }

    /// Moves the target where the plan says and clears the operation's in-flight marker
    /// (the fact is decided and named by `facts::rollback_target_fact`: each end of the
    /// rollback on its target is its own commit, a retry of one end the same commit).
    async fn apply_target_outcome(
        &self,
        op: &OperationState,
        outcome: RollbackOutcome,
    ) -> Result<(), DriveError> {
        let Some(plan) = &op.rollback_plan else {
            return Ok(());
        };
        let operation = op.header.id.id;
        let entity = self.ledger.read_current(plan.target).await?;
        let Some(fact) = rollback_target_fact(op, entity.as_ref(), outcome) else {
            return Ok(());
        };
        let draft = self.fact(
            operation,
            derived_commit_id(operation, &fact.name),
            fact.events,
        );
        self.ledger.record_fact(fact.aggregate, draft).await?;
        Ok(())
    }
}
