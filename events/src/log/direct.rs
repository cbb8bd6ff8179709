//! Reading the stream without consumers: JetStream's batch direct get (ADR-31, nats-server
//! 2.11+). One request on `$JS.API.DIRECT.GET.<stream>` asks for up to a batch of messages
//! from a sequence (or a time) on a subject filter; the server answers with the messages on
//! the request's reply subject and ends with an end-of-batch status (204) that says how many
//! remain. Nothing is created on the server, so nothing lingers and no account limit on
//! consumers can be reached by reading, whatever the rate.

use std::time::Duration;

use async_nats::jetstream::message::StreamMessage;
use futures::StreamExt;
use serde::Serialize;

/// Messages asked for in one request. Large enough that reading an aggregate of 100,000
/// commits takes a few hundred round trips, small enough that one reply stays bounded.
pub(crate) const DIRECT_BATCH_MESSAGES_MAX: usize = 256;
/// Bytes asked for in one request (the server stops a batch once it has sent this much,
/// always sending at least one message).
const DIRECT_BATCH_BYTES_MAX: usize = 8 * 1024 * 1024;
/// How long to wait for the next message of a batch before the read is `unavailable`.
const DIRECT_REPLY_WAIT: Duration = Duration::from_secs(10);

/// Where a batch starts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Start {
    Sequence(u64),
    /// The first message stored at or after this time (the server's clock).
    Time(time::OffsetDateTime),
}

#[derive(Serialize)]
struct Request<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    seq: Option<u64>,
    #[serde(
        skip_serializing_if = "Option::is_none",
        with = "time::serde::rfc3339::option"
    )]
    start_time: Option<time::OffsetDateTime>,
    next_by_subj: &'a str,
    batch: usize,
    max_bytes: usize,
}

/// A request for the last message on each of some subjects at or before a sequence
/// (ADR-31's `multi_last` with `up_to_seq`): the server answers from its per-subject
/// index, without scanning the messages in between.
#[derive(Serialize)]
struct LastRequest<'a> {
    multi_last: [&'a str; 1],
    up_to_seq: u64,
    batch: usize,
}

/// Why a direct get failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DirectGetError {
    /// 503: no replica of the stream answers direct gets (yet): a stream just created, or
    /// one whose every replica is gone.
    #[error(
        "direct get refused: 503 no responders (no replica of the stream answers direct gets)"
    )]
    NoResponders,
    #[error("{0}")]
    Other(String),
}

impl From<String> for DirectGetError {
    fn from(s: String) -> Self {
        DirectGetError::Other(s)
    }
}

impl From<&str> for DirectGetError {
    fn from(s: &str) -> Self {
        DirectGetError::Other(s.to_string())
    }
}

/// One batch: the messages, and how many more match after the last of them (the
/// end-of-batch status's `Nats-Num-Pending`, which counts what follows the batch).
pub(crate) struct Batch {
    pub(crate) messages: Vec<StreamMessage>,
    pub(crate) pending: u64,
}

/// Sends batch direct gets for one stream.
#[derive(Clone)]
pub(crate) struct DirectReader {
    client: async_nats::Client,
    api_subject: String,
}

impl DirectReader {
    pub(crate) fn new(client: async_nats::Client, stream: &str) -> Self {
        DirectReader {
            client,
            api_subject: format!("$JS.API.DIRECT.GET.{stream}"),
        }
    }

