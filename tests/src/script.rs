//! Random but plausible event scripts for property tests: a small fixed pool of
//! aggregates, events drawn from the catalogue's samples and varied in the fields that
//! matter to the folds (consumers, amounts, members, statuses). Many scripts contain
//! events that make no sense (anomalies), which is intended.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use provledger_events::catalogue::{samples, ClusterStatus, ConsumerKind, Inventory, Ratio};
use provledger_events::{AggregateId, AggregateKind, Commit, CommitDraft, Event, Hash, Timestamp};
use uuid::Uuid;

/// One commit to write: the aggregate and its events.
pub type ScriptStep = (AggregateId, Vec<Event>);

fn pool_id(n: u8) -> Uuid {
    Uuid::from_bytes([0xA0 ^ n; 16])
}

/// The aggregates a script writes to: 2 clusters, 4 instances, 2 providers, 2 operations.
pub fn aggregate_pool() -> Vec<AggregateId> {
    let mut pool = Vec::new();
    for n in 0..2 {
        pool.push(AggregateId::cluster(pool_id(n)));
    }
    for n in 2..6 {
        pool.push(AggregateId::instance(pool_id(n)));
    }
    for n in 6..8 {
        pool.push(AggregateId::provider(pool_id(n)));
    }
    for n in 8..10 {
        pool.push(AggregateId::operation(pool_id(n)));
    }
    pool
}

/// Varies a sample event with the small integers `a` and `b`.
fn vary(event: Event, a: u8, b: u8) -> Event {
    let member = pool_id(2 + a % 4);
    match event {
        Event::InstanceJoined { node_group, .. } => Event::InstanceJoined {
            node_group,
            instance_id: member,
        },
        Event::InstanceLeft {
            node_group, reason, ..
        } => Event::InstanceLeft {
            node_group,
            instance_id: member,
            reason,
        },
        Event::ClusterStatusChanged { description, .. } => Event::ClusterStatusChanged {
            status: [
                ClusterStatus::Spawning,
                ClusterStatus::Configuring,
                ClusterStatus::Active,
                ClusterStatus::Scaling,
                ClusterStatus::Error,
                ClusterStatus::Deleted,
            ][usize::from(b % 6)],
            description,
        },
        Event::AllocationClaimed { .. } => Event::AllocationClaimed {
            consumer: member,
            consumer_kind: ConsumerKind::Instance,
            resources: BTreeMap::from([("VCPU".to_string(), u64::from(1 + b % 6))]),
        },
        Event::AllocationReleased { reason, .. } => Event::AllocationReleased {
            consumer: member,
            reason,
        },
        Event::InventorySet { .. } => Event::InventorySet {
            resource_class: "VCPU".into(),
            inventory: Inventory {
                total: u64::from(4 + b % 12),
                reserved: u64::from(a % 3),
                allocation_ratio: Ratio(1000 + 500 * u32::from(a % 3)),
                min_unit: 1,
                max_unit: 16,
                step_size: 1,
            },
        },
        other => other,
    }
}

/// A strategy for scripts of up to `steps_max` commits over [`aggregate_pool`].
pub fn script(steps_max: usize) -> impl Strategy<Value = Vec<ScriptStep>> {
    let pool = aggregate_pool();
    let by_kind: HashMap<AggregateKind, Vec<Event>> = AggregateKind::ALL
        .iter()
        .map(|k| {
            let events: Vec<Event> = samples::all()
                .into_iter()
                // Every log refuses a loss acknowledgement where no loss is open
                // (`provledger_events::loss`); scripts write to real logs.
                .filter(|e| e.belongs_to(*k) && !matches!(e, Event::LossAcknowledged { .. }))
                .collect();
            (*k, events)
        })
        .collect();
    let step = (
        0..pool.len(),
        proptest::collection::vec((any::<u16>(), any::<u8>(), any::<u8>()), 1..4),
    );
    proptest::collection::vec(step, 1..steps_max).prop_map(move |steps| {
        steps
            .into_iter()
            .map(|(agg_index, picks)| {
                let aggregate = pool[agg_index];
                let choices = &by_kind[&aggregate.kind];
                let events = picks
                    .into_iter()
                    .map(|(pick, a, b)| {
                        // Bias towards the first (creating) event so that most aggregates
                        // exist and later events are meaningful.
                        let index = if pick % 5 == 0 {
                            0
                        } else {
                            usize::from(pick) % choices.len()
                        };
                        vary(choices[index].clone(), a, b)
                    })
                    .collect();
                (aggregate, events)
            })
            .collect()
    })
}

/// Seals a script into commits as a log would: versions per aggregate, positions from 1,
/// hash-chained, with deterministic ids and times.
pub fn seal(script: &[ScriptStep]) -> Vec<Commit> {
    let mut heads: HashMap<AggregateId, (u64, Hash)> = HashMap::new();
    script
        .iter()
        .enumerate()
        .map(|(i, (aggregate, events))| {
            let (version, prev) = heads.get(aggregate).copied().unwrap_or((0, Hash::ZERO));
            let draft = draft_for(i, events.clone());
            let mut commit = Commit::seal(*aggregate, version + 1, prev, draft);
            commit.position = i as u64 + 1;
            heads.insert(*aggregate, (version + 1, commit.hash));
            commit
        })
        .collect()
}

/// The draft a script step is written with: deterministic commit id and time.
pub fn draft_for(index: usize, events: Vec<Event>) -> CommitDraft {
    CommitDraft {
        trace: None,
        commit_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0000 | index as u128),
        operation_id: None,
        causation_id: None,
        actor: "script".into(),
        recorded_at: Timestamp::from_unix_ms(1_800_000_000_000 + index as i64 * 1000),
        events,
    }
}
