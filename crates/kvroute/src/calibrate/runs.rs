//! Reading real vLLM runs: `calibration_runs.csv` (or any runs file of its format) with the
//! `models.csv` and `workload_profiles.csv` beside it, and the traced steps of
//! `steps_calibration.csv.gz`, into the simulator's [`CalibrationRun`]s.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, bail};
use kvroute_engine::capacity::{Deployment, PassLimits};
use kvroute_engine::timing::PassShape;
use kvroute_engine::{GpuSpec, ModelSpec, MoeSpec};
use kvroute_sim::calibration::{CalibrationRun, EngineSetup, Latencies, StepSample};
use kvroute_sim::profile_workload::{SharedPrefixProfile, parse_rate_stages};

use super::csv::{Row, Table};

/// Tokens a prompt has beyond its profile's system prompt and question when the run does not
/// say (the calibration set's T runs measured 26 to 48 more: the tokenizer and the template).
pub const TEMPLATE_TOKENS: u32 = 30;
/// `max_num_seqs` when a run leaves it empty: every calibration run that publishes it uses 128.
pub const DEFAULT_MAX_NUM_SEQS: u32 = 128;
/// `max_num_batched_tokens` when a run leaves it empty (every calibration run's).
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u32 = 2048;
/// `max_model_len` when a run leaves it empty.
pub const DEFAULT_MAX_MODEL_LEN: u32 = 4096;
/// Tokens per KV block when a run leaves it empty (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Failed share of requests above which a run is saturated (upstream's training split drops
/// runs with more than 10% failures).
pub const SATURATED_FAILED_SHARE: f64 = 0.1;
/// Seed of every run's workload.
pub const WORKLOAD_SEED: u64 = 42;

/// A runs file's rows: each a run to simulate, or why it cannot be.
#[derive(Debug)]
pub struct RunsFile {
    /// Per row, in file order: the run id and the run or the reason it cannot be simulated.
    pub runs: Vec<(String, RowInfo, Result<CalibrationRun, String>)>,
}

/// What the fidelity table shows of a row besides its errors.
#[derive(Clone, Debug, Default)]
pub struct RowInfo {
    /// `source_group`, if given.
    pub group: String,
    /// The model id.
    pub model: String,
    /// The GPU as the file names it.
    pub gpu: String,
    /// Tensor-parallel degree, if read.
    pub tp: u32,
    /// Assumptions made for this row (empty cells filled, quirks).
    pub assumptions: Vec<String>,
}

/// The GPU of a runs file's GPU name: a built-in one under any of its names (`H100-80GB`,
/// `A100-80GB`, `A100-40GB`, `L40S`, `H200`, ...).
pub fn gpu_spec(name: &str) -> Result<GpuSpec, String> {
    GpuSpec::builtin(name).map_err(|e| format!("GPU {name:?}: {e}"))
}

/// Reads `models.csv`: model id → its shape at the precision it was served.
pub fn read_models(table: &Table) -> anyhow::Result<BTreeMap<String, ModelSpec>> {
    table.require(&[
        "model",
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_kv_heads",
        "intermediate_size",
        "vocab_size",
    ])?;
    let mut models = BTreeMap::new();
    for row in table.rows() {
        let id = row.text("model")?.to_owned();
        let hidden = row.u32("hidden_size")?;
        let heads = row.u32("num_attention_heads")?;
        if heads == 0 {
            bail!("{}: num_attention_heads must be above zero", row.at());
        }
        let experts = row.u32_opt("num_experts")?;
        let per_token = row.u32_opt("experts_per_token")?;
        let moe = match (experts, per_token) {
            (Some(e), Some(k)) if e > 1 => Some(MoeSpec {
                num_experts: e,
                experts_per_token: k,
            }),
            (Some(e), None) if e > 1 => bail!("{}: num_experts without experts_per_token", row.at()),
            _ => None,
        };
        let dtype_bytes = match row
            .get("serving_precision")
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("fp8") | Some("int8") => 1,
            Some("fp16") | Some("bf16") | None => 2,
            Some("fp32") => 4,
            Some(other) => bail!(
                "{}: serving_precision {other:?} (fp16, bf16, fp8, int8, fp32)",
                row.at()
            ),
        };
        let spec = ModelSpec {
            name: row.get("short_name").unwrap_or(&id).to_owned(),
            num_layers: row.u32("num_layers")?,
            hidden_size: hidden,
            num_attention_heads: heads,
            num_kv_heads: row.u32("num_kv_heads")?,
            head_dim: row.u32_opt("head_dim")?.unwrap_or(hidden / heads),
            intermediate_size: row.u32("intermediate_size")?,
            vocab_size: row.u32("vocab_size")?,
            dtype_bytes,
            tie_word_embeddings: false,
            moe,
        };
        spec.validate()
            .with_context(|| format!("{}: model {id}", row.at()))?;
        if models.insert(id.clone(), spec).is_some() {
            bail!("{}: model {id} appears twice", row.at());
        }
    }
    Ok(models)
}

