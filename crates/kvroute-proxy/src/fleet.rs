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
use kvroute_sync::{Secret, WorkerChange};

use crate::config::WorkerConfig;
use crate::driver::{Announce, Driver};
use crate::events::EventFeed;
use crate::health::Checker;

/// See the module docs.
pub struct Fleet {
    driver: Arc<Driver>,
    feed: EventFeed,
    checker: Checker,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

impl Fleet {
    /// The fleet of `driver`'s workers: their KV events applied by `feed`, their registration
    /// checks run by `checker`.
    pub fn new(driver: Arc<Driver>, feed: EventFeed, checker: Checker) -> Self {
        Self {
            driver,
            feed,
            checker,
        }
    }

    /// The driver.
    pub fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }

    /// The registration checks' runner.
    pub fn checker(&self) -> &Checker {
        &self.checker
    }

    /// Adds a worker and returns its id: it enters routing, its KV-event subscribers start
    /// (one per rank), its registration checks run, and the peers are told.
    pub fn add(&self, config: WorkerConfig) -> Result<WorkerId, String> {
        let id = self.driver.add_worker(config.clone())?;
        self.driver
            .adopt_subscribers(id, self.feed.subscribe(id, &config));
        self.checker.spawn(&self.driver, id);
        Ok(id)
    }

    /// An operator drains worker `id` (the peers are told). False if there is no such worker.
    pub fn drain(&self, id: WorkerId) -> bool {
        self.driver.drain_worker(id, Announce::ToPeers)
    }

    /// An operator removes worker `id` (the peers are told): out of the router, its
    /// subscribers stopped, its cache view and series gone. False if there is no such worker.
    pub fn remove(&self, id: WorkerId) -> bool {
        self.driver.remove_worker(id, Announce::ToPeers)
    }

    /// A peer replica's change to its registry, applied here through the same paths (and not
    /// told again). A worker the peer added that this replica already has is left alone; one
    /// whose configuration is refused, or that needs a credential this replica lacks, is
    /// logged. `peer_key` is `peer-worker-api-key`: a replica's own `[[worker]]` table for the URL comes first.
    pub fn apply_peer_change(&self, change: &WorkerChange, peer_key: Option<&Secret>) {
        match change {
            WorkerChange::Added { config, credential } => {
                self.add_peers(config, *credential, peer_key);
            }
            WorkerChange::Draining { url } => {
                if let Some(id) = self.driver.find_worker(url) {
                    self.driver.drain_worker(id, Announce::No);
                }
            }
            WorkerChange::Removed { url } => {
                if let Some(id) = self.driver.find_worker(url) {
                    self.driver.remove_worker(id, Announce::No);
                    tracing::info!(url, "worker removed by a peer replica");
                }
            }
        }
    }

    fn add_peers(&self, config: &serde_json::Value, credential: bool, peer_key: Option<&Secret>) {
        let mut config = match serde_json::from_value::<WorkerConfig>(config.clone()) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "a peer's worker configuration was refused");
                return;
            }
        };
        if self
            .driver
            .find_worker(config.url.trim_end_matches('/'))
            .is_some()
        {
            return;
        }
        let url = config.url.clone();
        config.api_key = match resolve_credential(&self.driver.config.workers, peer_key, &url, credential) {
            Ok(key) => key,
            Err(e) => {
                tracing::warn!(url, "a peer's worker was refused: {e}");
                return;
            }
        };
        match self.add(config) {
            Ok(_) => tracing::info!(url, "worker added by a peer replica"),
            Err(e) => tracing::warn!(url, error = e, "a peer's worker was refused"),
        }
    }
}

/// The credential this replica calls a peer's worker at `url` with: the `api-key` of its own
/// `[[worker]]` table for that URL in `own` (none if the table has none), else, when the peer
/// calls it with one (`credential`), `peer_key` (`peer-worker-api-key`); an error when the
/// peer does and this replica has none. Replicas never send each other a credential.
pub(crate) fn resolve_credential(
    own: &[WorkerConfig],
    peer_key: Option<&Secret>,
    url: &str,
    credential: bool,
) -> Result<Option<String>, String> {
    let base = url.trim_end_matches('/');
    match (own.iter().find(|w| w.url.trim_end_matches('/') == base), peer_key) {
        (Some(table), _) => Ok(table.api_key.clone()),
        (None, _) if !credential => Ok(None),
        (None, Some(key)) => Ok(Some(key.expose().to_owned())),
        (None, None) => Err(
            "its peer calls its engine with a credential (api-key), which replicas \
             never send each other, and this replica has none for it: set \
             peer-worker-api-key-file, or give the worker a [[worker]] table with its api-key"
                .to_owned(),
        ),
    }
}
