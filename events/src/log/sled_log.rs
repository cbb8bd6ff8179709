//! The embedded backend: sled is the source of truth.
//!
//! Key layout in the `log` tree (all integers big-endian so that keys sort by number):
//! - `c` + position(8)                 -> encoded commit
//! - `h` + aggregate(17)               -> head: version(8) position(8) hash(32)
//! - `v` + aggregate(17) + version(8)  -> position(8)
//! - `i` + commit_id(16)               -> position(8)
//!
//! Appends are serialised by one in-process mutex (positions are assigned under it and
//! applied with one atomic `apply_batch`), and the data dir is locked against other
//! processes. Durability uses group commit: a flusher thread calls `Db::flush` for every
//! batch of appends that arrived while the previous flush ran, and an append is
//! acknowledged only once a flush that started after its batch was applied has returned.
//! A failed flush is fatal: after a refused fsync nothing says what reached the disk, so
//! its waiters and every later append are refused until the data dir is reopened.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use futures::StreamExt;
use tokio::sync::watch;

use super::group_commit::{self, GroupCommit, GroupStats, SetAnswer, SetWriter};
use super::{
    encode_for_append, recognise_batch_retry, validate_batch, AppendError, AppendOutcome,
    AppendStatus, AtomicItem, ChainTip, CommitStream, EventLog, Expectation, ReadError,
    VersionConflict,
};
use crate::codec;
use crate::commit::{Commit, CommitDraft};
use crate::ids::{AggregateId, Hash};

const LOCK_FILE: &str = "LOCK";
const SLED_DIR: &str = "sled";
/// How many commits a reader takes from sled per step of a stream.
const READ_CHUNK_COMMITS_MAX: usize = 512;
/// How long the flusher waits for more appends before it flushes (group commit).
const FLUSH_GATHER: std::time::Duration = std::time::Duration::from_micros(200);
/// sled's page cache, in sled's own accounting (what it holds in memory is about 1.6
/// times this). sled's default of 1 GiB let serve's memory climb to about 1.7 GB before it
/// levelled off (`store-memory` in provledger-tests); at 256 MiB it levels off near
/// 450 MB, at the price of reading evicted pages back from the file, which the projector
/// rarely does (it keeps its entities in its own cache) and which the measured write rate
/// did not show.
const SLED_CACHE_CAPACITY_BYTES: u64 = 256 * 1024 * 1024;

/// How long an open waits for sled's own lock once it holds the data dir's
/// (`wait_for_sleds_own_lock`): a closing handle's sled threads let go within
/// milliseconds, seconds on a loaded machine.
const SLED_LOCK_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Why a lock could not be taken within its wait.
enum LockWait {
    /// Still held by another open file when the wait ended, or at once if the holder was
    /// not one to wait for.
    Held,
    Io(std::io::Error),
}

/// Locks `file` (flock), trying again while `may_let_go` says its holder may let go soon,
/// for up to `wait`, pausing 1 ms between tries and doubling to 50 ms. Returns how long
/// it waited.
fn lock_within(
    file: &File,
    wait: std::time::Duration,
    mut may_let_go: impl FnMut() -> bool,
) -> Result<std::time::Duration, LockWait> {
    let started = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(1);
    loop {
        // Called through the trait: std's inherent File::try_lock (1.89) would win otherwise.
        match fs4::FileExt::try_lock(file) {
            Ok(()) => return Ok(started.elapsed()),
            Err(fs4::TryLockError::WouldBlock) if started.elapsed() < wait && may_let_go() => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(std::time::Duration::from_millis(50));
            }
            Err(fs4::TryLockError::WouldBlock) => return Err(LockWait::Held),
            Err(fs4::TryLockError::Error(source)) => return Err(LockWait::Io(source)),
        }
    }
}

/// The pid the data dir's lock file names, as written by its holder.
fn lock_holder(lock_path: &Path) -> Option<String> {
    std::fs::read_to_string(lock_path)
        .ok()
        .map(|s| s.trim().to_string())
}

