//! `kvroute replay`: a trace (or a generated workload) through the cluster simulator, under one
//! or several policies, with a text table on stdout and optional JSON, JSONL and HTML outputs.
//!
//! Options come from an optional TOML file (`--config`) whose keys are the long flag names, then
//! the flags over it ([`crate::config::layered`]); unknown keys are rejected. Every option is
//! checked (`Plan::new`) before the trace is read. The router's options (policy,
//! cache view, decider, ...) are the core's vocabulary (`kvroute_core::router::spec`), the same
//! as `kvroute serve`'s.

mod noise;
mod output;
mod plan;
mod workload;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, ensure};
use clap::Args;
use kvroute_core::router::{RouterConfig, RouterSpec};
use kvroute_sim::{Report, RunResult, Simulation};
use serde::{Deserialize, Serialize};

use output::{ProgressBar, write_outputs};
use plan::Plan;
pub(crate) use plan::kv_link;
use workload::{Requests, hashing_threads};

/// The options of `kvroute replay`: the configuration, the file it may come from, and the
/// outputs.
#[derive(Args, Debug, Default)]
pub struct ReplayArgs {
    /// The configuration (flags; `--config` keys under the same names).
    #[command(flatten)]
    pub options: ReplayConfig,
    /// A TOML file of options (keys: the long flag names, e.g. `block-size = 64`); flags beat it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Write the report as JSON (several policies: one object per policy, under its name), with
    /// its `provenance`.
    #[arg(long)]
    pub report_json: Option<PathBuf>,
    /// Write one JSON line per request (several policies: a `policy` field on each).
    #[arg(long)]
    pub per_request_jsonl: Option<PathBuf>,
    /// Write a self-contained HTML page of plots.
    #[arg(long)]
    pub html: Option<PathBuf>,
}

