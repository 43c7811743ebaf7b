//! A worker's map from the engine's external block hashes to tree nodes.
//!
//! This is the index's hottest table: every stored and every removed block probes it once, and
//! with thousands of blocks per worker and dozens of workers it does not fit in cache, so its cost
//! is counted in cache lines. A general Swiss table reads a control group and then a bucket: two
//! lines per probe. Here a slot holds key and value together, slots come in cache-line-aligned
//! groups of four, and a key's probe starts at the first slot of its home line. At the load this
//! table keeps (at most 5/8) a home line rarely overflows, so a lookup, an insert or a removal
//! touches one line. Keys are hashes already; one multiply spreads them. Deletion shifts later
//! entries back (no tombstones), so probe runs stay short under the constant churn of eviction.

use super::NodeId;
use crate::key_hasher::mix;

/// The value marking an empty slot. Node ids never take it (it is the index's `NONE`).
const EMPTY: NodeId = NodeId::MAX;

#[derive(Clone, Copy, Debug)]
struct Slot {
    key: u64,
    node: NodeId,
}

const VACANT: Slot = Slot { key: 0, node: EMPTY };

/// Slots per cache line.
const LINE_SLOTS: usize = 4;

/// Four slots on one 64-byte cache line.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Line([Slot; LINE_SLOTS]);

const VACANT_LINE: Line = Line([VACANT; LINE_SLOTS]);

/// Open-addressing map `u64 -> NodeId` with linear probing from a line-aligned home and
/// backward-shift deletion.
#[derive(Clone, Debug, Default)]
pub(super) struct ExtMap {
    lines: Vec<Line>,
    len: usize,
}

/// Where a key is, or where it would go.
pub(super) enum Probe {
    /// The key is present, mapped to this node.
    Found(NodeId),
    /// The key is absent; this is the slot to insert it into.
    Vacant(usize),
}

impl ExtMap {
    const MIN_LINES: usize = 4;

    /// Number of slots (a power of two, or zero before the first insert).
    #[inline]
    fn capacity(&self) -> usize {
        self.lines.len() * LINE_SLOTS
    }

    #[inline]
    fn slot(&self, i: usize) -> Slot {
        self.lines[i / LINE_SLOTS].0[i % LINE_SLOTS]
    }

    #[inline]
    fn set(&mut self, i: usize, slot: Slot) {
        self.lines[i / LINE_SLOTS].0[i % LINE_SLOTS] = slot;
    }

