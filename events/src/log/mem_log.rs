//! An in-memory log with the `EventLog` contract, for deterministic simulation and fast
//! tests; it passes the same conformance suite as the real backends. It never stands in
//! for them in a test that proves durability.
//!
//! With a [`FaultPlan`], a seeded generator decides for each append whether the log is
//! unavailable (nothing written) or the ack is lost (written, but the caller is told
//! `Unavailable`), and for each read whether the log is unavailable: the faults a JetStream
//! client meets, replayable from the seed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use tokio::sync::watch;
use uuid::Uuid;

use super::group_commit::{self, GroupCommit, GroupStats, SetAnswer, SetWriter};
use super::{
    recognise_batch_retry, validate_batch, AppendError, AppendOutcome, AppendStatus, AtomicItem,
    CommitStream, EventLog, Expectation, ReadError, VersionConflict,
};
use crate::commit::{Commit, CommitDraft};
use crate::ids::{AggregateId, Hash};

/// Which faults to inject, in thousandths of operations, and the seed that decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    pub seed: u64,
    /// Appends refused before anything is written.
    pub unavailable_per_mille: u32,
    /// Appends written whose ack is lost on the way back.
    pub lost_ack_per_mille: u32,
    /// Reads (`read_aggregate`) refused.
    pub read_unavailable_per_mille: u32,
}

/// What the faults did, for a simulation's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub unavailable: u64,
    pub lost_acks: u64,
    pub read_unavailable: u64,
}

#[derive(Debug, Default)]
struct State {
    commits: Vec<Commit>,
    by_aggregate: HashMap<AggregateId, Vec<usize>>,
    by_id: HashMap<Uuid, usize>,
    plan: Option<FaultPlan>,
    rng: u64,
    counts: FaultCounts,
}

impl State {
    /// splitmix64: small, fast, and the same sequence everywhere for a seed.
    fn roll(&mut self) -> u32 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % 1000) as u32
    }

    fn fault(&mut self, per_mille: impl Fn(&FaultPlan) -> u32) -> bool {
        let Some(plan) = self.plan else {
            return false;
        };
        self.roll() < per_mille(&plan)
    }

    /// Stores a sealed commit at the next position and indexes it.
    fn push(&mut self, mut commit: Commit) -> AppendOutcome {
        let index = self.commits.len();
        commit.position = index as u64 + 1;
        let outcome = AppendOutcome {
            position: commit.position,
            version: commit.version,
            status: AppendStatus::Appended,
        };
        self.by_id.insert(commit.commit_id, index);
        self.by_aggregate
            .entry(commit.aggregate)
            .or_default()
            .push(index);
        self.commits.push(commit);
        outcome
    }

    /// The injected "log unavailable" fault, when the dice say so.
    fn injected_unavailable(&mut self) -> Result<(), AppendError> {
        if self.fault(|p| p.unavailable_per_mille) {
            self.counts.unavailable += 1;
            return Err(AppendError::Unavailable {
                reason: "injected: the log is unavailable".into(),
            });
        }
        Ok(())
    }

    fn head(&self, aggregate: &AggregateId) -> (u64, Hash) {
        self.by_aggregate
            .get(aggregate)
            .and_then(|v| v.last())
            .map_or((0, Hash::ZERO), |&i| {
                (self.commits[i].version, self.commits[i].hash)
            })
    }
}

/// The in-memory log. Cheap to clone; clones share the log.
#[derive(Clone)]
pub struct MemLog {
    state: Arc<Mutex<State>>,
    appended: watch::Sender<u64>,
    groups: Arc<GroupCommit>,
}

impl Default for MemLog {
    fn default() -> Self {
        MemLog::new()
    }
}

impl MemLog {
    pub fn new() -> Self {
        let (appended, _) = watch::channel(0);
        MemLog {
            state: Arc::new(Mutex::new(State::default())),
            appended,
            groups: Arc::default(),
        }
    }

    /// Injects the faults of `plan` from now on, decided by its seed (`None`: a healthy
    /// log again, e.g. for a simulation's final checks).
    pub fn set_faults(&self, plan: Option<FaultPlan>) {
        let mut s = self.lock();
        if let Some(p) = plan {
            s.rng = p.seed;
        }
        s.plan = plan;
    }

    pub fn fault_counts(&self) -> FaultCounts {
        self.lock().counts
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Nothing panics while the lock is held; a poisoned lock still holds a valid log.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn commits_from(&self, from: u64, to: u64) -> Vec<Commit> {
        let s = self.lock();
        let from = from.max(1) as usize - 1;
        let to = (to as usize).min(s.commits.len());
        s.commits
            .get(from..to)
            .map(<[Commit]>::to_vec)
            .unwrap_or_default()
    }
}

impl MemLog {
    /// How many group writes of atomic sets this handle (and its clones) made, and how many
    /// sets they held.
    pub fn group_stats(&self) -> GroupStats {
        self.groups.written()
    }

