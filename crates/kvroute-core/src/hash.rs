//! Block hashing, compatible with Dynamo's KV router.
//!
//! A prompt is cut into blocks of `block_size` tokens; only full blocks are hashed, and a
//! trailing partial block is ignored.
//!
//! * Local hash of block `i`: `XXH3_64(token ids of the block as u32 little-endian bytes, seed)`,
//!   where `seed` is [`XXH3_SEED`] (1337) unless a salt is set (below).
//! * Sequence hash: `seq[0] = local[0]`, and
//!   `seq[i] = XXH3_64(le64(seq[i-1]) ‖ le64(local[i]), seed = 1337)` for `i > 0`. The chain
//!   seed is always 1337, salted or not: a salt already changes `local[0]` and with it the whole
//!   chain.
//!
//! **Salt.** A LoRA adapter name and a cache namespace (for example a tenant) must not share
//! cache entries with other adapters or namespaces. Both change the *local* hash seed:
//!
//! ```text
//! seed = 1337 wrapping_add XXH3_64(lora_name bytes, seed 0) wrapping_add XXH3_64(namespace bytes, seed 1)
//! ```
//!
//! where an absent or empty string adds nothing, so an empty salt gives the unsalted hashes.
//! This is the rule of Dynamo's `compute_salt_hash`, so salted hashes can be cross-checked too.

use std::sync::Arc;

use xxhash_rust::const_xxh3::const_custom_default_secret;
use xxhash_rust::xxh3::{xxh3_64_with_secret, xxh3_64_with_seed};

use crate::ids::{LocalBlockHash, SequenceHash};

/// The XXH3 seed of Dynamo's router, for local hashes without a salt and for the chain.
pub const XXH3_SEED: u64 = 1337;

/// What separates one cache namespace from another: an optional LoRA adapter name and an
/// optional cache namespace. Empty strings count as absent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HashSalt<'a> {
    /// The LoRA adapter the request runs under.
    pub lora_name: Option<&'a str>,
    /// A cache namespace, such as a tenant or an explicit `cache_salt`.
    pub namespace: Option<&'a str>,
}

impl HashSalt<'_> {
    /// No salt: the plain hashes.
    pub const NONE: HashSalt<'static> = HashSalt {
        lora_name: None,
        namespace: None,
    };

    /// The XXH3 seed for local block hashes under this salt.
    pub fn local_seed(&self) -> u64 {
        let part = |s: Option<&str>, seed: u64| match s {
            Some(s) if !s.is_empty() => xxh3_64_with_seed(s.as_bytes(), seed),
            _ => 0,
        };
        XXH3_SEED
            .wrapping_add(part(self.lora_name, 0))
            .wrapping_add(part(self.namespace, 1))
    }
}

/// Hashes token ids into block hashes at one block size and salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
    /// The seed's key words for blocks of 17 to 128 bytes, derived once.
    keys: ShortKeys,
    long: LongSecret,
}

/// Inputs longer than this many bytes take XXH3's long path, which derives a 192-byte secret
/// from the seed on every call (`xxh3_64_with_seed`); with that secret derived once,
/// `xxh3_64_with_secret` gives the same value for them.
const XXH3_MIDSIZE_MAX: usize = 240;

/// The seed's XXH3 secret, derived once for blocks past [`XXH3_MIDSIZE_MAX`] bytes (more than 60
/// tokens, such as 64-token blocks); `None` for shorter blocks, which never use it.
#[derive(Clone, Copy, PartialEq, Eq)]
struct LongSecret(Option<[u8; 192]>);

