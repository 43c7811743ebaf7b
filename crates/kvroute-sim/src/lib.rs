//! The cluster simulator: real traces through the real router core and simulated engines, on
//! one virtual clock.
//!
//! A [`Simulation`] owns one [`kvroute_core::router::Router`] (the very type the live server
//! drives, never a copy of its logic), or several replicas of it ([`Replicas`], with or without
//! replica sync), and N [`kvroute_engine::Engine`]s. Arrivals go to the router; its decisions go
//! to the engines; first tokens and completions go back to the router; the engines' KV events
//! reach the router's index through a channel with a configurable lag and loss, so stale cache
//! views can be studied.
//!
//! ```
//! use kvroute_sim::{SimConfig, Simulation, synthetic};
//!
//! let config = SimConfig::new(4);
//! let workload = synthetic::generate(
//!     &synthetic::SyntheticConfig { requests: 50, ..Default::default() },
//!     config.engine.block_size,
//! );
//! let result = Simulation::new(config).unwrap().run(&workload, &mut |_| {}).unwrap();
//! assert_eq!(result.report.number("completed_requests"), Some(50.0));
//! ```
//!
//! Like the core, the simulator is sans-IO: trace readers take a reader, runs take a workload and
//! return values, and nothing reads a clock. The same workload, configuration and seed give a
//! byte-identical report.
//!
//! # Layout
//!
//! * [`workload`]: requests with arrival rules, prompts as block hashes, true output lengths.
//! * [`trace`]: Mooncake JSONL and Azure CSV readers.
//! * [`synthetic`]: a seeded generator.
//! * [`config`]: the configuration, `SimConfig`.
//! * `cluster`: the event loop.
//! * [`report`]: the report, per-request records, time series and the text table.
//! * [`stats`]: percentiles and the inter-token-latency sketch.
//! * [`html`]: a self-contained HTML page of plots.
//! * [`profile_workload`]: inference-perf's `shared_prefix` profiles, as the real vLLM runs were
//!   driven; [`calibration`]: fitting the calibrated timing model on those runs and simulating
//!   them.
//! * [`profile`]: the engine's limits and profiled passes, and the planner built from them (for
//!   the simulator and the live planner alike).
//!
//! **Invariants checked at the end of every run:** arrived = completed + rejected + unfinished;
//! arrival ≤ routing ≤ first token ≤ finish; the clock never goes back (the router saw no
//! earlier time either); with nothing unfinished, the router's booked load is zero; every
//! engine's block accounting holds and, without event loss, the router's index holds exactly the
//! blocks each engine caches (none in approximate mode, which refuses KV events).
#![forbid(unsafe_code)]

pub mod calibration;
mod cluster;
pub mod config;
mod error;
pub mod html;
mod planned;
pub mod profile;
pub mod profile_workload;
pub mod report;
pub mod slo;
pub mod stats;
mod summary;
pub mod synthetic;
pub mod trace;
pub mod workload;

pub use cluster::Progress;
pub use config::{
    ArrivalMode, EventChannel, HttpLatency, Noise, PlannerSetup, ReplicaSync, Replicas, SimConfig, Spread,
    Topology, WorkerSpeed,
};
pub use error::SimError;
pub use kvroute_engine::Dispersion;
/// The prefill-to-decode KV link, the engine crate's (the mock workers price imports with it too).
pub use kvroute_engine::KvTransfer;
pub use planned::{PlannerRun, RequestSla, SlaWindow, sla_windows};
pub use report::{CompletedRequest, Latency, Outcome, Report, ReportBuilder, RequestRecord, TimeSeries};
pub use workload::{
    Arrival, LengthSpread, PromptBlocks, RequestSource, SimRequest, Workload, WorkloadSource,
};

/// The first 2,000 rows of the Mooncake conversation trace (Apache-2.0; see `data/NOTICE.md`),
/// gzip'd: the trace `kvroute replay` runs when none is named.
pub const EXAMPLE_MOONCAKE_GZ: &[u8] = include_bytes!("../data/mooncake_conversation_2000.jsonl.gz");

/// A configured simulation; [`Simulation::run`] may be called any number of times.
#[derive(Clone, Debug)]
pub struct Simulation {
    config: SimConfig,
}

