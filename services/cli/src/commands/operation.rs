//! `provledger operation list [--status S] [--kind K] [--target KIND/ID]`: the operator's
//! worklist. With `--nats` it asks a running service (`q.operation.list`); embedded (or on
//! a stopped service's data dir) it reads the local projection store. Either way the
//! listing walks the store's operation indexes (status, kind, target), not every operation.

use std::time::Duration;

use provledger_events::SledLog;
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
}

/// Lists from the local store.
pub async fn list_local(log: &SledLog, req: ListRequest, json: bool) -> Result<(), CommandError> {
    let store = open_local_store(log).await?;
    let mut views = Vec::new();
    for entity in store.operations(&req.filter, req.after).take(req.limit) {
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
    for v in views {
        println!("{}", line(v));
    }
    if views.len() == req.limit {
        if let Some(last) = views.last().and_then(|v| v["id"].as_str()) {
            println!("(more may follow: add --after {last})");
        }
    }
}

/// One operation on one line: full id (to paste into `rollback run`), kind, status, target,
/// and for a stopped rollback how many compensations are not done.
fn line(v: &Value) -> String {
    let word = |field: &str| v[field].as_str().unwrap_or("-").to_string();
    let id = v["id"].as_str().unwrap_or("-");
    let open = v["compensations_not_done"].as_u64().unwrap_or(0);
    let mut out = format!(
        "{id}  {:<20} {:<16} {}",
        word("kind"),
        word("status"),
        word("target")
    );
    if word("status") == "needs_attention" {
        out.push_str(&format!("  ({open} compensation(s) not done)"));
    }
    out
}
