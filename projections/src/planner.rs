//! The rollback planner: from a stopped operation's folded commits to a deterministic
//! rollback plan. Pure: the same commits always give the same plan, with the same
//! compensation ids, so replicas that race to record it and drivers that retry it agree.
//!
//! The policy of the stage that failed decides the plan's shape (Sahara's rules, design 3):
//! - `compensate`: undo every completed step in reverse order of the effects, and move the
//!   target to Error, keeping its record;
//! - `hold`: keep every resource, move the target to Error and list what remains;
//! - `roll_forward`: undo what the operation created, finish the removals it started
//!   (decommissioned nodes are terminated, and whatever else the decommission step listed
//!   in its `removal` detail is removed), and return the target to Active.
//!
//! Whatever the policy, three safety rules hold for every planned step:
//! - a resource that provledger did not create (`Origin::Discovered`) is never destroyed;
//! - a node that this operation configured or started is never terminated unless it was
//!   decommissioned, because it may hold data;
//! - steps of a `hold` stage are kept even when a later stage compensates.
//!
//! The one exception is deletion: when the user deleted the target
//! (`TargetDeletionNoticed`), everything the operation created goes, data-holding nodes
//! included, because the user asked for it. Discovered resources are still kept.
//!
//! A `remove_leaked` operation is the one kind whose discovered resources are compensated:
//! an operator recorded them (resources `provledger drift` found leaked) in order to have
//! them removed through this ordinary path.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use provledger_events::catalogue::{
    BundlePolicy, Compensation, CompensationAction, DetailKey, EffectKind, Executor, OperationKind,
    Origin, PlannedCompensation, RetainedResource, RollbackPlan, StagePolicy, TargetOutcome,
};
use provledger_events::{short_aggregate, short_id};
use uuid::Uuid;

use crate::operation::{OperationState, OperationStatus, StartedStep, StepState};

/// The namespace of compensation ids (UUID v5): a compensation's id is a function of the
/// operation, the step and the action, so every planner computes the same one.
pub const COMPENSATION_ID_NAMESPACE: Uuid =
    Uuid::from_u128(0x8f0e_4d1c_6b7a_4e59_9c3d_2a1b_0f9e_8d7c);

/// The executor a forward termination is sent to when the decommission step does not name
/// one (`detail["terminate_executor"]`).
pub const TERMINATE_EXECUTOR_DEFAULT: &str = "hypervisor";

/// The decommission effect's detail key holding the node's removal list: a JSON array of
/// [`Compensation`]s that undo everything of the node except its VM and its allocation
/// (its plugin record, DNS, DHCP, IP). A roll-forward plans them after the VM's
/// termination, so that finishing a removal leaves nothing of the node at any executor.
pub const REMOVAL_DETAIL: &str = DetailKey::Removal.as_str();

/// The effect detail key naming the node a resource belongs to (an IP, a DHCP or DNS entry
/// is named in its executor's terms, not by the node), so its removal can be found later.
pub const NODE_DETAIL: &str = DetailKey::Node.as_str();

/// The plugin's compensation of a configure step: forget the node.
pub const REMOVE_NODE_ACTION: &str = "remove_node";

/// The effect kind of a forward step that removed one resource of a node (its detail
/// carries `action` and `node`). A roll-forward does not request that removal again.
pub const RESOURCE_REMOVED_EFFECT: &str = "resource_removed";

/// Why no plan can be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanRefusal {
    #[error("operation {operation} has no recorded start; nothing to roll back")]
    NotStarted { operation: Uuid },
    #[error(
        "operation {operation} has status {status}: there is nothing to roll back (only a failed or cancelled operation is rolled back)"
    )]
    NotStopped { operation: Uuid, status: String },
    #[error("operation {operation} already has a recorded rollback plan")]
    AlreadyPlanned { operation: Uuid },
    #[error("bundle {operation}: child operation {child} is not among the children given to the planner")]
    ChildMissing { operation: Uuid, child: Uuid },
}

/// How the plan treats the operation's completed steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Policy(StagePolicy),
    /// The user deleted the target: everything created goes.
    TargetDeleted,
}

