//! Predicted active load: what each worker is busy with, from the router's own bookings.
//!
//! No load metrics are needed. Per worker the router counts:
//!
//! * **Prefill tokens**: the [`PrefillLoadHint`] of every request from admission until its first
//!   token. The hint is computed once, where the request is routed ([`PrefillLoadHint::new`]);
//!   the tracker only applies it and removes it.
//! * **Active blocks**: the sequence hashes of the prompts it is running, with reference counts,
//!   so a prefix shared by many running requests counts once per worker. They live in a
//!   [`ChainTrie`], so booking a prompt costs a few nodes, not one hash-table update per block.
//! * **Staged blocks**: the same set as the decode term sees it under the staged projection: a
//!   request still in prefill contributes only its cached prefix (its uncached blocks are in the
//!   prefill term), and all of its blocks once its prefill is done.
//! * **Output blocks** (optional): one per block boundary that generation crosses.
//!
//! [`Projection`] is the load a worker would have if a request were added; [`project`] is the one
//! function that computes it.

use std::sync::Arc;
use std::time::Duration;

use super::chain_trie::{ChainTrie, NodeId, Touched};
use super::worker::WorkerRole;
use crate::ids::SequenceHash;
use crate::time::Timestamp;

/// Tokens a worker computes for a prompt of `prompt_tokens` tokens when `cached_tokens` of them
/// are already in its cache: the prompt minus the cached tokens, the cached count clamped to the
/// prompt (Dynamo's `effective_prefill_tokens`). A fully cached prompt gives 0: like Dynamo, the
/// router does not model the one token an engine recomputes to produce the first output.
///
/// This is the only place this subtraction is written; the prefill load hint and the
/// disaggregation decider both call it.
pub fn effective_prefill_tokens(prompt_tokens: u64, cached_tokens: u64) -> u64 {
    prompt_tokens - cached_tokens.min(prompt_tokens)
}

/// The most prompt blocks of `block_size` tokens an engine serves from its prefix cache for a
/// prompt of `prompt_tokens` tokens: at most `prompt_tokens − 1` tokens come from the cache, as
/// the last one is always computed (vLLM's `max_cache_hit_length = num_tokens − 1`), in whole
/// blocks. The simulated engine's scheduler and the proxy's prediction of an engine's reported
/// `cached_tokens` both call it.
pub fn max_cached_blocks(prompt_tokens: u64, block_size: u64) -> u64 {
    prompt_tokens.saturating_sub(1) / block_size.max(1)
}

/// A linear model of prefill time, for the optional expected duration of a prefill load hint:
/// `fixed_overhead + effective_tokens / tokens_per_second` (Dynamo's linear prefill estimator).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillModel {
    /// Prefill throughput of one worker, in tokens per second (finite and positive).
    pub tokens_per_second: f64,
    /// Time every prefill takes regardless of its length.
    pub fixed_overhead: Duration,
}

impl PrefillModel {
    /// The expected time to prefill `tokens` tokens.
    pub fn duration(&self, tokens: u64) -> Duration {
        self.fixed_overhead + Duration::from_secs_f64(tokens as f64 / self.tokens_per_second)
    }
}

/// The prefill load a request puts on the worker that computes its prompt, decided once when the
/// request is routed and then only applied and removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillLoadHint {
    /// Uncached prompt tokens on that worker ([`effective_prefill_tokens`]).
    pub tokens: u64,
    /// How long the prefill is expected to take, when a [`PrefillModel`] is configured. Carried
    /// in decisions and replica events; the tracker does not decay load with it (yet).
    pub expected_duration: Option<Duration>,
}

impl PrefillLoadHint {
    /// The hint for a prompt of `prompt_tokens` tokens on a worker that caches `overlap_blocks`
    /// of its blocks, at `block_size` tokens per block.
    pub fn new(
        prompt_tokens: u64,
        overlap_blocks: u32,
        block_size: u32,
        model: Option<&PrefillModel>,
    ) -> Self {
        let tokens =
            effective_prefill_tokens(prompt_tokens, u64::from(overlap_blocks) * u64::from(block_size));
        Self {
            tokens,
            expected_duration: model.map(|m| m.duration(tokens)),
        }
    }
}

/// A worker's active load, as booked by the router.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    /// Requests booked on the worker (in any phase).
    pub requests: u32,
    /// Of those, requests whose prefill runs here and has not produced a first token (the
    /// router's stand-in for the engine's queue depth).
    pub prefill_requests: u32,
    /// Sum of the prefill hints of those requests.
    pub prefill_tokens: u64,
    /// Active decode blocks: unique prompt blocks of every booked request, plus output blocks.
    pub decode_blocks: u64,
    /// Decode blocks as the staged projection counts them: the cached prefix of requests still
    /// in prefill, every block of the others, plus output blocks.
    pub staged_decode_blocks: u64,
    /// Output blocks booked (included in both decode counts).
    pub output_blocks: u64,
}