impl std::fmt::Debug for LongSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "derived" } else { "none" })
    }
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens under `salt`.
    ///
    /// A `block_size` of zero is treated as one: a block holds at least one token.
    pub fn new(block_size: usize, salt: &HashSalt<'_>) -> Self {
        Self::with_seed(block_size, salt.local_seed())
    }

    fn with_seed(block_size: usize, seed: u64) -> Self {
        let block_size = block_size.max(1);
        let long = (block_size * 4 > XXH3_MIDSIZE_MAX).then(|| const_custom_default_secret(seed));
        Self {
            block_size,
            seed,
            keys: ShortKeys::new(seed),
            long: LongSecret(long),
        }
    }

    /// XXH3 of a block of any length under this hasher's seed: through the derived secret where
    /// the block takes the long path, else `xxh3_64_with_seed`. The same value either way.
    #[inline]
    fn hash_any(&self, tokens: &[u32]) -> u64 {
        match &self.long.0 {
            Some(secret) if tokens.len() * 4 > XXH3_MIDSIZE_MAX => {
                with_u32_le(tokens, |bytes| xxh3_64_with_secret(bytes, secret))
            }
            _ => hash_u32_le(tokens, self.seed),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The local hash of one block's tokens (any length; callers pass full blocks).
    #[inline]
    pub fn local_hash(&self, tokens: &[u32]) -> LocalBlockHash {
        if let Ok(block) = <&[u32; 16]>::try_from(tokens) {
            return LocalBlockHash(self.keys.hash(block));
        }
        if let Ok(block) = <&[u32; 32]>::try_from(tokens) {
            return LocalBlockHash(self.keys.hash(block));
        }
        LocalBlockHash(self.hash_any(tokens))
    }

    /// Local hashes of every full block of `tokens`.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        fn short<const N: usize>(hasher: &BlockHasher, tokens: &[u32]) -> Vec<LocalBlockHash> {
            tokens
                .chunks_exact(N)
                .map(|block| LocalBlockHash(hasher.keys.hash_chunk::<N>(block, hasher.seed)))
                .collect()
        }
        match self.block_size {
            16 => short::<16>(self, tokens),
            32 => short::<32>(self, tokens),
            _ => tokens
                .chunks_exact(self.block_size)
                .map(|block| LocalBlockHash(self.hash_any(block)))
                .collect(),
        }
    }

    /// Sequence hashes of the chain of `locals`, starting from the root.
    pub fn sequence_hashes(&self, locals: &[LocalBlockHash]) -> Vec<SequenceHash> {
        let mut chain = Vec::with_capacity(locals.len());
        sequence_hashes_into(locals, &mut chain);
        chain
    }

    /// Hashes the full blocks of `tokens` into their local hashes and their sequence hashes (both
    /// vectors are cleared first, so callers can reuse them), in one pass, so the latency of each
    /// chain step overlaps the next block's local hash. The values are those of
    /// [`BlockHasher::local_hashes`] and [`BlockHasher::sequence_hashes`].
    pub fn hash_prompt(
        &self,
        tokens: &[u32],
        locals: &mut Vec<LocalBlockHash>,
        chain: &mut Vec<SequenceHash>,
    ) {
        chain.clear();
        chain.extend_from_slice(&self.hash_prompt_shared(tokens, locals));
    }

    /// [`BlockHasher::hash_prompt`] with the sequence hashes written straight into one shared
    /// allocation, the chain a router books: a long prompt's chain (64 KiB at 128K tokens in
    /// 16-token blocks) is neither grown in a buffer nor copied out of one.
    ///
    /// Blocks of 16 and 32 tokens (64 and 128 bytes) take a specialised XXH3 (see `ShortKeys`):
    /// the same values as `xxh3_64_with_seed`, without its per-call length dispatch, and with
    /// the seeded secret words computed once per hasher.
    pub fn hash_prompt_shared(
        &self,
        tokens: &[u32],
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        self.hash_from(tokens, &[], None, locals)
    }

    /// The chain of a prompt whose first blocks' sequence hashes are `known` (their local hashes
    /// the first `known.len()` of `locals`), followed by the full blocks of `tokens`: `tokens`'
    /// local hashes follow them in `locals` (whatever else it held is cut); the result holds
    /// `known` and the new blocks' sequence hashes, in one allocation. When nothing is known,
    /// `first_seed` (if any) is the first block's local seed (a cache salt's).
    fn hash_from(
        &self,
        tokens: &[u32],
        known: &[SequenceHash],
        first_seed: Option<u64>,
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        match (self.block_size, known.is_empty()) {
            (16, true) => self.hash_blocks::<16>(tokens, first_seed, locals),
            (32, true) => self.hash_blocks::<32>(tokens, first_seed, locals),
            (16, false) => self.hash_blocks_after::<16>(tokens, known, locals),
            (32, false) => self.hash_blocks_after::<32>(tokens, known, locals),
            _ => self.hash_any_blocks_after(tokens, known, first_seed, locals),
        }
    }

    /// [`BlockHasher::hash_from`] with nothing known, for blocks of `N` tokens, `N` in 5..=32.
    fn hash_blocks<const N: usize>(
        &self,
        tokens: &[u32],
        first_seed: Option<u64>,
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        debug_assert_eq!(N, self.block_size);
        let keys = &self.keys;
        let mut blocks = tokens.chunks_exact(N);
        // Sized up front and written through `iter_mut`: no capacity check per block. Every
        // entry is written below, so what a longer earlier prompt left is overwritten, not zeroed
        // first (a 64 KiB `memset` per 128K-token prompt).
        locals.resize(blocks.len(), LocalBlockHash(0));
        let (Some(first), Some((first_local, rest_locals))) = (blocks.next(), locals.split_first_mut())
        else {
            return Arc::new([]);
        };
        // A cache salt's first block under its own seed, in this one pass: chained once.
        let mut prev = match first_seed {
            Some(seed) => hash_u32_le(first, seed),
            None => keys.hash_chunk::<N>(first, self.seed),
        };
        *first_local = LocalBlockHash(prev);
        // One pass: each chain step (a latency chain of about 13 cycles) overlaps the next
        // blocks' local hashes, which do not depend on it. `once` chained to a zip of slices
        // has an exact length, so the `Arc` is allocated once and filled in place. (The same
        // loop as `hash_blocks_after`'s, kept apart: written as that one is, through a zeroed
        // `Arc`, this one ran 5 % slower.)
        std::iter::once(SequenceHash(prev))
            .chain(blocks.zip(rest_locals).map(|(block, slot)| {
                let local = keys.hash_chunk::<N>(block, self.seed);
                *slot = LocalBlockHash(local);
                prev = chain_step(prev, local);
                SequenceHash(prev)
            }))
            .collect()
    }

    /// [`BlockHasher::hash_from`] for blocks of `N` tokens, `N` in 5..=32, after `known` (not
    /// empty: else [`BlockHasher::hash_blocks`]).
    ///
    /// One pass: each chain step (a latency chain of about 13 cycles) overlaps the next blocks'
    /// local hashes, which do not depend on it. The chain is written into its one shared allocation through plain
    /// slices, the known part copied whole (a `memcpy`, where an iterator chained to the new
    /// hashes copied it hash by hash), and the local hashes are appended as an exact-length
    /// extend (one capacity check).
    fn hash_blocks_after<const N: usize>(
        &self,
        tokens: &[u32],
        known: &[SequenceHash],
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        debug_assert_eq!(N, self.block_size);
        debug_assert!(known.len() <= locals.len());
        let keys = &self.keys;
        let blocks = tokens.chunks_exact(N);
        let start = known.len();
        locals.truncate(start);
        shared_chain(start + blocks.len(), |chain| {
            let (head, new) = chain.split_at_mut(start);
            head.copy_from_slice(known);
            let (mut blocks, mut slots) = (blocks, new.iter_mut());
            // The root block, when nothing is known: its sequence hash is its local hash.
            let mut prev = match known.last() {
                Some(last) => last.0,
                None => {
                    let (Some(block), Some(slot)) = (blocks.next(), slots.next()) else {
                        return;
                    };
                    let local = keys.hash_chunk::<N>(block, self.seed);
                    locals.push(LocalBlockHash(local));
                    *slot = SequenceHash(local);
                    local
                }
            };
            locals.extend(blocks.zip(slots).map(|(block, slot)| {
                let local = keys.hash_chunk::<N>(block, self.seed);
                prev = chain_step(prev, local);
                *slot = SequenceHash(prev);
                LocalBlockHash(local)
            }));
        })
    }

    /// [`BlockHasher::hash_from`] for any block size, through `xxh3_64_with_seed`.
    fn hash_any_blocks_after(
        &self,
        tokens: &[u32],
        known: &[SequenceHash],
        first_seed: Option<u64>,
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        debug_assert!(known.len() <= locals.len());
        locals.truncate(known.len());
        locals.reserve(tokens.len() / self.block_size);
        let mut prev = known.last().copied();
        // `chunks_exact` mapped has an exact length, so the `Arc` is allocated once and filled in
        // place; each chain step's latency overlaps the next block's local hash.
        known
            .iter()
            .copied()
            .chain(tokens.chunks_exact(self.block_size).map(|block| {
                let local = match (prev, first_seed) {
                    (None, Some(seed)) => LocalBlockHash(hash_u32_le(block, seed)),
                    _ => LocalBlockHash(self.hash_any(block)),
                };
                let seq = next_sequence_hash(prev, local);
                locals.push(local);
                prev = Some(seq);
                seq
            }))
            .collect()
    }

    /// [`BlockHasher::hash_prompt_shared`] of a prompt whose first `known.len()` blocks' local
    /// hashes are the first of `locals` and sequence hashes are `known`, and whose later tokens
    /// are `tokens`: only `tokens`' full blocks are hashed.
    fn hash_prompt_after(
        &self,
        tokens: &[u32],
        known: &[SequenceHash],
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        self.hash_from(tokens, known, None, locals)
    }
}