/// The deterministic id of the compensation that undoes step number `step_index`.
pub fn compensation_id(
    operation: Uuid,
    step_index: usize,
    stage: &str,
    step: &str,
    action: &CompensationAction,
) -> Uuid {
    // The action's contract word (its JSON name; `custom:` and the name for a custom one),
    // never its Debug form, which is not a stable format across compiler versions.
    let word = match action {
        CompensationAction::Custom(name) => format!("custom:{name}"),
        other => action_word(other),
    };
    let name = format!("{operation}/{step_index}/{stage}/{step}/{word}");
    Uuid::new_v5(&COMPENSATION_ID_NAMESPACE, name.as_bytes())
}

/// Plans the rollback of a failed or cancelled operation. `children` holds the folded
/// child operations of a bundle (ignored otherwise).
pub fn plan_rollback(
    op: &OperationState,
    children: &[OperationState],
) -> Result<RollbackPlan, PlanRefusal> {
    let operation = op.header.id.id;
    let (Some(kind), Some(target)) = (op.kind, op.target) else {
        return Err(PlanRefusal::NotStarted { operation });
    };
    if op.rollback_plan.is_some() {
        return Err(PlanRefusal::AlreadyPlanned { operation });
    }
    if !matches!(
        op.status,
        Some(OperationStatus::Failed) | Some(OperationStatus::Cancelled)
    ) {
        return Err(PlanRefusal::NotStopped {
            operation,
            // The contract's word (`succeeded`, `needs_attention`), as JSON shows it.
            status: op
                .status
                .map_or_else(|| "none".to_string(), |s| json_word(&s)),
        });
    }
    let failed_stage = op
        .error
        .as_ref()
        .map(|e| e.stage.clone())
        .or_else(|| op.current_stage.clone());
    let mode = if op.target_deleted {
        Mode::TargetDeleted
    } else {
        // No stage started: nothing was done, and compensating nothing is the safe shape.
        Mode::Policy(
            failed_stage
                .as_deref()
                .and_then(|s| op.stage_policy(s))
                .unwrap_or(StagePolicy::Compensate),
        )
    };
    let mut builder = PlanBuilder::default();
    if kind == OperationKind::Bundle {
        plan_bundle(op, children, mode, &mut builder)?;
    } else {
        if mode == Mode::Policy(StagePolicy::RollForward) {
            builder.finish_removals(op);
        }
        builder.undo_steps(op, mode, None);
    }
    builder.keep_same_host_releases();
    let stage = failed_stage.as_deref().unwrap_or("(before any stage)");
    Ok(RollbackPlan {
        rule: rule_text(kind, mode, stage, op.bundle_policy),
        target,
        target_outcome: target_outcome(op, kind, mode, stage, &builder),
        compensations: builder.compensations,
        retained: builder.retained,
    })
}

#[derive(Default)]
struct PlanBuilder {
    compensations: Vec<PlannedCompensation>,
    retained: Vec<RetainedResource>,
}

/// What this operation did to each node, for the data-safety rule.
#[derive(Default)]
struct NodeFacts {
    configured: bool,
    decommissioned: bool,
    terminated: bool,
}

fn node_facts(op: &OperationState) -> BTreeMap<&str, NodeFacts> {
    let mut facts: BTreeMap<&str, NodeFacts> = BTreeMap::new();
    for step in &op.steps {
        let entry = facts.entry(step.effect.resource.as_str()).or_default();
        match step.effect.kind {
            EffectKind::NodeConfigured | EffectKind::NodeStarted => entry.configured = true,
            EffectKind::NodeDecommissioned => entry.decommissioned = true,
            EffectKind::NodeTerminated => entry.terminated = true,
            _ => {}
        }
    }
    facts
}

impl PlanBuilder {
    fn retain(&mut self, label: &str, step: &StepState, why: String) {
        self.retained.push(RetainedResource {
            stage: label.to_string(),
            step: step.name.clone(),
            resource: step.effect.resource.clone(),
            why,
        });
    }

