//! The runner lease's write, given/when/then: serve's sweep fails a silent runner's
//! operation at the exact version it decided on, so a runner that renewed in between wins
//! (nothing is written), and racing sweeps record the failure once.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use provledger_client::recovery::{fail_silent_runners, RecoveryOutcome};
use provledger_client::{Clock, SeededIds, Stamper, Writer};
use provledger_events::catalogue::OperationKind;
use provledger_events::{AggregateId, Event, EventLog, Expectation, MemLog, Timestamp};
use provledger_projections::operation::{OperationState, OperationStatus};
use provledger_projections::stages::stages_of;
use provledger_projections::Entity;
use uuid::Uuid;

struct ManualClock(AtomicI64);

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_unix_ms(self.0.load(Ordering::SeqCst))
    }
}

const T0: i64 = 1_800_000_000_000;
const LEASE: i64 = 10_000;

async fn state(log: &Writer<MemLog>, op: Uuid) -> OperationState {
    match log.read_current(AggregateId::operation(op)).await {
        Ok(Some(Entity::Operation(o))) => *o,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_runner_that_renewed_wins_and_a_silent_one_is_failed_once() {
    let log = Writer::new(MemLog::new());
    let clock = Arc::new(ManualClock(AtomicI64::new(T0)));
    let stamper = Stamper::new(clock.clone(), Arc::new(SeededIds::new(1)));
    let op = Uuid::from_u128(9);
    let aggregate = AggregateId::operation(op);
    let kind = OperationKind::CreateCluster;
    let stages = stages_of(kind);
    let first = stages[0].name.clone();
    // Given a running operation whose runner last wrote at T0
    log.record(
        aggregate,
        Expectation::NoStream,
        stamper.draft(
            "runner",
            vec![
                Event::operation_started(
                    kind,
                    AggregateId::cluster(Uuid::from_u128(1)),
                    None,
                    stages,
                    None,
                ),
                Event::StageStarted { stage: first },
            ],
        ),
    )
    .await
    .expect("started");
    let seen = state(&log, op).await;
    // And its runner renewing at T0 + LEASE, after a sweep read the view
    clock.0.store(T0 + LEASE, Ordering::SeqCst);
    log.record(
        aggregate,
        Expectation::Exactly(1),
        stamper.draft("runner", vec![Event::operation_heartbeat()]),
    )
    .await
    .expect("renewed");
    // When the sweep decides on the view it read (lapsed there) at T0 + LEASE + 1
    clock.0.store(T0 + LEASE + 1, Ordering::SeqCst);
    let report = fail_silent_runners(&log, [seen], LEASE, false, &stamper).await;
    // Then it raced: nothing is written, the operation runs on
    assert_eq!(report.len(), 1);
    assert_eq!(report[0].outcome, RecoveryOutcome::Raced);
    let now = state(&log, op).await;
    assert_eq!(
        (now.header.version, now.status),
        (2, Some(OperationStatus::Running))
    );
    // And decided again on the fresh state, nothing lapsed
    assert!(
        fail_silent_runners(&log, [now.clone()], LEASE, false, &stamper)
            .await
            .is_empty()
    );

    // When the runner stays silent past the lease from its heartbeat
    clock.0.store(T0 + 2 * LEASE + 1, Ordering::SeqCst);
    let report = fail_silent_runners(&log, [now.clone()], LEASE, false, &stamper).await;
    // Then the failure is recorded at version 3, naming the silence
    assert_eq!(report[0].outcome, RecoveryOutcome::Recorded);
    let failed = state(&log, op).await;
    assert_eq!(failed.header.version, 3);
    assert_eq!(failed.status, Some(OperationStatus::Failed));
    let message = failed.error.expect("error").message;
    assert!(
        message.starts_with(&format!(
            "runner silent since {}",
            Timestamp::from_unix_ms(T0 + LEASE)
        )),
        "{message}"
    );
    // And a second sweep (a replica) deciding on the same state writes nothing more
    let again = fail_silent_runners(&log, [now], LEASE, false, &stamper).await;
    assert_eq!(again[0].outcome, RecoveryOutcome::AlreadyRecorded);
    assert_eq!(log.log().read_aggregate(aggregate).await.unwrap().len(), 3);
}

/// The heartbeats of `op` in the log.
async fn heartbeats(log: &Writer<provledger_client::Ledger>, op: Uuid) -> usize {
    log.log()
        .read_aggregate(AggregateId::operation(op))
        .await
        .expect("history")
        .iter()
        .filter(|c| c.events.contains(&Event::operation_heartbeat()))
        .count()
}

// On paused time (the log is in memory): the heartbeat's due times are exact, so the count
// is too, whatever else the machine is doing.
#[tokio::test(start_paused = true)]
async fn the_runner_renews_while_a_step_is_quiet_and_never_after_the_end() {
    use provledger_client::{CancelNotices, Ledger, OperationRunner, OperationSpec};
    use std::time::Duration;
    let log = Writer::new(Ledger::Memory(MemLog::new()));
    let runner = OperationRunner::new(log.clone(), CancelNotices::local(), None, "runner")
        .with_heartbeat(Duration::from_millis(500));
    let target = AggregateId::operation(Uuid::now_v7());
    let spec = OperationSpec::new(OperationKind::Bundle, target).with_id(target.id);
    // Given a body that writes nothing for 1.3 s, with a 500 ms heartbeat
    let report = runner
        .run(spec, |_ctx| async move {
            tokio::time::sleep(Duration::from_millis(1300)).await;
            Ok(())
        })
        .await;
    // Then the runner renewed twice by itself, and the operation succeeded
    assert!(report.result.is_ok(), "{:?}", report.result);
    assert_eq!(report.status, Some(OperationStatus::Succeeded));
    assert_eq!(heartbeats(&log, target.id).await, 2);
    // And after the end it writes nothing more
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(heartbeats(&log, target.id).await, 2);
}

/// Given an operation run in a caller's trace (`OperationSpec::with_trace`), when it
/// runs, then every commit the runner writes on it records that trace: serve's rollback
/// of it continues the caller's trace.
#[tokio::test(flavor = "multi_thread")]
async fn every_commit_of_a_traced_operation_records_its_trace() {
    use provledger_client::{CancelNotices, Ledger, OperationRunner, OperationSpec};
    use provledger_events::TraceContext;
    let log = Writer::new(Ledger::Memory(MemLog::new()));
    let runner = OperationRunner::new(log.clone(), CancelNotices::local(), None, "runner");
    let target = AggregateId::operation(Uuid::now_v7());
    let trace = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    assert!(trace.is_some());
    let spec = OperationSpec::new(OperationKind::Bundle, target)
        .with_id(target.id)
        .with_trace(trace);
    let report = runner.run(spec, |_ctx| async move { Ok(()) }).await;
    assert!(report.result.is_ok(), "{:?}", report.result);
    let commits = log.log().read_aggregate(target).await.expect("history");
    assert!(commits.len() >= 2, "{commits:?}");
    for commit in &commits {
        assert_eq!(commit.trace, trace, "v{}", commit.version);
        assert!(commit.hash_is_valid());
    }
}
