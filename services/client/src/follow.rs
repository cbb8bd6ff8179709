//! Following the ledger from a position: the commits after it, then each new one as serve
//! applies it, in position order, none missed and none twice. The protocol is NATS and JSON
//! only (docs/following.md), so a service in any language can follow it the same way:
//! - the live feed, `<prefix>.feed.>` (serve's `feed.rs`): each change once per replica,
//!   with `prev`, and a bookmark every few seconds;
//! - `q.changes`, the catch-up, which is the feed's truth: it fills every gap.
//!
//! A [`Follower`] subscribes to the feed first, then catches up from its position through
//! `q.changes` until current, then takes the feed: a change at or before its position is a
//! duplicate (another replica's, or one the catch-up already gave); one whose `prev` is past
//! its position means something was missed (a slow consumer, a reconnect, a batch the feed
//! dropped), and it catches up again from its position. A bookmark past its position, or a
//! feed silent for [`FEED_SILENCE_MAX`], does the same. A follower of one aggregate
//! subscribes to that aggregate's subject alone (the server filters) and checks each
//! change's `aggregate_prev` instead of `prev`; its catch-up reads that aggregate alone.
//! Any other filter is applied here, to the whole feed: a follower of one operation still
//! hears every change's `prev`.

use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use provledger_events::{AggregateId, AggregateKind, Commit};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use uuid::Uuid;

/// How long the feed may be silent (no change, no bookmark: serve sends one every 5 s)
/// before the follower checks through `q.changes` that it is not cut off.
pub const FEED_SILENCE_MAX: Duration = Duration::from_secs(15);
/// How long one `q.changes` request waits for its reply.
const CATCH_UP_REPLY_WAIT: Duration = Duration::from_secs(10);
/// How long a catch-up keeps retrying a busy or absent service before it fails.
const CATCH_UP_RETRY_FOR: Duration = Duration::from_secs(30);
/// Commits asked for per catch-up page.
const CATCH_UP_PAGE: u64 = 1000;

/// The live feed's subject for `aggregate`'s changes: `<prefix>.feed.<kind>.<id>`.
pub fn feed_subject(prefix: &str, aggregate: &AggregateId) -> String {
    aggregate.subject(prefix, "feed")
}

/// Which commits a follower wants; an empty set or `None` admits all. Every part given
/// must hold; within `kinds` and `event_types` any one listed does. `q.changes` applies
/// the same rule (serve uses this type).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeFilter {
    pub kinds: BTreeSet<AggregateKind>,
    pub aggregate: Option<AggregateId>,
    pub operation_id: Option<Uuid>,
    pub event_types: BTreeSet<String>,
}

impl ChangeFilter {
    /// Whether `commit` is one the follower wants.
    pub fn admits(&self, commit: &Commit) -> bool {
        (self.kinds.is_empty() || self.kinds.contains(&commit.aggregate.kind))
            && self.aggregate.is_none_or(|a| a == commit.aggregate)
            && self
                .operation_id
                .is_none_or(|op| commit.operation_id == Some(op))
            && (self.event_types.is_empty()
                || commit
                    .events
                    .iter()
                    .any(|e| self.event_types.contains(e.name())))
    }

    /// The filter as `q.changes` takes it.
    fn to_request(&self) -> Value {
        let mut body = json!({});
        if !self.kinds.is_empty() {
            body["kinds"] = json!(self.kinds);
        }
        if let Some(a) = &self.aggregate {
            body["aggregate"] = json!(a.to_string());
        }
        if let Some(op) = &self.operation_id {
            body["operation_id"] = json!(op);
        }
        if !self.event_types.is_empty() {
            body["event_types"] = json!(self.event_types);
        }
        body
    }
}

/// Why following stopped.
#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    #[error("cannot subscribe to the live feed {subject}: {reason}")]
    Subscribe { subject: String, reason: String },
    #[error(
        "catching up through {subject}: {reason} (is `provledger serve` running on this NATS?)"
    )]
    CatchUp { subject: String, reason: String },
    #[error("{subject} refused the catch-up: {code}: {message}")]
    Refused {
        subject: String,
        code: String,
        message: String,
    },
    #[error("the live feed's subscription ended (the NATS connection closed)")]
    FeedEnded,
}