    fn plan(&mut self, op: Uuid, index: usize, label: &str, step: &str, c: Compensation) {
        self.compensations.push(PlannedCompensation {
            compensation_id: compensation_id(op, index, label, step, &c.action),
            stage: label.to_string(),
            step: step.to_string(),
            compensation: c,
        });
    }

    /// Plans the entries of a decommission step's removal list (`detail["removal"]`), in
    /// their order. An absent or unparsable list plans nothing more (the VM and the
    /// allocation are still removed). Never planned: a resource this operation knows as
    /// discovered, a removal the operation already carried out forward (a
    /// `resource_removed` effect: requesting it again could hit a resource that was since
    /// handed to someone else, e.g. a reused IP), and a duplicate.
    fn plan_removal_list(&mut self, op: &OperationState, index: usize, step: &StepState) {
        let Some(list) = step.effect.detail.get(REMOVAL_DETAIL) else {
            return;
        };
        let Ok(list) = serde_json::from_str::<Vec<Compensation>>(list) else {
            return;
        };
        let operation = op.header.id.id;
        for c in list {
            let discovered = op
                .steps
                .iter()
                .any(|s| s.effect.resource == c.resource && s.effect.origin == Origin::Discovered);
            if discovered {
                self.retained.push(RetainedResource {
                    stage: step.stage.clone(),
                    step: step.name.clone(),
                    resource: c.resource.clone(),
                    why: "discovered, not created by provledger: listed for removal but never \
                          destroyed"
                        .into(),
                });
                continue;
            }
            if removed_forward(op, &c) {
                continue;
            }
            // Two entries of one step may share an action (two `Custom` removals with the
            // same name): the resource is part of these entries' id name. The termination
            // and the release of the same step keep their ids (the resource is not in
            // theirs), so plans recorded before removal lists existed are unchanged.
            let id_name = format!("{}/{}", step.name, c.resource);
            let compensation_id =
                compensation_id(operation, index, &step.stage, &id_name, &c.action);
            let duplicate = self.compensations.iter().any(|p| {
                p.compensation_id == compensation_id
                    || (p.step == step.name
                        && p.stage == step.stage
                        && p.compensation.action == c.action
                        && p.compensation.executor == c.executor
                        && p.compensation.resource == c.resource)
            });
            if duplicate {
                continue;
            }
            self.compensations.push(PlannedCompensation {
                compensation_id,
                stage: step.stage.clone(),
                step: step.name.clone(),
                compensation: c,
            });
        }
    }

    /// Undoes `op`'s completed steps in reverse order of their effects, as `mode` and the
    /// safety rules allow. `label` prefixes the stage names (a bundle's child).
    fn undo_steps(&mut self, op: &OperationState, mode: Mode, label: Option<&str>) {
        let facts = node_facts(op);
        let operation = op.header.id.id;
        // The latest actions first: a step whose outcome is unknown was the last one the
        // runner asked for (or one that failed at its executor, maybe half done).
        self.undo_unknown_outcomes(op, mode, label);
        for (index, step) in op.steps.iter().enumerate().rev() {
            let stage_label = match label {
                Some(l) => format!("{l}/{}", step.stage),
                None => step.stage.clone(),
            };
            let Some(compensation) = &step.compensation else {
                // Nothing to undo (a configuration, a termination, ...). A node whose
                // removal a holding stage started stays, and the plan says so.
                let removal_started = step.effect.kind == EffectKind::NodeDecommissioned
                    && !facts
                        .get(step.effect.resource.as_str())
                        .is_some_and(|f| f.terminated);
                if removal_started && mode == Mode::Policy(StagePolicy::Hold) {
                    self.retain(
                        &stage_label,
                        step,
                        "decommissioned, not removed: a holding stage deletes no node".into(),
                    );
                }
                continue;
            };
            if step.effect.origin == Origin::Discovered && !adopted_to_remove(op) {
                self.retain(
                    &stage_label,
                    step,
                    "discovered, not created by provledger: never destroyed".into(),
                );
                continue;
            }
            if let Some(why) = keep_reason(op, step, compensation, mode, &facts) {
                self.retain(&stage_label, step, why);
                continue;
            }
            let mut compensation = compensation.clone();
            if compensation.action == CompensationAction::ReturnToSource && label.is_some() {
                // Undone from a bundle's plan: the migration is the child, not the bundle
                // the driver rolls back.
                compensation
                    .args
                    .entry(DetailKey::MigrationId.to_string())
                    .or_insert_with(|| operation.to_string());
            }
            self.plan(operation, index, &stage_label, &step.name, compensation);
        }
    }

