//! The engine: requests in, forward passes out, with time passed in.

use kvroute_core::ids::{ExternalBlockHash, RequestId};
use kvroute_core::time::{TimeScale, Timestamp};

use crate::config::{ConfigError, EngineConfig};
use crate::cpu_tier::CpuTier;
use crate::metrics::{ForwardPass, StepMetrics};
use crate::request::{EngineRequest, Finished, RequestError, TokenEmission};
use crate::scheduler::{PassResults, Schedule, Scheduler};
use crate::sequence::Sequence;
use crate::timing::{MIN_STEP, StepTimer};
use kvroute_core::events::KvEvent;
use std::time::Duration;

/// A simulated vLLM-like engine. See the crate docs.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    scheduler: Scheduler,
    timer: StepTimer,
    /// The mapping of modeled spans to the engine's time.
    scale: TimeScale,
    /// When the last forward pass ends.
    busy_until: Timestamp,
    /// The latest time passed in.
    clock: Timestamp,
    /// Passes run (stepped or skipped): the index of the next pass's jitter draw.
    passes: u64,
}

/// What one forward pass did. Its effects happen at `end`: a driver delivers the tokens and
/// publishes the events then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepOutput {
    /// When the pass started (the `now` it was run at).
    pub start: Timestamp,
    /// When it ends.
    pub end: Timestamp,
    /// Requests that produced tokens, in scheduling order.
    pub emitted: Vec<TokenEmission>,
    /// Requests whose first token this was.
    pub first_token: Vec<RequestId>,
    /// Requests that finished; their blocks are freed.
    pub finished: Vec<Finished>,
    /// Requests preempted: they lost their blocks and wait at the front of the queue to be
    /// recomputed.
    pub preempted: Vec<RequestId>,
    /// KV events of the step, in the order they happened.
    pub events: Vec<KvEvent>,
    /// Requests admitted in this pass (preempted ones readmitted included), each with the prompt
    /// tokens it found in the prefix cache: what vLLM reports as a request's
    /// `prompt_tokens_details.cached_tokens`.
    pub prefix_hits: Vec<(RequestId, u32)>,
    /// The step's metrics.
    pub metrics: StepMetrics,
}

/// A stretch of passes that decode every running request, planned by
/// [`Engine::plan_decode_stretch`] and run by the engine it was planned on: some allocate or
/// complete blocks (grows). Its buffers are reused from one stretch to the next.
#[derive(Debug, Default)]
pub struct DecodeStretch {
    /// The engine's pass count when planned.
    at: u64,
    /// Passes planned.
    passes: u32,
    /// The running requests' computed tokens, summed.
    context: u64,
    /// Per running request: the pure passes before its first new block and before its first
    /// completed block.
    marks: Vec<(u32, u32)>,
    /// The pass of each block allocated, in order.
    allocs: Vec<u32>,
    /// Grows by (pass, index in the running list), in order.
    grows: Vec<(u32, u32)>,
    /// Grows run.
    done: usize,
    /// Per running request: its passes applied to its state.
    synced: Vec<u32>,
    /// Scratch: the running requests (by index) whose first completed block may come before
    /// the horizon, to check for a shared chain.
    fills: Vec<u32>,
    /// Requests whose last token the last pass produces.
    finishing: u32,
}

impl DecodeStretch {
    /// The next pass (from 1) with a grow not yet run, if any: it may have KV events.
    pub fn next_grow(&self) -> Option<u32> {
        self.grows.get(self.done).map(|&(p, _)| p)
    }

    /// Passes planned (0 once finished).
    pub fn passes(&self) -> u32 {
        self.passes
    }

    /// Requests the last planned pass finishes (their last token): they run until it ends, as
    /// a step's finished requests leave when it starts (see [`Engine::finish_decode_stretch`]).
    pub fn finishing(&self) -> u32 {
        self.finishing
    }

