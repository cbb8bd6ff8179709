//! The operator's console (`serve --http ADDR`): read-only HTML pages over this replica's
//! projection store and the stream, rendered on the server, with no build step and no
//! asset fetched from anywhere.
//!
//! - `/operations`: the worklist, newest first, filtered by status, kind or target, with
//!   the operations that need attention first; it follows the projector live (the page
//!   listens to `/events`, server-sent events, and fetches its own fragment again).
//! - `/operations/{id}`: stages, steps with their effect and declared compensation, the
//!   failure, the rollback plan drawn (`plan`) and as a table with each compensation's
//!   full id, what remains at which executor, the commands that move it on (`rollback
//!   run`, and `rollback resolve` for each stuck compensation), and its timeline (the
//!   operation's own commits).
//! - `/clusters`, `/instances`, `/providers` and `/clusters|instances|providers/{id}`: current state,
//!   the operation in flight, allocations against capacity, and the aggregate's history
//!   with its hash chain verified: a broken link or a message outside the chain is shown
//!   in place, never hidden.
//! - `/health`: readiness, position, lag, the quarantine, the operations that need
//!   attention (the projector's count), and the last audit against the position applied
//!   now (stale when overdue or far behind: [`AUDIT_OVERDUE_INTERVALS`],
//!   [`AUDIT_COVERED_MIN_PERCENT`]).
//!
//! The console never writes: it has GET routes only and reads what the store and the
//! stream hold, as serve's own NATS identity may. Everything is bounded: pages, requests
//! in flight ([`REQUESTS_MAX`]), live connections ([`LIVE_CONNECTIONS_MAX`]) and their
//! event rate ([`LIVE_EVENT_SPACING`]). It has no authentication of its own: put it
//! behind a reverse proxy that has (docs/console.md); serve says so when it listens on
//! anything but loopback.

mod chains;
mod html;
mod pages;
mod plan;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;
pub use chains::CHAINS_KEPT_MAX;
use provledger_events::{AggregateId, AggregateKind, EventLog, HistoryEntry, Timestamp};
use provledger_projections::view::EntityView;
use provledger_projections::Entity;
use tokio::sync::{watch, Semaphore};
use uuid::Uuid;

use crate::replica::QueryContext;
use crate::store::OperationFilter;
use html::html;
use pages::{History, ListFilter};

/// Page requests answered at once; more are answered 503 at once (the console must never
/// take the store or the stream from the queries and commands).
pub const REQUESTS_MAX: usize = 32;
/// Live pages (server-sent event streams) open at once; more are refused with 503 and
/// the page stays as it was rendered.
pub const LIVE_CONNECTIONS_MAX: usize = 64;
/// The least time between two live events on one connection: a busy stream applies
/// thousands of commits a second, and a page re-renders at most this often.
pub const LIVE_EVENT_SPACING: Duration = Duration::from_millis(500);
/// Operations on one page of the list (the default; `limit` may ask for up to
/// [`OPERATIONS_PAGE_MAX`]).
pub const OPERATIONS_PAGE: usize = 50;
pub const OPERATIONS_PAGE_MAX: usize = 200;
/// Operations that need attention shown above the list.
pub const ATTENTION_SHOWN_MAX: usize = 50;
/// Entities a filtered list may pass over to fill one page before it stops and links to
/// the next (a filter the index does not serve reads entities one by one).
pub const LIST_SCAN_MAX: usize = 10_000;
/// Commits of an aggregate's history on one page.
pub const HISTORY_PAGE: usize = 100;
/// Chain violations listed above a history (all are counted).
pub const VIOLATIONS_SHOWN_MAX: usize = 20;
/// A provider's allocations listed (all are counted).
pub const ALLOCATIONS_SHOWN_MAX: usize = 200;
/// Quarantined entries listed on the health page (all are counted).
pub const QUARANTINE_SHOWN_MAX: usize = 50;
/// The last audit is stale on the health page (red, with what to do) once this many
/// audit intervals have passed since it finished: the next one is overdue.
pub const AUDIT_OVERDUE_INTERVALS: u32 = 2;
/// ...or when it read less than this share (percent) of the positions applied now: it
/// ran against a much smaller log (the empty one at start), so its verdict is not the
/// log's.
pub const AUDIT_COVERED_MIN_PERCENT: u64 = 50;
/// Stuck compensations whose `rollback resolve` command an operation's page prints (all
/// are counted, and the plan's table names each by its full id).
pub const RESOLVE_COMMANDS_SHOWN_MAX: usize = 20;

