//! Facts decided in the pure core: what to record, as a function of state. The shell
//! (the rollback driver, placement, recovery) reads the state, calls one of these and
//! records what it returns; it composes no event itself.

use provledger_events::catalogue::{
    AllocationHold, BlockingAllocation, ClusterStatus, ConsumerKind, NodeGroupTarget,
    OperationKind, OperationOutcome, RollbackOutcome, TargetOutcome, TaskOutcome, TaskState,
    VmState,
};
use provledger_events::{AggregateId, AggregateKind, Event};
use uuid::Uuid;

use crate::cluster::ClusterState;
use crate::instance::InstanceState;
use crate::operation::{OperationState, OperationStatus};
use crate::placement::migration_source;
use crate::provider::ProviderState;
use crate::recovery::{Recovery, Reissue};
use crate::Entity;

/// The events that close a rollback on its target: the target's status as the plan says
/// (an operation that needs attention leaves it in error, saying where to look), the
/// operation's in-flight marker cleared if it still holds the target, and, after a scale,
/// each node group's count put back to the members it has, so a scale that was undone does
/// not leave its request behind (a removal that was finished stays finished). Nothing for
/// a target being deleted or gone, or an operation without a plan.
pub fn rollback_target_events(
    op: &OperationState,
    target: Option<&Entity>,
    outcome: RollbackOutcome,
) -> Vec<Event> {
    let Some(plan) = &op.rollback_plan else {
        return Vec::new();
    };
    let operation = op.header.id.id;
    let attention = outcome == RollbackOutcome::NeedsAttention;
    let describe = |d: &str| match attention {
        true => format!("{d}; rollback needs attention, see operation {operation}"),
        false => d.to_string(),
    };
    let mut events = Vec::new();
    match (target, &plan.target_outcome) {
        (Some(Entity::Cluster(c)), outcome) if !c.is_deleting_or_deleted() => {
            if op.kind == Some(OperationKind::ScaleCluster) {
                let targets: Vec<NodeGroupTarget> = c
                    .node_groups
                    .iter()
                    .filter(|g| g.count as usize != g.instance_ids.len())
                    .map(|g| NodeGroupTarget {
                        name: g.spec.name.clone(),
                        count: u32::try_from(g.instance_ids.len()).unwrap_or(u32::MAX),
                    })
                    .collect();
                if !targets.is_empty() {
                    events.push(Event::ClusterScaleRequested { targets });
                }
            }
            let next = match outcome {
                TargetOutcome::Error { description } => {
                    Some((ClusterStatus::Error, describe(description)))
                }
                TargetOutcome::Active { description } if attention => {
                    Some((ClusterStatus::Error, describe(description)))
                }
                TargetOutcome::Active { description } => {
                    Some((ClusterStatus::Active, description.clone()))
                }
                TargetOutcome::Deleted => None,
            };
            if let Some((status, description)) = next {
                events.push(Event::ClusterStatusChanged {
                    status,
                    description,
                });
            }
        }
        // A migration that failed (or was reverted or aborted) leaves its instance where
        // it runs, as Nova does: only the migration is in error, unless its rollback
        // itself needs attention.
        (Some(Entity::Instance(_)), TargetOutcome::Error { .. })
            if op.kind.is_some_and(|k| k.is_migration()) && !attention => {}
        (Some(Entity::Instance(i)), TargetOutcome::Error { description })
            if i.vm_state != Some(VmState::Deleted) =>
        {
            events.push(Event::VmStateChanged {
                vm_state: VmState::Error,
                reason: describe(description),
            });
        }
        _ => {}
    }
    // A migration's task that no worker started (queued, or its worker gone) ends with
    // the migration: the instance is not left "migrating" for good.
    if let Some(Entity::Instance(i)) = target {
        let migrating = matches!(
            i.task_state,
            Some(TaskState::ResizeMigrating | TaskState::Migrating)
        );
        if op.kind.is_some_and(|k| k.is_migration()) && migrating && i.task_worker.is_none() {
            if let Some(task_state) = i.task_state {
                events.push(Event::TaskFinished {
                    task_state,
                    outcome: TaskOutcome::Failed,
                    reason: format!("migration {operation} rolled back"),
                });
            }
        }
    }
    let holds = match target {
        Some(Entity::Cluster(c)) => c.in_flight.as_ref().map(|f| f.operation_id),
        Some(Entity::Instance(i)) => i.in_flight.as_ref().map(|f| f.operation_id),
        _ => None,
    };
    if holds == Some(operation) {
        events.push(Event::InFlightOperationCleared {
            operation_id: operation,
            outcome: match outcome {
                RollbackOutcome::RolledBack if op.cancelled => OperationOutcome::Cancelled,
                RollbackOutcome::RolledBack => OperationOutcome::RolledBack,
                RollbackOutcome::Held => OperationOutcome::Held,
                RollbackOutcome::NeedsAttention => OperationOutcome::NeedsAttention,
            },
        });
    }
    events
}

