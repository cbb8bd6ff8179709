//! A re-issue attempt decided on the instance's current state: an unrelated commit on the
//! instance between the view and the attempt (serve's rollback worker clearing an
//! operation) does not race it away.

use provledger_client::recovery::{
    deliver_to_worker, due_reissues, sweep, ReissueFuture, ReissueRequest, Reissuer,
};
use provledger_client::view::LogView;
use provledger_client::{Stamper, Writer};
use provledger_events::catalogue::{OperationKind, TaskState};
use provledger_events::{AggregateId, Event, EventLog, Expectation, MemLog, Timestamp};
use provledger_projections::recovery::ReissuePolicy;

/// A worker that acknowledges every re-issue.
struct Answers;

impl Reissuer for Answers {
    fn reissue<'a>(&'a self, _worker: &'a str, _request: &'a ReissueRequest) -> ReissueFuture<'a> {
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test]
async fn an_unrelated_commit_between_the_view_and_the_attempt_does_not_race_it_away() {
    // Given an instance whose worker died powering it off (its lease long expired), and
    // the recovery recorded with its re-issue pending...
    let writer = Writer::new(MemLog::new());
    let stamper = Stamper::system();
    let vm = AggregateId::instance(uuid::Uuid::now_v7());
    let expired = Timestamp::from_unix_ms(stamper.now().unix_ms() - 60_000);
    let mut events = provledger_tests::workload::instance_running_on(uuid::Uuid::now_v7());
    events.push(Event::TaskStarted {
        task_state: TaskState::PoweringOff,
        worker_id: "w1".into(),
        lease_until: expired,
    });
    writer
        .log()
        .append(vm, Expectation::NoStream, stamper.draft("t", events))
        .await
        .expect("the instance");
    let swept = sweep(&writer, &LogView::new(writer.log()), false, &stamper)
        .await
        .expect("sweep");
    assert_eq!(swept.recoveries.len(), 1, "{swept:?}");
    let policy = ReissuePolicy::new(10_000);
    let (dues, _) = due_reissues(
        &LogView::new(writer.log()),
        &policy,
        &std::collections::BTreeMap::new(),
        &stamper,
    )
    .await
    .expect("dues");
    // ...when another commit lands on the instance after the dues were read...
    writer
        .log()
        .append(
            vm,
            Expectation::Any,
            stamper.draft(
                "serve",
                vec![Event::InFlightOperationSet {
                    operation_id: uuid::Uuid::now_v7(),
                    operation_kind: OperationKind::RebootInstance,
                }],
            ),
        )
        .await
        .expect("an unrelated commit");
    // ...then the attempt is still recorded and delivered, not counted raced.
    let mut delivered = 0;
    for (_, dues) in dues {
        let report = deliver_to_worker(&writer, &Answers, dues, &stamper).await;
        assert_eq!(report.raced, 0, "{report:?}");
        delivered += report.delivered;
    }
    assert_eq!(delivered, 1);
}
