//! `audit-bench`: `provledger audit`'s pass over an embedded ledger of 1,000,000 events,
//! against a raw read + decode of the same log in the same run.
//!
//! Workload: 2,000 providers (registration and VCPU inventory), then per instance one
//! lifecycle commit (create, host, task started/finished, vm and power state: 6 events) and
//! one claim on a provider: 7 events per instance. Written through `SledLog::append` by 64
//! concurrent writers (one per partition of the aggregates, so each aggregate's commits stay
//! in order). The audit must find nothing: the bench fails otherwise.
//!
//! Usage: `cargo bench -p provledger-serve --bench audit-bench [-- --quick]`

use std::time::Instant;

use futures::StreamExt;
use provledger_events::{
    AggregateId, CommitDraft, Event, EventLog, Expectation, SledLog, Timestamp,
};
use provledger_serve::{audit_log, OnChainViolation};
use provledger_tests::workload::{compute_node, instance_claim, instance_lifecycle};
use uuid::Uuid;

const PROVIDERS: u128 = 2_000;
const WRITERS: usize = 64;

fn draft(n: u64, events: Vec<Event>) -> CommitDraft {
    CommitDraft {
        trace: None,
        commit_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0000 | u128::from(n)),
        operation_id: None,
        causation_id: None,
        actor: "bench".into(),
        recorded_at: Timestamp::from_unix_ms(1_800_000_000_000 + n as i64),
        events,
    }
}

/// Every commit of the workload, in the order one writer per aggregate must append them.
fn workload(events_target: u64) -> Vec<(AggregateId, Vec<Event>)> {
    let mut out = Vec::new();
    for p in 0..PROVIDERS {
        out.push((
            AggregateId::provider(Uuid::from_u128(p + 1)),
            compute_node(p),
        ));
    }
    let instances = (events_target - 2 * PROVIDERS as u64) / 7;
    for k in 0..u128::from(instances) {
        let instance = Uuid::from_u128(1 << 64 | k);
        let provider = Uuid::from_u128(k % PROVIDERS + 1);
        out.push((
            AggregateId::instance(instance),
            instance_lifecycle(k, k % PROVIDERS, provider),
        ));
        out.push((AggregateId::provider(provider), instance_claim(instance)));
    }
    out
}

async fn fill(log: &SledLog, commits: Vec<(AggregateId, Vec<Event>)>) {
    let mut partitions: Vec<Vec<(u64, AggregateId, Vec<Event>)>> = vec![Vec::new(); WRITERS];
    for (n, (aggregate, events)) in commits.into_iter().enumerate() {
        let slot = (aggregate.id.as_u128() % WRITERS as u128) as usize;
        partitions[slot].push((n as u64, aggregate, events));
    }
    let writers = partitions.into_iter().map(|part| {
        let log = log.clone();
        tokio::spawn(async move {
            for (n, aggregate, events) in part {
                log.append(aggregate, Expectation::Any, draft(n, events))
                    .await
                    .expect("append");
            }
        })
    });
    for w in futures::future::join_all(writers).await {
        w.expect("writer");
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let target: u64 = if quick { 50_000 } else { 1_000_000 };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = SledLog::open(dir.path()).expect("sled log");
    let commits = workload(target);
    let n_commits = commits.len();
    let started = Instant::now();
    fill(&log, commits).await;
    eprintln!(
        "wrote {n_commits} commits in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Baseline: read and decode every commit of the same log, nothing else.
    let started = Instant::now();
    let mut events = 0u64;
    let mut stream = log.read_all(1).await.expect("read_all");
    while let Some(commit) = stream.next().await {
        events += commit.expect("decodes").events.len() as u64;
    }
    let raw = started.elapsed().as_secs_f64();

    let started = Instant::now();
    let report = audit_log(
        &log,
        OnChainViolation::Fail,
        None,
        Timestamp::now(),
        |_, _| {},
    )
    .await
    .expect("audit");
    let audit = started.elapsed().as_secs_f64();
    assert_eq!(report.events, events, "the audit read every event");
    assert!(
        report.violations.is_empty(),
        "a clean log audits clean: {:?}",
        &report.violations[..report.violations.len().min(5)]
    );

    println!("| measurement | events | commits | wall | events/s | vs raw |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| raw read + decode (`read_all`) | {events} | {n_commits} | {raw:.2} s | {:.0} | 1.00x |",
        events as f64 / raw
    );
    println!(
        "| `audit` (chains, positions, fold, invariants) | {events} | {n_commits} | {audit:.2} s | {:.0} | {:.2}x |",
        events as f64 / audit,
        raw / audit
    );
    log.close();
}
