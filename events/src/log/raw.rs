//! The stream's messages as stored, for a backup and its restore (`crate::backup` is the
//! pure part). A backup reads every message of `first..=last` by batch direct get (no
//! consumer); a restore publishes them, in position order, into an empty stream, each with
//! `Nats-Expected-Last-Sequence` = the position before it, so that it lands exactly at its
//! position and nothing else can land in between (a writer that does makes the next
//! publish fail, and the restore stops).
//!
//! This is the one writer of the log besides `EventLog::append` and `append_atomic`, and it
//! writes only into a stream that holds nothing.

use std::collections::VecDeque;
use std::time::Duration;

use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};

use super::direct::{Start, DIRECT_BATCH_MESSAGES_MAX};
use super::jetstream_log::{
    parse_server_version, JetStreamConfig, JetStreamLog, MAX_ACK_INFLIGHT, SERVER_VERSION_MIN,
};
use super::ReadError;
use crate::backup::RawMessage;

/// Publishes a restore keeps in flight: enough to keep a local server busy, well below
/// async-nats' [`MAX_ACK_INFLIGHT`].
pub const RESTORE_WINDOW: usize = 1024;
const _: () = assert!(RESTORE_WINDOW < MAX_ACK_INFLIGHT);
/// The subject of the placeholder a restore publishes, then deletes, at a position the
/// source stream had lost, so that every later message keeps its position.
const HOLE_TOKEN: &str = "restore-hole";

/// The stream's positions as its state says now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamBounds {
    /// The first position the stream holds (1 for a stream that never lost its start).
    pub first: u64,
    /// The last position assigned (0 for a stream never written).
    pub last: u64,
    pub messages: u64,
}

fn unavailable(e: impl std::fmt::Display) -> ReadError {
    ReadError::Unavailable {
        reason: e.to_string(),
    }
}

impl JetStreamLog {
    /// The stream's first and last positions and its message count, now.
    pub async fn stream_bounds(&self) -> Result<StreamBounds, ReadError> {
        let info = self
            .context()
            .get_stream(&self.config().stream)
            .await
            .map_err(unavailable)?
            .get_info()
            .await
            .map_err(unavailable)?;
        Ok(StreamBounds {
            first: info.state.first_sequence.max(1),
            last: info.state.last_sequence,
            messages: info.state.messages,
        })
    }

    /// Up to [`DIRECT_BATCH_MESSAGES_MAX`] messages as stored, from position `from`, none
    /// past `end`; a position the stream lost is skipped (the next message's position tells
    /// it). `end` must be a position the stream holds: a reply that stops before it comes
    /// from a replica behind the leader and is an error, never a short read.
    pub async fn read_raw_batch(&self, from: u64, end: u64) -> Result<Vec<RawMessage>, ReadError> {
        let max = usize::try_from(end.saturating_sub(from) + 1)
            .map_or(DIRECT_BATCH_MESSAGES_MAX, |n| {
                n.min(DIRECT_BATCH_MESSAGES_MAX)
            });
        // Every subject: the stream holds only the event subjects (see `range_stream`).
        let batch = self
            .direct()
            .batch(Start::Sequence(from), ">", max)
            .await
            .map_err(|e| unavailable(format!("reading from position {from}: {e}")))?;
        let reached = batch.messages.last().map(|m| m.sequence);
        if reached.is_none_or(|last| last < end && batch.pending == 0) {
            return Err(unavailable(super::direct::behind(from, end)));
        }
        Ok(batch
            .messages
            .into_iter()
            .filter(|m| m.sequence <= end)
            .map(|m| RawMessage {
                position: m.sequence,
                msg_id: m
                    .headers
                    .get(async_nats::header::NATS_MESSAGE_ID)
                    .map(|v| v.as_str().to_string()),
                subject: m.subject.to_string(),
                payload: m.payload,
            })
            .collect())
    }
}