/// [`rollback_target_events`] as the fact a driver records on the plan's target (a cluster
/// or an instance; `None` when there is nothing to record), named by
/// [`rollback_target_fact_name`].
pub fn rollback_target_fact(
    op: &OperationState,
    target: Option<&Entity>,
    outcome: RollbackOutcome,
) -> Option<Fact> {
    let aggregate = op.rollback_plan.as_ref()?.target;
    if !matches!(
        aggregate.kind,
        AggregateKind::Cluster | AggregateKind::Instance
    ) {
        return None;
    }
    let events = rollback_target_events(op, target, outcome);
    (!events.is_empty()).then(|| Fact {
        aggregate,
        name: rollback_target_fact_name(op, outcome),
        events,
    })
}

/// The name of a rollback's end on its target, from which its commit id derives. One
/// rollback may end more than once: `needs_attention`, then, after each resume, again
/// `needs_attention` or finally `rolled_back` or `held`. Each end is its own fact, and a
/// retry of the same end (racing drivers, a driver that crashed before `rollback_finished`)
/// keeps its name. A final end happens once per operation and is named by its outcome
/// alone; a `needs_attention` end also by the operation's version it was decided at (each
/// resume moves it). An end recorded before these names (one name for every end) does not
/// stand for a later end of another outcome, which is then written.
pub fn rollback_target_fact_name(op: &OperationState, outcome: RollbackOutcome) -> String {
    match outcome {
        RollbackOutcome::RolledBack => "target_outcome/rolled_back".into(),
        RollbackOutcome::Held => "target_outcome/held".into(),
        RollbackOutcome::NeedsAttention => {
            format!("target_outcome/needs_attention@{}", op.header.version)
        }
    }
}

/// The in-flight marker to set again on `target` when the rollback of `op`, stopped in
/// `needs_attention`, resumes, to be written with the resume at both exact versions: a
/// rollback under way holds its target, as it did before it stopped (its end then reaches
/// the target: a boot's build task and host end with it, see `InstanceState`'s fold). A
/// rollback that needs attention holds nothing (its end cleared the marker), so the target
/// may be deleted or taken by another operation meanwhile; then it is not taken back:
/// `None` for a target being deleted or gone (its delete finishes it), held by another
/// operation, or not a cluster or an instance, and for an operation not in
/// `needs_attention`.
pub fn resumed_target_marker(op: &OperationState, target: Option<&Entity>) -> Option<Event> {
    let kind = op.kind?;
    if op.status != Some(OperationStatus::NeedsAttention) {
        return None;
    }
    let free = match target? {
        Entity::Cluster(c) => {
            c.status.is_some() && !c.is_deleting_or_deleted() && c.in_flight.is_none()
        }
        Entity::Instance(i) => {
            i.vm_state.is_some_and(|v| v != VmState::Deleted)
                && !i.delete_requested
                && i.in_flight.is_none()
        }
        _ => false,
    };
    free.then(|| Event::in_flight_operation_set(op.header.id.id, kind))
}

/// One fact to record: `events` on `aggregate`, named so that whoever records it derives
/// the same commit id from the same decision (racing replicas then write it once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fact {
    pub aggregate: AggregateId,
    pub name: String,
    pub events: Vec<Event>,
}

