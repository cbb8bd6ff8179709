//! Operations end to end, embedded on real sled files: for every stage of every shipped
//! operation kind, a failure injected into the simulated executors, then what is left in
//! the executors and in the projections after the rollback. Also a delete arriving at each
//! stage of a create, a compensation that keeps failing, a panicking step, and repeated
//! deletes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use provledger_client::deletion::{self, DeleteRequestOutcome};
use provledger_client::CancelNotices;
use provledger_client::Ledger;
use provledger_client::RollbackDriver;
use provledger_client::{OperationError, OperationRunner, OperationSpec, StepHook, StepOutput};
use provledger_events::catalogue::{
    BundlePolicy, ClusterStatus, CompensationAction, Effect, EffectKind, NodeGroupSpec,
    OperationKind, Origin, RollbackOutcome, VmState,
};
use provledger_events::{AggregateId, CommitDraft, Event, EventLog, Expectation, SledLog};
use provledger_projections::facts::rollback_target_fact_name;
use provledger_projections::operation::{OperationState, OperationStatus};
use provledger_projections::rollback::RetryPolicy;
use provledger_projections::stages::stage;
use provledger_projections::Entity;
use provledger_sim::SimInfrastructure;
use provledger_sim::{register_compute_node, ClusterRequest, InstanceRequest, Provisioner};
use uuid::Uuid;

const VCPU_PER_NODE: u64 = 2;

fn fast_retries() -> RetryPolicy {
    RetryPolicy {
        attempts_max: 3,
        backoff_base_ms: 5,
        backoff_max_ms: 20,
        reply_wait_ms: 2_000,
        runner_stop_wait_ms: 10_000,
    }
}

/// A step at which a hook fires: (stage, step name prefix).
type Trigger = Arc<Mutex<Option<(String, String)>>>;

struct World {
    ledger: provledger_client::Writer<Ledger>,
    infra: Arc<SimInfrastructure>,
    prov: Provisioner,
    provider: Uuid,
    notices: CancelNotices,
    /// When set, the delete of `delete_target` is requested just before this step.
    delete_at: Trigger,
    delete_target: Arc<Mutex<Option<AggregateId>>>,
    /// Last: fields drop in order, and the data dir must outlive every handle on the sled
    /// database in it (the last one flushes when dropped).
    _dir: tempfile::TempDir,
}

async fn world(vcpus: u64) -> World {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger =
        provledger_client::Writer::new(Ledger::Embedded(SledLog::open(dir.path()).expect("sled")));
    let infra = Arc::new(SimInfrastructure::default());
    let notices = CancelNotices::local();
    let driver = Arc::new(RollbackDriver::new(
        ledger.clone(),
        infra.clone(),
        fast_retries(),
        "test-driver",
    ));
    let delete_at: Trigger = Arc::new(Mutex::new(None));
    let delete_target: Arc<Mutex<Option<AggregateId>>> = Arc::new(Mutex::new(None));
    let hook: StepHook = {
        let (ledger, notices, delete_at, delete_target) = (
            ledger.clone(),
            notices.clone(),
            delete_at.clone(),
            delete_target.clone(),
        );
        Arc::new(move |_op, stage, step| {
            let (ledger, notices) = (ledger.clone(), notices.clone());
            let fire = {
                let mut at = delete_at.lock().unwrap();
                match &*at {
                    Some((s, prefix)) if *s == stage && step.starts_with(prefix.as_str()) => {
                        *at = None;
                        *delete_target.lock().unwrap()
                    }
                    _ => None,
                }
            };
            Box::pin(async move {
                if let Some(target) = fire {
                    deletion::request_delete(
                        &ledger,
                        &notices,
                        target,
                        "deleted by the user mid-create",
                        "test-user",
                        &provledger_client::Stamper::system(),
                    )
                    .await
                    .expect("delete request");
                }
            })
        })
    };
    let runner = OperationRunner::new(ledger.clone(), notices.clone(), Some(driver), "test")
        .with_step_hook(hook);
    let prov = Provisioner::new(runner, infra.clone(), "test");
    let provider = Uuid::now_v7();
    register_compute_node(&ledger, provider, "cn-1", vcpus, "test")
        .await
        .expect("provider");
    World {
        _dir: dir,
        ledger,
        infra,
        prov,
        provider,
        notices,
        delete_at,
        delete_target,
    }
}

fn group(count: u32) -> NodeGroupSpec {
    NodeGroupSpec {
        name: "workers".into(),
        count,
        flavor: "m1.medium".into(),
        resources: BTreeMap::from([("VCPU".to_string(), VCPU_PER_NODE)]),
        processes: vec!["datanode".into()],
    }
}

impl World {
    fn cluster_request(&self, nodes: u32) -> ClusterRequest {
        ClusterRequest {
            cluster_id: Uuid::now_v7(),
            name: "analytics".into(),
            plugin: "vanilla".into(),
            node_groups: vec![group(nodes)],
            provider: self.provider,
        }
    }

    async fn entity(&self, id: AggregateId) -> Option<Entity> {
        self.ledger.read_current(id).await.expect("read")
    }

    async fn cluster(&self, id: Uuid) -> provledger_projections::cluster::ClusterState {
        match self.entity(AggregateId::cluster(id)).await {
            Some(Entity::Cluster(c)) => *c,
            other => panic!("no cluster: {other:?}"),
        }
    }

    async fn operation(&self, id: Uuid) -> OperationState {
        match self.entity(AggregateId::operation(id)).await {
            Some(Entity::Operation(o)) => *o,
            other => panic!("no operation: {other:?}"),
        }
    }

    async fn allocations(&self) -> Vec<Uuid> {
        match self.entity(AggregateId::provider(self.provider)).await {
            Some(Entity::Provider(p)) => p.allocations.keys().copied().collect(),
            other => panic!("no provider: {other:?}"),
        }
    }

    async fn members(&self, cluster: Uuid) -> Vec<Uuid> {
        self.cluster(cluster)
            .await
            .node_groups
            .iter()
            .flat_map(|g| g.instance_ids.clone())
            .collect()
    }

