//! The prompts the router recently sent to each worker, as a stand-in for (or a supplement to)
//! the engines' KV events.
//!
//! Three users, one structure:
//!
//! * **Approximate mode** (no KV events): the router's only view of the caches. Entries expire
//!   after a TTL (Dynamo: 120 s) and each worker's set is capped, oldest entries pruned first.
//! * **Predict-on-route** (with KV events): a short-TTL side view, so a burst of sibling requests
//!   lands together before the engine's stored event arrives. A worker's overlap is the larger of
//!   this view's and the index's.
//! * **`sglang-cache-aware`**: SGLang's approximate tree of routed prompts, with no TTL and a
//!   least-recently-routed cap.
//!
//! Every block of a recorded prompt is stamped with the time it was last recorded, so recording
//! a prompt again refreshes its TTL. A block's stamp is never older than its descendants', and
//! expiry and pruning take the oldest stamp first and, among equal stamps, the deepest run first,
//! so a prefix never disappears before its continuations.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::Duration;

use super::chain_trie::{ChainTrie, NodeId, Touched};
use crate::ids::{SequenceHash, WorkerKey};
use crate::time::Timestamp;

/// How long recorded prompts live and how many blocks each worker keeps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecentConfig {
    /// How long a recorded block counts as cached; `None` keeps it until pruned.
    pub ttl: Option<Duration>,
    /// The most blocks kept per worker; past it, the oldest are pruned.
    pub max_blocks: u64,
    /// When a worker passes `max_blocks`, prune it down to this fraction of it (in `(0, 1]`).
    pub prune_ratio: f64,
}

impl RecentConfig {
    /// Dynamo's approximate mode: TTL 120 s, prune to 80% past 2^20 blocks (Dynamo's cap is on
    /// the whole tree; here it is per worker).
    pub const APPROXIMATE: RecentConfig = RecentConfig {
        ttl: Some(Duration::from_secs(120)),
        max_blocks: 1 << 20,
        prune_ratio: 0.8,
    };

    /// Predict-on-route: Dynamo's suggested 5 s TTL, the same cap as approximate mode.
    pub const PREDICT_ON_ROUTE: RecentConfig = RecentConfig {
        ttl: Some(Duration::from_secs(5)),
        max_blocks: 1 << 20,
        prune_ratio: 0.8,
    };
}

/// A heap entry: a node's stamp, then deeper runs first, then the node. Entries go stale when a
/// node is restamped or dropped; a popped entry counts only if it still describes its node.
type Entry = Reverse<(Timestamp, Reverse<u32>, NodeId)>;

#[derive(Clone, Debug, Default)]
struct WorkerRecent {
    trie: ChainTrie<Timestamp>,
    order: BinaryHeap<Entry>,
}

impl WorkerRecent {
    fn push(&mut self, id: NodeId) {
        let node = self.trie.node(id);
        self.order.push(Reverse((node.meta, Reverse(node.start), id)));
    }

    /// Pops the oldest entry and drops its node if the entry is current; returns its stamp.
    fn pop_oldest(&mut self) -> Option<Timestamp> {
        let Reverse((stamp, Reverse(start), id)) = self.order.pop()?;
        if self.is_current(id, stamp, start) {
            self.trie.remove(id);
        }
        Some(stamp)
    }

    fn is_current(&self, id: NodeId, stamp: Timestamp, start: u32) -> bool {
        self.trie
            .get(id)
            .is_some_and(|n| n.meta == stamp && n.start == start)
    }

    /// Rebuilds the heap from the live nodes once stale entries outnumber them.
    fn compact(&mut self) {
        if self.order.len() <= 2 * self.trie.node_count() + 1024 {
            return;
        }
        let entries: Vec<Entry> = self
            .trie
            .nodes()
            .map(|(id, n)| Reverse((n.meta, Reverse(n.start), id)))
            .collect();
        self.order = BinaryHeap::from(entries);
    }
}

/// Recently routed prompts per worker; see the module docs.
#[derive(Clone, Debug)]
pub(crate) struct RecentChains {
    config: RecentConfig,
    workers: BTreeMap<WorkerKey, WorkerRecent>,
    scratch: Touched,
}

impl RecentChains {
    pub(crate) fn new(config: RecentConfig) -> Self {
        Self {
            config,
            workers: BTreeMap::new(),
            scratch: Touched::default(),
        }
    }

    fn alive(&self, stamp: Timestamp, now: Timestamp) -> bool {
        self.config.ttl.is_none_or(|ttl| stamp + ttl > now)
    }

    /// How many leading blocks of `chain` were recorded for `worker` and are still alive.
    pub(crate) fn depth(&self, worker: WorkerKey, chain: &[SequenceHash], now: Timestamp) -> u32 {
        self.workers
            .get(&worker)
            .map_or(0, |w| self.depth_in(w, chain, now))
    }

