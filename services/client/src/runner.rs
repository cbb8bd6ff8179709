//! The operation runner: the one entry point through which a provisioning service runs an
//! operation. It records the start, each stage and each step with its effect and declared
//! compensation (one commit), and catches every error, panic and cancellation in one
//! place: it records the failure (stage, step, error) or the cancellation, then hands the
//! operation to the rollback driver.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use provledger_events::catalogue::{
    BundlePolicy, Compensation, CompensationAction, ConsumerKind, DetailKey, Effect, EffectKind,
    Executor, OperationKind, OperationOutcome, Origin, RollbackPlan,
};
use provledger_events::{AggregateId, AggregateKind, CommitDraft, Event, Expectation, ReadError};
use provledger_projections::decide::{AppendRejection, DecideOptions};
use provledger_projections::operation::{OperationState, OperationStatus};
use provledger_projections::stages::stages_of;
use provledger_projections::Entity;
use tokio::sync::watch;
use uuid::Uuid;

use crate::cancel::CancelNotices;
use crate::clock::Stamper;
use crate::driver::RollbackDriver;
use crate::ledger::Ledger;
use crate::write::{Fact, FromTheLog, RecordError, Recorded, Writer};

/// How long a runner lets its operation go without a commit before it writes an
/// `operation_heartbeat` (while a step runs and records nothing): 60 s, a fifth of serve's
/// default runner lease (`RUNNER_LEASE_MS_DEFAULT`, 5 minutes), so a live runner whose
/// clock lags serve's by up to 4 minutes is never taken for dead.
pub const RUNNER_HEARTBEAT_DEFAULT: Duration = Duration::from_secs(60);
/// The shortest heartbeat interval: half the shortest runner lease (`RUNNER_LEASE_MS_MIN`),
/// so one operation's heartbeat writes at most two commits a second, as a task lease.
pub const RUNNER_HEARTBEAT_MIN: Duration = Duration::from_millis(500);
/// The longest heartbeat interval: half the longest runner lease serve accepts
/// (`RUNNER_LEASE_MS_MAX`, 15 minutes).
pub const RUNNER_HEARTBEAT_MAX: Duration = Duration::from_secs(450);

/// Appends to the operation retried after a version conflict (each conflict means another
/// writer, a canceller or a deleter, got in between).
const OPERATION_APPEND_ATTEMPTS_MAX: usize = 8;

/// What to run: the kind fixes the stages and their rollback policies.
#[derive(Debug, Clone)]
pub struct OperationSpec {
    pub id: Uuid,
    pub kind: OperationKind,
    pub target: AggregateId,
    pub parent_id: Option<Uuid>,
    pub bundle_policy: Option<BundlePolicy>,
    /// Events that create the target, written in the same commit as its in-flight marker
    /// (create operations). `None` when the target already exists.
    pub create_target: Option<Vec<Event>>,
    /// The W3C trace the operation runs in (the request that asked for it): every commit
    /// the runner writes records it, so serve's rollback and its compensation requests
    /// continue it (docs/events.md, "The trace context").
    pub trace: Option<provledger_events::TraceContext>,
}

impl OperationSpec {
    /// A spec whose id the runner mints from its id source when it runs it.
    pub fn new(kind: OperationKind, target: AggregateId) -> Self {
        OperationSpec {
            id: Uuid::nil(),
            kind,
            target,
            parent_id: None,
            bundle_policy: None,
            create_target: None,
            trace: None,
        }
    }

    /// Records every commit of the operation in `trace` (`None`: none).
    pub fn with_trace(mut self, trace: Option<provledger_events::TraceContext>) -> Self {
        self.trace = trace;
        self
    }

    /// Runs the operation under this id (a bundle names its own target with it).
    pub fn with_id(mut self, id: Uuid) -> Self {
        self.id = id;
        self
    }

    pub fn creating(mut self, events: Vec<Event>) -> Self {
        self.create_target = Some(events);
        self
    }

    pub fn child_of(mut self, parent: Uuid) -> Self {
        self.parent_id = Some(parent);
        self
    }
}

