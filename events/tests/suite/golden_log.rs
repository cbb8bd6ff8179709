//! The golden log (docs/events.md, "The golden log"): `tests/golden/log/log-1.bin`, a
//! stream's worth of commits written by the build of its day, covering every event in
//! plausible lifecycles. Every later build must decode it byte for byte, verify its chains
//! and (in `provledger-projections`) fold it to the same state.
//!
//! The file is written once, by [`generate`], only when it is missing and
//! `PROVLEDGER_BLESS=1` is set; it is never rewritten. Its BLAKE3 and entry count are pinned
//! in `catalogue::golden_log::LOGS`: that pin is "the golden log is unchanged".

use std::collections::{BTreeMap, BTreeSet};

use provledger_events::catalogue::golden_log::{self, GoldenEntry, Pinned, LOGS};
use provledger_events::catalogue::{
    AllocationHold, BlockingAllocation, BundlePolicy, ClusterStatus, Compensation,
    CompensationAction, ConsumerKind, DetailKey, Effect, EffectKind, Executor, Inventory,
    NodeGroupSpec, NodeGroupTarget, OperationKind, OperationOutcome, Origin, PlannedCompensation,
    PowerState, Ratio, Reissue, RollbackOutcome, RollbackPlan, StagePolicy, StageSpec,
    TargetOutcome, TaskOutcome, TaskState, VmState,
};
use provledger_events::codec::{self, FORMAT_1};
use provledger_events::loss::{self, LostVersions};
use provledger_events::{
    verify_chain, AggregateId, ChainViolation, Commit, CommitDraft, Event, Hash, JetStreamConfig,
    Timestamp,
};
use uuid::Uuid;

/// The first log and its pin.
fn log_1() -> &'static Pinned {
    &LOGS[0]
}

/// Every event name log-1 holds: the whole catalogue of its day (53 events).
const LOG_1_NAMES: [&str; 53] = [
    "allocation_claimed",
    "allocation_released",
    "cancellation_requested",
    "child_operation_added",
    "cluster_create_requested",
    "cluster_delete_requested",
    "cluster_deleted",
    "cluster_scale_requested",
    "cluster_status_changed",
    "compensation_done",
    "compensation_failed",
    "compensation_requested",
    "compensation_resolved",
    "host_assigned",
    "in_flight_operation_cleared",
    "in_flight_operation_set",
    "instance_create_requested",
    "instance_deleted",
    "instance_delete_requested",
    "instance_discovered",
    "instance_joined",
    "instance_left",
    "inventory_removed",
    "inventory_set",
    "loss_acknowledged",
    "node_group_added",
    "operation_cancelled",
    "operation_failed",
    "operation_heartbeat",
    "operation_started",
    "operation_succeeded",
    "power_state_changed",
    "provider_deleted",
    "provider_delete_refused",
    "provider_delete_requested",
    "provider_registered",
    "reissue_attempted",
    "reissue_delivered",
    "reissue_failed",
    "reissue_requested",
    "rollback_finished",
    "rollback_planned",
    "rollback_resumed",
    "stage_completed",
    "stage_started",
    "step_done",
    "step_started",
    "target_deletion_noticed",
    "task_finished",
    "task_lease_renewed",
    "task_queued",
    "task_started",
    "vm_state_changed",
];

/// The aggregate whose version 2 the log lost (its message dropped by the server), and
/// which an operator acknowledged at version 4.
const LOST_ON: u128 = 0x1004;

// ---------------------------------------------------------------------------------------
// The generator. Deterministic: fixed ids, times and actors; nothing read from the clock.
// ---------------------------------------------------------------------------------------

const T0_MS: i64 = 1_800_000_000_000;
const USER: &str = "alice";
const OPERATOR: &str = "ops-bob";
const RUNNER: &str = "provledger-runner";
const RECOVERY: &str = "provledger-recovery";

fn provider(n: u128) -> AggregateId {
    AggregateId::provider(Uuid::from_u128(0x1000 + n))
}
fn cluster(n: u128) -> AggregateId {
    AggregateId::cluster(Uuid::from_u128(0x2000 + n))
}
fn instance(n: u128) -> AggregateId {
    AggregateId::instance(Uuid::from_u128(0x3000 + n))
}
fn operation(n: u128) -> AggregateId {
    AggregateId::operation(Uuid::from_u128(0x4000 + n))
}
fn compensation_id(n: u128) -> Uuid {
    Uuid::from_u128(0x5000 + n)
}
fn request_id(n: u128) -> Uuid {
    Uuid::from_u128(0x6000 + n)
}
fn key(n: u128) -> String {
    Uuid::from_u128(0x7000 + n).to_string()
}

fn resources(vcpu: u64, memory_mb: u64) -> BTreeMap<String, u64> {
    BTreeMap::from([
        ("VCPU".to_string(), vcpu),
        ("MEMORY_MB".to_string(), memory_mb),
    ])
}

fn inventory(total: u64, max_unit: u64) -> Inventory {
    Inventory {
        total,
        reserved: 0,
        allocation_ratio: Ratio::ONE,
        min_unit: 1,
        max_unit,
        step_size: 1,
    }
}

