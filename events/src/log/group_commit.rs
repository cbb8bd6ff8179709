//! Group commit of atomic sets: the atomic appends one log handle (and its clones) is asked
//! for at the same time are written together, as one write of the backend (one JetStream
//! atomic batch, one sled batch), and each set is answered on its own.
//!
//! Why: nats-server commits atomic batches one at a time per stream, at a fixed cost per
//! batch whatever its size (measured in `docs/benchmarks.md`), so one batch per request
//! pins facts on several aggregates at the floor of that curve. Sharing the batch spreads
//! the fixed cost over every request waiting for it.
//!
//! How: a request queues its set and, if fewer than [`GROUP_COMMITTERS_MAX`] committers
//! run, starts one. A committer takes the queue's sets in arrival order, up to
//! [`GROUP_MESSAGES_MAX`] commits, and writes them; while it waits on the backend, new
//! requests queue, and the next write takes them all. Under no load a request is written at
//! once, alone: it waits only for the write in flight. Under load (the last write held
//! several sets), the next write waits at most [`GROUP_LINGER`] for the writers just
//! answered to send their next sets, so that they share one batch; it opens with the first
//! of them and takes the others as they come, so that a backend can start writing before
//! the group is whole (JetStream opens the batch, which costs the server a staging store,
//! while the others are still on their way). Sets that share an aggregate or a commit id
//! are never in one write (the second waits for the next), so every set's expectations are
//! checked against the log as the sets before it left it, and a set is never split: each is
//! written whole or not at all.
//!
//! The backend answers each set: a set whose expectation fails is refused alone
//! ([`AppendError::Conflicts`]) and the others are written (`write_sets`).

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::{oneshot, Notify};

use super::{AppendError, AppendOutcome, AtomicItem, ATOMIC_COMMITS_MAX};

/// Most commits one group write holds: nats-server takes at most 1,000 messages in one
/// atomic batch.
pub const GROUP_MESSAGES_MAX: usize = 1000;
/// Group writes one log handle has in flight at once. nats-server commits one atomic batch
/// at a time per stream, so a second write in flight only halves each group: measured with
/// `write-bench` on 2.14.6, pairs at 16 / 64 / 256 clients did 7,531 / 16,867 / 22,183
/// commits/s with one, 4,969 / 13,579 / 17,639 with two and 4,089 / 9,157 / 16,613 with
/// four.
pub const GROUP_COMMITTERS_MAX: usize = 1;
/// The longest a write waits, after a write of several sets, for the writers it just
/// answered to send their next sets (they are the load: under it, a write that left at
/// once would take only the few sets that arrived during the last one, and the writers
/// would settle into halves taking turns, each paying the server's fixed cost per batch).
/// A write after a write of one set, or one started on an empty queue, never waits.
pub const GROUP_LINGER: Duration = Duration::from_millis(2);
const _: () = assert!(ATOMIC_COMMITS_MAX <= GROUP_MESSAGES_MAX);
const _: () = assert!(GROUP_COMMITTERS_MAX >= 1);

/// What one atomic set came to.
pub type SetAnswer = Result<Vec<AppendOutcome>, AppendError>;

/// A backend that writes several atomic sets in one write, answering each on its own: one
/// answer per set, in the order given.
pub(crate) trait SetWriter: Clone + Send + Sync + 'static {
    fn write_sets(&self, sets: Vec<Vec<AtomicItem>>)
        -> impl Future<Output = Vec<SetAnswer>> + Send;

    /// Writes `head` and the sets `more` yields as one write: one answer per set, `head`'s
    /// then `more`'s, in order. `more` yields only sets that share no aggregate or commit id
    /// with `head`. A backend that can start the write before it knows the whole group
    /// (JetStream: the batch is opened with `head` while `more` lingers) overrides this;
    /// the others wait for `more`.
    fn write_sets_streamed<'a>(
        &'a self,
        head: Vec<Vec<AtomicItem>>,
        more: impl Future<Output = Vec<Vec<AtomicItem>>> + Send + 'a,
    ) -> impl Future<Output = Vec<SetAnswer>> + Send + 'a {
        write_whole(self, head, more)
    }

    /// The queue this handle (and its clones) groups its sets in.
    fn group_commit(&self) -> &GroupCommit;
}

