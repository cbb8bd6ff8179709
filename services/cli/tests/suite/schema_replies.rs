//! Real replies of a running `provledger serve` against the committed JSON Schemas of
//! `docs/schemas/`: given a provider, a cluster, an instance holding a task lease and an
//! allocation, and an operation, written over `cmd.append` (one commit and several at
//! once), when every endpoint is asked, then every reply and error matches the schema of
//! its message, formats (uuid, date-time) included. The schemas are generated from the
//! types (`provledger-serve`'s `tests/schemas.rs`); this checks them against what the
//! wire really carries.

use std::path::PathBuf;
use std::time::Duration;

use provledger_events::Timestamp;
use provledger_tests::NatsServer;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::common::{provledger, text, wait_ready, Serve};

const REPLY_WAIT: Duration = Duration::from_secs(10);

fn validator(name: &str) -> jsonschema::Validator {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/schemas")
        .join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let schema: Value = serde_json::from_str(&text).expect("a schema is JSON");
    jsonschema::options()
        .should_validate_formats(true)
        .build(&schema)
        .unwrap_or_else(|e| panic!("{name} does not compile: {e}"))
}

fn assert_matches(value: &Value, schema: &str, what: &str) {
    let errors: Vec<String> = validator(schema)
        .iter_errors(value)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{what} does not match {schema}: {errors:?}\n{value:#}"
    );
}

/// Asks `subject` and checks the answer against `schema`; returns the answer.
async fn ask(client: &async_nats::Client, subject: &str, body: Value, schema: &str) -> Value {
    let reply = tokio::time::timeout(
        REPLY_WAIT,
        client.request(format!("provledger.{subject}"), body.to_string().into()),
    )
    .await
    .unwrap_or_else(|_| panic!("no reply on {subject}"))
    .unwrap_or_else(|e| panic!("request on {subject}: {e}"));
    let value: Value = serde_json::from_slice(&reply.payload).expect("a JSON reply");
    assert_matches(&value, schema, subject);
    value
}

