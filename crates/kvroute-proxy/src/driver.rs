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
//! **Replicas.** With a sync transport attached ([`Shared::attach_sync`]), every change the
//! router exports is handed to it when the lock is released (the lock guard drains the router's
//! outbox: no `handle_*` call can forget to), named by worker URL; an operator's add, drain or
//! remove is handed to it too. Peers' changes come back through [`Shared::apply_peer_events`],
//! a silent peer's release through [`Shared::release_peer`], and a joining peer is given
//! [`Shared::sync_snapshot`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{
    Decision, Output, Prompt, RejectReason, RouteOutcome, RouteRequest, Router, RouterError, RouterId,
    WorkerSpec, max_cached_blocks,
};
use kvroute_core::time::{TimeScale, Timestamp};
use kvroute_sync::{LinkState, WireEvent, WorkerChange};
use tokio::sync::oneshot;

use crate::checks::{self, Check, Verdict};
use crate::config::{ServeConfig, WorkerConfig};
use crate::events::Views;
use crate::metrics::Metrics;
use crate::registry::{Registry, Transition, WorkerStatus};
use crate::worker::{HealthPolicy, WorkerEvent, WorkerState};

/// Why a request could not be routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteError {
    /// No worker can take requests (none configured, all unhealthy or draining).
    NoWorker,
    /// Every worker is busy and the queue is full.
    QueueFull,
    /// The request waited in the queue past the queue timeout.
    QueueTimeout,
}

/// What the router made of a request.
enum Admission {
    /// Sent to a worker.
    Routed(Decision, Box<Target>),
    /// Waiting in the queue for its decision.
    Queued(oneshot::Receiver<Decision>),
    /// Not taken.
    Refused(RouteError),
}

struct Inner {
    router: Router,
    waiters: HashMap<RequestId, oneshot::Sender<Decision>>,
    registry: Registry,
}

/// State shared by every request handler and background task.
pub struct Shared {
    inner: Mutex<Inner>,
    epoch: Instant,
    next_request: AtomicU64,
    /// Bumped on each change a waiter may watch (see [`Shared::wait_until`]).
    changes: tokio::sync::watch::Sender<u64>,
    /// The metrics.
    pub metrics: Metrics,
    /// The configuration.
    pub config: ServeConfig,
    /// Each worker rank's cache view: its state, and how to resync it.
    pub(crate) views: Views,
    /// The sync transport, where this replica's changes go to its peers (set once, when sync
    /// starts).
    sync: OnceLock<kvroute_sync::Sync>,
}

/// The router and registry, locked; releasing the lock hands the router's exported changes to
/// the sync transport (see the module docs).
struct Locked<'a> {
    guard: MutexGuard<'a, Inner>,
    shared: &'a Shared,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.guard
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.guard
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let Inner { router, registry, .. } = &mut *self.guard;
        match self.shared.sync.get() {
            Some(sync) => {
                let out = sync.outgoing();
                while let Some(event) = router.poll_sync_event() {
                    let name = |id: WorkerId| registry.get(id).map(|w| w.base.clone());
                    if let Some(wire) = WireEvent::from_sync(&event, name) {
                        out.push(wire);
                    }
                }
            }
            // Not attached yet (starting): nobody to tell.
            None => while router.poll_sync_event().is_some() {},
        }
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").finish_non_exhaustive()
    }
}

/// One worker rank a request is sent to.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// The worker.
    pub worker: WorkerId,
    /// The data-parallel rank.
    pub dp_rank: u32,
    /// Whether the worker has several ranks (send the rank header).
    pub dp: bool,
    /// The worker's base URL.
    pub base: String,
    /// Its SGLang bootstrap port, if configured.
    pub bootstrap_port: Option<u16>,
    /// How a request names its rank.
    pub engine: crate::config::EngineKind,
    /// The worker's configured credential.
    pub api_key: Option<String>,
    /// Whether its engine may be asked to re-announce reused blocks.
    pub reannounce: crate::config::Reannounce,
}

/// Where a routed request goes.
#[derive(Debug)]
pub struct Target {
    /// The worker that decodes it, and prefills it too unless `prefill` is set.
    pub decode: Upstream,
    /// The prefill worker of a disaggregated request (the first hop).
    pub prefill: Option<Upstream>,
}

