//! The scheduler: which requests compute how many tokens in the next pass, modeled on vLLM v1.
//!
//! A step has a token budget (`max_num_batched_tokens`). [`Scheduler::schedule`] spends it in
//! vLLM's order:
//!
//! 1. **Running requests**, oldest first. Each gets `min(its uncomputed tokens, budget)`: one for
//!    a decoding request, a chunk for a prompt being prefilled. When its new blocks cannot be
//!    allocated, the newest running request is **preempted** (recompute mode: its blocks are
//!    freed, its progress reset, and it goes to the front of the waiting queue) until they can;
//!    if the request itself was the newest, scheduling of running requests stops.
//! 2. **Waiting requests**, in queue order, unless a request was preempted in this step, while
//!    fewer than `max_num_seqs` run. The longest cached prefix of full blocks is looked up (block
//!    by block, stopping at the first miss) and at most `len − 1` tokens are taken from the cache,
//!    so the last token is always computed. Without chunked prefill the rest must fit in the
//!    budget; if it does not, or its blocks cannot be allocated, admission stops (no request
//!    overtakes the head of the queue).
//!
//! Blocks are offered to the prefix cache as soon as the pass that computes them is scheduled,
//! as in vLLM, and [`Scheduler::commit`] then advances every scheduled request by its tokens:
//! a request whose known tokens are all computed samples its next token, and finishes once its
//! output is complete.

use std::collections::{BTreeSet, VecDeque};

use kvroute_core::ids::RequestId;
use kvroute_core::index::StoredBlock;

use crate::config::EngineConfig;
use kvroute_core::events::{BlocksStored, KvEvent};

use crate::cpu_tier::CpuTier;
use crate::kv_pool::{BlockId, BlockPool};
use crate::live::{Live, Running, Slot};
use crate::metrics::ForwardPass;
use crate::request::{Finished, KvReportMode, TokenEmission};
use crate::sequence::Sequence;
use kvroute_core::ids::ExternalBlockHash;

/// The part of the configuration the scheduler reads.
#[derive(Clone, Copy, Debug)]
struct Limits {
    block_size: u32,
    max_num_seqs: usize,
    max_num_batched_tokens: u32,
    chunked_prefill: bool,
    prefix_caching: bool,
}

/// One request's share of a pass.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Chunk {
    pub id: RequestId,
    /// Its slot among the live requests.
    pub slot: Slot,
    /// Tokens computed in the pass.
    pub new_tokens: u32,
    /// Tokens already in the cache before the pass.
    pub context: u32,
    /// Whether this is a decode (see [`ForwardPass`]).
    pub decode: bool,
}

/// What [`Scheduler::schedule`] decided for one pass.
#[derive(Debug, Default)]
pub(crate) struct Schedule {
    pub chunks: Vec<Chunk>,
    pub preempted: Vec<RequestId>,
    pub admitted: u32,
    pub hit_tokens: u64,
    pub query_tokens: u64,
    /// Blocks loaded from the CPU tier for the admitted requests.
    pub loaded_blocks: u32,
}

impl Schedule {
    /// The pass's composition, before the pool's occupancy is filled in.
    pub fn pass(&self) -> ForwardPass {
        let mut pass = ForwardPass::default();
        for chunk in &self.chunks {
            if chunk.decode {
                pass.add_decode(chunk.context);
            } else {
                pass.add_prefill(chunk.new_tokens, chunk.context);
            }
        }
        pass
    }
}

/// What one pass produced, as [`Scheduler::commit`] found it: tokens emitted, first tokens,
/// requests finished.
#[derive(Debug, Default)]
pub(crate) struct PassResults {
    pub emitted: Vec<TokenEmission>,
    pub first_token: Vec<RequestId>,
    pub finished: Vec<Finished>,
}

/// Queues, live requests and the block pool.
#[derive(Debug)]
pub(crate) struct Scheduler {
    limits: Limits,
    pub pool: BlockPool,
    /// Live requests (looked up several times per request and step).
    pub seqs: Live,
    pub waiting: VecDeque<RequestId>,
    /// Oldest first; preemption takes from the back.
    pub running: Running,
    /// Imported requests whose KV is in transfer (vLLM's `WAITING_FOR_REMOTE_KVS`): they hold
    /// blocks for their whole prompt and compute nothing.
    pub importing: BTreeSet<RequestId>,
    /// Imported requests whose KV has landed, waiting for a running slot, oldest first.
    pub imported: VecDeque<RequestId>,
    /// Reused buffer for cache hits.
    hits: Vec<BlockId>,
    /// The host-memory tier, if any.
    pub cpu: Option<CpuTier>,
    /// Reused buffer of hashes newly cached on the GPU, for the CPU tier.
    offloads: Vec<ExternalBlockHash>,
}

