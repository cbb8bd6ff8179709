//! The query and command endpoints, one file per group, each answering its request from
//! the replica's state ([`QueryContext`], `crate::replica`). Every request is JSON; a malformed one answers `bad_request`
//! naming the field (`request`), and every refusal carries one of the contract's error
//! codes (`error`).

mod allocation;
mod append;
pub(crate) mod caller;
mod changes;
mod entities;
pub(crate) mod error;
mod health;
mod history;
mod placement;
mod request;
mod worker;

use std::sync::atomic::{AtomicUsize, Ordering};

use provledger_events::AggregateKind;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::replica::{QueryContext, MIN_POSITION_WAITS_MAX};
pub(crate) use error::ErrorCode;

/// What an endpoint answers: its data as a JSON tree, or already written as JSON (a
/// `q.changes` page: each change is written once, and spliced into the reply as it is).
#[derive(Debug)]
pub(crate) enum Answer {
    Value(Value),
    Raw(Box<RawValue>),
}

impl Answer {
    /// The data as a tree, for what reads fields of it (an append's outcome); `None` for a
    /// page written ahead, which no such reader needs.
    pub(crate) fn value(&self) -> Option<&Value> {
        match self {
            Answer::Value(v) => Some(v),
            Answer::Raw(_) => None,
        }
    }
}

impl serde::Serialize for Answer {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Answer::Value(v) => v.serialize(serializer),
            Answer::Raw(r) => r.serialize(serializer),
        }
    }
}
use error::QueryError;

/// The endpoints under `<prefix>.q.` and `<prefix>.cmd.`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Health,
    ClusterGet,
    ClusterList,
    InstanceGet,
    InstanceList,
    ProviderGet,
    AllocationByConsumer,
    OperationGet,
    History,
    StateAt,
    CmdAppend,
    ProviderList,
    ProviderDelete,
    HealAllocations,
    FixOrphans,
    WorkerReady,
    OperationList,
    Drift,
    IdResolve,
    Changes,
}

/// Every subject the service answers, below the prefix (`q.health`, ..., `cmd.append`).
pub fn endpoint_subjects() -> Vec<&'static str> {
    Endpoint::ALL.iter().map(|e| e.suffix()).collect()
}

impl Endpoint {
    pub(crate) const ALL: [Endpoint; 20] = [
        Endpoint::Health,
        Endpoint::ClusterGet,
        Endpoint::ClusterList,
        Endpoint::InstanceGet,
        Endpoint::InstanceList,
        Endpoint::ProviderGet,
        Endpoint::AllocationByConsumer,
        Endpoint::OperationGet,
        Endpoint::History,
        Endpoint::StateAt,
        Endpoint::CmdAppend,
        Endpoint::ProviderList,
        Endpoint::ProviderDelete,
        Endpoint::HealAllocations,
        Endpoint::FixOrphans,
        Endpoint::WorkerReady,
        Endpoint::OperationList,
        Endpoint::Drift,
        Endpoint::IdResolve,
        Endpoint::Changes,
    ];

    /// The subject below the prefix, e.g. `q.cluster.get`.
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Endpoint::Health => "q.health",
            Endpoint::ClusterGet => "q.cluster.get",
            Endpoint::ClusterList => "q.cluster.list",
            Endpoint::InstanceGet => "q.instance.get",
            Endpoint::InstanceList => "q.instance.list",
            Endpoint::ProviderGet => "q.provider.get",
            Endpoint::AllocationByConsumer => "q.allocation.by_consumer",
            Endpoint::OperationGet => "q.operation.get",
            Endpoint::History => "q.history",
            Endpoint::StateAt => "q.state_at",
            Endpoint::CmdAppend => "cmd.append",
            Endpoint::ProviderList => "q.provider.list",
            Endpoint::ProviderDelete => "cmd.provider.delete",
            Endpoint::HealAllocations => "cmd.heal_allocations",
            Endpoint::FixOrphans => "cmd.fix_orphans",
            Endpoint::WorkerReady => "cmd.worker.ready",
            Endpoint::OperationList => "q.operation.list",
            Endpoint::Drift => "q.drift",
            Endpoint::IdResolve => "q.id.resolve",
            Endpoint::Changes => "q.changes",
        }
    }

    /// The micro-service endpoint name (letters, digits, `-` and `_` only).
    pub(crate) fn name(self) -> String {
        self.suffix().replace('.', "-")
    }
}

/// One of the [`MIN_POSITION_WAITS_MAX`] places to wait, given back on drop.
struct WaitSlot<'a>(&'a AtomicUsize);

impl<'a> WaitSlot<'a> {
    fn take(waits: &'a AtomicUsize) -> Option<WaitSlot<'a>> {
        waits
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MIN_POSITION_WAITS_MAX).then_some(n + 1)
            })
            .ok()
            .map(|_| WaitSlot(waits))
    }
}

