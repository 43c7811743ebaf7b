//! A request as the router sees it: a prompt (token ids or block hashes), its cache namespace,
//! a priority and an optional output-length hint. Never its true output length: the router
//! cannot know it, so the type has no place for it.

use std::sync::Arc;

use super::fair::TenantId;
use super::session::SessionId;
use crate::hash::PromptHashes;
use crate::ids::{LocalBlockHash, RequestId, SequenceHash};
use crate::time::Timestamp;

/// A request's prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prompt<'a> {
    /// Token ids. The router hashes full blocks at its block size under the request's salt.
    Tokens(&'a [u32]),
    /// Token ids continuing an earlier prompt whose hashes the caller kept (a conversation's
    /// previous turn): the router hashes only the blocks past `earlier`'s
    /// ([`PromptHasher::hash_prompt_after`], which falls back to hashing the whole prompt when
    /// `earlier` was hashed under another block size or salt). The caller vouches that the
    /// earlier prompt's tokens are the first of `tokens`.
    ///
    /// [`PromptHasher::hash_prompt_after`]: crate::hash::PromptHasher::hash_prompt_after
    Continues {
        /// All the prompt's token ids, the earlier prompt's first.
        tokens: &'a [u32],
        /// The earlier prompt's hashes.
        earlier: &'a PromptHashes,
    },
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
    /// Queue priority: higher goes first. Only the queue reads it. (vLLM's `priority` field
    /// is the other way round, lower first: a driver converts at its edge.)
    pub priority: i32,
    /// The tenant, whose fair share of tokens orders the queue within a priority tier and
    /// whose counter the booking charges ([`super::FairConfig`]).
    pub tenant: TenantId,
    /// The caller's guess of the output length in tokens, if any. A hint, carried into replica
    /// events; no policy reads it yet.
    pub expected_output_tokens: Option<u32>,
    /// The conversation it belongs to, for session affinity (see the `session` module).
    pub session: Option<SessionId>,
}

impl<'a> RouteRequest<'a> {
    /// A request for `prompt` with no salt, priority 0, of no configured tenant, no output hint
    /// and no session.
    pub fn new(id: RequestId, prompt: Prompt<'a>) -> Self {
        Self {
            id,
            prompt,
            lora_name: None,
            cache_salt: None,
            priority: 0,
            tenant: TenantId::OTHER,
            expected_output_tokens: None,
            session: None,
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
    /// How loaded the fleet is, in `[0, 1]`: the load of its least loaded worker that computes
    /// prompts (see `Router::fleet_load`); 0 while one of them has nothing booked, and when no
    /// policy of the router weighs it (`fleet_weight` 0).
    pub fleet_load: f64,
}

impl RequestView<'_> {
    /// Full blocks in the prompt.
    pub fn prompt_blocks(&self) -> u32 {
        self.chain.len() as u32
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
    pub(crate) tenant: TenantId,
    pub(crate) expected_output_tokens: Option<u32>,
    pub(crate) session: Option<SessionId>,
    /// The LoRA adapter the request names: only workers serving it may take it.
    pub(crate) adapter: Option<Arc<str>>,
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
            fleet_load: 0.0,
        }
    }
}
