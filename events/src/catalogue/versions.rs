//! Which layout each event is written at, and how its older layouts are read: the one place
//! an event's evolution is registered (docs/events.md, "How to change an event").
//!
//! An event's *tag* is its bincode variant index (variants are only appended, so a tag never
//! changes meaning). Its *version* numbers the layout of its fields: every event starts at 1,
//! and a changed layout takes the next number. A tag absent from [`Registry::current`] is at
//! version 1. A commit whose events are all at version 1 is written in format 1, exactly as
//! before versions existed; one holding a newer layout is written in format 2, which records
//! each event's version (see `codec`).
//!
//! Reading never loses an old layout: for every version below the current one, an
//! [`Upcaster`] reads the frozen old fields (`catalogue/legacy/`, one file per old layout) and
//! returns the event in today's layout. The stored bytes stay as they were, and the hash and
//! any re-encoding use them, so old commits keep verifying after a change.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::Event;

/// Reads the fields of one old layout (the bytes after the tag) and returns the event in
/// today's layout and the number of bytes read, or bincode's reason the bytes are not that
/// layout (an upcaster decodes its frozen struct with bincode, and adds only defaults).
pub type ReadOld<E> = fn(&[u8]) -> Result<(E, usize), bincode::error::DecodeError>;

/// Reads one old layout of one event.
pub struct Upcaster<E: 'static> {
    /// The event's bincode variant index.
    pub tag: u32,
    /// The layout version this reads.
    pub from: u16,
    /// Reads the fields of layout `from` (the bytes after the tag) and returns the event in
    /// today's layout and the number of bytes read. Pure: no clock, no ids; a field the old
    /// layout lacked gets a default that means "not recorded".
    pub read: ReadOld<E>,
}

/// The versions of one event enum: its current layout per tag and its upcasters.
pub struct Registry<E: 'static> {
    /// `(tag, current version)` for every tag whose layout changed; others are at 1.
    pub current: &'static [(u32, u16)],
    pub upcasters: &'static [Upcaster<E>],
}

impl<E> Registry<E> {
    /// The layout version this build writes for `tag`.
    pub fn current_version(&self, tag: u32) -> u16 {
        self.current
            .iter()
            .find(|(t, _)| *t == tag)
            .map_or(1, |(_, version)| *version)
    }

    /// The upcaster that reads `tag` at layout `from`, if any.
    pub fn upcaster(&self, tag: u32, from: u16) -> Option<&Upcaster<E>> {
        self.upcasters
            .iter()
            .find(|u| u.tag == tag && u.from == from)
    }

    /// True when some tag is above version 1: only then can a stored event need more than
    /// a plain decode, so the codec's fast paths are taken when this is false.
    pub fn any_changed(&self) -> bool {
        self.current.iter().any(|(_, version)| *version > 1)
    }

    /// What is wrong with this registry for an enum of `tags` variants: every old layout
    /// `1..current` of every tag must have exactly one upcaster, no upcaster may read a
    /// layout at or above the current one, versions start at 1, a tag is listed once, and
    /// every tag exists. Empty when the registry is complete.
    pub fn problems(&self, tags: u32) -> Vec<String> {
        let mut problems = Vec::new();
        for (i, (tag, version)) in self.current.iter().enumerate() {
            if *tag >= tags {
                problems.push(format!("current: tag {tag} is not a variant (0..{tags})"));
            }
            if *version < 1 {
                problems.push(format!(
                    "current: tag {tag} is at version {version}, below 1"
                ));
            }
            if self.current[..i].iter().any(|(t, _)| t == tag) {
                problems.push(format!("current: tag {tag} is listed twice"));
            }
            for from in 1..*version {
                let count = self
                    .upcasters
                    .iter()
                    .filter(|u| u.tag == *tag && u.from == from)
                    .count();
                if count != 1 {
                    problems.push(format!(
                        "tag {tag}: layout {from} has {count} upcasters, expected exactly 1"
                    ));
                }
            }
        }
        for upcaster in self.upcasters {
            let current = self.current_version(upcaster.tag);
            if upcaster.from < 1 || upcaster.from >= current {
                problems.push(format!(
                    "tag {}: an upcaster reads layout {}, but the current layout is {current}",
                    upcaster.tag, upcaster.from
                ));
            }
        }
        problems
    }
}

/// An event enum that is written through the codec: it names its registry. `Event`
/// implements it; the evolution tests implement it for toy enums, so they run the same
/// envelope code as real commits.
pub trait Versioned: Serialize + DeserializeOwned + PartialEq + Clone + 'static {
    fn registry() -> &'static Registry<Self>;
}

impl Versioned for Event {
    fn registry() -> &'static Registry<Event> {
        &REGISTRY
    }
}

/// The catalogue's registry. Empty: no event has changed layout yet, so every event is at
/// version 1 and every commit is written in format 1.
pub static REGISTRY: Registry<Event> = Registry {
    current: &[],
    upcasters: &[],
};
