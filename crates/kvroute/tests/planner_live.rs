//! The planner, live and simulated: one planner, two drivers.

use std::time::Duration;

use kvroute::plan::PlanFile;
use kvroute_planner::Action;
use kvroute_sim::synthetic::{self, Lengths, SyntheticConfig};
use kvroute_sim::{PlannerSetup, SimConfig, Simulation};
use kvroute_testkit::Scratch;

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
    config.engine = plan.engine.over(&config.engine).expect("a valid engine");
    let live_engine = plan.live_engine().expect("a valid engine");
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
        observe: kvroute_planner::Observe::Engines,
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

#[path = "support/cluster.rs"]
#[allow(clippy::unwrap_used)]
mod cluster;

use kvroute_proxy::autoscale::process::ProcessActuator;

/// The live planner's file: one to three mock workers whose KV fills with a burst (2,048
/// blocks), so the burst breaks the ITL target and the quiet after it does not; load ticks every
/// 250 ms.
const LIVE_PLAN: &str = r#"
[planner]
mode = "agg"
min_replicas = 1
max_replicas = 3
max_gpu_budget = 3
model_seed = "profile"
load_interval_s = 0.25
throughput_scaling = false
scale_down_ticks = 4

[planner.sla]
ttft_ms = 5000
itl_ms = 15

[engine]
block_size = 16
num_blocks = 2048

[drain]
timeout_s = 60
"#;

/// A folder for the workers' logs of `test`, removed when it is dropped unless the test fails. A
/// test makes it before its fleet, so that it goes after the fleet and its workers.
fn worker_logs(test: &str) -> Scratch {
    Scratch::new(&format!("planner-live-{test}")).keep_on_failure()
}

/// A proxy with no worker (requests wait for one) and a `process` actuator starting
/// `kvroute mock` processes for it, their logs in `logs`.
async fn empty_fleet(logs: &Scratch) -> (cluster::Cluster, std::sync::Arc<ProcessActuator>) {
    use kvroute_proxy::autoscale::actuator::ProcessConfig;
    let c = cluster::fronting(Vec::new(), Vec::new(), |c| {
        c.routing.block_size = 16;
        c.routing.queue_timeout_ms = 120_000;
        c.routing.when_empty = "queue".to_owned();
    })
    .await;
    let config = ProcessConfig {
        agg: Some(cluster::mock_template(&[
            "--num-blocks",
            "2048",
            "--block-size",
            "16",
        ])),
        prefill: None,
        decode: None,
        ready_timeout_s: 60,
        stop_grace_s: 5,
        log_dir: Some(logs.path().to_owned()),
        host: "127.0.0.1".to_owned(),
    };
    let actuator = std::sync::Arc::new(ProcessActuator::new(
        config,
        std::sync::Arc::clone(&c.proxy.fleet),
    ));
    (c, actuator)
}

/// Runs the planner of `plan` on `c`'s fleet through `actuator`.
fn start_planner(c: &mut cluster::Cluster, plan: &PlanFile, actuator: &std::sync::Arc<ProcessActuator>) {
    let planner = plan
        .live_planner(c.proxy.driver.timestamp())
        .expect("the live planner");
    c.proxy.start_planner(
        planner,
        std::sync::Arc::clone(actuator) as std::sync::Arc<dyn kvroute_proxy::autoscale::Actuator>,
        kvroute_proxy::autoscale::Settings {
            drain_timeout: plan.drain.timeout().expect("a timeout"),
            ..Default::default()
        },
    );
}

/// [`empty_fleet`] with the planner of `plan` running on it.
async fn planned(plan: &PlanFile, logs: &Scratch) -> (cluster::Cluster, std::sync::Arc<ProcessActuator>) {
    let (mut c, actuator) = empty_fleet(logs).await;
    start_planner(&mut c, plan, &actuator);
    (c, actuator)
}

/// A completion of `tokens` distinct prompt tokens (seeded by `i`) and `max_tokens` outputs;
/// its HTTP status.
async fn send(c: &cluster::Cluster, i: u32, tokens: u32, max_tokens: u32) -> u16 {
    let prompt: Vec<u32> = (0..tokens).map(|t| 1 + (i * 7919 + t * 31) % 250).collect();
    let body = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens});
    c.http
        .request(
            "POST",
            "/v1/completions",
            serde_json::to_vec(&body).expect("json"),
        )
        .await
        .0
}

/// The planner's actions so far that `which` picks.
fn actions(c: &cluster::Cluster, which: impl Fn(&Action) -> bool) -> usize {
    c.proxy
        .planner
        .decisions()
        .iter()
        .flat_map(|d| d.actions.clone())
        .filter(|a| which(a))
        .count()
}

