//! The catalogue's constructors: the events a writer records on its own account, one call
//! each. The client library composes events only through these (or through the pure
//! decisions of `provledger-projections`, which choose events from state), so an event's
//! shape is written once, here, next to its definition.

use std::collections::BTreeMap;

use uuid::Uuid;

use super::{
    BundlePolicy, Compensation, ConsumerKind, Effect, Event, Inventory, OperationKind,
    OperationOutcome, RollbackOutcome, RollbackPlan, StageSpec, TaskOutcome, TaskState,
};
use crate::ids::{AggregateId, Timestamp};

impl Event {
    // ---- any aggregate: an operator's acknowledgement of a loss ----

    /// The acknowledgement of `loss` (`crate::loss`), with the operator's reason.
    pub fn loss_acknowledged(loss: &crate::loss::LostVersions, reason: String) -> Event {
        Event::LossAcknowledged {
            from_version: loss.from_version,
            to_version: loss.to_version,
            reason,
        }
    }

    // ---- operation: what the runner records of the service's own calls ----

    pub fn operation_started(
        kind: OperationKind,
        target: AggregateId,
        parent_id: Option<Uuid>,
        stages: Vec<StageSpec>,
        bundle_policy: Option<BundlePolicy>,
    ) -> Event {
        Event::OperationStarted {
            kind,
            target,
            parent_id,
            stages,
            bundle_policy,
        }
    }

    pub fn stage_started(stage: impl Into<String>) -> Event {
        Event::StageStarted {
            stage: stage.into(),
        }
    }

    pub fn stage_completed(stage: impl Into<String>) -> Event {
        Event::StageCompleted {
            stage: stage.into(),
        }
    }

    /// Intent before effect (see [`Event::StepStarted`]).
    pub fn step_started(
        stage: impl Into<String>,
        step: impl Into<String>,
        executor: impl Into<String>,
        idempotency_key: impl Into<String>,
        compensation: Option<Compensation>,
    ) -> Event {
        Event::StepStarted {
            stage: stage.into(),
            step: step.into(),
            executor: executor.into(),
            idempotency_key: idempotency_key.into(),
            compensation,
        }
    }

    pub fn step_done(
        stage: impl Into<String>,
        step: impl Into<String>,
        effect: Effect,
        compensation: Option<Compensation>,
    ) -> Event {
        Event::StepDone {
            stage: stage.into(),
            step: step.into(),
            effect,
            compensation,
        }
    }

    pub fn child_operation_added(child_id: Uuid) -> Event {
        Event::ChildOperationAdded { child_id }
    }

    pub fn operation_succeeded() -> Event {
        Event::OperationSucceeded {}
    }

    pub fn operation_failed(
        stage: impl Into<String>,
        step: Option<String>,
        error: impl Into<String>,
    ) -> Event {
        Event::OperationFailed {
            stage: stage.into(),
            step,
            error: error.into(),
        }
    }

    /// The runner is alive (renews the operation's runner lease without another fact).
    pub fn operation_heartbeat() -> Event {
        Event::OperationHeartbeat {}
    }

    /// Someone asks a running operation to stop (`provledger operation cancel`).
    pub fn cancellation_requested(reason: impl Into<String>) -> Event {
        Event::CancellationRequested {
            reason: reason.into(),
        }
    }

    pub fn operation_cancelled(reason: impl Into<String>) -> Event {
        Event::OperationCancelled {
            reason: reason.into(),
        }
    }

    pub fn target_deletion_noticed(reason: impl Into<String>) -> Event {
        Event::TargetDeletionNoticed {
            reason: reason.into(),
        }
    }

    // ---- operation: what the rollback driver records of the pure decider's choices ----

    pub fn rollback_planned(plan: RollbackPlan) -> Event {
        Event::RollbackPlanned { plan }
    }

    pub fn compensation_requested(compensation_id: Uuid, attempt: u32) -> Event {
        Event::CompensationRequested {
            compensation_id,
            attempt,
        }
    }

    pub fn rollback_resumed(reason: impl Into<String>) -> Event {
        Event::RollbackResumed {
            reason: reason.into(),
        }
    }

    pub fn rollback_finished(outcome: RollbackOutcome, remaining: Vec<Uuid>) -> Event {
        Event::RollbackFinished { outcome, remaining }
    }

    // ---- the target of an operation ----

    pub fn in_flight_operation_set(operation_id: Uuid, operation_kind: OperationKind) -> Event {
        Event::InFlightOperationSet {
            operation_id,
            operation_kind,
        }
    }

    pub fn in_flight_operation_cleared(operation_id: Uuid, outcome: OperationOutcome) -> Event {
        Event::InFlightOperationCleared {
            operation_id,
            outcome,
        }
    }

    // ---- instance: a worker's task and its lease; a re-issue's delivery ----

    pub fn task_started(task_state: TaskState, worker_id: &str, lease_until: Timestamp) -> Event {
        Event::TaskStarted {
            task_state,
            worker_id: worker_id.to_string(),
            lease_until,
        }
    }

    pub fn task_lease_renewed(worker_id: &str, lease_until: Timestamp) -> Event {
        Event::TaskLeaseRenewed {
            worker_id: worker_id.to_string(),
            lease_until,
        }
    }

    pub fn task_finished(
        task_state: TaskState,
        outcome: TaskOutcome,
        reason: impl Into<String>,
    ) -> Event {
        Event::TaskFinished {
            task_state,
            outcome,
            reason: reason.into(),
        }
    }

    pub fn reissue_attempted(request_id: Uuid, attempt: u32) -> Event {
        Event::ReissueAttempted {
            request_id,
            attempt,
        }
    }

    pub fn reissue_delivered(request_id: Uuid) -> Event {
        Event::ReissueDelivered { request_id }
    }

    pub fn reissue_failed(request_id: Uuid, attempt: u32, error: impl Into<String>) -> Event {
        Event::ReissueFailed {
            request_id,
            attempt,
            error: error.into(),
        }
    }

    // ---- provider ----

    pub fn provider_registered(name: impl Into<String>, host: impl Into<String>) -> Event {
        Event::ProviderRegistered {
            name: name.into(),
            host: host.into(),
        }
    }

    pub fn inventory_set(resource_class: impl Into<String>, inventory: Inventory) -> Event {
        Event::InventorySet {
            resource_class: resource_class.into(),
            inventory,
        }
    }

    pub fn allocation_claimed(
        consumer: Uuid,
        consumer_kind: ConsumerKind,
        resources: BTreeMap<String, u64>,
    ) -> Event {
        Event::AllocationClaimed {
            consumer,
            consumer_kind,
            resources,
        }
    }

    pub fn allocation_released(consumer: Uuid, reason: impl Into<String>) -> Event {
        Event::AllocationReleased {
            consumer,
            reason: reason.into(),
        }
    }
}
