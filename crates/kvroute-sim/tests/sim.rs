//! Runs through the public API: invariants under every policy, determinism, lossy and lagging
//! KV events, closed loops, the router queue, and the traces (built-in, and shared ones where
//! they exist).

use std::io::{BufReader, Read};
use std::path::Path;
use std::time::Duration;

mod common;

use common::{count, run, shrink};
use kvroute_core::router::{CacheMode, PolicyConfig, RecentConfig};
use kvroute_sim::synthetic::{Lengths, SyntheticConfig, generate};
use kvroute_sim::{ArrivalMode, EventChannel, RunResult, SimConfig, Simulation, Workload, trace};

/// A small fleet whose caches fill and evict: 4 workers of 256 blocks of 16 tokens.
fn small_config() -> SimConfig {
    shrink(SimConfig::new(4))
}

fn small_workload() -> Workload {
    generate(
        &SyntheticConfig {
            requests: 120,
            rate_rps: 40.0,
            isl: Lengths::Uniform { min: 32, max: 400 },
            osl: Lengths::Uniform { min: 1, max: 40 },
            prefix_groups: 4,
            shared_prefix_tokens: 128,
            turns_per_session: 2,
            think_time: Duration::from_millis(200),
            ..SyntheticConfig::default()
        },
        16,
    )
}

fn json(result: &RunResult) -> String {
    serde_json::to_string(&result.report).expect("serializable")
}

#[test]
fn every_policy_completes_every_request_and_keeps_the_invariants() {
    let workload = small_workload();
    for name in PolicyConfig::NAMES {
        let mut config = small_config();
        config.router.policy = PolicyConfig::from_name(name).unwrap();
        let result = run(config, &workload);
        assert_eq!(count(&result, "completed_requests"), 120, "{name}");
        assert_eq!(count(&result, "unfinished_requests"), 0, "{name}");
        assert_eq!(result.requests.len(), 120);
        assert!(
            result.report.number("prefix_cache_reused_ratio").unwrap() > 0.0,
            "{name}"
        );
    }
}

#[test]
fn the_same_seed_gives_a_byte_identical_report() {
    let workload = small_workload();
    let mut config = small_config();
    config.router.policy = PolicyConfig::from_name("power-of-two").unwrap();
    config.events = EventChannel {
        lag: Duration::from_millis(30),
        loss: 0.1,
    };
    let a = run(config.clone(), &workload);
    let b = run(config.clone(), &workload);
    assert_eq!(json(&a), json(&b));
    assert_eq!(a.requests, b.requests);
    assert_eq!(a.series, b.series);
    config.seed = 99;
    config.router.seed = 99;
    assert_ne!(json(&run(config, &workload)), json(&a), "the seed matters");
}

#[test]
fn lagging_and_lossy_events_are_counted_not_fatal() {
    let workload = small_workload();
    let mut config = small_config();
    config.router.policy = PolicyConfig::from_name("dynamo").unwrap();
    config.events = EventChannel {
        lag: Duration::from_millis(500),
        loss: 0.3,
    };
    let result = run(config, &workload);
    assert_eq!(count(&result, "completed_requests"), 120);
    assert!(count(&result, "kv_events_lost") > 0);
    // Lag without loss: the index ends equal to the engines' caches (checked by the run).
    let mut config = small_config();
    config.events.lag = Duration::from_millis(50);
    config.router.cache = CacheMode::EventsWithPrediction(RecentConfig::PREDICT_ON_ROUTE);
    assert_eq!(count(&run(config, &workload), "completed_requests"), 120);
}

#[test]
fn closed_loop_and_router_queue_drain() {
    let workload = small_workload();
    let mut config = small_config();
    config.arrivals = ArrivalMode::Closed { concurrency: 64 };
    config.router.busy.requests_fraction = Some(0.25);
    let result = run(config, &workload);
    assert_eq!(count(&result, "completed_requests"), 120);
    assert!(
        count(&result, "router_queued_requests") > 0,
        "the busy threshold queued requests"
    );
}

#[test]
fn engine_rejections_are_counted() {
    // Prompts longer than max_model_len are turned away by the engine, and the router is told.
    let workload = small_workload();
    let mut config = small_config();
    config.engine.max_model_len = 300;
    let result = run(config, &workload);
    let (done, rejected) = (
        count(&result, "completed_requests"),
        count(&result, "rejected_requests"),
    );
    assert!(rejected > 0);
    assert_eq!(done + rejected, count(&result, "arrived_requests"));
}

#[test]
fn mismatched_block_sizes_are_refused() {
    let mut config = small_config();
    config.router.block_size = 32;
    assert!(Simulation::new(config).is_err());
    let sim = Simulation::new(small_config()).unwrap();
    assert!(sim.run(&Workload::new(64), &mut |_| {}).is_err());
}

fn gunzip(bytes: impl Read) -> BufReader<flate2::read::GzDecoder<impl Read>> {
    BufReader::new(flate2::read::GzDecoder::new(bytes))
}

#[test]
fn the_built_in_trace_replays() {
    let workload =
        trace::read_mooncake(gunzip(kvroute_sim::EXAMPLE_MOONCAKE_GZ), 512, 64, Some(150)).unwrap();
    assert_eq!(workload.requests.len(), 150);
    let mut config = SimConfig::new(4);
    config.router.policy = PolicyConfig::from_name("dynamo").unwrap();
    let result = run(config, &workload);
    assert_eq!(count(&result, "completed_requests"), 150);
    assert!(result.report.number("prefix_cache_reused_ratio").unwrap() > 0.0);
}

#[test]
fn shared_traces_replay_where_present() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    let cases = [
        ("mooncake_conversation_trace.jsonl.gz", "mooncake"),
        ("mooncake_synthetic_trace.jsonl.gz", "mooncake"),
        ("azure_llm_2023_code.csv.gz", "azure"),
        ("azure_llm_2023_conv.csv.gz", "azure"),
    ];
    for (file, format) in cases {
        let path = dir.join(file);
        let Ok(f) = std::fs::File::open(&path) else {
            println!("skipped: {} not found", path.display());
            continue;
        };
        let reader = gunzip(f);
        let workload = match format {
            "mooncake" => trace::read_mooncake(reader, 512, 64, Some(60)).unwrap(),
            _ => trace::read_azure(reader, 64, Some(60)).unwrap(),
        };
        assert_eq!(workload.requests.len(), 60, "{file}");
        let result = run(SimConfig::new(4), &workload);
        assert_eq!(count(&result, "completed_requests"), 60, "{file}");
    }
}

#[test]
fn an_approximate_view_routes_on_its_own_decisions_alone() {
    // The engines publish their KV events and the router refuses them, as the live proxy's
    // does; its overlaps come from its record of where it sent each prompt.
    let workload = small_workload();
    let mut config = small_config();
    config.router.cache = "approximate".parse().expect("a cache view");
    let result = run(config, &workload);
    assert_eq!(count(&result, "completed_requests"), 120);
    assert_eq!(count(&result, "kv_events_refused"), 0);
    let overlap = result
        .report
        .number("router_predicted_overlap_ratio")
        .expect("an overlap ratio");
    assert!(overlap > 0.0, "shared prefixes were predicted cached: {overlap}");
}
