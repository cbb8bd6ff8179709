//! Where external compensations go. A compensation whose executor is
//! `Executor::Service(name)` is requested from the service that owns the resource: over
//! NATS as a request on `<prefix>.exec.<name>.compensate`, or in-process when embedded.
//! Executors must be idempotent by `compensation_id`: a retried or raced request for a
//! compensation already carried out answers success without doing it again.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use provledger_events::catalogue::{CompensationAction, PlannedCompensation};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use uuid::Uuid;

/// The JSON request an executor receives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CompensationRequest {
    pub operation_id: Uuid,
    pub compensation_id: Uuid,
    pub attempt: u32,
    pub action: CompensationAction,
    pub resource: String,
    pub args: BTreeMap<String, String>,
}

impl CompensationRequest {
    pub fn new(operation_id: Uuid, planned: &PlannedCompensation, attempt: u32) -> Self {
        CompensationRequest {
            operation_id,
            compensation_id: planned.compensation_id,
            attempt,
            action: planned.compensation.action.clone(),
            resource: planned.compensation.resource.clone(),
            args: planned.compensation.args.clone(),
        }
    }
}

/// The JSON reply: `{"ok": true}` or `{"ok": false, "error": "..."}`. An executor asked to
/// undo, by idempotency key, an action it never carried out answers `{"ok": true,
/// "nothing_to_undo": true}`: the compensation is done, and the log says so.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CompensationReply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nothing_to_undo: bool,
}

impl CompensationReply {
    pub fn done() -> Self {
        CompensationReply {
            ok: true,
            error: None,
            nothing_to_undo: false,
        }
    }

    pub fn nothing_to_undo() -> Self {
        CompensationReply {
            nothing_to_undo: true,
            ..Self::done()
        }
    }

    pub fn failed(error: String) -> Self {
        CompensationReply {
            ok: false,
            error: Some(error),
            nothing_to_undo: false,
        }
    }
}

/// Why an executor or a worker did not do what it was asked, as the port reports it: a
/// retry policy (and an operator) can tell a peer it never reached from one that refused.
/// The message is the reason recorded in the log (`compensation_failed`, `reissue_failed`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// No answer: nobody listens on its subject, the reply wait passed, the connection
    /// failed. Trying again later may work.
    #[error("{0}")]
    Unreachable(String),
    /// It answered that it did not do it (`{"ok": false, "error": ...}`): its reason.
    #[error("{0}")]
    Refused(String),
    /// It answered something that is not a reply of the protocol.
    #[error("{0}")]
    BadReply(String),
}

/// The reason as the log records it (the flows' steps and the driver keep reasons as text).
impl From<PeerError> for String {
    fn from(e: PeerError) -> String {
        e.to_string()
    }
}

pub type CompensationFuture<'a> = Pin<Box<dyn Future<Output = Result<(), PeerError>> + Send + 'a>>;

/// Carries out one external compensation; `Err` says why not.
pub trait CompensationExecutor: Send + Sync {
    fn compensate<'a>(
        &'a self,
        executor: &'a str,
        request: &'a CompensationRequest,
    ) -> CompensationFuture<'a>;
}

/// Requests compensations from executors over NATS.
pub struct NatsExecutors {
    pub client: async_nats::Client,
    pub subject_prefix: String,
    pub reply_wait: Duration,
}

impl NatsExecutors {
    pub fn subject(subject_prefix: &str, executor: &str) -> String {
        format!("{subject_prefix}.exec.{executor}.compensate")
    }
}

impl CompensationExecutor for NatsExecutors {
    fn compensate<'a>(
        &'a self,
        executor: &'a str,
        request: &'a CompensationRequest,
    ) -> CompensationFuture<'a> {
        Box::pin(async move {
            let subject = Self::subject(&self.subject_prefix, executor);
            request_ok(&self.client, subject, request, self.reply_wait).await
        })
    }
}

/// One request to a service that answers `{"ok": true}` or `{"ok": false, "error": ...}`
/// (executors, workers), bounded by `reply_wait`.
pub(crate) async fn request_ok<T: Serialize>(
    client: &async_nats::Client,
    subject: String,
    request: &T,
    reply_wait: Duration,
) -> Result<(), PeerError> {
    // The requests are plain serde structs: encoding them cannot fail.
    let body = serde_json::to_vec(request).expect("a request encodes as JSON");
    let reply = tokio::time::timeout(reply_wait, client.request(subject.clone(), body.into()))
        .await
        .map_err(|_| {
            PeerError::Unreachable(format!("no reply from {subject} within {reply_wait:?}"))
        })?
        .map_err(|e| PeerError::Unreachable(format!("request to {subject}: {e}")))?;
    let reply: CompensationReply = serde_json::from_slice(&reply.payload)
        .map_err(|e| PeerError::BadReply(format!("unreadable reply from {subject}: {e}")))?;
    if reply.ok && reply.nothing_to_undo {
        tracing::info!(%subject, "the executor had nothing to undo (it never acted under the key)");
    }
    match (reply.ok, reply.error) {
        (true, _) => Ok(()),
        (false, error) => Err(PeerError::Refused(
            error.unwrap_or_else(|| "refused without a reason".into()),
        )),
    }
}

/// Hands every compensation to one in-process executor (embedded mode and tests).
impl<T: CompensationExecutor + ?Sized> CompensationExecutor for Arc<T> {
    fn compensate<'a>(
        &'a self,
        executor: &'a str,
        request: &'a CompensationRequest,
    ) -> CompensationFuture<'a> {
        (**self).compensate(executor, request)
    }
}
