//! The executor port: what a provisioning flow acts on. A real service implements it with
//! its IPAM, DHCP, DNS, hypervisor and cluster plugin clients; `provledger-sim` implements
//! it with simulated executors. Compensations go through the same port
//! ([`CompensationExecutor`]), so the rollback driver and the flows reach the same owners.

use std::future::Future;
use std::pin::Pin;

use crate::executors::{CompensationExecutor, CompensationFuture, PeerError};

/// A forward action's outcome: `Err` says why the executor did not do it.
pub type ActionFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, PeerError>> + Send + 'a>>;

/// The infrastructure a provisioning flow acts on: forward actions by executor name, and
/// compensations (through [`CompensationExecutor`]). Every forward action carries the
/// idempotency key its step recorded before asking (`StepStarted`): the executor keeps
/// what it does under that key, answers a repeated request with the same key with the
/// same result, and can undo by the key a step whose outcome the ledger never learnt.
pub trait Infrastructure: CompensationExecutor {
    /// Performs `action` on `resource` at `executor` (e.g. `hypervisor` `create_vm`).
    fn act<'a>(
        &'a self,
        executor: &'a str,
        action: &'a str,
        resource: &'a str,
        idempotency_key: &'a str,
    ) -> CompensationFuture<'a>;
    /// Takes a free IP for `node` from IPAM.
    fn acquire_ip<'a>(
        &'a self,
        node: &'a str,
        idempotency_key: &'a str,
    ) -> ActionFuture<'a, String>;
}
