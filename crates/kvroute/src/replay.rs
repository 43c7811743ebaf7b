//! `kvroute replay`: a trace (or a generated workload) through the cluster simulator, under one
//! or several policies, with a text table on stdout and optional JSON, JSONL and HTML outputs.
//!
//! Options come from flags and from an optional TOML file (`--config`) whose keys are the long
//! flag names; unknown keys are rejected and flags beat the file.

use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use flate2::read::GzDecoder;
use kvroute_core::router::policy::CostPolicyConfig;
use kvroute_core::router::{CacheMode, Decider, DecodeProjection, PolicyConfig, RecentConfig, RouterConfig};
use kvroute_sim::synthetic::{ArrivalProcess, Lengths, SyntheticConfig};
use kvroute_sim::{
    ArrivalMode, EventChannel, KvTransfer, PlannerSetup, Progress, Report, RunResult, SimConfig, Simulation,
    Workload,
};
use serde::Deserialize;

/// The options of `kvroute replay`. Every option is also a key of the `--config` TOML file.
#[derive(Args, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ReplayArgs {
    /// The trace file (`.jsonl[.gz]` Mooncake, `.csv[.gz]` Azure). Default: the built-in first
    /// 2,000 rows of the Mooncake conversation trace. Ignored with `--format synthetic`.
    pub trace: Option<PathBuf>,
    /// A TOML file of options (keys: the long flag names); flags beat it.
    #[arg(long)]
    #[serde(skip)]
    pub config: Option<PathBuf>,
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
    /// Policies, comma-separated; each runs the identical workload. `kv:full` / `kv:staged`
    /// (and `dynamo:...`) choose the decode projection. Default `kv`.
    #[arg(long, value_delimiter = ',')]
    pub policy: Option<Vec<String>>,
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
    /// Engine KV blocks per worker. Default 16,384.
    #[arg(long)]
    pub num_blocks: Option<u32>,
    /// Engine max running requests. Default 256.
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Engine token budget per forward pass. Default 8,192.
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// Divide modelled step times by this. Default 1.
    #[arg(long)]
    pub engine_speedup: Option<f64>,
    /// KV-event lag in milliseconds. Default 0.
    #[arg(long)]
    pub kv_lag_ms: Option<f64>,
    /// Probability that a KV event is lost. Default 0.
    #[arg(long)]
    pub kv_loss: Option<f64>,
    /// Also use the router's record of its own decisions (TTL in seconds) as a cache view.
    #[arg(long)]
    pub predict_on_route_s: Option<f64>,
    /// Router queue: requests per worker above which a worker is busy (fraction of
    /// max-num-seqs). Default: never busy.
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
    /// A planner TOML file (`kvroute_planner::PlannerConfig`): the planner adds and removes
    /// workers during the run, starting from `--workers` (or the two pools); its mode must fit
    /// the topology. The report gains the planner's keys, decisions and ticks.
    #[arg(long)]
    pub planner: Option<PathBuf>,
    /// With `--planner`: seconds per SLA-attainment window. Default 60.
    #[arg(long)]
    pub sla_window_s: Option<f64>,
    /// Time-varying load: re-time the arrivals so that the rate is the trace's times a
    /// piecewise-linear multiplier, `T:M,T:M,...` (seconds after the other arrival options,
    /// multiplier), e.g. `0:0.5,1800:3,3600:0.5`.
    #[arg(long)]
    pub rate_profile: Option<String>,
    /// Write the report as JSON (several policies: one object per policy, under its name).
    #[arg(long)]
    #[serde(skip)]
    pub report_json: Option<PathBuf>,
    /// Write one JSON line per request (several policies: a `policy` field on each).
    #[arg(long)]
    #[serde(skip)]
    pub per_request_jsonl: Option<PathBuf>,
    /// Write a self-contained HTML page of plots.
    #[arg(long)]
    #[serde(skip)]
    pub html: Option<PathBuf>,
}

macro_rules! merge {
    ($flags:ident, $file:ident; $($field:ident),* $(,)?) => {
        $( if $flags.$field.is_none() { $flags.$field = $file.$field.take(); } )*
    };
}

impl ReplayArgs {
    /// These flags over the `--config` file's values.
    fn with_file(mut self) -> anyhow::Result<Self> {
        let Some(path) = &self.config else { return Ok(self) };
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut file: ReplayArgs =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        merge!(self, file; trace, format, workers, prefill_workers, decode_workers, decider,
            kv_transfer_gbps, kv_transfer_latency_ms, kv_bytes_per_token, kv_model, policy, seed, limit, trace_block_size,
            arrival_speedup, concurrency, block_size, num_blocks, max_num_seqs,
            max_num_batched_tokens, engine_speedup, kv_lag_ms, kv_loss, predict_on_route_s,
            busy_requests_fraction, requests, rate, arrival_cv, isl, osl, prefix_groups,
            prefix_tokens, turns, think_ms, planner, sla_window_s, rate_profile);
        Ok(self)
    }
}