impl WorkerLoad {
    /// Whether nothing is booked.
    pub fn is_idle(&self) -> bool {
        *self == Self::default()
    }
}

/// How the decode term counts a request that is still in prefill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeProjection {
    /// Its uncached blocks sit in the prefill term only and move to the decode term when its
    /// prefill completes, so no block is counted in both terms (kvroute's default).
    #[default]
    Staged,
    /// Every prompt block is in the decode term from admission (Dynamo's default), so uncached
    /// blocks count in both terms while prefill is pending.
    Full,
}

/// A worker's decode blocks if a request were added to it, under both projections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Projection {
    /// [`DecodeProjection::Full`]: active blocks plus the request's blocks not already active.
    pub decode_blocks_full: u64,
    /// [`DecodeProjection::Staged`]: staged blocks plus the request's cached prefix not already
    /// staged. On decode workers (no prefill term) it equals the full projection.
    pub decode_blocks_staged: u64,
}

impl Projection {
    /// The decode blocks under `projection`.
    pub fn decode_blocks(&self, projection: DecodeProjection) -> u64 {
        match projection {
            DecodeProjection::Staged => self.decode_blocks_staged,
            DecodeProjection::Full => self.decode_blocks_full,
        }
    }
}

/// How deep a request's prompt chain already runs in a worker's active sets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActiveDepth {
    /// Leading prompt blocks that are active on the worker.
    pub all: u32,
    /// Leading prompt blocks that are in the worker's staged set.
    pub staged: u32,
}

/// The decode blocks a worker with `role` and `load` would have if a request of `prompt_blocks`
/// blocks, `overlap_blocks` of them cached there, were added; `depth` is how far its chain
/// already runs in the worker's active sets. Workers that track no decode blocks project 0.
pub fn project(
    role: WorkerRole,
    load: &WorkerLoad,
    prompt_blocks: u32,
    overlap_blocks: u32,
    depth: ActiveDepth,
) -> Projection {
    if !role.tracks_decode() {
        return Projection::default();
    }
    let full = load.decode_blocks + u64::from(prompt_blocks.saturating_sub(depth.all));
    let staged = if role.tracks_prefill() {
        let cached = overlap_blocks.min(prompt_blocks);
        load.staged_decode_blocks + u64::from(cached.saturating_sub(depth.staged))
    } else {
        full
    };
    Projection {
        decode_blocks_full: full,
        decode_blocks_staged: staged,
    }
}

/// How many of a request's prompt blocks are in its worker's staged set: on a worker with a
/// prefill term, only the `cached_blocks` prefix while its prefill is pending; otherwise all.
pub(crate) fn staged_len(
    role: WorkerRole,
    prefill_pending: bool,
    cached_blocks: u32,
    prompt_blocks: u32,
) -> u32 {
    if role.tracks_prefill() && prefill_pending {
        cached_blocks.min(prompt_blocks)
    } else {
        prompt_blocks
    }
}

/// Reference counts of one run of active blocks: requests whose prompt covers it, and those of
/// them that count it in the staged set.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Refs {
    pub(crate) all: u32,
    pub(crate) staged: u32,
}

/// One booking of a request on one worker, as the tracker needs it to apply or remove it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Share<'a> {
    /// The request's prompt chain; `None` on workers that track no decode blocks.
    pub(crate) chain: Option<&'a Arc<[SequenceHash]>>,
    /// Blocks of the chain in the staged set.
    pub(crate) staged_len: u32,
    /// The chain's nodes in the active set when it was booked (a hint; see
    /// [`ChainTrie::path`]); empty at booking.
    pub(crate) path: &'a [NodeId],
    /// Prefill tokens booked here, while the prefill is pending.
    pub(crate) prefill_tokens: Option<u64>,
    /// Output blocks booked here.
    pub(crate) output_blocks: u32,
}

/// One worker's booked load; see the module docs.
#[derive(Clone, Debug, Default)]
pub(crate) struct LoadState {
    active: ChainTrie<Refs>,
    staged_blocks: u64,
    output_blocks: u64,
    prefill_tokens: u64,
    prefill_requests: u32,
    requests: u32,
    /// `prefill_tokens` integrated over time, in token-nanoseconds, up to `area_at`.
    prefill_area: u128,
    /// The decode blocks ([`WorkerLoad::decode_blocks`]) integrated over time, in
    /// block-nanoseconds, up to `area_at`.
    decode_area: u128,
    area_at: Timestamp,
}

