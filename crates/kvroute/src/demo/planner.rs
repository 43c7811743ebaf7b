//! `kvroute demo --planner`: the planner live and simulated on one load ramp.
//!
//! The example trace's rows are re-timed into a ramp (low, high, low: `RAMP`), replayed by the
//! simulator with the planner in the loop, then sent live through a proxy whose planner starts
//! and stops `kvroute mock` processes through the `process` actuator (the mocks run the
//! simulator's engine model, sped up). Live time is modeled time divided by the speedup, so the
//! live planner's intervals, targets and drain timeout are the file's divided by it, and live
//! figures are multiplied back. The demo ends with `GPU-hours: live L, simulated S`, the
//! directions of both runs' scaling decisions, and the count of failed requests.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use kvroute_core::ids::WorkerId;
use kvroute_core::time::Timestamp;
use kvroute_http::Model;
use kvroute_planner::{Action, PlannerConfig, Pool, ScalingDecision, TickRecord};
use kvroute_proxy::autoscale::actuator::{self, ActuatorConfig, ProcessConfig, WorkerTemplate};
use kvroute_proxy::autoscale::{Actuator, Settings};
use kvroute_sim::report::{Outcome, Report};
use kvroute_sim::trace::TokenRequest;
use kvroute_sim::{PlannerSetup, SimConfig, Simulation};

use crate::plan::PlanFile;

use super::DemoArgs;

/// The ramp: the trace's rate times these multipliers (seconds of modeled time, multiplier),
/// piecewise linear: low, a climb, high, a descent, low again until the rows run out.
const RAMP: &[(f64, f64)] = &[(0.0, 0.3), (60.0, 0.3), (90.0, 2.0), (150.0, 2.0), (180.0, 0.3)];

/// The planner file the demo uses without `--planner FILE`: an aggregated pool of at least one
/// worker, within six, profiled from the engine, scaled by the load loop.
pub const DEFAULT_PLAN: &str = include_str!("planner.toml");

/// The figures of one run the demo compares.
struct Run {
    report: Report,
    decisions: Vec<ScalingDecision>,
    /// Every tick's record, in modeled time.
    ticks: Vec<TickRecord>,
    /// SLA windows met, and windows with arrivals.
    attainment: (u64, u64),
}

/// The length of an SLA window, modeled time.
const SLA_WINDOW: Duration = Duration::from_secs(30);

