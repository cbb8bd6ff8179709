//! A real 3-node JetStream cluster rendered from `deploy/nats/cluster-node.conf`: an R3
//! stream, appends going on while a member is SIGKILLed and restarted, and every
//! acknowledged commit in the stream afterwards (none lost, none twice); and the stream
//! leader moved under retried appends, which still land once at their first position; and
//! grouped atomic sets (batches opened early on 2.14+) while a follower lags, each set
//! whole or absent.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use provledger_events::catalogue::ClusterStatus;
use provledger_events::log::OpenJetStreamError;
use provledger_events::{
    AggregateId, AppendError, AppendOutcome, AppendStatus, CommitDraft, Event, EventLog,
    Expectation, JetStreamConfig, JetStreamLog,
};
use provledger_tests::NatsCluster;
use uuid::Uuid;

fn status(n: usize) -> Vec<Event> {
    vec![Event::ClusterStatusChanged {
        status: ClusterStatus::Active,
        description: format!("step {n}"),
    }]
}

/// Every commit in the stream: its positions by commit id (more than one is a duplicate).
async fn positions_by_commit(log: &JetStreamLog) -> BTreeMap<Uuid, Vec<u64>> {
    let mut stored: BTreeMap<Uuid, Vec<u64>> = BTreeMap::new();
    let mut all = log.read_all(1).await.expect("reading the stream");
    while let Some(commit) = all.next().await {
        let commit = commit.expect("a commit");
        stored
            .entry(commit.commit_id)
            .or_default()
            .push(commit.position);
    }
    stored
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
    let log = JetStreamLog::open(cluster.client_as("writer").await, r3())
        .await
        .expect("an R3 stream");
    // An existing R3 stream is verified, not refused, when asked for with three replicas,
    // and a single-replica expectation is refused by name.
    JetStreamLog::open(cluster.client_as("writer").await, r3())
        .await
        .expect("the same R3 stream again");
    match JetStreamLog::open(
        cluster.client_as("writer").await,
        JetStreamConfig::default(),
    )
    .await
    {
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
    let stored = positions_by_commit(&log).await;
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

/// How long a writer waits for one append's answer before it gives up on it and retries
/// with the same commit id (what a client whose ack was lost does). Below the log's own
/// 10 s ack timeout, so that a publish sent into an election costs 2 s, not 10.
const ATTEMPT_PATIENCE: Duration = Duration::from_secs(2);
const ATTEMPTS_MAX: usize = 40;

/// Asks `attempt` until the log acknowledges it, again (with the same commit ids and
/// expectations) after `Unavailable` or a wait past [`ATTEMPT_PATIENCE`], as a writer
/// whose answer was lost does; `None` if it never was within [`ATTEMPTS_MAX`] attempts.
/// Any other answer fails the test, naming `what`: a conflict here means a retry was not
/// recognised.
async fn until_acknowledged<T, F>(
    mut attempt: impl FnMut() -> F,
    what: impl std::fmt::Display,
) -> Option<T>
where
    F: std::future::Future<Output = Result<T, AppendError>>,
{
    for _ in 0..ATTEMPTS_MAX {
        match tokio::time::timeout(ATTEMPT_PATIENCE, attempt()).await {
            Ok(Ok(acknowledged)) => return Some(acknowledged),
            Ok(Err(AppendError::Unavailable { .. })) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_elapsed) => {}
            Ok(Err(e)) => panic!("{what}: {e}"),
        }
    }
    None
}

/// Appends `draft` until the log acknowledges it ([`until_acknowledged`]).
async fn append_until_acknowledged(
    log: &JetStreamLog,
    aggregate: AggregateId,
    expect: Expectation,
    draft: &CommitDraft,
) -> AppendOutcome {
    let what = format!("{aggregate} {} (expect {expect})", draft.commit_id);
    until_acknowledged(|| log.append(aggregate, expect, draft.clone()), &what)
        .await
        .unwrap_or_else(|| panic!("{what}: not acknowledged after {ATTEMPTS_MAX} attempts"))
}

/// The stream's leader as `$JS.API.STREAM.INFO.<stream>` reports it (`cluster.leader`),
/// `None` while there is none or the request goes unanswered (mid-election).
async fn stream_leader(js: &async_nats::jetstream::Context, stream: &str) -> Option<String> {
    let info = js.get_stream(stream).await.ok()?.get_info().await.ok()?;
    info.cluster?.leader
}

/// Asks the stream's leader to step down, checks the server accepted, and waits until
/// another member leads it. Returns the new leader.
async fn move_leader(
    client: &async_nats::Client,
    js: &async_nats::jetstream::Context,
    stream: &str,
    old: &str,
) -> String {
    let reply = client
        .request(
            format!("$JS.API.STREAM.LEADER.STEPDOWN.{stream}"),
            bytes::Bytes::new(),
        )
        .await
        .expect("a stepdown reply");
    // The server answers compact JSON (`{"type":..., "success":true}` or `{"error":...}`);
    // this crate has no JSON parser of its own, and the flag is unambiguous as text.
    let text = String::from_utf8_lossy(&reply.payload);
    assert!(
        text.contains("\"success\":true") && !text.contains("\"error\""),
        "stepdown of {stream} refused: {text}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match stream_leader(js, stream).await {
            Some(new) if new != old => return new,
            _ if Instant::now() > deadline => panic!("{stream} still led by {old} after 10 s"),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// One acknowledged append, as the writer that made it remembers it.
struct Acknowledged {
    aggregate: AggregateId,
    expect: Expectation,
    draft: CommitDraft,
    position: u64,
}

/// Half the aggregates are written with `Exactly` (a retry is recognised by scanning the
/// aggregate after the version check fails), half with `Any` (recognised by the stream's
/// duplicate window, which the new leader must have inherited).
fn expectation(aggregate_index: usize, version: u64) -> Expectation {
    if aggregate_index.is_multiple_of(2) {
        Expectation::Exactly(version)
    } else {
        Expectation::Any
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_leader_moving_does_not_break_idempotent_retries() {
    // Given an R3 stream on a 3-node cluster, a plain client to move its leader with, and
    // a JetStream context with a short timeout to watch the leader (requests sent while
    // nobody leads go unanswered).
    let cluster = NatsCluster::start(3).await;
    let config = r3();
    let stream = config.stream.clone();
    let log = JetStreamLog::open(cluster.client_as("writer").await, config)
        .await
        .expect("an R3 stream");
    let admin = cluster.client_as("writer").await;
    let js = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(1))
        .build(admin.clone());
    let aggregates: Vec<AggregateId> = (0..8)
        .map(|_| AggregateId::cluster(Uuid::now_v7()))
        .collect();
    let mut versions = vec![0u64; aggregates.len()];
    let mut acknowledged: Vec<Acknowledged> = Vec::new();
    let mut step = 0;
    let mut next_step = || {
        step += 1;
        status(step)
    };

    for round in 0..3 {
        // Given one more acknowledged commit on every aggregate. After the first round
        // these are (c): new appends after a leader moved, at the next version.
        for (i, aggregate) in aggregates.iter().enumerate() {
            let expect = expectation(i, versions[i]);
            let draft = CommitDraft::now("leader-test", next_step());
            let outcome = append_until_acknowledged(&log, *aggregate, expect, &draft).await;
            assert_eq!(outcome.status, AppendStatus::Appended, "round {round}");
            assert_eq!(
                outcome.version,
                versions[i] + 1,
                "round {round}: {aggregate}"
            );
            versions[i] += 1;
            acknowledged.push(Acknowledged {
                aggregate: *aggregate,
                expect,
                draft,
                position: outcome.position,
            });
        }
        let old = stream_leader(&js, &stream)
            .await
            .expect("the stream has a leader between stepdowns");

        // When the leader steps down while a first attempt per aggregate is on its way:
        // staggered 5 ms apart, so that some land before the stepdown, some into it and
        // some after. A first attempt gets ATTEMPT_PATIENCE, like any attempt.
        let in_flight: Vec<(Expectation, CommitDraft)> = (0..aggregates.len())
            .map(|i| {
                let draft = CommitDraft::now("leader-test", next_step());
                (expectation(i, versions[i]), draft)
            })
            .collect();
        let first_attempts: Vec<_> = aggregates
            .iter()
            .zip(&in_flight)
            .enumerate()
            .map(|(i, (aggregate, (expect, draft)))| {
                let (log, aggregate, expect, draft) =
                    (log.clone(), *aggregate, *expect, draft.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(5 * i as u64)).await;
                    tokio::time::timeout(ATTEMPT_PATIENCE, log.append(aggregate, expect, draft))
                        .await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let new = move_leader(&admin, &js, &stream, &old).await;

        // Then (b): each in-flight draft, retried with its commit id until acknowledged,
        // is acknowledged once: at the first attempt's position if that one was answered
        // (the retry then writes nothing), at the next version either way.
        let mut answered = 0;
        for (i, ((aggregate, (expect, draft)), first)) in aggregates
            .iter()
            .zip(in_flight)
            .zip(first_attempts)
            .enumerate()
        {
            let first = first.await.expect("a first attempt task");
            let outcome = append_until_acknowledged(&log, *aggregate, expect, &draft).await;
            if let Ok(Ok(first)) = &first {
                answered += 1;
                assert_eq!(
                    outcome.position, first.position,
                    "{aggregate} round {round}"
                );
                assert_eq!(outcome.status, AppendStatus::AlreadyAppended);
            }
            assert_eq!(
                outcome.version,
                versions[i] + 1,
                "{aggregate} round {round}"
            );
            versions[i] += 1;
            acknowledged.push(Acknowledged {
                aggregate: *aggregate,
                expect,
                draft,
                position: outcome.position,
            });
        }

        eprintln!(
            "round {round}: leader moved {old} -> {new}; {answered} of {} first attempts \
             answered, the rest retried",
            aggregates.len()
        );

        // Then (a): every draft acknowledged so far, sent again as it was first sent,
        // answers the position of its first acknowledgement, and nothing is written.
        let end = log.last_position().await.expect("the stream's end");
        for a in &acknowledged {
            let outcome = append_until_acknowledged(&log, a.aggregate, a.expect, &a.draft).await;
            assert_eq!(
                (outcome.position, outcome.status),
                (a.position, AppendStatus::AlreadyAppended),
                "{} {} re-sent after the leader moved ({})",
                a.aggregate,
                a.draft.commit_id,
                a.expect
            );
        }
        assert_eq!(
            log.last_position().await.expect("the stream's end"),
            end,
            "re-sending acknowledged drafts wrote something"
        );
    }

    // Then (c): after the last move, new appends still go on at the next version.
    for (i, aggregate) in aggregates.iter().enumerate() {
        let expect = expectation(i, versions[i]);
        let draft = CommitDraft::now("leader-test", next_step());
        let outcome = append_until_acknowledged(&log, *aggregate, expect, &draft).await;
        assert_eq!(
            (outcome.status, outcome.version),
            (AppendStatus::Appended, versions[i] + 1)
        );
        versions[i] += 1;
        acknowledged.push(Acknowledged {
            aggregate: *aggregate,
            expect,
            draft,
            position: outcome.position,
        });
    }

    // Then the stream holds exactly the acknowledged commits, each once at its
    // acknowledged position (a first attempt that landed unanswered was acknowledged by
    // its retry, so nothing else can be there), and every aggregate's chain verifies.
    let stored = positions_by_commit(&log).await;
    for a in &acknowledged {
        assert_eq!(
            stored.get(&a.draft.commit_id),
            Some(&vec![a.position]),
            "{} {}",
            a.aggregate,
            a.draft.commit_id
        );
    }
    assert_eq!(
        stored.len(),
        acknowledged.len(),
        "commits nobody acknowledged"
    );
    for (i, aggregate) in aggregates.iter().enumerate() {
        let commits = log.read_aggregate(*aggregate).await.expect("an aggregate");
        assert_eq!(commits.len() as u64, versions[i], "{aggregate}");
        let violations = provledger_events::verify_chain(aggregate, &commits);
        assert!(violations.is_empty(), "{aggregate}: {violations:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_accounts_config_holds_on_a_cluster_with_an_r3_stream() {
    // Given a 3-node cluster with deploy/nats/accounts.conf (as the compose file runs it)...
    let cluster = NatsCluster::start_with(3, true).await;
    // ...when the writer creates the R3 stream and appends...
    let writer = cluster.client_as("writer").await;
    let log = JetStreamLog::open(writer, r3())
        .await
        .expect("the writer creates the R3 stream");
    let aggregate = AggregateId::cluster(Uuid::now_v7());
    for n in 0..5 {
        log.append(
            aggregate,
            Expectation::Exactly(n),
            CommitDraft::now("writer", status(n as usize)),
        )
        .await
        .expect("the writer appends");
    }
    // ...then the auditor reads them all, and may not create a stream of its own.
    let auditor = cluster.client_as("auditor").await;
    let read = JetStreamLog::open(auditor.clone(), r3())
        .await
        .expect("the auditor opens the stream");
    assert_eq!(read.read_aggregate(aggregate).await.unwrap().len(), 5);
    let js = async_nats::jetstream::new(auditor);
    let refused = tokio::time::timeout(
        Duration::from_secs(5),
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "SHADOW".into(),
            subjects: vec!["shadow.>".into()],
            ..Default::default()
        }),
    )
    .await;
    assert!(
        !matches!(refused, Ok(Ok(_))),
        "the auditor created a stream"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_atomic_sets_land_whole_while_a_replica_lags() {
    // Given an R3 stream, and 32 writers each sending atomic sets of two fresh aggregates
    // in a closed loop, which the log groups into shared atomic batches (opened before a
    // group is whole on 2.14+)...
    let mut cluster = NatsCluster::start(3).await;
    let client = cluster.client_as("writer").await;
    let log = JetStreamLog::open(client.clone(), r3())
        .await
        .expect("an R3 stream");
    let js = async_nats::jetstream::new(client);
    let leader = stream_leader(&js, "PROVLEDGER").await.expect("a leader");
    let follower = (0..3)
        .find(|i| cluster.name(*i) != leader)
        .expect("a member that does not lead");
    let before = log.group_stats();
    let load = Duration::from_secs(7);
    let writers: Vec<_> = (0..32)
        .map(|w| {
            let log = log.clone();
            tokio::spawn(async move {
                let started = Instant::now();
                let mut sets = Vec::new();
                while started.elapsed() < load {
                    let n = sets.len();
                    let items: Vec<_> = (0..2)
                        .map(|_| provledger_events::AtomicItem {
                            aggregate: AggregateId::cluster(Uuid::now_v7()),
                            expect: Expectation::NoStream,
                            draft: CommitDraft::now("cluster-test", status(w * 10_000 + n)),
                        })
                        .collect();
                    let acknowledged = until_acknowledged(
                        || log.append_atomic(items.clone()),
                        "an atomic set of two fresh aggregates",
                    )
                    .await;
                    sets.push((items, acknowledged));
                }
                sets
            })
        })
        .collect();

    // ...when a follower stops answering for 3 s mid-load (SIGSTOP) and then goes on, so
    // that the stream's quorum holds while one replica lags and must catch up...
    tokio::time::sleep(Duration::from_secs(2)).await;
    cluster.pause(follower);
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.resume(follower);
    let mut sets = Vec::new();
    for writer in writers {
        sets.extend(writer.await.expect("a writer"));
    }

    // ...then every set is wholly in the stream or wholly absent; an acknowledged one at
    // the positions it was answered, each commit once; and the writes were grouped, opened
    // early where the server can.
    let stored = positions_by_commit(&log).await;
    let (mut whole, mut absent) = (0, 0);
    for (items, acknowledged) in &sets {
        let found: Vec<Option<&Vec<u64>>> = items
            .iter()
            .map(|i| stored.get(&i.draft.commit_id))
            .collect();
        match acknowledged {
            Some(outcomes) => {
                for (outcome, positions) in outcomes.iter().zip(&found) {
                    assert_eq!(*positions, Some(&vec![outcome.position]), "{outcome:?}");
                }
                whole += 1;
            }
            None if found.iter().all(Option::is_some) => whole += 1,
            None if found.iter().all(Option::is_none) => absent += 1,
            None => panic!("a set written in part: {found:?}"),
        }
    }
    assert!(
        sets.iter().filter(|(_, a)| a.is_some()).count() >= sets.len() * 9 / 10,
        "most sets were acknowledged: {whole} whole, {absent} absent of {}",
        sets.len()
    );
    let after = log.group_stats();
    assert!(
        after.sets - before.sets > after.writes - before.writes,
        "sets shared writes: {after:?}"
    );
    assert_eq!(
        after.opened_early > before.opened_early,
        provledger_tests::opens_batches_early(log.server_version()),
        "{after:?}"
    );
    // And the follower caught up: the stream's replicas are all current again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = js
            .get_stream("PROVLEDGER")
            .await
            .expect("the stream")
            .get_info()
            .await
            .expect("its info");
        let replicas = info.cluster.map(|c| c.replicas).unwrap_or_default();
        if replicas.len() == 2 && replicas.iter().all(|r| r.current) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the lagging replica did not catch up: {replicas:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
