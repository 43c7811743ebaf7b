//! The prefix index: which KV blocks each worker holds, and how deep a prompt's prefix matches.
//!
//! # Semantics
//!
//! These are the semantics of the kv-opstream format (`shared/bench/OPSTREAM.md`), which are
//! also what an engine's hash-based prefix cache does:
//!
//! * **Holding.** A worker holds a block from the store that names it until a removal that names
//!   it, or a clear of the worker. A removal drops exactly the blocks it names, never their
//!   descendants.
//! * **Depth.** For a query of local hashes `q[0..n)`, a worker's depth is the number of
//!   consecutive blocks from block 0 whose prefix it holds.
//! * **Holes and heals.** When a block in the middle of a chain is removed, lookups for that worker
//!   stop at the hole, but the blocks after it stay held. Storing the missing block again (under
//!   its parent) makes the whole chain reachable again.
//!
//! # Layouts
//!
//! Two layouts give the same answers (`tests/index_model.rs` checks both against one reference):
//! [`RunIndex`] (`runs`), the router's index, keeps a record a run of blocks with one holder set;
//! [`PrefixIndex`], described below, a node a block. They share the worker table, the holder
//! sets, the counters, the cap and the slower tiers (`api`, `slots`, `wide`, `tier`).
//!
//! # Shape
//!
//! One tree of prefixes is shared by all workers. A node stands for one prefix of local hashes:
//! it is identified by its parent node and its own local hash, and it carries the set of workers
//! that hold it over dense worker slots: a bit mask while there are at most 64 slots; past that
//! up to three slots inline, or a row of a shared table of full masks for a node held by more
//! (`wide`), so a node that one worker holds costs no mask over the whole fleet. Nodes live in
//! an arena and refer to each other by `u32` ids; there is no per-node allocation, reference
//! count or lock.
//!
//! * A node's first child is linked from the node itself (its "hint"); further children go in
//!   one hash table keyed by `(parent, local)` that stores only node ids. Chains, the common
//!   case, so never touch the table: a lookup along a chain is one array read per block.
//! * Each worker maps the engine's external hashes to nodes, so removals and the parents of
//!   stores are resolved in one probe. External hashes are opaque: two workers may name the same
//!   prefix differently.
//! * A node that no worker holds and that has no children is freed at once, so memory follows
//!   what is held, not what was ever stored.
//! * The blocks a store adds below the tree are laid out in consecutive nodes where the free
//!   ids allow (`free_runs`), and a child lookup tries node `n + 1` first: a walk along a chain
//!   then reads consecutive nodes whose addresses it knows ahead, instead of waiting on each
//!   node's hint before it can load the next.
//!
//! # Errors
//!
//! Bad input never panics; it returns an [`IndexError`] and is counted in [`IndexStats`]. A
//! store applies its blocks in order and stops at the first bad one; the error says how many
//! were applied.
//!
//! # Bound
//!
//! With [`IndexConfig::max_blocks_per_worker`], a worker never holds more blocks than that: a
//! store that takes it past the cap evicts its oldest blocks (in the order they were first
//! stored, as if the engine had removed them) and counts them in
//! [`IndexStats::blocks_evicted`]. An engine's own removals keep its view within its cache, so
//! the cap only bites when removals were lost or an engine misbehaves; it bounds memory.
//! The order is one queue of external hashes per worker, compacted when it holds twice as many
//! entries as the worker holds blocks.

#[macro_use]
mod api;
mod event;
mod ext_map;
mod free_runs;
mod layout;
mod runs;
mod scores;
mod slots;
mod tier;
mod walk;
mod wide;

use std::num::NonZeroUsize;

use hashbrown::HashTable;

use crate::ids::{ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerKey};
use crate::key_hasher::mix;
use free_runs::{FreeRuns, Source};
use slots::{Slots, WorkerSlot};
use tier::Tiers;
use wide::Rows;

pub use event::{IndexEvent, Tier, stored_blocks};
pub use ext_map::ExtMap;
pub use layout::IndexLayout;
pub use runs::RunIndex;
pub use scores::OverlapScores;

/// A node id in the arena.
type NodeId = u32;

