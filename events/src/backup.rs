//! Backups of the JetStream log, the pure part: the backup's format, the manifest built
//! from the stream's messages in position order, and the check of a backup's content
//! against its manifest. Reading the stream, publishing a restore and the files are the
//! shell's (`log/raw.rs`, `provledger_client::backup`).
//!
//! A backup is a directory holding two files (docs/operating.md, "Backup and restore"):
//! - `stream.bin`: [`STREAM_FILE_MAGIC`], then one frame per stored message in position
//!   order: `position u64 ‖ subject_len u16 ‖ subject ‖ has_msg_id u8 ‖ msg_id_len u16 ‖
//!   msg_id ‖ payload_len u32 ‖ payload ‖ blake3(the frame's bytes before it)`, integers
//!   little-endian. The frame's own hash names the position whose bytes changed.
//! - `manifest.json` ([`Manifest`]): the backup format, the stream's first and last
//!   positions, its holes, the counts, each aggregate's chain tip and the blake3 of the
//!   whole of `stream.bin`.
//!
//! The same fold ([`ContentFold`]) builds the manifest at backup time, checks a backup
//! before a restore publishes anything, and reads the restored stream back: the three
//! cannot disagree on what a tip or a hole is. A commit's position is not in its encoded
//! bytes (the stream sequence is), so a restore that keeps the bytes must also keep every
//! position, holes included.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read};

use serde::{Deserialize, Serialize};

use crate::codec;
use crate::commit::Commit;
use crate::ids::{AggregateId, Hash, Timestamp};
use crate::loss::LostVersions;

/// The format of a backup directory this build writes and reads.
pub const BACKUP_FORMAT: u32 = 1;
/// The first bytes of `stream.bin`: what it is, and its format.
pub const STREAM_FILE_MAGIC: &[u8; 8] = b"PLBAK\0\0\x01";
/// The longest subject a frame holds (nats-server's default control line is 4 KiB).
pub const FRAME_SUBJECT_BYTES_MAX: usize = 4096;
/// The longest `Nats-Msg-Id` a frame holds.
pub const FRAME_MSG_ID_BYTES_MAX: usize = 1024;
/// The largest payload a frame holds: nats-server's largest `max_payload` (64 MiB).
pub const FRAME_PAYLOAD_BYTES_MAX: usize = 64 << 20;
/// The largest `manifest.json` read (its tips grow with the aggregates: ~150 bytes each).
pub const MANIFEST_BYTES_MAX: u64 = 1 << 30;
/// The most holes a manifest lists: a stream with more lost ranges is not one to restore
/// without a person looking at it first.
pub const HOLES_MAX: usize = 100_000;
/// The most positions a manifest's holes may cover: a restore makes each one (a publish
/// and a delete), so a hostile or mistaken manifest must not ask for billions.
pub const HOLE_POSITIONS_MAX: u64 = 1_000_000;
const _: () = assert!(FRAME_SUBJECT_BYTES_MAX < u16::MAX as usize);
const _: () = assert!(FRAME_MSG_ID_BYTES_MAX < u16::MAX as usize);
const _: () = assert!(FRAME_PAYLOAD_BYTES_MAX < u32::MAX as usize);

/// One stored message of the stream: what a backup keeps of it and a restore publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage {
    /// The stream sequence: the commit's position.
    pub position: u64,
    pub subject: String,
    /// The `Nats-Msg-Id` header (the commit id), when the message had one.
    pub msg_id: Option<String>,
    pub payload: bytes::Bytes,
}

impl RawMessage {
    /// The message a writer published for `commit` (its encoded bytes `payload`): on its
    /// aggregate's subject under `subject_prefix`, with its commit id as `Nats-Msg-Id`,
    /// exactly as the JetStream log's append sends it (`crate::log::subject_for`,
    /// `crate::log::message_id`). What a backup from a replica's copy holds, since the
    /// copy keeps the commit's bytes but not the message's subject and headers.
    pub fn of_commit(subject_prefix: &str, commit: &Commit, payload: Vec<u8>) -> Self {
        RawMessage {
            position: commit.position,
            subject: crate::log::subject_for(subject_prefix, &commit.aggregate),
            msg_id: Some(crate::log::message_id(&commit.commit_id)),
            payload: payload.into(),
        }
    }
}

/// Positions the stream had assigned but no longer holds (a message the server dropped;
/// docs/operating.md, "A commit lost from the log"), inclusive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hole {
    pub from: u64,
    pub to: u64,
}

/// An aggregate's chain tip: its last commit in the chain (a loss included, as readers
/// follow it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tip {
    pub aggregate: String,
    pub version: u64,
    pub position: u64,
    pub hash: Hash,
}

