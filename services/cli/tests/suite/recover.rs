//! `provledger recover` on real sled files: given instances whose workers died (their
//! leases ran out), when the sweep runs, then each is recovered by its rule, once.

use futures::StreamExt;
use provledger_tests::NatsServer;
use serde_json::{json, Value};

use crate::common;
use crate::common::{provledger, text};

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
    // Given a snapshot upload and a delete whose worker died after starting them with a
    // short lease, and a task whose lease runs 10 minutes (a lease is recorded for at least
    // 1 s and at most 15 minutes: the decider refuses one already over or in 2100)...
    instance(
        d,
        UPLOADING,
        vec![started("image_uploading", &time_in(SHORT_LEASE_S))],
    );
    instance(
        d,
        DELETING,
        vec![
            json!({"instance_delete_requested": {"reason": "user"}}),
            started("deleting", &time_in(SHORT_LEASE_S)),
        ],
    );
    instance(d, ALIVE, vec![started("powering_off", &time_in(600))]);
    // ...once the short leases ran out...
    std::thread::sleep(SHORT_LEASE_RUN_OUT);
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
    // stays pending for serve to deliver rather than being dropped (exit 1, named)...
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
    let pending = state(DELETING)["pending_reissues"].clone();
    assert_eq!(pending.as_array().map(Vec::len), Some(1), "{pending}");
    assert_eq!(pending[0]["action"], "delete");
    assert_eq!(pending[0]["worker"], "compute-1");
    assert_eq!(
        pending[0]["attempts"], 0,
        "nothing to deliver to without --nats"
    );
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
    assert_eq!(out.status.code(), Some(1), "still pending: {}", text(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["written"], 0, "{v}");
    assert_eq!(v["pending_reissues"][0]["instance"], DELETING, "{v}");
    let again: Vec<u64> = [UPLOADING, DELETING, ALIVE]
        .iter()
        .map(|i| version(d, i))
        .collect();
    assert_eq!(written, again);
}

