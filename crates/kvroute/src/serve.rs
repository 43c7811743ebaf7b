//! `kvroute serve` and `kvroute mock`: flags (and for serve a `--config` TOML file under the same
//! kebab-case names, the keys of the server's `ServeConfig`; flags beat it) into the server
//! crate's configurations, on a Tokio runtime.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use clap::Args;
use kvroute_http::Model;
use kvroute_mock::{self as mock, MockConfig};
use kvroute_proxy::{ServeConfig, WorkerConfig};
use kvroute_wire::EventEncoding;
use serde::{Deserialize, Serialize};

/// The options of `kvroute serve`: the configuration and the file it may come from.
#[derive(Args, Debug, Default)]
pub struct ServeArgs {
    /// A TOML file of options (keys: the long flag names, e.g. `queue-capacity = 64`; workers
    /// as `[[worker]]` tables); flags beat it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The configuration (flags; `--config` keys under the same names).
    #[command(flatten)]
    pub options: ServeOptions,
}

/// The configuration of `kvroute serve`: every option is a flag and a key of the `--config`
/// file under one kebab-case name, the keys of the server's `ServeConfig`. Unset options take
/// the defaults their docs name.
#[derive(Args, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct ServeOptions {
    /// Listen address, `HOST:PORT`. Default 127.0.0.1:8000.
    #[arg(long)]
    pub listen: Option<String>,
    /// A worker: `URL[,events=tcp://H:P][,replay=tcp://H:P][,topic=T][,dp=N][,block-size=N]
    /// [,engine=vllm|sglang][,role=agg|prefill|decode][,capacity=BLOCKS][,max-requests=N]
    /// [,bootstrap-port=N]` (`engine`: how a request names its data-parallel rank;
    /// `bootstrap-port`: a prefill worker's SGLang bootstrap port). Repeat for several;
    /// replaces the file's `[[worker]]` tables, whose keys are the same.
    #[arg(long, value_parser = parse_worker)]
    pub worker: Option<Vec<WorkerConfig>>,
    /// Model name served. Default `tiny`.
    #[arg(long)]
    pub model_name: Option<String>,
    /// Local model directory (`tokenizer.json`, `tokenizer_config.json`). Default: the built-in
    /// tiny byte-level model.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Routing policy (kv, dynamo, sglang-cache-aware, llmd-weighted, least-loaded,
    /// power-of-two, round-robin, random). Default kv.
    #[arg(long)]
    pub policy: Option<String>,
    /// Tokens per KV block, as the engines use. Default 16.
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Router seed. Default 0.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Disaggregation decider, for requests routed to `role=decode` workers: `always` (prefill
    /// on a prefill worker first), `never`, or N (when more than N prompt tokens are uncached
    /// on the chosen decode worker). Default always.
    #[arg(long)]
    pub decider: Option<String>,
    /// How prefill and decode workers hand KV over: `vllm` (two hops with
    /// kv_transfer_params) or `sglang` (bootstrap host, port and room, to both at once).
    /// Default vllm.
    #[arg(long)]
    pub disagg_protocol: Option<kvroute_proxy::EngineKind>,
    /// Cache view: events, predict or approximate. Default events.
    #[arg(long)]
    pub cache: Option<String>,
    /// Router queue capacity (0: reject when every worker is busy). Default 1024.
    #[arg(long)]
    pub queue_capacity: Option<usize>,
    /// How long a request may wait in the queue before a 503, ms. Default 30,000.
    #[arg(long)]
    pub queue_timeout_ms: Option<u64>,
    /// A worker is busy above this fraction of its max requests. Default: never.
    #[arg(long)]
    pub busy_requests_fraction: Option<f64>,
    /// Largest request body in bytes. Default 4 MiB.
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Most prompt tokens. Default 131072.
    #[arg(long)]
    pub max_prompt_tokens: Option<usize>,
    /// Longest silence from a worker while a request runs before a 504, ms. Default 600,000.
    #[arg(long)]
    pub request_timeout_ms: Option<u64>,
    /// TCP connect timeout to a worker, ms. Default 2,000.
    #[arg(long)]
    pub connect_timeout_ms: Option<u64>,
    /// Health-check interval, ms (0: off). Default 5000.
    #[arg(long)]
    pub health_interval_ms: Option<u64>,
    /// Timeout of one health check, ms. Default 1,000.
    #[arg(long)]
    pub health_timeout_ms: Option<u64>,
    /// Failed health checks in a row that take a worker out of routing. Default 3.
    #[arg(long)]
    pub health_failure_threshold: Option<u32>,
    /// Passing health checks in a row that bring an unhealthy worker back. Default 2.
    #[arg(long)]
    pub health_success_threshold: Option<u32>,
    /// Runtime worker threads (0: one per core). Default 0.
    #[arg(long)]
    pub threads: Option<usize>,
    /// The most KV blocks the router's view keeps per worker rank (the oldest evicted past
    /// it). Default 1,048,576.
    #[arg(long)]
    pub max_blocks_per_worker: Option<usize>,
}