/// One commit a follower hands over, in position order.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Change {
    #[serde(flatten)]
    pub commit: Commit,
    /// One readable line per event, as `q.history` renders it.
    #[serde(default)]
    pub timeline: Vec<String>,
}

/// What [`Follower::next`] gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Followed {
    /// A commit the filter admits, the next in position order.
    Change(Box<Change>),
    /// The follower is current: it has everything up to `position` (after its catch-up,
    /// and on each bookmark while idle).
    Current { position: u64 },
}

/// A change as the feed carries it.
#[derive(Deserialize)]
struct FeedChange {
    #[serde(flatten)]
    change: Change,
    prev: u64,
    /// Absent from a replica older than the field: a follower of one aggregate then checks
    /// against `prev`, which is never less (and catches up more often than it must).
    #[serde(default)]
    aggregate_prev: Option<u64>,
}

#[derive(Deserialize)]
struct Bookmark {
    position: u64,
}

/// Counts of what a follower did, for a progress line or a test.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FollowStats {
    /// Changes handed over as the feed brought them (not through a catch-up).
    pub live: u64,
    pub catch_ups: u64,
    pub duplicates: u64,
    pub gaps: u64,
    /// Messages heard on the feed (changes and bookmarks): what following cost the server
    /// and this follower's connection.
    pub heard: u64,
}

/// Follows the ledger from a position (see the module).
pub struct Follower {
    client: async_nats::Client,
    /// `<prefix>.feed.bookmark`, told apart from changes on every feed message.
    bookmark_subject: String,
    filter: ChangeFilter,
    /// The whole feed, or for a follower of one aggregate its subject and the bookmarks.
    feed: futures::stream::BoxStream<'static, async_nats::Message>,
    /// Following one aggregate on its subject alone: gaps are told by `aggregate_prev`.
    narrow: bool,
    /// Everything up to here was handed over (or did not match): where to resume.
    position: u64,
    /// Changes a catch-up page gave that are not handed over yet, and where the page ended.
    pending: VecDeque<Change>,
    page_next: u64,
    catching_up: bool,
    /// The catch-up reached the end with changes still pending: say `Current` once they
    /// are handed over.
    current_once_handed: bool,
    /// `<prefix>.q.changes`.
    changes_subject: String,
    /// The next catch-up page, asked for while the one before it is handed over.
    prefetch: Option<Prefetch>,
    stats: FollowStats,
}

impl Follower {
    /// Starts following after `position` (0: from the first commit): subscribes to the
    /// feed, then catches up from there on the first [`Follower::next`].
    pub async fn start(
        client: async_nats::Client,
        prefix: &str,
        filter: ChangeFilter,
        position: u64,
    ) -> Result<Self, FollowError> {
        let bookmark_subject = format!("{prefix}.feed.bookmark");
        let subscribe = |subject: String| {
            let client = client.clone();
            async move {
                client
                    .subscribe(subject.clone())
                    .await
                    .map_err(|e| FollowError::Subscribe {
                        subject,
                        reason: e.to_string(),
                    })
            }
        };
        // A follower of one aggregate hears its subject alone (the server filters: it costs
        // nothing per change of the others) and the bookmarks; any other follower hears the
        // whole feed, whose `prev` tells it missed nothing, and filters it here.
        let (feed, subject, narrow) = match filter.aggregate {
            Some(aggregate) => {
                let subject = feed_subject(prefix, &aggregate);
                let changes = subscribe(subject.clone()).await?;
                let bookmarks = subscribe(bookmark_subject.clone()).await?;
                (
                    futures::stream::select(changes, bookmarks).boxed(),
                    subject,
                    true,
                )
            }
            None => {
                let subject = format!("{prefix}.feed.>");
                (subscribe(subject.clone()).await?.boxed(), subject, false)
            }
        };
        // The subscription must be known to the server before the catch-up reads the end,
        // or a change published in between would be neither caught up nor heard.
        client.flush().await.map_err(|e| FollowError::Subscribe {
            subject,
            reason: e.to_string(),
        })?;
        Ok(Follower {
            client,
            bookmark_subject,
            filter,
            feed,
            narrow,
            position,
            pending: VecDeque::new(),
            page_next: position,
            catching_up: true,
            current_once_handed: false,
            changes_subject: format!("{prefix}.q.changes"),
            prefetch: None,
            stats: FollowStats::default(),
        })
    }

