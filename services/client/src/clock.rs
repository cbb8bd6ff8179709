//! The clock and the id source the client library stamps its commits and decisions with.
//! Everything in this crate that needs "now" or a fresh id asks a [`Stamper`], never the
//! wall clock or `Uuid::now_v7` directly, so that a simulation can drive time and ids.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use provledger_events::{CommitDraft, Event, Timestamp};
use uuid::Uuid;

/// What time it is, for the writer.
pub trait Clock: Send + Sync {
    fn now(&self) -> Timestamp;
}

/// Where fresh ids come from. Ids must be UUID v7 minted at `at`: JetStream's retry scan
/// reads the mint time back out of a commit id.
pub trait IdSource: Send + Sync {
    fn next_id(&self, at: Timestamp) -> Uuid;
}

/// The wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        Timestamp::now()
    }
}

/// Random UUID v7 ids (the uuid crate's generator).
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomIds;

impl IdSource for RandomIds {
    fn next_id(&self, _at: Timestamp) -> Uuid {
        Uuid::now_v7()
    }
}

/// Deterministic UUID v7 ids: the mint time, then a counter mixed with a seed, so that the
/// same seed and the same sequence of calls give the same ids. For simulations and demos.
#[derive(Debug)]
pub struct SeededIds {
    seed: u64,
    counter: AtomicU64,
}

impl SeededIds {
    pub fn new(seed: u64) -> Self {
        SeededIds {
            seed,
            counter: AtomicU64::new(0),
        }
    }
}

impl IdSource for SeededIds {
    fn next_id(&self, at: Timestamp) -> Uuid {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        // splitmix64: spreads consecutive counters over all bits, so short ids differ.
        let mut z = self
            .seed
            .wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let ms = u64::try_from(at.unix_ms()).unwrap_or(0);
        let mut bytes = [0u8; 10];
        bytes[..8].copy_from_slice(&z.to_be_bytes());
        bytes[8..].copy_from_slice(&(n as u16).to_be_bytes());
        uuid::Builder::from_unix_timestamp_millis(ms, &bytes).into_uuid()
    }
}

/// A clock and an id source together: what the runner, the driver and the deletion steps
/// stamp drafts with. Cheap to clone.
#[derive(Clone)]
pub struct Stamper {
    clock: Arc<dyn Clock>,
    ids: Arc<dyn IdSource>,
}

impl Default for Stamper {
    fn default() -> Self {
        Stamper::system()
    }
}

impl std::fmt::Debug for Stamper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Stamper")
    }
}

impl Stamper {
    /// The wall clock and random UUID v7 ids: what a service uses.
    pub fn system() -> Self {
        Stamper::new(Arc::new(SystemClock), Arc::new(RandomIds))
    }

    pub fn new(clock: Arc<dyn Clock>, ids: Arc<dyn IdSource>) -> Self {
        Stamper { clock, ids }
    }

    pub fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// A fresh id, minted now.
    pub fn id(&self) -> Uuid {
        self.ids.next_id(self.clock.now())
    }

    /// A draft with a fresh commit id, recorded now.
    pub fn draft(&self, actor: &str, events: Vec<Event>) -> CommitDraft {
        self.draft_at(self.clock.now(), actor, events)
    }

    /// A draft with a fresh commit id minted at `at`, recorded at `at`: for a writer whose
    /// events depend on the time they are recorded at (a lease), so that the time it
    /// decided with is the time the decider sees.
    pub fn draft_at(&self, at: Timestamp, actor: &str, events: Vec<Event>) -> CommitDraft {
        CommitDraft {
            trace: None,
            commit_id: self.ids.next_id(at),
            operation_id: None,
            causation_id: None,
            actor: actor.to_string(),
            recorded_at: at,
            events,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct FixedClock(i64);
    impl Clock for FixedClock {
        fn now(&self) -> Timestamp {
            Timestamp::from_unix_ms(self.0)
        }
    }

    #[test]
    fn seeded_ids_repeat_per_seed_and_differ_across_seeds() {
        let stamper = |seed| {
            Stamper::new(
                Arc::new(FixedClock(1_700_000_000_000)),
                Arc::new(SeededIds::new(seed)),
            )
        };
        let (a, b, c) = (stamper(7), stamper(7), stamper(8));
        let ids = |s: &Stamper| (0..100).map(|_| s.id()).collect::<Vec<_>>();
        let (ia, ib, ic) = (ids(&a), ids(&b), ids(&c));
        assert_eq!(ia, ib, "same seed, same ids");
        assert_ne!(ia, ic, "another seed, other ids");
        let distinct: std::collections::BTreeSet<_> = ia.iter().collect();
        assert_eq!(distinct.len(), ia.len(), "no id repeats");
        assert!(ia.iter().all(|u| u.get_version_num() == 7), "UUID v7");
        let tails: std::collections::BTreeSet<_> = ia
            .iter()
            .map(|u| u.simple().to_string()[24..].to_string())
            .collect();
        assert_eq!(
            tails.len(),
            ia.len(),
            "the last 8 hex digits tell ids apart"
        );
    }

    #[test]
    fn drafts_carry_the_injected_time_and_id() {
        let s = Stamper::new(Arc::new(FixedClock(42_000)), Arc::new(SeededIds::new(1)));
        let d = s.draft("t", vec![]);
        assert_eq!(d.recorded_at, Timestamp::from_unix_ms(42_000));
        assert_eq!(d.commit_id.get_timestamp().map(|t| t.to_unix().0), Some(42));
    }
}
