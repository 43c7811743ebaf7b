//! The workers' engine from a model, a GPU and limits: one pipeline for `replay`'s and `mock`'s
//! flags and the planner file's `[engine]` (which `serve --planner` and `replay --planner` read).
//!
//! Keys, each optional: the engine's limits (`block-size`, `num-blocks`, `max-num-seqs`,
//! `max-num-batched-tokens`, `speedup`), the timing model, and where the model runs: `model` (a
//! built-in name or alias, a model TOML, or a Hugging Face `config.json` or its directory),
//! `gpu` (a built-in name or alias, or a GPU TOML), `tp` and `gpu-memory-utilization`. With a
//! model, the timing model defaults to the roofline and `num-blocks` to what fits in the GPUs'
//! memory ([`kvroute_engine::capacity`]); without one the engine is the base one (today's).
//! Files are read here, parsed by the engine crate.

use std::path::Path;

use anyhow::{Context, bail, ensure};
use kvroute_engine::capacity::{Deployment, PassLimits};
use kvroute_engine::timing::{RooflineConfig, RooflineEfficiency, TableProfile};
use kvroute_engine::{EngineConfig, GpuSpec, ModelSpec, TimingConfig};

/// vLLM's default share of each GPU's memory.
pub const DEFAULT_GPU_MEMORY_UTILIZATION: f64 = 0.9;
/// The GPU a model runs on when none is named.
pub const DEFAULT_GPU: &str = "h100-sxm";

/// A timing model as a key names it.
#[derive(Clone, Debug, PartialEq)]
pub enum Timing {
    /// `--timing roofline|polynomial|table:FILE|FILE`, read when the engine is built.
    Named(String),
    /// The planner file's `[engine] timing` table.
    Config(Box<TimingConfig>),
}

/// The engine keys of one source (flags, or the planner file), each optional.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineChoice {
    /// Tokens per KV block.
    pub block_size: Option<u32>,
    /// KV blocks per worker.
    pub num_blocks: Option<u32>,
    /// Most requests running at once.
    pub max_num_seqs: Option<u32>,
    /// Token budget of one forward pass.
    pub max_num_batched_tokens: Option<u32>,
    /// Modelled step times are divided by this.
    pub speedup: Option<f64>,
    /// The timing model.
    pub timing: Option<Timing>,
    /// The model: a built-in, a TOML description or a `config.json`.
    pub model: Option<String>,
    /// The GPU: a built-in or a TOML description.
    pub gpu: Option<String>,
    /// Tensor-parallel GPUs per worker.
    pub tp: Option<u32>,
    /// Share of each GPU's memory the engine may use.
    pub gpu_memory_utilization: Option<f64>,
}

/// The engine the keys describe, and what follows from them.
#[derive(Clone, Debug, PartialEq)]
pub struct Built {
    /// The engine.
    pub engine: EngineConfig,
    /// GPUs per worker (`tp`; 1 without it).
    pub gpus_per_worker: u32,
    /// The model's KV bytes per token, when a model is named.
    pub kv_bytes_per_token: Option<u64>,
    /// One line saying what was derived, when a model is named.
    pub description: Option<String>,
}

impl EngineChoice {
    /// These keys, each over `under`'s.
    pub fn over(&self, under: &EngineChoice) -> EngineChoice {
        EngineChoice {
            block_size: self.block_size.or(under.block_size),
            num_blocks: self.num_blocks.or(under.num_blocks),
            max_num_seqs: self.max_num_seqs.or(under.max_num_seqs),
            max_num_batched_tokens: self.max_num_batched_tokens.or(under.max_num_batched_tokens),
            speedup: self.speedup.or(under.speedup),
            timing: self.timing.clone().or_else(|| under.timing.clone()),
            model: self.model.clone().or_else(|| under.model.clone()),
            gpu: self.gpu.clone().or_else(|| under.gpu.clone()),
            tp: self.tp.or(under.tp),
            gpu_memory_utilization: self.gpu_memory_utilization.or(under.gpu_memory_utilization),
        }
    }