fn in_seconds(s: i64) -> String {
    Timestamp::from_unix_ms(Timestamp::now().0 + s * 1000).to_rfc3339()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_answers_what_its_schema_says() {
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let client = nats.client().await;
    let _serve = Serve::start(&nats, &tmp.path().join("serve"));
    wait_ready(&client).await;
    let (p, c, i, op) = (
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
    );

    // Given a provider with an inventory, a cluster, and an operation (one commit each)
    let one = |aggregate: String, events: Value| json!({"aggregate": aggregate, "expect": "any", "events": events});
    for request in [
        one(
            format!("provider/{p}"),
            json!([
            {"provider_registered": {"name": "cn1", "host": "cn1"}},
            {"inventory_set": {"resource_class": "VCPU", "inventory": {"total": 8, "reserved": 0,
                "allocation_ratio": 1.5, "min_unit": 1, "max_unit": 8, "step_size": 1}}}]),
        ),
        one(
            format!("cluster/{c}"),
            json!([{"cluster_create_requested": {"name": "c1",
            "plugin": "vanilla", "node_groups": [{"name": "workers", "count": 1, "flavor": "m1",
            "resources": {"VCPU": 2}, "processes": ["datanode"]}]}}]),
        ),
        one(
            format!("operation/{op}"),
            json!([{"operation_started": {"kind": "boot_instance",
            "target": format!("instance/{i}"), "parent_id": null, "stages": [
            {"name": "schedule", "policy": "compensate"}], "bundle_policy": null}}]),
        ),
    ] {
        ask(&client, "cmd.append", request, "cmd.append.reply").await;
    }
    // And an instance placed on the provider with its claim, written together, whose task
    // a worker started with a lease
    let together = json!({"commits": [
        {"aggregate": format!("instance/{i}"), "expect": "none", "events": [
            {"instance_create_requested": {"name": "vm", "cluster_id": c, "node_group": "workers",
                "flavor": "m1", "resources": {"VCPU": 2}, "image": "img"}},
            {"host_assigned": {"host": "cn1", "provider_id": p}},
            {"task_started": {"task_state": "spawning", "worker_id": "compute-1",
                "lease_until": in_seconds(600)}}]},
        {"aggregate": format!("provider/{p}"), "expect": "any", "events": [
            {"allocation_claimed": {"consumer": i, "consumer_kind": "instance",
                "resources": {"VCPU": 2}}}]}]});
    let written = ask(&client, "cmd.append", together, "cmd.append.reply").await;
    let position = written["data"]["commits"][1]["position"].clone();

    // When every query is asked, then its reply matches its schema
    let get = json!({"min_position": position});
    let with_id = |id: Uuid| {
        let mut r = get.clone();
        r["id"] = json!(id);
        r
    };
    ask(&client, "q.health", json!({}), "q.health.reply").await;
    ask(&client, "q.cluster.get", with_id(c), "q.cluster.get.reply").await;
    let instance = ask(
        &client,
        "q.instance.get",
        with_id(i),
        "q.instance.get.reply",
    )
    .await;
    assert_eq!(instance["data"]["task_worker"], "compute-1", "{instance:#}");
    ask(
        &client,
        "q.provider.get",
        with_id(p),
        "q.provider.get.reply",
    )
    .await;
    ask(
        &client,
        "q.operation.get",
        with_id(op),
        "q.operation.get.reply",
    )
    .await;
    ask(
        &client,
        "q.cluster.list",
        json!({"status": "requested"}),
        "q.cluster.list.reply",
    )
    .await;
    ask(
        &client,
        "q.instance.list",
        json!({"host": "cn1"}),
        "q.instance.list.reply",
    )
    .await;
    ask(
        &client,
        "q.provider.list",
        json!({}),
        "q.provider.list.reply",
    )
    .await;
    ask(
        &client,
        "q.operation.list",
        json!({"status": "running"}),
        "q.operation.list.reply",
    )
    .await;
    let by_consumer = json!({"consumer": i});
    let allocations = ask(
        &client,
        "q.allocation.by_consumer",
        by_consumer,
        "q.allocation.by_consumer.reply",
    )
    .await;
    assert_eq!(
        allocations["data"][0]["provider_id"],
        json!(p),
        "{allocations:#}"
    );
    let changes = ask(&client, "q.changes", json!({}), "q.changes.reply").await;
    assert_eq!(
        changes["data"]["changes"].as_array().map(Vec::len),
        Some(5),
        "{changes:#}"
    );
    let resolved = ask(
        &client,
        "q.id.resolve",
        json!({"id": provledger_events::short_id(&op)}),
        "q.id.resolve.reply",
    )
    .await;
    assert_eq!(
        resolved["data"]["matches"],
        json!([format!("operation/{op}")]),
        "{resolved:#}"
    );
    let aggregate = format!("instance/{i}");
    ask(
        &client,
        "q.history",
        json!({"aggregate": aggregate}),
        "q.history.reply",
    )
    .await;
    ask(
        &client,
        "q.state_at",
        json!({"aggregate": aggregate}),
        "q.state_at.reply",
    )
    .await;
    ask(
        &client,
        "cmd.worker.ready",
        json!({"worker": "compute-1"}),
        "cmd.worker.ready.reply",
    )
    .await;
    ask(
        &client,
        "cmd.heal_allocations",
        json!({"dry_run": true}),
        "cmd.heal_allocations.reply",
    )
    .await;
    ask(
        &client,
        "cmd.fix_orphans",
        json!({"dry_run": true}),
        "cmd.fix_orphans.reply",
    )
    .await;

    // And the errors match the error schema: a refused delete with its holds, a stale
    // version, an unknown id, a malformed request, a claim that does not fit
    let refused = ask(&client, "cmd.provider.delete", json!({"id": p}), "error").await;
    assert_eq!(
        refused["error"]["reason"], "allocations_remain",
        "{refused:#}"
    );
    let stale = one(
        format!("cluster/{c}"),
        json!([{"cluster_status_changed": {"status": "spawning", "description": ""}}]),
    );
    let mut stale = stale;
    stale["expect"] = json!(7);
    ask(&client, "cmd.append", stale, "error").await;
    ask(&client, "q.cluster.get", with_id(Uuid::now_v7()), "error").await;
    ask(&client, "q.cluster.get", json!({"id": "nope"}), "error").await;
    let too_big = one(
        format!("provider/{p}"),
        json!([{"allocation_claimed": {"consumer": Uuid::now_v7(),
        "consumer_kind": "instance", "resources": {"VCPU": 40}}}]),
    );
    let rejected = ask(&client, "cmd.append", too_big, "error").await;
    assert_eq!(rejected["error"]["code"], "rejected", "{rejected:#}");
}

#[test]
fn recover_json_prints_what_its_schema_says() {
    // Given an embedded ledger with an instance whose worker died while powering it off
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let id = Uuid::now_v7();
    let events = json!([
        {"instance_create_requested": {"name": "vm", "cluster_id": null, "node_group": null,
            "flavor": "m1", "resources": {"VCPU": 1}, "image": "img"}},
        {"task_started": {"task_state": "powering_off", "worker_id": "compute-1",
            "lease_until": in_seconds(2)}}]);
    let aggregate = format!("instance/{id}");
    let args = [
        "--data-dir",
        d,
        "append",
        &aggregate,
        "--expect",
        "none",
        "--events",
        "-",
    ];
    let out = provledger(&args, &events.to_string());
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    std::thread::sleep(Duration::from_millis(2_500));
    // When a recovery sweep runs with --json
    let out = provledger(&["--data-dir", d, "--json", "recover"], "");
    // Then it recovered the task, left its re-issue pending, and printed the schema's form
    let printed: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&out)));
    assert_eq!(
        printed["pending_reissues"][0]["worker"], "compute-1",
        "{printed:#}"
    );
    assert_matches(&printed, "cli.recover", "recover --json");
}