    fn count(&self, executor: &str) -> usize {
        self.infra
            .executor(executor)
            .map(|e| e.resources().len())
            .unwrap_or(0)
    }

    fn delete_before(&self, cluster: Uuid, stage: &str, step: &str) {
        *self.delete_target.lock().unwrap() = Some(AggregateId::cluster(cluster));
        *self.delete_at.lock().unwrap() = Some((stage.into(), step.into()));
    }

    /// Every operation's anomalies, for asserting the log stayed clean.
    async fn assert_no_anomaly(&self, ids: &[AggregateId]) {
        for id in ids {
            if let Some(e) = self.entity(*id).await {
                assert_eq!(
                    e.header().anomaly_count,
                    0,
                    "{id}: {:?}",
                    e.header().anomalies
                );
            }
        }
    }
}

// ---- create cluster ----

#[tokio::test]
async fn create_failing_in_allocate_releases_the_claims_and_sets_error() {
    // Given room for one node of two,
    let w = world(VCPU_PER_NODE).await;
    let request = w.cluster_request(2);
    // when the create runs,
    let report = w.prov.create_cluster(request.clone()).await;
    // then the second claim failed, the first was released, nothing was created.
    assert!(
        matches!(report.result, Err(OperationError::StepFailed { ref stage, .. }) if stage == stage::ALLOCATE)
    );
    assert_eq!(report.status, Some(OperationStatus::RolledBack));
    assert!(w.allocations().await.is_empty());
    assert!(w.infra.inventory().is_empty());
    let cluster = w.cluster(request.cluster_id).await;
    assert_eq!(cluster.status, Some(ClusterStatus::Error));
    assert!(cluster.in_flight.is_none());
    w.assert_no_anomaly(&[
        AggregateId::cluster(request.cluster_id),
        AggregateId::operation(report.operation_id),
    ])
    .await;
}

#[tokio::test]
async fn create_failing_in_spawn_terminates_every_instance_and_keeps_the_record() {
    let w = world(64).await;
    w.infra.hypervisor.fail_call("create_vm", 3);
    let request = w.cluster_request(3);
    let report = w.prov.create_cluster(request.clone()).await;
    assert!(
        matches!(report.result, Err(OperationError::StepFailed { ref stage, .. }) if stage == stage::SPAWN)
    );
    assert_eq!(report.status, Some(OperationStatus::RolledBack));
    // Two VMs with IP, DHCP and DNS were created, and all of it is gone.
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
    // The failed create_vm's outcome is unknown: undone by its key, which the
    // hypervisor answers with nothing to undo.
    assert_eq!(w.infra.applied_total(), 9);
    assert_eq!(w.infra.hypervisor.nothing_to_undo(), 1);
    assert!(w.allocations().await.is_empty());
    let cluster = w.cluster(request.cluster_id).await;
    assert_eq!(cluster.status, Some(ClusterStatus::Error));
    assert!(
        cluster.status_description.contains("spawn"),
        "{}",
        cluster.status_description
    );
    assert!(w.members(request.cluster_id).await.is_empty());
    let op = w.operation(report.operation_id).await;
    assert_eq!(
        op.compensations.len(),
        12,
        "8 external + 3 allocation releases + the failed create_vm by its key"
    );
}

#[tokio::test]
async fn create_failing_in_configure_keeps_the_instances_and_sets_error() {
    let w = world(64).await;
    w.infra.plugin.fail_call("configure", 2);
    let request = w.cluster_request(2);
    let report = w.prov.create_cluster(request.clone()).await;
    assert_eq!(report.status, Some(OperationStatus::Held));
    assert_eq!(w.count("hypervisor"), 2, "no node deleted");
    assert_eq!(w.count("ipam"), 2);
    assert_eq!(w.allocations().await.len(), 2);
    assert_eq!(w.members(request.cluster_id).await.len(), 2);
    assert_eq!(
        w.cluster(request.cluster_id).await.status,
        Some(ClusterStatus::Error)
    );
    // Per node claim, VM, IP, DHCP, DNS; node 1's configuration (its plugin record,
    // whose `remove_node` compensation a holding stage keeps); and node 2's failed
    // configuration, whose outcome is unknown (kept for an operator, by its key).
    assert_eq!(report.plan.expect("plan").retained.len(), 12);
}

#[tokio::test]
async fn create_failing_in_start_keeps_the_instances_and_sets_error() {
    let w = world(64).await;
    w.infra.plugin.fail_call("start", 1);
    let request = w.cluster_request(2);
    let report = w.prov.create_cluster(request.clone()).await;
    assert_eq!(report.status, Some(OperationStatus::Held));
    assert_eq!(w.count("hypervisor"), 2);
    assert_eq!(w.allocations().await.len(), 2);
    assert_eq!(
        w.cluster(request.cluster_id).await.status,
        Some(ClusterStatus::Error)
    );
}

#[tokio::test]
async fn a_create_that_succeeds_leaves_an_active_cluster_and_no_plan() {
    let w = world(64).await;
    let request = w.cluster_request(3);
    let report = w.prov.create_cluster(request.clone()).await;
    assert_eq!(
        report.result.as_ref().ok().map(|n| n.len()),
        Some(3),
        "{:?}",
        report.result
    );
    assert_eq!(report.status, Some(OperationStatus::Succeeded));
    assert!(report.plan.is_none());
    let cluster = w.cluster(request.cluster_id).await;
    assert_eq!(cluster.status, Some(ClusterStatus::Active));
    assert!(cluster.in_flight.is_none());
    assert_eq!(w.count("hypervisor"), 3);
}

// ---- scale cluster ----

async fn active_cluster(w: &World, nodes: u32) -> (Uuid, Vec<Uuid>) {
    let request = w.cluster_request(nodes);
    let report = w.prov.create_cluster(request.clone()).await;
    (request.cluster_id, report.result.expect("created"))
}

