//! Reading an executor's inventory against a real nats-server, when the executor is
//! hostile or broken: an inventory that never ends is read within a named time bound, and
//! what drift keeps of it stays within a named memory bound.

use std::time::Duration;

use futures::StreamExt;
use provledger_client::inventory::{
    compare_inventory, InventoryError, ReadBounds, SUSPECTS_KEPT_MAX, SUSPECT_BYTES_MAX,
};
use provledger_projections::drift::LedgerResources;
use provledger_tests::NatsServer;

/// An executor that answers every inventory page at once with 1,000 items no operation
/// made, and always one more page.
async fn endless_executor(client: async_nats::Client, mut requests: async_nats::Subscriber) {
    let mut page = 0u64;
    while let Some(request) = requests.next().await {
        page += 1;
        let items: Vec<serde_json::Value> = (0..1_000)
            .map(|i| {
                serde_json::json!({
                    "kind": "ip",
                    "resource": format!("10.{page}.{i}.{}", "x".repeat(200)),
                    "key": format!("unknown-{page}-{i}"),
                })
            })
            .collect();
        let reply = serde_json::json!({"items": items, "next": format!("{page:012}")});
        if let Some(to) = request.reply {
            let _ = client.publish(to, reply.to_string().into()).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inventory_that_never_ends_is_cut_at_the_time_bound_keeping_bounded_suspects() {
    // Given an executor whose inventory never ends, every item unknown to the ledger...
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    // (its subscription in effect at the server before it is asked: a flush only writes
    // it out, and the request of another connection can be routed first under load)
    let executor = nats.client().await;
    let requests = executor
        .subscribe("p.exec.endless.inventory")
        .await
        .expect("subscribe");
    provledger_tests::subscriptions_in_effect(&executor).await;
    tokio::spawn(endless_executor(executor, requests));
    // ...when it is compared within a whole-read bound of 3 s...
    let bounds = ReadBounds {
        reply_wait: Duration::from_secs(5),
        whole: Duration::from_secs(3),
    };
    let ledger = LedgerResources::default();
    let mut items = 0usize;
    let asked = tokio::time::timeout(
        Duration::from_secs(3 + 10),
        compare_inventory(&client, "p", "endless", bounds, &ledger, |n| items += n),
    )
    .await
    .expect("the read stops at its bound");
    // ...then the read stops at the bound (above, within a margin for a loaded machine: a
    // read the bound does not stop never ends), reported as unread (the comparison is
    // incomplete),
    assert!(
        matches!(asked.held, Err(InventoryError::TooSlow { .. })),
        "{:?}",
        asked.held.as_ref().err()
    );
    // ...and what was kept of its leaks is bounded, the rest counted.
    assert!(items > SUSPECTS_KEPT_MAX, "only {items} items read");
    assert!(asked.suspects.len() <= SUSPECTS_KEPT_MAX);
    let kept: usize = asked
        .suspects
        .iter()
        .map(|i| i.resource.len() + i.kind.len() + i.key.as_ref().map_or(0, String::len))
        .sum();
    assert!(kept <= SUSPECT_BYTES_MAX, "{kept} bytes kept");
    assert_eq!(
        asked.suspects.len() as u64 + asked.suspects_not_kept,
        items as u64
    );
}
