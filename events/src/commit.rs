//! The commit envelope: the unit written to the log, and its per-aggregate hash chain.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::catalogue::Event;
use crate::codec::envelope::{Envelope, EnvelopeRef};
use crate::codec::stored::Stored;
use crate::ids::{AggregateId, Hash, Timestamp};
use crate::trace::TraceContext;

/// Upper bound on events in one commit; keeps a commit well below NATS' max payload.
pub const COMMIT_EVENTS_MAX: usize = 1024;
/// Upper bound on the actor string.
pub const ACTOR_BYTES_MAX: usize = 256;

/// What a writer hands to `EventLog::append`: everything but the fields the log assigns
/// (version, position, prev_hash, hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CommitDraft {
    /// UUID v7; the idempotency key. A retry must reuse it.
    pub commit_id: Uuid,
    pub operation_id: Option<Uuid>,
    pub causation_id: Option<Uuid>,
    pub actor: String,
    /// Injected by the writer's clock, never read from inside the log's pure code.
    pub recorded_at: Timestamp,
    /// The W3C trace the commit is written in (the request that wrote it), when the
    /// writer has one: what serve later sends on the commit's behalf continues it.
    #[serde(
        rename = "traceparent",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub trace: Option<TraceContext>,
    pub events: Vec<Event>,
}

impl CommitDraft {
    /// A draft with a fresh UUID v7 and the wall clock: for shells only.
    pub fn now(actor: impl Into<String>, events: Vec<Event>) -> Self {
        CommitDraft {
            commit_id: Uuid::now_v7(),
            operation_id: None,
            causation_id: None,
            actor: actor.into(),
            recorded_at: Timestamp::now(),
            trace: None,
            events,
        }
    }

    pub fn with_operation(mut self, operation_id: Uuid) -> Self {
        self.operation_id = Some(operation_id);
        self
    }

    pub fn with_causation(mut self, causation_id: Uuid) -> Self {
        self.causation_id = Some(causation_id);
        self
    }

    /// Records the W3C trace the commit is written in (`None`: none).
    pub fn with_trace(mut self, trace: Option<TraceContext>) -> Self {
        self.trace = trace;
        self
    }

    /// Checks the draft against the catalogue for that aggregate.
    pub fn validate(&self, aggregate: &AggregateId) -> Result<(), InvalidCommit> {
        if self.events.is_empty() {
            return Err(InvalidCommit::NoEvents);
        }
        if self.events.len() > COMMIT_EVENTS_MAX {
            return Err(InvalidCommit::TooManyEvents {
                count: self.events.len(),
                max: COMMIT_EVENTS_MAX,
            });
        }
        if self.actor.len() > ACTOR_BYTES_MAX {
            return Err(InvalidCommit::ActorTooLong {
                max: ACTOR_BYTES_MAX,
            });
        }
        for (index, event) in self.events.iter().enumerate() {
            if let Some(name) = event
                .executor_names()
                .into_iter()
                .find(|n| !crate::catalogue::operation::executor_name_is_valid(n))
            {
                return Err(InvalidCommit::BadExecutorName {
                    index,
                    event: event.name().into(),
                    name: name
                        .chars()
                        .take(crate::catalogue::operation::EXECUTOR_NAME_BYTES_MAX)
                        .collect(),
                });
            }
            if !event.belongs_to(aggregate.kind) {
                return Err(InvalidCommit::WrongAggregateKind {
                    index,
                    event: event.name().into(),
                    kind: aggregate.kind.to_string(),
                });
            }
        }
        Ok(())
    }
}

/// Why a draft was refused before anything was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidCommit {
    #[error("a commit needs at least one event")]
    NoEvents,
    #[error("a commit holds at most {max} events, this one has {count}")]
    TooManyEvents { count: usize, max: usize },
    #[error("actor is longer than {max} bytes")]
    ActorTooLong { max: usize },
    #[error("event #{index} ({event}) does not belong to a {kind} aggregate")]
    WrongAggregateKind {
        index: usize,
        event: String,
        kind: String,
    },
    #[error("the encoded commit is {size} bytes, above the limit of {max}")]
    TooLarge { size: usize, max: usize },
    /// `name` is shown Debug-escaped and cut at the longest valid length: it is hostile
    /// until checked, and this message reaches logs and replies.
    #[error("event #{index} ({event}) names executor {name:?}, which is not an executor name: 1 to {max} ASCII letters, digits, '_' or '-'", max = crate::catalogue::operation::EXECUTOR_NAME_BYTES_MAX)]
    BadExecutorName {
        index: usize,
        event: String,
        name: String,
    },
}

