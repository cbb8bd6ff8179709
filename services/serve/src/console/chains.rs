//! What the console has already verified of each aggregate's chain, so that a page reads
//! only what is new: the subject as classified so far (its tip, how many commits and
//! quarantined messages), and the tips of the newest commits, which say where the page's
//! window starts. Every message of the subject has been read and classified once (a
//! commit that extends the chain, or a message outside it); a page reads the messages
//! after the kept tip, then the window it shows.
//!
//! A message deleted from the stream after it was verified here goes unnoticed until
//! serve restarts (JetStream cannot alter a stored message; an administrator can delete
//! one): `provledger audit` checks the whole log's positions.

use std::collections::{HashMap, VecDeque};

use provledger_events::{AggregateId, ChainTip, HistoryEntry, OpenLosses};

/// Aggregates whose verified chain is kept (about 6 KB each); past it the whole map is
/// dropped and each page pays one whole read again.
pub const CHAINS_KEPT_MAX: usize = 1_024;

/// One aggregate's subject as classified so far.
#[derive(Debug, Clone)]
pub(crate) struct Verified {
    /// The chain's tip, at the last subject sequence classified (which may be a
    /// quarantined message's: the next read starts after it).
    pub(crate) through: ChainTip,
    pub(crate) commits: usize,
    pub(crate) quarantined: usize,
    /// Losses found so far that no later commit acknowledges (`provledger_events::loss`).
    pub(crate) losses: OpenLosses,
    /// The tips of the newest commits, oldest first: at most `window + 1`, the first being
    /// the commit just before the page (where reading the page starts).
    pub(crate) newest: VecDeque<ChainTip>,
}

impl Verified {
    pub(crate) fn new() -> Self {
        Verified {
            through: ChainTip::EMPTY,
            commits: 0,
            quarantined: 0,
            losses: OpenLosses::EMPTY,
            newest: VecDeque::new(),
        }
    }

    /// Takes in the entries read after `through`, in subject order, up to `applied`
    /// (what lies beyond is left for a later read). Pure.
    pub(crate) fn extend(&mut self, entries: &[HistoryEntry], applied: u64, window: usize) {
        for entry in entries {
            match entry {
                HistoryEntry::Commit(c) => {
                    if c.position > applied {
                        return;
                    }
                    self.through = ChainTip {
                        version: c.version,
                        position: c.position,
                        hash: c.hash,
                    };
                    self.commits += 1;
                    self.losses.close_by(c);
                    self.newest.push_back(self.through);
                    while self.newest.len() > window + 1 {
                        self.newest.pop_front();
                    }
                }
                HistoryEntry::Quarantined { position, .. } => {
                    if *position > applied {
                        return;
                    }
                    // The chain stays where it was; the subject moves past the message.
                    self.through.position = *position;
                    self.quarantined += 1;
                }
                // The commit after the loss, which follows it, moves the tip.
                HistoryEntry::Lost(l) => {
                    if l.next_position > applied {
                        return;
                    }
                    self.losses.open(*l);
                }
            }
        }
    }

    /// Where reading the page's window starts: after the commit before the window, or
    /// from the subject's start when the window reaches version 1.
    pub(crate) fn window_start(&self, window: usize) -> ChainTip {
        match self.newest.len() > window {
            true => self.newest.front().copied().unwrap_or(ChainTip::EMPTY),
            false => ChainTip::EMPTY,
        }
    }
}

/// The verified chains, bounded by [`CHAINS_KEPT_MAX`].
#[derive(Default)]
pub(crate) struct Chains {
    kept: std::sync::Mutex<HashMap<AggregateId, Verified>>,
}

impl Chains {
    pub(crate) fn get(&self, id: &AggregateId) -> Option<Verified> {
        self.kept
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
    }

    /// Keeps `verified` unless a concurrent page already kept a chain further along.
    pub(crate) fn keep(&self, id: AggregateId, verified: Verified) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= CHAINS_KEPT_MAX && !kept.contains_key(&id) {
            kept.clear();
        }
        match kept.get(&id) {
            Some(k) if k.through.position >= verified.through.position => {}
            _ => {
                kept.insert(id, verified);
            }
        }
    }
}
