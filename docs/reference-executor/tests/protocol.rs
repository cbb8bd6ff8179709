//! The reference executor held to provledger's protocols, through provledger's own client
//! against a private nats-server: its inventory is read whole, page by page, by the reader
//! `provledger drift` uses; its compensation answers follow the documented forms
//! (idempotent, undo by key, `nothing_to_undo`, fenced keys); and a leak it holds is
//! removed by the path of `drift --fix leaked` (a recorded `remove_leaked` operation
//! driven by the rollback driver).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use provledger_client::inventory::read_inventory;
use provledger_client::{record_leak_removal, Ledger, NatsExecutors, RollbackDriver, Stamper};
use provledger_events::SledLog;
use provledger_projections::drift::{compare, recorded_resources, FindingKind};
use provledger_projections::leak_removal::{leak_removal_events, plan_leak_removal};
use provledger_projections::rollback::RetryPolicy;
use provledger_tests::NatsServer;
use serde_json::{json, Value};
use uuid::Uuid;

const WAIT: Duration = Duration::from_secs(10);

/// The executor as a child process, killed when the test ends.
struct Executor(Child);

impl Drop for Executor {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Given a nats-server and the reference executor `dns` answering on it.
async fn started() -> (NatsServer, async_nats::Client, Executor) {
    let nats = NatsServer::start().await;
    let child = Command::new(env!("CARGO_BIN_EXE_reference-executor"))
        .args(["--nats", &nats.url(), "--name", "dns"])
        .stderr(Stdio::null())
        .spawn()
        .expect("start the reference executor");
    let executor = Executor(child);
    let client = nats.client().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ask_within(&client, "inventory", json!({}), Duration::from_millis(500))
        .await
        .is_none()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the executor never answered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (nats, client, executor)
}

/// One request to `provledger.exec.dns.<what>`; its JSON reply, if one came within
/// [`WAIT`] (a stall of the machine is not a lost answer: thousands of requests are sent).
async fn ask(client: &async_nats::Client, what: &str, body: Value) -> Option<Value> {
    ask_within(client, what, body, WAIT).await
}

/// [`ask`] waiting `wait` for the reply (short while polling for the executor to start).
async fn ask_within(
    client: &async_nats::Client,
    what: &str,
    body: Value,
    wait: Duration,
) -> Option<Value> {
    let subject = format!("provledger.exec.dns.{what}");
    let reply = tokio::time::timeout(wait, client.request(subject, body.to_string().into()))
        .await
        .ok()?
        .ok()?;
    serde_json::from_slice(&reply.payload).ok()
}

async fn create(client: &async_nats::Client, resource: &str, key: Option<&str>) -> Value {
    ask(client, "create", json!({"resource": resource, "key": key}))
        .await
        .expect("create answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_inventory_is_read_whole_page_by_page_in_order() {
    // Given 2,345 records, more than two pages of the largest size
    let (_nats, client, _executor) = started().await;
    for i in 0..2_345 {
        let made = create(
            &client,
            &format!("host-{i:05}.example"),
            Some(&format!("k{i}")),
        )
        .await;
        assert_eq!(made["ok"], true, "{made}");
    }
    // When drift's reader reads its inventory
    let mut pages = 0;
    let items = read_inventory(&client, "provledger", "dns", WAIT, |_| pages += 1)
        .await
        .expect("the inventory follows the protocol");
    // Then every record is there once, in order, with its key and its undo action
    assert_eq!(items.len(), 2_345);
    assert!(pages >= 3, "{pages} pages");
    assert!(items.windows(2).all(|w| w[0].resource < w[1].resource));
    assert_eq!(items[7].key.as_deref(), Some("k7"));
    assert_eq!(
        serde_json::to_value(&items[7].undo).expect("JSON"),
        json!("unregister_dns")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_compensations_are_idempotent_undo_by_key_and_fence_the_key() {
    let (_nats, client, _executor) = started().await;
    // Given a record made under key k1
    assert_eq!(create(&client, "a.example", Some("k1")).await["ok"], true);
    // When a compensation names only the key (an outcome the ledger never learnt)
    let undo = json!({"operation_id": Uuid::now_v7(), "compensation_id": "c1", "attempt": 1,
        "action": "unregister_dns", "resource": "", "args": {"idempotency_key": "k1"}});
    let first = ask(&client, "compensate", undo.clone())
        .await
        .expect("a reply");
    // Then it is undone, and a retry answers the same without doing anything twice
    assert_eq!(first, json!({"ok": true}));
    assert_eq!(
        ask(&client, "compensate", undo).await,
        Some(json!({"ok": true}))
    );
    assert_eq!(
        ask(&client, "inventory", json!({})).await,
        Some(json!({"items": [], "next": null}))
    );
    // And a late create under the undone key is refused
    assert_eq!(
        create(&client, "a.example", Some("k1")).await,
        json!({"ok": false, "error": "undone"})
    );
    // And undoing a key nothing was done under says so
    let nothing = json!({"operation_id": Uuid::now_v7(), "compensation_id": "c2", "attempt": 1,
        "action": "unregister_dns", "resource": "", "args": {"idempotency_key": "k2"}});
    assert_eq!(
        ask(&client, "compensate", nothing).await,
        Some(json!({"ok": true, "nothing_to_undo": true}))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leak_it_holds_is_removed_by_a_recorded_remove_leaked_operation() {
    let (nats, client, _executor) = started().await;
    // Given a record made by hand (no key), unknown to an empty ledger
    assert_eq!(create(&client, "rogue.example", None).await["ok"], true);
    let dir = tempfile::tempdir().expect("a temp dir");
    let ledger = provledger_client::Writer::new(Ledger::Embedded(
        SledLog::open(dir.path()).expect("a sled log"),
    ));
    let held = read_inventory(&client, "provledger", "dns", WAIT, |_| {})
        .await
        .expect("an inventory");
    let findings = compare(&recorded_resources(std::iter::empty()), "dns", &held);
    assert_eq!(findings.len(), 1);
    assert_eq!(findings[0].kind, FindingKind::Leaked);
    // When its removal is recorded and driven, as `drift --fix leaked` does
    let plan = plan_leak_removal(&findings);
    let id = Uuid::now_v7();
    let events = leak_removal_events(id, &plan, "test: unused").expect("events");
    record_leak_removal(&ledger, id, events, "tester", &Stamper::system())
        .await
        .expect("recorded");
    let executors = Arc::new(NatsExecutors {
        client: nats.client().await,
        subject_prefix: "provledger".into(),
        reply_wait: WAIT,
    });
    let op = RollbackDriver::new(ledger, executors, RetryPolicy::default(), "tester")
        .drive(id)
        .await
        .expect("driven");
    // Then the executor no longer holds it and the operation's rollback is done
    assert!(op.remaining.is_empty(), "{:?}", op.remaining);
    assert_eq!(
        ask(&client, "inventory", json!({})).await,
        Some(json!({"items": [], "next": null}))
    );
}
