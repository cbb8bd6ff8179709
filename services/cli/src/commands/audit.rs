//! `provledger audit`: hash chains and version continuity per aggregate, position
//! continuity, quarantined entries, the sled copy against the log, and the contract's
//! invariants. Exit 1 on any violation, each listed with what to do.

use std::time::Instant;

use provledger_client::{Ledger, LedgerOptions};
use provledger_events::log::OpenSledError;
use provledger_events::{SledLog, Timestamp};
use provledger_projections::audit::{counts, AuditReport};
use provledger_serve::{
    audit_copy, audit_log, AuditError, HistoryCopy, OnChainViolation, ProjectionStore,
};

use super::state::progress_bar;
use super::{print_json, CommandError};

impl From<AuditError> for CommandError {
    fn from(e: AuditError) -> Self {
        match e {
            AuditError::Read(r) => r.into(),
            AuditError::Store(s) => s.into(),
            e @ AuditError::PartialCopy { .. } => CommandError::Problem(e.to_string()),
        }
    }
}

/// The copy to compare with the stream when auditing JetStream: the data dir's projection
/// store, if it copies this stream and no running service holds it.
fn service_copy(
    options: &LedgerOptions,
    notes: &mut Vec<String>,
) -> Option<(SledLog, ProjectionStore)> {
    if !options.data_dir.join("sled").exists() {
        notes.push(format!(
            "no sled copy at {}: only the stream was audited",
            options.data_dir.display()
        ));
        return None;
    }
    let dir = match SledLog::open(&options.data_dir) {
        Ok(dir) => dir,
        Err(OpenSledError::Locked { dir, holder }) => {
            notes.push(format!(
                "the copy in {} was not compared: another process ({holder}) has that data \
                 dir open, as a running `provledger serve` does; the stream was audited",
                dir.display()
            ));
            return None;
        }
        Err(e) => {
            notes.push(format!("the copy was not compared: {e}"));
            return None;
        }
    };
    let store = ProjectionStore::open(dir.db()).ok()?;
    let wanted = format!("jetstream:{}", options.stream);
    match store.source().ok().flatten() {
        Some(source) if source == wanted => Some((dir, store)),
        other => {
            notes.push(format!(
                "{} copies {}, not {wanted}: not compared",
                options.data_dir.display(),
                other.unwrap_or_else(|| "nothing".into())
            ));
            dir.close();
            None
        }
    }
}

pub async fn run(options: &LedgerOptions, json: bool) -> Result<(), CommandError> {
    let started = Instant::now();
    let mut notes = Vec::new();
    let copy = match options.nats_url {
        Some(_) => service_copy(options, &mut notes),
        None => None,
    };
    // Opened first: a missing data dir or stream is told before anything else is read.
    let ledger = Ledger::open_existing(options).await?;
    let bar = progress_bar(0, "auditing");
    let progress = |done: u64, end: u64| {
        bar.set_length(end);
        bar.set_position(done);
    };
    let now = Timestamp::now();
    let result = match &ledger {
        Ledger::Embedded(log) => {
            let store = ProjectionStore::open(log.db())?;
            match store.source()? {
                // A stopped replica's data dir: its copy of the stream, offline.
                Some(source) if source != "embedded" => match store.history_copy()? {
                    HistoryCopy::Separate(extent) => {
                        notes.push(format!(
                            "offline: the copy of {source} in {} (positions {} to {}); the stream itself was not read",
                            options.data_dir.display(),
                            extent.from,
                            extent.through
                        ));
                        audit_copy(&store, now, progress).map_err(CommandError::from)
                    }
                    _ => Err(CommandError::BadInput(format!(
                        "{} holds the projection of {source} and no copy of it; audit it with --nats",
                        options.data_dir.display()
                    ))),
                },
                // The embedded projection copies the embedded log: compared as well.
                _ => audit_log(log, OnChainViolation::Fail, Some(&store), now, progress)
                    .await
                    .map_err(CommandError::from),
            }
        }
        Ledger::Memory(_) => Err(CommandError::BadInput(
            "an in-memory ledger cannot be audited from the command line".into(),
        )),
        Ledger::JetStream(log) => audit_log(
            log,
            OnChainViolation::Quarantine,
            copy.as_ref().map(|(_, s)| s),
            now,
            progress,
        )
        .await
        .map_err(CommandError::from),
    };
    bar.finish_and_clear();
    ledger.close();
    if let Some((dir, _)) = copy {
        dir.close();
    }
    let report = result?;
    print_report(&report, &notes, started.elapsed().as_secs_f64(), json);
    if report.violations.is_empty() {
        Ok(())
    } else if let Some(u) = &report.first_undecodable {
        Err(CommandError::Problem(format!(
            // The subject is the log's, not ours: Debug-quoted.
            "audit found {} violation(s); this build could not decode {} commit(s), the first at position {} ({:?})",
            report.violations.len(),
            report.undecodable,
            u.position,
            u.subject
        )))
    } else {
        Err(CommandError::Problem(format!(
            "audit found {} violation(s)",
            report.violations.len()
        )))
    }
}