    /// Sends one direct get on an inbox of its own; its replies arrive there.
    async fn send(&self, body: Vec<u8>) -> Result<async_nats::Subscriber, String> {
        let inbox = self.client.new_inbox();
        let replies = self
            .client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| format!("subscribing for a direct get: {e}"))?;
        self.client
            .publish_with_reply(self.api_subject.clone(), inbox, body.into())
            .await
            .map_err(|e| format!("sending a direct get: {e}"))?;
        Ok(replies)
    }

    /// Up to `max` messages matching `filter` from `start`, in stream order. An empty
    /// batch means nothing matches from there on.
    pub(crate) async fn batch(
        &self,
        start: Start,
        filter: &str,
        max: usize,
    ) -> Result<Batch, DirectGetError> {
        let (seq, start_time) = match start {
            Start::Sequence(s) => (Some(s.max(1)), None),
            Start::Time(t) => (None, Some(t)),
        };
        let body = serde_json::to_vec(&Request {
            seq,
            start_time,
            next_by_subj: filter,
            batch: max.clamp(1, DIRECT_BATCH_MESSAGES_MAX),
            max_bytes: DIRECT_BATCH_BYTES_MAX,
        })
        .map_err(|e| format!("encoding a direct get: {e}"))?;
        let mut replies = self.send(body).await?;
        let mut messages = Vec::new();
        let pending = loop {
            let reply = tokio::time::timeout(DIRECT_REPLY_WAIT, replies.next())
                .await
                .map_err(|_| format!("no direct get reply within {DIRECT_REPLY_WAIT:?}"))?
                .ok_or("the direct get subscription ended")?;
            match reply.status.map(|s| s.as_u16()) {
                None => messages.push(
                    StreamMessage::try_from(reply)
                        .map_err(|e| format!("a direct get reply without its headers: {e}"))?,
                ),
                // End of batch: the server says how many more there are.
                Some(204) => break pending_of(&reply),
                // Nothing at or after the start.
                Some(404) => break 0,
                Some(503) => return Err(DirectGetError::NoResponders),
                Some(code) => {
                    return Err(DirectGetError::Other(format!(
                        "direct get refused: {code} {}",
                        reply.description.as_deref().unwrap_or("")
                    )))
                }
            }
        };
        // The inbox is used once; unsubscribing is best effort (the connection may be gone).
        let _ = replies.unsubscribe().await;
        Ok(Batch { messages, pending })
    }

    /// Returns once the stream answers a direct get (a message or "none"), asking again
    /// while it answers `503 no responders`, for at most `wait`: a stream just created has
    /// no responders until its replicas subscribe to the direct get API.
    pub(crate) async fn wait_for_responders(&self, wait: Duration) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut pause = Duration::from_millis(5);
        loop {
            match self.batch(Start::Sequence(1), ">", 1).await {
                Ok(_) => return Ok(()),
                Err(DirectGetError::NoResponders) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                Err(DirectGetError::NoResponders) => {
                    return Err(format!(
                        "no replica of the stream answered a direct get within {wait:?} (503 no responders)"
                    ))
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// The sequence of the last message on `subject` at or before `up_to_seq` (`None`: no
    /// message there).
    pub(crate) async fn last_up_to(
        &self,
        subject: &str,
        up_to_seq: u64,
    ) -> Result<Option<u64>, String> {
        let body = serde_json::to_vec(&LastRequest {
            multi_last: [subject],
            up_to_seq,
            batch: 1,
        })
        .map_err(|e| format!("encoding a direct get: {e}"))?;
        let mut replies = self.send(body).await?;
        let mut last = None;
        loop {
            let reply = tokio::time::timeout(DIRECT_REPLY_WAIT, replies.next())
                .await
                .map_err(|_| format!("no direct get reply within {DIRECT_REPLY_WAIT:?}"))?
                .ok_or("the direct get subscription ended")?;
            match reply.status.map(|s| s.as_u16()) {
                None => {
                    let msg = StreamMessage::try_from(reply)
                        .map_err(|e| format!("a direct get reply without its headers: {e}"))?;
                    last = last.max(Some(msg.sequence));
                }
                Some(204) | Some(404) => break,
                Some(code) => {
                    return Err(format!(
                        "direct get refused: {code} {}",
                        reply.description.as_deref().unwrap_or("")
                    ))
                }
            }
        }
        let _ = replies.unsubscribe().await;
        Ok(last)
    }

    /// Every message matching `filter` from sequence `from` to `end` (inclusive), in
    /// batches. `end` must be a message matching `filter` that the stream holds: a reply
    /// that stops before it comes from a replica behind the stream's leader (followers and
    /// mirrors answer direct gets too), and is an error rather than a short read.
    pub(crate) async fn range(
        &self,
        from: u64,
        end: u64,
        filter: &str,
    ) -> Result<Vec<StreamMessage>, String> {
        let mut out = Vec::new();
        let mut next = from.max(1);
        while next <= end {
            let batch = self
                .batch(Start::Sequence(next), filter, DIRECT_BATCH_MESSAGES_MAX)
                .await
                .map_err(|e| e.to_string())?;
            let last = batch.messages.last().map(|m| m.sequence);
            out.extend(batch.messages.into_iter().filter(|m| m.sequence <= end));
            match last {
                Some(last) if last >= end => return Ok(out),
                Some(last) if batch.pending > 0 => next = last + 1,
                _ => return Err(behind(next, end)),
            }
        }
        Ok(out)
    }
}

/// The error for a reply that ended before a message the stream's leader said it holds.
pub(crate) fn behind(next: u64, end: u64) -> String {
    format!(
        "the replica that answered holds nothing from position {next} up to {end}: it is behind the stream's leader; retry"
    )
}

fn pending_of(reply: &async_nats::Message) -> u64 {
    reply
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Num-Pending"))
        .and_then(|v| v.as_str().parse().ok())
        .unwrap_or(0)
}