/// `manifest.json`: what a backup holds, and what its content must match.
/// (Fields a later build adds are ignored by this one: a change that an older reader must
/// not ignore takes the next `backup_format`.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub backup_format: u32,
    pub stream: String,
    pub subject_prefix: String,
    pub taken_at: Timestamp,
    pub server_version: String,
    /// Set when the backup was written from a stopped replica's copy of the stream
    /// (`provledger backup --from-copy`), not read from the stream itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_copy: Option<CopyOrigin>,
    #[serde(flatten)]
    pub content: ContentFacts,
}

/// Where a backup written from a replica's copy came from, and what the copy covered: it
/// holds the commits of `copied_from..=copied_through` (the copy's `copied` mark; the
/// stream may have gone on past it), of which the backup's positions are the first and
/// last commit or quarantined entry. A position the replica quarantined (garbage, a
/// refused forgery) holds a placeholder that readers quarantine again; a position with
/// neither (lost by the stream) is a hole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyOrigin {
    pub copied_from: u64,
    pub copied_through: u64,
    /// Positions the replica had quarantined, held as placeholders (their bytes are not
    /// in the copy).
    pub placeholders: u64,
}

/// What the fold of a backup's messages finds: the part of the manifest its content must
/// reproduce exactly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentFacts {
    /// The stream's first and last positions at the backup (`last` < `first`: empty).
    pub first_position: u64,
    pub last_position: u64,
    /// Messages held: `last - first + 1` minus the holes.
    pub messages: u64,
    pub holes: Vec<Hole>,
    /// Commits in their aggregates' chains, and messages outside them (garbage, forged,
    /// replayed: what readers quarantine, kept as they are).
    pub commits: u64,
    pub quarantined: u64,
    pub aggregates: u64,
    /// Losses the chains reveal (a commit past its chain's next version).
    pub losses: u64,
    pub content_bytes: u64,
    pub content_blake3: String,
    /// Each aggregate's tip, in aggregate order.
    pub tips: Vec<Tip>,
}

/// Why a backup is refused: which check, and where.
#[derive(Debug, thiserror::Error)]
pub enum BackupRefusal {
    #[error("manifest.json cannot be read as a backup manifest: {reason}")]
    ManifestUnreadable { reason: String },
    #[error("manifest.json is of backup format {found}; this build reads format {BACKUP_FORMAT}")]
    UnknownFormat { found: u32 },
    #[error("manifest.json is inconsistent: {problem}")]
    ManifestInconsistent { problem: String },
    #[error("stream.bin does not start with a backup's header: not a provledger backup, or the wrong file")]
    NotAStreamFile,
    #[error(
        "stream.bin is malformed at byte {offset} (the frame after position {after}): {problem}"
    )]
    FrameMalformed {
        offset: u64,
        after: u64,
        problem: String,
    },
    #[error("position {position}: its frame's checksum does not match its bytes (stream.bin changed at byte {offset} or after)")]
    FrameChecksum { position: u64, offset: u64 },
    #[error("position {position} follows position {after}: positions must increase")]
    OutOfOrder { position: u64, after: u64 },
    #[error("position {position} is outside the manifest's range {first}..={last}")]
    OutsideRange {
        position: u64,
        first: u64,
        last: u64,
    },
    #[error(
        "position {position}: its subject {subject:?} is not an event subject of prefix {prefix}"
    )]
    ForeignSubject {
        position: u64,
        subject: String,
        prefix: String,
    },
    #[error(
        "position {position} is missing from stream.bin: the manifest says the stream held it"
    )]
    MissingMessage { position: u64 },
    #[error("position {position} is in stream.bin but the manifest lists it as a hole")]
    UnexpectedMessage { position: u64 },
    #[error("message id {msg_id:?} is at positions {first} and {again}: JetStream would drop the second as a duplicate, so a restore could not keep the positions")]
    RepeatedMessageId {
        msg_id: String,
        first: u64,
        again: u64,
    },
    #[error("{what}: the manifest says {manifest}, the content has {content}")]
    FactMismatch {
        what: &'static str,
        manifest: String,
        content: String,
    },
    #[error("chain tip of {aggregate}: the manifest says {manifest}, the content has {content}")]
    TipMismatch {
        aggregate: String,
        manifest: String,
        content: String,
    },
    #[error("reading stream.bin: {0}")]
    Io(#[from] io::Error),
}

/// Why a message cannot be written as a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("position {position}: its {part} is {size} bytes, over the backup's {max}-byte bound")]
    TooLarge {
        position: u64,
        part: &'static str,
        size: usize,
        max: usize,
    },
}