/// Runs `kvroute replay`.
pub fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let args = args.with_file()?;
    let base = sim_config(&args)?;
    let t0 = Instant::now();
    let (workload, source) = load_workload(&args, base.engine.block_size)?;
    eprintln!(
        "workload: {} requests from {source} (loaded in {:.2}s)",
        workload.requests.len(),
        t0.elapsed().as_secs_f64()
    );
    let policies = args.policy.clone().unwrap_or_else(|| vec!["kv".to_owned()]);
    let mut results: Vec<(String, RunResult)> = Vec::new();
    for name in &policies {
        let mut config = base.clone();
        config.router.policy = parse_policy(name)?;
        let sim = Simulation::new(config)?;
        let started = Instant::now();
        let mut bar = ProgressBar::new(name, started);
        let result = sim.run(&workload, &mut |p| bar.update(p))?;
        bar.finish();
        eprintln!(
            "{name}: simulated in {:.3}s wall",
            started.elapsed().as_secs_f64()
        );
        results.push((name.clone(), result));
    }
    let reports: Vec<(String, Report)> = results
        .iter()
        .map(|(n, r)| (n.clone(), r.report.clone()))
        .collect();
    print!("{}", kvroute_sim::report::table(&reports));
    write_outputs(&args, &results)
}

/// The simulation configuration the options describe (the policy is set per run).
fn sim_config(args: &ReplayArgs) -> anyhow::Result<SimConfig> {
    let mut config = match (args.prefill_workers, args.decode_workers) {
        (None, None) => SimConfig::new(args.workers.unwrap_or(16)),
        (Some(p), Some(d)) => SimConfig::disaggregated(p, d),
        _ => bail!("--prefill-workers and --decode-workers go together"),
    };
    config.transfer = kv_transfer(args)?;
    let e = &mut config.engine;
    e.block_size = args.block_size.unwrap_or(e.block_size);
    e.num_blocks = args.num_blocks.unwrap_or(e.num_blocks);
    e.max_num_seqs = args.max_num_seqs.unwrap_or(e.max_num_seqs);
    e.max_num_batched_tokens = args.max_num_batched_tokens.unwrap_or(e.max_num_batched_tokens);
    e.speedup = args.engine_speedup.unwrap_or(e.speedup);
    let seed = args.seed.unwrap_or(0);
    config.seed = seed;
    config.router = RouterConfig {
        block_size: e.block_size,
        seed,
        ..RouterConfig::default()
    };
    if let Some(ttl) = args.predict_on_route_s {
        config.router.cache = CacheMode::EventsWithPrediction(RecentConfig {
            ttl: Some(Duration::try_from_secs_f64(ttl).context("--predict-on-route-s")?),
            ..RecentConfig::PREDICT_ON_ROUTE
        });
    }
    config.router.busy.requests_fraction = args.busy_requests_fraction;
    if let Some(decider) = &args.decider {
        config.router.decider = parse_decider(decider)?;
    }
    config.events = EventChannel {
        lag: Duration::try_from_secs_f64(args.kv_lag_ms.unwrap_or(0.0) / 1e3).context("--kv-lag-ms")?,
        loss: args.kv_loss.unwrap_or(0.0),
    };
    if let Some(concurrency) = args.concurrency {
        config.arrivals = ArrivalMode::Closed { concurrency };
    }
    config.keep_requests = args.per_request_jsonl.is_some();
    if let Some(path) = &args.planner {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let planner: kvroute_planner::PlannerConfig =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let window = args.sla_window_s.unwrap_or(60.0);
        config.planner = Some(PlannerSetup {
            config: planner,
            sla_window: Duration::try_from_secs_f64(window).context("--sla-window-s")?,
        });
    }
    if args.html.is_none() {
        config.sample_interval = None;
    }
    Ok(config)
}

/// The KV link the options describe.
fn kv_transfer(args: &ReplayArgs) -> anyhow::Result<KvTransfer> {
    let bytes_per_token = match (args.kv_bytes_per_token, &args.kv_model) {
        (Some(b), _) => Some(b),
        (None, Some(name)) => Some(KvTransfer::model_bytes_per_token(name)?),
        (None, None) => None,
    };
    kv_link(
        args.kv_transfer_gbps,
        args.kv_transfer_latency_ms,
        bytes_per_token,
    )
}

