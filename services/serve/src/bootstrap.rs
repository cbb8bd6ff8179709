//! Snapshots published for new replicas, and a new replica's bootstrap from one.
//!
//! A replica that takes a projection snapshot (`--snapshot-bucket`) also publishes its
//! whole projection state (entities, indexes, quarantine, time index: everything but the
//! copy of the log, which the stream holds) as one object in a JetStream object store,
//! replacing the previous one: the bucket keeps the newest snapshot only. A replica whose
//! data dir is new fetches it, checks it, writes it into its store and follows the stream
//! from the snapshot's position on, instead of folding the whole stream.
//!
//! A snapshot is used only if every check holds, else it is refused and the replica
//! catches up from position 1 as before:
//! - its bytes: the blake3 of the body is the one in its header (the object store's own
//!   SHA-256 only says the object was read as it was put);
//! - what it says it is: this stream, this entity format and index layouts (the body's own
//!   format keys, checked by the import before it writes), a position the stream has;
//! - the chain tips it covers: the blake3 of every entity's tip (aggregate, version,
//!   position, hash) is the header's, and a sample of tips ([`TIPS_VERIFIED_MAX`], spread
//!   over the aggregates, and the newest) is checked against the stream itself: the commit
//!   at the tip's position is that aggregate's, at that version, with that hash, and the
//!   subject holds no later commit at or before the snapshot's position.
//!
//! The body's hash is computed as it is fetched, and the state is written into the store
//! while the tips are checked: the import stays unfinished (no checkpoint, a marker) until
//! every check holds, and a refusal abandons it, leaving the store fresh. A crash at any
//! point leaves either a finished import or a marked one that the next start abandons.

use futures::StreamExt;
use provledger_events::{AggregateId, ChainTip, EventLog, JetStreamLog};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use provledger_projections::{Entity, Projection};

use crate::store::{
    be_u64, decode_entity, exported_pairs, ProjectionStore, StoreError, ENTITY_FORMAT,
};

/// The name of the one object a snapshot bucket holds.
pub const SNAPSHOT_OBJECT: &str = "projection";
/// How many chain tips a bootstrap checks against the stream (two direct gets each).
pub const TIPS_VERIFIED_MAX: usize = 256;
/// How many of those checks are in flight at once.
const TIPS_VERIFIED_CONCURRENTLY: usize = 16;
/// The first bytes of a published snapshot, with its layout's version.
const MAGIC: &[u8; 8] = b"PLSNAP\x00\x01";

/// What a published snapshot says of itself (JSON, after the magic and its length).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotHeader {
    /// The stream it is the projection of.
    pub stream: String,
    /// The last position it covers: the bootstrapped replica follows from the next.
    pub position: u64,
    pub entity_format: u8,
    pub keys: u64,
    pub entities: u64,
    pub body_bytes: u64,
    /// blake3 of the body, hex.
    pub body_blake3: String,
    /// blake3 of every entity's chain tip in key order, hex.
    pub tips_blake3: String,
}

/// A snapshot ready to publish: its layout's head (the magic, the header's length, the
/// header) and the body, published one after the other (the body is never copied).
#[derive(Debug, Clone)]
pub struct PublishedSnapshot {
    pub header: SnapshotHeader,
    pub head: Vec<u8>,
    pub body: Vec<u8>,
}