/// Appends `message` as one frame to `out`.
pub fn encode_frame(message: &RawMessage, out: &mut Vec<u8>) -> Result<(), FrameError> {
    let too_large = |part, size, max| FrameError::TooLarge {
        position: message.position,
        part,
        size,
        max,
    };
    let subject = message.subject.as_bytes();
    if subject.len() > FRAME_SUBJECT_BYTES_MAX {
        return Err(too_large("subject", subject.len(), FRAME_SUBJECT_BYTES_MAX));
    }
    let msg_id = message.msg_id.as_deref().unwrap_or("").as_bytes();
    if msg_id.len() > FRAME_MSG_ID_BYTES_MAX {
        return Err(too_large(
            "message id",
            msg_id.len(),
            FRAME_MSG_ID_BYTES_MAX,
        ));
    }
    if message.payload.len() > FRAME_PAYLOAD_BYTES_MAX {
        let size = message.payload.len();
        return Err(too_large("payload", size, FRAME_PAYLOAD_BYTES_MAX));
    }
    let start = out.len();
    out.extend_from_slice(&message.position.to_le_bytes());
    // The casts hold: each length was checked against a bound below its type's maximum.
    out.extend_from_slice(&(subject.len() as u16).to_le_bytes());
    out.extend_from_slice(subject);
    out.push(u8::from(message.msg_id.is_some()));
    out.extend_from_slice(&(msg_id.len() as u16).to_le_bytes());
    out.extend_from_slice(msg_id);
    out.extend_from_slice(&(message.payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&message.payload);
    let checksum = blake3::hash(&out[start..]);
    out.extend_from_slice(checksum.as_bytes());
    Ok(())
}

/// Reads the frames of a `stream.bin`, checking each frame's checksum, and hashes every
/// byte read (the content's blake3).
pub struct FrameReader<R> {
    source: R,
    hasher: blake3::Hasher,
    offset: u64,
    last_position: u64,
    started: bool,
    /// The bytes of the frame being read, for its checksum.
    frame: Vec<u8>,
}

impl<R: Read> FrameReader<R> {
    pub fn new(source: R) -> Self {
        FrameReader {
            source,
            hasher: blake3::Hasher::new(),
            offset: 0,
            last_position: 0,
            started: false,
            frame: Vec::new(),
        }
    }

    /// Appends exactly `n` bytes to the frame; `false` at a clean end of the file when
    /// `may_end` (the start of a frame).
    fn take(&mut self, n: usize, may_end: bool) -> Result<bool, BackupRefusal> {
        let start = self.frame.len();
        self.frame.resize(start + n, 0);
        let mut filled = 0;
        while filled < n {
            match self.source.read(&mut self.frame[start + filled..]) {
                Ok(0) if filled == 0 && may_end => return Ok(false),
                Ok(0) => {
                    return Err(self.malformed(format!(
                        "the file ends inside a frame ({filled} of {n} bytes)"
                    )))
                }
                Ok(read) => filled += read,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(BackupRefusal::Io(e)),
            }
        }
        self.hasher.update(&self.frame[start..]);
        self.offset += n as u64;
        Ok(true)
    }

    fn malformed(&self, problem: String) -> BackupRefusal {
        BackupRefusal::FrameMalformed {
            offset: self.offset,
            after: self.last_position,
            problem,
        }
    }

    /// A little-endian length of `width` bytes then that many bytes; the range of the
    /// bytes in the frame.
    fn part(
        &mut self,
        width: usize,
        max: usize,
        name: &str,
    ) -> Result<std::ops::Range<usize>, BackupRefusal> {
        let at = self.frame.len();
        self.take(width, false)?;
        let mut le = [0u8; 8];
        le[..width].copy_from_slice(&self.frame[at..]);
        let n = u64::from_le_bytes(le);
        let n = match usize::try_from(n) {
            Ok(n) if n <= max => n,
            _ => {
                return Err(
                    self.malformed(format!("a {name} of {n} bytes, over the {max}-byte bound"))
                )
            }
        };
        let body = self.frame.len();
        self.take(n, false)?;
        Ok(body..body + n)
    }

    /// The next message, `None` at the end of the file.
    pub fn next_message(&mut self) -> Result<Option<RawMessage>, BackupRefusal> {
        if !self.started {
            self.started = true;
            self.frame.clear();
            if !self.take(STREAM_FILE_MAGIC.len(), true)? || self.frame != STREAM_FILE_MAGIC {
                return Err(BackupRefusal::NotAStreamFile);
            }
        }
        let frame_offset = self.offset;
        self.frame.clear();
        if !self.take(8, true)? {
            return Ok(None);
        }
        let mut le = [0u8; 8];
        le.copy_from_slice(&self.frame[..8]);
        let position = u64::from_le_bytes(le);
        let subject = self.part(2, FRAME_SUBJECT_BYTES_MAX, "subject")?;
        self.take(1, false)?;
        let has_id = self.frame[subject.end];
        let msg_id = self.part(2, FRAME_MSG_ID_BYTES_MAX, "message id")?;
        let payload = self.part(4, FRAME_PAYLOAD_BYTES_MAX, "payload")?;
        let body_end = self.frame.len();
        self.take(32, false)?;
        if blake3::hash(&self.frame[..body_end]).as_bytes()[..] != self.frame[body_end..] {
            return Err(BackupRefusal::FrameChecksum {
                position,
                offset: frame_offset,
            });
        }
        let text = |range: std::ops::Range<usize>, what: &str| {
            String::from_utf8(self.frame[range].to_vec())
                .map_err(|_| self.malformed(format!("position {position}: a {what} not UTF-8")))
        };
        let subject = text(subject, "subject")?;
        let msg_id = match has_id {
            0 if msg_id.is_empty() => None,
            1 => Some(text(msg_id, "message id")?),
            _ => return Err(self.malformed(format!("position {position}: a bad message-id flag"))),
        };
        if position <= self.last_position {
            return Err(BackupRefusal::OutOfOrder {
                position,
                after: self.last_position,
            });
        }
        self.last_position = position;
        Ok(Some(RawMessage {
            position,
            subject,
            msg_id,
            payload: bytes::Bytes::copy_from_slice(&self.frame[payload]),
        }))
    }

    /// The bytes read so far and their blake3.
    pub fn content(&self) -> (u64, String) {
        (self.offset, self.hasher.finalize().to_hex().to_string())
    }
}

/// An aggregate's tip while folding.
#[derive(Debug, Clone, Copy)]
struct FoldTip {
    version: u64,
    position: u64,
    hash: Hash,
}

/// Folds a stream's messages in position order into [`ContentFacts`]: positions and
/// holes, the content's blake3 (over the frames as `stream.bin` holds them), the chains
/// and their tips, and repeated message ids. It decides what is in a chain as the
/// JetStream log's readers do (`classify`): an intact commit of the subject's aggregate at
/// the next version that links, or past it (a loss); anything else is quarantined.
pub struct ContentFold {
    subject_prefix: String,
    first: u64,
    end: u64,
    next: u64,
    messages: u64,
    holes: Vec<Hole>,
    commits: u64,
    quarantined: u64,
    losses: u64,
    tips: BTreeMap<AggregateId, FoldTip>,
    /// Each message id seen (as [`id_key`]) and its position.
    ids: HashMap<u128, u64>,
    repeated_id: Option<RepeatedId>,
    hasher: blake3::Hasher,
    bytes: u64,
    frame: Vec<u8>,
}

impl ContentFold {
    /// A fold of the positions `first..=end` of a stream of `subject_prefix`.
    pub fn new(subject_prefix: &str, first: u64, end: u64) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.update(STREAM_FILE_MAGIC);
        ContentFold {
            subject_prefix: subject_prefix.to_string(),
            first,
            end,
            next: first,
            messages: 0,
            holes: Vec::new(),
            commits: 0,
            quarantined: 0,
            losses: 0,
            tips: BTreeMap::new(),
            ids: HashMap::new(),
            repeated_id: None,
            hasher,
            bytes: STREAM_FILE_MAGIC.len() as u64,
            frame: Vec::new(),
        }
    }

    /// Adds the next message; returns its frame's bytes (what `stream.bin` holds for it).
    pub fn push(&mut self, message: &RawMessage) -> Result<&[u8], BackupFoldError> {
        let position = message.position;
        if position < self.next || position > self.end {
            return Err(BackupFoldError::Position {
                position,
                expected_from: self.next,
                end: self.end,
            });
        }
        if position > self.next {
            if self.holes.len() >= HOLES_MAX {
                return Err(BackupFoldError::TooManyHoles { max: HOLES_MAX });
            }
            self.holes.push(Hole {
                from: self.next,
                to: position - 1,
            });
        }
        self.next = position + 1;
        self.messages += 1;
        if let Some(id) = &message.msg_id {
            if let Some(first) = self.ids.insert(id_key(id), position) {
                self.repeated_id.get_or_insert(RepeatedId {
                    msg_id: id.clone(),
                    first,
                    again: position,
                });
            }
        }
        self.classify(message);
        self.frame.clear();
        encode_frame(message, &mut self.frame).map_err(BackupFoldError::Frame)?;
        self.hasher.update(&self.frame);
        self.bytes += self.frame.len() as u64;
        Ok(&self.frame)
    }

    fn classify(&mut self, message: &RawMessage) {
        let Ok(commit) = codec::decode(&message.payload, message.position) else {
            self.quarantined += 1;
            return;
        };
        let subject = crate::log::subject_for(&self.subject_prefix, &commit.aggregate);
        let tip = self
            .tips
            .get(&commit.aggregate)
            .copied()
            .unwrap_or(FoldTip {
                version: 0,
                position: 0,
                hash: Hash::ZERO,
            });
        let in_chain = subject == message.subject
            && commit.hash_is_valid()
            && commit.version > tip.version
            && (commit.prev_hash == tip.hash
                || LostVersions::before(&commit.aggregate, tip.version, &commit).is_some());
        if !in_chain {
            self.quarantined += 1;
            return;
        }
        if commit.version > tip.version + 1 {
            self.losses += 1;
        }
        self.commits += 1;
        self.tips.insert(
            commit.aggregate,
            FoldTip {
                version: commit.version,
                position: commit.position,
                hash: commit.hash,
            },
        );
    }

    /// The facts of everything pushed. Positions after the last message up to `end` are
    /// not a hole: a backup reads up to the stream's last message, which the stream holds.
    pub fn finish(self) -> ContentFacts {
        ContentFacts {
            first_position: self.first,
            last_position: self.end,
            messages: self.messages,
            holes: self.holes,
            commits: self.commits,
            quarantined: self.quarantined,
            aggregates: self.tips.len() as u64,
            losses: self.losses,
            content_bytes: self.bytes,
            content_blake3: self.hasher.finalize().to_hex().to_string(),
            tips: self
                .tips
                .into_iter()
                .map(|(aggregate, t)| Tip {
                    aggregate: aggregate.to_string(),
                    version: t.version,
                    position: t.position,
                    hash: t.hash,
                })
                .collect(),
        }
    }

    /// The first message id found twice: a backup holding one cannot be restored with its
    /// positions, since JetStream drops a repeated `Nats-Msg-Id` inside its duplicate
    /// window (a restore publishes the whole stream inside one).
    pub fn repeated_id(&self) -> Option<&RepeatedId> {
        self.repeated_id.as_ref()
    }

    /// Messages pushed so far that are outside their aggregate's chain (what readers
    /// quarantine).
    pub fn quarantined(&self) -> u64 {
        self.quarantined
    }

    /// The next position expected (one past the last pushed).
    pub fn next_position(&self) -> u64 {
        self.next
    }
}

