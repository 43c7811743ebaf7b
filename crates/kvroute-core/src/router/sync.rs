//! Replica synchronization, sans-IO: the active-load changes one router makes, as events another
//! router replica can apply, so that replicas that route to the same fleet see each other's
//! load; and the one rule for deciding that a peer is gone ([`PeerTracker`]). Transports (the
//! simulator's channel, a live message bus) carry the events; they decide nothing.
//!
//! # What a router exports
//!
//! With [`SyncMode::Export`], a router exports an event for every booking it makes
//! ([`LoadChange::Added`], with the load hint it computed), every first token
//! ([`LoadChange::PrefillDone`]) and every request it frees ([`LoadChange::Freed`], including
//! expiries and requests dropped with a removed worker). Events carry the exporting router's
//! [`RouterId`]; a router drops events with its own id, so echoes through a shared channel are
//! harmless. As in Dynamo, output-block growth is not synced. A [`RouterId`] names one run of a
//! replica: a restarted replica takes a fresh id (its request ids start over).
//!
//! # What a router does with a peer's event
//!
//! * **Added** books the request exactly as a local decision is booked (load, the record of
//!   recent decisions, the policies' own views through [`super::Policy::routed`], the binding
//!   of its session: [`super::session`]), stamped with the time it is applied.
//! * **Duplicates are idempotent**: an Added for a request already booked, a PrefillDone or
//!   Freed for one already freed, change nothing (counted as `sync_duplicates`).
//! * **Tombstones**: every Freed of a peer's request leaves a tombstone, so an Added that arrives
//!   after it (reordered, or in a snapshot taken before the free) is not resurrected (counted as
//!   `sync_stale_added`). A PrefillDone that arrives before its Added leaves a mark too: the late
//!   Added is booked with its prefill done. Tombstones expire after
//!   [`super::RouterConfig::request_ttl`] and are capped at [`SyncConfig::max_tombstones`], the
//!   oldest evicted first; both are counted.
//! * **A lost peer** ([`super::Router::handle_peer_lost`]) has every booking released at once.
//! * **A joining replica** applies each peer's [`super::Router::sync_snapshot`]: its in-flight
//!   bookings as Added (and PrefillDone) events.
//!
//! # Ordering
//!
//! A router applies events in the order it is handed them, and the result depends on that order
//! only through the rules above. Each peer's events must arrive in the order that peer exported
//! them (a single publisher on an ordered channel gives that). Events of several peers that a
//! driver hands over at the same time are applied in [`RouterId`] order, and each peer's in its
//! export order: the simulator delivers by (delivery time, router id, export sequence), so a run
//! is a function of its inputs.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashMap;

use super::fair::TenantId;
use super::load::PrefillLoadHint;
use super::session::SessionId;
use crate::ids::{RequestId, SequenceHash, WorkerKey};
use crate::key_hasher::BuildKeyHasher;
use crate::time::Timestamp;

/// A router replica's identity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RouterId(pub u64);

/// Everything needed to book a request's load: what a decision commits to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Booking {
    /// The worker that decodes the request.
    pub worker: WorkerKey,
    /// Prompt blocks cached on `worker` at admission (the staged projection's cached prefix).
    pub overlap_blocks: u32,
    /// The prefill worker, when disaggregated.
    pub prefill_worker: Option<WorkerKey>,
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Sequence hashes of the prompt's full blocks.
    pub chain: Arc<[SequenceHash]>,
    /// The prefill load, booked on the worker that prefills.
    pub hint: PrefillLoadHint,
    /// The request's output-length hint.
    pub expected_output_tokens: Option<u32>,
    /// The request's session: a peer binds it to `worker` (see the `session` module).
    pub session: Option<SessionId>,
    /// The request's tenant, charged for it in every replica's fair share.
    pub tenant: TenantId,
}

/// One active-load change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadChange {
    /// A request was booked.
    Added(Booking),
    /// Its first token came: prefill is done.
    PrefillDone,
    /// It left the books.
    Freed,
    /// A session's binding, from a replica's [`super::Router::session_snapshot`]: bound here
    /// only if the session is not (the event's request id is unused, 0).
    Session {
        /// The session.
        session: SessionId,
        /// Its worker.
        worker: WorkerKey,
    },
}

impl LoadChange {
    /// How soon peers must hear it: a booking or a session's binding at once (within the batch
    /// window), prefill done and freed lazily (they only lower a peer's view of load).
    pub fn urgency(&self) -> super::replica::Urgency {
        use super::replica::Urgency;
        match self {
            Self::Added(_) | Self::Session { .. } => Urgency::Urgent,
            Self::PrefillDone | Self::Freed => Urgency::Lazy,
        }
    }
}