    /// A migration to the same host (Nova's resize to the same host): the source given
    /// back is the instance's allocation there, so the release of its "destination" on
    /// that same provider, planned after it, must not run; it is kept, and the plan says
    /// why.
    fn keep_same_host_releases(&mut self) {
        let returned: Vec<(String, Option<String>)> = self
            .compensations
            .iter()
            .filter(|p| p.compensation.action == CompensationAction::ReturnToSource)
            .map(|p| {
                (
                    p.compensation.resource.clone(),
                    p.compensation
                        .args
                        .get(DetailKey::ProviderId.as_str())
                        .cloned(),
                )
            })
            .collect();
        let same_host = |p: &PlannedCompensation| {
            p.compensation.action == CompensationAction::ReleaseAllocation
                && returned.iter().any(|(resource, provider)| {
                    *resource == p.compensation.resource
                        && provider.is_some()
                        && *provider
                            == p.compensation
                                .args
                                .get(DetailKey::ProviderId.as_str())
                                .cloned()
                })
        };
        let (kept, planned): (Vec<_>, Vec<_>) = std::mem::take(&mut self.compensations)
            .into_iter()
            .partition(same_host);
        self.compensations = planned;
        for p in kept {
            self.retained.push(RetainedResource {
                stage: p.stage,
                step: p.step,
                resource: p.compensation.resource,
                why: "the migration's source is this same provider: the source given back is \
                      this allocation"
                    .into(),
            });
        }
    }

    /// Steps started with an intent (`StepStarted`) and no recorded outcome: the executor
    /// may have acted under the step's idempotency key, so its compensation is planned
    /// by that key, under the same stage rules as a done step's (a holding stage keeps
    /// it for an operator). An executor that did nothing answers that there was nothing
    /// to undo.
    fn undo_unknown_outcomes(&mut self, op: &OperationState, mode: Mode, label: Option<&str>) {
        let operation = op.header.id.id;
        for (index, started) in op.started.iter().enumerate().rev() {
            let Some(compensation) = &started.compensation else {
                continue;
            };
            let stage_label = match label {
                Some(l) => format!("{l}/{}", started.stage),
                None => started.stage.clone(),
            };
            let hold = match mode {
                Mode::TargetDeleted => false,
                Mode::Policy(p) => {
                    p == StagePolicy::Hold
                        || op.stage_policy(&started.stage) == Some(StagePolicy::Hold)
                }
            };
            if hold {
                self.retained.push(RetainedResource {
                    stage: stage_label,
                    step: started.name.clone(),
                    resource: unknown_resource(started),
                    why: "outcome unknown, in a holding stage: kept for an operator (the \
                          executor knows it by its idempotency key)"
                        .into(),
                });
                continue;
            }
            let mut compensation = compensation.clone();
            compensation
                .args
                .entry(DetailKey::IdempotencyKey.to_string())
                .or_insert_with(|| started.idempotency_key.clone());
            // Not the id of a done step's compensation: the name says "started", and a
            // `StepDone` recorded later (a late runner) settles the intent before any plan.
            let id_name = format!("started:{}", started.name);
            self.compensations.push(PlannedCompensation {
                compensation_id: compensation_id(
                    operation,
                    index,
                    &stage_label,
                    &id_name,
                    &compensation.action,
                ),
                stage: stage_label,
                step: started.name.clone(),
                compensation,
            });
        }
    }