/// The configuration of `kvroute replay`: every option is a flag and a key of the `--config`
/// file, under one kebab-case name. Unset options take the defaults their docs name.
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ReplayConfig {
    /// The trace file (`.jsonl[.gz]` Mooncake, `.csv[.gz]` Azure). Default: the built-in first
    /// 2,000 rows of the Mooncake conversation trace. Not with `--format synthetic`.
    pub trace: Option<PathBuf>,
    /// Trace format: mooncake, azure or synthetic. Default: from the file name.
    #[arg(long)]
    pub format: Option<String>,
    /// Aggregated workers. Default 16 (ignored with `--prefill-workers`).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Disaggregated fleet: this many prefill workers (needs `--decode-workers`).
    #[arg(long)]
    pub prefill_workers: Option<usize>,
    /// Disaggregated fleet: this many decode workers (needs `--prefill-workers`).
    #[arg(long)]
    pub decode_workers: Option<usize>,
    /// Disaggregation decider: `never`, `always`, or N (prefill on a prefill worker when more
    /// than N prompt tokens are uncached on the chosen decode worker). Default `always`.
    #[arg(long)]
    pub decider: Option<String>,
    /// Prefill-to-decode KV link bandwidth, GB/s (10^9 bytes). Default 64.
    #[arg(long)]
    pub kv_transfer_gbps: Option<f64>,
    /// Fixed latency of a KV transfer, ms. Default 0.05.
    #[arg(long)]
    pub kv_transfer_latency_ms: Option<f64>,
    /// KV bytes per token. Default: from `--kv-model`.
    #[arg(long)]
    pub kv_bytes_per_token: Option<u64>,
    /// Built-in model whose shape gives the KV bytes per token (llama-3.1-8b, llama-3.1-70b,
    /// mixtral-8x7b, qwen2.5-7b). Default llama-3.1-8b (131,072 bytes per token).
    #[arg(long)]
    pub kv_model: Option<String>,
    /// Policy specs, comma-separated; each runs the identical workload. The vocabulary of
    /// `kvroute serve --policy`: `kv:full` / `kv:staged` (and `dynamo:...`) choose the decode
    /// projection; `kv:scale=2`, `kv:credit=0.5` set the cost's weights; `kv:temperature=0.1`
    /// samples instead of taking the argmin; `kv:spread=0.05` spreads concurrent replicas over
    /// the near-best workers. Default `kv`.
    #[arg(long, value_delimiter = ',')]
    pub policy: Option<Vec<String>>,
    /// Cache view, as `kvroute serve --cache` takes it: `events`, `predict` (events and the
    /// router's record of its own decisions) or `approximate` (that record alone; KV events
    /// are refused), the last two with options, e.g. `approximate:ttl=120:max-blocks=65536`
    /// (`--predict-on-route-s S` is `predict:ttl=S`; not both). Default `events`.
    #[arg(long)]
    pub cache: Option<String>,
    /// Router queue capacity (0: reject when every worker is busy). Default 1,024.
    #[arg(long)]
    pub queue_capacity: Option<usize>,
    /// When no worker can take a request (none in the fleet, or none in routing), as `kvroute
    /// serve --when-empty` takes it: `reject`, or `queue` (it waits in the router's queue for a
    /// worker). Default reject.
    #[arg(long)]
    pub when_empty: Option<String>,
    /// Seed of the router, the simulator and a synthetic workload (`--seed 0` is the default's
    /// run). Default 0.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Use only the first N requests of the trace.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Tokens per `hash_ids` entry of a Mooncake trace. Default 512.
    #[arg(long)]
    pub trace_block_size: Option<u32>,
    /// Divide arrival times by this. Default 1.
    #[arg(long)]
    pub arrival_speedup: Option<f64>,
    /// Closed loop: keep this many requests in flight, ignoring arrival times.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Engine tokens per KV block (also the router's). Default 64 (Dynamo mocker).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Engine KV blocks per worker (also `--kv-blocks`). Default 16,384, or with `--model`
    /// what fits: GPU memory x `--gpu-memory-utilization` less the weights and an activation
    /// reserve, over the bytes of one block.
    #[arg(long, alias = "kv-blocks")]
    #[serde(alias = "kv-blocks")]
    pub num_blocks: Option<u32>,
    /// Blocks of a host-memory (CPU) KV tier per worker: vLLM's native offloading
    /// (`--kv-offloading-size` GiB over one block's bytes). Blocks are copied to it as they are
    /// cached and loaded back past a prompt's GPU hit over the KV link (`--kv-transfer-gbps`);
    /// its events carry `medium` "CPU". Default none.
    #[arg(long)]
    pub cpu_offload_blocks: Option<u32>,
    /// Engine max running requests. Default 256.
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Engine token budget per forward pass. Default 8,192.
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Divide modelled step times by this. Default 1.
    #[arg(long)]
    pub engine_speedup: Option<f64>,
    /// The workers' model: a built-in name or alias (llama-3.1-8b, llama-3.1-70b,
    /// llama-3.3-70b, llama-2-7b, llama-2-70b, codellama-34b, qwen2.5-7b, qwen3-8b, qwen3-14b,
    /// qwen3-32b, mistral-nemo-12b, mixtral-8x7b, mixtral-8x22b; Hugging Face names such as
    /// `meta-llama/Llama-3.1-8B-Instruct` too), a Hugging Face `config.json` or its directory,
    /// or a model TOML. With it the timing model defaults to the roofline, the KV blocks to
    /// what fits, and the KV bytes per token to the model's. Default: none (the mocker's
    /// engine).
    #[arg(long)]
    pub model: Option<String>,
    /// The GPU `--model` runs on: h100-sxm, h200-sxm, a100-sxm-80gb, a100-sxm-40gb, l40s (or
    /// aliases: h100, H100-80GB, A100-40GB, ...), or a GPU TOML. Default h100-sxm.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Tensor-parallel GPUs per worker: the model's weights and KV heads are split over them,
    /// and GPU-hours count them. Default 1.
    #[arg(long)]
    pub tp: Option<u32>,
    /// Share of each GPU's memory the engine may use, for the derived KV blocks. Default 0.9
    /// (vLLM's).
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// The timing model: `roofline` (needs `--model`), `polynomial` (Dynamo's mocker fit),
    /// `table:FILE` (a measured profile), or FILE, a TOML timing model (`kind = ...`, e.g. one
    /// written by `kvroute calibrate`). Default: roofline with `--model`, else polynomial.
    #[arg(long)]
    pub timing: Option<String>,
    /// KV-event lag in milliseconds. Default 0.
    #[arg(long)]
    pub kv_lag_ms: Option<f64>,
    /// Probability that a KV event is lost. Default 0.
    #[arg(long)]
    pub kv_loss: Option<f64>,
    /// Router replicas over the fleet, each with its own index fed every engine's KV events;
    /// client requests are spread over them (`--replica-spread`). Default 1.
    #[arg(long)]
    pub replicas: Option<usize>,
    /// Replica sync: `off` (each replica knows only its own requests) or `on` (each applies the
    /// others' bookings, `--sync-delay-ms` later). Default `off`.
    #[arg(long)]
    pub sync: Option<String>,
    /// With `--sync on`: delay from a replica's load change to its peers applying it, ms.
    /// Default 0.
    #[arg(long)]
    pub sync_delay_ms: Option<f64>,
    /// With `--sync on`: probability that a sync message is lost (for every peer). Default 0.
    #[arg(long)]
    pub sync_loss: Option<f64>,
    /// With `--sync on`: how long a replica's booking may wait for others in its batch, ms (the
    /// live transport's is 2). Default 0: one batch per input.
    #[arg(long)]
    pub sync_batch_ms: Option<f64>,
    /// With `--sync on`: how long prefill-done and freed changes may wait for the replica's
    /// next booking, ms (`serve --nats-lazy-ms`). Default: `--sync-batch-ms`.
    #[arg(long)]
    pub sync_lazy_ms: Option<f64>,
    /// How requests are spread over the replicas: `round-robin` or `random` (seeded). Default
    /// `round-robin`.
    #[arg(long)]
    pub replica_spread: Option<String>,
    /// The last replica starts this many seconds into the run (with `--sync on`, it joins its
    /// peers as a live replica does). Needs `--replicas` 2 or more. Default: all start at 0.
    #[arg(long)]
    pub replica_join_s: Option<f64>,
    /// The first replica dies this many seconds into the run: it routes nothing more, and its
    /// peers release its bookings once it has been silent past the peer timeout (3 s). Needs
    /// `--replicas` 2 or more. Default: none dies.
    #[arg(long)]
    pub replica_fail_s: Option<f64>,
    /// Also use the router's record of its own decisions (TTL in seconds) as a cache view.
    #[arg(long)]
    pub predict_on_route_s: Option<f64>,
    /// Router queue: requests per worker above which a worker is busy (fraction of
    /// max-num-seqs, 0 or above). Default: never busy.
    #[arg(long)]
    pub busy_requests_fraction: Option<f64>,
    /// Synthetic: requests. Default 2,000.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Synthetic: session starts per second. Default 10.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Synthetic: coefficient of variation of gaps (gamma arrivals); 1 or absent is Poisson.
    #[arg(long)]
    pub arrival_cv: Option<f64>,
    /// Synthetic: new prompt tokens per turn, `N` or `MIN-MAX`. Default 1024-4096.
    #[arg(long)]
    pub isl: Option<String>,
    /// Synthetic: output tokens, `N` or `MIN-MAX`. Default 64-512.
    #[arg(long)]
    pub osl: Option<String>,
    /// Synthetic: shared-prefix groups (0: none). Default 16.
    #[arg(long)]
    pub prefix_groups: Option<u32>,
    /// Synthetic: tokens of each group's prefix. Default 2,048.
    #[arg(long)]
    pub prefix_tokens: Option<u32>,
    /// Synthetic: turns per session. Default 1.
    #[arg(long)]
    pub turns: Option<u32>,
    /// Synthetic: think time between turns, ms. Default 5,000.
    #[arg(long)]
    pub think_ms: Option<u64>,
    /// The planner's TOML file, as `kvroute serve --planner` takes it (`[planner]`, and
    /// `[engine]`: the workers, under the engine flags here): the planner adds and removes
    /// workers during the run, starting from `--workers` (or the two pools); its mode must fit
    /// the topology. The report gains the planner's keys, decisions and ticks.
    #[arg(long)]
    pub planner: Option<PathBuf>,
    /// With `--planner`: seconds per SLA-attainment window. Default 60.
    #[arg(long)]
    pub sla_window_s: Option<f64>,
    /// With `--planner`: what the planner sees of the workers, `engines` (their forward passes
    /// and KV) or `router` (the router's books only, as `kvroute serve --planner` sees a live
    /// fleet). Default engines.
    #[arg(long)]
    pub planner_observe: Option<String>,
    /// Time-varying load: re-time the arrivals so that the rate is the trace's times a
    /// piecewise-linear multiplier, `T:M,T:M,...` (seconds after the other arrival options,
    /// multiplier), e.g. `0:0.5,1800:3,3600:0.5`.
    #[arg(long)]
    pub rate_profile: Option<String>,
    /// Service-level objective, judged on each run: `METRIC-STAT=LIMIT`, comma-separated;
    /// METRIC ttft, itl, tpot or e2e; STAT mean, p50, p90, p95 or p99; LIMIT in ms or s, e.g.
    /// `ttft-p90=500ms,itl-p99=50ms`. A run meets it when every target holds and no request
    /// was turned away or left unfinished. The report gains `slo` and `slo_met`.
    #[arg(long)]
    pub slo: Option<String>,
    /// Run the trace at each fleet size: `workers=A..B` (every size from A to B),
    /// `workers=A..B:STEP`, or `workers=A,B,C`; one run per core at once, one policy. Prints
    /// one column per size and, with `--slo`, the smallest fleet meeting it; `--html` gains a
    /// plot of latency against fleet size. Not with `--workers`, the two pools or `--planner`.
    #[arg(long)]
    pub sweep: Option<String>,
    /// Trace multiplier: play the workload (after `--limit`) as N independent copies at once,
    /// each with its own prompts (no block shared across copies) and the original arrival
    /// times, so N times the requests at N times the rate. Default 1.
    #[arg(long)]
    pub multiply: Option<usize>,
    /// Noise: spread each prompt's own tokens by a factor of mean 1 drawn per request,
    /// `uniform:A` (over 1±A) or `lognormal:SIGMA`, before routing. Default: none.
    #[arg(long)]
    pub isl_spread: Option<String>,
    /// Noise: spread each output length likewise. Default: none.
    #[arg(long)]
    pub osl_spread: Option<String>,
    /// Noise: each forward pass's time times a factor drawn per pass, `uniform:A` or
    /// `lognormal:SIGMA`. Default: none.
    #[arg(long)]
    pub step_jitter: Option<String>,
    /// Noise: each worker's speed, a factor drawn once per worker (`uniform:A`,
    /// `lognormal:SIGMA`) or given, `F,F,...` (worker i runs at entry i; above 1 is faster).
    /// Default: all equal.
    #[arg(long)]
    pub worker_speed: Option<String>,
    /// Noise: one-way HTTP latency, ms, from the router's decision to the engine and from the
    /// engine's first token and finish back (TTFT and E2E include it). Default: none.
    #[arg(long)]
    pub http_latency_ms: Option<f64>,
    /// Noise: each HTTP message's latency times a factor drawn per message (`uniform:A`,
    /// `lognormal:SIGMA`). Needs `--http-latency-ms`. Default: none.
    #[arg(long)]
    pub http_jitter: Option<String>,
}