/// An active-load change made by router `router` for its request `request`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncEvent {
    /// The router that made the change.
    pub router: RouterId,
    /// The request, in that router's ids.
    pub request: RequestId,
    /// The change.
    pub change: LoadChange,
}

/// Whether a router exports its load changes for its peers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SyncMode {
    /// No events are exported: a lone router. Peers' events, if handed over, still apply.
    #[default]
    Off,
    /// Every load change waits in the outbox for [`super::Router::poll_sync_event`].
    Export,
}

/// Replica-sync settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyncConfig {
    /// Whether load changes are exported. Default [`SyncMode::Off`].
    pub mode: SyncMode,
    /// The most tombstones kept (freed peer requests, early prefill-done marks); past it the
    /// oldest are evicted. Default 65,536.
    pub max_tombstones: usize,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            mode: SyncMode::Off,
            max_tombstones: 1 << 16,
        }
    }
}

/// What a tombstone remembers of a peer's request that is not booked here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mark {
    /// Its prefill is done (the Added has not come yet).
    PrefillDone,
    /// It was freed: a later Added is stale.
    Freed,
}

type PeerKey = (RouterId, RequestId);

/// Tombstones of peers' requests, in time order; see the module docs.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tombstones {
    marks: HashMap<PeerKey, (Timestamp, Mark), BuildKeyHasher>,
    /// Insertion order; an entry is stale once its key is marked again at another time or gone.
    order: VecDeque<(Timestamp, PeerKey)>,
}

impl Tombstones {
    pub(crate) fn get(&self, key: PeerKey) -> Option<Mark> {
        self.marks.get(&key).map(|&(_, mark)| mark)
    }

    /// Marks `key` at `now`; returns how many old marks the cap evicted.
    pub(crate) fn mark(&mut self, now: Timestamp, key: PeerKey, mark: Mark, cap: usize) -> u64 {
        self.marks.insert(key, (now, mark));
        self.order.push_back((now, key));
        let mut evicted = 0;
        while self.marks.len() > cap.max(1) {
            evicted += u64::from(self.pop_front());
        }
        self.compact();
        evicted
    }

    pub(crate) fn remove(&mut self, key: PeerKey) {
        self.marks.remove(&key);
        self.compact();
    }

    /// Drops marks made at or before `cutoff`; returns how many.
    pub(crate) fn expire(&mut self, cutoff: Timestamp) -> u64 {
        let mut expired = 0;
        while self.order.front().is_some_and(|&(t, _)| t <= cutoff) {
            expired += u64::from(self.pop_front());
        }
        expired
    }

    /// Drops every mark of `router`.
    pub(crate) fn forget_router(&mut self, router: RouterId) {
        self.marks.retain(|&(r, _), _| r != router);
        self.compact();
    }

    /// The time of the oldest mark.
    pub(crate) fn oldest(&self) -> Option<Timestamp> {
        self.order.front().map(|&(t, _)| t)
    }

    pub(crate) fn len(&self) -> usize {
        self.marks.len()
    }

    /// Pops the oldest entry; true if it was a live mark (now removed).
    fn pop_front(&mut self) -> bool {
        let Some((t, key)) = self.order.pop_front() else {
            return false;
        };
        if self.marks.get(&key).is_some_and(|&(stamp, _)| stamp == t) {
            self.marks.remove(&key);
            return true;
        }
        false
    }

    /// Drops stale entries at the front, and rebuilds the order once stale entries outnumber
    /// live ones.
    fn compact(&mut self) {
        while let Some(&(t, key)) = self.order.front()
            && self.marks.get(&key).is_none_or(|&(stamp, _)| stamp != t)
        {
            self.order.pop_front();
        }
        if self.order.len() > 2 * self.marks.len() + 1024 {
            let marks = &self.marks;
            let mut seen = hashbrown::HashSet::with_capacity_and_hasher(marks.len(), BuildKeyHasher);
            // Keep, for each live key, only its newest entry (the one its stamp names).
            let mut kept: Vec<(Timestamp, PeerKey)> = self
                .order
                .iter()
                .rev()
                .filter(|&&(t, key)| marks.get(&key).is_some_and(|&(s, _)| s == t) && seen.insert(key))
                .copied()
                .collect();
            kept.reverse();
            self.order = kept.into();
        }
    }
}

