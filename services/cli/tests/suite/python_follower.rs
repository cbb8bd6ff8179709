//! docs/examples/follow.py, the Python follower of docs/following.md, against a real
//! nats-server and serve while writers append: SIGKILLed and restarted from its position
//! file, then stalled (SIGSTOP) until its bounded feed buffer drops changes, it ends having
//! handled every commit of the stream in position order. It stores a position after handling
//! the change, so it is at least once: a change is handled twice only when the process died
//! between printing it and storing its position, and then it is the first one the restart
//! prints.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use provledger_events::EventLog;
use provledger_tests::NatsServer;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

use crate::common::{self, wait_ready, Serve};

/// How long the follower may take to print a line it owes (Python's start, a catch-up, a
/// bookmark, which serve sends every 5 s).
const LINE_WAIT: Duration = Duration::from_secs(30);
/// How long to wait for one of serve's bookmarks (sent every 5 s).
const BOOKMARK_WAIT: Duration = Duration::from_secs(10);
const WRITERS: usize = 4;
/// Commits per writer while the first run is killed and the second starts.
const PHASE_ONE_PER_WRITER: usize = 250;
/// Commits per writer while the second run is stopped: 800 in all, more than follow.py's
/// feed buffer (FEED_BUFFER_MSGS = 256) holds.
const STALLED_PER_WRITER: usize = 200;
/// Commits per writer once it runs again: their `prev` shows it what its buffer dropped.
const AFTER_STALL_PER_WRITER: usize = 50;
/// Changes the first run prints before it is killed.
const KILL_AFTER_LINES: usize = 300;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory to put on PYTHONPATH for nats-py: `.tools/python`, installed by
/// scripts/install-nats-py.sh when it is not there.
fn nats_py() -> PathBuf {
    let root = repo_root();
    let dir = root.join(".tools/python");
    if !dir.join("nats").is_dir() {
        let out = std::process::Command::new("bash")
            .arg(root.join("scripts/install-nats-py.sh"))
            .output()
            .expect("run bash scripts/install-nats-py.sh");
        assert!(
            out.status.success() && dir.join("nats").is_dir(),
            "nats-py is not in {} and scripts/install-nats-py.sh could not install it \
             (it needs python3 with pip, and PyPI): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    dir
}

/// One run of `python3 docs/examples/follow.py URL POSITION_FILE`: the positions it printed
/// so far; its stderr (why it caught up) goes to a file.
struct PythonFollower {
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
    printed: Vec<u64>,
    stderr: PathBuf,
}

impl PythonFollower {
    fn start(url: &str, position_file: &Path, stderr: PathBuf) -> PythonFollower {
        let root = repo_root();
        let mut child = Command::new("python3")
            .arg(root.join("docs/examples/follow.py"))
            .arg(url)
            .arg(position_file)
            .env("PYTHONPATH", nats_py())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn python3 docs/examples/follow.py");
        let stdout = BufReader::new(child.stdout.take().expect("stdout")).lines();
        PythonFollower {
            child,
            stdout,
            printed: Vec::new(),
            stderr,
        }
    }

    /// Reads one line (bounded); false at the end of its output.
    async fn read_line(&mut self) -> bool {
        let line = tokio::time::timeout(LINE_WAIT, self.stdout.next_line()).await;
        let line = line
            .unwrap_or_else(|_| panic!("no line for {LINE_WAIT:?}: {}", self.diagnosis()))
            .expect("read the follower's stdout");
        let Some(line) = line else {
            return false;
        };
        let change: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("a line that is not JSON ({e}): {line}"));
        let events = change["events"].as_array();
        assert!(
            change["aggregate"].is_string() && events.is_some_and(|e| !e.is_empty()),
            "{line}"
        );
        let position = change["position"].as_u64();
        self.printed
            .push(position.unwrap_or_else(|| panic!("no position: {line}")));
        true
    }

    /// Reads until `lines` changes are printed in all.
    async fn wait_lines(&mut self, lines: usize) {
        while self.printed.len() < lines {
            assert!(self.read_line().await, "it ended: {}", self.diagnosis());
        }
    }

    /// Reads until it printed `position` (or beyond).
    async fn wait_position(&mut self, position: u64) {
        while self.printed.last().is_none_or(|&p| p < position) {
            assert!(self.read_line().await, "it ended: {}", self.diagnosis());
        }
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = self.child.id().expect("the follower runs") as libc::pid_t;
        // SAFETY: kill(2) touches no memory; the pid is our child's, not reaped yet, so no
        // other process can have it.
        assert_eq!(
            unsafe { libc::kill(pid, signal) },
            0,
            "kill({pid}, {signal})"
        );
    }

    /// SIGKILL, then what it printed (all of it: the pipe keeps what it wrote), and its
    /// stderr.
    async fn kill(mut self) -> (Vec<u64>, String) {
        self.child.kill().await.expect("SIGKILL the follower");
        while self.read_line().await {}
        let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        (self.printed, stderr)
    }

    fn diagnosis(&self) -> String {
        let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        format!("last printed {:?}; stderr:\n{stderr}", self.printed.last())
    }
}

/// A few positions from `at`, for a message.
fn window(positions: &[u64], at: Option<usize>) -> &[u64] {
    let at = at.unwrap_or(0).min(positions.len());
    &positions[at..(at + 5).min(positions.len())]
}

fn stored_position(file: &Path) -> u64 {
    let text = std::fs::read_to_string(file).expect("the position file");
    text.trim()
        .parse()
        .unwrap_or_else(|e| panic!("position file {text:?}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_python_follower_killed_and_stalled_during_writes_handles_every_commit_in_order() {
    // Given serve, and docs/examples/follow.py following it from an empty position file,
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let log = Arc::new(common::stream(&nats).await);
    let position_file = dir.path().join("position");
    let first = PythonFollower::start(&nats.url(), &position_file, dir.path().join("first.err"));

    // when 4 writers append 1,000 commits, and the follower is SIGKILLed after it printed
    // 300 and restarted with the same position file,
    let (first_printed, stored, mut second) = {
        let kill_and_restart = async {
            let mut first = first;
            first.wait_lines(KILL_AFTER_LINES).await;
            let (printed, _) = first.kill().await;
            let stored = stored_position(&position_file);
            let second =
                PythonFollower::start(&nats.url(), &position_file, dir.path().join("second.err"));
            (printed, stored, second)
        };
        let ((), run) = tokio::join!(
            common::write_concurrently(&nats, WRITERS, PHASE_ONE_PER_WRITER),
            kill_and_restart
        );
        run
    };
    second
        .wait_position(log.last_position().await.unwrap())
        .await;
    // and, once it is current, is stopped (SIGSTOP) right after one of serve's bookmarks
    // (so that the next one, 5 s later, does not send it to catch up first) while they
    // append 800 more, then continued while they append 200,
    let mut bookmarks = client.subscribe("provledger.feed.bookmark").await.unwrap();
    tokio::time::timeout(BOOKMARK_WAIT, bookmarks.next())
        .await
        .expect("a bookmark from serve");
    second.signal(libc::SIGSTOP);
    common::write_concurrently(&nats, WRITERS, STALLED_PER_WRITER).await;
    second.signal(libc::SIGCONT);
    common::write_concurrently(&nats, WRITERS, AFTER_STALL_PER_WRITER).await;
    let end = common::quiet_end(&log).await;
    second.wait_position(end).await;
    let (second_printed, second_stderr) = second.kill().await;

    // then what the first run printed up to the position it stored, followed by what the
    // second printed, is exactly the stream's commits in position order;
    let expected: Vec<u64> = common::stream_commits(&log)
        .await
        .iter()
        .map(|c| c.position)
        .collect();
    let per_writer = PHASE_ONE_PER_WRITER + STALLED_PER_WRITER + AFTER_STALL_PER_WRITER;
    assert_eq!(expected.len(), WRITERS * per_writer);
    let (kept, unstored) = first_printed.split_at(first_printed.partition_point(|&p| p <= stored));
    assert_eq!(
        kept.last(),
        Some(&stored),
        "the file holds a printed position"
    );
    let handled: Vec<u64> = kept.iter().chain(&second_printed).copied().collect();
    let differ = (0..=handled.len()).find(|&i| handled.get(i) != expected.get(i));
    assert!(
        differ.is_none(),
        "the first run stored {stored} and printed beyond it {unstored:?}; handled and \
         the stream differ first at index {differ:?}: {:?} against {:?}",
        window(&handled, differ),
        window(&expected, differ),
    );
    // a change printed and not stored is only the one it died handling, and the second run
    // handled it again first;
    assert!(unstored.len() <= 1, "printed but not stored: {unstored:?}");
    assert_eq!(unstored, &second_printed[..unstored.len()]);
    // and the stall made it lose feed messages, which it saw by their prev.
    assert!(
        second_stderr.contains("missed changes (prev"),
        "no gap seen: {second_stderr}"
    );
}
