//! `provledger recover` on real sled files: given instances whose workers died (leases in
//! the past), when the sweep runs, then each is recovered by its rule, once.

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::{json, Value};

fn provledger(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_provledger"))
        .args(args)
        .env_remove("PROVLEDGER_NATS_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Err(e) = child.stdin.take().unwrap().write_all(stdin.as_bytes()) {
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    }
    child.wait_with_output().unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

const UPLOADING: &str = "0190c0de-0000-7000-8000-00000000a001";
const DELETING: &str = "0190c0de-0000-7000-8000-00000000a002";
const ALIVE: &str = "0190c0de-0000-7000-8000-00000000a003";

fn instance(dir: &str, id: &str, extra: Vec<Value>) {
    let mut events = vec![
        json!({"instance_create_requested": {"name": "vm", "cluster_id": null, "node_group": null,
            "flavor": "m1", "resources": {"VCPU": 1}, "image": "img"}}),
        json!({"task_finished": {"task_state": "scheduling", "outcome": "succeeded", "reason": ""}}),
        json!({"vm_state_changed": {"vm_state": "active", "reason": ""}}),
    ];
    events.extend(extra);
    let out = provledger(
        &[
            "--data-dir",
            dir,
            "append",
            &format!("instance/{id}"),
            "--expect",
            "none",
            "--events",
            "-",
        ],
        &Value::Array(events).to_string(),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

fn started(task: &str, lease: &str) -> Value {
    json!({"task_started": {"task_state": task, "worker_id": "compute-1", "lease_until": lease}})
}

fn version(dir: &str, id: &str) -> u64 {
    let out = provledger(
        &[
            "--data-dir",
            dir,
            "--json",
            "state",
            &format!("instance/{id}"),
        ],
        "",
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["state"]["version"].as_u64().unwrap()
}

#[test]
fn a_sweep_recovers_each_interrupted_task_once_and_leaves_live_ones() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // Given a snapshot upload and a delete whose worker died long ago, and a task whose
    // lease runs until 2100...
    instance(
        d,
        UPLOADING,
        vec![started("image_uploading", "2020-01-01T00:00:00Z")],
    );
    instance(
        d,
        DELETING,
        vec![
            json!({"instance_delete_requested": {"reason": "user"}}),
            started("deleting", "2020-01-01T00:00:00Z"),
        ],
    );
    instance(
        d,
        ALIVE,
        vec![started("powering_off", "2100-01-01T00:00:00Z")],
    );
    let before: Vec<u64> = [UPLOADING, DELETING, ALIVE]
        .iter()
        .map(|i| version(d, i))
        .collect();

    // ...a dry run lists the two and writes nothing...
    let out = provledger(&["--data-dir", d, "--json", "recover", "--dry-run"], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rules: Vec<&str> = v["recoveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rule"].as_str().unwrap())
        .collect();
    assert_eq!(rules.len(), 2, "{v}");
    assert!(rules.iter().any(|r| r.starts_with("image snapshot")), "{v}");
    assert!(rules.iter().any(|r| r.starts_with("deleting")), "{v}");
    let after: Vec<u64> = [UPLOADING, DELETING, ALIVE]
        .iter()
        .map(|i| version(d, i))
        .collect();
    assert_eq!(before, after, "the dry run wrote");

    // ...the sweep clears the upload, and the delete it cannot re-drive without a worker
    // goes to error rather than being dropped (exit 1, named)...
    let out = provledger(&["--data-dir", d, "recover"], "");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains(DELETING), "{}", text(&out));
    let state = |id: &str| -> Value {
        let out = provledger(
            &[
                "--data-dir",
                d,
                "--json",
                "state",
                &format!("instance/{id}"),
            ],
            "",
        );
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["state"].clone()
    };
    assert_eq!(state(UPLOADING)["task_state"], Value::Null);
    assert_eq!(state(DELETING)["vm_state"], "error");
    assert_eq!(
        state(ALIVE)["task_state"],
        "powering_off",
        "a live lease is untouched"
    );
    assert_eq!(version(d, ALIVE), before[2]);

    // ...and a second sweep writes nothing.
    let written: Vec<u64> = [UPLOADING, DELETING, ALIVE]
        .iter()
        .map(|i| version(d, i))
        .collect();
    let out = provledger(&["--data-dir", d, "--json", "recover"], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["written"], 0, "{v}");
    let again: Vec<u64> = [UPLOADING, DELETING, ALIVE]
        .iter()
        .map(|i| version(d, i))
        .collect();
    assert_eq!(written, again);
}
