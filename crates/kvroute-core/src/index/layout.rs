//! The operations both index layouts answer alike, so that the benchmark and the model test run
//! either through one generic path.

use super::{IndexError, IndexFootprint, OverlapScores, PrefixIndex, RunIndex, StoredBlock};
use crate::ids::{ExternalBlockHash, LocalBlockHash, WorkerKey};

/// What [`PrefixIndex`] and [`RunIndex`] answer alike, with the same results (the model test
/// checks both against one reference). Each method is the layout's own method of that name.
pub trait IndexLayout {
    /// Starts tracking `worker`, empty; refused past the layout's worker limit, if it has one.
    fn add_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError>;
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
}

/// The methods both layouts name alike, each the type's own.
macro_rules! same_named {
    ($layout:ty) => {
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
    };
}

impl IndexLayout for PrefixIndex {
    /// The node layout has no worker limit.
    fn add_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
        PrefixIndex::add_worker(self, worker);
        Ok(())
    }
    same_named!(PrefixIndex);
}

impl IndexLayout for RunIndex {
    fn add_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
        RunIndex::add_worker(self, worker)
    }
    same_named!(RunIndex);
}
