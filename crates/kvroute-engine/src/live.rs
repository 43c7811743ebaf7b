//! The engine's live requests: each [`Sequence`] in a slot it keeps from its arrival to its end,
//! found by id through a table of `(id, slot)` pairs, and the running requests in order with
//! their slots.
//!
//! Every pass of a busy engine reads each of its running requests, and a decode stretch plans
//! and runs over all of them; on a fleet whose requests do not stay in the CPU's caches a read
//! costs the lines it touches. A walk of the running requests goes by slot: it reads each
//! sequence's line and no line of the table. A lookup by id (an arrival, an admission, an
//! abort) reads the table's control and pair lines first.

use std::hash::BuildHasher;
use std::ops::Index;

use hashbrown::HashTable;
use kvroute_core::ids::RequestId;
use kvroute_core::key_hasher::BuildKeyHasher;

use crate::sequence::Sequence;

/// Where a live request's [`Sequence`] is in [`Live`]: fixed while it is live; a slot freed by a
/// request's end is reused by a later one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slot(u32);

/// Live requests by id (nothing iterates them in an order that reaches an output).
#[derive(Debug, Default)]
pub(crate) struct Live {
    seqs: Vec<Option<Sequence>>,
    /// Slots of `seqs` that hold nothing.
    free: Vec<u32>,
    by_id: HashTable<(RequestId, Slot)>,
}

fn hash(id: RequestId) -> u64 {
    BuildKeyHasher.hash_one(id)
}

impl Live {
    /// Whether request `id` is live.
    pub fn contains_key(&self, id: &RequestId) -> bool {
        self.slot(id).is_some()
    }

    /// Live request `id`'s slot, if it is live.
    pub fn slot(&self, id: &RequestId) -> Option<Slot> {
        self.by_id
            .find(hash(*id), |&(k, _)| k == *id)
            .map(|&(_, slot)| slot)
    }

    /// Live request `id`, if any.
    pub fn get(&self, id: &RequestId) -> Option<&Sequence> {
        self.slot(id).map(|slot| self.at(slot))
    }

    /// The request at `slot`, which must be live.
    pub fn at(&self, slot: Slot) -> &Sequence {
        self.seqs[slot.0 as usize]
            .as_ref()
            .unwrap_or_else(|| unreachable!("slot {} is free", slot.0))
    }

    /// The request at `slot`, which must be live.
    pub fn at_mut(&mut self, slot: Slot) -> &mut Sequence {
        self.seqs[slot.0 as usize]
            .as_mut()
            .unwrap_or_else(|| unreachable!("slot {} is free", slot.0))
    }

    /// Whether a request is live at `slot`.
    pub fn holds(&self, slot: Slot) -> bool {
        self.seqs.get(slot.0 as usize).is_some_and(Option::is_some)
    }

    /// Adds `seq`, whose id must not be live, and returns its slot.
    pub fn insert(&mut self, seq: Sequence) -> Slot {
        debug_assert!(!self.contains_key(&seq.id), "{:?} is already live", seq.id);
        let id = seq.id;
        let slot = match self.free.pop() {
            Some(s) => {
                self.seqs[s as usize] = Some(seq);
                Slot(s)
            }
            None => {
                self.seqs.push(Some(seq));
                Slot(self.seqs.len() as u32 - 1)
            }
        };
        self.by_id.insert_unique(hash(id), (id, slot), |&(k, _)| hash(k));
        slot
    }

    /// Removes live request `id` and returns it, if it was live.
    pub fn remove(&mut self, id: &RequestId) -> Option<Sequence> {
        let (_, slot) = self
            .by_id
            .find_entry(hash(*id), |&(k, _)| k == *id)
            .ok()?
            .remove()
            .0;
        self.free.push(slot.0);
        self.seqs[slot.0 as usize].take()
    }

    /// The live requests, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &Sequence> {
        self.seqs.iter().flatten()
    }

    /// Live requests.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }
}

impl Index<&RequestId> for Live {
    type Output = Sequence;