impl Scheduler {
    /// An empty scheduler over a fresh pool.
    pub fn new(config: &EngineConfig) -> Self {
        Self {
            limits: Limits {
                block_size: config.block_size,
                max_num_seqs: config.max_num_seqs as usize,
                max_num_batched_tokens: config.max_num_batched_tokens,
                chunked_prefill: config.enable_chunked_prefill,
                prefix_caching: config.enable_prefix_caching,
            },
            pool: BlockPool::new(config.num_blocks),
            seqs: Live::default(),
            waiting: VecDeque::new(),
            running: Running::default(),
            importing: BTreeSet::new(),
            imported: VecDeque::new(),
            hits: Vec::new(),
            cpu: config.cpu_offload.map(|c| CpuTier::new(c.num_blocks)),
            offloads: Vec::new(),
        }
    }

    /// Whether a pass would schedule something: a request runs or is imported, or the head of
    /// the waiting queue can be admitted (it always can when no transfer holds blocks).
    pub fn has_work(&self) -> bool {
        !self.running.is_empty()
            || !self.imported.is_empty()
            || self.waiting.front().is_some_and(|&id| {
                self.importing.is_empty()
                    || self
                        .plan(
                            &self.seqs[&id],
                            self.limits.max_num_batched_tokens,
                            &mut Vec::new(),
                        )
                        .is_some()
            })
    }

    /// Queues a new request at the back of the waiting queue.
    pub fn enqueue(&mut self, seq: Sequence) {
        self.waiting.push_back(seq.id);
        self.seqs.insert(seq);
    }

    /// Chooses the next pass (see the module docs).
    pub fn schedule(&mut self) -> Schedule {
        let mut budget = self.limits.max_num_batched_tokens;
        let mut schedule = Schedule::default();
        while self.running.len() < self.limits.max_num_seqs
            && let Some(id) = self.imported.pop_front()
        {
            let slot = self.seqs.slot(&id).expect("imported requests are live");
            self.running.push(id, slot);
        }
        self.schedule_running(&mut budget, &mut schedule);
        if schedule.preempted.is_empty() {
            self.schedule_waiting(&mut budget, &mut schedule);
        }
        schedule
    }

