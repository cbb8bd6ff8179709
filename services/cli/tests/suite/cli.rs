//! The `provledger` binary as a user runs it: exit codes, messages, and append/history
//! round trips embedded (real sled files) and against a private nats-server.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use provledger_tests::NatsServer;

use crate::common::{provledger, text};

const CLUSTER: &str = "cluster/0190c0de-0000-7000-8000-000000000001";

#[test]
fn demo_runs_embedded_and_ends_with_a_clean_audit() {
    let dir = tempfile::tempdir().unwrap();
    let out = provledger(&["--data-dir", dir.path().to_str().unwrap(), "demo"], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let s = text(&out);
    assert!(s.contains("positions and invariants ok"), "{s}");
    assert!(s.contains("stale claim"), "{s}");
    assert!(s.contains("already appended"), "{s}");
    // The failure scenarios: a create rolled back, a scale failing in each stage, a
    // delete during a create, each with its plan.
    for expected in [
        "failure scenario 1: create fails in spawn",
        "(create_cluster): rolled_back",
        "scale fails in decommission",
        "(scale_cluster): held",
        "scale fails in terminate_and_create",
        "(scale_cluster): rolled_back",
        "scale fails in configure_new",
        "(create_cluster): cancelled",
        "rollback plan:",
        "cluster deleted",
    ] {
        assert!(s.contains(expected), "missing {expected:?} in {s}");
    }
    // `provledger audit` on the demo's data exits 0.
    let demo_dir = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("demo-"))
        })
        .expect("the demo's data dir");
    let out = provledger(
        &["--json", "--data-dir", demo_dir.to_str().unwrap(), "audit"],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let audit: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(audit["ok"], true, "{audit}");
    assert!(audit["commits"].as_u64().unwrap() > 300, "{audit}");
    assert_eq!(audit["violations"].as_array().map(Vec::len), Some(0));
}

