//! The machine-readable description of the NATS interface: the JSON Schemas in
//! `docs/schemas/` and the AsyncAPI document `docs/asyncapi.json` are generated from the
//! Rust types that build the messages (`provledger_serve::messages`, the catalogue, the
//! entity views, the client's executor and worker messages). These tests
//! - fail when a committed file differs from what the types generate (regenerate with
//!   `PROVLEDGER_WRITE_SCHEMAS=1 cargo test -p provledger-serve --test suite schemas::`);
//! - validate every JSON example of `docs/` against the schema of the message it shows
//!   (the convention is in `docs/schemas.md`);
//! - validate real values the code produces (entity views folded from random histories,
//!   commits, events) against their schemas, so a serde attribute the schema misses fails.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use provledger_events::catalogue::samples;
use provledger_events::{Commit, Event};
use provledger_projections::view::{
    ClusterView, InstanceView, OperationSummary, OperationView, ProviderView,
};
use provledger_projections::{Entity, Projection};
use provledger_serve::messages::*;
use provledger_tests::docs::{comment, fenced_block};
use schemars::generate::SchemaSettings;
use schemars::{schema_for, Schema};
use serde_json::{json, Value};

/// The command that rewrites the committed files from the types.
const REGENERATE: &str =
    "PROVLEDGER_WRITE_SCHEMAS=1 cargo test -p provledger-serve --test suite schemas::";

/// One channel of the interface: its subject (below `provledger.`), who sends what, and
/// the schema files of its messages.
struct Channel {
    subject: &'static str,
    summary: &'static str,
    /// Who sends the first message: `receive` when provledger answers it (queries and
    /// commands), `send` when provledger sends it (notices, executors, workers).
    action: &'static str,
    message: &'static str,
    /// The schema of the answer, for request/reply subjects.
    reply: Option<&'static str>,
    content_type: &'static str,
}

const JSON: &str = "application/json";

