//! provledger-tests owns the test harness: a private `nats-server -js` per test, on a free
//! port with a temporary store, rendered from the `deploy/` configuration and killed on
//! drop. Tests that use it are hermetic and can run in parallel.
//!
//! The binary is found through `NATS_SERVER_BIN`, then `.tools/nats-server` at the
//! workspace root, then `PATH`; candidates older than 2.12 are skipped (reads use batch direct gets, facts on several aggregates atomic batches). This crate never
//! installs anything itself: when nothing fits it fails with the command that does.

pub mod bench;
pub mod docs;
pub mod script;
pub mod workload;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use provledger_deploy::{single_node_config, Hardening, ServerSpec, ACCOUNT_USERS};
use provledger_events::log::{parse_server_version, SERVER_VERSION_MIN};

/// The exact command that installs the pinned nats-server into `.tools/`.
pub const INSTALL_COMMAND: &str = "bash scripts/install-nats-server.sh";
const START_TIMEOUT: Duration = Duration::from_secs(20);

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The version `binary --version` prints (`nats-server: v2.14.6`), parsed as the log parses
/// the one a server reports to its clients.
fn version_of(binary: &Path) -> Option<(u64, u64, u64)> {
    let out = Command::new(binary).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    parse_server_version(text.trim().rsplit(' ').next()?)
}

/// Finds a nats-server of version 2.12 or later, or explains how to install one.
pub fn nats_server_binary() -> Result<PathBuf, String> {
    let mut candidates = Vec::new();
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        candidates.push(PathBuf::from(p));
    }
    candidates.push(workspace_root().join(".tools/nats-server"));
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            candidates.push(dir.join("nats-server"));
        }
    }
    let mut tried = Vec::new();
    for c in candidates {
        if !c.is_file() {
            continue;
        }
        match version_of(&c) {
            Some(v) if v >= SERVER_VERSION_MIN => return Ok(c),
            Some(v) => tried.push(format!(
                "{} (v{}.{}.{}, too old)",
                c.display(),
                v.0,
                v.1,
                v.2
            )),
            None => tried.push(format!("{} (no version)", c.display())),
        }
    }
    Err(format!(
        "no nats-server >= 2.12 found (NATS_SERVER_BIN, .tools/nats-server, PATH; tried: {}). \
         Install the pinned one with: {INSTALL_COMMAND}",
        if tried.is_empty() {
            "nothing".to_string()
        } else {
            tried.join(", ")
        }
    ))
}

/// Where [`free_port`] hands ports out: below Linux's ephemeral range (32768-60999), so
/// that no client connection of a concurrent test can take a port between the moment it
/// is found free and the moment nats-server binds it (a port from `bind(:0)` is an
/// ephemeral one, and was seen taken that way: "address already in use").
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A free TCP port on loopback, never handed out twice by this process: ports are tried in
/// turn from a point that depends on the process id (test binaries run one at a time, and
/// tests within one share this counter), each checked free by binding it.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = u32::from(TEST_PORTS.end - TEST_PORTS.start);
    let start = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        // `offset` < span, which fits in u16 by the range's definition.
        let port = TEST_PORTS.start + offset as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {TEST_PORTS:?} on 127.0.0.1")
}

/// The password the harness gives `user` of `deploy/nats/accounts.conf`.
pub fn test_password(user: &str) -> String {
    format!("test-{user}-secret")
}

/// The TLS files `deploy/tls/make-test-ca.sh` writes.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Makes a test CA, a server and a client certificate in `dir` with the deploy script.
pub fn make_test_ca(dir: &Path) -> TlsFiles {
    let script = workspace_root().join("deploy/tls/make-test-ca.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed (it needs openssl): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join("client.pem"),
        key: dir.join("client-key.pem"),
    }
}

/// A private JetStream server; killed when dropped.
pub struct NatsServer {
    child: Option<Child>,
    spec: ServerSpec,
    dir: tempfile::TempDir,
    binary: PathBuf,
    accounts: bool,
    tls: Option<TlsFiles>,
}

impl NatsServer {
    /// Starts a server on a free port with a temporary store and waits until JetStream answers.
    pub async fn start() -> NatsServer {
        NatsServer::start_hardened(false, false).await
    }

    /// Starts a server with `deploy/nats/accounts.conf` (users and permissions, passwords
    /// from [`test_password`]) and/or `deploy/nats/tls.conf` (a fresh test CA, client
    /// certificates required).
    pub async fn start_hardened(accounts: bool, tls: bool) -> NatsServer {
        let binary = nats_server_binary().unwrap_or_else(|e| panic!("{e}"));
        let dir = tempfile::tempdir().expect("temporary store dir");
        let spec = ServerSpec {
            name: format!("test-{}", std::process::id()),
            host: "127.0.0.1".into(),
            port: free_port(),
            monitor_port: free_port(),
            cluster_port: 0,
        };
        let tls = tls.then(|| make_test_ca(&dir.path().join("tls")));
        let mut server = NatsServer {
            child: None,
            spec,
            dir,
            binary,
            accounts,
            tls,
        };
        server.spawn_and_wait().await;
        server
    }

