//! A serve replica's copy of the stream (issue 39): every commit it applied, kept in the
//! data dir so that a JetStream loss has a second copy and a stopped replica can show
//! history (`history`, `state --at`, `audit` offline).
//!
//! Why a tree and a thread of its own, not the projector's batch: `cmd.append` answers
//! once serve's projector has applied the commit, and writing the copy in the projector's
//! batch (as serve did before issue 23) cost about a fifth of serve's time on that path.
//! Here the projector only hands each written batch's commits over a bounded queue, never
//! waiting ([`crate::handoff::Sender::hand`]); the copier writes them on its own thread, one sled
//! `apply_batch` per handed batch (or per [`READ_BACK_BATCH_MAX`] read back), in the sled
//! tree [`COPY_TREE`] of the same data dir. A batch the queue has no room for is dropped and
//! read back from the stream later, as are the positions the copy lacks when serve starts
//! (a new copy reads the stream from position 1): the copy never waits on the request
//! path and never has a hole it does not fill. The copier starts once the replica has
//! caught up with the stream (`Copier::start`), so that a catch-up is not slowed by it.
//!
//! Key layout of the tree `log_copy_packed` (one leading tag byte; a copy kept before packs
//! is in the tree `log_copy`, one `c` + position key per commit, until it is packed):
//! - `p` + position: a pack of consecutive commits from that position on, each the codec's
//!   bytes ([`pack`]: one key per commit cost a tenth of a commit's CPU).
//! - `t` + aggregate (17 bytes): its chain's tip in the copy, version (8 bytes) and hash
//!   (32), as of the `m` + `tips` mark: what the copier checks a commit it does not
//!   remember the aggregate of against. One key per aggregate, written when the copy is
//!   flushed (at most every [`COPY_FLUSH_INTERVAL`]) for the aggregates that moved since:
//!   a per-commit index (`h` + aggregate + version, as the projection store keeps) doubled
//!   the copier's sled writes and a fifth of the copy's bytes, for an offline history
//!   that can scan the copy instead (`ProjectionStore::aggregate_commits`).
//! - `m` + `copied`: every position up to it was copied (or is not a commit the copy
//!   keeps); written in the batch that copies it.
//! - `m` + `tips`: every commit up to it is in the `t` keys; the commits after it (up to
//!   `copied`, those of the last second before a crash) are read again at open.
//! - `m` + `from`: the first position the copy covers (1 for a whole copy).
//!
//! What it keeps: exactly the commit the stream holds at each position that extends its
//! aggregate's chain in the copy (version = the copy's tip + 1 and `prev_hash` = the
//! tip's hash; version 1 after the zero hash), and a commit past a loss of the stream
//! (a version further on: the commits between are not in the stream, so not here
//! either; readers' chain checks name that gap as they do on the stream). A commit that
//! does not link (a replay, a forgery, an older version) is refused and not written: the
//! projector quarantines the same entries. Garbage is not a commit and is not copied.
//!
//! It is never ahead of the stream: it copies what the projector applied (which the
//! stream acknowledged) or what it reads back from the stream. A crash loses at most the
//! batches since the last flush, with their `copied` mark; they are read back at the next
//! start.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_events::codec;
use provledger_events::{AggregateId, Commit, EventLog, Hash, ReadError};
use tokio::sync::watch;

use crate::handoff::{self, Release};
use crate::store::{be_u64, StoreError};

pub mod pack;
pub use pack::{locate, CopyEntries};

