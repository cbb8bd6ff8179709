//! `cmd.append` for publishers not written in Rust: validated against the catalogue and
//! the target's state, then appended like any other writer would.

use provledger_client::write::{Fact, FoldedElsewhere, RecordError, Recorded};
use provledger_events::{
    AppendError, AppendStatus, CommitDraft, LossRefusal, ReadError, ATOMIC_COMMITS_MAX,
};
use provledger_projections::decide::{AlreadyDone, AppendRejection, DecideOptions};
use serde_json::{json, Value};

use super::caller::Caller;
use super::error::{bad, to_data, ErrorCode, QueryError};
use super::request::{from_object, object, read_directly};
use crate::messages::{
    AppendData, AppendOutcomeWord, AppendRequest, AtomicAppendData, AtomicAppendRequest,
    AtomicCommit, CmdAppendRequest, CommitOutcome,
};
use crate::replica::QueryContext;

pub(crate) async fn append(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    match request(payload)? {
        CmdAppendRequest::One(req) => append_one(ctx, req, caller).await,
        CmdAppendRequest::Atomic(req) => append_atomic(ctx, req, caller).await,
    }
}

/// The request in the form its keys say: `commits` is the atomic form, each commit an
/// object (serde would also read a commit from an array of its fields in order).
pub(super) fn request(payload: &[u8]) -> Result<CmdAppendRequest, QueryError> {
    // The common form, one commit: `AppendRequest` denies `commits`, so an atomic request
    // is never read as one commit here.
    if let Some(one) = read_directly(payload) {
        return Ok(CmdAppendRequest::One(one));
    }
    let req = object(payload)?;
    let Some(commits) = req.get("commits") else {
        return Ok(CmdAppendRequest::One(from_object(req)?));
    };
    if let Some(i) = commits
        .as_array()
        .and_then(|commits| commits.iter().position(|c| !c.is_object()))
    {
        return Err(bad(&format!("commits[{i}]"), "must be an object"));
    }
    Ok(CmdAppendRequest::Atomic(from_object(req)?))
}

/// One commit.
async fn append_one(
    ctx: &QueryContext,
    req: AppendRequest,
    caller: &Caller,
) -> Result<Value, QueryError> {
    let AppendRequest {
        aggregate,
        expect,
        commit_id,
        operation_id,
        causation_id,
        actor,
        events,
        force,
    } = req;
    // The server-vouched identity, when there is one, rather than what the request claims.
    let actor = caller.actor(actor.as_deref(), "nats:cmd.append");
    let commit = AtomicCommit {
        aggregate,
        expect,
        commit_id,
        operation_id,
        causation_id,
        events,
    };
    let Fact {
        aggregate,
        expect,
        draft,
    } = fact(commit, &actor, caller, "")?;
    // Decided against the log itself at the version appended, never against this
    // replica's projection, which may not have applied the last acknowledged commit yet
    // (the store only spares reading what it already folded).
    let options = decide_options(force, caller);
    let store = StoreFolded(&ctx.store);
    match ctx
        .writer
        .record_with_folded(aggregate, expect, draft, options, &store)
        .await
    {
        Ok(recorded) => Ok(to_data(&AppendData {
            commit: commit_outcome(&recorded),
            actor,
        })),
        Err(RecordError::Conflict { actual, .. }) => Err(QueryError::new(
            ErrorCode::Conflict,
            format!("{aggregate} is at version {actual}, not {expect}; re-read and retry"),
        )
        .with("reason", "version".into())
        .with("actual_version", actual.into())),
        Err(e) => Err(record_error(e)),
    }
}

