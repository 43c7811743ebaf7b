//! Which nodes continue the node before them unchanged, one bit a node.
//!
//! Node `m`'s bit is set exactly when its parent is node `m - 1` and its worker set has the same
//! code as `m - 1`'s (equal codes are equal sets; see `wide`). A lookup along a chain laid out in
//! consecutive nodes then reads, a block, the packed local hash (8 bytes) and this bit, not the
//! node: every worker still matching at `m - 1` holds `m`. A cleared bit says nothing (the walk
//! reads the node then), but the index keeps every bit exact, and `check_invariants` checks it.

use super::NodeId;

/// One bit per node id (see the module docs).
#[derive(Clone, Debug, Default)]
pub(super) struct Links {
    words: Vec<u64>,
}

impl Links {
    /// Room for the bits of nodes `0..nodes` (new bits clear).
    pub(super) fn cover(&mut self, nodes: usize) {
        let needed = nodes.div_ceil(64);
        if self.words.len() < needed {
            self.words.resize(needed, 0);
        }
    }

    /// Node `m`'s bit.
    #[inline(always)]
    pub(super) fn get(&self, m: NodeId) -> bool {
        self.words
            .get(m as usize / 64)
            .is_some_and(|w| w >> (m % 64) & 1 != 0)
    }

    /// Sets node `m`'s bit to `on` (`m` is covered).
    #[inline(always)]
    pub(super) fn put(&mut self, m: NodeId, on: bool) {
        if let Some(w) = self.words.get_mut(m as usize / 64) {
            let bit = 1u64 << (m % 64);
            *w = (*w & !bit) | (u64::from(on) << (m % 64));
        }
    }

    /// Heap bytes, by capacity.
    pub(super) fn allocation_size(&self) -> usize {
        self.words.capacity() * size_of::<u64>()
    }
}