/// Takes the data dir's lock. Held by another process, it is refused at once. Held by this
/// very process, it may be a handle closing on another task: the last clone of a closed
/// log can outlive `close` for a moment (a group committer answers its last set, then
/// drops its clone), and a close followed at once by an open (the demo, read back) was
/// refused so. That waits, bounded by `wait`, as sled's own lock does below. Refused, it
/// names the holder.
fn take_data_dir_lock(
    dir: &Path,
    lock: &File,
    lock_path: &Path,
    wait: std::time::Duration,
) -> Result<(), OpenSledError> {
    let ours = std::process::id().to_string();
    match lock_within(lock, wait, || {
        lock_holder(lock_path).as_deref() == Some(&ours)
    }) {
        Ok(_) => Ok(()),
        Err(LockWait::Io(source)) => Err(OpenSledError::Io {
            dir: dir.to_path_buf(),
            source,
        }),
        Err(LockWait::Held) => Err(OpenSledError::Locked {
            dir: dir.to_path_buf(),
            holder: match lock_holder(lock_path) {
                Some(pid) if pid == ours => format!(
                    "pid {pid}: this process itself, whose other handle on it stayed open for {} s",
                    wait.as_secs()
                ),
                Some(pid) => format!("pid {pid}"),
                None => "unknown pid".to_string(),
            },
        }),
    }
}

/// sled locks its own `db` file too. Once the data dir's lock is ours, no other process may
/// hold sled's, yet sled's may still be held for a moment by a handle on this dir that was
/// just closed in this process: sled's thread pool keeps the file open after its last `Db`
/// is dropped, and sled then refuses the open with "could not acquire lock" (a `close`
/// followed at once by an open, as the demo and the CLI's tests do, failed so). So the open
/// waits, bounded, until sled's lock can be taken, and lets go of it for sled to take: no
/// one else can take it in between, since the data dir's lock excludes every other opener.
fn wait_for_sleds_own_lock(
    sled_dir: &Path,
    wait: std::time::Duration,
) -> Result<(), OpenSledError> {
    let db_file = sled_dir.join("db");
    let file = match File::open(&db_file) {
        Ok(file) => file,
        // A new data dir: sled creates the file, nobody holds it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(OpenSledError::Io {
                dir: sled_dir.to_path_buf(),
                source,
            })
        }
    };
    // Dropping `file` on return releases the probe's lock (flock is per open file).
    match lock_within(&file, wait, || true) {
        Ok(waited) => {
            if waited > std::time::Duration::from_millis(50) {
                tracing::debug!(file = %db_file.display(), waited_ms = waited.as_millis() as u64, "sled's lock was released by a closing handle");
            }
            Ok(())
        }
        Err(LockWait::Held) => Err(OpenSledError::Locked {
            dir: sled_dir.to_path_buf(),
            holder: format!(
                "sled's lock on {} is still held after {} s, by a handle on this data dir left open in this process or by a program other than provledger",
                db_file.display(),
                wait.as_secs()
            ),
        }),
        Err(LockWait::Io(source)) => Err(OpenSledError::Io {
            dir: sled_dir.to_path_buf(),
            source,
        }),
    }
}

/// Why the data dir could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenSledError {
    #[error("data dir {dir} is locked by another provledger process ({holder}): a data dir is opened by one process at a time; if that process is `provledger serve`, ask it over NATS instead (`provledger --nats URL ...`, or `provledger query`)")]
    Locked { dir: PathBuf, holder: String },
    #[error("cannot open data dir {dir}: {source}")]
    Io {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot open sled database in {dir}: {source}")]
    Sled { dir: PathBuf, source: sled::Error },
    #[error("no provledger data dir at {} ({reason}); nothing was created, since a read never creates one. Point to the data dir with --data-dir DIR (or PROVLEDGER_DATA_DIR; the default is ./provledger-data in the current directory), or read a JetStream log with --nats URL; a data dir is created by the first write (`provledger append`) or by `provledger serve`", dir.display())]
    NoDataDir { dir: PathBuf, reason: &'static str },
}

#[derive(Debug, Clone, Copy)]
struct Head {
    version: u64,
    position: u64,
    hash: Hash,
}

impl Head {
    const EMPTY: Head = Head {
        version: 0,
        position: 0,
        hash: Hash::ZERO,
    };

    fn to_bytes(self) -> [u8; 48] {
        let mut b = [0u8; 48];
        b[..8].copy_from_slice(&self.version.to_be_bytes());
        b[8..16].copy_from_slice(&self.position.to_be_bytes());
        b[16..].copy_from_slice(&self.hash.0);
        b
    }

    fn from_bytes(b: &[u8]) -> Option<Head> {
        if b.len() != 48 {
            return None;
        }
        let mut hash = [0u8; 32];
        hash.copy_from_slice(&b[16..]);
        Some(Head {
            version: u64::from_be_bytes(b[..8].try_into().ok()?),
            position: u64::from_be_bytes(b[8..16].try_into().ok()?),
            hash: Hash(hash),
        })
    }
}

fn commit_key(position: u64) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[0] = b'c';
    k[1..].copy_from_slice(&position.to_be_bytes());
    k
}

