//! `q.changes`: the catch-up of a follower. The log's commits after a position, in
//! position order, as `q.history` decodes them, filtered, in pages bounded by count, bytes
//! and the positions looked at ([`CHANGES_SCAN_MAX`]), each saying where to go on from.
//! Only what this replica has applied is served, and never an entry its projector
//! quarantined (garbage, a replayed or foreign commit on a subject): a follower sees the
//! commits the projections are folded from, no more.

use std::collections::{BTreeSet, HashSet};

use futures::StreamExt;
use provledger_client::follow::ChangeFilter;
use provledger_events::{AggregateKind, EventLog, ReadError};
use provledger_projections::timeline;
use serde_json::Value;

use super::error::{bad, to_data, ErrorCode, QueryError};
use super::request::parse;
use crate::messages::{ChangesData, ChangesRequest, ChangesStop, HistoryItem, CHANGES_SCAN_MAX};
use crate::replica::QueryContext;

/// Default and maximum `limit`.
const LIMIT_DEFAULT: u64 = 100;
const LIMIT_MAX: u64 = 1000;

/// The request's filter, each part checked.
fn filter_of(request: &ChangesRequest) -> Result<ChangeFilter, QueryError> {
    let kinds: BTreeSet<AggregateKind> = request.kinds.iter().flatten().copied().collect();
    if request.kinds.as_ref().is_some_and(Vec::is_empty) {
        return Err(bad(
            "kinds",
            "an empty list admits nothing: leave it out for all kinds",
        ));
    }
    let mut event_types = BTreeSet::new();
    if let Some(types) = &request.event_types {
        if types.is_empty() {
            return Err(bad(
                "event_types",
                "an empty list admits nothing: leave it out for all events",
            ));
        }
        for t in types {
            if !provledger_events::Event::names().contains(t) {
                // Debug-quoted: a caller's text, not ours.
                return Err(bad(
                    "event_types",
                    format!(
                        "{:?} is not an event of the catalogue (docs/events.md)",
                        t.chars().take(80).collect::<String>()
                    ),
                ));
            }
            event_types.insert(t.clone());
        }
    }
    Ok(ChangeFilter {
        kinds,
        aggregate: request.aggregate,
        operation_id: request.operation_id,
        event_types,
    })
}

/// One page of changes after `after`.
pub(crate) async fn changes(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let request: ChangesRequest = parse(payload)?;
    let filter = filter_of(&request)?;
    let limit = request.limit.unwrap_or(LIMIT_DEFAULT);
    if !(1..=LIMIT_MAX).contains(&limit) {
        return Err(bad("limit", format!("must be 1..={LIMIT_MAX}")));
    }
    let after = request.after.unwrap_or(0);
    // Only what this replica applied: its projector decided what was quarantined up to it.
    let end = ctx.position();
    let last = end.min(after.saturating_add(CHANGES_SCAN_MAX));
    let mut page = ChangesData {
        changes: Vec::new(),
        next: after,
        end,
        stopped: ChangesStop::End,
    };
    if after >= end {
        return Ok(to_data(&page));
    }
    let quarantined: HashSet<u64> = ctx.store.quarantined_between(after + 1, last)?;
    let budget = ctx.page_bytes_max();
    let mut bytes = 0;
    let mut commits = ctx.log.read_all(after + 1).await.map_err(unavailable)?;
    while let Some(entry) = commits.next().await {
        let commit = match entry {
            Ok(c) => c,
            // What the projector quarantined: passed over, as it was.
            Err(
                ReadError::Undecodable { position, .. } | ReadError::OutsideChain { position, .. },
            ) => {
                if position > last {
                    break;
                }
                page.next = position;
                continue;
            }
            Err(e) => return Err(unavailable(e)),
        };
        if commit.position > last {
            break;
        }
        if quarantined.contains(&commit.position) || !filter.admits(&commit) {
            page.next = commit.position;
            continue;
        }
        let item = HistoryItem {
            timeline: timeline::render(&commit),
            commit,
        };
        let size = serde_json::to_vec(&item).map_or(0, |b| b.len());
        if !page.changes.is_empty() && bytes + size > budget {
            page.stopped = ChangesStop::Bytes;
            return Ok(to_data(&page));
        }
        bytes += size;
        page.next = item.commit.position;
        page.changes.push(item);
        if page.changes.len() as u64 == limit {
            page.stopped = ChangesStop::Limit;
            return Ok(to_data(&page));
        }
    }
    // Every position up to `last` was looked at.
    page.next = last;
    if last < end {
        page.stopped = ChangesStop::Scan;
    }
    Ok(to_data(&page))
}

fn unavailable(e: ReadError) -> QueryError {
    QueryError::new(
        ErrorCode::Unavailable,
        format!("reading the log's changes: {e}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_event_types_and_empty_lists_are_refused_naming_the_field() {
        let request =
            |v: serde_json::Value| -> ChangesRequest { serde_json::from_value(v).unwrap() };
        for (body, field) in [
            (
                serde_json::json!({"event_types": ["vm_flew_away"]}),
                "event_types",
            ),
            (serde_json::json!({"event_types": []}), "event_types"),
            (serde_json::json!({"kinds": []}), "kinds"),
        ] {
            let e = filter_of(&request(body.clone())).unwrap_err();
            assert!(e.message.contains(field), "{body}: {}", e.message);
        }
        let ok = filter_of(&request(
            serde_json::json!({"event_types": ["vm_state_changed"], "kinds": ["instance"]}),
        ));
        assert!(ok.is_ok(), "{ok:?}");
    }
}