/// Runs `kvroute replay`.
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let options = crate::config::layered(args.config.as_deref(), &args.options)?;
    let plan = Plan::new(&options, &args)?;
    let serve = serve_flags(&plan.runs)?;
    if let Some(line) = &plan.engine_line {
        eprintln!("{line}");
    }
    let t0 = Instant::now();
    let trace = plan.trace()?;
    let (workload, source) = plan.workload(&trace)?;
    eprintln!(
        "workload: {} requests from {source} ({} in {:.2}s)",
        workload.len(),
        workload.how(),
        t0.elapsed().as_secs_f64()
    );
    let mut results: Vec<(String, RunResult)> = if plan.sweep.is_some() {
        run_on_every_core(&plan.runs, &workload)?
    } else {
        let mut results = Vec::new();
        for (name, sim) in &plan.runs {
            let started = Instant::now();
            let mut bar = ProgressBar::new(name, started);
            let result = workload.run(sim, hashing_threads(), &mut |p| bar.update(p))?;
            bar.finish();
            eprintln!(
                "{name}: simulated in {:.3}s wall",
                started.elapsed().as_secs_f64()
            );
            results.push((name.clone(), result));
        }
        results
    };
    if let Some(slo) = &plan.slo {
        for (_, result) in &mut results {
            slo.judge(&mut result.report);
        }
    }
    let reports: Vec<(String, Report)> = results
        .iter()
        .map(|(n, r)| (n.clone(), r.report.clone()))
        .collect();
    print!("{}", kvroute_sim::report::table(&reports));
    let mut sweep_html = String::new();
    if let Some(sizes) = &plan.sweep {
        let gpus = |n: usize| n as u64 * u64::from(plan.gpus_per_worker);
        let points: Vec<kvroute_sim::html::SweepPoint<'_>> = sizes
            .iter()
            .zip(&results)
            .map(|(&workers, (_, r))| kvroute_sim::html::SweepPoint {
                workers,
                gpus: gpus(workers),
                report: &r.report,
            })
            .collect();
        if let Some(slo) = &plan.slo {
            match points.iter().find(|p| slo.met(p.report)) {
                Some(p) => println!(
                    "smallest fleet meeting the SLO: {} workers ({} GPUs)",
                    p.workers, p.gpus
                ),
                None => println!("no fleet size tried meets the SLO"),
            }
        }
        if args.html.is_some() {
            sweep_html = kvroute_sim::html::sweep_section(&points, plan.slo.as_ref());
        }
    } else if let Some(slo) = &plan.slo {
        for (name, r) in &reports {
            let verdict = if slo.met(r) { "meets" } else { "misses" };
            println!("{name} {verdict} the SLO");
        }
    }
    // A sweep's runs share one router.
    let shown = if plan.sweep.is_some() {
        &serve[..serve.len().min(1)]
    } else {
        &serve[..]
    };
    for (name, flags) in shown {
        println!("serve {name} with: kvroute serve {flags}");
    }
    let mut provenance = crate::provenance::Provenance::new(&options, plan.seed, trace.file.as_ref())?;
    provenance.serve_flags = serve.into_iter().collect();
    write_outputs(&args, &results, &provenance, &sweep_html)
}