/// A message id as a set key: a commit id's 128 bits, or the first 128 bits of the blake3
/// of any other id, so the set costs 16 bytes a message whatever the ids are.
fn id_key(id: &str) -> u128 {
    match uuid::Uuid::parse_str(id) {
        Ok(uuid) => uuid.as_u128(),
        Err(_) => {
            let hash = blake3::hash(id.as_bytes());
            let mut first = [0u8; 16];
            first.copy_from_slice(&hash.as_bytes()[..16]);
            u128::from_le_bytes(first)
        }
    }
}

/// A message id at two positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepeatedId {
    pub msg_id: String,
    pub first: u64,
    pub again: u64,
}

/// Why a message cannot be added to a backup's fold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BackupFoldError {
    #[error("position {position} is not where the next message can be (from {expected_from} up to {end})")]
    Position {
        position: u64,
        expected_from: u64,
        end: u64,
    },
    #[error("the stream has more than {max} holes (HOLES_MAX): look at it before backing it up")]
    TooManyHoles { max: usize },
    #[error(transparent)]
    Frame(FrameError),
}

/// Parses `manifest.json`'s bytes and checks what it says about itself.
pub fn parse_manifest(bytes: &[u8]) -> Result<Manifest, BackupRefusal> {
    // The format first: a newer backup is named as such, not as unreadable.
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| BackupRefusal::ManifestUnreadable {
            reason: e.to_string(),
        })?;
    match value
        .get("backup_format")
        .and_then(serde_json::Value::as_u64)
    {
        Some(f) if f == u64::from(BACKUP_FORMAT) => {}
        Some(f) => {
            return Err(BackupRefusal::UnknownFormat {
                found: u32::try_from(f).unwrap_or(u32::MAX),
            })
        }
        None => {
            return Err(BackupRefusal::ManifestUnreadable {
                reason: "no backup_format".into(),
            })
        }
    }
    let manifest: Manifest =
        serde_json::from_value(value).map_err(|e| BackupRefusal::ManifestUnreadable {
            reason: e.to_string(),
        })?;
    let inconsistent = |problem: String| Err(BackupRefusal::ManifestInconsistent { problem });
    let c = &manifest.content;
    if c.first_position == 0 {
        return inconsistent("first_position is 0 (positions start at 1)".into());
    }
    // Text a terminal shows: no control character (an escape sequence could rewrite it).
    let texts = [
        ("stream", &manifest.stream),
        ("subject_prefix", &manifest.subject_prefix),
        ("server_version", &manifest.server_version),
    ];
    if let Some((field, text)) = texts.iter().find(|(_, t)| t.chars().any(char::is_control)) {
        return inconsistent(format!("{field} {text:?} holds control characters"));
    }
    // Each tip names an aggregate as provledger writes it (so a refusal can name it).
    if let Some(tip) = c.tips.iter().find(|t| {
        t.aggregate
            .parse::<AggregateId>()
            .map_or(true, |a| a.to_string() != t.aggregate)
    }) {
        return inconsistent(format!(
            "a tip of {:?}, which is no aggregate",
            tip.aggregate
        ));
    }
    // No stream gets near it, and below it no position arithmetic here can overflow.
    if c.last_position >= 1 << 63 || c.first_position >= 1 << 63 {
        return inconsistent(format!(
            "positions {}..={} are past 2^63, which no stream reaches",
            c.first_position, c.last_position
        ));
    }
    if c.last_position + 1 < c.first_position {
        return inconsistent(format!(
            "last_position {} is before first_position {} - 1",
            c.last_position, c.first_position
        ));
    }
    if c.holes.len() > HOLES_MAX {
        return inconsistent(format!(
            "{} holes, over HOLES_MAX = {HOLES_MAX}",
            c.holes.len()
        ));
    }
    let mut after = c.first_position;
    let mut missing = 0u64;
    for h in &c.holes {
        if h.from <= after || h.to < h.from || h.to >= c.last_position {
            return inconsistent(format!(
                "hole {}..={} is not inside {}..{} after the hole before it",
                h.from, h.to, c.first_position, c.last_position
            ));
        }
        missing += h.to - h.from + 1;
        after = h.to + 1;
    }
    if missing > HOLE_POSITIONS_MAX {
        return inconsistent(format!(
            "its holes cover {missing} positions, over HOLE_POSITIONS_MAX = {HOLE_POSITIONS_MAX}"
        ));
    }
    let span = (c.last_position + 1).saturating_sub(c.first_position);
    if span.checked_sub(missing) != Some(c.messages) {
        return inconsistent(format!(
            "{} messages in {}..={} with {missing} position(s) in holes",
            c.messages, c.first_position, c.last_position
        ));
    }
    Ok(manifest)
}

