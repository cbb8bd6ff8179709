//! The envelope as bytes: the one borrowed view of a commit that both the encoder and the
//! hash read.
//!
//! Sharing it is what keeps the rule "hash = BLAKE3(domain ‖ payload[1 .. len-32])" true by
//! construction: the hash input is the payload without its format byte and its trailing
//! hash, preceded by the bincode of the format's domain string. A reader can therefore check
//! a hash from the raw bytes alone, and a re-encoded commit hashes as the stored one did.

use serde::Serialize;
use uuid::Uuid;

use super::{config, EncodeError, FORMAT_1};
use crate::ids::{AggregateId, Hash, Timestamp};

/// The hash domain of format 1: it separates commit hashes from any other BLAKE3 use.
pub(crate) const DOMAIN_1: &str = "provledger.commit.v1";

/// Every field of a commit that is written, borrowed, in wire order, without `hash` (which
/// follows it on the wire) and without `position` (which the log assigns after writing).
#[derive(Serialize)]
pub struct EnvelopeRef<'a, E> {
    pub commit_id: &'a Uuid,
    pub aggregate: &'a AggregateId,
    pub version: u64,
    pub operation_id: &'a Option<Uuid>,
    pub causation_id: &'a Option<Uuid>,
    pub actor: &'a str,
    pub recorded_at: Timestamp,
    pub events: &'a [E],
    pub prev_hash: &'a Hash,
}

/// The payload's middle: everything between the format byte and the hash.
fn body<E: Serialize>(envelope: &EnvelopeRef<'_, E>) -> Result<Vec<u8>, EncodeError> {
    bincode::serde::encode_to_vec(envelope, config())
        .map_err(|e| EncodeError::Bincode(e.to_string()))
}

/// `[format] ‖ body ‖ hash`. The hash is written as its 32 raw bytes, which is how bincode
/// writes `Hash` (a `[u8; 32]`, no length): the golden files pin it.
pub fn encode<E: Serialize>(
    envelope: &EnvelopeRef<'_, E>,
    hash: &Hash,
) -> Result<Vec<u8>, EncodeError> {
    let body = body(envelope)?;
    let mut out = Vec::with_capacity(1 + body.len() + hash.0.len());
    out.push(FORMAT_1);
    out.extend_from_slice(&body);
    out.extend_from_slice(&hash.0);
    Ok(out)
}

/// BLAKE3 over the bincode of the domain string, then the body.
pub fn hash<E: Serialize>(envelope: &EnvelopeRef<'_, E>) -> Hash {
    // Encoding these fields cannot fail: every one is a plain serde value with no custom
    // error path, and bincode's limit applies to decoding only. If it ever did, every commit
    // would hash the same input and a chain would no longer tell one commit from another:
    // stop rather than seal that.
    let body = body(envelope).expect("the hash input (plain serde fields) encodes");
    assert!(
        !body.is_empty(),
        "the hash input of v{} of {} encoded to nothing",
        envelope.version,
        envelope.aggregate
    );
    hash_body(DOMAIN_1, &body)
}

/// The hash of a body under a domain; `pub` so tests can check the rule on raw bytes.
pub fn hash_body(domain: &str, body: &[u8]) -> Hash {
    let domain = bincode::serde::encode_to_vec(domain, config())
        .expect("a short &str always encodes (a varint length and its bytes)");
    let mut hasher = blake3::Hasher::new();
    hasher.update(&domain);
    hasher.update(body);
    Hash(*hasher.finalize().as_bytes())
}
