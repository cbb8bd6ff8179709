//! Following the ledger (`provledger_client::follow`, serve's live feed and `q.changes`)
//! against real nats-servers and serve processes: a follower killed at random and resumed
//! from what it stored ends with exactly the stream's commits in position order, with one
//! replica or two (one killed during the run), filtered or reading too slowly.

use std::time::{Duration, Instant};

use provledger_client::follow::{ChangeFilter, FollowStats, Followed, Follower};
use provledger_tests::NatsServer;
use uuid::Uuid;

use crate::common::{self, wait_ready, Serve};

/// A follower from `after` that handles changes into `handled` (what it "stored"), for at
/// most `budget` changes (then it is killed: dropped where it is), or until it is current
/// at `until`. Its stats.
async fn follow_into(
    client: async_nats::Client,
    filter: ChangeFilter,
    after: u64,
    handled: &mut Vec<u64>,
    budget: usize,
    until: Option<u64>,
) -> FollowStats {
    let follower = Follower::start(client, "provledger", filter, after)
        .await
        .expect("follower starts");
    take(follower, handled, budget, until).await
}

/// A follower that is current before the writes begin: its run then hears them live from
/// the feed, whatever the machine's pace (a follower started with the writes may spend
/// its whole budget on catch-up pages if serve answers its first one late).
async fn current_follower(client: async_nats::Client) -> Follower {
    let mut follower = Follower::start(client, "provledger", ChangeFilter::default(), 0)
        .await
        .expect("follower starts");
    assert!(matches!(
        follower.next().await.expect("follows"),
        Followed::Current { .. }
    ));
    follower
}

/// [`follow_into`] with a follower already started.
async fn take(
    mut follower: Follower,
    handled: &mut Vec<u64>,
    budget: usize,
    until: Option<u64>,
) -> FollowStats {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut taken = 0;
    while taken < budget {
        assert!(Instant::now() < deadline, "the follower never got current");
        match follower.next().await.expect("follows") {
            Followed::Change(change) => {
                handled.push(change.commit.position);
                taken += 1;
            }
            Followed::Current { position } => {
                if until.is_some_and(|u| position >= u) {
                    break;
                }
            }
        }
    }
    follower.stats()
}

/// Where a resumed follower starts: after the last position it stored.
fn resume_from(handled: &[u64]) -> u64 {
    handled.last().copied().unwrap_or(0)
}