/// One commit as stored: one or more events for one aggregate, appended atomically.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Commit {
    pub commit_id: Uuid,
    pub aggregate: AggregateId,
    /// The aggregate's version after this commit: 1 for its first commit.
    pub version: u64,
    /// The global log position (the JetStream stream sequence). Not part of the encoded
    /// payload or the hash, because the log assigns it after the bytes are written.
    pub position: u64,
    pub operation_id: Option<Uuid>,
    pub causation_id: Option<Uuid>,
    pub actor: String,
    pub recorded_at: Timestamp,
    /// The W3C trace the commit was written in, when its writer had one (format 3; the
    /// hash covers it). JSON: `"traceparent": "00-<trace id>-<span id>-<flags>"`, absent
    /// when there is none.
    #[serde(
        rename = "traceparent",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub trace: Option<TraceContext>,
    pub events: Vec<Event>,
    pub prev_hash: Hash,
    pub hash: Hash,
    /// How the commit was stored, kept only when re-encoding its fields would not give those
    /// bytes back (an upcast event, a format other than the minimal one), so its hash and any
    /// copy use what was written. Not part of what the commit is: equality ignores it and
    /// JSON leaves it out.
    #[serde(skip)]
    pub(crate) stored: Stored,
}

impl Commit {
    /// Builds a commit from a draft at the given version, linked to the previous commit's
    /// hash. Position stays 0 until the log assigns it.
    pub fn seal(aggregate: AggregateId, version: u64, prev_hash: Hash, draft: CommitDraft) -> Self {
        let mut commit = Commit {
            commit_id: draft.commit_id,
            aggregate,
            version,
            position: 0,
            operation_id: draft.operation_id,
            causation_id: draft.causation_id,
            actor: draft.actor,
            recorded_at: draft.recorded_at,
            trace: draft.trace,
            events: draft.events,
            prev_hash,
            hash: Hash::ZERO,
            stored: Stored::default(),
        };
        commit.hash = commit.compute_hash();
        commit
    }

    /// BLAKE3 over every field but `position` and `hash`, as written: see
    /// `codec::envelope` for the exact input.
    pub fn compute_hash(&self) -> Hash {
        crate::codec::hash(self)
    }

    /// The format byte this commit is written in: 3 when it records a trace context, else
    /// 1 unless an event is at a layout version above 1 (or it was decoded from format 2).
    pub fn format(&self) -> u8 {
        self.envelope().format()
    }

    /// Each event's layout version as written (see `catalogue/versions.rs`).
    pub fn event_versions(&self) -> Vec<u16> {
        self.envelope().event_versions()
    }

    /// A decoded envelope stored at `position`, moved into a commit.
    pub(crate) fn from_envelope(envelope: Envelope<Event>, position: u64) -> Self {
        Commit {
            commit_id: envelope.commit_id,
            aggregate: envelope.aggregate,
            version: envelope.version,
            position,
            operation_id: envelope.operation_id,
            causation_id: envelope.causation_id,
            actor: envelope.actor,
            recorded_at: envelope.recorded_at,
            trace: envelope.trace,
            events: envelope.events,
            prev_hash: envelope.prev_hash,
            hash: envelope.hash,
            stored: envelope.stored,
        }
    }

    /// This commit's written fields, borrowed: what the codec encodes and hashes.
    pub(crate) fn envelope(&self) -> EnvelopeRef<'_, Event> {
        EnvelopeRef {
            commit_id: &self.commit_id,
            aggregate: &self.aggregate,
            version: self.version,
            operation_id: &self.operation_id,
            causation_id: &self.causation_id,
            actor: &self.actor,
            recorded_at: self.recorded_at,
            trace: &self.trace,
            events: &self.events,
            prev_hash: &self.prev_hash,
            stored: &self.stored,
        }
    }

    pub fn hash_is_valid(&self) -> bool {
        self.compute_hash() == self.hash
    }

    /// True when a retry carries the same payload as this stored commit. `recorded_at` is
    /// left out because a retry may be stamped again by the writer's clock, and `trace`
    /// because a retried request is a new span (often a new trace): the first write's
    /// context stays recorded.
    pub fn same_payload_as(&self, draft: &CommitDraft) -> bool {
        self.commit_id == draft.commit_id
            && self.operation_id == draft.operation_id
            && self.causation_id == draft.causation_id
            && self.actor == draft.actor
            && self.events == draft.events
    }
}

