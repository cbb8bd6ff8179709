//! The EventLog conformance suite: every test runs against both backends, `SledLog` on real
//! sled files in a temporary dir and `JetStreamLog` on a private nats-server.

use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use provledger_events::catalogue::ClusterStatus;
use provledger_events::{
    verify_chain, AggregateId, AppendError, AppendStatus, AtomicItem, ChainViolation, Commit,
    CommitDraft, Event, EventLog, Expectation, GroupStats, HistoryEntry, JetStreamConfig,
    JetStreamLog, MemLog, ReadError, SledLog, VersionConflict,
};
use provledger_tests::NatsServer;
use uuid::Uuid;

trait Backend: Sized + Send {
    type Log: EventLog + Clone + Send + Sync + 'static;
    async fn create() -> Self;
    async fn open(&mut self) -> Self::Log;
    /// Closes the log and, for JetStream, restarts the server process on the same store.
    async fn close(&mut self, log: Self::Log);
    /// Group writes of atomic sets the log made, and the sets they held.
    fn group_stats(log: &Self::Log) -> GroupStats;
    /// Whether the log opens a group write before the group is whole (JetStream on
    /// nats-server 2.14+).
    fn opens_early(_log: &Self::Log) -> bool {
        false
    }
}

struct SledBackend {
    dir: tempfile::TempDir,
}

impl Backend for SledBackend {
    type Log = SledLog;
    async fn create() -> Self {
        SledBackend {
            dir: tempfile::tempdir().unwrap(),
        }
    }
    async fn open(&mut self) -> SledLog {
        SledLog::open(self.dir.path()).unwrap()
    }
    fn group_stats(log: &SledLog) -> GroupStats {
        log.group_stats()
    }
    async fn close(&mut self, log: SledLog) {
        log.close();
    }
}

/// The in-memory log used by the seeded simulation: it must keep the same contract.
/// "Closing" keeps the shared state, as a process restart keeps a real log's files.
struct MemBackend {
    log: MemLog,
}

impl Backend for MemBackend {
    type Log = MemLog;
    async fn create() -> Self {
        MemBackend { log: MemLog::new() }
    }
    async fn open(&mut self) -> MemLog {
        self.log.clone()
    }
    fn group_stats(log: &MemLog) -> GroupStats {
        log.group_stats()
    }
    async fn close(&mut self, log: MemLog) {
        drop(log);
    }
}

struct JetStreamBackend {
    server: NatsServer,
}

impl Backend for JetStreamBackend {
    type Log = JetStreamLog;
    async fn create() -> Self {
        JetStreamBackend {
            server: NatsServer::start().await,
        }
    }
    async fn open(&mut self) -> JetStreamLog {
        JetStreamLog::open(self.server.client().await, JetStreamConfig::default())
            .await
            .unwrap()
    }
    fn opens_early(log: &JetStreamLog) -> bool {
        opens_early(log)
    }

    fn group_stats(log: &JetStreamLog) -> GroupStats {
        log.group_stats()
    }
    async fn close(&mut self, log: JetStreamLog) {
        drop(log);
        self.server.restart().await;
    }
}

/// Whether `log`'s server takes a batch committed by an end-of-batch marker (2.14+), so
/// that the log opens its group writes early: the suite also runs against older servers
/// (`NATS_SERVER_BIN`), which are written to once a group is whole.
fn opens_early(log: &JetStreamLog) -> bool {
    provledger_tests::opens_batches_early(log.server_version())
}

fn status(n: usize) -> CommitDraft {
    CommitDraft::now(
        "conformance",
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Active,
            description: format!("#{n}"),
        }],
    )
}

fn cluster() -> AggregateId {
    AggregateId::cluster(Uuid::now_v7())
}

async fn read_all<L: EventLog>(log: &L, from: u64) -> Vec<Commit> {
    let mut s = log.read_all(from).await.unwrap();
    let mut out = Vec::new();
    while let Some(c) = s.next().await {
        out.push(c.unwrap());
    }
    out
}

// ---- the suite ----

async fn appends_then_reads<B: Backend>(mut b: B) {
    let log = b.open().await;
    let (a, c) = (cluster(), cluster());
    let mut positions = Vec::new();
    for (agg, n) in [(a, 0), (c, 1), (a, 2), (a, 3), (c, 4)] {
        let out = log.append(agg, Expectation::Any, status(n)).await.unwrap();
        assert_eq!(out.status, AppendStatus::Appended);
        positions.push(out.position);
    }
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "positions grow: {positions:?}"
    );

    let history = log.read_aggregate(a).await.unwrap();
    assert_eq!(
        history.iter().map(|c| c.version).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(
        history.iter().map(|c| c.position).collect::<Vec<_>>(),
        vec![positions[0], positions[2], positions[3]]
    );
    assert!(verify_chain(&a, &history).is_empty());
    assert_eq!(log.read_aggregate(cluster()).await.unwrap(), vec![]);

    let all = read_all(&log, positions[0]).await;
    assert_eq!(
        all.iter().map(|c| c.position).collect::<Vec<_>>(),
        positions
    );
    let tail = read_all(&log, positions[3]).await;
    assert_eq!(tail.len(), 2);
    assert_eq!(log.last_position().await.unwrap(), positions[4]);
}

async fn expectations_and_conflicts<B: Backend>(mut b: B) {
    let log = b.open().await;
    let a = cluster();
    let first = log
        .append(a, Expectation::NoStream, status(0))
        .await
        .unwrap();
    assert_eq!(first.version, 1);
    match log.append(a, Expectation::NoStream, status(1)).await {
        Err(AppendError::Conflict {
            actual: 1,
            expected: Expectation::NoStream,
            ..
        }) => {}
        other => panic!("NoStream on an existing aggregate must conflict, got {other:?}"),
    }
    assert_eq!(
        log.append(a, Expectation::Exactly(1), status(2))
            .await
            .unwrap()
            .version,
        2
    );
    match log.append(a, Expectation::Exactly(1), status(3)).await {
        Err(AppendError::Conflict {
            actual: 2,
            expected: Expectation::Exactly(1),
            ..
        }) => {}
        other => panic!("stale Exactly must conflict with the actual version, got {other:?}"),
    }
    match log.append(a, Expectation::Exactly(7), status(4)).await {
        Err(AppendError::Conflict { actual: 2, .. }) => {}
        other => panic!("future Exactly must conflict, got {other:?}"),
    }
    match log
        .append(cluster(), Expectation::Exactly(1), status(5))
        .await
    {
        Err(AppendError::Conflict { actual: 0, .. }) => {}
        other => panic!("Exactly on a missing aggregate must conflict with 0, got {other:?}"),
    }
    assert_eq!(
        log.append(a, Expectation::Any, status(6))
            .await
            .unwrap()
            .version,
        3
    );
    // Nothing the conflicts refused was written.
    assert_eq!(log.read_aggregate(a).await.unwrap().len(), 3);
    // An event of another aggregate kind is refused before anything is written.
    let bad = CommitDraft::now("t", vec![Event::InstanceDeleted {}]);
    assert!(matches!(
        log.append(a, Expectation::Any, bad).await,
        Err(AppendError::Invalid(_))
    ));
}

