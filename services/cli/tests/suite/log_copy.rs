//! Every serve replica keeps the commits it applied in its data dir (issue 39): a stopped
//! replica answers `history`, `state --at` and `audit` offline, as the stream does; and
//! `--no-log-copy` keeps none.

use provledger_tests::NatsServer;
use serde_json::Value;

use crate::common;

/// `provledger --json ARGS`, offline on `dir` (`nats`: None) or on the stream; the exit
/// code and the JSON printed (Null when none).
fn run(dir: &std::path::Path, nats: Option<&NatsServer>, args: &[&str]) -> (i32, Value) {
    let url = nats.map(|n| n.url());
    let mut all = vec!["--json", "--data-dir", dir.to_str().unwrap()];
    if let Some(url) = &url {
        all.extend(["--nats", url.as_str()]);
    }
    all.extend_from_slice(args);
    let out = common::provledger(&all, "");
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let code = out.status.code().unwrap_or(-1);
    assert!(
        code != 0 || !json.is_null(),
        "{args:?}: {}",
        common::text(&out)
    );
    (code, json)
}

/// Given a replica that served while four writers appended 240 commits and then stopped,
/// when `history`, `state --at` and `audit` are run on its data dir without NATS, then each
/// answers what the stream answers (the same commits, the same state at a position half
/// way, a clean audit of the same commits through the same position), and the stream's own
/// audit finds the copy byte for byte the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_replica_answers_history_state_at_and_audit_offline_from_its_copy() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("replica");
    let mut serve = common::Serve::start(&nats, &data);
    let client = nats.client().await;
    common::wait_ready(&client).await;
    common::write_concurrently(&nats, 4, 60).await;
    let log = common::stream(&nats).await;
    let end = common::quiet_end(&log).await;
    assert_eq!(end, 240);
    common::wait_position(&client, end).await;
    assert!(serve.terminate().success());

    let commits = common::stream_commits(&log).await;
    let middle = &commits[120];
    let aggregate = middle.aggregate.to_string();
    let (code, offline) = run(&data, None, &["history", &aggregate]);
    assert_eq!(code, 0, "{offline}");
    let (_, online) = run(&data, Some(&nats), &["history", &aggregate]);
    assert_eq!(offline["commits"], online["commits"]);
    assert!(offline["commits"].as_array().unwrap().len() > 1);

    let at = middle.position.to_string();
    let (code, offline) = run(&data, None, &["state", &aggregate, "--at", &at]);
    assert_eq!(code, 0, "{offline}");
    let (_, online) = run(&data, Some(&nats), &["state", &aggregate, "--at", &at]);
    assert_eq!(offline["state"], online["state"]);
    assert_eq!(offline["state"]["version"], middle.version);

    let (code, offline) = run(&data, None, &["audit"]);
    assert_eq!(code, 0, "{offline}");
    let (code, online) = run(&data, Some(&nats), &["audit"]);
    assert_eq!(code, 0, "{online}");
    for field in [
        "ok",
        "position",
        "commits",
        "events",
        "quarantined",
        "formats",
    ] {
        assert_eq!(offline[field], online[field], "{field}");
    }
    assert_eq!(offline["position"], end);
    let compared = online["notes"].as_array().unwrap();
    assert!(
        compared.is_empty(),
        "the stream's audit compared the copy: {compared:?}"
    );
}

/// Given a replica that kept a copy, when it runs again with `--no-log-copy` and stops,
/// then its data dir keeps no copy: `history` offline refuses and says where history is,
/// while the current state is still read from the projection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_copy_keeps_none_and_removes_the_one_kept_before() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("replica");
    let client = nats.client().await;
    let mut serve = common::Serve::start(&nats, &data);
    common::wait_ready(&client).await;
    common::write_concurrently(&nats, 2, 10).await;
    common::wait_position(&client, 20).await;
    assert!(serve.terminate().success());
    let log = common::stream(&nats).await;
    let aggregate = common::stream_commits(&log).await[0].aggregate.to_string();
    assert_eq!(
        run(&data, None, &["history", &aggregate]).0,
        0,
        "a copy was kept"
    );

    let mut serve = common::Serve::start_with(&nats, &data, &["--no-log-copy"]);
    common::wait_ready(&client).await;
    assert!(serve.terminate().success());
    let out = common::provledger(
        &["--data-dir", data.to_str().unwrap(), "history", &aggregate],
        "",
    );
    assert_eq!(out.status.code(), Some(1), "{}", common::text(&out));
    assert!(
        common::text(&out).contains("keeps no copy of the log"),
        "{}",
        common::text(&out)
    );
    let (code, state) = run(&data, None, &["state", &aggregate]);
    assert_eq!(code, 0, "{state}");
}

