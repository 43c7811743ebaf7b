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
    /// The worker holds nothing.
    Cleared,
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
