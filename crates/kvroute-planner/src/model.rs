//! Performance models of one pool: step time as a linear function of batch features, fitted
//! online from forward-pass samples, and what the planner derives from it (next TTFT and ITL
//! of an engine, requests per second one engine sustains under the SLA).
//!
//! | pool    | features                          | samples used                       |
//! |---------|-----------------------------------|------------------------------------|
//! | prefill | prefill tokens                    | passes that prefill                |
//! | decode  | decoding requests, KV tokens      | pure-decode passes                 |
//! | agg     | prefill tokens, KV tokens         | every pass                         |
//!
//! **KV reuse.** The hit rate `h` ([`clamp_hit_rate`]) discounts prefill work only: the
//! tokens to compute are `(queued + ISL) * (1 - h)`. The KV a request keeps resident while it
//! decodes is its raw ISL (a cache hit still occupies blocks).

use crate::config::{EngineLimits, Pool, Sla};
use crate::regression::{Fit, Regression};

/// The hit rate the planner uses: `h` clamped to `[0, 0.95]`; missing or NaN means 0.
pub fn clamp_hit_rate(h: Option<f64>) -> f64 {
    match h {
        Some(h) if !h.is_nan() => h.clamp(0.0, 0.95),
        _ => 0.0,
    }
}

/// Prefill tokens to compute for `queued` waiting prompt tokens plus one request of `isl`
/// tokens, at hit rate `h` (already clamped).
pub fn prefill_work(queued: f64, isl: f64, h: f64) -> f64 {
    (queued + isl).max(0.0) * (1.0 - h)
}

/// One forward pass as the planner sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassSample {
    /// Prompt tokens computed in the pass (cache hits excluded).
    pub prefill_tokens: u64,
    /// Requests that decoded one token.
    pub decode_seqs: u32,
    /// KV tokens resident during the pass (blocks in use times block size).
    pub kv_tokens: u64,
    /// How long the pass took, seconds.
    pub duration_s: f64,
}

/// The fitted step-time model of one pool.
#[derive(Clone, Debug)]
pub struct PoolModel {
    pool: Pool,
    limits: EngineLimits,
    prefill: Regression<1>,
    two: Regression<2>,
}

/// A pool model's fitted coefficients, for reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FittedModel {
    /// `step_s = a + b * prefill_tokens`.
    Prefill(Fit<1>),
    /// `step_s = a + b * decode_seqs + c * kv_tokens`.
    Decode(Fit<2>),
    /// `step_s = a + b * prefill_tokens + c * kv_tokens`.
    Agg(Fit<2>),
}

impl PoolModel {
    /// An empty model of `pool`.
    pub fn new(pool: Pool, limits: EngineLimits, max_samples: usize, buckets: usize, min_obs: usize) -> Self {
        let mbt = f64::from(limits.max_num_batched_tokens);
        let kv = limits.kv_capacity_tokens as f64;
        let first = match pool {
            Pool::Decode => f64::from(limits.max_num_seqs),
            _ => mbt,
        };
        Self {
            pool,
            limits,
            prefill: Regression::new([mbt], max_samples, buckets, min_obs),
            two: Regression::new([first, kv], max_samples, buckets, min_obs),
        }
    }

    /// Takes a sample if it belongs to this pool's model; returns whether it was kept.
    pub fn add(&mut self, s: &PassSample) -> bool {
        let (p, d, kv) = (
            s.prefill_tokens as f64,
            f64::from(s.decode_seqs),
            s.kv_tokens as f64,
        );
        match self.pool {
            Pool::Prefill if s.prefill_tokens > 0 => self.prefill.add([p], s.duration_s),
            Pool::Decode if s.prefill_tokens == 0 && s.decode_seqs > 0 => self.two.add([d, kv], s.duration_s),
            Pool::Agg if s.prefill_tokens > 0 || s.decode_seqs > 0 => self.two.add([p, kv], s.duration_s),
            _ => false,
        }
    }

    /// Refits if needed; whether a fit is available.
    pub fn refit(&mut self) -> bool {
        match self.pool {
            Pool::Prefill => self.prefill.fit().is_some(),
            _ => self.two.fit().is_some(),
        }
    }

    /// The fitted coefficients, if any.
    pub fn fitted(&self) -> Option<FittedModel> {
        match self.pool {
            Pool::Prefill => self.prefill.current().map(FittedModel::Prefill),
            Pool::Decode => self.two.current().map(FittedModel::Decode),
            Pool::Agg => self.two.current().map(FittedModel::Agg),
        }
    }

    /// The KV capacity of one engine, tokens.
    pub fn kv_capacity_tokens(&self) -> u64 {
        self.limits.kv_capacity_tokens
    }

    /// Fits rejected so far.
    pub fn rejected(&self) -> u64 {
        self.prefill.rejected() + self.two.rejected()
    }

    /// Seconds of a pass computing `prefill` prompt tokens (prefill and agg pools) or decoding
    /// `seqs` requests (decode pool), with `kv` tokens resident.
    fn step_s(&self, prefill: f64, seqs: f64, kv: f64) -> Option<f64> {
        Some(match self.fitted()? {
            FittedModel::Prefill(f) => f.predict([prefill]),
            FittedModel::Decode(f) => f.predict([seqs, kv]),
            FittedModel::Agg(f) => f.predict([prefill, kv]),
        })
    }

