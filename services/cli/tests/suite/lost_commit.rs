//! A commit lost mid-chain (nats-server dropped it after a damaged store block) is told
//! from a forged one, answered `integrity` by every read and write of its aggregate, and
//! acknowledged by an operator, in the log, before the aggregate continues.

use provledger_events::catalogue::ClusterStatus;
use provledger_events::{AggregateId, CommitDraft, Event, EventLog, Expectation};
use provledger_tests::NatsServer;
use serde_json::json;
use uuid::Uuid;

use crate::common;
use crate::common::ask;

fn status(description: &str) -> Vec<Event> {
    vec![Event::ClusterStatusChanged {
        status: ClusterStatus::Active,
        description: description.into(),
    }]
}

fn create() -> Vec<Event> {
    vec![Event::ClusterCreateRequested {
        name: "web".into(),
        plugin: "vanilla".into(),
        node_groups: vec![],
    }]
}

/// Flips one byte of the only place `marker` occurs in the server's store files.
fn flip_in_store(store: &std::path::Path, marker: &str) {
    let mut hits = 0;
    for entry in walk(store) {
        if entry.extension().is_some_and(|e| e == "blk") {
            let mut bytes = std::fs::read(&entry).unwrap();
            if let Some(at) = bytes
                .windows(marker.len())
                .position(|w| w == marker.as_bytes())
            {
                bytes[at] ^= 0x20;
                std::fs::write(&entry, bytes).unwrap();
                hits += 1;
            }
        }
    }
    assert_eq!(hits, 1, "the marker is in exactly one block");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

const CMD: &str = "provledger.cmd.append";

/// Given cluster X with three commits and cluster Y with one, the server shut down, one
/// byte of X's v2 flipped in its store file and the server started again (it drops v2:
/// its position answers 404, and v3 stays).
pub(crate) async fn x_lost_its_v2() -> (NatsServer, AggregateId, AggregateId) {
    let mut nats = NatsServer::start().await;
    let (x, y) = x_and_y(&nats).await;
    drop_x_v2(&mut nats).await;
    (nats, x, y)
}

/// Cluster X with three commits (v2 carries a marker), then cluster Y with one.
async fn x_and_y(nats: &NatsServer) -> (AggregateId, AggregateId) {
    let log = common::stream(nats).await;
    let x = AggregateId::cluster(Uuid::now_v7());
    let y = AggregateId::cluster(Uuid::now_v7());
    log.append(x, Expectation::NoStream, CommitDraft::now("t", create()))
        .await
        .unwrap();
    log.append(
        x,
        Expectation::Exactly(1),
        CommitDraft::now("t", status("marker-of-version-two")),
    )
    .await
    .unwrap();
    log.append(
        x,
        Expectation::Exactly(2),
        CommitDraft::now("t", status("three")),
    )
    .await
    .unwrap();
    log.append(y, Expectation::NoStream, CommitDraft::now("t", create()))
        .await
        .unwrap();
    (x, y)
}

/// The server shut down, the byte of X's v2 flipped, and the server started again.
async fn drop_x_v2(nats: &mut NatsServer) {
    nats.shut_down();
    flip_in_store(&nats.store_dir(), "marker-of-version-two");
    nats.start_again().await;
    let log = common::stream(nats).await;
    let stream = log.context().get_stream("PROVLEDGER").await.unwrap();
    assert!(
        stream.direct_get(2).await.is_err() && stream.direct_get(3).await.is_ok(),
        "the server dropped the damaged v2 and kept v3"
    );
}

/// A replica on `data` that applied X's three commits and Y's one, then stopped; then the
/// server dropped X's v2 (a damaged block, the server restarted).
async fn copied_then_x_lost_its_v2(data: &std::path::Path) -> (NatsServer, AggregateId) {
    let mut nats = NatsServer::start().await;
    let mut serve = common::Serve::start(&nats, data);
    let client = nats.client().await;
    common::wait_ready(&client).await;
    let (x, _) = x_and_y(&nats).await;
    common::wait_position(&client, 4).await;
    assert!(serve.terminate().success());
    drop_x_v2(&mut nats).await;
    (nats, x)
}

/// Given a replica that applied X's three commits and stopped, when the server drops X's
/// v2, then the stream's history of X says v2 is lost while the replica's data dir, offline,
/// still shows v2 (the marker) in a chain checked whole: the second copy an operator looks
/// for first (docs/operating.md, "A commit lost from the log").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_copy_still_holds_a_commit_the_stream_lost() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("replica");
    let (nats, x) = copied_then_x_lost_its_v2(&data).await;

    let xs = x.to_string();
    let online = cli(&nats, &["history", &xs]);
    assert_eq!(online.status.code(), Some(1), "{}", common::text(&online));
    assert!(common::text(&online).contains("LOST v2"));
    let offline = common::provledger(&["--data-dir", data.to_str().unwrap(), "history", &xs], "");
    assert!(offline.status.success(), "{}", common::text(&offline));
    assert!(
        common::text(&offline).contains("marker-of-version-two")
            && !common::text(&offline).contains("LOST"),
        "{}",
        common::text(&offline)
    );
}

