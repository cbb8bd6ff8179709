//! The console's pages, rendered from the projection's views and an aggregate's history.
//! Pure: what a page shows is a function of what it is given (the handlers in `mod.rs`
//! read the store and the stream), so a page can be tested without a server.

use provledger_events::{AggregateId, AggregateKind, HistoryEntry, Timestamp};
use provledger_projections::timeline;
use provledger_projections::view::{
    age, ClusterView, CompensationView, InstanceView, OperationView, ProviderView, StartedStepView,
};
use std::collections::BTreeMap;
use uuid::Uuid;

use super::html::{
    badge, entity_link, executor_name, html, operation_link, table, url_encode, word, Html,
};
use super::plan::{plan_diagram, standing};

/// The operation list's filters, as the query string gives them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ListFilter {
    pub(crate) status: Option<String>,
    pub(crate) kind: Option<String>,
    pub(crate) target: Option<String>,
    /// The page size asked for, kept by the next page's link.
    pub(crate) limit: Option<usize>,
}

impl ListFilter {
    /// The filters and page size as a query string (without the cursor), for the next
    /// page's link.
    pub(crate) fn query(&self) -> String {
        let mut parts = Vec::new();
        for (name, value) in [
            ("status", &self.status),
            ("kind", &self.kind),
            ("target", &self.target),
        ] {
            if let Some(v) = value {
                parts.push(format!("{name}={}", url_encode(v)));
            }
        }
        if let Some(limit) = self.limit {
            parts.push(format!("limit={limit}"));
        }
        parts.join("&")
    }
}

/// The statuses an operator filters on, needs_attention first.
pub(crate) const STATUSES: [&str; 8] = [
    "needs_attention",
    "running",
    "rolling_back",
    "failed",
    "held",
    "rolled_back",
    "cancelled",
    "succeeded",
];

/// What the operator types to move a stopped operation on, if anything is to be typed.
pub(crate) fn resume_command(op: &OperationView) -> Option<String> {
    let status = op.status.as_ref().map(word)?;
    let id = op.id;
    match status.as_str() {
        "needs_attention" => Some(format!("provledger --nats $NATS_URL rollback run {id}")),
        "failed" => Some(format!("provledger --nats $NATS_URL rollback run {id}")),
        "rolling_back" => Some(format!(
            "provledger --nats $NATS_URL rollback plan {id}   # serve drives it; `rollback run {id}` drives it by hand"
        )),
        _ => None,
    }
}

/// The command that records a stuck compensation as handled by hand, one per compensation
/// `rollback resolve` takes (an executor's, failed and left when the rollback stopped in
/// `needs_attention`; the ledger's own are applied by `rollback run`), in plan order: at
/// most [`super::RESOLVE_COMMANDS_SHOWN_MAX`], and how many there are in all.
pub(crate) fn resolve_commands(op: &OperationView) -> (Vec<(Uuid, String)>, usize) {
    if op.status != Some(provledger_projections::operation::OperationStatus::NeedsAttention) {
        return (Vec::new(), 0);
    }
    let id = op.id;
    let stuck: Vec<&CompensationView> = op
        .compensations
        .iter()
        .filter(|c| {
            standing(op, c) == "stuck"
                && matches!(
                    c.executor,
                    provledger_events::catalogue::Executor::Service(_)
                )
        })
        .collect();
    let shown = stuck
        .iter()
        .take(super::RESOLVE_COMMANDS_SHOWN_MAX)
        .map(|c| {
            let cid = c.compensation_id;
            (
                cid,
                format!(
                    "provledger --nats $NATS_URL rollback resolve {id} --compensation {cid} --reason '…'"
                ),
            )
        })
        .collect();
    (shown, stuck.len())
}

/// The compensation a plan made for a started step by its idempotency key (not a done
/// step's own), with where it stands, if the plan has one.
fn compensation_by_key<'a>(
    op: &'a OperationView,
    started: &StartedStepView,
) -> Option<&'a CompensationView> {
    let plan = op.rollback_plan.as_ref()?;
    let key = provledger_events::catalogue::DetailKey::IdempotencyKey.as_str();
    let planned = plan.compensations.iter().find(|p| {
        p.step == started.name
            && p.compensation.args.get(key) == Some(&started.idempotency_key)
            && !op
                .steps
                .iter()
                .any(|s| s.compensation_id == Some(p.compensation_id))
    })?;
    op.compensations
        .iter()
        .find(|c| c.compensation_id == planned.compensation_id)
}

fn compensations_summary(op: &OperationView) -> Html {
    if op.compensations.is_empty() {
        return Html::new();
    }
    let done = op
        .compensations
        .iter()
        .filter(|c| word(&c.state) == "done")
        .count();
    html!("{}/{} undone", done, op.compensations.len())
}

fn failure(op: &OperationView) -> Html {
    match &op.error {
        Some(e) => html!(
            "{}{}: {}",
            e.stage,
            e.step.as_deref().map(|s| html!(" / {}", s)),
            e.message
        ),
        None => op
            .cancellation_reason
            .as_deref()
            .map(|r| html!("cancelled: {}", r))
            .unwrap_or_default(),
    }
}

