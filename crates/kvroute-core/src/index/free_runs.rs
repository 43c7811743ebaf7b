//! The arena's free node ids, kept as runs of consecutive ids so that a chain is laid out in
//! consecutive nodes.
//!
//! A lookup or a store walks a chain one node after another. When the child of node `n` is node
//! `n + 1`, the walk knows the next node's address before it has read the current one, so the
//! processor overlaps the loads and the hardware prefetcher streams them; with ids handed out in
//! the order they were freed (a plain stack), chains end up scattered over the arena after a
//! while of evictions, and every block of a walk waits on one cache miss.
//!
//! So frees are coalesced: a chain freed leaf first (as [`super::PrefixIndex`]'s `collect` climbs)
//! gives back its ids as one run, and a new chain takes ids from the front of the most recent run.
//! A chain that needs more ids than the top run has is laid at the arena's end instead, as long as
//! the free ids stay a small fraction of the arena (the `SLACK` below) and the arena has room
//! without reallocating, so memory stays what it was.

use super::NodeId;

/// Free ids may make up at most `1 / SLACK` of the arena before an allocation must use short
/// runs instead of growing the arena.
const SLACK: usize = 16;

/// A chain shorter than this takes ids from the top run even when the run is shorter than the
/// chain: at worst one break every `SHORT` nodes.
const SHORT: usize = 8;

/// A run of free ids `start..start + len`.
#[derive(Clone, Copy, Debug)]
struct Run {
    start: NodeId,
    len: u32,
}

/// The free ids of the node arena, as a stack of runs of consecutive ids.
#[derive(Clone, Debug, Default)]
pub(super) struct FreeRuns {
    runs: Vec<Run>,
    /// Free ids in all runs.
    count: usize,
}

/// Where the ids of a new chain come from.
pub(super) enum Source {
    /// From the free runs: take them with [`FreeRuns::take_up_to`].
    Free,
    /// From the arena's end (the free runs are too short and there is room to grow).
    End,
}

impl FreeRuns {
    /// How many ids are free.
    pub(super) fn len(&self) -> usize {
        self.count
    }

    /// Heap bytes held.
    pub(super) fn allocation_size(&self) -> usize {
        self.runs.capacity() * size_of::<Run>()
    }

    /// Gives back `id`, joining it to the most recent run when it is adjacent.
    #[inline]
    pub(super) fn free(&mut self, id: NodeId) {
        self.count += 1;
        if let Some(top) = self.runs.last_mut() {
            if top.start == id.wrapping_add(1) {
                top.start = id;
                top.len += 1;
                return;
            }
            if top.start.wrapping_add(top.len) == id {
                top.len += 1;
                return;
            }
        }
        self.runs.push(Run { start: id, len: 1 });
    }

    /// Where the `needed` ids of a new chain should come from, in an arena of `arena` nodes
    /// with room for `capacity` without reallocating. The arena grows past its capacity only
    /// when no id is free, as it would without runs, so memory is what it was.
    #[inline]
    pub(super) fn source(&self, needed: usize, arena: usize, capacity: usize) -> Source {
        match self.runs.last() {
            None => Source::End,
            Some(top) if top.len as usize >= needed.min(SHORT) => Source::Free,
            Some(_) if self.count * SLACK > arena || arena + needed > capacity => Source::Free,
            Some(_) => Source::End,
        }
    }

    /// Up to `max` (at least one) consecutive free ids from the front of the most recent run:
    /// the first and how many.
    #[inline]
    pub(super) fn take_up_to(&mut self, max: usize) -> Option<(NodeId, usize)> {
        let top = self.runs.last_mut()?;
        let n = (top.len as usize).min(max);
        let start = top.start;
        top.start += n as u32;
        top.len -= n as u32;
        if top.len == 0 {
            self.runs.pop();
        }
        self.count -= n;
        Some((start, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_freed_leaf_first_is_taken_back_in_order() {
        let mut free = FreeRuns::default();
        for id in (10..20).rev() {
            free.free(id);
        }
        free.free(40);
        assert_eq!(free.len(), 11);
        assert!(matches!(free.source(3, 100, 100), Source::Free));
        assert_eq!(free.take_up_to(3), Some((40, 1)));
        assert_eq!(free.take_up_to(4), Some((10, 4)));
        assert_eq!(free.take_up_to(100), Some((14, 6)));
        assert_eq!(free.take_up_to(1), None);
        assert_eq!(free.len(), 0);
        assert!(matches!(free.source(1, 100, 100), Source::End));
    }

    #[test]
    fn short_runs_are_skipped_only_while_there_is_room() {
        let mut free = FreeRuns::default();
        free.free(5);
        // A long chain and a short run: the arena's end, if the arena has room and few ids free.
        assert!(matches!(free.source(20, 100, 200), Source::End));
        // No room without reallocating: the short run.
        assert!(matches!(free.source(20, 100, 110), Source::Free));
        // Too many ids free: the short run.
        assert!(matches!(free.source(20, 10, 200), Source::Free));
        // A chain no longer than the run: the run.
        assert!(matches!(free.source(1, 100, 200), Source::Free));
    }
}
