//! The discrete-event loop: one virtual clock, one [`Router`] (or several replicas), N
//! [`Engine`]s.
//!
//! Sources of events, merged by time (ties: KV deliveries, then replica-sync deliveries, then
//! arrivals in workload order, then the heap in push order, then the routers' deadlines):
//!
//! * open-loop arrivals, a cursor over the workload sorted by arrival time;
//! * a heap keyed by `(time, time pushed, class, tie-break)`: engine step ends (class 1, ties
//!   broken by worker), session follow-ups, closed-loop arrivals, transfers and samples (class 0,
//!   ties broken in push order);
//! * the KV-event channel, a FIFO (its lag is constant, so delivery times never decrease);
//! * the replica-sync channel, a heap keyed by (delivery time, exporting replica, export
//!   sequence): each event goes to every other replica;
//! * each router's own deadline ([`Router::next_deadline`]), while requests are in flight (ties:
//!   the lowest replica first).
//!
//! **Replicas** ([`crate::Replicas`]): each arrival goes to one replica (in turn, or at random);
//! the request's first token, finish and cancellation go to that replica; KV events and fleet
//! changes go to every replica. After every input a replica takes, its exported sync events are
//! put on the sync channel (or lost, with the configured probability). One replica without sync
//! is exactly the single-router run: no draws, no events.
//!
//! An engine runs one forward pass at a time: a `Step` event at the pass's end delivers its
//! effects (tokens, first tokens, completions, KV events) and starts the next pass at once.
//!
//! Fast-forward ([`SimConfig::fast_forward`]): when an engine's next passes are pure decode
//! ([`Engine::decode_horizon`]: nothing allocated, cached, admitted or finished, so nothing the
//! router or another engine sees), the run computes their end times and pushes one `Step` event,
//! keyed as the last of them would have been, instead of one per pass. The skipped passes are
//! applied when that event comes, or earlier when something touches the engine (a request or
//! import sent to it, a transfer landing): then exactly the passes whose keys come before the
//! current event's are applied, the pass in flight is started as it was, and the stretch's event
//! is dropped. A step's key does not depend on the sequence number, so the order of events, and
//! every result, is the same with fast-forward on or off.
//!
//! A disaggregated request (the router's decision names a prefill worker) runs its prompt on
//! the prefill engine with an output of one token (a prefill-only vLLM instance: the first
//! token comes from there). When that finishes, the decode engine reserves blocks for the
//! prompt ([`Engine::import_request`]; if they are not free, the import waits, in order, until a
//! pass of the decode engine frees some), a `TransferDone` event fires after the link's
//! transfer time for the blocks it lacks, and the decode engine takes the prompt's KV as
//! computed ([`Engine::complete_import`]) and generates the rest. KV events a call outside a
//! pass returns are published after those of the decode engine's pass in flight, keeping the
//! engine's order.
//!
//! With a planner ([`SimConfig::planner`]), a `PlannerTick` event runs the planner at the times
//! it asks for (see `planned.rs`); an added worker's engine exists from the decision on and
//! joins the router at its `WorkerReady` event; a removed one drains (the router's
//! `handle_worker_draining`) and leaves the router (`handle_worker_removed`) once its engine is
//! idle and no request is on its way to it. Fast-forward is off then: the planner fits on every
//! pass.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Duration;

use kvroute_core::events::KvEvent;
use kvroute_core::ids::{DpRank, ExternalBlockHash, LocalBlockHash, RequestId, WorkerId, WorkerKey};
use kvroute_core::index::IndexEvent;
use kvroute_core::router::{
    Decision, Output, Prompt as RoutePrompt, Rng, RouteOutcome, RouteRequest, Router, RouterConfig,
    RouterError, RouterId, SyncEvent, SyncMode, WorkerRole, WorkerSpec,
};
use kvroute_core::time::Timestamp;
use kvroute_engine::{
    Engine, EngineHost, EnginePrompt, EngineRequest, ImportAdmission, ImportStart, StartedImport, StepOutput,
};
use kvroute_planner::{
    Action, EngineLimits, Observation, PassSample, Planner, Pool, WorkerObservation, WorkerState,
};

use crate::config::{ArrivalMode, ReplicaSync, SimConfig, Spread, Topology};
use crate::error::SimError;
use crate::planned::PlannerState;
use crate::report::{Outcome, TimeSeries};
use crate::workload::{Arrival, Workload};

/// Progress of a run, for a progress bar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Simulated time reached.
    pub now: Timestamp,
    /// Requests completed or turned away.
    pub done: usize,
    /// Requests in the workload.
    pub total: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(u32),
    /// Engine `.0`'s pass ends; valid while `.1` is the worker's generation.
    Step(u32, u32),
    /// A request's KV reached its decode worker.
    TransferDone(u32),
    Sample,
    /// The planner's next tick.
    PlannerTick,
    /// Worker `.0`, added by the planner, becomes routable.
    WorkerReady(u32),
}

/// A worker's life under a planner (always `Ready` without one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Life {
    Starting,
    Ready,
    Draining,
    Removed,
}

/// One request's state during a run.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReqState {
    pub(crate) arrived: Option<Timestamp>,
    pub(crate) routed: Option<Timestamp>,
    pub(crate) worker: Option<u32>,
    pub(crate) overlap_blocks: u32,
    pub(crate) first_token: Option<Timestamp>,
    pub(crate) last_token: Timestamp,
    pub(crate) finished: Option<Timestamp>,
    pub(crate) output_tokens: u32,
    pub(crate) rejected: bool,
    /// The prefill worker of a disaggregated request.
    pub(crate) prefill_worker: Option<u32>,
    /// Whether it runs on its prefill worker and will move to its decode worker after.
    pub(crate) in_prefill: bool,
    /// The worker computing its prompt, until its first token (the planner's queued prefill).
    pub(crate) queued_on: Option<u32>,
    /// The router replica that routed it.
    pub(crate) replica: u32,
    /// Whether it counts in its decode worker's in-flight requests (load imbalance).
    pub(crate) counted: bool,
}

impl ReqState {
    pub(crate) fn outcome(&self) -> Outcome {
        if self.finished.is_some() {
            Outcome::Completed
        } else if self.rejected {
            Outcome::Rejected
        } else {
            Outcome::Unfinished
        }
    }
}

/// A heap key: time, the time the event was pushed, class (0, or 1 for steps) and tie-break
/// (the push sequence number, or the worker for steps).
type Key = (Timestamp, Timestamp, u8, u64);

