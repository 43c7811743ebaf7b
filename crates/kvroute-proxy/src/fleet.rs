//! The fleet: the proxy's one door for adding and removing workers, used by start-up, the admin
//! API and peer replicas alike.
//!
//! A worker, once added, is one entry of the driver's registry ([`crate::registry`]), and that
//! entry owns everything the proxy holds for it: its state, its registration checks' verdicts,
//! its ranks' cache views, its KV-event subscribers; besides, its ranks are in the router and
//! its series in the metrics. [`Fleet::add`] makes all of these; [`Fleet::remove`] (the
//! driver's one remove path) ends all of them, whoever asks: an operator, or a peer replica
//! that an operator asked.
//!
//! [`Fleet::retire`] is the one way a worker is drained and then removed: out of routing (the
//! peers told), its requests in flight left to finish (or the drain timeout to pass), then
//! removed. Discovery ([`crate::discovery`]) retires the workers its sources stop listing this
//! way, and the planner's scale-down takes the same path.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::ids::WorkerId;
use kvroute_sync::{Secret, WorkerChange};

use crate::config::WorkerConfig;
use crate::driver::{Announce, Driver};
use crate::events::EventFeed;
use crate::health::Checker;
use crate::worker::WorkerState;

/// How [`Fleet::retire`] ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetireOutcome {
    /// Its requests in flight all ended within the drain timeout; then it was removed.
    Drained,
    /// The drain timeout passed with `in_flight` requests still booked on it; it was removed
    /// anyway (the router forgets those requests; their streams are not cut by the proxy).
    TimedOut {
        /// Requests still booked on it when the timeout passed.
        in_flight: u64,
    },
    /// There was no such worker, or it was removed by another path meanwhile.
    Gone,
}

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

    /// Retires worker `id`: drains it (out of routing, the peers told), waits until it has no
    /// request in flight or `drain_timeout` passes (woken by each change the driver reports,
    /// a request ending among them: no polling), then removes it ([`Self::remove`]). The one
    /// drain-then-remove path, for discovery and the planner's scale-down alike.
    pub async fn retire(&self, id: WorkerId, drain_timeout: Duration) -> RetireOutcome {
        if !self.drain(id) {
            return RetireOutcome::Gone;
        }
        let settled = |d: &Driver| !matches!(d.worker_state(id), Some(WorkerState::Draining { .. }));
        let drained = self.driver.wait_until(drain_timeout, settled).await;
        let in_flight = match self.driver.worker_state(id) {
            None | Some(WorkerState::Gone) => return RetireOutcome::Gone,
            Some(_) => self.driver.in_flight(id).unwrap_or(0),
        };
        if !self.remove(id) {
            return RetireOutcome::Gone;
        }
        if drained {
            RetireOutcome::Drained
        } else {
            RetireOutcome::TimedOut { in_flight }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ServeConfig;
    use crate::metrics::Metrics;
    use kvroute_core::router::Router;
    use kvroute_http::model::Model;

    /// A fleet of one worker that is never called (its ranks are only booked on).
    fn fleet() -> (Arc<Fleet>, WorkerId) {
        let config = ServeConfig::default();
        let router = Router::new(config.validate().unwrap()).unwrap();
        let driver = Driver::new(router, config, Metrics::new());
        let feed = EventFeed::start(Arc::clone(&driver));
        let checker = Checker {
            client: kvroute_http::net::client(Duration::from_secs(1)),
            model: Arc::new(Model::tiny().unwrap()),
        };
        // Added to the driver only: no registration checks against a worker that is not there.
        let id = driver
            .add_worker(WorkerConfig::parse_flag("http://127.0.0.1:1").unwrap())
            .unwrap();
        (Arc::new(Fleet::new(driver, feed, checker)), id)
    }

    #[tokio::test(start_paused = true)]
    async fn a_retired_worker_keeps_its_request_until_it_ends_and_is_removed_then() {
        let (fleet, id) = fleet();
        let (guard, target, _) = fleet.driver().route(&[1, 2, 3], None, None).await.unwrap();
        assert_eq!(target.decode.worker, id);
        let retiring = tokio::spawn({
            let fleet = Arc::clone(&fleet);
            async move { fleet.retire(id, Duration::from_secs(3600)).await }
        });
        // Draining: out of routing, its request still booked, not removed.
        let draining = |d: &Driver| matches!(d.worker_state(id), Some(WorkerState::Draining { .. }));
        assert!(fleet.driver().wait_until(Duration::from_secs(1), draining).await);
        tokio::time::advance(Duration::from_secs(600)).await;
        assert!(!retiring.is_finished(), "removed with a request in flight");
        assert_eq!(fleet.driver().in_flight(id), Some(1));
        guard.finish(None, false);
        assert_eq!(retiring.await.unwrap(), RetireOutcome::Drained);
        assert_eq!(fleet.driver().worker_state(id), None, "removed");
        fleet.driver().check_invariants().unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_retired_worker_is_removed_when_its_drain_times_out() {
        let (fleet, id) = fleet();
        let (guard, _, _) = fleet.driver().route(&[1, 2, 3], None, None).await.unwrap();
        let outcome = fleet.retire(id, Duration::from_secs(30)).await;
        assert_eq!(outcome, RetireOutcome::TimedOut { in_flight: 1 });
        assert_eq!(fleet.driver().worker_state(id), None, "removed");
        // The request's end, after its worker went, is no leak and no error.
        guard.finish(None, false);
        assert_eq!(fleet.driver().snapshot().active_now, 0);
        fleet.driver().check_invariants().unwrap();
        // Retiring it again, or a worker that never was: gone.
        assert_eq!(
            fleet.retire(id, Duration::from_secs(1)).await,
            RetireOutcome::Gone
        );
        assert_eq!(
            fleet.retire(WorkerId(99), Duration::from_secs(1)).await,
            RetireOutcome::Gone
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_worker_is_retired_at_once() {
        let (fleet, id) = fleet();
        assert_eq!(
            fleet.retire(id, Duration::from_secs(3600)).await,
            RetireOutcome::Drained
        );
        assert!(fleet.driver().worker_urls().is_empty());
    }
}
