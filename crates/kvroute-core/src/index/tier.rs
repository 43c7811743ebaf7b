//! The slower tiers' blocks (a host-memory tier an engine offloads to): a second key space
//! beside the GPU's prefix tree, so the tree and its walk are untouched by them.
//!
//! vLLM's offloading connector names an offloaded block only by the engine's hash, with neither
//! tokens nor parent, and offloads a block while the GPU still holds it. The index therefore
//! places it by the GPU block it knows under that hash: the block's prefix, as the router's
//! [`SequenceHash`] of the path from the root to that node, which a prompt's chain names
//! directly. Each tier keeps, per prefix, the workers that hold it, and per worker the engine's
//! hash of each block it holds (for removals). A lookup asks, for one worker, how many blocks of
//! the chain from a given depth on (where its GPU match ends) the tier holds in a row: vLLM's
//! own lookup of offloaded blocks past the GPU's hit.

use hashbrown::HashMap;

use super::{ExtMap, IndexError, IndexStats, NodeId, Tier};
use crate::hash::next_sequence_hash;
use crate::ids::{ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerKey};
use crate::key_hasher::BuildKeyHasher;

/// One tier's blocks; see the module docs.
#[derive(Debug, Default)]
pub(super) struct TierSet {
    /// The workers holding each prefix on this tier, by the prefix's sequence hash; sorted.
    holders: HashMap<u64, Vec<WorkerKey>, BuildKeyHasher>,
    /// Per worker: the engine's hash of each block it holds here, and the block's prefix.
    blocks: HashMap<WorkerKey, HashMap<u64, u64, BuildKeyHasher>, BuildKeyHasher>,
    /// (worker, block) pairs held.
    entries: usize,
}

impl TierSet {
    /// `worker` holds `external`, whose prefix is `seq`. Returns whether it is newly held.
    pub fn store(&mut self, worker: WorkerKey, external: ExternalBlockHash, seq: SequenceHash) -> bool {
        let mine = self.blocks.entry(worker).or_default();
        match mine.insert(external.0, seq.0) {
            Some(old) if old == seq.0 => return false,
            Some(old) => Self::unhold(&mut self.holders, old, worker),
            None => self.entries += 1,
        }
        let set = self.holders.entry(seq.0).or_default();
        if let Err(at) = set.binary_search(&worker) {
            set.insert(at, worker);
        }
        true
    }

    /// `worker` no longer holds `external`. Returns whether it did.
    pub fn remove(&mut self, worker: WorkerKey, external: ExternalBlockHash) -> bool {
        let Some(seq) = self.blocks.get_mut(&worker).and_then(|m| m.remove(&external.0)) else {
            return false;
        };
        self.entries -= 1;
        Self::unhold(&mut self.holders, seq, worker);
        true
    }

    fn unhold(holders: &mut HashMap<u64, Vec<WorkerKey>, BuildKeyHasher>, seq: u64, worker: WorkerKey) {
        if let Some(set) = holders.get_mut(&seq) {
            if let Ok(at) = set.binary_search(&worker) {
                set.remove(at);
            }
            if set.is_empty() {
                holders.remove(&seq);
            }
        }
    }

    /// `worker` holds nothing on this tier.
    pub fn clear(&mut self, worker: WorkerKey) {
        let Some(mine) = self.blocks.remove(&worker) else {
            return;
        };
        self.entries -= mine.len();
        for seq in mine.into_values() {
            Self::unhold(&mut self.holders, seq, worker);
        }
    }

    /// Blocks `worker` holds on this tier.
    pub fn count(&self, worker: WorkerKey) -> usize {
        self.blocks.get(&worker).map_or(0, HashMap::len)
    }

    /// Whether `worker` holds `external` on this tier.
    pub fn holds(&self, worker: WorkerKey, external: ExternalBlockHash) -> bool {
        self.blocks
            .get(&worker)
            .is_some_and(|m| m.contains_key(&external.0))
    }

    /// Whether no worker holds a block here.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The workers holding a block on this tier, in key order.
    pub fn workers(&self) -> Vec<WorkerKey> {
        let mut w: Vec<WorkerKey> = self
            .blocks
            .iter()
            .filter(|(_, m)| !m.is_empty())
            .map(|(&k, _)| k)
            .collect();
        w.sort_unstable();
        w
    }

    /// How many blocks of `chain` from `from` on `worker` holds here in a row.
    pub fn run(&self, worker: WorkerKey, chain: &[SequenceHash], from: u32) -> u32 {
        let rest = chain.get(from as usize..).unwrap_or_default();
        rest.iter()
            .take_while(|s| {
                self.holders
                    .get(&s.0)
                    .is_some_and(|set| set.binary_search(&worker).is_ok())
            })
            .count() as u32
    }

