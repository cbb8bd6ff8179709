//! The audit's pure core: fed the log's entries in position order, it checks position
//! continuity and each aggregate's hash chain and version sequence, folds what is valid,
//! and at the end checks the contract's invariants on the folded state. Every violation
//! names where it is (aggregate, version, position) and what to do. The shell (reading the
//! log, comparing the sled copy, printing) is `provledger-serve`'s `audit` module.

use std::collections::BTreeMap;

use provledger_events::catalogue::ConsumerKind;
use provledger_events::{AggregateId, Commit, HeldChains, Passage, Timestamp};
use serde::Serialize;
use uuid::Uuid;

use crate::cluster::ClusterState;
use crate::instance::InstanceState;
use crate::operation::{OperationState, OperationStatus};
use crate::provider::ProviderState;
use crate::{Entity, Projection};

/// Which check found a violation. The snake_case words are stable (`audit --json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// Positions 1, 2, 3, ... with nothing missing or out of order.
    PositionContinuity,
    /// Each aggregate's versions 1..n, hashes valid, each linked to the previous one.
    HashChain,
    /// Something on an aggregate's subject that is not part of its chain.
    Quarantine,
    /// A service's sled copy differs from the log it copies.
    Copy,
    ProviderCapacity,
    OrphanAllocation,
    /// An instance's allocation on a provider it neither runs on nor migrates to or from
    /// (Nova keeps a migrating instance's destination claim under the instance and its
    /// source under the migration: anything else off its host is left behind).
    MisplacedAllocation,
    DeletedTargetNotEmpty,
    RollbackUnfinished,
    TaskLeaseExpired,
    /// A recovery's re-issue still not acknowledged by its worker past
    /// `recovery::REISSUE_UNDELIVERED_AFTER_MS`.
    ReissueUndelivered,
    /// An effect recorded after its operation's rollback was planned: nothing undoes it.
    LateEffect,
    /// A rollback that stopped after its compensations ran out of attempts: what it left
    /// is still out there until an operator acts.
    NeedsAttention,
    /// A rolled-back operation whose release of an allocation was recorded done by hand
    /// (`compensation_resolved`, which the decider refuses for the ledger's own
    /// compensations since; a log may hold one from before), while the provider still
    /// holds it.
    HeldAfterRollback,
    /// Versions of an aggregate missing from the log (the server dropped them) that no
    /// operator has acknowledged: every read and write of it answers `integrity`.
    LostCommits,
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    pub check: Check,
    pub aggregate: Option<String>,
    pub version: Option<u64>,
    pub position: Option<u64>,
    pub problem: String,
    /// What an operator does about it.
    pub action: String,
}

impl Violation {
    fn at(check: Check, aggregate: Option<AggregateId>, problem: String, action: &str) -> Self {
        Violation {
            check,
            aggregate: aggregate.map(|a| a.to_string()),
            version: None,
            position: None,
            problem,
            action: action.to_string(),
        }
    }

    fn with_version(mut self, version: u64) -> Self {
        self.version = Some(version);
        self
    }

    pub fn with_position(mut self, position: u64) -> Self {
        self.position = Some(position);
        self
    }
}

/// What an audit found, for printing and `--json`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AuditReport {
    /// The last position audited.
    pub position: u64,
    pub commits: u64,
    pub events: u64,
    pub aggregates: usize,
    pub quarantined: u64,
    pub violations: Vec<Violation>,
    /// Compensations an operator resolved by hand, with who and why: not violations, but
    /// what an auditor reads (drift still checks each resource at its executor).
    pub resolved_by_hand: Vec<ResolvedByHand>,
    /// Losses an operator acknowledged (`loss_acknowledged`), with who and why: not
    /// violations (the positions they lost are not reported missing), but what an auditor
    /// reads.
    pub acknowledged_losses: Vec<AcknowledgedLoss>,
    /// The commits decoded, by their format byte (docs/events.md): which layouts of the log
    /// this build read. A key absent means no commit of that format was seen.
    pub formats: BTreeMap<u8, u64>,
    /// Entries this build could not decode (each also a `quarantine` violation), and the
    /// first of them: garbage, or a commit written by a newer build.
    pub undecodable: u64,
    pub first_undecodable: Option<Undecodable>,
}

