//! The inventory protocol (`docs/drift.md`): an executor answers, a page at a time, the
//! resources it holds, on `<prefix>.exec.<name>.inventory`. [`read_inventory`] reads every
//! page of one executor, bounded in page size and page count; a reply that does not follow
//! the protocol is a typed [`InventoryError`] naming the executor, never a panic.
//! [`discover_executors`] finds the executors that receive inventory requests without the
//! ledger naming them, from the account's connection list, within named bounds; a name
//! outside the executor grammar is reported, never asked.

use std::time::Duration;

use std::collections::BTreeSet;

use futures::StreamExt;
use provledger_events::{EventLog, ReadError};
use provledger_projections::drift::{
    Comparison, DriftFold, Finding, Folded, InventoryItem, LedgerResources,
};
use serde::{Deserialize, Serialize};

/// The most items an executor may answer in one page (and the most a request asks for).
pub const INVENTORY_PAGE_ITEMS_MAX: u32 = 1_000;
/// What a request asks for when it does not say.
pub const INVENTORY_PAGE_ITEMS_DEFAULT: u32 = 500;
/// The most pages one executor's inventory is read in: 10 million items at the largest
/// page, so that an executor whose cursor never ends cannot keep a reader forever.
pub const INVENTORY_PAGES_MAX: u32 = 10_000;

const _: () = assert!(INVENTORY_PAGE_ITEMS_DEFAULT <= INVENTORY_PAGE_ITEMS_MAX);

/// The request: the page after the resource `after` (from the start without it), of at
/// most `limit` items.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct InventoryRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

impl InventoryRequest {
    /// The page size an executor answers: `limit` within 1..=`INVENTORY_PAGE_ITEMS_MAX`.
    pub fn page_items(&self) -> usize {
        self.limit
            .unwrap_or(INVENTORY_PAGE_ITEMS_DEFAULT)
            .clamp(1, INVENTORY_PAGE_ITEMS_MAX) as usize
    }
}

/// One page: items in the order of their `resource` (bytewise), and the cursor of the
/// next page (`null` on the last one).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct InventoryPage {
    pub items: Vec<InventoryItem>,
    pub next: Option<String>,
}

/// Every form a reply may take: a page, or `{"error": "..."}`.
#[derive(Debug, Deserialize)]
struct RawReply {
    items: Option<Vec<InventoryItem>>,
    #[serde(default)]
    next: Option<String>,
    error: Option<String>,
}

/// Why one executor's inventory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// One executor's whole inventory took longer than the bound: each page came within
    /// the reply wait, but an executor that answers slowly for ever must not hold drift
    /// (or serve's sweep) for hours.
    #[error("executor {executor:?} did not finish its inventory within {bound:?} (INVENTORY_READ_MAX); it is reported unread")]
    TooSlow { executor: String, bound: Duration },
    /// A name outside the executor grammar (written before names had one, or forged): it
    /// is never turned into a subject, where a `.`, `*` or `>` would ask someone else.
    #[error(
        "{executor:?} is not an executor name (1 to {max} ASCII letters, digits, '_' or '-'); it was not asked",
        max = provledger_events::catalogue::operation::EXECUTOR_NAME_BYTES_MAX
    )]
    BadName { executor: String },
    #[error(
        "executor {executor:?} does not answer {subject} (no responders): is it running, on \
         this NATS server, and does it implement the inventory protocol (docs/drift.md)?"
    )]
    NoResponders { executor: String, subject: String },
    #[error("executor {executor:?} did not answer {subject} within {wait:?}; retry, or check it")]
    Timeout {
        executor: String,
        subject: String,
        wait: Duration,
    },
    #[error("the inventory request to executor {executor:?} on {subject} failed: {reason}")]
    Request {
        executor: String,
        subject: String,
        reason: String,
    },
    #[error(
        "executor {executor:?} answered {subject} with something other than an inventory \
         page: {reason} (docs/drift.md gives the form)"
    )]
    Malformed {
        executor: String,
        subject: String,
        reason: String,
    },
    #[error("executor {executor:?} refused the inventory request: {error}")]
    Refused { executor: String, error: String },
    #[error(
        "executor {executor:?} answered a page of {items} items, more than the {asked} asked \
         for; it must answer at most `limit` items"
    )]
    PageTooLarge {
        executor: String,
        items: usize,
        asked: usize,
    },
    #[error(
        "executor {executor:?} answered next = {next:?} after {after:?}: a cursor must move \
         forward; its inventory cannot be read to the end"
    )]
    CursorStuck {
        executor: String,
        after: Option<String>,
        next: String,
    },
    #[error(
        "executor {executor:?} still had pages after {pages} (INVENTORY_PAGES_MAX); its \
         inventory is not read whole"
    )]
    TooManyPages { executor: String, pages: u32 },
}