    fn schedule_running(&mut self, budget: &mut u32, schedule: &mut Schedule) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let (id, slot) = (self.running.ids()[i], self.running.slots()[i]);
            let seq = self.seqs.at(slot);
            let new_tokens = seq.remaining().min(*budget);
            let context = seq.num_computed;
            let decode = seq.outputs > 0 && seq.remaining() == 1;
            if !self.grow(slot, new_tokens, schedule) {
                break;
            }
            schedule.chunks.push(Chunk {
                id,
                slot,
                new_tokens,
                context,
                decode,
            });
            *budget -= new_tokens;
            i += 1;
        }
    }

    /// Allocates the blocks the running request at `slot` needs for `new_tokens` more tokens,
    /// preempting from the back of the running list until they fit. Returns false if it was
    /// preempted itself.
    fn grow(&mut self, slot: Slot, new_tokens: u32, schedule: &mut Schedule) -> bool {
        loop {
            let seq = self.seqs.at_mut(slot);
            let needed = (seq.num_computed + new_tokens).div_ceil(self.limits.block_size);
            let fresh = needed.saturating_sub(seq.blocks.len() as u32);
            if self.pool.allocate(fresh, &mut seq.blocks) {
                let tokens = seq.num_computed + new_tokens;
                // Most passes of a decoding request fill no block: nothing to offer then.
                if tokens / self.limits.block_size > seq.num_cached_blocks {
                    self.offer_full_blocks(slot, tokens);
                }
                return true;
            }
            let (victim, at) = self.running.pop().expect("the request is running");
            self.preempt(victim, at, schedule);
            if at == slot {
                return false;
            }
        }
    }

    /// Schedules the decode of one token of the running request at `slot` inside a stretch of
    /// passes whose blocks are known to fit ([`crate::Engine::plan_decode_stretch`]): its new
    /// block and the block it completes, with their events, as [`Scheduler::schedule`] would.
    pub fn grow_decode(&mut self, slot: Slot) {
        let mut unused = Schedule::default();
        let grown = self.grow(slot, 1, &mut unused);
        debug_assert!(grown && unused.preempted.is_empty(), "a planned block fits");
    }

    /// Frees the blocks of `id` (at `slot`), resets its progress and puts it at the front of
    /// the waiting queue.
    fn preempt(&mut self, id: RequestId, slot: Slot, schedule: &mut Schedule) {
        let seq = self.seqs.at_mut(slot);
        self.pool.release(&seq.blocks);
        seq.blocks.clear();
        seq.num_computed = 0;
        seq.num_cached_blocks = 0;
        self.waiting.push_front(id);
        schedule.preempted.push(id);
    }

    fn schedule_waiting(&mut self, budget: &mut u32, schedule: &mut Schedule) {
        while let Some(&id) = self.waiting.front() {
            if *budget == 0 || self.running.len() >= self.limits.max_num_seqs {
                break;
            }
            let slot = self.seqs.slot(&id).expect("waiting requests are live");
            let Some((chunk, loaded)) = self.admit(id, slot, *budget) else {
                break;
            };
            self.waiting.pop_front();
            self.running.push(id, slot);
            schedule.admitted += 1;
            schedule.loaded_blocks += loaded;
            schedule.hit_tokens += u64::from(chunk.context - loaded * self.limits.block_size);
            schedule.query_tokens += u64::from(self.seqs.at(slot).len());
            schedule.chunks.push(chunk);
            *budget -= chunk.new_tokens;
        }
    }

    /// Takes the cached prefix of waiting request `id` (at `slot`) and allocates its first chunk
    /// within `budget`, or changes nothing and returns `None` if it does not fit.
    fn admit(&mut self, id: RequestId, slot: Slot, budget: u32) -> Option<(Chunk, u32)> {
        let bs = self.limits.block_size;
        let mut hits = std::mem::take(&mut self.hits);
        hits.clear();
        let planned = self.plan(self.seqs.at(slot), budget, &mut hits);
        self.reannounce_hits(slot, &hits);
        let Some((new_tokens, fresh, loaded)) = planned else {
            self.hits = hits;
            return None;
        };
        let seq = self.seqs.at_mut(slot);
        // Blocks loaded from the CPU tier count as computed; they are cached on the GPU below
        // with the first chunk's blocks.
        let context = (hits.len() as u32 + loaded) * bs;
        if let Some(cpu) = &mut self.cpu {
            cpu.touch_all(&seq.externals[hits.len()..hits.len() + loaded as usize]);
        }
        let uncached = seq.len() - context;
        for &block in &hits {
            self.pool.claim(block);
        }
        seq.blocks.extend_from_slice(&hits);
        let allocated = self.pool.allocate(fresh, &mut seq.blocks);
        debug_assert!(allocated, "can_allocate said the blocks fit");
        seq.num_computed = context;
        seq.num_cached_blocks = hits.len() as u32;
        let decode = seq.outputs > 0 && uncached == 1;
        self.hits = hits;
        self.offer_full_blocks(slot, context + new_tokens);
        Some((
            Chunk {
                id,
                slot,
                new_tokens,
                context,
                decode,
            },
            loaded,
        ))
    }

    /// With [`KvReportMode::Full`], announces the prefix-cache hit `hits` of the request at
    /// `slot` again ([`reannouncement`]).
    fn reannounce_hits(&mut self, slot: Slot, hits: &[BlockId]) {
        if let Some(stored) = reannouncement(self.seqs.at(slot), hits.len(), self.limits.block_size) {
            self.pool.push_event(KvEvent::Stored(stored));
        }
    }

    /// Waiting request `seq`'s admission within `budget`: its cache hits (onto `hits`), the
    /// tokens of its first chunk, the fresh blocks they need and how many of those are loaded
    /// from the CPU tier (the blocks past the hits it holds in a row); `None` if it does not
    /// fit.
    fn plan(&self, seq: &Sequence, budget: u32, hits: &mut Vec<BlockId>) -> Option<(u32, u32, u32)> {
        let bs = self.limits.block_size;
        let mut loaded = 0;
        if self.limits.prefix_caching {
            // At most len − 1 tokens come from the cache: the last one is always computed.
            let max_hit_blocks =
                kvroute_core::router::max_cached_blocks(u64::from(seq.len()), u64::from(bs)) as usize;
            self.pool.lookup(&seq.externals, max_hit_blocks, hits);
            if let Some(cpu) = &self.cpu {
                let past = seq.externals.get(hits.len()..max_hit_blocks).unwrap_or_default();
                loaded = cpu.run(past) as u32;
            }
        }
        let context = (hits.len() as u32 + loaded) * bs;
        let uncached = seq.len() - context;
        if !self.limits.chunked_prefill && uncached > budget {
            return None;
        }
        let new_tokens = uncached.min(budget);
        let fresh = (context + new_tokens).div_ceil(bs) - hits.len() as u32;
        self.pool
            .can_allocate(fresh, hits)
            .then_some((new_tokens, fresh, loaded))
    }

    /// Reserves blocks for the whole prompt of `seq`, whose KV another engine computed and is
    /// about to transfer: its cached prefix of full blocks (no `len − 1` cap: nothing is
    /// computed) and fresh blocks for the rest. Returns the blocks hit and the fresh ones, or
    /// the blocks the prompt needs when they do not fit (changing nothing).
    pub fn reserve_import(&mut self, mut seq: Sequence) -> Result<(u32, u32), u32> {
        let bs = self.limits.block_size;
        let needed = seq.len().div_ceil(bs);
        let mut hits = std::mem::take(&mut self.hits);
        hits.clear();
        if self.limits.prefix_caching {
            self.pool
                .lookup(&seq.externals, (seq.len() / bs) as usize, &mut hits);
        }
        if let Some(stored) = reannouncement(&seq, hits.len(), bs) {
            self.pool.push_event(KvEvent::Stored(stored));
        }
        let fresh = needed - hits.len() as u32;
        if !self.pool.can_allocate(fresh, &hits) {
            self.hits = hits;
            return Err(needed);
        }
        for &block in &hits {
            self.pool.claim(block);
        }
        seq.blocks.extend_from_slice(&hits);
        let allocated = self.pool.allocate(fresh, &mut seq.blocks);
        debug_assert!(allocated, "can_allocate said the blocks fit");
        seq.num_cached_blocks = hits.len() as u32;
        let hit = hits.len() as u32;
        self.hits = hits;
        self.importing.insert(seq.id);
        self.seqs.insert(seq);
        Ok((hit, fresh))
    }

    /// The KV of importing request `id` landed: its prompt counts as computed, its full prompt
    /// blocks are offered to the cache (`stored` events), the first output token (sampled by the
    /// engine that prefilled it) is appended, and it waits for a running slot. False if `id`
    /// is not importing.
    pub fn complete_import(&mut self, id: RequestId) -> bool {
        if !self.importing.remove(&id) {
            return false;
        }
        let slot = self.seqs.slot(&id).expect("importing requests are live");
        let seq = self.seqs.at_mut(slot);
        let prompt = seq.len();
        seq.num_computed = prompt;
        self.offer_full_blocks(slot, prompt);
        self.seqs.at_mut(slot).push_output();
        self.imported.push_back(id);
        true
    }

    /// Offers the blocks of the request at `slot` that are full once `tokens` tokens have KV to
    /// the prefix cache, and records a [`BlocksStored`] event for every run of blocks newly
    /// cached. A block that is already cached is swapped for the cached copy (see
    /// [`BlockPool::cache`]).
    fn offer_full_blocks(&mut self, slot: Slot, tokens: u32) {
        if !self.limits.prefix_caching {
            return;
        }
        let Self {
            pool,
            seqs,
            limits,
            cpu,
            offloads,
            ..
        } = self;
        let seq = seqs.at_mut(slot);
        let full = (tokens / limits.block_size) as usize;
        let start = (seq.num_cached_blocks as usize).min(full);
        pool.warm(&seq.externals[start..full]);
        let mut run: Option<BlocksStored> = None;
        offloads.clear();
        for b in seq.num_cached_blocks as usize..full {
            if pool.cache(&mut seq.blocks[b], seq.externals[b]) {
                offloads.push(seq.externals[b]);
                let stored = run.get_or_insert_with(|| BlocksStored {
                    parent_block_hash: b.checked_sub(1).map(|p| seq.externals[p]),
                    blocks: Vec::with_capacity(full - b),
                    token_ids: Vec::new(),
                    block_size: limits.block_size,
                    lora_name: seq.lora_name.clone(),
                    cache_salt: seq.cache_salt.clone().filter(|_| b == 0),
                });
                stored.blocks.push(StoredBlock {
                    local: seq.locals[b],
                    external: seq.externals[b],
                });
                if seq.token_ids_known {
                    stored.token_ids.extend_from_slice(seq.block_tokens(b));
                }
            } else if let Some(stored) = run.take() {
                pool.push_event(KvEvent::Stored(stored));
            }
        }
        if let Some(stored) = run {
            pool.push_event(KvEvent::Stored(stored));
        }
        seq.num_cached_blocks = seq.num_cached_blocks.max(full as u32);
        if let Some(cpu) = cpu {
            cpu.offload(offloads, pool.events_mut());
        }
    }

    /// Advances every request of `schedule` by its tokens: samples the next token where all
    /// known tokens are computed, and retires finished requests, freeing their blocks.
    pub fn commit(&mut self, schedule: &Schedule) -> PassResults {
        let mut progress = PassResults::default();
        for chunk in &schedule.chunks {
            let seq = self.seqs.at_mut(chunk.slot);
            seq.num_computed += chunk.new_tokens;
            if seq.remaining() > 0 {
                continue; // a prefill chunk short of the end
            }
            if !seq.is_done() {
                seq.push_output();
                progress.emitted.push(TokenEmission {
                    request: chunk.id,
                    tokens: 1,
                });
                if seq.outputs == 1 {
                    progress.first_token.push(chunk.id);
                }
            }
            if seq.is_done() {
                progress.finished.push(seq.finished());
            }
        }
        if !progress.finished.is_empty() {
            self.retire(&progress.finished);
        }
        progress
    }

    /// Removes `finished` requests from the running list and frees their blocks.
    pub fn retire(&mut self, finished: &[Finished]) {
        for f in finished {
            if let Some(seq) = self.seqs.remove(&f.request) {
                self.pool.release(&seq.blocks);
            }
        }
        let seqs = &self.seqs;
        self.running.retain(|_, slot| seqs.holds(slot));
    }

    /// Drops live request `id` wherever it is (waiting, running, importing or imported) and
    /// frees its blocks; those already cached stay in the prefix cache, as in vLLM. False if
    /// `id` is not live.
    pub fn abort(&mut self, id: RequestId) -> bool {
        let Some(seq) = self.seqs.remove(&id) else {
            return false;
        };
        self.pool.release(&seq.blocks);
        self.waiting.retain(|&r| r != id);
        self.running.retain(|r, _| r != id);
        self.importing.remove(&id);
        self.imported.retain(|&r| r != id);
        true
    }

    /// How many live requests hold each block.
    pub fn holders(&self) -> Vec<u32> {
        let mut holders = vec![0u32; self.pool.total() as usize];
        for seq in self.seqs.values() {
            for &block in &seq.blocks {
                holders[block as usize] += 1;
            }
        }
        holders
    }
}

/// With [`KvReportMode::Full`], the announcement of `seq`'s prefix-cache hit of `hit_blocks`
/// leading blocks, again, as vLLM 0.32 makes it when it looks a request's prefix up
/// (`KVCacheManager.get_computed_blocks` → `BlockPool.emit_cached_block_events`): one `Stored`
/// of every hit block from the root (no parent: a hit is a prefix), with their tokens, whether
/// or not the request is then admitted. None for an empty hit or the default mode.
fn reannouncement(seq: &Sequence, hit_blocks: usize, block_size: u32) -> Option<BlocksStored> {
    if seq.kv_report != KvReportMode::Full || hit_blocks == 0 {
        return None;
    }
    let mut token_ids = Vec::new();
    if seq.token_ids_known {
        for b in 0..hit_blocks {
            token_ids.extend_from_slice(seq.block_tokens(b));
        }
    }
    Some(BlocksStored {
        parent_block_hash: None,
        blocks: (0..hit_blocks)
            .map(|b| StoredBlock {
                local: seq.locals[b],
                external: seq.externals[b],
            })
            .collect(),
        token_ids,
        block_size,
        lora_name: seq.lora_name.clone(),
        cache_salt: seq.cache_salt.clone(),
    })
}
