//! A simulation's configuration: the fleet, the engines, the router, the KV-event channel and
//! the arrival mode. Validated once, by [`crate::Simulation::new`].

use std::time::Duration;

use kvroute_core::router::RouterConfig;
use kvroute_core::router::replica::BatchConfig;
use kvroute_engine::{Dispersion, EngineConfig, KvTransfer};

/// How requests enter the simulation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ArrivalMode {
    /// At the workload's arrival times (session turns after their predecessor).
    #[default]
    Open,
    /// Closed loop: at most this many requests in flight; the next one (in workload order)
    /// arrives when one completes or is turned away. Arrival times are ignored.
    Closed {
        /// Requests in flight.
        concurrency: usize,
    },
}

/// The channel that carries engines' KV events to the router.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EventChannel {
    /// Delay between a forward pass's end and its KV events reaching the router's index.
    pub lag: Duration,
    /// Probability in `[0, 1]` that an event is lost (drawn from the simulation's seed).
    pub loss: f64,
}

/// Several router replicas over one fleet ([`SimConfig::replicas`]).
///
/// Each replica is its own [`kvroute_core::router::Router`] (the same configuration, router id
/// `router_id + r`, seed `seed + r` and replica rank `replica_rank + r`) with its own index, fed every engine's KV events (each
/// replica subscribes to every engine). Client requests are spread over the replicas; a request's
/// lifecycle (first token, finish) goes to the replica that routed it; fleet changes reach all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Replicas {
    /// Router replicas, at least 1. One replica is the plain single-router run.
    pub count: usize,
    /// Whether and how replicas share their bookings.
    pub sync: ReplicaSync,
    /// How client requests are spread over the replicas.
    pub spread: Spread,
    /// When the last replica starts (joining its peers, with [`ReplicaSync::On`], as a live one
    /// does); `None`: with the others, at 0. Before it starts it routes nothing and hears
    /// nothing, its index included.
    pub join_at: Option<Duration>,
    /// When the first replica dies: from then on it routes nothing and says nothing; the requests
    /// it routed run to their end on their engines, and its peers release its bookings once it
    /// has been silent past the peer timeout. `None`: it does not.
    pub fail_at: Option<Duration>,
    /// How each replica cuts its changes into batches, with sync (the live transport's rule,
    /// [`kvroute_core::router::replica::Batcher`]). Default [`Replicas::IMMEDIATE`].
    pub batching: BatchConfig,
}

impl Replicas {
    /// No batch window: one batch per input a replica takes.
    pub const IMMEDIATE: BatchConfig = BatchConfig {
        window: Duration::ZERO,
        lazy_window: Duration::ZERO,
        max_events: usize::MAX,
    };
}

impl Default for Replicas {
    /// One router, no sync, round-robin.
    fn default() -> Self {
        Self {
            count: 1,
            sync: ReplicaSync::Off,
            spread: Spread::RoundRobin,
            join_at: None,
            fail_at: None,
            batching: Self::IMMEDIATE,
        }
    }
}

/// Replica sync in the simulator: each replica runs the replica-sync protocol that serves
/// ([`kvroute_core::router::replica::ReplicaProtocol`], its default timing: heartbeats every
/// second, a peer lost after 3 s of silence), its messages carried by a simulated bus.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ReplicaSync {
    /// Each replica knows only the requests it routed.
    #[default]
    Off,
    /// Each replica publishes its load changes, one numbered batch per input it takes; every
    /// message (batches, heartbeats, snapshot requests and answers) reaches its receivers
    /// `delay` later, or is lost, for all of them, with probability `loss` (drawn from the
    /// simulation's seed), as when a publisher's bounded queue overflows. A receiver that sees a
    /// gap in a peer's batch numbers asks for its snapshot. Messages that arrive at the same time
    /// apply in (sender, send order).
    On {
        /// Delay from export to delivery.
        delay: Duration,
        /// Probability in `[0, 1]` that a message is lost.
        loss: f64,
    },
}

/// How client requests are spread over the replicas (a load balancer in front of them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Spread {
    /// In turn, in arrival order.
    #[default]
    RoundRobin,
    /// Uniformly at random (drawn from the simulation's seed).
    Random,
}