/// The sled tree of the copy, its commits in packs ([`pack`]).
pub const COPY_TREE: &str = "log_copy_packed";
/// The tree of a copy kept one key per commit, before packs: packed into [`COPY_TREE`] and
/// removed when its data dir is next opened. A tree of another name, so that an older
/// build, which reads only this one, sees no copy after a downgrade (and keeps a new one,
/// read back from the stream) instead of taking packs for positions it holds nothing at.
pub const OLDER_COPY_TREE: &str = "log_copy";
/// Batches the projector may hand ahead of the copier; past it a batch is dropped and
/// read back from the stream.
pub const COPY_QUEUE_BATCHES_MAX: usize = 64;
/// Commits the queue holds at most (decoded, in memory), whatever the batches' sizes: a
/// catch-up's batches are full (`BATCH_ENTRIES_MAX`), a live load's are small.
pub const COPY_QUEUE_COMMITS_MAX: usize = 32_768;
/// Commits read back from the stream per sled batch (a start, a dropped batch).
pub const READ_BACK_BATCH_MAX: usize = 4096;
/// Aggregates whose chain tip the copier keeps in memory; past it the tips that moved are
/// written, the map is emptied, and tips are read from the copy's `t` keys as needed.
pub const TIPS_CACHED_MAX: usize = 200_000;
/// How long the copier gathers the batches handed after the first before it writes them
/// as one: under load the projector hands one small batch per linger of its own, and a
/// copier woken for each paid a wake-up and a sled batch per commit at one client.
pub const COPY_LINGER: Duration = Duration::from_millis(100);
/// The copy is flushed at most this often while writing (and at every stop): a crash
/// loses at most this much, which the next start reads back from the stream.
pub const COPY_FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// Why a commit was not copied: it does not extend its aggregate's chain in the copy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CopyRefusal {
    #[error("{aggregate} v{version} at position {position}: its hash does not match its content")]
    BadHash {
        aggregate: AggregateId,
        version: u64,
        position: u64,
    },
    #[error("{aggregate} v{version} at position {position}: the copy already holds v{tip}")]
    NotNewer {
        aggregate: AggregateId,
        version: u64,
        position: u64,
        tip: u64,
    },
    #[error(
        "{aggregate} v{version} at position {position}: its prev_hash is not the hash of v{}",
        version - 1
    )]
    Unlinked {
        aggregate: AggregateId,
        version: u64,
        position: u64,
    },
}

/// What one write did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CopyOutcome {
    pub copied: usize,
    /// Copied past a loss of the stream (versions missing before them).
    pub after_loss: usize,
    pub refused: Vec<CopyRefusal>,
}

/// The positions a copy covers: `from` through `through` (both 0 when it holds nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyExtent {
    pub from: u64,
    pub through: u64,
}

impl CopyExtent {
    /// Whether the copy holds every commit from position 1 (not begun later).
    pub fn is_whole(&self) -> bool {
        self.from <= 1
    }
}

fn meta(name: &[u8]) -> Vec<u8> {
    let mut k = vec![b'm'];
    k.extend_from_slice(name);
    k
}

fn tip_key(aggregate: &AggregateId) -> Vec<u8> {
    let mut k = vec![b't'];
    k.extend_from_slice(&aggregate.key_bytes());
    k
}

/// A `t` value: the tip's version, then its hash.
fn tip_value(version: u64, hash: &Hash) -> [u8; 40] {
    let mut v = [0; 40];
    v[..8].copy_from_slice(&version.to_be_bytes());
    v[8..].copy_from_slice(&hash.0);
    v
}

/// The extent of the copy in `db`, if it has one (`None`: no copy was ever kept, or it
/// was removed by `--no-log-copy`). Reads only: the tree is not created.
pub fn extent(db: &sled::Db) -> Result<Option<CopyExtent>, StoreError> {
    // An older copy not packed yet is the current one (a packed tree beside it is stale:
    // `pack::pack_older_layout`); the marks are the same in both layouts.
    for tree in [OLDER_COPY_TREE, COPY_TREE] {
        if has_tree(db, tree) {
            if let Some(extent) = extent_of(&db.open_tree(tree)?)? {
                return Ok(Some(extent));
            }
        }
    }
    Ok(None)
}

pub(crate) fn has_tree(db: &sled::Db, name: &str) -> bool {
    db.tree_names()
        .iter()
        .any(|n| n.as_ref() == name.as_bytes())
}

/// The extent of the copy in `tree` (`None`: it holds none).
pub(crate) fn extent_of(tree: &sled::Tree) -> Result<Option<CopyExtent>, StoreError> {
    let Some(from) = tree.get(meta(b"from"))?.and_then(|v| be_u64(&v)) else {
        return Ok(None);
    };
    let through = tree
        .get(meta(b"copied"))?
        .and_then(|v| be_u64(&v))
        .unwrap_or(0);
    Ok(Some(CopyExtent { from, through }))
}