impl InventoryError {
    /// The executor could not be reached or did not answer (rather than answering wrong).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            InventoryError::NoResponders { .. }
                | InventoryError::Timeout { .. }
                | InventoryError::TooSlow { .. }
                | InventoryError::Request { .. }
        )
    }
}

/// `<prefix>.exec.<executor>.inventory`.
pub fn inventory_subject(subject_prefix: &str, executor: &str) -> String {
    format!("{subject_prefix}.exec.{executor}.inventory")
}

/// Turns one reply's bytes into a page, checking what the protocol promises.
pub fn parse_inventory_reply(
    executor: &str,
    subject: &str,
    request: &InventoryRequest,
    payload: &[u8],
) -> Result<InventoryPage, InventoryError> {
    let malformed = |reason: String| InventoryError::Malformed {
        executor: executor.to_string(),
        subject: subject.to_string(),
        reason,
    };
    let raw: RawReply = serde_json::from_slice(payload).map_err(|e| malformed(e.to_string()))?;
    if let Some(error) = raw.error {
        return Err(InventoryError::Refused {
            executor: executor.to_string(),
            error,
        });
    }
    let items = raw
        .items
        .ok_or_else(|| malformed("no `items` and no `error`".into()))?;
    if items.len() > request.page_items() {
        return Err(InventoryError::PageTooLarge {
            executor: executor.to_string(),
            items: items.len(),
            asked: request.page_items(),
        });
    }
    if let Some(next) = &raw.next {
        if request.after.as_ref().is_some_and(|after| next <= after) {
            return Err(InventoryError::CursorStuck {
                executor: executor.to_string(),
                after: request.after.clone(),
                next: next.clone(),
            });
        }
    }
    Ok(InventoryPage {
        items,
        next: raw.next,
    })
}

/// Reads `executor`'s whole inventory, page by page; `on_page` hears how many items each
/// page brought (a progress bar). Holds the whole inventory: [`read_inventory_pages`]
/// hands each page over instead.
pub async fn read_inventory(
    client: &async_nats::Client,
    subject_prefix: &str,
    executor: &str,
    reply_wait: Duration,
    mut on_page: impl FnMut(usize),
) -> Result<Vec<InventoryItem>, InventoryError> {
    let mut items = Vec::new();
    read_inventory_pages(client, subject_prefix, executor, reply_wait, |page| {
        on_page(page.len());
        items.extend(page);
    })
    .await?;
    Ok(items)
}

/// Reads `executor`'s whole inventory, handing each page to `on_page` as it comes, so that
/// a reader holds one page at a time. Returns how many items there were.
pub async fn read_inventory_pages(
    client: &async_nats::Client,
    subject_prefix: &str,
    executor: &str,
    reply_wait: Duration,
    mut on_page: impl FnMut(Vec<InventoryItem>),
) -> Result<u64, InventoryError> {
    if !provledger_events::catalogue::operation::executor_name_is_valid(executor) {
        return Err(InventoryError::BadName {
            executor: executor
                .chars()
                .take(provledger_events::catalogue::operation::EXECUTOR_NAME_BYTES_MAX)
                .collect(),
        });
    }
    let subject = inventory_subject(subject_prefix, executor);
    let mut count = 0;
    let mut request = InventoryRequest {
        after: None,
        limit: Some(INVENTORY_PAGE_ITEMS_MAX),
    };
    for _ in 0..INVENTORY_PAGES_MAX {
        let page = request_page(client, executor, &subject, &request, reply_wait).await?;
        count += page.items.len() as u64;
        on_page(page.items);
        match page.next {
            Some(next) => request.after = Some(next),
            None => return Ok(count),
        }
    }
    Err(InventoryError::TooManyPages {
        executor: executor.to_string(),
        pages: INVENTORY_PAGES_MAX,
    })
}

