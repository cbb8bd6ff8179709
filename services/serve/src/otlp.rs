//! Span export over OTLP/HTTP (protobuf), when configured (`--otlp-endpoint URL` or
//! `OTEL_EXPORTER_OTLP_ENDPOINT`; off by default, and then nothing here runs).
//!
//! Spans, all under resource `service.name=provledger-serve`:
//! - `cmd.append` (server): one per append request, child of the caller's `traceparent`
//!   when it sent one; the commits it writes record this span's context (format 3), so
//!   everything done later on their behalf joins the caller's trace;
//! - `compensation.request` (client): one per compensation requested from an executor,
//!   from the request to its reply, child of the operation's recorded trace; the executor
//!   gets this span as its `traceparent`;
//! - `reissue.request` (client): the same for a task re-issued to a worker.
//!
//! The OpenTelemetry SDK makes the spans and the OTLP exporter encodes and sends them.
//! What carries them between the two is this module's, because it must never hold serve
//! up: a bounded queue ([`SPAN_QUEUE_MAX`]) that an ended span is put on without waiting
//! (dropped and counted when full), one task that sends batches of at most
//! [`EXPORT_BATCH_SPANS_MAX`] every export interval, each bounded by [`EXPORT_TIMEOUT`]
//! (a dead or slow collector loses those spans, counted, and a warning at most once per
//! [`WARN_INTERVAL`]). The HTTP client is HTTP/1.1 on the hyper already in the tree
//! (opentelemetry-http's own turns on HTTP/2 and its h2 stack, which OTLP/HTTP does not
//! need); `https` is refused at start for the same reason (no TLS stack is built in: run
//! a collector or agent with a plain-HTTP receiver beside serve).

use std::time::Duration;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider, SpanData, SpanExporter as _};
use provledger_client::recovery::{NatsReissuer, ReissueFuture, ReissueRequest, Reissuer};
use provledger_client::{
    CompensationExecutor, CompensationFuture, CompensationRequest, NatsExecutors, RequestTrace,
};
use provledger_events::TraceContext;
use tokio::sync::mpsc;

use crate::metrics::SpanMetrics;

/// Ended spans waiting for export; past it, a span is dropped (and counted).
pub const SPAN_QUEUE_MAX: usize = 4096;
/// Spans sent in one OTLP request.
pub const EXPORT_BATCH_SPANS_MAX: usize = 512;
/// Longest one export may take (connect, send, the collector's answer).
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often spans are sent by default (`--otlp-export-interval`).
pub const EXPORT_INTERVAL_DEFAULT: Duration = Duration::from_secs(2);
/// At most one warning about lost spans per this interval.
pub const WARN_INTERVAL: Duration = Duration::from_secs(60);
/// Longest endpoint URL taken.
pub const ENDPOINT_BYTES_MAX: usize = 2048;
/// Largest collector answer read (OTLP answers are a few bytes; a partial success a few
/// hundred).
const ANSWER_BYTES_MAX: usize = 64 * 1024;
/// The path OTLP/HTTP appends to the endpoint for spans.
const TRACES_PATH: &str = "/v1/traces";
/// The resource's `service.name` and the instrumentation scope.
pub const SERVICE_NAME: &str = "provledger-serve";

const _: () = assert!(EXPORT_BATCH_SPANS_MAX <= SPAN_QUEUE_MAX);

/// Where and how often spans are exported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpOptions {
    /// The collector's OTLP/HTTP base URL (`http://host:4318`); spans go to
    /// `<endpoint>/v1/traces`.
    pub endpoint: String,
    pub export_interval: Duration,
}

/// Why span export could not be set up: serve does not start.
#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    #[error("--otlp-endpoint {endpoint:?}: {reason}; give the collector's OTLP/HTTP base URL, e.g. http://127.0.0.1:4318")]
    BadEndpoint { endpoint: String, reason: String },
    #[error("cannot build the OTLP span exporter: {0}")]
    Exporter(String),
}

