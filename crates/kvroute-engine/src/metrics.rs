//! What one step did: the forward pass's composition and the engine's load after it.
//!
//! [`ForwardPass`] is both the input of the timing models and the record a planner fits its
//! models on (Dynamo calls these forward-pass metrics). [`StepMetrics`] adds the load a router
//! or a planner reads from an engine: blocks in use, queue lengths, preemptions, cache hits.

use std::time::Duration;

/// The composition of one forward pass.
///
/// A scheduled chunk is **decode** when it is one token of a request that has already produced
/// output (the KV of its last sampled token); every other chunk is **prefill** (a prompt, part of
/// one, or a preempted request's recomputation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForwardPass {
    /// Requests with a prefill chunk in the pass.
    pub prefill_seqs: u32,
    /// Tokens computed by prefill chunks (cache hits excluded).
    pub prefill_tokens: u64,
    /// Tokens already in the KV cache before each prefill chunk (cached prefix or earlier
    /// chunks), summed over chunks: the context prefill attends to without computing.
    pub prefill_context_tokens: u64,
    /// (query, key) pairs attended by prefill tokens: `n·c + n(n+1)/2` for a chunk of `n` tokens
    /// after `c` tokens of context, summed over chunks.
    pub prefill_attention_pairs: u64,
    /// Requests decoding one token each.
    pub decode_seqs: u32,
    /// KV tokens read by decoding requests: each one's context, its new token included, summed.
    pub decode_context_tokens: u64,
    /// KV blocks in use during the pass (held by running requests).
    pub kv_active_blocks: u32,
    /// KV blocks in the cache.
    pub kv_total_blocks: u32,
}

impl ForwardPass {
    /// Tokens computed in the pass, prefill and decode.
    pub fn tokens(&self) -> u64 {
        self.prefill_tokens + u64::from(self.decode_seqs)
    }

    /// Requests in the pass.
    pub fn seqs(&self) -> u32 {
        self.prefill_seqs + self.decode_seqs
    }

    /// The share of KV blocks in use, in `[0, 1]`.
    pub fn kv_utilisation(&self) -> f64 {
        if self.kv_total_blocks == 0 {
            return 0.0;
        }
        (f64::from(self.kv_active_blocks) / f64::from(self.kv_total_blocks)).min(1.0)
    }

    /// Adds a prefill chunk of `new` tokens after `context` tokens already in the cache.
    pub(crate) fn add_prefill(&mut self, new: u32, context: u32) {
        let (n, c) = (u64::from(new), u64::from(context));
        self.prefill_seqs += 1;
        self.prefill_tokens += n;
        self.prefill_context_tokens += c;
        self.prefill_attention_pairs += n * c + n * (n + 1) / 2;
    }

    /// Adds one decoding request with `context` tokens already in the cache.
    pub(crate) fn add_decode(&mut self, context: u32) {
        self.decode_seqs += 1;
        self.decode_context_tokens += u64::from(context) + 1;
    }
}

/// The engine's load and work in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepMetrics {
    /// The forward pass.
    pub pass: ForwardPass,
    /// How long the pass took (its end minus its start).
    pub duration: Duration,
    /// KV blocks held by requests after the step.
    pub active_blocks: u32,
    /// KV blocks in the cache.
    pub total_blocks: u32,
    /// Blocks holding a cached (hit-able) block hash after the step, in use or free.
    pub cached_blocks: u32,
    /// Requests running after the step.
    pub running: u32,
    /// Requests waiting after the step, preempted ones included.
    pub waiting: u32,
    /// Requests preempted in this step.
    pub preemptions: u32,
    /// Requests admitted from the waiting queue in this step (including preempted ones coming
    /// back).
    pub admitted: u32,
    /// Tokens of the admitted requests found in the prefix cache.
    pub prefix_cache_hit_tokens: u64,
    /// Tokens of the admitted requests looked up in the prefix cache (their known tokens), the
    /// denominator of the hit rate.
    pub prefix_cache_query_tokens: u64,
}
