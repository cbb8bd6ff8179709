//! `provledger history KIND/ID`: an aggregate's commits, oldest first, with a chain check,
//! and anything else found on its subject (quarantined entries) in place.

use provledger_events::{AggregateId, ChainViolation, EventLog, HistoryEntry, OpenLosses};
use provledger_projections::timeline;

use super::{print_json, CommandError};
use provledger_client::Ledger;
use provledger_serve::ProjectionStore;

/// The aggregate's entries: from the log; or, in a stopped service's data dir (whose log
/// tree is empty: the service writes its copy of the stream into the projection store),
/// from that copy, as `state` reads it.
async fn entries(
    ledger: &Ledger,
    aggregate: AggregateId,
) -> Result<Vec<HistoryEntry>, CommandError> {
    if let Ledger::Embedded(log) = ledger {
        if let Some(stream) = ProjectionStore::copied_stream(log.db())? {
            tracing::info!(%stream, "data dir holds a service's copy; reading it offline");
            let store = ProjectionStore::open(log.db())?;
            let commits = store.aggregate_commits(&aggregate, u64::MAX)?;
            return Ok(commits.into_iter().map(HistoryEntry::Commit).collect());
        }
    }
    Ok(ledger.aggregate_history(aggregate).await?)
}

pub async fn run(ledger: &Ledger, aggregate: AggregateId, json: bool) -> Result<(), CommandError> {
    let entries = entries(ledger, aggregate).await?;
    let commits: Vec<_> = entries
        .iter()
        .filter_map(HistoryEntry::commit)
        .cloned()
        .collect();
    if commits.is_empty() {
        return Err(CommandError::Problem(format!(
            "{aggregate} not found: it has no commits in this ledger (check --data-dir / --nats)"
        )));
    }
    let violations = HistoryEntry::verify(&aggregate, &entries);
    let open_losses = HistoryEntry::open_losses(&entries);
    let lost = lost_json(&entries, &open_losses);
    let quarantined = quarantined_json(&entries);
    if json {
        print_json(&serde_json::json!({
            "aggregate": aggregate.to_string(),
            "commits": commits,
            "quarantined": quarantined,
            "lost": lost,
            "chain_violations": violations.iter().map(|v| v.to_string()).collect::<Vec<_>>(),
        }));
    } else {
        print_entries(&entries, &open_losses);
        print_chain_check(&open_losses, &violations, commits.len(), quarantined.len());
    }
    chain_verdict(aggregate, &open_losses, &violations)
}

/// The losses among the entries, as JSON: their versions, where the log goes on, and
/// whether each was acknowledged.
fn lost_json(entries: &[HistoryEntry], open_losses: &OpenLosses) -> Vec<serde_json::Value> {
    entries
        .iter()
        .filter_map(|e| match e {
            HistoryEntry::Lost(l) => Some(serde_json::json!({
                "from_version": l.from_version,
                "to_version": l.to_version,
                "next_position": l.next_position,
                "acknowledged": !open_losses.as_slice().contains(l),
            })),
            _ => None,
        })
        .collect()
}

/// The quarantined entries, as JSON: where each is and why.
fn quarantined_json(entries: &[HistoryEntry]) -> Vec<serde_json::Value> {
    entries
        .iter()
        .filter_map(|e| match e {
            HistoryEntry::Quarantined {
                position,
                subject,
                reason,
            } => Some(serde_json::json!({
                "position": position, "subject": subject, "reason": reason,
            })),
            HistoryEntry::Commit(_) | HistoryEntry::Lost(_) => None,
        })
        .collect()
}

/// Prints every entry in order: each commit with its events, each quarantined entry and
/// each loss in place.
fn print_entries(entries: &[HistoryEntry], open_losses: &OpenLosses) {
    for entry in entries {
        match entry {
            HistoryEntry::Commit(commit) => {
                println!(
                    "-- v{} at #{} {} by {} commit {}",
                    commit.version,
                    commit.position,
                    commit.recorded_at,
                    commit.actor,
                    commit.commit_id
                );
                for line in timeline::render(commit) {
                    println!("   {line}");
                }
            }
            HistoryEntry::Quarantined {
                position, reason, ..
            } => println!("-- QUARANTINED at #{position}: {reason} (not part of the chain)"),
            HistoryEntry::Lost(l) if open_losses.as_slice().contains(l) => {
                println!(
                    "-- LOST v{}: missing from the log, not acknowledged",
                    l.range()
                )
            }
            HistoryEntry::Lost(l) => {
                println!("-- LOST v{}: missing from the log; acknowledged", l.range())
            }
        }
    }
}

/// Prints the chain check's result: broken by an open loss, ok, or each violation.
fn print_chain_check(
    open_losses: &OpenLosses,
    violations: &[ChainViolation],
    commits: usize,
    quarantined: usize,
) {
    if let Some(loss) = open_losses.first() {
        println!("hash chain: BROKEN, integrity: {loss}");
    } else if violations.is_empty() {
        println!("hash chain: ok ({commits} commits, {quarantined} quarantined)");
    } else {
        for v in violations {
            println!("hash chain VIOLATION: {v}");
        }
    }
}

/// The command's result: an error for an open loss, else for any chain violation.
fn chain_verdict(
    aggregate: AggregateId,
    open_losses: &OpenLosses,
    violations: &[ChainViolation],
) -> Result<(), CommandError> {
    if let Some(loss) = open_losses.first() {
        Err(CommandError::Problem(format!("integrity: {loss}")))
    } else if violations.is_empty() {
        Ok(())
    } else {
        Err(CommandError::Problem(format!(
            "{} hash-chain violation(s) in {aggregate}; run `{}`",
            violations.len(),
            super::invocation::current().command("audit")
        )))
    }
}
