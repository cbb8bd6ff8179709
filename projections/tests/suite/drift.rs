//! Drift, as given an operation's events and what the executors hold / when compared /
//! then these findings: `leaked`, `missing`, `mismatched`, or none.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    Compensation, CompensationAction, Effect, EffectKind, Executor, OperationKind, Origin,
    RollbackOutcome,
};
use provledger_events::{AggregateId, Commit, Event};
use provledger_projections::drift::{
    compare, recorded_resources, DriftFold, Finding, FindingKind, Folded, InventoryItem,
    LedgerResources,
};
use provledger_projections::operation::OperationState;
use provledger_projections::planner::plan_rollback;
use provledger_projections::stages::{stage, stages_of};
use provledger_projections::Projection;
use provledger_tests::script::{self, ScriptStep};
use uuid::Uuid;

const NODE: u128 = 0x0190_0000_0000_7000_8000_0000_0000_00b1;
const OTHER_NODE: u128 = 0x0190_0000_0000_7000_8000_0000_0000_00b2;
const BOOT: u128 = 0x0190_0000_0000_7000_8000_0000_0000_0e01;
const DELETE: u128 = 0x0190_0000_0000_7000_8000_0000_0000_0e02;
const KEY_IP: &str = "key-ip";
const KEY_VM: &str = "key-vm";

fn node() -> String {
    Uuid::from_u128(NODE).to_string()
}

/// The log so far: one commit per event, in order.
#[derive(Default)]
struct Given {
    script: Vec<ScriptStep>,
}

impl Given {
    fn on(&mut self, op: u128, event: Event) -> &mut Self {
        self.script
            .push((AggregateId::operation(Uuid::from_u128(op)), vec![event]));
        self
    }

    fn operations(&self) -> Vec<OperationState> {
        let commits = script::seal(&self.script);
        let projection = Projection::rebuild(&commits);
        let mut ops: Vec<OperationState> = projection.operations().cloned().collect();
        for op in &ops {
            assert!(
                op.header.anomalies.is_empty(),
                "the given events must fold cleanly: {:?}",
                op.header.anomalies
            );
        }
        ops.sort_by_key(|op| op.header.id.id);
        ops
    }

    /// The ledger's side as `provledger drift` folds it from the log (a commit at a time,
    /// closed operations reduced), and how many commits asked for an operation's history.
    fn folded(&self) -> (LedgerResources, usize) {
        let commits = script::seal(&self.script);
        let mut fold = DriftFold::new();
        let mut reopened = 0;
        for (i, commit) in commits.iter().enumerate() {
            if let Folded::NeedsHistory(aggregate) = fold.apply(commit) {
                reopened += 1;
                let history: Vec<Commit> = commits[..i]
                    .iter()
                    .filter(|c| c.aggregate == aggregate)
                    .cloned()
                    .collect();
                fold.reopen(aggregate, &history).expect("the whole history");
                assert_eq!(fold.apply(commit), Folded::Applied, "{commit:?}");
            }
        }
        (fold.resources(), reopened)
    }

    /// The findings at `executor`, the same whether the ledger's side comes from the
    /// folded operations or from the commit-at-a-time fold.
    fn findings(&self, executor: &str, items: &[InventoryItem]) -> Vec<Finding> {
        let whole = compare(&recorded_resources(&self.operations()), executor, items);
        let (folded, _) = self.folded();
        assert_eq!(
            compare(&folded, executor, items),
            whole,
            "the two folds differ"
        );
        whole
    }

    /// A boot of `NODE` that acquired 10.0.0.5, created the VM and succeeded.
    fn succeeded_boot() -> Self {
        let mut given = Given::default();
        given
            .boot_started()
            .ip_acquired("10.0.0.5")
            .vm_created()
            .boot_succeeded();
        given
    }

    fn operation(&self, op: u128) -> OperationState {
        self.operations()
            .into_iter()
            .find(|o| o.header.id.id == Uuid::from_u128(op))
            .expect("the operation was given")
    }

