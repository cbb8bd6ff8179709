//! The projector: consumes the log from the store's checkpoint, folds each
//! commit into its entity, and writes the entities, the indexes, the new checkpoint and,
//! for a store that copies the log (not serve's: it reads history back from the stream),
//! the sled copy of the commit in one atomic batch. After a crash at any point the
//! store holds exactly the batches that were written, so a restart resumes at the
//! checkpoint with nothing lost and nothing folded twice.
//!
//! serve's own copy of the stream is not written here: each written batch's commits are
//! handed to its copier (`crate::log_copy`, `Projector::with_copy`), never waited for.
//!
//! An entry that cannot be decoded is quarantined with its position and error, and the
//! projector goes on.

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use provledger_client::write::FoldedVersions;
use provledger_events::codec;
use provledger_events::{
    AggregateId, AggregateKind, Commit, Event, EventLog, HeldChains, IntegrityError, Passage,
    ReadError,
};
use provledger_projections::Entity;
use tokio::sync::watch;
use uuid::Uuid;

use crate::bootstrap::PublishedSnapshot;
use crate::metrics::FoldMetrics;
use crate::store::{
    encode_entity, OperationIndexEntry, ProjectionStore, QuarantineRecord, StoreBatch, StoreError,
};

/// Log entries folded per batch at most: bounds the memory of one batch and the work
/// lost to a crash, while amortising the sled write across many commits.
pub const BATCH_ENTRIES_MAX: usize = 4096;
/// How long the live projector, once it sees a backlog, keeps gathering entries before it
/// writes them as one batch. sled's cost per commit falls steeply with the batch (one write
/// of each entity touched, fewer page rewrites): at 64 writers, batches of about 30 cost
/// 43 µs per commit, batches of about 800 cost 28 µs. The price is that a query waiting for
/// `min_position` under load may wait this much longer.
pub const GROUP_COMMIT_LINGER: Duration = Duration::from_millis(20);
/// Entities kept in memory between batches; past it the cache is emptied and entities are
/// loaded from sled again as they are touched.
pub const CACHE_ENTITIES_MAX: usize = 200_000;
/// A snapshot of every entity is taken each time the checkpoint crosses a multiple of
/// this many positions (0 turns snapshots off).
pub const SNAPSHOT_EVERY_POSITIONS_DEFAULT: u64 = 100_000;
/// How many multiples of the snapshot interval a snapshot may wait for the projector to
/// catch up (see `Projector::maybe_snapshot`).
const SNAPSHOT_DEFERRED_MAX: u64 = 10;
/// Bytes of an undecodable payload kept in its quarantine record.
const QUARANTINE_HEAD_BYTES_MAX: usize = 4096;
/// Back-off between attempts to resubscribe after the log became unavailable.
const RESUBSCRIBE_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Aggregates other than providers that [`Touched`] remembers between two reads by the
/// rollback worker; past it, what did not fit is only marked as a range to read back from
/// the copy.
pub const TOUCHED_MAX: usize = 65_536;

/// The operations, clusters and instances the projector applied commits to since the
/// rollback worker last looked: it learns what changed from here instead of reading every
/// commit of the copy back (under a load of provider claims, nearly all of them are of no
/// interest to it).
#[derive(Debug, Default)]
pub struct Touched {
    inner: std::sync::Mutex<TouchedInner>,
}

#[derive(Debug, Default)]
struct TouchedInner {
    aggregates: HashSet<AggregateId>,
    /// The copy up to this position may hold aggregates that did not fit: read it back.
    incomplete_through: u64,
}

impl Touched {
    /// Records the aggregates of a batch that ends at `checkpoint`, before the batch is
    /// announced as applied.
    fn record(&self, aggregates: impl Iterator<Item = AggregateId>, checkpoint: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        for aggregate in aggregates.filter(|a| a.kind != AggregateKind::Provider) {
            if inner.aggregates.len() >= TOUCHED_MAX {
                inner.incomplete_through = checkpoint;
                return;
            }
            inner.aggregates.insert(aggregate);
        }
    }

