//! Who may write what, with `deploy/nats/accounts.conf` on a real nats-server: a client
//! that is not a designated writer cannot put anything in the log, by raw publish, by the
//! JetStream API or through cmd.append; and cmd.append records the identity the server
//! vouches for, not the actor the request claims.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use std::time::Duration;

use provledger_tests::NatsServer;
use serde_json::{json, Value};

use crate::common::{provledger, text, wait_ready, Serve};

const CLUSTER: &str = "cluster/0190c0de-0000-7000-8000-00000000e001";
const CLUSTER_ID: &str = "0190c0de-0000-7000-8000-00000000e001";

/// A client connected as `user` that keeps every error the server sends it.
async fn client_keeping_errors(
    nats: &NatsServer,
    user: &str,
) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&errors);
    let client = nats
        .options_as(user)
        .event_callback(move |event| {
            let kept = Arc::clone(&kept);
            async move {
                if let async_nats::Event::ServerError(e) = event {
                    kept.lock().unwrap().push(e.to_string());
                }
            }
        })
        .connect(nats.url())
        .await
        .unwrap();
    (client, errors)
}

async fn stream_last_sequence(nats: &NatsServer) -> u64 {
    let js = async_nats::jetstream::new(nats.client_as("auditor").await);
    let mut stream = js.get_stream("PROVLEDGER").await.unwrap();
    stream.info().await.unwrap().state.last_sequence
}

/// Waits (bounded) until the server has told `errors` about a violation on `subject`.
async fn violation_on(errors: &Arc<Mutex<Vec<String>>>, subject: &str) -> String {
    // Up to 20 s: the server's error comes back asynchronously, later on a loaded machine.
    for _ in 0..1000 {
        if let Some(e) = errors.lock().unwrap().iter().find(|e| e.contains(subject)) {
            return e.clone();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "no violation on {subject}; errors: {:?}",
        errors.lock().unwrap()
    );
}

fn blocking<F: FnOnce() -> std::process::Output + Send + 'static>(
    f: F,
) -> tokio::task::JoinHandle<std::process::Output> {
    tokio::task::spawn_blocking(f)
}

