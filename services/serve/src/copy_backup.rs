//! A backup written from a stopped replica's copy of the stream (`crate::log_copy`), for
//! `provledger backup --from-copy DATA_DIR --to DIR` (issue 39, item 4): an ordinary
//! backup (`provledger_client::backup`'s format, manifest and blake3s), so that
//! `restore --check-only` and `restore --verify` check it exactly as one read from the
//! stream. docs/operating.md, "Backup and restore", is the procedure.
//!
//! What the copy holds, and so what such a backup holds: every commit the replica applied
//! that extends its aggregate's chain, at its stream position, through the copy's
//! `copied` mark. A position the replica quarantined (garbage, a refused forgery) is not
//! in the copy: the backup holds a placeholder there that readers quarantine again (its
//! bytes are lost; its subject and reason are the projection's quarantine record's), so
//! that positions stay continuous and the restored stream audits as the source did. A
//! position neither holds (a message the stream itself had lost) is a hole, kept as a
//! hole by a restore. Every commit is restored at its position. Past the copy's mark
//! nothing is known: the stream may have gone on, and the manifest's `from_copy` says
//! how far the copy went.
//!
//! The copy keeps a commit's bytes, not the message it came in: its subject and its
//! `Nats-Msg-Id` are derived as the writer made them ([`RawMessage::of_commit`]), so that
//! a retry of an old request is still a duplicate after the restore.
//!
//! Nothing is taken on trust: each copied commit must decode, match its hash, re-encode to
//! the bytes kept, and extend its chain as the stream's readers decide it (the backup's
//! own fold, `ContentFold`); the first that does not is refused by its position. It only
//! reads the data dir; the caller holds its lock, so a running serve's is never read.

use std::path::{Path, PathBuf};

use provledger_client::backup::{BackupError, BackupSource, BackupSummary, BackupWriter};
use provledger_events::backup::{check_subject, CopyOrigin, RawMessage};
use provledger_events::log::subject_for;
use provledger_events::{codec, AggregateId, Timestamp};

use crate::log_copy::{self, CopyExtent};
use crate::store::{ProjectionStore, QuarantineRecord, StoreError};

/// What a serve replica's projection store records as its source: `jetstream:<stream>`.
const JETSTREAM_SOURCE_PREFIX: &str = "jetstream:";

/// Why a backup from a replica's copy was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum CopyBackupError {
    #[error("{dir} keeps no copy of the stream: it is not a serve replica's data dir, or that replica ran with --no-log-copy (or before replicas kept one); back up the stream itself (`provledger --nats URL backup --to DIR`)")]
    NoCopy { dir: PathBuf },
    #[error("{dir} holds a copy, but its projection is of {projection_of:?}, not of a JetStream stream: not a serve replica's data dir")]
    NotAReplica { dir: PathBuf, projection_of: String },
    #[error("the copy in {dir} begins at position {from}, not 1 (the replica began it on a stream whose start it could not read): the chains before it are not in it, so it would restore as a partial stream; it is refused. Back up the stream itself, or another replica's copy")]
    CopyStartsLate { dir: PathBuf, from: u64 },
    #[error(
        "the copy in {dir} holds no commit (copied through position {through}): nothing to back up"
    )]
    Empty { dir: PathBuf, through: u64 },
    #[error("position {position}: the copy's commit {problem}; the copy was changed or damaged after the replica wrote it, and no backup was finished. Back up another replica's copy, or the stream")]
    Damaged { position: u64, problem: String },
    #[error("reading the copy in {dir}: {source}")]
    Store {
        dir: PathBuf,
        #[source]
        source: StoreError,
    },
    #[error(transparent)]
    Backup(#[from] BackupError),
}

/// What the copy covered, and what was written.
#[derive(Debug, Clone)]
pub struct CopyBackup {
    pub extent: CopyExtent,
    pub summary: BackupSummary,
}