fn head_key(aggregate: &AggregateId) -> [u8; 18] {
    let mut k = [0u8; 18];
    k[0] = b'h';
    k[1..].copy_from_slice(&aggregate.key_bytes());
    k
}

fn version_key(aggregate: &AggregateId, version: u64) -> [u8; 26] {
    let mut k = [0u8; 26];
    k[0] = b'v';
    k[1..18].copy_from_slice(&aggregate.key_bytes());
    k[18..].copy_from_slice(&version.to_be_bytes());
    k
}

fn commit_id_key(commit_id: &uuid::Uuid) -> [u8; 17] {
    let mut k = [0u8; 17];
    k[0] = b'i';
    k[1..].copy_from_slice(commit_id.as_bytes());
    k
}

fn be_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.try_into().ok()?))
}

fn unavailable(e: sled::Error) -> AppendError {
    AppendError::Unavailable {
        reason: format!("sled: {e}"),
    }
}

fn read_unavailable(e: sled::Error) -> ReadError {
    ReadError::Unavailable {
        reason: format!("sled: {e}"),
    }
}

struct Flusher {
    /// What the flusher is asked for. Both flags live under its lock: the flusher reads
    /// them and then waits while holding it, so a flag set without the lock between the
    /// two would go unheard (a close once hung that way, joining a flusher that waited).
    asked: Mutex<FlushAsked>,
    wake: Condvar,
}

#[derive(Default)]
struct FlushAsked {
    /// Set by appenders after their batch is applied; cleared by the flusher.
    flush: bool,
    /// Set once, by the close.
    stop: bool,
}

struct Shared {
    db: sled::Db,
    tree: sled::Tree,
    dir: PathBuf,
    append_lock: Mutex<()>,
    last_assigned: AtomicU64,
    durable: watch::Sender<u64>,
    flusher: Flusher,
    flushes: AtomicU64,
    /// Set for good by the first failed flush: after a failed fsync what is on disk is
    /// unknown, so no append waiting for it, and none after it, is acknowledged.
    flush_failure: Mutex<Option<String>>,
    /// Fault injection for tests: the next flush fails as if the disk had refused it.
    fail_next_flush: AtomicBool,
    /// Concurrent atomic sets waiting to share one sled batch (`group_commit.rs`).
    groups: GroupCommit,
    /// The data dir's lock. Declared last so that it is released only after `db` and
    /// `tree` (fields drop in declaration order): whoever takes the lock next finds no sled
    /// handle of ours still open on the dir.
    _lock: File,
}

impl Shared {
    fn flush_failure(&self) -> Option<String> {
        self.flush_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn refused_after_flush_failure(&self) -> Option<AppendError> {
        self.flush_failure().map(|reason| AppendError::Unavailable {
            reason: format!(
                "a sled flush failed ({reason}); what is on disk is unknown, so nothing more is acknowledged: restart to reopen the data dir, then run `provledger audit`"
            ),
        })
    }
}

/// The embedded event log. Cheap to clone; the flusher thread and the data-dir lock live
/// until the last clone is dropped or [`SledLog::close`] is called.
#[derive(Clone)]
pub struct SledLog {
    shared: Arc<Shared>,
    guard: Arc<CloseGuard>,
}

struct CloseGuard {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for CloseGuard {
    fn drop(&mut self) {
        self.shared
            .flusher
            .asked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .stop = true;
        self.shared.flusher.wake.notify_all();
        if let Ok(mut t) = self.thread.lock() {
            if let Some(handle) = t.take() {
                let _ = handle.join();
            }
        }
        // A final flush so that nothing applied is left only in memory.
        let _ = self.shared.db.flush();
    }
}

impl SledLog {
    /// Opens (or creates) the log in `dir`, taking an exclusive lock on it.
    /// Opens an existing data dir and refuses to create one: what a read-only command
    /// does, so that reading from the wrong directory leaves nothing behind.
    pub fn open_existing(dir: impl AsRef<Path>) -> Result<Self, OpenSledError> {
        let dir = dir.as_ref();
        let missing = |reason| OpenSledError::NoDataDir {
            // Where it looked, as the user can find it whatever the current directory.
            dir: std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf()),
            reason,
        };
        if !dir.is_dir() {
            return Err(missing("no such directory"));
        }
        if !dir.join(SLED_DIR).is_dir() {
            return Err(missing("the directory holds no sled database"));
        }
        Self::open(dir)
    }

