//! Authenticating to a real nats-server: the user and password given in the `--nats` URL
//! (an error never shows the password), an nkey seed file (`--nkey`), and mutual TLS
//! (`--tls-ca`, `--tls-cert`, `--tls-key`) with the CA made by deploy/tls/make-test-ca.sh.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{provledger, text};

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
        .stderr(std::fs::File::create(dir.path().join("server.log")).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nats-server did not listen: {}",
            std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default()
        );
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
    assert!(text(&out).contains("refused this client"), "{}", text(&out));
    // Without the CA, the server's certificate is not trusted (exit 3).
    let out = append_with(&server.url(), &["--tls-cert", cert, "--tls-key", key], d);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    // A certificate without its key is bad usage (exit 2), before any connection.
    let out = append_with(&server.url(), &["--tls-ca", ca, "--tls-cert", cert], d);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("needs --tls-key"), "{}", text(&out));
}

/// A NATS JWT (v2: header `ed25519-nkey`, signature over `header.claims`) about `subject`,
/// issued by `issuer`, with `nats` as its type-specific claims.
fn jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine;
    let header = URL_SAFE_NO_PAD.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": uuid::Uuid::now_v7().simple().to_string().to_uppercase(),
        "iat": 1_700_000_000,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let claims = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signed = format!("{header}.{claims}");
    let signature = URL_SAFE_NO_PAD.encode(issuer.sign(signed.as_bytes()).unwrap());
    format!("{signed}.{signature}")
}

#[test]
fn a_creds_file_authenticates_against_an_operator_mode_server() {
    // Given an operator, an account with JetStream and a user of it, as `nsc` would make...
    // (and the system account JetStream needs in operator mode).
    let operator = nkeys::KeyPair::new_operator();
    let system = nkeys::KeyPair::new_account();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "op",
        serde_json::json!({"type": "operator", "version": 2,
            "system_account": system.public_key()}),
    );
    let system_jwt = jwt(
        &operator,
        &system.public_key(),
        "SYS",
        serde_json::json!({"type": "account", "version": 2}),
    );
    let account_jwt = jwt(
        &operator,
        &account.public_key(),
        "provledger",
        serde_json::json!({"type": "account", "version": 2, "limits": {
            "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
            "wildcards": true, "conn": -1, "leaf": -1,
            "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}}),
    );
    let user_jwt = jwt(
        &account,
        &user.public_key(),
        "writer",
        serde_json::json!({"type": "user", "version": 2, "pub": {}, "sub": {},
            "subs": -1, "data": -1, "payload": -1}),
    );
    let config = format!(
        "operator: {operator_jwt}\nsystem_account: {}\nresolver: MEMORY\n\
         resolver_preload: {{\n  {}: {system_jwt}\n  {}: {account_jwt}\n}}\n",
        system.public_key(),
        system.public_key(),
        account.public_key()
    );
    let server = start_with(&[], Some(&config));
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("writer.creds");
    std::fs::write(
        &creds,
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed().unwrap()
        ),
    )
    .unwrap();
    let url = format!("nats://127.0.0.1:{}", server.port);
    let d = dir.path().join("data");
    let d = d.to_str().unwrap();

    // When the CLI appends with --creds, it lands; without, the server refuses (exit 3).
    let out = append_with(&url, &["--creds", creds.to_str().unwrap()], d);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = append_with(&url, &[], d);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    // A file that is not a creds file is bad input (exit 2), naming the option.
    let out = append_with(&url, &["--creds", "/nonexistent/writer.creds"], d);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("--creds /nonexistent/writer.creds"),
        "{}",
        text(&out)
    );
}
