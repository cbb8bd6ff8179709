//! The cluster projection (Sahara): status, node groups with their instances, and the
//! operation in flight.

use provledger_events::catalogue::{ClusterStatus, NodeGroupSpec, OperationKind};
use provledger_events::{AggregateId, Event};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::entity::{json_or_null, not_created, EventContext, FoldResult, Header};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeGroupState {
    pub spec: NodeGroupSpec,
    /// The desired count: the spec's count, or the last scale target.
    pub count: u32,
    pub instance_ids: Vec<Uuid>,
}

/// The operation holding a cluster or an instance, shared by both folds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InFlight {
    pub operation_id: Uuid,
    pub kind: OperationKind,
}

impl InFlight {
    /// Records `operation_id` as in flight. Replacing another operation still in flight is
    /// applied (the newer writer holds the target now) and reported as an anomaly.
    pub(crate) fn set(
        slot: &mut Option<InFlight>,
        operation_id: Uuid,
        kind: OperationKind,
    ) -> FoldResult {
        let previous = slot.replace(InFlight { operation_id, kind });
        match previous.filter(|p| p.operation_id != operation_id) {
            Some(prev) => Err(format!(
                "operation {operation_id} replaced operation {} still in flight",
                prev.operation_id
            )),
            None => Ok(()),
        }
    }

    /// Clears the slot if `operation_id` holds it; otherwise nothing is applied.
    pub(crate) fn clear(slot: &mut Option<InFlight>, operation_id: Uuid) -> FoldResult {
        match slot {
            Some(current) if current.operation_id == operation_id => {
                *slot = None;
                Ok(())
            }
            _ => Err(format!(
                "operation {operation_id} is not the one in flight; not applied"
            )),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    pub header: Header,
    pub name: String,
    pub plugin: String,
    /// `None` until `ClusterCreateRequested` is folded.
    pub status: Option<ClusterStatus>,
    pub status_description: String,
    pub node_groups: Vec<NodeGroupState>,
    pub in_flight: Option<InFlight>,
    pub delete_reason: Option<String>,
}

impl ClusterState {
    pub fn new(id: AggregateId) -> Self {
        ClusterState {
            header: Header::new(id),
            name: String::new(),
            plugin: String::new(),
            status: None,
            status_description: String::new(),
            node_groups: Vec::new(),
            in_flight: None,
            delete_reason: None,
        }
    }

    pub fn is_deleting_or_deleted(&self) -> bool {
        self.status.is_some_and(ClusterStatus::is_terminal)
    }

    /// Every instance still in a node group.
    pub fn instance_count(&self) -> usize {
        self.node_groups.iter().map(|g| g.instance_ids.len()).sum()
    }

    fn group_mut(&mut self, name: &str) -> Result<&mut NodeGroupState, String> {
        self.node_groups
            .iter_mut()
            .find(|g| g.spec.name == name)
            .ok_or_else(|| format!("node group {name:?} does not exist; event not applied"))
    }

    pub(crate) fn apply_event(&mut self, event: &Event, ctx: &EventContext) -> FoldResult {
        if let Event::ClusterCreateRequested {
            name,
            plugin,
            node_groups,
        } = event
        {
            if self.status.is_some() {
                return Err("the cluster was already created; event not applied".into());
            }
            self.name = name.clone();
            self.plugin = plugin.clone();
            self.status = Some(ClusterStatus::Requested);
            self.node_groups = node_groups
                .iter()
                .map(|spec| NodeGroupState {
                    count: spec.count,
                    spec: spec.clone(),
                    instance_ids: Vec::new(),
                })
                .collect();
            self.header.created_at = Some(ctx.recorded_at);
            return Ok(());
        }
        let Some(status) = self.status else {
            return Err(not_created("cluster"));
        };
        if status == ClusterStatus::Deleted {
            if matches!(event, Event::ClusterDeleteRequested { .. }) {
                return Ok(());
            }
            return Err("the cluster is deleted; event not applied".into());
        }
        match event {
            Event::ClusterStatusChanged {
                status: next,
                description,
            } => {
                // `deleting` is terminal: only a move to `deleted` (or a new description
                // while deleting) is accepted, never a way back (Sahara seed, design 4).
                if status.is_terminal() && !next.is_terminal() {
                    return Err(format!(
                        "status change to {next:?} after {status:?} rejected: deleting is terminal"
                    ));
                }
                self.status = Some(*next);
                self.status_description = description.clone();
            }
            Event::ClusterScaleRequested { targets } => {
                if status.is_terminal() {
                    return Err("scale requested on a deleting cluster; not applied".into());
                }
                for target in targets {
                    self.group_mut(&target.name)?.count = target.count;
                }
            }
            Event::NodeGroupAdded { spec } => {
                if self.node_groups.iter().any(|g| g.spec.name == spec.name) {
                    return Err(format!("node group {:?} already exists", spec.name));
                }
                self.node_groups.push(NodeGroupState {
                    count: spec.count,
                    spec: spec.clone(),
                    instance_ids: Vec::new(),
                });
            }
            Event::InstanceJoined {
                node_group,
                instance_id,
            } => {
                if self
                    .node_groups
                    .iter()
                    .any(|g| g.instance_ids.contains(instance_id))
                {
                    return Err(format!("instance {instance_id} is already a member"));
                }
                // A VM joining a deleting cluster did come into being: keep it listed so
                // the delete knows to remove it, and flag the anomaly.
                self.group_mut(node_group)?.instance_ids.push(*instance_id);
                if status.is_terminal() {
                    return Err(format!(
                        "instance {instance_id} joined while the cluster is deleting"
                    ));
                }
            }
            Event::InstanceLeft {
                node_group,
                instance_id,
                ..
            } => {
                let group = self.group_mut(node_group)?;
                let before = group.instance_ids.len();
                group.instance_ids.retain(|i| i != instance_id);
                if group.instance_ids.len() == before {
                    return Err(format!(
                        "instance {instance_id} is not in node group {node_group:?}"
                    ));
                }
            }
            Event::ClusterDeleteRequested { reason } => {
                // Repeating a delete is idempotent: the first reason is kept.
                if !status.is_terminal() {
                    self.status = Some(ClusterStatus::Deleting);
                    self.status_description = format!("deleting: {reason}");
                    self.delete_reason = Some(reason.clone());
                }
            }
            Event::ClusterDeleted {} => {
                let live = self.instance_count();
                if status != ClusterStatus::Deleting {
                    return Err(format!(
                        "deleted while {status:?}, without a delete request; not applied"
                    ));
                }
                if live > 0 {
                    return Err(format!(
                        "deleted while {live} instance(s) remain in node groups; not applied"
                    ));
                }
                self.status = Some(ClusterStatus::Deleted);
                self.in_flight = None;
            }
            Event::InFlightOperationSet {
                operation_id,
                operation_kind,
            } => {
                if status.is_terminal() && *operation_kind != OperationKind::DeleteCluster {
                    return Err(format!(
                        "{operation_kind:?} started on a deleting cluster; not applied"
                    ));
                }
                InFlight::set(&mut self.in_flight, *operation_id, *operation_kind)?;
            }
            Event::InFlightOperationCleared { operation_id, .. } => {
                InFlight::clear(&mut self.in_flight, *operation_id)?
            }
            other => return Err(format!("{} is not a cluster event", other.name())),
        }
        Ok(())
    }

    /// The contract's JSON form of a cluster.
    pub fn view(&self) -> serde_json::Value {
        json_or_null(&crate::view::ClusterView::of(self))
    }
}
