//! `cmd.worker.ready`: a worker that (re)connected says so, and the replica that answers
//! delivers its pending re-issues at its next round without waiting for their backoff
//! (`provledger_client::recovery::deliver_reissues`). Without it a worker still receives
//! them, within the backoff's bound (`REISSUE_BACKOFF_MAX_MS`).
//!
//! A worker may say only that *it* listens, as for its task events: when the server vouches
//! for the caller (`Nats-Request-Info`), `worker` must be the caller's own worker id, else
//! any caller could make serve skip another worker's backoff on every call.

use serde_json::Value;

use super::caller::Caller;
use super::error::{to_data, ErrorCode, QueryError};
use super::request::parse;
use crate::messages::{WorkerReadyData, WorkerReadyRequest};
use crate::replica::QueryContext;

/// The longest worker id accepted: it is one token of a NATS subject.
const WORKER_ID_BYTES_MAX: usize = 256;

pub(crate) fn ready(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    let WorkerReadyRequest { worker } = parse(payload)?;
    let worker = worker.as_str();
    let valid = !worker.is_empty()
        && worker.len() <= WORKER_ID_BYTES_MAX
        && !worker
            .chars()
            .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>'));
    if !valid {
        return Err(QueryError::new(
            ErrorCode::BadRequest,
            "`worker` must be a worker id: one NATS subject token (no '.', '*', '>' or space), at most 256 bytes".to_string(),
        ));
    }
    if let Some(own) = caller.worker().filter(|own| !own.is(worker)) {
        return Err(QueryError::new(
            ErrorCode::Rejected,
            format!(
                "a worker may say only that it listens itself: the server vouches this caller is worker {:?}, not {worker:?}",
                own.as_str()
            ),
        )
        .with("reason", "another_worker".into()));
    }
    let delivering = ctx.workers_ready.note(worker);
    Ok(to_data(&WorkerReadyData {
        worker: worker.to_string(),
        delivering,
    }))
}
