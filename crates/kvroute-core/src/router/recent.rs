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
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use hashbrown::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::chain_trie::{ChainTrie, NodeId, Touched};
use crate::ids::{SequenceHash, WorkerKey};
use crate::key_hasher::BuildKeyHasher;
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

    /// Pops the oldest entry and drops its node if the entry is current; returns its stamp and,
    /// if the node dropped was a root (a run from position 0), the hash it started with.
    fn pop_oldest(&mut self) -> Option<(Timestamp, Option<SequenceHash>)> {
        let Reverse((stamp, Reverse(start), id)) = self.order.pop()?;
        let mut root = None;
        if self.is_current(id, stamp, start) {
            root = (start == 0).then(|| self.trie.node(id).hash_at(0));
            self.trie.remove(id);
        }
        Some((stamp, root))
    }

    /// The first hashes of this worker's root runs.
    fn roots(&self) -> impl Iterator<Item = SequenceHash> + '_ {
        self.trie
            .nodes()
            .filter(|(_, n)| n.start == 0)
            .map(|(_, n)| n.hash_at(0))
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
    /// The workers holding a run from position 0 that starts with each hash: a prompt's chain
    /// runs into no other worker's set, so only these are walked (see [`Self::raise_depths`]).
    by_root: HashMap<SequenceHash, BTreeSet<WorkerKey>, BuildKeyHasher>,
    scratch: Touched,
}

impl RecentChains {
    pub(crate) fn new(config: RecentConfig) -> Self {
        Self {
            config,
            workers: BTreeMap::new(),
            by_root: HashMap::default(),
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

    /// For every worker whose [`Self::depth`] of `chain` may be above 0 (those holding a run
    /// that starts with the chain's first hash; every other one has depth 0), raises
    /// `out[slot(worker)]` to it; workers `slot` does not place are skipped.
    pub(crate) fn raise_depths(
        &self,
        chain: &[SequenceHash],
        now: Timestamp,
        mut slot: impl FnMut(WorkerKey) -> Option<usize>,
        out: &mut [u32],
    ) {
        let Some(holders) = chain.first().and_then(|first| self.by_root.get(first)) else {
            return;
        };
        for &key in holders {
            if let (Some(w), Some(i)) = (self.workers.get(&key), slot(key)) {
                out[i] = out[i].max(self.depth_in(w, chain, now));
            }
        }
    }

    fn forget_root(&mut self, worker: WorkerKey, root: SequenceHash) {
        if let Some(holders) = self.by_root.get_mut(&root) {
            holders.remove(&worker);
            if holders.is_empty() {
                self.by_root.remove(&root);
            }
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
        if w.trie.walk(chain).next().is_none() {
            self.by_root.entry(chain[0]).or_default().insert(worker);
        }
        w.trie.insert(chain, chain.len() as u32, &[], &mut self.scratch);
        for &id in &self.scratch.path {
            *w.trie.meta_mut(id) = now;
            w.push(id);
        }
        for &id in &self.scratch.split_off {
            w.push(id);
        }
        let mut dropped = Vec::new();
        if w.trie.blocks() > self.config.max_blocks {
            let target = (self.config.max_blocks as f64 * self.config.prune_ratio) as u64;
            while w.trie.blocks() > target
                && let Some((_, root)) = w.pop_oldest()
            {
                dropped.extend(root);
            }
        }
        w.compact();
        for root in dropped {
            self.forget_root(worker, root);
        }
    }

    /// Drops every block whose TTL has passed by `now`.
    pub(crate) fn expire(&mut self, now: Timestamp) {
        let Some(ttl) = self.config.ttl else { return };
        let mut dropped = Vec::new();
        for (&key, w) in &mut self.workers {
            while w
                .order
                .peek()
                .is_some_and(|Reverse((stamp, _, _))| *stamp + ttl <= now)
            {
                if let Some((_, Some(root))) = w.pop_oldest() {
                    dropped.push((key, root));
                }
            }
            w.compact();
        }
        for (key, root) in dropped {
            self.forget_root(key, root);
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
        if let Some(w) = self.workers.remove(&worker) {
            for root in w.roots() {
                self.forget_root(worker, root);
            }
        }
    }

    /// Checks that the root index names exactly the workers holding each root run.
    #[cfg(test)]
    fn check_roots(&self) -> Result<(), String> {
        let mut expect: HashMap<SequenceHash, BTreeSet<WorkerKey>, BuildKeyHasher> = HashMap::default();
        for (&key, w) in &self.workers {
            for root in w.roots() {
                expect.entry(root).or_default().insert(key);
            }
        }
        if expect == self.by_root {
            Ok(())
        } else {
            Err(format!("root index {:?}, recomputed {expect:?}", self.by_root))
        }
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

#[cfg(test)]
mod root_index_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::ids::{DpRank, WorkerId};
    use crate::router::chain_trie::test_chain as chain;

    #[derive(Clone, Debug)]
    enum Op {
        Record(u32, u64, usize),
        Expire,
        Remove(u32),
        Advance(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..6u32, 0..4u64, 1..6usize).prop_map(|(w, f, n)| Op::Record(w, f, n)),
            1 => Just(Op::Expire),
            1 => (0..6u32).prop_map(Op::Remove),
            2 => (0..4_000u64).prop_map(Op::Advance),
        ]
    }

    /// Chains of family `f`: `f`'s first blocks then `n - 1` more, so families share no root
    /// and chains of one family share prefixes of every length.
    fn family_chain(f: u64, n: usize, variant: u64) -> Arc<[SequenceHash]> {
        let blocks: Vec<u64> = (0..n as u64)
            .map(|i| {
                if i + 1 == n as u64 && n > 2 {
                    1_000 * (f + 1) + 100 * variant + i
                } else {
                    1_000 * (f + 1) + i
                }
            })
            .collect();
        chain(&blocks)
    }

    proptest! {
        #[test]
        fn the_root_index_names_every_worker_a_chain_can_reach(
            ttl in prop::option::of(1_000..5_000u64),
            max_blocks in 2..12u64,
            ops in prop::collection::vec(op(), 1..80),
        ) {
            let mut r = RecentChains::new(RecentConfig {
                ttl: ttl.map(Duration::from_millis),
                max_blocks,
                prune_ratio: 0.5,
            });
            let key = |w: u32| WorkerKey::new(WorkerId(u64::from(w)), DpRank(0));
            let mut now = Timestamp::ZERO;
            for (step, op) in ops.iter().enumerate() {
                match *op {
                    Op::Record(w, f, n) => r.record(key(w), &family_chain(f, n, step as u64 % 3), now),
                    Op::Expire => r.expire(now),
                    Op::Remove(w) => r.remove_worker(key(w)),
                    Op::Advance(ms) => now = Timestamp(now.0 + ms * 1_000_000),
                }
                prop_assert!(r.check_roots().is_ok(), "{:?}", r.check_roots());
                for f in 0..4 {
                    for n in [1, 3, 5] {
                        let c = family_chain(f, n, 0);
                        let mut out = [0u32; 6];
                        r.raise_depths(&c, now, |k| Some(k.worker.0 as usize), &mut out);
                        let each: Vec<u32> = (0..6).map(|w| r.depth(key(w), &c, now)).collect();
                        prop_assert_eq!(out.to_vec(), each);
                    }
                }
            }
        }
    }
}
