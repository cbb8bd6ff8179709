//! serve's trace across an operation's life, exported over OTLP/HTTP to a collector
//! stand-in (a small HTTP/1.1 server in this test that decodes the protobuf requests with
//! `opentelemetry-proto`), against a real nats-server and a serve process:
//! - an operation written through `cmd.append` under a caller's `traceparent` fails and
//!   serve rolls it back through an executor on NATS: the commits record the trace, the
//!   executor gets a `traceparent` in it, and the spans from the `cmd.append` to the
//!   compensation's reply share one trace id;
//! - a collector that never answers does not hold serve's appends up;
//! - a task re-issued to a worker continues the trace of the one it replaces;
//! - a garbage endpoint stops serve at start with a usage error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;
use provledger_tests::NatsServer;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use uuid::Uuid;

use crate::common;
use crate::common::{wait_ready, Serve};

/// The caller's trace: the W3C specification's example.
const CALLER_TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN_ID: &str = "00f067aa0ba902b7";
/// A body larger than this is not an OTLP request of this test.
const BODY_BYTES_MAX: usize = 4 << 20;

/// One exported span as the collector received it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    attributes: HashMap<String, String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The collector stand-in: answers each `POST /v1/traces` with 200 and an empty
/// `ExportTraceServiceResponse`, keeping every span it decoded (keep-alive connections,
/// several requests each).
async fn collector() -> (u16, Arc<Mutex<Vec<Received>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let spans = Arc::new(Mutex::new(Vec::new()));
    let kept = spans.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                while let Some(body) = read_request(&mut stream).await {
                    if let Ok(request) = ExportTraceServiceRequest::decode(body.as_slice()) {
                        kept.lock().expect("spans").extend(spans_of(request));
                    }
                    let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if stream.get_mut().write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, spans)
}

/// One HTTP/1.1 request's body (by `content-length`), `None` at the connection's end.
async fn read_request(stream: &mut BufReader<tokio::net::TcpStream>) -> Option<Vec<u8>> {
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        if stream.read_line(&mut line).await.ok()? == 0 || line.len() > 8192 {
            return None;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().ok()?;
            }
        }
    }
    if length > BODY_BYTES_MAX {
        return None;
    }
    let mut body = vec![0; length];
    stream.read_exact(&mut body).await.ok()?;
    Some(body)
}

fn spans_of(request: ExportTraceServiceRequest) -> Vec<Received> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
    let text = |v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>| match v
        .as_ref()
        .and_then(|v| v.value.as_ref())
    {
        Some(Any::StringValue(s)) => s.clone(),
        Some(Any::IntValue(i)) => i.to_string(),
        other => format!("{other:?}"),
    };
    let mut out = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .map(|a| text(&a.value))
            .unwrap_or_default();
        for scope in resource_spans.scope_spans {
            for span in scope.spans {
                out.push(Received {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    attributes: span
                        .attributes
                        .iter()
                        .map(|a| (a.key.clone(), text(&a.value)))
                        .collect(),
                });
            }
        }
    }
    out
}

/// A peer on NATS that refuses nothing: every request on `subject` answered `ok`, each
/// request's `traceparent` header (or `None`) kept with its body. The `ipam` executor's
/// compensations, or a worker's re-issues.
async fn answering_ok(
    client: &async_nats::Client,
    subject: String,
) -> Arc<Mutex<Vec<(Option<String>, Value)>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut sub = client.subscribe(subject).await.expect("subscribe");
    provledger_tests::subscriptions_in_effect(client).await;
    let (client, kept) = (client.clone(), seen.clone());
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let traceparent = msg
                .headers
                .as_ref()
                .and_then(|h| h.get("traceparent"))
                .map(|v| v.as_str().to_string());
            let body: Value = serde_json::from_slice(&msg.payload).unwrap_or(Value::Null);
            kept.lock().expect("requests").push((traceparent, body));
            if let Some(to) = msg.reply {
                let _ = client
                    .publish(to, json!({"ok": true}).to_string().into())
                    .await;
            }
        }
    });
    seen
}