fn strings(pairs: &[(&str, String)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

fn effect(kind: EffectKind, resource: String, executor: &str, detail: &[(&str, String)]) -> Effect {
    Effect {
        kind,
        resource,
        executor: executor.into(),
        origin: Origin::Created,
        detail: strings(detail),
    }
}

fn undo(
    action: CompensationAction,
    executor: Executor,
    resource: String,
    args: &[(&str, String)],
) -> Compensation {
    Compensation {
        action,
        executor,
        resource,
        args: strings(args),
    }
}

fn service(name: &str) -> Executor {
    Executor::Service(name.into())
}

fn stages(kind: OperationKind) -> Vec<StageSpec> {
    use StagePolicy::*;
    let spec = |name: &str, policy| StageSpec {
        name: name.into(),
        policy,
    };
    match kind {
        OperationKind::CreateCluster => vec![
            spec("allocate", Compensate),
            spec("spawn", Compensate),
            spec("configure", Hold),
            spec("start", Hold),
        ],
        OperationKind::ScaleCluster => vec![
            spec("decommission", Hold),
            spec("terminate_and_create", RollForward),
            spec("configure_new", Hold),
        ],
        OperationKind::BootInstance => vec![
            spec("schedule", Compensate),
            spec("network", Compensate),
            spec("spawn", Compensate),
        ],
        OperationKind::Bundle => vec![spec("children", Compensate)],
        _ => vec![spec("act", Hold)],
    }
}

fn started(kind: OperationKind, target: AggregateId, parent: Option<&AggregateId>) -> Event {
    Event::OperationStarted {
        kind,
        target,
        parent_id: parent.map(|p| p.id),
        stages: stages(kind),
        bundle_policy: (kind == OperationKind::Bundle).then_some(BundlePolicy::RollBackSiblings),
    }
}

/// A commit as the log holds it, and whether the log's server later lost it.
struct Written {
    commit: Commit,
    lost: bool,
}

/// Writes commits as a writer does: each draft validated as the log validates it
/// (`CommitDraft::validate`, the open-loss rule, the size limit), sealed on its aggregate's
/// tip, at the next position, one second after the previous commit (plus any wait).
struct Writer {
    written: Vec<Written>,
    tips: BTreeMap<AggregateId, (u64, Hash)>,
    open_losses: BTreeMap<AggregateId, Vec<LostVersions>>,
    clock_ms: i64,
}

impl Writer {
    fn new() -> Self {
        Writer {
            written: Vec::new(),
            tips: BTreeMap::new(),
            open_losses: BTreeMap::new(),
            clock_ms: T0_MS,
        }
    }

    /// The time the next commit is recorded at.
    fn now(&self) -> Timestamp {
        Timestamp(self.clock_ms + 1000)
    }

    /// A lease `ms` long from the next commit.
    fn lease(&self, ms: i64) -> Timestamp {
        self.now().plus_ms(ms)
    }

    /// Time passes without a commit.
    fn wait(&mut self, ms: i64) {
        self.clock_ms += ms;
    }

    fn write(
        &mut self,
        aggregate: AggregateId,
        actor: &str,
        operation: Option<&AggregateId>,
        events: Vec<Event>,
    ) {
        self.clock_ms += 1000;
        let position = self.written.len() as u64 + 1;
        let draft = CommitDraft {
            trace: None,
            commit_id: Uuid::from_u128(
                0x0190_0000_0000_7000_8000_0000_0000_0000 + position as u128,
            ),
            operation_id: operation.map(|o| o.id),
            causation_id: None,
            actor: actor.into(),
            recorded_at: Timestamp(self.clock_ms),
            events,
        };
        let open = self.open_losses.remove(&aggregate).unwrap_or_default();
        draft
            .validate(&aggregate)
            .unwrap_or_else(|e| panic!("position {position} on {aggregate}: {e}"));
        loss::admits(&draft, &open)
            .unwrap_or_else(|e| panic!("position {position} on {aggregate}: {e}"));
        let (version, prev) = self
            .tips
            .get(&aggregate)
            .copied()
            .unwrap_or((0, Hash::ZERO));
        let mut commit = Commit::seal(aggregate, version + 1, prev, draft);
        commit.position = position;
        let bytes = codec::encode(&commit).expect("encodes");
        assert!(bytes.len() <= codec::ENCODED_COMMIT_BYTES_MAX);
        self.tips.insert(aggregate, (commit.version, commit.hash));
        self.written.push(Written {
            commit,
            lost: false,
        });
    }

    /// The server loses version `version` of `aggregate` (a damaged block): its message is
    /// not in the file, and the aggregate's next commit reveals the loss.
    fn lose(&mut self, aggregate: AggregateId, version: u64) {
        let lost = self
            .written
            .iter_mut()
            .find(|w| w.commit.aggregate == aggregate && w.commit.version == version)
            .expect("the version was written");
        lost.lost = true;
        let next = self
            .written
            .iter()
            .find(|w| w.commit.aggregate == aggregate && w.commit.version == version + 1)
            .expect("the version after was written");
        let loss = LostVersions::before(&aggregate, version - 1, &next.commit).expect("a loss");
        self.open_losses.entry(aggregate).or_default().push(loss);
    }
}

/// The stories of log-1, in log order. Each is a plausible lifecycle, written as the
/// runner, workers, the recovery sweep and operators write it.
fn generate() -> Vec<Written> {
    let mut w = Writer::new();
    providers(&mut w);
    create_cluster(&mut w);
    scale_cluster(&mut w);
    boot_instance_and_recover_its_power_off(&mut w);
    discover_an_instance(&mut w);
    retire_a_provider(&mut w);
    failing_create_rolled_back_by_hand(&mut w);
    create_cancelled_by_its_target_deletion(&mut w);
    snapshot_cancelled_by_its_user(&mut w);
    bundle_with_a_child(&mut w);
    lost_commit_acknowledged(&mut w);
    w.written
}

/// Three compute hosts; the third loses its local disk inventory.
fn providers(w: &mut Writer) {
    for n in 1..=3u128 {
        w.write(
            provider(n),
            OPERATOR,
            None,
            vec![
                Event::ProviderRegistered {
                    name: format!("cmp-{n}"),
                    host: format!("cmp-{n}.dc1.example"),
                },
                Event::InventorySet {
                    resource_class: "VCPU".into(),
                    inventory: Inventory {
                        allocation_ratio: Ratio(4000),
                        ..inventory(32, 16)
                    },
                },
                Event::InventorySet {
                    resource_class: "MEMORY_MB".into(),
                    inventory: Inventory {
                        reserved: 2048,
                        ..inventory(131_072, 65_536)
                    },
                },
                Event::InventorySet {
                    resource_class: "DISK_GB".into(),
                    inventory: inventory(2000, 500),
                },
            ],
        );
    }
    w.write(
        provider(3),
        OPERATOR,
        None,
        vec![Event::InventoryRemoved {
            resource_class: "DISK_GB".into(),
        }],
    );
}

/// A node's build by a cluster operation: created, claimed, placed, spawned by its worker.
fn build_node(
    w: &mut Writer,
    op: &AggregateId,
    node: AggregateId,
    name: &str,
    p: u128,
    group: (AggregateId, &str),
) {
    let (c, group) = group;
    w.write(
        node,
        RUNNER,
        Some(op),
        vec![Event::InstanceCreateRequested {
            name: name.into(),
            cluster_id: Some(c.id),
            node_group: Some(group.into()),
            flavor: "m1.large".into(),
            resources: resources(4, 8192),
            image: "ubuntu-24.04".into(),
        }],
    );
    w.write(
        provider(p),
        RUNNER,
        Some(op),
        vec![Event::AllocationClaimed {
            consumer: node.id,
            consumer_kind: ConsumerKind::Instance,
            resources: resources(4, 8192),
        }],
    );
    w.write(
        node,
        RUNNER,
        Some(op),
        vec![Event::HostAssigned {
            host: format!("cmp-{p}"),
            provider_id: provider(p).id,
        }],
    );
    w.write(
        *op,
        RUNNER,
        Some(op),
        vec![Event::StepDone {
            stage: "allocate".into(),
            step: format!("claim_{name}"),
            effect: effect(
                EffectKind::AllocationClaimed,
                node.id.to_string(),
                "ledger",
                &[(DetailKey::ProviderId.as_str(), provider(p).id.to_string())],
            ),
            compensation: Some(undo(
                CompensationAction::ReleaseAllocation,
                Executor::Ledger,
                node.id.to_string(),
                &[(DetailKey::ProviderId.as_str(), provider(p).id.to_string())],
            )),
        }],
    );
}

/// A node's VM spawned by its worker, intent before effect.
fn spawn_node(
    w: &mut Writer,
    op: &AggregateId,
    node: AggregateId,
    name: &str,
    worker: &str,
    key_n: u128,
) -> Compensation {
    let terminate = undo(
        CompensationAction::TerminateVm,
        service("hypervisor"),
        node.id.to_string(),
        &[(DetailKey::IdempotencyKey.as_str(), key(key_n))],
    );
    w.write(
        *op,
        RUNNER,
        Some(op),
        vec![Event::StepStarted {
            stage: "spawn".into(),
            step: format!("create_vm_{name}"),
            executor: "hypervisor".into(),
            idempotency_key: key(key_n),
            compensation: Some(terminate.clone()),
        }],
    );
    let lease = w.lease(30_000);
    w.write(
        node,
        worker,
        Some(op),
        vec![Event::TaskStarted {
            task_state: TaskState::Spawning,
            worker_id: worker.into(),
            lease_until: lease,
        }],
    );
    w.write(
        node,
        worker,
        Some(op),
        vec![
            Event::VmStateChanged {
                vm_state: VmState::Active,
                reason: "spawned".into(),
            },
            Event::PowerStateChanged {
                power_state: PowerState::Running,
            },
            Event::TaskFinished {
                task_state: TaskState::Spawning,
                outcome: TaskOutcome::Succeeded,
                reason: "booted".into(),
            },
        ],
    );
    terminate
}

/// The node's VM created, as its step records it.
fn vm_created(
    w: &mut Writer,
    op: &AggregateId,
    stage: &str,
    node: AggregateId,
    name: &str,
    terminate: Compensation,
) {
    w.write(
        *op,
        RUNNER,
        Some(op),
        vec![Event::StepDone {
            stage: stage.into(),
            step: format!("create_vm_{name}"),
            effect: effect(
                EffectKind::VmCreated,
                node.id.to_string(),
                "hypervisor",
                &[],
            ),
            compensation: Some(terminate),
        }],
    );
}

/// A node's deletion by its worker (its claim is released apart).
fn delete_node(w: &mut Writer, op: &AggregateId, node: AggregateId, worker: &str, why: &str) {
    w.write(
        node,
        RUNNER,
        Some(op),
        vec![Event::InstanceDeleteRequested { reason: why.into() }],
    );
    let lease = w.lease(30_000);
    w.write(
        node,
        worker,
        Some(op),
        vec![Event::TaskStarted {
            task_state: TaskState::Deleting,
            worker_id: worker.into(),
            lease_until: lease,
        }],
    );
    w.write(
        node,
        worker,
        Some(op),
        vec![
            Event::TaskFinished {
                task_state: TaskState::Deleting,
                outcome: TaskOutcome::Succeeded,
                reason: "vm terminated".into(),
            },
            Event::InstanceDeleted {},
        ],
    );
}

/// A node's claim on provider `on` released.
fn release_claim(w: &mut Writer, op: &AggregateId, node: AggregateId, on: u128, why: &str) {
    w.write(
        provider(on),
        RUNNER,
        Some(op),
        vec![Event::allocation_released(node.id, why)],
    );
}

/// Cluster "analytics": created by an operation, two workers on two hosts; it succeeds.
fn create_cluster(w: &mut Writer) {
    let (op, c) = (operation(1), cluster(1));
    w.write(
        op,
        USER,
        Some(&op),
        vec![started(OperationKind::CreateCluster, c, None)],
    );
    w.write(
        c,
        USER,
        Some(&op),
        vec![
            Event::ClusterCreateRequested {
                name: "analytics".into(),
                plugin: "vanilla".into(),
                node_groups: vec![NodeGroupSpec {
                    name: "workers".into(),
                    count: 2,
                    flavor: "m1.large".into(),
                    resources: resources(4, 8192),
                    processes: vec!["datanode".into(), "nodemanager".into()],
                }],
            },
            Event::InFlightOperationSet {
                operation_id: op.id,
                operation_kind: OperationKind::CreateCluster,
            },
        ],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::stage_started("allocate")],
    );
    let nodes = [
        (instance(1), "analytics-workers-0", 1u128, "compute-1"),
        (instance(2), "analytics-workers-1", 2u128, "compute-2"),
    ];
    for (node, name, p, _) in nodes {
        build_node(w, &op, node, name, p, (c, "workers"));
    }
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::stage_completed("allocate"),
            Event::stage_started("spawn"),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Spawning,
            description: "spawning 2 nodes".into(),
        }],
    );
    for (i, (node, name, _, worker)) in nodes.into_iter().enumerate() {
        let terminate = spawn_node(w, &op, node, name, worker, 1 + i as u128);
        vm_created(w, &op, "spawn", node, name, terminate);
        w.write(
            c,
            RUNNER,
            Some(&op),
            vec![Event::InstanceJoined {
                node_group: "workers".into(),
                instance_id: node.id,
            }],
        );
    }
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::stage_completed("spawn"),
            Event::stage_started("configure"),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Configuring,
            description: "configuring hadoop".into(),
        }],
    );
    w.write(op, RUNNER, Some(&op), vec![Event::operation_heartbeat()]);
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::StepDone {
                stage: "configure".into(),
                step: "configure_nodes".into(),
                effect: effect(EffectKind::NodeConfigured, c.id.to_string(), "sahara", &[]),
                compensation: None,
            },
            Event::stage_completed("configure"),
            Event::stage_started("start"),
            Event::StepDone {
                stage: "start".into(),
                step: "start_services".into(),
                effect: effect(EffectKind::NodeStarted, c.id.to_string(), "sahara", &[]),
                compensation: None,
            },
            Event::stage_completed("start"),
            Event::operation_succeeded(),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![
            Event::ClusterStatusChanged {
                status: ClusterStatus::Active,
                description: "ready".into(),
            },
            Event::InFlightOperationCleared {
                operation_id: op.id,
                outcome: OperationOutcome::Succeeded,
            },
        ],
    );
}