/// The longest one executor's whole inventory may take to read.
pub const INVENTORY_READ_MAX: Duration = Duration::from_secs(300);
/// At most this many items behind one executor's `leaked` and `mismatched` findings are
/// kept to confirm them (and listed); past it they are counted, not held.
pub const SUSPECTS_KEPT_MAX: usize = 10_000;
/// ... and at most this many bytes of them.
pub const SUSPECT_BYTES_MAX: usize = 16 << 20;
/// How many executors drift (and serve's sweep) reads at once.
pub const EXECUTORS_READ_AT_ONCE: usize = 4;

/// What bounds one executor's read.
#[derive(Debug, Clone, Copy)]
pub struct ReadBounds {
    /// For one page to come back.
    pub reply_wait: Duration,
    /// For the whole inventory ([`INVENTORY_READ_MAX`]).
    pub whole: Duration,
}

/// One executor's inventory as compared: how many items it held (or why it could not be
/// read), and the items behind its `leaked` and `mismatched` findings, kept to confirm
/// them against a later ledger (at most [`SUSPECTS_KEPT_MAX`] items and
/// [`SUSPECT_BYTES_MAX`] bytes; those past it are counted in `suspects_not_kept`). The
/// rest of the inventory is never held: it is compared a page at a time.
pub struct Asked {
    pub executor: String,
    pub held: Result<u64, InventoryError>,
    pub suspects: Vec<InventoryItem>,
    /// Items behind findings that were past the bounds: not listed, not confirmed.
    pub suspects_not_kept: u64,
    /// The `missing` findings against the ledger as read before asking (those of the
    /// suspects are found again from the items by [`confirmed`]).
    pub missing: Vec<Finding>,
}

/// Asks `executor` for its inventory and compares each page as it comes with `ledger`
/// (`provledger drift`, serve's sweep); `on_page` hears how many items each page brought.
pub async fn compare_inventory(
    client: &async_nats::Client,
    subject_prefix: &str,
    executor: &str,
    bounds: ReadBounds,
    ledger: &LedgerResources,
    mut on_page: impl FnMut(usize),
) -> Asked {
    let mut comparison = Comparison::new(ledger, executor);
    let mut suspects = Vec::new();
    let mut kept_bytes = 0;
    let mut not_kept = 0u64;
    let read = read_inventory_pages(
        client,
        subject_prefix,
        executor,
        bounds.reply_wait,
        |page| {
            on_page(page.len());
            let found = comparison.items(&page);
            if !found.is_empty() {
                let named: BTreeSet<&str> = found.iter().map(|f| f.resource.as_str()).collect();
                for item in page
                    .into_iter()
                    .filter(|i| named.contains(i.resource.as_str()))
                {
                    let size = item_bytes(&item);
                    if suspects.len() < SUSPECTS_KEPT_MAX && kept_bytes + size <= SUSPECT_BYTES_MAX
                    {
                        kept_bytes += size;
                        suspects.push(item);
                    } else {
                        not_kept += 1;
                    }
                }
            }
        },
    );
    let held = match tokio::time::timeout(bounds.whole, read).await {
        Ok(held) => held,
        Err(_) => Err(InventoryError::TooSlow {
            executor: executor.to_string(),
            bound: bounds.whole,
        }),
    };
    let missing = match &held {
        Ok(_) => comparison.finish(),
        Err(_) => Vec::new(),
    };
    Asked {
        executor: executor.to_string(),
        held,
        suspects,
        suspects_not_kept: not_kept,
        missing,
    }
}

/// About what an item costs to keep: its strings and a fixed overhead.
fn item_bytes(item: &InventoryItem) -> usize {
    const OVERHEAD: usize = 128;
    OVERHEAD
        + item.kind.len()
        + item.resource.len()
        + item.key.as_ref().map_or(0, String::len)
        + item.entity.as_ref().map_or(0, String::len)
        + item
            .attrs
            .iter()
            .map(|(k, v)| k.len() + v.len() + 48)
            .sum::<usize>()
}