/// Given a replica that applied X's three commits and Y's one, then stopped, and the server
/// that dropped X's v2 (a damaged block, the server restarted), when the operator follows
/// docs/operating.md ("Putting a lost commit back"): backs up the damaged stream, then the
/// replica's copy, removes the damaged stream and restores the copy's backup with
/// `--verify`, then `audit --nats` is clean, X's history holds v2 again, and X is written
/// at its true version (v4, after v3), through a fresh serve replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_stream_lost_is_put_back_from_a_replicas_copy() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("replica");
    let (nats, x) = copied_then_x_lost_its_v2(&data).await;
    let client = nats.client().await;
    let xs = x.to_string();
    let before = cli(&nats, &["audit"]);
    assert_eq!(before.status.code(), Some(1), "{}", common::text(&before));
    assert!(common::text(&before).contains("[lost_commits]"));

    // When the damaged stream is backed up (its bytes kept aside), then the replica's copy,
    let damaged = dir.path().join("damaged");
    let out = cli(&nats, &["backup", "--to", damaged.to_str().unwrap()]);
    assert!(out.status.success(), "{}", common::text(&out));
    let from_copy = dir.path().join("from-copy");
    let out = common::provledger(
        &[
            "backup",
            "--from-copy",
            data.to_str().unwrap(),
            "--to",
            from_copy.to_str().unwrap(),
        ],
        "",
    );
    assert!(out.status.success(), "{}", common::text(&out));
    // (the copy covers the stream's end: nothing written after it would be lost)
    assert!(
        common::text(&out).contains("covers positions 1..=4"),
        "{}",
        common::text(&out)
    );
    // the damaged stream is removed and the copy's backup restored with --verify,
    let log = common::stream(&nats).await;
    log.context().delete_stream("PROVLEDGER").await.unwrap();
    drop(log);
    let restore = cli(
        &nats,
        &["restore", "--from", from_copy.to_str().unwrap(), "--verify"],
    );
    assert!(restore.status.success(), "{}", common::text(&restore));

    // then the audit is clean, X's history holds v2 (the marker) and no loss,
    let audit = cli(&nats, &["audit"]);
    assert!(audit.status.success(), "{}", common::text(&audit));
    let history = cli(&nats, &["history", &xs]);
    assert!(history.status.success(), "{}", common::text(&history));
    assert!(
        common::text(&history).contains("marker-of-version-two")
            && !common::text(&history).contains("LOST"),
        "{}",
        common::text(&history)
    );
    // and a fresh replica writes X at its true version, v4, at the stream's next position.
    let _fresh = common::Serve::start(&nats, &dir.path().join("fresh"));
    common::wait_ready(&client).await;
    let change = json!([{"cluster_status_changed": {"status": "active", "description": "back"}}]);
    let reply = ask(
        &client,
        CMD,
        json!({"aggregate": xs, "expect": 3, "events": change}),
    )
    .await;
    assert_eq!(reply["data"]["version"], 4, "{reply}");
    assert_eq!(reply["data"]["position"], 5, "{reply}");
}

fn cli(nats: &NatsServer, args: &[&str]) -> std::process::Output {
    let url = nats.url();
    let mut all = vec!["--nats", url.as_str()];
    all.extend_from_slice(args);
    common::provledger(&all, "")
}