/// "analytics" scaled: one worker fewer, a new "edge" group of one node.
fn scale_cluster(w: &mut Writer) {
    let (op, c) = (operation(2), cluster(1));
    let (gone, edge) = (instance(2), instance(3));
    w.write(
        op,
        USER,
        Some(&op),
        vec![started(OperationKind::ScaleCluster, c, None)],
    );
    w.write(
        c,
        USER,
        Some(&op),
        vec![
            Event::ClusterScaleRequested {
                targets: vec![NodeGroupTarget {
                    name: "workers".into(),
                    count: 1,
                }],
            },
            Event::NodeGroupAdded {
                spec: NodeGroupSpec {
                    name: "edge".into(),
                    count: 1,
                    flavor: "m1.large".into(),
                    resources: resources(4, 8192),
                    processes: vec!["gateway".into()],
                },
            },
            Event::InFlightOperationSet {
                operation_id: op.id,
                operation_kind: OperationKind::ScaleCluster,
            },
            Event::ClusterStatusChanged {
                status: ClusterStatus::Scaling,
                description: "workers 2 -> 1, edge 0 -> 1".into(),
            },
        ],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::stage_started("decommission"),
            Event::StepDone {
                stage: "decommission".into(),
                step: "decommission_analytics-workers-1".into(),
                effect: effect(
                    EffectKind::NodeDecommissioned,
                    gone.id.to_string(),
                    "sahara",
                    &[(DetailKey::Node.as_str(), gone.id.to_string())],
                ),
                compensation: None,
            },
            Event::stage_completed("decommission"),
            Event::stage_started("terminate_and_create"),
        ],
    );
    delete_node(w, &op, gone, "compute-2", "scaled down");
    release_claim(w, &op, gone, 2, "instance deleted");
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::InstanceLeft {
            node_group: "workers".into(),
            instance_id: gone.id,
            reason: "scaled down".into(),
        }],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::StepDone {
            stage: "terminate_and_create".into(),
            step: "terminate_analytics-workers-1".into(),
            effect: effect(
                EffectKind::NodeTerminated,
                gone.id.to_string(),
                "hypervisor",
                &[],
            ),
            compensation: None,
        }],
    );
    w.write(
        edge,
        RUNNER,
        Some(&op),
        vec![Event::InstanceCreateRequested {
            name: "analytics-edge-0".into(),
            cluster_id: Some(c.id),
            node_group: Some("edge".into()),
            flavor: "m1.large".into(),
            resources: resources(4, 8192),
            image: "ubuntu-24.04".into(),
        }],
    );
    w.write(
        provider(1),
        RUNNER,
        Some(&op),
        vec![Event::AllocationClaimed {
            consumer: edge.id,
            consumer_kind: ConsumerKind::Instance,
            resources: resources(4, 8192),
        }],
    );
    w.write(
        edge,
        RUNNER,
        Some(&op),
        vec![Event::HostAssigned {
            host: "cmp-1".into(),
            provider_id: provider(1).id,
        }],
    );
    let lease = w.lease(30_000);
    w.write(
        edge,
        "compute-1",
        Some(&op),
        vec![Event::TaskStarted {
            task_state: TaskState::Spawning,
            worker_id: "compute-1".into(),
            lease_until: lease,
        }],
    );
    w.write(
        edge,
        "compute-1",
        Some(&op),
        vec![
            Event::VmStateChanged {
                vm_state: VmState::Active,
                reason: "spawned".into(),
            },
            Event::PowerStateChanged {
                power_state: PowerState::Running,
            },
            Event::TaskFinished {
                task_state: TaskState::Spawning,
                outcome: TaskOutcome::Succeeded,
                reason: "booted".into(),
            },
        ],
    );
    let terminate = undo(
        CompensationAction::TerminateVm,
        service("hypervisor"),
        edge.id.to_string(),
        &[(DetailKey::ClusterId.as_str(), c.id.to_string())],
    );
    vm_created(
        w,
        &op,
        "terminate_and_create",
        edge,
        "analytics-edge-0",
        terminate,
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::InstanceJoined {
            node_group: "edge".into(),
            instance_id: edge.id,
        }],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::stage_completed("terminate_and_create"),
            Event::stage_started("configure_new"),
            Event::StepDone {
                stage: "configure_new".into(),
                step: "configure_analytics-edge-0".into(),
                effect: effect(
                    EffectKind::NodeConfigured,
                    edge.id.to_string(),
                    "sahara",
                    &[],
                ),
                compensation: None,
            },
            Event::stage_completed("configure_new"),
            Event::operation_succeeded(),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![
            Event::ClusterStatusChanged {
                status: ClusterStatus::Active,
                description: "scaled".into(),
            },
            Event::InFlightOperationCleared {
                operation_id: op.id,
                outcome: OperationOutcome::Succeeded,
            },
        ],
    );
}

