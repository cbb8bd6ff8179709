//! The JSON messages of the NATS interface as types: every request the service reads,
//! every reply and error it sends. The JSON Schemas in `docs/schemas/` are derived from
//! these (and from the catalogue and the entity views), and `tests/schemas.rs` fails when
//! the committed files differ from what these types generate.
//!
//! Each endpoint deserializes its request into its type here (`deny_unknown_fields`: any
//! other field is refused), and a refusal names the failing field by its path
//! (`endpoints/request.rs`); replies are built from these types.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use provledger_client::placement::HealReport;
use provledger_client::recovery::ReissueRequest;
use provledger_client::{CompensationReply, CompensationRequest};
use provledger_events::catalogue::{ClusterStatus, ConsumerKind, OperationKind, TaskState};
use provledger_events::{AggregateId, Commit, Event, Expectation, Timestamp};
use provledger_projections::operation::OperationStatus;
use provledger_projections::placement::Hold;
use provledger_projections::provider::{ClassRefusal, ProviderStatus};
use provledger_projections::view::EntityView;
use schemars::JsonSchema;
use serde::de::{self, DeserializeOwned, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The fields a request carries, as its `Deserialize` reads them: serde's own list, not a
/// second one. Every request refuses any other (`deny_unknown_fields`, `bad_request`);
/// `tests/schemas.rs` checks each request's schema documents exactly these.
pub trait RequestFields: DeserializeOwned {
    const FIELDS: Fields<Self> = Fields(PhantomData);
}

impl<T: DeserializeOwned> RequestFields for T {}

/// The field names a struct's derived `Deserialize` reads (none for any other type).
pub struct Fields<T>(PhantomData<fn() -> T>);

impl<T: DeserializeOwned> Fields<T> {
    pub fn iter(&self) -> std::slice::Iter<'static, &'static str> {
        T::deserialize(FieldNames)
            .err()
            .and_then(|found| found.0)
            .unwrap_or_default()
            .iter()
    }
}

/// A deserializer that only takes the field list serde's derive hands to
/// `deserialize_struct`, and stops there.
struct FieldNames;

#[derive(Debug)]
struct Found(Option<&'static [&'static str]>);

impl fmt::Display for Found {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a struct")
    }
}

impl std::error::Error for Found {}

impl de::Error for Found {
    fn custom<M: fmt::Display>(_: M) -> Self {
        Found(None)
    }
}

impl<'de> Deserializer<'de> for FieldNames {
    type Error = Found;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Found> {
        Err(Found(None))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Found> {
        Err(Found(Some(fields)))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// An optional flag is `true` or `false` when present; `null` is refused, as it always
/// was (a `"dry_run": null` must not write).
fn flag<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    bool::deserialize(d).map(Some)
}

// ---- requests ----

/// `q.health`: no field (an empty payload counts as `{}`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthRequest {}

/// `q.changes`: the log's commits after a position, in position order, decoded to the JSON
/// of `q.history`, optionally filtered; the catch-up of a follower (a billing service, an
/// inventory, a CMDB) that resumes from the last position it handled. Every filter given
/// must hold (they are AND-ed); within `kinds` and `event_types` any one listed matches.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ChangesRequest {
    /// The last position handled (0, the default: from the first commit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// At most this many commits (1..=1000, default 100); a page is also bounded by bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub limit: Option<u64>,
    /// Only commits of these kinds of aggregate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kinds: Option<Vec<provledger_events::AggregateKind>>,
    /// Only this aggregate's commits (`cluster/<uuid>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<AggregateId>,
    /// Only commits made for this operation (their `operation_id`): its own commits and
    /// what it wrote on its targets and providers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<Uuid>,
    /// Only commits holding at least one event of these types (the catalogue's names:
    /// `vm_state_changed`, `allocation_claimed`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_types: Option<Vec<String>>,
}

/// `q.changes`'s data. `next` is where to go on from (the next request's `after`): the last
/// position this request looked at, matching or not, so a page that passed over many
/// commits that do not match still moves on. The follower is current once `next` = `end`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ChangesData {
    /// The matching commits, in position order.
    pub changes: Vec<HistoryItem>,
    pub next: u64,
    /// The last position of the log this replica had applied when it read: positions up to
    /// it are final; later ones may still come (the next page, or the live feed).
    pub end: u64,
    /// Why the page ended: `end` (nothing more yet), `limit`, `bytes` (the reply's size
    /// bound), or `scan` (it looked at [`CHANGES_SCAN_MAX`] positions without filling).
    pub stopped: ChangesStop,
}

