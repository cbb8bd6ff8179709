//! The one write path: know the aggregate, decide, append at exactly the version decided
//! on. `cmd.append`, `provledger append` and this library's own writes all go through a
//! [`Writer`], so a commit is acknowledged only if the fold applies it, and no decision is
//! taken against a state older than the version the commit lands on.
//!
//! A process keeps one `Writer` per log (its clones share it). Writers of one process take
//! turns per aggregate (`turns`) and keep, in the aggregate's turn, what they know of it
//! (`known`: the folded entity, its chain tip and its last commits). A write decides on
//! that state and appends with exactly its version; if another process wrote in between,
//! the log refuses the expectation and the write reads only the commits after its tip,
//! then decides again. So a write costs the same on an aggregate's 100,000th commit as on
//! its first, hot aggregates queue inside a process instead of failing, and nothing is
//! decided on a state the append does not check.
//!
//! One commit ([`Writer::record`]) and facts that move together ([`Writer::record_atomic`])
//! go through the same rounds (`Attempts`): refresh, recognise a retry, decide, append,
//! classify. They differ only in how the commits are appended (one append, or one atomic
//! append) and in how a refusal is named.

mod known;
mod turns;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use provledger_events::{
    AggregateId, AppendError, AppendOutcome, AppendStatus, AtomicItem, ChainTip, Commit,
    CommitDraft, EventLog, Expectation, ReadError, VersionConflict,
};
use provledger_projections::decide::{
    decide_append_with, Admission, AlreadyDone, AppendRejection, DecideOptions,
};
use provledger_projections::Entity;

use known::Known;
pub use known::RECENT_COMMITS_MAX;
pub use turns::WRITE_QUEUES_MAX;
use turns::{Turn, Turns};

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

/// Where a process may find an aggregate already folded from this very log (serve's
/// projection store), to start what it keeps without reading the aggregate whole. What it
/// returns is only a starting point: the commits after its tip are read from the log before
/// anything is decided, and the log's expectation catches anything else.
pub trait FoldedElsewhere: Send + Sync {
    fn folded(&self, aggregate: AggregateId) -> Option<Entity>;
}

/// Where a fold of the same log elsewhere in the process (serve's projector) tells a
/// [`Writer`] and its clones how far it has taken each aggregate. A write whose kept state
/// is older than that reads the log first, instead of appending on a state another process
/// has moved past, which the log would refuse: a round trip lost before the same read.
/// Kept in memory beside each kept state, so a write pays one atomic load for it (asking
/// serve's store on every write cost about 8% of the single-commit rate). A hint only: the
/// log's expectation still decides.
///
/// The tips reached go to the log too ([`EventLog::note_head`]): a write then decided on
/// the state folded elsewhere appends at once, without reading the log after its tip
/// first (the log refuses the append if anything came after).
#[derive(Clone)]
pub struct FoldedVersions {
    turns: Arc<Turns<Known>>,
    heads: Arc<dyn Fn(AggregateId, ChainTip) + Send + Sync>,
}

impl FoldedVersions {
    /// Each `(aggregate, tip)` a fold reached; aggregates this writer keeps no state for
    /// are passed over.
    pub fn folded(&self, tips: impl IntoIterator<Item = (AggregateId, ChainTip)>) {
        self.turns
            .folded(tips, |aggregate, tip| (self.heads)(aggregate, tip));
    }
}

/// No state folded elsewhere: a process starts from the log.
pub struct FromTheLog;

impl FoldedElsewhere for FromTheLog {
    fn folded(&self, _aggregate: AggregateId) -> Option<Entity> {
        None
    }
}

/// One commit of an atomic write: `draft` on `aggregate` if `expect` admits its version
/// and the decider admits the commit in the aggregate's state at that version.
#[derive(Debug, Clone)]
pub struct Fact {
    pub aggregate: AggregateId,
    pub expect: Expectation,
    pub draft: CommitDraft,
}