/// Why a restore could not write the stream.
#[derive(Debug, thiserror::Error)]
pub enum RestoreStreamError {
    #[error("stream {stream} already holds {messages} message(s), up to position {last}: a restore writes only into an empty stream; restore onto a fresh server, or into another --stream")]
    NotEmpty {
        stream: String,
        messages: u64,
        last: u64,
    },
    #[error("stream {stream} exists, empty, but {problem}; delete it (`nats stream rm {stream}`) and let the restore create it")]
    ExistingUnfit { stream: String, problem: String },
    #[error("nats-server {found} is too old: provledger needs {}.{}.{} or later", SERVER_VERSION_MIN.0, SERVER_VERSION_MIN.1, SERVER_VERSION_MIN.2)]
    ServerTooOld { found: String },
    #[error("position {position}: the server stored it at {stored}, not at its position; the stream is not what the restore created: delete it and restore again")]
    Misplaced { position: u64, stored: u64 },
    #[error("position {position}: the server took it for a duplicate of the message at {stored} (same Nats-Msg-Id); delete the stream and restore again onto a stream that holds nothing")]
    Duplicate { position: u64, stored: u64 },
    #[error("position {position}: another message landed on the stream during the restore (its expected last sequence no longer held): stop every writer (serve, services), delete the stream and restore again")]
    Interleaved { position: u64 },
    #[error(
        "position {position}: publishing failed: {reason}; delete the stream and restore again"
    )]
    Publish { position: u64, reason: String },
    #[error("JetStream unavailable: {reason}")]
    Unavailable { reason: String },
}

fn restore_unavailable(e: impl std::fmt::Display) -> RestoreStreamError {
    RestoreStreamError::Unavailable {
        reason: e.to_string(),
    }
}

/// An empty stream being restored into.
pub struct RestoreTarget {
    context: jetstream::Context,
    stream: stream::Stream,
    config: JetStreamConfig,
    /// The last position assigned so far.
    last: u64,
    /// Publishes sent, oldest first, with the position each must land at.
    in_flight: VecDeque<(u64, PublishAckFuture)>,
}

impl RestoreTarget {
    /// The stream `config` names, empty, to restore positions `first..` into: created for
    /// the restore (with deletes allowed until [`RestoreTarget::finish`], so that a hole
    /// can be made, and so that a restore that never finished is refused by every
    /// provledger process, whose stream check wants `deny_delete`), or an existing empty
    /// one of the right configuration when the backup has no hole and starts at 1.
    pub async fn open(
        client: async_nats::Client,
        config: JetStreamConfig,
        first: u64,
        has_holes: bool,
    ) -> Result<RestoreTarget, RestoreStreamError> {
        let found = client.server_info().version;
        if parse_server_version(&found).is_none_or(|v| v < SERVER_VERSION_MIN) {
            return Err(RestoreStreamError::ServerTooOld { found });
        }
        let context = jetstream::ContextBuilder::new()
            .max_ack_inflight(MAX_ACK_INFLIGHT)
            .timeout(Duration::from_secs(10))
            .build(client);
        let stream = match context.get_stream(&config.stream).await {
            Ok(existing) => Self::existing(existing, &config, first, has_holes)?,
            Err(e)
                if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
            {
                let mut want = config.stream_config();
                want.deny_delete = false;
                want.deny_purge = false;
                want.first_sequence = (first > 1).then_some(first);
                context
                    .create_stream(want)
                    .await
                    .map_err(restore_unavailable)?
            }
            Err(e) => return Err(restore_unavailable(e)),
        };
        tracing::info!(stream = %config.stream, first, "restoring into an empty stream");
        Ok(RestoreTarget {
            context,
            stream,
            config,
            last: first - 1,
            in_flight: VecDeque::new(),
        })
    }

    fn existing(
        existing: stream::Stream,
        config: &JetStreamConfig,
        first: u64,
        has_holes: bool,
    ) -> Result<stream::Stream, RestoreStreamError> {
        let info = existing.cached_info();
        if info.state.messages > 0 || info.state.last_sequence > 0 {
            return Err(RestoreStreamError::NotEmpty {
                stream: config.stream.clone(),
                messages: info.state.messages,
                last: info.state.last_sequence,
            });
        }
        let unfit = |problem: String| RestoreStreamError::ExistingUnfit {
            stream: config.stream.clone(),
            problem,
        };
        if first > 1 || has_holes {
            return Err(unfit(format!(
                "the backup starts at position {first} or has holes, which only a stream the restore creates can reproduce"
            )));
        }
        super::jetstream_log::verify_stream_config(&config.stream_config(), &info.config)
            .map_err(|e| unfit(e.to_string()))?;
        Ok(existing)
    }

