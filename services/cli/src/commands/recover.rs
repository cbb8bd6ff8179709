//! `provledger recover [--dry-run]`: one stuck-state recovery sweep (and the provider
//! deletes a crash left half done, finished), then, over `--nats`,
//! one round of re-issue delivery (see `provledger_client::recovery`). Embedded there is
//! no worker to deliver to: a re-issue stays pending (serve delivers it, with backoff,
//! until its worker acknowledges). Exit 1 while any re-issue is pending or a recovery
//! failed, each named.

use std::time::Duration;

use provledger_client::recovery::{
    deliver_reissues, recovery_round, DeliveryReport, NatsReissuer, PendingReissueLine,
    RecoverReport, RecoveryOutcome,
};
use provledger_client::view::{LogView, StateView};
use provledger_client::Writer;
use provledger_client::{connect_nats, Ledger, LedgerOptions, Stamper};
use provledger_projections::recovery::ReissuePolicy;

use super::{print_json, CommandError};

const REISSUE_REPLY_WAIT: Duration = Duration::from_secs(10);

pub async fn run(
    ledger: &Writer<Ledger>,
    options: &LedgerOptions,
    dry_run: bool,
    json: bool,
) -> Result<(), CommandError> {
    let view = LogView::new(ledger.log());
    let stamper = Stamper::system();
    let round = recovery_round(ledger, &view, dry_run, &stamper).await;
    let sweep = round.sweep?;
    let provider_deletes_finished = round.provider_deletes_finished?;
    let delivery = match (&options.nats_url, dry_run) {
        (Some(url), false) => Some(deliver(ledger, options, url, &stamper).await?),
        _ => None,
    };
    let pending_reissues = pending_reissues(ledger, dry_run).await?;
    let report = RecoverReport {
        written: sweep.written(),
        sweep,
        dry_run,
        delivery,
        pending_reissues,
        provider_deletes_finished,
    };
    if json {
        // A struct of strings, numbers and string-keyed maps always serializes to JSON.
        print_json(&serde_json::to_value(&report).expect("a recover report is JSON"));
    } else {
        print_text(&report);
    }
    verdict(&report, options)
}

/// One round of re-issue delivery over NATS at `url`, after the sweep.
async fn deliver(
    ledger: &Writer<Ledger>,
    options: &LedgerOptions,
    url: &str,
    stamper: &Stamper,
) -> Result<DeliveryReport, CommandError> {
    let client = connect_nats(url, "provledger-recover", &options.nats_auth).await?;
    let reissuer = NatsReissuer {
        client,
        subject_prefix: options.subject_prefix.clone(),
        reply_wait: REISSUE_REPLY_WAIT,
    };
    let policy = ReissuePolicy::new(REISSUE_REPLY_WAIT.as_millis() as i64);
    // A fresh view: the sweep's recoveries (and their re-issues) are in the log.
    let view = LogView::new(ledger.log());
    let ready = std::collections::BTreeMap::new();
    Ok(deliver_reissues(ledger, &view, &reissuer, &policy, &ready, stamper).await?)
}

/// What is still pending once this command is done (nothing in a dry run).
async fn pending_reissues(
    ledger: &Writer<Ledger>,
    dry_run: bool,
) -> Result<Vec<PendingReissueLine>, CommandError> {
    if dry_run {
        return Ok(Vec::new());
    }
    Ok(LogView::new(ledger.log())
        .instances()
        .await
        .map_err(|e| CommandError::Problem(e.to_string()))?
        .iter()
        .flat_map(|i| {
            i.pending_reissues.iter().map(|p| PendingReissueLine {
                instance: i.header.id.id,
                request_id: p.request_id,
                worker: p.worker.clone(),
                action: p.action,
                attempts: p.attempts,
                last_error: p.last_error.clone(),
            })
        })
        .collect())
}

/// Prints the report for a reader: each recovery, the sweep's count, the provider
/// deletes finished, the delivery round and each re-issue still pending.
fn print_text(report: &RecoverReport) {
    let sweep = &report.sweep;
    for r in &sweep.recoveries {
        println!(
            "instance {}: {} [{}]\n    {}",
            r.instance, r.rule, r.outcome, r.reason
        );
    }
    println!(
        "{} instance(s) examined, {} recovery(ies) {}",
        sweep.examined,
        if report.dry_run {
            sweep.recoveries.len()
        } else {
            sweep.written()
        },
        if report.dry_run {
            "would be written (dry run: nothing written)"
        } else {
            "written"
        }
    );
    for p in &report.provider_deletes_finished {
        println!("provider {p}: a delete left half done was finished");
    }
    if let Some(d) = &report.delivery {
        println!(
            "re-issues: {} sent, {} delivered, {} not delivered, {} taken by another replica or no longer needed",
            d.sent, d.delivered, d.failed, d.raced
        );
    }
    for p in &report.pending_reissues {
        println!(
            "instance {}: re-issue {} to worker {} pending ({} attempt(s){})",
            p.instance,
            serde_json::to_value(p.action)
                .unwrap_or_default()
                .as_str()
                .unwrap_or_default(),
            p.worker,
            p.attempts,
            p.last_error
                .as_deref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default()
        );
    }
}

/// The command's result: an error while any recovery failed, else while any re-issue is
/// pending.
fn verdict(report: &RecoverReport, options: &LedgerOptions) -> Result<(), CommandError> {
    let failed = report
        .sweep
        .recoveries
        .iter()
        .filter(|r| matches!(r.outcome, RecoveryOutcome::Failed(_)))
        .count();
    if failed > 0 {
        return Err(CommandError::Problem(format!(
            "{failed} recovery(ies) could not be carried out (listed above)"
        )));
    }
    let pending = &report.pending_reissues;
    if !pending.is_empty() {
        return Err(CommandError::Problem(format!(
            "{} re-issue(s) not delivered yet (listed above): serve delivers them with backoff once their worker listens{}",
            pending.len(),
            match options.nats_url {
                None => "; without --nats no worker is reachable",
                Some(_) => "",
            }
        )));
    }
    Ok(())
}
