//! `q.changes`: the catch-up of a follower. The log's commits after a position, in
//! position order, as `q.history` decodes them, filtered, in pages bounded by count, bytes
//! and the positions looked at ([`CHANGES_SCAN_MAX`]), each saying where to go on from.
//! Only what this replica has applied is served, and never an entry its projector
//! quarantined (garbage, a replayed or foreign commit on a subject): a follower sees the
//! commits the projections are folded from, no more.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use provledger_client::follow::ChangeFilter;
use provledger_events::codec;
use provledger_events::log::CommitStream;
use provledger_events::{AggregateKind, Commit, JetStreamLog, ReadError};
use provledger_projections::timeline;
use serde::Serialize;
use serde_json::value::RawValue;

use super::error::{bad, ErrorCode, QueryError};
use super::request::parse;
#[cfg(doc)]
use crate::messages::ChangesData;
use crate::messages::{ChangesRequest, ChangesStop, HistoryItem, CHANGES_SCAN_MAX};
use crate::metrics::Metrics;
use crate::replica::QueryContext;
use crate::store::HistoryCopy;

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

/// A [`ChangesData`] as written on the wire: each change already JSON, written once
/// (its size is what the page's byte bound counts) and copied into the reply as it is.
/// The same fields in the same order as [`ChangesData`], which documents them (its
/// schema); a test holds the two to the same JSON.
#[derive(Serialize)]
struct ChangesPage {
    changes: Vec<Box<RawValue>>,
    next: u64,
    end: u64,
    stopped: ChangesStop,
}

impl ChangesPage {
    fn written(&self) -> Result<Box<RawValue>, QueryError> {
        serde_json::value::to_raw_value(self).map_err(unwritable)
    }
}

/// One page of changes after `after`.
pub(crate) async fn changes(
    ctx: &QueryContext,
    payload: &[u8],
) -> Result<Box<RawValue>, QueryError> {
    let request: ChangesRequest = parse(payload)?;
    let filter = filter_of(&request)?;
    let limit = request.limit.unwrap_or(LIMIT_DEFAULT);
    if !(1..=LIMIT_MAX).contains(&limit) {
        return Err(bad("limit", format!("must be 1..={LIMIT_MAX}")));
    }
    let after = request.after.unwrap_or(0);
    // Only what this replica applied: its projector decided what was quarantined up to it.
    let end = ctx.position();
    // One aggregate is read by its subject: only its commits are looked at, so the whole
    // range fits one request. Its last folded commit says where that read must reach: a
    // read that stops short of it was answered by a stream replica behind the leader.
    let (last, must_reach) = match filter.aggregate {
        Some(aggregate) => {
            let folded = ctx
                .store
                .entity(&aggregate)?
                .map(|e| e.header().last_position);
            (end, folded.filter(|p| *p > after && *p <= end))
        }
        None => (end.min(after.saturating_add(CHANGES_SCAN_MAX)), None),
    };
    let mut page = ChangesPage {
        changes: Vec::new(),
        next: after,
        end,
        stopped: ChangesStop::End,
    };
    if after >= end {
        return page.written();
    }
    let quarantined: HashSet<u64> = ctx.store.quarantined_between(after + 1, last)?;
    let budget = ctx.page_bytes_max();
    let mut bytes = 0;
    let mut entries = match filter.aggregate {
        // Up to `last`, which this replica applied, so stored: no need to ask the stream's
        // end.
        Some(aggregate) => PageSource::log(
            ctx,
            ctx.log.read_aggregate_range(aggregate, after + 1, last),
        ),
        None => PageSource::open(ctx, after, last)?,
    };
    let mut reached = after;
    while let Some(entry) = entries.next().await {
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
        reached = commit.position;
        if quarantined.contains(&commit.position) || !filter.admits(&commit) {
            page.next = commit.position;
            continue;
        }
        let position = commit.position;
        let item = HistoryItem {
            timeline: timeline::render(&commit),
            commit,
        };
        let written = serde_json::value::to_raw_value(&item).map_err(unwritable)?;
        // The separating comma counts too.
        let size = written.get().len() + 1;
        if !page.changes.is_empty() && bytes + size > budget {
            page.stopped = ChangesStop::Bytes;
            return page.written();
        }
        bytes += size;
        page.next = position;
        page.changes.push(written);
        if page.changes.len() as u64 == limit {
            page.stopped = ChangesStop::Limit;
            return page.written();
        }
    }
    if let Some(expected) = must_reach.filter(|p| reached < *p) {
        return Err(QueryError::new(
            ErrorCode::Unavailable,
            format!(
                "reading the log's changes: the stream answered up to position {reached}, but this replica folded a commit of the aggregate at {expected} (a stream replica behind its leader answered); ask again"
            ),
        ));
    }
    // Every position up to `last` was looked at.
    page.next = last;
    if last < end {
        page.stopped = ChangesStop::Scan;
    }
    page.written()
}

