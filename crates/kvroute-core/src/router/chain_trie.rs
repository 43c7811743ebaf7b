//! A set of block chains, path-compressed, with a value on every run of blocks.
//!
//! The router keeps two kinds of per-worker chain sets: the prompts of the requests a worker is
//! running (with reference counts) and the prompts the router recently sent to it (with
//! timestamps). Both need the same two operations fast: "how deep does this prompt's chain go
//! into the set?" on every routing decision, for every worker, and "add this chain" on every
//! booking, for one worker.
//!
//! A sequence hash names a whole prefix, so two chains share exactly a leading run of blocks,
//! and the set of chains is a tree. Nodes are runs of consecutive blocks of one chain: a node
//! covers positions `start..end` and refers to the chain that created it (shared, never copied),
//! so booking a new 2,048-block prompt adds one node. Every node is found by the hash of its
//! first block, which names the prefix up to it, so no node needs child links: a walk looks up
//! the hash at the position where the last node ended. Inside a node, the matched length is found
//! by binary search, because two chains that agree at position `i` agree before it.
//!
//! A router probes every worker's set on every decision, and a long chain is rarely in cache, so
//! a probe avoids its lines where it can: a filter of first hashes turns away most lookups before
//! the map, a node keeps its last hash (does the chain run through it?), and the search first
//! tries the caller's hint and where the set's last walk left a node.
//!
//! Nodes are split where chains diverge and where a caller asks for a boundary (a request's
//! cached prefix), and never merged. The caller keeps the invariant that a node's descendants
//! are dropped before it (reference counts and timestamps never grow going down the tree), so
//! removing a node never strands a reachable child.

use std::cell::Cell;
use std::sync::Arc;

use hashbrown::HashMap;

use crate::ids::SequenceHash;
use crate::key_hasher::BuildKeyHasher;

/// A node's index in the arena.
pub(crate) type NodeId = u32;

/// One run of blocks of a chain, and its value.
#[derive(Clone, Debug)]
pub(crate) struct Node<M> {
    /// The chain this run was cut from; positions index into it.
    chain: Arc<[SequenceHash]>,
    /// The first position covered.
    pub(crate) start: u32,
    /// One past the last position covered.
    pub(crate) end: u32,
    /// The hash at `end - 1`, kept in the node: the first probe of a walk (does the chain run
    /// through this whole node?) reads no line of the shared chain, which is rarely in cache.
    last: SequenceHash,
    /// The caller's value for this run.
    pub(crate) meta: M,
}

impl<M> Node<M> {
    /// Blocks covered.
    pub(crate) fn len(&self) -> u32 {
        self.end - self.start
    }

    /// The hash at position `pos` of the chain this run was cut from.
    pub(crate) fn hash_at(&self, pos: usize) -> SequenceHash {
        self.chain[pos]
    }

