//! `q.provider.list`, `cmd.provider.delete`, `cmd.heal_allocations` and
//! `cmd.fix_orphans`: placement for services that are not written in Rust, through the
//! client library's placement writes.
//!
//! What the decisions look at (a provider's consumers, the providers, the instances) is
//! read from the projection store, never by folding the log, so a request costs what it
//! looks at. First the store applies what the log held when the request came (bounded like
//! a `min_position` wait, `stale` beyond), so a command sees every write acknowledged
//! before it. The store only tells what to try: the provider is read from the log, and
//! every claim and release goes through the one decided write path at the provider's exact
//! version.

use provledger_client::placement::{
    delete_provider, fix_orphans, heal_allocations, PlacementError, ProviderDeletion,
};
use provledger_client::{Stamper, Writer};
use provledger_events::{AggregateKind, EventLog};
use provledger_projections::Entity;
use serde_json::Value;
use uuid::Uuid;

use crate::messages::{
    FixOrphansData, FixOrphansRequest, HealAllocationsRequest, HealData, OrphanAllocation,
    ProviderDeleteData, ProviderDeleteRequest, ProviderListRequest,
};
use crate::store::ProjectionStore;

use super::caller::Caller;
use super::error::{to_data, ErrorCode, QueryError};
use super::request::parse;
use crate::replica::QueryContext;

fn placement_error(e: PlacementError) -> QueryError {
    match e {
        PlacementError::NotFound(_) => QueryError::new(ErrorCode::NotFound, e.to_string()),
        PlacementError::Read(_) | PlacementError::Contended { .. } => {
            QueryError::new(ErrorCode::Unavailable, e.to_string())
        }
        PlacementError::Write(w) => QueryError::new(ErrorCode::Unavailable, w.to_string()),
    }
}

/// Waits until the store has applied the log's end as it is now: decisions read from the
/// store then see every write acknowledged before the request.
async fn caught_up_with_log(ctx: &QueryContext) -> Result<(), QueryError> {
    let end = ctx.log.last_position().await.map_err(|e| {
        QueryError::new(
            ErrorCode::Unavailable,
            format!("cannot read the log's end: {e}"),
        )
    })?;
    ctx.wait_for(Some(end)).await
}

/// Providers, optionally of one `status` or `host`, in id order after `after`.
pub(crate) fn provider_list(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let ProviderListRequest {
        status,
        host,
        limit,
        after,
    } = parse(payload)?;
    super::entities::list(ctx, AggregateKind::Provider, limit, after, |e| {
        let Entity::Provider(p) = e else { return false };
        status.as_deref().is_none_or(|s| e.status_word() == s)
            && host.as_deref().is_none_or(|h| p.host == h)
    })
}

/// Deletes a provider: refused (`conflict`, every hold listed) while allocations remain,
/// unless `cascade`.
pub(crate) async fn provider_delete(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    let ProviderDeleteRequest { id, cascade, actor } = parse(payload)?;
    let actor = caller.actor(actor.as_deref(), "nats:cmd.provider.delete");
    caught_up_with_log(ctx).await?;
    delete_with(
        &ctx.writer,
        &ctx.store,
        id,
        cascade.unwrap_or(false),
        &actor,
    )
    .await
}

/// `provider_delete` once the request is read: the provider from `log`, why each
/// allocation is there from `store` (each consumer by id).
async fn delete_with<L: EventLog>(
    writer: &Writer<L>,
    store: &ProjectionStore,
    id: Uuid,
    cascade: bool,
    actor: &str,
) -> Result<Value, QueryError> {
    match delete_provider(writer, store, id, cascade, actor, &Stamper::system())
        .await
        .map_err(placement_error)?
    {
        ProviderDeletion::Deleted { released } => {
            Ok(to_data(&ProviderDeleteData::Deleted { released }))
        }
        ProviderDeletion::AlreadyDeleted => Ok(to_data(&ProviderDeleteData::AlreadyDeleted)),
        ProviderDeletion::Refused { holds } => Err(QueryError::new(
            ErrorCode::Conflict,
            format!(
                "provider {id} holds {} allocation(s); nothing was written: release them (see holds) or send cascade: true",
                holds.len()
            ),
        )
        .with("reason", "allocations_remain".into())
        .with("holds", serde_json::to_value(&holds).expect("holds: plain serde data (string keys, no fallible impls) encodes as JSON"))),
    }
}

