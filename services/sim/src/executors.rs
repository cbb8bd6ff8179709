//! Simulated executors for the demo and the tests: IPAM, DHCP, DNS, a hypervisor and a
//! cluster plugin. Each really keeps its resources (in memory), carries out compensations
//! idempotently by `compensation_id`, counts how often each compensation took effect (a
//! test asserts "once"), and can be told to fail a chosen call of a chosen action, or its
//! next compensations. `serve_on_nats` answers compensation requests over NATS the way a
//! real owning service would.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use provledger_client::{
    ActionFuture, CompensationExecutor, CompensationFuture, CompensationReply, CompensationRequest,
    Infrastructure, NatsExecutors,
};
use uuid::Uuid;

pub const IPAM: &str = "ipam";
pub const DHCP: &str = "dhcp";
pub const DNS: &str = "dns";
pub const HYPERVISOR: &str = "hypervisor";
pub const PLUGIN: &str = "plugin";
/// IPs in the simulated pool (10.0.x.y).
const IP_POOL_MAX: u32 = 65_000;

#[derive(Debug, Clone)]
struct Fault {
    action: String,
    /// The 1-based call of `action` that fails.
    on_call: u32,
}

#[derive(Debug, Default)]
struct SimState {
    /// Resource → the action that made it (or its state, for the plugin).
    resources: BTreeMap<String, String>,
    calls: BTreeMap<String, u32>,
    faults: Vec<Fault>,
    compensation_failures_left: u32,
    /// How many times each compensation took effect (at most once if idempotent).
    applied: BTreeMap<Uuid, u32>,
    /// How many requests arrived for each compensation, counted before deduplication, so
    /// that a driver sending one twice is seen even though it takes effect once.
    requests: BTreeMap<Uuid, u32>,
    next_ip: u32,
}

/// One simulated executor.
pub struct SimExecutor {
    name: String,
    // A std mutex: held only for bookkeeping, never across an await.
    state: Mutex<SimState>,
}

