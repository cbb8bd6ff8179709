//! The seeded simulation (TigerBeetle's VOPR is the model): one seed decides every choice
//! (which operations run, with how many nodes, which executor call fails, where a user's
//! delete lands, which appends the log refuses or whose ack it loses), time is tokio's
//! paused clock and ids come from a seeded source, so a seed replays exactly. After the
//! run the invariants are checked; a failing seed is reported with what broke.
//!
//! Each seed runs a series of operations of every kind against the reference flows, with
//! a fault-injecting in-memory log, faulty executors, deletes racing creates, runners
//! dying between two steps and between an executor's action and the record of its
//! outcome (their future dropped, as kill -9 would), and two rollback drivers racing over
//! every stopped operation. Then the log is healed, an operator cancels every operation
//! whose runner died, every operation is driven to its end (an operator resuming the
//! rollbacks that needed attention), and these must hold:
//! - every compensation request an executor received is an attempt recorded in the log
//!   (no double execution by racing drivers or retries);
//! - nothing is left at any executor that the ledger does not know about: every held
//!   resource is a recorded effect, or was made under the idempotency key of a recorded
//!   step (done, or started with its outcome unknown);
//! - nothing is left at any executor under the key of an operation that rolled back or
//!   was cancelled with nothing retained;
//! - a boot rolled back or cancelled with nothing retained leaves its instance (unless
//!   deleted) with no build task, and with no host unless a delete owns it, also when its
//!   rollback first needed attention and was resumed;
//! - no acknowledged fact was dropped by the fold (no "not applied" anomaly);
//! - the audit's invariants hold: no allocation unaccounted for (orphaned, misplaced, over
//!   capacity), no rollback unfinished, no effect recorded after its rollback's plan;
//! - every operation ends: succeeded, rolled back, held, cancelled or needs_attention
//!   (none is left running).
//!
//! The caller runs it on a current-thread runtime with paused time
//! ([`run_seed_blocking`]); the rebuild-versus-projector check lives with the projector
//! (`provledger simulate`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use provledger_client::deletion;
use provledger_client::write::{Fact, FromTheLog, RecordError};
use provledger_client::{
    idempotency_key, CancelNotices, Clock, Ledger, OperationRunner, RollbackDriver, SeededIds,
    Stamper, StepHook, Writer,
};
use provledger_events::catalogue::{NodeGroupSpec, OperationKind, VmState};
use provledger_events::log::{FaultCounts, FaultPlan, MemLog};
use provledger_events::{
    AggregateId, AggregateKind, Commit, Event, EventLog, Expectation, Timestamp,
};
use provledger_projections::instance::is_build_task;
use provledger_projections::operation::{OperationState, OperationStatus};
use provledger_projections::rollback::RetryPolicy;
use provledger_projections::{Entity, Projection};
use uuid::Uuid;

use crate::executors::SimInfrastructure;
use crate::flows::{register_compute_node_stamped, ClusterRequest, InstanceRequest, Provisioner};

/// How big one seed's run is.
#[derive(Debug, Clone, Copy)]
pub struct SimulationConfig {
    /// Operations started per seed (creates, boots, scales, deletes).
    pub operations: usize,
    pub unavailable_per_mille: u32,
    pub lost_ack_per_mille: u32,
    pub read_unavailable_per_mille: u32,
}

impl Default for SimulationConfig {
    fn default() -> Self {
        SimulationConfig {
            operations: 10,
            unavailable_per_mille: 20,
            lost_ack_per_mille: 20,
            read_unavailable_per_mille: 10,
        }
    }
}

/// What one seed did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct SeedReport {
    pub seed: u64,
    pub operations: usize,
    pub commits: usize,
    /// Final status of every operation the seed started, by status.
    pub outcomes: BTreeMap<String, usize>,
    pub unavailable: u64,
    pub lost_acks: u64,
    pub read_unavailable: u64,
    /// Runners that died between two steps or between an action and its record (an
    /// operator cancels what they left, at the end of the run).
    pub crashes: usize,
    /// Of those, the ones that died right after an executor acted.
    pub crashes_after_action: usize,
    /// Atomic sets the log's group commit wrote, and in how many shared writes.
    pub atomic_sets: u64,
    pub atomic_writes: u64,
    /// Writers of the storm's atomic sets that died mid-way (their future dropped).
    pub storm_writers_died: usize,
}

