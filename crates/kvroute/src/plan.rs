//! The planner's file: one TOML for `kvroute serve --planner` and `kvroute replay --planner`.
//!
//! ```toml
//! [planner]          # the planner (kvroute_planner::PlannerConfig): SLA, loops, limits
//! mode = "agg"
//! sla = { ttft_ms = 1000, itl_ms = 30 }
//!
//! [engine]           # the workers' engine, as far as the planner needs it (optional)
//! num_blocks = 16384
//!
//! [actuator]         # how a live fleet grows and shrinks (serve only)
//! kind = "dry-run"
//!
//! [drain]            # how long a removed worker's requests may take (serve only)
//! timeout_s = 300
//! ```
//!
//! `[engine]` describes the workers: its limits bound the planner's estimates, and its timing
//! model is what a profiled planner (`model_seed = "profile"`) is seeded from. `replay`
//! simulates those workers (its engine flags win, key by key); `serve` profiles them. The
//! simulator carries decisions out itself, so `replay` reads neither `[actuator]` nor `[drain]`.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use kvroute_core::time::Timestamp;
use kvroute_engine::{EngineConfig, TimingConfig};
use kvroute_planner::{Planner, PlannerConfig};
use kvroute_proxy::autoscale::actuator::ActuatorConfig;
use serde::Deserialize;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanFile {
    /// The planner.
    pub planner: PlannerConfig,
    /// The workers' engine.
    #[serde(default)]
    pub engine: EngineKeys,
    /// How a live fleet grows and shrinks.
    pub actuator: Option<ActuatorConfig>,
    /// How long a removed worker's requests may take.
    #[serde(default)]
    pub drain: Drain,
}

/// `[engine]`: the keys of the workers' engine that differ from `kvroute mock`'s, and where
/// its model runs (as `replay`'s and `mock`'s flags of the same names:
/// [`crate::hardware::EngineChoice`]).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineKeys {
    /// Tokens per KV block.
    pub block_size: Option<u32>,
    /// KV blocks per worker (default: what fits, with `model`).
    pub num_blocks: Option<u32>,
    /// Most requests running at once.
    pub max_num_seqs: Option<u32>,
    /// Token budget of one forward pass.
    pub max_num_batched_tokens: Option<u32>,
    /// Modelled step times are divided by this.
    pub speedup: Option<f64>,
    /// The timing model (`{ kind = "polynomial" }`, roofline, table; default: the roofline,
    /// with `model`).
    pub timing: Option<TimingConfig>,
    /// The model: a built-in name, a model TOML or a Hugging Face `config.json`.
    pub model: Option<String>,
    /// The GPU: a built-in name or a GPU TOML (default h100-sxm).
    pub gpu: Option<String>,
    /// Tensor-parallel GPUs per worker (default 1).
    pub tp: Option<u32>,
    /// Share of each GPU's memory the engine may use (default 0.9).
    pub gpu_memory_utilization: Option<f64>,
}

impl EngineKeys {
    /// The keys as one source of [`crate::hardware::EngineChoice`].
    pub fn choice(&self) -> crate::hardware::EngineChoice {
        crate::hardware::EngineChoice {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            speedup: self.speedup,
            timing: self
                .timing
                .clone()
                .map(|t| crate::hardware::Timing::Config(Box::new(t))),
            model: self.model.clone(),
            gpu: self.gpu.clone(),
            tp: self.tp,
            gpu_memory_utilization: self.gpu_memory_utilization,
        }
    }

    /// `base` with these keys over it.
    pub fn over(&self, base: &EngineConfig) -> anyhow::Result<EngineConfig> {
        Ok(self.choice().build(base).context("[engine]")?.engine)
    }
}

/// `[drain]`.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Drain {
    /// Seconds a removed worker's requests may take before it is removed anyway.
    pub timeout_s: f64,
}

impl Default for Drain {
    fn default() -> Self {
        Self { timeout_s: 300.0 }
    }
}

impl Drain {
    /// The timeout, or why it is not one.
    pub fn timeout(&self) -> anyhow::Result<Duration> {
        Duration::try_from_secs_f64(self.timeout_s).context("[drain] timeout_s")
    }
}

impl PlanFile {
    /// Reads and checks the file at `path` (the planner's configuration included), naming the
    /// line and key of what is wrong.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let at = || format!("--planner {}", path.display());
        let text = std::fs::read_to_string(path).with_context(at)?;
        Self::parse(&text).with_context(at)
    }

    /// The file of `text`, checked.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: Self = crate::config::parse(text)?;
        file.planner.validate()?;
        if let Some(a) = &file.actuator {
            a.validate()?;
        }
        Ok(file)
    }

    /// The workers' engine: `[engine]` over `kvroute mock`'s.
    pub fn live_engine(&self) -> anyhow::Result<EngineConfig> {
        self.engine.over(&kvroute_mock::MockConfig::default_engine())
    }

    /// The planner `serve` runs, started at `start`: seeded from the profile of
    /// [`Self::live_engine`] when `model_seed = "profile"` (the simulator builds its planner
    /// the same way, from the engine it simulates).
    pub fn live_planner(&self, start: Timestamp) -> anyhow::Result<Planner> {
        Ok(kvroute_sim::profile::planner(
            &self.planner,
            &self.live_engine()?,
            start,
        )?)
    }
}
