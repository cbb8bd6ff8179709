//! One queue per aggregate, per [`super::Writer`] (and its clones): the writers of one
//! process that target the same aggregate take turns instead of racing each other through
//! the log's expectation check, which under load makes all but one of them lose and
//! re-read. Each queue also holds what the writer knows of the aggregate between two
//! writes ([`super::known::Known`]), so the state a write decides on lives where it is
//! used, typed.
//!
//! Writers in other processes still race through the expectation, which stays the only
//! guard of correctness; the queue only removes the races a process would have with itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use provledger_events::{AggregateId, ChainTip};
use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

/// How many aggregates keep a queue and what it knows. Beyond it, the least recently used
/// idle queues are dropped (with what they knew), so memory stays bounded whatever the
/// number of aggregates written; a dropped state is rebuilt from the log on the next write.
pub const WRITE_QUEUES_MAX: usize = 4096;

/// The turn of one writer on one aggregate: what is kept for it, held exclusively until
/// dropped.
pub(crate) type Turn<T> = OwnedMutexGuard<T>;

/// One aggregate's queue: what is kept for it, when it was last handed out, and the
/// version a fold of the same log elsewhere in the process has reached
/// ([`Turns::folded`]), which a writer holding the turn reads without waiting.
struct Queue<T> {
    state: Arc<AsyncMutex<T>>,
    tick: u64,
    folded: Arc<AtomicU64>,
}

struct Queues<T> {
    by_aggregate: HashMap<AggregateId, Queue<T>>,
    /// A counter of turns handed out: the recency by which idle queues are dropped.
    tick: u64,
}

/// The per-aggregate queues of one writer, each holding a `T` (starting at its default).
pub(crate) struct Turns<T> {
    queues: Mutex<Queues<T>>,
}

impl<T: Default> Default for Turns<T> {
    fn default() -> Self {
        Turns {
            queues: Mutex::new(Queues {
                by_aggregate: HashMap::new(),
                tick: 0,
            }),
        }
    }
}

impl<T: Default> Turns<T> {
    /// Waits for this process's turn on `aggregate`, in arrival order (tokio's mutex is
    /// fair), and returns it with what is kept for the aggregate.
    /// With it, the version folded elsewhere (0 until told).
    pub(crate) async fn turn(&self, aggregate: AggregateId) -> (Turn<T>, Arc<AtomicU64>) {
        let (state, folded) = {
            let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
            queues.tick += 1;
            let tick = queues.tick;
            if !queues.by_aggregate.contains_key(&aggregate)
                && queues.by_aggregate.len() >= WRITE_QUEUES_MAX
            {
                evict_idle(&mut queues.by_aggregate);
            }
            let entry = queues
                .by_aggregate
                .entry(aggregate)
                .or_insert_with(|| Queue {
                    state: Arc::new(AsyncMutex::new(T::default())),
                    tick,
                    folded: Arc::default(),
                });
            entry.tick = tick;
            (entry.state.clone(), entry.folded.clone())
        };
        (state.lock_owned().await, folded)
    }
}

impl<T> Turns<T> {
    /// Records the versions a fold of the same log elsewhere in the process has reached,
    /// for the aggregates that have a queue (one that has none knows nothing to be stale).
    /// `kept` is told each tip of an aggregate that has one.
    pub(crate) fn folded(
        &self,
        tips: impl IntoIterator<Item = (AggregateId, ChainTip)>,
        mut kept: impl FnMut(AggregateId, ChainTip),
    ) {
        let queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        for (aggregate, tip) in tips {
            if let Some(queue) = queues.by_aggregate.get(&aggregate) {
                queue.folded.fetch_max(tip.version, Ordering::Relaxed);
                kept(aggregate, tip);
            }
        }
    }

    /// How many aggregates have a queue now (at most [`WRITE_QUEUES_MAX`] plus those in
    /// use when the bound was reached).
    pub(crate) fn len(&self) -> usize {
        self.queues
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_aggregate
            .len()
    }
}

/// Drops the older half of the queues nobody holds or waits for. A queue in use is never
/// dropped: two writers of one aggregate must always meet in the same queue.
fn evict_idle<T>(by_aggregate: &mut HashMap<AggregateId, Queue<T>>) {
    let mut idle: Vec<(u64, AggregateId)> = by_aggregate
        .iter()
        .filter(|(_, queue)| Arc::strong_count(&queue.state) == 1)
        .map(|(id, queue)| (queue.tick, *id))
        .collect();
    idle.sort_unstable();
    for (_, id) in idle.iter().take(idle.len().div_ceil(2)) {
        by_aggregate.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::AggregateKind;

    fn provider(n: u128) -> AggregateId {
        AggregateId::new(AggregateKind::Provider, uuid::Uuid::from_u128(n))
    }

    #[tokio::test]
    async fn writers_of_one_aggregate_share_one_state_and_take_turns() {
        // given one turn held, with something kept
        let turns = Turns::<u64>::default();
        let (mut first, _) = turns.turn(provider(1)).await;
        *first = 7;
        // when a second writer asks for the same aggregate
        let waiting = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            turns.turn(provider(1)),
        )
        .await;
        // then it waits until the first is done, and sees what the first kept
        assert!(
            waiting.is_err(),
            "a second turn was given while the first was held"
        );
        drop(first);
        let (second, _) = turns.turn(provider(1)).await;
        assert_eq!(*second, 7);
    }

    #[tokio::test]
    async fn idle_queues_are_dropped_beyond_the_bound_but_a_held_one_stays() {
        // given one turn held while twice the bound of other aggregates are written
        let turns = Turns::<u8>::default();
        let (mut held, _) = turns.turn(provider(0)).await;
        *held = 1;
        for n in 1..=(WRITE_QUEUES_MAX as u128 * 2) {
            drop(turns.turn(provider(n)).await);
        }
        // then the queues stay bounded, and the one in use kept its state
        assert!(turns.len() <= WRITE_QUEUES_MAX, "{} queues", turns.len());
        drop(held);
        let (again, _) = turns.turn(provider(0)).await;
        assert_eq!(*again, 1, "the queue in use was dropped with its state");
    }
}
