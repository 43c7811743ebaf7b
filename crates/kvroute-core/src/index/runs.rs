//! [`RunIndex`]: the prefix index laid out as runs.
//!
//! The semantics are [`PrefixIndex`](super::PrefixIndex)'s (holding, depth, holes and heals,
//! the same errors for the same bad stores); the layout differs. A run is a stretch of a chain
//! whose blocks have one holder set and no branch before its last block: one record (first
//! block, length, holder set, parent block, children) for the whole stretch. A run's blocks
//! have consecutive block ids, and the blocks' local hashes are one packed array indexed by
//! block id, so a lookup along a run is a loop comparing 8-byte hashes, with one child lookup
//! a run rather than a node read a block.
//!
//! * Children hang off a run's last block and are keyed by that block's id, which never changes,
//!   so splitting a run (a store that branches or covers part of it, a removal of part of it:
//!   holes stay exact) moves no child. A split rewrites the run id of the blocks after the cut.
//! * A store that continues a run held by its worker alone, with no children and free ids after
//!   it, appends to the run.
//! * Runs are not merged back when holder sets become equal again.
//!
//! * A run's holder set is the node layout's: a bit mask while the fleet has at most 64 worker
//!   slots, a set code past that (`wide`); a lookup reads one mask word once every worker still
//!   matching is in it.
//!
//! Block ids come from the same coalescing free runs as the node arena's (`free_runs`). The
//! worker table, the counters, the cap and the slower tiers are the node layout's (`api`,
//! `slots`, `tier`).

use std::num::NonZeroUsize;

use hashbrown::HashTable;

use super::free_runs::{FreeRuns, Source};
use super::slots::{Slots, WorkerSlot};
use super::tier::Tiers;
use super::wide::Rows;
use super::{
    ExtMap, IndexConfig, IndexError, IndexEvent, IndexFootprint, IndexStats, NONE, OverlapScores,
    REMOVE_AHEAD, STORE_AHEAD, StoredBlock, Tier, hold_block,
};
use crate::ids::{ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerKey};
use crate::key_hasher::mix;

/// A block id: its place in the packed arrays.
type BlockId = u32;
/// A run id.
type RunId = u32;

/// A stretch of a chain with one holder set.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// The first block's id; the run is `start..start + len`.
    start: BlockId,
    /// Blocks in the run; 0 for a free run.
    len: u32,
    /// The workers that hold every block of the run: a holder set of `rows` (a bit mask while
    /// narrow, a code once wide).
    mask: u64,
    /// The block the run continues (the last block of another run), or `NONE` under the root.
    parent: BlockId,
    /// A child run reached without the table, or `NONE`.
    hint: RunId,
    /// Child runs of the last block.
    children: u32,
}

impl Run {
    const FREE: Run = Run {
        start: 0,
        len: 0,
        mask: 0,
        parent: NONE,
        hint: NONE,
        children: 0,
    };

    fn end(&self) -> BlockId {
        self.start + self.len
    }

    fn last(&self) -> BlockId {
        self.end() - 1
    }
}

/// How many of `locals` from the first on equal the local hashes `local` gives of `other`'s.
///
/// Four at a time, one branch for the four: along a run a query or a store matches far more
/// often than not, and a branch per block is most of a long match's instructions.
#[inline]
fn matching<T>(locals: &[u64], other: &[T], local: impl Fn(&T) -> u64) -> usize {
    const CHUNK: usize = 4;
    let n = locals.len().min(other.len());
    let (locals, other) = (&locals[..n], &other[..n]);
    let mut same = 0;
    for (l, o) in locals.chunks_exact(CHUNK).zip(other.chunks_exact(CHUNK)) {
        let diff =
            (l[0] ^ local(&o[0])) | (l[1] ^ local(&o[1])) | (l[2] ^ local(&o[2])) | (l[3] ^ local(&o[3]));
        if diff != 0 {
            break;
        }
        same += CHUNK;
    }
    same + locals[same..]
        .iter()
        .zip(&other[same..])
        .take_while(|&(l, o)| *l == local(o))
        .count()
}

