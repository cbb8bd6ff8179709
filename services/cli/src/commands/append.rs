//! `provledger append KIND/ID --expect any|none|N --events FILE|-`

use std::io::Read;

use provledger_events::{AggregateId, AppendStatus, CommitDraft, Event, Expectation, Timestamp};
use uuid::Uuid;

use super::{print_json, CommandError};
use provledger_client::write::Recorded;
use provledger_client::Ledger;
use provledger_client::Writer;
use provledger_projections::decide::DecideOptions;

pub struct AppendArgs {
    pub aggregate: AggregateId,
    pub expect: Expectation,
    pub events: Vec<Event>,
    pub commit_id: Option<Uuid>,
    pub operation_id: Option<Uuid>,
    pub causation_id: Option<Uuid>,
    pub actor: String,
    /// Accept an inventory below current usage (reported as over capacity afterwards).
    pub force: bool,
}

/// Reads the events' JSON: a list of events in the catalogue's JSON form, or one event.
pub fn parse_events(text: &str) -> Result<Vec<Event>, CommandError> {
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| CommandError::BadInput(format!("events are not valid JSON: {e}")))?;
    let list = match value {
        serde_json::Value::Array(items) => items,
        single @ serde_json::Value::Object(_) => vec![single],
        _ => {
            return Err(CommandError::BadInput(
                "events must be a JSON list of events, e.g. [{\"cluster_deleted\": {}}]".into(),
            ))
        }
    };
    list.into_iter()
        .enumerate()
        .map(|(i, v)| {
            serde_json::from_value::<Event>(v).map_err(|e| {
                CommandError::BadInput(format!(
                    "event #{i} is not in the catalogue ({e}); see docs/events.md for the JSON form"
                ))
            })
        })
        .collect()
}

pub fn read_events_source(source: &str) -> Result<String, CommandError> {
    if source == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CommandError::BadInput(format!("cannot read events from stdin: {e}")))?;
        Ok(s)
    } else {
        std::fs::read_to_string(source)
            .map_err(|e| CommandError::BadInput(format!("cannot read events file {source}: {e}")))
    }
}

pub async fn run(
    ledger: &Writer<Ledger>,
    args: AppendArgs,
    json: bool,
) -> Result<(), CommandError> {
    if let Ledger::Embedded(log) = ledger.log() {
        if let Some(source) = provledger_serve::ProjectionStore::copied_stream(log.db())? {
            return Err(CommandError::BadInput(format!(
                "{} holds the projection copy of {source}; append with --nats instead",
                log.dir().display()
            )));
        }
    }
    let draft = CommitDraft {
        trace: None,
        commit_id: args.commit_id.unwrap_or_else(Uuid::now_v7),
        operation_id: args.operation_id,
        causation_id: args.causation_id,
        actor: args.actor,
        recorded_at: Timestamp::now(),
        events: args.events,
    };
    let commit_id = draft.commit_id;
    let recorded = ledger
        .record_with(
            args.aggregate,
            args.expect,
            draft,
            // An operator's own append: no authenticated worker, the lease-holder rules only.
            DecideOptions {
                force: args.force,
                caller_worker: None,
            },
        )
        .await?;
    let (position, version, status) = match recorded {
        Recorded::Appended(o) if o.status == AppendStatus::AlreadyAppended => {
            (o.position, o.version, "already_appended")
        }
        Recorded::Appended(o) => (o.position, o.version, "appended"),
        Recorded::AlreadyDone {
            outcome,
            version,
            position,
        } => (position, version, outcome.as_str()),
    };
    if json {
        print_json(&serde_json::json!({
            "position": position,
            "version": version,
            "commit_id": commit_id,
            "status": status,
        }));
    } else {
        match status {
            "appended" => println!("appended {commit_id}: position {position} version {version}"),
            "already_appended" => println!(
                "already appended (idempotent retry of {commit_id}): position {position} version {version}"
            ),
            // A repeated delete request: nothing written.
            other => println!(
                "{}: nothing written ({} is at version {version})",
                other.replace('_', " "),
                args.aggregate
            ),
        }
    }
    Ok(())
}