    /// Plans only the first `k` passes (at least one, at most those planned; the grows of the
    /// others are dropped, and so are the requests the last planned pass would finish). The
    /// engine may then take requests ([`Engine::add_request`], not imports) before
    /// [`Engine::finish_decode_stretch`] ends the stretch after pass `k`: they wait for the
    /// pass after it, as behind a step.
    pub fn truncate(&mut self, k: u32) {
        debug_assert!(k >= 1 && k <= self.passes, "a stretch keeps some of its passes");
        if k < self.passes {
            self.passes = k;
            self.finishing = 0;
            self.grows.truncate(self.grows.partition_point(|&(p, _)| p <= k));
            self.allocs.truncate(self.allocs.partition_point(|&p| p <= k));
        }
    }

    fn clear(&mut self) {
        self.passes = 0;
        self.context = 0;
        self.marks.clear();
        self.allocs.clear();
        self.grows.clear();
        self.done = 0;
        self.synced.clear();
        self.fills.clear();
        self.finishing = 0;
    }
}

/// What the end of a [`DecodeStretch`] leaves to deliver ([`Engine::finish_decode_stretch`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StretchEnd {
    /// KV events of the grows not yet run ([`Engine::run_decode_stretch`]), in order.
    pub events: Vec<KvEvent>,
    /// Requests whose last token the last pass produced, in scheduling order, as
    /// [`StepOutput::finished`] reports them: they left the engine and their blocks are freed.
    pub finished: Vec<Finished>,
}

/// Applies `k` committed decode passes to `seq`: its computed tokens and its outputs.
fn advance(seq: &mut Sequence, k: u32) {
    if k > 0 {
        seq.num_computed += k;
        seq.push_outputs(k);
    }
}

/// What [`Engine::import_request`] reserved for a request whose KV is transferred in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Import {
    /// Prompt blocks found in this engine's prefix cache: they need no transfer.
    pub hit_blocks: u32,
    /// Prompt blocks reserved for the transfer (the last, partial block included): the blocks
    /// this engine lacks, whose bytes cross the link.
    pub transfer_blocks: u32,
    /// KV events of the reservation (blocks evicted to make room), in order with the engine's
    /// other events: publish them after those of any pass already returned.
    pub events: Vec<KvEvent>,
}

/// Why the prefix cache could not be reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResetError {
    /// Running requests hold blocks (vLLM refuses the reset then too).
    #[error("{active} KV blocks are held by running requests")]
    BlocksInUse {
        /// Blocks in use.
        active: u32,
    },
}

impl Engine {
    /// An idle engine with an empty cache, or why `config` is unusable.
    pub fn new(config: EngineConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let scale = config.time_scale()?;
        let timer = StepTimer::new(config.timing.build()?, scale, config.step_jitter);
        Ok(Self {
            scale,
            scheduler: Scheduler::new(&config),
            timer,
            config,
            busy_until: Timestamp::ZERO,
            clock: Timestamp::ZERO,
            passes: 0,
        })
    }

    /// The configuration the engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues `request`, arrived at `now`, behind the waiting requests; or rejects it, leaving
    /// the engine unchanged. It is scheduled at the next step.
    pub fn add_request(&mut self, now: Timestamp, request: EngineRequest) -> Result<(), RequestError> {
        if self.scheduler.seqs.contains_key(&request.id) {
            return Err(RequestError::DuplicateId(request.id));
        }
        let seq = Sequence::new(request, &self.config)?;
        self.clock = self.clock.max(now);
        self.scheduler.enqueue(seq);
        Ok(())
    }

    /// Takes in `request`, whose prompt another engine prefilled (its first output token
    /// included) and whose KV is about to be transferred here: reserves blocks for the whole
    /// prompt now, as vLLM's decode instance does for a request `WAITING_FOR_REMOTE_KVS`. Full
    /// prompt blocks already in this engine's prefix cache are hit and need no transfer. The
    /// request computes nothing until [`Engine::complete_import`].
    ///
    /// `request.output_len` is the whole output, the token already sampled by the prefilling
    /// engine included, so it must be at least 2. Rejected, leaving the engine unchanged, for
    /// the reasons of [`Engine::add_request`], [`RequestError::NothingToDecode`], or
    /// [`RequestError::NoBlocksForImport`] when the blocks are not free now (a driver may
    /// retry after a pass frees some).
    pub fn import_request(&mut self, now: Timestamp, request: EngineRequest) -> Result<Import, RequestError> {
        let id = request.id;
        if self.scheduler.seqs.contains_key(&id) {
            return Err(RequestError::DuplicateId(id));
        }
        let seq = Sequence::new(request, &self.config)?;
        if seq.max_output < 2 {
            return Err(RequestError::NothingToDecode(id));
        }
        match self.scheduler.reserve_import(seq) {
            Ok((hit_blocks, transfer_blocks)) => {
                self.clock = self.clock.max(now);
                Ok(Import {
                    hit_blocks,
                    transfer_blocks,
                    events: self.scheduler.pool.take_events(),
                })
            }
            Err(blocks_needed) => Err(RequestError::NoBlocksForImport {
                id,
                blocks_needed,
                blocks_free: self.scheduler.pool.total() - self.scheduler.pool.active(),
            }),
        }
    }

