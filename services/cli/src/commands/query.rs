//! `provledger query ENDPOINT [JSON]`: one request to a running service.

use std::time::Duration;

use super::{print_json, CommandError};

/// `query --help`'s description of ENDPOINT: every endpoint the service answers, from
/// serve's own list (`provledger_serve::endpoint_subjects`), so that it cannot leave one out.
pub fn endpoints_help() -> String {
    let names: Vec<&str> = provledger_serve::endpoint_subjects()
        .into_iter()
        .map(|s| s.strip_prefix("q.").unwrap_or(s))
        .collect();
    format!(
        "The endpoint, one of: {} (a query's `q.` may be left out)",
        names.join(", ")
    )
}

/// The subject suffix for an endpoint given as `cluster.get`, `q.cluster.get` or
/// `cmd.append`, if the service has that endpoint.
fn suffix_of(endpoint: &str) -> Result<String, CommandError> {
    let suffix = if endpoint.starts_with("q.") || endpoint.starts_with("cmd.") {
        endpoint.to_string()
    } else {
        format!("q.{endpoint}")
    };
    let known = provledger_serve::endpoint_subjects();
    if known.contains(&suffix.as_str()) {
        return Ok(suffix);
    }
    let names: Vec<&str> = known
        .iter()
        .map(|s| s.strip_prefix("q.").unwrap_or(s))
        .collect();
    Err(CommandError::BadInput(format!(
        "unknown endpoint {endpoint:?}; the service answers: {}",
        names.join(", ")
    )))
}

pub async fn run(
    nats_url: &str,
    auth: &provledger_client::NatsAuth,
    prefix: &str,
    endpoint: &str,
    request: Option<String>,
    timeout: Duration,
) -> Result<(), CommandError> {
    let suffix = suffix_of(endpoint)?;
    provledger_client::parse_nats_urls(nats_url)?;
    let body = request.unwrap_or_else(|| "{}".to_string());
    if let Err(e) = serde_json::from_str::<serde_json::Value>(&body) {
        return Err(CommandError::BadInput(format!(
            "the request is not JSON: {e}"
        )));
    }
    let value = ask(nats_url, auth, &format!("{prefix}.{suffix}"), body, timeout).await?;
    print_json(&value);
    refusal(&value)
}

/// One request to the service on `subject`, waiting at most `timeout`: its reply as JSON
/// (a refusal too: see [`refusal`]), or why no reply came, saying what to do.
pub async fn ask(
    nats_url: &str,
    auth: &provledger_client::NatsAuth,
    subject: &str,
    body: String,
    timeout: Duration,
) -> Result<serde_json::Value, CommandError> {
    let client = provledger_client::connect_nats(nats_url, "provledger-query", auth)
        .await
        .map_err(|e| match e {
            // A query needs the service: running embedded (without --nats) is no way out.
            provledger_client::OpenLedgerError::NatsUnreachable { url, reason } => {
                CommandError::Infrastructure(format!(
                    "NATS unreachable at {url}: {reason}; give --nats the URL of the NATS server \
                     that `provledger serve` runs against"
                ))
            }
            other => other.into(),
        })?;
    let no_service = "start `provledger serve` against this NATS, with the same --subject-prefix";
    let reply = tokio::time::timeout(timeout, client.request(subject.to_string(), body.into()))
        .await
        .map_err(|_| {
            CommandError::Infrastructure(format!(
                "no answer on {subject} within {}; is `provledger serve` running against this \
                 NATS? (a longer --timeout waits more)",
                humantime::format_duration(timeout)
            ))
        })?
        .map_err(|e| {
            let why = match e.kind() {
                async_nats::RequestErrorKind::NoResponders => {
                    format!("no service answers on {subject}; {no_service}")
                }
                async_nats::RequestErrorKind::TimedOut => {
                    format!("no answer on {subject} in time; {no_service}")
                }
                _ => format!("request on {subject} failed: {e}"),
            };
            CommandError::Infrastructure(why)
        })?;
    serde_json::from_slice(&reply.payload)
        .map_err(|e| CommandError::Problem(format!("the service's reply is not JSON: {e}")))
}

/// The service's refusal in a reply, as the command's error (exit 2 for `bad_request`, 3
/// for `unavailable`, 1 for the others); `Ok` for an answer.
pub fn refusal(value: &serde_json::Value) -> Result<(), CommandError> {
    match value["error"]["code"].as_str() {
        None => Ok(()),
        Some("bad_request") => Err(CommandError::BadInput(format!(
            "bad_request: {}",
            value["error"]["message"]
        ))),
        Some("unavailable") => Err(CommandError::Infrastructure(format!(
            "unavailable: {}",
            value["error"]["message"]
        ))),
        Some(code) => Err(CommandError::Problem(format!(
            "{code}: {}",
            value["error"]["message"]
        ))),
    }
}
