//! The console's pages, rendered from the projection's views and an aggregate's history.
//! Pure: what a page shows is a function of what it is given (the handlers in `mod.rs`
//! read the store and the stream), so a page can be tested without a server.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use provledger_events::{AggregateId, AggregateKind, HistoryEntry};
use provledger_projections::timeline;
use provledger_projections::view::{
    ClusterView, CompensationView, InstanceView, OperationView, ProviderView,
};
use uuid::Uuid;

use super::html::{badge, entity_link, esc, operation_link, table, word};
use super::plan::plan_diagram;

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

/// Percent-encodes a query value (letters, digits and `-_.~/` kept).
pub(crate) fn url_encode(value: &str) -> String {
    let mut out = String::new();
    for b in value.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(b as char)
            }
            b => {
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
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

fn compensations_summary(op: &OperationView) -> String {
    if op.compensations.is_empty() {
        return String::new();
    }
    let done = op
        .compensations
        .iter()
        .filter(|c| word(&c.state) == "done")
        .count();
    format!("{done}/{} undone", op.compensations.len())
}

fn failure(op: &OperationView) -> String {
    match &op.error {
        Some(e) => format!(
            "{}{}: {}",
            esc(&e.stage),
            e.step
                .as_deref()
                .map(|s| format!(" / {}", esc(s)))
                .unwrap_or_default(),
            esc(&e.message)
        ),
        None => op
            .cancellation_reason
            .as_deref()
            .map(|r| format!("cancelled: {}", esc(r)))
            .unwrap_or_default(),
    }
}

fn operation_rows(ops: &[OperationView]) -> Vec<Vec<String>> {
    ops.iter()
        .map(|op| {
            vec![
                operation_link(&op.id),
                op.kind.as_ref().map(|k| esc(&word(k))).unwrap_or_default(),
                op.target.as_ref().map(entity_link).unwrap_or_default(),
                op.status
                    .as_ref()
                    .map(|s| badge(&word(s)))
                    .unwrap_or_default(),
                op.stage.as_deref().map(esc).unwrap_or_default(),
                failure(op),
                compensations_summary(op),
            ]
        })
        .collect()
}

const OPERATION_HEAD: [&str; 7] = [
    "operation",
    "kind",
    "target",
    "status",
    "stage",
    "failure",
    "rollback",
];

/// The operation list, newest first: a filter form, the operations that need attention
/// first (when the list is not filtered by status), then one page of the filtered list.
pub(crate) fn operations(
    filter: &ListFilter,
    attention: Option<&[OperationView]>,
    rows: &[OperationView],
    next_before: Option<Uuid>,
) -> String {
    let mut out = String::new();
    out.push_str("<form class=\"filters\" method=\"get\" action=\"/operations\">");
    out.push_str("<label>status<select name=\"status\"><option value=\"\">any</option>");
    for s in STATUSES {
        let selected = if filter.status.as_deref() == Some(s) {
            " selected"
        } else {
            ""
        };
        let _ = write!(out, "<option value=\"{s}\"{selected}>{s}</option>");
    }
    let _ = write!(
        out,
        "</select></label><label>kind<input name=\"kind\" value=\"{}\" placeholder=\"create_cluster\"></label>\
<label>target<input name=\"target\" size=\"44\" value=\"{}\" placeholder=\"cluster/UUID\"></label>\
<button type=\"submit\">filter</button></form>",
        esc(filter.kind.as_deref().unwrap_or("")),
        esc(filter.target.as_deref().unwrap_or(""))
    );
    if let Some(attention) = attention {
        let _ = write!(
            out,
            "<h2 id=\"needs-attention\">Needs attention ({}{})</h2>",
            attention.len(),
            if attention.len() >= super::ATTENTION_SHOWN_MAX {
                "+"
            } else {
                ""
            }
        );
        if attention.is_empty() {
            out.push_str("<p class=\"muted\">No rollback is stopped.</p>");
        } else {
            out.push_str(&table(
                "operations attention",
                &OPERATION_HEAD,
                &operation_rows(attention),
            ));
        }
        out.push_str("<h2>All operations</h2>");
    }
    if rows.is_empty() {
        out.push_str("<p class=\"muted\">No operation matches.</p>");
    } else {
        out.push_str(&table(
            "operations all",
            &OPERATION_HEAD,
            &operation_rows(rows),
        ));
    }
    if let Some(before) = next_before {
        let query = filter.query();
        let sep = if query.is_empty() { "" } else { "&" };
        let _ = write!(
            out,
            "<p><a href=\"/operations?{query}{sep}before={before}\">older operations</a></p>"
        );
    }
    out
}

/// One operation: what it is, where it stopped, the command to move it on, its stages,
/// the rollback plan drawn (above the steps: it is what an operator came for), its steps,
/// and its own history (the timeline).
pub(crate) fn operation(op: &OperationView, history: &History) -> String {
    let mut out = String::new();
    let status = op.status.as_ref().map(word).unwrap_or_default();
    let _ = write!(
        out,
        "<div class=\"box\"><p>{} {} on {} · status {} · version {}</p>",
        esc(&op.kind.as_ref().map(word).unwrap_or_default()),
        operation_link(&op.id),
        op.target.as_ref().map(entity_link).unwrap_or_default(),
        badge(&status),
        op.progress.version
    );
    if let Some(parent) = op.parent_id {
        let _ = write!(out, "<p>part of bundle {}</p>", operation_link(&parent));
    }
    if !op.children.is_empty() {
        out.push_str("<p>children: ");
        for c in &op.children {
            let _ = write!(out, "{} ", operation_link(c));
        }
        out.push_str("</p>");
    }
    if op.target_deleted {
        out.push_str(
            "<p>the target is being deleted by a user: data-holding nodes are removed too</p>",
        );
    }
    let failed = failure(op);
    if !failed.is_empty() {
        let _ = write!(out, "<p class=\"alert\">failed in {failed}</p>");
    }
    if let Some(cmd) = resume_command(op) {
        let _ = write!(
            out,
            "<p>To move it on: <code class=\"cmd\" id=\"resume\">{}</code></p>",
            esc(&cmd)
        );
    }
    out.push_str("</div>");

    out.push_str("<h2>Stages</h2><div class=\"stages\">");
    for stage in &op.stages {
        let current = op.stage.as_deref() == Some(stage.name.as_str());
        let reached = op.steps.iter().any(|s| s.stage == stage.name)
            || op.started.iter().any(|s| s.stage == stage.name);
        let _ = write!(
            out,
            "<div class=\"stage{}\"><b>{}</b><br><span class=\"muted\">on failure: {}</span><br>{}</div>",
            if current { " current" } else { "" },
            esc(&stage.name),
            esc(&word(&stage.policy)),
            if current {
                "current"
            } else if reached {
                "reached"
            } else {
                "not reached"
            }
        );
    }
    out.push_str("</div>");

    out.push_str("<h2>Rollback plan</h2>");
    match &op.rollback_plan {
        None => out.push_str("<p class=\"muted\">No rollback plan is recorded.</p>"),
        Some(plan) => {
            let _ = write!(
                out,
                "<div class=\"box\" id=\"plan\"><p>rule: {}</p><p>target {} ends {}</p>",
                esc(&plan.rule),
                entity_link(&plan.target),
                esc(&target_outcome(&plan.target_outcome))
            );
            if let Some(outcome) = &op.rollback_outcome {
                let _ = write!(out, "<p>rollback ended {}</p>", badge(&word(outcome)));
            }
            out.push_str(&plan_diagram(op));
            if !plan.retained.is_empty() {
                out.push_str("<p>kept on purpose:</p>");
                let rows: Vec<Vec<String>> = plan
                    .retained
                    .iter()
                    .map(|r| {
                        vec![
                            esc(&r.stage),
                            esc(&r.step),
                            format!("<code>{}</code>", esc(&r.resource)),
                            esc(&r.why),
                        ]
                    })
                    .collect();
                out.push_str(&table(
                    "retained",
                    &["stage", "step", "resource", "why"],
                    &rows,
                ));
            }
            out.push_str(&remaining_by_executor(&op.compensations));
            out.push_str("</div>");
        }
    }
    out.push_str("<h2>Steps</h2>");
    let mut rows: Vec<Vec<String>> = op
        .steps
        .iter()
        .map(|s| {
            vec![
                esc(&s.stage),
                esc(&s.name),
                format!(
                    "{} <code>{}</code> at {}",
                    esc(&word(&s.effect.kind)),
                    esc(&s.effect.resource),
                    esc(&s.effect.executor)
                ),
                s.compensation
                    .as_ref()
                    .map(|c| {
                        format!(
                            "{} <code>{}</code> at {}",
                            esc(&word(&c.action)),
                            esc(&c.resource),
                            esc(&executor_name(&c.executor))
                        )
                    })
                    .unwrap_or_else(|| "<span class=\"muted\">none declared</span>".into()),
                badge(&word(&s.state)),
            ]
        })
        .collect();
    rows.extend(op.started.iter().map(|s| {
        vec![
            esc(&s.stage),
            esc(&s.name),
            format!(
                "asked of {} under key <code>{}</code>",
                esc(&s.executor),
                esc(&s.idempotency_key)
            ),
            s.compensation
                .as_ref()
                .map(|c| format!("{} by key", esc(&word(&c.action))))
                .unwrap_or_default(),
            badge("outcome_unknown"),
        ]
    }));
    if rows.is_empty() {
        out.push_str("<p class=\"muted\">No step recorded.</p>");
    } else {
        out.push_str(&table(
            "steps",
            &["stage", "step", "effect", "declared compensation", "state"],
            &rows,
        ));
    }

    out.push_str("<h2>Timeline</h2>");
    out.push_str(&history_section(history));
    out
}

fn target_outcome(outcome: &provledger_events::catalogue::TargetOutcome) -> String {
    use provledger_events::catalogue::TargetOutcome;
    match outcome {
        TargetOutcome::Error { description } => format!("in error ({description})"),
        TargetOutcome::Active { description } => format!("active ({description})"),
        TargetOutcome::Deleted => "deleted".to_string(),
    }
}

/// An executor's name: `ledger` or the service's.
pub(crate) fn executor_name(executor: &provledger_events::catalogue::Executor) -> String {
    match executor {
        provledger_events::catalogue::Executor::Ledger => "ledger".to_string(),
        provledger_events::catalogue::Executor::Service(name) => name.clone(),
    }
}

/// What is still not undone, by executor: where an operator has to look.
fn remaining_by_executor(compensations: &[CompensationView]) -> String {
    let mut by: BTreeMap<String, Vec<&CompensationView>> = BTreeMap::new();
    for c in compensations {
        // Resolved by hand: an operator says the executor no longer holds it.
        if word(&c.state) != "done" && c.resolved.is_none() {
            by.entry(executor_name(&c.executor)).or_default().push(c);
        }
    }
    if by.is_empty() {
        return if compensations.is_empty() {
            String::new()
        } else {
            "<p class=\"ok\" id=\"remaining\">Nothing remains at any executor.</p>".into()
        };
    }
    let rows: Vec<Vec<String>> = by
        .iter()
        .map(|(executor, cs)| {
            vec![
                esc(executor),
                cs.iter()
                    .map(|c| format!("<code>{}</code>", esc(&c.resource)))
                    .collect::<Vec<_>>()
                    .join(", "),
            ]
        })
        .collect();
    format!(
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
pub(crate) fn history_section(history: &History) -> String {
    let mut out = String::new();
    if !history.lost.is_empty() {
        out.push_str("<div class=\"alert\" id=\"chain\" data-chain=\"lost\"><b>integrity: commits lost from the log</b><ul>");
        for l in &history.lost {
            let _ = write!(out, "<li>{}</li>", esc(l));
        }
        out.push_str("</ul></div>");
    } else if history.violations.is_empty() && history.quarantined == 0 {
        let _ = write!(
            out,
            "<p class=\"ok\" id=\"chain\" data-chain=\"verified\">hash chain verified: {} commits, every link intact</p>",
            history.commits
        );
    } else {
        let _ = write!(
            out,
            "<div class=\"alert\" id=\"chain\" data-chain=\"broken\"><b>hash chain broken</b>: {} violation(s), {} message(s) on the subject outside the chain<ul>",
            history.violations.len(),
            history.quarantined
        );
        for (_, v) in history.violations.iter().take(super::VIOLATIONS_SHOWN_MAX) {
            let _ = write!(out, "<li>{}</li>", esc(v));
        }
        for e in &history.entries {
            if let HistoryEntry::Quarantined {
                position, reason, ..
            } = e
            {
                let _ = write!(out, "<li>position {position}: {}</li>", esc(reason));
            }
        }
        out.push_str("</ul></div>");
    }
    if let Some(from) = history.earlier_from {
        let _ = write!(
            out,
            "<p><a href=\"{}?from={from}\">earlier commits</a></p>",
            history.path
        );
    }
    let rows: Vec<(bool, Vec<String>)> = history
        .entries
        .iter()
        .map(|e| match e {
            HistoryEntry::Commit(c) => {
                let broken: Vec<&str> = history
                    .violations
                    .iter()
                    .filter(|(p, _)| *p == c.position)
                    .map(|(_, v)| v.as_str())
                    .collect();
                let lines = timeline::render(c)
                    .iter()
                    .map(|l| esc(l))
                    .collect::<Vec<_>>()
                    .join("<br>");
                let link = if broken.is_empty() {
                    format!(
                        "<span title=\"prev {}\">&#x2713; {}</span>",
                        esc(&c.prev_hash.to_string()),
                        esc(&short_hash(&c.hash.to_string()))
                    )
                } else {
                    format!("<b>&#x2717; broken</b>: {}", esc(&broken.join("; ")))
                };
                (
                    !broken.is_empty(),
                    vec![
                        format!("v{}", c.version),
                        format!("#{}", c.position),
                        esc(&c.recorded_at.to_string()),
                        esc(&c.actor),
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
                    "—".into(),
                    format!("#{position}"),
                    String::new(),
                    String::new(),
                    format!("<code>{}</code>: not part of the chain", esc(subject)),
                    format!("<b>&#x2717; quarantined</b>: {}", esc(reason)),
                ],
            ),
            HistoryEntry::Lost(l) => {
                let open = history.lost.contains(&format!("integrity: {l}"));
                (
                    open,
                    vec![
                        format!("v{}", l.range()),
                        format!("before #{}", l.next_position),
                        String::new(),
                        String::new(),
                        "missing from the log".into(),
                        if open {
                            "<b>&#x2717; lost</b>".into()
                        } else {
                            "lost; acknowledged".into()
                        },
                    ],
                )
            }
        })
        .collect();
    out.push_str("<table class=\"history\"><thead><tr><th>version</th><th>position</th><th>recorded</th><th>actor</th><th>events</th><th>chain</th></tr></thead><tbody>");
    for (broken, row) in rows {
        out.push_str(if broken {
            "<tr class=\"broken\">"
        } else {
            "<tr>"
        });
        for cell in row {
            let _ = write!(out, "<td>{cell}</td>");
        }
        out.push_str("</tr>");
    }
    out.push_str("</tbody></table>");
    if let Some(from) = history.later_from {
        let _ = write!(
            out,
            "<p><a href=\"{}?from={from}\">later commits</a></p>",
            history.path
        );
    }
    out
}

fn short_hash(hash: &str) -> String {
    hash.chars().take(12).collect()
}

fn in_flight(operation: Option<Uuid>, kind: Option<String>) -> String {
    match operation {
        Some(op) => format!(
            "<p>operation in flight: {} {}</p>",
            esc(&kind.unwrap_or_default()),
            operation_link(&op)
        ),
        None => "<p class=\"muted\">no operation in flight</p>".into(),
    }
}

/// A cluster: its state, node groups and their instances, the operation in flight.
pub(crate) fn cluster(c: &ClusterView, history: &History) -> String {
    let mut out = String::new();
    let status = c.status.as_ref().map(word).unwrap_or_default();
    let _ = write!(
        out,
        "<div class=\"box\"><p><b>{}</b> ({}) · {} · version {}</p><p>{}</p>{}</div>",
        esc(&c.name),
        esc(&c.plugin),
        badge(&status),
        c.progress.version,
        esc(&c.status_description),
        in_flight(c.operation_id, c.operation_kind.as_ref().map(word))
    );
    out.push_str("<h2>Node groups</h2>");
    let rows: Vec<Vec<String>> = c
        .node_groups
        .iter()
        .map(|g| {
            vec![
                esc(&g.name),
                g.count.to_string(),
                esc(&g.flavor),
                g.instance_ids
                    .iter()
                    .map(|i| entity_link(&AggregateId::new(AggregateKind::Instance, *i)))
                    .collect::<Vec<_>>()
                    .join("<br>"),
            ]
        })
        .collect();
    out.push_str(&table(
        "groups",
        &["group", "count", "flavor", "instances"],
        &rows,
    ));
    out.push_str("<h2>History</h2>");
    out.push_str(&history_section(history));
    out
}

/// An instance: where it runs, its task and lease, its cluster and operation.
pub(crate) fn instance(i: &InstanceView, history: &History) -> String {
    let mut out = String::new();
    let rows = vec![
        vec!["name".into(), esc(&i.name)],
        vec![
            "vm state".into(),
            i.vm_state
                .as_ref()
                .map(|s| badge(&word(s)))
                .unwrap_or_default(),
        ],
        vec![
            "task".into(),
            i.task_state
                .as_ref()
                .map(|s| badge(&word(s)))
                .unwrap_or_else(|| "none".into()),
        ],
        vec!["power".into(), esc(&word(&i.power_state))],
        vec![
            "cluster".into(),
            i.cluster_id
                .map(|c| entity_link(&AggregateId::new(AggregateKind::Cluster, c)))
                .unwrap_or_default(),
        ],
        vec!["host".into(), esc(i.host.as_deref().unwrap_or(""))],
        vec![
            "provider".into(),
            i.provider_id
                .map(|p| entity_link(&AggregateId::new(AggregateKind::Provider, p)))
                .unwrap_or_default(),
        ],
        vec![
            "resources".into(),
            esc(&i
                .resources
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", ")),
        ],
        vec![
            "task lease".into(),
            match (&i.task_worker, &i.task_lease_until) {
                (Some(w), Some(until)) => format!("{} until {}", esc(w), esc(&until.to_string())),
                _ => "none".into(),
            },
        ],
        vec!["delete requested".into(), i.delete_requested.to_string()],
        vec!["version".into(), i.progress.version.to_string()],
    ];
    out.push_str(&table("fields", &["", ""], &rows));
    out.push_str(&in_flight(i.operation_id, None));
    out.push_str("<h2>History</h2>");
    out.push_str(&history_section(history));
    out
}

/// A provider: capacity against usage per resource class, and who holds what.
pub(crate) fn provider(p: &ProviderView, history: &History) -> String {
    let mut out = String::new();
    let status = p.status.as_ref().map(word).unwrap_or_default();
    let _ = write!(
        out,
        "<div class=\"box\"><p><b>{}</b> on host <code>{}</code> · {} · version {}</p></div>",
        esc(&p.name),
        esc(&p.host),
        badge(&status),
        p.progress.version
    );
    out.push_str("<h2>Allocations against capacity</h2>");
    let classes: std::collections::BTreeSet<&String> =
        p.capacity.keys().chain(p.usage.keys()).collect();
    let rows: Vec<Vec<String>> = classes
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
                esc(class),
                used.to_string(),
                capacity.to_string(),
                format!(
                    "<span class=\"bar\"><span class=\"{}\" style=\"width:{pct}%\"></span></span> {}",
                    if over { "over" } else { "" },
                    if over { "over capacity" } else { "" }
                ),
            ]
        })
        .collect();
    out.push_str(&table(
        "capacity",
        &[
            "resource class",
            "used",
            "capacity (after allocation ratio)",
            "",
        ],
        &rows,
    ));
    let rows: Vec<Vec<String>> = p
        .allocations
        .iter()
        .take(super::ALLOCATIONS_SHOWN_MAX)
        .map(|a| {
            let kind = word(&a.consumer_kind);
            let consumer = match kind.as_str() {
                "instance" => entity_link(&AggregateId::new(AggregateKind::Instance, a.consumer)),
                "operation" => operation_link(&a.consumer),
                _ => format!("<code>{}</code>", a.consumer),
            };
            vec![
                consumer,
                esc(&kind),
                esc(&a
                    .resources
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", ")),
            ]
        })
        .collect();
    let _ = write!(
        out,
        "<h2>Allocations ({}{})</h2>",
        p.allocations.len(),
        if p.allocations.len() > super::ALLOCATIONS_SHOWN_MAX {
            format!(", first {} shown", super::ALLOCATIONS_SHOWN_MAX)
        } else {
            String::new()
        }
    );
    if rows.is_empty() {
        out.push_str("<p class=\"muted\">none</p>");
    } else {
        out.push_str(&table(
            "allocations",
            &["consumer", "kind", "resources"],
            &rows,
        ));
    }
    out.push_str("<h2>History</h2>");
    out.push_str(&history_section(history));
    out
}

