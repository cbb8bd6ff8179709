//! The cluster projection (Sahara): status, node groups with their instances, and the
//! operation in flight.

use provledger_events::catalogue::{ClusterStatus, NodeGroupSpec, NodeGroupTarget, OperationKind};
use provledger_events::{AggregateId, Event};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::entity::{json_or_null, not_created, EventContext, Folded, Header};

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
    ) -> Folded {
        let previous = slot.replace(InFlight { operation_id, kind });
        match previous.filter(|p| p.operation_id != operation_id) {
            Some(prev) => Folded::AppliedWithAnomaly(format!(
                "operation {operation_id} replaced operation {} still in flight",
                prev.operation_id
            )),
            None => Folded::Applied,
        }
    }

    /// Clears the slot if `operation_id` holds it; otherwise nothing is applied.
    pub(crate) fn clear(slot: &mut Option<InFlight>, operation_id: Uuid) -> Folded {
        match slot {
            Some(current) if current.operation_id == operation_id => {
                *slot = None;
                Folded::Applied
            }
            _ => Folded::Refused(format!(
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

    fn group_mut(&mut self, name: &str) -> Option<&mut NodeGroupState> {
        self.node_groups.iter_mut().find(|g| g.spec.name == name)
    }

    /// The problem of an event naming a node group the cluster does not have.
    fn no_group(name: &str) -> String {
        format!("node group {name:?} does not exist; event not applied")
    }

    /// Folds one event into this cluster's state, and says whether it was applied.
    pub(crate) fn apply_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        if let Event::ClusterCreateRequested {
            name,
            plugin,
            node_groups,
        } = event
        {
            return self.create(name, plugin, node_groups, ctx);
        }
        let Some(status) = self.status else {
            return not_created("cluster");
        };
        if status == ClusterStatus::Deleted {
            if matches!(event, Event::ClusterDeleteRequested { .. }) {
                return Folded::Applied;
            }
            return Folded::Refused("the cluster is deleted; event not applied".into());
        }
        match event {
            Event::ClusterStatusChanged {
                status: next,
                description,
            } => self.change_status(status, *next, description),
            Event::ClusterScaleRequested { targets } => self.scale(status, targets),
            Event::NodeGroupAdded { spec } => self.add_node_group(spec),
            Event::InstanceJoined {
                node_group,
                instance_id,
            } => self.join(status, node_group, *instance_id),
            Event::InstanceLeft {
                node_group,
                instance_id,
                ..
            } => self.leave(node_group, *instance_id),
            Event::ClusterDeleteRequested { reason } => {
                // Repeating a delete is idempotent: the first reason is kept.
                if !status.is_terminal() {
                    self.status = Some(ClusterStatus::Deleting);
                    self.status_description = format!("deleting: {reason}");
                    self.delete_reason = Some(reason.clone());
                }
                Folded::Applied
            }
            Event::ClusterDeleted {} => self.mark_deleted(status),
            Event::InFlightOperationSet {
                operation_id,
                operation_kind,
            } => {
                if status.is_terminal() && *operation_kind != OperationKind::DeleteCluster {
                    return Folded::Refused(format!(
                        "{operation_kind:?} started on a deleting cluster; not applied"
                    ));
                }
                InFlight::set(&mut self.in_flight, *operation_id, *operation_kind)
            }
            Event::InFlightOperationCleared { operation_id, .. } => {
                InFlight::clear(&mut self.in_flight, *operation_id)
            }
            other => Folded::Refused(format!("{} is not a cluster event", other.name())),
        }
    }

    /// `ClusterCreateRequested`: the cluster comes into being, once.
    fn create(
        &mut self,
        name: &str,
        plugin: &str,
        node_groups: &[NodeGroupSpec],
        ctx: &EventContext,
    ) -> Folded {
        if self.status.is_some() {
            return Folded::Refused("the cluster was already created; event not applied".into());
        }
        self.name = name.to_string();
        self.plugin = plugin.to_string();
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
        Folded::Applied
    }

    /// `ClusterStatusChanged` from `status` to `next`.
    fn change_status(
        &mut self,
        status: ClusterStatus,
        next: ClusterStatus,
        description: &str,
    ) -> Folded {
        // `deleting` is terminal: only a move to `deleted` (or a new description
        // while deleting) is accepted, never a way back (Sahara seed, design 4).
        if status.is_terminal() && !next.is_terminal() {
            return Folded::Refused(format!(
                "status change to {next:?} after {status:?} rejected: deleting is terminal"
            ));
        }
        self.status = Some(next);
        self.status_description = description.to_string();
        Folded::Applied
    }

    /// `ClusterScaleRequested`: each target's count, in order.
    fn scale(&mut self, status: ClusterStatus, targets: &[NodeGroupTarget]) -> Folded {
        if status.is_terminal() {
            return Folded::Refused("scale requested on a deleting cluster; not applied".into());
        }
        let mut changed = false;
        for target in targets {
            // The targets before a missing group keep their new count: if any changed,
            // the event is applied in part (an anomaly), otherwise it is refused.
            let Some(group) = self.group_mut(&target.name) else {
                return Folded::anomaly_or_refused(changed, Self::no_group(&target.name));
            };
            changed |= group.count != target.count;
            group.count = target.count;
        }
        Folded::Applied
    }

    /// `NodeGroupAdded`: a group of a new name.
    fn add_node_group(&mut self, spec: &NodeGroupSpec) -> Folded {
        if self.node_groups.iter().any(|g| g.spec.name == spec.name) {
            return Folded::Refused(format!("node group {:?} already exists", spec.name));
        }
        self.node_groups.push(NodeGroupState {
            count: spec.count,
            spec: spec.clone(),
            instance_ids: Vec::new(),
        });
        Folded::Applied
    }

    /// `InstanceJoined`: a member of `node_group`, unless it is a member already.
    fn join(&mut self, status: ClusterStatus, node_group: &str, instance_id: Uuid) -> Folded {
        if self
            .node_groups
            .iter()
            .any(|g| g.instance_ids.contains(&instance_id))
        {
            return Folded::Refused(format!("instance {instance_id} is already a member"));
        }
        let Some(group) = self.group_mut(node_group) else {
            return Folded::Refused(Self::no_group(node_group));
        };
        // A VM joining a deleting cluster did come into being: keep it listed so
        // the delete knows to remove it, and flag the anomaly.
        group.instance_ids.push(instance_id);
        if status.is_terminal() {
            return Folded::AppliedWithAnomaly(format!(
                "instance {instance_id} joined while the cluster is deleting"
            ));
        }
        Folded::Applied
    }

    /// `InstanceLeft`: no longer a member of `node_group`.
    fn leave(&mut self, node_group: &str, instance_id: Uuid) -> Folded {
        let Some(group) = self.group_mut(node_group) else {
            return Folded::Refused(Self::no_group(node_group));
        };
        let before = group.instance_ids.len();
        group.instance_ids.retain(|i| *i != instance_id);
        if group.instance_ids.len() == before {
            // Nothing was removed: the state is unchanged.
            return Folded::Refused(format!(
                "instance {instance_id} is not in node group {node_group:?}"
            ));
        }
        Folded::Applied
    }

    /// `ClusterDeleted`: only after a delete request, and once no instance remains.
    fn mark_deleted(&mut self, status: ClusterStatus) -> Folded {
        let live = self.instance_count();
        if status != ClusterStatus::Deleting {
            return Folded::Refused(format!(
                "deleted while {status:?}, without a delete request; not applied"
            ));
        }
        if live > 0 {
            return Folded::Refused(format!(
                "deleted while {live} instance(s) remain in node groups; not applied"
            ));
        }
        self.status = Some(ClusterStatus::Deleted);
        self.in_flight = None;
        Folded::Applied
    }

    /// The contract's JSON form of a cluster.
    pub fn view(&self) -> serde_json::Value {
        json_or_null(&crate::view::ClusterView::of(self))
    }
}
