//! The instance projection (Nova): vm_state, task_state, power_state, host, and the
//! worker and lease of the task in progress.
//!
//! Besides the instance's own events, the end of the operation holding it matters: when a
//! boot's rollback undid all of it (`in_flight_operation_cleared` as `rolled_back` or
//! `cancelled`), the build task and the host go with it (see `end_undone_boot`). A rollback
//! that stopped in `needs_attention` let go of the instance; resumed, it holds it again
//! (`facts::resumed_target_marker`), so its final end reaches the instance the same way.

use provledger_events::catalogue::{
    OperationKind, OperationOutcome, Origin, PowerState, Reissue, TaskOutcome, TaskState, VmState,
};
use provledger_events::{AggregateId, Event, Timestamp};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::cluster::InFlight;
use crate::entity::{json_or_null, not_created, EventContext, Folded, Header};
use crate::resource_map::ResourceMap;

/// Whether `task` is one of a build's (Nova's scheduling, networking, spawning): the task
/// a boot holds the instance with. The one definition: the recovery rules and the
/// simulation's invariants ask it too.
pub fn is_build_task(task: TaskState) -> bool {
    matches!(
        task,
        TaskState::Scheduling | TaskState::Spawning | TaskState::Networking
    )
}

/// A re-issue a recovery recorded and the worker has not acknowledged yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct PendingReissue {
    pub request_id: Uuid,
    pub worker: String,
    pub action: Reissue,
    pub reason: String,
    pub requested_at: Timestamp,
    /// Attempts sent so far.
    pub attempts: u32,
    /// When the latest attempt was sent; with no outcome after the reply wait it counts
    /// as lost (its sender died) and the next attempt may go.
    pub attempted_at: Option<Timestamp>,
    /// Whether the latest attempt has an outcome (failed) or is still in flight.
    pub last_failed_at: Option<Timestamp>,
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceState {
    pub header: Header,
    pub name: String,
    pub origin: Option<Origin>,
    pub cluster_id: Option<Uuid>,
    pub node_group: Option<String>,
    pub flavor: String,
    pub image: String,
    pub resources: ResourceMap,
    /// `None` until the instance is created or discovered.
    pub vm_state: Option<VmState>,
    pub task_state: Option<TaskState>,
    pub power_state: PowerState,
    pub host: Option<String>,
    pub provider_id: Option<Uuid>,
    /// Set by `TaskStarted`: tells "started and interrupted" apart from "still queued".
    pub task_worker: Option<String>,
    /// The `recorded_at` of the commit that granted the current lease (`task_started` or
    /// the last `task_lease_renewed`): the lease's length is `task_lease_until` minus this
    /// (see `crate::lease`).
    pub task_lease_since: Option<Timestamp>,
    pub task_lease_until: Option<Timestamp>,
    pub last_task_outcome: Option<TaskOutcome>,
    pub delete_requested: bool,
    pub in_flight: Option<InFlight>,
    /// Re-issues recorded by recoveries and not yet acknowledged by their worker.
    pub pending_reissues: Vec<PendingReissue>,
}

impl InstanceState {
    pub fn new(id: AggregateId) -> Self {
        InstanceState {
            header: Header::new(id),
            name: String::new(),
            origin: None,
            cluster_id: None,
            node_group: None,
            flavor: String::new(),
            image: String::new(),
            resources: ResourceMap::default(),
            vm_state: None,
            task_state: None,
            power_state: PowerState::NoState,
            host: None,
            provider_id: None,
            task_worker: None,
            task_lease_since: None,
            task_lease_until: None,
            last_task_outcome: None,
            delete_requested: false,
            in_flight: None,
            pending_reissues: Vec::new(),
        }
    }

    fn pending_mut(&mut self, request_id: &Uuid) -> Option<&mut PendingReissue> {
        self.pending_reissues
            .iter_mut()
            .find(|p| p.request_id == *request_id)
    }

    /// The refusal of an event about a re-issue that is not pending.
    fn not_pending(request_id: &Uuid) -> Folded {
        Folded::Refused(format!("re-issue {request_id} is not pending; not applied"))
    }