    pub fn open(dir: impl AsRef<Path>) -> Result<Self, OpenSledError> {
        let dir = dir.as_ref().to_path_buf();
        let io = |source| OpenSledError::Io {
            dir: dir.clone(),
            source,
        };
        std::fs::create_dir_all(&dir).map_err(io)?;
        let lock_path = dir.join(LOCK_FILE);
        let mut lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&lock_path)
            .map_err(io)?;
        take_data_dir_lock(&dir, &lock, &lock_path, SLED_LOCK_RELEASE_WAIT)?;
        lock.set_len(0).map_err(io)?;
        write!(lock, "{}", std::process::id()).map_err(io)?;
        wait_for_sleds_own_lock(&dir.join(SLED_DIR), SLED_LOCK_RELEASE_WAIT)?;

        let db = sled::Config::new()
            .path(dir.join(SLED_DIR))
            // Durability comes from our explicit flushes, not from a timer.
            .flush_every_ms(None)
            .cache_capacity(SLED_CACHE_CAPACITY_BYTES)
            .open()
            .map_err(|source| OpenSledError::Sled {
                dir: dir.clone(),
                source,
            })?;
        let tree = db.open_tree("log").map_err(|source| OpenSledError::Sled {
            dir: dir.clone(),
            source,
        })?;
        let last = match tree.scan_prefix(b"c").next_back() {
            Some(Ok((k, _))) => be_u64(&k[1..]).unwrap_or(0),
            Some(Err(source)) => {
                return Err(OpenSledError::Sled {
                    dir: dir.clone(),
                    source,
                })
            }
            None => 0,
        };
        let (durable, _) = watch::channel(last);
        let shared = Arc::new(Shared {
            db,
            tree,
            dir: dir.clone(),
            append_lock: Mutex::new(()),
            last_assigned: AtomicU64::new(last),
            groups: GroupCommit::default(),
            durable,
            flusher: Flusher {
                asked: Mutex::new(FlushAsked::default()),
                wake: Condvar::new(),
            },
            flushes: AtomicU64::new(0),
            flush_failure: Mutex::new(None),
            fail_next_flush: AtomicBool::new(false),
            _lock: lock,
        });
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("provledger-sled-flush".into())
            .spawn(move || flush_loop(&thread_shared))
            .map_err(|source| OpenSledError::Io {
                dir: dir.clone(),
                source,
            })?;
        let guard = Arc::new(CloseGuard {
            shared: Arc::clone(&shared),
            thread: Mutex::new(Some(thread)),
        });
        tracing::debug!(dir = %shared.dir.display(), last_position = last, "sled log opened");
        Ok(SledLog { shared, guard })
    }

