//! The projector against real sled files: folding in batches, with the projector rebuilt from
//! the store between batches (its cache gone, as after a restart), gives the same
//! entities as one pure rebuild, and the sled copy holds every commit once.

use std::collections::HashMap;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use provledger_events::codec::DecodeError;
use provledger_events::{Commit, ReadError};
use provledger_projections::{Entity, Projection};
use provledger_serve::ProjectionStore;
use provledger_serve::Projector;
use provledger_tests::script;

fn garbage(position: u64) -> Result<Commit, ReadError> {
    Err(ReadError::Undecodable {
        position,
        subject: "provledger.ev.cluster.garbage".into(),
        error: DecodeError::Empty,
        payload: bytes::Bytes::from_static(b"\xffnot a commit"),
    })
}

/// Renumbers positions so that garbage can sit between commits, as on a real subject.
fn with_garbage(commits: Vec<Commit>, every: usize) -> Vec<Result<Commit, ReadError>> {
    let mut out = Vec::new();
    let mut position = 0;
    for (i, mut c) in commits.into_iter().enumerate() {
        if every > 0 && i % every == every - 1 {
            position += 1;
            out.push(garbage(position));
        }
        position += 1;
        c.position = position;
        out.push(Ok(c));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn stored_incremental_state_equals_a_rebuild(
        steps in script::script(120),
        cuts in proptest::collection::vec(1usize..40, 1..8),
        garbage_every in 0usize..9,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let entries = with_garbage(script::seal(&steps), garbage_every);
        let commits: Vec<Commit> = entries.iter().filter_map(|e| e.as_ref().ok().cloned()).collect();
        let quarantined = entries.len() - commits.len();

        // Given the entries fed in random batches, with a fresh projector for each batch.
        let mut rest = entries.clone();
        let mut cut = cuts.iter().cycle();
        while !rest.is_empty() {
            let n = (*cut.next().unwrap()).min(rest.len());
            let tail = rest.split_off(n);
            // Re-deliver the previous batch's last entry: it must be skipped, not refolded.
            let mut projector = Projector::new(ProjectionStore::open(&db).unwrap(), 7).unwrap();
            let checkpoint = projector.checkpoint();
            let mut batch = Vec::new();
            if let Some(prev) = entries.iter().find(|e| pos(e) == checkpoint) {
                batch.push(prev.clone());
            }
            batch.extend(rest);
            projector.apply_batch(batch).unwrap();
            rest = tail;
        }

        // Then the store equals a rebuild, and the copy holds every commit once.
        let store = ProjectionStore::open(&db).unwrap();
        let rebuilt = Projection::rebuild(&commits);
        let stored: HashMap<_, Entity> = store.all_entities().map(|e| { let e = e.unwrap(); (e.id(), e) }).collect();
        prop_assert_eq!(&stored, &rebuilt.entities);
        let copy: Vec<Commit> = store.commits(1, u64::MAX).map(|c| c.unwrap()).collect();
        prop_assert_eq!(&copy, &commits);
        prop_assert_eq!(store.quarantine_count(), quarantined);
        prop_assert_eq!(store.checkpoint().unwrap(), entries.len() as u64);

        // And a replay from the newest snapshot equals the rebuild too.
        let end = store.checkpoint().unwrap();
        let mut replayed = store.load_snapshot(end).unwrap().unwrap_or_default();
        let from = replayed.position + 1;
        for c in store.commits(from, end) {
            replayed.apply(&c.unwrap());
        }
        prop_assert_eq!(&replayed.entities, &rebuilt.entities);

        // And one aggregate's state at a past position equals the rebuild of that prefix.
        if let Some(mid) = commits.get(commits.len() / 2) {
            let prefix = Projection::rebuild(commits.iter().filter(|c| c.position <= mid.position));
            let at = store.entity_at(&mid.aggregate, mid.position).unwrap();
            prop_assert_eq!(at.as_ref(), prefix.get(&mid.aggregate));
        }
    }
}

fn pos(entry: &Result<Commit, ReadError>) -> u64 {
    match entry {
        Ok(c) => c.position,
        Err(ReadError::Undecodable { position, .. }) => *position,
        Err(_) => 0,
    }
}

#[test]
fn the_rollback_worker_learns_every_changed_operation_cluster_and_instance() {
    // Given a script of commits applied in a few batches by one projector.
    let dir = tempfile::tempdir().unwrap();
    let db = sled::open(dir.path()).unwrap();
    let steps = script::script(200)
        .new_tree(&mut proptest::test_runner::TestRunner::deterministic())
        .unwrap()
        .current();
    let commits = script::seal(&steps);
    let mut projector = Projector::new(ProjectionStore::open(&db).unwrap(), 0).unwrap();
    let touched = projector.touched();
    let mut seen = std::collections::HashSet::new();
    for chunk in commits.chunks(37) {
        projector
            .apply_batch(chunk.iter().cloned().map(Ok).collect())
            .unwrap();
        // When the worker takes what changed after each batch.
        let (changed, incomplete_through) = touched.take();
        assert_eq!(incomplete_through, 0, "a few hundred aggregates fit");
        seen.extend(changed);
    }
    // Then it saw every aggregate but the providers, and nothing else.
    let expected: std::collections::HashSet<_> = commits
        .iter()
        .map(|c| c.aggregate)
        .filter(|a| a.kind != provledger_events::AggregateKind::Provider)
        .collect();
    assert!(expected.len() > 3, "the script touches several aggregates");
    assert_eq!(seen, expected);
}

/// `n` instances created, one commit each, at positions 1..=n.
fn instances(n: usize) -> Vec<Result<Commit, ReadError>> {
    let provider = uuid::Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_00f0_0001);
    let steps: Vec<script::ScriptStep> = (0..n as u128)
        .map(|k| {
            let id = uuid::Uuid::from_u128(0x0190_0000_0000_7000_8000_0001_0000_0000 | k);
            (
                provledger_events::AggregateId::instance(id),
                provledger_tests::workload::instance_lifecycle(k, k, provider),
            )
        })
        .collect();
    script::seal(&steps).into_iter().map(Ok).collect()
}

