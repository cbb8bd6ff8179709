//! The shipped operation kinds, written the way a provisioning service uses the client
//! library: stages and steps through one [`OperationCtx`], errors returned with `?`, and
//! not one line of rollback code. Create, scale and delete a cluster (Sahara), boot an
//! instance (Nova, ManageIQ's IP/DHCP/DNS steps), and a bundle of child operations.
//!
//! The flows act through an [`Infrastructure`] (the simulated executors in the demo and
//! the tests); every effect is recorded with the compensation that undoes it.

use std::collections::BTreeMap;
use std::sync::Arc;

use provledger_events::catalogue::{
    BundlePolicy, ClusterStatus, Compensation, CompensationAction, ConsumerKind, DetailKey, Effect,
    EffectKind, Executor, Inventory, NodeGroupSpec, NodeGroupTarget, OperationKind, Origin,
    PowerState, Ratio, TaskOutcome, TaskState, VmState,
};
use provledger_events::{
    AggregateId, AppendError, AppendOutcome, Event, EventLog, Expectation, ReadError,
};
use provledger_projections::planner::{
    action_word, NODE_DETAIL, REMOVAL_DETAIL, REMOVE_NODE_ACTION, RESOURCE_REMOVED_EFFECT,
};
use provledger_projections::stages::stage;
use provledger_projections::Entity;
use uuid::Uuid;

use provledger_client::deletion::{self, DeleteError, DeleteRequestOutcome};
use provledger_client::{
    derived_commit_id, release_allocation, ActOutput, CompensationExecutor, CompensationRequest,
    Infrastructure, OperationCtx, OperationError, OperationRunner, OperationSpec, RunReport,
    Stamper, StepOutput, Writer,
};

use crate::executors::{DHCP, DNS, HYPERVISOR, IPAM, PLUGIN};

/// A cluster to create.
#[derive(Debug, Clone)]
pub struct ClusterRequest {
    pub cluster_id: Uuid,
    pub name: String,
    pub plugin: String,
    pub node_groups: Vec<NodeGroupSpec>,
    /// The resource provider (compute node) the nodes are scheduled on.
    pub provider: Uuid,
}

/// An instance to boot.
#[derive(Debug, Clone)]
pub struct InstanceRequest {
    pub instance_id: Uuid,
    pub name: String,
    pub resources: BTreeMap<String, u64>,
    pub provider: Uuid,
}

/// What a cluster delete did.
#[derive(Debug)]
pub struct DeleteReport {
    pub request: DeleteRequestOutcome,
    /// The operation that was in flight and got cancelled.
    pub cancelled: Option<Uuid>,
    /// The delete operation that removed the remaining nodes, if one ran.
    pub delete_operation: Option<RunReport<()>>,
    pub deleted: bool,
}

#[derive(Clone)]
pub struct Provisioner {
    pub runner: OperationRunner,
    pub infra: Arc<dyn Infrastructure>,
    pub actor: String,
}

/// The simulated host name of a compute node: the tail of its provider's id (UUID v7 ids
/// minted in the same second share their first digits, so the head would name every host
/// alike).
fn host_of(provider: Uuid) -> String {
    let hex = provider.simple().to_string();
    format!("host-{}", &hex[hex.len() - 8..])
}

fn effect(kind: EffectKind, resource: &str, executor: &str) -> Effect {
    Effect {
        kind,
        resource: resource.to_string(),
        executor: executor.to_string(),
        origin: Origin::Created,
        detail: BTreeMap::new(),
    }
}

fn undo(action: CompensationAction, executor: &str, resource: &str) -> Compensation {
    Compensation {
        action,
        executor: Executor::Service(executor.to_string()),
        resource: resource.to_string(),
        args: BTreeMap::new(),
    }
}

/// The plugin's compensation of a configure step: forget the node. Declared so that a node
/// removed later (scale-in, delete, a roll-forward) can find it, and so that a deletion of
/// the target removes the plugin's record too. The planner's stage rules keep it while the
/// node may hold data (configure, start and configure_new hold); only a deletion of the
/// target compensates it, before the node's network and VM (plans undo in reverse).
fn remove_node(node: Uuid) -> Compensation {
    undo(
        CompensationAction::Custom(REMOVE_NODE_ACTION.into()),
        PLUGIN,
        &node.to_string(),
    )
}

