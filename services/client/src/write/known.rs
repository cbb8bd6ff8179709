//! What a process knows of one aggregate between two writes: the folded entity, its chain
//! tip and the ids of its last commits, kept in the aggregate's turn (`super::turns`).

use std::collections::VecDeque;

use provledger_events::ids::{uuid_v7_unix_ms, CLOCK_SKEW_MS_MAX};
use provledger_events::{AggregateId, ChainTip, Commit, CommitDraft, Timestamp};
use provledger_projections::Entity;

/// The last commits of an aggregate whose ids (not payloads) a process keeps with its
/// state: a retry of one of them is recognised without scanning the log (its commit is then
/// read by position to compare payloads). 256 ids cost 8 KiB per aggregate kept.
pub const RECENT_COMMITS_MAX: usize = 256;

/// What this process knows of one aggregate. The default knows nothing: the next write
/// reads the aggregate first.
#[derive(Debug, Clone)]
pub(crate) struct Known {
    /// `None` while the aggregate has no commit.
    pub(crate) entity: Option<Entity>,
    pub(crate) tip: ChainTip,
    /// The last commits folded, oldest first, at most [`RECENT_COMMITS_MAX`].
    recent: VecDeque<RecentCommit>,
    /// At least the newest mint time (UUID v7, ms) of any id in `recent`; `None` once an id
    /// without one was kept. A draft whose id was minted later is none of them, so a new
    /// write is told apart without scanning 256 ids (10 KiB of memory per write).
    recent_minted_max: Option<i64>,
    /// Whether `recent` holds every commit since version 1, so a commit id not in it was
    /// never written to this aggregate.
    complete: bool,
    /// Whether anything was ever folded here (from the log, or adopted from a state folded
    /// elsewhere). Until then the aggregate is read whole.
    read: bool,
    /// Set when the log may hold commits this state has not folded (a lost ack, a
    /// recognised duplicate, a lost race): the next write reads the tail first.
    pub(crate) stale: bool,
}

impl Default for Known {
    fn default() -> Self {
        Known {
            entity: None,
            tip: ChainTip::EMPTY,
            recent: VecDeque::new(),
            recent_minted_max: NOTHING_MINTED,
            complete: false,
            read: false,
            stale: true,
        }
    }
}

/// `recent_minted_max` while nothing is kept: every minted id is later.
const NOTHING_MINTED: Option<i64> = Some(i64::MIN);

/// The bound `max` once `id` is kept too: raised to its mint time, or `None` for good if
/// it has none (not a UUID v7).
fn minted_with(max: Option<i64>, id: &uuid::Uuid) -> Option<i64> {
    max.zip(uuid_v7_unix_ms(id))
        .map(|(max, minted)| max.max(minted))
}

/// The newest mint time among `recent`'s ids, `None` if one has none.
fn minted_max<'a>(recent: impl Iterator<Item = &'a RecentCommit>) -> Option<i64> {
    recent.fold(NOTHING_MINTED, |max, c| minted_with(max, &c.commit_id))
}

/// What is kept of a recent commit: enough to recognise a retry of it and find it again.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecentCommit {
    commit_id: uuid::Uuid,
    pub(crate) position: u64,
    recorded_at: Timestamp,
}

impl RecentCommit {
    fn of(commit: &Commit) -> Self {
        RecentCommit {
            commit_id: commit.commit_id,
            position: commit.position,
            recorded_at: commit.recorded_at,
        }
    }
}

impl Known {
    /// The state of an aggregate read whole.
    pub(crate) fn from_commits(aggregate: AggregateId, commits: Vec<Commit>) -> Known {
        let entity = Entity::fold(aggregate, &commits);
        let tip = commits.last().map_or(ChainTip::EMPTY, ChainTip::of);
        let complete = commits.len() <= RECENT_COMMITS_MAX;
        let skip = commits.len().saturating_sub(RECENT_COMMITS_MAX);
        let recent: VecDeque<RecentCommit> =
            commits.iter().skip(skip).map(RecentCommit::of).collect();
        Known {
            entity,
            tip,
            recent_minted_max: minted_max(recent.iter()),
            recent,
            complete,
            read: true,
            stale: false,
        }
    }

    /// A state folded elsewhere (serve's store), taken as a starting point: stale, so the
    /// commits after its tip are read before anything is decided on it, unless the log
    /// holds that tip as the head its append expects (`super::refresh`).
    pub(crate) fn adopted(entity: Entity) -> Known {
        let tip = entity.header().tip();
        Known {
            entity: Some(entity),
            tip,
            recent: VecDeque::new(),
            recent_minted_max: NOTHING_MINTED,
            complete: false,
            read: true,
            stale: true,
        }
    }

    /// Whether anything was ever folded here.
    pub(crate) fn was_read(&self) -> bool {
        self.read
    }

    /// Folds commits read after the tip. Returns false if one does not extend the chain
    /// (the log changed under a stale tip): the caller then reads the aggregate whole.
    pub(crate) fn fold(&mut self, aggregate: AggregateId, commits: Vec<Commit>) -> bool {
        for commit in commits {
            let entity = self.entity.get_or_insert_with(|| Entity::new(aggregate));
            if entity.check_next(&commit).is_err() {
                return false;
            }
            entity.apply(&commit);
            self.advance(&commit);
        }
        true
    }