/// A break in an aggregate's hash chain or version sequence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainViolation {
    #[error("{aggregate} v{version} at position {position}: stored hash does not match its content (modified)")]
    HashMismatch {
        aggregate: AggregateId,
        version: u64,
        position: u64,
    },
    #[error("{aggregate} v{version} at position {position}: prev_hash does not link to v{}", version.saturating_sub(1))]
    BrokenLink {
        aggregate: AggregateId,
        version: u64,
        position: u64,
    },
    #[error("{aggregate}: expected version {expected}, found {found} at position {position} (lost or reordered commit)")]
    VersionGap {
        aggregate: AggregateId,
        expected: u64,
        found: u64,
        position: u64,
    },
    #[error("{aggregate}: commit at position {position} belongs to {found}")]
    ForeignCommit {
        aggregate: AggregateId,
        found: AggregateId,
        position: u64,
    },
}

impl ChainViolation {
    /// The version the violation is at (for a gap: the version found).
    pub fn version(&self) -> u64 {
        match self {
            ChainViolation::HashMismatch { version, .. }
            | ChainViolation::BrokenLink { version, .. } => *version,
            ChainViolation::VersionGap { found, .. } => *found,
            ChainViolation::ForeignCommit { .. } => 0,
        }
    }

    pub fn position(&self) -> u64 {
        match self {
            ChainViolation::HashMismatch { position, .. }
            | ChainViolation::BrokenLink { position, .. }
            | ChainViolation::VersionGap { position, .. }
            | ChainViolation::ForeignCommit { position, .. } => *position,
        }
    }
}

/// A read found a stored commit that is not what was written: the typed error every read
/// path returns instead of a state folded from it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("integrity: {aggregate} v{version} at position {position}: {problem}; the stored log was altered or damaged, run `provledger audit`")]
pub struct IntegrityError {
    pub aggregate: AggregateId,
    pub version: u64,
    pub position: u64,
    pub problem: String,
}

impl IntegrityError {
    pub fn from_violation(aggregate: AggregateId, violation: &ChainViolation) -> Self {
        IntegrityError {
            aggregate,
            version: violation.version(),
            position: violation.position(),
            problem: violation.to_string(),
        }
    }
}

/// The first break in one aggregate's chain (see [`verify_chain`]), as an integrity error.
pub fn check_chain(aggregate: &AggregateId, commits: &[Commit]) -> Result<(), IntegrityError> {
    match verify_chain(aggregate, commits).first() {
        None => Ok(()),
        Some(v) => Err(IntegrityError::from_violation(*aggregate, v)),
    }
}

/// Checks one aggregate's commits, oldest first: versions 1..n without gaps, each hash
/// valid and each `prev_hash` equal to the previous commit's hash. Returns every violation.
pub fn verify_chain(aggregate: &AggregateId, commits: &[Commit]) -> Vec<ChainViolation> {
    let mut violations = Vec::new();
    verify_segment(aggregate, 0, Hash::ZERO, commits, &mut violations);
    violations
}