/// A time as pages show it, in a `<time>` element (its full RFC 3339 text in `datetime`).
fn time(at: Timestamp) -> Html {
    let text = at.to_rfc3339();
    html!("<time datetime=\"{}\">{}</time>", text, text)
}

/// When the operation finished (closed), else when it failed; nothing before either.
fn ended(op: &OperationView) -> Html {
    match (op.finished_at, op.failed_at) {
        (Some(at), _) => html!("finished {}", time(at)),
        (None, Some(at)) => html!("failed {}", time(at)),
        (None, None) => Html::new(),
    }
}

fn operation_rows(ops: &[OperationView], now: Timestamp) -> Vec<Vec<Html>> {
    ops.iter()
        .map(|op| {
            vec![
                operation_link(&op.id),
                Html::text(&op.kind.as_ref().map(word).unwrap_or_default()),
                op.target.as_ref().map(entity_link).unwrap_or_default(),
                op.status
                    .as_ref()
                    .map(|s| badge(&word(s)))
                    .unwrap_or_default(),
                Html::text(op.stage.as_deref().unwrap_or_default()),
                op.started_at.map(time).unwrap_or_default(),
                Html::text(&op.started_at.map(|at| age(at, now)).unwrap_or_default()),
                ended(op),
                Html::text(&op.last_commit_at.map(|at| age(at, now)).unwrap_or_default()),
                failure(op),
                compensations_summary(op),
            ]
        })
        .collect()
}

const OPERATION_HEAD: [&str; 11] = [
    "operation",
    "kind",
    "target",
    "status",
    "stage",
    "started",
    "age",
    "ended",
    "last commit",
    "failure",
    "rollback",
];

/// The operation list, newest first: a filter form, the operations that need attention
/// first (when the list is not filtered by status), then one page of the filtered list.
/// Ages (since the start, since the last commit) are counted to `now`.
pub(crate) fn operations(
    filter: &ListFilter,
    attention: Option<&[OperationView]>,
    rows: &[OperationView],
    next_before: Option<Uuid>,
    now: Timestamp,
) -> Html {
    let mut out = Html::lit(
        "<form class=\"filters\" method=\"get\" action=\"/operations\">\
<label>status<select name=\"status\"><option value=\"\">any</option>",
    );
    for s in STATUSES {
        let selected = if filter.status.as_deref() == Some(s) {
            " selected"
        } else {
            ""
        };
        out.push(html!(
            "<option value=\"{}\"{}>{}</option>",
            s,
            Html::lit(selected),
            s
        ));
    }
    out.push(html!(
        "</select></label><label>kind<input name=\"kind\" value=\"{}\" placeholder=\"create_cluster\"></label>\
<label>target<input name=\"target\" size=\"44\" value=\"{}\" placeholder=\"cluster/UUID\"></label>\
<button type=\"submit\">filter</button></form>",
        filter.kind.as_deref().unwrap_or(""),
        filter.target.as_deref().unwrap_or("")
    ));
    if let Some(attention) = attention {
        out.push(html!(
            "<h2 id=\"needs-attention\">Needs attention ({}{})</h2>",
            attention.len(),
            if attention.len() >= super::ATTENTION_SHOWN_MAX {
                "+"
            } else {
                ""
            }
        ));
        if attention.is_empty() {
            out.push(Html::lit("<p class=\"muted\">No rollback is stopped.</p>"));
        } else {
            out.push(table(
                "operations attention",
                &OPERATION_HEAD,
                &operation_rows(attention, now),
            ));
        }
        out.push(Html::lit("<h2>All operations</h2>"));
    }
    if rows.is_empty() {
        out.push(Html::lit("<p class=\"muted\">No operation matches.</p>"));
    } else {
        out.push(table(
            "operations all",
            &OPERATION_HEAD,
            &operation_rows(rows, now),
        ));
    }
    if let Some(before) = next_before {
        let query = filter.query();
        let sep = if query.is_empty() { "" } else { "&" };
        out.push(html!(
            "<p><a href=\"/operations?{}{}before={}\">older operations</a></p>",
            query,
            sep,
            before
        ));
    }
    out
}

/// One operation: what it is, where it stopped, the command to move it on, its stages,
/// the rollback plan drawn (above the steps: it is what an operator came for), its steps,
/// and its own history (the timeline). Ages are counted to `now`.
pub(crate) fn operation(op: &OperationView, history: &History, now: Timestamp) -> Html {
    let mut out = operation_summary(op, now);
    out.push(stages_section(op));
    out.push(Html::lit("<h2>Rollback plan</h2>"));
    out.push(plan_section(op));
    out.push(Html::lit("<h2>Steps</h2>"));
    out.push(steps_section(op));
    out.push(Html::lit("<h2>Timeline</h2>"));
    out.push(history_section(history));
    out
}