    /// The underlying database, for other trees that must live beside the log (the
    /// projection state). Never write to the `log` tree through it.
    pub fn db(&self) -> &sled::Db {
        &self.shared.db
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Fault injection for tests: makes the next group-commit flush fail as a refused
    /// fsync would.
    #[doc(hidden)]
    pub fn fail_next_flush(&self) {
        self.shared.fail_next_flush.store(true, Ordering::SeqCst);
    }

    /// How many `Db::flush` calls ran: the group-commit benchmark reports appends per flush.
    pub fn flush_count(&self) -> u64 {
        self.shared.flushes.load(Ordering::Relaxed)
    }

    /// Flushes and releases the data dir. Other clones become unusable for appends.
    pub fn close(self) {
        drop(self.guard);
    }

    /// Synchronous part of an append: decide, assign the position and apply one batch.
    fn apply(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        draft.validate(&aggregate)?;
        // Only provledger writes this log, in order: no version is ever lost from it, so
        // there is no loss to acknowledge (`crate::loss`).
        crate::loss::admits(&draft, &[])?;
        let _serial = self.serialise()?;
        let tree = &self.shared.tree;

        if let Some(pos) = tree
            .get(commit_id_key(&draft.commit_id))
            .map_err(unavailable)?
        {
            let position = be_u64(&pos).unwrap_or(0);
            return self.commit_at(position)?.retry_outcome(aggregate, &draft);
        }

        let head = self.head_of(&aggregate)?;
        if !expect.admits(head.version) {
            return Err(AppendError::Conflict {
                aggregate,
                expected: expect,
                actual: head.version,
            });
        }

        let version = head.version + 1;
        let commit_id = draft.commit_id;
        let commit = Commit::seal(aggregate, version, head.hash, draft);
        let bytes = encode_for_append(&commit)?;
        let position = self.shared.last_assigned.load(Ordering::SeqCst) + 1;
        let new_head = Head {
            version,
            position,
            hash: commit.hash,
        };

        let mut batch = sled::Batch::default();
        batch.insert(&commit_key(position), bytes);
        batch.insert(&head_key(&aggregate), &new_head.to_bytes()[..]);
        batch.insert(
            &version_key(&aggregate, version),
            &position.to_be_bytes()[..],
        );
        batch.insert(&commit_id_key(&commit_id), &position.to_be_bytes()[..]);
        tree.apply_batch(batch).map_err(unavailable)?;
        self.shared.last_assigned.store(position, Ordering::SeqCst);
        Ok(AppendOutcome {
            position,
            version,
            status: AppendStatus::Appended,
        })
    }

    /// The aggregate's head record (empty for an aggregate without commits).
    fn head_of(&self, aggregate: &AggregateId) -> Result<Head, AppendError> {
        match self
            .shared
            .tree
            .get(head_key(aggregate))
            .map_err(unavailable)?
        {
            Some(b) => Head::from_bytes(&b).ok_or(AppendError::Unavailable {
                reason: format!("head record of {aggregate} is corrupt; run `provledger audit`"),
            }),
            None => Ok(Head::EMPTY),
        }
    }

    /// Takes the append lock, unless a failed flush has made appending unsafe.
    fn serialise(&self) -> Result<std::sync::MutexGuard<'_, ()>, AppendError> {
        if let Some(refused) = self.shared.refused_after_flush_failure() {
            return Err(refused);
        }
        // Poisoning only happens if a holder panicked; the guarded data is `()`, so the
        // lock is still a valid serialisation point.
        Ok(self
            .shared
            .append_lock
            .lock()
            .unwrap_or_else(|p| p.into_inner()))
    }

    /// [`EventLog::append_atomic`] for a group of sets under the append lock: each set's
    /// checks first (a retry recognised, its expectations on the heads the sets before it
    /// in the group left), then one sled batch for every set admitted, so a crash keeps all
    /// of them or none. A set refused is answered alone; the others are written.
    fn apply_sets(&self, sets: Vec<Vec<AtomicItem>>) -> Vec<SetAnswer> {
        let count = sets.len();
        let _serial = match self.serialise() {
            Ok(serial) => serial,
            Err(e) => return (0..count).map(|_| Err(copy_unavailable(&e))).collect(),
        };
        let mut answers: Vec<Option<SetAnswer>> = (0..count).map(|_| None).collect();
        let mut heads: HashMap<AggregateId, Head> = HashMap::new();
        let mut batch = sled::Batch::default();
        let mut next = self.shared.last_assigned.load(Ordering::SeqCst) + 1;
        for (set, answer) in sets.into_iter().zip(answers.iter_mut()) {
            match self.stage_set(set, &mut heads, &mut batch, next) {
                Ok(Staged::Written(outcomes)) => {
                    next += outcomes.len() as u64;
                    *answer = Some(Ok(outcomes));
                }
                Ok(Staged::Answered(a)) => *answer = Some(a),
                Err(e) => *answer = Some(Err(e)),
            }
        }
        let written = next - 1;
        if written > self.shared.last_assigned.load(Ordering::SeqCst) {
            if let Err(e) = self.shared.tree.apply_batch(batch) {
                // Nothing of the batch was applied: every set staged in it is unwritten.
                let e = unavailable(e);
                for a in answers.iter_mut() {
                    if matches!(a, Some(Ok(o)) if o.iter().any(|o| o.status == AppendStatus::Appended))
                    {
                        *a = Some(Err(copy_unavailable(&e)));
                    }
                }
                return answers.into_iter().flatten().collect();
            }
            self.shared.last_assigned.store(written, Ordering::SeqCst);
        }
        let answers: Vec<SetAnswer> = answers.into_iter().flatten().collect();
        assert_eq!(answers.len(), count, "every set of a group is answered");
        answers
    }