/// Reads every executor in `executors` (at most [`EXECUTORS_READ_AT_ONCE`] at once), each
/// within `bounds`, comparing with `ledger`; answers in the order given. `on_page` hears
/// which executor each page came from and how many items it brought.
pub async fn compare_inventories(
    client: &async_nats::Client,
    subject_prefix: &str,
    executors: &[String],
    bounds: ReadBounds,
    ledger: &LedgerResources,
    on_page: &(dyn Fn(&str, usize) + Sync),
) -> Vec<Asked> {
    use futures::StreamExt;
    let mut pending = futures::stream::FuturesOrdered::new();
    let mut waiting = executors.iter();
    let mut asked = Vec::with_capacity(executors.len());
    loop {
        // Keep EXECUTORS_READ_AT_ONCE in flight while any is waiting.
        while pending.len() < EXECUTORS_READ_AT_ONCE {
            let Some(executor) = waiting.next() else {
                break;
            };
            pending.push_back(read_one(
                client,
                subject_prefix,
                executor,
                bounds,
                ledger,
                on_page,
            ));
        }
        match pending.next().await {
            Some(one) => asked.push(one),
            None => break,
        }
    }
    asked
}

/// One executor of [`compare_inventories`]: one future type for all of them.
fn read_one<'a>(
    client: &'a async_nats::Client,
    subject_prefix: &'a str,
    executor: &'a str,
    bounds: ReadBounds,
    ledger: &'a LedgerResources,
    on_page: &'a (dyn Fn(&str, usize) + Sync),
) -> impl std::future::Future<Output = Asked> + Send + 'a {
    compare_inventory(client, subject_prefix, executor, bounds, ledger, move |n| {
        on_page(executor, n)
    })
}

/// The findings of `asked` that still stand against `ledger` (read after the
/// inventories): an item that now joins a record (an operation started on it while drift
/// asked) is no longer leaked; a resource removed or moving since is no longer missing.
pub fn confirmed(ledger: &LedgerResources, asked: &[Asked]) -> Vec<Finding> {
    let mut findings = Vec::new();
    for a in asked.iter().filter(|a| a.held.is_ok()) {
        let mut now = Comparison::new(ledger, &a.executor);
        findings.extend(now.items(&a.suspects));
        findings.extend(a.missing.iter().filter(|f| now.still_missing(f)).cloned());
    }
    findings.sort_by(|a, b| {
        (&a.executor, a.kind, &a.resource).cmp(&(&b.executor, b.kind, &b.resource))
    });
    findings
}

/// Discovery's request: the server's list of the account's connections and their
/// subscriptions (`$SYS.REQ.ACCOUNT.PING.CONNZ`, which nats-server answers in every account,
/// for that account only, one reply per server of a cluster). An executor is found by the
/// subscription it already holds to receive its inventory requests: discovery needs nothing
/// from executors (docs/drift.md, "Discovery").
pub const DISCOVERY_SUBJECT: &str = "$SYS.REQ.ACCOUNT.PING.CONNZ";
/// The longest the discovery round may take (replies read until then).
pub const DISCOVERY_WAIT: Duration = Duration::from_secs(2);
/// Once a reply came, the round ends when no other comes within this (the servers of a
/// cluster answer together).
pub const DISCOVERY_QUIET: Duration = Duration::from_millis(300);
/// The most replies read in one round (one per server; past it, the round ends).
pub const DISCOVERY_REPLIES_MAX: usize = 32;
/// A reply over this many bytes is not parsed (reported).
pub const DISCOVERY_REPLY_BYTES_MAX: usize = 8 << 20;
/// The most connections one server is asked to list (those with an inventory subscription).
pub const DISCOVERY_CONNECTIONS_MAX: u32 = 1_024;
/// The most executors discovery adds to those the ledger names; past it (in name order),
/// the others are counted, not asked.
pub const DISCOVERED_EXECUTORS_MAX: usize = 64;
/// The most names failing the executor grammar that are listed (truncated to
/// [`REJECTED_NAME_CHARS_MAX`] characters); the others are counted.
pub const DISCOVERY_REJECTED_LISTED_MAX: usize = 10;
/// How much of a rejected name is kept to report it.
pub const REJECTED_NAME_CHARS_MAX: usize = 80;

/// What one discovery round found.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Discovery {
    /// Executors answering the inventory subject that are not among those known (the
    /// ledger's), in name order, at most [`DISCOVERED_EXECUTORS_MAX`].
    pub discovered: BTreeSet<String>,
    /// Further such executors, past the bound: not asked.
    pub not_asked: u64,
    /// Names that subscribe to the inventory subject and fail the executor grammar: never
    /// turned into a subject, never asked (at most [`DISCOVERY_REJECTED_LISTED_MAX`] listed).
    pub rejected: Vec<String>,
    pub rejected_not_listed: u64,
    /// Subscriptions that receive every executor's inventory requests (`*` or `>` in the
    /// name's place, as the simulator's): they name no executor, so they are counted only.
    pub wildcard_subscriptions: u64,
    /// Replies (servers) read.
    pub servers: usize,
    /// Why the round may have missed executors (no reply, a reply not read, a server's
    /// list cut at [`DISCOVERY_CONNECTIONS_MAX`], executors past the bound); empty when it
    /// saw everything.
    pub incomplete: Vec<String>,
}

