//! `provledger drift [--executor NAME] [--executors-url URL]`: what the executors hold
//! against what the ledger says exists (`docs/drift.md`). The shell around the pure
//! comparison (`provledger_projections::drift`): it folds the log's operations, asks each
//! executor's inventory over NATS (those the ledger names, and those discovered answering
//! the inventory subject without being named: `discover_executors`), folds the commits
//! appended meanwhile, compares, prints.
//! It writes only with `--fix leaked` (without `--dry-run`): one `remove_leaked` operation,
//! whose rollback the ordinary driver carries out (`provledger_projections::leak_removal`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use provledger_client::inventory::{
    compare_inventories, confirmed, discover_executors, fold_log, Asked, Discovery, DiscoveryError,
    InventoryError, LogFolded, ReadBounds, INVENTORY_READ_MAX,
};
use provledger_client::Writer;
use provledger_client::{
    record_leak_removal, Ledger, NatsAuth, NatsExecutors, RollbackDriver, Stamper,
};
use provledger_events::EventLog;
use provledger_projections::drift::{DriftFold, Finding, FindingKind};
use provledger_projections::leak_removal::{
    leak_removal_events, plan_leak_removal, render_leak_removal, LeakRemovalPlan,
};
use provledger_projections::operation::OperationState;
use provledger_projections::rollback::RetryPolicy;
use uuid::Uuid;

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
    /// `--fix leaked`: remove the leaked resources, recorded.
    pub fix: Option<Fix>,
}

/// `--fix leaked [--dry-run] --reason TEXT [--actor NAME]`.
pub struct Fix {
    pub dry_run: bool,
    pub reason: String,
    pub actor: String,
}

/// What `--fix leaked` did.
struct Fixed {
    plan: LeakRemovalPlan,
    /// The `remove_leaked` operation recorded, and where its rollback ended.
    operation: Option<OperationState>,
    dry_run: bool,
}

/// Which executors drift asked, and why.
struct Sought {
    /// Those the ledger names (or the one `--executor` named).
    named: BTreeSet<String>,
    /// The discovery round (none with `--executor`): what it found, or why it failed.
    discovery: Option<Result<Discovery, DiscoveryError>>,
}

impl Sought {
    fn is_discovered(&self, executor: &str) -> bool {
        matches!(&self.discovery, Some(Ok(d)) if d.discovered.contains(executor))
    }

    /// Every executor to ask: the named ones, then the discovered ones, in name order.
    fn executors(&self) -> Vec<String> {
        let mut all = self.named.clone();
        if let Some(Ok(d)) = &self.discovery {
            all.extend(d.discovered.iter().cloned());
        }
        all.into_iter().collect()
    }

    fn json(&self) -> serde_json::Value {
        match &self.discovery {
            None => serde_json::Value::Null,
            Some(Err(e)) => serde_json::json!({"error": e.to_string()}),
            Some(Ok(d)) => serde_json::json!({
                "discovered": d.discovered,
                "not_asked": d.not_asked,
                "rejected": d.rejected,
                "rejected_not_listed": d.rejected_not_listed,
                "wildcard_subscriptions": d.wildcard_subscriptions,
                "servers": d.servers,
                "incomplete": d.incomplete,
            }),
        }
    }

    /// What discovery says, a line each (text output).
    fn print(&self) {
        let discovered = match &self.discovery {
            None => {
                println!("asked {} only (--executor): no discovery", self.names());
                return;
            }
            Some(Err(e)) => {
                println!("discovery failed: {e}");
                println!(
                    "asked the {} executor(s) the ledger names",
                    self.named.len()
                );
                return;
            }
            Some(Ok(d)) => d,
        };
        println!(
            "asked {} executor(s): {} named by the ledger, {} discovered{}",
            self.named.len() + discovered.discovered.len(),
            self.named.len(),
            discovered.discovered.len(),
            if discovered.discovered.is_empty() {
                String::new()
            } else {
                let names: Vec<&str> = discovered.discovered.iter().map(String::as_str).collect();
                format!(" ({})", names.join(", "))
            }
        );
        for name in &discovered.rejected {
            // Debug form: control characters and quotes escaped, never printed raw.
            println!(
                "discovery: {name:?} answers inventories but is not an executor name: not asked"
            );
        }
        if discovered.rejected_not_listed > 0 {
            println!(
                "discovery: {} more name(s) that are not executor names, not listed",
                discovered.rejected_not_listed
            );
        }
        for why in &discovered.incomplete {
            println!("discovery incomplete: {why}");
        }
    }

