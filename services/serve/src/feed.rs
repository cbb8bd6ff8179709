//! The live feed: each change this replica applies, published as JSON on core NATS,
//! `<prefix>.feed.<kind>.<id>` (a follower subscribes to `feed.>`, a kind `feed.cluster.>`,
//! or one aggregate), and a bookmark on `<prefix>.feed.bookmark` every
//! [`FEED_BOOKMARK_INTERVAL`]. Core NATS rather than a second stream: the replica publishes
//! each change once whatever the followers, the server fans it out, and a follower that
//! reads too slowly is the server's slow consumer, cut off by it; the replica holds nothing
//! per follower, so no follower can grow its memory. What a follower misses (a slow
//! consumer, a reconnect, a dropped batch) it sees by `prev` and fills through
//! `q.changes`, which is the feed's truth.

use std::sync::Arc;
use std::time::Duration;

use provledger_client::follow::feed_subject;
use provledger_events::Commit;
use provledger_projections::timeline;
use tokio::sync::watch;

use crate::handoff::{self, Release};
use crate::messages::{FeedBookmark, FeedChange, HistoryItem};
use crate::metrics::FoldMetrics;

/// Applied batches the feed holds before the projector drops the next one (it never waits
/// for the feed): a burst of this many batches, or a NATS connection that stalls, costs
/// followers a catch-up, never the projector its pace.
pub const FEED_QUEUE_BATCHES: usize = 256;
/// Commits the feed holds, queued or being published, before the projector drops the next
/// batch: what bounds its memory, since a batch holds up to `BATCH_ENTRIES_MAX` commits
/// (256 of those would be a million commits). About a second of writes at this machine's
/// highest rate; a NATS server slowed by its fan-out to many followers fills it, and costs
/// the followers a catch-up, not serve its memory.
pub const FEED_QUEUE_COMMITS: usize = 16_384;
// A batch of the largest size always fits in an empty queue.
const _: () = assert!(FEED_QUEUE_COMMITS >= crate::projector::BATCH_ENTRIES_MAX);

/// The projector's end of the feed's queue, bounded in batches and in commits.
pub type FeedSender = handoff::Sender<FeedBatch>;

/// The feed task's end: each batch taken is held (counted) until it is published.
pub(crate) type FeedReceiver = handoff::Receiver<FeedBatch>;

/// A new feed queue.
pub(crate) fn queue() -> (FeedSender, FeedReceiver) {
    handoff::queue(FEED_QUEUE_BATCHES, FEED_QUEUE_COMMITS, Release::WhenDone)
}

impl handoff::Batch for FeedBatch {
    fn commits(&self) -> usize {
        self.commits.len()
    }
}

/// How often each replica says how far it has published.
pub const FEED_BOOKMARK_INTERVAL: Duration = Duration::from_secs(5);

/// What the projector hands the feed once a batch is written: the commits it took, in
/// position order, after `after` through `through` (positions between them that are not
/// here were quarantined: no change).
#[derive(Debug)]
pub struct FeedBatch {
    pub after: u64,
    pub through: u64,
    pub commits: Vec<FedCommit>,
}

/// A commit for the feed, with the position of its aggregate's commit folded before it (0:
/// its first), which a follower of that aggregate alone checks its position against.
/// `None` where the projector cannot say (a commit held past a loss): the change then
/// carries the whole log's `prev` there too, which is never less. The commit is shared
/// with the copier (`crate::log_copy::CopyBatch`), which takes the same ones.
#[derive(Debug)]
pub struct FedCommit {
    pub commit: Arc<Commit>,
    pub aggregate_prev: Option<u64>,
}

/// The changes of one batch, each with its `prev` and `aggregate_prev`.
fn changes(batch: &FeedBatch) -> impl Iterator<Item = FeedChange> + '_ {
    let mut prev = batch.after;
    batch.commits.iter().map(move |fed| {
        // Never past `prev`: a commit of the aggregate after `prev` would be in this batch
        // before it, which the projector's order rules out.
        debug_assert!(fed.aggregate_prev.is_none_or(|p| p <= prev));
        let change = FeedChange {
            change: HistoryItem {
                timeline: timeline::render(&fed.commit),
                commit: Arc::clone(&fed.commit),
            },
            prev,
            aggregate_prev: fed.aggregate_prev.unwrap_or(prev),
        };
        prev = fed.commit.position;
        change
    })
}