    /// Whether [`Engine::import_request`] could ever take `request`: `Ok` if it fits the empty
    /// cache and the engine's limits (it may still have to wait for free blocks), else why it
    /// never will. Changes nothing.
    pub fn check_import(&self, request: &EngineRequest) -> Result<(), RequestError> {
        if self.scheduler.seqs.contains_key(&request.id) {
            return Err(RequestError::DuplicateId(request.id));
        }
        if Sequence::admissible(request, &self.config)? < 2 {
            return Err(RequestError::NothingToDecode(request.id));
        }
        Ok(())
    }

    /// The KV of imported request `id` landed at `now`: its prompt counts as computed (no
    /// recompute), its full prompt blocks join the prefix cache, and it decodes from the next
    /// pass on (once a running slot is free), starting from the first token the prefilling
    /// engine sampled. Returns the `stored` events of the blocks newly cached, to publish after
    /// those of any pass already returned.
    pub fn complete_import(&mut self, now: Timestamp, id: RequestId) -> Result<Vec<KvEvent>, RequestError> {
        if !self.scheduler.complete_import(id) {
            return Err(RequestError::NotImporting(id));
        }
        self.clock = self.clock.max(now);
        Ok(self.scheduler.pool.take_events())
    }

    /// Aborts live request `id` (its client left): it leaves the engine at once, wherever it
    /// was, and its blocks are freed; blocks it cached stay cached (no KV event). A pass
    /// already returned keeps what it reported of the request. False if `id` is not live (it
    /// finished, or never came).
    pub fn abort_request(&mut self, id: RequestId) -> bool {
        self.scheduler.abort(id)
    }

    /// Requests whose KV is being transferred in ([`Engine::import_request`] without
    /// [`Engine::complete_import`] yet).
    pub fn num_importing(&self) -> usize {
        self.scheduler.importing.len()
    }

    /// When [`Engine::step`] should next be called: the end of the pass in flight, or, if it
    /// has ended, the latest time passed in (the engine is ready now). `None` when no request is
    /// waiting or running.
    pub fn next_wakeup(&self) -> Option<Timestamp> {
        self.scheduler.has_work().then(|| self.busy_until.max(self.clock))
    }

    /// Runs one forward pass starting at `now` and returns what it did.
    ///
    /// Returns `None`, changing nothing, when no request is waiting or running, or when the
    /// previous pass ends after `now` (the engine is busy; see [`Engine::next_wakeup`]).
    pub fn step(&mut self, now: Timestamp) -> Option<StepOutput> {
        if !self.scheduler.has_work() || now < self.busy_until {
            return None;
        }
        self.clock = self.clock.max(now);
        let schedule = self.scheduler.schedule();
        // A step may schedule nothing only by preempting: every running request, when the
        // blocks it needs are held by imports still in transfer (a pass of `MIN_STEP`).
        debug_assert!(
            !schedule.chunks.is_empty() || !schedule.preempted.is_empty(),
            "a step with work schedules at least one request or preempts"
        );
        let mut metrics = StepMetrics {
            pass: schedule.pass(),
            ..StepMetrics::default()
        };
        metrics.pass.kv_active_blocks = self.scheduler.pool.active();
        metrics.pass.kv_total_blocks = self.scheduler.pool.total();
        metrics.duration = if schedule.chunks.is_empty() {
            MIN_STEP
        } else {
            self.timer.duration(&metrics.pass, self.passes)
        };
        if schedule.loaded_blocks > 0
            && let Some(cpu) = &self.config.cpu_offload
        {
            // The admitted requests' blocks loaded from the CPU tier hold the pass up.
            let load = cpu.link.duration(schedule.loaded_blocks, self.config.block_size);
            metrics.duration += self.scale.modeled(load);
        }
        self.passes += 1;
        let end = now + metrics.duration;
        self.busy_until = end;
        let progress = self.scheduler.commit(&schedule);
        Some(self.output(now, end, schedule, progress, metrics))
    }

