//! The engine's live requests by id: one table of [`Sequence`]s, each found by the id it holds.
//!
//! A map from ids to sequences stores each id twice and puts it on a line of its own, away
//! from the fields a pass reads; here a lookup compares the id on the sequence's first cache
//! line, the line that also holds its progress (see [`Sequence`]). Every pass of a busy engine
//! looks up each of its running requests, so on a fleet whose requests do not stay in the
//! CPU's caches a lookup costs the lines it touches.

use std::hash::BuildHasher;
use std::ops::Index;

use hashbrown::HashTable;
use kvroute_core::ids::RequestId;
use kvroute_core::key_hasher::BuildKeyHasher;

use crate::sequence::Sequence;

/// Live requests by id (nothing iterates them in an order that reaches an output).
#[derive(Debug, Default)]
pub(crate) struct Live {
    table: HashTable<Sequence>,
}

fn hash(id: RequestId) -> u64 {
    BuildKeyHasher.hash_one(id)
}

impl Live {
    /// Whether request `id` is live.
    pub fn contains_key(&self, id: &RequestId) -> bool {
        self.get(id).is_some()
    }

    /// Live request `id`, if any.
    pub fn get(&self, id: &RequestId) -> Option<&Sequence> {
        self.table.find(hash(*id), |s| s.id == *id)
    }

    /// Live request `id`, if any.
    pub fn get_mut(&mut self, id: &RequestId) -> Option<&mut Sequence> {
        self.table.find_mut(hash(*id), |s| s.id == *id)
    }

    /// Adds `seq`, whose id must not be live.
    pub fn insert(&mut self, seq: Sequence) {
        debug_assert!(!self.contains_key(&seq.id), "{:?} is already live", seq.id);
        self.table.insert_unique(hash(seq.id), seq, |s| hash(s.id));
    }

    /// Removes live request `id` and returns it, if it was live.
    pub fn remove(&mut self, id: &RequestId) -> Option<Sequence> {
        self.table
            .find_entry(hash(*id), |s| s.id == *id)
            .ok()
            .map(|entry| entry.remove().0)
    }

    /// The live requests, in no particular order.
    pub fn values(&self) -> impl Iterator<Item = &Sequence> {
        self.table.iter()
    }

    /// Live requests.
    pub fn len(&self) -> usize {
        self.table.len()
    }
}

impl Index<&RequestId> for Live {
    type Output = Sequence;

    fn index(&self, id: &RequestId) -> &Sequence {
        self.get(id).expect("a live request")
    }
}
