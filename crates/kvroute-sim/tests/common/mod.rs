//! Helpers the simulator's integration tests share.

#![allow(dead_code)] // Each test file uses a different part.

use kvroute_sim::{RunResult, SimConfig, Simulation, Workload};

/// Makes `config`'s engines small enough for caches to fill and evict: 256 blocks of 16 tokens,
/// 16 sequences, 512 tokens per pass; keeps per-request records.
pub fn shrink(mut config: SimConfig) -> SimConfig {
    config.engine.block_size = 16;
    config.engine.num_blocks = 256;
    config.engine.max_num_seqs = 16;
    config.engine.max_num_batched_tokens = 512;
    config.engine.max_model_len = 4096;
    config.router.block_size = 16;
    config.keep_requests = true;
    config
}

/// Runs `workload`, which must keep the invariants.
pub fn run(config: SimConfig, workload: &Workload) -> RunResult {
    Simulation::new(config)
        .expect("valid config")
        .run(workload, &mut |_| {})
        .expect("the run keeps its invariants")
}

/// A report value as a count.
pub fn count(result: &RunResult, key: &str) -> u64 {
    result
        .report
        .number(key)
        .unwrap_or_else(|| panic!("{key} in the report")) as u64
}
