//! Identifiers, timestamps and hashes shared by every event and commit.
//!
//! These types are part of the wire contract: they serialise compactly under bincode
//! (`is_human_readable() == false`) and as readable strings in JSON.

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use uuid::Uuid;

/// The four kinds of aggregate, each a consistency boundary with its own version sequence.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum AggregateKind {
    Cluster,
    Instance,
    Provider,
    Operation,
}

impl AggregateKind {
    pub const ALL: [AggregateKind; 4] = [
        AggregateKind::Cluster,
        AggregateKind::Instance,
        AggregateKind::Provider,
        AggregateKind::Operation,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AggregateKind::Cluster => "cluster",
            AggregateKind::Instance => "instance",
            AggregateKind::Provider => "provider",
            AggregateKind::Operation => "operation",
        }
    }

    /// A one-byte tag used in sled keys; stable forever.
    pub fn tag(self) -> u8 {
        match self {
            AggregateKind::Cluster => 1,
            AggregateKind::Instance => 2,
            AggregateKind::Provider => 3,
            AggregateKind::Operation => 4,
        }
    }

    pub fn from_tag(tag: u8) -> Option<Self> {
        AggregateKind::ALL.into_iter().find(|k| k.tag() == tag)
    }
}

impl fmt::Display for AggregateKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a `KIND` or `KIND/ID` string could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseAggregateError {
    #[error(
        "unknown aggregate kind {0:?}: expected one of cluster, instance, provider, operation"
    )]
    UnknownKind(String),
    #[error("aggregate {0:?} is not of the form KIND/ID (for example cluster/0190c0de-...)")]
    MissingSlash(String),
    #[error("aggregate id {id:?} is not a UUID: {reason}")]
    BadId { id: String, reason: String },
}

impl FromStr for AggregateKind {
    type Err = ParseAggregateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        AggregateKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| ParseAggregateError::UnknownKind(s.to_string()))
    }
}

/// One aggregate: its kind and UUID. Displayed and parsed as `kind/uuid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AggregateId {
    pub kind: AggregateKind,
    pub id: Uuid,
}

impl AggregateId {
    pub fn new(kind: AggregateKind, id: Uuid) -> Self {
        Self { kind, id }
    }

    /// `PREFIX.FAMILY.KIND.ID`: the subject of this aggregate's messages of one family
    /// (`ev`: its commits, `feed`: its changes). Built by hand: `format!` costs as much
    /// again, and this runs for every write and every message the projector reads.
    pub fn subject(&self, prefix: &str, family: &str) -> String {
        let kind = self.kind.as_str();
        let mut subject = String::with_capacity(prefix.len() + family.len() + kind.len() + 39);
        for part in [prefix, ".", family, ".", kind, "."] {
            subject.push_str(part);
        }
        subject.push_str(
            self.id
                .hyphenated()
                .encode_lower(&mut Uuid::encode_buffer()),
        );
        subject
    }

    /// Whether `subject` is [`AggregateId::subject`]`(prefix, family)`, without building it.
    pub fn is_subject(&self, prefix: &str, family: &str, subject: &str) -> bool {
        let id = subject
            .strip_prefix(prefix)
            .and_then(|s| s.strip_prefix('.'))
            .and_then(|s| s.strip_prefix(family))
            .and_then(|s| s.strip_prefix('.'))
            .and_then(|s| s.strip_prefix(self.kind.as_str()))
            .and_then(|s| s.strip_prefix('.'));
        id == Some(
            &*self
                .id
                .hyphenated()
                .encode_lower(&mut Uuid::encode_buffer()),
        )
    }
    pub fn cluster(id: Uuid) -> Self {
        Self::new(AggregateKind::Cluster, id)
    }
    pub fn instance(id: Uuid) -> Self {
        Self::new(AggregateKind::Instance, id)
    }
    pub fn provider(id: Uuid) -> Self {
        Self::new(AggregateKind::Provider, id)
    }
    pub fn operation(id: Uuid) -> Self {
        Self::new(AggregateKind::Operation, id)
    }

