//! Simulated executors for the demo and the tests: IPAM, DHCP, DNS, a hypervisor and a
//! cluster plugin. Each really keeps its resources (in memory), carries out compensations
//! idempotently by `compensation_id`, counts how often each compensation took effect (a
//! test asserts "once"), and can be told to fail a chosen call of a chosen action, or its
//! next compensations. `serve_on_nats` answers compensation requests over NATS the way a
//! real owning service would, and their inventory (`docs/drift.md`) page by page.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use provledger_client::inventory::{inventory_subject, InventoryPage, InventoryRequest};
use provledger_client::{
    ActionFuture, CompensationExecutor, CompensationFuture, CompensationReply, CompensationRequest,
    Infrastructure, NatsExecutors, PeerError,
};
use provledger_events::catalogue::{CompensationAction, DetailKey};
use provledger_projections::drift::InventoryItem;
use provledger_projections::planner::{NODE_DETAIL, REMOVE_NODE_ACTION};
use uuid::Uuid;

pub const IPAM: &str = "ipam";
pub const DHCP: &str = "dhcp";
pub const DNS: &str = "dns";
pub const HYPERVISOR: &str = "hypervisor";
pub const PLUGIN: &str = "plugin";
/// IPs in the simulated pool (10.0.x.y).
const IP_POOL_MAX: u32 = 65_000;
/// The queue group the simulated executors answer in.
const QUEUE_GROUP: &str = "provledger-sim-executors";
/// The length of a UUID's text form.
const UUID_TEXT_LEN: usize = 36;

/// The first UUID written in `text` (`node-<uuid>.example`), if any.
fn uuid_in(text: &str) -> Option<Uuid> {
    (0..text.len().saturating_sub(UUID_TEXT_LEN - 1)).find_map(|i| {
        text.get(i..i + UUID_TEXT_LEN)
            .and_then(|s| Uuid::parse_str(s).ok())
    })
}

#[derive(Debug, Clone)]
struct Fault {
    action: String,
    /// The 1-based call of `action` that fails.
    on_call: u32,
}

impl Fault {
    fn hits(&self, action: &str, call: u32) -> bool {
        self.action == action && self.on_call == call
    }
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
    /// The idempotency key each held resource was made under (a step's `StepStarted`).
    key_of: BTreeMap<String, String>,
    /// What each key's action returned, so that a repeated request answers the same.
    made_under: BTreeMap<String, String>,
    /// Compensations by key that found nothing done under their key.
    nothing_to_undo: u32,
    /// Calls after which the runner "dies": the action takes effect, and its answer never
    /// comes back (the caller's future stays pending, and the harness drops it).
    crashes: Vec<Fault>,
    /// Injected crashes that happened.
    crashed: u32,
    /// Keys a compensation undid (or found nothing under): an action asked under one of
    /// them later (a runner presumed dead, acting late) is refused, so nothing can appear
    /// after its rollback.
    fenced: std::collections::BTreeSet<String>,
    /// How many requests arrived for each compensation, counted before deduplication, so
    /// that a driver sending one twice is seen even though it takes effect once.
    requests: BTreeMap<Uuid, u32>,
    next_ip: u32,
}