    /// The end of the run of `chain` that this node matches, starting at `self.start` (where the
    /// caller found it, so at least one block matches), capped at `chain.len()`. `hints` are
    /// likely ends (0 for none), probed first, in order: two probes instead of a binary search
    /// when one is right.
    fn matched_end(&self, chain: &[SequenceHash], hints: [u32; 2]) -> u32 {
        let cap = self.end.min(chain.len() as u32);
        let same = |pos: u32| self.chain[pos as usize] == chain[pos as usize];
        let through = if cap == self.end {
            self.last == chain[cap as usize - 1]
        } else {
            same(cap - 1)
        };
        if through {
            return cap;
        }
        // same(lo - 1) holds and same(hi - 1) does not.
        let (mut lo, mut hi) = (self.start + 1, cap);
        for hint in hints {
            if lo < hint && hint < hi {
                if same(hint - 1) {
                    lo = hint;
                    if hint + 1 < hi && !same(hint) {
                        hi = hint + 1;
                    }
                } else {
                    hi = hint;
                }
            }
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if same(mid - 1) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// One step of a walk: a node on the path and how far along it the chain matched.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step<'t, M> {
    /// The node's value.
    pub(crate) meta: &'t M,
    /// Where the match inside the node ends (at most the node's end).
    pub(crate) matched_end: u32,
}

/// The nodes an [`ChainTrie::insert`] touched: reusable scratch space.
#[derive(Clone, Debug, Default)]
pub(crate) struct Touched {
    /// The nodes covering the inserted chain, in order from the root.
    pub(crate) path: Vec<NodeId>,
    /// Nodes split off existing ones that are not on the path (they keep the value of the node
    /// they were cut from).
    pub(crate) split_off: Vec<NodeId>,
}

/// A set of chains; see the module docs.
#[derive(Clone, Debug)]
pub(crate) struct ChainTrie<M> {
    nodes: Vec<Option<Node<M>>>,
    free: Vec<NodeId>,
    by_first: HashMap<SequenceHash, NodeId, BuildKeyHasher>,
    /// Which [`FirstFilter`] buckets hold a key of `by_first`.
    first_filter: FirstFilter,
    /// Where the last walk that left the set inside a node left it: the second hint of every
    /// walk. A router's prompts mostly leave a worker's active set where a shared system prompt
    /// ends, whatever the worker caches (the caller's hint), so this spares a binary search whose
    /// probes miss the cache. A speed hint only: every answer is exact whatever it holds. A
    /// `Cell`: walks take `&self`.
    left_at: Cell<u32>,
    blocks: u64,
}

impl<M> Default for ChainTrie<M> {
    fn default() -> Self {
        Self {
            nodes: Vec::new(),
            free: Vec::new(),
            by_first: HashMap::default(),
            first_filter: FirstFilter::default(),
            left_at: Cell::default(),
            blocks: 0,
        }
    }
}

/// Buckets of a filter over the keys of `by_first`.
const FILTER_BUCKETS: usize = 256;

/// An exact count of the keys of a trie's `by_first` map per bucket of their hash, and a bit per
/// bucket that is set while its count is not zero. A walk tests the bit before probing the map:
/// a router probes every worker's active set on every decision, and most sets do not hold the
/// prompt's first block (or the block after a match), so most probes end on this bit, in the
/// worker's own struct, without reading the map's lines.
#[derive(Clone, Debug, Default)]
struct FirstFilter {
    bits: [u64; FILTER_BUCKETS / 64],
    /// Keys per bucket; empty until the first key.
    counts: Vec<u32>,
}

impl FirstFilter {
    #[inline]
    fn bucket(hash: SequenceHash) -> usize {
        // The top byte of a multiplicative mix: every bit of the hash moves it, so chains whose
        // hashes are small numbers (as in tests) spread too.
        (hash.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize
    }

    /// Whether `by_first` may hold `hash`; false means it does not.
    #[inline]
    fn may_hold(&self, hash: SequenceHash) -> bool {
        let b = Self::bucket(hash);
        self.bits[b / 64] & (1 << (b % 64)) != 0
    }

    /// A key `hash` was added to `by_first`.
    fn add(&mut self, hash: SequenceHash) {
        if self.counts.is_empty() {
            self.counts = vec![0; FILTER_BUCKETS];
        }
        let b = Self::bucket(hash);
        self.counts[b] += 1;
        self.bits[b / 64] |= 1 << (b % 64);
    }

    /// A key `hash` was removed from `by_first`.
    fn remove(&mut self, hash: SequenceHash) {
        let b = Self::bucket(hash);
        self.counts[b] -= 1;
        if self.counts[b] == 0 {
            self.bits[b / 64] &= !(1 << (b % 64));
        }
    }
}

impl<M: Clone + Default> ChainTrie<M> {
    /// Blocks covered by the set (each shared block once).
    pub(crate) fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Asks for the cache line of [`ChainTrie::blocks`]; changes nothing.
    pub(crate) fn prefetch_blocks(&self) {
        kvroute_prefetch::prefetch_read(&self.blocks);
    }

    /// Whether the set is empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.by_first.is_empty()
    }

    /// Live nodes.
    pub(crate) fn node_count(&self) -> usize {
        self.by_first.len()
    }

    /// The node `id`, which must be live.
    pub(crate) fn node(&self, id: NodeId) -> &Node<M> {
        self.nodes[id as usize]
            .as_ref()
            .unwrap_or_else(|| unreachable!("node {id} is free"))
    }

    /// The node `id`, if it is live.
    pub(crate) fn get(&self, id: NodeId) -> Option<&Node<M>> {
        self.nodes.get(id as usize)?.as_ref()
    }

    /// The value of node `id`, which must be live.
    pub(crate) fn meta_mut(&mut self, id: NodeId) -> &mut M {
        &mut self.nodes[id as usize]
            .as_mut()
            .unwrap_or_else(|| unreachable!("node {id} is free"))
            .meta
    }

    /// Live nodes, in arena order.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node<M>)> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| n.as_ref().map(|n| (id as NodeId, n)))
    }

    /// The walk of `chain` through the set: the nodes its path crosses, from the root, until it
    /// leaves the set or ends.
    pub(crate) fn walk<'t, 'c>(&'t self, chain: &'c [SequenceHash]) -> Walk<'t, 'c, M> {
        self.walk_hinted(chain, 0)
    }

    /// [`ChainTrie::walk`], where the caller guesses that the chain leaves the set at `hint`.
    pub(crate) fn walk_hinted<'t, 'c>(&'t self, chain: &'c [SequenceHash], hint: u32) -> Walk<'t, 'c, M> {
        Walk {
            trie: self,
            chain,
            hint,
            pos: 0,
            done: false,
        }
    }

    /// The node whose run starts at `pos` of `chain`, if the set holds `chain` up to there.
    fn node_at(&self, chain: &[SequenceHash], pos: u32) -> Option<NodeId> {
        let first = chain.get(pos as usize)?;
        if !self.first_filter.may_hold(*first) {
            return None;
        }
        let id = *self.by_first.get(first)?;
        // A different start would mean two prefixes with one hash: treat as absent.
        (self.node(id).start == pos).then_some(id)
    }

    /// Makes the set cover `chain[..len]`, with node boundaries at `len` and at every position
    /// of `cuts` below `len`. Runs that are new get `M::default()`; runs split off an existing
    /// node copy its value. Reports the nodes it touched in `touched` (cleared first).
    pub(crate) fn insert(
        &mut self,
        chain: &Arc<[SequenceHash]>,
        len: u32,
        cuts: &[u32],
        touched: &mut Touched,
    ) {
        touched.path.clear();
        touched.split_off.clear();
        let len = len.min(chain.len() as u32);
        let mut pos = 0;
        while pos < len {
            let Some(id) = self.node_at(&chain[..len as usize], pos) else {
                self.append(chain, pos, len, cuts, &mut touched.path);
                return;
            };
            let node = self.node(id);
            let matched = node.matched_end(&chain[..len as usize], [0, 0]);
            let split = cuts
                .iter()
                .copied()
                .filter(|&c| pos < c && c < matched)
                .chain((matched < node.end).then_some(matched))
                .min();
            if let Some(at) = split {
                let tail = self.split(id, at);
                if at == matched {
                    touched.split_off.push(tail);
                }
            }
            touched.path.push(id);
            pos = self.node(id).end;
        }
    }

    /// Adds new nodes for `chain[pos..len]`, cut at `cuts`, and pushes their ids to `path`.
    fn append(
        &mut self,
        chain: &Arc<[SequenceHash]>,
        pos: u32,
        len: u32,
        cuts: &[u32],
        path: &mut Vec<NodeId>,
    ) {
        let mut start = pos;
        while start < len {
            let end = cuts
                .iter()
                .copied()
                .filter(|&c| start < c && c < len)
                .min()
                .unwrap_or(len);
            let id = self.alloc(Node {
                chain: Arc::clone(chain),
                start,
                end,
                last: chain[end as usize - 1],
                meta: M::default(),
            });
            path.push(id);
            self.blocks += u64::from(end - start);
            start = end;
        }
    }

    /// Cuts node `id` at `at` (strictly inside it): it keeps `start..at`, a new node with a copy
    /// of its value takes `at..end`.
    fn split(&mut self, id: NodeId, at: u32) -> NodeId {
        let node = self.node(id);
        debug_assert!(node.start < at && at < node.end);
        let tail = Node {
            chain: Arc::clone(&node.chain),
            start: at,
            end: node.end,
            last: node.last,
            meta: node.meta.clone(),
        };
        if let Some(n) = self.nodes[id as usize].as_mut() {
            n.end = at;
            n.last = n.chain[at as usize - 1];
        }
        self.alloc(tail)
    }

    fn alloc(&mut self, node: Node<M>) -> NodeId {
        let first = node.chain[node.start as usize];
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id as usize] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as NodeId
            }
        };
        if self.by_first.insert(first, id).is_none() {
            self.first_filter.add(first);
        }
        id
    }

    /// The ids of the nodes covering `chain[..len]`, in order, into `path` (cleared first); stops
    /// where the set stops covering the chain.
    ///
    /// `hint` is a likely path, such as the one [`ChainTrie::insert`] reported for the chain:
    /// a hinted node that starts where the path is and ends on the chain is taken as it stands,
    /// without a lookup of its first hash (two cache misses on a large set). A node split since
    /// keeps its id and start and loses its tail to a new node, which is looked up. Any hint
    /// gives the same path; a stale one only costs lookups.
    pub(crate) fn path(&self, chain: &[SequenceHash], len: u32, hint: &[NodeId], path: &mut Vec<NodeId>) {
        path.clear();
        let chain = &chain[..(len as usize).min(chain.len())];
        let len = chain.len() as u32;
        let mut hint = hint.iter().copied().peekable();
        let mut pos = 0;
        while pos < len {
            while hint
                .next_if(|&id| self.get(id).is_none_or(|n| n.start < pos))
                .is_some()
            {}
            let hinted = hint.peek().and_then(|&id| {
                let n = self.get(id)?;
                (n.start == pos && n.end <= len && n.last == chain[n.end as usize - 1]).then_some((id, n))
            });
            let (id, end) = match hinted {
                Some((id, n)) => {
                    hint.next();
                    (id, n.end)
                }
                None => {
                    let Some(id) = self.node_at(chain, pos) else {
                        break;
                    };
                    let n = self.node(id);
                    if n.matched_end(chain, [0, 0]) < n.end {
                        break;
                    }
                    (id, n.end)
                }
            };
            path.push(id);
            pos = end;
        }
    }

    /// Drops node `id` (the caller has dropped its descendants).
    pub(crate) fn remove(&mut self, id: NodeId) {
        if let Some(node) = self.nodes[id as usize].take() {
            let first = node.chain[node.start as usize];
            if self.by_first.remove(&first).is_some() {
                self.first_filter.remove(first);
            }
            self.blocks -= u64::from(node.len());
            self.free.push(id);
        }
    }
}