    /// Whether the next pass can only run the running requests, each with its whole share: some
    /// run, none waits or is imported, and the budget covers one token of each.
    fn only_running_decodes(&self) -> bool {
        let s = &self.scheduler;
        !s.running.is_empty()
            && s.waiting.is_empty()
            && s.imported.is_empty()
            && s.running.len() <= self.config.max_num_batched_tokens as usize
    }

    /// How many of the next passes are certain to decode one token of every running request
    /// and do nothing else the engine's state does not plan for: nothing waits to be admitted,
    /// the blocks they allocate are free (so none preempts), and only the last may produce a
    /// request's last token (the request then leaves at its end, as a step's would). These
    /// passes may allocate blocks and complete (cache) blocks, with KV events; `stretch` plans
    /// them, and the passes before [`DecodeStretch::next_grow`] change nothing but the running
    /// requests' progress. A driver may skip them
    /// ([`Engine::decode_stretch_ends`], [`Engine::run_decode_stretch`],
    /// [`Engine::finish_decode_stretch`]) as long as nothing else touches the engine meanwhile
    /// (but requests added to a stretch cut at the pass in flight, [`DecodeStretch::truncate`]).
    pub fn plan_decode_stretch(&self, stretch: &mut DecodeStretch) -> u32 {
        stretch.clear();
        let s = &self.scheduler;
        if !self.only_running_decodes() {
            return 0;
        }
        let (bs, caching) = (self.config.block_size, self.config.enable_prefix_caching);
        let mut horizon = u32::MAX;
        // The fewest passes to a request's last token, and the requests that many passes away.
        let (mut least, mut finishing) = (u32::MAX, 0);
        for (i, &slot) in s.running.slots().iter().enumerate() {
            let seq = s.seqs.at(slot);
            let Some(m) = seq.decode_marks(bs, caching) else {
                return 0;
            };
            // The pass of its last token decodes as the others do; the stretch ends with it.
            let last = m.finish + 1;
            if last < least {
                (least, finishing) = (last, 0);
            }
            finishing += u32::from(last == least);
            horizon = horizon.min(last);
            if m.fill < horizon {
                stretch.fills.push(i as u32);
            }
            stretch.context += u64::from(seq.num_computed);
            stretch.marks.push((m.alloc, m.fill));
        }
        // The block a request completes is cached as planned (its KV use unchanged) unless
        // another request holds a block of the same hash, whose chain of hashes is then this
        // request's: the block before it would be held by both. Checked only where it would
        // end the stretch sooner (a read of the block, a cache miss on a large fleet).
        for &i in &stretch.fills {
            let fill = stretch.marks[i as usize].1;
            if fill >= horizon {
                continue;
            }
            let seq = s.seqs.at(s.running.slots()[i as usize]);
            let b = seq.num_cached_blocks as usize;
            if b == 0 || s.pool.refs(seq.blocks[b - 1]) != 1 {
                horizon = fill;
                if horizon == 0 {
                    return 0;
                }
            }
        }
        // Every pass `a + 1 + j·bs` allocates a block for a request with mark `a`.
        let passes_from =
            |first: u32, last: u32| (u64::from(first) + 1..=u64::from(last)).step_by(bs as usize);
        for &(alloc, _) in &stretch.marks {
            stretch
                .allocs
                .extend(passes_from(alloc, horizon).map(|p| p as u32));
        }
        stretch.allocs.sort_unstable();
        let free = s.pool.free() as usize;
        if let Some(&first_short) = stretch.allocs.get(free) {
            horizon = first_short - 1;
            stretch.allocs.retain(|&p| p <= horizon);
        }
        for (i, &(alloc, fill)) in stretch.marks.iter().enumerate() {
            let i = i as u32;
            let grows = passes_from(alloc, horizon).chain(passes_from(fill, horizon));
            stretch.grows.extend(grows.map(|p| (p as u32, i)));
        }
        stretch.grows.sort_unstable();
        stretch.grows.dedup();
        stretch.synced.resize(s.running.len(), 0);
        stretch.at = self.passes;
        stretch.passes = horizon;
        stretch.finishing = if horizon == least { finishing } else { 0 };
        horizon
    }

