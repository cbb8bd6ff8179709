//! The projection store: the sled copy of every commit, the projected entities, the
//! checkpoint, the quarantine, the time index and the snapshots, all in one sled tree so
//! that one `apply_batch` writes a whole projector batch atomically (sled applies a batch
//! on one tree all or nothing, also across a crash: it is a one-tree transaction).
//!
//! Key layout (one leading tag byte):
//! - `m` + name: metadata (`checkpoint`, `source`, `watermark`).
//! - `c` + position: the encoded commit, byte for byte what the codec writes.
//! - `h` + aggregate (17 bytes) + version: the position of that commit.
//! - `e` + aggregate: the entity, a format byte then bincode.
//! - `b` + consumer + provider: the allocation index by consumer.
//! - `q` + position: a quarantined log entry (JSON).
//! - `w` + time (ms) + position: where the time watermark rose, for `--at TIME`; the
//!   value packs the same batch's later rises (time key, position: 16 bytes each), empty
//!   for one rise (as every entry was before).
//! - `s` + snapshot position + aggregate: an entity as of a snapshot.
//! - `S` + snapshot position: the marker written last, once a snapshot is complete.
//! - `o` + operation: the status the operation indexes below were written with.
//! - `O` + status word + 0 + operation: operations by status (`operation list --status`).
//! - `k` + kind word + 0 + operation: operations by kind.
//! - `t` + target aggregate (17 bytes) + operation: operations by target.
//! - `n` + status word: how many operations are in that status (the metrics' gauge).
//! - `x` + kind tag + id bytes reversed: the id index, which finds an entity by the tail
//!   of its id (the short id people are shown) as `e` finds it by the head. Derived
//!   locally: written when an aggregate's first commit is folded, rebuilt from `e` when a
//!   store lacks it (an older one, an imported snapshot), never exported.
//!
//! The copy (`c`, `h`) is kept in this tree only where `m` `copies_log` is not 0: the
//! embedded store, and serve data dirs made before serve stopped copying. serve's store
//! (bootstrapped from a published snapshot or not) keeps none here: serve keeps its copy of
//! the stream in a tree of its own (`log_copy_packed`, its commits in packs and no `h`
//! index, written off the request path by its copier: `crate::log_copy`), unless
//! `--no-log-copy`. The readers of
//! history (`aggregate_commits`, `commits`, `raw_commits`, `entity_at`) read whichever
//! copy the data dir has; serve itself still reads history from the stream (its copy may
//! be a batch behind its projection).

use provledger_client::view::{StateView, ViewError};
use provledger_events::codec::{self, DecodeError};
use provledger_events::{
    check_chain, AggregateId, AggregateKind, Commit, HeldChain, IdRef, IntegrityError,
    LostVersions, Timestamp,
};
use provledger_projections::instance::InstanceState;
use provledger_projections::provider::ProviderState;
use provledger_projections::{Entity, Projection};
use uuid::Uuid;

/// The format byte in front of every stored entity. Bump it when entity state changes
/// shape; an older store is then rebuilt from its sled copy of the log.
/// 5: instances keep `task_lease_since`, when their current lease was granted.
/// 6: operations keep `started` (steps whose intent is recorded and outcome unknown),
/// instances their pending re-issues, providers whether their delete is a cascade.
/// 7: compensations keep `resolved` (an operator's `compensation_resolved`).
/// 8: operations keep `failed_at` and `finished_at` (the times of those commits).
/// 9: the same shape; an instance whose boot was rolled back no longer keeps its build task
/// and host (the fold changed, so stores are folded again for every replica to agree).
/// 10: every entity's header keeps `trace`, the trace context of its latest traced commit.
pub const ENTITY_FORMAT: u8 = 10;
/// The time index's layout: 2 = an entry at every commit where the watermark rose.
const TIME_INDEX_FORMAT: u8 = 2;
/// How many snapshots are kept; older ones are removed once a new one is complete.
pub const SNAPSHOTS_KEPT_MAX: usize = 3;
/// Entities per sled batch while writing a snapshot, so memory stays bounded.
const SNAPSHOT_CHUNK_ENTITIES: usize = 10_000;
const TREE: &str = "projection";
/// How many operations of one status [`ProjectionStore::oldest_started`] reads at most: a
/// scrape's cost stays bounded however many operations are stuck.
pub const OLDEST_SCAN_MAX: usize = 10_000;
/// The operation indexes' layout (`o`, `O`, `k`, `t`, `n`); a store without it, or with
/// another, has them rebuilt from its operation entities when it opens.
const OPERATION_INDEX_FORMAT: u8 = 1;
/// The id index's layout (`x`); a store without it has it rebuilt from `e` when it opens.
const ID_INDEX_FORMAT: u8 = 1;
/// How many ids [`ProjectionStore::resolve_ids`] returns at most: a short id that names
/// more is ambiguous whatever they are, and a person reads a list of ten.
pub const ID_MATCHES_MAX: usize = 10;

/// The ids of stored entities that an [`IdRef`] names (at most [`ID_MATCHES_MAX`], in id
/// order); `more`: others match too.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdMatches {
    pub ids: Vec<AggregateId>,
    pub more: bool,
}

/// Why the store could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error(
        "stored {what} is corrupt: {reason}; run `provledger replay` to rebuild from the sled copy"
    )]
    Corrupt { what: String, reason: String },
    #[error("stored commit at position {position} cannot be decoded: {error}")]
    Commit { position: u64, error: DecodeError },
    #[error(
        "this data dir holds the projection of {found}, not of {wanted}; use another --data-dir"
    )]
    SourceMismatch { found: String, wanted: String },
    #[error(transparent)]
    Integrity(#[from] IntegrityError),
    #[error(
        "this data dir is a serve replica's, which keeps no copy of the log (it ran with `--no-log-copy`, or before replicas kept one): the history is in the stream (ask serve: `--nats`)"
    )]
    HistoryNotCopied,
    /// The replica's copy of the stream begins after this aggregate's first commit (it
    /// was begun on a data dir that had none): its history here is not whole.
    #[error(
        "this data dir's copy of the stream starts at position {from}, after the first commit of {aggregate}: its history is not whole here (ask serve: `--nats`)"
    )]
    CopyStartsLate { from: u64, aggregate: AggregateId },
    /// A position past the end of the replica's copy of the stream.
    #[error(
        "this data dir's copy of the stream ends at position {through}, before position {wanted} (ask serve: `--nats`)"
    )]
    CopyEnds { through: u64, wanted: u64 },
    /// The snapshot's body is not a projection this build can import (refused, never
    /// partly used).
    #[error("cannot import a snapshot: {0}")]
    Import(String),
    #[error("cannot import a snapshot: this data dir already holds a projection")]
    NotFresh,
    /// Entities (or the time index) in an older layout, in a data dir without a whole copy
    /// of the log to fold them again from: a service's store is then reset
    /// ([`ProjectionStore::reset`]) and catches up from the stream.
    #[error(
        "this data dir holds a projection of an older format ({what}) and no copy of the log to rebuild it from: remove the data dir, or start `provledger serve` on it, which rebuilds it from the stream (or a snapshot)"
    )]
    OlderFormat { what: String },
}

/// The key tags a published snapshot carries: all of the projection's state, not the copy
/// of the log (`c`, `h`: the stream holds it) nor the local snapshots (`s`, `S`).
const EXPORTED_TAGS: &[u8] = b"mebqwoOktnl";
/// Keys per sled batch while importing a snapshot, so memory stays bounded. Smaller
/// batches are cheaper per key in sled 0.34 (150,000 keys of 1.6 kB written alone: 9.3 µs
/// per key in batches of 1,000, 11.8 µs in batches of 10,000).
const IMPORT_CHUNK_KEYS: usize = 1_000;

/// The layouts a store records under `m` (entities, time index, operation indexes) with
/// this build's version of each: a snapshot must carry the same ones to be imported, and
/// an abandoned import leaves them as `open` sets them on a new store.
fn layout_formats() -> [(Vec<u8>, u8, &'static str); 3] {
    [
        (key(b'm', &[b"entity_format"]), ENTITY_FORMAT, "entity"),
        (
            key(b'm', &[b"time_index_format"]),
            TIME_INDEX_FORMAT,
            "time index",
        ),
        (
            key(b'm', &[b"operation_index_format"]),
            OPERATION_INDEX_FORMAT,
            "operation index",
        ),
    ]
}

/// A log entry that could not be decoded, kept with its position and the error.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QuarantineRecord {
    pub position: u64,
    pub subject: String,
    pub error: String,
    pub payload_len: usize,
    /// The first bytes of the payload, hex, for forensics.
    pub payload_head_hex: String,
}

/// Everything one projector batch writes, applied atomically.
#[derive(Debug, Default)]
pub struct StoreBatch {
    pub commits: Vec<(u64, AggregateId, u64, Vec<u8>)>,
    pub entities: Vec<(AggregateId, Vec<u8>)>,
    /// (consumer, provider, whether the consumer now holds an allocation there)
    pub allocation_index: Vec<(Uuid, Uuid, bool)>,
    pub quarantine: Vec<QuarantineRecord>,
    /// (time ms, position) at every commit where the watermark rose, in position order
    pub watermark_rises: Vec<(i64, u64)>,
    /// Every operation written in this batch, for the operation indexes.
    pub operations: Vec<OperationIndexEntry>,
    /// Aggregates read past a loss (`provledger_events::loss`): their held chain as it
    /// stands, or `None` once it resumed.
    pub held: Vec<(AggregateId, Option<HeldChain>)>,
    /// Aggregates whose first commit this batch folds (new to the store), for the id index.
    pub created: Vec<AggregateId>,
    pub checkpoint: u64,
}

/// What the operation indexes hold of one operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OperationIndexEntry {
    pub id: Uuid,
    /// The status as JSON says it (`needs_attention`), `absent` before the first status.
    pub status: String,
    pub kind: Option<String>,
    pub target: Option<AggregateId>,
}

impl OperationIndexEntry {
    /// The index entry of `entity`, when it is an operation.
    pub fn of(entity: &Entity) -> Option<Self> {
        let Entity::Operation(o) = entity else {
            return None;
        };
        Some(OperationIndexEntry {
            id: o.header.id.id,
            status: entity.status_word(),
            kind: o.kind.and_then(|k| match serde_json::to_value(k) {
                Ok(serde_json::Value::String(s)) => Some(s),
                _ => None,
            }),
            target: o.target,
        })
    }
}

/// Which copy of the log a data dir holds ([`ProjectionStore::history_copy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HistoryCopy {
    /// No copy: history is in the stream only.
    None,
    /// The copy in the projection tree, written with each batch (embedded; old serve
    /// data dirs): whole, through the checkpoint.
    InProjection,
    /// serve's copy in its own tree, covering these positions.
    Separate(crate::log_copy::CopyExtent),
}

/// Which operation index a listing walks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OperationIndex {
    Status(String),
    Kind(String),
    Target(AggregateId),
}

