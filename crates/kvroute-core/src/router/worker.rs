//! What the router knows about a worker before any request: its role and its limits.

use std::fmt;

use crate::ids::WorkerKey;

/// The phases of a request a worker runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WorkerRole {
    /// Runs both prefill and decode (no disaggregation).
    Aggregated,
    /// Runs only prefills; its requests leave when their first token is out.
    Prefill,
    /// Runs decodes, with the prompt's KV computed by a prefill worker (or by itself when the
    /// disaggregation decider says no).
    Decode,
}

impl WorkerRole {
    /// Whether the router books prefill tokens on this worker. Decode workers get no prefill
    /// term, as in Dynamo's decode pool (prefill tracking off).
    pub fn tracks_prefill(self) -> bool {
        matches!(self, Self::Aggregated | Self::Prefill)
    }

    /// Whether the router books active blocks on this worker. Prefill workers track no decode
    /// blocks, as in Dynamo's prefill pool (active-block tracking off).
    pub fn tracks_decode(self) -> bool {
        matches!(self, Self::Aggregated | Self::Decode)
    }

    /// The role's short name: `agg`, `prefill` or `decode`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Aggregated => "agg",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A worker (one data-parallel rank of one engine) as the router is told about it.
///
/// Every field may take any value except that `capacity_blocks` must be at least 1 (checked when
/// the worker is added).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerSpec {
    /// The worker and data-parallel rank.
    pub key: WorkerKey,
    /// Which phases it runs.
    pub role: WorkerRole,
    /// KV-cache capacity in blocks (the denominator of the decode busy threshold and of llm-d's
    /// KV-utilization score).
    pub capacity_blocks: u64,
    /// The engine's per-step token budget (vLLM `max_num_batched_tokens`), the denominator of
    /// the fractional prefill busy threshold.
    pub max_batched_tokens: u64,
    /// The engine's concurrent-sequence limit (vLLM `max_num_seqs`), the denominator of the
    /// fractional request busy threshold.
    pub max_requests: u64,
}

impl WorkerSpec {
    /// vLLM's default `max_num_batched_tokens` for online serving.
    pub const DEFAULT_MAX_BATCHED_TOKENS: u64 = 8192;
    /// vLLM's default `max_num_seqs`.
    pub const DEFAULT_MAX_REQUESTS: u64 = 256;

    /// A worker with vLLM's default batch limits ([`Self::DEFAULT_MAX_BATCHED_TOKENS`],
    /// [`Self::DEFAULT_MAX_REQUESTS`]); set the fields to change them.
    pub fn new(key: WorkerKey, role: WorkerRole, capacity_blocks: u64) -> Self {
        Self {
            key,
            role,
            capacity_blocks,
            max_batched_tokens: Self::DEFAULT_MAX_BATCHED_TOKENS,
            max_requests: Self::DEFAULT_MAX_REQUESTS,
        }
    }
}
