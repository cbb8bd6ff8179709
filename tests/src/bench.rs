//! What the append benchmarks (`ledger-bench`, `replication-bench`) share, so that their
//! figures are of the same commits written the same way: a ~256-byte commit, writers that
//! each append to their own aggregate at exact versions, and a single writer's latencies.

use std::time::{Duration, Instant};

use provledger_events::catalogue::ClusterStatus;
use provledger_events::{AggregateId, CommitDraft, Event, EventLog, Expectation, Timestamp};
use uuid::Uuid;

/// Commit `n` of a bench aggregate: the description pads it to about 256 bytes encoded.
pub fn padded_draft(n: usize) -> CommitDraft {
    CommitDraft {
        trace: None,
        commit_id: Uuid::now_v7(),
        operation_id: Some(Uuid::now_v7()),
        causation_id: None,
        actor: "bench".into(),
        recorded_at: Timestamp::now(),
        events: vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Active,
            description: format!("{n:>8} {}", "x".repeat(80)),
        }],
    }
}

/// The largest latency [`percentile`] tells apart: an hour.
const LATENCY_NS_MAX: u64 = 3_600 * 1_000_000_000;

/// The `p` quantile (0..=1) of `latencies` (in any order), read from an HDR histogram of
/// their nanoseconds at 3 significant digits (within 0.1%); zero for none.
pub fn percentile(latencies: &[Duration], p: f64) -> Duration {
    if latencies.is_empty() {
        return Duration::ZERO;
    }
    // Bounds 1 ns..1 h at 3 significant digits are valid for hdrhistogram (low >= 1, high
    // >= 2 * low, digits <= 5), so this cannot fail; a latency over an hour saturates.
    let mut histogram = hdrhistogram::Histogram::<u64>::new_with_bounds(1, LATENCY_NS_MAX, 3)
        .expect("valid bounds");
    for latency in latencies {
        histogram.saturating_record(u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX));
    }
    Duration::from_nanos(histogram.value_at_quantile(p))
}

/// `writers` tasks, each appending `per_writer` commits in order to a fresh aggregate of
/// its own with exact expectations; returns appends per second.
pub async fn concurrent_appends<L>(log: &L, writers: usize, per_writer: usize) -> f64
where
    L: EventLog + Clone + Send + Sync + 'static,
{
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(writers);
    for _ in 0..writers {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let aggregate = AggregateId::cluster(Uuid::now_v7());
            for v in 0..per_writer {
                log.append(aggregate, Expectation::Exactly(v as u64), padded_draft(v))
                    .await
                    .expect("bench append");
            }
        }));
    }
    for t in tasks {
        t.await.expect("writer task");
    }
    (writers * per_writer) as f64 / start.elapsed().as_secs_f64()
}

/// One writer appending `count` commits one at a time: each append's latency, sorted.
pub async fn single_writer_latencies<L: EventLog>(log: &L, count: usize) -> Vec<Duration> {
    let aggregate = AggregateId::cluster(Uuid::now_v7());
    let mut samples = Vec::with_capacity(count);
    for v in 0..count {
        let t = Instant::now();
        log.append(aggregate, Expectation::Exactly(v as u64), padded_draft(v))
            .await
            .expect("latency append");
        samples.push(t.elapsed());
    }
    samples.sort();
    samples
}

/// `provledger serve` run in the bench's process, on a runtime of its own (2 worker
/// threads, as the deployed binary on this machine) on a thread of its own, until
/// [`InProcessServe::stop`].
pub struct InProcessServe {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<Result<(), String>>,
}

impl InProcessServe {
    pub fn start(options: provledger_serve::ServeOptions) -> InProcessServe {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("serve's runtime")
                .block_on(provledger_serve::run(options, async {
                    let _ = stopped.await;
                }))
                .map_err(|e| e.to_string())
        });
        InProcessServe { stop, thread }
    }

    /// Asks serve to stop and waits until it has (with its copy of the stream, it stops
    /// once the copy is whole through what it applied, and flushed); how serve ended.
    pub fn stop(self) -> Result<(), String> {
        let _ = self.stop.send(());
        self.thread
            .join()
            .unwrap_or_else(|_| Err("serve's thread panicked".into()))
    }
}

/// Waits until a replica answers `ready` at `end` or later; the time it took from `since`.
/// Panics after an hour: a bench that waits longer measures nothing.
pub async fn ready_at(client: &async_nats::Client, end: u64, since: Instant) -> Duration {
    let deadline = since + Duration::from_secs(3_600);
    loop {
        assert!(
            Instant::now() < deadline,
            "serve not ready at {end} in an hour"
        );
        let reply = tokio::time::timeout(
            Duration::from_secs(1),
            client.request("provledger.q.health", "{}".into()),
        )
        .await;
        if let Ok(Ok(msg)) = reply {
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&msg.payload) {
                if v["position"].as_u64() >= Some(end) && v["data"]["ready"] == true {
                    return since.elapsed();
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The bytes of every file under `dir`.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        total += match entry.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&path),
            Ok(m) => m.len(),
            Err(_) => 0,
        };
    }
    total
}

/// The bytes the stream's messages take on the server (its `state.bytes`).
pub async fn stream_bytes(log: &provledger_events::JetStreamLog) -> u64 {
    log.context()
        .get_stream(&log.config().stream)
        .await
        .expect("stream")
        .info()
        .await
        .expect("stream info")
        .state
        .bytes
}

/// serve's log on stderr, at `info` unless `RUST_LOG` says otherwise, as `provledger serve`
/// logs: a bench that runs serve in process shows its phases (catch-up, snapshots, copy).
pub fn log_serve_to_stderr() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "provledger_serve=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Sends `payload` on `subject` as the raw references write: with a fresh message id,
/// expecting `last` as the subject's last sequence. Gives the ack's future.
pub async fn publish_expecting(
    js: &async_nats::jetstream::Context,
    subject: String,
    payload: bytes::Bytes,
    last: u64,
) -> Result<
    async_nats::jetstream::context::PublishAckFuture,
    async_nats::jetstream::context::PublishError,
> {
    let publish = async_nats::jetstream::message::PublishMessage::build()
        .payload(payload)
        .message_id(Uuid::now_v7().to_string())
        .expected_last_subject_sequence(last);
    js.send_publish(subject, publish).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_1_to_100_ms_are_within_a_tenth_of_a_percent() {
        // Given: latencies of 1, 2, ..., 100 ms, shuffled.
        let mut latencies: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        latencies.reverse();
        // When / then: the median, p99 and max are those of the sorted list, to 0.1%.
        for (p, expected_ms) in [(0.5, 50.0), (0.99, 99.0), (1.0, 100.0)] {
            let got = percentile(&latencies, p).as_secs_f64() * 1e3;
            assert!(
                (got - expected_ms).abs() <= expected_ms * 1e-3,
                "p{p}: {got} ms, expected {expected_ms}"
            );
        }
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }
}
