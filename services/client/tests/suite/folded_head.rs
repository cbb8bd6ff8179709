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

/// This process's log and writer, and another process's log, on one stream; a provider
/// this process wrote (version 1), which the other process took to version `to`; its
/// commits, read whole.
struct Deepened {
    log: JetStreamLog,
    other: JetStreamLog,
    writer: Writer<JetStreamLog>,
    provider: AggregateId,
    commits: Vec<provledger_events::Commit>,
}

async fn deepened(nats: &NatsServer, to: u64) -> Deepened {
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
    for v in 1..to {
        let draft = CommitDraft::now("another process", inventory(8 + v % 2));
        other
            .append(provider, Expectation::Exactly(v), draft)
            .await
            .expect("another process");
    }
    let commits = other.read_aggregate(provider).await.expect("a read");
    Deepened {
        log,
        other,
        writer,
        provider,
        commits,
    }
}

#[tokio::test]
async fn a_stale_folded_head_costs_a_refused_append_and_never_a_broken_chain() {
    // Given a provider this process wrote, which another process then took to version 10,
    // as a fold of the same stream in this process read it (its tip noted in the log)...
    let nats = NatsServer::start().await;
    let Deepened {
        log,
        other,
        writer,
        provider,
        commits,
    } = deepened(&nats, 10).await;
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

/// A fold elsewhere that lags behind the log and gains one commit each time it is asked,
/// noting each tip as the log's head, as serve's projector would while another replica
/// writes steadily.
struct Lagging {
    log: JetStreamLog,
    states: std::sync::Mutex<std::collections::VecDeque<(Entity, ChainTip)>>,
}

impl FoldedElsewhere for Lagging {
    fn folded(&self, aggregate: AggregateId) -> Option<Entity> {
        let (entity, tip) = self.states.lock().unwrap().pop_front()?;
        self.log.note_head(aggregate, tip);
        Some(entity)
    }
}

#[tokio::test]
async fn a_write_takes_the_folded_head_once_and_reads_after_a_lost_race() {
    // Given a provider this process wrote, which another process took to version 40,
    // and a fold in this process that lags: asked again, it has always folded one commit
    // more, never all of them...
    let nats = NatsServer::start().await;
    let Deepened {
        log,
        other: _,
        writer,
        provider,
        commits,
    } = deepened(&nats, 40).await;
    let states = (10..40)
        .map(|n| {
            let entity = Entity::fold(provider, &commits[..n]).expect("a provider");
            (entity, ChainTip::of(&commits[n - 1]))
        })
        .collect();
    let first = ChainTip::of(&commits[9]);
    writer.folded_versions().folded([(provider, first)]);
    let lagging = Lagging {
        log: log.clone(),
        states: std::sync::Mutex::new(states),
    };

    // ...when this process writes to it, decided on that fold...
    let recorded = writer
        .record_with_folded(
            provider,
            Expectation::Any,
            CommitDraft::now("test", inventory(5)),
            DecideOptions::default(),
            &lagging,
        )
        .await
        .expect("the write");

    // ...then the append at the fold's head lost its race once, and the next round read
    // the log instead of taking the fold's next head: the write lands at version 41.
    assert_eq!(recorded.version(), 41);
    assert_eq!(writer.races_lost(), 1);
}
