//! Reading an executor's inventory against a real nats-server, when the executor is
//! hostile or broken: an inventory that never ends is read within a named time bound, and
//! what drift keeps of it stays within a named memory bound.

use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_client::inventory::{
    compare_inventory, InventoryError, ReadBounds, SUSPECTS_KEPT_MAX, SUSPECT_BYTES_MAX,
};
use provledger_projections::drift::LedgerResources;
use provledger_tests::NatsServer;

/// An executor that answers every inventory page at once with 1,000 items no operation
/// made, and always one more page.
async fn endless_executor(client: async_nats::Client, subject: String) {
    let mut requests = client.subscribe(subject).await.expect("subscribe");
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
    tokio::spawn(endless_executor(
        nats.client().await,
        "p.exec.endless.inventory".into(),
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    // ...when it is compared within a whole-read bound of 3 s...
    let bounds = ReadBounds {
        reply_wait: Duration::from_secs(5),
        whole: Duration::from_secs(3),
    };
    let ledger = LedgerResources::default();
    let started = Instant::now();
    let mut items = 0usize;
    let asked = compare_inventory(&client, "p", "endless", bounds, &ledger, |n| items += n).await;
    // ...then the read stops at the bound, reported as unread (the comparison is incomplete),
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
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
