//! The append decider: whether a commit may be written to its aggregate in the state it is
//! in. Every write path (the client library, `cmd.append`, `provledger append`) asks it
//! against the aggregate's state at exactly the version it then appends with, so that an
//! acknowledged commit is always one the fold applies.
//!
//! Three rules, in this order:
//! 1. A delete request is idempotent: on a target already deleting or deleted nothing is
//!    written and the caller is told so; on a target that does not exist it is `not_found`.
//! 2. Deletion is terminal: a deleted target takes nothing, a deleting one nothing that
//!    would bring it back (`target_deleted`).
//! 3. Otherwise the commit is folded on a copy of the state. An event the fold would not
//!    apply (it leaves the state unchanged and reports why) refuses the whole commit: an
//!    event on an aggregate that needs one to exist (`not_found`), a claim that does not
//!    fit (per resource class), an impossible transition. An event the fold applies
//!    although it is out of place (a step's effect after a cancellation: a fact about the
//!    world) is accepted, so nothing real is ever refused.
//!
//! Before each task event of an instance is folded, the lease protocol (docs/recovery.md,
//! bounds in [`crate::lease`]) is checked against the state the commit's earlier events
//! left, with the commit's `recorded_at` as the only time:
//! - an authenticated worker ([`DecideOptions::caller_worker`]) names itself in
//!   `task_started` and `task_lease_renewed` (`worker_mismatch`);
//! - a task a worker holds is that worker's: a renewal must name the holder, and
//!   `task_started` by another worker, `task_queued` and `task_finished` are refused while
//!   the lease is live unless the holder records them (the authenticated worker, or else
//!   the commit's actor); an authenticated worker may touch a held task only as its holder,
//!   even after the lease expired, which the recovery sweep (no authenticated worker, lease
//!   expired) releases (`not_lease_holder`);
//! - a lease ends after its commit, at least `LEASE_MS_MIN` and at most `LEASE_MS_MAX`
//!   later (`lease_in_past`, `lease_too_short`, `lease_too_long`);
//! - a renewal extends the lease (`renewal_not_extending`) and comes no sooner than half
//!   the current lease's length after it was granted (`renewal_too_soon`).

use provledger_events::catalogue::{OperationKind, TaskState, VmState};
use provledger_events::{AggregateId, CommitDraft, Event, Timestamp};
use uuid::Uuid;

use crate::entity::{EventContext, Folded};
use crate::instance::InstanceState;
use crate::lease::{renewal_not_before, CallerWorker, LEASE_MS_MAX, LEASE_MS_MIN};
use crate::operation::OperationState;
use crate::provider::{ClaimRefusal, ProviderStatus};
use crate::{DeletionState, Entity};

/// What the decider allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Append the commit as it is.
    Append,
    /// The commit asks for what is already true; nothing is to be written.
    AlreadyDone(AlreadyDone),
}

/// A repeated request that needs no commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlreadyDone {
    AlreadyDeleting,
    AlreadyDeleted,
}

impl AlreadyDone {
    /// The stable word at the NATS boundary.
    pub fn as_str(self) -> &'static str {
        match self {
            AlreadyDone::AlreadyDeleting => "already_deleting",
            AlreadyDone::AlreadyDeleted => "already_deleted",
        }
    }
}

