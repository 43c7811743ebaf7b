//! The workload: every request a run will offer, with its arrival rule, its prompt as local
//! block hashes at the engines' block size, and its true output length.
//!
//! A workload is built once (from a trace or a generator) and run under any number of router
//! configurations: each policy of a comparison sees the identical requests.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::LocalBlockHash;
use kvroute_core::time::Timestamp;

/// When a request arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// At a fixed time (open loop: trace timestamps, generated arrival processes).
    At(Timestamp),
    /// `delay` after an earlier request of the same session finishes (or is turned away): the
    /// next turn of a conversation, with the user's think time.
    After {
        /// Index of the earlier request in [`Workload::requests`].
        request: usize,
        /// Think time.
        delay: Duration,
    },
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimRequest {
    /// When it arrives (ignored in closed-loop mode, where a request arrives when a slot frees).
    pub arrival: Arrival,
    /// Local hashes of the prompt's full blocks, at [`Workload::block_size`].
    pub locals: Arc<[LocalBlockHash]>,
    /// Prompt length in tokens: `locals.len()` full blocks plus fewer than a block.
    pub prompt_tokens: u32,
    /// Tokens the request generates. Only the engine reads it; the router never sees it.
    pub output_tokens: u32,
}

/// Requests, in the order of their ids (request `i` is `RequestId(i)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Tokens per block of every request's `locals`; runs need engines and a router of this
    /// block size.
    pub block_size: u32,
    /// The requests.
    pub requests: Vec<SimRequest>,
}

impl Workload {
    /// An empty workload at `block_size` tokens per block.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            requests: Vec::new(),
        }
    }

    /// Prompt tokens over all requests.
    pub fn total_input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| u64::from(r.prompt_tokens)).sum()
    }

    /// Divides every fixed arrival time and think time by `speedup` (2.0 arrives twice as fast).
    /// Values that are not finite and positive leave the workload unchanged.
    pub fn speed_up(&mut self, speedup: f64) {
        if !(speedup.is_finite() && speedup > 0.0) || speedup == 1.0 {
            return;
        }
        for r in &mut self.requests {
            r.arrival = match r.arrival {
                Arrival::At(t) => Arrival::At(Timestamp((t.as_nanos() as f64 / speedup).round() as u64)),
                Arrival::After { request, delay } => Arrival::After {
                    request,
                    delay: delay.div_f64(speedup),
                },
            };
        }
    }

    /// Re-times fixed arrivals so that the arrival rate at (new) time `τ` is the original rate
    /// times `m(τ)`, with `m` the piecewise-linear profile through `points` (seconds,
    /// multiplier), constant before the first point and after the last. A request at original
    /// time `t` arrives at the `τ` where `∫₀^τ m = t`, so a stationary trace becomes a ramp or a
    /// daily cycle while its requests, lengths and order stay. Think times are kept. Points must
    /// have increasing times and positive, finite multipliers; otherwise an error says why.
    pub fn warp_rate(&mut self, points: &[(f64, f64)]) -> Result<(), String> {
        if points.is_empty() {
            return Ok(());
        }
        for (i, &(t, m)) in points.iter().enumerate() {
            if !(t.is_finite() && t >= 0.0 && m.is_finite() && m > 0.0) {
                return Err(format!(
                    "rate profile point ({t}, {m}): time >= 0 and multiplier > 0"
                ));
            }
            if i > 0 && t <= points[i - 1].0 {
                return Err(format!(
                    "rate profile times must increase ({t} after {})",
                    points[i - 1].0
                ));
            }
        }
        // Segments (start, end, m at start, m at end), the first from 0, the last open.
        let mut segments = Vec::with_capacity(points.len() + 1);
        let (t0, m0) = points[0];
        if t0 > 0.0 {
            segments.push((0.0, t0, m0, m0));
        }
        for pair in points.windows(2) {
            segments.push((pair[0].0, pair[1].0, pair[0].1, pair[1].1));
        }
        let (tl, ml) = points[points.len() - 1];
        segments.push((tl, f64::INFINITY, ml, ml));
        let invert = |target: f64| -> f64 {
            let mut area = 0.0;
            for &(a, b, ma, mb) in &segments {
                let slope = if b.is_finite() { (mb - ma) / (b - a) } else { 0.0 };
                let seg_area = if b.is_finite() {
                    (ma + mb) / 2.0 * (b - a)
                } else {
                    f64::INFINITY
                };
                if area + seg_area >= target {
                    // Solve ma·x + slope·x²/2 = target - area for x in [0, b - a].
                    let need = target - area;
                    let x = if slope.abs() < 1e-15 {
                        need / ma
                    } else {
                        (-ma + (ma * ma + 2.0 * slope * need).max(0.0).sqrt()) / slope
                    };
                    return a + x.max(0.0);
                }
                area += seg_area;
            }
            target
        };
        for r in &mut self.requests {
            if let Arrival::At(t) = r.arrival {
                let tau = invert(t.as_secs_f64());
                r.arrival = Arrival::At(Timestamp((tau * 1e9).round() as u64));
            }
        }
        Ok(())
    }

    /// Keeps the first `n` requests, dropping any session link to a dropped request.
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
    }
}

