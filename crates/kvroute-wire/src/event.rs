//! KV events as they travel: vLLM's `BlockStored`, `BlockRemoved` and `AllBlocksCleared`, in one
//! batch per publish.
//!
//! These types keep what a router or a mock worker needs of the wire format and nothing of its
//! layout: a batch decoded from any revision's bytes compares equal to the same batch decoded
//! from another's.

use kvroute_core::events::{BlocksRemoved, BlocksStored, KvEvent, TierBlocks};
use kvroute_core::ids::{DpRank, ExternalBlockHash, WorkerKey};

use crate::error::{DecodeError, EncodeError, PayloadError};
use crate::frames::RawBatch;
use crate::{decode, encode};

/// The `medium` of the GPU KV cache, the tier the router indexes.
pub const MEDIUM_GPU: &str = "GPU";

/// One batch of events: what one publish carries, with the topic and sequence number of the
/// ZMQ message around it.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The topic frame (vLLM's `topic` setting; empty by default and in old-layout replays).
    pub topic: String,
    /// The publisher's sequence number: 0 for its first batch, then one more per batch.
    pub seq: u64,
    /// When the batch was published, in seconds since the Unix epoch (the engine's clock).
    pub ts: f64,
    /// The events, in the order the engine produced them.
    pub events: Vec<WireEvent>,
    /// The data-parallel rank that published the batch, if the publisher said.
    pub dp_rank: Option<u32>,
}

/// One event of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WireEvent {
    /// Full blocks became cached.
    BlockStored(BlockStored),
    /// Cached blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The engine's prefix cache was reset.
    AllBlocksCleared,
    /// An event type this crate does not know, kept by its tag so that it can be counted.
    Unknown {
        /// The event's tag (vLLM's class name).
        tag: String,
    },
}

/// Full blocks newly cached, continuing a chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockStored {
    /// The engine's hashes of the blocks, in chain order.
    pub block_hashes: Vec<ExternalBlockHash>,
    /// The engine's hash of the block before the first; `None` at the start of a sequence.
    pub parent_block_hash: Option<ExternalBlockHash>,
    /// The blocks' tokens, concatenated: `block_size` per block when complete.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// vLLM's deprecated integer LoRA id, kept so that a batch re-encodes as it came.
    pub lora_id: Option<i64>,
    /// The cache tier: `"GPU"`, an offload tier such as `"CPU"`, or `None` (older engines).
    pub medium: Option<String>,
    /// The LoRA adapter the blocks were computed under.
    pub lora_name: Option<String>,
    /// The request's `cache_salt`, read from the first block's `extra_keys` (vLLM puts it
    /// there, after the LoRA name, when the block starts at token 0); only a store that starts
    /// a sequence has it. The other extra keys (multimodal, prompt embeddings) are not kept.
    pub cache_salt: Option<String>,
    /// The KV-cache group (hybrid models send one event per group); `None` when not sent.
    pub group_idx: Option<u32>,
}

/// Cached blocks evicted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<ExternalBlockHash>,
    /// The cache tier they left.
    pub medium: Option<String>,
    /// The KV-cache group; `None` when not sent.
    pub group_idx: Option<u32>,
}

/// How to encode the events of a batch. The batch around them is always positional
/// (`[ts, events, data_parallel_rank]`), as every vLLM release sends it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EventEncoding {
    /// Each event a map keyed by field name, with its tag under `"type"`: vLLM since PR #42892
    /// (June 2026, v0.26.0).
    #[default]
    Map,
    /// Each event an array, its tag first: vLLM before PR #42892, in the field layout of its
    /// last positional revision (12 items for `BlockStored`, 4 for `BlockRemoved`), and SGLang.
    Positional,
}

impl EventBatch {
    /// Decodes a live message, the three frames `[topic, seq, payload]` a SUB socket receives.
    pub fn decode_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<EventBatch, DecodeError> {
        Ok(RawBatch::from_live(frames)?.decode()?)
    }

    /// Decodes `payload` (the msgpack of one batch) as the batch with sequence number `seq` on
    /// `topic`.
    pub fn decode_payload(topic: &str, seq: u64, payload: &[u8]) -> Result<EventBatch, PayloadError> {
        let decoded = decode::payload(payload)?;
        Ok(EventBatch {
            topic: topic.to_owned(),
            seq,
            ts: decoded.ts,
            events: decoded.events,
            dp_rank: decoded.dp_rank,
        })
    }

    /// The msgpack payload of this batch, byte for byte what vLLM's msgspec encoder writes for
    /// it (topic and sequence number travel in their own frames).
    pub fn encode_payload(&self, encoding: EventEncoding) -> Result<Vec<u8>, EncodeError> {
        encode::payload(self, encoding)
    }

    /// The live message of this batch: `[topic, seq as 8 bytes big-endian, payload]`.
    pub fn encode_live(&self, encoding: EventEncoding) -> Result<[Vec<u8>; 3], EncodeError> {
        Ok([
            self.topic.as_bytes().to_vec(),
            self.seq.to_be_bytes().to_vec(),
            self.encode_payload(encoding)?,
        ])
    }

    /// The cache this batch is about, when it came on `stream` (a worker's rank's endpoint):
    /// the worker's data-parallel rank the batch names, or the stream's rank when it names none.
    pub fn worker_key(&self, stream: WorkerKey) -> WorkerKey {
        WorkerKey::new(stream.worker, self.dp_rank.map_or(stream.dp_rank, DpRank))
    }
}

impl From<&KvEvent> for WireEvent {
    /// The wire form of a simulated engine's event. The engine's local hashes are not sent: a
    /// subscriber computes them from the tokens. A slower tier's events are what vLLM's
    /// offloading connector sends: its `medium`, the hashes, and for a store no parent, no
    /// tokens, block size 0 and no LoRA name.
    fn from(event: &KvEvent) -> Self {
        match event {
            KvEvent::Stored(stored) => WireEvent::BlockStored(BlockStored::from(stored)),
            KvEvent::Removed(BlocksRemoved { block_hashes }) => WireEvent::BlockRemoved(BlockRemoved {
                block_hashes: block_hashes.clone(),
                medium: Some(MEDIUM_GPU.to_owned()),
                group_idx: None,
            }),
            KvEvent::AllCleared => WireEvent::AllBlocksCleared,
            KvEvent::TierStored(TierBlocks { tier, block_hashes }) => WireEvent::BlockStored(BlockStored {
                block_hashes: block_hashes.clone(),
                parent_block_hash: None,
                token_ids: Vec::new(),
                block_size: 0,
                lora_id: None,
                medium: Some(tier.medium().to_owned()),
                lora_name: None,
                cache_salt: None,
                group_idx: None,
            }),
            KvEvent::TierRemoved(TierBlocks { tier, block_hashes }) => {
                WireEvent::BlockRemoved(BlockRemoved {
                    block_hashes: block_hashes.clone(),
                    medium: Some(tier.medium().to_owned()),
                    group_idx: None,
                })
            }
        }
    }
}

impl From<&BlocksStored> for BlockStored {
    fn from(stored: &BlocksStored) -> Self {
        BlockStored {
            block_hashes: stored.block_hashes(),
            parent_block_hash: stored.parent_block_hash,
            token_ids: stored.token_ids.clone(),
            block_size: stored.block_size,
            lora_id: None,
            medium: Some(MEDIUM_GPU.to_owned()),
            lora_name: stored.lora_name.clone(),
            cache_salt: stored.cache_salt.clone(),
            group_idx: None,
        }
    }
}
