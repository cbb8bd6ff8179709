//! `q.cluster.get`, `q.instance.get`, `q.provider.get`, `q.operation.get`,
//! `q.cluster.list`, `q.instance.list` and `q.operation.list`: projected entities, one or a
//! filtered page; `q.id.resolve`: which entities a short id names.

use provledger_events::{AggregateId, AggregateKind};
use provledger_projections::Entity;
use serde_json::Value;
use uuid::Uuid;

use super::error::{bad, ErrorCode, QueryError};
use super::request::parse;
use crate::messages::{
    ClusterListRequest, GetRequest, IdResolveData, IdResolveRequest, InstanceListRequest,
    OperationListRequest,
};
use crate::replica::QueryContext;
use crate::store::{OperationFilter, StoreError};

/// Default and maximum `limit` of the list endpoints.
const LIST_LIMIT_DEFAULT: usize = 100;
const LIST_LIMIT_MAX: usize = 1000;

/// The entity `id` of `kind`, once the projection has applied `min_position`.
pub(crate) async fn get(
    ctx: &QueryContext,
    payload: &[u8],
    kind: AggregateKind,
) -> Result<Value, QueryError> {
    let GetRequest {
        id,
        min_position,
        steps_from,
        compensations_from,
        parts_limit,
        allocations_after,
    } = parse(payload)?;
    let id = AggregateId::new(kind, id);
    if (steps_from.is_some() || compensations_from.is_some()) && kind != AggregateKind::Operation {
        return Err(bad(
            "steps_from",
            "`steps_from` and `compensations_from` page an operation's lists (q.operation.get only)",
        ));
    }
    if allocations_after.is_some() && kind != AggregateKind::Provider {
        return Err(bad(
            "allocations_after",
            "`allocations_after` pages a provider's allocations (q.provider.get only)",
        ));
    }
    if parts_limit.is_some() && !matches!(kind, AggregateKind::Operation | AggregateKind::Provider)
    {
        return Err(bad(
            "parts_limit",
            "`parts_limit` pages an operation's lists or a provider's allocations (q.operation.get and q.provider.get only)",
        ));
    }
    let parts = steps_from.is_some()
        || compensations_from.is_some()
        || parts_limit.is_some()
        || allocations_after.is_some();
    let limit = parts_limit.unwrap_or(PARTS_LIMIT_DEFAULT);
    if parts && !(1..=PARTS_LIMIT_MAX).contains(&limit) {
        return Err(bad("parts_limit", format!("must be 1..={PARTS_LIMIT_MAX}")));
    }
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    ctx.wait_for(min_position).await?;
    // Never the state folded before a loss as if it were the aggregate's.
    if let Some(loss) = ctx.store.open_loss(&id)? {
        return Err(loss.into());
    }
    match ctx.store.entity(&id)? {
        Some(Entity::Operation(op)) if parts => Ok(serde_json::to_value(
            provledger_projections::view::OperationView::of(&op).part(
                usize::try_from(steps_from.unwrap_or(0)).unwrap_or(usize::MAX),
                usize::try_from(compensations_from.unwrap_or(0)).unwrap_or(usize::MAX),
                limit,
            ),
        )
        .unwrap_or(Value::Null)),
        Some(Entity::Provider(provider)) if parts => Ok(serde_json::to_value(
            provledger_projections::view::ProviderView::part(&provider, allocations_after, limit),
        )
        .unwrap_or(Value::Null)),
        Some(entity) => Ok(entity.view()),
        None => Err(QueryError::new(
            ErrorCode::NotFound,
            format!("{id} has no commit in the log applied so far"),
        )),
    }
}

/// The aggregates a short id (or a prefix, or a whole id) names, through the store's id
/// index: a bounded range scan, whatever the store holds.
pub(crate) async fn id_resolve(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let IdResolveRequest {
        id,
        kind,
        min_position,
    } = parse(payload)?;
    let id: provledger_events::IdRef = id
        .parse()
        .map_err(|e: provledger_events::ids::InvalidText| bad("id", e.reason))?;
    ctx.wait_for(min_position).await?;
    let found = ctx.store.resolve_ids(kind, &id)?;
    Ok(super::error::to_data(&IdResolveData {
        matches: found.ids,
        more: found.more,
    }))
}