    /// The end times of the passes of `stretch` ([`Engine::plan_decode_stretch`]), run back to
    /// back from `now`, onto `ends`. Changes nothing.
    pub fn decode_stretch_ends(&self, now: Timestamp, stretch: &DecodeStretch, ends: &mut Vec<Timestamp>) {
        debug_assert_eq!(stretch.at, self.passes, "a stretch planned at this pass");
        self.pass_ends(now, stretch.passes, stretch.context, &stretch.allocs, ends);
    }

    /// The end times of the next `k` passes, each decoding every running request (whose
    /// computed tokens sum to `base`), back to back from `now`, onto `ends`; pass `p` (from 1)
    /// allocates a block for each entry `p` of `allocs` (in order).
    fn pass_ends(&self, now: Timestamp, k: u32, base: u64, allocs: &[u32], ends: &mut Vec<Timestamp>) {
        let s = &self.scheduler;
        let n = s.running.len() as u64;
        let active = s.pool.active();
        let mut pass = ForwardPass {
            decode_seqs: n as u32,
            kv_active_blocks: active,
            kv_total_blocks: s.pool.total(),
            decode_context_tokens: base + n,
            ..ForwardPass::default()
        };
        ends.reserve(k as usize);
        let (constant, by_context) = (
            self.timer.constant_decode_passes(),
            self.timer.reads_decode_context(),
        );
        // While the blocks in use do not change: the passes' duration when constant, else
        // their modeled time when the model does not read the context.
        let refresh = |pass: &ForwardPass| match (constant, by_context) {
            (true, _) => (0.0, self.timer.duration(pass, self.passes)),
            (false, false) => (self.timer.pass_secs(pass), Duration::ZERO),
            (false, true) => (0.0, Duration::ZERO),
        };
        let (mut secs, mut d) = refresh(&pass);
        let mut allocated = 0;
        let mut t = now;
        for p in 1..=u64::from(k) {
            let before = allocated;
            while allocs.get(allocated).is_some_and(|&a| u64::from(a) == p) {
                allocated += 1;
            }
            if allocated != before {
                pass.kv_active_blocks = active + allocated as u32;
                (secs, d) = refresh(&pass);
            }
            let index = self.passes + p - 1;
            if constant {
                // Every pass takes as long as the first with these blocks in use.
                t = t + d;
            } else if !by_context {
                // One modeled time, jittered pass by pass: `t + jittered(..)`, without building
                // each `Duration`.
                t = Timestamp(t.0.saturating_add(self.timer.jittered_nanos(secs, index)));
            } else {
                pass.decode_context_tokens = base + n * p;
                t = t + self.timer.duration(&pass, index);
            }
            ends.push(t);
        }
    }

    /// Runs the grows of `stretch`'s passes up to pass `p` (from 1) not yet run: the blocks
    /// allocated and completed then, as [`Engine::step`] would. Returns their KV events, in
    /// order: those of pass `p` when the driver calls this at each pass
    /// [`DecodeStretch::next_grow`] names, to publish when that pass ends.
    pub fn run_decode_stretch(&mut self, stretch: &mut DecodeStretch, p: u32) -> Vec<KvEvent> {
        debug_assert_eq!(stretch.at, self.passes, "a stretch planned at this pass");
        let s = &mut self.scheduler;
        while let Some(&(q, i)) = stretch.grows.get(stretch.done)
            && q <= p
        {
            let slot = s.running.slots()[i as usize];
            let seq = s.seqs.at_mut(slot);
            // The request's passes before `q`; pass `q` itself is scheduled here and
            // committed with the passes after it.
            advance(seq, q - 1 - stretch.synced[i as usize]);
            stretch.synced[i as usize] = q - 1;
            s.grow_decode(slot);
            stretch.done += 1;
        }
        s.pool.take_events()
    }