/// The part of a CONNZ reply discovery reads.
#[derive(Debug, Deserialize)]
struct ConnzReply {
    #[serde(default)]
    data: Option<ConnzData>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct ConnzData {
    #[serde(default)]
    connections: Vec<ConnzConnection>,
}

#[derive(Debug, Deserialize)]
struct ConnzConnection {
    #[serde(default)]
    subscriptions_list: Vec<String>,
}

/// What a subscription subject says about who answers `<prefix>.exec.<name>.inventory`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InventorySubscriber {
    /// It receives one executor's inventory requests, and the name follows the grammar.
    Executor(String),
    /// It receives one name's inventory requests, and the name fails the grammar.
    BadName(String),
    /// It receives any executor's (`*` or `>` in the name's place).
    Wildcard,
    /// It does not receive inventory requests.
    Other,
}

/// Reads one subscription subject: does it receive `<prefix>.exec.<name>.inventory`, and
/// for which name. Pure.
pub fn inventory_subscriber(subject_prefix: &str, subscription: &str) -> InventorySubscriber {
    let Some(rest) = subscription
        .strip_prefix(subject_prefix)
        .and_then(|r| r.strip_prefix(".exec."))
    else {
        return InventorySubscriber::Other;
    };
    if rest == ">" {
        return InventorySubscriber::Wildcard;
    }
    // The name is the token before the last one; the last must receive `inventory`.
    let Some((name, last)) = rest.rsplit_once('.') else {
        return InventorySubscriber::Other;
    };
    if name.contains('.') || !matches!(last, "inventory" | "*" | ">") {
        return InventorySubscriber::Other;
    }
    if name == "*" || name == ">" {
        return InventorySubscriber::Wildcard;
    }
    if provledger_events::catalogue::operation::executor_name_is_valid(name) {
        InventorySubscriber::Executor(name.to_string())
    } else {
        InventorySubscriber::BadName(name.chars().take(REJECTED_NAME_CHARS_MAX).collect())
    }
}

impl Discovery {
    /// Adds what one subscription says, keeping every bound.
    fn add(&mut self, subject_prefix: &str, known: &BTreeSet<String>, subscription: &str) {
        match inventory_subscriber(subject_prefix, subscription) {
            InventorySubscriber::Executor(name) => {
                if known.contains(&name) || self.discovered.contains(&name) {
                    return;
                }
                self.discovered.insert(name);
                if self.discovered.len() > DISCOVERED_EXECUTORS_MAX {
                    self.discovered.pop_last();
                    self.not_asked += 1;
                }
            }
            InventorySubscriber::BadName(name) => {
                if self.rejected.contains(&name) {
                    return;
                }
                if self.rejected.len() < DISCOVERY_REJECTED_LISTED_MAX {
                    self.rejected.push(name);
                } else {
                    self.rejected_not_listed += 1;
                }
            }
            InventorySubscriber::Wildcard => self.wildcard_subscriptions += 1,
            InventorySubscriber::Other => {}
        }
    }

    /// Adds one server's reply.
    fn read_reply(&mut self, subject_prefix: &str, known: &BTreeSet<String>, payload: &[u8]) {
        if payload.len() > DISCOVERY_REPLY_BYTES_MAX {
            self.incomplete.push(format!(
                "a reply of {} bytes, over DISCOVERY_REPLY_BYTES_MAX, was not read",
                payload.len()
            ));
            return;
        }
        let reply: ConnzReply = match serde_json::from_slice(payload) {
            Ok(reply) => reply,
            Err(e) => {
                self.incomplete
                    .push(format!("a reply that is not a connection list: {e}"));
                return;
            }
        };
        let Some(data) = reply.data else {
            let why = reply.error.map(|e| e.to_string()).unwrap_or_default();
            self.incomplete.push(format!(
                "a server refused the connection list: {}",
                why.chars()
                    .take(REJECTED_NAME_CHARS_MAX * 2)
                    .collect::<String>()
            ));
            return;
        };
        if data.connections.len() >= DISCOVERY_CONNECTIONS_MAX as usize {
            self.incomplete.push(format!(
                "a server lists {} or more connections with inventory subscriptions \
                 (DISCOVERY_CONNECTIONS_MAX); those past it were not looked at",
                DISCOVERY_CONNECTIONS_MAX
            ));
        }
        for subscription in data.connections.iter().flat_map(|c| &c.subscriptions_list) {
            self.add(subject_prefix, known, subscription);
        }
    }
}