/// Checks a backup's `stream.bin` (read from `source`) against its manifest: every frame's
/// checksum, subjects, positions and holes, message ids, then the facts (counts, content
/// blake3, chain tips). `progress(position)` is called as messages are read. The first
/// problem found is the answer.
pub fn check_backup<R: Read>(
    manifest: &Manifest,
    source: R,
    mut progress: impl FnMut(u64),
) -> Result<(), BackupRefusal> {
    let c = &manifest.content;
    let mut reader = FrameReader::new(source);
    let mut fold = ContentFold::new(&manifest.subject_prefix, c.first_position, c.last_position);
    let mut holes = c.holes.iter().peekable();
    while let Some(message) = reader.next_message()? {
        let position = message.position;
        if position > c.last_position {
            return Err(BackupRefusal::OutsideRange {
                position,
                first: c.first_position,
                last: c.last_position,
            });
        }
        check_subject(&manifest.subject_prefix, &message)?;
        // Every position from the last one up to this one is either a listed hole or lost
        // from the backup.
        let mut expected = fold.next_position();
        while expected < position {
            match holes.peek() {
                Some(h) if h.from == expected && h.to < position => {
                    expected = h.to + 1;
                    holes.next();
                }
                _ => return Err(BackupRefusal::MissingMessage { position: expected }),
            }
        }
        if holes
            .peek()
            .is_some_and(|h| h.from <= position && position <= h.to)
        {
            return Err(BackupRefusal::UnexpectedMessage { position });
        }
        fold.push(&message)
            .map_err(|e| BackupRefusal::ManifestInconsistent {
                problem: e.to_string(),
            })?;
        if let Some(r) = fold.repeated_id() {
            return Err(BackupRefusal::RepeatedMessageId {
                msg_id: r.msg_id.clone(),
                first: r.first,
                again: r.again,
            });
        }
        progress(position);
    }
    if fold.next_position() <= c.last_position {
        return Err(BackupRefusal::MissingMessage {
            position: fold.next_position(),
        });
    }
    let facts = fold.finish();
    let (bytes, blake3) = reader.content();
    // What was read is what the fold hashed; a difference would be a bug in this module.
    assert_eq!(
        (bytes, &blake3),
        (facts.content_bytes, &facts.content_blake3),
        "the fold re-encodes each frame as read"
    );
    compare_facts(c, &facts)
}