async fn concurrent_writers_one_winner_per_version<B: Backend>(mut b: B) {
    let log = b.open().await;
    let a = cluster();
    const WRITERS: usize = 6;
    const COMMITS_PER_WRITER: usize = 12;
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            let mut conflicts = 0u32;
            while mine.len() < COMMITS_PER_WRITER {
                let version = log
                    .read_aggregate(a)
                    .await
                    .unwrap()
                    .last()
                    .map_or(0, |c| c.version);
                let draft = status(w * 1000 + mine.len());
                let id = draft.commit_id;
                match log.append(a, Expectation::Exactly(version), draft).await {
                    Ok(out) => {
                        assert_eq!(out.version, version + 1);
                        mine.push((id, out.version));
                    }
                    Err(AppendError::Conflict { actual, .. }) => {
                        assert!(actual > version, "a conflict reports a newer version");
                        conflicts += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            (mine, conflicts)
        }));
    }
    let mut won = Vec::new();
    for t in tasks {
        won.extend(t.await.unwrap().0);
    }
    let history = log.read_aggregate(a).await.unwrap();
    let total = WRITERS * COMMITS_PER_WRITER;
    assert_eq!(history.len(), total, "nothing lost, nothing doubled");
    assert!(verify_chain(&a, &history).is_empty());
    // Each version has exactly one winner, and it is the commit that writer was told won.
    let versions: BTreeSet<u64> = won.iter().map(|(_, v)| *v).collect();
    assert_eq!(versions.len(), total);
    for (id, v) in &won {
        assert_eq!(history[(*v - 1) as usize].commit_id, *id);
    }
}

async fn idempotent_retry<B: Backend>(mut b: B) {
    let log = b.open().await;
    let a = cluster();
    let draft = status(0);
    let first = log
        .append(a, Expectation::NoStream, draft.clone())
        .await
        .unwrap();
    let other = log
        .append(cluster(), Expectation::Any, status(1))
        .await
        .unwrap();
    // The retry carries the same (now stale) expectation, as a client that lost the ack would.
    let retry = log
        .append(a, Expectation::NoStream, draft.clone())
        .await
        .unwrap();
    assert_eq!(retry.status, AppendStatus::AlreadyAppended);
    assert_eq!(
        (retry.position, retry.version),
        (first.position, first.version)
    );
    let again = log
        .append(a, Expectation::Any, draft.clone())
        .await
        .unwrap();
    assert_eq!(again.position, first.position);
    assert_eq!(log.read_aggregate(a).await.unwrap().len(), 1);
    assert_eq!(log.last_position().await.unwrap(), other.position);

    let mut reused = draft.clone();
    reused.actor = "someone else".into();
    match log.append(a, Expectation::Any, reused).await {
        Err(AppendError::CommitIdReused { position, .. }) => assert_eq!(position, first.position),
        other => panic!("a reused commit_id with another payload must be refused, got {other:?}"),
    }
}

async fn subscribe_from_the_middle_while_appending<B: Backend>(mut b: B) {
    let log = b.open().await;
    let a = cluster();
    let mut positions = Vec::new();
    for n in 0..10 {
        positions.push(
            log.append(a, Expectation::Any, status(n))
                .await
                .unwrap()
                .position,
        );
    }
    let from = positions[5];
    let mut sub = log.subscribe(from).await.unwrap();
    let writer = {
        let log = log.clone();
        tokio::spawn(async move {
            let mut ps = Vec::new();
            for n in 10..40 {
                let agg = if n % 3 == 0 { cluster() } else { a };
                ps.push(
                    log.append(agg, Expectation::Any, status(n))
                        .await
                        .unwrap()
                        .position,
                );
            }
            ps
        })
    };
    let mut seen = Vec::new();
    while seen.len() < 35 {
        let item = tokio::time::timeout(Duration::from_secs(20), sub.next())
            .await
            .expect("live tail stalled")
            .expect("live tail ended")
            .unwrap();
        seen.push(item.position);
    }
    positions.extend(writer.await.unwrap());
    assert_eq!(seen, positions[5..].to_vec(), "no skip, no reorder");
}

async fn reopen_loses_nothing_acknowledged<B: Backend>(mut b: B) {
    let log = b.open().await;
    let aggs: Vec<AggregateId> = (0..5).map(|_| cluster()).collect();
    let mut acked = Vec::new();
    for n in 0..50 {
        let agg = aggs[n % aggs.len()];
        let out = log.append(agg, Expectation::Any, status(n)).await.unwrap();
        acked.push((agg, out.position, out.version));
    }
    b.close(log).await;
    let log = b.open().await;
    let all = read_all(&log, 1).await;
    let got: Vec<(AggregateId, u64, u64)> = all
        .iter()
        .map(|c| (c.aggregate, c.position, c.version))
        .collect();
    assert_eq!(got, acked);
    for agg in &aggs {
        let history = log.read_aggregate(*agg).await.unwrap();
        assert!(verify_chain(agg, &history).is_empty());
    }
    let next = log
        .append(aggs[0], Expectation::Exactly(10), status(99))
        .await
        .unwrap();
    assert_eq!(next.version, 11);
}

/// Same scenario on both backends; the tampering itself differs (see the backend modules).
fn assert_tampering_detected(agg: &AggregateId, history: &[Commit]) {
    let violations = verify_chain(agg, history);
    assert!(
        violations
            .iter()
            .any(|v| matches!(v, ChainViolation::HashMismatch { version: 2, .. })),
        "modified commit must be detected: {violations:?}"
    );
}

fn item(aggregate: AggregateId, expect: Expectation, draft: CommitDraft) -> AtomicItem {
    AtomicItem {
        aggregate,
        expect,
        draft,
    }
}