/// Publishes what `batches` brings until `stop`: nothing until `ready` says the replica
/// has caught up (it would flood followers with what the other replicas published
/// already), then every change, and a bookmark every interval with `served_by`.
pub(crate) async fn run(
    client: async_nats::Client,
    prefix: String,
    mut batches: FeedReceiver,
    ready: impl Fn() -> Option<String> + Send + 'static,
    metrics: FoldMetrics,
    mut stop: watch::Receiver<bool>,
) {
    let mut published_through = 0;
    let mut bookmarks = tokio::time::interval(FEED_BOOKMARK_INTERVAL);
    bookmarks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            batch = batches.recv() => {
                let Some(batch) = batch else { return };
                let held = batch.commits.len();
                if ready().is_none() {
                    batches.release(held);
                    continue;
                }
                let through = batch.through;
                let mut published = 0;
                for change in changes(&batch) {
                    let subject = feed_subject(&prefix, &change.change.commit.aggregate);
                    let payload = serde_json::to_vec(&change)
                        .expect("a feed change: plain serde data (string keys, no fallible impls) encodes as JSON");
                    if let Err(e) = client.publish(subject, payload.into()).await {
                        tracing::warn!(error = %e, "the live feed could not publish; its followers catch up through q.changes");
                        break;
                    }
                    published += 1;
                }
                batches.release(held);
                metrics.feed_published(published);
                published_through = through;
            }
            _ = bookmarks.tick() => {
                let Some(served_by) = ready() else { continue };
                let bookmark = FeedBookmark { position: published_through, served_by };
                let payload = serde_json::to_vec(&bookmark)
                    .expect("a bookmark: plain serde data encodes as JSON");
                let _ = client.publish(format!("{prefix}.feed.bookmark"), payload.into()).await;
            }
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::{AggregateId, CommitDraft, Hash};
    use uuid::Uuid;

    #[test]
    fn each_change_of_a_batch_names_the_one_before_it_and_the_first_the_batch_start() {
        // Given a batch after position 10 holding commits at 12 and 15 (11, 13 and 14
        // quarantined),
        let commit = |position| {
            let mut c = Commit::seal(
                AggregateId::cluster(Uuid::from_u128(position as u128)),
                1,
                Hash::ZERO,
                CommitDraft::now("t", vec![]),
            );
            c.position = position;
            c
        };
        // the first of its aggregate's commits before it at 3, the second held past a loss;
        let batch = FeedBatch {
            after: 10,
            through: 15,
            commits: vec![
                FedCommit {
                    commit: Arc::new(commit(12)),
                    aggregate_prev: Some(3),
                },
                FedCommit {
                    commit: Arc::new(commit(15)),
                    aggregate_prev: None,
                },
            ],
        };
        // when its changes are made, then each says no change lies between it and `prev`,
        // and no change of its aggregate between it and `aggregate_prev` (`prev` where the
        // projector could not say).
        let prevs: Vec<(u64, u64, u64)> = changes(&batch)
            .map(|c| (c.prev, c.aggregate_prev, c.change.commit.position))
            .collect();
        assert_eq!(prevs, vec![(10, 3, 12), (12, 12, 15)]);
        assert_eq!(
            feed_subject("provledger", &commit(12).aggregate),
            format!("provledger.feed.cluster.{}", Uuid::from_u128(12))
        );
    }

    #[test]
    fn a_change_is_published_as_q_history_gives_its_commit_with_prev_and_aggregate_prev() {
        // Given a commit with every optional field set and events with text to escape,
        let events: Vec<provledger_events::Event> = serde_json::from_value(serde_json::json!([
            {"provider_registered": {"name": "rack \"7\"\n", "host": "h\u{1}.example"}},
            {"inventory_set": {"resource_class": "VCPU", "inventory": {
                "total": 64, "reserved": 0, "allocation_ratio": 1.5,
                "min_unit": 1, "max_unit": 64, "step_size": 1}}}
        ]))
        .expect("catalogue events");
        let mut draft = CommitDraft::now("svc <a>&\"b\"", events);
        draft.operation_id = Some(Uuid::from_u128(7));
        draft.causation_id = Some(Uuid::from_u128(8));
        draft.trace = provledger_events::TraceContext::parse(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        );
        let mut commit = Commit::seal(
            AggregateId::provider(Uuid::from_u128(9)),
            3,
            Hash([4; 32]),
            draft,
        );
        commit.position = 41;
        let batch = FeedBatch {
            after: 40,
            through: 41,
            commits: vec![FedCommit {
                commit: Arc::new(commit.clone()),
                aggregate_prev: Some(17),
            }],
        };
        // when the feed writes its change (its commit shared with the copier), then the
        // bytes are q.history's item of the same commit, followed by `prev` and
        // `aggregate_prev`.
        let published: Vec<Vec<u8>> = changes(&batch)
            .map(|c| serde_json::to_vec(&c).expect("json"))
            .collect();
        let history = serde_json::to_vec(&HistoryItem {
            timeline: timeline::render(&commit),
            commit,
        })
        .expect("json");
        let mut expected = history[..history.len() - 1].to_vec();
        expected.extend_from_slice(br#","prev":40,"aggregate_prev":17}"#);
        assert_eq!(
            published,
            vec![expected],
            "{}",
            String::from_utf8_lossy(&published[0])
        );
    }

    #[tokio::test]
    async fn the_queue_refuses_a_batch_past_its_commits_until_the_feed_is_done_with_some() {
        // Given a feed queue nobody takes from, filled with batches of the largest size
        // up to its bound in commits;
        let commit = |position| {
            let mut c = Commit::seal(
                AggregateId::cluster(Uuid::from_u128(1)),
                1,
                Hash::ZERO,
                CommitDraft::now("t", vec![]),
            );
            c.position = position;
            c
        };
        let batch = |n: usize| FeedBatch {
            after: 0,
            through: n as u64,
            commits: (1..=n as u64)
                .map(|p| FedCommit {
                    commit: Arc::new(commit(p)),
                    aggregate_prev: None,
                })
                .collect(),
        };
        let (sender, mut receiver) = queue();
        let full = crate::projector::BATCH_ENTRIES_MAX;
        let fitting = FEED_QUEUE_COMMITS / full;
        for _ in 0..fitting {
            assert!(sender.hand(batch(full)));
        }
        // when one more commit is handed, then it is refused: far fewer batches than
        // FEED_QUEUE_BATCHES are queued, but as many commits as the feed may hold;
        assert!(fitting < FEED_QUEUE_BATCHES);
        let over = FEED_QUEUE_COMMITS - fitting * full + 1;
        assert!(!sender.has_room(over) && sender.has_room(over - 1));
        assert!(!sender.hand(batch(over)));
        // and once the feed is done with one batch, then a batch of its size fits again.
        let taken = receiver.recv().await.expect("a batch");
        receiver.release(taken.commits.len());
        assert!(sender.has_room(full));
        assert!(sender.hand(batch(full)));
    }
}