    /// What was recorded since the last call, and the position through which the copy
    /// must be read back for what did not fit (0: nothing).
    pub fn take(&self) -> (HashSet<AggregateId>, u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let taken = std::mem::take(&mut *inner);
        (taken.aggregates, taken.incomplete_through)
    }
}

/// Why the projector stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProjectorError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
}

/// What a commit that does not extend its aggregate's chain means to this projector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnChainViolation {
    /// A JetStream stream: anyone allowed to publish on an aggregate's subject can put a
    /// replayed, forged or foreign commit there. It is quarantined and never folded; the
    /// aggregate's chain goes on from its last valid commit.
    Quarantine,
    /// The embedded log: only provledger writes it, so a broken chain is damage or
    /// tampering. The projector stops with an integrity error rather than fold it.
    Fail,
}

/// What a commit read in log order does (`Projector::past_loss`).
enum PastLoss {
    Fold(Vec<Commit>),
    /// Held past a loss (the held chain keeps its own copy): the commit, for the feed.
    Held(Box<Commit>),
    Violation(Box<Commit>, String),
}

/// What one batch has gathered so far (`Projector::apply_batch`): what it did, what it
/// writes, and where it ends.
struct Gathered {
    outcome: BatchOutcome,
    batch: StoreBatch,
    /// The aggregates folded, whose entities the batch writes.
    dirty: HashSet<AggregateId>,
    /// The position through which the batch has taken every entry.
    checkpoint: u64,
    watermark: Option<i64>,
    /// Whether a re-issue to send was folded (see `Projector::reissues`).
    reissue_news: bool,
    /// The commits for the feed (`Projector::with_feed`): every commit this batch took
    /// (folded, or held past a loss), in position order; never what it quarantined. Each
    /// with its aggregate's commit before it (`crate::feed::FedCommit`).
    feed: Vec<crate::feed::FedCommit>,
}

/// What one batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchOutcome {
    pub folded: usize,
    pub events: usize,
    pub quarantined: usize,
    pub skipped: usize,
    /// Commits held past a loss in their aggregate's chain, not folded (yet).
    pub held: usize,
}

pub struct Projector {
    store: ProjectionStore,
    cache: HashMap<AggregateId, Entity>,
    checkpoint: u64,
    watermark: Option<i64>,
    snapshot_every: u64,
    /// The checkpoint at which a snapshot fell due while the projector was behind (its
    /// batches full, or short of `catching_up_to`): taken at the first batch that is not,
    /// so that a replica catching up copies its entities once at the end rather than at
    /// every multiple on the way.
    snapshot_due_since: Option<u64>,
    /// The stream's end when the replica started: until the checkpoint reaches it, the
    /// projector is catching up whatever its batches' sizes (a consumer that delivers no
    /// faster than the fold leaves them short, and each multiple then took its snapshot:
    /// nine of them, 3.9 s of a 17-s catch-up of 1,000,000 commits).
    catching_up_to: u64,
    applied: watch::Sender<u64>,
    touched: std::sync::Arc<Touched>,
    /// Woken once a batch applied a re-issue that is (again) due to be sent
    /// (`reissue_requested`, `reissue_failed`), whoever wrote it: serve's delivery does
    /// not wait for its own sweep to learn of a re-issue `recover` or another replica
    /// recorded.
    reissues: std::sync::Arc<tokio::sync::Notify>,
    on_violation: OnChainViolation,
    metrics: FoldMetrics,
    /// Where each snapshot taken is also handed for publishing (`--snapshot-bucket`),
    /// with the stream's name.
    publisher: Option<(tokio::sync::mpsc::Sender<PublishedSnapshot>, String)>,
    /// Where each applied batch's commits are handed for the live feed (`crate::feed`).
    feed: Option<crate::feed::FeedSender>,
    /// Whether the store keeps a copy of each commit (`ProjectionStore::copies_log`).
    copies_log: bool,
    /// Where each applied batch's commits are handed for serve's copy of the stream
    /// (`crate::log_copy`), never waited for.
    copy: Option<crate::log_copy::CopySender>,
    /// Serve's write path, told how far each batch took its aggregates.
    folded_versions: Option<FoldedVersions>,
    /// Aggregates read past a loss, whose commits are held, not folded, until it is
    /// acknowledged (`provledger_events::loss`): few, all kept.
    held: HeldChains,
}