/// A list of clusters or providers: one link per entity with its status.
pub(crate) fn entity_list(rows: &[(AggregateId, String, String)], next: Option<String>) -> String {
    let mut out = String::new();
    if rows.is_empty() {
        out.push_str("<p class=\"muted\">None yet.</p>");
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|(id, name, status)| vec![entity_link(id), esc(name), badge(status)])
        .collect();
    if !rows.is_empty() {
        out.push_str(&table("entities", &["id", "name", "status"], &rows));
    }
    if let Some(next) = next {
        let _ = write!(out, "<p><a href=\"{next}\">next page</a></p>");
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
    pub(crate) audit: Option<crate::audit::LastAudit>,
    pub(crate) audit_failed: Option<(provledger_events::Timestamp, String)>,
    pub(crate) audit_interval: Option<std::time::Duration>,
}

pub(crate) fn health(h: &HealthView) -> String {
    let mut out = String::new();
    let lag = h.end.map(|e| e.saturating_sub(h.position));
    let rows = vec![
        vec![
            "ready".into(),
            if h.ready {
                badge("ready")
            } else {
                format!(
                    "{} {}",
                    badge("not_ready"),
                    esc(h.reason.as_deref().unwrap_or(""))
                )
            },
        ],
        vec!["position applied".into(), h.position.to_string()],
        vec![
            "stream end".into(),
            h.end.map_or("cannot be read".into(), |e| e.to_string()),
        ],
        vec![
            "lag".into(),
            lag.map_or("unknown".into(), |l| format!("{l} positions")),
        ],
        vec![
            "caught up at start to".into(),
            h.caught_up_to.map_or("not yet".into(), |p| p.to_string()),
        ],
        vec![
            "NATS".into(),
            if h.nats_connected {
                "connected".into()
            } else {
                "disconnected".into()
            },
        ],
        vec![
            "quarantined entries".into(),
            h.quarantined_total.to_string(),
        ],
    ];
    out.push_str(&table("fields", &["", ""], &rows));
    out.push_str("<h2>Last audit</h2>");
    if let Some((at, why)) = &h.audit_failed {
        let _ = write!(
            out,
            "<p class=\"alert\" id=\"audit-failed\">the audit of {} could not run: {}</p>",
            esc(&at.to_string()),
            esc(why)
        );
    }
    match &h.audit {
        None => {
            let _ = write!(
                out,
                "<p class=\"muted\" id=\"audit\">{}</p>",
                match h.audit_interval {
                    Some(i) => format!(
                        "no audit has finished yet on this replica (one runs every {} s)",
                        i.as_secs()
                    ),
                    None => "this replica runs no audit (`serve --audit-interval`); run `provledger audit --nats URL` by hand".into(),
                }
            );
        }
        Some(a) => {
            let class = if a.violations == 0 { "ok" } else { "alert" };
            let _ = write!(
                out,
                "<div class=\"{class}\" id=\"audit\">finished {} in {} ms: {} commits read up to position {}, {} violation(s)",
                esc(&a.finished_at.to_string()),
                a.took_ms,
                a.commits,
                a.position,
                a.violations
            );
            if !a.first.is_empty() {
                out.push_str("<ul>");
                for v in &a.first {
                    let _ = write!(out, "<li>{}</li>", esc(v));
                }
                out.push_str("</ul>");
            }
            out.push_str("</div>");
        }
    }
    out.push_str("<h2>Quarantine</h2>");
    if h.quarantined.is_empty() {
        out.push_str("<p class=\"muted\">Nothing quarantined.</p>");
    } else {
        let rows: Vec<Vec<String>> = h
            .quarantined
            .iter()
            .map(|(p, s, r)| vec![format!("#{p}"), format!("<code>{}</code>", esc(s)), esc(r)])
            .collect();
        out.push_str(&table(
            "quarantine",
            &["position", "subject", "reason"],
            &rows,
        ));
    }
    out
}