    /// Everything up to this position was handed over: store it once what
    /// [`Follower::next`] gave is handled, and start from it to resume.
    pub fn position(&self) -> u64 {
        self.position
    }

    pub fn stats(&self) -> FollowStats {
        self.stats
    }

    /// The next change the filter admits, or word that the follower is current.
    pub async fn next(&mut self) -> Result<Followed, FollowError> {
        loop {
            if let Some(change) = self.pending.pop_front() {
                self.position = change.commit.position;
                return Ok(Followed::Change(Box::new(change)));
            }
            self.position = self.position.max(self.page_next);
            if self.current_once_handed {
                // The last page's changes are handed over: current now, not at the next
                // bookmark (up to 5 s later).
                self.current_once_handed = false;
                return Ok(Followed::Current {
                    position: self.position,
                });
            }
            if self.catching_up {
                if let Some(current) = self.catch_up_page().await? {
                    return Ok(current);
                }
                continue;
            }
            let message = tokio::time::timeout(FEED_SILENCE_MAX, self.feed.next()).await;
            let message = match message {
                Ok(Some(m)) => m,
                Ok(None) => return Err(FollowError::FeedEnded),
                // Silent: serve gone, or this follower cut off; the catch-up tells.
                Err(_) => {
                    self.catching_up = true;
                    continue;
                }
            };
            self.stats.heard += 1;
            if message.subject.as_str() == self.bookmark_subject {
                match serde_json::from_slice::<Bookmark>(&message.payload) {
                    Ok(b) if b.position > self.position => self.catching_up = true,
                    Ok(_) => {
                        return Ok(Followed::Current {
                            position: self.position,
                        })
                    }
                    Err(_) => {}
                }
                continue;
            }
            let Ok(feed) = serde_json::from_slice::<FeedChange>(&message.payload) else {
                // Not a change (another publisher on the subject): the catch-up is the truth.
                continue;
            };
            let position = feed.change.commit.position;
            match heard(self.position, self.narrow, &feed) {
                Heard::Duplicate => {
                    self.stats.duplicates += 1;
                    continue;
                }
                Heard::Gap => {
                    self.stats.gaps += 1;
                    self.catching_up = true;
                    continue;
                }
                Heard::Next => {}
            }
            self.position = position;
            self.page_next = position;
            if self.filter.admits(&feed.change.commit) {
                self.stats.live += 1;
                return Ok(Followed::Change(Box::new(feed.change)));
            }
        }
    }

    /// One page of the catch-up from the position; `Some(Current)` once it reached the
    /// replica's end (then the feed takes over). The page after it is asked for before this
    /// one is decoded, so that serve writes it while this one is read.
    async fn catch_up_page(&mut self) -> Result<Option<Followed>, FollowError> {
        let after = self.position;
        let payload = match self.prefetch.take() {
            Some(prefetch) if prefetch.after == after => {
                prefetch.reply.await.map_err(|e| FollowError::CatchUp {
                    subject: self.changes_subject.clone(),
                    reason: format!("the page asked for ahead was lost: {e}"),
                })??
            }
            stale => {
                // Asked from a position the follower left (a gap sent it back): not this.
                if let Some(prefetch) = stale {
                    prefetch.reply.abort();
                }
                ask(
                    &self.client,
                    &self.changes_subject,
                    self.page_request(after),
                )
                .await?
            }
        };
        let unparsable = |e: serde_json::Error| FollowError::CatchUp {
            subject: self.changes_subject.clone(),
            reason: format!("a reply that does not parse as a page of changes: {e}"),
        };
        let reply: Reply = serde_json::from_slice(&payload).map_err(unparsable)?;
        let page: PageHead = serde_json::from_str(reply.data.get()).map_err(unparsable)?;
        let next = page.next.max(after);
        let end = page.end.max(next);
        if next < end {
            self.prefetch = Some(Prefetch {
                after: next,
                reply: tokio::spawn(ask_owned(
                    self.client.clone(),
                    self.changes_subject.clone(),
                    self.page_request(next),
                )),
            });
        }
        let changes: Vec<Change> = serde_json::from_str(page.changes.get()).map_err(unparsable)?;
        self.stats.catch_ups += 1;
        self.pending.extend(changes);
        self.page_next = next;
        if next >= end && self.pending.is_empty() {
            self.catching_up = false;
            self.position = self.page_next;
            return Ok(Some(Followed::Current {
                position: self.position,
            }));
        }
        if next >= end {
            // The page's changes first; the follower is current after them.
            self.catching_up = false;
            self.current_once_handed = true;
        }
        Ok(None)
    }