#[tokio::test]
async fn a_scale_removing_more_nodes_than_the_group_has_fails_before_recording_anything() {
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 2).await;
    let before = w.cluster(cluster).await;
    // Given a group of 2, when 3 removals are asked for (one of them twice, one a stranger)...
    for remove in [
        vec![nodes[0], nodes[1], Uuid::from_u128(99)],
        vec![nodes[0], nodes[0], nodes[1]],
    ] {
        let report = w
            .prov
            .scale_cluster(cluster, "workers", remove, 0, w.provider)
            .await;
        // ...then the operation fails at reading with a typed error (not a panic, not an
        // impossible count), and the group is unchanged.
        assert!(
            matches!(
                &report.result,
                Err(provledger_client::OperationError::StepFailed { step, .. }) if step == "read"
            ),
            "{:?}",
            report.result
        );
        let after = w.cluster(cluster).await;
        assert_eq!(after.node_groups[0].count, before.node_groups[0].count);
        assert_eq!(w.members(cluster).await.len(), 2);
    }
}

#[tokio::test]
async fn scale_failing_in_decommission_sets_error_and_deletes_no_node() {
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 3).await;
    w.infra.plugin.fail_call("decommission", 2);
    let report = w
        .prov
        .scale_cluster(cluster, "workers", nodes[..2].to_vec(), 1, w.provider)
        .await;
    assert_eq!(report.status, Some(OperationStatus::Held));
    assert_eq!(w.count("hypervisor"), 3, "no node deleted");
    assert_eq!(w.members(cluster).await.len(), 3);
    assert_eq!(w.cluster(cluster).await.status, Some(ClusterStatus::Error));
    let plan = report.plan.expect("plan");
    assert_eq!(
        plan.retained.len(),
        1,
        "the decommissioned node is listed as kept"
    );
}

#[tokio::test]
async fn scale_failing_in_terminate_and_create_removes_new_nodes_finishes_removal_and_returns_active(
) {
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 3).await;
    // The second termination fails: node 0 is gone, node 1 is decommissioned only.
    w.infra.hypervisor.fail_call("terminate_vm", 2);
    let report = w
        .prov
        .scale_cluster(cluster, "workers", nodes[..2].to_vec(), 1, w.provider)
        .await;
    assert_eq!(report.status, Some(OperationStatus::RolledBack));
    let members = w.members(cluster).await;
    assert_eq!(members, vec![nodes[2]], "removal finished, no new node");
    assert_eq!(w.infra.hypervisor.resources(), vec![nodes[2].to_string()]);
    assert_eq!(w.allocations().await, vec![nodes[2]]);
    let c = w.cluster(cluster).await;
    assert_eq!(c.status, Some(ClusterStatus::Active));
    assert!(
        c.status_description.contains("terminate_and_create"),
        "{}",
        c.status_description
    );
    let plan = report.plan.expect("plan");
    assert!(plan
        .compensations
        .iter()
        .any(|p| p.compensation.action == CompensationAction::TerminateVm
            && p.compensation.resource == nodes[1].to_string()));
}

#[tokio::test]
async fn scale_failing_while_creating_a_new_node_deletes_it() {
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 2).await;
    w.infra.dns.fail_call("register", 2);
    let report = w
        .prov
        .scale_cluster(cluster, "workers", vec![], 2, w.provider)
        .await;
    assert_eq!(report.status, Some(OperationStatus::RolledBack));
    let mut members = w.members(cluster).await;
    members.sort();
    let mut before = nodes.clone();
    before.sort();
    assert_eq!(members, before);
    assert_eq!(w.count("hypervisor"), 2);
    assert_eq!(w.count("dns"), 2);
    assert_eq!(w.allocations().await.len(), 2);
    assert_eq!(w.cluster(cluster).await.status, Some(ClusterStatus::Active));
}

#[tokio::test]
async fn scale_failing_in_configure_new_keeps_the_new_nodes_and_sets_error() {
    let w = world(64).await;
    let (cluster, _) = active_cluster(&w, 2).await;
    w.infra.plugin.fail_call("configure", 1);
    let report = w
        .prov
        .scale_cluster(cluster, "workers", vec![], 1, w.provider)
        .await;
    assert_eq!(report.status, Some(OperationStatus::Held));
    assert_eq!(w.members(cluster).await.len(), 3);
    assert_eq!(w.count("hypervisor"), 3);
    assert_eq!(w.allocations().await.len(), 3);
    assert_eq!(w.cluster(cluster).await.status, Some(ClusterStatus::Error));
}

// ---- removed nodes leave nothing behind ----

/// What every executor holds for a node that exists: its VM, its plugin record, its DHCP
/// and DNS entries and its IP.
const HELD_PER_NODE: usize = 5;

fn assert_nothing_left(w: &World, removed: &[Uuid]) {
    for node in removed {
        assert_eq!(
            w.infra.held_for(node),
            Vec::<String>::new(),
            "removed node {node} left resources behind"
        );
    }
}

fn assert_all_held(w: &World, kept: &[Uuid]) {
    for node in kept {
        assert_eq!(
            w.infra.held_for(node).len(),
            HELD_PER_NODE,
            "kept node {node}: {:?}",
            w.infra.held_for(node)
        );
    }
}

#[tokio::test]
async fn a_scale_removing_two_nodes_and_adding_one_leaves_nothing_of_the_removed_nodes() {
    // Given an active cluster of three nodes,
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 3).await;
    // when a scale removes two of them and adds one,
    let report = w
        .prov
        .scale_cluster(cluster, "workers", nodes[..2].to_vec(), 1, w.provider)
        .await;
    // then it succeeded, no executor holds anything of the removed nodes, and the kept
    // and the new node hold all of theirs.
    let added = report.result.expect("scaled");
    assert_eq!(report.status, Some(OperationStatus::Succeeded));
    assert_nothing_left(&w, &nodes[..2]);
    assert_all_held(&w, &[nodes[2], added[0]]);
    // And each removal went plugin, DNS, DHCP, IP, then the VM (network and plugin before
    // the VM, so a failed termination leaves only the VM to the roll-forward).
    let op = w.operation(report.operation_id).await;
    let n0 = nodes[0].to_string();
    let order: Vec<String> = op
        .steps
        .iter()
        .filter(|s| s.name.ends_with(&n0))
        .map(|s| s.name.split(':').next().unwrap_or_default().to_string())
        .collect();
    assert_eq!(
        order,
        [
            "decommission",
            "remove_node",
            "unregister_dns",
            "unregister_dhcp",
            "release_ip",
            "terminate"
        ]
    );
}