/// Removes the copy from `db` (`--no-log-copy`: a replica that must not keep one).
pub fn remove(db: &sled::Db) -> Result<bool, StoreError> {
    let older = db.drop_tree(OLDER_COPY_TREE)?;
    Ok(db.drop_tree(COPY_TREE)? || older)
}

/// The copy's writer: the one writer of the tree [`COPY_TREE`].
pub struct LogCopy {
    tree: sled::Tree,
    db: sled::Db,
    extent: CopyExtent,
    /// (version, hash) of each aggregate's last copied commit, as far as remembered.
    tips: HashMap<AggregateId, (u64, Hash)>,
    /// The remembered tips not yet written to `t`.
    moved: HashSet<AggregateId>,
    /// A write failed after tips were remembered: they are read again from the mark.
    tips_lost: bool,
    last_flush: Instant,
}

impl LogCopy {
    /// Opens (or begins) the copy in `db`. A new copy begins at `from`: 1 to copy the
    /// stream whole (read back from its start), or later for a copy that begins where
    /// the replica is (then it says so: [`CopyExtent::is_whole`]).
    pub fn open(db: &sled::Db, from: u64) -> Result<Self, StoreError> {
        // serve's store opened the data dir first and packed it already (then this only
        // looks for the older tree); a copy opened alone is packed here.
        pack::pack_older_layout(db)?;
        let tree = db.open_tree(COPY_TREE)?;
        let extent = match extent(db)? {
            Some(extent) => extent,
            None => {
                let from = from.max(1);
                let mut batch = sled::Batch::default();
                batch.insert(meta(b"from"), &from.to_be_bytes()[..]);
                batch.insert(meta(b"copied"), &(from - 1).to_be_bytes()[..]);
                tree.apply_batch(batch)?;
                CopyExtent {
                    from,
                    through: from - 1,
                }
            }
        };
        let mut copy = LogCopy {
            tree,
            db: db.clone(),
            extent,
            tips: HashMap::new(),
            moved: HashSet::new(),
            tips_lost: false,
            last_flush: Instant::now(),
        };
        copy.recover_tips()?;
        Ok(copy)
    }

    /// Brings the `t` keys up to the copy's end: the commits copied after the `tips` mark
    /// (a crash since the last flush; every commit of a copy kept before the `t` keys
    /// existed) are read again.
    fn recover_tips(&mut self) -> Result<(), StoreError> {
        let mark = self
            .tree
            .get(meta(b"tips"))?
            .and_then(|v| be_u64(&v))
            .unwrap_or(self.extent.from - 1);
        if mark < self.extent.through {
            tracing::info!(
                from = mark + 1,
                through = self.extent.through,
                "reading the copy's last commits again for their chains' tips"
            );
            for entry in pack::read(&self.tree, mark + 1, self.extent.through)? {
                let (position, bytes) = entry?;
                let commit = codec::decode(&bytes, position)
                    .map_err(|error| StoreError::Commit { position, error })?;
                // In position order, so the last one read of an aggregate is its tip.
                self.remember(commit.aggregate, commit.version, commit.hash);
            }
            self.write_tips()?;
        }
        Ok(())
    }

    /// Remembers `aggregate`'s tip, to be written to `t` at the next flush.
    fn remember(&mut self, aggregate: AggregateId, version: u64, hash: Hash) {
        self.tips.insert(aggregate, (version, hash));
        self.moved.insert(aggregate);
    }

    /// Writes the tips that moved, with the mark that every commit through the copy's end
    /// has its tip written.
    fn write_tips(&mut self) -> Result<(), StoreError> {
        let mut batch = sled::Batch::default();
        for aggregate in &self.moved {
            if let Some((version, hash)) = self.tips.get(aggregate) {
                batch.insert(tip_key(aggregate), &tip_value(*version, hash)[..]);
            }
        }
        batch.insert(meta(b"tips"), &self.extent.through.to_be_bytes()[..]);
        self.tree.apply_batch(batch)?;
        crate::store::reclaim_sled_garbage(self.moved.len() + 1);
        self.moved.clear();
        Ok(())
    }