    /// The `q.changes` request for the page after `after`.
    fn page_request(&self, after: u64) -> Bytes {
        let mut body = self.filter.to_request();
        body["after"] = json!(after);
        body["limit"] = json!(CATCH_UP_PAGE);
        body.to_string().into()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        if let Some(prefetch) = self.prefetch.take() {
            prefetch.reply.abort();
        }
    }
}

/// What a change heard on the feed is to a follower at `position`.
#[derive(Debug, PartialEq, Eq)]
enum Heard {
    /// At or before `position`: handled already (the catch-up gave it, or another replica).
    Duplicate,
    /// Something between `position` and it was missed: catch up.
    Gap,
    /// The next change: take it.
    Next,
}

/// The follower's rule for a change heard on the feed. No change lies between its `prev`
/// and it (no change of its aggregate between its `aggregate_prev` and it): a follower that
/// hears the whole feed and handled less than `prev`, or a `narrow` one (its aggregate's
/// subject alone) that handled less than `aggregate_prev`, missed one.
fn heard(position: u64, narrow: bool, feed: &FeedChange) -> Heard {
    let prev = match (narrow, feed.aggregate_prev) {
        (true, Some(aggregate_prev)) => aggregate_prev,
        _ => feed.prev,
    };
    if feed.change.commit.position <= position {
        Heard::Duplicate
    } else if prev > position {
        Heard::Gap
    } else {
        Heard::Next
    }
}

/// A page asked for ahead: the one after `after`.
struct Prefetch {
    after: u64,
    reply: tokio::task::JoinHandle<Result<Bytes, FollowError>>,
}

/// A reply of serve's: its data, or the error it answered.
#[derive(Deserialize)]
struct Reply<'a> {
    #[serde(borrow)]
    data: &'a RawValue,
}

#[derive(Deserialize)]
struct ReplyRefusal {
    error: ReplyError,
}

#[derive(Deserialize)]
struct ReplyError {
    code: String,
    #[serde(default)]
    message: String,
}

/// A `q.changes` page with its changes not yet decoded.
#[derive(Deserialize)]
struct PageHead<'a> {
    #[serde(borrow)]
    changes: &'a RawValue,
    next: u64,
    end: u64,
}

async fn ask_owned(
    client: async_nats::Client,
    subject: String,
    body: Bytes,
) -> Result<Bytes, FollowError> {
    ask(&client, &subject, body).await
}