/// The URL spans are sent to, checked: `http://host[:port][/path]`, bounded, no query.
pub fn traces_url(endpoint: &str) -> Result<http::Uri, OtlpError> {
    let bad = |reason: &str| OtlpError::BadEndpoint {
        endpoint: endpoint.chars().take(200).collect(),
        reason: reason.into(),
    };
    if endpoint.len() > ENDPOINT_BYTES_MAX {
        return Err(bad(&format!("longer than {ENDPOINT_BYTES_MAX} bytes")));
    }
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&format!("not a URL ({e})")))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(bad(
                "https is not supported (serve builds no TLS stack); use a collector or agent's plain-HTTP receiver",
            ))
        }
        _ => return Err(bad("not an http:// URL")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    // `Uri` keeps the port as text; a number past 65535 only fails when connecting.
    let authority = uri.authority().map_or("", |a| a.as_str());
    if let Some((_, port)) = authority
        .rsplit_once(':')
        .filter(|_| !authority.ends_with(']'))
    {
        if port.parse::<u16>().is_err() {
            return Err(bad("the port is not a number from 0 to 65535"));
        }
    }
    if uri.query().is_some() {
        return Err(bad("a query string is not part of an OTLP endpoint"));
    }
    let base = endpoint.trim_end_matches('/');
    format!("{base}{TRACES_PATH}")
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&format!("not a URL with {TRACES_PATH} ({e})")))
}

/// serve's spans: made by the SDK, exported by the task [`Spans::start`] spawned. Cheap to
/// clone.
#[derive(Clone, Debug)]
pub(crate) struct Spans {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
}

/// A started span; it ends (and goes on the export queue) when dropped.
pub(crate) struct ActiveSpan(opentelemetry_sdk::trace::Span);

impl Spans {
    /// Checks the endpoint and starts the export task (on the current tokio runtime).
    fn start(options: &OtlpOptions, metrics: SpanMetrics) -> Result<Export, OtlpError> {
        let url = traces_url(&options.endpoint)?;
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(SERVICE_NAME)
            .build();
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Http1Client::new())
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(url.to_string())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| OtlpError::Exporter(e.to_string()))?;
        exporter.set_resource(&resource);
        let (queue, spans) = mpsc::channel(SPAN_QUEUE_MAX);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(export(
            spans,
            exporter,
            options.export_interval,
            metrics.clone(),
            stopped,
        ));
        let provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_span_processor(Queue { queue, metrics })
            .build();
        let tracer = provider.tracer(SERVICE_NAME);
        Ok(Export {
            spans: Spans { tracer, provider },
            stop,
            task,
        })
    }

    /// A span named `name`, child of `parent` (a context from another process: a caller's
    /// `traceparent`, or one a commit recorded), or a new trace without one.
    pub(crate) fn start_span(
        &self,
        name: &'static str,
        kind: SpanKind,
        parent: Option<TraceContext>,
        attributes: Vec<KeyValue>,
    ) -> ActiveSpan {
        let context = match parent {
            Some(p) => opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(p.trace_id()),
                SpanId::from_bytes(p.span_id()),
                TraceFlags::new(p.flags()),
                true,
                TraceState::default(),
            )),
            None => opentelemetry::Context::new(),
        };
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &context);
        ActiveSpan(span)
    }
}

impl ActiveSpan {
    /// This span's context: what the commits it writes record and what a request it
    /// makes carries. `None` only for an invalid one (the SDK's ids are never all zero).
    pub(crate) fn context(&self) -> Option<TraceContext> {
        let sc = self.0.span_context();
        TraceContext::new(
            sc.trace_id().to_bytes(),
            sc.span_id().to_bytes(),
            sc.trace_flags().to_u8(),
        )
    }

    pub(crate) fn set(&mut self, attribute: KeyValue) {
        self.0.set_attribute(attribute);
    }

    pub(crate) fn fail(&mut self, message: String) {
        self.0.set_status(Status::error(message));
    }
}

/// The SDK's span processor: each ended span onto the bounded queue, never waiting.
#[derive(Debug)]
struct Queue {
    queue: mpsc::Sender<SpanData>,
    metrics: SpanMetrics,
}

impl opentelemetry_sdk::trace::SpanProcessor for Queue {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if self.queue.try_send(span).is_err() {
            self.metrics.dropped.inc();
        }
    }

    fn force_flush(&self) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> opentelemetry_sdk::error::OTelSdkResult {
        Ok(())
    }
}

