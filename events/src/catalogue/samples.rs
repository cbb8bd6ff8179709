//! One deterministic example of every event, for golden tests, docs and the demo.
//! Tests check that this list covers every variant of [`Event`].

use std::collections::BTreeMap;

use uuid::Uuid;

use super::*;
use crate::ids::{AggregateId, Timestamp};

fn id(n: u8) -> Uuid {
    Uuid::from_bytes([n; 16])
}

fn resources() -> BTreeMap<String, u64> {
    BTreeMap::from([("VCPU".to_string(), 2), ("MEMORY_MB".to_string(), 4096)])
}

fn node_group() -> NodeGroupSpec {
    NodeGroupSpec {
        name: "workers".into(),
        count: 3,
        flavor: "m1.large".into(),
        resources: resources(),
        processes: vec!["datanode".into(), "nodemanager".into()],
    }
}

fn compensation() -> Compensation {
    Compensation {
        action: CompensationAction::ReleaseIp,
        executor: Executor::Service("ipam".into()),
        resource: "10.0.0.7".into(),
        args: BTreeMap::from([("pool".to_string(), "default".to_string())]),
    }
}

/// Every event once, in catalogue order.
pub fn all() -> Vec<Event> {
    vec![
        Event::ClusterCreateRequested {
            name: "analytics".into(),
            plugin: "vanilla".into(),
            node_groups: vec![node_group()],
        },
        Event::ClusterStatusChanged {
            status: ClusterStatus::Spawning,
            description: "booting".into(),
        },
        Event::ClusterScaleRequested {
            targets: vec![NodeGroupTarget {
                name: "workers".into(),
                count: 5,
            }],
        },
        Event::NodeGroupAdded { spec: node_group() },
        Event::InstanceJoined {
            node_group: "workers".into(),
            instance_id: id(2),
        },
        Event::InstanceLeft {
            node_group: "workers".into(),
            instance_id: id(2),
            reason: "scaled down".into(),
        },
        Event::ClusterDeleteRequested {
            reason: "user request".into(),
        },
        Event::ClusterDeleted {},
        Event::InstanceCreateRequested {
            name: "analytics-workers-0".into(),
            cluster_id: Some(id(1)),
            node_group: Some("workers".into()),
            flavor: "m1.large".into(),
            resources: resources(),
            image: "ubuntu-24.04".into(),
        },
        Event::InstanceDiscovered {
            name: "legacy-db".into(),
            host: "cmp-7".into(),
            resources: resources(),
        },
        Event::VmStateChanged {
            vm_state: VmState::Active,
            reason: "spawned".into(),
        },
        Event::PowerStateChanged {
            power_state: PowerState::Running,
        },
        Event::HostAssigned {
            host: "cmp-3".into(),
            provider_id: id(3),
        },
        Event::TaskQueued {
            task_state: TaskState::Spawning,
        },
        Event::TaskStarted {
            task_state: TaskState::Spawning,
            worker_id: "compute-3".into(),
            lease_until: Timestamp(1_700_000_060_000),
        },
        Event::TaskLeaseRenewed {
            worker_id: "compute-3".into(),
            lease_until: Timestamp(1_700_000_120_000),
        },
        Event::TaskFinished {
            task_state: TaskState::Spawning,
            outcome: TaskOutcome::Succeeded,
            reason: "booted".into(),
        },
        Event::InstanceDeleteRequested {
            reason: "user request".into(),
        },
        Event::InstanceDeleted {},
        Event::ProviderRegistered {
            name: "cmp-3".into(),
            host: "cmp-3.example".into(),
        },
        Event::InventorySet {
            resource_class: "VCPU".into(),
            inventory: Inventory {
                total: 32,
                reserved: 2,
                allocation_ratio: Ratio(4000),
                min_unit: 1,
                max_unit: 16,
                step_size: 1,
            },
        },
        Event::InventoryRemoved {
            resource_class: "DISK_GB".into(),
        },
        Event::AllocationClaimed {
            consumer: id(2),
            consumer_kind: ConsumerKind::Instance,
            resources: resources(),
        },
        Event::AllocationReleased {
            consumer: id(2),
            reason: "instance deleted".into(),
        },
        Event::ProviderDeleteRequested {
            cascade: false,
            reason: "host retired".into(),
        },
        Event::ProviderDeleteRefused {
            blocking: vec![BlockingAllocation {
                consumer: id(4),
                consumer_kind: ConsumerKind::Migration,
                hold: AllocationHold::UnconfirmedMigration,
            }],
        },
        Event::ProviderDeleted {},
        Event::OperationStarted {
            kind: OperationKind::ScaleCluster,
            target: AggregateId::cluster(id(1)),
            parent_id: None,
            stages: vec![
                StageSpec {
                    name: "decommission".into(),
                    policy: StagePolicy::Hold,
                },
                StageSpec {
                    name: "provision".into(),
                    policy: StagePolicy::RollForward,
                },
                StageSpec {
                    name: "configure".into(),
                    policy: StagePolicy::Hold,
                },
            ],
            bundle_policy: None,
        },
        Event::ChildOperationAdded { child_id: id(6) },
        Event::StageStarted {
            stage: "provision".into(),
        },
        Event::StepDone {
            stage: "provision".into(),
            step: "acquire_ip".into(),
            effect: Effect {
                kind: EffectKind::IpAcquired,
                resource: "10.0.0.7".into(),
                executor: "ipam".into(),
                origin: Origin::Created,
                detail: BTreeMap::from([("instance".to_string(), id(2).to_string())]),
            },
            compensation: Some(compensation()),
        },
        Event::StageCompleted {
            stage: "provision".into(),
        },
        Event::OperationSucceeded {},
        Event::OperationFailed {
            stage: "configure".into(),
            step: Some("start_services".into()),
            error: "ssh timeout".into(),
        },
        Event::CancellationRequested {
            reason: "target deleted".into(),
        },
        Event::OperationCancelled {
            reason: "target deleted".into(),
        },
        Event::RollbackPlanned {
            plan: RollbackPlan {
                rule: "create: infrastructure stage failed; terminate everything created".into(),
                target: AggregateId::cluster(id(1)),
                compensations: vec![PlannedCompensation {
                    compensation_id: id(7),
                    stage: "provision".into(),
                    step: "acquire_ip".into(),
                    compensation: compensation(),
                }],
                retained: vec![RetainedResource {
                    stage: "configure".into(),
                    step: "configure_node".into(),
                    resource: id(2).to_string(),
                    why: "not decommissioned; may hold data".into(),
                }],
                target_outcome: TargetOutcome::Error {
                    description: "create failed".into(),
                },
            },
        },
        Event::CompensationRequested {
            compensation_id: id(7),
            attempt: 1,
        },
        Event::CompensationDone {
            compensation_id: id(7),
        },
        Event::CompensationFailed {
            compensation_id: id(7),
            attempt: 2,
            error: "ipam unreachable".into(),
        },
        Event::RollbackFinished {
            outcome: RollbackOutcome::NeedsAttention,
            remaining: vec![id(7)],
        },
        Event::InFlightOperationSet {
            operation_id: id(5),
            operation_kind: OperationKind::CreateCluster,
        },
        Event::InFlightOperationCleared {
            operation_id: id(5),
            outcome: OperationOutcome::RolledBack,
        },
        Event::TargetDeletionNoticed {
            reason: "cluster deleted by the user".into(),
        },
        Event::RollbackResumed {
            reason: "the IPAM is back; resumed by an operator".into(),
        },
        Event::StepStarted {
            stage: "provision".into(),
            step: "acquire_ip".into(),
            executor: "ipam".into(),
            idempotency_key: id(8).to_string(),
            compensation: Some(Compensation {
                action: CompensationAction::ReleaseIp,
                executor: Executor::Service("ipam".into()),
                resource: String::new(),
                args: BTreeMap::from([(DetailKey::IdempotencyKey.to_string(), id(8).to_string())]),
            }),
        },
        Event::ReissueRequested {
            request_id: id(9),
            worker: "compute-1".into(),
            action: Reissue::PowerOff,
            reason: "task powering_off of worker compute-1 interrupted; power off re-issued".into(),
        },
        Event::ReissueAttempted {
            request_id: id(9),
            attempt: 1,
        },
        Event::ReissueDelivered { request_id: id(9) },
        Event::ReissueFailed {
            request_id: id(9),
            attempt: 1,
            error: "no responders on provledger.worker.compute-1.reissue".into(),
        },
        Event::CompensationResolved {
            compensation_id: id(5),
            reason: "released 10.0.0.3 by hand in the IPAM console (ticket OPS-1234)".into(),
        },
        Event::LossAcknowledged {
            from_version: 2,
            to_version: 2,
            reason: "store block damaged on nats-1; state checked against the IPAM (OPS-1240)"
                .into(),
        },
        Event::OperationHeartbeat {},
    ]
}

/// A sample aggregate of the right kind for an event.
pub fn aggregate_for(event: &Event) -> AggregateId {
    let kind = event
        .home_kind()
        .unwrap_or(crate::ids::AggregateKind::Cluster);
    AggregateId::new(kind, id(1))
}
