//! The one write path against a real sled log behind a lossy transport: given an append
//! whose ack is lost, when the write is retried, then the commit is there once.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use provledger_client::write::{
    Fact, FromTheLog, RecordError, Recorded, Writer, RECENT_COMMITS_MAX, UNAVAILABLE_RETRIES_MAX,
};
use provledger_events::catalogue::{samples, ConsumerKind, Inventory, Ratio};
use provledger_events::{
    AggregateId, AppendError, AppendOutcome, AppendStatus, ChainTip, Commit, CommitDraft,
    CommitStream, Event, EventLog, Expectation, ReadError, SledLog, Timestamp,
};
use provledger_projections::Entity;
use uuid::Uuid;

/// A log whose next `lose` appends are durable but answer `Unavailable`, as when the ack
/// of a publish is lost on the way back; or, when `down`, refuses every append before
/// writing anything. `attempts` counts the appends tried.
#[derive(Clone)]
struct LostAcks {
    inner: SledLog,
    lose: Arc<AtomicUsize>,
    down: Arc<std::sync::atomic::AtomicBool>,
    attempts: Arc<AtomicUsize>,
    /// Commits handed to readers (whole reads and tail reads).
    commits_read: Arc<AtomicUsize>,
}

impl LostAcks {
    fn open(dir: &std::path::Path) -> Self {
        LostAcks {
            inner: SledLog::open(dir).unwrap(),
            lose: Arc::default(),
            down: Arc::default(),
            attempts: Arc::default(),
            commits_read: Arc::default(),
        }
    }
}

impl LostAcks {
    /// Counts the attempt; refuses it while the log is down.
    fn before_append(&self) -> Result<(), AppendError> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(AppendError::Unavailable {
                reason: "down".into(),
            });
        }
        Ok(())
    }

    /// Loses the answer to a write that landed, while acks are to be lost.
    fn after_append(&self) -> Result<(), AppendError> {
        let lost = self
            .lose
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lost {
            return Err(AppendError::Unavailable {
                reason: "ack lost".into(),
            });
        }
        Ok(())
    }
}

impl EventLog for LostAcks {
    async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        self.before_append()?;
        let outcome = self.inner.append(aggregate, expect, draft).await?;
        self.after_append()?;
        Ok(outcome)
    }

    /// The same faults for a set written together: down refuses it, a lost ack loses the
    /// answer to all of it.
    async fn append_atomic(
        &self,
        items: Vec<provledger_events::AtomicItem>,
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        self.before_append()?;
        let outcomes = self.inner.append_atomic(items).await?;
        self.after_append()?;
        Ok(outcomes)
    }

    async fn read_aggregate(&self, aggregate: AggregateId) -> Result<Vec<Commit>, ReadError> {
        let commits = self.inner.read_aggregate(aggregate).await?;
        self.commits_read.fetch_add(commits.len(), Ordering::SeqCst);
        Ok(commits)
    }

    async fn read_aggregate_after(
        &self,
        aggregate: AggregateId,
        after: provledger_events::ChainTip,
    ) -> Result<Vec<Commit>, ReadError> {
        let commits = self.inner.read_aggregate_after(aggregate, after).await?;
        self.commits_read.fetch_add(commits.len(), Ordering::SeqCst);
        Ok(commits)
    }

    async fn read_all(&self, from: u64) -> Result<CommitStream, ReadError> {
        self.inner.read_all(from).await
    }

    async fn subscribe(&self, from: u64) -> Result<CommitStream, ReadError> {
        self.inner.subscribe(from).await
    }

    async fn last_position(&self) -> Result<u64, ReadError> {
        self.inner.last_position().await
    }
}

fn draft(n: u128, events: Vec<Event>) -> CommitDraft {
    CommitDraft {
        trace: None,
        commit_id: Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0000 | n),
        operation_id: None,
        causation_id: None,
        actor: "test".into(),
        recorded_at: Timestamp::from_unix_ms(1_800_000_000_000),
        events,
    }
}

async fn provider_with_capacity(writer: &Writer<LostAcks>, provider: AggregateId) {
    let events = provledger_tests::workload::provider_on("cn1", 8);
    writer
        .record(provider, Expectation::NoStream, draft(1, events))
        .await
        .expect("provider");
}

fn claim(consumer: Uuid) -> Event {
    Event::AllocationClaimed {
        consumer,
        consumer_kind: ConsumerKind::Instance,
        resources: BTreeMap::from([("VCPU".to_string(), 2)]),
    }
}