/// What the operation is, when it started, stopped and last changed, where it stopped,
/// and the command to move it on.
fn operation_summary(op: &OperationView, now: Timestamp) -> Html {
    let status = op.status.as_ref().map(word).unwrap_or_default();
    let mut out = html!(
        "<div class=\"box\"><p>{} {} on {} · status {} · version {}</p>",
        op.kind.as_ref().map(word).unwrap_or_default(),
        operation_link(&op.id),
        op.target.as_ref().map(entity_link),
        badge(&status),
        op.progress.version
    );
    let mut times = Vec::new();
    if let Some(at) = op.started_at {
        times.push(html!("started {} ({} ago)", time(at), age(at, now)));
    }
    let ended = ended(op);
    if !ended.is_empty() {
        times.push(ended);
    }
    if let Some(at) = op.last_commit_at {
        times.push(html!("last commit {} ({} ago)", time(at), age(at, now)));
    }
    if !times.is_empty() {
        out.push(html!("<p class=\"times\">{}</p>", Html::join(times, " · ")));
    }
    if let Some(parent) = op.parent_id {
        out.push(html!("<p>part of bundle {}</p>", operation_link(&parent)));
    }
    if !op.children.is_empty() {
        out.push(html!(
            "<p>children: {} </p>",
            Html::join(op.children.iter().map(operation_link), " ")
        ));
    }
    if op.target_deleted {
        out.push(Html::lit(
            "<p>the target is being deleted by a user: data-holding nodes are removed too</p>",
        ));
    }
    let failed = failure(op);
    if !failed.is_empty() {
        out.push(html!("<p class=\"alert\">failed in {}</p>", failed));
    }
    if let Some(cmd) = resume_command(op) {
        out.push(html!(
            "<p>To move it on: <code class=\"cmd\" id=\"resume\">{}</code></p>",
            cmd
        ));
    }
    let (resolves, stuck) = resolve_commands(op);
    if !resolves.is_empty() {
        out.push(html!(
            "<div id=\"resolve\"><p>A stuck compensation undone by hand at its executor is \
recorded with (say in <code>--reason</code> what was done: a ticket, who checked what):</p>{}{}</div>",
            Html::join(
                resolves.iter().map(|(cid, cmd)| html!(
                    "<p><code class=\"cmd resolve\" data-compensation=\"{}\">{}</code></p>",
                    cid,
                    cmd
                )),
                ""
            ),
            (stuck > resolves.len()).then(|| html!(
                "<p class=\"muted\">{} more stuck compensation(s): the plan's table names each by its full id</p>",
                stuck - resolves.len()
            ))
        ));
    }
    out.push(Html::lit("</div>"));
    out
}

/// The stages, the current one marked, each with its policy on failure.
fn stages_section(op: &OperationView) -> Html {
    let mut out = Html::lit("<h2>Stages</h2><div class=\"stages\">");
    for stage in &op.stages {
        let current = op.stage.as_deref() == Some(stage.name.as_str());
        let reached = op.steps.iter().any(|s| s.stage == stage.name)
            || op.started.iter().any(|s| s.stage == stage.name);
        out.push(html!(
            "<div class=\"stage{}\"><b>{}</b><br><span class=\"muted\">on failure: {}</span><br>{}</div>",
            if current { " current" } else { "" },
            stage.name,
            word(&stage.policy),
            if current {
                "current"
            } else if reached {
                "reached"
            } else {
                "not reached"
            }
        ));
    }
    out.push(Html::lit("</div>"));
    out
}

/// The rollback plan drawn, what it keeps on purpose, and what is still held.
fn plan_section(op: &OperationView) -> Html {
    let Some(plan) = &op.rollback_plan else {
        return Html::lit("<p class=\"muted\">No rollback plan is recorded.</p>");
    };
    let mut out = html!(
        "<div class=\"box\" id=\"plan\"><p>rule: {}</p><p>target {} ends {}</p>",
        plan.rule,
        entity_link(&plan.target),
        target_outcome(&plan.target_outcome)
    );
    if let Some(outcome) = &op.rollback_outcome {
        out.push(html!("<p>rollback ended {}</p>", badge(&word(outcome))));
    }
    out.push(plan_diagram(op));
    out.push(plan_table(op));
    if !plan.retained.is_empty() {
        out.push(Html::lit("<p>kept on purpose:</p>"));
        let rows: Vec<Vec<Html>> = plan
            .retained
            .iter()
            .map(|r| {
                vec![
                    Html::text(&r.stage),
                    Html::text(&r.step),
                    html!("<code>{}</code>", r.resource),
                    Html::text(&r.why),
                ]
            })
            .collect();
        out.push(table(
            "retained",
            &["stage", "step", "resource", "why"],
            &rows,
        ));
    }
    out.push(remaining_by_executor(&op.compensations));
    out.push(Html::lit("</div>"));
    out
}