/// `cmd.append` with a `traceparent` header; the reply's JSON.
async fn append(client: &async_nats::Client, traceparent: &str, body: Value) -> Value {
    append_within(client, traceparent, body, Duration::from_secs(10)).await
}

/// [`append`] whose answer must come before `deadline`.
async fn append_within(
    client: &async_nats::Client,
    traceparent: &str,
    body: Value,
    deadline: Duration,
) -> Value {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("traceparent", traceparent);
    let reply = tokio::time::timeout(
        deadline,
        client.request_with_headers("provledger.cmd.append", headers, body.to_string().into()),
    )
    .await
    .unwrap_or_else(|_| panic!("cmd.append did not answer within {deadline:?}"))
    .expect("cmd.append");
    serde_json::from_slice(&reply.payload).expect("JSON")
}

/// The four commits of an operation whose `acquire_ip` step failed after it started:
/// its rollback asks IPAM to release whatever it holds under the step's key.
fn failing_operation(op: Uuid) -> Vec<Value> {
    let aggregate = format!("operation/{op}");
    let target = format!("instance/{}", Uuid::now_v7());
    vec![
        json!({"aggregate": aggregate, "expect": "none", "operation_id": op, "events": [
            {"operation_started": {"kind": "boot_instance", "target": target, "parent_id": null,
             "stages": [{"name": "network", "policy": "compensate"}], "bundle_policy": null}}]}),
        json!({"aggregate": aggregate, "expect": 1, "operation_id": op, "events": [
            {"stage_started": {"stage": "network"}}]}),
        json!({"aggregate": aggregate, "expect": 2, "operation_id": op, "events": [
            {"step_started": {"stage": "network", "step": "acquire_ip:node-1", "executor": "ipam",
             "idempotency_key": "key-1",
             "compensation": {"action": "release_ip", "executor": {"service": "ipam"},
                              "resource": "", "args": {"idempotency_key": "key-1"}}}}]}),
        json!({"aggregate": aggregate, "expect": 3, "operation_id": op, "events": [
            {"operation_failed": {"stage": "network", "step": "acquire_ip:node-1",
             "error": "ipam: no free address"}}]}),
    ]
}