#[tokio::test]
async fn a_claim_whose_ack_is_lost_is_recorded_once_and_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let log = LostAcks::open(dir.path());
    let writer = Writer::new(log.clone());
    let provider = AggregateId::provider(Uuid::from_u128(7));
    provider_with_capacity(&writer, provider).await;
    let consumer = Uuid::from_u128(42);

    // Given the claim's ack is lost once...
    log.lose.store(1, Ordering::SeqCst);
    let recorded = writer
        .record(provider, Expectation::Any, draft(2, vec![claim(consumer)]))
        .await
        .expect("retried with the same commit id");

    // ...then the caller learns it is recorded, and it is recorded once.
    let Recorded::Appended(outcome) = recorded else {
        panic!("{recorded:?}")
    };
    assert_eq!(outcome.status, AppendStatus::AlreadyAppended);
    assert_eq!(outcome.version, 2);
    let commits = log.read_aggregate(provider).await.unwrap();
    assert_eq!(commits.len(), 2, "no second claim commit");
    let Some(Entity::Provider(state)) = Entity::fold(provider, &commits) else {
        panic!("provider")
    };
    assert_eq!(state.usage.get("VCPU"), Some(&2));
    assert!(state.allocations.contains_key(&consumer));
}

#[tokio::test]
async fn a_log_that_stays_unavailable_is_reported_after_the_named_bound() {
    let dir = tempfile::tempdir().unwrap();
    let log = LostAcks::open(dir.path());
    let writer = Writer::new(log.clone());
    let provider = AggregateId::provider(Uuid::from_u128(7));
    provider_with_capacity(&writer, provider).await;
    // Given a log that refuses every append...
    log.down.store(true, Ordering::SeqCst);
    log.attempts.store(0, Ordering::SeqCst);
    let result = writer
        .record(
            provider,
            Expectation::Any,
            draft(10, vec![claim(Uuid::from_u128(100))]),
        )
        .await;
    // ...then the write tries the bound's number of times, reports `Unavailable`, and
    // nothing was written.
    assert!(
        matches!(
            result,
            Err(RecordError::Append(AppendError::Unavailable { .. }))
        ),
        "{result:?}"
    );
    assert_eq!(
        log.attempts.load(Ordering::SeqCst),
        UNAVAILABLE_RETRIES_MAX + 1
    );
    assert_eq!(log.read_aggregate(provider).await.unwrap().len(), 1);
}

pub(super) fn inventory(total: u64) -> Event {
    Event::InventorySet {
        resource_class: "VCPU".into(),
        inventory: Inventory {
            total,
            reserved: 0,
            allocation_ratio: Ratio::ONE,
            min_unit: 1,
            max_unit: 8,
            step_size: 1,
        },
    }
}

#[tokio::test]
async fn a_write_reads_only_what_is_new_however_long_the_aggregate() {
    // Given a provider with 500 commits, written through this process,
    let dir = tempfile::tempdir().unwrap();
    let log = LostAcks::open(dir.path());
    let writer = Writer::new(log.clone());
    let provider = AggregateId::provider(Uuid::now_v7());
    provider_with_capacity(&writer, provider).await;
    for n in 0..500u128 {
        let d = draft(1_000 + n, vec![inventory(8 + (n as u64 % 2))]);
        writer
            .record(provider, Expectation::Any, d)
            .await
            .expect("deepen");
    }
    // when 100 more writes are decided, then none reads a commit: each decides on the
    // state this process keeps and appends at exactly its version,
    log.commits_read.store(0, Ordering::SeqCst);
    for n in 0..100u64 {
        let d = draft(2_000 + u128::from(n), vec![inventory(8 + n % 2)]);
        let expect = match n % 2 {
            0 => Expectation::Any,
            _ => Expectation::Exactly(501 + n),
        };
        let recorded = writer.record(provider, expect, d).await.expect("write");
        assert_eq!(recorded.version(), 502 + n);
    }
    assert_eq!(log.commits_read.load(Ordering::SeqCst), 0);
    // and a commit another process appended is read alone (the tail), then decided on.
    let version = log.inner.read_aggregate(provider).await.unwrap().len() as u64;
    log.inner
        .append(
            provider,
            Expectation::Exactly(version),
            draft(3_000, vec![inventory(8)]),
        )
        .await
        .expect("another writer");
    log.commits_read.store(0, Ordering::SeqCst);
    let recorded = writer
        .record(provider, Expectation::Any, draft(3_001, vec![inventory(9)]))
        .await
        .expect("decided after the other writer");
    assert_eq!(recorded.version(), version + 2);
    assert_eq!(log.commits_read.load(Ordering::SeqCst), 1);
}

/// Another process's appends to `provider`, at each version of `versions`.
async fn another_process_deepens(
    log: &SledLog,
    provider: AggregateId,
    versions: std::ops::Range<u64>,
    ids_from: u128,
) {
    for v in versions {
        let d = draft(ids_from + u128::from(v), vec![inventory(8 + v % 2)]);
        log.append(provider, Expectation::Exactly(v), d)
            .await
            .expect("another writer");
    }
}

