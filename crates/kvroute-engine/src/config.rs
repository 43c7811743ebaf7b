//! The engine's one configuration, validated once by [`Engine::new`](crate::Engine::new).
//!
//! The names follow vLLM's engine arguments, so a vLLM deployment's settings carry over.
//! Nothing has a default but `step_jitter` and `cpu_offload` (none): a caller states every knob (the CLI will fill
//! them from a TOML file with [`EngineConfig::from_toml_str`]).

use kvroute_core::time::TimeScale;
use serde::Deserialize;

use crate::cpu_tier::CpuOffload;
use crate::noise::StepJitter;
use crate::spec::{SpecError, parse_toml};
use crate::timing::TimingConfig;

/// How to build an [`Engine`](crate::Engine).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV block (vLLM `--block-size`; Dynamo's mocker uses 64).
    pub block_size: u32,
    /// KV blocks in the cache (vLLM `--num-gpu-blocks-override`).
    pub num_blocks: u32,
    /// Requests running at once at most (vLLM `--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Tokens computed per forward pass at most, over all requests (vLLM
    /// `--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// The longest sequence, prompt plus output, the model can hold (vLLM `--max-model-len`).
    /// Longer prompts are rejected; outputs are cut at this length.
    pub max_model_len: u32,
    /// Whether a prompt may be computed over several passes. When off, a prompt is computed in
    /// one pass and `max_num_batched_tokens` must be at least `max_model_len`, as vLLM requires.
    pub enable_chunked_prefill: bool,
    /// Whether full blocks are kept by hash and reused across requests. When off, no block is
    /// cached and no KV event is emitted (vLLM publishes none either).
    pub enable_prefix_caching: bool,
    /// The seed of the engine's external block hashes (see
    /// [`external_hash`](crate::external_hash)). Engines with different seeds name the same block
    /// differently, as real engines do.
    pub external_hash_seed: u64,
    /// Modeled durations are divided by this (1.0: as modeled; 10.0: ten times faster).
    pub speedup: f64,
    /// How long a forward pass takes.
    pub timing: TimingConfig,
    /// Multiplicative noise on each pass's duration (`[step_jitter]`, optional); `None`: every
    /// pass takes its modelled time.
    #[serde(default)]
    pub step_jitter: Option<StepJitter>,
    /// The host-memory KV tier blocks are offloaded to and loaded back from (vLLM's native
    /// offloading, `[cpu_offload]`, optional); `None`: none.
    #[serde(default)]
    pub cpu_offload: Option<CpuOffload>,
}

/// vLLM's defaults where it has them: 16-token blocks, 256 sequences, 8,192 tokens a pass,
/// chunked prefill and prefix caching on; 16,384 blocks, a 128K context, real time, the
/// polynomial timing model, no noise and no CPU tier.
impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 131_072,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            external_hash_seed: 0,
            speedup: 1.0,
            timing: TimingConfig::Polynomial,
            step_jitter: None,
            cpu_offload: None,
        }
    }
}

/// Why a configuration was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A count that must be at least one is zero.
    #[error("{field} must be above zero")]
    Zero {
        /// The field at fault.
        field: &'static str,
    },
    /// The speedup factor is not a finite number above zero.
    #[error("speedup must be a finite number above zero, not {0}")]
    Speedup(f64),
    /// Without chunked prefill a whole sequence must fit in one pass.
    #[error(
        "with chunked prefill off, max_num_batched_tokens ({max_num_batched_tokens}) must be at \
         least max_model_len ({max_model_len})"
    )]
    BudgetBelowModelLen {
        /// The token budget per pass.
        max_num_batched_tokens: u32,
        /// The longest sequence.
        max_model_len: u32,
    },
    /// The timing model's description is unusable.
    #[error("timing: {0}")]
    Timing(#[from] SpecError),
    /// The step-time jitter's amount is out of range.
    #[error("step jitter: {0}")]
    StepJitter(String),
    /// The configuration text did not parse.
    #[error("{0}")]
    Parse(SpecError),
}

impl EngineConfig {
    /// Parses and validates a configuration written in TOML (field names as in this struct;
    /// the timing model under `[timing]`, chosen by `kind = "polynomial" | "roofline" | "table"`).
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let config: Self = parse_toml(text, "engine config").map_err(ConfigError::Parse)?;
        config.validate()?;
        Ok(config)
    }

    /// The mapping of the engine's modeled spans to its time ([`EngineConfig::speedup`]).
    pub fn time_scale(&self) -> Result<TimeScale, ConfigError> {
        TimeScale::new(self.speedup).ok_or(ConfigError::Speedup(self.speedup))
    }

    /// Checks every field; [`Engine::new`](crate::Engine::new) calls this.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let counts = [
            ("block_size", self.block_size),
            ("num_blocks", self.num_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        let cpu = (
            "cpu_offload.num_blocks",
            self.cpu_offload.map_or(1, |c| c.num_blocks),
        );
        if let Some((field, _)) = counts.iter().chain([&cpu]).find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero { field });
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(ConfigError::Speedup(self.speedup));
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(ConfigError::BudgetBelowModelLen {
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_model_len: self.max_model_len,
            });
        }
        self.timing.validate()?;
        if let Some(j) = &self.step_jitter {
            j.dispersion.validate().map_err(ConfigError::StepJitter)?;
        }
        Ok(())
    }
}
