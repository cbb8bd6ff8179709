//! The console's pages as pure functions: given views and histories, when rendered, then
//! what an operator must see is there (and what must never be hidden is not).

use std::collections::HashMap;

use provledger_events::catalogue::{
    ClusterStatus, CompensationAction, Executor, RollbackOutcome, RollbackPlan, StagePolicy,
    StageSpec, TargetOutcome,
};
use provledger_events::{
    AggregateId, AggregateKind, Commit, CommitDraft, Event, Hash, HistoryEntry, Timestamp,
};
use provledger_projections::operation::{CompensationProgress, OperationStatus};
use provledger_projections::view::{CompensationView, FoldProgress, OperationView};
use uuid::Uuid;

use super::html::Html;
use super::pages::{self, History, ListFilter};
use super::plan::plan_diagram;
use super::{history_page, Params};

fn cluster() -> AggregateId {
    AggregateId::new(AggregateKind::Cluster, Uuid::from_u128(7))
}

fn chain(n: u64) -> Vec<Commit> {
    let mut prev = Hash::ZERO;
    (1..=n)
        .map(|v| {
            let draft = CommitDraft {
                trace: None,
                commit_id: Uuid::from_u128(v as u128),
                operation_id: None,
                causation_id: None,
                actor: "svc".into(),
                recorded_at: Timestamp(1_700_000_000_000 + v as i64),
                events: vec![Event::ClusterStatusChanged {
                    status: ClusterStatus::Active,
                    description: format!("step {v}"),
                }],
            };
            let mut c = Commit::seal(cluster(), v, prev, draft);
            c.position = v * 10;
            prev = c.hash;
            c
        })
        .collect()
}

fn entries(commits: Vec<Commit>) -> Vec<HistoryEntry> {
    commits.into_iter().map(HistoryEntry::Commit).collect()
}

#[test]
fn an_intact_chain_is_shown_verified() {
    // Given three commits that link, when their history is rendered...
    let history = history_page(&cluster(), entries(chain(3)), None, "/clusters/x".into());
    let html = pages::history_section(&history);
    // ...then the chain is verified and no row is marked broken.
    assert!(html.contains("data-chain=\"verified\""), "{html}");
    assert!(!html.contains("class=\"broken\""), "{html}");
    assert_eq!(history.commits, 3);
}

#[test]
fn a_tampered_commit_is_shown_as_a_broken_link_in_place() {
    // Given a chain whose second commit was altered after it was sealed...
    let mut commits = chain(3);
    commits[1].actor = "mallory".into();
    // ...when its history is rendered...
    let history = history_page(&cluster(), entries(commits), None, "/clusters/x".into());
    let html = pages::history_section(&history);
    // ...then the verdict is "broken", and the altered commit's own row says so.
    assert!(html.contains("data-chain=\"broken\""), "{html}");
    let broken_rows = html.matches("<tr class=\"broken\">").count();
    assert_eq!(broken_rows, 1, "{html}");
    let row = html
        .split("<tr class=\"broken\">")
        .nth(1)
        .unwrap_or_default();
    assert!(row.starts_with("<td>v2</td>"), "{row}");
}

#[test]
fn a_message_outside_the_chain_is_listed_where_it_lies() {
    // Given a quarantined message on the subject between versions 1 and 2...
    let mut e = entries(chain(2));
    e.insert(
        1,
        HistoryEntry::Quarantined {
            position: 15,
            subject: "provledger.ev.cluster.x".into(),
            reason: "modified: the hash does not match".into(),
        },
    );
    // ...when rendered, then it is in the page, marked, and the chain is not "verified".
    let history = history_page(&cluster(), e, None, "/clusters/x".into());
    let html = pages::history_section(&history);
    assert!(html.contains("data-chain=\"broken\""), "{html}");
    assert!(html.contains("quarantined</b>: modified"), "{html}");
}

#[test]
fn a_long_history_shows_its_newest_page_and_links_to_the_earlier_one() {
    // Given more commits than a page holds...
    let n = super::HISTORY_PAGE as u64 + 30;
    let history = history_page(&cluster(), entries(chain(n)), None, "/clusters/x".into());
    // ...then the page holds the newest HISTORY_PAGE, and links back.
    assert_eq!(history.entries.len(), super::HISTORY_PAGE);
    assert_eq!(history.earlier_from, Some(1));
    assert_eq!(history.later_from, None);
    // ...and from version 1, the first page links forward.
    let first = history_page(&cluster(), entries(chain(n)), Some(1), "/c".into());
    assert_eq!(first.later_from, Some(super::HISTORY_PAGE as u64 + 1));
    assert_eq!(first.earlier_from, None);
}

