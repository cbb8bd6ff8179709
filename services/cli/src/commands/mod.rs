//! The `provledger` subcommands. Each returns a [`CommandError`] whose exit code follows the
//! contract: 1 = ran and found a problem, 2 = bad usage or input, 3 = infrastructure.

pub mod append;
pub mod audit;
pub mod backup;
pub mod completions;
#[cfg(feature = "demo")]
pub mod demo;
pub mod drift;
pub mod history;
pub mod ids;
pub mod integrity;
pub mod invocation;
pub mod operation;
pub mod placement;
pub mod query;
pub mod recover;
pub mod replay;
pub mod rollback;
pub mod serve;
pub mod signals;
#[cfg(feature = "demo")]
pub mod simulate;
pub mod state;
pub mod watch;

use provledger_client::write::RecordError;
use provledger_client::OpenLedgerError;
use provledger_events::log::{OpenJetStreamError, OpenSledError};
use provledger_events::{AppendError, LossRefusal, ReadError};

/// A failed command: what went wrong, what to do, and the exit code.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// The command ran and found a problem (a conflict, not found, a violation).
    #[error("{0}")]
    Problem(String),
    /// Bad usage or bad input.
    #[error("{0}")]
    BadInput(String),
    /// NATS unreachable, data dir locked, storage failing.
    #[error("{0}")]
    Infrastructure(String),
    /// The command ran and there was nothing to do (heal-allocations, as nova-manage).
    #[error("{0}")]
    NothingToDo(String),
}

impl CommandError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CommandError::Problem(_) => 1,
            CommandError::BadInput(_) => 2,
            CommandError::Infrastructure(_) => 3,
            CommandError::NothingToDo(_) => 4,
        }
    }

    /// The stable word for the exit code, in `--json` errors.
    pub fn code(&self) -> &'static str {
        match self {
            CommandError::Problem(_) => "problem",
            CommandError::BadInput(_) => "bad_input",
            CommandError::Infrastructure(_) => "infrastructure",
            CommandError::NothingToDo(_) => "nothing_to_do",
        }
    }

    /// The error as `--json` prints it: `{"error": {"code", "exit_code", "message"}}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "code": self.code(),
                "exit_code": self.exit_code(),
                "message": self.to_string(),
            }
        })
    }
}

impl From<OpenLedgerError> for CommandError {
    fn from(e: OpenLedgerError) -> Self {
        match e {
            OpenLedgerError::JetStream(OpenJetStreamError::StreamConfigMismatch { .. }) => {
                CommandError::Problem(e.to_string())
            }
            OpenLedgerError::BadNatsUrl { .. } | OpenLedgerError::BadNatsAuth { .. } => {
                CommandError::BadInput(e.to_string())
            }
            // Nothing at the place given: like an aggregate not found, the command ran and
            // found no ledger there (exit 1, as `history` of a missing aggregate).
            OpenLedgerError::JetStream(OpenJetStreamError::StreamNotFound { .. })
            | OpenLedgerError::Sled(OpenSledError::NoDataDir { .. }) => {
                CommandError::Problem(e.to_string())
            }
            OpenLedgerError::JetStream(OpenJetStreamError::SubjectsTaken { .. }) => {
                CommandError::BadInput(e.to_string())
            }
            // Held by another process, perhaps the production service: say who, and how
            // to ask it instead.
            OpenLedgerError::Sled(OpenSledError::Locked { dir, holder }) => {
                CommandError::Infrastructure(invocation::current().locked_message(&dir, &holder))
            }
            other => CommandError::Infrastructure(other.to_string()),
        }
    }
}

impl From<AppendError> for CommandError {
    fn from(e: AppendError) -> Self {
        match e {
            AppendError::Conflict { .. }
            | AppendError::Conflicts { .. }
            | AppendError::CommitIdReused { .. } => CommandError::Problem(e.to_string()),
            AppendError::Invalid(_) | AppendError::Encode(_) | AppendError::InvalidBatch(_) => {
                CommandError::BadInput(e.to_string())
            }
            AppendError::Corrupt { .. } => CommandError::Problem(e.to_string()),
            AppendError::Loss(LossRefusal::Lost(_)) => CommandError::Problem(e.to_string()),
            AppendError::Loss(LossRefusal::NotAnOpenLoss { .. }) => {
                CommandError::BadInput(e.to_string())
            }
            AppendError::Unavailable { .. } => CommandError::Infrastructure(e.to_string()),
        }
    }
}

impl From<RecordError> for CommandError {
    fn from(e: RecordError) -> Self {
        match e {
            // A refusal is the command finding a problem, like a conflict: exit 1.
            RecordError::Rejected(_)
            | RecordError::Conflict { .. }
            | RecordError::Conflicts { .. }
            | RecordError::Rejections { .. }
            | RecordError::PermissionDenied { .. } => CommandError::Problem(e.to_string()),
            RecordError::Contended { .. } => CommandError::Infrastructure(e.to_string()),
            RecordError::Append(e) => e.into(),
            RecordError::Read(e) => e.into(),
        }
    }
}

impl From<ReadError> for CommandError {
    fn from(e: ReadError) -> Self {
        match e {
            ReadError::Undecodable { .. } | ReadError::OutsideChain { .. } | ReadError::Lost(_) => {
                CommandError::Problem(e.to_string())
            }
            ReadError::Unavailable { .. } => CommandError::Infrastructure(e.to_string()),
        }
    }
}

/// Prints one JSON document on stdout.
pub fn print_json(value: &serde_json::Value) {
    match serde_json::to_string_pretty(value) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("cannot render JSON: {e}"),
    }
}

/// Text from outside (an executor's resource names and error messages) as a terminal may
/// show it: control characters (an escape sequence could rewrite the operator's screen or
/// forge lines) are written as Rust escapes; everything else is left as it is.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn text_from_outside_cannot_drive_the_terminal() {
        // Given an executor's text with an escape sequence, a newline and a bell...
        let hostile = "vm-1\u{1b}[2J\nfixed: nothing leaked\u{7}";
        // ...when it is made printable, then no control character is left, and what it
        // said is still readable.
        let shown = printable(hostile);
        assert!(!shown.chars().any(char::is_control), "{shown}");
        assert_eq!(shown, "vm-1\\u{1b}[2J\\nfixed: nothing leaked\\u{7}");
        // ...and ordinary text is shown as it is.
        assert_eq!(printable("vm-1 é"), "vm-1 é");
    }
}