/// A workload class of `workload_profiles.csv`.
#[derive(Clone, Debug)]
pub struct ProfileRow {
    prefix_groups: u32,
    users_per_group: u32,
    system_prompt_tokens: u32,
    question_tokens: u32,
    output_tokens: u32,
    rate_stages: String,
}

/// Reads `workload_profiles.csv`: class → profile.
pub fn read_profiles(table: &Table) -> anyhow::Result<BTreeMap<String, ProfileRow>> {
    table.require(&[
        "workload_class",
        "prefix_groups",
        "users_per_group",
        "system_prompt_tokens",
        "question_tokens",
        "output_tokens",
        "rate_stages",
    ])?;
    let mut out = BTreeMap::new();
    for row in table.rows() {
        let class = row.text("workload_class")?.to_owned();
        let p = ProfileRow {
            prefix_groups: row.u32("prefix_groups")?,
            users_per_group: row.u32("users_per_group")?,
            system_prompt_tokens: row.u32("system_prompt_tokens")?,
            question_tokens: row.u32("question_tokens")?,
            output_tokens: row.u32("output_tokens")?,
            rate_stages: row.text("rate_stages")?.to_owned(),
        };
        parse_rate_stages(&p.rate_stages).map_err(|e| anyhow::anyhow!("{}: {e}", row.at()))?;
        out.insert(class, p);
    }
    Ok(out)
}

/// Reads a runs file with the models and profiles beside it. A row that cannot be simulated
/// (unknown GPU, missing model or class) is kept with the reason; a malformed table is an
/// error.
pub fn read_runs(
    runs: &Table,
    models: &BTreeMap<String, ModelSpec>,
    profiles: &BTreeMap<String, ProfileRow>,
) -> anyhow::Result<RunsFile> {
    runs.require(&["run_id", "model", "gpu", "tp", "ttft_mean_ms", "e2e_mean_ms"])?;
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for row in runs.rows() {
        let id = row.text("run_id")?.to_owned();
        if !seen.insert(id.clone()) {
            bail!("{}: run_id {id} appears twice", row.at());
        }
        let mut info = RowInfo {
            group: row.get("source_group").unwrap_or("").to_owned(),
            model: row.get("model").unwrap_or("").to_owned(),
            gpu: row.get("gpu").unwrap_or("").to_owned(),
            tp: 0,
            assumptions: Vec::new(),
        };
        let run = read_run(&row, &id, models, profiles, &mut info)?;
        out.push((id, info, run));
    }
    Ok(RunsFile { runs: out })
}