/// A KV link from the `--kv-transfer-gbps`, `--kv-transfer-latency-ms` and bytes-per-token
/// options of `replay` and `mock`, [`KvTransfer::default`] where one is absent.
pub(crate) fn kv_link(
    gbps: Option<f64>,
    latency_ms: Option<f64>,
    bytes_per_token: Option<u64>,
) -> anyhow::Result<KvTransfer> {
    let d = KvTransfer::default();
    let link = KvTransfer {
        bandwidth_bytes_per_s: gbps.map_or(d.bandwidth_bytes_per_s, |g| g * 1e9),
        bytes_per_token: bytes_per_token.unwrap_or(d.bytes_per_token),
        base_latency: match latency_ms {
            Some(ms) => Duration::try_from_secs_f64(ms / 1e3).context("--kv-transfer-latency-ms")?,
            None => d.base_latency,
        },
    };
    anyhow::ensure!(
        link.bandwidth_bytes_per_s.is_finite() && link.bandwidth_bytes_per_s > 0.0,
        "--kv-transfer-gbps must be positive"
    );
    Ok(link)
}

/// `never`, `always` or a threshold in tokens ([`Decider::from_name`]).
fn parse_decider(s: &str) -> anyhow::Result<Decider> {
    Decider::from_name(s).with_context(|| format!("--decider {s:?}"))
}

/// A policy spec: a name, then for the cost policies (`kv`, `dynamo`) optional `:`-separated
/// overrides: `full` or `staged` (the decode projection), `scale=X` (`prefill_load_scale`),
/// `credit=X` (`overlap_credit`). For example `kv:full` or `dynamo:staged:scale=2`.
fn parse_policy(spec: &str) -> anyhow::Result<PolicyConfig> {
    let mut parts = spec.split(':');
    let name = parts.next().unwrap_or_default();
    let mut policy = PolicyConfig::from_name(name)?;
    for part in parts {
        let (PolicyConfig::Kv(CostPolicyConfig { cost, .. })
        | PolicyConfig::Dynamo(CostPolicyConfig { cost, .. })) = &mut policy
        else {
            bail!("{name} takes no options (in {spec:?})");
        };
        match part.split_once('=') {
            None if part == "full" => cost.projection = DecodeProjection::Full,
            None if part == "staged" => cost.projection = DecodeProjection::Staged,
            Some(("scale", v)) => {
                cost.prefill_load_scale = v.parse().with_context(|| format!("scale in {spec:?}"))?
            }
            Some(("credit", v)) => {
                cost.overlap_credit = v.parse().with_context(|| format!("credit in {spec:?}"))?
            }
            _ => bail!("unknown option {part:?} in {spec:?} (full, staged, scale=X, credit=X)"),
        }
    }
    Ok(policy)
}

/// The workload and a description of where it came from.
fn load_workload(args: &ReplayArgs, block_size: u32) -> anyhow::Result<(Workload, String)> {
    let format = match (&args.format, &args.trace) {
        (Some(f), _) => f.clone(),
        (None, Some(path)) if path.to_string_lossy().contains(".csv") => "azure".to_owned(),
        _ => "mooncake".to_owned(),
    };
    let mut workload = match format.as_str() {
        "synthetic" => {
            let config = synthetic_config(args)?;
            let w = kvroute_sim::synthetic::generate(&config, block_size);
            (w, format!("the synthetic generator ({config:?})"))
        }
        "mooncake" => {
            let tbs = args.trace_block_size.unwrap_or(512);
            let (reader, source) = open_trace(args.trace.as_deref())?;
            let w = kvroute_sim::trace::read_mooncake(reader, tbs, block_size, args.limit)?;
            (w, source)
        }
        "azure" => {
            let Some(path) = &args.trace else {
                bail!("--format azure needs a TRACE file")
            };
            let (reader, source) = open_trace(Some(path))?;
            (
                kvroute_sim::trace::read_azure(reader, block_size, args.limit)?,
                source,
            )
        }
        other => bail!("unknown format {other:?} (mooncake, azure or synthetic)"),
    };
    workload.0.speed_up(args.arrival_speedup.unwrap_or(1.0));
    if let Some(profile) = &args.rate_profile {
        workload
            .0
            .warp_rate(&parse_profile(profile)?)
            .map_err(anyhow::Error::msg)?;
        workload.1.push_str(&format!(", rate profile {profile}"));
    }
    Ok(workload)
}