/// One seed's result: the report, the broken invariants (empty when all hold) and the log,
/// for checks the caller adds.
pub struct SeedOutcome {
    pub report: SeedReport,
    pub violations: Vec<String>,
    pub commits: Vec<Commit>,
}

/// The seed's choices: splitmix64, the same sequence everywhere.
struct Choices(u64);

impl Choices {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }

    fn uuid(&mut self) -> Uuid {
        // Version 7 layout with a fixed early time: ids only need to be unique and stable.
        let bytes = [self.next().to_be_bytes(), self.next().to_be_bytes()].concat();
        let mut random = [0u8; 10];
        random.copy_from_slice(&bytes[..10]);
        uuid::Builder::from_unix_timestamp_millis(1_800_000_000_000, &random).into_uuid()
    }
}

/// tokio's clock (paused in a simulation, so it moves only when every task waits), from a
/// fixed start: time in a run depends on the seed alone.
struct TokioClock {
    start: tokio::time::Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        let elapsed = i64::try_from(self.start.elapsed().as_millis()).unwrap_or(i64::MAX);
        Timestamp::from_unix_ms(1_800_000_000_000_i64.saturating_add(elapsed))
    }
}

fn fast_retries() -> RetryPolicy {
    RetryPolicy {
        attempts_max: 3,
        backoff_base_ms: 10,
        backoff_max_ms: 100,
        reply_wait_ms: 1_000,
        runner_stop_wait_ms: 5_000,
    }
}

/// Where a user's delete lands: before the step of `stage` whose name starts with `step`.
type DeleteAt = Arc<Mutex<Option<(String, String, AggregateId)>>>;
/// The stage before whose first step the runner's process dies.
type CrashAt = Arc<Mutex<Option<String>>>;

/// Longer than any operation of a seed takes in simulated time: an operation still going
/// after it crashed (its runner's future is dropped).
const CRASH_DETECTED_AFTER: std::time::Duration = std::time::Duration::from_secs(600);

/// Runs one seed on a fresh current-thread runtime with paused time.
pub fn run_seed_blocking(seed: u64, config: &SimulationConfig) -> SeedOutcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build();
    match runtime {
        Ok(rt) => rt.block_on(run_seed(seed, config)),
        Err(e) => SeedOutcome {
            report: SeedReport {
                seed,
                ..Default::default()
            },
            violations: vec![format!("cannot start a runtime: {e}")],
            commits: Vec::new(),
        },
    }
}

/// The stages of a cluster's create: where a user's delete lands or the runner dies.
const CREATE_STAGES: [&str; 4] = ["allocate", "spawn", "configure", "start"];

/// Where a runner can die between an executor's action and its record.
const AFTER_ACTIONS: [(&str, &str); 6] = [
    ("hypervisor", "create_vm"),
    ("ipam", "acquire_ip"),
    ("dhcp", "register"),
    ("dns", "register"),
    ("plugin", "configure"),
    ("plugin", "start"),
];

/// The executor calls the seed makes fail.
const FAULTS: [(&str, &str); 4] = [
    ("hypervisor", "create_vm"),
    ("ipam", "acquire_ip"),
    ("dns", "register_dns"),
    ("plugin", "configure"),
];

/// One seed: see the module documentation.
pub async fn run_seed(seed: u64, config: &SimulationConfig) -> SeedOutcome {
    let mut run = SeedRun::start(seed, config).await;
    for _ in 0..config.operations {
        run.inject_executor_faults();
        let op = run.next_operation().await;
        run.race_drivers(op).await;
    }

    // A boot storm of facts that move together, while the log still misbehaves.
    let storm = run.storm().await;

    // The log heals and the executors stop failing; every operation is driven to its end.
    run.heal(storm).await;
    let all_operations = run.drive_to_the_end().await;

    run.check_and_report(&all_operations).await
}

/// Everything a seed's run acts through: the log and its writer, the clock and ids, the
/// executors, the provisioner (whose runner the step hook steers) and the two rollback
/// drivers that race over every stopped operation.
struct World {
    log: MemLog,
    ledger: Writer<Ledger>,
    stamper: Stamper,
    infra: Arc<SimInfrastructure>,
    delete_at: DeleteAt,
    crash_at: CrashAt,
    prov: Provisioner,
    drivers: [RollbackDriver; 2],
}