/// [`verify_chain`] for commits that follow version `after` whose hash is `prev`.
pub(crate) fn verify_segment<'a>(
    aggregate: &AggregateId,
    after: u64,
    mut prev: Hash,
    commits: impl IntoIterator<Item = &'a Commit>,
    violations: &mut Vec<ChainViolation>,
) {
    for (i, commit) in commits.into_iter().enumerate() {
        let expected = after + i as u64 + 1;
        if commit.aggregate != *aggregate {
            violations.push(ChainViolation::ForeignCommit {
                aggregate: *aggregate,
                found: commit.aggregate,
                position: commit.position,
            });
        }
        if commit.version != expected {
            violations.push(ChainViolation::VersionGap {
                aggregate: *aggregate,
                expected,
                found: commit.version,
                position: commit.position,
            });
        }
        if !commit.hash_is_valid() {
            violations.push(ChainViolation::HashMismatch {
                aggregate: *aggregate,
                version: commit.version,
                position: commit.position,
            });
        }
        if commit.prev_hash != prev {
            violations.push(ChainViolation::BrokenLink {
                aggregate: *aggregate,
                version: commit.version,
                position: commit.position,
            });
        }
        prev = commit.hash;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::ClusterStatus;

    fn draft(n: u8) -> CommitDraft {
        CommitDraft {
            commit_id: Uuid::from_bytes([n; 16]),
            operation_id: None,
            causation_id: None,
            actor: "test".into(),
            recorded_at: Timestamp(1_700_000_000_000 + i64::from(n)),
            trace: None,
            events: vec![Event::ClusterStatusChanged {
                status: ClusterStatus::Active,
                description: format!("step {n}"),
            }],
        }
    }

    fn chain(agg: AggregateId, n: u8) -> Vec<Commit> {
        let mut out: Vec<Commit> = Vec::new();
        for i in 1..=n {
            let prev = out.last().map(|c| c.hash).unwrap_or(Hash::ZERO);
            out.push(Commit::seal(agg, u64::from(i), prev, draft(i)));
        }
        out
    }

    #[test]
    fn given_an_intact_chain_when_verified_then_no_violation() {
        let agg = AggregateId::cluster(Uuid::from_bytes([9; 16]));
        assert!(verify_chain(&agg, &chain(agg, 5)).is_empty());
    }

    #[test]
    fn given_a_modified_event_when_verified_then_hash_mismatch_is_reported() {
        let agg = AggregateId::cluster(Uuid::from_bytes([9; 16]));
        let mut commits = chain(agg, 4);
        commits[2].actor = "mallory".into();
        let v = verify_chain(&agg, &commits);
        assert_eq!(
            v,
            vec![ChainViolation::HashMismatch {
                aggregate: agg,
                version: 3,
                position: 0
            }]
        );
    }

    #[test]
    fn given_a_lost_commit_when_verified_then_gap_and_broken_link_are_reported() {
        let agg = AggregateId::cluster(Uuid::from_bytes([9; 16]));
        let mut commits = chain(agg, 4);
        commits.remove(1);
        let v = verify_chain(&agg, &commits);
        assert!(v.iter().any(|x| matches!(
            x,
            ChainViolation::VersionGap {
                expected: 2,
                found: 3,
                ..
            }
        )));
        assert!(v
            .iter()
            .any(|x| matches!(x, ChainViolation::BrokenLink { version: 3, .. })));
    }

    /// Given a commit, when described as JSON or JSON Schema, then its hidden stored form is
    /// in neither: the JSON form and the published schemas stay as they were.
    #[test]
    fn the_stored_form_is_not_part_of_the_json_or_the_schema() {
        let commit = chain(AggregateId::cluster(Uuid::from_bytes([9; 16])), 1).remove(0);
        let json = serde_json::to_string(&commit).unwrap();
        let schema = serde_json::to_value(schemars::schema_for!(Commit)).unwrap();
        assert!(!json.contains("stored"), "{json}");
        assert!(schema["properties"].get("position").is_some(), "{schema}");
        assert!(schema["properties"].get("stored").is_none(), "{schema}");
        let back: Commit = serde_json::from_str(&json).unwrap();
        assert_eq!(back, commit);
        assert!(back.hash_is_valid());
    }

    #[test]
    fn a_forged_version_0_is_described_without_panicking() {
        let agg = AggregateId::cluster(Uuid::from_bytes([9; 16]));
        let text = ChainViolation::BrokenLink {
            aggregate: agg,
            version: 0,
            position: 4,
        }
        .to_string();
        assert!(text.contains("v0 at position 4"), "{text}");
    }

    #[test]
    fn validate_refuses_events_of_another_kind() {
        let agg = AggregateId::instance(Uuid::nil());
        let err = draft(1).validate(&agg).unwrap_err();
        assert!(matches!(
            err,
            InvalidCommit::WrongAggregateKind { index: 0, .. }
        ));
        assert!(err.to_string().contains("cluster_status_changed"));
    }

    #[test]
    fn validate_refuses_an_executor_name_outside_its_grammar() {
        use crate::catalogue::{samples, Event};
        let operation = AggregateId::operation(Uuid::nil());
        let named = |name: &str| {
            let mut event = samples::all()
                .into_iter()
                .find(|e| matches!(e, Event::StepStarted { .. }))
                .expect("a step_started sample");
            if let Event::StepStarted { executor, .. } = &mut event {
                *executor = name.into();
            }
            CommitDraft::now("t", vec![event])
        };
        // Given names that would forge a metric line, address another executor's subjects,
        // or are too long, then each is refused naming the event...
        let forged = "rt3evil\"} 7\nprovledger_ready 0\nx{a=\"";
        for bad in [forged, "dns.>", "a b", "", &"x".repeat(65)] {
            let err = named(bad).validate(&operation).unwrap_err();
            assert!(
                matches!(err, InvalidCommit::BadExecutorName { index: 0, .. }),
                "{bad:?}: {err:?}"
            );
            // ...and the message carries no raw line break.
            assert!(!err.to_string().contains('\n'), "{err}");
        }
        // ...while identifiers pass.
        for good in ["ipam", "dns-x", "Hyper_V2", &"x".repeat(64)] {
            named(good).validate(&operation).expect(good);
        }
    }
}
