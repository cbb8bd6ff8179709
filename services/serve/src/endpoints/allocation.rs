//! `q.allocation.by_consumer`: what every provider has allocated to one consumer.

use provledger_events::AggregateId;
use provledger_projections::Entity;
use serde_json::Value;

use super::error::{to_data, QueryError};
use super::request::parse;
use crate::messages::{AllocationByConsumerRequest, ConsumerAllocation};
use crate::replica::QueryContext;

pub(crate) async fn by_consumer(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let AllocationByConsumerRequest {
        consumer,
        min_position,
    } = parse(payload)?;
    ctx.wait_for(min_position).await?;
    let mut out = Vec::new();
    for provider in ctx.store.providers_of_consumer(&consumer)? {
        let id = AggregateId::provider(provider);
        if let Some(Entity::Provider(p)) = ctx.store.entity(&id)? {
            if let Some(a) = p.allocations.get(&consumer) {
                out.push(ConsumerAllocation {
                    provider_id: provider,
                    provider_name: p.name.clone(),
                    consumer,
                    consumer_kind: a.consumer_kind,
                    resources: a.resources.to_map(),
                });
            }
        }
    }
    Ok(to_data(&out))
}
