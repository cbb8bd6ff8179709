//! Shared by the test binaries that run `provledger serve` as a child process.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use provledger_tests::NatsServer;

pub struct Serve {
    child: Child,
}

impl Serve {
    #[allow(dead_code)]
    pub fn start(nats: &NatsServer, dir: &Path) -> Serve {
        Self::start_with(nats, dir, &[])
    }

    /// Starts serve with extra arguments (e.g. compensation retry bounds).
    #[allow(dead_code)]
    pub fn start_with(nats: &NatsServer, dir: &Path, extra: &[&str]) -> Serve {
        Self::start_at(&nats.url(), dir, extra)
    }

    /// Starts serve on a NATS URL of the caller's choosing (a user in it, say).
    #[allow(dead_code)]
    pub fn start_at(url: &str, dir: &Path, extra: &[&str]) -> Serve {
        Self::spawn(url, dir, extra, None)
    }

    /// Starts serve with a soft limit of `files` open files, as a systemd unit without
    /// `LimitNOFILE` gives it (1,024).
    #[allow(dead_code)]
    pub fn start_with_open_files(
        nats: &NatsServer,
        dir: &Path,
        extra: &[&str],
        files: u64,
    ) -> Serve {
        Self::spawn(&nats.url(), dir, extra, Some(files))
    }

