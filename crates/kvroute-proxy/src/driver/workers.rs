//! The workers in the driver: adding, draining and removing them, their state machine's
//! effects on the router, and their registration checks' verdicts.

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::router::WorkerSpec;
use kvroute_sync::WorkerChange;

use crate::checks::{self, Check, Verdict};
use crate::config::WorkerConfig;
use crate::registry::{Subscribers, Transition, WorkerStatus};
use crate::views::WorkerViews;
use crate::worker::{WorkerEvent, WorkerState};

use super::{Driver, DriverState};

impl Driver {
    /// Adds a worker (all its ranks) to routing and returns its id: its registry entry, its
    /// ranks in the router and its series, told to the peers. Its subscribers and checks are
    /// started by the proxy's one add path ([`crate::fleet::Fleet::add`]).
    pub(crate) fn add_worker(&self, config: WorkerConfig) -> Result<WorkerId, String> {
        config
            .validate(
                self.config.routing.block_size,
                self.config.routing.disagg_protocol,
            )
            .map_err(|e| e.to_string())?;
        // Told to the peers (before the registry takes it): an operator's add holds on all.
        let announced = super::announced(&config);
        let mut inner = self.lock();
        let (ranks, base) = (config.dp_size, config.url.trim_end_matches('/').to_owned());
        let id = inner.registry.add(config);
        self.metrics.add_worker(id, ranks, &base);
        self.enter(&mut inner, id);
        self.set_up_gauge(&inner, id, WorkerState::ADDED);
        drop(inner);
        if let Some(change) = announced {
            self.announce(change);
        }
        self.notify();
        Ok(id)
    }

    /// Gives worker `id` its KV-event subscribers, which then run until it is removed (at
    /// once, if it already was).
    pub(crate) fn adopt_subscribers(&self, id: WorkerId, subscribers: Subscribers) {
        self.lock().registry.adopt(id, subscribers);
    }

    /// Stops every worker's KV-event subscribers (the proxy stops).
    pub(crate) fn stop_subscribers(&self) {
        self.lock().registry.stop_subscribers();
    }

    /// Runs `f` on worker `id`'s cache views under the lock (not at all if it is gone).
    pub(crate) fn update_views(&self, id: WorkerId, f: impl FnOnce(&mut WorkerViews)) {
        if let Some(views) = self.lock().registry.views_mut(id) {
            f(views);
        }
    }

    /// How many KV-event subscribers worker `id` has running (one per rank with an endpoint);
    /// `None` if there is no such worker.
    pub fn subscriber_count(&self, id: WorkerId) -> Option<usize> {
        self.lock().registry.get(id).map(|w| w.subscribers.len())
    }

    /// Drains a worker: it keeps its running requests and takes no new ones; once it has none
    /// it leaves the router. Told to the peers if `announce`. False if there is no such worker.
    pub(crate) fn drain_worker(&self, id: WorkerId, announce: Announce) -> bool {
        self.operator_event(id, WorkerEvent::DrainRequested, announce, |url| {
            WorkerChange::Draining { url }
        })
    }

    /// Removes a worker, and everything the proxy holds for it: its requests are dropped from
    /// the router's books, its subscribers stop, its cache view and its series go. Told to the
    /// peers if `announce`. False if there is no such worker. The one remove path: an
    /// operator's, a peer's ([`crate::fleet::Fleet`]).
    pub(crate) fn remove_worker(&self, id: WorkerId, announce: Announce) -> bool {
        self.operator_event(id, WorkerEvent::Removed, announce, |url| WorkerChange::Removed {
            url,
        })
    }

    /// An operator's `event` on worker `id` (applied as [`Self::apply_worker_event`] does),
    /// then told to the peers as `change` of its URL if `announce`.
    fn operator_event(
        &self,
        id: WorkerId,
        event: WorkerEvent,
        announce: Announce,
        change: impl FnOnce(String) -> WorkerChange,
    ) -> bool {
        let mut inner = self.lock();
        let Some(url) = inner.registry.get(id).map(|w| w.base.clone()) else {
            return false;
        };
        self.apply(&mut inner, id, event);
        drop(inner);
        self.notify();
        if announce == Announce::ToPeers {
            self.announce(change(url));
        }
        true
    }