/// A process's write path over one log: the log, and per aggregate a turn and what is
/// known of it. Clones share both; a process keeps one per log, so that its writers of
/// one aggregate take turns and its known states serve every write.
pub struct Writer<L> {
    log: L,
    turns: Arc<Turns<Known>>,
    /// Appends the log refused because another process had appended after the state
    /// they were decided on ([`Writer::races_lost`]).
    races_lost: Arc<AtomicU64>,
}

impl<L: Clone> Clone for Writer<L> {
    fn clone(&self) -> Self {
        Writer {
            log: self.log.clone(),
            turns: self.turns.clone(),
            races_lost: self.races_lost.clone(),
        }
    }
}

impl<L> std::fmt::Debug for Writer<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("known_aggregates", &self.turns.len())
            .finish()
    }
}

impl<L: EventLog> Writer<L> {
    /// A writer knowing nothing yet: each aggregate is read on its first write.
    pub fn new(log: L) -> Self {
        Writer {
            log,
            turns: Arc::default(),
            races_lost: Arc::default(),
        }
    }

    /// How many appends of this writer (and its clones) the log refused because another
    /// process had appended after the state they were decided on; each was read and
    /// decided again. Races between replicas count here, and so would a kept state used
    /// although the state folded elsewhere was known to be newer.
    pub fn races_lost(&self) -> u64 {
        self.races_lost.load(Ordering::Relaxed)
    }

    /// Where a fold of the same log elsewhere in this process tells this writer how far it
    /// took each aggregate ([`FoldedVersions`]).
    pub fn folded_versions(&self) -> FoldedVersions
    where
        L: Clone + Send + Sync + 'static,
    {
        let log = self.log.clone();
        FoldedVersions {
            turns: self.turns.clone(),
            heads: Arc::new(move |aggregate, tip| log.note_head(aggregate, tip)),
        }
    }

    /// The log written to, for reads.
    pub fn log(&self) -> &L {
        &self.log
    }

    /// How many aggregates this writer keeps a state for (at most [`WRITE_QUEUES_MAX`]
    /// plus those being written when the bound was reached).
    pub fn known_aggregates(&self) -> usize {
        self.turns.len()
    }

    /// The current state of `aggregate`, as fresh as the log: what this process knows of
    /// it, plus the commits written since (read after its tip). `None` without commits.
    pub async fn read_current(&self, aggregate: AggregateId) -> Result<Option<Entity>, ReadError> {
        let (mut turn, _) = self.turns.turn(aggregate).await;
        refresh(&self.log, aggregate, &mut turn, &FromTheLog, false).await?;
        Ok(turn.entity.clone())
    }

