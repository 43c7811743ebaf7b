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

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::index::IndexError;
use kvroute_core::router::{
    Decision, Output, Prompt, RejectReason, RouteOutcome, RouteRequest, Router, RouterError, WorkerSpec,
};
use kvroute_core::time::{TimeScale, Timestamp};
use kvroute_wire::{ApplyConfig, EventBatch, WireEvent};
use kvroute_zmq::SubscriberEvent;
use serde::Serialize;
use tokio::sync::oneshot;

use crate::config::{ServeConfig, WorkerConfig};
use crate::metrics::Metrics;

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

/// A worker as the proxy knows it.
#[derive(Debug)]
pub struct WorkerEntry {
    /// Its configuration.
    pub config: WorkerConfig,
    /// Its base URL without a trailing slash.
    pub base: String,
    /// Whether its ranks are in the router now.
    pub in_router: bool,
    /// Whether it was drained by an operator (it leaves routing for good).
    pub draining: bool,
    /// Whether it is counted healthy (see [`Shared::record_check`]).
    pub healthy: bool,
    /// Health checks passed in a row (counts up to `health_success_threshold` when unhealthy).
    pub checks_passed: u32,
    /// Health checks failed in a row (counts up to `health_failure_threshold` when healthy).
    pub checks_failed: u32,
}

/// A worker as the admin API lists it.
#[derive(Debug, Serialize)]
pub struct WorkerStatus {
    /// Its id.
    pub id: u64,
    /// Its configuration.
    #[serde(flatten)]
    pub config: WorkerConfig,
    /// Whether it takes requests.
    pub routable: bool,
    /// Last health check.
    pub healthy: bool,
    /// Drained by an operator.
    pub draining: bool,
    /// Requests the router books on it (all ranks).
    pub active_requests: u64,
    /// Blocks the index says it holds (all ranks).
    pub cached_blocks: u64,
}

struct Inner {
    router: Router,
    waiters: HashMap<RequestId, oneshot::Sender<Decision>>,
    workers: BTreeMap<WorkerId, WorkerEntry>,
    next_worker: u64,
}

