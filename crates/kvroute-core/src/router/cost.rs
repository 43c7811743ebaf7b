//! The cost of sending a request to a worker: the one function that computes it.
//!
//! ```text
//! cost = prefill_load_scale * max(prefill_blocks - overlap_credit * (overlap_blocks + moved), 0)
//!      + prefill_load_scale * (evict_weight * eviction_pressure + fleet_weight * fleet_load
//!                              + stall_weight * active_requests)
//!                           * max(prefill_blocks_of_prompt - overlap_blocks - moved, 0)
//!      + prefill_load_scale * transfer_block_cost * max(prompt_blocks - overlap_blocks - moved, 0)
//!                                                          (decode workers only)
//!      + decode_blocks
//!      + decode_active_request_weight * active_requests
//! ```
//!
//! * `prefill_blocks = (worker's active prefill tokens + the prompt's tokens) / block_size`, a
//!   fraction; 0 on workers without a prefill term (decode workers).
//! * `overlap_blocks`: the prompt's leading blocks cached on the worker('s GPU).
//! * `moved = (1 - tier_block_cost) * tier_blocks`, where `tier_blocks` are the blocks right
//!   after those that the worker holds only on a slower tier
//!   (host memory), which its engine loads back instead of computing. Each costs
//!   `tier_block_cost` of a block to prefill (its transfer against its prefill): 1 makes the
//!   router tier-blind (a miss), 0 a GPU hit. Dynamo credits such blocks with
//!   `--router-host-cache-hit-weight` 0.75, a cost of 0.25, kvroute's default. Under the staged
//!   projection `moved` also joins the decode term, as cached blocks do; at 1 nothing moves and
//!   the cost is the tier-blind one exactly.
//! * `decode_blocks`: the worker's decode blocks with the request added, under the chosen
//!   [`DecodeProjection`]; 0 on workers without a decode term (prefill workers).
//! * `active_requests`: requests booked on the worker before this one.
//! * `eviction_pressure`: the fraction of its cache the worker evicted lately (its `Removed`
//!   events, decayed: the `churn` module), 0 on a worker with nothing booked. The prompt's blocks
//!   it does not hold must be made room for; on a worker that evicts, each one pushes out a
//!   cached block some later request could have reused, and what is cached there does not stay
//!   long. The term (on workers with a prefill term) sends prompts that bring much new to
//!   workers with room, and keeps a conversation whose prefix is cached where it is: the
//!   remedy to affinity piling sessions onto a few hot workers when caches are small, where
//!   spreading keeps more prefixes in the fleet. 0 makes the cost eviction-blind (Dynamo's).
//! * `fleet_load`: how loaded the whole fleet is, in `[0, 1]` (the load of its least loaded
//!   worker that computes prompts, booked requests over `max_requests` or decode blocks over
//!   capacity, whichever is larger; 0 while one has nothing booked: `Router::fleet_load`). The
//!   same for every candidate of a decision, it raises what a cached block saves. The rest of
//!   the cost weighs a request's own wait: balancing sends it where it starts soonest. Once
//!   every worker is loaded, a block computed anywhere delays the requests queued behind it
//!   and lengthens the steps of the batch it joins, so a block not computed (a reused prefix)
//!   saves fleet-wide work, and it is worth more than the queue a worker has over another.
//!   `fleet_weight = 128` lets a session stay where its prefix is on an overloaded fleet, as
//!   SGLang's affinity does, while an idle worker (load 0) leaves the cost as it was.
//! * `stall_weight`: the pass that computes a prompt's uncached blocks on a worker lengthens
//!   the step of every request booked there (chunked prefill shares the pass with the decodes),
//!   so each of them waits as long as the prompt's own prefill. The rest of the cost weighs the
//!   request's own wait (queue and prefill); this term weighs the wait it imposes, per booked
//!   request. Without it `kv` sends a long prompt to the worker with the shortest prefill queue
//!   even when that worker decodes many more requests, whose every later token is then slower:
//!   on small caches (EXPERIMENTS.md's small-cache case) its TTFT was the best and its E2E
//!   behind `least-loaded`'s and `power-of-two`'s. A cached prompt stalls nobody, so affinity keeps its weight. At 1
//!   every stalled request counts as much as the request's own wait, which buys E2E with TTFT
//!   (TTFT p90 past `dynamo`'s on the small-cache case on some seeds); of a sweep of 0.03 to 1,
//!   only `kv`'s 0.07 kept it within 2 % of the best policy on every routing workload of
//!   EXPERIMENTS.md where one can be ("Is `kv` the best policy everywhere?"). 0 is stall-blind
//!   (Dynamo's).
//! * `transfer_block_cost`, on decode workers (no prefill term): a prompt block the worker does
//!   not cache reaches it by transfer from the prefill worker (or by a prefill there), and a
//!   block it caches does not. Priced as a block from a slower tier is (0.25 of a block to
//!   prefill, `tier_block_cost`'s default), so a decode worker holding the prompt's prefix wins
//!   over an equally loaded one that does not. 0 is Dynamo's cache-blind decode pool.
//!
//! This is Dynamo's v1 cost (without the host/disk tiers, credit decay and taint factor, which
//! kvroute does not model) with kvroute's staged projection as an option.
//!
//! Under the staged projection at `prefill_load_scale = overlap_credit = 1`, every prompt block
//! is counted exactly once, in one term or the other. On an idle fleet a worker that caches the
//! whole prompt and one that caches none therefore cost the same (the cached blocks are decode
//! blocks, the uncached ones prefill blocks), and the tie is broken at random; cache affinity
//! then comes from load (a prefix already active on a worker is not counted again) or from a
//! `prefill_load_scale` above 1.
//!
//! `kv` therefore defaults to `prefill_load_scale = 16`: a block to prefill weighs as much as
//! sixteen blocks of decode residency. At 1, `kv` kept no more of the Mooncake traces' prefixes
//! than round-robin (reuse 0.07); at 2 it equals the full projection (Dynamo's default); from 4
//! to 16 TTFT kept improving on both Mooncake traces and on an overloaded multi-turn workload
//! without hurting tail latency (EXPERIMENTS.md, "Which `prefill_load_scale` should `kv` use?").
//! With `evict_weight = 16` beside it, a prompt's uncached blocks on a worker that turned its
//! whole cache over lately cost seventeen times a prefill: the pair came out of `kvroute tune`
//! over EXPERIMENTS.md's routing workloads, noise off and on ("Is `kv` the best policy
//! everywhere?"), as did `fleet_weight = 128` (64 to 256 swept) and `stall_weight = 0.07`.

