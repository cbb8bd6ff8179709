//! The console's HTML building blocks: the [`Html`] type and its [`html!`] macro (the only
//! ways to make markup, so every value is escaped by its type), the page frame, links to
//! entities and status badges. Pure: values in, markup out.

use std::fmt;

use provledger_events::{AggregateId, AggregateKind};
use uuid::Uuid;

/// Markup. Nothing outside this module can turn a string into one without escaping it:
/// markup comes from escaped text ([`Html::text`], or any string given to [`html!`]), from
/// markup written in the source ([`html!`]'s literal, [`Html::lit`]), or from joining
/// markup. So a page cannot show an unescaped value by forgetting to escape it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Html(String);

impl Html {
    pub(crate) fn new() -> Html {
        Html(String::new())
    }

    /// Text, escaped for element content and attribute values alike.
    pub(crate) fn text(text: &str) -> Html {
        let mut out = Html::new();
        out.push(text);
        out
    }

    /// Markup written in the source: a `&'static str` is a literal or a constant, never
    /// a value read from outside.
    pub(crate) fn lit(markup: &'static str) -> Html {
        Html(markup.to_string())
    }

    /// Appends a part: markup as it is, text escaped, numbers as digits.
    pub(crate) fn push(&mut self, part: impl Render) {
        part.render(&mut self.0);
    }

    /// The parts with `separator` (markup from the source) between them.
    pub(crate) fn join(parts: impl IntoIterator<Item = Html>, separator: &'static str) -> Html {
        let mut out = Html::new();
        for (i, part) in parts.into_iter().enumerate() {
            if i > 0 {
                out.0.push_str(separator);
            }
            out.0.push_str(&part.0);
        }
        out
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The response body: the one way markup leaves the console.
    pub(crate) fn into_body(self) -> axum::response::Html<String> {
        axum::response::Html(self.0)
    }

    /// [`html!`]'s output. Only the macro calls it: it has checked that its format string
    /// names no argument inline, so every argument went through [`Render`].
    #[doc(hidden)]
    pub(crate) fn from_checked_args(args: fmt::Arguments<'_>) -> Html {
        Html(args.to_string())
    }
}

impl std::ops::Deref for Html {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Html {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How a value becomes part of a page: markup as it is, text escaped, numbers and ids as
/// they print (digits, hex and dashes cannot carry markup).
pub(crate) trait Render {
    fn render(&self, out: &mut String);
}

impl Render for Html {
    fn render(&self, out: &mut String) {
        out.push_str(&self.0);
    }
}

impl Render for str {
    fn render(&self, out: &mut String) {
        for c in self.chars() {
            match c {
                '&' => out.push_str("&amp;"),
                '<' => out.push_str("&lt;"),
                '>' => out.push_str("&gt;"),
                '"' => out.push_str("&quot;"),
                '\'' => out.push_str("&#39;"),
                c => out.push(c),
            }
        }
    }
}

impl Render for String {
    fn render(&self, out: &mut String) {
        self.as_str().render(out)
    }
}

macro_rules! render_as_printed {
    ($($t:ty),*) => {$(
        impl Render for $t {
            fn render(&self, out: &mut String) {
                use std::fmt::Write as _;
                // Writing to a String cannot fail.
                let _ = write!(out, "{self}");
            }
        }
    )*};
}
render_as_printed!(u8, u16, u32, u64, usize, i64, Uuid);

impl<T: Render + ?Sized> Render for &T {
    fn render(&self, out: &mut String) {
        (**self).render(out)
    }
}

impl<T: Render> Render for Option<T> {
    fn render(&self, out: &mut String) {
        if let Some(v) = self {
            v.render(out)
        }
    }
}

/// An argument of [`html!`], displayed through [`Render`].
#[doc(hidden)]
pub(crate) struct Rendered<'a, T: ?Sized>(pub(crate) &'a T);

impl<T: Render + ?Sized> fmt::Display for Rendered<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = String::new();
        self.0.render(&mut out);
        f.write_str(&out)
    }
}

/// Whether a format string has only `{}` placeholders (and `{{`, `}}`): an argument named
/// inside the string (`{name}`) would be captured by `format_args!` directly, past
/// [`Render`], so [`html!`] refuses it when it compiles.
#[doc(hidden)]
pub(crate) const fn only_positional(format: &str) -> bool {
    let b = format.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'{' {
            if i + 1 < b.len() && (b[i + 1] == b'{' || b[i + 1] == b'}') {
                i += 2;
                continue;
            }
            return false;
        }
        i += 1;
    }
    true
}

/// Markup from a format string written in the source and arguments that are each
/// rendered by type ([`Render`]): text is escaped, markup kept. Only `{}` placeholders:
/// an inline `{name}` does not compile.
macro_rules! html {
    ($format:literal $(, $arg:expr)* $(,)?) => {{
        const _: () = assert!(
            $crate::console::html::only_positional($format),
            "html!: use {{}} placeholders only, so every argument is rendered by type"
        );
        $crate::console::html::Html::from_checked_args(format_args!(
            $format $(, $crate::console::html::Rendered(&$arg))*
        ))
    }};
}
pub(crate) use html;