async fn cmd(client: &async_nats::Client, body: Value) -> Value {
    let reply = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        client.request("provledger.cmd.append", body.to_string().into()),
    )
    .await
    .expect("reply in time")
    .expect("request");
    serde_json::from_slice(&reply.payload).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_recover_a_dead_workers_instances_once_and_reissue_to_its_successor() {
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let client = nats.client().await;
    // The successor of the dead worker answers re-issues, counting every request.
    let seen = answering_worker(&client, "compute-1").await;
    let first = common::Serve::start_sweeping(&nats, &dir.path().join("a"));
    common::wait_ready(&client).await;

    // Given a worker that started powering off two instances with a short lease (at
    // least the decider's 1 s minimum once serve records it), and died (it never renews
    // nor finishes)...
    let lease = time_in(SHORT_LEASE_S);
    let ids = [
        "0190c0de-0000-7000-8000-00000000f001",
        "0190c0de-0000-7000-8000-00000000f002",
    ];
    for id in ids {
        let reply = cmd(
            &client,
            json!({"aggregate": format!("instance/{id}"), "expect": "none", "events": [
                {"instance_create_requested": {"name": "vm", "cluster_id": null, "node_group": null,
                    "flavor": "m1", "resources": {"VCPU": 1}, "image": "img"}},
                {"task_finished": {"task_state": "scheduling", "outcome": "succeeded", "reason": ""}},
                {"vm_state_changed": {"vm_state": "active", "reason": ""}},
                {"task_started": {"task_state": "powering_off", "worker_id": "compute-1", "lease_until": lease}}
            ]}),
        )
        .await;
        assert!(reply["error"].is_null(), "{reply}");
    }
    // ...when two replicas sweep every second...
    let second = common::Serve::start_sweeping(&nats, &dir.path().join("b"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while seen.lock().unwrap().len() < ids.len() {
        assert!(std::time::Instant::now() < deadline, "never re-issued");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Several more sweeps of both replicas run...
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;

    // ...then each instance was recovered once, and its power off re-issued once.
    let log = common::stream(&nats).await;
    for id in ids {
        assert_eq!(common::recoveries_of(&log, id).await, 1, "{id}");
    }
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), ids.len(), "{seen:?}");
    for request in &seen {
        assert_eq!(request["action"], "power_off", "{request}");
    }
    drop((first, second));
}

/// A lease that runs out soon: its end is computed before the process that records it
/// starts, and the decider refuses a lease under 1 s, so it keeps 3 s of slack for a slow
/// process start on a loaded machine (2 s was refused as 975 ms once).
const SHORT_LEASE_S: i64 = 4;
/// Long enough after a short lease was computed for it to have run out.
const SHORT_LEASE_RUN_OUT: std::time::Duration =
    std::time::Duration::from_millis(SHORT_LEASE_S as u64 * 1000 + 500);

/// An RFC 3339 time `secs` from now.
fn time_in(secs: i64) -> String {
    let ms = provledger_events::Timestamp::now().unix_ms() + secs * 1000;
    provledger_events::Timestamp::from_unix_ms(ms).to_string()
}

#[test]
fn an_interrupted_resize_is_reverted_and_its_allocations_follow_it_back_to_the_source() {
    interrupted_resize_goes_back_to_the_source(true);
}

#[test]
fn an_interrupted_resize_with_the_host_still_on_the_source_releases_the_destination() {
    interrupted_resize_goes_back_to_the_source(false);
}

/// Nova's revert: whether the host had moved to the destination or not, the VM ends on
/// the source holding the source allocation, the destination free, the migration failed,
/// and (once its rollback ran) the VM still active: only the migration is in error.
fn interrupted_resize_goes_back_to_the_source(host_moved: bool) {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    const SOURCE: &str = "0190c0de-0000-7000-8000-00000000e001";
    const DEST: &str = "0190c0de-0000-7000-8000-00000000e002";
    const VM: &str = "0190c0de-0000-7000-8000-00000000e003";
    const MIGRATION: &str = "0190c0de-0000-7000-8000-00000000e004";
    let append = |aggregate: String, expect: &str, events: Value| {
        let out = provledger(
            &[
                "--data-dir",
                d,
                "append",
                &aggregate,
                "--expect",
                expect,
                "--events",
                "-",
            ],
            &events.to_string(),
        );
        assert_eq!(out.status.code(), Some(0), "{aggregate}: {}", text(&out));
    };
    for (id, host) in [(SOURCE, "cn-src"), (DEST, "cn-dst")] {
        append(
            format!("provider/{id}"),
            "none",
            json!([{"provider_registered": {"name": host, "host": host}},
                   {"inventory_set": {"resource_class": "VCPU", "inventory": {"total": 4, "reserved": 0,
                     "allocation_ratio": 1.0, "min_unit": 1, "max_unit": 4, "step_size": 1}}}]),
        );
    }
    // Given a resize of VM from SOURCE to DEST, interrupted: the migration (its operation)
    // holds the source, the VM holds the destination, and the worker's short lease expired.
    append(
        format!("operation/{MIGRATION}"),
        "none",
        json!([{"operation_started": {"kind": "resize_instance", "target": format!("instance/{VM}"),
            "parent_id": null, "stages": [{"name": "schedule", "policy": "compensate"},
            {"name": "act", "policy": "hold"}], "bundle_policy": null}},
            {"stage_started": {"stage": "act"}}]),
    );
    instance(
        d,
        VM,
        vec![
            match host_moved {
                true => json!({"host_assigned": {"host": "cn-dst", "provider_id": DEST}}),
                false => json!({"host_assigned": {"host": "cn-src", "provider_id": SOURCE}}),
            },
            started("resize_migrating", &time_in(SHORT_LEASE_S)),
        ],
    );
    append(
        format!("provider/{SOURCE}"),
        "any",
        json!([{"allocation_claimed": {"consumer": MIGRATION, "consumer_kind": "migration", "resources": {"VCPU": 4}}}]),
    );
    append(
        format!("provider/{DEST}"),
        "any",
        json!([{"allocation_claimed": {"consumer": VM, "consumer_kind": "instance", "resources": {"VCPU": 4}}}]),
    );

    std::thread::sleep(SHORT_LEASE_RUN_OUT);

    // When the sweep runs (no worker is reachable embedded: the revert's re-issue fails)...
    let out = provledger(&["--data-dir", d, "recover"], "");
    assert!(
        text(&out).contains("resize migrating: revert to the source"),
        "{}",
        text(&out)
    );

    // ...then the allocations followed: the VM holds the source, the destination is free,
    // the VM's host is the source again, and the migration went to error.
    let state = |aggregate: String| -> Value {
        let out = provledger(&["--data-dir", d, "--json", "state", &aggregate], "");
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["state"].clone()
    };
    let source = state(format!("provider/{SOURCE}"));
    assert_eq!(
        source["allocations"].as_array().unwrap().len(),
        1,
        "{source}"
    );
    assert_eq!(source["allocations"][0]["consumer"], VM);
    assert_eq!(source["allocations"][0]["consumer_kind"], "instance");
    assert_eq!(state(format!("provider/{DEST}"))["allocations"], json!([]));
    let vm = state(format!("instance/{VM}"));
    assert_eq!(vm["host"], "cn-src", "{vm}");
    assert_eq!(vm["task_state"], Value::Null);
    assert_eq!(state(format!("operation/{MIGRATION}"))["status"], "failed");

    // And when the migration's rollback runs, the VM stays active on the source.
    let out = provledger(&["--data-dir", d, "rollback", "run", MIGRATION], "");
    assert!(out.status.code().is_some_and(|c| c <= 1), "{}", text(&out));
    let vm = state(format!("instance/{VM}"));
    assert_eq!(vm["vm_state"], "active", "{vm}");
    assert_eq!(vm["host"], "cn-src", "{vm}");
    assert_eq!(state(format!("provider/{DEST}"))["allocations"], json!([]));
}

/// A worker that answers every re-issue addressed to it with `{"ok": true}`, keeping the
/// requests it received (duplicates included).
async fn answering_worker(
    client: &async_nats::Client,
    worker: &str,
) -> std::sync::Arc<std::sync::Mutex<Vec<Value>>> {
    let mut requests = client
        .subscribe(format!("provledger.worker.{worker}.reissue"))
        .await
        .unwrap();
    provledger_tests::subscriptions_in_effect(client).await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Value>::new()));
    let (client, kept) = (client.clone(), seen.clone());
    tokio::spawn(async move {
        while let Some(msg) = requests.next().await {
            let request: Value = serde_json::from_slice(&msg.payload).unwrap_or(Value::Null);
            kept.lock().unwrap().push(request);
            if let Some(reply) = msg.reply {
                let _ = client.publish(reply, r#"{"ok": true}"#.into()).await;
            }
        }
    });
    seen
}

