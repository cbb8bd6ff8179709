//! The events of the benchmarks' placement workload (a compute node with a VCPU inventory,
//! an instance's lifecycle, its claim), shared so that every bench measures the same
//! commits; and the running instance placement's tests start from.

use std::collections::BTreeMap;

use provledger_events::catalogue::{
    ConsumerKind, Inventory, PowerState, Ratio, TaskOutcome, TaskState, VmState,
};
use provledger_events::{Event, Timestamp};
use uuid::Uuid;

/// Compute node `n`: registered on host `cn<n>` with 4096 VCPU (units 1..=64).
pub fn compute_node(n: u128) -> Vec<Event> {
    vec![
        Event::ProviderRegistered {
            name: format!("cn{n}"),
            host: format!("cn{n}"),
        },
        Event::InventorySet {
            resource_class: "VCPU".into(),
            inventory: Inventory {
                total: 4096,
                reserved: 0,
                allocation_ratio: Ratio::ONE,
                min_unit: 1,
                max_unit: 64,
                step_size: 1,
            },
        },
    ]
}

/// `total` VCPU, claimable 1 to `total` at a time, nothing reserved, ratio 1.
pub fn vcpu_inventory(total: u64) -> Inventory {
    Inventory {
        total,
        reserved: 0,
        allocation_ratio: Ratio::ONE,
        min_unit: 1,
        max_unit: total,
        step_size: 1,
    }
}

/// A provider registered on `host` (its name too) with `total` VCPU ([`vcpu_inventory`]):
/// the small provider placement's and the write path's tests reason about.
pub fn provider_on(host: &str, total: u64) -> Vec<Event> {
    vec![
        Event::ProviderRegistered {
            name: host.into(),
            host: host.into(),
        },
        Event::InventorySet {
            resource_class: "VCPU".into(),
            inventory: vcpu_inventory(total),
        },
    ]
}

/// Instance `k`'s lifecycle on compute node `node` (`provider`): created, placed, spawned,
/// active and running (6 events).
pub fn instance_lifecycle(k: u128, node: u128, provider: Uuid) -> Vec<Event> {
    vec![
        Event::InstanceCreateRequested {
            name: format!("vm{k}"),
            cluster_id: None,
            node_group: None,
            flavor: "m1.small".into(),
            resources: BTreeMap::from([("VCPU".to_string(), 1)]),
            image: "img".into(),
        },
        Event::HostAssigned {
            host: format!("cn{node}"),
            provider_id: provider,
        },
        Event::TaskStarted {
            task_state: TaskState::Spawning,
            worker_id: "w1".into(),
            lease_until: Timestamp::from_unix_ms(1_900_000_000_000),
        },
        Event::TaskFinished {
            task_state: TaskState::Spawning,
            outcome: TaskOutcome::Succeeded,
            reason: String::new(),
        },
        Event::VmStateChanged {
            vm_state: VmState::Active,
            reason: String::new(),
        },
        Event::PowerStateChanged {
            power_state: PowerState::Running,
        },
    ]
}

/// An active instance of 2 VCPU placed on `provider` (host `cn`), its scheduling done: the
/// instance placement's and recovery's tests reason about.
pub fn instance_running_on(provider: Uuid) -> Vec<Event> {
    vec![
        Event::InstanceCreateRequested {
            name: "vm".into(),
            cluster_id: None,
            node_group: None,
            flavor: "m1".into(),
            resources: BTreeMap::from([("VCPU".to_string(), 2)]),
            image: "img".into(),
        },
        Event::HostAssigned {
            host: "cn".into(),
            provider_id: provider,
        },
        Event::TaskFinished {
            task_state: TaskState::Scheduling,
            outcome: TaskOutcome::Succeeded,
            reason: String::new(),
        },
        Event::VmStateChanged {
            vm_state: VmState::Active,
            reason: String::new(),
        },
    ]
}

/// The instance's claim of 1 VCPU.
pub fn instance_claim(instance: Uuid) -> Vec<Event> {
    vcpu_claim(instance, ConsumerKind::Instance, 1)
}

/// A claim of `vcpu` VCPU by `consumer` (an instance, or a migration holding a source).
pub fn vcpu_claim(consumer: Uuid, consumer_kind: ConsumerKind, vcpu: u64) -> Vec<Event> {
    vec![Event::AllocationClaimed {
        consumer,
        consumer_kind,
        resources: BTreeMap::from([("VCPU".to_string(), vcpu)]),
    }]
}

/// The events of commit `c` of provider `p` in the benches' churn: its registration with
/// 1,000 VCPU, then instances coming and going (a claim at each odd `c`, the release of
/// the claim before it at each even one).
pub fn provider_churn(p: u64, c: u64) -> Vec<Event> {
    let consumer = |c: u64| Uuid::from_u128((u128::from(p) << 32) + u128::from(c));
    match c {
        0 => provider_on(&format!("node-{p}"), 1_000),
        c if c % 2 == 1 => vcpu_claim(consumer(c), ConsumerKind::Instance, 1),
        c => vec![Event::AllocationReleased {
            consumer: consumer(c - 1),
            reason: "instance deleted".into(),
        }],
    }
}