    /// Tells worker `id`'s state machine of `event` and carries out what its change of state
    /// means for the router; the new state, or `None` if there is no such worker. (A request
    /// that could not connect reports here.)
    pub fn worker_event(&self, id: WorkerId, event: WorkerEvent) -> Option<WorkerState> {
        self.apply_worker_event(id, event).map(|t| t.to)
    }

    /// [`Self::worker_event`], returning the whole transition: read and applied under one lock
    /// (the health prober decides from it whether the registration checks are due).
    pub fn apply_worker_event(&self, id: WorkerId, event: WorkerEvent) -> Option<Transition> {
        let mut inner = self.lock();
        let t = self.apply(&mut inner, id, event);
        drop(inner);
        self.notify();
        t
    }

    /// Applies `event` to worker `id` under the lock: the pure transition ([`WorkerState::on`]),
    /// then its effects. A worker whose new state is [`WorkerState::Gone`] is forgotten, and
    /// with its entry go its subscribers and its cache views (its series went in
    /// [`Self::effect`]).
    fn apply(&self, inner: &mut DriverState, id: WorkerId, event: WorkerEvent) -> Option<Transition> {
        let t = inner.registry.apply(id, event)?;
        self.effect(inner, id, t);
        if t.to == WorkerState::Gone {
            inner.registry.forget(id);
        }
        self.settle_drains(inner);
        Some(t)
    }

    /// What worker `id`'s change of state means for the router: its ranks enter it, drain, or
    /// leave it. A worker that fails its health checks leaves the fleet but keeps its cache
    /// view, which its KV events go on updating (its cache may have survived: a restart shows
    /// in its event stream and clears it); when it is back, its view is resynced through the
    /// replay socket, which fetches what was missed and tells whether the engine restarted.
    /// Any other exit forgets the view.
    fn effect(&self, inner: &mut DriverState, id: WorkerId, t: Transition) {
        if t.from == t.to {
            return;
        }
        let now = self.now();
        match (t.from.in_router(), t.to.in_router()) {
            (false, true) => {
                self.enter(inner, id);
                if matches!(t.from, WorkerState::Unhealthy { .. })
                    && let Some(w) = inner.registry.get(id)
                {
                    w.views.resync();
                }
            }
            (_, false) => {
                let suspend = matches!(t.to, WorkerState::Unhealthy { .. });
                for rank in 0..t.ranks {
                    let key = WorkerKey::new(id, DpRank(rank));
                    let out = if suspend {
                        inner.router.handle_worker_suspended(now, key)
                    } else {
                        // Also forgets the view of a worker suspended before (an error for one
                        // that was already removed, which is ignored).
                        inner.router.handle_worker_removed(now, key)
                    };
                    if let Ok(out) = out {
                        self.dispatch(inner, out);
                    }
                }
            }
            (true, true) if matches!(t.to, WorkerState::Draining { .. }) => {
                for rank in 0..t.ranks {
                    let _ = inner
                        .router
                        .handle_worker_draining(now, WorkerKey::new(id, DpRank(rank)));
                }
            }
            _ => {}
        }
        match (t.from, t.to) {
            (WorkerState::Ready { .. }, WorkerState::Unhealthy { .. }) => {
                tracing::warn!(worker = id.0, "worker failed; out of routing");
            }
            (WorkerState::Unhealthy { .. }, WorkerState::Ready { .. }) => {
                tracing::info!(worker = id.0, "worker healthy again; back in routing");
            }
            (from, to) => tracing::debug!(worker = id.0, ?from, ?to, "worker state"),
        }
        match (t.to, inner.registry.get(id)) {
            // Removed: its series go with it (they stay, at zero if need be, until then).
            (WorkerState::Gone, Some(w)) => {
                let role = w.config.role().name();
                self.metrics.remove_worker(id, t.ranks, &w.base, role);
            }
            _ => self.set_up_gauge(inner, id, t.to),
        }
    }