/// Which operations a listing wants (`operation list`, `q.operation.list`); `None` fields
/// do not filter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OperationFilter {
    /// A status as JSON says it (`needs_attention`).
    pub status: Option<String>,
    /// A kind as JSON says it (`create_cluster`).
    pub kind: Option<String>,
    pub target: Option<AggregateId>,
    /// Only operations started at or after this time (their `started_at`).
    pub since: Option<Timestamp>,
}

impl OperationFilter {
    /// Whether `entity` is an operation this filter lists.
    pub fn accepts(&self, entity: &Entity) -> bool {
        let Entity::Operation(o) = entity else {
            return false;
        };
        self.status
            .as_deref()
            .is_none_or(|s| entity.status_word() == s)
            && self.kind.as_deref().is_none_or(|k| {
                serde_json::to_value(o.kind).ok() == Some(serde_json::Value::String(k.into()))
            })
            && self.target.is_none_or(|t| o.target == Some(t))
            && self
                .since
                .is_none_or(|since| o.header.created_at.is_some_and(|at| at >= since))
    }

    /// The most selective index the filter names: target, then status, then kind.
    fn index(&self) -> Option<OperationIndex> {
        match (&self.target, &self.status, &self.kind) {
            (Some(t), _, _) => Some(OperationIndex::Target(*t)),
            (None, Some(s), _) => Some(OperationIndex::Status(s.clone())),
            (None, None, Some(k)) => Some(OperationIndex::Kind(k.clone())),
            (None, None, None) => None,
        }
    }
}

#[derive(Clone)]
pub struct ProjectionStore {
    tree: sled::Tree,
    db: sled::Db,
    /// serve's copy of the stream (`crate::log_copy`), empty where none is kept.
    log_copy: sled::Tree,
}

/// A rewrite too large for one sled batch, applied in batches of [`IMPORT_CHUNK_KEYS`]
/// keys (sled's garbage reclaimed after each). A crash between batches leaves it in part:
/// each caller writes what says "done" in the last batch ([`Chunked::finish`]).
struct Chunked<'a> {
    tree: &'a sled::Tree,
    batch: sled::Batch,
    keys: usize,
}

impl<'a> Chunked<'a> {
    fn new(tree: &'a sled::Tree) -> Self {
        Chunked {
            tree,
            batch: sled::Batch::default(),
            keys: 0,
        }
    }

    fn insert(
        &mut self,
        k: impl Into<sled::IVec>,
        v: impl Into<sled::IVec>,
    ) -> Result<(), StoreError> {
        self.batch.insert(k, v);
        self.count()
    }

    fn remove(&mut self, k: impl Into<sled::IVec>) -> Result<(), StoreError> {
        self.batch.remove(k);
        self.count()
    }

    fn count(&mut self) -> Result<(), StoreError> {
        self.keys += 1;
        if self.keys == IMPORT_CHUNK_KEYS {
            self.tree.apply_batch(std::mem::take(&mut self.batch))?;
            reclaim_sled_garbage(self.keys);
            self.keys = 0;
        }
        Ok(())
    }

    /// Applies what is left, as one batch with what `last` adds to it.
    fn finish(mut self, last: impl FnOnce(&mut sled::Batch)) -> Result<(), StoreError> {
        last(&mut self.batch);
        self.tree.apply_batch(self.batch)?;
        // The few keys `last` adds are counted in the slack.
        reclaim_sled_garbage(self.keys + 4);
        Ok(())
    }
}

/// Removes every key of `tree` but those `stays` keeps, in chunks; `last` is written with
/// the last chunk.
fn remove_all_but(
    tree: &sled::Tree,
    stays: impl Fn(&[u8]) -> bool,
    last: impl FnOnce(&mut sled::Batch),
) -> Result<(), StoreError> {
    let mut chunked = Chunked::new(tree);
    for k in tree.iter().keys() {
        let k = k?;
        if !stays(&k) {
            chunked.remove(k)?;
        }
    }
    chunked.finish(last)
}

/// The id index's key of `id` (`x`): kind tag, then the id's bytes last first.
fn id_index_key(id: &AggregateId) -> Vec<u8> {
    let mut reversed = *id.id.as_bytes();
    reversed.reverse();
    key(b'x', &[&[id.kind.tag()], &reversed])
}

fn id_index_format_key() -> Vec<u8> {
    key(b'm', &[b"id_index_format"])
}

/// Bytes of an even number of hex digits (checked by [`IdRef`]'s grammar; anything else
/// stops it early: fewer bytes make a scan wider, never wrong, as each key is checked).
fn hex_bytes(digits: &str) -> Vec<u8> {
    digits
        .as_bytes()
        .chunks(2)
        .map_while(|pair| u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok())
        .collect()
}

fn key(tag: u8, parts: &[&[u8]]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + parts.iter().map(|p| p.len()).sum::<usize>());
    k.push(tag);
    for p in parts {
        k.extend_from_slice(p);
    }
    k
}

/// Frees the garbage sled left for epoch-based reclamation after writing `writes` keys in
/// one `apply_batch` on this thread.
///
/// sled 0.34 replaces a page on every write and hands the old one (often a whole leaf,
/// values included) to crossbeam-epoch's global collector, which a thread only drives
/// every 128 pins, freeing at most 512 objects then. `apply_batch` pins once for all its
/// keys, so the projector's batches (thousands of keys, a handful of pins) deferred far
/// more than was ever collected: serve's memory grew by kilobytes per commit without
/// bound, and `cache_capacity` could not bound it since that garbage is no longer in the
/// cache (`store-memory --epoch-flush` in provledger-tests measures it). Each flush seals
/// this thread's bag and frees up to 512 expired objects, and a bag expires two epoch
/// advances after it is sealed, so two flushes plus one per 256 keys collect at least
/// twice what the batch deferred. `sled::pin` is sled's own handle on that collector (sled
/// is pinned to =0.34.7), so this reaches the very collector sled defers to.
pub(crate) fn reclaim_sled_garbage(writes: usize) {
    for _ in 0..2 + writes / 256 {
        sled::pin().flush();
    }
}

/// The encoded commits of a data dir's copy of the log ([`ProjectionStore::raw_commits`]):
/// the projection's own (a key per commit) or serve's (packs), in position order.
pub enum RawCommits {
    Projection(sled::Iter),
    Copy(crate::log_copy::CopyEntries),
    /// The copy could not be opened for reading: the error, then nothing.
    Failed(Option<StoreError>),
}

impl Iterator for RawCommits {
    type Item = Result<(u64, sled::IVec), StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        match self {
            RawCommits::Projection(iter) => iter.next().map(projection_commit),
            RawCommits::Copy(entries) => entries.next(),
            RawCommits::Failed(e) => e.take().map(Err),
        }
    }
}

impl DoubleEndedIterator for RawCommits {
    fn next_back(&mut self) -> Option<Self::Item> {
        match self {
            RawCommits::Projection(iter) => iter.next_back().map(projection_commit),
            RawCommits::Copy(entries) => entries.next_back(),
            RawCommits::Failed(e) => e.take().map(Err),
        }
    }
}

fn projection_commit(
    entry: sled::Result<(sled::IVec, sled::IVec)>,
) -> Result<(u64, sled::IVec), StoreError> {
    let (k, v) = entry?;
    Ok((k.get(1..).and_then(be_u64).unwrap_or(0), v))
}

pub(crate) fn be_u64(bytes: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(bytes.get(..8)?.try_into().ok()?))
}

/// Order-preserving encoding of a signed time for keys.
fn time_key(ms: i64) -> [u8; 8] {
    ((ms as u64) ^ (1 << 63)).to_be_bytes()
}

/// The time a [`time_key`] encodes.
fn from_time_key(encoded: u64) -> i64 {
    (encoded ^ (1 << 63)) as i64
}

/// One watermark rise packed in a time-index entry: its time key, then its position.
const RISE_BYTES: usize = 16;

pub fn encode_entity(entity: &Entity) -> Result<Vec<u8>, StoreError> {
    let mut out = vec![ENTITY_FORMAT];
    let body = bincode::serde::encode_to_vec(entity, bincode::config::standard()).map_err(|e| {
        StoreError::Corrupt {
            what: format!("entity {}", entity.id()),
            reason: e.to_string(),
        }
    })?;
    out.extend_from_slice(&body);
    Ok(out)
}

fn decode_quarantine_record(
    entry: sled::Result<(sled::IVec, sled::IVec)>,
) -> Result<QuarantineRecord, StoreError> {
    let (_, v) = entry?;
    serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt {
        what: "quarantine record".into(),
        reason: e.to_string(),
    })
}

pub fn decode_entity(bytes: &[u8]) -> Result<Entity, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        what: "entity".into(),
        reason,
    };
    let (&format, body) = bytes.split_first().ok_or_else(|| corrupt("empty".into()))?;
    if format != ENTITY_FORMAT {
        return Err(corrupt(format!("unknown entity format {format}")));
    }
    let (entity, _) = bincode::serde::decode_from_slice(body, bincode::config::standard())
        .map_err(|e| corrupt(e.to_string()))?;
    Ok(entity)
}

impl ProjectionStore {
    /// Opens the store. A store written with an older entity format (the entity state
    /// changed shape) has its entities re-folded from its own sled copy of the log and its
    /// snapshots dropped, once, before anything reads it.
    pub fn open(db: &sled::Db) -> Result<Self, StoreError> {
        crate::log_copy::pack::pack_older_layout(db)?;
        let store = ProjectionStore {
            tree: db.open_tree(TREE)?,
            db: db.clone(),
            log_copy: db.open_tree(crate::log_copy::COPY_TREE)?,
        };
        let format_key = key(b'm', &[b"entity_format"]);
        let stored = match store.tree.get(&format_key)? {
            Some(v) => v.first().copied(),
            // Stores from before the format was recorded hold format 1, if anything.
            None if store.tree.scan_prefix([b'e']).next().is_some() => Some(1),
            None => None,
        };
        let refolded = stored.is_some_and(|f| f != ENTITY_FORMAT);
        let index_key = key(b'm', &[b"time_index_format"]);
        let indexed = store.tree.get(&index_key)?.and_then(|v| v.first().copied());
        let needs_copy = refolded || (stored.is_some() && indexed != Some(TIME_INDEX_FORMAT));
        if needs_copy && !store.copies_log()? {
            // Without a whole copy, neither can be rebuilt from the data dir.
            return Err(StoreError::OlderFormat {
                what: format!(
                    "entity format {}, time index format {}; this build's are {ENTITY_FORMAT} and {TIME_INDEX_FORMAT}",
                    stored.map_or("none".into(), |f| f.to_string()),
                    indexed.map_or("none".into(), |f| f.to_string()),
                ),
            });
        }
        if refolded {
            store.refold_entities(stored.unwrap_or(0))?;
        }
        store.tree.insert(format_key, &[ENTITY_FORMAT][..])?;
        if indexed != Some(TIME_INDEX_FORMAT) {
            store.rebuild_time_index()?;
            store.tree.insert(index_key, &[TIME_INDEX_FORMAT][..])?;
        }
        let op_index_key = key(b'm', &[b"operation_index_format"]);
        let op_indexed = store
            .tree
            .get(&op_index_key)?
            .and_then(|v| v.first().copied());
        // Re-folded entities may say another status than the one they were indexed under.
        if refolded || op_indexed != Some(OPERATION_INDEX_FORMAT) {
            store.rebuild_operation_indexes()?;
            store
                .tree
                .insert(op_index_key, &[OPERATION_INDEX_FORMAT][..])?;
        }
        if store.tree.get(id_index_format_key())?.as_deref() != Some(&[ID_INDEX_FORMAT][..]) {
            store.rebuild_id_index()?;
        }
        Ok(store)
    }