    /// Ends `stretch` after its first `k` passes, the last of them started at `last_start` and
    /// ending at `end`: the engine is then as `k` calls of [`Engine::step`] leave it. Returns
    /// what those calls would have reported and the stretch's own passes have not: the KV events
    /// of the grows not yet run and the requests the last pass finished (only when it is the
    /// stretch's last).
    pub fn finish_decode_stretch(
        &mut self,
        stretch: &mut DecodeStretch,
        k: u32,
        last_start: Timestamp,
        end: Timestamp,
    ) -> StretchEnd {
        debug_assert!(k <= stretch.passes, "only planned passes are run");
        let events = self.run_decode_stretch(stretch, k);
        let mut finished = Vec::new();
        if k > 0 {
            let s = &mut self.scheduler;
            for (&slot, &synced) in s.running.slots().iter().zip(&stretch.synced) {
                let seq = s.seqs.at_mut(slot);
                advance(seq, k - synced);
                if seq.is_done() {
                    finished.push(seq.finished());
                }
            }
            if !finished.is_empty() {
                s.retire(&finished);
            }
            self.clock = self.clock.max(last_start);
            self.busy_until = end;
            self.passes += u64::from(k);
        }
        stretch.clear();
        StretchEnd { events, finished }
    }

    /// KV blocks in use and in all.
    pub fn kv_blocks(&self) -> (u32, u32) {
        (self.scheduler.pool.active(), self.scheduler.pool.total())
    }

    /// The running requests, in scheduling order.
    pub fn running_requests(&self) -> &[RequestId] {
        self.scheduler.running.ids()
    }

    /// Assembles a step's output, filling in the load after the step.
    fn output(
        &mut self,
        start: Timestamp,
        end: Timestamp,
        schedule: Schedule,
        progress: PassResults,
        mut metrics: StepMetrics,
    ) -> StepOutput {
        let s = &self.scheduler;
        metrics.active_blocks = s.pool.active();
        metrics.total_blocks = s.pool.total();
        metrics.cached_blocks = s.pool.cached();
        metrics.running = s.running.len() as u32;
        metrics.waiting = s.waiting.len() as u32;
        metrics.preemptions = schedule.preempted.len() as u32;
        metrics.admitted = schedule.admitted;
        metrics.prefix_cache_hit_tokens = schedule.hit_tokens;
        metrics.prefix_cache_query_tokens = schedule.query_tokens;
        // Admissions are scheduled after the running requests: the last `admitted` chunks.
        let admissions = schedule.chunks.len().saturating_sub(schedule.admitted as usize);
        let prefix_hits = schedule.chunks[admissions..]
            .iter()
            .map(|chunk| (chunk.id, chunk.context))
            .collect();
        StepOutput {
            start,
            end,
            emitted: progress.emitted,
            first_token: progress.first_token,
            finished: progress.finished,
            preempted: schedule.preempted,
            events: self.scheduler.pool.take_events(),
            prefix_hits,
            metrics,
        }
    }

