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

    /// Sets the bits of nodes `from..to` (covered), a word at a time.
    pub(super) fn set_range(&mut self, from: NodeId, to: NodeId) {
        let (mut at, to) = (from as usize, to as usize);
        while at < to {
            let (word, bit) = (at / 64, at % 64);
            let n = (64 - bit).min(to - at);
            let ones = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            if let Some(w) = self.words.get_mut(word) {
                *w |= ones;
            }
            at += n;
        }
    }

    /// Heap bytes, by capacity.
    pub(super) fn allocation_size(&self) -> usize {
        self.words.capacity() * size_of::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #[test]
        fn a_range_sets_exactly_its_bits(from in 0u32..300, len in 0u32..300, before in proptest::collection::vec(any::<bool>(), 600)) {
            let mut links = Links::default();
            links.cover(before.len());
            for (m, &on) in before.iter().enumerate() {
                links.put(m as NodeId, on);
            }
            links.set_range(from, from + len);
            for (m, &on) in before.iter().enumerate() {
                let m = m as NodeId;
                prop_assert_eq!(links.get(m), on || (from..from + len).contains(&m), "bit {}", m);
            }
        }
    }
}
