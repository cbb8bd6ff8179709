//! `provledger query ENDPOINT [JSON]`: one request to a running service.

use std::time::Duration;

use super::{print_json, CommandError};

/// Longer than the service's bounded `min_position` wait, so `stale` arrives as a reply.
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);

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
) -> Result<(), CommandError> {
    let suffix = suffix_of(endpoint)?;
    provledger_client::parse_nats_urls(nats_url)?;
    let body = request.unwrap_or_else(|| "{}".to_string());
    if let Err(e) = serde_json::from_str::<serde_json::Value>(&body) {
        return Err(CommandError::BadInput(format!(
            "the request is not JSON: {e}"
        )));
    }
    let client = provledger_client::connect_nats(nats_url, "provledger-query", auth).await?;
    let subject = format!("{prefix}.{suffix}");
    let reply = tokio::time::timeout(QUERY_TIMEOUT, client.request(subject.clone(), body.into()))
        .await
        .unwrap_or_else(|_| {
            Err(async_nats::RequestError::new(
                async_nats::RequestErrorKind::TimedOut,
            ))
        })
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