    /// A boot of `NODE` through its network stage: an IP by key, then a VM by key.
    fn boot_started(&mut self) -> &mut Self {
        let target = AggregateId::instance(Uuid::from_u128(NODE));
        self.on(
            BOOT,
            Event::OperationStarted {
                kind: OperationKind::BootInstance,
                target,
                parent_id: None,
                stages: stages_of(OperationKind::BootInstance),
                bundle_policy: None,
            },
        )
        .on(
            BOOT,
            Event::StageStarted {
                stage: stage::NETWORK.into(),
            },
        )
    }

    fn acted(&mut self, step: &str, key: &str, effect: Effect, undo: Compensation) -> &mut Self {
        let mut undo = undo;
        undo.args.insert("idempotency_key".into(), key.into());
        let mut by_key = undo.clone();
        by_key.resource = String::new();
        self.on(
            BOOT,
            Event::step_started(stage::NETWORK, step, &effect.executor, key, Some(by_key)),
        )
        .on(
            BOOT,
            Event::step_done(stage::NETWORK, step, effect, Some(undo)),
        )
    }

    fn ip_acquired(&mut self, ip: &str) -> &mut Self {
        let mut effect = effect(EffectKind::IpAcquired, ip, "ipam");
        effect.detail.insert("node".into(), node());
        self.acted(
            &format!("acquire_ip:{}", node()),
            KEY_IP,
            effect,
            undo(CompensationAction::ReleaseIp, "ipam", ip),
        )
    }

    fn vm_created(&mut self) -> &mut Self {
        self.acted(
            &format!("create_vm:{}", node()),
            KEY_VM,
            effect(EffectKind::VmCreated, &node(), "hypervisor"),
            undo(CompensationAction::TerminateVm, "hypervisor", &node()),
        )
    }

    /// The VM step's intent, with no outcome recorded.
    fn vm_started(&mut self) -> &mut Self {
        self.on(
            BOOT,
            Event::step_started(
                stage::NETWORK,
                format!("create_vm:{}", node()),
                "hypervisor",
                KEY_VM,
                Some(undo(CompensationAction::TerminateVm, "hypervisor", &node())),
            ),
        )
    }

    fn boot_succeeded(&mut self) -> &mut Self {
        self.on(
            BOOT,
            Event::StageCompleted {
                stage: stage::NETWORK.into(),
            },
        )
        .on(BOOT, Event::OperationSucceeded {})
    }

    /// The boot fails in its network stage.
    fn boot_failed(&mut self) -> &mut Self {
        self.on(
            BOOT,
            Event::OperationFailed {
                stage: stage::NETWORK.into(),
                step: None,
                error: "injected".into(),
            },
        )
    }

    /// The boot fails and its whole plan is carried out: every compensation done.
    fn boot_rolled_back(&mut self) -> &mut Self {
        self.boot_rolls_back(false);
        self
    }

    /// The boot fails; its rollback does every compensation of its plan but the last and
    /// stops in `needs_attention`. Returns the compensation left.
    fn boot_needs_attention(&mut self) -> Uuid {
        self.boot_rolls_back(true)
            .expect("the plan undoes something")
    }

    /// The boot fails and its plan is carried out, all of it, or all but the last
    /// compensation (then `needs_attention`, and that one is returned).
    fn boot_rolls_back(&mut self, last_stuck: bool) -> Option<Uuid> {
        self.boot_failed();
        let plan = plan_rollback(&self.operation(BOOT), &[]).expect("a boot plans");
        let mut ids: Vec<Uuid> = plan
            .compensations
            .iter()
            .map(|c| c.compensation_id)
            .collect();
        assert!(!ids.is_empty(), "the plan undoes something");
        let stuck = if last_stuck { ids.pop() } else { None };
        self.on(BOOT, Event::RollbackPlanned { plan });
        for id in ids {
            self.on(
                BOOT,
                Event::CompensationRequested {
                    compensation_id: id,
                    attempt: 1,
                },
            )
            .on(
                BOOT,
                Event::CompensationDone {
                    compensation_id: id,
                },
            );
        }
        let (outcome, remaining) = match stuck {
            Some(id) => (RollbackOutcome::NeedsAttention, vec![id]),
            None => (RollbackOutcome::RolledBack, Vec::new()),
        };
        self.on(BOOT, Event::RollbackFinished { outcome, remaining });
        stuck
    }

