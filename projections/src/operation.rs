//! The operation projection: stages, steps with their effects and declared
//! compensations, status, error, and the progress of a recorded rollback plan.

use std::collections::BTreeMap;
use std::sync::Arc;

use provledger_events::catalogue::{
    BundlePolicy, Compensation, Effect, OperationKind, PlannedCompensation, RollbackOutcome,
    RollbackPlan, StagePolicy, StageSpec,
};
use provledger_events::{AggregateId, Event, Timestamp};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::entity::{json_or_null, not_created, EventContext, Folded, Header};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OperationStatus {
    Running,
    Succeeded,
    Failed,
    RollingBack,
    RolledBack,
    Held,
    Cancelled,
    NeedsAttention,
}

impl OperationStatus {
    /// Every status, for those who must name each one (serve's metrics keep a series per
    /// status from the start).
    pub const ALL: [OperationStatus; 8] = {
        use OperationStatus::*;
        // A new status fails to compile here until it is added to the list below.
        const fn listed(s: OperationStatus) {
            match s {
                Running | Succeeded | Failed | RollingBack | RolledBack | Held | Cancelled
                | NeedsAttention => {}
            }
        }
        let _ = listed;
        [
            Running,
            Succeeded,
            Failed,
            RollingBack,
            RolledBack,
            Held,
            Cancelled,
            NeedsAttention,
        ]
    };

