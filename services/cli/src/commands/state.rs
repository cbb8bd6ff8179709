//! `provledger state KIND/ID [--at ...]`: an aggregate's state now or at a past point,
//! embedded, against the sled copy of a service's data dir, or straight from JetStream with
//! `--nats`. Also the pieces `replay` shares: the log point, the progress bar, the local
//! store.

use std::str::FromStr;

use indicatif::{ProgressBar, ProgressStyle};
use provledger_events::ids::InvalidText;
use provledger_events::{AggregateId, EventLog, JetStreamLog, SledLog, Timestamp};
use provledger_projections::Entity;

use super::{print_json, CommandError};
use provledger_serve::{
    ProjectionStore, Projector, ProjectorError, StoreError, SNAPSHOT_EVERY_POSITIONS_DEFAULT,
};

/// A point in the log: a position, or a time (RFC 3339).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogPoint {
    Position(u64),
    Time(Timestamp),
}

impl FromStr for LogPoint {
    type Err = InvalidText;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Ok(p) = s.parse::<u64>() {
            return Ok(LogPoint::Position(p));
        }
        Timestamp::parse_rfc3339(s)
            .map(LogPoint::Time)
            .map_err(|e| InvalidText {
                what: "a log position or an RFC 3339 time",
                text: s.to_string(),
                reason: e.reason,
            })
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

impl From<ProjectorError> for CommandError {
    fn from(e: ProjectorError) -> Self {
        match e {
            ProjectorError::Store(s) => s.into(),
            ProjectorError::Read(r) => r.into(),
            ProjectorError::Integrity(i) => CommandError::Problem(i.to_string()),
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
    let mut runner = Projector::new(store.clone(), SNAPSHOT_EVERY_POSITIONS_DEFAULT)?;
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
    // A serve replica's data dir keeps the current entities but no copy of the log: the
    // current state is read as stored; an earlier one needs the history (`--nats`).
    let entity = match at.is_none() && !store.copies_log()? {
        true => store.entity(&aggregate)?,
        false => store.entity_at(&aggregate, position)?,
    }
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