    fn spawn(url: &str, dir: &Path, extra: &[&str], files: Option<u64>) -> Serve {
        let log = std::fs::File::create(dir.with_extension("log")).expect("serve log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_provledger"));
        if let Some(files) = files {
            use std::os::unix::process::CommandExt;
            // SAFETY: between fork and exec only setrlimit runs, which is async-signal-safe
            // and touches no memory of the parent.
            unsafe {
                command.pre_exec(move || {
                    let mut limit = libc::rlimit {
                        rlim_cur: 0,
                        rlim_max: 0,
                    };
                    if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    limit.rlim_cur = files.min(limit.rlim_max);
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        // Short waits for a position, unless the test sets its own.
        let wait: &[&str] = match extra.iter().any(|a| a.starts_with("--min-position-wait")) {
            true => &[],
            false => &["--min-position-wait-ms", "300"],
        };
        let child = command
            .args(["serve", "--snapshot-every", "50"])
            .args(wait)
            .args(extra)
            .arg("--nats")
            .arg(url)
            .arg("--data-dir")
            .arg(dir)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn provledger serve");
        Serve { child }
    }

    #[allow(dead_code)]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        // std's kill is SIGKILL on unix: no chance to flush or finish a batch.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits (bounded) for serve to exit on its own.
    #[allow(dead_code)]
    pub fn wait_for_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("wait serve") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    #[allow(dead_code)]
    pub fn terminate(&mut self) -> ExitStatus {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait serve") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "serve did not stop after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A JetStream ledger on `nats` (stream `PROVLEDGER`, prefix `provledger`), the simulated
/// executors answering compensation and inventory requests on it, and a compute node of
/// `vcpus` VCPUs: the NATS client, the ledger, the executors and the node's provider id.
#[allow(dead_code)]
pub async fn ledger_with_executors(
    nats: &NatsServer,
    vcpus: u64,
) -> (
    async_nats::Client,
    provledger_client::Writer<provledger_client::Ledger>,
    std::sync::Arc<provledger_sim::SimInfrastructure>,
    uuid::Uuid,
) {
    let (client, log) = provledger_client::open_jetstream(
        &nats.url(),
        "test",
        "PROVLEDGER",
        "provledger",
        1,
        &Default::default(),
    )
    .await
    .expect("jetstream");
    let ledger = provledger_client::Writer::new(provledger_client::Ledger::JetStream(log));
    let infra = std::sync::Arc::new(provledger_sim::SimInfrastructure::default());
    infra
        .clone()
        .serve_on_nats(client.clone(), "provledger")
        .await
        .expect("executors on NATS");
    let provider = uuid::Uuid::now_v7();
    provledger_sim::register_compute_node(&ledger, provider, "cn", vcpus, "test")
        .await
        .expect("a compute node");
    (client, ledger, infra, provider)
}

/// Waits until a serve replica answers `$SRV.INFO.provledger` with every endpoint. Not
/// `$SRV.PING`: the micro service answers it as soon as it starts, before serve has added
/// its endpoints one by one, and a request sent in between finds no responder. Serve adds
/// them in order on one connection, so an INFO listing them all comes after every one of
/// their subscriptions reached the server.
#[allow(dead_code)]
pub async fn wait_ready(client: &async_nats::Client) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let all = provledger_serve::endpoint_subjects().len();
    loop {
        let info = tokio::time::timeout(
            Duration::from_millis(500),
            client.request("$SRV.INFO.provledger", "".into()),
        )
        .await;
        let endpoints = match &info {
            Ok(Ok(reply)) => serde_json::from_slice::<serde_json::Value>(&reply.payload)
                .ok()
                .and_then(|v| v["endpoints"].as_array().map(Vec::len)),
            _ => None,
        };
        if endpoints == Some(all) {
            return;
        }
        assert!(Instant::now() < deadline, "serve never became ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the `provledger` binary with `args` and `stdin`, without `PROVLEDGER_NATS_URL` from
/// the environment, and returns what it did.
#[allow(dead_code)]
pub fn provledger<S: AsRef<std::ffi::OsStr>>(args: &[S], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_provledger"))
        .args(args)
        .env_remove("PROVLEDGER_NATS_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn provledger");
    // A command that refuses its arguments exits before reading stdin: the pipe is then
    // closed, which is not the test's concern.
    if let Err(e) = child
        .stdin
        .take()
        .expect("stdin piped")
        .write_all(stdin.as_bytes())
    {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }
    child.wait_with_output().expect("wait for provledger")
}

/// Everything a command printed, stdout then stderr.
#[allow(dead_code)]
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

impl Serve {
    /// Starts serve sweeping for stuck tasks and half-done deletes every second.
    #[allow(dead_code)]
    pub fn start_sweeping(nats: &NatsServer, dir: &Path) -> Serve {
        Self::start_with(nats, dir, &["--recovery-interval", "1"])
    }
}

/// The test server's stream, read directly (not through serve).
#[allow(dead_code)]
pub async fn stream(nats: &NatsServer) -> provledger_events::JetStreamLog {
    provledger_events::JetStreamLog::open(
        nats.client().await,
        provledger_events::JetStreamConfig::default(),
    )
    .await
    .expect("the stream opens")
}

/// How many recoveries (`task_finished` recovered) instance `id` has in the log.
#[allow(dead_code)]
pub async fn recoveries_of(log: &provledger_events::JetStreamLog, id: &str) -> usize {
    use provledger_events::EventLog;
    let instance = provledger_events::AggregateId::instance(id.parse().expect("a uuid"));
    log.read_aggregate(instance)
        .await
        .expect("read the instance")
        .iter()
        .flat_map(|c| c.events.iter())
        .filter(|e| {
            matches!(
                e,
                provledger_events::Event::TaskFinished {
                    outcome: provledger_events::catalogue::TaskOutcome::Recovered,
                    ..
                }
            )
        })
        .count()
}

/// How many times each consumer's allocation was released on `provider`, in the log.
#[allow(dead_code)]
pub async fn releases_by_consumer(
    log: &provledger_events::JetStreamLog,
    provider: provledger_events::AggregateId,
) -> std::collections::BTreeMap<uuid::Uuid, usize> {
    use provledger_events::EventLog;
    let mut released = std::collections::BTreeMap::new();
    for c in log
        .read_aggregate(provider)
        .await
        .expect("read the provider")
    {
        for e in &c.events {
            if let provledger_events::Event::AllocationReleased { consumer, .. } = e {
                *released.entry(*consumer).or_insert(0) += 1;
            }
        }
    }
    released
}

/// `GET path` on 127.0.0.1:`port` (serve's `--metrics-addr`) over plain HTTP/1.1:
/// (status code, body).
#[allow(dead_code)]
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// The value of the sample `name{labels}` in a scrape, if present.
#[allow(dead_code)]
pub fn sample(scrape: &str, name_and_labels: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
}

/// A two-node create on `provider` whose second VM fails to boot, run by a provisioning
/// service on `ledger` (cancel notices over `client`): it fails after making resources, so
/// a rollback has something to undo. Returns the create's operation id.
#[allow(dead_code)]
pub async fn fail_a_create(
    client: &async_nats::Client,
    ledger: &provledger_client::Writer<provledger_client::Ledger>,
    infra: &std::sync::Arc<provledger_sim::SimInfrastructure>,
    provider: uuid::Uuid,
) -> uuid::Uuid {
    infra.hypervisor.fail_call("create_vm", 2);
    let runner = provledger_client::OperationRunner::new(
        ledger.clone(),
        provledger_client::CancelNotices::nats(client.clone(), "provledger"),
        None,
        "test-service",
    );
    let report = provledger_sim::Provisioner::new(runner, infra.clone(), "test-service")
        .create_cluster(two_workers(provider, "workers"))
        .await;
    assert!(report.result.is_err(), "the create fails");
    report.operation_id
}

/// [`fail_a_create`], then waits (up to 60 s) until serve's rollback worker has closed
/// the operation: only then is the stream quiet for good (a rollback that starts late on
/// a loaded machine would otherwise land after a `quiet_end`).
#[allow(dead_code)]
pub async fn fail_a_create_rolled_back(
    client: &async_nats::Client,
    ledger: &provledger_client::Writer<provledger_client::Ledger>,
    infra: &std::sync::Arc<provledger_sim::SimInfrastructure>,
    provider: uuid::Uuid,
) -> uuid::Uuid {
    let op = fail_a_create(client, ledger, infra, provider).await;
    operation_closed(ledger, op, Duration::from_secs(60)).await;
    op
}

/// The operation `op` as `ledger` folds it now; a panic if there is none.
#[allow(dead_code)]
pub async fn operation(
    ledger: &provledger_client::Writer<provledger_client::Ledger>,
    op: uuid::Uuid,
) -> Box<provledger_projections::operation::OperationState> {
    match ledger
        .read_current(provledger_events::AggregateId::operation(op))
        .await
    {
        Ok(Some(provledger_projections::Entity::Operation(o))) => o,
        other => panic!("operation {op}: {other:?}"),
    }
}

/// Waits, up to `within`, until the operation `op` is closed (it succeeded, or its
/// rollback finished); its state then.
#[allow(dead_code)]
pub async fn operation_closed(
    ledger: &provledger_client::Writer<provledger_client::Ledger>,
    op: uuid::Uuid,
    within: Duration,
) -> Box<provledger_projections::operation::OperationState> {
    let deadline = Instant::now() + within;
    loop {
        let state = operation(ledger, op).await;
        if state.is_closed() {
            return state;
        }
        assert!(
            Instant::now() < deadline,
            "operation {op} not closed within {within:?}: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The cluster the create tests run: one group `group` of two workers of 2 VCPU each on
/// `provider`.
#[allow(dead_code)]
pub fn two_workers(provider: uuid::Uuid, group: &str) -> provledger_sim::ClusterRequest {
    provledger_sim::ClusterRequest {
        cluster_id: uuid::Uuid::now_v7(),
        name: "c".into(),
        plugin: "vanilla".into(),
        node_groups: vec![provledger_events::catalogue::NodeGroupSpec {
            name: group.into(),
            count: 2,
            flavor: "m".into(),
            resources: std::collections::BTreeMap::from([("VCPU".to_string(), 2)]),
            processes: vec![],
        }],
        provider,
    }
}

/// A failed create on the data dir `d` (embedded), whose rollback has something to undo
/// at the executors: its operation id.
#[allow(dead_code)]
pub async fn failed_embedded_create(d: &Path) -> String {
    use provledger_client::{CancelNotices, Ledger, OperationRunner};
    use provledger_events::SledLog;
    use provledger_sim::{register_compute_node, Provisioner, SimInfrastructure};

    let log = SledLog::open(d).unwrap();
    let ledger = provledger_client::Writer::new(Ledger::Embedded(log.clone()));
    let provider = uuid::Uuid::now_v7();
    register_compute_node(&ledger, provider, "cn", 64, "t")
        .await
        .unwrap();
    let infra = std::sync::Arc::new(SimInfrastructure::default());
    infra.hypervisor.fail_call("create_vm", 2);
    let runner = OperationRunner::new(ledger.clone(), CancelNotices::local(), None, "t");
    let report = Provisioner::new(runner, infra.clone(), "t")
        .create_cluster(two_workers(provider, "w"))
        .await;
    assert!(report.result.is_err(), "the create fails");
    drop(ledger);
    log.close();
    report.operation_id.to_string()
}

/// The stream's end once it has not moved for a second (serve's own writes, a rollback
/// finished, all landed).
#[allow(dead_code)]
pub async fn quiet_end(log: &provledger_events::JetStreamLog) -> u64 {
    use provledger_events::EventLog;
    let mut end = log.last_position().await.unwrap();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = log.last_position().await.unwrap();
        if now == end {
            return end;
        }
        end = now;
    }
}

/// Every commit of the stream, in position order (what readers quarantine left out).
#[allow(dead_code)]
pub async fn stream_commits(
    log: &provledger_events::JetStreamLog,
) -> Vec<provledger_events::Commit> {
    use futures::StreamExt;
    use provledger_events::EventLog;
    log.read_all(1)
        .await
        .unwrap()
        .filter_map(|c| async move { c.ok() })
        .collect()
        .await
}

/// Every reply to one request on `subject` within `wait` (a micro service's `$SRV.PING`,
/// answered once per replica).
#[allow(dead_code)]
pub async fn gather(
    client: &async_nats::Client,
    subject: &str,
    wait: Duration,
) -> Vec<serde_json::Value> {
    use futures::StreamExt;
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.expect("subscribe");
    client
        .publish_with_reply(subject.to_string(), inbox, "".into())
        .await
        .expect("publish");
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, sub.next()).await {
        // A "no responders" status arrives as an empty message; it is not a reply.
        if !msg.payload.is_empty() {
            out.push(serde_json::from_slice(&msg.payload).expect("JSON"));
        }
    }
    out
}

/// Waits until `n` serve replicas answer `$SRV.PING` (each joined the queue group).
#[allow(dead_code)]
pub async fn wait_ready_replicas(client: &async_nats::Client, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while gather(client, "$SRV.PING.provledger", Duration::from_millis(300))
        .await
        .len()
        < n
    {
        assert!(
            Instant::now() < deadline,
            "{n} replicas never answered PING"
        );
    }
}

/// `writers` tasks appending `per_writer` commits each, every commit on a cluster of its
/// own writer (a create, then status changes), as fast as they can.
#[allow(dead_code)]
pub async fn write_concurrently(nats: &NatsServer, writers: usize, per_writer: usize) {
    let log = std::sync::Arc::new(stream(nats).await);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let log = std::sync::Arc::clone(&log);
        tasks.push(tokio::spawn(async move {
            let mut cluster = provledger_events::AggregateId::cluster(uuid::Uuid::now_v7());
            for i in 0..per_writer {
                // A cluster per 50 commits, so that aggregates stay short.
                if i % 50 == 0 {
                    cluster = provledger_events::AggregateId::cluster(uuid::Uuid::now_v7());
                }
                let event = if i % 50 == 0 {
                    provledger_events::catalogue::samples::all().remove(0)
                } else {
                    provledger_events::Event::ClusterStatusChanged {
                        status: provledger_events::catalogue::ClusterStatus::Spawning,
                        description: format!("writer {w} commit {i}"),
                    }
                };
                let draft = provledger_events::CommitDraft::now("writer", vec![event]);
                provledger_events::EventLog::append(
                    &*log,
                    cluster,
                    provledger_events::Expectation::Any,
                    draft,
                )
                .await
                .expect("append");
            }
        }));
    }
    for t in tasks {
        t.await.expect("writer");
    }
}

/// Waits until some replica answers health at or past `position` (and the service is up).
#[allow(dead_code)]
pub async fn wait_position(client: &async_nats::Client, position: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reply = tokio::time::timeout(
            Duration::from_secs(1),
            client.request("provledger.q.health", "{}".into()),
        )
        .await;
        if let Ok(Ok(msg)) = reply {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&msg.payload) {
                if v["position"].as_u64().unwrap_or(0) >= position {
                    return;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "serve never reached position {position}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until some replica has applied everything the stream holds now.
#[allow(dead_code)]
pub async fn wait_applied(client: &async_nats::Client, log: &provledger_events::JetStreamLog) {
    let end = provledger_events::EventLog::last_position(log)
        .await
        .expect("the stream's end");
    wait_position(client, end).await;
}

/// The JSON reply to one request on `subject` (a query or a command), within 20 s.
#[allow(dead_code)]
pub async fn ask(
    client: &async_nats::Client,
    subject: &str,
    body: serde_json::Value,
) -> serde_json::Value {
    let reply = tokio::time::timeout(
        Duration::from_secs(20),
        client.request(subject.to_string(), body.to_string().into()),
    )
    .await
    .expect("reply in time")
    .expect("request");
    serde_json::from_slice(&reply.payload).expect("JSON reply")
}

/// A stopped replica's sled database, opened in this process to read or damage it, and
/// closed at once when dropped. `sled::open` would start a flusher thread that keeps the
/// directory's lock until it exits, after the drop (sled issue 1234): the next open of the
/// same data dir (here, or by a serve or CLI started next) could then fail on the lock.
pub fn open_stopped_data_dir(data_dir: &Path) -> sled::Db {
    sled::Config::new()
        .path(data_dir.join("sled"))
        .flush_every_ms(None)
        .open()
        .expect("open the stopped replica's sled")
}