/// Why a commit is refused before it reaches the log. Nothing is written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendRejection {
    #[error("{target} is {state}: event #{index} ({event}) cannot be applied to it")]
    TargetDeleted {
        target: AggregateId,
        state: &'static str,
        index: usize,
        event: String,
    },
    #[error("{target} does not exist: event #{index} ({event}) needs it to; create it first or check the id")]
    NotFound {
        target: AggregateId,
        index: usize,
        event: String,
    },
    #[error("{target} refuses the claim of consumer {consumer} (event #{index}): {refusal}")]
    ClaimRefused {
        target: AggregateId,
        index: usize,
        consumer: Uuid,
        refusal: ClaimRefusal,
    },
    #[error("{target}: event #{index} would set the {resource_class} capacity to {capacity}, below the {usage} in use; release allocations first, or force it (it is then reported as over capacity)")]
    InventoryBelowUsage {
        target: AggregateId,
        index: usize,
        resource_class: String,
        capacity: u64,
        usage: u64,
    },
    #[error("{target} cannot apply event #{index} ({event}) in its state: {problem}")]
    NotApplicable {
        target: AggregateId,
        index: usize,
        event: String,
        problem: String,
    },
    /// A task event names another worker than the authenticated one sending it.
    #[error("{target}: event #{index} ({event}) names worker {named}, but the request is authenticated as worker {caller}; a worker records its own tasks only")]
    WorkerMismatch {
        target: AggregateId,
        index: usize,
        event: String,
        named: String,
        caller: String,
    },
    /// A task event by someone else than the worker holding the task's lease.
    #[error("{target}: event #{index} ({event}) by {by} refused: {}", holder_text(holder.as_deref(), *lease_until))]
    NotLeaseHolder {
        target: AggregateId,
        index: usize,
        event: String,
        /// The worker (or actor) the event came from.
        by: String,
        /// The worker holding the task, if a task is started.
        holder: Option<String>,
        lease_until: Option<Timestamp>,
    },
    #[error("{target}: event #{index} ({event}) has lease_until {lease_until}, not after the commit's time {recorded_at}")]
    LeaseInPast {
        target: AggregateId,
        index: usize,
        event: String,
        lease_until: Timestamp,
        recorded_at: Timestamp,
    },
    #[error("{target}: event #{index} ({event}) asks for a lease of {length_ms} ms (until {lease_until}), shorter than the {LEASE_MS_MIN} ms minimum")]
    LeaseTooShort {
        target: AggregateId,
        index: usize,
        event: String,
        lease_until: Timestamp,
        length_ms: i64,
    },
    #[error("{target}: event #{index} ({event}) asks for a lease of {length_ms} ms (until {lease_until}), longer than the {LEASE_MS_MAX} ms maximum; renew it instead")]
    LeaseTooLong {
        target: AggregateId,
        index: usize,
        event: String,
        lease_until: Timestamp,
        length_ms: i64,
    },
    #[error("{target}: event #{index} ({event}) renews the lease until {lease_until}, which does not extend the current one (until {current_until})")]
    RenewalNotExtending {
        target: AggregateId,
        index: usize,
        event: String,
        lease_until: Timestamp,
        current_until: Timestamp,
    },
    #[error("{target}: event #{index} ({event}) at {recorded_at} comes too soon: the lease granted at {since} until {until} may be renewed from {not_before} (at most once per half lease)")]
    RenewalTooSoon {
        target: AggregateId,
        index: usize,
        event: String,
        recorded_at: Timestamp,
        since: Timestamp,
        until: Timestamp,
        not_before: Timestamp,
    },
}

fn holder_text(holder: Option<&str>, lease_until: Option<Timestamp>) -> String {
    match (holder, lease_until) {
        (Some(holder), Some(until)) => {
            format!("the task is held by worker {holder} (lease until {until})")
        }
        (Some(holder), None) => format!("the task is held by worker {holder}"),
        (None, _) => "no task is started (no worker holds a lease)".into(),
    }
}

impl AppendRejection {
    /// The stable reason word: `target_deleted`, `not_found`, a claim's first refused
    /// class reason (`over_capacity`, `no_inventory`, `below_min_unit`, `above_max_unit`,
    /// `step_size`), `below_usage`, `not_applicable`, or a lease refusal
    /// (`worker_mismatch`, `not_lease_holder`, `lease_in_past`, `lease_too_short`,
    /// `lease_too_long`, `renewal_not_extending`, `renewal_too_soon`).
    pub fn reason(&self) -> &'static str {
        match self {
            AppendRejection::TargetDeleted { .. } => "target_deleted",
            AppendRejection::NotFound { .. } => "not_found",
            AppendRejection::ClaimRefused { refusal, .. } => refusal
                .classes
                .first()
                .map(|c| c.reason.as_str())
                .unwrap_or("not_applicable"),
            AppendRejection::InventoryBelowUsage { .. } => "below_usage",
            AppendRejection::NotApplicable { .. } => "not_applicable",
            AppendRejection::WorkerMismatch { .. } => "worker_mismatch",
            AppendRejection::NotLeaseHolder { .. } => "not_lease_holder",
            AppendRejection::LeaseInPast { .. } => "lease_in_past",
            AppendRejection::LeaseTooShort { .. } => "lease_too_short",
            AppendRejection::LeaseTooLong { .. } => "lease_too_long",
            AppendRejection::RenewalNotExtending { .. } => "renewal_not_extending",
            AppendRejection::RenewalTooSoon { .. } => "renewal_too_soon",
        }
    }
}