/// A shared chain of `len` sequence hashes, written by `fill` in place: allocated once (zeroed),
/// neither grown nor copied.
fn shared_chain(len: usize, fill: impl FnOnce(&mut [SequenceHash])) -> Arc<[SequenceHash]> {
    let mut chain: Arc<[SequenceHash]> = std::iter::repeat_n(SequenceHash(0), len).collect();
    match Arc::get_mut(&mut chain) {
        Some(slots) => fill(slots),
        // Never: a fresh `Arc` is unique. Through a buffer all the same, rather than a panic.
        None => {
            let mut slots = vec![SequenceHash(0); len];
            fill(&mut slots);
            chain = slots.into();
        }
    }
    chain
}

/// Hashes a request's prompt as vLLM salts its blocks: the LoRA adapter salts every block, a
/// cache salt (vLLM's `cache_salt`, a tenant's namespace) only the first, as vLLM folds it
/// into the extra keys of the block that starts at token 0 alone. The chain carries the first
/// block's salt to every later block: a salted prompt shares no block with another salt's or
/// an unsalted one, yet a store continuing a chain (whose event names its parent, not the salt)
/// hashes its blocks under the adapter alone.
///
/// Without a cache salt this is [`BlockHasher`] under the adapter's salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptHasher {
    /// Blocks after the first: the adapter's salt.
    rest: BlockHasher,
    /// The first block's local-hash seed (the adapter's and the cache salt's), when a cache salt
    /// is set.
    first: Option<u64>,
}

impl PromptHasher {
    /// A hasher for blocks of `block_size` tokens of a request under `salt` (its `namespace`
    /// being the cache salt).
    pub fn new(block_size: usize, salt: &HashSalt<'_>) -> Self {
        let rest = BlockHasher::new(
            block_size,
            &HashSalt {
                lora_name: salt.lora_name,
                namespace: None,
            },
        );
        let first = salt
            .namespace
            .filter(|n| !n.is_empty())
            .map(|_| salt.local_seed());
        Self { rest, first }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.rest.block_size()
    }

    /// The local hash of block `index` of the prompt, whose tokens are `tokens`.
    pub fn local_hash(&self, index: usize, tokens: &[u32]) -> LocalBlockHash {
        match self.first {
            Some(seed) if index == 0 => LocalBlockHash(hash_u32_le(tokens, seed)),
            _ => self.rest.local_hash(tokens),
        }
    }

