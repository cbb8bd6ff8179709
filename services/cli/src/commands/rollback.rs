//! `provledger rollback plan OP_ID` prints the rollback plan of a failed or cancelled
//! operation: the recorded one, or (dry run) the one the planner would record now.
//! `provledger rollback run OP_ID` records the plan and drives it to the end, with the
//! executors reached over NATS (`--executors-url`, default `--nats`); a rollback that
//! ended `needs_attention` is resumed first (`rollback_resumed`).

use std::sync::Arc;
use std::time::Duration;

use provledger_events::catalogue::Executor;
use provledger_events::{Commit, Timestamp};
use provledger_projections::operation::{
    CompensationProgress, CompensationState, OperationState, OperationStatus,
};
use provledger_projections::planner::{action_word, json_word, render_plan};
use provledger_projections::rollback::{
    next_rollback_action, resolvable_by_hand, RetryPolicy, RollbackAction,
};
use provledger_projections::Entity;
use uuid::Uuid;

use super::{print_json, CommandError};
use provledger_client::Writer;
use provledger_client::{
    plan_for, read_operation, resume_needs_attention, CompensationExecutor, CompensationFuture,
    CompensationRequest, DriveError, Ledger, NatsExecutors, PeerError, RollbackDriver, Stamper,
};

/// How long `rollback run` waits for one executor's reply.
const EXECUTOR_REPLY_WAIT: Duration = Duration::from_secs(10);

/// Maps the driver's errors onto the command's exit codes and messages.
fn command_error(e: DriveError) -> CommandError {
    match e {
        DriveError::NotFound(id) => CommandError::Problem(format!(
            "operation {id} not found in this ledger (check --data-dir / --nats)"
        )),
        DriveError::Plan(refusal) => CommandError::Problem(refusal.to_string()),
        DriveError::Resolve(refusal) => CommandError::Problem(refusal.to_string()),
        // A refusal (permissions, conflict, rejection) exits 1 as any write's does.
        DriveError::Write(e) => CommandError::from(e),
        // A loss in the operation's chain exits 1, the log unavailable 3.
        DriveError::Read(e) => CommandError::from(e),
        other => CommandError::Infrastructure(other.to_string()),
    }
}

/// `rollback resolve OP --compensation ID --reason TEXT`: records that `actor` handled the
/// compensation by hand; when none is left, the rollback is resumed, and this command
/// finishes it (nothing is requested of any executor: every compensation is done).
pub async fn resolve(
    ledger: &Writer<Ledger>,
    id: Uuid,
    compensation: &provledger_events::IdRef,
    reason: &str,
    actor: &str,
    json: bool,
) -> Result<(), CommandError> {
    let compensation_id = match compensation {
        provledger_events::IdRef::Full(c) => *c,
        // Digits of it: the one compensation of this operation's plan they name.
        short => {
            let op = read_operation(ledger, id).await.map_err(command_error)?;
            super::ids::resolve_compensation(
                id,
                op.compensations.iter().map(|c| c.planned.compensation_id),
                short,
            )?
        }
    };
    let events = provledger_client::resolve_compensation(
        ledger,
        id,
        compensation_id,
        reason,
        actor,
        &Stamper::system(),
    )
    .await
    .map_err(command_error)?;
    let resumed = events
        .iter()
        .any(|e| matches!(e, provledger_events::Event::RollbackResumed { .. }));
    if !json {
        println!("compensation {compensation_id} of operation {id} resolved by hand by {actor}: {reason}");
    }
    if !resumed {
        let op = read_operation(ledger, id).await.map_err(command_error)?;
        let left = left_after_resolve(&op);
        if json {
            print_json(&serde_json::json!({
                "operation_id": id,
                "resolved": compensation_id,
                "status": "needs_attention",
                "compensations_not_done": left.len(),
                "left": left.iter().map(|c| c.to_json()).collect::<Vec<_>>(),
            }));
        } else {
            print!("{}", describe_left(id, &left));
        }
        return Ok(());
    }
    if !json {
        println!("every stuck compensation is resolved: the rollback resumes and finishes");
    }
    // Every compensation is done: the driver only records the end.
    let driver = RollbackDriver::new(
        ledger.clone(),
        Arc::new(NoExecutors),
        RetryPolicy::default(),
        actor,
    );
    let op = driver.drive(id).await.map_err(command_error)?;
    finish_report(&op, id, json)
}

/// A compensation still not done after a resolve, as the operator must see it: tried
/// (and how it failed) or never attempted.
struct Left<'a> {
    state: &'a CompensationState,
}

