//! `sglang-cache-aware`: the SGLang gateway's (sgl-router / SMG) cache-aware policy, in its
//! approximate-tree form (workers without KV events).
//!
//! Per decision:
//!
//! 1. **Imbalance.** With `load` = a worker's in-flight requests (here: booked requests), the
//!    fleet is imbalanced when `max_load - min_load > balance_abs_threshold` and
//!    `max_load > balance_rel_threshold * min_load`. Then the least loaded worker wins (the first
//!    in worker order on a tie, as SGLang's `min_by_key`).
//! 2. **Cache.** Otherwise each worker's match rate is the share of the prompt found in the tree
//!    of prompts routed to it. If the best rate exceeds `cache_threshold`, the best-matching
//!    worker wins (ties: lower load, then smaller tree, then worker order); if not, the worker
//!    with the smallest tree ("most free cache") wins.
//!
//! Either way the prompt is then recorded in the chosen worker's tree.
//!
//! Defaults are the SGLang CLI's (`router_args.py`): cache threshold 0.3, balance thresholds 64
//! absolute and 1.5 relative, tree size 2^26 (characters there; here 2^22 blocks, 2^26 tokens at
//! 16 tokens per block).
//!
//! Differences from SGLang: the tree matches whole blocks of token ids (SGLang's `StringTree`
//! matches characters, its `TokenTree` tokens), so a match rate is matched blocks over prompt
//! blocks; a tree is pruned, least recently routed first, as soon as it passes its cap, rather
//! than by a background thread every 60 s; and there is one tree per worker and data-parallel
//! rank, with no per-model split (a router serves one model).

use super::{Candidate, Policy};
use crate::ids::{SequenceHash, WorkerKey};
use crate::router::recent::{RecentChains, RecentConfig};
use crate::router::request::RequestView;
use crate::router::rng::Rng;
use crate::time::Timestamp;

/// Parameters of `sglang-cache-aware`; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SglangConfig {
    /// Route by cache when the best match rate exceeds this, in `[0, 1]`. Default 0.3.
    pub cache_threshold: f64,
    /// Absolute load gap that (with the relative one) means imbalance. Default 64.
    pub balance_abs_threshold: u32,
    /// Relative load ratio that (with the absolute one) means imbalance. Default 1.5.
    pub balance_rel_threshold: f64,
    /// Blocks kept per worker's tree. Default 2^22.
    pub max_tree_blocks: u64,
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_blocks: 1 << 22,
        }
    }
}

impl SglangConfig {
    pub(crate) fn invalid_field(&self) -> Option<(&'static str, f64)> {
        if !(0.0..=1.0).contains(&self.cache_threshold) {
            return Some(("cache_threshold", self.cache_threshold));
        }
        if !(self.balance_rel_threshold.is_finite() && self.balance_rel_threshold >= 0.0) {
            return Some(("balance_rel_threshold", self.balance_rel_threshold));
        }
        (self.max_tree_blocks == 0).then_some(("max_tree_blocks", 0.0))
    }
}

/// See the module docs.
#[derive(Clone, Debug)]
pub(super) struct SglangCacheAware {
    config: SglangConfig,
    trees: RecentChains,
}

impl SglangCacheAware {
    pub(super) fn new(config: SglangConfig) -> Self {
        let trees = RecentChains::new(RecentConfig {
            ttl: None,
            max_blocks: config.max_tree_blocks,
            prune_ratio: 1.0,
        });
        Self { config, trees }
    }

    fn imbalanced(&self, candidates: &[Candidate]) -> bool {
        let loads = candidates.iter().map(|c| c.load.requests);
        let (min, max) = loads.fold((u32::MAX, 0), |(lo, hi), l| (lo.min(l), hi.max(l)));
        max - min > self.config.balance_abs_threshold
            && f64::from(max) > self.config.balance_rel_threshold * f64::from(min)
    }

    /// The candidate with the smallest key, the first on a tie.
    fn first_min<K: Ord>(candidates: &[Candidate], key: impl Fn(&Candidate) -> K) -> usize {
        (0..candidates.len())
            .min_by_key(|&i| key(&candidates[i]))
            .unwrap_or(0)
    }
}

impl Policy for SglangCacheAware {
    fn name(&self) -> &'static str {
        "sglang-cache-aware"
    }

    fn select(&mut self, request: &RequestView<'_>, candidates: &[Candidate], _: &mut Rng) -> usize {
        if self.imbalanced(candidates) {
            return Self::first_min(candidates, |c| c.load.requests);
        }
        let tree = |c: &Candidate| self.trees.blocks(c.worker());
        let matched = |c: &Candidate| self.trees.depth(c.worker(), request.chain, request.now);
        let best = Self::first_min(candidates, |c| {
            (std::cmp::Reverse(matched(c)), c.load.requests, tree(c))
        });
        let blocks = request.prompt_blocks();
        let rate = if blocks == 0 {
            0.0
        } else {
            f64::from(matched(&candidates[best])) / f64::from(blocks)
        };
        if rate > self.config.cache_threshold {
            best
        } else {
            Self::first_min(candidates, tree)
        }
    }

    fn routed(&mut self, request: &RequestView<'_>, worker: WorkerKey) {
        self.trees.record(worker, request.chain, request.now);
    }

    fn view_depth(&self, worker: WorkerKey, chain: &[SequenceHash], now: Timestamp) -> Option<u32> {
        Some(self.trees.depth(worker, chain, now))
    }

    fn worker_removed(&mut self, worker: WorkerKey) {
        self.trees.remove_worker(worker);
    }
}