/// An entry the audit could not decode: where, its format byte (if it has one) and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Undecodable {
    pub position: u64,
    pub subject: String,
    pub format: Option<u8>,
    pub error: String,
}

/// One `loss_acknowledged`: the aggregate, the versions, the commit's actor, the reason and
/// where the acknowledgement is in the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AcknowledgedLoss {
    pub aggregate: String,
    pub from_version: u64,
    pub to_version: u64,
    pub actor: String,
    pub reason: String,
    pub position: u64,
}

/// One `compensation_resolved`: the operation, the compensation, the commit's actor, the
/// reason and where it is in the log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ResolvedByHand {
    pub operation: String,
    pub compensation_id: Uuid,
    pub actor: String,
    pub reason: String,
    pub position: u64,
}

/// Feeds on the log in position order; see the module documentation.
#[derive(Debug, Default)]
pub struct Auditor {
    projection: Projection,
    next_position: u64,
    report: AuditReport,
    /// A log anyone may publish to (JetStream): a commit that does not extend its chain is
    /// quarantined there, as every reader does, rather than a break of the chain.
    quarantine_link_breaks: bool,
    /// Aggregates read past a loss, as the projector holds them (`provledger_events::loss`),
    /// with the position of their last commit before it.
    held: HeldChains,
    /// Ranges of positions found missing, reported at the end unless a loss explains them.
    missing: Vec<(u64, u64)>,
    /// Where each acknowledged loss lies in the log: after the last commit before it,
    /// before the commit that revealed it.
    loss_windows: Vec<(u64, u64)>,
}

const CHAIN_ACTION: &str = "the stored log was altered or damaged: restore this aggregate's commits from a replica or backup, and find who wrote there";

impl Auditor {
    pub fn new() -> Self {
        Auditor {
            next_position: 1,
            ..Default::default()
        }
    }

    /// For a log anyone allowed may publish on (JetStream): see `quarantine_link_breaks`.
    pub fn quarantining_link_breaks(mut self) -> Self {
        self.quarantine_link_breaks = true;
        self
    }

    /// Adds a violation found by the shell (a copy that differs, an entry it could not read).
    pub fn record(&mut self, violation: Violation) {
        self.report.violations.push(violation);
    }

    fn advance(&mut self, position: u64) {
        if position > self.next_position {
            // Reported at the end: a loss found later may explain it.
            self.missing.push((self.next_position, position - 1));
        } else if position < self.next_position {
            self.record(
                Violation::at(
                    Check::PositionContinuity,
                    None,
                    format!(
                        "position {position} arrived after {}: out of order or repeated",
                        self.next_position - 1
                    ),
                    "the log's order is broken: rebuild it from a replica",
                )
                .with_position(position),
            );
        }
        self.next_position = self.next_position.max(position + 1);
        self.report.position = self.report.position.max(position);
    }

    /// One commit of the log. A commit that does not extend its aggregate's chain is
    /// reported and not folded, so the invariants are checked on the valid history only. A
    /// commit past a loss is held as the projector holds it, and folded once acknowledged.
    pub fn commit(&mut self, commit: &Commit) {
        self.advance(commit.position);
        // Every commit decoded counts, folded or not: these are the formats this build read.
        *self.report.formats.entry(commit.format()).or_default() += 1;
        let (version, position) = self
            .projection
            .get(&commit.aggregate)
            .map_or((0, 0), |e| (e.header().version, e.header().last_position));
        match self.held.pass(commit, version, position) {
            Passage::Read => {
                if let Err(violation) = self.projection.apply_checked(commit) {
                    return self.break_of_chain(commit, violation.to_string());
                }
                self.counted(commit);
            }
            Passage::Held(_) => {}
            Passage::Resumed {
                commits,
                after_position,
            } => {
                let revealed = commits.first().map_or(commit.position, |c| c.position);
                self.loss_windows.push((after_position, revealed));
                for c in &commits {
                    self.projection.apply(c);
                    self.counted(c);
                }
            }
            Passage::Outside(reason) => self.break_of_chain(commit, reason),
        }
    }

