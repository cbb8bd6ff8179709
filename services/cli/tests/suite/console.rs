//! The operator's console (`serve --http`) in a real browser: Debian's headless Chromium
//! driven through chromedriver (installed by `scripts/install-chromium.sh`, which
//! `scripts/test.sh` runs), against `provledger serve` as a child process on a private
//! nats-server.
//!
//! - The demo's data: every scenario's operation has its page, with its rollback plan
//!   drawn box by box as the plan records it; the list shows them; a provider shows its
//!   capacity and a verified chain; `/instances` lists every instance.
//! - A rollback whose compensations keep failing appears under "Needs attention" on a
//!   list page that was opened before it failed, without a reload, with its age; its page
//!   shows every compensation's full id and the `rollback resolve` command of each stuck
//!   one; the health page counts it.
//! - A tampered commit on an aggregate's subject shows as a broken chain on its page.
//!
//! With `PROVLEDGER_SCREENSHOTS=DIR`, the demo test saves the screenshots docs/ shows.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder};
use futures::StreamExt;
use provledger_events::catalogue::ClusterStatus;
use provledger_events::{
    AggregateId, AggregateKind, Commit, CommitDraft, Event, EventLog, Expectation, JetStreamLog,
    SledLog, Timestamp,
};
use provledger_tests::{free_port, NatsServer};
use uuid::Uuid;

use crate::common;
use crate::common::{wait_ready, Serve};

/// chromedriver and a headless Chromium session on it, both gone on drop.
struct Browser {
    driver: Child,
    client: Option<Client>,
    /// The browser's profile dir: its own, so that its processes can be told apart.
    profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver starts Chromium in a process group of its own, so killing the
        // driver leaves the browser running: every process of this browser's profile dir
        // goes too (also when a test failed and never closed its session).
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = Command::new("pkill")
            .args(["-KILL", "-f", &self.profile.path().display().to_string()])
            .status();
    }
}

impl Browser {
    async fn start() -> Browser {
        let chromium = std::env::var("CHROMIUM_BIN").unwrap_or_else(|_| "/usr/bin/chromium".into());
        let chromedriver =
            std::env::var("CHROMEDRIVER_BIN").unwrap_or_else(|_| "/usr/bin/chromedriver".into());
        assert!(
            std::path::Path::new(&chromium).exists() && std::path::Path::new(&chromedriver).exists(),
            "{chromium} and {chromedriver} are needed: run scripts/install-chromium.sh (scripts/test.sh does)"
        );
        let port = free_port();
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = tempfile::tempdir().expect("a profile dir");
        let mut browser = Browser {
            driver,
            client: None,
            profile,
        };
        let capabilities = serde_json::json!({
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,1500",
                         format!("--user-data-dir={}", browser.profile.path().display())],
            }
        });
        let capabilities = capabilities.as_object().cloned().unwrap_or_default();
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(capabilities.clone())
                .connect(&format!("http://127.0.0.1:{port}"))
                .await
            {
                Ok(client) => break client,
                Err(e) => {
                    assert!(Instant::now() < deadline, "no browser session: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        browser.client = Some(client);
        browser
    }

    fn c(&self) -> &Client {
        self.client.as_ref().expect("a session")
    }

    /// Reads in the page itself, in one script: a live page replaces its `#live` part as
    /// commits are applied, so an element found first and read later may be gone.
    async fn run(&self, script: &str, css: &str) -> serde_json::Value {
        self.c()
            .execute(script, vec![serde_json::json!(css)])
            .await
            .unwrap_or_else(|e| panic!("{css}: {e}"))
    }

    async fn text_of(&self, css: &str) -> String {
        let v = self
            .run(
                "var e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
                css,
            )
            .await;
        v.as_str()
            .unwrap_or_else(|| panic!("no {css} on the page"))
            .to_string()
    }

    async fn attr(&self, css: &str, name: &str) -> Option<String> {
        let script = format!(
            "var e = document.querySelector(arguments[0]); return e ? e.getAttribute('{name}') : null;"
        );
        self.run(&script, css).await.as_str().map(str::to_string)
    }

    /// The attribute `name` of every element matching `css`, in document order.
    async fn attrs(&self, css: &str, name: &str) -> Vec<String> {
        let script = format!(
            "return Array.from(document.querySelectorAll(arguments[0])).map(function (e) {{ return e.getAttribute('{name}'); }});"
        );
        match self.run(&script, css).await {
            serde_json::Value::Array(v) => v
                .into_iter()
                .filter_map(|x| x.as_str().map(str::to_string))
                .collect(),
            _ => vec![],
        }
    }

    async fn count(&self, css: &str) -> usize {
        self.run(
            "return document.querySelectorAll(arguments[0]).length;",
            css,
        )
        .await
        .as_u64()
        .unwrap_or(0) as usize
    }

    async fn screenshot(&self, name: &str) {
        if let Ok(dir) = std::env::var("PROVLEDGER_SCREENSHOTS") {
            let png = self.c().screenshot().await.expect("screenshot");
            std::fs::create_dir_all(&dir).expect("screenshot dir");
            std::fs::write(std::path::Path::new(&dir).join(name), png).expect("write screenshot");
        }
    }
}

/// serve with the console on a free loopback port: the process and the console's URL.
async fn serve_with_console(
    nats: &NatsServer,
    dir: &std::path::Path,
    extra: &[&str],
) -> (Serve, String) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec!["--http", addr.as_str()];
    args.extend_from_slice(extra);
    let serve = Serve::start_with(nats, dir, &args);
    (serve, format!("http://{addr}"))
}

