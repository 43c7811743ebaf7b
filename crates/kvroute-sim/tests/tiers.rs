//! A CPU tier (vLLM's native offloading) on small GPU caches, on an in-repo multi-turn
//! workload: every run keeps the invariants (the routers' indexes hold each engine's CPU tier
//! too), the engines load blocks back from it, and routing that counts those blocks as a cheap
//! hit (`kv`, a tier block at a quarter of a prefilled one) beats routing that counts them as a
//! miss (`kv:tier=1`).

use std::time::Duration;

mod common;

use common::{count, run, shrink};
use kvroute_core::router::PolicyConfig;
use kvroute_engine::{CpuOffload, KvTransfer};
use kvroute_sim::synthetic::{Lengths, SyntheticConfig, generate};
use kvroute_sim::{RunResult, SimConfig, Workload};

/// Conversations whose history outgrows the GPU caches: 4 workers of 256 blocks of 16 tokens,
/// each turn's prompt the whole conversation so far.
fn conversations() -> Workload {
    generate(
        &SyntheticConfig {
            requests: 400,
            rate_rps: 20.0,
            isl: Lengths::Uniform { min: 200, max: 600 },
            osl: Lengths::Uniform { min: 8, max: 40 },
            prefix_groups: 40,
            shared_prefix_tokens: 64,
            turns_per_session: 5,
            think_time: Duration::from_millis(1500),
            ..SyntheticConfig::default()
        },
        16,
    )
}

fn config(policy: &str, cpu_blocks: Option<u32>) -> SimConfig {
    let mut config = shrink(SimConfig::new(4));
    config.router.policy = policy.parse::<PolicyConfig>().expect("a policy");
    config.engine.cpu_offload = cpu_blocks.map(|n| CpuOffload::new(n, KvTransfer::default()));
    config
}

fn mean_ttft(result: &RunResult) -> f64 {
    result.report.number("mean_ttft_ms").expect("mean TTFT")
}

#[test]
fn tier_aware_routing_beats_tier_blind_routing_on_small_gpu_caches() {
    let workload = conversations();
    let aware = run(config("kv", Some(2048)), &workload);
    let blind = run(config("kv:tier=1", Some(2048)), &workload);
    let none = run(config("kv", None), &workload);
    for (name, r) in [("aware", &aware), ("blind", &blind), ("none", &none)] {
        assert_eq!(count(r, "completed_requests"), 400, "{name}");
        assert_eq!(count(r, "unfinished_requests"), 0, "{name}");
    }
    let (a, b, n) = (mean_ttft(&aware), mean_ttft(&blind), mean_ttft(&none));
    assert!(a < b, "tier-aware TTFT mean {a} ms, tier-blind {b} ms");
    assert!(b < n, "with a CPU tier {b} ms, without {n} ms");
}