/// `worker` answers the first re-issue on `reissues` with `{"ok": true}`, and that
/// answer reaches serve's request within 5 s.
async fn reissue_answered(
    worker: async_nats::Client,
    mut reissues: async_nats::Subscriber,
    from_serve: &async_nats::Client,
    what: &str,
) {
    // `flush` only writes the SUB out; whether the server has processed it when serve's
    // request (on another connection, another account) arrives is a race, lost under
    // load as "no responders". A round trip on the worker's own connection after its SUB
    // is the barrier: the server handles one connection's messages in order.
    worker
        .request("provledger.q.health", "{}".into())
        .await
        .expect("the worker's round trip through serve");
    let answering = tokio::spawn(async move {
        let request = reissues.next().await.unwrap();
        worker
            .publish(request.reply.unwrap(), r#"{"ok": true}"#.into())
            .await
            .unwrap();
        worker.flush().await.unwrap();
    });
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        from_serve.request("provledger.worker.w1.reissue", "{}".into()),
    )
    .await
    .expect(what)
    .unwrap_or_else(|e| panic!("{what}: the request failed: {e} ({:?})", e.kind()));
    assert_eq!(&answer.payload[..], br#"{"ok": true}"#);
    answering.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_designated_writers_reach_the_log_and_cmd_append_records_who_asked() {
    let nats = NatsServer::start_hardened(true, false).await;
    let dir = tempfile::tempdir().unwrap();
    let data = |name: &str| dir.path().join(name).to_str().unwrap().to_string();

    // Given a cluster appended by the designated writer...
    let (url, d) = (nats.url_as("writer"), data("writer"));
    let out = blocking(move || {
        provledger(
            &["--nats", &url, "--data-dir", &d, "append", CLUSTER, "--expect", "none", "--events", "-"],
            r#"[{"cluster_create_requested": {"name": "c1", "plugin": "vanilla", "node_groups": []}}]"#,
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(stream_last_sequence(&nats).await, 1);
    // ...and serve running as `serve`.
    let _serve = Serve::start_at(&nats.url_as("serve"), &dir.path().join("serve"), &[]);
    wait_ready(&nats.client_as("serve").await).await;

    // When a service user publishes raw bytes on the aggregate's subject, and an auditor
    // does the same and tries to purge the stream...
    let subject = format!("provledger.ev.cluster.{CLUSTER_ID}");
    let (rogue, rogue_errors) = client_keeping_errors(&nats, "provisioner").await;
    rogue
        .publish(subject.clone(), "garbage".into())
        .await
        .unwrap();
    rogue.flush().await.unwrap();
    let (auditor, auditor_errors) = client_keeping_errors(&nats, "auditor").await;
    auditor
        .publish(subject.clone(), "garbage".into())
        .await
        .unwrap();
    let purge = "$JS.API.STREAM.PURGE.PROVLEDGER";
    auditor.publish(purge, "".into()).await.unwrap();
    auditor.flush().await.unwrap();
    // ...then the server refuses each by name...
    let denial = violation_on(&rogue_errors, &subject).await;
    assert!(
        denial
            .to_lowercase()
            .contains("permissions violation for publish"),
        "{denial}"
    );
    println!("a rogue publisher sees: {denial}");
    violation_on(&auditor_errors, &subject).await;
    violation_on(&auditor_errors, purge).await;

    // When a reader (queries only) asks cmd.append, it is refused before serve sees it.
    let (reader, reader_errors) = client_keeping_errors(&nats, "reader").await;
    let request = json!({"aggregate": CLUSTER, "expect": "any", "actor": "admin",
        "events": [{"cluster_status_changed": {"status": "active", "description": "rogue"}}]});
    let answer = tokio::time::timeout(
        Duration::from_secs(3),
        reader.request("provledger.cmd.append", request.to_string().into()),
    )
    .await;
    assert!(
        !matches!(answer, Ok(Ok(_))),
        "a reader got an answer from cmd.append"
    );
    violation_on(&reader_errors, "provledger.cmd.append").await;

    // When the auditor runs `provledger append`, it fails as denied, not as unavailable.
    let (url, d) = (nats.url_as("auditor"), data("auditor"));
    let out = blocking(move || {
        provledger(
            &[
                "--nats",
                &url,
                "--data-dir",
                &d,
                "append",
                CLUSTER,
                "--expect",
                "any",
                "--events",
                "-",
            ],
            r#"[{"cluster_status_changed": {"status": "active", "description": "auditor"}}]"#,
        )
    })
    .await
    .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("NATS denied this user"),
        "{}",
        text(&out)
    );

    // When a library writer connected as the auditor records two facts atomically (one
    // JetStream batch), it is refused as denied too, not as unavailable.
    {
        use provledger_client::write::{Fact, FromTheLog, RecordError};
        let (_client, log) = provledger_client::open_jetstream(
            &nats.url_as("auditor"),
            "auditor-library",
            "PROVLEDGER",
            "provledger",
            1,
            &provledger_client::NatsAuth::default(),
        )
        .await
        .expect("the auditor opens the stream");
        let cluster: provledger_events::AggregateId = CLUSTER.parse().unwrap();
        let other = provledger_events::AggregateId::cluster(uuid::Uuid::now_v7());
        let draft = |d: &str| {
            provledger_client::Stamper::system().draft(
                "auditor",
                vec![provledger_events::Event::ClusterStatusChanged {
                    status: provledger_events::catalogue::ClusterStatus::Active,
                    description: d.into(),
                }],
            )
        };
        let facts = vec![
            Fact {
                aggregate: cluster,
                expect: provledger_events::Expectation::Any,
                draft: draft("auditor, atomically"),
            },
            Fact {
                aggregate: other,
                expect: provledger_events::Expectation::NoStream,
                draft: provledger_client::Stamper::system().draft(
                    "auditor",
                    vec![provledger_events::Event::ClusterCreateRequested {
                        name: "x".into(),
                        plugin: "vanilla".into(),
                        node_groups: vec![],
                    }],
                ),
            },
        ];
        let refused = provledger_client::Writer::new(log)
            .record_atomic(
                facts,
                provledger_projections::decide::DecideOptions::default(),
                &FromTheLog,
            )
            .await;
        assert!(
            matches!(refused, Err(RecordError::PermissionDenied { .. })),
            "{refused:?}"
        );
    }

    // Then the log holds only the writer's commit: nothing was appended or quarantined.
    assert_eq!(stream_last_sequence(&nats).await, 1);
    let (url, d) = (nats.url_as("auditor"), data("audit"));
    let out = blocking(move || provledger(&["--nats", &url, "--data-dir", &d, "audit"], ""))
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));

    // When the provisioning service appends through cmd.append claiming to be "admin"...
    let service = nats.client_as("provisioner").await;
    let request = json!({"aggregate": CLUSTER, "expect": 1, "actor": "admin",
        "events": [{"cluster_status_changed": {"status": "active", "description": "built"}}]});
    let reply = service
        .request("provledger.cmd.append", request.to_string().into())
        .await
        .unwrap();
    let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
    // ...then the commit records the user the server authenticated.
    assert_eq!(reply["data"]["actor"], "provisioner@SERVICES", "{reply}");
    assert_eq!(reply["data"]["version"], 2, "{reply}");
    let (url, d) = (nats.url_as("auditor"), data("history"));
    let out =
        blocking(move || provledger(&["--nats", &url, "--data-dir", &d, "history", CLUSTER], ""))
            .await
            .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("by provisioner@SERVICES"),
        "{}",
        text(&out)
    );
    assert!(!text(&out).contains("by admin"), "{}", text(&out));

    // A writer cannot create a stream of its own (one that captured or republished
    // provledger subjects would bypass everything above).
    let (writer, writer_errors) = client_keeping_errors(&nats, "writer").await;
    let shadow = "$JS.API.STREAM.CREATE.SHADOW";
    writer
        .publish(
            shadow,
            r#"{"name":"SHADOW","subjects":["provledger.cmd.>"]}"#.into(),
        )
        .await
        .unwrap();
    writer.flush().await.unwrap();
    violation_on(&writer_errors, shadow).await;

    // A worker (SERVICES) records through cmd.append under its own name, and hears the
    // re-issues serve sends to it across the accounts.
    let worker = nats.client_as("worker-w1").await;
    let request = json!({"aggregate": CLUSTER, "expect": "any",
        "events": [{"cluster_status_changed": {"status": "active", "description": "by worker"}}]});
    let reply = worker
        .request("provledger.cmd.append", request.to_string().into())
        .await
        .unwrap();
    let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(reply["data"]["actor"], "worker-w1@SERVICES", "{reply}");
    // It may say it listens again, so that its pending re-issues come at once.
    let ready = worker
        .request(
            "provledger.cmd.worker.ready",
            json!({"worker": "w1"}).to_string().into(),
        )
        .await
        .unwrap();
    let ready: Value = serde_json::from_slice(&ready.payload).unwrap();
    assert_eq!(ready["data"]["worker"], "w1", "{ready}");
    // It may not say so for another worker: that would skip w2's backoff on every call.
    let other = worker
        .request(
            "provledger.cmd.worker.ready",
            json!({"worker": "w2"}).to_string().into(),
        )
        .await
        .unwrap();
    let other: Value = serde_json::from_slice(&other.payload).unwrap();
    assert_eq!(other["error"]["code"], "rejected", "{other}");
    assert_eq!(other["error"]["reason"], "another_worker", "{other}");
    let reissues = worker
        .subscribe("provledger.worker.w1.reissue")
        .await
        .unwrap();
    let from_serve = nats.client_as("serve").await;
    reissue_answered(worker, reissues, &from_serve, "the worker answers in time").await;

    // A worker connection with two subscriptions matching its re-issue subject (its own
    // and a wildcard one, as a worker library may add) receives each request twice; its
    // answer still reaches serve (the permission allows a reply per delivery).
    let worker = nats.client_as("worker-w1").await;
    let exact = worker
        .subscribe("provledger.worker.w1.reissue")
        .await
        .unwrap();
    let _wildcard = worker.subscribe("provledger.worker.w1.>").await.unwrap();
    reissue_answered(
        worker,
        exact,
        &from_serve,
        "the worker with two subscriptions answers in time",
    )
    .await;

    // An executor hears only its own requests: another executor's subject is refused.
    let (executor, executor_errors) = client_keeping_errors(&nats, "executor-compute").await;
    let _own = executor
        .subscribe("provledger.exec.compute.>")
        .await
        .unwrap();
    let _other = executor
        .subscribe("provledger.exec.storage.>")
        .await
        .unwrap();
    executor.flush().await.unwrap();
    violation_on(&executor_errors, "provledger.exec.storage.>").await;
    assert!(
        !executor_errors
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.contains("provledger.exec.compute.>")),
        "its own subject was refused"
    );

    // A reader (SERVICES, through the imports) and the auditor follow the ledger: the
    // catch-up gives what is there, the live feed what comes next; an executor and a worker
    // may not follow.
    for user in ["reader", "auditor"] {
        let mut follower = provledger_client::follow::Follower::start(
            nats.client_as(user).await,
            "provledger",
            Default::default(),
            0,
        )
        .await
        .unwrap();
        let mut changes = 0;
        while let provledger_client::follow::Followed::Change(_) =
            tokio::time::timeout(Duration::from_secs(20), follower.next())
                .await
                .expect("the follower answers")
                .unwrap()
        {
            changes += 1;
        }
        assert!(changes >= 1, "{user} caught up on nothing");
        let (url, d) = (nats.url_as("writer"), data(&format!("writer-{user}")));
        let out = blocking(move || {
            provledger(
                &["--nats", &url, "--data-dir", &d, "append", CLUSTER, "--expect", "any", "--events", "-"],
                r#"[{"cluster_status_changed": {"status": "spawning", "description": "followed"}}]"#,
            )
        })
        .await
        .unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", text(&out));
        loop {
            let next = tokio::time::timeout(Duration::from_secs(20), follower.next())
                .await
                .expect("the live change arrives")
                .unwrap();
            if let provledger_client::follow::Followed::Change(c) = next {
                assert!(c.timeline[0].contains("followed"), "{c:?}");
                break;
            }
        }
        assert_eq!(follower.stats().live, 1, "{user}: {:?}", follower.stats());
    }
    for user in ["executor-compute", "worker-w1"] {
        let (follower, errors) = client_keeping_errors(&nats, user).await;
        let _feed = follower.subscribe("provledger.feed.>").await.unwrap();
        follower.flush().await.unwrap();
        violation_on(&errors, "provledger.feed.>").await;
    }

    // Everything the trusted users did was allowed: the lists in accounts.conf are
    // complete for serve and the writer (a missing JetStream subject shows up here).
    let log = nats.log();
    for user in ["serve", "writer"] {
        let refused: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("user:{user}\"")) && l.contains("Violation"))
            .filter(|l| !l.contains("SHADOW"))
            .collect();
        assert!(refused.is_empty(), "{user} was refused: {refused:#?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_beyond_a_thousand_consumers_worth_never_answer_unavailable_under_the_accounts() {
    // Given the deployed accounts, serve as `serve`, and an auditor that tries to take the
    // consumers writers once needed (it may not: reading needs none),
    let nats = NatsServer::start_hardened(true, false).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start_at(&nats.url_as("serve"), &dir.path().join("serve"), &[]);
    wait_ready(&nats.client_as("serve").await).await;
    let (auditor, errors) = client_keeping_errors(&nats, "auditor").await;
    let js = async_nats::jetstream::new(auditor);
    let create = tokio::time::timeout(
        Duration::from_secs(3),
        js.create_consumer_on_stream(
            async_nats::jetstream::consumer::pull::Config {
                durable_name: Some("hog-0".into()),
                ..Default::default()
            },
            "PROVLEDGER",
        ),
    )
    .await;
    assert!(
        !matches!(create, Ok(Ok(_))),
        "the auditor created a consumer"
    );
    violation_on(&errors, "$JS.API.CONSUMER.CREATE").await;

    // when a provisioning service registers 1,200 providers and claims on each, 20 at a time
    // (the reads of 2,400 decided writes: once 2,400 consumers),
    let service = nats.client_as("provisioner").await;
    let providers: Vec<uuid::Uuid> = (0..1_200).map(|_| uuid::Uuid::now_v7()).collect();
    let mut failures = Vec::new();
    for (phase, expect) in [("register", "none"), ("claim", "any")] {
        for chunk in providers.chunks(20) {
            let writes = chunk.iter().map(|p| {
                let events = match phase {
                    "register" => json!([
                        {"provider_registered": {"name": p.to_string(), "host": "h"}},
                        {"inventory_set": {"resource_class": "VCPU", "inventory": {
                            "total": 8, "reserved": 0, "allocation_ratio": 1.0,
                            "min_unit": 1, "max_unit": 8, "step_size": 1}}}
                    ]),
                    _ => json!([{"allocation_claimed": {"consumer": uuid::Uuid::now_v7(),
                        "consumer_kind": "instance", "resources": {"VCPU": 2}}}]),
                };
                let body = json!({"aggregate": format!("provider/{p}"), "expect": expect, "events": events});
                let service = service.clone();
                async move {
                    let reply = service
                        .request("provledger.cmd.append", body.to_string().into())
                        .await
                        .expect("a reply");
                    serde_json::from_slice::<Value>(&reply.payload).expect("JSON")
                }
            });
            for reply in futures::future::join_all(writes).await {
                if reply.get("error").is_some() {
                    failures.push(reply);
                }
            }
        }
    }
    // then every write lands, and the stream holds no consumer but serve's live tail.
    assert!(
        failures.is_empty(),
        "{} failed, e.g. {:?}",
        failures.len(),
        failures.first()
    );
    let js = async_nats::jetstream::new(nats.client_as("serve").await);
    let mut stream = js.get_stream("PROVLEDGER").await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(info.state.messages, 2_400);
    assert!(
        info.state.consumer_count <= provledger_events::log::jetstream_log::SUBSCRIPTIONS_MAX,
        "{} consumers",
        info.state.consumer_count
    );
}