impl LoadState {
    /// Brings the time integrals of the prefill tokens and the decode blocks up to `now`,
    /// before either changes (a time before the last one adds nothing).
    pub(crate) fn accrue(&mut self, now: Timestamp) {
        (self.prefill_area, self.decode_area) = self.areas_at(now);
        self.area_at = self.area_at.max(now);
    }

    /// The prefill tokens and the decode blocks integrated over time from the first booking to
    /// `now`, in token- and block-nanoseconds: divided by a span, the difference of two
    /// readings is the mean over that span, whatever the instants at which it was read.
    pub(crate) fn areas_at(&self, now: Timestamp) -> (u128, u128) {
        let span = u128::from(now.as_nanos().saturating_sub(self.area_at.as_nanos()));
        let decode_blocks = self.active.blocks() + self.output_blocks;
        (
            self.prefill_area + span * u128::from(self.prefill_tokens),
            self.decode_area + span * u128::from(decode_blocks),
        )
    }

    /// Asks for the cache lines [`LoadState::snapshot`] reads; changes nothing.
    pub(crate) fn prefetch(&self) {
        kvroute_prefetch::prefetch_read(&self.requests);
        kvroute_prefetch::prefetch_read(&self.staged_blocks);
        self.active.prefetch_blocks();
    }

    /// The load as a plain snapshot.
    pub(crate) fn snapshot(&self) -> WorkerLoad {
        WorkerLoad {
            requests: self.requests,
            prefill_requests: self.prefill_requests,
            prefill_tokens: self.prefill_tokens,
            decode_blocks: self.active.blocks() + self.output_blocks,
            staged_decode_blocks: self.staged_blocks + self.output_blocks,
            output_blocks: self.output_blocks,
        }
    }

    /// Requests booked.
    pub(crate) fn requests(&self) -> u32 {
        self.requests
    }

    /// Whether nothing is booked: the snapshot is [`WorkerLoad::default`] and every chain's
    /// [`Self::depth`] is zero.
    pub(crate) fn is_idle(&self) -> bool {
        self.requests == 0
            && self.active.is_empty()
            && self.prefill_tokens == 0
            && self.prefill_requests == 0
            && self.staged_blocks == 0
            && self.output_blocks == 0
    }

    /// How deep `chain` runs in the active and staged sets; `hint` is a likely depth (0 for
    /// none), such as the prompt's cached prefix on this worker.
    pub(crate) fn depth(&self, chain: &[SequenceHash], hint: u32) -> ActiveDepth {
        let mut depth = ActiveDepth::default();
        if self.active.is_empty() {
            return depth;
        }
        let mut staged_open = true;
        for step in self.active.walk_hinted(chain, hint) {
            depth.all = step.matched_end;
            staged_open &= step.meta.staged > 0;
            if staged_open {
                depth.staged = step.matched_end;
            }
        }
        depth
    }

    /// Applies `share`, and leaves the chain's nodes in `scratch.path` (the hint of the share's
    /// later changes; empty without a chain).
    pub(crate) fn book(&mut self, share: Share<'_>, scratch: &mut Touched) {
        self.requests += 1;
        if let Some(tokens) = share.prefill_tokens {
            self.prefill_tokens += tokens;
            self.prefill_requests += 1;
        }
        self.output_blocks += u64::from(share.output_blocks);
        let Some(chain) = share.chain.filter(|c| !c.is_empty()) else {
            scratch.path.clear();
            return;
        };
        self.active
            .insert(chain, chain.len() as u32, &[share.staged_len], scratch);
        for &id in &scratch.path {
            let end = self.active.node(id).end;
            let run = u64::from(self.active.node(id).len());
            let refs = self.active.meta_mut(id);
            refs.all += 1;
            if end <= share.staged_len {
                refs.staged += 1;
                if refs.staged == 1 {
                    self.staged_blocks += run;
                }
            }
        }
    }

    /// The request of `share` produced its first token here: its prefill tokens leave, and its
    /// blocks past `share.staged_len` join the staged set (it now counts all of them).
    pub(crate) fn finish_prefill(&mut self, share: Share<'_>, scratch: &mut Touched) {
        if let Some(tokens) = share.prefill_tokens {
            self.prefill_tokens -= tokens;
            self.prefill_requests -= 1;
        }
        let Some(chain) = share.chain.filter(|c| share.staged_len < c.len() as u32) else {
            return;
        };
        let path = &mut scratch.path;
        self.active.path(chain, chain.len() as u32, share.path, path);
        for &id in path.iter() {
            if self.active.node(id).start < share.staged_len {
                continue;
            }
            let run = u64::from(self.active.node(id).len());
            let refs = self.active.meta_mut(id);
            refs.staged += 1;
            if refs.staged == 1 {
                self.staged_blocks += run;
            }
        }
    }

