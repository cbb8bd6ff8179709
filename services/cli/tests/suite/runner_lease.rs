//! An operation's runner lease, end to end against a private nats-server: a runner in
//! another process (this test binary run again as `child_runner`) starts a create, claims
//! its allocations and then hangs in a step, renewing its lease in the background
//! (`operation_heartbeat`); serve (`--runner-lease 3000ms --recovery-interval 1`) leaves it
//! alone. The process is then SIGKILLed: serve records the operation failed with "runner
//! silent since …" once the lease is over, within a few sweeps, and its rollback releases
//! the claims.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use provledger_client::{CancelNotices, Ledger, OperationRunner, StepHook, Writer};
use provledger_events::{AggregateId, Event, EventLog};
use provledger_projections::operation::OperationStatus;
use provledger_projections::Entity;
use provledger_sim::{Provisioner, SimInfrastructure};
use provledger_tests::NatsServer;
use uuid::Uuid;

use crate::common;
use crate::common::{wait_ready, Serve};

const CHILD_NATS: &str = "PROVLEDGER_TEST_RUNNER_NATS";
const CHILD_PROVIDER: &str = "PROVLEDGER_TEST_RUNNER_PROVIDER";
/// serve's runner lease and sweep interval in this test. The lease is 6 heartbeats: only a
/// stall of the (debug-built, possibly starved) runner of 2.5 s fails a live one.
const LEASE: Duration = Duration::from_millis(3000);
const SWEEP: Duration = Duration::from_secs(1);
/// The child's heartbeat: a sixth of the lease.
const HEARTBEAT: Duration = Duration::from_millis(500);
/// How late after the lease serve may record the failure and still have acted on the
/// lease: a sweep starts a second after the last one ended, and a sweep on a loaded machine
/// (or one whose replica lags, which makes it try again at the next) takes time. A serve
/// that waited for its default lease (minutes) or for a restart is far outside it.
const SWEEP_SLACK: Duration = Duration::from_secs(5);