async fn atomic_appends_all_or_nothing<B: Backend>(mut b: B) {
    // Given two aggregates, one at version 1 and one at version 2.
    let log = b.open().await;
    let (a, c) = (cluster(), cluster());
    log.append(a, Expectation::NoStream, status(0))
        .await
        .unwrap();
    log.append(c, Expectation::NoStream, status(1))
        .await
        .unwrap();
    log.append(c, Expectation::Exactly(1), status(2))
        .await
        .unwrap();
    let end = log.last_position().await.unwrap();

    // When a batch expects both at stale versions and a third (new) one correctly.
    let fresh = cluster();
    let stale = vec![
        item(a, Expectation::Exactly(0), status(3)),
        item(fresh, Expectation::NoStream, status(4)),
        item(c, Expectation::Exactly(1), status(5)),
    ];
    // Then nothing is written, and each stale aggregate is named with its actual version.
    match log.append_atomic(stale).await {
        Err(AppendError::Conflicts { conflicts }) => assert_eq!(
            conflicts,
            vec![
                VersionConflict {
                    aggregate: a,
                    expected: Expectation::Exactly(0),
                    actual: 1
                },
                VersionConflict {
                    aggregate: c,
                    expected: Expectation::Exactly(1),
                    actual: 2
                },
            ]
        ),
        other => panic!("a batch with stale expectations must conflict, got {other:?}"),
    }
    assert_eq!(log.last_position().await.unwrap(), end);
    assert!(log.read_aggregate(fresh).await.unwrap().is_empty());

    // When the batch expects what is true.
    let good = vec![
        item(a, Expectation::Exactly(1), status(6)),
        item(fresh, Expectation::NoStream, status(7)),
        item(c, Expectation::Any, status(8)),
    ];
    let outcomes = log.append_atomic(good.clone()).await.unwrap();
    // Then all three are written at consecutive positions, in order.
    let positions: Vec<u64> = outcomes.iter().map(|o| o.position).collect();
    assert_eq!(positions, vec![end + 1, end + 2, end + 3]);
    let versions: Vec<u64> = outcomes.iter().map(|o| o.version).collect();
    assert_eq!(versions, vec![2, 1, 3]);
    assert!(outcomes.iter().all(|o| o.status == AppendStatus::Appended));
    let all = read_all(&log, end + 1).await;
    assert_eq!(
        all.iter().map(|c| c.aggregate).collect::<Vec<_>>(),
        vec![a, fresh, c]
    );

    // When the same batch is sent again (a lost ack): it is recognised, nothing is added.
    let again = log.append_atomic(good.clone()).await.unwrap();
    assert_eq!(
        again
            .iter()
            .map(|o| (o.position, o.version))
            .collect::<Vec<_>>(),
        outcomes
            .iter()
            .map(|o| (o.position, o.version))
            .collect::<Vec<_>>()
    );
    assert!(again
        .iter()
        .all(|o| o.status == AppendStatus::AlreadyAppended));
    assert_eq!(log.last_position().await.unwrap(), end + 3);

    // And a batch reusing one of those ids with another payload is refused.
    let mut reused = good[0].clone();
    reused.draft.events = status(99).events;
    reused.expect = Expectation::Any;
    assert!(matches!(
        log.append_atomic(vec![
            reused,
            item(cluster(), Expectation::NoStream, status(9))
        ])
        .await,
        Err(AppendError::CommitIdReused { .. })
    ));
    // And an aggregate twice in one batch is refused before anything is tried.
    assert!(matches!(
        log.append_atomic(vec![
            item(a, Expectation::Any, status(10)),
            item(a, Expectation::Any, status(11))
        ])
        .await,
        Err(AppendError::InvalidBatch(_))
    ));
    assert_eq!(log.last_position().await.unwrap(), end + 3);
}

/// Given 64 atomic sets of two new aggregates each, every 8th expecting a version its
/// aggregates do not have, sent at once: exactly the stale sets are refused, every other
/// lands whole at consecutive positions, and the sets were written in shared groups.
async fn concurrent_atomic_sets_share_writes_and_a_stale_one_sinks_no_other<B: Backend>(mut b: B) {
    let log = b.open().await;
    let sets: Vec<(bool, Vec<AtomicItem>)> = (0..64)
        .map(|n| {
            let stale = n % 8 == 3;
            let expect = match stale {
                true => Expectation::Exactly(1),
                false => Expectation::NoStream,
            };
            let items = vec![
                item(cluster(), expect, status(n)),
                item(cluster(), Expectation::Any, status(n + 100)),
            ];
            (stale, items)
        })
        .collect();
    let before = B::group_stats(&log);
    let answers = futures::future::join_all(sets.iter().map(|(_, items)| {
        let log = log.clone();
        let items = items.clone();
        tokio::spawn(async move { log.append_atomic(items).await })
    }))
    .await;
    let after = B::group_stats(&log);
    for ((stale, items), answer) in sets.iter().zip(answers) {
        match (stale, answer.unwrap()) {
            (true, Err(AppendError::Conflicts { conflicts })) => {
                assert_eq!(conflicts.len(), 1);
                assert_eq!(conflicts[0].aggregate, items[0].aggregate);
                assert_eq!(conflicts[0].actual, 0);
            }
            (false, Ok(outcomes)) => {
                assert_eq!(outcomes.len(), 2);
                assert_eq!(outcomes[1].position, outcomes[0].position + 1);
                assert!(outcomes.iter().all(|o| o.version == 1));
            }
            (stale, other) => panic!("set (stale: {stale}) answered {other:?}"),
        }
        // An independent read finds each set whole or absent, as answered.
        for i in items {
            let commits = log.read_aggregate(i.aggregate).await.unwrap();
            assert_eq!(commits.len(), usize::from(!stale), "{}", i.aggregate);
        }
    }
    let (writes, grouped) = (after.writes - before.writes, after.sets - before.sets);
    assert_eq!(grouped, 64, "every set went through the group commit");
    assert!(
        writes < grouped,
        "64 concurrent sets took {writes} writes: none was shared"
    );
}