/// A scale of three nodes removing two, whose `call`-th hypervisor termination fails.
async fn scale_failing_at_termination(call: u32) {
    // Given an active cluster of three nodes and a hypervisor that fails a termination,
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 3).await;
    w.infra.hypervisor.fail_call("terminate_vm", call);
    // when a scale removes two nodes and adds one,
    let report = w
        .prov
        .scale_cluster(cluster, "workers", nodes[..2].to_vec(), 1, w.provider)
        .await;
    // then it stopped in terminate_and_create and rolled forward: both removals are
    // finished, nothing of either node is left at any executor, the kept node keeps all.
    assert!(
        matches!(report.result, Err(OperationError::StepFailed { ref stage, .. }) if stage == stage::TERMINATE_AND_CREATE),
        "call {call}: {:?}",
        report.result
    );
    assert_eq!(
        report.status,
        Some(OperationStatus::RolledBack),
        "call {call}"
    );
    assert_nothing_left(&w, &nodes[..2]);
    assert_all_held(&w, &[nodes[2]]);
    assert_eq!(w.members(cluster).await, vec![nodes[2]], "call {call}");
    assert_eq!(w.allocations().await, vec![nodes[2]], "call {call}");
    assert_eq!(w.cluster(cluster).await.status, Some(ClusterStatus::Active));
    // The plan terminates the failed node's VM; only a node whose removal never started
    // has its plugin record, DNS, DHCP and IP planned (the other's were removed forward).
    let plan = report.plan.expect("plan");
    let planned_for = |node: Uuid| -> Vec<String> {
        plan.compensations
            .iter()
            .filter(|p| p.step == format!("decommission:{node}"))
            .map(|p| provledger_projections::planner::action_word(&p.compensation.action))
            .collect()
    };
    let failed = nodes[call as usize - 1];
    assert_eq!(
        planned_for(failed),
        ["terminate_vm", "release_allocation"],
        "call {call}"
    );
    if call == 1 {
        assert_eq!(
            planned_for(nodes[1]),
            [
                "terminate_vm",
                "remove_node",
                "unregister_dns",
                "unregister_dhcp",
                "release_ip",
                "release_allocation"
            ]
        );
    }
}

#[tokio::test]
async fn scale_failing_at_the_first_termination_rolls_forward_and_leaves_nothing_of_both_nodes() {
    // Node 1's VM termination fails after its network and plugin record were removed;
    // node 2's removal never started: the roll-forward removes all of it.
    scale_failing_at_termination(1).await;
}

#[tokio::test]
async fn scale_failing_at_the_second_termination_rolls_forward_and_leaves_nothing_of_both_nodes() {
    // Node 1 is removed; node 2's VM termination fails after the rest of it was removed.
    scale_failing_at_termination(2).await;
}

#[tokio::test]
async fn scale_failing_in_decommission_keeps_every_nodes_resources() {
    // Given an active cluster of three nodes and a plugin that fails the second
    // decommission,
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 3).await;
    w.infra.plugin.fail_call("decommission", 2);
    // when a scale removes two nodes,
    let report = w
        .prov
        .scale_cluster(cluster, "workers", nodes[..2].to_vec(), 1, w.provider)
        .await;
    // then the stage holds: every node keeps everything, and no compensation ran.
    assert_eq!(report.status, Some(OperationStatus::Held));
    assert_all_held(&w, &nodes);
    assert_eq!(w.infra.applied_total(), 0);
    assert_eq!(w.members(cluster).await.len(), 3);
}

// ---- delete ----

#[tokio::test]
async fn delete_of_an_active_cluster_removes_everything_and_a_repeat_says_so() {
    let w = world(64).await;
    let (cluster, _) = active_cluster(&w, 3).await;
    let report = w
        .prov
        .delete_cluster(cluster, "user request")
        .await
        .expect("delete");
    assert_eq!(report.request, DeleteRequestOutcome::Requested);
    assert!(report.deleted);
    assert_eq!(
        w.cluster(cluster).await.status,
        Some(ClusterStatus::Deleted)
    );
    assert_eq!(w.count("hypervisor"), 0);
    assert!(w.allocations().await.is_empty());
    let again = w
        .prov
        .delete_cluster(cluster, "user request")
        .await
        .expect("delete");
    assert_eq!(again.request, DeleteRequestOutcome::AlreadyDeleted);
    let unknown = w
        .prov
        .delete_cluster(Uuid::now_v7(), "typo")
        .await
        .expect("delete");
    assert_eq!(unknown.request, DeleteRequestOutcome::Unknown);
}

