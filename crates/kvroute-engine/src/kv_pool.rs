//! The paged KV cache: a fixed set of blocks, reference counts, a free list and the prefix cache.
//!
//! This is vLLM v1's `BlockPool`:
//!
//! * Every block is either **in use** (reference count above zero, held by running requests) or
//!   **free** (count zero, on the free list). In use + free = total, always.
//! * A full block may be **cached**: it carries its external hash and the cache maps that hash to
//!   it, so a later request with the same prefix reuses it. A cached block stays cached when
//!   freed; it can be hit until it is reused for something else.
//! * The free list is in eviction order. Freed blocks join its tail; allocation takes from its
//!   head and, if the block taken was cached, evicts it (a [`BlocksRemoved`] event). Requests free
//!   their blocks tail first, so within a request the tail is evicted before the prefix, and
//!   across requests the least recently freed block goes first.
//! * A hit on a free cached block takes it off the free list.
//!
//! One difference from vLLM: a hash names one block at most. When a request computes a block
//! that is already cached (two requests prefilling the same prompt in chunks, or the recomputed
//! last block of a fully cached prompt), it switches to the cached block and frees its own copy,
//! and no event is emitted. vLLM v1 keeps both copies under the hash and reports each one's
//! `stored` and `removed`, so a router that sees one copy removed believes the block gone while
//! the other copy serves hits. Keeping one copy also means that every full block of a running
//! request is cached and cannot be evicted, so every `stored` event names a parent the router
//! holds.

use kvroute_core::ids::ExternalBlockHash;
use kvroute_core::index::ExtMap;

use kvroute_core::events::{BlocksRemoved, KvEvent};

/// A block's index in the pool.
pub(crate) type BlockId = u32;

/// "No block", for free-list links.
const NIL: BlockId = BlockId::MAX;

#[derive(Clone, Copy, Debug)]
struct Block {
    /// Running requests holding the block.
    refs: u32,
    /// The block's external hash while it is cached.
    hash: Option<ExternalBlockHash>,
    /// Free-list neighbours (towards the head, towards the tail), `NIL` at the ends or when in
    /// use.
    prev: BlockId,
    next: BlockId,
}

/// The block pool. See the module docs.
#[derive(Debug)]
pub(crate) struct BlockPool {
    blocks: Vec<Block>,
    /// The free list: evicted from the head, freed blocks appended at the tail.
    head: BlockId,
    tail: BlockId,
    free: u32,
    /// Cached blocks by external hash: the index's map of external hashes (a key's entry is on
    /// its home cache line, which [`BlockPool::warm`] reads ahead for a run of stores, so a
    /// store writes a line already in cache). An eviction does not touch it: an entry is valid
    /// only while its block carries its hash, and stale entries are overwritten by the next
    /// store of the hash or swept when they outnumber the blocks.
    cached: ExtMap,
    /// Blocks that carry a hash (the valid entries of `cached`).
    num_cached: u32,
    /// Events since the last [`BlockPool::take_events`], in order.
    events: Vec<KvEvent>,
}

