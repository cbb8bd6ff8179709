//! `provledger history KIND/ID`: an aggregate's commits, oldest first, with a chain check.

use provledger_events::{verify_chain, AggregateId, EventLog};
use provledger_projections::timeline;

use super::{print_json, CommandError};
use provledger_client::Ledger;

pub async fn run(ledger: &Ledger, aggregate: AggregateId, json: bool) -> Result<(), CommandError> {
    let commits = ledger.read_aggregate(aggregate).await?;
    if commits.is_empty() {
        return Err(CommandError::Problem(format!(
            "{aggregate} not found: it has no commits in this ledger (check --data-dir / --nats)"
        )));
    }
    let violations = verify_chain(&aggregate, &commits);
    if json {
        print_json(&serde_json::json!({
            "aggregate": aggregate.to_string(),
            "commits": commits,
            "chain_violations": violations.iter().map(|v| v.to_string()).collect::<Vec<_>>(),
        }));
    } else {
        for commit in &commits {
            println!(
                "-- v{} at #{} {} by {} commit {}",
                commit.version, commit.position, commit.recorded_at, commit.actor, commit.commit_id
            );
            for line in timeline::render(commit) {
                println!("   {line}");
            }
        }
        if violations.is_empty() {
            println!("hash chain: ok ({} commits)", commits.len());
        } else {
            for v in &violations {
                println!("hash chain VIOLATION: {v}");
            }
        }
    }
    if violations.is_empty() {
        Ok(())
    } else {
        Err(CommandError::Problem(format!(
            "{} hash-chain violation(s) in {aggregate}",
            violations.len()
        )))
    }
}
