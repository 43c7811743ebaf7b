//! The discrete-event loop: one virtual clock, one [`Router`] (or several replicas), N
//! [`Engine`](kvroute_engine::Engine)s.
//!
//! Sources of events, merged by time (ties: KV deliveries, then replica-sync deliveries, then
//! arrivals in workload order, then the heap in push order, then the routers' deadlines):
//!
//! * open-loop arrivals, the requests taken from the source (`intake.rs`) and not yet arrived,
//!   in order of (arrival time, id);
//! * a heap keyed by `(time, time pushed, class, tie-break)`: engine step ends (class 1, ties
//!   broken by worker), session follow-ups, closed-loop arrivals, transfers and samples (class 0,
//!   ties broken in push order);
//! * the KV-event channel, a FIFO (its lag is constant, so delivery times never decrease);
//! * the replica-sync bus, a heap of protocol messages keyed by (delivery time, sending replica,
//!   send sequence): each goes to every other replica that is up, or to the one addressed;
//! * each router's own deadline ([`Router::next_deadline`]), while requests are in flight (ties:
//!   the lowest replica first);
//! * each replica's protocol timeout (heartbeats, asks, peer loss), while work is left.
//!
//! **Replicas** ([`crate::Replicas`]): each arrival goes to one replica (in turn, or at random);
//! the request's first token, finish and cancellation go to that replica; KV events and fleet
//! changes go to every replica. After every input a replica takes, its exported sync events go
//! out as one numbered batch of its replica-sync protocol (`replicas.rs`), on the bus (or lost,
//! with the configured probability). A replica may start late (hearing nothing before, KV events
//! included) and one may die (saying nothing after). One replica without sync is exactly the
//! single-router run: no draws, no events.
//!
//! An engine runs one forward pass at a time: a `Step` event at the pass's end delivers its
//! effects (tokens, first tokens, completions, KV events) and starts the next pass at once.
//!
//! Fast-forward ([`SimConfig::fast_forward`]): when an engine's next passes only decode
//! ([`Engine::plan_decode_stretch`](kvroute_engine::Engine::plan_decode_stretch): every running
//! request decodes one token, only the last may finish some, nothing is admitted and the blocks
//! they allocate are free), the run computes their end times and pushes one `Step` event, keyed
//! as the pass it stands for would have been, for the first of them that allocates or completes
//! a block (its KV events are published when it ends, and the event of the next such pass is
//! pushed) or else for the last, whose finished requests are delivered when it ends. The skipped
//! passes are applied when that last event comes, or earlier when something touches the engine
//! (an import sent to it, a transfer landing): then exactly the passes whose keys come before
//! the current event's are applied, the pass in flight is started as it was, and the stretch's
//! event is dropped. In an aggregated fleet a request sent to it only cuts the stretch after the
//! pass in flight (the request waits for the next pass either way). A step's key does not
//! depend on the sequence number, so the order of events, and every result, is the same with
//! fast-forward on or off. A step retires the requests it finishes when its pass starts, so a
//! time-series sample inside a stretch's last pass counts its engine's running requests without
//! those that pass finishes.
//!
//! A disaggregated request (the router's decision names a prefill worker) runs its prompt on
//! the prefill engine with an output of one token (a prefill-only vLLM instance: the first
//! token comes from there). When that finishes, the decode engine reserves blocks for the
//! prompt ([`Engine::import_request`](kvroute_engine::Engine::import_request); if they are not free, the import waits, in order, until a
//! pass of the decode engine frees some), a `TransferDone` event fires after the link's
//! transfer time for the blocks it lacks, and the decode engine takes the prompt's KV as
//! computed ([`Engine::complete_import`](kvroute_engine::Engine::complete_import)) and generates the rest. KV events a call outside a
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
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::time::Duration;

use kvroute_core::events::KvEvent;
use kvroute_core::ids::{ExternalBlockHash, LocalBlockHash, RequestId};
use kvroute_core::router::replica::{Batcher, ReplicaProtocol};
use kvroute_core::router::{
    Output, Prompt as RoutePrompt, Rng, RouteOutcome, RouteRequest, Router, WorkerRole,
};
use kvroute_core::time::Timestamp;

use crate::config::{ArrivalMode, SimConfig, Topology};
use crate::error::SimError;
use crate::planned::PlannerState;
use crate::report::TimeSeries;
use crate::summary::Tally;
use crate::workload::{Arrival, RequestSource};

mod check;
mod engines;
mod fast_forward;
mod intake;
mod kv;
mod record;
mod replicas;
mod scaling;
mod worker;

