//! A real 3-node JetStream cluster rendered from `deploy/nats/cluster-node.conf`: an R3
//! stream, appends going on while a member is SIGKILLed and restarted, and every
//! acknowledged commit in the stream afterwards (none lost, none twice).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use provledger_events::catalogue::ClusterStatus;
use provledger_events::log::OpenJetStreamError;
use provledger_events::{
    AggregateId, AppendError, CommitDraft, Event, EventLog, Expectation, JetStreamConfig,
    JetStreamLog,
};
use provledger_tests::NatsCluster;
use uuid::Uuid;

fn status(n: usize) -> Vec<Event> {
    vec![Event::ClusterStatusChanged {
        status: ClusterStatus::Active,
        description: format!("step {n}"),
    }]
}

async fn connect(cluster: &NatsCluster) -> async_nats::Client {
    let seeds: Vec<String> = cluster.seeds().split(',').map(str::to_string).collect();
    async_nats::ConnectOptions::new()
        .connect(seeds)
        .await
        .expect("connecting to the cluster")
}

fn r3() -> JetStreamConfig {
    JetStreamConfig {
        replicas: 3,
        ..JetStreamConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_go_on_while_a_member_is_killed_and_every_acknowledged_commit_stays() {
    let mut cluster = NatsCluster::start(3).await;
    let log = JetStreamLog::open(connect(&cluster).await, r3())
        .await
        .expect("an R3 stream");
    // An existing R3 stream is verified, not refused, when asked for with three replicas,
    // and a single-replica expectation is refused by name.
    JetStreamLog::open(connect(&cluster).await, r3())
        .await
        .expect("the same R3 stream again");
    match JetStreamLog::open(connect(&cluster).await, JetStreamConfig::default()).await {
        Err(e @ OpenJetStreamError::StreamConfigMismatch { .. }) => {
            assert!(e.to_string().contains("num_replicas = 3"), "{e}");
        }
        Err(e) => panic!("expected a mismatch, got {e}"),
        Ok(_) => panic!("an R3 stream opened as R1"),
    }

    let aggregates: Vec<AggregateId> = (0..20)
        .map(|_| AggregateId::cluster(Uuid::now_v7()))
        .collect();
    let mut acknowledged: BTreeMap<Uuid, u64> = BTreeMap::new();
    let mut unavailable = 0;
    for n in 0..240 {
        if n == 80 {
            cluster.kill(1); // SIGKILL, mid-load
        }
        if n == 160 {
            cluster.restart(1).await;
        }
        let draft = CommitDraft::now("cluster-test", status(n));
        let commit_id = draft.commit_id;
        // A retry with the same commit id is recognised, whatever node answers.
        for _ in 0..30 {
            match log
                .append(
                    aggregates[n % aggregates.len()],
                    Expectation::Any,
                    draft.clone(),
                )
                .await
            {
                Ok(outcome) => {
                    acknowledged.insert(commit_id, outcome.position);
                    break;
                }
                Err(AppendError::Unavailable { .. }) => {
                    unavailable += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("append {n}: {e}"),
            }
        }
    }
    assert!(
        acknowledged.len() >= 230,
        "most appends got through: {}",
        acknowledged.len()
    );

    // Every acknowledged commit is in the stream, once, at the position acknowledged.
    let mut stored: BTreeMap<Uuid, Vec<u64>> = BTreeMap::new();
    let mut all = log.read_all(1).await.unwrap();
    while let Some(commit) = all.next().await {
        let commit = commit.expect("a commit");
        stored
            .entry(commit.commit_id)
            .or_default()
            .push(commit.position);
    }
    let mut lost = 0;
    for (id, position) in &acknowledged {
        match stored.get(id) {
            Some(positions) => {
                assert_eq!(positions, &vec![*position], "{id} stored {positions:?}");
            }
            None => lost += 1,
        }
    }
    assert_eq!(
        lost, 0,
        "acknowledged commits lost ({unavailable} unavailable answers)"
    );
    for aggregate in &aggregates {
        let commits = log.read_aggregate(*aggregate).await.unwrap();
        assert!(provledger_events::verify_chain(aggregate, &commits).is_empty());
    }
}
