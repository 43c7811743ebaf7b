//! The router driver: the one place the proxy touches the sans-IO [`Router`].
//!
//! The router lives behind a mutex held only for the duration of one `handle_*` call (a few
//! microseconds); prompts are tokenized and block-hashed before it is taken. Time is a monotonic
//! clock read under the lock and mapped onto [`Timestamp`] (nanoseconds since the proxy started),
//! so the router never sees time go back.
//!
//! **Invariant: load never leaks.** Every request the router knows is owned by a
//! [`RequestGuard`]. Finishing it, or dropping it on any other exit path (upstream error,
//! timeout, client disconnect, panic unwinding through the handler), tells the router, so the
//! per-worker totals return to zero when traffic stops. Requests the router drops itself (their
//! worker was removed, or they outlived the request TTL) are already freed; the guard's later
//! report is then an unknown request, which the router counts and ignores.
//!
//! **Replicas.** With a sync transport attached ([`Driver::attach_sync`]), every change the
//! router exports is handed to it when the lock is released (the lock guard drains the router's
//! outbox: no `handle_*` call can forget to), named by worker URL; an operator's add, drain or
//! remove is handed to it too. Peers' changes come back through [`Driver::apply_peer_events`],
//! a silent peer's release through [`Driver::release_peer`], and a joining peer is given
//! [`Driver::sync_snapshot`].

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{Decision, Router};
use kvroute_core::time::{TimeScale, Timestamp};
use kvroute_sync::SyncItem;
use tokio::sync::oneshot;

use crate::config::ServeConfig;
use crate::metrics::Metrics;
use crate::registry::Registry;
use crate::worker::HealthPolicy;

mod adapters;
mod guard;
mod observe;
mod replicas;
mod route;
#[cfg(test)]
mod tests;
mod workers;

pub use adapters::AdapterSet;
pub use guard::RequestGuard;
pub use observe::pool_of;
pub(crate) use replicas::announced;
pub use route::{RouteError, Routing, Target, Upstream};
pub(crate) use workers::Announce;
pub use workers::RemovalFigures;

/// The requests waiting in the router's queue ([`Driver::queued_requests`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueuedRequests {
    /// Every request waiting.
    pub total: usize,
    /// Of those, the requests waiting for want of any worker: all of them while no worker
    /// that decodes is in routing (with `when-empty = queue`), none otherwise.
    pub without_worker: usize,
}

/// What the driver's one lock guards: the router and the worker registry.
struct DriverState {
    router: Router,
    waiters: HashMap<RequestId, oneshot::Sender<Decision>>,
    registry: Registry,
    /// Traffic gathered for the live planner (none without one).
    gathering: Option<observe::Gathering>,
    /// The LoRA adapters each worker serves ([`Driver::set_adapters`]).
    adapters: std::collections::BTreeMap<WorkerId, AdapterSet>,
}

/// The router driver: the one code that touches the `Router`, shared by every request handler
/// and background task.
pub struct Driver {
    inner: Mutex<DriverState>,
    epoch: Instant,
    next_request: AtomicU64,
    /// Bumped on each change a waiter may watch (see [`Driver::wait_until`]).
    changes: tokio::sync::watch::Sender<u64>,
    /// The metrics.
    pub metrics: Metrics,
    /// The configuration.
    pub config: ServeConfig,
    /// The sync transport, where this replica's changes go to its peers (set once, when sync
    /// starts).
    sync: OnceLock<kvroute_sync::SyncTransport>,
}

/// The router and registry, locked; releasing the lock hands the router's exported changes to
/// the sync transport (see the module docs).
struct Locked<'a> {
    guard: MutexGuard<'a, DriverState>,
    driver: &'a Driver,
}