fn is_delete_request(event: &Event) -> bool {
    matches!(
        event,
        Event::ClusterDeleteRequested { .. }
            | Event::InstanceDeleteRequested { .. }
            | Event::ProviderDeleteRequested { .. }
    )
}

/// Would this event move a target that is being deleted away from deletion?
fn revives(event: &Event) -> bool {
    match event {
        Event::ClusterStatusChanged { status, .. } => !status.is_terminal(),
        Event::ClusterScaleRequested { .. }
        | Event::NodeGroupAdded { .. }
        | Event::InstanceJoined { .. } => true,
        Event::VmStateChanged { vm_state, .. } => {
            !matches!(vm_state, VmState::Deleted | VmState::Error)
        }
        Event::TaskQueued { task_state } | Event::TaskStarted { task_state, .. } => {
            *task_state != TaskState::Deleting
        }
        Event::InFlightOperationSet { operation_kind, .. } => !matches!(
            operation_kind,
            OperationKind::DeleteCluster | OperationKind::DeleteInstance
        ),
        Event::AllocationClaimed { .. } => true,
        _ => false,
    }
}

/// What a writer may ask of the decider beyond the commit itself, and who it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecideOptions {
    /// Accept an inventory below current usage (hardware that really shrank); the
    /// provider is then reported as over capacity until it fits again.
    pub force: bool,
    /// The worker the write boundary authenticated the sender as, if any
    /// ([`CallerWorker::from_identity`] of the vouched NATS identity). When `Some`,
    /// `task_started` and `task_lease_renewed` must name it, and it may renew, finish,
    /// re-queue or re-start a held task only as the task's holder. `None` (library writes,
    /// the recovery sweep, unauthenticated deployments): only the lease-holder rules.
    pub caller_worker: Option<CallerWorker>,
}

/// Decides `draft` against `entity`, the state of `target` at the version the caller will
/// append with (`None`: nothing recorded yet). Pure: the same inputs give the same answer.
pub fn decide_append(
    target: AggregateId,
    entity: Option<&Entity>,
    draft: &CommitDraft,
) -> Result<Admission, AppendRejection> {
    decide_append_with(target, entity, draft, DecideOptions::default())
}

/// [`decide_append`] with options.
pub fn decide_append_with(
    target: AggregateId,
    entity: Option<&Entity>,
    draft: &CommitDraft,
    options: DecideOptions,
) -> Result<Admission, AppendRejection> {
    let events = &draft.events;
    let exists = entity.is_some_and(Entity::is_created);
    if !events.is_empty() && events.iter().all(is_delete_request) {
        let Some(entity) = entity.filter(|_| exists) else {
            return Err(AppendRejection::NotFound {
                target,
                index: 0,
                event: events[0].name().into(),
            });
        };
        match entity.deletion_state() {
            Some(DeletionState::Deleting) => {
                return Ok(Admission::AlreadyDone(AlreadyDone::AlreadyDeleting))
            }
            Some(DeletionState::Deleted) => {
                return Ok(Admission::AlreadyDone(AlreadyDone::AlreadyDeleted))
            }
            None => {}
        }
    }
    if let Some(state) = entity.and_then(Entity::deletion_state) {
        for (index, event) in events.iter().enumerate() {
            let refused = match state {
                DeletionState::Deleted => true,
                DeletionState::Deleting => revives(event),
            };
            if refused {
                return Err(AppendRejection::TargetDeleted {
                    target,
                    state: state.as_str(),
                    index,
                    event: event.name().into(),
                });
            }
        }
    }
    trial_fold(target, entity, draft, options)?;
    Ok(Admission::Append)
}

/// Folds the draft on a copy of the state; the first event the fold would not apply
/// refuses the commit.
fn trial_fold(
    target: AggregateId,
    entity: Option<&Entity>,
    draft: &CommitDraft,
    options: DecideOptions,
) -> Result<(), AppendRejection> {
    let mut trial = entity.cloned().unwrap_or_else(|| Entity::new(target));
    let ctx = EventContext {
        position: trial.header().last_position + 1,
        version: trial.header().version + 1,
        recorded_at: draft.recorded_at,
        operation_id: draft.operation_id,
    };
    for (index, event) in draft.events.iter().enumerate() {
        let at = At {
            target,
            index,
            event,
        };
        check_before_fold(at, &trial, draft, options)?;
        let created = trial.is_created();
        // An event applied with an anomaly (a fact about the world) is accepted; only an
        // event the fold refused (the state left as it was) refuses the commit.
        if let Folded::Refused(problem) = trial.fold_event(event, &ctx) {
            return Err(if created {
                AppendRejection::NotApplicable {
                    target,
                    index,
                    event: event.name().into(),
                    problem,
                }
            } else {
                AppendRejection::NotFound {
                    target,
                    index,
                    event: event.name().into(),
                }
            });
        }
    }
    Ok(())
}