    /// The two maps agree, sets are sorted and non-empty, and the count is right.
    pub fn check(&self, tier: Tier) -> Result<(), String> {
        let mut pairs = 0usize;
        for (&worker, mine) in &self.blocks {
            for (&external, &seq) in mine {
                let held = self
                    .holders
                    .get(&seq)
                    .is_some_and(|set| set.binary_search(&worker).is_ok());
                if !held {
                    return Err(format!(
                        "{tier:?}: worker {worker} holds block {external:#x} but not its prefix {seq:#x}"
                    ));
                }
            }
            pairs += mine.len();
        }
        if pairs != self.entries {
            return Err(format!("{tier:?}: {pairs} blocks held, {} counted", self.entries));
        }
        for (seq, set) in &self.holders {
            if set.is_empty() || set.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("{tier:?}: prefix {seq:#x} has holders {set:?}"));
            }
        }
        Ok(())
    }
}

/// Every slower tier's [`TierSet`].
#[derive(Debug, Default)]
pub(super) struct Tiers {
    sets: [TierSet; Tier::ALL.len()],
}

impl Tiers {
    pub fn get(&self, tier: Tier) -> &TierSet {
        &self.sets[tier as usize]
    }

    pub fn get_mut(&mut self, tier: Tier) -> &mut TierSet {
        &mut self.sets[tier as usize]
    }

    pub fn clear(&mut self, worker: WorkerKey) {
        for set in &mut self.sets {
            set.clear(worker);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.sets.iter().all(TierSet::is_empty)
    }

    pub fn check(&self) -> Result<(), String> {
        Tier::ALL.iter().try_for_each(|&t| self.get(t).check(t))
    }

    /// `worker` copied `externals`, blocks it holds on the GPU (in `map`, to the layout's block
    /// ids), to `tier`: each is placed at its GPU block's prefix, which `parent` (the block
    /// before, `None` under the root) and `local` (a block's local hash) of either layout give.
    /// Blocks it does not hold on the GPU are left out (the others applied) and reported with
    /// [`IndexError::UnplacedTierBlock`]. `path` is scratch.
    #[allow(
        clippy::too_many_arguments,
        reason = "the layout's tree, lent as two functions"
    )]
    pub fn store_placed(
        &mut self,
        stats: &mut IndexStats,
        map: &ExtMap,
        worker: WorkerKey,
        tier: Tier,
        externals: &[ExternalBlockHash],
        parent: impl Fn(NodeId) -> Option<NodeId>,
        local: impl Fn(NodeId) -> u64,
        path: &mut Vec<NodeId>,
    ) -> Result<(), IndexError> {
        let mut unplaced: Option<(ExternalBlockHash, usize)> = None;
        // The previous block and its prefix: a stretch of a chain extends it by one hash.
        let mut prev: Option<(NodeId, SequenceHash)> = None;
        for &external in externals {
            let Some(block) = map.get(external.0) else {
                let first = unplaced.map_or(external, |(e, _)| e);
                unplaced = Some((first, unplaced.map_or(0, |(_, n)| n) + 1));
                prev = None;
                continue;
            };
            let seq = match prev {
                Some((p, seq)) if Some(p) == parent(block) => {
                    next_sequence_hash(Some(seq), LocalBlockHash(local(block)))
                }
                _ => {
                    // The router's sequence hash of the block's prefix: a walk to the root.
                    path.clear();
                    let mut at = Some(block);
                    while let Some(b) = at {
                        path.push(b);
                        at = parent(b);
                    }
                    path.iter()
                        .rev()
                        .fold(None, |seq, &b| {
                            Some(next_sequence_hash(seq, LocalBlockHash(local(b))))
                        })
                        .unwrap_or(SequenceHash(0))
                }
            };
            prev = Some((block, seq));
            if self.get_mut(tier).store(worker, external, seq) {
                stats.tier_blocks_stored += 1;
            }
        }
        match unplaced {
            None => Ok(()),
            Some((external, n)) => {
                stats.tier_unplaced += n as u64;
                Err(IndexError::UnplacedTierBlock {
                    worker,
                    tier,
                    external,
                    unplaced: n,
                })
            }
        }
    }

    /// `worker` dropped `externals` from `tier`; blocks it did not hold there are ignored.
    pub fn remove(
        &mut self,
        stats: &mut IndexStats,
        worker: WorkerKey,
        tier: Tier,
        externals: &[ExternalBlockHash],
    ) {
        let set = self.get_mut(tier);
        let dropped = externals.iter().filter(|&&e| set.remove(worker, e)).count();
        stats.tier_blocks_removed += dropped as u64;
    }
}
