//! The planner's configuration, validated once by [`crate::Planner::new`].
//!
//! Defaults follow Dynamo's planner where it has one (SLA 500 ms TTFT / 50 ms ITL, load loop
//! every 5 s, throughput loop every 180 s, 64 samples in 16 buckets, 5 observations before a
//! fit, scale-down sensitivity 0.8, GPU budget 8, one replica per pool at least).

use serde::{Deserialize, Serialize};

use crate::error::PlannerError;

/// Which pools the planner scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// One pool of aggregated workers (prefill and decode on the same engine).
    #[default]
    Agg,
    /// A prefill pool and a decode pool, scaled as a pair.
    Disagg,
    /// Only the prefill pool of a disaggregated fleet; the decode pool is left alone.
    Prefill,
    /// Only the decode pool of a disaggregated fleet; the prefill pool is left alone.
    Decode,
}

impl Mode {
    /// The pools this mode scales, in a fixed order.
    pub fn pools(self) -> &'static [Pool] {
        match self {
            Mode::Agg => &[Pool::Agg],
            Mode::Disagg => &[Pool::Prefill, Pool::Decode],
            Mode::Prefill => &[Pool::Prefill],
            Mode::Decode => &[Pool::Decode],
        }
    }
}

/// A pool of identical workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pool {
    /// Aggregated workers.
    Agg,
    /// Prefill-only workers.
    Prefill,
    /// Decode-only workers.
    Decode,
}

impl Pool {
    /// The pool's name.
    pub fn name(self) -> &'static str {
        match self {
            Pool::Agg => "agg",
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }

    /// Index into per-pool arrays.
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// Service-level targets, in milliseconds (means, as the planner estimates them).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Sla {
    /// Time to first token.
    pub ttft_ms: f64,
    /// Inter-token latency.
    pub itl_ms: f64,
}

impl Default for Sla {
    fn default() -> Self {
        Self {
            ttft_ms: 500.0,
            itl_ms: 50.0,
        }
    }
}

/// How the throughput loop predicts the next window from the past ones.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum PredictorConfig {
    /// The last window again.
    Constant,
    /// The mean of the last `window` windows.
    MovingAverage {
        /// Windows averaged.
        window: usize,
    },
    /// Holt's linear trend (double exponential smoothing).
    Holt {
        /// Level smoothing, in `(0, 1]`.
        alpha: f64,
        /// Trend smoothing, in `[0, 1]`.
        beta: f64,
    },
    /// A Kalman filter over a local linear trend (state: level and slope; F = `[[1,1],[0,1]]`).
    Kalman {
        /// Process noise of the level.
        q_level: f64,
        /// Process noise of the trend.
        q_trend: f64,
        /// Measurement noise.
        r: f64,
        /// Observations before the filter's forecast is used (the last value until then).
        min_points: usize,
    },
}

impl Default for PredictorConfig {
    fn default() -> Self {
        Self::Kalman {
            q_level: 1.0,
            q_trend: 0.1,
            r: 10.0,
            min_points: 5,
        }
    }
}

/// Where the planner's performance model starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelSeed {
    /// Nothing: the model is fitted from observed forward passes only (none before
    /// `min_observations`).
    #[default]
    None,
    /// A profile of the engine, timed by its timing model, before any pass is observed; observed
    /// passes join it. The live planner needs it: a live fleet reports no forward passes.
    Profile,
}

/// How a simulated fleet is observed by its planner.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Observe {
    /// The engines themselves: their forward passes and resident KV (what an engine that
    /// reports per-pass metrics gives).
    #[default]
    Engines,
    /// The router's books only, as the live proxy observes its workers ([`crate::books`]): no
    /// forward passes, the load the router booked.
    Router,
}

