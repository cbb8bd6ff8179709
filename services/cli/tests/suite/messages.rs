//! Messages a user reads when something is missing say what and what to do, once.

use provledger_tests::NatsServer;

use crate::common::{provledger, text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_nobody_answers_says_to_start_serve_and_an_unreachable_nats_says_which_url() {
    // Given a nats-server with no service on it, and a port with no server at all,
    let nats = NatsServer::start().await;
    let url = nats.url();
    let nowhere = format!("nats://127.0.0.1:{}", provledger_tests::free_port());
    let (no_service, unreachable) = tokio::task::spawn_blocking(move || {
        // when `query health` is sent to each (with a short --timeout),
        (
            provledger(
                &["--nats", &url, "query", "health", "--timeout", "500ms"],
                "",
            ),
            provledger(&["--nats", &nowhere, "query", "health"], ""),
        )
    })
    .await
    .unwrap();
    // then the first is exit 3 saying nobody answers and to start serve, said once,
    let said = text(&no_service);
    assert_eq!(no_service.status.code(), Some(3), "{said}");
    assert!(
        said.contains("no service answers on provledger.q.health"),
        "{said}"
    );
    assert!(said.contains("start `provledger serve`"), "{said}");
    assert!(!said.contains("no responders: no responders"), "{said}");
    // and the second is exit 3 naming the URL, not telling a query user to drop --nats.
    let said = text(&unreachable);
    assert_eq!(unreachable.status.code(), Some(3), "{said}");
    assert!(said.contains("NATS unreachable at"), "{said}");
    assert!(!said.contains("drop --nats"), "{said}");
}

#[test]
fn a_query_timeout_that_is_not_a_duration_is_bad_usage() {
    let out = provledger(
        &[
            "--nats",
            "nats://127.0.0.1:1",
            "query",
            "health",
            "--timeout",
            "soon",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--timeout"), "{}", text(&out));
}

#[test]
fn under_json_a_failure_is_one_json_object_on_stderr_with_its_code_and_exit_code() {
    // Given a data dir that does not exist,
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing-here");
    // when a read-only command runs on it with --json,
    let out = provledger(
        &[
            "--json",
            "--data-dir",
            missing.to_str().unwrap(),
            "history",
            "cluster/0190b6b1-9a39-7c52-8c4e-2f3f7d1b8a01",
        ],
        "",
    );
    // then it exits 1 and stderr is one JSON object saying so, with the message.
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let error: serde_json::Value = serde_json::from_str(stderr.trim())
        .unwrap_or_else(|e| panic!("stderr is not one JSON object ({e}): {stderr}"));
    assert_eq!(error["error"]["code"], "problem", "{error}");
    assert_eq!(error["error"]["exit_code"], 1, "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("nothing-here")),
        "{error}"
    );
}