const NONE: NodeId = u32::MAX;
const ROOT: NodeId = 0;

/// How many blocks ahead of itself a store's map updates prefetch the blocks' home lines
/// (measured: BENCHMARKS.md, "Index: prefetch distance").
const STORE_AHEAD: usize = 16;

/// `STORE_AHEAD` for removals: a removal's work per block is smaller, so it reaches further to
/// cover a miss to memory.
const REMOVE_AHEAD: usize = 32;

/// Why a stored block on a place the tree already has was refused.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    /// The worker's map has the block's external hash on another block.
    Conflicting,
    /// The worker holds the place, under another external hash.
    Duplicate,
}

impl Refusal {
    fn error(self, worker: WorkerKey, external: ExternalBlockHash, applied: usize) -> IndexError {
        match self {
            Refusal::Conflicting => IndexError::ConflictingBlock {
                worker,
                external,
                applied,
            },
            Refusal::Duplicate => IndexError::DuplicatePrefix {
                worker,
                external,
                applied,
            },
        }
    }
}

/// Records in a worker's `map` that it holds `block` (a node or block id, either layout's) under
/// `external`; `held` says whether the tree counts the worker on `block` already. `Ok(true)`:
/// the map took it (the caller sets the worker's bit); `Ok(false)`: the map had it.
#[inline(always)]
fn hold_block(map: &mut ExtMap, external: u64, block: NodeId, held: bool) -> Result<bool, Refusal> {
    if held {
        match map.get(external) {
            Some(b) if b == block => Ok(false),
            Some(_) => Err(Refusal::Conflicting),
            None => Err(Refusal::Duplicate),
        }
    } else {
        match map.insert_new(external, block) {
            Ok(()) => Ok(true),
            Err(b) if b == block => Ok(false),
            Err(_) => Err(Refusal::Conflicting),
        }
    }
}

/// One block a worker now holds: its content hash and the engine's id for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredBlock {
    /// The hash of the block's tokens.
    pub local: LocalBlockHash,
    /// The engine's id of the block at its place in the chain.
    pub external: ExternalBlockHash,
}

/// How to build a [`PrefixIndex`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexConfig {
    /// Blocks to reserve room for up front (a hint; the index grows as needed).
    pub expected_blocks: usize,
    /// Blocks each worker's map of external hashes is sized for when the worker is added (a
    /// hint, such as the engine's cache size in blocks; zero: maps grow from empty). A map sized
    /// ahead never rehashes on the way to that many blocks.
    pub expected_blocks_per_worker: usize,
    /// The most blocks one worker may hold; `None`: unbounded. See the module docs ("Bound").
    pub max_blocks_per_worker: Option<NonZeroUsize>,
}

/// Why an operation on the index was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IndexError {
    /// The worker was never added, or was removed.
    #[error("unknown worker {0}")]
    UnknownWorker(WorkerKey),
    /// A store named a parent block the worker does not hold.
    #[error("worker {worker} stored blocks under parent {parent:?}, which it does not hold")]
    UnknownParent {
        /// The worker.
        worker: WorkerKey,
        /// The parent's external hash.
        parent: ExternalBlockHash,
    },
    /// A store named a block the worker already holds at a different place in the tree.
    #[error(
        "worker {worker} stored block {external:?} at a place other than where it already holds it \
         ({applied} earlier blocks of the store were applied)"
    )]
    ConflictingBlock {
        /// The worker.
        worker: WorkerKey,
        /// The block's external hash.
        external: ExternalBlockHash,
        /// Blocks of the same store that were applied before it.
        applied: usize,
    },
    /// A store named, under a new external hash, a prefix the worker already holds under
    /// another one.
    #[error(
        "worker {worker} stored block {external:?} for a prefix it already holds under another \
         external hash ({applied} earlier blocks of the store were applied)"
    )]
    DuplicatePrefix {
        /// The worker.
        worker: WorkerKey,
        /// The block's new external hash.
        external: ExternalBlockHash,
        /// Blocks of the same store that were applied before it.
        applied: usize,
    },
    /// A slower tier's store named blocks the worker does not hold on the GPU, so the index
    /// cannot tell which prefix they are (the tier's events carry no tokens and no parent).
    #[error(
        "worker {worker} stored {unplaced} block(s) on {tier:?} that it does not hold on the GPU, first {external:?}"
    )]
    UnplacedTierBlock {
        /// The worker.
        worker: WorkerKey,
        /// The tier.
        tier: Tier,
        /// The first such block.
        external: ExternalBlockHash,
        /// How many of the store's blocks were left out; the others were applied.
        unplaced: usize,
    },
}