/// Why an operation stopped. Every variant is a value a caller can match on.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OperationError {
    /// The user deleted the target: the operation stopped at its next step or append.
    #[error("{target} is being deleted: operation {operation} stopped ({reason})")]
    TargetDeleted {
        operation: Uuid,
        target: AggregateId,
        reason: String,
    },
    #[error("operation {operation} was cancelled: {reason}")]
    Cancelled { operation: Uuid, reason: String },
    #[error("stage {stage}, step {step} failed: {error}")]
    StepFailed {
        stage: String,
        step: String,
        error: String,
    },
    #[error("stage {stage}, step {step} panicked: {message}")]
    Panicked {
        stage: String,
        step: String,
        message: String,
    },
    /// A stage or step outside the kind's declared stages: a bug in the caller.
    #[error("stage {stage:?} is not declared for this operation kind")]
    UnknownStage { stage: String },
    #[error("operation {operation} could not start: {reason}")]
    NotStarted { operation: Uuid, reason: String },
    /// An append with an exact expectation met a newer version (another writer got in
    /// between); the caller re-reads and decides again.
    #[error("conflict on {aggregate}: actual version is {actual}")]
    Conflict { aggregate: AggregateId, actual: u64 },
    /// The append decider refused a write: the fold would not apply it (a claim that does
    /// not fit, an event on an aggregate that does not exist, an impossible transition).
    #[error("{0}")]
    Rejected(AppendRejection),
    /// The operation's state could not be read from the log.
    #[error("reading the log: {0}")]
    Read(#[from] ReadError),
    /// A record could not be written (nothing of it was).
    #[error("writing to the log: {0}")]
    Write(#[source] std::sync::Arc<RecordError>),
    /// The operation this runner started has no record in the log any more.
    #[error("operation {0} is not in the log")]
    Vanished(Uuid),
    /// Other writers moved the operation on at every attempt: `attempts` appends in a row
    /// met a newer version.
    #[error("operation {operation}: {attempts} appends in a row met a newer version")]
    Contended { operation: Uuid, attempts: usize },
}

impl From<RecordError> for OperationError {
    fn from(e: RecordError) -> Self {
        OperationError::Write(std::sync::Arc::new(e))
    }
}

impl OperationError {
    fn is_cancellation(&self) -> bool {
        matches!(
            self,
            OperationError::TargetDeleted { .. } | OperationError::Cancelled { .. }
        )
    }
}

/// A step's own failure, as its code reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepError(pub String);

impl<S: Into<String>> From<S> for StepError {
    fn from(s: S) -> Self {
        StepError(s.into())
    }
}

/// What a step produced: its value and, if it changed the world, the effect with the
/// compensation that undoes it.
pub struct StepOutput<T> {
    pub value: T,
    pub effect: Option<(Effect, Option<Compensation>)>,
}

impl<T> StepOutput<T> {
    pub fn with_effect(value: T, effect: Effect, compensation: Option<Compensation>) -> Self {
        StepOutput {
            value,
            effect: Some((effect, compensation)),
        }
    }

    pub fn without_effect(value: T) -> Self {
        StepOutput {
            value,
            effect: None,
        }
    }
}

/// What an executor's action produced ([`OperationCtx::act`]): its value, the effect,
/// and the compensation that undoes it by resource (or `None`: nothing to undo).
pub struct ActOutput<T> {
    pub value: T,
    pub effect: Effect,
    pub compensation: Option<Compensation>,
}

impl<T> ActOutput<T> {
    pub fn new(value: T, effect: Effect, compensation: Option<Compensation>) -> Self {
        ActOutput {
            value,
            effect,
            compensation,
        }
    }
}

/// The idempotency key of step `step` of `operation`: derived, so that the runner, a
/// re-run and a reader of the log agree on it without storing anything else.
pub fn idempotency_key(operation: Uuid, step: &str) -> String {
    crate::ledger::derived_commit_id(operation, &format!("intent/{step}")).to_string()
}

/// How a run ended, with the operation's final state as folded from the log.
#[derive(Debug)]
pub struct RunReport<T> {
    pub operation_id: Uuid,
    pub result: Result<T, OperationError>,
    pub status: Option<OperationStatus>,
    pub plan: Option<RollbackPlan>,
}

/// Called before every step with (operation, stage, step): the seam through which a
/// simulation injects faults or a delete at a chosen step.
pub type StepHook = Arc<
    dyn Fn(Uuid, String, String) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
        + Send
        + Sync,
>;

/// Runs operations against one ledger.
#[derive(Clone)]
pub struct OperationRunner {
    ledger: Writer<Ledger>,
    notices: CancelNotices,
    driver: Option<Arc<RollbackDriver>>,
    actor: String,
    step_hook: Option<StepHook>,
    stamper: Stamper,
    heartbeat: Duration,
}

#[derive(Debug, Clone)]
enum Stop {
    TargetDeleted(String),
    Cancelled(String),
}

struct CtxState {
    version: u64,
    stage: Option<String>,
    step: Option<String>,
    stop: Option<Stop>,
    /// When this runner last wrote on the operation (its runner lease renewed).
    last_written: tokio::time::Instant,
}

struct CtxInner {
    ledger: Writer<Ledger>,
    id: Uuid,
    kind: OperationKind,
    target: AggregateId,
    actor: String,
    stamper: Stamper,
    trace: Option<provledger_events::TraceContext>,
    step_hook: Option<StepHook>,
    notice: watch::Receiver<bool>,
    // A std mutex: it is never held across an await.
    state: Mutex<CtxState>,
}

/// The running operation, handed to the service's code. Cheap to clone.
#[derive(Clone)]
pub struct OperationCtx {
    inner: Arc<CtxInner>,
}

fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Runs a step's own work, turning its error or panic into the typed stop of the step.
async fn run_work<O>(
    stage: &str,
    step: &str,
    work: impl Future<Output = Result<O, StepError>>,
) -> Result<O, OperationError> {
    match AssertUnwindSafe(work).catch_unwind().await {
        Err(panic) => Err(OperationError::Panicked {
            stage: stage.into(),
            step: step.into(),
            message: panic_message(panic),
        }),
        Ok(Err(StepError(error))) => Err(OperationError::StepFailed {
            stage: stage.into(),
            step: step.into(),
            error,
        }),
        Ok(Ok(output)) => Ok(output),
    }
}

impl OperationRunner {
    /// `driver`: when given, a failed or cancelled operation's rollback is planned and
    /// driven in this process before `run` returns (embedded mode). Without it the
    /// operation is left failed for `serve` to plan and drive.
    pub fn new(
        ledger: Writer<Ledger>,
        notices: CancelNotices,
        driver: Option<Arc<RollbackDriver>>,
        actor: &str,
    ) -> Self {
        OperationRunner {
            ledger,
            notices,
            driver,
            actor: actor.to_string(),
            step_hook: None,
            stamper: Stamper::system(),
            heartbeat: RUNNER_HEARTBEAT_DEFAULT,
        }
    }

    /// Writes an `operation_heartbeat` once the operation has gone `every` without a
    /// commit from this runner (clamped to [`RUNNER_HEARTBEAT_MIN`] ..=
    /// [`RUNNER_HEARTBEAT_MAX`]). serve's `--runner-lease` must be longer than twice this,
    /// plus the clock skew between this process and serve.
    pub fn with_heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every.clamp(RUNNER_HEARTBEAT_MIN, RUNNER_HEARTBEAT_MAX);
        self
    }

    /// The heartbeat interval ([`Self::with_heartbeat`]).
    pub fn heartbeat(&self) -> Duration {
        self.heartbeat
    }

    /// Stamps every commit and mints every id from `stamper` instead of the wall clock.
    pub fn with_stamper(mut self, stamper: Stamper) -> Self {
        self.stamper = stamper;
        self
    }

    pub fn stamper(&self) -> &Stamper {
        &self.stamper
    }

    pub fn with_step_hook(mut self, hook: StepHook) -> Self {
        self.step_hook = Some(hook);
        self
    }

    pub fn ledger(&self) -> &Writer<Ledger> {
        &self.ledger
    }

    pub fn notices(&self) -> &CancelNotices {
        &self.notices
    }

    pub fn driver(&self) -> Option<&Arc<RollbackDriver>> {
        self.driver.as_ref()
    }

    /// Runs `body` as the operation `spec` describes. Whatever happens inside `body` (an
    /// error returned with `?`, a panic, a cancellation), the outcome is recorded and the
    /// rollback handed over here.
    pub async fn run<T, F, Fut>(&self, spec: OperationSpec, body: F) -> RunReport<T>
    where
        F: FnOnce(OperationCtx) -> Fut,
        Fut: Future<Output = Result<T, OperationError>>,
    {
        let mut spec = spec;
        if spec.id.is_nil() {
            spec.id = self.stamper.id();
        }
        let operation_id = spec.id;
        let ctx = match self.start(&spec).await {
            Ok(ctx) => ctx,
            Err(e) => {
                return RunReport {
                    operation_id,
                    result: Err(e),
                    status: None,
                    plan: None,
                }
            }
        };
        tracing::info!(operation = %operation_id, kind = ?spec.kind, target = %spec.target, "operation started");
        // The runner lease is renewed in the background while the body runs, and never
        // after: it is stopped (and its write in hand finished) before the outcome.
        let heartbeat = Heartbeat::start(&ctx, self.heartbeat);
        let result = AssertUnwindSafe(body(ctx.clone())).catch_unwind().await;
        heartbeat.stop().await;
        let result = match result {
            Ok(result) => result,
            Err(panic) => {
                let (stage, step) = ctx.position();
                Err(OperationError::Panicked {
                    stage,
                    step,
                    message: panic_message(panic),
                })
            }
        };
        let result = match result {
            Ok(value) => match ctx.finish_succeeded().await {
                Ok(()) => Ok(value),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        // The driver returns the state it ended on; otherwise read it once.
        let mut driven = None;
        if let Err(error) = &result {
            if let Err(e) = ctx.record_stop(error).await {
                tracing::error!(operation = %operation_id, error = %e, "the failure could not be recorded; serve or `rollback run` finishes it from the log");
            } else if let Some(driver) = &self.driver {
                match driver.drive(operation_id).await {
                    Ok(op) => driven = Some(op),
                    Err(e) => {
                        tracing::warn!(operation = %operation_id, error = %e, "rollback not finished here; serve or `rollback run` resumes it from the log")
                    }
                }
            }
        }
        let state = match driven {
            Some(op) => Some(op),
            None => match self
                .ledger
                .read_current(AggregateId::operation(operation_id))
                .await
            {
                Ok(Some(Entity::Operation(op))) => Some(*op),
                _ => None,
            },
        };
        RunReport {
            operation_id,
            result,
            status: state.as_ref().and_then(|s| s.status),
            plan: state.and_then(|s| s.rollback_plan.map(std::sync::Arc::unwrap_or_clone)),
        }
    }

    async fn start(&self, spec: &OperationSpec) -> Result<OperationCtx, OperationError> {
        let op = AggregateId::operation(spec.id);
        let started = Event::operation_started(
            spec.kind,
            spec.target,
            spec.parent_id,
            stages_of(spec.kind),
            spec.bundle_policy,
        );
        let draft = self
            .stamper
            .draft(&self.actor, vec![started])
            .with_operation(spec.id)
            .with_trace(spec.trace);
        let outcome = self
            .ledger
            .record(op, Expectation::NoStream, draft)
            .await
            .map_err(|e| OperationError::NotStarted {
                operation: spec.id,
                reason: e.to_string(),
            })?;
        let notice = self.notices.watch(spec.id).await;
        let ctx = OperationCtx {
            inner: Arc::new(CtxInner {
                ledger: self.ledger.clone(),
                id: spec.id,
                kind: spec.kind,
                target: spec.target,
                actor: self.actor.clone(),
                stamper: self.stamper.clone(),
                trace: spec.trace,
                step_hook: self.step_hook.clone(),
                notice,
                state: Mutex::new(CtxState {
                    version: outcome.version(),
                    stage: None,
                    step: None,
                    stop: None,
                    last_written: tokio::time::Instant::now(),
                }),
            }),
        };
        if let Err(e) = ctx.mark_target(spec).await {
            // The operation is recorded: close it as failed before any stage, so nothing
            // is left running in the log.
            let _ = ctx.record_stop(&e).await;
            if let Some(driver) = &self.driver {
                let _ = driver.drive(spec.id).await;
            }
            return Err(e);
        }
        Ok(ctx)
    }
}

impl OperationCtx {
    pub fn id(&self) -> Uuid {
        self.inner.id
    }

    pub fn target(&self) -> AggregateId {
        self.inner.target
    }

    pub fn ledger(&self) -> &Writer<Ledger> {
        &self.inner.ledger
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CtxState> {
        // A poisoned lock means a panic while holding it, and nothing panics while
        // holding it (no user code runs under it); recover the state either way.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn position(&self) -> (String, String) {
        let s = self.lock();
        (
            s.stage.clone().unwrap_or_else(|| "(none)".into()),
            s.step.clone().unwrap_or_else(|| "(none)".into()),
        )
    }

    /// A draft stamped with this operation, its actor and its trace.
    pub fn draft(&self, events: Vec<Event>) -> CommitDraft {
        self.inner
            .stamper
            .draft(&self.inner.actor, events)
            .with_operation(self.inner.id)
            .with_trace(self.inner.trace)
    }

    /// The clock and id source of the runner that started this operation.
    pub fn stamper(&self) -> &Stamper {
        &self.inner.stamper
    }

    fn stop_error(&self, stop: &Stop) -> OperationError {
        match stop {
            Stop::TargetDeleted(reason) => OperationError::TargetDeleted {
                operation: self.inner.id,
                target: self.inner.target,
                reason: reason.clone(),
            },
            Stop::Cancelled(reason) => OperationError::Cancelled {
                operation: self.inner.id,
                reason: reason.clone(),
            },
        }
    }

    /// Reads the operation from the log and notes a cancellation, if one is recorded.
    async fn refresh(&self) -> Result<u64, OperationError> {
        let op = AggregateId::operation(self.inner.id);
        let Some(Entity::Operation(state)) = self.inner.ledger.read_current(op).await? else {
            return Err(OperationError::Vanished(op.id));
        };
        let stop = stop_of(&state);
        let mut s = self.lock();
        s.version = state.header.version;
        if s.stop.is_none() {
            s.stop = stop;
        }
        Ok(state.header.version)
    }

    /// Fails with the typed stop error if the operation was cancelled or its target is
    /// being deleted; consults the log when a cancel notice arrived.
    pub async fn check_cancelled(&self) -> Result<(), OperationError> {
        if *self.inner.notice.borrow() {
            self.refresh().await?;
        }
        let stop = self.lock().stop.clone();
        match stop {
            Some(stop) => Err(self.stop_error(&stop)),
            None => Ok(()),
        }
    }

    /// Resolves when a cancel notice for this operation arrives (for long steps that can
    /// stop early). Never resolves if none does.
    pub async fn cancel_notice(&self) {
        let mut rx = self.inner.notice.clone();
        while !*rx.borrow() {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Appends to the operation itself at its known version. `record_anyway`: a fact
    /// (a step's effect, the outcome) is recorded even after a cancellation arrived.
    async fn append_op(
        &self,
        events: Vec<Event>,
        record_anyway: bool,
    ) -> Result<(), OperationError> {
        let op = AggregateId::operation(self.inner.id);
        // One commit id across attempts: an attempt whose answer was lost is then
        // recognised as the same commit, never written twice.
        let draft = self.draft(events);
        for _ in 0..OPERATION_APPEND_ATTEMPTS_MAX {
            let version = self.lock().version;
            match self
                .inner
                .ledger
                .record(op, Expectation::Exactly(version), draft.clone())
                .await
            {
                Ok(outcome) => {
                    let mut s = self.lock();
                    s.version = outcome.version();
                    s.last_written = tokio::time::Instant::now();
                    return Ok(());
                }
                Err(RecordError::Conflict { .. }) => {
                    self.refresh().await?;
                    if !record_anyway {
                        self.check_cancelled().await?;
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(OperationError::Contended {
            operation: op.id,
            attempts: OPERATION_APPEND_ATTEMPTS_MAX,
        })
    }

    async fn mark_target(&self, spec: &OperationSpec) -> Result<(), OperationError> {
        let marker = Event::in_flight_operation_set(spec.id, spec.kind);
        if spec.target.kind == AggregateKind::Operation {
            return Ok(()); // a bundle is its own target
        }
        match &spec.create_target {
            Some(create) => {
                let mut events = create.clone();
                events.push(marker);
                self.inner
                    .ledger
                    .record(spec.target, Expectation::NoStream, self.draft(events))
                    .await
                    .map_err(|e| OperationError::NotStarted {
                        operation: spec.id,
                        reason: format!("creating {}: {e}", spec.target),
                    })?;
            }
            None => {
                self.append(spec.target, Expectation::Any, vec![marker])
                    .await?;
            }
        }
        Ok(())
    }

    /// Starts a stage, completing the current one first.
    pub async fn stage(&self, name: &str) -> Result<(), OperationError> {
        if !stages_of(self.inner.kind).iter().any(|s| s.name == name) {
            return Err(OperationError::UnknownStage { stage: name.into() });
        }
        self.check_cancelled().await?;
        let mut events = Vec::new();
        if let Some(current) = self.lock().stage.clone() {
            events.push(Event::stage_completed(current));
        }
        events.push(Event::stage_started(name));
        self.append_op(events, false).await?;
        let mut s = self.lock();
        s.stage = Some(name.to_string());
        s.step = None;
        Ok(())
    }

    /// Runs one step of the current stage. Its effect and compensation are recorded in one
    /// commit as soon as it returns, even if a cancellation arrived meanwhile (the effect
    /// happened, and the rollback must know of it); then the cancellation is honoured.
    pub async fn step<T, Fut>(&self, name: &str, work: Fut) -> Result<T, OperationError>
    where
        Fut: Future<Output = Result<StepOutput<T>, StepError>>,
    {
        let stage = self.begin_step(name).await?;
        let output = run_work(&stage, name, work).await?;
        if let Some((effect, compensation)) = output.effect {
            let done = Event::step_done(stage, name, effect, compensation);
            self.append_op(vec![done], true).await?;
        }
        self.check_cancelled().await?;
        Ok(output.value)
    }

    /// Intent before effect: a step that asks an executor to act. Before `work` runs, the
    /// step is recorded as started (`StepStarted`) with the idempotency key `work` must
    /// pass to the executor and with `undo`, the compensation that undoes by that key
    /// (its `resource` may be empty when the executor chooses the resource, e.g. an IP;
    /// the key is added to its `args`). `work` returns its value, the effect and the
    /// compensation that undoes it by resource, recorded as the step's `StepDone`.
    ///
    /// A runner dying between the executor's action and that record leaves the intent in
    /// the log: the rollback asks `executor` to undo whatever it did under the key, and an
    /// executor that did nothing answers that there was nothing to undo. The same holds
    /// when `work` fails (the executor may have half acted before answering an error).
    pub async fn act<T, F, Fut>(
        &self,
        name: &str,
        executor: &str,
        undo: Option<Compensation>,
        work: F,
    ) -> Result<T, OperationError>
    where
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<ActOutput<T>, StepError>>,
    {
        let stage = self.begin_step(name).await?;
        let key = idempotency_key(self.inner.id, name);
        let undo = undo.map(|mut c| {
            c.args
                .insert(DetailKey::IdempotencyKey.to_string(), key.clone());
            c
        });
        let started = Event::step_started(stage.clone(), name, executor, key.clone(), undo);
        // A decision: refused if a cancellation got in first (nothing was asked yet).
        self.append_op(vec![started], false).await?;
        let output = run_work(&stage, name, work(key.clone())).await?;
        // The compensation by resource carries the key too: the executor can tell its
        // own resource from one handed to another request since (a reused IP).
        let compensation = output.compensation.map(|mut c| {
            c.args
                .entry(DetailKey::IdempotencyKey.to_string())
                .or_insert_with(|| key.clone());
            c
        });
        let done = Event::step_done(stage, name, output.effect, compensation);
        self.append_op(vec![done], true).await?;
        self.check_cancelled().await?;
        Ok(output.value)
    }

    /// What every step does first: the simulation's hook, a cancellation check, and the
    /// step noted as current. Returns the stage it runs in.
    async fn begin_step(&self, name: &str) -> Result<String, OperationError> {
        if let Some(hook) = &self.inner.step_hook {
            let stage = self.lock().stage.clone().unwrap_or_default();
            hook(self.inner.id, stage, name.to_string()).await;
        }
        self.check_cancelled().await?;
        let stage = {
            let mut s = self.lock();
            s.step = Some(name.to_string());
            s.stage.clone()
        };
        stage.ok_or_else(|| OperationError::UnknownStage {
            stage: format!("(none, for step {name})"),
        })
    }

    /// A step whose effect is itself a fact on another aggregate (a claim on a provider):
    /// `events` on `aggregate` and the step's record (`effect`, `compensation`) on the
    /// operation are written as one atomic commit set, so no crash can leave the claim
    /// without the step that accounts for it (and its compensation), or the reverse. The
    /// operation's record is decided at its exact version; a cancellation recorded in
    /// between stops the step before anything is written.
    pub async fn step_recording(
        &self,
        name: &str,
        aggregate: AggregateId,
        events: Vec<Event>,
        effect: Effect,
        compensation: Option<Compensation>,
    ) -> Result<Recorded, OperationError> {
        let stage = self.begin_step(name).await?;
        let op = AggregateId::operation(self.inner.id);
        let done = Event::step_done(stage, name, effect, compensation);
        // Both drafts keep their commit ids across attempts: a lost answer is then
        // recognised as the same facts, never written twice.
        let fact = self.draft(events);
        let record = self.draft(vec![done]);
        for _ in 0..OPERATION_APPEND_ATTEMPTS_MAX {
            let version = self.lock().version;
            let facts = vec![
                Fact {
                    aggregate,
                    expect: Expectation::Any,
                    draft: fact.clone(),
                },
                Fact {
                    aggregate: op,
                    expect: Expectation::Exactly(version),
                    draft: record.clone(),
                },
            ];
            match self.record_together(facts).await {
                Ok(recorded) => {
                    if let Some(on_op) = recorded.get(1) {
                        self.lock().version = on_op.version();
                    }
                    let Some(first) = recorded.into_iter().next() else {
                        unreachable!("an atomic write answers each of its facts");
                    };
                    return Ok(first);
                }
                // The operation moved (a cancellation, a notice): look again, and stop
                // if it says so.
                Err(RecordError::Conflicts { .. }) => {
                    self.refresh().await?;
                    self.check_cancelled().await?;
                }
                Err(RecordError::Rejections { rejections }) => {
                    let Some((refused, rejection)) = rejections.into_iter().next() else {
                        unreachable!("a refusal names at least one aggregate");
                    };
                    // Only the operation's own target being deleted stops it; a provider
                    // being deleted refuses the claim like any other refusal.
                    if let AppendRejection::TargetDeleted { state, .. } = &rejection {
                        if refused == self.target() {
                            let stop = Stop::TargetDeleted(format!("{refused} is {state}"));
                            self.lock().stop = Some(stop.clone());
                            return Err(self.stop_error(&stop));
                        }
                    }
                    return Err(OperationError::Rejected(rejection));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(OperationError::Contended {
            operation: op.id,
            attempts: OPERATION_APPEND_ATTEMPTS_MAX,
        })
    }

    /// The claim step a provisioning service runs: `resources` claimed for `consumer` on
    /// `provider`, recorded with its step (effect `allocation_claimed` with the provider in
    /// its detail, compensation `release_allocation` at the ledger) in one atomic set
    /// ([`OperationCtx::step_recording`]). The decider checks the claim against the
    /// provider's state at exactly the version it is appended with, so concurrent
    /// schedulers never overcommit. A claim that does not fit fails the step ("no valid
    /// host: ..."), as Nova's scheduler does; a cancellation stops the operation.
    pub async fn claim(
        &self,
        step: &str,
        provider: Uuid,
        consumer: Uuid,
        consumer_kind: ConsumerKind,
        resources: &BTreeMap<String, u64>,
    ) -> Result<(), OperationError> {
        let claimed = Event::allocation_claimed(consumer, consumer_kind, resources.clone());
        let provider_key = DetailKey::ProviderId.to_string();
        let release = Compensation {
            action: CompensationAction::ReleaseAllocation,
            executor: Executor::Ledger,
            resource: consumer.to_string(),
            args: BTreeMap::from([(provider_key.clone(), provider.to_string())]),
        };
        let effect = Effect {
            kind: EffectKind::AllocationClaimed,
            resource: consumer.to_string(),
            executor: "ledger".into(),
            origin: Origin::Created,
            detail: BTreeMap::from([(provider_key, provider.to_string())]),
        };
        let recorded = self
            .step_recording(
                step,
                AggregateId::provider(provider),
                vec![claimed],
                effect,
                Some(release),
            )
            .await;
        match recorded {
            Ok(_) => Ok(()),
            Err(OperationError::Rejected(AppendRejection::ClaimRefused { refusal, .. })) => {
                Err(self.step_failed(step, format!("no valid host: {refusal}")))
            }
            Err(OperationError::Rejected(AppendRejection::NotFound { .. })) => {
                Err(self.step_failed(step, format!("provider {provider} does not exist")))
            }
            Err(OperationError::Rejected(AppendRejection::TargetDeleted { state, .. })) => {
                Err(self.step_failed(
                    step,
                    format!("no valid host: provider {provider} is {state}"),
                ))
            }
            // A cancellation or a deleted target stops the operation as any step would.
            Err(e @ (OperationError::Cancelled { .. } | OperationError::TargetDeleted { .. })) => {
                Err(e)
            }
            Err(e) => Err(self.step_failed(step, e.to_string())),
        }
    }

    /// Appends to another aggregate on behalf of this operation. A cluster or instance
    /// that is being deleted refuses anything that would revive it: the typed
    /// `TargetDeleted` error, and the operation stops.
    pub async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        events: Vec<Event>,
    ) -> Result<Recorded, OperationError> {
        self.check_cancelled().await?;
        match self
            .inner
            .ledger
            .record(aggregate, expect, self.draft(events))
            .await
        {
            Ok(recorded) => Ok(recorded),
            Err(RecordError::Conflict { actual, .. }) => {
                Err(OperationError::Conflict { aggregate, actual })
            }
            Err(RecordError::Rejected(rejection)) => Err(self.refused(aggregate, rejection)),
            Err(e) => Err(e.into()),
        }
    }

    /// A write the decider refused: a target being deleted stops the operation (noted, so
    /// that its next step sees it); anything else is the refusal itself.
    fn refused(&self, aggregate: AggregateId, rejection: AppendRejection) -> OperationError {
        match rejection {
            AppendRejection::TargetDeleted { state, .. } => {
                let stop = Stop::TargetDeleted(format!("{aggregate} is {state}"));
                self.lock().stop = Some(stop.clone());
                self.stop_error(&stop)
            }
            rejection => OperationError::Rejected(rejection),
        }
    }

    /// Writes facts on several aggregates (other than the operation) all or nothing, each
    /// at its expectation: facts that move together (a node's instance record and its
    /// membership of the cluster) are never left half written by a crash. A target being
    /// deleted refuses what would revive it, as [`OperationCtx::append`] does.
    pub async fn append_together(
        &self,
        facts: Vec<(AggregateId, Expectation, Vec<Event>)>,
    ) -> Result<Vec<Recorded>, OperationError> {
        self.check_cancelled().await?;
        // Drafts made once: a retry after a lost answer is recognised as the same facts.
        let facts: Vec<Fact> = facts
            .into_iter()
            .map(|(aggregate, expect, events)| Fact {
                aggregate,
                expect,
                draft: self.draft(events),
            })
            .collect();
        match self.record_together(facts).await {
            Ok(recorded) => Ok(recorded),
            Err(RecordError::Conflicts { conflicts }) => {
                let first = conflicts.first().map(|c| (c.aggregate, c.actual));
                let (aggregate, actual) = first.unwrap_or((self.inner.target, 0));
                Err(OperationError::Conflict { aggregate, actual })
            }
            Err(RecordError::Rejections { mut rejections }) => {
                // A target being deleted is the answer, whichever fact met it.
                let deleted = rejections
                    .iter()
                    .position(|(_, r)| matches!(r, AppendRejection::TargetDeleted { .. }));
                let first = deleted.unwrap_or(0);
                if first >= rejections.len() {
                    // A refusal that names no aggregate: answered as the log gave it.
                    return Err(RecordError::Rejections { rejections }.into());
                }
                let (aggregate, rejection) = rejections.swap_remove(first);
                Err(self.refused(aggregate, rejection))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// One atomic set through the write path, each fact decided against the log.
    async fn record_together(&self, facts: Vec<Fact>) -> Result<Vec<Recorded>, RecordError> {
        self.inner
            .ledger
            .record_atomic(facts, DecideOptions::default(), &FromTheLog)
            .await
    }

    /// Records a child operation of this one (a bundle's).
    pub async fn add_child(&self, child: Uuid) -> Result<(), OperationError> {
        self.append_op(vec![Event::child_operation_added(child)], true)
            .await
    }

    async fn finish_succeeded(&self) -> Result<(), OperationError> {
        let mut events = Vec::new();
        if let Some(stage) = self.lock().stage.clone() {
            events.push(Event::stage_completed(stage));
        }
        events.push(Event::operation_succeeded());
        self.append_op(events, true).await?;
        if self.inner.target.kind != AggregateKind::Operation {
            let cleared =
                Event::in_flight_operation_cleared(self.inner.id, OperationOutcome::Succeeded);
            self.inner
                .ledger
                .record(
                    self.inner.target,
                    Expectation::Any,
                    self.draft(vec![cleared]),
                )
                .await?;
        }
        Ok(())
    }

    /// Records why the operation stopped: cancelled (by a user or by the target's
    /// deletion) or failed at a stage and step.
    async fn record_stop(&self, error: &OperationError) -> Result<(), OperationError> {
        let (stage, step) = {
            let s = self.lock();
            (s.stage.clone(), s.step.clone())
        };
        let event = if error.is_cancellation() {
            Event::operation_cancelled(error.to_string())
        } else {
            let step = match error {
                OperationError::StepFailed { step, .. } | OperationError::Panicked { step, .. } => {
                    Some(step.clone())
                }
                _ => step,
            };
            // The stage and step have their own fields; the message is the cause alone.
            let message = match error {
                OperationError::StepFailed { error, .. } => error.clone(),
                OperationError::Panicked { message, .. } => format!("panicked: {message}"),
                other => other.to_string(),
            };
            Event::operation_failed(stage.unwrap_or_else(|| "start".into()), step, message)
        };
        tracing::info!(operation = %self.inner.id, error = %error, "operation stopped");
        self.append_op(vec![event], true).await
    }

    /// Fails the operation at the current stage with `step` naming the cause (a bundle's
    /// failed child).
    pub fn step_failed(&self, step: &str, error: impl Into<String>) -> OperationError {
        let (stage, _) = self.position();
        OperationError::StepFailed {
            stage,
            step: step.into(),
            error: error.into(),
        }
    }
}

/// The background renewal of a running operation's runner lease: an
/// `operation_heartbeat` whenever the operation went the interval without a commit from
/// this runner. It ends at [`Heartbeat::stop`], when dropped (the run abandoned), or at
/// its first write refused or failed (the operation stopped: failed by serve, cancelled).
struct Heartbeat {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Heartbeat {
    fn start(ctx: &OperationCtx, every: Duration) -> Heartbeat {
        let (stop, mut stopped) = watch::channel(false);
        let ctx = ctx.clone();
        let task = tokio::spawn(async move {
            loop {
                let due = ctx.lock().last_written + every;
                tokio::select! {
                    _ = tokio::time::sleep_until(due) => {}
                    _ = stopped.changed() => return,
                }
                if *stopped.borrow() {
                    return;
                }
                if ctx.lock().last_written + every > tokio::time::Instant::now() {
                    continue; // the runner wrote meanwhile: the lease is fresh
                }
                if let Err(e) = ctx
                    .append_op(vec![Event::operation_heartbeat()], false)
                    .await
                {
                    tracing::warn!(operation = %ctx.id(), error = %e, "runner heartbeat stopped");
                    return;
                }
            }
        });
        Heartbeat {
            stop,
            task: Some(task),
        }
    }

    /// Stops the renewal; a heartbeat being written is finished first, so none is written
    /// after this returns.
    async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

fn stop_of(state: &OperationState) -> Option<Stop> {
    let reason = state.cancellation_reason.clone()?;
    Some(if state.target_deleted {
        Stop::TargetDeleted(reason)
    } else {
        Stop::Cancelled(reason)
    })
}