    /// 17 bytes: the kind tag then the UUID. Used as a sled key prefix.
    pub fn key_bytes(&self) -> [u8; 17] {
        let mut key = [0u8; 17];
        key[0] = self.kind.tag();
        key[1..].copy_from_slice(self.id.as_bytes());
        key
    }
}

impl fmt::Display for AggregateId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.id)
    }
}

impl FromStr for AggregateId {
    type Err = ParseAggregateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, id) = s
            .split_once('/')
            .ok_or_else(|| ParseAggregateError::MissingSlash(s.to_string()))?;
        let kind = kind.parse()?;
        let id = Uuid::parse_str(id).map_err(|e| ParseAggregateError::BadId {
            id: id.to_string(),
            reason: e.to_string(),
        })?;
        Ok(AggregateId { kind, id })
    }
}

// On the wire (bincode) an aggregate is a (kind, uuid) pair; in JSON it is "kind/uuid".
impl Serialize for AggregateId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            (self.kind, self.id).serialize(s)
        }
    }
}

// Written by hand because the Serialize above is: in JSON an aggregate is one string.
impl JsonSchema for AggregateId {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "AggregateId".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "An aggregate, `kind/uuid`: `cluster/0190...`, `instance/...`, `provider/...`, `operation/...`.",
            "type": "string",
            "pattern": "^(cluster|instance|provider|operation)/"
        })
    }
}

impl<'de> Deserialize<'de> for AggregateId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(de::Error::custom)
        } else {
            let (kind, id) = <(AggregateKind, Uuid)>::deserialize(d)?;
            Ok(AggregateId { kind, id })
        }
    }
}

/// Milliseconds since the Unix epoch, UTC. RFC 3339 in JSON.
///
/// Time is always injected (by the writer's clock), never read inside pure code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(pub i64);

impl Timestamp {
    pub fn from_unix_ms(ms: i64) -> Self {
        Timestamp(ms)
    }
    pub fn unix_ms(self) -> i64 {
        self.0
    }
    /// The wall clock. Only shells (CLI, services, logs) call this.
    pub fn now() -> Self {
        let now = time::OffsetDateTime::now_utc();
        Timestamp((now.unix_timestamp_nanos() / 1_000_000) as i64)
    }
    pub fn to_rfc3339(self) -> String {
        let nanos = i128::from(self.0) * 1_000_000;
        match time::OffsetDateTime::from_unix_timestamp_nanos(nanos) {
            Ok(t) => t
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_else(|_| format!("@{}ms", self.0)),
            Err(_) => format!("@{}ms", self.0),
        }
    }
    pub fn parse_rfc3339(s: &str) -> Result<Self, InvalidText> {
        let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
            .map_err(|e| InvalidText {
                what: "an RFC 3339 timestamp",
                text: s.to_string(),
                reason: e.to_string(),
            })?;
        Ok(Timestamp((t.unix_timestamp_nanos() / 1_000_000) as i64))
    }
    pub fn plus_ms(self, ms: i64) -> Self {
        Timestamp(self.0.saturating_add(ms))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(self)
        } else {
            s.serialize_i64(self.0)
        }
    }
}

// Written by hand because the Serialize above is: in JSON a timestamp is RFC 3339 text.
impl JsonSchema for Timestamp {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Timestamp".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A UTC time in RFC 3339, to the millisecond: `2026-11-21T10:00:00.000Z`.",
            "type": "string",
            "format": "date-time"
        })
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            Timestamp::parse_rfc3339(&s).map_err(de::Error::custom)
        } else {
            Ok(Timestamp(i64::deserialize(d)?))
        }
    }
}

/// A BLAKE3 digest: the per-aggregate hash chain link. Hex in JSON.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Hash(pub [u8; 32]);

impl Hash {
    /// The `prev_hash` of an aggregate's first commit.
    pub const ZERO: Hash = Hash([0u8; 32]);

    /// Lowercase hex, 64 digits (blake3's own encoding).
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// Parses 64 hex digits (either case), as blake3 does.
    pub fn from_hex(s: &str) -> Result<Self, InvalidText> {
        blake3::Hash::from_hex(s)
            .map(|h| Hash(*h.as_bytes()))
            .map_err(|e| InvalidText {
                what: "a hash of 64 hex digits",
                text: s.to_string(),
                reason: e.to_string(),
            })
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hash({})", &self.to_hex()[..12])
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for Hash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&self.to_hex())
        } else {
            self.0.serialize(s)
        }
    }
}