    /// Local hashes of every full block of `tokens` under this rule.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        let mut locals = self.rest.local_hashes(tokens);
        if let (Some(seed), Some(first)) = (self.first, locals.first_mut()) {
            *first = LocalBlockHash(hash_u32_le(&tokens[..self.block_size()], seed));
        }
        locals
    }

    /// [`BlockHasher::hash_prompt_shared`] under this rule.
    pub fn hash_prompt_shared(
        &self,
        tokens: &[u32],
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        // The first block under its own seed, in the one pass: hashed once, chained once.
        self.rest.hash_from(tokens, &[], self.first, locals)
    }

    /// The hashes of a prompt that continues the earlier prompt whose hashes are `earlier`: the
    /// same values as [`PromptHasher::hash_prompt_shared`] of the whole prompt (`tokens`, from
    /// its first token), with only the blocks past `earlier`'s hashed. The caller vouches that
    /// the earlier prompt's tokens are the first tokens of `tokens`, as a conversation cache
    /// that found the earlier turn by its text does; `earlier` made under another rule (block
    /// size, adapter, cache salt) is not used, the whole prompt is hashed. Returns `None`, having
    /// hashed nothing, when `earlier` holds more blocks than `tokens`.
    pub fn hash_prompt_after(
        &self,
        tokens: &[u32],
        earlier: &PromptHashes,
        locals: &mut Vec<LocalBlockHash>,
    ) -> Option<Arc<[SequenceHash]>> {
        let known = earlier.blocks();
        let rest = tokens.get(known * self.block_size()..)?;
        if earlier.rule != HashRule::of(self) || known == 0 {
            return Some(self.hash_prompt_shared(tokens, locals));
        }
        // The earlier local hashes first, written over what the buffer held (a router's buffer,
        // left longer by an earlier prompt), or copied into an empty one: never zeroed first.
        if locals.len() < known {
            locals.clear();
            locals.extend_from_slice(earlier.locals());
        } else {
            locals[..known].copy_from_slice(earlier.locals());
        }
        if rest.len() < self.block_size() {
            // No new full block: the earlier chain is this prompt's, shared as it is when it is
            // whole (not a prefix of a longer one's).
            locals.truncate(known);
            return Some(match earlier.chain.len() == known {
                true => Arc::clone(&earlier.chain),
                false => Arc::from(earlier.chain()),
            });
        }
        // The first block's salt is in `earlier`'s first hashes; later blocks take the adapter's.
        Some(self.rest.hash_prompt_after(rest, earlier.chain(), locals))
    }
}

/// What makes two prompts' hashes comparable: the block size and both seeds of a
/// [`PromptHasher`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HashRule {
    block_size: usize,
    seed: u64,
    first: Option<u64>,
}

impl HashRule {
    fn of(hasher: &PromptHasher) -> Self {
        Self {
            block_size: hasher.rest.block_size,
            seed: hasher.rest.seed,
            first: hasher.first,
        }
    }
}

/// A prompt's block hashes as a driver keeps them (a conversation cache, for the next turn), so
/// that a prompt continuing it hashes only its new blocks
/// ([`PromptHasher::hash_prompt_after`]); they remember the rule they were made under. Cloning
/// shares them, and so does a [`PromptHashes::prefix`].
#[derive(Clone, Debug)]
pub struct PromptHashes {
    rule: HashRule,
    locals: Arc<[LocalBlockHash]>,
    chain: Arc<[SequenceHash]>,
    /// The blocks these are the hashes of: the first of `locals` and `chain` (fewer than they
    /// hold in a prefix).
    blocks: usize,
}

impl PartialEq for PromptHashes {
    fn eq(&self, other: &Self) -> bool {
        self.rule == other.rule && self.locals() == other.locals() && self.chain() == other.chain()
    }
}

impl Eq for PromptHashes {}

impl PromptHashes {
    /// The hashes of the full blocks of `tokens` under `hasher`.
    pub fn new(hasher: &PromptHasher, tokens: &[u32]) -> Self {
        let mut locals = Vec::with_capacity(tokens.len() / hasher.block_size());
        let chain = hasher.hash_prompt_shared(tokens, &mut locals);
        Self::made(hasher, locals, chain)
    }

    /// The hashes of a prompt continuing `earlier` (see [`PromptHasher::hash_prompt_after`]), or
    /// `None` when `earlier` holds more blocks than `tokens`.
    pub fn after(hasher: &PromptHasher, tokens: &[u32], earlier: &PromptHashes) -> Option<Self> {
        // Sized once: the earlier hashes are copied in, the new ones written after them.
        let mut locals = Vec::with_capacity(tokens.len() / hasher.block_size());
        let chain = hasher.hash_prompt_after(tokens, earlier, &mut locals)?;
        Some(Self::made(hasher, locals, chain))
    }

    fn made(hasher: &PromptHasher, locals: Vec<LocalBlockHash>, chain: Arc<[SequenceHash]>) -> Self {
        Self {
            rule: HashRule::of(hasher),
            blocks: locals.len(),
            locals: locals.into(),
            chain,
        }
    }

    /// The hashes of the prompt's first `tokens` tokens (the full blocks among them, at most
    /// all of these), sharing these.
    pub fn prefix(&self, tokens: usize) -> Self {
        Self {
            blocks: self.blocks.min(tokens / self.rule.block_size),
            ..self.clone()
        }
    }