    /// Stages one set into the group's batch at positions from `first`: written (its
    /// outcomes), or answered without writing (a retry recognised, a conflict).
    fn stage_set(
        &self,
        items: Vec<AtomicItem>,
        heads: &mut HashMap<AggregateId, Head>,
        batch: &mut sled::Batch,
        first: u64,
    ) -> Result<Staged, AppendError> {
        let tree = &self.shared.tree;
        let mut found = Vec::with_capacity(items.len());
        for item in &items {
            match tree
                .get(commit_id_key(&item.draft.commit_id))
                .map_err(unavailable)?
            {
                Some(pos) => found.push(Some(self.commit_at(be_u64(&pos).unwrap_or(0))?)),
                None => found.push(None),
            }
        }
        if found.iter().any(Option::is_some) {
            return Ok(Staged::Answered(recognise_batch_retry(&items, &found)));
        }
        let mut set_heads = Vec::with_capacity(items.len());
        let mut conflicts = Vec::new();
        for item in &items {
            let head = match heads.get(&item.aggregate) {
                Some(h) => *h,
                None => self.head_of(&item.aggregate)?,
            };
            if !item.expect.admits(head.version) {
                conflicts.push(VersionConflict {
                    aggregate: item.aggregate,
                    expected: item.expect,
                    actual: head.version,
                });
            }
            set_heads.push(head);
        }
        if !conflicts.is_empty() {
            return Ok(Staged::Answered(Err(AppendError::Conflicts { conflicts })));
        }
        let mut sealed = Vec::with_capacity(items.len());
        for (i, (item, head)) in items.into_iter().zip(set_heads).enumerate() {
            let position = first + i as u64;
            let version = head.version + 1;
            let commit = Commit::seal(item.aggregate, version, head.hash, item.draft);
            sealed.push((position, encode_for_append(&commit)?, commit));
        }
        // Every commit encodes before any is staged: a set is staged whole or not at all.
        let mut outcomes = Vec::with_capacity(sealed.len());
        for (position, bytes, commit) in sealed {
            let new_head = Head {
                version: commit.version,
                position,
                hash: commit.hash,
            };
            batch.insert(&commit_key(position), bytes);
            batch.insert(&head_key(&commit.aggregate), &new_head.to_bytes()[..]);
            batch.insert(
                &version_key(&commit.aggregate, commit.version),
                &position.to_be_bytes()[..],
            );
            batch.insert(
                &commit_id_key(&commit.commit_id),
                &position.to_be_bytes()[..],
            );
            heads.insert(commit.aggregate, new_head);
            outcomes.push(AppendOutcome {
                position,
                version: commit.version,
                status: AppendStatus::Appended,
            });
        }
        Ok(Staged::Written(outcomes))
    }

    /// The aggregate's durable commits from version `from` on, through the version index:
    /// the cost is what is read, not the aggregate's length.
    fn read_versions_from(
        &self,
        aggregate: &AggregateId,
        from: u64,
    ) -> Result<Vec<Commit>, ReadError> {
        let start = version_key(aggregate, from.max(1));
        let end = version_key(aggregate, u64::MAX);
        let durable = *self.shared.durable.borrow();
        let mut out = Vec::new();
        for item in self.shared.tree.range(start..=end) {
            let (_, pos) = item.map_err(read_unavailable)?;
            let position = be_u64(&pos).unwrap_or(0);
            if position > durable {
                break;
            }
            let bytes = self
                .shared
                .tree
                .get(commit_key(position))
                .map_err(read_unavailable)?;
            let bytes = bytes.ok_or(ReadError::Unavailable {
                reason: format!("index of {aggregate} points at missing position {position}"),
            })?;
            out.push(
                codec::decode(&bytes, position).map_err(|error| ReadError::Undecodable {
                    position,
                    subject: aggregate.to_string(),
                    error,
                    payload: bytes::Bytes::copy_from_slice(&bytes),
                })?,
            );
        }
        Ok(out)
    }

    fn commit_at(&self, position: u64) -> Result<Commit, AppendError> {
        let bytes = self
            .shared
            .tree
            .get(commit_key(position))
            .map_err(unavailable)?
            .ok_or(AppendError::Unavailable {
                reason: format!(
                    "index points at missing position {position}; run `provledger audit`"
                ),
            })?;
        codec::decode(&bytes, position).map_err(|error| AppendError::Corrupt { position, error })
    }