/// State shared by every request handler and background task.
pub struct Shared {
    inner: Mutex<Inner>,
    epoch: Instant,
    next_request: AtomicU64,
    /// KV-event reports applied so far (see [`Shared::kv_reports`]).
    kv_reports: tokio::sync::watch::Sender<u64>,
    /// The metrics.
    pub metrics: Metrics,
    /// The configuration.
    pub config: ServeConfig,
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
                workers: BTreeMap::new(),
                next_worker: 0,
            }),
            epoch: Instant::now(),
            next_request: AtomicU64::new(0),
            kv_reports: tokio::sync::watch::Sender::new(0),
            metrics,
            config,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the router half-changed in a way that
        // matters more than stopping: keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
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
        let mut guard = RequestGuard {
            shared: Arc::clone(self),
            id,
            started: t0,
            first_token: false,
            prefill_reported: false,
            last_chunk: None,
            done: true,
        };
        let (outcome, t2) = {
            let mut inner = self.lock();
            let now = self.now();
            let outcome = inner.router.handle_request(now, &request);
            let t2 = Instant::now();
            match outcome {
                Ok(RouteOutcome::Routed(d)) => {
                    guard.done = false;
                    let target = inner.target(&d);
                    (Ok(Some((d, target))), t2)
                }
                Ok(RouteOutcome::Queued) => {
                    guard.done = false;
                    let (tx, rx) = oneshot::channel();
                    inner.waiters.insert(id, tx);
                    (Err(rx), t2)
                }
                Ok(RouteOutcome::Rejected(RejectReason::QueueFull)) => (Ok(None), t2),
                Ok(RouteOutcome::Rejected(_)) | Err(_) => {
                    drop(inner);
                    return Err(RouteError::NoWorker);
                }
            }
        };
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        self.metrics.overhead_block_hashing.observe(ms(t1 - t0));
        self.metrics.overhead_scheduling.observe(ms(t2 - t1));
        self.metrics.input_tokens.observe(tokens.len() as f64);
        let (decision, target) = match outcome {
            Ok(Some(routed)) => routed,
            Ok(None) => return Err(RouteError::QueueFull),
            Err(rx) => {
                let timeout = ServeConfig::ms(self.config.queue_timeout_ms);
                match tokio::time::timeout(timeout, rx).await {
                    Ok(Ok(d)) => {
                        let target = self.lock().target(&d);
                        (d, target)
                    }
                    // Timed out (the guard cancels it in the queue), or the router dropped the
                    // waiter (cannot happen while it is registered).
                    _ => return Err(RouteError::QueueTimeout),
                }
            }
        };
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

    fn lifecycle(&self, f: impl FnOnce(&mut Router, Timestamp) -> Result<Vec<Output>, RouterError>) {
        let mut inner = self.lock();
        let now = self.now();
        if let Ok(out) = f(&mut inner.router, now)
            && !out.is_empty()
        {
            self.dispatch(&mut inner, out);
        }
    }

    /// Runs the router's timers once (request expiry, queue re-check) and says when next.
    pub fn tick(&self) -> Option<Duration> {
        let mut inner = self.lock();
        let now = self.now();
        let out = inner.router.handle_tick(now);
        self.dispatch(&mut inner, out);
        inner
            .router
            .next_deadline()
            .map(|d| d.saturating_since(self.now()))
    }

    // ---- workers ----

    /// Adds a worker (all its ranks) to routing and returns its id.
    pub fn add_worker(&self, config: WorkerConfig) -> Result<WorkerId, String> {
        config
            .validate(self.config.block_size, self.config.disagg_protocol)
            .map_err(|e| e.to_string())?;
        let mut inner = self.lock();
        let id = WorkerId(inner.next_worker);
        inner.next_worker += 1;
        let base = config.url.trim_end_matches('/').to_owned();
        inner.workers.insert(
            id,
            WorkerEntry {
                config,
                base,
                in_router: false,
                draining: false,
                healthy: true,
                checks_passed: 0,
                checks_failed: 0,
            },
        );
        self.enter(&mut inner, id);
        Ok(id)
    }

    fn enter(&self, inner: &mut Inner, id: WorkerId) {
        let Some(w) = inner.workers.get(&id) else { return };
        if w.in_router || w.draining {
            return;
        }
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
        if let Some(w) = inner.workers.get_mut(&id) {
            w.in_router = true;
        }
        self.set_up_gauge(inner, id);
    }

    fn leave(&self, inner: &mut Inner, id: WorkerId) {
        let Some(w) = inner.workers.get(&id) else { return };
        if !w.in_router {
            return;
        }
        let ranks = w.config.dp_size;
        let now = self.now();
        for rank in 0..ranks {
            if let Ok(out) = inner
                .router
                .handle_worker_removed(now, WorkerKey::new(id, DpRank(rank)))
            {
                self.dispatch(inner, out);
            }
        }
        if let Some(w) = inner.workers.get_mut(&id) {
            w.in_router = false;
        }
        self.set_up_gauge(inner, id);
    }

    fn set_up_gauge(&self, inner: &Inner, id: WorkerId) {
        if let Some(w) = inner.workers.get(&id) {
            let up = w.in_router && !w.draining;
            self.metrics
                .worker_up
                .with_label_values(&[id.0.to_string().as_str(), w.base.as_str()])
                .set(i64::from(up));
        }
    }

    /// Drains a worker: it keeps its running requests and takes no new ones.
    pub fn drain_worker(&self, id: WorkerId) -> bool {
        let mut inner = self.lock();
        let Some(w) = inner.workers.get_mut(&id) else {
            return false;
        };
        w.draining = true;
        let ranks = w.config.dp_size;
        let in_router = w.in_router;
        let now = self.now();
        if in_router {
            for rank in 0..ranks {
                let _ = inner
                    .router
                    .handle_worker_draining(now, WorkerKey::new(id, DpRank(rank)));
            }
        }
        self.set_up_gauge(&inner, id);
        true
    }

    /// Removes a worker: its requests are dropped from the router's books.
    pub fn remove_worker(&self, id: WorkerId) -> Option<WorkerConfig> {
        let mut inner = self.lock();
        self.leave(&mut inner, id);
        let w = inner.workers.remove(&id)?;
        self.metrics
            .worker_up
            .with_label_values(&[id.0.to_string().as_str(), w.base.as_str()])
            .set(0);
        Some(w.config)
    }

    /// Takes a worker that could not be reached out of routing at once; it comes back after
    /// `health_success_threshold` passing health checks in a row.
    pub fn mark_unreachable(&self, id: WorkerId) {
        let mut inner = self.lock();
        if let Some(w) = inner.workers.get_mut(&id) {
            w.checks_passed = 0;
        }
        self.set_health(&mut inner, id, false);
    }

    /// Records one health check: a healthy worker leaves routing after
    /// `health_failure_threshold` failed checks in a row, an unhealthy one comes back after
    /// `health_success_threshold` passing checks in a row, so one slow answer does not drop a
    /// worker's cache view and one lucky answer does not bring a failing worker back.
    pub fn record_check(&self, id: WorkerId, passed: bool) {
        let mut inner = self.lock();
        let Some(w) = inner.workers.get_mut(&id) else {
            return;
        };
        let flip = if passed {
            w.checks_failed = 0;
            w.checks_passed = w.checks_passed.saturating_add(1);
            !w.healthy && w.checks_passed >= self.config.health_success_threshold
        } else {
            w.checks_passed = 0;
            w.checks_failed = w.checks_failed.saturating_add(1);
            w.healthy && w.checks_failed >= self.config.health_failure_threshold
        };
        if flip {
            self.set_health(&mut inner, id, passed);
        }
    }

    /// A health verdict: a failed worker leaves routing, a recovered one comes back with an
    /// empty cache view (a worker that died lost its cache).
    fn set_health(&self, inner: &mut Inner, id: WorkerId, healthy: bool) {
        let Some(w) = inner.workers.get_mut(&id) else {
            return;
        };
        if w.healthy == healthy {
            return;
        }
        w.healthy = healthy;
        if healthy {
            tracing::info!(worker = id.0, "worker healthy again; back in routing");
            self.enter(inner, id);
        } else {
            tracing::warn!(worker = id.0, "worker failed; out of routing");
            self.leave(inner, id);
        }
    }

    /// Every worker's id and base URL.
    pub fn worker_urls(&self) -> Vec<(WorkerId, String)> {
        self.lock()
            .workers
            .iter()
            .map(|(&id, w)| (id, w.base.clone()))
            .collect()
    }

    /// The worker's configuration.
    pub fn worker_config(&self, id: WorkerId) -> Option<WorkerConfig> {
        self.lock().workers.get(&id).map(|w| w.config.clone())
    }

    /// Every worker's status, for the admin API.
    pub fn worker_statuses(&self) -> Vec<WorkerStatus> {
        let inner = self.lock();
        let snapshot = inner.router.metrics();
        inner
            .workers
            .iter()
            .map(|(&id, w)| {
                let ranks = snapshot.workers.iter().filter(|m| m.spec.key.worker == id);
                let (mut active, mut cached) = (0, 0);
                for m in ranks {
                    active += u64::from(m.load.requests);
                    cached += m.cached_blocks;
                }
                WorkerStatus {
                    id: id.0,
                    config: w.config.clone(),
                    routable: w.in_router && !w.draining,
                    healthy: w.healthy,
                    draining: w.draining,
                    active_requests: active,
                    cached_blocks: cached,
                }
            })
            .collect()
    }

    /// Whether some worker takes requests.
    pub fn any_routable(&self) -> bool {
        self.lock().workers.values().any(|w| w.in_router && !w.draining)
    }

    /// The router's metrics snapshot (the gauges are refreshed from it too).
    pub fn snapshot(&self) -> kvroute_core::router::RouterMetrics {
        let snapshot = self.lock().router.metrics();
        self.metrics.refresh(&snapshot);
        snapshot
    }

    /// Checks the router's invariants (tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.lock().router.check_invariants()
    }

    // ---- KV events ----

    /// Applies what the subscriber of one rank's stream reported. A batch applies to the rank
    /// it names (the engine's publisher fills it in), else to the stream's; a restart or lost
    /// batches clear the stream's rank.
    pub fn apply_feed(&self, event: SubscriberEvent) {
        self.apply_report(event);
        self.kv_reports.send_modify(|n| *n += 1);
    }

    /// Waits until `done` holds of this state, checking it again after each KV-event report
    /// is applied (no timer polls); false if `patience` passes first. For whoever needs the
    /// router's cache view to reach some state: tests, and a caller waiting for its engines'
    /// subscribers to join.
    pub async fn wait_for_kv(&self, patience: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let mut reports = self.kv_reports.subscribe();
        let deadline = tokio::time::Instant::now() + patience;
        while !done(self) {
            if !matches!(
                tokio::time::timeout_at(deadline, reports.changed()).await,
                Ok(Ok(()))
            ) {
                return done(self);
            }
        }
        true
    }

    fn apply_report(&self, event: SubscriberEvent) {
        match event {
            SubscriberEvent::Batch { worker, batch } => self.apply_batch(batch.worker_key(worker), &batch),
            SubscriberEvent::Restarted { worker } => {
                self.metrics
                    .kv_stream_incidents
                    .with_label_values(&["restarted"])
                    .inc();
                self.clear(worker);
            }
            SubscriberEvent::GapLost { worker, missing } => {
                tracing::warn!(
                    worker = worker.worker.0,
                    rank = worker.dp_rank.0,
                    missing = missing.end.saturating_sub(missing.start),
                    "KV events lost; clearing the rank's cache view"
                );
                self.metrics
                    .kv_stream_incidents
                    .with_label_values(&["gap_lost"])
                    .inc();
                self.clear(worker);
            }
            SubscriberEvent::Error { worker, error } => {
                tracing::debug!(
                    worker = worker.worker.0,
                    rank = worker.dp_rank.0,
                    error,
                    "KV event stream error"
                );
                self.metrics
                    .kv_stream_incidents
                    .with_label_values(&["error"])
                    .inc();
            }
        }
    }

    fn clear(&self, key: WorkerKey) {
        let mut inner = self.lock();
        if !inner.workers.contains_key(&key.worker) {
            return;
        }
        let now = self.now();
        let _ = inner
            .router
            .handle_kv_event(now, key, kvroute_core::router::IndexEvent::Cleared);
    }

    fn apply_batch(&self, key: WorkerKey, batch: &EventBatch) {
        let config = ApplyConfig {
            block_size: std::num::NonZeroU32::new(self.config.block_size)
                .unwrap_or(std::num::NonZeroU32::MIN),
            namespace: None,
            group_idx: 0,
        };
        // Convert (and hash) outside the lock.
        let converted: Vec<_> = batch
            .events
            .iter()
            .map(|e| (event_type(e), e.to_kv_event(&config)))
            .collect();
        let mut inner = self.lock();
        if !inner.workers.get(&key.worker).is_some_and(|w| w.in_router) {
            return;
        }
        let now = self.now();
        for (kind, conversion) in converted {
            if conversion.skipped.is_some() {
                self.metrics.kv_events.with_label_values(&[kind, "skipped"]).inc();
            }
            let Some(event) = conversion.event else { continue };
            let status = match inner.router.handle_kv_event(now, key, event.as_index_event()) {
                Ok(()) => "ok",
                Err(RouterError::Index(IndexError::UnknownParent { .. })) => "parent_block_not_found",
                Err(RouterError::Index(IndexError::UnknownWorker(_))) => "block_not_found",
                Err(_) => "invalid_block",
            };
            self.metrics.kv_events.with_label_values(&[kind, status]).inc();
        }
    }
}