    /// The first slot of `key`'s home line.
    #[inline]
    fn home(&self, key: u64) -> usize {
        // High bits of the multiplicative hash are the best mixed; shift them down.
        let bits = self.capacity().trailing_zeros();
        (mix(key, 0) >> (64 - bits)) as usize & !(LINE_SLOTS - 1)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn allocation_size(&self) -> usize {
        self.lines.capacity() * size_of::<Line>()
    }

    /// Reads the home slot of every key, so that the probes which follow find them in cache.
    ///
    /// The loads are independent and feed no branch, so the processor issues them all at once
    /// instead of one cache miss after another (a prefetch in safe code). Returns a value to
    /// pass to [`std::hint::black_box`], which keeps the loads from being optimized away.
    #[inline]
    pub(super) fn touch(&self, keys: impl Iterator<Item = u64>) -> u64 {
        if self.lines.is_empty() {
            return 0;
        }
        keys.fold(0, |acc, key| acc ^ self.slot(self.home(key)).key)
    }

    /// Looks `key` up, reporting the node or the slot to insert it into.
    #[inline]
    pub(super) fn probe(&self, key: u64) -> Probe {
        if self.lines.is_empty() {
            return Probe::Vacant(usize::MAX);
        }
        let mask = self.capacity() - 1;
        let mut i = self.home(key);
        loop {
            let slot = self.slot(i);
            if slot.node == EMPTY {
                return Probe::Vacant(i);
            }
            if slot.key == key {
                return Probe::Found(slot.node);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(super) fn get(&self, key: u64) -> Option<NodeId> {
        match self.probe(key) {
            Probe::Found(node) => Some(node),
            Probe::Vacant(_) => None,
        }
    }

    /// Inserts `key` at `at`, the slot a [`Probe::Vacant`] for it named, with no other insert
    /// or removal in between.
    #[inline]
    pub(super) fn insert_at(&mut self, at: usize, key: u64, node: NodeId) {
        debug_assert!(node != EMPTY);
        if at == usize::MAX || (self.len + 1) * 8 > self.capacity() * 5 {
            // Too full (or unallocated): grow, then place the key afresh.
            self.grow();
            match self.probe(key) {
                Probe::Vacant(i) => self.set(i, Slot { key, node }),
                Probe::Found(_) => unreachable!("insert_at is only called for absent keys"),
            }
        } else {
            self.set(at, Slot { key, node });
        }
        self.len += 1;
    }

    /// Removes `key`, returning its node.
    #[inline]
    pub(super) fn remove(&mut self, key: u64) -> Option<NodeId> {
        if self.lines.is_empty() {
            return None;
        }
        let mask = self.capacity() - 1;
        let mut i = self.home(key);
        loop {
            let slot = self.slot(i);
            if slot.node == EMPTY {
                return None;
            }
            if slot.key == key {
                break;
            }
            i = (i + 1) & mask;
        }
        let removed = self.slot(i).node;
        // Backward shift: pull later entries of the run into the hole when their home allows.
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let slot = self.slot(j);
            if slot.node == EMPTY {
                break;
            }
            let home = self.home(slot.key);
            // The entry at j may move to the hole if its home is not in (hole, j] (cyclically).
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.set(hole, slot);
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.set(hole, VACANT);
        self.len -= 1;
        Some(removed)
    }

    /// Removes every entry, keeping the allocation, and yields the nodes that were mapped.
    pub(super) fn drain_nodes(&mut self) -> impl Iterator<Item = NodeId> + '_ {
        self.len = 0;
        self.lines
            .iter_mut()
            .flat_map(|line| line.0.iter_mut())
            .filter(|s| s.node != EMPTY)
            .map(|s| std::mem::replace(s, VACANT).node)
    }

    /// Every key and its node, in slot order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, NodeId)> + '_ {
        self.lines
            .iter()
            .flat_map(|line| line.0.iter())
            .filter(|s| s.node != EMPTY)
            .map(|s| (s.key, s.node))
    }

    fn grow(&mut self) {
        let new_lines = (self.lines.len() * 2).max(Self::MIN_LINES);
        let old = std::mem::replace(&mut self.lines, vec![VACANT_LINE; new_lines]);
        let mask = self.capacity() - 1;
        for slot in old
            .iter()
            .flat_map(|line| line.0.iter())
            .filter(|s| s.node != EMPTY)
        {
            let mut i = self.home(slot.key);
            while self.slot(i).node != EMPTY {
                i = (i + 1) & mask;
            }
            self.set(i, *slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum MapOp {
        Insert(u64, NodeId),
        Remove(u64),
        Drain,
    }

    fn op() -> impl Strategy<Value = MapOp> {
        // Few distinct keys, so inserts and removes collide; some share a home slot.
        let key = prop_oneof![0u64..48, any::<u64>()];
        prop_oneof![
            6 => (key.clone(), 0u32..1000).prop_map(|(k, v)| MapOp::Insert(k, v)),
            4 => key.prop_map(MapOp::Remove),
            1 => Just(MapOp::Drain),
        ]
    }

    proptest! {
        #[test]
        fn behaves_like_a_hash_map(ops in proptest::collection::vec(op(), 1..400)) {
            let mut map = ExtMap::default();
            let mut model: HashMap<u64, NodeId> = HashMap::new();
            for op in ops {
                match op {
                    MapOp::Insert(k, v) => match map.probe(k) {
                        Probe::Found(node) => prop_assert_eq!(model.get(&k), Some(&node)),
                        Probe::Vacant(at) => {
                            prop_assert!(!model.contains_key(&k));
                            map.insert_at(at, k, v);
                            model.insert(k, v);
                        }
                    },
                    MapOp::Remove(k) => prop_assert_eq!(map.remove(k), model.remove(&k)),
                    MapOp::Drain => {
                        let mut drained: Vec<NodeId> = map.drain_nodes().collect();
                        let mut expected: Vec<NodeId> = model.drain().map(|(_, v)| v).collect();
                        drained.sort_unstable();
                        expected.sort_unstable();
                        prop_assert_eq!(drained, expected);
                    }
                }
                prop_assert_eq!(map.len(), model.len());
                for (k, v) in &model {
                    prop_assert_eq!(map.get(*k), Some(*v));
                }
            }
        }
    }
}