/// Everything that undoes `node`'s existence except its VM's termination and its
/// allocation's release, in the order it is undone: the plugin's `remove_node` first, then
/// DNS, DHCP and IP (the reverse of their creation). Read from the operation that created
/// the node (the one that wrote the instance's first commit): the compensations its network
/// steps declared (found by their effect's `node` detail, since an IP or a DNS name does
/// not name the node) and its configure step's. Empty for a node without a record.
pub(crate) async fn node_removal<L: EventLog>(
    writer: &Writer<L>,
    node: Uuid,
) -> Result<Vec<Compensation>, ReadError> {
    let commits = writer
        .log()
        .read_aggregate(AggregateId::instance(node))
        .await?;
    let Some(creator) = commits.first().and_then(|c| c.operation_id) else {
        return Ok(Vec::new());
    };
    let op = match writer.read_current(AggregateId::operation(creator)).await {
        Ok(Some(Entity::Operation(op))) => op,
        Ok(_) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let node = node.to_string();
    let remove_node = CompensationAction::Custom(REMOVE_NODE_ACTION.into());
    let mut removal: Vec<Compensation> = Vec::new();
    for step in op.steps.iter().rev() {
        let Some(c) = &step.compensation else {
            continue;
        };
        if !matches!(c.executor, Executor::Service(_)) {
            continue;
        }
        let network = step.effect.detail.get(NODE_DETAIL) == Some(&node);
        let plugin = c.action == remove_node && c.resource == node;
        if (network || plugin) && !removal.contains(c) {
            removal.push(c.clone());
        }
    }
    // The plugin forgets the node first, as in the rollback of a deleted target.
    removal.sort_by_key(|c| c.action != remove_node);
    Ok(removal)
}

/// What a scale of node group `group` of `cluster` makes of it: the group's spec and its
/// node count after the scale, or the step failure that stops the scale before anything is
/// recorded (no such cluster or group, a node removed that is not a member or is listed
/// twice, a count too large).
async fn scale_target(
    ctx: &OperationCtx,
    cluster: Uuid,
    group: &str,
    remove: &[Uuid],
    add: u32,
) -> Result<(NodeGroupSpec, u32), OperationError> {
    let Some(Entity::Cluster(state)) = ctx
        .ledger()
        .read_current(AggregateId::cluster(cluster))
        .await?
    else {
        return Err(ctx.step_failed("read", format!("cluster {cluster} not found")));
    };
    let Some(ng) = state.node_groups.iter().find(|g| g.spec.name == group) else {
        return Err(ctx.step_failed("read", format!("no node group {group:?}")));
    };
    let spec = ng.spec.clone();
    // Only members can be removed, each once: a scale-in is checked before
    // anything is recorded, never computed into an impossible count.
    if let Some(stranger) = remove.iter().find(|n| !ng.instance_ids.contains(n)) {
        return Err(ctx.step_failed(
            "read",
            format!("node {stranger} is not in node group {group:?}"),
        ));
    }
    let distinct: std::collections::BTreeSet<&Uuid> = remove.iter().collect();
    if distinct.len() != remove.len() {
        return Err(ctx.step_failed("read", "a node is listed twice in remove"));
    }
    let count = u32::try_from(ng.instance_ids.len() - remove.len())
        .ok()
        .and_then(|kept| kept.checked_add(add))
        .ok_or_else(|| ctx.step_failed("read", "the node group would be too large"))?;
    Ok((spec, count))
}

/// Registers a compute node (resource provider) with a VCPU inventory of `vcpus`
/// (no reservation, ratio 1, any amount from 1 to `vcpus`): the one place the demo, the
/// tests and the benchmark create the provider their flows claim on.
pub async fn register_compute_node<L: EventLog>(
    writer: &Writer<L>,
    provider: Uuid,
    name: &str,
    vcpus: u64,
    actor: &str,
) -> Result<AppendOutcome, AppendError> {
    register_compute_node_stamped(writer, provider, name, vcpus, actor, &Stamper::system()).await
}

/// [`register_compute_node`] with the commit stamped by `stamper` (a simulation's seeded
/// clock and ids).
pub async fn register_compute_node_stamped<L: EventLog>(
    writer: &Writer<L>,
    provider: Uuid,
    name: &str,
    vcpus: u64,
    actor: &str,
    stamper: &Stamper,
) -> Result<AppendOutcome, AppendError> {
    let inventory = Inventory {
        total: vcpus,
        reserved: 0,
        allocation_ratio: Ratio::ONE,
        min_unit: 1,
        max_unit: vcpus,
        step_size: 1,
    };
    let inventories = BTreeMap::from([("VCPU".to_string(), inventory)]);
    let recorded = provledger_client::placement::register_provider(
        writer,
        provider,
        name,
        name,
        &inventories,
        actor,
        stamper,
    )
    .await
    .map_err(|e| match e {
        provledger_client::write::RecordError::Append(e) => e,
        provledger_client::write::RecordError::Conflict {
            aggregate, actual, ..
        } => AppendError::Conflict {
            aggregate,
            expected: Expectation::NoStream,
            actual,
        },
        other => AppendError::Unavailable {
            reason: other.to_string(),
        },
    })?;
    recorded.appended().ok_or_else(|| AppendError::Unavailable {
        reason: format!("provider {provider}: registration found nothing to write"),
    })
}

impl Provisioner {
    pub fn new(runner: OperationRunner, infra: Arc<dyn Infrastructure>, actor: &str) -> Self {
        Provisioner {
            runner,
            infra,
            actor: actor.to_string(),
        }
    }

    /// The claim step for one node (its own step, so a crash after the claim is undone).
    async fn claim_step(
        &self,
        ctx: &OperationCtx,
        provider: Uuid,
        node: Uuid,
        resources: &BTreeMap<String, u64>,
    ) -> Result<(), OperationError> {
        ctx.claim(
            &format!("claim:{node}"),
            provider,
            node,
            ConsumerKind::Instance,
            resources,
        )
        .await
    }

    /// The step that creates a VM, recorded with its termination as the compensation
    /// (which names the cluster, if the VM is a cluster node). Intent before effect: the
    /// termination is declared before the hypervisor is asked, so a runner dying between
    /// the two still leaves the VM known to the ledger.
    async fn create_vm_step(
        &self,
        ctx: &OperationCtx,
        node: Uuid,
        cluster: Option<Uuid>,
    ) -> Result<(), OperationError> {
        let infra = self.infra.clone();
        let vm = node.to_string();
        let mut terminate = undo(CompensationAction::TerminateVm, HYPERVISOR, &vm);
        if let Some(cluster) = cluster {
            terminate
                .args
                .insert(DetailKey::ClusterId.to_string(), cluster.to_string());
        }
        let by_key = terminate.clone();
        ctx.act(
            &format!("create_vm:{node}"),
            HYPERVISOR,
            Some(by_key),
            |key| async move {
                infra.act(HYPERVISOR, "create_vm", &vm, &key).await?;
                let mut done = effect(EffectKind::VmCreated, &vm, HYPERVISOR);
                if let Some(cluster) = cluster {
                    done.detail
                        .insert(DetailKey::ClusterId.to_string(), cluster.to_string());
                }
                Ok(ActOutput::new((), done, Some(terminate)))
            },
        )
        .await
    }

    /// The step that terminates a VM for good: a removal, with nothing to compensate.
    async fn terminate_vm_step(
        &self,
        ctx: &OperationCtx,
        node: Uuid,
    ) -> Result<(), OperationError> {
        let infra = self.infra.clone();
        let vm = node.to_string();
        ctx.act(
            &format!("terminate:{node}"),
            HYPERVISOR,
            None,
            |key| async move {
                infra.act(HYPERVISOR, "terminate_vm", &vm, &key).await?;
                Ok(ActOutput::new(
                    (),
                    effect(EffectKind::NodeTerminated, &vm, HYPERVISOR),
                    None,
                ))
            },
        )
        .await
    }

    /// Creates one node's VM and records the instance and its membership.
    async fn spawn_node(
        &self,
        ctx: &OperationCtx,
        cluster: Uuid,
        group: &NodeGroupSpec,
        node: Uuid,
        provider: Uuid,
    ) -> Result<(), OperationError> {
        self.create_vm_step(ctx, node, Some(cluster)).await?;
        let vm = node.to_string();
        let host = host_of(provider);
        // The node's record and its membership of the cluster, together.
        ctx.append_together(vec![
            (
                AggregateId::instance(node),
                Expectation::NoStream,
                vec![
                    Event::InstanceCreateRequested {
                        name: format!("{}-{}", group.name, &vm[vm.len() - 12..]),
                        cluster_id: Some(cluster),
                        node_group: Some(group.name.clone()),
                        flavor: group.flavor.clone(),
                        resources: group.resources.clone(),
                        image: "sahara-image".into(),
                    },
                    Event::HostAssigned {
                        host,
                        provider_id: provider,
                    },
                    Event::VmStateChanged {
                        vm_state: VmState::Active,
                        reason: "booted".into(),
                    },
                    Event::PowerStateChanged {
                        power_state: PowerState::Running,
                    },
                    Event::TaskFinished {
                        task_state: TaskState::Scheduling,
                        outcome: TaskOutcome::Succeeded,
                        reason: "spawned".into(),
                    },
                ],
            ),
            (
                AggregateId::cluster(cluster),
                Expectation::Any,
                vec![Event::InstanceJoined {
                    node_group: group.name.clone(),
                    instance_id: node,
                }],
            ),
        ])
        .await?;
        self.network(ctx, node).await
    }

    /// IP, DHCP and DNS for one node, each its own step with its own compensation. Each
    /// effect names the node in `detail["node"]`: the IP, the DHCP entry and the DNS name are
    /// resources in their executors' terms, and a later removal of the node (scale-in,
    /// delete, roll-forward) finds their compensations by it (`node_removal`).
    async fn network(&self, ctx: &OperationCtx, node: Uuid) -> Result<(), OperationError> {
        let infra = self.infra.clone();
        let name = format!("node-{node}");
        let of_node = |mut done: Effect| {
            done.detail.insert(NODE_DETAIL.into(), node.to_string());
            done
        };
        // The IP is IPAM's choice: its release is declared by key before asking.
        let ip = {
            let infra = infra.clone();
            let name = name.clone();
            ctx.act(
                &format!("acquire_ip:{node}"),
                IPAM,
                Some(undo(CompensationAction::ReleaseIp, IPAM, "")),
                |key| async move {
                    let ip = infra.acquire_ip(&name, &key).await?;
                    let done = of_node(effect(EffectKind::IpAcquired, &ip, IPAM));
                    let release = undo(CompensationAction::ReleaseIp, IPAM, &ip);
                    Ok(ActOutput::new(ip.clone(), done, Some(release)))
                },
            )
            .await?
        };
        let unregister = undo(CompensationAction::UnregisterDhcp, DHCP, &name);
        {
            let (infra, name, ip) = (infra.clone(), name.clone(), ip.clone());
            ctx.act(
                &format!("register_dhcp:{node}"),
                DHCP,
                Some(unregister.clone()),
                |key| async move {
                    infra.act(DHCP, "register", &name, &key).await?;
                    let mut done = of_node(effect(EffectKind::DhcpRegistered, &name, DHCP));
                    done.detail.insert(DetailKey::Ip.to_string(), ip);
                    Ok(ActOutput::new((), done, Some(unregister)))
                },
            )
            .await?;
        }
        let fqdn = format!("{name}.example");
        let unregister = undo(CompensationAction::UnregisterDns, DNS, &fqdn);
        ctx.act(
            &format!("register_dns:{node}"),
            DNS,
            Some(unregister.clone()),
            |key| async move {
                infra.act(DNS, "register", &fqdn, &key).await?;
                let done = of_node(effect(EffectKind::DnsRegistered, &fqdn, DNS));
                Ok(ActOutput::new((), done, Some(unregister)))
            },
        )
        .await
    }

    /// A plugin action on a node that changes its data role, recorded as an effect. Only a
    /// configure step declares a compensation (`remove_node`, see [`remove_node`]); the
    /// stage rules keep it while the node may hold data, so configuration is undone only
    /// when the user deletes the target. Start and decommission declare none.
    async fn plugin_step(
        &self,
        ctx: &OperationCtx,
        action: &str,
        kind: EffectKind,
        node: Uuid,
        detail: BTreeMap<String, String>,
    ) -> Result<(), OperationError> {
        let infra = self.infra.clone();
        let resource = node.to_string();
        let compensation = (kind == EffectKind::NodeConfigured).then(|| remove_node(node));
        ctx.act(
            &format!("{action}:{node}"),
            PLUGIN,
            compensation.clone(),
            |key| async move {
                infra.act(PLUGIN, action, &resource, &key).await?;
                let mut done = effect(kind, &resource, PLUGIN);
                done.detail = detail;
                Ok(ActOutput::new((), done, compensation))
            },
        )
        .await
    }

    /// The same plugin step on each node, in order.
    async fn plugin_each(
        &self,
        ctx: &OperationCtx,
        action: &str,
        kind: EffectKind,
        nodes: &[Uuid],
    ) -> Result<(), OperationError> {
        for node in nodes {
            self.plugin_step(ctx, action, kind.clone(), *node, BTreeMap::new())
                .await?;
        }
        Ok(())
    }

    /// Removes one resource of a node for good, forward (not as a rollback): its own step,
    /// carried out through the executor's compensation endpoint with an id derived from the
    /// operation and the step (so a retry is recognised), and recorded as a
    /// `resource_removed` effect with nothing to compensate. A roll-forward of this
    /// operation does not request it again.
    async fn removal_step(
        &self,
        ctx: &OperationCtx,
        node: Uuid,
        removal: &Compensation,
        step: &str,
    ) -> Result<(), OperationError> {
        let Executor::Service(executor) = &removal.executor else {
            // `node_removal` lists only service-held resources; the allocation is
            // released by `release_for`.
            return Ok(());
        };
        let word = action_word(&removal.action);
        let request = CompensationRequest {
            operation_id: ctx.id(),
            compensation_id: derived_commit_id(ctx.id(), step),
            attempt: 1,
            action: removal.action.clone(),
            resource: removal.resource.clone(),
            args: removal.args.clone(),
            trace: None,
        };
        let infra = self.infra.clone();
        ctx.step(step, async {
            infra.compensate(executor, &request).await?;
            let mut done = effect(
                EffectKind::Custom(RESOURCE_REMOVED_EFFECT.into()),
                &removal.resource,
                executor,
            );
            done.detail
                .insert(DetailKey::Action.to_string(), word.clone());
            done.detail.insert(NODE_DETAIL.into(), node.to_string());
            Ok(StepOutput::with_effect((), done, None))
        })
        .await
    }

    async fn set_status(
        &self,
        ctx: &OperationCtx,
        cluster: Uuid,
        status: ClusterStatus,
        description: &str,
    ) -> Result<(), OperationError> {
        ctx.append(
            AggregateId::cluster(cluster),
            Expectation::Any,
            vec![Event::ClusterStatusChanged {
                status,
                description: description.into(),
            }],
        )
        .await
        .map(|_| ())
    }

    /// Sahara's create: allocate, spawn (VM, IP, DHCP, DNS per node), configure, start.
    pub async fn create_cluster(&self, request: ClusterRequest) -> RunReport<Vec<Uuid>> {
        let cluster = request.cluster_id;
        let spec = OperationSpec::new(OperationKind::CreateCluster, AggregateId::cluster(cluster))
            .creating(vec![Event::ClusterCreateRequested {
                name: request.name.clone(),
                plugin: request.plugin.clone(),
                node_groups: request.node_groups.clone(),
            }]);
        self.runner
            .run(spec, |ctx| async move {
                let mut nodes = Vec::new();
                for group in &request.node_groups {
                    for _ in 0..group.count {
                        nodes.push((group.clone(), self.runner.stamper().id()));
                    }
                }
                ctx.stage(stage::ALLOCATE).await?;
                for (group, node) in &nodes {
                    self.claim_step(&ctx, request.provider, *node, &group.resources)
                        .await?;
                }
                ctx.stage(stage::SPAWN).await?;
                self.set_status(&ctx, cluster, ClusterStatus::Spawning, "creating VMs")
                    .await?;
                for (group, node) in &nodes {
                    self.spawn_node(&ctx, cluster, group, *node, request.provider)
                        .await?;
                }
                ctx.stage(stage::CONFIGURE).await?;
                self.set_status(&ctx, cluster, ClusterStatus::Configuring, "configuring")
                    .await?;
                let ids: Vec<Uuid> = nodes.iter().map(|(_, n)| *n).collect();
                self.plugin_each(&ctx, "configure", EffectKind::NodeConfigured, &ids)
                    .await?;
                ctx.stage(stage::START).await?;
                self.plugin_each(&ctx, "start", EffectKind::NodeStarted, &ids)
                    .await?;
                self.set_status(&ctx, cluster, ClusterStatus::Active, "ready")
                    .await?;
                Ok(nodes.into_iter().map(|(_, n)| n).collect())
            })
            .await
    }

    /// Sahara's scale of one node group: decommission the nodes removed, terminate them and
    /// create the new ones, configure and start the new ones.
    pub async fn scale_cluster(
        &self,
        cluster: Uuid,
        group: &str,
        remove: Vec<Uuid>,
        add: u32,
        provider: Uuid,
    ) -> RunReport<Vec<Uuid>> {
        let target = AggregateId::cluster(cluster);
        let spec = OperationSpec::new(OperationKind::ScaleCluster, target);
        let group = group.to_string();
        self.runner
            .run(spec, |ctx| async move {
                let (spec, count) = scale_target(&ctx, cluster, &group, &remove, add).await?;
                ctx.append(
                    target,
                    Expectation::Any,
                    vec![
                        Event::ClusterScaleRequested {
                            targets: vec![NodeGroupTarget {
                                name: group.clone(),
                                count,
                            }],
                        },
                        Event::ClusterStatusChanged {
                            status: ClusterStatus::Scaling,
                            description: format!("scaling {group} to {count}"),
                        },
                    ],
                )
                .await?;
                ctx.stage(stage::DECOMMISSION).await?;
                for node in &remove {
                    self.decommission_node(&ctx, cluster, &group, *node, provider)
                        .await?;
                }
                ctx.stage(stage::TERMINATE_AND_CREATE).await?;
                for node in &remove {
                    self.terminate_node(&ctx, cluster, &group, *node, Some(provider))
                        .await?;
                }
                let added = self.add_nodes(&ctx, cluster, &spec, add, provider).await?;
                ctx.stage(stage::CONFIGURE_NEW).await?;
                self.plugin_each(&ctx, "configure", EffectKind::NodeConfigured, &added)
                    .await?;
                self.set_status(&ctx, cluster, ClusterStatus::Active, "scaled")
                    .await?;
                Ok(added)
            })
            .await
    }

    /// The decommission step of a node a scale removes, its removal list in the effect.
    async fn decommission_node(
        &self,
        ctx: &OperationCtx,
        cluster: Uuid,
        group: &str,
        node: Uuid,
        provider: Uuid,
    ) -> Result<(), OperationError> {
        // The node's removal list goes with the decommission effect: if the
        // scale stops in terminate_and_create before this node is gone, the
        // roll-forward removes its plugin record, DNS, DHCP and IP too, not
        // only its VM and allocation.
        let removal = node_removal(ctx.ledger(), node).await?;
        // A list of compensations (plain serde values) always encodes.
        let removal = serde_json::to_string(&removal).expect("compensations encode as JSON");
        let detail = BTreeMap::from([
            (DetailKey::ClusterId.to_string(), cluster.to_string()),
            (DetailKey::NodeGroup.to_string(), group.to_string()),
            (DetailKey::ProviderId.to_string(), provider.to_string()),
            (REMOVAL_DETAIL.to_string(), removal),
        ]);
        self.plugin_step(
            ctx,
            "decommission",
            EffectKind::NodeDecommissioned,
            node,
            detail,
        )
        .await
    }

    /// Claims and spawns `add` new nodes of a group, one after the other: their ids.
    async fn add_nodes(
        &self,
        ctx: &OperationCtx,
        cluster: Uuid,
        spec: &NodeGroupSpec,
        add: u32,
        provider: Uuid,
    ) -> Result<Vec<Uuid>, OperationError> {
        let mut added = Vec::new();
        for _ in 0..add {
            let node = self.runner.stamper().id();
            self.claim_step(ctx, provider, node, &spec.resources)
                .await?;
            self.spawn_node(ctx, cluster, spec, node, provider).await?;
            added.push(node);
        }
        Ok(added)
    }

    /// Terminates a node for good (a scale-in or a delete): its plugin record, DNS, DHCP
    /// and IP (each its own step), then the VM, then the ledger's records of it
    /// (allocation, membership, instance). The network and the plugin go before the VM, so
    /// a failing termination leaves only the VM (and the allocation) for the roll-forward.
    async fn terminate_node(
        &self,
        ctx: &OperationCtx,
        cluster: Uuid,
        group: &str,
        node: Uuid,
        provider: Option<Uuid>,
    ) -> Result<(), OperationError> {
        let removal = node_removal(ctx.ledger(), node).await?;
        let mut named = Vec::new();
        for c in &removal {
            // `unregister_dns:<node>`; a second removal with the same action (a node with
            // two IPs) names its resource too, so that step names and the derived request
            // ids stay unique.
            let mut step = format!("{}:{node}", action_word(&c.action));
            if named.contains(&step) {
                step = format!("{step}/{}", c.resource);
            }
            self.removal_step(ctx, node, c, &step).await?;
            named.push(step);
        }
        self.terminate_vm_step(ctx, node).await?;
        let reason = format!("terminated by operation {}", ctx.id());
        if let Some(provider) = provider {
            self.release_for(ctx, provider, node, &reason).await?;
        }
        // Termination records go straight to the log: they record a removal, which a
        // deleting cluster accepts.
        // The instance record closed and its membership ended, together.
        let instance = AggregateId::instance(node);
        let mut facts = Vec::new();
        if let Ok(Some(Entity::Instance(i))) = ctx.ledger().read_current(instance).await {
            if i.vm_state != Some(VmState::Deleted) {
                let mut events = Vec::new();
                if !i.delete_requested {
                    events.push(Event::InstanceDeleteRequested {
                        reason: reason.clone(),
                    });
                }
                events.push(Event::InstanceDeleted {});
                facts.push((instance, Expectation::Any, events));
            }
        }
        facts.push((
            AggregateId::cluster(cluster),
            Expectation::Any,
            vec![Event::InstanceLeft {
                node_group: group.to_string(),
                instance_id: node,
                reason,
            }],
        ));
        ctx.append_together(facts).await?;
        Ok(())
    }

    /// Releases `consumer`'s allocation on `provider` on behalf of the operation, unless the
    /// operation was cancelled.
    async fn release_for(
        &self,
        ctx: &OperationCtx,
        provider: Uuid,
        consumer: Uuid,
        reason: &str,
    ) -> Result<(), OperationError> {
        ctx.check_cancelled().await?;
        release_allocation(ctx.ledger(), provider, consumer, reason, |events| {
            ctx.draft(events)
        })
        .await
        .map_err(OperationError::from)
    }

    /// The first half of a delete: records the request (idempotent), then drives the
    /// rollback of the operation it cancelled. The runner of that operation stops at its
    /// next step and rolls back by itself; driving it here as well is safe (the driver
    /// races by expected version) and covers a runner that died. `Err(report)`: nothing
    /// more to do (unknown or already deleted).
    async fn begin_delete(
        &self,
        target: AggregateId,
        reason: &str,
    ) -> Result<Result<(DeleteRequestOutcome, Option<Uuid>), DeleteReport>, DeleteError> {
        let ledger = self.runner.ledger();
        let (request, cancelled) = deletion::request_delete(
            ledger,
            self.runner.notices(),
            target,
            reason,
            &self.actor,
            self.runner.stamper(),
        )
        .await?;
        if matches!(
            request,
            DeleteRequestOutcome::Unknown | DeleteRequestOutcome::AlreadyDeleted
        ) {
            let deleted = request == DeleteRequestOutcome::AlreadyDeleted;
            return Ok(Err(DeleteReport {
                request,
                cancelled,
                delete_operation: None,
                deleted,
            }));
        }
        let entity = ledger.read_current(target).await?;
        let op = entity.as_ref().and_then(deletion::cancellable_in_flight);
        if let (Some(op), Some(driver)) = (op, self.runner.driver()) {
            if let Err(e) = driver.drive(op).await {
                tracing::warn!(operation = %op, error = %e, "cancelled operation not closed yet");
            }
        }
        Ok(Ok((request, cancelled)))
    }

    /// Deletes a cluster: records the request (idempotent), cancels the operation in
    /// flight and waits for its rollback, terminates every remaining node under a
    /// delete operation, and records `Deleted` once nothing remains.
    pub async fn delete_cluster(
        &self,
        cluster: Uuid,
        reason: &str,
    ) -> Result<DeleteReport, DeleteError> {
        let target = AggregateId::cluster(cluster);
        let ledger = self.runner.ledger();
        let (request, cancelled) = match self.begin_delete(target, reason).await? {
            Ok(begun) => begun,
            Err(report) => return Ok(report),
        };
        let members: Vec<(String, Uuid)> = match ledger.read_current(target).await {
            Ok(Some(Entity::Cluster(c))) => c
                .node_groups
                .iter()
                .flat_map(|g| g.instance_ids.iter().map(|i| (g.spec.name.clone(), *i)))
                .collect(),
            Ok(_) => Vec::new(),
            Err(e) => return Err(e.into()),
        };
        let mut delete_operation = None;
        if !members.is_empty() {
            let spec = OperationSpec::new(OperationKind::DeleteCluster, target);
            let report = self
                .runner
                .run(spec, |ctx| async move {
                    ctx.stage(stage::TERMINATE).await?;
                    for (group, node) in &members {
                        // A read that fails is the step's failure, never "no provider":
                        // that would leave the node's allocation behind for good.
                        let provider = match ctx
                            .ledger()
                            .read_current(AggregateId::instance(*node))
                            .await
                        {
                            Ok(Some(Entity::Instance(i))) => i.provider_id,
                            Ok(_) => None,
                            Err(e) => return Err(e.into()),
                        };
                        self.terminate_node(&ctx, cluster, group, *node, provider)
                            .await?;
                    }
                    Ok(())
                })
                .await;
            delete_operation = Some(report);
        }
        let deleted =
            deletion::complete_deletion(ledger, target, &self.actor, self.runner.stamper()).await?;
        Ok(DeleteReport {
            request,
            cancelled,
            delete_operation,
            deleted,
        })
    }

    /// Deletes an instance: records the request (idempotent), cancels the operation in
    /// flight and waits for its rollback, terminates the VM and releases its allocation
    /// under a delete operation, and records `Deleted` once no allocation remains.
    pub async fn delete_instance(
        &self,
        instance: Uuid,
        reason: &str,
    ) -> Result<DeleteReport, DeleteError> {
        let target = AggregateId::instance(instance);
        let ledger = self.runner.ledger();
        let (request, cancelled) = match self.begin_delete(target, reason).await? {
            Ok(begun) => begun,
            Err(report) => return Ok(report),
        };
        let spec = OperationSpec::new(OperationKind::DeleteInstance, target);
        let report = self
            .runner
            .run(spec, |ctx| async move {
                ctx.stage(stage::TERMINATE).await?;
                // Removing a VM that is already gone (a rolled-back boot) is a no-op.
                self.terminate_vm_step(&ctx, instance).await?;
                let provider = match ctx.ledger().read_current(target).await {
                    Ok(Some(Entity::Instance(i))) => i.provider_id,
                    Ok(_) => None,
                    Err(e) => return Err(e.into()),
                };
                if let Some(provider) = provider {
                    let reason = format!("instance deleted by operation {}", ctx.id());
                    self.release_for(&ctx, provider, instance, &reason).await?;
                }
                Ok(())
            })
            .await;
        let deleted =
            deletion::complete_deletion(ledger, target, &self.actor, self.runner.stamper()).await?;
        Ok(DeleteReport {
            request,
            cancelled,
            delete_operation: Some(report),
            deleted,
        })
    }

    /// Boots one instance: schedule (claim), network (IP, DHCP, DNS), spawn (VM).
    pub async fn boot_instance(
        &self,
        request: InstanceRequest,
        parent: Option<Uuid>,
    ) -> RunReport<()> {
        let instance = request.instance_id;
        let mut spec =
            OperationSpec::new(OperationKind::BootInstance, AggregateId::instance(instance))
                .creating(vec![Event::InstanceCreateRequested {
                    name: request.name.clone(),
                    cluster_id: None,
                    node_group: None,
                    flavor: "m1.small".into(),
                    resources: request.resources.clone(),
                    image: "ubuntu-24.04".into(),
                }]);
        spec.parent_id = parent;
        self.runner
            .run(spec, |ctx| async move {
                ctx.stage(stage::SCHEDULE).await?;
                self.claim_step(&ctx, request.provider, instance, &request.resources)
                    .await?;
                ctx.append(
                    AggregateId::instance(instance),
                    Expectation::Any,
                    vec![Event::HostAssigned {
                        host: host_of(request.provider),
                        provider_id: request.provider,
                    }],
                )
                .await?;
                ctx.stage(stage::NETWORK).await?;
                self.network(&ctx, instance).await?;
                ctx.stage(stage::SPAWN).await?;
                self.create_vm_step(&ctx, instance, None).await?;
                ctx.append(
                    AggregateId::instance(instance),
                    Expectation::Any,
                    vec![
                        Event::VmStateChanged {
                            vm_state: VmState::Active,
                            reason: "booted".into(),
                        },
                        Event::TaskFinished {
                            task_state: TaskState::Scheduling,
                            outcome: TaskOutcome::Succeeded,
                            reason: "spawned".into(),
                        },
                    ],
                )
                .await?;
                Ok(())
            })
            .await
    }

    /// A service bundle: boots each child in turn. When one fails, the bundle fails at
    /// that child and its policy decides about the siblings.
    pub async fn bundle(
        &self,
        policy: BundlePolicy,
        children: Vec<InstanceRequest>,
    ) -> RunReport<()> {
        let id = self.runner.stamper().id();
        let mut spec =
            OperationSpec::new(OperationKind::Bundle, AggregateId::operation(id)).with_id(id);
        spec.bundle_policy = Some(policy);
        self.runner
            .run(spec, |ctx| async move {
                ctx.stage(stage::CHILDREN).await?;
                for child in children {
                    let report = Box::pin(self.boot_instance(child, Some(ctx.id()))).await;
                    ctx.add_child(report.operation_id).await?;
                    if let Err(e) = report.result {
                        return Err(
                            ctx.step_failed(&report.operation_id.to_string(), e.to_string())
                        );
                    }
                }
                Ok(())
            })
            .await
    }
}