fn compensation(n: u128, state: CompensationProgress, attempts: u32) -> CompensationView {
    CompensationView {
        compensation_id: Uuid::from_u128(n),
        stage: "spawn".into(),
        step: format!("vm-{n}"),
        action: CompensationAction::TerminateVm,
        executor: Executor::Service("hypervisor".into()),
        resource: format!("vm-{n}"),
        state,
        attempts,
        last_error: (state == CompensationProgress::Failed).then(|| "hypervisor down".into()),
        resolved: None,
    }
}

/// The time pages count ages to: an hour after `stopped_rollback` started.
const NOW: Timestamp = Timestamp(1_700_003_600_000);

fn stopped_rollback() -> OperationView {
    let op = Uuid::from_u128(99);
    OperationView {
        id: op,
        kind: None,
        target: Some(cluster()),
        parent_id: None,
        children: vec![],
        status: Some(OperationStatus::NeedsAttention),
        stage: Some("spawn".into()),
        stages: vec![StageSpec {
            name: "spawn".into(),
            policy: StagePolicy::Compensate,
        }],
        steps: vec![],
        started: vec![],
        error: None,
        cancellation_reason: None,
        target_deleted: false,
        rollback_plan: Some(RollbackPlan {
            rule: "undo spawn".into(),
            target: cluster(),
            compensations: vec![],
            retained: vec![],
            target_outcome: TargetOutcome::Error {
                description: "spawn failed".into(),
            },
        }),
        rollback_outcome: Some(RollbackOutcome::NeedsAttention),
        compensations: vec![
            compensation(1, CompensationProgress::Done, 1),
            compensation(2, CompensationProgress::Failed, 5),
        ],
        remaining: vec![Uuid::from_u128(2)],
        started_at: Some(Timestamp(1_700_000_000_000)),
        failed_at: Some(Timestamp(1_700_000_060_000)),
        finished_at: Some(Timestamp(1_700_000_120_000)),
        last_commit_at: Some(Timestamp(1_700_000_120_000)),
        parts: None,
        progress: FoldProgress {
            version: 9,
            last_position: 90,
            anomalies: vec![],
            anomaly_count: 0,
        },
    }
}

#[test]
fn a_stopped_rollback_draws_its_done_and_stuck_compensations_and_says_how_to_resume() {
    // Given a rollback that stopped with one compensation done and one failed and left...
    let op = stopped_rollback();
    // ...when its page is rendered...
    let svg = plan_diagram(&op);
    let html = pages::operation(&op, &History::default(), NOW);
    // ...then the drawing shows one done and one stuck, in plan order...
    let done = svg.find("data-standing=\"done\"").expect("a done box");
    let stuck = svg.find("data-standing=\"stuck\"").expect("a stuck box");
    assert!(done < stuck, "plan order");
    // ...what remains is named at its executor, and the command to move it on is given.
    assert!(
        html.contains("<td>hypervisor</td><td><code>vm-2</code></td>"),
        "{html}"
    );
    assert!(
        !html.contains("<code>vm-1</code></td></tr></tbody></table></div>"),
        "{html}"
    );
    assert!(
        html.contains(&format!("rollback run {}", op.id)),
        "the resume command: {html}"
    );
    assert!(html.contains("data-status=\"needs_attention\""), "{html}");
}

#[test]
fn an_operation_shows_when_it_started_ended_and_last_changed_and_its_age() {
    // Given an operation started an hour before now, failed a minute in and closed two
    // minutes in...
    let op = stopped_rollback();
    // ...when its page and the list are rendered...
    let page = pages::operation(&op, &History::default(), NOW);
    let list = pages::operations(
        &ListFilter::default(),
        None,
        std::slice::from_ref(&op),
        None,
        NOW,
    );
    // ...then the page says when it started and how long ago, when it finished, and when
    // its last commit was...
    let at = |t: &str| format!("<time datetime=\"{t}\">{t}</time>");
    for said in [
        format!("started {} (1h0m ago)", at("2023-11-14T22:13:20Z")),
        format!("finished {}", at("2023-11-14T22:15:20Z")),
        format!("last commit {} (58m0s ago)", at("2023-11-14T22:15:20Z")),
    ] {
        assert!(page.contains(&said), "{said} not in {page}");
    }
    // ...and its row in the list says the same, under named columns.
    for said in [
        "<th>started</th><th>age</th><th>ended</th><th>last commit</th>".to_string(),
        format!("<td>{}</td><td>1h0m</td>", at("2023-11-14T22:13:20Z")),
        format!(
            "<td>finished {}</td><td>58m0s</td>",
            at("2023-11-14T22:15:20Z")
        ),
    ] {
        assert!(list.contains(&said), "{said} not in {list}");
    }
}

