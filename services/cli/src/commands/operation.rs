//! `provledger operation list [--status S] [--kind K] [--target KIND/ID] [--since 10m]`:
//! the operator's worklist, newest first. With `--nats` it asks a running service
//! (`q.operation.list`); embedded (or on a stopped service's data dir) it reads the local
//! projection store. Either way the listing walks the store's operation indexes (status,
//! kind, target), not every operation.

use std::time::Duration;

use provledger_events::{SledLog, Timestamp};
use provledger_projections::view::age;
use provledger_serve::OperationFilter;
use serde_json::{json, Value};
use uuid::Uuid;

use super::state::open_local_store;
use super::{print_json, CommandError};

/// How long the service may take to answer (its own waits are bounded well below this).
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// What `operation list` asks for.
pub struct ListRequest {
    pub filter: OperationFilter,
    pub limit: usize,
    pub after: Option<Uuid>,
    /// What ages are counted to (`--since` was counted back from it).
    pub now: Timestamp,
}

/// Lists from the local store.
pub async fn list_local(log: &SledLog, req: ListRequest, json: bool) -> Result<(), CommandError> {
    let store = open_local_store(log).await?;
    let mut views = Vec::new();
    let listed = store
        .operations_newest_first(&req.filter, req.after)
        .filter(|e| e.as_ref().map_or(true, |e| req.filter.accepts(e)));
    for entity in listed.take(req.limit) {
        if let provledger_projections::Entity::Operation(op) = entity? {
            views.push(
                serde_json::to_value(provledger_projections::view::OperationSummary::of(&op))
                    .unwrap_or(Value::Null),
            );
        }
    }
    print_list(&views, &req, json);
    Ok(())
}

/// Lists through a running service.
pub async fn list_remote(
    nats_url: &str,
    auth: &provledger_client::NatsAuth,
    prefix: &str,
    req: ListRequest,
    json: bool,
) -> Result<(), CommandError> {
    let mut body = json!({ "limit": req.limit });
    if let Some(s) = &req.filter.status {
        body["status"] = s.as_str().into();
    }
    if let Some(k) = &req.filter.kind {
        body["kind"] = k.as_str().into();
    }
    if let Some(t) = &req.filter.target {
        body["target"] = t.to_string().into();
    }
    if let Some(since) = &req.filter.since {
        body["since"] = since.to_string().into();
    }
    if let Some(a) = &req.after {
        body["after"] = a.to_string().into();
    }
    let subject = format!("{prefix}.q.operation.list");
    let value = super::query::ask(nats_url, auth, &subject, body.to_string(), LIST_TIMEOUT).await?;
    super::query::refusal(&value)?;
    let views = value["data"].as_array().cloned().unwrap_or_default();
    print_list(&views, &req, json);
    Ok(())
}

fn print_list(views: &[Value], req: &ListRequest, json: bool) {
    if json {
        print_json(&Value::Array(views.to_vec()));
        return;
    }
    if views.is_empty() {
        println!("no operation matches");
        return;
    }
    println!("{}", header());
    for v in views {
        println!("{}", line(v, req.now));
    }
    if views.len() == req.limit {
        if let Some(last) = views.last().and_then(|v| v["id"].as_str()) {
            println!("(older ones may follow: add --after {last})");
        }
    }
}

/// The column names, aligned with [`line`].
fn header() -> String {
    format!(
        "{:<36}  {:<20} {:<16} {:<20} {:>7} {:>7}  {}",
        "ID", "KIND", "STATUS", "STARTED", "AGE", "IDLE", "TARGET"
    )
}

/// One operation on one line: full id (to paste into `rollback run`), kind, status, when it
/// started, its age and how long since its last commit (a `running` operation idle for
/// hours has lost its writer), target, and for a stopped rollback how many compensations
/// are not done.
fn line(v: &Value, now: Timestamp) -> String {
    let word = |field: &str| v[field].as_str().unwrap_or("-").to_string();
    let time = |field: &str| {
        v[field]
            .as_str()
            .and_then(|t| Timestamp::parse_rfc3339(t).ok())
    };
    let since = |field: &str| time(field).map_or("-".to_string(), |t| age(t, now));
    let started = time("started_at").map_or("-".to_string(), |t| {
        // To the second: the column's width.
        Timestamp::from_unix_ms(t.unix_ms() - t.unix_ms().rem_euclid(1000)).to_rfc3339()
    });
    let id = v["id"].as_str().unwrap_or("-");
    let open = v["compensations_not_done"].as_u64().unwrap_or(0);
    let mut out = format!(
        "{id:<36}  {:<20} {:<16} {:<20} {:>7} {:>7}  {}",
        word("kind"),
        word("status"),
        started,
        since("started_at"),
        since("last_commit_at"),
        word("target")
    );
    if word("status") == "needs_attention" {
        out.push_str(&format!("  ({open} compensation(s) not done)"));
    }
    out
}