/// Everything one instance's recovery records, to be written as one atomic set so that a
/// crash never leaves half of it (a recovered build whose claim is never released, a
/// reverted resize still holding its destination):
/// - on the instance, the recovery's own events (the task ended, what the rule decided);
/// - a build put in error: its claim released where it is held;
/// - an interrupted resize or live migration (Nova's revert / abort): the instance back on
///   its source (the source allocation a migration held becomes the instance's again, in
///   the same commit on that provider, so the capacity cannot be taken in between), every
///   other claim of the instance released (the destination), its host the source again if
///   it had moved, and the migration's operation failed if it still runs. The instance
///   keeps its vm_state (it runs on the source; only the migration is in error).
///
/// `providers`: those holding an allocation of the instance or of a migration of it (or
/// more); `lookup`: the operations of those migrations and of the instance's in-flight
/// operation. The instance's fact comes first.
pub fn recovery_facts<'a, 'p>(
    recovery: &Recovery,
    instance: &InstanceState,
    providers: impl IntoIterator<Item = &'p ProviderState>,
    lookup: impl Fn(&AggregateId) -> Option<&'a Entity>,
) -> Vec<Fact> {
    let scope = RecoveryScope {
        instance,
        providers: providers.into_iter().collect(),
    };
    let mut on_instance = recovery.events.clone();
    let mut facts = Vec::new();
    if let Some(provider) = recovery.release_claim_on {
        if scope
            .providers
            .iter()
            .any(|p| p.header.id.id == provider && scope.holds(p))
        {
            facts.push(scope.release(provider, format!("recovery: {}", recovery.reason)));
        }
    }
    if matches!(
        recovery.reissue,
        Some(Reissue::RevertResize | Reissue::AbortLiveMigration)
    ) {
        scope.back_to_source(recovery, lookup, &mut facts, &mut on_instance);
    }
    if let Some(action) = recovery.reissue {
        on_instance.push(scope.reissue(recovery, action));
    }
    facts.insert(
        0,
        Fact {
            aggregate: instance.header.id,
            name: scope.name("instance"),
            events: on_instance,
        },
    );
    facts
}

/// What [`recovery_facts`] reads: the instance recovered and the providers that may hold
/// its claims or its migrations'.
struct RecoveryScope<'i, 'p> {
    instance: &'i InstanceState,
    providers: Vec<&'p ProviderState>,
}

