//! How the copy keeps its commits: packs of consecutive commits under one key.
//!
//! Why packs: sled 0.34 pays about 10 µs of CPU per key written in position order (it
//! copies the growing leaf on every insert), which at 64 clients was 7% of the machine's
//! CPU per commit, a tenth of what a commit costs. Under one key per pack of up to
//! [`PACK_COMMITS_MAX`] commits it pays under 1 µs per commit (measured on this machine:
//! 9.6-9.9 µs per key alone, 0.6-1.3 µs per commit in packs of 16-64).
//!
//! Layout: `p` + the pack's first position (8 bytes, big-endian) → [`PACK_FORMAT`], then
//! per commit its position (8 bytes), its length (4 bytes, both big-endian) and the codec's
//! bytes, in position order. Positions in a pack need not follow each other: a position
//! the copy refused or the projector quarantined has no entry. Packs never overlap: each
//! one's first position is after the last one's last. A pack is written whole, in the
//! sled batch that marks its positions copied, and never rewritten.
//!
//! Copies kept before packs (`c` + position per commit, in the tree [`OLDER_COPY_TREE`])
//! are packed into [`COPY_TREE`] when the data dir is next opened ([`pack_older_layout`]).

use std::collections::VecDeque;
use std::ops::Range;

use super::{COPY_TREE, OLDER_COPY_TREE};
use crate::store::{be_u64, StoreError};

/// Commits a pack holds at most.
pub const PACK_COMMITS_MAX: usize = 64;
/// Bytes a pack's value holds at most, unless one commit alone is larger (it is then a pack
/// of its own). sled 0.34 splits a leaf past 16 keys and writes a page over 128 KiB (a
/// quarter of its segment) to a file of its own: 17 packs of this size stay inline.
pub const PACK_BYTES_MAX: usize = 4096;
/// The first byte of every pack: its layout.
pub const PACK_FORMAT: u8 = 1;
/// A commit's position and length in front of its bytes.
const ENTRY_HEADER: usize = 12;
/// Keys of the older layout packed per sled batch when a store opens.
const OLDER_LAYOUT_CHUNK: usize = 4096;
/// How often packing an older copy says how far it got.
const OLDER_LAYOUT_PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// The key of the pack whose first position is `first`.
pub(crate) fn pack_key(first: u64) -> [u8; 9] {
    let mut k = [b'p'; 9];
    k[1..].copy_from_slice(&first.to_be_bytes());
    k
}

/// The key of one commit in the older layout.
#[cfg(test)]
fn older_key(position: u64) -> [u8; 9] {
    let mut k = [b'c'; 9];
    k[1..].copy_from_slice(&position.to_be_bytes());
    k
}

fn corrupt(key: &[u8], reason: String) -> StoreError {
    StoreError::Corrupt {
        what: format!(
            "the copy's pack from position {}",
            key.get(1..).and_then(be_u64).unwrap_or(0)
        ),
        reason,
    }
}

/// Packs commits, in position order, into a sled batch.
#[derive(Default)]
pub(crate) struct Packer {
    first: u64,
    value: Vec<u8>,
    commits: usize,
}

impl Packer {
    /// Adds the commit at `position` (after every one added before), closing the pack it
    /// would overfill.
    pub(crate) fn push(
        &mut self,
        batch: &mut sled::Batch,
        position: u64,
        bytes: &[u8],
    ) -> Result<(), StoreError> {
        let len = u32::try_from(bytes.len()).map_err(|_| StoreError::Corrupt {
            what: format!("commit at position {position}"),
            reason: format!("{} bytes, more than a pack entry holds", bytes.len()),
        })?;
        if self.commits == PACK_COMMITS_MAX
            || (self.commits > 0 && self.value.len() + ENTRY_HEADER + bytes.len() > PACK_BYTES_MAX)
        {
            self.close(batch);
        }
        if self.commits == 0 {
            self.first = position;
            self.value.push(PACK_FORMAT);
        }
        self.value.extend_from_slice(&position.to_be_bytes());
        self.value.extend_from_slice(&len.to_be_bytes());
        self.value.extend_from_slice(bytes);
        self.commits += 1;
        Ok(())
    }

