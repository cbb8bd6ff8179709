//! A worker's lease: started, renewed at most once per half lease however often the worker
//! asks (the heartbeat is bounded in rate), finished; and a lease left to expire is what the
//! recovery rules see as an interrupted task.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use provledger_client::write::RecordError;
use provledger_client::{Clock, SeededIds, Stamper, TaskLease};
use provledger_events::catalogue::{TaskOutcome, TaskState};
use provledger_events::{AggregateId, Event, EventLog, Expectation, MemLog, Timestamp};
use provledger_projections::lease::LEASE_MS_MAX;
use provledger_projections::recovery::recover;
use provledger_projections::Entity;
use uuid::Uuid;

struct ManualClock(AtomicI64);

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_unix_ms(self.0.load(Ordering::SeqCst))
    }
}

#[tokio::test]
async fn renewals_are_bounded_to_one_per_half_lease_and_an_expired_one_is_recovered() {
    let log = provledger_client::Writer::new(MemLog::new());
    let clock = Arc::new(ManualClock(AtomicI64::new(1_800_000_000_000)));
    let stamper = Stamper::new(clock.clone(), Arc::new(SeededIds::new(1)));
    let vm = Uuid::from_u128(5);
    let create = Event::InstanceCreateRequested {
        name: "vm".into(),
        cluster_id: None,
        node_group: None,
        flavor: "m1".into(),
        resources: Default::default(),
        image: "img".into(),
    };
    let finish_scheduling = Event::TaskFinished {
        task_state: TaskState::Scheduling,
        outcome: TaskOutcome::Succeeded,
        reason: String::new(),
    };
    log.log()
        .append(
            AggregateId::instance(vm),
            Expectation::NoStream,
            stamper.draft("t", vec![create, finish_scheduling]),
        )
        .await
        .unwrap();

    // Given a task started with a 10 s lease...
    let mut lease = TaskLease::start(
        &log,
        vm,
        TaskState::PoweringOff,
        "w1",
        Duration::from_secs(10),
        &stamper,
    )
    .await
    .unwrap();
    // ...when the worker asks to renew every 100 ms for 12 s...
    let mut renewals = 0;
    for _ in 0..120 {
        clock.0.fetch_add(100, Ordering::SeqCst);
        if lease.renew_if_due(&log, &stamper).await.unwrap() {
            renewals += 1;
        }
    }
    // ...then it renewed about every 5 s, not 120 times, and the lease never lapsed.
    assert_eq!(renewals, 2, "bounded in rate");
    let state = |log: MemLog| async move {
        match Entity::fold(
            AggregateId::instance(vm),
            &log.read_aggregate(AggregateId::instance(vm)).await.unwrap(),
        ) {
            Some(Entity::Instance(i)) => *i,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        recover(&state(log.log().clone()).await, clock.now()),
        None,
        "a live lease"
    );
    // When the worker stops renewing (it died), the recovery rules see an interrupted task
    // once the lease has expired.
    let until = lease.until();
    assert!(recover(&state(log.log().clone()).await, until.plus_ms(1)).is_some());
    // A finished task is nothing to recover.
    lease
        .finish(&log, TaskOutcome::Succeeded, "", &stamper)
        .await
        .unwrap();
    assert_eq!(
        recover(&state(log.log().clone()).await, until.plus_ms(1)),
        None
    );
}

/// An active instance with no task in progress, on a manual clock at `start` ms.
async fn idle_instance(
    start: i64,
) -> (
    provledger_client::Writer<MemLog>,
    Arc<ManualClock>,
    Stamper,
    Uuid,
) {
    let log = provledger_client::Writer::new(MemLog::new());
    let clock = Arc::new(ManualClock(AtomicI64::new(start)));
    let stamper = Stamper::new(clock.clone(), Arc::new(SeededIds::new(2)));
    let vm = Uuid::from_u128(6);
    let events = vec![
        Event::InstanceCreateRequested {
            name: "vm".into(),
            cluster_id: None,
            node_group: None,
            flavor: "m1".into(),
            resources: Default::default(),
            image: "img".into(),
        },
        Event::TaskFinished {
            task_state: TaskState::Scheduling,
            outcome: TaskOutcome::Succeeded,
            reason: String::new(),
        },
    ];
    log.log()
        .append(
            AggregateId::instance(vm),
            Expectation::NoStream,
            stamper.draft("t", events),
        )
        .await
        .unwrap();
    (log, clock, stamper, vm)
}

#[tokio::test]
async fn the_client_renews_exactly_when_the_decider_admits_a_renewal() {
    // Given an odd lease length (half of it is not a whole millisecond)...
    let (log, clock, stamper, vm) = idle_instance(1_800_000_000_000).await;
    let start = clock.now();
    let mut lease = TaskLease::start(
        &log,
        vm,
        TaskState::PoweringOff,
        "w1",
        Duration::from_millis(10_001),
        &stamper,
    )
    .await
    .unwrap();
    assert_eq!(lease.renewal_due_at(), start.plus_ms(5_001));
    // ...when the worker asks every millisecond, the client writes nothing before the
    // decider's time and renews at it; the decider refuses none of its renewals.
    let mut renewed_at = Vec::new();
    for _ in 0..15_000 {
        clock.0.fetch_add(1, Ordering::SeqCst);
        if lease.renew_if_due(&log, &stamper).await.unwrap() {
            renewed_at.push(clock.now().unix_ms() - start.unix_ms());
        }
    }
    assert_eq!(renewed_at, vec![5_001, 10_002]);
}

#[tokio::test]
async fn a_lease_beyond_the_deciders_bound_is_refused_at_start() {
    let (log, _clock, stamper, vm) = idle_instance(1_800_000_000_000).await;
    let too_long = Duration::from_millis(LEASE_MS_MAX as u64 + 1);
    let refused = TaskLease::start(&log, vm, TaskState::PoweringOff, "w1", too_long, &stamper)
        .await
        .expect_err("refused");
    match refused {
        RecordError::Rejected(rejection) => assert_eq!(rejection.reason(), "lease_too_long"),
        other => panic!("{other:?}"),
    }
    let longest = Duration::from_millis(LEASE_MS_MAX as u64);
    TaskLease::start(&log, vm, TaskState::PoweringOff, "w1", longest, &stamper)
        .await
        .expect("the longest lease");
}