impl SimExecutor {
    pub fn new(name: &str) -> Self {
        SimExecutor {
            name: name.to_string(),
            state: Mutex::new(SimState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SimState> {
        // Nothing panics while holding the lock; recover the state if something did.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes call number `on_call` (1-based, counted from now on) of `action` fail.
    pub fn fail_call(&self, action: &str, on_call: u32) {
        let mut s = self.lock();
        let done = s.calls.get(action).copied().unwrap_or(0);
        s.faults.push(Fault {
            action: action.to_string(),
            on_call: done + on_call,
        });
    }

    /// Makes the next `times` compensation requests fail.
    pub fn fail_compensations(&self, times: u32) {
        self.lock().compensation_failures_left = times;
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// What a resource is held for (the action or node that made it), if it is held.
    pub fn held_by(&self, resource: &str) -> Option<String> {
        self.lock().resources.get(resource).cloned()
    }

    pub fn resources(&self) -> Vec<String> {
        self.lock().resources.keys().cloned().collect()
    }

    pub fn has(&self, resource: &str) -> bool {
        self.lock().resources.contains_key(resource)
    }

    /// How many times compensation `id` took effect here.
    pub fn applied(&self, id: Uuid) -> u32 {
        self.lock().applied.get(&id).copied().unwrap_or(0)
    }

    pub fn applied_total(&self) -> u32 {
        self.lock().applied.values().sum()
    }

    /// How many requests for compensation `id` arrived here, duplicates and failures
    /// included.
    pub fn requests(&self, id: Uuid) -> u32 {
        self.lock().requests.get(&id).copied().unwrap_or(0)
    }

    fn call(&self, action: &str, resource: &str) -> Result<(), String> {
        let mut s = self.lock();
        let n = {
            let n = s.calls.entry(action.to_string()).or_insert(0);
            *n += 1;
            *n
        };
        if s.faults
            .iter()
            .any(|f| f.action == action && f.on_call == n)
        {
            return Err(format!(
                "{}: {action} {resource} failed (injected fault, call {n})",
                self.name
            ));
        }
        match action {
            // Removals take the resource away; anything else creates it or records its
            // latest state (decommissioned, configured, started).
            "terminate_vm" | "unregister" | "release" => {
                s.resources.remove(resource);
            }
            _ => {
                s.resources.insert(resource.to_string(), action.to_string());
            }
        }
        Ok(())
    }

    fn take_ip(&self, node: &str) -> Result<String, String> {
        self.call("acquire_ip", node)?;
        let mut s = self.lock();
        s.resources.remove(node); // `call` recorded the node; the IP is the resource
        for _ in 0..IP_POOL_MAX {
            s.next_ip = (s.next_ip + 1) % IP_POOL_MAX;
            let ip = format!("10.0.{}.{}", s.next_ip / 250, s.next_ip % 250 + 1);
            if !s.resources.contains_key(&ip) {
                s.resources.insert(ip.clone(), node.to_string());
                return Ok(ip);
            }
        }
        Err(format!("{}: pool exhausted", self.name))
    }

    fn compensate_now(&self, request: &CompensationRequest) -> Result<(), String> {
        let mut s = self.lock();
        *s.requests.entry(request.compensation_id).or_insert(0) += 1;
        if s.applied.contains_key(&request.compensation_id) {
            return Ok(()); // already carried out: a retry or a racing driver
        }
        if s.compensation_failures_left > 0 {
            s.compensation_failures_left -= 1;
            return Err(format!(
                "{}: {:?} {} failed (injected fault)",
                self.name, request.action, request.resource
            ));
        }
        // Gone already (removed by hand, or by an earlier removal) counts as done.
        s.resources.remove(&request.resource);
        *s.applied.entry(request.compensation_id).or_insert(0) += 1;
        Ok(())
    }
}

/// The five simulated executors together.
pub struct SimInfrastructure {
    pub ipam: SimExecutor,
    pub dhcp: SimExecutor,
    pub dns: SimExecutor,
    pub hypervisor: SimExecutor,
    pub plugin: SimExecutor,
}

impl Default for SimInfrastructure {
    fn default() -> Self {
        SimInfrastructure {
            ipam: SimExecutor::new(IPAM),
            dhcp: SimExecutor::new(DHCP),
            dns: SimExecutor::new(DNS),
            hypervisor: SimExecutor::new(HYPERVISOR),
            plugin: SimExecutor::new(PLUGIN),
        }
    }
}

impl SimInfrastructure {
    pub fn executor(&self, name: &str) -> Option<&SimExecutor> {
        match name {
            IPAM => Some(&self.ipam),
            DHCP => Some(&self.dhcp),
            DNS => Some(&self.dns),
            HYPERVISOR => Some(&self.hypervisor),
            PLUGIN => Some(&self.plugin),
            _ => None,
        }
    }

    fn named(&self, name: &str) -> Result<&SimExecutor, String> {
        self.executor(name)
            .ok_or_else(|| format!("no executor named {name:?}"))
    }

    pub fn all(&self) -> [&SimExecutor; 5] {
        [
            &self.ipam,
            &self.dhcp,
            &self.dns,
            &self.hypervisor,
            &self.plugin,
        ]
    }

    /// Every resource held, by executor: what a test compares after a rollback.
    pub fn inventory(&self) -> BTreeMap<String, Vec<String>> {
        self.all()
            .iter()
            .map(|e| (e.name.clone(), e.resources()))
            .filter(|(_, r)| !r.is_empty())
            .collect()
    }

    pub fn applied_total(&self) -> u32 {
        self.all().iter().map(|e| e.applied_total()).sum()
    }

    /// Everything any executor still holds for `node`: its VM, its plugin record, its DHCP
    /// and DNS entries (named after the node) and its IP (held for the node's name).
    pub fn held_for(&self, node: &Uuid) -> Vec<String> {
        let node = node.to_string();
        let mut held = Vec::new();
        for e in self.all() {
            let s = e.lock();
            for (resource, by) in &s.resources {
                if resource.contains(&node) || by.contains(&node) {
                    held.push(format!("{}: {resource}", e.name));
                }
            }
        }
        held
    }

    /// Answers `<prefix>.exec.<name>.compensate` requests for the five executors until the
    /// subscription ends.
    pub async fn serve_on_nats(
        self: Arc<Self>,
        client: async_nats::Client,
        subject_prefix: &str,
    ) -> Result<tokio::task::JoinHandle<()>, async_nats::SubscribeError> {
        let wildcard = NatsExecutors::subject(subject_prefix, "*");
        let mut sub = client
            .queue_subscribe(wildcard, "provledger-sim-executors".to_string())
            .await?;
        let prefix_tokens = subject_prefix.split('.').count();
        Ok(tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let name = msg
                    .subject
                    .split('.')
                    .nth(prefix_tokens + 1)
                    .unwrap_or_default()
                    .to_string();
                let reply = match serde_json::from_slice::<CompensationRequest>(&msg.payload) {
                    Ok(request) => match self.compensate(&name, &request).await {
                        Ok(()) => CompensationReply {
                            ok: true,
                            error: None,
                        },
                        Err(e) => CompensationReply {
                            ok: false,
                            error: Some(e),
                        },
                    },
                    Err(e) => CompensationReply {
                        ok: false,
                        error: Some(format!("bad request: {e}")),
                    },
                };
                if let (Some(to), Ok(body)) = (msg.reply, serde_json::to_vec(&reply)) {
                    let _ = client.publish(to, body.into()).await;
                }
            }
        }))
    }
}

impl CompensationExecutor for SimInfrastructure {
    fn compensate<'a>(
        &'a self,
        executor: &'a str,
        request: &'a CompensationRequest,
    ) -> CompensationFuture<'a> {
        Box::pin(async move { self.named(executor)?.compensate_now(request) })
    }
}

impl Infrastructure for SimInfrastructure {
    fn act<'a>(
        &'a self,
        executor: &'a str,
        action: &'a str,
        resource: &'a str,
    ) -> CompensationFuture<'a> {
        Box::pin(async move { self.named(executor)?.call(action, resource) })
    }

    fn acquire_ip<'a>(&'a self, node: &'a str) -> ActionFuture<'a, String> {
        Box::pin(async move { self.ipam.take_ip(node) })
    }
}