/// Counters of what the index has been asked to do. They only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Blocks newly held by a store (blocks stored again at the same place are not counted).
    pub blocks_stored: u64,
    /// Blocks dropped by removals.
    pub blocks_removed: u64,
    /// Removals of blocks the worker did not hold (allowed, and ignored).
    pub removed_not_held: u64,
    /// Workers cleared.
    pub clears: u64,
    /// Operations refused with [`IndexError::UnknownWorker`].
    pub unknown_worker: u64,
    /// Stores refused with [`IndexError::UnknownParent`].
    pub unknown_parent: u64,
    /// Stores cut short with [`IndexError::ConflictingBlock`].
    pub conflicting_block: u64,
    /// Stores cut short with [`IndexError::DuplicatePrefix`].
    pub duplicate_prefix: u64,
    /// Blocks dropped to keep a worker within [`IndexConfig::max_blocks_per_worker`].
    pub blocks_evicted: u64,
    /// Blocks newly held on a slower tier.
    pub tier_blocks_stored: u64,
    /// Blocks dropped from a slower tier.
    pub tier_blocks_removed: u64,
    /// Slower-tier blocks left out with [`IndexError::UnplacedTierBlock`].
    pub tier_unplaced: u64,
}

/// How much memory the index uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexFootprint {
    /// (worker, block) pairs held.
    pub entries: u64,
    /// Tree nodes alive (distinct prefixes held by at least one worker, plus their ancestors).
    pub nodes: u64,
    /// Heap bytes owned by the index's tables, by their allocated capacity.
    pub heap_bytes: u64,
}

impl IndexFootprint {
    /// Heap bytes per (worker, block) entry; zero when empty.
    pub fn bytes_per_entry(&self) -> f64 {
        if self.entries == 0 {
            0.0
        } else {
            self.heap_bytes as f64 / self.entries as f64
        }
    }
}

/// One prefix in the tree.
#[derive(Clone, Copy, Debug)]
struct Node {
    /// The local hash of this node's last block.
    local: u64,
    /// The workers that hold this prefix: their bit mask while the fleet has at most 64 worker
    /// slots, a set code (see `wide`) once it has more. `0`: nobody, either way.
    mask0: u64,
    /// The parent node; `NONE` for the root and for free nodes.
    parent: NodeId,
    /// A child reached without the children table, or `NONE`. Every other child is in the table.
    hint: NodeId,
    /// The low 32 bits of the hint child's local hash (meaningless without a hint): a lookup for
    /// another child skips reading the hint node, one dependent cache miss fewer at a branch.
    hint_tag: u32,
    /// Number of children.
    children: u32,
}

impl Node {
    const FREE: Node = Node {
        local: 0,
        mask0: 0,
        parent: NONE,
        hint: NONE,
        hint_tag: 0,
        children: 0,
    };
}

/// Which KV blocks each worker holds, for prefix-match lookups. See the module docs.
#[derive(Debug)]
pub struct PrefixIndex {
    nodes: Vec<Node>,
    /// Free node ids, as runs of consecutive ids (see `free_runs`).
    free: FreeRuns,
    /// Children of every node, keyed by `(parent, local)`; holds node ids only.
    children: HashTable<NodeId>,
    /// The worker sets of a fleet of more than 64 slots (see `wide`); empty before.
    rows: Rows,
    slots: Slots,
    stats: IndexStats,
    /// Reused buffer of node ids for batched updates.
    scratch: Vec<NodeId>,
    /// [`IndexConfig::max_blocks_per_worker`].
    cap: Option<NonZeroUsize>,
    /// [`IndexConfig::expected_blocks_per_worker`].
    per_worker: usize,
    /// The slower tiers' blocks (see `tier`).
    tiers: Tiers,
}