impl SimState {
    /// Call number `on_call` of `action`, counted from the calls made so far.
    fn call_from_now(&self, action: &str, on_call: u32) -> Fault {
        let done = self.calls.get(action).copied().unwrap_or(0);
        Fault {
            action: action.to_string(),
            on_call: done + on_call,
        }
    }
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
        let fault = s.call_from_now(action, on_call);
        s.faults.push(fault);
    }

    /// Makes call number `on_call` (1-based, counted from now on) of `action` take effect
    /// and never answer: the runner's process dies between the executor's action and its
    /// record.
    pub fn crash_after_call(&self, action: &str, on_call: u32) {
        let mut s = self.lock();
        let crash = s.call_from_now(action, on_call);
        s.crashes.push(crash);
    }

    /// Forgets the crashes planned and not yet happened (the operation they were meant
    /// for ended before reaching them).
    pub fn clear_crashes(&self) {
        self.lock().crashes.clear();
    }

    /// Every held resource with the idempotency key it was made under, if any.
    pub fn held_with_keys(&self) -> Vec<(String, Option<String>)> {
        let s = self.lock();
        s.resources
            .keys()
            .map(|r| (r.clone(), s.key_of.get(r).cloned()))
            .collect()
    }

    /// Compensations by key that found nothing done under their key.
    pub fn nothing_to_undo(&self) -> u32 {
        self.lock().nothing_to_undo
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

    /// The inventory protocol's word for what this executor holds.
    fn item_kind(&self) -> &'static str {
        match self.name.as_str() {
            IPAM => "ip",
            DHCP => "dhcp_entry",
            DNS => "dns_record",
            HYPERVISOR => "vm",
            PLUGIN => "node",
            _ => "resource",
        }
    }

    /// The compensation action that removes what this executor holds (the inventory's
    /// `undo`, what `drift --fix leaked` asks for): the same actions its compensations
    /// take.
    fn undo_action(&self) -> Option<CompensationAction> {
        Some(match self.name.as_str() {
            IPAM => CompensationAction::ReleaseIp,
            DHCP => CompensationAction::UnregisterDhcp,
            DNS => CompensationAction::UnregisterDns,
            HYPERVISOR => CompensationAction::TerminateVm,
            PLUGIN => CompensationAction::Custom(REMOVE_NODE_ACTION.into()),
            _ => return None,
        })
    }

    /// One page of the inventory: the resources after `request.after`, in order, with the
    /// key each was made under and the node it belongs to (named in the resource, or, for
    /// an IP, in what it is held for).
    pub fn inventory_page(&self, request: &InventoryRequest) -> InventoryPage {
        use std::ops::Bound;
        let s = self.lock();
        let from = match &request.after {
            Some(after) => Bound::Excluded(after.clone()),
            None => Bound::Unbounded,
        };
        let limit = request.page_items();
        let mut items: Vec<InventoryItem> = s
            .resources
            .range((from, Bound::Unbounded))
            .take(limit + 1)
            .map(|(resource, by)| {
                let entity = uuid_in(resource).or_else(|| uuid_in(by));
                let mut attrs = BTreeMap::new();
                if self.name == IPAM {
                    if let Some(node) = entity {
                        attrs.insert(NODE_DETAIL.to_string(), node.to_string());
                    }
                }
                InventoryItem {
                    kind: self.item_kind().to_string(),
                    resource: resource.clone(),
                    key: s.key_of.get(resource).cloned(),
                    entity: entity.map(|e| e.to_string()),
                    attrs,
                    undo: self.undo_action(),
                }
            })
            .collect();
        // One item past the page says whether there is a next one.
        let next = (items.len() > limit)
            .then(|| {
                items.truncate(limit);
                items.last().map(|i| i.resource.clone())
            })
            .flatten();
        InventoryPage { items, next }
    }

    /// Everything it holds, as its inventory answers it, page after page.
    pub fn held_items(&self) -> Vec<InventoryItem> {
        let mut items = Vec::new();
        let mut request = InventoryRequest {
            after: None,
            limit: Some(provledger_client::inventory::INVENTORY_PAGE_ITEMS_MAX),
        };
        loop {
            let page = self.inventory_page(&request);
            items.extend(page.items);
            match page.next {
                Some(next) => request.after = Some(next),
                None => return items,
            }
        }
    }

    /// A resource made by hand, behind the ledger's back: held for `held_for`, under no
    /// key.
    pub fn create_by_hand(&self, resource: &str, held_for: &str) {
        let mut s = self.lock();
        s.resources
            .insert(resource.to_string(), held_for.to_string());
        s.key_of.remove(resource);
    }

    /// A held resource filed again by hand under another idempotency key (an operator
    /// re-importing records, a migration between IPAMs); `false` if it was not held.
    pub fn rekey_by_hand(&self, resource: &str, key: &str) -> bool {
        let mut s = self.lock();
        if !s.resources.contains_key(resource) {
            return false;
        }
        s.key_of.insert(resource.to_string(), key.to_string());
        true
    }

    /// A resource removed by hand; `true` if it was held.
    pub fn remove_by_hand(&self, resource: &str) -> bool {
        let mut s = self.lock();
        s.key_of.remove(resource);
        s.resources.remove(resource).is_some()
    }

    /// A resource renamed by hand (an IP changed in IPAM): the new name keeps what it is
    /// held for and the key it was made under. `false` if `from` was not held.
    pub fn rename_by_hand(&self, from: &str, to: &str) -> bool {
        let mut s = self.lock();
        let Some(by) = s.resources.remove(from) else {
            return false;
        };
        s.resources.insert(to.to_string(), by);
        if let Some(key) = s.key_of.remove(from) {
            s.key_of.insert(to.to_string(), key);
        }
        true
    }

    /// Carries out `action` on `resource` under `key`. `Ok(true)`: the runner dies now
    /// (an injected crash after the action took effect).
    fn call(&self, action: &str, resource: &str, key: &str) -> Result<bool, String> {
        let mut s = self.lock();
        if s.fenced.contains(key) {
            return Err(format!(
                "{}: {action} {resource} refused: its idempotency key {key} was undone",
                self.name
            ));
        }
        if !key.is_empty() && s.made_under.contains_key(key) {
            return Ok(false); // a repeated request under the same key: done once
        }
        let n = {
            let n = s.calls.entry(action.to_string()).or_insert(0);
            *n += 1;
            *n
        };
        if s.faults.iter().any(|f| f.hits(action, n)) {
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
                s.key_of.remove(resource);
            }
            // A state change (the plugin starting or decommissioning a node) of a resource
            // the executor does not hold changes nothing: it creates no record.
            "start" | "decommission" if !s.resources.contains_key(resource) => {}
            _ => {
                let created = s
                    .resources
                    .insert(resource.to_string(), action.to_string())
                    .is_none();
                if !key.is_empty() {
                    // A resource belongs to the key that created it; a later action on it
                    // (start, decommission) changes its state, not its owner.
                    if created {
                        s.key_of.insert(resource.to_string(), key.to_string());
                    }
                    s.made_under.insert(key.to_string(), resource.to_string());
                }
            }
        }
        let crash = s.crashes.iter().any(|f| f.hits(action, n));
        if crash {
            s.crashed += 1;
        }
        Ok(crash)
    }

    /// How many injected crashes after an action happened here.
    pub fn crashed(&self) -> u32 {
        self.lock().crashed
    }

    /// Takes a free IP for `node` under `key` (the same IP again for a repeated key).
    /// The second value: the runner dies now.
    fn take_ip(&self, node: &str, key: &str) -> Result<(String, bool), String> {
        {
            let s = self.lock();
            if s.fenced.contains(key) {
                return Err(format!(
                    "{}: acquire_ip {node} refused: its idempotency key {key} was undone",
                    self.name
                ));
            }
            if let Some(ip) = s.made_under.get(key) {
                return Ok((ip.clone(), false));
            }
        }
        // `call` counts the call and applies faults; the node is not the resource.
        let crash = self.call("acquire_ip", node, "")?;
        let mut s = self.lock();
        s.resources.remove(node);
        for _ in 0..IP_POOL_MAX {
            s.next_ip = (s.next_ip + 1) % IP_POOL_MAX;
            let ip = format!("10.0.{}.{}", s.next_ip / 250, s.next_ip % 250 + 1);
            if !s.resources.contains_key(&ip) {
                s.resources.insert(ip.clone(), node.to_string());
                if !key.is_empty() {
                    s.key_of.insert(ip.clone(), key.to_string());
                    s.made_under.insert(key.to_string(), ip.clone());
                }
                return Ok((ip, crash));
            }
        }
        Err(format!("{}: pool exhausted", self.name))
    }

    /// `Ok(false)`: asked to undo by key something never done under it (nothing to undo).
    fn compensate_now(&self, request: &CompensationRequest) -> Result<bool, String> {
        let mut s = self.lock();
        *s.requests.entry(request.compensation_id).or_insert(0) += 1;
        if s.applied.contains_key(&request.compensation_id) {
            return Ok(true); // already carried out: a retry or a racing driver
        }
        if s.compensation_failures_left > 0 {
            s.compensation_failures_left -= 1;
            return Err(format!(
                "{}: {:?} {} failed (injected fault)",
                self.name, request.action, request.resource
            ));
        }
        let key = request.args.get(DetailKey::IdempotencyKey.as_str());
        let mut undone = false;
        if let Some(key) = key {
            s.fenced.insert(key.clone());
            // By key: whatever is still held under it (the resource may have been
            // handed to another key since, e.g. a reused IP: that one is not touched).
            let under_key: Vec<String> = s
                .key_of
                .iter()
                .filter(|(_, k)| *k == key)
                .map(|(r, _)| r.clone())
                .collect();
            for r in under_key {
                s.resources.remove(&r);
                s.key_of.remove(&r);
                undone = true;
            }
        }
        if !request.resource.is_empty() {
            // Gone already (removed by hand, or by an earlier removal) counts as done.
            let held_by_other_key = key.is_some_and(|k| {
                s.key_of
                    .get(&request.resource)
                    .is_some_and(|other| other != k)
            });
            if !held_by_other_key && s.resources.remove(&request.resource).is_some() {
                s.key_of.remove(&request.resource);
                undone = true;
            }
        }
        *s.applied.entry(request.compensation_id).or_insert(0) += 1;
        let nothing = key.is_some() && !undone;
        if nothing {
            s.nothing_to_undo += 1;
        }
        Ok(!nothing)
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

    /// The reply to a compensation request for executor `name`.
    fn compensation_reply(&self, name: &str, payload: &[u8]) -> CompensationReply {
        match serde_json::from_slice::<CompensationRequest>(payload) {
            Ok(request) => match self.named(name).and_then(|e| e.compensate_now(&request)) {
                Ok(true) => CompensationReply::done(),
                Ok(false) => CompensationReply::nothing_to_undo(),
                Err(e) => CompensationReply::failed(e),
            },
            Err(e) => CompensationReply::failed(format!("bad request: {e}")),
        }
    }

    /// The reply to an inventory request for executor `name`: a page, or `{"error"}`.
    fn inventory_reply(&self, name: &str, payload: &[u8]) -> serde_json::Value {
        let page = serde_json::from_slice::<InventoryRequest>(payload)
            .map_err(|e| format!("bad request: {e}"))
            .and_then(|request| Ok(self.named(name)?.inventory_page(&request)));
        match page.map(|p| serde_json::to_value(&p)) {
            Ok(Ok(page)) => page,
            Ok(Err(e)) => serde_json::json!({ "error": e.to_string() }),
            Err(e) => serde_json::json!({ "error": e }),
        }
    }

    /// Answers `<prefix>.exec.<name>.compensate` and `<prefix>.exec.<name>.inventory`
    /// requests for the five executors until the subscriptions end.
    pub async fn serve_on_nats(
        self: Arc<Self>,
        client: async_nats::Client,
        subject_prefix: &str,
    ) -> Result<tokio::task::JoinHandle<()>, async_nats::SubscribeError> {
        let compensate = client
            .queue_subscribe(
                NatsExecutors::subject(subject_prefix, "*"),
                QUEUE_GROUP.to_string(),
            )
            .await?;
        let inventory = client
            .queue_subscribe(
                inventory_subject(subject_prefix, "*"),
                QUEUE_GROUP.to_string(),
            )
            .await?;
        let prefix_tokens = subject_prefix.split('.').count();
        Ok(tokio::spawn(async move {
            let this = self.clone();
            let compensations = answer(compensate, client.clone(), prefix_tokens, move |n, p| {
                serde_json::to_vec(&this.compensation_reply(n, p))
            });
            let inventories = answer(inventory, client, prefix_tokens, move |n, p| {
                serde_json::to_vec(&self.inventory_reply(n, p))
            });
            tokio::join!(compensations, inventories);
        }))
    }
}

