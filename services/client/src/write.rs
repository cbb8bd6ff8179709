//! The one write path: know the aggregate, decide, append at exactly the version decided
//! on. `cmd.append`, `provledger append` and this library's own writes all go through
//! [`record`], so a commit is acknowledged only if the fold applies it, and no decision is
//! taken against a state older than the version the commit lands on.
//!
//! Writers of one process take turns per aggregate (the log's [`WriteQueues`]) and keep,
//! in the aggregate's slot, what they know of it ([`Known`]: the folded entity, its chain
//! tip and its last commits). A write decides on that state and appends with exactly its
//! version; if another process wrote in between, the log refuses the expectation and the
//! write reads only the commits after its tip, then decides again. So a write costs the
//! same on an aggregate's 100,000th commit as on its first, hot aggregates queue inside a
//! process instead of failing, and nothing is decided on a state the append does not
//! check.

use std::collections::VecDeque;
use std::time::Duration;

use provledger_events::ids::{uuid_v7_unix_ms, CLOCK_SKEW_MS_MAX};
use provledger_events::{
    AggregateId, AppendError, AppendOutcome, AppendStatus, AtomicItem, ChainTip, Commit,
    CommitDraft, EventLog, Expectation, ReadError, Timestamp, VersionConflict, WriteQueues,
    WriteTurn,
};
use provledger_projections::decide::{
    decide_append_with, Admission, AlreadyDone, AppendRejection, DecideOptions,
};
use provledger_projections::Entity;

/// How many times a write re-reads and re-decides after another process appended in
/// between. Writers of one process never race each other (they take turns), so each
/// round is lost only to another replica, and one racer wins every round.
pub const DECIDE_ATTEMPTS_MAX: usize = 32;
/// How many times a write whose read or append came back `Unavailable` (the ack may be lost
/// while the commit is durable) is tried again with the same commit id. The re-read recognises
/// a commit that did land, so nothing is written twice and nothing leaks.
pub const UNAVAILABLE_RETRIES_MAX: usize = 3;
/// The longest pause between two rounds; the pause is spread by commit id so that racers
/// do not collide again in lockstep.
const DECIDE_BACKOFF_MAX: Duration = Duration::from_millis(20);
/// The last commits of an aggregate whose ids (not payloads) a process keeps with its
/// state: a retry of one of them is recognised without scanning the log (its commit is then
/// read by position to compare payloads). 256 ids cost 8 KiB per aggregate kept.
pub const RECENT_COMMITS_MAX: usize = 256;

/// What this process knows of one aggregate, kept in its write-queue slot between writes.
#[derive(Debug, Clone)]
struct Known {
    /// `None` while the aggregate has no commit.
    entity: Option<Entity>,
    tip: ChainTip,
    /// The last commits folded, oldest first, at most [`RECENT_COMMITS_MAX`].
    recent: VecDeque<RecentCommit>,
    /// Whether `recent` holds every commit since version 1, so a commit id not in it was
    /// never written to this aggregate.
    complete: bool,
    /// Set when the log may hold commits this state has not folded (a lost ack, a
    /// recognised duplicate, a lost race): the next write reads the tail first.
    stale: bool,
}

/// What is kept of a recent commit: enough to recognise a retry of it and find it again.
#[derive(Debug, Clone, Copy)]
struct RecentCommit {
    commit_id: uuid::Uuid,
    position: u64,
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
    fn from_commits(aggregate: AggregateId, commits: Vec<Commit>) -> Known {
        let entity = Entity::fold(aggregate, &commits);
        let tip = commits.last().map_or(ChainTip::EMPTY, ChainTip::of);
        let complete = commits.len() <= RECENT_COMMITS_MAX;
        let skip = commits.len().saturating_sub(RECENT_COMMITS_MAX);
        Known {
            entity,
            tip,
            recent: commits.iter().skip(skip).map(RecentCommit::of).collect(),
            complete,
            stale: false,
        }
    }