#[test]
fn a_failed_compensation_still_in_budget_is_failed_not_stuck() {
    let mut op = stopped_rollback();
    op.remaining.clear();
    op.status = Some(OperationStatus::RollingBack);
    let svg = plan_diagram(&op);
    assert!(svg.contains("data-standing=\"failed\""), "{svg}");
    assert!(!svg.contains("data-standing=\"stuck\""), "{svg}");
}

#[test]
fn the_worklist_comes_before_the_list_and_the_next_page_keeps_the_filters() {
    let op = stopped_rollback();
    let filter = ListFilter {
        status: None,
        kind: Some("create_cluster".into()),
        target: None,
        limit: Some(20),
    };
    let html = pages::operations(
        &filter,
        Some(std::slice::from_ref(&op)),
        &[],
        Some(Uuid::from_u128(5)),
        NOW,
    );
    let attention = html.find("id=\"needs-attention\"").expect("the worklist");
    let all = html.find("All operations").expect("the list");
    assert!(attention < all);
    assert!(
        html.contains(&format!(
            "/operations?kind=create_cluster&amp;limit=20&amp;before={}",
            Uuid::from_u128(5)
        )),
        "{html}"
    );
}

#[test]
fn text_from_the_log_is_escaped() {
    let mut op = stopped_rollback();
    op.compensations[1].last_error = Some("<script>alert(1)</script>".into());
    let html = pages::operation(&op, &History::default(), NOW);
    assert!(!html.contains("<script>alert"), "{html}");
    assert_eq!(
        &*Html::text("<a href='x'>&"),
        "&lt;a href=&#39;x&#39;&gt;&amp;"
    );
}

#[test]
fn a_query_string_with_an_unknown_name_or_a_bad_value_is_refused() {
    let q = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    assert!(Params::parse(&q(&[("status", "needs_attention")]), &["status"]).is_ok());
    assert!(Params::parse(&q(&[("status", "sleeping")]), &["status"]).is_err());
    assert!(Params::parse(&q(&[("sort", "x")]), &["status"]).is_err());
    assert!(Params::parse(&q(&[("limit", "0")]), &["limit"]).is_err());
    assert!(Params::parse(&q(&[("limit", "500")]), &["limit"]).is_err());
    assert!(Params::parse(&q(&[("target", "cluster/nope")]), &["target"]).is_err());
    let ok = Params::parse(&q(&[("fragment", "1"), ("from", "3")]), &["from"]).unwrap();
    assert!(ok.fragment);
    assert_eq!(ok.from, Some(3));
}

#[test]
fn a_verified_chain_keeps_its_tip_its_counts_and_the_page_window() {
    // Given a subject of 5 commits with a quarantined message after the second...
    let commits = chain(5);
    let mut e = entries(commits.clone());
    e.insert(
        2,
        HistoryEntry::Quarantined {
            position: 25,
            subject: String::new(),
            reason: "modified".into(),
        },
    );
    // ...when it is taken in up to position 40 with a window of 2...
    let mut v = super::chains::Verified::new();
    v.extend(&e, 40, 2);
    // ...then v5 (position 50) is left for later, the counts hold, and the page (v3, v4)
    // is read from after v2, whose tip is kept with them (window + 1 tips).
    assert_eq!(v.through.version, 4);
    assert_eq!(v.through.position, 40);
    assert_eq!(v.commits, 4);
    assert_eq!(v.quarantined, 1);
    assert_eq!(v.window_start(2).version, 2);
    assert_eq!(v.window_start(2).hash, commits[1].hash);
    // When the rest comes, only it is taken in.
    v.extend(&entries(commits[4..].to_vec()), 100, 2);
    assert_eq!((v.through.version, v.commits), (5, 5));
    assert_eq!(v.window_start(2).version, 3);
    // A short chain's window starts at the subject's start.
    let mut short = super::chains::Verified::new();
    short.extend(&entries(chain(2)), 100, 5);
    assert_eq!(short.window_start(5), provledger_events::ChainTip::EMPTY);
}

