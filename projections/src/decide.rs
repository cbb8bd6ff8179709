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

use provledger_events::catalogue::{OperationKind, TaskState, VmState};
use provledger_events::{AggregateId, CommitDraft, Event};
use uuid::Uuid;

use crate::entity::EventContext;
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
}

impl AppendRejection {
    /// The stable reason word: `target_deleted`, `not_found`, a claim's first refused
    /// class reason (`over_capacity`, `no_inventory`, `below_min_unit`, `above_max_unit`,
    /// `step_size`), or `not_applicable`.
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

/// What a writer may ask of the decider beyond the commit itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecideOptions {
    /// Accept an inventory below current usage (hardware that really shrank); the
    /// provider is then reported as over capacity until it fits again.
    pub force: bool,
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
                event: events[0].name(),
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
                    event: event.name(),
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
        if let (
            Entity::Provider(provider),
            Event::AllocationClaimed {
                consumer,
                resources,
                ..
            },
        ) = (&trial, event)
        {
            if provider.status == Some(ProviderStatus::Active) {
                provider
                    .check_claim(consumer, resources)
                    .map_err(|refusal| AppendRejection::ClaimRefused {
                        target,
                        index,
                        consumer: *consumer,
                        refusal,
                    })?;
            }
        }
        if let (
            Entity::Provider(provider),
            Event::InventorySet {
                resource_class,
                inventory,
            },
        ) = (&trial, event)
        {
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
        }
        let created = trial.is_created();
        let before = trial.clone();
        if let Err(problem) = trial.fold_event(event, &ctx) {
            if trial == before {
                return Err(if created {
                    AppendRejection::NotApplicable {
                        target,
                        index,
                        event: event.name(),
                        problem,
                    }
                } else {
                    AppendRejection::NotFound {
                        target,
                        index,
                        event: event.name(),
                    }
                });
            }
        }
    }
    Ok(())
}
