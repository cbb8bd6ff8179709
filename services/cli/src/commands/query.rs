//! `provledger query ENDPOINT [JSON]`: one request to a running service.

use std::time::Duration;

use super::{print_json, CommandError};

/// Longer than the service's bounded `min_position` wait, so `stale` arrives as a reply.
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

/// The subject for an endpoint given as `cluster.get`, `q.cluster.get` or `cmd.append`.
pub fn subject_for(prefix: &str, endpoint: &str) -> String {
    if endpoint.starts_with("q.") || endpoint.starts_with("cmd.") {
        format!("{prefix}.{endpoint}")
    } else {
        format!("{prefix}.q.{endpoint}")
    }
}

pub async fn run(
    nats_url: &str,
    prefix: &str,
    endpoint: &str,
    request: Option<String>,
) -> Result<(), CommandError> {
    let body = request.unwrap_or_else(|| "{}".to_string());
    if let Err(e) = serde_json::from_str::<serde_json::Value>(&body) {
        return Err(CommandError::BadInput(format!(
            "the request is not JSON: {e}"
        )));
    }
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .request_timeout(Some(QUERY_TIMEOUT))
        .connect(nats_url)
        .await
        .map_err(|e| {
            CommandError::Infrastructure(format!(
                "NATS unreachable at {nats_url}: {e}; start nats-server or fix --nats"
            ))
        })?;
    let subject = subject_for(prefix, endpoint);
    let reply = client
        .request(subject.clone(), body.into())
        .await
        .map_err(|e| {
            CommandError::Infrastructure(format!(
                "no answer on {subject}: {e}; is `provledger serve` running against this NATS?"
            ))
        })?;
    let value: serde_json::Value = serde_json::from_slice(&reply.payload)
        .map_err(|e| CommandError::Problem(format!("the service's reply is not JSON: {e}")))?;
    print_json(&value);
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