impl Projector {
    pub fn new(store: ProjectionStore, snapshot_every: u64) -> Result<Self, StoreError> {
        let checkpoint = store.checkpoint()?;
        let watermark = store.watermark()?;
        let copies_log = store.copies_log()?;
        let held = HeldChains::new(store.held_chains()?);
        let (applied, _) = watch::channel(checkpoint);
        // A snapshot deferred before a restart is still due.
        let newest = store.snapshots()?.last().copied().unwrap_or(0);
        let snapshot_due_since = (snapshot_every > 0
            && checkpoint / snapshot_every > newest / snapshot_every)
            .then_some(checkpoint);
        Ok(Projector {
            store,
            cache: HashMap::new(),
            checkpoint,
            watermark,
            snapshot_every,
            snapshot_due_since,
            catching_up_to: 0,
            applied,
            touched: std::sync::Arc::default(),
            reissues: std::sync::Arc::default(),
            on_violation: OnChainViolation::Fail,
            metrics: FoldMetrics::default(),
            publisher: None,
            feed: None,
            copies_log,
            copy: None,
            folded_versions: None,
            held,
        })
    }

    /// Also hands each snapshot it takes, as the whole state of `stream`, to `publisher`
    /// (which publishes it for new replicas). A snapshot the publisher has no room for is
    /// not even prepared: the next one will be.
    pub fn with_publisher(
        mut self,
        publisher: tokio::sync::mpsc::Sender<PublishedSnapshot>,
        stream: &str,
    ) -> Self {
        self.publisher = Some((publisher, stream.to_string()));
        self
    }

    /// Also hands the commits of each batch it applies, once written, to `feed` (serve's
    /// live feed, `crate::feed`). A batch the feed has no room for is dropped, never
    /// waited for: the projector is not slowed by the feed, and its followers see the gap
    /// (each change's `prev`) and fill it through `q.changes`.
    pub fn with_feed(mut self, feed: crate::feed::FeedSender) -> Self {
        self.feed = Some(feed);
        self
    }

    /// Also hands the commits of each batch it applies, once written, to serve's copier
    /// (`crate::log_copy`). A batch the copier has no room for is dropped, never waited
    /// for: the copier reads it back from the stream.
    pub fn with_copy(mut self, copy: crate::log_copy::CopySender) -> Self {
        self.copy = Some(copy);
        self
    }

    /// Also tells `writer`, once each batch is written, the version each aggregate of the
    /// batch reached, so that serve's write path reads before deciding on a state another
    /// process moved past (`provledger_client::write::FoldedVersions`).
    pub fn with_folded_versions(mut self, writer: FoldedVersions) -> Self {
        self.folded_versions = Some(writer);
        self
    }

    /// Sets what a commit breaking its aggregate's chain does (default: fail).
    pub fn on_chain_violation(mut self, policy: OnChainViolation) -> Self {
        self.on_violation = policy;
        self
    }

    /// Counts itself behind until its checkpoint reaches `end` (the stream's end when the
    /// replica started), for its snapshots (see `maybe_snapshot`).
    pub fn catching_up_to(mut self, end: u64) -> Self {
        self.catching_up_to = end;
        self
    }

