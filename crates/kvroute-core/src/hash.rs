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

use xxhash_rust::xxh3::xxh3_64_with_seed;

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
}

impl BlockHasher {
    /// A hasher for blocks of `block_size` tokens under `salt`.
    ///
    /// A `block_size` of zero is treated as one: a block holds at least one token.
    pub fn new(block_size: usize, salt: &HashSalt<'_>) -> Self {
        Self {
            block_size: block_size.max(1),
            seed: salt.local_seed(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The local hash of one block's tokens (any length; callers pass full blocks).
    #[inline]
    pub fn local_hash(&self, tokens: &[u32]) -> LocalBlockHash {
        LocalBlockHash(hash_u32_le(tokens, self.seed))
    }

    /// Local hashes of every full block of `tokens`.
    pub fn local_hashes(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        tokens
            .chunks_exact(self.block_size)
            .map(|block| self.local_hash(block))
            .collect()
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
        locals.clear();
        chain.clear();
        let mut prev = None;
        for block in tokens.chunks_exact(self.block_size) {
            let local = self.local_hash(block);
            let seq = next_sequence_hash(prev, local);
            locals.push(local);
            chain.push(seq);
            prev = Some(seq);
        }
    }

    /// [`BlockHasher::hash_prompt`] with the sequence hashes written straight into one shared
    /// allocation, the chain a router books: a long prompt's chain (64 KiB at 128K tokens in
    /// 16-token blocks) is neither grown in a buffer nor copied out of one.
    pub fn hash_prompt_shared(
        &self,
        tokens: &[u32],
        locals: &mut Vec<LocalBlockHash>,
    ) -> Arc<[SequenceHash]> {
        locals.clear();
        locals.reserve(tokens.len() / self.block_size);
        let mut prev = None;
        // `chunks_exact` mapped has an exact length, so the `Arc` is allocated once and filled in
        // place; each chain step's latency overlaps the next block's local hash.
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                let local = self.local_hash(block);
                let seq = next_sequence_hash(prev, local);
                locals.push(local);
                prev = Some(seq);
                seq
            })
            .collect()
    }
}

/// The sequence hashes of `locals`, starting from the root, written straight into one shared
/// allocation (no copy from a buffer): the chain a router books.
pub fn sequence_hashes_shared(locals: &[LocalBlockHash]) -> Arc<[SequenceHash]> {
    let mut prev = None;
    // A map over a slice has an exact length, so the `Arc` is allocated once and filled in place.
    locals
        .iter()
        .map(|&local| {
            let seq = next_sequence_hash(prev, local);
            prev = Some(seq);
            seq
        })
        .collect()
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
        Some(parent) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
            bytes[8..].copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
        }
    }
}

/// XXH3 over `tokens` as little-endian u32 bytes, without copying on little-endian machines.
#[inline]
fn hash_u32_le(tokens: &[u32], seed: u64) -> u64 {
    #[cfg(target_endian = "little")]
    {
        xxh3_64_with_seed(bytemuck::cast_slice(tokens), seed)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&bytes, seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(
            hasher
                .hash_prompt_shared(&tokens[..15], &mut shared_locals)
                .is_empty()
        );
        assert!(shared_locals.is_empty());
    }
}
