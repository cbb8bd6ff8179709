//! Permission violations NATS reported to this process. The server answers a publish this
//! user may not make with an asynchronous `-ERR 'Permissions Violation for Publish to
//! "<subject>"'`, never with a reply, so the append itself only times out. The connection's
//! event callback records the violation here, and the write path turns an `Unavailable`
//! append to a denied subject into a typed `PermissionDenied` instead of retrying it.
//!
//! Process-wide because async-nats gives the event callback no handle on the request it
//! concerns; violations name their subject, so one client cannot misread another's.

use std::sync::Mutex;
use std::time::Instant;

/// The most recent violations, newest last; a few suffice, as each names its subject.
const KEPT: usize = 16;

/// Each violation with when it arrived: only one that arrived during an append explains
/// that append's timeout (a later outage on the same subject is an outage).
static SEEN: Mutex<Vec<(Instant, String)>> = Mutex::new(Vec::new());

/// Records a server error if it is a permissions violation; says whether it was.
pub(crate) fn record(server_error: &str) -> bool {
    if !server_error
        .to_ascii_lowercase()
        .contains("permissions violation")
    {
        return false;
    }
    // A poisoned lock only means another thread panicked while pushing; the list is
    // still a list of strings, so keep using it.
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if seen.len() == KEPT {
        seen.remove(0);
    }
    seen.push((Instant::now(), server_error.to_string()));
    true
}

/// The newest violation recorded at or after `since` naming a subject that ends with
/// `suffix` (e.g. `.ev.cluster.<id>`: whatever the prefix, a uuid names one aggregate).
pub fn denied(suffix: &str, since: Instant) -> Option<String> {
    let quoted = format!("{suffix}\"");
    let seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    seen.iter()
        .rev()
        .find(|(at, m)| *at >= since && m.contains(&quoted))
        .map(|(_, m)| m.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_violation_is_found_by_its_exact_subject_and_time_only() {
        let before = Instant::now();
        assert!(!record("slow consumer"));
        assert!(record(
            "Permissions Violation for Publish to \"p.ev.cluster.a1\""
        ));
        assert!(denied(".ev.cluster.a1", before).is_some());
        assert!(
            denied(".ev.cluster.a", before).is_none(),
            "a prefix is another subject"
        );
        assert!(denied(".ev.cluster.b1", before).is_none());
        let after = Instant::now();
        assert!(
            denied(".ev.cluster.a1", after).is_none(),
            "an earlier denial does not explain a later timeout"
        );
    }
}
