//! A nats-server that requires a user and password: the user and password given in the
//! `--nats` URL are used, and an error never shows the password.

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
    let binary = provledger_tests::nats_server_binary().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = provledger_tests::free_port();
    let child = Command::new(binary)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string()])
        .args(["--user", "alice", "--pass", "s3cret-pw"])
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