fn event_type(e: &WireEvent) -> &'static str {
    match e {
        WireEvent::BlockStored(_) => "stored",
        WireEvent::BlockRemoved(_) => "removed",
        WireEvent::AllBlocksCleared => "cleared",
        WireEvent::Unknown { .. } => "unknown",
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
        let w = self.workers.get(&key.worker);
        Upstream {
            worker: key.worker,
            dp_rank: key.dp_rank.0,
            dp: w.is_some_and(|w| w.config.dp_size > 1),
            base: w.map(|w| w.base.clone()).unwrap_or_default(),
            bootstrap_port: w.and_then(|w| w.config.bootstrap_port),
            engine: w.map(|w| w.config.engine).unwrap_or_default(),
        }
    }
}

/// Owns one routed (or queued) request's load; see the module docs.
pub struct RequestGuard {
    shared: Arc<Shared>,
    id: RequestId,
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
    /// The router's id of the request.
    pub fn id(&self) -> RequestId {
        self.id
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
        let mut inner = self.shared.lock();
        inner.waiters.remove(&id);
        let now = self.shared.now();
        if let Ok(out) = inner.router.handle_cancelled(now, id)
            && !out.is_empty()
        {
            self.shared.dispatch(&mut inner, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> (Arc<Shared>, WorkerId) {
        let config = ServeConfig::default();
        let router = Router::new(config.validate().unwrap()).unwrap();
        let shared = Shared::new(router, config, Metrics::new());
        let id = shared
            .add_worker(WorkerConfig::parse_flag("http://127.0.0.1:1").unwrap())
            .unwrap();
        (shared, id)
    }

    fn routable(shared: &Shared) -> bool {
        shared.worker_statuses()[0].routable
    }

    #[test]
    fn health_checks_flip_a_worker_only_after_enough_in_a_row() {
        // Defaults: out after 3 failed checks in a row, back after 2 passing ones in a row.
        // (checks, routable after each)
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
            shared.record_check(id, passed);
            assert_eq!(routable(&shared), want, "after check {step} ({passed})");
        }
    }

    #[test]
    fn an_unreachable_worker_leaves_at_once_and_needs_fresh_passes_to_return() {
        let (shared, id) = shared();
        shared.record_check(id, true);
        shared.mark_unreachable(id);
        assert!(!routable(&shared));
        shared.record_check(id, true);
        assert!(!routable(&shared), "a pass before the failure does not count");
        shared.record_check(id, true);
        assert!(routable(&shared));
    }
}