    /// Rewrites the id index (`x`) from the stored entities' keys, then records its format:
    /// a crash half-way leaves no format, and the next open rebuilds again.
    fn rebuild_id_index(&self) -> Result<(), StoreError> {
        let mut chunked = Chunked::new(&self.tree);
        for k in self.tree.scan_prefix([b'x']).keys() {
            chunked.remove(k?)?;
        }
        for k in self.tree.scan_prefix([b'e']).keys() {
            let k = k?;
            let id = k.get(1..18).and_then(|b| {
                let kind = AggregateKind::from_tag(b[0])?;
                Some(AggregateId::new(kind, Uuid::from_slice(&b[1..]).ok()?))
            });
            let Some(id) = id else {
                return Err(StoreError::Corrupt {
                    what: "an entity key".into(),
                    reason: format!("{} bytes, not a kind tag and a UUID", k.len()),
                });
            };
            chunked.insert(id_index_key(&id), &[][..])?;
        }
        chunked.finish(|batch| batch.insert(id_index_format_key(), &[ID_INDEX_FORMAT][..]))?;
        tracing::info!("id index rebuilt");
        Ok(())
    }

    /// The stored entities of `kind` (of any kind with `None`) whose id `r` names: for a
    /// short id, those whose id ends with its digits (the id index) or begins with them
    /// (the entity keys), each read by a range scan that stops at the
    /// [`ID_MATCHES_MAX`]-and-one-th match, so its cost does not grow with the store.
    pub fn resolve_ids(
        &self,
        kind: Option<AggregateKind>,
        r: &IdRef,
    ) -> Result<IdMatches, StoreError> {
        let kinds: Vec<AggregateKind> = match kind {
            Some(k) => vec![k],
            None => AggregateKind::ALL.to_vec(),
        };
        let mut found = std::collections::BTreeSet::new();
        for kind in kinds {
            match r {
                IdRef::Full(id) => {
                    let id = AggregateId::new(kind, *id);
                    if self.tree.contains_key(key(b'e', &[&id.key_bytes()]))? {
                        found.insert(id);
                    }
                }
                IdRef::Short(digits) => {
                    // Whole bytes of the digits narrow the scan; the rest is checked on
                    // each key (an odd digit, or the other end of the id).
                    let head = hex_bytes(&digits[..digits.len() / 2 * 2]);
                    let scan = self
                        .tree
                        .scan_prefix(key(b'e', &[&[kind.tag()], &head]))
                        .keys()
                        .map(|k| {
                            Ok::<_, StoreError>(Uuid::from_slice(k?.get(2..18).unwrap_or(&[])).ok())
                        });
                    self.collect_matches(scan, kind, r, &mut found)?;
                    let mut tail = hex_bytes(&digits[digits.len() % 2..]);
                    tail.reverse();
                    let scan = self
                        .tree
                        .scan_prefix(key(b'x', &[&[kind.tag()], &tail]))
                        .keys()
                        .map(|k| {
                            let k = k?;
                            let mut bytes: Vec<u8> = k.get(2..18).unwrap_or(&[]).to_vec();
                            bytes.reverse();
                            Ok(Uuid::from_slice(&bytes).ok())
                        });
                    self.collect_matches(scan, kind, r, &mut found)?;
                }
            }
        }
        let more = found.len() > ID_MATCHES_MAX;
        Ok(IdMatches {
            ids: found.into_iter().take(ID_MATCHES_MAX).collect(),
            more,
        })
    }

    /// Adds to `found` the ids of `scan` that `r` names, stopping once `found` holds more
    /// than [`ID_MATCHES_MAX`].
    fn collect_matches(
        &self,
        scan: impl Iterator<Item = Result<Option<Uuid>, StoreError>>,
        kind: AggregateKind,
        r: &IdRef,
        found: &mut std::collections::BTreeSet<AggregateId>,
    ) -> Result<(), StoreError> {
        for id in scan {
            if found.len() > ID_MATCHES_MAX {
                break;
            }
            let Some(id) = id? else {
                return Err(StoreError::Corrupt {
                    what: "an entity or id index key".into(),
                    reason: "not a kind tag and a UUID".into(),
                });
            };
            if r.matches(&id) {
                found.insert(AggregateId::new(kind, id));
            }
        }
        Ok(())
    }

    /// Empties a store that keeps no copy of the log (a service's) of everything it
    /// projected, keeping only which stream it follows: it is then a new replica's store
    /// in this build's formats, which catches up from position 1 (or a snapshot). For a
    /// store of an older format ([`StoreError::OlderFormat`]): what it held is derived
    /// from the stream, which keeps every commit. Refused on a store holding a copy (the
    /// embedded store: its log is its only copy of the commits).
    pub fn reset(db: &sled::Db) -> Result<(), StoreError> {
        let tree = db.open_tree(TREE)?;
        let copies = tree
            .get(key(b'm', &[b"copies_log"]))?
            .is_none_or(|v| v.first() != Some(&0));
        if copies {
            return Err(StoreError::Corrupt {
                what: "a store that holds a copy of the log".into(),
                reason: "it is not reset: its commits are not kept anywhere else".into(),
            });
        }
        let kept = [key(b'm', &[b"source"]), key(b'm', &[b"copies_log"])];
        remove_all_but(&tree, |k| kept.iter().any(|m| m.as_slice() == k), |_| {})?;
        db.flush()?;
        Ok(())
    }

    /// Rewrites the operation indexes and counts from the stored operation entities (a
    /// store from before they existed).
    fn rebuild_operation_indexes(&self) -> Result<(), StoreError> {
        let mut batch = sled::Batch::default();
        for tag in [b'o', b'O', b'k', b't', b'n'] {
            for k in self.tree.scan_prefix([tag]).keys() {
                batch.remove(k?);
            }
        }
        self.tree.apply_batch(batch)?;
        let mut entries = Vec::new();
        for entity in self.entities_of(AggregateKind::Operation, None) {
            entries.extend(OperationIndexEntry::of(&entity?));
            if entries.len() == SNAPSHOT_CHUNK_ENTITIES {
                let mut batch = sled::Batch::default();
                self.index_operations(&mut batch, std::mem::take(&mut entries), false)?;
                self.tree.apply_batch(batch)?;
            }
        }
        let mut batch = sled::Batch::default();
        self.index_operations(&mut batch, entries, false)?;
        self.tree.apply_batch(batch)?;
        tracing::info!("operation indexes rebuilt");
        Ok(())
    }

    /// Adds to `b` what moves each operation of `entries` to its index entries: its status
    /// (leaving the one it was indexed under), its kind and target, and the counts.
    /// Only the projector writes batches, so what it reads here is not raced.
    /// `live` (a projector batch, not a rebuild) logs each operation that enters
    /// `needs_attention` at WARN.
    fn index_operations(
        &self,
        b: &mut sled::Batch,
        entries: Vec<OperationIndexEntry>,
        live: bool,
    ) -> Result<(), StoreError> {
        let mut deltas: std::collections::BTreeMap<String, i64> = Default::default();
        // Within one batch an operation may appear once only (the projector writes each
        // dirty entity once), but `seen` keeps the counts right if that ever changes.
        let mut seen: std::collections::HashMap<Uuid, String> = Default::default();
        for entry in entries {
            let id = entry.id;
            let old = match seen.get(&id) {
                Some(status) => Some(status.clone()),
                None => self
                    .tree
                    .get(key(b'o', &[id.as_bytes()]))?
                    .map(|v| String::from_utf8_lossy(&v).into_owned()),
            };
            if old.as_deref() != Some(entry.status.as_str()) {
                if let Some(old) = &old {
                    b.remove(key(b'O', &[old.as_bytes(), &[0], id.as_bytes()]));
                    *deltas.entry(old.clone()).or_default() -= 1;
                }
                b.insert(
                    key(b'O', &[entry.status.as_bytes(), &[0], id.as_bytes()]),
                    &[][..],
                );
                *deltas.entry(entry.status.clone()).or_default() += 1;
                b.insert(key(b'o', &[id.as_bytes()]), entry.status.as_bytes());
                if live && entry.status == "needs_attention" {
                    tracing::warn!(operation = %id, kind = entry.kind.as_deref().unwrap_or("unknown"), "operation needs attention: its rollback stopped; see `provledger audit` and docs/operating.md");
                }
            }
            if old.is_none() {
                if let Some(kind) = &entry.kind {
                    b.insert(key(b'k', &[kind.as_bytes(), &[0], id.as_bytes()]), &[][..]);
                }
                if let Some(target) = &entry.target {
                    b.insert(key(b't', &[&target.key_bytes(), id.as_bytes()]), &[][..]);
                }
            }
            seen.insert(id, entry.status);
        }
        for (status, delta) in deltas {
            let k = key(b'n', &[status.as_bytes()]);
            let now = self.tree.get(&k)?.and_then(|v| be_u64(&v)).unwrap_or(0);
            let next = now.saturating_add_signed(delta);
            b.insert(k, &next.to_be_bytes()[..]);
        }
        Ok(())
    }

    /// How many operations are in each status, from the counts the projector keeps.
    pub fn operation_counts(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let mut out = Vec::new();
        for r in self.tree.scan_prefix([b'n']) {
            let (k, v) = r?;
            let status = String::from_utf8_lossy(&k[1..]).into_owned();
            out.push((status, be_u64(&v).unwrap_or(0)));
        }
        Ok(out)
    }

    /// The earliest `started_at` of the operations in `status` (a status word), among the
    /// first [`OLDEST_SCAN_MAX`] of its index in id order (UUID v7 ids: start order), for
    /// the metrics' age of the oldest operation in a status. `None` when there is none.
    pub fn oldest_started(&self, status: &str) -> Result<Option<Timestamp>, StoreError> {
        let filter = OperationFilter {
            status: Some(status.to_string()),
            ..OperationFilter::default()
        };
        let mut oldest: Option<Timestamp> = None;
        for entity in self.operations(&filter, None).take(OLDEST_SCAN_MAX) {
            if let Entity::Operation(o) = entity? {
                if let Some(at) = o.header.created_at {
                    oldest = Some(oldest.map_or(at, |t| t.min(at)));
                }
            }
        }
        Ok(oldest)
    }