impl PublishedSnapshot {
    /// The bytes published.
    pub fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a bootstrap did not happen. All but `Store` leave the data dir as it was, and the
/// replica catches up from position 1.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("no snapshot is published in bucket {bucket}")]
    NoSnapshot { bucket: String },
    #[error("the published snapshot is refused: {0}")]
    Refused(String),
    #[error("the snapshot bucket cannot be read: {0}")]
    Unavailable(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// One entity's chain tip, as a snapshot covers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoveredTip {
    pub aggregate: AggregateId,
    pub tip: ChainTip,
}

/// The chain tips of the entities in an exported body, in key order, and their digest;
/// each entity, once decoded and its tip taken, goes to `keep` (so that a caller that
/// wants the entities, `replay`, does not decode them a second time).
fn tips_of(
    body: &[u8],
    mut keep: impl FnMut(Entity),
) -> Result<(Vec<CoveredTip>, blake3::Hash), BootstrapError> {
    let pairs = exported_pairs(body).map_err(|e| BootstrapError::Refused(e.to_string()))?;
    let mut tips = Vec::new();
    let mut digest = blake3::Hasher::new();
    for (k, v) in pairs.into_iter().filter(|(k, _)| k.first() == Some(&b'e')) {
        let entity = decode_entity(v).map_err(|e| BootstrapError::Refused(e.to_string()))?;
        let h = entity.header();
        digest.update(&h.id.key_bytes());
        digest.update(&h.version.to_be_bytes());
        digest.update(&h.last_position.to_be_bytes());
        digest.update(&h.hash.0);
        if k.get(1..) != Some(&h.id.key_bytes()[..]) {
            return Err(BootstrapError::Refused(format!(
                "entity {} is stored under another key",
                h.id
            )));
        }
        tips.push(CoveredTip {
            aggregate: h.id,
            tip: h.tip(),
        });
        keep(entity);
    }
    Ok((tips, digest.finalize()))
}

/// The store's state as a snapshot of `stream` (called by the projector between batches).
pub fn prepare(store: &ProjectionStore, stream: &str) -> Result<PublishedSnapshot, BootstrapError> {
    let (position, keys, body) = store.export_state()?;
    let (tips, tips_digest) = tips_of(&body, drop)?;
    let header = SnapshotHeader {
        stream: stream.to_string(),
        position,
        entity_format: ENTITY_FORMAT,
        keys,
        entities: tips.len() as u64,
        body_bytes: body.len() as u64,
        body_blake3: blake3::hash(&body).to_hex().to_string(),
        tips_blake3: tips_digest.to_hex().to_string(),
    };
    let json = serde_json::to_vec(&header).map_err(|e| BootstrapError::Refused(e.to_string()))?;
    let mut head = Vec::with_capacity(MAGIC.len() + 4 + json.len());
    head.extend_from_slice(MAGIC);
    // A header is a few hundred bytes: it always fits a u32.
    head.extend_from_slice(&(json.len() as u32).to_be_bytes());
    head.extend_from_slice(&json);
    Ok(PublishedSnapshot { header, head, body })
}

/// Where a snapshot's body starts: after the magic, the header's length and the header;
/// `None` while (or if) the bytes are too short to tell.
fn body_from(bytes: &[u8]) -> Option<usize> {
    let len = bytes.get(MAGIC.len()..MAGIC.len() + 4)?;
    let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
    Some(MAGIC.len() + 4 + len)
}

/// Checks what a snapshot's head says against its bytes (pure): layout, stream, entity
/// format, body length, and `body_hash` (the blake3 of its body, computed as it was
/// fetched) against the header's. Returns the header and the body.
pub fn check_head<'a>(
    bytes: &'a [u8],
    stream: &str,
    body_hash: blake3::Hash,
) -> Result<(SnapshotHeader, &'a [u8]), BootstrapError> {
    let refused = |why: String| BootstrapError::Refused(why);
    if !bytes.starts_with(MAGIC) {
        return Err(refused("not a provledger snapshot (magic)".into()));
    }
    let from = body_from(bytes)
        .filter(|from| *from <= bytes.len())
        .ok_or_else(|| refused("truncated header".into()))?;
    let (head, body) = (&bytes[MAGIC.len() + 4..from], &bytes[from..]);
    let header: SnapshotHeader =
        serde_json::from_slice(head).map_err(|e| refused(format!("header: {e}")))?;
    if header.stream != stream {
        return Err(refused(format!(
            "it is a snapshot of stream {}, not {stream}",
            header.stream
        )));
    }
    if header.entity_format != ENTITY_FORMAT {
        return Err(refused(format!(
            "entity format {}, this build reads {ENTITY_FORMAT}",
            header.entity_format
        )));
    }
    if body.len() as u64 != header.body_bytes {
        return Err(refused(format!(
            "body of {} bytes, the header says {}",
            body.len(),
            header.body_bytes
        )));
    }
    if body_hash.to_hex().as_str() != header.body_blake3 {
        return Err(refused("the body's blake3 is not the header's".into()));
    }
    Ok((header, body))
}