/// The export task: a batch off the queue every `interval` (or as soon as it is full),
/// each export bounded by [`EXPORT_TIMEOUT`]; on `stop`, what the queue holds is sent and
/// the task ends.
async fn export(
    mut spans: mpsc::Receiver<SpanData>,
    exporter: opentelemetry_otlp::SpanExporter,
    interval: Duration,
    metrics: SpanMetrics,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut batch: Vec<SpanData> = Vec::with_capacity(EXPORT_BATCH_SPANS_MAX);
    let mut warnings = Warnings::default();
    loop {
        let last = tokio::select! {
            span = spans.recv() => match span {
                Some(span) => {
                    batch.push(span);
                    if batch.len() < EXPORT_BATCH_SPANS_MAX {
                        continue;
                    }
                    false
                }
                None => true,
            },
            _ = ticks.tick() => false,
            _ = &mut stop => true,
        };
        if last {
            // Bounded by the queue's size: nothing is added once `stop` is sent (the
            // provider is shut down first).
            while let Ok(span) = spans.try_recv() {
                batch.push(span);
            }
        }
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(EXPORT_BATCH_SPANS_MAX));
            let sent = std::mem::replace(&mut batch, rest);
            send(&exporter, sent, &metrics, &mut warnings).await;
            if !last {
                break;
            }
        }
        if last {
            return;
        }
    }
}

/// When the last warning about lost spans was logged, and what was lost since.
#[derive(Default)]
struct Warnings {
    last: Option<tokio::time::Instant>,
    lost: u64,
}

/// One OTLP request, bounded by [`EXPORT_TIMEOUT`]; a failure is counted and warned about
/// at most once per [`WARN_INTERVAL`].
async fn send(
    exporter: &opentelemetry_otlp::SpanExporter,
    batch: Vec<SpanData>,
    metrics: &SpanMetrics,
    warnings: &mut Warnings,
) {
    let count = batch.len() as u64;
    let error = match tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(batch)).await {
        Ok(Ok(())) => {
            metrics.exported.inc_by(count);
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(_) => format!("no answer within {EXPORT_TIMEOUT:?}"),
    };
    metrics.failed.inc_by(count);
    warnings.lost += count;
    let now = tokio::time::Instant::now();
    if warnings
        .last
        .is_none_or(|at| now.duration_since(at) >= WARN_INTERVAL)
    {
        tracing::warn!(%error, spans_lost = warnings.lost, "OTLP span export failed: those spans are dropped and serve goes on (at most one such warning a minute)");
        warnings.last = Some(now);
        warnings.lost = 0;
    }
}

/// OTLP/HTTP over HTTP/1.1 on hyper, each request bounded by [`EXPORT_TIMEOUT`] and its
/// answer by [`ANSWER_BYTES_MAX`].
#[derive(Debug, Clone)]
struct Http1Client {
    inner: hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
}

impl Http1Client {
    fn new() -> Self {
        let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
        connector.set_connect_timeout(Some(EXPORT_TIMEOUT));
        Http1Client {
            inner:
                hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                    .build(connector),
        }
    }
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for Http1Client {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        use http_body_util::BodyExt as _;
        let (parts, body) = request.into_parts();
        let request = http::Request::from_parts(parts, http_body_util::Full::new(body));
        tokio::time::timeout(EXPORT_TIMEOUT, async {
            let response = self.inner.request(request).await?;
            let (parts, body) = response.into_parts();
            let body = http_body_util::Limited::new(body, ANSWER_BYTES_MAX)
                .collect()
                .await?
                .to_bytes();
            Ok(http::Response::from_parts(parts, body))
        })
        .await
        .map_err(|_| format!("no answer within {EXPORT_TIMEOUT:?}"))?
    }
}

/// Compensation requests with a span each, when the operation is traced: the executor
/// gets the span as its `traceparent`.
pub(crate) struct TracedExecutors {
    pub(crate) inner: NatsExecutors,
    pub(crate) spans: Spans,
}

impl CompensationExecutor for TracedExecutors {
    fn compensate<'a>(
        &'a self,
        executor: &'a str,
        request: &'a CompensationRequest,
    ) -> CompensationFuture<'a> {
        Box::pin(async move {
            let Some(trace) = request.trace else {
                return self.inner.compensate(executor, request).await;
            };
            let (mut span, sent_trace) = request_span(
                &self.spans,
                "compensation.request",
                trace,
                NatsExecutors::subject(&self.inner.subject_prefix, executor),
                [
                    KeyValue::new("provledger.operation_id", request.operation_id.to_string()),
                    KeyValue::new(
                        "provledger.compensation_id",
                        request.compensation_id.to_string(),
                    ),
                    KeyValue::new("provledger.attempt", i64::from(request.attempt)),
                ],
            );
            let sent = CompensationRequest {
                trace: Some(sent_trace),
                ..request.clone()
            };
            let outcome = self.inner.compensate(executor, &sent).await;
            record_outcome(&mut span, &outcome);
            outcome
        })
    }
}