/// `T:M,T:M,...` as (seconds, multiplier) points.
fn parse_profile(s: &str) -> anyhow::Result<Vec<(f64, f64)>> {
    s.split(',')
        .map(|p| {
            let (t, m) = p
                .split_once(':')
                .with_context(|| format!("--rate-profile point {p:?}: T:M"))?;
            Ok((
                t.trim().parse().with_context(|| format!("time in {p:?}"))?,
                m.trim().parse().with_context(|| format!("multiplier in {p:?}"))?,
            ))
        })
        .collect()
}

fn synthetic_config(args: &ReplayArgs) -> anyhow::Result<SyntheticConfig> {
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
            .map(parse_lengths)
            .transpose()?
            .unwrap_or(d.isl),
        osl: args
            .osl
            .as_deref()
            .map(parse_lengths)
            .transpose()?
            .unwrap_or(d.osl),
        prefix_groups: args.prefix_groups.unwrap_or(d.prefix_groups),
        shared_prefix_tokens: args.prefix_tokens.unwrap_or(d.shared_prefix_tokens),
        turns_per_session: args.turns.unwrap_or(d.turns_per_session),
        think_time: args.think_ms.map_or(d.think_time, Duration::from_millis),
        seed: args.seed.unwrap_or(d.seed),
    })
}

fn parse_lengths(s: &str) -> anyhow::Result<Lengths> {
    let num = |x: &str| {
        x.trim()
            .parse::<u32>()
            .with_context(|| format!("bad length {s:?}"))
    };
    Ok(match s.split_once('-') {
        Some((a, b)) => Lengths::Uniform {
            min: num(a)?,
            max: num(b)?,
        },
        None => Lengths::Fixed(num(s)?),
    })
}

/// A reader over the trace (gunzipped if it ends in `.gz`), or over the built-in example.
fn open_trace(path: Option<&Path>) -> anyhow::Result<(Box<dyn BufRead>, String)> {
    let Some(path) = path else {
        let reader = GzDecoder::new(kvroute_sim::EXAMPLE_MOONCAKE_GZ);
        return Ok((
            Box::new(BufReader::new(reader)),
            "the built-in example (first 2,000 rows of the Mooncake conversation trace)".to_owned(),
        ));
    };
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    Ok((
        Box::new(BufReader::with_capacity(1 << 20, reader)),
        path.display().to_string(),
    ))
}

fn write_outputs(args: &ReplayArgs, results: &[(String, RunResult)]) -> anyhow::Result<()> {
    if let Some(path) = &args.report_json {
        let text = if let [(_, only)] = results {
            serde_json::to_string_pretty(&only.report)?
        } else {
            let map: Vec<(&str, &Report)> = results.iter().map(|(n, r)| (n.as_str(), &r.report)).collect();
            serde_json::to_string_pretty(&OrderedMap(&map))?
        };
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.per_request_jsonl {
        let mut out = std::io::BufWriter::new(
            File::create(path).with_context(|| format!("creating {}", path.display()))?,
        );
        for (name, result) in results {
            for record in &result.requests {
                let mut value = serde_json::to_value(record)?;
                if results.len() > 1
                    && let Some(obj) = value.as_object_mut()
                {
                    obj.insert("policy".to_owned(), serde_json::Value::String(name.clone()));
                }
                writeln!(out, "{value}")?;
            }
        }
        out.flush()?;
    }
    if let Some(path) = &args.html {
        let page = kvroute_sim::html::page(results);
        std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Serializes `(name, report)` pairs as one JSON object, in order.
struct OrderedMap<'a>(&'a [(&'a str, &'a Report)]);

impl serde::Serialize for OrderedMap<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// A one-line progress bar on stderr, drawn only on a terminal and only after a second.
struct ProgressBar<'a> {
    name: &'a str,
    started: Instant,
    drawn: bool,
    tty: bool,
}

impl<'a> ProgressBar<'a> {
    fn new(name: &'a str, started: Instant) -> Self {
        Self {
            name,
            started,
            drawn: false,
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn update(&mut self, p: Progress) {
        if !self.tty || self.started.elapsed() < Duration::from_secs(1) || p.total == 0 {
            return;
        }
        let frac = p.done as f64 / p.total as f64;
        let filled = (frac * 30.0) as usize;
        eprint!(
            "\r{} [{}{}] {:>3.0}%  {}/{} requests, {:.0} s simulated",
            self.name,
            "#".repeat(filled),
            " ".repeat(30 - filled.min(30)),
            frac * 100.0,
            p.done,
            p.total,
            p.now.as_secs_f64()
        );
        self.drawn = true;
    }

    fn finish(&self) {
        if self.drawn {
            eprintln!();
        }
    }
}
