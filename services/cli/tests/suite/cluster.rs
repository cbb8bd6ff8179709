//! The CLI against a real 3-node JetStream cluster: a seed list of URLs, an R3 stream made
//! with --stream-replicas 3 and then verified, a replica count that does not match refused
//! by name, and serve answering across the loss of a member.

use std::process::{Command, Stdio};
use std::time::Duration;

use provledger_tests::NatsCluster;
use serde_json::Value;

use crate::common;
use crate::common::{provledger, text};

const CLUSTER: &str = "cluster/0190c0de-0000-7000-8000-0000000c1001";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_r3_stream_through_a_seed_list_and_serve_across_a_member_loss() {
    let mut cluster = NatsCluster::start(3).await;
    let seeds = cluster.seeds();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("cli");
    let data = data.to_str().unwrap().to_string();

    // Given an R3 stream created through a seed list...
    let (s, d) = (seeds.clone(), data.clone());
    let out = tokio::task::spawn_blocking(move || {
        provledger(
            &["--nats", &s, "--stream-replicas", "3", "--data-dir", &d, "append", CLUSTER,
              "--expect", "none", "--events", "-"],
            r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#,
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // ...a client expecting one replica is refused by name (exit 1)...
    let (s, d) = (seeds.clone(), data.clone());
    let out = tokio::task::spawn_blocking(move || {
        provledger(&["--nats", &s, "--data-dir", &d, "history", CLUSTER], "")
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("num_replicas = 3"), "{}", text(&out));

    // ...and a serve replica given the seed list keeps answering when a member dies.
    let serve_dir = dir.path().join("serve");
    let log = std::fs::File::create(serve_dir.with_extension("log")).unwrap();
    let mut serve = Command::new(env!("CARGO_BIN_EXE_provledger"))
        .args([
            "--nats",
            &seeds,
            "--stream-replicas",
            "3",
            "serve",
            "--recovery-interval",
            "0",
        ])
        .arg("--data-dir")
        .arg(&serve_dir)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let client = async_nats::connect(seeds.split(',').collect::<Vec<_>>())
        .await
        .unwrap();
    common::wait_ready(&client).await;
    let ask = |client: async_nats::Client| async move {
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            client.request(
                "provledger.q.cluster.get",
                r#"{"id": "0190c0de-0000-7000-8000-0000000c1001", "min_position": 1}"#.into(),
            ),
        )
        .await;
        match reply {
            Ok(Ok(msg)) => serde_json::from_slice::<Value>(&msg.payload).unwrap_or(Value::Null),
            _ => Value::Null,
        }
    };
    let before = ask(client.clone()).await;
    assert_eq!(before["data"]["name"], "c1", "{before}");
    cluster.kill(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let after = ask(client.clone()).await;
        if after["data"]["name"] == "c1" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "serve stopped answering: {after}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = serve.kill();
    let _ = serve.wait();
}