    /// Puts worker `id`'s ranks in the router, with an empty cache view (or the one kept while
    /// it was unhealthy).
    fn enter(&self, inner: &mut DriverState, id: WorkerId) {
        let Some(w) = inner.registry.get(id) else { return };
        let specs: Vec<WorkerSpec> = (0..w.config.dp_size)
            .map(|rank| {
                let mut spec = WorkerSpec::new(
                    WorkerKey::new(id, DpRank(rank)),
                    w.config.role(),
                    w.config.capacity_blocks,
                );
                spec.max_requests = w.config.max_requests;
                spec
            })
            .collect();
        let now = self.now();
        for spec in specs {
            if let Ok(out) = inner.router.handle_worker_added(now, spec) {
                self.dispatch(inner, out);
            }
        }
    }

    /// `kvroute_worker_up`: 1 while the worker takes new requests.
    fn set_up_gauge(&self, inner: &DriverState, id: WorkerId, state: WorkerState) {
        if let Some(w) = inner.registry.get(id) {
            self.metrics
                .worker_up
                .with_label_values(&[id.0.to_string().as_str(), w.base.as_str()])
                .set(i64::from(state.routable()));
        }
    }

    /// A registration check's verdict on worker `id` ([`crate::checks`]): its reason is kept
    /// or cleared, said once in the log and in `kvroute_worker_misconfigured` when it changes,
    /// and the worker is misconfigured (out of routing) while any reason stands.
    pub fn report_check(&self, id: WorkerId, check: Check, verdict: Verdict) {
        let mut inner = self.lock();
        let Some(change) = inner.registry.set_verdict(id, check, verdict) else {
            return;
        };
        match &change {
            Some(reason) => tracing::warn!(
                worker = id.0,
                check = check.name(),
                reason = reason.as_str(),
                "worker misconfigured; out of routing"
            ),
            None => tracing::info!(worker = id.0, check = check.name(), "worker check passes again"),
        }
        self.metrics.set_misconfigured(id, check.name(), change.is_some());
        let misconfigured = inner.registry.get(id).is_some_and(|w| !w.problems.is_empty());
        let event = if misconfigured {
            WorkerEvent::ChecksFailed
        } else {
            WorkerEvent::ChecksPassed
        };
        if let Some(t) = inner.registry.apply(id, event) {
            self.effect(&mut inner, id, t);
        }
        drop(inner);
        self.notify();
    }

    /// Worker `id`'s KV events carry blocks of `block_size` tokens: judged against the
    /// router's ([`Check::BlockSize`]) when it changes.
    pub fn observe_event_block_size(&self, id: WorkerId, block_size: u32) {
        if self.lock().registry.note_event_block_size(id, block_size) {
            let verdict = checks::block_size_verdict(block_size, self.config.routing.block_size);
            self.report_check(id, Check::BlockSize, verdict);
        }
    }

    /// Tells every draining worker the router books nothing on that it is idle.
    pub(super) fn settle_drains(&self, inner: &mut DriverState) {
        let idle: Vec<(WorkerId, u32)> = inner
            .registry
            .draining()
            .map(|(id, w)| (id, w.config.dp_size))
            .filter(|&(id, ranks)| {
                (0..ranks).all(|rank| {
                    inner
                        .router
                        .worker_load(WorkerKey::new(id, DpRank(rank)))
                        .is_none_or(|load| load.requests == 0)
                })
            })
            .collect();
        for (id, _) in idle {
            if let Some(t) = inner.registry.apply(id, WorkerEvent::Idle) {
                self.effect(inner, id, t);
            }
        }
    }

