//! Authenticating to a real nats-server: the user and password given in the `--nats` URL
//! (an error never shows the password), an nkey seed file (`--nkey`), and mutual TLS
//! (`--tls-ca`, `--tls-cert`, `--tls-key`) with the CA made by deploy/tls/make-test-ca.sh.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{provledger, text};

struct AuthServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for AuthServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> AuthServer {
    start_with(&["--user", "alice", "--pass", "s3cret-pw"], None)
}

/// A server with extra arguments, and a configuration file when `config` is given.
fn start_with(args: &[&str], config: Option<&str>) -> AuthServer {
    let binary = provledger_tests::nats_server_binary().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = provledger_tests::free_port();
    let mut command = Command::new(binary);
    if let Some(config) = config {
        let path = dir.path().join("nats.conf");
        std::fs::write(&path, config).unwrap();
        command.arg("-c").arg(path);
    }
    let child = command
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .arg("-sd")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "nats-server did not listen");
        std::thread::sleep(Duration::from_millis(50));
    }
    AuthServer {
        child,
        port,
        _dir: dir,
    }
}

#[test]
fn the_user_and_password_in_the_url_are_used_and_never_shown() {
    let server = start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let good = format!("nats://alice:s3cret-pw@127.0.0.1:{}", server.port);
    let out = provledger(
        &[
            "--nats",
            &good,
            "--data-dir",
            d,
            "append",
            "cluster/0190c0de-0000-7000-8000-0000000a0001",
            "--expect",
            "none",
            "--events",
            "-",
        ],
        r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = provledger(
        &[
            "--nats",
            &good,
            "--data-dir",
            d,
            "history",
            "cluster/0190c0de-0000-7000-8000-0000000a0001",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // A wrong password is refused (exit 3), and neither password appears in the message.
    let bad = format!("nats://alice:wrong-pw@127.0.0.1:{}", server.port);
    let out = provledger(
        &[
            "--nats",
            &bad,
            "--data-dir",
            d,
            "history",
            "cluster/0190c0de-0000-7000-8000-0000000a0001",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("authorization"), "{}", text(&out));
    assert!(!text(&out).contains("wrong-pw"), "{}", text(&out));
    assert!(!text(&out).contains("s3cret-pw"), "{}", text(&out));
}

const APPEND_EVENTS: &str =
    r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#;

/// `provledger <auth...> --nats URL append` of a new cluster.
fn append_with(url: &str, auth: &[&str], data_dir: &str) -> std::process::Output {
    let aggregate = format!("cluster/{}", uuid::Uuid::now_v7());
    let mut args: Vec<&str> = vec!["--nats", url, "--data-dir", data_dir];
    args.extend_from_slice(auth);
    args.extend_from_slice(&["append", &aggregate, "--expect", "none", "--events", "-"]);
    provledger(&args, APPEND_EVENTS)
}

#[test]
fn an_nkey_seed_file_authenticates_and_a_wrong_or_missing_one_is_told_apart() {
    let user = nkeys::KeyPair::new_user();
    let config = format!(
        "authorization {{ users = [ {{ nkey: {} }} ] }}\n",
        user.public_key()
    );
    let server = start_with(&[], Some(&config));
    let dir = tempfile::tempdir().unwrap();
    let seed = dir.path().join("user.nk");
    std::fs::write(&seed, format!("{}\n", user.seed().unwrap())).unwrap();
    let other = dir.path().join("other.nk");
    std::fs::write(&other, nkeys::KeyPair::new_user().seed().unwrap()).unwrap();
    let url = format!("nats://127.0.0.1:{}", server.port);
    let d = dir.path().join("data");
    let d = d.to_str().unwrap();

    // Given the right seed, the append lands.
    let out = append_with(&url, &["--nkey", seed.to_str().unwrap()], d);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // Without one, or with another user's seed, the server refuses (exit 3)...
    let out = append_with(&url, &[], d);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let out = append_with(&url, &["--nkey", other.to_str().unwrap()], d);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    // ...and a file that is not there, or holds no seed, is bad input (exit 2), naming it.
    let out = append_with(&url, &["--nkey", "/nonexistent/user.nk"], d);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--nkey /nonexistent/user.nk"),
        "{}",
        text(&out)
    );
    let not_a_seed = dir.path().join("pub.nk");
    std::fs::write(&not_a_seed, user.public_key()).unwrap();
    let out = append_with(&url, &["--nkey", not_a_seed.to_str().unwrap()], d);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("no user nkey seed"), "{}", text(&out));
}

#[test]
fn mutual_tls_with_the_deploy_test_ca() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.block_on(provledger_tests::NatsServer::start_hardened(false, true));
    let tls = server.tls().expect("a TLS server").clone();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().join("data");
    let d = d.to_str().unwrap();
    let (ca, cert, key) = (
        tls.ca.to_str().unwrap(),
        tls.cert.to_str().unwrap(),
        tls.key.to_str().unwrap(),
    );

    // Given the CA and a client certificate, the append lands over TLS.
    let full = ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key];
    let out = append_with(&server.url(), &full, d);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // Without a client certificate the server refuses the connection (exit 3).
    let out = append_with(&server.url(), &["--tls-ca", ca], d);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    // Without the CA, the server's certificate is not trusted (exit 3).
    let out = append_with(&server.url(), &["--tls-cert", cert, "--tls-key", key], d);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    // A certificate without its key is bad usage (exit 2), before any connection.
    let out = append_with(&server.url(), &["--tls-ca", ca, "--tls-cert", cert], d);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("needs --tls-key"), "{}", text(&out));
}
