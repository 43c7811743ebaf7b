//! KV cache events, as vLLM emits them: the one event type of an engine's cache, which the
//! simulated engine emits, the wire codec (`kvroute-wire`) converts to and from vLLM's msgpack,
//! and the index applies.
//!
//! The three kinds mirror vLLM's `BlockStored`, `BlockRemoved` and `AllBlocksCleared`
//! (`vllm/distributed/kv_events.py`), field for field where a field means something here:
//!
//! * [`BlocksStored`] when blocks become full and cached: their external hashes in chain order,
//!   the external hash of the block before the first (none at the start of a sequence), their
//!   token ids concatenated, the block size and the LoRA adapter. The engine also carries each
//!   block's local hash (the router's content hash), which a real engine does not send: a
//!   subscriber computes it from `token_ids`. Carrying it lets the simulator skip that work and
//!   lets requests given as block hashes (no token ids) be indexed.
//! * [`BlocksRemoved`] when cached blocks are evicted. vLLM sends one per block; the engine
//!   gathers consecutive evictions (no other event between them) into one, which a subscriber
//!   applies identically.
//! * `AllCleared` when the prefix cache is reset (every tier).
//! * [`KvEvent::TierStored`] and [`KvEvent::TierRemoved`]: vLLM's offloading connector's
//!   `BlockStored` and `BlockRemoved` with a `medium` other than `"GPU"` (see [`TierBlocks`]).
//!
//! Events are values; encoding them for the wire is `kvroute-wire`'s job.
//! [`KvEvent::as_index_event`] lends one out as the index's own event type, the one conversion
//! between the two.

use crate::ids::{ExternalBlockHash, LocalBlockHash};
use crate::index::{IndexEvent, StoredBlock, Tier};

/// One change to an engine's KV cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks became full and cached.
    Stored(BlocksStored),
    /// Cached blocks were evicted.
    Removed(BlocksRemoved),
    /// Every cached block was forgotten, on every tier.
    AllCleared,
    /// GPU blocks were copied to a slower tier (vLLM's offloading connector).
    TierStored(TierBlocks),
    /// Blocks were dropped from a slower tier.
    TierRemoved(TierBlocks),
}

/// Blocks of one slower tier, named by the engine's hashes as its GPU events named them. vLLM's
/// offloading connector sends neither tokens nor parent with them: a subscriber places them by
/// the GPU blocks it already knows under those hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierBlocks {
    /// The tier.
    pub tier: Tier,
    /// The engine's hashes of the blocks.
    pub block_hashes: Vec<ExternalBlockHash>,
}

/// Full blocks newly cached, continuing a chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlocksStored {
    /// The external hash of the block before the first stored block; `None` at the start of a
    /// sequence.
    pub parent_block_hash: Option<ExternalBlockHash>,
    /// The stored blocks in chain order: the engine's hash of each (vLLM's `block_hashes`) with
    /// its local (router) hash, which is not part of vLLM's event.
    pub blocks: Vec<StoredBlock>,
    /// The tokens of the stored blocks, concatenated: `block_size` per block. Empty when the
    /// request was given as block hashes, whose tokens the engine never saw.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter of the request that stored the blocks.
    pub lora_name: Option<String>,
    /// The `cache_salt` of the request that stored the blocks, when the store starts its
    /// sequence (vLLM puts it in the first block's extra keys alone).
    pub cache_salt: Option<String>,
}

/// Cached blocks evicted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlocksRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<ExternalBlockHash>,
}

impl BlocksStored {
    /// The engine's hashes of the stored blocks, in chain order (vLLM's `block_hashes`).
    pub fn block_hashes(&self) -> Vec<ExternalBlockHash> {
        self.blocks.iter().map(|b| b.external).collect()
    }

    /// The local (router) hashes of the stored blocks, in chain order.
    pub fn local_hashes(&self) -> Vec<LocalBlockHash> {
        self.blocks.iter().map(|b| b.local).collect()
    }
}

impl KvEvent {
    /// This event as the prefix index takes it: apply it with
    /// [`RunIndex::apply_event`](crate::index::RunIndex::apply_event), the one
    /// place an event changes an index.
    pub fn as_index_event(&self) -> IndexEvent<'_> {
        match self {
            KvEvent::Stored(stored) => IndexEvent::Stored {
                parent: stored.parent_block_hash,
                blocks: &stored.blocks,
            },
            KvEvent::Removed(removed) => IndexEvent::Removed {
                blocks: &removed.block_hashes,
            },
            KvEvent::AllCleared => IndexEvent::Cleared,
            KvEvent::TierStored(t) => IndexEvent::TierStored {
                tier: t.tier,
                blocks: &t.block_hashes,
            },
            KvEvent::TierRemoved(t) => IndexEvent::TierRemoved {
                tier: t.tier,
                blocks: &t.block_hashes,
            },
        }
    }
}
