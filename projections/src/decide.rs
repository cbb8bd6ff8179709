//! The append decider used by `provledger.cmd.append`: whether a commit may still be
//! written to its target. Deletion is terminal, so a deleted target takes nothing but a
//! repeated delete request, and a target being deleted takes nothing that would bring it
//! back to life.

use provledger_events::catalogue::{OperationKind, TaskState, VmState};
use provledger_events::{AggregateId, Event};

use crate::{DeletionState, Entity};

/// Why an append is refused before it reaches the log.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AppendRejection {
    #[error("{target} is {state}: event #{index} ({event}) cannot be applied to it")]
    TargetDeleted {
        target: AggregateId,
        state: &'static str,
        index: usize,
        event: String,
    },
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

/// Checks `events` against the target's current state (`None`: nothing recorded yet).
pub fn admit_append(entity: Option<&Entity>, events: &[Event]) -> Result<(), AppendRejection> {
    let Some(entity) = entity else {
        return Ok(());
    };
    let Some(state) = entity.deletion_state() else {
        return Ok(());
    };
    for (index, event) in events.iter().enumerate() {
        let refused = match state {
            DeletionState::Deleted => !is_delete_request(event),
            DeletionState::Deleting => revives(event),
        };
        if refused {
            return Err(AppendRejection::TargetDeleted {
                target: entity.id(),
                state: state.as_str(),
                index,
                event: event.name(),
            });
        }
    }
    Ok(())
}