/// Why a discovery round could not run at all.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error(
        "nothing answers {subject} (no responders): the server has no system account, so \
         executors the ledger does not name cannot be discovered"
    )]
    NoResponders { subject: String },
    #[error(
        "no server answered {subject} within {wait:?}: may this user publish it \
         (deploy/nats/accounts.conf)? Executors the ledger does not name were not discovered"
    )]
    NoReply { subject: String, wait: Duration },
    #[error("the discovery request on {subject} failed: {reason}")]
    Request { subject: String, reason: String },
}

/// Finds the executors that receive `<prefix>.exec.<name>.inventory` and are not in
/// `known`, from the account's connection list (one round, within [`DISCOVERY_WAIT`],
/// at most [`DISCOVERY_REPLIES_MAX`] replies, every list bounded: see [`Discovery`]).
pub async fn discover_executors(
    client: &async_nats::Client,
    subject_prefix: &str,
    known: &BTreeSet<String>,
) -> Result<Discovery, DiscoveryError> {
    let subject = DISCOVERY_SUBJECT.to_string();
    let failed = |e: &dyn std::fmt::Display| DiscoveryError::Request {
        subject: subject.clone(),
        reason: e.to_string(),
    };
    let request = serde_json::json!({
        "subscriptions": true,
        "filter_subject": inventory_subject(subject_prefix, "*"),
        "limit": DISCOVERY_CONNECTIONS_MAX,
    });
    let inbox = client.new_inbox();
    let mut replies = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| failed(&e))?;
    client
        .publish_with_reply(subject.clone(), inbox, request.to_string().into())
        .await
        .map_err(|e| failed(&e))?;
    client.flush().await.map_err(|e| failed(&e))?;
    let mut found = Discovery::default();
    let deadline = tokio::time::Instant::now() + DISCOVERY_WAIT;
    while found.servers < DISCOVERY_REPLIES_MAX {
        let until = if found.servers == 0 {
            deadline
        } else {
            deadline.min(tokio::time::Instant::now() + DISCOVERY_QUIET)
        };
        let Ok(Some(reply)) = tokio::time::timeout_at(until, replies.next()).await else {
            break;
        };
        if reply.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            if found.servers == 0 {
                return Err(DiscoveryError::NoResponders { subject });
            }
            continue;
        }
        found.servers += 1;
        found.read_reply(subject_prefix, known, &reply.payload);
    }
    if found.servers == 0 {
        return Err(DiscoveryError::NoReply {
            subject,
            wait: DISCOVERY_WAIT,
        });
    }
    if found.servers >= DISCOVERY_REPLIES_MAX {
        found.incomplete.push(format!(
            "{DISCOVERY_REPLIES_MAX} replies (DISCOVERY_REPLIES_MAX) were read; any later \
             one was not"
        ));
    }
    if found.not_asked > 0 {
        found.incomplete.push(format!(
            "{} more executor(s) answer inventories than the {DISCOVERED_EXECUTORS_MAX} \
             discovered (DISCOVERED_EXECUTORS_MAX): they were not asked; name them with \
             --executor",
            found.not_asked
        ));
    }
    found.incomplete.dedup();
    Ok(found)
}

/// How far a [`fold_log`] read, and what it left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogFolded {
    /// The position of the last entry read.
    pub position: u64,
    /// Entries not folded: undecodable, or outside their aggregate's chain (as serve
    /// quarantines them).
    pub quarantined: u64,
    /// Commits on an operation already reduced, whose history was read back.
    pub reopened: u64,
}