/// Percent-encodes a query value (letters, digits and `-_.~/` kept).
pub(crate) fn url_encode(value: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    for b in value.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b'/' => {
                out.push(b as char)
            }
            b => {
                // Writing to a String cannot fail.
                let _ = write!(out, "%{b:02X}");
            }
        }
    }
    out
}

/// A value as JSON says it (`needs_attention`, `create_cluster`), or its debug form.
pub(crate) fn word<T: serde::Serialize + std::fmt::Debug>(value: &T) -> String {
    provledger_projections::planner::json_word(value)
}

/// An executor's name: `ledger` or the service's.
pub(crate) fn executor_name(executor: &provledger_events::catalogue::Executor) -> String {
    match executor {
        provledger_events::catalogue::Executor::Ledger => "ledger".to_string(),
        provledger_events::catalogue::Executor::Service(name) => name.clone(),
    }
}

/// The path of the list of one kind's entities.
pub(crate) fn list_path(kind: AggregateKind) -> &'static str {
    match kind {
        AggregateKind::Cluster => "/clusters",
        AggregateKind::Instance => "/instances",
        AggregateKind::Provider => "/providers",
        AggregateKind::Operation => "/operations",
    }
}

/// The path of an entity's page.
pub(crate) fn entity_path(id: &AggregateId) -> String {
    format!("{}/{}", list_path(id.kind), id.id)
}

/// A link to an entity's page, labelled with its kind and short id (the last 12 hex
/// digits, as docs/cli.md's "Short ids" says text output shows one); the full id is in
/// its path and its title.
pub(crate) fn entity_link(id: &AggregateId) -> Html {
    html!(
        "<a href=\"{}\" title=\"{}\"><code>{}</code></a>",
        entity_path(id),
        id.to_string(),
        provledger_events::short_aggregate(id)
    )
}

/// A link to an operation's page.
pub(crate) fn operation_link(id: &Uuid) -> Html {
    entity_link(&AggregateId::new(AggregateKind::Operation, *id))
}

/// The colour class of a status or progress word: what needs an operator is red, what is
/// under way blue, what ended well green, the rest grey.
pub(crate) fn tone(status: &str) -> &'static str {
    match status {
        "needs_attention" | "failed" | "error" | "broken" | "compensation_failed" | "stuck" => {
            "bad"
        }
        "running"
        | "rolling_back"
        | "requested"
        | "compensation_requested"
        | "started"
        | "building"
        | "deleting"
        | "outcome_unknown" => "busy",
        "succeeded" | "rolled_back" | "done" | "compensated" | "active" | "completed"
        | "verified" => "good",
        "held" | "retained" | "cancelled" | "planned" | "compensation_planned" => "warn",
        _ => "plain",
    }
}

/// A status word as a coloured badge.
pub(crate) fn badge(status: &str) -> Html {
    html!(
        "<span class=\"badge {}\" data-status=\"{}\">{}</span>",
        tone(status),
        status,
        status
    )
}

/// A simple table: a header row (text) and cells (markup).
pub(crate) fn table(class: &'static str, head: &[&str], rows: &[Vec<Html>]) -> Html {
    let mut out = html!("<table class=\"{}\"><thead><tr>", class);
    for h in head {
        out.push(html!("<th>{}</th>", h));
    }
    out.push(Html::lit("</tr></thead><tbody>"));
    for row in rows {
        out.push(Html::lit("<tr>"));
        for cell in row {
            out.push(html!("<td>{}</td>", cell));
        }
        out.push(Html::lit("</tr>"));
    }
    out.push(Html::lit("</tbody></table>"));
    out
}

/// What the frame needs besides the page's own content.
pub(crate) struct Frame<'a> {
    pub(crate) title: &'a str,
    /// The stream the replica follows, and the position applied when the page was made.
    pub(crate) stream: &'a str,
    pub(crate) position: u64,
    /// Whether the page follows the projector (server-sent events) and replaces its
    /// `#live` part as commits are applied.
    pub(crate) live: bool,
}

/// A whole page around `content` (the part a live page replaces).
pub(crate) fn page(frame: &Frame<'_>, content: &Html) -> Html {
    let (live, live_note) = if frame.live {
        (
            Html::lit(LIVE_SCRIPT),
            Html::lit(" · <span id=\"live-state\">live</span>"),
        )
    } else {
        (Html::new(), Html::new())
    };
    html!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
<title>{} · provledger</title><style>{}</style></head><body data-position=\"{}\">\
<header><a class=\"brand\" href=\"/operations\">provledger</a>\
<nav><a href=\"/operations\">Operations</a><a href=\"/operations?status=needs_attention\">Needs attention</a>\
<a href=\"/clusters\">Clusters</a><a href=\"/instances\">Instances</a><a href=\"/providers\">Providers</a><a href=\"/health\">Health</a></nav>\
<span class=\"where\">{} · <span id=\"position\">position {}</span>{}</span></header>\
<main><h1>{}</h1><div id=\"live\">{}</div></main>{}</body></html>\n",
        frame.title,
        Html::lit(STYLE),
        frame.position,
        frame.stream,
        frame.position,
        live_note,
        frame.title,
        content,
        live,
    )
}