/// Checks the chain tips a body covers against its header (pure): their digest and count,
/// none past the snapshot's position. Returns the tips to verify against the stream; each
/// entity decoded on the way goes to `keep`.
pub fn check_tips(
    header: &SnapshotHeader,
    body: &[u8],
    keep: impl FnMut(Entity),
) -> Result<Vec<CoveredTip>, BootstrapError> {
    let (tips, digest) = tips_of(body, keep)?;
    if digest.to_hex().as_str() != header.tips_blake3 || tips.len() as u64 != header.entities {
        return Err(BootstrapError::Refused(
            "the chain tips it holds are not the ones its header covers".into(),
        ));
    }
    if let Some(beyond) = tips.iter().find(|t| t.tip.position > header.position) {
        return Err(BootstrapError::Refused(format!(
            "{} is at position {}, past the snapshot's {}",
            beyond.aggregate, beyond.tip.position, header.position
        )));
    }
    Ok(sample(&tips))
}

/// At most [`TIPS_VERIFIED_MAX`] tips spread evenly over the aggregates, and the newest.
fn sample(tips: &[CoveredTip]) -> Vec<CoveredTip> {
    let step = tips.len().div_ceil(TIPS_VERIFIED_MAX).max(1);
    let mut picked: Vec<CoveredTip> = tips.iter().step_by(step).copied().collect();
    if let Some(newest) = tips.iter().max_by_key(|t| t.tip.position) {
        if !picked.contains(newest) {
            picked.push(*newest);
        }
    }
    picked
}

/// Checks the sampled tips against the stream (see the module's doc).
pub async fn verify_against_stream(
    log: &JetStreamLog,
    position: u64,
    sample: &[CoveredTip],
) -> Result<(), BootstrapError> {
    let unavailable = |e: provledger_events::ReadError| BootstrapError::Unavailable(e.to_string());
    let end = log.last_position().await.map_err(unavailable)?;
    if end < position {
        return Err(BootstrapError::Refused(format!(
            "it covers up to position {position}, the stream ends at {end}"
        )));
    }
    // Each tip on its own: random reads of a long stream wait on the server's disk, so
    // they go out side by side.
    let checks = futures::stream::iter(sample.iter().copied())
        .map(|covered| verify_tip(log, covered, position))
        .buffer_unordered(TIPS_VERIFIED_CONCURRENTLY);
    futures::pin_mut!(checks);
    while let Some(result) = checks.next().await {
        result?;
    }
    Ok(())
}

/// Checks one covered tip against the stream (see the module's doc).
async fn verify_tip(
    log: &JetStreamLog,
    covered: CoveredTip,
    position: u64,
) -> Result<(), BootstrapError> {
    let unavailable = |e: provledger_events::ReadError| BootstrapError::Unavailable(e.to_string());
    let CoveredTip { aggregate, tip } = covered;
    let at = log.read_position(tip.position).await.map_err(unavailable)?;
    match at {
        Some(c) if c.aggregate == aggregate && c.version == tip.version && c.hash == tip.hash => {}
        _ => {
            return Err(BootstrapError::Refused(format!(
                "{aggregate}'s tip (version {}, position {}) is not the stream's",
                tip.version, tip.position
            )))
        }
    }
    // The subject's last message up to the snapshot's position is the tip itself: one
    // indexed request. Anything else (a later commit the snapshot misses, or garbage
    // quarantined after the tip) is told apart by reading what follows.
    if log
        .last_position_of(aggregate, position)
        .await
        .map_err(unavailable)?
        == Some(tip.position)
    {
        return Ok(());
    }
    let later = log
        .read_aggregate_after(aggregate, tip)
        .await
        .map_err(unavailable)?;
    if let Some(missed) = later.iter().find(|c| c.position <= position) {
        return Err(BootstrapError::Refused(format!(
            "{aggregate} has version {} at position {}, which the snapshot misses",
            missed.version, missed.position
        )));
    }
    Ok(())
}

/// The object store holding the snapshots, created if missing.
async fn bucket(
    js: &async_nats::jetstream::Context,
    name: &str,
) -> Result<async_nats::jetstream::object_store::ObjectStore, BootstrapError> {
    if let Ok(store) = js.get_object_store(name).await {
        return Ok(store);
    }
    js.create_object_store(async_nats::jetstream::object_store::Config {
        bucket: name.to_string(),
        description: Some("provledger projection snapshots for new replicas".into()),
        ..Default::default()
    })
    .await
    .map_err(|e| BootstrapError::Unavailable(format!("creating bucket {name}: {e}")))
}