/// Re-issue requests with a span each, when the instance is traced.
pub(crate) struct TracedReissuer {
    pub(crate) inner: NatsReissuer,
    pub(crate) spans: Spans,
}

impl Reissuer for TracedReissuer {
    fn reissue<'a>(&'a self, worker: &'a str, request: &'a ReissueRequest) -> ReissueFuture<'a> {
        Box::pin(async move {
            let Some(trace) = request.trace else {
                return self.inner.reissue(worker, request).await;
            };
            let (mut span, sent_trace) = request_span(
                &self.spans,
                "reissue.request",
                trace,
                NatsReissuer::subject(&self.inner.subject_prefix, worker),
                [
                    KeyValue::new("provledger.instance_id", request.instance_id.to_string()),
                    KeyValue::new("provledger.request_id", request.request_id.to_string()),
                    KeyValue::new("provledger.attempt", i64::from(request.attempt)),
                ],
            );
            let sent = ReissueRequest {
                trace: Some(sent_trace),
                ..request.clone()
            };
            let outcome = self.inner.reissue(worker, &sent).await;
            record_outcome(&mut span, &outcome);
            outcome
        })
    }
}

/// The client span of a request to a peer on `subject`, in the caller's trace (`trace`'s
/// parent), and the trace the request then carries: this span as the peer's parent, or the
/// request's own span id when the span is not recorded.
fn request_span(
    spans: &Spans,
    name: &'static str,
    trace: RequestTrace,
    subject: String,
    attributes: impl IntoIterator<Item = KeyValue>,
) -> (ActiveSpan, RequestTrace) {
    let mut all = vec![
        KeyValue::new("messaging.system", "nats"),
        KeyValue::new("messaging.destination.name", subject),
    ];
    all.extend(attributes);
    let span = spans.start_span(name, SpanKind::Client, Some(trace.parent), all);
    let sent = match span.context() {
        Some(context) => trace.with_sent_span(context.span_id()),
        None => trace,
    };
    (span, sent)
}

/// The reply on the request's span: `provledger.outcome` `done`, `refused`, `unreachable`
/// or `bad_reply`, and an error status with the reason for the last three.
fn record_outcome(span: &mut ActiveSpan, outcome: &Result<(), provledger_client::PeerError>) {
    use provledger_client::PeerError;
    let word = match outcome {
        Ok(()) => "done",
        Err(PeerError::Refused(_)) => "refused",
        Err(PeerError::Unreachable(_)) => "unreachable",
        Err(PeerError::BadReply(_)) => "bad_reply",
    };
    span.set(KeyValue::new("provledger.outcome", word));
    if let Err(e) = outcome {
        span.fail(e.to_string());
    }
}

/// serve's span export while it runs: the spans its parts clone, and the export task.
pub(crate) struct Export {
    pub(crate) spans: Spans,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Export {
    pub(crate) fn start(options: &OtlpOptions, metrics: SpanMetrics) -> Result<Export, OtlpError> {
        Spans::start(options, metrics)
    }

    /// Ends span making, sends what the queue holds (each batch bounded by the export
    /// timeout, the whole by `EXPORT_TIMEOUT` times the batches a full queue makes) and
    /// stops the task.
    pub(crate) async fn stop(self) {
        let Export { spans, stop, task } = self;
        if let Err(e) = spans.provider.shutdown() {
            tracing::debug!(error = %e, "span provider shutdown");
        }
        let _ = stop.send(());
        let batches = SPAN_QUEUE_MAX.div_ceil(EXPORT_BATCH_SPANS_MAX) as u32 + 1;
        if tokio::time::timeout(EXPORT_TIMEOUT * batches, task)
            .await
            .is_err()
        {
            tracing::warn!("OTLP span export still busy at shutdown; the rest is dropped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_endpoints_when_checked_then_garbage_is_refused_with_the_reason() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap().to_string(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://collector:4318/otlp/")
                .unwrap()
                .to_string(),
            "http://collector:4318/otlp/v1/traces"
        );
        for (bad, why) in [
            ("", "not"),
            ("not a url", "not"),
            ("127.0.0.1:4318", "http://"),
            ("ftp://x:1", "http://"),
            ("https://collector:4318", "https is not supported"),
            ("http://x:4318/?a=b", "query"),
            ("http://x:99999", "port"),
            ("http://user@x:99999", "port"),
        ] {
            let err = traces_url(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
        let long = format!("http://x/{}", "a".repeat(ENDPOINT_BYTES_MAX));
        assert!(traces_url(&long)
            .unwrap_err()
            .to_string()
            .contains("longer"));
    }
}