#[derive(Clone)]
struct Console {
    ctx: Arc<QueryContext>,
    chains: Arc<chains::Chains>,
    requests: Arc<Semaphore>,
    live: Arc<Semaphore>,
    stopped: watch::Receiver<bool>,
}

/// Serves the console on `addr` until `stopped` turns true; the address it bound goes to
/// the log. On anything but loopback it warns that it has no authentication.
pub(crate) async fn serve_console(
    addr: SocketAddr,
    ctx: Arc<QueryContext>,
    stopped: watch::Receiver<bool>,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    if local.ip().is_loopback() {
        tracing::info!(addr = %local, "console on http://{local}/ (read-only)");
    } else {
        tracing::warn!(
            addr = %local,
            "console on http://{local}/ is reachable from other hosts and has no authentication: \
             anyone who reaches it reads every operation; put it behind a reverse proxy with \
             authentication (docs/console.md) or listen on 127.0.0.1"
        );
    }
    let console = Console {
        ctx,
        chains: Default::default(),
        requests: Arc::new(Semaphore::new(REQUESTS_MAX)),
        live: Arc::new(Semaphore::new(LIVE_CONNECTIONS_MAX)),
        stopped: stopped.clone(),
    };
    let app = Router::new()
        .route("/", get(|| async { Redirect::to("/operations") }))
        .route("/operations", get(operations))
        .route("/operations/{id}", get(operation))
        .route("/clusters", get(clusters))
        .route("/instances", get(instances))
        .route("/providers", get(providers))
        .route("/clusters/{id}", get(cluster))
        .route("/instances/{id}", get(instance))
        .route("/providers/{id}", get(provider))
        .route("/health", get(health))
        .route("/events", get(events))
        .with_state(console);
    let mut stop = stopped;
    Ok(tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        crate::http::serve(
            "console",
            listener,
            app,
            crate::http::CONSOLE_LIMITS,
            shutdown,
        )
        .await;
    }))
}

/// Why a page cannot be shown; each is its own status and page.
#[derive(Debug, thiserror::Error)]
enum PageError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("the console answers {REQUESTS_MAX} pages at once (REQUESTS_MAX); retry in a moment")]
    Busy,
    #[error("{0}")]
    Unavailable(String),
}

impl From<crate::store::StoreError> for PageError {
    fn from(e: crate::store::StoreError) -> Self {
        PageError::Unavailable(format!("reading the projection store: {e}"))
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let status = match &self {
            PageError::BadRequest(_) => StatusCode::BAD_REQUEST,
            PageError::NotFound(_) => StatusCode::NOT_FOUND,
            PageError::Busy | PageError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        };
        let body = html!(
            "<!doctype html><html><head><meta charset=\"utf-8\"><title>{}</title></head><body><h1>{}</h1><p id=\"error\">{}</p><p><a href=\"/operations\">operations</a></p></body></html>",
            status.as_u16(),
            status.to_string(),
            self.to_string()
        );
        (status, body.into_body()).into_response()
    }
}

type PageResult = Result<Response, PageError>;

impl Console {
    /// A request slot (or `Busy` at once), and the position applied before anything is
    /// read: the page says it shows at least that, so a commit applied while it is made
    /// is announced again by the next live event, never taken as already shown.
    fn begin(&self) -> Result<(tokio::sync::OwnedSemaphorePermit, u64), PageError> {
        let slot = self
            .requests
            .clone()
            .try_acquire_owned()
            .map_err(|_| PageError::Busy)?;
        Ok((slot, self.ctx.position()))
    }

    /// The page, or only its live part when the page's script asks (`fragment`).
    fn respond(
        &self,
        at: u64,
        title: &str,
        live: bool,
        params: &Params,
        content: html::Html,
    ) -> Response {
        let body = if params.fragment {
            content
        } else {
            html::page(
                &html::Frame {
                    title,
                    stream: &self.ctx.stream,
                    position: at,
                    live,
                },
                &content,
            )
        };
        ([(header::CACHE_CONTROL, "no-store")], body.into_body()).into_response()
    }
}

