//! `provledger state KIND/ID [--at ...]` and `provledger replay [--to ...]`: time travel
//! over the projection, embedded, against the sled copy of a service's data dir, or
//! straight from JetStream with `--nats`.

use std::str::FromStr;

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use provledger_events::{AggregateId, EventLog, JetStreamLog, SledLog, Timestamp};
use provledger_projections::{Entity, Projection};

use super::{print_json, CommandError};
use crate::runner::{Runner, SNAPSHOT_EVERY_POSITIONS_DEFAULT};
use crate::store::{ProjectionStore, StoreError};

/// A point in the log: a position, or a time (RFC 3339).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogPoint {
    Position(u64),
    Time(Timestamp),
}

impl FromStr for LogPoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(p) = s.parse::<u64>() {
            return Ok(LogPoint::Position(p));
        }
        Timestamp::parse_rfc3339(s)
            .map(LogPoint::Time)
            .map_err(|e| format!("{s:?} is neither a log position nor an RFC 3339 time: {e}"))
    }
}

impl From<StoreError> for CommandError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::SourceMismatch { .. } => CommandError::BadInput(e.to_string()),
            other => CommandError::Problem(other.to_string()),
        }
    }
}

impl From<crate::runner::RunnerError> for CommandError {
    fn from(e: crate::runner::RunnerError) -> Self {
        match e {
            crate::runner::RunnerError::Store(s) => s.into(),
            crate::runner::RunnerError::Read(r) => r.into(),
        }
    }
}

/// A terminal progress bar (hidden when stderr is not a terminal).
pub fn progress_bar(total: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{msg} [{elapsed_precise}] {wide_bar} {pos}/{len} ({per_sec}, eta {eta})",
    ) {
        bar.set_style(style);
    }
    bar.set_message(what.to_string());
    bar
}

/// Opens the projection store of an embedded data dir, bringing it up to date with the
/// embedded log first; a service's data dir (a JetStream copy) is used as it is.
pub async fn open_local_store(log: &SledLog) -> Result<ProjectionStore, CommandError> {
    let store = ProjectionStore::open(log.db())?;
    let source = store.source()?;
    if source.as_deref().is_some_and(|s| s != "embedded") {
        tracing::info!(source = ?source, "data dir holds a service's copy; reading it offline");
        return Ok(store);
    }
    store.claim_source("embedded")?;
    let mut runner = Runner::new(store.clone(), SNAPSHOT_EVERY_POSITIONS_DEFAULT)?;
    let end = log.last_position().await?;
    if end > runner.checkpoint() {
        let bar = progress_bar(end - runner.checkpoint(), "projecting");
        let start = runner.checkpoint();
        runner
            .catch_up(log, |done, _| bar.set_position(done - start))
            .await?;
        bar.finish_and_clear();
        tracing::info!(checkpoint = runner.checkpoint(), "projection caught up");
    }
    Ok(store)
}

fn print_state(aggregate: AggregateId, at: u64, entity: &Entity, json: bool) {
    if json {
        print_json(&serde_json::json!({
            "aggregate": aggregate.to_string(),
            "at_position": at,
            "state": entity.view(),
        }));
    } else {
        println!("{aggregate} as of position {at}:");
        match serde_json::to_string_pretty(&entity.view()) {
            Ok(s) => println!("{s}"),
            Err(e) => eprintln!("cannot render state: {e}"),
        }
    }
}

fn not_found(aggregate: AggregateId, at: u64) -> CommandError {
    CommandError::Problem(format!(
        "{aggregate} not found: no commit at or before position {at} (check --data-dir / --nats)"
    ))
}

pub async fn state_local(
    log: &SledLog,
    aggregate: AggregateId,
    at: Option<LogPoint>,
    json: bool,
) -> Result<(), CommandError> {
    let store = open_local_store(log).await?;
    let position = match at {
        None => store.checkpoint()?,
        Some(LogPoint::Position(p)) => p,
        Some(LogPoint::Time(t)) => store.position_at_time(t)?,
    };
    let entity = store
        .entity_at(&aggregate, position)?
        .ok_or_else(|| not_found(aggregate, position))?;
    print_state(aggregate, position, &entity, json);
    Ok(())
}

pub async fn state_remote(
    log: &JetStreamLog,
    aggregate: AggregateId,
    at: Option<LogPoint>,
    json: bool,
) -> Result<(), CommandError> {
    let commits = log.read_aggregate(aggregate).await?;
    let mut entity = Entity::new(aggregate);
    let mut position = 0;
    for commit in &commits {
        let included = match at {
            None => true,
            Some(LogPoint::Position(p)) => commit.position <= p,
            // Without a local time index, a time selects the aggregate's own commits
            // recorded by then.
            Some(LogPoint::Time(t)) => commit.recorded_at <= t,
        };
        if included {
            entity.apply(commit);
            position = commit.position;
        }
    }
    if position == 0 {
        return Err(not_found(aggregate, 0));
    }
    print_state(aggregate, position, &entity, json);
    Ok(())
}

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
        projection.apply(&commit?);
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
                projection.apply(&commit);
                bar.set_position(commit.position);
            }
            Err(provledger_events::ReadError::Undecodable { position, .. }) => {
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
