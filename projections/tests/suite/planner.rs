//! The rollback planner, as given an operation's events / when it is planned / then this
//! plan. Each plan is pinned as a snapshot (`tests/snapshots/`), one per stage of each
//! shipped operation kind, covering every case of design brief section 3: Sahara's create
//! and scale rules, the delete that rolls forward, ManageIQ's boot with IP, DHCP and DNS,
//! bundles that roll back or retain their siblings, cancellation by deletion, and the
//! safety rules (discovered resources, nodes that may hold data).

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    BundlePolicy, Compensation, CompensationAction, Effect, EffectKind, Executor, OperationKind,
    Origin, RollbackOutcome, StagePolicy, StageSpec, TargetOutcome,
};
use provledger_events::{AggregateId, Event};
use provledger_projections::operation::OperationState;
use provledger_projections::planner::{
    action_word, plan_rollback, render_plan, PlanRefusal, REMOVAL_DETAIL,
};
use provledger_projections::rollback::{next_rollback_action, RetryPolicy, RollbackAction};
use provledger_projections::stages::{stage, stages_of};
use provledger_projections::{Entity, Projection};
use provledger_tests::script::{self, ScriptStep};
use uuid::Uuid;

const PROVIDER: u128 = 0xC0;

fn node(n: u128) -> String {
    Uuid::from_u128(0x100 + n).to_string()
}

/// Given an operation's events, one commit each.
struct GivenOperation {
    id: Uuid,
    target: AggregateId,
    steps: Vec<ScriptStep>,
}

impl GivenOperation {
    fn start(kind: OperationKind) -> Self {
        Self::start_with(kind, stages_of(kind), None)
    }

    fn start_with(
        kind: OperationKind,
        stages: Vec<StageSpec>,
        bundle: Option<BundlePolicy>,
    ) -> Self {
        let id = Uuid::from_u128(0x0B + kind as u128);
        let target = match kind {
            OperationKind::BootInstance => AggregateId::instance(Uuid::from_u128(0xAA)),
            OperationKind::Bundle => AggregateId::operation(id),
            _ => AggregateId::cluster(Uuid::from_u128(0xCC)),
        };
        let mut given = GivenOperation {
            id,
            target,
            steps: Vec::new(),
        };
        given.event(Event::OperationStarted {
            kind,
            target,
            parent_id: None,
            stages,
            bundle_policy: bundle,
        });
        given
    }

    fn with_id(mut self, id: u128) -> Self {
        let new = AggregateId::operation(Uuid::from_u128(id));
        for (aggregate, events) in &mut self.steps {
            *aggregate = new;
            for e in events.iter_mut() {
                if let Event::OperationStarted { target, .. } = e {
                    if target.kind == provledger_events::AggregateKind::Operation {
                        *target = new;
                    }
                }
            }
        }
        self.id = new.id;
        self
    }

    fn event(&mut self, event: Event) -> &mut Self {
        self.steps
            .push((AggregateId::operation(self.id), vec![event]));
        self
    }

    fn stage(mut self, name: &str) -> Self {
        self.event(Event::StageStarted { stage: name.into() });
        self
    }

    fn complete(mut self, name: &str) -> Self {
        self.event(Event::StageCompleted { stage: name.into() });
        self
    }

    fn step(mut self, stage: &str, name: &str, effect: Effect, c: Option<Compensation>) -> Self {
        self.event(Event::StepDone {
            stage: stage.into(),
            step: name.into(),
            effect,
            compensation: c,
        });
        self
    }

    fn effect(kind: EffectKind, resource: &str, executor: &str) -> Effect {
        Effect {
            kind,
            resource: resource.into(),
            executor: executor.into(),
            origin: Origin::Created,
            detail: BTreeMap::new(),
        }
    }

    fn undo(action: CompensationAction, executor: Executor, resource: &str) -> Compensation {
        Compensation {
            action,
            executor,
            resource: resource.into(),
            args: BTreeMap::new(),
        }
    }

    fn claim(self, stage: &str, n: u128) -> Self {
        let consumer = node(n);
        let mut undo = Self::undo(
            CompensationAction::ReleaseAllocation,
            Executor::Ledger,
            &consumer,
        );
        undo.args
            .insert("provider_id".into(), Uuid::from_u128(PROVIDER).to_string());
        self.step(
            stage,
            &format!("claim:{n}"),
            Self::effect(EffectKind::AllocationClaimed, &consumer, "ledger"),
            Some(undo),
        )
    }

    fn vm(self, stage: &str, n: u128) -> Self {
        let vm = node(n);
        self.step(
            stage,
            &format!("create_vm:{n}"),
            Self::effect(EffectKind::VmCreated, &vm, "hypervisor"),
            Some(Self::undo(
                CompensationAction::TerminateVm,
                Executor::Service("hypervisor".into()),
                &vm,
            )),
        )
    }

    fn ip(self, stage: &str, n: u128) -> Self {
        let ip = format!("10.0.0.{n}");
        self.step(
            stage,
            &format!("acquire_ip:{n}"),
            Self::effect(EffectKind::IpAcquired, &ip, "ipam"),
            Some(Self::undo(
                CompensationAction::ReleaseIp,
                Executor::Service("ipam".into()),
                &ip,
            )),
        )
    }

    fn dhcp(self, stage: &str, n: u128) -> Self {
        let name = format!("node-{n}");
        self.step(
            stage,
            &format!("register_dhcp:{n}"),
            Self::effect(EffectKind::DhcpRegistered, &name, "dhcp"),
            Some(Self::undo(
                CompensationAction::UnregisterDhcp,
                Executor::Service("dhcp".into()),
                &name,
            )),
        )
    }