/// Why a `q.changes` page ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ChangesStop {
    End,
    Limit,
    Bytes,
    Scan,
}

/// How many positions one `q.changes` request looks at, at most: a filter that matches
/// little costs a bounded time per request, and the follower asks again from `next`. (With
/// one aggregate only its commits are looked at, by its subject: no bound needed.)
pub const CHANGES_SCAN_MAX: u64 = 10_000;

/// One change on the live feed, `<prefix>.feed.<kind>.<id>`: a commit as `q.history` and
/// `q.changes` give it, published by each replica once it has applied it. `prev`: no change
/// lies between `prev` and this one's `position` (both excluded), so a follower that has
/// handled everything up to `prev` or later takes this one; one that is behind `prev` missed
/// something and fills the gap through `q.changes` from what it handled. With several
/// replicas each change comes once per replica: a follower drops a `position` it handled.
/// `aggregate_prev` does the same for a follower of this aggregate alone (subscribed to its
/// subject only): no change of this aggregate lies between `aggregate_prev` and `position`
/// (0: this is its first).
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct FeedChange {
    #[serde(flatten)]
    pub change: HistoryItem<Arc<Commit>>,
    pub prev: u64,
    pub aggregate_prev: u64,
}

/// `<prefix>.feed.bookmark`, every few seconds from each replica: it has published every
/// change up to `position` (a follower that handled less asks `q.changes`); a follower that
/// hears none for a while is cut off from the feed, not merely idle.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct FeedBookmark {
    pub position: u64,
    pub served_by: String,
}

/// `q.id.resolve`: which entities a short id names. `{"id": "71eec13912d3"}` (the short
/// form the CLI and console print: an id's last 12 hex digits), or the start of an id, or a
/// whole one; `kind` narrows it to one kind of aggregate.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct IdResolveRequest {
    /// A UUID, or 4 to 31 of its hex digits (dashes ignored): the ids that end or begin
    /// with them match.
    #[schemars(length(min = 4, max = 36))]
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<provledger_events::AggregateKind>,
    /// Answer only from a state that has applied this log position (as `q.*.get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_position: Option<u64>,
}

/// `q.id.resolve`'s data: the aggregates `id` names, in id order, at most 10; `more`: others
/// match too. One match: the id is unique. None: no entity has it (yet, on this replica).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct IdResolveData {
    pub matches: Vec<AggregateId>,
    pub more: bool,
}

/// `q.drift`: no field (an empty payload counts as `{}`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DriftRequest {}

/// `q.drift`'s data: whether this replica sweeps, how often, and its last sweep's
/// findings (`docs/drift.md` section 6). Each replica sweeps on its own; the one that
/// answers says which it is (`served_by`).
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct DriftData {
    /// `serve --drift-interval`, in seconds; `null` when this replica does not sweep.
    pub interval_s: Option<u64>,
    /// The last sweep; `null` before the first (or when it does not sweep).
    pub last: Option<DriftSweep>,
    pub served_by: String,
}

/// One executor as the last sweep read it: how many resources it holds, or why it could
/// not be read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct ExecutorRead {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Findings past the bounds of what a sweep keeps (`SUSPECTS_KEPT_MAX`): counted, not
    /// listed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub leaks_not_listed: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What one sweep found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct DriftSweep {
    /// When it finished (RFC 3339).
    pub finished_at: String,
    /// How long it took, in milliseconds.
    pub took_ms: u64,
    /// The log position this replica had applied when the ledger's side was taken.
    pub position: u64,
    pub executors: Vec<ExecutorRead>,
    pub findings: Vec<provledger_projections::drift::Finding>,
}

/// `q.cluster.get`, `q.instance.get`, `q.provider.get`, `q.operation.get`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetRequest {
    pub id: Uuid,
    /// Answer only from a state that has applied this log position: the replica waits up
    /// to `--min-position-wait-ms`, then answers `stale`; `unavailable` at once if its
    /// projector stopped meanwhile (it is exiting: ask another replica).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_position: Option<u64>,
    /// `q.operation.get` only: the operation's `steps` from this index (0-based). With
    /// `compensations_from` and `parts_limit` it answers an operation of any size in parts;
    /// the view then carries `parts`, each list's total. Without them the whole view is
    /// answered, or `too_large` for one over a reply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_from: Option<u64>,
    /// `q.operation.get` only: its `compensations` from this index.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compensations_from: Option<u64>,
    /// `q.operation.get` and `q.provider.get`: at most this many of each of an operation's
    /// `steps`, `started` and `compensations`, or of a provider's `allocations` (1..=1000,
    /// default 100 once paging).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub parts_limit: Option<u64>,
    /// `q.provider.get` only: the provider's `allocations` after this consumer id (in
    /// consumer id order). With it or `parts_limit`, a provider of any size is answered in
    /// parts: the view then carries `allocations_total`; go on with the last consumer of
    /// each part until a part holds fewer than `parts_limit`. Without them the whole view
    /// is answered, or `too_large` for one over a reply (about 10,000 allocations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocations_after: Option<Uuid>,
}