    fn break_of_chain(&mut self, commit: &Commit, problem: String) {
        if self.quarantine_link_breaks {
            let subject = commit.aggregate.to_string();
            return self.quarantine_at(commit.position, &subject, &problem);
        }
        self.record(
            Violation::at(
                Check::HashChain,
                Some(commit.aggregate),
                problem,
                CHAIN_ACTION,
            )
            .with_version(commit.version)
            .with_position(commit.position),
        );
    }

    /// Counts a commit folded, and what an auditor reads of it.
    fn counted(&mut self, commit: &Commit) {
        self.report.commits += 1;
        self.report.events += commit.events.len() as u64;
        for event in &commit.events {
            match event {
                provledger_events::Event::CompensationResolved {
                    compensation_id,
                    reason,
                } => self.report.resolved_by_hand.push(ResolvedByHand {
                    operation: commit.aggregate.to_string(),
                    compensation_id: *compensation_id,
                    actor: commit.actor.clone(),
                    reason: reason.clone(),
                    position: commit.position,
                }),
                provledger_events::Event::LossAcknowledged {
                    from_version,
                    to_version,
                    reason,
                } => self.report.acknowledged_losses.push(AcknowledgedLoss {
                    aggregate: commit.aggregate.to_string(),
                    from_version: *from_version,
                    to_version: *to_version,
                    actor: commit.actor.clone(),
                    reason: reason.clone(),
                    position: commit.position,
                }),
                _ => {}
            }
        }
    }

    /// One entry readers quarantine (garbage, or a commit outside its aggregate's chain).
    pub fn quarantined(&mut self, position: u64, subject: &str, reason: &str) {
        self.advance(position);
        self.quarantine_at(position, subject, reason);
    }

    /// One entry this build could not decode (`format`: its first byte, if any): readers
    /// quarantine it, and the report names the first such entry.
    pub fn undecodable(&mut self, position: u64, subject: &str, format: Option<u8>, error: &str) {
        self.report.undecodable += 1;
        if self.report.first_undecodable.is_none() {
            self.report.first_undecodable = Some(Undecodable {
                position,
                subject: subject.to_string(),
                format,
                error: error.to_string(),
            });
        }
        self.quarantined(position, subject, &format!("undecodable: {error}"));
    }

    fn quarantine_at(&mut self, position: u64, subject: &str, reason: &str) {
        self.report.quarantined += 1;
        self.record(
            Violation::at(
                Check::Quarantine,
                None,
                format!("{subject}: {reason}"),
                "not part of any chain and skipped by every reader; find the publisher and restrict publishing on the subject (its aggregate is unaffected)",
            )
            .with_position(position),
        );
    }

    /// Ends the audit at the log's end as of its start (`end`), checking the invariants at
    /// `now` (for leases).
    pub fn finish(mut self, end: u64, now: Timestamp) -> AuditReport {
        if end >= self.next_position {
            self.advance(end + 1);
            self.report.position = end;
        }
        let held = std::mem::take(&mut self.held);
        let mut held: Vec<_> = held.iter().collect();
        held.sort_by_key(|(id, _)| id.to_string());
        for (&aggregate, chain) in held {
            for loss in chain.open.as_slice() {
                self.record(
                    Violation::at(
                        Check::LostCommits,
                        Some(aggregate),
                        format!("integrity: {loss}"),
                        "the log's server lost these commits: restore them from a replica or a backup of the stream if one has them; otherwise check the aggregate's real state and acknowledge the loss (`provledger integrity acknowledge`)",
                    )
                    .with_version(loss.from_version)
                    .with_position(loss.next_position),
                );
            }
        }
        for (from, to) in std::mem::take(&mut self.missing) {
            let explained = self
                .loss_windows
                .iter()
                .any(|(after, before)| *after < from && to < *before);
            if explained {
                continue;
            }
            let missing = if from == to {
                format!("position {from} is missing")
            } else {
                format!("positions {from}..={to} are missing")
            };
            self.record(
                Violation::at(
                    Check::PositionContinuity,
                    None,
                    missing,
                    "commits were lost from the log: compare with another replica of the stream",
                )
                .with_position(from),
            );
        }
        self.report.aggregates = self.projection.entities.len();
        let mut invariants = check_invariants(&self.projection, now);
        self.report.violations.append(&mut invariants);
        self.report
    }
}

