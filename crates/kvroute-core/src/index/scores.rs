//! The answer to a prefix lookup.

use crate::ids::WorkerKey;

/// Each worker's matched depth (in blocks) for one query. Workers with depth 0 are absent.
///
/// Entries are in the order the lookup's walk lets workers go: by depth, shallowest first, and
/// among workers that stop at the same depth by worker slot (which depends only on the order
/// workers were added and removed). The order is deterministic, but it is not the slot order:
/// a caller that needs one looks a worker up with [`Self::depth`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapScores {
    scores: Vec<(WorkerKey, u32)>,
}

impl OverlapScores {
    /// The depth of `worker`, or 0.
    pub fn depth(&self, worker: WorkerKey) -> u32 {
        self.scores
            .iter()
            .find(|(w, _)| *w == worker)
            .map_or(0, |&(_, d)| d)
    }

    /// Every worker with a non-zero depth, and its depth.
    pub fn iter(&self) -> impl Iterator<Item = (WorkerKey, u32)> + '_ {
        self.scores.iter().copied()
    }

    /// How many workers matched at least one block.
    pub fn len(&self) -> usize {
        self.scores.len()
    }

    /// Whether no worker matched.
    pub fn is_empty(&self) -> bool {
        self.scores.is_empty()
    }

    /// The deepest match over all workers, or 0.
    pub fn max_depth(&self) -> u32 {
        self.scores.iter().map(|&(_, d)| d).max().unwrap_or(0)
    }

    pub(super) fn clear(&mut self) {
        self.scores.clear();
    }

    #[inline]
    pub(super) fn push(&mut self, worker: WorkerKey, depth: u32) {
        self.scores.push((worker, depth));
    }
}