/// Writes a backup of the copy in `db` (a stopped replica's data dir, `dir` for messages)
/// into `to` (new or empty), its subjects under `subject_prefix`.
/// `progress(position, last)` as commits are written.
pub fn backup_from_copy(
    db: &sled::Db,
    dir: &Path,
    subject_prefix: &str,
    to: &Path,
    taken_at: Timestamp,
    progress: impl FnMut(u64, u64),
) -> Result<CopyBackup, CopyBackupError> {
    let store_error = |source| CopyBackupError::Store {
        dir: dir.to_path_buf(),
        source,
    };
    // Read before the store is opened: opening creates trees, and a data dir without a
    // copy is left as it was.
    let extent =
        log_copy::extent(db)
            .map_err(store_error)?
            .ok_or_else(|| CopyBackupError::NoCopy {
                dir: dir.to_path_buf(),
            })?;
    let store = ProjectionStore::open(db).map_err(store_error)?;
    let source = store.source().map_err(store_error)?.unwrap_or_default();
    let Some(stream) = source.strip_prefix(JETSTREAM_SOURCE_PREFIX) else {
        return Err(CopyBackupError::NotAReplica {
            dir: dir.to_path_buf(),
            projection_of: source,
        });
    };
    if !extent.is_whole() {
        return Err(CopyBackupError::CopyStartsLate {
            dir: dir.to_path_buf(),
            from: extent.from,
        });
    }
    let Some((first, last)) = held_range(&store, extent).map_err(store_error)? else {
        return Err(CopyBackupError::Empty {
            dir: dir.to_path_buf(),
            through: extent.through,
        });
    };
    let mut writer = BackupWriter::create(to, subject_prefix, first, last)?;
    let copied = copy_commits(&store, &mut writer, (subject_prefix, first, last), progress);
    let placeholders = match copied {
        Ok(n) => n,
        Err(e) => {
            writer.abandon();
            return Err(match e {
                Copied::Store(source) => store_error(source),
                Copied::Refused(e) => e,
            });
        }
    };
    let summary = writer.finish(BackupSource {
        stream: stream.to_string(),
        taken_at,
        server_version: COPY_SERVER_VERSION.into(),
        from_copy: Some(CopyOrigin {
            copied_from: extent.from,
            copied_through: extent.through,
            placeholders,
        }),
    })?;
    Ok(CopyBackup { extent, summary })
}

/// The first and last positions the backup holds: the copy's first and last commits, or
/// a position the replica quarantined before or after them (`None`: no commit).
fn held_range(
    store: &ProjectionStore,
    extent: CopyExtent,
) -> Result<Option<(u64, u64)>, StoreError> {
    let mut commits = store.raw_commits(extent.from, extent.through);
    let Some((first, _)) = commits.next().transpose()? else {
        return Ok(None);
    };
    // One commit only: the first is the last.
    let last = commits.next_back().transpose()?.map_or(first, |(p, _)| p);
    let mut quarantined = store.quarantine_records(extent.from, extent.through);
    let before = quarantined.next().transpose()?.map(|q| q.position);
    let after = quarantined.next_back().transpose()?.map(|q| q.position);
    let first = before.map_or(first, |q| q.min(first));
    let last = after.or(before).map_or(last, |q| q.max(last));
    Ok(Some((first, last)))
}

/// Why copying the commits into the backup stopped.
enum Copied {
    Store(StoreError),
    Refused(CopyBackupError),
}

impl From<CopyBackupError> for Copied {
    fn from(e: CopyBackupError) -> Self {
        Copied::Refused(e)
    }
}

impl From<BackupError> for Copied {
    fn from(e: BackupError) -> Self {
        Copied::Refused(e.into())
    }
}