impl<'p> RecoveryScope<'_, 'p> {
    /// The instance's id: the consumer of its claims.
    fn id(&self) -> Uuid {
        self.instance.header.id.id
    }

    /// A fact's name: the same for every replica recovering the instance at its version.
    fn name(&self, what: &str) -> String {
        format!("recovery/{}/{what}", self.instance.header.version)
    }

    /// Whether `provider` holds a claim of the instance itself (not of a migration).
    fn holds(&self, provider: &ProviderState) -> bool {
        provider
            .allocations
            .get(&self.id())
            .is_some_and(|a| a.consumer_kind == ConsumerKind::Instance)
    }

    /// The provider `id`, if it is one of those read.
    fn provider(&self, id: Uuid) -> Option<&'p ProviderState> {
        self.providers
            .iter()
            .copied()
            .find(|p| p.header.id.id == id)
    }

    /// The instance's claim on `provider` released, for `reason`.
    fn release(&self, provider: Uuid, reason: String) -> Fact {
        Fact {
            aggregate: AggregateId::provider(provider),
            name: self.name(&format!("release/{provider}")),
            events: vec![Event::AllocationReleased {
                consumer: self.id(),
                reason,
            }],
        }
    }

    /// An interrupted resize or live migration (Nova's revert / abort): the source given
    /// back to the instance, every other claim of it released, its host the source again
    /// if it had moved, and the migration's operation failed if it still runs.
    fn back_to_source<'a>(
        &self,
        recovery: &Recovery,
        lookup: impl Fn(&AggregateId) -> Option<&'a Entity>,
        facts: &mut Vec<Fact>,
        on_instance: &mut Vec<Event>,
    ) {
        let why = format!("recovery: back to the source: {}", recovery.reason);
        let migration = migration_source(self.providers.iter().copied(), &lookup, self.id());
        let source = migration
            .as_ref()
            .map(|(_, s, _)| *s)
            .or(self.instance.provider_id);
        if let Some((migration, source, _)) = &migration {
            let events = self
                .provider(*source)
                .and_then(|p| return_to_source_events(p, self.id(), *migration, &why));
            if let Some(events) = events {
                facts.push(Fact {
                    aggregate: AggregateId::provider(*source),
                    name: self.name(&format!("back-to-source/{source}")),
                    events,
                });
            }
        }
        for p in self
            .providers
            .iter()
            .filter(|p| Some(p.header.id.id) != source)
        {
            if self.holds(p) {
                facts.push(self.release(p.header.id.id, why.clone()));
            }
        }
        if let Some(source) = source.filter(|s| self.instance.provider_id != Some(*s)) {
            let host = self
                .provider(source)
                .map(|p| p.host.clone())
                .unwrap_or_default();
            on_instance.push(Event::HostAssigned {
                host,
                provider_id: source,
            });
        }
        let operation = migration.map(|(m, _, _)| m).or_else(|| {
            self.instance
                .in_flight
                .as_ref()
                .filter(|f| f.kind.is_migration())
                .map(|f| f.operation_id)
        });
        let operation = operation.and_then(|m| lookup(&AggregateId::operation(m)));
        facts.extend(self.migration_failed(operation, why));
    }

    /// The migration's operation failed, if it still runs.
    fn migration_failed(&self, operation: Option<&Entity>, why: String) -> Option<Fact> {
        let Some(Entity::Operation(op)) = operation else {
            return None;
        };
        (op.status == Some(OperationStatus::Running)).then(|| Fact {
            aggregate: op.header.id,
            name: self.name("migration-error"),
            events: vec![Event::OperationFailed {
                stage: op.current_stage.clone().unwrap_or_else(|| "migrate".into()),
                step: None,
                error: why,
            }],
        })
    }

    /// The re-issue `action` asked of the task's worker, or the instance in error when no
    /// worker owns the task.
    fn reissue(&self, recovery: &Recovery, action: Reissue) -> Event {
        match &self.instance.task_worker {
            // Pending until the worker acknowledges: delivered, not just sent.
            Some(worker) => Event::ReissueRequested {
                request_id: reissue_request_id(self.id(), self.instance.header.version),
                worker: worker.clone(),
                action,
                reason: recovery.reason.clone(),
            },
            // A task no worker ever started (a queued delete): nobody to re-drive it.
            None => Event::VmStateChanged {
                vm_state: VmState::Error,
                reason: format!(
                    "{}; but no worker owns the task, so it cannot be re-driven",
                    recovery.reason
                ),
            },
        }
    }
}

/// The id of the re-issue a recovery of `instance` at `version` records: the worker's
/// idempotency key, the same for every replica and every retry of that recovery.
pub fn reissue_request_id(instance: Uuid, version: u64) -> Uuid {
    Uuid::new_v5(&instance, format!("recovery/{version}/instance").as_bytes())
}

/// Releases in one commit of a cascade delete. A provider holding more is emptied in
/// several commits, each decided at the provider's exact version; the first also records
/// the delete (claims are refused from then on), the last deletes the provider. One that
/// stops half way is `deleting` with `deleting_cascade`, and whoever finds it finishes it
/// (serve's sweep, or the same command again): nothing is orphaned, nothing released twice.
pub const CASCADE_RELEASES_PER_COMMIT: usize = 256;

/// What deleting a provider writes next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderDeleteStep {
    AlreadyDeleted,
    /// Allocations remain and no cascade is asked for (nor was one recorded): nothing is
    /// written; the caller names each allocation.
    Refused,
    /// The next commit on the provider, at its exact version. `deletes`: it is the last.
    Write {
        events: Vec<Event>,
        released: Vec<Uuid>,
        deletes: bool,
    },
}