    /// The operations `filter` accepts, in id order after `after`: read through the most
    /// selective index it names (never a scan of every operation when it names one).
    pub fn operations<'a>(
        &'a self,
        filter: &'a OperationFilter,
        after: Option<Uuid>,
    ) -> Box<dyn Iterator<Item = Result<Entity, StoreError>> + 'a> {
        let keep =
            move |r: &Result<Entity, StoreError>| r.as_ref().map_or(true, |e| filter.accepts(e));
        match filter.index() {
            Some(index) => Box::new(self.operations_in(index, after).filter(keep)),
            None => Box::new(
                self.entities_of(AggregateKind::Operation, after)
                    .filter(keep),
            ),
        }
    }

    /// The operations in the filter's most selective index (all operations when it names
    /// none), newest first (ids are UUID v7: id order is start order), before `before`.
    /// The filter's other conditions are the caller's ([`OperationFilter::accepts`]), so
    /// that it can bound how many it passes over. The console lists them so: an operator
    /// looks at what just happened.
    pub fn operations_newest_first<'a>(
        &'a self,
        filter: &OperationFilter,
        before: Option<Uuid>,
    ) -> Box<dyn Iterator<Item = Result<Entity, StoreError>> + 'a> {
        let (prefix, indexed) = match filter.index() {
            Some(OperationIndex::Status(s)) => (key(b'O', &[s.as_bytes(), &[0]]), true),
            Some(OperationIndex::Kind(k)) => (key(b'k', &[k.as_bytes(), &[0]]), true),
            Some(OperationIndex::Target(t)) => (key(b't', &[&t.key_bytes()]), true),
            None => (key(b'e', &[&[AggregateKind::Operation.tag()]]), false),
        };
        // Every key below the prefix is the prefix and a 16-byte id: the prefix followed by
        // 17 bytes of 0xFF sorts after all of them; `before`'s own key is excluded.
        let mut end = prefix.clone();
        match before {
            Some(id) => end.extend_from_slice(id.as_bytes()),
            None => end.extend_from_slice(&[0xFF; 17]),
        }
        let entries = self.tree.range(prefix..end).rev();
        Box::new(entries.filter_map(move |r| {
            let (k, v) = match r {
                Ok(kv) => kv,
                Err(e) => return Some(Err(e.into())),
            };
            if !indexed {
                return Some(decode_entity(&v));
            }
            let id = Uuid::from_slice(k.get(k.len().checked_sub(16)?..)?).ok()?;
            self.entity(&AggregateId::new(AggregateKind::Operation, id))
                .transpose()
        }))
    }

    /// Operations in `index` (in id order, after `after`), read through that index.
    fn operations_in(
        &self,
        index: OperationIndex,
        after: Option<Uuid>,
    ) -> impl Iterator<Item = Result<Entity, StoreError>> + '_ {
        let prefix = match &index {
            OperationIndex::Status(s) => key(b'O', &[s.as_bytes(), &[0]]),
            OperationIndex::Kind(k) => key(b'k', &[k.as_bytes(), &[0]]),
            OperationIndex::Target(t) => key(b't', &[&t.key_bytes()]),
        };
        let mut start = prefix.clone();
        if let Some(id) = after {
            // Just past `after`: its key with one more byte sorts right after it.
            start.extend_from_slice(id.as_bytes());
            start.push(0);
        }
        self.tree
            .range(start..)
            .take_while(move |r| r.as_ref().map_or(true, |(k, _)| k.starts_with(&prefix)))
            .filter_map(move |r| {
                let (k, _) = match r {
                    Ok(kv) => kv,
                    Err(e) => return Some(Err(e.into())),
                };
                let id = Uuid::from_slice(k.get(k.len().checked_sub(16)?..)?).ok()?;
                let aggregate = AggregateId::new(AggregateKind::Operation, id);
                self.entity(&aggregate).transpose()
            })
    }

    /// Rewrites the time index from the copy with an entry at every rise of the watermark
    /// (stores before format 2 kept one entry per batch, which made `--at TIME` depend on
    /// how a replica happened to batch).
    fn rebuild_time_index(&self) -> Result<(), StoreError> {
        let mut batch = sled::Batch::default();
        for k in self.tree.scan_prefix([b'w']).keys() {
            batch.remove(k?);
        }
        let mut watermark: Option<i64> = None;
        let mut rises = 0usize;
        for commit in self.commits(1, self.checkpoint()?) {
            let commit = commit?;
            let ms = commit.recorded_at.unix_ms();
            if watermark.is_none_or(|w| ms > w) {
                watermark = Some(ms);
                batch.insert(
                    key(b'w', &[&time_key(ms), &commit.position.to_be_bytes()]),
                    &[][..],
                );
                rises += 1;
            }
        }
        self.tree.apply_batch(batch)?;
        if rises > 0 {
            tracing::info!(rises, "time index rebuilt at commit granularity");
        }
        Ok(())
    }

    /// Re-derives every entity from the copy (per aggregate, through the history index)
    /// and drops the snapshots, which hold entities in the old format.
    fn refold_entities(&self, from_format: u8) -> Result<(), StoreError> {
        let checkpoint = self.checkpoint()?;
        tracing::info!(
            from_format,
            to_format = ENTITY_FORMAT,
            "re-folding stored entities from the sled copy"
        );
        let ids: Vec<AggregateId> = self
            .tree
            .scan_prefix([b'e'])
            .keys()
            .filter_map(|k| {
                let k = k.ok()?;
                let kind = AggregateKind::from_tag(*k.get(1)?)?;
                let id = Uuid::from_slice(k.get(2..18)?).ok()?;
                Some(AggregateId::new(kind, id))
            })
            .collect();
        let mut batch = sled::Batch::default();
        let mut in_batch = 0;
        for id in &ids {
            if let Some(entity) = self.entity_at(id, checkpoint)? {
                batch.insert(key(b'e', &[&id.key_bytes()]), encode_entity(&entity)?);
                in_batch += 1;
            }
            if in_batch == SNAPSHOT_CHUNK_ENTITIES {
                self.tree.apply_batch(std::mem::take(&mut batch))?;
                in_batch = 0;
            }
        }
        for prefix in [b's', b'S'] {
            for k in self.tree.scan_prefix([prefix]).keys() {
                batch.remove(k?);
            }
        }
        self.tree.apply_batch(batch)?;
        self.tree.flush()?;
        tracing::info!(entities = ids.len(), "stored entities re-folded");
        Ok(())
    }

    fn meta_u64(&self, name: &str) -> Result<Option<u64>, StoreError> {
        Ok(self
            .tree
            .get(key(b'm', &[name.as_bytes()]))?
            .and_then(|v| be_u64(&v)))
    }

    /// The position of the last log entry folded (or quarantined); 0 when empty.
    pub fn checkpoint(&self) -> Result<u64, StoreError> {
        Ok(self.meta_u64("checkpoint")?.unwrap_or(0))
    }

    /// Every key and value of the projection's state, for a published snapshot: the
    /// caller is the only writer and calls this between batches, so what it reads is the
    /// state at the checkpoint. Keys in order, each as (key length u32, key, value length
    /// u32, value), big-endian. Returns the checkpoint, the number of keys and the bytes.
    pub fn export_state(&self) -> Result<(u64, u64, Vec<u8>), StoreError> {
        let checkpoint = self.checkpoint()?;
        let mut out = Vec::new();
        let mut keys = 0u64;
        for &tag in EXPORTED_TAGS {
            for r in self.tree.scan_prefix([tag]) {
                let (k, v) = r?;
                for part in [&k[..], &v[..]] {
                    let len = u32::try_from(part.len()).map_err(|_| StoreError::Corrupt {
                        what: "a stored key or value".into(),
                        reason: "larger than 4 GiB".into(),
                    })?;
                    out.extend_from_slice(&len.to_be_bytes());
                    out.extend_from_slice(part);
                }
                keys += 1;
            }
        }
        Ok((checkpoint, keys, out))
    }

    /// Whether the projector writes a copy of each commit (`c`, `h`) into this store: true
    /// for the embedded store and for serve data dirs made before serve stopped copying;
    /// false for serve's since (the stream holds every commit and is read back instead).
    pub fn copies_log(&self) -> Result<bool, StoreError> {
        Ok(self
            .tree
            .get(key(b'm', &[b"copies_log"]))?
            .is_none_or(|v| v.first() != Some(&0)))
    }

    /// Which copy of the log this data dir holds for history: the one in the projection
    /// tree (through the checkpoint), serve's own (`crate::log_copy`, with its extent), or
    /// none.
    pub fn history_copy(&self) -> Result<HistoryCopy, StoreError> {
        if self.copies_log()? {
            return Ok(HistoryCopy::InProjection);
        }
        Ok(match crate::log_copy::extent_of(&self.log_copy)? {
            Some(extent) => HistoryCopy::Separate(extent),
            None => HistoryCopy::None,
        })
    }

    /// Makes a fresh store keep no copy of the log (serve's); a store that already holds
    /// one keeps copying, so that its copy stays whole.
    pub fn keep_no_copy(&self) -> Result<(), StoreError> {
        if self.is_fresh()? && self.tree.scan_prefix([b'c']).next().is_none() {
            self.tree.insert(key(b'm', &[b"copies_log"]), &[0u8][..])?;
        }
        Ok(())
    }

    /// Whether an import of a snapshot was cut short (by a crash): the next one starts over.
    pub fn import_incomplete(&self) -> Result<bool, StoreError> {
        Ok(self.tree.get(key(b'm', &[b"importing"]))?.is_some())
    }

    /// Whether nothing was ever projected into this store (a new replica's).
    pub fn is_fresh(&self) -> Result<bool, StoreError> {
        Ok(self.checkpoint()? == 0 && self.tree.scan_prefix([b'e']).next().is_none())
    }

    /// Writes an exported state ([`ProjectionStore::export_state`]) into this store, which
    /// must be fresh (or hold an import that did not finish: it is abandoned first), all
    /// but its checkpoint. The import stays unfinished (marked) until
    /// [`ProjectionStore::finish_import`], so that the snapshot can still be refused while
    /// it is written ([`ProjectionStore::abandon_import`]), and a crash half-way leaves a
    /// marked store that the next start abandons. `cancel` turning true stops it between
    /// chunks (the caller then abandons it). Returns the keys written.
    pub fn import_unfinished(
        &self,
        body: &[u8],
        cancel: &std::sync::atomic::AtomicBool,
    ) -> Result<u64, StoreError> {
        let marker = key(b'm', &[b"importing"]);
        if self.import_incomplete()? {
            self.abandon_import()?;
        } else if !self.is_fresh()? {
            return Err(StoreError::NotFresh);
        }
        let pairs = exported_pairs(body)?;
        // Indexes in another build's layout would be read as this build's: such a snapshot
        // is refused before anything is written (its `m` keys come first).
        for (format_key, ours, what) in layout_formats() {
            match pairs.iter().find(|(k, _)| *k == format_key.as_slice()) {
                Some((_, v)) if *v == [ours] => {}
                Some((_, v)) => {
                    return Err(StoreError::Import(format!(
                        "its {what} format is {v:?}, this build reads [{ours}]"
                    )))
                }
                None => {
                    return Err(StoreError::Import(format!(
                        "it does not say its {what} format"
                    )))
                }
            }
        }
        self.tree.insert(&marker, &[][..])?;
        let checkpoint_key = key(b'm', &[b"checkpoint"]);
        let mut batch = sled::Batch::default();
        let mut in_batch = 0;
        let mut keys = 0u64;
        for (k, v) in pairs {
            if !k.first().is_some_and(|t| EXPORTED_TAGS.contains(t)) {
                return Err(StoreError::Import(format!(
                    "key {} is not part of a projection's state",
                    k.first().copied().unwrap_or(0)
                )));
            }
            if k == checkpoint_key.as_slice() || k == marker.as_slice() {
                continue; // set by finish_import only
            }
            batch.insert(k, v);
            in_batch += 1;
            keys += 1;
            if in_batch == IMPORT_CHUNK_KEYS {
                self.tree.apply_batch(std::mem::take(&mut batch))?;
                reclaim_sled_garbage(in_batch);
                in_batch = 0;
                if cancel.load(std::sync::atomic::Ordering::Relaxed) {
                    return Ok(keys);
                }
            }
        }
        self.tree.apply_batch(batch)?;
        reclaim_sled_garbage(in_batch);
        Ok(keys)
    }

    /// Finishes an import ([`ProjectionStore::import_unfinished`]) of a snapshot taken at
    /// `position`: the checkpoint set, no copy of the log kept and the marker removed in
    /// one batch, then flushed. From here the store is an ordinary one at `position`.
    pub fn finish_import(&self, position: u64) -> Result<(), StoreError> {
        // The id index is not exported: it is built here from the imported entities.
        self.rebuild_id_index()?;
        let mut batch = sled::Batch::default();
        batch.insert(key(b'm', &[b"checkpoint"]), &position.to_be_bytes()[..]);
        batch.insert(key(b'm', &[b"copies_log"]), &[0u8][..]);
        batch.remove(key(b'm', &[b"importing"]));
        self.tree.apply_batch(batch)?;
        self.flush()
    }

    /// Removes what an unfinished import wrote (a refused snapshot, a crash half-way): the
    /// store is then as a new service store is, claimed by the same stream, keeping no copy,
    /// and in this build's formats, so that the replica can catch up from position 1 into
    /// it (and open it again later). Keys go in batches with the marker last (sled's
    /// `clear` is a loop of single removes, not one write): a crash half-way leaves the
    /// marker, and the next start abandons again. The format keys stay until the last batch,
    /// which sets them as `open` does on a new store, so that a store opened half-abandoned
    /// is never taken for one of an older format.
    pub fn abandon_import(&self) -> Result<(), StoreError> {
        let marker = key(b'm', &[b"importing"]);
        let formats = layout_formats();
        let kept = [
            key(b'm', &[b"source"]),
            key(b'm', &[b"copies_log"]),
            id_index_format_key(),
        ];
        let stays = |k: &[u8]| {
            k == marker.as_slice()
                || kept.iter().any(|m| m.as_slice() == k)
                || formats.iter().any(|(m, ..)| m.as_slice() == k)
        };
        remove_all_but(&self.tree, stays, |batch| {
            for (k, format, _) in &formats {
                batch.insert(k.as_slice(), &[*format][..]);
            }
            batch.remove(marker.as_slice());
        })?;
        self.flush()
    }

    /// The highest `recorded_at` folded so far (ms), which the time index is built on.
    pub fn watermark(&self) -> Result<Option<i64>, StoreError> {
        Ok(self.meta_u64("watermark")?.map(|v| v as i64))
    }

    /// Which log this store copies: `embedded`, or `jetstream:<stream>`.
    /// Refuses an embedded write into a service's data dir: the directory copies a
    /// JetStream stream (its store's source is not `embedded`), and an embedded append
    /// there would invent positions that collide with the stream's. `Ok(None)`: writable;
    /// `Ok(Some(source))`: the stream it copies.
    pub fn copied_stream(db: &sled::Db) -> Result<Option<String>, StoreError> {
        let store = ProjectionStore::open(db)?;
        Ok(store.source()?.filter(|s| s != "embedded"))
    }

    pub fn source(&self) -> Result<Option<String>, StoreError> {
        Ok(self
            .tree
            .get(key(b'm', &[b"source"]))?
            .map(|v| String::from_utf8_lossy(&v).into_owned()))
    }

    /// Records the source on first use and refuses a store that copies another log,
    /// whose positions would not line up.
    pub fn claim_source(&self, wanted: &str) -> Result<(), StoreError> {
        match self.source()? {
            Some(found) if found != wanted => Err(StoreError::SourceMismatch {
                found,
                wanted: wanted.to_string(),
            }),
            Some(_) => Ok(()),
            None => {
                self.tree
                    .insert(key(b'm', &[b"source"]), wanted.as_bytes())?;
                Ok(())
            }
        }
    }

    /// Every aggregate the projector holds past a loss, with its held chain.
    pub fn held_chains(&self) -> Result<Vec<(AggregateId, HeldChain)>, StoreError> {
        let mut out = Vec::new();
        for r in self.tree.scan_prefix([b'l']) {
            let (_, v) = r?;
            let chain: HeldChain = serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt {
                what: "a held chain".into(),
                reason: e.to_string(),
            })?;
            let aggregate =
                chain
                    .held
                    .first()
                    .map(|c| c.aggregate)
                    .ok_or_else(|| StoreError::Corrupt {
                        what: "a held chain".into(),
                        reason: "it holds no commit".into(),
                    })?;
            out.push((aggregate, chain));
        }
        Ok(out)
    }

    /// The loss that keeps `id` from being read, if the projector holds it past one: what
    /// a query answers (`integrity`) instead of a state folded before the loss.
    pub fn open_loss(&self, id: &AggregateId) -> Result<Option<LostVersions>, StoreError> {
        let Some(v) = self.tree.get(key(b'l', &[&id.key_bytes()]))? else {
            return Ok(None);
        };
        let chain: HeldChain = serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt {
            what: format!("the held chain of {id}"),
            reason: e.to_string(),
        })?;
        Ok(chain.open.first().copied())
    }

    pub fn entity(&self, id: &AggregateId) -> Result<Option<Entity>, StoreError> {
        self.tree
            .get(key(b'e', &[&id.key_bytes()]))?
            .map(|v| decode_entity(&v))
            .transpose()
    }

    /// Writes one projector batch atomically: copy, entities, indexes, quarantine and the
    /// checkpoint together.
    pub fn write_batch(&self, batch: StoreBatch) -> Result<(), StoreError> {
        let mut b = sled::Batch::default();
        // What the batch writes, at most (the operation indexes add a few per operation).
        let writes = 2 * batch.commits.len()
            + batch.entities.len()
            + batch.allocation_index.len()
            + batch.quarantine.len()
            + batch.watermark_rises.len()
            + 5 * batch.operations.len()
            + batch.held.len()
            + batch.created.len()
            + 2;
        for (position, aggregate, version, bytes) in batch.commits {
            let pos = position.to_be_bytes();
            b.insert(key(b'c', &[&pos]), bytes);
            b.insert(
                key(b'h', &[&aggregate.key_bytes(), &version.to_be_bytes()]),
                &pos[..],
            );
        }
        for (id, bytes) in batch.entities {
            b.insert(key(b'e', &[&id.key_bytes()]), bytes);
        }
        for id in batch.created {
            b.insert(id_index_key(&id), &[][..]);
        }
        for (consumer, provider, present) in batch.allocation_index {
            let k = key(b'b', &[consumer.as_bytes(), provider.as_bytes()]);
            if present {
                b.insert(k, &[][..]);
            } else {
                b.remove(k);
            }
        }
        for record in batch.quarantine {
            let json = serde_json::to_vec(&record).expect("a quarantine record: plain serde data (string keys, no fallible impls) encodes as JSON");
            b.insert(key(b'q', &[&record.position.to_be_bytes()]), json);
        }
        // The batch's rises as one entry: keyed by the first, the rest in its value (a
        // sled insert costs 5-10 µs whatever its size; one per rise was one per commit).
        if let Some(((ms, position), rest)) = batch.watermark_rises.split_first() {
            let mut packed = Vec::with_capacity(rest.len() * RISE_BYTES);
            for (ms, position) in rest {
                packed.extend_from_slice(&time_key(*ms));
                packed.extend_from_slice(&position.to_be_bytes());
            }
            b.insert(
                key(b'w', &[&time_key(*ms), &position.to_be_bytes()]),
                packed,
            );
        }
        if let Some((ms, _)) = batch.watermark_rises.last() {
            b.insert(key(b'm', &[b"watermark"]), &(*ms as u64).to_be_bytes()[..]);
        }
        self.index_operations(&mut b, batch.operations, true)?;
        for (id, chain) in batch.held {
            let k = key(b'l', &[&id.key_bytes()]);
            match chain {
                Some(chain) => b.insert(
                    k,
                    serde_json::to_vec(&chain).expect("a held chain: plain serde data (string keys, no fallible impls) encodes as JSON"),
                ),
                None => b.remove(k),
            }
        }
        b.insert(
            key(b'm', &[b"checkpoint"]),
            &batch.checkpoint.to_be_bytes()[..],
        );
        self.tree.apply_batch(b)?;
        reclaim_sled_garbage(writes);
        Ok(())
    }

    /// Makes everything written so far durable.
    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush()?;
        Ok(())
    }

    /// The encoded commits of the copy from `from` to `to` inclusive, undecoded.
    pub fn raw_commits(&self, from: u64, to: u64) -> RawCommits {
        match self.copies_log() {
            Ok(false) => match crate::log_copy::pack::read(&self.log_copy, from, to) {
                Ok(entries) => RawCommits::Copy(entries),
                Err(e) => RawCommits::Failed(Some(e)),
            },
            // A store that copies in its own tree, or one unreadable: its own tree
            // (reading it then says what is wrong).
            _ => RawCommits::Projection(
                self.tree
                    .range(key(b'c', &[&from.to_be_bytes()])..=key(b'c', &[&to.to_be_bytes()])),
            ),
        }
    }

    /// serve's copy's (`crate::log_copy`) encoded commits from `from` to `to` inclusive,
    /// positions and bytes: for a reader that checks each one itself (`q.changes`).
    pub(crate) fn raw_copy_range(
        &self,
        from: u64,
        to: u64,
    ) -> Result<crate::log_copy::CopyEntries, StoreError> {
        crate::log_copy::pack::read(&self.log_copy, from, to)
    }

    /// The decoded commits of the copy from `from` to `to` inclusive. A copy that no longer
    /// decodes was damaged after it was written: an integrity error naming its aggregate.
    pub fn commits(
        &self,
        from: u64,
        to: u64,
    ) -> impl Iterator<Item = Result<Commit, StoreError>> + '_ {
        self.raw_commits(from, to).map(move |r| {
            let (position, bytes) = r?;
            codec::decode(&bytes, position).map_err(|error| match self.locate(position) {
                Some((aggregate, version)) => StoreError::Integrity(IntegrityError {
                    aggregate,
                    version,
                    position,
                    problem: format!("the copy cannot be decoded: {error}"),
                }),
                None => StoreError::Commit { position, error },
            })
        })
    }

    /// The aggregate of each commit of the copy from `from` to `to` inclusive, decoding
    /// only what precedes it in the encoding (for scans that only sort commits by kind).
    pub fn commit_aggregates(
        &self,
        from: u64,
        to: u64,
    ) -> impl Iterator<Item = Result<AggregateId, StoreError>> + '_ {
        self.raw_commits(from, to).map(|r| {
            let (position, bytes) = r?;
            codec::decode_aggregate(&bytes).map_err(|error| StoreError::Commit { position, error })
        })
    }

    /// Which aggregate and version the copy's commit at `position` is, from the history
    /// index of the projection's own copy (serve's copy keeps none). A scan: only for
    /// naming a damaged commit.
    fn locate(&self, position: u64) -> Option<(AggregateId, u64)> {
        self.tree.scan_prefix([b'h']).find_map(|r| {
            let (k, v) = r.ok()?;
            if be_u64(&v)? != position {
                return None;
            }
            let kind = AggregateKind::from_tag(*k.get(1)?)?;
            let id = Uuid::from_slice(k.get(2..18)?).ok()?;
            Some((AggregateId::new(kind, id), be_u64(k.get(18..)?)?))
        })
    }

    /// One aggregate's commits up to `to` (inclusive), oldest first. A bootstrapped store
    /// does not copy the history before its snapshot: `HistoryNotCopied`.
    pub fn aggregate_commits(&self, id: &AggregateId, to: u64) -> Result<Vec<Commit>, StoreError> {
        let extent = match self.history_copy()? {
            HistoryCopy::None => return Err(StoreError::HistoryNotCopied),
            HistoryCopy::InProjection => None,
            HistoryCopy::Separate(extent) => Some(extent),
        };
        let found: Vec<(u64, Option<sled::IVec>)> = match extent {
            // The projection's own copy has a per-commit index of each aggregate.
            None => self
                .tree
                .scan_prefix(key(b'h', &[&id.key_bytes()]))
                .values()
                .filter_map(|v| v.map(|v| be_u64(&v)).transpose())
                .take_while(|p| p.as_ref().map_or(true, |p| *p <= to))
                .map(|p| p.map(|p| (p, None)))
                .collect::<Result<_, _>>()?,
            // serve's copy has none (`crate::log_copy`): its commits are looked through,
            // decoding each one's aggregate only, as an offline read can afford.
            Some(extent) => {
                let mut found = Vec::new();
                for r in self.raw_commits(extent.from, to.min(extent.through)) {
                    let (position, bytes) = r?;
                    // One that does not decode is named by the audit, not here.
                    if codec::decode_aggregate(&bytes).is_ok_and(|a| a == *id) {
                        found.push((position, Some(bytes)));
                    }
                }
                found
            }
        };
        let mut out: Vec<Commit> = Vec::new();
        for (position, bytes) in found {
            let version = out.len() as u64 + 1;
            let damaged = |problem: String| IntegrityError {
                aggregate: *id,
                version,
                position,
                problem,
            };
            let bytes = match bytes {
                Some(bytes) => bytes,
                None => self
                    .tree
                    .get(key(b'c', &[&position.to_be_bytes()]))?
                    .ok_or_else(|| damaged("the copy has no commit at this position".into()))?,
            };
            let commit = codec::decode(&bytes, position)
                .map_err(|error| damaged(format!("cannot be decoded: {error}")))?;
            out.push(commit);
        }
        // A copy begun after this aggregate's first commit holds the rest of its chain
        // only: never shown as if it were whole.
        if let (Some(extent), Some(first)) = (extent, out.first()) {
            if !extent.is_whole() && first.version != 1 {
                return Err(StoreError::CopyStartsLate {
                    from: extent.from,
                    aggregate: *id,
                });
            }
        }
        // What is served must be what was written: the chain is checked on every read.
        check_chain(id, &out)?;
        Ok(out)
    }

    /// One aggregate's state at position `at`, folded from its own commits: each commit
    /// changes one entity only, so no other aggregate is needed.
    pub fn entity_at(&self, id: &AggregateId, at: u64) -> Result<Option<Entity>, StoreError> {
        if let HistoryCopy::Separate(extent) = self.history_copy()? {
            if at > extent.through {
                return Err(StoreError::CopyEnds {
                    through: extent.through,
                    wanted: at,
                });
            }
        }
        Ok(Entity::fold(*id, &self.aggregate_commits(id, at)?))
    }

    /// Entities of one kind in id order, starting after `after`.
    pub fn entities_of(
        &self,
        kind: AggregateKind,
        after: Option<Uuid>,
    ) -> impl Iterator<Item = Result<Entity, StoreError>> {
        let prefix = key(b'e', &[&[kind.tag()]]);
        let start = match after {
            // Just past `after`: its key with one more byte sorts right after it.
            Some(id) => key(b'e', &[&[kind.tag()], id.as_bytes(), &[0]]),
            None => prefix.clone(),
        };
        self.tree
            .range(start..)
            .take_while(move |r| r.as_ref().map_or(true, |(k, _)| k.starts_with(&prefix)))
            .map(|r| decode_entity(&r?.1))
    }

    /// Every entity.
    pub fn all_entities(&self) -> impl Iterator<Item = Result<Entity, StoreError>> {
        self.tree.scan_prefix([b'e']).map(|r| decode_entity(&r?.1))
    }

    /// The providers where `consumer` holds an allocation.
    pub fn providers_of_consumer(&self, consumer: &Uuid) -> Result<Vec<Uuid>, StoreError> {
        let mut out = Vec::new();
        for r in self.tree.scan_prefix(key(b'b', &[consumer.as_bytes()])) {
            let (k, _) = r?;
            if let Some(bytes) = k.get(17..33).and_then(|b| <[u8; 16]>::try_from(b).ok()) {
                out.push(Uuid::from_bytes(bytes));
            }
        }
        Ok(out)
    }

    pub fn quarantined(&self) -> Result<Vec<QuarantineRecord>, StoreError> {
        self.quarantined_first(usize::MAX)
    }

    /// The positions quarantined from `from` to `to` (inclusive): a range scan of the
    /// quarantine's keys.
    pub fn quarantined_between(
        &self,
        from: u64,
        to: u64,
    ) -> Result<std::collections::HashSet<u64>, StoreError> {
        let mut out = std::collections::HashSet::new();
        let start = key(b'q', &[&from.to_be_bytes()]);
        let end = key(b'q', &[&to.to_be_bytes()]);
        for k in self.tree.range(start..=end).keys() {
            if let Some(position) = k?.get(1..9).and_then(be_u64) {
                out.insert(position);
            }
        }
        Ok(out)
    }

    /// The first `n` quarantine records, in position order (a page's worth).
    pub fn quarantined_first(&self, n: usize) -> Result<Vec<QuarantineRecord>, StoreError> {
        self.tree
            .scan_prefix([b'q'])
            .take(n)
            .map(decode_quarantine_record)
            .collect()
    }

    /// The quarantine records from position `from` to `to` inclusive, in position order,
    /// read as they are taken (however many a hostile publisher made).
    pub fn quarantine_records(
        &self,
        from: u64,
        to: u64,
    ) -> impl DoubleEndedIterator<Item = Result<QuarantineRecord, StoreError>> {
        let start = key(b'q', &[&from.to_be_bytes()]);
        let end = key(b'q', &[&to.to_be_bytes()]);
        self.tree.range(start..=end).map(decode_quarantine_record)
    }

    pub fn quarantine_count(&self) -> usize {
        self.tree.scan_prefix([b'q']).count()
    }

    /// The last position whose time watermark is at or before `at`: the state "as of"
    /// a time is the log prefix that had been recorded by then. Writers' clocks are not
    /// monotonic across aggregates, so the watermark is the running maximum.
    pub fn position_at_time(&self, at: Timestamp) -> Result<u64, StoreError> {
        let at_ms = at.unix_ms();
        let after = key(b'w', &[&time_key(at_ms.saturating_add(1))]);
        // The first rise after `at` is in the last entry starting at or before it (a batch's
        // rises packed in its value), or else it starts the next entry.
        if let Some(r) = self.tree.range(key(b'w', &[])..after.clone()).next_back() {
            let (_, packed) = r?;
            for rise in packed.chunks_exact(RISE_BYTES) {
                let (ms, position) = (be_u64(rise).map(from_time_key), be_u64(&rise[8..]));
                if let (Some(ms), Some(position)) = (ms, position) {
                    if ms > at_ms {
                        return Ok(position.saturating_sub(1));
                    }
                }
            }
        }
        let end = key(b'x', &[]);
        match self.tree.range(after..end).next() {
            Some(r) => {
                let (k, _) = r?;
                Ok(be_u64(&k[9..]).unwrap_or(1).saturating_sub(1))
            }
            None => self.checkpoint(),
        }
    }

    /// The positions of the complete snapshots, oldest first.
    pub fn snapshots(&self) -> Result<Vec<u64>, StoreError> {
        let mut out = Vec::new();
        for r in self.tree.scan_prefix([b'S']) {
            let (k, _) = r?;
            if let Some(p) = be_u64(&k[1..]) {
                out.push(p);
            }
        }
        Ok(out)
    }

    /// Copies every entity as a snapshot at `position` (which must be the checkpoint:
    /// the caller is the only writer and calls this between batches). The marker goes
    /// last, so a crash half-way leaves an incomplete snapshot that is never used and is
    /// removed by the next prune.
    pub fn write_snapshot(&self, position: u64) -> Result<usize, StoreError> {
        let pos = position.to_be_bytes();
        let mut batch = sled::Batch::default();
        let mut in_batch = 0;
        let mut total = 0;
        for r in self.tree.scan_prefix([b'e']) {
            let (k, v) = r?;
            batch.insert(key(b's', &[&pos, &k[1..]]), v);
            in_batch += 1;
            total += 1;
            if in_batch == SNAPSHOT_CHUNK_ENTITIES {
                self.tree.apply_batch(std::mem::take(&mut batch))?;
                reclaim_sled_garbage(in_batch);
                in_batch = 0;
            }
        }
        batch.insert(key(b'S', &[&pos]), &[][..]);
        self.tree.apply_batch(batch)?;
        reclaim_sled_garbage(in_batch + 1);
        self.prune_snapshots()?;
        Ok(total)
    }

    fn prune_snapshots(&self) -> Result<(), StoreError> {
        let complete = self.snapshots()?;
        let keep: Vec<u64> = complete
            .iter()
            .rev()
            .take(SNAPSHOTS_KEPT_MAX)
            .copied()
            .collect();
        let mut doomed: Vec<sled::IVec> = Vec::new();
        for r in self.tree.scan_prefix([b's']) {
            let (k, _) = r?;
            if !keep.contains(&be_u64(&k[1..]).unwrap_or(0)) {
                doomed.push(k);
            }
        }
        let mut batch = sled::Batch::default();
        for p in complete.iter().filter(|p| !keep.contains(p)) {
            batch.remove(key(b'S', &[&p.to_be_bytes()]));
        }
        let writes = doomed.len() + complete.len();
        for k in doomed {
            batch.remove(k);
        }
        self.tree.apply_batch(batch)?;
        reclaim_sled_garbage(writes);
        Ok(())
    }

    /// The newest complete snapshot at or before `position`, loaded.
    pub fn load_snapshot(&self, position: u64) -> Result<Option<Projection>, StoreError> {
        let Some(at) = self
            .snapshots()?
            .into_iter()
            .filter(|p| *p <= position)
            .max()
        else {
            return Ok(None);
        };
        let mut projection = Projection::new();
        projection.position = at;
        for r in self.tree.scan_prefix(key(b's', &[&at.to_be_bytes()])) {
            let (_, v) = r?;
            let entity = decode_entity(&v)?;
            projection.entities.insert(entity.id(), entity);
        }
        Ok(Some(projection))
    }
}

