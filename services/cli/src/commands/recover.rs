//! `provledger recover [--dry-run]`: one stuck-state recovery sweep (see
//! `provledger_client::recovery`). Re-issues reach the owning workers over `--nats`;
//! embedded there is no worker, so a re-issue fails (a re-driven delete then puts the
//! instance in error, never drops it).

use std::time::Duration;

use provledger_client::recovery::{sweep, NatsReissuer, NoWorkers, Reissuer};
use provledger_client::view::LogView;
use provledger_client::{connect_nats, Ledger, LedgerOptions, Stamper};

use super::{print_json, CommandError};

const REISSUE_REPLY_WAIT: Duration = Duration::from_secs(10);

pub async fn run(
    ledger: &Ledger,
    options: &LedgerOptions,
    dry_run: bool,
    json: bool,
) -> Result<(), CommandError> {
    let reissuer: Box<dyn Reissuer> = match &options.nats_url {
        Some(url) if !dry_run => {
            let client = connect_nats(url, "provledger-recover", &options.nats_auth).await?;
            Box::new(NatsReissuer {
                client,
                subject_prefix: options.subject_prefix.clone(),
                reply_wait: REISSUE_REPLY_WAIT,
            })
        }
        _ => Box::new(NoWorkers),
    };
    let view = LogView::new(ledger);
    let report = sweep(
        ledger,
        &view,
        reissuer.as_ref(),
        dry_run,
        &Stamper::system(),
    )
    .await?;
    let failed = report
        .recoveries
        .iter()
        .filter(|r| r.outcome.starts_with("failed"))
        .count();
    if json {
        let mut v = serde_json::to_value(&report).unwrap_or_default();
        v["dry_run"] = dry_run.into();
        v["written"] = report.written().into();
        print_json(&v);
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
    }
    if failed > 0 {
        return Err(CommandError::Problem(format!(
            "{failed} recovery(ies) could not be carried out (listed above)"
        )));
    }
    Ok(())
}