/// Markup a hostile writer puts in every free-text field: an element, both quotes, an
/// ampersand. Found unescaped on a page, it would be markup the page runs.
const HOSTILE: &str = "<i id=hostile>'\"&";

/// Where one string sits in a JSON value: a leaf, or an object's key.
#[derive(Clone)]
enum Spot {
    Leaf(Vec<Step>),
    Key(Vec<Step>, String),
}

#[derive(Clone)]
enum Step {
    Key(String),
    Index(usize),
}

fn spots(v: &serde_json::Value, at: Vec<Step>, out: &mut Vec<Spot>) {
    match v {
        serde_json::Value::String(_) => out.push(Spot::Leaf(at)),
        serde_json::Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let mut next = at.clone();
                next.push(Step::Index(i));
                spots(item, next, out);
            }
        }
        serde_json::Value::Object(map) => {
            for (k, item) in map {
                out.push(Spot::Key(at.clone(), k.clone()));
                let mut next = at.clone();
                next.push(Step::Key(k.clone()));
                spots(item, next, out);
            }
        }
        _ => {}
    }
}

fn at_mut<'a>(v: &'a mut serde_json::Value, path: &[Step]) -> &'a mut serde_json::Value {
    path.iter().fold(v, |v, step| match step {
        Step::Key(k) => &mut v[k.as_str()],
        Step::Index(i) => &mut v[*i],
    })
}

/// `value` with every string its type accepts as free text (map keys included) replaced by
/// [`HOSTILE`], and how many were. A replacement is kept only when the typed value holds
/// it exactly (serialized back, the JSON is the same), so enum words, ids and times stay.
fn poisoned<T: serde::Serialize + serde::de::DeserializeOwned>(value: &T) -> (T, usize) {
    let mut json = serde_json::to_value(value).expect("a view serializes");
    let mut all = Vec::new();
    spots(&json, Vec::new(), &mut all);
    let mut kept = 0;
    for (n, spot) in all.into_iter().enumerate() {
        let mut candidate = json.clone();
        match &spot {
            Spot::Leaf(path) => {
                *at_mut(&mut candidate, path) = serde_json::Value::String(HOSTILE.into())
            }
            Spot::Key(path, key) => {
                let serde_json::Value::Object(map) = at_mut(&mut candidate, path) else {
                    continue;
                };
                let Some(item) = map.remove(key) else {
                    continue;
                };
                map.insert(format!("{HOSTILE}{n}"), item);
            }
        }
        let typed: Result<T, _> = serde_json::from_value(candidate.clone());
        if let Ok(typed) = typed {
            if serde_json::to_value(&typed).ok().as_ref() == Some(&candidate) {
                json = candidate;
                kept += 1;
            }
        }
    }
    (
        serde_json::from_value(json).expect("kept only what round-trips"),
        kept,
    )
}

fn assert_escaped(page: &str, what: &str) {
    assert!(
        !page.contains("<i id=hostile>"),
        "{what}: unescaped markup in {page}"
    );
    assert!(
        page.contains("&lt;i id=hostile&gt;&#39;&quot;&amp;"),
        "{what}: the hostile text is not shown at all, so the test proves nothing: {page}"
    );
}