/// Answers each request on `sub` with `reply(executor name, payload)` until it ends.
async fn answer(
    mut sub: async_nats::Subscriber,
    client: async_nats::Client,
    prefix_tokens: usize,
    reply: impl Fn(&str, &[u8]) -> serde_json::Result<Vec<u8>>,
) {
    while let Some(msg) = sub.next().await {
        let name = msg
            .subject
            .split('.')
            .nth(prefix_tokens + 1)
            .unwrap_or_default()
            .to_string();
        if let (Some(to), Ok(body)) = (msg.reply, reply(&name, &msg.payload)) {
            let _ = client.publish(to, body.into()).await;
        }
    }
}

impl CompensationExecutor for SimInfrastructure {
    fn compensate<'a>(
        &'a self,
        executor: &'a str,
        request: &'a CompensationRequest,
    ) -> CompensationFuture<'a> {
        Box::pin(async move {
            self.named(executor)
                .map_err(PeerError::Unreachable)?
                .compensate_now(request)
                .map(|_| ())
                .map_err(PeerError::Refused)
        })
    }
}

impl Infrastructure for SimInfrastructure {
    fn act<'a>(
        &'a self,
        executor: &'a str,
        action: &'a str,
        resource: &'a str,
        idempotency_key: &'a str,
    ) -> CompensationFuture<'a> {
        Box::pin(async move {
            if self
                .named(executor)
                .map_err(PeerError::Unreachable)?
                .call(action, resource, idempotency_key)
                .map_err(PeerError::Refused)?
            {
                // The runner's process died after the action: no answer ever comes.
                std::future::pending::<()>().await;
            }
            Ok(())
        })
    }

    fn acquire_ip<'a>(
        &'a self,
        node: &'a str,
        idempotency_key: &'a str,
    ) -> ActionFuture<'a, String> {
        Box::pin(async move {
            let (ip, crash) = self
                .ipam
                .take_ip(node, idempotency_key)
                .map_err(PeerError::Refused)?;
            if crash {
                std::future::pending::<()>().await;
            }
            Ok(ip)
        })
    }
}
