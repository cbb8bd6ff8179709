//! `replication-bench`: what replication costs a `JetStreamLog` append, in one run.
//!
//! Rows, each on its own stream:
//! - R1 on a single nats-server (the `ledger-bench` setup);
//! - R3 on a 3-node cluster rendered from `deploy/nats/cluster-node.conf`, all three
//!   servers on this machine: every ack waits until a quorum (2 of 3) has stored the commit;
//! - R1 on the same 3-node cluster: the cluster's routing without the replication.
//!
//! Per row: throughput (one writer task per aggregate, `Exactly` expectations, ~256-byte
//! commits, the log's default window of 1,024 in-flight publishes) and the latency of a
//! single writer appending one commit at a time (p50 / p99 / max). The client connects to
//! every server of the cluster as seeds and takes whichever answers, like a service would;
//! the run prints which server that is and which one leads each stream.
//!
//! Usage: `cargo run --release -p provledger-tests --bin replication-bench [-- --quick]`

use std::time::Duration;

use provledger_events::{JetStreamConfig, JetStreamLog};
use provledger_tests::bench::{concurrent_appends, percentile, single_writer_latencies};
use provledger_tests::{NatsCluster, NatsServer};

/// Throughput and latency of one setup.
struct Row {
    name: &'static str,
    placement: String,
    appends_per_s: f64,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

/// How much of each measurement to do.
#[derive(Clone, Copy)]
struct Size {
    aggregates: usize,
    per_aggregate: usize,
    latency_samples: usize,
}

/// One writer, one commit at a time: (p50, p99, max).
async fn latency(log: &JetStreamLog, count: usize) -> (Duration, Duration, Duration) {
    let samples = single_writer_latencies(log, count).await;
    let max = samples.last().copied().unwrap_or(Duration::ZERO);
    (percentile(&samples, 0.50), percentile(&samples, 0.99), max)
}

/// Opens `stream` with `replicas`, warms it up, then measures it.
async fn measure(
    name: &'static str,
    client: async_nats::Client,
    stream: &str,
    replicas: usize,
    size: Size,
) -> Row {
    let connected_to = client.server_info().server_name;
    let config = JetStreamConfig {
        stream: stream.into(),
        subject_prefix: stream.to_lowercase(),
        replicas,
        ..Default::default()
    };
    let log = JetStreamLog::open(client, config)
        .await
        .expect("open the bench stream");
    let leader = log
        .context()
        .get_stream(stream)
        .await
        .expect("the bench stream")
        .get_info()
        .await
        .expect("the bench stream's info")
        .cluster
        .and_then(|c| c.leader)
        .unwrap_or_else(|| "?".into());
    let placement = format!("client on {connected_to}, stream led by {leader}");
    eprintln!("{name}: {placement}; warming up ...");
    // The first appends pay for connections, consumers and the stream's first blocks.
    concurrent_appends(&log, 100, 2).await;
    eprintln!("{name}: throughput ...");
    let appends_per_s = concurrent_appends(&log, size.aggregates, size.per_aggregate).await;
    eprintln!("{name}: latency ...");
    let (p50, p99, max) = latency(&log, size.latency_samples).await;
    Row {
        name,
        placement,
        appends_per_s,
        p50,
        p99,
        max,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let size = if quick {
        Size {
            aggregates: 200,
            per_aggregate: 5,
            latency_samples: 300,
        }
    } else {
        Size {
            aggregates: 1000,
            per_aggregate: 20,
            latency_samples: 3000,
        }
    };
    println!(
        "replication-bench: {} aggregates x {} commits (Exactly, window 1,024), {} single-writer appends for latency",
        size.aggregates, size.per_aggregate, size.latency_samples
    );

    let mut rows = Vec::new();
    {
        eprintln!("starting a single nats-server ...");
        let server = NatsServer::start().await;
        rows.push(
            measure(
                "R1, single node",
                server.client().await,
                "BENCH_R1",
                1,
                size,
            )
            .await,
        );
    }
    eprintln!("starting a 3-node cluster ...");
    let cluster = NatsCluster::start(3).await;
    rows.push(
        measure(
            "R3, 3-node cluster",
            cluster.client_as("bench").await,
            "BENCH_R3",
            3,
            size,
        )
        .await,
    );
    rows.push(
        measure(
            "R1, 3-node cluster",
            cluster.client_as("bench").await,
            "BENCH_R1C",
            1,
            size,
        )
        .await,
    );

    let base_rate = rows[0].appends_per_s;
    let base_p50 = rows[0].p50.as_secs_f64();
    println!();
    println!("| setup | appends/s | vs R1 | p50 | p99 | max | p50 vs R1 |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.0} | {:.2}x | {:.2?} | {:.2?} | {:.2?} | {:.2}x |",
            r.name,
            r.appends_per_s,
            r.appends_per_s / base_rate,
            r.p50,
            r.p99,
            r.max,
            r.p50.as_secs_f64() / base_p50,
        );
    }
    println!();
    for r in &rows {
        println!("- {}: {}", r.name, r.placement);
    }
}
