//! A worker's KV-cache event, as the index takes it: a borrowed view. The owned event,
//! [`crate::events::KvEvent`], lends itself out as this view
//! ([`crate::events::KvEvent::as_index_event`]), and so can callers that hold blocks in slices
//! (the op-stream benchmark, tests); [`super::PrefixIndex::apply_event`] is the one place an
//! event changes the index.

use crate::ids::{ExternalBlockHash, LocalBlockHash, SequenceHash};
use crate::index::StoredBlock;

/// One KV-cache event of one worker; see [`crate::index::PrefixIndex`] for the semantics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexEvent<'a> {
    /// The worker now holds `blocks`, continuing the chain from its block `parent` (or from the
    /// root).
    Stored {
        /// The engine's id of the block before the first one, if any.
        parent: Option<ExternalBlockHash>,
        /// The blocks, in chain order.
        blocks: &'a [StoredBlock],
    },
    /// The worker no longer holds these blocks.
    Removed {
        /// The engine's ids of the blocks.
        blocks: &'a [ExternalBlockHash],
    },
    /// The worker holds nothing, on any tier.
    Cleared,
    /// The worker copied these blocks, which it holds on the GPU, to a slower tier (vLLM's
    /// offloading connector: `BlockStored` with `medium` `"CPU"`, no tokens and no parent).
    TierStored {
        /// The tier.
        tier: Tier,
        /// The engine's ids of the blocks, as its GPU events named them.
        blocks: &'a [ExternalBlockHash],
    },
    /// The worker dropped these blocks from a slower tier (`BlockRemoved` with its `medium`).
    TierRemoved {
        /// The tier.
        tier: Tier,
        /// The engine's ids of the blocks.
        blocks: &'a [ExternalBlockHash],
    },
}

/// A KV-cache tier below the GPU's, which an engine offloads blocks to and loads them back
/// from. The GPU's own cache is the prefix tree itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Host memory: vLLM's native offloading (`--kv-offloading-backend native`), `medium` `"CPU"`.
    Cpu,
}

impl Tier {
    /// Every tier.
    pub const ALL: [Tier; 1] = [Tier::Cpu];

    /// The tier's `medium` in vLLM's events.
    pub fn medium(self) -> &'static str {
        match self {
            Tier::Cpu => "CPU",
        }
    }

    /// The tier whose `medium` this is (any case), if one is tracked.
    pub fn from_medium(medium: &str) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| t.medium().eq_ignore_ascii_case(medium))
    }
}

/// The blocks a worker that names blocks by the router's own chain (Dynamo's mocker, the
/// simulated engine, the op-stream files) announces when it stores a prompt with these hashes.
pub fn stored_blocks(locals: &[LocalBlockHash], chain: &[SequenceHash]) -> Vec<StoredBlock> {
    locals
        .iter()
        .zip(chain)
        .map(|(&local, &seq)| StoredBlock {
            local,
            external: seq.into(),
        })
        .collect()
}