/// The contract's invariants on a folded state, in aggregate order.
pub fn check_invariants(projection: &Projection, now: Timestamp) -> Vec<Violation> {
    let mut entities: Vec<&Entity> = projection.entities.values().collect();
    entities.sort_by_key(|e| (e.id().kind.tag(), e.id().id));
    let mut out = Vec::new();
    for entity in entities {
        match entity {
            Entity::Provider(p) => provider_invariants(p, projection, &mut out),
            Entity::Cluster(c) => cluster_invariants(c, projection, &mut out),
            Entity::Instance(i) => instance_invariants(i, now, &mut out),
            Entity::Operation(o) => {
                operation_invariants(o, &mut out);
                held_after_rollback(o, projection, &mut out);
            }
        }
    }
    out
}

fn provider_invariants(p: &ProviderState, projection: &Projection, out: &mut Vec<Violation>) {
    let id = p.header.id;
    for rc in p.over_capacity() {
        let used = p.usage.get(&rc).copied().unwrap_or(0);
        let capacity = p.inventories.get(&rc).map_or(0, |i| i.capacity());
        out.push(
            Violation::at(
                Check::ProviderCapacity,
                Some(id),
                format!("{rc} used {used} > capacity {capacity}"),
                "raise the inventory back, or release or migrate allocations until usage fits",
            )
            .with_version(p.header.version),
        );
    }
    let deleted = p.status == Some(crate::provider::ProviderStatus::Deleted);
    for (consumer, allocation) in &p.allocations {
        let gone = if deleted {
            Some("its provider is deleted".to_string())
        } else {
            consumer_gone(*consumer, allocation.consumer_kind, projection, id.id)
        };
        if gone.is_none() && allocation.consumer_kind == ConsumerKind::Instance {
            if let Some(why) = misplaced(*consumer, projection, id.id) {
                out.push(
                    Violation::at(
                        Check::MisplacedAllocation,
                        Some(id),
                        format!("allocation of instance {consumer}: {why}"),
                        "release it on this provider (`provledger provider delete --cascade` does for evacuation residue), or finish the migration that should hold it",
                    )
                    .with_version(p.header.version),
                );
            }
        }
        if let Some(why) = gone {
            out.push(
                Violation::at(
                    Check::OrphanAllocation,
                    Some(id),
                    format!("allocation of {consumer}: {why}"),
                    "release it with `provledger audit --fix-orphans` (only orphans are released, each with its reason)",
                )
                .with_version(p.header.version),
            );
        }
    }
}

/// Why an instance's allocation on `provider` is misplaced, if it is: the instance runs on
/// another provider and no migration of it is in flight (placement's evacuation residue,
/// or a migration's destination claim left after it ended).
fn misplaced(consumer: Uuid, projection: &Projection, provider: Uuid) -> Option<String> {
    let (hold, why, _) = crate::placement::classify(
        |id| projection.get(id),
        provider,
        consumer,
        ConsumerKind::Instance,
    );
    if hold != provledger_events::catalogue::AllocationHold::EvacuationResidue {
        return None;
    }
    match projection.get(&AggregateId::instance(consumer)) {
        Some(crate::Entity::Instance(i))
            if i.in_flight.as_ref().is_some_and(|f| f.kind.is_migration()) =>
        {
            None
        }
        _ => Some(why),
    }
}