/// Given 16 writers each appending 8 atomic sets of two new aggregates in a closed loop
/// (the next set sent when the last is answered), every 8th set expecting a version its
/// aggregates do not have: exactly the stale sets are refused, every other lands whole at
/// consecutive positions, and writes under load were opened before their last sets came.
async fn writers_in_a_closed_loop_share_writes_and_a_stale_set_sinks_no_other<B: Backend>(
    mut b: B,
) {
    let log = b.open().await;
    let before = B::group_stats(&log);
    let answers = futures::future::join_all((0..16).map(|w| {
        let log = log.clone();
        tokio::spawn(async move {
            let mut answered = Vec::new();
            for round in 0..8 {
                let n = w * 8 + round;
                let stale = n % 8 == 5;
                let items = vec![
                    item(
                        cluster(),
                        match stale {
                            true => Expectation::Exactly(1),
                            false => Expectation::NoStream,
                        },
                        status(n),
                    ),
                    item(cluster(), Expectation::Any, status(n + 1000)),
                ];
                let answer = log.append_atomic(items.clone()).await;
                answered.push((stale, items, answer));
            }
            answered
        })
    }))
    .await;
    let after = B::group_stats(&log);
    for (stale, items, answer) in answers.into_iter().flat_map(|a| a.unwrap()) {
        match (stale, answer) {
            (true, Err(AppendError::Conflicts { conflicts })) => {
                assert_eq!(conflicts.len(), 1);
                assert_eq!(conflicts[0].aggregate, items[0].aggregate);
            }
            (false, Ok(outcomes)) => {
                assert_eq!(outcomes.len(), 2);
                assert_eq!(outcomes[1].position, outcomes[0].position + 1);
            }
            (stale, other) => panic!("set (stale: {stale}) answered {other:?}"),
        }
        for i in &items {
            let commits = log.read_aggregate(i.aggregate).await.unwrap();
            assert_eq!(commits.len(), usize::from(!stale), "{}", i.aggregate);
        }
    }
    assert_eq!(
        after.sets - before.sets,
        128,
        "every set went through the group commit"
    );
    assert!(
        after.writes - before.writes < 128,
        "no write was shared: {after:?}"
    );
    assert_eq!(
        after.opened_early > before.opened_early,
        B::opens_early(&log),
        "writes under load opened before their last sets came: {after:?}"
    );
}

macro_rules! conformance {
    ($backend:ident, $module:ident) => {
        mod $module {
            use super::*;
            conformance!(@tests $backend,
                appends_then_reads,
                expectations_and_conflicts,
                concurrent_writers_one_winner_per_version,
                idempotent_retry,
                subscribe_from_the_middle_while_appending,
                reopen_loses_nothing_acknowledged,
                atomic_appends_all_or_nothing,
                concurrent_atomic_sets_share_writes_and_a_stale_one_sinks_no_other,
                writers_in_a_closed_loop_share_writes_and_a_stale_set_sinks_no_other);
        }
    };
    (@tests $backend:ident, $($name:ident),*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                super::$name($backend::create().await).await
            }
        )*
    };
}

conformance!(SledBackend, sled_backend);
conformance!(MemBackend, mem_backend);
conformance!(JetStreamBackend, jetstream_backend);

