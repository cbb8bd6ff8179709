//! The bounds of a worker's task lease and who a worker is, shared by the append decider
//! (which refuses a commit that breaks them, `decide.rs`) and the Rust client's
//! `TaskLease` (which follows them), so that the two cannot disagree. Pure: the only time
//! is a commit's `recorded_at`.
//!
//! A lease is granted by the commit that records `task_started` or `task_lease_renewed`:
//! it runs from that commit's `recorded_at` (the instance's `task_lease_since`) to the
//! event's `lease_until`. Its **length** is `lease_until - recorded_at` of that commit,
//! and only of that commit: a renewal's length is measured from the renewal, not from the
//! task's start.
//!
//! - A lease must end after the commit that grants it, at least [`LEASE_MS_MIN`] and at
//!   most [`LEASE_MS_MAX`] later.
//! - A renewal must extend the lease (a later `lease_until`) and may come no sooner than
//!   half the current lease's length after the current lease was granted
//!   ([`renewal_not_before`]).

use provledger_events::Timestamp;

/// The longest lease: it may end at most 15 minutes after the `recorded_at` of the commit
/// that grants it. A worker that dies holding a lease keeps its task from the recovery
/// sweep until the lease ends, so this bounds how long a dead worker's task stays stuck
/// and unreported (15 minutes, plus one sweep interval: `--recovery-interval`, 60 s by
/// default), which is the order an operator expects a stuck "powering-off" to be noticed
/// in. A task that runs longer (an image upload) renews: with a 15-minute lease, one
/// commit every 7.5 minutes.
pub const LEASE_MS_MAX: i64 = 15 * 60 * 1000;

/// The shortest lease: 1 second. Renewals come at most once per half lease, so this bounds
/// one task's heartbeat to two commits a second whatever the worker asks; every renewal is
/// a commit kept in the log forever. Nothing needs a shorter lease: the recovery sweep runs
/// every 60 s by default.
pub const LEASE_MS_MIN: i64 = 1000;

/// The prefix of a worker's NATS user (`deploy/nats/accounts.conf`): user `worker-w1` is
/// worker `w1`.
pub const WORKER_USER_PREFIX: &str = "worker-";

/// The earliest time a lease granted at `since` (the granting commit's `recorded_at`) and
/// ending at `until` may be renewed: half its length after `since`, rounded up to the
/// millisecond (so never sooner than half). The decider refuses a renewal recorded before
/// it (`renewal_too_soon`); the Rust client's `TaskLease::renew_if_due` writes nothing
/// before it.
pub fn renewal_not_before(since: Timestamp, until: Timestamp) -> Timestamp {
    let (since, until) = (i128::from(since.unix_ms()), i128::from(until.unix_ms()));
    let length = until - since;
    // Ceiling of half the length, also for a length that is odd or not positive (a lease
    // recorded before the bounds existed).
    let half = length.div_euclid(2) + length.rem_euclid(2);
    let at = (since + half).clamp(i128::from(i64::MIN), i128::from(i64::MAX));
    Timestamp::from_unix_ms(at as i64)
}

/// The longest worker id an authenticated caller is checked as, in bytes. The id is held
/// inline so that `DecideOptions` stays `Copy`; a longer one is kept truncated and then
/// matches no worker, so such a caller is refused every task event naming a worker.
pub const WORKER_ID_BYTES_MAX: usize = 64;

/// The worker a write's sender is authenticated as (`DecideOptions::caller_worker`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallerWorker {
    len: u8,
    truncated: bool,
    bytes: [u8; WORKER_ID_BYTES_MAX],
}

impl CallerWorker {
    /// The worker `id`, truncated (at a character boundary) to [`WORKER_ID_BYTES_MAX`]
    /// bytes if longer; a truncated one is no worker ([`CallerWorker::is`] is false).
    pub fn new(id: &str) -> CallerWorker {
        let mut end = id.len().min(WORKER_ID_BYTES_MAX);
        while !id.is_char_boundary(end) {
            end -= 1;
        }
        let mut bytes = [0u8; WORKER_ID_BYTES_MAX];
        bytes[..end].copy_from_slice(&id.as_bytes()[..end]);
        CallerWorker {
            len: end as u8,
            truncated: end < id.len(),
            bytes,
        }
    }