impl Drop for WaitSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl QueryContext {
    /// `unavailable`: this replica's projector stopped, with the reason once serve knows it.
    fn projector_stopped(&self) -> QueryError {
        let reason = self
            .projector_failed
            .get()
            .map_or_else(|| "it ended".to_string(), Clone::clone);
        QueryError::new(
            ErrorCode::Unavailable,
            format!(
                "this replica's projector stopped ({reason}); it is exiting: ask another replica or restart it"
            ),
        )
    }

    /// Read-your-writes: waits (bounded in time, and in how many wait at once) until the
    /// projection has applied `min`.
    async fn wait_for(&self, min: Option<u64>) -> Result<(), QueryError> {
        let Some(min) = min else { return Ok(()) };
        if self.position() >= min {
            return Ok(());
        }
        // Beyond the bound, a wait would only hold a request slot that others (health,
        // commands) need: the answer is `stale` at once, as it would be after the wait.
        let Some(_waiting) = WaitSlot::take(&self.min_position_waits) else {
            let position = self.position();
            return Err(QueryError::new(
                ErrorCode::Stale,
                format!(
                    "applied up to position {position}, below min_position {min}; {MIN_POSITION_WAITS_MAX} queries already wait for a position (MIN_POSITION_WAITS_MAX); retry later"
                ),
            )
            .with("position", position.into()));
        };
        // Registered before the flag is read, so that a failure in between still wakes it.
        let stopped = self.projector_stopped.notified();
        tokio::pin!(stopped);
        stopped.as_mut().enable();
        if self.projector_failed.get().is_some() {
            return Err(self.projector_stopped());
        }
        let mut applied = self.applied.clone();
        let reached = tokio::select! {
            reached = tokio::time::timeout(
                self.min_position_wait,
                applied.wait_for(|p| *p >= min),
            ) => reached,
            () = stopped => return Err(self.projector_stopped()),
        };
        match reached {
            Ok(Ok(_)) => Ok(()),
            // The projector's end dropped its side: this replica will not get there.
            Ok(Err(_)) => Err(self.projector_stopped()),
            Err(_) => {
                let position = self.position();
                Err(QueryError::new(
                    ErrorCode::Stale,
                    format!(
                        "applied up to position {position}, below min_position {min} after waiting {} ms; retry later",
                        self.min_position_wait.as_millis()
                    ),
                )
                .with("position", position.into()))
            }
        }
    }

    pub(crate) async fn handle(
        &self,
        endpoint: Endpoint,
        payload: &[u8],
        caller: &caller::Caller,
    ) -> Result<Answer, QueryError> {
        if self.projector_failed.get().is_some() {
            return Err(self.projector_stopped());
        }
        // Each endpoint's future is boxed: unboxed, every request's task would be as large
        // as the largest endpoint's (9,840 bytes), and tokio moves a task's future several
        // times as it spawns and ends it (memmove was 20% of serve's request threads).
        let value = match endpoint {
            Endpoint::Health => Box::pin(health::health(self, payload)).await,
            Endpoint::ClusterGet => {
                Box::pin(entities::get(self, payload, AggregateKind::Cluster)).await
            }
            Endpoint::InstanceGet => {
                Box::pin(entities::get(self, payload, AggregateKind::Instance)).await
            }
            Endpoint::ProviderGet => {
                Box::pin(entities::get(self, payload, AggregateKind::Provider)).await
            }
            Endpoint::OperationGet => {
                Box::pin(entities::get(self, payload, AggregateKind::Operation)).await
            }
            Endpoint::ClusterList => entities::cluster_list(self, payload),
            Endpoint::InstanceList => entities::instance_list(self, payload),
            Endpoint::AllocationByConsumer => {
                Box::pin(allocation::by_consumer(self, payload)).await
            }
            Endpoint::History => Box::pin(history::history(self, payload)).await,
            Endpoint::StateAt => Box::pin(history::state_at(self, payload)).await,
            Endpoint::CmdAppend => Box::pin(append::append(self, payload, caller)).await,
            Endpoint::ProviderList => placement::provider_list(self, payload),
            Endpoint::ProviderDelete => {
                Box::pin(placement::provider_delete(self, payload, caller)).await
            }
            Endpoint::HealAllocations => Box::pin(placement::heal(self, payload, caller)).await,
            Endpoint::FixOrphans => Box::pin(placement::orphans(self, payload, caller)).await,
            Endpoint::WorkerReady => worker::ready(self, payload, caller),
            Endpoint::OperationList => entities::operation_list(self, payload),
            Endpoint::Drift => health::drift(self, payload),
            Endpoint::IdResolve => Box::pin(entities::id_resolve(self, payload)).await,
            // Written as JSON ahead: the one raw answer.
            Endpoint::Changes => {
                return Box::pin(changes::changes(self, payload))
                    .await
                    .map(Answer::Raw)
            }
        };
        value.map(Answer::Value)
    }
}