use super::load::DecodeProjection;
use super::policy::Candidate;
use super::request::RequestView;

/// The weights of the cost; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostParams {
    /// Multiplies the prefill term (Dynamo `prefill_load_scale`, formerly `overlap_score_weight`).
    pub prefill_load_scale: f64,
    /// How much of a cached block is taken off the prefill term, in `[0, 1]` (Dynamo
    /// `overlap_score_credit`).
    pub overlap_credit: f64,
    /// Block-equivalents added per active request (Dynamo `decode_active_request_weight`).
    pub decode_active_request_weight: f64,
    /// How the decode term counts requests still in prefill.
    pub projection: DecodeProjection,
    /// What a block held only on a slower tier costs, as a fraction of a block to prefill, in
    /// `[0, 1]` (1: tier-blind).
    pub tier_block_cost: f64,
    /// How much more a prompt's uncached block costs on a worker that evicts, per unit of its
    /// eviction pressure, as a fraction of a block to prefill (0: eviction-blind).
    pub evict_weight: f64,
    /// How much more a prompt's uncached block costs anywhere when the whole fleet is loaded,
    /// per unit of the fleet's load ([`RequestView::fleet_load`]), as a fraction of a block to
    /// prefill (0: load-blind, Dynamo's).
    pub fleet_weight: f64,
    /// How much a prompt's uncached block costs per request booked on the worker, as a
    /// fraction of a block to prefill: the pass that computes it stalls every one of them
    /// (0: stall-blind, Dynamo's).
    pub stall_weight: f64,
    /// What a prompt block a decode worker (no prefill term) does not cache costs there, as a
    /// fraction of a block to prefill: it must be transferred from the prefill worker, or
    /// computed there (0: decode workers cache-blind, Dynamo's).
    pub transfer_block_cost: f64,
}

impl CostParams {
    /// Dynamo's defaults: scale 1, credit 1, no per-request weight, the full projection.
    pub const DYNAMO: CostParams = CostParams {
        prefill_load_scale: 1.0,
        overlap_credit: 1.0,
        decode_active_request_weight: 0.0,
        projection: DecodeProjection::Full,
        tier_block_cost: Self::DEFAULT_TIER_BLOCK_COST,
        evict_weight: 0.0,
        fleet_weight: 0.0,
        stall_weight: 0.0,
        transfer_block_cost: 0.0,
    };