    pub fn extent(&self) -> CopyExtent {
        self.extent
    }

    /// Moves the start of a copy that holds nothing yet to `from` (the stream's first
    /// entry is later than the copy's start: a stream whose oldest messages were removed).
    fn begin_at(&mut self, from: u64) -> Result<(), StoreError> {
        if self.extent.through + 1 != self.extent.from || from <= self.extent.from {
            return Ok(());
        }
        let mut batch = sled::Batch::default();
        batch.insert(meta(b"from"), &from.to_be_bytes()[..]);
        batch.insert(meta(b"copied"), &(from - 1).to_be_bytes()[..]);
        self.tree.apply_batch(batch)?;
        tracing::warn!(
            from,
            "the stream's first entry is past position 1: the copy starts there"
        );
        self.extent = CopyExtent {
            from,
            through: from - 1,
        };
        Ok(())
    }

    /// The last copied (version, hash) of `aggregate`: remembered, or read from `t`.
    fn tip(&mut self, aggregate: &AggregateId) -> Result<Option<(u64, Hash)>, StoreError> {
        if let Some(tip) = self.tips.get(aggregate) {
            return Ok(Some(*tip));
        }
        let Some(v) = self.tree.get(tip_key(aggregate))? else {
            return Ok(None);
        };
        let (Some(version), Some(hash)) = (
            be_u64(&v),
            v.get(8..40).and_then(|h| <[u8; 32]>::try_from(h).ok()),
        ) else {
            return Err(StoreError::Corrupt {
                what: format!("the copy's tip of {aggregate}"),
                reason: format!("a value of {} bytes, not 40", v.len()),
            });
        };
        Ok(Some((version, Hash(hash))))
    }

    /// Whether `commit` extends its aggregate's chain in the copy; `Ok(true)`: it lies
    /// past a loss of the stream (a version further on than the tip's next).
    fn check(&mut self, commit: &Commit) -> Result<Result<bool, CopyRefusal>, StoreError> {
        let (aggregate, version, position) = (commit.aggregate, commit.version, commit.position);
        if !commit.hash_is_valid() {
            return Ok(Err(CopyRefusal::BadHash {
                aggregate,
                version,
                position,
            }));
        }
        let (tip, tip_hash) = match self.tip(&aggregate)? {
            Some(tip) => tip,
            // Unknown to a copy that begun later: its history before `from` is not here,
            // so its first commit here cannot be linked (readers say the copy starts late).
            None if !self.extent.is_whole() => return Ok(Ok(false)),
            None => (0, Hash::ZERO),
        };
        Ok(if version <= tip {
            Err(CopyRefusal::NotNewer {
                aggregate,
                version,
                position,
                tip,
            })
        } else if version > tip + 1 {
            Ok(true)
        } else if commit.prev_hash != tip_hash {
            Err(CopyRefusal::Unlinked {
                aggregate,
                version,
                position,
            })
        } else {
            Ok(false)
        })
    }

