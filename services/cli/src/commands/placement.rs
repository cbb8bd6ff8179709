//! `provledger provider delete ID [--cascade]` (or `--host HOST`), `provledger
//! heal-allocations [--dry-run] [--instance ID]`, and the orphan release of `audit
//! --fix-orphans`: the client library's placement writes, printed for a person.

use provledger_client::placement::{
    delete_provider, fix_orphans, heal_allocations, providers_on_host, read_projection, LogView,
    PlacementError, ProviderDeletion,
};
use provledger_client::Writer;
use provledger_client::{Ledger, Stamper};
use provledger_projections::placement::Hold;
use uuid::Uuid;

use super::{print_json, CommandError};

impl From<PlacementError> for CommandError {
    fn from(e: PlacementError) -> Self {
        match e {
            PlacementError::NotFound(_) => CommandError::Problem(e.to_string()),
            PlacementError::Write(w) => w.into(),
            PlacementError::Read(_) | PlacementError::Contended { .. } => {
                CommandError::Infrastructure(e.to_string())
            }
        }
    }
}

fn word(value: serde_json::Result<serde_json::Value>) -> String {
    match value {
        Ok(serde_json::Value::String(s)) => s,
        _ => "?".into(),
    }
}

fn describe(hold: &Hold) -> String {
    format!(
        "  {} {} ({}): {}\n      what to do: {}",
        word(serde_json::to_value(hold.consumer_kind)),
        hold.consumer,
        word(serde_json::to_value(hold.hold)),
        hold.why,
        super::invocation::current().in_text(&hold.what_to_do)
    )
}

fn hold_json(hold: &Hold) -> serde_json::Value {
    serde_json::to_value(hold)
        .expect("a hold: plain serde data (string keys, no fallible impls) encodes as JSON")
}

/// Deletes one provider, or every provider on a host one by one (each fully released and
/// deleted before the next, so a crash never leaves one half done).
pub async fn delete(
    ledger: &Writer<Ledger>,
    provider: Option<Uuid>,
    host: Option<String>,
    cascade: bool,
    json: bool,
) -> Result<(), CommandError> {
    let stamper = Stamper::system();
    let targets = match (provider, host) {
        (Some(p), None) => vec![p],
        (None, Some(h)) => {
            let projection = read_projection(ledger.log()).await?;
            let ids = providers_on_host(&projection, &h);
            if ids.is_empty() {
                return Err(CommandError::Problem(format!(
                    "no provider on host {h:?} is left to delete"
                )));
            }
            ids
        }
        _ => {
            return Err(CommandError::BadInput(
                "give a provider ID or --host HOST, not both".into(),
            ))
        }
    };
    let mut results = Vec::new();
    let mut refused = 0;
    for id in targets {
        // A CLI run is not a request path: it decides from the log folded (a view per
        // provider, so each sees what the previous deletes wrote).
        let view = LogView::new(ledger.log());
        let outcome = delete_provider(ledger, &view, id, cascade, "cli", &stamper).await?;
        match &outcome {
            ProviderDeletion::Deleted { released } => {
                if !json {
                    println!(
                        "provider {id} deleted{}",
                        if released.is_empty() {
                            String::new()
                        } else {
                            format!(", after releasing {} allocation(s):", released.len())
                        }
                    );
                    for h in released {
                        println!("{}", describe(h));
                    }
                }
                results.push(serde_json::json!({"provider": id, "outcome": "deleted",
                    "released": released.iter().map(hold_json).collect::<Vec<_>>()}));
            }
            ProviderDeletion::AlreadyDeleted => {
                if !json {
                    println!("provider {id} is already deleted");
                }
                results.push(serde_json::json!({"provider": id, "outcome": "already_deleted"}));
            }
            ProviderDeletion::Refused { holds } => {
                refused += 1;
                if !json {
                    println!(
                        "provider {id} NOT deleted: {} allocation(s) still hold it; nothing was written:",
                        holds.len()
                    );
                    for h in holds {
                        println!("{}", describe(h));
                    }
                    println!(
                        "  or release them all with: provledger provider delete {id} --cascade"
                    );
                }
                results.push(serde_json::json!({"provider": id, "outcome": "refused",
                    "holds": holds.iter().map(hold_json).collect::<Vec<_>>()}));
            }
        }
    }
    if json {
        print_json(&serde_json::json!({ "providers": results }));
    }
    if refused > 0 {
        return Err(CommandError::Problem(format!(
            "{refused} provider(s) refused: allocations remain (listed above)"
        )));
    }
    Ok(())
}

/// heal-allocations, with nova-manage's exit codes: 0 healed, 4 nothing to do, 1 some
/// could not be healed.
pub async fn heal(
    ledger: &Writer<Ledger>,
    instance: Option<Uuid>,
    dry_run: bool,
    json: bool,
) -> Result<(), CommandError> {
    let view = LogView::new(ledger.log());
    let report =
        heal_allocations(ledger, &view, instance, dry_run, "cli", &Stamper::system()).await?;
    if json {
        let mut v = serde_json::to_value(&report)
            .expect("a report: plain serde data (string keys, no fallible impls) encodes as JSON");
        v["dry_run"] = dry_run.into();
        print_json(&v);
    } else {
        let verb = if dry_run { "would claim" } else { "claimed" };
        for (i, p) in &report.healed {
            println!("instance {i}: {verb} its allocation on provider {p}");
        }
        for (i, why) in &report.skipped {
            println!("instance {i}: skipped: {why}");
        }
        for (i, why) in &report.failed {
            println!("instance {i}: NOT healed: {why}");
        }
        if dry_run {
            println!("dry run: nothing was written");
        }
    }
    if !report.failed.is_empty() {
        return Err(CommandError::Problem(format!(
            "{} instance(s) could not be healed (listed above)",
            report.failed.len()
        )));
    }
    if report.healed.is_empty() {
        return Err(CommandError::NothingToDo(
            "no instance needs healing".into(),
        ));
    }
    Ok(())
}

/// `audit --fix-orphans`: releases the orphan allocations, only those, with reasons.
pub async fn release_orphans(ledger: &Writer<Ledger>, json: bool) -> Result<usize, CommandError> {
    let view = LogView::new(ledger.log());
    let released = fix_orphans(ledger, &view, false, "cli", &Stamper::system()).await?;
    if !json {
        for (provider, hold) in &released {
            println!("released on provider {provider}:\n{}", describe(hold));
        }
    }
    Ok(released.len())
}
