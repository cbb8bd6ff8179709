//! Lost commits: versions missing from an aggregate's chain, told from forged ones, and the
//! one write an aggregate with an open loss accepts (its acknowledgement).
//!
//! The rule: a message on an aggregate's subject that is a commit of that aggregate, intact
//! (its hash matches its content) and at a version past the chain's next, means the
//! versions in between were written and are gone (nats-server drops a message whose block
//! checksum fails, and its position then answers 404). Anything else outside the chain (a
//! replay, a modified commit, a commit at the next version that does not link) stays a
//! quarantine, as before. A loss is never folded past: reads and writes of the aggregate
//! answer `integrity` naming the missing versions until an operator appends
//! [`Event::LossAcknowledged`] for each, right after the chain's tip past the gap.
//!
//! The trade-off, chosen over signing commits with a writer key: anyone allowed to publish
//! on an aggregate's subject can freeze it (publish an intact commit at a skipped version)
//! until an operator acknowledges, but can never fork it; a signature would need every
//! writer (services linking the client library) to hold a key, and a lost commit would
//! still need the same acknowledgement.

use std::fmt;

use crate::catalogue::Event;
use crate::commit::{Commit, CommitDraft};
use crate::ids::AggregateId;

/// Versions `from_version..=to_version` of `aggregate` are missing from the log; the intact
/// commit after them (version `to_version + 1`) is at `next_position`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct LostVersions {
    pub aggregate: AggregateId,
    pub from_version: u64,
    pub to_version: u64,
    pub next_position: u64,
}

impl LostVersions {
    /// The loss `commit` reveals after a chain whose tip is at `tip_version`: `Some` if the
    /// commit is this aggregate's, intact, and more than one version past the tip.
    pub fn before(aggregate: &AggregateId, tip_version: u64, commit: &Commit) -> Option<Self> {
        (commit.aggregate == *aggregate
            && commit.version > tip_version + 1
            && commit.hash_is_valid())
        .then_some(LostVersions {
            aggregate: *aggregate,
            from_version: tip_version + 1,
            to_version: commit.version - 1,
            next_position: commit.position,
        })
    }

    /// The versions, as the CLI takes them (`2` or `2-5`).
    pub fn range(&self) -> String {
        if self.from_version == self.to_version {
            self.from_version.to_string()
        } else {
            format!("{}-{}", self.from_version, self.to_version)
        }
    }

    /// Whether `event` acknowledges exactly this loss.
    pub fn acknowledged_by(&self, event: &Event) -> bool {
        matches!(event, Event::LossAcknowledged { from_version, to_version, .. }
            if *from_version == self.from_version && *to_version == self.to_version)
    }
}

impl fmt::Display for LostVersions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let versions = if self.from_version == self.to_version {
            format!("version {} is", self.from_version)
        } else {
            format!("versions {} to {} are", self.from_version, self.to_version)
        };
        write!(
            f,
            "{} {versions} missing from the log (the commit after, v{}, is at position {}); \
             nothing is read or written past a loss until an operator runs \
             `provledger integrity acknowledge {} --lost {} --reason TEXT`",
            self.aggregate,
            self.to_version + 1,
            self.next_position,
            self.aggregate,
            self.range()
        )
    }
}

/// The range a commit acknowledges, if it is an acknowledgement.
pub fn acknowledged_range(events: &[Event]) -> Option<(u64, u64)> {
    events.iter().find_map(|e| match e {
        Event::LossAcknowledged {
            from_version,
            to_version,
            ..
        } => Some((*from_version, *to_version)),
        _ => None,
    })
}

/// Why a draft may not be appended to an aggregate, given its open losses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LossRefusal {
    /// The aggregate has an open loss and the draft is not its acknowledgement.
    #[error("integrity: {0}")]
    Lost(LostVersions),
    /// The draft acknowledges versions that are not an open loss of the aggregate, or
    /// carries other events with its acknowledgement.
    #[error("a loss_acknowledged commit must hold that one event and name an open loss of the aggregate exactly (versions {from_version} to {to_version} are not one)")]
    NotAnOpenLoss { from_version: u64, to_version: u64 },
}

/// The write rule at a chain's tip: with no open loss, anything but an acknowledgement; with
/// one, only a draft holding exactly one [`Event::LossAcknowledged`] naming an open loss.
pub fn admits(draft: &CommitDraft, open: &[LostVersions]) -> Result<(), LossRefusal> {
    let acknowledges = acknowledged_range(&draft.events);
    match (open.first(), acknowledges) {
        (None, None) => Ok(()),
        (_, Some((from_version, to_version))) => {
            let names_one =
                draft.events.len() == 1 && open.iter().any(|l| l.acknowledged_by(&draft.events[0]));
            if names_one {
                Ok(())
            } else {
                Err(LossRefusal::NotAnOpenLoss {
                    from_version,
                    to_version,
                })
            }
        }
        (Some(first), None) => Err(LossRefusal::Lost(*first)),
    }
}