/// One key and its value, borrowed from an exported state.
pub(crate) type KeyValue<'a> = (&'a [u8], &'a [u8]);

/// The (key, value) pairs of an exported state, checked to be whole.
pub(crate) fn exported_pairs(body: &[u8]) -> Result<Vec<KeyValue<'_>>, StoreError> {
    fn part<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        let bytes = rest.get(4..4 + len)?;
        *rest = &rest[4 + len..];
        Some(bytes)
    }
    let truncated = || StoreError::Import("the exported state is truncated".into());
    let mut pairs = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        let k = part(&mut rest).ok_or_else(truncated)?;
        let v = part(&mut rest).ok_or_else(truncated)?;
        pairs.push((k, v));
    }
    Ok(pairs)
}

/// The store as placement's and recovery's [`StateView`]: each entity read from sled by id,
/// providers and instances by kind (`e` + kind), a consumer's providers from the `b`
/// index. A refused delete then costs its allocations, heal and orphans the entities of
/// the kinds they walk, a recovery sweep the instances: never the log's length.
///
/// The store may lag the log by what the projector has not applied yet; it only tells what
/// to try. Every write decided from it goes through the client's one decided write path
/// (`record`/`record_fact`: the aggregate read from the log, appended at that exact
/// version), so the decider checks each claim, release and recovery against the log.
impl StateView for ProjectionStore {
    async fn entity(&self, id: &AggregateId) -> Result<Option<Entity>, ViewError> {
        ProjectionStore::entity(self, id).map_err(view_error)
    }