async fn delete_during_create(stage_name: &str, step_prefix: &str) {
    let w = world(64).await;
    let request = w.cluster_request(3);
    w.delete_before(request.cluster_id, stage_name, step_prefix);
    let report = w.prov.create_cluster(request.clone()).await;
    // The runner stopped with the typed error and the operation closed as cancelled.
    assert!(
        matches!(report.result, Err(OperationError::TargetDeleted { .. })),
        "{stage_name}: {:?}",
        report.result
    );
    assert_eq!(
        report.status,
        Some(OperationStatus::Cancelled),
        "{stage_name}"
    );
    let op = w.operation(report.operation_id).await;
    assert!(op.target_deleted);
    // Everything it created was compensated, data-holding nodes included.
    assert!(
        w.infra.inventory().is_empty(),
        "{stage_name}: {:?}",
        w.infra.inventory()
    );
    assert_eq!(
        w.cluster(request.cluster_id).await.status,
        Some(ClusterStatus::Deleting)
    );
    // Finishing the delete (a repeat of the request) removes whatever remains.
    let finish = w
        .prov
        .delete_cluster(request.cluster_id, "again")
        .await
        .expect("delete");
    assert_eq!(finish.request, DeleteRequestOutcome::AlreadyDeleting);
    assert!(finish.deleted, "{stage_name}");
    assert!(w.infra.hypervisor.resources().is_empty(), "{stage_name}");
    assert!(w.infra.ipam.resources().is_empty(), "{stage_name}");
    assert!(w.infra.dns.resources().is_empty(), "{stage_name}");
    assert!(w.allocations().await.is_empty(), "{stage_name}");
    assert_eq!(
        w.cluster(request.cluster_id).await.status,
        Some(ClusterStatus::Deleted)
    );
    // A later attempt to revive it is refused with the typed error.
    let revive = w
        .prov
        .scale_cluster(request.cluster_id, "workers", vec![], 1, w.provider)
        .await;
    assert!(
        matches!(revive.result, Err(OperationError::TargetDeleted { .. })),
        "{:?}",
        revive.result
    );
}

#[tokio::test]
async fn delete_arriving_in_allocate_cancels_the_create() {
    delete_during_create(stage::ALLOCATE, "claim:").await;
}

#[tokio::test]
async fn delete_arriving_in_spawn_cancels_the_create() {
    delete_during_create(stage::SPAWN, "register_dns:").await;
}

#[tokio::test]
async fn delete_arriving_in_configure_cancels_the_create_and_removes_data_nodes() {
    delete_during_create(stage::CONFIGURE, "configure:").await;
}

#[tokio::test]
async fn delete_arriving_in_start_cancels_the_create() {
    delete_during_create(stage::START, "start:").await;
}

#[tokio::test]
async fn delete_of_an_active_cluster_leaves_nothing_of_its_nodes_at_any_executor() {
    // Given an active cluster of three nodes,
    let w = world(64).await;
    let (cluster, nodes) = active_cluster(&w, 3).await;
    assert_all_held(&w, &nodes);
    // when it is deleted,
    let report = w
        .prov
        .delete_cluster(cluster, "user request")
        .await
        .expect("delete");
    // then no executor holds anything of any node.
    assert!(report.deleted);
    assert_nothing_left(&w, &nodes);
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
}

#[tokio::test]
async fn delete_arriving_in_start_removes_the_plugin_records_of_the_configured_nodes() {
    // Given a create of three nodes, deleted by the user once all are configured (just
    // before the first start),
    let w = world(64).await;
    let request = w.cluster_request(3);
    w.delete_before(request.cluster_id, stage::START, "start:");
    // when the create runs,
    let report = w.prov.create_cluster(request.clone()).await;
    assert_eq!(report.status, Some(OperationStatus::Cancelled));
    let op = w.operation(report.operation_id).await;
    let nodes: Vec<Uuid> = op
        .steps
        .iter()
        .filter(|s| s.effect.kind == EffectKind::VmCreated)
        .map(|s| s.effect.resource.parse().expect("a node id"))
        .collect();
    assert_eq!(nodes.len(), 3);
    // then its rollback removed everything of every node, the plugin's records included,
    assert_nothing_left(&w, &nodes);
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
    // each node's plugin record before its network and its VM,
    let plan = report.plan.expect("plan");
    for node in &nodes {
        let at = |action: CompensationAction| {
            plan.compensations
                .iter()
                .position(|p| {
                    p.compensation.action == action
                        && p.step.ends_with(&node.to_string())
                        && (p.compensation.resource.contains(&node.to_string()))
                })
                .unwrap_or_else(|| panic!("{action:?} of {node} not planned"))
        };
        let plugin = at(CompensationAction::Custom("remove_node".into()));
        assert!(plugin < at(CompensationAction::UnregisterDns));
        assert!(plugin < at(CompensationAction::TerminateVm));
    }
    // and finishing the delete leaves it so.
    let finish = w
        .prov
        .delete_cluster(request.cluster_id, "again")
        .await
        .expect("delete");
    assert!(finish.deleted);
    assert_nothing_left(&w, &nodes);
}

// ---- boot instance and bundles ----

fn instance_request(w: &World, vcpus: u64) -> InstanceRequest {
    InstanceRequest {
        instance_id: Uuid::now_v7(),
        name: "vm".into(),
        resources: BTreeMap::from([("VCPU".to_string(), vcpus)]),
        provider: w.provider,
    }
}

