//! The operator on call, against a private nats-server and `provledger serve` as a child
//! process: a rollback whose compensations keep failing ends `needs_attention`, and the
//! operator finds it three ways: in the Prometheus metrics (scraped over HTTP), in
//! `operation list --status needs_attention`, and in `audit` (exit 1, naming it). Also:
//! serve's logs as JSON carry a caller's W3C trace id with the commits it produced, and a
//! serve that loses NATS says it is not ready (ready file gone, `/health` 503) until NATS
//! is back.

use std::time::{Duration, Instant};

use provledger_tests::{free_port, NatsServer};
use uuid::Uuid;

use crate::common;
use crate::common::{http_get, provledger, sample, text, wait_ready, Serve};

async fn eventually<F: FnMut() -> bool>(what: &str, timeout: Duration, mut check: F) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_that_needs_attention_is_in_the_metrics_the_worklist_and_the_audit() {
    // Given serve with a metrics listener and a budget of two attempts per compensation...
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let metrics_addr = format!("127.0.0.1:{port}");
    let mut serve = Serve::start_with(
        &nats,
        &dir.path().join("serve"),
        &[
            "--metrics-addr",
            &metrics_addr,
            "--compensation-attempts-max",
            "2",
            "--compensation-backoff-ms",
            "20",
            "--compensation-reply-wait-ms",
            "3000",
            "--drift-interval",
            "1s",
        ],
    );
    // ...and executors on NATS that fail every compensation...
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    for executor in [&infra.ipam, &infra.dhcp, &infra.dns, &infra.hypervisor] {
        executor.fail_compensations(1_000);
    }
    wait_ready(&client).await;
    let scrape = || {
        http_get(port, "/metrics")
            .map(|(_, body)| body)
            .unwrap_or_default()
    };
    assert_eq!(
        sample(
            &scrape(),
            "provledger_operations{status=\"needs_attention\"}"
        ),
        Some(0.0),
        "nothing needs attention yet, and the series exists"
    );

    // ...when a create fails after making VMs, and serve drives its rollback...
    let op = common::fail_a_create(&client, &ledger, &infra, provider)
        .await
        .to_string();

    // Then the metrics show it in needs_attention, with the failed attempts counted...
    eventually(
        "needs_attention in the metrics",
        Duration::from_secs(60),
        || {
            sample(
                &scrape(),
                "provledger_operations{status=\"needs_attention\"}",
            ) == Some(1.0)
        },
    )
    .await;
    // ...and the drift sweep has looked at the executors the failed create named (its
    // series exist once a sweep has asked them: the alert's metric is real)...
    eventually(
        "a drift sweep in the metrics",
        Duration::from_secs(30),
        || scrape().contains("provledger_drift_findings{executor=\"hypervisor\""),
    )
    .await;
    let metrics = scrape();
    assert!(
        sample(
            &metrics,
            "provledger_compensation_events_total{outcome=\"failed\"}"
        )
        .is_some_and(|n| n >= 2.0),
        "{metrics}"
    );
    assert_eq!(sample(&metrics, "provledger_ready"), Some(1.0), "{metrics}");
    assert_alert_rules_name_real_metrics(&metrics);
    assert_eq!(
        sample(&metrics, "provledger_consumers_held"),
        Some(1.0),
        "{metrics}"
    );

    // ...`operation list --status needs_attention` finds it, over NATS and offline...
    let url = nats.url();
    let listed = needing_attention(&["--nats", &url]);
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["id"], serde_json::json!(op), "{listed}");
    let out = provledger(
        &["--nats", &url, "operation", "list", "--status", "running"],
        "",
    );
    assert!(!text(&out).contains(&op), "{}", text(&out));
    // (Each of those requests is in the latency histogram of its endpoint.)
    let metrics = scrape();
    assert_eq!(
        sample(
            &metrics,
            "provledger_request_duration_seconds_count{endpoint=\"q.operation.list\"}"
        ),
        Some(2.0),
        "{metrics}"
    );

    // ...and `audit` exits 1 naming it, with what remains and what to do.
    let out = provledger(&["--nats", &url, "audit"], "");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    assert!(said.contains("needs_attention"), "{said}");
    assert!(said.contains(&op), "{said}");
    assert!(said.contains("rollback run"), "{said}");

    // And once stopped, the service's data dir lists it offline too.
    assert!(serve.terminate().success());
    let data = dir.path().join("serve");
    let listed = needing_attention(&["--data-dir", data.to_str().unwrap()]);
    assert_eq!(listed[0]["id"], serde_json::json!(op), "{listed}");
}

