//! Where external compensations go. A compensation whose executor is
//! `Executor::Service(name)` is requested from the service that owns the resource: over
//! NATS as a request on `<prefix>.exec.<name>.compensate`, or in-process when embedded.
//! Executors must be idempotent by `compensation_id`: a retried or raced request for a
//! compensation already carried out answers success without doing it again.
//!
//! A request on behalf of a traced operation carries the W3C `traceparent` header: the
//! operation's trace (the latest trace context its commits recorded) under a span id of
//! the request's own ([`RequestTrace`]), so the executor's work joins the trace of the
//! request that wrote the operation.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use provledger_events::catalogue::{CompensationAction, PlannedCompensation};
use provledger_events::trace::{TraceContext, TRACEPARENT};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use uuid::Uuid;

/// The trace a request to an executor or a worker is sent in: the context it carries as
/// its `traceparent` header (`sent`: the entity's trace under a span id of this request's
/// own) and the context it continues (`parent`: the one the entity's commits recorded).
/// A span exporter reports the request as span `sent` with parent `parent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestTrace {
    pub sent: TraceContext,
    pub parent: TraceContext,
}

impl RequestTrace {
    /// A request continuing `parent` under a fresh random span id.
    pub fn continuing(parent: TraceContext) -> RequestTrace {
        let random = Uuid::new_v4();
        let mut span_id = [0u8; 8];
        span_id.copy_from_slice(&random.as_bytes()[..8]);
        // A v4 UUID's byte 6 holds its version nibble (4): its first 8 bytes are never all
        // zero, the one span id `with_span` refuses.
        let sent = parent
            .with_span(span_id)
            .expect("the first 8 bytes of a v4 UUID are not all zero");
        RequestTrace { sent, parent }
    }

    /// The request under another span id (a span exporter's own), same trace and parent.
    pub fn with_sent_span(self, span_id: [u8; 8]) -> RequestTrace {
        RequestTrace {
            sent: self.sent.with_span(span_id).unwrap_or(self.sent),
            parent: self.parent,
        }
    }
}

/// The JSON request an executor receives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CompensationRequest {
    pub operation_id: Uuid,
    pub compensation_id: Uuid,
    pub attempt: u32,
    pub action: CompensationAction,
    pub resource: String,
    pub args: BTreeMap<String, String>,
    /// Sent as the `traceparent` header, not in the body.
    #[serde(skip)]
    pub trace: Option<RequestTrace>,
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
            trace: None,
        }
    }

    /// The request continuing the operation's trace (`None`: it has none).
    pub fn with_trace(mut self, operation_trace: Option<TraceContext>) -> Self {
        self.trace = operation_trace.map(RequestTrace::continuing);
        self
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
            let trace = request.trace.map(|t| t.sent);
            request_ok(&self.client, subject, request, trace, self.reply_wait).await
        })
    }
}

/// One request to a service that answers `{"ok": true}` or `{"ok": false, "error": ...}`
/// (executors, workers), bounded by `reply_wait`, with a `traceparent` header when it is
/// sent in a trace.
pub(crate) async fn request_ok<T: Serialize>(
    client: &async_nats::Client,
    subject: String,
    request: &T,
    trace: Option<TraceContext>,
    reply_wait: Duration,
) -> Result<(), PeerError> {
    // The requests are plain serde structs: encoding them cannot fail.
    let body = serde_json::to_vec(request).expect("a request encodes as JSON");
    // Untraced requests go without headers, as they always have.
    let sent = match trace {
        Some(trace) => {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(TRACEPARENT, trace.to_string().as_str());
            futures::future::Either::Left(client.request_with_headers(
                subject.clone(),
                headers,
                body.into(),
            ))
        }
        None => futures::future::Either::Right(client.request(subject.clone(), body.into())),
    };
    let reply = tokio::time::timeout(reply_wait, sent)
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