/// Instance "web-1" booted by an operation (a network task whose lease is renewed), then
/// powered off by a worker that goes silent: the recovery sweep re-queues the task and
/// re-issues it until the worker acknowledges, and the worker powers it off.
fn boot_instance_and_recover_its_power_off(w: &mut Writer) {
    let (op, i) = (operation(3), instance(4));
    let worker = "compute-2";
    w.write(
        op,
        USER,
        Some(&op),
        vec![started(OperationKind::BootInstance, i, None)],
    );
    w.write(
        i,
        USER,
        Some(&op),
        vec![
            Event::InstanceCreateRequested {
                name: "web-1".into(),
                cluster_id: None,
                node_group: None,
                flavor: "m1.medium".into(),
                resources: resources(2, 4096),
                image: "debian-13".into(),
            },
            Event::InFlightOperationSet {
                operation_id: op.id,
                operation_kind: OperationKind::BootInstance,
            },
        ],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::stage_started("schedule")],
    );
    w.write(
        provider(2),
        RUNNER,
        Some(&op),
        vec![Event::AllocationClaimed {
            consumer: i.id,
            consumer_kind: ConsumerKind::Instance,
            resources: resources(2, 4096),
        }],
    );
    w.write(
        i,
        RUNNER,
        Some(&op),
        vec![Event::HostAssigned {
            host: "cmp-2".into(),
            provider_id: provider(2).id,
        }],
    );
    let on_p2 = [(DetailKey::ProviderId.as_str(), provider(2).id.to_string())];
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::StepDone {
                stage: "schedule".into(),
                step: "claim".into(),
                effect: effect(
                    EffectKind::AllocationClaimed,
                    i.id.to_string(),
                    "ledger",
                    &on_p2,
                ),
                compensation: Some(undo(
                    CompensationAction::ReleaseAllocation,
                    Executor::Ledger,
                    i.id.to_string(),
                    &on_p2,
                )),
            },
            Event::stage_completed("schedule"),
            Event::stage_started("network"),
        ],
    );
    w.write(
        i,
        RUNNER,
        Some(&op),
        vec![Event::TaskQueued {
            task_state: TaskState::Networking,
        }],
    );
    let lease = w.lease(4000);
    w.write(
        i,
        worker,
        Some(&op),
        vec![Event::task_started(TaskState::Networking, worker, lease)],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::step_started(
            "network",
            "acquire_ip",
            "ipam",
            key(10),
            Some(undo(
                CompensationAction::ReleaseIp,
                service("ipam"),
                String::new(),
                &[(DetailKey::IdempotencyKey.as_str(), key(10))],
            )),
        )],
    );
    w.wait(1000);
    let lease = w.lease(4000);
    w.write(
        i,
        worker,
        Some(&op),
        vec![Event::task_lease_renewed(worker, lease)],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::StepDone {
            stage: "network".into(),
            step: "acquire_ip".into(),
            effect: effect(
                EffectKind::IpAcquired,
                "10.0.1.4".into(),
                "ipam",
                &[(DetailKey::IdempotencyKey.as_str(), key(10))],
            ),
            compensation: Some(undo(
                CompensationAction::ReleaseIp,
                service("ipam"),
                "10.0.1.4".into(),
                &[("pool", "tenant-a".into())],
            )),
        }],
    );
    w.write(
        i,
        worker,
        Some(&op),
        vec![Event::task_finished(
            TaskState::Networking,
            TaskOutcome::Succeeded,
            "10.0.1.4 attached",
        )],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::StepDone {
                stage: "network".into(),
                step: "register_dns".into(),
                effect: effect(
                    EffectKind::DnsRegistered,
                    "web-1.tenant-a.example".into(),
                    "dns",
                    &[],
                ),
                compensation: Some(undo(
                    CompensationAction::UnregisterDns,
                    service("dns"),
                    "web-1.tenant-a.example".into(),
                    &[],
                )),
            },
            Event::stage_completed("network"),
            Event::stage_started("spawn"),
        ],
    );
    let terminate = spawn_node(w, &op, i, "web-1", worker, 11);
    vm_created(w, &op, "spawn", i, "web-1", terminate);
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::stage_completed("spawn"),
            Event::operation_succeeded(),
        ],
    );
    w.write(
        i,
        RUNNER,
        Some(&op),
        vec![Event::in_flight_operation_cleared(
            op.id,
            OperationOutcome::Succeeded,
        )],
    );
    // The power-off whose worker goes silent.
    w.write(
        i,
        USER,
        None,
        vec![Event::TaskQueued {
            task_state: TaskState::PoweringOff,
        }],
    );
    let lease = w.lease(5000);
    w.write(
        i,
        worker,
        None,
        vec![Event::task_started(TaskState::PoweringOff, worker, lease)],
    );
    w.wait(60_000);
    let reason = format!(
        "task PoweringOff of worker {worker} interrupted (lease expired at {lease}); power off re-issued"
    );
    let request = request_id(1);
    w.write(
        i,
        RECOVERY,
        None,
        vec![
            Event::task_finished(
                TaskState::PoweringOff,
                TaskOutcome::Recovered,
                reason.clone(),
            ),
            Event::TaskQueued {
                task_state: TaskState::PoweringOff,
            },
            Event::ReissueRequested {
                request_id: request,
                worker: worker.into(),
                action: Reissue::PowerOff,
                reason,
            },
        ],
    );
    w.write(
        i,
        RECOVERY,
        None,
        vec![Event::reissue_attempted(request, 1)],
    );
    w.write(
        i,
        RECOVERY,
        None,
        vec![Event::reissue_failed(
            request,
            1,
            format!("no responders on provledger.worker.{worker}.reissue"),
        )],
    );
    w.wait(5000);
    w.write(
        i,
        RECOVERY,
        None,
        vec![Event::reissue_attempted(request, 2)],
    );
    w.write(i, worker, None, vec![Event::reissue_delivered(request)]);
    let lease = w.lease(10_000);
    w.write(
        i,
        worker,
        None,
        vec![Event::task_started(TaskState::PoweringOff, worker, lease)],
    );
    w.write(
        i,
        worker,
        None,
        vec![
            Event::PowerStateChanged {
                power_state: PowerState::Shutdown,
            },
            Event::VmStateChanged {
                vm_state: VmState::Stopped,
                reason: "powered off".into(),
            },
            Event::task_finished(
                TaskState::PoweringOff,
                TaskOutcome::Succeeded,
                "powered off",
            ),
        ],
    );
}