    /// Requests the router books on worker `id` (all its ranks); `None` if there is no such
    /// worker. A worker out of the router (drained, unhealthy) books none.
    pub fn in_flight(&self, id: WorkerId) -> Option<u64> {
        let inner = self.lock();
        inner.registry.get(id)?;
        Some(u64::from(
            kvroute_planner::books::booked(&inner.router, inner.keys(id)).in_flight,
        ))
    }

    /// Every worker's id and base URL.
    pub fn worker_urls(&self) -> Vec<(WorkerId, String)> {
        self.lock()
            .registry
            .iter()
            .map(|(id, w)| (id, w.base.clone()))
            .collect()
    }

    /// The worker's configuration.
    pub fn worker_config(&self, id: WorkerId) -> Option<WorkerConfig> {
        self.lock().registry.get(id).map(|w| w.config.clone())
    }

    /// Worker `id`'s state.
    pub fn worker_state(&self, id: WorkerId) -> Option<WorkerState> {
        self.lock().registry.get(id).map(|w| w.state)
    }

    /// Every worker's status, for the admin API.
    pub fn worker_statuses(&self) -> Vec<WorkerStatus> {
        let inner = self.lock();
        let snapshot = inner.router.metrics();
        inner
            .registry
            .iter()
            .map(|(id, w)| {
                let ranks = snapshot.workers.iter().filter(|m| m.spec.key.worker == id);
                let (mut active, mut cached) = (0, 0);
                for m in ranks {
                    active += u64::from(m.load.requests);
                    cached += m.cached_blocks;
                }
                WorkerStatus {
                    id: id.0,
                    view: w.views.summary(w.config.events.is_some()),
                    config: w.config.clone(),
                    state: w.state.name(),
                    routable: w.state.routable(),
                    misconfigured: w.problems.clone(),
                    active_requests: active,
                    cached_blocks: cached,
                }
            })
            .collect()
    }

    /// Whether some worker takes requests.
    pub fn any_routable(&self) -> bool {
        self.lock().registry.any_routable()
    }

    /// Whether worker `id` has sent a KV event that stored a block (the block-size check's
    /// evidence, [`Self::observe_event_block_size`]): its event stream reaches the router.
    /// False if there is no such worker.
    pub fn has_kv_events(&self, id: WorkerId) -> bool {
        self.lock()
            .registry
            .get(id)
            .is_some_and(|w| w.event_block_size.is_some())
    }

    /// Every worker's figures for the removal order, in id order: the cached blocks that no
    /// other worker holds (the router index's `sole_blocks`, summed over its ranks) and the
    /// requests the router books on it. Walks each worker's blocks: for scale-down choices and
    /// scrapes, not the request path.
    pub fn removal_figures(&self) -> Vec<RemovalFigures> {
        let inner = self.lock();
        inner
            .registry
            .iter()
            .map(|(id, w)| {
                let keys = inner.keys(id);
                RemovalFigures {
                    id,
                    url: w.base.clone(),
                    role: w.config.role().name(),
                    state: w.state.name(),
                    cached_unique_blocks: kvroute_planner::books::sole_blocks(
                        &inner.router,
                        keys.iter().copied(),
                    ),
                    in_flight: kvroute_planner::books::booked(&inner.router, keys).in_flight,
                }
            })
            .collect()
    }
}

/// One worker's figures for the removal order ([`Driver::removal_figures`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemovalFigures {
    /// Its id.
    pub id: WorkerId,
    /// Its base URL.
    pub url: String,
    /// Its role's name.
    pub role: &'static str,
    /// Its state.
    pub state: crate::worker::StateName,
    /// Cached blocks no other worker holds (all ranks): the cache value the fleet loses with it.
    pub cached_unique_blocks: u64,
    /// Requests the router books on it (all ranks).
    pub in_flight: u32,
}

/// Whether an operator's change to a worker is told to the peer replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Announce {
    /// This replica's own change (the admin API's): the peers apply it too.
    ToPeers,
    /// A peer's change, applied here: not told again.
    No,
}