/// Everything the planner needs besides its inputs.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlannerConfig {
    /// Which pools are scaled.
    pub mode: Mode,
    /// The targets.
    pub sla: Sla,
    /// Whether the fast, load-based loop runs.
    pub load_scaling: bool,
    /// Seconds between load-loop ticks.
    pub load_interval_s: f64,
    /// Whether the slow, throughput-based loop runs.
    pub throughput_scaling: bool,
    /// Seconds between throughput-loop ticks (the prediction window).
    pub throughput_interval_s: f64,
    /// The throughput loop's predictor.
    pub predictor: PredictorConfig,
    /// Whether the router-predicted KV hit rate discounts prefill work.
    pub kv_hit_discount: bool,
    /// Total GPUs the planner may provision (starting and draining workers count).
    pub max_gpu_budget: u32,
    /// GPUs per aggregated worker.
    pub agg_gpus: u32,
    /// GPUs per prefill worker.
    pub prefill_gpus: u32,
    /// GPUs per decode worker.
    pub decode_gpus: u32,
    /// Fewest replicas of every scaled pool (0: a pool may stop when idle, and starts again when
    /// a request arrives; the router's queue must hold requests meanwhile).
    pub min_replicas: u32,
    /// Most replicas of every scaled pool (none: only the GPU budget bounds them).
    pub max_replicas: Option<u32>,
    /// Most actions (adds and removals) one decision takes; the rest wait for later ticks.
    pub max_changes_per_tick: Option<u32>,
    /// With `min_replicas = 0`: seconds without a request before a pool stops.
    pub idle_to_zero_s: f64,
    /// Where the performance model starts from.
    pub model_seed: ModelSeed,
    /// Whether estimates are corrected by observed over predicted latency (smoothed, within
    /// 0.25x to 4x): a model profiled on other hardware, or too ideal, is pulled to the fleet.
    pub latency_correction: bool,
    /// Seconds after a worker becomes ready during which its latencies are not observed (cold
    /// start: compilation, first allocations); its requests still count as load.
    pub warmup_s: f64,
    /// Seconds a new worker takes to become routable (the fleet applies it; a live fleet
    /// ignores it).
    pub startup_delay_s: f64,
    /// Samples a regression keeps.
    pub max_samples: usize,
    /// Buckets samples are retained by (16 = a 4x4 grid for two features).
    pub sample_buckets: usize,
    /// Samples before a regression is fitted.
    pub min_observations: usize,
    /// Forward passes of a new worker that are not used for fitting (cold start).
    pub cold_start_passes: u32,
    /// Scale-down margin: the remaining engines must stay within this share of the SLA.
    pub scale_down_sensitivity: f64,
    /// Consecutive load ticks the consolidation check must pass before a scale-down (one
    /// snapshot of queues is noisy; 1 acts on the first pass).
    pub scale_down_ticks: u32,
    /// Consecutive load ticks whose estimates must all breach the SLA before a scale-up (1, the
    /// default, acts on the first; 2 or more let a single tick's burst pass, as a Kubernetes
    /// autoscaler's stabilization window does).
    pub scale_up_ticks: u32,
    /// With `scale_up_ticks` above 1: a breach this many times the SLA (the best engine's
    /// estimate over the target) scales up at its first tick; a burst that large is not waited
    /// out (none: every scale-up waits its ticks).
    pub scale_up_at_once: Option<f64>,
    /// Share of an engine's modelled throughput the throughput loop plans to use (queueing
    /// makes 100 % unusable under any latency target).
    pub throughput_headroom: f64,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Agg,
            sla: Sla::default(),
            load_scaling: true,
            load_interval_s: 5.0,
            throughput_scaling: true,
            throughput_interval_s: 180.0,
            predictor: PredictorConfig::default(),
            kv_hit_discount: true,
            max_gpu_budget: 8,
            agg_gpus: 1,
            prefill_gpus: 1,
            decode_gpus: 1,
            min_replicas: 1,
            max_replicas: None,
            max_changes_per_tick: None,
            idle_to_zero_s: 300.0,
            model_seed: ModelSeed::None,
            latency_correction: false,
            warmup_s: 0.0,
            startup_delay_s: 30.0,
            max_samples: 64,
            sample_buckets: 16,
            min_observations: 5,
            cold_start_passes: 5,
            scale_down_sensitivity: 0.8,
            scale_down_ticks: 6,
            scale_up_ticks: 1,
            scale_up_at_once: None,
            throughput_headroom: 0.8,
        }
    }
}

impl PlannerConfig {
    /// Whether a worker ready for `ready_for_s` seconds is past its warm-up, so that its
    /// latencies are observed.
    pub fn warm(&self, ready_for_s: f64) -> bool {
        ready_for_s >= self.warmup_s
    }

    /// GPUs per worker of `pool`.
    pub fn gpus(&self, pool: Pool) -> u32 {
        match pool {
            Pool::Agg => self.agg_gpus,
            Pool::Prefill => self.prefill_gpus,
            Pool::Decode => self.decode_gpus,
        }
    }

