//! The provider cascade against a real sled log, with the process "crashing" between the
//! releases and the delete: nothing is orphaned, a claim cannot slip in, and a re-run
//! finishes the job.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use provledger_client::placement::{delete_provider, LogView, ProviderDeletion};
use provledger_client::write::RecordError;
use provledger_client::Stamper;
use provledger_client::Writer;
use provledger_events::catalogue::ConsumerKind;
use provledger_events::{
    AggregateId, AppendError, AppendOutcome, Commit, CommitDraft, CommitStream, Event, EventLog,
    Expectation, ReadError, SledLog,
};
use provledger_projections::Entity;
use uuid::Uuid;

/// A log whose process dies before it can append `provider_deleted`: every such append
/// fails, as long as `dead` is set.
#[derive(Clone)]
struct DiesBeforeDelete {
    inner: SledLog,
    dead: Arc<AtomicBool>,
}

impl EventLog for DiesBeforeDelete {
    async fn append(
        &self,
        aggregate: AggregateId,
        expect: Expectation,
        draft: CommitDraft,
    ) -> Result<AppendOutcome, AppendError> {
        let deleting = draft
            .events
            .iter()
            .any(|e| matches!(e, Event::ProviderDeleted {}));
        if deleting && self.dead.load(Ordering::SeqCst) {
            return Err(AppendError::Unavailable {
                reason: "the process died".into(),
            });
        }
        self.inner.append(aggregate, expect, draft).await
    }
    async fn append_atomic(
        &self,
        items: Vec<provledger_events::AtomicItem>,
    ) -> Result<Vec<AppendOutcome>, AppendError> {
        let deleting = items.iter().any(|i| {
            i.draft
                .events
                .iter()
                .any(|e| matches!(e, Event::ProviderDeleted {}))
        });
        if deleting && self.dead.load(Ordering::SeqCst) {
            return Err(AppendError::Unavailable {
                reason: "the process died".into(),
            });
        }
        self.inner.append_atomic(items).await
    }
    async fn read_aggregate(&self, aggregate: AggregateId) -> Result<Vec<Commit>, ReadError> {
        self.inner.read_aggregate(aggregate).await
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

fn claim(consumer: Uuid, n: u64) -> Vec<Event> {
    vec![Event::AllocationClaimed {
        consumer,
        consumer_kind: ConsumerKind::Instance,
        resources: BTreeMap::from([("VCPU".to_string(), n)]),
    }]
}

async fn provider_state(
    log: &Writer<DiesBeforeDelete>,
    p: AggregateId,
) -> provledger_projections::provider::ProviderState {
    match Entity::fold(p, &log.log().read_aggregate(p).await.unwrap()) {
        Some(Entity::Provider(s)) => *s,
        other => panic!("{other:?}"),
    }
}

/// A provider on host `cn` with `total` VCPU.
fn provider_with_vcpus(total: u64) -> Vec<Event> {
    provledger_tests::workload::provider_on("cn", total)
}

/// A provider on a dying log, with `allocations` claims of 1 VCPU.
async fn provider_holding(
    log: &Writer<DiesBeforeDelete>,
    allocations: usize,
    stamper: &Stamper,
) -> (Uuid, AggregateId) {
    let provider = Uuid::now_v7();
    let p = AggregateId::provider(provider);
    let register = provider_with_vcpus(allocations as u64 + 8);
    log.record(p, Expectation::NoStream, stamper.draft("t", register))
        .await
        .unwrap();
    for _ in 0..allocations {
        log.record(
            p,
            Expectation::Any,
            stamper.draft("t", claim(Uuid::now_v7(), 1)),
        )
        .await
        .unwrap();
    }
    (provider, p)
}

/// Every release written on `p`, by consumer.
async fn releases(log: &Writer<DiesBeforeDelete>, p: AggregateId) -> BTreeMap<Uuid, Vec<String>> {
    let mut by_consumer: BTreeMap<Uuid, Vec<String>> = BTreeMap::new();
    for c in log.log().read_aggregate(p).await.unwrap() {
        for e in c.events {
            if let Event::AllocationReleased { consumer, reason } = e {
                by_consumer.entry(consumer).or_default().push(reason);
            }
        }
    }
    by_consumer
}

#[tokio::test]
async fn a_cascade_that_dies_writes_all_of_a_commit_or_none_and_is_finished_by_whoever_finds_it() {
    use provledger_client::placement::finish_provider_deletes;
    use provledger_projections::facts::CASCADE_RELEASES_PER_COMMIT;
    use provledger_projections::provider::ProviderStatus;
    let dir = tempfile::tempdir().unwrap();
    let log = Writer::new(DiesBeforeDelete {
        inner: SledLog::open(dir.path()).unwrap(),
        dead: Arc::new(AtomicBool::new(true)),
    });
    let stamper = Stamper::system();

    // Given a cascade of a few allocations (one commit) whose process dies writing it...
    let (small, s) = provider_holding(&log, 3, &stamper).await;
    let died = delete_provider(&log, &LogView::new(log.log()), small, true, "t", &stamper).await;
    assert!(died.is_err(), "{died:?}");
    // ...then nothing of it was written: still active, holding its three allocations.
    let state = provider_state(&log, s).await;
    assert_eq!(state.status, Some(ProviderStatus::Active));
    assert_eq!(state.allocations.len(), 3);

    // Given a cascade of more allocations than one commit releases, dying before the
    // commit that deletes the provider...
    let many = CASCADE_RELEASES_PER_COMMIT + 44;
    let (large, l) = provider_holding(&log, many, &stamper).await;
    let died = delete_provider(&log, &LogView::new(log.log()), large, true, "t", &stamper).await;
    assert!(died.is_err(), "{died:?}");
    // ...then nothing is orphaned: the delete is recorded (claims refused), the first
    // commit's allocations released with their reason, the rest still held.
    let state = provider_state(&log, l).await;
    assert_eq!(state.status, Some(ProviderStatus::Deleting));
    assert!(state.deleting_cascade);
    assert_eq!(state.allocations.len(), 44);
    let late = log
        .record(
            l,
            Expectation::Any,
            stamper.draft("t", claim(Uuid::now_v7(), 1)),
        )
        .await;
    assert!(matches!(late, Err(RecordError::Rejected(_))), "{late:?}");
    let first = releases(&log, l).await;
    assert_eq!(first.len(), CASCADE_RELEASES_PER_COMMIT);
    assert!(first.values().flatten().all(|r| r.contains("--cascade")));

    // When, after the restart, serve's sweep finds it half done (no one re-runs it), it
    // finishes it: deleted, every allocation released exactly once.
    log.log().dead.store(false, Ordering::SeqCst);
    let finished = finish_provider_deletes(&log, &LogView::new(log.log()), "sweep", &stamper)
        .await
        .unwrap();
    assert_eq!(finished, vec![large]);
    let state = provider_state(&log, l).await;
    assert_eq!(state.status, Some(ProviderStatus::Deleted));
    assert_eq!(
        state.header.anomaly_count, 0,
        "{:?}",
        state.header.anomalies
    );
    let all = releases(&log, l).await;
    assert_eq!(all.len(), many);
    assert!(
        all.values().all(|r| r.len() == 1),
        "a release written twice"
    );
    // The small one, never recorded as deleting, is left alone by the sweep.
    assert_eq!(
        provider_state(&log, s).await.status,
        Some(ProviderStatus::Active)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_racing_claims_never_deletes_a_provider_that_gained_an_allocation() {
    for round in 0..10 {
        let dir = tempfile::tempdir().unwrap();
        let log = Writer::new(DiesBeforeDelete {
            inner: SledLog::open(dir.path()).unwrap(),
            dead: Arc::new(AtomicBool::new(false)),
        });
        let stamper = Stamper::system();
        let provider = Uuid::now_v7();
        let p = AggregateId::provider(provider);
        let register = provider_with_vcpus(64);
        log.record(p, Expectation::NoStream, stamper.draft("t", register))
            .await
            .unwrap();
        // Given a plain delete and eight claims racing...
        let claims = (0..8).map(|_| {
            let (log, stamper) = (log.clone(), stamper.clone());
            tokio::spawn(async move {
                log.record(
                    p,
                    Expectation::Any,
                    stamper.draft("t", claim(Uuid::now_v7(), 1)),
                )
                .await
                .is_ok()
            })
        });
        let delete = {
            let (log, stamper) = (log.clone(), stamper.clone());
            tokio::spawn(async move {
                delete_provider(
                    &log,
                    &LogView::new(log.log()),
                    provider,
                    false,
                    "t",
                    &stamper,
                )
                .await
            })
        };
        let acknowledged = futures::future::join_all(claims)
            .await
            .into_iter()
            .filter(|r| *r.as_ref().unwrap())
            .count();
        let deleted = delete.await.unwrap().unwrap();
        // ...then either the delete won before any claim, or the claims are all held and
        // the provider is not deleted: never an allocation on a deleted provider.
        let state = provider_state(&log, p).await;
        assert_eq!(state.allocations.len(), acknowledged, "round {round}");
        match deleted {
            ProviderDeletion::Deleted { .. } => {
                assert_eq!(
                    acknowledged, 0,
                    "round {round}: claims acknowledged yet deleted"
                );
            }
            ProviderDeletion::Refused { .. } => {
                assert_ne!(
                    state.status,
                    Some(provledger_projections::provider::ProviderStatus::Deleted)
                );
            }
            other => panic!("round {round}: {other:?}"),
        }
        assert_eq!(
            state.header.anomaly_count, 0,
            "{:?}",
            state.header.anomalies
        );
    }
}

#[tokio::test]
async fn a_heal_decided_on_a_stale_view_never_claims_for_an_instance_deleted_since() {
    use provledger_client::placement::heal_allocations;
    use provledger_client::view::StateView;
    // Given a provider and two active instances on it holding no allocation,
    let dir = tempfile::tempdir().unwrap();
    let log = Writer::new(SledLog::open(dir.path()).unwrap());
    let provider = Uuid::now_v7();
    let p = AggregateId::provider(provider);
    let draft = |events| CommitDraft::now("test", events);
    log.record(p, Expectation::NoStream, draft(provider_with_vcpus(8)))
        .await
        .unwrap();
    let (kept, deleted) = (Uuid::now_v7(), Uuid::now_v7());
    for vm in [kept, deleted] {
        log.record(
            AggregateId::instance(vm),
            Expectation::NoStream,
            draft(provledger_tests::workload::instance_running_on(provider)),
        )
        .await
        .unwrap();
    }
    // a view read now (a replica's store that will lag),
    let view = LogView::new(log.log());
    assert_eq!(view.instances().await.unwrap().len(), 2);
    // and one instance deleted after that read,
    log.record(
        AggregateId::instance(deleted),
        Expectation::Any,
        draft(vec![
            Event::InstanceDeleteRequested {
                reason: "user".into(),
            },
            Event::InstanceDeleted {},
        ]),
    )
    .await
    .unwrap();
    // when heal-allocations runs from that view,
    let report = heal_allocations(&log, &view, None, false, "test", &Stamper::system())
        .await
        .unwrap();
    // then only the live instance is claimed for; nothing is claimed for the deleted one.
    let state = match Entity::fold(p, &log.log().read_aggregate(p).await.unwrap()) {
        Some(Entity::Provider(s)) => *s,
        other => panic!("{other:?}"),
    };
    assert!(state.allocations.contains_key(&kept), "{state:?}");
    assert!(!state.allocations.contains_key(&deleted), "{state:?}");
    assert_eq!(report.healed, vec![(kept, provider)]);
    assert_eq!(
        report.failed.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        vec![deleted]
    );
}

#[tokio::test]
async fn a_provider_registered_through_the_client_refuses_an_inventory_below_usage_unless_forced() {
    use provledger_client::placement::{register_provider, set_inventory};
    use provledger_tests::workload::vcpu_inventory;
    // Given a provider registered with 8 VCPU and a claim of 6 on it,
    let dir = tempfile::tempdir().unwrap();
    let log = Writer::new(SledLog::open(dir.path()).unwrap());
    let stamper = Stamper::system();
    let provider = Uuid::now_v7();
    let inventories = BTreeMap::from([("VCPU".to_string(), vcpu_inventory(8))]);
    register_provider(&log, provider, "cn", "cn", &inventories, "test", &stamper)
        .await
        .unwrap();
    let p = AggregateId::provider(provider);
    log.record(
        p,
        Expectation::Any,
        CommitDraft::now("test", claim(Uuid::now_v7(), 6)),
    )
    .await
    .unwrap();
    // when the hardware is said to shrink to 4, it is refused (below usage)...
    let refused = set_inventory(
        &log,
        provider,
        "VCPU",
        vcpu_inventory(4),
        false,
        "test",
        &stamper,
    )
    .await;
    assert!(
        matches!(&refused, Err(RecordError::Rejected(r)) if r.reason() == "below_usage"),
        "{refused:?}"
    );
    // ...unless forced, and registering it again is a conflict.
    set_inventory(
        &log,
        provider,
        "VCPU",
        vcpu_inventory(4),
        true,
        "test",
        &stamper,
    )
    .await
    .unwrap();
    assert!(matches!(
        register_provider(&log, provider, "cn", "cn", &inventories, "test", &stamper).await,
        Err(RecordError::Conflict { actual: 3, .. })
    ));
}