    /// Why discovery may have missed executors, if it may have.
    fn unseen(&self) -> Option<String> {
        match &self.discovery {
            None => None,
            Some(Err(e)) => Some(format!("discovery failed: {e}")),
            Some(Ok(d)) if d.incomplete.is_empty() => None,
            Some(Ok(d)) => Some(format!("discovery incomplete: {}", d.incomplete.join("; "))),
        }
    }

    fn saw_everything(&self) -> bool {
        self.unseen().is_none() && self.rejected() == 0
    }

    /// Names answering inventories that fail the grammar.
    fn rejected(&self) -> u64 {
        match &self.discovery {
            Some(Ok(d)) => d.rejected.len() as u64 + d.rejected_not_listed,
            _ => 0,
        }
    }

    fn names(&self) -> String {
        let names: Vec<&str> = self.named.iter().map(String::as_str).collect();
        names.join(", ")
    }
}

/// The ledger's side of drift, folded from the log, and how far.
struct Operations {
    fold: DriftFold,
    done: LogFolded,
}

impl Operations {
    /// Folds the commits after `self.done.position` up to the log's end.
    async fn catch_up(&mut self, ledger: &Writer<Ledger>, what: &str) -> Result<(), CommandError> {
        let end = ledger.log().last_position().await?;
        if end <= self.done.position {
            return Ok(());
        }
        let from = self.done.position + 1;
        let bar = progress_bar(end - self.done.position, what);
        fold_log(
            ledger.log(),
            &mut self.fold,
            &mut self.done,
            end,
            |position| bar.set_position(position - from + 1),
        )
        .await?;
        bar.finish_and_clear();
        let (open, reduced) = self.fold.counts();
        tracing::info!(
            position = self.done.position,
            quarantined = self.done.quarantined,
            reopened = self.done.reopened,
            open,
            reduced,
            "ledger folded for drift"
        );
        Ok(())
    }
}

pub async fn run(ledger: &Writer<Ledger>, args: DriftArgs<'_>) -> Result<(), CommandError> {
    let url = args.executors_url.ok_or_else(|| {
        CommandError::BadInput(
            "drift asks the executors over NATS: pass --executors-url URL (or --nats)".into(),
        )
    })?;
    if let Some(name) = &args.executor {
        if !provledger_events::catalogue::operation::executor_name_is_valid(name) {
            return Err(CommandError::BadInput(format!(
                "--executor {name:?}: an executor name is 1 to {} ASCII letters, digits, '_' or '-'",
                provledger_events::catalogue::operation::EXECUTOR_NAME_BYTES_MAX
            )));
        }
    }
    if let Some(fix) = &args.fix {
        if !fix.dry_run && fix.reason.trim().is_empty() {
            return Err(CommandError::BadInput(
                "drift --fix leaked records why in the ledger: pass --reason TEXT (or \
                 --dry-run to see the plan)"
                    .into(),
            ));
        }
    }
    let mut ops = Operations {
        fold: DriftFold::new(),
        done: LogFolded::default(),
    };
    ops.catch_up(ledger, "reading the ledger").await?;
    let before = ops.fold.resources();
    let named: BTreeSet<String> = match &args.executor {
        Some(name) => BTreeSet::from([name.clone()]),
        None => before.executors(),
    };
    let client = provledger_client::connect_nats(url, "provledger-drift", args.auth).await?;
    // Executors that answer inventories without the ledger naming them hold only what the
    // ledger never recorded: they are asked too, unless one executor was named.
    let discovery = match &args.executor {
        Some(_) => None,
        None => Some(discover_executors(&client, args.subject_prefix, &named).await),
    };
    let sought = Sought { named, discovery };
    let executors = sought.executors();
    let bar = progress_bar(
        0,
        &format!("inventories of {} executor(s)", executors.len()),
    );
    let bounds = ReadBounds {
        reply_wait: INVENTORY_REPLY_WAIT,
        whole: INVENTORY_READ_MAX,
    };
    let asked = compare_inventories(
        &client,
        args.subject_prefix,
        &executors,
        bounds,
        &before,
        &|_, n| bar.inc(n as u64),
    )
    .await;
    bar.finish_and_clear();
    drop(before);
    // Intent before effect: whatever an executor answered it holds had its intent recorded
    // before, so reading the commits appended while asking leaves nothing it made unknown.
    ops.catch_up(ledger, "reading the ledger's latest commits")
        .await?;
    let findings = confirmed(&ops.fold.resources(), &asked);
    let fixed = match &args.fix {
        Some(fix) => Some(fix_leaked(ledger, &client, &findings, fix, &args).await?),
        None => None,
    };
    report(&ops, &sought, &asked, &findings, fixed.as_ref(), args.json);
    outcome(&sought, &asked, &findings, fixed.as_ref())
}

