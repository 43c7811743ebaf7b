//! Routing a request: admission, the queue's waiters, the request's life reported to the router,
//! and where a routed request goes.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvroute_core::hash::{HashSalt, PromptHasher, PromptHashes};
use kvroute_core::ids::{RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{
    Decision, Output, Prompt, RejectReason, RouteOutcome, RouteRequest, Router, RouterError, SessionId,
    TenantId, max_cached_blocks,
};
use kvroute_core::time::Timestamp;
use kvroute_http::openai::KvCacheReport;
use kvroute_http::prefix_cache::Turn;
use tokio::sync::oneshot;

use crate::config::ServeConfig;
use crate::registry::WorkerUrls;

use super::{Driver, DriverState, RequestGuard};

/// A prompt's hashes as the driver hands them to the router.
enum Hashed {
    /// All its hashes, kept in the conversation cache too.
    Kept(PromptHashes),
    /// Its blocks' local hashes, which the router chains.
    Locals(Vec<kvroute_core::ids::LocalBlockHash>),
}

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

/// One worker rank a request is sent to.
#[derive(Clone, Debug)]
pub struct Upstream {
    /// The worker.
    pub worker: WorkerId,
    /// The data-parallel rank.
    pub dp_rank: u32,
    /// Whether the worker has several ranks (send the rank header).
    pub dp: bool,
    /// The worker's base URL and its endpoints' URLs.
    pub urls: Arc<WorkerUrls>,
    /// Its SGLang bootstrap port, if configured.
    pub bootstrap_port: Option<u16>,
    /// How a request names its rank.
    pub engine: crate::config::EngineKind,
    /// The worker's configured credential.
    pub api_key: Option<String>,
    /// Whether its engine may be asked to re-announce reused blocks.
    pub reannounce: crate::config::Reannounce,
    /// What a request sent there asks of its engine's KV events: `Full` while the rank's view
    /// is rebuilt after lost batches, within `reannounce-window-ms`, if `reannounce` allows it
    /// (decided when the request is routed).
    pub kv_cache_report: KvCacheReport,
}

/// Where a routed request goes.
#[derive(Debug)]
pub struct Target {
    /// The worker that decodes it, and prefills it too unless `prefill` is set.
    pub decode: Upstream,
    /// The prefill worker of a disaggregated request (the first hop).
    pub prefill: Option<Upstream>,
}

/// What the router reads of a request besides its prompt and salt: its LoRA adapter, its tenant
/// and queue priority (the router's convention: higher first), its conversation (the session
/// header's), kept on its worker by the router's session rule, and its place in the
/// conversation cache.
#[derive(Clone, Copy, Debug)]
pub struct Routing<'a> {
    /// The LoRA adapter it runs under, which only the workers serving it may take.
    pub lora_name: Option<&'a str>,
    /// The tenant charged for it in the fair share.
    pub tenant: TenantId,
    /// Its queue priority, higher first.
    pub priority: i32,
    /// Its session, if it carries one.
    pub session: Option<SessionId>,
    /// A chat prompt's place in the conversation cache: the block hashes kept for the prefix
    /// it continues (only the blocks past them are hashed), and where the prompt's are kept for
    /// the next turn.
    pub turn: Option<&'a Turn>,
}

impl Default for Routing<'_> {
    /// No adapter, no configured tenant, priority 0, no session.
    fn default() -> Self {
        Self {
            lora_name: None,
            tenant: TenantId::OTHER,
            priority: 0,
            session: None,
            turn: None,
        }
    }
}

impl Driver {
    /// Routes a prompt of `tokens` (salted by `cache_salt`, run under LoRA adapter `lora_name`,
    /// which only the workers serving it may take). Waits in the queue if every worker
    /// is busy, or, with `when-empty = queue`, if no worker can take it (until one is added or
    /// back in routing); `queue-timeout-ms` bounds the wait. The returned guard owns the
    /// request's load.
    pub async fn route(
        self: &Arc<Self>,
        tokens: &[u32],
        cache_salt: Option<&str>,
        lora_name: Option<&str>,
    ) -> Result<(RequestGuard, Target, Decision), RouteError> {
        let routing = Routing {
            lora_name,
            ..Routing::default()
        };
        self.route_as(tokens, cache_salt, routing).await
    }