/// The event being decided: the commit's target, the event's index in it, the event.
#[derive(Clone, Copy)]
struct At<'e> {
    target: AggregateId,
    index: usize,
    event: &'e Event,
}

/// What is checked before an event is folded on `trial` (the state the commit's earlier
/// events left), with reasons of its own rather than the fold's: a claim that does not
/// fit, an inventory below usage, a compensation only the ledger may resolve, and the
/// lease protocol of a task event.
fn check_before_fold(
    at: At,
    trial: &Entity,
    draft: &CommitDraft,
    options: DecideOptions,
) -> Result<(), AppendRejection> {
    let At {
        target,
        index,
        event,
    } = at;
    match (trial, event) {
        (
            Entity::Provider(provider),
            Event::AllocationClaimed {
                consumer,
                resources,
                ..
            },
        ) if provider.status == Some(ProviderStatus::Active) => provider
            .check_claim(consumer, resources)
            .map_err(|refusal| AppendRejection::ClaimRefused {
                target,
                index,
                consumer: *consumer,
                refusal,
            }),
        (
            Entity::Provider(provider),
            Event::InventorySet {
                resource_class,
                inventory,
            },
        ) => {
            let usage = provider.usage.get(resource_class).copied().unwrap_or(0);
            if usage > inventory.capacity() && !options.force {
                return Err(AppendRejection::InventoryBelowUsage {
                    target,
                    index,
                    resource_class: resource_class.clone(),
                    capacity: inventory.capacity(),
                    usage,
                });
            }
            Ok(())
        }
        (
            Entity::Operation(op),
            Event::CompensationResolved {
                compensation_id, ..
            },
        ) => check_resolvable_by_hand(at, op, compensation_id),
        // On an instance that does not exist yet the fold answers `not_found`.
        (Entity::Instance(instance), _) if instance.vm_state.is_some() => {
            check_task_event(at, instance, draft, options)
        }
        _ => Ok(()),
    }
}

/// A compensation of the ledger's own is applied when the rollback resumes: it cannot be
/// resolved by hand.
fn check_resolvable_by_hand(
    at: At,
    op: &OperationState,
    compensation_id: &Uuid,
) -> Result<(), AppendRejection> {
    let ledgers = op.compensations.iter().find(|c| {
        c.planned.compensation_id == *compensation_id
            && !crate::rollback::resolvable_by_hand(&c.planned.compensation)
    });
    match ledgers {
        Some(c) => Err(AppendRejection::NotApplicable {
            target: at.target,
            index: at.index,
            event: at.event.name().into(),
            problem: format!(
                "compensation {compensation_id} is the ledger's own ({}): provledger applies it when the rollback resumes, so it cannot be resolved by hand",
                crate::planner::action_word(&c.planned.compensation.action)
            ),
        }),
        None => Ok(()),
    }
}

/// The lease protocol for one task event on `instance` (its state before the event).
fn check_task_event(
    at: At,
    instance: &InstanceState,
    draft: &CommitDraft,
    options: DecideOptions,
) -> Result<(), AppendRejection> {
    let lease = LeaseCheck {
        at,
        instance,
        draft,
        options,
        now: draft.recorded_at,
        live: instance
            .task_lease_until
            .is_some_and(|until| until > draft.recorded_at),
    };
    match at.event {
        Event::TaskStarted {
            worker_id,
            lease_until,
            ..
        } => lease.started(worker_id, *lease_until),
        Event::TaskLeaseRenewed {
            worker_id,
            lease_until,
        } => lease.renewed(worker_id, *lease_until),
        Event::TaskFinished { .. } | Event::TaskQueued { .. } => lease.by_holder(),
        _ => Ok(()),
    }
}

/// One task event checked against the lease protocol: the instance before the event, the
/// commit's time (`now`, the only time), and whether the current lease is `live` then.
struct LeaseCheck<'a> {
    at: At<'a>,
    instance: &'a InstanceState,
    draft: &'a CommitDraft,
    options: DecideOptions,
    now: Timestamp,
    live: bool,
}

