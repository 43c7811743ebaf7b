//! The engine as the planner knows it before it has seen a pass: its limits, and a profile of
//! forward passes of chosen shapes timed by the engine's own timing model (what Dynamo's
//! pre-deployment profiling measures on the real engine). The simulator and the live planner
//! both build their planner here, so a profiled planner starts from the same model in either.

use kvroute_core::time::Timestamp;
use kvroute_engine::{EngineConfig, ForwardPass};
use kvroute_planner::{EngineLimits, ModelSeed, PassSample, Planner, PlannerConfig};

use crate::error::SimError;

/// What the planner knows of `engine`'s limits.
pub fn limits(engine: &EngineConfig) -> EngineLimits {
    EngineLimits {
        max_num_batched_tokens: engine.max_num_batched_tokens,
        max_num_seqs: engine.max_num_seqs,
        kv_capacity_tokens: u64::from(engine.num_blocks) * u64::from(engine.block_size),
    }
}

/// Passes of prefill chunks, of decode batches and of both, over `engine`'s range of batch
/// sizes and resident KV, each timed by its timing model (speedup applied, as the engine runs).
pub fn passes(engine: &EngineConfig) -> Result<Vec<PassSample>, SimError> {
    let timing = engine
        .timing
        .build()
        .map_err(|e| SimError::Config(format!("the engine's timing model: {e}")))?;
    let bs = u64::from(engine.block_size.max(1));
    let mbt = u64::from(engine.max_num_batched_tokens.max(1));
    let seqs_max = engine.max_num_seqs.max(1);
    let kv_cap = u64::from(engine.num_blocks) * bs;
    let time = |pass: &ForwardPass| timing.pass_secs(pass) / engine.speedup;
    let mut out = Vec::new();
    let chunks = [1, 2, 4, 8].map(|d| (mbt / d).max(1));
    let batches = [1, 2, 4, 8].map(|d| (seqs_max / d).max(1));
    let contexts = [256u64, 1024, 4096];
    for &n in &chunks {
        for &ctx in &[0u64, 2048] {
            let pass = ForwardPass {
                prefill_seqs: 1,
                prefill_tokens: n,
                prefill_context_tokens: ctx,
                prefill_attention_pairs: n * ctx + n * (n + 1) / 2,
                kv_active_blocks: ((ctx + n).div_ceil(bs)).min(u64::from(u32::MAX)) as u32,
                kv_total_blocks: engine.num_blocks,
                ..ForwardPass::default()
            };
            out.push(sample(&pass, bs, time(&pass)));
        }
    }
    for &seqs in &batches {
        for &ctx in &contexts {
            let resident = (u64::from(seqs) * ctx).min(kv_cap);
            let decode = ForwardPass {
                decode_seqs: seqs,
                decode_context_tokens: resident,
                kv_active_blocks: resident.div_ceil(bs).min(u64::from(u32::MAX)) as u32,
                kv_total_blocks: engine.num_blocks,
                ..ForwardPass::default()
            };
            out.push(sample(&decode, bs, time(&decode)));
            // The same batch beside a prefill chunk, as an aggregated engine runs it.
            let n = (mbt - u64::from(seqs).min(mbt - 1)).max(1) / 2;
            let mixed = ForwardPass {
                prefill_seqs: 1,
                prefill_tokens: n,
                prefill_attention_pairs: n * (n + 1) / 2,
                kv_active_blocks: (resident + n).div_ceil(bs).min(u64::from(u32::MAX)) as u32,
                ..decode
            };
            out.push(sample(&mixed, bs, time(&mixed)));
        }
    }
    Ok(out)
}

fn sample(pass: &ForwardPass, block_size: u64, duration_s: f64) -> PassSample {
    PassSample {
        prefill_tokens: pass.prefill_tokens,
        decode_seqs: pass.decode_seqs,
        kv_tokens: u64::from(pass.kv_active_blocks) * block_size,
        duration_s,
    }
}

/// The planner of `config` for workers running `engine`, started at `start`: seeded with the
/// engine's profile when the configuration asks for it ([`ModelSeed::Profile`]).
pub fn planner(config: &PlannerConfig, engine: &EngineConfig, start: Timestamp) -> Result<Planner, SimError> {
    let mut planner = Planner::new(config.clone(), limits(engine), start)?;
    if config.model_seed == ModelSeed::Profile {
        let samples = passes(engine)?;
        for &pool in config.mode.pools() {
            planner.seed(pool, &samples);
        }
    }
    Ok(planner)
}

#[cfg(test)]
mod tests {
    use kvroute_planner::{Mode, Pool};

    use super::*;

    #[test]
    fn a_profiled_planner_has_a_model_of_every_pool_before_any_pass() {
        let engine = crate::SimConfig::new(2).engine;
        for mode in [Mode::Agg, Mode::Disagg] {
            let config = PlannerConfig {
                mode,
                model_seed: ModelSeed::Profile,
                ..PlannerConfig::default()
            };
            let p = planner(&config, &engine, Timestamp::ZERO).expect("valid");
            for &pool in mode.pools() {
                let model = p.model(pool).expect("a scaled pool has a model");
                assert!(model.fitted().is_some(), "{mode:?} {pool:?}");
            }
            let unseeded = planner(
                &PlannerConfig {
                    model_seed: ModelSeed::None,
                    ..config
                },
                &engine,
                Timestamp::ZERO,
            )
            .expect("valid");
            assert!(unseeded.model(mode.pools()[0]).expect("model").fitted().is_none());
        }
        // Longer prompts take longer on the profiled prefill model, as on the engine.
        let config = PlannerConfig {
            mode: Mode::Disagg,
            model_seed: ModelSeed::Profile,
            ..PlannerConfig::default()
        };
        let p = planner(&config, &engine, Timestamp::ZERO).expect("valid");
        let m = p.model(Pool::Prefill).expect("prefill");
        let short = m.ttft_ms(0.0, 256.0, 0.0, 0.0).expect("fitted");
        let long = m.ttft_ms(0.0, 4096.0, 0.0, 0.0).expect("fitted");
        assert!(long > short && short > 0.0, "{short} {long}");
    }
}
