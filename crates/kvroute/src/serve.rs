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
    /// Log format on stderr: `text`, or `json` (one object a line; a request's lines carry its
    /// `request_id`, the `x-request-id` its answer names).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// The configuration (flags; `--config` keys under the same names).
    #[command(flatten)]
    pub options: ServeOptions,
    /// Run the SLA planner on this proxy's fleet: a planner file (`[planner]`, `[engine]`,
    /// `[actuator]`, `[drain]`; the file `kvroute replay --planner` takes), its decisions carried
    /// out by its `[actuator]` (process, external or dry-run). With `[[model]]` tables,
    /// `MODEL=FILE`, once per model to plan: each model's fleet its own planner.
    #[arg(long, value_name = "FILE")]
    pub planner: Vec<String>,
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
    /// The admin API's own listen address (`/admin/...` never answers on `--listen`). Beyond
    /// loopback it needs `--admin-token`. Default 127.0.0.1:8100.
    #[arg(long)]
    pub admin_listen: Option<String>,
    /// The bearer token the admin API requires (better in the `--config` file than on a
    /// command line). Required when `--admin-listen` is beyond loopback. Default: none.
    #[arg(long)]
    pub admin_token: Option<String>,
    /// An API key of the inference API (`Authorization: Bearer KEY`); repeat for several
    /// (`api-key = [..]` in the file). `/health` and `/metrics` need none. Default: none
    /// needed.
    #[arg(long)]
    pub api_key: Option<Vec<String>>,
    /// Longest a client may take to send a request's headers, ms. Default 10,000.
    #[arg(long)]
    pub header_read_timeout_ms: Option<u64>,
    /// Longest a client may take to send a request's body (408 past it), ms. Default 30,000.
    #[arg(long)]
    pub body_read_timeout_ms: Option<u64>,
    /// How long a keep-alive connection may wait idle for its next request, ms. Default 60,000.
    #[arg(long)]
    pub idle_timeout_ms: Option<u64>,
    /// On SIGTERM or Ctrl-C, how long streams in flight may take to finish, ms. Default 30,000.
    #[arg(long)]
    pub drain_timeout_ms: Option<u64>,
    /// A worker: `URL[,events=tcp://H:P][,replay=tcp://H:P][,topic=T][,dp=N][,block-size=N]
    /// [,engine=vllm|sglang][,role=agg|prefill|decode][,capacity=BLOCKS][,max-requests=N]
    /// [,bootstrap-port=N][,api-key=K][,reannounce=auto|off][,model=NAME]` (`engine`: how a request names its
    /// data-parallel rank; `bootstrap-port`: a prefill worker's SGLang bootstrap port; `api-key`:
    /// the engine's `--api-key`, sent on every call to it; `reannounce`: whether a vLLM engine is
    /// asked to re-announce reused blocks while its view is rebuilt; `model`: which `[[model]]`
    /// it serves, else the one its `/v1/models` lists). Repeat for several;
    /// replaces the file's `[[worker]]` tables, whose keys are the same.
    #[arg(long, value_parser = parse_worker)]
    pub worker: Option<Vec<WorkerConfig>>,
    /// Model name served. Default `tiny`.
    #[arg(long)]
    pub model_name: Option<String>,
    /// Several models: `[[model]]` tables of the file (name, model-dir or
    /// approximate-tokenizer, block-size, policy, `[[model.worker]]` tables), each with its own
    /// router, tokenizer and workers; not with --model-name, --model-dir,
    /// --approximate-tokenizer or --block-size, which are one model's.
    #[arg(skip)]
    pub model: Option<Vec<kvroute_proxy::config::ModelTable>>,
    /// Local model directory (`tokenizer.json`, `tokenizer_config.json`): the engines'
    /// tokenizer. Required unless --approximate-tokenizer.
    #[arg(long)]
    pub model_dir: Option<PathBuf>,
    /// Without --model-dir, tokenize with the built-in tiny byte-level tokenizer: exact for
    /// `kvroute mock` workers started without --model-dir, approximate for real engines.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub approximate_tokenizer: Option<bool>,
    /// The NATS server router replicas share their load and worker registry through,
    /// `nats://HOST:PORT` (replicas with the same `--nats-subject-prefix` form one fleet).
    /// Default: none (no sync: this replica knows only its own requests).
    #[arg(long)]
    pub nats: Option<String>,
    /// The start of every sync subject; fleets with different prefixes can share a NATS
    /// server. Default `kvroute`.
    #[arg(long)]
    pub nats_subject_prefix: Option<String>,
    /// How often a replica heartbeats on NATS. Default 1,000 ms.
    #[arg(long)]
    pub nats_heartbeat_ms: Option<u64>,
    /// How long a replica may stay silent before its peers release its requests' load.
    /// Default 3,000 ms.
    #[arg(long)]
    pub nats_peer_timeout_ms: Option<u64>,
    /// How long a request's prefill-done and freed changes may wait for this replica's next
    /// booking before they go to the peers on their own. Default 100 ms; 0: at once.
    #[arg(long)]
    pub nats_lazy_ms: Option<u64>,
    /// The token the NATS server requires. Better `--nats-token-file` (a flag's value shows in
    /// the process list). Default: none.
    #[arg(long)]
    pub nats_token: Option<String>,
    /// A file holding the NATS token (its first line).
    #[arg(long)]
    pub nats_token_file: Option<PathBuf>,
    /// The NATS user (with `--nats-password-file` or `--nats-password`).
    #[arg(long)]
    pub nats_user: Option<String>,
    /// The NATS user's password. Better `--nats-password-file`.
    #[arg(long)]
    pub nats_password: Option<String>,
    /// A file holding the NATS user's password (its first line).
    #[arg(long)]
    pub nats_password_file: Option<PathBuf>,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed, as `nsc` writes it).
    /// One way to authenticate: a token, a user and password, or this.
    #[arg(long)]
    pub nats_credentials: Option<PathBuf>,
    /// PEM file of the CAs that verify the NATS server; implies TLS. Default: the system's, and
    /// TLS only for a `tls://` URL or a server that asks for it.
    #[arg(long)]
    pub nats_tls_ca: Option<PathBuf>,
    /// This replica's client certificate (PEM) for a NATS server that verifies its clients
    /// (mutual TLS), with `--nats-tls-key`.
    #[arg(long)]
    pub nats_tls_cert: Option<PathBuf>,
    /// The private key (PEM) of `--nats-tls-cert`.
    #[arg(long)]
    pub nats_tls_key: Option<PathBuf>,
    /// The engine credential this replica calls a worker added by a peer replica with, when the
    /// worker has one there and no `[[worker]]` table here names it (replicas never send each
    /// other credentials). Better `--peer-worker-api-key-file`. Default: none (such a worker is
    /// refused).
    #[arg(long)]
    pub peer_worker_api_key: Option<String>,
    /// A file holding `--peer-worker-api-key` (its first line).
    #[arg(long)]
    pub peer_worker_api_key_file: Option<PathBuf>,
    /// Find workers in DNS: a name's A/AAAA records (with `--discover-port`), or SRV records
    /// with a `srv:` prefix (`srv:_http._tcp.vllm.ns.svc.cluster.local`, as a Kubernetes
    /// headless service gives), re-resolved every `--discover-interval-ms`. Workers that appear
    /// are added (their registration checks run); one that disappears is drained, then
    /// removed. A failed or empty answer changes nothing. Default: none.
    #[arg(long)]
    pub discover_dns: Option<String>,
    /// The records of `--discover-dns`: `a` (A and AAAA) or `srv`. Default a (srv with the
    /// `srv:` prefix).
    #[arg(long)]
    pub discover_dns_type: Option<kvroute_proxy::config::DnsRecordKind>,
    /// The DNS server `--discover-dns` asks, `IP:PORT`. Default: the system's
    /// (/etc/resolv.conf).
    #[arg(long)]
    pub discover_dns_server: Option<String>,
    /// Find workers in a file: one `--worker` line a line (`#` comments and blank lines
    /// ignored), as a mounted ConfigMap gives; re-read every `--discover-interval-ms`, by path.
    /// A file that cannot be read or has a bad line changes nothing. Default: none.
    #[arg(long)]
    pub discover_file: Option<PathBuf>,
    /// How often discovery's sources are resolved or read again, ms. Default 5,000.
    #[arg(long)]
    pub discover_interval_ms: Option<u64>,
    /// The worker line a DNS answer makes: `{host}` is the address, `{port}` the SRV record's
    /// port (or `--discover-port`), e.g. `http://{host}:{port},events=tcp://{host}:5557`.
    /// Default `http://{host}:{port}`.
    #[arg(long)]
    pub discover_worker_template: Option<String>,
    /// The port of workers found by A records (`{port}` in the template).
    #[arg(long)]
    pub discover_port: Option<u16>,
    /// How long a worker that discovery lets go may take to finish its requests before it is
    /// removed anyway, ms. Default 60,000.
    #[arg(long)]
    pub discover_drain_timeout_ms: Option<u64>,
    /// A header whose value names a tenant (one of a `[[tenant]]` table's `header-values`),
    /// read when the request's API key is no tenant's. Default: none.
    #[arg(long)]
    pub tenant_header: Option<String>,
    /// A header carrying a request's priority (an integer, lower served first, as vLLM's
    /// `priority` field), read when the body has none. Default: none.
    #[arg(long)]
    pub priority_header: Option<String>,
    /// The engines run with vLLM's `--scheduling-policy priority`: a request's priority goes
    /// on in its body (else it is taken out, and only the router's queue orders by it).
    /// Default false.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub forward_priority: Option<bool>,
    /// Tenants: `[[tenant]]` tables of the file (name, api-keys, header-values, weight,
    /// requests-per-interval, tokens-per-interval, interval-ms).
    #[arg(skip)]
    pub tenant: Option<Vec<kvroute_proxy::config::TenantConfig>>,
    /// Name the chosen worker and the predicted cached tokens in response headers
    /// (`x-kvroute-worker`, `x-kvroute-dp-rank`, `x-kvroute-predicted-cached-tokens`).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub debug_headers: Option<bool>,
    /// Routing policy spec: a name (kv, dynamo, sglang-cache-aware, llmd-weighted,
    /// least-loaded, power-of-two, round-robin, random), for kv and dynamo with options, e.g.
    /// `kv:full`, `kv:staged:scale=2`, `dynamo:temperature=0.1` (the vocabulary of `kvroute
    /// replay --policy`). Default kv.
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
    /// Cache view: events, predict (events and the router's own recent decisions) or
    /// approximate (its decisions only), the last two with options, e.g.
    /// `approximate:ttl=120:max-blocks=65536` (as `kvroute replay --cache`). Default events.
    #[arg(long)]
    pub cache: Option<String>,
    /// Router queue capacity (0: reject when every worker is busy). Default 1024.
    #[arg(long)]
    pub queue_capacity: Option<usize>,
    /// How long a request may wait in the queue before a 503, ms. Default 30,000.
    #[arg(long)]
    pub queue_timeout_ms: Option<u64>,
    /// When no worker can take a request (none added, or none in routing): `reject` (503 at
    /// once) or `queue` (it waits in the queue, within --queue-capacity and
    /// --queue-timeout-ms, for a worker to be added: scale from zero). Default reject.
    #[arg(long)]
    pub when_empty: Option<String>,
    /// A worker is busy above this fraction of its max requests. Default: never.
    #[arg(long)]
    pub busy_requests_fraction: Option<f64>,
    /// Largest request body in bytes. Default 4 MiB.
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Most prompt tokens. Default 131072.
    #[arg(long)]
    pub max_prompt_tokens: Option<usize>,
    /// Longest silence from a worker while a request runs (before its first byte, or between
    /// two chunks) before a 504, ms. Default 600,000.
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
    /// After a worker's view was cleared for lost KV events, how long requests routed to it ask
    /// its engine to re-announce the cached blocks they reuse (worker key `reannounce`), ms.
    /// Default 300,000.
    #[arg(long)]
    pub reannounce_window_ms: Option<u64>,
    /// The request header that names a conversation (e.g. `x-session-id`): its requests stay
    /// on the worker that served it while that worker is not overloaded, and move once when it
    /// is, on every replica. Default: none (no session affinity).
    #[arg(long)]
    pub session_header: Option<String>,
    /// A session unused this long is forgotten, ms. Default 1,800,000.
    #[arg(long)]
    pub session_idle_timeout_ms: Option<u64>,
    /// The most sessions kept (the least recently used forgotten past it). Default 65,536.
    #[arg(long)]
    pub max_sessions: Option<usize>,
    /// Bytes the cache of chat conversations' tokens may hold (a follow-up turn tokenizes
    /// only its new text); 0 turns it off. Default 268435456 (256 MiB).
    #[arg(long)]
    pub tokenizer_cache_bytes: Option<usize>,
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
        let flagged = |e| match e {
            kvroute_proxy::config::ConfigError::Invalid { field, message } => {
                anyhow::anyhow!("--{field}: {message}")
            }
            other => other.into(),
        };
        config.validate().map_err(flagged)?;
        // Each model's tokenizer (with [[model]] tables, `validate` checked theirs).
        if config.models.is_empty() {
            config.tokenizer().map_err(flagged)?;
        }
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