    /// Roll forward: every node whose removal this operation started (decommissioned) and
    /// did not finish (no termination recorded) is terminated, the rest of it (the
    /// decommission step's removal list: plugin record, DNS, DHCP, IP) is removed, and its
    /// allocation released, in that order.
    fn finish_removals(&mut self, op: &OperationState) {
        let facts = node_facts(op);
        let operation = op.header.id.id;
        for (index, step) in op.steps.iter().enumerate() {
            if step.effect.kind != EffectKind::NodeDecommissioned {
                continue;
            }
            let node = step.effect.resource.as_str();
            if facts.get(node).is_some_and(|f| f.terminated) {
                continue;
            }
            if step.effect.origin == Origin::Discovered {
                self.retain(
                    &step.stage,
                    step,
                    "discovered, not created by provledger: decommissioned but never destroyed"
                        .into(),
                );
                continue;
            }
            let executor = step
                .effect
                .detail
                .get(DetailKey::TerminateExecutor.as_str())
                .cloned()
                .unwrap_or_else(|| TERMINATE_EXECUTOR_DEFAULT.to_string());
            let mut args = BTreeMap::new();
            for key in [
                DetailKey::ClusterId,
                DetailKey::NodeGroup,
                DetailKey::ProviderId,
            ]
            .map(DetailKey::as_str)
            {
                if let Some(v) = step.effect.detail.get(key) {
                    args.insert(key.to_string(), v.clone());
                }
            }
            let terminate = Compensation {
                action: CompensationAction::TerminateVm,
                executor: Executor::Service(executor),
                resource: node.to_string(),
                args: args.clone(),
            };
            self.plan(operation, index, &step.stage, &step.name, terminate);
            self.plan_removal_list(op, index, step);
            if args.contains_key(DetailKey::ProviderId.as_str()) {
                let release = Compensation {
                    action: CompensationAction::ReleaseAllocation,
                    executor: Executor::Ledger,
                    resource: node.to_string(),
                    args,
                };
                self.plan(operation, index, &step.stage, &step.name, release);
            }
        }
    }
}

/// Whether the operation already removed `c`'s resource forward: a step whose effect is
/// `resource_removed` on the same resource, by the same executor, with the same action.
/// How a plan names a resource it knows only by its step's idempotency key.
fn unknown_resource(started: &StartedStep) -> String {
    match started.compensation.as_ref().map(|c| c.resource.as_str()) {
        Some(resource) if !resource.is_empty() => resource.to_string(),
        _ => format!("{} key {}", started.executor, started.idempotency_key),
    }
}

fn removed_forward(op: &OperationState, c: &Compensation) -> bool {
    let Executor::Service(executor) = &c.executor else {
        return false;
    };
    let action = action_word(&c.action);
    op.steps.iter().any(|s| {
        s.effect.kind == EffectKind::Custom(RESOURCE_REMOVED_EFFECT.into())
            && s.effect.resource == c.resource
            && s.effect.executor == *executor
            && s.effect.detail.get(DetailKey::Action.as_str()) == Some(&action)
    })
}

/// Why a step's resource must be kept, if it must.
fn keep_reason(
    op: &OperationState,
    step: &StepState,
    compensation: &Compensation,
    mode: Mode,
    facts: &BTreeMap<&str, NodeFacts>,
) -> Option<String> {
    let policy = match mode {
        Mode::TargetDeleted => return None,
        Mode::Policy(p) => p,
    };
    if policy == StagePolicy::Hold {
        return Some(
            "the failed stage holds: kept for an operator, the target goes to error".into(),
        );
    }
    if op.stage_policy(&step.stage) == Some(StagePolicy::Hold) {
        return Some(format!(
            "done in stage {:?}, which holds its resources",
            step.stage
        ));
    }
    // A configure step's compensation (the plugin forgets the node) falls under the same
    // rule as the node's termination: a node that may hold data keeps its VM and its
    // plugin record, unless it was decommissioned or the user deleted the target.
    let undoes_configuration = matches!(
        step.effect.kind,
        EffectKind::NodeConfigured | EffectKind::NodeStarted
    );
    if compensation.action == CompensationAction::TerminateVm || undoes_configuration {
        let node = facts.get(compensation.resource.as_str());
        if node.is_some_and(|f| f.configured && !f.decommissioned) {
            return Some("configured and not decommissioned: may hold data".into());
        }
    }
    None
}