    /// [`Self::route`] for a request of `routing`'s adapter, tenant, priority and session.
    pub async fn route_as(
        self: &Arc<Self>,
        tokens: &[u32],
        cache_salt: Option<&str>,
        routing: Routing<'_>,
    ) -> Result<(RequestGuard, Target, Decision), RouteError> {
        let t0 = Instant::now();
        let salt = HashSalt {
            lora_name: routing.lora_name,
            namespace: cache_salt,
        };
        let hasher = PromptHasher::new(self.config.routing.block_size as usize, &salt);
        // Hashed outside the router's lock. A chat prompt is hashed after its cached prefix's
        // kept hashes (hashes kept under another salt or block size are not used), its own kept
        // for the next turn, and reaches the router whole (`Prompt::Continues` with nothing
        // left to hash); any other prompt's local hashes are chained by the router.
        let hashed = match routing.turn {
            Some(turn) => Hashed::Kept(turn.hashes(&hasher, tokens)),
            None => Hashed::Locals(hasher.local_hashes(tokens)),
        };
        let t1 = Instant::now();
        let id = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let (prompt, blocks) = match &hashed {
            Hashed::Kept(hashes) => (
                Prompt::Continues {
                    tokens,
                    earlier: hashes,
                },
                hashes.blocks(),
            ),
            Hashed::Locals(locals) => (
                Prompt::Blocks {
                    locals,
                    prompt_tokens: tokens.len() as u64,
                },
                locals.len(),
            ),
        };
        let request = RouteRequest {
            lora_name: routing.lora_name,
            // The salt the kept hashes were made under (a local hash comes salted).
            cache_salt,
            tenant: routing.tenant,
            priority: routing.priority,
            session: routing.session,
            ..RouteRequest::new(id, prompt)
        };
        let admission = self.admit(&request, tokens.len() as u64, blocks as u32);
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
                // A change `wait_until` may watch (the queue grew).
                self.notify();
                let timeout = ServeConfig::ms(self.config.routing.queue_timeout_ms);
                let Ok(Ok(decision)) = tokio::time::timeout(timeout, rx).await else {
                    // Timed out, or the router dropped the waiter (cannot happen while it is
                    // registered).
                    return Err(RouteError::QueueTimeout);
                };
                let mut inner = self.lock();
                inner.observe_routed(&decision, blocks as u32);
                let target = inner.target(&decision, self.reannounce_window());
                drop(inner);
                (decision, target, guard)
            }
            Admission::Refused(e) => return Err(e),
        };
        let predicted = predicted_cached_tokens(&decision, tokens.len(), self.config.routing.block_size);
        self.metrics.record_prediction(decision.worker, predicted);
        let mut guard = guard;
        guard.routed = Some((decision.worker, predicted));
        self.metrics.router_requests.inc();
        if decision.prefill.is_some() {
            self.metrics.disaggregated_requests.inc();
        }
        if blocks > 0 {
            self.metrics
                .kv_hit_rate
                .observe(f64::from(decision.overlap_blocks) / blocks as f64);
        }
        Ok((guard, target, decision))
    }

    /// Requests waiting in the router's queue per tenant.
    pub fn queued_per_tenant(&self) -> Vec<(TenantId, usize)> {
        self.lock().router.queued_per_tenant()
    }

    /// The tenants' virtual token counters (the queue's fair share).
    pub fn fair_counters(&self) -> Vec<(TenantId, f64)> {
        self.lock().router.fair_counters()
    }

    /// `reannounce-window-ms`.
    fn reannounce_window(&self) -> Duration {
        ServeConfig::ms(self.config.routing.reannounce_window_ms)
    }

    /// Hands `request`, of `prompt_tokens` in `blocks` full blocks, to the router.
    fn admit(&self, request: &RouteRequest<'_>, prompt_tokens: u64, blocks: u32) -> Admission {
        let mut inner = self.lock();
        let now = self.now();
        inner.observe_arrival(prompt_tokens);
        match inner.router.handle_request(now, request) {
            Ok(RouteOutcome::Routed(d)) => {
                inner.observe_routed(&d, blocks);
                let target = Box::new(inner.target(&d, self.reannounce_window()));
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
    pub(super) fn dispatch(&self, inner: &mut DriverState, outputs: Vec<Output>) {
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
    pub(super) fn lifecycle(
        &self,
        f: impl FnOnce(&mut Router, Timestamp) -> Result<Vec<Output>, RouterError>,
    ) {
        self.lifecycle_observed(f, |_| {});
    }

    /// [`Self::lifecycle`], with what the planner observes of that step taken under the same
    /// lock.
    pub(super) fn lifecycle_observed(
        &self,
        f: impl FnOnce(&mut Router, Timestamp) -> Result<Vec<Output>, RouterError>,
        observe: impl FnOnce(&mut DriverState),
    ) {
        let mut inner = self.lock();
        observe(&mut inner);
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
}
impl DriverState {
    /// Where decision `d` sends its request; `window`: how long after a view was cleared its
    /// requests ask for re-announcements.
    fn target(&self, d: &Decision, window: Duration) -> Target {
        Target {
            decode: self.upstream(d.worker, window),
            prefill: d.prefill.map(|p| self.upstream(p.worker, window)),
        }
    }

    fn upstream(&self, key: WorkerKey, window: Duration) -> Upstream {
        let w = self.registry.get(key.worker);
        Upstream {
            worker: key.worker,
            dp_rank: key.dp_rank.0,
            dp: w.is_some_and(|w| w.config.dp_size > 1),
            urls: w.map(|w| Arc::clone(&w.urls)).unwrap_or_default(),
            bootstrap_port: w.and_then(|w| w.config.bootstrap_port),
            engine: w.map(|w| w.config.engine).unwrap_or_default(),
            api_key: w.and_then(|w| w.config.api_key.clone()),
            reannounce: w.map(|w| w.config.reannounce).unwrap_or_default(),
            kv_cache_report: w.map_or(KvCacheReport::Incremental, |w| {
                w.views
                    .kv_cache_report(key.dp_rank, w.config.engine, w.config.reannounce, window)
            }),
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