    /// Seconds to compute `tokens` prompt tokens, cut into passes of at most
    /// `max_num_batched_tokens`, with `kv` tokens resident.
    pub fn prefill_s(&self, tokens: f64, kv: f64) -> Option<f64> {
        let mbt = f64::from(self.limits.max_num_batched_tokens);
        if tokens <= 0.0 {
            return Some(0.0);
        }
        let full = (tokens / mbt).floor();
        let rest = tokens - full * mbt;
        let mut t = 0.0;
        if full > 0.0 {
            t += full * self.step_s(mbt, 0.0, kv)?;
        }
        if rest > 0.0 {
            t += self.step_s(rest, 0.0, kv)?;
        }
        Some(t)
    }

    /// An engine's next TTFT, ms: its queue plus one request of `isl`, discounted by `h`.
    pub fn ttft_ms(&self, queued: f64, isl: f64, h: f64, kv: f64) -> Option<f64> {
        Some(self.prefill_s(prefill_work(queued, isl, h), kv)? * 1e3)
    }

    /// An engine's next ITL, ms, with `seqs` requests decoding over `kv` resident tokens and
    /// (agg) `prefill_per_pass` prompt tokens sharing each pass.
    pub fn itl_ms(&self, seqs: f64, kv: f64, prefill_per_pass: f64) -> Option<f64> {
        let mbt = f64::from(self.limits.max_num_batched_tokens);
        Some(self.step_s(prefill_per_pass.min(mbt), seqs, kv)? * 1e3)
    }

    /// Requests per second one engine of this pool sustains under `sla` for requests of
    /// `isl` prompt and `osl` output tokens at hit rate `h`, before headroom.
    pub fn capacity_rps(&self, sla: &Sla, isl: f64, osl: f64, h: f64) -> Option<f64> {
        let (isl, osl) = (isl.max(1.0), osl.max(1.0));
        let kv_cap = self.limits.kv_capacity_tokens as f64;
        let seqs_cap = f64::from(self.limits.max_num_seqs);
        let ctx = isl + osl / 2.0;
        match self.pool {
            Pool::Prefill => {
                let wt = self.prefill_s(prefill_work(0.0, isl, h), 0.0)?;
                (wt > 0.0).then(|| 1.0 / wt)
            }
            Pool::Decode => {
                let max_bs = (kv_cap / ctx).min(seqs_cap).floor().max(1.0) as u64;
                let ok = |bs: u64| -> Option<bool> {
                    let b = bs as f64;
                    Some(self.itl_ms(b, b * ctx, 0.0)? <= sla.itl_ms)
                };
                let (mut lo, mut hi) = (1u64, max_bs);
                if !ok(1)? {
                    hi = 1;
                }
                while lo < hi {
                    let mid = (lo + hi).div_ceil(2);
                    if ok(mid)? {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                let b = lo as f64;
                let wt = self.itl_ms(b, b * ctx, 0.0)? / 1e3;
                (wt > 0.0).then(|| b / (osl * wt))
            }
            Pool::Agg => {
                let mbt = f64::from(self.limits.max_num_batched_tokens);
                let work = prefill_work(0.0, isl, h);
                let balance = osl * mbt / (work + osl);
                let max_bs = (kv_cap / ctx).min(seqs_cap).min(balance).floor().max(1.0) as u64;
                let mut best: Option<f64> = None;
                let mut fallback: Option<f64> = None;
                for bs in 1..=max_bs.min(4096) {
                    let b = bs as f64;
                    let per_pass = (b * work / osl).min(mbt);
                    let wt = self.itl_ms(b, b * ctx, per_pass)? / 1e3;
                    if wt <= 0.0 {
                        continue;
                    }
                    let ttft = self.ttft_ms(0.0, isl, h, b * ctx)?;
                    let rps = b / (osl * wt);
                    if fallback.is_none() {
                        fallback = Some(rps);
                    }
                    if wt * 1e3 <= sla.itl_ms && ttft <= sla.ttft_ms {
                        best = Some(rps);
                    }
                }
                best.or(fallback)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clamp_and_nan_rule() {
        let cases = [
            (None, 0.0),
            (Some(f64::NAN), 0.0),
            (Some(-0.3), 0.0),
            (Some(0.0), 0.0),
            (Some(0.5), 0.5),
            (Some(0.95), 0.95),
            (Some(0.99), 0.95),
            (Some(f64::INFINITY), 0.95),
            (Some(f64::NEG_INFINITY), 0.0),
        ];
        for (h, want) in cases {
            assert_eq!(clamp_hit_rate(h), want, "{h:?}");
        }
        assert_eq!(prefill_work(1000.0, 3000.0, 0.5), 2000.0);
        assert_eq!(
            prefill_work(0.0, 3000.0, clamp_hit_rate(Some(1.0))),
            3000.0 * (1.0 - 0.95)
        );
    }
}
