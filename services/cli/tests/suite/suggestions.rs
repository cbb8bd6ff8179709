//! What the `provledger` binary tells an operator to do next: a data dir a running
//! service holds names it and the command that asks it over NATS (never "stop it"); every
//! command it suggests carries the global flags it was run with, so that it can be pasted
//! as printed; `rollback resolve` names what is left, tried or never attempted; and help
//! lists every endpoint and puts a command's own options before the global ones.

use std::path::Path;
use std::time::{Duration, Instant};

use provledger_tests::NatsServer;

use crate::common;
use crate::common::{provledger, text, Serve};

const CLUSTER: &str = "cluster/0190c0de-0000-7000-8000-000000000001";

/// Runs the binary off the async runtime.
async fn run(args: Vec<String>) -> std::process::Output {
    tokio::task::spawn_blocking(move || provledger(&args, ""))
        .await
        .expect("the command's thread")
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// The commands (between backticks) a message suggests that start with `provledger`.
fn suggested(said: &str) -> Vec<String> {
    said.split('`')
        .skip(1)
        .step_by(2)
        .filter(|c| c.starts_with("provledger "))
        .map(str::to_string)
        .collect()
}

/// `text` with its whitespace (line breaks included) made single spaces.
fn words(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The example of a data dir held by serve in docs/cli.md: the indented lines after
/// `$ provledger audit`, as one line.
fn documented_lock_message() -> String {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/cli.md"))
            .expect("docs/cli.md");
    let example: Vec<&str> = doc
        .lines()
        .skip_while(|l| l.trim() != "$ provledger audit")
        .skip(1)
        .take_while(|l| l.starts_with("    "))
        .collect();
    assert!(
        !example.is_empty(),
        "docs/cli.md shows `$ provledger audit`"
    );
    words(&example.join(" "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_held_by_serve_names_it_and_says_how_to_ask_it_over_nats() {
    // Given `provledger serve` running on a data dir...
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("serve-data");
    let ready = tmp.path().join("serve.ready");
    let serve = Serve::start_with(&nats, &dir, &["--ready-file", ready.to_str().unwrap()]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "serve never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = dir.to_str().unwrap().to_string();
    let pid = format!("pid {}", serve.pid());

    // When an operator runs audit, state or operation list on that data dir...
    for command in [
        vec!["audit"],
        vec!["state", CLUSTER],
        vec!["operation", "list"],
    ] {
        let mut args = strings(&["--data-dir", &d]);
        args.extend(strings(&command));
        let out = run(args).await;
        let said = text(&out);
        // ...then it is refused (infrastructure, exit 3), naming serve and its pid...
        assert_eq!(out.status.code(), Some(3), "{said}");
        assert!(
            said.contains(&format!("is locked by `provledger serve` ({pid})")),
            "{said}"
        );
        // ...with the command that asks the running service instead, and never the
        // advice to stop it.
        let ask = format!(
            "provledger --nats $PROVLEDGER_NATS_URL {}",
            command.join(" ")
        );
        assert!(suggested(&said).contains(&ask), "{ask:?} in {said}");
        assert!(!said.contains("stop it"), "{said}");
        // docs/cli.md shows audit's message as it is.
        if command == ["audit"] {
            let documented = documented_lock_message()
                .replace("/srv/provledger-data", &d)
                .replace("pid 28116", &pid);
            assert_eq!(words(&said), documented, "docs/cli.md against {said}");
        }
    }

    // ...and a second serve on the same data dir is told to take its own.
    let out = run(strings(&["--nats", &nats.url(), "--data-dir", &d, "serve"])).await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(3), "{said}");
    assert!(said.contains(&pid), "{said}");
    assert!(said.contains("a data dir of its own"), "{said}");
    drop(serve);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_suggests_rollback_run_with_the_nats_it_was_run_with_and_the_paste_works() {
    // Given a failed create on a JetStream ledger, its executors answering over NATS, and
    // no serve to roll it back...
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    let op = common::fail_a_create(&client, &ledger, &infra, provider).await;
    let url = nats.url();

    // When audit runs with --nats (and a --subject-prefix that is the default)...
    let out = run(strings(&[
        "--nats",
        &url,
        "--subject-prefix",
        "provledger",
        "audit",
    ]))
    .await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");

    // ...then the rollback it suggests carries that --nats (the default prefix left out)...
    let rollback = format!("provledger --nats {url} rollback run {op}");
    assert!(
        suggested(&said).contains(&rollback),
        "{rollback:?} in {said}"
    );
    assert!(
        !said.contains(&format!("`provledger rollback run {op}`")),
        "{said}"
    );

    // ...and pasted as printed, it rolls the operation back.
    let pasted: Vec<String> = rollback.split(' ').skip(1).map(str::to_string).collect();
    let out = run(pasted).await;
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("rolled_back"), "{}", text(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_suggestion_carries_the_data_dir_and_a_stream_that_is_not_the_default() {
    // Given an aggregate on a data dir...
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("d").to_str().unwrap().to_string();
    let events =
        r#"[{"cluster_create_requested": {"name": "c", "plugin": "vanilla", "node_groups": []}}]"#;
    let out = tokio::task::spawn_blocking({
        let d = d.clone();
        move || {
            provledger(
                &[
                    "--data-dir",
                    &d,
                    "append",
                    CLUSTER,
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

    // When integrity acknowledge finds no loss, run with --stream OTHER and --json...
    let out = run(strings(&[
        "--json",
        "--data-dir",
        &d,
        "--stream",
        "OTHER",
        "integrity",
        "acknowledge",
        CLUSTER,
        "--lost",
        "2",
        "--reason",
        "x",
    ]))
    .await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    // ...then the history it points to carries the data dir and the stream, not --json.
    let history = format!("provledger --data-dir {d} --stream OTHER history {CLUSTER}");
    assert!(
        said.contains(&format!("`{history}`")),
        "{history:?} in {said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolve_names_each_compensation_left_and_never_suggests_resolving_untried_ones() {
    // Given a failed create whose rollback, with no executor answering, needs attention:
    // its first executor compensation tried and failed, the ones after it never attempted...
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
    let executors: Vec<serde_json::Value> = view["compensations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] != "done" && c["executor"] != "ledger")
        .cloned()
        .collect();
    let id = |c: &serde_json::Value| c["compensation_id"].as_str().unwrap().to_string();
    let stuck = id(executors
        .iter()
        .find(|c| c["attempts"].as_u64() > Some(0))
        .expect("a compensation tried"));
    let untried: Vec<String> = executors
        .iter()
        .filter(|c| c["attempts"] == 0)
        .map(id)
        .collect();
    assert!(!untried.is_empty(), "{view}");

    // When an operator resolves the stuck one by hand...
    let out = run(strings(&[
        "--data-dir",
        &d,
        "rollback",
        "resolve",
        &op,
        "--compensation",
        &stuck,
        "--reason",
        "removed by hand",
    ]))
    .await;
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");

    // ...then each compensation left is named in full, as never attempted...
    for c in &untried {
        let line = said
            .lines()
            .find(|l| l.contains(c.as_str()))
            .unwrap_or_else(|| panic!("{c} not named in {said}"));
        assert!(line.contains("never attempted"), "{line}");
    }
    // ...the command to request them carries the data dir, and nothing says to resolve
    // work that was never tried.
    let rollback = format!("provledger --data-dir {d} rollback run {op}");
    assert!(
        suggested(&said).contains(&rollback),
        "{rollback:?} in {said}"
    );
    assert!(!said.contains("resolve them"), "{said}");
    for command in suggested(&said) {
        assert!(
            !(command.contains("resolve") && untried.iter().any(|c| command.contains(c))),
            "{command} in {said}"
        );
    }
}

#[test]
fn query_help_lists_every_endpoint_serve_answers() {
    // Given the endpoints serve answers...
    let endpoints = provledger_serve::endpoint_subjects();
    // When an operator asks query for help...
    let out = provledger(&["query", "--help"], "");
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    // ...then it names each of them as query takes it.
    for subject in endpoints {
        let name = subject.strip_prefix("q.").unwrap_or(subject);
        assert!(
            said.contains(&format!(" {name},")) || said.contains(&format!(" {name} ")),
            "{name} missing from {said}"
        );
    }
}

#[test]
fn a_commands_help_shows_its_own_options_before_the_global_ones() {
    // When an operator asks `rollback run` for help...
    let out = provledger(&["rollback", "run", "--help"], "");
    let said = text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    // ...then its own option comes first, and the global ones under their own heading.
    let own = said.find("--executors-url").expect("its own option");
    let heading = said
        .find("Global options:")
        .expect("a heading for the globals");
    let global = said.find("--data-dir").expect("a global option");
    assert!(own < heading && heading < global, "{said}");
}