/// A `--worker` flag.
fn parse_worker(s: &str) -> Result<WorkerConfig, String> {
    WorkerConfig::parse_flag(s).map_err(|e| e.to_string())
}

impl ServeArgs {
    /// The configuration: the file's options, the flags over them, the defaults under both;
    /// checked.
    pub fn to_config(&self) -> anyhow::Result<ServeConfig> {
        let options = crate::config::layered(self.config.as_deref(), &self.options)?;
        let config: ServeConfig = toml::Value::Table(crate::config::to_table(&options)?).try_into()?;
        // The server names a field by its key, which is also the flag.
        config.validate().map_err(|e| match e {
            kvroute_proxy::config::ConfigError::Invalid { field, message } => {
                anyhow::anyhow!("--{field}: {message}")
            }
            other => other.into(),
        })?;
        Ok(config)
    }
}

/// A Tokio runtime with `threads` workers (0: one per core).
pub fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if threads > 0 {
        builder.worker_threads(threads);
    }
    builder.enable_all().build().context("starting the runtime")
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs `kvroute serve` until the process is stopped.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    init_logging();
    let config = args.to_config()?;
    if config.workers.is_empty() {
        eprintln!("no workers yet: add them with --worker or POST /admin/workers");
    }
    runtime(config.threads)?.block_on(async move {
        let proxy = kvroute_proxy::start(config, None).await?;
        eprintln!("kvroute serve: listening on {}", proxy.url());
        proxy.stopped().await;
        Ok(())
    })
}

/// The options of `kvroute mock`.
#[derive(Args, Debug)]
pub struct MockArgs {
    /// Mock workers to run (decode workers with `--prefill`, aggregated ones without).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Prefill workers, started first (ports before the others'); the `--workers` then have
    /// role `decode`. Every mock speaks both sides of vLLM's kv_transfer_params protocol; in
    /// SGLang's bootstrap protocol the role picks the side. Default 0.
    #[arg(long, default_value_t = 0)]
    pub prefill: usize,
    /// KV link bandwidth of imports (remote prefills), GB/s (10^9 bytes). Default 64.
    #[arg(long)]
    pub kv_transfer_gbps: Option<f64>,
    /// Fixed latency of a KV transfer, ms. Default 0.05.
    #[arg(long)]
    pub kv_transfer_latency_ms: Option<f64>,
    /// KV bytes per token. Default 131072 (Llama-3.1-8B in fp16).
    #[arg(long)]
    pub kv_bytes_per_token: Option<u64>,
    /// HTTP port of the first worker; worker i listens on PORT+i (0: free ports).
    #[arg(long, default_value_t = 8001)]
    pub port: u16,
    /// ZMQ port of the first worker's events; worker i publishes on EVENT_PORT+2i and replays
    /// on EVENT_PORT+2i+1 (0: free ports). With --dp N, worker i's rank r publishes on
    /// EVENT_PORT+2iN+r and replays on EVENT_PORT+2iN+N+r.
    #[arg(long, default_value_t = 5557)]
    pub event_port: u16,
    /// Data-parallel ranks per worker: an engine each behind the worker's port, chosen by
    /// vLLM's X-data-parallel-rank header or SGLang's data_parallel_rank field.
    #[arg(long, default_value_t = 1)]
    pub dp: u32,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Divide the engine's modeled step times by this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// KV-event encoding: map (vLLM since mid 2026) or positional (older vLLM, SGLang).
    #[arg(long, default_value = "map")]
    pub encoding: String,
    /// Publish no KV events.
    #[arg(long)]
    pub no_events: bool,
    /// Batches each worker rank's replay socket keeps (vLLM's buffer_steps).
    #[arg(long, default_value_t = 10_000)]
    pub replay_buffer: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV blocks per worker.
    #[arg(long, default_value_t = 16_384)]
    pub num_blocks: u32,
    /// Output tokens of a request that names no max_tokens.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,
    /// Local model directory (the proxy's, so prompts tokenize alike). Default: the built-in
    /// tiny model.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Model name served.
    #[arg(long, default_value = "tiny")]
    pub model_name: String,
}

