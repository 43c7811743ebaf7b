//! The worker registry: every worker the proxy knows, its configuration and its
//! [`WorkerState`]. It only keeps the books; what a change of state means for the router
//! (ranks entering, draining or leaving it) is the driver's ([`crate::driver`]).

use std::collections::BTreeMap;

use kvroute_core::ids::WorkerId;
use serde::Serialize;

use crate::config::WorkerConfig;
use crate::worker::{HealthPolicy, StateName, WorkerEvent, WorkerState};

/// A worker as the proxy knows it.
#[derive(Debug)]
pub struct WorkerEntry {
    /// Its configuration.
    pub config: WorkerConfig,
    /// Its base URL without a trailing slash.
    pub base: String,
    /// Where it is in its life.
    pub state: WorkerState,
}

/// A worker as the admin API lists it.
#[derive(Debug, Serialize)]
pub struct WorkerStatus {
    /// Its id.
    pub id: u64,
    /// Its configuration.
    #[serde(flatten)]
    pub config: WorkerConfig,
    /// Its state by name.
    pub state: StateName,
    /// Whether it takes new requests (its state is `ready`).
    pub routable: bool,
    /// Requests the router books on it (all ranks).
    pub active_requests: u64,
    /// Blocks the index says it holds (all ranks).
    pub cached_blocks: u64,
    /// How far its cache view can be trusted (from its KV events).
    pub view: crate::events::ViewSummary,
}

/// One worker's change of state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Before.
    pub from: WorkerState,
    /// After.
    pub to: WorkerState,
    /// Its data-parallel ranks (each is a worker to the router).
    pub ranks: u32,
}

/// Every worker, by id (ids are never reused).
#[derive(Debug)]
pub struct Registry {
    workers: BTreeMap<WorkerId, WorkerEntry>,
    next: u64,
    policy: HealthPolicy,
}

impl Registry {
    /// An empty registry whose health streaks follow `policy`.
    pub fn new(policy: HealthPolicy) -> Self {
        Self {
            workers: BTreeMap::new(),
            next: 0,
            policy,
        }
    }

    /// Registers a worker in state [`WorkerState::ADDED`] (not yet in the router: the driver
    /// puts it there) and returns its id.
    pub fn add(&mut self, config: WorkerConfig) -> WorkerId {
        let id = WorkerId(self.next);
        self.next += 1;
        let base = config.url.trim_end_matches('/').to_owned();
        self.workers.insert(
            id,
            WorkerEntry {
                config,
                base,
                state: WorkerState::ADDED,
            },
        );
        id
    }

    /// Applies `event` to worker `id`; `None` if there is no such worker. A worker whose new
    /// state is [`WorkerState::Gone`] stays until [`Self::forget`] (its last state is still
    /// to be carried out).
    pub fn apply(&mut self, id: WorkerId, event: WorkerEvent) -> Option<Transition> {
        let entry = self.workers.get_mut(&id)?;
        let from = entry.state;
        let to = from.on(event, self.policy);
        entry.state = to;
        let ranks = entry.config.dp_size;
        Some(Transition { from, to, ranks })
    }

    /// Forgets worker `id` if it is [`WorkerState::Gone`].
    pub fn forget(&mut self, id: WorkerId) {
        if self.get(id).is_some_and(|w| w.state == WorkerState::Gone) {
            self.workers.remove(&id);
        }
    }

    /// Worker `id`.
    pub fn get(&self, id: WorkerId) -> Option<&WorkerEntry> {
        self.workers.get(&id)
    }

    /// Every worker, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerId, &WorkerEntry)> {
        self.workers.iter().map(|(&id, w)| (id, w))
    }

    /// The workers being drained.
    pub fn draining(&self) -> impl Iterator<Item = (WorkerId, &WorkerEntry)> {
        self.iter()
            .filter(|(_, w)| matches!(w.state, WorkerState::Draining { .. }))
    }

    /// Whether worker `id`'s ranks are in the router.
    pub fn in_router(&self, id: WorkerId) -> bool {
        self.get(id).is_some_and(|w| w.state.in_router())
    }

    /// Whether some worker takes new requests.
    pub fn any_routable(&self) -> bool {
        self.workers.values().any(|w| w.state.routable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_forgets_a_worker_and_ids_are_not_reused() {
        let mut registry = Registry::new(HealthPolicy {
            failures: 3,
            successes: 2,
        });
        let config = WorkerConfig::parse_flag("http://127.0.0.1:1/").unwrap();
        let a = registry.add(config.clone());
        assert_eq!(registry.get(a).unwrap().base, "http://127.0.0.1:1");
        let t = registry.apply(a, WorkerEvent::Removed).unwrap();
        assert_eq!((t.from, t.to), (WorkerState::ADDED, WorkerState::Gone));
        assert_eq!(registry.get(a).unwrap().state, WorkerState::Gone);
        registry.forget(a);
        assert!(registry.get(a).is_none());
        assert!(registry.apply(a, WorkerEvent::CheckPassed).is_none());
        assert_ne!(registry.add(config), a);
    }
}