    async fn wait_durable(&self, position: u64) -> Result<(), AppendError> {
        self.shared
            .flusher
            .asked
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .flush = true;
        self.shared.flusher.wake.notify_one();
        let mut rx = self.shared.durable.subscribe();
        let shared = &self.shared;
        rx.wait_for(|d| *d >= position || shared.flush_failure().is_some())
            .await
            .map_err(|_| AppendError::Unavailable {
                reason: "sled log closed before the append was flushed".into(),
            })?;
        if *rx.borrow() >= position {
            return Ok(());
        }
        Err(self
            .shared
            .refused_after_flush_failure()
            .unwrap_or(AppendError::Unavailable {
                reason: "the append was not flushed".into(),
            }))
    }

    fn read_range(&self, from: u64, to: u64) -> Vec<Result<Commit, ReadError>> {
        let mut out = Vec::new();
        if from > to {
            return out;
        }
        for item in self
            .shared
            .tree
            .range(commit_key(from)..=commit_key(to))
            .take(READ_CHUNK_COMMITS_MAX)
        {
            match item {
                Ok((k, v)) => {
                    let position = be_u64(&k[1..]).unwrap_or(0);
                    out.push(
                        codec::decode(&v, position).map_err(|error| ReadError::Undecodable {
                            position,
                            subject: "sled".into(),
                            error,
                            payload: bytes::Bytes::copy_from_slice(&v),
                        }),
                    );
                }
                Err(e) => {
                    out.push(Err(read_unavailable(e)));
                    break;
                }
            }
        }
        out
    }

    /// A stream over `[from, end]`, where `end` is fixed (`Some`) or follows the durable
    /// position forever (`None`).
    fn stream(&self, from: u64, end: Option<u64>) -> CommitStream {
        struct State {
            log: SledLog,
            next: u64,
            end: Option<u64>,
            rx: watch::Receiver<u64>,
            buffer: std::collections::VecDeque<Result<Commit, ReadError>>,
        }
        let state = State {
            log: self.clone(),
            next: from.max(1),
            end,
            rx: self.shared.durable.subscribe(),
            buffer: Default::default(),
        };
        futures::stream::unfold(state, |mut st| async move {
            loop {
                if let Some(item) = st.buffer.pop_front() {
                    return Some((item, st));
                }
                let durable = *st.rx.borrow_and_update();
                let limit = st.end.map_or(durable, |e| e.min(durable));
                if st.next <= limit {
                    let chunk = st.log.read_range(st.next, limit);
                    if let Some(last) = chunk.iter().rev().find_map(|r| match r {
                        Ok(c) => Some(c.position),
                        Err(ReadError::Undecodable { position, .. }) => Some(*position),
                        Err(_) => None,
                    }) {
                        st.next = last + 1;
                    }
                    st.buffer.extend(chunk);
                    continue;
                }
                if st.end.is_some_and(|e| st.next > e) {
                    return None;
                }
                if st.rx.changed().await.is_err() {
                    return None;
                }
            }
        })
        .boxed()
    }
}

fn flush_loop(shared: &Shared) {
    loop {
        {
            let mut asked = shared
                .flusher
                .asked
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            while !asked.flush && !asked.stop {
                asked = shared
                    .flusher
                    .wake
                    .wait(asked)
                    .unwrap_or_else(|p| p.into_inner());
            }
            if !asked.flush && asked.stop {
                return;
            }
            asked.flush = false;
        }
        // Gather: appenders woken by the previous flush are still applying their batches;
        // a short pause lets one flush cover them instead of one flush per few appends.
        std::thread::sleep(FLUSH_GATHER);
        // Every append whose batch was applied before this load is covered by this flush.
        let target = shared.last_assigned.load(Ordering::SeqCst);
        let flushed = if shared.fail_next_flush.swap(false, Ordering::SeqCst) {
            Err(sled::Error::Io(std::io::Error::other(
                "injected flush failure",
            )))
        } else {
            shared.db.flush()
        };
        match flushed {
            Ok(_) => {
                shared.flushes.fetch_add(1, Ordering::Relaxed);
                shared.durable.send_if_modified(|d| {
                    if target > *d {
                        *d = target;
                        true
                    } else {
                        false
                    }
                });
            }
            Err(e) => {
                // Fatal: after a failed fsync a later one succeeding proves nothing about
                // the pages the failed one covered. Every waiter and every later append
                // is refused; the flusher stops.
                tracing::error!(error = %e, "sled flush failed; no append is acknowledged from now on");
                *shared
                    .flush_failure
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                shared.durable.send_modify(|_| {});
                return;
            }
        }
    }
}

/// What staging one set of a group came to.
enum Staged {
    Written(Vec<AppendOutcome>),
    Answered(SetAnswer),
}

