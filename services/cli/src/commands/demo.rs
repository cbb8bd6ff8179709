//! `provledger demo`: runs the demo scenarios (`provledger-sim`) embedded in a fresh data
//! dir and prints them for a person: each scenario's commits once, in log order, with
//! names instead of ids; its operations and their rollback plans; what remained; then the
//! hash-chain audit and how to look at the data with the same command the user ran.

use std::path::Path;

use provledger_events::{SledLog, Timestamp};
use provledger_serve::{audit_log, OnChainViolation};
use provledger_sim::demo::{self, fit, DemoReport, ScenarioReport};

use super::{print_json, CommandError};

pub async fn run(base_dir: &Path, json: bool) -> Result<(), CommandError> {
    let report = demo::run(base_dir).await.map_err(|e| match e {
        demo::DemoError::DataDir { .. } => CommandError::Infrastructure(e.to_string()),
        other => CommandError::Problem(other.to_string()),
    })?;
    // The same audit `provledger audit` runs, on the demo's data dir.
    let log =
        SledLog::open(&report.data_dir).map_err(|e| CommandError::Infrastructure(e.to_string()))?;
    let audit = audit_log(
        &log,
        OnChainViolation::Fail,
        None,
        Timestamp::now(),
        |_, _| {},
    )
    .await;
    log.close();
    let audit = audit?;
    let mut violations: Vec<String> = report.chain_violations.clone();
    violations.extend(
        audit
            .violations
            .iter()
            .map(|v| format!("{}: {}", v.aggregate.clone().unwrap_or_default(), v.problem)),
    );
    if json {
        print_json(&serde_json::json!({
            "data_dir": report.data_dir.display().to_string(),
            "scenarios": report.scenarios,
            "audit": {
                "aggregates": report.aggregates,
                "commits": report.commits,
                "positions": audit.position,
                "violations": violations,
            },
        }));
    } else {
        print_report(&report, &violations);
    }
    match violations.len() {
        0 => Ok(()),
        n => Err(CommandError::Problem(format!(
            "demo audit found {n} violation(s)"
        ))),
    }
}

fn print_report(report: &DemoReport, violations: &[String]) {
    println!(
        "{}",
        fit(&format!(
            "provledger demo: embedded (sled only, no NATS), data in {}",
            report.data_dir.display()
        ))
    );
    let mut failure = 0;
    for scenario in &report.scenarios {
        println!();
        let heading = if scenario.failure {
            failure += 1;
            format!("== failure scenario {failure}: {}", scenario.title)
        } else {
            format!("== {}", scenario.title)
        };
        println!("{}", fit(&heading));
        print_scenario(report, scenario);
    }
    println!();
    println!(
        "audit: {} aggregates, {} commits, hash chains, positions and invariants {}",
        report.aggregates,
        report.commits,
        if violations.is_empty() {
            "ok".to_string()
        } else {
            format!("{} VIOLATIONS", violations.len())
        }
    );
    for v in violations {
        println!("{}", fit(&format!("  VIOLATION {v}")));
    }
    // Commands are printed whole, never cut, so that they can be pasted as they are.
    let me = invocation();
    println!("the demo's data stays in its own data dir; look at it with the command you ran:");
    println!("  DIR={}", report.data_dir.display());
    if let Some(cluster) = report.first_cluster() {
        println!("  {me} --data-dir \"$DIR\" history {cluster}");
        println!("  {me} --data-dir \"$DIR\" state {cluster}");
    }
    println!("  {me} --data-dir \"$DIR\" replay");
    println!("  {me} --data-dir \"$DIR\" audit");
}

fn print_scenario(report: &DemoReport, scenario: &ScenarioReport) {
    for commit in &scenario.commits {
        for line in report.names.render_commit(commit) {
            println!("{line}");
        }
    }
    for note in &scenario.notes {
        println!("{}", fit(&format!("  note: {note}")));
    }
    for op in &scenario.operations {
        println!(
            "{}",
            fit(&format!("  -- {} ({}): {}", op.label, op.kind, op.status))
        );
        if let Some(plan) = &op.plan {
            // The plan names its target by its short id; say its name.
            let short_target = provledger_events::short_aggregate(&scenario.afterwards.cluster);
            let label = &scenario.afterwards.cluster_label;
            println!("     rollback plan:");
            for line in plan.lines() {
                let line = report.names.shorten(line).replacen(&short_target, label, 1);
                println!("{}", fit(&format!("       {line}")));
            }
        }
    }
    let a = &scenario.afterwards;
    let held: Vec<String> = a
        .executors
        .iter()
        .map(|(executor, n)| format!("{executor} {n}"))
        .collect();
    println!(
        "{}",
        fit(&format!(
            "  afterwards: {} is {} ({}), {} member(s)",
            a.cluster_label,
            a.status,
            report.names.shorten(&a.description),
            a.members
        ))
    );
    println!(
        "{}",
        fit(&format!(
            "  executors hold: {}; of removed nodes: {}",
            if held.is_empty() {
                "nothing".to_string()
            } else {
                held.join(", ")
            },
            if a.left_of_removed_nodes.is_empty() {
                "nothing".to_string()
            } else {
                a.left_of_removed_nodes.join(", ")
            }
        ))
    );
}

/// The command the user ran, so that the hint can be pasted as is: `cargo run` sets
/// `CARGO` and `CARGO_PKG_NAME` for the program it runs; otherwise the program as called.
fn invocation() -> String {
    let exe = std::env::args()
        .next()
        .unwrap_or_else(|| "provledger".into());
    let under_cargo = std::env::var_os("CARGO").is_some()
        && std::env::var("CARGO_PKG_NAME").is_ok_and(|p| p == "provledger");
    if under_cargo {
        let release = if exe.contains("/release/") {
            " --release"
        } else {
            ""
        };
        format!("cargo run{release} -p provledger --")
    } else {
        exe
    }
}