/// A VM found running on a host, unknown to the ledger until then.
fn discover_an_instance(w: &mut Writer) {
    w.write(
        instance(5),
        "provledger-discovery",
        None,
        vec![Event::InstanceDiscovered {
            name: "legacy-db".into(),
            host: "cmp-2".into(),
            resources: resources(8, 32_768),
        }],
    );
}

/// cmp-3 retired: its delete is refused while an instance runs there, and succeeds once
/// the instance is deleted and its claim released.
fn retire_a_provider(w: &mut Writer) {
    let (p, i) = (provider(3), instance(6));
    w.write(
        i,
        USER,
        None,
        vec![Event::InstanceCreateRequested {
            name: "batch-1".into(),
            cluster_id: None,
            node_group: None,
            flavor: "m1.small".into(),
            resources: resources(1, 2048),
            image: "debian-13".into(),
        }],
    );
    w.write(
        p,
        USER,
        None,
        vec![Event::allocation_claimed(
            i.id,
            ConsumerKind::Instance,
            resources(1, 2048),
        )],
    );
    w.write(
        i,
        USER,
        None,
        vec![Event::HostAssigned {
            host: "cmp-3".into(),
            provider_id: p.id,
        }],
    );
    let lease = w.lease(30_000);
    w.write(
        i,
        "compute-3",
        None,
        vec![Event::task_started(TaskState::Spawning, "compute-3", lease)],
    );
    w.write(
        i,
        "compute-3",
        None,
        vec![
            Event::VmStateChanged {
                vm_state: VmState::Active,
                reason: "spawned".into(),
            },
            Event::PowerStateChanged {
                power_state: PowerState::Running,
            },
            Event::task_finished(TaskState::Spawning, TaskOutcome::Succeeded, "booted"),
        ],
    );
    w.write(
        p,
        OPERATOR,
        None,
        vec![Event::ProviderDeleteRequested {
            cascade: false,
            reason: "host retired".into(),
        }],
    );
    w.write(
        p,
        OPERATOR,
        None,
        vec![Event::ProviderDeleteRefused {
            blocking: vec![BlockingAllocation {
                consumer: i.id,
                consumer_kind: ConsumerKind::Instance,
                hold: AllocationHold::Instance,
            }],
        }],
    );
    w.write(
        i,
        USER,
        None,
        vec![Event::InstanceDeleteRequested {
            reason: "moving off cmp-3".into(),
        }],
    );
    let lease = w.lease(30_000);
    w.write(
        i,
        "compute-3",
        None,
        vec![Event::task_started(TaskState::Deleting, "compute-3", lease)],
    );
    w.write(
        i,
        "compute-3",
        None,
        vec![
            Event::task_finished(TaskState::Deleting, TaskOutcome::Succeeded, "vm terminated"),
            Event::InstanceDeleted {},
        ],
    );
    w.write(
        p,
        USER,
        None,
        vec![Event::allocation_released(i.id, "instance deleted")],
    );
    w.write(
        p,
        OPERATOR,
        None,
        vec![
            Event::ProviderDeleteRequested {
                cascade: false,
                reason: "deleted".into(),
            },
            Event::ProviderDeleted {},
        ],
    );
}

