//! `cmd.append` for publishers not written in Rust: validated against the catalogue and
//! the target's state, then appended like any other writer would.

use provledger_client::write::{record_with_folded, FoldedElsewhere, RecordError, Recorded};
use provledger_events::{AppendError, AppendStatus, CommitDraft, Event, Expectation, ReadError};
use provledger_projections::decide::{AppendRejection, DecideOptions};
use serde_json::{json, Value};

use super::caller::Caller;
use super::error::{bad, ErrorCode, QueryError};
use super::request::{check_fields, object, opt_str, opt_uuid, req_aggregate};
use super::QueryContext;

pub(crate) async fn append(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    let mut req = object(payload)?;
    check_fields(
        &req,
        &[
            "aggregate",
            "expect",
            "commit_id",
            "operation_id",
            "causation_id",
            "actor",
            "events",
            "force",
        ],
    )?;
    let aggregate = req_aggregate(&req)?;
    let expect = match req.get("expect") {
        None => return Err(bad("expect", "missing")),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Expectation::Exactly)
            .ok_or_else(|| bad("expect", "must be \"any\", \"none\" or a version"))?,
        Some(Value::String(s)) => s.parse().map_err(|e| bad("expect", e))?,
        Some(other) => return Err(bad("expect", format!("unexpected {other}"))),
    };
    let events_json = req
        .remove("events")
        .ok_or_else(|| bad("events", "missing"))?;
    let events: Vec<Event> = serde_json::from_value(events_json)
        .map_err(|e| bad("events", format!("not catalogue events: {e}")))?;
    // The server-vouched identity, when there is one, rather than what the request claims.
    let actor = caller.actor(opt_str(&req, "actor")?, "nats:cmd.append");
    let mut draft = CommitDraft::now(&actor, events);
    if let Some(id) = opt_uuid(&req, "commit_id")? {
        draft.commit_id = id;
    }
    draft.operation_id = opt_uuid(&req, "operation_id")?;
    draft.causation_id = opt_uuid(&req, "causation_id")?;
    draft
        .validate(&aggregate)
        .map_err(|e| bad("events", e.to_string()))?;
    // Decided against the log itself at the version appended, never against this
    // replica's projection, which may not have applied the last acknowledged commit yet
    // (the store only spares reading what it already folded).
    let force = match req.get("force") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(bad("force", format!("must be true or false, not {other}"))),
    };
    // Task events must come from the worker they name (its vouched identity, when there is
    // one); the decider checks it along with the lease bounds.
    let options = DecideOptions {
        force,
        caller_worker: caller.worker(),
    };
    let store = StoreFolded(&ctx.store);
    match record_with_folded(&ctx.log, aggregate, expect, draft, options, &store).await {
        Ok(Recorded::Appended(outcome)) => Ok(json!({
            "position": outcome.position,
            "version": outcome.version,
            "outcome": match outcome.status {
                AppendStatus::Appended => "appended",
                AppendStatus::AlreadyAppended => "already_appended",
            },
            "already_appended": matches!(outcome.status, AppendStatus::AlreadyAppended),
            "actor": actor,
        })),
        Ok(Recorded::AlreadyDone {
            outcome,
            version,
            position,
        }) => Ok(json!({
            "position": position,
            "version": version,
            "outcome": outcome.as_str(),
            "already_appended": false,
            "actor": actor,
        })),
        Err(RecordError::Rejected(rejection)) => Err(rejected(rejection)),
        Err(RecordError::Conflict { actual, .. }) => Err(QueryError::new(
            ErrorCode::Conflict,
            format!("{aggregate} is at version {actual}, not {expect}; re-read and retry"),
        )
        .with("reason", "version".into())
        .with("actual_version", actual.into())),
        Err(e @ RecordError::Contended { .. }) => {
            Err(QueryError::new(ErrorCode::Unavailable, e.to_string()))
        }
        Err(e @ RecordError::PermissionDenied { .. }) => {
            Err(QueryError::new(ErrorCode::Internal, e.to_string()))
        }
        Err(RecordError::Append(e)) => Err(append_error(e)),
        Err(RecordError::Read(e)) => Err(read_error(e)),
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
fn rejected(rejection: AppendRejection) -> QueryError {
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
    if let AppendRejection::ClaimRefused { refusal, .. } = &rejection {
        error = error.with(
            "classes",
            serde_json::to_value(&refusal.classes).unwrap_or_default(),
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
        e @ AppendError::Unavailable { .. } => {
            QueryError::new(ErrorCode::Unavailable, e.to_string())
        }
        e @ (AppendError::Corrupt { .. } | AppendError::Conflict { .. }) => {
            QueryError::new(ErrorCode::Internal, e.to_string())
        }
    }
}

fn read_error(e: ReadError) -> QueryError {
    match e {
        e @ ReadError::Unavailable { .. } => QueryError::new(ErrorCode::Unavailable, e.to_string()),
        e => QueryError::new(ErrorCode::Internal, e.to_string()),
    }
}