/// How log lines are written.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line, with the fields of the spans it is in (a request's id).
    Json,
}

/// A line for the person who started a command, on stderr: as it is with text logs; with JSON
/// logs, one log event through `tracing` (the line its message), so that every line is JSON.
pub fn say(format: LogFormat, line: &str) {
    match format {
        LogFormat::Text => eprintln!("{line}"),
        LogFormat::Json => tracing::info!("{line}"),
    }
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (default `info`). Text is coloured only
/// when stderr is a terminal: a pipe or a file gets no ANSI escape codes.
pub fn init_logging_as(format: LogFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        // The default fields' text, cheaper without colours (a request's span is written
        // whether or not a line is logged in it).
        LogFormat::Text => builder.fmt_fields(crate::log_fields::PlainFields).try_init(),
        LogFormat::Json => builder.json().with_current_span(true).try_init(),
    };
}

/// Runs `kvroute serve` until SIGTERM or Ctrl-C, then shuts down gracefully: stops accepting,
/// lets streams in flight finish for up to `drain-timeout-ms`, and returns.
pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let format = args.log_format;
    let config = args.to_config()?;
    let plans = plans(&config, &args.planner)?;
    let drain = std::time::Duration::from_millis(config.server.drain_timeout_ms);
    runtime(config.server.threads)?.block_on(async move {
        let stop = stop_signal()?;
        let mut proxy = kvroute_proxy::start(config, None).await?;
        for (model, plan, actuator) in plans {
            let Some(m) = proxy.models.iter().find(|m| model.as_ref().is_none_or(|n| *n == m.name)) else {
                bail!("--planner: no model {model:?}");
            };
            let (fleet, start) = (Arc::clone(&m.fleet), m.driver.timestamp());
            let actuator = kvroute_proxy::autoscale::actuator::build(&actuator, fleet)?;
            let planner = plan.live_planner(start)?;
            let settings = kvroute_proxy::autoscale::Settings {
                drain_timeout: plan.drain.timeout()?,
                ..Default::default()
            };
            match &model {
                None => proxy.start_planner(planner, actuator, settings),
                Some(name) => {
                    proxy.start_planner_for(name, planner, actuator, settings);
                }
            }
            let of = model.map(|m| format!(" of model {m}")).unwrap_or_default();
            say(
                format,
                &format!("kvroute serve: the planner{of} runs (GET /admin/planner shows its decisions)"),
            );
        }
        let (url, admin_url) = (proxy.url(), proxy.admin_url());
        match format {
            LogFormat::Text => eprintln!("kvroute serve: listening on {url}; admin API on {admin_url}"),
            LogFormat::Json => tracing::info!(
                %url,
                %admin_url,
                "kvroute serve: listening on {url}; admin API on {admin_url}"
            ),
        }
        let discovering = matches!(proxy.driver.config.discovery(), Ok(Some(_)));
        let no_workers = proxy.models.iter().all(|m| m.driver.worker_urls().is_empty());
        if no_workers && !discovering {
            say(
                format,
                &format!(
                    "no workers yet: add them with --worker, --discover-dns, --discover-file or \
                     POST {admin_url}/admin/workers"
                ),
            );
        }
        tokio::select! {
            () = proxy.stopped() => return Ok(()),
            signal = stop => say(format, &format!("kvroute serve: {}; draining (up to {} ms)", signal?, drain.as_millis())),
        }
        if proxy.drain(drain).await {
            say(format, "kvroute serve: drained; exiting");
        } else {
            say(
                format,
                "kvroute serve: the drain timeout passed with requests in flight; exiting",
            );
        }
        Ok(())
    })
}