    /// Copies `commits` (in position order; those at or below the copy's end are skipped)
    /// and marks every position through `through` copied, in one sled batch. A commit that
    /// does not link its chain is refused (in the outcome), never written.
    pub fn write<C: Borrow<Commit>>(
        &mut self,
        commits: &[C],
        through: u64,
    ) -> Result<CopyOutcome, StoreError> {
        let mut outcome = CopyOutcome::default();
        if through <= self.extent.through {
            return Ok(outcome);
        }
        if std::mem::take(&mut self.tips_lost) {
            self.recover_tips()?;
        }
        if self.tips.len() + commits.len() > TIPS_CACHED_MAX {
            // Written before they are forgotten: `t` then answers for them.
            self.write_tips()?;
            self.tips.clear();
        }
        let mut batch = sled::Batch::default();
        let mut packer = pack::Packer::default();
        let end = self.extent.through;
        let mut previous = end;
        for commit in commits
            .iter()
            .map(Borrow::borrow)
            .filter(|c: &&Commit| c.position > end)
        {
            assert!(
                commit.position > previous && commit.position <= through,
                "copy: {} v{} at position {} handed after position {previous}, through {through}",
                commit.aggregate,
                commit.version,
                commit.position
            );
            previous = commit.position;
            match self.check(commit)? {
                Err(refusal) => {
                    tracing::warn!(%refusal, "commit not copied: it does not extend its chain in the copy");
                    outcome.refused.push(refusal);
                    continue;
                }
                Ok(after_loss) => outcome.after_loss += usize::from(after_loss),
            }
            let bytes = codec::encode(commit).map_err(|e| StoreError::Corrupt {
                what: format!("commit at position {}", commit.position),
                reason: e.to_string(),
            })?;
            packer.push(&mut batch, commit.position, &bytes)?;
            self.remember(commit.aggregate, commit.version, commit.hash);
            outcome.copied += 1;
        }
        packer.close(&mut batch);
        batch.insert(meta(b"copied"), &through.to_be_bytes()[..]);
        if let Err(e) = self.tree.apply_batch(batch) {
            // The tips remembered above were not written, nor maybe those before them.
            self.tips.clear();
            self.moved.clear();
            self.tips_lost = true;
            return Err(e.into());
        }
        // At most one key per commit copied (packs are fewer), and the mark.
        crate::store::reclaim_sled_garbage(outcome.copied + 1);
        self.extent.through = through;
        Ok(outcome)
    }

    /// Flushes the data dir if the last flush is older than [`COPY_FLUSH_INTERVAL`]
    /// (`force`: now).
    pub fn flush(&mut self, force: bool) -> Result<(), StoreError> {
        if force || self.last_flush.elapsed() >= COPY_FLUSH_INTERVAL {
            self.write_tips()?;
            self.db.flush()?;
            self.last_flush = Instant::now();
        }
        Ok(())
    }
}

/// What the projector hands the copier once a batch is written: the commits it took at
/// their positions (folded, or held past a loss), after `after` through `through`. Shared
/// with the feed, which takes the same commits: never cloned for the two.
#[derive(Debug)]
pub struct CopyBatch {
    pub after: u64,
    pub through: u64,
    pub commits: Vec<Arc<Commit>>,
}

/// The projector's end of the copier's queue.
pub type CopySender = handoff::Sender<CopyBatch>;

/// The copier's end of its queue: a batch taken no longer counts against it.
pub type CopyReceiver = handoff::Receiver<CopyBatch>;

impl handoff::Batch for CopyBatch {
    fn commits(&self) -> usize {
        self.commits.len()
    }
}

/// The copier's queue: the projector's end and the copier's.
pub fn queue() -> (CopySender, CopyReceiver) {
    handoff::queue(
        COPY_QUEUE_BATCHES_MAX,
        COPY_QUEUE_COMMITS_MAX,
        Release::OnTake,
    )
}