    /// Writes `draft` to `aggregate` if `expect` admits its version and the decider admits
    /// the commit in its state at that version; the append then carries
    /// `Exactly(version)`. With `expect any`, losing a race re-reads and re-decides, at
    /// most [`DECIDE_ATTEMPTS_MAX`] times. A retry of a commit already in the log (same
    /// commit id and payload) is recognised before anything is decided.
    pub async fn record(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<Recorded, RecordError> {
        self.record_with(aggregate, expect, draft, DecideOptions::default())
            .await
    }

    /// [`Self::record`] with decider options (`force`: an inventory below usage).
    pub async fn record_with(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
        options: DecideOptions,
    ) -> Result<Recorded, RecordError> {
        self.record_with_folded(aggregate, expect, draft, options, &FromTheLog)
            .await
    }

    /// [`Self::record_with`] for a process that holds the aggregate folded elsewhere
    /// (serve: its projection store), so that its first write to a long aggregate reads
    /// only the commits the store has not applied yet instead of the whole aggregate.
    pub async fn record_with_folded(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
        options: DecideOptions,
        elsewhere: &dyn FoldedElsewhere,
    ) -> Result<Recorded, RecordError> {
        let fact = Fact {
            aggregate,
            expect,
            draft,
        };
        let shape = Shape::One {
            id_names_the_fact: false,
        };
        self.write(std::slice::from_ref(&fact), shape, options, elsewhere)
            .await
            .map(only)
    }

    /// Writes a fact whose commit id is derived from what it records (a driver's or a
    /// deleter's, see `derived_commit_id`): the id names the fact, so finding it already
    /// in the log means the fact is recorded, even if this attempt would have worded it
    /// differently (its events depend on state that the first attempt changed). A driver
    /// that crashed between two such facts resumes instead of meeting `CommitIdReused`
    /// forever.
    pub async fn record_fact(
        &self,
        aggregate: AggregateId,
        draft: CommitDraft,
    ) -> Result<Recorded, RecordError> {
        let fact = Fact {
            aggregate,
            expect: Expectation::Any,
            draft,
        };
        let shape = Shape::One {
            id_names_the_fact: true,
        };
        self.write(
            std::slice::from_ref(&fact),
            shape,
            DecideOptions::default(),
            &FromTheLog,
        )
        .await
        .map(only)
    }

    /// Writes several facts on distinct aggregates all or nothing: each decided on what
    /// this process knows of its aggregate (brought up to the log's head), each appended at
    /// exactly the version it was decided at, all in one atomic append. A lost race on any
    /// aggregate re-reads what is new there and decides again (a caller's own expectations
    /// are checked again on that state). A refusal names every aggregate refused; nothing
    /// is written then. A retry of the same facts (same commit ids and payloads) answers
    /// each as already appended. A fact the decider finds already true (a repeated delete)
    /// is not written and is answered `AlreadyDone`; the others are written together.
    pub async fn record_atomic(
        &self,
        facts: Vec<Fact>,
        options: DecideOptions,
        elsewhere: &dyn FoldedElsewhere,
    ) -> Result<Vec<Recorded>, RecordError> {
        self.write(&facts, Shape::Set, options, elsewhere).await
    }

    /// The rounds of one write, until one answers or the bound of rounds is reached.
    async fn write(
        &self,
        facts: &[Fact],
        shape: Shape,
        options: DecideOptions,
        elsewhere: &dyn FoldedElsewhere,
    ) -> Result<Vec<Recorded>, RecordError> {
        match shape {
            Shape::One { .. } => {
                debug_assert_eq!(facts.len(), 1);
                for fact in facts {
                    fact.draft
                        .validate(&fact.aggregate)
                        .map_err(AppendError::from)?;
                }
            }
            Shape::Set => {
                provledger_events::log::validate_batch(
                    facts.iter().map(|f| (f.aggregate, &f.draft)),
                )
                .map_err(RecordError::Append)?;
            }
        }
        // Turns are taken in aggregate order, so two atomic writers never wait on each
        // other in a cycle; a single-aggregate writer holds one turn only.
        let mut order: Vec<usize> = (0..facts.len()).collect();
        order.sort_by_key(|&i| facts[i].aggregate);
        let mut taken: Vec<Option<(Turn<Known>, Arc<AtomicU64>)>> =
            (0..facts.len()).map(|_| None).collect();
        for &i in &order {
            taken[i] = Some(self.turns.turn(facts[i].aggregate).await);
        }
        let (turns, folded) = taken.into_iter().flatten().unzip();
        let mut attempts = Attempts {
            log: &self.log,
            facts,
            turns,
            folded,
            shape,
            options,
            elsewhere,
            unavailable: 0,
            fresh: false,
            adopted_at_head: false,
            races_lost: &self.races_lost,
        };
        for attempt in 0..DECIDE_ATTEMPTS_MAX {
            // The first lost round retries at once (its re-read is what was missing); only
            // repeated losses, racers colliding in step, pause.
            if attempt > 1 && !attempts.fresh {
                tokio::time::sleep(backoff(&facts[0].draft, attempt)).await;
            }
            if let Round::Answer(answers) = attempts.round().await? {
                debug_assert_eq!(answers.len(), facts.len());
                return Ok(answers);
            }
        }
        Err(RecordError::Contended {
            aggregate: facts[0].aggregate,
            attempts: DECIDE_ATTEMPTS_MAX,
        })
    }
}

/// The one answer of a one-commit write.
fn only(mut answers: Vec<Recorded>) -> Recorded {
    // A one-commit write answers its one fact (asserted in `Writer::write`); an empty
    // answer cannot come out of it.
    answers.swap_remove(0)
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

/// How a write's facts were asked for: how they are appended and how a refusal is named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// One commit (`record`): one append; a refusal is `Conflict` or `Rejected`.
    /// `id_names_the_fact` (`record_fact`): the commit id is derived from the fact, so
    /// finding it in the log means the fact is recorded, whatever its wording.
    One { id_names_the_fact: bool },
    /// Facts that move together (`record_atomic`): one atomic append; a refusal is
    /// `Conflicts` or `Rejections`, naming every aggregate refused.
    Set,
}

impl Shape {
    fn id_names_the_fact(self) -> bool {
        matches!(
            self,
            Shape::One {
                id_names_the_fact: true
            }
        )
    }