/// The planners `--planner` asks for, read and checked before anything starts: one `FILE` for
/// the one model, or with `[[model]]` tables a `MODEL=FILE` per model planned (the model's name
/// with each, `None` for the one model); each file needs an `[actuator]`.
type Plan = (
    Option<String>,
    crate::plan::PlanFile,
    kvroute_proxy::autoscale::actuator::ActuatorConfig,
);

fn plans(config: &kvroute_proxy::ServeConfig, flags: &[String]) -> anyhow::Result<Vec<Plan>> {
    let mut plans: Vec<Plan> = Vec::new();
    for flag in flags {
        let (model, path) = match (config.models.is_empty(), flag.split_once('=')) {
            (true, _) => {
                ensure!(
                    plans.is_empty(),
                    "--planner {flag}: one planner file for one model (several models are \
                     [[model]] tables, each planned by a --planner MODEL=FILE)"
                );
                (None, flag.as_str())
            }
            (false, Some((model, path))) => {
                ensure!(
                    config.models.iter().any(|m| m.name == model),
                    "--planner {flag}: {model:?} is none of the [[model]] tables' names"
                );
                ensure!(
                    !plans.iter().any(|(m, _, _)| m.as_deref() == Some(model)),
                    "--planner {flag}: model {model:?} has a planner already"
                );
                (Some(model.to_owned()), path)
            }
            (false, None) => bail!(
                "--planner {flag}: with [[model]] tables, name the model it plans: --planner MODEL=FILE"
            ),
        };
        let plan = crate::plan::PlanFile::read(std::path::Path::new(path))?;
        let Some(actuator) = plan.actuator.clone() else {
            bail!(
                "--planner {path}: serve needs an [actuator] table (kind = \"process\", \"external\" or \"dry-run\")"
            );
        };
        plans.push((model, plan, actuator));
    }
    Ok(plans)
}