/// Not a test of its own: the runner process of `a_killed_runner_...`, which runs this
/// binary again with the environment naming the NATS server and the provider. It starts a
/// two-node create and hangs in the first step of `spawn`, after the claims, printing
/// `BLOCKED <operation id>` on stderr. Without that environment it returns at once.
#[tokio::test(flavor = "multi_thread")]
async fn child_runner() {
    let (Ok(url), Ok(provider)) = (std::env::var(CHILD_NATS), std::env::var(CHILD_PROVIDER)) else {
        return;
    };
    let provider: Uuid = provider.parse().expect("provider id");
    let (client, log) = provledger_client::open_jetstream(
        &url,
        "runner",
        "PROVLEDGER",
        "provledger",
        1,
        &Default::default(),
    )
    .await
    .expect("jetstream");
    let ledger = Writer::new(Ledger::JetStream(log));
    eprintln!("runner: connected");
    let hook: StepHook = Arc::new(|operation, stage, _step| {
        Box::pin(async move {
            eprintln!("runner: step in {stage}");
            if stage == provledger_projections::stages::stage::SPAWN {
                eprintln!("BLOCKED {operation}");
                std::future::pending::<()>().await;
            }
        })
    });
    let runner = OperationRunner::new(
        ledger,
        CancelNotices::nats(client, "provledger"),
        None,
        "dying-runner",
    )
    .with_heartbeat(HEARTBEAT)
    .with_step_hook(hook);
    let infra = Arc::new(SimInfrastructure::default());
    let _ = Provisioner::new(runner, infra, "dying-runner")
        .create_cluster(common::two_workers(provider, "workers"))
        .await;
    panic!("the runner was meant to hang until killed");
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn allocations(ledger: &Writer<Ledger>, provider: Uuid) -> usize {
    match ledger.read_current(AggregateId::provider(provider)).await {
        Ok(Some(Entity::Provider(p))) => p.allocations.len(),
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_runner_has_its_operation_failed_within_the_lease_and_rolled_back() {
    // Given serve with a 3 s runner lease, sweeping every second
    let nats = NatsServer::start().await;
    let (client, ledger, _infra, provider) = common::ledger_with_executors(&nats, 256).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let _serve = Serve::start_with(
        &nats,
        &dir.path().join("serve"),
        &[
            "--recovery-interval",
            "1",
            "--runner-lease",
            "3000ms",
            "--compensation-backoff-ms",
            "50",
        ],
    );
    wait_ready(&client).await;

    // And a runner in another process, hanging in a step after its claims
    let child_log = dir.path().join("runner.log");
    let child = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "runner_lease::child_runner",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_NATS, nats.url())
        .env(CHILD_PROVIDER, provider.to_string())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&child_log).expect("runner log"))
        .spawn()
        .expect("spawn the runner");
    // Killed however this test ends.
    let mut child = KillOnDrop(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    let op: Uuid = loop {
        let log = std::fs::read_to_string(&child_log).unwrap_or_default();
        if let Some(id) = log.lines().find_map(|l| l.strip_prefix("BLOCKED ")) {
            break id.trim().parse().expect("an operation id");
        }
        assert!(
            Instant::now() < deadline,
            "the runner never reached its hanging step: {log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        allocations(&ledger, provider).await,
        2,
        "both nodes claimed"
    );

    // When it stays alive for twice the lease (it writes no step meanwhile)
    let alive_until = Instant::now() + 2 * LEASE;
    let version_before = common::operation(&ledger, op).await.header.version;
    while Instant::now() < alive_until {
        let state = common::operation(&ledger, op).await;
        // Then serve leaves it running: its heartbeats renew the lease
        assert_eq!(
            state.status,
            Some(OperationStatus::Running),
            "a live runner's operation was stopped: {:?}",
            state.error
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let history = ledger
        .log()
        .read_aggregate(AggregateId::operation(op))
        .await
        .expect("history");
    let heartbeats = history
        .iter()
        .filter(|c| c.events.contains(&Event::operation_heartbeat()))
        .count();
    assert!(
        heartbeats >= 2,
        "the runner renewed {heartbeats} times in {:?} (version {version_before} before)",
        2 * LEASE
    );

    // When the runner's process is killed
    child.0.kill().expect("SIGKILL the runner");
    let _ = child.0.wait();
    let killed = Instant::now();

    // Then serve fails the operation once the lease is over, a few sweeps later at most
    // (the lease's own bound is checked on the commits' times below; this one only keeps a
    // serve that never acts from hanging the test)
    let bound = LEASE + SWEEP_SLACK + Duration::from_secs(10);
    let failed = loop {
        let state = common::operation(&ledger, op).await;
        if state.status != Some(OperationStatus::Running) {
            break state;
        }
        assert!(
            killed.elapsed() < bound,
            "still running {:?} after the runner died",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let error = failed.error.clone().expect("an error is recorded");
    assert!(
        error.message.starts_with("runner silent since "),
        "{error:?}"
    );
    assert_eq!(error.stage, "spawn");
    // And the failure was recorded by serve's sweep, at the version the runner left
    let history = ledger
        .log()
        .read_aggregate(AggregateId::operation(op))
        .await
        .expect("history");
    let at = history
        .iter()
        .position(|c| {
            c.events
                .iter()
                .any(|e| matches!(e, Event::OperationFailed { .. }))
        })
        .expect("operation_failed in the log");
    let (last_runner, failure) = (&history[at - 1], &history[at]);
    assert_eq!(failure.actor, provledger_client::recovery::RECOVERY_ACTOR);
    assert_eq!(last_runner.actor, "dying-runner");
    let silent_ms = failure.recorded_at.unix_ms() - last_runner.recorded_at.unix_ms();
    assert!(
        silent_ms >= LEASE.as_millis() as i64
            && silent_ms <= (LEASE + SWEEP_SLACK).as_millis() as i64,
        "failed {silent_ms} ms after the runner's last commit (lease {LEASE:?}, sweep {SWEEP:?}, slack {SWEEP_SLACK:?})"
    );
    assert!(
        error.message.contains(&last_runner.recorded_at.to_string()),
        "{} does not name {}",
        error.message,
        last_runner.recorded_at
    );

    // And its rollback runs: the claims are released and the operation rolled back
    let closed = common::operation_closed(&ledger, op, Duration::from_secs(30)).await;
    assert_eq!(closed.status, Some(OperationStatus::RolledBack));
    assert_eq!(allocations(&ledger, provider).await, 0, "claims released");
}