impl World {
    /// Builds the world of `seed`: a fresh log (not misbehaving yet), tokio's clock from
    /// now, ids from the seed, the runner's step hook with nothing armed.
    fn new(seed: u64) -> World {
        let log = MemLog::new();
        let ledger = Writer::new(Ledger::Memory(log.clone()));
        let stamper = Stamper::new(
            Arc::new(TokioClock {
                start: tokio::time::Instant::now(),
            }),
            Arc::new(SeededIds::new(seed)),
        );
        let infra = Arc::new(SimInfrastructure::default());
        let notices = CancelNotices::local();
        let delete_at: DeleteAt = Arc::new(Mutex::new(None));
        let crash_at: CrashAt = Arc::new(Mutex::new(None));
        let hook = step_hook(&ledger, &notices, &stamper, &delete_at, &crash_at);
        let runner = OperationRunner::new(ledger.clone(), notices.clone(), None, "sim")
            .with_stamper(stamper.clone())
            .with_step_hook(hook);
        let prov = Provisioner::new(runner, infra.clone(), "sim");
        let drivers = [
            RollbackDriver::new(ledger.clone(), infra.clone(), fast_retries(), "driver-a")
                .with_stamper(stamper.clone()),
            RollbackDriver::new(ledger.clone(), infra.clone(), fast_retries(), "driver-b")
                .with_stamper(stamper.clone()),
        ];
        World {
            log,
            ledger,
            stamper,
            infra,
            delete_at,
            crash_at,
            prov,
            drivers,
        }
    }

    /// How many of the crashes injected after an executor's action have happened, at all
    /// executors.
    fn crashed_after_calls(&self) -> u32 {
        self.infra.all().iter().map(|e| e.crashed()).sum()
    }

