//! The operations both index layouts answer alike, so that the benchmark and the model test run
//! either through one generic path.

use super::{
    IndexConfig, IndexError, IndexEvent, IndexFootprint, IndexStats, OverlapScores, PrefixIndex, RunIndex,
    StoredBlock, Tier,
};
use crate::ids::{ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerKey};

/// What [`PrefixIndex`] and [`RunIndex`] answer alike, with the same results (the model test
/// checks both against one reference). Each method is the layout's own method of that name.
pub trait IndexLayout {
    /// An empty index with no workers.
    fn with_config(config: IndexConfig) -> Self
    where
        Self: Sized;
    /// Starts tracking `worker`, empty (a worker already tracked is left alone).
    fn add_worker(&mut self, worker: WorkerKey);
    /// Stops tracking `worker` and drops its blocks.
    fn remove_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError>;
    /// Drops every block of `worker`, which stays tracked.
    fn clear_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError>;
    /// `worker` now holds `blocks`, continuing the chain from `parent` (the root if `None`).
    fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError>;
    /// `worker` no longer holds `blocks`; how many it held.
    fn apply_removed(&mut self, worker: WorkerKey, blocks: &[ExternalBlockHash])
    -> Result<usize, IndexError>;
    /// Each worker's matched depth along `query`, into `out`.
    fn find_matches_into(&self, query: &[LocalBlockHash], early_exit: bool, out: &mut OverlapScores);
    /// Entries, nodes and heap bytes.
    fn footprint(&self) -> IndexFootprint;
    /// Blocks `worker` holds.
    fn block_count(&self, worker: WorkerKey) -> usize;
    /// Whether `worker` holds the block the engine calls `external`.
    fn holds(&self, worker: WorkerKey, external: ExternalBlockHash) -> bool;
    /// The layout's structural invariants.
    fn check_invariants(&self) -> Result<(), String>;
    /// The workers tracked, in slot order.
    fn workers(&self) -> impl Iterator<Item = WorkerKey> + '_;
    /// The external hashes of every block `worker` holds, in no particular order.
    fn held_blocks(&self, worker: WorkerKey) -> impl Iterator<Item = ExternalBlockHash> + '_;
    /// How many of `worker`'s blocks no other worker holds.
    fn sole_blocks(&self, worker: WorkerKey) -> usize;
    /// The counters of what the index was asked to do.
    fn stats(&self) -> IndexStats;
    /// Applies one event of `worker`.
    fn apply_event(&mut self, worker: WorkerKey, event: IndexEvent<'_>) -> Result<(), IndexError>;
    /// `worker` copied `externals`, blocks it holds on the GPU, to `tier`.
    fn apply_tier_stored(
        &mut self,
        worker: WorkerKey,
        tier: Tier,
        externals: &[ExternalBlockHash],
    ) -> Result<(), IndexError>;
    /// Blocks `worker` holds on `tier`.
    fn tier_block_count(&self, worker: WorkerKey, tier: Tier) -> usize;
    /// Whether `worker` holds the block the engine calls `external` on `tier`.
    fn tier_holds(&self, worker: WorkerKey, tier: Tier, external: ExternalBlockHash) -> bool;
    /// Whether any worker holds a block on a slower tier.
    fn has_tier_blocks(&self) -> bool;
    /// Each worker's run on `tier` of `chain` past its GPU depth, onto `out` where above 0.
    fn tier_runs_into(
        &self,
        tier: Tier,
        chain: &[SequenceHash],
        gpu: impl Fn(WorkerKey) -> u32,
        out: &mut Vec<(WorkerKey, u32)>,
    );
}

/// The methods both layouts name alike, each the type's own.
macro_rules! same_named {
    ($layout:ty) => {
        fn with_config(config: IndexConfig) -> Self {
            <$layout>::new(config)
        }
        fn add_worker(&mut self, worker: WorkerKey) {
            <$layout>::add_worker(self, worker)
        }
        fn remove_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
            <$layout>::remove_worker(self, worker)
        }
        fn clear_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
            <$layout>::clear_worker(self, worker)
        }
        fn apply_stored(
            &mut self,
            worker: WorkerKey,
            parent: Option<ExternalBlockHash>,
            blocks: &[StoredBlock],
        ) -> Result<(), IndexError> {
            <$layout>::apply_stored(self, worker, parent, blocks)
        }
        fn apply_removed(
            &mut self,
            worker: WorkerKey,
            blocks: &[ExternalBlockHash],
        ) -> Result<usize, IndexError> {
            <$layout>::apply_removed(self, worker, blocks)
        }
        fn find_matches_into(&self, query: &[LocalBlockHash], early_exit: bool, out: &mut OverlapScores) {
            <$layout>::find_matches_into(self, query, early_exit, out)
        }
        fn footprint(&self) -> IndexFootprint {
            <$layout>::footprint(self)
        }
        fn block_count(&self, worker: WorkerKey) -> usize {
            <$layout>::block_count(self, worker)
        }
        fn holds(&self, worker: WorkerKey, external: ExternalBlockHash) -> bool {
            <$layout>::holds(self, worker, external)
        }
        fn check_invariants(&self) -> Result<(), String> {
            <$layout>::check_invariants(self)
        }
        fn workers(&self) -> impl Iterator<Item = WorkerKey> + '_ {
            <$layout>::workers(self)
        }
        fn held_blocks(&self, worker: WorkerKey) -> impl Iterator<Item = ExternalBlockHash> + '_ {
            <$layout>::held_blocks(self, worker)
        }
        fn sole_blocks(&self, worker: WorkerKey) -> usize {
            <$layout>::sole_blocks(self, worker)
        }
        fn stats(&self) -> IndexStats {
            <$layout>::stats(self)
        }
        fn apply_event(&mut self, worker: WorkerKey, event: IndexEvent<'_>) -> Result<(), IndexError> {
            <$layout>::apply_event(self, worker, event)
        }
        fn apply_tier_stored(
            &mut self,
            worker: WorkerKey,
            tier: Tier,
            externals: &[ExternalBlockHash],
        ) -> Result<(), IndexError> {
            <$layout>::apply_tier_stored(self, worker, tier, externals)
        }
        fn tier_block_count(&self, worker: WorkerKey, tier: Tier) -> usize {
            <$layout>::tier_block_count(self, worker, tier)
        }
        fn tier_holds(&self, worker: WorkerKey, tier: Tier, external: ExternalBlockHash) -> bool {
            <$layout>::tier_holds(self, worker, tier, external)
        }
        fn has_tier_blocks(&self) -> bool {
            <$layout>::has_tier_blocks(self)
        }
        fn tier_runs_into(
            &self,
            tier: Tier,
            chain: &[SequenceHash],
            gpu: impl Fn(WorkerKey) -> u32,
            out: &mut Vec<(WorkerKey, u32)>,
        ) {
            <$layout>::tier_runs_into(self, tier, chain, gpu, out)
        }
    };
}

impl IndexLayout for PrefixIndex {
    same_named!(PrefixIndex);
}

impl IndexLayout for RunIndex {
    same_named!(RunIndex);
}