fn full_operation() -> OperationView {
    use provledger_events::catalogue::{
        Compensation, Effect, EffectKind, OperationKind, Origin, RetainedResource,
    };
    use provledger_projections::operation::{OperationError, StepProgress};
    use provledger_projections::view::{OutcomeUnknown, StartedStepView, StepView};
    let mut op = stopped_rollback();
    op.kind = Some(OperationKind::CreateCluster);
    op.parent_id = Some(Uuid::from_u128(3));
    op.children = vec![Uuid::from_u128(4)];
    op.target_deleted = true;
    op.error = Some(OperationError {
        stage: "spawn".into(),
        step: Some("vm-2".into()),
        message: "boot failed".into(),
    });
    op.cancellation_reason = Some("asked".into());
    op.compensations[0].resolved = Some("released by hand".into());
    let compensation = Compensation {
        action: CompensationAction::TerminateVm,
        executor: Executor::Service("hypervisor".into()),
        resource: "vm-1".into(),
        args: [("a".to_string(), "b".to_string())].into(),
    };
    op.steps = vec![StepView {
        stage: "spawn".into(),
        name: "vm-1".into(),
        effect: Effect {
            kind: EffectKind::VmCreated,
            resource: "vm-1".into(),
            executor: "hypervisor".into(),
            origin: Origin::Created,
            detail: [("k".to_string(), "v".to_string())].into(),
        },
        compensation: Some(compensation.clone()),
        state: StepProgress::Done,
        compensation_id: None,
    }];
    op.started = vec![StartedStepView {
        stage: "spawn".into(),
        name: "vm-3".into(),
        executor: "hypervisor".into(),
        idempotency_key: "key-3".into(),
        compensation: Some(compensation),
        state: OutcomeUnknown::OutcomeUnknown,
    }];
    if let Some(plan) = op.rollback_plan.as_mut() {
        plan.retained = vec![RetainedResource {
            stage: "spawn".into(),
            step: "vm-0".into(),
            resource: "disk-0".into(),
            why: "holds data".into(),
        }];
    }
    op
}

/// A history with a commit whose actor and events carry text, a broken link, a message
/// outside the chain and a loss, every text in it hostile.
fn hostile_history() -> History {
    let mut commits = chain(2);
    commits[1].actor = HOSTILE.into();
    commits[1].events = vec![Event::ClusterStatusChanged {
        status: ClusterStatus::Active,
        description: HOSTILE.into(),
    }];
    let mut entries = entries(commits);
    entries.push(HistoryEntry::Quarantined {
        position: 99,
        subject: HOSTILE.into(),
        reason: HOSTILE.into(),
    });
    let mut history = history_page(&cluster(), entries, None, "/clusters/x".into());
    history.violations.push((20, HOSTILE.into()));
    history
}

#[test]
fn every_text_a_page_shows_is_escaped_whatever_a_writer_put_in_it() {
    // Given views in which every free-text field (and every map key) holds markup...
    let (op, op_fields) = poisoned(&full_operation());
    assert!(
        op_fields >= 25,
        "only {op_fields} operation fields were poisoned"
    );
    let history = hostile_history();
    // ...when every page that shows them is rendered, then each shows the text escaped.
    assert_escaped(&pages::operation(&op, &history, NOW), "operation page");
    assert_escaped(&plan_diagram(&op), "plan drawing");
    assert_escaped(&pages::history_section(&history), "history");
    let filter = ListFilter {
        status: None,
        kind: Some(HOSTILE.into()),
        target: Some(HOSTILE.into()),
        limit: None,
    };
    let list = pages::operations(
        &filter,
        Some(std::slice::from_ref(&op)),
        std::slice::from_ref(&op),
        None,
        NOW,
    );
    assert_escaped(&list, "operation list");
    let rows = vec![(cluster(), HOSTILE.to_string(), HOSTILE.to_string())];
    assert_escaped(
        &pages::entity_list(&rows, Some(format!("/clusters?after={HOSTILE}"))),
        "entity list",
    );
    let health = pages::HealthView {
        ready: false,
        reason: Some(HOSTILE.into()),
        position: 1,
        end: None,
        caught_up_to: None,
        nats_connected: true,
        quarantined: vec![(1, HOSTILE.into(), HOSTILE.into())],
        quarantined_total: 1,
        audit: Some(crate::replica::LastAudit {
            finished_at: Timestamp(0),
            took_ms: 1,
            position: 1,
            commits: 1,
            violations: 1,
            first: vec![HOSTILE.into()],
        }),
        audit_failed: Some((Timestamp(0), HOSTILE.into())),
        audit_interval: None,
        needs_attention: 1,
        now: NOW,
    };
    assert_escaped(&pages::health(&health), "health");
    let frame = super::html::Frame {
        title: HOSTILE,
        stream: HOSTILE,
        position: 1,
        live: true,
    };
    assert_escaped(&super::html::page(&frame, &Html::new()), "page frame");
}