/// When each peer was last heard from, and the one rule for declaring one lost: silent for
/// longer than the timeout. Both the live transport and the simulator use it.
#[derive(Clone, Debug)]
pub struct PeerTracker {
    timeout: Duration,
    last_heard: std::collections::BTreeMap<RouterId, Timestamp>,
}

impl PeerTracker {
    /// A tracker that declares a peer lost after `timeout` of silence.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            last_heard: std::collections::BTreeMap::new(),
        }
    }

    /// The timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// `peer` was heard from at `now` (a heartbeat or any event); true if it is new (or back
    /// after being declared lost).
    pub fn heard(&mut self, now: Timestamp, peer: RouterId) -> bool {
        match self.last_heard.insert(peer, now) {
            None => true,
            Some(before) => {
                if before > now {
                    // Never move a peer's last sighting back.
                    self.last_heard.insert(peer, before);
                }
                false
            }
        }
    }

    /// The peers silent for longer than the timeout at `now`, in [`RouterId`] order; they are
    /// forgotten (heard again, they are new).
    pub fn expired(&mut self, now: Timestamp) -> Vec<RouterId> {
        let lost: Vec<RouterId> = self
            .last_heard
            .iter()
            .filter(|&(_, &t)| t + self.timeout < now)
            .map(|(&peer, _)| peer)
            .collect();
        for peer in &lost {
            self.last_heard.remove(peer);
        }
        lost
    }

    /// Forgets `peer` (it said goodbye); true if it was known.
    pub fn forget(&mut self, peer: RouterId) -> bool {
        self.last_heard.remove(&peer).is_some()
    }

    /// The peers alive now, in [`RouterId`] order.
    pub fn peers(&self) -> impl Iterator<Item = RouterId> + '_ {
        self.last_heard.keys().copied()
    }

    /// When the next peer would expire if not heard from: call [`PeerTracker::expired`] then
    /// (just after it: silence must exceed the timeout).
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.last_heard.values().min().map(|&t| t + self.timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Timestamp {
        Timestamp::from_millis(n)
    }

    #[test]
    fn a_peer_is_lost_once_silent_past_the_timeout_and_new_when_heard_again() {
        let mut t = PeerTracker::new(Duration::from_millis(100));
        assert!(t.heard(ms(0), RouterId(2)));
        assert!(t.heard(ms(10), RouterId(1)));
        assert!(!t.heard(ms(50), RouterId(2)));
        assert_eq!(t.next_deadline(), Some(ms(110)));
        assert_eq!(t.expired(ms(110)), vec![]);
        assert_eq!(t.expired(ms(111)), vec![RouterId(1)]);
        // A late, older sighting does not move a peer back.
        assert!(!t.heard(ms(20), RouterId(2)));
        assert_eq!(t.expired(ms(151)), vec![RouterId(2)]);
        assert_eq!(t.peers().count(), 0);
        assert!(t.heard(ms(200), RouterId(1)));
        assert!(t.heard(ms(200), RouterId(3)));
        assert_eq!(t.expired(ms(301)), vec![RouterId(1), RouterId(3)]);
        assert!(!t.forget(RouterId(1)));
    }

    #[test]
    fn tombstones_expire_in_order_and_are_capped() {
        let k = |n| (RouterId(1), RequestId(n));
        let mut t = Tombstones::default();
        assert_eq!(t.mark(ms(1), k(1), Mark::PrefillDone, 3), 0);
        t.mark(ms(2), k(2), Mark::Freed, 3);
        // Marked again later: its old entry is stale.
        t.mark(ms(3), k(1), Mark::Freed, 3);
        t.mark(ms(4), k(3), Mark::Freed, 3);
        assert_eq!(t.len(), 3);
        assert_eq!(t.mark(ms(5), k(4), Mark::Freed, 3), 1);
        assert_eq!(t.get(k(2)), None);
        assert_eq!(t.get(k(1)), Some(Mark::Freed));
        assert_eq!(t.oldest(), Some(ms(3)));
        assert_eq!(t.expire(ms(4)), 2);
        assert_eq!((t.len(), t.get(k(4))), (1, Some(Mark::Freed)));
        t.forget_router(RouterId(1));
        assert_eq!((t.len(), t.oldest()), (0, None));
        for n in 0..5000 {
            t.mark(ms(10), k(n % 3), Mark::Freed, 100);
        }
        assert!(t.order.len() <= 2 * t.len() + 1025, "{}", t.order.len());
    }
}
