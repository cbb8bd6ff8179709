//! `cancellation_requested` on an operation: applied while it runs; refused, with the
//! reason why, on one that is closed or already stopped, with its state unchanged; and a
//! log written before the refusal existed, holding such an event, still folds (the event
//! is an anomaly, never an error).

use provledger_events::catalogue::{OperationKind, RollbackOutcome, StagePolicy, StageSpec};
use provledger_events::{AggregateId, Event};
use provledger_projections::decide::{decide_append, Admission, AppendRejection};
use provledger_projections::operation::OperationStatus;
use provledger_projections::Entity;
use provledger_tests::script::{self, draft_for, ScriptStep};
use uuid::Uuid;

fn operation() -> AggregateId {
    AggregateId::operation(Uuid::from_u128(3))
}

fn started() -> Event {
    Event::OperationStarted {
        kind: OperationKind::CreateCluster,
        target: AggregateId::cluster(Uuid::from_u128(1)),
        parent_id: None,
        stages: vec![StageSpec {
            name: "spawn".into(),
            policy: StagePolicy::Compensate,
        }],
        bundle_policy: None,
    }
}

fn cancel() -> Event {
    Event::CancellationRequested {
        reason: "its writer died".into(),
    }
}

/// The operation folded from these events, one commit each.
fn folded(events: Vec<Event>) -> Entity {
    let steps: Vec<ScriptStep> = events.into_iter().map(|e| (operation(), vec![e])).collect();
    let commits = script::seal(&steps);
    Entity::fold(operation(), commits.iter()).expect("an operation")
}

fn succeeded() -> Vec<Event> {
    vec![started(), Event::OperationSucceeded {}]
}

/// Failed, planned with nothing to undo, rolled back: closed.
fn rolled_back() -> Vec<Event> {
    vec![
        started(),
        Event::OperationFailed {
            stage: "spawn".into(),
            step: None,
            error: "boom".into(),
        },
        Event::RollbackPlanned {
            plan: provledger_events::catalogue::RollbackPlan {
                rule: "nothing".into(),
                target: AggregateId::cluster(Uuid::from_u128(1)),
                target_outcome: provledger_events::catalogue::TargetOutcome::Deleted,
                compensations: vec![],
                retained: vec![],
            },
        },
        Event::RollbackFinished {
            outcome: RollbackOutcome::RolledBack,
            remaining: vec![],
        },
    ]
}

fn operation_state(entity: &Entity) -> &provledger_projections::operation::OperationState {
    match entity {
        Entity::Operation(o) => o,
        other => panic!("not an operation: {other:?}"),
    }
}

#[test]
fn a_cancellation_of_a_running_operation_is_admitted() {
    // Given a running operation,
    let running = folded(vec![started()]);
    // when a cancellation is proposed, then it is admitted.
    assert_eq!(
        decide_append(operation(), Some(&running), &draft_for(100, vec![cancel()])),
        Ok(Admission::Append)
    );
}

#[test]
fn a_cancellation_of_a_closed_operation_is_refused_with_why_and_changes_nothing() {
    for (events, status) in [(succeeded(), "succeeded"), (rolled_back(), "rolled_back")] {
        let closed = folded(events.clone());
        assert!(operation_state(&closed).is_closed(), "{status}");
        // Given a closed operation, when a cancellation is proposed,
        let refusal = decide_append(operation(), Some(&closed), &draft_for(100, vec![cancel()]))
            .expect_err("refused");
        // then the decider refuses it as not applicable, with the fold's reason,
        let AppendRejection::NotApplicable { problem, event, .. } = &refusal else {
            panic!("not NotApplicable: {refusal:?}");
        };
        assert_eq!(event, "cancellation_requested");
        assert!(
            problem.contains(&format!("the operation is closed ({status})"))
                && problem.contains("nothing left to cancel"),
            "{problem}"
        );
        // and a fold of it (a log that holds it) leaves the state as it was, but for the
        // commit's bookkeeping and the anomaly that names it.
        let mut with_it = events.clone();
        with_it.push(cancel());
        let after = folded(with_it);
        let (before, now) = (operation_state(&closed), operation_state(&after));
        assert_eq!(now.header.version, before.header.version + 1);
        let mut same = now.clone();
        same.header = before.header.clone();
        assert_eq!(&same, before, "the refused event changed the state");
        let anomaly = now.header.anomalies.last().expect("an anomaly");
        assert_eq!(anomaly.event, "cancellation_requested");
        assert!(
            anomaly.problem.contains("nothing left to cancel"),
            "{anomaly:?}"
        );
    }
}

#[test]
fn a_cancellation_of_an_operation_already_rolling_back_is_refused() {
    let failed = folded(vec![
        started(),
        Event::OperationFailed {
            stage: "spawn".into(),
            step: None,
            error: "boom".into(),
        },
    ]);
    assert_eq!(
        operation_state(&failed).status,
        Some(OperationStatus::Failed)
    );
    let refusal = decide_append(operation(), Some(&failed), &draft_for(100, vec![cancel()]))
        .expect_err("refused");
    assert!(
        refusal.to_string().contains("already stopped (failed)"),
        "{refusal}"
    );
}

#[test]
fn an_old_log_with_a_cancellation_after_the_close_still_folds() {
    // Given a log written before the refusal existed: a cancellation after success,
    let mut log = succeeded();
    log.push(cancel());
    let entity = folded(log);
    // when it is folded, then the operation is still succeeded, at version 3, without a
    // cancellation reason, and the refused event is an anomaly.
    let op = operation_state(&entity);
    assert_eq!(op.status, Some(OperationStatus::Succeeded));
    assert_eq!(op.header.version, 3);
    assert_eq!(op.cancellation_reason, None);
    assert!(op
        .header
        .anomalies
        .iter()
        .any(|a| a.event == "cancellation_requested" && a.problem.contains("closed")));
}