    /// One set of a group, checked and written under the lock the whole group holds.
    fn write_set(s: &mut State, items: Vec<AtomicItem>) -> SetAnswer {
        let found: Vec<Option<Commit>> = items
            .iter()
            .map(|i| {
                s.by_id
                    .get(&i.draft.commit_id)
                    .map(|&at| s.commits[at].clone())
            })
            .collect();
        if found.iter().any(Option::is_some) {
            return recognise_batch_retry(&items, &found);
        }
        let heads: Vec<(u64, Hash)> = items.iter().map(|i| s.head(&i.aggregate)).collect();
        let conflicts: Vec<VersionConflict> = items
            .iter()
            .zip(&heads)
            .filter(|(i, (version, _))| !i.expect.admits(*version))
            .map(|(i, (version, _))| VersionConflict {
                aggregate: i.aggregate,
                expected: i.expect,
                actual: *version,
            })
            .collect();
        if !conflicts.is_empty() {
            return Err(AppendError::Conflicts { conflicts });
        }
        let mut outcomes = Vec::with_capacity(items.len());
        for (item, (version, hash)) in items.into_iter().zip(heads) {
            let commit = Commit::seal(item.aggregate, version + 1, hash, item.draft);
            outcomes.push(s.push(commit));
        }
        Ok(outcomes)
    }
}

impl SetWriter for MemLog {
    /// A group as JetStream writes it: an injected unavailability refuses the whole group
    /// (nothing written); each set is then checked on its own; an injected lost ack loses
    /// the answer of every set the group wrote (they are in the log).
    async fn write_sets(&self, sets: Vec<Vec<AtomicItem>>) -> Vec<SetAnswer> {
        // The round trip a real backend's write takes, during which other sets queue.
        tokio::task::yield_now().await;
        let count = sets.len();
        let mut s = self.lock();
        if let Err(e) = s.injected_unavailable() {
            let reason = e.to_string();
            return (0..count)
                .map(|_| {
                    Err(AppendError::Unavailable {
                        reason: reason.clone(),
                    })
                })
                .collect();
        }
        let before = s.commits.len();
        let mut answers: Vec<SetAnswer> = sets
            .into_iter()
            .map(|set| MemLog::write_set(&mut s, set))
            .collect();
        let last = s.commits.len() as u64;
        if last as usize > before && s.fault(|p| p.lost_ack_per_mille) {
            s.counts.lost_acks += 1;
            for answer in answers.iter_mut() {
                if matches!(answer, Ok(o) if o.iter().any(|o| o.status == AppendStatus::Appended)) {
                    *answer = Err(AppendError::Unavailable {
                        reason: "injected: the ack was lost".into(),
                    });
                }
            }
        }
        drop(s);
        if last as usize > before {
            self.appended.send_replace(last);
        }
        answers
    }

    fn group_commit(&self) -> &GroupCommit {
        &self.groups
    }
}

impl EventLog for MemLog {
    async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        draft.validate(&aggregate)?;
        // Only provledger writes this log, in order: no version is ever lost from it, so
        // there is no loss to acknowledge (`crate::loss`).
        crate::loss::admits(&draft, &[])?;
        let position = {
            let mut s = self.lock();
            s.injected_unavailable()?;
            if let Some(&i) = s.by_id.get(&draft.commit_id) {
                return s.commits[i].retry_outcome(aggregate, &draft);
            }
            let (version, hash) = s.head(&aggregate);
            if !expect.admits(version) {
                return Err(AppendError::Conflict {
                    aggregate,
                    expected: expect,
                    actual: version,
                });
            }
            let commit = Commit::seal(aggregate, version + 1, hash, draft);
            let outcome = s.push(commit);
            if s.fault(|p| p.lost_ack_per_mille) {
                s.counts.lost_acks += 1;
                drop(s);
                self.appended.send_replace(outcome.position);
                return Err(AppendError::Unavailable {
                    reason: "injected: the ack was lost".into(),
                });
            }
            outcome
        };
        self.appended.send_replace(position.position);
        Ok(position)
    }

    async fn append_atomic(
        &self,
        items: Vec<AtomicItem>,
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        validate_batch(items.iter().map(|i| (i.aggregate, &i.draft)))?;
        for item in &items {
            crate::loss::admits(&item.draft, &[])?;
        }
        group_commit::submit(self, items).await
    }

    async fn read_aggregate(&self, aggregate: AggregateId) -> Result<Vec<Commit>, ReadError> {
        let mut s = self.lock();
        if s.fault(|p| p.read_unavailable_per_mille) {
            s.counts.read_unavailable += 1;
            return Err(ReadError::Unavailable {
                reason: "injected: the log is unavailable for reads".into(),
            });
        }
        Ok(s.by_aggregate
            .get(&aggregate)
            .map(|v| v.iter().map(|&i| s.commits[i].clone()).collect())
            .unwrap_or_default())
    }

    async fn read_all(&self, from: u64) -> Result<CommitStream, ReadError> {
        let end = self.lock().commits.len() as u64;
        let commits = self.commits_from(from, end);
        Ok(futures::stream::iter(commits.into_iter().map(Ok)).boxed())
    }

    async fn subscribe(&self, from: u64) -> Result<CommitStream, ReadError> {
        let log = self.clone();
        let appended = self.appended.subscribe();
        let stream = futures::stream::unfold(
            (log, appended, from.max(1)),
            |(log, mut appended, next)| async move {
                loop {
                    if let Some(commit) = log.commits_from(next, next).into_iter().next() {
                        return Some((Ok(commit), (log, appended, next + 1)));
                    }
                    if appended.changed().await.is_err() {
                        return None;
                    }
                }
            },
        );
        Ok(stream.boxed())
    }

    async fn last_position(&self) -> Result<u64, ReadError> {
        Ok(self.lock().commits.len() as u64)
    }
}
