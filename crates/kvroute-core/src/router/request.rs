//! A request as the router sees it: a prompt (token ids or block hashes), its cache namespace,
//! a priority and an optional output-length hint. Never its true output length: the router
//! cannot know it, so the type has no place for it.

use std::sync::Arc;

use crate::hash::{BlockHasher, next_sequence_hash};
use crate::ids::{LocalBlockHash, RequestId, SequenceHash};
use crate::time::Timestamp;

/// A request's prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// Token ids. The router hashes full blocks at its block size under the request's salt.
    Tokens(&'a [u32]),
    /// Local hashes of the full blocks, computed by the caller at the router's block size with
    /// the salt already applied, and the prompt's length in tokens (at least `locals.len()`
    /// blocks' worth; a trailing partial block is not hashed but is prefilled).
    Blocks {
        /// Local hashes of the full blocks, in order.
        locals: &'a [LocalBlockHash],
        /// Prompt length in tokens.
        prompt_tokens: u64,
    },
}

/// A request to route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteRequest<'a> {
    /// The caller's id; unique among the router's active and queued requests.
    pub id: RequestId,
    /// The prompt.
    pub prompt: Prompt<'a>,
    /// The LoRA adapter, which salts the block hashes of token prompts.
    pub lora_name: Option<&'a str>,
    /// A cache namespace (a tenant, an explicit `cache_salt`), which salts them too.
    pub cache_salt: Option<&'a str>,
    /// Queue priority: higher goes first. Only the queue reads it.
    pub priority: i32,
    /// The caller's guess of the output length in tokens, if any. A hint, carried into replica
    /// events; no policy reads it yet.
    pub expected_output_tokens: Option<u32>,
}

impl<'a> RouteRequest<'a> {
    /// A request for `prompt` with no salt, priority 0 and no output hint.
    pub fn new(id: RequestId, prompt: Prompt<'a>) -> Self {
        Self {
            id,
            prompt,
            lora_name: None,
            cache_salt: None,
            priority: 0,
            expected_output_tokens: None,
        }
    }
}

/// What policies see of the request being routed.
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    /// The time of the decision.
    pub now: Timestamp,
    /// The request.
    pub id: RequestId,
    /// Prompt length in tokens.
    pub prompt_tokens: u64,
    /// Tokens per block.
    pub block_size: u32,
    /// Sequence hashes of the prompt's full blocks.
    pub chain: &'a Arc<[SequenceHash]>,
}

impl RequestView<'_> {
    /// Full blocks in the prompt.
    pub fn prompt_blocks(&self) -> u32 {
        self.chain.len() as u32
    }
}

/// Hashes the full blocks of `tokens` into their local hashes and their sequence hashes (both
/// vectors are cleared first), in one pass, so the latency of each chain step overlaps the next
/// block's local hash. The values are those of [`BlockHasher::local_hashes`] and
/// [`BlockHasher::sequence_hashes`].
pub fn hash_prompt(
    hasher: &BlockHasher,
    tokens: &[u32],
    locals: &mut Vec<LocalBlockHash>,
    chain: &mut Vec<SequenceHash>,
) {
    locals.clear();
    chain.clear();
    let mut prev = None;
    for block in tokens.chunks_exact(hasher.block_size()) {
        let local = hasher.local_hash(block);
        let seq = next_sequence_hash(prev, local);
        locals.push(local);
        chain.push(seq);
        prev = Some(seq);
    }
}

/// The sequence hashes of `locals` into `chain` (cleared first).
pub fn chain_hashes(locals: &[LocalBlockHash], chain: &mut Vec<SequenceHash>) {
    chain.clear();
    let mut prev = None;
    for &local in locals {
        let seq = next_sequence_hash(prev, local);
        chain.push(seq);
        prev = Some(seq);
    }
}

/// A request after hashing, as it is booked or waits in the queue.
#[derive(Clone, Debug)]
pub(crate) struct Prepared {
    pub(crate) id: RequestId,
    pub(crate) arrived: Timestamp,
    pub(crate) prompt_tokens: u64,
    pub(crate) chain: Arc<[SequenceHash]>,
    pub(crate) priority: i32,
    pub(crate) expected_output_tokens: Option<u32>,
}

impl Prepared {
    /// The policy's view of this request at `now`.
    pub(crate) fn view(&self, now: Timestamp, block_size: u32) -> RequestView<'_> {
        RequestView {
            now,
            id: self.id,
            prompt_tokens: self.prompt_tokens,
            block_size,
            chain: &self.chain,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::HashSalt;

    #[test]
    fn one_pass_hashing_matches_the_two_pass_functions() {
        let tokens: Vec<u32> = (0..100).map(|i| i * 7 + 3).collect();
        let hasher = BlockHasher::new(
            16,
            &HashSalt {
                lora_name: Some("a"),
                namespace: None,
            },
        );
        let (mut locals, mut chain) = (Vec::new(), Vec::new());
        hash_prompt(&hasher, &tokens, &mut locals, &mut chain);
        assert_eq!(locals, hasher.local_hashes(&tokens));
        assert_eq!(chain, hasher.sequence_hashes(&locals));
        let mut again = Vec::new();
        chain_hashes(&locals, &mut again);
        assert_eq!(again, chain);
    }
}
