//! `provledger operation cancel` and `provledger operation show`, run as the binary:
//! - a cancel of a running create (against a real nats-server, serve running, the runner
//!   live in this test process) stops it, and serve's rollback worker rolls it back;
//! - a cancel of a closed operation is refused with the reason why, and writes nothing;
//! - `operation show` of a rollback that needs attention prints every compensation not
//!   done by its full id, within 100 columns, and the next commands with the flags given.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use provledger_client::{CancelNotices, OperationError, OperationRunner, StepHook};
use provledger_projections::operation::OperationStatus;
use provledger_projections::stages::stage;
use provledger_sim::Provisioner;
use provledger_tests::NatsServer;

use crate::common;
use crate::common::{provledger, text, wait_ready, Serve};

/// Runs the binary off the async runtime.
async fn run(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || provledger(&args, ""))
        .await
        .expect("the command's thread")
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// `said` with the commands continued over lines (` \` at a line's end) joined back into
/// one line each, as the shell joins them when pasted.
fn joined(said: &str) -> String {
    let mut out = String::new();
    let mut continued = false;
    for line in said.lines() {
        let line = if continued { line.trim_start() } else { line };
        match line.strip_suffix(" \\") {
            Some(head) => {
                out.push_str(head);
                out.push(' ');
                continued = true;
            }
            None => {
                out.push_str(line);
                out.push('\n');
                continued = false;
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_of_a_running_create_stops_it_and_serve_rolls_it_back() {
    // Given serve on a private nats-server, the executors answering over NATS, and a
    // create running in this process...
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 256).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let _serve = Serve::start_with(
        &nats,
        &dir.path().join("serve"),
        &["--compensation-backoff-ms", "50"],
    );
    wait_ready(&client).await;
    let url = nats.url();
    // ...when, at its spawn stage (compensate: all of it is undone), an operator runs `operation cancel` over NATS (and
    // `operation show` while the cancellation is pending)...
    let said = Arc::new(Mutex::new(Vec::<(i32, String)>::new()));
    let fired = Arc::new(Mutex::new(false));
    let hook: StepHook = {
        let (said, fired, url) = (said.clone(), fired.clone(), url.clone());
        Arc::new(move |op, stage_name, _step| {
            let (said, fired, url) = (said.clone(), fired.clone(), url.clone());
            Box::pin(async move {
                if stage_name != stage::SPAWN
                    || std::mem::replace(&mut *fired.lock().unwrap(), true)
                {
                    return;
                }
                let op = op.to_string();
                for args in [
                    vec![
                        "--nats",
                        &url,
                        "operation",
                        "cancel",
                        &op,
                        "--reason",
                        "the writer is stuck",
                        "--actor",
                        "sre",
                    ],
                    vec!["--nats", &url, "operation", "show", &op],
                ] {
                    let out = run(strings(&args)).await;
                    said.lock()
                        .unwrap()
                        .push((out.status.code().unwrap_or(-1), text(&out)));
                }
            })
        })
    };
    let runner = OperationRunner::new(
        ledger.clone(),
        CancelNotices::nats(client.clone(), "provledger"),
        None,
        "test-service",
    )
    .with_step_hook(hook);
    let report = Provisioner::new(runner, infra.clone(), "test-service")
        .create_cluster(common::two_workers(provider, "workers"))
        .await;
    let op = report.operation_id;
    let said = said.lock().unwrap().clone();
    assert_eq!(said.len(), 2, "the hook ran the commands: {said:?}");
    let (cancel_code, cancel_said) = &said[0];
    assert_eq!(*cancel_code, 0, "{cancel_said}");
    assert!(
        cancel_said.contains(&format!("cancellation of operation {op} recorded by sre")),
        "{cancel_said}"
    );
    assert!(
        cancel_said.contains("serve's rollback worker"),
        "{cancel_said}"
    );
    // ...then `operation show` says a cancellation is pending, with the next command
    // carrying the --nats it was run with...
    let (show_code, show_said) = &said[1];
    assert_eq!(*show_code, 0, "{show_said}");
    assert!(
        show_said.contains("cancellation the writer is stuck"),
        "{show_said}"
    );
    assert!(
        joined(show_said).contains(&format!("provledger --nats {url} rollback run {op}")),
        "{show_said}"
    );
    // ...the runner stopped at its next step, as cancelled,
    assert!(
        matches!(report.result, Err(OperationError::Cancelled { .. })),
        "{:?}",
        report.result
    );
    // and serve's rollback worker rolls it back: the operation closes as cancelled and
    // nothing it made remains at the executors.
    let closed = common::operation_closed(&ledger, op, Duration::from_secs(60)).await;
    assert_eq!(closed.status, Some(OperationStatus::Cancelled));
    assert!(closed.rollback_plan.is_some());
    assert!(infra.hypervisor.resources().is_empty());
    assert!(infra.ipam.resources().is_empty());
    // `operation show` over NATS then says it is closed, with every compensation done.
    let out = run(strings(&[
        "--nats",
        &url,
        "operation",
        "show",
        &op.to_string(),
    ]))
    .await;
    let shown = text(&out);
    assert_eq!(out.status.code(), Some(0), "{shown}");
    assert!(shown.contains("status       cancelled"), "{shown}");
    assert!(
        shown.contains("next: nothing; the operation is closed"),
        "{shown}"
    );
    for c in &closed.compensations {
        assert!(
            shown.contains(&c.planned.compensation_id.to_string()),
            "{} in {shown}",
            c.planned.compensation_id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_of_a_closed_operation_is_refused_with_why_and_writes_nothing() {
    // Given an operation that succeeded, on a data dir...
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d").to_str().unwrap().to_string();
    let op = "0190c0de-0000-7000-8000-0000000000aa";
    let events = r#"[{"operation_started": {"kind": "create_cluster",
        "target": "cluster/0190c0de-0000-7000-8000-000000000001", "parent_id": null,
        "stages": [{"name": "spawn", "policy": "compensate"}], "bundle_policy": null}},
        {"operation_succeeded": {}}]"#;
    let out = tokio::task::spawn_blocking({
        let (d, aggregate) = (d.clone(), format!("operation/{op}"));
        move || {
            provledger(
                &[
                    "--data-dir",
                    &d,
                    "append",
                    &aggregate,
                    "--expect",
                    "none",
                    "--events",
                    "-",
                ],
                events,
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // ...when an operator cancels it...
    let out = run(strings(&[
        "--data-dir",
        &d,
        "operation",
        "cancel",
        op,
        "--reason",
        "too late",
    ]))
    .await;
    let said = text(&out);
    // ...then the cancellation is refused (exit 1, as every refused write), saying why,
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains(&format!("cancellation of operation {op} refused"))
            && said
                .contains("the operation is closed (succeeded): there is nothing left to cancel"),
        "{said}"
    );
    // and nothing was written: the operation is still at version 1 (one commit).
    let out = run(strings(&[
        "--json",
        "--data-dir",
        &d,
        "operation",
        "show",
        op,
    ]))
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(view["status"], "succeeded", "{view}");
    assert_eq!(
        view["cancellation_reason"],
        serde_json::Value::Null,
        "{view}"
    );
    assert_eq!(view["version"], 1, "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_names_each_compensation_in_full_and_the_next_commands_with_the_flags_given() {
    // Given a failed create whose rollback, with no executor answering, needs attention...
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_str().unwrap().to_string();
    let op = common::failed_embedded_create(tmp.path()).await;
    let out = run(strings(&[
        "--json",
        "--data-dir",
        &d,
        "rollback",
        "run",
        &op,
    ]))
    .await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(view["status"], "needs_attention", "{view}");
    let compensations = view["compensations"].as_array().unwrap().clone();
    let tried: Vec<String> = compensations
        .iter()
        .filter(|c| c["state"] != "done" && c["executor"] != "ledger" && c["attempts"] != 0)
        .map(|c| c["compensation_id"].as_str().unwrap().to_string())
        .collect();
    assert!(!tried.is_empty(), "{view}");

    // When an operator shows it, with a --stream that is not the default...
    let out = run(strings(&[
        "--data-dir",
        &d,
        "--stream",
        "OTHER",
        "operation",
        "show",
        &op,
    ]))
    .await;
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // ...then it fits 100 columns (stdout; stderr has the logs),
    for line in said.lines() {
        assert!(
            line.chars().count() <= 100,
            "{} columns: {line}",
            line.len()
        );
    }
    // names its kind, status and times,
    assert!(
        said.contains(&format!("operation {op} (create_cluster)")),
        "{said}"
    );
    assert!(said.contains("status       needs_attention"), "{said}");
    for field in ["started_at", "failed_at", "finished_at", "last commit"] {
        assert!(said.contains(field), "{field} in {said}");
    }
    // every compensation by its full id, with its state,
    for c in &compensations {
        let id = c["compensation_id"].as_str().unwrap();
        let line = said
            .lines()
            .find(|l| l.contains(id))
            .unwrap_or_else(|| panic!("{id} not named in {said}"));
        let state = c["state"].as_str().unwrap();
        assert!(line.contains(state), "{state} in {line}");
    }
    // and the next commands, with the flags it was run with, to paste as printed:
    // `rollback resolve` for each compensation tried and failed, `rollback run` to retry.
    let said = joined(&said);
    let flags = format!("provledger --data-dir {d} --stream OTHER");
    for id in &tried {
        let resolve = format!("{flags} rollback resolve {op} --compensation {id} --reason TEXT");
        assert!(said.contains(&resolve), "{resolve:?} in {said}");
    }
    let rerun = format!("{flags} rollback run {op}");
    assert!(said.contains(&rerun), "{rerun:?} in {said}");
}

/// Appends `events` (JSON) to `aggregate` on the data dir `d` through `provledger append`.
async fn append(d: &str, aggregate: &str, expect: &str, events: &'static str) {
    let out = tokio::task::spawn_blocking({
        let (d, aggregate, expect) = (d.to_string(), aggregate.to_string(), expect.to_string());
        move || {
            provledger(
                &[
                    "--data-dir",
                    &d,
                    "append",
                    &aggregate,
                    "--expect",
                    &expect,
                    "--events",
                    "-",
                ],
                events,
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_plan_and_rollback_run_agree_on_a_running_operation() {
    // Given a running operation whose writer died, on a data dir...
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d").to_str().unwrap().to_string();
    let op = "0190c0de-0000-7000-8000-0000000000bb";
    let aggregate = format!("operation/{op}");
    append(
        &d,
        &aggregate,
        "none",
        r#"[{"operation_started": {"kind": "create_cluster",
        "target": "cluster/0190c0de-0000-7000-8000-000000000001", "parent_id": null,
        "stages": [{"name": "spawn", "policy": "compensate"}], "bundle_policy": null}}]"#,
    )
    .await;
    // ...when `rollback plan` and `rollback run` are asked, then both refuse alike (exit 1,
    // nothing to roll back) and say how to cancel it;
    for command in ["plan", "run"] {
        let out = run(strings(&["--data-dir", &d, "rollback", command, op])).await;
        let said = text(&out);
        assert_eq!(out.status.code(), Some(1), "{command}: {said}");
        assert!(
            said.contains("has status running: there is nothing to roll back"),
            "{command}: {said}"
        );
        let cancel = format!("`provledger --data-dir {d} operation cancel {op} --reason TEXT`");
        assert!(said.contains(&cancel), "{command}: {said}");
    }
    // once a cancellation is recorded by hand, `rollback plan` says it would be recorded
    // and shows the plan `rollback run` then records, and `rollback run` records it.
    append(
        &d,
        &aggregate,
        "1",
        r#"[{"cancellation_requested": {"reason": "by hand"}}]"#,
    )
    .await;
    let out = run(strings(&["--data-dir", &d, "rollback", "plan", op])).await;
    let planned = text(&out);
    assert_eq!(out.status.code(), Some(0), "{planned}");
    assert!(
        planned.contains("cancellation requested") && planned.contains("dry run"),
        "{planned}"
    );
    let rule = planned
        .lines()
        .find(|l| l.starts_with("rule: "))
        .unwrap_or_else(|| panic!("a rule in {planned}"))
        .to_string();
    let out = run(strings(&["--data-dir", &d, "rollback", "run", op])).await;
    let ran = text(&out);
    assert_eq!(out.status.code(), Some(0), "{ran}");
    assert!(ran.contains(&format!("operation {op}: cancelled")), "{ran}");
    assert!(ran.contains(&rule), "{rule:?} in {ran}");
}