    /// Full blocks hashed.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// The blocks of these that [`PromptHasher::hash_prompt_after`] takes as they are for a
    /// prompt of `tokens` continuing them under `hasher`: all of them when they were made under
    /// `hasher`'s rule and the prompt holds them, else none.
    pub fn reusable_blocks(&self, hasher: &PromptHasher, tokens: usize) -> usize {
        match self.rule == HashRule::of(hasher) && self.blocks * hasher.block_size() <= tokens {
            true => self.blocks,
            false => 0,
        }
    }

    /// The blocks' local hashes.
    pub fn locals(&self) -> &[LocalBlockHash] {
        &self.locals[..self.blocks]
    }

    /// The blocks' sequence hashes.
    pub fn chain(&self) -> &[SequenceHash] {
        &self.chain[..self.blocks]
    }

    /// Bytes of the hashes these share (a prefix counts its whole prompt's), for a cache's
    /// memory bound.
    pub fn shared_bytes(&self) -> usize {
        std::mem::size_of_val::<[LocalBlockHash]>(&self.locals)
            + std::mem::size_of_val::<[SequenceHash]>(&self.chain)
    }
}

/// The sequence hashes of `locals`, starting from the root, written straight into one shared
/// allocation (no copy from a buffer): the chain a router books.
pub fn sequence_hashes_shared(locals: &[LocalBlockHash]) -> Arc<[SequenceHash]> {
    shared_chain(locals.len(), |chain| {
        let (Some((first, rest)), Some((root, slots))) = (locals.split_first(), chain.split_first_mut())
        else {
            return;
        };
        let mut prev = first.0;
        *root = SequenceHash(prev);
        for (local, slot) in rest.iter().zip(slots) {
            prev = chain_step(prev, local.0);
            *slot = SequenceHash(prev);
        }
    })
}

/// The sequence hashes of `locals` into `chain` (cleared first), starting from the root.
pub fn sequence_hashes_into(locals: &[LocalBlockHash], chain: &mut Vec<SequenceHash>) {
    chain.clear();
    let mut prev = None;
    for &local in locals {
        let seq = next_sequence_hash(prev, local);
        chain.push(seq);
        prev = Some(seq);
    }
}

/// The sequence hash of `local` placed after the block whose sequence hash is `parent`, or at
/// the root when `parent` is `None`.
#[inline]
pub fn next_sequence_hash(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(parent) => SequenceHash(chain_step(parent.0, local.0)),
    }
}

// ---- XXH3 specialised to the router's two input shapes ----
//
// The router hashes two shapes of input, millions of times: a block of 16 (or 32) token ids,
// 64 (128) bytes, and a chain step of 16 bytes. `xxh3_64_with_seed` serves any length: it
// dispatches on the length on every call and adds the seed to the secret words inside each
// mix. Below is the same function (XXH3-64 of the xxHash specification, `XXH3_len_17to128_64b`
// and `XXH3_len_9to16_64b`) written for exactly these shapes, with the seeded secret words
// computed once per prompt. `tests::specialised_xxh3_equals_the_reference` checks it against
// xxhash-rust on random inputs and seeds; `tests/hash_vectors.rs` against Python's xxhash.

/// The first 128 bytes of XXH3's default secret (`kSecret`), as little-endian 64-bit words,
/// read at compile time from xxhash-rust's own (a seed of 0 derives the default secret).
const SECRET: [u64; 16] = {
    let bytes = const_custom_default_secret(0);
    let mut words = [0u64; 16];
    let mut i = 0;
    while i < 16 {
        let b = 8 * i;
        words[i] = u64::from_le_bytes([
            bytes[b],
            bytes[b + 1],
            bytes[b + 2],
            bytes[b + 3],
            bytes[b + 4],
            bytes[b + 5],
            bytes[b + 6],
            bytes[b + 7],
        ]);
        i += 1;
    }
    words
};

/// XXH3's first 64-bit prime.
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;

/// XXH3's final mix of a short input's accumulator.
#[inline(always)]
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