    /// A later delete of `NODE` removes its IP forward (`resource_removed`).
    fn ip_removed_forward(&mut self, ip: &str) -> &mut Self {
        let target = AggregateId::instance(Uuid::from_u128(NODE));
        let mut removed = effect(EffectKind::Custom("resource_removed".into()), ip, "ipam");
        removed.detail.insert("node".into(), node());
        removed.detail.insert("action".into(), "release_ip".into());
        self.on(
            DELETE,
            Event::OperationStarted {
                kind: OperationKind::DeleteInstance,
                target,
                parent_id: None,
                stages: stages_of(OperationKind::DeleteInstance),
                bundle_policy: None,
            },
        )
        .on(
            DELETE,
            Event::StageStarted {
                stage: stage::TERMINATE.into(),
            },
        )
        .on(
            DELETE,
            Event::step_done(
                stage::TERMINATE,
                format!("release_ip:{}", node()),
                removed,
                None,
            ),
        )
        .on(
            DELETE,
            Event::StageCompleted {
                stage: stage::TERMINATE.into(),
            },
        )
        .on(DELETE, Event::OperationSucceeded {})
    }
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

fn undo(action: CompensationAction, executor: &str, resource: &str) -> Compensation {
    Compensation {
        action,
        executor: Executor::Service(executor.into()),
        resource: resource.into(),
        args: BTreeMap::new(),
    }
}

/// What an executor answers it holds.
fn held(resource: &str, key: Option<&str>, attrs: &[(&str, String)]) -> InventoryItem {
    InventoryItem {
        kind: "test".into(),
        resource: resource.into(),
        key: key.map(str::to_string),
        entity: None,
        attrs: attrs
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
        undo: None,
    }
}

fn drift(given: &Given, executor: &str, items: &[InventoryItem]) -> Vec<(FindingKind, String)> {
    given
        .findings(executor, items)
        .into_iter()
        .map(|f| (f.kind, f.resource))
        .collect()
}

/// The one finding drift reports at `executor`.
fn one_finding(given: &Given, executor: &str, items: &[InventoryItem]) -> Finding {
    let mut findings = given.findings(executor, items);
    assert_eq!(findings.len(), 1, "{findings:#?}");
    findings.remove(0)
}

#[test]
fn a_successful_boot_whose_resources_are_all_held_has_no_finding() {
    // Given a boot that acquired 10.0.0.5 and created the VM, and succeeded
    let given = Given::succeeded_boot();
    // When IPAM and the hypervisor hold exactly those, under their keys
    let ipam = [held("10.0.0.5", Some(KEY_IP), &[("node", node())])];
    let hypervisor = [held(&node(), Some(KEY_VM), &[])];
    // Then nothing is reported
    assert_eq!(drift(&given, "ipam", &ipam), vec![]);
    assert_eq!(drift(&given, "hypervisor", &hypervisor), vec![]);
}

#[test]
fn a_resource_no_operation_created_is_leaked() {
    // Given a successful boot
    let given = Given::succeeded_boot();
    // When IPAM also holds an IP made by hand, without a key
    let ipam = [
        held("10.0.0.5", Some(KEY_IP), &[("node", node())]),
        held("10.0.0.99", None, &[]),
    ];
    // Then that IP is leaked, with no operation to name and what to do
    let f = one_finding(&given, "ipam", &ipam);
    assert_eq!(
        (f.kind, f.resource.as_str()),
        (FindingKind::Leaked, "10.0.0.99")
    );
    assert_eq!(f.operation_id, None);
    assert!(f.action.contains("remove it at ipam"), "{}", f.action);
}

#[test]
fn a_resource_still_held_after_its_compensation_was_done_is_leaked_naming_the_step() {
    // Given a boot rolled back: its IP's release recorded done
    let mut given = Given::default();
    given
        .boot_started()
        .ip_acquired("10.0.0.5")
        .vm_created()
        .boot_rolled_back();
    // When IPAM still holds the IP under the step's key
    let ipam = [held("10.0.0.5", Some(KEY_IP), &[("node", node())])];
    // Then it is leaked, naming the boot and its acquire_ip step
    let f = one_finding(&given, "ipam", &ipam);
    assert_eq!(f.kind, FindingKind::Leaked);
    assert_eq!(f.operation_id, Some(Uuid::from_u128(BOOT)));
    assert_eq!(
        f.step.as_deref(),
        Some(format!("acquire_ip:{}", node()).as_str())
    );
    assert!(f.reason.contains("undone"), "{}", f.reason);
    // And nothing is reported once the executor no longer holds it
    assert_eq!(drift(&given, "ipam", &[]), vec![]);
}

#[test]
fn a_recorded_resource_the_executor_does_not_hold_is_missing() {
    // Given a successful boot
    let given = Given::succeeded_boot();
    // When the hypervisor holds no VM (deleted by hand)
    let f = one_finding(&given, "hypervisor", &[]);
    // Then the VM is missing, naming the entity, the boot and its step
    assert_eq!(
        (f.kind, f.resource.as_str()),
        (FindingKind::Missing, node().as_str())
    );
    assert_eq!(f.entity.as_deref(), Some(node().as_str()));
    assert_eq!(f.operation_id, Some(Uuid::from_u128(BOOT)));
    assert_eq!(
        f.step.as_deref(),
        Some(format!("create_vm:{}", node()).as_str())
    );
    assert!(f.action.contains("drift writes nothing"), "{}", f.action);
}

#[test]
fn another_ip_under_the_same_key_is_mismatched() {
    // Given a boot that recorded 10.0.0.5 for the node
    let given = Given::succeeded_boot();
    // When IPAM holds 10.0.0.7 under the step's key (changed by hand)
    let ipam = [held("10.0.0.7", Some(KEY_IP), &[("node", node())])];
    // Then one mismatch, naming both IPs; neither leaked nor missing
    let f = one_finding(&given, "ipam", &ipam);
    assert_eq!(f.kind, FindingKind::Mismatched);
    assert_eq!(f.differences.len(), 1);
    assert_eq!(
        (
            f.differences[0].ledger.as_str(),
            f.differences[0].executor.as_str()
        ),
        ("10.0.0.5", "10.0.0.7")
    );
    assert_eq!(f.operation_id, Some(Uuid::from_u128(BOOT)));
}

#[test]
fn a_recorded_resource_held_under_another_key_is_mismatched_never_leaked() {
    // Given a boot that recorded 10.0.0.5 for the node under the step's key
    let given = Given::succeeded_boot();
    // When IPAM holds 10.0.0.5 under another key (re-keyed at the executor)
    let ipam = [held("10.0.0.5", Some("another-key"), &[("node", node())])];
    // Then it is the ledger's resource: one mismatch on the key, neither leaked (which
    // `drift --fix leaked` would remove) nor missing
    let f = one_finding(&given, "ipam", &ipam);
    assert_eq!(f.kind, FindingKind::Mismatched, "{f:#?}");
    assert_eq!(f.differences.len(), 1, "{f:#?}");
    assert_eq!(f.differences[0].attr, "key");
    assert_eq!(
        (
            f.differences[0].ledger.as_str(),
            f.differences[0].executor.as_str()
        ),
        (KEY_IP, "another-key")
    );
    // And a leak removal planned from these findings removes nothing
    let plan = provledger_projections::leak_removal::plan_leak_removal(&[f]);
    assert!(plan.removals.is_empty(), "{plan:?}");
}

#[test]
fn an_ip_held_for_another_node_is_mismatched() {
    // Given a boot that recorded 10.0.0.5 for NODE
    let given = Given::succeeded_boot();
    // When IPAM says the IP is held for another node
    let other = Uuid::from_u128(OTHER_NODE).to_string();
    let ipam = [held("10.0.0.5", Some(KEY_IP), &[("node", other.clone())])];
    // Then the node attribute differs
    let f = one_finding(&given, "ipam", &ipam);
    assert_eq!(f.kind, FindingKind::Mismatched);
    assert_eq!(f.differences[0].attr, "node");
    assert_eq!(f.differences[0].executor, other);
}

#[test]
fn a_resource_removed_forward_by_a_later_operation_is_no_longer_expected() {
    // Given a boot, then a delete that released the IP forward
    let mut given = Given::default();
    given
        .boot_started()
        .ip_acquired("10.0.0.5")
        .vm_created()
        .boot_succeeded()
        .ip_removed_forward("10.0.0.5");
    // When IPAM holds nothing: then nothing is missing
    assert_eq!(drift(&given, "ipam", &[]), vec![]);
    // When IPAM still holds it: then it is leaked, naming the removal
    let ipam = [held("10.0.0.5", Some(KEY_IP), &[])];
    let f = one_finding(&given, "ipam", &ipam);
    assert_eq!(f.kind, FindingKind::Leaked);
    assert!(f.reason.contains("release_ip"), "{}", f.reason);
}

#[test]
fn an_operation_in_flight_and_a_step_of_unknown_outcome_report_nothing() {
    // Given a boot still running, with a VM step started and never settled
    let mut given = Given::default();
    given.boot_started().ip_acquired("10.0.0.5").vm_started();
    // When IPAM holds nothing and the hypervisor holds the VM under the started key
    // Then neither missing (in flight) nor leaked (its intent is recorded)
    assert_eq!(drift(&given, "ipam", &[]), vec![]);
    let hypervisor = [held(&node(), Some(KEY_VM), &[])];
    assert_eq!(drift(&given, "hypervisor", &hypervisor), vec![]);
}

#[test]
fn an_executor_that_keeps_no_keys_is_joined_by_resource() {
    // Given a successful boot
    let given = Given::succeeded_boot();
    // When IPAM answers the IP without its key
    let ipam = [held("10.0.0.5", None, &[("node", node())])];
    // Then it is matched by its name: no finding
    assert_eq!(drift(&given, "ipam", &ipam), vec![]);
}

#[test]
fn the_executors_to_ask_are_those_the_ledger_names() {
    // Given a boot with an IP and a VM (and a claim the ledger itself holds)
    let given = Given::succeeded_boot();
    // When the ledger side is derived
    let ledger = recorded_resources(&given.operations());
    // Then IPAM and the hypervisor are named, never the ledger
    let names: Vec<String> = ledger.executors().into_iter().collect();
    assert_eq!(names, vec!["hypervisor".to_string(), "ipam".to_string()]);
}

#[test]
fn a_step_of_unknown_outcome_in_a_closed_operation_is_never_missing() {
    // Given a boot whose VM step was started and never settled, that failed, and whose
    // rollback ended needs_attention (no compensation done)
    let mut given = Given::default();
    given.boot_started().ip_acquired("10.0.0.5").vm_started();
    given.boot_failed();
    let plan = plan_rollback(&given.operation(BOOT), &[]).expect("a boot plans");
    given.on(BOOT, Event::RollbackPlanned { plan }).on(
        BOOT,
        Event::RollbackFinished {
            outcome: RollbackOutcome::NeedsAttention,
            remaining: Vec::new(),
        },
    );
    assert!(given.operation(BOOT).is_closed());
    // When the hypervisor holds nothing: then the VM is not missing (it may never have
    // been made)
    assert_eq!(drift(&given, "hypervisor", &[]), vec![]);
    // And the IP, recorded and never released, is missing
    assert_eq!(
        drift(&given, "ipam", &[]),
        vec![(FindingKind::Missing, "10.0.0.5".to_string())]
    );
}

const FIX: u128 = 0x0190_0000_0000_7000_8000_0000_0000_0f01;

#[test]
fn a_leak_removal_adopts_the_leaked_resource_as_discovered_and_its_rollback_removes_it() {
    use provledger_projections::leak_removal::{leak_removal_events, plan_leak_removal};
    // Given a successful boot, and IPAM holding an IP made by hand that it can release
    let mut given = Given::succeeded_boot();
    let mut rogue = held("10.0.0.99", None, &[]);
    rogue.undo = Some(CompensationAction::ReleaseIp);
    let ipam = [held("10.0.0.5", Some(KEY_IP), &[("node", node())]), rogue];
    let findings = compare(&recorded_resources(&given.operations()), "ipam", &ipam);
    // When drift --fix leaked records its removal
    let plan = plan_leak_removal(&findings);
    assert_eq!(plan.removals.len(), 1, "{plan:#?}");
    for event in leak_removal_events(Uuid::from_u128(FIX), &plan, "ticket 42").expect("recorded") {
        given.on(FIX, event);
    }
    // Then while its rollback runs, the IP is the operation's: uncertain, not leaked
    assert_eq!(drift(&given, "ipam", &ipam), vec![]);
    // And the planner compensates the discovered IP (the one kind that does)
    let fix = given.operation(FIX);
    let plan = plan_rollback(&fix, &[]).expect("a cancelled remove_leaked plans");
    assert_eq!(plan.retained, vec![], "nothing kept: {plan:#?}");
    assert_eq!(plan.compensations.len(), 1);
    let c = &plan.compensations[0];
    assert_eq!(
        (&c.compensation.action, c.compensation.resource.as_str()),
        (&CompensationAction::ReleaseIp, "10.0.0.99")
    );
    // And once the removal is done and IPAM no longer holds it, drift is clean
    given
        .on(FIX, Event::RollbackPlanned { plan: plan.clone() })
        .on(
            FIX,
            Event::CompensationRequested {
                compensation_id: c.compensation_id,
                attempt: 1,
            },
        )
        .on(
            FIX,
            Event::CompensationDone {
                compensation_id: c.compensation_id,
            },
        )
        .on(
            FIX,
            Event::RollbackFinished {
                outcome: RollbackOutcome::RolledBack,
                remaining: Vec::new(),
            },
        );
    assert_eq!(drift(&given, "ipam", &ipam[..1]), vec![]);
    // But if IPAM still held it, it is leaked again, naming the removal that did not work
    let f = one_finding(&given, "ipam", &ipam);
    assert_eq!(f.operation_id, Some(Uuid::from_u128(FIX)));
}

#[test]
fn a_discovered_resource_of_any_other_operation_is_still_never_destroyed() {
    // Given a boot that recorded a discovered IP with a compensation, then failed
    let mut given = Given::default();
    let mut found = effect(EffectKind::IpAcquired, "10.0.0.7", "ipam");
    found.origin = Origin::Discovered;
    given.boot_started().on(
        BOOT,
        Event::step_done(
            stage::NETWORK,
            "adopt_ip",
            found,
            Some(undo(CompensationAction::ReleaseIp, "ipam", "10.0.0.7")),
        ),
    );
    given.boot_failed();
    // When planned, then the IP is kept, not released
    let plan = plan_rollback(&given.operation(BOOT), &[]).expect("plans");
    assert_eq!(plan.compensations.len(), 0, "{plan:#?}");
    assert_eq!(plan.retained.len(), 1);
}

#[test]
fn an_inventory_compared_a_page_at_a_time_finds_what_it_finds_whole() {
    // Given a successful boot, and IPAM holding its IP, a leak, and not the VM
    let given = Given::succeeded_boot();
    let ledger = recorded_resources(&given.operations());
    let ipam = [
        held("10.0.0.5", Some(KEY_IP), &[("node", node())]),
        held("10.0.0.99", None, &[]),
    ];
    // When IPAM's inventory comes in two pages
    let mut comparison = provledger_projections::drift::Comparison::new(&ledger, "ipam");
    let mut paged = comparison.items(&ipam[..1]);
    paged.extend(comparison.items(&ipam[1..]));
    paged.extend(comparison.finish());
    // Then the findings are those of the whole inventory at once
    assert_eq!(paged, compare(&ledger, "ipam", &ipam));
    assert_eq!(paged.len(), 1);
}

#[test]
fn a_missing_resource_removed_forward_since_no_longer_stands() {
    // Given a boot whose VM the hypervisor does not hold: missing, against that ledger
    let mut given = Given::succeeded_boot();
    let before = recorded_resources(&given.operations());
    let f = one_finding(&given, "ipam", &[]);
    assert_eq!(f.kind, FindingKind::Missing);
    let at_before = provledger_projections::drift::Comparison::new(&before, "ipam");
    assert!(at_before.still_missing(&f));
    // When a later delete removed the IP forward while drift asked
    given.ip_removed_forward("10.0.0.5");
    let after = recorded_resources(&given.operations());
    // Then the finding no longer stands
    let at_after = provledger_projections::drift::Comparison::new(&after, "ipam");
    assert!(!at_after.still_missing(&f));
}

#[test]
fn a_compensation_resolved_after_its_operation_closed_is_folded_from_its_history() {
    // Given a boot whose rollback stopped in needs_attention (closed: the commit-at-a-time
    // fold reduced it), then an operator resolving the stuck compensation by hand
    let mut given = Given::default();
    given.boot_started().ip_acquired("10.0.0.5").vm_created();
    let stuck = given.boot_needs_attention();
    let stuck_resource = given
        .operation(BOOT)
        .compensations
        .iter()
        .find(|c| c.planned.compensation_id == stuck)
        .map(|c| c.planned.compensation.resource.clone())
        .expect("the stuck compensation is planned");
    given.on(
        BOOT,
        Event::CompensationResolved {
            compensation_id: stuck,
            reason: "removed by hand".into(),
        },
    );
    // When drift folds the log a commit at a time
    let (_, reopened) = given.folded();
    // Then the late commit asked for the operation's history once
    assert_eq!(reopened, 1);
    // And a resource still held there is leaked "although the ledger records it undone",
    // the same as from the whole fold (Given::findings compares both)
    let executor = if stuck_resource == node() {
        "hypervisor"
    } else {
        "ipam"
    };
    let key = if executor == "ipam" { KEY_IP } else { KEY_VM };
    let f = one_finding(&given, executor, &[held(&stuck_resource, Some(key), &[])]);
    assert_eq!(f.kind, FindingKind::Leaked, "{f:#?}");
    assert!(f.reason.contains("records it undone"), "{}", f.reason);
}

#[test]
fn a_forged_commit_on_a_closed_operation_is_quarantined_not_folded() {
    // Given a succeeded boot (closed, reduced), and a commit appended after it whose link
    // to the chain is broken
    let given = Given::succeeded_boot();
    let mut commits = script::seal(&given.script);
    let mut forged = Given {
        script: given.script.clone(),
    };
    forged.on(BOOT, Event::OperationSucceeded {});
    let mut late = script::seal(&forged.script).pop().expect("the late commit");
    late.prev_hash = commits[0].hash;
    commits.push(late);
    // When folded a commit at a time
    let mut fold = DriftFold::new();
    let outcomes: Vec<Folded> = commits.iter().map(|c| fold.apply(c)).collect();
    // Then the forged commit is quarantined, and asks for no history
    assert!(
        matches!(outcomes.last(), Some(Folded::Quarantined(_))),
        "{:?}",
        outcomes.last()
    );
    assert_eq!(fold.counts(), (0, 1), "the boot is held reduced, not whole");
}

#[test]
fn a_history_that_does_not_rebuild_a_reduced_operation_is_refused_and_the_operation_kept() {
    // Given a boot reduced in needs_attention, and a later resolve of its stuck compensation
    let mut given = Given::default();
    given.boot_started().ip_acquired("10.0.0.5").vm_created();
    let stuck = given.boot_needs_attention();
    given.on(
        BOOT,
        Event::CompensationResolved {
            compensation_id: stuck,
            reason: "removed by hand".into(),
        },
    );
    let commits = script::seal(&given.script);
    let (late, earlier) = commits.split_last().expect("commits");
    let mut fold = DriftFold::new();
    for commit in earlier {
        assert_eq!(fold.apply(commit), Folded::Applied);
    }
    let executors = fold.resources().executors();
    assert_eq!(fold.apply(late), Folded::NeedsHistory(late.aggregate));
    // When the history handed back lacks its first commit, or its last
    let no_first = fold.reopen(late.aggregate, &earlier[1..]);
    let no_last = fold.reopen(late.aggregate, &earlier[..earlier.len() - 1]);
    // Then it is refused, and the operation is still held reduced with all it recorded
    assert!(no_first.is_err(), "{no_first:?}");
    assert!(no_last.is_err(), "{no_last:?}");
    assert_eq!(fold.counts(), (0, 1));
    assert_eq!(fold.resources().executors(), executors);
    assert_eq!(fold.apply(late), Folded::NeedsHistory(late.aggregate));
    // And the whole history is accepted, after which the late commit folds
    fold.reopen(late.aggregate, earlier)
        .expect("the whole history");
    assert_eq!(fold.apply(late), Folded::Applied);
}