/// The query string, checked: unknown names are refused, like the NATS queries refuse
/// unknown fields.
#[derive(Debug, Default)]
struct Params {
    fragment: bool,
    status: Option<String>,
    kind: Option<String>,
    target: Option<String>,
    before: Option<Uuid>,
    after: Option<Uuid>,
    limit: Option<usize>,
    from: Option<u64>,
    /// A live page's refresh of an entity it shows at this version: answered `204` at
    /// once while the entity is still there, without reading its history again.
    if_version: Option<u64>,
}

impl Params {
    fn parse(raw: &HashMap<String, String>, allowed: &[&str]) -> Result<Params, PageError> {
        let mut p = Params::default();
        for (name, value) in raw {
            if name != "fragment" && name != "if_version" && !allowed.contains(&name.as_str()) {
                return Err(PageError::BadRequest(format!(
                    "unknown parameter {name:?}; this page takes {}",
                    allowed.join(", ")
                )));
            }
            let value = value.trim();
            let bad = |what: &str| PageError::BadRequest(format!("{name}: {what}, not {value:?}"));
            let text = (!value.is_empty()).then(|| value.to_string());
            match name.as_str() {
                "fragment" => p.fragment = value == "1",
                "status" => {
                    if let Some(s) = &text {
                        if !pages::STATUSES.contains(&s.as_str()) {
                            return Err(bad(&format!("one of {}", pages::STATUSES.join(", "))));
                        }
                    }
                    p.status = text
                }
                "kind" => p.kind = text,
                "target" => {
                    if let Some(t) = &text {
                        t.parse::<AggregateId>()
                            .map_err(|_| bad("an aggregate as KIND/UUID"))?;
                    }
                    p.target = text
                }
                "before" | "after" => {
                    let id = text
                        .map(|t| t.parse::<Uuid>().map_err(|_| bad("a UUID")))
                        .transpose()?;
                    match name.as_str() {
                        "before" => p.before = id,
                        _ => p.after = id,
                    }
                }
                "limit" => {
                    let n = value.parse::<usize>().map_err(|_| bad("a number"))?;
                    if n == 0 || n > OPERATIONS_PAGE_MAX {
                        return Err(bad(&format!("1 to {OPERATIONS_PAGE_MAX}")));
                    }
                    p.limit = Some(n)
                }
                "if_version" => {
                    p.if_version = Some(value.parse::<u64>().map_err(|_| bad("a version"))?)
                }
                "from" => {
                    let v = value.parse::<u64>().map_err(|_| bad("a version"))?;
                    p.from = Some(v.max(1))
                }
                _ => {}
            }
        }
        Ok(p)
    }
}

fn parse_id(id: &str) -> Result<Uuid, PageError> {
    id.parse::<Uuid>()
        .map_err(|_| PageError::BadRequest(format!("{id:?} is not a UUID")))
}

/// Up to `limit` accepted entities, passing over at most [`LIST_SCAN_MAX`]; and where the
/// next page starts when there is more (one accepted entity past the page is looked for,
/// so a page that ends the list offers no next page).
fn take_page(
    entities: impl Iterator<Item = Result<Entity, crate::store::StoreError>>,
    keep: impl Fn(&Entity) -> bool,
    limit: usize,
) -> Result<(Vec<Entity>, Option<Uuid>), PageError> {
    let mut out: Vec<Entity> = Vec::new();
    for (scanned, e) in entities.enumerate() {
        let e = e?;
        let id = e.id().id;
        if keep(&e) {
            if out.len() == limit {
                // One more exists: the next page starts after this page's last.
                let next = out.last().map(|l| l.id().id);
                return Ok((out, next));
            }
            out.push(e);
        }
        if scanned + 1 >= LIST_SCAN_MAX {
            // Passed over as many as a page may: the next page goes on from here.
            return Ok((out, Some(id)));
        }
    }
    Ok((out, None))
}