    /// A status nothing moves on from. `cancelled` is left out: a cancelled operation is
    /// closed only once its rollback has finished (see [`OperationState::is_closed`]).
    pub fn is_final(self) -> bool {
        matches!(
            self,
            OperationStatus::Succeeded
                | OperationStatus::RolledBack
                | OperationStatus::Held
                | OperationStatus::NeedsAttention
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageProgress {
    Started,
    Completed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StepProgress {
    Done,
    CompensationPlanned,
    CompensationRequested,
    Compensated,
    CompensationFailed,
    Retained,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepState {
    pub stage: String,
    pub name: String,
    pub effect: Effect,
    pub compensation: Option<Compensation>,
    pub progress: StepProgress,
    pub compensation_id: Option<Uuid>,
}

/// A step whose action was asked for (`StepStarted`, intent before effect) and whose
/// outcome no `StepDone` has recorded: the executor may or may not have acted under its
/// idempotency key, so a rollback undoes by that key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StartedStep {
    pub stage: String,
    pub name: String,
    pub executor: String,
    pub idempotency_key: String,
    pub compensation: Option<Compensation>,
}

/// Where one planned compensation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CompensationProgress {
    Planned,
    Requested,
    Done,
    Failed,
}

/// One compensation of the recorded rollback plan and its attempts, in plan order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompensationState {
    pub planned: PlannedCompensation,
    pub progress: CompensationProgress,
    pub attempts: u32,
    pub last_error: Option<String>,
    /// When the latest attempt was requested. A request with no outcome after the reply
    /// wait is treated as lost (its requester died) and may be requested again.
    pub requested_at: Option<Timestamp>,
    /// When the latest attempt failed; the next one waits for the backoff from here.
    pub failed_at: Option<Timestamp>,
    /// `attempts` when the rollback was last resumed: the retry budget counts the
    /// attempts after it, while attempt numbers (and the ids derived from them) go on.
    pub attempts_at_resume: u32,
    /// Why an operator handled it by hand (`compensation_resolved`); who did is the
    /// actor of that commit (`audit` names it).
    pub resolved: Option<String>,
}

impl CompensationState {
    /// Attempts made since the rollback (last) started or resumed.
    pub fn attempts_in_budget(&self) -> u32 {
        self.attempts.saturating_sub(self.attempts_at_resume)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct OperationError {
    pub stage: String,
    pub step: Option<String>,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperationState {
    pub header: Header,
    pub kind: Option<OperationKind>,
    pub target: Option<AggregateId>,
    pub parent_id: Option<Uuid>,
    pub bundle_policy: Option<BundlePolicy>,
    pub stages: Vec<StageSpec>,
    pub stage_progress: BTreeMap<String, StageProgress>,
    pub current_stage: Option<String>,
    pub children: Vec<Uuid>,
    pub status: Option<OperationStatus>,
    /// Each step behind its own `Arc`, like each compensation below: an operation's state
    /// is copied on every decision about it (the decider's trial fold, a reader's copy),
    /// and sharing what did not change keeps that copy cheap however many steps it has.
    /// A fold that changes one step copies that step only (`Arc::make_mut`).
    pub steps: Vec<Arc<StepState>>,
    /// Steps started with an intent and no recorded outcome yet, in start order.
    pub started: Vec<Arc<StartedStep>>,
    /// Steps whose effect, with a compensation, was recorded after the rollback plan: the
    /// plan does not undo them (a runner presumed dead finished an action late). `audit`
    /// reports each.
    pub late_effects: Vec<String>,
    pub error: Option<OperationError>,
    pub cancellation_reason: Option<String>,
    /// The target is being deleted by a user (`TargetDeletionNoticed`): the rollback then
    /// removes data-holding nodes too.
    pub target_deleted: bool,
    /// `OperationCancelled` was recorded: after its rollback the operation closes as
    /// `cancelled` rather than `rolled_back`.
    pub cancelled: bool,
    pub rollback_plan: Option<Arc<RollbackPlan>>,
    /// The plan's compensations with their progress, in plan order.
    pub compensations: Vec<Arc<CompensationState>>,
    pub rollback_outcome: Option<RollbackOutcome>,
    pub remaining: Vec<Uuid>,
    /// The `recorded_at` of the commit that recorded `operation_failed`.
    pub failed_at: Option<Timestamp>,
    /// The `recorded_at` of the commit that closed the operation ([`Self::is_closed`]):
    /// `operation_succeeded` or `rollback_finished`; cleared when a rollback resumes.
    pub finished_at: Option<Timestamp>,
}

impl OperationState {
    pub fn new(id: AggregateId) -> Self {
        OperationState {
            header: Header::new(id),
            kind: None,
            target: None,
            parent_id: None,
            bundle_policy: None,
            stages: Vec::new(),
            stage_progress: BTreeMap::new(),
            current_stage: None,
            children: Vec::new(),
            status: None,
            steps: Vec::new(),
            started: Vec::new(),
            late_effects: Vec::new(),
            error: None,
            cancellation_reason: None,
            target_deleted: false,
            cancelled: false,
            rollback_plan: None,
            compensations: Vec::new(),
            rollback_outcome: None,
            remaining: Vec::new(),
            failed_at: None,
            finished_at: None,
        }
    }

    /// Nothing more will happen to this operation: it succeeded, or its rollback finished.
    pub fn is_closed(&self) -> bool {
        self.status.is_some_and(OperationStatus::is_final) || self.rollback_outcome.is_some()
    }

    /// The operation stopped (failed or cancelled) and no rollback plan is recorded yet:
    /// the planner's turn.
    pub fn awaits_rollback_plan(&self) -> bool {
        matches!(
            self.status,
            Some(OperationStatus::Failed) | Some(OperationStatus::Cancelled)
        ) && self.rollback_plan.is_none()
    }

    /// A cancellation (by a user or by the target's deletion) was asked for and the
    /// operation has not stopped yet.
    pub fn cancellation_pending(&self) -> bool {
        self.cancellation_reason.is_some() && self.status == Some(OperationStatus::Running)
    }

    /// The policy of a declared stage.
    pub fn stage_policy(&self, stage: &str) -> Option<StagePolicy> {
        self.stages
            .iter()
            .find(|s| s.name == stage)
            .map(|s| s.policy)
    }

    fn compensation_mut(&mut self, id: &Uuid) -> Option<&mut CompensationState> {
        self.compensations
            .iter_mut()
            .find(|c| c.planned.compensation_id == *id)
            .map(Arc::make_mut)
    }

    /// The refusal of an event about a compensation the recorded plan does not have.
    fn not_in_plan(id: &Uuid) -> Folded {
        Folded::Refused(format!(
            "compensation {id} is not in the recorded plan; not applied"
        ))
    }

    /// Mirrors a compensation's progress on the step it undoes, for the step list view.
    fn mark_step(&mut self, id: &Uuid, progress: StepProgress) {
        if let Some(step) = self
            .steps
            .iter_mut()
            .find(|s| s.compensation_id.as_ref() == Some(id))
        {
            Arc::make_mut(step).progress = progress;
        }
    }

    /// Whether the operation is in one of `allowed`.
    fn status_in(&self, allowed: &[OperationStatus]) -> bool {
        self.status.is_some_and(|s| allowed.contains(&s))
    }

    /// The refusal of `what` in a status that does not allow it (see [`Self::status_in`]).
    fn wrong_status(&self, what: &str) -> Folded {
        Folded::Refused(format!(
            "{what} while the operation is {:?}; not applied",
            self.status
        ))
    }

    /// Folds one event into this operation's state, and says whether it was applied.
    pub(crate) fn apply_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        if let Event::OperationStarted {
            kind,
            target,
            parent_id,
            stages,
            bundle_policy,
        } = event
        {
            if self.status.is_some() {
                return Folded::Refused("the operation already started; event not applied".into());
            }
            self.kind = Some(*kind);
            self.target = Some(*target);
            self.parent_id = *parent_id;
            self.stages = stages.clone();
            self.bundle_policy = *bundle_policy;
            self.status = Some(OperationStatus::Running);
            self.header.created_at = Some(ctx.recorded_at);
            return Folded::Applied;
        }
        if self.status.is_none() {
            return not_created("operation");
        }
        match event {
            Event::ChildOperationAdded { child_id } => {
                if self.children.contains(child_id) {
                    return Folded::Refused(format!("child {child_id} already added"));
                }
                self.children.push(*child_id);
                Folded::Applied
            }
            Event::StageStarted { .. } | Event::StageCompleted { .. } => {
                self.apply_stage_event(event)
            }
            Event::StepDone { .. } | Event::StepStarted { .. } => self.apply_step_event(event),
            // The runner says it is alive: the commit renews the runner lease
            // (`header.updated_at`); nothing else changes. Only while running: a runner
            // must not go on once its operation stopped.
            Event::OperationHeartbeat {} => {
                if !self.status_in(&[OperationStatus::Running]) {
                    return self.wrong_status("operation heartbeat");
                }
                Folded::Applied
            }
            Event::OperationSucceeded {}
            | Event::OperationFailed { .. }
            | Event::CancellationRequested { .. }
            | Event::TargetDeletionNoticed { .. }
            | Event::OperationCancelled { .. } => self.apply_run_outcome_event(event, ctx),
            Event::RollbackPlanned { .. }
            | Event::RollbackFinished { .. }
            | Event::RollbackResumed { .. } => self.apply_rollback_event(event, ctx),
            Event::CompensationRequested { .. }
            | Event::CompensationDone { .. }
            | Event::CompensationFailed { .. }
            | Event::CompensationResolved { .. } => self.apply_compensation_event(event, ctx),
            other => Self::not_an_operation_event(other),
        }
    }

    /// A stage started or completed, while the operation runs.
    fn apply_stage_event(&mut self, event: &Event) -> Folded {
        match event {
            Event::StageStarted { stage } => {
                if !self.status_in(&[OperationStatus::Running]) {
                    return self.wrong_status("stage started");
                }
                if !self.stages.iter().any(|s| &s.name == stage) {
                    return Folded::Refused(format!(
                        "stage {stage:?} was not declared; not applied"
                    ));
                }
                self.stage_progress
                    .insert(stage.clone(), StageProgress::Started);
                self.current_stage = Some(stage.clone());
            }
            Event::StageCompleted { stage } => {
                if !self.status_in(&[OperationStatus::Running]) {
                    return self.wrong_status("stage completed");
                }
                if self.stage_progress.get(stage) != Some(&StageProgress::Started) {
                    return Folded::Refused(format!("stage {stage:?} completed without starting"));
                }
                self.stage_progress
                    .insert(stage.clone(), StageProgress::Completed);
            }
            // Not reached: `apply_event` sends stage events only.
            other => return Self::not_an_operation_event(other),
        }
        Folded::Applied
    }

    /// A step's effect (`StepDone`) or intent (`StepStarted`).
    fn apply_step_event(&mut self, event: &Event) -> Folded {
        match event {
            Event::StepDone {
                stage,
                step,
                effect,
                compensation,
            } => self.record_step_done(stage, step, effect, compensation),
            Event::StepStarted {
                stage,
                step,
                executor,
                idempotency_key,
                compensation,
            } => {
                // An intent is a decision, not a fact: nothing happened yet, so it is
                // refused once the operation stopped (the runner must not act then).
                if !self.status_in(&[OperationStatus::Running]) {
                    return self.wrong_status("step started");
                }
                if self.stage_progress.get(stage) != Some(&StageProgress::Started) {
                    return Folded::Refused(format!(
                        "step {step:?} started outside its started stage {stage:?}; not applied"
                    ));
                }
                let known = self.started.iter().any(|s| s.name == *step)
                    || self.steps.iter().any(|s| s.name == *step);
                if known {
                    return Folded::Refused(format!(
                        "step {step:?} was already started or done; step names are unique \
                         within an operation; not applied"
                    ));
                }
                self.started.push(Arc::new(StartedStep {
                    stage: stage.clone(),
                    name: step.clone(),
                    executor: executor.clone(),
                    idempotency_key: idempotency_key.clone(),
                    compensation: compensation.clone(),
                }));
                Folded::Applied
            }
            // Not reached: `apply_event` sends step events only.
            other => Self::not_an_operation_event(other),
        }
    }

    /// `StepDone`. An effect that happened is a fact: it is recorded even when out of
    /// place (then with an anomaly), so the rollback planner can still undo it. It settles
    /// the outcome of the intent of the same step, if one was recorded.
    fn record_step_done(
        &mut self,
        stage: &str,
        step: &str,
        effect: &Effect,
        compensation: &Option<Compensation>,
    ) -> Folded {
        self.started
            .retain(|s| !(s.stage == stage && s.name == step));
        if self.rollback_plan.is_some() && compensation.is_some() {
            self.late_effects.push(step.to_string());
        }
        self.steps.push(Arc::new(StepState {
            stage: stage.to_string(),
            name: step.to_string(),
            effect: effect.clone(),
            compensation: compensation.clone(),
            progress: StepProgress::Done,
            compensation_id: None,
        }));
        if self.stage_progress.get(stage) != Some(&StageProgress::Started) {
            return Folded::AppliedWithAnomaly(format!(
                "step {step:?} done outside its started stage {stage:?}"
            ));
        }
        if self.status != Some(OperationStatus::Running) {
            return Folded::AppliedWithAnomaly(format!(
                "step {step:?} done while the operation is {:?}",
                self.status
            ));
        }
        Folded::Applied
    }

    /// How the run ends or is asked to: succeeded, failed, a cancellation requested, the
    /// target's deletion noticed, cancelled.
    fn apply_run_outcome_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        use OperationStatus::*;
        match event {
            Event::OperationSucceeded {} => {
                if !self.status_in(&[Running]) {
                    return self.wrong_status("succeeded");
                }
                if let Some(open) = self.started.first() {
                    // An action asked for and never settled would be unknown to every
                    // later reader: success is refused until its outcome is recorded.
                    return Folded::Refused(format!(
                        "step {:?} was started and its outcome never recorded; record its \
                         step_done (or fail the operation) first; not applied",
                        open.name
                    ));
                }
                self.status = Some(Succeeded);
                self.finished_at = Some(ctx.recorded_at);
            }
            Event::OperationFailed { stage, step, error } => {
                if !self.status_in(&[Running]) {
                    return self.wrong_status("failed");
                }
                self.status = Some(Failed);
                self.failed_at = Some(ctx.recorded_at);
                self.error = Some(OperationError {
                    stage: stage.clone(),
                    step: step.clone(),
                    message: error.clone(),
                });
            }
            Event::CancellationRequested { reason } => {
                if let Some(refusal) = self.cancellation_refusal() {
                    return refusal;
                }
                if self.cancellation_reason.is_none() {
                    self.cancellation_reason = Some(reason.clone());
                }
            }
            Event::TargetDeletionNoticed { reason } => {
                // Recorded even on a closed operation: the deletion is a fact, and a
                // repeated notice (two deleters, two replicas) changes nothing.
                self.target_deleted = true;
                if self.cancellation_reason.is_none() {
                    self.cancellation_reason = Some(reason.clone());
                }
            }
            Event::OperationCancelled { reason } => {
                if !self.status_in(&[Running, Failed]) {
                    return self.wrong_status("cancelled");
                }
                self.status = Some(Cancelled);
                self.cancelled = true;
                if self.cancellation_reason.is_none() {
                    self.cancellation_reason = Some(reason.clone());
                }
            }
            // Not reached: `apply_event` sends these events only.
            other => return Self::not_an_operation_event(other),
        }
        Folded::Applied
    }

    /// Why a cancellation cannot be requested now, if it cannot: only a running operation
    /// is cancelled. A closed one (succeeded, rolled back, held, needs attention, cancelled
    /// and rolled back) has nothing left to stop, and one that already stopped (failed,
    /// cancelled, rolling back) is being rolled back already: a request would change
    /// nothing, so it is refused rather than accepted silently.
    fn cancellation_refusal(&self) -> Option<Folded> {
        let status = self.status?;
        if status == OperationStatus::Running {
            return None;
        }
        let word = serde_json::to_value(status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{status:?}"));
        Some(Folded::Refused(if self.is_closed() {
            format!(
                "the operation is closed ({word}): there is nothing left to cancel; \
                 cancellation not applied"
            )
        } else {
            format!(
                "the operation already stopped ({word}) and its rollback is under way: \
                 there is nothing left to cancel; cancellation not applied"
            )
        }))
    }

    /// The rollback: its plan recorded, finished, resumed after it needed attention.
    fn apply_rollback_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        use OperationStatus::*;
        match event {
            Event::RollbackPlanned { plan } => return self.plan_rollback(plan),
            Event::RollbackFinished { outcome, remaining } => {
                if !self.status_in(&[RollingBack]) {
                    return self.wrong_status("rollback finished");
                }
                self.status = Some(match outcome {
                    // A cancelled operation closes as cancelled once everything it
                    // created is compensated (design 4); so does one whose target was
                    // deleted, even if a step failed before the runner saw the notice.
                    RollbackOutcome::RolledBack if self.cancelled || self.target_deleted => {
                        Cancelled
                    }
                    RollbackOutcome::RolledBack => RolledBack,
                    RollbackOutcome::Held => Held,
                    RollbackOutcome::NeedsAttention => NeedsAttention,
                });
                self.rollback_outcome = Some(*outcome);
                self.remaining = remaining.clone();
                self.finished_at = Some(ctx.recorded_at);
            }
            Event::RollbackResumed { .. } => {
                if !self.status_in(&[NeedsAttention]) {
                    return self.wrong_status("rollback resumed");
                }
                for c in &mut self.compensations {
                    if c.progress != CompensationProgress::Done {
                        let c = Arc::make_mut(c);
                        c.attempts_at_resume = c.attempts;
                    }
                }
                self.status = Some(RollingBack);
                self.rollback_outcome = None;
                self.remaining.clear();
                self.finished_at = None;
            }
            // Not reached: `apply_event` sends rollback events only.
            other => return Self::not_an_operation_event(other),
        }
        Folded::Applied
    }

    /// `RollbackPlanned`: once, after the operation failed or was cancelled. Each planned
    /// compensation is marked on the step it undoes, each retained resource on its step.
    fn plan_rollback(&mut self, plan: &RollbackPlan) -> Folded {
        use OperationStatus::*;
        if self.rollback_plan.is_some() {
            return Folded::Refused("a rollback plan is already recorded; not applied".into());
        }
        if !self.status_in(&[Failed, Cancelled]) {
            return self.wrong_status("rollback planned");
        }
        for planned in &plan.compensations {
            if let Some(step) = self.steps.iter_mut().find(|s| {
                s.stage == planned.stage && s.name == planned.step && s.compensation_id.is_none()
            }) {
                let step = Arc::make_mut(step);
                step.compensation_id = Some(planned.compensation_id);
                step.progress = StepProgress::CompensationPlanned;
            }
            self.compensations.push(Arc::new(CompensationState {
                planned: planned.clone(),
                progress: CompensationProgress::Planned,
                attempts: 0,
                last_error: None,
                requested_at: None,
                failed_at: None,
                attempts_at_resume: 0,
                resolved: None,
            }));
        }
        for retained in &plan.retained {
            if let Some(step) = self.steps.iter_mut().find(|s| {
                s.stage == retained.stage
                    && s.name == retained.step
                    && s.progress == StepProgress::Done
            }) {
                Arc::make_mut(step).progress = StepProgress::Retained;
            }
        }
        self.rollback_plan = Some(Arc::new(plan.clone()));
        self.status = Some(RollingBack);
        Folded::Applied
    }

    /// One compensation of the recorded plan: requested, done, failed, resolved by hand.
    /// Each is mirrored on the step it undoes.
    fn apply_compensation_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        match event {
            Event::CompensationRequested {
                compensation_id,
                attempt,
            } => {
                let Some(c) = self.compensation_mut(compensation_id) else {
                    return Self::not_in_plan(compensation_id);
                };
                if c.progress == CompensationProgress::Done {
                    return Folded::Refused(format!(
                        "compensation {compensation_id} requested after it was done"
                    ));
                }
                c.progress = CompensationProgress::Requested;
                c.attempts = c.attempts.max(*attempt);
                c.requested_at = Some(ctx.recorded_at);
                self.mark_step(compensation_id, StepProgress::CompensationRequested);
            }
            Event::CompensationDone { compensation_id } => {
                let Some(c) = self.compensation_mut(compensation_id) else {
                    return Self::not_in_plan(compensation_id);
                };
                c.progress = CompensationProgress::Done;
                self.mark_step(compensation_id, StepProgress::Compensated);
            }
            Event::CompensationFailed {
                compensation_id,
                attempt,
                error,
            } => {
                let Some(c) = self.compensation_mut(compensation_id) else {
                    return Self::not_in_plan(compensation_id);
                };
                if c.progress == CompensationProgress::Done {
                    return Folded::Refused(format!(
                        "compensation {compensation_id} failed after it was done"
                    ));
                }
                c.progress = CompensationProgress::Failed;
                c.attempts = c.attempts.max(*attempt);
                c.last_error = Some(error.clone());
                c.failed_at = Some(ctx.recorded_at);
                self.mark_step(compensation_id, StepProgress::CompensationFailed);
            }
            Event::CompensationResolved {
                compensation_id,
                reason,
            } => {
                if !self.status_in(&[OperationStatus::NeedsAttention]) {
                    return self.wrong_status("compensation resolved");
                }
                let Some(c) = self.compensation_mut(compensation_id) else {
                    return Self::not_in_plan(compensation_id);
                };
                if c.progress == CompensationProgress::Done {
                    return Folded::Refused(format!(
                        "compensation {compensation_id} resolved after it was done"
                    ));
                }
                c.progress = CompensationProgress::Done;
                c.resolved = Some(reason.clone());
                self.mark_step(compensation_id, StepProgress::Compensated);
            }
            // Not reached: `apply_event` sends compensation events only.
            other => return Self::not_an_operation_event(other),
        }
        Folded::Applied
    }

    /// The refusal of an event that is not an operation's.
    fn not_an_operation_event(event: &Event) -> Folded {
        Folded::Refused(format!("{} is not an operation event", event.name()))
    }

    /// The contract's JSON form of an operation.
    pub fn view(&self) -> serde_json::Value {
        json_or_null(&crate::view::OperationView::of(self))
    }
}