/// The demo, run embedded, then its every commit appended to the stream in log order with
/// the same ids, actors, times and events (the hash does not cover the position, so every
/// chain is the demo's own).
async fn publish_demo(log: &JetStreamLog) -> (provledger_sim::demo::DemoReport, Vec<Commit>) {
    let base = tempfile::tempdir().expect("tempdir");
    let report = provledger_sim::demo::run(base.path())
        .await
        .expect("the demo runs");
    let sled = SledLog::open(&report.data_dir).expect("the demo's log");
    let mut commits = Vec::new();
    let mut all = sled.read_all(1).await.expect("read the demo's log");
    while let Some(c) = all.next().await {
        commits.push(c.expect("a demo commit"));
    }
    sled.close();
    for c in &commits {
        let expect = match c.version {
            1 => Expectation::NoStream,
            v => Expectation::Exactly(v - 1),
        };
        let draft = CommitDraft {
            trace: None,
            commit_id: c.commit_id,
            operation_id: c.operation_id,
            causation_id: c.causation_id,
            actor: c.actor.clone(),
            recorded_at: c.recorded_at,
            events: c.events.clone(),
        };
        log.append(c.aggregate, expect, draft)
            .await
            .expect("append a demo commit");
    }
    // The stream holds the demo's very chains: each aggregate ends at the demo's hash.
    let mut tips = BTreeMap::new();
    for c in &commits {
        tips.insert(c.aggregate, c.hash);
    }
    for (aggregate, hash) in tips {
        let chain = log.read_aggregate(aggregate).await.expect("read back");
        assert_eq!(chain.last().map(|c| c.hash), Some(hash), "{aggregate}");
    }
    (report, commits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_each_scenarios_operation_with_its_plan() {
    // Given the demo's commits on the stream, and serve with its console caught up...
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (client, log) = (nats.client().await, common::stream(&nats).await);
    let (report, commits) = publish_demo(&log).await;
    let (_serve, url) = serve_with_console(&nats, &dir.path().join("serve"), &[]).await;
    wait_ready(&client).await;
    let browser = Browser::start().await;

    // When the operations list is opened, then every scenario's operations are on it...
    browser
        .c()
        .goto(&format!("{url}/operations?limit=200"))
        .await
        .expect("the list");
    let listed = browser.text_of("#live").await;
    let mut failing = None;
    for scenario in &report.scenarios {
        for op in &scenario.operations {
            let short = op.id.to_string();
            assert!(
                browser
                    .count(&format!("a[href='/operations/{short}']"))
                    .await
                    >= 1,
                "{} ({}) is listed: {listed}",
                op.id,
                scenario.title
            );
        }
    }
    browser.screenshot("console-operations.png").await;

    // ...newest first, a page at a time: following "older operations" from pages of 3
    // walks every operation once, each page older than the one before.
    let operations: std::collections::BTreeSet<Uuid> = commits
        .iter()
        .filter(|c| c.aggregate.kind == AggregateKind::Operation)
        .map(|c| c.aggregate.id)
        .collect();
    let mut walked: Vec<Uuid> = Vec::new();
    let mut next = Some(format!("{url}/operations?limit=3"));
    while let Some(page) = next.take() {
        browser.c().goto(&page).await.expect("a page of the list");
        let ids: Vec<Uuid> = browser
            .attrs("table.all tr td:first-child a", "href")
            .await
            .iter()
            .filter_map(|h| h.strip_prefix("/operations/")?.parse().ok())
            .collect();
        assert!(ids.len() <= 3, "{page}: {ids:?}");
        walked.extend(ids);
        next = browser
            .attrs("#live p a[href^='/operations?']", "href")
            .await
            .first()
            .map(|h| format!("{url}{h}"));
    }
    let mut newest_first: Vec<Uuid> = operations.iter().copied().collect();
    newest_first.reverse();
    assert_eq!(walked, newest_first, "every operation once, newest first");

    // ...and each operation's page shows its status and, when it has one, its rollback
    // plan drawn with one box per planned compensation, in plan order.
    for scenario in &report.scenarios {
        for op in &scenario.operations {
            browser
                .c()
                .goto(&format!("{url}/operations/{}", op.id))
                .await
                .expect("an operation's page");
            let status = browser.text_of("#live .box .badge").await;
            assert_eq!(status, op.status, "{} in {}", op.id, scenario.title);
            match &op.rollback_plan {
                None => assert_eq!(browser.count("#plan").await, 0, "{}: no plan", op.id),
                Some(plan) => {
                    let drawn = browser
                        .attrs("#plan-diagram g.compensation", "data-id")
                        .await;
                    let planned: Vec<String> = plan
                        .compensations
                        .iter()
                        .map(|c| c.compensation_id.to_string())
                        .collect();
                    assert_eq!(
                        drawn, planned,
                        "{}: one box per compensation, in plan order ({})",
                        op.id, scenario.title
                    );
                    if !plan.compensations.is_empty() && failing.is_none() {
                        failing = Some(op.id);
                    }
                    // The rule the plan was made by is there, word for word.
                    assert!(
                        browser.text_of("#plan").await.contains(&plan.rule),
                        "{}",
                        op.id
                    );
                }
            }
            // An operation's own timeline: its chain, verified.
            assert_eq!(
                browser.attr("#chain", "data-chain").await.as_deref(),
                Some("verified"),
                "{}",
                op.id
            );
        }
    }
    let failing = failing.expect("the demo has a rollback that undid something");
    browser
        .c()
        .goto(&format!("{url}/operations/{failing}"))
        .await
        .expect("page");
    browser.screenshot("console-operation-plan.png").await;

    // A provider: its capacity per resource class against usage, and its verified chain.
    let provider = commits
        .iter()
        .map(|c| c.aggregate)
        .find(|a| a.kind == AggregateKind::Provider)
        .expect("the demo registers compute nodes");
    browser
        .c()
        .goto(&format!("{url}/providers/{}", provider.id))
        .await
        .expect("a provider's page");
    assert!(browser.count("table.capacity tbody tr").await >= 1);
    assert!(browser
        .text_of("#chain")
        .await
        .contains("hash chain verified"));
    browser.screenshot("console-provider.png").await;

    // The instances have their list, reached from the header, each linking its page.
    browser
        .c()
        .goto(&format!("{url}/health"))
        .await
        .expect("health");
    let instances = browser
        .attr("header nav a[href='/instances']", "href")
        .await;
    assert_eq!(instances.as_deref(), Some("/instances"));
    browser
        .c()
        .goto(&format!("{url}/instances?limit=200"))
        .await
        .expect("the instances");
    let listed: std::collections::BTreeSet<String> = browser
        .attrs("table.entities a[href^='/instances/']", "href")
        .await
        .into_iter()
        .collect();
    let demo_instances: std::collections::BTreeSet<String> = commits
        .iter()
        .filter(|c| c.aggregate.kind == AggregateKind::Instance)
        .map(|c| format!("/instances/{}", c.aggregate.id))
        .collect();
    assert!(!demo_instances.is_empty(), "the demo makes instances");
    assert_eq!(listed, demo_instances, "every instance, once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_that_needs_attention_appears_on_an_open_page_without_a_reload() {
    // Given serve (two attempts per compensation) and executors that fail every one...
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_serve, url) = serve_with_console(
        &nats,
        &dir.path().join("serve"),
        &[
            "--compensation-attempts-max",
            "2",
            "--compensation-backoff-ms",
            "20",
            "--compensation-reply-wait-ms",
            "3000",
        ],
    )
    .await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    for executor in [&infra.ipam, &infra.dhcp, &infra.dns, &infra.hypervisor] {
        executor.fail_compensations(1_000);
    }
    wait_ready(&client).await;
    // ...and the operations list open in a browser, marked so that a reload would show...
    let browser = Browser::start().await;
    browser
        .c()
        .goto(&format!("{url}/operations"))
        .await
        .expect("the list");
    assert!(browser
        .text_of("#needs-attention")
        .await
        .starts_with("Needs attention (0"));
    browser
        .c()
        .execute("window.__opened_once = 1; return 1;", vec![])
        .await
        .expect("mark the page");

    // When a create fails after making VMs and serve's rollback gives up...
    let op = common::fail_a_create(&client, &ledger, &infra, provider).await;

    // Then the open page lists it under "Needs attention", by itself...
    let row = format!("#needs-attention + table a[href='/operations/{op}']");
    let deadline = Instant::now() + Duration::from_secs(60);
    while browser.count(&row).await == 0 {
        assert!(
            Instant::now() < deadline,
            "never listed as needing attention: {}",
            browser.text_of("#live").await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // ...on the same page, never reloaded.
    let same = browser
        .c()
        .execute("return window.__opened_once === 1;", vec![])
        .await
        .expect("ask the page");
    assert_eq!(same, serde_json::json!(true), "the page was reloaded");
    // The list shows its age, in the column named so.
    let age = browser
        .run(
            "var a = document.querySelector(arguments[0]); if (!a) { return null; } \
             var heads = Array.from(a.closest('table').querySelectorAll('thead th')).map(function (h) { return h.innerText; }); \
             return a.closest('tr').querySelectorAll('td')[heads.indexOf('age')].innerText;",
            &format!("table.all a[href='/operations/{op}']"),
        )
        .await;
    let age = age.as_str().unwrap_or_default().to_string();
    assert!(
        age.ends_with('s')
            && age
                .trim_end_matches('s')
                .chars()
                .all(|c| c.is_ascii_digit() || c == 'm'),
        "an age such as 3s or 1m2s, not {age:?}"
    );
    // Its page names what is stuck and how to move it on.
    browser
        .c()
        .goto(&format!("{url}/operations/{op}"))
        .await
        .expect("page");
    let stuck = browser
        .attrs("#plan-diagram g[data-standing='stuck']", "data-id")
        .await;
    assert!(!stuck.is_empty());
    assert!(browser
        .text_of("#resume")
        .await
        .contains(&format!("rollback run {op}")));
    // The plan's table shows every compensation's full id, and each stuck one (all at
    // executors here) has its exact `rollback resolve` command, with the CLI's flags.
    let drawn = browser
        .attrs("#plan-diagram g.compensation", "data-id")
        .await;
    let listed = browser
        .run(
            "return Array.from(document.querySelectorAll(arguments[0])).map(function (e) { return e.innerText; });",
            "#plan table.plan code.compensation-id",
        )
        .await;
    let listed: Vec<String> = serde_json::from_value(listed).expect("ids");
    assert_eq!(listed, drawn, "every compensation's full id, in plan order");
    assert_eq!(
        browser
            .attrs("#resolve code.resolve", "data-compensation")
            .await,
        stuck
    );
    for id in &stuck {
        assert!(
            browser
                .text_of(&format!("#resolve code[data-compensation='{id}']"))
                .await
                .contains(&format!(
                    "provledger --nats $NATS_URL rollback resolve {op} --compensation {id} --reason '"
                )),
            "{id}"
        );
    }
    // The health page counts it among the operations that need attention.
    browser
        .c()
        .goto(&format!("{url}/health"))
        .await
        .expect("health");
    assert_eq!(
        browser
            .attr("#needs-attention-count", "data-count")
            .await
            .as_deref(),
        Some("1")
    );
}

fn status(n: u32) -> CommitDraft {
    CommitDraft::now(
        "test",
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Active,
            description: format!("status {n}"),
        }],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tampered_commit_shows_as_a_broken_chain() {
    // Given a cluster whose subject holds, after its first commit, a commit altered after
    // it was sealed, then a valid second commit; and another cluster left alone...
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (client, log) = (nats.client().await, common::stream(&nats).await);
    let tampered = AggregateId::new(AggregateKind::Cluster, Uuid::now_v7());
    let clean = AggregateId::new(AggregateKind::Cluster, Uuid::now_v7());
    log.append(clean, Expectation::NoStream, status(0))
        .await
        .unwrap();
    log.append(tampered, Expectation::NoStream, status(0))
        .await
        .unwrap();
    let first = log.read_aggregate(tampered).await.unwrap()[0].hash;
    let mut forged = Commit::seal(tampered, 2, first, status(1));
    forged.actor = "mallory".into();
    forged.recorded_at = Timestamp::now();
    let js = async_nats::jetstream::new(client.clone());
    js.publish(
        log.config().subject_for(&tampered),
        provledger_events::codec::encode(&forged).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    log.append(tampered, Expectation::Exactly(1), status(2))
        .await
        .unwrap();
    let (_serve, url) = serve_with_console(&nats, &dir.path().join("serve"), &[]).await;
    wait_ready(&client).await;
    let browser = Browser::start().await;

    // When the tampered cluster's page is opened, then its chain is broken, and the
    // altered message is in its history, marked...
    browser
        .c()
        .goto(&format!("{url}/clusters/{}", tampered.id))
        .await
        .expect("page");
    assert_eq!(
        browser.attr("#chain", "data-chain").await.as_deref(),
        Some("broken")
    );
    assert!(browser
        .text_of("#chain")
        .await
        .contains("hash chain broken"));
    assert_eq!(browser.count("table.history tr.broken").await, 1);
    assert!(browser
        .text_of("table.history tr.broken")
        .await
        .contains("quarantined"));
    // ...and the one left alone is verified.
    browser
        .c()
        .goto(&format!("{url}/clusters/{}", clean.id))
        .await
        .expect("page");
    assert!(browser
        .text_of("#chain")
        .await
        .contains("hash chain verified: 1 commits"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_reachable_from_other_hosts_is_announced_as_unauthenticated() {
    // Given serve with its console on every address, and one on loopback...
    let nats = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let open_dir = dir.path().join("open");
    let port = free_port();
    let _open = Serve::start_with(&nats, &open_dir, &["--http", &format!("0.0.0.0:{port}")]);
    let local_dir = dir.path().join("local");
    let (_local, _) = serve_with_console(&nats, &local_dir, &[]).await;
    wait_ready(&nats.client().await).await;
    // ...then the first says, at start, that anyone who reaches it reads everything; the
    // second does not.
    let log_of =
        |d: &std::path::Path| std::fs::read_to_string(d.with_extension("log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(log_of(&open_dir).contains("console on") && log_of(&local_dir).contains("console on")) {
        assert!(
            Instant::now() < deadline,
            "no console started: {}",
            log_of(&open_dir)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        log_of(&open_dir).contains("has no authentication"),
        "{}",
        log_of(&open_dir)
    );
    assert!(!log_of(&local_dir).contains("has no authentication"));
}