const CHANNELS: &[Channel] = &[
    Channel { subject: "q.health", summary: "Readiness, position and lag of the replica that answers.", action: "receive", message: "q.health.request", reply: Some("q.health.reply"), content_type: JSON },
    Channel { subject: "q.cluster.get", summary: "One cluster.", action: "receive", message: "q.get.request", reply: Some("q.cluster.get.reply"), content_type: JSON },
    Channel { subject: "q.cluster.list", summary: "A page of clusters in id order.", action: "receive", message: "q.cluster.list.request", reply: Some("q.cluster.list.reply"), content_type: JSON },
    Channel { subject: "q.instance.get", summary: "One instance, with its task's worker and lease.", action: "receive", message: "q.get.request", reply: Some("q.instance.get.reply"), content_type: JSON },
    Channel { subject: "q.instance.list", summary: "A page of instances in id order.", action: "receive", message: "q.instance.list.request", reply: Some("q.instance.list.reply"), content_type: JSON },
    Channel { subject: "q.provider.get", summary: "One resource provider.", action: "receive", message: "q.get.request", reply: Some("q.provider.get.reply"), content_type: JSON },
    Channel { subject: "q.provider.list", summary: "A page of providers in id order.", action: "receive", message: "q.provider.list.request", reply: Some("q.provider.list.reply"), content_type: JSON },
    Channel { subject: "q.allocation.by_consumer", summary: "A consumer's allocations on every provider.", action: "receive", message: "q.allocation.by_consumer.request", reply: Some("q.allocation.by_consumer.reply"), content_type: JSON },
    Channel { subject: "q.operation.get", summary: "One operation.", action: "receive", message: "q.get.request", reply: Some("q.operation.get.reply"), content_type: JSON },
    Channel { subject: "q.operation.list", summary: "A page of operations, newest first, by status, kind, target or start time.", action: "receive", message: "q.operation.list.request", reply: Some("q.operation.list.reply"), content_type: JSON },
    Channel { subject: "q.changes", summary: "A follower's catch-up: the log's commits after a position, in position order, filtered, in bounded pages.", action: "receive", message: "q.changes.request", reply: Some("q.changes.reply"), content_type: JSON },
    Channel { subject: "q.id.resolve", summary: "Which entities a short id (an id's last hex digits, or its start) names.", action: "receive", message: "q.id.resolve.request", reply: Some("q.id.resolve.reply"), content_type: JSON },
    Channel { subject: "q.drift", summary: "The last drift sweep of the replica that answers (serve --drift-interval).", action: "receive", message: "q.drift.request", reply: Some("q.drift.reply"), content_type: JSON },
    Channel { subject: "q.history", summary: "A page of an aggregate's commits, decoded.", action: "receive", message: "q.history.request", reply: Some("q.history.reply"), content_type: JSON },
    Channel { subject: "q.state_at", summary: "An aggregate's state at a position or a time.", action: "receive", message: "q.state_at.request", reply: Some("q.state_at.reply"), content_type: JSON },
    Channel { subject: "cmd.append", summary: "Appends one commit, or several all or nothing.", action: "receive", message: "cmd.append.request", reply: Some("cmd.append.reply"), content_type: JSON },
    Channel { subject: "cmd.provider.delete", summary: "Deletes a provider, refused while allocations remain unless cascaded.", action: "receive", message: "cmd.provider.delete.request", reply: Some("cmd.provider.delete.reply"), content_type: JSON },
    Channel { subject: "cmd.heal_allocations", summary: "Claims the missing allocations of instances with a host.", action: "receive", message: "cmd.heal_allocations.request", reply: Some("cmd.heal_allocations.reply"), content_type: JSON },
    Channel { subject: "cmd.fix_orphans", summary: "Releases allocations whose consumer or provider is gone.", action: "receive", message: "cmd.fix_orphans.request", reply: Some("cmd.fix_orphans.reply"), content_type: JSON },
    Channel { subject: "cmd.worker.ready", summary: "A worker listens again: its pending re-issues go at once.", action: "receive", message: "cmd.worker.ready.request", reply: Some("cmd.worker.ready.reply"), content_type: JSON },
    Channel { subject: "ev.{kind}.{id}", summary: "One message per commit on stream PROVLEDGER; header Nats-Msg-Id is the commit_id. The payload is bincode with a leading format byte; its decoded (JSON) form is the commit schema, as q.history answers it.", action: "send", message: "commit", reply: None, content_type: "application/octet-stream" },
    Channel { subject: "feed.{kind}.{id}", summary: "The live feed: each change a replica applied, as q.changes gives it, with prev (no change lies between prev and position); core NATS, once per replica.", action: "send", message: "feed.change", reply: None, content_type: JSON },
    Channel { subject: "feed.bookmark", summary: "Every 5 s from each replica: it published every change up to position.", action: "send", message: "feed.bookmark", reply: None, content_type: JSON },
    Channel { subject: "cancel.{operation_id}", summary: "Notice that an operation is cancelled (its target is being deleted); the payload is the reason as plain text.", action: "send", message: "cancel.notice", reply: None, content_type: "text/plain" },
    Channel { subject: "exec.{executor}.compensate", summary: "A compensation asked of an executor; it must be idempotent by compensation_id.", action: "send", message: "exec.compensate.request", reply: Some("exec.compensate.reply"), content_type: JSON },
    Channel { subject: "exec.{executor}.inventory", summary: "A page of the resources an executor holds, for provledger drift (docs/drift.md).", action: "send", message: "exec.inventory.request", reply: Some("exec.inventory.reply"), content_type: JSON },
    Channel { subject: "worker.{worker_id}.reissue", summary: "A task re-issued to its worker by a recovery, retried until acknowledged.", action: "send", message: "worker.reissue.request", reply: Some("worker.reissue.reply"), content_type: JSON },
];

/// The schema of what provledger reads: a field serde may miss (`Option`, `default`) is
/// optional.
fn schema_of<T: schemars::JsonSchema>() -> Schema {
    schema_for!(T)
}

/// The schema of what provledger writes: a field is required unless it is skipped when
/// empty (`skip_serializing_if`), so a reply that lost a field no longer matches.
fn sent<T: schemars::JsonSchema>() -> Schema {
    SchemaSettings::draft2020_12()
        .for_serialize()
        .into_generator()
        .into_root_schema_for::<T>()
}