/// Follows `q.changes` from position 0 until `end`: each change's (position, actor).
async fn catch_up(client: &async_nats::Client, end: u64) -> Vec<(u64, String)> {
    let (mut after, mut seen) = (0u64, Vec::new());
    while after < end {
        let body = serde_json::json!({"after": after, "limit": 50});
        let reply = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            client.request("provledger.q.changes", body.to_string().into()),
        )
        .await
        .expect("a reply in time")
        .expect("a reply");
        let reply: Value = serde_json::from_slice(&reply.payload).expect("JSON");
        let data = &reply["data"];
        for change in data["changes"].as_array().expect("changes") {
            seen.push((
                change["position"].as_u64().unwrap(),
                change["actor"].as_str().unwrap().to_string(),
            ));
        }
        after = data["next"].as_u64().expect("next");
    }
    seen
}

/// `provledger_changes_read_total{source=...}` of serve on `port`.
fn changes_read(port: u16, source: &str) -> f64 {
    let (_, scrape) = common::http_get(port, "/metrics").expect("a scrape");
    common::sample(
        &scrape,
        &format!("provledger_changes_read_total{{source=\"{source}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Given a replica whose copy holds the stream's 240 commits, when a follower catches up
/// from position 0, then every page is read from the copy (none from the stream) and holds
/// exactly the stream's commits; and given one copied commit altered on disk while the
/// replica was stopped (its hash no longer matches), when a follower catches up again,
/// then that page is read from the stream instead and the follower gets the stream's
/// commit, never the altered one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_followers_catch_up_is_read_from_the_copy_and_never_serves_a_damaged_entry() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("replica");
    let port = provledger_tests::free_port();
    let metrics = ["--metrics-addr", &format!("127.0.0.1:{port}")];
    let mut serve = common::Serve::start_with(&nats, &data, &metrics);
    let client = nats.client().await;
    common::wait_ready(&client).await;
    common::write_concurrently(&nats, 4, 60).await;
    let log = common::stream(&nats).await;
    let end = common::quiet_end(&log).await;
    common::wait_position(&client, end).await;
    let expected: Vec<(u64, String)> = common::stream_commits(&log)
        .await
        .iter()
        .map(|c| (c.position, c.actor.clone()))
        .collect();

    // (the copier writes what was applied within about a second: until then a page may
    // come from the stream)
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let before = changes_read(port, "stream");
        assert_eq!(catch_up(&client, end).await, expected);
        if changes_read(port, "stream") == before {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a catch-up still read the stream 20 s after the writes"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(changes_read(port, "copy") >= end as f64);

    assert!(serve.terminate().success());
    let altered = expected[100].0;
    {
        let db = common::open_stopped_data_dir(&data);
        let tree = db
            .open_tree(provledger_serve::log_copy::COPY_TREE)
            .expect("the copy");
        let (key, at) = provledger_serve::log_copy::locate(&tree, altered)
            .unwrap()
            .expect("the commit is in the copy");
        let mut pack = tree.get(&key).unwrap().expect("its pack").to_vec();
        let mut commit = provledger_events::codec::decode(&pack[at.clone()], altered).unwrap();
        // Another actor of the same length: the commit keeps its place in the pack.
        commit.actor = "x".repeat(commit.actor.len());
        let bytes = provledger_events::codec::encode(&commit).unwrap();
        assert_eq!(bytes.len(), at.len());
        pack[at].copy_from_slice(&bytes);
        tree.insert(key, pack).unwrap();
        db.flush().unwrap();
    }
    let _serve = common::Serve::start_with(&nats, &data, &metrics);
    common::wait_ready(&client).await;
    let before = changes_read(port, "stream");
    assert_eq!(catch_up(&client, end).await, expected);
    assert!(
        changes_read(port, "stream") > before,
        "the damaged entry's page was read from the stream"
    );
}
