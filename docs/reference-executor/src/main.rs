//! A reference executor for provledger, to copy: a small service that owns one kind of
//! resource (here, DNS-like records kept in memory) and answers, over NATS with JSON only,
//! the two protocols provledger asks of every executor:
//!
//! - `<prefix>.exec.<name>.compensate`: undo one effect (docs/writing-operations.md,
//!   section 4): idempotent by `compensation_id`, undoing by `args.idempotency_key` when
//!   given, answering `nothing_to_undo` when nothing was done under the key, and fencing
//!   the key so a late action under it is refused;
//! - `<prefix>.exec.<name>.inventory`: what it holds, a page at a time, in bytewise order
//!   of `resource` (docs/drift.md, section 2), each item with the key it was made under,
//!   the entity it belongs to and the `undo` action that removes it.
//!
//! It also answers `<prefix>.exec.<name>.create` (`{"resource", "key", "entity"}`): its own
//! forward action, standing in for whatever API your service has. provledger never calls
//! it; your operation's runner does, after recording `step_started` with the same key.
//!
//! Run: `reference-executor --nats nats://127.0.0.1:4222 --name dns [--prefix provledger]
//! [--kind dns_record] [--undo unregister_dns]`. A real executor keeps its records in its
//! own store; what matters here is what it keeps with each (the key, the entity) and how
//! it answers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

/// The most items a page holds, whatever `limit` asks (the protocol's bound).
const PAGE_ITEMS_MAX: usize = 1_000;
/// A page's size when the request does not say.
const PAGE_ITEMS_DEFAULT: usize = 500;

/// One record, as this executor keeps it.
struct Record {
    /// The idempotency key of the request that made it (`None`: made by hand).
    key: Option<String>,
    /// The entity (an instance's or node's UUID) it belongs to, if known.
    entity: Option<String>,
}

#[derive(Default)]
struct State {
    records: BTreeMap<String, Record>,
    /// Compensations already carried out: a retry answers the same.
    done: BTreeSet<String>,
    /// Keys undone: a late action under one of them is refused.
    fenced: BTreeSet<String>,
}

/// What this executor is.
struct Config {
    subject_prefix: String,
    name: String,
    /// The inventory's word for what it holds.
    kind: String,
    /// The compensation action that removes a record (the inventory's `undo`).
    undo: String,
}

/// `<prefix>.exec.<name>.compensate`'s request. Unknown fields are ignored.
#[derive(Deserialize)]
struct CompensationRequest {
    compensation_id: String,
    #[serde(default)]
    resource: String,
    #[serde(default)]
    args: BTreeMap<String, String>,
}

/// `<prefix>.exec.<name>.inventory`'s request.
#[derive(Deserialize, Default)]
struct InventoryRequest {
    after: Option<String>,
    limit: Option<u64>,
}

/// `<prefix>.exec.<name>.create`'s request (this executor's own forward action).
#[derive(Deserialize)]
struct CreateRequest {
    resource: String,
    key: Option<String>,
    entity: Option<String>,
}

fn compensate(state: &mut State, payload: &[u8]) -> Value {
    let request: CompensationRequest = match serde_json::from_slice(payload) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("not a compensation request: {e}")}),
    };
    if state.done.contains(&request.compensation_id) {
        return json!({"ok": true}); // a retry: already carried out
    }
    let key = request.args.get("idempotency_key").cloned();
    let mut undone = false;
    if let Some(key) = &key {
        state.fenced.insert(key.clone());
        let before = state.records.len();
        state.records.retain(|_, r| r.key.as_ref() != Some(key));
        undone = state.records.len() < before;
    }
    if !request.resource.is_empty() {
        // By name too, unless it now belongs to another key (handed to another request).
        let other_key = state
            .records
            .get(&request.resource)
            .is_some_and(|r| key.is_some() && r.key.is_some() && r.key != key);
        if !other_key && state.records.remove(&request.resource).is_some() {
            undone = true;
        }
    }
    state.done.insert(request.compensation_id);
    match (key.is_some(), undone) {
        (true, false) => json!({"ok": true, "nothing_to_undo": true}),
        _ => json!({"ok": true}),
    }
}

