//! One write queue per aggregate, per log handle (and its clones): the writers of one
//! process that target the same aggregate take turns instead of racing each other through
//! the log's expectation check, which under load makes all but one of them lose and
//! re-read. Each queue also holds a slot where the writer above the log keeps what it knows
//! of the aggregate (its folded state, version and recent commits). The log does not know
//! what is in the slot: deciding is not its business (`provledger-client::write` is).
//!
//! Writers in other processes still race through the expectation, which stays the only
//! guard of correctness; the queue only removes the races a process would have with itself.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::ids::AggregateId;

/// How many aggregates keep a queue and a slot. Beyond it, the least recently used idle
/// queues are dropped (with what their slot knew), so memory stays bounded whatever the
/// number of aggregates written; a dropped slot is rebuilt from the log on the next write.
pub const WRITE_QUEUES_MAX: usize = 4096;

/// What a writer keeps for one aggregate between two writes; `None` until it is filled.
pub type WriteSlot = Option<Box<dyn Any + Send + Sync>>;

/// The turn of one writer on one aggregate: the slot, held exclusively until dropped.
pub type WriteTurn = OwnedMutexGuard<WriteSlot>;

#[derive(Default)]
struct Queues {
    by_aggregate: HashMap<AggregateId, (Arc<AsyncMutex<WriteSlot>>, u64)>,
    /// A counter of turns handed out: the recency by which idle queues are dropped.
    tick: u64,
}

/// The per-aggregate write queues of one log. Cheap to share (`Arc` inside the log).
#[derive(Default)]
pub struct WriteQueues {
    queues: Mutex<Queues>,
}

impl WriteQueues {
    /// Waits for this process's turn on `aggregate`, in arrival order (tokio's mutex is
    /// fair), and returns it with the aggregate's slot.
    pub async fn turn(&self, aggregate: AggregateId) -> WriteTurn {
        let queue = {
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
                .or_insert_with(|| (Arc::new(AsyncMutex::new(None)), tick));
            entry.1 = tick;
            entry.0.clone()
        };
        queue.lock_owned().await
    }

    /// How many aggregates have a queue now (at most [`WRITE_QUEUES_MAX`] plus those in
    /// use when the bound was reached).
    pub fn len(&self) -> usize {
        self.queues
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_aggregate
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Drops the older half of the queues nobody holds or waits for. A queue in use is never
/// dropped: two writers of one aggregate must always meet in the same queue.
fn evict_idle(by_aggregate: &mut HashMap<AggregateId, (Arc<AsyncMutex<WriteSlot>>, u64)>) {
    let mut idle: Vec<(u64, AggregateId)> = by_aggregate
        .iter()
        .filter(|(_, (queue, _))| Arc::strong_count(queue) == 1)
        .map(|(id, (_, tick))| (*tick, *id))
        .collect();
    idle.sort_unstable();
    for (_, id) in idle.iter().take(idle.len().div_ceil(2)) {
        by_aggregate.remove(id);
    }
}

impl std::fmt::Debug for WriteQueues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteQueues")
            .field("aggregates", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::AggregateKind;

    fn provider(n: u128) -> AggregateId {
        AggregateId::new(AggregateKind::Provider, uuid::Uuid::from_u128(n))
    }

    #[tokio::test]
    async fn writers_of_one_aggregate_share_one_slot_and_take_turns() {
        let queues = WriteQueues::default();
        let mut first = queues.turn(provider(1)).await;
        *first = Some(Box::new(7u64));
        let waiting = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            queues.turn(provider(1)),
        )
        .await;
        assert!(
            waiting.is_err(),
            "a second turn was given while the first was held"
        );
        drop(first);
        let second = queues.turn(provider(1)).await;
        let seen = second
            .as_ref()
            .and_then(|s| s.downcast_ref::<u64>())
            .copied();
        assert_eq!(seen, Some(7));
    }

    #[tokio::test]
    async fn idle_queues_are_dropped_beyond_the_bound_but_a_held_one_stays() {
        let queues = WriteQueues::default();
        let mut held = queues.turn(provider(0)).await;
        *held = Some(Box::new(1u8));
        for n in 1..=(WRITE_QUEUES_MAX as u128 * 2) {
            drop(queues.turn(provider(n)).await);
        }
        assert!(queues.len() <= WRITE_QUEUES_MAX, "{} queues", queues.len());
        drop(held);
        let again = queues.turn(provider(0)).await;
        assert!(
            again.is_some(),
            "the queue in use was dropped with its slot"
        );
    }
}