/// Hashes synthesized prompts into a workload's blocks, reusing one token buffer.
#[derive(Debug)]
pub(crate) struct PromptHasher {
    hasher: BlockHasher,
    tokens: Vec<u32>,
}

impl PromptHasher {
    pub(crate) fn new(block_size: u32) -> Self {
        Self {
            hasher: BlockHasher::new(block_size as usize, &HashSalt::NONE),
            tokens: Vec::new(),
        }
    }

    /// The buffer to fill with a prompt's tokens (cleared).
    pub(crate) fn buffer(&mut self) -> &mut Vec<u32> {
        self.tokens.clear();
        &mut self.tokens
    }

    /// The local hashes of the full blocks of the buffer's tokens.
    ///
    /// A block equal to the one before it reuses its hash: synthesized trace prompts repeat one
    /// token per trace block, so most blocks do, and comparing is cheaper than hashing.
    pub(crate) fn locals(&self) -> Arc<[LocalBlockHash]> {
        let mut prev: Option<(&[u32], LocalBlockHash)> = None;
        self.tokens
            .chunks_exact(self.hasher.block_size())
            .map(|block| match prev {
                Some((tokens, hash)) if tokens == block => hash,
                _ => {
                    let hash = self.hasher.local_hash(block);
                    prev = Some((block, hash));
                    hash
                }
            })
            .collect()
    }

    /// The local hashes of the full blocks of a prompt made of `runs` (each a token repeated
    /// `count` times), and the prompt's length, without writing the prompt out: a block inside
    /// one run is hashed once per run, only blocks across a run boundary are assembled. The
    /// hashes are those [`PromptHasher::locals`] gives for the same tokens.
    pub(crate) fn run_locals(
        &mut self,
        runs: impl IntoIterator<Item = (u32, usize)>,
    ) -> (Arc<[LocalBlockHash]>, u32) {
        let bs = self.hasher.block_size();
        let mut locals = Vec::new();
        let mut len = 0usize;
        let mut uniform: Option<(u32, LocalBlockHash)> = None;
        self.tokens.clear();
        for (token, mut count) in runs {
            len += count;
            while count > 0 {
                if self.tokens.is_empty() && count >= bs {
                    let hash = match uniform {
                        Some((t, hash)) if t == token => hash,
                        _ => {
                            self.tokens.resize(bs, token);
                            let hash = self.hasher.local_hash(&self.tokens);
                            self.tokens.clear();
                            uniform = Some((token, hash));
                            hash
                        }
                    };
                    let whole = count / bs;
                    locals.extend(std::iter::repeat_n(hash, whole));
                    count -= whole * bs;
                } else {
                    let take = (bs - self.tokens.len()).min(count);
                    self.tokens.extend(std::iter::repeat_n(token, take));
                    count -= take;
                    if self.tokens.len() == bs {
                        locals.push(self.hasher.local_hash(&self.tokens));
                        self.tokens.clear();
                    }
                }
            }
        }
        self.tokens.clear();
        (locals.into(), u32::try_from(len).unwrap_or(u32::MAX))
    }

    /// Tokens in the buffer.
    pub(crate) fn len(&self) -> u32 {
        u32::try_from(self.tokens.len()).unwrap_or(u32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::PromptHasher;

    proptest! {
        /// Hashing runs gives what hashing the written-out prompt gives, partial tail included.
        #[test]
        fn run_locals_equal_locals_of_the_tokens(
            block_size in 1u32..40,
            runs in prop::collection::vec((0u32..4, 0usize..100), 0..12),
        ) {
            let mut hasher = PromptHasher::new(block_size);
            let (from_runs, len) = hasher.run_locals(runs.iter().copied());
            let tokens = hasher.buffer();
            for &(token, count) in &runs {
                tokens.extend(std::iter::repeat_n(token, count));
            }
            prop_assert_eq!(len, hasher.len());
            prop_assert_eq!(&*from_runs, &*hasher.locals());
        }
    }
}
