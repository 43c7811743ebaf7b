//! The planner, live and simulated: one planner, two drivers.

use std::time::Duration;

use kvroute::plan::PlanFile;
use kvroute_planner::Action;
use kvroute_sim::synthetic::{self, Lengths, SyntheticConfig};
use kvroute_sim::{PlannerSetup, SimConfig, Simulation};

/// A planner file whose `[engine]` names every key the simulator's engine sets, so the live
/// path (`PlanFile::live_planner`, what `serve --planner` runs) and the simulator profile the
/// same engine.
const PLAN: &str = r#"
[planner]
mode = "agg"
min_replicas = 1
max_gpu_budget = 6
model_seed = "profile"
scale_down_ticks = 2
throughput_interval_s = 60
startup_delay_s = 5

[planner.sla]
ttft_ms = 400
itl_ms = 30

[engine]
block_size = 64
num_blocks = 16384
max_num_seqs = 256
max_num_batched_tokens = 8192
speedup = 1.0
timing = { kind = "polynomial" }
"#;

/// A low, high, low ramp of single-turn requests.
fn ramp(block_size: u32) -> kvroute_sim::workload::Workload {
    let mut w = synthetic::generate(
        &SyntheticConfig {
            requests: 900,
            rate_rps: 3.0,
            isl: Lengths::Uniform { min: 1024, max: 4096 },
            osl: Lengths::Uniform { min: 32, max: 256 },
            ..SyntheticConfig::default()
        },
        block_size,
    );
    w.warp_rate(&[(0.0, 0.3), (60.0, 0.3), (90.0, 3.0), (180.0, 3.0), (210.0, 0.3)])
        .expect("a valid profile");
    w
}

#[test]
fn one_observation_sequence_gives_the_same_decisions_live_and_simulated() {
    let plan = PlanFile::parse(PLAN).expect("a valid planner file");
    let mut config = SimConfig::new(2);
    config.engine = plan.engine.over(&config.engine);
    let live_engine = plan.live_engine();
    assert_eq!(
        kvroute_sim::profile::passes(&config.engine).expect("timed"),
        kvroute_sim::profile::passes(&live_engine).expect("timed"),
        "both drivers profile one engine"
    );
    assert_eq!(
        kvroute_sim::profile::limits(&config.engine),
        kvroute_sim::profile::limits(&live_engine)
    );
    config.sample_interval = None;
    config.planner = Some(PlannerSetup {
        config: plan.planner.clone(),
        sla_window: Duration::from_secs(30),
        keep_observations: true,
    });
    let workload = ramp(config.engine.block_size);
    let run = Simulation::new(config)
        .expect("valid")
        .run(&workload, &mut |_| {})
        .expect("the run ends");
    let sim = run.planner.expect("a planned run");
    let (ups, downs) = sim
        .decisions
        .iter()
        .flat_map(|d| &d.actions)
        .fold((0, 0), |(u, d), a| match a {
            Action::Add { .. } => (u + 1, d),
            Action::Remove { .. } => (u, d + 1),
        });
    assert!(
        ups > 0 && downs > 0,
        "the ramp scales up and down: {:?}",
        sim.decisions
    );

    // The live planner, built as `serve --planner` builds it, handed the same observations.
    let mut live = plan
        .live_planner(kvroute_core::time::Timestamp::ZERO)
        .expect("the live planner");
    let decisions: Vec<_> = sim
        .observations
        .iter()
        .filter_map(|(at, obs)| live.tick(*at, obs).decision)
        .collect();
    assert_eq!(decisions, sim.decisions);
}