/// The planner's decisions so far with a change for a reason `which` picks.
fn decided(c: &cluster::Cluster, which: impl Fn(&kvroute_planner::Reason) -> bool) -> usize {
    c.proxy
        .planner
        .decisions()
        .iter()
        .filter(|d| d.changes.iter().any(|ch| which(&ch.reason)))
        .count()
}

fn ready(c: &cluster::Cluster) -> usize {
    c.proxy
        .driver
        .planner_workers()
        .iter()
        .filter(|w| w.state == kvroute_planner::WorkerPhase::Ready)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_ramp_grows_the_fleet_and_shrinks_it_back_without_failing_a_request() {
    let plan = PlanFile::parse(LIVE_PLAN).expect("a valid planner file");
    let logs = worker_logs("ramp");
    let (c, _actuator) = planned(&plan, &logs).await;
    // Scale from zero: the first request waits in the queue while the planner starts a worker.
    assert_eq!(
        send(&c, 0, 64, 4).await,
        200,
        "the first request is served once a worker is up"
    );
    assert_eq!(ready(&c), 1);
    // Low: one request at a time.
    for i in 1..4 {
        assert_eq!(send(&c, i, 256, 8).await, 200);
    }
    // High: a burst that fills one worker's KV.
    let burst: Vec<_> = (0..48u32)
        .map(|i| {
            let c = &c;
            async move { send(c, 100 + i, 1024, 48).await }
        })
        .collect();
    let statuses = futures_util::future::join_all(burst).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let status = c.proxy.planner.to_json();
    let adds = actions(&c, |a| matches!(a, Action::Add { .. }));
    assert!(
        adds >= 2,
        "the burst scaled the fleet up (one from zero, then more): {status}"
    );
    // Low again, a request at a time: the fleet shrinks back to one, every request served.
    let deadline = tokio::time::Instant::now() + kvroute_testkit::PATIENCE;
    let mut i = 1000;
    while !(ready(&c) == 1
        && c.proxy.planner.to_json()["retiring"]
            .as_array()
            .is_some_and(Vec::is_empty))
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fleet did not shrink back: {}",
            c.proxy.planner.to_json()
        );
        i += 1;
        assert_eq!(send(&c, i, 128, 4).await, 200);
    }
    let removes = actions(&c, |a| matches!(a, Action::Remove { .. }));
    assert!(removes >= 1, "{}", c.proxy.planner.to_json());
    for d in c.proxy.planner.decisions() {
        eprintln!("{:.2} s: {}", d.at_s, d.text);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_worker_is_replaced_and_only_its_own_requests_fail() {
    // Two workers, neither more nor fewer: only a loss changes the fleet.
    let plan = PlanFile::parse(
        &LIVE_PLAN
            .replace("min_replicas = 1", "min_replicas = 2")
            .replace("max_replicas = 3", "max_replicas = 2"),
    )
    .expect("a valid planner file");
    let logs = worker_logs("kill");
    let (c, actuator) = planned(&plan, &logs).await;
    let driver = &c.proxy.driver;
    assert!(
        driver
            .wait_until(kvroute_testkit::PATIENCE, |_| ready(&c) == 2)
            .await,
        "the planner starts its minimum: {}",
        c.proxy.planner.to_json()
    );
    // Requests long enough to be in flight when a worker dies.
    let burst: Vec<_> = (0..16u32)
        .map(|i| {
            let c = &c;
            async move { send(c, 500 + i, 512, 400).await }
        })
        .collect();
    let all = futures_util::future::join_all(burst);
    let killer = async {
        // Once every request is routed, and both workers have some, kill one from outside.
        let booked = |d: &kvroute_proxy::Driver| {
            let w = d.planner_workers();
            w.iter().filter(|w| w.in_flight > 0).count() == 2
                && w.iter().map(|w| w.in_flight).sum::<u32>() == 16
        };
        assert!(
            driver.wait_until(kvroute_testkit::PATIENCE, booked).await,
            "every request is booked, on both workers: {:?}",
            driver.planner_workers()
        );
        let victim = actuator
            .running()
            .into_iter()
            .find(|s| s.worker.is_some() && s.pid.is_some())
            .expect("a running worker");
        let id = victim.worker.expect("registered");
        let in_flight = driver.in_flight(id).unwrap_or(0);
        let pid = victim.pid.expect("a pid").to_string();
        let before = c.proxy.planner.decisions().len();
        let killed = std::process::Command::new("kill")
            .args(["-9", &pid])
            .status()
            .expect("kill");
        assert!(killed.success());
        (in_flight, before)
    };
    let (statuses, (in_flight, before)) = tokio::join!(all, killer);
    let failed = statuses.iter().filter(|&&s| s != 200).count() as u64;
    assert!(
        failed <= in_flight,
        "{failed} requests failed, more than the {in_flight} in flight on the killed worker: {statuses:?}"
    );
    // The planner replaces it: two ready workers again, and requests are served.
    assert!(
        driver
            .wait_until(kvroute_testkit::PATIENCE, |_| ready(&c) == 2)
            .await,
        "the lost worker is replaced: {}",
        c.proxy.planner.to_json()
    );
    // A decision after the kill started the replacement (below the minimum, here).
    let added_after_kill = c.proxy.planner.decisions().iter().skip(before).any(|d| {
        d.actions.iter().any(|a| matches!(a, Action::Add { .. }))
            && d.changes.iter().any(|ch| {
                matches!(
                    ch.reason,
                    kvroute_planner::Reason::Replace { .. } | kvroute_planner::Reason::MinReplicas
                )
            })
    });
    assert!(added_after_kill, "{}", c.proxy.planner.to_json());
    assert_eq!(send(&c, 9999, 64, 4).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_at_zero_serves_its_first_request_once_a_worker_is_ready_and_goes_back_to_zero() {
    let plan =
        PlanFile::parse(&LIVE_PLAN.replace("min_replicas = 1", "min_replicas = 0\nidle_to_zero_s = 1"))
            .expect("a valid planner file");
    let logs = worker_logs("zero");
    let (c, _actuator) = planned(&plan, &logs).await;
    for round in 0..2u32 {
        assert_eq!(ready(&c), 0, "round {round}: no worker");
        // The request waits in the queue while the planner starts a worker, then is served.
        assert_eq!(send(&c, 7000 + round, 64, 4).await, 200, "round {round}");
        // Idle for a second: the pool goes back to zero.
        assert!(
            c.proxy
                .driver
                .wait_until(kvroute_testkit::PATIENCE, |d| d.planner_workers().is_empty())
                .await,
            "round {round}: the idle pool stops: {}",
            c.proxy.planner.to_json()
        );
    }
    let reasons: Vec<String> = c
        .proxy
        .planner
        .decisions()
        .iter()
        .map(|d| d.text.clone())
        .collect();
    let from_zero = decided(&c, |r| matches!(r, kvroute_planner::Reason::FromZero { .. }));
    let idle = decided(&c, |r| matches!(r, kvroute_planner::Reason::Idle { .. }));
    assert_eq!((from_zero, idle), (2, 2), "{reasons:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_down_keeps_the_worker_that_holds_the_hot_prefix() {
    use kvroute_proxy::autoscale::Actuator;
    let logs = worker_logs("warm");
    let (mut c, actuator) = empty_fleet(&logs).await;
    let driver = std::sync::Arc::clone(&c.proxy.driver);
    // Two workers before the planner runs.
    actuator.provision(kvroute_planner::Pool::Agg);
    actuator.provision(kvroute_planner::Pool::Agg);
    assert!(
        driver
            .wait_until(kvroute_testkit::PATIENCE, |_| ready(&c) == 2)
            .await
    );
    // One hot prefix, asked for again and again: the router keeps it where it is cached.
    for _ in 0..6 {
        assert_eq!(send(&c, 42, 1024, 2).await, 200);
    }
    assert!(
        driver
            .wait_for_kv(kvroute_testkit::PATIENCE, |d| d
                .removal_figures()
                .iter()
                .any(|f| f.cached_unique_blocks >= 32))
            .await,
        "the prefix is cached: {:?}",
        driver.removal_figures()
    );
    let figures = driver.removal_figures();
    let hot = figures
        .iter()
        .max_by_key(|f| f.cached_unique_blocks)
        .expect("two workers");
    let cold = figures
        .iter()
        .min_by_key(|f| f.cached_unique_blocks)
        .expect("two workers");
    assert!(
        hot.cached_unique_blocks > cold.cached_unique_blocks,
        "{figures:?}"
    );
    let hot = hot.id.0;
    // A planner with a minimum of one: the quiet fleet consolidates, keeping the hot worker.
    let plan = PlanFile::parse(LIVE_PLAN).expect("a valid planner file");
    start_planner(&mut c, &plan, &actuator);
    assert!(
        driver
            .wait_until(kvroute_testkit::PATIENCE, |d| d.worker_statuses().len() == 1)
            .await,
        "one worker is let go: {}",
        c.proxy.planner.to_json()
    );
    let kept: Vec<_> = driver.worker_statuses().iter().map(|w| w.id).collect();
    assert_eq!(
        kept,
        [hot],
        "the worker holding the hot prefix stays: {}",
        c.proxy.planner.to_json()
    );
}

#[test]
fn the_readmes_planner_file_is_read_as_written() {
    let readme = include_str!("../../../README.md");
    let section = &readme[readme.find("### The planner, live").expect("the section")..];
    let start = section.find("```toml\n").expect("a TOML block") + "```toml\n".len();
    let text = &section[start..start + section[start..].find("```").expect("its end")];
    let plan = PlanFile::parse(text).expect("the README's planner file is valid");
    assert_eq!(plan.planner.min_replicas, 0);
    assert!(plan.actuator.is_some());
}