/// Runs the planner demo.
pub fn run(args: &DemoArgs, file: Option<&Path>) -> anyhow::Result<()> {
    let plan = match file {
        Some(path) => PlanFile::read(path)?,
        None => PlanFile::parse(DEFAULT_PLAN).context("the demo's planner file")?,
    };
    ensure!(
        plan.planner.mode == kvroute_planner::Mode::Agg,
        "demo --planner runs an aggregated pool (mode = \"agg\")"
    );
    let trace = || std::io::BufReader::new(flate2::read::GzDecoder::new(kvroute_sim::EXAMPLE_MOONCAKE_GZ));
    let mut sim = SimConfig::new(plan.planner.min_replicas.max(1) as usize);
    let built = plan.engine.choice().build(&sim.engine).context("[engine]")?;
    sim.engine = built.engine;
    sim.gpus_per_worker = built.gpus_per_worker;
    sim.router.block_size = sim.engine.block_size;
    sim.router.policy = args
        .policy
        .parse::<kvroute_core::router::PolicyConfig>()
        .map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    sim.sample_interval = None;
    sim.planner = Some(PlannerSetup {
        config: plan.planner.clone(),
        sla_window: SLA_WINDOW,
        keep_observations: false,
        // As the live planner sees its workers.
        observe: kvroute_planner::Observe::Router,
    });
    let mut workload =
        kvroute_sim::trace::read_mooncake(trace(), 512, sim.engine.block_size, Some(args.limit))?;
    workload
        .warp_rate(RAMP)
        .map_err(|e| anyhow::anyhow!("the ramp: {e}"))?;
    let mut requests = kvroute_sim::trace::read_mooncake_tokens(trace(), 512, Some(args.limit))?;
    for (r, w) in requests.iter_mut().zip(&workload.requests) {
        if let kvroute_sim::workload::Arrival::At(at) = w.arrival {
            r.arrival = at;
        }
    }
    crate::serve::say(
        args.log_format,
        &format!(
            "demo --planner: {} requests of the example trace on a ramp (x0.3, x2, x0.3), policy {}, {}x speed",
            requests.len(),
            args.policy,
            args.speedup
        ),
    );
    let result = Simulation::new(sim.clone())?.run(&workload, &mut |_| {})?;
    let planned = result.planner.context("a planned run")?;
    let simulated = Run {
        attainment: planned.attainment(),
        decisions: planned.decisions,
        ticks: planned.ticks,
        report: result.report,
    };
    let (live, failed) = crate::serve::runtime(0)?.block_on(live(args, &sim, &plan, requests))?;
    if let Some(path) = &args.ticks {
        write_ticks(path, &simulated.ticks, &live.ticks)?;
    }
    let table = kvroute_sim::report::table(&[
        ("planner (simulated)".to_owned(), simulated.report.clone()),
        ("planner (live HTTP)".to_owned(), live.report.clone()),
    ]);
    let gpu = |r: &Report| r.number("gpu_hours").unwrap_or(f64::NAN);
    let lines = [
        format!("scaling, simulated: {}", directions(&simulated.decisions, 1.0)),
        format!(
            "scaling, live:      {}",
            directions(&live.decisions, args.speedup)
        ),
        format!(
            "SLA windows met: live {}/{}, simulated {}/{}",
            live.attainment.0, live.attainment.1, simulated.attainment.0, simulated.attainment.1
        ),
        format!(
            "GPU-hours: live {:.4}, simulated {:.4}",
            gpu(&live.report),
            gpu(&simulated.report)
        ),
        format!("failed requests: {failed}"),
    ];
    match args.log_format {
        crate::serve::LogFormat::Text => {
            print!("{table}");
            for l in &lines {
                println!("{l}");
            }
        }
        crate::serve::LogFormat::Json => {
            tracing::info!(%table, summary = lines.join("\n"), "demo: the result");
        }
    }
    Ok(())
}

