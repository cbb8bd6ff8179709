//! `provledger recover [--dry-run]`: one stuck-state recovery sweep (and the provider
//! deletes a crash left half done, finished), then, over `--nats`,
//! one round of re-issue delivery (see `provledger_client::recovery`). Embedded there is
//! no worker to deliver to: a re-issue stays pending (serve delivers it, with backoff,
//! until its worker acknowledges). Exit 1 while any re-issue is pending or a recovery
//! failed, each named.

use std::time::Duration;

use provledger_client::recovery::{
    deliver_reissues, recovery_round, NatsReissuer, PendingReissueLine, RecoverReport,
    RecoveryOutcome,
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
    let report = round.sweep?;
    let providers_finished = round.provider_deletes_finished?;
    let delivery = match (&options.nats_url, dry_run) {
        (Some(url), false) => {
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
            Some(deliver_reissues(ledger, &view, &reissuer, &policy, &ready, &stamper).await?)
        }
        _ => None,
    };
    // What is still pending once this command is done.
    let pending: Vec<PendingReissueLine> = match dry_run {
        true => Vec::new(),
        false => LogView::new(ledger.log())
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
            .collect(),
    };
    let failed = report
        .recoveries
        .iter()
        .filter(|r| matches!(r.outcome, RecoveryOutcome::Failed(_)))
        .count();
    if json {
        let printed = RecoverReport {
            written: report.written(),
            sweep: report.clone(),
            dry_run,
            delivery: delivery.clone(),
            pending_reissues: pending.clone(),
            provider_deletes_finished: providers_finished.clone(),
        };
        // A struct of strings, numbers and string-keyed maps always serializes to JSON.
        print_json(&serde_json::to_value(&printed).expect("a recover report is JSON"));
    } else {
        for r in &report.recoveries {
            println!(
                "instance {}: {} [{}]\n    {}",
                r.instance, r.rule, r.outcome, r.reason
            );
        }
        println!(
            "{} instance(s) examined, {} recovery(ies) {}",
            report.examined,
            if dry_run {
                report.recoveries.len()
            } else {
                report.written()
            },
            if dry_run {
                "would be written (dry run: nothing written)"
            } else {
                "written"
            }
        );
        for p in &providers_finished {
            println!("provider {p}: a delete left half done was finished");
        }
        if let Some(d) = &delivery {
            println!(
                "re-issues: {} sent, {} delivered, {} not delivered, {} taken by another replica or no longer needed",
                d.sent, d.delivered, d.failed, d.raced
            );
        }
        for p in &pending {
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
    if failed > 0 {
        return Err(CommandError::Problem(format!(
            "{failed} recovery(ies) could not be carried out (listed above)"
        )));
    }
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