    /// Publishes `messages` (in position order, after everything published before) at
    /// their positions, making a hole where a position is missing.
    pub async fn publish(&mut self, messages: &[RawMessage]) -> Result<(), RestoreStreamError> {
        for m in messages {
            assert!(
                m.position > self.last,
                "a restore publishes in position order: {} after {}",
                m.position,
                self.last
            );
            while self.last + 1 < m.position {
                self.make_hole().await?;
            }
            let mut publish = PublishMessage::build()
                .payload(m.payload.clone())
                .expected_last_sequence(self.last);
            if let Some(id) = &m.msg_id {
                publish = publish.message_id(id);
            }
            let ack = self
                .context
                .send_publish(m.subject.clone(), publish)
                .await
                .map_err(|e| RestoreStreamError::Publish {
                    position: m.position,
                    reason: e.to_string(),
                })?;
            self.in_flight.push_back((m.position, ack));
            self.last = m.position;
            if self.in_flight.len() >= RESTORE_WINDOW {
                self.settle_one().await?;
            }
        }
        Ok(())
    }

    /// Waits for the oldest publish in flight and checks where it landed.
    async fn settle_one(&mut self) -> Result<(), RestoreStreamError> {
        let Some((position, ack)) = self.in_flight.pop_front() else {
            return Ok(());
        };
        match ack.await {
            Ok(ack) if ack.duplicate => Err(RestoreStreamError::Duplicate {
                position,
                stored: ack.sequence,
            }),
            Ok(ack) if ack.sequence != position => Err(RestoreStreamError::Misplaced {
                position,
                stored: ack.sequence,
            }),
            Ok(_) => Ok(()),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                Err(RestoreStreamError::Interleaved { position })
            }
            Err(e) => Err(RestoreStreamError::Publish {
                position,
                reason: e.to_string(),
            }),
        }
    }

    async fn settle_all(&mut self) -> Result<(), RestoreStreamError> {
        while !self.in_flight.is_empty() {
            self.settle_one().await?;
        }
        Ok(())
    }

    /// The next position as a hole: a placeholder published there, then deleted, as the
    /// source stream's server had lost it.
    async fn make_hole(&mut self) -> Result<(), RestoreStreamError> {
        self.settle_all().await?;
        let position = self.last + 1;
        let subject = format!("{}.ev.{HOLE_TOKEN}", self.config.subject_prefix);
        let publish = PublishMessage::build()
            .payload(bytes::Bytes::new())
            .expected_last_sequence(self.last);
        let ack = self
            .context
            .send_publish(subject, publish)
            .await
            .map_err(|e| RestoreStreamError::Publish {
                position,
                reason: e.to_string(),
            })?;
        self.in_flight.push_back((position, ack));
        self.settle_all().await?;
        self.stream
            .delete_message(position)
            .await
            .map_err(|e| RestoreStreamError::Publish {
                position,
                reason: format!("deleting the hole's placeholder: {e}"),
            })?;
        self.last = position;
        Ok(())
    }

    /// Waits for every publish, then gives the stream the log's configuration (deletes
    /// and purges denied, as for every stream of the log). Returns the last position.
    pub async fn finish(mut self) -> Result<u64, RestoreStreamError> {
        self.settle_all().await?;
        let mut config = self
            .stream
            .get_info()
            .await
            .map_err(restore_unavailable)?
            .config;
        if !(config.deny_delete && config.deny_purge) {
            config.deny_delete = true;
            config.deny_purge = true;
            self.context.update_stream(config).await.map_err(|e| {
                restore_unavailable(format!("denying deletes on the restored stream: {e}"))
            })?;
        }
        tracing::info!(stream = %self.config.stream, last = self.last, "restore published");
        Ok(self.last)
    }

    /// The last position published so far.
    pub fn last_position(&self) -> u64 {
        self.last
    }
}
