//! What every projected entity has in common: its identity, how far it has been folded,
//! and the anomalies met on the way.

use provledger_events::{AggregateId, ChainTip, Hash, Timestamp, TraceContext};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// How many anomalies an entity keeps in full. Older ones are still counted in
/// `anomaly_count`, so an operator sees that more happened than is listed; the events
/// themselves are never lost, they stay in the log.
pub const ANOMALIES_KEPT_MAX: usize = 64;

/// An event that made no sense for the entity's state when it was folded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Anomaly {
    pub position: u64,
    pub version: u64,
    pub event: String,
    pub problem: String,
}

/// Where an event sits in the log, for the fold's bookkeeping and anomaly reports.
#[derive(Debug, Clone, Copy)]
pub struct EventContext {
    pub position: u64,
    pub version: u64,
    pub recorded_at: Timestamp,
    pub operation_id: Option<Uuid>,
}

/// Identity and fold progress of one entity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub id: AggregateId,
    /// The number of commits folded into this state (the aggregate's version).
    pub version: u64,
    /// The log position of the last commit folded.
    pub last_position: u64,
    /// The hash of the last commit folded: the chain's tip, which the next commit's
    /// `prev_hash` must equal.
    pub hash: Hash,
    pub created_at: Option<Timestamp>,
    pub updated_at: Option<Timestamp>,
    pub anomalies: Vec<Anomaly>,
    pub anomaly_count: u64,
    /// The trace context of the latest commit folded that recorded one: what serve sends
    /// on this entity's behalf (a compensation request, a re-issue) continues that trace.
    pub trace: Option<TraceContext>,
}

impl Header {
    /// The tip of the chain folded into this state: its version, last position and hash.
    pub fn tip(&self) -> ChainTip {
        ChainTip {
            version: self.version,
            position: self.last_position,
            hash: self.hash,
        }
    }

    pub fn new(id: AggregateId) -> Self {
        Header {
            id,
            version: 0,
            last_position: 0,
            hash: Hash::ZERO,
            created_at: None,
            updated_at: None,
            anomalies: Vec::new(),
            anomaly_count: 0,
            trace: None,
        }
    }

    pub fn record_anomaly(&mut self, ctx: &EventContext, event: String, problem: String) {
        self.anomaly_count += 1;
        if self.anomalies.len() == ANOMALIES_KEPT_MAX {
            self.anomalies.remove(0);
        }
        self.anomalies.push(Anomaly {
            position: ctx.position,
            version: ctx.version,
            event,
            problem,
        });
    }
}

/// What folding one event did to the entity's state. The fold decides per event whether
/// an anomalous event still changes state: a fact about the outside world (an effect that
/// happened, hardware that changed) is applied anyway so nothing real is forgotten; an
/// impossible transition is not applied. The two are different answers because their
/// readers need them apart: the decider accepts a commit whose events are applied (with
/// an anomaly or not) and refuses one with an event the fold would not apply, while the
/// fold of the log keeps both kinds of anomaly on the entity alike.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Folded {
    /// Applied; nothing out of place.
    Applied,
    /// Applied (the state changed) although out of place: kept as an anomaly.
    AppliedWithAnomaly(String),
    /// Not applied: the state is exactly as it was before the event (the module's tests
    /// check this, and the converse for `AppliedWithAnomaly`, on every sample event).
    /// Kept as an anomaly.
    Refused(String),
}

impl Folded {
    /// The anomaly to keep on the entity: the problem of an event applied with an anomaly
    /// or refused, `None` for one applied cleanly.
    pub(crate) fn anomaly(self) -> Option<String> {
        match self {
            Folded::Applied => None,
            Folded::AppliedWithAnomaly(problem) | Folded::Refused(problem) => Some(problem),
        }
    }

    /// Applied with an anomaly if the fold changed the state before it found the problem
    /// (`changed`), otherwise refused: for an event applied in part, or a fact applied
    /// anyway that may equal what the state already held.
    pub(crate) fn anomaly_or_refused(changed: bool, problem: String) -> Folded {
        if changed {
            Folded::AppliedWithAnomaly(problem)
        } else {
            Folded::Refused(problem)
        }
    }
}

/// A fold's helper: the refusal of an event on an entity that was never created.
pub(crate) fn not_created(kind: &str) -> Folded {
    Folded::Refused(format!("the {kind} was never created; event not applied"))
}

/// A view field: the value's JSON form, or null when it has none.
pub(crate) fn json_or_null<T: Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests;