/// One simulated worker.
#[derive(Debug)]
pub(crate) struct SimWorker {
    key: WorkerKey,
    pub(crate) role: WorkerRole,
    /// Its engine, with the pass in flight and the imports (waiting, or on the link).
    host: EngineHost,
    /// Whether a `Step` event is pending.
    scheduled: bool,
    /// KV use after the last pass.
    kv_use: f32,
    /// Generation of the worker's valid `Step` event; a cut stretch leaves a stale one behind.
    generation: u32,
    /// The start of the pure-decode passes being skipped, if any ...
    stretch_start: Option<Timestamp>,
    /// ... and their end times.
    stretch_ends: Vec<Timestamp>,
    /// Its life under a planner.
    pub(crate) life: Life,
    pub(crate) provisioned_at: Timestamp,
    pub(crate) ready_at: Option<Timestamp>,
    pub(crate) draining_at: Option<Timestamp>,
    pub(crate) removed_at: Option<Timestamp>,
    /// Passes since the planner's last tick (only with a planner).
    passes: Vec<PassSample>,
    /// Prompt tokens of requests sent here that have no first token yet.
    queued_prefill_tokens: u64,
    /// Requests routed here (to decode) and not finished or turned away ...
    in_flight: u32,
    /// ... since this time ...
    in_flight_since: Timestamp,
    /// ... and their integral over time, request-nanoseconds (the load-imbalance figure).
    pub(crate) in_flight_area: u128,
}

impl SimWorker {
    /// Worker `i` of `role` with its engine, provisioned at `now`.
    fn new(config: &SimConfig, i: usize, role: WorkerRole, now: Timestamp) -> Result<Self, SimError> {
        let engine = Engine::new(kvroute_engine::EngineConfig {
            external_hash_seed: config.engine.external_hash_seed.wrapping_add(i as u64),
            ..config.engine.clone()
        })?;
        Ok(Self {
            key: WorkerKey::new(WorkerId(i as u64), DpRank(0)),
            role,
            host: EngineHost::new(engine, config.transfer),
            scheduled: false,
            kv_use: 0.0,
            generation: 0,
            stretch_start: None,
            stretch_ends: Vec::new(),
            life: Life::Ready,
            provisioned_at: now,
            ready_at: Some(now),
            draining_at: None,
            removed_at: None,
            passes: Vec::new(),
            queued_prefill_tokens: 0,
            in_flight: 0,
            in_flight_since: now,
            in_flight_area: 0,
        })
    }

    /// The router's description of this worker.
    fn spec(&self, config: &SimConfig) -> WorkerSpec {
        let mut spec = WorkerSpec::new(self.key, self.role, u64::from(config.engine.num_blocks));
        spec.max_batched_tokens = u64::from(config.engine.max_num_batched_tokens);
        spec.max_requests = u64::from(config.engine.max_num_seqs);
        spec
    }

    /// Adds `delta` (+1 or -1) to the requests in flight here at `now`.
    fn count_in_flight(&mut self, now: Timestamp, delta: i32) {
        let span = u128::from(now.as_nanos().saturating_sub(self.in_flight_since.as_nanos()));
        self.in_flight_area += span * u128::from(self.in_flight);
        self.in_flight_since = now;
        self.in_flight = self.in_flight.saturating_add_signed(delta);
    }

    /// Closes the in-flight integral at `end`.
    pub(crate) fn close_in_flight(&mut self, end: Timestamp) {
        self.count_in_flight(end, 0);
    }

    /// The planner's pool of this worker.
    pub(crate) fn pool(&self) -> Pool {
        match self.role {
            WorkerRole::Prefill => Pool::Prefill,
            WorkerRole::Decode => Pool::Decode,
            _ => Pool::Agg,
        }
    }
}

/// Totals a run accumulates; the report is computed from them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Totals {
    pub(crate) arrived: u64,
    pub(crate) completed: u64,
    pub(crate) rejected_by_router: u64,
    pub(crate) rejected_by_engine: u64,
    pub(crate) dropped_by_router: u64,
    pub(crate) steps: u64,
    pub(crate) busy_nanos: u64,
    pub(crate) prefill_busy_nanos: u64,
    pub(crate) kv_transfers: u64,
    pub(crate) kv_transfers_done: u64,
    pub(crate) kv_transfer_bytes: u64,
    pub(crate) kv_transfer_blocks: u64,
    pub(crate) kv_transfer_hit_blocks: u64,
    pub(crate) kv_transfer_nanos: u64,
    pub(crate) kv_import_waits: u64,
    pub(crate) kv_import_wait_nanos: u64,
    pub(crate) preemptions: u64,
    pub(crate) hit_tokens: u64,
    pub(crate) query_tokens: u64,
    pub(crate) kv_events_published: u64,
    pub(crate) kv_events_lost: u64,
    pub(crate) kv_events_refused: u64,
    pub(crate) stale_lifecycle_events: u64,
    pub(crate) sync_events_published: u64,
    pub(crate) sync_events_lost: u64,
    pub(crate) sync_events_refused: u64,
    pub(crate) end: Timestamp,
    pub(crate) itl: crate::stats::Sketch,
}

/// A replica-sync event on its way: delivery time, exporting replica, export sequence.
#[derive(Debug)]
struct InTransit {
    key: (Timestamp, u32, u64),
    event: SyncEvent,
}

