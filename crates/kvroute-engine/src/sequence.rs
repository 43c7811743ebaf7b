//! One request's state inside the engine, and the engine's external block hashes.
//!
//! # External hashes
//!
//! A real engine names its cached blocks with its own digest (vLLM: SHA-256 over the parent's
//! digest, the block's tokens and extra keys), which a router cannot reproduce and must treat as
//! opaque. The engine does the same, so that nothing downstream can come to rely on the engine's
//! names being the router's sequence hashes:
//!
//! ```text
//! external[i] = XXH3_64(le64(external[i-1]) ‖ le64(local[i]), seed = external_hash_seed)
//! external[-1] = EXTERNAL_ROOT
//! ```
//!
//! where `local[i]` is the block's local hash (the router's, salt included, from
//! `kvroute_core::hash`). The router's chain starts with `seq[0] = local[0]` and uses seed 1337;
//! this one hashes block 0 with a root value, so the two differ from the first block on, whatever
//! the seed. Engines configured with different seeds name the same block differently.

use kvroute_core::hash::{HashSalt, PromptHasher};
use kvroute_core::ids::{ExternalBlockHash, LocalBlockHash, RequestId};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::EngineConfig;
use crate::kv_pool::BlockId;
use crate::request::{
    EnginePrompt, EngineRequest, FinishReason, Finished, KvReportMode, RequestError, synthetic_output_token,
};

/// The parent value of the first block of every chain ("kvroute" in ASCII, then `!`).
pub const EXTERNAL_ROOT: u64 = 0x6b76_726f_7574_6521;

/// The engine's external hash of the block with local hash `local` after the block named
/// `parent` (`None` at the start of a sequence). See the module docs.
pub fn external_hash(
    seed: u64,
    parent: Option<ExternalBlockHash>,
    local: LocalBlockHash,
) -> ExternalBlockHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.map_or(EXTERNAL_ROOT, |p| p.0).to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    ExternalBlockHash(xxh3_64_with_seed(&bytes, seed))
}

/// See [`Sequence::decode_marks`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeMarks {
    pub alloc: u32,
    pub fill: u32,
    pub finish: u32,
}

/// A live request: its tokens, their block hashes, the blocks it holds and its progress.
///
/// A pass reads its running requests' progress and blocks: those fields come first and fill
/// the first cache line (a walk of the running requests reads that line by slot, and a lookup
/// by id checks the `id` there, see [`crate::live`]); the tokens, hashes and names, read when a
/// block fills, follow.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct Sequence {
    pub id: RequestId,
    /// Tokens whose KV has been (or, in the pass being scheduled, is being) computed.
    pub num_computed: u32,
    /// Output tokens produced.
    pub outputs: u32,
    /// Tokens it will produce: the requested output, cut at `max_model_len`.
    pub max_output: u32,
    /// Prompt tokens (the given blocks' included).
    prompt_len: u32,
    /// Leading blocks this request has offered to the cache (hits included).
    pub num_cached_blocks: u32,
    /// Tokens per block.
    block_size: u32,
    /// KV blocks held, in token order.
    pub blocks: Vec<BlockId>,
    /// Whether `max_output` was cut.
    pub truncated: bool,
    /// Whether `tokens` holds the real prompt (false for block-hash prompts).
    pub token_ids_known: bool,
    /// What its KV events report of its prefix-cache hits.
    pub kv_report: KvReportMode,
    /// Prompt then output tokens from token `offset` on, up to the end of the last full block
    /// at least: an output token is written out when a block it is in fills (it is
    /// [`synthetic_output_token`], so nothing else needs it earlier). For a block-hash prompt,
    /// `offset` skips the given blocks (their tokens are never needed) and the prompt's tail
    /// is zeros.
    tokens: Vec<u32>,
    /// Tokens before `tokens[0]`: the given blocks' (zero for a token prompt).
    offset: u32,
    /// Local and external hashes of every full block.
    pub locals: Vec<LocalBlockHash>,
    pub externals: Vec<ExternalBlockHash>,
    /// Prompt blocks whose local hash was given instead of tokens.
    given: Vec<LocalBlockHash>,
    external_seed: u64,
    pub lora_name: Option<String>,
    /// Its `cache_salt` (cache namespace), which salts its first block.
    pub cache_salt: Option<String>,
    hasher: PromptHasher,
}

// What a pass reads of a running request (up to its report mode) stays on its first line.
const _: () = assert!(
    std::mem::offset_of!(Sequence, kv_report) + std::mem::size_of::<KvReportMode>() <= 64
        && std::mem::offset_of!(Sequence, blocks) < 64
);

impl Sequence {
    /// The output `request` may generate under `config` (its `output_len`, capped by
    /// `max_model_len`), or why it can never run there: the one admission rule of requests and
    /// imports alike, checked before any state changes.
    pub fn admissible(request: &EngineRequest, config: &EngineConfig) -> Result<u32, RequestError> {
        let id = request.id;
        let bs = config.block_size;
        let prompt_len = request.prompt.len();
        if prompt_len == 0 {
            return Err(RequestError::EmptyPrompt(id));
        }
        if prompt_len >= config.max_model_len {
            return Err(RequestError::PromptTooLong {
                id,
                prompt_len,
                max_model_len: config.max_model_len,
            });
        }
        let max_output = request.output_len.min(config.max_model_len - prompt_len);
        // The last output token is sampled but never fed back, so its KV is never computed.
        let peak_tokens = u64::from(prompt_len) + u64::from(max_output.saturating_sub(1));
        let blocks_needed = peak_tokens.div_ceil(u64::from(bs));
        if blocks_needed > u64::from(config.num_blocks) {
            return Err(RequestError::ExceedsCache {
                id,
                blocks_needed,
                total_blocks: config.num_blocks,
            });
        }
        Ok(max_output)
    }

