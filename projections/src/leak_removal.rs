//! `drift --fix leaked`: from drift's `leaked` findings to the one commit that records
//! their removal (`docs/drift.md` section 5). Pure: the operation's id is handed in, the
//! clock is the caller's, and nothing here asks an executor.
//!
//! A leaked resource is removed through the ordinary compensation path, so that its
//! removal is recorded like any other undo (requested, retried, done or `needs_attention`,
//! audited): a `remove_leaked` operation records each resource as a **discovered** effect
//! (provledger did not make it) with the compensation its executor named (the inventory
//! item's `undo`), and is cancelled in the same commit with the operator's reason. The
//! planner compensates the discovered effects of that kind alone, and the rollback driver
//! carries the removals out. Afterwards the ledger holds the whole story: found by drift,
//! adopted, removed, by whom and why.

use std::collections::{BTreeMap, BTreeSet};

use provledger_events::catalogue::{
    Compensation, DetailKey, Effect, EffectKind, Event, Executor, OperationKind, Origin,
};
use provledger_events::AggregateId;
use uuid::Uuid;

use crate::drift::{Finding, FindingKind, LEDGER_EXECUTOR};
use crate::planner::NODE_DETAIL;
use crate::stages::{stage, stages_of};

/// The effect kind a `remove_leaked` operation records for each resource it adopts.
pub const LEAKED_EFFECT: &str = "leaked_resource";

/// The effect detail key naming the inventory's word for what the resource is.
pub const FOUND_BY_DETAIL: &str = "found_by";

/// One leaked resource drift will remove, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeakRemoval {
    /// The step that records it: `remove_leaked:<executor>:<resource>`, unique per plan.
    pub step: String,
    pub executor: String,
    pub resource: String,
    pub entity: Option<String>,
    pub compensation: Compensation,
}

/// A leaked resource drift will not remove, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unremovable {
    pub executor: String,
    pub resource: String,
    pub why: String,
}

/// What `drift --fix leaked` will do: remove some, leave the others (with why).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeakRemovalPlan {
    pub removals: Vec<LeakRemoval>,
    pub unremovable: Vec<Unremovable>,
}

/// Why a leak removal is not recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeakRemovalRefusal {
    #[error("a removal needs a reason (--reason TEXT): it stays in the log with who asked")]
    NoReason,
    #[error("no leaked resource can be removed: nothing to record")]
    NothingToRemove,
}

/// The removals `findings` allow: every `leaked` finding whose executor named an `undo`
/// action, once per (executor, resource); the others are listed with why. Findings of
/// other kinds are never acted on (`missing` is the entity's operator's to decide).
pub fn plan_leak_removal(findings: &[Finding]) -> LeakRemovalPlan {
    let mut plan = LeakRemovalPlan::default();
    let mut seen = BTreeSet::new();
    for f in findings.iter().filter(|f| f.kind == FindingKind::Leaked) {
        if !seen.insert((f.executor.as_str(), f.resource.as_str())) {
            continue;
        }
        let unremovable = |why: String| Unremovable {
            executor: f.executor.clone(),
            resource: f.resource.clone(),
            why,
        };
        if f.executor == LEDGER_EXECUTOR {
            plan.unremovable.push(unremovable(
                "the ledger's own resources are audit's, not drift's".into(),
            ));
            continue;
        }
        if f.resource.is_empty() {
            plan.unremovable
                .push(unremovable("the executor named no resource".into()));
            continue;
        }
        let Some(action) = f.undo.clone() else {
            plan.unremovable.push(unremovable(format!(
                "{} named no undo action for it in its inventory: remove it at {} by hand",
                f.executor, f.executor
            )));
            continue;
        };
        let mut args = BTreeMap::new();
        if let Some(key) = &f.key {
            // The executor removes by key what it made under it (docs/writing-operations.md).
            args.insert(DetailKey::IdempotencyKey.to_string(), key.clone());
        }
        plan.removals.push(LeakRemoval {
            step: format!("{}:{}:{}", stage::REMOVE_LEAKED, f.executor, f.resource),
            executor: f.executor.clone(),
            resource: f.resource.clone(),
            entity: f.entity.clone(),
            compensation: Compensation {
                action,
                executor: Executor::Service(f.executor.clone()),
                resource: f.resource.clone(),
                args,
            },
        });
    }
    plan
}