/// The open losses of one chain as it is walked in order: a loss is opened where a commit
/// skips versions, and closed by a later commit of the chain acknowledging it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OpenLosses(Vec<LostVersions>);

impl OpenLosses {
    pub const EMPTY: OpenLosses = OpenLosses(Vec::new());

    pub fn open(&mut self, loss: LostVersions) {
        self.0.push(loss);
    }

    /// Closes the loss `commit` acknowledges, if it is one of these.
    pub fn close_by(&mut self, commit: &Commit) {
        if let [event] = commit.events.as_slice() {
            self.0.retain(|l| !l.acknowledged_by(event));
        }
    }

    pub fn first(&self) -> Option<&LostVersions> {
        self.0.first()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn as_slice(&self) -> &[LostVersions] {
        &self.0
    }
}

/// An aggregate read in log order (a projector) past a loss: the commits after the loss
/// are held, never folded, until every open loss is acknowledged; then all of them are
/// handed back in order, to fold as if the lost versions were never written.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeldChain {
    pub open: OpenLosses,
    /// The version and hash of the last commit held: the next one must link to it.
    pub tip_version: u64,
    pub tip_hash: crate::ids::Hash,
    /// Every commit of the chain since the first loss, oldest first.
    pub held: Vec<Commit>,
    /// The position of the aggregate's last commit before the first loss (0: none): the
    /// lost commits lay between it and the first one held.
    #[serde(default)]
    pub after_position: u64,
}

/// What a commit does to a [`HeldChain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeldStep {
    /// Held (it extends the chain, or reveals one more loss); losses remain open.
    Held,
    /// It acknowledged the last open loss: every commit held, itself last, to fold now.
    Resumed(Vec<Commit>),
    /// Not part of the chain (a replay, a modified commit, a broken link): quarantined.
    Outside(String),
}

impl HeldChain {
    /// The chain from the commit that revealed `loss`, which it holds; the aggregate's
    /// last commit before it was at `after_position`.
    pub fn start(loss: LostVersions, commit: Commit, after_position: u64) -> Self {
        let mut open = OpenLosses::default();
        open.open(loss);
        HeldChain {
            open,
            tip_version: commit.version,
            tip_hash: commit.hash,
            held: vec![commit],
            after_position,
        }
    }

    pub fn step(&mut self, commit: Commit) -> HeldStep {
        if let Some(loss) = LostVersions::before(&commit.aggregate, self.tip_version, &commit) {
            self.open.open(loss);
        } else if commit.version != self.tip_version + 1
            || !commit.hash_is_valid()
            || commit.prev_hash != self.tip_hash
        {
            return HeldStep::Outside(format!(
                "v{} at position {} does not extend {} past its lost versions (at v{})",
                commit.version, commit.position, commit.aggregate, self.tip_version
            ));
        } else {
            self.open.close_by(&commit);
        }
        self.tip_version = commit.version;
        self.tip_hash = commit.hash;
        self.held.push(commit);
        if self.open.is_empty() {
            HeldStep::Resumed(std::mem::take(&mut self.held))
        } else {
            HeldStep::Held
        }
    }
}

/// Every aggregate a reader in log order holds past a loss (the projector, the auditor):
/// the one place that decides, commit by commit, whether a commit is read as usual, held,
/// or hands back everything held.
#[derive(Debug, Clone, Default)]
pub struct HeldChains(std::collections::HashMap<AggregateId, HeldChain>);

/// What [`HeldChains::pass`] decided for one commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Passage {
    /// Neither held nor revealing a loss: checked against its chain and folded as usual.
    Read,
    /// Held, not folded: its aggregate's held chain as it stands now.
    Held(HeldChain),
    /// The last open loss acknowledged: every commit held, this one last, to fold now;
    /// the lost commits lay after `after_position` and before the first of them.
    Resumed {
        commits: Vec<Commit>,
        after_position: u64,
    },
    /// Not part of its held chain (a replay, a modified commit, a broken link): why.
    Outside(String),
}

impl HeldChains {
    pub fn new(chains: impl IntoIterator<Item = (AggregateId, HeldChain)>) -> Self {
        HeldChains(chains.into_iter().collect())
    }

    /// Decides `commit`, whose aggregate's chain as folded so far ends at `tip_version`,
    /// its last commit at `tip_position` (what is held is not folded). A commit read as
    /// usual is not copied.
    pub fn pass(&mut self, commit: &Commit, tip_version: u64, tip_position: u64) -> Passage {
        let aggregate = commit.aggregate;
        if let Some(chain) = self.0.get_mut(&aggregate) {
            let after_position = chain.after_position;
            return match chain.step(commit.clone()) {
                HeldStep::Held => Passage::Held(chain.clone()),
                HeldStep::Resumed(commits) => {
                    self.0.remove(&aggregate);
                    Passage::Resumed {
                        commits,
                        after_position,
                    }
                }
                HeldStep::Outside(reason) => Passage::Outside(reason),
            };
        }
        match LostVersions::before(&aggregate, tip_version, commit) {
            Some(loss) => {
                let chain = HeldChain::start(loss, commit.clone(), tip_position);
                self.0.insert(aggregate, chain.clone());
                Passage::Held(chain)
            }
            None => Passage::Read,
        }
    }