/// Writes `head` and the sets `more` yields once the group is whole: the write of a backend
/// that cannot start before.
pub(crate) async fn write_whole<W: SetWriter>(
    writer: &W,
    head: Vec<Vec<AtomicItem>>,
    more: impl Future<Output = Vec<Vec<AtomicItem>>> + Send,
) -> Vec<SetAnswer> {
    let mut sets = head;
    sets.extend(more.await);
    writer.write_sets(sets).await
}

struct Pending {
    items: Vec<AtomicItem>,
    answer: oneshot::Sender<SetAnswer>,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Pending>,
    committers: usize,
}

/// The sets waiting to be written and the committers writing them, per log handle.
#[derive(Default)]
pub struct GroupCommit {
    queue: Mutex<Queue>,
    /// Told of each set queued: what a lingering committer waits on.
    arrived: Notify,
    writes: AtomicU64,
    sets: AtomicU64,
    opened_early: AtomicU64,
    sent_again: AtomicU64,
}

impl std::fmt::Debug for GroupCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let q = self.lock();
        f.debug_struct("GroupCommit")
            .field("pending", &q.pending.len())
            .field("committers", &q.committers)
            .finish()
    }
}

impl GroupCommit {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets waiting for a write now (for tests and metrics).
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }

    /// Sets and commits waiting for a write now.
    fn queued(&self) -> (usize, usize) {
        let q = self.lock();
        let commits = q.pending.iter().map(|p| p.items.len()).sum();
        (q.pending.len(), commits)
    }

    /// How many group writes this handle made, and how many sets they held.
    pub fn written(&self) -> GroupStats {
        GroupStats {
            writes: self.writes.load(Ordering::Relaxed),
            sets: self.sets.load(Ordering::Relaxed),
            opened_early: self.opened_early.load(Ordering::Relaxed),
            sent_again: self.sent_again.load(Ordering::Relaxed),
        }
    }

    /// Counts a write the backend opened before its group was whole.
    pub(crate) fn count_opened_early(&self) {
        self.opened_early.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a write opened early that the backend had to send again from the start
    /// (JetStream: a batch the server did not know at its commit).
    pub(crate) fn count_sent_again(&self) {
        self.sent_again.fetch_add(1, Ordering::Relaxed);
    }
}

/// Group writes made and the sets they held: sets / writes is the grouping achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupStats {
    pub writes: u64,
    pub sets: u64,
    /// Writes under load that the backend opened with the first sets while the others
    /// were awaited (JetStream on nats-server 2.14+: the batch opened before its last sets
    /// were known; the other backends write a group once it is whole, and count none).
    pub opened_early: u64,
    /// Writes opened early that had to be sent again from the start (JetStream: a batch
    /// the server did not know at its commit, its opening turned away; nothing was stored).
    pub sent_again: u64,
}

/// Queues `items` (validated by the caller) for the next group write of `writer` and waits
/// for its answer.
pub(crate) async fn submit<W: SetWriter>(writer: &W, items: Vec<AtomicItem>) -> SetAnswer {
    // An empty set would be answered with nothing; one past the bound would split a set
    // across batches. Callers validate both.
    assert!(
        !items.is_empty() && items.len() <= ATOMIC_COMMITS_MAX,
        "a set of {} commits submitted (1 to {ATOMIC_COMMITS_MAX})",
        items.len()
    );
    let (answer, answered) = oneshot::channel();
    let start_committer = {
        let mut q = writer.group_commit().lock();
        q.pending.push_back(Pending { items, answer });
        let start = q.committers < GROUP_COMMITTERS_MAX;
        if start {
            q.committers += 1;
        }
        start
    };
    writer.group_commit().arrived.notify_one();
    if start_committer {
        // Counted before the task exists: the guard moves into it, so a task that never
        // runs (dropped with its runtime, or a spawn that panics) still counts itself out.
        let mut running = Running {
            writer: writer.clone(),
            counted: true,
        };
        // A task of its own: a caller that stops waiting (a dropped request) never strands
        // the sets queued behind its own.
        tokio::spawn(async move {
            commit_until_empty(&mut running).await;
        });
    }
    answered.await.unwrap_or_else(|_| {
        Err(AppendError::Unavailable {
            reason: "the group write holding this atomic set ended without an answer; retry with \
                     the same commit ids"
                .into(),
        })
    })
}