    /// Writes the open pack, if any, into `batch`.
    pub(crate) fn close(&mut self, batch: &mut sled::Batch) {
        if self.commits > 0 {
            batch.insert(&pack_key(self.first)[..], std::mem::take(&mut self.value));
            self.commits = 0;
        }
    }
}

/// Each commit of the pack `value` under `key`: its position and where its bytes lie. A
/// pack that breaks its layout anywhere is refused whole.
fn entries(key: &[u8], value: &[u8]) -> Result<Vec<(u64, Range<usize>)>, StoreError> {
    let first = match (key.first(), key.get(1..).and_then(be_u64)) {
        (Some(b'p'), Some(first)) if key.len() == 9 => first,
        _ => return Err(corrupt(key, format!("a key of {} bytes", key.len()))),
    };
    if value.first() != Some(&PACK_FORMAT) {
        return Err(corrupt(
            key,
            format!("layout {:?}, not {PACK_FORMAT}", value.first()),
        ));
    }
    let mut out = Vec::new();
    let mut at = 1;
    let mut last: Option<u64> = None;
    while at < value.len() {
        let header = value
            .get(at..at + ENTRY_HEADER)
            .ok_or_else(|| corrupt(key, format!("a commit's header cut off at byte {at}")))?;
        let position = be_u64(header).unwrap_or(0);
        let len = u32::from_be_bytes([header[8], header[9], header[10], header[11]]) as usize;
        let bytes = at + ENTRY_HEADER..at + ENTRY_HEADER + len;
        if bytes.end > value.len() {
            return Err(corrupt(
                key,
                format!("the commit at position {position} runs past the pack's end"),
            ));
        }
        let in_order = match last {
            None => position == first,
            Some(last) => position > last,
        };
        if !in_order {
            return Err(corrupt(
                key,
                format!("position {position} out of order (after {last:?})"),
            ));
        }
        last = Some(position);
        at = bytes.end;
        out.push((position, bytes));
    }
    if out.is_empty() {
        return Err(corrupt(key, "no commit".into()));
    }
    Ok(out)
}

/// The copy's commits from `from` to `to` inclusive, in position order (or backwards):
/// each position with its bytes, a slice of its pack (not copied).
pub struct CopyEntries {
    packs: sled::Iter,
    front: VecDeque<(u64, sled::IVec)>,
    back: VecDeque<(u64, sled::IVec)>,
    from: u64,
    to: u64,
}

/// The copy's commits in `tree` from `from` to `to` inclusive.
pub(crate) fn read(tree: &sled::Tree, from: u64, to: u64) -> Result<CopyEntries, StoreError> {
    // The pack holding `from` begins at or before it.
    let start = match tree.range(pack_key(0)..=pack_key(from)).next_back() {
        Some(entry) => entry?.0.to_vec(),
        None => pack_key(from).to_vec(),
    };
    Ok(CopyEntries {
        packs: tree.range(start..=pack_key(to).to_vec()),
        front: VecDeque::new(),
        back: VecDeque::new(),
        from,
        to,
    })
}

impl CopyEntries {
    /// The entries of the next pack `packs` gives (from the front or the back) in the
    /// range; `None` once none is left.
    fn unpack(
        &self,
        pack: Option<sled::Result<(sled::IVec, sled::IVec)>>,
    ) -> Option<Result<VecDeque<(u64, sled::IVec)>, StoreError>> {
        let (key, value) = match pack? {
            Ok(kv) => kv,
            Err(e) => return Some(Err(e.into())),
        };
        Some(entries(&key, &value).map(|entries| {
            entries
                .into_iter()
                .filter(|(p, _)| (self.from..=self.to).contains(p))
                .map(|(p, r)| (p, value.subslice(r.start, r.len())))
                .collect()
        }))
    }
}

impl Iterator for CopyEntries {
    type Item = Result<(u64, sled::IVec), StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(entry) = self.front.pop_front() {
                return Some(Ok(entry));
            }
            let next = self.packs.next();
            match self.unpack(next) {
                Some(Ok(entries)) => self.front = entries,
                Some(Err(e)) => return Some(Err(e)),
                // The back may have taken the last pack.
                None => return self.back.pop_front().map(Ok),
            }
        }
    }
}

