//! `provledger demo`: runs the demo scenarios (`provledger-sim`) and prints them for a
//! person: each scenario's commits once, in log order, with names instead of ids; its
//! operations (by kind and short id) and their rollback plans; what remained; then the
//! audit and the commands, with the global flags the user gave, that look at a rollback
//! it just showed.
//!
//! Without `--nats` it runs embedded in a fresh data dir. With `--nats` it writes to that
//! server's stream, the log a `provledger serve --nats` consumes and its console shows,
//! on new aggregates every run; its executors are simulated in this process either way.

use std::path::{Path, PathBuf};
use std::time::Duration;

use provledger_client::{Ledger, LedgerOptions};
use provledger_events::catalogue::Executor;
use provledger_events::short_aggregate;
use provledger_events::{SledLog, Timestamp};
use provledger_projections::audit::AuditReport;
use provledger_projections::planner::action_word;
use provledger_serve::{audit_log, OnChainViolation};
use provledger_sim::demo::{self, wrap, DemoReport, OperationOutcome, ScenarioReport};

use super::{print_json, CommandError};

/// The longest the demo may take on a stream. Each connect, append and read is bounded on
/// its own; this bounds them together, so that a server that stalls is reported, not
/// waited on (the demo takes a few seconds).
const DEMO_ON_STREAM_MS_MAX: u64 = 120_000;

/// Where the demo wrote.
enum Place {
    /// A fresh data dir of its own.
    DataDir(PathBuf),
    /// A JetStream stream (`stream`) at `url` (its password shown as `***`).
    Stream { url: String, stream: String },
}

