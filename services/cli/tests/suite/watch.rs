//! `provledger watch` against a real nats-server and serve: it prints every commit once, in
//! position order, replayed from `--after` and then live; a filter (an operation by its
//! short id, a kind) prints exactly what it names; from now by default; SIGTERM ends it with
//! exit 0 and the position to resume from; without --nats, or with an unknown event, it is
//! refused (exit 2), and without serve it exits 3.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use provledger_events::{short_aggregate, short_id, AggregateKind, Commit, EventLog};
use provledger_tests::NatsServer;

use crate::common::{self, wait_ready, Serve};

/// How long a watch may take to print what a test waits for.
const OUTPUT_WAIT: Duration = Duration::from_secs(60);

/// A `provledger watch` child: its stdout as lines on a channel, its stderr gathered.
struct Watching {
    child: Child,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Watching {
    /// Runs `provledger --nats URL ARGS...`.
    fn start(url: &str, args: &[&str]) -> Watching {
        let mut child = Command::new(env!("CARGO_BIN_EXE_provledger"))
            .arg("--nats")
            .arg(url)
            .args(args)
            .env_remove("PROVLEDGER_NATS_URL")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn provledger watch");
        let (send, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout piped");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if send.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let gathered = Arc::clone(&stderr);
        let pipe = child.stderr.take().expect("stderr piped");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { return };
                let mut all = gathered.lock().unwrap();
                all.push_str(&line);
                all.push('\n');
            }
        });
        Watching {
            child,
            lines,
            stderr,
        }
    }

    /// The stdout lines, read until `done` holds of those read (bounded by [`OUTPUT_WAIT`];
    /// polled, so that the test's runtime, which runs the executors, is never blocked).
    async fn lines_until(&self, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        let deadline = Instant::now() + OUTPUT_WAIT;
        let mut read = Vec::new();
        while !done(&read) {
            match self.lines.try_recv() {
                Ok(line) => read.push(line),
                Err(TryRecvError::Empty) => {
                    assert!(
                        Instant::now() < deadline,
                        "watch printed only {read:#?}; stderr: {}",
                        self.stderr()
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(TryRecvError::Disconnected) => {
                    panic!("watch ended after {read:#?}; stderr: {}", self.stderr())
                }
            }
        }
        read
    }

    /// Waits (bounded) until stderr holds `text`; the whole of stderr then.
    async fn stderr_with(&self, text: &str) -> String {
        let deadline = Instant::now() + OUTPUT_WAIT;
        loop {
            let all = self.stderr();
            if all.contains(text) {
                return all;
            }
            assert!(Instant::now() < deadline, "no {text:?} on stderr: {all}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// SIGTERM, then (bounded) its exit: the status, the stdout lines not read yet, stderr.
    fn terminate(mut self) -> (ExitStatus, Vec<String>, String) {
        // SAFETY: kill(2) with a child's pid and a valid signal has no memory effect here.
        let sent = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        assert_eq!(sent, 0, "SIGTERM sent");
        let deadline = Instant::now() + Duration::from_secs(15);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait watch") {
                break status;
            }
            assert!(Instant::now() < deadline, "watch did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        // The readers end with the pipes: what is left is all there is.
        let rest: Vec<String> = self.lines.iter().collect();
        let stderr_closed = Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&self.stderr) > 1 && Instant::now() < stderr_closed {
            std::thread::sleep(Duration::from_millis(10));
        }
        (status, rest, self.stderr())
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The position a text line starts with (`#1217  cluster/... v3 ...`).
fn text_position(line: &str) -> u64 {
    line.strip_prefix('#')
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no position at the start of {line:?}"))
}

/// The position a `--json` line holds.
fn json_position(line: &str) -> u64 {
    let value: serde_json::Value = serde_json::from_str(line).expect("one JSON object a line");
    value["position"].as_u64().expect("a position")
}

/// The position `resume with --after P` names on stderr.
fn resume_position(stderr: &str) -> u64 {
    let (_, rest) = stderr
        .split_once("resume with --after ")
        .unwrap_or_else(|| panic!("no resume hint on stderr: {stderr}"));
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().expect("a position to resume from")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watch_json_replays_from_the_first_commit_then_prints_new_commits_as_they_land() {
    // Given serve, and a failed create with its rollback,
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    let log = common::stream(&nats).await;
    let first_end = common::quiet_end(&log).await;

    // when `watch --after 0 --json` replays them,
    let watch = Watching::start(&nats.url(), &["watch", "--after", "0", "--json"]);
    let mut printed = watch
        .lines_until(|read| read.last().is_some_and(|l| json_position(l) >= first_end))
        .await;
    // and another failed create is written while it runs,
    common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    let end = common::quiet_end(&log).await;
    let live = watch
        .lines_until(|read| read.last().is_some_and(|l| json_position(l) >= end))
        .await;
    printed.extend(live);
    // and it is sent SIGTERM,
    let (status, rest, stderr) = watch.terminate();
    printed.extend(rest);

    // then it printed every commit of the stream once, in position order, each as
    // q.changes gives it,
    let commits = common::stream_commits(&log).await;
    assert!(commits.len() as u64 > first_end, "the second create wrote");
    let positions: Vec<u64> = printed.iter().map(|l| json_position(l)).collect();
    let expected: Vec<u64> = commits.iter().map(|c| c.position).collect();
    assert_eq!(positions, expected, "{stderr}");
    for (line, commit) in printed.iter().zip(&commits) {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(value["aggregate"], commit.aggregate.to_string(), "{line}");
        assert_eq!(value["version"], commit.version, "{line}");
        assert_eq!(value["commit_id"], commit.commit_id.to_string(), "{line}");
        assert_eq!(
            value["events"].as_array().map(Vec::len),
            Some(commit.events.len())
        );
        assert!(value["timeline"].is_array(), "{line}");
    }
    // and it ended with exit 0, naming the last position it printed to resume from.
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert_eq!(
        resume_position(&stderr),
        *expected.last().unwrap(),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watch_of_one_operation_by_its_short_id_prints_only_its_commits_as_text_lines() {
    // Given serve, and two failed creates with their rollbacks,
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let first = common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    let log = common::stream(&nats).await;
    let end = common::quiet_end(&log).await;
    let commits = common::stream_commits(&log).await;
    let of_first: Vec<&Commit> = commits
        .iter()
        .filter(|c| c.operation_id == Some(first))
        .collect();
    assert!(of_first.len() > 5, "{of_first:?}");

    // when `watch --after 0 --operation SHORT` follows in text mode until current,
    let short = short_id(&first);
    let watch = Watching::start(
        &nats.url(),
        &["watch", "--after", "0", "--operation", &short],
    );
    let mut printed = watch.lines_until(|read| read.len() == of_first.len()).await;
    let stderr = watch.stderr_with("-- current at").await;
    assert!(
        stderr.contains(&format!("-- current at {end}, waiting for changes")),
        "{stderr}"
    );
    let (status, rest, stderr) = watch.terminate();
    printed.extend(rest);

    // then it printed exactly that operation's commits, on every aggregate it wrote, in
    // position order, each line naming the commit shortly, its actor and the operation,
    let positions: Vec<u64> = printed.iter().map(|l| text_position(l)).collect();
    let expected: Vec<u64> = of_first.iter().map(|c| c.position).collect();
    assert_eq!(positions, expected, "{printed:#?}");
    for (line, commit) in printed.iter().zip(&of_first) {
        let head = format!(
            "{} v{:<3} {}",
            short_aggregate(&commit.aggregate),
            commit.version,
            commit.events[0].name()
        );
        assert!(line.contains(&head), "{line:?} lacks {head:?}");
        assert!(line.contains(&format!("by {}", commit.actor)), "{line}");
        assert!(line.ends_with(&format!("  op {short}")), "{line}");
    }
    // and it ended with exit 0, to resume after everything it looked at.
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert_eq!(resume_position(&stderr), end, "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watch_without_after_starts_at_the_current_end_and_prints_only_what_follows() {
    // Given serve, and a compute node registered before the watch,
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let log = common::stream(&nats).await;
    let before = common::quiet_end(&log).await;
    assert!(before > 0);

    // when `watch --kind provider` starts from now, and once it is current a failed create
    // claims and releases on the provider,
    let watch = Watching::start(&nats.url(), &["watch", "--kind", "provider"]);
    let stderr = watch.stderr_with("-- current at").await;
    assert!(
        stderr.contains(&format!("-- current at {before}, waiting for changes")),
        "{stderr}"
    );
    common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    let end = common::quiet_end(&log).await;
    let expected: Vec<u64> = common::stream_commits(&log)
        .await
        .iter()
        .filter(|c| c.position > before && c.aggregate.kind == AggregateKind::Provider)
        .map(|c| c.position)
        .collect();
    assert!(!expected.is_empty(), "the create wrote on the provider");
    let mut printed = watch.lines_until(|read| read.len() == expected.len()).await;
    let (status, rest, stderr) = watch.terminate();
    printed.extend(rest);

    // then it printed the provider's commits after the start, none before, none other.
    let positions: Vec<u64> = printed.iter().map(|l| text_position(l)).collect();
    assert_eq!(positions, expected, "{printed:#?}");
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(
        resume_position(&stderr) >= *expected.last().unwrap(),
        "{stderr}"
    );
    assert!(resume_position(&stderr) <= end.max(log.last_position().await.unwrap()));
}

#[test]
fn watch_without_nats_or_with_an_unknown_event_is_refused_with_exit_2() {
    // Given no --nats, when watch runs, then it is refused saying what it needs;
    let o = common::provledger(&["watch", "--after", "0"], "");
    assert_eq!(o.status.code(), Some(2), "{}", common::text(&o));
    assert!(
        common::text(&o).contains("watch needs --nats"),
        "{}",
        common::text(&o)
    );
    // given an event the catalogue does not have, then it is refused naming it, before
    // any NATS is asked (none listens on this port).
    let o = common::provledger(
        &[
            "--nats",
            "nats://127.0.0.1:1",
            "watch",
            "--event",
            "vm_flew_away",
        ],
        "",
    );
    assert_eq!(o.status.code(), Some(2), "{}", common::text(&o));
    assert!(
        common::text(&o).contains("vm_flew_away"),
        "{}",
        common::text(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_with_no_serve_on_the_nats_exits_3_saying_so() {
    // Given a NATS server where no serve runs, when watch starts from now,
    let nats = NatsServer::start().await;
    let o = common::provledger(&["--nats", &nats.url(), "watch"], "");
    // then it exits 3, naming what to start.
    assert_eq!(o.status.code(), Some(3), "{}", common::text(&o));
    assert!(
        common::text(&o).contains("provledger serve"),
        "{}",
        common::text(&o)
    );
}
