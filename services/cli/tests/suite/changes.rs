//! `q.changes`, a follower's catch-up, against a real nats-server and serve: pages in
//! position order that together hold exactly the stream's commits (never an entry the
//! projector quarantined), a filtered follower sees exactly what its filter names, and a
//! sparse filter moves on within its scan bound.

use std::time::Duration;

use provledger_tests::NatsServer;
use serde_json::{json, Value};

use crate::common::{self, wait_ready, Serve};

async fn ask(client: &async_nats::Client, body: Value) -> Value {
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.request("provledger.q.changes", body.to_string().into()),
    )
    .await
    .expect("a reply in time")
    .expect("a reply");
    serde_json::from_slice(&reply.payload).expect("JSON")
}

/// Follows from position 0 with `filter` until current (`next` = `end` at or past
/// `until`), page by page: the positions delivered, and the pages' `stopped` words.
async fn follow(client: &async_nats::Client, filter: Value, until: u64) -> (Vec<u64>, Vec<String>) {
    let (mut after, mut positions, mut stops) = (0u64, Vec::new(), Vec::new());
    loop {
        let mut body = filter.clone();
        body["after"] = json!(after);
        body["limit"] = json!(37);
        let reply = ask(client, body).await;
        let data = &reply["data"];
        assert!(data.is_object(), "{reply}");
        for change in data["changes"].as_array().unwrap() {
            positions.push(change["position"].as_u64().unwrap());
            assert!(change["timeline"].is_array(), "{change}");
        }
        stops.push(data["stopped"].as_str().unwrap().to_string());
        let next = data["next"].as_u64().unwrap();
        assert!(next >= after, "next {next} went back from {after}");
        after = next;
        if next == data["end"].as_u64().unwrap() && next >= until {
            return (positions, stops);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_catches_up_on_exactly_the_commits_and_a_filtered_one_on_its_own() {
    // Given operations that failed and rolled back, commits of every kind, and garbage
    // published on a subject (which serve quarantines),
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let first = common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    let js = async_nats::jetstream::new(client.clone());
    let garbage = js
        .publish(
            format!("provledger.ev.cluster.{}", uuid::Uuid::now_v7()),
            "\0garbage".into(),
        )
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence;
    let second = common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    let log = common::stream(&nats).await;
    // (serve's rollbacks written: the stream is quiet)
    let end = common::quiet_end(&log).await;
    let commits = common::stream_commits(&log).await;
    assert!(
        commits.len() > 2 * 37,
        "{} commits: pages of 37 make three",
        commits.len()
    );

    // When a follower catches up from position 0, page by page,
    let (positions, _) = follow(&client, json!({}), end).await;
    // then it got each commit once, in order, and not the garbage.
    let expected: Vec<u64> = commits.iter().map(|c| c.position).collect();
    assert_eq!(positions, expected);
    assert!(!positions.contains(&garbage));

    // When a follower asks for one operation's commits, then it gets exactly those: the
    // operation's own and what it wrote elsewhere (claims, the cluster, instances).
    let (positions, _) = follow(&client, json!({"operation_id": first}), end).await;
    let of_first: Vec<u64> = commits
        .iter()
        .filter(|c| c.operation_id == Some(first))
        .map(|c| c.position)
        .collect();
    assert_eq!(positions, of_first);
    assert!(of_first.iter().any(|p| commits[0].position <= *p));
    assert!(
        commits
            .iter()
            .filter(|c| of_first.contains(&c.position))
            .any(|c| c.aggregate.kind != provledger_events::AggregateKind::Operation),
        "the operation wrote on other aggregates too"
    );
    let (positions, _) = follow(
        &client,
        json!({"operation_id": second, "kinds": ["provider"], "event_types": ["allocation_released"]}),
        end,
    )
    .await;
    let released: Vec<u64> = commits
        .iter()
        .filter(|c| {
            c.operation_id == Some(second)
                && c.aggregate.kind == provledger_events::AggregateKind::Provider
        })
        .filter(|c| c.events.iter().any(|e| e.name() == "allocation_released"))
        .map(|c| c.position)
        .collect();
    assert!(!released.is_empty(), "the rollback released the claims");
    assert_eq!(positions, released);

    // When a follower is past this replica's end, then it gets nothing and stays there.
    let ahead = ask(&client, json!({"after": end + 5})).await;
    assert_eq!(ahead["data"]["changes"], json!([]), "{ahead}");
    assert_eq!(ahead["data"]["next"], json!(end + 5), "{ahead}");

    // And a bad request names its field.
    let bad = ask(&client, json!({"event_types": ["vm_flew_away"]})).await;
    assert_eq!(bad["error"]["code"], json!("bad_request"), "{bad}");
    assert!(
        bad["error"]["message"]
            .as_str()
            .unwrap()
            .contains("event_types"),
        "{bad}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_aggregates_changes_come_in_one_page_however_many_others_lie_between() {
    // Given a cluster with a commit, then more commits on other aggregates than one page
    // looks at (CHANGES_SCAN_MAX), then a second commit on the cluster,
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let log = common::stream(&nats).await;
    let cluster = provledger_events::AggregateId::cluster(uuid::Uuid::now_v7());
    let append = |event| {
        provledger_events::EventLog::append(
            &log,
            cluster,
            provledger_events::Expectation::Any,
            provledger_events::CommitDraft::now("writer", vec![event]),
        )
    };
    let first = append(provledger_events::catalogue::samples::all().remove(0))
        .await
        .expect("append");
    common::write_concurrently(&nats, 8, 1_260).await;
    let second = append(provledger_events::Event::ClusterStatusChanged {
        status: provledger_events::catalogue::ClusterStatus::Spawning,
        description: "after the others".into(),
    })
    .await
    .expect("append");
    let end = common::quiet_end(&log).await;
    assert!(second.position - first.position > provledger_serve::messages::CHANGES_SCAN_MAX);
    common::wait_position(&client, end).await;

    // when a follower of the cluster asks for its changes from position 0,
    let reply = ask(
        &client,
        json!({"aggregate": cluster.to_string(), "after": 0, "limit": 100}),
    )
    .await;

    // then one page holds both, and reaches the end: only the cluster's commits were
    // looked at, not the range (a scan would stop at CHANGES_SCAN_MAX positions).
    let data = &reply["data"];
    let positions: Vec<u64> = data["changes"]
        .as_array()
        .expect("changes")
        .iter()
        .map(|c| c["position"].as_u64().unwrap())
        .collect();
    assert_eq!(positions, vec![first.position, second.position], "{reply}");
    assert_eq!(data["stopped"], json!("end"), "{reply}");
    assert_eq!(data["next"], json!(end), "{reply}");
}
