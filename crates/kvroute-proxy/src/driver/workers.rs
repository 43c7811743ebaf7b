//! The fleet: adding, draining and removing workers, their state machine's effects on the
//! router, and their registration checks.

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::router::WorkerSpec;
use kvroute_sync::WorkerChange;

use crate::checks::{self, Check, Verdict};
use crate::config::WorkerConfig;
use crate::registry::{Transition, WorkerStatus};
use crate::worker::{WorkerEvent, WorkerState};

use super::{Inner, Shared};

impl Shared {
    /// Adds a worker (all its ranks) to routing and returns its id.
    pub fn add_worker(&self, config: WorkerConfig) -> Result<WorkerId, String> {
        config
            .validate(self.config.block_size, self.config.disagg_protocol)
            .map_err(|e| e.to_string())?;
        // Told to the peers (before the registry takes it): an operator's add holds on all.
        let announced = crate::replicas::announced(&config);
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

    /// Drains a worker: it keeps its running requests and takes no new ones; once it has none
    /// it leaves the router. False if there is no such worker.
    pub fn drain_worker(&self, id: WorkerId) -> bool {
        let url = self.lock().registry.get(id).map(|w| w.base.clone());
        let done = self.worker_event(id, WorkerEvent::DrainRequested).is_some();
        if let Some(url) = url.filter(|_| done) {
            self.announce(WorkerChange::Draining { url });
        }
        done
    }

    /// Removes a worker: its requests are dropped from the router's books. False if there is no
    /// such worker.
    pub fn remove_worker(&self, id: WorkerId) -> bool {
        let url = self.lock().registry.get(id).map(|w| w.base.clone());
        let done = self.worker_event(id, WorkerEvent::Removed).is_some();
        if let Some(url) = url.filter(|_| done) {
            self.announce(WorkerChange::Removed { url });
        }
        done
    }

    /// Tells worker `id`'s state machine of `event` and carries out what its change of state
    /// means for the router; the new state, or `None` if there is no such worker. (Health
    /// checks report here; so does a request that could not connect.)
    pub fn worker_event(&self, id: WorkerId, event: WorkerEvent) -> Option<WorkerState> {
        let mut inner = self.lock();
        let t = inner.registry.apply(id, event)?;
        self.effect(&mut inner, id, t);
        inner.registry.forget(id);
        self.settle_drains(&mut inner);
        drop(inner);
        self.notify();
        Some(t.to)
    }

    /// What worker `id`'s change of state means for the router: its ranks enter it, drain, or
    /// leave it. A worker that fails its health checks leaves the fleet but keeps its cache
    /// view, which its KV events go on updating (its cache may have survived: a restart shows
    /// in its event stream and clears it); when it is back, its view is resynced through the
    /// replay socket, which fetches what was missed and tells whether the engine restarted.
    /// Any other exit forgets the view.
    fn effect(&self, inner: &mut Inner, id: WorkerId, t: Transition) {
        if t.from == t.to {
            return;
        }
        let now = self.now();
        match (t.from.in_router(), t.to.in_router()) {
            (false, true) => {
                self.enter(inner, id);
                if matches!(t.from, WorkerState::Unhealthy { .. }) {
                    self.views.resync(id);
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
    fn enter(&self, inner: &mut Inner, id: WorkerId) {
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
    fn set_up_gauge(&self, inner: &Inner, id: WorkerId, state: WorkerState) {
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
            let verdict = checks::block_size_verdict(block_size, self.config.block_size);
            self.report_check(id, Check::BlockSize, verdict);
        }
    }

    /// Tells every draining worker the router books nothing on that it is idle.
    pub(super) fn settle_drains(&self, inner: &mut Inner) {
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
                    view: self.views.summary(id, w.config.events.is_some()),
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
}