#[test]
fn every_text_a_cluster_instance_or_provider_page_shows_is_escaped() {
    use provledger_projections::view::{ClusterView, InstanceView, ProviderView};
    // The fold's progress is flattened into each view.
    let with_progress = |mut v: serde_json::Value| {
        v["version"] = 1.into();
        v["last_position"] = 1.into();
        v["anomalies"] = serde_json::json!([]);
        v["anomaly_count"] = 0.into();
        v
    };
    let json = with_progress(serde_json::json!({
        "id": Uuid::from_u128(1), "name": "c", "plugin": "p", "status": null,
        "status_description": "d",
        "node_groups": [{"name": "g", "count": 1, "flavor": "f", "processes": ["x"],
                         "instance_ids": [Uuid::from_u128(2)]}],
        "operation_id": Uuid::from_u128(3), "operation_kind": null
    }));
    let cluster_view: ClusterView = serde_json::from_value(json).expect("a cluster view");
    let (c, n) = poisoned(&cluster_view);
    assert!(n >= 6, "only {n} cluster fields were poisoned");
    assert_escaped(&pages::cluster(&c, &hostile_history()), "cluster page");

    let json = with_progress(serde_json::json!({
        "id": Uuid::from_u128(1), "name": "i", "origin": null, "cluster_id": Uuid::from_u128(2),
        "node_group": "g", "flavor": "f", "resources": {"VCPU": 1}, "vm_state": null,
        "task_state": null, "power_state": "running", "host": "h", "provider_id": Uuid::from_u128(3),
        "task_worker": "w", "task_lease_since": null, "task_lease_until": Timestamp(5),
        "delete_requested": false, "pending_reissues": [], "operation_id": Uuid::from_u128(4)
    }));
    let instance_view: InstanceView = serde_json::from_value(json).expect("an instance view");
    let (i, n) = poisoned(&instance_view);
    assert!(n >= 5, "only {n} instance fields were poisoned");
    assert_escaped(&pages::instance(&i, &hostile_history()), "instance page");

    let json = with_progress(serde_json::json!({
        "id": Uuid::from_u128(1), "name": "p", "host": "h", "status": null, "inventories": {},
        "capacity": {"VCPU": 4}, "usage": {"VCPU": 1},
        "allocations": [{"consumer": Uuid::from_u128(5), "consumer_kind": "instance",
                         "resources": {"VCPU": 1}}],
        "last_delete_refusal": null
    }));
    let provider_view: ProviderView = serde_json::from_value(json).expect("a provider view");
    let (p, n) = poisoned(&provider_view);
    assert!(n >= 5, "only {n} provider fields were poisoned");
    assert_escaped(&pages::provider(&p, &hostile_history()), "provider page");
}

fn health_at(position: u64, audit_position: u64, finished_at: Timestamp) -> pages::HealthView {
    pages::HealthView {
        ready: true,
        reason: None,
        position,
        end: Some(position),
        caught_up_to: Some(position),
        nats_connected: true,
        quarantined: vec![],
        quarantined_total: 0,
        audit: Some(crate::replica::LastAudit {
            finished_at,
            took_ms: 3,
            position: audit_position,
            commits: audit_position,
            violations: 0,
            first: vec![],
        }),
        audit_failed: None,
        audit_interval: Some(std::time::Duration::from_secs(3600)),
        needs_attention: 0,
        now: NOW,
    }
}

/// The `#audit` element's opening tag.
fn audit_box(page: &str) -> &str {
    let at = page.find("id=\"audit\"").expect("an audit box");
    let open = page[..at].rfind('<').unwrap_or(0);
    &page[open..page[open..].find('>').map_or(page.len(), |e| open + e + 1)]
}

#[test]
fn an_audit_of_an_almost_empty_log_is_stale_not_green_and_says_what_to_do() {
    // Given an audit that finished five minutes ago at position 0 (the log was empty) and
    // a replica that has applied 50 positions since...
    let h = health_at(50, 0, NOW.plus_ms(-300_000));
    // ...when the health page is rendered...
    let page = pages::health(&h);
    // ...then the audit is stale, in red, says its age and both positions, and what to do.
    let tag = audit_box(&page);
    assert!(tag.contains("class=\"alert\""), "{tag}");
    assert!(tag.contains("data-freshness=\"stale\""), "{tag}");
    for said in [
        "<b>stale</b>",
        "(5m0s ago)",
        "read up to position 0; position applied now 50 (50 position(s) since)",
        "provledger --nats $NATS_URL audit",
    ] {
        assert!(page.contains(said), "{said} not in {page}");
    }
}