#[inline]
fn child_hash(parent: NodeId, local: u64) -> u64 {
    mix(local, u64::from(parent))
}

impl PrefixIndex {
    /// An empty index with no workers.
    pub fn new(config: IndexConfig) -> Self {
        let mut nodes = Vec::with_capacity(config.expected_blocks + 1);
        nodes.push(Node::FREE);
        Self {
            nodes,
            free: FreeRuns::default(),
            children: HashTable::with_capacity(config.expected_blocks),
            rows: Rows::default(),
            slots: Slots::default(),
            stats: IndexStats::default(),
            scratch: Vec::new(),
            cap: config.max_blocks_per_worker,
            per_worker: config.expected_blocks_per_worker,
            tiers: Tiers::default(),
        }
    }

    /// Starts tracking `worker`'s cache, empty. Adding a worker that is already tracked does nothing.
    pub fn add_worker(&mut self, worker: WorkerKey) {
        if let Some(slot) = self.slots.add(worker, self.per_worker) {
            let sets = self.nodes.iter_mut().map(|n| &mut n.mask0);
            self.rows.ensure_slot(slot, sets);
        }
    }

    /// Stops tracking `worker` and forgets every block it held.
    pub fn remove_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
        self.clear_worker(worker)?;
        self.slots.remove(worker);
        Ok(())
    }

    shared_index_api!();

    /// How many workers hold `node`.
    fn holder_count(&self, node: NodeId) -> usize {
        self.rows.set_len(self.nodes[node as usize].mask0)
    }

    /// Entries, nodes and heap bytes.
    pub fn footprint(&self) -> IndexFootprint {
        let entries = self.slots.entries();
        let heap = self.nodes.capacity() * size_of::<Node>()
            + self.free.allocation_size()
            + self.children.allocation_size()
            + self.rows.allocation_size()
            + self.slots.allocation_size();
        IndexFootprint {
            entries: entries as u64,
            nodes: (self.nodes.len() - 1 - self.free.len()) as u64,
            heap_bytes: heap as u64,
        }
    }

    /// Applies a stored chain: `worker` now holds `blocks`, which continue the chain from the
    /// block the engine calls `parent`, or from the root when `parent` is `None`.
    ///
    /// Blocks already held at the same place stay held. On error, the blocks before the bad one
    /// have been applied (the error says how many).
    pub fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let slot = self.slot_index(worker)?;
        // Start loading the home lines of the first blocks: the map updates (`hold_path`) keep
        // prefetching `STORE_AHEAD` blocks ahead of themselves, so each block's miss overlaps
        // with the work on the blocks before it, and the tree walk runs meanwhile.
        let map = &self.slots.taken(slot).blocks;
        for block in blocks.iter().take(STORE_AHEAD) {
            map.prefetch(block.external.0);
        }
        let parent_node = match parent {
            None => ROOT,
            Some(parent) => match map.get(parent.0) {
                Some(node) => node,
                None => {
                    self.stats.unknown_parent += 1;
                    return Err(IndexError::UnknownParent { worker, parent });
                }
            },
        };
        let mut path = std::mem::take(&mut self.scratch);
        path.clear();
        let mut at = parent_node;
        // The blocks whose prefixes are in the tree already, then the new ones: a node just
        // created has no children, so every block after the first new one is new too.
        let mut known = 0;
        for block in blocks {
            if self.nodes[at as usize].children == 0 {
                break;
            }
            let Some(next) = self.child(at, block.local.0) else {
                break;
            };
            at = next;
            path.push(at);
            known += 1;
        }
        self.new_chain(at, &blocks[known..], &mut path);
        // The blocks on new nodes are new to the worker (unless a store is refused): make room
        // for them in its map at once, rather than growing it step by step on the way.
        self.slots.taken_mut(slot).blocks.reserve(blocks.len() - known);
        // One copy of the loop per kind of index, so no block branches on which.
        let result = match (self.rows.wide(), self.cap.is_some()) {
            (false, false) => self.hold_path::<false, false>(worker, slot, blocks, &path),
            (false, true) => self.hold_path::<false, true>(worker, slot, blocks, &path),
            (true, false) => self.hold_path::<true, false>(worker, slot, blocks, &path),
            (true, true) => self.hold_path::<true, true>(worker, slot, blocks, &path),
        };
        if result.is_err()
            && let Some(&deepest) = path.last()
        {
            // Nodes created for the blocks that were not applied are held by nobody: free them.
            self.collect(deepest);
        }
        self.scratch = path;
        if let Some(cap) = self.cap {
            self.enforce_cap(slot, cap.get());
        }
        result
    }

    /// Evicts `slot`'s oldest blocks until it holds at most `cap`, and compacts its order.
    fn enforce_cap(&mut self, slot: usize, cap: usize) {
        let mut dropped = std::mem::take(&mut self.scratch);
        dropped.clear();
        self.stats.blocks_evicted += self.slots.evict_over_cap(slot, cap, &mut dropped);
        if self.rows.wide() {
            self.release::<true>(&dropped, slot);
        } else {
            self.release::<false>(&dropped, slot);
        }
        self.scratch = dropped;
    }

    /// Marks `worker` (in `slot`) as holding `blocks`, whose tree nodes are `path`. `WIDE` and
    /// `CAPPED` must be the index's `rows.wide()` and `cap.is_some()`.
    fn hold_path<const WIDE: bool, const CAPPED: bool>(
        &mut self,
        worker: WorkerKey,
        slot: usize,
        blocks: &[StoredBlock],
        path: &[NodeId],
    ) -> Result<(), IndexError> {
        let Self {
            nodes,
            rows,
            slots,
            stats,
            ..
        } = self;
        let (wide, capped) = (WIDE, CAPPED);
        let bit = 1u64 << (slot % 64);
        let WorkerSlot {
            blocks: map, order, ..
        } = slots.taken_mut(slot);
        // Counted once at the end (or at an error): a counter in `self` updated per block is a
        // load and a store the compiler may not keep in a register across the map's writes.
        let mut stored = 0u64;
        for (applied, (block, &node)) in blocks.iter().zip(path).enumerate() {
            if let Some(ahead) = blocks.get(applied + STORE_AHEAD) {
                map.prefetch(ahead.external.0);
            }
            let set = &mut nodes[node as usize].mask0;
            let held = if wide {
                rows.contains(*set, slot)
            } else {
                *set & bit != 0
            };
            match hold_block(map, block.external.0, node, held) {
                Ok(false) => {}
                Ok(true) => {
                    if wide {
                        rows.insert(set, slot);
                    } else {
                        *set |= bit;
                    }
                    stored += 1;
                    if capped {
                        order.push_back(block.external.0);
                    }
                }
                Err(refusal) => {
                    stats.blocks_stored += stored;
                    match refusal {
                        Refusal::Conflicting => stats.conflicting_block += 1,
                        Refusal::Duplicate => stats.duplicate_prefix += 1,
                    }
                    return Err(refusal.error(worker, block.external, applied));
                }
            }
        }
        stats.blocks_stored += stored;
        Ok(())
    }

    /// `worker` copied `externals`, blocks it holds on the GPU, to `tier`: each is placed at
    /// its GPU node's prefix. Blocks it does not hold on the GPU are left out (the others
    /// applied) and reported with [`IndexError::UnplacedTierBlock`].
    pub fn apply_tier_stored(
        &mut self,
        worker: WorkerKey,
        tier: Tier,
        externals: &[ExternalBlockHash],
    ) -> Result<(), IndexError> {
        let slot = self.slot_index(worker)?;
        let mut path = std::mem::take(&mut self.scratch);
        let Self {
            nodes,
            slots,
            stats,
            tiers,
            ..
        } = self;
        let result = tiers.store_placed(
            stats,
            &slots.taken(slot).blocks,
            worker,
            tier,
            externals,
            |n| Some(nodes[n as usize].parent).filter(|&p| p != ROOT && p != NONE),
            |n| nodes[n as usize].local,
            &mut path,
        );
        self.scratch = path;
        result
    }

    /// Applies removed blocks: `worker` no longer holds the blocks the engine calls `externals`.
    /// Blocks it does not hold are ignored (and counted). Returns how many blocks were dropped.
    pub fn apply_removed(
        &mut self,
        worker: WorkerKey,
        externals: &[ExternalBlockHash],
    ) -> Result<usize, IndexError> {
        let slot = self.slot_index(worker)?;
        // Two passes, so the map updates of the first (each prefetching a line `REMOVE_AHEAD`
        // blocks ahead) overlap their cache misses instead of waiting behind each block's tree
        // update.
        let mut dropped = std::mem::take(&mut self.scratch);
        dropped.clear();
        let Self { nodes, slots, .. } = self;
        let blocks = &mut slots.taken_mut(slot).blocks;
        for e in externals.iter().take(REMOVE_AHEAD) {
            blocks.prefetch(e.0);
        }
        for (i, e) in externals.iter().enumerate() {
            if let Some(ahead) = externals.get(i + REMOVE_AHEAD) {
                blocks.prefetch(ahead.0);
            }
            if let Some(node) = blocks.remove(e.0) {
                // The second pass reads the node: start loading it now.
                if let Some(n) = nodes.get(node as usize) {
                    kvroute_prefetch::prefetch_read(n);
                }
                dropped.push(node);
            }
        }
        if self.rows.wide() {
            // A wide fleet's set updates branch on what a node holds, which keeps the cache
            // misses of one node after another from overlapping: read every node and its parent
            // (which `collect` reads when the node goes) first, in a pass without branches.
            let nodes = &self.nodes;
            let ahead = dropped.iter().fold(0u64, |acc, &n| {
                let parent = nodes[n as usize].parent;
                acc ^ nodes.get(parent as usize).map_or(0, |p| p.mask0)
            });
            std::hint::black_box(ahead);
            self.release::<true>(&dropped, slot);
        } else {
            self.release::<false>(&dropped, slot);
        }
        let count = dropped.len();
        self.scratch = dropped;
        self.stats.removed_not_held += (externals.len() - count) as u64;
        self.stats.blocks_removed += count as u64;
        Ok(count)
    }

    /// `worker` now holds nothing.
    pub fn clear_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
        let slot = self.slot_index(worker)?;
        self.tiers.clear(worker);
        self.slots.taken_mut(slot).order.clear();
        let held: Vec<NodeId> = self.slots.taken_mut(slot).blocks.drain_nodes().collect();
        for &node in &held {
            self.clear_bit(node, slot);
        }
        // Collect after every bit is cleared, so a node freed while climbing from a descendant is
        // never visited again as if alive (`collect` skips free nodes).
        for &node in &held {
            self.collect(node);
        }
        self.stats.clears += 1;
        Ok(())
    }

    /// Checks the index's internal invariants, for tests: every node's child count and links,
    /// every worker's map against the nodes' worker masks, and that no node is kept that nobody
    /// holds and that has no children. Returns the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_tiers()?;
        let live = |id: NodeId| id == ROOT || self.nodes[id as usize].parent != NONE;
        let mut children = vec![0u32; self.nodes.len()];
        let mut held_bits = 0usize;
        for id in 1..self.nodes.len() as NodeId {
            let n = &self.nodes[id as usize];
            if !live(id) {
                if !self.is_unheld(id) {
                    return Err(format!("free node {id} has workers"));
                }
                continue;
            }
            if !live(n.parent) {
                return Err(format!("node {id} has a free parent {}", n.parent));
            }
            children[n.parent as usize] += 1;
            if self.child(n.parent, n.local) != Some(id) {
                return Err(format!("node {id} is not found as the child of {}", n.parent));
            }
            if n.hint != NONE && n.hint_tag != self.nodes[n.hint as usize].local as u32 {
                return Err(format!("node {id}'s hint tag does not match its hint {}", n.hint));
            }
            if n.children == 0 && self.is_unheld(id) {
                return Err(format!(
                    "node {id} is held by nobody and has no children, but was kept"
                ));
            }
            if self.rows.wide() {
                self.rows.check(n.mask0).map_err(|e| format!("node {id}: {e}"))?;
                held_bits += self.rows.count(n.mask0);
            } else {
                held_bits += n.mask0.count_ones() as usize;
            }
        }
        for (id, &count) in children.iter().enumerate() {
            if live(id as NodeId) && self.nodes[id].children != count {
                return Err(format!(
                    "node {id} counts {} children, has {count}",
                    self.nodes[id].children
                ));
            }
        }
        let mut entries = 0usize;
        for (slot, s) in self.slots.iter() {
            for (ext, node) in s.blocks.iter() {
                if !live(node) || !self.holds_slot(node, slot) {
                    return Err(format!(
                        "worker {} maps {ext:#x} to node {node}, which it does not hold",
                        s.key
                    ));
                }
            }
            entries += s.blocks.len();
        }
        if entries != held_bits {
            return Err(format!("{entries} map entries but {held_bits} worker bits set"));
        }
        Ok(())
    }

    // ---- children ----

    /// The child of `parent` whose block has local hash `local`.
    #[inline(always)]
    fn child(&self, parent: NodeId, local: u64) -> Option<NodeId> {
        // A chain laid out in consecutive nodes (see `free_runs`): the next node's address is
        // known without reading `parent`'s hint, so a walk's loads along a chain overlap instead
        // of each waiting on the one before. A node is the child of its parent for its local hash
        // (free nodes have no parent), so checking the candidate's own fields is enough.
        let next = parent.wrapping_add(1);
        if let Some(n) = self.nodes.get(next as usize)
            && n.parent == parent
            && n.local == local
        {
            return Some(next);
        }
        let p = &self.nodes[parent as usize];
        if p.hint != NONE && p.hint_tag == local as u32 && self.nodes[p.hint as usize].local == local {
            return Some(p.hint);
        }
        // The hint is not it: look in the table if the node has children other than the hint.
        let in_table = p.children - u32::from(p.hint != NONE);
        if in_table == 0 {
            return None;
        }
        self.child_in_table(parent, local)
    }

    /// The child of `parent` for `local` among those in the children table (not the hint).
    #[inline(never)]
    fn child_in_table(&self, parent: NodeId, local: u64) -> Option<NodeId> {
        let nodes = &self.nodes;
        self.children
            .find(child_hash(parent, local), |&id| {
                let n = &nodes[id as usize];
                n.parent == parent && n.local == local
            })
            .copied()
    }

    /// Creates a chain of new nodes (held by nobody) for `blocks` under `parent`, which has no
    /// child for the first of them, and appends their ids to `path`. The ids are consecutive
    /// where the free runs allow (see `free_runs`), so walks along the chain read consecutive
    /// nodes.
    fn new_chain(&mut self, parent: NodeId, blocks: &[StoredBlock], path: &mut Vec<NodeId>) {
        path.reserve(blocks.len());
        let mut at = parent;
        let mut rest = blocks;
        while !rest.is_empty() {
            // A stretch of consecutive ids: the front of the top free run, or the arena's end.
            // Where the rest goes is decided again once a run is used up.
            let source = self
                .free
                .source(rest.len(), self.nodes.len(), self.nodes.capacity());
            let taken = match source {
                Source::Free => self.free.take_up_to(rest.len()),
                Source::End => None,
            };
            let (start, n) = taken.unwrap_or_else(|| {
                // Node by node, so the arena grows by `Vec`'s own doubling: `FreeRuns::source`
                // reads its capacity (a bulk `resize` may reserve exactly, and ids and memory
                // would then depend on how chains are batched).
                let start = self.nodes.len();
                for _ in 0..rest.len() {
                    self.nodes.push(Node::FREE);
                }
                (start as NodeId, rest.len())
            });
            let (stretch, after) = rest.split_at(n);
            self.lay_chain(at, start, stretch);
            path.extend(start..start + n as NodeId);
            at = start + n as NodeId - 1;
            rest = after;
        }
    }

    /// Writes `stretch` (not empty) into the free nodes from `start` on, as a chain under
    /// `parent`: each node the only child of the one before it, reached by its hint.
    fn lay_chain(&mut self, parent: NodeId, start: NodeId, stretch: &[StoredBlock]) {
        let nodes = &mut self.nodes[start as usize..][..stretch.len()];
        for (k, (node, block)) in nodes.iter_mut().zip(stretch).enumerate() {
            let id = start + k as NodeId;
            let next = stretch.get(k + 1);
            *node = Node {
                local: block.local.0,
                mask0: 0,
                parent: if k == 0 { parent } else { id - 1 },
                hint: if next.is_some() { id + 1 } else { NONE },
                hint_tag: next.map_or(0, |b| b.local.0 as u32),
                children: u32::from(next.is_some()),
            };
        }
        self.adopt(parent, start, stretch[0].local.0);
    }

    /// Counts the node `id`, just written as a child of `parent` for `local`, among `parent`'s
    /// children.
    fn adopt(&mut self, parent: NodeId, id: NodeId, local: u64) {
        let p = &mut self.nodes[parent as usize];
        p.children += 1;
        if p.hint == NONE && p.children == 1 {
            // An only child is reached through the hint alone: chains never touch the table.
            p.hint = id;
            p.hint_tag = local as u32;
        } else {
            let nodes = &self.nodes;
            self.children.insert_unique(child_hash(parent, local), id, |&n| {
                let n = &nodes[n as usize];
                child_hash(n.parent, n.local)
            });
        }
    }

    /// Frees `node` if no worker holds it and it has no children, then its ancestors likewise.
    #[inline(always)]
    fn collect(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &self.nodes[node as usize];
            // Most calls stop at the first test: a removed block in the middle of a chain still
            // has its children. `mask0` is 0 exactly when nobody holds the node (see `wide`).
            if n.children != 0 || n.mask0 != 0 || n.parent == NONE {
                return;
            }
            let n = *n;
            let p = &mut self.nodes[n.parent as usize];
            p.children -= 1;
            if p.hint == node {
                p.hint = NONE;
            } else if let Ok(entry) = self
                .children
                .find_entry(child_hash(n.parent, n.local), |&id| id == node)
            {
                entry.remove();
            }
            // A free node is one without a parent; its other fields are rewritten when it is
            // taken again (`lay_chain`), and nobody holds it and it has no children already.
            self.nodes[node as usize].parent = NONE;
            self.free.free(node);
            node = n.parent;
        }
    }

    // ---- worker masks ----

    /// Mask word `word` of `node`'s worker set.
    #[inline]
    fn mask_word(&self, node: NodeId, word: usize) -> u64 {
        self.rows.set_word(self.nodes[node as usize].mask0, word)
    }

    /// Whether the worker in `slot` holds `node`.
    fn holds_slot(&self, node: NodeId, slot: usize) -> bool {
        self.mask_word(node, slot / 64) & (1 << (slot % 64)) != 0
    }

    #[inline]
    fn clear_bit(&mut self, node: NodeId, slot: usize) {
        if self.rows.wide() {
            self.clear_bit_as::<true>(node, slot);
        } else {
            self.clear_bit_as::<false>(node, slot);
        }
    }

    /// [`PrefixIndex::clear_bit`] where `WIDE` is `rows.wide()`, for loops compiled once per kind
    /// of index.
    #[inline(always)]
    fn clear_bit_as<const WIDE: bool>(&mut self, node: NodeId, slot: usize) {
        let set = &mut self.nodes[node as usize].mask0;
        if WIDE {
            self.rows.remove(set, slot);
        } else {
            *set &= !(1 << (slot % 64));
        }
    }

    /// Clears `slot`'s bit on each of `dropped` and collects it (`WIDE` is `rows.wide()`).
    ///
    /// A node is collected as soon as its bit is cleared: one still held by this worker (in
    /// `dropped` further on) is not freed when a descendant climbs to it, so none is freed before
    /// its turn, and a parent whose last child goes later is collected by that child.
    fn release<const WIDE: bool>(&mut self, dropped: &[NodeId], slot: usize) {
        for &node in dropped {
            self.clear_bit_as::<WIDE>(node, slot);
            self.collect(node);
        }
    }

    fn is_unheld(&self, node: NodeId) -> bool {
        self.nodes[node as usize].mask0 == 0
    }
}

#[cfg(test)]
mod tests;
