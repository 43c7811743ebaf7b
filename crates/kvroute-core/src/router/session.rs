//! Session affinity, sans-IO: a conversation stays on the worker that served it while that
//! worker is not overloaded, and moves once when it is.
//!
//! # The rule
//!
//! A request may carry a [`SessionId`] (the proxy's session header). The [`SessionTable`] binds
//! each session to the worker of its latest booking, with the time of that booking. For a
//! request of a bound session:
//!
//! * **Stay** while the bound worker is in the fleet, decodes, is neither draining nor
//!   suspended, is not busy (the router's [`BusyThresholds`]) and is not **overloaded**: past
//!   any of [`SessionConfig::overloaded`], the same kind of thresholds on the same booked load
//!   (by default: booked requests above the worker's `max_requests`, vLLM's `max_num_seqs`, or
//!   active decode blocks above 90 % of its KV capacity). The policy is not asked.
//! * **Move** otherwise: the policy picks as for any request (an overloaded worker is still a
//!   candidate if not busy, at the cost its load gives it) and the session is bound to the
//!   pick. The binding follows the pick, so the session does not bounce back when the old worker
//!   recovers: it moves again only if its new worker is overloaded in turn.
//! * A request of an unknown session is routed by the policy and binds it.
//!
//! A worker removed or suspended releases its sessions at once (their next request binds anew,
//! counted as new, not as a move). Entries expire [`SessionConfig::idle_ttl`] after their last
//! use, and past [`SessionConfig::max_sessions`] the least recently used is evicted.
//!
//! # Replicas
//!
//! Every booking carries its session ([`super::Booking::session`]), so a peer's booking binds
//! the session here too, stamped with the time it is applied: alternate replicas keep a session
//! on one worker, and each use refreshes its idle time everywhere. A joining replica learns the
//! bindings of idle sessions from the snapshot ([`super::Router::session_snapshot`],
//! [`super::LoadChange::Session`]), which binds only a session it does not know yet. Two
//! replicas that move one session at the same instant may bind it to two workers until its next
//! booking reaches both.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use super::busy::BusyThresholds;
use crate::ids::WorkerKey;
use crate::key_hasher::BuildKeyHasher;
use crate::time::Timestamp;

/// A session's id: the hash of the session header's value ([`SessionId::from_header`]), the
/// same on every replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(pub u64);

impl SessionId {
    /// The id of a session header's value: XXH3-64 of its bytes, seed 0.
    pub fn from_header(value: impl AsRef<[u8]>) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64(value.as_ref()))
    }
}

/// Session-affinity settings; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SessionConfig {
    /// The most sessions kept; past it the least recently used is evicted. Default 65,536.
    pub max_sessions: usize,
    /// A session unused this long is forgotten. Default 30 min.
    pub idle_ttl: Duration,
    /// When a session's worker counts as overloaded, on the load the router books. Default:
    /// booked requests above its `max_requests` (`requests_fraction` 1.0) or active decode
    /// blocks above 90 % of its capacity (`decode_blocks_fraction` 0.9).
    pub overloaded: BusyThresholds,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            max_sessions: 1 << 16,
            idle_ttl: Duration::from_secs(30 * 60),
            overloaded: BusyThresholds {
                decode_blocks_fraction: Some(0.9),
                requests_fraction: Some(1.0),
                ..BusyThresholds::default()
            },
        }
    }
}

/// What a booking did to its session's binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionOutcome {
    /// The session was not bound: now it is.
    New,
    /// It stayed on its worker.
    Hit,
    /// It moved to another worker.
    Moved,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Binding {
    worker: WorkerKey,
    last_use: Timestamp,
    /// Tie-break of `last_use` in the recency order: the table's use count at the last use.
    stamp: u64,
}

/// Session → worker bindings, bounded and expiring; see the module docs.
#[derive(Clone, Debug, Default)]
pub struct SessionTable {
    bindings: HashMap<SessionId, Binding, BuildKeyHasher>,
    /// Recency order: (last use, stamp) → session.
    order: BTreeMap<(Timestamp, u64), SessionId>,
    uses: u64,
}

impl SessionTable {
    /// The worker `session` is bound to.
    pub fn worker_of(&self, session: SessionId) -> Option<WorkerKey> {
        self.bindings.get(&session).map(|b| b.worker)
    }

    /// Sessions bound now.
    pub fn len(&self) -> usize {
        self.bindings.len()
    }

    /// Whether no session is bound.
    pub fn is_empty(&self) -> bool {
        self.bindings.is_empty()
    }

