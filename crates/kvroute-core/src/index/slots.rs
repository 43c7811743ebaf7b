//! The worker-slot table both index layouts keep: each tracked worker gets a dense slot (its bit
//! in the layouts' holder masks) and its map from the engine's external hashes to the layout's
//! block ids. A removed worker's slot is reused by the next worker added.

use std::collections::VecDeque;

use hashbrown::HashMap;

use super::{ExtMap, IndexError, NodeId};
use crate::ids::{ExternalBlockHash, WorkerKey};
use crate::key_hasher::BuildKeyHasher;

/// One worker's view: the engine's external hashes of the blocks it holds.
#[derive(Debug)]
pub(super) struct WorkerSlot {
    pub(super) key: WorkerKey,
    pub(super) blocks: ExtMap,
    /// With a cap: the external hashes of the blocks stored, oldest first (some since removed).
    pub(super) order: VecDeque<u64>,
}

/// Tracked workers by dense slot.
#[derive(Debug, Default)]
pub(super) struct Slots {
    slots: Vec<Option<WorkerSlot>>,
    slot_of: HashMap<WorkerKey, u32, BuildKeyHasher>,
}

impl Slots {
    /// Gives `worker` a slot (the lowest free one) whose map is sized for `per_worker` blocks,
    /// and returns it; `None` if `worker` is already tracked.
    pub(super) fn add(&mut self, worker: WorkerKey, per_worker: usize) -> Option<usize> {
        if self.slot_of.contains_key(&worker) {
            return None;
        }
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        let mut blocks = ExtMap::default();
        blocks.reserve(per_worker);
        self.slots[slot] = Some(WorkerSlot {
            key: worker,
            blocks,
            order: VecDeque::new(),
        });
        self.slot_of.insert(worker, slot as u32);
        Some(slot)
    }

    /// Frees `worker`'s slot, if it has one.
    pub(super) fn remove(&mut self, worker: WorkerKey) {
        if let Some(slot) = self.slot_of.remove(&worker) {
            self.slots[slot as usize] = None;
        }
    }

    /// `worker`'s slot number.
    #[inline]
    pub(super) fn index(&self, worker: WorkerKey) -> Option<usize> {
        self.slot_of.get(&worker).map(|&s| s as usize)
    }

    /// `worker`'s slot number, or [`IndexError::UnknownWorker`].
    #[inline]
    pub(super) fn index_of(&self, worker: WorkerKey) -> Result<usize, IndexError> {
        self.index(worker).ok_or(IndexError::UnknownWorker(worker))
    }

    /// `worker`'s slot.
    pub(super) fn get(&self, worker: WorkerKey) -> Option<&WorkerSlot> {
        self.slots[self.index(worker)?].as_ref()
    }

    /// The worker in `slot`, if any (a slot number past the table's is empty).
    #[inline]
    pub(super) fn at(&self, slot: usize) -> Option<&WorkerSlot> {
        self.slots.get(slot).and_then(Option::as_ref)
    }

    /// The slot `slot`, which is taken (a number from [`Slots::add`] or [`Slots::index`]).
    #[inline]
    pub(super) fn taken(&self, slot: usize) -> &WorkerSlot {
        self.slots[slot]
            .as_ref()
            .unwrap_or_else(|| unreachable!("slot {slot} is registered in slot_of"))
    }

    /// [`Slots::taken`], mutable.
    #[inline]
    pub(super) fn taken_mut(&mut self, slot: usize) -> &mut WorkerSlot {
        self.slots[slot]
            .as_mut()
            .unwrap_or_else(|| unreachable!("slot {slot} is registered in slot_of"))
    }

    /// Whether `worker` is tracked.
    pub(super) fn contains(&self, worker: WorkerKey) -> bool {
        self.slot_of.contains_key(&worker)
    }

    /// The taken slots with their numbers, in slot order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &WorkerSlot)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| s.as_ref().map(|s| (slot, s)))
    }

    /// How many blocks `worker` holds.
    pub(super) fn block_count(&self, worker: WorkerKey) -> usize {
        self.get(worker).map_or(0, |s| s.blocks.len())
    }

    /// Whether `worker` holds the block the engine calls `external`.
    pub(super) fn holds(&self, worker: WorkerKey, external: ExternalBlockHash) -> bool {
        self.get(worker)
            .is_some_and(|s| s.blocks.get(external.0).is_some())
    }

    /// Takes the oldest blocks of the worker in `slot` (in the order they were first stored) out
    /// of its map until it holds at most `cap`, onto `dropped` (the layout's block ids, for the
    /// layout to release), and compacts its order; returns how many. Shared by both layouts.
    pub(super) fn evict_over_cap(&mut self, slot: usize, cap: usize, dropped: &mut Vec<NodeId>) -> u64 {
        let s = self.taken_mut(slot);
        let mut evicted = 0u64;
        while s.blocks.len() > cap {
            let Some(oldest) = s.order.pop_front() else {
                break;
            };
            if let Some(block) = s.blocks.remove(oldest) {
                dropped.push(block);
                evicted += 1;
            }
        }
        if s.order.len() > 2 * s.blocks.len() + 64 {
            // Keep the first entry of each block still held (a block removed and stored again
            // is listed twice; its first place in line is kept).
            let mut seen: hashbrown::HashSet<u64, BuildKeyHasher> =
                hashbrown::HashSet::with_capacity_and_hasher(s.blocks.len(), BuildKeyHasher);
            let blocks = &s.blocks;
            s.order.retain(|&e| blocks.get(e).is_some() && seen.insert(e));
        }
        evicted
    }

    /// Map entries over every worker.
    pub(super) fn entries(&self) -> usize {
        self.iter().map(|(_, s)| s.blocks.len()).sum()
    }

    /// Heap bytes: the table, its index and the workers' maps.
    pub(super) fn allocation_size(&self) -> usize {
        self.slots.capacity() * size_of::<Option<WorkerSlot>>()
            + self.slot_of.allocation_size()
            + self
                .iter()
                .map(|(_, s)| s.blocks.allocation_size())
                .sum::<usize>()
    }
}