/// Makes room in `v` for `additional` more items at the capacity pushing them one by one would
/// reach (doubling from 4), where one `extend` would take exactly the length it needs: the
/// arena's capacity decides whether a store takes free ids or the arena's end.
fn reserve_doubling<T>(v: &mut Vec<T>, additional: usize) {
    let needed = v.len() + additional;
    if needed > v.capacity() {
        let mut capacity = v.capacity().max(4);
        while capacity < needed {
            capacity *= 2;
        }
        v.reserve_exact(capacity - v.len());
    }
}

#[inline]
fn child_hash(parent: BlockId, local: u64) -> u64 {
    mix(local, u64::from(parent))
}

/// How far ahead [`RunIndex::release`] fetches the runs of the blocks it drops.
const RELEASE_AHEAD: usize = 8;

/// The prefix index as runs of blocks with one holder set; see the module docs.
#[derive(Debug, Default)]
pub struct RunIndex {
    /// Local hash of each block id.
    locals: Vec<u64>,
    /// Run of each block id; `NONE` for free ids.
    run_of: Vec<RunId>,
    runs: Vec<Run>,
    free_run_ids: Vec<RunId>,
    /// Free block ids.
    free: FreeRuns,
    /// Child runs not reached by their parent run's hint (and every run under the root), keyed
    /// by `(parent block, first local)`.
    children: HashTable<RunId>,
    slots: Slots,
    /// Reused block id buffer.
    scratch: Vec<BlockId>,
    /// New-block id stretches of a store.
    segments: Vec<(BlockId, u32)>,
    per_worker: usize,
    stats: IndexStats,
    /// [`IndexConfig::max_blocks_per_worker`].
    cap: Option<NonZeroUsize>,
    /// The slower tiers' blocks (see `tier`).
    tiers: Tiers,
    /// The holder sets of a fleet of more than 64 slots (see `wide`); empty before.
    rows: Rows,
}

impl RunIndex {
    /// An empty index with no workers.
    pub fn new(config: IndexConfig) -> Self {
        Self {
            locals: Vec::with_capacity(config.expected_blocks),
            run_of: Vec::with_capacity(config.expected_blocks),
            per_worker: config.expected_blocks_per_worker,
            cap: config.max_blocks_per_worker,
            ..Self::default()
        }
    }

    shared_index_api!();

    /// How many workers hold block `b`.
    fn holder_count(&self, b: BlockId) -> usize {
        self.rows
            .set_len(self.runs[self.run_of[b as usize] as usize].mask)
    }

    /// Starts tracking `worker`, empty; a worker already tracked is left alone.
    pub fn add_worker(&mut self, worker: WorkerKey) {
        if let Some(slot) = self.slots.add(worker, self.per_worker) {
            let sets = self.runs.iter_mut().map(|r| &mut r.mask);
            self.rows.ensure_slot(slot, sets);
        }
    }