/// Reality's noise in a run: step-time jitter, workers of unequal speed, HTTP latency between
/// router and engines. Every draw comes from [`SimConfig::seed`] (counter-based, so the draws do
/// not depend on the order events are handled in). [`Noise::default`] is all off, and a run
/// without noise draws nothing and handles no extra event. Prompt- and output-length spread
/// belongs to the workload ([`crate::workload::LengthSpread`]); KV-event lag and loss to
/// [`EventChannel`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Noise {
    /// Each forward pass's modelled duration times a factor drawn per pass, from a stream of
    /// its worker's own.
    pub step_jitter: Option<Dispersion>,
    /// How fast each worker is.
    pub worker_speed: WorkerSpeed,
    /// HTTP latency between router and engines; `None`: none.
    pub http: Option<HttpLatency>,
}

/// How fast each worker's engine is, as a factor on [`kvroute_engine::EngineConfig::speedup`]
/// (above 1: faster).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum WorkerSpeed {
    /// Every worker at the engine's speed.
    #[default]
    Same,
    /// Worker `i`'s factor drawn once from the run's seed.
    Drawn(Dispersion),
    /// Worker `i`'s factor is entry `i` (a worker a planner adds past the list: entry `i mod
    /// len`).
    Given(Vec<f64>),
}

impl WorkerSpeed {
    /// Worker `i`'s speed factor in a run of seed `seed`.
    pub fn factor(&self, seed: u64, i: usize) -> f64 {
        match self {
            Self::Same => 1.0,
            Self::Drawn(d) => d.draw_at(seed ^ SPEED_SALT, i as u64),
            Self::Given(list) => list.get(i % list.len().max(1)).copied().unwrap_or(1.0),
        }
    }
}

/// A one-way HTTP delay: from the router's decision to the engine's receipt of the request, and
/// from the engine's first token and finish to the router's (and the client's) receipt of them.
/// The client's TTFT and end-to-end latency include it, and a closed loop's next request waits for
/// it. A request's messages arrive in the order they were sent (one stream).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HttpLatency {
    /// The nominal one-way delay.
    pub delay: Duration,
    /// Each message's delay times a factor drawn per message; `None`: always `delay`.
    pub jitter: Option<Dispersion>,
}

impl HttpLatency {
    /// The delay of message `k` (0: the request, 1: its first token, 2: its finish) of request
    /// `request` in a run of seed `seed`.
    pub fn delay_of(&self, seed: u64, request: usize, k: u64) -> Duration {
        match &self.jitter {
            None => self.delay,
            Some(d) => self
                .delay
                .mul_f64(d.draw_at(seed ^ HTTP_SALT, request as u64 * 3 + k).min(1e6)),
        }
    }
}

/// Salts of the noise streams, apart from the simulator's other draws.
const SPEED_SALT: u64 = 0x5EED_0000_0000_0004;
const HTTP_SALT: u64 = 0x5EED_0000_0000_0005;
/// Salt of the step-jitter streams (worker `i`'s: [`kvroute_engine::noise::mix`] of it and `i`).
pub(crate) const JITTER_SALT: u64 = 0x5EED_0000_0000_0003;

impl Noise {
    /// Checks every amount; [`crate::Simulation::new`] calls this.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(d) = &self.step_jitter {
            d.validate().map_err(|e| format!("step jitter: {e}"))?;
        }
        match &self.worker_speed {
            WorkerSpeed::Same => {}
            WorkerSpeed::Drawn(d) => d.validate().map_err(|e| format!("worker speed: {e}"))?,
            WorkerSpeed::Given(list) => {
                if list.is_empty() {
                    return Err("worker speed: an empty list".to_owned());
                }
                if let Some(bad) = list.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                    return Err(format!("worker speed {bad}: a factor above 0"));
                }
            }
        }
        if let Some(h) = &self.http
            && let Some(d) = &h.jitter
        {
            d.validate().map_err(|e| format!("HTTP jitter: {e}"))?;
        }
        Ok(())
    }
}

/// The fleet's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// Workers that prefill and decode (router role `Aggregated`), each one engine.
    Aggregated {
        /// Workers.
        workers: usize,
    },
    /// A prefill pool and a decode pool (router roles `Prefill` and `Decode`). The router
    /// picks the decode worker first; when its decider says so, a prefill worker computes the
    /// prompt (and samples the first token), then the KV moves to the decode worker over a link
    /// ([`KvTransfer`]). Otherwise the decode worker prefills locally. Workers `0..prefill` are
    /// the prefill pool, the rest the decode pool.
    Disaggregated {
        /// Prefill workers.
        prefill: usize,
        /// Decode workers.
        decode: usize,
    },
}