    async fn providers(&self) -> Result<Vec<ProviderState>, ViewError> {
        self.of_kind(AggregateKind::Provider, |e| match e {
            Entity::Provider(p) => Some(*p),
            _ => None,
        })
        .await
    }

    async fn instances(&self) -> Result<Vec<InstanceState>, ViewError> {
        self.of_kind(AggregateKind::Instance, |e| match e {
            Entity::Instance(i) => Some(*i),
            _ => None,
        })
        .await
    }

    async fn allocation_providers(&self, consumer: Uuid) -> Result<Vec<Uuid>, ViewError> {
        self.providers_of_consumer(&consumer).map_err(view_error)
    }
}

impl ProjectionStore {
    /// Every entity of `kind`, decoded off the reactor: a scan of a whole kind takes long
    /// enough to hold up the requests sharing its thread.
    async fn of_kind<T: Send + 'static>(
        &self,
        kind: AggregateKind,
        pick: fn(Entity) -> Option<T>,
    ) -> Result<Vec<T>, ViewError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || {
            store
                .entities_of(kind, None)
                .filter_map(|e| match e {
                    Ok(e) => pick(e).map(Ok),
                    Err(e) => Some(Err(view_error(e))),
                })
                .collect()
        })
        .await
        .map_err(|e| ViewError::Store(Box::new(e)))?
    }
}

