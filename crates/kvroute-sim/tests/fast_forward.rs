//! Fast-forward over pure-decode passes changes nothing: every workload below gives the same
//! report (byte for byte), per-request records and time series with it on and off.

mod common;

use std::io::BufReader;
use std::time::Duration;

use common::{run, shrink};
use kvroute_core::router::{Decider, PolicyConfig};
use kvroute_sim::synthetic::{Lengths, SyntheticConfig, generate};
use kvroute_sim::{ArrivalMode, EventChannel, KvTransfer, SimConfig, Workload, trace};

/// Sessions and prefix groups, with outputs long enough for long decode stretches.
fn synthetic(requests: usize, rate_rps: f64, osl_max: u32) -> Workload {
    generate(
        &SyntheticConfig {
            requests,
            rate_rps,
            isl: Lengths::Uniform { min: 16, max: 500 },
            osl: Lengths::Uniform { min: 1, max: osl_max },
            prefix_groups: 4,
            shared_prefix_tokens: 128,
            turns_per_session: 3,
            think_time: Duration::from_millis(150),
            ..SyntheticConfig::default()
        },
        16,
    )
}

/// Runs `config` on `workload` with fast-forward on and off and checks that the results are
/// identical.
fn assert_same(name: &str, mut config: SimConfig, workload: &Workload) {
    config.keep_requests = true;
    config.fast_forward = true;
    let on = run(config.clone(), workload);
    config.fast_forward = false;
    let off = run(config, workload);
    let json = |r: &kvroute_sim::RunResult| serde_json::to_string(&r.report).expect("serializable");
    assert_eq!(json(&on), json(&off), "{name}: report");
    assert_eq!(on.requests, off.requests, "{name}: per-request records");
    assert_eq!(on.series, off.series, "{name}: time series");
    assert!(!on.requests.is_empty(), "{name}: records kept");
}

#[test]
fn synthetic_sessions_and_prefix_groups() {
    let workload = synthetic(200, 30.0, 300);
    for policy in ["kv", "round-robin", "least-loaded"] {
        let mut config = shrink(SimConfig::new(4));
        config.router.policy = PolicyConfig::from_name(policy).unwrap();
        config.sample_interval = Some(Duration::from_millis(7));
        assert_same(policy, config, &workload);
    }
    // Without prefix caching, and with a tight pool that preempts.
    let mut config = shrink(SimConfig::new(2));
    config.engine.enable_prefix_caching = false;
    config.engine.num_blocks = 64;
    config.engine.max_num_seqs = 8;
    assert_same(
        "no prefix caching, tight pool",
        config,
        &synthetic(120, 60.0, 200),
    );
}

#[test]
fn the_built_in_trace_truncated() {
    let reader = BufReader::new(flate2::read::GzDecoder::new(kvroute_sim::EXAMPLE_MOONCAKE_GZ));
    let workload = trace::read_mooncake(reader, 512, 64, Some(300)).unwrap();
    assert_eq!(workload.requests.len(), 300);
    for policy in ["kv", "dynamo"] {
        let mut config = SimConfig::new(4);
        config.router.policy = PolicyConfig::from_name(policy).unwrap();
        config.sample_interval = Some(Duration::from_millis(250));
        assert_same(policy, config, &workload);
    }
}

#[test]
fn lagging_and_lossy_kv_events() {
    let workload = synthetic(200, 40.0, 250);
    let mut config = shrink(SimConfig::new(4));
    config.router.policy = PolicyConfig::from_name("power-of-two").unwrap();
    config.events = EventChannel {
        lag: Duration::from_millis(30),
        loss: 0.2,
    };
    assert_same("lag and loss", config, &workload);
}

#[test]
fn closed_loop_with_the_router_queue() {
    let workload = synthetic(200, 40.0, 250);
    let mut config = shrink(SimConfig::new(4));
    config.arrivals = ArrivalMode::Closed { concurrency: 24 };
    config.router.busy.requests_fraction = Some(0.25);
    assert_same("closed loop", config, &workload);
}

#[test]
fn disaggregated() {
    // Outputs of one token end on the prefill worker; the rest move to decode.
    let workload = synthetic(150, 60.0, 200);
    let mut config = shrink(SimConfig::disaggregated(2, 4));
    config.router.decider = Decider::PrefixThreshold { uncached_tokens: 128 };
    config.transfer = KvTransfer {
        base_latency: Duration::from_millis(3),
        ..KvTransfer::default()
    };
    assert_same("disaggregated", config.clone(), &workload);
    // Decode pools short of blocks: imports wait for passes to free some.
    config.engine.num_blocks = 96;
    assert_same("disaggregated, imports waiting", config, &workload);
}