/// `--fix leaked`: the leaked findings (already confirmed against the ledger as read after
/// the inventories: an operation that started on one meanwhile made it uncertain, not
/// leaked), recorded as one `remove_leaked` operation and driven as its rollback.
async fn fix_leaked(
    ledger: &Writer<Ledger>,
    client: &async_nats::Client,
    findings: &[Finding],
    fix: &Fix,
    args: &DriftArgs<'_>,
) -> Result<Fixed, CommandError> {
    let plan = plan_leak_removal(findings);
    if fix.dry_run || plan.removals.is_empty() {
        return Ok(Fixed {
            plan,
            operation: None,
            dry_run: fix.dry_run,
        });
    }
    let stamper = Stamper::system();
    let id = Uuid::now_v7();
    let events = leak_removal_events(id, &plan, &fix.reason)
        .map_err(|e| CommandError::BadInput(e.to_string()))?;
    record_leak_removal(ledger, id, events, &fix.actor, &stamper)
        .await
        .map_err(|e| CommandError::Infrastructure(e.to_string()))?;
    tracing::info!(operation = %id, removals = plan.removals.len(), "remove_leaked recorded");
    let executors = Arc::new(NatsExecutors {
        client: client.clone(),
        subject_prefix: args.subject_prefix.to_string(),
        reply_wait: INVENTORY_REPLY_WAIT,
    });
    let driver = RollbackDriver::new(
        ledger.clone(),
        executors,
        RetryPolicy::default(),
        &fix.actor,
    );
    let op = driver
        .drive(id)
        .await
        .map_err(|e| CommandError::Infrastructure(format!("operation {id}: {e}")))?;
    Ok(Fixed {
        plan,
        operation: Some(op),
        dry_run: false,
    })
}

fn fix_json(fixed: &Fixed) -> serde_json::Value {
    let removals: Vec<serde_json::Value> = fixed
        .plan
        .removals
        .iter()
        .map(|r| {
            serde_json::json!({
                "executor": r.executor,
                "resource": r.resource,
                "entity": r.entity,
                "step": r.step,
                "compensation": r.compensation,
            })
        })
        .collect();
    let kept: Vec<serde_json::Value> = fixed
        .plan
        .unremovable
        .iter()
        .map(|u| serde_json::json!({"executor": u.executor, "resource": u.resource, "why": u.why}))
        .collect();
    serde_json::json!({
        "dry_run": fixed.dry_run,
        "removals": removals,
        "kept": kept,
        "operation": fixed.operation.as_ref().map(OperationState::view),
    })
}

fn report(
    ops: &Operations,
    sought: &Sought,
    asked: &[Asked],
    findings: &[Finding],
    fixed: Option<&Fixed>,
    json: bool,
) {
    if json {
        let executors: Vec<serde_json::Value> = asked
            .iter()
            .map(|a| {
                let mut one = match &a.held {
                    Ok(held) if a.suspects_not_kept > 0 => serde_json::json!({
                        "name": a.executor, "held": held, "leaks_not_listed": a.suspects_not_kept,
                    }),
                    Ok(held) => serde_json::json!({"name": a.executor, "held": held}),
                    Err(e) => serde_json::json!({"name": a.executor, "error": e.to_string()}),
                };
                if sought.is_discovered(&a.executor) {
                    one["discovered"] = true.into();
                }
                one
            })
            .collect();
        print_json(&serde_json::json!({
            "position": ops.done.position,
            "quarantined": ops.done.quarantined,
            "executors": executors,
            "discovery": sought.json(),
            "findings": findings,
            "fix": fixed.map(fix_json),
        }));
        return;
    }
    sought.print();
    for a in asked {
        let discovered = if sought.is_discovered(&a.executor) {
            " (discovered: the ledger does not name it)"
        } else {
            ""
        };
        match &a.held {
            Ok(held) => println!("{}: {} held{discovered}", a.executor, held),
            Err(e) => println!(
                "{}: not read{discovered}: {}",
                a.executor,
                super::printable(&e.to_string())
            ),
        }
        if a.suspects_not_kept > 0 {
            println!(
                "{}: too many findings to list: the first {} shown, {} more not listed (SUSPECTS_KEPT_MAX); fix what is shown and run drift again",
                a.executor,
                a.suspects.len(),
                a.suspects_not_kept
            );
        }
    }
    for f in findings {
        println!(
            "{:<10} {} {} (entity {}, operation {}, step {})",
            word(f),
            f.executor,
            super::printable(&f.resource),
            f.entity.as_deref().unwrap_or("unknown"),
            f.operation_id
                .map(|o| o.to_string())
                .unwrap_or_else(|| "none".into()),
            f.step.as_deref().unwrap_or("none"),
        );
        println!("  why: {}", super::printable(&f.reason));
        println!("  do:  {}", super::invocation::current().in_text(&f.action));
    }
    if let Some(fixed) = fixed {
        report_fix(fixed);
    }
    if findings.is_empty() && asked.iter().all(|a| a.held.is_ok()) && sought.saw_everything() {
        println!(
            "no drift: the executors hold what the ledger records (to position {})",
            ops.done.position
        );
    }
}