#[test]
fn an_audit_is_current_behind_or_stale_by_its_positions_and_its_age() {
    // Given audits every hour: one at the position applied now is current, one a little
    // behind is behind, one overdue (more than two intervals old) or that read less than
    // half of what is applied now is stale.
    use pages::AuditFreshness::{Behind, Current, Stale};
    let hour = std::time::Duration::from_secs(3600);
    for (position, audited, ago_ms, expected) in [
        (100, 100, 60_000, Current),
        (100, 90, 60_000, Behind),
        (100, 100, 3 * 3_600_000, Stale),
        (100, 49, 60_000, Stale),
        (100, 0, 0, Stale),
        (0, 0, 0, Current),
    ] {
        let h = health_at(position, audited, NOW.plus_ms(-ago_ms));
        let audit = h.audit.as_ref().expect("an audit");
        assert_eq!(
            pages::audit_freshness(audit, position, NOW, Some(hour)),
            expected,
            "applied {position}, audited {audited}, {ago_ms} ms ago"
        );
    }
    // A current audit without violations is green; one behind is not.
    let current = pages::health(&health_at(100, 100, NOW.plus_ms(-60_000)));
    assert!(audit_box(&current).contains("class=\"ok\""), "{current}");
    let behind = pages::health(&health_at(100, 90, NOW.plus_ms(-60_000)));
    assert!(audit_box(&behind).contains("class=\"warnbox\""), "{behind}");
}

#[test]
fn the_health_page_counts_the_operations_needing_attention_and_links_to_the_worklist() {
    // Given 3 operations in needs_attention (the store's count per status)...
    let mut h = health_at(10, 10, NOW);
    h.needs_attention = 3;
    // ...when the health page is rendered, then it says so, linking to the worklist.
    let page = pages::health(&h);
    assert!(
        page.contains(
            "data-count=\"3\" href=\"/operations?status=needs_attention\">3 operation(s)</a>"
        ),
        "{page}"
    );
    assert!(page.contains("data-status=\"needs_attention\""), "{page}");
}

#[test]
fn instances_have_their_list_and_a_link_in_every_page_header() {
    // Given any page, when framed, then its header links to /instances...
    let frame = super::html::Frame {
        title: "x",
        stream: "s",
        position: 1,
        live: false,
    };
    let page = super::html::page(&frame, &Html::new());
    assert!(
        page.contains("<a href=\"/instances\">Instances</a>"),
        "{page}"
    );
    // ...and a list of instances links each one's page, with the next page's link.
    let instance = AggregateId::new(AggregateKind::Instance, Uuid::from_u128(0xabc));
    let list = pages::entity_list(
        &[(instance, "node-1".into(), "active".into())],
        Some("/instances?after=x".into()),
    );
    assert!(
        list.contains(&format!("href=\"/instances/{}\"", instance.id)),
        "{list}"
    );
    assert!(list.contains("href=\"/instances?after=x\""), "{list}");
    assert_eq!(
        super::html::list_path(AggregateKind::Instance),
        "/instances"
    );
}

/// `stopped_rollback` with a started step (key `key-3`) whose compensation the plan made
/// by that key, in `state`.
fn with_a_step_undone_by_key(state: CompensationProgress) -> OperationView {
    use provledger_events::catalogue::{Compensation, PlannedCompensation};
    use provledger_projections::view::{OutcomeUnknown, StartedStepView};
    let mut op = stopped_rollback();
    let declared = Compensation {
        action: CompensationAction::TerminateVm,
        executor: Executor::Service("hypervisor".into()),
        resource: "vm-3".into(),
        args: Default::default(),
    };
    op.started = vec![StartedStepView {
        stage: "spawn".into(),
        name: "vm-3".into(),
        executor: "hypervisor".into(),
        idempotency_key: "key-3".into(),
        compensation: Some(declared.clone()),
        state: OutcomeUnknown::OutcomeUnknown,
    }];
    let mut by_key = declared;
    by_key.args.insert("idempotency_key".into(), "key-3".into());
    if let Some(plan) = op.rollback_plan.as_mut() {
        plan.compensations = vec![PlannedCompensation {
            compensation_id: Uuid::from_u128(3),
            stage: "spawn".into(),
            step: "vm-3".into(),
            compensation: by_key,
        }];
    }
    let mut c = compensation(3, state, 1);
    c.step = "vm-3".into();
    op.compensations = vec![c];
    op.remaining.clear();
    op.status = Some(OperationStatus::RolledBack);
    op
}

/// The steps table's row of the started step `vm-3`.
fn started_row(page: &str) -> String {
    let at = page.find("<td>vm-3</td>").expect("the started step's row");
    let end = page[at..].find("</tr>").map_or(page.len(), |e| at + e);
    page[at..end].to_string()
}