    async fn spawn_and_wait(&mut self) {
        let store = self.dir.path().join("store");
        let conf = self.dir.path().join("nats.conf");
        let hardening = Hardening {
            accounts: self.accounts,
            tls_dir: self.tls.as_ref().map(|_| self.dir.path().join("tls")),
        };
        std::fs::write(&conf, single_node_config(&self.spec, &store, &hardening))
            .expect("writing nats.conf");
        let log = std::fs::File::create(self.dir.path().join("server.log")).expect("server log");
        let mut command = Command::new(&self.binary);
        for (_, user, variable) in ACCOUNT_USERS {
            command.env(variable, test_password(user));
        }
        let child = command
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.binary.display()));
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(client) = self.options_as("serve").connect(self.url()).await {
                let js = async_nats::jetstream::new(client);
                if js.query_account().await.is_ok() {
                    return;
                }
            }
            if Instant::now() > deadline {
                let log =
                    std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default();
                panic!("nats-server did not become ready on {}:\n{log}", self.url());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.spec.port)
    }

    /// The URL with `user`'s name and password in it (what the CLI is given).
    pub fn url_as(&self, user: &str) -> String {
        format!(
            "nats://{user}:{}@127.0.0.1:{}",
            test_password(user),
            self.spec.port
        )
    }

    /// The TLS files of a server started with TLS.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    /// The server's log so far (permission violations show up here).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// Connect options for `user` (ignored without accounts), with the client
    /// certificate when the server requires TLS.
    pub fn options_as(&self, user: &str) -> async_nats::ConnectOptions {
        let mut options = async_nats::ConnectOptions::new();
        if self.accounts {
            options = options.user_and_password(user.to_string(), test_password(user));
        }
        if let Some(tls) = &self.tls {
            options = options
                .require_tls(true)
                .add_root_certificates(tls.ca.clone())
                .add_client_certificate(tls.cert.clone(), tls.key.clone());
        }
        options
    }

    /// A client connected as `user`.
    pub async fn client_as(&self, user: &str) -> async_nats::Client {
        self.options_as(user)
            .connect(self.url())
            .await
            .unwrap_or_else(|e| panic!("connecting as {user}: {e}"))
    }

    pub fn port(&self) -> u16 {
        self.spec.port
    }

    /// The directory of the server's JetStream store (its `.blk` files hold the messages):
    /// what a test damages while the server is stopped.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// `host:port` of the server's HTTP monitoring endpoint (`/varz`, `/jsz`): every
    /// configuration the harness renders has one.
    pub fn monitor_addr(&self) -> String {
        format!("127.0.0.1:{}", self.spec.monitor_port)
    }

    pub async fn client(&self) -> async_nats::Client {
        async_nats::connect(self.url())
            .await
            .expect("connecting to the test nats-server")
    }

    /// Kills the process (SIGKILL), keeping its port and store for
    /// [`NatsServer::start_again`]: NATS lost for as long as the caller likes.
    pub fn kill(&mut self) {
        self.stop();
    }

    /// Stops the process as an operator would (SIGTERM: it flushes its store and writes its
    /// indexes), keeping its port and store for [`NatsServer::start_again`].
    pub fn shut_down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(child.id().to_string())
                .status();
            let _ = child.wait();
        }
    }

    /// Starts a killed server again on the same port and store.
    pub async fn start_again(&mut self) {
        self.spawn_and_wait().await;
    }

    /// Stops the process (SIGKILL) and starts it again on the same port and store.
    pub async fn restart(&mut self) {
        self.stop();
        self.spawn_and_wait().await;
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A private JetStream cluster of `n` servers rendered from `deploy/nats/cluster-node.conf`;
/// every member killed when dropped.
pub struct NatsCluster {
    nodes: Vec<ClusterNode>,
    binary: PathBuf,
    accounts: bool,
    _dir: tempfile::TempDir,
}

struct ClusterNode {
    spec: ServerSpec,
    conf: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl NatsCluster {
    /// Starts `n` servers routed to each other and waits until JetStream answers on all.
    pub async fn start(n: usize) -> NatsCluster {
        NatsCluster::start_with(n, false).await
    }

    /// Starts `n` servers, with `deploy/nats/accounts.conf` when `accounts` (passwords
    /// from [`test_password`]; readiness is checked as `serve`).
    pub async fn start_with(n: usize, accounts: bool) -> NatsCluster {
        let binary = nats_server_binary().unwrap_or_else(|e| panic!("{e}"));
        let dir = tempfile::tempdir().expect("temporary cluster dir");
        let specs: Vec<ServerSpec> = (0..n)
            .map(|i| ServerSpec {
                name: format!("n{i}-{}", std::process::id()),
                host: "127.0.0.1".into(),
                port: free_port(),
                monitor_port: free_port(),
                cluster_port: free_port(),
            })
            .collect();
        let stores: Vec<PathBuf> = (0..n)
            .map(|i| dir.path().join(format!("store{i}")))
            .collect();
        let store_refs: Vec<&std::path::Path> = stores.iter().map(|p| p.as_path()).collect();
        let configs = provledger_deploy::cluster_configs(
            &specs,
            &store_refs,
            &Hardening {
                accounts,
                tls_dir: None,
            },
        );
        let nodes = specs
            .into_iter()
            .zip(configs)
            .enumerate()
            .map(|(i, (spec, config))| {
                let conf = dir.path().join(format!("n{i}.conf"));
                std::fs::write(&conf, config).expect("writing a cluster config");
                ClusterNode {
                    spec,
                    conf,
                    log: dir.path().join(format!("n{i}.log")),
                    child: None,
                }
            })
            .collect();
        let mut cluster = NatsCluster {
            nodes,
            binary,
            accounts,
            _dir: dir,
        };
        for i in 0..n {
            cluster.spawn(i);
        }
        for i in 0..n {
            cluster.wait_ready(i).await;
        }
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let node = &mut self.nodes[i];
        let log = std::fs::File::create(&node.log).expect("cluster node log");
        let mut command = Command::new(&self.binary);
        for (_, user, variable) in ACCOUNT_USERS {
            command.env(variable, test_password(user));
        }
        let child = command
            .arg("-c")
            .arg(&node.conf)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.binary.display()));
        node.child = Some(child);
    }

    async fn wait_ready(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(client) = self.options_as("serve").connect(self.url(i)).await {
                let js = async_nats::jetstream::new(client);
                if js.query_account().await.is_ok() {
                    return;
                }
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&self.nodes[i].log).unwrap_or_default();
                panic!("cluster node {i} did not become ready:\n{log}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].spec.port)
    }

    /// Connect options for `user` (ignored without accounts).
    pub fn options_as(&self, user: &str) -> async_nats::ConnectOptions {
        let options = async_nats::ConnectOptions::new();
        match self.accounts {
            true => options.user_and_password(user.to_string(), test_password(user)),
            false => options,
        }
    }

    /// A client connected as `user` (ignored without accounts) to whichever member of the
    /// seed list answers, as a service would connect.
    pub async fn client_as(&self, user: &str) -> async_nats::Client {
        let seeds: Vec<String> = (0..self.nodes.len()).map(|i| self.url(i)).collect();
        self.options_as(user)
            .connect(seeds)
            .await
            .unwrap_or_else(|e| panic!("connecting to the cluster as {user}: {e}"))
    }

    /// Every member's URL, comma-separated: the seed list a client is given.
    pub fn seeds(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Member `i`'s server name, as a stream's cluster info names its leader and replicas.
    pub fn name(&self, i: usize) -> &str {
        &self.nodes[i].spec.name
    }

    /// Stops member `i` where it is (SIGSTOP): its connections stay open and it answers
    /// nothing, as a replica that lags (a stalled disk, a long pause) does, until
    /// [`NatsCluster::resume`].
    pub fn pause(&mut self, i: usize) {
        self.signal(i, "-STOP");
    }

    /// Lets member `i` go on after [`NatsCluster::pause`] (SIGCONT).
    pub fn resume(&mut self, i: usize) {
        self.signal(i, "-CONT");
    }

    fn signal(&self, i: usize, signal: &str) {
        let Some(child) = &self.nodes[i].child else {
            panic!("cluster member {i} is not running");
        };
        let status = Command::new("kill")
            .arg(signal)
            .arg(child.id().to_string())
            .status()
            .unwrap_or_else(|e| panic!("kill {signal}: {e}"));
        assert!(status.success(), "kill {signal} member {i}: {status}");
    }

    /// Starts member `i` again on its port and store, and waits until it answers.
    pub async fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        self.wait_ready(i).await;
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

/// Whether a server of `version` (as `INFO` says it: `2.14.6`, `v2.12.8`) takes an atomic
/// batch committed by an end-of-batch marker (2.14+), so that a JetStream log opens its
/// group writes early. The suite reads the version itself rather than asking the log: were
/// the log's own gate wrong, asking it would let the early-open assertions pass without a
/// batch ever opened early.
pub fn opens_batches_early(version: &str) -> bool {
    parse_server_version(version).is_some_and(|v| v >= (2, 14, 0))
}

/// The machine's CPU model (`/proc/cpuinfo`), for the benchmarks' headers; `?` elsewhere.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "?".into())
}

/// Waits until the server has processed every subscription `client` sent before. `flush`
/// only writes them out: a request another connection makes right after may reach the
/// server first and find no responders (a race seen under load). One connection's
/// messages are handled in order, so the client's own message coming back through a new
/// subscription proves the earlier ones are in effect.
pub async fn subscriptions_in_effect(client: &async_nats::Client) {
    use futures::StreamExt;
    let inbox = client.new_inbox();
    let mut back = client.subscribe(inbox.clone()).await.expect("subscribe");
    client.publish(inbox, "".into()).await.expect("publish");
    tokio::time::timeout(Duration::from_secs(10), back.next())
        .await
        .expect("the client's own message comes back within 10 s")
        .expect("the subscription stays open");
}