/// Why the copier stopped.
#[derive(Debug, thiserror::Error)]
pub enum CopierError {
    #[error("the copy of the stream: {0}")]
    Store(#[from] StoreError),
    #[error("reading the stream back into the copy: {0}")]
    Read(#[from] ReadError),
}

/// Copies positions after the copy's end through `to` from `log`, in sled batches of at
/// most [`READ_BACK_BATCH_MAX`] commits. Entries that are not commits (garbage) are
/// passed over: the projector quarantines them.
pub async fn read_back<L: EventLog>(
    copy: &mut LogCopy,
    log: &L,
    to: u64,
) -> Result<(), CopierError> {
    let from = copy.extent().through + 1;
    if to < from {
        return Ok(());
    }
    tracing::info!(from, to, "reading the stream back into the copy");
    let mut entries = log.read_all(from).await?;
    let mut commits = Vec::new();
    let mut last = from - 1;
    let mut first = true;
    while let Some(entry) = entries.next().await {
        let position = match entry {
            Ok(commit) => {
                let position = commit.position;
                if position <= to {
                    commits.push(commit);
                }
                position
            }
            Err(e) => match e.quarantine_parts() {
                Some((position, ..)) => position,
                None => return Err(e.into()),
            },
        };
        if position > to {
            break;
        }
        if std::mem::take(&mut first) && position > from {
            copy.begin_at(position)?;
        }
        last = position;
        if commits.len() >= READ_BACK_BATCH_MAX {
            copy_write(copy, &std::mem::take(&mut commits), last)?;
        }
        if position == to {
            break;
        }
    }
    copy_write(copy, &commits, last)?;
    copy.flush(false)?;
    Ok(())
}

fn copy_write<C: Borrow<Commit>>(
    copy: &mut LogCopy,
    commits: &[C],
    through: u64,
) -> Result<(), StoreError> {
    let outcome = copy.write(commits, through)?;
    if outcome.after_loss > 0 {
        tracing::warn!(
            commits = outcome.after_loss,
            through,
            "copied commits that lie past a loss of the stream (their earlier versions are not in it)"
        );
    }
    Ok(())
}

/// serve's copier: reads back what the copy lacks up to what the projector has applied,
/// then writes each batch the projector hands, reading back any it dropped, until `stop`;
/// then copies up to what the projector applied last and flushes.
pub async fn run<L: EventLog>(
    mut copy: LogCopy,
    log: L,
    mut batches: CopyReceiver,
    applied: watch::Receiver<u64>,
    mut go: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), CopierError> {
    // A replica catching up is not slowed by its copy (the copier's sled writes took
    // 60% more time to ready): the copier starts once the replica is caught up. Its queue
    // fills meanwhile, and what it had no room for is read back.
    let stopping = tokio::select! {
        _ = go.wait_for(|go| *go) => false,
        _ = stop.changed() => true,
    };
    if stopping {
        // Stopped before it was caught up: the next start reads back what is missing, and
        // this stop does not wait for it.
        return Ok(());
    }
    let start = *applied.borrow();
    read_back(&mut copy, &log, start).await?;
    loop {
        let batch = tokio::select! {
            batch = batches.recv() => batch,
            _ = stop.changed() => None,
        };
        let Some(batch) = batch else { break };
        let stopping = tokio::select! {
            _ = tokio::time::sleep(COPY_LINGER) => false,
            _ = stop.changed() => true,
        };
        take_gathered(&mut copy, &log, batch, &mut batches).await?;
        if stopping {
            break;
        }
    }
    // What was handed before the stop, then what the projector applied last.
    while let Some(batch) = batches.try_recv() {
        take(&mut copy, &log, batch).await?;
    }
    let end = *applied.borrow();
    read_back(&mut copy, &log, end).await?;
    copy.flush(true)?;
    tracing::info!(
        through = copy.extent().through,
        "copy of the stream flushed"
    );
    Ok(())
}

/// serve's copier on a thread of its own ([`run`] on a current-thread runtime): its sled
/// writes never take a worker of serve's runtime from the requests.
pub struct Copier {
    go: watch::Sender<bool>,
    stop: watch::Sender<bool>,
    done: tokio::sync::oneshot::Receiver<Result<(), CopierError>>,
}

impl Copier {
    pub fn spawn<L: EventLog + 'static>(
        copy: LogCopy,
        log: L,
        batches: CopyReceiver,
        applied: watch::Receiver<u64>,
    ) -> std::io::Result<Self> {
        let (stop, stopped) = watch::channel(false);
        let (go, going) = watch::channel(false);
        let (done_tx, done) = tokio::sync::oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        std::thread::Builder::new()
            .name("log-copy".into())
            .spawn(move || {
                let result = runtime.block_on(run(copy, log, batches, applied, going, stopped));
                if let Err(e) = &result {
                    tracing::error!(error = %e, "the copy of the stream stopped; offline history ends where it stopped");
                }
                // Nobody to tell when serve itself is gone.
                let _ = done_tx.send(result);
            })?;
        Ok(Copier { go, stop, done })
    }

    /// Lets the copier start: the replica has caught up with the stream.
    pub fn start(&self) {
        let _ = self.go.send(true);
    }

    /// Stops the copier once the projector has stopped: it copies through what the
    /// projector applied last, flushes, and returns.
    pub async fn stop(self) -> Result<(), CopierError> {
        let _ = self.stop.send(true);
        match self.done.await {
            Ok(result) => result,
            // The thread ended without a word: it panicked (logged by the panic hook).
            Err(_) => Ok(()),
        }
    }
}

/// Writes `first` with the batches queued behind it that follow it without a gap, as one
/// sled batch (at most [`READ_BACK_BATCH_MAX`] commits), then each batch after a gap.
async fn take_gathered<L: EventLog>(
    copy: &mut LogCopy,
    log: &L,
    first: CopyBatch,
    batches: &mut CopyReceiver,
) -> Result<(), CopierError> {
    let mut gathered = first;
    while gathered.commits.len() < READ_BACK_BATCH_MAX {
        let Some(next) = batches.try_recv() else {
            break;
        };
        if next.after > gathered.through {
            // A batch was dropped between them: what is gathered first, then this one
            // (reading the gap back).
            take(copy, log, std::mem::replace(&mut gathered, next)).await?;
            continue;
        }
        gathered.commits.extend(next.commits);
        gathered.through = next.through;
    }
    take(copy, log, gathered).await
}

/// Writes one handed batch, first reading back the positions before it that the copy
/// lacks (a dropped batch).
async fn take<L: EventLog>(
    copy: &mut LogCopy,
    log: &L,
    batch: CopyBatch,
) -> Result<(), CopierError> {
    if batch.after > copy.extent().through {
        read_back(copy, log, batch.after).await?;
    }
    copy_write(copy, &batch.commits, batch.through)?;
    copy.flush(false)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::catalogue::samples;
    use provledger_events::{CommitDraft, Event};
    use uuid::Uuid;

    /// A store as serve opens it: no copy in the projection's own tree.
    fn serve_store(db: &sled::Db) -> crate::ProjectionStore {
        let store = crate::ProjectionStore::open(db).expect("store");
        store.keep_no_copy().expect("no copy in the projection");
        store
    }

    fn commit(id: AggregateId, version: u64, prev: Hash, position: u64) -> Commit {
        let event: Event = samples::all().into_iter().next().expect("a sample event");
        let mut c = Commit::seal(id, version, prev, CommitDraft::now("t", vec![event]));
        c.position = position;
        c
    }

    /// Given a copy holding v1 and v2 of an aggregate, when a batch brings a v3 whose
    /// prev_hash is not v2's hash, a replayed v2 and a v3 whose hash does not match its
    /// content, then each is refused and none is written, while a v3 that links is copied
    /// and the copy's end moves through the batch.
    #[test]
    fn a_copy_refuses_a_commit_that_does_not_link_its_chain() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let id = AggregateId::provider(Uuid::from_u128(7));
        let mut copy = LogCopy::open(&db, 1).expect("copy");
        let v1 = commit(id, 1, Hash::ZERO, 1);
        let v2 = commit(id, 2, v1.hash, 2);
        let outcome = copy.write(&[v1.clone(), v2.clone()], 2).expect("write");
        assert_eq!((outcome.copied, outcome.refused.len()), (2, 0));

        let unlinked = commit(id, 3, v1.hash, 3);
        let mut replayed = v2.clone();
        replayed.position = 4;
        let mut tampered = commit(id, 3, v2.hash, 5);
        tampered.actor = "someone else".into();
        // Reopened: the tip comes from the copy's index, not from memory.
        drop(copy);
        let mut copy = LogCopy::open(&db, 1).expect("reopen");
        let outcome = copy
            .write(&[unlinked, replayed, tampered], 5)
            .expect("write");
        assert_eq!(outcome.copied, 0);
        assert!(matches!(
            outcome.refused[0],
            CopyRefusal::Unlinked { version: 3, .. }
        ));
        assert!(matches!(
            outcome.refused[1],
            CopyRefusal::NotNewer { tip: 2, .. }
        ));
        assert!(matches!(outcome.refused[2], CopyRefusal::BadHash { .. }));
        assert_eq!(
            copy.extent(),
            CopyExtent {
                from: 1,
                through: 5
            }
        );

        let v3 = commit(id, 3, v2.hash, 6);
        let outcome = copy.write(&[v3], 6).expect("write");
        assert_eq!((outcome.copied, outcome.refused.len()), (1, 0));
        let store = serve_store(&db);
        let history = store.aggregate_commits(&id, u64::MAX).expect("history");
        assert_eq!(
            history
                .iter()
                .map(|c| (c.version, c.position))
                .collect::<Vec<_>>(),
            vec![(1, 1), (2, 2), (3, 6)]
        );
    }