impl DoubleEndedIterator for CopyEntries {
    fn next_back(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(entry) = self.back.pop_back() {
                return Some(Ok(entry));
            }
            let next = self.packs.next_back();
            match self.unpack(next) {
                Some(Ok(entries)) => self.back = entries,
                Some(Err(e)) => return Some(Err(e)),
                None => return self.front.pop_back().map(Ok),
            }
        }
    }
}

/// Where the copy in `tree` keeps the commit at `position`: its pack's key and the range
/// of its bytes in that pack's value (`None`: the copy holds none there).
pub fn locate(
    tree: &sled::Tree,
    position: u64,
) -> Result<Option<(sled::IVec, Range<usize>)>, StoreError> {
    let Some(entry) = tree.range(pack_key(0)..=pack_key(position)).next_back() else {
        return Ok(None);
    };
    let (key, value) = entry?;
    let found = entries(&key, &value)?
        .into_iter()
        .find(|(p, _)| *p == position)
        .map(|(_, r)| r);
    Ok(found.map(|r| (key, r)))
}

/// Packs a copy kept one key per commit (the tree [`OLDER_COPY_TREE`], before packs) into
/// [`COPY_TREE`], then removes the older tree; returns how many commits it packed.
///
/// The older tree stays the copy until it is removed, last, once the packed one is flushed:
/// a crash half-way leaves it whole, and the next open starts again. Found beside a packed
/// copy, an older copy that has its marks is the newer of the two (an older build ran on
/// this data dir after a downgrade, and kept a copy of its own): the packed one is dropped
/// first. One without marks holds nothing (an older build's offline command opened it) and
/// is only removed.
pub(crate) fn pack_older_layout(db: &sled::Db) -> Result<usize, StoreError> {
    if !super::has_tree(db, OLDER_COPY_TREE) {
        return Ok(0);
    }
    let older = db.open_tree(OLDER_COPY_TREE)?;
    if super::extent_of(&older)?.is_none() {
        drop(older);
        db.drop_tree(OLDER_COPY_TREE)?;
        return Ok(0);
    }
    tracing::info!("packing this data dir's copy of the stream (kept one key per commit before)");
    db.drop_tree(COPY_TREE)?;
    let packed_tree = db.open_tree(COPY_TREE)?;
    let started = std::time::Instant::now();
    let mut said = started;
    let mut packed = 0;
    let mut keys = older.iter();
    loop {
        let chunk: Vec<(sled::IVec, sled::IVec)> = keys
            .by_ref()
            .take(OLDER_LAYOUT_CHUNK)
            .collect::<Result<_, _>>()?;
        if chunk.is_empty() {
            break;
        }
        let mut batch = sled::Batch::default();
        let mut packer = Packer::default();
        for (key, value) in &chunk {
            match key.first() {
                Some(b'c') => {
                    let position = match key.get(1..).and_then(be_u64) {
                        Some(p) if key.len() == 9 => p,
                        _ => {
                            return Err(StoreError::Corrupt {
                                what: "a key of the copy".into(),
                                reason: format!("{} bytes under `c`, not a position", key.len()),
                            })
                        }
                    };
                    packer.push(&mut batch, position, value)?;
                    packed += 1;
                }
                // The per-commit index of a still older layout: not kept.
                Some(b'h') => {}
                // The marks and the chains' tips, as they are.
                _ => batch.insert(key, value),
            }
        }
        packer.close(&mut batch);
        packed_tree.apply_batch(batch)?;
        crate::store::reclaim_sled_garbage(chunk.len());
        // About 8 s per million commits: said every few seconds, not per chunk.
        if said.elapsed() >= OLDER_LAYOUT_PROGRESS_EVERY {
            said = std::time::Instant::now();
            tracing::info!(commits = packed, "packing the copy: commits packed so far");
        }
    }
    // The packed copy is durable before the older one goes.
    db.flush()?;
    drop(keys);
    drop(older);
    db.drop_tree(OLDER_COPY_TREE)?;
    db.flush()?;
    tracing::info!(
        commits = packed,
        seconds = started.elapsed().as_secs_f64(),
        "packed this data dir's copy of the stream"
    );
    Ok(packed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit_bytes(position: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| (position as usize + i) as u8).collect()
    }

    fn write(tree: &sled::Tree, commits: &[(u64, Vec<u8>)]) {
        let mut batch = sled::Batch::default();
        let mut packer = Packer::default();
        for (p, bytes) in commits {
            packer.push(&mut batch, *p, bytes).expect("push");
        }
        packer.close(&mut batch);
        tree.apply_batch(batch).expect("apply");
    }

    /// Given 300 commits with gaps, of sizes from 1 byte to larger than a pack, written in
    /// two batches, when any range is read forwards, backwards, or from both ends at once,
    /// then it gives exactly the commits in that range, each with its own bytes.
    #[test]
    fn any_range_reads_back_exactly_its_commits_from_either_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let tree = db.open_tree("copy").expect("tree");
        let commits: Vec<(u64, Vec<u8>)> = (1..=400u64)
            .filter(|p| p % 4 != 0)
            .map(|p| {
                let len = match p % 50 {
                    0 => 0,
                    7 => PACK_BYTES_MAX + 100,
                    n => n as usize * 13,
                };
                (p, commit_bytes(p, len))
            })
            .collect();
        write(&tree, &commits[..120]);
        write(&tree, &commits[120..]);
        assert!(
            tree.len() > 2 && tree.len() < commits.len() / 4,
            "{} packs",
            tree.len()
        );

        for (from, to) in [
            (1, 400),
            (0, u64::MAX),
            (5, 5),
            (4, 4),
            (17, 333),
            (399, 1000),
            (150, 140),
        ] {
            let want: Vec<(u64, Vec<u8>)> = commits
                .iter()
                .filter(|(p, _)| (from..=to).contains(p))
                .cloned()
                .collect();
            let got = |it: CopyEntries, back: bool| -> Vec<(u64, Vec<u8>)> {
                let mut v: Vec<_> = if back {
                    it.rev()
                        .map(|r| r.expect("read"))
                        .map(|(p, b)| (p, b.to_vec()))
                        .collect()
                } else {
                    it.map(|r| r.expect("read"))
                        .map(|(p, b)| (p, b.to_vec()))
                        .collect()
                };
                if back {
                    v.reverse();
                }
                v
            };
            assert_eq!(
                got(read(&tree, from, to).expect("read"), false),
                want,
                "{from}..={to}"
            );
            assert_eq!(
                got(read(&tree, from, to).expect("read"), true),
                want,
                "{from}..={to} back"
            );
            // From both ends, alternating, until they meet.
            let mut it = read(&tree, from, to).expect("read");
            let (mut head, mut tail) = (Vec::new(), Vec::new());
            loop {
                match it.next() {
                    Some(r) => head.push(r.expect("read").0),
                    None => break,
                }
                match it.next_back() {
                    Some(r) => tail.push(r.expect("read").0),
                    None => break,
                }
            }
            tail.reverse();
            head.extend(tail);
            assert_eq!(
                head,
                want.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
                "{from}..={to} both"
            );
        }
        let (key, range) = locate(&tree, 57).expect("locate").expect("held");
        let value = tree.get(&key).expect("get").expect("pack");
        assert_eq!(&value[range], &commit_bytes(57, PACK_BYTES_MAX + 100)[..]);
        assert!(locate(&tree, 56).expect("locate").is_none());
    }

    /// An older copy in `db`: the commits one key each, its marks through `through`, a tip
    /// and a key of the per-commit index.
    fn older_copy(db: &sled::Db, commits: &[(u64, Vec<u8>)], through: u64) {
        let tree = db.open_tree(OLDER_COPY_TREE).expect("tree");
        for (p, bytes) in commits {
            tree.insert(older_key(*p), &bytes[..]).expect("insert");
        }
        tree.insert(b"mfrom", &1u64.to_be_bytes()[..])
            .expect("from");
        tree.insert(b"mcopied", &through.to_be_bytes()[..])
            .expect("copied");
        tree.insert([b't', 1, 2], &[7u8; 40][..]).expect("tip");
        tree.insert([b'h', 1, 2], &[0u8; 8][..]).expect("index");
    }

    fn read_all(db: &sled::Db) -> Vec<(u64, Vec<u8>)> {
        let tree = db.open_tree(COPY_TREE).expect("tree");
        read(&tree, 1, u64::MAX)
            .expect("read")
            .map(|r| r.map(|(p, b)| (p, b.to_vec())).expect("read"))
            .collect()
    }

    /// Given a copy of the older layout (one `c` key per commit, more than a chunk), when
    /// it is packed, then the older tree is gone, every commit reads back the same from
    /// packs, the marks and tips are kept and the per-commit index is not.
    #[test]
    fn an_older_copy_is_packed_and_reads_the_same() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let commits: Vec<(u64, Vec<u8>)> = (1..=(OLDER_LAYOUT_CHUNK as u64 + 500))
            .filter(|p| p % 7 != 0)
            .map(|p| (p, commit_bytes(p, 100 + (p % 30) as usize)))
            .collect();
        older_copy(&db, &commits, OLDER_LAYOUT_CHUNK as u64 + 500);

        assert_eq!(pack_older_layout(&db).expect("pack"), commits.len());
        assert!(!super::super::has_tree(&db, OLDER_COPY_TREE));
        assert_eq!(read_all(&db), commits);
        let tree = db.open_tree(COPY_TREE).expect("tree");
        assert!(tree.scan_prefix([b'c']).next().is_none());
        assert!(tree.scan_prefix([b'h']).next().is_none());
        assert!(tree.get([b't', 1, 2]).expect("get").is_some());
        assert_eq!(
            super::super::extent(&db).expect("extent"),
            Some(super::super::CopyExtent {
                from: 1,
                through: OLDER_LAYOUT_CHUNK as u64 + 500
            })
        );
        assert_eq!(pack_older_layout(&db).expect("again"), 0);
    }

    /// Given a packed copy and, beside it, an older copy with its marks (an older build ran
    /// on the data dir after a downgrade), when the data dir is opened again, then the older
    /// copy is the one kept: the stale packs are gone. And given an older tree without
    /// marks (an older build's offline command opened it), then the packed copy is kept.
    #[test]
    fn after_a_downgrade_the_older_builds_copy_is_kept_and_an_empty_one_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let stale: Vec<(u64, Vec<u8>)> = (1..=200).map(|p| (p, vec![1; 50])).collect();
        write(&db.open_tree(COPY_TREE).expect("tree"), &stale);
        let newer: Vec<(u64, Vec<u8>)> = (1..=20).map(|p| (p, commit_bytes(p, 60))).collect();
        older_copy(&db, &newer, 20);

        assert_eq!(pack_older_layout(&db).expect("pack"), 20);
        assert_eq!(read_all(&db), newer);

        db.open_tree(OLDER_COPY_TREE).expect("an empty older tree");
        assert_eq!(pack_older_layout(&db).expect("pack"), 0);
        assert!(!super::super::has_tree(&db, OLDER_COPY_TREE));
        assert_eq!(read_all(&db), newer);
    }

    /// Given packs damaged in each way the layout can break, when they are read, then each
    /// is refused as corrupt, never read as commits.
    #[test]
    fn a_damaged_pack_is_refused_not_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let tree = db.open_tree("copy").expect("tree");
        write(
            &tree,
            &[(10, commit_bytes(10, 40)), (11, commit_bytes(11, 40))],
        );
        let good = tree.get(pack_key(10)).expect("get").expect("pack").to_vec();
        let mut cut = good.clone();
        cut.truncate(good.len() - 1);
        let mut other_layout = good.clone();
        other_layout[0] = 9;
        let mut swapped = good.clone();
        // The second entry's position, made the first's.
        let second = 1 + ENTRY_HEADER + 40;
        swapped[second..second + 8].copy_from_slice(&10u64.to_be_bytes());
        let mut half_header = good.clone();
        half_header.truncate(second + 5);
        for damaged in [cut, other_layout, swapped, half_header, vec![PACK_FORMAT]] {
            tree.insert(pack_key(10), damaged.clone()).expect("insert");
            let read: Vec<_> = read(&tree, 1, 100).expect("read").collect();
            assert!(
                matches!(read[..], [Err(StoreError::Corrupt { .. })]),
                "{damaged:?}: {read:?}"
            );
        }
    }
}