async fn boot_fails(w: &World, request: InstanceRequest) {
    let report = w.prov.boot_instance(request.clone(), None).await;
    assert!(report.result.is_err());
    assert_eq!(report.status, Some(OperationStatus::RolledBack));
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
    assert!(w.allocations().await.is_empty());
    match w.entity(AggregateId::instance(request.instance_id)).await {
        Some(Entity::Instance(i)) => assert_eq!(i.vm_state, Some(VmState::Error)),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn boot_failing_in_schedule_sets_error() {
    let w = world(4).await;
    let request = instance_request(&w, 8);
    boot_fails(&w, request).await;
}

#[tokio::test]
async fn boot_failing_in_network_releases_the_ip_and_the_dhcp_record() {
    let w = world(64).await;
    w.infra.dns.fail_call("register", 1);
    boot_fails(&w, instance_request(&w, 2)).await;
    assert_eq!(
        w.infra.applied_total(),
        3,
        "the failed DNS registration by its key, then DHCP and IP, in that order"
    );
    assert_eq!(w.infra.dns.nothing_to_undo(), 1, "DNS never registered it");
}

#[tokio::test]
async fn boot_failing_in_spawn_undoes_the_network_and_the_claim() {
    let w = world(64).await;
    w.infra.hypervisor.fail_call("create_vm", 1);
    boot_fails(&w, instance_request(&w, 2)).await;
    assert_eq!(w.infra.applied_total(), 4);
    assert_eq!(w.infra.hypervisor.nothing_to_undo(), 1);
}

#[tokio::test]
async fn bundle_rolling_back_siblings_removes_them_all() {
    let w = world(64).await;
    w.infra.ipam.fail_call("acquire_ip", 3);
    let children = (0..3).map(|_| instance_request(&w, 2)).collect();
    let report = w
        .prov
        .bundle(BundlePolicy::RollBackSiblings, children)
        .await;
    assert_eq!(report.status, Some(OperationStatus::RolledBack));
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
    assert!(w.allocations().await.is_empty());
}

#[tokio::test]
async fn bundle_retaining_siblings_keeps_them() {
    let w = world(64).await;
    w.infra.ipam.fail_call("acquire_ip", 3);
    let children = (0..3).map(|_| instance_request(&w, 2)).collect();
    let report = w.prov.bundle(BundlePolicy::RetainSiblings, children).await;
    assert_eq!(report.status, Some(OperationStatus::Held));
    assert_eq!(w.count("hypervisor"), 2);
    assert_eq!(w.allocations().await.len(), 2);
}

// ---- the one place errors are caught ----

#[tokio::test]
async fn a_compensation_that_keeps_failing_ends_in_needs_attention_with_what_remains() {
    let w = world(64).await;
    w.infra.hypervisor.fail_call("create_vm", 2);
    w.infra.ipam.fail_compensations(1_000);
    let request = w.cluster_request(2);
    let report = w.prov.create_cluster(request.clone()).await;
    assert_eq!(report.status, Some(OperationStatus::NeedsAttention));
    let op = w.operation(report.operation_id).await;
    assert!(!op.remaining.is_empty());
    let stuck = &op
        .compensations
        .iter()
        .find(|c| c.planned.compensation_id == op.remaining[0])
        .expect("listed");
    assert_eq!(stuck.attempts, fast_retries().attempts_max);
    assert_eq!(
        stuck.planned.compensation.action,
        CompensationAction::ReleaseIp
    );
    let c = w.cluster(request.cluster_id).await;
    assert_eq!(c.status, Some(ClusterStatus::Error));
    assert!(
        c.status_description.contains("needs attention"),
        "{}",
        c.status_description
    );
}

#[tokio::test]
async fn a_boot_whose_rollback_needed_attention_leaves_no_task_and_no_host_once_resumed() {
    let w = world(64).await;
    // Given a boot that failed in spawn and whose rollback needs attention (the IP's
    // release keeps failing), its instance in error and still on its host...
    w.infra.hypervisor.fail_call("create_vm", 1);
    w.infra.ipam.fail_compensations(1_000);
    let request = instance_request(&w, 2);
    let instance = AggregateId::instance(request.instance_id);
    let report = w.prov.boot_instance(request, None).await;
    assert_eq!(report.status, Some(OperationStatus::NeedsAttention));
    let op = report.operation_id;
    let Some(Entity::Instance(i)) = w.entity(instance).await else {
        panic!("no instance");
    };
    assert_eq!((i.vm_state, &i.in_flight), (Some(VmState::Error), &None));
    assert!(i.host.is_some() && i.task_state.is_some(), "{i:?}");
    // ...when the IPAM works again and an operator resumes the rollback...
    w.infra.ipam.fail_compensations(0);
    let resumed = provledger_client::resume_needs_attention(
        &w.ledger,
        op,
        "IPAM fixed",
        "test-operator",
        &provledger_client::Stamper::system(),
    )
    .await
    .expect("resume");
    assert!(resumed);
    let driver = RollbackDriver::new(w.ledger.clone(), w.infra.clone(), fast_retries(), "d");
    let state = driver.drive(op).await.expect("drive");
    // ...then it rolls back, and the instance has no build task and no host: both ends
    // of the rollback are on the instance, each its own commit
    assert_eq!(state.status, Some(OperationStatus::RolledBack));
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
    assert!(w.allocations().await.is_empty());
    let Some(Entity::Instance(i)) = w.entity(instance).await else {
        panic!("no instance");
    };
    assert_eq!(i.vm_state, Some(VmState::Error));
    assert_eq!(
        (i.task_state, i.host.as_deref(), i.provider_id, i.in_flight),
        (None, None, None, None)
    );
    let ends = w
        .ledger
        .log()
        .read_aggregate(instance)
        .await
        .expect("read")
        .iter()
        .filter(|c| {
            c.events
                .iter()
                .any(|e| matches!(e, Event::InFlightOperationCleared { .. }))
        })
        .count();
    assert_eq!(ends, 2, "needs_attention, then rolled_back");
    w.assert_no_anomaly(&[instance, AggregateId::operation(op)])
        .await;
}

#[tokio::test]
async fn a_panicking_step_is_caught_recorded_and_rolled_back() {
    let w = world(64).await;
    let instance = Uuid::now_v7();
    let spec = OperationSpec::new(OperationKind::BootInstance, AggregateId::instance(instance))
        .creating(vec![Event::InstanceCreateRequested {
            name: "p".into(),
            cluster_id: None,
            node_group: None,
            flavor: "f".into(),
            resources: BTreeMap::new(),
            image: "i".into(),
        }]);
    let infra = w.infra.clone();
    let report: provledger_client::RunReport<()> = w
        .prov
        .runner
        .run(spec, |ctx| async move {
            ctx.stage(stage::NETWORK).await?;
            ctx.step("acquire_ip", async {
                let ip = provledger_client::Infrastructure::acquire_ip(&*infra, "p", "").await?;
                Ok(StepOutput::with_effect(
                    (),
                    Effect {
                        kind: EffectKind::IpAcquired,
                        resource: ip.clone(),
                        executor: "ipam".into(),
                        origin: Origin::Created,
                        detail: BTreeMap::new(),
                    },
                    Some(provledger_events::catalogue::Compensation {
                        action: CompensationAction::ReleaseIp,
                        executor: provledger_events::catalogue::Executor::Service("ipam".into()),
                        resource: ip,
                        args: BTreeMap::new(),
                    }),
                ))
            })
            .await?;
            ctx.step::<(), _>("boom", async { panic!("driver bug") })
                .await?;
            Ok(())
        })
        .await;
    assert!(
        matches!(report.result, Err(OperationError::Panicked { ref message, .. }) if message == "driver bug")
    );
    assert_eq!(report.status, Some(OperationStatus::RolledBack));
    assert!(w.infra.ipam.resources().is_empty());
    let op = w.operation(report.operation_id).await;
    assert_eq!(op.error.expect("error").step.as_deref(), Some("boom"));
}

#[tokio::test]
async fn a_status_change_to_active_after_deleting_is_refused_with_a_typed_error() {
    let w = world(64).await;
    let (cluster, _) = active_cluster(&w, 1).await;
    deletion::request_delete(
        &w.ledger,
        &w.notices,
        AggregateId::cluster(cluster),
        "bye",
        "t",
        &provledger_client::Stamper::system(),
    )
    .await
    .expect("delete");
    let spec = OperationSpec::new(OperationKind::ScaleCluster, AggregateId::cluster(cluster));
    let report: provledger_client::RunReport<()> =
        w.prov.runner.run(spec, |_ctx| async { Ok(()) }).await;
    assert!(
        matches!(report.result, Err(OperationError::TargetDeleted { .. })),
        "{:?}",
        report.result
    );
    assert_eq!(
        w.cluster(cluster).await.status,
        Some(ClusterStatus::Deleting)
    );
}

#[tokio::test]
async fn delete_arriving_during_a_boot_cancels_it_and_deletes_the_instance() {
    let w = world(64).await;
    let request = instance_request(&w, 2);
    let instance = request.instance_id;
    // The user deletes the instance just before its VM is created.
    *w.delete_target.lock().unwrap() = Some(AggregateId::instance(instance));
    *w.delete_at.lock().unwrap() = Some((stage::SPAWN.into(), "create_vm:".into()));
    let report = w.prov.boot_instance(request, None).await;
    assert!(
        matches!(report.result, Err(OperationError::TargetDeleted { .. })),
        "{:?}",
        report.result
    );
    assert_eq!(report.status, Some(OperationStatus::Cancelled));
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
    let delete = w
        .prov
        .delete_instance(instance, "user")
        .await
        .expect("delete");
    assert!(delete.deleted, "{delete:?}");
    assert!(w.infra.hypervisor.resources().is_empty());
    assert!(w.allocations().await.is_empty());
    match w.entity(AggregateId::instance(instance)).await {
        Some(Entity::Instance(i)) => assert_eq!(i.vm_state, Some(VmState::Deleted)),
        other => panic!("{other:?}"),
    }
    let again = w
        .prov
        .delete_instance(instance, "user")
        .await
        .expect("delete");
    assert_eq!(again.request, DeleteRequestOutcome::AlreadyDeleted);
}

#[tokio::test]
async fn a_cancellation_whose_runner_died_is_recorded_by_the_driver_and_rolled_back() {
    // Given an operation whose runner acquired an IP and then died, and a delete that
    // asked it to stop,
    let w = world(64).await;
    let op = Uuid::now_v7();
    let ip = provledger_client::Infrastructure::acquire_ip(&*w.infra, "orphan", "")
        .await
        .expect("ip");
    let events = vec![
        Event::OperationStarted {
            kind: OperationKind::BootInstance,
            target: AggregateId::instance(Uuid::now_v7()),
            parent_id: None,
            stages: provledger_projections::stages::stages_of(OperationKind::BootInstance),
            bundle_policy: None,
        },
        Event::StageStarted {
            stage: stage::NETWORK.into(),
        },
        Event::StepDone {
            stage: stage::NETWORK.into(),
            step: "acquire_ip".into(),
            effect: Effect {
                kind: EffectKind::IpAcquired,
                resource: ip.clone(),
                executor: "ipam".into(),
                origin: Origin::Created,
                detail: BTreeMap::new(),
            },
            compensation: Some(provledger_events::catalogue::Compensation {
                action: CompensationAction::ReleaseIp,
                executor: provledger_events::catalogue::Executor::Service("ipam".into()),
                resource: ip.clone(),
                args: BTreeMap::new(),
            }),
        },
        Event::TargetDeletionNoticed {
            reason: "deleted".into(),
        },
    ];
    w.ledger
        .log()
        .append(
            AggregateId::operation(op),
            Expectation::NoStream,
            CommitDraft::now("dead-runner", events),
        )
        .await
        .expect("append");
    // when a driver finds it quiet for longer than the runner stop wait,
    let policy = RetryPolicy {
        runner_stop_wait_ms: 50,
        ..fast_retries()
    };
    let driver = RollbackDriver::new(w.ledger.clone(), w.infra.clone(), policy, "test");
    let state = driver.drive(op).await.expect("drive");
    // then it records the cancellation, and the rollback releases the IP.
    assert_eq!(state.status, Some(OperationStatus::Cancelled));
    assert!(state.cancelled);
    assert!(!w.infra.ipam.has(&ip));
}

#[tokio::test]
async fn a_rollback_whose_driver_crashed_after_the_target_outcome_is_finished_by_the_next() {
    let w = world(64).await;
    // Given a create that failed with nobody driving its rollback (a runner without a
    // driver, as in a service that leaves rollbacks to serve)...
    let runner = OperationRunner::new(w.ledger.clone(), w.notices.clone(), None, "test");
    let prov = Provisioner::new(runner, w.infra.clone(), "test");
    w.infra.hypervisor.fail_call("create_vm", 2);
    let request = w.cluster_request(2);
    let report = prov.create_cluster(request.clone()).await;
    assert_eq!(report.status, Some(OperationStatus::Failed));
    let op = report.operation_id;
    // ...and a driver that recorded the target's outcome under its derived commit id and
    // crashed before `rollback_finished` (its wording differs from what a driver would
    // write now, since the target's state has changed since)...
    let cluster = AggregateId::cluster(request.cluster_id);
    let mut draft = CommitDraft::now(
        "crashed-replica",
        vec![
            Event::ClusterStatusChanged {
                status: ClusterStatus::Error,
                description: "create failed (written by a replica that then crashed)".into(),
            },
            Event::InFlightOperationCleared {
                operation_id: op,
                outcome: provledger_events::catalogue::OperationOutcome::RolledBack,
            },
        ],
    )
    .with_operation(op);
    let name = rollback_target_fact_name(&w.operation(op).await, RollbackOutcome::RolledBack);
    draft.commit_id = provledger_client::derived_commit_id(op, &name);
    w.ledger
        .log()
        .append(cluster, Expectation::Any, draft)
        .await
        .expect("the crashed driver's outcome");
    // ...when another driver takes the operation over...
    let driver = RollbackDriver::new(
        w.ledger.clone(),
        w.infra.clone(),
        fast_retries(),
        "second-replica",
    );
    let state = driver.drive(op).await.expect("resumes, no CommitIdReused");
    // ...then it finishes: the outcome already recorded counts as recorded.
    assert_eq!(state.status, Some(OperationStatus::RolledBack));
    assert!(state.is_closed());
    assert!(w.infra.inventory().is_empty(), "{:?}", w.infra.inventory());
    let outcome_commits = w
        .ledger
        .log()
        .read_aggregate(cluster)
        .await
        .unwrap()
        .iter()
        .filter(|c| c.commit_id == provledger_client::derived_commit_id(op, &name))
        .count();
    assert_eq!(outcome_commits, 1);
}

/// Every point at which a create's runner can die between an executor's action and the
/// record of its outcome: (executor, action as the executor counts it, 1-based call).
const CRASH_POINTS: [(&str, &str, u32); 12] = [
    ("hypervisor", "create_vm", 1),
    ("hypervisor", "create_vm", 2),
    ("ipam", "acquire_ip", 1),
    ("ipam", "acquire_ip", 2),
    ("dhcp", "register", 1),
    ("dhcp", "register", 2),
    ("dns", "register", 1),
    ("dns", "register", 2),
    ("plugin", "configure", 1),
    ("plugin", "configure", 2),
    ("plugin", "start", 1),
    ("plugin", "start", 2),
];

/// Given a two-node create whose runner dies (its future dropped, as kill -9 would)
/// right after an executor acted and before the step's outcome was recorded, at each such
/// point; when the user deletes the cluster and a driver, finding the runner silent,
/// rolls the operation back; then nothing is left at any executor: the action whose
/// outcome the ledger never learnt was undone by its idempotency key.
#[tokio::test]
async fn a_runner_dying_between_an_action_and_its_record_leaves_nothing_behind() {
    for (executor, action, call) in CRASH_POINTS {
        let w = world(64).await;
        let at = w.infra.executor(executor).expect("executor");
        at.crash_after_call(action, call);
        let request = w.cluster_request(2);
        let cluster = request.cluster_id;
        let prov = w.prov.clone();
        let run = tokio::spawn(async move { prov.create_cluster(request).await });
        for _ in 0..5_000 {
            if at.crashed() > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert_eq!(at.crashed(), 1, "{executor} {action} #{call}: no crash");
        run.abort(); // the runner's process is gone
        let _ = run.await;
        let held_before = w.infra.inventory();
        assert!(!held_before.is_empty());

        let op = match w.entity(AggregateId::cluster(cluster)).await {
            Some(Entity::Cluster(c)) => c.in_flight.expect("the create is in flight").operation_id,
            other => panic!("no cluster: {other:?}"),
        };
        let open = w.operation(op).await.started;
        assert_eq!(
            open.len(),
            1,
            "{executor} {action} #{call}: one outcome unknown"
        );
        deletion::request_delete(
            &w.ledger,
            &w.notices,
            AggregateId::cluster(cluster),
            "deleted by the user after the service died",
            "test-user",
            &provledger_client::Stamper::system(),
        )
        .await
        .expect("delete request");
        let driver = RollbackDriver::new(
            w.ledger.clone(),
            w.infra.clone(),
            RetryPolicy {
                runner_stop_wait_ms: 0,
                ..fast_retries()
            },
            "restarted-driver",
        );
        let state = driver.drive(op).await.expect("drive");
        assert_eq!(
            state.status,
            Some(OperationStatus::Cancelled),
            "{executor} {action} #{call}"
        );
        assert!(
            w.infra.inventory().is_empty(),
            "{executor} {action} #{call}: left {:?} (held before: {held_before:?})",
            w.infra.inventory()
        );
        assert_eq!(
            at.nothing_to_undo(),
            0,
            "{executor} {action} #{call}: the undo by key found what was done"
        );
        assert!(w.allocations().await.is_empty());
    }
}

/// Given an executor asked to undo by key an action it never carried out (the runner was
/// presumed dead), when that runner's late action under the same key arrives, then the
/// executor refuses it: nothing appears after the rollback that nothing would undo.
#[tokio::test]
async fn an_action_under_an_idempotency_key_already_undone_is_refused() {
    use provledger_client::{CompensationExecutor, CompensationRequest, Infrastructure};
    let infra = SimInfrastructure::default();
    let key = "6f9d2c4e-0000-4000-8000-000000000001";
    let request = CompensationRequest {
        operation_id: Uuid::now_v7(),
        compensation_id: Uuid::now_v7(),
        attempt: 1,
        action: CompensationAction::TerminateVm,
        resource: "vm-late".into(),
        args: BTreeMap::from([("idempotency_key".to_string(), key.to_string())]),
        trace: None,
    };
    infra
        .compensate("hypervisor", &request)
        .await
        .expect("nothing to undo is done");
    assert_eq!(infra.hypervisor.nothing_to_undo(), 1);
    let late = infra.act("hypervisor", "create_vm", "vm-late", key).await;
    assert!(late.is_err(), "{late:?}");
    assert!(!infra.hypervisor.has("vm-late"));
    // The fence is the executor's own: IPAM, never asked, still acts under that key.
    assert!(infra.acquire_ip("node-late", key).await.is_ok());
}