    fn dns(self, stage: &str, n: u128) -> Self {
        let name = format!("node-{n}.example");
        self.step(
            stage,
            &format!("register_dns:{n}"),
            Self::effect(EffectKind::DnsRegistered, &name, "dns"),
            Some(Self::undo(
                CompensationAction::UnregisterDns,
                Executor::Service("dns".into()),
                &name,
            )),
        )
    }

    fn configured(self, stage: &str, n: u128) -> Self {
        self.step(
            stage,
            &format!("configure:{n}"),
            Self::effect(EffectKind::NodeConfigured, &node(n), "plugin"),
            None,
        )
    }

    fn started(self, stage: &str, n: u128) -> Self {
        self.step(
            stage,
            &format!("start:{n}"),
            Self::effect(EffectKind::NodeStarted, &node(n), "plugin"),
            None,
        )
    }

    fn decommissioned(self, stage: &str, n: u128) -> Self {
        let mut effect = Self::effect(EffectKind::NodeDecommissioned, &node(n), "plugin");
        effect
            .detail
            .insert("provider_id".into(), Uuid::from_u128(PROVIDER).to_string());
        effect
            .detail
            .insert("cluster_id".into(), Uuid::from_u128(0xCC).to_string());
        self.step(stage, &format!("decommission:{n}"), effect, None)
    }

    fn terminated(self, stage: &str, n: u128) -> Self {
        self.step(
            stage,
            &format!("terminate:{n}"),
            Self::effect(EffectKind::NodeTerminated, &node(n), "hypervisor"),
            None,
        )
    }

    /// A configure step declaring the plugin's `remove_node` compensation, as the flows do.
    fn configured_with_undo(self, stage: &str, n: u128) -> Self {
        self.step(
            stage,
            &format!("configure:{n}"),
            Self::effect(EffectKind::NodeConfigured, &node(n), "plugin"),
            Some(remove_node(n)),
        )
    }

    /// A decommission step whose effect carries the node's removal list.
    fn decommissioned_with(self, stage: &str, n: u128, removal: &str) -> Self {
        let mut given = self.decommissioned(stage, n);
        if let Some((_, events)) = given.steps.last_mut() {
            if let Some(Event::StepDone { effect, .. }) = events.first_mut() {
                effect
                    .detail
                    .insert(REMOVAL_DETAIL.into(), removal.to_string());
            }
        }
        given
    }

    /// A forward removal of one of node `n`'s resources (a `resource_removed` effect).
    fn removed(self, stage: &str, n: u128, c: &Compensation) -> Self {
        let Executor::Service(executor) = &c.executor else {
            panic!("a forward removal is by a service");
        };
        let word = action_word(&c.action);
        let mut effect = Self::effect(
            EffectKind::Custom("resource_removed".into()),
            &c.resource,
            executor,
        );
        effect.detail.insert("action".into(), word.clone());
        effect.detail.insert("node".into(), node(n));
        self.step(stage, &format!("{word}:{n}"), effect, None)
    }

    fn fail(mut self, stage: &str, error: &str) -> Self {
        self.event(Event::OperationFailed {
            stage: stage.into(),
            step: None,
            error: error.into(),
        });
        self
    }

    fn succeed(mut self) -> Self {
        self.event(Event::OperationSucceeded {});
        self
    }

    /// The user deleted the target while the operation ran.
    fn target_deleted(mut self) -> Self {
        self.event(Event::TargetDeletionNoticed {
            reason: "cluster deleted by the user".into(),
        });
        self.event(Event::OperationCancelled {
            reason: "target deleted".into(),
        });
        self
    }

    fn fold(&self) -> OperationState {
        fold_all(&self.steps, self.id)
    }
}

fn remove_node(n: u128) -> Compensation {
    GivenOperation::undo(
        CompensationAction::Custom("remove_node".into()),
        Executor::Service("plugin".into()),
        &node(n),
    )
}

/// Node `n`'s removal list as the flows record it: plugin record, DNS, DHCP, IP.
fn removal_of(n: u128) -> Vec<Compensation> {
    let service = |s: &str| Executor::Service(s.into());
    vec![
        remove_node(n),
        GivenOperation::undo(
            CompensationAction::UnregisterDns,
            service("dns"),
            &format!("node-{n}.example"),
        ),
        GivenOperation::undo(
            CompensationAction::UnregisterDhcp,
            service("dhcp"),
            &format!("node-{n}"),
        ),
        GivenOperation::undo(
            CompensationAction::ReleaseIp,
            service("ipam"),
            &format!("10.0.0.{n}"),
        ),
    ]
}

fn json(removal: &[Compensation]) -> String {
    serde_json::to_string(removal).expect("JSON")
}

fn fold_all(steps: &[ScriptStep], id: Uuid) -> OperationState {
    let projection = Projection::rebuild(&script::seal(steps));
    match projection.get(&AggregateId::operation(id)) {
        Some(Entity::Operation(op)) => {
            assert_eq!(
                op.header.anomaly_count, 0,
                "anomalies: {:?}",
                op.header.anomalies
            );
            (**op).clone()
        }
        other => panic!("operation not folded: {other:?}"),
    }
}

/// When planned, then the plan (rendered) is returned; it is also checked to be
/// deterministic and to never terminate a discovered resource.
fn planned(given: &GivenOperation) -> String {
    let op = given.fold();
    let plan = plan_rollback(&op, &[]).expect("a plan");
    assert_eq!(
        plan_rollback(&op, &[]).expect("a plan"),
        plan,
        "deterministic"
    );
    assert_eq!(plan.target, given.target);
    render_plan(&plan)
}

fn create_infrastructure() -> GivenOperation {
    GivenOperation::start(OperationKind::CreateCluster)
        .stage(stage::ALLOCATE)
        .claim(stage::ALLOCATE, 1)
        .claim(stage::ALLOCATE, 2)
        .complete(stage::ALLOCATE)
        .stage(stage::SPAWN)
        .vm(stage::SPAWN, 1)
        .ip(stage::SPAWN, 1)
        .vm(stage::SPAWN, 2)
        .ip(stage::SPAWN, 2)
}