#[test]
fn a_started_step_undone_by_its_key_shows_as_compensated_not_outcome_unknown() {
    // Given a fully rolled-back operation whose started step's compensation by key is done...
    let op = with_a_step_undone_by_key(CompensationProgress::Done);
    // ...when its page is rendered...
    let page = pages::operation(&op, &History::default(), NOW);
    // ...then that step shows as undone (compensated), with no outcome_unknown badge.
    let steps = &page[page.find("<h2>Steps</h2>").expect("steps")..];
    let row = started_row(steps);
    assert!(row.contains("data-status=\"compensated\""), "{row}");
    assert!(!row.contains("outcome_unknown"), "{row}");
    // While its compensation is only requested, the outcome is still unknown.
    let op = with_a_step_undone_by_key(CompensationProgress::Requested);
    let page = pages::operation(&op, &History::default(), NOW);
    let steps = &page[page.find("<h2>Steps</h2>").expect("steps")..];
    let row = started_row(steps);
    assert!(row.contains("data-status=\"outcome_unknown\""), "{row}");
    assert!(row.contains("data-status=\"requested\""), "{row}");
}

#[test]
fn the_plan_names_each_compensation_by_its_full_id_and_a_stuck_one_by_its_resolve_command() {
    // Given a rollback stopped in needs_attention with one compensation done, one of an
    // executor's failed and left, and one of the ledger's own failed and left...
    let mut op = stopped_rollback();
    let mut ledger_own = compensation(4, CompensationProgress::Failed, 5);
    ledger_own.executor = Executor::Ledger;
    op.compensations.push(ledger_own);
    op.remaining.push(Uuid::from_u128(4));
    // ...when its page is rendered...
    let page = pages::operation(&op, &History::default(), NOW);
    // ...then the plan's table shows every compensation's full id...
    for n in [1, 2, 4] {
        let id = Uuid::from_u128(n);
        assert!(
            page.contains(&format!("<code class=\"compensation-id\">{id}</code>")),
            "{id} not in {page}"
        );
    }
    // ...and the executor's stuck one has its exact `rollback resolve` command, next to
    // `rollback run`; the done one and the ledger's own (which `rollback run` applies) none.
    let resolve = format!(
        "provledger --nats $NATS_URL rollback resolve {} --compensation {} --reason &#39;…&#39;",
        op.id,
        Uuid::from_u128(2)
    );
    assert!(page.contains(&resolve), "{resolve} not in {page}");
    assert_eq!(page.matches("rollback resolve ").count(), 1, "{page}");
    let run = page.find("id=\"resume\"").expect("rollback run");
    let res = page.find("id=\"resolve\"").expect("rollback resolve");
    assert!(run < res, "{page}");
    // Once resumed (rolling back), nothing is stuck and resolve is not offered.
    op.status = Some(OperationStatus::RollingBack);
    let page = pages::operation(&op, &History::default(), NOW);
    assert!(!page.contains("rollback resolve "), "{page}");
}

#[test]
fn titles_and_links_show_the_short_id_docs_cli_names() {
    // Given an operation and a cluster with UUID v7-like ids...
    let mut op = stopped_rollback();
    op.id = "0190c0de-0000-7000-8000-71eec13912d3"
        .parse()
        .expect("a uuid");
    op.kind = Some(provledger_events::catalogue::OperationKind::CreateCluster);
    let target = AggregateId::new(
        AggregateKind::Cluster,
        "0190c0de-0000-7000-8000-0000abcdef12"
            .parse()
            .expect("a uuid"),
    );
    op.target = Some(target);
    // ...then the title and the links' labels show the last 12 hex digits
    // (provledger_events::short_id), the links' paths the full id.
    assert_eq!(
        super::operation_title(&op),
        "Operation 71eec13912d3 (create_cluster)"
    );
    let link = super::html::entity_link(&target);
    assert!(
        link.contains("<code>cluster/0000abcdef12</code>"),
        "{}",
        &*link
    );
    assert!(
        link.contains(&format!("href=\"/clusters/{}\"", target.id)),
        "{}",
        &*link
    );
    let list = pages::operations(
        &ListFilter::default(),
        None,
        std::slice::from_ref(&op),
        None,
        NOW,
    );
    assert!(
        list.contains("<code>operation/71eec13912d3</code>"),
        "{list}"
    );
}