    fn conflicts(self, mut conflicts: Vec<VersionConflict>) -> RecordError {
        match (self, conflicts.len()) {
            (Shape::One { .. }, 1) => {
                let c = conflicts.remove(0);
                RecordError::Conflict {
                    aggregate: c.aggregate,
                    expected: c.expected,
                    actual: c.actual,
                }
            }
            _ => RecordError::Conflicts { conflicts },
        }
    }

    fn rejections(self, mut rejections: Vec<(AggregateId, AppendRejection)>) -> RecordError {
        match (self, rejections.len()) {
            (Shape::One { .. }, 1) => RecordError::Rejected(rejections.remove(0).1),
            _ => RecordError::Rejections { rejections },
        }
    }
}

/// What one round ends in: an answer for every fact, or another round.
enum Round {
    Answer(Vec<Recorded>),
    Again,
}

/// What a look for the facts' commit ids in the log found.
enum Earlier {
    /// None of them is there.
    NotThere,
    /// The facts were written before: the answer.
    Answer(Vec<Recorded>),
    /// A commit seen here is not where it was seen: the aggregate is read again.
    Moved,
}

/// Each fact decided on what its turn knows.
struct Decision {
    /// The tip each fact was decided at.
    tips: Vec<ChainTip>,
    conflicts: Vec<VersionConflict>,
    rejections: Vec<(AggregateId, AppendRejection)>,
    /// The facts already true, answered without being written.
    done: Vec<Option<Recorded>>,
}

impl Decision {
    /// The aggregates whose answer is not a write: refused, or already true.
    fn refused(&self, facts: &[Fact]) -> Vec<AggregateId> {
        self.conflicts
            .iter()
            .map(|c| c.aggregate)
            .chain(self.rejections.iter().map(|(a, _)| *a))
            .chain(
                facts
                    .iter()
                    .zip(&self.done)
                    .filter(|(_, d)| d.is_some())
                    .map(|(f, _)| f.aggregate),
            )
            .collect()
    }
}

/// The state of one write across its rounds: its facts, their turns (held for the whole
/// write) and what the rounds have learned.
struct Attempts<'a, L> {
    log: &'a L,
    facts: &'a [Fact],
    /// One per fact, in the facts' order.
    turns: Vec<Turn<Known>>,
    /// The version a fold elsewhere in the process reached, one per fact
    /// ([`FoldedVersions`]).
    folded: Vec<Arc<AtomicU64>>,
    shape: Shape,
    options: DecideOptions,
    elsewhere: &'a dyn FoldedElsewhere,
    /// Reads and appends that came back `Unavailable`, bounded by
    /// [`UNAVAILABLE_RETRIES_MAX`].
    unavailable: usize,
    races_lost: &'a AtomicU64,
    /// Whether the states decided on were read from the log during this write: a refusal
    /// (conflict, rejection, nothing to do) is only answered from a fresh state, never
    /// from what the process remembered.
    fresh: bool,
    /// Whether a state was taken from the fold elsewhere at the head the log holds, without
    /// a read (`refresh`). Once per write: a round after a lost race or an unconfirmed
    /// refusal reads, or it would chase a fold that lags behind the log round after round.
    adopted_at_head: bool,
}

