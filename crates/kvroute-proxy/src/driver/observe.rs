//! What the live planner observes, taken under the driver's lock: the traffic as it happens,
//! recorded by the planner's own [`Traffic`] methods (the simulator calls the same), and every
//! worker's load at a tick, from the router's books.
//!
//! Nothing is recorded until a planner asks ([`Driver::observe_traffic`]): a proxy without
//! one pays nothing per request. A latency is observed only where it is known: TTFT on
//! streamed answers (a unary answer's first byte is its last), ITL on streamed answers of two
//! tokens or more, output length from the engine's usage; and never from a worker still within
//! the warm-up. What is not known is left out, never counted as zero.

use std::time::Duration;

use kvroute_core::ids::{WorkerId, WorkerKey};
use kvroute_core::router::{Decision, WorkerRole};
use kvroute_http::openai::types::Usage;
use kvroute_planner::{Pool, Traffic, WorkerObservation, WorkerPhase, books};

use super::{Driver, DriverState};
use crate::worker::WorkerState;

/// The traffic being gathered for the planner, and its warm-up.
#[derive(Debug)]
pub(super) struct Gathering {
    pub(super) traffic: Traffic,
    warmup: Duration,
}

impl DriverState {
    /// Worker `id`'s ranks, as the router names them.
    pub(super) fn keys(&self, id: WorkerId) -> Vec<WorkerKey> {
        let ranks = self.registry.get(id).map_or(0, |w| w.config.dp_size);
        (0..ranks)
            .map(|rank| WorkerKey::new(id, kvroute_core::ids::DpRank(rank)))
            .collect()
    }

    /// Whether worker `id` has taken requests for at least the planner's warm-up.
    fn warm(&self, id: WorkerId, warmup: Duration) -> bool {
        self.registry
            .get(id)
            .and_then(|w| w.routable_since)
            .is_some_and(|since| since.elapsed() >= warmup)
    }

    /// A request of `prompt_tokens` arrived.
    pub(super) fn observe_arrival(&mut self, prompt_tokens: u64) {
        if let Some(g) = &mut self.gathering {
            g.traffic.arrival(prompt_tokens);
        }
    }

    /// A request of `blocks` full prompt blocks was routed by `decision`.
    pub(super) fn observe_routed(&mut self, decision: &Decision, blocks: u32) {
        if let Some(g) = &mut self.gathering {
            g.traffic.routed(decision, blocks);
        }
    }

    /// A streamed request's first token, `ttft` after its arrival, from `worker`.
    pub(super) fn observe_first_token(&mut self, worker: WorkerId, ttft: Duration) {
        let Some(warmup) = self.gathering.as_ref().map(|g| g.warmup) else {
            return;
        };
        let warm = self.warm(worker, warmup);
        if let Some(g) = &mut self.gathering
            && warm
        {
            g.traffic.first_token(ttft.as_secs_f64() * 1e3);
        }
    }

    /// A request completed on `worker` as the engine's `usage` says; `decode`: its
    /// first-to-last token span, when it streamed.
    pub(super) fn observe_completed(&mut self, worker: WorkerId, usage: &Usage, decode: Option<Duration>) {
        let Some(warmup) = self.gathering.as_ref().map(|g| g.warmup) else {
            return;
        };
        let warm = self.warm(worker, warmup);
        if let Some(g) = &mut self.gathering {
            let decode_ms = decode.filter(|_| warm).map(|d| d.as_secs_f64() * 1e3);
            g.traffic.completed(usage.completion_tokens, decode_ms);
            if let Some(cached) = usage.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens) {
                g.traffic.engine_reported(cached, usage.prompt_tokens);
            }
        }
    }
}

/// The planner's pool of a worker of `role`.
pub fn pool_of(role: WorkerRole) -> Pool {
    match role {
        WorkerRole::Aggregated => Pool::Agg,
        WorkerRole::Prefill => Pool::Prefill,
        WorkerRole::Decode => Pool::Decode,
    }
}

impl Driver {
    /// Starts gathering traffic for the planner, whose warm-up leaves out the latencies of a
    /// worker that has taken requests for less than `warmup`.
    pub fn observe_traffic(&self, warmup: Duration) {
        self.lock().gathering = Some(Gathering {
            traffic: Traffic::default(),
            warmup,
        });
    }

    /// The traffic gathered since the previous call (its `duration_s` is the caller's).
    pub fn take_traffic(&self) -> Traffic {
        self.lock()
            .gathering
            .as_mut()
            .map(|g| std::mem::take(&mut g.traffic))
            .unwrap_or_default()
    }

    /// Every worker in the router (taking requests, or draining) as the planner sees it, in id
    /// order: its load from the router's books (summed over its ranks) and the cached blocks
    /// only it holds; its queue as booked now. Workers out of routing (failed, misconfigured)
    /// are not the planner's capacity and are left out.
    pub fn planner_workers(&self) -> Vec<WorkerObservation> {
        self.planner_observe(&mut books::Reader::new(self.config.routing.block_size))
    }

    /// A reader of this driver's workers for one planner ([`Driver::planner_observe`]) starting
    /// now: its first tick reads each worker's mean queue since now, every worker in the
    /// registry primed with its reading now.
    pub fn planner_reader(&self) -> books::Reader {
        let now = self.now();
        let inner = self.lock();
        let mut reader = books::Reader::starting_at(self.config.routing.block_size, now);
        for (id, _) in inner.registry.iter() {
            reader.prime(&inner.router, id.0, &inner.keys(id));
        }
        reader
    }

    /// [`Driver::planner_workers`] read by the planner's `reader`: each worker's queue is its
    /// mean since the reader's previous tick. Ends the reader's tick.
    pub fn planner_observe(&self, reader: &mut books::Reader) -> Vec<WorkerObservation> {
        let now = self.now();
        let inner = self.lock();
        let mut out = Vec::new();
        for (id, w) in inner.registry.iter() {
            let state = match w.state {
                WorkerState::Ready { .. } => WorkerPhase::Ready,
                WorkerState::Draining { .. } => WorkerPhase::Draining,
                _ => continue,
            };
            out.push(reader.observe(
                &inner.router,
                now,
                id.0,
                pool_of(w.config.role()),
                state,
                &inner.keys(id),
            ));
        }
        reader.end_tick(now);
        out
    }

    /// Whether a request no worker can take waits in the queue (`when-empty = queue`, with
    /// room in it).
    pub fn queues_when_empty(&self) -> bool {
        let inner = self.lock();
        let queue = &inner.router.config().queue;
        queue.when_empty == kvroute_core::router::WhenEmpty::Queue && queue.capacity > 0
    }

    /// The driver's time now, as the router sees it.
    pub fn timestamp(&self) -> kvroute_core::time::Timestamp {
        self.now()
    }
}