use intake::Requests;
pub(crate) use record::{ReqState, Tokens, Totals};
pub(crate) use replicas::ReplicaLife;
use replicas::{InTransit, replica_batchers, replica_config, replica_protocols};
pub(crate) use worker::{Life, SimWorker};
use worker::{engine_request, kv_use};

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
    /// Replica `.0` starts late.
    ReplicaJoin(u32),
    /// Replica `.0` dies.
    ReplicaFail(u32),
    /// Request `.0` reaches its engine (HTTP latency).
    Deliver(u32),
    /// Request `.0`'s first token reaches its client and router (HTTP latency).
    FirstTokenSeen(u32),
    /// Request `.0`'s completion reaches its client and router (HTTP latency).
    FinishSeen(u32),
}

impl Event {
    /// Whether it is work of the run (not a sample or a planner tick, nor a step, which only runs
    /// while requests are in flight): the replicas' protocols keep time while work is left.
    fn is_work(self) -> bool {
        matches!(
            self,
            Event::Arrive(_)
                | Event::TransferDone(_)
                | Event::WorkerReady(_)
                | Event::ReplicaJoin(_)
                | Event::ReplicaFail(_)
                | Event::Deliver(_)
                | Event::FirstTokenSeen(_)
                | Event::FinishSeen(_)
        )
    }
}

/// A heap key: time, the time the event was pushed, class (0, or 1 for steps) and tie-break
/// (the push sequence number, or the worker for steps).
type Key = (Timestamp, Timestamp, u8, u64);