    /// One more output block for a request booked here.
    pub(crate) fn add_output_block(&mut self) {
        self.output_blocks += 1;
    }

    /// Removes `share`, which must have been booked.
    pub(crate) fn free(&mut self, share: Share<'_>, scratch: &mut Touched) {
        self.requests -= 1;
        if let Some(tokens) = share.prefill_tokens {
            self.prefill_tokens -= tokens;
            self.prefill_requests -= 1;
        }
        self.output_blocks -= u64::from(share.output_blocks);
        let Some(chain) = share.chain.filter(|c| !c.is_empty()) else {
            return;
        };
        let len = chain.len() as u32;
        let path = &mut scratch.path;
        self.active.path(chain, len, share.path, path);
        debug_assert_eq!(
            path.last().map(|&id| self.active.node(id).end),
            Some(len),
            "booked chain not covered"
        );
        for &id in path.iter() {
            let node = self.active.node(id);
            let (end, run) = (node.end, u64::from(node.len()));
            let refs = self.active.meta_mut(id);
            refs.all -= 1;
            if end <= share.staged_len {
                refs.staged -= 1;
                if refs.staged == 0 {
                    self.staged_blocks -= run;
                }
            }
            if refs.all == 0 {
                self.active.remove(id);
            }
        }
    }

    /// Recomputes this worker's totals from `shares` (every booking on it) and compares them
    /// with the running ones, node reference counts included.
    pub(crate) fn check(&self, shares: &[Share<'_>]) -> Result<(), String> {
        use std::collections::HashSet;
        let requests = shares.len() as u32;
        let pending: Vec<u64> = shares.iter().filter_map(|s| s.prefill_tokens).collect();
        let output: u64 = shares.iter().map(|s| u64::from(s.output_blocks)).sum();
        let mut all = HashSet::new();
        let mut staged = HashSet::new();
        let chains = || shares.iter().filter_map(|s| s.chain.map(|c| (c, s.staged_len)));
        for (chain, staged_len) in chains() {
            all.extend(chain.iter().copied());
            staged.extend(chain[..staged_len as usize].iter().copied());
        }
        let expect = (
            requests,
            pending.len() as u32,
            pending.iter().sum::<u64>(),
            output,
            all.len() as u64,
            staged.len() as u64,
        );
        let got = (
            self.requests,
            self.prefill_requests,
            self.prefill_tokens,
            self.output_blocks,
            self.active.blocks(),
            self.staged_blocks,
        );
        if expect != got {
            return Err(format!(
                "(requests, prefill requests, prefill tokens, output blocks, active blocks, staged blocks) are {got:?}, recomputed {expect:?}"
            ));
        }
        for (id, node) in self.active.nodes() {
            let last = node.end as usize - 1;
            let covers = |chain: &Arc<[SequenceHash]>, len: u32| {
                len as usize > last && chain[last] == node.hash_at(last)
            };
            let refs = Refs {
                all: chains().filter(|(c, _)| covers(c, c.len() as u32)).count() as u32,
                staged: chains().filter(|&(c, staged_len)| covers(c, staged_len)).count() as u32,
            };
            if refs != node.meta || refs.all == 0 {
                return Err(format!(
                    "node {id} ({}..{}) has {:?}, recomputed {refs:?}",
                    node.start, node.end, node.meta
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_tokens_clamp_to_the_prompt() {
        assert_eq!(effective_prefill_tokens(100, 0), 100);
        assert_eq!(effective_prefill_tokens(100, 64), 36);
        assert_eq!(effective_prefill_tokens(100, 100), 0);
        assert_eq!(effective_prefill_tokens(100, 128), 0);
    }

    #[test]
    fn hint_uses_the_model_when_given() {
        let model = PrefillModel {
            tokens_per_second: 1000.0,
            fixed_overhead: Duration::from_millis(5),
        };
        let hint = PrefillLoadHint::new(100, 2, 16, Some(&model));
        assert_eq!(hint.tokens, 68);
        assert_eq!(hint.expected_duration, Some(Duration::from_millis(73)));
        assert_eq!(PrefillLoadHint::new(100, 2, 16, None).expected_duration, None);
    }
}
