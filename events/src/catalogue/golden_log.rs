//! The golden logs: streams of commits written once by the build of their day and kept in
//! `events/tests/golden/log/`, which every later build must decode, verify and fold the same
//! way (docs/events.md, "The golden log"). This module reads them for the tests of
//! `provledger-events` and `provledger-projections`; it is not part of the API.
//!
//! A file is the [`MAGIC`] then its entries, each `u64 BE position | u16 BE subject length |
//! subject | u32 BE payload length | payload`, in position order. The subject is the
//! aggregate's JetStream subject (`provledger.ev.<kind>.<id>`), the payload the exact bytes
//! `codec::encode` wrote. A file is never rewritten: each is pinned by its BLAKE3 and its
//! number of entries in [`LOGS`], and a catalogue change adds the next `log-N.bin`.

use std::path::PathBuf;

/// The first bytes of a golden log file (the last byte is the file layout's version).
pub const MAGIC: &[u8; 8] = b"PLGLOG\0\x01";
/// The most entries a golden log may hold: a reader allocates nothing beyond this.
pub const ENTRIES_MAX: usize = 100_000;
/// The longest subject an entry may name.
pub const SUBJECT_BYTES_MAX: usize = 256;

/// One golden log as pinned: its file name, the BLAKE3 of the file (hex), its entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pinned {
    pub file: &'static str,
    pub blake3: &'static str,
    pub entries: usize,
}

/// Every golden log, oldest first. Appended to, never edited: a file listed here is never
/// regenerated.
pub const LOGS: &[Pinned] = &[Pinned {
    file: "log-1.bin",
    blake3: "69f1cc78d37b758ef5ba135481e193bb9b0bcf227ee7c01a9a52a40a5b37f5a4",
    entries: 185,
}];

/// Why a golden log could not be read, or is not the file pinned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GoldenLogError {
    #[error("{path}: {reason}")]
    Unreadable { path: String, reason: String },
    #[error(
        "{path} changed: its BLAKE3 is {found}, pinned {pinned}. A golden log is never \
         regenerated or edited: restore it from git (docs/events.md, \"The golden log\")"
    )]
    Changed {
        path: String,
        found: String,
        pinned: String,
    },
    #[error("{path} holds {found} entries, pinned {pinned}")]
    EntryCount {
        path: String,
        found: usize,
        pinned: usize,
    },
    #[error("not a golden log: the magic PLGLOG\\0\\x01 is missing")]
    NoMagic,
    #[error("more than {ENTRIES_MAX} entries")]
    TooManyEntries,
    /// Entry `entry` (counted from 0) is cut short, too large or out of order.
    #[error("entry {entry}: {problem}")]
    Entry { entry: usize, problem: String },
}

/// One entry of a golden log: one message of the stream as JetStream stored it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoldenEntry {
    pub position: u64,
    pub subject: String,
    pub payload: Vec<u8>,
}

/// Where the golden logs are, in the source tree of `provledger-events`.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/log")
}

/// The BLAKE3 of `bytes`, in hex.
pub fn digest(bytes: &[u8]) -> String {
    blake3::hash(bytes).to_hex().to_string()
}

/// The file of `log` as its entries, after checking it is the file pinned: same BLAKE3, same
/// number of entries. An error says what differs and that the file is never regenerated.
pub fn open(log: &Pinned) -> Result<Vec<GoldenEntry>, GoldenLogError> {
    let path = dir().join(log.file);
    let shown = path.display().to_string();
    let bytes = std::fs::read(&path).map_err(|e| GoldenLogError::Unreadable {
        path: shown.clone(),
        reason: e.to_string(),
    })?;
    let found = digest(&bytes);
    if found != log.blake3 {
        return Err(GoldenLogError::Changed {
            path: shown,
            found,
            pinned: log.blake3.into(),
        });
    }
    let entries = read(&bytes)?;
    if entries.len() != log.entries {
        return Err(GoldenLogError::EntryCount {
            path: shown,
            found: entries.len(),
            pinned: log.entries,
        });
    }
    Ok(entries)
}

