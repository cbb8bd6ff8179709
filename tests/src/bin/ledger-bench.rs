//! `ledger-bench`: provledger's append paths against raw baselines, in one run.
//!
//! - JetStream: `JetStreamLog` appends with per-aggregate `Exactly` expectations over 1,000
//!   aggregates (~256-byte commits, pipelined by 1,000 concurrent writers, window 1,024) vs.
//!   a raw async-nats publish loop with the same payload size, window, writers and headers
//!   (`Nats-Msg-Id`, `Nats-Expected-Last-Subject-Sequence`).
//! - sled: `SledLog` durable appends with 64 concurrent writers vs. 64 writers doing a raw
//!   sled insert + flush.
//! - Latency: single-writer append p50/p99 on both backends.
//!
//! Usage: `cargo run --release -p provledger-tests --bin ledger-bench [-- --quick]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use provledger_events::{
    AggregateId, Commit, EventLog, Hash, JetStreamConfig, JetStreamLog, SledLog,
};
use provledger_tests::bench::{
    concurrent_appends, padded_draft, percentile, single_writer_latencies,
};
use provledger_tests::NatsServer;
use tokio::sync::Semaphore;
use uuid::Uuid;

const AGGREGATES: usize = 1000;
const SLED_WRITERS: usize = 64;
const WINDOW: usize = 1024;

fn encoded_size() -> usize {
    let c = Commit::seal(
        AggregateId::cluster(Uuid::now_v7()),
        1,
        Hash::ZERO,
        padded_draft(0),
    );
    provledger_events::codec::encode(&c)
        .map(|b| b.len())
        .unwrap_or(0)
}

async fn ledger_jetstream(server: &NatsServer, per_aggregate: usize) -> f64 {
    let config = JetStreamConfig {
        stream: "BENCH_LEDGER".into(),
        subject_prefix: "bl".into(),
        ack_window: WINDOW,
        ..Default::default()
    };
    let log = JetStreamLog::open(server.client().await, config)
        .await
        .expect("open ledger stream");
    concurrent_appends(&log, AGGREGATES, per_aggregate).await
}

async fn raw_jetstream(server: &NatsServer, per_aggregate: usize, payload_bytes: usize) -> f64 {
    let js = jetstream::ContextBuilder::new()
        .max_ack_inflight(5000)
        .build(server.client().await);
    js.create_stream(jetstream::stream::Config {
        name: "BENCH_RAW".into(),
        subjects: vec!["br.>".into()],
        storage: jetstream::stream::StorageType::File,
        allow_direct: true,
        deny_delete: true,
        deny_purge: true,
        ..Default::default()
    })
    .await
    .expect("raw stream");
    let payload = bytes::Bytes::from(vec![7u8; payload_bytes]);
    let window = Arc::new(Semaphore::new(WINDOW));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..AGGREGATES {
        let (js, payload, window) = (js.clone(), payload.clone(), window.clone());
        tasks.push(tokio::spawn(async move {
            let subject = format!("br.cluster.{}", Uuid::now_v7());
            let mut last = 0u64;
            for _ in 0..per_aggregate {
                let _permit = window.acquire().await.expect("window");
                let ack = provledger_tests::bench::publish_expecting(
                    &js,
                    subject.clone(),
                    payload.clone(),
                    last,
                )
                .await
                .expect("publish");
                last = ack.await.expect("ack").sequence;
            }
        }));
    }
    for t in tasks {
        t.await.expect("raw task");
    }
    (AGGREGATES * per_aggregate) as f64 / start.elapsed().as_secs_f64()
}

async fn ledger_sled(total: usize) -> (f64, u64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = SledLog::open(dir.path()).expect("open sled log");
    let rate = concurrent_appends(&log, SLED_WRITERS, total / SLED_WRITERS).await;
    let flushes = log.flush_count();
    log.close();
    (rate, flushes)
}

/// 64 OS threads, each `insert` then a synchronous `flush` (sled's `flush_async` stalls
/// with this many concurrent callers on a small runtime, so the baseline uses threads).
fn raw_sled(total: usize, payload_bytes: usize) -> f64 {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = sled::Config::new()
        .path(dir.path())
        .flush_every_ms(None)
        .open()
        .expect("sled");
    let tree = db.open_tree("raw").expect("tree");
    let per_writer = total / SLED_WRITERS;
    let start = Instant::now();
    std::thread::scope(|scope| {
        for w in 0..SLED_WRITERS {
            let (db, tree) = (&db, &tree);
            scope.spawn(move || {
                for n in 0..per_writer {
                    let key = ((w * per_writer + n) as u64).to_be_bytes();
                    tree.insert(key, vec![7u8; payload_bytes]).expect("insert");
                    db.flush().expect("flush");
                }
            });
        }
    });
    (per_writer * SLED_WRITERS) as f64 / start.elapsed().as_secs_f64()
}

async fn latency<L: EventLog>(log: &L, count: usize) -> (Duration, Duration) {
    let samples = single_writer_latencies(log, count).await;
    (percentile(&samples, 0.50), percentile(&samples, 0.99))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let (per_aggregate, sled_total, latency_count) = if quick {
        (3, 2_048, 200)
    } else {
        (20, 12_800, 2_000)
    };
    let payload = encoded_size();
    println!("ledger-bench: commit size {payload} bytes, {AGGREGATES} aggregates x {per_aggregate} commits, window {WINDOW}");

    let server = NatsServer::start().await;
    eprintln!("raw JetStream publish loop ...");
    let raw_js = raw_jetstream(&server, per_aggregate, payload).await;
    eprintln!("JetStreamLog appends ...");
    let ledger_js = ledger_jetstream(&server, per_aggregate).await;
    eprintln!("raw sled insert + flush ...");
    let raw_sl = tokio::task::spawn_blocking(move || raw_sled(sled_total, payload))
        .await
        .expect("raw sled");
    eprintln!("SledLog appends ...");
    let (ledger_sl, flushes) = ledger_sled(sled_total).await;
    eprintln!("latency ...");

    let js_log = JetStreamLog::open(
        server.client().await,
        JetStreamConfig {
            stream: "BENCH_LAT".into(),
            subject_prefix: "bt".into(),
            ..Default::default()
        },
    )
    .await
    .expect("latency stream");
    let (js_p50, js_p99) = latency(&js_log, latency_count).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let sled_log = SledLog::open(dir.path()).expect("sled");
    let (sl_p50, sl_p99) = latency(&sled_log, latency_count).await;
    sled_log.close();

    println!();
    println!("| measurement | provledger | raw baseline | ratio | target |");
    println!("|---|---:|---:|---:|---|");
    println!(
        "| JetStream appends/s (1,000 aggregates, Exactly, pipelined) | {ledger_js:.0} | {raw_js:.0} | {:.2}x | >= 0.8x |",
        ledger_js / raw_js
    );
    println!(
        "| sled durable appends/s (64 writers) | {ledger_sl:.0} | {raw_sl:.0} | {:.2}x | >= 0.7x |",
        ledger_sl / raw_sl
    );
    println!(
        "| sled appends per flush (group commit) | {:.1} | 1 | | > 1 |",
        sled_total as f64 / flushes.max(1) as f64
    );
    println!("| JetStream single-writer latency p50 / p99 | {js_p50:.2?} / {js_p99:.2?} | | | |");
    println!("| sled single-writer latency p50 / p99 | {sl_p50:.2?} / {sl_p99:.2?} | | | |");
}