/// Why an allocation's consumer is gone, if it is (placement's classification).
fn consumer_gone(
    consumer: Uuid,
    kind: provledger_events::catalogue::ConsumerKind,
    projection: &Projection,
    provider: Uuid,
) -> Option<String> {
    let (hold, why, _) =
        crate::placement::classify(|id| projection.get(id), provider, consumer, kind);
    (hold == provledger_events::catalogue::AllocationHold::Orphan).then_some(why)
}

fn cluster_invariants(c: &ClusterState, projection: &Projection, out: &mut Vec<Violation>) {
    use provledger_events::catalogue::{ClusterStatus, VmState};
    if c.status != Some(ClusterStatus::Deleted) {
        return;
    }
    let live: Vec<Uuid> = c
        .node_groups
        .iter()
        .flat_map(|g| g.instance_ids.iter().copied())
        .filter(|i| {
            !matches!(
                projection.get(&AggregateId::instance(*i)),
                Some(Entity::Instance(s)) if s.vm_state == Some(VmState::Deleted)
            )
        })
        .collect();
    if !live.is_empty() {
        out.push(
            Violation::at(
                Check::DeletedTargetNotEmpty,
                Some(c.header.id),
                format!("deleted while {} instance(s) remain: {live:?}", live.len()),
                "delete the remaining instances (provledger rollback run, or the flow's delete) so nothing is left running",
            )
            .with_version(c.header.version),
        );
    }
}

fn instance_invariants(i: &InstanceState, now: Timestamp, out: &mut Vec<Violation>) {
    for p in &i.pending_reissues {
        let age_ms = now.unix_ms() - p.requested_at.unix_ms();
        if age_ms > crate::recovery::REISSUE_UNDELIVERED_AFTER_MS {
            out.push(
                Violation::at(
                    Check::ReissueUndelivered,
                    Some(i.header.id),
                    format!(
                        "re-issue {} ({}) to worker {} pending for {} s after {} attempt(s){}{}",
                        p.request_id,
                        crate::planner::json_word(&p.action),
                        p.worker,
                        age_ms / 1000,
                        p.attempts,
                        p.last_error
                            .as_ref()
                            .map(|e| format!("; last error: {e}"))
                            .unwrap_or_default(),
                        match p.attempts >= crate::recovery::REISSUE_ATTEMPTS_MAX {
                            true => "; no longer retried until the worker says it listens",
                            false => "",
                        }
                    ),
                    "start the worker (serve delivers its pending re-issues once it subscribes, at once if it sends provledger.cmd.worker.ready), or carry the task out by hand and record its outcome",
                )
                .with_version(i.header.version),
            );
        }
    }
    if let (Some(task), Some(until)) = (i.task_state, i.task_lease_until) {
        if until < now {
            out.push(
                Violation::at(
                    Check::TaskLeaseExpired,
                    Some(i.header.id),
                    format!(
                        "task {task:?} of worker {} past its lease (until {until})",
                        i.task_worker.as_deref().unwrap_or("?")
                    ),
                    "run `provledger recover` so the stuck task is re-driven or errored",
                )
                .with_version(i.header.version),
            );
        }
    }
}

/// Each allocation a rolled-back operation's plan released only by hand and that its
/// provider still holds.
fn held_after_rollback(o: &OperationState, projection: &Projection, out: &mut Vec<Violation>) {
    use provledger_events::catalogue::{CompensationAction, Executor};
    if o.status != Some(OperationStatus::RolledBack) {
        return;
    }
    for c in &o.compensations {
        let planned = &c.planned.compensation;
        if planned.executor != Executor::Ledger
            || planned.action != CompensationAction::ReleaseAllocation
            || c.resolved.is_none()
        {
            continue;
        }
        let provider = planned
            .args
            .get("provider_id")
            .and_then(|p| p.parse::<Uuid>().ok());
        let consumer = planned.resource.parse::<Uuid>().ok();
        let (Some(provider), Some(consumer)) = (provider, consumer) else {
            continue;
        };
        let held = matches!(
            projection.get(&AggregateId::provider(provider)),
            Some(Entity::Provider(p)) if p.allocations.contains_key(&consumer)
        );
        if held {
            out.push(
                Violation::at(
                    Check::HeldAfterRollback,
                    Some(o.header.id),
                    format!(
                        "rolled back, but provider {provider} still holds the allocation of {consumer}: its release was resolved by hand, not applied"
                    ),
                    "release it: `provledger audit --fix-orphans` if nothing uses it any more, or an allocation_released on the provider with the reason",
                )
                .with_version(o.header.version),
            );
        }
    }
}

