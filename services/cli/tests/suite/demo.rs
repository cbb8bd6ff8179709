//! The demo as a newcomer reads it: its default output fits on a screen or two, nothing in
//! it is cut off, its operations carry the short ids the CLI prints everywhere, and the
//! commands it prints about a rollback work as printed; with `--nats` it writes to that
//! server's stream, where `serve` and every command over NATS find it, once per run.

use std::process::Command;
use std::time::{Duration, Instant};

use provledger_tests::NatsServer;

use crate::common;
use crate::common::{text, Serve};

/// The most lines the demo's default output may take: a screen or two.
const DEMO_LINES_MAX: usize = 150;
/// The widest line it may print, the closing commands included (they name the data dir
/// through `$DIR`, set once).
const DEMO_COLUMNS_MAX: usize = 120;

#[test]
fn the_demo_fits_its_line_budget_at_120_columns_with_every_failure_reason_whole() {
    // Given a fresh data dir,
    let dir = tempfile::tempdir().unwrap();
    // when the demo runs with its default output, as an installed binary (not under cargo,
    // whose `cargo run` its hints would name),
    let out = Command::new(env!("CARGO_BIN_EXE_provledger"))
        .args(["--data-dir", dir.path().to_str().unwrap(), "demo"])
        .env_remove("CARGO")
        .env_remove("PROVLEDGER_NATS_URL")
        .output()
        .expect("run the demo");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let lines: Vec<&str> = stdout.lines().collect();
    // then it takes at most 150 lines, none wider than 120 columns,
    assert!(
        lines.len() <= DEMO_LINES_MAX,
        "{} lines:\n{stdout}",
        lines.len()
    );
    let me = env!("CARGO_BIN_EXE_provledger");
    for line in &lines {
        assert!(
            line.chars().count() <= DEMO_COLUMNS_MAX,
            "wider than {DEMO_COLUMNS_MAX} columns: {line:?}"
        );
        assert!(!line.ends_with("..."), "cut off: {line:?}");
    }
    // every failure reason and every plan's rule are there whole (wrapped, not cut),
    let joined = lines.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ");
    for whole in [
        "failed (injected fault, call 3)",
        "plugin: decommission",
        "failed (injected fault, call 2)",
        "hypervisor: terminate_vm",
        "plugin: configure",
        "failed (injected fault, call 4)",
        "compensate: undo every completed step in reverse order of the effects; the target goes to \
         error and its record is kept",
        "the user deleted the target: compensate everything the operation created, data-holding \
         nodes included; discovered resources are kept",
    ] {
        assert!(joined.contains(whole), "missing {whole:?} in:\n{stdout}");
    }
    // and each operation it prints is named by its short id and kind, as the CLI prints ids,
    let operations = operation_lines(&stdout);
    assert_eq!(operations.len(), 9, "{stdout}");
    // and every command it prints about the rollback runs as printed, in the demo's data
    // dir: `operation show` shows the rolled-back operation whose short id it printed.
    let set_dir = lines
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with("DIR="))
        .unwrap_or_else(|| panic!("no DIR= line in:\n{stdout}"));
    let commands = printed_commands(&stdout, me);
    assert_eq!(commands.len(), 5, "{stdout}");
    for command in &commands {
        let read = Command::new("sh")
            .args(["-c", &format!("{set_dir}\n{command}")])
            .env_remove("PROVLEDGER_NATS_URL")
            .output()
            .expect("run the printed command");
        assert_eq!(read.status.code(), Some(0), "{command}: {}", text(&read));
    }
    let show = command_after(&commands, " operation show ");
    let (short, kind) = rolled_back_of(&stdout);
    assert!(show.ends_with(&short), "{show} is not operation {short}");
    let read = Command::new("sh")
        .args(["-c", &format!("{set_dir}\n{show}")])
        .output()
        .expect("run operation show");
    let shown = text(&read);
    assert!(
        shown.contains(&format!("({kind})")) && shown.contains("status       rolled_back"),
        "{shown}"
    );
}

