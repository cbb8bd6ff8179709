//! A readable, one-line-per-event rendering of commits, for `history` and the demo.

use provledger_events::catalogue::{EffectKind, Executor, TargetOutcome};
use provledger_events::{short_id, Commit, Event};

use crate::planner::{action_word, json_word};

/// One line per event: position, aggregate@version, event name and its key fields.
pub fn render(commit: &Commit) -> Vec<String> {
    commit
        .events
        .iter()
        .map(|event| {
            format!(
                "#{:<5} {} v{:<3} {:<28} {}",
                commit.position,
                commit.aggregate,
                commit.version,
                event.name(),
                summary(event)
            )
        })
        .collect()
}

/// The fields a person looks for first, per event: a table of one line of text per
/// event, split by family; an event no family names shows its fields as JSON, cut at 100
/// characters.
pub fn summary(event: &Event) -> String {
    cluster_summary(event)
        .or_else(|| instance_summary(event))
        .or_else(|| provider_summary(event))
        .or_else(|| operation_summary(event))
        .or_else(|| rollback_summary(event))
        .unwrap_or_else(|| {
            let json = inner_json(event);
            match json.char_indices().nth(100) {
                Some((cut, _)) => format!("{}...", &json[..cut]),
                None => json,
            }
        })
}

/// A cluster's events, and the in-flight marker clusters and instances hold.
fn cluster_summary(event: &Event) -> Option<String> {
    Some(match event {
        Event::ClusterCreateRequested {
            name, node_groups, ..
        } => {
            let groups: Vec<String> = node_groups
                .iter()
                .map(|g| format!("{}x{}", g.name, g.count))
                .collect();
            format!("name={name} groups=[{}]", groups.join(", "))
        }
        Event::ClusterStatusChanged {
            status,
            description,
        } => format!("status={} {description:?}", json_word(status)),
        Event::InstanceJoined {
            node_group,
            instance_id,
        } => format!("group={node_group} instance={instance_id}"),
        Event::InstanceLeft {
            node_group,
            instance_id,
            reason,
        } => format!("group={node_group} instance={instance_id} {reason:?}"),
        Event::ClusterDeleteRequested { reason } => format!("{reason:?}"),
        Event::InFlightOperationSet {
            operation_id,
            operation_kind,
        } => format!("operation={operation_id} ({})", json_word(operation_kind)),
        Event::InFlightOperationCleared {
            operation_id,
            outcome,
        } => format!("operation={operation_id} outcome={}", json_word(outcome)),
        _ => return None,
    })
}

/// An instance's events.
fn instance_summary(event: &Event) -> Option<String> {
    Some(match event {
        Event::InstanceCreateRequested {
            name, node_group, ..
        } => format!("name={name} group={}", node_group.as_deref().unwrap_or("-")),
        Event::VmStateChanged { vm_state, reason } => {
            format!("vm_state={} {reason:?}", json_word(vm_state))
        }
        Event::PowerStateChanged { power_state } => {
            format!("power_state={}", json_word(power_state))
        }
        Event::TaskStarted {
            task_state,
            worker_id,
            ..
        } => format!("task={} worker={worker_id}", json_word(task_state)),
        Event::TaskFinished {
            task_state,
            outcome,
            ..
        } => format!(
            "task={} outcome={}",
            json_word(task_state),
            json_word(outcome)
        ),
        Event::HostAssigned { host, .. } => format!("host={host}"),
        Event::InstanceDeleteRequested { reason } => format!("{reason:?}"),
        _ => return None,
    })
}

/// A provider's events.
fn provider_summary(event: &Event) -> Option<String> {
    Some(match event {
        Event::AllocationClaimed {
            consumer,
            resources,
            ..
        } => format!("consumer={consumer} resources={resources:?}"),
        Event::AllocationReleased { consumer, reason } => {
            format!("consumer={consumer} {reason:?}")
        }
        Event::ProviderRegistered { name, host } => format!("name={name} host={host}"),
        Event::InventorySet {
            resource_class,
            inventory,
        } => format!(
            "{resource_class} total={} reserved={} ratio={}",
            inventory.total, inventory.reserved, inventory.allocation_ratio
        ),
        _ => return None,
    })
}

/// An operation's run: started, its stages and steps, how it ends or is asked to.
fn operation_summary(event: &Event) -> Option<String> {
    Some(match event {
        Event::OperationStarted { kind, target, .. } => {
            format!("kind={} target={target}", json_word(kind))
        }
        Event::ChildOperationAdded { child_id } => format!("child={child_id}"),
        Event::StageStarted { stage } | Event::StageCompleted { stage } => {
            format!("stage={stage}")
        }
        Event::StepDone {
            step,
            effect,
            compensation,
            ..
        } => {
            let kind = match &effect.kind {
                EffectKind::Custom(k) => k.clone(),
                k => json_word(k),
            };
            let undo = match compensation {
                Some(c) => format!(
                    " undo={} by {}",
                    action_word(&c.action),
                    executor(&c.executor)
                ),
                None => String::new(),
            };
            format!("{step} {kind} {}{undo}", effect.resource)
        }
        Event::StepStarted {
            step,
            executor,
            idempotency_key,
            compensation,
            ..
        } => {
            let undo = match compensation {
                Some(c) => format!(" undo={} by key", action_word(&c.action)),
                None => String::new(),
            };
            format!("{step} asked of {executor} key={idempotency_key}{undo}")
        }
        Event::OperationFailed { stage, step, error } => format!(
            "stage={stage} step={} {error:?}",
            step.as_deref().unwrap_or("-")
        ),
        Event::OperationCancelled { reason }
        | Event::CancellationRequested { reason }
        | Event::TargetDeletionNoticed { reason } => format!("{reason:?}"),
        _ => return None,
    })
}

/// An operation's rollback: its plan, each compensation, finished, resumed.
fn rollback_summary(event: &Event) -> Option<String> {
    Some(match event {
        Event::RollbackPlanned { plan } => format!(
            "{} compensation(s), {} kept; target -> {}",
            plan.compensations.len(),
            plan.retained.len(),
            target_word(&plan.target_outcome)
        ),
        Event::CompensationRequested {
            compensation_id,
            attempt,
        } => format!(
            "compensation={} attempt={attempt}",
            short_id(compensation_id)
        ),
        Event::CompensationDone { compensation_id } => {
            format!("compensation={}", short_id(compensation_id))
        }
        Event::CompensationFailed {
            compensation_id,
            attempt,
            error,
        } => format!(
            "compensation={} attempt={attempt} {error:?}",
            short_id(compensation_id)
        ),
        Event::RollbackFinished { outcome, remaining } => format!(
            "outcome={} remaining={}",
            json_word(outcome),
            remaining.len()
        ),
        Event::RollbackResumed { reason } => format!("{reason:?}"),
        _ => return None,
    })
}

/// The catalogue's JSON form without its outer tag: `{"stage":"spawn"}`.
fn inner_json(event: &Event) -> String {
    match serde_json::to_value(event) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .next()
            .map(|(_, v)| v.to_string())
            .unwrap_or_default(),
        Ok(other) => other.to_string(),
        Err(e) => format!("<unrenderable: {e}>"),
    }
}

fn executor(executor: &Executor) -> String {
    match executor {
        Executor::Ledger => "ledger".into(),
        Executor::Service(name) => name.clone(),
    }
}

fn target_word(outcome: &TargetOutcome) -> &'static str {
    match outcome {
        TargetOutcome::Error { .. } => "error",
        TargetOutcome::Active { .. } => "active",
        TargetOutcome::Deleted => "deleted",
    }
}
