//! `provledger replay [--to POSITION|TIME]`: rebuilds every projection up to a point, from
//! the newest snapshot at or before it (embedded or a service's data dir) or from JetStream
//! with `--nats`, and prints counts by status, anomalies and quarantined entries.

use futures::StreamExt;
use provledger_events::{EventLog, IntegrityError, JetStreamLog, SledLog};
use provledger_projections::Projection;

use super::state::{open_local_store, progress_bar, LogPoint};
use super::{print_json, CommandError};

fn print_summary(projection: &Projection, quarantined: usize, json: bool) {
    let summary = projection.summary();
    if json {
        let mut v = serde_json::to_value(&summary).unwrap_or_default();
        v["quarantined"] = quarantined.into();
        print_json(&v);
        return;
    }
    println!("replayed to position {}", summary.position);
    for (kind, statuses) in &summary.counts {
        let parts: Vec<String> = statuses.iter().map(|(s, n)| format!("{s}={n}")).collect();
        println!("  {kind:<10} {}", parts.join(" "));
    }
    println!("  anomalies  {}", summary.anomaly_count);
    for a in &summary.anomalies {
        println!("    {a}");
    }
    println!("  quarantined log entries {quarantined}");
}

/// Replays the local copy to `to`, from the newest snapshot at or before it.
pub async fn replay_local(
    log: &SledLog,
    to: Option<LogPoint>,
    json: bool,
) -> Result<(), CommandError> {
    let store = open_local_store(log).await?;
    // A serve replica's data dir holds no copy of the log to replay (the stream does).
    if !store.copies_log()? {
        return Err(provledger_serve::StoreError::HistoryNotCopied.into());
    }
    let end = match to {
        None => store.checkpoint()?,
        Some(LogPoint::Position(p)) => p.min(store.checkpoint()?),
        Some(LogPoint::Time(t)) => store.position_at_time(t)?,
    };
    let mut projection = store.load_snapshot(end)?.unwrap_or_default();
    let from = projection.position + 1;
    tracing::info!(snapshot = projection.position, to = end, "replaying");
    let bar = progress_bar(end.saturating_sub(projection.position), "replaying");
    for (n, commit) in store.commits(from, end).enumerate() {
        let commit = commit?;
        // The copy is what is folded: every commit must extend its aggregate's chain.
        projection.apply_checked(&commit).map_err(|v| {
            CommandError::Problem(IntegrityError::from_violation(commit.aggregate, &v).to_string())
        })?;
        if n % 4096 == 0 {
            bar.set_position(n as u64);
        }
    }
    projection.position = end;
    bar.finish_and_clear();
    let quarantined = store
        .quarantined()?
        .iter()
        .filter(|q| q.position <= end)
        .count();
    print_summary(&projection, quarantined, json);
    Ok(())
}

/// Replays straight from JetStream (no local copy needed).
pub async fn replay_remote(
    log: &JetStreamLog,
    to: Option<LogPoint>,
    json: bool,
) -> Result<(), CommandError> {
    let end = log.last_position().await?;
    let bar = progress_bar(end, "replaying");
    let mut projection = Projection::new();
    let mut quarantined = 0;
    let mut watermark = i64::MIN;
    let mut stream = log.read_all(1).await?;
    while let Some(entry) = stream.next().await {
        match entry {
            Ok(commit) => {
                watermark = watermark.max(commit.recorded_at.unix_ms());
                let past = match to {
                    None => false,
                    Some(LogPoint::Position(p)) => commit.position > p,
                    Some(LogPoint::Time(t)) => watermark > t.unix_ms(),
                };
                if past {
                    break;
                }
                // A commit published on a subject outside its aggregate's chain (replayed,
                // forged) is quarantined, as `serve` does, never folded.
                if projection.apply_checked(&commit).is_err() {
                    quarantined += 1;
                    continue;
                }
                bar.set_position(commit.position);
            }
            Err(
                provledger_events::ReadError::Undecodable { position, .. }
                | provledger_events::ReadError::OutsideChain { position, .. },
            ) => {
                if matches!(to, Some(LogPoint::Position(p)) if position > p) {
                    break;
                }
                quarantined += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
    bar.finish_and_clear();
    print_summary(&projection, quarantined, json);
    Ok(())
}