    /// The worker an authenticated identity `user@ACCOUNT` is ([`worker_of_identity`]).
    pub fn from_identity(identity: &str) -> Option<CallerWorker> {
        worker_of_identity(identity).map(CallerWorker::new)
    }

    /// Whether this is worker `id`.
    pub fn is(&self, id: &str) -> bool {
        !self.truncated && self.as_str() == id
    }

    /// The id (its first [`WORKER_ID_BYTES_MAX`] bytes if it was longer).
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.bytes[..usize::from(self.len)]).unwrap_or_default()
    }
}

impl std::fmt::Display for CallerWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())?;
        if self.truncated {
            f.write_str("…")?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for CallerWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CallerWorker({self})")
    }
}

/// The worker an authenticated NATS identity (`user@ACCOUNT`, as serve's `Caller` renders
/// it) is: user `worker-<id>` is worker `<id>` (`worker-w1@SERVICES` -> `w1`), any other
/// user is the worker of its own name (`compute-1@SERVICES` -> `compute-1`). `None` when
/// the identity names no user (`*@ACCOUNT`: the server vouched for the account only) or
/// is not of that form: such a caller is treated as unauthenticated.
pub fn worker_of_identity(identity: &str) -> Option<&str> {
    let (user, account) = identity.rsplit_once('@')?;
    if user.is_empty() || user == "*" || account.is_empty() {
        return None;
    }
    match user.strip_prefix(WORKER_USER_PREFIX) {
        Some(id) if !id.is_empty() => Some(id),
        _ => Some(user),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_unix_ms(ms)
    }

    #[test]
    fn a_renewal_is_due_half_a_lease_after_it_was_granted_rounded_up() {
        assert_eq!(renewal_not_before(at(1_000), at(11_000)), at(6_000));
        assert_eq!(renewal_not_before(at(1_000), at(11_001)), at(6_001));
        // A lease that ended before it was granted (recorded before the bounds): at once.
        assert_eq!(renewal_not_before(at(1_000), at(999)), at(1_000));
        assert_eq!(
            renewal_not_before(at(i64::MIN), at(i64::MAX)),
            at(0),
            "no overflow"
        );
    }

    #[test]
    fn a_worker_user_is_its_worker_and_another_user_its_own_name() {
        assert_eq!(worker_of_identity("worker-w1@SERVICES"), Some("w1"));
        assert_eq!(worker_of_identity("compute-1@SERVICES"), Some("compute-1"));
        assert_eq!(
            worker_of_identity("provisioner@SERVICES"),
            Some("provisioner")
        );
        // A user named exactly the prefix is no worker id: it is its own name.
        assert_eq!(worker_of_identity("worker-@SERVICES"), Some("worker-"));
        // The account only, or no identity at all: not authenticated as a worker.
        assert_eq!(worker_of_identity("*@SERVICES"), None);
        assert_eq!(worker_of_identity("@SERVICES"), None);
        assert_eq!(worker_of_identity("w1"), None);
        assert_eq!(worker_of_identity("w1@"), None);
    }

    #[test]
    fn a_caller_worker_is_its_id_and_one_too_long_to_hold_is_no_worker() {
        let w1 = CallerWorker::from_identity("worker-w1@SERVICES").expect("a worker");
        assert!(w1.is("w1"));
        assert!(!w1.is("w2"));
        assert_eq!(w1.to_string(), "w1");
        assert_eq!(CallerWorker::from_identity("*@SERVICES"), None);
        let exact = "é".repeat(WORKER_ID_BYTES_MAX / 2);
        assert!(CallerWorker::new(&exact).is(&exact));
        let long = format!("{exact}x");
        let truncated = CallerWorker::new(&long);
        assert!(!truncated.is(&long));
        assert!(!truncated.is(&exact), "a prefix is not the worker");
        assert_eq!(truncated.to_string(), format!("{exact}…"));
        // Cut at a character boundary: 63 bytes of a two-byte character, not 64.
        let odd = format!("x{exact}");
        assert_eq!(
            CallerWorker::new(&odd).as_str().len(),
            WORKER_ID_BYTES_MAX - 1
        );
    }
}