/// Cluster "etl": its node's VM goes to error, the create fails and is rolled back; two
/// compensations run out of attempts (needs attention), an operator removes the DNS record
/// by hand and resumes the rollback once the IPAM is back, and it ends rolled back.
fn failing_create_rolled_back_by_hand(w: &mut Writer) {
    let (op, c, node) = (operation(4), cluster(2), instance(7));
    let name = "etl-workers-0";
    w.write(
        op,
        USER,
        Some(&op),
        vec![started(OperationKind::CreateCluster, c, None)],
    );
    w.write(
        c,
        USER,
        Some(&op),
        vec![
            Event::ClusterCreateRequested {
                name: "etl".into(),
                plugin: "vanilla".into(),
                node_groups: vec![NodeGroupSpec {
                    name: "workers".into(),
                    count: 1,
                    flavor: "m1.large".into(),
                    resources: resources(4, 8192),
                    processes: vec!["datanode".into()],
                }],
            },
            Event::in_flight_operation_set(op.id, OperationKind::CreateCluster),
        ],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::stage_started("allocate")],
    );
    build_node(w, &op, node, name, 1, (c, "workers"));
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::stage_completed("allocate"),
            Event::stage_started("spawn"),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Spawning,
            description: "spawning 1 node".into(),
        }],
    );
    let release_ip = undo(
        CompensationAction::ReleaseIp,
        service("ipam"),
        "10.0.2.7".into(),
        &[("pool", "tenant-b".into())],
    );
    let unregister_dns = undo(
        CompensationAction::UnregisterDns,
        service("dns"),
        "etl-workers-0.tenant-b.example".into(),
        &[],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::StepDone {
            stage: "spawn".into(),
            step: "acquire_ip".into(),
            effect: effect(EffectKind::IpAcquired, "10.0.2.7".into(), "ipam", &[]),
            compensation: Some(release_ip.clone()),
        }],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::StepDone {
            stage: "spawn".into(),
            step: "register_dns".into(),
            effect: effect(
                EffectKind::DnsRegistered,
                "etl-workers-0.tenant-b.example".into(),
                "dns",
                &[],
            ),
            compensation: Some(unregister_dns.clone()),
        }],
    );
    let terminate = undo(
        CompensationAction::TerminateVm,
        service("hypervisor"),
        node.id.to_string(),
        &[(DetailKey::ClusterId.as_str(), c.id.to_string())],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::StepStarted {
            stage: "spawn".into(),
            step: format!("create_vm_{name}"),
            executor: "hypervisor".into(),
            idempotency_key: key(20),
            compensation: Some(terminate.clone()),
        }],
    );
    let lease = w.lease(30_000);
    w.write(
        node,
        "compute-1",
        Some(&op),
        vec![Event::task_started(TaskState::Spawning, "compute-1", lease)],
    );
    w.write(
        node,
        "compute-1",
        Some(&op),
        vec![
            Event::VmStateChanged {
                vm_state: VmState::Error,
                reason: "image not found".into(),
            },
            Event::task_finished(TaskState::Spawning, TaskOutcome::Failed, "image not found"),
        ],
    );
    vm_created(w, &op, "spawn", node, name, terminate.clone());
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::operation_failed(
            "spawn",
            Some(format!("create_vm_{name}")),
            "instance etl-workers-0 went to error: image not found",
        )],
    );
    let on_p1 = [(DetailKey::ProviderId.as_str(), provider(1).id.to_string())];
    let planned =
        |n: u128, step: &str, compensation: &Compensation, stage: &str| PlannedCompensation {
            compensation_id: compensation_id(n),
            stage: stage.into(),
            step: step.into(),
            compensation: compensation.clone(),
        };
    let release_allocation = undo(
        CompensationAction::ReleaseAllocation,
        Executor::Ledger,
        node.id.to_string(),
        &on_p1,
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::rollback_planned(RollbackPlan {
            rule: "create: infrastructure stage failed; terminate everything created".into(),
            target: c,
            compensations: vec![
                planned(1, &format!("create_vm_{name}"), &terminate, "spawn"),
                planned(2, "register_dns", &unregister_dns, "spawn"),
                planned(3, "acquire_ip", &release_ip, "spawn"),
                planned(4, &format!("claim_{name}"), &release_allocation, "allocate"),
            ],
            retained: vec![],
            target_outcome: TargetOutcome::Error {
                description: "create failed: image not found".into(),
            },
        })],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::compensation_requested(compensation_id(1), 1)],
    );
    delete_node(w, &op, node, "compute-1", "rollback of the create");
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::CompensationDone {
            compensation_id: compensation_id(1),
        }],
    );
    for attempt in 1..=2 {
        for (n, error) in [(2, "dns: connection refused"), (3, "ipam unreachable")] {
            w.write(
                op,
                RUNNER,
                Some(&op),
                vec![Event::compensation_requested(compensation_id(n), attempt)],
            );
            w.write(
                op,
                RUNNER,
                Some(&op),
                vec![Event::CompensationFailed {
                    compensation_id: compensation_id(n),
                    attempt,
                    error: error.into(),
                }],
            );
        }
    }
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::compensation_requested(compensation_id(4), 1)],
    );
    release_claim(w, &op, node, 1, "rollback of the create");
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::CompensationDone {
            compensation_id: compensation_id(4),
        }],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::rollback_finished(
            RollbackOutcome::NeedsAttention,
            vec![compensation_id(2), compensation_id(3)],
        )],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![
            Event::ClusterStatusChanged {
                status: ClusterStatus::Error,
                description: format!(
                    "create failed: image not found; rollback needs attention, see operation {}",
                    op.id
                ),
            },
            Event::in_flight_operation_cleared(op.id, OperationOutcome::NeedsAttention),
        ],
    );
    w.write(
        op,
        OPERATOR,
        Some(&op),
        vec![Event::CompensationResolved {
            compensation_id: compensation_id(2),
            reason: "removed etl-workers-0.tenant-b.example by hand in the DNS console (OPS-77)"
                .into(),
        }],
    );
    w.write(
        op,
        OPERATOR,
        Some(&op),
        vec![Event::rollback_resumed(
            "the IPAM is back; resumed by an operator",
        )],
    );
    w.write(
        c,
        OPERATOR,
        Some(&op),
        vec![Event::in_flight_operation_set(
            op.id,
            OperationKind::CreateCluster,
        )],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::compensation_requested(compensation_id(3), 3)],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::CompensationDone {
                compensation_id: compensation_id(3),
            },
            Event::rollback_finished(RollbackOutcome::RolledBack, vec![]),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![
            Event::ClusterStatusChanged {
                status: ClusterStatus::Error,
                description: "create failed: image not found".into(),
            },
            Event::in_flight_operation_cleared(op.id, OperationOutcome::RolledBack),
        ],
    );
}

