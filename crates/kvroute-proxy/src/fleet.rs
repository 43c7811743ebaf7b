//! The fleet: the proxy's one door for adding and removing workers, used by start-up, the admin
//! API and peer replicas alike.
//!
//! A worker, once added, is one entry of the driver's registry ([`crate::registry`]), and that
//! entry owns everything the proxy holds for it: its state, its registration checks' verdicts,
//! its ranks' cache views, its KV-event subscribers; besides, its ranks are in the router and
//! its series in the metrics. [`Fleet::add`] makes all of these; [`Fleet::remove`] (the
//! driver's one remove path) ends all of them, whoever asks: an operator, or a peer replica
//! that an operator asked.

use std::sync::Arc;

use kvroute_core::ids::WorkerId;
use kvroute_sync::WorkerChange;

use crate::config::WorkerConfig;
use crate::driver::{Announce, Shared};
use crate::events::EventFeed;
use crate::health::Checker;

/// See the module docs.
pub struct Fleet {
    shared: Arc<Shared>,
    feed: EventFeed,
    checker: Checker,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

impl Fleet {
    /// The fleet of `shared`'s workers: their KV events applied by `feed`, their registration
    /// checks run by `checker`.
    pub fn new(shared: Arc<Shared>, feed: EventFeed, checker: Checker) -> Self {
        Self {
            shared,
            feed,
            checker,
        }
    }

    /// The driver.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The registration checks' runner.
    pub fn checker(&self) -> &Checker {
        &self.checker
    }

    /// Adds a worker and returns its id: it enters routing, its KV-event subscribers start
    /// (one per rank), its registration checks run, and the peers are told.
    pub fn add(&self, config: WorkerConfig) -> Result<WorkerId, String> {
        let id = self.shared.add_worker(config.clone())?;
        self.shared
            .adopt_subscribers(id, self.feed.subscribe(id, &config));
        self.checker.spawn(&self.shared, id);
        Ok(id)
    }

    /// An operator drains worker `id` (the peers are told). False if there is no such worker.
    pub fn drain(&self, id: WorkerId) -> bool {
        self.shared.drain_worker(id, Announce::ToPeers)
    }

    /// An operator removes worker `id` (the peers are told): out of the router, its
    /// subscribers stopped, its cache view and series gone. False if there is no such worker.
    pub fn remove(&self, id: WorkerId) -> bool {
        self.shared.remove_worker(id, Announce::ToPeers)
    }

    /// A peer replica's change to its registry, applied here through the same paths (and not
    /// told again). A worker the peer added that this replica already has is left alone; one
    /// whose configuration is refused is logged.
    pub fn apply_peer_change(&self, change: &WorkerChange) {
        match change {
            WorkerChange::Added { config } => self.add_peers(config),
            WorkerChange::Draining { url } => {
                if let Some(id) = self.shared.find_worker(url) {
                    self.shared.drain_worker(id, Announce::No);
                }
            }
            WorkerChange::Removed { url } => {
                if let Some(id) = self.shared.find_worker(url) {
                    self.shared.remove_worker(id, Announce::No);
                    tracing::info!(url, "worker removed by a peer replica");
                }
            }
        }
    }

    fn add_peers(&self, config: &serde_json::Value) {
        let config = match serde_json::from_value::<WorkerConfig>(config.clone()) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "a peer's worker configuration was refused");
                return;
            }
        };
        if self
            .shared
            .find_worker(config.url.trim_end_matches('/'))
            .is_some()
        {
            return;
        }
        let url = config.url.clone();
        match self.add(config) {
            Ok(_) => tracing::info!(url, "worker added by a peer replica"),
            Err(e) => tracing::warn!(url, error = e, "a peer's worker was refused"),
        }
    }
}