    fn clear_task(&mut self) {
        self.task_state = None;
        self.task_worker = None;
        self.task_lease_since = None;
        self.task_lease_until = None;
    }

    /// Folds one event into this instance's state, and says whether it was applied.
    pub(crate) fn apply_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        if let Some(folded) = self.apply_creation(event, ctx) {
            return folded;
        }
        let Some(vm_state) = self.vm_state else {
            return not_created("instance");
        };
        if vm_state == VmState::Deleted {
            if matches!(event, Event::InstanceDeleteRequested { .. }) {
                return Folded::Applied;
            }
            return Folded::Refused("the instance is deleted; event not applied".into());
        }
        match event {
            Event::VmStateChanged { vm_state: next, .. } => self.change_vm_state(*next),
            Event::PowerStateChanged { power_state } => {
                self.power_state = *power_state;
                Folded::Applied
            }
            Event::HostAssigned { host, provider_id } => {
                self.host = Some(host.clone());
                self.provider_id = Some(*provider_id);
                Folded::Applied
            }
            Event::TaskQueued { .. }
            | Event::TaskStarted { .. }
            | Event::TaskLeaseRenewed { .. }
            | Event::TaskFinished { .. } => self.apply_task_event(event, ctx),
            Event::InstanceDeleteRequested { .. } => {
                // Idempotent: a repeated request changes nothing.
                if !self.delete_requested {
                    self.delete_requested = true;
                    self.task_state = Some(TaskState::Deleting);
                    self.task_worker = None;
                    self.task_lease_since = None;
                    self.task_lease_until = None;
                }
                Folded::Applied
            }
            Event::InstanceDeleted {} => self.mark_deleted(),
            Event::ReissueRequested { .. }
            | Event::ReissueAttempted { .. }
            | Event::ReissueDelivered { .. }
            | Event::ReissueFailed { .. } => self.apply_reissue_event(event, ctx),
            Event::InFlightOperationSet {
                operation_id,
                operation_kind,
            } => InFlight::set(&mut self.in_flight, *operation_id, *operation_kind),
            Event::InFlightOperationCleared {
                operation_id,
                outcome,
            } => self.clear_in_flight(*operation_id, *outcome),
            other => Folded::Refused(format!("{} is not an instance event", other.name())),
        }
    }

    /// The events that bring an instance into being (`InstanceCreateRequested`,
    /// `InstanceDiscovered`), once; `None` for any other event.
    fn apply_creation(&mut self, event: &Event, ctx: &EventContext) -> Option<Folded> {
        let exists = self.vm_state.is_some();
        match event {
            Event::InstanceCreateRequested { .. } | Event::InstanceDiscovered { .. } if exists => {
                Some(Folded::Refused(
                    "the instance already exists; event not applied".into(),
                ))
            }
            Event::InstanceCreateRequested {
                name,
                cluster_id,
                node_group,
                flavor,
                resources,
                image,
            } => {
                self.name = name.clone();
                self.origin = Some(Origin::Created);
                self.cluster_id = *cluster_id;
                self.node_group = node_group.clone();
                self.flavor = flavor.clone();
                self.image = image.clone();
                self.resources = ResourceMap::from(resources);
                self.vm_state = Some(VmState::Building);
                self.task_state = Some(TaskState::Scheduling);
                self.header.created_at = Some(ctx.recorded_at);
                Some(Folded::Applied)
            }
            Event::InstanceDiscovered {
                name,
                host,
                resources,
            } => {
                self.name = name.clone();
                self.origin = Some(Origin::Discovered);
                self.host = Some(host.clone());
                self.resources = ResourceMap::from(resources);
                self.vm_state = Some(VmState::Active);
                self.power_state = PowerState::Running;
                self.header.created_at = Some(ctx.recorded_at);
                Some(Folded::Applied)
            }
            _ => None,
        }
    }

    /// `VmStateChanged`: after a delete request, only towards deleted or error.
    fn change_vm_state(&mut self, next: VmState) -> Folded {
        if self.delete_requested && !matches!(next, VmState::Deleted | VmState::Error) {
            return Folded::Refused(format!(
                "vm_state change to {next:?} after a delete request rejected: deleting is terminal"
            ));
        }
        self.vm_state = Some(next);
        if next == VmState::Deleted {
            self.pending_reissues.clear(); // nothing is left to re-drive
        }
        Folded::Applied
    }

    /// `InFlightOperationCleared`: the operation holding the instance ended. When it was
    /// the instance's boot and its rollback undid all of it, the build is over.
    fn clear_in_flight(&mut self, operation_id: Uuid, outcome: OperationOutcome) -> Folded {
        let ending = self
            .in_flight
            .as_ref()
            .filter(|f| f.operation_id == operation_id)
            .map(|f| f.kind);
        let folded = InFlight::clear(&mut self.in_flight, operation_id);
        if ending == Some(OperationKind::BootInstance) {
            self.end_undone_boot(outcome);
        }
        folded
    }

    /// A boot's rollback that ran to its end (`rolled_back`, or `cancelled` when the boot
    /// was cancelled) undid everything the boot created: its VM is terminated and its claim
    /// released (a plan that keeps anything ends `held`). As Nova does for a build that
    /// failed (task_state None, host and node nil), the instance then has no build task in
    /// progress, no worker or lease on it, and names no host: a build task left behind reads
    /// as "still scheduling", and a host without its allocation would have heal-allocations
    /// claim there again. Its vm_state is the rollback's own event (error) and stays as
    /// recorded; a delete asked for meanwhile stays the task in progress. A rollback ended
    /// `held` or `needs_attention` left something of the boot (its claim, maybe its VM):
    /// the instance is left as it is, still on its host. A `needs_attention` rollback that
    /// is resumed holds the instance again, and its final end comes here.
    fn end_undone_boot(&mut self, outcome: OperationOutcome) {
        let task_outcome = match outcome {
            OperationOutcome::RolledBack => TaskOutcome::Failed,
            OperationOutcome::Cancelled => TaskOutcome::Cancelled,
            _ => return,
        };
        if self.task_state.is_some_and(is_build_task) {
            self.clear_task();
            self.last_task_outcome = Some(task_outcome);
        }
        self.host = None;
        self.provider_id = None;
        self.power_state = PowerState::NoState;
    }

    /// `InstanceDeleted`: only after a delete request.
    fn mark_deleted(&mut self) -> Folded {
        if !self.delete_requested {
            return Folded::Refused("deleted without a delete request; not applied".into());
        }
        self.vm_state = Some(VmState::Deleted);
        self.power_state = PowerState::NoState;
        self.clear_task();
        self.in_flight = None;
        // Nothing is left to re-drive on an instance that is gone.
        self.pending_reissues.clear();
        Folded::Applied
    }

    /// The task's events: queued, started (with its worker and lease), lease renewed,
    /// finished.
    fn apply_task_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        match event {
            Event::TaskQueued { task_state } => {
                if self.delete_requested && *task_state != TaskState::Deleting {
                    return Folded::Refused(format!(
                        "task {task_state:?} queued after a delete request; not applied"
                    ));
                }
                self.task_state = Some(*task_state);
                self.task_worker = None;
                self.task_lease_since = None;
                self.task_lease_until = None;
                // A task queued anew supersedes what a recovery asked to re-drive (the
                // recovery's own re-queue comes before its re-issue in one commit).
                self.pending_reissues.clear();
            }
            Event::TaskStarted {
                task_state,
                worker_id,
                lease_until,
            } => {
                if self.delete_requested && *task_state != TaskState::Deleting {
                    return Folded::Refused(format!(
                        "task {task_state:?} started after a delete request; not applied"
                    ));
                }
                self.task_state = Some(*task_state);
                self.task_worker = Some(worker_id.clone());
                self.task_lease_since = Some(ctx.recorded_at);
                self.task_lease_until = Some(*lease_until);
                // A worker took the task up: the re-issue reached it, or no longer matters.
                self.pending_reissues.clear();
            }
            Event::TaskLeaseRenewed {
                worker_id,
                lease_until,
            } => return self.renew_lease(worker_id, *lease_until, ctx),
            Event::TaskFinished {
                task_state,
                outcome,
                ..
            } => {
                if self.task_state != Some(*task_state) {
                    return Folded::Refused(format!(
                        "task {task_state:?} finished but the task in progress is {:?}; not applied",
                        self.task_state
                    ));
                }
                self.clear_task();
                self.last_task_outcome = Some(*outcome);
                // The task ended (by its worker, or by hand): nothing is left to re-issue.
                // A recovery that ends a task and re-issues writes its re-issue after this.
                self.pending_reissues.clear();
            }
            // Not reached: `apply_event` sends task events only.
            other => {
                return Folded::Refused(format!("{} is not an instance event", other.name()));
            }
        }
        Folded::Applied
    }

    /// `TaskLeaseRenewed`: by the worker holding the task only.
    fn renew_lease(
        &mut self,
        worker_id: &str,
        lease_until: Timestamp,
        ctx: &EventContext,
    ) -> Folded {
        match &self.task_worker {
            Some(current) if current == worker_id => {
                self.task_lease_since = Some(ctx.recorded_at);
                self.task_lease_until = Some(lease_until);
                Folded::Applied
            }
            Some(current) => Folded::Refused(format!(
                "lease renewed by {worker_id} but the task belongs to {current}; not applied"
            )),
            None => Folded::Refused("lease renewed but no task is started; not applied".into()),
        }
    }

    /// The re-issues a recovery records and their worker's acknowledgement: requested,
    /// attempted, delivered, failed.
    fn apply_reissue_event(&mut self, event: &Event, ctx: &EventContext) -> Folded {
        match event {
            Event::ReissueRequested {
                request_id,
                worker,
                action,
                reason,
            } => {
                if self.pending_mut(request_id).is_some() {
                    return Folded::Refused(format!(
                        "re-issue {request_id} is already pending; not applied"
                    ));
                }
                self.pending_reissues.push(PendingReissue {
                    request_id: *request_id,
                    worker: worker.clone(),
                    action: *action,
                    reason: reason.clone(),
                    requested_at: ctx.recorded_at,
                    attempts: 0,
                    attempted_at: None,
                    last_failed_at: None,
                    last_error: None,
                });
            }
            Event::ReissueAttempted {
                request_id,
                attempt,
            } => {
                let Some(pending) = self.pending_mut(request_id) else {
                    return Self::not_pending(request_id);
                };
                if *attempt != pending.attempts + 1 {
                    return Folded::Refused(format!(
                        "re-issue {request_id}: attempt {attempt} after {} attempt(s); not applied",
                        pending.attempts
                    ));
                }
                pending.attempts = *attempt;
                pending.attempted_at = Some(ctx.recorded_at);
                pending.last_failed_at = None;
            }
            Event::ReissueDelivered { request_id } => {
                if self.pending_mut(request_id).is_none() {
                    return Self::not_pending(request_id);
                }
                self.pending_reissues
                    .retain(|p| p.request_id != *request_id);
            }
            Event::ReissueFailed {
                request_id,
                attempt,
                error,
            } => {
                let Some(pending) = self.pending_mut(request_id) else {
                    return Self::not_pending(request_id);
                };
                // A late failure of an earlier attempt says nothing about the current one.
                if *attempt == pending.attempts {
                    pending.last_failed_at = Some(ctx.recorded_at);
                }
                pending.last_error = Some(error.clone());
            }
            // Not reached: `apply_event` sends re-issue events only.
            other => {
                return Folded::Refused(format!("{} is not an instance event", other.name()));
            }
        }
        Folded::Applied
    }

    /// The contract's JSON form of an instance.
    pub fn view(&self) -> serde_json::Value {
        json_or_null(&crate::view::InstanceView::of(self))
    }
}