fn operation_invariants(o: &OperationState, out: &mut Vec<Violation>) {
    for step in &o.late_effects {
        let undo = o
            .steps
            .iter()
            .rev()
            .find(|s| s.name == *step)
            .and_then(|s| s.compensation.as_ref())
            .map(|c| {
                format!(
                    "{} {} at {}",
                    crate::planner::action_word(&c.action),
                    c.resource,
                    match &c.executor {
                        provledger_events::catalogue::Executor::Ledger => "the ledger".to_string(),
                        provledger_events::catalogue::Executor::Service(s) => s.clone(),
                    }
                )
            })
            .unwrap_or_default();
        out.push(
            Violation::at(
                Check::LateEffect,
                Some(o.header.id),
                format!(
                    "step {step:?} recorded its effect after the rollback was planned; the plan does not undo it ({undo})"
                ),
                "undo it by hand at its executor (its compensation above), or have the executor refuse actions under an idempotency key it has undone",
            )
            .with_version(o.header.version),
        );
    }
    if o.status == Some(OperationStatus::NeedsAttention) {
        out.push(needs_attention(o));
    }
    let unfinished = match o.status {
        Some(OperationStatus::Failed | OperationStatus::RollingBack) => true,
        Some(OperationStatus::Cancelled) => !o.is_closed(),
        _ => false,
    };
    if unfinished {
        let id = o.header.id;
        out.push(
            Violation::at(
                Check::RollbackUnfinished,
                Some(id),
                format!(
                    "{:?} but its rollback has not finished",
                    o.status.map(|s| format!("{s:?}").to_lowercase())
                ),
                &format!(
                    "let `provledger serve` drive it, or run `provledger rollback run {}`",
                    id.id
                ),
            )
            .with_version(o.header.version),
        );
    }
}

/// An operation whose rollback stopped: which compensations are not done (each with its
/// attempts and last error), and how an operator goes on.
fn needs_attention(o: &OperationState) -> Violation {
    let open: Vec<String> = o
        .compensations
        .iter()
        .filter(|c| c.progress != crate::operation::CompensationProgress::Done)
        .map(|c| {
            let comp = &c.planned.compensation;
            format!(
                "{} {} at {} (step {}/{}, {} attempts, last error: {})",
                crate::planner::action_word(&comp.action),
                comp.resource,
                match &comp.executor {
                    provledger_events::catalogue::Executor::Ledger => "the ledger".to_string(),
                    provledger_events::catalogue::Executor::Service(s) => s.clone(),
                },
                c.planned.stage,
                c.planned.step,
                c.attempts,
                c.last_error.as_deref().unwrap_or("none recorded"),
            )
        })
        .collect();
    let kind = o
        .kind
        .and_then(|k| match serde_json::to_value(k) {
            Ok(serde_json::Value::String(s)) => Some(s),
            _ => None,
        })
        .unwrap_or_else(|| "operation".into());
    let target = o.target.map(|t| format!(" on {t}")).unwrap_or_default();
    Violation::at(
        Check::NeedsAttention,
        Some(o.header.id),
        format!(
            "{kind}{target}: its rollback stopped with {} compensation(s) not done: {}",
            open.len(),
            open.join("; ")
        ),
        &format!(
            "fix what makes them fail (the executor, the resource), then `provledger rollback run {}` resumes the rollback with a fresh budget of attempts",
            o.header.id.id
        ),
    )
    .with_version(o.header.version)
}

/// Counts of violations by check, for summaries.
pub fn counts(violations: &[Violation]) -> BTreeMap<Check, usize> {
    let mut out = BTreeMap::new();
    for v in violations {
        *out.entry(v.check).or_insert(0) += 1;
    }
    out
}