/// Cluster "scratch": deleted by its user while its create runs; the create notices,
/// is cancelled, removes what it created, and the cluster is deleted.
fn create_cancelled_by_its_target_deletion(w: &mut Writer) {
    let (op, c, node) = (operation(5), cluster(3), instance(8));
    let name = "scratch-workers-0";
    w.write(
        op,
        USER,
        Some(&op),
        vec![started(OperationKind::CreateCluster, c, None)],
    );
    w.write(
        c,
        USER,
        Some(&op),
        vec![
            Event::ClusterCreateRequested {
                name: "scratch".into(),
                plugin: "vanilla".into(),
                node_groups: vec![NodeGroupSpec {
                    name: "workers".into(),
                    count: 1,
                    flavor: "m1.large".into(),
                    resources: resources(4, 8192),
                    processes: vec!["nodemanager".into()],
                }],
            },
            Event::in_flight_operation_set(op.id, OperationKind::CreateCluster),
        ],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::stage_started("allocate")],
    );
    build_node(w, &op, node, name, 2, (c, "workers"));
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::stage_completed("allocate"),
            Event::stage_started("spawn"),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Spawning,
            description: "spawning 1 node".into(),
        }],
    );
    let terminate = spawn_node(w, &op, node, name, "compute-2", 30);
    vm_created(w, &op, "spawn", node, name, terminate.clone());
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::InstanceJoined {
            node_group: "workers".into(),
            instance_id: node.id,
        }],
    );
    w.write(
        c,
        USER,
        None,
        vec![Event::ClusterDeleteRequested {
            reason: "no longer needed".into(),
        }],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::target_deletion_noticed(
            "cluster deleted by the user",
        )],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::operation_cancelled("target deleted")],
    );
    let on_p2 = [(DetailKey::ProviderId.as_str(), provider(2).id.to_string())];
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::rollback_planned(RollbackPlan {
            rule: "create cancelled by deletion: remove everything created".into(),
            target: c,
            compensations: vec![
                PlannedCompensation {
                    compensation_id: compensation_id(11),
                    stage: "spawn".into(),
                    step: format!("create_vm_{name}"),
                    compensation: terminate,
                },
                PlannedCompensation {
                    compensation_id: compensation_id(12),
                    stage: "allocate".into(),
                    step: format!("claim_{name}"),
                    compensation: undo(
                        CompensationAction::ReleaseAllocation,
                        Executor::Ledger,
                        node.id.to_string(),
                        &on_p2,
                    ),
                },
            ],
            retained: vec![],
            target_outcome: TargetOutcome::Deleted,
        })],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![Event::compensation_requested(compensation_id(11), 1)],
    );
    w.write(
        node,
        RUNNER,
        Some(&op),
        vec![Event::InstanceDeleteRequested {
            reason: "cluster scratch deleted".into(),
        }],
    );
    let lease = w.lease(30_000);
    w.write(
        node,
        "compute-2",
        Some(&op),
        vec![Event::task_started(TaskState::Deleting, "compute-2", lease)],
    );
    w.write(
        node,
        "compute-2",
        Some(&op),
        vec![
            Event::task_finished(TaskState::Deleting, TaskOutcome::Succeeded, "vm terminated"),
            Event::InstanceDeleted {},
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::InstanceLeft {
            node_group: "workers".into(),
            instance_id: node.id,
            reason: "terminated by the rollback".into(),
        }],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::CompensationDone {
                compensation_id: compensation_id(11),
            },
            Event::compensation_requested(compensation_id(12), 1),
        ],
    );
    w.write(
        provider(2),
        RUNNER,
        Some(&op),
        vec![Event::allocation_released(
            node.id,
            "rollback of the create",
        )],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::CompensationDone {
                compensation_id: compensation_id(12),
            },
            Event::rollback_finished(RollbackOutcome::RolledBack, vec![]),
        ],
    );
    w.write(
        c,
        RUNNER,
        Some(&op),
        vec![Event::in_flight_operation_cleared(
            op.id,
            OperationOutcome::Cancelled,
        )],
    );
    w.write(c, RUNNER, None, vec![Event::ClusterDeleted {}]);
}

/// A snapshot of "web-1" its user cancels before anything was uploaded.
fn snapshot_cancelled_by_its_user(w: &mut Writer) {
    let (op, i) = (operation(6), instance(4));
    w.write(
        op,
        USER,
        Some(&op),
        vec![started(OperationKind::SnapshotInstance, i, None)],
    );
    w.write(
        i,
        USER,
        Some(&op),
        vec![Event::in_flight_operation_set(
            op.id,
            OperationKind::SnapshotInstance,
        )],
    );
    w.write(op, RUNNER, Some(&op), vec![Event::stage_started("act")]);
    w.write(op, RUNNER, Some(&op), vec![Event::operation_heartbeat()]);
    w.write(
        op,
        USER,
        Some(&op),
        vec![Event::cancellation_requested(
            "snapshot not needed any more",
        )],
    );
    w.write(
        op,
        RUNNER,
        Some(&op),
        vec![
            Event::operation_cancelled("snapshot not needed any more"),
            Event::rollback_planned(RollbackPlan {
                rule: "nothing was done; nothing to undo".into(),
                target: i,
                compensations: vec![],
                retained: vec![],
                target_outcome: TargetOutcome::Active {
                    description: "snapshot cancelled".into(),
                },
            }),
            Event::rollback_finished(RollbackOutcome::RolledBack, vec![]),
        ],
    );
    w.write(
        i,
        RUNNER,
        Some(&op),
        vec![Event::in_flight_operation_cleared(
            op.id,
            OperationOutcome::Cancelled,
        )],
    );
}

/// A bundle whose one child boots "db-1".
fn bundle_with_a_child(w: &mut Writer) {
    let (bundle, child, i) = (operation(7), operation(8), instance(9));
    w.write(
        bundle,
        USER,
        Some(&bundle),
        vec![started(OperationKind::Bundle, bundle, None)],
    );
    w.write(
        bundle,
        RUNNER,
        Some(&bundle),
        vec![
            Event::stage_started("children"),
            Event::child_operation_added(child.id),
        ],
    );
    w.write(
        child,
        RUNNER,
        Some(&child),
        vec![started(OperationKind::BootInstance, i, Some(&bundle))],
    );
    w.write(
        i,
        RUNNER,
        Some(&child),
        vec![
            Event::InstanceCreateRequested {
                name: "db-1".into(),
                cluster_id: None,
                node_group: None,
                flavor: "m1.large".into(),
                resources: resources(4, 16_384),
                image: "debian-13".into(),
            },
            Event::in_flight_operation_set(child.id, OperationKind::BootInstance),
        ],
    );
    w.write(
        child,
        RUNNER,
        Some(&child),
        vec![Event::stage_started("schedule")],
    );
    w.write(
        provider(1),
        RUNNER,
        Some(&child),
        vec![Event::allocation_claimed(
            i.id,
            ConsumerKind::Instance,
            resources(4, 16_384),
        )],
    );
    w.write(
        i,
        RUNNER,
        Some(&child),
        vec![Event::HostAssigned {
            host: "cmp-1".into(),
            provider_id: provider(1).id,
        }],
    );
    let on_p1 = [(DetailKey::ProviderId.as_str(), provider(1).id.to_string())];
    w.write(
        child,
        RUNNER,
        Some(&child),
        vec![
            Event::StepDone {
                stage: "schedule".into(),
                step: "claim".into(),
                effect: effect(
                    EffectKind::AllocationClaimed,
                    i.id.to_string(),
                    "ledger",
                    &on_p1,
                ),
                compensation: Some(undo(
                    CompensationAction::ReleaseAllocation,
                    Executor::Ledger,
                    i.id.to_string(),
                    &on_p1,
                )),
            },
            Event::stage_completed("schedule"),
            Event::stage_started("network"),
            Event::stage_completed("network"),
            Event::stage_started("spawn"),
        ],
    );
    let terminate = spawn_node(w, &child, i, "db-1", "compute-1", 40);
    vm_created(w, &child, "spawn", i, "db-1", terminate);
    w.write(
        child,
        RUNNER,
        Some(&child),
        vec![
            Event::stage_completed("spawn"),
            Event::operation_succeeded(),
        ],
    );
    w.write(
        i,
        RUNNER,
        Some(&child),
        vec![Event::in_flight_operation_cleared(
            child.id,
            OperationOutcome::Succeeded,
        )],
    );
    w.write(
        bundle,
        RUNNER,
        Some(&bundle),
        vec![
            Event::stage_completed("children"),
            Event::operation_succeeded(),
        ],
    );
}

