//! A write decided on a state folded elsewhere in the process (serve's projector), at the
//! head that fold noted in the log, appends without reading the stream first; a head that
//! is stale by then costs a refused append and a read, never a broken chain. Against a
//! real nats-server.

use provledger_client::write::{FoldedElsewhere, Writer};
use provledger_events::{
    AggregateId, ChainTip, CommitDraft, Event, EventLog, Expectation, JetStreamConfig, JetStreamLog,
};
use provledger_projections::decide::DecideOptions;
use provledger_projections::Entity;
use provledger_tests::NatsServer;
use uuid::Uuid;

/// A fold of the same stream elsewhere in the process, stopped at one state.
struct FoldedAt(Entity);

impl FoldedElsewhere for FoldedAt {
    fn folded(&self, _aggregate: AggregateId) -> Option<Entity> {
        Some(self.0.clone())
    }
}

fn inventory(total: u64) -> Vec<Event> {
    vec![super::write::inventory(total)]
}

#[tokio::test]
async fn a_stale_folded_head_costs_a_refused_append_and_never_a_broken_chain() {
    // Given a provider this process wrote, which another process then took to version 10,
    // as a fold of the same stream in this process read it (its tip noted in the log)...
    let nats = NatsServer::start().await;
    let open = || async {
        JetStreamLog::open(nats.client().await, JetStreamConfig::default())
            .await
            .expect("the stream")
    };
    let (log, other) = (open().await, open().await);
    let writer = Writer::new(log.clone());
    let provider = AggregateId::provider(Uuid::now_v7());
    let events = provledger_tests::workload::provider_on("cn1", 8);
    writer
        .record(
            provider,
            Expectation::NoStream,
            CommitDraft::now("test", events),
        )
        .await
        .expect("v1");
    for v in 1..10 {
        let draft = CommitDraft::now("another process", inventory(8 + v % 2));
        other
            .append(provider, Expectation::Exactly(v), draft)
            .await
            .expect("another process");
    }
    let commits = other.read_aggregate(provider).await.expect("a read");
    let folded = Entity::fold(provider, &commits).expect("a provider");
    let tip = ChainTip::of(commits.last().expect("ten commits"));
    writer.folded_versions().folded([(provider, tip)]);
    assert!(
        log.holds_head(provider, tip),
        "the fold's tip is the head the log holds"
    );
    // ...and then one more commit, which that fold has not seen yet...
    other
        .append(
            provider,
            Expectation::Exactly(10),
            CommitDraft::now("another process", inventory(3)),
        )
        .await
        .expect("v11");

    // ...when this process writes to it, decided on the fold...
    let recorded = writer
        .record_with_folded(
            provider,
            Expectation::Any,
            CommitDraft::now("test", inventory(5)),
            DecideOptions::default(),
            &FoldedAt(folded),
        )
        .await
        .expect("the write");

    // ...then the append at the fold's head was refused, the commit after it read, and the
    // write landed after it: the chain read whole is unbroken, every version once.
    assert_eq!(recorded.version(), 12);
    assert_eq!(writer.races_lost(), 1);
    let history = other.read_aggregate(provider).await.expect("a whole read");
    let versions: Vec<u64> = history.iter().map(|c| c.version).collect();
    assert_eq!(versions, (1..=12).collect::<Vec<_>>());
    assert!(history.windows(2).all(|w| w[1].prev_hash == w[0].hash));
}