impl Left<'_> {
    fn tried(&self) -> bool {
        self.state.attempts > 0
    }

    fn to_json(&self) -> serde_json::Value {
        let c = self.state;
        serde_json::json!({
            "compensation_id": c.planned.compensation_id,
            "action": action_word(&c.planned.compensation.action),
            "executor": c.planned.compensation.executor,
            "state": c.progress,
            "attempts": c.attempts,
            "last_error": c.last_error,
            "attempted": self.tried(),
            "resolvable_by_hand": resolvable_by_hand(&c.planned.compensation),
        })
    }
}

/// Who carries out a compensation, as the operation's view names it.
fn executor_word(executor: &Executor) -> String {
    match executor {
        Executor::Ledger => "ledger".into(),
        Executor::Service(name) => name.clone(),
    }
}

/// The compensations not done, in plan order.
fn left_after_resolve(op: &OperationState) -> Vec<Left<'_>> {
    op.compensations
        .iter()
        .filter(|c| c.progress != CompensationProgress::Done)
        .map(|state| Left { state })
        .collect()
}

/// What is left after a resolve, each compensation by its full id, tried (attempts, last
/// error) or never attempted, and what to do: a compensation never attempted is requested
/// by `rollback run`, never resolved by hand (nobody knows it was done).
fn describe_left(id: Uuid, left: &[Left<'_>]) -> String {
    let invocation = super::invocation::current();
    let mut out = format!(
        "{} compensation(s) of operation {id} still not done:\n",
        left.len()
    );
    for c in left {
        let s = c.state;
        let what = format!(
            "{} {} ({})",
            s.planned.compensation_id,
            action_word(&s.planned.compensation.action),
            executor_word(&s.planned.compensation.executor)
        );
        let how = if !resolvable_by_hand(&s.planned.compensation) {
            "the ledger's own: applied when the rollback resumes".to_string()
        } else if c.tried() {
            format!(
                "tried {} time(s), {}{}",
                s.attempts,
                json_word(&s.progress),
                s.last_error
                    .as_ref()
                    .map(|e| format!(", last error: {e}"))
                    .unwrap_or_default()
            )
        } else {
            "never attempted".to_string()
        };
        out.push_str(&format!("  {what}: {how}\n"));
    }
    let untried = left
        .iter()
        .any(|c| !c.tried() && resolvable_by_hand(&c.state.planned.compensation));
    let failed: Vec<&Left<'_>> = left
        .iter()
        .filter(|c| c.tried() && resolvable_by_hand(&c.state.planned.compensation))
        .collect();
    if untried {
        out.push_str(&format!(
            "the ones never attempted are the executors' to do: request them with `{}` \
             (never tried, they are not work handled by hand)\n",
            invocation.command(&format!("rollback run {id}"))
        ));
    }
    for c in failed {
        out.push_str(&format!(
            "{} failed: fix what fails, then `{}`; or, once handled by hand, `{}`\n",
            c.state.planned.compensation_id,
            invocation.command(&format!("rollback run {id}")),
            invocation.command(&format!(
                "rollback resolve {id} --compensation {} --reason TEXT",
                c.state.planned.compensation_id
            ))
        ));
    }
    out
}

/// `rollback plan OP`: what `rollback run OP` would do, said the same way: the recorded
/// plan; or the plan the planner would record now (dry run); or, for a running operation
/// with a cancellation pending, when `rollback run` records the cancellation and the plan
/// it would then record; or the refusal `rollback run` gives (nothing to roll back).
pub async fn plan(ledger: &Writer<Ledger>, id: Uuid, json: bool) -> Result<(), CommandError> {
    let op = read_operation(ledger, id).await.map_err(command_error)?;
    let policy = cli_policy(ledger);
    let pending = op
        .cancellation_pending()
        .then(|| cancelled_trial(&op, &policy));
    let (plan, recorded) = match (&op.rollback_plan, &pending) {
        (Some(plan), _) => (
            provledger_events::catalogue::RollbackPlan::clone(plan),
            true,
        ),
        (None, Some(trial)) => (plan_for(ledger, trial).await.map_err(command_error)?, false),
        (None, None) => (
            plan_for(ledger, &op)
                .await
                .map_err(|e| with_cancel_hint(command_error(e), &op))?,
            false,
        ),
    };
    if json {
        print_json(&serde_json::json!({
            "operation_id": id,
            "recorded": recorded,
            "status": op.status,
            "cancellation_pending": pending.is_some(),
            "cancellation_recorded_at": pending
                .as_ref()
                .map(|_| cancellation_at(&op, &policy)),
            "plan": plan,
            "compensations": op.view()["compensations"],
        }));
        return Ok(());
    }
    if pending.is_some() {
        println!(
            "operation {id} (running, cancellation requested) on {}: dry run, nothing recorded",
            plan.target
        );
        print!("{}", pending_note(&op, &policy));
        println!("then `rollback run` records this plan:");
        print!("{}", render_plan(&plan));
        return Ok(());
    }
    let status = op.view()["status"].as_str().unwrap_or("?").to_string();
    // The plan shows ids short; the target's full id is what `state` and `history` take.
    println!(
        "operation {id} ({status}) on {}: {}",
        plan.target,
        if recorded {
            "recorded plan"
        } else {
            "dry run, nothing recorded"
        }
    );
    print!("{}", render_plan(&plan));
    for c in &op.compensations {
        if c.progress != CompensationProgress::Done {
            println!(
                "  pending: {} {} after {} attempt(s){}",
                c.planned.compensation_id,
                json_word(&c.progress),
                c.attempts,
                c.last_error
                    .as_ref()
                    .map(|e| format!(", last error: {e}"))
                    .unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// The retry policy this command's driver runs with. Embedded, this process holds the data
/// dir (one process opens it at a time), so no runner of this ledger is alive anywhere: a
/// cancellation pending is recorded at once, since the runner stop wait only protects a
/// live runner inside a long step. Over NATS a runner may be alive in another process, and
/// the stop wait applies as in serve's rollback worker.
pub fn cli_policy(ledger: &Writer<Ledger>) -> RetryPolicy {
    match ledger.log() {
        Ledger::Embedded(_) => RetryPolicy {
            runner_stop_wait_ms: 0,
            ..RetryPolicy::default()
        },
        _ => RetryPolicy::default(),
    }
}

/// When a driver with `policy` records the cancellation of `op` (a running operation
/// with a cancellation pending) if its runner has not stopped by then.
fn cancellation_at(op: &OperationState, policy: &RetryPolicy) -> Option<Timestamp> {
    op.header
        .updated_at
        .map(|t| t.plus_ms(policy.runner_stop_wait_ms))
}

/// What happens to a running operation with a cancellation pending, as `rollback plan`,
/// `rollback run` and `operation cancel` say it.
pub fn pending_note(op: &OperationState, policy: &RetryPolicy) -> String {
    let reason = op.cancellation_reason.as_deref().unwrap_or_default();
    let mut out = format!(
        "cancellation requested ({}); the operation is still running: its runner stops at its \
         next step and records operation_cancelled\n",
        super::printable(reason)
    );
    if policy.runner_stop_wait_ms == 0 {
        out.push_str(
            "no runner can be alive (this command holds the data dir): `rollback run` records \
             the cancellation at once\n",
        );
    } else {
        let at = cancellation_at(op, policy).map_or("-".to_string(), |t| t.to_rfc3339());
        out.push_str(&format!(
            "if its runner died, a rollback driver (serve's worker, `rollback run`) records the \
             cancellation once the operation has been quiet for {} s, at {at}\n",
            policy.runner_stop_wait_ms / 1000
        ));
    }
    super::operation::wrap_text(&out)
}

/// `op` as it would be once the driver recorded its cancellation: the decider's own event
/// (the one a driver records for a runner that did not stop), folded into a copy.
fn cancelled_trial(op: &OperationState, policy: &RetryPolicy) -> OperationState {
    let far = Timestamp::from_unix_ms(i64::MAX / 4);
    let RollbackAction::CancelForSilentRunner(event) = next_rollback_action(op, far, policy) else {
        return op.clone();
    };
    let draft = Stamper::system()
        .draft("cli", vec![*event])
        .with_operation(op.header.id.id);
    let commit = Commit::seal(op.header.id, op.header.version + 1, op.header.hash, draft);
    let mut entity = Entity::Operation(Box::new(op.clone()));
    entity.apply(&commit);
    match entity {
        Entity::Operation(trial) => *trial,
        _ => op.clone(),
    }
}

/// A refusal to roll back a running operation, with how to stop it.
fn with_cancel_hint(e: CommandError, op: &OperationState) -> CommandError {
    match e {
        CommandError::Problem(message) if op.status == Some(OperationStatus::Running) => {
            CommandError::Problem(format!(
                "{message}; to stop it (its writer died, say): `{}`",
                super::invocation::current().command(&format!(
                    "operation cancel {} --reason TEXT",
                    op.header.id.id
                ))
            ))
        }
        other => other,
    }
}

/// Stands in for the executors when none is reachable: each external compensation fails
/// with what to do, and the rollback ends in `needs_attention` listing them.
struct NoExecutors;

impl CompensationExecutor for NoExecutors {
    fn compensate<'a>(
        &'a self,
        executor: &'a str,
        _request: &'a CompensationRequest,
    ) -> CompensationFuture<'a> {
        Box::pin(async move {
            Err(PeerError::Unreachable(format!(
                "executor {executor:?} is not reachable: pass --executors-url with the NATS \
                 server it listens on"
            )))
        })
    }
}

/// A rollback that ended `needs_attention` is resumed on request: `rollback_resumed`,
/// decided at the operation's exact version, gives every compensation not done a fresh
/// budget of attempts; the driver then goes on from where it stopped.
async fn resume_if_needs_attention(
    ledger: &Writer<Ledger>,
    id: Uuid,
    json: bool,
) -> Result<(), CommandError> {
    let resumed = resume_needs_attention(
        ledger,
        id,
        "resumed by `provledger rollback run`",
        "cli",
        &Stamper::system(),
    )
    .await
    .map_err(command_error)?;
    if resumed && !json {
        println!("operation {id} needed attention: rollback resumed");
    }
    Ok(())
}

pub async fn run(
    ledger: &Writer<Ledger>,
    id: Uuid,
    executors_url: Option<&str>,
    auth: &provledger_client::NatsAuth,
    subject_prefix: &str,
    json: bool,
) -> Result<(), CommandError> {
    let executors: Arc<dyn CompensationExecutor> = match executors_url {
        Some(url) => {
            let client = provledger_client::connect_nats(url, "provledger-rollback", auth).await?;
            Arc::new(NatsExecutors {
                client,
                subject_prefix: subject_prefix.to_string(),
                reply_wait: EXECUTOR_REPLY_WAIT,
            })
        }
        None => Arc::new(NoExecutors),
    };
    let op = read_operation(ledger, id).await.map_err(command_error)?;
    let policy = cli_policy(ledger);
    if op.rollback_plan.is_none() && !op.awaits_rollback_plan() && !op.cancellation_pending() {
        // Nothing to roll back (running, succeeded): the planner's refusal, the one
        // `rollback plan` gives, rather than a silent success.
        let refusal = plan_for(ledger, &op).await.err().map(command_error);
        return Err(with_cancel_hint(
            refusal.unwrap_or_else(|| {
                CommandError::Problem(format!("operation {id}: there is nothing to roll back"))
            }),
            &op,
        ));
    }
    if op.cancellation_pending() && !json {
        print!("{}", pending_note(&op, &policy));
    }
    resume_if_needs_attention(ledger, id, json).await?;
    let driver = RollbackDriver::new(ledger.clone(), executors, policy, "cli");
    let op = driver.drive(id).await.map_err(command_error)?;
    finish_report(&op, id, json)
}

/// Where a driven rollback ended: the view (`--json`) or its status, plan and what remains;
/// exit 1 while compensations remain (`needs_attention`).
fn finish_report(op: &OperationState, id: Uuid, json: bool) -> Result<(), CommandError> {
    if json {
        print_json(&op.view());
    } else {
        let status = op.view()["status"].as_str().unwrap_or("?").to_string();
        println!("operation {id}: {status}");
        if let Some(plan) = &op.rollback_plan {
            print!("{}", render_plan(plan));
        }
        if !op.remaining.is_empty() {
            let remaining: Vec<String> = op.remaining.iter().map(Uuid::to_string).collect();
            println!("remaining compensations: {}", remaining.join(", "));
        }
    }
    if op.remaining.is_empty() {
        Ok(())
    } else {
        Err(CommandError::Problem(format!(
            "operation {id} needs attention: {} compensation(s) remain",
            op.remaining.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_client::write::RecordError;

    #[test]
    fn a_write_refused_for_permissions_exits_1_as_docs_operations_promises() {
        // Given a resolve whose write NATS refused for this user's permissions...
        let denied = DriveError::Write(RecordError::PermissionDenied {
            aggregate: provledger_events::AggregateId::operation(Uuid::nil()),
            message: "Permissions Violation for Publish".into(),
        });
        // ...then the command found a problem (exit 1), not an infrastructure failure (3).
        assert_eq!(command_error(denied).exit_code(), 1);
    }
}
