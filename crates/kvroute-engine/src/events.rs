//! KV cache events, as vLLM emits them.
//!
//! The three kinds mirror vLLM's `BlockStored`, `BlockRemoved` and `AllBlocksCleared`
//! (`vllm/distributed/kv_events.py`), field for field where a field means something here:
//!
//! * [`BlockStored`] when blocks become full and cached: their external hashes in chain order,
//!   the external hash of the block before the first (none at the start of a sequence), their
//!   token ids concatenated, the block size and the LoRA adapter. The engine also carries each
//!   block's local hash (the router's content hash), which a real engine does not send: a
//!   subscriber computes it from `token_ids`. Carrying it lets the simulator skip that work and
//!   lets requests given as block hashes (no token ids) be indexed.
//! * [`BlockRemoved`] when a cached block is evicted.
//! * `AllCleared` when the prefix cache is reset.
//!
//! Events are values; encoding them for the wire (msgpack over ZMQ) is an edge crate's job.
//! [`KvEvent::apply_to`] feeds one to the router's [`PrefixIndex`], the one conversion between
//! the two.

use kvroute_core::ids::{ExternalBlockHash, LocalBlockHash, WorkerKey};
use kvroute_core::index::{IndexError, PrefixIndex, StoredBlock};

/// One change to an engine's KV cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks became full and cached.
    Stored(BlockStored),
    /// Cached blocks were evicted.
    Removed(BlockRemoved),
    /// Every cached block was forgotten.
    AllCleared,
}

/// Full blocks newly cached, continuing a chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockStored {
    /// The external hash of the block before `block_hashes[0]`; `None` at the start of a
    /// sequence.
    pub parent_block_hash: Option<ExternalBlockHash>,
    /// The engine's hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<ExternalBlockHash>,
    /// The local (router) hash of each stored block, in the same order. Not part of vLLM's
    /// event.
    pub local_hashes: Vec<LocalBlockHash>,
    /// The tokens of the stored blocks, concatenated: `block_size` per block. Empty when the
    /// request was given as block hashes, whose tokens the engine never saw.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter of the request that stored the blocks.
    pub lora_name: Option<String>,
}

/// Cached blocks evicted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<ExternalBlockHash>,
}

impl BlockStored {
    /// The stored blocks as the prefix index takes them.
    pub fn stored_blocks(&self) -> impl Iterator<Item = StoredBlock> + '_ {
        self.local_hashes
            .iter()
            .zip(&self.block_hashes)
            .map(|(&local, &external)| StoredBlock { local, external })
    }
}

impl KvEvent {
    /// Applies this event to `index` as `worker`'s, the way a router's event subscriber does.
    pub fn apply_to(&self, index: &mut PrefixIndex, worker: WorkerKey) -> Result<(), IndexError> {
        match self {
            KvEvent::Stored(stored) => {
                let blocks: Vec<StoredBlock> = stored.stored_blocks().collect();
                index.apply_stored(worker, stored.parent_block_hash, &blocks)
            }
            KvEvent::Removed(removed) => index.apply_removed(worker, &removed.block_hashes).map(|_| ()),
            KvEvent::AllCleared => index.clear_worker(worker),
        }
    }
}
