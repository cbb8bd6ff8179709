//! [`StateView`]: the current state placement and recovery decide from, read by id and by
//! kind, so that a decision costs what it looks at rather than the log's length.
//!
//! Two implementations: [`LogView`], the log itself (folded once, lazily, the first time
//! the view is asked; for the embedded CLI and library users without a projection store),
//! and `provledger-serve`'s projection store, which reads entities from sled by id and by
//! kind and consumers from its allocation-by-consumer index (serve's request paths and its
//! recovery sweep never fold the log).
//!
//! A view only tells what to try. Every write a decision leads to still goes through the
//! one decided write path (`Writer::record` / `Writer::record_fact`), which reads the
//! aggregate it writes from the log and appends at that exact version: a claim, a release
//! or a recovery decided from a view that lags the log is checked against the log by the
//! decider, and refused or re-decided, never applied blindly.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;

use futures::StreamExt;
use provledger_events::{AggregateId, EventLog};
use provledger_projections::instance::InstanceState;
use provledger_projections::provider::ProviderState;
use provledger_projections::{Entity, Projection};
use tokio::sync::OnceCell;
use uuid::Uuid;

/// The state could not be read: the log a view folds, or the store it reads.
#[derive(Debug, thiserror::Error)]
pub enum ViewError {
    #[error(transparent)]
    Log(#[from] provledger_events::ReadError),
    /// A view over a store of its own (serve's projection store) could not read it.
    #[error("reading the projection store: {0}")]
    Store(Box<dyn std::error::Error + Send + Sync>),
}

/// The current state placement and recovery decide from: entities by id, providers and
/// instances by kind, and who holds allocations where. Lists are in id order.
pub trait StateView: Sync {
    /// The entity `id`, if this view knows it.
    fn entity(
        &self,
        id: &AggregateId,
    ) -> impl Future<Output = Result<Option<Entity>, ViewError>> + Send;

    /// Every provider, in id order.
    fn providers(&self) -> impl Future<Output = Result<Vec<ProviderState>, ViewError>> + Send;

    /// Every instance, in id order.
    fn instances(&self) -> impl Future<Output = Result<Vec<InstanceState>, ViewError>> + Send;

    /// The providers where `consumer` holds an allocation, in id order.
    fn allocation_providers(
        &self,
        consumer: Uuid,
    ) -> impl Future<Output = Result<Vec<Uuid>, ViewError>> + Send;
}

/// The entities of `view` among `ids` (those it knows), for the pure functions' lookups:
/// `|id| found.get(id)`.
pub async fn entities<V: StateView>(
    view: &V,
    ids: impl IntoIterator<Item = AggregateId>,
) -> Result<BTreeMap<AggregateId, Entity>, ViewError> {
    let mut found = BTreeMap::new();
    for id in ids {
        if found.contains_key(&id) {
            continue;
        }
        if let Some(entity) = view.entity(&id).await? {
            found.insert(id, entity);
        }
    }
    Ok(found)
}

/// Folds the whole log (what readers quarantine is not folded here either).
pub(crate) async fn fold_log<L: EventLog>(log: &L) -> Result<Projection, ViewError> {
    let mut projection = Projection::new();
    let mut stream = log.read_all(1).await?;
    while let Some(entry) = stream.next().await {
        match entry {
            Ok(commit) => {
                let _ = projection.apply_checked(&commit);
            }
            Err(e) if e.quarantine_parts().is_some() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(projection)
}

/// The log itself as a [`StateView`]: the whole log folded the first time the view is
/// asked anything, then answered from that fold (a view is as of its first read: make one
/// per decision). Its cost grows with the log; request paths use a projection store.
pub struct LogView<'a, L> {
    log: &'a L,
    folded: OnceCell<Folded>,
}

struct Folded {
    projection: Projection,
    by_consumer: HashMap<Uuid, Vec<Uuid>>,
}

impl<'a, L: EventLog> LogView<'a, L> {
    pub fn new(log: &'a L) -> Self {
        LogView {
            log,
            folded: OnceCell::new(),
        }
    }

    async fn folded(&self) -> Result<&Folded, ViewError> {
        self.folded
            .get_or_try_init(|| async {
                let projection = fold_log(self.log).await?;
                let mut by_consumer: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
                // `providers()` is in id order, so each list is too.
                for p in projection.providers() {
                    for consumer in p.allocations.keys() {
                        by_consumer
                            .entry(*consumer)
                            .or_default()
                            .push(p.header.id.id);
                    }
                }
                Ok(Folded {
                    projection,
                    by_consumer,
                })
            })
            .await
    }
}

impl<L: EventLog> StateView for LogView<'_, L> {
    async fn entity(&self, id: &AggregateId) -> Result<Option<Entity>, ViewError> {
        Ok(self.folded().await?.projection.get(id).cloned())
    }

    async fn providers(&self) -> Result<Vec<ProviderState>, ViewError> {
        let folded = self.folded().await?;
        Ok(folded.projection.providers().into_iter().cloned().collect())
    }

    async fn instances(&self) -> Result<Vec<InstanceState>, ViewError> {
        let folded = self.folded().await?;
        Ok(folded.projection.instances().into_iter().cloned().collect())
    }

    async fn allocation_providers(&self, consumer: Uuid) -> Result<Vec<Uuid>, ViewError> {
        let folded = self.folded().await?;
        Ok(folded
            .by_consumer
            .get(&consumer)
            .cloned()
            .unwrap_or_default())
    }
}