/// Replaces `#live` with the same page's fragment each time the projector applies
/// commits (at most once per server-sent event; the server spaces them), and the position
/// in the header. Read-only: it only GETs the page it is on.
const LIVE_SCRIPT: &str = r#"<script>
(function () {
  var busy = false, again = false;
  // The position this page shows at least (taken before the page was read): a live event
  // at it (the first one after connecting, when nothing was applied meanwhile) changes
  // nothing. It moves only once a refresh has been shown.
  var shown = document.body.dataset.position, wanted = shown;
  function state(text) { document.getElementById('live-state').textContent = text; }
  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    var target = wanted;
    var url = location.pathname + location.search + (location.search ? '&' : '?') + 'fragment=1';
    // An entity's page is fetched again only if the entity changed (204 otherwise).
    var version = document.getElementById('shown-version');
    if (version) { url += '&if_version=' + version.dataset.version; }
    fetch(url, {cache: 'no-store'})
      .then(function (r) {
        if (r.status === 204) { return ''; }
        return r.ok ? r.text() : Promise.reject(r.status);
      })
      .then(function (html) {
        if (html) { document.getElementById('live').innerHTML = html; }
        shown = target;
        document.getElementById('position').textContent = 'position ' + target;
        state('live');
      })
      .catch(function () { state('behind: retrying at the next commit'); })
      .finally(function () { busy = false; if (again) { again = false; refresh(); } });
  }
  var events = null;
  function listen() {
    events = new EventSource('/events');
    events.addEventListener('position', function (e) {
      if (e.data === shown) { state('live'); return; }
      wanted = e.data;
      refresh();
    });
    events.onerror = function () {
      // A refused stream (every live slot taken) is closed for good; a dropped one retries.
      state(events && events.readyState === EventSource.CLOSED ? 'not live: reload to follow' : 'reconnecting');
    };
  }
  // A page left for another may be kept whole (the back/forward cache) with its stream
  // open: a browser opens six connections per host over HTTP/1.1, so pages left behind
  // would hold them all and the next page would wait. Closed when left, opened on return.
  window.addEventListener('pagehide', function () { if (events) { events.close(); events = null; } });
  window.addEventListener('pageshow', function () { if (!events) { listen(); } });
})();
</script>"#;

const STYLE: &str = "\
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d232b;background:#f6f7f9}\
header{display:flex;gap:18px;align-items:center;background:#1d2733;color:#e8edf2;padding:8px 20px}\
header a{color:#e8edf2;text-decoration:none}header nav a{margin-right:14px}.brand{font-weight:700}\
.where{margin-left:auto;font-size:12px;color:#aab6c3}\
main{padding:8px 24px 40px}h1{font-size:20px;margin:10px 0 14px}h2{font-size:16px;margin:22px 0 8px}\
table{border-collapse:collapse;background:#fff;margin:4px 0 10px;min-width:40%}\
th,td{border:1px solid #dde2e8;padding:4px 8px;text-align:left;vertical-align:top}th{background:#eef1f4;font-weight:600}\
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace}a{color:#1a5fb4}\
.badge{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;font-weight:600;background:#e4e7eb}\
.badge.bad{background:#fbd5d5;color:#8c1d18}.badge.busy{background:#d5e5fb;color:#17457a}\
.badge.good{background:#d3f1dc;color:#1b5e2c}.badge.warn{background:#fbeccc;color:#7a4b00}\
.box{background:#fff;border:1px solid #dde2e8;border-radius:6px;padding:10px 14px;margin:8px 0}\
.alert{background:#fde8e8;border:1px solid #e8a0a0;border-radius:6px;padding:8px 12px;margin:8px 0}\
.warnbox{background:#fdf3dc;border:1px solid #e5c274;border-radius:6px;padding:8px 12px;margin:8px 0}\
.ok{background:#e6f6ea;border:1px solid #9fd3ad;border-radius:6px;padding:8px 12px;margin:8px 0}\
.cmd{background:#1d2733;color:#e8edf2;padding:8px 12px;border-radius:6px;display:inline-block}\
.stages{display:flex;gap:8px;flex-wrap:wrap;margin:6px 0}.stage{background:#fff;border:1px solid #dde2e8;border-radius:6px;padding:6px 10px}\
.stage.current{border-color:#1a5fb4;box-shadow:0 0 0 2px #c9dbf4}\
.bar{display:inline-block;width:160px;height:10px;background:#e4e7eb;border-radius:5px;vertical-align:middle;overflow:hidden}\
.bar span{display:block;height:100%;background:#3d8b5a}.bar span.over{background:#c0392b}\
tr.broken td{background:#fde8e8}form.filters{display:flex;gap:8px;align-items:end;margin:4px 0 12px}\
form.filters label{display:flex;flex-direction:column;font-size:12px}.muted{color:#6b7785}\
svg text{font:12px system-ui,sans-serif}";