impl BlockPool {
    /// `num_blocks` free, uncached blocks, in id order on the free list.
    pub fn new(num_blocks: u32) -> Self {
        let blocks = (0..num_blocks)
            .map(|i| Block {
                refs: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == num_blocks { NIL } else { i + 1 },
            })
            .collect();
        let (head, tail) = if num_blocks == 0 {
            (NIL, NIL)
        } else {
            (0, num_blocks - 1)
        };
        Self {
            blocks,
            head,
            tail,
            free: num_blocks,
            cached: ExtMap::default(),
            num_cached: 0,
            events: Vec::new(),
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> u32 {
        self.blocks.len() as u32
    }

    /// Blocks held by requests.
    pub fn active(&self) -> u32 {
        self.total() - self.free
    }

    /// Blocks not held by any request (cached ones included): what can be allocated.
    pub fn free(&self) -> u32 {
        self.free
    }

    /// Requests holding `block`.
    pub fn refs(&self, block: BlockId) -> u32 {
        self.blocks[block as usize].refs
    }

    /// Blocks that carry a cached hash.
    pub fn cached(&self) -> u32 {
        self.num_cached
    }

    /// The block cached under `hash`, if any.
    fn cached_block(&self, hash: ExternalBlockHash) -> Option<BlockId> {
        self.cached
            .get(hash.0)
            .filter(|&b| self.blocks[b as usize].hash == Some(hash))
    }

    /// The external hashes of every cached block, in hash order.
    pub fn cached_hashes(&self) -> impl Iterator<Item = ExternalBlockHash> + '_ {
        let mut hashes: Vec<ExternalBlockHash> = self.blocks.iter().filter_map(|b| b.hash).collect();
        hashes.sort_unstable();
        hashes.into_iter()
    }

    /// The hash `block` is cached under, if any.
    pub fn hash_of(&self, block: BlockId) -> Option<ExternalBlockHash> {
        self.blocks[block as usize].hash
    }

    /// The cached blocks of the longest prefix of `hashes` in the cache, at most `max` blocks.
    pub fn lookup(&self, hashes: &[ExternalBlockHash], max: usize, out: &mut Vec<BlockId>) {
        out.extend(hashes.iter().take(max).map_while(|&h| self.cached_block(h)));
    }

    /// Prefetches the cache map's lines for `hashes`, so that the cache misses of a run of
    /// independent lookups overlap before the blocks are cached one by one.
    pub fn warm(&self, hashes: &[ExternalBlockHash]) {
        if hashes.len() > 1 {
            for h in hashes {
                self.cached.prefetch(h.0);
            }
        }
    }

    /// Whether `fresh` new blocks can be allocated after claiming `hits`.
    pub fn can_allocate(&self, fresh: u32, hits: &[BlockId]) -> bool {
        let hits_on_free_list = hits
            .iter()
            .filter(|&&b| self.blocks[b as usize].refs == 0)
            .count() as u32;
        self.free >= fresh + hits_on_free_list
    }

    /// Takes a reference to `block` (a cache hit), off the free list if it was free.
    pub fn claim(&mut self, block: BlockId) {
        if self.blocks[block as usize].refs == 0 {
            self.unlink(block);
        }
        self.blocks[block as usize].refs += 1;
    }

    /// Allocates `n` blocks from the head of the free list onto `out`, evicting cached ones, or
    /// does nothing and returns false when fewer than `n` are free.
    pub fn allocate(&mut self, n: u32, out: &mut Vec<BlockId>) -> bool {
        if self.free < n {
            return false;
        }
        out.reserve(n as usize);
        for _ in 0..n {
            let block = self.head;
            self.unlink(block);
            self.evict(block);
            self.blocks[block as usize].refs = 1;
            out.push(block);
        }
        true
    }

    /// Caches `*block`, held by one request, under `hash` and returns true; or, when another
    /// block is already cached under `hash`, makes the request hold that one instead (taking a
    /// reference to it and releasing `*block`) and returns false.
    pub fn cache(&mut self, block: &mut BlockId, hash: ExternalBlockHash) -> bool {
        debug_assert!(
            self.blocks[*block as usize].hash.is_none(),
            "block {block} cached twice"
        );
        match self.cached.insert_new(hash.0, *block) {
            Ok(()) => {}
            Err(cached) if self.blocks[cached as usize].hash == Some(hash) => {
                self.claim(cached);
                self.release(&[*block]);
                *block = cached;
                return false;
            }
            Err(_) => {
                self.cached.replace(hash.0, *block);
            }
        }
        self.blocks[*block as usize].hash = Some(hash);
        self.num_cached += 1;
        if self.cached.len() > 2 * self.blocks.len() + 1024 {
            let blocks = &self.blocks;
            self.cached
                .retain(|h, b| blocks[b as usize].hash == Some(ExternalBlockHash(h)));
        }
        true
    }

    /// Drops one reference to each of `blocks`, last block first, so a request's tail joins the
    /// free list (and will be evicted) before its prefix.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &block in blocks.iter().rev() {
            let b = &mut self.blocks[block as usize];
            debug_assert!(b.refs > 0, "block {block} released more often than taken");
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.push_tail(block);
            }
        }
    }

    /// Forgets every cached hash, if no block is in use. Returns whether it did.
    pub fn reset(&mut self) -> bool {
        if self.active() > 0 {
            return false;
        }
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.cached.clear();
        self.num_cached = 0;
        self.events.push(KvEvent::AllCleared);
        true
    }

    /// Records an event in order with the pool's own.
    pub fn push_event(&mut self, event: KvEvent) {
        self.events.push(event);
    }

    /// The events since the last call, to append to in order.
    pub fn events_mut(&mut self) -> &mut Vec<KvEvent> {
        &mut self.events
    }

    /// The events since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Checks the pool against `holders[b]`, the number of requests holding block `b`: counts,
    /// free-list links, and the cache map against the blocks' hashes.
    pub fn check_invariants(&self, holders: &[u32]) -> Result<(), String> {
        if holders.len() != self.blocks.len() {
            return Err(format!(
                "{} holder counts for {} blocks",
                holders.len(),
                self.blocks.len()
            ));
        }
        // One pass over the blocks for the per-block facts; a violation is then located (and
        // named) by the slower search below.
        let (mut in_use, mut carrying, mut refs_differ) = (0u32, 0usize, false);
        for (block, &held) in self.blocks.iter().zip(holders) {
            refs_differ |= block.refs != held;
            in_use += u32::from(block.refs > 0);
            carrying += usize::from(block.hash.is_some());
        }
        if refs_differ
            && let Some((i, (block, held))) = self
                .blocks
                .iter()
                .zip(holders)
                .enumerate()
                .find(|(_, (block, held))| block.refs != **held)
        {
            return Err(format!(
                "block {i} has {} references but {held} holders",
                block.refs
            ));
        }
        let on_list = self.walk_free_list()?;
        if on_list != self.free {
            return Err(format!(
                "free count {} but {on_list} blocks on the free list",
                self.free
            ));
        }
        if in_use + self.free != self.total() {
            return Err(format!(
                "{in_use} in use + {} free != {} total",
                self.free,
                self.total()
            ));
        }
        // Every block carrying a hash is the one the cache map names under it. The map's valid
        // entries (an entry whose block carries the entry's hash) name distinct blocks (their
        // hashes are distinct keys, and a block carries one hash), each carrying its hash; so
        // they are exactly the carrying blocks' entries when they are as many. Counting them is
        // one walk over the map instead of a lookup per block; on a mismatch the lookups name
        // the block.
        let valid = self
            .cached
            .iter()
            .filter(|&(h, b)| {
                self.blocks
                    .get(b as usize)
                    .is_some_and(|block| block.hash == Some(ExternalBlockHash(h)))
            })
            .count();
        if valid != carrying {
            for (i, block) in self.blocks.iter().enumerate() {
                if let Some(hash) = block.hash
                    && self.cached.get(hash.0) != Some(i as BlockId)
                {
                    return Err(format!(
                        "block {i} carries {hash:?} but the cache map does not name it"
                    ));
                }
            }
            return Err(format!(
                "{valid} valid cache map entries for {carrying} blocks carrying a hash"
            ));
        }
        if carrying != self.num_cached as usize {
            return Err(format!(
                "{carrying} blocks carry a hash but {} are counted cached",
                self.num_cached
            ));
        }
        Ok(())
    }

    /// Walks the free list from head to tail, checking links and that every block on it is
    /// unreferenced; returns its length.
    fn walk_free_list(&self) -> Result<u32, String> {
        let mut count = 0u32;
        let (mut at, mut prev) = (self.head, NIL);
        while at != NIL {
            let block = &self.blocks[at as usize];
            if block.refs != 0 || block.prev != prev {
                return Err(format!(
                    "free block {at} has {} references, prev link {}",
                    block.refs, block.prev
                ));
            }
            count += 1;
            if count > self.total() {
                return Err("the free list has a cycle".to_owned());
            }
            (prev, at) = (at, block.next);
        }
        if prev != self.tail {
            return Err(format!("free list ends at {prev}, tail is {}", self.tail));
        }
        Ok(count)
    }

    /// Drops `block`'s cached hash, if any, with a [`BlocksRemoved`] event.
    fn evict(&mut self, block: BlockId) {
        if let Some(hash) = self.blocks[block as usize].hash.take() {
            self.num_cached -= 1;
            // Evictions with no other event between them share one event (as a batch they are
            // the same to a subscriber, and a simulated fleet evicts millions of blocks).
            match self.events.last_mut() {
                Some(KvEvent::Removed(removed)) => removed.block_hashes.push(hash),
                _ => self.events.push(KvEvent::Removed(BlocksRemoved {
                    block_hashes: vec![hash],
                })),
            }
        }
    }

    /// Takes `block` off the free list.
    fn unlink(&mut self, block: BlockId) {
        let Block { prev, next, .. } = self.blocks[block as usize];
        match prev {
            NIL => self.head = next,
            p => self.blocks[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.blocks[n as usize].prev = prev,
        }
        let b = &mut self.blocks[block as usize];
        (b.prev, b.next) = (NIL, NIL);
        self.free -= 1;
    }

    /// Appends `block` to the tail of the free list.
    fn push_tail(&mut self, block: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[block as usize];
            (b.prev, b.next) = (tail, NIL);
        }
        match tail {
            NIL => self.head = block,
            t => self.blocks[t as usize].next = block,
        }
        self.tail = block;
        self.free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(i: u64) -> ExternalBlockHash {
        ExternalBlockHash(i)
    }

    #[test]
    fn freed_blocks_are_evicted_least_recently_freed_first_tail_before_prefix() {
        let mut pool = BlockPool::new(4);
        let mut a = Vec::new();
        assert!(pool.allocate(2, &mut a));
        let mut b = Vec::new();
        assert!(pool.allocate(2, &mut b));
        for (i, block) in a.iter_mut().chain(&mut b).enumerate() {
            assert!(pool.cache(block, hash(i as u64)));
        }
        pool.release(&a); // free list: a[1], a[0]
        pool.release(&b); // free list: a[1], a[0], b[1], b[0]
        let mut out = Vec::new();
        assert!(pool.allocate(3, &mut out));
        assert_eq!(out, vec![a[1], a[0], b[1]]);
        let removed: Vec<_> = pool
            .take_events()
            .into_iter()
            .map(|e| match e {
                KvEvent::Removed(r) => r.block_hashes,
                other => panic!("{other:?}"),
            })
            .collect();
        // Evicted in free-list order, consecutive evictions sharing one event.
        assert_eq!(removed, vec![vec![hash(1), hash(0), hash(3)]]);
        assert_eq!(pool.cached_hashes().collect::<Vec<_>>(), vec![hash(2)]);
        pool.check_invariants(&[1, 1, 0, 1]).unwrap();
    }

    /// A pool of four cached blocks, two held by one request (blocks 0 and 1), two free.
    fn four_cached() -> (BlockPool, [u32; 4]) {
        let mut pool = BlockPool::new(4);
        let mut blocks = Vec::new();
        assert!(pool.allocate(4, &mut blocks));
        for (i, block) in blocks.iter_mut().enumerate() {
            assert!(pool.cache(block, hash(i as u64)));
        }
        pool.release(&blocks[2..]);
        pool.check_invariants(&[1, 1, 0, 0]).unwrap();
        (pool, [1, 1, 0, 0])
    }

    #[test]
    fn the_invariant_check_names_each_kind_of_corruption() {
        let check = |pool: &BlockPool, holders: &[u32]| pool.check_invariants(holders).unwrap_err();
        let (pool, holders) = four_cached();
        let mut wrong = holders;
        wrong[1] = 2;
        assert_eq!(check(&pool, &wrong), "block 1 has 1 references but 2 holders");
        // A carrying block the map does not name: its entry gone, or naming another block.
        let (mut pool, holders) = four_cached();
        pool.cached.remove(hash(2).0);
        assert!(
            check(&pool, &holders).starts_with("block 2 carries"),
            "{}",
            check(&pool, &holders)
        );
        let (mut pool, holders) = four_cached();
        pool.blocks[3].hash = Some(hash(2));
        pool.cached.remove(hash(3).0);
        assert!(check(&pool, &holders).contains("the cache map does not name it"));
        // An entry naming a block past the pool.
        let (mut pool, holders) = four_cached();
        assert!(pool.cached.replace(hash(0).0, 9));
        assert!(check(&pool, &holders).starts_with("block 0 carries"));
        // The counter of cached blocks.
        let (mut pool, holders) = four_cached();
        pool.num_cached = 3;
        assert_eq!(
            check(&pool, &holders),
            "4 blocks carry a hash but 3 are counted cached"
        );
        // References against the free list.
        let (mut pool, _) = four_cached();
        pool.blocks[2].refs = 1;
        assert!(check(&pool, &[1, 1, 1, 0]).starts_with("free block 2 has 1 references"));
        // Stale entries (a block since evicted or recached) are not violations.
        let (mut pool, holders) = four_cached();
        assert_eq!(pool.cached.insert_new(77, 2), Ok(()), "hash 77 was cached");
        pool.check_invariants(&holders).unwrap();
    }

    #[test]
    fn a_hit_takes_a_free_block_off_the_free_list() {
        let mut pool = BlockPool::new(2);
        let mut a = Vec::new();
        assert!(pool.allocate(1, &mut a));
        assert!(pool.cache(&mut a[0], hash(7)));
        pool.release(&a);
        let mut hits = Vec::new();
        pool.lookup(&[hash(7), hash(8)], 2, &mut hits);
        assert_eq!(hits, a);
        assert!(pool.can_allocate(1, &hits));
        assert!(!pool.can_allocate(2, &hits));
        pool.claim(hits[0]);
        assert_eq!((pool.free, pool.active()), (1, 1));
        // A second copy of the same block is swapped for the cached one and freed.
        let mut b = Vec::new();
        assert!(pool.allocate(1, &mut b));
        let copy = b[0];
        assert!(!pool.cache(&mut b[0], hash(7)));
        assert_eq!(b, a);
        assert_eq!(pool.blocks[copy as usize].refs, 0);
        pool.check_invariants(&[2, 0]).unwrap();
        assert!(!pool.reset());
    }
}