/// Simulates every run `args` asks for as [`run`] does (a sweep aside), one per core at once:
/// each run's policy, as its canonical spec (`kvroute serve --policy`), and its report, in the
/// order named. What `kvroute tune` scores.
pub(crate) fn simulate(args: &ReplayArgs) -> anyhow::Result<Vec<(String, Report)>> {
    let options = crate::config::layered(args.config.as_deref(), &args.options)?;
    let plan = Plan::new(&options, args)?;
    ensure!(
        plan.sweep.is_none(),
        "--sweep is replay's: tune compares policies on one fleet"
    );
    ensure!(
        plan.slo.is_none(),
        "--slo is replay's: tune scores by --objective"
    );
    let trace = plan.trace()?;
    let (workload, source) = plan.workload(&trace)?;
    eprintln!("workload: {} requests from {source}", workload.len());
    let results = run_on_every_core(&plan.runs, &workload)?;
    Ok(plan
        .runs
        .iter()
        .zip(results)
        .map(|((_, sim), (_, r))| (sim.config().router.policy.to_string(), r.report))
        .collect())
}

/// Runs every simulation of a sweep, one per core at once; results in the runs' order, each
/// the same whatever ran beside it (a simulation shares nothing).
fn run_on_every_core(
    runs: &[(String, Simulation)],
    workload: &Requests,
) -> anyhow::Result<Vec<(String, RunResult)>> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(runs.len().max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut done: Vec<Option<anyhow::Result<RunResult>>> = (0..runs.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                scope.spawn(|| {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((name, sim)) = runs.get(i) else { break };
                        let started = Instant::now();
                        // Every core runs a simulation: each hashes its own requests.
                        let result = workload.run(sim, 1, &mut |_| {});
                        eprintln!(
                            "{name}: simulated in {:.3}s wall",
                            started.elapsed().as_secs_f64()
                        );
                        mine.push((i, result));
                    }
                    mine
                })
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(mine) => {
                    for (i, r) in mine {
                        done[i] = Some(r);
                    }
                }
                Err(_) => return Err(anyhow::anyhow!("a sweep thread panicked")),
            }
        }
        Ok(())
    })?;
    runs.iter()
        .zip(done)
        .map(|((name, _), r)| Ok((name.clone(), r.context("a sweep run was not run")??)))
        .collect()
}

/// The router configuration of each run `args` asks for, by the policy spec as given: what
/// `kvroute replay` would simulate, checked as it checks it (the trace is not read).
pub fn router_configs(args: &ReplayArgs) -> anyhow::Result<Vec<(String, RouterConfig)>> {
    let options = crate::config::layered(args.config.as_deref(), &args.options)?;
    let plan = Plan::new(&options, args)?;
    Ok(plan
        .runs
        .iter()
        .map(|(name, sim)| (name.clone(), sim.config().router.clone()))
        .collect())
}

/// The `kvroute serve` flags of each run's router, by the policy spec as given.
fn serve_flags(runs: &[(String, Simulation)]) -> anyhow::Result<Vec<(String, String)>> {
    runs.iter()
        .map(|(name, sim)| {
            let spec = RouterSpec::from_config(&sim.config().router)
                .with_context(|| format!("the serve flags of {name}"))?;
            Ok((name.clone(), spec.to_string()))
        })
        .collect()
}