/// Listens for SIGTERM from now on (so that one sent as soon as the proxy says it listens is
/// not missed); the future resolves on it or on Ctrl-C (SIGINT), naming which.
fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = anyhow::Result<&'static str>>> {
    #[cfg(unix)]
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("listening for SIGTERM")?;
    Ok(async move {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = term.recv() => Ok("SIGTERM"),
                r = tokio::signal::ctrl_c() => r.map(|()| "Ctrl-C").context("listening for Ctrl-C"),
            }
        }
        #[cfg(not(unix))]
        {
            tokio::signal::ctrl_c().await.context("listening for Ctrl-C")?;
            Ok("Ctrl-C")
        }
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
    /// LoRA adapters every worker serves from its start, `NAME=PATH` as vLLM's
    /// `--lora-modules` (listed on `/v1/models` with the model as parent); more can be loaded
    /// at run time through `/v1/load_lora_adapter`.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<kvroute_mock::LoraModule>,
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
    /// KV blocks per worker (also `--kv-blocks`). Default 16,384, or with `--model` what fits
    /// in the GPUs' memory (as `kvroute replay --model`).
    #[arg(long, alias = "kv-blocks")]
    pub num_blocks: Option<u32>,
    /// Blocks of a host-memory (CPU) KV tier per worker rank, as vLLM's native offloading
    /// (`--kv-offloading-backend native --kv-offloading-size` GiB over one block's bytes):
    /// blocks are copied to it as they are cached and loaded back past a prompt's GPU hit over
    /// the KV link (`--kv-transfer-gbps`), with vLLM's offloading events (medium "CPU", no
    /// tokens). Default none.
    #[arg(long)]
    pub cpu_offload_blocks: Option<u32>,
    /// Most requests running at once. Default 256.
    #[arg(long)]
    pub max_num_seqs: Option<u32>,
    /// Token budget of one forward pass. Default 8,192.
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
    /// The engine's model, as `kvroute replay --model` takes it: a built-in name, a Hugging
    /// Face `config.json` or a model TOML. Default: none (the tiny polynomial engine).
    #[arg(long)]
    pub model: Option<String>,
    /// The GPU `--model` runs on, as `kvroute replay --gpu` takes it. Default h100-sxm.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Tensor-parallel GPUs per worker. Default 1.
    #[arg(long)]
    pub tp: Option<u32>,
    /// Share of each GPU's memory the engine may use. Default 0.9.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// The timing model, as `kvroute replay --timing` takes it. Default: roofline with
    /// `--model`, else polynomial.
    #[arg(long)]
    pub timing: Option<String>,
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
    /// Log format on stderr: `text`, or `json` (one object a line; the `serve` command to copy
    /// is then the `command` field of its line, each worker's flag a `worker` field).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// The `kvroute serve` command that routes to mock workers of `block_size`-token blocks