impl Topology {
    /// Workers in all.
    pub fn workers(&self) -> usize {
        match *self {
            Self::Aggregated { workers } => workers,
            Self::Disaggregated { prefill, decode } => prefill + decode,
        }
    }
}

/// Everything a run needs besides the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// The fleet: aggregated workers, or prefill and decode pools.
    pub topology: Topology,
    /// The prefill-to-decode KV link (used only by a disaggregated topology).
    pub transfer: KvTransfer,
    /// The engine every worker runs. Its block size must equal the router's and the
    /// workload's.
    pub engine: EngineConfig,
    /// The router. Its `policy` is the one under test.
    pub router: RouterConfig,
    /// The KV-event channel.
    pub events: EventChannel,
    /// Router replicas over the fleet, and their sync. Default: one router.
    pub replicas: Replicas,
    /// Arrival mode.
    pub arrivals: ArrivalMode,
    /// Seed of the simulator's own draws (event loss). The router has its own seed.
    pub seed: u64,
    /// Time between samples of the time series (per-worker load, KV use, hit rate, queues);
    /// `None` records no series.
    pub sample_interval: Option<Duration>,
    /// Whether to keep one record per request (for `--per-request-jsonl`).
    pub keep_requests: bool,
    /// GPUs per worker, for GPU-seconds.
    pub gpus_per_worker: u32,
    /// Whether to skip over runs of decode passes of an engine (every running request decodes
    /// one token, none finishes, nothing is admitted, every block they allocate is free) instead
    /// of simulating them one by one, stopping only at the passes that allocate or complete a
    /// block and applying the rest when something touches the engine or the run ends. The
    /// results are identical either way; off, every pass is an event (for checking that).
    /// A run with a planner steps every pass (the planner fits on each one).
    pub fast_forward: bool,
    /// The planner, if one scales the fleet (see [`PlannerSetup`]); `None` keeps the fleet fixed
    /// and the report exactly as without it.
    pub planner: Option<PlannerSetup>,
    /// Step-time jitter, worker speeds, HTTP latency; default: none.
    pub noise: Noise,
}

/// A planner in the loop: it adds workers (routable after `config.startup_delay_s`) and drains
/// and removes them.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannerSetup {
    /// The planner's configuration; its mode must match the topology (`agg` for aggregated
    /// workers, `disagg`, `prefill` or `decode` for a disaggregated fleet).
    pub config: kvroute_planner::PlannerConfig,
    /// Length of the windows SLA attainment is reported over (requests by arrival time).
    pub sla_window: Duration,
    /// Whether the run keeps every observation it handed the planner
    /// ([`crate::PlannerRun::observations`]).
    pub keep_observations: bool,
    /// What the planner sees of the workers: the engines (their passes and KV), or the router's
    /// books, as the live proxy's planner sees them.
    pub observe: kvroute_planner::Observe,
}

impl SimConfig {
    /// Dynamo mocker's engine defaults: 64-token blocks, 16,384 blocks, 256 sequences, 8,192
    /// batched tokens, chunked prefill and prefix caching on, the polynomial timing model.
    pub fn mocker_engine() -> EngineConfig {
        EngineConfig {
            block_size: 64,
            max_model_len: 1 << 20,
            ..EngineConfig::default()
        }
    }

    /// `prefill` prefill and `decode` decode workers (see [`Topology::Disaggregated`]),
    /// otherwise as [`SimConfig::new`]; the default KV link and decider ([`KvTransfer`],
    /// `Decider::Always`).
    pub fn disaggregated(prefill: usize, decode: usize) -> Self {
        Self {
            topology: Topology::Disaggregated { prefill, decode },
            ..Self::new(prefill + decode)
        }
    }

    /// Workers in all.
    pub fn workers(&self) -> usize {
        self.topology.workers()
    }

    /// `workers` aggregated mocker-default engines, the default router at their block size,
    /// events without lag or loss, open-loop arrivals, seed 0, one sample per second.
    pub fn new(workers: usize) -> Self {
        let engine = Self::mocker_engine();
        let router = RouterConfig {
            block_size: engine.block_size,
            ..RouterConfig::default()
        };
        Self {
            topology: Topology::Aggregated { workers },
            transfer: KvTransfer::default(),
            engine,
            router,
            events: EventChannel::default(),
            replicas: Replicas::default(),
            arrivals: ArrivalMode::Open,
            seed: 0,
            sample_interval: Some(Duration::from_secs(1)),
            keep_requests: false,
            gpus_per_worker: 1,
            fast_forward: true,
            planner: None,
            noise: Noise::default(),
        }
    }
}
