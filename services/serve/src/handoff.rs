//! The queue the projector hands each written batch's commits over to a task that must
//! never slow it (the live feed, the copier of the stream): bounded in batches and in
//! commits, never waited for. A batch that does not fit is refused (`hand` is false) and
//! the task makes up for it its own way (followers catch up, the copier reads back).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;

/// A batch of commits, counted against the queue's bound in commits.
pub trait Batch {
    fn commits(&self) -> usize;
}

/// When a batch taken out of the queue stops counting against its bound in commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Release {
    /// As it is taken (the copier: what it gathers is bounded by its own batch size).
    OnTake,
    /// When the receiver says it is done with it ([`Receiver::release`]): the feed holds a
    /// batch until it is published.
    WhenDone,
}

/// The projector's end.
#[derive(Debug)]
pub struct Sender<T> {
    batches: mpsc::Sender<T>,
    held: Arc<AtomicUsize>,
    commits_max: usize,
}

// Not derived: a derive would ask `T: Clone`, which a sender does not need.
impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        Sender {
            batches: self.batches.clone(),
            held: Arc::clone(&self.held),
            commits_max: self.commits_max,
        }
    }
}

/// The task's end.
#[derive(Debug)]
pub struct Receiver<T> {
    batches: mpsc::Receiver<T>,
    held: Arc<AtomicUsize>,
    release: Release,
}

/// A queue of at most `batches_max` batches and `commits_max` commits held.
pub fn queue<T>(
    batches_max: usize,
    commits_max: usize,
    release: Release,
) -> (Sender<T>, Receiver<T>) {
    let (tx, rx) = mpsc::channel(batches_max);
    let held = Arc::new(AtomicUsize::new(0));
    (
        Sender {
            batches: tx,
            held: Arc::clone(&held),
            commits_max,
        },
        Receiver {
            batches: rx,
            held,
            release,
        },
    )
}

impl<T: Batch> Sender<T> {
    /// Whether a batch of `commits` would be taken now: a sender that must build the batch
    /// first (clone its commits) asks before it does. Only the receiver makes room
    /// meanwhile, so a `true` from the queue's one sender stays true until it hands.
    pub fn has_room(&self, commits: usize) -> bool {
        self.held.load(Ordering::Acquire) + commits <= self.commits_max
            && self.batches.capacity() > 0
    }

    /// Hands `batch` over if the queue has room (in batches and in commits); false when it
    /// was dropped. Never waits.
    pub fn hand(&self, batch: T) -> bool {
        let n = batch.commits();
        if self.held.fetch_add(n, Ordering::AcqRel) + n > self.commits_max {
            self.held.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        if self.batches.try_send(batch).is_err() {
            self.held.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        true
    }
}

impl<T: Batch> Receiver<T> {
    fn taken(&self, batch: Option<T>) -> Option<T> {
        if let (Some(b), Release::OnTake) = (&batch, self.release) {
            self.release(b.commits());
        }
        batch
    }

    pub async fn recv(&mut self) -> Option<T> {
        let batch = self.batches.recv().await;
        self.taken(batch)
    }

    /// A batch already in the queue, if any.
    pub fn try_recv(&mut self) -> Option<T> {
        let batch = self.batches.try_recv().ok();
        self.taken(batch)
    }

    /// [`Receiver::recv`] outside a runtime.
    pub fn blocking_recv(&mut self) -> Option<T> {
        let batch = self.batches.blocking_recv();
        self.taken(batch)
    }

    /// `commits` of batches taken no longer count against the bound ([`Release::WhenDone`]).
    pub fn release(&self, commits: usize) {
        self.held.fetch_sub(commits, Ordering::AcqRel);
    }
}
