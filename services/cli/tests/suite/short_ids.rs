//! Ids as people copy them: every command that names an existing entity takes its short
//! id (the last 12 hex digits the CLI and console print) or a unique start, over NATS
//! (resolved by serve's `q.id.resolve`) and on a data dir; an ambiguous one is refused
//! naming every candidate, whole.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::{failed_embedded_create, ledger_with_executors, provledger, text, Serve};
use provledger_events::short_id;
use provledger_tests::NatsServer;
use uuid::Uuid;

/// `args` run until they succeed (serve folds what was just written within a moment), at
/// most 20 s; the last output.
fn until_ok(args: &[&str]) -> std::process::Output {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = provledger(args, "");
        if out.status.success() || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The hex digits two ids begin with in common (UUID v7 minted close together share
/// their time), at most 8.
fn shared_head(a: &Uuid, b: &Uuid) -> String {
    let (a, b) = (a.simple().to_string(), b.simple().to_string());
    a.chars()
        .zip(b.chars())
        .take_while(|(x, y)| x == y)
        .take(8)
        .map(|(x, _)| x)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_nats_a_short_id_resolves_and_an_ambiguous_start_is_refused_naming_both() {
    // Given two failed creates, written to the stream, and serve folding it,
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = ledger_with_executors(&nats, 64).await;
    let first = common::fail_a_create(&client, &ledger, &infra, provider).await;
    let second = common::fail_a_create(&client, &ledger, &infra, provider).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    let url = nats.url();
    let short = short_id(&first);

    // when `operation show` is given the short id printed everywhere,
    let out = until_ok(&["--nats", &url, "operation", "show", &short]);
    // then it shows that operation (its whole id), and not the other;
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains(&first.to_string()), "{}", text(&out));
    assert!(!text(&out).contains(&second.to_string()), "{}", text(&out));

    // and `rollback plan`, `history` and `operation list --after` take it as well.
    let aggregate = format!("operation/{short}");
    for args in [
        ["rollback", "plan", short.as_str()].as_slice(),
        &["history", &aggregate],
        &["operation", "list", "--after", &short],
    ] {
        let all = [&["--nats", url.as_str()], args].concat();
        let out = provledger(&all, "");
        assert!(out.status.success(), "{all:?}: {}", text(&out));
    }

    // When the start both ids share is given, then it is refused (bad input) naming both.
    let head = shared_head(&first, &second);
    assert!(
        head.len() >= 4,
        "ids minted a moment apart share their time: {head}"
    );
    let out = provledger(&["--nats", &url, "operation", "show", &head], "");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    let said = text(&out);
    assert!(said.contains("ambiguous"), "{said}");
    assert!(
        said.contains(&first.to_string()) && said.contains(&second.to_string()),
        "{said}"
    );

    // When digits no operation has are given, then it says so (a problem, exit 1).
    let out = provledger(&["--nats", &url, "operation", "show", "0123456789ab"], "");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("no operation has an id"),
        "{}",
        text(&out)
    );

    // And the service answers the lookup itself to any NATS client, as documented.
    let reply = client
        .request(
            "provledger.q.id.resolve",
            serde_json::json!({"id": short, "kind": "operation"})
                .to_string()
                .into(),
        )
        .await
        .unwrap();
    let reply: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(
        reply["data"],
        serde_json::json!({"matches": [format!("operation/{first}")], "more": false})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_data_dir_short_ids_resolve_and_hostile_ones_are_refused_plainly() {
    // Given two failed creates in one embedded data dir,
    let d = tempfile::tempdir().unwrap();
    let first: Uuid = failed_embedded_create(d.path()).await.parse().unwrap();
    let second: Uuid = failed_embedded_create(d.path()).await.parse().unwrap();
    let dir = d.path().to_str().unwrap();

    // when each is named by its short id, then each command finds that one;
    for id in [first, second] {
        let short = short_id(&id);
        let out = provledger(&["--data-dir", dir, "operation", "show", &short], "");
        assert!(out.status.success(), "{}", text(&out));
        assert!(text(&out).contains(&id.to_string()), "{}", text(&out));
        let out = provledger(&["--data-dir", dir, "rollback", "plan", &short], "");
        assert!(out.status.success(), "{}", text(&out));
    }

    // when the start they share is given, then both are named;
    let head = shared_head(&first, &second);
    let out = provledger(&["--data-dir", dir, "rollback", "plan", &head], "");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains(&first.to_string()) && text(&out).contains(&second.to_string()),
        "{}",
        text(&out)
    );

    // and text that is no id (too short, not hex, a terminal escape) is refused before
    // anything is opened, shown escaped.
    for hostile in ["abc", "71eec13912dz", "\u{1b}[31mred"] {
        let out = provledger(&["--data-dir", dir, "operation", "show", hostile], "");
        assert_eq!(out.status.code(), Some(2), "{hostile:?}: {}", text(&out));
        assert!(
            !text(&out).contains('\u{1b}'),
            "{hostile:?}: {}",
            text(&out)
        );
    }
}