    /// Checks every parameter; the planner is built only from a valid configuration.
    pub fn validate(&self) -> Result<(), PlannerError> {
        let bad = |what: String| Err(PlannerError::Config(what));
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.sla.ttft_ms) || !positive(self.sla.itl_ms) {
            return bad(format!("SLA {:?} must be positive", self.sla));
        }
        if !self.load_scaling && !self.throughput_scaling {
            return bad("neither loop is enabled".to_owned());
        }
        if !positive(self.load_interval_s) || !positive(self.throughput_interval_s) {
            return bad("loop intervals must be positive".to_owned());
        }
        if self.load_scaling && self.throughput_scaling && self.load_interval_s >= self.throughput_interval_s
        {
            return bad(format!(
                "load interval {} s must be shorter than the throughput interval {} s",
                self.load_interval_s, self.throughput_interval_s
            ));
        }
        if !(self.startup_delay_s.is_finite() && self.startup_delay_s >= 0.0) {
            return bad(format!("startup delay {} s", self.startup_delay_s));
        }
        if let Some(max) = self.max_replicas
            && (max == 0 || max < self.min_replicas)
        {
            return bad(format!(
                "max_replicas {max} must be at least 1 and at least min_replicas {}",
                self.min_replicas
            ));
        }
        if self.max_changes_per_tick == Some(0) {
            return bad("max_changes_per_tick must be at least 1".to_owned());
        }
        if !(self.idle_to_zero_s.is_finite() && self.idle_to_zero_s > 0.0) {
            return bad(format!("idle_to_zero_s {} must be positive", self.idle_to_zero_s));
        }
        if !(self.warmup_s.is_finite() && self.warmup_s >= 0.0) {
            return bad(format!("warmup_s {} must be 0 or more", self.warmup_s));
        }
        for &pool in self.mode.pools() {
            if self.gpus(pool) == 0 {
                return bad(format!("{} workers need at least one GPU", pool.name()));
            }
        }
        let min_gpus: u32 = self
            .mode
            .pools()
            .iter()
            .map(|&p| self.gpus(p) * self.min_replicas)
            .sum();
        if min_gpus > self.max_gpu_budget {
            return bad(format!(
                "the minimum replicas need {min_gpus} GPUs, over the budget of {}",
                self.max_gpu_budget
            ));
        }
        if self.max_samples < 2 || self.sample_buckets == 0 || self.min_observations < 2 {
            return bad("max_samples and min_observations must be at least 2, sample_buckets 1".to_owned());
        }
        if self.min_observations > self.max_samples {
            return bad("min_observations exceeds max_samples".to_owned());
        }
        if !(self.scale_down_sensitivity > 0.0 && self.scale_down_sensitivity <= 1.0) {
            return bad(format!("scale_down_sensitivity {}", self.scale_down_sensitivity));
        }
        if self.scale_down_ticks == 0 || self.scale_up_ticks == 0 {
            return bad("scale_down_ticks and scale_up_ticks must be at least 1".to_owned());
        }
        if let Some(f) = self.scale_up_at_once
            && !(f > 1.0 && f.is_finite())
        {
            return bad(format!("scale_up_at_once {f} (a factor over the SLA, above 1)"));
        }
        if !(self.throughput_headroom > 0.0 && self.throughput_headroom <= 1.0) {
            return bad(format!("throughput_headroom {}", self.throughput_headroom));
        }
        match self.predictor {
            PredictorConfig::Constant => {}
            PredictorConfig::MovingAverage { window } if window > 0 => {}
            PredictorConfig::Holt { alpha, beta }
                if alpha > 0.0 && alpha <= 1.0 && (0.0..=1.0).contains(&beta) => {}
            PredictorConfig::Kalman {
                q_level, q_trend, r, ..
            } if q_level >= 0.0
                && q_trend >= 0.0
                && r > 0.0
                && q_level.is_finite()
                && q_trend.is_finite()
                && r.is_finite() => {}
            p => return bad(format!("predictor {p:?}")),
        }
        Ok(())
    }
}

/// What the planner knows of the engines it scales (the same for every worker).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Token budget of one forward pass (prefill is cut into chunks of this size).
    pub max_num_batched_tokens: u32,
    /// Most requests running at once.
    pub max_num_seqs: u32,
    /// KV capacity in tokens (blocks times block size).
    pub kv_capacity_tokens: u64,
}

impl EngineLimits {
    pub(crate) fn validate(&self) -> Result<(), PlannerError> {
        if self.max_num_batched_tokens == 0 || self.max_num_seqs == 0 || self.kv_capacity_tokens == 0 {
            return Err(PlannerError::Config(format!(
                "engine limits {self:?} must be positive"
            )));
        }
        Ok(())
    }
}
