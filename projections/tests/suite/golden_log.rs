//! The golden log, folded (docs/events.md, "The golden log"): `log-1.bin` of
//! `provledger-events` (a stream's worth of commits written by the build of its day, every
//! event in plausible lifecycles) must audit clean, be admitted commit by commit by the
//! append decider, and fold to the state pinned in
//! `snapshots/suite__golden_log__golden_log_1_state.snap`, by every later build.
//!
//! The log is never regenerated. A fold changed on purpose re-pins the snapshot (review the
//! diff: `cargo insta review`, or `INSTA_UPDATE=always` and `git diff`), as an entity
//! format bump does; a fold changed by accident fails here, naming the entity that differs.

use std::collections::BTreeMap;

use provledger_events::catalogue::golden_log::{self, LOGS};
use provledger_events::{codec, AggregateId, Commit, CommitDraft, Event};
use provledger_projections::audit::Auditor;
use provledger_projections::decide::{decide_append, Admission};
use provledger_projections::{Entity, Projection};

/// The commits of log-1, checked against its pin and decoded, in log order.
fn log_1() -> Vec<Commit> {
    golden_log::open(&LOGS[0])
        .unwrap_or_else(|e| panic!("{e}"))
        .iter()
        .map(|entry| {
            codec::decode(&entry.payload, entry.position)
                .unwrap_or_else(|e| panic!("position {}: {e}", entry.position))
        })
        .collect()
}

/// The aggregate log-1 lost a version of (its acknowledged loss).
fn lost_on() -> AggregateId {
    AggregateId::provider(uuid::Uuid::from_u128(0x1004))
}

/// Given log-1, when the audit's core reads it in log order and checks the invariants at
/// the time of its last commit, then it finds no violation: its chains hold, its one lost
/// position is explained by the acknowledged loss, and no invariant is broken.
#[test]
fn golden_log_1_audits_clean() {
    // Given
    let commits = log_1();
    let last = commits.last().expect("log-1 holds commits");
    // When
    let mut auditor = Auditor::new();
    for commit in &commits {
        auditor.commit(commit);
    }
    let report = auditor.finish(last.position, last.recorded_at);
    // Then
    assert_eq!(report.violations, vec![], "log-1 audits clean");
    assert_eq!(report.quarantined, 0);
    assert_eq!(report.commits, commits.len() as u64);
    assert_eq!(report.position, last.position);
    let losses: Vec<_> = report
        .acknowledged_losses
        .iter()
        .map(|l| {
            (
                l.aggregate.clone(),
                l.from_version,
                l.to_version,
                l.actor.as_str(),
            )
        })
        .collect();
    assert_eq!(losses, vec![(lost_on().to_string(), 2, 2, "ops-bob")]);
    assert_eq!(
        report.resolved_by_hand.len(),
        1,
        "{:?}",
        report.resolved_by_hand
    );
}

/// Given log-1, when each commit is decided against the state its aggregate was folded to
/// before it (what every write path asks), then each is admitted as written: the log is
/// one the write path could have written. The loss's acknowledgement is the exception:
/// `provledger integrity acknowledge` writes it past the decider.
#[test]
fn golden_log_1_is_admitted_by_the_decider() {
    // Given
    let commits = log_1();
    let mut projection = Projection::new();
    let mut refused = Vec::new();
    for commit in &commits {
        // When
        let draft = CommitDraft {
            trace: None,
            commit_id: commit.commit_id,
            operation_id: commit.operation_id,
            causation_id: commit.causation_id,
            actor: commit.actor.clone(),
            recorded_at: commit.recorded_at,
            events: commit.events.clone(),
        };
        let acknowledgement = matches!(commit.events.as_slice(), [Event::LossAcknowledged { .. }]);
        if !acknowledgement {
            let entity = projection.get(&commit.aggregate);
            match decide_append(commit.aggregate, entity, &draft) {
                Ok(Admission::Append) => {}
                other => refused.push(format!("position {}: {other:?}", commit.position)),
            }
        }
        projection.apply(commit);
    }
    // Then
    assert_eq!(refused, Vec::<String>::new());
}

/// Given log-1, when folded commit by commit (`Projection::apply`, as a rebuild does), then
/// the state (summary and every entity's contract view) is the pinned snapshot; each
/// entity folded alone from its own commits is the same; and the only anomalies are the
/// two the lost version leaves (the gap, and its acknowledgement).
#[test]
fn golden_log_1_folds_to_its_pinned_state() {
    // Given
    let commits = log_1();
    // When
    let projection = Projection::rebuild(&commits);
    // Then
    let mut by_aggregate: BTreeMap<AggregateId, Vec<&Commit>> = BTreeMap::new();
    for commit in &commits {
        by_aggregate
            .entry(commit.aggregate)
            .or_default()
            .push(commit);
    }
    for (id, own) in &by_aggregate {
        assert_eq!(
            Entity::fold(*id, own.iter().copied()).as_ref(),
            projection.get(id),
            "{id} folded alone"
        );
    }
    let anomalies: Vec<(String, u64, String)> = by_aggregate
        .keys()
        .filter_map(|id| projection.get(id))
        .flat_map(|e| {
            e.header()
                .anomalies
                .iter()
                .map(|a| (e.id().to_string(), a.version, a.event.clone()))
        })
        .collect();
    assert_eq!(
        anomalies,
        vec![
            (lost_on().to_string(), 3, "commit".to_string()),
            (lost_on().to_string(), 4, "loss_acknowledged".to_string()),
        ]
    );
    let entities: BTreeMap<String, serde_json::Value> = by_aggregate
        .keys()
        .filter_map(|id| projection.get(id))
        .map(|e| (e.id().to_string(), e.view()))
        .collect();
    let state = serde_json::json!({
        "summary": projection.summary(),
        "entities": entities,
    });
    let text = serde_json::to_string_pretty(&state).expect("JSON");
    insta::with_settings!({
        description => "log-1 folded by this build; the log never changes, so a difference is \
                        a change of the fold (docs/events.md, \"The golden log\")",
        omit_expression => true,
    }, {
        insta::assert_snapshot!("golden_log_1_state", text);
    });
}