// The paging fields of every list, `limit` and `after`: at most `limit` (1..=1000, default
// 100) entities in id order after `after` (operations newest first: before it in id
// order), and at most half a reply in bytes; go on with `after` = the last id until a page
// is empty.
//
// A filter's word (`status`, `task_state`, `kind`) is documented as the catalogue's, and read
// as any string, as it always was: a word no entity has lists nothing.

/// `q.cluster.list`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClusterListRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ClusterStatus>")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Uuid>,
}

/// `q.instance.list`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InstanceListRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<TaskState>")]
    pub task_state: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Uuid>,
}

/// `q.operation.list`: `{"status": "needs_attention"}` lists the rollbacks an operator
/// must look at. Unlike the other lists, operations come newest first (ids are UUID v7:
/// id order is start order), and `after` goes on to older ones.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OperationListRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<OperationStatus>")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<OperationKind>")]
    pub kind: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<AggregateId>,
    /// Only operations started at or after this time (`started_at`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Uuid>,
}

/// `q.provider.list`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProviderListRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<ProviderStatus>")]
    pub status: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub limit: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<Uuid>,
}

/// `q.allocation.by_consumer`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AllocationByConsumerRequest {
    pub consumer: Uuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_position: Option<u64>,
}

/// `q.history`: a page of the aggregate's commits from `from_version` (default 1).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HistoryRequest {
    pub aggregate: AggregateId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_position: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub from_version: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub limit: Option<u64>,
}

/// `q.state_at`: at a position, at the last position by a time, or now (not both).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StateAtRequest {
    pub aggregate: AggregateId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<Timestamp>,
}

/// What the writer expects of the aggregate's version.
#[derive(Debug, Clone, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum Expect {
    /// `"any"` (no check) or `"none"` (no commit yet).
    Word(ExpectWord),
    /// Exactly this version (the aggregate's number of commits).
    Version(u64),
}

#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExpectWord {
    Any,
    None,
}

/// Read as the log's own text form reads it (`"any"`, `"none"`, or a version, which may
/// also come as a string), or a version number.
impl<'de> Deserialize<'de> for Expect {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ExpectVisitor;
        impl Visitor<'_> for ExpectVisitor {
            type Value = Expect;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"any\", \"none\" or a version")
            }
            fn visit_u64<E: de::Error>(self, version: u64) -> Result<Expect, E> {
                Ok(Expect::Version(version))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Expect, E> {
                u64::try_from(n)
                    .map(Expect::Version)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(n), &self))
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Expect, E> {
                text.parse::<Expectation>()
                    .map(Expect::from)
                    .map_err(E::custom)
            }
        }
        d.deserialize_any(ExpectVisitor)
    }
}

impl From<Expectation> for Expect {
    fn from(e: Expectation) -> Self {
        match e {
            Expectation::Any => Expect::Word(ExpectWord::Any),
            Expectation::NoStream => Expect::Word(ExpectWord::None),
            Expectation::Exactly(version) => Expect::Version(version),
        }
    }
}

impl From<Expect> for Expectation {
    fn from(e: Expect) -> Self {
        match e {
            Expect::Word(ExpectWord::Any) => Expectation::Any,
            Expect::Word(ExpectWord::None) => Expectation::NoStream,
            Expect::Version(version) => Expectation::Exactly(version),
        }
    }
}

/// `cmd.append`, one commit: decided on the aggregate's state, appended at the version
/// decided on. The server-vouched caller, when there is one, replaces `actor`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendRequest {
    pub aggregate: AggregateId,
    pub expect: Expect,
    /// UUID v7; a retry with the same id is recognised (`already_appended`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    /// 1 to 1024 events of the catalogue, all of the aggregate's kind.
    #[schemars(length(min = 1, max = 1024))]
    pub events: Vec<Event>,
    /// Applies an `inventory_set` below what is allocated (hardware that really shrank).
    #[serde(
        default,
        deserialize_with = "flag",
        skip_serializing_if = "Option::is_none"
    )]
    pub force: Option<bool>,
}