    /// For each of `keys` (ascending) at position `i`, raises `out[i]` to [`Self::depth`] of
    /// `chain` for that worker: one pass over both key-ordered sets instead of a lookup per key.
    pub(crate) fn raise_depths(
        &self,
        keys: impl Iterator<Item = WorkerKey>,
        chain: &[SequenceHash],
        now: Timestamp,
        out: &mut [u32],
    ) {
        if chain.is_empty() {
            return;
        }
        let mut recorded = self.workers.iter().peekable();
        for (key, out) in keys.zip(out) {
            while recorded.next_if(|&(k, _)| *k < key).is_some() {}
            let Some((_, w)) = recorded.next_if(|&(k, _)| *k == key) else {
                continue;
            };
            *out = (*out).max(self.depth_in(w, chain, now));
        }
    }

    fn depth_in(&self, w: &WorkerRecent, chain: &[SequenceHash], now: Timestamp) -> u32 {
        let mut depth = 0;
        for step in w.trie.walk(chain) {
            if !self.alive(*step.meta, now) {
                break;
            }
            depth = step.matched_end;
        }
        depth
    }

    /// Blocks recorded for `worker` (expired ones included until the next [`Self::expire`]).
    pub(crate) fn blocks(&self, worker: WorkerKey) -> u64 {
        self.workers.get(&worker).map_or(0, |w| w.trie.blocks())
    }

    /// Records that `chain` was sent to `worker` at `now`, then prunes the worker to its cap.
    pub(crate) fn record(&mut self, worker: WorkerKey, chain: &Arc<[SequenceHash]>, now: Timestamp) {
        if chain.is_empty() {
            return;
        }
        let w = self.workers.entry(worker).or_default();
        w.trie.insert(chain, chain.len() as u32, &[], &mut self.scratch);
        for &id in &self.scratch.path {
            *w.trie.meta_mut(id) = now;
            w.push(id);
        }
        for &id in &self.scratch.split_off {
            w.push(id);
        }
        if w.trie.blocks() > self.config.max_blocks {
            let target = (self.config.max_blocks as f64 * self.config.prune_ratio) as u64;
            while w.trie.blocks() > target && w.pop_oldest().is_some() {}
        }
        w.compact();
    }

    /// Drops every block whose TTL has passed by `now`.
    pub(crate) fn expire(&mut self, now: Timestamp) {
        let Some(ttl) = self.config.ttl else { return };
        for w in self.workers.values_mut() {
            while w
                .order
                .peek()
                .is_some_and(|Reverse((stamp, _, _))| *stamp + ttl <= now)
            {
                w.pop_oldest();
            }
            w.compact();
        }
        self.workers.retain(|_, w| !w.trie.is_empty());
    }

    /// When the next block expires (possibly earlier, never later).
    pub(crate) fn next_expiry(&self) -> Option<Timestamp> {
        let ttl = self.config.ttl?;
        self.workers
            .values()
            .filter_map(|w| w.order.peek().map(|Reverse((stamp, _, _))| *stamp + ttl))
            .min()
    }

    /// Forgets `worker`.
    pub(crate) fn remove_worker(&mut self, worker: WorkerKey) {
        self.workers.remove(&worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{DpRank, WorkerId};
    use crate::router::chain_trie::test_chain as chain;

    const W: WorkerKey = WorkerKey::new(WorkerId(1), DpRank(0));

    #[test]
    fn entries_expire_after_the_ttl_and_refresh_when_recorded_again() {
        let ttl = Duration::from_secs(10);
        let mut r = RecentChains::new(RecentConfig {
            ttl: Some(ttl),
            max_blocks: 100,
            prune_ratio: 1.0,
        });
        let a = chain(&[1, 2, 3, 4]);
        let b = chain(&[1, 2, 7]);
        r.record(W, &a, Timestamp::from_millis(0));
        r.record(W, &b, Timestamp::from_millis(5_000));
        assert_eq!(r.depth(W, &a, Timestamp::from_millis(9_000)), 4);
        // a's tail is older than the shared prefix, which b refreshed.
        assert_eq!(r.depth(W, &a, Timestamp::from_millis(12_000)), 2);
        r.expire(Timestamp::from_millis(12_000));
        assert_eq!(r.blocks(W), 3);
        assert_eq!(r.next_expiry(), Some(Timestamp::from_millis(15_000)));
        r.expire(Timestamp::from_millis(15_000));
        assert_eq!(r.blocks(W), 0);
        assert_eq!(r.next_expiry(), None);
    }

    #[test]
    fn the_cap_prunes_the_least_recently_recorded_first() {
        let mut r = RecentChains::new(RecentConfig {
            ttl: None,
            max_blocks: 6,
            prune_ratio: 1.0,
        });
        let old = chain(&[1, 2, 3]);
        let new = chain(&[9, 8, 7]);
        r.record(W, &old, Timestamp::from_millis(1));
        r.record(W, &new, Timestamp::from_millis(2));
        r.record(W, &old, Timestamp::from_millis(3));
        r.record(W, &chain(&[5]), Timestamp::from_millis(4));
        assert_eq!(r.blocks(W), 4);
        assert_eq!(r.depth(W, &old, Timestamp::from_millis(5)), 3);
        assert_eq!(r.depth(W, &new, Timestamp::from_millis(5)), 0);
    }
}
