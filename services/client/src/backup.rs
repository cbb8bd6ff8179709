//! Backup and restore of the JetStream log: the shell around `provledger_events::backup`
//! (the format, the manifest's fold and the checks, all pure). It reads the stream and
//! publishes a restore (`provledger_events::log::raw`), and reads and writes the backup's
//! two files; [`BackupWriter`] is the one writer of a backup, whatever its messages come
//! from (the stream here, a replica's copy in `provledger_serve::copy_backup`). docs/operating.md, "Backup and restore", is the procedure.

use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use provledger_events::backup::{
    check_backup, check_subject, compare_facts, parse_manifest, BackupFoldError, BackupRefusal,
    ContentFacts, ContentFold, CopyOrigin, FrameReader, Manifest, RawMessage, RepeatedId,
    BACKUP_FORMAT, MANIFEST_BYTES_MAX, STREAM_FILE_MAGIC,
};
use provledger_events::log::{
    JetStreamConfig, MissingStream, OpenJetStreamError, RestoreStreamError, RestoreTarget,
};
use provledger_events::{JetStreamLog, ReadError, Timestamp};

/// The backup's manifest, written last: a directory without it is no (finished) backup.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The stream's messages, framed.
pub const STREAM_FILE: &str = "stream.bin";
/// The suffix of a file being written; renamed away once whole and synced.
const PARTIAL_SUFFIX: &str = ".partial";
/// Messages a restore reads from `stream.bin` before publishing them.
const RESTORE_CHUNK_MESSAGES: usize = 256;

/// Why a backup could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error(
        "{dir} is not empty: a backup goes into a new or empty directory, never over another one"
    )]
    DirNotEmpty { dir: PathBuf },
    #[error("{path} is a file: a backup goes into a new or empty directory")]
    NotADirectory { path: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("the stream cannot be backed up: {0}")]
    Fold(#[from] BackupFoldError),
}