impl LeaseCheck<'_> {
    /// The event's name, as rejections give it.
    fn name(&self) -> &'static str {
        self.at.event.name()
    }

    /// `by` is not the task's holder.
    fn not_holder(&self, by: &str) -> AppendRejection {
        AppendRejection::NotLeaseHolder {
            target: self.at.target,
            index: self.at.index,
            event: self.name().into(),
            by: by.to_string(),
            holder: self.instance.task_worker.clone(),
            lease_until: self.instance.task_lease_until,
        }
    }

    /// An authenticated worker names itself.
    fn names_caller(&self, named: &str) -> Result<(), AppendRejection> {
        match self.options.caller_worker {
            Some(caller) if !caller.is(named) => Err(AppendRejection::WorkerMismatch {
                target: self.at.target,
                index: self.at.index,
                event: self.name().into(),
                named: named.to_string(),
                caller: caller.to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// A lease ends after its commit, at least `LEASE_MS_MIN` and at most `LEASE_MS_MAX`
    /// later.
    fn bounded(&self, lease_until: Timestamp) -> Result<(), AppendRejection> {
        let (target, index, now) = (self.at.target, self.at.index, self.now);
        let length_ms = i128::from(lease_until.unix_ms()) - i128::from(now.unix_ms());
        let length_ms = length_ms.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        if length_ms <= 0 {
            return Err(AppendRejection::LeaseInPast {
                target,
                index,
                event: self.name().into(),
                lease_until,
                recorded_at: now,
            });
        }
        if length_ms < LEASE_MS_MIN {
            return Err(AppendRejection::LeaseTooShort {
                target,
                index,
                event: self.name().into(),
                lease_until,
                length_ms,
            });
        }
        if length_ms > LEASE_MS_MAX {
            return Err(AppendRejection::LeaseTooLong {
                target,
                index,
                event: self.name().into(),
                lease_until,
                length_ms,
            });
        }
        Ok(())
    }

    /// Who may end or replace the task: the authenticated worker, always as the holder;
    /// otherwise, while the lease is live, the holder as the commit's actor.
    fn by_holder(&self) -> Result<(), AppendRejection> {
        let Some(holder) = self.instance.task_worker.as_deref() else {
            return Ok(());
        };
        match self.options.caller_worker {
            Some(caller) if !caller.is(holder) => Err(self.not_holder(&caller.to_string())),
            Some(_) => Ok(()),
            None if self.live && self.draft.actor != holder => {
                Err(self.not_holder(&self.draft.actor))
            }
            None => Ok(()),
        }
    }

    /// `task_started` by `worker_id`, with a lease until `lease_until`.
    fn started(&self, worker_id: &str, lease_until: Timestamp) -> Result<(), AppendRejection> {
        self.names_caller(worker_id)?;
        if let Some(holder) = self.instance.task_worker.as_deref() {
            // Another worker's task: only once its lease expired, and never by an
            // authenticated worker (the recovery sweep releases an expired task).
            if holder != worker_id && (self.live || self.options.caller_worker.is_some()) {
                return Err(self.not_holder(worker_id));
            }
        }
        self.bounded(lease_until)
    }

    /// `task_lease_renewed` by `worker_id` until `lease_until`: by the holder, extending
    /// the lease, no sooner than half the current lease after it was granted.
    fn renewed(&self, worker_id: &str, lease_until: Timestamp) -> Result<(), AppendRejection> {
        self.names_caller(worker_id)?;
        if self.instance.task_worker.as_deref() != Some(worker_id) {
            return Err(self.not_holder(worker_id));
        }
        self.bounded(lease_until)?;
        let (Some(since), Some(until)) = (
            self.instance.task_lease_since,
            self.instance.task_lease_until,
        ) else {
            return Ok(());
        };
        if lease_until <= until {
            return Err(AppendRejection::RenewalNotExtending {
                target: self.at.target,
                index: self.at.index,
                event: self.name().into(),
                lease_until,
                current_until: until,
            });
        }
        let not_before = renewal_not_before(since, until);
        if self.now < not_before {
            return Err(AppendRejection::RenewalTooSoon {
                target: self.at.target,
                index: self.at.index,
                event: self.name().into(),
                recorded_at: self.now,
                since,
                until,
                not_before,
            });
        }
        Ok(())
    }
}
