//! Disaggregated runs: a prefill pool and a decode pool under the real router's decider, KV
//! moving over the link between them.

mod common;

use std::time::Duration;

use common::{count, run, shrink};
use kvroute_core::router::Decider;
use kvroute_sim::synthetic::{Lengths, SyntheticConfig, generate};
use kvroute_sim::{KvTransfer, SimConfig, Simulation, Topology, Workload};

/// 2 prefill + 4 decode workers of 256 blocks of 16 tokens.
fn config(decider: Decider) -> SimConfig {
    let mut config = shrink(SimConfig::disaggregated(2, 4));
    config.router.decider = decider;
    config
}

/// Every request generates at least 2 tokens, so every disaggregated one moves to decode.
fn workload() -> Workload {
    generate(
        &SyntheticConfig {
            requests: 150,
            rate_rps: 60.0,
            isl: Lengths::Uniform { min: 32, max: 600 },
            osl: Lengths::Uniform { min: 2, max: 40 },
            prefix_groups: 4,
            shared_prefix_tokens: 256,
            turns_per_session: 2,
            think_time: Duration::from_millis(100),
            ..SyntheticConfig::default()
        },
        16,
    )
}

#[test]
fn a_disaggregated_run_completes_everything_and_is_deterministic() {
    let workload = workload();
    let a = run(
        config(Decider::PrefixThreshold { uncached_tokens: 128 }),
        &workload,
    );
    assert_eq!(count(&a, "completed_requests"), 150);
    assert_eq!(count(&a, "unfinished_requests"), 0);
    assert_eq!(count(&a, "num_prefill_workers"), 2);
    assert_eq!(count(&a, "num_decode_workers"), 4);
    let transfers = count(&a, "kv_transfers");
    assert!(transfers > 0 && transfers < 150, "{transfers}");
    assert_eq!(transfers, count(&a, "disaggregated_requests"));
    // Per-pool worker-seconds split the fleet's.
    let split = a.report.number("prefill_worker_seconds").unwrap()
        + a.report.number("decode_worker_seconds").unwrap();
    assert!((split - a.report.number("worker_seconds").unwrap()).abs() < 1e-6);
    // Every request ran on a decode worker (ids 2..6); prefill workers never decode.
    assert!(a.requests.iter().all(|r| r.worker.is_some_and(|w| w >= 2)));
    let b = run(
        config(Decider::PrefixThreshold { uncached_tokens: 128 }),
        &workload,
    );
    assert_eq!(
        serde_json::to_string(&a.report).unwrap(),
        serde_json::to_string(&b.report).unwrap()
    );
}

#[test]
fn decider_never_transfers_nothing_and_always_transfers_every_request() {
    let workload = workload();
    let never = run(config(Decider::Never), &workload);
    assert_eq!(count(&never, "completed_requests"), 150);
    assert_eq!(count(&never, "kv_transfers"), 0);
    assert_eq!(count(&never, "kv_transfer_bytes"), 0);
    assert_eq!(never.report.number("prefill_busy_worker_seconds"), Some(0.0));
    let always = run(config(Decider::Always), &workload);
    assert_eq!(count(&always, "completed_requests"), 150);
    assert_eq!(count(&always, "kv_transfers"), 150);
    assert_eq!(count(&always, "disaggregated_requests"), 150);
    let blocks = count(&always, "kv_transfer_blocks") + count(&always, "kv_transfer_hit_blocks");
    let prompt_blocks: u64 = workload
        .requests
        .iter()
        .map(|r| u64::from(r.prompt_tokens.div_ceil(16)))
        .sum();
    assert_eq!(blocks, prompt_blocks, "each prompt block is hit or transferred");
    assert_eq!(
        count(&always, "kv_transfer_bytes"),
        count(&always, "kv_transfer_blocks") * 16 * 131_072
    );
}

#[test]
fn the_transfer_time_is_base_latency_plus_bytes_over_bandwidth() {
    let link = KvTransfer::default();
    // 10 blocks of 64 tokens of Llama-3.1-8B fp16: 640 × 131,072 = 83,886,080 bytes; at
    // 64e9 bytes/s that is 1,310,720 ns, plus 50 µs.
    assert_eq!(link.bytes(10, 64), 83_886_080);
    assert_eq!(link.duration(10, 64), Duration::from_nanos(1_360_720));
    assert_eq!(link.duration(0, 64), Duration::from_micros(50));
    assert_eq!(
        KvTransfer::model_bytes_per_token("llama-3.1-8b").unwrap(),
        131_072
    );

    // One request of 100 tokens (7 blocks of 16) through a link of 1e9 bytes/s, 1 ms latency,
    // 1,000 bytes per token: 7 × 16 × 1,000 = 112,000 bytes, 112 µs + 1 ms.
    let mut config = config(Decider::Always);
    config.transfer = KvTransfer {
        bandwidth_bytes_per_s: 1e9,
        bytes_per_token: 1000,
        base_latency: Duration::from_millis(1),
    };
    let mut workload = generate(
        &SyntheticConfig {
            requests: 1,
            isl: Lengths::Fixed(100),
            osl: Lengths::Fixed(5),
            prefix_groups: 0,
            ..SyntheticConfig::default()
        },
        16,
    );
    workload.requests.truncate(1);
    let result = run(config, &workload);
    assert_eq!(count(&result, "kv_transfer_bytes"), 112_000);
    assert_eq!(result.report.number("mean_kv_transfer_ms"), Some(1.112));
    // The transfer sits between the first token (from the prefill worker) and the second.
    let r = &result.requests[0];
    assert_eq!(r.output_tokens, 5);
    assert!(r.e2e_latency_ms.unwrap() - r.ttft_ms.unwrap() > 1.112);
}

#[test]
fn a_disaggregated_topology_needs_both_pools() {
    let mut config = config(Decider::Always);
    config.topology = Topology::Disaggregated {
        prefill: 0,
        decode: 4,
    };
    assert!(Simulation::new(config).is_err());
}

#[test]
fn imports_wait_for_decode_blocks_under_kv_pressure() {
    let workload = workload();
    let mut config = config(Decider::Always);
    config.engine.num_blocks = 80;
    let result = run(config, &workload);
    assert_eq!(
        count(&result, "completed_requests") + count(&result, "rejected_requests"),
        150
    );
    assert_eq!(
        count(&result, "kv_transfers"),
        count(&result, "completed_requests")
    );
    assert!(
        count(&result, "kv_import_waits") > 0,
        "the small decode caches make imports wait"
    );
}
