//! The demo as a newcomer reads it: its default output fits on a screen or two, nothing in
//! it is cut off, and the command it prints to read its data works as printed.

use std::process::Command;

mod common;
use common::text;

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
    // and the history command it prints reads the demo's cluster as printed.
    let history = lines
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with(me) && l.contains(" history cluster/"))
        .unwrap_or_else(|| panic!("no history command in:\n{stdout}"));
    let set_dir = lines
        .iter()
        .map(|l| l.trim())
        .find(|l| l.starts_with("DIR="))
        .unwrap_or_else(|| panic!("no DIR= line in:\n{stdout}"));
    let read = Command::new("sh")
        .args(["-c", &format!("{set_dir}\n{history}")])
        .output()
        .expect("run the printed command");
    assert_eq!(read.status.code(), Some(0), "{history}: {}", text(&read));
    assert!(
        text(&read).contains("cluster_create_requested"),
        "{}",
        text(&read)
    );
}
