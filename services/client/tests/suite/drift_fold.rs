//! `fold_log`, the shell around drift's `DriftFold`, against a real log: given an
//! operation that closed and later got another commit / when folded from the log / then
//! its history is read back once and the ledger's side is what the whole fold says.

use std::collections::BTreeMap;

use provledger_client::inventory::{fold_log, LogFolded};
use provledger_events::catalogue::{
    Compensation, CompensationAction, Effect, EffectKind, Executor, OperationKind, Origin,
    RollbackOutcome,
};
use provledger_events::{AggregateId, Event, EventLog, Expectation, MemLog};
use provledger_projections::drift::{recorded_resources, DriftFold};
use provledger_projections::planner::plan_rollback;
use provledger_projections::stages::{stage, stages_of};
use provledger_projections::Projection;
use provledger_tests::script::draft_for;
use uuid::Uuid;

const BOOT: u128 = 0x0190_0000_0000_7000_8000_0000_0000_0e01;
const NODE: u128 = 0x0190_0000_0000_7000_8000_0000_0000_00b1;

async fn record(log: &MemLog, index: &mut usize, event: Event) {
    let op = AggregateId::operation(Uuid::from_u128(BOOT));
    *index += 1;
    log.append(op, Expectation::Any, draft_for(*index, vec![event]))
        .await
        .expect("append");
}

async fn folded_whole(log: &MemLog) -> Projection {
    let mut projection = Projection::new();
    for commit in log
        .read_aggregate(AggregateId::operation(Uuid::from_u128(BOOT)))
        .await
        .expect("read")
    {
        projection.apply_checked(&commit).expect("in chain");
    }
    projection
}

#[tokio::test]
async fn a_commit_on_an_operation_closed_earlier_is_folded_from_its_history() {
    // Given a boot that took an IP, failed, and whose rollback stopped in needs_attention
    // with the IP's release stuck; then an operator resolving it by hand
    let log = MemLog::new();
    let mut i = 0;
    let node = Uuid::from_u128(NODE);
    record(
        &log,
        &mut i,
        Event::OperationStarted {
            kind: OperationKind::BootInstance,
            target: AggregateId::instance(node),
            parent_id: None,
            stages: stages_of(OperationKind::BootInstance),
            bundle_policy: None,
        },
    )
    .await;
    record(
        &log,
        &mut i,
        Event::StageStarted {
            stage: stage::NETWORK.into(),
        },
    )
    .await;
    let effect = Effect {
        kind: EffectKind::IpAcquired,
        executor: "ipam".into(),
        resource: "10.0.0.5".into(),
        origin: Origin::Created,
        detail: BTreeMap::from([("node".to_string(), node.to_string())]),
    };
    let undo = Compensation {
        action: CompensationAction::ReleaseIp,
        executor: Executor::Service("ipam".into()),
        resource: "10.0.0.5".into(),
        args: BTreeMap::from([("idempotency_key".to_string(), "key-ip".to_string())]),
    };
    record(
        &log,
        &mut i,
        Event::step_done(stage::NETWORK, "acquire_ip", effect, Some(undo)),
    )
    .await;
    record(
        &log,
        &mut i,
        Event::OperationFailed {
            stage: stage::NETWORK.into(),
            step: None,
            error: "injected".into(),
        },
    )
    .await;
    let failed = folded_whole(&log).await;
    let op = failed.operations().next().expect("the boot is folded");
    let plan = plan_rollback(op, &[]).expect("a boot plans");
    let stuck = plan.compensations[0].compensation_id;
    record(&log, &mut i, Event::RollbackPlanned { plan }).await;
    record(
        &log,
        &mut i,
        Event::RollbackFinished {
            outcome: RollbackOutcome::NeedsAttention,
            remaining: vec![stuck],
        },
    )
    .await;
    record(
        &log,
        &mut i,
        Event::CompensationResolved {
            compensation_id: stuck,
            reason: "released by hand".into(),
        },
    )
    .await;

    // When drift folds the log
    let mut fold = DriftFold::new();
    let mut done = LogFolded::default();
    let end = log.last_position().await.expect("end");
    let mut heard = Vec::new();
    fold_log(&log, &mut fold, &mut done, end, |p| heard.push(p))
        .await
        .expect("fold");

    // Then the resolve read the boot's history back once, nothing was left out, every
    // position was heard, and the IP is no longer held (the same as the whole fold says)
    assert_eq!(
        done,
        LogFolded {
            position: end,
            quarantined: 0,
            reopened: 1
        }
    );
    assert_eq!(heard, (1..=end).collect::<Vec<_>>());
    let whole = folded_whole(&log).await;
    let expected = recorded_resources(whole.operations());
    let ledger = fold.resources();
    assert_eq!(ledger.held_at("ipam").count(), 0);
    assert_eq!(
        ledger.held_at("ipam").count(),
        expected.held_at("ipam").count()
    );
    assert_eq!(ledger.executors(), expected.executors());
}
