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

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use clap::Args;
use flate2::read::GzDecoder;
use kvroute_core::router::replica::BatchConfig;
use kvroute_core::router::{
    CacheMode, PolicyConfig, RecentConfig, RouterConfig, RouterOptions, RouterSpec, WhenEmpty,
};
use kvroute_sim::synthetic::{
    ArrivalProcess, Lengths, OwnBlocks, SyntheticConfig, SyntheticStream, WorkloadPlan,
};
use kvroute_sim::workload::{RateWarp, Reshape, Reshaped};
use kvroute_sim::{
    ArrivalMode, EventChannel, KvTransfer, PlannerSetup, ReplicaSync, Replicas, Report, RunResult, SimConfig,
    Simulation, Spread, Workload,
};
use serde::{Deserialize, Serialize};

use output::{ProgressBar, write_outputs};

use crate::hardware::{EngineChoice, Timing};

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
    /// Seed of the router and the simulator. Default 0.
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

/// `--sweep`'s fleet sizes, ascending: `workers=A..B`, `workers=A..B:STEP` or `workers=A,B,...`.
fn parse_sweep(s: &str) -> anyhow::Result<Vec<usize>> {
    let shape =
        || format!("--sweep {s:?}: workers=A..B, workers=A..B:STEP or workers=A,B,C (sizes of 1 or more)");
    let Some(spec) = s.trim().strip_prefix("workers=") else {
        bail!("{}", shape());
    };
    let num = |x: &str| x.trim().parse::<usize>().ok().filter(|&n| n >= 1);
    let mut sizes: Vec<usize> = if let Some((a, rest)) = spec.split_once("..") {
        let (b, step) = match rest.split_once(':') {
            Some((b, step)) => (b, num(step).with_context(shape)?),
            None => (rest, 1),
        };
        let (a, b) = (num(a).with_context(shape)?, num(b).with_context(shape)?);
        ensure!(a <= b, "--sweep {s:?}: A is above B");
        (a..=b).step_by(step).collect()
    } else {
        spec.split(',')
            .map(num)
            .collect::<Option<Vec<_>>>()
            .with_context(shape)?
    };
    sizes.sort_unstable();
    sizes.dedup();
    ensure!(
        sizes.len() <= 256,
        "--sweep {s:?}: {} sizes, at most 256",
        sizes.len()
    );
    Ok(sizes)
}

/// Where the workload comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Mooncake,
    Azure,
    Synthetic,
}

/// A checked configuration: everything `kvroute replay` will do, decided before any work.
struct Plan<'a> {
    options: &'a ReplayConfig,
    format: Format,
    /// One simulation per policy, in the order named.
    runs: Vec<(String, Simulation)>,
    block_size: u32,
    seed: u64,
    synthetic: Option<SyntheticConfig>,
    profile: Option<Vec<(f64, f64)>>,
    /// What `--model` derived, said on stderr.
    engine_line: Option<String>,
    /// `--slo`.
    slo: Option<kvroute_sim::slo::Slo>,
    /// `--sweep`'s fleet sizes, ascending (one run each, in that order).
    sweep: Option<Vec<usize>>,
    /// GPUs per worker (`--tp`).
    gpus_per_worker: u32,
    /// Prompt- and output-length spread, applied to the workload once built.
    lengths: kvroute_sim::LengthSpread,
}

/// The trace's bytes (a file's, or the built-in example's) and the file, if one was named.
struct Trace {
    bytes: Option<Vec<u8>>,
    file: Option<crate::provenance::TraceFile>,
}