/// The plan's compensations as a table, in the order the driver runs them (the ones
/// drawn): each with its full id, which `rollback resolve --compensation` takes.
fn plan_table(op: &OperationView) -> Html {
    let rows: Vec<Vec<Html>> = op
        .compensations
        .iter()
        .take(super::plan::PLAN_DRAWN_MAX)
        .enumerate()
        .map(|(i, c)| {
            let standing = standing(op, c);
            vec![
                html!("{}", i + 1),
                Html::text(&c.stage),
                Html::text(&c.step),
                html!("{} <code>{}</code>", word(&c.action), c.resource),
                Html::text(&executor_name(&c.executor)),
                badge(standing),
                html!("{}", c.attempts),
                html!(
                    "{}{}",
                    c.last_error.as_deref(),
                    c.resolved
                        .as_deref()
                        .map(|r| html!("resolved by hand: {}", r))
                ),
                html!(
                    "<code class=\"compensation-id\">{}</code>",
                    c.compensation_id
                ),
            ]
        })
        .collect();
    if rows.is_empty() {
        return Html::new();
    }
    table(
        "plan",
        &[
            "#",
            "stage",
            "step",
            "compensation",
            "executor",
            "standing",
            "attempts",
            "last error",
            "compensation id",
        ],
        &rows,
    )
}

/// The steps recorded, then those started whose outcome is not known.
fn steps_section(op: &OperationView) -> Html {
    let mut rows: Vec<Vec<Html>> = op
        .steps
        .iter()
        .map(|s| {
            vec![
                Html::text(&s.stage),
                Html::text(&s.name),
                html!(
                    "{} <code>{}</code> at {}",
                    word(&s.effect.kind),
                    s.effect.resource,
                    s.effect.executor
                ),
                s.compensation
                    .as_ref()
                    .map(|c| {
                        html!(
                            "{} <code>{}</code> at {}",
                            word(&c.action),
                            c.resource,
                            executor_name(&c.executor)
                        )
                    })
                    .unwrap_or_else(|| Html::lit("<span class=\"muted\">none declared</span>")),
                badge(&word(&s.state)),
            ]
        })
        .collect();
    rows.extend(op.started.iter().map(|s| {
        // Undone by its key: whatever the executor did is gone, so the outcome no longer
        // matters; until then the outcome is unknown, with where the compensation stands.
        let by_key = compensation_by_key(op, s);
        let state = match by_key.map(|c| (standing(op, c), c)) {
            Some(("done", _)) => badge("compensated"),
            Some(("resolved", _)) => badge("resolved"),
            Some((standing, c)) => html!(
                "{} compensation {} <code>{}</code>",
                badge("outcome_unknown"),
                badge(standing),
                c.compensation_id
            ),
            None => badge("outcome_unknown"),
        };
        vec![
            Html::text(&s.stage),
            Html::text(&s.name),
            html!(
                "asked of {} under key <code>{}</code>",
                s.executor,
                s.idempotency_key
            ),
            s.compensation
                .as_ref()
                .map(|c| {
                    html!(
                        "{} by key{}",
                        word(&c.action),
                        by_key.map(|c| html!(" (<code>{}</code>)", c.compensation_id))
                    )
                })
                .unwrap_or_default(),
            state,
        ]
    }));
    if rows.is_empty() {
        return Html::lit("<p class=\"muted\">No step recorded.</p>");
    }
    table(
        "steps",
        &["stage", "step", "effect", "declared compensation", "state"],
        &rows,
    )
}

fn target_outcome(outcome: &provledger_events::catalogue::TargetOutcome) -> String {
    use provledger_events::catalogue::TargetOutcome;
    match outcome {
        TargetOutcome::Error { description } => format!("in error ({description})"),
        TargetOutcome::Active { description } => format!("active ({description})"),
        TargetOutcome::Deleted => "deleted".to_string(),
    }
}

/// What is still not undone, by executor: where an operator has to look.
fn remaining_by_executor(compensations: &[CompensationView]) -> Html {
    let mut by: BTreeMap<String, Vec<&CompensationView>> = BTreeMap::new();
    for c in compensations {
        // Resolved by hand: an operator says the executor no longer holds it.
        if word(&c.state) != "done" && c.resolved.is_none() {
            by.entry(executor_name(&c.executor)).or_default().push(c);
        }
    }
    if by.is_empty() {
        return if compensations.is_empty() {
            Html::new()
        } else {
            Html::lit("<p class=\"ok\" id=\"remaining\">Nothing remains at any executor.</p>")
        };
    }
    let rows: Vec<Vec<Html>> = by
        .iter()
        .map(|(executor, cs)| {
            vec![
                Html::text(executor),
                Html::join(
                    cs.iter().map(|c| html!("<code>{}</code>", c.resource)),
                    ", ",
                ),
            ]
        })
        .collect();
    html!(
        "<div id=\"remaining\"><p>still held (not undone):</p>{}</div>",
        table("remaining", &["executor", "resources"], &rows)
    )
}