fn view_error(e: StoreError) -> ViewError {
    ViewError::Store(Box::new(e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::projector::Projector;
    use provledger_events::catalogue::samples;
    use provledger_events::{CommitDraft, Event, Hash};

    /// Given operations that start, then one succeeds, when the projector applies them,
    /// then the status index and counts follow each one (no stale entry under its old
    /// status), the kind and target indexes find them, and a store whose indexes are
    /// dropped rebuilds the same ones when it opens.
    #[test]
    fn the_operation_indexes_follow_each_status_change_and_rebuild_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        let mut projector = Projector::new(store.clone(), 0).expect("projector");
        let started = samples::all()
            .into_iter()
            .find(|e| matches!(e, Event::OperationStarted { .. }))
            .expect("a sample start");
        let Event::OperationStarted { target, .. } = &started else {
            unreachable!("found above")
        };
        let target = *target;
        let (a, b) = (
            AggregateId::operation(Uuid::from_u128(1)),
            AggregateId::operation(Uuid::from_u128(2)),
        );
        let mut position = 0;
        let mut commit = |id: AggregateId, version: u64, prev: Hash, events: Vec<Event>| {
            position += 1;
            let mut c = Commit::seal(id, version, prev, CommitDraft::now("t", events));
            c.position = position;
            c
        };
        let a1 = commit(a, 1, Hash::ZERO, vec![started.clone()]);
        let b1 = commit(b, 1, Hash::ZERO, vec![started.clone()]);
        let a2 = commit(a, 2, a1.hash, vec![Event::OperationSucceeded {}]);
        projector
            .apply_batch(vec![Ok(a1), Ok(b1)])
            .expect("batch 1");
        let ids = |filter: &OperationFilter| -> Vec<Uuid> {
            store
                .operations(filter, None)
                .map(|e| e.expect("read").header().id.id)
                .collect()
        };
        let status = |s: &str| OperationFilter {
            status: Some(s.into()),
            ..Default::default()
        };
        assert_eq!(ids(&status("running")), vec![a.id, b.id]);
        projector.apply_batch(vec![Ok(a2)]).expect("batch 2");
        assert_eq!(ids(&status("running")), vec![b.id]);
        // The index itself holds no stale entry (the listing re-checks each entity, so
        // only the index shows it).
        let indexed = |s: &str| {
            store
                .tree
                .scan_prefix(key(b'O', &[s.as_bytes(), &[0]]))
                .count()
        };
        assert_eq!((indexed("running"), indexed("succeeded")), (1, 1));
        assert_eq!(ids(&status("succeeded")), vec![a.id]);
        let counts = store.operation_counts().expect("counts");
        assert_eq!(
            counts,
            vec![("running".to_string(), 1), ("succeeded".to_string(), 1)]
        );
        let on_target = OperationFilter {
            target: Some(target),
            ..Default::default()
        };
        assert_eq!(ids(&on_target), vec![a.id, b.id]);
        let kind = OperationFilter {
            kind: Some("scale_cluster".into()),
            status: Some("succeeded".into()),
            ..Default::default()
        };
        assert_eq!(ids(&kind), vec![a.id]);

        // A store from before the indexes: dropped, then rebuilt on open.
        store
            .tree
            .remove(key(b'm', &[b"operation_index_format"]))
            .expect("remove");
        for tag in [b'o', b'O', b'k', b't', b'n'] {
            for k in store.tree.scan_prefix([tag]).keys() {
                store.tree.remove(k.expect("key")).expect("remove");
            }
        }
        assert_eq!(ids(&status("running")), Vec::<Uuid>::new());
        drop(projector);
        let reopened = ProjectionStore::open(&db).expect("reopen");
        assert_eq!(reopened.operation_counts().expect("counts"), counts);
        assert_eq!(ids(&status("running")), vec![b.id]);
        assert_eq!(ids(&on_target), vec![a.id, b.id]);
    }

    /// Given a store whose entities were written in an older format, when it is opened,
    /// then every entity is re-folded from the copy and the snapshots are dropped.
    #[test]
    fn an_older_entity_format_is_refolded_from_the_copy_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        let cluster = AggregateId::cluster(Uuid::from_u128(7));
        let mut commit = Commit::seal(
            cluster,
            1,
            Hash::ZERO,
            CommitDraft::now("t", vec![samples::all().remove(0)]),
        );
        commit.position = 1;
        let mut projector = Projector::new(store.clone(), 0).expect("projector");
        projector.apply_batch(vec![Ok(commit)]).expect("batch");
        store.write_snapshot(1).expect("snapshot");
        let expected = store.entity(&cluster).expect("read").expect("entity");
        // An older build wrote format 1 with a different layout.
        let k = key(b'e', &[&cluster.key_bytes()]);
        store
            .tree
            .insert(&k, &[1u8, 0xde, 0xad][..])
            .expect("tamper");
        store
            .tree
            .insert(key(b'm', &[b"entity_format"]), &[1u8][..])
            .expect("format");
        drop(projector);
        drop(store);

        let reopened = ProjectionStore::open(&db).expect("reopen");
        assert_eq!(reopened.entity(&cluster).expect("read"), Some(expected));
        assert!(reopened.snapshots().expect("snapshots").is_empty());
    }

    /// Given a serve store (no copy of the log) written in the previous entity format,
    /// when it is opened, then it is refused with what to do (it cannot be re-folded from
    /// itself: serve catches up again from the stream), and nothing is read as this format.
    #[test]
    fn a_serve_store_of_the_previous_entity_format_is_refused_with_what_to_do() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        store.keep_no_copy().expect("serve's store");
        let op = AggregateId::operation(Uuid::from_u128(8));
        let started = samples::all()
            .into_iter()
            .find(|e| matches!(e, Event::OperationStarted { .. }))
            .expect("a sample start");
        let mut commit = Commit::seal(op, 1, Hash::ZERO, CommitDraft::now("t", vec![started]));
        commit.position = 1;
        let mut projector = Projector::new(store.clone(), 0).expect("projector");
        projector.apply_batch(vec![Ok(commit)]).expect("batch");
        store
            .tree
            .insert(key(b'm', &[b"entity_format"]), &[ENTITY_FORMAT - 1][..])
            .expect("format");
        drop(projector);
        drop(store);

        let refused = ProjectionStore::open(&db).err();
        assert!(
            matches!(&refused, Some(StoreError::OlderFormat { .. }))
                && refused
                    .as_ref()
                    .is_some_and(|e| e.to_string().contains("remove the data dir")),
            "{refused:?}"
        );
        // When it is reset (as serve does), then it opens as a new replica's store of the
        // same stream, empty, in this build's formats.
        ProjectionStore::reset(&db).expect("reset");
        let store = ProjectionStore::open(&db).expect("opens after the reset");
        assert!(store.is_fresh().expect("fresh"));
        assert!(!store.copies_log().expect("copies"));
        assert_eq!(store.entity(&op).expect("read"), None);
    }

    /// Given an embedded store (its log is its only copy), when a reset is asked, then it
    /// is refused and nothing is removed.
    #[test]
    fn a_store_holding_the_copy_of_the_log_is_never_reset() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        store
            .tree
            .insert(key(b'm', &[b"checkpoint"]), &7u64.to_be_bytes()[..])
            .expect("insert");
        assert!(ProjectionStore::reset(&db).is_err());
        assert_eq!(store.checkpoint().expect("checkpoint"), 7);
    }

    /// Given garbage this thread left for sled's epoch collector (as sled's own writes
    /// do, a replaced page at a time), when the projector writes a batch, then it is freed
    /// by the time the write returns: sled alone would keep it until this thread pinned
    /// 128 more times, which under a stream of large batches never caught up (serve grew
    /// by kilobytes per commit). Other tests pinning meanwhile can hold the epoch back for
    /// a moment, so a few batches are allowed.
    #[test]
    fn a_batch_write_frees_the_garbage_sled_left_for_epoch_reclamation() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        let freed = Arc::new(AtomicBool::new(false));
        {
            let flag = Arc::clone(&freed);
            sled::pin().defer(move || flag.store(true, Ordering::SeqCst));
        }
        for checkpoint in 1..=5 {
            store
                .write_batch(StoreBatch {
                    checkpoint,
                    ..Default::default()
                })
                .expect("batch");
            if freed.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        panic!("the garbage deferred before the batches was not freed by 5 batch writes");
    }

    /// Given instances and an operation whose ids share heads and tails, when short ids
    /// are resolved, then a tail (the short form shown) or a head names exactly the ids it
    /// ends or begins, of the kind asked; more than [`ID_MATCHES_MAX`] says `more`; and a
    /// store without the index (an older one) rebuilds the same on open.
    #[test]
    fn the_id_index_resolves_short_ids_by_tail_or_head_and_rebuilds_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        let mut projector = Projector::new(store.clone(), 0).expect("projector");
        // What the entity folds does not matter to the index: its first commit does.
        let created = Event::InstanceDeleted {};
        // 12 instances ending ...Naaaa00000000 (N: 0 to 11), one ending ...bbbb12345678,
        // all sharing a head.
        let head = 0x0190_0000_0000_7000_8000_0000_0000_0000u128;
        let mut ids: Vec<AggregateId> = (0..12u128)
            .map(|n| AggregateId::instance(Uuid::from_u128(head | n << 48 | 0xaaaa_0000_0000)))
            .collect();
        ids.push(AggregateId::instance(Uuid::from_u128(
            head | 0xbbbb_1234_5678,
        )));
        let op = AggregateId::operation(Uuid::from_u128(head | 0xbbbb_1234_5678));
        let entries = ids
            .iter()
            .chain([&op])
            .enumerate()
            .map(|(i, id)| {
                let mut c = Commit::seal(
                    *id,
                    1,
                    Hash::ZERO,
                    CommitDraft::now("t", vec![created.clone()]),
                );
                c.position = i as u64 + 1;
                Ok(c)
            })
            .collect();
        projector.apply_batch(entries).expect("batch");
        let resolve = |kind: Option<AggregateKind>, text: &str| {
            store
                .resolve_ids(kind, &text.parse().expect("an id ref"))
                .expect("resolve")
        };
        let check = |store_label: &str| {
            let one = resolve(Some(AggregateKind::Instance), "bbbb12345678");
            assert_eq!(one.ids, vec![ids[12]], "{store_label}: tail");
            assert!(!one.more);
            // An odd number of digits, and the kind left open: both kinds answer.
            let both = resolve(None, "b12345678");
            assert_eq!(both.ids, vec![ids[12], op], "{store_label}: any kind");
            let many = resolve(Some(AggregateKind::Instance), "aaaa00000000");
            assert_eq!(many.ids.len(), ID_MATCHES_MAX, "{store_label}");
            assert!(many.more, "{store_label}: 12 match, 10 are listed");
            let by_head = resolve(Some(AggregateKind::Instance), "01900000");
            assert!(by_head.more, "{store_label}: every instance begins so");
            assert_eq!(
                resolve(Some(AggregateKind::Cluster), "bbbb12345678").ids,
                vec![],
                "{store_label}: another kind"
            );
            let full = IdRef::Full(ids[3].id);
            assert_eq!(
                store.resolve_ids(None, &full).expect("full").ids,
                vec![ids[3]]
            );
        };
        check("as folded");
        // An older store: no index, no format; opened again, it rebuilds both.
        store.tree.remove(id_index_format_key()).expect("remove");
        for k in store.tree.scan_prefix([b'x']).keys() {
            store.tree.remove(k.expect("key")).expect("remove");
        }
        assert_eq!(resolve(None, "bbbb12345678").ids, vec![]);
        let store = ProjectionStore::open(&db).expect("reopen");
        let resolve = |kind: Option<AggregateKind>, text: &str| {
            store
                .resolve_ids(kind, &text.parse().expect("an id ref"))
                .expect("resolve")
        };
        assert_eq!(resolve(None, "b12345678").ids, vec![ids[12], op]);
        assert!(resolve(Some(AggregateKind::Instance), "aaaa00000000").more);
    }

    /// A service's store: claimed by a stream, keeping no copy of the log.
    fn service_store(dir: &std::path::Path) -> (sled::Db, ProjectionStore) {
        let db = sled::open(dir).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        store.claim_source("jetstream:PROVLEDGER").expect("source");
        store.keep_no_copy().expect("no copy");
        (db, store)
    }

    /// Given a store that projected 3,000 commits on 1,500 providers (more than one import
    /// chunk), exported; when a new store imports it, then until the import is finished it
    /// is marked, at checkpoint 0, and not fresh; once finished it holds every key of the
    /// export at the export's checkpoint. When an unfinished import is abandoned (a refused
    /// snapshot), or cut short and followed by another import (a crash), the store is fresh
    /// again, still claimed by its stream and keeping no copy.
    #[test]
    fn an_import_is_invisible_until_finished_and_abandoned_without_a_trace() {
        use provledger_events::catalogue::ConsumerKind;
        use provledger_tests::workload::{provider_on, vcpu_claim};
        use std::sync::atomic::AtomicBool;
        let dir = tempfile::tempdir().expect("tempdir");
        let (_source_db, source) = service_store(&dir.path().join("source"));
        let mut projector = Projector::new(source.clone(), 0).expect("projector");
        let mut commits = Vec::new();
        for p in 0..1_500u128 {
            let id = AggregateId::provider(Uuid::from_u128(p + 1));
            let inventory = Commit::seal(
                id,
                1,
                Hash::ZERO,
                CommitDraft::now("t", provider_on(&format!("node-{p}"), 16)),
            );
            let claim = Commit::seal(
                id,
                2,
                inventory.hash,
                CommitDraft::now(
                    "t",
                    vcpu_claim(Uuid::from_u128(10_000 + p), ConsumerKind::Instance, 1),
                ),
            );
            commits.push(inventory);
            commits.push(claim);
        }
        for (i, c) in commits.iter_mut().enumerate() {
            c.position = i as u64 + 1;
        }
        projector
            .apply_batch(commits.into_iter().map(Ok).collect())
            .expect("projected");
        assert_eq!(
            source.tree.scan_prefix([b'b']).count(),
            1_500,
            "each claim in the allocation index"
        );
        let (position, keys, body) = source.export_state().expect("export");
        assert_eq!(position, 3_000);
        assert!(
            keys as usize > IMPORT_CHUNK_KEYS,
            "{keys} keys fit one chunk"
        );
        let all = |store: &ProjectionStore| -> Vec<(sled::IVec, sled::IVec)> {
            store.tree.iter().map(|r| r.expect("read")).collect()
        };
        // What a new service store holds: its stream, no copy, this build's formats.
        let (_new_db, new) = service_store(&dir.path().join("new"));
        let fresh_like = |store: &ProjectionStore| {
            assert!(store.is_fresh().expect("fresh") && !store.import_incomplete().expect("m"));
            assert_eq!(all(store), all(&new), "an abandoned store is a new one");
        };

        let (_db, imported) = service_store(&dir.path().join("imported"));
        let go_on = AtomicBool::new(false);
        assert_eq!(
            imported.import_unfinished(&body, &go_on).expect("import"),
            keys - 1
        );
        assert!(imported.import_incomplete().expect("marked"));
        assert_eq!(imported.checkpoint().expect("checkpoint"), 0);
        assert!(!imported.is_fresh().expect("fresh"));
        imported.finish_import(position).expect("finished");
        assert!(!imported.import_incomplete().expect("marked"));
        assert_eq!(
            all(&imported),
            all(&source),
            "the imported store is the exported one"
        );

        // A snapshot in another build's index layout is refused before anything is written.
        let mut other_build = Vec::new();
        for (k, v) in exported_pairs(&body).expect("pairs") {
            let v: &[u8] = if k == b"mtime_index_format" { &[1] } else { v };
            for part in [k, v] {
                other_build.extend_from_slice(&(part.len() as u32).to_be_bytes());
                other_build.extend_from_slice(part);
            }
        }
        let (_db, newer) = service_store(&dir.path().join("newer"));
        let refusal = newer.import_unfinished(&other_build, &go_on);
        assert!(
            matches!(&refusal, Err(StoreError::Import(why)) if why.contains("time index format")),
            "{refusal:?}"
        );
        fresh_like(&newer);
        assert!(matches!(
            imported.import_unfinished(&body, &go_on),
            Err(StoreError::NotFresh)
        ));

        let refused_dir = dir.path().join("refused");
        let (refused_db, refused) = service_store(&refused_dir);
        refused.import_unfinished(&body, &go_on).expect("import");
        refused.abandon_import().expect("abandoned");
        fresh_like(&refused);
        // The replica then catches up into it, and the store opens again at its next start.
        let mut follower = Projector::new(refused.clone(), 0).expect("projector");
        let mut first = Commit::seal(
            AggregateId::provider(Uuid::from_u128(1)),
            1,
            Hash::ZERO,
            CommitDraft::now("t", provider_on("node-after", 8)),
        );
        first.position = 1;
        follower.apply_batch(vec![Ok(first)]).expect("folded");
        drop((follower, refused, refused_db));
        let reopened = service_store(&refused_dir).1;
        assert_eq!(reopened.checkpoint().expect("checkpoint"), 1);

        // A crash half-way: the first chunk written, then the process gone.
        let (_db, crashed) = service_store(&dir.path().join("crashed"));
        let stop = AtomicBool::new(true);
        let written = crashed.import_unfinished(&body, &stop).expect("cut short");
        assert_eq!(written, IMPORT_CHUNK_KEYS as u64);
        assert!(crashed.import_incomplete().expect("marked"));
        crashed.abandon_import().expect("abandoned");
        fresh_like(&crashed);
        crashed
            .import_unfinished(&body, &stop)
            .expect("cut short again");
        // The next import starts over from a fresh store.
        crashed.import_unfinished(&body, &go_on).expect("import");
        crashed.finish_import(position).expect("finished");
        assert_eq!(all(&crashed), all(&source));
    }
}