fn report_fix(fixed: &Fixed) {
    if fixed.plan.removals.is_empty() && fixed.plan.unremovable.is_empty() {
        println!("fix: no leaked resource to remove");
        return;
    }
    print!("{}", render_leak_removal(&fixed.plan));
    if fixed.dry_run {
        println!("dry run: nothing recorded, nothing asked of any executor");
        return;
    }
    let Some(op) = &fixed.operation else {
        return;
    };
    let id = op.header.id.id;
    let status = op.view()["status"].as_str().unwrap_or("?").to_string();
    if op.remaining.is_empty() {
        println!(
            "fix: operation {id} (remove_leaked) {status}: {} removal(s) done and recorded; \
             run drift again to confirm",
            fixed.plan.removals.len()
        );
    } else {
        println!(
            "fix: operation {id} (remove_leaked) {status}: {} removal(s) not done; see \
             provledger operation list --status needs_attention",
            op.remaining.len()
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

/// Exit 3 if an executor could not be reached, 1 with findings (other than leaked ones a
/// fix removed) or a reply that broke the protocol, 0 clean.
fn outcome(
    sought: &Sought,
    asked: &[Asked],
    findings: &[Finding],
    fixed: Option<&Fixed>,
) -> Result<(), CommandError> {
    let unreachable: Vec<&str> = asked
        .iter()
        .filter(|a| a.held.as_ref().is_err_and(InventoryError::is_unreachable))
        .map(|a| a.executor.as_str())
        .collect();
    if let Some(why) = sought.unseen() {
        return Err(CommandError::Infrastructure(format!(
            "{why}{}: the comparison may be incomplete; check deploy/nats/accounts.conf \
             (publish on {}), or name the executor with --executor",
            if unreachable.is_empty() {
                String::new()
            } else {
                format!(
                    ", and drift could not read the inventory of {}",
                    unreachable.join(", ")
                )
            },
            provledger_client::inventory::DISCOVERY_SUBJECT
        )));
    }
    if !unreachable.is_empty() {
        return Err(CommandError::Infrastructure(format!(
            "drift could not read the inventory of {}: the comparison is incomplete; check \
             that they run and answer <prefix>.exec.<name>.inventory, then run drift again",
            unreachable.join(", ")
        )));
    }
    if let Some(op) = fixed.and_then(|f| f.operation.as_ref()) {
        if !op.remaining.is_empty() {
            return Err(CommandError::Problem(format!(
                "operation {} (remove_leaked) needs attention: {} removal(s) not done",
                op.header.id.id,
                op.remaining.len()
            )));
        }
    }
    // Removed by the fix (done and recorded): no longer findings.
    let removed: BTreeSet<(&str, &str)> = fixed
        .filter(|f| f.operation.is_some())
        .map(|f| {
            f.plan
                .removals
                .iter()
                .map(|r| (r.executor.as_str(), r.resource.as_str()))
                .collect()
        })
        .unwrap_or_default();
    let findings: Vec<&Finding> = findings
        .iter()
        .filter(|f| {
            !(f.kind == FindingKind::Leaked
                && removed.contains(&(f.executor.as_str(), f.resource.as_str())))
        })
        .collect();
    let broken = asked.iter().filter(|a| a.held.is_err()).count();
    let rejected = sought.rejected();
    if !findings.is_empty() || broken > 0 || rejected > 0 {
        return Err(CommandError::Problem(format!(
            "{} drift finding(s){}{}; each is listed with what to do",
            findings.len(),
            if broken > 0 {
                format!(", and {broken} executor(s) answered outside the protocol")
            } else {
                String::new()
            },
            if rejected > 0 {
                format!(", and {rejected} name(s) answering inventories are not executor names")
            } else {
                String::new()
            }
        )));
    }
    Ok(())
}