/// One cmd.append request as `client`; the reply's JSON.
async fn cmd_append(client: &async_nats::Client, request: Value) -> Value {
    let reply = tokio::time::timeout(
        Duration::from_secs(20),
        client.request("provledger.cmd.append", request.to_string().into()),
    )
    .await
    .expect("reply in time")
    .unwrap();
    serde_json::from_slice(&reply.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_records_its_own_tasks_only_and_within_the_lease_bounds() {
    let nats = NatsServer::start_hardened(true, false).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start_at(&nats.url_as("serve"), &dir.path().join("serve"), &[]);
    wait_ready(&nats.client_as("serve").await).await;
    let provisioner = nats.client_as("provisioner").await;
    let worker = nats.client_as("worker-w1").await;
    let vm = "instance/0190c0de-0000-7000-8000-00000000e101";
    let created = cmd_append(
        &provisioner,
        json!({"aggregate": vm, "expect": "none", "events": [
            {"instance_create_requested": {"name": "vm", "cluster_id": null, "node_group": null,
                "flavor": "m1", "resources": {"VCPU": 1}, "image": "img"}},
            {"task_finished": {"task_state": "scheduling", "outcome": "succeeded", "reason": ""}},
            {"vm_state_changed": {"vm_state": "active", "reason": ""}}]}),
    )
    .await;
    assert!(created["error"].is_null(), "{created}");
    let in_secs = |secs: i64| {
        provledger_events::Timestamp::from_unix_ms(
            provledger_events::Timestamp::now().unix_ms() + secs * 1000,
        )
        .to_string()
    };
    let started = |worker_id: &str, until: &str| {
        json!({"aggregate": vm, "expect": "any", "events": [{"task_started": {
            "task_state": "powering_off", "worker_id": worker_id, "lease_until": until}}]})
    };
    let refused = |reply: &Value, reason: &str| {
        assert_eq!(reply["error"]["code"], "rejected", "{reply}");
        assert_eq!(reply["error"]["reason"], reason, "{reply}");
    };

    // Given worker-w1 (worker w1) on SERVICES: it cannot start a task in w2's name, nor
    // with a lease ending in the year 9999...
    refused(
        &cmd_append(&worker, started("w2", &in_secs(60))).await,
        "worker_mismatch",
    );
    refused(
        &cmd_append(&worker, started("w1", "9999-12-31T23:59:59Z")).await,
        "lease_too_long",
    );
    // ...it starts one in its own name with a minute's lease...
    let reply = cmd_append(&worker, started("w1", &in_secs(60))).await;
    assert!(reply["error"].is_null(), "{reply}");
    // ...cannot renew it at once (at most once per half lease)...
    let renew = json!({"aggregate": vm, "expect": "any", "events": [{"task_lease_renewed": {
        "worker_id": "w1", "lease_until": in_secs(90)}}]});
    refused(&cmd_append(&worker, renew).await, "renewal_too_soon");
    // ...and another user cannot finish it, whatever actor it claims.
    let finish = json!({"aggregate": vm, "expect": "any", "actor": "w1", "events": [
        {"task_finished": {"task_state": "powering_off", "outcome": "succeeded", "reason": ""}}]});
    refused(
        &cmd_append(&provisioner, finish.clone()).await,
        "not_lease_holder",
    );
    let reply = cmd_append(&worker, finish).await;
    assert!(reply["error"].is_null(), "{reply}");
}
