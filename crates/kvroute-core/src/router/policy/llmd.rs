//! `llmd-weighted`: llm-d's default scheduling profile: a weighted sum of scorers, highest total
//! wins (the `max-score` picker, ties broken at random).
//!
//! Scorers, each in `[0, 1]`, with weights 2:1:1 by default (llm-d's and BLIS's
//! `precise-prefix-cache:2, queue-depth:1, kv-utilization:1`):
//!
//! * **prefix cache** (`precise-prefix-cache-scorer`): the worker's cached prompt blocks,
//!   min-max normalized over the candidates; 1 for all when they are equal. The overlap comes
//!   from the KV-event index, as llm-d's precise scorer reads llm-d-kv-cache.
//! * **queue depth** (`queue-scorer`): `(max_q - q) / (max_q - min_q)`, 1 for all when equal. The
//!   engine's waiting queue is not visible to a router without metrics; `q` is the router's
//!   stand-in, the requests booked on the worker whose first token has not come yet.
//! * **KV utilization** (`kv-cache-utilization-scorer`): `1 - used / capacity`, with `used` the
//!   worker's active decode blocks as booked by the router (llm-d scrapes the engine's
//!   `kv_cache_usage_perc`).
//!
//! The total is `Σ weight · score / Σ weight`.

use super::{Candidate, Policy};
use crate::router::request::RequestView;
use crate::router::rng::Rng;
use crate::router::select::argmax;

/// Weights of `llmd-weighted`'s scorers; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlmdConfig {
    /// Weight of the prefix-cache scorer. Default 2.
    pub prefix_weight: f64,
    /// Weight of the queue-depth scorer. Default 1.
    pub queue_weight: f64,
    /// Weight of the KV-utilization scorer. Default 1.
    pub kv_utilization_weight: f64,
}

impl Default for LlmdConfig {
    fn default() -> Self {
        Self {
            prefix_weight: 2.0,
            queue_weight: 1.0,
            kv_utilization_weight: 1.0,
        }
    }
}

impl LlmdConfig {
    fn weights(&self) -> [(&'static str, f64); 3] {
        [
            ("prefix_weight", self.prefix_weight),
            ("queue_weight", self.queue_weight),
            ("kv_utilization_weight", self.kv_utilization_weight),
        ]
    }

    pub(crate) fn invalid_field(&self) -> Option<(&'static str, f64)> {
        let bad = self
            .weights()
            .into_iter()
            .find(|&(_, w)| !(w.is_finite() && w >= 0.0));
        let total: f64 = self.weights().iter().map(|&(_, w)| w).sum();
        bad.or((total <= 0.0).then_some(("prefix_weight", self.prefix_weight)))
    }
}

/// `(max - value) / (max - min)` or `(value - min) / (max - min)`; 1 when all are equal.
fn min_max(value: f64, (min, max): (f64, f64), higher_is_better: bool) -> f64 {
    if max <= min {
        return 1.0;
    }
    if higher_is_better {
        (value - min) / (max - min)
    } else {
        (max - value) / (max - min)
    }
}

fn range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

/// See the module docs.
#[derive(Clone, Debug)]
pub(super) struct LlmdWeighted {
    config: LlmdConfig,
}

impl LlmdWeighted {
    pub(super) fn new(config: LlmdConfig) -> Self {
        Self { config }
    }
}

impl Policy for LlmdWeighted {
    fn name(&self) -> &'static str {
        "llmd-weighted"
    }

    fn select(&mut self, _: &RequestView<'_>, candidates: &[Candidate], rng: &mut Rng) -> usize {
        let c = &self.config;
        let prefix = |x: &Candidate| f64::from(x.overlap_blocks);
        let queue = |x: &Candidate| f64::from(x.load.prefill_requests);
        let (prefix_range, queue_range) = (
            range(candidates.iter().map(prefix)),
            range(candidates.iter().map(queue)),
        );
        let total = c.prefix_weight + c.queue_weight + c.kv_utilization_weight;
        let score = |x: &Candidate| {
            let used = x.load.decode_blocks as f64 / x.spec.capacity_blocks.max(1) as f64;
            let kv = (1.0 - used).clamp(0.0, 1.0);
            (c.prefix_weight * min_max(prefix(x), prefix_range, true)
                + c.queue_weight * min_max(queue(x), queue_range, false)
                + c.kv_utilization_weight * kv)
                / total
        };
        argmax(candidates.iter().map(score), rng)
    }
}