/// Asks `subject`, retrying a busy or absent service for a while; the payload of a reply
/// that is not a refusal.
async fn ask(
    client: &async_nats::Client,
    subject: &str,
    body: Bytes,
) -> Result<Bytes, FollowError> {
    let deadline = tokio::time::Instant::now() + CATCH_UP_RETRY_FOR;
    let mut backoff = Duration::from_millis(100);
    loop {
        let asked = tokio::time::timeout(
            CATCH_UP_REPLY_WAIT,
            client.request(subject.to_string(), body.clone()),
        )
        .await;
        let retry_reason = match asked {
            Ok(Ok(message)) => match serde_json::from_slice::<ReplyRefusal>(&message.payload) {
                // Not a refusal: the caller reads it.
                Err(_) => return Ok(message.payload),
                Ok(refusal) if refusal.error.code == "unavailable" => refusal.error.message,
                Ok(refusal) => {
                    return Err(FollowError::Refused {
                        subject: subject.to_string(),
                        code: refusal.error.code,
                        message: refusal.error.message,
                    })
                }
            },
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no reply within {CATCH_UP_REPLY_WAIT:?}"),
        };
        if tokio::time::Instant::now() + backoff > deadline {
            return Err(FollowError::CatchUp {
                subject: subject.to_string(),
                reason: retry_reason,
            });
        }
        tracing::debug!(%subject, reason = %retry_reason, ?backoff, "catch-up retried");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::catalogue::samples;
    use provledger_events::{CommitDraft, Hash};

    fn commit(
        aggregate: AggregateId,
        operation: Option<Uuid>,
        events: Vec<provledger_events::Event>,
    ) -> Commit {
        let mut draft = CommitDraft::now("t", events);
        draft.operation_id = operation;
        Commit::seal(aggregate, 1, Hash::ZERO, draft)
    }

    #[test]
    fn a_narrow_follower_tells_a_gap_by_aggregate_prev_and_any_other_by_prev() {
        // Given a change at 20 whose last change before it was at 19, and its aggregate's
        // at 7,
        let feed = |aggregate_prev: Option<u64>| {
            let mut change = commit(AggregateId::cluster(Uuid::from_u128(1)), None, vec![]);
            change.position = 20;
            FeedChange {
                change: Change {
                    commit: change,
                    timeline: vec![],
                },
                prev: 19,
                aggregate_prev,
            }
        };
        // then a follower of that aggregate alone at 7 (or past it) takes it, one at 6
        // missed a change of it;
        assert_eq!(heard(7, true, &feed(Some(7))), Heard::Next);
        assert_eq!(heard(12, true, &feed(Some(7))), Heard::Next);
        assert_eq!(heard(6, true, &feed(Some(7))), Heard::Gap);
        // a follower of the whole feed at 7 missed what lies up to 19;
        assert_eq!(heard(7, false, &feed(Some(7))), Heard::Gap);
        assert_eq!(heard(19, false, &feed(Some(7))), Heard::Next);
        // from a replica that does not say `aggregate_prev`, `prev` decides for both;
        assert_eq!(heard(7, true, &feed(None)), Heard::Gap);
        assert_eq!(heard(19, true, &feed(None)), Heard::Next);
        // and at or past 20 it is a duplicate.
        assert_eq!(heard(20, true, &feed(Some(7))), Heard::Duplicate);
        assert_eq!(heard(25, false, &feed(Some(7))), Heard::Duplicate);
    }

    #[test]
    fn a_filter_admits_a_commit_only_when_every_part_given_holds() {
        let op = Uuid::from_u128(7);
        let cluster = AggregateId::cluster(Uuid::from_u128(1));
        let event = samples::all().remove(0);
        let name = event.name();
        let c = commit(cluster, Some(op), vec![event]);
        // Given no filter, then everything is admitted;
        assert!(ChangeFilter::default().admits(&c));
        // given each part alone, then it decides;
        let kind = |k| ChangeFilter {
            kinds: [k].into(),
            ..Default::default()
        };
        assert!(kind(AggregateKind::Cluster).admits(&c));
        assert!(!kind(AggregateKind::Instance).admits(&c));
        let of_op = |o| ChangeFilter {
            operation_id: Some(o),
            ..Default::default()
        };
        assert!(of_op(op).admits(&c));
        assert!(!of_op(Uuid::from_u128(8)).admits(&c));
        let typed = |t: &str| ChangeFilter {
            event_types: [t.to_string()].into(),
            ..Default::default()
        };
        assert!(typed(name).admits(&c));
        assert!(!typed("operation_heartbeat").admits(&c) || name == "operation_heartbeat");
        // and given several, then all must hold.
        let both = ChangeFilter {
            kinds: [AggregateKind::Cluster].into(),
            operation_id: Some(Uuid::from_u128(8)),
            ..Default::default()
        };
        assert!(!both.admits(&c));
        // A commit made for no operation is not one of an operation's.
        assert!(!of_op(op).admits(&commit(cluster, None, vec![])));
    }
}
