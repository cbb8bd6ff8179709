//! The query and command endpoints: request parsing, the answers, and the contract's
//! error codes. Every request is JSON; a malformed one answers `bad_request` naming the
//! field.

use std::time::Duration;

use provledger_events::{
    AggregateId, AggregateKind, AppendError, CommitDraft, Event, EventLog, Expectation,
    JetStreamLog, Timestamp,
};
use provledger_projections::decide::{admit_append, AppendRejection};
use provledger_projections::{timeline, Entity};
use serde_json::{json, Map, Value};
use tokio::sync::watch;
use uuid::Uuid;

use crate::store::{ProjectionStore, StoreError};

/// Default and maximum `limit` of the list endpoints.
pub const LIST_LIMIT_DEFAULT: usize = 100;
pub const LIST_LIMIT_MAX: usize = 1000;

/// The contract's error codes, stable at the NATS boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    NotFound,
    BadRequest,
    Stale,
    Conflict,
    TargetDeleted,
    Unavailable,
    Internal,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NotFound => "not_found",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Stale => "stale",
            ErrorCode::Conflict => "conflict",
            ErrorCode::TargetDeleted => "target_deleted",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        }
    }

    /// The numeric `Nats-Service-Error-Code` header, HTTP-like as NATS micro services use.
    pub fn numeric(self) -> u16 {
        match self {
            ErrorCode::NotFound => 404,
            ErrorCode::BadRequest => 400,
            ErrorCode::Stale => 408,
            ErrorCode::Conflict => 409,
            ErrorCode::TargetDeleted => 410,
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }
}

/// A refused or failed request: a code, a message, and optional extra fields.
#[derive(Debug, Clone)]
pub struct QueryError {
    pub code: ErrorCode,
    pub message: String,
    pub extra: Map<String, Value>,
}

impl QueryError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        QueryError {
            code,
            message: message.into(),
            extra: Map::new(),
        }
    }

    fn with(mut self, field: &str, value: Value) -> Self {
        self.extra.insert(field.into(), value);
        self
    }

    pub fn body(&self) -> Value {
        let mut error = Map::new();
        error.insert("code".into(), self.code.as_str().into());
        error.insert("message".into(), self.message.clone().into());
        error.extend(self.extra.clone());
        json!({ "error": error })
    }
}

impl From<StoreError> for QueryError {
    fn from(e: StoreError) -> Self {
        QueryError::new(ErrorCode::Internal, e.to_string())
    }
}

fn bad(field: &str, problem: impl std::fmt::Display) -> QueryError {
    QueryError::new(ErrorCode::BadRequest, format!("field `{field}`: {problem}"))
}

/// The endpoints under `<prefix>.q.` and `<prefix>.cmd.`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
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
}

impl Endpoint {
    pub const ALL: [Endpoint; 11] = [
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
    ];

    /// The subject below the prefix, e.g. `q.cluster.get`.
    pub fn suffix(self) -> &'static str {
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
        }
    }

    /// The micro-service endpoint name (letters, digits, `-` and `_` only).
    pub fn name(self) -> String {
        self.suffix().replace('.', "-")
    }
}

/// What every handler reads.
pub struct QueryContext {
    pub store: ProjectionStore,
    pub applied: watch::Receiver<u64>,
    pub log: JetStreamLog,
    pub stream: String,
    pub served_by: String,
    pub min_position_wait: Duration,
}

fn object(payload: &[u8]) -> Result<Map<String, Value>, QueryError> {
    if payload.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(payload) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(QueryError::new(
            ErrorCode::BadRequest,
            "the request must be a JSON object",
        )),
        Err(e) => Err(QueryError::new(
            ErrorCode::BadRequest,
            format!("the request is not JSON: {e}"),
        )),
    }
}

fn opt_str<'a>(req: &'a Map<String, Value>, field: &str) -> Result<Option<&'a str>, QueryError> {
    match req.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(bad(field, format!("expected a string, got {other}"))),
    }
}

fn opt_u64(req: &Map<String, Value>, field: &str) -> Result<Option<u64>, QueryError> {
    match req.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(field, format!("expected a non-negative integer, got {v}"))),
    }
}

fn req_uuid(req: &Map<String, Value>, field: &str) -> Result<Uuid, QueryError> {
    let s = opt_str(req, field)?.ok_or_else(|| bad(field, "missing"))?;
    Uuid::parse_str(s).map_err(|e| bad(field, format!("not a UUID: {e}")))
}

fn opt_uuid(req: &Map<String, Value>, field: &str) -> Result<Option<Uuid>, QueryError> {
    opt_str(req, field)?
        .map(|s| Uuid::parse_str(s).map_err(|e| bad(field, format!("not a UUID: {e}"))))
        .transpose()
}

fn req_aggregate(req: &Map<String, Value>) -> Result<AggregateId, QueryError> {
    let s = opt_str(req, "aggregate")?.ok_or_else(|| bad("aggregate", "missing"))?;
    s.parse().map_err(|e| bad("aggregate", e))
}