/// heal-allocations: `{dry_run?, instance?}`.
pub(crate) async fn heal(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    let HealAllocationsRequest {
        dry_run,
        instance,
        actor,
    } = parse(payload)?;
    let actor = caller.actor(actor.as_deref(), "nats:cmd.heal_allocations");
    caught_up_with_log(ctx).await?;
    heal_with(
        &ctx.writer,
        &ctx.store,
        instance,
        dry_run.unwrap_or(false),
        &actor,
    )
    .await
}

/// `heal` once the request is read: the instances and who holds allocations from `store`,
/// each claim written to `log` through the write path.
async fn heal_with<L: EventLog>(
    writer: &Writer<L>,
    store: &ProjectionStore,
    instance: Option<Uuid>,
    dry_run: bool,
    actor: &str,
) -> Result<Value, QueryError> {
    let report = heal_allocations(writer, store, instance, dry_run, actor, &Stamper::system())
        .await
        .map_err(placement_error)?;
    Ok(to_data(&HealData { report, dry_run }))
}

/// Releases the orphan allocations, only those: `{dry_run?}`.
pub(crate) async fn orphans(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    let FixOrphansRequest { dry_run, actor } = parse(payload)?;
    let actor = caller.actor(actor.as_deref(), "nats:cmd.fix_orphans");
    caught_up_with_log(ctx).await?;
    orphans_with(&ctx.writer, &ctx.store, dry_run.unwrap_or(false), &actor).await
}