fn plan_bundle(
    op: &OperationState,
    children: &[OperationState],
    mode: Mode,
    builder: &mut PlanBuilder,
) -> Result<(), PlanRefusal> {
    let operation = op.header.id.id;
    let failed_child: Option<Uuid> = op
        .error
        .as_ref()
        .and_then(|e| e.step.as_deref())
        .and_then(|s| s.parse().ok());
    let child_mode = match (mode, op.bundle_policy) {
        (Mode::TargetDeleted, _) => Mode::TargetDeleted,
        (_, Some(BundlePolicy::RetainSiblings)) => Mode::Policy(StagePolicy::Hold),
        _ => Mode::Policy(StagePolicy::Compensate),
    };
    for child_id in op.children.iter().rev() {
        let child = children
            .iter()
            .find(|c| c.header.id.id == *child_id)
            .ok_or(PlanRefusal::ChildMissing {
                operation,
                child: *child_id,
            })?;
        // A child that stopped on its own is rolled back by its own plan.
        if Some(*child_id) == failed_child
            || child.rollback_plan.is_some()
            || !child_closed_ok(child)
        {
            continue;
        }
        let label = format!("child {child_id}");
        match child_mode {
            Mode::Policy(StagePolicy::Hold) => {
                for step in child.steps.iter().filter(|s| s.compensation.is_some()) {
                    builder.retain(
                        &format!("{label}/{}", step.stage),
                        step,
                        "bundle policy retain_siblings: sibling kept".into(),
                    );
                }
            }
            _ => {
                builder.undo_steps(child, child_mode, Some(&label));
                // Ids come from the child, so a later plan of the child itself agrees.
            }
        }
    }
    Ok(())
}

/// Whether `op` adopted its discovered resources in order to remove them (an operator's
/// `drift --fix leaked`, `OperationKind::RemoveLeaked`): the one exception to "discovered
/// resources are never destroyed", because removing them is what the operator recorded.
fn adopted_to_remove(op: &OperationState) -> bool {
    op.kind == Some(OperationKind::RemoveLeaked)
}

/// A child that succeeded (or is still running, which the bundle runner prevents).
fn child_closed_ok(child: &OperationState) -> bool {
    child.status == Some(OperationStatus::Succeeded)
}

fn rule_text(kind: OperationKind, mode: Mode, stage: &str, bundle: Option<BundlePolicy>) -> String {
    let kind_word = json_word(&kind);
    let what = match (kind, mode) {
        (_, Mode::TargetDeleted) => {
            "the user deleted the target: compensate everything the operation created, \
             data-holding nodes included; discovered resources are kept"
                .to_string()
        }
        (OperationKind::RemoveLeaked, _) => {
            "an operator removes resources drift found leaked: each is compensated at its \
             executor"
                .into()
        }
        (OperationKind::Bundle, _) => match bundle {
            Some(BundlePolicy::RetainSiblings) => {
                "a child failed; bundle policy retain_siblings: the siblings are kept".into()
            }
            _ => "a child failed; bundle policy roll_back_siblings: every sibling's effects are \
                  compensated in reverse order"
                .into(),
        },
        (_, Mode::Policy(StagePolicy::Compensate)) => {
            "compensate: undo every completed step in reverse order of the effects; the target \
             goes to error and its record is kept"
                .into()
        }
        (_, Mode::Policy(StagePolicy::Hold)) => {
            "hold: delete no node, since nodes not decommissioned or not configured may hold \
             data; the target goes to error with what remains"
                .into()
        }
        (OperationKind::DeleteCluster | OperationKind::DeleteInstance, _) => {
            "roll_forward: a removal is never undone; the delete is re-driven until nothing \
             remains"
                .into()
        }
        (_, Mode::Policy(StagePolicy::RollForward)) => {
            "roll_forward: delete the new nodes, finish removing the decommissioned ones; the \
             target returns to active with the failure described"
                .into()
        }
    };
    format!("{kind_word}: stage {stage:?} stopped; {what}")
}

