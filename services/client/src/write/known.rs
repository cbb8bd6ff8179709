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
            complete: false,
            read: false,
            stale: true,
        }
    }
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
        Known {
            entity,
            tip,
            recent: commits.iter().skip(skip).map(RecentCommit::of).collect(),
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
        self.recent.push_back(RecentCommit::of(commit));
    }

    pub(crate) fn version(&self) -> u64 {
        self.tip.version
    }

    pub(crate) fn recent_commit(&self, draft: &CommitDraft) -> Option<RecentCommit> {
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