    fn index(&self, id: &RequestId) -> &Sequence {
        self.get(id).expect("a live request")
    }
}

/// The running requests, oldest first, each with its slot in [`Live`].
#[derive(Debug, Default)]
pub(crate) struct Running {
    ids: Vec<RequestId>,
    slots: Vec<Slot>,
}

impl Running {
    /// The running requests' ids, oldest first.
    pub fn ids(&self) -> &[RequestId] {
        &self.ids
    }

    /// Their slots, in the same order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Adds the newest running request.
    pub fn push(&mut self, id: RequestId, slot: Slot) {
        self.ids.push(id);
        self.slots.push(slot);
    }

    /// Takes the newest running request.
    pub fn pop(&mut self) -> Option<(RequestId, Slot)> {
        Some((self.ids.pop()?, self.slots.pop()?))
    }

    /// Keeps the running requests for which `keep` holds, in order.
    pub fn retain(&mut self, mut keep: impl FnMut(RequestId, Slot) -> bool) {
        let mut kept = 0;
        for i in 0..self.ids.len() {
            if keep(self.ids[i], self.slots[i]) {
                self.ids[kept] = self.ids[i];
                self.slots[kept] = self.slots[i];
                kept += 1;
            }
        }
        self.ids.truncate(kept);
        self.slots.truncate(kept);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::config::EngineConfig;
    use crate::request::{EnginePrompt, EngineRequest, KvReportMode};

    fn seq(id: u64) -> Sequence {
        let request = EngineRequest {
            id: RequestId(id),
            prompt: EnginePrompt::Tokens(vec![1, 2, 3]),
            output_len: 4,
            lora_name: None,
            cache_namespace: None,
            kv_report: KvReportMode::Incremental,
        };
        Sequence::new(request, &EngineConfig::default()).expect("a valid request")
    }

    proptest! {
        /// Against a map of ids to slots: every live id is found at the slot it got when it
        /// came (which no other live id holds), and nothing else is live. The running list
        /// keeps its pairs, in order, through pushes, pops and retains.
        #[test]
        fn ids_keep_their_slots_while_live(ops in prop::collection::vec((0u64..24, 0u8..4), 1..200)) {
            let mut live = Live::default();
            let mut model: BTreeMap<u64, Slot> = BTreeMap::new();
            let mut running = Running::default();
            let mut order: Vec<(RequestId, Slot)> = Vec::new();
            for (id, op) in ops {
                match (op, model.get(&id).copied()) {
                    (0 | 1, None) => {
                        let slot = live.insert(seq(id));
                        prop_assert!(model.values().all(|&s| s != slot), "slot {slot:?} reused while live");
                        model.insert(id, slot);
                        running.push(RequestId(id), slot);
                        order.push((RequestId(id), slot));
                    }
                    (2, Some(_)) => {
                        prop_assert_eq!(live.remove(&RequestId(id)).map(|s| s.id), Some(RequestId(id)));
                        model.remove(&id);
                        running.retain(|_, slot| live.holds(slot));
                        order.retain(|&(r, _)| r != RequestId(id));
                    }
                    (3, _) => {
                        prop_assert_eq!(running.pop(), order.pop());
                    }
                    (_, Some(_)) => {}
                    (_, None) => prop_assert!(live.remove(&RequestId(id)).is_none()),
                }
                prop_assert_eq!(live.len(), model.len());
                prop_assert_eq!(live.values().count(), model.len());
                for i in 0..24 {
                    let slot = model.get(&i).copied();
                    prop_assert_eq!(live.slot(&RequestId(i)), slot);
                    if let Some(slot) = slot {
                        prop_assert_eq!(live.at(slot).id, RequestId(i));
                        prop_assert_eq!(live[&RequestId(i)].id, RequestId(i));
                    }
                }
                prop_assert_eq!(running.ids(), order.iter().map(|&(r, _)| r).collect::<Vec<_>>());
                prop_assert_eq!(running.slots(), order.iter().map(|&(_, s)| s).collect::<Vec<_>>());
            }
        }
    }
}
