//! Facts decided in the pure core: what to record, as a function of state. The shell
//! (the rollback driver, placement, recovery) reads the state, calls one of these and
//! records what it returns; it composes no event itself.

use provledger_events::catalogue::{
    ClusterStatus, NodeGroupTarget, OperationKind, OperationOutcome, RollbackOutcome,
    TargetOutcome, VmState,
};
use provledger_events::Event;

use crate::operation::OperationState;
use crate::Entity;

/// The events that close a rollback on its target: the target's status as the plan says
/// (an operation that needs attention leaves it in error, saying where to look), the
/// operation's in-flight marker cleared if it still holds the target, and, after a scale,
/// each node group's count put back to the members it has, so a scale that was undone does
/// not leave its request behind (a removal that was finished stays finished). Nothing for
/// a target being deleted or gone, or an operation without a plan.
pub fn rollback_target_events(
    op: &OperationState,
    target: Option<&Entity>,
    outcome: RollbackOutcome,
) -> Vec<Event> {
    let Some(plan) = &op.rollback_plan else {
        return Vec::new();
    };
    let operation = op.header.id.id;
    let attention = outcome == RollbackOutcome::NeedsAttention;
    let describe = |d: &str| match attention {
        true => format!("{d}; rollback needs attention, see operation {operation}"),
        false => d.to_string(),
    };
    let mut events = Vec::new();
    match (target, &plan.target_outcome) {
        (Some(Entity::Cluster(c)), outcome) if !c.is_deleting_or_deleted() => {
            if op.kind == Some(OperationKind::ScaleCluster) {
                let targets: Vec<NodeGroupTarget> = c
                    .node_groups
                    .iter()
                    .filter(|g| g.count as usize != g.instance_ids.len())
                    .map(|g| NodeGroupTarget {
                        name: g.spec.name.clone(),
                        count: u32::try_from(g.instance_ids.len()).unwrap_or(u32::MAX),
                    })
                    .collect();
                if !targets.is_empty() {
                    events.push(Event::ClusterScaleRequested { targets });
                }
            }
            let next = match outcome {
                TargetOutcome::Error { description } => {
                    Some((ClusterStatus::Error, describe(description)))
                }
                TargetOutcome::Active { description } if attention => {
                    Some((ClusterStatus::Error, describe(description)))
                }
                TargetOutcome::Active { description } => {
                    Some((ClusterStatus::Active, description.clone()))
                }
                TargetOutcome::Deleted => None,
            };
            if let Some((status, description)) = next {
                events.push(Event::ClusterStatusChanged {
                    status,
                    description,
                });
            }
        }
        (Some(Entity::Instance(i)), TargetOutcome::Error { description })
            if i.vm_state != Some(VmState::Deleted) =>
        {
            events.push(Event::VmStateChanged {
                vm_state: VmState::Error,
                reason: describe(description),
            });
        }
        _ => {}
    }
    let holds = match target {
        Some(Entity::Cluster(c)) => c.in_flight.as_ref().map(|f| f.operation_id),
        Some(Entity::Instance(i)) => i.in_flight.as_ref().map(|f| f.operation_id),
        _ => None,
    };
    if holds == Some(operation) {
        events.push(Event::InFlightOperationCleared {
            operation_id: operation,
            outcome: match outcome {
                RollbackOutcome::RolledBack if op.cancelled => OperationOutcome::Cancelled,
                RollbackOutcome::RolledBack => OperationOutcome::RolledBack,
                RollbackOutcome::Held => OperationOutcome::Held,
                RollbackOutcome::NeedsAttention => OperationOutcome::NeedsAttention,
            },
        });
    }
    events
}
