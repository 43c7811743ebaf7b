//! What the planner is handed at a tick: the traffic since the previous one, recorded by one
//! set of methods that the simulator and the live proxy both call, and every worker with its
//! load; and the order in which workers are cheapest to remove.

use serde::Serialize;

use crate::config::Pool;
use crate::model::PassSample;

/// Traffic over a window, as sums and counts (so windows merge by adding).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Traffic {
    /// Seconds the window covers.
    pub duration_s: f64,
    /// Requests that arrived (offered load).
    pub requests: u64,
    /// Prompt tokens of those requests.
    pub isl_sum: f64,
    /// Output tokens of the requests that completed in the window ...
    pub osl_sum: f64,
    /// ... and how many completed.
    pub completed: u64,
    /// TTFT of the requests whose first token came in the window, ms, summed ...
    pub ttft_sum_ms: f64,
    /// ... and how many.
    pub ttft_n: u64,
    /// Mean inter-token latency of the requests that completed in the window, ms, summed ...
    pub itl_sum_ms: f64,
    /// ... and how many.
    pub itl_n: u64,
    /// Router-predicted hit rate of the requests routed in the window (overlap blocks / prompt
    /// blocks, one value per request), summed ...
    pub hit_sum: f64,
    /// ... and how many (requests with no full prompt block are left out).
    pub hit_n: u64,
    /// Prompt tokens the engines reported cached, of the completed requests whose usage said
    /// (a live fleet's engines; the simulator's do not report per request) ...
    pub engine_cached_tokens: u64,
    /// ... of these prompt tokens.
    pub engine_prompt_tokens: u64,
}

impl Traffic {
    /// A request arrived with a prompt of `isl` tokens (offered load, counted at arrival).
    pub fn arrival(&mut self, isl: u64) {
        self.requests += 1;
        self.isl_sum += isl as f64;
    }

    /// A request of `blocks` full prompt blocks was routed by `decision`: its hit rate is the
    /// overlap of the worker that prefills it (the one whose work the cache saves). A prompt
    /// without a full block says nothing of reuse and is left out.
    pub fn routed(&mut self, decision: &kvroute_core::router::Decision, blocks: u32) {
        let overlap = decision
            .prefill
            .map_or(decision.overlap_blocks, |p| p.overlap_blocks);
        if blocks > 0 {
            self.hit_sum += f64::from(overlap) / f64::from(blocks);
            self.hit_n += 1;
        }
    }

    /// A request's first token came `ttft_ms` after its arrival.
    pub fn first_token(&mut self, ttft_ms: f64) {
        self.ttft_sum_ms += ttft_ms;
        self.ttft_n += 1;
    }

    /// A request completed with `output_tokens`, the last `decode_ms` after its first token
    /// (its mean inter-token latency counts when it had two tokens or more; `None`: its
    /// latency is not observed, as on a worker still warming up).
    pub fn completed(&mut self, output_tokens: u32, decode_ms: Option<f64>) {
        self.completed += 1;
        self.osl_sum += f64::from(output_tokens);
        if let Some(decode_ms) = decode_ms
            && output_tokens > 1
        {
            self.itl_sum_ms += decode_ms / f64::from(output_tokens - 1);
            self.itl_n += 1;
        }
    }

    /// Adds `other`'s sums and counts.
    pub fn merge(&mut self, other: &Traffic) {
        self.duration_s += other.duration_s;
        self.requests += other.requests;
        self.isl_sum += other.isl_sum;
        self.osl_sum += other.osl_sum;
        self.completed += other.completed;
        self.ttft_sum_ms += other.ttft_sum_ms;
        self.ttft_n += other.ttft_n;
        self.itl_sum_ms += other.itl_sum_ms;
        self.itl_n += other.itl_n;
        self.hit_sum += other.hit_sum;
        self.hit_n += other.hit_n;
        self.engine_cached_tokens += other.engine_cached_tokens;
        self.engine_prompt_tokens += other.engine_prompt_tokens;
    }

    /// An engine reported `cached` of a completed request's `prompt` tokens cached.
    pub fn engine_reported(&mut self, cached: u32, prompt: u32) {
        self.engine_cached_tokens += u64::from(cached);
        self.engine_prompt_tokens += u64::from(prompt);
    }

