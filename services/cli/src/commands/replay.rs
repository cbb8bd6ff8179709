//! `provledger replay [--to POSITION|TIME] [--snapshot-bucket BUCKET]`: rebuilds every
//! projection up to a point, from the newest snapshot at or before it (embedded or a
//! service's data dir) or from JetStream with `--nats` (from position 1, or from the snapshot
//! serve publishes in BUCKET), and prints counts by status, anomalies and quarantined entries.

use futures::StreamExt;
use provledger_events::{EventLog, IntegrityError, JetStreamLog, SledLog};
use provledger_projections::Projection;

use provledger_serve::bootstrap::SnapshotProjection;

use super::state::{open_local_store, progress_bar, LogPoint};
use super::{print_json, CommandError};

fn print_summary(projection: &Projection, quarantined: usize, json: bool) {
    let summary = projection.summary();
    if json {
        let mut v = serde_json::to_value(&summary)
            .expect("a summary: plain serde data (string keys, no fallible impls) encodes as JSON");
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

/// Where a replay over JetStream starts: the published snapshot in `bucket` when it is
/// there, checks, and lies at or before `to`; else nothing, from position 1 (saying why).
async fn starting_point(
    log: &JetStreamLog,
    bucket: Option<&str>,
    to: Option<LogPoint>,
) -> Option<SnapshotProjection> {
    let bucket = bucket?;
    let snapshot = match provledger_serve::bootstrap::snapshot_projection(log, bucket).await {
        Ok(snapshot) => snapshot,
        Err(e) => {
            tracing::warn!(bucket, error = %e, "snapshot not used: replaying from position 1");
            eprintln!("snapshot not used ({e}): replaying from position 1");
            return None;
        }
    };
    let position = snapshot.projection.position;
    let past = match to {
        None => false,
        Some(LogPoint::Position(p)) => position > p,
        Some(LogPoint::Time(t)) => snapshot.watermark.is_some_and(|w| w > t.unix_ms()),
    };
    if past {
        eprintln!("the snapshot (position {position}) is past --to: replaying from position 1");
        return None;
    }
    tracing::info!(bucket, position, "replaying from the published snapshot");
    eprintln!("replaying from the published snapshot at position {position}");
    Some(snapshot)
}

/// Replays straight from JetStream (no local copy needed), from position 1 or from the
/// snapshot published in `bucket`.
pub async fn replay_remote(
    log: &JetStreamLog,
    to: Option<LogPoint>,
    bucket: Option<String>,
    json: bool,
) -> Result<(), CommandError> {
    let end = log.last_position().await?;
    let bar = progress_bar(end, "replaying");
    let (mut projection, mut quarantined, mut watermark) =
        match starting_point(log, bucket.as_deref(), to).await {
            Some(s) => (s.projection, s.quarantined, s.watermark.unwrap_or(i64::MIN)),
            None => (Projection::new(), 0, i64::MIN),
        };
    let mut stream = log.read_all(projection.position + 1).await?;
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
