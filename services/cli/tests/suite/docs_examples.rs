//! The examples of `docs/writing-operations.md`, replayed against `provledger serve` on a
//! private nats-server: every request of every example is sent to `provledger.cmd.append`
//! in document order and must be accepted (with the reply `outcome` the document states),
//! then each example's operation must reach the final status the document states, and its
//! target the stated status with no operation left in flight. At the end no aggregate the
//! examples wrote may hold an anomaly (an out-of-place event the ledger accepted).
//!
//! The document marks its examples with HTML comments:
//! - `<!-- example: KIND operation=UUID status=STATUS target_status=STATUS -->` opens one
//!   (`setup` takes no attributes; `target_status` is optional), `<!-- end example -->`
//!   closes it, and every ```json block in between is one request, in order;
//! - `<!-- outcome: WORD -->` right before a block: the reply's `outcome` is WORD
//!   (`already_appended`, `already_deleting`, ...) instead of `appended`.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use provledger_tests::docs::{comment, fenced_block};
use provledger_tests::NatsServer;
use serde_json::{json, Value};

use crate::common::{wait_ready, Serve};

/// Every operation kind the document must show, one example each.
const KINDS: [&str; 10] = [
    "create_cluster",
    "scale_cluster",
    "delete_cluster",
    "boot_instance",
    "delete_instance",
    "resize_instance",
    "reboot_instance",
    "snapshot_instance",
    "bundle",
    "live_migrate_instance",
];
/// How long an operation (a rollback driven by serve included) may take to settle (a
/// deadline polled against, so generous: a loaded CI machine is slow, not wrong).
const SETTLE_WAIT: Duration = Duration::from_secs(60);
const REPLY_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Request {
    /// 1-based line of the block's opening fence, for messages.
    line: usize,
    body: Value,
    outcome: String,
}

#[derive(Debug)]
struct Example {
    name: String,
    line: usize,
    attrs: BTreeMap<String, String>,
    requests: Vec<Request>,
}

impl Example {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.get(key).map(String::as_str)
    }
}

fn doc_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/writing-operations.md")
}

/// Every marked example, its requests in order. Panics (naming the line) on anything
/// malformed, so a broken marker cannot silently drop an example.
fn parse(doc: &str) -> Vec<Example> {
    let mut examples: Vec<Example> = Vec::new();
    let mut open: Option<Example> = None;
    let mut outcome: Option<String> = None;
    let mut lines = doc.lines().enumerate().map(|(i, l)| (i + 1, l));
    while let Some((n, line)) = lines.next() {
        if let Some(spec) = comment(line, "example:") {
            assert!(
                open.is_none(),
                "line {n}: example opened inside another one"
            );
            let mut words = spec.split_whitespace();
            let name = words
                .next()
                .unwrap_or_else(|| panic!("line {n}: example without a name"));
            let mut attrs = BTreeMap::new();
            for word in words {
                let (k, v) = word
                    .split_once('=')
                    .unwrap_or_else(|| panic!("line {n}: {word:?} is not key=value"));
                assert!(
                    ["operation", "status", "target_status"].contains(&k),
                    "line {n}: unknown attribute {k:?}"
                );
                attrs.insert(k.to_string(), v.to_string());
            }
            open = Some(Example {
                name: name.to_string(),
                line: n,
                attrs,
                requests: Vec::new(),
            });
        } else if comment(line, "end example").is_some() {
            let example = open
                .take()
                .unwrap_or_else(|| panic!("line {n}: end of an example that was not opened"));
            assert!(
                outcome.is_none(),
                "line {n}: outcome marker without a request"
            );
            examples.push(example);
        } else if let Some(word) = comment(line, "outcome:") {
            assert!(
                open.is_some(),
                "line {n}: outcome marker outside an example"
            );
            outcome = Some(word.to_string());
        } else if line.trim() == "```json" {
            let text = fenced_block(&mut lines, &format!("line {n}"));
            let Some(example) = open.as_mut() else {
                continue; // an illustration, not a request
            };
            let body: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("line {n}: the request is not JSON: {e}"));
            let one = |c: &Value| c["aggregate"].is_string() && c["events"].is_array();
            let well_formed = match body["commits"].as_array() {
                Some(commits) => !commits.is_empty() && commits.iter().all(one),
                None => one(&body),
            };
            assert!(
                well_formed,
                "line {n}: a request needs `aggregate` and `events` (each of its `commits`)"
            );
            example.requests.push(Request {
                line: n,
                body,
                outcome: outcome.take().unwrap_or_else(|| "appended".into()),
            });
        } else {
            assert!(
                outcome.is_none() || line.trim().is_empty(),
                "line {n}: an outcome marker must come right before its request"
            );
        }
    }
    assert!(open.is_none(), "an example is not closed");
    examples
}

