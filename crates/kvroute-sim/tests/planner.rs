//! The planner in the loop: a ramp makes it scale up, workers join and leave without breaking
//! the simulator's invariants, runs are deterministic, and without a planner the report has none
//! of its keys.

use std::time::Duration;

mod common;

use common::{count, run};
use kvroute_planner::{Action, Mode, PlannerConfig, Sla};
use kvroute_sim::synthetic::{Lengths, SyntheticConfig, generate};
use kvroute_sim::{Arrival, PlannerSetup, RunResult, SimConfig, Workload};

/// Single-turn requests at 1 req/s, re-timed into a ramp to 8x and back down.
fn ramp_workload() -> Workload {
    let mut w = generate(
        &SyntheticConfig {
            requests: 400,
            rate_rps: 1.0,
            isl: Lengths::Uniform { min: 4000, max: 8000 },
            osl: Lengths::Uniform { min: 20, max: 120 },
            prefix_groups: 8,
            shared_prefix_tokens: 512,
            turns_per_session: 1,
            ..SyntheticConfig::default()
        },
        64,
    );
    w.warp_rate(&[(0.0, 1.0), (20.0, 1.0), (40.0, 8.0), (60.0, 8.0), (70.0, 1.0)])
        .expect("valid profile");
    w
}

fn planner(mode: Mode) -> PlannerSetup {
    PlannerSetup {
        config: PlannerConfig {
            mode,
            sla: Sla {
                ttft_ms: 800.0,
                itl_ms: 40.0,
            },
            throughput_interval_s: 30.0,
            startup_delay_s: 10.0,
            max_gpu_budget: 8,
            scale_down_ticks: 2,
            ..PlannerConfig::default()
        },
        sla_window: Duration::from_secs(30),
        keep_observations: false,
        observe: kvroute_planner::Observe::Engines,
    }
}

fn json(result: &RunResult) -> String {
    serde_json::to_string(&result.report).expect("serializable")
}

fn added(result: &RunResult) -> u64 {
    count(result, "planner_workers_added")
}

#[test]
fn warp_rate_compresses_arrivals_where_the_multiplier_is_high() {
    let mut w = generate(
        &SyntheticConfig {
            requests: 200,
            rate_rps: 1.0,
            turns_per_session: 1,
            ..SyntheticConfig::default()
        },
        64,
    );
    let before: Vec<f64> = w.requests.iter().map(arrival_s).collect();
    w.warp_rate(&[(0.0, 2.0)]).expect("valid");
    for (r, b) in w.requests.iter().zip(&before) {
        assert!((arrival_s(r) - b / 2.0).abs() < 1e-6);
    }
    assert!(w.warp_rate(&[(10.0, 1.0), (5.0, 1.0)]).is_err());
    assert!(w.warp_rate(&[(0.0, 0.0)]).is_err());
}

fn arrival_s(r: &kvroute_sim::SimRequest) -> f64 {
    match r.arrival {
        Arrival::At(t) => t.as_secs_f64(),
        Arrival::After { .. } => f64::NAN,
    }
}

#[test]
fn a_ramp_makes_an_aggregated_fleet_scale_up_and_back_down() {
    let workload = ramp_workload();
    let mut config = SimConfig::new(1);
    config.planner = Some(planner(Mode::Agg));
    let result = run(config, &workload);
    assert_eq!(count(&result, "completed_requests"), 400);
    assert_eq!(count(&result, "unfinished_requests"), 0);
    assert!(added(&result) >= 1, "{}", json(&result));
    assert!(
        count(&result, "planner_workers_removed") >= 1,
        "{}",
        json(&result)
    );
    let p = result.planner.as_ref().expect("planner record");
    assert!(!p.ticks.is_empty() && !p.windows.is_empty());
    // Every decision says why, and a removed worker was ready when it was removed.
    for d in &p.decisions {
        assert!(!d.text.is_empty() && !d.changes.is_empty());
    }
    for life in &p.workers {
        if let (Some(ready), Some(removed)) = (life.ready_s, life.removed_s) {
            assert!(life.provisioned_s <= ready && ready <= removed, "{life:?}");
        }
        if life.provisioned_s > 0.0 {
            let ready = life.ready_s.expect("started workers become ready");
            assert!(
                (ready - life.provisioned_s - 10.0).abs() < 1e-6,
                "startup delay: {life:?}"
            );
        }
    }
    // GPU-seconds count provisioned workers, startup included: more than the fixed worker alone.
    let duration_s = result.report.number("duration_ms").expect("duration") / 1e3;
    assert!(result.report.number("worker_seconds").expect("worker seconds") > duration_s);
}

#[test]
fn a_disaggregated_fleet_grows_and_shrinks_without_leaking_load() {
    let workload = ramp_workload();
    let mut config = SimConfig::disaggregated(1, 1);
    config.planner = Some(planner(Mode::Disagg));
    // The run ends by checking: arrived = completed + rejected + unfinished, router load drained,
    // engines' blocks conserved and the index equal to the caches of the workers still present.
    let result = run(config, &workload);
    assert_eq!(count(&result, "completed_requests"), 400);
    assert!(added(&result) >= 1, "{}", json(&result));
    let p = result.planner.as_ref().expect("planner record");
    for t in &p.ticks {
        let gpus: u32 = t.pools.iter().map(|s| s.ready + s.starting + s.draining).sum();
        assert!(gpus <= 8, "budget exceeded at {}", t.at_s);
    }
    let pools: Vec<_> = p
        .decisions
        .iter()
        .flat_map(|d| &d.actions)
        .map(|a| match a {
            Action::Add { pool } | Action::Remove { pool, .. } => *pool,
        })
        .collect();
    assert!(!pools.is_empty());
}

#[test]
fn runs_with_a_planner_are_deterministic() {
    let workload = ramp_workload();
    let mut config = SimConfig::new(1);
    config.planner = Some(planner(Mode::Agg));
    let a = run(config.clone(), &workload);
    let b = run(config, &workload);
    assert_eq!(json(&a), json(&b));
}

#[test]
fn without_a_planner_the_report_has_none_of_its_keys() {
    let workload = ramp_workload();
    let result = run(SimConfig::new(2), &workload);
    assert!(result.planner.is_none());
    for (key, _) in result.report.entries() {
        assert!(
            !key.starts_with("planner") && !key.starts_with("sla_") && !key.starts_with("goodput"),
            "{key}"
        );
    }
    let table = kvroute_sim::report::table(&[("kv".to_owned(), result.report.clone())]);
    assert!(!table.contains("planner"), "{table}");
}

#[test]
fn a_planner_mode_must_fit_the_topology() {
    let mut config = SimConfig::new(2);
    config.planner = Some(planner(Mode::Disagg));
    assert!(kvroute_sim::Simulation::new(config).is_err());
}
