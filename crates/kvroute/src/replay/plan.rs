//! A checked `kvroute replay` configuration: every option parsed and checked, or the flag that
//! is wrong named, before any work; the simulations it describes.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use kvroute_core::router::replica::BatchConfig;
use kvroute_core::router::{CacheMode, PolicyConfig, RecentConfig, RouterOptions, RouterSpec, WhenEmpty};
use kvroute_sim::synthetic::SyntheticConfig;
use kvroute_sim::{
    ArrivalMode, EventChannel, KvTransfer, PlannerSetup, ReplicaSync, Replicas, SimConfig, Simulation, Spread,
};

use super::workload::{parse_profile, synthetic_config};
use super::{ReplayArgs, ReplayConfig};
use crate::hardware::{EngineChoice, Timing};

/// Where the workload comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Format {
    Mooncake,
    Azure,
    Synthetic,
}

/// A checked configuration: everything `kvroute replay` will do, decided before any work.
pub(super) struct Plan<'a> {
    pub(super) options: &'a ReplayConfig,
    pub(super) format: Format,
    /// One simulation per policy, in the order named.
    pub(super) runs: Vec<(String, Simulation)>,
    pub(super) block_size: u32,
    pub(super) seed: u64,
    pub(super) synthetic: Option<SyntheticConfig>,
    pub(super) profile: Option<Vec<(f64, f64)>>,
    /// What `--model` derived, said on stderr.
    pub(super) engine_line: Option<String>,
    /// `--slo`.
    pub(super) slo: Option<kvroute_sim::slo::Slo>,
    /// `--sweep`'s fleet sizes, ascending (one run each, in that order).
    pub(super) sweep: Option<Vec<usize>>,
    /// GPUs per worker (`--tp`).
    pub(super) gpus_per_worker: u32,
    /// Prompt- and output-length spread, applied to the workload once built.
    pub(super) lengths: kvroute_sim::LengthSpread,
}

impl<'a> Plan<'a> {
    /// Checks every option, or says which flag is wrong.
    pub(super) fn new(o: &'a ReplayConfig, args: &ReplayArgs) -> anyhow::Result<Self> {
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
        let (lengths, noise) = super::noise::noise(o)?;
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