    /// Stops tracking `worker` and forgets every block it held.
    pub fn remove_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
        self.clear_worker(worker)?;
        self.slots.remove(worker);
        Ok(())
    }

    /// Entries, live blocks and heap bytes (`nodes` counts live blocks).
    pub fn footprint(&self) -> IndexFootprint {
        let entries = self.slots.entries();
        let heap = self.locals.capacity() * size_of::<u64>()
            + self.run_of.capacity() * size_of::<RunId>()
            + self.runs.capacity() * size_of::<Run>()
            + self.free_run_ids.capacity() * size_of::<RunId>()
            + self.free.allocation_size()
            + self.children.allocation_size()
            + self.rows.allocation_size()
            + self.slots.allocation_size();
        IndexFootprint {
            entries: entries as u64,
            nodes: (self.locals.len() - self.free.len()) as u64,
            heap_bytes: heap as u64,
        }
    }

    /// [`PrefixIndex::apply_stored`](super::PrefixIndex::apply_stored), with the same results.
    pub fn apply_stored(
        &mut self,
        worker: WorkerKey,
        parent: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let slot = self.slot_index(worker)?;
        let result = self.store(worker, slot, parent, blocks);
        match &result {
            Err(IndexError::UnknownParent { .. }) => self.stats.unknown_parent += 1,
            Err(IndexError::ConflictingBlock { .. }) => self.stats.conflicting_block += 1,
            Err(IndexError::DuplicatePrefix { .. }) => self.stats.duplicate_prefix += 1,
            _ => {}
        }
        // A store refused before its first block changed nothing (as the node layout's).
        if let Some(cap) = self.cap
            && !matches!(result, Err(IndexError::UnknownParent { .. }))
        {
            let mut dropped = std::mem::take(&mut self.scratch);
            dropped.clear();
            self.stats.blocks_evicted += self.slots.evict_over_cap(slot, cap.get(), &mut dropped);
            self.release(&mut dropped, slot);
            self.scratch = dropped;
        }
        result
    }

    /// [`RunIndex::apply_stored`] for the worker in `slot`, before the cap and the counters of
    /// refusals.
    fn store(
        &mut self,
        worker: WorkerKey,
        slot: usize,
        parent: Option<ExternalBlockHash>,
        blocks: &[StoredBlock],
    ) -> Result<(), IndexError> {
        let map = self.map(slot);
        for block in blocks.iter().take(STORE_AHEAD) {
            map.prefetch(block.external.0);
        }
        let mut at = match parent {
            None => NONE,
            Some(parent) => match self.map(slot).get(parent.0) {
                Some(block) => block,
                None => return Err(IndexError::UnknownParent { worker, parent }),
            },
        };
        let mut i = 0;
        // The blocks already in the tree, a stretch of one run at a time.
        while i < blocks.len() {
            let Some((r, off)) = self.next(at, blocks[i].local.0) else {
                break;
            };
            let run = self.runs[r as usize];
            let from = run.start + off;
            let room = ((run.end() - from) as usize).min(blocks.len() - i);
            let n = 1 + matching(
                &self.locals[from as usize + 1..][..room - 1],
                &blocks[i + 1..],
                |b| b.local.0,
            );
            let held = self.rows.set_has(run.mask, slot);
            let WorkerSlot {
                blocks: map, order, ..
            } = self.slots.taken_mut(slot);
            let mut applied = n;
            let mut error = None;
            for (k, block) in blocks[i..i + n].iter().enumerate() {
                let id = from + k as BlockId;
                if let Some(ahead) = blocks.get(i + k + STORE_AHEAD) {
                    map.prefetch(ahead.external.0);
                }
                if let Err(refusal) = hold_block(map, block.external.0, id, held) {
                    error = Some(refusal.error(worker, block.external, i + k));
                    applied = k;
                    break;
                }
            }
            // The run's holder set and the worker's map agree, so the blocks applied are all
            // new to the worker or all held already.
            if !held && applied > 0 {
                self.stats.blocks_stored += applied as u64;
                if self.cap.is_some() {
                    order.extend(blocks[i..i + applied].iter().map(|b| b.external.0));
                }
                self.change_range(r, off, applied as u32, |rows, m| rows.set_add(m, slot));
            }
            if let Some(error) = error {
                return Err(error);
            }
            i += n;
            at = from + n as BlockId - 1;
        }
        if i == blocks.len() {
            return Ok(());
        }
        // A branch inside a run: the new blocks hang off a run's last block.
        if at != NONE {
            let r = self.run_of[at as usize];
            let run = self.runs[r as usize];
            if at != run.last() {
                self.split(r, at + 1 - run.start);
            }
        }
        self.new_blocks(worker, slot, at, &blocks[i..], i)
    }

    /// Lays `rest`, new to the tree, under block `at` (a run's last block, or `NONE`) for the
    /// worker in `slot`; `before` blocks of the store came before them.
    fn new_blocks(
        &mut self,
        worker: WorkerKey,
        slot: usize,
        mut at: BlockId,
        rest: &[StoredBlock],
        before: usize,
    ) -> Result<(), IndexError> {
        // Ids first (an append to `at`'s run where it is this worker's alone, childless and
        // the next id is free), then the map, then the runs for the blocks the map took.
        // Each id gets its block's local hash here; an id the map then refuses is freed again,
        // and a free id's local hash is never read.
        let mut segments = std::mem::take(&mut self.segments);
        segments.clear();
        let mut done = 0;
        while done < rest.len() {
            let need = rest.len() - done;
            let source = self.free.source(need, self.locals.len(), self.locals.capacity());
            let taken = match source {
                Source::Free => self.free.take_up_to(need),
                Source::End => None,
            };
            let (start, n) = match taken {
                Some((start, n)) => {
                    let ids = &mut self.locals[start as usize..start as usize + n];
                    for (local, block) in ids.iter_mut().zip(&rest[done..]) {
                        *local = block.local.0;
                    }
                    (start, n)
                }
                None => {
                    let start = self.locals.len();
                    reserve_doubling(&mut self.locals, need);
                    reserve_doubling(&mut self.run_of, need);
                    self.locals.extend(rest[done..].iter().map(|b| b.local.0));
                    self.run_of.resize(self.locals.len(), NONE);
                    (start as BlockId, need)
                }
            };
            segments.push((start, n as u32));
            done += n;
        }
        let capped = self.cap.is_some();
        let WorkerSlot {
            blocks: map, order, ..
        } = self.slots.taken_mut(slot);
        map.reserve(rest.len());
        let mut applied = 0;
        let mut error = None;
        'ids: for &(start, n) in &segments {
            let blocks = &rest[applied..applied + n as usize];
            for (id, block) in (start..start + n).zip(blocks) {
                if let Some(ahead) = rest.get(applied + STORE_AHEAD) {
                    map.prefetch(ahead.external.0);
                }
                if map.insert_new(block.external.0, id).is_err() {
                    error = Some(IndexError::ConflictingBlock {
                        worker,
                        external: block.external,
                        applied: before + applied,
                    });
                    break 'ids;
                }
                applied += 1;
            }
        }
        self.stats.blocks_stored += applied as u64;
        if capped {
            order.extend(rest[..applied].iter().map(|b| b.external.0));
        }
        let mut left = applied;
        for &(start, n) in &segments {
            let used = (n as usize).min(left);
            for id in start + used as u32..start + n {
                self.free.free(id);
            }
            if used == 0 {
                continue;
            }
            let extend = (at != NONE).then(|| self.run_of[at as usize]).filter(|&r| {
                let run = &self.runs[r as usize];
                self.rows.set_is_only(run.mask, slot) && run.children == 0 && run.end() == start
            });
            let r = match extend {
                Some(r) => {
                    self.runs[r as usize].len += used as u32;
                    r
                }
                None => {
                    let mut mask = 0;
                    self.rows.set_add(&mut mask, slot);
                    let r = self.new_run(Run {
                        start,
                        len: used as u32,
                        mask,
                        parent: at,
                        hint: NONE,
                        children: 0,
                    });
                    self.adopt(at, r);
                    r
                }
            };
            self.run_of[start as usize..start as usize + used].fill(r);
            at = start + used as u32 - 1;
            left -= used;
        }
        self.segments = segments;
        error.map_or(Ok(()), Err)
    }

    /// [`PrefixIndex::apply_removed`](super::PrefixIndex::apply_removed): drops `externals`
    /// from `worker`; returns how many it held.
    pub fn apply_removed(
        &mut self,
        worker: WorkerKey,
        externals: &[ExternalBlockHash],
    ) -> Result<usize, IndexError> {
        let slot = self.slot_index(worker)?;
        let mut dropped = std::mem::take(&mut self.scratch);
        dropped.clear();
        let map = &mut self.slots.taken_mut(slot).blocks;
        for e in externals.iter().take(REMOVE_AHEAD) {
            map.prefetch(e.0);
        }
        for (i, e) in externals.iter().enumerate() {
            if let Some(ahead) = externals.get(i + REMOVE_AHEAD) {
                map.prefetch(ahead.0);
            }
            if let Some(b) = map.remove(e.0) {
                dropped.push(b);
            }
        }
        let count = dropped.len();
        self.release(&mut dropped, slot);
        self.scratch = dropped;
        self.stats.removed_not_held += (externals.len() - count) as u64;
        self.stats.blocks_removed += count as u64;
        Ok(count)
    }

    /// `worker` now holds nothing.
    pub fn clear_worker(&mut self, worker: WorkerKey) -> Result<(), IndexError> {
        let slot = self.slot_index(worker)?;
        self.tiers.clear(worker);
        let mut dropped = std::mem::take(&mut self.scratch);
        dropped.clear();
        let s = self.slots.taken_mut(slot);
        s.order.clear();
        dropped.extend(s.blocks.drain_nodes());
        self.release(&mut dropped, slot);
        self.scratch = dropped;
        self.stats.clears += 1;
        Ok(())
    }

    /// `worker` copied `externals`, blocks it holds on the GPU, to `tier`: each is placed at
    /// its GPU block's prefix. Blocks it does not hold on the GPU are left out (the others
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
            locals,
            run_of,
            runs,
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
            |b| {
                let run = &runs[run_of[b as usize] as usize];
                if b > run.start {
                    Some(b - 1)
                } else {
                    Some(run.parent).filter(|&p| p != NONE)
                }
            },
            |b| locals[b as usize],
            &mut path,
        );
        self.scratch = path;
        result
    }

    /// Clears `slot`'s bit on `dropped` (block ids it held), a stretch of a run at a time: ids
    /// that follow each other in `dropped`, rising or falling by one within one run, are one
    /// stretch. Any order is correct (a run is looked up again for each stretch, and a run
    /// holding a block still to be dropped keeps the bit, so it is not freed before its turn);
    /// an engine's removals list a chain's blocks in order, so stretches are long.
    fn release(&mut self, dropped: &mut [BlockId], slot: usize) {
        for &b in dropped.iter().take(RELEASE_AHEAD) {
            kvroute_prefetch::prefetch_read(&self.run_of[b as usize]);
        }
        let mut k = 0;
        while k < dropped.len() {
            // Block ids are scattered over the arena, so each stretch's run (and, a chain freed
            // last block first, the parent run the next stretch frees) would be a cache miss:
            // fetch them ahead, the block's run once its entry of `run_of` has arrived.
            if let Some(&b) = dropped.get(k + RELEASE_AHEAD) {
                kvroute_prefetch::prefetch_read(&self.run_of[b as usize]);
            }
            if let Some(&b) = dropped.get(k + RELEASE_AHEAD / 2)
                && let Some(run) = self.runs.get(self.run_of[b as usize] as usize)
            {
                kvroute_prefetch::prefetch_read(run);
            }
            let b = dropped[k];
            let r = self.run_of[b as usize];
            let run = self.runs[r as usize];
            let mut n = 1;
            if dropped.get(k + 1) == Some(&b.wrapping_add(1)) {
                while dropped.get(k + n) == Some(&(b + n as BlockId)) && b + (n as BlockId) < run.end() {
                    n += 1;
                }
            } else if dropped.get(k + 1) == Some(&b.wrapping_sub(1)) {
                while b >= n as BlockId
                    && b - (n as BlockId) >= run.start
                    && dropped.get(k + n) == Some(&(b - n as BlockId))
                {
                    n += 1;
                }
            }
            let first = b.min(dropped[k + n - 1]);
            let r = self.change_range(r, first - run.start, n as u32, |rows, m| rows.set_remove(m, slot));
            self.collect(r);
            k += n;
        }
    }

    /// Changes the holder set of blocks `off..off + n` of run `r` with `f`, splitting the run
    /// around them; returns their run.
    fn change_range(&mut self, r: RunId, off: u32, n: u32, f: impl Fn(&mut Rows, &mut u64)) -> RunId {
        let mut r = r;
        if off > 0 {
            r = self.split(r, off);
        }
        if self.runs[r as usize].len > n {
            self.split(r, n);
        }
        f(&mut self.rows, &mut self.runs[r as usize].mask);
        r
    }

    /// Cuts run `r` before its block `at` (`0 < at < len`); returns the new run of the blocks
    /// from `at` on, which takes over `r`'s children.
    fn split(&mut self, r: RunId, at: u32) -> RunId {
        let run = self.runs[r as usize];
        let mask = self.rows.set_copy(run.mask);
        let tail = self.new_run(Run {
            start: run.start + at,
            len: run.len - at,
            mask,
            parent: run.start + at - 1,
            hint: run.hint,
            children: run.children,
        });
        self.run_of[(run.start + at) as usize..run.end() as usize].fill(tail);
        let head = &mut self.runs[r as usize];
        head.len = at;
        head.hint = tail;
        head.children = 1;
        tail
    }

    fn new_run(&mut self, run: Run) -> RunId {
        match self.free_run_ids.pop() {
            Some(r) => {
                self.runs[r as usize] = run;
                r
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as RunId
            }
        }
    }

    /// Counts run `r`, just written, among the children of block `parent`.
    fn adopt(&mut self, parent: BlockId, r: RunId) {
        if parent != NONE {
            let p = &mut self.runs[self.run_of[parent as usize] as usize];
            p.children += 1;
            if p.hint == NONE && p.children == 1 {
                p.hint = r;
                return;
            }
        }
        let local = self.locals[self.runs[r as usize].start as usize];
        let (runs, locals) = (&self.runs, &self.locals);
        self.children.insert_unique(child_hash(parent, local), r, |&c| {
            let c = &runs[c as usize];
            child_hash(c.parent, locals[c.start as usize])
        });
    }

    /// Frees run `r` if nobody holds it and it has no children, then its ancestors likewise.
    fn collect(&mut self, mut r: RunId) {
        loop {
            let run = self.runs[r as usize];
            if run.mask != 0 || run.children != 0 {
                return;
            }
            let local = self.locals[run.start as usize];
            let in_table = if run.parent == NONE {
                true
            } else {
                let p = &mut self.runs[self.run_of[run.parent as usize] as usize];
                p.children -= 1;
                if p.hint == r {
                    p.hint = NONE;
                    false
                } else {
                    true
                }
            };
            if in_table
                && let Ok(entry) = self
                    .children
                    .find_entry(child_hash(run.parent, local), |&c| c == r)
            {
                entry.remove();
            }
            // Last block first, so the ids coalesce into one free run in order.
            for id in (run.start..run.end()).rev() {
                self.run_of[id as usize] = NONE;
                self.free.free(id);
            }
            self.runs[r as usize] = Run::FREE;
            self.free_run_ids.push(r);
            if run.parent == NONE {
                return;
            }
            r = self.run_of[run.parent as usize];
        }
    }

    /// The place of the block after block `at` (`NONE`: the root) whose local hash is `local`:
    /// its run and offset.
    #[inline]
    fn next(&self, at: BlockId, local: u64) -> Option<(RunId, u32)> {
        if at != NONE {
            let r = self.run_of[at as usize];
            let run = &self.runs[r as usize];
            if at != run.last() {
                return (self.locals[at as usize + 1] == local).then_some((r, at + 1 - run.start));
            }
        }
        self.child(at, local).map(|c| (c, 0))
    }

    /// The child run of block `parent` (a run's last block, or `NONE`) starting with `local`.
    #[inline]
    fn child(&self, parent: BlockId, local: u64) -> Option<RunId> {
        let run = (parent != NONE).then(|| &self.runs[self.run_of[parent as usize] as usize]);
        self.child_of(run, parent, local)
    }

    /// [`RunIndex::child`] where `run` is the run of `parent` (`None` for the root).
    #[inline]
    fn child_of(&self, run: Option<&Run>, parent: BlockId, local: u64) -> Option<RunId> {
        if let Some(p) = run {
            if p.hint != NONE && self.locals[self.runs[p.hint as usize].start as usize] == local {
                return Some(p.hint);
            }
            if p.children <= u32::from(p.hint != NONE) {
                return None;
            }
        }
        let (runs, locals) = (&self.runs, &self.locals);
        self.children
            .find(child_hash(parent, local), |&c| {
                let c = &runs[c as usize];
                c.parent == parent && locals[c.start as usize] == local
            })
            .copied()
    }

    /// [`PrefixIndex::find_matches_into`](super::PrefixIndex::find_matches_into).
    pub fn find_matches_into(&self, query: &[LocalBlockHash], early_exit: bool, out: &mut OverlapScores) {
        out.clear();
        let Some(first) = query.first() else {
            return;
        };
        let Some(r) = self.child(NONE, first.0) else {
            return;
        };
        let set = self.runs[r as usize].mask;
        if self.rows.wide() {
            self.walk_wide(r, query, early_exit, out);
        } else {
            self.walk_word(r, 1, query, 0, set, early_exit, out, |run| run.mask);
        }
    }

    /// The walk of a wide index from run `r`, whose first block matched the query's first:
    /// over every mask word until the workers still matching are all in one.
    fn walk_wide(&self, mut r: RunId, query: &[LocalBlockHash], early_exit: bool, out: &mut OverlapScores) {
        let rows = &self.rows;
        let words = rows.mask_words();
        // Fleets of up to 1,024 worker slots keep the walk's worker set on the stack.
        let mut stack = [0u64; 16];
        let mut heap = Vec::new();
        let active: &mut [u64] = if words <= stack.len() {
            &mut stack[..words]
        } else {
            heap.resize(words, 0);
            &mut heap
        };
        for (w, word) in active.iter_mut().enumerate() {
            *word = rows.word(self.runs[r as usize].mask, w);
        }
        let mut depth = 1usize;
        loop {
            let mut live = active.iter().enumerate().filter(|&(_, &w)| w != 0);
            let Some((first, &word)) = live.next() else {
                return;
            };
            if live.next().is_none() {
                // One word of workers left (a long prompt past its shared prefix, the common
                // case): the walk reads only that word from here on.
                let mask = |run: &Run| rows.word(run.mask, first);
                self.walk_word(r, depth, query, first, word, early_exit, out, mask);
                return;
            }
            // Two words or more: at least two workers, so no early exit yet.
            let Some(c) = self.next_run(r, &mut depth, query) else {
                break;
            };
            let set = self.runs[c as usize].mask;
            for (w, word) in active.iter_mut().enumerate() {
                if *word == 0 {
                    continue;
                }
                let kept = *word & rows.word(set, w);
                self.emit(w, *word & !kept, depth as u32, out);
                *word = kept;
            }
            depth += 1;
            r = c;
        }
        for (w, &word) in active.iter().enumerate() {
            self.emit(w, word, depth as u32, out);
        }
    }

    /// A lookup's step from run `r`, whose first block is the query's block `depth - 1`:
    /// through the rest of the run, then to the child run holding the next block, its id.
    /// `None` where the walk ends (a block differs, or the query is done); `depth` counts the
    /// blocks matched.
    #[inline(always)]
    fn next_run(&self, r: RunId, depth: &mut usize, query: &[LocalBlockHash]) -> Option<RunId> {
        let run = self.runs[r as usize];
        let tail = &self.locals[run.start as usize + 1..run.end() as usize];
        let m = matching(tail, &query[*depth..], |q| q.0);
        *depth += m;
        if m < tail.len() || *depth == query.len() {
            return None;
        }
        self.child_of(Some(&run), run.last(), query[*depth].0)
    }

    /// The walk once every worker still matching is in mask word `word`: `active` are those
    /// workers, matched `depth` blocks deep, the last of them the first block of run `r`;
    /// `mask` reads a run's word `word`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, reason = "the walk's state, handed over mid-walk")]
    fn walk_word(
        &self,
        mut r: RunId,
        mut depth: usize,
        query: &[LocalBlockHash],
        word: usize,
        mut active: u64,
        early_exit: bool,
        out: &mut OverlapScores,
        mask: impl Fn(&Run) -> u64,
    ) {
        loop {
            if active == 0 {
                return;
            }
            if early_exit && active & (active - 1) == 0 {
                break;
            }
            let Some(c) = self.next_run(r, &mut depth, query) else {
                break;
            };
            let kept = active & mask(&self.runs[c as usize]);
            self.emit(word, active & !kept, depth as u32, out);
            active = kept;
            depth += 1;
            r = c;
        }
        self.emit(word, active, depth as u32, out);
    }

    /// Records `depth` for every worker whose bit is set in `bits`, mask word `word`.
    #[inline]
    fn emit(&self, word: usize, mut bits: u64, depth: u32, out: &mut OverlapScores) {
        while bits != 0 {
            let slot = word * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(s) = self.slots.at(slot) {
                out.push(s.key, depth);
            }
        }
    }

    /// Checks the layout's invariants, for tests: runs cover their blocks, children hang off
    /// last blocks and are found, counts match, no run is kept that nobody holds and that has no
    /// children, and every worker's map agrees with the runs' masks.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_tiers()?;
        let mut children = vec![0u32; self.runs.len()];
        let mut held_bits = 0usize;
        let mut live_blocks = 0usize;
        for (r, run) in self.runs.iter().enumerate() {
            if run.len == 0 {
                continue;
            }
            live_blocks += run.len as usize;
            for id in run.start..run.end() {
                if self.run_of[id as usize] != r as RunId {
                    return Err(format!(
                        "block {id} of run {r} maps to run {}",
                        self.run_of[id as usize]
                    ));
                }
            }
            if run.parent != NONE {
                let p = self.run_of[run.parent as usize];
                if p == NONE || self.runs[p as usize].last() != run.parent {
                    return Err(format!(
                        "run {r} hangs off block {}, not a live run's last",
                        run.parent
                    ));
                }
                children[p as usize] += 1;
            }
            if self.child(run.parent, self.locals[run.start as usize]) != Some(r as RunId) {
                return Err(format!("run {r} is not found as a child of block {}", run.parent));
            }
            if run.mask == 0 && run.children == 0 {
                return Err(format!(
                    "run {r} is held by nobody and has no children, but was kept"
                ));
            }
            if self.rows.wide() {
                self.rows.check(run.mask).map_err(|e| format!("run {r}: {e}"))?;
            }
            held_bits += run.len as usize * self.rows.set_len(run.mask);
        }
        for (r, run) in self.runs.iter().enumerate() {
            if run.len > 0 && run.children != children[r] {
                return Err(format!(
                    "run {r} counts {} children, has {}",
                    run.children, children[r]
                ));
            }
        }
        if live_blocks + self.free.len() != self.locals.len() {
            return Err(format!(
                "{live_blocks} live and {} free blocks in an arena of {}",
                self.free.len(),
                self.locals.len()
            ));
        }
        let mut entries = 0;
        for (slot, s) in self.slots.iter() {
            for (ext, id) in s.blocks.iter() {
                let r = self.run_of[id as usize];
                if r == NONE || !self.rows.set_has(self.runs[r as usize].mask, slot) {
                    return Err(format!(
                        "worker {} maps {ext:#x} to block {id}, which it does not hold",
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

    fn map(&self, slot: usize) -> &ExtMap {
        &self.slots.taken(slot).blocks
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::matching;

    proptest! {
        #[test]
        fn matching_counts_the_common_prefix(
            common in proptest::collection::vec(0u64..4, 0..40),
            a in proptest::collection::vec(0u64..4, 0..12),
            b in proptest::collection::vec(0u64..4, 0..12),
        ) {
            // Few distinct values, so the tails often agree for a while too.
            let locals: Vec<u64> = common.iter().chain(&a).copied().collect();
            let other: Vec<u64> = common.iter().chain(&b).copied().collect();
            let expected = locals.iter().zip(&other).take_while(|(l, o)| l == o).count();
            prop_assert_eq!(matching(&locals, &other, |&o| o), expected);
        }
    }
}
