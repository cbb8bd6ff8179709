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

/// The `p` quantile (0..=1) of `sorted` latencies; zero for none.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
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
