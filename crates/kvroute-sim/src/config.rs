//! A simulation's configuration: the fleet, the engines, the router, the KV-event channel and
//! the arrival mode. Validated once, by [`crate::Simulation::new`].

use std::time::Duration;

use kvroute_core::router::RouterConfig;
use kvroute_engine::{EngineConfig, TimingConfig};

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

/// Everything a run needs besides the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Aggregated workers, each one engine.
    pub workers: usize,
    /// The engine every worker runs. Its block size must equal the router's and the
    /// workload's.
    pub engine: EngineConfig,
    /// The router. Its `policy` is the one under test.
    pub router: RouterConfig,
    /// The KV-event channel.
    pub events: EventChannel,
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
}

impl SimConfig {
    /// Dynamo mocker's engine defaults: 64-token blocks, 16,384 blocks, 256 sequences, 8,192
    /// batched tokens, chunked prefill and prefix caching on, the polynomial timing model.
    pub fn mocker_engine() -> EngineConfig {
        EngineConfig {
            block_size: 64,
            num_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 1 << 20,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            external_hash_seed: 0,
            speedup: 1.0,
            timing: TimingConfig::Polynomial,
        }
    }

    /// `workers` mocker-default engines, the default router at their block size, events without
    /// lag or loss, open-loop arrivals, seed 0, one sample per second.
    pub fn new(workers: usize) -> Self {
        let engine = Self::mocker_engine();
        let router = RouterConfig {
            block_size: engine.block_size,
            ..RouterConfig::default()
        };
        Self {
            workers,
            engine,
            router,
            events: EventChannel::default(),
            arrivals: ArrivalMode::Open,
            seed: 0,
            sample_interval: Some(Duration::from_secs(1)),
            keep_requests: false,
            gpus_per_worker: 1,
        }
    }
}
