//! `provledger demo`: runs the demo scenarios (`provledger-sim`) embedded in a fresh data
//! dir and prints them for a person: each scenario's commits once, in log order, with
//! names instead of ids; its operations and their rollback plans; what remained; then the
//! hash-chain audit and how to look at the data with the same command the user ran.

use std::path::Path;

use provledger_events::catalogue::Executor;
use provledger_events::short_aggregate;
use provledger_events::{SledLog, Timestamp};
use provledger_projections::planner::action_word;
use provledger_serve::{audit_log, OnChainViolation};
use provledger_sim::demo::{self, wrap, DemoReport, OperationOutcome, ScenarioReport};

use super::{print_json, CommandError};

pub async fn run(base_dir: &Path, verbose: bool, json: bool) -> Result<(), CommandError> {
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
            "drift": {"held": report.held, "findings": report.drift},
        }));
    } else {
        print_report(&report, &violations, verbose);
    }
    match (violations.len(), report.drift.len()) {
        (0, 0) => Ok(()),
        (n, 0) => Err(CommandError::Problem(format!(
            "demo audit found {n} violation(s)"
        ))),
        (n, d) => Err(CommandError::Problem(format!(
            "demo audit found {n} violation(s) and drift {d} finding(s)"
        ))),
    }
}

/// Prints a line wrapped at [`demo::LINE_COLUMNS_MAX`] columns, continuations indented.
fn say(line: &str, indent: usize) {
    for part in wrap(line, indent) {
        println!("{part}");
    }
}

fn print_report(report: &DemoReport, violations: &[String], verbose: bool) {
    say(
        &format!(
            "provledger demo: embedded (sled only, no NATS), data in {}",
            report.data_dir.display()
        ),
        2,
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
        say(&heading, 3);
        print_scenario(report, scenario, verbose);
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
        say(&format!("  VIOLATION {v}"), 4);
    }
    if report.drift.is_empty() {
        say(
            &format!(
                "drift: the executors hold {} resource(s), each as the ledger records it",
                report.held
            ),
            2,
        );
    } else {
        say(&format!("drift: {} FINDINGS", report.drift.len()), 2);
        for f in &report.drift {
            say(
                &format!("  {:?} {} {}: {}", f.kind, f.executor, f.resource, f.reason),
                4,
            );
        }
    }
    // Commands are printed whole, never wrapped, so that they can be pasted as they are;
    // they name the demo's own data dir, which is not the default one.
    let me = invocation();
    // Absolute, so that the commands work from any directory.
    let dir = std::path::absolute(&report.data_dir).unwrap_or_else(|_| report.data_dir.clone());
    let dir = shell_word(&dir.display().to_string());
    // The path once, in a shell variable, so each command stays within the line budget
    // however deep the data dir is.
    say(
        "the demo's data dir, and how to read it with the command you ran (paste as is):",
        2,
    );
    println!("  DIR={dir}");
    if let Some(cluster) = report.first_cluster() {
        println!("  {me} --data-dir \"$DIR\" history {cluster}");
        println!("  {me} --data-dir \"$DIR\" state {cluster}");
    }
    println!("  {me} --data-dir \"$DIR\" replay");
    println!("  {me} --data-dir \"$DIR\" audit");
}

fn print_scenario(report: &DemoReport, scenario: &ScenarioReport, verbose: bool) {
    if verbose {
        for commit in &scenario.commits {
            for line in report.names.render_commit(commit).iter().flatten() {
                println!("{line}");
            }
        }
    } else if let (Some(first), Some(last)) = (scenario.commits.first(), scenario.commits.last()) {
        println!(
            "  {} commits, #{}..#{} (--verbose prints each)",
            scenario.commits.len(),
            first.position,
            last.position
        );
    }
    for note in &scenario.notes {
        say(&format!("  note: {note}"), 8);
    }
    for op in &scenario.operations {
        say(
            &format!("  -- {} ({}): {}", op.label, op.kind, op.status),
            6,
        );
        if let Some(failure) = &op.failure {
            say(
                &format!("     failed in {}", report.names.shorten(failure)),
                7,
            );
        }
        print_plan(report, scenario, op, verbose);
    }
    let a = &scenario.afterwards;
    let held: Vec<String> = a
        .executors
        .iter()
        .map(|(executor, n)| format!("{executor} {n}"))
        .collect();
    say(
        &format!(
            "  afterwards: {} is {} ({}), {} member(s)",
            a.cluster_label,
            a.status,
            report.names.shorten(&a.description),
            a.members
        ),
        4,
    );
    say(
        &format!(
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
        ),
        4,
    );
}

/// The operation's rollback plan: whole with `--verbose`; otherwise its rule and target
/// whole, its compensations counted by action in plan order, what it kept grouped by why.
fn print_plan(
    report: &DemoReport,
    scenario: &ScenarioReport,
    op: &OperationOutcome,
    verbose: bool,
) {
    let (Some(rendered), Some(plan)) = (&op.plan, &op.rollback_plan) else {
        return;
    };
    // The plan names its target by its short id; say its name.
    let short_target = short_aggregate(&scenario.afterwards.cluster);
    let label = &scenario.afterwards.cluster_label;
    let named = |line: &str| report.names.shorten(line).replacen(&short_target, label, 1);
    println!("     rollback plan:");
    for line in rendered.lines() {
        let summarised = line.starts_with("  ")
            || line.starts_with("compensations")
            || line.starts_with("retained");
        if verbose || !summarised {
            say(&format!("       {}", named(line)), 9);
        }
    }
    if verbose {
        return;
    }
    let mut by_action: Vec<(String, usize)> = Vec::new();
    for c in &plan.compensations {
        let executor = match &c.compensation.executor {
            Executor::Ledger => "ledger".to_string(),
            Executor::Service(s) => s.clone(),
        };
        let what = format!("{} by {executor}", action_word(&c.compensation.action));
        match by_action.iter_mut().find(|(w, _)| *w == what) {
            Some((_, n)) => *n += 1,
            None => by_action.push((what, 1)),
        }
    }
    let counted: Vec<String> = by_action.iter().map(|(w, n)| format!("{n} {w}")).collect();
    say(
        &format!(
            "       compensations: {}",
            if counted.is_empty() {
                "none".to_string()
            } else {
                counted.join(", ")
            }
        ),
        9,
    );
    let mut by_why: Vec<(&str, Vec<String>)> = Vec::new();
    for r in &plan.retained {
        let resource = report.names.shorten(&r.resource);
        match by_why.iter_mut().find(|(w, _)| *w == r.why) {
            Some((_, kept)) => kept.push(resource),
            None => by_why.push((&r.why, vec![resource])),
        }
    }
    if by_why.is_empty() {
        println!("       retained: none");
    }
    for (why, kept) in by_why {
        say(
            &format!(
                "       retained {}: {}",
                kept.join(", "),
                report.names.shorten(why)
            ),
            9,
        );
    }
}

/// A path as one shell word: as it is when it needs no quoting, else in single quotes.
fn shell_word(text: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+:@%,=".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        text.to_string()
    } else {
        format!("'{}'", text.replace('\'', "'\\''"))
    }
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