impl std::ops::Deref for Locked<'_> {
    type Target = DriverState;
    fn deref(&self) -> &DriverState {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut DriverState {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let DriverState { router, registry, .. } = &mut *self.guard;
        match self.driver.sync.get() {
            Some(sync) => {
                let out = sync.outgoing();
                while let Some(event) = router.poll_sync_event() {
                    let name = |id: WorkerId| registry.get(id).map(|w| w.base.clone());
                    if let Some(wire) = SyncItem::from_sync(&event, name) {
                        out.push(wire, event.change.urgency());
                    }
                }
            }
            // Not attached yet (starting): nobody to tell.
            None => while router.poll_sync_event().is_some() {},
        }
    }
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl Driver {
    /// A driver for `router`, with no workers yet.
    pub fn new(router: Router, config: ServeConfig, metrics: Metrics) -> Arc<Self> {
        Self::numbering_from(router, config, metrics, Arc::default())
    }

    /// [`Self::new`], its workers' ids taken from `ids` (one counter for the drivers of every
    /// model the proxy serves, so that an id names one worker).
    pub fn numbering_from(
        router: Router,
        config: ServeConfig,
        metrics: Metrics,
        ids: Arc<AtomicU64>,
    ) -> Arc<Self> {
        let policy = HealthPolicy {
            failures: config.upstream.health_failure_threshold,
            successes: config.upstream.health_success_threshold,
        };
        Arc::new(Self {
            inner: Mutex::new(DriverState {
                router,
                waiters: HashMap::new(),
                registry: Registry::numbering_from(policy, ids),
                gathering: None,
                adapters: std::collections::BTreeMap::new(),
            }),
            epoch: Instant::now(),
            next_request: AtomicU64::new(0),
            changes: tokio::sync::watch::Sender::new(0),
            metrics,
            config,
            sync: OnceLock::new(),
        })
    }

    fn lock(&self) -> Locked<'_> {
        // A panic while holding the lock cannot leave the router half-changed in a way that
        // matters more than stopping: keep serving.
        Locked {
            guard: self.inner.lock().unwrap_or_else(|p| p.into_inner()),
            driver: self,
        }
    }

    // ---- replicas ----

    fn now(&self) -> Timestamp {
        TimeScale::REAL.timestamp(self.epoch.elapsed())
    }

    /// Runs the router's timers once (request expiry, queue re-check) and says when next.
    pub fn tick(&self) -> Option<Duration> {
        let mut inner = self.lock();
        let now = self.now();
        let out = inner.router.handle_tick(now);
        self.dispatch(&mut inner, out);
        self.settle_drains(&mut inner);
        inner
            .router
            .next_deadline()
            .map(|d| d.saturating_since(self.now()))
    }

    /// The door for the proxy's other parts (the KV-event intake): runs `f` on the router at
    /// the current time, under the lock, with the registry to check membership against.
    pub(crate) fn with_router<R>(&self, f: impl FnOnce(&mut Router, Timestamp, &Registry) -> R) -> R {
        let mut inner = self.lock();
        let now = self.now();
        let DriverState { router, registry, .. } = &mut *inner;
        f(router, now, registry)
    }

    /// Says that something a waiter of [`Self::wait_until`] may watch has changed.
    pub(crate) fn notify(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Waits until `done` holds of this state, checking it again after each change the proxy
    /// reports (a KV-event report applied, a worker changing state, a request ending; no timer
    /// polls); false if `patience` passes first. For whoever needs the router to reach some
    /// state: tests, and a caller waiting for its engines' subscribers to join.
    pub async fn wait_until(&self, patience: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let mut changes = self.changes.subscribe();
        let deadline = tokio::time::Instant::now() + patience;
        while !done(self) {
            if !matches!(
                tokio::time::timeout_at(deadline, changes.changed()).await,
                Ok(Ok(()))
            ) {
                return done(self);
            }
        }
        true
    }

    /// [`Self::wait_until`], for a state of the router's cache view (woken by each KV-event
    /// report applied, among other changes).
    pub async fn wait_for_kv(&self, patience: Duration, done: impl FnMut(&Self) -> bool) -> bool {
        self.wait_until(patience, done).await
    }

    // ---- workers ----

    /// The router's metrics snapshot (the gauges are refreshed from it too).
    pub fn snapshot(&self) -> kvroute_core::router::RouterMetrics {
        let inner = self.lock();
        let snapshot = inner.router.metrics();
        let registered: Vec<(WorkerKey, &'static str)> = inner
            .registry
            .iter()
            .flat_map(|(id, w)| {
                let role = w.config.role().name();
                (0..w.config.dp_size).map(move |rank| (WorkerKey::new(id, DpRank(rank)), role))
            })
            .collect();
        drop(inner);
        self.metrics.refresh(&snapshot, &registered);
        snapshot
    }

    /// The requests waiting in the router's queue now, read live (the autoscaler's demand
    /// signal while a pool is at zero).
    pub fn queued_requests(&self) -> QueuedRequests {
        let inner = self.lock();
        QueuedRequests {
            total: inner.router.queued_now(),
            without_worker: inner.router.queued_without_worker_now(),
        }
    }

    /// Checks the router's invariants (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.lock().router.check_invariants()
    }
}