/// `{"commits": [...]}`: several aggregates' commits written all or nothing.
async fn append_atomic(
    ctx: &QueryContext,
    req: AtomicAppendRequest,
    caller: &Caller,
) -> Result<Value, QueryError> {
    let AtomicAppendRequest {
        commits,
        actor,
        force,
    } = req;
    let actor = caller.actor(actor.as_deref(), "nats:cmd.append");
    let options = decide_options(force, caller);
    if commits.is_empty() || commits.len() > ATOMIC_COMMITS_MAX {
        return Err(bad(
            "commits",
            format!(
                "holds {} commits; an atomic append takes 1 to {ATOMIC_COMMITS_MAX}",
                commits.len()
            ),
        ));
    }
    let facts = commits
        .into_iter()
        .enumerate()
        .map(|(i, commit)| fact(commit, &actor, caller, &format!("commits[{i}].")))
        .collect::<Result<Vec<_>, _>>()?;
    let store = StoreFolded(&ctx.store);
    match ctx.writer.record_atomic(facts, options, &store).await {
        Ok(recorded) => Ok(to_data(&AtomicAppendData {
            commits: recorded.iter().map(commit_outcome).collect(),
            actor,
        })),
        Err(RecordError::Conflicts { conflicts }) => Err(QueryError::new(
            ErrorCode::Conflict,
            format!(
                "nothing written: {}; re-read and retry",
                conflicts
                    .iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        )
        .with("reason", "version".into())
        .with(
            "conflicts",
            conflicts
                .iter()
                .map(|c| {
                    json!({
                        "aggregate": c.aggregate.to_string(),
                        "expected": c.expected.to_string(),
                        "actual_version": c.actual,
                    })
                })
                .collect(),
        )),
        Err(RecordError::Rejections { rejections }) => {
            let errors: Vec<QueryError> = rejections.iter().map(|(_, r)| rejected(r)).collect();
            let each: Vec<Value> = rejections
                .iter()
                .zip(&errors)
                .map(|((aggregate, _), error)| {
                    let mut fields = error.fields();
                    fields.insert("aggregate".into(), aggregate.to_string().into());
                    Value::Object(fields)
                })
                .collect();
            // The first refusal's code (as a single commit would get it; a refusal names
            // at least one aggregate), every refusal in `rejections`.
            Err(QueryError::new(
                errors[0].code(),
                format!(
                    "nothing written: {}",
                    rejections
                        .iter()
                        .map(|(a, r)| format!("{a}: {r}"))
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            )
            .with("rejections", each.into()))
        }
        Err(e) => Err(record_error(e)),
    }
}

/// One commit as a draft recorded by `actor` in the caller's trace, its events checked
/// against its aggregate; `prefix` names where it sits in the request for error messages.
fn fact(
    commit: AtomicCommit,
    actor: &str,
    caller: &Caller,
    prefix: &str,
) -> Result<Fact, QueryError> {
    let AtomicCommit {
        aggregate,
        expect,
        commit_id,
        operation_id,
        causation_id,
        events,
    } = commit;
    let mut draft = CommitDraft::now(actor, events).with_trace(caller.trace());
    if let Some(id) = commit_id {
        draft.commit_id = id;
    }
    draft.operation_id = operation_id;
    draft.causation_id = causation_id;
    draft
        .validate(&aggregate)
        .map_err(|e| bad(&format!("{prefix}events"), e.to_string()))?;
    Ok(Fact {
        aggregate,
        expect: expect.into(),
        draft,
    })
}

/// `force` and the caller's worker identity: task events must come from the worker they
/// name (its vouched identity, when there is one); the decider checks it along with the
/// lease bounds.
fn decide_options(force: Option<bool>, caller: &Caller) -> DecideOptions {
    DecideOptions {
        force: force.unwrap_or(false),
        caller_worker: caller.worker(),
    }
}

fn commit_outcome(recorded: &Recorded) -> CommitOutcome {
    match recorded {
        Recorded::Appended(outcome) => CommitOutcome {
            position: outcome.position,
            version: outcome.version,
            outcome: match outcome.status {
                AppendStatus::Appended => AppendOutcomeWord::Appended,
                AppendStatus::AlreadyAppended => AppendOutcomeWord::AlreadyAppended,
            },
            already_appended: matches!(outcome.status, AppendStatus::AlreadyAppended),
        },
        Recorded::AlreadyDone {
            outcome,
            version,
            position,
        } => CommitOutcome {
            position: *position,
            version: *version,
            outcome: match outcome {
                AlreadyDone::AlreadyDeleting => AppendOutcomeWord::AlreadyDeleting,
                AlreadyDone::AlreadyDeleted => AppendOutcomeWord::AlreadyDeleted,
            },
            already_appended: false,
        },
    }
}

/// The errors both forms answer alike.
fn record_error(e: RecordError) -> QueryError {
    match e {
        RecordError::Rejected(rejection) => rejected(&rejection),
        e @ (RecordError::Conflict { .. }
        | RecordError::Conflicts { .. }
        | RecordError::Rejections { .. }) => QueryError::new(ErrorCode::Conflict, e.to_string()),
        e @ RecordError::Contended { .. } => QueryError::new(ErrorCode::Unavailable, e.to_string()),
        e @ RecordError::PermissionDenied { .. } => {
            QueryError::new(ErrorCode::Internal, e.to_string())
        }
        RecordError::Append(e) => append_error(e),
        RecordError::Read(e) => read_error(e),
    }
}

/// This replica's projection store as a starting point for the write path: an aggregate
/// it has folded is read from the log only after the store's tip (the decision itself is
/// still taken on the log's head, at the version appended).
struct StoreFolded<'a>(&'a crate::store::ProjectionStore);

impl FoldedElsewhere for StoreFolded<'_> {
    fn folded(
        &self,
        aggregate: provledger_events::AggregateId,
    ) -> Option<provledger_projections::Entity> {
        match self.0.entity(&aggregate) {
            Ok(entity) => entity,
            Err(e) => {
                tracing::warn!(%aggregate, error = %e, "store entity unreadable; the write reads the log");
                None
            }
        }
    }
}

