//! What goes into the engine (requests) and what comes out per request (tokens, completions).

use kvroute_core::ids::{LocalBlockHash, RequestId};

/// A request as the engine receives it.
///
/// `output_len` is the true number of tokens the request will generate, which in reality only
/// the model knows (it stops at an end-of-sequence token). The engine uses it to decide when the
/// request finishes; nothing that routes or admits requests should read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    /// The caller's name for the request; unique among the engine's live requests.
    pub id: RequestId,
    /// The prompt.
    pub prompt: EnginePrompt,
    /// Tokens the request will generate (cut at `max_model_len`). Zero is allowed: the prompt is
    /// computed and cached, and the request finishes without emitting a token.
    pub output_len: u32,
    /// The LoRA adapter; it salts the block hashes and is reported in KV events.
    pub lora_name: Option<String>,
    /// A cache namespace (vLLM's `cache_salt`, a tenant): it salts the block hashes.
    pub cache_namespace: Option<String>,
    /// What its KV events report of its prefix-cache hits (vLLM's `kv_cache_report_mode`).
    pub kv_report: KvReportMode,
}

/// What the engine's KV events report of a request's prefix-cache hits: vLLM's per-request
/// `kv_cache_report_mode` (0.32, read from the request's `vllm_xargs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvReportMode {
    /// Only blocks newly cached are announced: vLLM's default (`incremental`).
    #[default]
    Incremental,
    /// Each time the request's prefix is looked up in the cache (when the scheduler tries to
    /// admit it) and hits, the hit is announced again: one `Stored` event of every hit block,
    /// from the root (no parent), with their tokens, before the blocks the request then caches
    /// (vLLM's `KVCacheManager.get_computed_blocks` → `BlockPool.emit_cached_block_events`).
    /// A request that waits is looked up, and re-announces, at each try.
    Full,
}

/// A prompt: token ids, or the local hashes of its full blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnginePrompt {
    /// The prompt's token ids.
    Tokens(Vec<u32>),
    /// A prompt known only by the local hashes of its full blocks, as trace files give it
    /// (already salted, if a salt applies), and its length in tokens: `hashes.len()` full blocks
    /// and fewer than `block_size` tokens after them. The engine uses the hashes as given;
    /// the prompt's token ids are unknown, so its KV events carry none.
    Blocks {
        /// Local hashes of the full blocks, in order.
        hashes: Vec<LocalBlockHash>,
        /// Prompt length in tokens.
        len: u32,
    },
}

impl EnginePrompt {
    /// Prompt length in tokens.
    pub fn len(&self) -> u32 {
        match self {
            EnginePrompt::Tokens(tokens) => u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            EnginePrompt::Blocks { len, .. } => *len,
        }
    }

    /// Whether the prompt has no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why a request was not accepted. Rejection is decided when the request is added, before it
/// takes part in any step.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestError {
    /// A live request already has this id.
    #[error("request {0:?} is already in the engine")]
    DuplicateId(RequestId),
    /// The prompt has no token.
    #[error("request {0:?} has an empty prompt")]
    EmptyPrompt(RequestId),
    /// A block-hash prompt's length does not match its number of blocks.
    #[error(
        "request {id:?}: {blocks} full blocks of {block_size} tokens cannot make a prompt of {len} tokens"
    )]
    BlockCountMismatch {
        /// The request.
        id: RequestId,
        /// Blocks given.
        blocks: usize,
        /// Length given.
        len: u32,
        /// The engine's block size.
        block_size: u32,
    },
    /// The prompt leaves no room to generate within `max_model_len`.
    #[error(
        "request {id:?}: prompt of {prompt_len} tokens leaves no room under max_model_len {max_model_len}"
    )]
    PromptTooLong {
        /// The request.
        id: RequestId,
        /// Prompt tokens.
        prompt_len: u32,
        /// The engine's limit.
        max_model_len: u32,
    },
    /// An imported request (see `Engine::import_request`) must generate at least one token
    /// after the one its prefilling engine sampled.
    #[error("request {0:?} has no token left to decode after its prefill")]
    NothingToDecode(RequestId),
    /// An imported request's prompt blocks are not free now.
    #[error("request {id:?} needs {blocks_needed} KV blocks for its transfer; {blocks_free} are free")]
    NoBlocksForImport {
        /// The request.
        id: RequestId,
        /// Blocks its prompt takes (cache hits included).
        blocks_needed: u32,
        /// Blocks free (cached ones included).
        blocks_free: u32,
    },
    /// `Engine::complete_import` for a request that is not being imported.
    #[error("request {0:?} is not being imported")]
    NotImporting(RequestId),
    /// The request's KV would not fit even in the whole, empty cache, so it could never finish.
    #[error("request {id:?} needs {blocks_needed} KV blocks; the cache has {total_blocks}")]
    ExceedsCache {
        /// The request.
        id: RequestId,
        /// Blocks it would hold at its longest.
        blocks_needed: u64,
        /// Blocks in the cache.
        total_blocks: u32,
    },
}

