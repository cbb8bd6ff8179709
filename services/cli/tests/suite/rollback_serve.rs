//! `serve` drives rollbacks and deletions against a private nats-server, with the
//! simulated executors answering compensation requests over NATS and the provisioning
//! flows running in this test process (their runner leaves the rollback to serve):
//! - two replicas race on the same failed operations: exactly one plan each, and each
//!   compensation requested once and carried out once;
//! - serve is SIGKILLed in the middle of a rollback and a new one resumes it;
//! - a delete arriving through `cmd.append` during a create: serve notices it, publishes
//!   the cancel notice, the runner stops with `TargetDeleted`, the rollback removes what
//!   the create made, and the cluster is recorded `deleted`.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_client::CancelNotices;
use provledger_client::Ledger;
use provledger_client::{OperationError, OperationRunner, StepHook};
use provledger_events::catalogue::{ClusterStatus, NodeGroupSpec};
use provledger_events::{AggregateId, EventLog};
use provledger_projections::operation::{OperationState, OperationStatus};
use provledger_projections::stages::stage;
use provledger_projections::Entity;
use provledger_sim::SimInfrastructure;
use provledger_sim::{ClusterRequest, Provisioner};
use provledger_tests::NatsServer;
use uuid::Uuid;

use crate::common;
use crate::common::{wait_ready, Serve};

const FAST: &[&str] = &[
    "--compensation-backoff-ms",
    "50",
    "--compensation-reply-wait-ms",
    "3000",
];

struct Env {
    nats: NatsServer,
    ledger: provledger_client::Writer<Ledger>,
    client: async_nats::Client,
    infra: Arc<SimInfrastructure>,
    provider: Uuid,
    dir: tempfile::TempDir,
}

async fn env() -> Env {
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 256).await;
    Env {
        nats,
        ledger,
        client,
        infra,
        provider,
        dir: tempfile::tempdir().expect("tempdir"),
    }
}

impl Env {
    /// A provisioner whose runner records failures and leaves the rollback to serve.
    fn provisioner(&self, hook: Option<StepHook>) -> Provisioner {
        let mut runner = OperationRunner::new(
            self.ledger.clone(),
            CancelNotices::nats(self.client.clone(), "provledger"),
            None,
            "test-service",
        );
        if let Some(hook) = hook {
            runner = runner.with_step_hook(hook);
        }
        Provisioner::new(runner, self.infra.clone(), "test-service")
    }

    fn request(&self) -> ClusterRequest {
        ClusterRequest {
            cluster_id: Uuid::now_v7(),
            name: "c".into(),
            plugin: "vanilla".into(),
            node_groups: vec![NodeGroupSpec {
                name: "workers".into(),
                count: 3,
                flavor: "m".into(),
                resources: BTreeMap::from([("VCPU".to_string(), 2)]),
                processes: vec!["datanode".into()],
            }],
            provider: self.provider,
        }
    }

    fn serve(&self, name: &str) -> Serve {
        Serve::start_with(&self.nats, &self.dir.path().join(name), FAST)
    }

    /// A replica with a slower backoff, so that a rollback stays open long enough to be
    /// interrupted (200 ms, then 400 ms between the injected failures).
    fn slow_serve(&self, name: &str) -> Serve {
        let args = [
            "--compensation-backoff-ms",
            "200",
            "--compensation-reply-wait-ms",
            "3000",
        ];
        Serve::start_with(&self.nats, &self.dir.path().join(name), &args)
    }

    async fn operation(&self, id: Uuid) -> OperationState {
        match self.ledger.read_current(AggregateId::operation(id)).await {
            Ok(Some(Entity::Operation(op))) => *op,
            other => panic!("operation {id}: {other:?}"),
        }
    }

    async fn allocations(&self) -> usize {
        match self
            .ledger
            .read_current(AggregateId::provider(self.provider))
            .await
        {
            Ok(Some(Entity::Provider(p))) => p.allocations.len(),
            other => panic!("{other:?}"),
        }
    }