// Written by hand because the Serialize above is: in JSON a hash is 64 lowercase hex digits.
impl JsonSchema for Hash {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Hash".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A BLAKE3 hash in hex: a commit's `hash` and `prev_hash` (all zeros before the first commit).",
            "type": "string",
            "pattern": "^[0-9a-f]{64}$"
        })
    }
}

impl<'de> Deserialize<'de> for Hash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            Hash::from_hex(&s).map_err(de::Error::custom)
        } else {
            Ok(Hash(<[u8; 32]>::deserialize(d)?))
        }
    }
}

/// How many hex digits of an id a person is shown: the id's last 12.
pub const SHORT_ID_HEX_DIGITS: usize = 12;

/// An id shortened for a person: its last [`SHORT_ID_HEX_DIGITS`] hex digits. A UUID v7
/// begins with its mint time, so every id minted in the same second shares its head; the
/// tail is random (and, for ids minted by one generator in one millisecond, ends with the
/// low bits of its counter), so it is the part that tells entities apart. Commands take
/// the full id, which `history` and `state` print.
pub fn short_id(id: &Uuid) -> String {
    let hex = id.simple().to_string();
    hex[hex.len() - SHORT_ID_HEX_DIGITS..].to_string()
}

/// An aggregate shortened for a person: `cluster/` and its [`short_id`].
pub fn short_aggregate(aggregate: &AggregateId) -> String {
    format!("{}/{}", aggregate.kind, short_id(&aggregate.id))
}

/// The fewest hex digits a short id may have: fewer would match too many ids to be worth
/// a lookup (4 digits already tell 65,536 ids apart).
pub const ID_REF_HEX_DIGITS_MIN: usize = 4;

/// An id as a person gives it to a command: a whole UUID, or some of its hex digits (its
/// short form as the CLI and console print it, [`short_id`], or the start of it as a full
/// id is written). A short one names the one id whose hex digits end or begin with it, or
/// none; which ids exist is for the caller's store to say (`q.id.resolve`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IdRef {
    Full(Uuid),
    /// [`ID_REF_HEX_DIGITS_MIN`] to 31 lowercase hex digits, dashes removed.
    Short(String),
}

impl IdRef {
    /// Whether `id` is one this reference names.
    pub fn matches(&self, id: &Uuid) -> bool {
        match self {
            IdRef::Full(full) => full == id,
            IdRef::Short(digits) => {
                let hex = id.simple().to_string();
                hex.ends_with(digits.as_str()) || hex.starts_with(digits.as_str())
            }
        }
    }
}

impl FromStr for IdRef {
    type Err = InvalidText;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: &str| InvalidText {
            what: "an id",
            text: s.chars().take(80).collect(),
            reason: reason.to_string(),
        };
        if let Ok(id) = Uuid::parse_str(s) {
            return Ok(IdRef::Full(id));
        }
        let digits: String = s.chars().filter(|c| *c != '-').collect();
        if !digits.chars().all(|c| c.is_ascii_hexdigit()) {
            return Err(invalid(
                "expected a UUID, or 4 to 31 of its hex digits (the short id shown, or its start)",
            ));
        }
        if !(ID_REF_HEX_DIGITS_MIN..32).contains(&digits.len()) {
            return Err(invalid(&format!(
                "{} hex digits: give a whole UUID, or {ID_REF_HEX_DIGITS_MIN} to 31 of its digits",
                digits.len()
            )));
        }
        Ok(IdRef::Short(digits.to_ascii_lowercase()))
    }
}

impl fmt::Display for IdRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdRef::Full(id) => write!(f, "{id}"),
            IdRef::Short(digits) => f.write_str(digits),
        }
    }
}

/// An aggregate as a person gives it: `KIND/ID`, where ID is an [`IdRef`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AggregateRef {
    pub kind: AggregateKind,
    pub id: IdRef,
}