impl<'a> Plan<'a> {
    /// Checks every option, or says which flag is wrong.
    fn new(o: &'a ReplayConfig, args: &ReplayArgs) -> anyhow::Result<Self> {
        let format = match (o.format.as_deref(), &o.trace) {
            (Some("synthetic"), Some(_)) => bail!("--format synthetic reads no TRACE file"),
            (Some("synthetic"), None) => Format::Synthetic,
            (Some("azure"), None) => bail!("--format azure needs a TRACE file"),
            (Some("azure"), Some(_)) => Format::Azure,
            (Some("mooncake"), _) => Format::Mooncake,
            (Some(other), _) => bail!("--format {other:?}: mooncake, azure or synthetic"),
            (None, Some(path)) if path.to_string_lossy().contains(".csv") => Format::Azure,
            (None, _) => Format::Mooncake,
        };
        let synthetic_only = [
            ("--requests", o.requests.is_some()),
            ("--rate", o.rate.is_some()),
            ("--arrival-cv", o.arrival_cv.is_some()),
            ("--isl", o.isl.is_some()),
            ("--osl", o.osl.is_some()),
            ("--prefix-groups", o.prefix_groups.is_some()),
            ("--prefix-tokens", o.prefix_tokens.is_some()),
            ("--turns", o.turns.is_some()),
            ("--think-ms", o.think_ms.is_some()),
        ];
        for (flag, set) in synthetic_only {
            ensure!(
                !set || format == Format::Synthetic,
                "{flag} applies only to --format synthetic"
            );
        }
        ensure!(
            o.limit.is_none() || format != Format::Synthetic,
            "--limit applies to a trace; with --format synthetic use --requests"
        );
        ensure!(
            o.trace_block_size.is_none() || format == Format::Mooncake,
            "--trace-block-size applies only to --format mooncake"
        );
        ensure!(
            o.sla_window_s.is_none() || o.planner.is_some(),
            "--sla-window-s applies only with --planner"
        );
        ensure!(
            o.planner_observe.is_none() || o.planner.is_some(),
            "--planner-observe applies only with --planner"
        );
        for (flag, v) in [
            ("--workers", o.workers),
            ("--prefill-workers", o.prefill_workers),
            ("--decode-workers", o.decode_workers),
            ("--limit", o.limit),
            ("--concurrency", o.concurrency),
            ("--requests", o.requests),
            ("--multiply", o.multiply),
        ] {
            at_least_one(flag, v.map(|v| v as u64))?;
        }
        for (flag, v) in [
            ("--trace-block-size", o.trace_block_size),
            ("--block-size", o.block_size),
            ("--num-blocks", o.num_blocks),
            ("--cpu-offload-blocks", o.cpu_offload_blocks),
            ("--max-num-seqs", o.max_num_seqs),
            ("--max-num-batched-tokens", o.max_num_batched_tokens),
            ("--turns", o.turns),
        ] {
            at_least_one(flag, v.map(u64::from))?;
        }
        for (flag, v) in [
            ("--arrival-speedup", o.arrival_speedup),
            ("--engine-speedup", o.engine_speedup),
            ("--predict-on-route-s", o.predict_on_route_s),
            ("--rate", o.rate),
            ("--arrival-cv", o.arrival_cv),
            ("--sla-window-s", o.sla_window_s),
        ] {
            positive(flag, v)?;
        }
        non_negative("--kv-lag-ms", o.kv_lag_ms)?;
        at_least_one("--replicas", o.replicas.map(|v| v as u64))?;
        non_negative("--sync-delay-ms", o.sync_delay_ms)?;
        non_negative("--sync-batch-ms", o.sync_batch_ms)?;
        non_negative("--sync-lazy-ms", o.sync_lazy_ms)?;
        non_negative("--replica-join-s", o.replica_join_s)?;
        non_negative("--replica-fail-s", o.replica_fail_s)?;
        if let Some(p) = o.sync_loss {
            ensure!(
                (0.0..=1.0).contains(&p),
                "--sync-loss must be a probability (0 to 1), not {p}"
            );
        }
        if let Some(p) = o.kv_loss {
            ensure!(
                (0.0..=1.0).contains(&p),
                "--kv-loss must be a probability (0 to 1), not {p}"
            );
        }
        let slo = o
            .slo
            .as_deref()
            .map(|s| {
                s.parse::<kvroute_sim::slo::Slo>()
                    .map_err(|e| anyhow::anyhow!("--slo {e}"))
            })
            .transpose()?;
        let sweep = o.sweep.as_deref().map(parse_sweep).transpose()?;
        if sweep.is_some() {
            for (flag, set) in [
                ("--workers", o.workers.is_some()),
                ("--prefill-workers", o.prefill_workers.is_some()),
                ("--decode-workers", o.decode_workers.is_some()),
                ("--planner", o.planner.is_some()),
            ] {
                ensure!(!set, "--sweep sets the fleet size: not with {flag}");
            }
            ensure!(
                o.policy.as_ref().is_none_or(|p| p.len() == 1),
                "--sweep runs one policy: give --policy one name"
            );
        }
        let (lengths, noise) = noise::noise(o)?;
        let (mut base, engine_line) = sim_config(o, args)?;
        base.noise = noise;
        let policies = o.policy.clone().unwrap_or_else(|| vec!["kv".to_owned()]);
        ensure!(!policies.is_empty(), "--policy names no policy");
        let mut runs = Vec::with_capacity(policies.len());
        for (i, name) in policies.iter().enumerate() {
            ensure!(!policies[..i].contains(name), "--policy names {name} twice");
            let mut config = base.clone();
            config.router = router_spec(o, name, base.engine.block_size, base.seed)?.router_config();
            tier_cost_from_the_link(&mut config, name)?;
            match &sweep {
                None => runs.push((name.clone(), Simulation::new(config)?)),
                Some(sizes) => {
                    for &workers in sizes {
                        let mut sized = config.clone();
                        sized.topology = kvroute_sim::Topology::Aggregated { workers };
                        runs.push((format!("workers={workers}"), Simulation::new(sized)?));
                    }
                }
            }
        }
        let synthetic = (format == Format::Synthetic)
            .then(|| synthetic_config(o))
            .transpose()?;
        let profile = o.rate_profile.as_deref().map(parse_profile).transpose()?;
        Ok(Self {
            options: o,
            format,
            runs,
            block_size: base.engine.block_size,
            seed: base.seed,
            synthetic,
            profile,
            engine_line,
            slo,
            sweep,
            gpus_per_worker: base.gpus_per_worker,
            lengths,
        })
    }