/// Publishes `snapshot` in `bucket_name`, replacing the one there (the object store
/// removes the replaced object's chunks: the bucket holds one snapshot).
pub async fn publish(
    js: &async_nats::jetstream::Context,
    bucket_name: &str,
    snapshot: &PublishedSnapshot,
) -> Result<(), BootstrapError> {
    let store = bucket(js, bucket_name).await?;
    let meta = async_nats::jetstream::object_store::ObjectMetadata {
        name: SNAPSHOT_OBJECT.to_string(),
        description: Some(format!(
            "projection of {} at position {}",
            snapshot.header.stream, snapshot.header.position
        )),
        chunk_size: Some(1024 * 1024),
        metadata: [("position".to_string(), snapshot.header.position.to_string())].into(),
        headers: None,
    };
    store
        .put(
            meta,
            &mut snapshot.head.as_slice().chain(snapshot.body.as_slice()),
        )
        .await
        .map_err(|e| BootstrapError::Unavailable(format!("publishing to {bucket_name}: {e}")))?;
    Ok(())
}

/// The largest snapshot a replica fetches (a store of millions of entities exports a few
/// GiB). The object's metadata states its size, but only serve's credentials can write the
/// bucket and metadata can still lie: an implausible size is refused before anything is
/// allocated (`Vec::with_capacity` of 2^62 bytes aborts the process), and a body that
/// outgrows the bound while it is read is refused too.
pub const SNAPSHOT_BYTES_MAX: usize = 16 << 30;
/// What is reserved up front from the stated size; the rest grows as chunks come.
const SNAPSHOT_PREALLOC_BYTES_MAX: usize = 256 << 20;

/// A snapshot as fetched: its bytes and the blake3 of its body, hashed as the chunks came
/// in (so that an 800 MB body costs no second pass).
pub struct Fetched {
    pub bytes: Vec<u8>,
    pub body_hash: blake3::Hash,
}

/// The bytes of the snapshot published in `bucket_name`.
pub async fn fetch(
    js: &async_nats::jetstream::Context,
    bucket_name: &str,
) -> Result<Fetched, BootstrapError> {
    let unavailable = |e: String| BootstrapError::Unavailable(format!("{bucket_name}: {e}"));
    let Ok(store) = js.get_object_store(bucket_name).await else {
        return Err(BootstrapError::NoSnapshot {
            bucket: bucket_name.to_string(),
        });
    };
    let mut object = match store.get(SNAPSHOT_OBJECT).await {
        Ok(o) => o,
        Err(e) if e.kind() == async_nats::jetstream::object_store::GetErrorKind::NotFound => {
            return Err(BootstrapError::NoSnapshot {
                bucket: bucket_name.to_string(),
            })
        }
        Err(e) => return Err(unavailable(e.to_string())),
    };
    let stated = object.info().size;
    if stated > SNAPSHOT_BYTES_MAX {
        return Err(BootstrapError::Refused(format!(
            "{bucket_name}: the snapshot's metadata states {stated} bytes, over the {SNAPSHOT_BYTES_MAX} a replica fetches (SNAPSHOT_BYTES_MAX); publish a new one with `provledger snapshot`"
        )));
    }
    let mut bytes = Vec::with_capacity(stated.min(SNAPSHOT_PREALLOC_BYTES_MAX));
    let mut hasher = blake3::Hasher::new();
    let mut hashed = 0;
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let n = object
            .read(&mut chunk)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        if n == 0 {
            break;
        }
        if bytes.len() + n > SNAPSHOT_BYTES_MAX {
            return Err(BootstrapError::Refused(format!(
                "{bucket_name}: the snapshot holds more than {SNAPSHOT_BYTES_MAX} bytes (SNAPSHOT_BYTES_MAX)"
            )));
        }
        bytes.extend_from_slice(&chunk[..n]);
        // The body's bytes are hashed as soon as the head says where they start.
        if let Some(from) = body_from(&bytes) {
            let from = from.max(hashed);
            if from < bytes.len() {
                hasher.update(&bytes[from..]);
                hashed = bytes.len();
            }
        }
    }
    Ok(Fetched {
        bytes,
        body_hash: hasher.finalize(),
    })
}

/// What a bootstrap did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bootstrapped {
    pub position: u64,
    pub keys: u64,
    pub entities: u64,
    pub bytes: u64,
    /// Milliseconds spent fetching (the body hashed on the way) and checking the head, then,
    /// side by side, checking and verifying the chain tips and importing.
    pub fetch_ms: u64,
    pub check_ms: u64,
    pub verify_ms: u64,
    pub import_ms: u64,
}