/// `cmd.append` with `commits`: several aggregates' commits, written all or nothing.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AtomicAppendRequest {
    /// 1 to 100 commits (`ATOMIC_COMMITS_MAX`), each on a different aggregate.
    #[schemars(length(min = 1, max = 100))]
    pub commits: Vec<AtomicCommit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    #[serde(
        default,
        deserialize_with = "flag",
        skip_serializing_if = "Option::is_none"
    )]
    pub force: Option<bool>,
}

/// One commit of an atomic `cmd.append`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AtomicCommit {
    pub aggregate: AggregateId,
    pub expect: Expect,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<Uuid>,
    #[schemars(length(min = 1, max = 1024))]
    pub events: Vec<Event>,
}

/// Either form of `cmd.append`.
// The endpoint tells them apart by `commits`, so that a refusal names the field of the
// form sent.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum CmdAppendRequest {
    One(AppendRequest),
    Atomic(AtomicAppendRequest),
}

/// `cmd.provider.delete`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProviderDeleteRequest {
    pub id: Uuid,
    #[serde(
        default,
        deserialize_with = "flag",
        skip_serializing_if = "Option::is_none"
    )]
    pub cascade: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

/// `cmd.heal_allocations`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HealAllocationsRequest {
    #[serde(
        default,
        deserialize_with = "flag",
        skip_serializing_if = "Option::is_none"
    )]
    pub dry_run: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<Uuid>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

/// `cmd.fix_orphans`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FixOrphansRequest {
    #[serde(
        default,
        deserialize_with = "flag",
        skip_serializing_if = "Option::is_none"
    )]
    pub dry_run: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

/// `cmd.worker.ready`: one NATS subject token, at most 256 bytes.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WorkerReadyRequest {
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^[^.*>\s]+$"))]
    pub worker: String,
}

// ---- replies ----

/// Every successful reply: `data` is the endpoint's answer.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct Reply<T> {
    /// The last log position this replica had applied when it answered.
    pub position: u64,
    pub data: T,
    /// The id of the replica that answered.
    pub served_by: String,
}

/// The contract's error codes, stable at the NATS boundary. The serde form is the word
/// sent (`as_str`; a test keeps them equal), for the schema of the error reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    NotFound,
    BadRequest,
    Stale,
    Conflict,
    TargetDeleted,
    /// The append decider refused a write the fold would not apply; `reason` says why.
    Rejected,
    /// A stored commit breaks its aggregate's hash chain; `aggregate` and `version` name it.
    Integrity,
    /// The answer would exceed the server's max payload; the message says how to ask for
    /// less (a smaller `limit`, paging with `after` or `from_version`).
    TooLarge,
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
            ErrorCode::TooLarge => "too_large",
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
            ErrorCode::TooLarge => 413,
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }
}

/// Every error reply; the `Nats-Service-Error` (`code: message`) and
/// `Nats-Service-Error-Code` (numeric) headers say the same.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ErrorReply {
    pub error: ErrorBody,
    /// The id of the replica that answered (absent only before it has joined the
    /// service, when it answers nothing else either).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_by: Option<String>,
}

/// An error: `code` and `message` always, the other fields where the code says.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ErrorBody {
    pub code: ErrorCode,
    /// What was wrong and what to do; at most 1,024 bytes of the request are echoed.
    pub message: String,
    /// A stable word under the code: `version`, `commit_id_reused`, `over_capacity`,
    /// `allocations_remain`, `renewal_too_soon`, ... (`docs/operations.md`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `stale`: the position this replica had applied. `integrity`: the broken commit's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<u64>,
    /// `conflict` of a single commit: the aggregate's version now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual_version: Option<u64>,
    /// `integrity`: the aggregate whose chain breaks; in `rejections`: the one refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggregate: Option<AggregateId>,
    /// `integrity`: the version that breaks the chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    /// A refused claim: every resource class that does not fit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classes: Option<Vec<ClassRefusal>>,
    /// An atomic append's version conflicts, one per aggregate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conflicts: Option<Vec<VersionConflict>>,
    /// An atomic append's refusals, one per aggregate (each an error body with `aggregate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rejections: Option<Vec<ErrorBody>>,
    /// `cmd.provider.delete` refused: the allocations that remain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holds: Option<Vec<Hold>>,
}