/// serving `model_name`, tokenizing as they do (`model_dir`, or the built-in tokenizer they
/// use without one), at `workers` (their `--worker` flags).
pub fn serve_command(
    block_size: u32,
    model_name: &str,
    model_dir: Option<&std::path::Path>,
    workers: &[String],
) -> String {
    let tokenizer = match model_dir {
        Some(dir) => format!("--model-dir {}", shell_word(&dir.display().to_string())),
        None => "--approximate-tokenizer".to_owned(),
    };
    let mut command = format!(
        "kvroute serve --block-size {block_size} --model-name {} {tokenizer}",
        shell_word(model_name)
    );
    for w in workers {
        command.push_str(" --worker ");
        command.push_str(&shell_word(w));
    }
    command
}

/// `word` as one word of a POSIX shell command (quoted when it needs to be).
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_./:,=@+%".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
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
    for (flag, v) in [
        ("--num-blocks", args.num_blocks),
        ("--cpu-offload-blocks", args.cpu_offload_blocks),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
    ] {
        ensure!(v != Some(0), "{flag} must be at least 1");
    }
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

/// Runs `kvroute mock` until SIGTERM or Ctrl-C, then exits with status 0.
pub fn mock(args: MockArgs) -> anyhow::Result<()> {
    check_mock(&args)?;
    let mut config = MockConfig::new(args.workers);
    config.prefill_workers = args.prefill;
    config.host = args.host;
    config.port = args.port;
    config.event_port = args.event_port;
    config.dp_size = args.dp;
    config.events = !args.no_events;
    config.encoding = encoding(&args.encoding)?;
    config.replay_buffer_steps = args.replay_buffer;
    let built = crate::hardware::EngineChoice {
        block_size: Some(args.block_size),
        num_blocks: args.num_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        speedup: Some(args.speedup),
        timing: args.timing.clone().map(crate::hardware::Timing::Named),
        model: args.model.clone(),
        gpu: args.gpu.clone(),
        tp: args.tp,
        gpu_memory_utilization: args.gpu_memory_utilization,
    }
    .build(&config.engine)?;
    config.engine = built.engine;
    config.transfer = crate::replay::kv_link(
        args.kv_transfer_gbps,
        args.kv_transfer_latency_ms,
        args.kv_bytes_per_token.or(built.kv_bytes_per_token),
    )?;
    config.engine.cpu_offload = args
        .cpu_offload_blocks
        .map(|n| kvroute_engine::CpuOffload::new(n, config.transfer));
    if let Some(line) = &built.description {
        say(args.log_format, line);
    }
    config.default_max_tokens = args.default_max_tokens;
    config.model_name = args.model_name.clone();
    config.lora_modules = args.lora_modules.clone();
    let model = Arc::new(match &args.model_dir {
        Some(dir) => Model::load(dir)?,
        None => Model::tiny()?,
    });
    runtime(0)?.block_on(async move {
        let stop = stop_signal()?;
        let workers = mock::start(&config, model).await?;
        let format = args.log_format;
        let mut flags = Vec::new();
        for w in &workers {
            let flag = w.worker_flag();
            match format {
                LogFormat::Text => eprintln!("mock worker: {flag}"),
                LogFormat::Json => tracing::info!(worker = %flag, "mock worker: {flag}"),
            }
            flags.push(flag);
        }
        let dir = args.model_dir.as_deref().map(std::path::absolute).transpose()?;
        let command = serve_command(
            config.engine.block_size,
            &config.model_name,
            dir.as_deref(),
            &flags,
        );
        // The command stays whole and copyable: a line of its own, or one JSON field.
        match format {
            LogFormat::Text => eprintln!("route to them with:\n  {command}"),
            LogFormat::Json => tracing::info!(%command, "route to them with the command"),
        }
        if config.prefill_workers > 0 {
            say(
                format,
                "(vLLM's kv_transfer_params flow; add --disagg-protocol sglang for SGLang's bootstrap rooms)",
            );
        }
        // As vLLM's server does: SIGTERM (or Ctrl-C) ends it with status 0.
        let signal = stop.await?;
        say(format, &format!("kvroute mock: {signal}; exiting"));
        drop(workers);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One `FILE` plans the one model; with `[[model]]` tables each `--planner` names its model,
    /// once, among the tables'; a bad flag is refused before any file is read.
    #[test]
    fn planner_flags_name_their_models_with_several() {
        let dir = kvroute_testkit::Scratch::new("serve-plans");
        let file = dir.write(
            "plan.toml",
            "[planner]\nmode = \"agg\"\nmax_gpu_budget = 2\n[planner.sla]\nttft_ms = 500\nitl_ms = 20\n\
             [actuator]\nkind = \"dry-run\"\n",
        );
        let path = file.display().to_string();
        let one = ServeConfig::default();
        let several = ServeConfig::from_toml_str(
            "[[model]]\nname = \"a\"\napproximate-tokenizer = true\n\
             [[model]]\nname = \"b\"\napproximate-tokenizer = true\n",
        )
        .unwrap();
        let models = |config: &ServeConfig, flags: &[String]| -> Result<Vec<Option<String>>, String> {
            plans(config, flags)
                .map(|p| p.into_iter().map(|(m, _, _)| m).collect())
                .map_err(|e| e.to_string())
        };
        assert_eq!(models(&one, std::slice::from_ref(&path)), Ok(vec![None]));
        assert_eq!(
            models(&several, &[format!("b={path}"), format!("a={path}")]),
            Ok(vec![Some("b".to_owned()), Some("a".to_owned())])
        );
        for (config, flags, says) in [
            (&one, vec![path.clone(), path.clone()], "one planner file"),
            (&several, vec![path.clone()], "name the model"),
            (&several, vec![format!("c={path}")], "none of the [[model]]"),
            (
                &several,
                vec![format!("a={path}"), format!("a={path}")],
                "has a planner already",
            ),
        ] {
            let e = models(config, &flags).unwrap_err();
            assert!(e.contains(says), "{flags:?}: {e}");
        }
    }
}