// ---- backend-specific proofs ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_hash_chain_detects_a_modified_commit_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let a = cluster();
    {
        let log = SledLog::open(dir.path()).unwrap();
        for n in 0..3 {
            log.append(a, Expectation::Any, status(n)).await.unwrap();
        }
        let history = log.read_aggregate(a).await.unwrap();
        // Given version 2 rewritten in place with different content but its old hash ...
        let mut forged = history[1].clone();
        forged.actor = "mallory".into();
        let bytes = provledger_events::codec::encode(&forged).unwrap();
        let mut key = vec![b'c'];
        key.extend_from_slice(&forged.position.to_be_bytes());
        log.db()
            .open_tree("log")
            .unwrap()
            .insert(key, bytes)
            .unwrap();
        log.close();
    }
    // ... when the aggregate is read back after reopening, then the chain check flags it.
    let log = SledLog::open(dir.path()).unwrap();
    assert_tampering_detected(&a, &log.read_aggregate(a).await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_stale_append_whose_commit_id_is_newer_than_the_head_answers_at_once() {
    let server = NatsServer::start().await;
    let log = JetStreamLog::open(server.client().await, JetStreamConfig::default())
        .await
        .unwrap();
    let a = cluster();
    log.append(a, Expectation::Any, status(0)).await.unwrap();
    // Given a commit id minted after everything on the subject (a clock ahead, or a head
    // older than the skew the retry scan allows for) ...
    let ahead = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        + Duration::from_secs(600);
    let mut draft = status(1);
    draft.commit_id = Uuid::new_v7(uuid::Timestamp::from_unix(
        uuid::NoContext,
        ahead.as_secs(),
        ahead.subsec_nanos(),
    ));
    // ... when an append with a stale expectation looks for it as a retry, then it answers
    // the conflict instead of waiting for a message that never comes.
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        log.append(a, Expectation::Exactly(5), draft),
    )
    .await
    .expect("answered in time, not pinned by the retry scan");
    assert!(
        matches!(answer, Err(AppendError::Conflict { actual: 1, .. })),
        "{answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_quarantines_a_forged_commit_on_the_subject_and_the_chain_goes_on() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    let log = JetStreamLog::open(client.clone(), JetStreamConfig::default())
        .await
        .unwrap();
    let a = cluster();
    log.append(a, Expectation::Any, status(0)).await.unwrap();
    // Given a commit published around the log with a body that does not match its hash ...
    let mut forged = Commit::seal(
        a,
        2,
        log.read_aggregate(a).await.unwrap()[0].hash,
        status(1),
    );
    forged.actor = "mallory".into();
    let js = async_nats::jetstream::new(client);
    let subject = log.config().subject_for(&a);
    js.publish(
        subject,
        provledger_events::codec::encode(&forged).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    // ... when read back, then it is quarantined in place, never part of the chain ...
    let history = log.aggregate_history(a).await.unwrap();
    assert!(
        matches!(&history[1], HistoryEntry::Quarantined { position: 2, reason, .. } if reason.starts_with("modified")),
        "{history:?}"
    );
    assert_eq!(log.read_aggregate(a).await.unwrap().len(), 1);
    // ... and the next append is version 2, linked to version 1.
    let next = log
        .append(a, Expectation::Exactly(1), status(2))
        .await
        .unwrap();
    assert_eq!((next.version, next.position), (2, 3));
    let commits = log.read_aggregate(a).await.unwrap();
    assert!(verify_chain(&a, &commits).is_empty());
    // Readers of the whole log see it as outside the chain.
    let mut all = log.read_all(1).await.unwrap();
    let mut outside = Vec::new();
    while let Some(item) = all.next().await {
        if let Err(ReadError::OutsideChain { position, .. }) = item {
            outside.push(position);
        }
    }
    assert_eq!(outside, vec![2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_a_failed_flush_is_fatal_to_the_appends_it_covers_and_to_later_ones() {
    let dir = tempfile::tempdir().unwrap();
    let a = cluster();
    {
        let log = SledLog::open(dir.path()).unwrap();
        log.append(a, Expectation::Any, status(0)).await.unwrap();
        // Given the disk refuses the next flush...
        log.fail_next_flush();
        // ...when an append waits for it, then it is refused, promptly, not acknowledged...
        let refused = tokio::time::timeout(
            Duration::from_secs(5),
            log.append(a, Expectation::Any, status(1)),
        )
        .await
        .expect("a bounded wait");
        assert!(
            matches!(&refused, Err(AppendError::Unavailable { reason }) if reason.contains("flush failed")),
            "{refused:?}"
        );
        // ...and so is every later append, since what is on disk is unknown.
        let later = log.append(a, Expectation::Any, status(2)).await;
        assert!(
            matches!(later, Err(AppendError::Unavailable { .. })),
            "{later:?}"
        );
        log.close();
    }
    // Reopened, the log works again from what is durable.
    let log = SledLog::open(dir.path()).unwrap();
    let next = log.append(a, Expectation::Any, status(3)).await.unwrap();
    assert!(next.version >= 2, "{next:?}");
    assert!(verify_chain(&a, &log.read_aggregate(a).await.unwrap()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_data_dir_is_locked_against_a_second_opener() {
    let dir = tempfile::tempdir().unwrap();
    let log = SledLog::open(dir.path()).unwrap();
    match SledLog::open(dir.path()) {
        Err(e @ provledger_events::log::OpenSledError::Locked { .. }) => {
            assert!(e.to_string().contains("locked"), "{e}");
            assert!(
                e.to_string().contains(&std::process::id().to_string()),
                "names the holder: {e}"
            );
        }
        Err(other) => panic!("expected Locked, got {other}"),
        Ok(_) => panic!("expected Locked, got a second handle"),
    }
    log.close();
    SledLog::open(dir.path()).expect("lock released on close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_closed_right_after_atomic_writes_opens_again_at_once() {
    // Given a log whose atomic sets go through the group commit, whose committer task holds
    // a clone of the log until it finds its queue empty, a moment after it answered...
    let dir = tempfile::tempdir().unwrap();
    for round in 0..40 {
        let log = SledLog::open(dir.path()).unwrap_or_else(|e| panic!("round {round}: {e}"));
        let sets = (0..4).map(|n| {
            let log = log.clone();
            async move {
                let (a, b) = (cluster(), cluster());
                log.append_atomic(vec![
                    item(a, Expectation::NoStream, status(n)),
                    item(b, Expectation::NoStream, status(n)),
                ])
                .await
                .unwrap()
            }
        });
        futures::future::join_all(sets).await;
        // ...when it is closed as soon as the last set is answered, and opened again (the
        // demo reads its data dir back so)...
        log.close();
    }
    // ...then every open found the data dir free, waiting for the committer if need be,
    // and the log holds every round's commits.
    let log = SledLog::open(dir.path()).unwrap();
    assert_eq!(log.last_position().await.unwrap(), 40 * 4 * 2);
    log.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_whose_sled_file_a_closing_handle_still_holds_opens_once_it_lets_go() {
    // Given a data dir closed a moment ago, whose sled `db` file is still locked as sled's
    // thread pool keeps it after the last handle is dropped (held here for 300 ms)...
    let dir = tempfile::tempdir().unwrap();
    let log = SledLog::open(dir.path()).unwrap();
    log.append(
        AggregateId::cluster(Uuid::now_v7()),
        Expectation::NoStream,
        status(1),
    )
    .await
    .unwrap();
    log.close();
    let db_file = std::fs::File::open(dir.path().join("sled").join("db")).unwrap();
    db_file.lock().unwrap();
    let lingering = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(db_file);
    });

    // ...when the data dir is opened again at once...
    let opened = tokio::task::spawn_blocking({
        let dir = dir.path().to_path_buf();
        move || SledLog::open(dir)
    })
    .await
    .unwrap();

    // ...then the open waits for sled's lock instead of failing with "could not acquire
    // lock", and the log is whole.
    let log = opened.expect("opens once sled's lock is let go");
    lingering.join().unwrap();
    assert_eq!(log.last_position().await.unwrap(), 1);
    log.close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sled_group_commit_shares_flushes_between_concurrent_appends() {
    let dir = tempfile::tempdir().unwrap();
    let log = SledLog::open(dir.path()).unwrap();
    let before = log.flush_count();
    let mut tasks = Vec::new();
    for w in 0..32 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..20 {
                log.append(cluster(), Expectation::NoStream, status(w * 100 + n))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let flushes = log.flush_count() - before;
    assert!(flushes > 0);
    assert!(
        flushes < 640,
        "640 appends must not cost 640 flushes, took {flushes}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_retry_after_the_duplicate_window_is_still_idempotent() {
    let server = NatsServer::start().await;
    let config = JetStreamConfig {
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    };
    let log = JetStreamLog::open(server.client().await, config)
        .await
        .unwrap();
    let a = cluster();
    let draft = status(0);
    let first = log
        .append(a, Expectation::NoStream, draft.clone())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    for expect in [
        Expectation::NoStream,
        Expectation::Any,
        Expectation::Exactly(0),
    ] {
        let retry = log.append(a, expect, draft.clone()).await.unwrap();
        assert_eq!(retry.status, AppendStatus::AlreadyAppended, "{expect}");
        assert_eq!(retry.position, first.position);
    }
    assert_eq!(
        log.read_aggregate(a).await.unwrap().len(),
        1,
        "no second copy written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_refuses_a_stream_with_the_wrong_settings() {
    let server = NatsServer::start().await;
    let js = async_nats::jetstream::new(server.client().await);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "PROVLEDGER".into(),
        subjects: vec!["provledger.ev.>".into()],
        deny_delete: true,
        storage: async_nats::jetstream::stream::StorageType::File,
        deny_purge: false,
        allow_direct: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let err = match JetStreamLog::open(server.client().await, JetStreamConfig::default()).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a purgeable stream must be refused"),
    };
    assert!(
        err.contains("deny_purge = false"),
        "names the wrong setting: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_refuses_a_stream_that_also_captures_other_subjects() {
    // Given the stream with one more subject than the events'...
    let server = NatsServer::start().await;
    let js = async_nats::jetstream::new(server.client().await);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "PROVLEDGER".into(),
        subjects: vec!["provledger.ev.>".into(), "provledger.other.>".into()],
        deny_delete: true,
        deny_purge: true,
        allow_direct: true,
        storage: async_nats::jetstream::stream::StorageType::File,
        ..Default::default()
    })
    .await
    .unwrap();
    // ...opening it is refused, naming the subjects.
    let err = match JetStreamLog::open(server.client().await, JetStreamConfig::default()).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a stream capturing other subjects must be refused"),
    };
    assert!(err.contains("subjects"), "names the setting: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_garbage_on_an_event_subject_is_a_typed_error_and_the_read_goes_on() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    let log = JetStreamLog::open(client.clone(), JetStreamConfig::default())
        .await
        .unwrap();
    let a = cluster();
    log.append(a, Expectation::Any, status(0)).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let garbage_subject = log.config().subject_for(&cluster());
    js.publish(
        garbage_subject,
        bytes::Bytes::from_static(b"\x01\xff\xff garbage"),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    log.append(a, Expectation::Any, status(1)).await.unwrap();
    let mut s = log.read_all(1).await.unwrap();
    let mut kinds = Vec::new();
    while let Some(item) = s.next().await {
        kinds.push(match item {
            Ok(c) => format!("ok@{}", c.position),
            Err(provledger_events::ReadError::Undecodable { position, .. }) => {
                format!("bad@{position}")
            }
            Err(e) => panic!("{e}"),
        });
    }
    assert_eq!(kinds, vec!["ok@1", "bad@2", "ok@3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_atomic_batches_beyond_the_servers_in_flight_limit_wait_their_turn() {
    // Given 60 writer processes' logs on one stream (each has one group write in flight),
    // together opening more atomic batches at once than the server lets one stream have in
    // flight (50 by default); under load a log opens its batch without waiting for the
    // server, so an opening the server turns away is learnt only at the batch's commit...
    let server = NatsServer::start().await;
    let mut logs = Vec::new();
    for _ in 0..60 {
        logs.push(open_jetstream(&server).await);
    }
    let (writers, rounds) = (4, 6);
    // ...when each log's writers append two fresh clusters per set, round after round...
    let results = futures::future::join_all(logs.iter().flat_map(|log| {
        (0..writers).map(move |_| async move {
            let mut refused = Vec::new();
            for _ in 0..rounds {
                let batch = vec![
                    item(cluster(), Expectation::NoStream, status(0)),
                    item(cluster(), Expectation::NoStream, status(1)),
                ];
                if let Err(e) = log.append_atomic(batch).await {
                    refused.push(e.to_string());
                }
            }
            refused
        })
    }))
    .await;
    // ...then none is refused: a batch the server turned away (answered, or found unknown
    // at its commit) is sent again, and every one is stored.
    let refused: Vec<String> = results.into_iter().flatten().collect();
    assert!(
        refused.is_empty(),
        "{} refused, first: {:?}",
        refused.len(),
        refused.first()
    );
    assert_eq!(
        logs[0].last_position().await.unwrap(),
        (logs.len() * writers * rounds * 2) as u64
    );
    let opened_early: u64 = logs.iter().map(|l| l.group_stats().opened_early).sum();
    assert_eq!(
        opened_early > 0,
        opens_early(&logs[0]),
        "batches opened under load"
    );
}

/// Sends message `sequence` of atomic batch `id` on `subject` as a request: the answer.
async fn raw_batch_message(
    raw: &async_nats::Client,
    subject: &str,
    id: &str,
    sequence: &str,
) -> async_nats::Message {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Batch-Id", id);
    headers.insert("Nats-Batch-Sequence", sequence);
    raw.request_with_headers(subject.to_string(), headers, "held".into())
        .await
        .unwrap()
}

/// Opens `count` atomic batches on `subject` that another client never commits, each with
/// an answered opening: the batch ids the server took (it may turn some away).
async fn hold_batches(raw: &async_nats::Client, subject: &str, count: usize) -> Vec<String> {
    let mut held = Vec::new();
    // An opening refused (a batch of the log's was in flight) is tried again until all are
    // held, or the log would still find a slot free.
    for _ in 0..20 * count {
        if held.len() == count {
            break;
        }
        let id = Uuid::new_v4().to_string();
        // An empty answer opened the batch; a refusal names why (too many in flight).
        if raw_batch_message(raw, subject, &id, "1")
            .await
            .payload
            .is_empty()
        {
            held.push(id);
        }
    }
    held
}

/// Abandons batches opened by [`hold_batches`]: a gap in each makes the server drop it,
/// nothing of it stored.
async fn release_batches(raw: &async_nats::Client, subject: &str, held: Vec<String>) {
    for id in held {
        let reply = raw_batch_message(raw, subject, &id, "3").await;
        assert!(!reply.payload.is_empty(), "a gapped batch is refused");
    }
}

/// Given a log under load (16 writers appending atomic sets in a closed loop, so that its
/// batches open before their last sets come, their opening unanswered), when another client
/// holds every atomic batch the stream may have in flight, again and again: a batch whose
/// opening the server turned away unseen is found unknown at its commit and sent again, and
/// every set lands whole, none refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_batch_opened_early_and_turned_away_is_sent_again() {
    let server = NatsServer::start().await;
    let log = open_jetstream(&server).await;
    if !opens_early(&log) {
        // Nothing opens early to be turned away (the suite's pinned server does).
        eprintln!("nats-server {} opens no batch early", log.server_version());
        return;
    }
    let raw = server.client().await;
    let hog = JetStreamConfig::default().subject_for(&cluster());
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..16)
        .map(|_| {
            let (log, stop) = (log.clone(), stop.clone());
            tokio::spawn(async move {
                let mut landed = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let items = vec![
                        item(cluster(), Expectation::NoStream, status(0)),
                        item(cluster(), Expectation::NoStream, status(1)),
                    ];
                    let answer = log.append_atomic(items.clone()).await;
                    assert!(answer.is_ok(), "a set was refused: {answer:?}");
                    landed.push(items);
                }
                landed
            })
        })
        .collect();
    let mut held_at_once = 0;
    // Rounds until one turned-away batch is sent again (up to 30 s: on a loaded machine a
    // round's hold can miss every writer's open, so the count is not fixed).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if log.group_stats().sent_again > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        let held = hold_batches(&raw, &hog, 50).await;
        held_at_once = held_at_once.max(held.len());
        tokio::time::sleep(Duration::from_millis(60)).await;
        release_batches(&raw, &hog, held).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut landed = Vec::new();
    for w in writers {
        landed.extend(w.await.unwrap());
    }
    let stats = log.group_stats();
    assert_eq!(
        held_at_once, 50,
        "the other client held {held_at_once} batches"
    );
    assert!(
        stats.sent_again > 0,
        "no batch opened early was turned away: {stats:?}"
    );
    // Every set whole: each aggregate holds its one commit, and nothing else was stored
    // (read independently, in one pass over the stream).
    let mut commits: std::collections::HashMap<AggregateId, usize> = Default::default();
    for c in read_all(&log, 1).await {
        *commits.entry(c.aggregate).or_default() += 1;
    }
    assert_eq!(commits.len(), 2 * landed.len(), "aggregates stored");
    for i in landed.iter().flatten() {
        assert_eq!(commits.get(&i.aggregate), Some(&1), "{}", i.aggregate);
    }
}

/// Given a log under load (16 writers in a closed loop, each on its own pair of clusters,
/// expecting each version exactly, so that the log's batches open before their last sets
/// come), when another process writes one writer's first cluster behind the log's cached
/// head: the server refuses the batch holding that set, that set alone is refused naming
/// the moved cluster, and every other set lands whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_batch_opened_early_and_refused_for_a_moved_subject_lands_the_others() {
    let server = NatsServer::start().await;
    let (ours, theirs) = (open_jetstream(&server).await, open_jetstream(&server).await);
    let (rounds, moved, moved_at) = (12u64, 5usize, 6u64);
    let pairs = closed_loop_pairs(&ours).await;
    let before = ours.group_stats();
    let answers = futures::future::join_all(pairs.iter().enumerate().map(|(w, &(a, b))| {
        let (ours, theirs) = (ours.clone(), theirs.clone());
        tokio::spawn(async move {
            for round in 0..rounds {
                let version = round + 1;
                if w == moved && round == moved_at {
                    theirs
                        .append(a, Expectation::Exactly(version), status(900))
                        .await
                        .unwrap();
                }
                let items = vec![
                    item(a, Expectation::Exactly(version), status(w)),
                    item(b, Expectation::Exactly(version), status(w)),
                ];
                if let Err(e) = ours.append_atomic(items).await {
                    return Err((round, e));
                }
            }
            Ok(())
        })
    }))
    .await;
    opened_early_where_the_server_can(&ours, &before);
    for (w, answer) in answers.into_iter().enumerate() {
        let (a, b) = pairs[w];
        let (a_len, b_len) = (
            theirs.read_aggregate(a).await.unwrap().len() as u64,
            theirs.read_aggregate(b).await.unwrap().len() as u64,
        );
        match (w == moved, answer.unwrap()) {
            (true, Err((round, AppendError::Conflicts { conflicts }))) => {
                assert_eq!(round, moved_at);
                assert_eq!(conflicts.len(), 1);
                assert_eq!(conflicts[0].aggregate, a);
                assert_eq!(conflicts[0].actual, moved_at + 2);
                // The refused set left nothing: the other process's commit on a, none on b.
                assert_eq!((a_len, b_len), (moved_at + 2, moved_at + 1));
            }
            (false, Ok(())) => assert_eq!((a_len, b_len), (rounds + 1, rounds + 1)),
            (is_moved, other) => panic!("writer {w} (moved: {is_moved}) ended {other:?}"),
        }
    }
}

/// Given a log under load (16 writers in a closed loop, so that its batches open before
/// their last sets come), when 4 writers each send a set that another process already
/// appended with the same commit ids (a retry through another replica): the server refuses
/// the batch holding it for a duplicate id, the retried set is answered as already
/// appended and stays written once, and every other set lands whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_batch_opened_early_and_refused_for_a_duplicate_id_lands_the_others() {
    let server = NatsServer::start().await;
    let (ours, theirs) = (open_jetstream(&server).await, open_jetstream(&server).await);
    let rounds = 12u64;
    // Writer w retries through the other process at round `retried_at(w)`, if any.
    let retried_at = |w: usize| (w % 4 == 1).then_some(3 + w as u64 / 4);
    let pairs = closed_loop_pairs(&ours).await;
    let before = ours.group_stats();
    let answers = futures::future::join_all(pairs.iter().enumerate().map(|(w, &(a, b))| {
        let (ours, theirs) = (ours.clone(), theirs.clone());
        tokio::spawn(async move {
            let mut retried = None;
            for round in 0..rounds {
                let version = round + 1;
                let items = vec![
                    item(a, Expectation::Exactly(version), status(w)),
                    item(b, Expectation::Exactly(version), status(w)),
                ];
                if retried_at(w) == Some(round) {
                    theirs.append_atomic(items.clone()).await.unwrap();
                }
                match ours.append_atomic(items).await {
                    Ok(outcomes) if retried_at(w) == Some(round) => retried = Some(outcomes),
                    Ok(_) => {}
                    Err(e) => return Err((round, e)),
                }
            }
            Ok(retried)
        })
    }))
    .await;
    opened_early_where_the_server_can(&ours, &before);
    for (w, answer) in answers.into_iter().enumerate() {
        let (a, b) = pairs[w];
        let retried = match answer.unwrap() {
            Ok(retried) => retried,
            Err((round, e)) => panic!("writer {w} refused at round {round}: {e:?}"),
        };
        if let Some(outcomes) = retried {
            let statuses: Vec<_> = outcomes.iter().map(|o| o.status).collect();
            assert_eq!(
                statuses,
                [AppendStatus::AlreadyAppended, AppendStatus::AlreadyAppended],
                "writer {w}'s retried set"
            );
        } else {
            assert_eq!(retried_at(w), None, "writer {w}'s retry went unanswered");
        }
        // Every set once, the retried one included: the first commit, then one per round.
        let (a_len, b_len) = (
            theirs.read_aggregate(a).await.unwrap().len() as u64,
            theirs.read_aggregate(b).await.unwrap().len() as u64,
        );
        assert_eq!((a_len, b_len), (rounds + 1, rounds + 1), "writer {w}");
    }
}

/// The 16 writers' pairs of clusters of the closed-loop tests, each written once (version
/// 1) as a set.
async fn closed_loop_pairs(log: &JetStreamLog) -> Vec<(AggregateId, AggregateId)> {
    let mut pairs = Vec::new();
    for n in 0..16 {
        let (a, b) = (cluster(), cluster());
        log.append_atomic(vec![
            item(a, Expectation::NoStream, status(n)),
            item(b, Expectation::NoStream, status(n)),
        ])
        .await
        .unwrap();
        pairs.push((a, b));
    }
    pairs
}

/// Asserts that `log` opened writes early since `before` exactly when its server lets it.
fn opened_early_where_the_server_can(log: &JetStreamLog, before: &GroupStats) {
    let after = log.group_stats();
    assert_eq!(
        after.opened_early > before.opened_early,
        opens_early(log),
        "{after:?}"
    );
}

/// A handle on the server's stream: two of them stand for two processes.
async fn open_jetstream(server: &NatsServer) -> JetStreamLog {
    JetStreamLog::open(server.client().await, JetStreamConfig::default())
        .await
        .unwrap()
}

/// Given sets whose aggregates another process moved after this one cached their heads
/// (so the server, not the heads, refuses them): the group's batch is refused, the moved
/// sets are refused alone on the heads read again, and every other set lands whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_batch_refused_for_one_moved_subject_is_split_and_the_others_land() {
    let server = NatsServer::start().await;
    let (ours, theirs) = (open_jetstream(&server).await, open_jetstream(&server).await);
    let aggregates: Vec<AggregateId> = (0..128).map(|_| cluster()).collect();
    for (n, a) in aggregates.iter().enumerate() {
        ours.append(*a, Expectation::NoStream, status(n))
            .await
            .unwrap();
    }
    // Another process writes version 2 of the first aggregate of every 8th set.
    let moved: BTreeSet<usize> = (0..64).filter(|s| s % 8 == 5).collect();
    for s in &moved {
        theirs
            .append(aggregates[2 * s], Expectation::Exactly(1), status(900))
            .await
            .unwrap();
    }
    // When 64 sets each expect version 1 of both its aggregates, at once.
    let answers = futures::future::join_all((0..64).map(|s| {
        let log = ours.clone();
        let items = vec![
            item(aggregates[2 * s], Expectation::Exactly(1), status(1000 + s)),
            item(
                aggregates[2 * s + 1],
                Expectation::Exactly(1),
                status(2000 + s),
            ),
        ];
        tokio::spawn(async move { log.append_atomic(items).await })
    }))
    .await;
    // Then exactly the moved sets are refused, naming version 2, and the rest land whole.
    for (s, answer) in answers.into_iter().enumerate() {
        let answer = answer.unwrap();
        let mut versions = Vec::new();
        for i in [2 * s, 2 * s + 1] {
            versions.push(theirs.read_aggregate(aggregates[i]).await.unwrap().len());
        }
        if moved.contains(&s) {
            match answer {
                Err(AppendError::Conflicts { conflicts }) => {
                    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
                    assert_eq!(conflicts[0].actual, 2);
                }
                other => panic!("moved set {s} answered {other:?}"),
            }
            assert_eq!(versions, vec![2, 1], "set {s} written in part");
        } else {
            assert!(answer.is_ok(), "set {s}: {answer:?}");
            assert_eq!(versions, vec![2, 2], "set {s} not written whole");
        }
    }
    assert!(ours.group_stats().writes < ours.group_stats().sets);
}

/// Given a commit another handle wrote with this draft (as this handle's own attempt whose
/// ack was lost would be) after this handle cached the head: this handle's append of the
/// same draft is refused by the server for its expected sequence (a one-replica stream
/// checks it before the message id), and is answered as already appended, not a conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_retry_the_server_refuses_for_its_sequence_is_recognised() {
    let server = NatsServer::start().await;
    let (ours, theirs) = (open_jetstream(&server).await, open_jetstream(&server).await);
    let a = cluster();
    ours.append(a, Expectation::NoStream, status(0))
        .await
        .unwrap();
    let draft = status(1);
    let first = theirs
        .append(a, Expectation::Exactly(1), draft.clone())
        .await
        .unwrap();
    let again = ours
        .append(a, Expectation::Exactly(1), draft)
        .await
        .unwrap();
    assert_eq!(again.status, AppendStatus::AlreadyAppended);
    assert_eq!((again.position, again.version), (first.position, 2));
    // And the same for an atomic set.
    let b = cluster();
    ours.append(b, Expectation::NoStream, status(2))
        .await
        .unwrap();
    let set = vec![
        item(b, Expectation::Exactly(1), status(3)),
        item(cluster(), Expectation::NoStream, status(4)),
    ];
    let written = theirs.append_atomic(set.clone()).await.unwrap();
    let recognised = ours.append_atomic(set).await.unwrap();
    assert!(recognised
        .iter()
        .all(|o| o.status == AppendStatus::AlreadyAppended));
    assert_eq!(recognised[0].position, written[0].position);
}

/// Given a replay of an aggregate's first commit published onto its subject after this
/// handle cached the head: the next append at the right version lands (the replay is
/// outside the chain, never a conflict).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_replayed_commit_on_the_subject_is_never_taken_for_a_conflict() {
    let server = NatsServer::start().await;
    let log = open_jetstream(&server).await;
    let a = cluster();
    for v in 0..3u64 {
        log.append(a, Expectation::Exactly(v), status(v as usize))
            .await
            .unwrap();
    }
    let first = log.read_aggregate(a).await.unwrap().remove(0);
    let replay = || async {
        let bytes = provledger_events::codec::encode(&first).unwrap();
        let js = async_nats::jetstream::new(server.client().await);
        let ack = js.publish(log.config().subject_for(&a), bytes.into());
        ack.await.unwrap().await.unwrap();
    };
    replay().await;
    let next = log
        .append(a, Expectation::Exactly(3), status(3))
        .await
        .unwrap();
    assert_eq!(next.version, 4);
    // And an atomic set through the same handle.
    replay().await;
    let set = vec![
        item(a, Expectation::Exactly(4), status(4)),
        item(cluster(), Expectation::NoStream, status(5)),
    ];
    assert_eq!(log.append_atomic(set).await.unwrap()[0].version, 5);
}