/// How long serve may take to apply what the demo wrote before `operation show` finds it
/// (a deadline polled against, so generous: a loaded CI machine is slow, not wrong).
const SERVE_APPLIES_WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_nats_writes_each_run_to_that_stream_where_serve_and_its_commands_find_it() {
    // Given a nats-server and a serve consuming its stream,
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    common::wait_ready(&nats.client().await).await;
    let me = env!("CARGO_BIN_EXE_provledger");
    let url = nats.url();
    // when the demo runs twice with --nats,
    let runs: Vec<String> = (0..2)
        .map(|_| {
            let out = Command::new(me)
                .args(["--nats", &url, "demo"])
                .env_remove("CARGO")
                .env_remove("PROVLEDGER_NATS_URL")
                .output()
                .expect("run the demo");
            assert_eq!(out.status.code(), Some(0), "{}", text(&out));
            String::from_utf8_lossy(&out.stdout).to_string()
        })
        .collect();
    // then each run says it wrote on that stream, after what was there,
    let written: Vec<u64> = runs.iter().map(|r| demo_commits(r)).collect();
    assert!(
        runs[0].contains("on stream PROVLEDGER at nats://"),
        "{}",
        runs[0]
    );
    assert!(
        runs[1].contains(&format!("after its position #{},", written[0])),
        "{}",
        runs[1]
    );
    // the stream holds both runs' commits, audited clean over NATS,
    let out = Command::new(me)
        .args(["--json", "--nats", &url, "audit"])
        .output()
        .expect("audit over NATS");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let audit: serde_json::Value = serde_json::from_slice(&out.stdout).expect("audit JSON");
    assert_eq!(
        audit["commits"].as_u64(),
        Some(written[0] + written[1]),
        "{audit}"
    );
    // the second run made operations of its own, named by their short ids,
    let (first, _) = rolled_back_of(&runs[0]);
    let (second, _) = rolled_back_of(&runs[1]);
    assert_ne!(first, second);
    // and every command each run printed runs over NATS as printed: `rollback plan`,
    // `history` and `audit` on the stream, `operation show` on serve once it has applied
    // the run (a bounded wait).
    for run in &runs {
        let commands = printed_commands(run, me);
        assert_eq!(commands.len(), 5, "{run}");
        assert!(
            commands
                .iter()
                .all(|c| c.contains(&format!(" --nats {url} "))),
            "{commands:#?}"
        );
        for command in commands.iter().filter(|c| !c.contains(" operation show ")) {
            let out = Command::new("sh")
                .args(["-c", command])
                .output()
                .expect("run it");
            assert_eq!(out.status.code(), Some(0), "{command}: {}", text(&out));
        }
        let show = command_after(&commands, " operation show ");
        let deadline = Instant::now() + SERVE_APPLIES_WITHIN;
        let shown = loop {
            let out = Command::new("sh")
                .args(["-c", show])
                .output()
                .expect("run it");
            if out.status.code() == Some(0) || Instant::now() > deadline {
                break out;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(shown.status.code(), Some(0), "{show}: {}", text(&shown));
        assert!(
            text(&shown).contains("status       rolled_back"),
            "{}",
            text(&shown)
        );
    }
}

/// How many commits a demo run says it wrote (`the demo's N commits`, or `N commits`
/// embedded).
fn demo_commits(stdout: &str) -> u64 {
    let audit = stdout
        .lines()
        .find_map(|l| l.strip_prefix("audit: the demo's "))
        .unwrap_or_else(|| panic!("no audit line in:\n{stdout}"));
    audit
        .split_once(" commits")
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no commit count in {audit:?}"))
}

/// The operation lines of a demo's output (`-- operation 71eec13912d3 (create_cluster):
/// rolled_back`), each checked to name its operation by a short id: (short id, kind, status).
fn operation_lines(stdout: &str) -> Vec<(String, String, String)> {
    stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("-- operation "))
        .map(|rest| {
            let (short, rest) = rest.split_once(' ').expect("a short id, then the kind");
            assert!(
                short.len() == 12 && short.chars().all(|c| c.is_ascii_hexdigit()),
                "not a short id: {short:?} in {rest:?}"
            );
            let (kind, status) = rest.split_once("): ").expect("(kind): status");
            let kind = kind.strip_prefix('(').expect("(kind)");
            (short.to_string(), kind.to_string(), status.to_string())
        })
        .collect()
}

/// The short id and kind of the rolled-back operation the closing commands are about.
fn rolled_back_of(stdout: &str) -> (String, String) {
    let about = stdout
        .lines()
        .find_map(|l| l.strip_prefix("look at the rollback of operation "))
        .unwrap_or_else(|| panic!("no closing commands in:\n{stdout}"));
    let (short, rest) = about.split_once(" (").expect("short id, then (kind");
    let kind = rest.split_once(',').expect("kind, scenario").0;
    assert!(
        operation_lines(stdout).contains(&(short.into(), kind.into(), "rolled_back".into())),
        "operation {short} is not printed as rolled back in:\n{stdout}"
    );
    (short.to_string(), kind.to_string())
}

/// The commands a demo printed to paste: its lines that start with the program `me`.
fn printed_commands(stdout: &str, me: &str) -> Vec<String> {
    stdout
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with(me))
        .map(str::to_string)
        .collect()
}

fn command_after<'a>(commands: &'a [String], words: &str) -> &'a str {
    commands
        .iter()
        .find(|c| c.contains(words))
        .unwrap_or_else(|| panic!("no{words}command in {commands:#?}"))
}