/// Every schema file, by name (the file is `docs/schemas/<name>.json`).
fn schemas() -> BTreeMap<&'static str, Schema> {
    BTreeMap::from([
        ("event", schema_of::<Event>()),
        ("commit", sent::<Commit>()),
        ("error", sent::<ErrorReply>()),
        ("cancel.notice", Schema::from(json!({"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "CancelNotice", "description": "The reason, as plain text (not JSON).", "type": "string"}).as_object().cloned().unwrap_or_default())),
        ("q.health.request", schema_of::<HealthRequest>()),
        ("q.health.reply", sent::<Reply<HealthData>>()),
        ("q.get.request", schema_of::<GetRequest>()),
        ("q.cluster.get.reply", sent::<Reply<ClusterView>>()),
        ("q.cluster.list.request", schema_of::<ClusterListRequest>()),
        ("q.cluster.list.reply", sent::<Reply<Vec<ClusterView>>>()),
        ("q.instance.get.reply", sent::<Reply<InstanceView>>()),
        ("q.instance.list.request", schema_of::<InstanceListRequest>()),
        ("q.instance.list.reply", sent::<Reply<Vec<InstanceView>>>()),
        ("q.provider.get.reply", sent::<Reply<ProviderView>>()),
        ("q.provider.list.request", schema_of::<ProviderListRequest>()),
        ("q.provider.list.reply", sent::<Reply<Vec<ProviderView>>>()),
        ("q.allocation.by_consumer.request", schema_of::<AllocationByConsumerRequest>()),
        ("q.allocation.by_consumer.reply", sent::<Reply<Vec<ConsumerAllocation>>>()),
        ("q.operation.get.reply", sent::<Reply<OperationView>>()),
        ("q.operation.list.request", schema_of::<OperationListRequest>()),
        ("q.operation.list.reply", sent::<Reply<Vec<OperationSummary>>>()),
        ("feed.change", sent::<FeedChange>()),
        ("feed.bookmark", sent::<FeedBookmark>()),
        ("q.changes.request", schema_of::<ChangesRequest>()),
        ("q.changes.reply", sent::<Reply<ChangesData>>()),
        ("q.id.resolve.request", schema_of::<IdResolveRequest>()),
        ("q.id.resolve.reply", sent::<Reply<IdResolveData>>()),
        ("q.drift.request", schema_of::<DriftRequest>()),
        ("q.drift.reply", sent::<Reply<DriftData>>()),
        ("q.history.request", schema_of::<HistoryRequest>()),
        ("q.history.reply", sent::<Reply<Vec<HistoryItem>>>()),
        ("q.state_at.request", schema_of::<StateAtRequest>()),
        ("q.state_at.reply", sent::<Reply<StateAtData>>()),
        ("cmd.append.request", schema_of::<CmdAppendRequest>()),
        ("cmd.append.reply", sent::<Reply<CmdAppendData>>()),
        ("cmd.provider.delete.request", schema_of::<ProviderDeleteRequest>()),
        ("cmd.provider.delete.reply", sent::<Reply<ProviderDeleteData>>()),
        ("cmd.heal_allocations.request", schema_of::<HealAllocationsRequest>()),
        ("cmd.heal_allocations.reply", sent::<Reply<HealData>>()),
        ("cmd.fix_orphans.request", schema_of::<FixOrphansRequest>()),
        ("cmd.fix_orphans.reply", sent::<Reply<FixOrphansData>>()),
        ("cmd.worker.ready.request", schema_of::<WorkerReadyRequest>()),
        ("cmd.worker.ready.reply", sent::<Reply<WorkerReadyData>>()),
        ("exec.compensate.request", sent::<ExecutorRequest>()),
        ("exec.compensate.reply", schema_of::<ExecutorReply>()),
        ("exec.inventory.request", sent::<provledger_client::inventory::InventoryRequest>()),
        ("exec.inventory.reply", schema_of::<provledger_client::inventory::InventoryPage>()),
        ("worker.reissue.request", sent::<WorkerReissueRequest>()),
        ("worker.reissue.reply", schema_of::<WorkerReissueReply>()),
        // Not a NATS message: what `provledger recover --json` prints.
        ("cli.recover", sent::<provledger_client::recovery::RecoverReport>()),
    ])
}

fn docs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

fn pretty(value: &Value) -> String {
    let mut text = serde_json::to_string_pretty(value).expect("a schema is JSON");
    text.push('\n');
    text
}

/// The AsyncAPI 3.0 document: one channel per subject, each message's payload a
/// reference to its schema file, every reply of a request/reply subject possibly the
/// error reply instead.
fn asyncapi() -> Value {
    let mut channels = serde_json::Map::new();
    let mut operations = serde_json::Map::new();
    let mut messages = serde_json::Map::new();
    let mut message = |name: &str, content_type: &str| {
        let id = name.replace('.', "_");
        messages.insert(
            id.clone(),
            json!({
                "name": name,
                "contentType": content_type,
                "payload": {"$ref": format!("./schemas/{name}.json")},
            }),
        );
        json!({"$ref": format!("#/components/messages/{id}")})
    };
    for c in CHANNELS {
        let id = c.subject.replace(['{', '}'], "").replace('.', "_");
        let mut channel_messages = serde_json::Map::new();
        channel_messages.insert("message".into(), message(c.message, c.content_type));
        if let Some(reply) = c.reply {
            channel_messages.insert("reply".into(), message(reply, JSON));
            if c.action == "receive" {
                channel_messages.insert("error".into(), message("error", JSON));
            }
        }
        let parameters: serde_json::Map<String, Value> = c
            .subject
            .split('.')
            .filter_map(|t| t.strip_prefix('{')?.strip_suffix('}'))
            .map(|p| {
                (
                    p.to_string(),
                    json!({"description": format!("the {p} token")}),
                )
            })
            .collect();
        let mut channel = json!({
            "address": format!("provledger.{}", c.subject),
            "summary": c.summary,
            "messages": channel_messages,
        });
        if !parameters.is_empty() {
            channel["parameters"] = Value::Object(parameters);
        }
        channels.insert(id.clone(), channel);
        let mut operation = json!({
            "action": c.action,
            "channel": {"$ref": format!("#/channels/{id}")},
            "summary": c.summary,
            "messages": [{"$ref": format!("#/channels/{id}/messages/message")}],
        });
        if c.reply.is_some() {
            let mut replies = vec![json!({"$ref": format!("#/channels/{id}/messages/reply")})];
            if c.action == "receive" {
                replies.push(json!({"$ref": format!("#/channels/{id}/messages/error")}));
            }
            operation["reply"] = json!({
                "address": {"location": "$message.header#/reply_to", "description": "the requester's inbox (NATS request/reply)"},
                "channel": {"$ref": format!("#/channels/{id}")},
                "messages": replies,
            });
        }
        operations.insert(id, operation);
    }
    json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": "provledger",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The NATS interface of provledger, generated from its Rust types (services/serve/tests/schemas.rs). Subjects are shown with the default prefix `provledger` (`--subject-prefix`). Queries and commands are the NATS micro service `provledger` (queue group `provledger`; `$SRV.PING`, `$SRV.INFO` and `$SRV.STATS` answer as for any micro service). An error reply also sets the headers `Nats-Service-Error` and `Nats-Service-Error-Code`. Human documentation: docs/schemas.md.",
        },
        "defaultContentType": JSON,
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages},
    })
}