/// One row: `Err` (outer) for a malformed cell, `Ok(Err)` for a run that cannot be simulated.
fn read_run(
    row: &Row<'_>,
    id: &str,
    models: &BTreeMap<String, ModelSpec>,
    profiles: &BTreeMap<String, ProfileRow>,
    info: &mut RowInfo,
) -> anyhow::Result<Result<CalibrationRun, String>> {
    let tp = row.u32("tp")?;
    if tp == 0 {
        bail!("{}: tp must be above zero", row.at());
    }
    info.tp = tp;
    let ttft_mean_ms = row.f64("ttft_mean_ms")?;
    let e2e_mean_ms = row.f64("e2e_mean_ms")?;
    if !(ttft_mean_ms > 0.0 && e2e_mean_ms >= ttft_mean_ms) {
        bail!(
            "{}: ttft_mean_ms must be above zero and at most e2e_mean_ms",
            row.at()
        );
    }
    let ttft_p90_ms = row.f64_opt("ttft_p90_ms")?;
    let e2e_p90_ms = row.f64_opt("e2e_p90_ms")?;
    let mbt = row.u32_opt("max_num_batched_tokens")?;
    let max_num_seqs = row.u32_opt("max_num_seqs")?;
    let max_model_len = row.u32_opt("max_model_len")?;
    let block_size = row.u32_opt("block_size")?;
    let kv_blocks = row.u32_opt("gpu_kv_blocks")?;
    let util = row.f64_opt("gpu_mem_util")?;
    let mean_input = row.f64_opt("mean_input_tokens")?;
    let mean_output = row.f64_opt("mean_output_tokens")?;
    let itl = row.f64_opt("itl_star_ms")?;
    let ok = row.f64_opt("ok")?;
    let failed = row.f64_opt("failed")?;
    let offload = row.bool_opt("cpu_offload")?;
    let stages_cell = row.get("rate_stages");
    let class = row.get("workload_class");
    let notes = row.get("notes").unwrap_or("");

    let Some(model) = models.get(row.get("model").unwrap_or("")) else {
        return Ok(Err(format!(
            "no row for model {:?} in models.csv",
            row.get("model").unwrap_or("")
        )));
    };
    let gpu = match gpu_spec(row.get("gpu").unwrap_or("")) {
        Ok(g) => g,
        Err(e) => return Ok(Err(e)),
    };
    let Some(profile) = class.and_then(|c| profiles.get(c)) else {
        return Ok(Err(format!(
            "no workload class {:?} in workload_profiles.csv",
            class.unwrap_or("")
        )));
    };
    let stages_text = match stages_cell {
        Some(s) => s,
        None => {
            info.assumptions.push("stages: class profile".to_owned());
            &profile.rate_stages
        }
    };
    let stages = match parse_rate_stages(stages_text) {
        Ok(s) => s,
        Err(e) => bail!("{}: {e}", row.at()),
    };
    let block_size = block_size.unwrap_or(DEFAULT_BLOCK_SIZE).max(1);
    let num_blocks = match kv_blocks {
        Some(b) if b > 0 => b,
        _ => {
            info.assumptions.push("KV blocks: derived from memory".to_owned());
            let deployment = Deployment {
                model,
                gpu: &gpu,
                tensor_parallel: tp,
                gpu_memory_utilization: util.unwrap_or(0.9),
            };
            let limits = PassLimits {
                block_size,
                max_num_batched_tokens: mbt.unwrap_or(DEFAULT_MAX_NUM_BATCHED_TOKENS).max(1),
                max_num_seqs: max_num_seqs.unwrap_or(DEFAULT_MAX_NUM_SEQS).max(1),
            };
            match deployment.kv_blocks(limits) {
                Ok(b) => b,
                Err(e) => return Ok(Err(e.to_string())),
            }
        }
    };
    let prompt = match mean_input {
        Some(x) if x >= 1.0 => x.round() as u32,
        _ => {
            info.assumptions
                .push(format!("input: profile + {TEMPLATE_TOKENS}"));
            profile.system_prompt_tokens + profile.question_tokens + TEMPLATE_TOKENS
        }
    };
    let output = match mean_output {
        Some(x) if x >= 1.0 => x.round() as u32,
        _ => profile.output_tokens,
    };
    if offload == Some(true) {
        info.assumptions.push("CPU offload not simulated".to_owned());
    }
    let itl_ms = match itl {
        Some(x) => x,
        None if output > 1 => (e2e_mean_ms - ttft_mean_ms) / f64::from(output - 1),
        None => 0.0,
    };
    let failed_share = match (ok, failed) {
        (Some(ok), Some(f)) if ok + f > 0.0 => f / (ok + f),
        _ => 0.0,
    };
    let saturated = failed_share > SATURATED_FAILED_SHARE || notes.to_ascii_lowercase().contains("saturated");
    let system = profile.system_prompt_tokens.min(prompt);
    Ok(Ok(CalibrationRun {
        id: id.to_owned(),
        engine: EngineSetup {
            model: model.clone(),
            gpu,
            tensor_parallel: tp,
            max_num_seqs: max_num_seqs.unwrap_or(DEFAULT_MAX_NUM_SEQS).max(1),
            max_num_batched_tokens: mbt.unwrap_or(DEFAULT_MAX_NUM_BATCHED_TOKENS).max(1),
            max_model_len: max_model_len
                .unwrap_or(DEFAULT_MAX_MODEL_LEN)
                .max(prompt + output + block_size),
            block_size,
            num_blocks,
        },
        profile: SharedPrefixProfile {
            prefix_groups: profile.prefix_groups,
            users_per_group: profile.users_per_group,
            system_prompt_tokens: system,
            question_tokens: prompt - system,
            output_tokens: output,
            stages,
            seed: WORKLOAD_SEED,
        },
        measured: Latencies {
            ttft_mean_ms,
            ttft_p90_ms,
            e2e_mean_ms,
            e2e_p90_ms,
            itl_ms,
        },
        saturated,
    }))
}