/// The same unavailability for each set of a group (an `AppendError` is not `Clone`).
fn copy_unavailable(e: &AppendError) -> AppendError {
    AppendError::Unavailable {
        reason: e.to_string(),
    }
}

impl SetWriter for SledLog {
    async fn write_sets(&self, sets: Vec<Vec<AtomicItem>>) -> Vec<SetAnswer> {
        let count = sets.len();
        let log = self.clone();
        let answers = match tokio::task::spawn_blocking(move || log.apply_sets(sets)).await {
            Ok(answers) => answers,
            Err(e) => {
                return (0..count)
                    .map(|_| {
                        Err(AppendError::Unavailable {
                            reason: format!("the sled append task failed: {e}"),
                        })
                    })
                    .collect()
            }
        };
        // Acknowledged once the last of them is flushed (a retry of a set still waiting for
        // its flush included).
        let last = answers
            .iter()
            .flat_map(|a| a.iter().flatten().map(|o| o.position))
            .max();
        if let Some(last) = last {
            if let Err(e) = self.wait_durable(last).await {
                let e = copy_unavailable(&e);
                return answers
                    .into_iter()
                    .map(|a| a.and_then(|_| Err(copy_unavailable(&e))))
                    .collect();
            }
        }
        answers
    }

    fn group_commit(&self) -> &GroupCommit {
        &self.shared.groups
    }
}

impl SledLog {
    /// How many group writes of atomic sets this handle (and its clones) made, and how many
    /// sets they held.
    pub fn group_stats(&self) -> GroupStats {
        self.shared.groups.written()
    }
}

impl EventLog for SledLog {
    async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        // The append takes a std mutex and writes sled: blocking work, kept off the
        // async workers so that other tasks go on meanwhile.
        let log = self.clone();
        let outcome = tokio::task::spawn_blocking(move || log.apply(aggregate, expect, draft))
            .await
            .map_err(|e| AppendError::Unavailable {
                reason: format!("the sled append task failed: {e}"),
            })??;
        // A retry of a commit still waiting for its flush must not be acknowledged early.
        self.wait_durable(outcome.position).await?;
        Ok(outcome)
    }

    async fn append_atomic(
        &self,
        items: Vec<AtomicItem>,
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        validate_batch(items.iter().map(|i| (i.aggregate, &i.draft)))?;
        for item in &items {
            crate::loss::admits(&item.draft, &[])?;
        }
        group_commit::submit(self, items).await
    }

    async fn read_aggregate(&self, aggregate: AggregateId) -> Result<Vec<Commit>, ReadError> {
        self.read_versions_from(&aggregate, 1)
    }

    async fn read_aggregate_after(
        &self,
        aggregate: AggregateId,
        after: ChainTip,
    ) -> Result<Vec<Commit>, ReadError> {
        self.read_versions_from(&aggregate, after.version + 1)
    }

    async fn read_position(&self, position: u64) -> Result<Option<Commit>, ReadError> {
        if position > *self.shared.durable.borrow() {
            return Ok(None);
        }
        match self.commit_at(position) {
            Ok(c) => Ok(Some(c)),
            Err(e) => Err(ReadError::Unavailable {
                reason: e.to_string(),
            }),
        }
    }

    async fn find_commit(
        &self,
        aggregate: AggregateId,
        commit_id: uuid::Uuid,
    ) -> Result<Option<Commit>, ReadError> {
        // The permanent commit-id index answers at once, however old the commit.
        let Some(pos) = self
            .shared
            .tree
            .get(commit_id_key(&commit_id))
            .map_err(read_unavailable)?
        else {
            return Ok(None);
        };
        let position = be_u64(&pos).unwrap_or(0);
        if position > *self.shared.durable.borrow() {
            return Ok(None);
        }
        let commit = self
            .commit_at(position)
            .map_err(|e| ReadError::Unavailable {
                reason: e.to_string(),
            })?;
        Ok((commit.aggregate == aggregate).then_some(commit))
    }

    async fn read_all(&self, from: u64) -> Result<CommitStream, ReadError> {
        let end = *self.shared.durable.borrow();
        Ok(self.stream(from, Some(end)))
    }

    async fn subscribe(&self, from: u64) -> Result<CommitStream, ReadError> {
        Ok(self.stream(from, None))
    }

    async fn last_position(&self) -> Result<u64, ReadError> {
        Ok(*self.shared.durable.borrow())
    }
}