/// The one commit of the `remove_leaked` operation `operation`: started, its stage, one
/// discovered effect per removal with the compensation that removes it, and its
/// cancellation with `reason` (which the rollback then carries out).
pub fn leak_removal_events(
    operation: Uuid,
    plan: &LeakRemovalPlan,
    reason: &str,
) -> Result<Vec<Event>, LeakRemovalRefusal> {
    let reason = reason.trim();
    if reason.is_empty() {
        return Err(LeakRemovalRefusal::NoReason);
    }
    if plan.removals.is_empty() {
        return Err(LeakRemovalRefusal::NothingToRemove);
    }
    let mut events = vec![
        Event::operation_started(
            OperationKind::RemoveLeaked,
            AggregateId::operation(operation),
            None,
            stages_of(OperationKind::RemoveLeaked),
            None,
        ),
        Event::stage_started(stage::REMOVE_LEAKED),
    ];
    for r in &plan.removals {
        let mut detail = BTreeMap::new();
        detail.insert(FOUND_BY_DETAIL.to_string(), "drift".to_string());
        if let Some(entity) = &r.entity {
            detail.insert(NODE_DETAIL.to_string(), entity.clone());
        }
        events.push(Event::StepDone {
            stage: stage::REMOVE_LEAKED.to_string(),
            step: r.step.clone(),
            effect: Effect {
                kind: EffectKind::Custom(LEAKED_EFFECT.into()),
                resource: r.resource.clone(),
                executor: r.executor.clone(),
                origin: Origin::Discovered,
                detail,
            },
            compensation: Some(r.compensation.clone()),
        });
    }
    events.push(Event::OperationCancelled {
        reason: format!("drift --fix leaked: {reason}"),
    });
    Ok(events)
}

/// The plan as text: one line per removal, then what stays and why.
pub fn render_leak_removal(plan: &LeakRemovalPlan) -> String {
    let mut out = String::new();
    for r in &plan.removals {
        out.push_str(&format!(
            "remove     {} {} ({} at {}{})\n",
            r.executor,
            r.resource,
            crate::planner::action_word(&r.compensation.action),
            r.executor,
            r.compensation
                .args
                .get(DetailKey::IdempotencyKey.as_str())
                .map(|k| format!(", key {k}"))
                .unwrap_or_default()
        ));
    }
    for u in &plan.unremovable {
        out.push_str(&format!(
            "keep       {} {}: {}\n",
            u.executor, u.resource, u.why
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use provledger_events::catalogue::CompensationAction;

    fn leaked(executor: &str, resource: &str, undo: Option<CompensationAction>) -> Finding {
        Finding {
            kind: FindingKind::Leaked,
            executor: executor.into(),
            resource: resource.into(),
            key: None,
            entity: None,
            operation_id: None,
            step: None,
            differences: Vec::new(),
            reason: String::new(),
            action: String::new(),
            undo,
        }
    }

    #[test]
    fn given_leaks_with_and_without_undo_when_planned_then_only_the_named_are_removed() {
        let mut missing = leaked(
            "dns",
            "gone.example",
            Some(CompensationAction::UnregisterDns),
        );
        missing.kind = FindingKind::Missing;
        let findings = vec![
            leaked(
                "dns",
                "rogue.example",
                Some(CompensationAction::UnregisterDns),
            ),
            leaked(
                "dns",
                "rogue.example",
                Some(CompensationAction::UnregisterDns),
            ),
            leaked("ipam", "10.0.0.9", None),
            missing,
        ];
        let plan = plan_leak_removal(&findings);
        assert_eq!(plan.removals.len(), 1);
        assert_eq!(plan.removals[0].resource, "rogue.example");
        assert_eq!(plan.unremovable.len(), 1);
        assert_eq!(plan.unremovable[0].resource, "10.0.0.9");
    }

    #[test]
    fn given_a_plan_when_recorded_then_discovered_effects_then_cancelled_with_the_reason() {
        let plan = plan_leak_removal(&[leaked(
            "dns",
            "rogue.example",
            Some(CompensationAction::UnregisterDns),
        )]);
        let id = Uuid::from_u128(7);
        assert_eq!(
            leak_removal_events(id, &plan, "  "),
            Err(LeakRemovalRefusal::NoReason)
        );
        assert_eq!(
            leak_removal_events(id, &LeakRemovalPlan::default(), "why"),
            Err(LeakRemovalRefusal::NothingToRemove)
        );
        let events = leak_removal_events(id, &plan, "ticket 42").expect("recorded");
        assert!(matches!(
            &events[2],
            Event::StepDone { effect, compensation: Some(_), .. }
                if effect.origin == Origin::Discovered
        ));
        assert!(matches!(
            events.last(),
            Some(Event::OperationCancelled { reason }) if reason.contains("ticket 42")
        ));
    }
}