/// Every commit of the copy from `first` to `last` into `writer`, each checked, with a
/// placeholder at each position the replica quarantined. Returns the placeholders
/// written.
fn copy_commits(
    store: &ProjectionStore,
    writer: &mut BackupWriter,
    (subject_prefix, first, last): (&str, u64, u64),
    mut progress: impl FnMut(u64, u64),
) -> Result<u64, Copied> {
    let mut quarantined = store.quarantine_records(first, last).peekable();
    let mut placeholders = 0;
    let mut place_before = |position: u64, writer: &mut BackupWriter| -> Result<(), Copied> {
        while let Some(q) =
            quarantined.next_if(|q| q.as_ref().map_or(true, |q| q.position <= position))
        {
            let q = q.map_err(Copied::Store)?;
            // A commit the copy holds wins over a record at its position (none is
            // expected: the copy refuses what the projector quarantines).
            if q.position < position {
                writer.push(&placeholder(subject_prefix, &q))?;
                placeholders += 1;
            }
        }
        Ok(())
    };
    for entry in store.raw_commits(first, last) {
        let (position, bytes) = entry.map_err(Copied::Store)?;
        place_before(position, writer)?;
        let message = copied_message(subject_prefix, position, &bytes)?;
        let before = writer.quarantined();
        writer.push(&message)?;
        // The backup's fold decides chains as the stream's readers do: a commit the copy
        // kept is never one they would quarantine.
        if writer.quarantined() > before {
            return Err(CopyBackupError::Damaged {
                position,
                problem: "does not extend its aggregate's chain (a version out of order, or a link to a hash that is not its previous commit's)".into(),
            }
            .into());
        }
        if position % 4096 == 0 || position == last {
            progress(position, last);
        }
    }
    place_before(u64::MAX, writer)?;
    Ok(placeholders)
}

/// The longest reason a placeholder's payload repeats.
const PLACEHOLDER_REASON_CHARS_MAX: usize = 200;

/// What a backup from a copy holds at a position the replica quarantined, without a
/// message id. Undecodable entries (garbage) come back as they were when the quarantine
/// record kept all their bytes (its head holds up to 4 KiB), on the subject they came on.
/// A commit outside its chain (a forgery, a replay) was recorded by aggregate, without its
/// bytes: it comes back as a text saying what was there, on that aggregate's subject.
/// Anything else is such a text too, on its subject when that is an event subject of the
/// prefix, else on `<prefix>.ev.restore-quarantined`. Readers quarantine each again.
fn placeholder(subject_prefix: &str, q: &QuarantineRecord) -> RawMessage {
    let reason: String = q.error.chars().take(PLACEHOLDER_REASON_CHARS_MAX).collect();
    let said = |what: &str| {
        format!("provledger backup --from-copy: the replica quarantined {what} here ({reason}) and kept only its record")
            .into_bytes()
    };
    let (subject, payload) = match q.subject.parse::<AggregateId>() {
        Ok(aggregate) => (
            subject_for(subject_prefix, &aggregate),
            said(&format!("a commit of {aggregate} outside its chain")),
        ),
        Err(_) => match hex_bytes(&q.payload_head_hex) {
            Some(bytes) if bytes.len() == q.payload_len => (q.subject.clone(), bytes),
            _ => (
                q.subject.clone(),
                said(&format!("{} byte(s)", q.payload_len)),
            ),
        },
    };
    let mut message = RawMessage {
        position: q.position,
        subject,
        msg_id: None,
        payload: payload.into(),
    };
    if check_subject(subject_prefix, &message).is_err() {
        message.subject = format!("{subject_prefix}.ev.restore-quarantined");
    }
    message
}