    /// Every aggregate held, with its chain.
    pub fn iter(&self) -> impl Iterator<Item = (&AggregateId, &HeldChain)> {
        self.0.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::ClusterStatus;
    use crate::ids::{Hash, Timestamp};
    use uuid::Uuid;

    fn draft(events: Vec<Event>) -> CommitDraft {
        CommitDraft {
            trace: None,
            commit_id: Uuid::from_u128(7),
            operation_id: None,
            causation_id: None,
            actor: "ops".into(),
            recorded_at: Timestamp(1),
            events,
        }
    }

    fn status() -> Vec<Event> {
        vec![Event::ClusterStatusChanged {
            status: ClusterStatus::Active,
            description: "x".into(),
        }]
    }

    fn ack(from: u64, to: u64) -> Event {
        Event::LossAcknowledged {
            from_version: from,
            to_version: to,
            reason: "checked".into(),
        }
    }

    #[test]
    fn an_intact_commit_past_the_next_version_reveals_a_loss_and_a_modified_one_does_not() {
        // Given a chain at v1, and an intact commit at v3 that links to a v2 nobody has,
        let x = AggregateId::cluster(Uuid::from_u128(1));
        let v3 = Commit::seal(x, 3, Hash([9; 32]), draft(status()));
        // when it is checked, then versions 2..=2 are lost;
        let loss = LostVersions::before(&x, 1, &v3).expect("a loss");
        assert_eq!((loss.from_version, loss.to_version), (2, 2));
        // a modified copy, the next version, or another aggregate's commit is no loss.
        let mut modified = v3.clone();
        modified.actor = "mallory".into();
        assert_eq!(LostVersions::before(&x, 1, &modified), None);
        assert_eq!(LostVersions::before(&x, 2, &v3), None);
        let y = AggregateId::cluster(Uuid::from_u128(2));
        assert_eq!(LostVersions::before(&y, 1, &v3), None);
    }

    #[test]
    fn a_held_chain_resumes_only_once_every_loss_is_acknowledged() {
        // Given v3 after a lost v2, then v4, then (lost v5) v6,
        let x = AggregateId::cluster(Uuid::from_u128(1));
        let v3 = Commit::seal(x, 3, Hash([9; 32]), draft(status()));
        let v4 = Commit::seal(x, 4, v3.hash, draft(status()));
        let v6 = Commit::seal(x, 6, Hash([8; 32]), draft(status()));
        let mut chain = HeldChain::start(LostVersions::before(&x, 1, &v3).unwrap(), v3, 1);
        assert_eq!(chain.step(v4.clone()), HeldStep::Held);
        // a replay is outside, and holds nothing;
        assert!(matches!(chain.step(v4), HeldStep::Outside(_)));
        assert_eq!(chain.step(v6.clone()), HeldStep::Held);
        // when v2 is acknowledged, v5 is still open;
        let ack2 = Commit::seal(x, 7, v6.hash, draft(vec![ack(2, 2)]));
        assert_eq!(chain.step(ack2.clone()), HeldStep::Held);
        // then acknowledging v5 hands back every commit held, in order.
        let ack5 = Commit::seal(x, 8, ack2.hash, draft(vec![ack(5, 5)]));
        let HeldStep::Resumed(all) = chain.step(ack5) else {
            panic!("resumed")
        };
        assert_eq!(
            all.iter().map(|c| c.version).collect::<Vec<_>>(),
            [3, 4, 6, 7, 8]
        );
    }

    #[test]
    fn an_open_loss_admits_only_its_own_acknowledgement() {
        let x = AggregateId::cluster(Uuid::from_u128(1));
        let loss = LostVersions {
            aggregate: x,
            from_version: 2,
            to_version: 3,
            next_position: 9,
        };
        assert_eq!(admits(&draft(status()), &[]), Ok(()));
        assert_eq!(
            admits(&draft(status()), &[loss]),
            Err(LossRefusal::Lost(loss))
        );
        assert_eq!(admits(&draft(vec![ack(2, 3)]), &[loss]), Ok(()));
        let not_open = |d: CommitDraft, open: &[LostVersions]| {
            matches!(admits(&d, open), Err(LossRefusal::NotAnOpenLoss { .. }))
        };
        assert!(not_open(draft(vec![ack(2, 2)]), &[loss]));
        assert!(not_open(draft(vec![ack(2, 3), ack(2, 3)]), &[loss]));
        assert!(not_open(draft(vec![ack(2, 3)]), &[]));
    }
}
