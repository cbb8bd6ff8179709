//! Who sent a request, as the NATS server vouches for it. A request that reaches serve
//! through a service import exported with `share: true` (deploy/nats/accounts.conf)
//! carries the `Nats-Request-Info` header, which the server writes and overwrites: a
//! client cannot forge it. Its account and user are the authenticated identity that
//! cmd.* record as the commit's actor, whatever `actor` the request names. A request
//! without it (one account, or no authentication configured) is trusted as it says.

use provledger_events::TraceContext;
use provledger_projections::lease::CallerWorker;
use serde::Deserialize;

/// The header nats-server adds to requests crossing a shared service import.
pub(crate) const REQUEST_INFO_HEADER: &str = "Nats-Request-Info";

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Caller {
    /// `user@ACCOUNT`, or `*@ACCOUNT` when the server vouches only for the account.
    identity: Option<String>,
    /// The trace the request's commits are recorded in: the caller's `traceparent`, or
    /// serve's span of the request when it exports spans (`service::respond` decides).
    trace: Option<TraceContext>,
}

#[derive(Deserialize)]
struct RequestInfo {
    #[serde(default)]
    acc: String,
    #[serde(default)]
    user: String,
}

impl Caller {
    pub(crate) fn from_headers(headers: Option<&async_nats::HeaderMap>) -> Caller {
        let info = headers
            .and_then(|h| h.get(REQUEST_INFO_HEADER))
            .and_then(|v| serde_json::from_str::<RequestInfo>(v.as_str()).ok());
        let identity = info.and_then(|i| match (i.user.is_empty(), i.acc.is_empty()) {
            (_, true) => None,
            (false, false) => Some(format!("{}@{}", i.user, i.acc)),
            (true, false) => Some(format!("*@{}", i.acc)),
        });
        Caller {
            identity,
            trace: None,
        }
    }

    /// The caller, its commits recorded in `trace`.
    pub(crate) fn in_trace(mut self, trace: Option<TraceContext>) -> Caller {
        self.trace = trace;
        self
    }

    /// The trace context the request's commits record.
    pub(crate) fn trace(&self) -> Option<TraceContext> {
        self.trace
    }

    /// The worker the server vouches the caller is (`worker-w1@SERVICES` is worker `w1`,
    /// `u@ACC` is `u`): what `cmd.append` passes to the decider as
    /// `DecideOptions::caller_worker`. `None` without a vouched user (no header, or
    /// `*@ACCOUNT`): the lease-holder rules apply alone.
    pub(crate) fn worker(&self) -> Option<CallerWorker> {
        self.identity
            .as_deref()
            .and_then(CallerWorker::from_identity)
    }

    /// The actor a command records: the authenticated identity when the server gave one,
    /// else the request's `actor`, else `default`.
    pub(crate) fn actor(&self, requested: Option<&str>, default: &str) -> String {
        match &self.identity {
            Some(identity) => identity.clone(),
            None => requested.unwrap_or(default).to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(info: &str) -> async_nats::HeaderMap {
        let mut h = async_nats::HeaderMap::new();
        h.insert(REQUEST_INFO_HEADER, info);
        h
    }

    #[test]
    fn the_server_vouched_identity_wins_over_the_requested_actor() {
        let caller = Caller::from_headers(Some(&headers(
            r#"{"acc":"SERVICES","user":"provisioner","name":"claims to be admin","rtt":1}"#,
        )));
        assert_eq!(caller.actor(Some("admin"), "d"), "provisioner@SERVICES");
    }

    #[test]
    fn an_account_only_identity_is_recorded_as_the_account() {
        let caller = Caller::from_headers(Some(&headers(r#"{"acc":"SERVICES","rtt":1}"#)));
        assert_eq!(caller.actor(Some("admin"), "d"), "*@SERVICES");
    }

    #[test]
    fn a_vouched_worker_user_is_its_worker_and_an_account_only_identity_no_worker() {
        let worker = |info: &str| Caller::from_headers(Some(&headers(info))).worker();
        let w1 = worker(r#"{"acc":"SERVICES","user":"worker-w1"}"#).expect("a worker");
        assert!(w1.is("w1"), "{w1}");
        let provisioner = worker(r#"{"acc":"SERVICES","user":"provisioner"}"#).expect("a user");
        assert!(provisioner.is("provisioner"), "{provisioner}");
        assert_eq!(worker(r#"{"acc":"SERVICES"}"#), None);
        assert_eq!(Caller::from_headers(None).worker(), None);
    }

    #[test]
    fn without_the_header_or_with_garbage_the_request_is_trusted_as_it_says() {
        assert_eq!(Caller::from_headers(None).actor(Some("svc"), "d"), "svc");
        let garbage = Caller::from_headers(Some(&headers("not json")));
        assert_eq!(garbage.actor(None, "d"), "d");
    }
}