/// Folds the log's entries after `done.position` up to `end` into `fold` (drift's side of
/// the ledger, `provledger drift` and drift-bench), updating `done`; `on_entry` hears the
/// position of each entry handled (a progress bar). A commit on an operation the fold has
/// reduced reads that one operation back from the log (`read_aggregate`); if that history
/// cannot be read whole or does not rebuild the operation as first folded, the commit is
/// left out and counted quarantined, as an entry outside its chain is. `done.position`
/// moves past an entry only once it is handled, so that after an error a retry reads it
/// again.
pub async fn fold_log<L: EventLog>(
    log: &L,
    fold: &mut DriftFold,
    done: &mut LogFolded,
    end: u64,
    mut on_entry: impl FnMut(u64),
) -> Result<(), ReadError> {
    if end <= done.position {
        return Ok(());
    }
    let mut stream = log.read_all(done.position + 1).await?;
    while let Some(entry) = stream.next().await {
        let position = match entry {
            Ok(commit) => {
                if commit.position > end {
                    break;
                }
                if !fold_commit(log, fold, done, &commit).await? {
                    done.quarantined += 1;
                }
                commit.position
            }
            Err(
                ReadError::Undecodable { position, .. } | ReadError::OutsideChain { position, .. },
            ) => {
                done.quarantined += 1;
                position
            }
            Err(e) => return Err(e),
        };
        done.position = done.position.max(position);
        on_entry(position);
    }
    Ok(())
}

/// Folds one commit; false when it is left out (outside its chain, or on a reduced
/// operation whose history does not rebuild it).
async fn fold_commit<L: EventLog>(
    log: &L,
    fold: &mut DriftFold,
    done: &mut LogFolded,
    commit: &provledger_events::Commit,
) -> Result<bool, ReadError> {
    let aggregate = match fold.apply(commit) {
        Folded::Applied | Folded::Ignored => return Ok(true),
        Folded::Quarantined(_) => return Ok(false),
        Folded::NeedsHistory(aggregate) => aggregate,
    };
    done.reopened += 1;
    let history = match log.read_aggregate(aggregate).await {
        Ok(commits) => commits,
        Err(e @ (ReadError::Undecodable { .. } | ReadError::OutsideChain { .. })) => {
            tracing::warn!(%aggregate, position = commit.position, error = %e,
                "an operation's history cannot be read whole: its later commit is left out");
            return Ok(false);
        }
        Err(e) => return Err(e),
    };
    let before: Vec<_> = history
        .into_iter()
        .filter(|c| c.version < commit.version)
        .collect();
    if let Err(e) = fold.reopen(aggregate, &before) {
        tracing::warn!(position = commit.position, error = %e, "commit left out");
        return Ok(false);
    }
    Ok(matches!(fold.apply(commit), Folded::Applied))
}

