//! Typed identities: workers, requests and the three kinds of block hash.
//!
//! A block has three names, each for a different job:
//!
//! * [`LocalBlockHash`]: the hash of one block's tokens alone. It does not depend on where the
//!   block stands, so the router can compute it from a prompt and walk the index with it.
//! * [`SequenceHash`]: the router's chained hash of a block and everything before it. It names a
//!   whole prefix, so two requests share a block exactly when they share its sequence hash.
//! * [`ExternalBlockHash`]: the engine's own id of a block at its place in a chain. Engines salt
//!   or digest it in ways the router cannot reproduce, so the index treats it as opaque and only
//!   uses it to find the block again when the engine says it was removed.

use std::fmt;

/// An inference worker (one engine process or endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub u64);

/// A data-parallel rank inside one worker. Each rank has its own KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct DpRank(pub u32);

/// The key a KV cache is tracked under: a worker and one of its data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerKey {
    /// The worker.
    pub worker: WorkerId,
    /// Its data-parallel rank.
    pub dp_rank: DpRank,
}

impl WorkerKey {
    /// The cache of `dp_rank` on `worker`.
    pub const fn new(worker: WorkerId, dp_rank: DpRank) -> Self {
        Self { worker, dp_rank }
    }
}

impl fmt::Display for WorkerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker.0, self.dp_rank.0)
    }
}

/// A request, as the caller names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// The hash of one full block's token ids, independent of its position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalBlockHash(pub u64);

/// The router's chained hash of a block and all blocks before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SequenceHash(pub u64);

/// An engine's opaque id of a block at its place in a chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExternalBlockHash(pub u64);

impl From<SequenceHash> for ExternalBlockHash {
    /// Engines that use the router's own chain (Dynamo's mocker, the op-stream files) publish
    /// sequence hashes as their external ids.
    fn from(h: SequenceHash) -> Self {
        Self(h.0)
    }
}