    /// The trace's bytes (none for a synthetic workload), read whole so that they can be hashed.
    fn trace(&self) -> anyhow::Result<Trace> {
        if self.format == Format::Synthetic {
            return Ok(Trace {
                bytes: None,
                file: None,
            });
        }
        let Some(path) = &self.options.trace else {
            return Ok(Trace {
                bytes: Some(kvroute_sim::EXAMPLE_MOONCAKE_GZ.to_vec()),
                file: Some(crate::provenance::TraceFile::builtin()),
            });
        };
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let file = crate::provenance::TraceFile::new(path, &bytes);
        Ok(Trace {
            bytes: Some(bytes),
            file: Some(file),
        })
    }

    /// The workload and a description of where it came from: a trace's, read whole; the
    /// synthetic generator's made as the run goes when one run takes it, else made once, whole,
    /// for every run (each run making its own would draw and hash it once a run).
    fn workload(&self, trace: &Trace) -> anyhow::Result<(Requests, String)> {
        let o = self.options;
        let one_run = self.runs.len() == 1 && self.sweep.is_none();
        if let Some(config) = self.synthetic.as_ref().filter(|_| one_run) {
            let mut source = format!("the synthetic generator ({config:?})");
            let copies = o.multiply.filter(|&c| c > 1).unwrap_or(1);
            kvroute_sim::workload::multiplied_len(config.requests, copies)
                .map_err(|e| anyhow::anyhow!("--multiply {copies}: {e}"))?;
            if copies > 1 {
                source.push_str(&format!(", {copies} copies"));
            }
            self.lengths.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut warp = None;
            if let (Some(points), Some(profile)) = (&self.profile, &o.rate_profile) {
                warp = RateWarp::new(points).map_err(|e| anyhow::anyhow!("--rate-profile {profile}: {e}"))?;
                source.push_str(&format!(", rate profile {profile}"));
            }
            let shape = Reshape {
                copies,
                spread: self.lengths,
                seed: self.seed,
                speedup: o.arrival_speedup.unwrap_or(1.0),
                warp,
            };
            let requests = Requests::Synthetic {
                config: *config,
                block_size: self.block_size,
                shape,
            };
            return Ok((requests, source));
        }
        let mut workload = match (&self.synthetic, &trace.bytes) {
            (Some(config), _) => {
                let plan = WorkloadPlan::new(config, self.block_size);
                let w = plan
                    .assemble(hash_on_threads(&plan, hashing_threads()))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                (w, format!("the synthetic generator ({config:?})"))
            }
            (None, Some(bytes)) => {
                let (reader, source) = open_trace(o.trace.as_deref(), bytes);
                let w = match self.format {
                    Format::Azure => kvroute_sim::trace::read_azure(reader, self.block_size, o.limit),
                    _ => {
                        let tbs = o.trace_block_size.unwrap_or(512);
                        kvroute_sim::trace::read_mooncake(reader, tbs, self.block_size, o.limit)
                    }
                }
                .with_context(|| format!("reading {source}"))?;
                (w, source)
            }
            (None, None) => bail!("no trace and no synthetic workload"),
        };
        if let Some(copies) = o.multiply.filter(|&c| c > 1) {
            workload.0 = workload
                .0
                .multiply(copies)
                .map_err(|e| anyhow::anyhow!("--multiply {copies}: {e}"))?;
            workload.1.push_str(&format!(", {copies} copies"));
        }
        if self.lengths != kvroute_sim::LengthSpread::default() {
            workload
                .0
                .spread_lengths(&self.lengths, self.seed)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        workload.0.speed_up(o.arrival_speedup.unwrap_or(1.0));
        if let (Some(points), Some(profile)) = (&self.profile, &o.rate_profile) {
            workload
                .0
                .warp_rate(points)
                .map_err(|e| anyhow::anyhow!("--rate-profile {profile}: {e}"))?;
            workload.1.push_str(&format!(", rate profile {profile}"));
        }
        Ok((Requests::Whole(workload.0), workload.1))
    }
}

/// `v`, if set, is at least 1.
fn at_least_one(flag: &str, v: Option<u64>) -> anyhow::Result<()> {
    ensure!(v != Some(0), "{flag} must be at least 1");
    Ok(())
}

/// `v`, if set, is a finite number above 0.
fn positive(flag: &str, v: Option<f64>) -> anyhow::Result<()> {
    if let Some(v) = v {
        ensure!(
            v.is_finite() && v > 0.0,
            "{flag} must be a positive number, not {v}"
        );
    }
    Ok(())
}

/// `v`, if set, is a finite number, 0 or above.
fn non_negative(flag: &str, v: Option<f64>) -> anyhow::Result<()> {
    if let Some(v) = v {
        ensure!(
            v.is_finite() && v >= 0.0,
            "{flag} must be a number 0 or above, not {v}"
        );
    }
    Ok(())
}

/// The simulation configuration the options describe (the policy is set per run), and a line
/// saying what was derived from `--model`, if given.
fn sim_config(o: &ReplayConfig, args: &ReplayArgs) -> anyhow::Result<(SimConfig, Option<String>)> {
    let mut config = match (o.prefill_workers, o.decode_workers) {
        (None, None) => SimConfig::new(o.workers.unwrap_or(16)),
        (Some(p), Some(d)) => SimConfig::disaggregated(p, d),
        _ => bail!("--prefill-workers and --decode-workers go together"),
    };
    let plan = o
        .planner
        .as_deref()
        .map(crate::plan::PlanFile::read)
        .transpose()?;
    let flags = EngineChoice {
        block_size: o.block_size,
        num_blocks: o.num_blocks,
        max_num_seqs: o.max_num_seqs,
        max_num_batched_tokens: o.max_num_batched_tokens,
        speedup: o.engine_speedup,
        timing: o.timing.clone().map(Timing::Named),
        model: o.model.clone(),
        gpu: o.gpu.clone(),
        tp: o.tp,
        gpu_memory_utilization: o.gpu_memory_utilization,
    };
    let file = plan.as_ref().map(|p| p.engine.choice()).unwrap_or_default();
    let keys = flags.over(&file);
    let built = keys.build(&config.engine)?;
    config.engine = built.engine;
    config.gpus_per_worker = built.gpus_per_worker;
    if let (Some(plan), Some(tp)) = (&plan, keys.tp) {
        for &pool in plan.planner.mode.pools() {
            let gpus = plan.planner.gpus(pool);
            ensure!(
                gpus == tp,
                "--tp {tp}: the planner counts {gpus} GPU(s) per {pool:?} worker; set its \
                 {}_gpus = {tp}",
                format!("{pool:?}").to_lowercase()
            );
        }
    }
    config.transfer = kv_transfer(o, built.kv_bytes_per_token)?;
    config.engine.cpu_offload = o
        .cpu_offload_blocks
        .map(|n| kvroute_engine::CpuOffload::new(n, config.transfer));
    let seed = o.seed.unwrap_or(0);
    config.seed = seed;
    config.events = EventChannel {
        lag: Duration::try_from_secs_f64(o.kv_lag_ms.unwrap_or(0.0) / 1e3).context("--kv-lag-ms")?,
        loss: o.kv_loss.unwrap_or(0.0),
    };
    config.replicas = replicas(o)?;
    if let Some(concurrency) = o.concurrency {
        config.arrivals = ArrivalMode::Closed { concurrency };
    }
    config.keep_requests = args.per_request_jsonl.is_some();
    if let Some(plan) = plan {
        let window = o.sla_window_s.unwrap_or(60.0);
        config.planner = Some(PlannerSetup {
            config: plan.planner,
            keep_observations: false,
            observe: match o.planner_observe.as_deref() {
                None | Some("engines") => kvroute_planner::Observe::Engines,
                Some("router") => kvroute_planner::Observe::Router,
                Some(other) => bail!("--planner-observe {other}: engines or router"),
            },
            sla_window: Duration::try_from_secs_f64(window).context("--sla-window-s")?,
        });
    }
    if args.html.is_none() {
        config.sample_interval = None;
    }
    Ok((config, built.description))
}

/// The router replicas the options describe.
fn replicas(o: &ReplayConfig) -> anyhow::Result<Replicas> {
    let sync_on = match o.sync.as_deref() {
        None | Some("off") => false,
        Some("on") => true,
        Some(other) => bail!("--sync {other:?}: off or on"),
    };
    ensure!(
        sync_on
            || (o.sync_delay_ms.is_none()
                && o.sync_loss.is_none()
                && o.sync_batch_ms.is_none()
                && o.sync_lazy_ms.is_none()),
        "--sync-delay-ms, --sync-loss, --sync-batch-ms and --sync-lazy-ms apply only with --sync on"
    );
    let ms = |flag: &str, v: f64| Duration::try_from_secs_f64(v / 1e3).with_context(|| flag.to_owned());
    let window = ms("--sync-batch-ms", o.sync_batch_ms.unwrap_or(0.0))?;
    let batching = BatchConfig {
        window,
        lazy_window: match o.sync_lazy_ms {
            Some(v) => ms("--sync-lazy-ms", v)?,
            None => window,
        },
        ..Replicas::IMMEDIATE
    };
    let sync = if sync_on {
        ReplicaSync::On {
            delay: Duration::try_from_secs_f64(o.sync_delay_ms.unwrap_or(0.0) / 1e3)
                .context("--sync-delay-ms")?,
            loss: o.sync_loss.unwrap_or(0.0),
        }
    } else {
        ReplicaSync::Off
    };
    let spread = match o.replica_spread.as_deref() {
        None | Some("round-robin") => Spread::RoundRobin,
        Some("random") => Spread::Random,
        Some(other) => bail!("--replica-spread {other:?}: round-robin or random"),
    };
    let seconds = |flag: &str, s: Option<f64>| -> anyhow::Result<Option<Duration>> {
        s.map(|s| Duration::try_from_secs_f64(s).with_context(|| flag.to_owned()))
            .transpose()
    };
    let count = o.replicas.unwrap_or(1);
    ensure!(
        count >= 2 || (o.replica_join_s.is_none() && o.replica_fail_s.is_none()),
        "--replica-join-s and --replica-fail-s need --replicas 2 or more"
    );
    Ok(Replicas {
        count,
        sync,
        spread,
        join_at: seconds("--replica-join-s", o.replica_join_s)?,
        fail_at: seconds("--replica-fail-s", o.replica_fail_s)?,
        batching,
    })
}

/// The KV link the options describe; `model_bytes_per_token` is `--model`'s, if given.
fn kv_transfer(o: &ReplayConfig, model_bytes_per_token: Option<u64>) -> anyhow::Result<KvTransfer> {
    let bytes_per_token = match (o.kv_bytes_per_token, &o.kv_model) {
        (Some(b), _) => Some(b),
        (None, Some(name)) => Some(KvTransfer::model_bytes_per_token(name).context("--kv-model")?),
        (None, None) => model_bytes_per_token,
    };
    kv_link(o.kv_transfer_gbps, o.kv_transfer_latency_ms, bytes_per_token)
}

/// A KV link from the `--kv-transfer-gbps`, `--kv-transfer-latency-ms` and bytes-per-token
/// options of `replay` and `mock`, [`KvTransfer::default`] where one is absent.
pub(crate) fn kv_link(
    gbps: Option<f64>,
    latency_ms: Option<f64>,
    bytes_per_token: Option<u64>,
) -> anyhow::Result<KvTransfer> {
    positive("--kv-transfer-gbps", gbps)?;
    non_negative("--kv-transfer-latency-ms", latency_ms)?;
    at_least_one("--kv-bytes-per-token", bytes_per_token)?;
    let d = KvTransfer::default();
    let link = KvTransfer {
        bandwidth_bytes_per_s: gbps.map_or(d.bandwidth_bytes_per_s, |g| g * 1e9),
        bytes_per_token: bytes_per_token.unwrap_or(d.bytes_per_token),
        base_latency: match latency_ms {
            Some(ms) => Duration::try_from_secs_f64(ms / 1e3).context("--kv-transfer-latency-ms")?,
            None => d.base_latency,
        },
    };
    Ok(link)
}

/// With a CPU tier, a cost policy whose spec sets no `tier=X` prices a tier block by the
/// transfer model: the link's time against the prefill's ([`kvroute_engine::CpuOffload::block_cost`]).
fn tier_cost_from_the_link(config: &mut SimConfig, spec: &str) -> anyhow::Result<()> {
    let Some(cpu) = config.engine.cpu_offload else {
        return Ok(());
    };
    if spec.split(':').any(|option| option.starts_with("tier=")) {
        return Ok(());
    }
    if let PolicyConfig::Kv(c) | PolicyConfig::Dynamo(c) = &mut config.router.policy {
        c.cost.tier_block_cost = cpu.block_cost(&config.engine).context("--cpu-offload-blocks")?;
    }
    Ok(())
}

/// The router of the run of policy `policy`: the options [`RouterSpec`] shares with `kvroute
/// serve`, parsed and checked there, so that both commands accept the same specs, with the
/// same errors, into the same [`RouterConfig`].
fn router_spec(o: &ReplayConfig, policy: &str, block_size: u32, seed: u64) -> anyhow::Result<RouterSpec> {
    let options = RouterOptions {
        policy,
        cache: o.cache.as_deref().unwrap_or("events"),
        decider: o.decider.as_deref().unwrap_or("always"),
        block_size,
        seed,
        queue_capacity: o.queue_capacity.unwrap_or(RouterSpec::default().queue_capacity),
        busy_requests_fraction: o.busy_requests_fraction,
        when_empty: o.when_empty.as_deref().unwrap_or(WhenEmpty::default().name()),
    };
    let flagged = |e: kvroute_core::router::OptionError| anyhow::anyhow!("--{}: {}", e.key, e.error);
    let mut spec = RouterSpec::parse(&options).map_err(flagged)?;
    if let Some(ttl) = o.predict_on_route_s {
        ensure!(
            o.cache.is_none(),
            "--predict-on-route-s is --cache predict:ttl=S: give one of the two"
        );
        spec.cache = CacheMode::EventsWithPrediction(RecentConfig {
            ttl: Some(Duration::try_from_secs_f64(ttl).context("--predict-on-route-s")?),
            ..RecentConfig::PREDICT_ON_ROUTE
        });
        spec.validate().map_err(flagged)?;
    }
    Ok(spec)
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

/// `T:M,T:M,...` as (seconds, multiplier) points, checked as [`Workload::warp_rate`] checks them.
fn parse_profile(s: &str) -> anyhow::Result<Vec<(f64, f64)>> {
    let points = s
        .split(',')
        .map(|p| {
            let (t, m) = p.split_once(':')?;
            Some((t.trim().parse().ok()?, m.trim().parse().ok()?))
        })
        .collect::<Option<Vec<(f64, f64)>>>()
        .with_context(|| format!("--rate-profile {s:?}: T:M,T:M,... (seconds, multiplier)"))?;
    Workload::new(1)
        .warp_rate(&points)
        .map_err(|e| anyhow::anyhow!("--rate-profile {s:?}: {e}"))?;
    Ok(points)
}

fn synthetic_config(args: &ReplayConfig) -> anyhow::Result<SyntheticConfig> {
    let d = SyntheticConfig::default();
    Ok(SyntheticConfig {
        requests: args.requests.unwrap_or(d.requests),
        rate_rps: args.rate.unwrap_or(d.rate_rps),
        arrival: match args.arrival_cv {
            Some(cv) if cv != 1.0 => ArrivalProcess::Gamma { cv },
            _ => ArrivalProcess::Poisson,
        },
        isl: args
            .isl
            .as_deref()
            .map(|s| parse_lengths("--isl", s))
            .transpose()?
            .unwrap_or(d.isl),
        osl: args
            .osl
            .as_deref()
            .map(|s| parse_lengths("--osl", s))
            .transpose()?
            .unwrap_or(d.osl),
        prefix_groups: args.prefix_groups.unwrap_or(d.prefix_groups),
        shared_prefix_tokens: args.prefix_tokens.unwrap_or(d.shared_prefix_tokens),
        turns_per_session: args.turns.unwrap_or(d.turns_per_session),
        think_time: args.think_ms.map_or(d.think_time, Duration::from_millis),
        seed: args.seed.unwrap_or(d.seed),
    })
}

/// The requests of every run: a trace's workload, held whole, or the synthetic generator's,
/// made anew by each run as it needs them (the same requests: a run's memory then follows what
/// is in flight, not the workload's length).
enum Requests {
    Whole(Workload),
    Synthetic {
        config: SyntheticConfig,
        block_size: u32,
        shape: Reshape,
    },
}

impl Requests {
    /// Requests in all.
    fn len(&self) -> usize {
        match self {
            Self::Whole(w) => w.requests.len(),
            Self::Synthetic { config, shape, .. } => config.requests.saturating_mul(shape.copies.max(1)),
        }
    }

    /// How they were had.
    fn how(&self) -> &'static str {
        match self {
            Self::Whole(_) => "loaded",
            Self::Synthetic { .. } => "planned, made as each run goes,",
        }
    }

    /// `sim` run on the requests, a synthetic workload's blocks hashed on `threads` threads.
    fn run(
        &self,
        sim: &Simulation,
        threads: usize,
        progress: &mut dyn FnMut(kvroute_sim::Progress),
    ) -> anyhow::Result<RunResult> {
        Ok(match self {
            Self::Whole(w) => sim.run(w, progress)?,
            Self::Synthetic {
                config,
                block_size,
                shape,
            } => {
                let chunk = SyntheticStream::CHUNK * threads.max(1);
                let stream = SyntheticStream::with_hasher(
                    config,
                    *block_size,
                    chunk,
                    Box::new(move |plan: &WorkloadPlan| hash_on_threads(plan, threads)),
                );
                let source = Reshaped::new(stream, shape.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
                sim.run_source(source, progress)?
            }
        })
    }
}

/// Threads to hash a synthetic workload on when one run goes at a time: every core.
fn hashing_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The own blocks of `plan`'s requests, hashed on `threads` threads, one range each: the
/// simulator's crate starts no thread, so its generator's hashing step
/// ([`kvroute_sim::synthetic::WorkloadPlan::hash`]) runs here.
fn hash_on_threads(plan: &WorkloadPlan, threads: usize) -> Vec<OwnBlocks> {
    let all = plan.requests();
    let chunk = all.len().div_ceil(threads.max(1)).max(1);
    if threads <= 1 || all.len() <= chunk {
        return vec![plan.hash(all)];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = all
            .clone()
            .step_by(chunk)
            .map(|first| scope.spawn(move || plan.hash(first..first + chunk)))
            .collect();
        // A thread that panicked hashes nothing: its range is missing, which the stream
        // reports as an error.
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    })
}

/// `N` or `MIN-MAX` tokens, at least 1.
fn parse_lengths(flag: &str, s: &str) -> anyhow::Result<Lengths> {
    let num = |x: &str| match x.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => bail!("{flag} {s:?}: N or MIN-MAX, whole numbers from 1 to {}", u32::MAX),
    };
    Ok(match s.split_once('-') {
        Some((a, b)) => {
            let (min, max) = (num(a)?, num(b)?);
            ensure!(min <= max, "{flag} {s:?}: MIN is above MAX");
            Lengths::Uniform { min, max }
        }
        None => Lengths::Fixed(num(s)?),
    })
}

/// A reader over the trace's bytes (gunzipped if the file ends in `.gz`; the built-in example is
/// gzip'd), and its description.
fn open_trace<'b>(path: Option<&Path>, bytes: &'b [u8]) -> (Box<dyn BufRead + 'b>, String) {
    let Some(path) = path else {
        return (
            Box::new(BufReader::new(GzDecoder::new(bytes))),
            "the built-in example (first 2,000 rows of the Mooncake conversation trace)".to_owned(),
        );
    };
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(GzDecoder::new(bytes))
    } else {
        Box::new(bytes)
    };
    (
        Box::new(BufReader::with_capacity(1 << 20, reader)),
        path.display().to_string(),
    )
}