    /// Binds `session` to `worker` as of `now` (a booking); returns what changed and how many
    /// sessions the cap of `max_sessions` evicted.
    pub fn bind(
        &mut self,
        now: Timestamp,
        session: SessionId,
        worker: WorkerKey,
        max_sessions: usize,
    ) -> (SessionOutcome, u64) {
        self.uses += 1;
        let binding = Binding {
            worker,
            last_use: now,
            stamp: self.uses,
        };
        let outcome = match self.bindings.insert(session, binding) {
            None => SessionOutcome::New,
            Some(old) => {
                self.order.remove(&(old.last_use, old.stamp));
                if old.worker == worker {
                    SessionOutcome::Hit
                } else {
                    SessionOutcome::Moved
                }
            }
        };
        self.order.insert((now, self.uses), session);
        let mut evicted = 0;
        while self.bindings.len() > max_sessions.max(1) {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.bindings.remove(&oldest);
            evicted += 1;
        }
        (outcome, evicted)
    }

    /// Binds `session` to `worker` as of `now` only if it is not bound (a peer's snapshot);
    /// true if it was bound here.
    pub fn learn(
        &mut self,
        now: Timestamp,
        session: SessionId,
        worker: WorkerKey,
        max_sessions: usize,
    ) -> bool {
        if self.bindings.contains_key(&session) {
            return false;
        }
        self.bind(now, session, worker, max_sessions);
        true
    }

    /// Forgets every session bound to `worker`; returns how many.
    pub fn release_worker(&mut self, worker: WorkerKey) -> u64 {
        let before = self.bindings.len();
        self.bindings.retain(|_, b| b.worker != worker);
        let bindings = &self.bindings;
        self.order
            .retain(|_, s| bindings.get(s).is_some_and(|b| b.worker != worker));
        (before - self.bindings.len()) as u64
    }

    /// Forgets the sessions last used at or before `cutoff`; returns how many.
    pub fn expire(&mut self, cutoff: Timestamp) -> u64 {
        let mut expired = 0;
        while let Some(entry) = self.order.first_entry() {
            if entry.key().0 > cutoff {
                break;
            }
            let session = entry.remove();
            self.bindings.remove(&session);
            expired += 1;
        }
        expired
    }

    /// When the least recently used session was last used.
    pub fn oldest(&self) -> Option<Timestamp> {
        self.order.first_key_value().map(|(&(t, _), _)| t)
    }

    /// Every binding, least recently used first.
    pub fn bindings(&self) -> impl Iterator<Item = (SessionId, WorkerKey)> + '_ {
        self.order
            .values()
            .filter_map(|s| self.bindings.get(s).map(|b| (*s, b.worker)))
    }

    /// Checks that the recency order and the bindings agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.order.len() != self.bindings.len() {
            return Err(format!(
                "{} sessions in the recency order, {} bound",
                self.order.len(),
                self.bindings.len()
            ));
        }
        for (&(t, stamp), s) in &self.order {
            match self.bindings.get(s) {
                Some(b) if (b.last_use, b.stamp) == (t, stamp) => {}
                other => {
                    return Err(format!(
                        "session {s:?} ordered at {t:?}/{stamp}, bound as {other:?}"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{DpRank, WorkerId};

    fn w(n: u32) -> WorkerKey {
        WorkerKey::new(WorkerId(n.into()), DpRank(0))
    }

    #[test]
    fn bindings_follow_bookings_expire_and_are_capped_least_recent_first() {
        let mut t = SessionTable::default();
        let ms = Timestamp::from_millis;
        let (a, b, c) = (SessionId(1), SessionId(2), SessionId(3));
        assert_eq!(t.bind(ms(1), a, w(1), 2), (SessionOutcome::New, 0));
        assert_eq!(t.bind(ms(2), b, w(2), 2), (SessionOutcome::New, 0));
        assert_eq!(t.bind(ms(3), a, w(1), 2), (SessionOutcome::Hit, 0));
        // `b` is the least recently used: the cap evicts it.
        assert_eq!(t.bind(ms(4), c, w(1), 2), (SessionOutcome::New, 1));
        assert_eq!(t.worker_of(b), None);
        assert_eq!(t.bind(ms(5), a, w(2), 2), (SessionOutcome::Moved, 0));
        assert!(!t.learn(ms(5), a, w(3), 2));
        assert_eq!(t.release_worker(w(1)), 1);
        assert_eq!(t.bindings().collect::<Vec<_>>(), vec![(a, w(2))]);
        assert_eq!(t.expire(ms(4)), 0);
        assert_eq!(t.expire(ms(5)), 1);
        assert!(t.is_empty());
        t.check_invariants().unwrap();
        assert_eq!(SessionId::from_header("abc"), SessionId::from_header("abc"));
        assert_ne!(SessionId::from_header("abc"), SessionId::from_header("abd"));
    }
}