async fn operations(
    State(c): State<Console>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    let (_slot, at) = c.begin()?;
    let p = Params::parse(&raw, &["status", "kind", "target", "before", "limit"])?;
    let filter = OperationFilter {
        status: p.status.clone(),
        kind: p.kind.clone(),
        target: p.target.as_deref().and_then(|t| t.parse().ok()),
        since: None,
    };
    let limit = p.limit.unwrap_or(OPERATIONS_PAGE);
    let (rows, next) = take_page(
        c.ctx.store.operations_newest_first(&filter, p.before),
        |e| filter.accepts(e),
        limit,
    )?;
    // The worklist first, unless the list is already one status.
    let attention = match (&p.status, p.before) {
        (None, None) => {
            let needs = OperationFilter {
                status: Some("needs_attention".into()),
                ..filter.clone()
            };
            let (ops, _) = take_page(
                c.ctx.store.operations_newest_first(&needs, None),
                |e| needs.accepts(e),
                ATTENTION_SHOWN_MAX,
            )?;
            Some(ops)
        }
        _ => None,
    };
    let views = |es: Vec<Entity>| -> Vec<_> {
        es.iter()
            .filter_map(|e| match e.view_typed() {
                EntityView::Operation(v) => Some(*v),
                _ => None,
            })
            .collect()
    };
    let attention = attention.map(views);
    let list_filter = ListFilter {
        status: p.status.clone(),
        kind: p.kind.clone(),
        target: p.target.clone(),
        limit: p.limit,
    };
    let content = pages::operations(
        &list_filter,
        attention.as_deref(),
        &views(rows),
        next,
        Timestamp::now(),
    );
    Ok(c.respond(at, "Operations", true, &p, content))
}

/// One aggregate's history for its page, up to what the store has applied, from the
/// stream (it holds every message of the subject, quarantined ones included, and a page
/// must show a broken chain, not fail on it).
///
/// The newest page reads only what this console has not verified yet (`chains`), then the
/// page's own window: what a page costs does not grow with the aggregate once it was read
/// once. An earlier page (`from`) reads and verifies the whole subject.
async fn history_of(
    c: &Console,
    id: &AggregateId,
    from: Option<u64>,
    path: String,
) -> Result<History, PageError> {
    let applied = c.ctx.position();
    let unreadable = |e: provledger_events::ReadError| {
        PageError::Unavailable(format!("reading {id}'s history from the stream: {e}"))
    };
    if from.is_some() {
        let mut entries = c.ctx.log.aggregate_history(*id).await.map_err(unreadable)?;
        entries.retain(|e| e.position() <= applied);
        return Ok(history_page(id, entries, from, path));
    }
    let mut verified = c.chains.get(id).unwrap_or_else(chains::Verified::new);
    let new = c
        .ctx
        .log
        .aggregate_history_between(*id, verified.through, None)
        .await
        .map_err(unreadable)?;
    verified.extend(&new, applied, HISTORY_PAGE);
    let entries = match verified.through.position {
        0 => Vec::new(),
        through => c
            .ctx
            .log
            .aggregate_history_between(*id, verified.window_start(HISTORY_PAGE), Some(through))
            .await
            .map_err(unreadable)?,
    };
    let first = entries
        .iter()
        .find_map(HistoryEntry::commit)
        .map(|c| c.version);
    let history = History {
        entries,
        commits: verified.commits,
        // Every commit counted was classified as extending the chain (version, hash and
        // link checked); whatever did not is counted as quarantined.
        violations: Vec::new(),
        quarantined: verified.quarantined,
        lost: verified
            .losses
            .as_slice()
            .iter()
            .map(|l| format!("integrity: {l}"))
            .collect(),
        earlier_from: first
            .filter(|v| *v > 1)
            .map(|v| v.saturating_sub(HISTORY_PAGE as u64).max(1)),
        later_from: None,
        path,
    };
    c.chains.keep(*id, verified);
    Ok(history)
}

/// One page of an aggregate's history (the newest [`HISTORY_PAGE`] commits, or from
/// version `from`), with the verdict on its whole chain: every violation, and every
/// message on its subject outside the chain. Pure.
pub(crate) fn history_page(
    id: &AggregateId,
    entries: Vec<HistoryEntry>,
    from: Option<u64>,
    path: String,
) -> History {
    let commits: Vec<_> = entries
        .iter()
        .filter_map(HistoryEntry::commit)
        .cloned()
        .collect();
    let violations = HistoryEntry::verify(id, &entries)
        .iter()
        .map(|v| (v.position(), v.to_string()))
        .collect();
    let quarantined = entries
        .iter()
        .filter(|e| matches!(e, HistoryEntry::Quarantined { .. }))
        .count();
    let lost = HistoryEntry::open_losses(&entries)
        .as_slice()
        .iter()
        .map(|l| format!("integrity: {l}"))
        .collect();
    // Entries are in log order; a page is HISTORY_PAGE commits from `from`, or the last.
    let versions: Vec<u64> = commits.iter().map(|c| c.version).collect();
    let first = match from {
        Some(v) => v,
        None => versions
            .len()
            .checked_sub(HISTORY_PAGE)
            .and_then(|i| versions.get(i).copied())
            .unwrap_or(1),
    };
    let last = first.saturating_add(HISTORY_PAGE as u64 - 1);
    let mut page = Vec::new();
    let mut in_page = false;
    for e in entries {
        match &e {
            HistoryEntry::Commit(cm) => {
                in_page = cm.version >= first && cm.version <= last;
                if in_page {
                    page.push(e);
                }
            }
            // A message outside the chain, or a loss, shows where it lies: after the commit
            // before it.
            HistoryEntry::Quarantined { .. } | HistoryEntry::Lost(_) => {
                if in_page || (first == 1 && page.is_empty()) {
                    page.push(e)
                }
            }
        }
    }
    let newest = versions.last().copied().unwrap_or(0);
    History {
        entries: page,
        commits: commits.len(),
        violations,
        quarantined,
        lost,
        earlier_from: (first > 1).then(|| first.saturating_sub(HISTORY_PAGE as u64).max(1)),
        later_from: (last < newest).then_some(last + 1),
        path,
    }
}