/// An aggregate's history as the console shows it: one page of entries, and the verdict
/// on the whole chain.
#[derive(Debug, Clone, Default)]
pub(crate) struct History {
    /// The page's entries, oldest first (commits and quarantined messages in place).
    pub(crate) entries: Vec<HistoryEntry>,
    /// Commits in the whole chain.
    pub(crate) commits: usize,
    /// Every violation of the whole chain (versions, hashes, links), as words.
    pub(crate) violations: Vec<(u64, String)>,
    /// Messages on the aggregate's subject that are not part of its chain.
    pub(crate) quarantined: usize,
    /// Losses in the chain no commit acknowledges yet, as words (`integrity`).
    pub(crate) lost: Vec<String>,
    /// The version of the page's first commit, when the page does not start at 1.
    pub(crate) earlier_from: Option<u64>,
    /// The version where the next page starts, when there is one.
    pub(crate) later_from: Option<u64>,
    /// The page's own path, for the paging links.
    pub(crate) path: String,
}

/// The chain verdict, then the page of entries: a broken link or a quarantined message is
/// shown in place, in red, never left out.
pub(crate) fn history_section(history: &History) -> Html {
    let mut out = chain_verdict(history);
    if let Some(from) = history.earlier_from {
        out.push(html!(
            "<p><a href=\"{}?from={}\">earlier commits</a></p>",
            history.path,
            from
        ));
    }
    out.push(Html::lit("<table class=\"history\"><thead><tr><th>version</th><th>position</th><th>recorded</th><th>actor</th><th>events</th><th>chain</th></tr></thead><tbody>"));
    for entry in &history.entries {
        let (broken, row) = history_row(history, entry);
        out.push(Html::lit(if broken {
            "<tr class=\"broken\">"
        } else {
            "<tr>"
        }));
        for cell in row {
            out.push(html!("<td>{}</td>", cell));
        }
        out.push(Html::lit("</tr>"));
    }
    out.push(Html::lit("</tbody></table>"));
    if let Some(from) = history.later_from {
        out.push(html!(
            "<p><a href=\"{}?from={}\">later commits</a></p>",
            history.path,
            from
        ));
    }
    out
}

/// Whether the whole chain holds: lost commits, or verified, or every violation and every
/// message outside the chain.
fn chain_verdict(history: &History) -> Html {
    if !history.lost.is_empty() {
        let mut out = Html::lit("<div class=\"alert\" id=\"chain\" data-chain=\"lost\"><b>integrity: commits lost from the log</b><ul>");
        for l in &history.lost {
            out.push(html!("<li>{}</li>", l));
        }
        out.push(Html::lit("</ul></div>"));
        return out;
    }
    if history.violations.is_empty() && history.quarantined == 0 {
        return html!(
            "<p class=\"ok\" id=\"chain\" data-chain=\"verified\">hash chain verified: {} commits, every link intact</p>",
            history.commits
        );
    }
    let mut out = html!(
        "<div class=\"alert\" id=\"chain\" data-chain=\"broken\"><b>hash chain broken</b>: {} violation(s), {} message(s) on the subject outside the chain<ul>",
        history.violations.len(),
        history.quarantined
    );
    for (_, v) in history.violations.iter().take(super::VIOLATIONS_SHOWN_MAX) {
        out.push(html!("<li>{}</li>", v));
    }
    for e in &history.entries {
        if let HistoryEntry::Quarantined {
            position, reason, ..
        } = e
        {
            out.push(html!("<li>position {}: {}</li>", position, reason));
        }
    }
    out.push(Html::lit("</ul></div>"));
    out
}

/// One entry's row, and whether it is shown as broken.
fn history_row(history: &History, entry: &HistoryEntry) -> (bool, Vec<Html>) {
    match entry {
        HistoryEntry::Commit(c) => {
            let broken: Vec<&str> = history
                .violations
                .iter()
                .filter(|(p, _)| *p == c.position)
                .map(|(_, v)| v.as_str())
                .collect();
            let lines = Html::join(timeline::render(c).iter().map(|l| Html::text(l)), "<br>");
            let link = if broken.is_empty() {
                html!(
                    "<span title=\"prev {}\">&#x2713; {}</span>",
                    c.prev_hash.to_string(),
                    short_hash(&c.hash.to_string())
                )
            } else {
                html!("<b>&#x2717; broken</b>: {}", broken.join("; "))
            };
            (
                !broken.is_empty(),
                vec![
                    html!("v{}", c.version),
                    html!("#{}", c.position),
                    Html::text(&c.recorded_at.to_string()),
                    Html::text(&c.actor),
                    lines,
                    link,
                ],
            )
        }
        HistoryEntry::Quarantined {
            position,
            subject,
            reason,
        } => (
            true,
            vec![
                Html::lit("—"),
                html!("#{}", position),
                Html::new(),
                Html::new(),
                html!("<code>{}</code>: not part of the chain", subject),
                html!("<b>&#x2717; quarantined</b>: {}", reason),
            ],
        ),
        HistoryEntry::Lost(l) => {
            let open = history.lost.contains(&format!("integrity: {l}"));
            (
                open,
                vec![
                    html!("v{}", l.range().to_string()),
                    html!("before #{}", l.next_position),
                    Html::new(),
                    Html::new(),
                    Html::lit("missing from the log"),
                    Html::lit(if open {
                        "<b>&#x2717; lost</b>"
                    } else {
                        "lost; acknowledged"
                    }),
                ],
            )
        }
    }
}

