//! The wait queue: requests that arrived while every eligible worker was busy, or, with
//! [`WhenEmpty::Queue`], while no worker was eligible at all.
//!
//! Order is a strict priority tier (higher [`RouteRequest::priority`](super::RouteRequest)
//! first), then the policy key: arrival for FCFS, prompt length for shortest-prefill-first
//! (Dynamo's WSPT key `(1 + priority) / isl` without the priority weighting, which the strict tier
//! replaces), then arrival. The router re-checks the head whenever load falls, a worker is
//! added or back in routing, and on every tick; the queue is bounded and a full queue rejects.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::time::Duration;

use hashbrown::HashMap;

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

type Key = (Reverse<i32>, u64, u64);

/// A request's place in the queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place(Key);

/// See the module docs.
#[derive(Clone, Debug)]
pub(crate) struct WaitQueue {
    config: QueueConfig,
    entries: BTreeMap<Key, Waiting>,
    keys: HashMap<RequestId, Key, BuildKeyHasher>,
    arrivals: u64,
}

impl WaitQueue {
    pub(crate) fn new(config: QueueConfig) -> Self {
        Self {
            config,
            entries: BTreeMap::new(),
            keys: HashMap::default(),
            arrivals: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub(crate) fn contains(&self, id: RequestId) -> bool {
        self.keys.contains_key(&id)
    }

    pub(crate) fn recheck_interval(&self) -> Duration {
        self.config.recheck_interval
    }

    /// Adds `waiting`; false (and the request is dropped) if the queue is full.
    pub(crate) fn push(&mut self, waiting: Waiting) -> bool {
        if self.entries.len() >= self.config.capacity {
            return false;
        }
        let order = match self.config.order {
            QueueOrder::Fcfs => 0,
            QueueOrder::ShortestPrefillFirst => waiting.request.prompt_tokens,
        };
        let key = (Reverse(waiting.request.priority), order, self.arrivals);
        self.arrivals += 1;
        self.keys.insert(waiting.request.id, key);
        self.entries.insert(key, waiting);
        true
    }

    /// Takes the request that goes next with its place in the queue, for
    /// [`WaitQueue::restore`].
    pub(crate) fn pop_placed(&mut self) -> Option<(Place, Waiting)> {
        let (key, waiting) = self.entries.pop_first()?;
        self.keys.remove(&waiting.request.id);
        Some((Place(key), waiting))
    }

    /// Puts back a request taken by [`WaitQueue::pop_placed`] in its place.
    pub(crate) fn restore(&mut self, place: Place, waiting: Waiting) {
        self.keys.insert(waiting.request.id, place.0);
        self.entries.insert(place.0, waiting);
    }

    /// The waiting requests, next first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Waiting> {
        self.entries.values()
    }

    /// Removes request `id` if it waits.
    pub(crate) fn remove(&mut self, id: RequestId) -> bool {
        let Some(key) = self.keys.remove(&id) else {
            return false;
        };
        self.entries.remove(&key).is_some()
    }
}
