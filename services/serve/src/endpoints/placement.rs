//! `q.provider.list`, `cmd.provider.delete`, `cmd.heal_allocations` and
//! `cmd.fix_orphans`: placement for services that are not written in Rust, through the
//! client library's placement writes (decided from the log, at exact versions).

use provledger_client::placement::{
    delete_provider, fix_orphans, heal_allocations, PlacementError, ProviderDeletion,
};
use provledger_client::Stamper;
use provledger_events::AggregateKind;
use provledger_projections::Entity;
use serde_json::{json, Map, Value};

use super::caller::Caller;
use super::error::{bad, ErrorCode, QueryError};
use super::request::{check_fields, object, opt_str, opt_uuid, req_uuid};
use super::QueryContext;

fn placement_error(e: PlacementError) -> QueryError {
    match e {
        PlacementError::NotFound(_) => QueryError::new(ErrorCode::NotFound, e.to_string()),
        PlacementError::Read(_) | PlacementError::Contended { .. } => {
            QueryError::new(ErrorCode::Unavailable, e.to_string())
        }
        PlacementError::Write(w) => QueryError::new(ErrorCode::Unavailable, w.to_string()),
    }
}

fn opt_bool(req: &Map<String, Value>, field: &str) -> Result<bool, QueryError> {
    match req.get(field) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(bad(field, format!("must be true or false, not {other}"))),
    }
}

fn actor(req: &Map<String, Value>, caller: &Caller, default: &str) -> Result<String, QueryError> {
    Ok(caller.actor(opt_str(req, "actor")?, default))
}

/// Providers, optionally of one `status` or `host`, in id order after `after`.
pub(crate) fn provider_list(ctx: &QueryContext, payload: &[u8]) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(&req, &["status", "host", "limit", "after"])?;
    let status = opt_str(&req, "status")?.map(str::to_string);
    let host = opt_str(&req, "host")?.map(str::to_string);
    super::entities::list(ctx, &req, AggregateKind::Provider, |e| {
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
    let req = object(payload)?;
    check_fields(&req, &["id", "cascade", "actor"])?;
    let id = req_uuid(&req, "id")?;
    let cascade = opt_bool(&req, "cascade")?;
    let actor = actor(&req, caller, "nats:cmd.provider.delete")?;
    match delete_provider(&ctx.log, id, cascade, &actor, &Stamper::system())
        .await
        .map_err(placement_error)?
    {
        ProviderDeletion::Deleted { released } => {
            Ok(json!({"outcome": "deleted", "released": released}))
        }
        ProviderDeletion::AlreadyDeleted => Ok(json!({"outcome": "already_deleted"})),
        ProviderDeletion::Refused { holds } => Err(QueryError::new(
            ErrorCode::Conflict,
            format!(
                "provider {id} holds {} allocation(s); nothing was written: release them (see holds) or send cascade: true",
                holds.len()
            ),
        )
        .with("reason", "allocations_remain".into())
        .with("holds", serde_json::to_value(&holds).unwrap_or_default())),
    }
}

/// heal-allocations: `{dry_run?, instance?}`.
pub(crate) async fn heal(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(&req, &["dry_run", "instance", "actor"])?;
    let dry_run = opt_bool(&req, "dry_run")?;
    let instance = opt_uuid(&req, "instance")?;
    let actor = actor(&req, caller, "nats:cmd.heal_allocations")?;
    let report = heal_allocations(&ctx.log, instance, dry_run, &actor, &Stamper::system())
        .await
        .map_err(placement_error)?;
    let mut v = serde_json::to_value(&report).unwrap_or_default();
    v["dry_run"] = dry_run.into();
    Ok(v)
}

/// Releases the orphan allocations, only those: `{dry_run?}`.
pub(crate) async fn orphans(
    ctx: &QueryContext,
    payload: &[u8],
    caller: &Caller,
) -> Result<Value, QueryError> {
    let req = object(payload)?;
    check_fields(&req, &["dry_run", "actor"])?;
    let dry_run = opt_bool(&req, "dry_run")?;
    let actor = actor(&req, caller, "nats:cmd.fix_orphans")?;
    let found = fix_orphans(&ctx.log, dry_run, &actor, &Stamper::system())
        .await
        .map_err(placement_error)?;
    Ok(json!({
        "dry_run": dry_run,
        "orphans": found
            .iter()
            .map(|(provider, hold)| json!({"provider": provider, "hold": hold}))
            .collect::<Vec<_>>(),
    }))
}
