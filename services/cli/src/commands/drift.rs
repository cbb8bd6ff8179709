//! `provledger drift [--executor NAME] [--executors-url URL]`: what the executors hold
//! against what the ledger says exists (`docs/drift.md`). The shell around the pure
//! comparison (`provledger_projections::drift`): it folds the log's operations, asks each
//! executor's inventory over NATS, folds the commits appended meanwhile, compares, prints.
//! It never writes.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use provledger_client::inventory::{read_inventory, InventoryError};
use provledger_client::{Ledger, NatsAuth};
use provledger_events::{AggregateKind, EventLog, ReadError};
use provledger_projections::drift::{compare, recorded_resources, Finding, InventoryItem};
use provledger_projections::{Entity, Projection};

use super::state::progress_bar;
use super::{print_json, CommandError};

/// How long one inventory page may take to come back.
const INVENTORY_REPLY_WAIT: Duration = Duration::from_secs(10);

/// What drift was asked to do.
pub struct DriftArgs<'a> {
    pub executor: Option<String>,
    pub executors_url: Option<&'a str>,
    pub auth: &'a NatsAuth,
    pub subject_prefix: &'a str,
    pub json: bool,
}

/// The operations of the log, folded, and how far.
struct Operations {
    projection: Projection,
    position: u64,
    quarantined: u64,
}

impl Operations {
    /// Folds the operation commits after `self.position` up to the log's end.
    async fn catch_up(&mut self, ledger: &Ledger, what: &str) -> Result<(), CommandError> {
        let end = ledger.last_position().await?;
        if end <= self.position {
            return Ok(());
        }
        let bar = progress_bar(end - self.position, what);
        let from = self.position + 1;
        let mut stream = ledger.read_all(from).await?;
        while let Some(entry) = stream.next().await {
            match entry {
                Ok(commit) => {
                    if commit.position > end {
                        break;
                    }
                    self.position = commit.position;
                    bar.set_position(commit.position - from + 1);
                    if commit.aggregate.kind != AggregateKind::Operation {
                        continue;
                    }
                    // Outside its chain (replayed, forged): quarantined, as serve does.
                    if self.projection.apply_checked(&commit).is_err() {
                        self.quarantined += 1;
                    }
                }
                Err(
                    ReadError::Undecodable { position, .. }
                    | ReadError::OutsideChain { position, .. },
                ) => {
                    self.position = self.position.max(position);
                    self.quarantined += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
        bar.finish_and_clear();
        Ok(())
    }

    fn operations(
        &self,
    ) -> impl Iterator<Item = &provledger_projections::operation::OperationState> {
        self.projection.entities.values().filter_map(|e| match e {
            Entity::Operation(op) => Some(op),
            _ => None,
        })
    }
}

/// One executor's inventory, or why it could not be read.
struct Asked {
    executor: String,
    held: Result<Vec<InventoryItem>, InventoryError>,
}

pub async fn run(ledger: &Ledger, args: DriftArgs<'_>) -> Result<(), CommandError> {
    let url = args.executors_url.ok_or_else(|| {
        CommandError::BadInput(
            "drift asks the executors over NATS: pass --executors-url URL (or --nats)".into(),
        )
    })?;
    let mut ops = Operations {
        projection: Projection::new(),
        position: 0,
        quarantined: 0,
    };
    ops.catch_up(ledger, "reading the ledger").await?;
    let executors: BTreeSet<String> = match &args.executor {
        Some(name) => BTreeSet::from([name.clone()]),
        None => recorded_resources(ops.operations()).executors(),
    };
    let client = provledger_client::connect_nats(url, "provledger-drift", args.auth).await?;
    let mut asked = Vec::new();
    for executor in &executors {
        let bar = progress_bar(0, &format!("inventory of {executor}"));
        let held = read_inventory(
            &client,
            args.subject_prefix,
            executor,
            INVENTORY_REPLY_WAIT,
            |n| bar.inc(n as u64),
        )
        .await;
        bar.finish_and_clear();
        asked.push(Asked {
            executor: executor.clone(),
            held,
        });
    }
    // Intent before effect: whatever an executor answered it holds had its intent recorded
    // before, so reading the commits appended while asking leaves nothing it made unknown.
    ops.catch_up(ledger, "reading the ledger's latest commits")
        .await?;
    let ledger_side = recorded_resources(ops.operations());
    let mut findings: Vec<Finding> = Vec::new();
    for a in &asked {
        if let Ok(held) = &a.held {
            findings.extend(compare(&ledger_side, &a.executor, held));
        }
    }
    report(&ops, &asked, &findings, args.json);
    outcome(&asked, &findings)
}

fn report(ops: &Operations, asked: &[Asked], findings: &[Finding], json: bool) {
    if json {
        let executors: Vec<serde_json::Value> = asked
            .iter()
            .map(|a| match &a.held {
                Ok(held) => serde_json::json!({"name": a.executor, "held": held.len()}),
                Err(e) => serde_json::json!({"name": a.executor, "error": e.to_string()}),
            })
            .collect();
        print_json(&serde_json::json!({
            "position": ops.position,
            "quarantined": ops.quarantined,
            "executors": executors,
            "findings": findings,
        }));
        return;
    }
    for a in asked {
        match &a.held {
            Ok(held) => println!("{}: {} held", a.executor, held.len()),
            Err(e) => println!("{}: not read: {e}", a.executor),
        }
    }
    for f in findings {
        println!(
            "{:<10} {} {} (entity {}, operation {}, step {})",
            word(f),
            f.executor,
            f.resource,
            f.entity.as_deref().unwrap_or("unknown"),
            f.operation_id
                .map(|o| o.to_string())
                .unwrap_or_else(|| "none".into()),
            f.step.as_deref().unwrap_or("none"),
        );
        println!("  why: {}", f.reason);
        println!("  do:  {}", f.action);
    }
    if findings.is_empty() && asked.iter().all(|a| a.held.is_ok()) {
        println!(
            "no drift: the executors hold what the ledger records (to position {})",
            ops.position
        );
    }
}

/// The finding's kind as its JSON word.
fn word(f: &Finding) -> String {
    serde_json::to_value(f.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Exit 3 if an executor could not be reached, 1 with findings or a reply that broke the
/// protocol, 0 clean.
fn outcome(asked: &[Asked], findings: &[Finding]) -> Result<(), CommandError> {
    let unreachable: Vec<&str> = asked
        .iter()
        .filter(|a| a.held.as_ref().is_err_and(InventoryError::is_unreachable))
        .map(|a| a.executor.as_str())
        .collect();
    if !unreachable.is_empty() {
        return Err(CommandError::Infrastructure(format!(
            "drift could not read the inventory of {}: the comparison is incomplete; check \
             that they run and answer <prefix>.exec.<name>.inventory, then run drift again",
            unreachable.join(", ")
        )));
    }
    let broken = asked.iter().filter(|a| a.held.is_err()).count();
    if !findings.is_empty() || broken > 0 {
        return Err(CommandError::Problem(format!(
            "{} drift finding(s){}; each is listed with what to do",
            findings.len(),
            if broken > 0 {
                format!(", and {broken} executor(s) answered outside the protocol")
            } else {
                String::new()
            }
        )));
    }
    Ok(())
}