/// Every generated file, by its path under `docs/`.
fn generated() -> BTreeMap<String, String> {
    let mut files: BTreeMap<String, String> = schemas()
        .into_iter()
        .map(|(name, schema)| (format!("schemas/{name}.json"), pretty(schema.as_value())))
        .collect();
    files.insert("asyncapi.json".into(), pretty(&asyncapi()));
    files
}

#[test]
fn committed_schemas_and_asyncapi_match_what_the_types_generate() {
    // Given the files the types generate
    let files = generated();
    if std::env::var_os("PROVLEDGER_WRITE_SCHEMAS").is_some() {
        let dir = docs_dir().join("schemas");
        if dir.exists() {
            std::fs::remove_dir_all(&dir).expect("remove docs/schemas");
        }
        std::fs::create_dir_all(&dir).expect("create docs/schemas");
        for (path, text) in &files {
            std::fs::write(docs_dir().join(path), text).expect("write a schema");
        }
    }
    // When they are compared with the committed ones
    let mut stale = Vec::new();
    for (path, text) in &files {
        match std::fs::read_to_string(docs_dir().join(path)) {
            Ok(committed) if &committed == text => {}
            Ok(_) => stale.push(format!("docs/{path} differs")),
            Err(_) => stale.push(format!("docs/{path} is missing")),
        }
    }
    let committed_names: BTreeSet<String> = std::fs::read_dir(docs_dir().join("schemas"))
        .map(|d| {
            d.flatten()
                .map(|e| format!("schemas/{}", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default();
    for extra in committed_names.iter().filter(|n| !files.contains_key(*n)) {
        stale.push(format!("docs/{extra} is not generated by any type"));
    }
    // Then none differs
    assert!(
        stale.is_empty(),
        "{}\nregenerate with: {REGENERATE}",
        stale.join("\n")
    );
}

#[test]
fn every_subject_the_service_answers_has_a_channel() {
    // Given the subjects serve answers
    let served: BTreeSet<&str> = provledger_serve::endpoint_subjects().into_iter().collect();
    // When compared with the AsyncAPI channels of queries and commands
    let described: BTreeSet<&str> = CHANNELS
        .iter()
        .filter(|c| c.action == "receive")
        .map(|c| c.subject)
        .collect();
    // Then they are the same set
    assert_eq!(
        served, described,
        "a served subject without a channel, or a channel nobody serves"
    );
}

#[test]
fn every_request_type_lists_exactly_the_fields_its_endpoint_accepts() {
    // Given each request type's schema and the field list its endpoint checks
    fn check<T: schemars::JsonSchema + RequestFields>() {
        let schema = schema_for!(T);
        let documented: BTreeSet<String> = schema
            .get("properties")
            .and_then(Value::as_object)
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        let accepted: BTreeSet<String> = T::FIELDS.iter().map(|f| f.to_string()).collect();
        // Then the schema documents every accepted field and no other
        assert_eq!(documented, accepted, "{}", std::any::type_name::<T>());
        // And refuses any other field, as the endpoint does
        assert_eq!(
            schema.get("additionalProperties"),
            Some(&json!(false)),
            "{}",
            std::any::type_name::<T>()
        );
    }
    check::<HealthRequest>();
    check::<GetRequest>();
    check::<ClusterListRequest>();
    check::<InstanceListRequest>();
    check::<OperationListRequest>();
    check::<ProviderListRequest>();
    check::<AllocationByConsumerRequest>();
    check::<HistoryRequest>();
    check::<StateAtRequest>();
    check::<AppendRequest>();
    check::<AtomicAppendRequest>();
    check::<ProviderDeleteRequest>();
    check::<HealAllocationsRequest>();
    check::<FixOrphansRequest>();
    check::<WorkerReadyRequest>();
    check::<DriftRequest>();
    check::<IdResolveRequest>();
    check::<ChangesRequest>();
}

// ---- validation ----

/// A validator for one schema file; `formats`: also check `format` (uuid, date-time),
/// which docs' placeholders (`"<instance id>"`) would not pass.
fn validator(name: &str, formats: bool) -> jsonschema::Validator {
    let schemas = schemas();
    let schema = schemas.get(name).unwrap_or_else(|| {
        panic!("no schema named {name:?}; the names are the files of docs/schemas")
    });
    jsonschema::options()
        .should_validate_formats(formats)
        .build(schema.as_value())
        .unwrap_or_else(|e| panic!("schema {name} does not compile: {e}"))
}

fn errors(validator: &jsonschema::Validator, value: &Value) -> Vec<String> {
    validator
        .iter_errors(value)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}

fn reply(data: Value) -> Value {
    json!({"position": 7, "data": data, "served_by": "replica-1"})
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn entity_views_folded_from_random_histories_match_their_schemas(script in provledger_tests::script::script(40)) {
        // Given a projection folded from a random, sealed history
        let commits = provledger_tests::script::seal(&script);
        let projection = Projection::rebuild(&commits);
        let get = |name: &str| validator(name, true);
        let (cluster, instance, provider, operation) = (get("q.cluster.get.reply"), get("q.instance.get.reply"), get("q.provider.get.reply"), get("q.operation.get.reply"));
        let commit_schema = get("commit");
        // When each entity's view is sent as a reply
        for entity in projection.entities.values() {
            let v = match entity {
                Entity::Cluster(_) => &cluster,
                Entity::Instance(_) => &instance,
                Entity::Provider(_) => &provider,
                Entity::Operation(_) => &operation,
            };
            // Then it matches its schema
            let errs = errors(v, &reply(entity.view()));
            prop_assert!(errs.is_empty(), "{}: {:?}\n{:#}", entity.id(), errs, entity.view());
        }
        // And every commit's JSON matches the commit schema
        for commit in &commits {
            let value = serde_json::to_value(commit).expect("a commit is JSON");
            let errs = errors(&commit_schema, &value);
            prop_assert!(errs.is_empty(), "{:?}\n{:#}", errs, value);
        }
    }
}

#[test]
fn every_sample_event_matches_the_event_schema_and_wrong_ones_do_not() {
    // Given the event schema
    let event = validator("event", true);
    // When every sample event (one per variant) is checked
    for sample in samples::all() {
        let value = serde_json::to_value(&sample).expect("an event is JSON");
        // Then it matches
        assert!(
            errors(&event, &value).is_empty(),
            "{:?}\n{value:#}",
            errors(&event, &value)
        );
    }
    // And an unknown event, a missing field and a bad enum word do not
    for wrong in [
        json!({"cluster_exploded": {}}),
        json!({"task_queued": {}}),
        json!({"vm_state_changed": {"vm_state": "flying", "reason": ""}}),
        json!({"inventory_set": {"resource_class": "VCPU", "inventory": {"total": 1, "reserved": 0, "allocation_ratio": 0, "min_unit": 1, "max_unit": 1, "step_size": 1}}}),
    ] {
        assert!(
            !errors(&event, &wrong).is_empty(),
            "{wrong} should not match"
        );
    }
}

// ---- the examples of docs/ ----

/// One ```json block of a doc: where it is, the schema it shows, its JSON documents.
struct DocExample {
    place: String,
    schema: String,
    documents: Vec<Value>,
    /// Under an event's heading in `docs/events.md`: the event it must be.
    event_heading: Option<String>,
}

/// Every ```json block of one doc with the schema it names. The rules (docs/schemas.md):
/// `<!-- schema: NAME -->` before a block names its schema (a file of docs/schemas, or
/// `none` with a reason for what is not a message); a block inside a marked example of
/// docs/writing-operations.md is a `cmd.append` request; a block under an event's heading
/// in docs/events.md is that event. Any other block is an error, so none is left out.
fn doc_examples(path: &Path) -> Vec<DocExample> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    let mut marker: Option<String> = None;
    let mut in_example = false;
    let mut heading: Option<String> = None;
    let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
    while let Some((n, line)) = lines.next() {
        let place = format!("docs/{name}:{n}");
        if let Some(title) = line.strip_prefix("### ") {
            heading = title
                .trim()
                .strip_prefix('`')
                .and_then(|t| t.strip_suffix('`'))
                .map(str::to_string);
        } else if line.starts_with('#') {
            heading = None;
        }
        if comment(line, "example:").is_some() {
            in_example = true;
        } else if comment(line, "end example").is_some() {
            in_example = false;
        } else if let Some(word) = comment(line, "schema:") {
            assert!(
                marker.is_none(),
                "{place}: two schema markers for one block"
            );
            let word = word.split_whitespace().next().unwrap_or_default();
            marker = Some(word.to_string());
        } else if line.trim() == "```json" {
            let body = fenced_block(&mut lines, &place);
            let event_heading = (name == "events.md").then(|| heading.clone()).flatten();
            let schema = match (marker.take(), in_example, &event_heading) {
                (Some(m), _, _) => m,
                (None, true, _) => "cmd.append.request".to_string(),
                (None, false, Some(_)) => "event".to_string(),
                (None, false, None) => panic!(
                    "{place}: a ```json block without a `<!-- schema: NAME -->` marker (docs/schemas.md says how)"
                ),
            };
            let documents = serde_json::Deserializer::from_str(&body)
                .into_iter::<Value>()
                .collect::<Result<Vec<_>, _>>()
                .unwrap_or_else(|e| panic!("{place}: not JSON: {e}"));
            assert!(!documents.is_empty(), "{place}: an empty block");
            out.push(DocExample {
                place,
                schema,
                documents,
                event_heading,
            });
        } else if marker.is_some() && !line.trim().is_empty() && comment(line, "").is_none() {
            panic!("{place}: a schema marker must come right before its ```json block");
        }
    }
    out
}

fn all_doc_examples() -> Vec<DocExample> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(docs_dir())
        .expect("docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    paths.sort();
    paths.iter().flat_map(|p| doc_examples(p)).collect()
}

#[test]
fn every_json_example_in_docs_matches_the_schema_of_its_message() {
    // Given every ```json block of docs/ with the message it shows
    let examples = all_doc_examples();
    let mut validators: BTreeMap<String, jsonschema::Validator> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for example in &examples {
        if example.schema == "none" {
            continue;
        }
        let v = validators
            .entry(example.schema.clone())
            .or_insert_with(|| validator(&example.schema, false));
        // When each of its documents is validated
        for doc in &example.documents {
            checked += 1;
            for e in errors(v, doc) {
                failures.push(format!("{} ({}): {e}", example.place, example.schema));
            }
            if let (Some(event), Some(key)) = (
                &example.event_heading,
                doc.as_object().and_then(|o| o.keys().next()),
            ) {
                if example.schema == "event" && key != event {
                    failures.push(format!(
                        "{}: the example of `{event}` is a `{key}`",
                        example.place
                    ));
                }
            }
        }
    }
    // Then every one matches, and the docs hold examples of the messages at all
    assert!(
        failures.is_empty(),
        "{} example(s) do not match their schema:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        checked > 150,
        "only {checked} examples found: is the docs parser broken?"
    );
}