/// Once the writes are over and the stream quiet, a follower resumed from what was stored
/// in `handled` follows until current: its stats, and the stream's commit positions.
async fn resume_until_quiet(
    nats: &NatsServer,
    client: &async_nats::Client,
    filter: ChangeFilter,
    handled: &mut Vec<u64>,
) -> (FollowStats, Vec<u64>) {
    let log = common::stream(nats).await;
    let end = common::quiet_end(&log).await;
    let after = resume_from(handled);
    let stats = follow_into(
        client.clone(),
        filter,
        after,
        handled,
        usize::MAX,
        Some(end),
    )
    .await;
    let positions = common::stream_commits(&log)
        .await
        .iter()
        .map(|c| c.position)
        .collect();
    (stats, positions)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_killed_twice_during_concurrent_writes_ends_with_exactly_the_streams_commits() {
    // Given serve, and 16 writers writing 10,000 commits meanwhile,
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    // when a follower, current at position 0 before the writes begin, is killed twice at
    // random points (a seeded choice, printed) and resumed from what it stored,
    let first = current_follower(client.clone()).await;
    let writing = common::write_concurrently(&nats, 16, 625);
    let seed = Uuid::now_v7().as_u128() as u64;
    let first_kill = 500 + (seed % 3000) as usize;
    let second_kill = 500 + ((seed >> 16) % 3000) as usize;
    eprintln!("kills after {first_kill} then {second_kill} more changes (seed {seed})");
    let mut handled = Vec::new();
    let follow = async {
        let mut stats = vec![take(first, &mut handled, first_kill, None).await];
        let after = resume_from(&handled);
        stats.push(
            follow_into(
                client.clone(),
                ChangeFilter::default(),
                after,
                &mut handled,
                second_kill,
                None,
            )
            .await,
        );
        stats
    };
    let ((), stats) = tokio::join!(writing, follow);
    let (last, expected) =
        resume_until_quiet(&nats, &client, ChangeFilter::default(), &mut handled).await;

    // then it handled exactly the stream's commits, each once, in position order,
    assert_eq!(expected.len(), 10_000);
    assert_eq!(handled.len(), expected.len(), "{:?}", (stats, last));
    assert_eq!(handled, expected);
    // and the first run, current as the writes began, handled most of its changes live
    // from the feed, not from catch-ups. (Only the first: a killed follower may be
    // thousands of changes behind the stream when it is killed, its feed buffered but not
    // read, on a slow machine; the run resumed after it then rightly reads those by
    // catch-up pages, and may reach its budget before it hears the feed at all.)
    eprintln!("{stats:?} {last:?}");
    assert!(
        stats[0].live * 2 > first_kill as u64,
        "{} of the first run's {first_kill} changes came live: {stats:?} {last:?}",
        stats[0].live
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_two_replicas_one_killed_during_the_run_a_follower_misses_nothing_and_drops_duplicates(
) {
    // Given two serve replicas (each publishes every change: the follower hears each twice),
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let dir = tempfile::tempdir().unwrap();
    let _a = Serve::start(&nats, &dir.path().join("a"));
    let mut b = Serve::start(&nats, &dir.path().join("b"));
    wait_ready(&client).await;
    common::wait_ready_replicas(&client, 2).await;
    // when a follower, current at position 0 before the writes begin, follows while 16
    // writers write 5,000 commits and one replica is SIGKILLed half-way,
    let follower = current_follower(client.clone()).await;
    let writing = async {
        common::write_concurrently(&nats, 16, 160).await;
        b.kill();
        common::write_concurrently(&nats, 16, 153).await;
    };
    let mut handled = Vec::new();
    let follow = take(follower, &mut handled, 2_000, None);
    let ((), early) = tokio::join!(writing, follow);
    let (late, expected) =
        resume_until_quiet(&nats, &client, ChangeFilter::default(), &mut handled).await;

    // then it handled exactly the stream's commits in order, and saw duplicates.
    assert_eq!(expected.len(), 16 * (160 + 153));
    assert_eq!(handled, expected, "{early:?} {late:?}");
    assert!(
        early.duplicates > 0,
        "two replicas publish each change: {early:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_of_one_operation_sees_exactly_its_commits() {
    // Given two failed creates and their rollbacks, with other writes between them,
    let nats = NatsServer::start().await;
    let (client, ledger, infra, provider) = common::ledger_with_executors(&nats, 64).await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let first = common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    common::write_concurrently(&nats, 4, 50).await;
    let _second = common::fail_a_create_rolled_back(&client, &ledger, &infra, provider).await;
    let log = common::stream(&nats).await;
    let end = common::quiet_end(&log).await;
    // when a follower of the first operation follows from position 0,
    let filter = ChangeFilter {
        operation_id: Some(first),
        ..Default::default()
    };
    let mut handled = Vec::new();
    follow_into(
        client.clone(),
        filter,
        0,
        &mut handled,
        usize::MAX,
        Some(end),
    )
    .await;

    // then it got exactly that operation's commits, on every aggregate it wrote.
    let commits = common::stream_commits(&log).await;
    let expected: Vec<u64> = commits
        .iter()
        .filter(|c| c.operation_id == Some(first))
        .map(|c| c.position)
        .collect();
    assert!(expected.len() > 5, "{expected:?}");
    assert_eq!(handled, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_that_reads_too_slowly_loses_changes_to_its_full_buffer_and_catches_up() {
    // Given serve, and a follower whose connection holds at most 32 messages per
    // subscription (the client drops what does not fit: a slow consumer),
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let slow = async_nats::ConnectOptions::new()
        .subscription_capacity(32)
        .connect(nats.url())
        .await
        .expect("a slow follower's connection");
    // when 1,000 commits are written while it reads nothing (its buffer overflows
    // whatever the machine's pace), then 1,000 more while it takes 2 ms per change (what
    // it hears of those tells it what it lost),
    let mut follower = Follower::start(slow, "provledger", ChangeFilter::default(), 0)
        .await
        .expect("follower");
    // (current before the writes, so that what it gets next comes from the feed)
    assert!(matches!(
        follower.next().await.unwrap(),
        Followed::Current { .. }
    ));
    common::write_concurrently(&nats, 8, 125).await;
    let log = common::stream(&nats).await;
    common::wait_applied(&client, &log).await;
    let writing = common::write_concurrently(&nats, 8, 125);
    let mut handled = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let reading = async {
        while handled.len() < 2_000 {
            assert!(
                Instant::now() < deadline,
                "handled {} of 2,000: {:?}",
                handled.len(),
                follower.stats()
            );
            if let Followed::Change(change) = follower.next().await.expect("follows") {
                handled.push(change.commit.position);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    tokio::join!(writing, reading);

    // then it lost changes from the feed, saw the gaps, filled them from q.changes, and
    // handled each commit once in order.
    let stats = follower.stats();
    assert!(stats.gaps > 0, "{stats:?}");
    let expected: Vec<u64> = common::stream_commits(&log)
        .await
        .iter()
        .map(|c| c.position)
        .collect();
    assert_eq!(handled, expected, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_catch_up_says_current_as_soon_as_its_last_change_is_handed_over() {
    // Given a quiet stream of 200 commits and a ready replica,
    let nats = NatsServer::start().await;
    let client = nats.client().await;
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    common::write_concurrently(&nats, 4, 50).await;
    let log = common::stream(&nats).await;
    let end = common::quiet_end(&log).await;
    // (the replica has applied them: its catch-up reaches the end)
    common::wait_position(&client, end).await;
    // when a follower from position 0 has been handed every commit (three times, so that
    // a bookmark, every 5 s, is unlikely to answer for the catch-up each time),
    for _ in 0..3 {
        let mut follower =
            Follower::start(client.clone(), "provledger", ChangeFilter::default(), 0)
                .await
                .expect("follower starts");
        let mut last = 0;
        while last < end {
            if let Followed::Change(change) = follower.next().await.expect("follows") {
                last = change.commit.position;
            }
        }
        // then the next call says it is current at the end, well before any bookmark.
        let next = tokio::time::timeout(Duration::from_secs(1), follower.next()).await;
        match next {
            Ok(Ok(Followed::Current { position })) => assert_eq!(position, end),
            other => panic!("not current right after the last change: {other:?}"),
        }
    }
}

/// A follower of one cluster alone, current, while 30 commits are written on the cluster,
/// then 400 on other aggregates and 30 more on the cluster; `slow`: its connection holds 4
/// messages per subscription, it reads nothing during the first 30 and takes 20 ms per
/// change after, so it loses changes of the cluster. Its
/// stats once it handled the cluster's commits, which it checks are exactly the stream's.
async fn follow_one_cluster_during_writes(slow: bool) -> FollowStats {
    // Given serve, and a cluster with one commit,
    let nats = NatsServer::start().await;
    let client = if slow {
        async_nats::ConnectOptions::new()
            .subscription_capacity(4)
            .connect(nats.url())
            .await
            .expect("a slow follower's connection")
    } else {
        nats.client().await
    };
    let dir = tempfile::tempdir().unwrap();
    let _serve = Serve::start(&nats, &dir.path().join("serve"));
    wait_ready(&client).await;
    let log = common::stream(&nats).await;
    let cluster = provledger_events::AggregateId::cluster(Uuid::now_v7());
    let append = |event| {
        let log = &log;
        async move {
            provledger_events::EventLog::append(
                log,
                cluster,
                provledger_events::Expectation::Any,
                provledger_events::CommitDraft::now("writer", vec![event]),
            )
            .await
            .expect("append");
        }
    };
    append(provledger_events::catalogue::samples::all().remove(0)).await;
    // when a follower of that cluster alone is current, and then 400 commits are written
    // on other aggregates while 60 are written on the cluster,
    let filter = ChangeFilter {
        aggregate: Some(cluster),
        ..Default::default()
    };
    let mut follower = Follower::start(client.clone(), "provledger", filter, 0)
        .await
        .expect("follower");
    let mut handled = Vec::new();
    while let Followed::Change(change) = follower.next().await.expect("follows") {
        handled.push(change.commit.position);
    }
    let own = |commits: std::ops::Range<usize>| async move {
        for i in commits {
            append(provledger_events::Event::ClusterStatusChanged {
                status: provledger_events::catalogue::ClusterStatus::Spawning,
                description: format!("own commit {i}"),
            })
            .await;
        }
    };
    // Half of the cluster's commits before the follower reads again: a slow one's buffer
    // of 4 overflows whatever the machine's pace, and what it hears of the second half
    // tells it what it lost.
    own(0..30).await;
    common::wait_applied(&client, &log).await;
    let others = common::write_concurrently(&nats, 4, 100);
    let own = own(30..60);
    let reading = async {
        if slow {
            // Reading slowly while the writes go on.
            let deadline = Instant::now() + Duration::from_secs(30);
            while handled.len() < 30 {
                assert!(Instant::now() < deadline, "{:?}", follower.stats());
                if let Followed::Change(change) = follower.next().await.expect("follows") {
                    handled.push(change.commit.position);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
    };
    tokio::join!(others, own, reading);
    let end = common::quiet_end(&log).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(Instant::now() < deadline, "never current at {end}");
        match follower.next().await.expect("follows") {
            Followed::Change(change) => {
                handled.push(change.commit.position);
                if slow {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Followed::Current { position } if position >= end => break,
            Followed::Current { .. } => {}
        }
    }

    // then it handled exactly the cluster's commits, in order,
    let expected: Vec<u64> = common::stream_commits(&log)
        .await
        .iter()
        .filter(|c| c.aggregate == cluster)
        .map(|c| c.position)
        .collect();
    assert_eq!(expected.len(), 61);
    assert_eq!(handled, expected, "{:?}", follower.stats());
    follower.stats()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_of_one_aggregate_hears_its_subject_alone_and_gets_exactly_its_commits() {
    // Given a follower of one cluster during writes on it and on 400 others, then it
    // handled exactly the cluster's commits (checked inside), and heard only the cluster's
    // changes and bookmarks from the server, not the 400 others (each a message on the
    // whole feed).
    let stats = follow_one_cluster_during_writes(false).await;
    assert!(stats.heard <= 60 + 20, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_of_one_aggregate_that_loses_changes_of_it_sees_the_gap_and_fills_it() {
    // Given a slow follower of one cluster during writes on it, then it lost changes of
    // the cluster, told them by `aggregate_prev`, filled them through `q.changes` (read by
    // the cluster's subject) and handled exactly the cluster's commits (checked inside).
    let stats = follow_one_cluster_during_writes(true).await;
    assert!(stats.gaps > 0, "{stats:?}");
}
