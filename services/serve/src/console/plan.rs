//! The rollback plan drawn: the compensations in the order the driver runs them, one box
//! each, grouped by stage with the stage's policy, coloured by where each stands (done,
//! requested, planned, failed, or stuck: failed and left when the rollback stopped), with
//! its attempts and the executor that holds the resource. Pure SVG, no script.

use provledger_projections::view::{CompensationView, OperationView};

use super::html::{executor_name, html, word, Html};

/// Compensations drawn; the rest are counted under the drawing (a plan of thousands is
/// a table's job, and the page must stay bounded).
pub(crate) const PLAN_DRAWN_MAX: usize = 200;

const ROW_HEIGHT: usize = 46;
const BOX_HEIGHT: usize = 34;
const WIDTH: usize = 860;
const STAGE_COLUMN: usize = 170;

/// Where one compensation stands, as the drawing colours it.
pub(crate) fn standing(op: &OperationView, c: &CompensationView) -> &'static str {
    let state = word(&c.state);
    if c.resolved.is_some() {
        return "resolved";
    }
    match state.as_str() {
        "done" => "done",
        "requested" => "requested",
        "planned" => "planned",
        // Failed and left when the rollback stopped: an operator's now.
        "failed" if op.remaining.contains(&c.compensation_id) => "stuck",
        "failed" => "failed",
        _ => "planned",
    }
}

fn colours(standing: &str) -> (&'static str, &'static str) {
    match standing {
        "done" | "resolved" => ("#d3f1dc", "#3d8b5a"),
        "requested" => ("#d5e5fb", "#1a5fb4"),
        "failed" => ("#fbeccc", "#b7791f"),
        "stuck" => ("#fbd5d5", "#c0392b"),
        _ => ("#eef1f4", "#8a96a3"),
    }
}

/// The plan of `op` as an inline SVG, with an accessible list of the same content.
pub(crate) fn plan_diagram(op: &OperationView) -> Html {
    let drawn: Vec<&CompensationView> = op.compensations.iter().take(PLAN_DRAWN_MAX).collect();
    if drawn.is_empty() {
        return Html::lit("<p class=\"muted\">The plan undoes nothing (every resource is kept or was never made).</p>");
    }
    let height = drawn.len() * ROW_HEIGHT + 10;
    let mut svg = html!(
        "<svg class=\"plan\" id=\"plan-diagram\" role=\"img\" aria-label=\"rollback plan\" width=\"{}\" height=\"{}\" viewBox=\"0 0 {} {}\" xmlns=\"http://www.w3.org/2000/svg\">\
<defs><marker id=\"arrow\" markerWidth=\"8\" markerHeight=\"8\" refX=\"4\" refY=\"4\" orient=\"auto\"><path d=\"M0,0 L8,4 L0,8 z\" fill=\"#8a96a3\"/></marker></defs>",
        WIDTH,
        height,
        WIDTH,
        height
    );
    let mut previous_stage: Option<&str> = None;
    for (i, c) in drawn.iter().enumerate() {
        let y = 5 + i * ROW_HEIGHT;
        if previous_stage != Some(c.stage.as_str()) {
            let policy = op
                .stages
                .iter()
                .find(|s| s.name == c.stage)
                .map(|s| word(&s.policy))
                .unwrap_or_default();
            svg.push(html!(
                "<text x=\"4\" y=\"{}\" font-weight=\"600\">{}</text><text x=\"4\" y=\"{}\" fill=\"#6b7785\">policy: {}</text>",
                y + 14,
                c.stage,
                y + 29,
                policy
            ));
            previous_stage = Some(c.stage.as_str());
        }
        svg.push(compensation_box(op, c, i, y));
        if i + 1 < drawn.len() {
            let ax = STAGE_COLUMN + 24;
            svg.push(html!(
                "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#8a96a3\" marker-end=\"url(#arrow)\"/>",
                ax,
                y + BOX_HEIGHT,
                ax,
                y + ROW_HEIGHT - 3
            ));
        }
    }
    svg.push(Html::lit("</svg>"));
    let more = op.compensations.len().saturating_sub(PLAN_DRAWN_MAX);
    if more > 0 {
        svg.push(html!(
            "<p class=\"muted\">{} more compensation(s) not drawn (PLAN_DRAWN_MAX = {}); `provledger rollback plan` lists them all.</p>",
            more,
            PLAN_DRAWN_MAX
        ));
    }
    svg
}

/// One compensation's box, the `i`th drawn, at height `y`.
fn compensation_box(op: &OperationView, c: &CompensationView, i: usize, y: usize) -> Html {
    let standing = standing(op, c);
    let (fill, stroke) = colours(standing);
    let x = STAGE_COLUMN;
    let w = WIDTH - STAGE_COLUMN - 6;
    html!(
        "<g class=\"compensation\" data-standing=\"{}\" data-id=\"{}\">\
<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" rx=\"5\" fill=\"{}\" stroke=\"{}\" stroke-width=\"1.5\"/>\
<text x=\"{}\" y=\"{}\">{}. {} <tspan font-family=\"monospace\">{}</tspan> at {}</text>\
<text x=\"{}\" y=\"{}\" fill=\"#3b4652\">{} · {} attempt(s){}</text></g>",
        standing,
        c.compensation_id,
        x,
        y,
        w,
        BOX_HEIGHT,
        fill,
        stroke,
        x + 10,
        y + 14,
        i + 1,
        word(&c.action),
        truncate(&c.resource, 40),
        executor_name(&c.executor),
        x + 10,
        y + 28,
        standing,
        c.attempts,
        c.last_error
            .as_deref()
            .map(|e| html!(" · last error: {}", truncate(e, 60))),
    )
}

fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}