/// A committer, counted in its queue's `committers` until it finds the queue empty (counted
/// out under the same lock, so a set queued just after is never left without a committer),
/// or until its task ends otherwise (a panic, or dropped with its runtime).
struct Running<W: SetWriter> {
    writer: W,
    counted: bool,
}

impl<W: SetWriter> Drop for Running<W> {
    fn drop(&mut self) {
        if !self.counted {
            return;
        }
        let mut q = self.writer.group_commit().lock();
        q.committers -= 1;
        // A committer that ended early leaves sets behind: with no other committer to take
        // them, they are answered unavailable rather than left waiting forever.
        if q.committers == 0 {
            for p in q.pending.drain(..) {
                let _ = p.answer.send(Err(AppendError::Unavailable {
                    reason: "the group commit stopped; retry with the same commit ids".into(),
                }));
            }
        }
    }
}

async fn commit_until_empty<W: SetWriter>(running: &mut Running<W>) {
    let writer = running.writer.clone();
    let groups = writer.group_commit();
    let mut answered: usize = 0;
    loop {
        // Under load (the last write held several sets), the writers just answered are
        // the load: the write opens with the first of their next sets and takes the others
        // as they come, until GROUP_LINGER after the answers.
        let lingering = (answered > 1).then(|| tokio::time::Instant::now() + GROUP_LINGER);
        if let Some(deadline) = lingering {
            wait_for_first(groups, deadline).await;
        }
        let mut taken = Taken::default();
        let (group, left) = {
            let mut q = groups.lock();
            let group = take_group(&mut q.pending, &mut taken);
            if group.is_empty() {
                q.committers -= 1;
                running.counted = false;
                return;
            }
            // What stays queued (sets sharing an aggregate with the group) is not what the
            // linger below waits for.
            (group, q.pending.len())
        };
        let (sets, mut answers) = split(group);
        let results = match lingering {
            None => writer.write_sets(sets).await,
            Some(deadline) => {
                let others = answered.saturating_sub(sets.len());
                let mut later = Vec::new();
                let more = async {
                    linger(groups, left + others, taken.commits, deadline).await;
                    let (rest, rest_answers) =
                        split(take_group(&mut groups.lock().pending, &mut taken));
                    later = rest_answers;
                    rest
                };
                let results = writer.write_sets_streamed(sets, more).await;
                answers.append(&mut later);
                results
            }
        };
        let count = answers.len();
        tracing::trace!(sets = count, "group write");
        groups.writes.fetch_add(1, Ordering::Relaxed);
        groups.sets.fetch_add(count as u64, Ordering::Relaxed);
        assert_eq!(
            results.len(),
            count,
            "a backend answered {} of {count} atomic sets",
            results.len()
        );
        for (answer, result) in answers.into_iter().zip(results) {
            // A caller that stopped waiting is told nothing; its set is in the log or not,
            // whole, and a retry with the same commit ids finds out which.
            let _ = answer.send(result);
        }
        answered = count;
    }
}

/// A group's sets, and the senders their answers go to, in the same order.
fn split(group: Vec<Pending>) -> (Vec<Vec<AtomicItem>>, Vec<oneshot::Sender<SetAnswer>>) {
    group.into_iter().map(|p| (p.items, p.answer)).unzip()
}