/// Waits until `check` holds, polling every 50 ms up to `timeout`.
async fn eventually<T>(what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(found) = check() {
            return found;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A nats-server, and serve on it (with `extra` flags) exporting its spans every 100 ms to
/// a collector: the server, serve's data dir and process, what the collector received, and
/// a ready client.
async fn serve_exporting(
    extra: &[&str],
) -> (
    NatsServer,
    tempfile::TempDir,
    Serve,
    Arc<Mutex<Vec<Received>>>,
    async_nats::Client,
) {
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let (port, spans) = collector().await;
    let endpoint = format!("http://127.0.0.1:{port}");
    let mut args = vec![
        "--otlp-endpoint",
        &endpoint,
        "--otlp-export-interval",
        "100ms",
    ];
    args.extend_from_slice(extra);
    let serve = Serve::start_with(&nats, &tmp.path().join("serve"), &args);
    let client = nats.client().await;
    wait_ready(&client).await;
    (nats, tmp, serve, spans, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failed_operation_rolled_back_through_an_executor_is_one_trace() {
    // Given a collector, an IPAM executor on NATS, and serve exporting spans to the one...
    let (_nats, _tmp, _serve, spans, client) =
        serve_exporting(&["--compensation-backoff-ms", "50"]).await;
    let executor = answering_ok(&client, "provledger.exec.ipam.compensate".into()).await;

    // ...when a caller writes an operation under its trace and the operation fails...
    let caller = format!("00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01");
    let op = Uuid::now_v7();
    for request in failing_operation(op) {
        let reply = append(&client, &caller, request).await;
        assert!(reply.get("error").is_none(), "{reply}");
    }

    // ...then serve rolls it back through IPAM, whose request carries the caller's trace
    // under a span of serve's own...
    let (traceparent, body) =
        eventually("the compensation request", Duration::from_secs(20), || {
            executor.lock().expect("requests").first().cloned()
        })
        .await;
    assert_eq!(body["action"], "release_ip", "{body}");
    let traceparent = traceparent.expect("the compensation request has a traceparent");
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent}");
    assert_eq!(parts[1], CALLER_TRACE_ID, "{traceparent}");
    assert_ne!(parts[2], CALLER_SPAN_ID, "{traceparent}");

    // ...the operation's commits record the trace (q.history shows each `traceparent`)...
    let history = client
        .request(
            "provledger.q.history",
            json!({"aggregate": format!("operation/{op}")})
                .to_string()
                .into(),
        )
        .await
        .expect("q.history");
    let history: Value = serde_json::from_slice(&history.payload).expect("JSON");
    let commits = history["data"].as_array().expect("commits");
    let recorded: Vec<String> = commits[..4]
        .iter()
        .map(|c| c["traceparent"].as_str().unwrap_or("none").to_string())
        .collect();
    assert!(
        recorded.iter().all(|t| t.contains(CALLER_TRACE_ID)),
        "{recorded:?}"
    );

    // ...and the collector holds the spans from each cmd.append to the compensation's
    // reply, all in the caller's trace: the appends children of the caller's span, the
    // request a child of the append that failed the operation, and the span IPAM got.
    let request = eventually("the compensation span", Duration::from_secs(20), || {
        let spans = spans.lock().expect("spans");
        spans
            .iter()
            .find(|s| s.name == "compensation.request")
            .cloned()
    })
    .await;
    let spans = spans.lock().expect("spans").clone();
    let appends: Vec<&Received> = spans.iter().filter(|s| s.name == "cmd.append").collect();
    assert_eq!(appends.len(), 4, "{spans:#?}");
    for span in appends.iter().copied().chain([&request]) {
        assert_eq!(span.trace_id, CALLER_TRACE_ID, "{span:?}");
        assert_eq!(span.service, "provledger-serve", "{span:?}");
    }
    assert!(appends.iter().all(|s| s.parent_span_id == CALLER_SPAN_ID));
    let failing = recorded[3]
        .split('-')
        .nth(2)
        .expect("a span id")
        .to_string();
    assert!(appends.iter().any(|s| s.span_id == failing), "{appends:#?}");
    assert_eq!(request.parent_span_id, failing, "{request:?}");
    assert_eq!(
        request.span_id, parts[2],
        "the span IPAM was sent is the exported one"
    );
    assert_eq!(
        request
            .attributes
            .get("provledger.outcome")
            .map(String::as_str),
        Some("done"),
        "{request:?}"
    );
    assert_eq!(
        request.attributes.get("provledger.operation_id"),
        Some(&op.to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_does_not_hold_serve_up() {
    // Given a collector that takes connections and never answers...
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = held.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            keep.lock().expect("held").push(stream);
        }
    });
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let endpoint = format!("http://127.0.0.1:{port}");
    let _serve = Serve::start_with(
        &nats,
        &tmp.path().join("serve"),
        &[
            "--otlp-endpoint",
            &endpoint,
            "--otlp-export-interval",
            "10ms",
        ],
    );
    let client = nats.client().await;
    wait_ready(&client).await;
    let started = |i: usize| {
        // Every other one with a hostile traceparent, which is ignored.
        let traceparent = if i.is_multiple_of(2) {
            format!("00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01")
        } else {
            "00-\u{1b}[2J-<script>-01".to_string()
        };
        let body = json!({"aggregate": format!("operation/{}", Uuid::now_v7()), "expect": "none",
               "events": [{"operation_started": {"kind": "boot_instance",
               "target": format!("instance/{}", Uuid::now_v7()), "parent_id": null,
               "stages": [{"name": "a", "policy": "compensate"}], "bundle_policy": null}}]});
        (traceparent, body)
    };
    // ...once an export hangs on it (traced appends until serve has connected)...
    let mut i = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while held.lock().expect("held").is_empty() {
        assert!(Instant::now() < deadline, "serve never tried the collector");
        let (traceparent, body) = started(i);
        let reply = append(&client, &traceparent, body).await;
        assert!(reply.get("error").is_none(), "{reply}");
        i += 1;
    }
    // ...when traced appends keep coming, then each is answered before a deadline shorter
    // than serve's export timeout (5 s): none waits for the hanging export.
    for i in i..i + 20 {
        let (traceparent, body) = started(i);
        let reply = append_within(&client, &traceparent, body, Duration::from_secs(4)).await;
        assert!(reply.get("error").is_none(), "{reply}");
    }
}

#[test]
fn a_garbage_otlp_endpoint_stops_serve_at_start_with_a_usage_error() {
    for endpoint in ["not a url", "https://collector:4318", "http://x:99999"] {
        let out = common::provledger(
            &[
                "--nats",
                "nats://127.0.0.1:1",
                "serve",
                "--otlp-endpoint",
                endpoint,
            ],
            "",
        );
        let text = common::text(&out);
        assert_eq!(out.status.code(), Some(2), "{endpoint}: {text}");
        assert!(text.contains("--otlp-endpoint"), "{endpoint}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reissue_continues_the_trace_of_the_task_it_replaces() {
    // Given a collector, worker w1 on NATS and serve sweeping every second...
    let (_nats, _tmp, _serve, spans, client) = serve_exporting(&["--recovery-interval", "1"]).await;
    let w1 = answering_ok(&client, "provledger.worker.w1.reissue".into()).await;
    // ...when w1 records, under the caller's trace, a power-off whose lease runs out...
    let lease_until = provledger_events::Timestamp::from_unix_ms(
        provledger_events::Timestamp::now().unix_ms() + 2_000,
    );
    let caller = format!("00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01");
    let reply = append(
        &client,
        &caller,
        json!({"aggregate": format!("instance/{}", Uuid::now_v7()), "expect": "none", "events": [
            {"instance_create_requested": {"name": "vm", "cluster_id": null, "node_group": null,
                "flavor": "m1", "resources": {"VCPU": 1}, "image": "img"}},
            {"task_finished": {"task_state": "scheduling", "outcome": "succeeded", "reason": ""}},
            {"vm_state_changed": {"vm_state": "active", "reason": ""}},
            {"task_started": {"task_state": "powering_off", "worker_id": "w1",
                              "lease_until": lease_until.to_string()}}]}),
    )
    .await;
    assert!(reply.get("error").is_none(), "{reply}");
    // ...then the re-issue w1 gets is in that trace, under serve's span, which the
    // collector has.
    let traceparent = eventually("the re-issue", Duration::from_secs(20), || {
        w1.lock()
            .expect("requests")
            .first()
            .map(|(traceparent, _)| traceparent.clone())
    })
    .await
    .expect("the re-issue has a traceparent");
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.get(1), Some(&CALLER_TRACE_ID), "{traceparent}");
    let span = eventually("the reissue span", Duration::from_secs(20), || {
        let spans = spans.lock().expect("spans");
        spans.iter().find(|s| s.name == "reissue.request").cloned()
    })
    .await;
    assert_eq!(span.trace_id, CALLER_TRACE_ID, "{span:?}");
    assert_eq!(
        Some(span.span_id.as_str()),
        parts.get(2).copied(),
        "{span:?}"
    );
    assert_eq!(
        span.attributes
            .get("provledger.outcome")
            .map(String::as_str),
        Some("done")
    );
}