/// Tokens a request produced in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenEmission {
    /// The request.
    pub request: RequestId,
    /// Tokens produced (one per step without speculative decoding).
    pub tokens: u32,
}

/// Why a request finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced its whole output.
    Stop,
    /// It reached `max_model_len` first.
    Length,
}

/// A request that finished in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub request: RequestId,
    /// Tokens it produced in all.
    pub output_tokens: u32,
    /// Why it finished.
    pub reason: FinishReason,
}

/// The token id the engine generates as output token `index` (from 0) of `request`.
///
/// The engine does not run a model, so its outputs are made up, deterministically: the low 32
/// bits of `XXH3_64(le64(request) ‖ le32(index), seed 0)`. A simulator that builds a conversation's
/// next turn from this turn's output computes the same tokens with this function.
pub fn synthetic_output_token(request: RequestId, index: u32) -> u32 {
    // XXH3's path for 9 to 16 bytes (`xxh3_64_9to16`), written out for these 12 bytes, the
    // default secret and seed 0, in registers. Built as a byte array, the input was written in
    // two stores and its last 8 bytes read back across both (at offset 4): a store-to-load
    // forward that fails, a stall on every output token of every simulated engine. The values
    // are `xxh3_64_with_seed`'s (`tests::output_tokens_are_xxh3_of_their_twelve_bytes`).
    /// The default secret's bytes 24..32 xor 32..40, and 40..48 xor 48..56.
    const FLIP: (u64, u64) = (0x6782_737b_ea42_39b9, 0xaf56_bc3b_0996_523a);
    const LEN: u64 = 12;
    let lo = request.0 ^ FLIP.0;
    let hi = (request.0 >> 32 | u64::from(index) << 32) ^ FLIP.1;
    let product = u128::from(lo) * u128::from(hi);
    let acc = LEN
        .wrapping_add(lo.swap_bytes())
        .wrapping_add(hi)
        .wrapping_add(product as u64 ^ (product >> 64) as u64);
    // XXH3's avalanche.
    let h = (acc ^ acc >> 37).wrapping_mul(0x1656_6791_9e37_79f9);
    (h ^ h >> 32) as u32
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use xxhash_rust::xxh3::xxh3_64_with_seed;

    use super::*;

    /// The token as the doc defines it: XXH3 of the 12 bytes.
    fn by_definition(request: u64, index: u32) -> u32 {
        let mut bytes = [0u8; 12];
        bytes[..8].copy_from_slice(&request.to_le_bytes());
        bytes[8..].copy_from_slice(&index.to_le_bytes());
        xxh3_64_with_seed(&bytes, 0) as u32
    }

    #[test]
    fn output_tokens_are_xxh3_of_their_twelve_bytes_at_the_edges() {
        for request in [0, 1, 7, u64::from(u32::MAX), 1 << 32, u64::MAX - 1, u64::MAX] {
            for index in [0, 1, 2, 511, u32::MAX - 1, u32::MAX] {
                assert_eq!(
                    synthetic_output_token(RequestId(request), index),
                    by_definition(request, index),
                    "request {request}, index {index}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn output_tokens_are_xxh3_of_their_twelve_bytes(request in any::<u64>(), index in any::<u32>()) {
            prop_assert_eq!(synthetic_output_token(RequestId(request), index), by_definition(request, index));
        }
    }
}