async fn request_page(
    client: &async_nats::Client,
    executor: &str,
    subject: &str,
    request: &InventoryRequest,
    reply_wait: Duration,
) -> Result<InventoryPage, InventoryError> {
    let failed = |reason: String| InventoryError::Request {
        executor: executor.to_string(),
        subject: subject.to_string(),
        reason,
    };
    let body = serde_json::to_vec(request).map_err(|e| failed(e.to_string()))?;
    let reply = tokio::time::timeout(reply_wait, client.request(subject.to_string(), body.into()))
        .await
        .map_err(|_| InventoryError::Timeout {
            executor: executor.to_string(),
            subject: subject.to_string(),
            wait: reply_wait,
        })?
        .map_err(|e| match e.kind() {
            async_nats::RequestErrorKind::NoResponders => InventoryError::NoResponders {
                executor: executor.to_string(),
                subject: subject.to_string(),
            },
            _ => failed(e.to_string()),
        })?;
    parse_inventory_reply(executor, subject, request, &reply.payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(payload: &str, after: Option<&str>) -> Result<InventoryPage, InventoryError> {
        let request = InventoryRequest {
            after: after.map(str::to_string),
            limit: Some(2),
        };
        parse_inventory_reply(
            "ipam",
            "provledger.exec.ipam.inventory",
            &request,
            payload.as_bytes(),
        )
    }

    #[test]
    fn discovery_reads_the_executor_name_of_an_inventory_subscription_and_nothing_else() {
        // Given subscriptions as executors, the simulator and others hold; when read;
        // then the name of each one that receives one executor's inventory requests
        use InventorySubscriber::*;
        let read = |s: &str| inventory_subscriber("provledger", s);
        for (subscription, expected) in [
            ("provledger.exec.dns.inventory", Executor("dns".into())),
            ("provledger.exec.dns.*", Executor("dns".into())),
            ("provledger.exec.compute.>", Executor("compute".into())),
            ("provledger.exec.*.inventory", Wildcard),
            ("provledger.exec.>", Wildcard),
            ("provledger.exec.dns.compensate", Other),
            ("provledger.exec.a.b.inventory", Other),
            ("provledgerx.exec.dns.inventory", Other),
            ("other.exec.dns.inventory", Other),
            ("provledger.q.>", Other),
            (
                "provledger.exec.\u{1b}[2J<b>x</b>.inventory",
                BadName("\u{1b}[2J<b>x</b>".into()),
            ),
        ] {
            assert_eq!(read(subscription), expected, "{subscription}");
        }
        // And a forged name is kept only to REJECTED_NAME_CHARS_MAX characters
        let long = format!("provledger.exec.{}.inventory", "\u{7}".repeat(10_000));
        assert!(matches!(read(&long), BadName(n) if n.chars().count() == REJECTED_NAME_CHARS_MAX));
    }

    #[test]
    fn a_discovery_keeps_its_bounds_whatever_the_replies_say() {
        // Given replies naming 10,000 executors, 1,000 bad names, and one not JSON
        let known = BTreeSet::from(["dns".to_string()]);
        let mut found = Discovery::default();
        for r in 0..10 {
            let subs: Vec<String> = (0..1_000)
                .map(|i| format!("provledger.exec.x{r}-{i:04}.inventory"))
                .chain((0..100).map(|i| format!("provledger.exec.<{r}-{i}>.inventory")))
                .chain(["provledger.exec.dns.inventory".to_string()])
                .collect();
            let reply =
                serde_json::json!({"data": {"connections": [{"subscriptions_list": subs}]}});
            found.read_reply("provledger", &known, reply.to_string().as_bytes());
        }
        found.read_reply("provledger", &known, b"not json");
        // Then at most the bounds are kept, the rest counted, and a known name is not
        // discovered
        assert_eq!(found.discovered.len(), DISCOVERED_EXECUTORS_MAX);
        assert_eq!(
            found.discovered.first().map(String::as_str),
            Some("x0-0000")
        );
        assert_eq!(found.not_asked, 10_000 - DISCOVERED_EXECUTORS_MAX as u64);
        assert!(!found.discovered.contains("dns"));
        assert_eq!(found.rejected.len(), DISCOVERY_REJECTED_LISTED_MAX);
        assert_eq!(
            found.rejected_not_listed,
            1_000 - DISCOVERY_REJECTED_LISTED_MAX as u64
        );
        assert_eq!(found.incomplete.len(), 1, "{:?}", found.incomplete);
    }

    #[test]
    fn a_page_in_the_documented_form_is_read() {
        // Given the reply of docs/drift.md; when parsed; then its items and cursor
        let page = parse(
            r#"{"items": [{"kind": "ip", "resource": "10.0.0.2", "key": "k1",
                "entity": "0190", "attrs": {"node": "0190"}}], "next": "10.0.0.2"}"#,
            None,
        )
        .expect("a valid page");
        assert_eq!(page.items.len(), 1);
        assert_eq!(page.items[0].key.as_deref(), Some("k1"));
        assert_eq!(page.next.as_deref(), Some("10.0.0.2"));
    }

    #[test]
    fn a_malformed_reply_is_a_typed_error_naming_the_executor() {
        // Given replies that are not pages; when parsed; then typed errors, no panic
        for bad in ["not json", "{}", r#"{"items": [{"resource": 3}]}"#, "[]"] {
            let e = parse(bad, None).expect_err(bad);
            assert!(matches!(e, InventoryError::Malformed { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("\"ipam\""), "{e}");
        }
        let refused = parse(r#"{"error": "busy"}"#, None).expect_err("refused");
        assert!(
            matches!(refused, InventoryError::Refused { .. }),
            "{refused}"
        );
    }

    #[test]
    fn a_page_over_the_limit_or_a_cursor_that_does_not_move_is_refused() {
        // Given a page of 3 items when 2 were asked for; then PageTooLarge
        let item = r#"{"kind": "ip", "resource": "r"}"#;
        let three = format!(r#"{{"items": [{item}, {item}, {item}], "next": null}}"#);
        let e = parse(&three, None).expect_err("too large");
        assert!(matches!(e, InventoryError::PageTooLarge { .. }), "{e}");
        // Given a next cursor that does not move past `after`; then CursorStuck
        let e = parse(r#"{"items": [], "next": "a"}"#, Some("b")).expect_err("stuck");
        assert!(matches!(e, InventoryError::CursorStuck { .. }), "{e}");
    }
}