/// Refuses a message whose subject is not an event subject of `prefix` that NATS takes for
/// a publish: what a restore would publish must land in the log's stream and nowhere else.
pub fn check_subject(prefix: &str, message: &RawMessage) -> Result<(), BackupRefusal> {
    let events_of_prefix = message
        .subject
        .strip_prefix(prefix)
        .is_some_and(|rest| rest.starts_with(".ev."));
    if events_of_prefix && is_plain_subject(&message.subject) {
        return Ok(());
    }
    Err(BackupRefusal::ForeignSubject {
        position: message.position,
        subject: message.subject.clone(),
        prefix: prefix.to_string(),
    })
}

/// A subject as NATS takes it for a publish: non-empty tokens, no wildcard, no whitespace
/// or control character.
fn is_plain_subject(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|t| {
            !t.is_empty()
                && t != "*"
                && t != ">"
                && !t.chars().any(|c| c.is_whitespace() || c.is_control())
        })
}

/// The first difference between what a manifest says and what a content has.
pub fn compare_facts(manifest: &ContentFacts, content: &ContentFacts) -> Result<(), BackupRefusal> {
    let mismatch = |what, m: String, c: String| {
        Err(BackupRefusal::FactMismatch {
            what,
            manifest: m,
            content: c,
        })
    };
    let counts = [
        (
            "first position",
            manifest.first_position,
            content.first_position,
        ),
        (
            "last position",
            manifest.last_position,
            content.last_position,
        ),
        ("messages", manifest.messages, content.messages),
        ("commits in chains", manifest.commits, content.commits),
        (
            "quarantined messages",
            manifest.quarantined,
            content.quarantined,
        ),
        ("aggregates", manifest.aggregates, content.aggregates),
        ("losses", manifest.losses, content.losses),
        (
            "content bytes",
            manifest.content_bytes,
            content.content_bytes,
        ),
    ];
    for (what, m, c) in counts {
        if m != c {
            return mismatch(what, m.to_string(), c.to_string());
        }
    }
    if manifest.holes != content.holes {
        return mismatch(
            "holes",
            format!("{:?}", manifest.holes),
            format!("{:?}", content.holes),
        );
    }
    if manifest.content_blake3 != content.content_blake3 {
        return mismatch(
            "content blake3",
            manifest.content_blake3.clone(),
            content.content_blake3.clone(),
        );
    }
    let tip_text = |t: &Tip| format!("v{} at position {} hash {}", t.version, t.position, t.hash);
    let mut theirs = content.tips.iter();
    for mine in &manifest.tips {
        match theirs.next() {
            Some(t) if t == mine => {}
            Some(t) if t.aggregate == mine.aggregate => {
                return Err(BackupRefusal::TipMismatch {
                    aggregate: mine.aggregate.clone(),
                    manifest: tip_text(mine),
                    content: tip_text(t),
                })
            }
            other => {
                return Err(BackupRefusal::TipMismatch {
                    aggregate: mine.aggregate.clone(),
                    manifest: tip_text(mine),
                    content: match other {
                        Some(t) => format!("{} there instead", t.aggregate),
                        None => "no such aggregate".into(),
                    },
                })
            }
        }
    }
    if let Some(extra) = theirs.next() {
        return Err(BackupRefusal::TipMismatch {
            aggregate: extra.aggregate.clone(),
            manifest: "no such aggregate".into(),
            content: tip_text(extra),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(position: u64, payload: &'static [u8]) -> RawMessage {
        RawMessage {
            position,
            subject: format!("provledger.ev.cluster.{position}"),
            msg_id: Some(format!("id-{position}")),
            payload: bytes::Bytes::from_static(payload),
        }
    }

    /// `stream.bin` and the manifest of `messages` folded over `first..=end`.
    fn backup_of(messages: &[RawMessage], first: u64, end: u64) -> (Vec<u8>, Manifest) {
        let mut fold = ContentFold::new("provledger", first, end);
        let mut bytes = STREAM_FILE_MAGIC.to_vec();
        for m in messages {
            bytes.extend_from_slice(fold.push(m).unwrap());
        }
        let manifest = Manifest {
            backup_format: BACKUP_FORMAT,
            stream: "PROVLEDGER".into(),
            subject_prefix: "provledger".into(),
            taken_at: Timestamp::from_unix_ms(0),
            server_version: "2.14.6".into(),
            from_copy: None,
            content: fold.finish(),
        };
        (bytes, manifest)
    }

    #[test]
    fn a_backup_reads_back_as_written_with_its_hole_and_quarantine_counted() {
        // Given messages at 1, 2 and 4 (3 lost by the server), none a commit,
        let messages = [message(1, b"a"), message(2, b""), message(4, b"garbage")];
        // when they are folded and framed,
        let (bytes, manifest) = backup_of(&messages, 1, 4);
        // then the manifest names the hole and counts them as quarantined,
        let c = &manifest.content;
        assert_eq!(c.holes, vec![Hole { from: 3, to: 3 }]);
        assert_eq!((c.messages, c.quarantined, c.commits), (3, 3, 0));
        assert_eq!(c.content_bytes, bytes.len() as u64);
        // the frames read back to the same messages, and the whole checks out,
        let mut reader = FrameReader::new(bytes.as_slice());
        for m in &messages {
            assert_eq!(reader.next_message().unwrap().as_ref(), Some(m));
        }
        assert!(reader.next_message().unwrap().is_none());
        let json = serde_json::to_vec(&manifest).unwrap();
        assert_eq!(parse_manifest(&json).unwrap(), manifest);
        check_backup(&manifest, bytes.as_slice(), |_| {}).unwrap();
    }

    #[test]
    fn a_cut_file_or_a_manifest_that_miscounts_is_refused() {
        // Given a good backup of two messages,
        let (bytes, manifest) = backup_of(&[message(1, b"a"), message(2, b"b")], 1, 2);
        // when stream.bin loses its last byte, then the read says where it broke;
        let cut = &bytes[..bytes.len() - 1];
        let refusal = check_backup(&manifest, cut, |_| {}).unwrap_err();
        assert!(
            matches!(refusal, BackupRefusal::FrameMalformed { after: 1, .. }),
            "{refusal}"
        );
        // when the manifest claims a third message, then it is inconsistent with its range;
        let mut wrong = manifest.clone();
        wrong.content.messages = 3;
        let refusal = parse_manifest(&serde_json::to_vec(&wrong).unwrap()).unwrap_err();
        assert!(
            matches!(refusal, BackupRefusal::ManifestInconsistent { .. }),
            "{refusal}"
        );
        // when it claims a position no stream reaches, then it is refused, not overflowed;
        let mut huge = manifest.clone();
        huge.content.last_position = u64::MAX;
        let refusal = parse_manifest(&serde_json::to_vec(&huge).unwrap()).unwrap_err();
        assert!(
            matches!(refusal, BackupRefusal::ManifestInconsistent { .. }),
            "{refusal}"
        );
        // when it names a tip that is no aggregate (an escape sequence), then it is refused;
        let mut forged = manifest.clone();
        forged.content.tips.push(Tip {
            aggregate: "cluster/\u{1b}[2J".into(),
            version: 1,
            position: 1,
            hash: Hash::ZERO,
        });
        let refusal = parse_manifest(&serde_json::to_vec(&forged).unwrap()).unwrap_err();
        assert!(
            matches!(refusal, BackupRefusal::ManifestInconsistent { .. }),
            "{refusal}"
        );
        // and a manifest of a newer backup format is named as such.
        let mut newer = serde_json::to_value(&manifest).unwrap();
        newer["backup_format"] = (BACKUP_FORMAT + 1).into();
        let refusal = parse_manifest(&serde_json::to_vec(&newer).unwrap()).unwrap_err();
        assert!(
            matches!(refusal, BackupRefusal::UnknownFormat { found } if found == BACKUP_FORMAT + 1),
            "{refusal}"
        );
    }

    #[test]
    fn a_repeated_message_id_is_refused_before_a_restore_could_lose_its_position() {
        // Given two messages with the same Nats-Msg-Id,
        let mut second = message(2, b"b");
        second.msg_id = Some("id-1".into());
        let (bytes, manifest) = backup_of(&[message(1, b"a"), second], 1, 2);
        // when the backup is checked, then the repeat is named with both positions.
        let refusal = check_backup(&manifest, bytes.as_slice(), |_| {}).unwrap_err();
        assert!(
            matches!(
                &refusal,
                BackupRefusal::RepeatedMessageId {
                    first: 1,
                    again: 2,
                    ..
                }
            ),
            "{refusal}"
        );
    }
}