/// `204 No Content` for a live refresh of an entity still at the version the page shows.
fn unchanged(p: &Params, entity: &Entity) -> Option<Response> {
    (p.fragment && p.if_version == Some(entity.header().version))
        .then(|| StatusCode::NO_CONTENT.into_response())
}

/// The page's content, marked with the entity's version for its live refreshes.
fn versioned(entity: &Entity, content: html::Html) -> html::Html {
    html!(
        "<span hidden id=\"shown-version\" data-version=\"{}\"></span>{}",
        entity.header().version,
        content
    )
}

async fn entity_of(c: &Console, id: &AggregateId) -> Result<Entity, PageError> {
    c.ctx.store.entity(id)?.ok_or_else(|| {
        PageError::NotFound(format!(
            "{id} has no commit in the log applied so far (position {})",
            c.ctx.position()
        ))
    })
}

async fn operation(
    State(c): State<Console>,
    Path(id): Path<String>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    let (_slot, at) = c.begin()?;
    let p = Params::parse(&raw, &["from"])?;
    let id = AggregateId::new(AggregateKind::Operation, parse_id(&id)?);
    let entity = entity_of(&c, &id).await?;
    if let Some(unchanged) = unchanged(&p, &entity) {
        return Ok(unchanged);
    }
    let EntityView::Operation(view) = entity.view_typed() else {
        return Err(PageError::NotFound(format!("{id} is not an operation")));
    };
    let history = history_of(&c, &id, p.from, html::entity_path(&id)).await?;
    let title = operation_title(&view);
    let content = versioned(&entity, pages::operation(&view, &history, Timestamp::now()));
    Ok(c.respond(at, &title, true, &p, content))
}

/// An operation's page title: its short id (the last 12 hex digits, docs/cli.md's "Short
/// ids") and its kind.
pub(crate) fn operation_title(op: &provledger_projections::view::OperationView) -> String {
    format!(
        "Operation {} ({})",
        provledger_events::short_id(&op.id),
        op.kind.as_ref().map(html::word).unwrap_or_default()
    )
}

async fn entity_page(
    c: Console,
    kind: AggregateKind,
    id: String,
    raw: HashMap<String, String>,
) -> PageResult {
    let (_slot, at) = c.begin()?;
    let p = Params::parse(&raw, &["from"])?;
    let id = AggregateId::new(kind, parse_id(&id)?);
    let entity = entity_of(&c, &id).await?;
    if let Some(unchanged) = unchanged(&p, &entity) {
        return Ok(unchanged);
    }
    let history = history_of(&c, &id, p.from, html::entity_path(&id)).await?;
    let (title, content) = match entity.view_typed() {
        EntityView::Cluster(v) => (format!("Cluster {}", v.name), pages::cluster(&v, &history)),
        EntityView::Instance(v) => (
            format!("Instance {}", v.name),
            pages::instance(&v, &history),
        ),
        EntityView::Provider(v) => (
            format!("Provider {}", v.name),
            pages::provider(&v, &history),
        ),
        EntityView::Operation(v) => (
            operation_title(&v),
            pages::operation(&v, &history, Timestamp::now()),
        ),
    };
    Ok(c.respond(at, &title, true, &p, versioned(&entity, content)))
}

async fn cluster(
    State(c): State<Console>,
    Path(id): Path<String>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    entity_page(c, AggregateKind::Cluster, id, raw).await
}