/// The next commit of a provider's delete, from the provider as it is. `cascade`: the
/// caller asks for every allocation to be released (a cascade already recorded on the
/// provider goes on either way); `why`: why each consumer's allocation is there
/// (`placement::classify`), for its release or the refusal.
pub fn provider_delete_step(
    provider: &ProviderState,
    cascade: bool,
    why: impl Fn(Uuid) -> (AllocationHold, String),
) -> ProviderDeleteStep {
    use crate::provider::ProviderStatus;
    if provider.status == Some(ProviderStatus::Deleted) {
        return ProviderDeleteStep::AlreadyDeleted;
    }
    let deleting = provider.status == Some(ProviderStatus::Deleting);
    let cascade = cascade || (deleting && provider.deleting_cascade);
    let mut events = Vec::new();
    if !provider.allocations.is_empty() && !cascade {
        if !deleting {
            return ProviderDeleteStep::Refused;
        }
        // A plain delete recorded earlier met a claim that got in first: the provider goes
        // back to active, and the refusal names what blocks it.
        events.push(Event::ProviderDeleteRefused {
            blocking: provider
                .allocations
                .iter()
                .map(|(consumer, a)| BlockingAllocation {
                    consumer: *consumer,
                    consumer_kind: a.consumer_kind,
                    hold: why(*consumer).0,
                })
                .collect(),
        });
        return ProviderDeleteStep::Write {
            events,
            released: Vec::new(),
            deletes: false,
        };
    }
    if !deleting {
        events.push(Event::ProviderDeleteRequested {
            cascade,
            reason: match cascade {
                true => "deleted with --cascade".into(),
                false => "deleted".into(),
            },
        });
    }
    let released: Vec<Uuid> = provider
        .allocations
        .keys()
        .take(CASCADE_RELEASES_PER_COMMIT)
        .copied()
        .collect();
    for consumer in &released {
        events.push(Event::AllocationReleased {
            consumer: *consumer,
            reason: format!("provider deleted with --cascade: {}", why(*consumer).1),
        });
    }
    let deletes = released.len() == provider.allocations.len();
    if deletes {
        events.push(Event::ProviderDeleted {});
    }
    ProviderDeleteStep::Write {
        events,
        released,
        deletes,
    }
}

/// A migration's source given back to its instance (a revert, an abort, a migration's
/// rollback: Nova's rule): on the source provider, the migration's allocation released and
/// the instance's claimed with the same resources, in one commit, so that the capacity
/// cannot be taken in between. `None`: the migration holds nothing there (it was confirmed,
/// or the source was given back already): nothing to do.
pub fn return_to_source_events(
    source: &ProviderState,
    instance: Uuid,
    migration: Uuid,
    why: &str,
) -> Option<Vec<Event>> {
    let held = source
        .allocations
        .get(&migration)
        .filter(|a| a.consumer_kind == ConsumerKind::Migration)?;
    Some(vec![
        Event::AllocationReleased {
            consumer: migration,
            reason: why.to_string(),
        },
        Event::AllocationClaimed {
            consumer: instance,
            consumer_kind: ConsumerKind::Instance,
            resources: held.resources.to_map(),
        },
    ])
}