/// The walk of a chain through a [`ChainTrie`]; see [`ChainTrie::walk`].
pub(crate) struct Walk<'t, 'c, M> {
    trie: &'t ChainTrie<M>,
    chain: &'c [SequenceHash],
    hint: u32,
    pos: u32,
    done: bool,
}

impl<'t, M: Clone + Default> Iterator for Walk<'t, '_, M> {
    type Item = Step<'t, M>;

    fn next(&mut self) -> Option<Step<'t, M>> {
        if self.done {
            return None;
        }
        let Some(id) = self.trie.node_at(self.chain, self.pos) else {
            self.done = true;
            return None;
        };
        let node = self.trie.node(id);
        let left_at = &self.trie.left_at;
        let matched_end = node.matched_end(self.chain, [self.hint, left_at.get()]);
        let step = Step {
            meta: &node.meta,
            matched_end,
        };
        self.done = matched_end < node.end;
        if self.done && left_at.get() != matched_end {
            left_at.set(matched_end);
        }
        self.pos = matched_end;
        Some(step)
    }
}

/// A chain for tests: hashes that name prefixes (each folds in everything before it).
#[cfg(test)]
pub(crate) fn test_chain(blocks: &[u64]) -> Arc<[SequenceHash]> {
    let mut acc = 0u64;
    blocks
        .iter()
        .map(|&b| {
            acc = acc.wrapping_mul(1_000_003).wrapping_add(b + 1);
            SequenceHash(acc)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::test_chain as chain;
    use super::*;
    use proptest::prelude::*;

    impl<M: Clone + Default> ChainTrie<M> {
        /// Every node's kept last hash is its chain's, and the filter counts exactly the keys of
        /// `by_first`, per bucket, with its bits set where a count is not zero.
        fn check_filter_and_lasts(&self) {
            for (id, n) in self.nodes() {
                assert_eq!(n.last, n.chain[n.end as usize - 1], "node {id}'s last hash");
            }
            let mut counts = vec![0u32; FILTER_BUCKETS];
            for key in self.by_first.keys() {
                counts[FirstFilter::bucket(*key)] += 1;
                assert!(self.first_filter.may_hold(*key));
            }
            if self.first_filter.counts.is_empty() {
                assert!(self.by_first.is_empty());
                return;
            }
            assert_eq!(counts, self.first_filter.counts);
            for (b, &c) in counts.iter().enumerate() {
                assert_eq!(self.first_filter.bits[b / 64] & (1 << (b % 64)) != 0, c > 0);
            }
        }
    }

    fn depth<M: Clone + Default>(t: &ChainTrie<M>, c: &[SequenceHash]) -> u32 {
        t.walk(c).last().map_or(0, |s| s.matched_end)
    }

    #[test]
    fn shared_prefixes_count_once_and_split_where_chains_diverge() {
        let mut t: ChainTrie<u32> = ChainTrie::default();
        let mut touched = Touched::default();
        let a = chain(&[1, 2, 3, 4, 5, 6]);
        let b = chain(&[1, 2, 3, 9, 9]);
        t.insert(&a, 6, &[2], &mut touched);
        assert_eq!(touched.path.len(), 2);
        assert_eq!(t.blocks(), 6);
        t.insert(&b, 5, &[], &mut touched);
        let path = touched.path.clone();
        assert_eq!(touched.split_off.len(), 1);
        // a's second node 2..6 split at 3; b adds 3..5.
        assert_eq!(t.blocks(), 8);
        assert_eq!(
            path.iter()
                .map(|&id| (t.node(id).start, t.node(id).end))
                .collect::<Vec<_>>(),
            [(0, 2), (2, 3), (3, 5)]
        );
        assert_eq!(depth(&t, &a), 6);
        assert_eq!(depth(&t, &chain(&[1, 2, 3, 4, 7])), 4);
        assert_eq!(depth(&t, &chain(&[8])), 0);
        let mut p = Vec::new();
        t.path(&a, 4, &[], &mut p);
        assert_eq!(p.len(), 2, "only nodes wholly inside the first four blocks");
        t.remove(path[2]);
        assert_eq!(t.blocks(), 6);
        assert_eq!(depth(&t, &b), 3);
    }

    #[test]
    fn binary_search_finds_every_divergence_point() {
        let base: Vec<u64> = (0..100).collect();
        let mut t: ChainTrie<()> = ChainTrie::default();
        t.insert(&chain(&base), 100, &[], &mut Touched::default());
        for k in 0..100 {
            let mut other = base.clone();
            other[k] = 1000;
            let other = chain(&other);
            assert_eq!(depth(&t, &other), k as u32);
            for hint in [0, 1, k as u32, k as u32 + 1, 50, 99, 100, 200] {
                assert_eq!(
                    t.walk_hinted(&other, hint).last().map(|s| s.matched_end),
                    Some(k as u32).filter(|&k| k > 0)
                );
            }
            assert_eq!(depth(&t, &chain(&base[..k + 1])), k as u32 + 1);
        }
    }

    /// A chain from a small alphabet, so chains share prefixes and diverge at many places.
    fn blocks() -> impl Strategy<Value = Vec<u64>> {
        prop::collection::vec(0u64..3, 1..40)
    }

    proptest! {
        /// Chains booked and freed with reference counts, as the active sets do: after every
        /// step, each query's walk ends where the longest common prefix with a held chain ends
        /// (whatever the hint), and the kept last hashes and the first-hash filter are exact.
        #[test]
        fn walks_match_the_longest_common_prefix(
            ops in prop::collection::vec((blocks(), 0u32..45, any::<bool>()), 1..40),
            queries in prop::collection::vec((blocks(), 0u32..45), 1..8),
        ) {
            let mut t: ChainTrie<u32> = ChainTrie::default();
            let mut touched = Touched::default();
            let mut held: Vec<(Arc<[SequenceHash]>, u32, Vec<NodeId>)> = Vec::new();
            let mut path = Vec::new();
            for (b, cut, free) in ops {
                if free && !held.is_empty() {
                    let (c, len, hint) = held.remove(cut as usize % held.len());
                    t.path(&c, len, &hint, &mut path);
                    let mut unhinted = Vec::new();
                    t.path(&c, len, &[], &mut unhinted);
                    prop_assert_eq!(&path, &unhinted, "a hint changes no path");
                    prop_assert_eq!(path.last().map(|&id| t.node(id).end), Some(len));
                    for &id in &path {
                        let refs = t.meta_mut(id);
                        *refs -= 1;
                        if *refs == 0 {
                            t.remove(id);
                        }
                    }
                } else {
                    let c = chain(&b);
                    let len = c.len() as u32;
                    t.insert(&c, len, &[cut], &mut touched);
                    for &id in &touched.path {
                        *t.meta_mut(id) += 1;
                    }
                    // The insert's path, or a stale one (another chain's), as the hint.
                    let hint = if free { path.clone() } else { touched.path.clone() };
                    held.push((c, len, hint));
                }
                t.check_filter_and_lasts();
                for (q, hint) in &queries {
                    let q = chain(q);
                    let expect = held
                        .iter()
                        .map(|(c, len, _)| {
                            c[..*len as usize].iter().zip(q.iter()).take_while(|(a, b)| a == b).count() as u32
                        })
                        .max()
                        .unwrap_or(0);
                    let got = t.walk_hinted(&q, *hint).last().map_or(0, |s| s.matched_end);
                    prop_assert_eq!(got, expect);
                }
            }
        }
    }
}