fn short_hash(hash: &str) -> String {
    hash.chars().take(12).collect()
}

fn in_flight(operation: Option<Uuid>, kind: Option<String>) -> Html {
    match operation {
        Some(op) => html!(
            "<p>operation in flight: {} {}</p>",
            kind.unwrap_or_default(),
            operation_link(&op)
        ),
        None => Html::lit("<p class=\"muted\">no operation in flight</p>"),
    }
}

/// A cluster: its state, node groups and their instances, the operation in flight.
pub(crate) fn cluster(c: &ClusterView, history: &History) -> Html {
    let status = c.status.as_ref().map(word).unwrap_or_default();
    let mut out = html!(
        "<div class=\"box\"><p><b>{}</b> ({}) · {} · version {}</p><p>{}</p>{}</div>",
        c.name,
        c.plugin,
        badge(&status),
        c.progress.version,
        c.status_description,
        in_flight(c.operation_id, c.operation_kind.as_ref().map(word))
    );
    out.push(Html::lit("<h2>Node groups</h2>"));
    let rows: Vec<Vec<Html>> = c
        .node_groups
        .iter()
        .map(|g| {
            vec![
                Html::text(&g.name),
                html!("{}", g.count),
                Html::text(&g.flavor),
                Html::join(
                    g.instance_ids
                        .iter()
                        .map(|i| entity_link(&AggregateId::new(AggregateKind::Instance, *i))),
                    "<br>",
                ),
            ]
        })
        .collect();
    out.push(table(
        "groups",
        &["group", "count", "flavor", "instances"],
        &rows,
    ));
    out.push(Html::lit("<h2>History</h2>"));
    out.push(history_section(history));
    out
}