/// Parses a golden log file. Bounded: at most [`ENTRIES_MAX`] entries, subjects of at most
/// [`SUBJECT_BYTES_MAX`] bytes and payloads of at most `codec::ENCODED_COMMIT_BYTES_MAX`;
/// positions strictly increase. Never panics.
pub fn read(bytes: &[u8]) -> Result<Vec<GoldenEntry>, GoldenLogError> {
    let mut rest = bytes
        .strip_prefix(MAGIC.as_slice())
        .ok_or(GoldenLogError::NoMagic)?;
    let mut entries = Vec::new();
    while !rest.is_empty() {
        if entries.len() == ENTRIES_MAX {
            return Err(GoldenLogError::TooManyEntries);
        }
        let at = entries.len();
        let position = u64::from_be_bytes(take::<8>(&mut rest, at, "position")?);
        let subject_len = usize::from(u16::from_be_bytes(take::<2>(&mut rest, at, "subject")?));
        if subject_len > SUBJECT_BYTES_MAX {
            return Err(entry_error(
                at,
                format!("a subject of {subject_len} bytes (at most {SUBJECT_BYTES_MAX})"),
            ));
        }
        let subject = std::str::from_utf8(take_slice(&mut rest, subject_len, at, "subject")?)
            .map_err(|e| entry_error(at, format!("the subject is not UTF-8: {e}")))?
            .to_string();
        let payload_len = u32::from_be_bytes(take::<4>(&mut rest, at, "payload")?);
        let payload_len = usize::try_from(payload_len).unwrap_or(usize::MAX);
        if payload_len > crate::codec::ENCODED_COMMIT_BYTES_MAX {
            return Err(entry_error(
                at,
                format!(
                    "a payload of {payload_len} bytes (at most {})",
                    crate::codec::ENCODED_COMMIT_BYTES_MAX
                ),
            ));
        }
        let payload = take_slice(&mut rest, payload_len, at, "payload")?.to_vec();
        if let Some(last) = entries.last().map(|e: &GoldenEntry| e.position) {
            if position <= last {
                return Err(entry_error(
                    at,
                    format!("position {position} after {last} (positions increase)"),
                ));
            }
        }
        entries.push(GoldenEntry {
            position,
            subject,
            payload,
        });
    }
    Ok(entries)
}

/// The file holding `entries`: the inverse of [`read`]. For the generator only.
pub fn write(entries: &[GoldenEntry]) -> Result<Vec<u8>, GoldenLogError> {
    let mut out = MAGIC.to_vec();
    for (at, entry) in entries.iter().enumerate() {
        let problem = |problem: String| GoldenLogError::Entry { entry: at, problem };
        let subject_len = u16::try_from(entry.subject.len())
            .ok()
            .filter(|len| usize::from(*len) <= SUBJECT_BYTES_MAX)
            .ok_or_else(|| problem(format!("subject {:?} is too long", entry.subject)))?;
        let payload_len = u32::try_from(entry.payload.len())
            .ok()
            .filter(|_| entry.payload.len() <= crate::codec::ENCODED_COMMIT_BYTES_MAX)
            .ok_or_else(|| problem(format!("the payload at {} is too large", entry.position)))?;
        out.extend_from_slice(&entry.position.to_be_bytes());
        out.extend_from_slice(&subject_len.to_be_bytes());
        out.extend_from_slice(entry.subject.as_bytes());
        out.extend_from_slice(&payload_len.to_be_bytes());
        out.extend_from_slice(&entry.payload);
    }
    Ok(out)
}

fn entry_error(entry: usize, problem: String) -> GoldenLogError {
    GoldenLogError::Entry { entry, problem }
}

/// The next `N` bytes of `rest` as an array, or which field of entry `at` is cut short.
fn take<const N: usize>(
    rest: &mut &[u8],
    at: usize,
    field: &str,
) -> Result<[u8; N], GoldenLogError> {
    let slice = take_slice(rest, N, at, field)?;
    let mut out = [0u8; N];
    out.copy_from_slice(slice);
    Ok(out)
}

/// The next `len` bytes of `rest`, or which field of entry `at` is cut short.
fn take_slice<'a>(
    rest: &mut &'a [u8],
    len: usize,
    at: usize,
    field: &str,
) -> Result<&'a [u8], GoldenLogError> {
    if rest.len() < len {
        return Err(entry_error(
            at,
            format!(
                "the {field} is cut short ({} bytes left, {len} needed)",
                rest.len()
            ),
        ));
    }
    let (head, tail) = rest.split_at(len);
    *rest = tail;
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(position: u64, subject: &str, payload: &[u8]) -> GoldenEntry {
        GoldenEntry {
            position,
            subject: subject.into(),
            payload: payload.to_vec(),
        }
    }

    #[test]
    fn given_entries_when_written_then_read_gives_them_back() {
        let entries = vec![
            entry(1, "provledger.ev.cluster.x", &[1, 2, 3]),
            entry(3, "s", &[]),
        ];
        let bytes = write(&entries).unwrap();
        assert!(bytes.starts_with(MAGIC));
        assert_eq!(read(&bytes).unwrap(), entries);
    }

    #[test]
    fn given_damaged_files_when_read_then_each_is_an_error_not_a_panic() {
        let bytes = write(&[entry(2, "s", &[9; 10]), entry(5, "t", &[7])]).unwrap();
        // Given the file cut anywhere, then only a cut between entries reads (fewer entries).
        let first_ends = MAGIC.len() + 8 + 2 + 1 + 4 + 10;
        for cut in 0..bytes.len() {
            let between = cut == MAGIC.len() || cut == first_ends;
            assert_eq!(read(&bytes[..cut]).is_ok(), between, "cut at {cut}");
        }
        let mut reordered = write(&[entry(5, "s", &[]), entry(5, "t", &[])]).unwrap();
        let err = read(&reordered).unwrap_err();
        assert!(err.to_string().contains("positions increase"), "{err}");
        reordered[0] = b'X';
        assert_eq!(read(&reordered), Err(GoldenLogError::NoMagic));
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&1u64.to_be_bytes());
        huge.extend_from_slice(&0u16.to_be_bytes());
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(read(&huge).unwrap_err().to_string().contains("at most"));
    }
}