async fn ask(client: &async_nats::Client, subject: &str, body: &Value) -> Value {
    let reply = tokio::time::timeout(
        REPLY_WAIT,
        client.request(subject.to_string(), body.to_string().into()),
    )
    .await
    .unwrap_or_else(|_| panic!("no reply on {subject} within {REPLY_WAIT:?}"))
    .unwrap_or_else(|e| panic!("request on {subject}: {e}"));
    serde_json::from_slice(&reply.payload).expect("a JSON reply")
}

/// Asks `subject` until `done` accepts the reply's data; panics with the last reply after
/// `SETTLE_WAIT`.
async fn settle(
    client: &async_nats::Client,
    subject: &str,
    body: Value,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let deadline = Instant::now() + SETTLE_WAIT;
    loop {
        let reply = ask(client, subject, &body).await;
        if reply.get("error").is_none() && done(&reply["data"]) {
            return reply["data"].clone();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not reached within {SETTLE_WAIT:?}; last reply {reply:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends one example's requests in order; returns the position of the last one.
async fn replay(client: &async_nats::Client, example: &Example) -> u64 {
    let mut position = 0;
    for (i, request) in example.requests.iter().enumerate() {
        let reply = ask(client, "provledger.cmd.append", &request.body).await;
        let at = format!(
            "example {} (line {}), request #{} (line {})",
            example.name,
            example.line,
            i + 1,
            request.line
        );
        assert!(
            reply.get("error").is_none(),
            "{at} was refused: {:#}\nrequest: {}",
            reply["error"],
            request.body
        );
        // A `commits` request answers one entry per commit, each with its own outcome.
        let answers = match reply["data"]["commits"].as_array() {
            Some(commits) => commits.clone(),
            None => vec![reply["data"].clone()],
        };
        for answer in answers {
            assert_eq!(
                answer["outcome"], request.outcome,
                "{at}: unexpected outcome in {reply}"
            );
            position = position.max(answer["position"].as_u64().expect("position"));
        }
    }
    position
}

/// The operation reaches the stated status and kind; its target (a cluster or an
/// instance) the stated status, with no operation in flight.
async fn check_outcome(client: &async_nats::Client, example: &Example, position: u64) {
    let (Some(id), Some(status)) = (example.attr("operation"), example.attr("status")) else {
        panic!(
            "example {} (line {}) needs operation=UUID and status=STATUS",
            example.name, example.line
        );
    };
    let what = format!("example {}: operation {id} {status}", example.name);
    let op = settle(
        client,
        "provledger.q.operation.get",
        json!({"id": id, "min_position": position}),
        &what,
        |op| op["status"] == status,
    )
    .await;
    assert_eq!(op["kind"], example.name.as_str(), "{what}: wrong kind");
    let Some(target_status) = example.attr("target_status") else {
        return;
    };
    let target = op["target"].as_str().expect("target");
    let (kind, target_id) = target.split_once('/').expect("kind/id");
    let field = match kind {
        "cluster" => "status",
        "instance" => "vm_state",
        other => panic!("{what}: target_status given for a {other} target"),
    };
    settle(
        client,
        &format!("provledger.q.{kind}.get"),
        json!({"id": target_id}),
        &format!(
            "example {}: {target} {target_status}, nothing in flight",
            example.name
        ),
        |t| t[field] == target_status && t["operation_id"].is_null(),
    )
    .await;
}

#[test]
fn the_document_marks_one_example_per_operation_kind() {
    let doc = std::fs::read_to_string(doc_path()).expect("docs/writing-operations.md");
    let examples = parse(&doc);
    let names: Vec<&str> = examples.iter().map(|e| e.name.as_str()).collect();
    for kind in KINDS {
        let count = names.iter().filter(|n| **n == kind).count();
        assert_eq!(count, 1, "{kind}: {count} examples, expected exactly one");
    }
    for e in &examples {
        assert!(
            e.name == "setup" || KINDS.contains(&e.name.as_str()),
            "line {}: unknown example {:?}",
            e.line,
            e.name
        );
        assert!(!e.requests.is_empty(), "example {} has no request", e.name);
    }
    // Fixed commit ids make the examples idempotent to replay; one id is one commit, and
    // only a retry (the same request, answered `already_appended`) repeats one.
    let mut ids: BTreeMap<&str, &Value> = BTreeMap::new();
    for r in examples.iter().flat_map(|e| &e.requests) {
        let Some(id) = r.body["commit_id"].as_str() else {
            continue;
        };
        match ids.get(id) {
            None => {
                ids.insert(id, &r.body);
            }
            Some(first) => assert!(
                r.outcome == "already_appended" && **first == r.body,
                "line {}: commit_id {id} used again, and not by a retry of the same request",
                r.line
            ),
        }
    }
}

/// Executors as section 4 of the document describes them, which never acted: every
/// compensation by key is answered with `nothing_to_undo` (one without a key with a plain
/// `ok`); the requests received are kept with the executor they were addressed to.
async fn executors_that_never_acted(
    client: &async_nats::Client,
) -> std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>> {
    use futures::StreamExt;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut sub = client
        .subscribe("provledger.exec.*.compensate")
        .await
        .expect("subscribe");
    provledger_tests::subscriptions_in_effect(client).await;
    let (client, kept) = (client.clone(), seen.clone());
    tokio::spawn(async move {
        while let Some(msg) = sub.next().await {
            let executor = msg
                .subject
                .split('.')
                .nth(2)
                .unwrap_or_default()
                .to_string();
            let request: Value = serde_json::from_slice(&msg.payload).unwrap_or(Value::Null);
            let by_key = request["args"]["idempotency_key"].is_string();
            kept.lock().expect("requests").push((executor, request));
            let reply = if by_key {
                json!({"ok": true, "nothing_to_undo": true})
            } else {
                json!({"ok": true})
            };
            if let Some(to) = msg.reply {
                let _ = client.publish(to, reply.to_string().into()).await;
            }
        }
    });
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_documented_example_is_accepted_and_ends_as_documented() {
    let doc = std::fs::read_to_string(doc_path()).expect("docs/writing-operations.md");
    let examples = parse(&doc);
    assert!(
        examples.iter().any(|e| e.name != "setup"),
        "no example found"
    );
    let nats = NatsServer::start().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let client = nats.client().await;
    let _serve = Serve::start(&nats, &tmp.path().join("serve"));
    wait_ready(&client).await;
    let executors = executors_that_never_acted(&client).await;
    let mut last = 0;
    for example in &examples {
        let position = replay(&client, example).await;
        if example.name != "setup" {
            check_outcome(&client, example, position).await;
        }
        last = last.max(position);
    }
    // The failed boot's `acquire_ip` and the failed live migration's `migrate` were
    // started and never done: their rollbacks asked IPAM and the hypervisor, by the
    // documented keys, to undo whatever they did, and neither had anything to undo.
    let asked = executors.lock().expect("requests").clone();
    assert_eq!(asked.len(), 2, "compensation requests: {asked:#?}");
    let (ipam, hypervisor) = (&asked[0], &asked[1]);
    assert_eq!(ipam.0, "ipam");
    assert_eq!(ipam.1["action"], "release_ip");
    assert_eq!(ipam.1["resource"], "");
    assert_eq!(
        ipam.1["args"]["idempotency_key"],
        "01900000-0000-7000-8000-0000000000a1"
    );
    assert_eq!(hypervisor.0, "hypervisor");
    assert_eq!(
        hypervisor.1["action"],
        json!({"custom": "abort_live_migration"})
    );
    assert_eq!(
        hypervisor.1["args"]["idempotency_key"],
        "01900000-0000-7000-8000-0000000000a2"
    );
    // The failed live migration left the instance where it ran, holding its source again
    // and nothing on the destination (Nova's rule), and its task ended.
    let vm = ask(
        &client,
        "provledger.q.instance.get",
        &json!({"id": "01900000-0000-7000-8000-0000000000b2", "min_position": last}),
    )
    .await;
    assert_eq!(vm["data"]["vm_state"], "active", "{vm}");
    assert_eq!(vm["data"]["host"], "cmp-2", "{vm}");
    assert_eq!(vm["data"]["task_state"], Value::Null, "{vm}");
    let held = ask(
        &client,
        "provledger.q.allocation.by_consumer",
        &json!({"consumer": "01900000-0000-7000-8000-0000000000b2", "min_position": last}),
    )
    .await;
    let held = held["data"].to_string();
    assert!(
        held.contains("01900000-0000-7000-8000-0000000000f2")
            && !held.contains("01900000-0000-7000-8000-0000000000f1"),
        "{held}"
    );
    let migration = ask(
        &client,
        "provledger.q.allocation.by_consumer",
        &json!({"consumer": "01900000-0000-7000-8000-000000000e0c", "min_position": last}),
    )
    .await;
    assert!(
        !migration["data"].to_string().contains("0000000000f2"),
        "the migration still holds the source: {migration}"
    );
    // A clean sequence: the fold applied every event of every aggregate written, none as
    // an anomaly (an out-of-place `step_done` is accepted, but recorded as one).
    let mut seen = HashSet::new();
    let commits = examples
        .iter()
        .flat_map(|e| &e.requests)
        .flat_map(|r| match r.body["commits"].as_array() {
            Some(commits) => commits.clone(),
            None => vec![r.body.clone()],
        })
        .collect::<Vec<_>>();
    for commit in &commits {
        let aggregate = commit["aggregate"].as_str().expect("aggregate");
        if !seen.insert(aggregate) {
            continue;
        }
        let (kind, id) = aggregate.split_once('/').expect("kind/id");
        let reply = ask(
            &client,
            &format!("provledger.q.{kind}.get"),
            &json!({"id": id, "min_position": last}),
        )
        .await;
        assert_eq!(
            reply["data"]["anomaly_count"], 0,
            "{aggregate} has anomalies: {:#}",
            reply["data"]["anomalies"]
        );
    }
}