/// What a run produced.
#[derive(Clone, Debug)]
pub struct RunResult {
    /// The summary.
    pub report: Report,
    /// One record per request, when [`SimConfig::keep_requests`] is set.
    pub requests: Vec<RequestRecord>,
    /// Time series, when [`SimConfig::sample_interval`] is set.
    pub series: Option<TimeSeries>,
    /// TTFT of every completed request, ms, in request order (for plots).
    pub ttft_ms: Vec<f64>,
    /// E2E latency of every completed request, ms, in request order (for plots).
    pub e2e_ms: Vec<f64>,
    /// The inter-token latencies' distribution: (ms, fraction at or below), for plots.
    pub itl_cdf: Vec<(f64, f64)>,
    /// What the planner saw and did, when one ran.
    pub planner: Option<PlannerRun>,
}

impl Simulation {
    /// A simulation, or why `config` is unusable.
    pub fn new(config: SimConfig) -> Result<Self, SimError> {
        config.router.validate()?;
        config.engine.validate()?;
        let workers = config.workers();
        if workers == 0 || workers > u32::MAX as usize {
            return Err(SimError::Config(format!("{workers} workers")));
        }
        if let config::Topology::Disaggregated { prefill, decode } = config.topology
            && (prefill == 0 || decode == 0)
        {
            return Err(SimError::Config(format!(
                "{prefill} prefill and {decode} decode workers: both pools need one"
            )));
        }
        let t = &config.transfer;
        if !(t.bandwidth_bytes_per_s.is_finite() && t.bandwidth_bytes_per_s > 0.0) {
            return Err(SimError::Config(format!(
                "KV transfer bandwidth {} bytes/s",
                t.bandwidth_bytes_per_s
            )));
        }
        if config.router.block_size != config.engine.block_size {
            return Err(SimError::Config(format!(
                "router block size {} != engine block size {}",
                config.router.block_size, config.engine.block_size
            )));
        }
        if !(0.0..=1.0).contains(&config.events.loss) {
            return Err(SimError::Config(format!(
                "event loss {} is not a probability",
                config.events.loss
            )));
        }
        if config.replicas.count == 0 || config.replicas.count > 1 << 16 {
            return Err(SimError::Config(format!(
                "{} router replicas (1 to 65,536)",
                config.replicas.count
            )));
        }
        if let config::ReplicaSync::On { loss, .. } = config.replicas.sync
            && !(0.0..=1.0).contains(&loss)
        {
            return Err(SimError::Config(format!(
                "sync message loss {loss} is not a probability"
            )));
        }
        let r = &config.replicas;
        if (r.join_at.is_some() || r.fail_at.is_some()) && r.count < 2 {
            return Err(SimError::Config(format!(
                "a replica joining late or dying needs at least 2 replicas, not {}",
                r.count
            )));
        }
        if let (Some(join), Some(fail)) = (r.join_at, r.fail_at)
            && r.count == 2
            && fail <= join
        {
            return Err(SimError::Config(format!(
                "with 2 replicas, the first dying at {fail:?} before the second joins at {join:?} leaves none"
            )));
        }
        if config.sample_interval.is_some_and(|d| d.is_zero()) {
            return Err(SimError::Config("sample interval of zero".to_owned()));
        }
        if let Some(setup) = &config.planner {
            setup.config.validate()?;
            let agg = matches!(config.topology, config::Topology::Aggregated { .. });
            if agg != (setup.config.mode == kvroute_planner::Mode::Agg) {
                return Err(SimError::Config(format!(
                    "planner mode {:?} does not fit the topology {:?}",
                    setup.config.mode, config.topology
                )));
            }
            if setup.sla_window.is_zero() {
                return Err(SimError::Config("SLA window of zero".to_owned()));
            }
        }
        config.noise.validate().map_err(SimError::Config)?;
        if let ArrivalMode::Closed { concurrency: 0 } = config.arrivals {
            return Err(SimError::Config("closed-loop concurrency of zero".to_owned()));
        }
        Ok(Self { config })
    }

    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Runs `workload` to the end, calling `progress` now and then, and checks the invariants.
    pub fn run(
        &self,
        workload: &Workload,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RunResult, SimError> {
        self.run_source(WorkloadSource::new(workload), progress)
    }

    /// Runs the requests of `source` to the end, as [`Simulation::run`] runs a workload: the
    /// same requests give the same result, whether held whole or made as the run goes.
    pub fn run_source<'w>(
        &'w self,
        source: impl RequestSource<'w> + 'w,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<RunResult, SimError> {
        if source.block_size() != self.config.engine.block_size {
            return Err(SimError::Config(format!(
                "workload block size {} != engine block size {}",
                source.block_size(),
                self.config.engine.block_size
            )));
        }
        let mut run = cluster::Run::new(&self.config, Box::new(source))?;
        run.run(progress)?;
        run.check()?;
        Ok(summary::summarize(&self.config, run))
    }
}