/// Bootstraps `store` (which must be new, or hold an import a crash cut short) from the
/// snapshot published in `bucket_name`: fetched (its body hashed on the way), its head
/// checked, then written into the store while its chain tips are checked and verified
/// against the stream, side by side; the import is finished only once both are done. On
/// any error but `Store` the store is left fresh (what the import wrote is abandoned).
pub async fn bootstrap(
    log: &JetStreamLog,
    bucket_name: &str,
    store: &ProjectionStore,
) -> Result<Bootstrapped, BootstrapError> {
    let ms = |since: std::time::Instant| since.elapsed().as_millis() as u64;
    let started = std::time::Instant::now();
    let Fetched { bytes, body_hash } = fetch(log.context(), bucket_name).await?;
    let fetch_ms = ms(started);
    let started = std::time::Instant::now();
    let (header, body) = check_head(&bytes, &log.config().stream, body_hash)?;
    let body_from = bytes.len() - body.len();
    let check_ms = ms(started);
    let total = bytes.len() as u64;
    // The bytes fetched are shared by the import and the tips' check, never copied.
    let bytes = std::sync::Arc::new(bytes);
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let import = {
        let (store, bytes, cancel) = (store.clone(), bytes.clone(), cancel.clone());
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            store
                .import_unfinished(&bytes[body_from..], &cancel)
                .map(|keys| (keys, ms(started)))
        })
    };
    let tips = async {
        let started = std::time::Instant::now();
        let sample = {
            let (header, bytes) = (header.clone(), bytes.clone());
            tokio::task::spawn_blocking(move || check_tips(&header, &bytes[body_from..], drop))
                .await
                .map_err(|e| BootstrapError::Unavailable(format!("tips task: {e}")))??
        };
        verify_against_stream(log, header.position, &sample).await?;
        Ok::<_, BootstrapError>(ms(started))
    };
    // The import is the long part; the tips are checked meanwhile, and a refusal stops it.
    let verified = tips.await;
    if verified.is_err() {
        cancel.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let imported = import
        .await
        .map_err(|e| BootstrapError::Unavailable(format!("import task: {e}")))?;
    let refused = match (verified, imported) {
        (Ok(verify_ms), Ok((keys, import_ms))) => {
            store.finish_import(header.position)?;
            return Ok(Bootstrapped {
                position: header.position,
                keys,
                entities: header.entities,
                bytes: total,
                fetch_ms,
                check_ms,
                verify_ms,
                import_ms,
            });
        }
        (Err(refused), _) => refused,
        // A body whose framing or keys are not a projection's is the snapshot's fault: it
        // is refused like any other, not a reason for serve to stop.
        (Ok(_), Err(StoreError::Import(why))) => BootstrapError::Refused(why),
        (Ok(_), Err(e)) => return Err(e.into()),
    };
    store.abandon_import()?;
    Err(refused)
}

/// A published snapshot as an in-memory projection, for `replay` (which folds in memory and
/// writes nothing): every entity it holds, the position it covers, the running maximum
/// `recorded_at` there and how many log entries it counts as quarantined.
#[derive(Debug)]
pub struct SnapshotProjection {
    pub projection: Projection,
    pub watermark: Option<i64>,
    pub quarantined: usize,
}

/// Fetches the snapshot published in `bucket_name` and checks it as a bootstrap does
/// (body hash, head, the chain tips' digest, a sample of tips against the stream) before
/// it is decoded into a [`Projection`].
pub async fn snapshot_projection(
    log: &JetStreamLog,
    bucket_name: &str,
) -> Result<SnapshotProjection, BootstrapError> {
    let Fetched { bytes, body_hash } = fetch(log.context(), bucket_name).await?;
    let (header, body) = check_head(&bytes, &log.config().stream, body_hash)?;
    let mut projection = Projection::new();
    let sample = check_tips(&header, body, |entity| {
        projection.entities.insert(entity.id(), entity);
    })?;
    verify_against_stream(log, header.position, &sample).await?;
    projection.position = header.position;
    let (mut watermark, mut quarantined) = (None, 0);
    // The entities are in `projection` already; the rest is the quarantine and the meta.
    for (k, v) in exported_pairs(body).map_err(|e| BootstrapError::Refused(e.to_string()))? {
        match k.first() {
            Some(b'q') => quarantined += 1,
            Some(b'm') if &k[1..] == b"watermark" => watermark = be_u64(v).map(|w| w as i64),
            _ => {}
        }
    }
    Ok(SnapshotProjection {
        projection,
        watermark,
        quarantined,
    })
}