/// The bytes of lower- or upper-case hex text (`None`: not hex).
fn hex_bytes(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The manifest's `server_version` for a backup from a copy: no server was read.
pub const COPY_SERVER_VERSION: &str = "none (a replica's copy)";

/// The message the stream held at `position`, from the copy's bytes there, once they are
/// checked to be an intact commit.
fn copied_message(
    subject_prefix: &str,
    position: u64,
    bytes: &[u8],
) -> Result<RawMessage, CopyBackupError> {
    let damaged = |problem: String| CopyBackupError::Damaged { position, problem };
    let commit =
        codec::decode(bytes, position).map_err(|e| damaged(format!("cannot be decoded ({e})")))?;
    if !commit.hash_is_valid() {
        return Err(damaged(format!(
            "({} v{}) does not match its hash: a byte of it changed",
            commit.aggregate, commit.version
        )));
    }
    // What the restore publishes must be the bytes the writer published: the codec's
    // encoding of the commit, which is what the copy keeps.
    match codec::encode(&commit) {
        Ok(encoded) if encoded == bytes => {}
        _ => {
            return Err(damaged(format!(
                "({} v{}) decodes, but not from the bytes its encoding makes (bytes added or changed where decoding does not look)",
                commit.aggregate, commit.version
            )))
        }
    }
    Ok(RawMessage::of_commit(
        subject_prefix,
        &commit,
        bytes.to_vec(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::catalogue::samples;
    use provledger_events::{Commit, CommitDraft, Event, Hash};
    use uuid::Uuid;

    fn commit(id: AggregateId, version: u64, prev: Hash, position: u64) -> Commit {
        let event: Event = samples::all().into_iter().next().expect("a sample event");
        let mut c = Commit::seal(id, version, prev, CommitDraft::now("t", vec![event]));
        c.position = position;
        c
    }

    /// A replica's data dir: a store of the stream PROVLEDGER keeping no copy in its
    /// projection, and its copy begun at `from`.
    fn replica(dir: &Path, from: u64) -> (sled::Db, log_copy::LogCopy) {
        let db = sled::open(dir.join("sled")).expect("sled");
        let store = ProjectionStore::open(&db).expect("store");
        store.claim_source("jetstream:PROVLEDGER").expect("source");
        store.keep_no_copy().expect("no copy in the projection");
        let copy = log_copy::LogCopy::open(&db, from).expect("copy");
        (db, copy)
    }

    fn backup(db: &sled::Db, dir: &Path) -> Result<CopyBackup, CopyBackupError> {
        let to = dir.join("backup");
        backup_from_copy(db, dir, "provledger", &to, Timestamp::now(), |_, _| {})
    }

    /// Given a copy begun at position 10 (its chains start part way), when it is backed
    /// up, then it is refused as beginning late, and no backup is started.
    #[test]
    fn a_copy_begun_late_is_refused_not_passed_as_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (db, mut copy) = replica(dir.path(), 10);
        let id = AggregateId::provider(Uuid::from_u128(1));
        copy.write(&[commit(id, 4, Hash([9; 32]), 12)], 12)
            .expect("write");
        match backup(&db, dir.path()) {
            Err(CopyBackupError::CopyStartsLate { from: 10, .. }) => {}
            other => panic!("expected CopyStartsLate, got {other:?}"),
        }
        assert!(!dir.path().join("backup").exists());
    }

    /// Given a whole copy of v1 and v2 of an aggregate, and a v3 at position 3 that matches
    /// its hash but links to v1 (written into the tree past the copier's check, as a
    /// damaged or altered copy would hold it), when it is backed up, then it is refused
    /// naming position 3, and the partial file is removed.
    #[test]
    fn a_copied_commit_outside_its_chain_is_refused_by_its_position() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (db, mut copy) = replica(dir.path(), 1);
        let id = AggregateId::provider(Uuid::from_u128(2));
        let v1 = commit(id, 1, Hash::ZERO, 1);
        let v2 = commit(id, 2, v1.hash, 2);
        let forked = commit(id, 3, v1.hash, 3);
        copy.write(&[v1, v2], 3).expect("write");
        let tree = db.open_tree(log_copy::COPY_TREE).expect("tree");
        let mut batch = sled::Batch::default();
        let mut packer = log_copy::pack::Packer::default();
        packer
            .push(&mut batch, 3, &codec::encode(&forked).expect("encodes"))
            .expect("pack");
        packer.close(&mut batch);
        tree.apply_batch(batch).expect("insert");
        match backup(&db, dir.path()) {
            Err(CopyBackupError::Damaged { position: 3, .. }) => {}
            other => panic!("expected Damaged at 3, got {other:?}"),
        }
        let left: Vec<_> = std::fs::read_dir(dir.path().join("backup"))
            .expect("the backup dir")
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