    /// The request's state, or why it cannot be accepted under `config`.
    pub fn new(request: EngineRequest, config: &EngineConfig) -> Result<Self, RequestError> {
        let id = request.id;
        let bs = config.block_size;
        let prompt_len = request.prompt.len();
        let max_output = Self::admissible(&request, config)?;
        let peak_tokens = u64::from(prompt_len) + u64::from(max_output.saturating_sub(1));
        let blocks_needed = peak_tokens.div_ceil(u64::from(bs));
        let salt = HashSalt {
            lora_name: request.lora_name.as_deref(),
            namespace: request.cache_namespace.as_deref(),
        };
        let hasher = PromptHasher::new(bs as usize, &salt);
        let (tokens, given, token_ids_known) = match request.prompt {
            EnginePrompt::Tokens(tokens) => (tokens, Vec::new(), true),
            EnginePrompt::Blocks { hashes, len } => {
                let blocks = hashes.len();
                if blocks as u64 != u64::from(len / bs) {
                    return Err(RequestError::BlockCountMismatch {
                        id,
                        blocks,
                        len,
                        block_size: bs,
                    });
                }
                let tail = (len - blocks as u32 * bs) as usize;
                let mut tokens = Vec::with_capacity(tail + max_output as usize);
                tokens.resize(tail, 0);
                (tokens, hashes, false)
            }
        };
        let offset = given.len() as u32 * bs;
        let mut seq = Self {
            id,
            max_output,
            prompt_len,
            block_size: bs,
            truncated: max_output < request.output_len,
            tokens,
            offset,
            token_ids_known,
            lora_name: request.lora_name,
            cache_salt: request.cache_namespace,
            kv_report: request.kv_report,
            hasher,
            given,
            locals: Vec::with_capacity(blocks_needed as usize),
            externals: Vec::with_capacity(blocks_needed as usize),
            external_seed: config.external_hash_seed,
            blocks: Vec::with_capacity(blocks_needed as usize),
            num_computed: 0,
            num_cached_blocks: 0,
            outputs: 0,
        };
        seq.tokens.reserve(max_output as usize);
        seq.hash_full_blocks();
        Ok(seq)
    }

    /// Tokens known: the prompt and the outputs so far.
    pub fn len(&self) -> u32 {
        self.prompt_len + self.outputs
    }

    /// Tokens known whose KV is not computed yet.
    pub fn remaining(&self) -> u32 {
        self.len() - self.num_computed
    }

    /// While it decodes one token a pass, the pure passes before each thing its own state
    /// makes happen: its first new block, its first block completed (cached; `u32::MAX`
    /// without prefix caching), and its last token. Afterwards a block is allocated and one
    /// completed every `block_size` passes. `None` when its next pass is not a decode, or its
    /// blocks are not those its computed tokens need.
    pub fn decode_marks(&self, block_size: u32, prefix_caching: bool) -> Option<DecodeMarks> {
        if self.outputs == 0 || self.remaining() != 1 {
            return None;
        }
        let c = self.num_computed;
        let alloc = (self.blocks.len() as u32 * block_size).checked_sub(c)?;
        let fill = if prefix_caching {
            ((self.num_cached_blocks + 1) * block_size - 1).checked_sub(c)?
        } else {
            u32::MAX
        };
        Some(DecodeMarks {
            alloc,
            fill,
            finish: (self.max_output - self.outputs).saturating_sub(1),
        })
    }

    /// Whether it has produced all its output.
    pub fn is_done(&self) -> bool {
        self.outputs == self.max_output
    }

    /// Why it finished (meaningful once [`Sequence::is_done`]).
    pub fn finish_reason(&self) -> FinishReason {
        if self.truncated {
            FinishReason::Length
        } else {
            FinishReason::Stop
        }
    }

    /// Its end as a pass reports it, once it [`Sequence::is_done`].
    pub fn finished(&self) -> Finished {
        Finished {
            request: self.id,
            output_tokens: self.outputs,
            reason: self.finish_reason(),
        }
    }

    /// Appends the next `k` output tokens and hashes the blocks they fill, as `k` calls of
    /// [`Sequence::push_output`].
    pub fn push_outputs(&mut self, k: u32) {
        let full = self.len() / self.block_size;
        self.outputs += k;
        if self.len() / self.block_size > full {
            self.hash_full_blocks();
        }
    }

    /// Appends the next output token and hashes the block it fills, if any.
    pub fn push_output(&mut self) {
        self.push_outputs(1);
    }

    /// The tokens of block `index`, which must not be a given block.
    pub fn block_tokens(&self, index: usize) -> &[u32] {
        let bs = self.hasher.block_size();
        let start = index * bs - self.offset as usize;
        &self.tokens[start..start + bs]
    }

    /// Extends `locals` and `externals` over every full block, writing out the output tokens
    /// not yet written.
    fn hash_full_blocks(&mut self) {
        let written = self.offset + self.tokens.len() as u32 - self.prompt_len;
        self.tokens
            .extend((written..self.outputs).map(|i| synthetic_output_token(self.id, i)));
        let full = (self.len() / self.block_size) as usize;
        while self.locals.len() < full {
            let i = self.locals.len();
            let local = match self.given.get(i) {
                Some(&given) => given,
                None => self.hasher.local_hash(i, self.block_tokens(i)),
            };
            let external = external_hash(self.external_seed, self.externals.last().copied(), local);
            self.locals.push(local);
            self.externals.push(external);
        }
    }
}