    /// Forgets every cached block, as vLLM's `reset_prefix_cache`, and returns the
    /// `AllCleared` event to publish (none when prefix caching is off). Refused while running
    /// requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> Result<Option<KvEvent>, ResetError> {
        let pool = &mut self.scheduler.pool;
        if !pool.reset() {
            return Err(ResetError::BlocksInUse {
                active: pool.active(),
            });
        }
        let cleared = pool.take_events();
        if let Some(cpu) = &mut self.scheduler.cpu {
            cpu.clear();
        }
        Ok(cleared
            .into_iter()
            .next()
            .filter(|_| self.config.enable_prefix_caching))
    }

    /// The external hashes of every block in the prefix cache (in use or free), in hash order.
    /// After applying all of the engine's events, a router's index holds exactly these.
    pub fn cached_blocks(&self) -> impl Iterator<Item = ExternalBlockHash> + '_ {
        self.scheduler.pool.cached_hashes()
    }

    /// The external hashes of every block on the CPU tier, in hash order (none without one).
    pub fn cpu_blocks(&self) -> Vec<ExternalBlockHash> {
        self.scheduler
            .cpu
            .as_ref()
            .map(CpuTier::hashes)
            .unwrap_or_default()
    }

    /// Blocks in the prefix cache (in use or free): the number [`Engine::cached_blocks`] yields,
    /// without listing or sorting them.
    pub fn num_cached_blocks(&self) -> usize {
        self.scheduler.pool.cached() as usize
    }

    /// Requests running (holding blocks).
    pub fn num_running(&self) -> usize {
        self.scheduler.running.len()
    }

    /// Requests waiting, preempted ones included, and imported ones waiting for a running slot.
    pub fn num_waiting(&self) -> usize {
        self.scheduler.waiting.len() + self.scheduler.imported.len()
    }

    /// Checks the engine's invariants, for tests and debug runs: every block's reference count
    /// equals the number of requests holding it, in use + free = total, the free list and the
    /// cache map are consistent, every live request is in exactly one queue, running requests
    /// (and imported ones waiting for a slot) hold exactly the blocks their computed tokens need
    /// (and, with prefix caching, their full blocks are the cached copies), importing ones hold
    /// blocks for their whole prompt and waiting ones hold none. Returns the first violation
    /// found.
    pub fn check_invariants(&self) -> Result<(), String> {
        let s = &self.scheduler;
        s.pool.check_invariants(&s.holders())?;
        if let Some(cpu) = &s.cpu {
            cpu.check_invariants()?;
        }
        if s.running.len() > self.config.max_num_seqs as usize {
            return Err(format!(
                "{} running, max_num_seqs {}",
                s.running.len(),
                self.config.max_num_seqs
            ));
        }
        let queued = s.running.len() + s.waiting.len() + s.importing.len() + s.imported.len();
        if queued != s.seqs.len() {
            return Err(format!(
                "{} running + {} waiting + {} importing + {} imported != {} live requests",
                s.running.len(),
                s.waiting.len(),
                s.importing.len(),
                s.imported.len(),
                s.seqs.len()
            ));
        }
        for id in &s.importing {
            let seq = s
                .seqs
                .get(id)
                .ok_or_else(|| format!("importing {id:?} is not live"))?;
            let needed = seq.len().div_ceil(self.config.block_size) as usize;
            if seq.blocks.len() != needed || seq.num_computed != 0 || seq.outputs != 0 {
                return Err(format!(
                    "importing {id:?} holds {} blocks for a prompt of {} tokens",
                    seq.blocks.len(),
                    seq.len()
                ));
            }
        }
        for (id, &slot) in s.running.ids().iter().zip(s.running.slots()) {
            if s.seqs.slot(id) != Some(slot) {
                return Err(format!("running {id:?} is not live at its slot"));
            }
        }
        for id in s.running.ids().iter().chain(&s.imported) {
            let seq = s
                .seqs
                .get(id)
                .ok_or_else(|| format!("running {id:?} is not live"))?;
            let needed = seq.num_computed.div_ceil(self.config.block_size) as usize;
            if seq.blocks.len() != needed {
                return Err(format!(
                    "{id:?} holds {} blocks for {} tokens",
                    seq.blocks.len(),
                    seq.num_computed
                ));
            }
            if !self.config.enable_prefix_caching {
                continue;
            }
            let cached = &seq.blocks[..seq.num_cached_blocks as usize];
            if let Some(b) = cached
                .iter()
                .zip(&seq.externals)
                .position(|(&b, &h)| s.pool.hash_of(b) != Some(h))
            {
                return Err(format!(
                    "block {b} of {id:?} is full but not the cached copy of its hash"
                ));
            }
        }
        for id in &s.waiting {
            let seq = s
                .seqs
                .get(id)
                .ok_or_else(|| format!("waiting {id:?} is not live"))?;
            if !seq.blocks.is_empty() || seq.num_computed != 0 {
                return Err(format!("waiting {id:?} holds {} blocks", seq.blocks.len()));
            }
        }
        Ok(())
    }
}