    /// Counts of each event name in an aggregate's history.
    async fn event_counts(&self, id: AggregateId) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for commit in self.ledger.log().read_aggregate(id).await.expect("history") {
            for e in &commit.events {
                *counts.entry(e.name().to_string()).or_insert(0) += 1;
            }
        }
        counts
    }
}

async fn eventually<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_record_one_plan_and_carry_out_each_compensation_once() {
    // Given two serve replicas and five creates that each fail at their third VM,
    let env = env().await;
    let _a = env.serve("a");
    let _b = env.serve("b");
    let prov = env.provisioner(None);
    let mut ops = Vec::new();
    for _ in 0..5 {
        env.infra.hypervisor.fail_call("create_vm", 3);
        let report = prov.create_cluster(env.request()).await;
        assert!(matches!(
            report.result,
            Err(OperationError::StepFailed { .. })
        ));
        assert_eq!(
            report.status,
            Some(OperationStatus::Failed),
            "left to serve"
        );
        ops.push(report.operation_id);
    }
    // when the replicas notice them, then every rollback finishes,
    for op in &ops {
        eventually(
            "the rollback to finish",
            Duration::from_secs(60),
            || async { env.operation(*op).await.is_closed() },
        )
        .await;
    }
    let mut external = 0;
    for op in &ops {
        let state = env.operation(*op).await;
        assert_eq!(state.status, Some(OperationStatus::RolledBack));
        let counts = env.event_counts(AggregateId::operation(*op)).await;
        // exactly one plan was recorded and each compensation requested and done once,
        assert_eq!(counts.get("rollback_planned"), Some(&1), "{counts:?}");
        assert_eq!(counts.get("rollback_finished"), Some(&1), "{counts:?}");
        let planned = state.compensations.len();
        assert_eq!(
            counts.get("compensation_requested"),
            Some(&planned),
            "{counts:?}"
        );
        assert_eq!(
            counts.get("compensation_done"),
            Some(&planned),
            "{counts:?}"
        );
        assert_eq!(
            state.header.anomaly_count, 0,
            "{:?}",
            state.header.anomalies
        );
        // and each external compensation took effect exactly once at its executor.
        for c in &state.compensations {
            if let provledger_events::catalogue::Executor::Service(name) =
                &c.planned.compensation.executor
            {
                let executor = env.infra.executor(name).expect("executor");
                assert_eq!(executor.applied(c.planned.compensation_id), 1);
                // Counted before the executor's deduplication: one request, not one
                // per racing replica.
                assert_eq!(executor.requests(c.planned.compensation_id), 1);
                external += 1;
            }
        }
    }
    assert_eq!(
        external,
        5 * 9,
        "2 VMs with IP, DHCP and DNS per create, and the failed third VM undone by its key"
    );
    assert!(
        env.infra.inventory().is_empty(),
        "{:?}",
        env.infra.inventory()
    );
    assert_eq!(env.allocations().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serve_killed_mid_rollback_is_resumed_by_the_next_one() {
    let env = env().await;
    let mut first = env.slow_serve("first");
    let prov = env.provisioner(None);
    // The IPAM refuses the first three releases: the rollback is slow and retried.
    env.infra.ipam.fail_compensations(3);
    env.infra.hypervisor.fail_call("create_vm", 3);
    let report = prov.create_cluster(env.request()).await;
    let op = report.operation_id;
    eventually("a failed compensation", Duration::from_secs(30), || async {
        env.operation(op)
            .await
            .compensations
            .iter()
            .any(|c| c.attempts >= 2)
    })
    .await;
    assert!(!env.operation(op).await.is_closed(), "killed mid-rollback");
    first.kill();
    let _second = env.serve("second");
    eventually(
        "the resumed rollback to finish",
        Duration::from_secs(60),
        || async { env.operation(op).await.is_closed() },
    )
    .await;
    let state = env.operation(op).await;
    assert_eq!(state.status, Some(OperationStatus::RolledBack));
    assert!(
        env.infra.inventory().is_empty(),
        "{:?}",
        env.infra.inventory()
    );
    assert_eq!(env.allocations().await, 0);
    for c in &state.compensations {
        if let provledger_events::catalogue::Executor::Service(name) =
            &c.planned.compensation.executor
        {
            let executor = env.infra.executor(name).expect("exec");
            assert_eq!(executor.applied(c.planned.compensation_id), 1);
            // Every request the executor saw is an attempt recorded in the log first: none
            // sent twice by the killed and the resumed serve (a kill between recording and
            // sending may leave an attempt that was never sent).
            let requests = executor.requests(c.planned.compensation_id);
            assert!(
                (1..=c.attempts).contains(&requests),
                "{} requests for {} recorded attempts",
                requests,
                c.attempts
            );
        }
    }
    let counts = env.event_counts(AggregateId::operation(op)).await;
    assert_eq!(counts.get("rollback_planned"), Some(&1));
    assert!(counts.get("compensation_failed").copied().unwrap_or(0) >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_through_cmd_append_cancels_a_running_create() {
    let env = env().await;
    let _serve = env.serve("s");
    wait_ready(&env.client).await;
    let mut notices = env
        .client
        .subscribe("provledger.cancel.>")
        .await
        .expect("subscribe");
    let request = env.request();
    let cluster = request.cluster_id;
    // When the create reaches its configure stage, a user deletes the cluster through the
    // NATS command and waits until serve has told the operation.
    let fired = Arc::new(Mutex::new(false));
    let hook: StepHook = {
        let (client, ledger, fired) = (env.client.clone(), env.ledger.clone(), fired.clone());
        Arc::new(move |op, stage_name, _step| {
            let (client, ledger, fired) = (client.clone(), ledger.clone(), fired.clone());
            Box::pin(async move {
                if stage_name != stage::CONFIGURE
                    || std::mem::replace(&mut *fired.lock().unwrap(), true)
                {
                    return;
                }
                let body = serde_json::json!({
                    "aggregate": format!("cluster/{cluster}"),
                    "expect": "any",
                    "events": [{"cluster_delete_requested": {"reason": "user"}}],
                });
                let reply = client
                    .request("provledger.cmd.append", body.to_string().into())
                    .await
                    .expect("cmd.append");
                let reply: serde_json::Value =
                    serde_json::from_slice(&reply.payload).expect("json");
                assert!(reply["data"]["position"].is_u64(), "{reply}");
                let deadline = Instant::now() + Duration::from_secs(20);
                loop {
                    if let Ok(Some(Entity::Operation(o))) =
                        ledger.read_current(AggregateId::operation(op)).await
                    {
                        if o.target_deleted {
                            return;
                        }
                    }
                    assert!(Instant::now() < deadline, "serve never noticed the delete");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        })
    };
    let prov = env.provisioner(Some(hook));
    let report = prov.create_cluster(request).await;
    // Then the runner stopped with the typed error,
    assert!(
        matches!(report.result, Err(OperationError::TargetDeleted { .. })),
        "{:?}",
        report.result
    );
    let notice = tokio::time::timeout(Duration::from_secs(5), notices.next())
        .await
        .expect("a cancel notice")
        .expect("message");
    assert_eq!(
        notice.subject.as_str(),
        format!("provledger.cancel.{}", report.operation_id)
    );
    // the operation closes as cancelled, everything it made is removed,
    let op = report.operation_id;
    eventually(
        "the cancelled create to close",
        Duration::from_secs(60),
        || async { env.operation(op).await.is_closed() },
    )
    .await;
    assert_eq!(
        env.operation(op).await.status,
        Some(OperationStatus::Cancelled)
    );
    assert!(env.infra.hypervisor.resources().is_empty());
    assert!(env.infra.ipam.resources().is_empty());
    assert_eq!(env.allocations().await, 0);
    // and serve records the cluster deleted once nothing of it remains.
    eventually(
        "the cluster to be deleted",
        Duration::from_secs(30),
        || async {
            matches!(
                env.ledger.read_current(AggregateId::cluster(cluster)).await,
                Ok(Some(Entity::Cluster(c))) if c.status == Some(ClusterStatus::Deleted)
            )
        },
    )
    .await;
}