impl FromStr for AggregateRef {
    type Err = ParseAggregateError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, id) = s
            .split_once('/')
            .ok_or_else(|| ParseAggregateError::MissingSlash(s.to_string()))?;
        let kind: AggregateKind = kind.parse()?;
        let id = id
            .parse()
            .map_err(|e: InvalidText| ParseAggregateError::BadId {
                id: e.text,
                reason: e.reason,
            })?;
        Ok(AggregateRef { kind, id })
    }
}

impl fmt::Display for AggregateRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.id)
    }
}

/// The clock skew tolerated between the writer that minted a commit id (its UUID v7 time)
/// and the clock it is compared with (the log's, or other writers'), when telling whether a
/// retry could be older than what is known.
pub const CLOCK_SKEW_MS_MAX: i64 = 60_000;

/// The millisecond timestamp embedded in a UUID v7, if it is one.
pub fn uuid_v7_unix_ms(id: &Uuid) -> Option<i64> {
    if id.get_version_num() != 7 {
        return None;
    }
    let b = id.as_bytes();
    let ms = (u64::from(b[0]) << 40)
        | (u64::from(b[1]) << 32)
        | (u64::from(b[2]) << 24)
        | (u64::from(b[3]) << 16)
        | (u64::from(b[4]) << 8)
        | u64::from(b[5]);
    i64::try_from(ms).ok()
}

/// Text that does not parse as the value asked for (a timestamp, a hash, an expectation):
/// what was expected, the text (Debug-quoted when shown) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not {what}: {reason}")]
pub struct InvalidText {
    pub what: &'static str,
    pub text: String,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_aggregates_subject_is_its_prefix_family_kind_and_id() {
        // Given an aggregate
        let id = AggregateId::provider(Uuid::from_u128(0x0190_a0c8_7a37_7f4c_8c7e_0000_0000_00ab));
        // When its subject is built, then it reads as the text form says
        let subject = id.subject("acme.prov", "ev");
        assert_eq!(subject, format!("acme.prov.ev.provider.{}", id.id));
        // and it is recognised, and nothing else is
        assert!(id.is_subject("acme.prov", "ev", &subject));
        for other in [
            format!("acme.prov.feed.provider.{}", id.id),
            format!("acme.prov.ev.cluster.{}", id.id),
            format!("acme.prov.ev.provider.{}.x", id.id),
            format!("acme.prov.ev.provider.{}", Uuid::nil()),
            format!("acme.prov.ev.provider.{}", id.id.to_string().to_uppercase()),
            format!("acme.provX.ev.provider.{}", id.id),
            "acme.prov.ev.provider.".to_string(),
            String::new(),
        ] {
            assert!(!id.is_subject("acme.prov", "ev", &other), "{other}");
        }
    }

    #[test]
    fn short_ids_of_ids_minted_in_one_millisecond_are_distinct() {
        // Given 1,000 UUID v7 minted by one generator within one millisecond, as a burst of
        // writes does (they share their whole time prefix),
        let context = uuid::ContextV7::new();
        let millisecond = uuid::Timestamp::from_unix(&context, 1_750_000_000, 0);
        let ids: Vec<Uuid> = (0..1_000).map(|_| Uuid::new_v7(millisecond)).collect();
        assert!(ids
            .iter()
            .all(|id| id.as_bytes()[..6] == ids[0].as_bytes()[..6]));
        // when they are shortened,
        let shorts: std::collections::HashSet<String> = ids.iter().map(short_id).collect();
        // then no two print the same.
        assert_eq!(shorts.len(), ids.len(), "short ids collide: {shorts:?}");
    }

    #[test]
    fn a_short_aggregate_is_its_kind_and_the_tail_of_its_id() {
        let id = Uuid::parse_str("01a20c10-bda9-71ad-a2a6-71eec13912d3").unwrap();
        assert_eq!(short_id(&id), "71eec13912d3");
        assert_eq!(
            short_aggregate(&AggregateId::cluster(id)),
            "cluster/71eec13912d3"
        );
    }