    /// `base` with these keys over it, every key checked; files named are read.
    pub fn build(&self, base: &EngineConfig) -> anyhow::Result<Built> {
        let mut e = base.clone();
        e.block_size = self.block_size.unwrap_or(e.block_size);
        e.max_num_seqs = self.max_num_seqs.unwrap_or(e.max_num_seqs);
        e.max_num_batched_tokens = self.max_num_batched_tokens.unwrap_or(e.max_num_batched_tokens);
        e.speedup = self.speedup.unwrap_or(e.speedup);
        ensure!(self.tp != Some(0), "--tp must be at least 1");
        if let Some(u) = self.gpu_memory_utilization {
            ensure!(
                u.is_finite() && u > 0.0 && u <= 1.0,
                "--gpu-memory-utilization must be above 0 and at most 1, not {u}"
            );
        }
        let tp = self.tp.unwrap_or(1);
        let model = self.model.as_deref().map(read_model).transpose()?;
        if model.is_none() {
            for (flag, set) in [
                ("--gpu", self.gpu.is_some()),
                ("--gpu-memory-utilization", self.gpu_memory_utilization.is_some()),
            ] {
                ensure!(!set, "{flag} describes where --model runs: give --model too");
            }
        }
        let gpu = read_gpu(self.gpu.as_deref().unwrap_or(DEFAULT_GPU))?;
        let roofline = |model: &ModelSpec| {
            TimingConfig::Roofline(RooflineConfig {
                model: model.clone(),
                gpu: gpu.clone(),
                tensor_parallel: tp,
                efficiency: RooflineEfficiency::TYPICAL,
            })
        };
        e.timing = match (&self.timing, &model) {
            (Some(Timing::Config(t)), _) => (**t).clone(),
            (Some(Timing::Named(name)), _) => named_timing(name, model.as_ref().map(roofline))?,
            (None, Some(m)) => roofline(m),
            (None, None) => e.timing,
        };
        let mut description = None;
        match (&model, self.num_blocks) {
            (_, Some(n)) => e.num_blocks = n,
            (Some(m), None) => {
                let utilization = self
                    .gpu_memory_utilization
                    .unwrap_or(DEFAULT_GPU_MEMORY_UTILIZATION);
                let deployment = Deployment {
                    model: m,
                    gpu: &gpu,
                    tensor_parallel: tp,
                    gpu_memory_utilization: utilization,
                };
                e.num_blocks = deployment
                    .kv_blocks(PassLimits {
                        block_size: e.block_size,
                        max_num_batched_tokens: e.max_num_batched_tokens,
                        max_num_seqs: e.max_num_seqs,
                    })
                    .context("--num-blocks from --model, --gpu, --tp and --gpu-memory-utilization")?;
                description = Some(format!(
                    "engine: {} on {tp} x {}, {} KV blocks of {} tokens per worker (derived at \
                     gpu-memory-utilization {utilization})",
                    m.name, gpu.name, e.num_blocks, e.block_size
                ));
            }
            (None, None) => {}
        }
        e.validate().context("the engine")?;
        Ok(Built {
            engine: e,
            gpus_per_worker: tp,
            kv_bytes_per_token: model.as_ref().map(ModelSpec::kv_bytes_per_token),
            description,
        })
    }
}

/// `--timing`'s value: `polynomial`, `roofline` (from `roofline`, the model's, if any), or a
/// TOML file: `table:FILE` a measured profile, `FILE` a whole timing model (`kind = ...`, as an
/// engine's `[timing]`, e.g. one `kvroute calibrate` wrote).
fn named_timing(name: &str, roofline: Option<TimingConfig>) -> anyhow::Result<TimingConfig> {
    Ok(match name {
        "polynomial" => TimingConfig::Polynomial,
        "roofline" => roofline.context("--timing roofline needs --model (and --gpu, default h100-sxm)")?,
        "table" => bail!("--timing table needs its profile: --timing table:FILE (a TOML table profile)"),
        _ => match name.strip_prefix("table:") {
            Some(path) => {
                let text = read(path, "--timing")?;
                TimingConfig::Table(
                    TableProfile::from_toml_str(&text).with_context(|| format!("--timing {name}"))?,
                )
            }
            None => {
                let text = read(name, "--timing")?;
                TimingConfig::from_toml_str(&text).with_context(|| {
                    format!("--timing {name}: polynomial, roofline, table:FILE or a timing-model FILE")
                })?
            }
        },
    })
}

/// The file at `path`, for `flag`.
fn read(path: &str, flag: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("{flag} {path}: reading the file"))
}

/// `--model`'s value: a Hugging Face `config.json` (or a directory holding one), a model TOML
/// (`.toml`), else a built-in name.
pub fn read_model(name: &str) -> anyhow::Result<ModelSpec> {
    let path = Path::new(name);
    let flag = || format!("--model {name}");
    if path.is_dir() {
        let file = path.join("config.json");
        let text = read(&file.to_string_lossy(), "--model")?;
        let short = path
            .file_name()
            .map_or(name.to_owned(), |n| n.to_string_lossy().into_owned());
        return ModelSpec::from_hf_config(&short, &text).with_context(flag);
    }
    if name.ends_with(".json") {
        let text = read(name, "--model")?;
        // A `config.json` is named after its directory, as a downloaded model's sits in one;
        // another file after its name (`qwen3-8b.config.json`: `qwen3-8b`).
        let file = path
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let short = match file.as_str() {
            "config.json" => path
                .parent()
                .and_then(Path::file_name)
                .map_or(file.clone(), |n| n.to_string_lossy().into_owned()),
            _ => file
                .trim_end_matches(".json")
                .trim_end_matches(".config")
                .to_owned(),
        };
        return ModelSpec::from_hf_config(&short, &text).with_context(flag);
    }
    if name.ends_with(".toml") {
        return ModelSpec::from_toml_str(&read(name, "--model")?).with_context(flag);
    }
    ModelSpec::builtin(name).with_context(|| {
        format!("--model {name}: a built-in name, a config.json (or its directory) or a model TOML")
    })
}

/// `--gpu`'s value: a GPU TOML (`.toml`), else a built-in name or alias.
pub fn read_gpu(name: &str) -> anyhow::Result<GpuSpec> {
    if name.ends_with(".toml") {
        return GpuSpec::from_toml_str(&read(name, "--gpu")?).with_context(|| format!("--gpu {name}"));
    }
    GpuSpec::builtin(name).with_context(|| format!("--gpu {name}: a built-in name or a GPU TOML"))
}
