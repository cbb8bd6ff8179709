//! Commands that only read never leave anything behind: no data dir, no JetStream stream.
//! A missing one is an error that says what was looked for and how to get one. And a
//! stopped service's data dir can be read offline by `history` as by `state`.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use provledger_tests::NatsServer;

use crate::common::{provledger, text, Serve};

const CLUSTER: &str = "cluster/0190c0de-0000-7000-8000-000000000021";
const CREATE: &str =
    r#"[{"cluster_create_requested": {"name": "c21", "plugin": "vanilla", "node_groups": []}}]"#;

/// Runs `provledger` in `cwd` with no data dir or NATS from the environment.
fn provledger_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_provledger"))
        .args(args)
        .current_dir(cwd)
        .env_remove("PROVLEDGER_NATS_URL")
        .env_remove("PROVLEDGER_DATA_DIR")
        .env_remove("PROVLEDGER_STREAM")
        .stdin(Stdio::null())
        .output()
        .expect("run provledger")
}

fn is_empty_dir(dir: &Path) -> bool {
    std::fs::read_dir(dir).expect("read dir").next().is_none()
}

#[test]
fn read_only_commands_create_no_data_dir_and_say_where_they_looked() {
    let op = "0190c0de-0000-7000-8000-0000000000ff";
    for args in [
        vec!["history", CLUSTER],
        vec!["state", CLUSTER],
        vec!["replay"],
        vec!["audit"],
        vec!["rollback", "plan", op],
        vec!["recover", "--dry-run"],
        vec!["heal-allocations", "--dry-run"],
    ] {
        // Given an empty working directory and no --data-dir (the default ./provledger-data),
        let cwd = tempfile::tempdir().unwrap();
        // when a command that only reads runs there,
        let out = provledger_in(cwd.path(), &args);
        // then it fails as "not found" (exit 1), naming where it looked and how to point
        // to a ledger,
        let said = text(&out);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {said}");
        let looked_at = cwd.path().canonicalize().unwrap().join("provledger-data");
        assert!(
            said.contains(&format!(
                "no provledger data dir at {}",
                looked_at.display()
            )),
            "{args:?}: {said}"
        );
        assert!(said.contains("--data-dir DIR"), "{args:?}: {said}");
        // and it created nothing.
        assert!(is_empty_dir(cwd.path()), "{args:?} left files behind");
    }
}

#[test]
fn provider_delete_without_arguments_is_bad_usage_and_creates_nothing() {
    // Given an empty working directory,
    let cwd = tempfile::tempdir().unwrap();
    // when `provider delete` is given neither an id nor --host,
    let out = provledger_in(cwd.path(), &["provider", "delete"]);
    // then it is bad usage (exit 2) naming what is missing, and nothing is created.
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--host"), "{}", text(&out));
    assert!(
        is_empty_dir(cwd.path()),
        "provider delete left files behind"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_with_a_mistyped_stream_creates_no_stream_and_names_the_one_looked_for() {
    // Given a nats-server with no stream at all,
    let nats = NatsServer::start().await;
    let url = nats.url();
    // when `history --stream TYPO` runs against it,
    let out = tokio::task::spawn_blocking(move || {
        provledger(
            &["--nats", &url, "--stream", "TYPO", "history", CLUSTER],
            "",
        )
    })
    .await
    .unwrap();
    // then it is "not found" (exit 1), naming the stream and how to create it, not a raw
    // JetStream error code,
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("stream TYPO not found"), "{said}");
    assert!(said.contains("provledger serve"), "{said}");
    assert!(!said.contains("error code"), "{said}");
    // and the server has no stream TYPO (nor any other) afterwards.
    let js = async_nats::jetstream::new(nats.client().await);
    let typo = js.get_stream("TYPO").await;
    assert!(typo.is_err(), "a stream TYPO was created");
    let mut names = js.stream_names();
    use futures::StreamExt;
    assert!(names.next().await.is_none(), "a stream was created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_to_a_second_stream_over_the_same_subjects_is_told_why_it_cannot_be_created() {
    // Given a server whose stream PROVLEDGER holds provledger.ev.>,
    let nats = NatsServer::start().await;
    let url = nats.url();
    let out = tokio::task::spawn_blocking(move || {
        let created = provledger(
            &[
                "--nats", &url, "append", CLUSTER, "--expect", "none", "--events", "-",
            ],
            CREATE,
        );
        assert_eq!(created.status.code(), Some(0), "{}", text(&created));
        // when an append names another stream with the same subject prefix,
        provledger(
            &[
                "--nats", &url, "--stream", "NOPE", "append", CLUSTER, "--expect", "any",
                "--events", "-",
            ],
            CREATE,
        )
    })
    .await
    .unwrap();
    // then it is bad usage (exit 2) saying the subjects are taken and what to do.
    let said = text(&out);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(said.contains("stream NOPE cannot be created"), "{said}");
    assert!(said.contains("provledger.ev.>"), "{said}");
    assert!(!said.contains("error code"), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offline_reads_of_a_stopped_services_data_dir_show_its_state_and_say_where_history_is() {
    // Given a service keeping no copy of the stream (`--no-log-copy`; by default it keeps
    // one: log_copy.rs) that projected a commit into its data dir, then stopped,
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("serve");
    let mut serve = Serve::start_with(&nats, &data, &["--no-log-copy"]);
    let url = nats.url();
    tokio::task::spawn_blocking(move || {
        let out = provledger(
            &[
                "--nats", &url, "append", CLUSTER, "--expect", "none", "--events", "-",
            ],
            CREATE,
        );
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        let request = format!(r#"{{"aggregate": "{CLUSTER}", "min_position": 1}}"#);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = provledger(&["--nats", &url, "query", "history", &request], "");
            if out.status.code() == Some(0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "serve never answered: {}",
                text(&out)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .unwrap();
    assert!(serve.terminate().success());
    let data = data.to_str().unwrap();
    // when `history` and `state` read that data dir offline,
    let history = provledger(&["--data-dir", data, "history", CLUSTER], "");
    let state = provledger(&["--data-dir", data, "state", CLUSTER], "");
    // then `state` shows the cluster as the service projected it, and `history` says the
    // history is in the stream (the data dir keeps no copy of it) and how to read it.
    assert_eq!(state.status.code(), Some(0), "{}", text(&state));
    assert!(text(&state).contains("c21"), "{}", text(&state));
    assert_eq!(history.status.code(), Some(1), "{}", text(&history));
    let shown = text(&history);
    assert!(shown.contains("keeps no copy of the log"), "{shown}");
    assert!(shown.contains("--nats"), "{shown}");
}
