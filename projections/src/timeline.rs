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
            let json = inner_json(other);
            match json.char_indices().nth(100) {
                Some((cut, _)) => format!("{}...", &json[..cut]),
                None => json,
            }
        }
    }
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