async fn instance(
    State(c): State<Console>,
    Path(id): Path<String>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    entity_page(c, AggregateKind::Instance, id, raw).await
}

async fn provider(
    State(c): State<Console>,
    Path(id): Path<String>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    entity_page(c, AggregateKind::Provider, id, raw).await
}

async fn entity_list(
    c: Console,
    kind: AggregateKind,
    title: &str,
    raw: HashMap<String, String>,
) -> PageResult {
    let (_slot, at) = c.begin()?;
    let p = Params::parse(&raw, &["after", "limit"])?;
    let limit = p.limit.unwrap_or(OPERATIONS_PAGE);
    let (entities, next) = take_page(c.ctx.store.entities_of(kind, p.after), |_| true, limit)?;
    let rows: Vec<(AggregateId, String, String)> = entities
        .iter()
        .map(|e| {
            let name = match e.view_typed() {
                EntityView::Cluster(v) => v.name,
                EntityView::Provider(v) => format!("{} ({})", v.name, v.host),
                EntityView::Instance(v) => v.name,
                EntityView::Operation(_) => String::new(),
            };
            (e.id(), name, e.status_word())
        })
        .collect();
    let base = html::list_path(kind);
    let limit_param = p.limit.map(|l| format!("&limit={l}")).unwrap_or_default();
    let next = next.map(|after| format!("{base}?after={after}{limit_param}"));
    Ok(c.respond(at, title, true, &p, pages::entity_list(&rows, next)))
}

async fn clusters(
    State(c): State<Console>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    entity_list(c, AggregateKind::Cluster, "Clusters", raw).await
}

async fn instances(
    State(c): State<Console>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    entity_list(c, AggregateKind::Instance, "Instances", raw).await
}

async fn providers(
    State(c): State<Console>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    entity_list(c, AggregateKind::Provider, "Providers", raw).await
}

async fn health(
    State(c): State<Console>,
    Query(raw): Query<HashMap<String, String>>,
) -> PageResult {
    let (_slot, at) = c.begin()?;
    let p = Params::parse(&raw, &[])?;
    let readiness = c.ctx.readiness().await;
    let quarantined = c.ctx.store.quarantined_first(QUARANTINE_SHOWN_MAX)?;
    // The projector's count per status: no operation is read.
    let needs_attention = c
        .ctx
        .store
        .operation_counts()?
        .into_iter()
        .find(|(status, _)| status == "needs_attention")
        .map_or(0, |(_, n)| n);
    let view = pages::HealthView {
        ready: readiness.ready,
        reason: readiness.reason.clone(),
        position: readiness.position,
        end: readiness.end,
        caught_up_to: c.ctx.caught_up_to.get().copied(),
        nats_connected: readiness.nats_connected,
        quarantined_total: c.ctx.store.quarantine_count(),
        quarantined: quarantined
            .iter()
            .map(|q| (q.position, q.subject.clone(), q.error.clone()))
            .collect(),
        audit: c.ctx.audits.last(),
        audit_failed: c.ctx.audits.failed(),
        audit_interval: c.ctx.audits.interval,
        needs_attention,
        now: Timestamp::now(),
    };
    Ok(c.respond(at, "Health", true, &p, pages::health(&view)))
}

/// Server-sent events: `position` each time the projector has applied more, at most once
/// per [`LIVE_EVENT_SPACING`], until the client leaves or serve stops.
async fn events(State(c): State<Console>) -> Response {
    let Ok(permit) = c.live.clone().try_acquire_owned() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{LIVE_CONNECTIONS_MAX} live pages are open (LIVE_CONNECTIONS_MAX)"),
        )
            .into_response();
    };
    let applied = c.ctx.applied.clone();
    let stopped = c.stopped.clone();
    let state = (applied, stopped, permit, true);
    let stream = futures::stream::unfold(
        state,
        |(mut applied, mut stopped, permit, first)| async move {
            if !first {
                tokio::time::sleep(LIVE_EVENT_SPACING).await;
                tokio::select! {
                    changed = applied.changed() => changed.ok()?,
                    _ = stopped.wait_for(|s| *s) => return None,
                }
            }
            let position = *applied.borrow_and_update();
            let event = SseEvent::default()
                .event("position")
                .data(position.to_string());
            Some((
                Ok::<_, std::convert::Infallible>(event),
                (applied, stopped, permit, false),
            ))
        },
    );
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

#[cfg(test)]
mod tests;