    #[test]
    fn an_id_ref_is_a_whole_uuid_or_some_of_its_hex_digits() {
        let id = Uuid::parse_str("01a20c10-bda9-71ad-a2a6-71eec13912d3").unwrap();
        // Given the forms a person copies: the whole id, the short form shown, its start,
        assert_eq!(id.to_string().parse::<IdRef>().unwrap(), IdRef::Full(id));
        for text in [
            "71eec13912d3",
            "71EEC13912D3",
            "a2a6-71eec13912d3",
            "01a20c10",
            "01a20c10-bd",
        ] {
            // when each is parsed, then it names this id,
            let r: IdRef = text.parse().unwrap();
            assert!(matches!(r, IdRef::Short(_)), "{text}");
            assert!(r.matches(&id), "{text} should name {id}");
        }
        // and a digit run from its middle names no id.
        assert!(!"bda971ad".parse::<IdRef>().unwrap().matches(&id));
    }

    #[test]
    fn an_id_ref_refuses_what_names_no_id_clearly() {
        for (text, says) in [
            ("abc", "3 hex digits"),
            ("", "0 hex digits"),
            ("71eec13912dz", "expected a UUID"),
            ("cluster/71eec1", "expected a UUID"),
            ("\u{1b}[31m", "expected a UUID"),
        ] {
            let e = text.parse::<IdRef>().unwrap_err();
            assert!(e.to_string().contains(says), "{text:?}: {e}");
        }
        let e = "instance/zz".parse::<AggregateRef>().unwrap_err();
        assert!(
            e.to_string().contains("instance") || e.to_string().contains("zz"),
            "{e}"
        );
        let r: AggregateRef = "operation/71eec13912d3".parse().unwrap();
        assert_eq!(r.kind, AggregateKind::Operation);
        assert_eq!(r.to_string(), "operation/71eec13912d3");
    }

    #[test]
    fn aggregate_id_round_trips_through_its_display_form() {
        let a = AggregateId::cluster(Uuid::now_v7());
        let parsed: AggregateId = a.to_string().parse().unwrap();
        assert_eq!(parsed, a);
    }

    #[test]
    fn aggregate_id_parse_errors_say_what_was_expected() {
        assert!(matches!(
            "vm/x".parse::<AggregateId>(),
            Err(ParseAggregateError::UnknownKind(_))
        ));
        assert!(matches!(
            "cluster".parse::<AggregateId>(),
            Err(ParseAggregateError::MissingSlash(_))
        ));
        assert!(matches!(
            "cluster/zz".parse::<AggregateId>(),
            Err(ParseAggregateError::BadId { .. })
        ));
    }

    #[test]
    fn timestamp_json_is_rfc3339_and_round_trips() {
        let t = Timestamp(1_700_000_000_123);
        let j = serde_json::to_string(&t).unwrap();
        assert_eq!(j, "\"2023-11-14T22:13:20.123Z\"");
        assert_eq!(serde_json::from_str::<Timestamp>(&j).unwrap(), t);
    }

    #[test]
    fn uuid_v7_timestamp_is_recovered() {
        let id = Uuid::now_v7();
        let ms = uuid_v7_unix_ms(&id).unwrap();
        assert!((ms - Timestamp::now().0).abs() < 5_000);
        assert_eq!(uuid_v7_unix_ms(&Uuid::new_v4()), None);
    }

    #[test]
    fn a_hash_is_64_lowercase_hex_digits_and_reads_back() {
        // Given: a hash whose bytes are 0, 1, ..., 31.
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = i as u8;
        }
        let hash = Hash(bytes);
        // When / then: it is written as each byte's two digits in order, and read back
        // from either case; anything but 64 hex digits is refused.
        let hex = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
        assert_eq!(hash.to_hex(), hex);
        assert_eq!(hash.to_string(), hex);
        assert_eq!(Hash::from_hex(hex), Ok(hash));
        assert_eq!(Hash::from_hex(&hex.to_uppercase()), Ok(hash));
        assert!(Hash::from_hex(&hex[1..]).is_err());
        assert!(Hash::from_hex(&hex.replace('a', "g")).is_err());
        assert!(Hash::from_hex(&format!("+{}", &hex[1..])).is_err());
    }
}