/// Feeds `entries` in full batches of BATCH_ENTRIES_MAX (a projector behind) and then the
/// rest; returns the snapshots after each batch.
fn snapshots_after_each_batch(entries: Vec<Result<Commit, ReadError>>) -> Vec<Vec<u64>> {
    let dir = tempfile::tempdir().unwrap();
    let db = sled::open(dir.path()).unwrap();
    let store = ProjectionStore::open(&db).unwrap();
    let mut projector = Projector::new(store.clone(), 1_000).unwrap();
    entries
        .chunks(provledger_serve::BATCH_ENTRIES_MAX)
        .map(|batch| {
            projector.apply_batch(batch.to_vec()).unwrap();
            store.snapshots().unwrap()
        })
        .collect()
}

/// Feeds `entries` in batches of `size` to a projector told it catches up to
/// `catching_up_to`; returns the snapshots after each batch.
fn snapshots_after_short_batches(
    entries: Vec<Result<Commit, ReadError>>,
    size: usize,
    catching_up_to: u64,
) -> Vec<Vec<u64>> {
    let dir = tempfile::tempdir().unwrap();
    let db = sled::open(dir.path()).unwrap();
    let store = ProjectionStore::open(&db).unwrap();
    let mut projector = Projector::new(store.clone(), 1_000)
        .unwrap()
        .catching_up_to(catching_up_to);
    entries
        .chunks(size)
        .map(|batch| {
            projector.apply_batch(batch.to_vec()).unwrap();
            store.snapshots().unwrap()
        })
        .collect()
}

#[test]
fn a_projector_catching_up_in_short_batches_snapshots_once_it_reaches_the_end() {
    // Given a snapshot interval of 1,000 positions and 3,500 commits delivered 500 at a
    // time (short batches: a consumer no faster than the fold),
    let entries = || instances(3_500);
    // when the projector is told it catches up to 3,500, then it takes no snapshot on the
    // way and one once it reaches the end,
    let after = snapshots_after_short_batches(entries(), 500, 3_500);
    assert!(after[..6].iter().all(Vec::is_empty), "{after:?}");
    assert_eq!(after[6], vec![3_500]);
    // while one that is not told snapshots at each multiple (its batches are not full).
    let after = snapshots_after_short_batches(entries(), 500, 0);
    assert_eq!(after[6], vec![1_000, 2_000, 3_000]);
}

#[test]
fn a_projector_catching_up_past_ten_intervals_snapshots_only_at_the_end() {
    // Given a snapshot interval of 1,000 positions and five full batches then a short one
    // (past the ten intervals a projector behind waits at most), to a projector catching up
    // to their end,
    let full = provledger_serve::BATCH_ENTRIES_MAX;
    let end = 5 * full + 100;
    let after = snapshots_after_short_batches(instances(end), full, end as u64);
    // then it takes none on the way, and one at the end.
    let (last, on_the_way) = after.split_last().unwrap();
    assert!(on_the_way.iter().all(Vec::is_empty), "{after:?}");
    assert_eq!(last, &vec![end as u64]);
}

#[test]
fn a_projector_behind_takes_one_snapshot_once_it_catches_up_not_one_per_interval() {
    // Given a snapshot interval of 1,000 positions, and three full batches then a short one
    let full = provledger_serve::BATCH_ENTRIES_MAX;
    let after = snapshots_after_each_batch(instances(3 * full + 10));
    // Then no snapshot is copied while the batches are full, and one at the end
    let end = (3 * full + 10) as u64;
    assert_eq!(after, vec![vec![], vec![], vec![], vec![end]]);
}

#[test]
fn a_projector_behind_for_long_still_snapshots_after_ten_intervals() {
    // Given full batches only, past ten intervals of 1,000 positions since the first was due
    let full = provledger_serve::BATCH_ENTRIES_MAX;
    let after = snapshots_after_each_batch(instances(4 * full));
    // Then the overdue snapshot is taken at the batch that passes the bound
    assert_eq!(after, vec![vec![], vec![], vec![], vec![4 * full as u64]]);
}