fn check_fields(req: &Map<String, Value>, allowed: &[&str]) -> Result<(), QueryError> {
    match req.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(unknown) => Err(bad(
            unknown,
            format!("unknown field; expected one of {}", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}

impl QueryContext {
    pub fn position(&self) -> u64 {
        *self.applied.borrow()
    }

    /// Read-your-writes: waits (bounded) until the projection has applied `min`.
    async fn wait_for(&self, min: Option<u64>) -> Result<(), QueryError> {
        let Some(min) = min else { return Ok(()) };
        let mut applied = self.applied.clone();
        let reached = tokio::time::timeout(self.min_position_wait, applied.wait_for(|p| *p >= min))
            .await
            .is_ok_and(|r| r.is_ok());
        match reached {
            true => Ok(()),
            false => {
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

    async fn get(&self, req: &[u8], kind: AggregateKind) -> Result<Value, QueryError> {
        let req = object(req)?;
        check_fields(&req, &["id", "min_position"])?;
        let id = AggregateId::new(kind, req_uuid(&req, "id")?);
        self.wait_for(opt_u64(&req, "min_position")?).await?;
        match self.store.entity(&id)? {
            Some(entity) => Ok(entity.view()),
            None => Err(QueryError::new(
                ErrorCode::NotFound,
                format!("{id} has no commit in the log applied so far"),
            )),
        }
    }

    fn list(
        &self,
        req: &Map<String, Value>,
        kind: AggregateKind,
        keep: impl Fn(&Entity) -> bool,
    ) -> Result<Value, QueryError> {
        let limit = opt_u64(req, "limit")?.map_or(LIST_LIMIT_DEFAULT, |l| l as usize);
        if limit == 0 || limit > LIST_LIMIT_MAX {
            return Err(bad("limit", format!("must be 1..={LIST_LIMIT_MAX}")));
        }
        let after = opt_uuid(req, "after")?;
        let mut items = Vec::new();
        for entity in self.store.entities_of(kind, after) {
            let entity = entity?;
            if keep(&entity) {
                items.push(entity.view());
                if items.len() == limit {
                    break;
                }
            }
        }
        Ok(Value::Array(items))
    }

    async fn health(&self) -> Result<Value, QueryError> {
        let position = self.position();
        let end = self
            .log
            .last_position()
            .await
            .map_err(|e| QueryError::new(ErrorCode::Unavailable, e.to_string()))?;
        Ok(json!({
            "position": position,
            "stream": self.stream,
            "nats_server_version": self.log.server_version(),
            "lag": end.saturating_sub(position),
            "quarantined": self.store.quarantine_count(),
            "snapshots": self.store.snapshots()?,
            "served_by": self.served_by,
        }))
    }

    pub async fn handle(&self, endpoint: Endpoint, payload: &[u8]) -> Result<Value, QueryError> {
        match endpoint {
            Endpoint::Health => {
                check_fields(&object(payload)?, &[])?;
                self.health().await
            }
            Endpoint::ClusterGet => self.get(payload, AggregateKind::Cluster).await,
            Endpoint::InstanceGet => self.get(payload, AggregateKind::Instance).await,
            Endpoint::ProviderGet => self.get(payload, AggregateKind::Provider).await,
            Endpoint::OperationGet => self.get(payload, AggregateKind::Operation).await,
            Endpoint::ClusterList => {
                let req = object(payload)?;
                check_fields(&req, &["status", "limit", "after"])?;
                let status = opt_str(&req, "status")?.map(str::to_string);
                self.list(&req, AggregateKind::Cluster, |e| {
                    status.as_deref().is_none_or(|s| e.status_word() == s)
                })
            }
            Endpoint::InstanceList => {
                let req = object(payload)?;
                check_fields(
                    &req,
                    &["cluster_id", "host", "task_state", "limit", "after"],
                )?;
                let cluster = opt_uuid(&req, "cluster_id")?;
                let host = opt_str(&req, "host")?.map(str::to_string);
                let task = opt_str(&req, "task_state")?.map(str::to_string);
                self.list(&req, AggregateKind::Instance, |e| {
                    let Entity::Instance(i) = e else { return false };
                    cluster.is_none_or(|c| i.cluster_id == Some(c))
                        && host.as_deref().is_none_or(|h| i.host.as_deref() == Some(h))
                        && task.as_deref().is_none_or(|t| {
                            serde_json::to_value(i.task_state).ok()
                                == Some(Value::String(t.to_string()))
                        })
                })
            }
            Endpoint::AllocationByConsumer => {
                let req = object(payload)?;
                check_fields(&req, &["consumer", "min_position"])?;
                let consumer = req_uuid(&req, "consumer")?;
                self.wait_for(opt_u64(&req, "min_position")?).await?;
                let mut out = Vec::new();
                for provider in self.store.providers_of_consumer(&consumer)? {
                    let id = AggregateId::provider(provider);
                    if let Some(Entity::Provider(p)) = self.store.entity(&id)? {
                        if let Some(a) = p.allocations.get(&consumer) {
                            out.push(json!({
                                "provider_id": provider,
                                "provider_name": p.name,
                                "consumer": consumer,
                                "consumer_kind": a.consumer_kind,
                                "resources": a.resources,
                            }));
                        }
                    }
                }
                Ok(Value::Array(out))
            }
            Endpoint::History => {
                let req = object(payload)?;
                check_fields(&req, &["aggregate", "min_position"])?;
                let id = req_aggregate(&req)?;
                self.wait_for(opt_u64(&req, "min_position")?).await?;
                let commits = self.store.aggregate_commits(&id, u64::MAX)?;
                if commits.is_empty() {
                    return Err(QueryError::new(
                        ErrorCode::NotFound,
                        format!("{id} has no commit"),
                    ));
                }
                Ok(Value::Array(
                    commits
                        .iter()
                        .map(|c| {
                            let mut v = serde_json::to_value(c).unwrap_or(Value::Null);
                            v["timeline"] = json!(timeline::render(c));
                            v
                        })
                        .collect(),
                ))
            }
            Endpoint::StateAt => {
                let req = object(payload)?;
                check_fields(&req, &["aggregate", "position", "time"])?;
                let id = req_aggregate(&req)?;
                let position = match (opt_u64(&req, "position")?, opt_str(&req, "time")?) {
                    (Some(_), Some(_)) => {
                        return Err(bad("time", "give either position or time, not both"))
                    }
                    (Some(p), None) => p,
                    (None, Some(t)) => {
                        let at = Timestamp::parse_rfc3339(t).map_err(|e| bad("time", e))?;
                        self.store.position_at_time(at)?
                    }
                    (None, None) => self.position(),
                };
                match self.store.entity_at(&id, position)? {
                    Some(e) => Ok(json!({ "at_position": position, "state": e.view() })),
                    None => Err(QueryError::new(
                        ErrorCode::NotFound,
                        format!("{id} has no commit at or before position {position}"),
                    )),
                }
            }
            Endpoint::CmdAppend => self.append(payload).await,
        }
    }

    /// `cmd.append` for publishers not written in Rust: validated against the catalogue
    /// and the target's state, then appended like any other writer would.
    async fn append(&self, payload: &[u8]) -> Result<Value, QueryError> {
        let req = object(payload)?;
        check_fields(
            &req,
            &[
                "aggregate",
                "expect",
                "commit_id",
                "operation_id",
                "causation_id",
                "actor",
                "events",
            ],
        )?;
        let aggregate = req_aggregate(&req)?;
        let expect = match req.get("expect") {
            None => return Err(bad("expect", "missing")),
            Some(Value::Number(n)) => n
                .as_u64()
                .map(Expectation::Exactly)
                .ok_or_else(|| bad("expect", "must be \"any\", \"none\" or a version"))?,
            Some(Value::String(s)) => s.parse().map_err(|e| bad("expect", e))?,
            Some(other) => return Err(bad("expect", format!("unexpected {other}"))),
        };
        let events_json = req.get("events").ok_or_else(|| bad("events", "missing"))?;
        let events: Vec<Event> = serde_json::from_value(events_json.clone())
            .map_err(|e| bad("events", format!("not catalogue events: {e}")))?;
        let mut draft =
            CommitDraft::now(opt_str(&req, "actor")?.unwrap_or("nats:cmd.append"), events);
        if let Some(id) = opt_uuid(&req, "commit_id")? {
            draft.commit_id = id;
        }
        draft.operation_id = opt_uuid(&req, "operation_id")?;
        draft.causation_id = opt_uuid(&req, "causation_id")?;
        draft
            .validate(&aggregate)
            .map_err(|e| bad("events", e.to_string()))?;
        let current = self.store.entity(&aggregate)?;
        admit_append(current.as_ref(), &draft.events).map_err(|e| match e {
            AppendRejection::TargetDeleted { .. } => {
                QueryError::new(ErrorCode::TargetDeleted, e.to_string())
            }
        })?;
        match self.log.append(aggregate, expect, draft).await {
            Ok(outcome) => Ok(json!({
                "position": outcome.position,
                "version": outcome.version,
                "already_appended": matches!(outcome.status, provledger_events::AppendStatus::AlreadyAppended),
            })),
            Err(AppendError::Conflict { actual, .. }) => Err(QueryError::new(
                ErrorCode::Conflict,
                format!("{aggregate} is at version {actual}, not {expect}; re-read and retry"),
            )
            .with("actual_version", actual.into())),
            Err(e @ AppendError::CommitIdReused { .. }) => {
                Err(QueryError::new(ErrorCode::Conflict, e.to_string()))
            }
            Err(e @ (AppendError::Invalid(_) | AppendError::Encode(_))) => {
                Err(bad("events", e.to_string()))
            }
            Err(e @ AppendError::Unavailable { .. }) => {
                Err(QueryError::new(ErrorCode::Unavailable, e.to_string()))
            }
            Err(e @ AppendError::Corrupt { .. }) => {
                Err(QueryError::new(ErrorCode::Internal, e.to_string()))
            }
        }
    }
}