#[test]
fn create_failing_in_allocate_releases_the_claims_made() {
    let given = GivenOperation::start(OperationKind::CreateCluster)
        .stage(stage::ALLOCATE)
        .claim(stage::ALLOCATE, 1)
        .fail(stage::ALLOCATE, "no valid host for node 2");
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn create_failing_in_spawn_terminates_every_instance_and_releases_every_allocation() {
    let given = create_infrastructure().fail(stage::SPAWN, "hypervisor: boot timed out");
    let op = given.fold();
    let plan = plan_rollback(&op, &[]).expect("a plan");
    // Reverse order of the effects: the last IP first, the first claim last.
    let order: Vec<String> = plan.compensations.iter().map(|c| c.step.clone()).collect();
    assert_eq!(
        order,
        [
            "acquire_ip:2",
            "create_vm:2",
            "acquire_ip:1",
            "create_vm:1",
            "claim:2",
            "claim:1"
        ]
    );
    assert!(matches!(plan.target_outcome, TargetOutcome::Error { .. }));
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn create_failing_in_configure_keeps_the_instances_and_sets_error() {
    let given = create_infrastructure()
        .complete(stage::SPAWN)
        .stage(stage::CONFIGURE)
        .configured(stage::CONFIGURE, 1)
        .fail(stage::CONFIGURE, "plugin: namenode format failed");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    assert!(plan.compensations.is_empty(), "hold deletes nothing");
    assert_eq!(plan.retained.len(), 6);
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn create_failing_in_start_keeps_the_instances_and_sets_error() {
    let given = create_infrastructure()
        .complete(stage::SPAWN)
        .stage(stage::CONFIGURE)
        .configured(stage::CONFIGURE, 1)
        .configured(stage::CONFIGURE, 2)
        .complete(stage::CONFIGURE)
        .stage(stage::START)
        .started(stage::START, 1)
        .fail(stage::START, "plugin: datanode did not start");
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn create_failing_before_any_step_plans_nothing() {
    let given = GivenOperation::start(OperationKind::CreateCluster)
        .stage(stage::ALLOCATE)
        .fail(stage::ALLOCATE, "quota exceeded");
    insta::assert_snapshot!(planned(&given));
}

fn scale_decommission() -> GivenOperation {
    GivenOperation::start(OperationKind::ScaleCluster)
        .stage(stage::DECOMMISSION)
        .decommissioned(stage::DECOMMISSION, 7)
}

#[test]
fn scale_failing_in_decommission_sets_error_and_deletes_no_node() {
    let given = scale_decommission().fail(
        stage::DECOMMISSION,
        "plugin: decommission of node 8 timed out",
    );
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    assert!(plan.compensations.is_empty());
    assert!(matches!(plan.target_outcome, TargetOutcome::Error { .. }));
    insta::assert_snapshot!(planned(&given));
}

fn scale_terminate_and_create() -> GivenOperation {
    scale_decommission()
        .decommissioned(stage::DECOMMISSION, 8)
        .complete(stage::DECOMMISSION)
        .stage(stage::TERMINATE_AND_CREATE)
        .terminated(stage::TERMINATE_AND_CREATE, 8)
        .claim(stage::TERMINATE_AND_CREATE, 9)
        .vm(stage::TERMINATE_AND_CREATE, 9)
        .ip(stage::TERMINATE_AND_CREATE, 9)
}

#[test]
fn scale_failing_in_terminate_and_create_deletes_new_nodes_finishes_removal_and_returns_active() {
    let given =
        scale_terminate_and_create().fail(stage::TERMINATE_AND_CREATE, "hypervisor: no capacity");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    let terminated: Vec<&str> = plan
        .compensations
        .iter()
        .filter(|c| c.compensation.action == CompensationAction::TerminateVm)
        .map(|c| c.compensation.resource.as_str())
        .collect();
    // Node 7 was decommissioned but not yet terminated: its removal is finished. Node 8
    // is already terminated. Node 9 is new: it is deleted.
    assert_eq!(terminated, [node(7), node(9)]);
    assert!(matches!(plan.target_outcome, TargetOutcome::Active { .. }));
    insta::assert_snapshot!(planned(&given));
}

/// The planned actions and resources, in plan order.
fn plan_lines(plan: &provledger_events::catalogue::RollbackPlan) -> Vec<(String, String)> {
    plan.compensations
        .iter()
        .map(|c| {
            (
                action_word(&c.compensation.action),
                c.compensation.resource.clone(),
            )
        })
        .collect()
}

fn line(action: &str, resource: &str) -> (String, String) {
    (action.to_string(), resource.to_string())
}

#[test]
fn scale_failing_in_terminate_and_create_with_a_removal_list_terminates_then_removes_then_releases()
{
    // Given a scale that decommissioned node 7 with its removal list, and failed in
    // terminate_and_create before node 7 was touched,
    let given = GivenOperation::start(OperationKind::ScaleCluster)
        .stage(stage::DECOMMISSION)
        .decommissioned_with(stage::DECOMMISSION, 7, &json(&removal_of(7)))
        .complete(stage::DECOMMISSION)
        .stage(stage::TERMINATE_AND_CREATE)
        .fail(stage::TERMINATE_AND_CREATE, "hypervisor: unreachable");
    // when planned,
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    // then the roll-forward terminates the VM, removes the plugin record, DNS, DHCP and IP,
    // and releases the allocation, in that order, with distinct ids.
    assert_eq!(
        plan_lines(&plan),
        [
            line("terminate_vm", &node(7)),
            line("remove_node", &node(7)),
            line("unregister_dns", "node-7.example"),
            line("unregister_dhcp", "node-7"),
            line("release_ip", "10.0.0.7"),
            line("release_allocation", &node(7)),
        ]
    );
    let ids: std::collections::BTreeSet<Uuid> = plan
        .compensations
        .iter()
        .map(|c| c.compensation_id)
        .collect();
    assert_eq!(ids.len(), plan.compensations.len());
    assert!(matches!(plan.target_outcome, TargetOutcome::Active { .. }));
    assert_eq!(plan, plan_rollback(&given.fold(), &[]).expect("a plan"));
}

#[test]
fn a_removal_list_plans_only_what_is_left_and_never_a_discovered_resource() {
    // Given a scale that removed node 7's plugin record and DNS entry forward, decommissioned
    // node 8 with an unparsable removal list and node 6 with a list naming a discovered IP
    // and two custom removals of one name, then failed in terminate_and_create,
    let mut removal_6 = vec![
        GivenOperation::undo(
            CompensationAction::Custom("wipe".into()),
            Executor::Service("storage".into()),
            "disk-a",
        ),
        GivenOperation::undo(
            CompensationAction::Custom("wipe".into()),
            Executor::Service("storage".into()),
            "disk-b",
        ),
        GivenOperation::undo(
            CompensationAction::ReleaseIp,
            Executor::Service("ipam".into()),
            "10.9.9.9",
        ),
    ];
    // (a duplicate entry is planned once)
    removal_6.push(removal_6[0].clone());
    let mut adopted_ip = GivenOperation::effect(EffectKind::IpAcquired, "10.9.9.9", "ipam");
    adopted_ip.origin = Origin::Discovered;
    let removal_7 = removal_of(7);
    let given = GivenOperation::start(OperationKind::ScaleCluster)
        .stage(stage::DECOMMISSION)
        .step(stage::DECOMMISSION, "adopt_ip", adopted_ip, None)
        .decommissioned_with(stage::DECOMMISSION, 6, &json(&removal_6))
        .decommissioned_with(stage::DECOMMISSION, 7, &json(&removal_7))
        .decommissioned_with(stage::DECOMMISSION, 8, "[{not json")
        .complete(stage::DECOMMISSION)
        .stage(stage::TERMINATE_AND_CREATE)
        .removed(stage::TERMINATE_AND_CREATE, 7, &removal_7[0])
        .removed(stage::TERMINATE_AND_CREATE, 7, &removal_7[1])
        .fail(stage::TERMINATE_AND_CREATE, "dhcp: unreachable");
    // when planned,
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    // then node 6's custom removals are both planned with distinct ids, the discovered IP
    // is kept, node 7's removals done forward are not requested again, and node 8 gets its
    // VM terminated and its allocation released only.
    assert_eq!(
        plan_lines(&plan),
        [
            line("terminate_vm", &node(6)),
            line("wipe", "disk-a"),
            line("wipe", "disk-b"),
            line("release_allocation", &node(6)),
            line("terminate_vm", &node(7)),
            line("unregister_dhcp", "node-7"),
            line("release_ip", "10.0.0.7"),
            line("release_allocation", &node(7)),
            line("terminate_vm", &node(8)),
            line("release_allocation", &node(8)),
        ]
    );
    let ids: std::collections::BTreeSet<Uuid> = plan
        .compensations
        .iter()
        .map(|c| c.compensation_id)
        .collect();
    assert_eq!(ids.len(), plan.compensations.len());
    assert!(plan.retained.iter().any(|r| r.resource == "10.9.9.9"));
}

#[test]
fn a_configure_compensation_is_kept_while_the_node_may_hold_data_and_undone_on_deletion() {
    // Given a create whose configure steps declare the plugin's remove_node,
    let configured = || {
        create_infrastructure()
            .complete(stage::SPAWN)
            .stage(stage::CONFIGURE)
            .configured_with_undo(stage::CONFIGURE, 1)
            .configured_with_undo(stage::CONFIGURE, 2)
    };
    // when it fails in configure, then the holding stage keeps the plugin records;
    let held =
        plan_rollback(&configured().fail(stage::CONFIGURE, "boom").fold(), &[]).expect("a plan");
    assert!(held.compensations.is_empty());
    assert!(held.retained.iter().any(|r| r.step == "configure:2"));
    // when a compensating stage stops after it (a custom spec), the record is kept too;
    let stages = vec![
        StageSpec {
            name: "spawn".into(),
            policy: StagePolicy::Compensate,
        },
        StageSpec {
            name: "configure".into(),
            policy: StagePolicy::Compensate,
        },
    ];
    let compensating = GivenOperation::start_with(OperationKind::CreateCluster, stages, None)
        .stage("spawn")
        .vm("spawn", 1)
        .complete("spawn")
        .stage("configure")
        .configured_with_undo("configure", 1)
        .fail("configure", "plugin crashed");
    let plan = plan_rollback(&compensating.fold(), &[]).expect("a plan");
    assert!(plan.compensations.is_empty(), "{}", render_plan(&plan));
    // when the user deletes the target, then the plugin forgets each node before its
    // network and its VM go.
    let deleted = plan_rollback(&configured().target_deleted().fold(), &[]).expect("a plan");
    let lines = plan_lines(&deleted);
    assert_eq!(
        lines[..2],
        [line("remove_node", &node(2)), line("remove_node", &node(1))]
    );
    assert_eq!(deleted.target_outcome, TargetOutcome::Deleted);
}

#[test]
fn scale_failing_in_configure_new_keeps_the_new_nodes_and_sets_error() {
    let given = scale_terminate_and_create()
        .terminated(stage::TERMINATE_AND_CREATE, 7)
        .complete(stage::TERMINATE_AND_CREATE)
        .stage(stage::CONFIGURE_NEW)
        .configured(stage::CONFIGURE_NEW, 9)
        .fail(stage::CONFIGURE_NEW, "plugin: datanode 9 did not register");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    assert!(
        plan.compensations.is_empty(),
        "nodes not configured may hold data"
    );
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn delete_failing_in_terminate_rolls_forward() {
    let given = GivenOperation::start(OperationKind::DeleteCluster)
        .stage(stage::TERMINATE)
        .terminated(stage::TERMINATE, 1)
        .fail(stage::TERMINATE, "hypervisor: node 2 unreachable");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    assert_eq!(plan.target_outcome, TargetOutcome::Deleted);
    insta::assert_snapshot!(planned(&given));
}

fn boot_network() -> GivenOperation {
    GivenOperation::start(OperationKind::BootInstance)
        .stage(stage::SCHEDULE)
        .claim(stage::SCHEDULE, 1)
        .complete(stage::SCHEDULE)
        .stage(stage::NETWORK)
        .ip(stage::NETWORK, 1)
        .dhcp(stage::NETWORK, 1)
}

#[test]
fn boot_failing_in_schedule_releases_nothing_but_what_it_claimed() {
    let given = GivenOperation::start(OperationKind::BootInstance)
        .stage(stage::SCHEDULE)
        .fail(stage::SCHEDULE, "no valid host");
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn boot_failing_in_network_unregisters_dhcp_then_releases_the_ip_and_the_claim() {
    let given = boot_network().fail(stage::NETWORK, "dns: zone not found");
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn boot_failing_in_spawn_terminates_the_vm_and_undoes_the_network() {
    let given = boot_network()
        .dns(stage::NETWORK, 1)
        .complete(stage::NETWORK)
        .stage(stage::SPAWN)
        .vm(stage::SPAWN, 1)
        .fail(stage::SPAWN, "hypervisor: image corrupt");
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn create_cancelled_by_deletion_during_configure_removes_everything_it_created() {
    let given = create_infrastructure()
        .complete(stage::SPAWN)
        .stage(stage::CONFIGURE)
        .configured(stage::CONFIGURE, 1)
        .target_deleted();
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    assert!(
        plan.retained.is_empty(),
        "the user asked for everything to go"
    );
    assert_eq!(plan.compensations.len(), 6);
    assert_eq!(plan.target_outcome, TargetOutcome::Deleted);
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn scale_cancelled_by_deletion_in_decommission_deletes_nothing_itself() {
    // The decommissioned node is not terminated by this plan: the delete operation that
    // follows removes every remaining member.
    let given = scale_decommission().target_deleted();
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn create_cancelled_by_a_user_in_spawn_is_compensated_like_a_failure() {
    let mut given = create_infrastructure();
    given.event(Event::CancellationRequested {
        reason: "user cancelled the request".into(),
    });
    given.event(Event::OperationCancelled {
        reason: "user cancelled the request".into(),
    });
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    assert_eq!(plan.compensations.len(), 6);
    assert!(matches!(plan.target_outcome, TargetOutcome::Error { .. }));
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn a_discovered_resource_is_never_destroyed_even_when_the_target_is_deleted() {
    let mut effect = GivenOperation::effect(EffectKind::VmCreated, &node(5), "hypervisor");
    effect.origin = Origin::Discovered;
    let given = GivenOperation::start(OperationKind::CreateCluster)
        .stage(stage::ALLOCATE)
        .claim(stage::ALLOCATE, 4)
        .complete(stage::ALLOCATE)
        .stage(stage::SPAWN)
        .step(
            stage::SPAWN,
            "adopt_vm:5",
            effect,
            Some(GivenOperation::undo(
                CompensationAction::TerminateVm,
                Executor::Service("hypervisor".into()),
                &node(5),
            )),
        )
        .vm(stage::SPAWN, 4)
        .target_deleted();
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    assert!(plan
        .compensations
        .iter()
        .all(|c| c.compensation.resource != node(5)));
    insta::assert_snapshot!(planned(&given));
}

#[test]
fn a_configured_node_is_not_terminated_by_a_compensating_stage() {
    // A custom operation whose configure stage compensates: the safety rule still keeps
    // the configured node, which may hold data, and undoes the rest.
    let stages = vec![
        StageSpec {
            name: "spawn".into(),
            policy: StagePolicy::Compensate,
        },
        StageSpec {
            name: "configure".into(),
            policy: StagePolicy::Compensate,
        },
    ];
    let given = GivenOperation::start_with(OperationKind::CreateCluster, stages, None)
        .stage("spawn")
        .vm("spawn", 1)
        .vm("spawn", 2)
        .complete("spawn")
        .stage("configure")
        .configured("configure", 1)
        .fail("configure", "plugin crashed");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    let terminated: Vec<&str> = plan
        .compensations
        .iter()
        .map(|c| c.compensation.resource.as_str())
        .collect();
    assert_eq!(terminated, [node(2)]);
    insta::assert_snapshot!(planned(&given));
}

fn boot_child(id: u128, n: u128, fails: bool) -> GivenOperation {
    let given = GivenOperation::start(OperationKind::BootInstance)
        .stage(stage::SCHEDULE)
        .claim(stage::SCHEDULE, n)
        .complete(stage::SCHEDULE)
        .stage(stage::NETWORK)
        .ip(stage::NETWORK, n);
    let given = if fails {
        given.fail(stage::NETWORK, "ipam: pool exhausted")
    } else {
        given
            .complete(stage::NETWORK)
            .stage(stage::SPAWN)
            .vm(stage::SPAWN, n)
            .complete(stage::SPAWN)
            .succeed()
    };
    given.with_id(id)
}

fn bundle(policy: BundlePolicy) -> (GivenOperation, Vec<OperationState>) {
    let children = [
        boot_child(0xD1, 1, false),
        boot_child(0xD2, 2, false),
        boot_child(0xD3, 3, true),
    ];
    let mut given = GivenOperation::start_with(
        OperationKind::Bundle,
        stages_of(OperationKind::Bundle),
        Some(policy),
    )
    .stage(stage::CHILDREN);
    for child in &children {
        given.event(Event::ChildOperationAdded { child_id: child.id });
    }
    given.event(Event::OperationFailed {
        stage: stage::CHILDREN.into(),
        step: Some(children[2].id.to_string()),
        error: "child failed: ipam: pool exhausted".into(),
    });
    let folded = children.iter().map(GivenOperation::fold).collect();
    (given, folded)
}

#[test]
fn bundle_rolling_back_siblings_compensates_every_succeeded_sibling_in_reverse() {
    let (given, children) = bundle(BundlePolicy::RollBackSiblings);
    let plan = plan_rollback(&given.fold(), &children).expect("a plan");
    // The failed child (0xD3) rolls back through its own plan; the siblings here, the
    // later one first.
    let resources: Vec<&str> = plan
        .compensations
        .iter()
        .map(|c| c.compensation.resource.as_str())
        .collect();
    assert_eq!(
        resources,
        [
            node(2),
            "10.0.0.2".to_string(),
            node(2),
            node(1),
            "10.0.0.1".to_string(),
            node(1)
        ]
    );
    insta::assert_snapshot!(render_plan(&plan));
}

#[test]
fn bundle_retaining_siblings_keeps_them() {
    let (given, children) = bundle(BundlePolicy::RetainSiblings);
    let plan = plan_rollback(&given.fold(), &children).expect("a plan");
    assert!(plan.compensations.is_empty());
    assert_eq!(plan.retained.len(), 6);
    insta::assert_snapshot!(render_plan(&plan));
}

#[test]
fn a_bundle_without_its_children_is_refused() {
    let (given, _) = bundle(BundlePolicy::RollBackSiblings);
    let refusal = plan_rollback(&given.fold(), &[]).unwrap_err();
    assert!(matches!(refusal, PlanRefusal::ChildMissing { .. }));
}

#[test]
fn a_running_operation_is_not_planned_and_the_refusal_says_its_status_in_the_contracts_word() {
    // Given an operation still running,
    let given = create_infrastructure();
    // when its rollback is planned,
    let refusal = plan_rollback(&given.fold(), &[]).unwrap_err();
    // then it is refused with a sentence naming its status as JSON does (not `some(running)`).
    assert!(
        matches!(refusal, PlanRefusal::NotStopped { .. }),
        "{refusal}"
    );
    let message = refusal.to_string();
    assert!(
        message.contains("has status running: there is nothing to roll back"),
        "{message}"
    );
}

#[test]
fn a_planned_operation_is_not_planned_twice() {
    let mut given = create_infrastructure().fail(stage::SPAWN, "boom");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    given.event(Event::RollbackPlanned { plan });
    let refusal = plan_rollback(&given.fold(), &[]).unwrap_err();
    assert!(matches!(refusal, PlanRefusal::AlreadyPlanned { .. }));
}

// ---- the driver's decider ----

fn policy() -> RetryPolicy {
    RetryPolicy {
        attempts_max: 3,
        backoff_base_ms: 100,
        backoff_max_ms: 1_000,
        reply_wait_ms: 5_000,
        runner_stop_wait_ms: 10_000,
    }
}

fn at(ms: i64) -> provledger_events::Timestamp {
    provledger_events::Timestamp(ms)
}

#[test]
fn the_decider_plans_then_requests_in_plan_order_then_finishes() {
    let mut given = boot_network().fail(stage::NETWORK, "dns down");
    assert_eq!(
        next_rollback_action(&given.fold(), at(0), &policy()),
        RollbackAction::Plan
    );
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    given.event(Event::RollbackPlanned { plan: plan.clone() });
    for c in &plan.compensations {
        let next = next_rollback_action(&given.fold(), at(0), &policy());
        assert_eq!(
            next,
            RollbackAction::Request {
                compensation: c.clone(),
                attempt: 1
            }
        );
        given.event(Event::CompensationRequested {
            compensation_id: c.compensation_id,
            attempt: 1,
        });
        given.event(Event::CompensationDone {
            compensation_id: c.compensation_id,
        });
    }
    assert_eq!(
        next_rollback_action(&given.fold(), at(0), &policy()),
        RollbackAction::Finish {
            outcome: RollbackOutcome::RolledBack,
            remaining: vec![]
        }
    );
}

#[test]
fn a_failing_compensation_backs_off_then_needs_attention_with_what_remains() {
    let mut given = boot_network().fail(stage::NETWORK, "dns down");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    given.event(Event::RollbackPlanned { plan: plan.clone() });
    let first = plan.compensations[0].compensation_id;
    // Recorded_at of the sealed script is 1_700_000_000_000 + index; the failure is the
    // latest commit.
    for attempt in 1..=3 {
        given.event(Event::CompensationRequested {
            compensation_id: first,
            attempt,
        });
        given.event(Event::CompensationFailed {
            compensation_id: first,
            attempt,
            error: "dhcp: connection refused".into(),
        });
        let op = given.fold();
        let failed_at = op.compensations[0].failed_at.expect("failed_at");
        let next = next_rollback_action(&op, failed_at, &policy());
        if attempt < 3 {
            assert_eq!(
                next,
                RollbackAction::WaitUntil(failed_at.plus_ms(policy().backoff_ms(attempt)))
            );
            let later = failed_at.plus_ms(policy().backoff_ms(attempt));
            assert_eq!(
                next_rollback_action(&op, later, &policy()),
                RollbackAction::Request {
                    compensation: plan.compensations[0].clone(),
                    attempt: attempt + 1
                }
            );
        } else {
            let remaining: Vec<Uuid> = plan
                .compensations
                .iter()
                .map(|c| c.compensation_id)
                .collect();
            assert_eq!(
                next,
                RollbackAction::Finish {
                    outcome: RollbackOutcome::NeedsAttention,
                    remaining
                }
            );
        }
    }
}

#[test]
fn a_request_without_outcome_is_retried_only_after_the_reply_wait() {
    let mut given = boot_network().fail(stage::NETWORK, "dns down");
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    given.event(Event::RollbackPlanned { plan: plan.clone() });
    given.event(Event::CompensationRequested {
        compensation_id: plan.compensations[0].compensation_id,
        attempt: 1,
    });
    let op = given.fold();
    let requested_at = op.compensations[0].requested_at.expect("requested_at");
    let lost_at = requested_at.plus_ms(policy().reply_wait_ms);
    assert_eq!(
        next_rollback_action(&op, requested_at, &policy()),
        RollbackAction::WaitUntil(lost_at)
    );
    assert_eq!(
        next_rollback_action(&op, lost_at, &policy()),
        RollbackAction::Request {
            compensation: plan.compensations[0].clone(),
            attempt: 2
        }
    );
}

#[test]
fn a_cancelled_operation_closes_as_cancelled_after_its_rollback() {
    let mut given = create_infrastructure().target_deleted();
    let plan = plan_rollback(&given.fold(), &[]).expect("a plan");
    given.event(Event::RollbackPlanned { plan: plan.clone() });
    for c in &plan.compensations {
        given.event(Event::CompensationDone {
            compensation_id: c.compensation_id,
        });
    }
    given.event(Event::RollbackFinished {
        outcome: RollbackOutcome::RolledBack,
        remaining: vec![],
    });
    let op = given.fold();
    assert_eq!(op.view()["status"], "cancelled");
    assert!(op.is_closed());
    assert_eq!(
        next_rollback_action(&op, at(0), &policy()),
        RollbackAction::Nothing
    );
}

// ---- properties over random operations ----

use proptest::prelude::*;

/// One random step: what it does and to which of a few nodes.
#[derive(Debug, Clone)]
enum RandomStep {
    Vm(u128),
    Ip(u128),
    Claim(u128),
    Configured(u128),
    Decommissioned(u128),
    /// Decommissioned with its removal list (plugin record, DNS, DHCP, IP).
    DecommissionedWithRemoval(u128),
    /// Configured, declaring the plugin's `remove_node`.
    ConfiguredWithUndo(u128),
    Terminated(u128),
    /// A VM provledger adopted, with its own node numbers (never created here).
    Adopted(u128),
}

fn random_step() -> impl Strategy<Value = RandomStep> {
    let node = 0u128..4;
    prop_oneof![
        node.clone().prop_map(RandomStep::Vm),
        node.clone().prop_map(RandomStep::Ip),
        node.clone().prop_map(RandomStep::Claim),
        node.clone().prop_map(RandomStep::Configured),
        node.clone().prop_map(RandomStep::Decommissioned),
        node.clone().prop_map(RandomStep::DecommissionedWithRemoval),
        node.clone().prop_map(RandomStep::ConfiguredWithUndo),
        node.clone().prop_map(RandomStep::Terminated),
        node.prop_map(|n| RandomStep::Adopted(50 + n)),
    ]
}

fn random_operation() -> impl Strategy<Value = (OperationKind, Vec<Vec<RandomStep>>, bool)> {
    let kind = prop_oneof![
        Just(OperationKind::CreateCluster),
        Just(OperationKind::ScaleCluster),
        Just(OperationKind::BootInstance),
        Just(OperationKind::DeleteCluster),
    ];
    (kind, any::<bool>()).prop_flat_map(|(kind, deleted)| {
        let stages = stages_of(kind).len();
        (
            Just(kind),
            proptest::collection::vec(proptest::collection::vec(random_step(), 0..5), 1..=stages),
            Just(deleted),
        )
    })
}

fn build(kind: OperationKind, stages: &[Vec<RandomStep>], deleted: bool) -> GivenOperation {
    let names: Vec<String> = stages_of(kind).into_iter().map(|s| s.name).collect();
    let mut given = GivenOperation::start(kind);
    for (i, steps) in stages.iter().enumerate() {
        let stage = names[i].as_str();
        given = given.stage(stage);
        for (j, step) in steps.iter().enumerate() {
            // Step names must be unique within an operation: suffix the position.
            let before = given.steps.len();
            given = match step {
                RandomStep::Vm(n) => given.vm(stage, *n),
                RandomStep::Ip(n) => given.ip(stage, *n),
                RandomStep::Claim(n) => given.claim(stage, *n),
                RandomStep::Configured(n) => given.configured(stage, *n),
                RandomStep::Decommissioned(n) => given.decommissioned(stage, *n),
                RandomStep::DecommissionedWithRemoval(n) => {
                    given.decommissioned_with(stage, *n, &json(&removal_of(*n)))
                }
                RandomStep::ConfiguredWithUndo(n) => given.configured_with_undo(stage, *n),
                RandomStep::Terminated(n) => given.terminated(stage, *n),
                RandomStep::Adopted(n) => {
                    let mut effect =
                        GivenOperation::effect(EffectKind::VmCreated, &node(*n), "hypervisor");
                    effect.origin = Origin::Discovered;
                    let undo = GivenOperation::undo(
                        CompensationAction::TerminateVm,
                        Executor::Service("hypervisor".into()),
                        &node(*n),
                    );
                    given.step(stage, &format!("adopt:{n}"), effect, Some(undo))
                }
            };
            if let Some((_, events)) = given.steps.get_mut(before) {
                if let Some(Event::StepDone { step, .. }) = events.first_mut() {
                    *step = format!("{step}#{i}.{j}");
                }
            }
        }
        if i + 1 < stages.len() {
            given = given.complete(stage);
        }
    }
    if deleted {
        given.target_deleted()
    } else {
        let last = names[stages.len() - 1].clone();
        given.fail(&last, "random failure")
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whatever the operation did and wherever it stopped, the plan is deterministic, its
    /// ids are unique, it never destroys a discovered resource, it never terminates a node
    /// this operation configured unless that node was decommissioned or the target is being
    /// deleted (neither its VM nor its plugin record), and it only undoes declared
    /// compensations (plus, rolling forward, the termination of decommissioned nodes and
    /// what their decommission steps list for removal).
    #[test]
    fn plans_respect_the_safety_rules((kind, stages, deleted) in random_operation()) {
        let given = build(kind, &stages, deleted);
        let op = given.fold();
        let plan = plan_rollback(&op, &[]).expect("a plan");
        prop_assert_eq!(&plan_rollback(&op, &[]).expect("a plan"), &plan);
        let ids: std::collections::BTreeSet<Uuid> =
            plan.compensations.iter().map(|c| c.compensation_id).collect();
        prop_assert_eq!(ids.len(), plan.compensations.len());
        let effects_on = |resource: &str, kind: EffectKind| {
            op.steps.iter().any(|s| s.effect.resource == resource && s.effect.kind == kind)
        };
        for c in &plan.compensations {
            let r = c.compensation.resource.as_str();
            prop_assert!(
                !op.steps.iter().any(|s| s.effect.resource == r && s.effect.origin == Origin::Discovered),
                "a discovered resource is planned for destruction: {}", render_plan(&plan)
            );
            let removes_node = c.compensation.action == CompensationAction::TerminateVm
                || c.compensation.action == CompensationAction::Custom("remove_node".into());
            if removes_node && !deleted {
                let configured = effects_on(r, EffectKind::NodeConfigured);
                let decommissioned = effects_on(r, EffectKind::NodeDecommissioned);
                prop_assert!(!configured || decommissioned, "removes a data node: {}", render_plan(&plan));
            }
            let declared = op.steps.iter().any(|s| s.compensation.as_ref() == Some(&c.compensation));
            let listed = !deleted && op.steps.iter().any(|s| {
                s.effect.kind == EffectKind::NodeDecommissioned
                    && s.effect
                        .detail
                        .get(REMOVAL_DETAIL)
                        .and_then(|l| serde_json::from_str::<Vec<Compensation>>(l).ok())
                        .is_some_and(|l| l.contains(&c.compensation))
            });
            let forward = effects_on(r, EffectKind::NodeDecommissioned) || listed;
            prop_assert!(declared || forward, "undeclared compensation: {}", render_plan(&plan));
        }
    }
}

/// Given a running operation with a cancellation pending, when its runner stays silent,
/// then the decider waits for the runner stop wait from the operation's last commit, and
/// after it records the cancellation itself (the runner died), saying why.
#[test]
fn the_decider_cancels_for_a_runner_silent_past_the_stop_wait() {
    let mut given = boot_network();
    given.event(Event::CancellationRequested {
        reason: "cancelled by an operator".into(),
    });
    let op = given.fold();
    let quiet_since = op.header.updated_at.expect("updated").unix_ms();
    assert_eq!(
        next_rollback_action(&op, at(quiet_since + 9_999), &policy()),
        RollbackAction::WaitUntil(at(quiet_since + 10_000))
    );
    let RollbackAction::CancelForSilentRunner(cancelled) =
        next_rollback_action(&op, at(quiet_since + 10_000), &policy())
    else {
        panic!("no cancellation");
    };
    assert!(matches!(
        *cancelled,
        Event::OperationCancelled { ref reason }
            if reason == "cancelled by an operator; the runner did not stop within 10000 ms"
    ));
}

/// A live migration of "vm" whose destination claim is on `destination` and whose source
/// (given back by `return_to_source`) is on `source`, failed in `migrate`.
fn failed_migration(destination: &str, source: &str) -> GivenOperation {
    let with_provider = |action: CompensationAction, provider: &str| {
        let mut c = GivenOperation::undo(action, Executor::Ledger, "vm");
        c.args.insert("provider_id".into(), provider.into());
        c
    };
    GivenOperation::start(OperationKind::LiveMigrateInstance)
        .stage(stage::SCHEDULE)
        .step(
            stage::SCHEDULE,
            "claim:vm",
            GivenOperation::effect(EffectKind::AllocationClaimed, "vm", "ledger"),
            Some(with_provider(
                CompensationAction::ReleaseAllocation,
                destination,
            )),
        )
        .step(
            stage::SCHEDULE,
            "source:vm",
            GivenOperation::effect(
                EffectKind::Custom("allocation_moved".into()),
                "vm",
                "ledger",
            ),
            Some(with_provider(CompensationAction::ReturnToSource, source)),
        )
        .complete(stage::SCHEDULE)
        .stage(stage::MIGRATE)
        .fail(stage::MIGRATE, "the guest refused")
}

/// Given a live migration to the same host (its source and its destination the same
/// provider) that failed in `migrate`; when planned, then the source is given back and the
/// destination's release on that same provider is kept, not planned (it would take back
/// the allocation just given back), and the plan says why.
#[test]
fn a_same_host_migration_keeps_the_release_that_would_undo_the_source_given_back() {
    let (host, other) = (
        "0190c0de-0000-7000-8000-0000000000f1",
        "0190c0de-0000-7000-8000-0000000000f2",
    );
    let plan = plan_rollback(&failed_migration(host, host).fold(), &[]).expect("a plan");
    let actions: Vec<&CompensationAction> = plan
        .compensations
        .iter()
        .map(|p| &p.compensation.action)
        .collect();
    assert_eq!(actions, vec![&CompensationAction::ReturnToSource]);
    assert_eq!(plan.retained.len(), 1, "{:?}", plan.retained);
    assert!(plan.retained[0].why.contains("same provider"));
    // On another host, both run: the source given back, then the destination released.
    let plan = plan_rollback(&failed_migration(other, host).fold(), &[]).expect("a plan");
    assert_eq!(plan.compensations.len(), 2);
    assert!(plan.retained.is_empty());
}