impl Shared {
    /// A driver for `router`, with no workers yet.
    pub fn new(router: Router, config: ServeConfig, metrics: Metrics) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner {
                router,
                waiters: HashMap::new(),
                registry: Registry::new(HealthPolicy {
                    failures: config.health_failure_threshold,
                    successes: config.health_success_threshold,
                }),
            }),
            epoch: Instant::now(),
            next_request: AtomicU64::new(0),
            changes: tokio::sync::watch::Sender::new(0),
            metrics,
            config,
            views: Views::default(),
            sync: OnceLock::new(),
        })
    }

    fn lock(&self) -> Locked<'_> {
        // A panic while holding the lock cannot leave the router half-changed in a way that
        // matters more than stopping: keep serving.
        Locked {
            guard: self.inner.lock().unwrap_or_else(|p| p.into_inner()),
            shared: self,
        }
    }

    // ---- replicas ----

    /// Sends this replica's changes through `sync` from now on (once; a second transport is
    /// stopped and ignored).
    pub fn attach_sync(&self, sync: kvroute_sync::Sync) {
        if let Err(extra) = self.sync.set(sync) {
            extra.stop();
        }
    }

    /// Whether this replica is connected to its peers; `None` without sync.
    pub fn sync_link(&self) -> Option<LinkState> {
        self.sync.get().map(kvroute_sync::Sync::link)
    }

    /// Stops the sync transport, if any (the replica falls silent to its peers).
    pub fn stop_sync(&self) {
        if let Some(sync) = self.sync.get() {
            sync.stop();
        }
    }

    /// Hands an operator's registry change to the peers, if synced.
    fn announce(&self, change: WorkerChange) {
        if let Some(sync) = self.sync.get() {
            sync.outgoing().push(WireEvent::Worker(change));
        }
    }

    /// Applies peer `from`'s load changes in order (registry changes are the caller's: they
    /// start tasks). A booking on a worker this replica does not know is skipped.
    pub fn apply_peer_events(&self, from: RouterId, events: &[WireEvent]) {
        let mut inner = self.lock();
        let now = self.now();
        let mut out = Vec::new();
        for wire in events {
            let Inner { router, registry, .. } = &mut *inner;
            let Some(event) = wire.to_sync(from, |url| registry.find(url)) else {
                continue;
            };
            if let Ok(o) = router.handle_sync_event(now, &event) {
                out.extend(o);
            }
        }
        self.dispatch(&mut inner, out);
        self.settle_drains(&mut inner);
        drop(inner);
        self.notify();
    }

    /// Releases every booking of peer `peer` at once.
    pub fn release_peer(&self, peer: RouterId) {
        let mut inner = self.lock();
        let now = self.now();
        let out = inner.router.handle_peer_lost(now, peer);
        self.dispatch(&mut inner, out);
        self.settle_drains(&mut inner);
        drop(inner);
        self.notify();
    }

    /// This replica's state for a joining peer: its registry (every worker an operator has not
    /// removed, with its drain) and its in-flight bookings.
    pub fn sync_snapshot(&self) -> Vec<WireEvent> {
        let inner = self.lock();
        let mut events = Vec::new();
        for (_, w) in inner.registry.iter() {
            if matches!(w.state, WorkerState::Gone) {
                continue;
            }
            let Ok(config) = serde_json::to_value(&w.config) else {
                continue;
            };
            events.push(WireEvent::Worker(WorkerChange::Added { config }));
            if matches!(w.state, WorkerState::Draining { .. } | WorkerState::Drained) {
                events.push(WireEvent::Worker(WorkerChange::Draining { url: w.base.clone() }));
            }
        }
        let name = |id: WorkerId| inner.registry.get(id).map(|w| w.base.clone());
        events.extend(
            inner
                .router
                .sync_snapshot()
                .iter()
                .filter_map(|e| WireEvent::from_sync(e, name)),
        );
        events
    }

    /// The worker at base URL `url` (no trailing slash), if any.
    pub fn find_worker(&self, url: &str) -> Option<WorkerId> {
        self.lock().registry.find(url)
    }

    /// A peer's drain or removal of a worker (not announced again). Adds are the caller's.
    pub fn apply_peer_worker_change(&self, change: &WorkerChange) {
        let (url, event) = match change {
            WorkerChange::Draining { url } => (url, WorkerEvent::DrainRequested),
            WorkerChange::Removed { url } => (url, WorkerEvent::Removed),
            WorkerChange::Added { .. } => return,
        };
        if let Some(id) = self.find_worker(url) {
            self.worker_event(id, event);
        }
    }

    fn now(&self) -> Timestamp {
        TimeScale::REAL.timestamp(self.epoch.elapsed())
    }

    /// Routes a prompt of `tokens` (salted by `cache_salt`). Waits in the queue if every worker
    /// is busy. The returned guard owns the request's load.
    pub async fn route(
        self: &Arc<Self>,
        tokens: &[u32],
        cache_salt: Option<&str>,
    ) -> Result<(RequestGuard, Target, Decision), RouteError> {
        let t0 = Instant::now();
        let salt = HashSalt {
            lora_name: None,
            namespace: cache_salt,
        };
        let locals = BlockHasher::new(self.config.block_size as usize, &salt).local_hashes(tokens);
        let t1 = Instant::now();
        let id = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let request = RouteRequest::new(
            id,
            Prompt::Blocks {
                locals: &locals,
                prompt_tokens: tokens.len() as u64,
            },
        );
        let admission = self.admit(&request);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        self.metrics.overhead_block_hashing.observe(ms(t1 - t0));
        self.metrics.overhead_scheduling.observe(ms(t1.elapsed()));
        self.metrics.input_tokens.observe(tokens.len() as f64);
        let (decision, target, guard) = match admission {
            Admission::Routed(decision, target) => (decision, *target, RequestGuard::new(self, id, t0)),
            Admission::Queued(rx) => {
                // The guard owns the queued request: a timeout (or the handler going away)
                // cancels it in the queue.
                let guard = RequestGuard::new(self, id, t0);
                let timeout = ServeConfig::ms(self.config.queue_timeout_ms);
                let Ok(Ok(decision)) = tokio::time::timeout(timeout, rx).await else {
                    // Timed out, or the router dropped the waiter (cannot happen while it is
                    // registered).
                    return Err(RouteError::QueueTimeout);
                };
                let target = self.lock().target(&decision);
                (decision, target, guard)
            }
            Admission::Refused(e) => return Err(e),
        };
        let predicted = predicted_cached_tokens(&decision, tokens.len(), self.config.block_size);
        self.metrics.record_prediction(decision.worker, predicted);
        let mut guard = guard;
        guard.routed = Some((decision.worker, predicted));
        self.metrics.router_requests.inc();
        if decision.prefill.is_some() {
            self.metrics.disaggregated_requests.inc();
        }
        if !locals.is_empty() {
            self.metrics
                .kv_hit_rate
                .observe(f64::from(decision.overlap_blocks) / locals.len() as f64);
        }
        Ok((guard, target, decision))
    }

    /// Hands `request` to the router.
    fn admit(&self, request: &RouteRequest<'_>) -> Admission {
        let mut inner = self.lock();
        let now = self.now();
        match inner.router.handle_request(now, request) {
            Ok(RouteOutcome::Routed(d)) => {
                let target = Box::new(inner.target(&d));
                Admission::Routed(d, target)
            }
            Ok(RouteOutcome::Queued) => {
                let (tx, rx) = oneshot::channel();
                inner.waiters.insert(request.id, tx);
                Admission::Queued(rx)
            }
            Ok(RouteOutcome::Rejected(RejectReason::QueueFull)) => Admission::Refused(RouteError::QueueFull),
            Ok(RouteOutcome::Rejected(_)) | Err(_) => Admission::Refused(RouteError::NoWorker),
        }
    }

    /// Routes the outputs of an input that freed capacity: released requests go to their
    /// waiting handlers (or are cancelled if the handler has gone).
    fn dispatch(&self, inner: &mut Inner, outputs: Vec<Output>) {
        let mut pending = outputs;
        while let Some(out) = pending.pop() {
            if let Output::Routed(d) = out {
                let delivered = match inner.waiters.remove(&d.request) {
                    Some(tx) => tx.send(d).is_ok(),
                    None => false,
                };
                if !delivered {
                    let now = self.now();
                    if let Ok(more) = inner.router.handle_cancelled(now, d.request) {
                        pending.extend(more);
                    }
                }
            }
        }
    }

    /// Reports a step of a request's life to the router. Its end may leave a draining worker
    /// idle, and is a change [`Self::wait_until`] wakes on.
    fn lifecycle(&self, f: impl FnOnce(&mut Router, Timestamp) -> Result<Vec<Output>, RouterError>) {
        let mut inner = self.lock();
        let now = self.now();
        if let Ok(out) = f(&mut inner.router, now)
            && !out.is_empty()
        {
            self.dispatch(&mut inner, out);
        }
        self.settle_drains(&mut inner);
        drop(inner);
        self.notify();
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
        let Inner { router, registry, .. } = &mut *inner;
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

    /// Adds a worker (all its ranks) to routing and returns its id.
    pub fn add_worker(&self, config: WorkerConfig) -> Result<WorkerId, String> {
        config
            .validate(self.config.block_size, self.config.disagg_protocol)
            .map_err(|e| e.to_string())?;
        // Told to the peers (before the registry takes it): an operator's add holds on all.
        let announced = serde_json::to_value(&config).ok();
        let mut inner = self.lock();
        let (ranks, base) = (config.dp_size, config.url.trim_end_matches('/').to_owned());
        let id = inner.registry.add(config);
        self.metrics.add_worker(id, ranks, &base);
        self.enter(&mut inner, id);
        self.set_up_gauge(&inner, id, WorkerState::ADDED);
        drop(inner);
        if let Some(config) = announced {
            self.announce(WorkerChange::Added { config });
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
    fn settle_drains(&self, inner: &mut Inner) {
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

    /// Checks the router's invariants (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.lock().router.check_invariants()
    }
}

impl Inner {
    fn target(&self, d: &Decision) -> Target {
        Target {
            decode: self.upstream(d.worker),
            prefill: d.prefill.map(|p| self.upstream(p.worker)),
        }
    }

    fn upstream(&self, key: WorkerKey) -> Upstream {
        let w = self.registry.get(key.worker);
        Upstream {
            worker: key.worker,
            dp_rank: key.dp_rank.0,
            dp: w.is_some_and(|w| w.config.dp_size > 1),
            base: w.map(|w| w.base.clone()).unwrap_or_default(),
            bootstrap_port: w.and_then(|w| w.config.bootstrap_port),
            engine: w.map(|w| w.config.engine).unwrap_or_default(),
            api_key: w.and_then(|w| w.config.api_key.clone()),
            reannounce: w.map(|w| w.config.reannounce).unwrap_or_default(),
        }
    }
}

/// The prompt tokens an engine should report cached for `decision`'s prompt of
/// `prompt_tokens` tokens: the router's overlap on the chosen worker in tokens, within the
/// engine's hit ceiling ([`max_cached_blocks`]).
fn predicted_cached_tokens(decision: &Decision, prompt_tokens: usize, block_size: u32) -> u64 {
    let block_size = u64::from(block_size);
    let blocks = u64::from(decision.overlap_blocks).min(max_cached_blocks(prompt_tokens as u64, block_size));
    blocks * block_size
}

/// Owns one routed (or queued) request's load; see the module docs.
pub struct RequestGuard {
    shared: Arc<Shared>,
    id: RequestId,
    /// The worker rank it was routed to, and the prompt tokens predicted cached there (`None`
    /// while it waits in the queue).
    routed: Option<(WorkerKey, u64)>,
    started: Instant,
    first_token: bool,
    prefill_reported: bool,
    last_chunk: Option<Instant>,
    done: bool,
}

impl std::fmt::Debug for RequestGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestGuard")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RequestGuard {
    fn new(shared: &Arc<Shared>, id: RequestId, started: Instant) -> Self {
        Self {
            shared: Arc::clone(shared),
            id,
            routed: None,
            started,
            first_token: false,
            prefill_reported: false,
            last_chunk: None,
            done: false,
        }
    }

    /// The router's id of the request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The worker rank the request was routed to (its decode worker), and the prompt tokens
    /// predicted cached there; `None` before it is routed.
    pub fn routed(&self) -> Option<(WorkerKey, u64)> {
        self.routed
    }

    /// The driver the request belongs to.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// A disaggregated request's prefill worker answered (its first token is out, the prompt's
    /// KV is ready to move): the router frees the prefill worker's share, as it does on the
    /// first token. The client's time to first token is still measured to [`Self::chunk`].
    pub fn prefill_done(&mut self) {
        if !self.prefill_reported {
            self.prefill_reported = true;
            let id = self.id;
            self.shared.lifecycle(|r, t| r.handle_first_token(t, id));
        }
    }

    /// A chunk of the response arrived: the first marks prefill done (unless
    /// [`Self::prefill_done`] did) and the time to first token; `streaming` chunks after it are
    /// inter-token latencies.
    pub fn chunk(&mut self, streaming: bool) {
        let now = Instant::now();
        if !self.first_token {
            self.first_token = true;
            if streaming {
                self.shared
                    .metrics
                    .ttft
                    .observe((now - self.started).as_secs_f64());
            }
            self.prefill_done();
        } else if streaming && let Some(last) = self.last_chunk {
            self.shared.metrics.itl.observe((now - last).as_secs_f64());
        }
        self.last_chunk = Some(now);
    }

    /// The response ended: the request is finished.
    pub fn finish(mut self) {
        self.done = true;
        let id = self.id;
        self.shared.lifecycle(|r, t| r.handle_finished(t, id));
    }

    /// The request is given up (before it reached a worker); the same as dropping the guard.
    pub fn cancel(self) {}
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let id = self.id;
        self.shared.lock().waiters.remove(&id);
        self.shared.lifecycle(|r, t| r.handle_cancelled(t, id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::StateName;

    fn shared() -> (Arc<Shared>, WorkerId) {
        let config = ServeConfig::default();
        let router = Router::new(config.validate().unwrap()).unwrap();
        let shared = Shared::new(router, config, Metrics::new());
        let id = shared
            .add_worker(WorkerConfig::parse_flag("http://127.0.0.1:1").unwrap())
            .unwrap();
        (shared, id)
    }

    fn state(shared: &Shared) -> StateName {
        shared.worker_statuses()[0].state
    }

    fn check(passed: bool) -> WorkerEvent {
        if passed {
            WorkerEvent::CheckPassed
        } else {
            WorkerEvent::CheckFailed
        }
    }

    #[test]
    fn health_checks_flip_a_worker_only_after_enough_in_a_row() {
        // Defaults: out after 3 failed checks in a row, back after 2 passing ones in a row.
        // (check passed, routable after it)
        let script: &[(bool, bool)] = &[
            (false, true),
            (false, true),
            (true, true), // the streak of failures is broken
            (false, true),
            (false, true),
            (false, false), // third in a row: out
            (true, false),
            (false, false), // the streak of passes is broken
            (true, false),
            (true, true), // second in a row: back
            (true, true),
        ];
        let (shared, id) = shared();
        for (step, &(passed, want)) in script.iter().enumerate() {
            shared.worker_event(id, check(passed));
            assert_eq!(shared.any_routable(), want, "after check {step} ({passed})");
            assert_eq!(
                shared.snapshot().workers.len(),
                usize::from(want),
                "in the router"
            );
        }
    }

    #[test]
    fn an_unreachable_worker_leaves_at_once_and_needs_fresh_passes_to_return() {
        let (shared, id) = shared();
        shared.worker_event(id, WorkerEvent::CheckPassed);
        shared.worker_event(id, WorkerEvent::Unreachable);
        assert_eq!(state(&shared), StateName::Unhealthy);
        shared.worker_event(id, WorkerEvent::CheckPassed);
        assert_eq!(
            state(&shared),
            StateName::Unhealthy,
            "a pass before the failure does not count"
        );
        shared.worker_event(id, WorkerEvent::CheckPassed);
        assert_eq!(state(&shared), StateName::Ready);
    }

    #[tokio::test(start_paused = true)]
    async fn a_draining_worker_keeps_its_requests_and_leaves_when_it_has_none() {
        let (shared, id) = shared();
        let (guard, target, _) = shared.route(&[1, 2, 3], None).await.unwrap();
        assert_eq!(target.decode.worker, id);
        assert!(shared.drain_worker(id));
        assert_eq!(state(&shared), StateName::Draining);
        assert_eq!(shared.worker_statuses()[0].active_requests, 1);
        assert_eq!(shared.route(&[4], None).await.unwrap_err(), RouteError::NoWorker);
        guard.finish();
        assert_eq!(state(&shared), StateName::Drained);
        assert!(shared.snapshot().workers.is_empty(), "out of the router");
        assert!(shared.remove_worker(id));
        assert!(shared.worker_statuses().is_empty());
        assert!(!shared.remove_worker(id));
        shared.check_invariants().unwrap();
    }
}
