//! `deploy/nats/single.conf` runs as is: `nats-server -c deploy/nats/single.conf`, with the
//! port overridden by nats-server's own flags and the store (relative to the working
//! directory) in a temporary directory, starts and answers JetStream requests, storing in
//! that directory and nowhere else.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use provledger_deploy::single_node_config_path;
use provledger_tests::{free_port, nats_server_binary};

const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The nats-server process, SIGKILLed when the test ends however it ends.
struct KilledOnDrop(Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn nats_server_runs_the_committed_single_conf_as_is_and_answers_jetstream() {
    // Given: the committed file, unchanged, and a fresh working directory for its store.
    let binary = nats_server_binary().unwrap_or_else(|e| panic!("{e}"));
    let workdir = tempfile::tempdir().expect("a working directory");
    let (port, monitor_port) = (free_port(), free_port());
    let log = std::fs::File::create(workdir.path().join("server.log")).expect("server log");

    // When: nats-server starts on it, only the ports given on its command line.
    let mut server = KilledOnDrop(
        Command::new(&binary)
            .current_dir(workdir.path())
            .arg("-c")
            .arg(single_node_config_path())
            .args(["-p", &port.to_string(), "-m", &monitor_port.to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", binary.display())),
    );

    // Then: it accepts a JetStream request, keeps a stream's message in the store under
    // the working directory, and applies the file's settings (its payload limit).
    let url = format!("nats://127.0.0.1:{port}");
    let deadline = Instant::now() + START_TIMEOUT;
    let client = loop {
        if let Ok(client) = async_nats::connect(&url).await {
            break client;
        }
        let exited = server.0.try_wait().expect("the server's status");
        let server_log =
            std::fs::read_to_string(workdir.path().join("server.log")).unwrap_or_default();
        assert!(
            exited.is_none() && Instant::now() < deadline,
            "nats-server -c single.conf did not start ({exited:?}):\n{server_log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        client.server_info().max_payload,
        2 * 1024 * 1024,
        "single.conf's max_payload"
    );
    let js = async_nats::jetstream::new(client);
    let account = js
        .query_account()
        .await
        .expect("a JetStream account request");
    assert_eq!(account.streams, 0);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "SINGLE_CONF".into(),
        subjects: vec!["single.conf".into()],
        ..Default::default()
    })
    .await
    .expect("a stream");
    js.publish("single.conf", "stored".into())
        .await
        .expect("publishing")
        .await
        .expect("an acknowledgement");
    let store = workdir.path().join("nats-data/jetstream");
    assert!(
        store.is_dir(),
        "the store is nats-data/ under the working directory"
    );
}