fn inventory(state: &State, config: &Config, payload: &[u8], bytes_max: usize) -> Value {
    let request: InventoryRequest = match payload {
        [] => InventoryRequest::default(),
        _ => match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => return json!({"error": format!("not an inventory request: {e}")}),
        },
    };
    let limit = request
        .limit
        .map_or(PAGE_ITEMS_DEFAULT, |l| {
            usize::try_from(l).unwrap_or(PAGE_ITEMS_MAX)
        })
        .clamp(1, PAGE_ITEMS_MAX);
    let from = match &request.after {
        Some(after) => std::ops::Bound::Excluded(after.clone()),
        None => std::ops::Bound::Unbounded,
    };
    let mut items = Vec::new();
    let mut bytes = 0;
    let mut more = false;
    for (resource, record) in state.records.range((from, std::ops::Bound::Unbounded)) {
        let mut attrs = serde_json::Map::new();
        if let Some(entity) = &record.entity {
            attrs.insert("node".into(), json!(entity));
        }
        let item = json!({
            "kind": config.kind, "resource": resource, "key": record.key,
            "entity": record.entity, "attrs": attrs, "undo": config.undo,
        });
        bytes += item.to_string().len() + 1;
        // Fewer items rather than more bytes than one NATS message may carry.
        if items.len() == limit || bytes > bytes_max {
            more = true;
            break;
        }
        items.push(item);
    }
    let next = match more {
        true => items.last().map(|i| i["resource"].clone()),
        false => None,
    };
    json!({"items": items, "next": next})
}

fn create(state: &mut State, payload: &[u8]) -> Value {
    let request: CreateRequest = match serde_json::from_slice(payload) {
        Ok(r) => r,
        Err(e) => return json!({"ok": false, "error": format!("not a create request: {e}")}),
    };
    if let Some(key) = &request.key {
        if state.fenced.contains(key) {
            return json!({"ok": false, "error": "undone"});
        }
        // The same request again: the same result.
        if let Some((resource, _)) = state
            .records
            .iter()
            .find(|(_, r)| r.key.as_ref() == Some(key))
        {
            return json!({"ok": true, "resource": resource});
        }
    }
    if state.records.contains_key(&request.resource) {
        return json!({"ok": false, "error": format!("{} is taken", request.resource)});
    }
    state.records.insert(
        request.resource.clone(),
        Record {
            key: request.key,
            entity: request.entity,
        },
    );
    json!({"ok": true, "resource": request.resource})
}

fn arg(args: &[String], flag: &str) -> Option<String> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let url = arg(&args, "--nats").unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let config = Arc::new(Config {
        subject_prefix: arg(&args, "--prefix").unwrap_or_else(|| "provledger".into()),
        name: arg(&args, "--name").unwrap_or_else(|| "dns".into()),
        kind: arg(&args, "--kind").unwrap_or_else(|| "dns_record".into()),
        undo: arg(&args, "--undo").unwrap_or_else(|| "unregister_dns".into()),
    });
    let client = async_nats::connect(&url).await?;
    // Half the server's max payload for items, the rest for the envelope.
    let bytes_max = client.server_info().max_payload / 2;
    let base = format!("{}.exec.{}", config.subject_prefix, config.name);
    // One subscription for the three subjects; each request is answered in order, so a
    // compensation and a page never see a half-applied change.
    let mut requests = client.subscribe(format!("{base}.*")).await?;
    let state = Arc::new(Mutex::new(State::default()));
    eprintln!(
        "reference-executor {} answering {base}.{{compensate,inventory,create}}",
        config.name
    );
    while let Some(message) = requests.next().await {
        let Some(reply) = message.reply.clone() else {
            continue; // not a request: nothing to answer
        };
        let answer = {
            // A poisoned lock only means an earlier handler panicked; the state is still
            // consistent, since every change above is a single map operation.
            let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
            match message.subject.as_str().rsplit('.').next() {
                Some("compensate") => compensate(&mut state, &message.payload),
                Some("inventory") => inventory(&state, &config, &message.payload, bytes_max),
                Some("create") => create(&mut state, &message.payload),
                _ => json!({"error": format!("no such request: {}", message.subject)}),
            }
        };
        client.publish(reply, answer.to_string().into()).await?;
    }
    Ok(())
}