/// `class=v, class=v` for a resource map.
fn resources_text(resources: &BTreeMap<String, u64>) -> String {
    resources
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// An instance: where it runs, its task and lease, its cluster and operation.
pub(crate) fn instance(i: &InstanceView, history: &History) -> Html {
    let rows = vec![
        vec![Html::lit("name"), Html::text(&i.name)],
        vec![
            Html::lit("vm state"),
            i.vm_state
                .as_ref()
                .map(|s| badge(&word(s)))
                .unwrap_or_default(),
        ],
        vec![
            Html::lit("task"),
            i.task_state
                .as_ref()
                .map(|s| badge(&word(s)))
                .unwrap_or_else(|| Html::lit("none")),
        ],
        vec![Html::lit("power"), Html::text(&word(&i.power_state))],
        vec![
            Html::lit("cluster"),
            i.cluster_id
                .map(|c| entity_link(&AggregateId::new(AggregateKind::Cluster, c)))
                .unwrap_or_default(),
        ],
        vec![
            Html::lit("host"),
            Html::text(i.host.as_deref().unwrap_or("")),
        ],
        vec![
            Html::lit("provider"),
            i.provider_id
                .map(|p| entity_link(&AggregateId::new(AggregateKind::Provider, p)))
                .unwrap_or_default(),
        ],
        vec![
            Html::lit("resources"),
            Html::text(&resources_text(&i.resources)),
        ],
        vec![
            Html::lit("task lease"),
            match (&i.task_worker, &i.task_lease_until) {
                (Some(w), Some(until)) => html!("{} until {}", w, until.to_string()),
                _ => Html::lit("none"),
            },
        ],
        vec![
            Html::lit("delete requested"),
            Html::lit(if i.delete_requested { "true" } else { "false" }),
        ],
        vec![Html::lit("version"), html!("{}", i.progress.version)],
    ];
    let mut out = table("fields", &["", ""], &rows);
    out.push(in_flight(i.operation_id, None));
    out.push(Html::lit("<h2>History</h2>"));
    out.push(history_section(history));
    out
}

/// A provider: capacity against usage per resource class, and who holds what.
pub(crate) fn provider(p: &ProviderView, history: &History) -> Html {
    let status = p.status.as_ref().map(word).unwrap_or_default();
    let mut out = html!(
        "<div class=\"box\"><p><b>{}</b> on host <code>{}</code> · {} · version {}</p></div>",
        p.name,
        p.host,
        badge(&status),
        p.progress.version
    );
    out.push(Html::lit("<h2>Allocations against capacity</h2>"));
    out.push(capacity_table(p));
    let rows: Vec<Vec<Html>> = p
        .allocations
        .iter()
        .take(super::ALLOCATIONS_SHOWN_MAX)
        .map(|a| {
            let kind = word(&a.consumer_kind);
            let consumer = match kind.as_str() {
                "instance" => entity_link(&AggregateId::new(AggregateKind::Instance, a.consumer)),
                "operation" => operation_link(&a.consumer),
                _ => html!("<code>{}</code>", a.consumer),
            };
            vec![
                consumer,
                Html::text(&kind),
                Html::text(&resources_text(&a.resources)),
            ]
        })
        .collect();
    out.push(html!(
        "<h2>Allocations ({}{})</h2>",
        p.allocations.len(),
        (p.allocations.len() > super::ALLOCATIONS_SHOWN_MAX)
            .then(|| html!(", first {} shown", super::ALLOCATIONS_SHOWN_MAX))
    ));
    if rows.is_empty() {
        out.push(Html::lit("<p class=\"muted\">none</p>"));
    } else {
        out.push(table(
            "allocations",
            &["consumer", "kind", "resources"],
            &rows,
        ));
    }
    out.push(Html::lit("<h2>History</h2>"));
    out.push(history_section(history));
    out
}

/// Usage against capacity per resource class, as bars.
fn capacity_table(p: &ProviderView) -> Html {
    let classes: std::collections::BTreeSet<&String> =
        p.capacity.keys().chain(p.usage.keys()).collect();
    let rows: Vec<Vec<Html>> = classes
        .into_iter()
        .map(|class| {
            let capacity = p.capacity.get(class).copied().unwrap_or(0);
            let used = p.usage.get(class).copied().unwrap_or(0);
            // No capacity at all reads as full.
            let pct = used
                .saturating_mul(100)
                .checked_div(capacity)
                .map_or(100, |p| p.min(100));
            let over = used > capacity;
            vec![
                Html::text(class),
                html!("{}", used),
                html!("{}", capacity),
                html!(
                    "<span class=\"bar\"><span class=\"{}\" style=\"width:{}%\"></span></span> {}",
                    if over { "over" } else { "" },
                    pct,
                    if over { "over capacity" } else { "" }
                ),
            ]
        })
        .collect();
    table(
        "capacity",
        &[
            "resource class",
            "used",
            "capacity (after allocation ratio)",
            "",
        ],
        &rows,
    )
}

/// A list of clusters, instances or providers: one link per entity with its status.
pub(crate) fn entity_list(rows: &[(AggregateId, String, String)], next: Option<String>) -> Html {
    let mut out = Html::new();
    if rows.is_empty() {
        out.push(Html::lit("<p class=\"muted\">None yet.</p>"));
    }
    let rows: Vec<Vec<Html>> = rows
        .iter()
        .map(|(id, name, status)| vec![entity_link(id), Html::text(name), badge(status)])
        .collect();
    if !rows.is_empty() {
        out.push(table("entities", &["id", "name", "status"], &rows));
    }
    if let Some(next) = next {
        out.push(html!("<p><a href=\"{}\">next page</a></p>", next));
    }
    out
}

/// What the health page shows.
pub(crate) struct HealthView {
    pub(crate) ready: bool,
    pub(crate) reason: Option<String>,
    pub(crate) position: u64,
    pub(crate) end: Option<u64>,
    pub(crate) caught_up_to: Option<u64>,
    pub(crate) nats_connected: bool,
    pub(crate) quarantined: Vec<(u64, String, String)>,
    pub(crate) quarantined_total: usize,
    pub(crate) audit: Option<crate::replica::LastAudit>,
    pub(crate) audit_failed: Option<(provledger_events::Timestamp, String)>,
    pub(crate) audit_interval: Option<std::time::Duration>,
    /// Operations in `needs_attention`, from the projector's counts per status.
    pub(crate) needs_attention: u64,
    /// The time ages are counted to.
    pub(crate) now: Timestamp,
}

/// How the last audit stands against what the replica has applied now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AuditFreshness {
    /// It read everything applied now.
    Current,
    /// Commits were applied since; the next audit, not yet due, reads them.
    Behind,
    /// Overdue ([`super::AUDIT_OVERDUE_INTERVALS`] intervals since it finished), or it
    /// read less than [`super::AUDIT_COVERED_MIN_PERCENT`]% of the positions applied now
    /// (it ran against a much smaller log, such as the empty one at start).
    Stale,
}

impl AuditFreshness {
    fn word(self) -> &'static str {
        match self {
            AuditFreshness::Current => "current",
            AuditFreshness::Behind => "behind",
            AuditFreshness::Stale => "stale",
        }
    }
}

/// Whether `audit` still says something about the log as applied now (at `position`,
/// at `now`, with audits every `interval`). Pure.
pub(crate) fn audit_freshness(
    audit: &crate::replica::LastAudit,
    position: u64,
    now: Timestamp,
    interval: Option<std::time::Duration>,
) -> AuditFreshness {
    let age_ms =
        u128::try_from(now.unix_ms().saturating_sub(audit.finished_at.unix_ms())).unwrap_or(0);
    let overdue = interval.is_some_and(|i| {
        age_ms
            > i.as_millis()
                .saturating_mul(u128::from(super::AUDIT_OVERDUE_INTERVALS))
    });
    let covered_too_little = u128::from(audit.position) * 100
        < u128::from(position) * u128::from(super::AUDIT_COVERED_MIN_PERCENT);
    if overdue || covered_too_little {
        AuditFreshness::Stale
    } else if audit.position >= position {
        AuditFreshness::Current
    } else {
        AuditFreshness::Behind
    }
}