impl<L: EventLog> Attempts<'_, L> {
    /// One round: bring every stale state up to the log, recognise a retry, decide each
    /// fact, and append what is to be written at exactly the versions decided on.
    async fn round(&mut self) -> Result<Round, RecordError> {
        if !self.refresh_stale().await? {
            return Ok(Round::Again);
        }
        // A retry of facts already written is recognised before anything is decided: one
        // this process saw, or one older than what it keeps that the log's own duplicate
        // detection would not catch.
        let may_be_retry = self.facts.iter().zip(&self.turns).any(|(f, known)| {
            known.recent_commit(&f.draft).is_some()
                || (known.may_hold_older(&f.draft)
                    && !self.log.recognises_retry_on_append(&f.draft.commit_id))
        });
        if may_be_retry {
            match self.earlier().await? {
                Earlier::NotThere => {}
                Earlier::Answer(answers) => return Ok(Round::Answer(answers)),
                Earlier::Moved => return Ok(Round::Again),
            }
        }
        let decision = self.decide();
        let refused = decision.refused(self.facts);
        if !refused.is_empty() {
            if !self.confirmed(&decision, &refused).await? {
                for (fact, known) in self.facts.iter().zip(self.turns.iter_mut()) {
                    if refused.contains(&fact.aggregate) {
                        known.stale = true;
                    }
                }
                self.fresh = false;
                return Ok(Round::Again);
            }
            // The facts may be a retry of commits already written (the answer lost, asked
            // again of another replica, or past the commits kept here), which the state
            // they changed now refuses: looked up before a refusal is answered (unless
            // this round already did, on this same state).
            let older = self
                .facts
                .iter()
                .zip(&self.turns)
                .any(|(f, known)| known.may_hold_older(&f.draft));
            if older && !may_be_retry {
                match self.earlier().await? {
                    Earlier::NotThere => {}
                    Earlier::Answer(answers) => return Ok(Round::Answer(answers)),
                    Earlier::Moved => return Ok(Round::Again),
                }
            }
            if !decision.conflicts.is_empty() {
                return Err(self.shape.conflicts(decision.conflicts));
            }
            if !decision.rejections.is_empty() {
                return Err(self.shape.rejections(decision.rejections));
            }
        }
        self.append(decision).await
    }

    /// Refreshes every state that needs a read. False when the log was unavailable (within
    /// the write's bound): the round is tried again.
    async fn refresh_stale(&mut self) -> Result<bool, RecordError> {
        let at_head = !self.adopted_at_head;
        let mut adopted = false;
        for ((fact, turn), folded) in self
            .facts
            .iter()
            .zip(self.turns.iter_mut())
            .zip(&self.folded)
        {
            // Another process moved the aggregate past what is kept (serve's projector
            // has folded it further): read before deciding rather than lose the append.
            if !turn.stale && turn.was_read() && folded.load(Ordering::Relaxed) > turn.version() {
                turn.stale = true;
            }
            if !turn.stale {
                continue;
            }
            // A write the log's append would not itself recognise as a retry is looked for
            // in the log before it is decided (`earlier`), on a state read, not taken.
            let at_head = at_head && self.log.recognises_retry_on_append(&fact.draft.commit_id);
            match refresh(self.log, fact.aggregate, turn, self.elsewhere, at_head).await {
                Ok(Refreshed::Read) => self.fresh = true,
                Ok(Refreshed::Adopted) => adopted = true,
                Err(e @ ReadError::Unavailable { .. }) => {
                    self.adopted_at_head |= adopted;
                    self.unavailable += 1;
                    if self.unavailable > UNAVAILABLE_RETRIES_MAX {
                        return Err(e.into());
                    }
                    return Ok(false);
                }
                Err(e) => return Err(e.into()),
            }
        }
        self.adopted_at_head |= adopted;
        Ok(true)
    }

    /// Every fact decided on its state; every refusal gathered.
    fn decide(&self) -> Decision {
        let mut decision = Decision {
            tips: Vec::with_capacity(self.facts.len()),
            conflicts: Vec::new(),
            rejections: Vec::new(),
            done: vec![None; self.facts.len()],
        };
        for (i, (fact, known)) in self.facts.iter().zip(&self.turns).enumerate() {
            let version = known.version();
            decision.tips.push(known.tip);
            if !fact.expect.admits(version) {
                decision.conflicts.push(VersionConflict {
                    aggregate: fact.aggregate,
                    expected: fact.expect,
                    actual: version,
                });
                continue;
            }
            match decide_append_with(
                fact.aggregate,
                known.entity.as_ref(),
                &fact.draft,
                self.options,
            ) {
                Err(rejection) => decision.rejections.push((fact.aggregate, rejection)),
                Ok(Admission::AlreadyDone(outcome)) => {
                    decision.done[i] = Some(Recorded::AlreadyDone {
                        outcome,
                        version,
                        position: known.tip.position,
                    })
                }
                Ok(_) => {}
            }
        }
        decision
    }

    /// Whether a refusal may be answered: decided on states read during this write, at
    /// tips the stream's leader confirms (a read may come from a replica that lags).
    async fn confirmed(
        &self,
        decision: &Decision,
        refused: &[AggregateId],
    ) -> Result<bool, RecordError> {
        if !self.fresh {
            return Ok(false);
        }
        for (fact, tip) in self.facts.iter().zip(&decision.tips) {
            if refused.contains(&fact.aggregate)
                && !self.log.tip_is_current(fact.aggregate, *tip).await?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Each fact's commit id looked for in the log: where this process saw it (one read by
    /// position), or else by the log's lookup (which bounds its search by the id's age where
    /// it can). A fact found is `AlreadyAppended` (with the same payload, unless its id
    /// names the fact); a fact not found was left out of that earlier write because it was
    /// already true (decided again here, it still is: `AlreadyDone`); anything else means
    /// the ids were reused.
    async fn earlier(&mut self) -> Result<Earlier, RecordError> {
        let mut found = Vec::with_capacity(self.facts.len());
        for (fact, known) in self.facts.iter().zip(&self.turns) {
            let commit = match known.recent_commit(&fact.draft) {
                Some(recent) => match self.log.read_position(recent.position).await? {
                    Some(c) if c.commit_id == fact.draft.commit_id => Some(c),
                    // The log does not hold it where it was seen: know the aggregate again.
                    _ => {
                        self.read_again();
                        return Ok(Earlier::Moved);
                    }
                },
                None => {
                    self.log
                        .find_commit(fact.aggregate, fact.draft.commit_id)
                        .await?
                }
            };
            found.push(commit);
        }
        let Some(reused) = found
            .iter()
            .flatten()
            .next()
            .map(|c| (c.commit_id, c.position))
        else {
            return Ok(Earlier::NotThere);
        };
        let mut answers = Vec::with_capacity(self.facts.len());
        for ((fact, earlier), known) in self.facts.iter().zip(&found).zip(&self.turns) {
            match earlier {
                Some(c) => answers.push(earlier_outcome(
                    fact.aggregate,
                    c,
                    &fact.draft,
                    self.shape.id_names_the_fact(),
                )?),
                None => match decide_append_with(
                    fact.aggregate,
                    known.entity.as_ref(),
                    &fact.draft,
                    self.options,
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
                },
            }
        }
        // What is known may not have folded the commits found: read before the next write.
        self.read_again();
        Ok(Earlier::Answer(answers))
    }

    /// Appends what is not already true, each at exactly the version decided on, and
    /// classifies what the log answered.
    async fn append(&mut self, decision: Decision) -> Result<Round, RecordError> {
        let writing: Vec<usize> = (0..self.facts.len())
            .filter(|&i| decision.done[i].is_none())
            .collect();
        if writing.is_empty() {
            return Ok(Round::Answer(decision.done.into_iter().flatten().collect()));
        }
        let appending = std::time::Instant::now();
        match self.append_decided(&decision, &writing).await {
            Ok(outcomes) => Ok(self.appended(decision, &writing, outcomes)),
            // Another process appended after what we knew: read what is new and decide
            // again (the caller's own expectations are checked again on that state).
            Err(AppendError::Conflict { .. } | AppendError::Conflicts { .. }) => {
                self.races_lost.fetch_add(1, Ordering::Relaxed);
                self.read_again();
                tracing::debug!(aggregate = %self.facts[0].aggregate, "write lost a race; deciding again");
                Ok(Round::Again)
            }
            // The append may have landed with its ack lost: read again and see.
            Err(e @ AppendError::Unavailable { .. }) => {
                self.after_unavailable(e, &writing, appending)
            }
            // One commit whose id is taken by a commit this state may not know: for a
            // fact, that commit is the fact recorded (in other words); otherwise a reused
            // id. (An atomic append has told a retry from a reuse already.)
            Err(AppendError::CommitIdReused {
                commit_id,
                position,
            }) if matches!(self.shape, Shape::One { .. }) => {
                self.after_id_taken(&writing, commit_id, position).await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Appends the facts at `writing` to the log, each expecting exactly the version it
    /// was decided at: one append for one commit, one atomic append for a set.
    async fn append_decided(
        &self,
        decision: &Decision,
        writing: &[usize],
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        match self.shape {
            Shape::One { .. } => {
                let fact = &self.facts[writing[0]];
                let expect = Expectation::Exactly(decision.tips[writing[0]].version);
                self.log
                    .append(fact.aggregate, expect, fact.draft.clone())
                    .await
                    .map(|outcome| vec![outcome])
            }
            Shape::Set => {
                let batch = writing
                    .iter()
                    .map(|&i| AtomicItem {
                        aggregate: self.facts[i].aggregate,
                        expect: Expectation::Exactly(decision.tips[i].version),
                        draft: self.facts[i].draft.clone(),
                    })
                    .collect();
                self.log.append_atomic(batch).await
            }
        }
    }

    /// The answer once the log took the facts at `writing`: each outcome, with what is
    /// known of its aggregate extended by the commit (or marked for a read, for a
    /// duplicate the log recognised); the facts already true keep their answer.
    fn appended(
        &mut self,
        decision: Decision,
        writing: &[usize],
        outcomes: Vec<AppendOutcome>,
    ) -> Round {
        let mut answers = decision.done;
        for (&i, outcome) in writing.iter().zip(outcomes) {
            let fact = &self.facts[i];
            let tip = decision.tips[i];
            let known = &mut self.turns[i];
            // Appended at exactly the version decided on: the log took the
            // expectation `Exactly(tip)`, so anything else is a log that broke it,
            // and a state decided at one version would be recorded at another.
            assert!(
                outcome.status != AppendStatus::Appended || outcome.version == tip.version + 1,
                "{} appended at v{} at position {}, decided at v{} (expected exactly v{})",
                fact.aggregate,
                outcome.version,
                outcome.position,
                tip.version + 1,
                tip.version
            );
            // Sealed here on the tip decided at and landed at the next version: it
            // extends what is known. A duplicate the log recognised is read before
            // the next write.
            if outcome.status == AppendStatus::Appended {
                let mut commit = Commit::seal(
                    fact.aggregate,
                    outcome.version,
                    tip.hash,
                    fact.draft.clone(),
                );
                commit.position = outcome.position;
                known.fold_own(fact.aggregate, commit);
            } else {
                known.stale = true;
            }
            answers[i] = Some(Recorded::Appended(outcome));
        }
        Round::Answer(answers.into_iter().flatten().collect())
    }

    /// After an append of the facts at `writing`, started at `appending`, came back
    /// unavailable (`e`): a permission denial NATS reported for one of their subjects, or
    /// another round after a read (within the bound of unavailable answers).
    fn after_unavailable(
        &mut self,
        e: AppendError,
        writing: &[usize],
        appending: std::time::Instant,
    ) -> Result<Round, RecordError> {
        // An append to a subject this user may not publish to only times out: the
        // server's violation names the subject, and makes it a typed refusal.
        let denied = writing.iter().find_map(|&i| {
            denied_append(self.facts[i].aggregate, appending)
                .map(|message| (self.facts[i].aggregate, message))
        });
        if let Some((aggregate, message)) = denied {
            return Err(RecordError::PermissionDenied { aggregate, message });
        }
        self.read_again();
        self.unavailable += 1;
        if self.unavailable > UNAVAILABLE_RETRIES_MAX {
            return Err(e.into());
        }
        tracing::warn!(aggregate = %self.facts[0].aggregate, commit_id = %self.facts[0].draft.commit_id, error = %e, "append unavailable; retrying with the same commit ids");
        Ok(Round::Again)
    }

    /// After the log refused the one commit at `writing` because `commit_id` is taken at
    /// `position`: the fact's earlier outcome if the commit there is this fact's, else the
    /// reused id.
    async fn after_id_taken(
        &mut self,
        writing: &[usize],
        commit_id: uuid::Uuid,
        position: u64,
    ) -> Result<Round, RecordError> {
        self.read_again();
        let fact = &self.facts[writing[0]];
        match self.log.read_position(position).await? {
            Some(earlier) if earlier.commit_id == fact.draft.commit_id => {
                Ok(Round::Answer(vec![earlier_outcome(
                    fact.aggregate,
                    &earlier,
                    &fact.draft,
                    self.shape.id_names_the_fact(),
                )?]))
            }
            _ => Err(AppendError::CommitIdReused {
                commit_id,
                position,
            }
            .into()),
        }
    }

    /// Marks every state of this write as needing a read before the next decision.
    fn read_again(&mut self) {
        for known in self.turns.iter_mut() {
            known.stale = true;
        }
        self.fresh = false;
    }
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

/// Brings what is known of `aggregate` up to the log's head: the commits after the tip of
/// whichever is newer, what is known or a state folded elsewhere (another process may have
/// taken the aggregate far past what this one last wrote, and serve's store has followed
/// it: reading from the kept tip would cost all of that), or the whole aggregate when
/// neither knows it.
async fn refresh<L: EventLog>(
    log: &L,
    aggregate: AggregateId,
    known: &mut Known,
    elsewhere: &dyn FoldedElsewhere,
    at_head: bool,
) -> Result<Refreshed, ReadError> {
    let kept = known.was_read().then(|| known.version());
    if let Some(entity) = elsewhere
        .folded(aggregate)
        .filter(|e| e.header().version > kept.unwrap_or(0))
    {
        *known = Known::adopted(entity);
        // The fold elsewhere read this tip from the log's own stream and the log holds it
        // as the head its next append expects: nothing after it is read first, since the
        // append is refused if anything came after (a lost race, read then). Not fresh: a
        // refusal is never answered from it.
        if at_head && log.holds_head(aggregate, known.tip) {
            known.stale = false;
            return Ok(Refreshed::Adopted);
        }
    }
    if known.was_read() {
        let newer = log.read_aggregate_after(aggregate, known.tip).await?;
        if known.fold(aggregate, newer) {
            known.stale = false;
            return Ok(Refreshed::Read);
        }
        tracing::warn!(%aggregate, "the log does not extend the chain this process knew; reading it whole");
    }
    let commits = log.read_aggregate(aggregate).await?;
    *known = Known::from_commits(aggregate, commits);
    Ok(Refreshed::Read)
}

/// How a stale state was brought up: read from the log during this write, or adopted from
/// a fold elsewhere at the head the log holds (not read, so not fresh).
enum Refreshed {
    Read,
    Adopted,
}
