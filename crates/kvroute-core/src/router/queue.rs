//! The wait queue: requests that arrived while every eligible worker was busy, or, with
//! [`WhenEmpty::Queue`], while no worker was eligible at all.
//!
//! Order is a strict priority tier (higher [`RouteRequest::priority`](super::RouteRequest)
//! first); within a tier, the waiting tenant furthest behind its weighted fair share of tokens
//! (the [`super::fair`] module); within a tenant, the policy key: arrival for FCFS, prompt length
//! for shortest-prefill-first (Dynamo's WSPT key `(1 + priority) / isl` without the priority
//! weighting, which the strict tier replaces), then arrival. With one tenant this is the tier,
//! then the policy key. The router re-checks the head whenever load falls, a worker is
//! added or back in routing, and on every tick; the queue is bounded and a full queue rejects.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::time::Duration;

use hashbrown::HashMap;

use super::fair::{FairShare, TenantId};
use super::request::Prepared;
use crate::ids::{LocalBlockHash, RequestId};
use crate::key_hasher::BuildKeyHasher;

/// The order in which waiting requests are released.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueOrder {
    /// First come, first served.
    #[default]
    Fcfs,
    /// The shortest prompt first (arrival among equals).
    ShortestPrefillFirst,
}

/// What a request meets when no worker is eligible at all (none that decodes, or all of them
/// draining or out of routing), as opposed to every eligible worker being busy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WhenEmpty {
    /// Turned away at once ([`super::RejectReason::NoEligibleWorker`]).
    #[default]
    Reject,
    /// Queued as a request is when every worker is busy (within the same capacity; with none,
    /// rejected as with `Reject`), and released when a worker is added or back in routing: a
    /// fleet scaled to zero starts a worker while its first requests wait.
    Queue,
}

/// The queue's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueConfig {
    /// The most requests that may wait; 0 rejects instead of queueing.
    pub capacity: usize,
    /// Whether a request for which no worker is eligible waits or is rejected.
    pub when_empty: WhenEmpty,
    /// Release order.
    pub order: QueueOrder,
    /// While requests wait, [`super::Router::next_deadline`] asks for a tick this often, as a
    /// backstop to the re-checks on every load change.
    pub recheck_interval: Duration,
}

impl Default for QueueConfig {
    /// 1,024 requests, rejected when no worker is eligible, FCFS, a re-check every second.
    fn default() -> Self {
        Self {
            capacity: 1024,
            when_empty: WhenEmpty::Reject,
            order: QueueOrder::Fcfs,
            recheck_interval: Duration::from_secs(1),
        }
    }
}

/// A request waiting, with the local hashes its overlap is looked up by.
#[derive(Clone, Debug)]
pub(crate) struct Waiting {
    pub(crate) request: Prepared,
    pub(crate) locals: Box<[LocalBlockHash]>,
}

/// Where a request waits: its priority tier, its tenant, then the policy key and arrival.
pub(crate) type Key = (Reverse<i32>, TenantId, (u64, u64));

/// One tenant's waiting requests in one tier, by (policy key, arrival).
type Line = BTreeMap<(u64, u64), Waiting>;

/// See the module docs.
#[derive(Clone, Debug)]
pub(crate) struct WaitQueue {
    config: QueueConfig,
    tiers: BTreeMap<Reverse<i32>, BTreeMap<TenantId, Line>>,
    keys: HashMap<RequestId, Key, BuildKeyHasher>,
    /// Requests waiting per tenant, in every tier.
    per_tenant: BTreeMap<TenantId, usize>,
    arrivals: u64,
}

impl WaitQueue {
    pub(crate) fn new(config: QueueConfig) -> Self {
        Self {
            config,
            tiers: BTreeMap::new(),
            keys: HashMap::default(),
            per_tenant: BTreeMap::new(),
            arrivals: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.keys.contains_key(&id)
    }

    pub(crate) fn recheck_interval(&self) -> Duration {
        self.config.recheck_interval
    }

    /// Requests waiting per tenant, in tenant order.
    pub(crate) fn waiting_per_tenant(&self) -> impl Iterator<Item = (TenantId, usize)> + '_ {
        self.per_tenant.iter().map(|(&t, &n)| (t, n))
    }

    /// Adds `waiting`; false (and the request is dropped) if the queue is full. A tenant that
    /// had nothing waiting is lifted in `fair` first ([`FairShare::lift`]).
    pub(crate) fn push(&mut self, waiting: Waiting, fair: &mut FairShare) -> bool {
        if self.len() >= self.config.capacity {
            return false;
        }
        let order = match self.config.order {
            QueueOrder::Fcfs => 0,
            QueueOrder::ShortestPrefillFirst => waiting.request.prompt_tokens,
        };
        let tenant = waiting.request.tenant;
        if !self.per_tenant.contains_key(&tenant) {
            fair.lift(tenant, self.per_tenant.keys().copied());
        }
        let key = (Reverse(waiting.request.priority), tenant, (order, self.arrivals));
        self.arrivals += 1;
        self.insert(key, waiting);
        true
    }

    /// Puts back a request [`Self::pop`] took, in its old place (no lift: it never left).
    pub(crate) fn put_back(&mut self, key: Key, waiting: Waiting) {
        self.insert(key, waiting);
    }

    fn insert(&mut self, key: Key, waiting: Waiting) {
        let (tier, tenant, place) = key;
        self.keys.insert(waiting.request.id, key);
        *self.per_tenant.entry(tenant).or_insert(0) += 1;
        self.tiers
            .entry(tier)
            .or_default()
            .entry(tenant)
            .or_default()
            .insert(place, waiting);
    }

    /// Takes the request that goes next: the highest tier; in it, the tenant with the smallest
    /// counter in `fair` (the earliest head among equals); its first request. Returns its key
    /// too, for [`Self::put_back`].
    pub(crate) fn pop(&mut self, fair: &FairShare) -> Option<(Key, Waiting)> {
        let (&tier, tenants) = self.tiers.iter().next()?;
        let tenant = tenants
            .iter()
            .filter_map(|(&t, line)| {
                line.keys()
                    .next()
                    .map(|&(_, arrival)| (fair.counter(t), arrival, t))
            })
            .min()
            .map(|(_, _, t)| t)?;
        let key = {
            let line = self.tiers.get(&tier)?.get(&tenant)?;
            let (&place, _) = line.iter().next()?;
            (tier, tenant, place)
        };
        let waiting = self.take(key)?;
        Some((key, waiting))
    }

    /// The waiting requests, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Waiting> {
        self.tiers
            .values()
            .flat_map(|tenants| tenants.values().flat_map(|line| line.values()))
    }

    /// Removes request `id` if it waits.
    pub(crate) fn remove(&mut self, id: RequestId) -> bool {
        let Some(&key) = self.keys.get(&id) else {
            return false;
        };
        self.take(key).is_some()
    }

    fn take(&mut self, (tier, tenant, place): Key) -> Option<Waiting> {
        let tenants = self.tiers.get_mut(&tier)?;
        let line = tenants.get_mut(&tenant)?;
        let waiting = line.remove(&place)?;
        if line.is_empty() {
            tenants.remove(&tenant);
            if tenants.is_empty() {
                self.tiers.remove(&tier);
            }
        }
        self.keys.remove(&waiting.request.id);
        if let Some(n) = self.per_tenant.get_mut(&tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&tenant);
            }
        }
        Some(waiting)
    }
}