pub(crate) fn health(h: &HealthView) -> Html {
    let lag = h.end.map(|e| e.saturating_sub(h.position));
    let rows = vec![
        vec![
            Html::lit("ready"),
            if h.ready {
                badge("ready")
            } else {
                html!(
                    "{} {}",
                    badge("not_ready"),
                    h.reason.as_deref().unwrap_or("")
                )
            },
        ],
        vec![Html::lit("position applied"), html!("{}", h.position)],
        vec![
            Html::lit("stream end"),
            h.end
                .map_or(Html::lit("cannot be read"), |e| html!("{}", e)),
        ],
        vec![
            Html::lit("lag"),
            lag.map_or(Html::lit("unknown"), |l| html!("{} positions", l)),
        ],
        vec![
            Html::lit("caught up at start to"),
            h.caught_up_to
                .map_or(Html::lit("not yet"), |p| html!("{}", p)),
        ],
        vec![
            Html::lit("NATS"),
            Html::lit(if h.nats_connected {
                "connected"
            } else {
                "disconnected"
            }),
        ],
        vec![
            Html::lit("quarantined entries"),
            html!("{}", h.quarantined_total),
        ],
        vec![
            Html::lit("operations needing attention"),
            html!(
                "<a id=\"needs-attention-count\" data-count=\"{}\" href=\"/operations?status=needs_attention\">{} operation(s)</a>{}",
                h.needs_attention,
                h.needs_attention,
                (h.needs_attention > 0).then(|| html!(
                    " {} their rollback stopped: the worklist says what to do",
                    badge("needs_attention")
                ))
            ),
        ],
    ];
    let mut out = table("fields", &["", ""], &rows);
    out.push(Html::lit("<h2>Last audit</h2>"));
    out.push(last_audit(h));
    out.push(Html::lit("<h2>Quarantine</h2>"));
    if h.quarantined.is_empty() {
        out.push(Html::lit("<p class=\"muted\">Nothing quarantined.</p>"));
    } else {
        let rows: Vec<Vec<Html>> = h
            .quarantined
            .iter()
            .map(|(p, s, r)| vec![html!("#{}", p), html!("<code>{}</code>", s), Html::text(r)])
            .collect();
        out.push(table(
            "quarantine",
            &["position", "subject", "reason"],
            &rows,
        ));
    }
    out
}

/// The replica's last audit, or why there is none.
fn last_audit(h: &HealthView) -> Html {
    let mut out = Html::new();
    if let Some((at, why)) = &h.audit_failed {
        out.push(html!(
            "<p class=\"alert\" id=\"audit-failed\">the audit of {} could not run: {}</p>",
            at.to_string(),
            why
        ));
    }
    let Some(a) = &h.audit else {
        out.push(html!(
            "<p class=\"muted\" id=\"audit\">{}</p>",
            match h.audit_interval {
                Some(i) => format!(
                    "no audit has finished yet on this replica (one runs every {} s)",
                    i.as_secs()
                ),
                None => "this replica runs no audit (`serve --audit-interval`); run `provledger audit --nats URL` by hand".into(),
            }
        ));
        return out;
    };
    let freshness = audit_freshness(a, h.position, h.now, h.audit_interval);
    let class = match (a.violations, freshness) {
        (0, AuditFreshness::Current) => "ok",
        (0, AuditFreshness::Behind) => "warnbox",
        _ => "alert",
    };
    let since = h.position.saturating_sub(a.position);
    out.push(html!(
        "<div class=\"{}\" id=\"audit\" data-freshness=\"{}\">{}finished {} ({} ago) in {} ms: {} commits read up to position {}; position applied now {} ({} position(s) since); {} violation(s)",
        class,
        freshness.word(),
        (freshness == AuditFreshness::Stale).then(|| Html::lit("<b>stale</b>: ")),
        time(a.finished_at),
        age(a.finished_at, h.now),
        a.took_ms,
        a.commits,
        a.position,
        h.position,
        since,
        a.violations
    ));
    match freshness {
        AuditFreshness::Current => {}
        AuditFreshness::Behind => out.push(Html::lit(
            "<p>what was applied since is not audited yet; the next audit reads it</p>",
        )),
        AuditFreshness::Stale => out.push(html!(
            "<p>what was applied since is not audited, and this result says nothing about it. \
Run <code class=\"cmd\">provledger --nats $NATS_URL audit</code> now, and check this \
replica's audit loop (<code>serve --audit-interval</code>{}; its log says why an audit did not run).</p>",
            h.audit_interval
                .map(|i| html!(", every {} s here", i.as_secs()))
        )),
    }
    if !a.first.is_empty() {
        out.push(Html::lit("<ul>"));
        for v in &a.first {
            out.push(html!("<li>{}</li>", v));
        }
        out.push(Html::lit("</ul>"));
    }
    out.push(Html::lit("</div>"));
    out
}
