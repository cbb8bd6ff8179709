//! [`DriftFold`]: the ledger's side of drift folded from the log a commit at a time,
//! holding the whole state of an operation only while it is open. Once an operation
//! closes, it is reduced to its [`OperationResources`] and its chain tip; its state is
//! dropped. A later commit on it (a `rollback resolve` of a held or needs_attention
//! operation) is checked against the kept tip and then asks for the operation's history
//! ([`Folded::NeedsHistory`]), which the shell reads back from the log and hands to
//! [`DriftFold::reopen`]: rare, and it costs that one aggregate.
//!
//! At a million effects, the folded state of every operation is gigabytes; this is what
//! `provledger drift` holds instead (`docs/drift.md`, "Limits").

use std::collections::HashMap;

use provledger_events::{AggregateId, AggregateKind, ChainViolation, Commit, Hash};

use super::ledger::{LedgerResources, Names, OperationResources};
use crate::projection::{Entity, Projection};
use crate::Header;

/// What [`DriftFold::apply`] did with a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "NeedsHistory asks the caller to reopen the operation and apply the commit again"]
pub enum Folded {
    /// Folded.
    Applied,
    /// Not an operation's commit: drift reads nothing else.
    Ignored,
    /// Outside its aggregate's chain (replayed, forged, altered): not folded, as serve
    /// quarantines it.
    Quarantined(ChainViolation),
    /// It extends the chain of an operation closed and reduced earlier: hand that
    /// operation's commits before this one to [`DriftFold::reopen`], then apply it again.
    NeedsHistory(AggregateId),
}

/// A history handed to [`DriftFold::reopen`] that does not rebuild the operation's chain to
/// the tip kept when it was reduced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the history read back for {aggregate} refolds to version {refolded}, not to version \
     {kept} as first read: the reduced operation is kept, the later commit not folded"
)]
pub struct Refolded {
    pub aggregate: AggregateId,
    pub kept: u64,
    pub refolded: u64,
}

/// An operation closed and reduced.
#[derive(Debug)]
struct Closed {
    version: u64,
    hash: Hash,
    resources: OperationResources,
}

/// The operations of a log as drift needs them.
#[derive(Debug, Default)]
pub struct DriftFold {
    open: Projection,
    closed: HashMap<AggregateId, Closed>,
    names: Names,
}

impl DriftFold {
    pub fn new() -> Self {
        DriftFold::default()
    }

    /// Folds the next commit of the log.
    pub fn apply(&mut self, commit: &Commit) -> Folded {
        if commit.aggregate.kind != AggregateKind::Operation {
            return Folded::Ignored;
        }
        if let Some(closed) = self.closed.get(&commit.aggregate) {
            let mut tip = Header::new(commit.aggregate);
            tip.version = closed.version;
            tip.hash = closed.hash;
            return match tip.check_next(commit) {
                Ok(()) => Folded::NeedsHistory(commit.aggregate),
                Err(v) => Folded::Quarantined(v),
            };
        }
        if let Err(v) = self.open.apply_checked(commit) {
            return Folded::Quarantined(v);
        }
        self.reduce_if_closed(commit.aggregate);
        Folded::Applied
    }

    /// Brings back a reduced operation from its commits (oldest first, up to the one that
    /// asked for them), folded as they were the first time: a commit outside the chain is
    /// again left out. The history must rebuild the chain to the tip kept when the
    /// operation was reduced; otherwise (a log whose history read disagrees with its
    /// stream) the reduced operation is kept as it was, and the commit that asked cannot be
    /// folded: the caller reports it.
    pub fn reopen(&mut self, aggregate: AggregateId, history: &[Commit]) -> Result<(), Refolded> {
        let Some(closed) = self.closed.get(&aggregate) else {
            return Ok(());
        };
        let mut scratch = Projection::new();
        for commit in history.iter().filter(|c| c.aggregate == aggregate) {
            let _quarantined_again = scratch.apply_checked(commit);
        }
        let Some(entity) = scratch.entities.remove(&aggregate) else {
            return Err(Refolded {
                aggregate,
                kept: closed.version,
                refolded: 0,
            });
        };
        let header = entity.header();
        if header.version != closed.version || header.hash != closed.hash {
            return Err(Refolded {
                aggregate,
                kept: closed.version,
                refolded: header.version,
            });
        }
        self.closed.remove(&aggregate);
        self.open.entities.insert(aggregate, entity);
        Ok(())
    }

    fn reduce_if_closed(&mut self, aggregate: AggregateId) {
        let closed = matches!(
            self.open.entities.get(&aggregate),
            Some(Entity::Operation(op)) if op.is_closed()
        );
        if !closed {
            return;
        }
        if let Some(Entity::Operation(op)) = self.open.entities.remove(&aggregate) {
            let resources = OperationResources::of(&op, &mut self.names);
            self.closed.insert(
                aggregate,
                Closed {
                    version: op.header.version,
                    hash: op.header.hash,
                    resources,
                },
            );
        }
    }

    /// How many operations are held whole (open), and how many reduced (closed).
    pub fn counts(&self) -> (usize, usize) {
        (self.open.entities.len(), self.closed.len())
    }

    /// What the operations folded so far say the executors hold.
    pub fn resources(&mut self) -> LedgerResources {
        let open: Vec<OperationResources> = self
            .open
            .operations()
            .map(|op| OperationResources::of(op, &mut self.names))
            .collect();
        LedgerResources::build(
            self.closed
                .values()
                .map(|c| &c.resources)
                .chain(open.iter()),
        )
    }
}