fn target_outcome(
    op: &OperationState,
    kind: OperationKind,
    mode: Mode,
    stage: &str,
    builder: &PlanBuilder,
) -> TargetOutcome {
    let cause = match (&op.error, &op.cancellation_reason) {
        (Some(e), _) => format!("failed in stage {stage}: {}", e.message),
        (None, Some(reason)) => format!("cancelled in stage {stage}: {reason}"),
        (None, None) => format!("stopped in stage {stage}"),
    };
    let kept = if builder.retained.is_empty() {
        String::new()
    } else {
        format!("; {} resource(s) kept", builder.retained.len())
    };
    match (kind, mode) {
        (_, Mode::TargetDeleted) => TargetOutcome::Deleted,
        (OperationKind::DeleteCluster | OperationKind::DeleteInstance, _) => TargetOutcome::Deleted,
        (_, Mode::Policy(StagePolicy::RollForward)) => TargetOutcome::Active {
            description: format!("{cause}; new nodes removed, decommissioned nodes removed{kept}"),
        },
        _ => TargetOutcome::Error {
            description: format!("{cause}{kept}"),
        },
    }
}

/// A plan as text, for the CLI, the demo and the snapshot tests. Ids are shown short.
pub fn render_plan(plan: &RollbackPlan) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "rule: {}", plan.rule);
    let outcome = match &plan.target_outcome {
        TargetOutcome::Error { description } => format!("error ({description})"),
        TargetOutcome::Active { description } => format!("active ({description})"),
        TargetOutcome::Deleted => "deleted".to_string(),
    };
    let _ = writeln!(
        out,
        "target: {} -> {outcome}",
        short_aggregate(&plan.target)
    );
    if plan.compensations.is_empty() {
        let _ = writeln!(out, "compensations: none");
    } else {
        let _ = writeln!(out, "compensations, in order:");
    }
    for (i, c) in plan.compensations.iter().enumerate() {
        let executor = match &c.compensation.executor {
            Executor::Ledger => "ledger".to_string(),
            Executor::Service(s) => s.clone(),
        };
        let _ = writeln!(
            out,
            "  {}. {} {} by {executor}  [{}/{}]  id {}",
            i + 1,
            action_word(&c.compensation.action),
            c.compensation.resource,
            c.stage,
            c.step,
            short_id(&c.compensation_id),
        );
    }
    if plan.retained.is_empty() {
        let _ = writeln!(out, "retained: none");
    } else {
        let _ = writeln!(out, "retained:");
    }
    for r in &plan.retained {
        let _ = writeln!(
            out,
            "  - {} [{}/{}]: {}",
            r.resource, r.stage, r.step, r.why
        );
    }
    out
}

/// The action's name in the JSON form.
pub fn action_word(action: &CompensationAction) -> String {
    match action {
        CompensationAction::Custom(name) => name.clone(),
        other => json_word(other),
    }
}

/// A unit enum variant's name in the JSON form (snake_case), or its Debug form.
pub fn json_word<T: serde::Serialize + std::fmt::Debug>(value: &T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{value:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compensation ids are recorded and executors deduplicate by them: the derivation is
    /// pinned to the action's contract word, so it cannot drift with a `Debug` format.
    #[test]
    fn compensation_ids_are_derived_from_the_actions_contract_word() {
        let op = Uuid::from_u128(1);
        let id = compensation_id(
            op,
            3,
            "network",
            "acquire_ip:1",
            &CompensationAction::ReleaseIp,
        );
        let name = format!("{op}/3/network/acquire_ip:1/release_ip");
        assert_eq!(
            id,
            Uuid::new_v5(&COMPENSATION_ID_NAMESPACE, name.as_bytes())
        );
        let custom = CompensationAction::Custom("remove_node".into());
        let id = compensation_id(op, 3, "configure", "configure:1", &custom);
        let name = format!("{op}/3/configure/configure:1/custom:remove_node");
        assert_eq!(
            id,
            Uuid::new_v5(&COMPENSATION_ID_NAMESPACE, name.as_bytes())
        );
    }
}