/// cmp-4's version 2 is lost from the log (a damaged store block); version 3 reveals it and
/// an operator acknowledges it at version 4.
fn lost_commit_acknowledged(w: &mut Writer) {
    let p = AggregateId::provider(Uuid::from_u128(LOST_ON));
    w.write(
        p,
        OPERATOR,
        None,
        vec![Event::provider_registered("cmp-4", "cmp-4.dc1.example")],
    );
    w.write(
        p,
        OPERATOR,
        None,
        vec![Event::inventory_set("VCPU", inventory(16, 16))],
    );
    w.write(
        p,
        OPERATOR,
        None,
        vec![Event::inventory_set("MEMORY_MB", inventory(65_536, 65_536))],
    );
    w.lose(p, 2);
    let loss = w.open_losses[&p][0];
    w.write(
        p,
        OPERATOR,
        None,
        vec![Event::loss_acknowledged(
            &loss,
            "store block damaged on nats-1; inventory checked on the host (OPS-1240)".into(),
        )],
    );
}

/// The file's entries: every commit not lost, at its position, on its subject.
fn entries(written: &[Written]) -> Vec<GoldenEntry> {
    let subjects = JetStreamConfig::default();
    written
        .iter()
        .filter(|w| !w.lost)
        .map(|w| GoldenEntry {
            position: w.commit.position,
            subject: subjects.subject_for(&w.commit.aggregate),
            payload: codec::encode(&w.commit).expect("encodes"),
        })
        .collect()
}

/// Writes log-1.bin if it is missing and PROVLEDGER_BLESS=1; never overwrites. Once per
/// test binary, so that tests running side by side never read a file being written.
fn bless_if_missing() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(bless_now);
}

fn bless_now() {
    let path = golden_log::dir().join(log_1().file);
    let bless = std::env::var("PROVLEDGER_BLESS").is_ok_and(|v| v == "1");
    if !bless || path.exists() {
        return;
    }
    let bytes = golden_log::write(&entries(&generate())).expect("a writable log");
    std::fs::create_dir_all(golden_log::dir()).expect("the golden log directory");
    std::fs::write(&path, &bytes).expect("log-1.bin written");
    eprintln!(
        "wrote {} ({} bytes, BLAKE3 {}); pin it in catalogue::golden_log::LOGS",
        path.display(),
        bytes.len(),
        golden_log::digest(&bytes)
    );
}

// ---------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------

/// Given log-1 as pinned (its BLAKE3 and entry count: the golden log is unchanged), when
/// every entry is decoded by this build, then each re-encodes to its exact bytes, sits on
/// its aggregate's subject, carries a valid hash (over the raw bytes too), is in format 1,
/// every aggregate's chain verifies (the lost version's aggregate shows only its
/// acknowledged gap), and the events are the whole catalogue of log-1's day.
#[test]
fn golden_log_1_decodes_and_verifies() {
    bless_if_missing();
    // Given
    let entries = golden_log::open(log_1()).unwrap_or_else(|e| panic!("{e}"));
    // When
    let mut commits: Vec<Commit> = Vec::new();
    let subjects = JetStreamConfig::default();
    let mut formats: BTreeMap<u8, usize> = BTreeMap::new();
    for entry in &entries {
        let commit = codec::decode(&entry.payload, entry.position)
            .unwrap_or_else(|e| panic!("position {}: {e}", entry.position));
        // Then
        assert_eq!(
            codec::encode(&commit).unwrap(),
            entry.payload,
            "position {}: re-encoding",
            entry.position
        );
        assert_eq!(
            entry.subject,
            subjects.subject_for(&commit.aggregate),
            "position {}",
            entry.position
        );
        assert!(commit.hash_is_valid(), "position {}: hash", entry.position);
        let body = &entry.payload[1..entry.payload.len() - 32];
        assert_eq!(
            codec::envelope::hash_body("provledger.commit.v1", body),
            commit.hash,
            "position {}: the hash over the raw bytes",
            entry.position
        );
        *formats.entry(commit.format()).or_default() += 1;
        commits.push(commit);
    }
    assert_eq!(formats, BTreeMap::from([(FORMAT_1, entries.len())]));
    let mut by_aggregate: BTreeMap<AggregateId, Vec<Commit>> = BTreeMap::new();
    for commit in &commits {
        by_aggregate
            .entry(commit.aggregate)
            .or_default()
            .push(commit.clone());
    }
    let lost_on = AggregateId::provider(Uuid::from_u128(LOST_ON));
    for (aggregate, chain) in &by_aggregate {
        let violations = verify_chain(aggregate, chain);
        if *aggregate == lost_on {
            // Versions 1 and 3.. each verify; version 3 reveals the loss of version 2
            // (intact, past the next version), which version 4 acknowledges.
            assert_eq!(verify_chain(aggregate, &chain[..1]), vec![]);
            let loss = LostVersions::before(aggregate, 1, &chain[1]).expect("a loss");
            assert_eq!((loss.from_version, loss.to_version), (2, 2));
            assert!(loss.acknowledged_by(&chain[2].events[0]));
            for pair in chain[1..].windows(2) {
                assert_eq!(pair[1].version, pair[0].version + 1, "{aggregate}");
                assert_eq!(pair[1].prev_hash, pair[0].hash, "{aggregate}");
            }
            assert!(chain.iter().all(Commit::hash_is_valid));
            assert!(
                matches!(
                    violations.as_slice(),
                    [
                        ChainViolation::VersionGap {
                            expected: 2,
                            found: 3,
                            ..
                        },
                        ..
                    ]
                ),
                "{violations:?}"
            );
        } else {
            assert_eq!(violations, vec![], "{aggregate}");
        }
    }
    let names: BTreeSet<String> = commits
        .iter()
        .flat_map(|c| c.events.iter().map(|e| e.name().to_string()))
        .collect();
    let pinned: BTreeSet<String> = LOG_1_NAMES.iter().map(|n| n.to_string()).collect();
    assert_eq!(names, pinned, "log-1 holds exactly the events of its day");
}

/// Given every golden log, then every event of today's catalogue is in one of them: an
/// event appended to the catalogue needs the next log-N.bin (docs/events.md).
#[test]
fn every_event_is_in_a_golden_log() {
    bless_if_missing();
    let mut names = BTreeSet::new();
    for log in LOGS {
        for entry in golden_log::open(log).unwrap_or_else(|e| panic!("{e}")) {
            let commit = codec::decode(&entry.payload, entry.position).unwrap();
            names.extend(commit.events.iter().map(|e| e.name().to_string()));
        }
    }
    let missing: Vec<&String> = Event::names().difference(&names).collect();
    assert!(
        missing.is_empty(),
        "{missing:?} is in no golden log: write log-{} (docs/events.md, \"The golden log\")",
        LOGS.len() + 1
    );
}

/// Given the generator run twice, then it writes the same bytes: the log is a function of
/// the code above, not of the clock or the machine.
#[test]
fn the_generator_is_deterministic() {
    let once = golden_log::write(&entries(&generate())).unwrap();
    let twice = golden_log::write(&entries(&generate())).unwrap();
    assert_eq!(golden_log::digest(&once), golden_log::digest(&twice));
}
