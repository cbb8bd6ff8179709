//! Time travel by time against a real nats-server and real sled stores: two replicas that
//! fold the same stream in different batches resolve every time to the same position, the
//! last one recorded at or before it.

use provledger_events::catalogue::ClusterStatus;
use provledger_events::{
    AggregateId, CommitDraft, Event, EventLog, Expectation, JetStreamConfig, JetStreamLog,
    Timestamp,
};
use provledger_serve::{ProjectionStore, Projector};
use provledger_tests::NatsServer;
use uuid::Uuid;

const BASE_MS: i64 = 1_800_000_000_000;

/// Writers' clocks disagree: every seventh commit is stamped five seconds in the past.
fn recorded_at(i: i64) -> i64 {
    BASE_MS + i * 1000 - if i % 7 == 3 { 5000 } else { 0 }
}

/// The definition: the last position whose running maximum `recorded_at` is at or before
/// `t` (writers' clocks are not monotonic, so a later commit may be stamped earlier).
fn expected(times: &[i64], t: i64) -> u64 {
    let mut max = i64::MIN;
    let mut answer = 0;
    for (i, ms) in times.iter().enumerate() {
        max = max.max(*ms);
        if max <= t {
            answer = i as u64 + 1;
        }
    }
    answer
}

fn store(dir: &std::path::Path) -> ProjectionStore {
    let db = sled::open(dir).unwrap();
    ProjectionStore::open(&db).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_that_batch_differently_resolve_a_time_to_the_same_last_position() {
    let nats = NatsServer::start().await;
    let log = JetStreamLog::open(nats.client().await, JetStreamConfig::default())
        .await
        .unwrap();
    let clusters: Vec<AggregateId> = (0..5)
        .map(|_| AggregateId::cluster(Uuid::now_v7()))
        .collect();
    let times: Vec<i64> = (0..60).map(recorded_at).collect();
    for (i, ms) in times.iter().enumerate() {
        let mut draft = CommitDraft::now(
            "test",
            vec![Event::ClusterStatusChanged {
                status: ClusterStatus::Spawning,
                description: format!("step {i}"),
            }],
        );
        draft.recorded_at = Timestamp::from_unix_ms(*ms);
        log.append(clusters[i % clusters.len()], Expectation::Any, draft)
            .await
            .unwrap();
    }

    // Replica A folds the stream in one batch; replica B one entry per batch.
    let dir = tempfile::tempdir().unwrap();
    let a = store(&dir.path().join("a"));
    Projector::new(a.clone(), 0)
        .unwrap()
        .catch_up(&log, |_, _| {})
        .await
        .unwrap();
    let b = store(&dir.path().join("b"));
    let mut projector_b = Projector::new(b.clone(), 0).unwrap();
    let mut entries = log.read_all(1).await.unwrap();
    use futures::StreamExt;
    while let Some(entry) = entries.next().await {
        projector_b.apply_batch(vec![entry]).unwrap();
    }
    assert_eq!(a.checkpoint().unwrap(), 60);
    assert_eq!(b.checkpoint().unwrap(), 60);

    let mut probes = vec![BASE_MS - 86_400_000, i64::MAX / 2];
    for ms in &times {
        probes.extend([ms - 1, *ms, ms + 1]);
    }
    for t in probes {
        let at = Timestamp::from_unix_ms(t);
        let want = expected(&times, t);
        assert_eq!(a.position_at_time(at).unwrap(), want, "replica A at {t}");
        assert_eq!(b.position_at_time(at).unwrap(), want, "replica B at {t}");
    }
}