/// What a demo run ended with, scenario by scenario: the commits it wrote, the cluster's
/// status and members, the executors' holdings and its operations' statuses.
fn demo_outcome(dir: &std::path::Path) -> (serde_json::Value, Vec<serde_json::Value>) {
    let out = provledger(&["--json", "--data-dir", dir.to_str().unwrap(), "demo"], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("demo JSON");
    let scenarios = report["scenarios"].as_array().expect("scenarios").clone();
    let outcome = scenarios
        .iter()
        .map(|s| {
            serde_json::json!({
                "commits": s["commits"].as_array().map(|c| c.len()),
                "status": s["afterwards"]["status"],
                "members": s["afterwards"]["members"],
                "executors": s["afterwards"]["executors"],
                "operations": s["operations"].as_array().map(|ops| ops
                    .iter()
                    .map(|o| o["status"].clone())
                    .collect::<Vec<_>>()),
            })
        })
        .collect();
    (report["audit"].clone(), outcome)
}

#[test]
fn demo_is_deterministic_and_removes_what_it_says_it_removes() {
    // Given two fresh data dirs
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // When the demo runs in each
    let (audit_a, run_a) = demo_outcome(a.path());
    let (audit_b, run_b) = demo_outcome(b.path());
    // Then both runs wrote the same commits and ended with the same counts
    assert_eq!(audit_a["commits"], audit_b["commits"]);
    assert_eq!(run_a, run_b);
    assert_eq!(run_a.len(), 6, "six scenarios");
    // And no executor holds anything of a node a scenario removed
    let report: serde_json::Value = serde_json::from_slice(
        &provledger(
            &["--json", "--data-dir", a.path().to_str().unwrap(), "demo"],
            "",
        )
        .stdout,
    )
    .unwrap();
    for s in report["scenarios"].as_array().unwrap() {
        assert_eq!(
            s["afterwards"]["left_of_removed_nodes"],
            serde_json::json!([]),
            "{}: removed nodes left resources behind",
            s["title"]
        );
    }
    // And the delete-during-create leaves nothing at any executor, the scale-in of a held
    // configure leaves only the kept nodes' resources
    let deleted = &report["scenarios"][5]["afterwards"];
    assert_eq!(deleted["status"], "deleted");
    assert_eq!(deleted["executors"], serde_json::json!({}));
    // And drift over the whole demo finds nothing: every resource the executors still
    // hold is one the ledger records, and every one it records is held
    assert_eq!(
        report["drift"]["findings"],
        serde_json::json!([]),
        "a clean demo has no drift"
    );
    assert!(
        report["drift"]["held"].as_u64() > Some(0),
        "{}",
        report["drift"]
    );
}

#[test]
fn demo_verbose_prints_each_commit_once_within_120_columns_with_names() {
    let dir = tempfile::tempdir().unwrap();
    let out = provledger(
        &[
            "--data-dir",
            dir.path().to_str().unwrap(),
            "demo",
            "--verbose",
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let mut positions = Vec::new();
    for line in stdout.lines() {
        assert!(
            line.chars().count() <= 120,
            "wider than 120 columns: {line:?}"
        );
        if let Some(rest) = line.trim_start().strip_prefix('#') {
            let n: u64 = rest.split_whitespace().next().unwrap().parse().unwrap();
            positions.push(n);
        }
    }
    // Every commit of the log appears exactly once, in order.
    let audit = stdout
        .lines()
        .find(|l| l.starts_with("audit:"))
        .expect("audit line");
    let commits: u64 = audit
        .split(", ")
        .find_map(|p| p.strip_suffix(" commits"))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(positions, (1..=commits).collect::<Vec<_>>());
    // Entities are named, not shown by their shared UUID v7 time prefix.
    assert!(stdout.contains("cluster analytics"), "{stdout}");
    // Operations by their kind and short id (the last 12 hex digits), as commands take them.
    assert!(
        stdout.lines().any(|l| l.contains("create_cluster ")
            && l.split_whitespace()
                .any(|w| w.len() == 12 && w.chars().all(|c| c.is_ascii_hexdigit()))),
        "{stdout}"
    );
    // And it says where its data is and how to look at it with the same command.
    assert!(stdout.contains("the demo's data dir"), "{stdout}");
    assert!(stdout.contains("  DIR=/"), "{stdout}");
    assert!(
        stdout.contains(" --data-dir \"$DIR\" history cluster/"),
        "{stdout}"
    );
}

#[test]
fn bad_usage_exits_2_and_says_what_was_expected() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = provledger(&["frobnicate"], "");
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("unrecognized subcommand"));

    let out = provledger(&["--data-dir", d, "history", "vm/1"], "");
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("expected one of cluster, instance, provider, operation"));

    // `append` with events on stdin, refused before anything is written.
    let append = |expect: &str, events: &str| {
        provledger(
            &[
                "--data-dir",
                d,
                "append",
                CLUSTER,
                "--expect",
                expect,
                "--events",
                "-",
            ],
            events,
        )
    };

    let out = append("none", "{not json");
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("not valid JSON"), "{}", text(&out));

    let out = append("none", r#"[{"boot": {}}]"#);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("not in the catalogue"),
        "{}",
        text(&out)
    );

    let out = append("maybe", "[]");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out).contains("\"any\", \"none\" or a version number"),
        "{}",
        text(&out)
    );

    let out = append("none", r#"[{"instance_deleted": {}}]"#);
    assert_eq!(
        out.status.code(),
        Some(2),
        "an instance event on a cluster is bad input"
    );
    assert!(
        text(&out).contains("does not belong to a cluster aggregate"),
        "{}",
        text(&out)
    );
}