/// Parses `map` or `positional`.
pub fn encoding(s: &str) -> anyhow::Result<EventEncoding> {
    Ok(match s {
        "map" => EventEncoding::Map,
        "positional" => EventEncoding::Positional,
        other => bail!("--encoding {other:?}: map or positional"),
    })
}

/// Checks `kvroute mock`'s flags: counts of at least one, ports that exist for every worker.
fn check_mock(args: &MockArgs) -> anyhow::Result<()> {
    let workers = args.workers + args.prefill;
    ensure!(
        workers >= 1,
        "--workers (with --prefill) must give at least 1 worker"
    );
    ensure!(args.dp >= 1, "--dp must be at least 1");
    ensure!(
        args.speedup.is_finite() && args.speedup > 0.0,
        "--speedup must be a positive number, not {}",
        args.speedup
    );
    ensure!(args.block_size >= 1, "--block-size must be at least 1");
    ensure!(args.num_blocks >= 1, "--num-blocks must be at least 1");
    ensure!(
        args.default_max_tokens >= 1,
        "--default-max-tokens must be at least 1"
    );
    let last = |first: u16, ports: u64| u64::from(first) + ports.saturating_sub(1);
    ensure!(
        args.port == 0 || last(args.port, workers as u64) <= 65535,
        "--port {}: {workers} workers need ports up to {}, past 65535",
        args.port,
        last(args.port, workers as u64)
    );
    let event_ports = 2 * workers as u64 * u64::from(args.dp);
    ensure!(
        args.no_events || args.event_port == 0 || last(args.event_port, event_ports) <= 65535,
        "--event-port {}: {workers} workers of {} ranks need ports up to {}, past 65535",
        args.event_port,
        args.dp,
        last(args.event_port, event_ports)
    );
    Ok(())
}

/// Runs `kvroute mock` until the process is stopped.
pub fn mock(args: MockArgs) -> anyhow::Result<()> {
    init_logging();
    check_mock(&args)?;
    let mut config = MockConfig::new(args.workers);
    config.prefill_workers = args.prefill;
    config.transfer = crate::replay::kv_link(
        args.kv_transfer_gbps,
        args.kv_transfer_latency_ms,
        args.kv_bytes_per_token,
    )?;
    config.host = args.host;
    config.port = args.port;
    config.event_port = args.event_port;
    config.dp_size = args.dp;
    config.events = !args.no_events;
    config.encoding = encoding(&args.encoding)?;
    config.replay_buffer_steps = args.replay_buffer;
    config.engine.speedup = args.speedup;
    config.engine.block_size = args.block_size;
    config.engine.num_blocks = args.num_blocks;
    config.default_max_tokens = args.default_max_tokens;
    config.model_name = args.model_name.clone();
    let model = Arc::new(match &args.model_dir {
        Some(dir) => Model::load(dir)?,
        None => Model::tiny()?,
    });
    runtime(0)?.block_on(async move {
        let workers = mock::start(&config, model).await?;
        let mut flags = Vec::new();
        for w in &workers {
            let flag = w.worker_flag();
            eprintln!("mock worker: {flag}");
            flags.push(format!("--worker {flag}"));
        }
        eprintln!(
            "route to them with:\n  kvroute serve --block-size {} {}",
            config.engine.block_size,
            flags.join(" ")
        );
        if config.prefill_workers > 0 {
            eprintln!(
                "(vLLM's kv_transfer_params flow; add --disagg-protocol sglang for SGLang's bootstrap rooms)"
            );
        }
        std::future::pending::<()>().await;
        Ok(())
    })
}