/// Reads the traced steps (`steps_calibration.csv`, gunzipped) of the runs in `runs`; steps
/// of other runs, and steps without a next-step gap, are skipped.
pub fn read_steps(table: &Table, runs: &[CalibrationRun]) -> anyhow::Result<Vec<StepSample>> {
    table.require(&[
        "run_id",
        "next_step_start_gap_us",
        "num_prefill_reqs",
        "num_decode_reqs",
        "prefill_tokens",
    ])?;
    let mut out = Vec::new();
    for row in table.rows() {
        let Some(run) = runs.iter().position(|r| Some(r.id.as_str()) == row.get("run_id")) else {
            continue;
        };
        let Some(gap_us) = row.f64_opt("next_step_start_gap_us")? else {
            continue;
        };
        let r = &runs[run];
        let input = f64::from(r.profile.system_prompt_tokens + r.profile.question_tokens);
        let output = f64::from(r.profile.output_tokens);
        let prefill_seqs = row.f64("num_prefill_reqs")?;
        let prefill_tokens = row.f64("prefill_tokens")?;
        let decode = row.f64("num_decode_reqs")?;
        // The trace has no context lengths: a decoding request is halfway through its output,
        // a prefill chunk comes after the rest of its prompt.
        let per_chunk = if prefill_seqs > 0.0 {
            prefill_tokens / prefill_seqs
        } else {
            0.0
        };
        let context = (input - per_chunk).max(0.0);
        out.push(StepSample {
            run,
            shape: PassShape {
                prefill_seqs,
                prefill_tokens,
                prefill_context_tokens: prefill_seqs * context,
                prefill_attention_pairs: prefill_seqs
                    * (per_chunk * context + per_chunk * (per_chunk + 1.0) / 2.0),
                decode_seqs: decode,
                decode_context_tokens: decode * (input + output / 2.0),
            },
            gap_secs: gap_us / 1e6,
        });
    }
    Ok(out)
}

/// Reads the file at `path` into a table named by its file name (`.gz` unzipped).
pub fn read_table(path: &Path) -> anyhow::Result<Table> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let text = if path.extension().is_some_and(|e| e == "gz") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut flate2::read::GzDecoder::new(&bytes[..]), &mut s)
            .with_context(|| format!("unzipping {}", path.display()))?;
        s
    } else {
        String::from_utf8(bytes).with_context(|| format!("{} is not UTF-8", path.display()))?
    };
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Table::parse(&name, &text)
}