pub async fn run(options: &LedgerOptions, verbose: bool, json: bool) -> Result<(), CommandError> {
    let (report, audit, place) = match &options.nats_url {
        None => embedded(&options.data_dir).await?,
        Some(url) => on_stream(options, url).await?,
    };
    let mut violations: Vec<String> = report.chain_violations.clone();
    violations.extend(
        audit
            .violations
            .iter()
            .map(|v| format!("{}: {}", v.aggregate.clone().unwrap_or_default(), v.problem)),
    );
    let next = Next::of(&report, &place);
    if json {
        let (data_dir, stream) = match &place {
            Place::DataDir(dir) => (Some(dir.display().to_string()), None),
            Place::Stream { url, stream } => (
                None,
                Some(serde_json::json!({"nats": url, "stream": stream})),
            ),
        };
        print_json(&serde_json::json!({
            "data_dir": data_dir,
            "stream": stream,
            "start_position": report.start_position,
            "scenarios": report.scenarios,
            "audit": {
                "aggregates": report.aggregates,
                "commits": report.commits,
                "positions": audit.position,
                "log_commits": audit.commits,
                "violations": violations,
            },
            "drift": {"held": report.held, "findings": report.drift},
            "next": next.as_ref().map(|n| &n.commands),
        }));
    } else {
        print_report(&report, &audit, &place, &violations, verbose);
        if let Some(next) = &next {
            next.print(&place);
        }
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

fn demo_error(e: demo::DemoError) -> CommandError {
    match e {
        demo::DemoError::DataDir { .. } => CommandError::Infrastructure(e.to_string()),
        other => CommandError::Problem(other.to_string()),
    }
}

/// In a fresh data dir under `base_dir`, then the same audit `provledger audit` runs on it.
async fn embedded(base_dir: &Path) -> Result<(DemoReport, AuditReport, Place), CommandError> {
    let report = demo::run(base_dir).await.map_err(demo_error)?;
    let dir = report.data_dir.clone();
    assert!(
        !dir.as_os_str().is_empty(),
        "an embedded demo reports its data dir"
    );
    let log = SledLog::open(&dir).map_err(|e| CommandError::Infrastructure(e.to_string()))?;
    let audit = audit_log(
        &log,
        OnChainViolation::Fail,
        None,
        Timestamp::now(),
        |_, _| {},
    )
    .await;
    log.close();
    Ok((report, audit?, Place::DataDir(dir)))
}

/// On the stream at `url` (created if missing, as `serve` and `append` do), within
/// [`DEMO_ON_STREAM_MS_MAX`]; then the audit of the whole stream, as `provledger --nats URL
/// audit` runs it.
async fn on_stream(
    options: &LedgerOptions,
    url: &str,
) -> Result<(DemoReport, AuditReport, Place), CommandError> {
    let place = Place::Stream {
        url: provledger_client::redacted_nats_url(url),
        stream: options.stream.clone(),
    };
    let ledger = Ledger::open(options).await?;
    let bound = Duration::from_millis(DEMO_ON_STREAM_MS_MAX);
    let outcome = match tokio::time::timeout(bound, demo::run_on(&ledger)).await {
        Ok(Ok(report)) => {
            let audit = audit_log(
                &ledger,
                OnChainViolation::Quarantine,
                None,
                Timestamp::now(),
                |_, _| {},
            )
            .await;
            audit
                .map(|audit| (report, audit))
                .map_err(CommandError::from)
        }
        Ok(Err(e)) => Err(demo_error(e)),
        Err(_) => Err(CommandError::Infrastructure(format!(
            "the demo did not finish within {} s on stream {} at {}: the server answers too \
             slowly; what it wrote so far stays in the stream",
            DEMO_ON_STREAM_MS_MAX / 1000,
            options.stream,
            provledger_client::redacted_nats_url(url),
        ))),
    };
    ledger.close();
    outcome.map(|(report, audit)| (report, audit, place))
}

/// The commands that look at the first rollback the demo showed, with the global flags
/// the user gave (embedded: the demo's data dir, through `$DIR`), to paste as printed.
struct Next {
    /// What they look at: the operation by its short id, its kind and its scenario.
    about: String,
    operation: uuid::Uuid,
    commands: Vec<String>,
}

impl Next {
    fn of(report: &DemoReport, place: &Place) -> Option<Next> {
        let (scenario, op) = report.first_rolled_back()?;
        let failure = report
            .scenarios
            .iter()
            .take_while(|s| !std::ptr::eq(*s, scenario))
            .filter(|s| s.failure)
            .count()
            + 1;
        // Commands are printed whole, never wrapped, so that they can be pasted as they
        // are, with the short ids the demo names things by (every command takes them;
        // docs/cli.md, "Short ids").
        let me = match place {
            Place::DataDir(_) => format!("{} --data-dir \"$DIR\"", invocation()),
            Place::Stream { .. } => {
                let flags = super::invocation::current().command("");
                let flags = flags.trim_end();
                format!(
                    "{}{}",
                    invocation(),
                    flags.strip_prefix("provledger").unwrap_or(flags)
                )
            }
        };
        let id = op.id;
        let short = demo::short(&id);
        let target = provledger_events::short_aggregate(&scenario.afterwards.cluster);
        Some(Next {
            about: format!(
                "operation {} ({}, failure scenario {failure})",
                demo::short(&id),
                op.kind
            ),
            operation: id,
            commands: vec![
                format!("{me} operation show {short}"),
                format!("{me} rollback plan {short}"),
                format!("{me} history operation/{short}"),
                format!("{me} history {target}"),
                format!("{me} audit"),
            ],
        })
    }

    fn print(&self, place: &Place) {
        say(
            &format!(
                "look at the rollback of {}: the operation whole, its recorded plan, its \
                 commits and its cluster's, then the audit{} (paste as is):",
                self.about,
                match place {
                    Place::DataDir(_) => ", in the demo's data dir",
                    Place::Stream { .. } => "",
                }
            ),
            2,
        );
        if let Place::DataDir(dir) = place {
            // Absolute, so that the commands work from any directory; the path once, in a
            // shell variable, so each command stays within the line budget however deep
            // the data dir is.
            let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.clone());
            println!("  DIR={}", shell_word(&dir.display().to_string()));
        }
        for command in &self.commands {
            println!("  {command}");
        }
        if let Place::Stream { .. } = place {
            say(
                "`operation show` over --nats asks a running `provledger serve` on this \
                 stream (without one it exits 3 saying so); `rollback plan`, \
                 `history` and `audit` read the stream itself",
                2,
            );
            say(
                &format!(
                    "with `provledger serve --nats URL --http ADDR` on this stream, its console \
                     shows it at http://ADDR/operations/{}",
                    self.operation
                ),
                2,
            );
        }
    }
}

/// Prints a line wrapped at [`demo::LINE_COLUMNS_MAX`] columns, continuations indented.
fn say(line: &str, indent: usize) {
    for part in wrap(line, indent) {
        println!("{part}");
    }
}

fn print_report(
    report: &DemoReport,
    audit: &AuditReport,
    place: &Place,
    violations: &[String],
    verbose: bool,
) {
    match place {
        Place::DataDir(dir) => say(
            &format!(
                "provledger demo: embedded (sled only, no NATS), data in {}; executors \
                 simulated in this process",
                dir.display()
            ),
            2,
        ),
        Place::Stream { url, stream } => say(
            &format!(
                "provledger demo: on stream {stream} at {url}, after its position #{}, on new \
                 aggregates (a `provledger serve` on this stream and its console see each \
                 commit as it lands); executors simulated in this process, not on NATS",
                report.start_position
            ),
            2,
        ),
    }
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
    let verdict = if violations.is_empty() {
        "ok".to_string()
    } else {
        format!("{} VIOLATIONS", violations.len())
    };
    match place {
        Place::DataDir(_) => say(
            &format!(
                "audit: {} aggregates, {} commits, hash chains, positions and invariants {verdict}",
                report.aggregates, report.commits,
            ),
            2,
        ),
        Place::Stream { stream, .. } => say(
            &format!(
                "audit: the demo's {} commits on {} aggregates read back, hash chains checked; \
                 the whole stream {stream} ({} commits to #{}, not only the demo's) audited as \
                 `audit` does: {verdict}",
                report.commits, report.aggregates, audit.commits, audit.position,
            ),
            2,
        ),
    }
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
        // By its short id, as `operation list`, `operation show` and the console name it.
        let line = format!(
            "  -- operation {} ({}): {}",
            demo::short(&op.id),
            op.kind,
            op.status
        );
        say(&line, 6);
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