/// After the executor confirmed a VM's termination during a rollback: the instance record
/// closed (`instance_delete_requested` if not asked yet, `instance_deleted`), unless it is
/// the operation's own target, which keeps its record (the target outcome moves it); and
/// the instance out of its node group (`instance_left`). Both together, or neither: a
/// deleted instance still listed in its cluster, or the reverse, is never left behind.
pub fn vm_gone_facts(
    op: &OperationState,
    instance: &InstanceState,
    cluster: Option<&ClusterState>,
) -> Vec<Fact> {
    let operation = op.header.id.id;
    let id = instance.header.id;
    let reason = format!("terminated by the rollback of operation {operation}");
    let mut facts = Vec::new();
    if op.target != Some(id) && instance.vm_state != Some(VmState::Deleted) {
        let mut events = Vec::new();
        if !instance.delete_requested {
            events.push(Event::InstanceDeleteRequested {
                reason: reason.clone(),
            });
        }
        events.push(Event::InstanceDeleted {});
        facts.push(Fact {
            aggregate: id,
            name: "instance_deleted".into(),
            events,
        });
    }
    let group = cluster.and_then(|c| {
        c.node_groups
            .iter()
            .find(|g| g.instance_ids.contains(&id.id))
            .map(|g| (c.header.id, g.spec.name.clone()))
    });
    if let Some((cluster, node_group)) = group {
        facts.push(Fact {
            aggregate: cluster,
            name: "instance_left".into(),
            events: vec![Event::InstanceLeft {
                node_group,
                instance_id: id.id,
                reason,
            }],
        });
    }
    facts
}

/// Whether a deleting target can be recorded deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeletionCompletion {
    AlreadyDeleted,
    /// Something of it remains (an instance in a node group, an operation in flight, an
    /// allocation), or it is not being deleted.
    NotYet,
    /// Nothing of it remains: record this.
    Record(Box<Event>),
}

/// `target` (a cluster or an instance) once nothing of it remains: a cluster with no
/// instance in its node groups and no operation in flight; an instance whose delete was
/// asked for, with no operation in flight and no allocation on `runs_on` (the provider it
/// runs on, if it has one).
pub fn deletion_completion(target: &Entity, runs_on: Option<&ProviderState>) -> DeletionCompletion {
    match target {
        Entity::Cluster(c) => match c.status {
            Some(ClusterStatus::Deleted) => DeletionCompletion::AlreadyDeleted,
            Some(ClusterStatus::Deleting) if c.instance_count() == 0 && c.in_flight.is_none() => {
                DeletionCompletion::Record(Box::new(Event::ClusterDeleted {}))
            }
            _ => DeletionCompletion::NotYet,
        },
        Entity::Instance(i) => {
            if i.vm_state == Some(VmState::Deleted) {
                return DeletionCompletion::AlreadyDeleted;
            }
            let holds = runs_on.is_some_and(|p| p.allocations.contains_key(&i.header.id.id));
            if !i.delete_requested || i.in_flight.is_some() || holds {
                return DeletionCompletion::NotYet;
            }
            DeletionCompletion::Record(Box::new(Event::InstanceDeleted {}))
        }
        _ => DeletionCompletion::NotYet,
    }
}

/// A heal's claim (an instance with a host and no allocation anywhere): the claim on the
/// provider it runs on, with the instance's host recorded again, to be written together at
/// the instance's exact version as it was read, so that no claim is recorded for an
/// instance deleted, moved or changed since (the instance's expectation refuses both).
/// Names derive from the provider and that version: a retry is recognised.
pub fn heal_facts(
    instance: &InstanceState,
    provider: Uuid,
    resources: std::collections::BTreeMap<String, u64>,
) -> Vec<Fact> {
    let id = instance.header.id;
    let version = instance.header.version;
    vec![
        Fact {
            aggregate: id,
            name: format!("healed-on/{provider}/host@{version}"),
            events: vec![Event::HostAssigned {
                host: instance.host.clone().unwrap_or_default(),
                provider_id: provider,
            }],
        },
        Fact {
            aggregate: AggregateId::provider(provider),
            name: format!("healed-on/{provider}@{version}"),
            events: vec![Event::AllocationClaimed {
                consumer: id.id,
                consumer_kind: ConsumerKind::Instance,
                resources,
            }],
        },
    ]
}

/// A user's delete request on a cluster or an instance (`None` for any other kind: only
/// those are deleted this way).
pub fn delete_request(kind: provledger_events::AggregateKind, reason: &str) -> Option<Event> {
    use provledger_events::AggregateKind;
    match kind {
        AggregateKind::Cluster => Some(Event::ClusterDeleteRequested {
            reason: reason.into(),
        }),
        AggregateKind::Instance => Some(Event::InstanceDeleteRequested {
            reason: reason.into(),
        }),
        _ => None,
    }
}