impl PartialEq for InTransit {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for InTransit {}

impl PartialOrd for InTransit {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InTransit {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}

/// A run's state. Built by [`crate::Simulation::run`], consumed into a [`crate::RunResult`].
pub(crate) struct Run<'w> {
    config: &'w SimConfig,
    workload: &'w Workload,
    /// The router replicas (one without [`crate::Replicas`]).
    pub(crate) routers: Vec<Router>,
    /// Replica-sync events on their way.
    sync: BinaryHeap<Reverse<InTransit>>,
    sync_seq: u64,
    /// Draws of the replica spread and of sync loss (apart from the simulator's own, so that one
    /// router draws exactly as before).
    spread_rng: Rng,
    sync_rng: Rng,
    next_replica: usize,
    pub(crate) workers: Vec<SimWorker>,
    heap: BinaryHeap<Reverse<(Key, Event)>>,
    seq: u64,
    /// The key of the event being handled (open arrivals come before heap events at the same
    /// time, router ticks after).
    current: Key,
    open: Vec<u32>,
    open_next: usize,
    channel: VecDeque<(Timestamp, u32, KvEvent)>,
    /// The arriving request's prompt blocks, in one slice for the router.
    prompt: Vec<LocalBlockHash>,
    /// Removals of one pass that reach the index at the same moment, applied as one event.
    removed_batch: Vec<ExternalBlockHash>,
    followers: Vec<Vec<u32>>,
    closed_next: usize,
    rng: Rng,
    now: Timestamp,
    in_flight_requests: u64,
    pub(crate) reqs: Vec<ReqState>,
    pub(crate) totals: Totals,
    pub(crate) series: Option<TimeSeries>,
    window_hits: (u64, u64),
    /// Per replica: the deadline it was last ticked at.
    ticked_at: Vec<Option<Timestamp>>,
    /// Whether pure-decode stretches are skipped (off with a planner).
    fast_forward: bool,
    pub(crate) planner: Option<PlannerState>,
}

impl<'w> Run<'w> {
    pub(crate) fn new(config: &'w SimConfig, workload: &'w Workload) -> Result<Self, SimError> {
        let mut routers = (0..config.replicas.count)
            .map(|r| Router::new(replica_config(config, r)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut workers = Vec::with_capacity(config.workers());
        for i in 0..config.workers() {
            let role = match config.topology {
                Topology::Aggregated { .. } => WorkerRole::Aggregated,
                Topology::Disaggregated { prefill, .. } if i < prefill => WorkerRole::Prefill,
                Topology::Disaggregated { .. } => WorkerRole::Decode,
            };
            let worker = SimWorker::new(config, i, role, Timestamp::ZERO)?;
            for router in &mut routers {
                router.handle_worker_added(Timestamp::ZERO, worker.spec(config))?;
            }
            workers.push(worker);
        }
        let planner = match &config.planner {
            Some(setup) => {
                let e = &config.engine;
                let limits = EngineLimits {
                    max_num_batched_tokens: e.max_num_batched_tokens,
                    max_num_seqs: e.max_num_seqs,
                    kv_capacity_tokens: u64::from(e.num_blocks) * u64::from(e.block_size),
                };
                let planner = Planner::new(setup.config.clone(), limits, Timestamp::ZERO)?;
                let startup = Duration::try_from_secs_f64(setup.config.startup_delay_s)
                    .map_err(|e| SimError::Config(format!("startup delay: {e}")))?;
                Some(PlannerState::new(planner, startup))
            }
            None => None,
        };
        let n = workload.requests.len();
        let mut followers = Vec::new();
        let mut open = Vec::new();
        for (i, r) in workload.requests.iter().enumerate() {
            match r.arrival {
                Arrival::At(_) => open.push(i as u32),
                Arrival::After { request, .. } if request < i => {
                    if followers.is_empty() {
                        followers = vec![Vec::new(); n];
                    }
                    followers[request].push(i as u32);
                }
                Arrival::After { request, .. } => {
                    return Err(SimError::Workload(format!(
                        "request {i} follows request {request}, which is not earlier"
                    )));
                }
            }
        }
        open.sort_by_key(|&i| match workload.requests[i as usize].arrival {
            Arrival::At(t) => (t, i),
            Arrival::After { .. } => (Timestamp::ZERO, i),
        });
        let series = config.sample_interval.map(|_| TimeSeries {
            worker_requests: vec![Vec::new(); config.workers()],
            worker_kv_use: vec![Vec::new(); config.workers()],
            ..TimeSeries::default()
        });
        let replicas = routers.len();
        Ok(Self {
            config,
            workload,
            routers,
            sync: BinaryHeap::new(),
            sync_seq: 0,
            spread_rng: Rng::new(config.seed ^ 0x5EED_0000_0000_0001),
            sync_rng: Rng::new(config.seed ^ 0x5EED_0000_0000_0002),
            next_replica: 0,
            workers,
            heap: BinaryHeap::new(),
            seq: 0,
            current: (Timestamp::ZERO, Timestamp::ZERO, 0, 0),
            open,
            open_next: 0,
            channel: VecDeque::new(),
            prompt: Vec::new(),
            removed_batch: Vec::new(),
            followers,
            closed_next: 0,
            rng: Rng::new(config.seed),
            now: Timestamp::ZERO,
            in_flight_requests: 0,
            reqs: vec![ReqState::default(); n],
            totals: Totals::default(),
            series,
            window_hits: (0, 0),
            ticked_at: vec![None; replicas],
            fast_forward: config.fast_forward && planner.is_none(),
            planner,
        })
    }

    fn push(&mut self, at: Timestamp, event: Event) {
        self.push_from(at, self.now, event);
    }

    /// Pushes `event` at `at` as if pushed at `pushed`.
    fn push_from(&mut self, at: Timestamp, pushed: Timestamp, event: Event) {
        let key = match event {
            Event::Step(w, _) => (at, pushed, 1, u64::from(w)),
            _ => (at, pushed, 0, self.seq),
        };
        self.heap.push(Reverse((key, event)));
        self.seq += 1;
    }

    /// Whether `event` is a step a cut stretch left behind.
    fn stale(&self, event: Event) -> bool {
        matches!(event, Event::Step(w, g) if self.workers[w as usize].generation != g)
    }

    /// Runs to the end: until no event is left.
    pub(crate) fn run(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<(), SimError> {
        if let ArrivalMode::Closed { concurrency } = self.config.arrivals {
            self.open.clear();
            for _ in 0..concurrency {
                self.launch_next_closed(Timestamp::ZERO);
            }
        }
        if self.config.sample_interval.is_some() {
            self.push(Timestamp::ZERO, Event::Sample);
        }
        if let Some(p) = &self.planner {
            let at = p.planner.next_tick();
            self.push(at, Event::PlannerTick);
        }
        let mut handled: u64 = 0;
        loop {
            while let Some(&Reverse((_, event))) = self.heap.peek()
                && self.stale(event)
            {
                self.heap.pop();
            }
            let Some(source) = self.next_source() else {
                break;
            };
            let at = source.0;
            if at < self.now {
                return Err(SimError::ClockWentBack {
                    from: self.now,
                    to: at,
                });
            }
            self.now = at;
            self.current = match source.1 {
                Source::Channel | Source::Sync | Source::Open => (at, Timestamp::ZERO, 0, 0),
                Source::Heap => self.heap.peek().map_or((at, Timestamp::ZERO, 0, 0), |e| e.0.0),
                Source::Router(_) => (at, Timestamp(u64::MAX), u8::MAX, u64::MAX),
            };
            match source.1 {
                Source::Channel => self.deliver_kv()?,
                Source::Sync => self.deliver_sync()?,
                Source::Open => {
                    let i = self.open[self.open_next];
                    self.open_next += 1;
                    self.arrive(i as usize)?;
                }
                Source::Heap => {
                    if let Some(Reverse((_, event))) = self.heap.pop() {
                        match event {
                            Event::Arrive(i) => self.arrive(i as usize)?,
                            Event::Step(w, _) => self.step(w as usize)?,
                            Event::TransferDone(i) => self.transfer_done(i as usize)?,
                            Event::Sample => self.sample(),
                            Event::PlannerTick => self.planner_tick()?,
                            Event::WorkerReady(w) => self.worker_ready(w as usize)?,
                        }
                    }
                }
                Source::Router(r) => {
                    let r = r as usize;
                    self.ticked_at[r] = Some(at);
                    let outputs = self.routers[r].handle_tick(at);
                    self.route_outputs(outputs)?;
                    self.export_sync(r);
                }
            }
            handled += 1;
            if handled % (1 << 15) == 0 {
                progress(Progress {
                    now: self.now,
                    done: (self.totals.completed + self.rejected()) as usize,
                    total: self.workload.requests.len(),
                });
            }
        }
        self.totals.end = self.now;
        let end = self.now;
        for w in &mut self.workers {
            w.close_in_flight(end);
        }
        Ok(())
    }

    pub(crate) fn rejected(&self) -> u64 {
        self.totals.rejected_by_router + self.totals.rejected_by_engine
    }

    /// The earliest pending source, or `None` when the run is over.
    fn next_source(&self) -> Option<(Timestamp, Source)> {
        let mut best: Option<(Timestamp, Source)> = None;
        let mut consider = |t: Option<Timestamp>, s: Source| {
            if let Some(t) = t
                && best.is_none_or(|(b, _)| t < b)
            {
                best = Some((t, s));
            }
        };
        consider(self.channel.front().map(|e| e.0), Source::Channel);
        consider(self.sync.peek().map(|Reverse(e)| e.key.0), Source::Sync);
        consider(
            self.open
                .get(self.open_next)
                .map(|&i| match self.workload.requests[i as usize].arrival {
                    Arrival::At(t) => t,
                    Arrival::After { .. } => Timestamp::ZERO,
                }),
            Source::Open,
        );
        consider(self.heap.peek().map(|Reverse((k, _))| k.0), Source::Heap);
        if self.in_flight_requests > 0 {
            for (r, router) in self.routers.iter().enumerate() {
                let deadline = router.next_deadline().map(|t| t.max(self.now));
                // A tick that left its own deadline where it was waits for time to move on.
                consider(
                    deadline.filter(|&d| self.ticked_at[r] != Some(d)),
                    Source::Router(r as u32),
                );
            }
        }
        best
    }

    /// Request `i` arrives now.
    fn arrive(&mut self, i: usize) -> Result<(), SimError> {
        let r = &self.workload.requests[i];
        self.reqs[i].arrived = Some(self.now);
        self.totals.arrived += 1;
        if let Some(p) = &mut self.planner {
            p.traffic.requests += 1;
            p.traffic.isl_sum += f64::from(r.prompt_tokens);
        }
        self.in_flight_requests += 1;
        let replica = self.pick_replica();
        self.reqs[i].replica = replica as u32;
        let r = &self.workload.requests[i];
        r.locals.write_to(&mut self.prompt);
        let request = RouteRequest::new(
            RequestId(i as u64),
            RoutePrompt::Blocks {
                locals: &self.prompt,
                prompt_tokens: u64::from(r.prompt_tokens),
            },
        );
        match self.routers[replica].handle_request(self.now, &request)? {
            RouteOutcome::Routed(decision) => self.start(decision)?,
            RouteOutcome::Queued => {}
            RouteOutcome::Rejected(_) => {
                self.totals.rejected_by_router += 1;
                self.reqs[i].rejected = true;
                self.done(i);
            }
        }
        self.export_sync(replica);
        Ok(())
    }

    /// The replica the next arrival goes to.
    fn pick_replica(&mut self) -> usize {
        let n = self.routers.len();
        if n == 1 {
            return 0;
        }
        match self.config.replicas.spread {
            Spread::RoundRobin => {
                let r = self.next_replica;
                self.next_replica = (r + 1) % n;
                r
            }
            Spread::Random => self.spread_rng.below(n),
        }
    }

    /// Puts replica `r`'s exported sync events on the channel, or loses them.
    fn export_sync(&mut self, r: usize) {
        let ReplicaSync::On { delay, loss } = self.config.replicas.sync else {
            return;
        };
        while let Some(event) = self.routers[r].poll_sync_event() {
            self.totals.sync_events_published += 1;
            if loss > 0.0 && self.sync_rng.next_f64() < loss {
                self.totals.sync_events_lost += 1;
                continue;
            }
            let key = (self.now + delay, r as u32, self.sync_seq);
            self.sync_seq += 1;
            self.sync.push(Reverse(InTransit { key, event }));
        }
    }

    /// Delivers the next sync event to every replica but its sender (each ignores its own
    /// anyway), in replica order. A booking on a worker a replica no longer has is refused and
    /// counted.
    fn deliver_sync(&mut self) -> Result<(), SimError> {
        let Some(Reverse(InTransit { key, event })) = self.sync.pop() else {
            return Ok(());
        };
        for r in 0..self.routers.len() {
            if r == key.1 as usize {
                continue;
            }
            match self.routers[r].handle_sync_event(self.now, &event) {
                Ok(outputs) => self.route_outputs(outputs)?,
                Err(RouterError::UnknownWorker(_)) => self.totals.sync_events_refused += 1,
                Err(e) => return Err(e.into()),
            }
            self.export_sync(r);
        }
        Ok(())
    }

    /// Sends a routed request to its engine.
    fn start(&mut self, decision: Decision) -> Result<(), SimError> {
        let i = decision.request.0 as usize;
        let w = decision.worker.worker.0 as usize;
        let r = &self.workload.requests[i];
        let state = &mut self.reqs[i];
        state.routed = Some(self.now);
        state.worker = Some(w as u32);
        state.overlap_blocks = decision.overlap_blocks;
        state.counted = true;
        self.workers[w].count_in_flight(self.now, 1);
        let state = &mut self.reqs[i];
        if let Some(p) = &mut self.planner {
            // The hit rate that discounts prefill work is the one of the worker that prefills.
            let overlap = decision
                .prefill
                .map_or(decision.overlap_blocks, |a| a.overlap_blocks);
            let blocks = r.prompt_tokens / self.workload.block_size;
            if blocks > 0 {
                p.traffic.hit_sum += f64::from(overlap) / f64::from(blocks);
                p.traffic.hit_n += 1;
            }
        }
        let mut request = engine_request(decision.request, r);
        // A prefill-only instance samples the first token; a request of at most one token is
        // then complete there.
        let w = match decision.prefill {
            Some(p) => {
                let p = p.worker.worker.0 as usize;
                state.prefill_worker = Some(p as u32);
                state.in_prefill = r.output_tokens >= 2;
                request.output_len = request.output_len.min(1);
                p
            }
            None => w,
        };
        self.materialize(w)?;
        self.reqs[i].queued_on = Some(w as u32);
        self.workers[w].queued_prefill_tokens += u64::from(self.workload.requests[i].prompt_tokens);
        let worker = &mut self.workers[w];
        if worker.host.add(self.now, request).is_err() {
            return self.reject_in_engine(i);
        }
        self.wake(w);
        Ok(())
    }

    /// Request `i` was refused by an engine: turned away, and cancelled at the router.
    fn reject_in_engine(&mut self, i: usize) -> Result<(), SimError> {
        self.totals.rejected_by_engine += 1;
        self.unqueue(i);
        self.reqs[i].rejected = true;
        self.reqs[i].in_prefill = false;
        self.uncount(i);
        let r = self.reqs[i].replica as usize;
        let outputs = self.routers[r].handle_cancelled(self.now, RequestId(i as u64))?;
        self.export_sync(r);
        self.done(i);
        self.route_outputs(outputs)
    }

    /// Request `i` no longer counts in its decode worker's in-flight requests.
    fn uncount(&mut self, i: usize) {
        if std::mem::take(&mut self.reqs[i].counted)
            && let Some(w) = self.reqs[i].worker
        {
            self.workers[w as usize].count_in_flight(self.now, -1);
        }
    }

    /// Schedules a pass of engine `w` now unless one is pending.
    fn wake(&mut self, w: usize) {
        if !self.workers[w].scheduled {
            self.workers[w].scheduled = true;
            let generation = self.workers[w].generation;
            self.push(self.now, Event::Step(w as u32, generation));
        }
    }

    /// Disaggregated request `i` finished its prefill: its decode engine admits the import
    /// ([`EngineHost::import`]): the transfer starts, or it waits for blocks behind earlier
    /// imports, or it is turned away if it can never fit.
    fn begin_import(&mut self, i: usize) -> Result<(), SimError> {
        self.reqs[i].in_prefill = false;
        let w = self.reqs[i].worker.expect("a routed request has a worker") as usize;
        if self.workers[w].host.num_waiting_imports() == 0 {
            self.materialize(w)?;
        }
        let request = engine_request(RequestId(i as u64), &self.workload.requests[i]);
        match self.workers[w].host.import(self.now, request) {
            Ok(ImportAdmission::Started(import)) => self.import_started(w, import),
            Ok(ImportAdmission::Waiting) => {
                self.totals.kv_import_waits += 1;
                Ok(())
            }
            Err(_) => self.reject_in_engine(i),
        }
    }

    /// An import to engine `w` started: its KV lands after the transfer.
    fn import_started(&mut self, w: usize, import: StartedImport) -> Result<(), SimError> {
        let bs = self.config.engine.block_size;
        let t = &mut self.totals;
        t.kv_transfers += 1;
        t.kv_transfer_blocks += u64::from(import.transfer_blocks);
        t.kv_transfer_hit_blocks += u64::from(import.hit_blocks);
        t.kv_transfer_bytes += self.config.transfer.bytes(import.transfer_blocks, bs);
        t.kv_transfer_nanos += import.transfer_time.as_nanos() as u64;
        self.publish(w, import.events)?;
        self.push(import.lands, Event::TransferDone(import.id.0 as u32));
        Ok(())
    }

    /// Starts the waiting imports of engine `w` that fit now, in order.
    fn retry_imports(&mut self, w: usize) -> Result<(), SimError> {
        for start in self.workers[w].host.start_waiting_imports(self.now) {
            match start {
                ImportStart::Started(import) => {
                    let i = import.id.0 as usize;
                    self.import_started(w, import)?;
                    // The prefill's first token was the request's last event before the wait.
                    let since = self.reqs[i].last_token;
                    self.totals.kv_import_wait_nanos += self.now.saturating_since(since).as_nanos() as u64;
                }
                ImportStart::Refused(id, _) => self.reject_in_engine(id.0 as usize)?,
            }
        }
        Ok(())
    }

    /// Request `i`'s KV reached its decode engine.
    fn transfer_done(&mut self, i: usize) -> Result<(), SimError> {
        let w = self.reqs[i].worker.expect("a transferred request has a worker") as usize;
        self.materialize(w)?;
        let events = self.workers[w]
            .host
            .land(self.now, RequestId(i as u64))
            .map_err(|e| SimError::Invariant(format!("completing the transfer of {i}: {e}")))?;
        self.totals.kv_transfers_done += 1;
        self.publish(w, events)?;
        self.wake(w);
        Ok(())
    }

    /// Routes or records what the router reported.
    fn route_outputs(&mut self, outputs: Vec<Output>) -> Result<(), SimError> {
        for output in outputs {
            match output {
                Output::Routed(decision) => self.start(decision)?,
                Output::Dropped { .. } => self.totals.dropped_by_router += 1,
            }
        }
        Ok(())
    }

    /// Request `i` completed or was turned away: its followers and the closed loop move on.
    fn done(&mut self, i: usize) {
        self.in_flight_requests -= 1;
        if matches!(self.config.arrivals, ArrivalMode::Closed { .. }) {
            self.launch_next_closed(self.now);
            return;
        }
        if let Some(next) = self.followers.get(i) {
            for j in next.clone() {
                if let Arrival::After { delay, .. } = self.workload.requests[j as usize].arrival {
                    self.push(self.now + delay, Event::Arrive(j));
                }
            }
        }
    }

    fn launch_next_closed(&mut self, at: Timestamp) {
        if self.closed_next < self.workload.requests.len() {
            let i = self.closed_next as u32;
            self.closed_next += 1;
            self.push(at, Event::Arrive(i));
        }
    }

    /// Engine `w`'s pass ended (or it was idle and got work): deliver, then start the next pass.
    fn step(&mut self, w: usize) -> Result<(), SimError> {
        if let Some(start) = self.workers[w].stretch_start.take() {
            let passes = self.workers[w].stretch_ends.len();
            self.apply_stretch(w, start, passes);
        } else if let Some(out) = self.workers[w].host.finish_pass() {
            self.deliver_step(w, out)?;
        }
        self.retry_imports(w)?;
        if self.fast_forward && self.begin_stretch(w) {
            return Ok(());
        }
        let worker = &mut self.workers[w];
        match worker.host.step(self.now) {
            Some(end) => {
                let generation = worker.generation;
                self.push(end, Event::Step(w as u32, generation));
            }
            None => worker.scheduled = false,
        }
        if self.workers[w].life == Life::Draining {
            self.try_retire(w)?;
        }
        Ok(())
    }

    /// Skips engine `w`'s next passes if they are pure decode (see the module docs): pushes
    /// the event of the last of them. False if there are fewer than two.
    fn begin_stretch(&mut self, w: usize) -> bool {
        let now = self.now;
        let worker = &mut self.workers[w];
        if worker.host.num_waiting_imports() > 0 {
            return false;
        }
        let passes = worker.host.engine().decode_horizon();
        if passes < 2 {
            return false;
        }
        // The passes change no block, so the KV use they report is the current one; a value
        // not yet shown (blocks imported since the last pass) waits for a real pass.
        if kv_use(worker.host.engine().kv_blocks()).to_bits() != worker.kv_use.to_bits() {
            return false;
        }
        let ends = &mut worker.stretch_ends;
        ends.clear();
        worker.host.engine().decode_pass_ends(now, passes, ends);
        let (end, pushed) = (ends[ends.len() - 1], ends[ends.len() - 2]);
        worker.stretch_start = Some(now);
        let generation = worker.generation;
        self.push_from(end, pushed, Event::Step(w as u32, generation));
        true
    }

    /// Engine `w` is touched while the current event is handled: applies the skipped passes
    /// that end before it (their events' keys are smaller), starts the pass in flight as it was
    /// started, and replaces the stretch's event with that pass's.
    fn materialize(&mut self, w: usize) -> Result<(), SimError> {
        let Some(start) = self.workers[w].stretch_start.take() else {
            return Ok(());
        };
        let current = self.current;
        let ends = &self.workers[w].stretch_ends;
        let (mut done, mut last) = (0, start);
        while done < ends.len() && (ends[done], last, 1, w as u64) < current {
            last = ends[done];
            done += 1;
        }
        if done == ends.len() {
            return Err(SimError::Invariant(format!(
                "worker {w}: a skipped pass ended before the event touching it"
            )));
        }
        let next_end = ends[done];
        self.apply_stretch(w, start, done);
        let worker = &mut self.workers[w];
        worker
            .host
            .step(last)
            .filter(|&end| end == next_end)
            .ok_or_else(|| SimError::Invariant(format!("worker {w}: a skipped pass changed")))?;
        worker.generation += 1;
        let generation = worker.generation;
        self.push_from(next_end, last, Event::Step(w as u32, generation));
        Ok(())
    }

    /// Applies the first `passes` skipped passes of engine `w`'s stretch from `start`: the
    /// engine's progress, and what delivering each would have done (one token per running
    /// request and pass; no block, event, first token or completion).
    fn apply_stretch(&mut self, w: usize, start: Timestamp, passes: usize) {
        if passes == 0 {
            return;
        }
        let Self {
            workers,
            reqs,
            totals,
            ..
        } = self;
        let worker = &mut workers[w];
        let ends = &worker.stretch_ends[..passes];
        let end = ends[passes - 1];
        let last_start = if passes >= 2 { ends[passes - 2] } else { start };
        worker
            .host
            .engine_mut()
            .skip_decode_passes(passes as u32, last_start, end);
        debug_assert_eq!(worker.host.engine().check_invariants(), Ok(()));
        totals.steps += passes as u64;
        let busy = end.as_nanos() - start.as_nanos();
        totals.busy_nanos += busy;
        if worker.role == WorkerRole::Prefill {
            totals.prefill_busy_nanos += busy;
        }
        let mut with_first_token = 0;
        for id in worker.host.engine().running_requests() {
            let s = &mut reqs[id.0 as usize];
            if s.first_token.is_some() {
                totals.itl.add(ends[0].saturating_since(s.last_token));
                with_first_token += 1;
            }
            s.last_token = end;
            s.output_tokens += passes as u32;
        }
        // Equal gaps (the rule when the timing model ignores the context) are added at once.
        let mut run: Option<(Duration, u64)> = None;
        for pair in ends.windows(2) {
            let gap = pair[1].saturating_since(pair[0]);
            match &mut run {
                Some((d, k)) if *d == gap => *k += 1,
                _ => {
                    if let Some((d, k)) = run.replace((gap, 1)) {
                        totals.itl.add_n(d, k * with_first_token);
                    }
                }
            }
        }
        if let Some((d, k)) = run {
            totals.itl.add_n(d, k * with_first_token);
        }
    }

    /// A pass's effects, at its end.
    fn deliver_step(&mut self, w: usize, out: StepOutput) -> Result<(), SimError> {
        let now = self.now;
        let m = out.metrics;
        let t = &mut self.totals;
        t.steps += 1;
        t.busy_nanos += out.end.as_nanos() - out.start.as_nanos();
        if self.workers[w].role == WorkerRole::Prefill {
            t.prefill_busy_nanos += out.end.as_nanos() - out.start.as_nanos();
        }
        t.preemptions += u64::from(m.preemptions);
        t.hit_tokens += m.prefix_cache_hit_tokens;
        t.query_tokens += m.prefix_cache_query_tokens;
        self.window_hits.0 += m.prefix_cache_hit_tokens;
        self.window_hits.1 += m.prefix_cache_query_tokens;
        self.workers[w].kv_use = kv_use((m.active_blocks, m.total_blocks));
        if self.planner.is_some() {
            self.workers[w].passes.push(PassSample {
                prefill_tokens: m.pass.prefill_tokens,
                decode_seqs: m.pass.decode_seqs,
                kv_tokens: u64::from(m.pass.kv_active_blocks) * u64::from(self.config.engine.block_size),
                duration_s: m.duration.as_secs_f64(),
            });
        }
        self.publish(w, out.events)?;
        for e in &out.emitted {
            let s = &mut self.reqs[e.request.0 as usize];
            if s.first_token.is_some() {
                self.totals.itl.add(now.saturating_since(s.last_token));
            }
            s.last_token = now;
            s.output_tokens += e.tokens;
        }
        for &id in &out.first_token {
            self.reqs[id.0 as usize].first_token = Some(now);
            self.unqueue(id.0 as usize);
            if let Some(p) = &mut self.planner
                && let Some(arrived) = self.reqs[id.0 as usize].arrived
            {
                p.traffic.ttft_sum_ms += now.saturating_since(arrived).as_secs_f64() * 1e3;
                p.traffic.ttft_n += 1;
            }
            let r = self.reqs[id.0 as usize].replica as usize;
            let result = self.routers[r].handle_first_token(now, id);
            self.export_sync(r);
            let outputs = self.lifecycle(result)?;
            self.route_outputs(outputs)?;
        }
        for f in &out.finished {
            let i = f.request.0 as usize;
            if self.reqs[i].in_prefill {
                self.begin_import(i)?;
                continue;
            }
            self.reqs[i].finished = Some(now);
            self.totals.completed += 1;
            if let Some(p) = &mut self.planner {
                let s = &self.reqs[i];
                p.traffic.completed += 1;
                p.traffic.osl_sum += f64::from(s.output_tokens);
                if let Some(first) = s.first_token
                    && s.output_tokens > 1
                {
                    let span = s.last_token.saturating_since(first).as_secs_f64() * 1e3;
                    p.traffic.itl_sum_ms += span / f64::from(s.output_tokens - 1);
                    p.traffic.itl_n += 1;
                }
            }
            self.uncount(i);
            let r = self.reqs[i].replica as usize;
            let result = self.routers[r].handle_finished(now, f.request);
            self.export_sync(r);
            let outputs = self.lifecycle(result)?;
            self.done(i);
            self.route_outputs(outputs)?;
        }
        Ok(())
    }

    /// A lifecycle call's outputs; a request the router already dropped (TTL) is counted, not
    /// an error.
    fn lifecycle(&mut self, result: Result<Vec<Output>, RouterError>) -> Result<Vec<Output>, SimError> {
        match result {
            Ok(outputs) => Ok(outputs),
            Err(RouterError::UnknownRequest(_)) => {
                self.totals.stale_lifecycle_events += 1;
                Ok(Vec::new())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Puts a pass's KV events on the channel (or applies them at once without lag), dropping
    /// each with the configured probability.
    ///
    /// Without lag, a run of removals (an engine evicts one block per event, as vLLM does) goes
    /// to the index as one event: nothing can observe the index between them, the state after is
    /// the same, and a batch lets the index overlap its cache misses.
    fn publish(&mut self, w: usize, events: Vec<KvEvent>) -> Result<(), SimError> {
        let channel = self.config.events;
        for event in events {
            self.totals.kv_events_published += 1;
            if channel.loss > 0.0 && self.rng.next_f64() < channel.loss {
                self.totals.kv_events_lost += 1;
                continue;
            }
            if !channel.lag.is_zero() {
                self.channel.push_back((self.now + channel.lag, w as u32, event));
            } else if let KvEvent::Removed(removed) = &event {
                self.removed_batch.extend_from_slice(&removed.block_hashes);
            } else {
                self.flush_removed(w)?;
                self.apply_kv(w, event.as_index_event())?;
            }
        }
        self.flush_removed(w)
    }

    /// Applies the removals gathered by [`Self::publish`], if any.
    fn flush_removed(&mut self, w: usize) -> Result<(), SimError> {
        if self.removed_batch.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.removed_batch);
        let result = self.apply_kv(w, IndexEvent::Removed { blocks: &batch });
        self.removed_batch = batch;
        self.removed_batch.clear();
        result
    }

    fn deliver_kv(&mut self) -> Result<(), SimError> {
        if let Some((_, w, event)) = self.channel.pop_front() {
            self.apply_kv(w as usize, event.as_index_event())?;
        }
        Ok(())
    }

    /// Applies one KV event to every replica's index. Refusals (an event whose parent was lost)
    /// are counted, per replica: they are what a lossy channel does.
    fn apply_kv(&mut self, w: usize, event: IndexEvent<'_>) -> Result<(), SimError> {
        if self.workers[w].life == Life::Removed {
            if let Some(p) = &mut self.planner {
                p.late_kv_events += 1;
            }
            return Ok(());
        }
        let key = self.workers[w].key;
        for router in &mut self.routers {
            match router.handle_kv_event(self.now, key, event) {
                Ok(()) => {}
                Err(RouterError::Index(_)) => self.totals.kv_events_refused += 1,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Records one sample of the time series and schedules the next while work remains.
    fn sample(&mut self) {
        let Some(series) = &mut self.series else {
            return;
        };
        series.time_s.push(self.now.as_secs_f64());
        let mut waiting = 0;
        for (i, w) in self.workers.iter().enumerate() {
            let (running, queued) = (w.host.engine().num_running(), w.host.engine().num_waiting());
            waiting += queued as u32;
            series.worker_requests[i].push((running + queued) as u32);
            series.worker_kv_use[i].push(w.kv_use);
        }
        let router_queued: u32 = self.routers.iter().map(|r| r.metrics().queued_now as u32).sum();
        series.queued.push(waiting + router_queued);
        let (hits, queries) = std::mem::take(&mut self.window_hits);
        series.hit_rate.push(if queries == 0 {
            0.0
        } else {
            hits as f64 / queries as f64
        });
        if self.more_work()
            && let Some(interval) = self.config.sample_interval
        {
            self.push(self.now + interval, Event::Sample);
        }
    }

    /// Whether anything but samples and planner ticks is left to happen.
    fn more_work(&self) -> bool {
        self.in_flight_requests > 0
            || self.open_next < self.open.len()
            || self
                .heap
                .iter()
                .any(|&Reverse((_, e))| !matches!(e, Event::Sample | Event::PlannerTick) && !self.stale(e))
    }

    /// Request `i` no longer waits for its first token on the worker computing its prompt.
    fn unqueue(&mut self, i: usize) {
        if let Some(w) = self.reqs[i].queued_on.take() {
            let tokens = u64::from(self.workload.requests[i].prompt_tokens);
            let q = &mut self.workers[w as usize].queued_prefill_tokens;
            *q = q.saturating_sub(tokens);
        }
    }

    /// The planner's tick: observe, decide, act; then schedule the next while work remains.
    fn planner_tick(&mut self) -> Result<(), SimError> {
        let now = self.now;
        let Some(p) = &mut self.planner else {
            return Ok(());
        };
        let mut traffic = std::mem::take(&mut p.traffic);
        traffic.duration_s = now.saturating_since(p.last_tick).as_secs_f64();
        p.last_tick = now;
        let bs = u64::from(self.config.engine.block_size);
        let workers = self
            .workers
            .iter_mut()
            .enumerate()
            .filter(|(_, w)| w.life != Life::Removed)
            .map(|(i, w)| WorkerObservation {
                id: i as u64,
                pool: w.pool(),
                state: match w.life {
                    Life::Starting => WorkerState::Starting,
                    Life::Draining | Life::Removed => WorkerState::Draining,
                    Life::Ready => WorkerState::Ready,
                },
                passes: std::mem::take(&mut w.passes),
                queued_prefill_tokens: w.queued_prefill_tokens,
                decode_seqs: w.host.engine().num_running() as u32,
                kv_tokens: u64::from(w.host.engine().kv_blocks().0) * bs,
            })
            .collect();
        let out = p.planner.tick(now, &Observation { traffic, workers });
        p.ticks.push(out.record);
        if let Some(decision) = out.decision {
            let actions = decision.actions.clone();
            p.decisions.push(decision);
            for action in actions {
                match action {
                    Action::Add { pool } => self.add_worker(pool)?,
                    Action::Remove { worker, .. } => self.drain_worker(worker as usize)?,
                }
            }
        }
        if self.more_work()
            && let Some(p) = &self.planner
        {
            let at = p.planner.next_tick();
            self.push(at, Event::PlannerTick);
        }
        Ok(())
    }

    /// Provisions a worker of `pool`: its engine exists now, the router learns of it after the
    /// startup delay.
    fn add_worker(&mut self, pool: Pool) -> Result<(), SimError> {
        let role = match pool {
            Pool::Agg => WorkerRole::Aggregated,
            Pool::Prefill => WorkerRole::Prefill,
            Pool::Decode => WorkerRole::Decode,
        };
        let i = self.workers.len();
        let mut worker = SimWorker::new(self.config, i, role, self.now)?;
        worker.life = Life::Starting;
        worker.ready_at = None;
        self.workers.push(worker);
        if let Some(series) = &mut self.series {
            let n = series.time_s.len();
            series.worker_requests.push(vec![0; n]);
            series.worker_kv_use.push(vec![0.0; n]);
        }
        let delay = self.planner.as_ref().map_or(Duration::ZERO, |p| p.startup);
        self.push(self.now + delay, Event::WorkerReady(i as u32));
        Ok(())
    }

    /// Worker `w` finished starting: the router may route to it.
    fn worker_ready(&mut self, w: usize) -> Result<(), SimError> {
        let spec = self.workers[w].spec(self.config);
        self.workers[w].life = Life::Ready;
        self.workers[w].ready_at = Some(self.now);
        for r in 0..self.routers.len() {
            let outputs = self.routers[r].handle_worker_added(self.now, spec)?;
            self.route_outputs(outputs)?;
            self.export_sync(r);
        }
        Ok(())
    }

    /// Worker `w` takes no new requests and leaves when idle.
    fn drain_worker(&mut self, w: usize) -> Result<(), SimError> {
        if self.workers.get(w).is_none_or(|x| x.life != Life::Ready) {
            return Err(SimError::Invariant(format!(
                "the planner removed worker {w}, which is not ready"
            )));
        }
        for router in &mut self.routers {
            router.handle_worker_draining(self.now, self.workers[w].key)?;
        }
        self.workers[w].life = Life::Draining;
        self.workers[w].draining_at = Some(self.now);
        self.try_retire(w)
    }

    /// Removes draining worker `w` from the router if nothing runs or is headed there.
    fn try_retire(&mut self, w: usize) -> Result<(), SimError> {
        let worker = &self.workers[w];
        if !worker.host.is_idle() || worker.stretch_start.is_some() {
            return Ok(());
        }
        // A disaggregated request still prefilling elsewhere will import here.
        if worker.role == WorkerRole::Decode
            && self
                .reqs
                .iter()
                .any(|r| r.in_prefill && r.worker == Some(w as u32) && !r.rejected)
        {
            return Ok(());
        }
        self.workers[w].life = Life::Removed;
        self.workers[w].removed_at = Some(self.now);
        for r in 0..self.routers.len() {
            let outputs = self.routers[r].handle_worker_removed(self.now, self.workers[w].key)?;
            self.route_outputs(outputs)?;
            self.export_sync(r);
        }
        Ok(())
    }

    /// Checks the end-of-run invariants.
    pub(crate) fn check(&self) -> Result<(), SimError> {
        let fail = |what: String| Err(SimError::Invariant(what));
        let unfinished = self
            .reqs
            .iter()
            .filter(|r| r.arrived.is_some() && r.outcome() == Outcome::Unfinished)
            .count() as u64;
        if self.totals.arrived != self.totals.completed + self.rejected() + unfinished {
            return fail(format!(
                "arrived {} != completed {} + rejected {} + unfinished {unfinished}",
                self.totals.arrived,
                self.totals.completed,
                self.rejected()
            ));
        }
        for (i, r) in self.reqs.iter().enumerate() {
            let (Some(arrived), Some(finished)) = (r.arrived, r.finished) else {
                continue;
            };
            let first = r.first_token.unwrap_or(arrived);
            if !(arrived <= first
                && first <= finished
                && r.routed.is_some_and(|t| arrived <= t && t <= first))
            {
                return fail(format!(
                    "request {i}: arrival, routing, first token and finish out of order"
                ));
            }
        }
        if unfinished == 0 && self.totals.kv_transfers != self.totals.kv_transfers_done {
            return fail(format!(
                "{} transfers started, {} completed",
                self.totals.kv_transfers, self.totals.kv_transfers_done
            ));
        }
        // Without lost sync events (and none still on the way), every replica holds every
        // replica's bookings, so all must be gone; with losses, a replica keeps a peer's booking
        // whose Freed was lost (until the request TTL), so only its own must be gone.
        let sync_exact = self.totals.sync_events_lost == 0 && self.sync.is_empty();
        for (r, router) in self.routers.iter().enumerate() {
            let metrics = router.metrics();
            if metrics.counters.clock_went_back > 0 {
                return fail(format!(
                    "router replica {r} saw time go back {} times",
                    metrics.counters.clock_went_back
                ));
            }
            if unfinished == 0 {
                let own = router.sync_snapshot().len();
                if own != 0 || metrics.queued_now != 0 {
                    return fail(format!(
                        "router replica {r}: own load not drained: {own} events of bookings, {} queued",
                        metrics.queued_now
                    ));
                }
                if sync_exact || self.config.replicas.sync == ReplicaSync::Off {
                    if metrics.active_now != 0 {
                        return fail(format!(
                            "router replica {r}: load not drained: {} active",
                            metrics.active_now
                        ));
                    }
                    if let Some(w) = metrics.workers.iter().find(|w| !w.load.is_idle()) {
                        return fail(format!(
                            "router replica {r}: worker {} still has load booked: {:?}",
                            w.spec.key, w.load
                        ));
                    }
                }
            }
            router.check_invariants().map_err(SimError::Invariant)?;
        }
        for w in &self.workers {
            w.host
                .engine()
                .check_invariants()
                .map_err(|e| SimError::Invariant(format!("{}: {e}", w.key)))?;
            if w.life == Life::Removed {
                continue;
            }
            if self.config.events.loss == 0.0 && self.channel.is_empty() {
                let engine_blocks = w.host.engine().cached_blocks().count();
                for (r, router) in self.routers.iter().enumerate() {
                    let index_blocks = router.index().block_count(w.key);
                    if engine_blocks != index_blocks {
                        return fail(format!(
                            "{}: engine caches {engine_blocks} blocks, router replica {r}'s index {index_blocks}",
                            w.key
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The share of blocks in use, from `(active, total)`.
fn kv_use((active, total): (u32, u32)) -> f32 {
    if total == 0 {
        0.0
    } else {
        active as f32 / total as f32
    }
}

/// Workload request `r` as engine request `id`, with its whole output.
fn engine_request(id: RequestId, r: &crate::workload::SimRequest) -> EngineRequest {
    EngineRequest {
        id,
        prompt: EnginePrompt::Blocks {
            hashes: r.locals.to_vec(),
            len: r.prompt_tokens,
        },
        output_len: r.output_tokens,
        lora_name: None,
        cache_namespace: None,
        kv_report: kvroute_engine::KvReportMode::Incremental,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Channel,
    Sync,
    Open,
    Heap,
    Router(u32),
}

/// Replica `r`'s router configuration: the base one with router id `router_id + r`, seed
/// `seed + r`, replica rank `replica_rank + r`, and export on when replicas sync.
fn replica_config(config: &SimConfig, r: usize) -> RouterConfig {
    let base = &config.router;
    let mut c = base.clone();
    c.router_id = RouterId(base.router_id.0.wrapping_add(r as u64));
    c.seed = base.seed.wrapping_add(r as u64);
    c.replica_rank = base.replica_rank.wrapping_add(r as u32);
    if config.replicas.sync != ReplicaSync::Off {
        c.sync.mode = SyncMode::Export;
    }
    c
}