/// `format 1: 1,000 commits, format 2: 3 commits`, or that none was decoded.
fn formats_seen(report: &AuditReport) -> String {
    if report.formats.is_empty() {
        return "no commit decoded".into();
    }
    report
        .formats
        .iter()
        .map(|(format, n)| format!("format {format}: {n} commit(s)"))
        .collect::<Vec<_>>()
        .join(", ")
}

pub(super) fn print_report(report: &AuditReport, notes: &[String], seconds: f64, json: bool) {
    if json {
        let mut value = serde_json::to_value(report).expect(
            "an audit report: plain serde data (string keys, no fallible impls) encodes as JSON",
        );
        value["ok"] = report.violations.is_empty().into();
        value["notes"] = notes.into();
        value["seconds"] = seconds.into();
        print_json(&value);
        return;
    }
    for v in &report.violations {
        let mut at = Vec::new();
        if let Some(a) = &v.aggregate {
            at.push(a.clone());
        }
        if let Some(version) = v.version {
            at.push(format!("v{version}"));
        }
        if let Some(p) = v.position {
            at.push(format!("position {p}"));
        }
        let check = serde_json::to_value(v.check)
            .expect("a check: plain serde data (string keys, no fallible impls) encodes as JSON");
        println!(
            "VIOLATION [{}] {}: {}\n    what to do: {}",
            check.as_str().unwrap_or("?"),
            at.join(" "),
            v.problem,
            super::invocation::current().in_text(&v.action)
        );
    }
    for r in &report.resolved_by_hand {
        println!(
            "resolved by hand: {} compensation {} by {} at position {}: {}",
            r.operation, r.compensation_id, r.actor, r.position, r.reason
        );
    }
    for l in &report.acknowledged_losses {
        println!(
            "loss acknowledged: {} v{}..=v{} by {} at position {}: {}",
            l.aggregate, l.from_version, l.to_version, l.actor, l.position, l.reason
        );
    }
    for note in notes {
        println!("note: {note}");
    }
    println!(
        "audited positions 1..={}: {} commits, {} events, {} aggregates, {} quarantined, in {seconds:.2} s",
        report.position, report.commits, report.events, report.aggregates, report.quarantined
    );
    println!("formats read: {}", formats_seen(report));
    if let Some(u) = &report.first_undecodable {
        // The subject and error are the log's bytes, not ours: Debug-quoted.
        println!(
            "undecodable: {} entr(ies) this build could not read; the first at position {} on {:?}{}: {:?} (a newer build's commit? upgrade this reader; garbage? find who publishes there)",
            report.undecodable,
            u.position,
            u.subject,
            u.format.map(|f| format!(" (format byte {f})")).unwrap_or_default(),
            u.error
        );
    }
    if report.violations.is_empty() {
        println!("audit: ok, no violation");
    } else {
        let by_check: Vec<String> = counts(&report.violations)
            .iter()
            .map(|(c, n)| {
                let name = serde_json::to_value(c).expect(
                    "a check: plain serde data (string keys, no fallible impls) encodes as JSON",
                );
                format!("{} {n}", name.as_str().unwrap_or("?"))
            })
            .collect();
        println!(
            "audit: {} violation(s) ({})",
            report.violations.len(),
            by_check.join(", ")
        );
    }
}