    /// Given a copy flushed after v1 and v2 of an aggregate (their tip written to `t`),
    /// when it is opened again, then the tip answers from `t` (a v3 linking v2 is copied, a
    /// replayed v2 refused). (The per-commit index `h` of a still older layout is dropped
    /// when that layout is packed: `pack::pack_older_layout`.)
    #[test]
    fn a_flushed_copy_checks_against_its_written_tips() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let id = AggregateId::provider(Uuid::from_u128(9));
        let mut copy = LogCopy::open(&db, 1).expect("copy");
        let v1 = commit(id, 1, Hash::ZERO, 1);
        let v2 = commit(id, 2, v1.hash, 2);
        copy.write(&[v1, v2.clone()], 2).expect("write");
        copy.flush(true).expect("flush");
        let tree = db.open_tree(COPY_TREE).expect("tree");
        assert_eq!(
            tree.get(meta(b"tips")).expect("read").as_deref(),
            Some(&2u64.to_be_bytes()[..])
        );
        drop(copy);

        let mut copy = LogCopy::open(&db, 1).expect("reopen");
        let mut replayed = v2.clone();
        replayed.position = 3;
        let v3 = commit(id, 3, v2.hash, 4);
        let outcome = copy.write(&[replayed, v3], 4).expect("write");
        assert_eq!(outcome.copied, 1);
        assert!(matches!(
            outcome.refused[..],
            [CopyRefusal::NotNewer { tip: 2, .. }]
        ));
    }

    /// Given a copy kept by an older serve, one `c` key per commit, when its data dir is
    /// opened as a store, then the copy is packed and its history reads as before.
    #[test]
    fn a_copy_of_the_older_layout_is_packed_when_its_store_opens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let id = AggregateId::provider(Uuid::from_u128(11));
        let mut prev = Hash::ZERO;
        let commits: Vec<Commit> = (1..=5)
            .map(|v| {
                let c = commit(id, v, prev, v * 2);
                prev = c.hash;
                c
            })
            .collect();
        let tree = db.open_tree(OLDER_COPY_TREE).expect("tree");
        for c in &commits {
            let mut k = vec![b'c'];
            k.extend_from_slice(&c.position.to_be_bytes());
            tree.insert(k, codec::encode(c).expect("encodes"))
                .expect("insert");
        }
        tree.insert(meta(b"from"), &1u64.to_be_bytes()[..])
            .expect("from");
        tree.insert(meta(b"copied"), &10u64.to_be_bytes()[..])
            .expect("copied");

        drop(tree);
        let store = serve_store(&db);
        assert!(!has_tree(&db, OLDER_COPY_TREE));
        assert_eq!(
            store.aggregate_commits(&id, u64::MAX).expect("history"),
            commits
        );
    }

    /// Given a copy begun at position 10 (the stream no longer held positions 1-9), when it
    /// copies v4 of an aggregate it never saw, then it keeps it, and the history of that
    /// aggregate is refused as starting late rather than shown from v4.
    #[test]
    fn a_copy_begun_late_keeps_commits_but_refuses_their_partial_history() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let id = AggregateId::provider(Uuid::from_u128(8));
        let mut copy = LogCopy::open(&db, 10).expect("copy");
        let v4 = commit(id, 4, Hash([9; 32]), 12);
        assert_eq!(copy.write(&[v4], 12).expect("write").copied, 1);
        let store = serve_store(&db);
        match store.aggregate_commits(&id, u64::MAX) {
            Err(StoreError::CopyStartsLate { from: 10, .. }) => {}
            other => panic!("expected CopyStartsLate, got {other:?}"),
        }
    }
}
