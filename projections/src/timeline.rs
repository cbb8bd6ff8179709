//! A readable, one-line-per-event rendering of commits, for `history` and the demo.

use provledger_events::{Commit, Event};

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

/// The fields a person looks for first, per event.
pub fn summary(event: &Event) -> String {
    match event {
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
        } => {
            format!("status={status:?} {description:?}")
        }
        Event::InstanceJoined {
            node_group,
            instance_id,
        } => {
            format!("group={node_group} instance={instance_id}")
        }
        Event::InstanceCreateRequested {
            name, node_group, ..
        } => {
            format!("name={name} group={}", node_group.as_deref().unwrap_or("-"))
        }
        Event::VmStateChanged { vm_state, reason } => format!("vm_state={vm_state:?} {reason:?}"),
        Event::TaskStarted {
            task_state,
            worker_id,
            ..
        } => {
            format!("task={task_state:?} worker={worker_id}")
        }
        Event::TaskFinished {
            task_state,
            outcome,
            ..
        } => {
            format!("task={task_state:?} outcome={outcome:?}")
        }
        Event::HostAssigned { host, .. } => format!("host={host}"),
        Event::AllocationClaimed {
            consumer,
            resources,
            ..
        } => {
            format!("consumer={consumer} resources={resources:?}")
        }
        other => {
            let json = serde_json_compact(other);
            if json.len() > 100 {
                format!(
                    "{}...",
                    &json[..json.char_indices().nth(97).map_or(json.len(), |(i, _)| i)]
                )
            } else {
                json
            }
        }
    }
}

fn serde_json_compact(event: &Event) -> String {
    // The catalogue's JSON form minus the outer tag; Debug is the fallback.
    format!("{event:?}")
        .split_once(' ')
        .map(|(_, rest)| rest.to_string())
        .unwrap_or_default()
}