/// How many of each of an operation's lists, or of a provider's allocations, a part holds,
/// by default and at most.
const PARTS_LIMIT_DEFAULT: u64 = 100;
const PARTS_LIMIT_MAX: u64 = 1_000;

/// Clusters, optionally of one `status`.
pub(crate) fn cluster_list(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let ClusterListRequest {
        status,
        limit,
        after,
    } = parse(payload)?;
    list(ctx, AggregateKind::Cluster, limit, after, |e| {
        status.as_deref().is_none_or(|s| e.status_word() == s)
    })
}

/// Operations, newest first (ids are UUID v7: id order is start order), optionally in one
/// status (`needs_attention`: the rollbacks an operator must look at), of one kind, on one
/// target (`cluster/<uuid>`) or started since a time. Read through the store's operation
/// indexes, never by scanning every operation for a listing filtered by status, kind or
/// target; `after` goes on after that id, to older operations.
pub(crate) fn operation_list(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let OperationListRequest {
        status,
        kind,
        target,
        since,
        limit,
        after,
    } = parse(payload)?;
    let filter = OperationFilter {
        status,
        kind,
        target,
        since,
    };
    // Summaries, not views: one operation of thousands of steps must not fill the page
    // (or a reply) and hide the others; its view is `q.operation.get`.
    page(
        ctx,
        ctx.store.operations_newest_first(&filter, after),
        limit,
        |e| filter.accepts(e),
        summary,
    )
}

/// An operation as lists show it.
fn summary(entity: &Entity) -> Value {
    match entity {
        Entity::Operation(op) => {
            serde_json::to_value(provledger_projections::view::OperationSummary::of(op))
                .unwrap_or(Value::Null)
        }
        other => other.view(),
    }
}

/// Instances, optionally of one cluster, on one host or in one task state.
pub(crate) fn instance_list(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let InstanceListRequest {
        cluster_id: cluster,
        host,
        task_state: task,
        limit,
        after,
    } = parse(payload)?;
    list(ctx, AggregateKind::Instance, limit, after, |e| {
        let Entity::Instance(i) = e else { return false };
        cluster.is_none_or(|c| i.cluster_id == Some(c))
            && host.as_deref().is_none_or(|h| i.host.as_deref() == Some(h))
            && task.as_deref().is_none_or(|t| {
                serde_json::to_value(i.task_state).ok() == Some(Value::String(t.to_string()))
            })
    })
}

/// Up to `limit` entities of `kind` that `keep` accepts, in id order after `after`.
pub(super) fn list(
    ctx: &QueryContext,
    kind: AggregateKind,
    limit: Option<u64>,
    after: Option<Uuid>,
    keep: impl Fn(&Entity) -> bool,
) -> Result<Value, QueryError> {
    page(
        ctx,
        ctx.store.entities_of(kind, after),
        limit,
        keep,
        Entity::view,
    )
}

/// Up to `limit` of `entities` that `keep` accepts, bounded by the reply's bytes too.
fn page(
    ctx: &QueryContext,
    entities: impl Iterator<Item = Result<Entity, StoreError>>,
    limit: Option<u64>,
    keep: impl Fn(&Entity) -> bool,
    render: impl Fn(&Entity) -> Value,
) -> Result<Value, QueryError> {
    let limit = limit.map_or(LIST_LIMIT_DEFAULT, |l| l as usize);
    if limit == 0 || limit > LIST_LIMIT_MAX {
        return Err(bad("limit", format!("must be 1..={LIST_LIMIT_MAX}")));
    }
    let budget = ctx.page_bytes_max();
    let mut items = Vec::new();
    let mut bytes = 0;
    for entity in entities {
        let entity = entity?;
        if keep(&entity) {
            let view = render(&entity);
            let size = serde_json::to_vec(&view).map_or(0, |v| v.len());
            // A page is bounded by bytes as well as by count: it ends before the entity
            // that would not fit (the caller goes on with `after`). A single entity
            // larger than a page is still sent, and refused as too large if it is.
            if !items.is_empty() && bytes + size > budget {
                break;
            }
            bytes += size;
            items.push(view);
            if items.len() == limit {
                break;
            }
        }
    }
    Ok(Value::Array(items))
}