/// Where a page's commits are read: this replica's copy of the stream (`crate::log_copy`)
/// for the positions it holds, then the stream. The copy is local (a sled range, no
/// message per commit through the NATS server, which cost the server more than the read
/// itself), and holds exactly what the projector took: every commit it folded or held,
/// none it quarantined (the copier refuses what does not link its chain).
struct PageSource {
    /// The copy's commits from the page's start through `copy_through`.
    copy: Option<crate::log_copy::CopyEntries>,
    copy_through: u64,
    /// Read once the copy ends, from the position after the last one it gave.
    log: Option<CommitStream>,
    reopen: Option<(JetStreamLog, u64)>,
    /// The last position the copy gave.
    looked: u64,
    /// Entries read from each (`provledger_changes_read_total`), counted when dropped.
    read: (u64, u64),
    metrics: Arc<Metrics>,
}

impl Drop for PageSource {
    fn drop(&mut self) {
        self.metrics.changes_read(self.read.0, self.read.1);
    }
}

impl PageSource {
    fn log(ctx: &QueryContext, stream: CommitStream) -> Self {
        PageSource {
            copy: None,
            copy_through: 0,
            log: Some(stream),
            reopen: None,
            looked: 0,
            read: (0, 0),
            metrics: ctx.metrics.clone(),
        }
    }

    /// Positions after `after` through `last`: from the copy where it holds them whole
    /// (a copy begun later than `after`, or one not yet at it, is not read).
    fn open(ctx: &QueryContext, after: u64, last: u64) -> Result<Self, QueryError> {
        let copy = match ctx.store.history_copy()? {
            HistoryCopy::Separate(extent) if extent.from <= after + 1 && extent.through > after => {
                Some(extent.through.min(last))
            }
            _ => None,
        };
        Ok(match copy {
            Some(through) => PageSource {
                copy: Some(ctx.store.raw_copy_range(after + 1, through)?),
                copy_through: through,
                log: None,
                reopen: Some((ctx.log.clone(), last)),
                looked: after,
                read: (0, 0),
                metrics: ctx.metrics.clone(),
            },
            None => PageSource::log(ctx, ctx.log.read_range(after + 1, last)),
        })
    }

    async fn next(&mut self) -> Option<Result<Commit, ReadError>> {
        if let Some(copy) = &mut self.copy {
            let entry = copy.next();
            match entry {
                Some(Ok((position, bytes))) => match codec::decode(&bytes, position) {
                    Ok(commit) if commit.hash_is_valid() && commit.position > self.looked => {
                        self.looked = position;
                        self.read.0 += 1;
                        return Some(Ok(commit));
                    }
                    _ => tracing::error!(
                        position,
                        "this replica's copy of the stream holds no intact commit here (run `provledger audit` on its data dir): the page is read from the stream"
                    ),
                },
                Some(Err(_)) => tracing::error!(
                    after = self.looked,
                    "this replica's copy of the stream cannot be read: the page is read from the stream"
                ),
                // Every position through its end was looked at.
                None => self.looked = self.copy_through,
            }
            self.copy = None;
        }
        if let Some((log, last)) = self.reopen.take() {
            self.log = Some(log.read_range(self.looked + 1, last));
        }
        let entry = self.log.as_mut()?.next().await;
        self.read.1 += u64::from(entry.is_some());
        entry
    }
}

/// A change or page that would not encode as JSON: plain serde data always does, so this
/// is a bug to report, not the caller's fault.
fn unwritable(e: serde_json::Error) -> QueryError {
    QueryError::new(
        ErrorCode::Internal,
        format!("writing a page of changes as JSON: {e}"),
    )
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

    #[test]
    fn a_page_written_ahead_is_the_json_of_the_documented_changes_data() {
        // Given a page of two changes, as the documented (schema) type and as written ahead;
        use crate::messages::ChangesData;
        use provledger_events::catalogue::samples;
        use provledger_events::{AggregateId, Commit, CommitDraft, Hash};
        let items: Vec<HistoryItem> = samples::all()
            .into_iter()
            .take(2)
            .enumerate()
            .map(|(n, event)| {
                let mut commit = Commit::seal(
                    AggregateId::cluster(uuid::Uuid::from_u128(n as u128 + 1)),
                    1,
                    Hash::ZERO,
                    CommitDraft::now("t", vec![event]),
                );
                commit.position = n as u64 + 5;
                HistoryItem {
                    timeline: timeline::render(&commit),
                    commit,
                }
            })
            .collect();
        let documented = ChangesData {
            changes: items.clone(),
            next: 6,
            end: 9,
            stopped: ChangesStop::Limit,
        };
        let ahead = ChangesPage {
            changes: items
                .iter()
                .map(|i| serde_json::value::to_raw_value(i).unwrap())
                .collect(),
            next: 6,
            end: 9,
            stopped: ChangesStop::Limit,
        };
        // When both are written, then the bytes are the same.
        assert_eq!(
            serde_json::to_string(&documented).unwrap(),
            ahead.written().unwrap().get()
        );
    }
}