    /// Counts what it folds and quarantines into `metrics` (serve's `/metrics`).
    pub fn with_metrics(mut self, metrics: FoldMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Whether each batch's commits are gathered to be handed on (feed or copy).
    fn hands_commits(&self) -> bool {
        self.feed.is_some() || self.copy.is_some()
    }

    pub fn store(&self) -> &ProjectionStore {
        &self.store
    }

    pub fn checkpoint(&self) -> u64 {
        self.checkpoint
    }

    /// Where the rollback worker learns which aggregates changed.
    pub fn touched(&self) -> std::sync::Arc<Touched> {
        std::sync::Arc::clone(&self.touched)
    }

    /// Notified when a batch applied a re-issue to send (see the field).
    pub fn reissues(&self) -> std::sync::Arc<tokio::sync::Notify> {
        std::sync::Arc::clone(&self.reissues)
    }

    /// The last position applied, for read-your-writes waits and replies.
    pub fn applied(&self) -> watch::Receiver<u64> {
        self.applied.subscribe()
    }

    fn load(&mut self, id: AggregateId) -> Result<&mut Entity, StoreError> {
        if !self.cache.contains_key(&id) {
            let entity = self.store.entity(&id)?.unwrap_or_else(|| Entity::new(id));
            self.cache.insert(id, entity);
        }
        // Inserted just above when missing.
        Ok(self.cache.get_mut(&id).expect("entity cached"))
    }

    /// [`Projector::apply_batch`], telling a multi-threaded runtime that this thread blocks
    /// on sled for a while (folding, the batch write, a snapshot), so its other tasks
    /// (queries, the rollback worker) move to another worker meanwhile.
    fn apply_batch_off_the_reactor(
        &mut self,
        entries: Vec<Result<Commit, ReadError>>,
    ) -> Result<BatchOutcome, ProjectorError> {
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| self.apply_batch(entries))
            }
            _ => self.apply_batch(entries),
        }
    }

    /// Folds one batch of log entries and writes it atomically. Entries at or below the
    /// checkpoint are skipped (a resubscription may deliver them again).
    pub fn apply_batch(
        &mut self,
        entries: Vec<Result<Commit, ReadError>>,
    ) -> Result<BatchOutcome, ProjectorError> {
        let behind = entries.len() >= BATCH_ENTRIES_MAX;
        let mut gathered = Gathered {
            outcome: BatchOutcome::default(),
            batch: StoreBatch::default(),
            dirty: HashSet::new(),
            checkpoint: self.checkpoint,
            watermark: self.watermark,
            reissue_news: false,
            feed: Vec::new(),
        };
        let mut failure = None;
        for entry in entries {
            let next = match entry {
                Ok(commit) => self.gather_commit(commit, &mut gathered)?,
                Err(e) => self.gather_unreadable(e, &mut gathered),
            };
            if let ControlFlow::Break(e) = next {
                failure = Some(e);
                break;
            }
        }
        let outcome = gathered.outcome;
        if gathered.checkpoint > self.checkpoint {
            self.write_gathered(gathered, behind)?;
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }

    /// Gathers one commit read from the log: skipped at or below the checkpoint, held past
    /// a loss, taken as a chain violation, or folded with the commits it resumes. Breaks
    /// with a failure that stops the batch after the entries before it.
    fn gather_commit(
        &mut self,
        commit: Commit,
        gathered: &mut Gathered,
    ) -> Result<ControlFlow<ProjectorError>, ProjectorError> {
        if commit.position <= gathered.checkpoint {
            gathered.outcome.skipped += 1;
            return Ok(ControlFlow::Continue(()));
        }
        let at = commit.position;
        let to_fold = match self.past_loss(commit, &mut gathered.batch)? {
            PastLoss::Fold(commits) => commits,
            PastLoss::Held(commit) => {
                if self.hands_commits() {
                    // Its aggregate's commits before it are not all folded (a loss lies
                    // between): the feed says nothing narrower than the whole log's `prev`.
                    gathered.feed.push(crate::feed::FedCommit {
                        commit: Arc::new(*commit),
                        aggregate_prev: None,
                    });
                }
                gathered.outcome.held += 1;
                gathered.checkpoint = at;
                return Ok(ControlFlow::Continue(()));
            }
            PastLoss::Violation(commit, violation) => {
                return Ok(self.chain_violation(&commit, violation, at, gathered));
            }
        };
        self.fold_in_order(to_fold, at, gathered)?;
        gathered.checkpoint = at;
        Ok(ControlFlow::Continue(()))
    }

    /// A commit at position `at` outside its aggregate's chain, as the policy says: the
    /// integrity failure that stops the batch, or a quarantine record.
    fn chain_violation(
        &self,
        commit: &Commit,
        violation: String,
        at: u64,
        gathered: &mut Gathered,
    ) -> ControlFlow<ProjectorError> {
        match self.on_violation {
            OnChainViolation::Fail => {
                ControlFlow::Break(ProjectorError::Integrity(IntegrityError {
                    aggregate: commit.aggregate,
                    version: commit.version,
                    position: commit.position,
                    problem: violation,
                }))
            }
            OnChainViolation::Quarantine => {
                tracing::warn!(position = at, %violation, "commit outside its aggregate's chain quarantined");
                gathered.batch.quarantine.push(QuarantineRecord {
                    position: at,
                    subject: commit.aggregate.to_string(),
                    error: violation,
                    payload_len: 0,
                    payload_head_hex: String::new(),
                });
                gathered.outcome.quarantined += 1;
                self.metrics.quarantined(true);
                gathered.checkpoint = at;
                ControlFlow::Continue(())
            }
        }
    }

    /// Folds the commits a commit at position `at` lets through (itself, or every commit
    /// held past a loss it acknowledged), in their order in the log, recording each rise
    /// of the watermark at `at`. The commit at `at` then goes to the feed, if there is one
    /// (moved, not copied); those held before it went there when they were held.
    fn fold_in_order(
        &mut self,
        commits: Vec<Commit>,
        at: u64,
        gathered: &mut Gathered,
    ) -> Result<(), StoreError> {
        let mut previous = 0;
        for commit in commits {
            // Commits held past a loss come back in their order in the log
            // (the last is this one, past the checkpoint).
            assert!(
                commit.position > previous,
                "{} v{} at position {} folded after position {previous}",
                commit.aggregate,
                commit.version,
                commit.position
            );
            previous = commit.position;
            let aggregate_prev = self.fold(&commit, &mut gathered.batch, &mut gathered.dirty)?;
            self.metrics.folded(&commit.events);
            gathered.reissue_news |= commit.events.iter().any(|e| {
                matches!(
                    e,
                    Event::ReissueRequested { .. } | Event::ReissueFailed { .. }
                )
            });
            if gathered
                .watermark
                .is_none_or(|w| commit.recorded_at.unix_ms() > w)
            {
                gathered.watermark = Some(commit.recorded_at.unix_ms());
                // Every rise, not one per batch: `--at TIME` must resolve to the
                // same position on replicas that batch differently. (Commits
                // held past a loss are folded at the position that resumed
                // them.)
                gathered
                    .batch
                    .watermark_rises
                    .push((commit.recorded_at.unix_ms(), at));
            }
            gathered.outcome.folded += 1;
            gathered.outcome.events += commit.events.len();
            if commit.position == at && self.hands_commits() {
                gathered.feed.push(crate::feed::FedCommit {
                    commit: Arc::new(commit),
                    aggregate_prev: Some(aggregate_prev),
                });
            }
        }
        Ok(())
    }

    /// Gathers a log entry that could not be read: quarantined with its position and error
    /// (skipped at or below the checkpoint). Breaks with a read failure that is not the
    /// entry's own, which stops the batch after the entries before it.
    fn gather_unreadable(
        &self,
        e: ReadError,
        gathered: &mut Gathered,
    ) -> ControlFlow<ProjectorError> {
        match e.quarantine_parts() {
            None => ControlFlow::Break(e.into()),
            Some((position, ..)) if position <= gathered.checkpoint => {
                gathered.outcome.skipped += 1;
                ControlFlow::Continue(())
            }
            Some((position, subject, error, payload)) => {
                tracing::warn!(position, %subject, %error, "log entry quarantined");
                let head = &payload[..payload.len().min(QUARANTINE_HEAD_BYTES_MAX)];
                gathered.batch.quarantine.push(QuarantineRecord {
                    position,
                    subject: subject.to_string(),
                    error,
                    payload_len: payload.len(),
                    payload_head_hex: head.iter().map(|b| format!("{b:02x}")).collect(),
                });
                gathered.outcome.quarantined += 1;
                self.metrics.quarantined(false);
                gathered.checkpoint = position;
                ControlFlow::Continue(())
            }
        }
    }

    /// Writes what a batch gathered as one atomic store batch (with the entities it
    /// touched), then moves the checkpoint, announces it, and takes a snapshot if one is
    /// due. `behind`: the batch was full.
    fn write_gathered(&mut self, gathered: Gathered, behind: bool) -> Result<(), StoreError> {
        let Gathered {
            mut batch,
            dirty,
            checkpoint,
            watermark,
            reissue_news,
            feed,
            ..
        } = gathered;
        for id in &dirty {
            if let Some(entity) = self.cache.get(id) {
                batch.entities.push((*id, encode_entity(entity)?));
                batch.operations.extend(OperationIndexEntry::of(entity));
            }
        }
        batch.checkpoint = checkpoint;
        let previous = self.checkpoint;
        self.store.write_batch(batch)?;
        if let Some(writer) = &self.folded_versions {
            writer.folded(dirty.iter().filter_map(|id| {
                self.cache
                    .get(id)
                    .map(|entity| (*id, entity.header().tip()))
            }));
        }
        if let Some(copy) = &self.copy {
            // A batch the copier has no room for (a catch-up fills its queue before the
            // copier starts) is read back from the stream: never cloned for nothing.
            let handed = copy.has_room(feed.len()) && {
                // Shared with the feed, which takes the same commits (serve runs both).
                let commits = feed.iter().map(|f| Arc::clone(&f.commit)).collect();
                copy.hand(crate::log_copy::CopyBatch {
                    after: self.checkpoint,
                    through: checkpoint,
                    commits,
                })
            };
            if !handed {
                tracing::debug!(
                    through = checkpoint,
                    "copier busy: it reads this batch back from the stream"
                );
                self.metrics.copy_dropped();
            }
        }
        if let Some(sender) = &self.feed {
            let handed = sender.hand(crate::feed::FeedBatch {
                after: self.checkpoint,
                through: checkpoint,
                commits: feed,
            });
            if !handed {
                self.metrics.feed_dropped();
            }
        }
        self.checkpoint = checkpoint;
        self.watermark = watermark;
        self.touched.record(dirty.iter().copied(), checkpoint);
        self.applied.send_replace(checkpoint);
        if reissue_news {
            // A permit is kept when nobody waits: the next wait returns at once.
            self.reissues.notify_one();
        }
        if self.cache.len() > CACHE_ENTITIES_MAX {
            self.cache.clear();
        }
        self.maybe_snapshot(previous, behind)
    }

    /// What the commit does to its aggregate's chain: extends it (fold it), reveals a loss
    /// or lies past one (held until acknowledged; the last acknowledgement hands back
    /// every commit held), or breaks it (the violation, in words).
    fn past_loss(
        &mut self,
        commit: Commit,
        batch: &mut StoreBatch,
    ) -> Result<PastLoss, StoreError> {
        let aggregate = commit.aggregate;
        let position = commit.position;
        let header = self.load(aggregate)?.header();
        let (tip_version, tip_position) = (header.version, header.last_position);
        Ok(match self.held.pass(&commit, tip_version, tip_position) {
            Passage::Read => match self.load(aggregate)?.check_next(&commit) {
                Ok(()) => PastLoss::Fold(vec![commit]),
                Err(violation) => PastLoss::Violation(Box::new(commit), violation.to_string()),
            },
            Passage::Held(chain) => {
                // This commit revealed a loss (the one found just before it).
                for loss in chain.open.as_slice() {
                    if loss.next_position == position {
                        tracing::error!(%loss, "commits lost from the log: the aggregate is held until an operator acknowledges");
                    }
                }
                batch.held.push((aggregate, Some(chain)));
                PastLoss::Held(Box::new(commit))
            }
            Passage::Resumed { commits, .. } => {
                tracing::warn!(%aggregate, position, commits = commits.len(), "every loss acknowledged; the commits held past it are folded");
                batch.held.push((aggregate, None));
                PastLoss::Fold(commits)
            }
            Passage::Outside(reason) => PastLoss::Violation(Box::new(commit), reason),
        })
    }

    /// Folds `commit` into its entity; the position of the commit of that aggregate folded
    /// before it (0: none).
    fn fold(
        &mut self,
        commit: &Commit,
        batch: &mut StoreBatch,
        dirty: &mut HashSet<AggregateId>,
    ) -> Result<u64, StoreError> {
        if self.copies_log {
            // The copy holds the codec's bytes; re-encoding a decoded commit gives the
            // same bytes because the encoding is canonical (the golden tests pin it).
            let bytes = codec::encode(commit).map_err(|e| StoreError::Corrupt {
                what: format!("commit at position {}", commit.position),
                reason: e.to_string(),
            })?;
            batch
                .commits
                .push((commit.position, commit.aggregate, commit.version, bytes));
        }
        let aggregate = commit.aggregate;
        let entity = self.load(aggregate)?;
        // Version 0: nothing of it was folded or stored before (a stored entity has folded
        // at least one commit), so this is where the id index learns of it.
        if entity.header().version == 0 {
            batch.created.push(aggregate);
        }
        let folded_before = entity.header().last_position;
        entity.apply(commit);
        if aggregate.kind == AggregateKind::Provider {
            if let Entity::Provider(provider) = &*entity {
                for consumer in touched_consumers(&commit.events) {
                    let present = provider.allocations.contains_key(&consumer);
                    batch
                        .allocation_index
                        .push((consumer, aggregate.id, present));
                }
            }
        }
        dirty.insert(aggregate);
        Ok(folded_before)
    }

    /// A snapshot falls due each time the checkpoint crosses a multiple of
    /// `snapshot_every`. It copies every entity, so while the projector is behind (a full
    /// batch, or short of the end it is catching up to) it waits: a replica catching up on
    /// N commits would otherwise copy its growing set of entities N / `snapshot_every`
    /// times, quadratic in all. It is taken at the first batch that is neither. A projector
    /// whose batches stay full past the end it caught up to takes it after
    /// `SNAPSHOT_DEFERRED_MAX` multiples at most; one still short of that end does not (a
    /// snapshot on the way is pruned once newer ones exist, and a crash resumes the catch-up
    /// from the checkpoint, not from a snapshot: at 10,000,000 commits the ten on the way
    /// cost 74 s of 206).
    fn maybe_snapshot(&mut self, previous: u64, behind: bool) -> Result<(), StoreError> {
        if self.snapshot_every == 0 {
            return Ok(());
        }
        if previous / self.snapshot_every != self.checkpoint / self.snapshot_every {
            self.snapshot_due_since.get_or_insert(self.checkpoint);
        }
        let Some(due_since) = self.snapshot_due_since else {
            return Ok(());
        };
        if self.checkpoint < self.catching_up_to {
            return Ok(());
        }
        let overdue = self.checkpoint - due_since
            >= SNAPSHOT_DEFERRED_MAX.saturating_mul(self.snapshot_every);
        if behind && !overdue {
            return Ok(());
        }
        self.snapshot_due_since = None;
        let started = std::time::Instant::now();
        let entities = self.store.write_snapshot(self.checkpoint)?;
        tracing::info!(
            position = self.checkpoint,
            entities,
            ms = started.elapsed().as_millis() as u64,
            "projection snapshot written"
        );
        if let Some((publisher, stream)) = &self.publisher {
            if publisher.capacity() > 0 {
                match crate::bootstrap::prepare(&self.store, stream) {
                    Ok(snapshot) => {
                        let _ = publisher.try_send(snapshot);
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot prepare a snapshot to publish"),
                }
            }
        }
        Ok(())
    }

    /// Folds everything the log holds now, then returns the checkpoint. `on_batch` sees
    /// the checkpoint and the log's end after each batch (for progress bars).
    pub async fn catch_up<L: EventLog>(
        &mut self,
        log: &L,
        mut on_batch: impl FnMut(u64, u64),
    ) -> Result<u64, ProjectorError> {
        let end = log.last_position().await?;
        if end <= self.checkpoint {
            return Ok(self.checkpoint);
        }
        let stream = log.read_all(self.checkpoint + 1).await?;
        let mut chunks = stream.ready_chunks(BATCH_ENTRIES_MAX);
        while let Some(chunk) = chunks.next().await {
            self.apply_batch_off_the_reactor(chunk)?;
            on_batch(self.checkpoint, end);
        }
        Ok(self.checkpoint)
    }

    /// Follows the log until `shutdown` turns true, finishing the batch in hand first.
    /// When the log becomes unavailable it resubscribes from the checkpoint with back-off.
    pub async fn run<L: EventLog>(
        &mut self,
        log: &L,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), ProjectorError> {
        let mut backoff = Duration::from_millis(100);
        loop {
            if *shutdown.borrow() {
                return Ok(());
            }
            let stream = match log.subscribe(self.checkpoint + 1).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, ?backoff, "cannot subscribe to the log; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.changed() => {}
                    }
                    backoff = (backoff * 2).min(RESUBSCRIBE_BACKOFF_MAX);
                    continue;
                }
            };
            // Read in eighths of a batch, so that a gathered batch stays within the bound.
            let mut chunks = stream.ready_chunks(BATCH_ENTRIES_MAX / 8);
            loop {
                let chunk = tokio::select! {
                    chunk = chunks.next() => chunk,
                    _ = shutdown.changed() => return Ok(()),
                };
                let Some(mut chunk) = chunk else { break };
                // More than one entry ready means entries queued while the last batch was
                // written: under load, gather for a moment so that one sled batch carries
                // many commits (group commit). A lone entry is applied at once, so an idle
                // replica's read-your-writes stays immediate.
                // A shutdown seen while gathering is remembered: `changed()` marks it seen,
                // so the outer wait would never see it again.
                let mut stopping = false;
                if chunk.len() > 1 {
                    let until = tokio::time::Instant::now() + GROUP_COMMIT_LINGER;
                    while chunk.len() + BATCH_ENTRIES_MAX / 8 <= BATCH_ENTRIES_MAX {
                        tokio::select! {
                            more = tokio::time::timeout_at(until, chunks.next()) => match more {
                                Ok(Some(more)) => chunk.extend(more),
                                _ => break,
                            },
                            _ = shutdown.changed() => {
                                stopping = true;
                                break;
                            }
                        }
                    }
                }
                let applied = self.apply_batch_off_the_reactor(chunk);
                if stopping && applied.is_ok() {
                    return Ok(());
                }
                match applied {
                    Ok(outcome) => {
                        backoff = Duration::from_millis(100);
                        tracing::debug!(checkpoint = self.checkpoint, ?outcome, "batch applied");
                    }
                    Err(ProjectorError::Read(e)) => {
                        tracing::warn!(error = %e, "log read failed; resubscribing from the checkpoint");
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.changed() => {}
            }
            backoff = (backoff * 2).min(RESUBSCRIBE_BACKOFF_MAX);
        }
    }
}

/// The consumers whose allocation on this provider a commit may have changed.
fn touched_consumers(events: &[Event]) -> impl Iterator<Item = Uuid> + '_ {
    events.iter().filter_map(|e| match e {
        Event::AllocationClaimed { consumer, .. } | Event::AllocationReleased { consumer, .. } => {
            Some(*consumer)
        }
        _ => None,
    })
}