    /// A slower tier's block costs a quarter of a prefilled one: Dynamo's host-tier credit
    /// (`--router-host-cache-hit-weight` 0.75).
    pub const DEFAULT_TIER_BLOCK_COST: f64 = 0.25;

    /// kvroute's defaults: the staged projection, a prefill block weighing sixteen decode
    /// blocks, an uncached block on a worker that evicts weighing up to sixteen more, on a
    /// fully loaded fleet up to 128 more and 0.07 more per request it stalls, and decode workers counting the blocks they lack at
    /// the tier's cost (see the module docs for why).
    pub const KV: CostParams = CostParams {
        prefill_load_scale: 16.0,
        projection: DecodeProjection::Staged,
        evict_weight: 16.0,
        fleet_weight: 128.0,
        stall_weight: 0.07,
        transfer_block_cost: Self::DEFAULT_TIER_BLOCK_COST,
        ..Self::DYNAMO
    };

    /// Whether every weight is in range: finite, non-negative, credit at most 1.
    pub(crate) fn invalid_field(&self) -> Option<(&'static str, f64)> {
        [
            ("prefill_load_scale", self.prefill_load_scale, f64::INFINITY),
            ("overlap_credit", self.overlap_credit, 1.0),
            (
                "decode_active_request_weight",
                self.decode_active_request_weight,
                f64::INFINITY,
            ),
            ("tier_block_cost", self.tier_block_cost, 1.0),
            ("evict_weight", self.evict_weight, f64::INFINITY),
            ("fleet_weight", self.fleet_weight, f64::INFINITY),
            ("stall_weight", self.stall_weight, f64::INFINITY),
            ("transfer_block_cost", self.transfer_block_cost, 1.0),
        ]
        .into_iter()
        .find(|&(_, v, max)| !(v.is_finite() && (0.0..=max).contains(&v)))
        .map(|(name, v, _)| (name, v))
    }
}

/// The prompt's blocks a worker caches, as the cost counts them: those on its GPU, and the
/// part of the slower tier's blocks taken off the prefill term as if cached (`moved`, the
/// second).
pub(super) fn cached_blocks(params: &CostParams, overlap_blocks: u32, tier_blocks: u32) -> (f64, f64) {
    let moved = (1.0 - params.tier_block_cost) * f64::from(tier_blocks);
    (f64::from(overlap_blocks) + moved, moved)
}

/// The prompt's blocks a worker caching `cached` of them lacks: what eviction pressure, the
/// fleet's load and the requests booked there make dearer on a worker that prefills, and what
/// reaches a decode worker by transfer.
pub(super) fn uncached_blocks(request: &RequestView<'_>, cached: f64) -> f64 {
    (request.prompt_tokens as f64 / f64::from(request.block_size) - cached).max(0.0)
}

/// The cost of sending `request` to `candidate` under `params`; lower is better.
pub fn cost(params: &CostParams, request: &RequestView<'_>, candidate: &Candidate) -> f64 {
    let role = candidate.spec.role;
    let (cached, moved) = cached_blocks(params, candidate.overlap_blocks, candidate.tier_blocks);
    let uncached = uncached_blocks(request, cached);
    let prefill = if role.tracks_prefill() {
        let tokens = candidate.load.prefill_tokens + request.prompt_tokens;
        let blocks = tokens as f64 / f64::from(request.block_size);
        let adjusted = (blocks - params.overlap_credit * cached).max(0.0);
        let pressure = params.evict_weight * candidate.eviction_pressure
            + params.fleet_weight * request.fleet_load
            + params.stall_weight * f64::from(candidate.load.requests);
        let mut prefill = params.prefill_load_scale * adjusted;
        if pressure > 0.0 {
            prefill += params.prefill_load_scale * pressure * uncached;
        }
        prefill
    } else if role.tracks_decode() {
        params.prefill_load_scale * params.transfer_block_cost * uncached
    } else {
        0.0
    };
    let mut decode = candidate.projection.decode_blocks(params.projection) as f64;
    // The staged projection counts cached blocks as decode residency at once; the part of the
    // tier's blocks counted as cached above joins them (the full projection has them already).
    if params.projection == DecodeProjection::Staged && role.tracks_prefill() && role.tracks_decode() {
        decode += moved;
    }
    prefill + decode + params.decode_active_request_weight * f64::from(candidate.load.requests)
}