/// The 128-bit product of `a` and `b`, its halves xored.
#[inline(always)]
fn mul128_fold64(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

/// Bytes `4 * i ..= 4 * i + 7` of a block's little-endian encoding: tokens `i` and `i + 1`.
#[inline(always)]
fn word<const N: usize>(block: &[u32; N], i: usize) -> u64 {
    u64::from(block[i]) | (u64::from(block[i + 1]) << 32)
}

/// The secret words of XXH3 for inputs of 17 to 128 bytes under one seed: even words plus the
/// seed, odd words minus it, as `XXH3_mix16B` uses them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ShortKeys([u64; 16]);

impl ShortKeys {
    fn new(seed: u64) -> Self {
        let mut keys = SECRET;
        for (i, key) in keys.iter_mut().enumerate() {
            *key = if i % 2 == 0 {
                key.wrapping_add(seed)
            } else {
                key.wrapping_sub(seed)
            };
        }
        Self(keys)
    }

    /// `XXH3_mix16B` of the 16 bytes at byte `offset` of `block` with the secret at byte `secret`.
    #[inline(always)]
    fn mix16<const N: usize>(&self, block: &[u32; N], offset: usize, secret: usize) -> u64 {
        let (i, k) = (offset / 4, secret / 8);
        mul128_fold64(word(block, i) ^ self.0[k], word(block, i + 2) ^ self.0[k + 1])
    }

    /// [`ShortKeys::hash`] of a block `chunks_exact(N)` cut, so of `N` tokens; any other length
    /// (which `chunks_exact` never gives) takes the general XXH3 with `seed`, these keys' seed.
    #[inline(always)]
    fn hash_chunk<const N: usize>(&self, block: &[u32], seed: u64) -> u64 {
        match <&[u32; N]>::try_from(block) {
            Ok(block) => self.hash(block),
            Err(_) => hash_u32_le(block, seed),
        }
    }

    /// `XXH3_64_with_seed` of the `4 * N` little-endian bytes of `block`, for `N` in 5..=32
    /// (17 to 128 bytes), with the seed these keys were made for. `N` is a constant, so the
    /// branches below fold away and no index is checked at run time.
    #[inline(always)]
    fn hash<const N: usize>(&self, block: &[u32; N]) -> u64 {
        const { assert!(N >= 5 && N <= 32) };
        let len = 4 * N;
        let mut acc = (len as u64).wrapping_mul(PRIME64_1);
        if len > 32 {
            if len > 64 {
                if len > 96 {
                    acc = acc.wrapping_add(self.mix16(block, 48, 96));
                    acc = acc.wrapping_add(self.mix16(block, len - 64, 112));
                }
                acc = acc.wrapping_add(self.mix16(block, 32, 64));
                acc = acc.wrapping_add(self.mix16(block, len - 48, 80));
            }
            acc = acc.wrapping_add(self.mix16(block, 16, 32));
            acc = acc.wrapping_add(self.mix16(block, len - 32, 48));
        }
        acc = acc.wrapping_add(self.mix16(block, 0, 0));
        acc = acc.wrapping_add(self.mix16(block, len - 16, 16));
        avalanche(acc)
    }
}

/// The chain's first bitflip: `(secret[24..32] ^ secret[32..40]) + 1337`.
const CHAIN_FLIP_LO: u64 = (SECRET[3] ^ SECRET[4]).wrapping_add(XXH3_SEED);
/// The chain's second bitflip: `(secret[40..48] ^ secret[48..56]) - 1337`.
const CHAIN_FLIP_HI: u64 = (SECRET[5] ^ SECRET[6]).wrapping_sub(XXH3_SEED);

/// One chain step: `XXH3_64(le64(parent) ‖ le64(local), seed 1337)`, XXH3's 9-to-16-byte case
/// for exactly 16 bytes.
#[inline(always)]
fn chain_step(parent: u64, local: u64) -> u64 {
    let lo = parent ^ CHAIN_FLIP_LO;
    let hi = local ^ CHAIN_FLIP_HI;
    let acc = 16u64
        .wrapping_add(lo.swap_bytes())
        .wrapping_add(hi)
        .wrapping_add(mul128_fold64(lo, hi));
    avalanche(acc)
}

/// XXH3 over `tokens` as little-endian u32 bytes, without copying on little-endian machines.
#[inline]
fn hash_u32_le(tokens: &[u32], seed: u64) -> u64 {
    with_u32_le(tokens, |bytes| xxh3_64_with_seed(bytes, seed))
}

/// `f` of `tokens` as little-endian u32 bytes, without copying on little-endian machines.
#[inline]
fn with_u32_le(tokens: &[u32], f: impl FnOnce(&[u8]) -> u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        f(bytemuck::cast_slice(tokens))
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        f(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The reference: `xxh3_64_with_seed` over the little-endian bytes, as Dynamo hashes.
    fn reference_local(tokens: &[u32], seed: u64) -> u64 {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }

    fn reference_chain(locals: &[u64]) -> Vec<u64> {
        let mut chain: Vec<u64> = Vec::with_capacity(locals.len());
        for &local in locals {
            chain.push(match chain.last() {
                None => local,
                Some(&parent) => {
                    let mut bytes = [0u8; 16];
                    bytes[..8].copy_from_slice(&parent.to_le_bytes());
                    bytes[8..].copy_from_slice(&local.to_le_bytes());
                    xxh3_64_with_seed(&bytes, XXH3_SEED)
                }
            });
        }
        chain
    }

    /// Token ids biased towards the edges (0, `u32::MAX`, byte boundaries) as well as uniform.
    fn token() -> impl Strategy<Value = u32> {
        prop_oneof![
            any::<u32>(),
            Just(0u32),
            Just(u32::MAX),
            (0u32..32).prop_map(|b| 1u32.rotate_left(b)),
            0u32..152_064,
        ]
    }

    fn seed() -> impl Strategy<Value = u64> {
        prop_oneof![any::<u64>(), Just(XXH3_SEED), Just(0u64), Just(u64::MAX)]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The specialised XXH3 of 16- and 32-token blocks and of a chain step equals
        /// xxhash-rust's `xxh3_64_with_seed` for any input and seed.
        #[test]
        fn specialised_xxh3_equals_the_reference(
            block in proptest::collection::vec(token(), 32),
            seed in seed(),
            parent in any::<u64>(),
            local in any::<u64>(),
        ) {
            let keys = ShortKeys::new(seed);
            let b16: &[u32; 16] = block[..16].try_into().unwrap();
            let b32: &[u32; 32] = block[..].try_into().unwrap();
            prop_assert_eq!(keys.hash(b16), reference_local(b16, seed));
            prop_assert_eq!(keys.hash(b32), reference_local(b32, seed));
            // Other lengths the generic function admits (20 to 124 bytes), one per branch.
            prop_assert_eq!(keys.hash::<5>(block[..5].try_into().unwrap()), reference_local(&block[..5], seed));
            prop_assert_eq!(keys.hash::<8>(block[..8].try_into().unwrap()), reference_local(&block[..8], seed));
            prop_assert_eq!(keys.hash::<9>(block[..9].try_into().unwrap()), reference_local(&block[..9], seed));
            prop_assert_eq!(keys.hash::<17>(block[..17].try_into().unwrap()), reference_local(&block[..17], seed));
            prop_assert_eq!(keys.hash::<25>(block[..25].try_into().unwrap()), reference_local(&block[..25], seed));
            prop_assert_eq!(keys.hash::<31>(block[..31].try_into().unwrap()), reference_local(&block[..31], seed));
            prop_assert_eq!(chain_step(parent, local), reference_chain(&[parent, local])[1]);
        }

        /// A whole prompt hashed at any block size (16 and 32 take the specialised path, with a
        /// trailing partial block) equals the reference, salted or not.
        #[test]
        fn prompts_hash_as_the_reference(
            tokens in proptest::collection::vec(token(), 0..400),
            block_size in prop_oneof![Just(16usize), Just(32usize), Just(64usize), 1usize..80],
            lora in proptest::option::of("[a-z]{0,6}"),
        ) {
            let salt = HashSalt { lora_name: lora.as_deref(), namespace: None };
            let hasher = BlockHasher::new(block_size, &salt);
            let seed = salt.local_seed();
            let want_locals: Vec<u64> =
                tokens.chunks_exact(block_size).map(|b| reference_local(b, seed)).collect();
            let want_chain = reference_chain(&want_locals);
            let mut locals = vec![LocalBlockHash(9)];
            let chain = hasher.hash_prompt_shared(&tokens, &mut locals);
            prop_assert_eq!(locals.iter().map(|l| l.0).collect::<Vec<_>>(), want_locals.clone());
            prop_assert_eq!(chain.iter().map(|c| c.0).collect::<Vec<_>>(), want_chain.clone());
            // The proxy's path: local hashes first, the chain from them.
            prop_assert_eq!(&hasher.local_hashes(&tokens), &locals);
            let from_locals = sequence_hashes_shared(&locals);
            prop_assert_eq!(from_locals.iter().map(|c| c.0).collect::<Vec<_>>(), want_chain);
            for (block, want) in tokens.chunks_exact(block_size).zip(&want_locals) {
                prop_assert_eq!(hasher.local_hash(block).0, *want);
            }
        }
    }

    #[test]
    fn long_blocks_hash_through_the_derived_secret_as_with_the_seed() {
        // Blocks past 240 bytes (61 tokens and more) take XXH3's long path, where the hasher
        // uses the secret it derived once; every seed, salted or not, and shorter slices too.
        for block_size in [61, 64, 100, 128, 1024] {
            for seed in [0, 1, XXH3_SEED, u64::MAX, 0x9e37_79b9_7f4a_7c15] {
                let hasher = BlockHasher::with_seed(block_size, seed);
                assert!(hasher.long.0.is_some(), "{block_size}");
                let tokens: Vec<u32> = (0..block_size as u32 * 3)
                    .map(|t| t.wrapping_mul(2_654_435_761) ^ seed as u32)
                    .collect();
                for block in tokens.chunks(block_size).chain([&tokens[..block_size / 2]]) {
                    assert_eq!(
                        hasher.local_hash(block).0,
                        reference_local(block, seed),
                        "{block_size} tokens, seed {seed}, slice of {}",
                        block.len()
                    );
                }
                let want: Vec<u64> = tokens
                    .chunks_exact(block_size)
                    .map(|b| reference_local(b, seed))
                    .collect();
                let got = hasher.local_hashes(&tokens);
                assert_eq!(got.iter().map(|l| l.0).collect::<Vec<_>>(), want);
            }
        }
        assert!(BlockHasher::with_seed(60, 7).long.0.is_none());
    }

    #[test]
    fn one_pass_and_into_buffer_forms_match_the_allocating_ones() {
        let tokens: Vec<u32> = (0..100).map(|i| i * 7 + 3).collect();
        let hasher = BlockHasher::new(
            16,
            &HashSalt {
                lora_name: Some("a"),
                namespace: None,
            },
        );
        // Stale contents must be cleared, not appended to.
        let (mut locals, mut chain) = (vec![LocalBlockHash(1)], vec![SequenceHash(2)]);
        hasher.hash_prompt(&tokens, &mut locals, &mut chain);
        assert_eq!(locals, hasher.local_hashes(&tokens));
        assert_eq!(chain, hasher.sequence_hashes(&locals));
        let mut again = vec![SequenceHash(3)];
        sequence_hashes_into(&locals, &mut again);
        assert_eq!(again, chain);
        // The shared forms: the same values, the stale buffer cleared.
        let mut shared_locals = vec![LocalBlockHash(4)];
        let shared = hasher.hash_prompt_shared(&tokens, &mut shared_locals);
        assert_eq!(shared_locals, locals);
        assert_eq!(&shared[..], &chain[..]);
        assert_eq!(&sequence_hashes_shared(&locals)[..], &chain[..]);
        // A buffer left longer by an earlier prompt: its stale entries do not show.
        let mut longer = vec![LocalBlockHash(5); 200];
        assert_eq!(&hasher.hash_prompt_shared(&tokens, &mut longer)[..], &chain[..]);
        assert_eq!(longer, locals);
        assert!(
            hasher
                .hash_prompt_shared(&tokens[..15], &mut shared_locals)
                .is_empty()
        );
        assert!(shared_locals.is_empty());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        /// A prompt hashed after the kept hashes of an earlier prompt it continues has the hashes
        /// of the whole prompt hashed anew, whatever the block size, salts and cut; hashes kept
        /// under another rule are not used; an earlier prompt longer than the new one is refused.
        #[test]
        fn a_prompt_hashed_after_an_earlier_one_hashes_as_the_whole(
            tokens in proptest::collection::vec(token(), 0..300),
            cut in 0usize..300,
            block in prop_oneof![Just(16usize), Just(32), Just(64), 1usize..40],
            lora in prop_oneof![Just(None), Just(Some("a"))],
            salt in prop_oneof![Just(None), Just(Some("t"))],
            other_salt in any::<bool>(),
            other_tail in proptest::collection::vec(token(), 0..80),
        ) {
            let cut = cut.min(tokens.len());
            let hasher = PromptHasher::new(block, &HashSalt { lora_name: lora, namespace: salt });
            let whole = PromptHashes::new(&hasher, &tokens);
            let made_by = if other_salt {
                PromptHasher::new(block, &HashSalt { lora_name: Some("other"), namespace: salt })
            } else {
                hasher
            };
            let earlier = PromptHashes::new(&made_by, &tokens[..cut]);
            let after = PromptHashes::after(&hasher, &tokens, &earlier);
            prop_assert_eq!(after.as_ref(), Some(&whole));
            // The earlier prompt's hashes as the prefix of a prompt that went on otherwise (a
            // previous turn's, kept whole): the same hashes, and the same continuation.
            let longer: Vec<u32> = tokens[..cut].iter().chain(&other_tail).copied().collect();
            let prefix = PromptHashes::new(&made_by, &longer).prefix(cut);
            prop_assert_eq!(&prefix, &earlier);
            let continued = PromptHashes::after(&hasher, &tokens, &prefix);
            prop_assert_eq!(continued.as_ref(), Some(&whole));
            // Into a buffer left longer by an earlier prompt: its stale entries do not show.
            let mut locals = vec![LocalBlockHash(7); 40];
            let chain = hasher.hash_prompt_after(&tokens, &earlier, &mut locals);
            prop_assert_eq!(chain.as_deref(), Some(whole.chain()));
            prop_assert_eq!(&locals[..], whole.locals());
            // Under one rule, the earlier prompt's hashes are a prefix of the whole's.
            if !other_salt {
                prop_assert_eq!(&whole.locals()[..earlier.blocks()], earlier.locals());
                prop_assert_eq!(&whole.chain()[..earlier.blocks()], earlier.chain());
            }
            if earlier.blocks() > 0 {
                let shorter = &tokens[..earlier.blocks() * block - 1];
                prop_assert!(PromptHashes::after(&hasher, shorter, &earlier).is_none());
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// A cache salt changes the first block's local hash alone (the adapter every block's),
        /// so the whole chain differs from the unsalted one; without a salt the prompt hashes
        /// as `BlockHasher` under the adapter; every form gives the same values.
        #[test]
        fn a_cache_salt_salts_the_first_block_alone(
            tokens in proptest::collection::vec(token(), 0..100),
            block in prop_oneof![Just(4usize), Just(16), Just(7)],
            lora in prop_oneof![Just(None), Just(Some("a"))],
            salt in "[a-z]{0,3}",
        ) {
            let plain = BlockHasher::new(block, &HashSalt { lora_name: lora, namespace: None });
            let salted = PromptHasher::new(block, &HashSalt { lora_name: lora, namespace: Some(&salt) });
            let (want, got) = (plain.local_hashes(&tokens), salted.local_hashes(&tokens));
            prop_assert_eq!(want.len(), got.len());
            if salt.is_empty() || got.is_empty() {
                prop_assert_eq!(&got, &want);
            } else {
                prop_assert_eq!(&got[1..], &want[1..]);
                let seed = HashSalt { lora_name: lora, namespace: Some(&salt) }.local_seed();
                prop_assert_eq!(got[0].0, reference_local(&tokens[..block], seed));
                let (a, b) = (plain.sequence_hashes(&want), plain.sequence_hashes(&got));
                prop_assert!(a.iter().zip(&b).all(|(x, y)| x != y), "a salted chain shares no block");
            }
            for (i, chunk) in tokens.chunks_exact(block).enumerate() {
                prop_assert_eq!(salted.local_hash(i, chunk), got[i]);
            }
            let mut locals = Vec::new();
            let chain = salted.hash_prompt_shared(&tokens, &mut locals);
            prop_assert_eq!(&locals, &got);
            prop_assert_eq!(&chain[..], &plain.sequence_hashes(&got)[..]);
        }
    }
}