fn append_history_round_trip(global: &[&str]) {
    let with = |args: &[&str]| -> Vec<String> {
        global
            .iter()
            .chain(args.iter())
            .map(|s| s.to_string())
            .collect()
    };
    let run = |args: Vec<String>, stdin: &str| {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        provledger(&refs, stdin)
    };
    let events =
        r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#;
    let commit_id = "0190c0de-0000-7000-8000-0000000000aa";
    let append_with_id = with(&[
        "--json",
        "append",
        CLUSTER,
        "--expect",
        "none",
        "--commit-id",
        commit_id,
        "--events",
        "-",
    ]);
    let out = run(append_with_id.clone(), events);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["version"], 1);
    assert_eq!(reply["status"], "appended");
    let position = reply["position"].clone();

    // The very same command again is an idempotent retry, not a conflict.
    let out = run(append_with_id, events);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["status"], "already_appended");
    assert_eq!(reply["position"], position);

    // A stale expectation is a conflict: exit 1, naming the actual version.
    let out = run(
        with(&["append", CLUSTER, "--expect", "none", "--events", "-"]),
        events,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("actual version is 1"), "{}", text(&out));

    let out = run(
        with(&["append", CLUSTER, "--expect", "1", "--events", "-"]),
        r#"[{"cluster_status_changed": {"status": "active", "description": "up"}}]"#,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // The decider refuses what the fold would not apply, and writes nothing: a delete of
    // nothing, a second delete, and a change that would bring a deleting cluster back.
    let out = run(
        with(&[
            "append",
            "cluster/0190c0de-0000-7000-8000-0000000000ff",
            "--expect",
            "any",
            "--events",
            "-",
        ]),
        r#"[{"cluster_delete_requested": {"reason": "user"}}]"#,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("does not exist"), "{}", text(&out));
    let out = run(
        with(&["append", CLUSTER, "--expect", "any", "--events", "-"]),
        r#"[{"cluster_delete_requested": {"reason": "user"}}]"#,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = run(
        with(&[
            "--json", "append", CLUSTER, "--expect", "any", "--events", "-",
        ]),
        r#"[{"cluster_delete_requested": {"reason": "again"}}]"#,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(reply["status"], "already_deleting", "{reply}");
    assert_eq!(reply["version"], 3);
    let out = run(
        with(&["append", CLUSTER, "--expect", "any", "--events", "-"]),
        r#"[{"cluster_status_changed": {"status": "active", "description": "back"}}]"#,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("is deleting"), "{}", text(&out));

    let out = run(with(&["--json", "history", CLUSTER]), "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let history: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let commits = history["commits"].as_array().unwrap();
    assert_eq!(
        commits.len(),
        3,
        "created, active, delete requested: nothing else"
    );
    assert_eq!(commits[0]["commit_id"], commit_id);
    assert_eq!(
        commits[1]["events"][0]["cluster_status_changed"]["status"],
        "active"
    );
    assert_eq!(commits[1]["prev_hash"], commits[0]["hash"]);
    assert_eq!(history["chain_violations"].as_array().unwrap().len(), 0);

    let out = run(
        with(&["history", "instance/0190c0de-0000-7000-8000-000000000009"]),
        "",
    );
    assert_eq!(out.status.code(), Some(1), "not found is exit 1");
    assert!(text(&out).contains("not found"));
}

#[test]
fn append_and_history_embedded() {
    let dir = tempfile::tempdir().unwrap();
    append_history_round_trip(&["--data-dir", dir.path().to_str().unwrap()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_and_history_against_nats() {
    let server = NatsServer::start().await;
    let url = server.url();
    tokio::task::spawn_blocking(move || append_history_round_trip(&["--nats", &url]))
        .await
        .unwrap();
}

#[test]
fn a_locked_data_dir_exits_3_naming_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let holder = provledger_events::SledLog::open(dir.path()).unwrap();
    let out = provledger(
        &[
            "--data-dir",
            dir.path().to_str().unwrap(),
            "history",
            CLUSTER,
        ],
        "",
    );
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        text(&out).contains("is locked by another provledger process"),
        "{}",
        text(&out)
    );
    holder.close();
}

#[test]
fn unreachable_nats_exits_3() {
    let port = provledger_tests::free_port().to_string();
    let url = format!("nats://127.0.0.1:{port}");
    let out = provledger(&["--nats", &url, "history", CLUSTER], "");
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(text(&out).contains("NATS unreachable"));
}

/// Given an embedded ledger with a create that failed in `allocate` and was left without a
/// rollback (its runner had no driver), `rollback plan` shows the dry-run plan, `rollback
/// run` records and drives it (a ledger-internal release, no executor needed), and `rollback
/// plan` then shows the recorded plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollback_plan_then_run_embedded() {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use provledger_client::CancelNotices;
    use provledger_client::Ledger;
    use provledger_client::OperationRunner;
    use provledger_events::catalogue::NodeGroupSpec;
    use provledger_events::SledLog;
    use provledger_sim::SimInfrastructure;
    use provledger_sim::{register_compute_node, ClusterRequest, Provisioner};
    use uuid::Uuid;

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let log = SledLog::open(dir.path()).unwrap();
    let ledger = provledger_client::Writer::new(Ledger::Embedded(log.clone()));
    let provider = Uuid::now_v7();
    register_compute_node(&ledger, provider, "cn", 2, "t")
        .await
        .unwrap();
    let runner = OperationRunner::new(ledger.clone(), CancelNotices::local(), None, "t");
    let prov = Provisioner::new(runner, Arc::new(SimInfrastructure::default()), "t");
    let report = prov
        .create_cluster(ClusterRequest {
            cluster_id: Uuid::now_v7(),
            name: "c".into(),
            plugin: "vanilla".into(),
            node_groups: vec![NodeGroupSpec {
                name: "w".into(),
                count: 2,
                flavor: "m".into(),
                resources: BTreeMap::from([("VCPU".to_string(), 2)]),
                processes: vec![],
            }],
            provider,
        })
        .await;
    assert!(report.result.is_err());
    drop(prov);
    drop(ledger);
    log.close();
    let op = report.operation_id.to_string();

    let out = provledger(&["--data-dir", &d, "rollback", "plan", &op], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let s = text(&out);
    assert!(s.contains("dry run, nothing recorded"), "{s}");
    assert!(s.contains("release_allocation"), "{s}");

    let out = provledger(&["--data-dir", &d, "rollback", "run", &op], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("rolled_back"), "{}", text(&out));

    let out = provledger(&["--data-dir", &d, "--json", "rollback", "plan", &op], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["recorded"], true);
    assert_eq!(json["status"], "rolled_back");

    let out = provledger(
        &["--data-dir", &d, "state", &format!("provider/{provider}")],
        "",
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("\"allocations\": []"), "{}", text(&out));

    let unknown = Uuid::now_v7().to_string();
    let out = provledger(&["--data-dir", &d, "rollback", "plan", &unknown], "");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("not found"), "{}", text(&out));
}

#[test]
fn a_malformed_nats_url_or_unknown_endpoint_is_bad_usage_exit_2() {
    for url in ["nats://a:4222,nats://b:notaport", "::not a url::"] {
        for args in [
            vec!["--nats", url, "history", CLUSTER],
            vec!["--nats", url, "query", "health"],
        ] {
            let out = provledger(&args, "");
            assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
            assert!(text(&out).contains("is not a NATS URL"), "{}", text(&out));
            assert!(!text(&out).contains("start nats-server"), "{}", text(&out));
        }
    }
    let out = provledger(
        &["--nats", "nats://127.0.0.1:1", "query", "cluster.gte", "{}"],
        "",
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("unknown endpoint"), "{}", text(&out));
    assert!(
        text(&out).contains("cluster.get"),
        "lists the endpoints: {}",
        text(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seed_list_of_nats_urls_reaches_the_server_that_answers() {
    let server = NatsServer::start().await;
    let seeds = format!("nats://127.0.0.1:1,{}", server.url());
    let out = tokio::task::spawn_blocking(move || {
        provledger(
            &["--nats", &seeds, "append", CLUSTER, "--expect", "none", "--events", "-"],
            r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#,
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

#[test]
fn history_into_a_pipe_closed_early_ends_quietly() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    // One commit whose JSON history is far larger than a pipe's buffer.
    let long = "x".repeat(10_000);
    let events: Vec<String> = (0..40)
        .map(|_| {
            format!(
                r#"{{"cluster_status_changed": {{"status": "spawning", "description": "{long}"}}}}"#
            )
        })
        .collect();
    let create =
        r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#;
    let out = provledger(
        &[
            "--data-dir",
            data,
            "append",
            CLUSTER,
            "--expect",
            "none",
            "--events",
            "-",
        ],
        create,
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let out = provledger(
        &[
            "--data-dir",
            data,
            "append",
            CLUSTER,
            "--expect",
            "1",
            "--events",
            "-",
        ],
        &format!("[{}]", events.join(",")),
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // When the reader goes away before the output is written (like `| head -1`)...
    let mut child = Command::new(env!("CARGO_BIN_EXE_provledger"))
        .args(["--data-dir", data, "--json", "history", CLUSTER])
        .env_remove("PROVLEDGER_NATS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    // ...then it ends without a panic (exit 101 before), as Unix tools do.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_ne!(out.status.code(), Some(101), "{stderr}");
}

/// Given a create that failed in spawn after making VMs, IPs and DNS entries, in a fresh
/// embedded data dir `d` (closed again): its operation id and the simulated executors
/// that still hold what it made.
async fn a_failed_create(
    d: &std::path::Path,
) -> (String, std::sync::Arc<provledger_sim::SimInfrastructure>) {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use provledger_client::{CancelNotices, Ledger, OperationRunner};
    use provledger_events::catalogue::NodeGroupSpec;
    use provledger_events::SledLog;
    use provledger_sim::SimInfrastructure;
    use provledger_sim::{register_compute_node, ClusterRequest, Provisioner};
    use uuid::Uuid;

    let log = SledLog::open(d).unwrap();
    let ledger = provledger_client::Writer::new(Ledger::Embedded(log.clone()));
    let provider = Uuid::now_v7();
    register_compute_node(&ledger, provider, "cn", 64, "t")
        .await
        .unwrap();
    let infra = Arc::new(SimInfrastructure::default());
    infra.hypervisor.fail_call("create_vm", 2);
    let runner = OperationRunner::new(ledger.clone(), CancelNotices::local(), None, "t");
    let prov = Provisioner::new(runner, infra.clone(), "t");
    let report = prov
        .create_cluster(ClusterRequest {
            cluster_id: Uuid::now_v7(),
            name: "c".into(),
            plugin: "vanilla".into(),
            node_groups: vec![NodeGroupSpec {
                name: "w".into(),
                count: 2,
                flavor: "m".into(),
                resources: BTreeMap::from([("VCPU".to_string(), 2)]),
                processes: vec![],
            }],
            provider,
        })
        .await;
    assert!(report.result.is_err());
    assert!(!infra.inventory().is_empty(), "something to compensate");
    drop(prov);
    drop(ledger);
    log.close();
    let op = report.operation_id.to_string();
    (op, infra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_that_needs_attention_is_resumed_by_rollback_run_with_executors() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let (op, infra) = a_failed_create(dir.path()).await;

    // ...when `rollback run` has no executors, it ends needs_attention (exit 1)...
    let d2 = d.clone();
    let op2 = op.clone();
    let out = tokio::task::spawn_blocking(move || {
        provledger(&["--data-dir", &d2, "rollback", "run", &op2], "")
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("needs_attention"), "{}", text(&out));

    // ...and run again with the executors reachable, it resumes and rolls back.
    let nats = NatsServer::start().await;
    infra
        .clone()
        .serve_on_nats(nats.client().await, "provledger")
        .await
        .unwrap();
    let url = nats.url();
    let d2 = d.clone();
    let op2 = op.clone();
    let out = tokio::task::spawn_blocking(move || {
        provledger(
            &[
                "--data-dir",
                &d2,
                "rollback",
                "run",
                &op2,
                "--executors-url",
                &url,
            ],
            "",
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("rollback resumed"), "{}", text(&out));
    assert!(text(&out).contains("rolled_back"), "{}", text(&out));
    assert!(infra.inventory().is_empty(), "{:?}", infra.inventory());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolving_each_stuck_compensation_by_hand_lets_the_rollback_finish_and_audit_names_who() {
    // Given a failed create whose rollback, with no executor answering, needs attention...
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let (op, _infra) = a_failed_create(dir.path()).await;
    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            provledger(&args, "")
        })
    };
    let args = |rest: &[&str]| -> Vec<String> {
        ["--data-dir", &d]
            .iter()
            .chain(rest)
            .map(|s| s.to_string())
            .collect()
    };
    let out = run(args(&["--json", "rollback", "run", &op]))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let view: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(view["status"], "needs_attention", "{view}");
    let open: Vec<String> = view["compensations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["state"] != "done" && c["executor"] != "ledger")
        .map(|c| c["compensation_id"].as_str().unwrap().to_string())
        .collect();
    assert!(open.len() >= 2, "{view}");
    let ledger_own = view["compensations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["state"] != "done" && c["executor"] == "ledger")
        .map(|c| c["compensation_id"].as_str().unwrap().to_string())
        .expect("a claim to release");

    // ...a resolve without a reason, of a compensation it does not have, or of one the
    // ledger applies itself (an allocation's release), is refused...
    let out = run(args(&[
        "rollback",
        "resolve",
        &op,
        "--compensation",
        &ledger_own,
        "--reason",
        "x",
    ]))
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("the ledger's own"), "{}", text(&out));
    // ...so is the same resolve written as a plain append: the rule is the decider's, on
    // every write path (cmd.append's too), or the rollback would end with the claim held...
    let events = format!(
        r#"[{{"compensation_resolved": {{"compensation_id": "{ledger_own}", "reason": "x"}}}}]"#
    );
    let append = args(&[
        "append",
        &format!("operation/{op}"),
        "--expect",
        "any",
        "--events",
        "-",
    ]);
    let out = tokio::task::spawn_blocking(move || {
        let append: Vec<&str> = append.iter().map(String::as_str).collect();
        provledger(&append, &events)
    })
    .await
    .unwrap();
    assert_ne!(out.status.code(), Some(0), "{}", text(&out));
    assert!(text(&out).contains("the ledger's own"), "{}", text(&out));
    let out = run(args(&[
        "rollback",
        "resolve",
        &op,
        "--compensation",
        &open[0],
        "--reason",
        " ",
    ]))
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stranger = uuid::Uuid::now_v7().to_string();
    let out = run(args(&[
        "rollback",
        "resolve",
        &op,
        "--compensation",
        &stranger,
        "--reason",
        "x",
    ]))
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));

    // ...when an operator resolves every stuck compensation by hand, with a reason...
    // (the first named by its whole ids, the others by the short ids text output shows)
    let short = |id: &str| id.replace('-', "")[20..].to_string();
    for (i, compensation) in open.iter().enumerate() {
        let reason = format!("removed by hand, ticket OPS-{i}");
        let (op_ref, compensation_ref) = match i {
            0 => (op.clone(), compensation.clone()),
            _ => (short(&op), short(compensation)),
        };
        let out = run(args(&[
            "rollback",
            "resolve",
            &op_ref,
            "--compensation",
            &compensation_ref,
            "--reason",
            &reason,
            "--actor",
            "alice",
        ]))
        .await
        .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    }

    // ...then the rollback has finished (the ledger's own compensations applied when it
    // resumed), the operation is rolled back, each resolved compensation carries its
    // reason...
    let out = run(args(&["--json", "state", &format!("operation/{op}")]))
        .await
        .unwrap();
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let view = &state["state"];
    assert_eq!(view["status"], "rolled_back", "{state}");
    let resolved = view["compensations"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["resolved"].as_str().is_some_and(|r| r.contains("OPS-")))
        .count();
    assert_eq!(resolved, open.len(), "{state}");
    // ...and audit is clean and names who resolved what.
    let out = run(args(&["audit"])).await.unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let said = text(&out);
    assert_eq!(
        said.matches("resolved by hand").count(),
        open.len(),
        "{said}"
    );
    assert!(said.contains("by alice"), "{said}");
    assert!(said.contains("ticket OPS-0"), "{said}");
}

#[test]
fn simulate_runs_seeds_checks_the_projector_and_replays_one() {
    let out = provledger(&["--json", "simulate", "--seeds", "60"], "");
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["seeds"], 60);
    assert_eq!(
        report["failures"].as_array().map(Vec::len),
        Some(0),
        "{report}"
    );
    assert!(report["commits"].as_u64().unwrap() > 1000, "{report}");
    assert!(
        report["faults"]["lost_acks"].as_u64().unwrap() > 0,
        "faults were injected"
    );
    // One seed, replayed twice, gives the same run.
    let once = provledger(&["--json", "simulate", "--seed", "5"], "");
    let twice = provledger(&["--json", "simulate", "--seed", "5"], "");
    let commits = |o: &Output| -> serde_json::Value {
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["commits"].clone()
    };
    assert_eq!(commits(&once), commits(&twice));
}

#[test]
fn completions_and_man_pages_are_generated_from_the_command_line_and_open_no_ledger() {
    // Given: a data dir that does not exist.
    let tmp = tempfile::tempdir().unwrap();
    let data_dir = tmp.path().join("data");
    let data_dir = data_dir.to_str().unwrap();

    // When: completions for bash and zsh, the man page, and man pages into a directory.
    let bash = provledger(&["--data-dir", data_dir, "completions", "bash"], "");
    let zsh = provledger(&["--data-dir", data_dir, "completions", "zsh"], "");
    let man = provledger(&["--data-dir", data_dir, "man"], "");
    let pages = tmp.path().join("man1");
    std::fs::create_dir(&pages).unwrap();
    let written = provledger(&["man", "--out-dir", pages.to_str().unwrap()], "");

    // Then: each names the subcommands and their options, and no ledger was opened.
    assert!(bash.status.success(), "{}", text(&bash));
    let bash = String::from_utf8_lossy(&bash.stdout);
    assert!(bash.contains("_provledger()"), "{bash}");
    assert!(bash.contains("heal-allocations") && bash.contains("--data-dir"));
    assert!(zsh.status.success(), "{}", text(&zsh));
    assert!(String::from_utf8_lossy(&zsh.stdout).starts_with("#compdef provledger"));
    assert!(man.status.success(), "{}", text(&man));
    let man = String::from_utf8_lossy(&man.stdout);
    assert!(man.contains(".TH provledger 1"), "{man}");
    assert!(man.contains(r"provledger\-completions(1)") && man.contains(r"\-\-data\-dir"));
    assert!(written.status.success(), "{}", text(&written));
    for page in [
        "provledger.1",
        "provledger-serve.1",
        "provledger-rollback-run.1",
    ] {
        assert!(pages.join(page).is_file(), "{page} written");
    }
    assert!(!Path::new(data_dir).exists(), "no data dir created");
}