    /// Folds commits read after the tip. Returns false if one does not extend the chain
    /// (the log changed under a stale tip): the caller then reads the aggregate whole.
    fn fold(&mut self, aggregate: AggregateId, commits: Vec<Commit>) -> bool {
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
    fn fold_own(&mut self, aggregate: AggregateId, commit: Commit) {
        debug_assert!(commit.version == self.tip.version + 1 && commit.prev_hash == self.tip.hash);
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

    fn version(&self) -> u64 {
        self.tip.version
    }

    fn recent_commit(&self, draft: &CommitDraft) -> Option<RecentCommit> {
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
    fn may_hold_older(&self, draft: &CommitDraft) -> bool {
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

/// Marks what the turn's slot knows as needing a read before the next decision; returns
/// the write's new `fresh` (false: nothing read since).
fn read_again(turn: &mut WriteTurn) -> bool {
    if let Some(known) = known_mut(turn) {
        known.stale = true;
    }
    false
}

fn known_mut(turn: &mut WriteTurn) -> Option<&mut Known> {
    turn.as_mut().and_then(|slot| slot.downcast_mut::<Known>())
}

/// Where a process may find an aggregate already folded from this very log (serve's
/// projection store), to start what it keeps without reading the aggregate whole. What it
/// returns is only a starting point: the commits after its tip are read from the log before
/// anything is decided, and the log's expectation catches anything else.
pub trait FoldedElsewhere: Send + Sync {
    fn folded(&self, aggregate: AggregateId) -> Option<Entity>;
}

/// No state folded elsewhere: a process starts from the log.
pub struct FromTheLog;

impl FoldedElsewhere for FromTheLog {
    fn folded(&self, _aggregate: AggregateId) -> Option<Entity> {
        None
    }
}

/// Brings what the turn's slot knows of `aggregate` up to the log's head: the commits
/// after the tip of whichever is newer, what the slot knows or a state folded elsewhere
/// (another process may have taken the aggregate far past what this one last wrote, and
/// serve's store has followed it: reading from the slot's tip would cost all of that), or
/// the whole aggregate when neither knows it.
async fn refresh<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    turn: &mut WriteTurn,
    elsewhere: &dyn FoldedElsewhere,
) -> Result<(), ReadError> {
    let known_version = known_mut(turn).map(|k| k.version());
    if let Some(entity) = elsewhere
        .folded(aggregate)
        .filter(|e| e.header().version > known_version.unwrap_or(0))
    {
        let header = entity.header();
        let tip = ChainTip {
            version: header.version,
            position: header.last_position,
            hash: header.hash,
        };
        **turn = Some(Box::new(Known {
            entity: Some(entity),
            tip,
            recent: VecDeque::new(),
            complete: false,
            stale: true,
        }));
    }
    if let Some(known) = known_mut(turn) {
        let newer = log.read_aggregate_after(aggregate, known.tip).await?;
        if known.fold(aggregate, newer) {
            known.stale = false;
            return Ok(());
        }
        tracing::warn!(%aggregate, "the log does not extend the chain this process knew; reading it whole");
    }
    let commits = log.read_aggregate(aggregate).await?;
    **turn = Some(Box::new(Known::from_commits(aggregate, commits)));
    Ok(())
}

/// [`refresh`] as part of a write: an unavailable log counts against the write's bound
/// ([`UNAVAILABLE_RETRIES_MAX`], like an unavailable append) and answers false, so the
/// write tries again; past the bound, or for any other failure, the error.
async fn refresh_counted<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    turn: &mut WriteTurn,
    elsewhere: &dyn FoldedElsewhere,
    unavailable: &mut usize,
) -> Result<bool, RecordError> {
    match refresh(log, aggregate, turn, elsewhere).await {
        Ok(()) => Ok(true),
        Err(e @ ReadError::Unavailable { .. }) => {
            *unavailable += 1;
            match *unavailable > UNAVAILABLE_RETRIES_MAX {
                true => Err(e.into()),
                false => Ok(false),
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// The current state of `aggregate`, as fresh as the log: what this process knows of it,
/// plus the commits written since (read after its tip). `None` without commits.
pub async fn read_current<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
) -> Result<Option<Entity>, ReadError> {
    let mut turn = log.write_queues().turn(aggregate).await;
    refresh(log, aggregate, &mut turn, &FromTheLog).await?;
    Ok(known_mut(&mut turn).and_then(|k| k.entity.clone()))
}

/// How many aggregates this process keeps a write state for (bounded by
/// `provledger_events::WRITE_QUEUES_MAX`).
pub fn known_aggregates(queues: &WriteQueues) -> usize {
    queues.len()
}

/// What a write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// The commit is durable (or was already: a retry with the same commit id).
    Appended(AppendOutcome),
    /// The commit asked for what is already true (a repeated delete request); nothing was
    /// written. `version` is the aggregate's version it was decided at, `position` that
    /// of its last commit.
    AlreadyDone {
        outcome: AlreadyDone,
        version: u64,
        position: u64,
    },
}

impl Recorded {
    /// The aggregate's version after this write (or at which nothing needed writing).
    pub fn version(&self) -> u64 {
        match self {
            Recorded::Appended(outcome) => outcome.version,
            Recorded::AlreadyDone { version, .. } => *version,
        }
    }

    /// The outcome of an append, if one happened or had happened.
    pub fn appended(&self) -> Option<AppendOutcome> {
        match self {
            Recorded::Appended(outcome) => Some(*outcome),
            Recorded::AlreadyDone { .. } => None,
        }
    }
}

/// Why a write did not happen. Nothing was written in any case.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error(transparent)]
    Rejected(#[from] AppendRejection),
    #[error("conflict on {aggregate}: expected version {expected}, actual version is {actual}")]
    Conflict {
        aggregate: AggregateId,
        expected: Expectation,
        actual: u64,
    },
    #[error("{aggregate}: {attempts} decisions in a row met a newer version; retry later")]
    Contended {
        aggregate: AggregateId,
        attempts: usize,
    },
    /// NATS refused this user the aggregate's subject: retrying cannot help.
    #[error("{aggregate}: NATS denied this user publishing its commit ({message}); write through cmd.append or connect as a designated writer")]
    PermissionDenied {
        aggregate: AggregateId,
        message: String,
    },
    /// An atomic write some of whose aggregates were not at the version expected: each.
    #[error("conflict: {}", conflicts.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("; "))]
    Conflicts { conflicts: Vec<VersionConflict> },
    /// An atomic write some of whose commits the decider refused: each, on its aggregate.
    #[error("refused: {}", rejections.iter().map(|(a, r)| format!("{a}: {r}")).collect::<Vec<_>>().join("; "))]
    Rejections {
        rejections: Vec<(AggregateId, AppendRejection)>,
    },
    #[error(transparent)]
    Append(AppendError),
    #[error(transparent)]
    Read(#[from] ReadError),
}

impl From<AppendError> for RecordError {
    fn from(e: AppendError) -> Self {
        match e {
            AppendError::Conflict {
                aggregate,
                expected,
                actual,
            } => RecordError::Conflict {
                aggregate,
                expected,
                actual,
            },
            AppendError::Conflicts { conflicts } => RecordError::Conflicts { conflicts },
            other => RecordError::Append(other),
        }
    }
}

/// The permissions violation NATS reported for this aggregate's subject, if an
/// unavailable append was in fact refused.
fn denied_append(aggregate: AggregateId, since: std::time::Instant) -> Option<String> {
    crate::denials::denied(&format!(".ev.{}.{}", aggregate.kind, aggregate.id), since)
}

fn backoff(draft: &CommitDraft, attempt: usize) -> Duration {
    let spread = u64::from(draft.commit_id.as_bytes()[15]) + 1; // 1..=256
    let micros = spread * 40 * attempt as u64;
    Duration::from_micros(micros).min(DECIDE_BACKOFF_MAX)
}

/// Writes `draft` to `aggregate` if `expect` admits its version and the decider admits
/// the commit in its state at that version; the append then carries `Exactly(version)`.
/// With `expect any`, losing a race re-reads and re-decides, at most
/// [`DECIDE_ATTEMPTS_MAX`] times. A retry of a commit already in the log (same commit id
/// and payload) is recognised before anything is decided.
pub async fn record<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
) -> Result<Recorded, RecordError> {
    record_inner(
        log,
        aggregate,
        expect,
        draft,
        false,
        DecideOptions::default(),
        &FromTheLog,
    )
    .await
}

/// [`record`] with decider options (`force`: an inventory below usage).
pub async fn record_with<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
    options: DecideOptions,
) -> Result<Recorded, RecordError> {
    record_inner(log, aggregate, expect, draft, false, options, &FromTheLog).await
}

/// [`record_with`] for a process that holds the aggregate folded elsewhere (serve: its
/// projection store), so that its first write to a long aggregate reads only the commits
/// the store has not applied yet instead of the whole aggregate.
pub async fn record_with_folded<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
    options: DecideOptions,
    elsewhere: &dyn FoldedElsewhere,
) -> Result<Recorded, RecordError> {
    record_inner(log, aggregate, expect, draft, false, options, elsewhere).await
}

/// Writes a fact whose commit id is derived from what it records (a driver's or a
/// deleter's, see `derived_commit_id`): the id names the fact, so finding it already in
/// the log means the fact is recorded, even if this attempt would have worded it
/// differently (its events depend on state that the first attempt changed). A driver that
/// crashed between two such facts resumes instead of meeting `CommitIdReused` forever.
pub async fn record_fact<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    draft: CommitDraft,
) -> Result<Recorded, RecordError> {
    record_inner(
        log,
        aggregate,
        Expectation::Any,
        draft,
        true,
        DecideOptions::default(),
        &FromTheLog,
    )
    .await
}

async fn record_inner<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
    id_names_the_fact: bool,
    options: DecideOptions,
    elsewhere: &dyn FoldedElsewhere,
) -> Result<Recorded, RecordError> {
    draft.validate(&aggregate).map_err(AppendError::from)?;
    let mut turn = log.write_queues().turn(aggregate).await;
    let mut unavailable = 0;
    // Whether the state decided on was read from the log during this write: a refusal
    // (conflict, rejection, nothing to do) is only answered from a fresh state, never
    // from what the process remembered.
    let mut fresh = false;
    for attempt in 0..DECIDE_ATTEMPTS_MAX {
        // The first lost round retries at once (its re-read is what was missing); only
        // repeated losses, racers colliding in step, pause.
        if attempt > 1 && !fresh {
            tokio::time::sleep(backoff(&draft, attempt)).await;
        }
        let needs_read = known_mut(&mut turn).is_none_or(|k| k.stale);
        if needs_read {
            if !refresh_counted(log, aggregate, &mut turn, elsewhere, &mut unavailable).await? {
                continue;
            }
            fresh = true;
        }
        let Some(known) = known_mut(&mut turn) else {
            unreachable!("refresh leaves a known state in the slot");
        };
        if let Some(recent) = known.recent_commit(&draft) {
            match log.read_position(recent.position).await? {
                Some(earlier) if earlier.commit_id == draft.commit_id => {
                    return earlier_outcome(aggregate, &earlier, &draft, id_names_the_fact)
                }
                // The log does not hold it where it was seen: know the aggregate again.
                _ => {
                    fresh = read_again(&mut turn);
                    continue;
                }
            }
        }
        let Some(known) = known_mut(&mut turn) else {
            unreachable!("refresh leaves a known state in the slot");
        };
        let version = known.version();
        let position = known.tip.position;
        let refusal = if !expect.admits(version) {
            Some(Err(RecordError::Conflict {
                aggregate,
                expected: expect,
                actual: version,
            }))
        } else {
            match decide_append_with(aggregate, known.entity.as_ref(), &draft, options) {
                Err(rejection) => Some(Err(RecordError::Rejected(rejection))),
                Ok(Admission::AlreadyDone(outcome)) => Some(Ok(Recorded::AlreadyDone {
                    outcome,
                    version,
                    position,
                })),
                Ok(_) => None,
            }
        };
        if let Some(answer) = refusal {
            if !fresh {
                known.stale = true;
                continue;
            }
            // A read may come from a replica of the stream that lags behind its leader: a
            // refusal is answered only on a tip the leader confirms.
            let tip = known.tip;
            if !log.tip_is_current(aggregate, tip).await? {
                fresh = read_again(&mut turn);
                continue;
            }
            let Some(known) = known_mut(&mut turn) else {
                unreachable!("the slot is held for the whole write");
            };
            // The commit may be a retry of one that changed the state this refuses.
            let older = known.may_hold_older(&draft);
            if older {
                if let Some(earlier) = find_earlier(log, aggregate, &draft).await? {
                    return earlier_outcome(aggregate, &earlier, &draft, id_names_the_fact);
                }
            }
            return answer;
        }
        // A retry older than the log's own duplicate detection would be written twice.
        if known.may_hold_older(&draft) && !log.recognises_retry_on_append(&draft.commit_id) {
            if let Some(earlier) = find_earlier(log, aggregate, &draft).await? {
                return earlier_outcome(aggregate, &earlier, &draft, id_names_the_fact);
            }
        }
        let tip = known.tip;
        let appending = std::time::Instant::now();
        let appended = log
            .append(aggregate, Expectation::Exactly(version), draft.clone())
            .await;
        let Some(known) = known_mut(&mut turn) else {
            unreachable!("the slot is held for the whole write");
        };
        match appended {
            Ok(outcome) => {
                let sealed = (outcome.status == AppendStatus::Appended
                    && outcome.version == version + 1)
                    .then(|| {
                        let mut commit = Commit::seal(aggregate, outcome.version, tip.hash, draft);
                        commit.position = outcome.position;
                        commit
                    });
                // A duplicate the log recognised, or a version other than decided: the state
                // is re-read before the next write.
                match sealed {
                    Some(commit) => known.fold_own(aggregate, commit),
                    None => known.stale = true,
                }
                return Ok(Recorded::Appended(outcome));
            }
            // Another process appended after what we knew: read what is new and decide
            // again (the caller's own expectation is checked again on that state).
            Err(AppendError::Conflict { .. }) => {
                known.stale = true;
                fresh = false;
            }
            // The append may have landed with its ack lost: read again and see.
            Err(e @ AppendError::Unavailable { .. }) => {
                known.stale = true;
                if let Some(message) = denied_append(aggregate, appending) {
                    return Err(RecordError::PermissionDenied { aggregate, message });
                }
                unavailable += 1;
                if unavailable > UNAVAILABLE_RETRIES_MAX {
                    return Err(e.into());
                }
                tracing::warn!(%aggregate, commit_id = %draft.commit_id, error = %e, "append unavailable; retrying with the same commit id");
            }
            // The id is taken by a commit this state may not know: for a fact, that
            // commit is the fact recorded (in other words); otherwise a reused id.
            Err(AppendError::CommitIdReused { position, .. }) => {
                known.stale = true;
                if let Some(earlier) = log.read_position(position).await? {
                    if earlier.commit_id == draft.commit_id {
                        return earlier_outcome(aggregate, &earlier, &draft, id_names_the_fact);
                    }
                }
                return Err(AppendError::CommitIdReused {
                    commit_id: draft.commit_id,
                    position,
                }
                .into());
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(RecordError::Contended {
        aggregate,
        attempts: DECIDE_ATTEMPTS_MAX,
    })
}

/// The answer to a draft whose commit id is already in the log.
fn earlier_outcome(
    aggregate: AggregateId,
    earlier: &Commit,
    draft: &CommitDraft,
    id_names_the_fact: bool,
) -> Result<Recorded, RecordError> {
    if id_names_the_fact {
        return Ok(Recorded::Appended(AppendOutcome {
            position: earlier.position,
            version: earlier.version,
            status: AppendStatus::AlreadyAppended,
        }));
    }
    Ok(Recorded::Appended(earlier.retry_outcome(aggregate, draft)?))
}

/// Looks the draft's commit id up in the log (which bounds the search by the id's age
/// where it can): the fallback when what is known cannot tell.
async fn find_earlier<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    draft: &CommitDraft,
) -> Result<Option<Commit>, RecordError> {
    Ok(log.find_commit(aggregate, draft.commit_id).await?)
}

/// One commit of an atomic write: `draft` on `aggregate` if `expect` admits its version
/// and the decider admits the commit in the aggregate's state at that version.
#[derive(Debug, Clone)]
pub struct Fact {
    pub aggregate: AggregateId,
    pub expect: Expectation,
    pub draft: CommitDraft,
}

/// Writes several facts on distinct aggregates all or nothing: each decided on what this
/// process knows of its aggregate (brought up to the log's head), each appended at exactly
/// the version it was decided at, all in one atomic append. A lost race on any aggregate
/// re-reads what is new there and decides again (a caller's own expectations are checked
/// again on that state). A refusal names every aggregate refused; nothing is written then.
/// A retry of the same facts (same commit ids and payloads) answers each as already
/// appended. A fact the decider finds already true (a repeated delete) is not written
/// and is answered `AlreadyDone`; the others are written together.
pub async fn record_atomic<L: EventLog>(
    log: &L,
    facts: Vec<Fact>,
    options: DecideOptions,
    elsewhere: &dyn FoldedElsewhere,
) -> Result<Vec<Recorded>, RecordError> {
    provledger_events::log::validate_batch(facts.iter().map(|f| (f.aggregate, &f.draft)))
        .map_err(RecordError::Append)?;
    // Turns are taken in aggregate order, so two atomic writers never wait on each other
    // in a cycle; a single-aggregate writer holds one turn only.
    let mut order: Vec<usize> = (0..facts.len()).collect();
    order.sort_by_key(|&i| facts[i].aggregate);
    let mut turns: Vec<Option<WriteTurn>> = (0..facts.len()).map(|_| None).collect();
    for &i in &order {
        turns[i] = Some(log.write_queues().turn(facts[i].aggregate).await);
    }
    let mut turns: Vec<WriteTurn> = turns.into_iter().flatten().collect();
    let mut unavailable = 0;
    let mut fresh = false;
    for attempt in 0..DECIDE_ATTEMPTS_MAX {
        // The first lost round retries at once (its re-read is what was missing); only
        // repeated losses, racers colliding in step, pause.
        if attempt > 1 && !fresh {
            tokio::time::sleep(backoff(&facts[0].draft, attempt)).await;
        }
        let mut all_known = true;
        for (fact, turn) in facts.iter().zip(turns.iter_mut()) {
            if known_mut(turn).is_none_or(|k| k.stale) {
                if refresh_counted(log, fact.aggregate, turn, elsewhere, &mut unavailable).await? {
                    fresh = true;
                } else {
                    all_known = false;
                    break;
                }
            }
        }
        if !all_known {
            continue;
        }
        // A retry of facts already written is recognised before anything is decided.
        let may_be_retry = facts.iter().zip(turns.iter_mut()).any(|(f, t)| {
            known_mut(t).is_some_and(|k| {
                k.recent_commit(&f.draft).is_some()
                    || (k.may_hold_older(&f.draft)
                        && !log.recognises_retry_on_append(&f.draft.commit_id))
            })
        });
        if may_be_retry {
            if let Some(answers) = earlier_facts(log, &facts, &mut turns, options).await? {
                return Ok(answers);
            }
        }
        // Decide every fact on its state; gather every refusal.
        let mut conflicts = Vec::new();
        let mut rejections = Vec::new();
        let mut done = vec![None; facts.len()];
        let mut versions = Vec::with_capacity(facts.len());
        for (i, (fact, turn)) in facts.iter().zip(turns.iter_mut()).enumerate() {
            let Some(known) = known_mut(turn) else {
                unreachable!("refresh leaves a known state in the slot");
            };
            let version = known.version();
            versions.push((version, known.tip));
            if !fact.expect.admits(version) {
                conflicts.push(VersionConflict {
                    aggregate: fact.aggregate,
                    expected: fact.expect,
                    actual: version,
                });
                continue;
            }
            match decide_append_with(fact.aggregate, known.entity.as_ref(), &fact.draft, options) {
                Err(rejection) => rejections.push((fact.aggregate, rejection)),
                Ok(Admission::AlreadyDone(outcome)) => {
                    done[i] = Some(Recorded::AlreadyDone {
                        outcome,
                        version,
                        position: known.tip.position,
                    })
                }
                Ok(_) => {}
            }
        }
        let refused: Vec<AggregateId> = conflicts
            .iter()
            .map(|c| c.aggregate)
            .chain(rejections.iter().map(|(a, _)| *a))
            .chain(
                facts
                    .iter()
                    .zip(&done)
                    .filter(|(_, d)| d.is_some())
                    .map(|(f, _)| f.aggregate),
            )
            .collect();
        if !refused.is_empty() {
            // As for one aggregate: a refusal is answered only on state read during this
            // write and confirmed by the stream's leader.
            let mut confirmed = fresh;
            if confirmed {
                for (fact, (_, tip)) in facts.iter().zip(&versions) {
                    if refused.contains(&fact.aggregate)
                        && !log.tip_is_current(fact.aggregate, *tip).await?
                    {
                        confirmed = false;
                    }
                }
            }
            if !confirmed {
                for (fact, turn) in facts.iter().zip(turns.iter_mut()) {
                    if refused.contains(&fact.aggregate) {
                        read_again(turn);
                    }
                }
                fresh = false;
                continue;
            }
            // The facts may be a retry of a set already written (its answer lost, asked
            // again of another replica, or past the commits kept here), which the state
            // they changed now refuses: looked up before a refusal is answered.
            let older = facts
                .iter()
                .zip(turns.iter_mut())
                .any(|(f, t)| known_mut(t).is_none_or(|k| k.may_hold_older(&f.draft)));
            // (Already looked up in this round if it may be a retry: the state is the same.)
            if older && !may_be_retry {
                if let Some(answers) = earlier_facts(log, &facts, &mut turns, options).await? {
                    return Ok(answers);
                }
            }
            if !conflicts.is_empty() {
                return Err(RecordError::Conflicts { conflicts });
            }
            if !rejections.is_empty() {
                return Err(RecordError::Rejections { rejections });
            }
        }
        // Append what is not already true, each at exactly the version decided on.
        let writing: Vec<usize> = (0..facts.len()).filter(|&i| done[i].is_none()).collect();
        if writing.is_empty() {
            return Ok(done.into_iter().flatten().collect());
        }
        let batch: Vec<AtomicItem> = writing
            .iter()
            .map(|&i| AtomicItem {
                aggregate: facts[i].aggregate,
                expect: Expectation::Exactly(versions[i].0),
                draft: facts[i].draft.clone(),
            })
            .collect();
        let appending = std::time::Instant::now();
        match log.append_atomic(batch).await {
            Ok(outcomes) => {
                let mut answers = done;
                for (&i, outcome) in writing.iter().zip(outcomes) {
                    let (version, tip) = versions[i];
                    let Some(known) = known_mut(&mut turns[i]) else {
                        unreachable!("the slot is held for the whole write");
                    };
                    if outcome.status == AppendStatus::Appended && outcome.version == version + 1 {
                        let mut commit = Commit::seal(
                            facts[i].aggregate,
                            outcome.version,
                            tip.hash,
                            facts[i].draft.clone(),
                        );
                        commit.position = outcome.position;
                        known.fold_own(facts[i].aggregate, commit);
                    } else {
                        known.stale = true;
                    }
                    answers[i] = Some(Recorded::Appended(outcome));
                }
                return Ok(answers.into_iter().flatten().collect());
            }
            Err(AppendError::Conflicts { conflicts }) => {
                for turn in turns.iter_mut() {
                    read_again(turn);
                }
                fresh = false;
                tracing::debug!(
                    conflicts = conflicts.len(),
                    "atomic write lost a race; deciding again"
                );
            }
            Err(e @ AppendError::Unavailable { .. }) => {
                // A batch to a subject this user may not publish to only times out: the
                // server's violation names the subject, and makes it a typed refusal.
                let denied = writing.iter().find_map(|&i| {
                    denied_append(facts[i].aggregate, appending)
                        .map(|message| (facts[i].aggregate, message))
                });
                if let Some((aggregate, message)) = denied {
                    return Err(RecordError::PermissionDenied { aggregate, message });
                }
                for turn in turns.iter_mut() {
                    read_again(turn);
                }
                fresh = false;
                unavailable += 1;
                if unavailable > UNAVAILABLE_RETRIES_MAX {
                    return Err(e.into());
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(RecordError::Contended {
        aggregate: facts[0].aggregate,
        attempts: DECIDE_ATTEMPTS_MAX,
    })
}

/// Each fact's commit id looked up in the log. `None` when none is there. Otherwise the
/// earlier answer: a fact found is `AlreadyAppended` (its payload must be the same); a fact
/// not found was left out of that set because it was already true (decided again here, it
/// is still `AlreadyDone`); anything else means the ids were reused.
async fn earlier_facts<L: EventLog>(
    log: &L,
    facts: &[Fact],
    turns: &mut [WriteTurn],
    options: DecideOptions,
) -> Result<Option<Vec<Recorded>>, RecordError> {
    let mut found = Vec::with_capacity(facts.len());
    for fact in facts {
        found.push(
            log.find_commit(fact.aggregate, fact.draft.commit_id)
                .await?,
        );
    }
    let Some(reused) = found
        .iter()
        .flatten()
        .next()
        .map(|c| (c.commit_id, c.position))
    else {
        return Ok(None);
    };
    let mut answers = Vec::with_capacity(facts.len());
    for ((fact, earlier), turn) in facts.iter().zip(&found).zip(turns.iter_mut()) {
        match earlier {
            Some(c) => answers.push(earlier_outcome(fact.aggregate, c, &fact.draft, false)?),
            None => {
                let Some(known) = known_mut(turn) else {
                    unreachable!("refresh leaves a known state in the slot");
                };
                match decide_append_with(
                    fact.aggregate,
                    known.entity.as_ref(),
                    &fact.draft,
                    options,
                ) {
                    Ok(Admission::AlreadyDone(outcome)) => answers.push(Recorded::AlreadyDone {
                        outcome,
                        version: known.version(),
                        position: known.tip.position,
                    }),
                    _ => {
                        return Err(AppendError::CommitIdReused {
                            commit_id: reused.0,
                            position: reused.1,
                        }
                        .into())
                    }
                }
            }
        }
    }
    for turn in turns.iter_mut() {
        read_again(turn);
    }
    Ok(Some(answers))
}