/// The operator's acknowledgement of X's lost v2, through the CLI: it succeeds.
fn acknowledge_x_v2(nats: &NatsServer, xs: &str) {
    let ack = cli(
        nats,
        &[
            "integrity",
            "acknowledge",
            xs,
            "--lost",
            "2",
            "--reason",
            "checked against the IPAM",
            "--actor",
            "oncall",
        ],
    );
    assert!(ack.status.success(), "{}", common::text(&ack));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_lost_mid_chain_answers_integrity_everywhere_until_acknowledged() {
    let (nats, x, y) = x_lost_its_v2().await;
    let (xs, ys) = (x.to_string(), y.to_string());

    // When the CLI reads X, then `state` and `history` exit 1 naming the lost version,
    let state = cli(&nats, &["state", &xs]);
    assert_eq!(state.status.code(), Some(1), "{}", common::text(&state));
    assert!(
        common::text(&state).contains("integrity")
            && common::text(&state).contains("version 2 is missing"),
        "{}",
        common::text(&state)
    );
    let history = cli(&nats, &["history", &xs]);
    assert_eq!(history.status.code(), Some(1), "{}", common::text(&history));
    assert!(
        common::text(&history).contains("LOST v2"),
        "{}",
        common::text(&history)
    );
    // while Y is unaffected; audit names the loss as one (and not as a quarantine).
    assert!(cli(&nats, &["state", &ys]).status.success());
    let audit = cli(&nats, &["audit"]);
    assert_eq!(audit.status.code(), Some(1), "{}", common::text(&audit));
    assert!(
        common::text(&audit).contains("[lost_commits]")
            && !common::text(&audit).contains("[quarantine]"),
        "{}",
        common::text(&audit)
    );

    // When a fresh replica serves X, then its get answers integrity (Y its state),
    let dir = tempfile::tempdir().unwrap();
    let mut serve = common::Serve::start(&nats, &dir.path().join("fresh"));
    let client = nats.client().await;
    common::wait_ready(&client).await;
    let get = |id: &AggregateId| json!({"id": id.id.to_string(), "min_position": 4});
    let reply = ask(&client, "provledger.q.cluster.get", get(&x)).await;
    assert_eq!(reply["error"]["code"], "integrity", "{reply}");
    assert_eq!(reply["error"]["version"], 2, "{reply}");
    let reply = ask(&client, "provledger.q.cluster.get", get(&y)).await;
    assert!(reply["error"].is_null(), "{reply}");

    // and every form of cmd.append on X answers integrity: nothing is written, nothing forks.
    let log = common::stream(&nats).await;
    let before = log.last_position().await.unwrap();
    let change = json!([{"cluster_status_changed": {"status": "error", "description": "fork?"}}]);
    for expect in [json!(1), json!("any"), json!(3)] {
        let reply = ask(
            &client,
            CMD,
            json!({"aggregate": xs, "expect": expect, "events": change}),
        )
        .await;
        assert_eq!(
            reply["error"]["code"], "integrity",
            "expect {expect}: {reply}"
        );
    }
    let reply = ask(
        &client,
        CMD,
        json!({"commits": [{"aggregate": xs, "expect": 3, "events": change},
                           {"aggregate": ys, "expect": 1, "events": change}]}),
    )
    .await;
    assert_eq!(reply["error"]["code"], "integrity", "atomic: {reply}");
    assert_eq!(
        log.last_position().await.unwrap(),
        before,
        "nothing was written"
    );

    // When an operator acknowledges the loss (a wrong range is refused first),
    let wrong = cli(
        &nats,
        &[
            "integrity",
            "acknowledge",
            &xs,
            "--lost",
            "2-3",
            "--reason",
            "x",
        ],
    );
    assert_eq!(wrong.status.code(), Some(2), "{}", common::text(&wrong));
    acknowledge_x_v2(&nats, &xs);

    // then X is read again, at v4, with the loss noted; history shows it acknowledged;
    let state = cli(&nats, &["--json", "state", &xs]);
    assert!(state.status.success(), "{}", common::text(&state));
    let history = cli(&nats, &["history", &xs]);
    assert!(history.status.success(), "{}", common::text(&history));
    assert!(common::text(&history).contains("LOST v2: missing from the log; acknowledged"));
    let audit = cli(&nats, &["audit"]);
    assert!(audit.status.success(), "{}", common::text(&audit));
    assert!(
        common::text(&audit).contains("loss acknowledged: "),
        "{}",
        common::text(&audit)
    );
    // the running replica folds the commits it held, and writes continue after v4.
    let reply = ask(
        &client,
        "provledger.q.cluster.get",
        json!({"id": x.id.to_string(), "min_position": before + 1}),
    )
    .await;
    assert_eq!(reply["data"]["version"], 4, "{reply}");
    let reply = ask(
        &client,
        CMD,
        json!({"aggregate": xs, "expect": 4, "events": change}),
    )
    .await;
    assert!(reply["error"].is_null(), "{reply}");
    serve.kill();
}

/// Given a log handle that met X's loss on an append (and so holds X's head with the loss
/// open), when another process acknowledges the loss, then the handle's next append on X
/// lands after the acknowledgement: it reads the head again before refusing on the loss it
/// had cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_acknowledged_by_another_process_no_longer_refuses_a_handle_that_met_it() {
    let (nats, x, _y) = x_lost_its_v2().await;
    let log = common::stream(&nats).await;
    let refused = log
        .append(x, Expectation::Any, CommitDraft::now("t", status("before")))
        .await;
    assert!(
        matches!(refused, Err(provledger_events::AppendError::Loss(_))),
        "{refused:?}"
    );

    acknowledge_x_v2(&nats, &x.to_string());

    // (`any`, which the cached head admits: only the loss sends the handle to the server.)
    let landed = log
        .append(x, Expectation::Any, CommitDraft::now("t", status("after")))
        .await
        .expect("the acknowledged loss no longer refuses");
    assert_eq!(landed.version, 5);
}