/// An instance powering off under `worker`, whose short lease runs out soon.
async fn powering_off_under(client: &async_nats::Client, id: &str, worker: &str) {
    let reply = cmd(
        client,
        json!({"aggregate": format!("instance/{id}"), "expect": "none", "events": [
            {"instance_create_requested": {"name": "vm", "cluster_id": null, "node_group": null,
                "flavor": "m1", "resources": {"VCPU": 1}, "image": "img"}},
            {"task_finished": {"task_state": "scheduling", "outcome": "succeeded", "reason": ""}},
            {"vm_state_changed": {"vm_state": "active", "reason": ""}},
            {"task_started": {"task_state": "powering_off", "worker_id": worker, "lease_until": time_in(SHORT_LEASE_S)}}
        ]}),
    )
    .await;
    assert!(reply["error"].is_null(), "{reply}");
}

async fn instance_view(client: &async_nats::Client, id: &str) -> Value {
    let reply = client
        .request(
            "provledger.q.instance.get",
            json!({"id": id}).to_string().into(),
        )
        .await
        .unwrap();
    serde_json::from_slice::<Value>(&reply.payload).unwrap()["data"].clone()
}

async fn wait_for(what: &str, secs: u64, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not within {secs} s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// When instance `id`'s 4th re-issue attempt failed and when its 5th was sent, as serve
/// recorded them (each commit's `recorded_at`).
async fn absent_attempt_times(
    nats: &NatsServer,
    id: &str,
) -> (provledger_events::Timestamp, provledger_events::Timestamp) {
    use provledger_events::Event;
    let aggregate = format!("instance/{id}");
    let log = common::stream(nats).await;
    let commits = common::stream_commits(&log).await;
    let mine = commits
        .iter()
        .filter(|c| c.aggregate.to_string() == aggregate);
    let (mut failed, mut sent) = (None, None);
    for commit in mine {
        for event in &commit.events {
            match event {
                Event::ReissueFailed { attempt: 4, .. } => failed = Some(commit.recorded_at),
                Event::ReissueAttempted { attempt: 5, .. } => sent = Some(commit.recorded_at),
                _ => {}
            }
        }
    }
    (
        failed.expect("attempt 4 recorded failed"),
        sent.expect("attempt 5 recorded sent"),
    )
}

/// Given three workers whose tasks were interrupted: `absent` not subscribed yet,
/// `hung` subscribed but never answering, `present` answering; when serve recovers
/// them, then `present` receives its re-issue without waiting behind `hung`, `absent`
/// receives its own once it subscribes and says it is ready (the earlier attempts are
/// recorded as failed, and it is still pending meanwhile), and each worker that answered
/// received its re-issue once, acknowledged in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reissue_is_delivered_once_its_worker_listens_and_a_hung_worker_delays_no_other() {
    const ABSENT: &str = "0190c0de-0000-7000-8000-00000000d001";
    const HUNG: &str = "0190c0de-0000-7000-8000-00000000d002";
    const PRESENT: &str = "0190c0de-0000-7000-8000-00000000d003";
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let client = nats.client().await;
    // A worker that subscribes and never answers: each request to it waits the reply wait.
    // (Workers are served in name order: `hung` comes before `present`.)
    let _hung = client
        .subscribe("provledger.worker.hung.reissue")
        .await
        .unwrap();
    let present = answering_worker(&client, "present").await;
    let _serve = common::Serve::start_with(
        &nats,
        &dir.path().join("serve"),
        &[
            "--recovery-interval",
            "1",
            "--compensation-reply-wait-ms",
            "20000",
        ],
    );
    common::wait_ready(&client).await;
    powering_off_under(&client, ABSENT, "absent").await;
    powering_off_under(&client, HUNG, "hung").await;
    powering_off_under(&client, PRESENT, "present").await;

    // `present` is served while `hung` holds its own request for the 20 s reply wait.
    let asked = std::time::Instant::now();
    wait_for("the present worker's re-issue", 20, || {
        !present.lock().unwrap().is_empty()
    })
    .await;
    assert!(asked.elapsed() < std::time::Duration::from_secs(10));

    // `absent` has no subscriber: its attempts fail with backoff (1, 2, 4 s) and it stays
    // pending; after the fourth failure the next attempt waits 8 s.
    let mut absent_view = Value::Null;
    for _ in 0..300 {
        absent_view = instance_view(&client, ABSENT).await;
        if absent_view["pending_reissues"][0]["attempts"].as_u64() >= Some(4)
            && absent_view["pending_reissues"][0]["last_error"].is_string()
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        absent_view["pending_reissues"][0]["attempts"], 4,
        "{absent_view}"
    );
    // When it subscribes and says so, it receives it at once, not after the 8 s backoff.
    let absent = answering_worker(&client, "absent").await;
    let ready = client
        .request(
            "provledger.cmd.worker.ready",
            json!({"worker": "absent"}).to_string().into(),
        )
        .await
        .unwrap();
    let ready: Value = serde_json::from_slice(&ready.payload).unwrap();
    assert_eq!(ready["data"]["delivering"], true, "{ready}");
    // (a generous deadline: "at once" is judged below on serve's own recorded times, not
    // on how long a loaded machine takes to get the request here)
    wait_for(
        "the absent worker's re-issue after it subscribed",
        30,
        || !absent.lock().unwrap().is_empty(),
    )
    .await;
    let (failed_4th, sent_5th) = absent_attempt_times(&nats, ABSENT).await;
    assert!(
        sent_5th.unix_ms() < failed_4th.unix_ms() + 8_000,
        "attempt 5 sent at {sent_5th}, not before the 8 s backoff after attempt 4 failed at {failed_4th}"
    );

    // Each answered once, and the log says delivered: nothing pending for them.
    for (id, seen) in [(ABSENT, &absent), (PRESENT, &present)] {
        let mut view = Value::Null;
        for _ in 0..100 {
            view = instance_view(&client, id).await;
            if view["pending_reissues"]
                .as_array()
                .is_some_and(Vec::is_empty)
            {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(view["pending_reissues"], json!([]), "{id}: {view}");
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 1, "{id}: {seen:?}");
        assert_eq!(seen[0]["action"], "power_off");
        assert_eq!(seen[0]["instance_id"], id);
    }
    // The hung worker's re-issue is still pending, its attempt 1 in flight.
    let hung = instance_view(&client, HUNG).await;
    assert_eq!(hung["pending_reissues"][0]["attempts"], 1, "{hung}");
}

/// Given 300 builds whose worker died (leases run out), each holding a claim on one
/// provider; when serve, sweeping every second, is killed with SIGKILL as soon as its
/// sweep has started recording, and started again on the same data dir; then every build
/// is recovered exactly once (one `task_finished` recovered, in error), every claim is
/// released exactly once, nothing is orphaned, and `audit` is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_killed_during_a_recovery_sweep_recovers_everything_once_after_restart() {
    const BUILDS: usize = 300;
    const PROVIDER: &str = "0190c0de-0000-7000-8000-00000000e500";
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("serve");
    let client = nats.client().await;
    // The builds are written through a replica that does not sweep, so that no recovery
    // starts before all of them are there.
    let mut setup = common::Serve::start_with(&nats, &data, &["--recovery-interval", "0"]);
    common::wait_ready(&client).await;
    let reply = cmd(
        &client,
        json!({"aggregate": format!("provider/{PROVIDER}"), "expect": "none", "events": [
            {"provider_registered": {"name": "cn-5", "host": "cn-5"}},
            {"inventory_set": {"resource_class": "VCPU", "inventory": {"total": 1000, "reserved": 0,
                "allocation_ratio": 1.0, "min_unit": 1, "max_unit": 1000, "step_size": 1}}}
        ]}),
    )
    .await;
    assert!(reply["error"].is_null(), "{reply}");
    let ids: Vec<String> = (0..BUILDS)
        .map(|i| format!("0190c0de-0000-7000-8000-0000000e{i:04x}"))
        .collect();
    for id in &ids {
        let request = json!({"commits": [
            {"aggregate": format!("provider/{PROVIDER}"), "expect": "any", "events": [
                {"allocation_claimed": {"consumer": id, "consumer_kind": "instance", "resources": {"VCPU": 1}}}]},
            {"aggregate": format!("instance/{id}"), "expect": "none", "events": [
                {"instance_create_requested": {"name": "vm", "cluster_id": null, "node_group": null,
                    "flavor": "m1", "resources": {"VCPU": 1}, "image": "img"}},
                {"host_assigned": {"host": "cn-5", "provider_id": PROVIDER}},
                {"task_started": {"task_state": "spawning", "worker_id": "compute-1", "lease_until": time_in(SHORT_LEASE_S)}}]}
        ]});
        let reply = cmd(&client, request).await;
        assert!(reply["error"].is_null(), "{reply}");
    }
    setup.terminate();
    tokio::time::sleep(SHORT_LEASE_RUN_OUT).await; // every lease ran out
    let log = common::stream(&nats).await;
    let provider = provledger_events::AggregateId::provider(PROVIDER.parse().unwrap());
    // Kill serve (SIGKILL) as soon as its sweep has released the first claim in the log.
    let mut serve = common::Serve::start_sweeping(&nats, &data);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while common::releases_by_consumer(&log, provider)
        .await
        .is_empty()
    {
        assert!(std::time::Instant::now() < deadline, "no recovery started");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    serve.kill();
    let _ = serve.wait_for_exit(std::time::Duration::from_secs(10));
    let released_at_kill = common::releases_by_consumer(&log, provider).await.len();
    eprintln!("{released_at_kill} of {BUILDS} builds recovered when serve was killed");

    // Restarted on the same data dir, it finishes what the killed one left.
    let _serve = common::Serve::start_sweeping(&nats, &data);
    common::wait_ready(&client).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if common::releases_by_consumer(&log, provider).await.len() == BUILDS {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not every build recovered"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // A few more sweeps run: none may do anything twice.
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let released = common::releases_by_consumer(&log, provider).await;
    assert_eq!(released.len(), BUILDS);
    assert!(released.values().all(|n| *n == 1), "a claim released twice");
    for id in &ids {
        assert_eq!(common::recoveries_of(&log, id).await, 1, "{id}");
    }
    let audit_dir = dir.path().join("audit");
    let (url, d) = (nats.url(), audit_dir.to_str().unwrap().to_string());
    let out = tokio::task::spawn_blocking(move || {
        provledger(&["--nats", &url, "--data-dir", &d, "--json", "audit"], "")
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
}

/// Given serve whose own sweep ran at start only (the next is an hour away), and a worker
/// that died powering an instance off; when `provledger recover` records the recovery and
/// its delivery fails (the successor is not listening yet), and the successor subscribes a
/// moment later without saying so; then serve delivers the re-issue within the backoff
/// (1 s after the failure, at most 30 s), not at its next sweep: it wakes on a re-issue
/// anyone recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reissue_recover_left_undelivered_is_delivered_by_serve_within_the_backoff() {
    const ID: &str = "0190c0de-0000-7000-8000-00000000e001";
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let client = nats.client().await;
    let _serve = common::Serve::start_with(
        &nats,
        &dir.path().join("serve"),
        &["--recovery-interval", "3600"],
    );
    common::wait_ready(&client).await;
    powering_off_under(&client, ID, "successor").await;
    tokio::time::sleep(SHORT_LEASE_RUN_OUT).await;

    // recover records the recovery and tries once: nobody listens yet.
    let (url, data) = (nats.url(), dir.path().join("cli"));
    let out = tokio::task::spawn_blocking(move || {
        provledger(
            &[
                "--nats",
                url.as_str(),
                "--data-dir",
                data.to_str().unwrap(),
                "recover",
            ],
            "",
        )
    })
    .await
    .unwrap();
    // Nobody listens yet: its attempt failed, or serve (woken by the recovery recover
    // wrote) took it first (then recover counts it taken, or not yet due while serve's is
    // in flight); either way nothing was delivered.
    let said = text(&out);
    assert!(said.contains("re-issues: "), "{said}");
    assert!(said.contains(" 0 delivered,"), "{said}");

    // The successor subscribes (and says nothing): serve sends it the re-issue.
    let subscribed = std::time::Instant::now();
    let seen = answering_worker(&client, "successor").await;
    wait_for("the re-issue from serve", 30, || {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    assert!(
        subscribed.elapsed() < std::time::Duration::from_secs(30),
        "{:?}",
        subscribed.elapsed()
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0]["action"], "power_off", "{seen:?}");
    assert_eq!(seen[0]["instance_id"], ID, "{seen:?}");
}