    /// Folds the commit this process just appended: sealed here on the tip it knew and
    /// accepted by the log at exactly the next version, so it extends the chain by
    /// construction (checking its hash again would only cost a second hash per write).
    pub(crate) fn fold_own(&mut self, aggregate: AggregateId, commit: Commit) {
        // A commit folded off its tip would make every later decision on this aggregate
        // wrong without an error anywhere.
        assert!(
            commit.version == self.tip.version + 1 && commit.prev_hash == self.tip.hash,
            "{aggregate} v{} (prev {}) folded on the tip v{} ({})",
            commit.version,
            commit.prev_hash,
            self.tip.version,
            self.tip.hash
        );
        let entity = self.entity.get_or_insert_with(|| Entity::new(aggregate));
        entity.apply(&commit);
        self.advance(&commit);
    }

    /// Moves the tip to `commit`, just folded, and keeps it among the recent commits.
    fn advance(&mut self, commit: &Commit) {
        self.tip = ChainTip::of(commit);
        if self.recent.len() == RECENT_COMMITS_MAX {
            self.recent.pop_front();
            self.complete = false;
        }
        // Never lowered when the oldest is dropped: it stays a bound, only a looser one.
        self.recent_minted_max = minted_with(self.recent_minted_max, &commit.commit_id);
        self.recent.push_back(RecentCommit::of(commit));
    }

    pub(crate) fn version(&self) -> u64 {
        self.tip.version
    }

    pub(crate) fn recent_commit(&self, draft: &CommitDraft) -> Option<RecentCommit> {
        // Equal ids have equal mint times: one minted after every kept id is none of them.
        if let (Some(max), Some(minted)) =
            (self.recent_minted_max, uuid_v7_unix_ms(&draft.commit_id))
        {
            if minted > max {
                return None;
            }
        }
        self.recent
            .iter()
            .find(|c| c.commit_id == draft.commit_id)
            .copied()
    }

    /// Whether a commit with `draft`'s id could be in the log without being among the
    /// recent commits: unless they are every commit there is, only if the id may be older
    /// than the oldest of them, or its age cannot be told (not a UUID v7, or minted ahead
    /// of the newest commit by more than the tolerated skew: its writer's clock runs
    /// ahead, so its time says nothing).
    pub(crate) fn may_hold_older(&self, draft: &CommitDraft) -> bool {
        if self.complete {
            return false;
        }
        match (
            uuid_v7_unix_ms(&draft.commit_id),
            self.recent.front(),
            self.recent.back(),
        ) {
            (Some(minted), Some(oldest), Some(newest)) => {
                minted - CLOCK_SKEW_MS_MAX < oldest.recorded_at.unix_ms()
                    || minted - CLOCK_SKEW_MS_MAX > newest.recorded_at.unix_ms()
            }
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::Hash;
    use uuid::Uuid;

    fn v7(ms: u64, n: u8) -> Uuid {
        uuid::Builder::from_unix_timestamp_millis(ms, &[n; 10]).into_uuid()
    }

    fn draft(id: Uuid) -> CommitDraft {
        let mut draft = CommitDraft::now("test", Vec::new());
        draft.commit_id = id;
        draft
    }

    /// The commits `ids` of one aggregate, in order, each sealed on the one before.
    fn commits(aggregate: AggregateId, ids: &[Uuid]) -> Vec<Commit> {
        let mut prev = Hash::ZERO;
        ids.iter()
            .enumerate()
            .map(|(i, id)| {
                let mut commit = Commit::seal(aggregate, i as u64 + 1, prev, draft(*id));
                commit.position = i as u64 + 1;
                prev = commit.hash;
                commit
            })
            .collect()
    }

    #[test]
    fn a_retry_of_any_kept_commit_is_found_and_a_later_id_is_not() {
        // given an aggregate whose kept commits were minted at 1,000, 3,000 and 2,000 ms
        // (a writer's clock may run behind another's), read whole and folded one by one
        let aggregate = AggregateId::provider(Uuid::now_v7());
        let ids = [v7(1_000, 1), v7(3_000, 2), v7(2_000, 3)];
        let read = Known::from_commits(aggregate, commits(aggregate, &ids));
        let mut folded = Known::default();
        for commit in commits(aggregate, &ids) {
            folded.fold_own(aggregate, commit);
        }
        for known in [&read, &folded] {
            // when a draft reuses any of their ids, then it is found, also the one minted
            // last and the one kept last
            for (i, id) in ids.iter().enumerate() {
                let found = known.recent_commit(&draft(*id)).map(|c| c.position);
                assert_eq!(found, Some(i as u64 + 1), "id {i}");
            }
            // when a draft's id is new, then it is not, whether minted after every kept id
            // or between them
            assert!(known.recent_commit(&draft(v7(3_001, 4))).is_none());
            assert!(known.recent_commit(&draft(v7(2_500, 5))).is_none());
        }
    }

    #[test]
    fn a_kept_id_that_is_no_uuid_v7_is_still_found() {
        // given a kept commit whose id carries no mint time, among v7 ones
        let aggregate = AggregateId::provider(Uuid::now_v7());
        let plain = Uuid::from_bytes([7; 16]);
        let ids = [v7(1_000, 1), plain];
        let mut known = Known::default();
        for commit in commits(aggregate, &ids) {
            known.fold_own(aggregate, commit);
        }
        // when a draft reuses it, then it is found; a later v7 id is still new
        assert_eq!(
            known.recent_commit(&draft(plain)).map(|c| c.position),
            Some(2)
        );
        assert!(known.recent_commit(&draft(v7(5_000, 9))).is_none());
    }
}