/// Waits until a set is queued, or `deadline`.
async fn wait_for_first(groups: &GroupCommit, deadline: tokio::time::Instant) {
    // A set queued since the last look left a permit: nothing is missed.
    while groups.pending() == 0 {
        if tokio::time::timeout_at(deadline, groups.arrived.notified())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// Waits, until `deadline` at the latest, for `want` sets queued (those left behind by the
/// write's first take, and one for each other writer the last write answered), or for a
/// group's worth of commits with the `taken` ones already in the write.
async fn linger(groups: &GroupCommit, want: usize, taken: usize, deadline: tokio::time::Instant) {
    let mut seen = groups.queued();
    while seen.0 < want && taken + seen.1 < GROUP_MESSAGES_MAX {
        // A set queued since the last look left a permit: nothing is missed.
        if tokio::time::timeout_at(deadline, groups.arrived.notified())
            .await
            .is_err()
        {
            return;
        }
        seen = groups.queued();
    }
}

/// What the sets taken into one write hold: a set sharing one of its aggregates or commit
/// ids waits for the next write, and the commits count towards the write's bound.
#[derive(Default)]
struct Taken {
    aggregates: HashSet<crate::ids::AggregateId>,
    ids: HashSet<uuid::Uuid>,
    commits: usize,
}

/// The next group: queued sets in arrival order, up to [`GROUP_MESSAGES_MAX`] commits, none
/// sharing an aggregate or a commit id with one taken before it (those wait for the next
/// group). A set whose caller stopped waiting is dropped unwritten: nobody would learn its
/// outcome, and its retry (same ids) must not find it half-way through a write.
fn take_group(pending: &mut VecDeque<Pending>, taken: &mut Taken) -> Vec<Pending> {
    let mut group = Vec::new();
    let mut kept = VecDeque::new();
    while let Some(p) = pending.pop_front() {
        if p.answer.is_closed() {
            continue;
        }
        if taken.commits + p.items.len() > GROUP_MESSAGES_MAX {
            kept.push_back(p);
            break;
        }
        let clashes = p.items.iter().any(|i| {
            taken.aggregates.contains(&i.aggregate) || taken.ids.contains(&i.draft.commit_id)
        });
        if clashes {
            kept.push_back(p);
            continue;
        }
        for i in &p.items {
            taken.aggregates.insert(i.aggregate);
            taken.ids.insert(i.draft.commit_id);
        }
        taken.commits += p.items.len();
        group.push(p);
    }
    kept.append(pending);
    *pending = kept;
    group
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commit::CommitDraft;
    use crate::ids::{AggregateId, AggregateKind};
    use crate::log::Expectation;

    fn set(aggregates: &[u128]) -> Vec<AtomicItem> {
        aggregates
            .iter()
            .map(|&n| AtomicItem {
                aggregate: AggregateId::new(AggregateKind::Provider, uuid::Uuid::from_u128(n)),
                expect: Expectation::Any,
                draft: CommitDraft::now("t", vec![]),
            })
            .collect()
    }

    /// A queued set, with the receiver its caller waits on (kept by the test: a set whose
    /// caller stopped waiting is dropped).
    fn pending(items: Vec<AtomicItem>) -> (Pending, oneshot::Receiver<SetAnswer>) {
        let (answer, waiting) = oneshot::channel();
        (Pending { items, answer }, waiting)
    }

    fn queue(sets: Vec<Vec<AtomicItem>>) -> (VecDeque<Pending>, Vec<oneshot::Receiver<SetAnswer>>) {
        sets.into_iter().map(pending).unzip()
    }

    #[test]
    fn a_group_never_holds_one_aggregate_twice_and_keeps_the_order_of_what_waits() {
        // given sets on {1,2}, {2,3}, {4}, {3}
        let (mut queue, _waiting) = queue(vec![set(&[1, 2]), set(&[2, 3]), set(&[4]), set(&[3])]);
        // when a group is taken
        let group = take_group(&mut queue, &mut Taken::default());
        // then {2,3} waits (it shares 2), {4} and {3} ride along, and {2,3} is next
        let sizes: Vec<usize> = group.iter().map(|p| p.items.len()).collect();
        assert_eq!(sizes, vec![2, 1, 1]);
        assert_eq!(queue.len(), 1);
        assert_eq!(queue[0].items.len(), 2);
    }

    #[test]
    fn a_group_holds_at_most_the_servers_batch_bound() {
        // given 11 sets of 100 commits on distinct aggregates
        let (mut queue, _waiting) = queue(
            (0..11u128)
                .map(|s| set(&(s * 100..s * 100 + 100).collect::<Vec<_>>()))
                .collect(),
        );
        // when a group is taken, then it stops at 1,000 commits and the 11th waits
        let group = take_group(&mut queue, &mut Taken::default());
        assert_eq!(group.iter().map(|p| p.items.len()).sum::<usize>(), 1000);
        assert_eq!(queue.len(), 1);
    }

    #[test]
    fn a_set_whose_caller_stopped_waiting_is_dropped_unwritten() {
        // given two sets, the first one's caller gone
        let (mut queue, mut waiting) = queue(vec![set(&[1]), set(&[2])]);
        drop(waiting.remove(0));
        // when a group is taken, then only the second is in it
        let group = take_group(&mut queue, &mut Taken::default());
        assert_eq!(group.len(), 1);
        assert_eq!(group[0].items[0].aggregate, set(&[2])[0].aggregate);
        assert!(queue.is_empty());
    }
}