/// One aggregate of an atomic append whose version was not the one expected.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct VersionConflict {
    pub aggregate: AggregateId,
    /// The expectation sent: `any`, `none` or a version, as text.
    pub expected: String,
    pub actual_version: u64,
}

/// `q.health`'s data.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct HealthData {
    /// Caught up and connected: this replica answers from current state.
    pub ready: bool,
    /// Why it is not ready; null when it is.
    pub reason: Option<String>,
    /// The stream's end when this replica started, once it had applied it.
    pub caught_up_to: Option<u64>,
    pub position: u64,
    pub stream: String,
    pub nats_server_version: String,
    /// Positions between the stream's end and what this replica applied.
    pub lag: u64,
    /// Log entries quarantined (garbage, forged, replayed).
    pub quarantined: u64,
    /// Positions of the snapshots this replica holds.
    pub snapshots: Vec<u64>,
    pub served_by: String,
}

/// How a `cmd.append` commit ended.
#[derive(Debug, Clone, Copy, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AppendOutcomeWord {
    Appended,
    /// A retry with a `commit_id` already in the log: nothing written.
    AlreadyAppended,
    /// A delete request on a target already deleting: nothing written.
    AlreadyDeleting,
    AlreadyDeleted,
}

/// One commit's outcome.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct CommitOutcome {
    /// The position of the commit (or, when nothing was written, of the aggregate's last).
    pub position: u64,
    pub version: u64,
    pub outcome: AppendOutcomeWord,
    pub already_appended: bool,
}

/// `cmd.append`'s data, one commit.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct AppendData {
    #[serde(flatten)]
    pub commit: CommitOutcome,
    /// Who the commit is recorded as: the server-vouched `user@ACCOUNT`, or the request's.
    pub actor: String,
}

/// `cmd.append`'s data, `commits` form: each commit's outcome in the order given.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct AtomicAppendData {
    pub commits: Vec<CommitOutcome>,
    pub actor: String,
}

/// Either form's data.
#[derive(Debug, Clone, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum CmdAppendData {
    One(AppendData),
    Atomic(AtomicAppendData),
}

/// One item of `q.allocation.by_consumer`: the consumer's allocation on one provider.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ConsumerAllocation {
    pub provider_id: Uuid,
    pub provider_name: String,
    pub consumer: Uuid,
    pub consumer_kind: ConsumerKind,
    pub resources: BTreeMap<String, u64>,
}

/// One item of `q.history`: a commit, decoded, with its rendered timeline.
// `C`: the live feed's items hold their commit shared with serve's copier (`Arc<Commit>`,
// which serializes as the commit does): the same JSON, no clone per commit.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct HistoryItem<C = Commit> {
    #[serde(flatten)]
    pub commit: C,
    /// One readable line per event.
    pub timeline: Vec<String>,
}

/// `q.state_at`'s data.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct StateAtData {
    /// The position the state was folded to.
    pub at_position: u64,
    pub state: EntityView,
}

/// `cmd.provider.delete`'s data.
#[derive(Debug, Clone, Serialize, JsonSchema)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ProviderDeleteData {
    /// Deleted, with the allocations a cascade released.
    Deleted {
        released: Vec<Hold>,
    },
    AlreadyDeleted,
}

/// `cmd.heal_allocations`'s data: `healed` pairs are `[instance, provider]`, `skipped`
/// and `failed` pairs `[instance, why]`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct HealData {
    #[serde(flatten)]
    pub report: HealReport,
    pub dry_run: bool,
}

/// `cmd.fix_orphans`'s data.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct FixOrphansData {
    pub dry_run: bool,
    pub orphans: Vec<OrphanAllocation>,
}

/// An orphan allocation released (or, dry run, to release), on the provider it was on.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct OrphanAllocation {
    pub provider: Uuid,
    pub hold: Hold,
}

/// `cmd.worker.ready`'s data.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct WorkerReadyData {
    pub worker: String,
    /// False from a replica whose recovery is off (the others still deliver).
    pub delivering: bool,
}

/// What `provledger.exec.<executor>.compensate` carries, both ways (client library types).
pub type ExecutorRequest = CompensationRequest;
pub type ExecutorReply = CompensationReply;
/// What `provledger.worker.<worker_id>.reissue` carries.
pub type WorkerReissueRequest = ReissueRequest;
/// A worker's answer to a re-issue, in the executor's form: `{"ok": true}` or
/// `{"ok": false, "error": "..."}`.
pub type WorkerReissueReply = CompensationReply;