/// A run's state. Built by [`crate::Simulation::run`], consumed into a [`crate::RunResult`].
pub(crate) struct Run<'w> {
    config: &'w SimConfig,
    /// Where the requests come from, and whether it is read as the run goes
    /// ([`RequestSource::in_arrival_order`]) and is spent.
    source: Box<dyn RequestSource<'w> + 'w>,
    streaming: bool,
    source_done: bool,
    total_requests: usize,
    /// The router replicas (one without [`crate::Replicas`]).
    pub(crate) routers: Vec<Router>,
    /// Each replica's replica-sync protocol (none without sync).
    pub(crate) protocols: Vec<ReplicaProtocol>,
    /// Each replica's changes waiting for their batch (none without sync).
    pub(crate) batchers: Vec<Batcher<kvroute_core::router::SyncEvent>>,
    /// Each replica's life: waiting to start, up, dead.
    pub(crate) replica_life: Vec<ReplicaLife>,
    /// Work events on the heap ([`Event::is_work`]).
    work_events: u64,
    /// Replica-sync messages on their way.
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
    /// Requests taken with a fixed arrival, not yet arrived, by (time, id); the latest such
    /// time taken.
    open: VecDeque<(Timestamp, u32)>,
    latest_open: Option<Timestamp>,
    channel: VecDeque<(Timestamp, u32, KvEvent)>,
    /// The arriving request's prompt blocks, in one slice for the router.
    prompt: Vec<LocalBlockHash>,
    /// Removals of one pass that reach the index at the same moment, applied as one event.
    removed_batch: Vec<ExternalBlockHash>,
    /// The requests taken that follow a request, by the request they follow.
    followers: BTreeMap<u32, Vec<u32>>,
    rng: Rng,
    now: Timestamp,
    in_flight_requests: u64,
    pub(crate) reqs: Requests<'w>,
    /// What the report keeps of the requests released.
    pub(crate) tally: Tally,
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
    pub(crate) fn new(
        config: &'w SimConfig,
        source: Box<dyn RequestSource<'w> + 'w>,
    ) -> Result<Self, SimError> {
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
                let planner = crate::profile::planner(&setup.config, &config.engine, Timestamp::ZERO)?;
                let startup = Duration::try_from_secs_f64(setup.config.startup_delay_s)
                    .map_err(|e| SimError::Config(format!("startup delay: {e}")))?;
                let mut state = PlannerState::new(planner, startup, config.engine.block_size);
                state.observations = setup.keep_observations.then(Vec::new);
                state.observe = setup.observe;
                Some(state)
            }
            None => None,
        };
        let series = config.sample_interval.map(|_| TimeSeries {
            worker_requests: vec![Vec::new(); config.workers()],
            worker_kv_use: vec![Vec::new(); config.workers()],
            ..TimeSeries::default()
        });
        let replicas = routers.len();
        let mut replica_life = vec![ReplicaLife::Up; replicas];
        if config.replicas.join_at.is_some() {
            replica_life[replicas - 1] = ReplicaLife::Waiting;
        }
        let total_requests = source.len();
        Ok(Self {
            config,
            streaming: source.in_arrival_order(),
            source,
            source_done: false,
            total_requests,
            routers,
            protocols: replica_protocols(config),
            batchers: replica_batchers(config),
            replica_life,
            work_events: 0,
            sync: BinaryHeap::new(),
            sync_seq: 0,
            spread_rng: Rng::new(config.seed ^ 0x5EED_0000_0000_0001),
            sync_rng: Rng::new(config.seed ^ 0x5EED_0000_0000_0002),
            next_replica: 0,
            workers,
            heap: BinaryHeap::new(),
            seq: 0,
            current: (Timestamp::ZERO, Timestamp::ZERO, 0, 0),
            open: VecDeque::new(),
            latest_open: None,
            channel: VecDeque::new(),
            prompt: Vec::new(),
            removed_batch: Vec::new(),
            followers: BTreeMap::new(),
            rng: Rng::new(config.seed),
            now: Timestamp::ZERO,
            in_flight_requests: 0,
            reqs: Requests::new(),
            tally: Tally::new(config, total_requests),
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
        if event.is_work() {
            self.work_events += 1;
        }
    }

    /// Whether `event` is a step a cut stretch left behind.
    fn stale(&self, event: Event) -> bool {
        matches!(event, Event::Step(w, g) if self.workers[w as usize].generation != g)
    }

    /// Runs to the end: until no event is left.
    pub(crate) fn run(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<(), SimError> {
        if let ArrivalMode::Closed { concurrency } = self.config.arrivals {
            for _ in 0..concurrency {
                self.launch_next_closed(Timestamp::ZERO)?;
            }
        }
        if self.config.sample_interval.is_some() {
            self.push(Timestamp::ZERO, Event::Sample);
        }
        if let Some(p) = &self.planner {
            let at = p.planner.next_tick();
            self.push(at, Event::PlannerTick);
        }
        let n = self.routers.len();
        if let Some(at) = self.config.replicas.join_at {
            self.push(Timestamp::ZERO + at, Event::ReplicaJoin(n as u32 - 1));
        }
        if let Some(at) = self.config.replicas.fail_at {
            self.push(Timestamp::ZERO + at, Event::ReplicaFail(0));
        }
        for r in 0..n {
            if self.up(r) {
                self.replica_join(r)?;
            }
        }
        let mut handled: u64 = 0;
        loop {
            self.take_requests()?;
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
                Source::Router(_) | Source::Protocol(_) => (at, Timestamp(u64::MAX), u8::MAX, u64::MAX),
            };
            match source.1 {
                Source::Channel => self.deliver_kv()?,
                Source::Sync => self.deliver_sync()?,
                Source::Open => {
                    if let Some((_, i)) = self.open.pop_front() {
                        self.arrive(i as usize)?;
                    }
                }
                Source::Heap => {
                    if let Some(Reverse((_, event))) = self.heap.pop() {
                        if event.is_work() {
                            self.work_events -= 1;
                        }
                        match event {
                            Event::Arrive(i) => self.arrive(i as usize)?,
                            Event::Step(w, _) => self.step(w as usize)?,
                            Event::TransferDone(i) => self.transfer_done(i as usize)?,
                            Event::Sample => self.sample(),
                            Event::PlannerTick => self.planner_tick()?,
                            Event::WorkerReady(w) => self.worker_ready(w as usize)?,
                            Event::ReplicaJoin(r) => self.replica_join(r as usize)?,
                            Event::ReplicaFail(r) => self.replica_fail(r as usize),
                            Event::Deliver(i) => self.hand_to_engine(i as usize)?,
                            Event::FirstTokenSeen(i) => self.first_token_seen(i as usize)?,
                            Event::FinishSeen(i) => self.finish_seen(i as usize)?,
                        }
                    }
                }
                Source::Router(r) => {
                    let r = r as usize;
                    self.ticked_at[r] = Some(at);
                    let outputs = self.routers[r].handle_tick(at);
                    self.route_outputs(outputs)?;
                    self.export_sync(r)?;
                }
                Source::Protocol(r) => self.protocol_timeout(r as usize)?,
            }
            self.release_settled(false);
            handled += 1;
            if handled % (1 << 15) == 0 {
                progress(Progress {
                    now: self.now,
                    done: (self.totals.completed + self.rejected()) as usize,
                    total: self.total_requests,
                });
            }
        }
        self.release_settled(true);
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
        // The protocols keep time while work is left (not after: the run would not end), and
        // until the last batch is out.
        let work_left = self.in_flight_requests > 0 || !self.open.is_empty() || self.work_events > 0;
        let protocol = if work_left {
            self.next_protocol_timeout()
        } else {
            self.next_batch_due()
        };
        let mut best: Option<(Timestamp, Source)> = None;
        let mut consider = |t: Option<Timestamp>, s: Source| {
            if let Some(t) = t
                && best.is_none_or(|(b, _)| t < b)
            {
                best = Some((t, s));
            }
        };
        // A planner tick observes what happened before its instant, as a live tick does (a
        // request arriving at the same instant reaches a live proxy after it): it goes first.
        if let Some(Reverse((k, Event::PlannerTick))) = self.heap.peek() {
            consider(Some(k.0), Source::Heap);
        }
        consider(self.channel.front().map(|e| e.0), Source::Channel);
        consider(self.sync.peek().map(|Reverse(e)| e.key.0), Source::Sync);
        consider(self.open.front().map(|&(t, _)| t), Source::Open);
        consider(self.heap.peek().map(|Reverse((k, _))| k.0), Source::Heap);
        if self.in_flight_requests > 0 {
            for (r, router) in self.routers.iter().enumerate() {
                if !self.up(r) {
                    continue;
                }
                let deadline = router.next_deadline().map(|t| t.max(self.now));
                // A tick that left its own deadline where it was waits for time to move on.
                consider(
                    deadline.filter(|&d| self.ticked_at[r] != Some(d)),
                    Source::Router(r as u32),
                );
            }
        }
        if let Some((t, r)) = protocol {
            consider(Some(t), Source::Protocol(r as u32));
        }
        best
    }

    /// Request `i` arrives now.
    fn arrive(&mut self, i: usize) -> Result<(), SimError> {
        let prompt_tokens = self.reqs.request(i)?.prompt_tokens;
        self.reqs[i].arrived = Some(self.now);
        self.totals.arrived += 1;
        if let Some(p) = &mut self.planner {
            p.traffic.arrival(u64::from(prompt_tokens));
        }
        self.in_flight_requests += 1;
        let replica = self.pick_replica();
        self.reqs[i].replica = replica as u32;
        self.reqs.request(i)?.locals.write_to(&mut self.prompt);
        let request = RouteRequest::new(
            RequestId(i as u64),
            RoutePrompt::Blocks {
                locals: &self.prompt,
                prompt_tokens: u64::from(prompt_tokens),
            },
        );
        match self.routers[replica].handle_request(self.now, &request)? {
            RouteOutcome::Routed(decision) => self.start(decision)?,
            RouteOutcome::Queued => {}
            RouteOutcome::Rejected(_) => {
                self.totals.rejected_by_router += 1;
                self.reqs[i].rejected = true;
                self.done(i)?;
            }
        }
        self.export_sync(replica)?;
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
    fn done(&mut self, i: usize) -> Result<(), SimError> {
        self.in_flight_requests -= 1;
        if matches!(self.config.arrivals, ArrivalMode::Closed { .. }) {
            return self.launch_next_closed(self.now);
        }
        if let Some(next) = self.followers.get(&(i as u32)) {
            for j in next.clone() {
                if let Arrival::After { delay, .. } = self.reqs.request(j as usize)?.arrival {
                    self.push(self.now + delay, Event::Arrive(j));
                }
            }
        }
        Ok(())
    }

    /// Closed loop: the source's next request, if any, arrives at `at`.
    fn launch_next_closed(&mut self, at: Timestamp) -> Result<(), SimError> {
        if let Some(i) = self.take_one()? {
            self.push(at, Event::Arrive(i as u32));
        }
        Ok(())
    }

    /// Records one sample of the time series and schedules the next while work remains.
    fn sample(&mut self) {
        // Out while the fleet is read (`running_now` borrows the run), back before the next one.
        let Some(mut series) = self.series.take() else {
            return;
        };
        series.time_s.push(self.now.as_secs_f64());
        let mut waiting = 0;
        for (i, w) in self.workers.iter().enumerate() {
            let (running, queued) = (self.running_now(i), w.host.engine().num_waiting());
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
        self.series = Some(series);
        if self.more_work()
            && let Some(interval) = self.config.sample_interval
        {
            self.push(self.now + interval, Event::Sample);
        }
    }

    /// Whether anything but samples and planner ticks is left to happen.
    fn more_work(&self) -> bool {
        self.in_flight_requests > 0
            || !self.open.is_empty()
            || self
                .heap
                .iter()
                .any(|&Reverse((_, e))| !matches!(e, Event::Sample | Event::PlannerTick) && !self.stale(e))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Channel,
    Sync,
    Open,
    Heap,
    Router(u32),
    /// A replica's protocol timeout.
    Protocol(u32),
}
