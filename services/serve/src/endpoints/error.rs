//! The refusal every endpoint answers with, in the contract's error codes
//! (`messages::ErrorCode`).

use serde_json::{json, Map, Value};

pub(crate) use crate::messages::ErrorCode;
use crate::store::StoreError;

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

    pub(crate) fn code(&self) -> ErrorCode {
        self.code
    }

    /// The error's own fields: `code`, `message` and whatever else it carries.
    pub(crate) fn fields(&self) -> Map<String, Value> {
        let mut error = Map::new();
        error.insert("code".into(), self.code.as_str().into());
        error.insert("message".into(), bounded(&self.message).into());
        error.extend(self.extra.clone());
        error
    }

    pub(crate) fn body(&self) -> Value {
        json!({ "error": self.fields() })
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

/// A loss in the aggregate's chain (`provledger_events::loss`): `integrity`, naming the
/// missing versions and where the commit after them lies.
impl From<provledger_events::LostVersions> for QueryError {
    fn from(l: provledger_events::LostVersions) -> Self {
        QueryError::new(ErrorCode::Integrity, format!("integrity: {l}"))
            .with("aggregate", l.aggregate.to_string().into())
            .with("version", l.from_version.into())
            .with("lost_to_version", l.to_version.into())
            .with("position", l.next_position.into())
    }
}

/// The longest error message sent: a message may echo the request (an aggregate string of
/// megabytes), and an error must always fit in a reply.
pub(crate) const ERROR_MESSAGE_BYTES_MAX: usize = 1024;

/// `message` cut to [`ERROR_MESSAGE_BYTES_MAX`] bytes on a character boundary, saying so.
pub(crate) fn bounded(message: &str) -> String {
    if message.len() <= ERROR_MESSAGE_BYTES_MAX {
        return message.to_string();
    }
    let mut end = ERROR_MESSAGE_BYTES_MAX;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes cut)", &message[..end], message.len() - end)
}

/// `bad_request` naming the field and what is wrong with it.
pub(crate) fn bad(field: &str, problem: impl std::fmt::Display) -> QueryError {
    QueryError::new(ErrorCode::BadRequest, format!("field `{field}`: {problem}"))
}

/// A reply's data from its message type (`crate::messages`). These types serialize to
/// JSON whatever their values (string keys, no fallible impls), so a failure is a bug.
pub(crate) fn to_data<T: serde::Serialize>(data: &T) -> Value {
    serde_json::to_value(data).expect("a reply message serializes to JSON")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [ErrorCode; 10] = [
        ErrorCode::NotFound,
        ErrorCode::BadRequest,
        ErrorCode::Stale,
        ErrorCode::Conflict,
        ErrorCode::TargetDeleted,
        ErrorCode::Rejected,
        ErrorCode::Integrity,
        ErrorCode::TooLarge,
        ErrorCode::Unavailable,
        ErrorCode::Internal,
    ];

    #[test]
    fn the_word_sent_is_the_word_the_error_schema_documents() {
        // Given every error code
        for code in ALL {
            // When it is sent (`as_str`) and when the schema's enum is derived (serde)
            let documented = serde_json::to_value(code).expect("a code is JSON");
            // Then both say the same word
            assert_eq!(documented, Value::from(code.as_str()), "{code:?}");
        }
    }
}