    /// The engines' reported hit rate (cached over prompt tokens), if any reported.
    pub fn engine_hit_rate(&self) -> Option<f64> {
        (self.engine_prompt_tokens > 0)
            .then(|| self.engine_cached_tokens as f64 / self.engine_prompt_tokens as f64)
    }

    fn mean(sum: f64, n: u64) -> Option<f64> {
        (n > 0).then(|| sum / n as f64)
    }

    /// Requests per second.
    pub fn rps(&self) -> f64 {
        if self.duration_s > 0.0 {
            self.requests as f64 / self.duration_s
        } else {
            0.0
        }
    }

    /// Mean prompt length.
    pub fn isl(&self) -> Option<f64> {
        Self::mean(self.isl_sum, self.requests)
    }

    /// Mean output length.
    pub fn osl(&self) -> Option<f64> {
        Self::mean(self.osl_sum, self.completed)
    }

    /// Mean TTFT, ms.
    pub fn ttft_ms(&self) -> Option<f64> {
        Self::mean(self.ttft_sum_ms, self.ttft_n)
    }

    /// Mean ITL, ms.
    pub fn itl_ms(&self) -> Option<f64> {
        Self::mean(self.itl_sum_ms, self.itl_n)
    }

    /// Mean router-predicted KV hit rate (raw, not clamped).
    pub fn hit_rate(&self) -> Option<f64> {
        Self::mean(self.hit_sum, self.hit_n)
    }
}

/// A worker's life as the fleet reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerPhase {
    /// Provisioned, not yet routable.
    Starting,
    /// Taking requests.
    Ready,
    /// Taking no new requests, finishing its own.
    Draining,
}

/// One worker at a tick.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerObservation {
    /// The fleet's id of the worker.
    pub id: u64,
    /// Its pool.
    pub pool: Pool,
    /// Its state.
    pub state: WorkerPhase,
    /// Its forward passes since the previous tick, in order.
    pub passes: Vec<PassSample>,
    /// Prompt tokens of requests sent to it that have not had their first token yet: the
    /// engine's queue at the tick (raw, no cache discount), or, read from the router's books
    /// ([`crate::books::Reader`]), the uncached tokens booked, averaged since the previous tick.
    pub queued_prefill_tokens: u64,
    /// Requests decoding on it now.
    pub decode_seqs: u32,
    /// KV tokens resident now (the engine's), or, read from the router's books, its booked
    /// decode blocks' tokens averaged since the previous tick.
    pub kv_tokens: u64,
    /// Requests routed to it and not finished.
    pub in_flight: u32,
    /// Cached blocks no other worker holds: the prefix the fleet loses with it.
    pub sole_blocks: u64,
}

/// Everything the planner learns at a tick.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observation {
    /// Traffic since the previous tick.
    pub traffic: Traffic,
    /// Every provisioned worker, in id order.
    pub workers: Vec<WorkerObservation>,
    /// Requests waiting in the router's queue now.
    pub queued_requests: u64,
}

/// The order to remove `workers` in, cheapest first: the fewest cached blocks only it holds,
/// then the fewest requests in flight, then the newest (highest id). The planner's scale-down
/// and the ranking the proxy exports for outside autoscalers are this one rule.
pub fn removal_order<'a>(workers: impl IntoIterator<Item = &'a WorkerObservation>) -> Vec<u64> {
    let mut ranked: Vec<&WorkerObservation> = workers.into_iter().collect();
    ranked.sort_by_key(|w| removal_rank(w.sole_blocks, w.in_flight, w.id));
    ranked.into_iter().map(|w| w.id).collect()
}

/// The key [`removal_order`] sorts by, lowest first, for a worker holding `sole_blocks` cached
/// blocks no other worker holds, with `in_flight` requests, of id `id` (ids grow with age).
pub fn removal_rank(sole_blocks: u64, in_flight: u32, id: u64) -> (u64, u32, std::cmp::Reverse<u64>) {
    (sole_blocks, in_flight, std::cmp::Reverse(id))
}