/// `orphans` once the request is read: the providers and their consumers from `store`,
/// each release written to `log` through the write path.
async fn orphans_with<L: EventLog>(
    writer: &Writer<L>,
    store: &ProjectionStore,
    dry_run: bool,
    actor: &str,
) -> Result<Value, QueryError> {
    let found = fix_orphans(writer, store, dry_run, actor, &Stamper::system())
        .await
        .map_err(placement_error)?;
    Ok(to_data(&FixOrphansData {
        dry_run,
        orphans: found
            .into_iter()
            .map(|(provider, hold)| OrphanAllocation { provider, hold })
            .collect(),
    }))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use provledger_client::placement::LogView;
    use provledger_client::recovery::sweep;
    use provledger_client::Writer;
    use provledger_events::catalogue::{ConsumerKind, Inventory, Ratio, TaskState, VmState};
    use provledger_events::{
        AggregateId, AppendError, AppendOutcome, ChainTip, Commit, CommitDraft, CommitStream,
        Event, Expectation, HistoryEntry, ReadError, SledLog, Timestamp,
    };
    use provledger_tests::workload::{instance_running_on as running_on, provider_on};

    use super::*;
    use crate::projector::Projector;
    use serde_json::json;

    /// The log serve writes to, counting every read of the whole log: serve's placement
    /// commands and recovery sweep must decide from the store and never ask for one.
    #[derive(Clone)]
    struct CountsFolds {
        inner: SledLog,
        folds: Arc<AtomicUsize>,
    }

    impl CountsFolds {
        fn folds(&self) -> usize {
            self.folds.load(Ordering::SeqCst)
        }
    }

    impl EventLog for CountsFolds {
        async fn append(
            &self,
            aggregate: AggregateId,
            expect: Expectation,
            draft: CommitDraft,
        ) -> Result<AppendOutcome, AppendError> {
            self.inner.append(aggregate, expect, draft).await
        }
        async fn append_atomic(
            &self,
            items: Vec<provledger_events::AtomicItem>,
        ) -> Result<Vec<AppendOutcome>, AppendError> {
            self.inner.append_atomic(items).await
        }
        async fn read_aggregate(&self, aggregate: AggregateId) -> Result<Vec<Commit>, ReadError> {
            self.inner.read_aggregate(aggregate).await
        }
        async fn read_aggregate_after(
            &self,
            aggregate: AggregateId,
            after: ChainTip,
        ) -> Result<Vec<Commit>, ReadError> {
            self.inner.read_aggregate_after(aggregate, after).await
        }
        async fn find_commit(
            &self,
            aggregate: AggregateId,
            commit_id: Uuid,
        ) -> Result<Option<Commit>, ReadError> {
            self.inner.find_commit(aggregate, commit_id).await
        }
        fn recognises_retry_on_append(&self, commit_id: &Uuid) -> bool {
            self.inner.recognises_retry_on_append(commit_id)
        }
        async fn aggregate_history(
            &self,
            aggregate: AggregateId,
        ) -> Result<Vec<HistoryEntry>, ReadError> {
            self.inner.aggregate_history(aggregate).await
        }
        async fn read_all(&self, from: u64) -> Result<CommitStream, ReadError> {
            self.folds.fetch_add(1, Ordering::SeqCst);
            self.inner.read_all(from).await
        }
        async fn subscribe(&self, from: u64) -> Result<CommitStream, ReadError> {
            self.folds.fetch_add(1, Ordering::SeqCst);
            self.inner.subscribe(from).await
        }
        async fn last_position(&self) -> Result<u64, ReadError> {
            self.inner.last_position().await
        }
    }

    fn claim(consumer: Uuid) -> Vec<Event> {
        vec![Event::AllocationClaimed {
            consumer,
            consumer_kind: ConsumerKind::Instance,
            resources: BTreeMap::from([("VCPU".to_string(), 2)]),
        }]
    }

    /// Given a provider holding a running instance's allocation and a deleted instance's,
    /// an instance on it without one, and an instance whose worker died mid-task, projected
    /// into a store: serve's refused delete, heal and orphan dry runs, recovery sweep, and
    /// the writes that follow (heal, cascade) never read the whole log.
    #[tokio::test]
    async fn serve_decides_placement_and_recovery_from_the_store_without_folding_the_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sled = SledLog::open(dir.path()).expect("sled log");
        let store = ProjectionStore::open(sled.db()).expect("store");
        let counts = CountsFolds {
            inner: sled.clone(),
            folds: Arc::default(),
        };
        let log = Writer::new(counts.clone());
        let stamper = Stamper::system();
        let (p, running, unallocated, deleted, stuck) = (
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
            Uuid::now_v7(),
        );
        // A task started ten minutes ago with a two-second lease: long expired.
        let started_at = Timestamp::from_unix_ms(stamper.now().unix_ms() - 600_000);
        let mut stuck_events = running_on(p);
        stuck_events.push(Event::TaskStarted {
            task_state: TaskState::PoweringOff,
            worker_id: "compute-1".into(),
            lease_until: Timestamp::from_unix_ms(started_at.unix_ms() + 2_000),
        });
        let mut deleted_events = running_on(p);
        deleted_events.push(Event::VmStateChanged {
            vm_state: VmState::Deleted,
            reason: "gone".into(),
        });
        let script = [
            (AggregateId::provider(p), provider_on("cn", 16)),
            (AggregateId::instance(running), running_on(p)),
            (AggregateId::instance(unallocated), running_on(p)),
            (AggregateId::instance(deleted), deleted_events),
            (AggregateId::instance(stuck), stuck_events),
            (AggregateId::provider(p), claim(running)),
            (AggregateId::provider(p), claim(deleted)),
            (AggregateId::provider(p), claim(stuck)),
        ];
        for (aggregate, events) in script {
            let mut draft = stamper.draft("t", events);
            if aggregate == AggregateId::instance(stuck) {
                draft.recorded_at = started_at;
            }
            log.record(aggregate, Expectation::Any, draft)
                .await
                .expect("record");
        }
        let mut projector = Projector::new(store.clone(), 0).expect("projector");
        projector
            .catch_up(&sled, |_, _| {})
            .await
            .expect("catch up");

        // A refused delete names each consumer, looked up in the store by id.
        let refused = delete_with(&log, &store, p, false, "t")
            .await
            .expect_err("refused");
        assert_eq!(refused.code, ErrorCode::Conflict, "{}", refused.message);
        assert_eq!(refused.extra["holds"].as_array().map(Vec::len), Some(3));
        assert_eq!(counts.folds(), 0, "the refused delete folded the log");

        let healed = heal_with(&log, &store, None, true, "t")
            .await
            .expect("heal");
        assert_eq!(healed["healed"], json!([[unallocated, p]]), "{healed}");
        assert_eq!(counts.folds(), 0, "the heal dry run folded the log");

        let found = orphans_with(&log, &store, true, "t")
            .await
            .expect("orphans");
        assert_eq!(
            found["orphans"].as_array().map(Vec::len),
            Some(1),
            "{found}"
        );
        assert_eq!(found["orphans"][0]["hold"]["consumer"], json!(deleted));
        assert_eq!(counts.folds(), 0, "the orphan dry run folded the log");

        let swept = sweep(&log, &store, true, &stamper).await.expect("sweep");
        assert_eq!(swept.examined, 4);
        assert_eq!(swept.recoveries.len(), 1, "{swept:?}");
        assert_eq!(swept.recoveries[0].instance, stuck);
        assert_eq!(counts.folds(), 0, "the recovery sweep folded the log");

        // The writes decided from the store go through the write path, still no fold.
        let healed = heal_with(&log, &store, None, false, "t")
            .await
            .expect("heal");
        assert_eq!(healed["healed"], json!([[unallocated, p]]), "{healed}");
        projector
            .catch_up(&sled, |_, _| {})
            .await
            .expect("catch up");
        let deleted_reply = delete_with(&log, &store, p, true, "t")
            .await
            .expect("cascade");
        assert_eq!(deleted_reply["outcome"], "deleted", "{deleted_reply}");
        assert_eq!(
            deleted_reply["released"].as_array().map(Vec::len),
            Some(4),
            "{deleted_reply}"
        );
        assert_eq!(counts.folds(), 0, "a placement write folded the log");

        // The counter does see a fold: the log itself as the view reads it whole.
        let other = Uuid::now_v7();
        log.record(
            AggregateId::provider(other),
            Expectation::Any,
            stamper.draft(
                "t",
                vec![Event::ProviderRegistered {
                    name: "cn2".into(),
                    host: "cn2".into(),
                }],
            ),
        )
        .await
        .expect("record");
        log.record(AggregateId::provider(other), Expectation::Any, {
            stamper.draft(
                "t",
                vec![Event::InventorySet {
                    resource_class: "VCPU".into(),
                    inventory: Inventory {
                        total: 4,
                        reserved: 0,
                        allocation_ratio: Ratio::ONE,
                        min_unit: 1,
                        max_unit: 4,
                        step_size: 1,
                    },
                }],
            )
        })
        .await
        .expect("record");
        log.record(
            AggregateId::provider(other),
            Expectation::Any,
            stamper.draft("t", claim(running)),
        )
        .await
        .expect("record");
        let by_log = delete_provider(&log, &LogView::new(log.log()), other, false, "t", &stamper)
            .await
            .expect("delete");
        assert!(
            matches!(by_log, ProviderDeletion::Refused { ref holds } if holds.len() == 1),
            "{by_log:?}"
        );
        assert_eq!(counts.folds(), 1);
    }
}
