//! Busy filtering: workers past a load threshold take no new requests, and when every eligible
//! worker is past one, requests wait in the queue.
//!
//! Thresholds apply to the booked load (not the projection) and combine with OR, as Dynamo's
//! `--active-decode-blocks-threshold`, `--active-prefill-tokens-threshold` and
//! `--active-prefill-tokens-threshold-frac` do. Every threshold is off by default.

use super::load::WorkerLoad;
use super::worker::WorkerSpec;

/// When a worker counts as busy; see the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BusyThresholds {
    /// Busy when active decode blocks exceed this fraction of the worker's capacity.
    pub decode_blocks_fraction: Option<f64>,
    /// Busy when active prefill tokens exceed this many.
    pub prefill_tokens: Option<u64>,
    /// Busy when active prefill tokens exceed this multiple of the worker's
    /// `max_batched_tokens`.
    pub prefill_tokens_fraction: Option<f64>,
    /// Busy when booked requests exceed this fraction of the worker's `max_requests`.
    pub requests_fraction: Option<f64>,
}

impl BusyThresholds {
    /// Whether any threshold is set.
    pub fn any(&self) -> bool {
        *self != Self::default()
    }

    /// Whether a worker with `spec` and `load` is busy.
    pub fn is_busy(&self, spec: &WorkerSpec, load: &WorkerLoad) -> bool {
        let over = |value: u64, limit: f64| value as f64 > limit;
        self.decode_blocks_fraction
            .is_some_and(|f| over(load.decode_blocks, f * spec.capacity_blocks as f64))
            || self.prefill_tokens.is_some_and(|t| load.prefill_tokens > t)
            || self
                .prefill_tokens_fraction
                .is_some_and(|f| over(load.prefill_tokens, f * spec.max_batched_tokens as f64))
            || self
                .requests_fraction
                .is_some_and(|f| over(u64::from(load.requests), f * spec.max_requests as f64))
    }

    pub(crate) fn invalid_field(&self) -> Option<(&'static str, f64)> {
        [
            ("decode_blocks_fraction", self.decode_blocks_fraction),
            ("prefill_tokens_fraction", self.prefill_tokens_fraction),
            ("requests_fraction", self.requests_fraction),
        ]
        .into_iter()
        .find_map(|(name, f)| f.filter(|f| !(f.is_finite() && *f >= 0.0)).map(|f| (name, f)))
    }
}