#[tokio::test]
async fn a_kept_state_older_than_the_one_folded_elsewhere_is_read_before_the_append() {
    // Given a provider this process wrote to version 2, which another process then took to
    // version 50, as a fold of the same log in this process (serve's projector) says...
    let dir = tempfile::tempdir().unwrap();
    let log = LostAcks::open(dir.path());
    let writer = Writer::new(log.clone());
    let provider = AggregateId::provider(Uuid::now_v7());
    provider_with_capacity(&writer, provider).await;
    writer
        .record(provider, Expectation::Any, draft(10, vec![inventory(9)]))
        .await
        .expect("v2");
    another_process_deepens(&log.inner, provider, 2..50, 100).await;
    let folded = ChainTip {
        version: 50,
        ..ChainTip::EMPTY
    };
    writer.folded_versions().folded([(provider, folded)]);
    log.attempts.store(0, Ordering::SeqCst);

    // ...when this process writes to it again...
    let recorded = writer
        .record(provider, Expectation::Any, draft(200, vec![inventory(7)]))
        .await
        .expect("write");

    // ...then it reads the new commits first and appends once, at version 51: no append
    // decided on the kept state is refused.
    assert_eq!(recorded.version(), 51);
    assert_eq!(log.attempts.load(Ordering::SeqCst), 1);
    assert_eq!(writer.races_lost(), 0);
    // And without that hint, the same situation costs a refused append.
    another_process_deepens(&log.inner, provider, 51..60, 300).await;
    let recorded = writer
        .record(provider, Expectation::Any, draft(400, vec![inventory(7)]))
        .await
        .expect("write");
    assert_eq!(recorded.version(), 61);
    assert_eq!(writer.races_lost(), 1);
}

fn fact(aggregate: AggregateId, expect: Expectation, draft: CommitDraft) -> Fact {
    Fact {
        aggregate,
        expect,
        draft,
    }
}

fn status(n: usize) -> Vec<Event> {
    vec![Event::ClusterStatusChanged {
        status: provledger_events::catalogue::ClusterStatus::Active,
        description: format!("#{n}"),
    }]
}

#[tokio::test]
async fn an_atomic_retry_past_the_kept_commits_is_recognised_not_refused() {
    // Given two clusters written together at versions 1,
    let dir = tempfile::tempdir().unwrap();
    let log = LostAcks::open(dir.path());
    let writer = Writer::new(log.clone());
    let (a, b) = (
        AggregateId::cluster(Uuid::now_v7()),
        AggregateId::cluster(Uuid::now_v7()),
    );
    let create = samples::all().remove(0);
    let facts = vec![
        fact(a, Expectation::NoStream, draft(10, vec![create.clone()])),
        fact(b, Expectation::NoStream, draft(11, vec![create])),
    ];
    let first = writer
        .record_atomic(facts.clone(), Default::default(), &FromTheLog)
        .await
        .unwrap();
    // and more commits on each than a process keeps the ids of,
    for (k, aggregate) in [a, b].into_iter().enumerate() {
        for n in 0..RECENT_COMMITS_MAX + 30 {
            let id = 1_000 * (k as u128 + 1) + n as u128;
            writer
                .record(aggregate, Expectation::Any, draft(id, status(n)))
                .await
                .unwrap();
        }
    }
    // when the same set is sent again (its answer was lost), expecting what was true then,
    let again = writer
        .record_atomic(facts, Default::default(), &FromTheLog)
        .await
        .expect("recognised, not a conflict");
    // then each fact answers its first position, already appended.
    for (then, now) in first.iter().zip(&again) {
        let (then, now) = (then.appended().unwrap(), now.appended().unwrap());
        assert_eq!(now.position, then.position);
        assert_eq!(now.status, AppendStatus::AlreadyAppended);
    }
}

#[tokio::test]
async fn an_already_true_fact_beside_a_claim_whose_ack_is_lost_answers_already_done() {
    // Given a provider and an instance already being deleted,
    let dir = tempfile::tempdir().unwrap();
    let log = LostAcks::open(dir.path());
    let writer = Writer::new(log.clone());
    let provider = AggregateId::provider(Uuid::now_v7());
    provider_with_capacity(&writer, provider).await;
    let vm = AggregateId::instance(Uuid::now_v7());
    let delete = Event::InstanceDeleteRequested {
        reason: "user".into(),
    };
    let create = samples::all()
        .into_iter()
        .find(|e| matches!(e, Event::InstanceCreateRequested { .. }))
        .unwrap();
    writer
        .record(vm, Expectation::NoStream, draft(20, vec![create]))
        .await
        .unwrap();
    writer
        .record(vm, Expectation::Any, draft(21, vec![delete.clone()]))
        .await
        .unwrap();
    // when a set holding that delete request again and a claim loses its ack once,
    log.lose.store(1, Ordering::SeqCst);
    let facts = vec![
        fact(vm, Expectation::Any, draft(22, vec![delete])),
        fact(provider, Expectation::Any, draft(23, vec![claim(vm.id)])),
    ];
    let answers = writer
        .record_atomic(facts, Default::default(), &FromTheLog)
        .await
        .expect("no CommitIdReused for the fact left out");
    // then the delete answers already done and the claim is written once.
    assert!(
        matches!(answers[0], Recorded::AlreadyDone { .. }),
        "{answers:?}"
    );
    let claims = log
        .read_aggregate(provider)
        .await
        .unwrap()
        .iter()
        .filter(|c| matches!(c.events[0], Event::AllocationClaimed { .. }))
        .count();
    assert_eq!(claims, 1);
}
