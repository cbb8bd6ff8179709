//! The contract's error codes and the refusal every endpoint answers with.

use serde_json::{json, Map, Value};

use crate::store::StoreError;

/// The contract's error codes, stable at the NATS boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorCode {
    NotFound,
    BadRequest,
    Stale,
    Conflict,
    TargetDeleted,
    /// The append decider refused a write the fold would not apply; `reason` says why.
    Rejected,
    /// A stored commit breaks its aggregate's hash chain; `aggregate` and `version` name it.
    Integrity,
    Unavailable,
    Internal,
}

impl ErrorCode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ErrorCode::NotFound => "not_found",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Stale => "stale",
            ErrorCode::Conflict => "conflict",
            ErrorCode::TargetDeleted => "target_deleted",
            ErrorCode::Rejected => "rejected",
            ErrorCode::Integrity => "integrity",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Internal => "internal",
        }
    }

    /// The numeric `Nats-Service-Error-Code` header, HTTP-like as NATS micro services use.
    pub(crate) fn numeric(self) -> u16 {
        match self {
            ErrorCode::NotFound => 404,
            ErrorCode::BadRequest => 400,
            ErrorCode::Stale => 408,
            ErrorCode::Conflict => 409,
            ErrorCode::TargetDeleted => 410,
            ErrorCode::Rejected => 422,
            ErrorCode::Integrity => 502,
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }
}

/// A refused or failed request: a code, a message, and optional extra fields.
#[derive(Debug, Clone)]
pub(crate) struct QueryError {
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    pub(crate) extra: Map<String, Value>,
}

impl QueryError {
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        QueryError {
            code,
            message: message.into(),
            extra: Map::new(),
        }
    }

    pub(crate) fn with(mut self, field: &str, value: Value) -> Self {
        self.extra.insert(field.into(), value);
        self
    }

    pub(crate) fn body(&self) -> Value {
        let mut error = Map::new();
        error.insert("code".into(), self.code.as_str().into());
        error.insert("message".into(), self.message.clone().into());
        error.extend(self.extra.clone());
        json!({ "error": error })
    }
}

impl From<StoreError> for QueryError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Integrity(i) => QueryError::new(ErrorCode::Integrity, i.to_string())
                .with("aggregate", i.aggregate.to_string().into())
                .with("version", i.version.into())
                .with("position", i.position.into()),
            other => QueryError::new(ErrorCode::Internal, other.to_string()),
        }
    }
}

/// `bad_request` naming the field and what is wrong with it.
pub(crate) fn bad(field: &str, problem: impl std::fmt::Display) -> QueryError {
    QueryError::new(ErrorCode::BadRequest, format!("field `{field}`: {problem}"))
}