/// A refusal by the decider: its own code for a deleted or unknown target, `rejected`
/// otherwise; always with the stable `reason`, and a claim's refused classes.
fn rejected(rejection: &AppendRejection) -> QueryError {
    let code = match rejection {
        AppendRejection::TargetDeleted { .. } => ErrorCode::TargetDeleted,
        AppendRejection::NotFound { .. } => ErrorCode::NotFound,
        AppendRejection::ClaimRefused { .. }
        | AppendRejection::InventoryBelowUsage { .. }
        | AppendRejection::NotApplicable { .. }
        | AppendRejection::WorkerMismatch { .. }
        | AppendRejection::NotLeaseHolder { .. }
        | AppendRejection::LeaseInPast { .. }
        | AppendRejection::LeaseTooShort { .. }
        | AppendRejection::LeaseTooLong { .. }
        | AppendRejection::RenewalNotExtending { .. }
        | AppendRejection::RenewalTooSoon { .. } => ErrorCode::Rejected,
    };
    let mut error =
        QueryError::new(code, rejection.to_string()).with("reason", rejection.reason().into());
    if let AppendRejection::ClaimRefused { refusal, .. } = rejection {
        error = error.with(
            "classes",
            serde_json::to_value(&refusal.classes).expect("refused classes: plain serde data (string keys, no fallible impls) encodes as JSON"),
        );
    }
    error
}

fn append_error(e: AppendError) -> QueryError {
    match e {
        // A `reason` tells it apart from a version conflict (which has `actual_version`).
        e @ AppendError::CommitIdReused { .. } => {
            QueryError::new(ErrorCode::Conflict, e.to_string())
                .with("reason", "commit_id_reused".into())
        }
        e @ (AppendError::Invalid(_) | AppendError::Encode(_)) => bad("events", e.to_string()),
        e @ AppendError::InvalidBatch(_) => bad("commits", e.to_string()),
        AppendError::Loss(LossRefusal::Lost(l)) => l.into(),
        e @ AppendError::Loss(LossRefusal::NotAnOpenLoss { .. }) => bad("events", e.to_string()),
        e @ AppendError::Unavailable { .. } => {
            QueryError::new(ErrorCode::Unavailable, e.to_string())
        }
        e @ (AppendError::Corrupt { .. }
        | AppendError::Conflict { .. }
        | AppendError::Conflicts { .. }) => QueryError::new(ErrorCode::Internal, e.to_string()),
    }
}

fn read_error(e: ReadError) -> QueryError {
    match e {
        e @ ReadError::Unavailable { .. } => QueryError::new(ErrorCode::Unavailable, e.to_string()),
        ReadError::Lost(l) => l.into(),
        e => QueryError::new(ErrorCode::Internal, e.to_string()),
    }
}