    /// Disarms every fault armed for one operation and not yet fired: the crashes after an
    /// executor's action, the user's delete and the runner's death.
    fn disarm(&self) {
        for e in self.infra.all() {
            e.clear_crashes();
        }
        *self.delete_at.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.crash_at.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// The runner's step hook: before a step of the stage `crash_at` names, the runner's
/// process dies; before the step `delete_at` names, a user's delete is sent. Each fires
/// once.
fn step_hook(
    ledger: &Writer<Ledger>,
    notices: &CancelNotices,
    stamper: &Stamper,
    delete_at: &DeleteAt,
    crash_at: &CrashAt,
) -> StepHook {
    let (ledger, notices, stamper, delete_at, crash_at) = (
        ledger.clone(),
        notices.clone(),
        stamper.clone(),
        delete_at.clone(),
        crash_at.clone(),
    );
    Arc::new(move |_op, stage, step| {
        let crash = {
            let mut at = crash_at.lock().unwrap_or_else(|p| p.into_inner());
            let hit = at.as_deref() == Some(stage.as_str());
            if hit {
                *at = None;
            }
            hit
        };
        let fire = {
            let mut at = delete_at.lock().unwrap_or_else(|p| p.into_inner());
            match &*at {
                Some((s, prefix, target)) if *s == stage && step.starts_with(prefix) => {
                    let target = *target;
                    *at = None;
                    Some(target)
                }
                _ => None,
            }
        };
        let (ledger, notices, stamper) = (ledger.clone(), notices.clone(), stamper.clone());
        Box::pin(async move {
            if crash {
                // The runner's process dies between two steps: nothing more comes
                // from it. The harness drops the operation's future.
                std::future::pending::<()>().await;
            }
            if let Some(target) = fire {
                // A user's delete racing the operation; the log may refuse it too.
                let _ = deletion::request_delete(
                    &ledger,
                    &notices,
                    target,
                    "deleted by a user while it was being built",
                    "sim-user",
                    &stamper,
                )
                .await;
            }
        })
    })
}

/// One seed's run as it goes: its choices, its world, the compute node everything is
/// placed on, the clusters and instances it made, the runners that died, what broke.
struct SeedRun {
    seed: u64,
    choose: Choices,
    world: World,
    provider: Uuid,
    clusters: Vec<Uuid>,
    instances: Vec<Uuid>,
    crashes: usize,
    crashes_after_action: usize,
    storm_writers_died: usize,
    violations: Vec<String>,
}

impl SeedRun {
    /// Sets up the world of `seed`, registers its compute node, then lets the log
    /// misbehave.
    async fn start(seed: u64, config: &SimulationConfig) -> SeedRun {
        let mut choose = Choices(seed);
        let world = World::new(seed);
        let provider = choose.uuid();
        let vcpus = 8 + choose.below(24);
        let mut violations = Vec::new();
        if let Err(e) = register_compute_node_stamped(
            &world.ledger,
            provider,
            "cn-1",
            vcpus,
            "sim",
            &world.stamper,
        )
        .await
        {
            violations.push(format!("registering the compute node: {e}"));
        }
        // From here on the log misbehaves, as the seed decides.
        world.log.set_faults(Some(FaultPlan {
            seed,
            unavailable_per_mille: config.unavailable_per_mille,
            lost_ack_per_mille: config.lost_ack_per_mille,
            read_unavailable_per_mille: config.read_unavailable_per_mille,
        }));
        SeedRun {
            seed,
            choose,
            world,
            provider,
            clusters: Vec::new(),
            instances: Vec::new(),
            crashes: 0,
            crashes_after_action: 0,
            storm_writers_died: 0,
            violations,
        }
    }

    /// As the seed decides: an executor's call fails a few times, an executor refuses a
    /// few compensations.
    fn inject_executor_faults(&mut self) {
        if self.choose.chance(400) {
            let (executor, action) = FAULTS[self.choose.below(FAULTS.len() as u64) as usize];
            if let Some(e) = self.world.infra.executor(executor) {
                e.fail_call(action, 1 + self.choose.below(3) as u32);
            }
        }
        if self.choose.chance(150) {
            let executor = ["ipam", "dns", "hypervisor"][self.choose.below(3) as usize];
            if let Some(e) = self.world.infra.executor(executor) {
                e.fail_compensations(1 + self.choose.below(4) as u32);
            }
        }
    }

    /// Runs the operation the seed picks next (a cluster's create, an instance's boot, a
    /// scale, or a user's delete of a cluster or an instance) until it stops: its id, if
    /// it has one.
    async fn next_operation(&mut self) -> Option<Uuid> {
        match self.choose.below(10) {
            0..=4 => self.create_cluster().await,
            5..=6 => Some(self.boot_instance().await),
            7 => self.scale_cluster().await,
            8 => self.delete_cluster().await,
            _ => self.delete_instance().await,
        }
    }

    /// A cluster's create, with the faults the seed arms for it; when its runner dies, its
    /// operation is found on the cluster.
    async fn create_cluster(&mut self) -> Option<Uuid> {
        let cluster = self.choose.uuid();
        self.arm_create_faults(cluster);
        let run = self.world.prov.create_cluster(ClusterRequest {
            cluster_id: cluster,
            name: format!("c{}", self.clusters.len()),
            plugin: "vanilla".into(),
            node_groups: vec![NodeGroupSpec {
                name: "workers".into(),
                count: 1 + self.choose.below(3) as u32,
                flavor: "m1.small".into(),
                resources: BTreeMap::from([("VCPU".to_string(), 2)]),
                processes: vec!["datanode".into()],
            }],
            provider: self.provider,
        });
        let crashed_before = self.world.crashed_after_calls();
        let op = match tokio::time::timeout(CRASH_DETECTED_AFTER, run).await {
            Ok(report) => Some(report.operation_id),
            Err(_) => {
                // Crashed: its operation is the one marked on the cluster.
                self.crashes += 1;
                if self.world.crashed_after_calls() > crashed_before {
                    self.crashes_after_action += 1;
                }
                in_flight_on(&self.world.ledger, AggregateId::cluster(cluster)).await
            }
        };
        self.world.disarm();
        self.clusters.push(cluster);
        op
    }

    /// As the seed decides, for the create of `cluster`: a user's delete before a stage,
    /// the runner's death before a stage, the runner's death between an executor's action
    /// and its record.
    fn arm_create_faults(&mut self, cluster: Uuid) {
        if self.choose.chance(300) {
            let stage = CREATE_STAGES[self.choose.below(CREATE_STAGES.len() as u64) as usize];
            *self
                .world
                .delete_at
                .lock()
                .unwrap_or_else(|p| p.into_inner()) =
                Some((stage.into(), String::new(), AggregateId::cluster(cluster)));
        }
        if self.choose.chance(100) {
            let stage = CREATE_STAGES[self.choose.below(CREATE_STAGES.len() as u64) as usize];
            *self
                .world
                .crash_at
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(stage.into());
        }
        if self.choose.chance(150) {
            let (executor, action) =
                AFTER_ACTIONS[self.choose.below(AFTER_ACTIONS.len() as u64) as usize];
            if let Some(e) = self.world.infra.executor(executor) {
                e.crash_after_call(action, 1 + self.choose.below(2) as u32);
            }
        }
    }

    /// An instance's boot: its operation's id.
    async fn boot_instance(&mut self) -> Uuid {
        let instance = self.choose.uuid();
        let report = self
            .world
            .prov
            .boot_instance(
                InstanceRequest {
                    instance_id: instance,
                    name: format!("vm{}", self.instances.len()),
                    resources: BTreeMap::from([("VCPU".to_string(), 1)]),
                    provider: self.provider,
                },
                None,
            )
            .await;
        self.instances.push(instance);
        report.operation_id
    }

    /// The scale of a cluster the seed picks (none yet: no operation): up to one member
    /// removed, up to one node added.
    async fn scale_cluster(&mut self) -> Option<Uuid> {
        let cluster = pick(&mut self.choose, &self.clusters)?;
        let members = members(&self.world.ledger, cluster).await;
        let remove = members
            .into_iter()
            .take(self.choose.below(2) as usize)
            .collect();
        let report = self
            .world
            .prov
            .scale_cluster(
                cluster,
                "workers",
                remove,
                self.choose.below(2) as u32,
                self.provider,
            )
            .await;
        Some(report.operation_id)
    }

    /// A user's delete of a cluster the seed picks: the delete operation's id, if one ran.
    async fn delete_cluster(&mut self) -> Option<Uuid> {
        let cluster = pick(&mut self.choose, &self.clusters)?;
        self.world
            .prov
            .delete_cluster(cluster, "deleted by a user")
            .await
            .ok()
            .and_then(|r| r.delete_operation.map(|d| d.operation_id))
    }

    /// A user's delete of an instance the seed picks: the delete operation's id, if one
    /// ran.
    async fn delete_instance(&mut self) -> Option<Uuid> {
        let instance = pick(&mut self.choose, &self.instances)?;
        self.world
            .prov
            .delete_instance(instance, "deleted by a user")
            .await
            .ok()
            .and_then(|r| r.delete_operation.map(|d| d.operation_id))
    }

    /// Both drivers drive the operation that just stopped, at once.
    async fn race_drivers(&self, op: Option<Uuid>) {
        if let Some(op) = op.filter(|o| !o.is_nil()) {
            // Two drivers race over the stopped operation; the log may fail either.
            let [a, b] = &self.world.drivers;
            let _ = futures::join!(a.drive(op), b.drive(op));
        }
    }

    /// The storm of atomic sets (see [`atomic_storm`]), counting the writers that died.
    async fn storm(&mut self) -> Vec<StormSet> {
        let storm = atomic_storm(&self.world.ledger, &self.world.stamper, &mut self.choose).await;
        self.storm_writers_died = storm.iter().filter(|s| s.answer.is_none()).count();
        storm
    }

    /// Heals the log, checks the storm's sets on it, and stops the executors refusing
    /// compensations.
    async fn heal(&mut self, storm: Vec<StormSet>) {
        self.world.log.set_faults(None);
        check_storm(
            &self.world.ledger,
            &self.world.log,
            storm,
            &mut self.violations,
        )
        .await;
        for e in self.world.infra.all() {
            e.fail_compensations(0);
        }
    }

    /// Drives every operation of the log to its end, as operators would: the ids of all
    /// of them, in order.
    async fn drive_to_the_end(&self) -> Vec<Uuid> {
        let (ledger, stamper, drivers) =
            (&self.world.ledger, &self.world.stamper, &self.world.drivers);
        let all_operations = operation_ids(&self.world.log).await;
        // An operator cancels every operation whose runner died: the drivers, finding it
        // silent past the runner stop wait, record the cancellation and roll it back.
        for op in &all_operations {
            cancel_if_running(ledger, stamper, *op).await;
        }
        for op in &all_operations {
            for driver in drivers {
                let _ = driver.drive(*op).await;
            }
        }
        // An operator then resumes every rollback that needed attention (the executors work
        // again), as `provledger rollback run` does, and the drivers finish them.
        for op in &all_operations {
            let resumed = provledger_client::resume_needs_attention(
                ledger,
                *op,
                "the executors are back; resumed by an operator",
                "sim-operator",
                stamper,
            )
            .await;
            if matches!(resumed, Ok(true)) {
                for driver in drivers {
                    let _ = driver.drive(*op).await;
                }
            }
        }
        all_operations
    }

    /// Checks the invariants on the final log and reports what the seed did.
    async fn check_and_report(mut self, all_operations: &[Uuid]) -> SeedOutcome {
        let commits = read_log(&self.world.log).await;
        let projection = Projection::rebuild(&commits);
        check_invariants(&projection, &self.world.infra, &mut self.violations);
        // The audit's invariants too: no allocation unaccounted for (orphaned, misplaced, over
        // capacity), no rollback left unfinished, no late effect.
        for v in
            provledger_projections::audit::check_invariants(&projection, self.world.stamper.now())
        {
            self.violations.push(format!(
                "audit {:?} on {}: {}",
                v.check,
                v.aggregate.as_deref().unwrap_or("-"),
                v.problem
            ));
        }
        let counts: FaultCounts = self.world.log.fault_counts();
        SeedOutcome {
            report: SeedReport {
                seed: self.seed,
                operations: all_operations.len(),
                commits: commits.len(),
                outcomes: outcomes(&projection, all_operations),
                unavailable: counts.unavailable,
                lost_acks: counts.lost_acks,
                read_unavailable: counts.read_unavailable,
                crashes: self.crashes,
                crashes_after_action: self.crashes_after_action,
                atomic_sets: self.world.log.group_stats().sets,
                atomic_writes: self.world.log.group_stats().writes,
                storm_writers_died: self.storm_writers_died,
            },
            violations: self.violations,
            commits,
        }
    }
}

/// How many of `operations` ended in each status, by the status's name.
fn outcomes(projection: &Projection, operations: &[Uuid]) -> BTreeMap<String, usize> {
    let mut outcomes = BTreeMap::new();
    for op in operations {
        if let Some(Entity::Operation(o)) = projection.get(&AggregateId::operation(*op)) {
            let status = match serde_json::to_value(o.status) {
                Ok(serde_json::Value::String(s)) => s,
                _ => "absent".into(),
            };
            *outcomes.entry(status).or_insert(0) += 1;
        }
    }
    outcomes
}

/// Atomic sets of the storm, with what their writer was told.
struct StormSet {
    facts: Vec<Fact>,
    /// Every 8th set expects a version its first aggregate never has.
    stale: bool,
    answer: Option<Result<(), String>>,
}

/// Sets of facts written together, all at once, so that the log's group commit shares its
/// writes between them: every 8th set stale (it must be refused alone), some writers dying
/// mid-way (their future dropped after its first poll, its set queued or not), the log
/// refusing groups and losing their acks as the seed decides.
async fn atomic_storm(
    ledger: &Writer<Ledger>,
    stamper: &Stamper,
    choose: &mut Choices,
) -> Vec<StormSet> {
    use provledger_events::catalogue::samples;
    let create = samples::all().remove(0);
    let mut sets: Vec<StormSet> = (0..(8 + choose.below(24) as usize))
        .map(|n| {
            let stale = n % 8 == 7;
            let mut fact = |expect| Fact {
                aggregate: AggregateId::cluster(choose.uuid()),
                expect,
                draft: stamper.draft("sim-storm", vec![create.clone()]),
            };
            let first = match stale {
                true => Expectation::Exactly(1),
                false => Expectation::NoStream,
            };
            StormSet {
                facts: vec![fact(first), fact(Expectation::Any)],
                stale,
                answer: None,
            }
        })
        .collect();
    let dies: Vec<bool> = sets.iter().map(|_| choose.chance(150)).collect();
    let writes = sets.iter().zip(&dies).map(|(set, dies)| {
        let (ledger, facts) = (ledger.clone(), set.facts.clone());
        let dies = *dies;
        async move {
            let write = ledger.record_atomic(facts, Default::default(), &FromTheLog);
            match dies {
                true => tokio::time::timeout(std::time::Duration::ZERO, write)
                    .await
                    .ok(),
                false => Some(write.await),
            }
        }
    });
    let answers = futures::future::join_all(writes).await;
    for (set, answer) in sets.iter_mut().zip(answers) {
        set.answer = answer.map(|a| a.map(|_| ()).map_err(|e| e.to_string()));
    }
    sets
}

/// On the healed log: every set is whole or absent, a set answered as written is there, a
/// stale one never is; then each set not answered as written is sent again with the same
/// commit ids: a stale one is refused again, any other lands (or is recognised) exactly
/// once.
async fn check_storm(
    ledger: &Writer<Ledger>,
    log: &MemLog,
    storm: Vec<StormSet>,
    violations: &mut Vec<String>,
) {
    let commits = read_log(log).await;
    let count = |id: Uuid| commits.iter().filter(|c| c.commit_id == id).count();
    for (n, set) in storm.iter().enumerate() {
        let held: Vec<usize> = set.facts.iter().map(|f| count(f.draft.commit_id)).collect();
        if held.iter().any(|&h| h != held[0]) || held[0] > 1 {
            violations.push(format!("storm set {n} written in part or twice: {held:?}"));
        }
        match (&set.answer, set.stale, held[0]) {
            (Some(Ok(())), false, 1) | (Some(Err(_)), true, 0) | (None, true, 0) => {}
            (Some(Err(_)) | None, false, _) => {}
            (answer, stale, held) => violations.push(format!(
                "storm set {n} (stale: {stale}) answered {answer:?} and held {held} times"
            )),
        }
        if set.answer.as_ref().is_some_and(Result::is_ok) {
            continue;
        }
        let again = ledger
            .record_atomic(set.facts.clone(), Default::default(), &FromTheLog)
            .await;
        match (set.stale, again) {
            (true, Err(RecordError::Conflicts { .. })) | (false, Ok(_)) => {}
            (stale, other) => violations.push(format!(
                "storm set {n} (stale: {stale}) sent again answered {:?}",
                other.map(|_| ())
            )),
        }
    }
    let commits = read_log(log).await;
    for (n, set) in storm.iter().enumerate() {
        for f in &set.facts {
            let times = commits
                .iter()
                .filter(|c| c.commit_id == f.draft.commit_id)
                .count();
            if times != usize::from(!set.stale) {
                violations.push(format!(
                    "storm set {n}: a commit held {times} times after its retry"
                ));
            }
        }
    }
}

fn pick(choose: &mut Choices, from: &[Uuid]) -> Option<Uuid> {
    if from.is_empty() {
        return None;
    }
    Some(from[choose.below(from.len() as u64) as usize])
}

async fn members(ledger: &Writer<Ledger>, cluster: Uuid) -> Vec<Uuid> {
    match ledger.read_current(AggregateId::cluster(cluster)).await {
        Ok(Some(Entity::Cluster(c))) => c
            .node_groups
            .iter()
            .flat_map(|g| g.instance_ids.iter().copied())
            .collect(),
        _ => Vec::new(),
    }
}

/// The operation marked in flight on a cluster or instance, if any.
async fn in_flight_on(ledger: &Writer<Ledger>, target: AggregateId) -> Option<Uuid> {
    match ledger.read_current(target).await {
        Ok(Some(Entity::Cluster(c))) => c.in_flight.map(|f| f.operation_id),
        Ok(Some(Entity::Instance(i))) => i.in_flight.map(|f| f.operation_id),
        _ => None,
    }
}

async fn read_log(log: &MemLog) -> Vec<Commit> {
    use futures::StreamExt;
    match log.read_all(1).await {
        Ok(stream) => stream.filter_map(|c| async { c.ok() }).collect().await,
        Err(_) => Vec::new(),
    }
}

async fn operation_ids(log: &MemLog) -> Vec<Uuid> {
    let mut ids: Vec<Uuid> = read_log(log)
        .await
        .iter()
        .filter(|c| c.aggregate.kind == AggregateKind::Operation)
        .map(|c| c.aggregate.id)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    ids.sort();
    ids
}

/// An operator's cancellation of an operation still running (its runner died), recorded
/// once (a derived commit id).
async fn cancel_if_running(ledger: &Writer<Ledger>, stamper: &Stamper, op: Uuid) {
    let id = AggregateId::operation(op);
    let Ok(Some(Entity::Operation(state))) = ledger.read_current(id).await else {
        return;
    };
    if state.status != Some(OperationStatus::Running) || state.cancellation_reason.is_some() {
        return;
    }
    let mut draft = stamper
        .draft(
            "sim-operator",
            vec![Event::CancellationRequested {
                reason: "its runner died; cancelled by an operator".into(),
            }],
        )
        .with_operation(op);
    draft.commit_id = provledger_client::derived_commit_id(op, "sim-operator-cancel");
    let _ = ledger.record_fact(id, draft).await;
}

/// A boot undone with nothing retained (rolled back, or cancelled) terminated its VM and
/// released its claim: its instance, unless deleted, has no build task in progress, and
/// names no host (Nova's failed build: task_state None, host and node nil) unless a delete
/// owns it (asked for while the rollback was stuck, the instance is left to that delete:
/// its host goes when it is deleted), however the rollback got there (at once, or resumed
/// after it needed attention).
fn check_undone_boot(projection: &Projection, op: &OperationState, violations: &mut Vec<String>) {
    let Some(target) = op.target else {
        return;
    };
    let Some(Entity::Instance(i)) = projection.get(&target) else {
        return;
    };
    if i.vm_state == Some(VmState::Deleted) {
        return;
    }
    let build_task = i.task_state.filter(|t| is_build_task(*t));
    let on_a_host = !i.delete_requested && (i.host.is_some() || i.provider_id.is_some());
    if build_task.is_some() || on_a_host {
        violations.push(format!(
            "{target}: its boot {} was undone ({:?}) but it keeps build task {build_task:?}, \
             host {:?}, provider {:?}",
            op.header.id.id, op.status, i.host, i.provider_id
        ));
    }
}

/// The invariants of the module documentation, on the healed and driven log.
fn check_invariants(
    projection: &Projection,
    infra: &SimInfrastructure,
    violations: &mut Vec<String>,
) {
    let mut known: BTreeSet<(String, String)> = BTreeSet::new();
    // Idempotency key -> (operation, whether it ended undone with nothing retained).
    let mut keys: BTreeMap<String, (Uuid, bool)> = BTreeMap::new();
    let mut attempts: BTreeMap<Uuid, u32> = BTreeMap::new();
    for entity in projection.entities.values() {
        let id = entity.id();
        for anomaly in &entity.header().anomalies {
            if anomaly.problem.contains("not applied") {
                violations.push(format!(
                    "{id} v{}: an acknowledged commit was not applied: {} ({})",
                    anomaly.version, anomaly.event, anomaly.problem
                ));
            }
        }
        let Entity::Operation(o) = entity else {
            continue;
        };
        let op = id.id;
        let undone = matches!(
            o.status,
            Some(OperationStatus::RolledBack | OperationStatus::Cancelled)
        ) && o.is_closed()
            && o.rollback_plan
                .as_ref()
                .is_some_and(|p| p.retained.is_empty());
        for step in &o.steps {
            known.insert((step.effect.executor.clone(), step.effect.resource.clone()));
            keys.insert(idempotency_key(op, &step.name), (op, undone));
        }
        for started in &o.started {
            keys.insert(started.idempotency_key.clone(), (op, undone));
        }
        for c in &o.compensations {
            attempts.insert(c.planned.compensation_id, c.attempts);
        }
        if undone && o.kind == Some(OperationKind::BootInstance) {
            check_undone_boot(projection, o, violations);
        }
        match o.status {
            Some(
                OperationStatus::Succeeded
                | OperationStatus::RolledBack
                | OperationStatus::Held
                | OperationStatus::Cancelled
                | OperationStatus::NeedsAttention,
            ) if o.is_closed() => {}
            other => violations.push(format!(
                "{id}: stopped but not closed: {other:?} (rollback outcome {:?})",
                o.rollback_outcome
            )),
        }
    }
    for executor in infra.all() {
        for (resource, key) in executor.held_with_keys() {
            let held_for = executor.held_by(&resource);
            let by_key = key.as_ref().and_then(|k| keys.get(k));
            if let Some((op, true)) = by_key {
                violations.push(format!(
                    "{}: holds {resource}, made for operation {op}, which was undone",
                    executor.name()
                ));
            }
            let known_here = by_key.is_some()
                || known.contains(&(executor.name().to_string(), resource.clone()))
                || held_for
                    .as_ref()
                    .is_some_and(|by| known.contains(&(executor.name().to_string(), by.clone())));
            if !known_here {
                violations.push(format!(
                    "{}: holds {resource} that no operation of the ledger recorded",
                    executor.name()
                ));
            }
        }
        for (id, recorded) in &attempts {
            let requests = executor.requests(*id);
            if requests > *recorded {
                violations.push(format!(
                    "{}: compensation {id} requested {requests} times for {recorded} recorded attempt(s)",
                    executor.name()
                ));
            }
        }
    }
}