/// Why a restore was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("{dir} holds no {MANIFEST_FILE}: not a backup, or one whose writing never finished (the manifest is written last); give the directory `provledger backup --to` wrote")]
    NotABackup { dir: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the backup in {dir} is refused: {refusal}")]
    Refused {
        dir: PathBuf,
        #[source]
        refusal: BackupRefusal,
    },
    #[error("the backup holds subjects of prefix {backup}, not {given}: restore it with --subject-prefix {backup}")]
    PrefixMismatch { backup: String, given: String },
    #[error(transparent)]
    Stream(#[from] RestoreStreamError),
    #[error(transparent)]
    Open(#[from] OpenJetStreamError),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("the restored stream differs from the backup: {0}")]
    RestoredDiffers(#[source] BackupRefusal),
}

/// What a backup wrote.
#[derive(Debug, Clone)]
pub struct BackupSummary {
    pub manifest: Manifest,
    /// A message id found twice: the backup is whole, but a restore will refuse it.
    pub repeated_id: Option<RepeatedId>,
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> BackupError + '_ {
    move |source| BackupError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Makes `dir` (new, or empty), refusing one that holds anything.
fn empty_dir(dir: &Path) -> Result<(), BackupError> {
    match fs::read_dir(dir) {
        Ok(mut entries) => match entries.next() {
            None => Ok(()),
            Some(_) => Err(BackupError::DirNotEmpty {
                dir: dir.to_path_buf(),
            }),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::create_dir_all(dir).map_err(io_error(dir))
        }
        Err(e) if e.kind() == io::ErrorKind::NotADirectory => Err(BackupError::NotADirectory {
            path: dir.to_path_buf(),
        }),
        Err(e) => Err(io_error(dir)(e)),
    }
}

/// Writes `bytes` to `dir/name` durably: a `.partial` file synced, then renamed.
fn write_durably(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), BackupError> {
    let partial = dir.join(format!("{name}{PARTIAL_SUFFIX}"));
    let mut file = File::create(&partial).map_err(io_error(&partial))?;
    file.write_all(bytes).map_err(io_error(&partial))?;
    file.sync_all().map_err(io_error(&partial))?;
    let done = dir.join(name);
    fs::rename(&partial, &done).map_err(io_error(&done))
}

/// Makes the renames in `dir` durable.
fn sync_dir(dir: &Path) -> Result<(), BackupError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
}

/// A backup being written into its directory: `stream.bin` under its `.partial` name,
/// and the fold that makes its manifest. The one writer of a backup, whatever it reads
/// (the stream, or a replica's copy of it), so that both write the same format and
/// `restore` checks both alike.
pub struct BackupWriter {
    dir: PathBuf,
    partial: PathBuf,
    subject_prefix: String,
    out: BufWriter<File>,
    fold: ContentFold,
}

/// What a manifest says besides its content: the source and when.
#[derive(Debug, Clone)]
pub struct BackupSource {
    pub stream: String,
    pub taken_at: Timestamp,
    pub server_version: String,
    pub from_copy: Option<CopyOrigin>,
}

impl BackupWriter {
    /// Starts a backup of positions `first..=last` (each held, the holes between them
    /// found as messages come) of a stream of `subject_prefix` in `dir`, new or empty.
    pub fn create(
        dir: &Path,
        subject_prefix: &str,
        first: u64,
        last: u64,
    ) -> Result<Self, BackupError> {
        empty_dir(dir)?;
        let partial = dir.join(format!("{STREAM_FILE}{PARTIAL_SUFFIX}"));
        let file = File::create(&partial).map_err(io_error(&partial))?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(STREAM_FILE_MAGIC)
            .map_err(io_error(&partial))?;
        Ok(BackupWriter {
            dir: dir.to_path_buf(),
            partial,
            subject_prefix: subject_prefix.to_string(),
            out,
            fold: ContentFold::new(subject_prefix, first, last),
        })
    }

    /// Adds the next message (in position order).
    pub fn push(&mut self, message: &RawMessage) -> Result<(), BackupError> {
        let frame = self.fold.push(message)?;
        self.out.write_all(frame).map_err(io_error(&self.partial))
    }

    /// Messages pushed so far that are outside their aggregate's chain, as the stream's
    /// readers decide it.
    pub fn quarantined(&self) -> u64 {
        self.fold.quarantined()
    }

    /// Gives the backup up: its partial `stream.bin` is removed (best effort: a
    /// directory without `manifest.json` is no backup either way), so that the directory
    /// can take another.
    pub fn abandon(self) {
        drop(self.out);
        if let Err(e) = fs::remove_file(&self.partial) {
            tracing::warn!(path = %self.partial.display(), error = %e, "removing an abandoned backup's partial file");
        }
    }

    /// `stream.bin` synced and renamed, then `manifest.json` written the same way: a
    /// directory without the manifest is no (finished) backup.
    pub fn finish(self, source: BackupSource) -> Result<BackupSummary, BackupError> {
        let BackupWriter {
            dir,
            partial,
            subject_prefix,
            out,
            fold,
        } = self;
        let file = out
            .into_inner()
            .map_err(|e| io_error(&partial)(e.into_error()))?;
        file.sync_all().map_err(io_error(&partial))?;
        fs::rename(&partial, dir.join(STREAM_FILE)).map_err(io_error(&partial))?;
        let repeated_id = fold.repeated_id().cloned();
        let manifest = Manifest {
            backup_format: BACKUP_FORMAT,
            stream: source.stream,
            subject_prefix,
            taken_at: source.taken_at,
            server_version: source.server_version,
            from_copy: source.from_copy,
            content: fold.finish(),
        };
        let json = serde_json::to_vec_pretty(&manifest).expect(
            "a manifest: plain serde data (string keys, no fallible impls) encodes as JSON",
        );
        write_durably(&dir, MANIFEST_FILE, &json)?;
        sync_dir(&dir)?;
        tracing::info!(
            dir = %dir.display(),
            last = manifest.content.last_position,
            messages = manifest.content.messages,
            "backup written"
        );
        Ok(BackupSummary {
            manifest,
            repeated_id,
        })
    }
}

/// Backs up `log`'s stream into `dir` (new or empty), consistent at the stream's last
/// position when it starts: exactly `first..=last` as of then; later writes are not in it.
/// `stream.bin` is written first, then `manifest.json`, each to a `.partial` name synced
/// and renamed. `progress(position, last)` as messages are written.
pub async fn backup(
    log: &JetStreamLog,
    dir: &Path,
    taken_at: Timestamp,
    mut progress: impl FnMut(u64, u64),
) -> Result<BackupSummary, BackupError> {
    let bounds = log.stream_bounds().await?;
    let config = log.config();
    let mut writer = BackupWriter::create(dir, &config.subject_prefix, bounds.first, bounds.last)?;
    let mut next = bounds.first;
    while next <= bounds.last {
        let batch = log.read_raw_batch(next, bounds.last).await?;
        for message in &batch {
            writer.push(message)?;
        }
        // `read_raw_batch` answers at least one message or an error.
        next = batch.last().map_or(bounds.last + 1, |m| m.position + 1);
        progress(next - 1, bounds.last);
    }
    writer.finish(BackupSource {
        stream: config.stream.clone(),
        taken_at,
        server_version: log.server_version().to_string(),
        from_copy: None,
    })
}

fn restore_io(path: &Path) -> impl FnOnce(io::Error) -> RestoreError + '_ {
    move |source| RestoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads and parses `dir/manifest.json` (at most [`MANIFEST_BYTES_MAX`] bytes).
pub fn read_manifest(dir: &Path) -> Result<Manifest, RestoreError> {
    let path = dir.join(MANIFEST_FILE);
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(RestoreError::NotABackup {
                dir: dir.to_path_buf(),
            })
        }
        Err(e) => return Err(restore_io(&path)(e)),
    };
    let mut bytes = Vec::new();
    file.take(MANIFEST_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(restore_io(&path))?;
    let refused = |refusal| RestoreError::Refused {
        dir: dir.to_path_buf(),
        refusal,
    };
    if bytes.len() as u64 > MANIFEST_BYTES_MAX {
        return Err(refused(BackupRefusal::ManifestUnreadable {
            reason: format!("over MANIFEST_BYTES_MAX = {MANIFEST_BYTES_MAX} bytes"),
        }));
    }
    parse_manifest(&bytes).map_err(refused)
}

fn open_stream_file(dir: &Path) -> Result<BufReader<File>, RestoreError> {
    let path = dir.join(STREAM_FILE);
    let file = File::open(&path).map_err(restore_io(&path))?;
    Ok(BufReader::with_capacity(1 << 20, file))
}

/// Checks the backup in `dir` against its manifest, reading every byte of `stream.bin`
/// (`provledger_events::backup::check_backup`); nothing is published.
pub fn check(
    dir: &Path,
    manifest: &Manifest,
    progress: impl FnMut(u64),
) -> Result<(), RestoreError> {
    check_backup(manifest, open_stream_file(dir)?, progress).map_err(|refusal| {
        RestoreError::Refused {
            dir: dir.to_path_buf(),
            refusal,
        }
    })
}

/// Publishes the (checked) backup in `dir` into the stream `config` names on `client`,
/// which must hold nothing, at the same positions, then denies deletes on it. Each frame
/// is checked again as it is read (its checksum), and the whole content's blake3 at the
/// end. Returns the last position. `progress(position, last)` as messages are published.
pub async fn restore(
    client: async_nats::Client,
    config: JetStreamConfig,
    dir: &Path,
    manifest: &Manifest,
    mut progress: impl FnMut(u64, u64),
) -> Result<u64, RestoreError> {
    if config.subject_prefix != manifest.subject_prefix {
        return Err(RestoreError::PrefixMismatch {
            backup: manifest.subject_prefix.clone(),
            given: config.subject_prefix,
        });
    }
    let c = &manifest.content;
    let refused = |refusal| RestoreError::Refused {
        dir: dir.to_path_buf(),
        refusal,
    };
    let mut target =
        RestoreTarget::open(client, config, c.first_position, !c.holes.is_empty()).await?;
    let mut frames = FrameReader::new(open_stream_file(dir)?);
    let mut chunk = Vec::with_capacity(RESTORE_CHUNK_MESSAGES);
    loop {
        let message = frames.next_message().map_err(refused)?;
        let end = message.is_none();
        if let Some(m) = message {
            // Checked before, checked again: the file may have changed since.
            check_subject(&manifest.subject_prefix, &m).map_err(refused)?;
            chunk.push(m);
        }
        if chunk.len() >= RESTORE_CHUNK_MESSAGES || (end && !chunk.is_empty()) {
            target.publish(&chunk).await?;
            chunk.clear();
            progress(target.last_position(), c.last_position);
        }
        if end {
            break;
        }
    }
    let (bytes, blake3) = frames.content();
    if (bytes, &blake3) != (c.content_bytes, &c.content_blake3) {
        // stream.bin changed since it was checked: what was published is not the backup.
        return Err(refused(BackupRefusal::FactMismatch {
            what: "content blake3 (stream.bin changed during the restore)",
            manifest: c.content_blake3.clone(),
            content: blake3,
        }));
    }
    Ok(target.finish().await?)
}

/// Opens the restored stream as every provledger process does (its configuration
/// checked), reads it back whole and folds it as a backup would: its facts must be the
/// manifest's (the same bytes at the same positions, the same tips). Returns the log
/// and the facts read.
pub async fn read_back(
    client: async_nats::Client,
    config: JetStreamConfig,
    manifest: &Manifest,
    mut progress: impl FnMut(u64, u64),
) -> Result<(JetStreamLog, ContentFacts), RestoreError> {
    let log = JetStreamLog::open_with(client, config, MissingStream::Refuse).await?;
    let c = &manifest.content;
    let bounds = log.stream_bounds().await?;
    let mut fold = ContentFold::new(&manifest.subject_prefix, bounds.first, bounds.last);
    let mut next = bounds.first;
    while next <= bounds.last {
        let batch = log.read_raw_batch(next, bounds.last).await?;
        for m in &batch {
            fold.push(m).map_err(|e| {
                RestoreError::RestoredDiffers(BackupRefusal::ManifestInconsistent {
                    problem: e.to_string(),
                })
            })?;
        }
        next = batch.last().map_or(bounds.last + 1, |m| m.position + 1);
        progress(next - 1, bounds.last);
    }
    let facts = fold.finish();
    compare_facts(c, &facts).map_err(RestoreError::RestoredDiffers)?;
    Ok((log, facts))
}