/// A run's decisions as their directions in order with their times, modeled seconds (a live
/// run's times are multiplied by `speedup`), e.g. `+1@35 +1@40 -1@220`.
fn directions(decisions: &[ScalingDecision], speedup: f64) -> String {
    if decisions.is_empty() {
        return "none".to_owned();
    }
    decisions
        .iter()
        .map(|d| {
            let net: i64 = d
                .actions
                .iter()
                .map(|a| match a {
                    Action::Add { .. } => 1,
                    Action::Remove { .. } => -1,
                })
                .sum();
            format!("{net:+}@{:.0}", d.at_s * speedup)
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Writes both runs' ticks to `path`, one JSON object a line, the simulated run's first.
fn write_ticks(path: &Path, simulated: &[TickRecord], live: &[TickRecord]) -> anyhow::Result<()> {
    let mut out = String::new();
    for (run, ticks) in [("simulated", simulated), ("live", live)] {
        for t in ticks {
            let mut line = serde_json::json!({ "run": run });
            if let (Some(line), serde_json::Value::Object(fields)) =
                (line.as_object_mut(), serde_json::to_value(t)?)
            {
                line.extend(fields);
            }
            out.push_str(&line.to_string());
            out.push('\n');
        }
    }
    std::fs::write(path, out).with_context(|| format!("--ticks: writing {}", path.display()))
}

/// `record`, a live tick, in modeled time: its instant and latencies times `speedup`, its rates
/// divided by it.
fn modeled_tick(mut record: TickRecord, speedup: f64) -> TickRecord {
    let ms = |v: &mut Option<f64>| *v = v.map(|x| x * speedup);
    record.at_s *= speedup;
    record.observed_rps /= speedup;
    record.predicted_rps = record.predicted_rps.map(|r| r / speedup);
    ms(&mut record.observed_ttft_ms);
    ms(&mut record.observed_itl_ms);
    for p in &mut record.pools {
        ms(&mut p.est_ttft_ms);
        ms(&mut p.est_itl_ms);
    }
    record
}

/// `config` in live time: every duration and latency target divided by `speedup`.
fn sped_up(config: &PlannerConfig, speedup: f64) -> PlannerConfig {
    let mut c = config.clone();
    c.load_interval_s /= speedup;
    c.throughput_interval_s /= speedup;
    c.startup_delay_s /= speedup;
    c.idle_to_zero_s /= speedup;
    c.warmup_s /= speedup;
    c.sla.ttft_ms /= speedup;
    c.sla.itl_ms /= speedup;
    c
}

/// Wraps the actuator to time each worker's life (provisioned to released), for GPU-hours.
struct Timed {
    inner: Arc<dyn Actuator>,
    /// Provisions (when) and releases (when), in order.
    lives: Mutex<(Vec<Instant>, Vec<Instant>)>,
}

impl Actuator for Timed {
    fn set_desired(&self, pool: Pool, n: u32) {
        self.inner.set_desired(pool, n);
    }

    fn provision(&self, pool: Pool) {
        self.lives
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .push(Instant::now());
        self.inner.provision(pool);
    }

    fn release(&self, id: WorkerId, url: &str) {
        self.lives
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .push(Instant::now());
        self.inner.release(id, url);
    }

    fn pending(&self) -> Vec<Pool> {
        self.inner.pending()
    }
}

impl Timed {
    /// Worker-seconds (wall) from `t0` to `end`, each worker counted from its provisioning (or
    /// `t0`, for the starting fleet) to its release (or `end`): which release ends which
    /// worker changes no sum.
    fn worker_seconds(&self, t0: Instant, end: Instant) -> f64 {
        let (provisioned, released) = &*self.lives.lock().unwrap_or_else(|p| p.into_inner());
        let left = |t: &Instant| end.saturating_duration_since((*t).max(t0)).as_secs_f64();
        provisioned.iter().map(left).sum::<f64>() - released.iter().map(left).sum::<f64>()
    }
}

async fn live(
    args: &DemoArgs,
    sim: &SimConfig,
    plan: &PlanFile,
    requests: Vec<TokenRequest>,
) -> anyhow::Result<(Run, usize)> {
    let model = Arc::new(Model::tiny()?);
    let e = &sim.engine;
    let speedup = e.speedup * args.speedup;
    let exe = std::env::current_exe().context("the kvroute binary's path")?;
    let command = [
        exe.to_string_lossy().into_owned(),
        "mock".into(),
        "--workers".into(),
        "1".into(),
        "--port".into(),
        "{port}".into(),
        "--event-port".into(),
        "{events_port}".into(),
        "--speedup".into(),
        speedup.to_string(),
        "--block-size".into(),
        e.block_size.to_string(),
        "--num-blocks".into(),
        e.num_blocks.to_string(),
        "--log-format".into(),
        "json".into(),
    ];
    let log_dir = std::env::temp_dir().join(format!("kvroute-demo-planner-{}", std::process::id()));
    let actuator_config = ActuatorConfig::Process(Box::new(ProcessConfig {
        agg: Some(WorkerTemplate {
            command: command.to_vec(),
            worker: format!(
                "http://127.0.0.1:{{port}},events=tcp://127.0.0.1:{{events_port}},replay=tcp://127.0.0.1:{{replay_port}},block-size={}",
                e.block_size
            ),
        }),
        prefill: None,
        decode: None,
        ready_timeout_s: 60,
        stop_grace_s: 10,
        log_dir: Some(log_dir.clone()),
        host: "127.0.0.1".into(),
    }));
    let mut config = super::serve_config(args, e.block_size, Vec::new());
    // Requests wait while the planner adds workers.
    config.routing.queue_timeout_ms = 600_000;
    let mut proxy = kvroute_proxy::start(config, Some(Arc::clone(&model))).await?;
    let mut engine = e.clone();
    engine.speedup = speedup;
    let live_config = sped_up(&plan.planner, args.speedup);
    let timed = Arc::new(Timed {
        inner: actuator::build(&actuator_config, Arc::clone(&proxy.fleet))?,
        lives: Mutex::new((Vec::new(), Vec::new())),
    });
    // The starting fleet, as the simulator's: provisioned now, traffic once it is routable.
    let initial = plan.planner.min_replicas.max(1);
    for _ in 0..initial {
        timed.provision(Pool::Agg);
    }
    let ready = proxy
        .driver
        .wait_until(Duration::from_secs(60), |d| {
            d.planner_workers().len() >= initial as usize
        })
        .await;
    ensure!(
        ready,
        "the first mock workers did not become ready within 60 s (logs in {})",
        log_dir.display()
    );
    let drain = plan.drain.timeout()?.div_f64(args.speedup);
    // The planner starts with the replay, as the simulated one starts with the trace: its
    // ticks fall at the same trace times (started before the first workers were ready, every
    // tick would fall that much earlier in the trace than the simulated one).
    let planner = kvroute_sim::profile::planner(&live_config, &engine, proxy.driver.timestamp())?;
    proxy.start_planner(
        planner,
        Arc::clone(&timed) as Arc<dyn Actuator>,
        Settings {
            drain_timeout: drain,
            // Every tick, for `--ticks`.
            history: 1 << 20,
        },
    );
    let client = kvroute_http::net::client(Duration::from_secs(5));
    let url: Arc<str> = format!("{}/v1/completions", proxy.url()).into();
    let (t0, measured) = super::replay(&client, &[url], requests, args.speedup).await?;
    let end = measured
        .iter()
        .filter_map(|m| m.end)
        .max()
        .unwrap_or_else(Instant::now);
    let failed = measured.iter().filter(|m| !m.ok).count();
    let decisions = proxy.planner.decisions();
    let ticks = proxy
        .planner
        .ticks()
        .into_iter()
        .map(|t| modeled_tick(t, args.speedup))
        .collect();
    let c = proxy.driver.snapshot().counters;
    let worker_seconds = timed.worker_seconds(t0, end) * args.speedup;
    let report = super::report(
        args,
        sim,
        &measured,
        t0,
        (c.overlap_blocks, c.prompt_blocks),
        0,
        Some(worker_seconds),
    );
    drop(proxy);
    // SLA attainment as the simulator counts it, on the live requests in modeled time.
    let modeled =
        |t: Instant| Timestamp(((t.saturating_duration_since(t0)).as_nanos() as f64 * args.speedup) as u64);
    let requests = measured.iter().filter_map(|m| {
        let arrived = modeled(m.arrival?);
        Some(kvroute_sim::RequestSla {
            arrived,
            outcome: if m.ok {
                Outcome::Completed
            } else {
                Outcome::Rejected
            },
            first_token: m.first.map(modeled),
            last_token: m.last_token.map_or(arrived, modeled),
            output_tokens: m.completion_tokens as u32,
        })
    });
    let windows = kvroute_sim::sla_windows(requests, SLA_WINDOW, &plan.planner.sla);
    let met = windows.iter().filter(|w| w.met).count() as u64;
    let counted = windows.iter().filter(|w| w.arrived > 0).count() as u64;
    Ok((
        Run {
            report,
            decisions,
            ticks,
            attainment: (met, counted),
        },
        failed,
    ))
}
