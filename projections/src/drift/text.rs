//! [`Text`]: a string as drift's ledger side keeps it, a million at a time. Most of what it
//! keeps are UUIDs in their hyphenated lower-case form (entities, nodes, VMs) and short
//! names (IPs, DNS names); a `String` costs 24 bytes plus a heap block for each, a `Text`
//! 24 bytes and a heap block only for what is neither.

use std::fmt;
use std::hash::{Hash, Hasher};

use uuid::Uuid;

/// The longest string kept inline.
const INLINE_MAX: usize = 22;

/// A string kept compactly; equal, hashed and shown exactly as the string it was made
/// from.
#[derive(Clone, PartialEq, Eq)]
pub struct Text(Repr);

#[derive(Clone, PartialEq, Eq)]
enum Repr {
    /// A UUID whose hyphenated lower-case form is the string (only then: the string is
    /// given back exactly as it came).
    Id(Uuid),
    Inline {
        len: u8,
        bytes: [u8; INLINE_MAX],
    },
    Heap(Box<str>),
}

impl Text {
    pub fn new(s: &str) -> Text {
        if s.len() <= INLINE_MAX {
            let mut bytes = [0; INLINE_MAX];
            bytes[..s.len()].copy_from_slice(s.as_bytes());
            // Cannot truncate: s.len() <= INLINE_MAX < 256.
            let len = s.len() as u8;
            return Text(Repr::Inline { len, bytes });
        }
        if s.len() == uuid::fmt::Hyphenated::LENGTH {
            if let Ok(id) = Uuid::try_parse(s) {
                let mut buf = [0; uuid::fmt::Hyphenated::LENGTH];
                if id.hyphenated().encode_lower(&mut buf) == s {
                    return Text(Repr::Id(id));
                }
            }
        }
        Text(Repr::Heap(s.into()))
    }

    /// Hands the string to `f` without allocating.
    pub fn with_str<R>(&self, f: impl FnOnce(&str) -> R) -> R {
        match &self.0 {
            Repr::Id(id) => {
                let mut buf = [0; uuid::fmt::Hyphenated::LENGTH];
                f(id.hyphenated().encode_lower(&mut buf))
            }
            Repr::Inline { len, bytes } => {
                // Always valid: the bytes were copied whole from a &str, and a cut can only
                // fall at its end.
                let s = std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default();
                f(s)
            }
            Repr::Heap(s) => f(s),
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self.0, Repr::Inline { len: 0, .. })
    }

    /// Whether this is the string `s`.
    pub fn is(&self, s: &str) -> bool {
        self.with_str(|mine| mine == s)
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Text {
        Text::new(s)
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with_str(|s| f.write_str(s))
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.with_str(|s| fmt::Debug::fmt(s, f))
    }
}

/// Hashed as the string, so that a `&str` looked up hashes the same (see [`hash_str`]).
impl Hash for Text {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.with_str(|s| s.hash(state));
    }
}

/// The hash drift's indexes use for a string: the same for a `Text` and the `&str` it was
/// made from, and the same in every process (no random seed: nothing outside this process
/// ever sees it, but a run must not differ from the next in what it finds).
pub(crate) fn hash_str(s: &str) -> u64 {
    #[allow(deprecated)] // SipHash with fixed keys: deterministic, and nothing adversarial
    let mut h = std::hash::SipHasher::new();
    s.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_gives_back_the_string_it_was_made_from() {
        // Given strings of each form, and UUID look-alikes that are not in canonical form
        let id = "0190a3b4-0000-7000-8000-0000000000b1";
        for s in [
            "",
            "10.0.0.5",
            "exactly-twenty-two-ch.",
            id,
            &id.to_uppercase(),
            "{0190a3b4-0000-7000-8000-0000000000b1}",
            "a-name-longer-than-twenty-two-characters",
            "név-ünïcode-ß-long-enough-to-go-on-heap",
        ] {
            // When kept as a Text; then shown, compared and hashed as the string
            let t = Text::new(s);
            assert_eq!(t.to_string(), s);
            assert!(t.is(s));
            assert_eq!(t.is_empty(), s.is_empty());
            assert_eq!(t.with_str(hash_str), hash_str(s));
        }
        assert!(matches!(Text::new(id).0, Repr::Id(_)));
        assert!(matches!(Text::new(&id.to_uppercase()).0, Repr::Heap(_)));
        assert_eq!(std::mem::size_of::<Text>(), 24);
    }
}