/// Every metric an expression of `deploy/prometheus/alerts.yml` names is one serve exports
/// (its family's `# TYPE` line is in `scrape`): a renamed metric breaks this, not an alert
/// that silently never fires.
fn assert_alert_rules_name_real_metrics(scrape: &str) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/prometheus/alerts.yml"
    );
    let rules = std::fs::read_to_string(path).expect("deploy/prometheus/alerts.yml");
    let mut named = 0;
    for expr in rules.lines().filter_map(|l| l.trim().strip_prefix("expr:")) {
        for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if !word.starts_with("provledger_") {
                continue;
            }
            let family = ["_total", "_bucket", "_count", "_sum"]
                .iter()
                .find_map(|suffix| word.strip_suffix(suffix))
                .unwrap_or(word);
            assert!(
                scrape.contains(&format!("# TYPE {family} ")),
                "alerts.yml names {word}, which serve does not export"
            );
            named += 1;
        }
    }
    assert!(named >= 5, "alerts.yml names {named} metrics");
}

/// `operation list --status needs_attention --json` with `ledger` (where to read), parsed.
fn needing_attention(ledger: &[&str]) -> serde_json::Value {
    let mut args = ledger.to_vec();
    args.extend(["--json", "operation", "list", "--status", "needs_attention"]);
    let out = provledger(&args, "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    serde_json::from_slice(&out.stdout).expect("operation list --json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_that_loses_nats_is_not_ready_until_nats_is_back() {
    // Given a ready serve with a ready file and /health...
    let mut nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let ready_file = dir.path().join("ready");
    let _serve = Serve::start_with(
        &nats,
        &dir.path().join("serve"),
        &[
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
            "--ready-file",
            ready_file.to_str().unwrap(),
        ],
    );
    wait_ready(&nats.client().await).await;
    eventually("the ready file", Duration::from_secs(10), || {
        ready_file.exists()
    })
    .await;
    assert_eq!(http_get(port, "/health").map(|(code, _)| code), Some(200));

    // ...when NATS goes away...
    nats.kill();

    // ...then it is not ready, and says why...
    eventually("the ready file removed", Duration::from_secs(10), || {
        !ready_file.exists()
    })
    .await;
    let (code, body) = http_get(port, "/health").expect("/health answers without NATS");
    assert_eq!(code, 503, "{body}");
    let health: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["ready"], false, "{health}");
    assert!(
        health["reason"]
            .as_str()
            .is_some_and(|r| r.contains("NATS")),
        "{health}"
    );
    let scrape = http_get(port, "/metrics").expect("metrics without NATS").1;
    assert_eq!(
        sample(&scrape, "provledger_nats_connected"),
        Some(0.0),
        "{scrape}"
    );

    // ...and once NATS is back, ready again.
    nats.start_again().await;
    eventually("the ready file back", Duration::from_secs(30), || {
        ready_file.exists()
    })
    .await;
    eventually("/health 200", Duration::from_secs(30), || {
        http_get(port, "/health").map(|(code, _)| code) == Some(200)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_append_is_logged_as_json_under_the_callers_trace_id() {
    // Given serve logging JSON...
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("serve");
    let _serve = Serve::start_with(&nats, &data, &["--log-format", "json"]);
    let client = nats.client().await;
    wait_ready(&client).await;

    // ...when a caller appends with a W3C traceparent...
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01").as_str(),
    );
    let request = serde_json::json!({
        "aggregate": format!("provider/{}", Uuid::now_v7()),
        "expect": "none",
        "events": [{"provider_registered": {"name": "cn9", "host": "cn9"}}],
        "actor": "traced-service",
    });
    let reply = client
        .request_with_headers("provledger.cmd.append", headers, request.to_string().into())
        .await
        .unwrap();
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    let position = reply["data"]["position"].as_u64().expect("appended");

    // ...then serve's log has a JSON line naming the commit, under that trace id.
    let log_path = data.with_extension("log");
    let mut found = None;
    eventually(
        "the traced commit in the log",
        Duration::from_secs(10),
        || {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            found = log
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .find(|l| l["fields"]["message"] == "commits appended");
            found.is_some()
        },
    )
    .await;
    let line = found.expect("found above");
    assert_eq!(line["span"]["trace_id"], trace_id, "{line}");
    assert_eq!(line["span"]["endpoint"], "cmd.append", "{line}");
    assert!(
        line["fields"]["commits"]
            .as_str()
            .is_some_and(|c| c.ends_with(&format!("@{position}"))),
        "{line}"
    );
}
