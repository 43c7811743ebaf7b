//! `kvroute`: the command line.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use kvroute::bench;
use kvroute::opstream::OpStream;

/// The op-stream the index benchmark runs on when none is named: a file of the shared bench
/// folder that sits beside a kvroute checkout.
const DEFAULT_OPSTREAM: &str = "../shared/bench/conv_full_w16_c4096.jsonl.gz";

#[derive(Parser)]
#[command(
    name = "kvroute",
    version,
    about = "KV-cache-aware routing for LLM inference fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Benchmarks; each prints one JSON line per case on stdout.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Replay a trace through the cluster simulator (the router core and simulated engines).
    Replay(Box<kvroute::replay::ReplayArgs>),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Apply a kv-opstream file to the prefix index on one thread, checking every lookup.
    Index(IndexArgs),
    /// Block hashing throughput beside memory-copy bandwidth.
    Hash(HashArgs),
    /// Routing decision latency (hashing included) for several fleet sizes and prompt lengths.
    Route(RouteArgs),
    /// Serve trivially fast OpenAI-compatible workers (for `bench proxy`) until interrupted.
    Upstream(UpstreamArgs),
    /// Drive a proxy with a closed loop of clients: requests/s, latency, CPU per request; with
    /// `--direct`, the same against one worker, and the latency the proxy adds.
    Proxy(ProxyArgs),
}

#[derive(Args)]
struct UpstreamArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Ports, comma-separated: one worker each.
    #[arg(long, value_delimiter = ',', default_value = "18100,18101,18102,18103")]
    ports: Vec<u16>,
    /// Events of a streamed completion (and tokens of a whole one).
    #[arg(long, default_value_t = 8)]
    chunks: usize,
    /// Hand a streamed completion's events over at once (the server may write them together)
    /// instead of one write per event.
    #[arg(long)]
    coalesce: bool,
    /// Runtime threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Args)]
struct ProxyArgs {
    /// The proxy, as host:port.
    #[arg(long)]
    target: std::net::SocketAddr,
    /// One worker behind it, as host:port, measured the same way for the added latency.
    #[arg(long)]
    direct: Option<std::net::SocketAddr>,
    /// The API path.
    #[arg(long, default_value = "/v1/completions")]
    path: String,
    /// Clients, each with one connection and one request in flight.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// The measured window, seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Unmeasured warm-up, seconds.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Ask for streamed responses.
    #[arg(long)]
    stream: bool,
    /// Words in the prompt.
    #[arg(long, default_value_t = 64)]
    prompt_words: usize,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 8)]
    max_tokens: u32,
    /// The proxy's process id, for its CPU time per request.
    #[arg(long)]
    pid: Option<u32>,
    /// Runtime threads of the load generator.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

#[derive(Args)]
struct IndexArgs {
    /// The kv-opstream file (gzip'd JSON lines).
    #[arg(long, default_value = DEFAULT_OPSTREAM)]
    opstream: PathBuf,
    /// Repetitions; the median run is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Print up to this many mismatching lookups to stderr.
    #[arg(long, default_value_t = 5)]
    show_mismatches: usize,
}

#[derive(Args)]
struct HashArgs {
    /// Token ids to hash per repetition.
    #[arg(long, default_value_t = 16 << 20)]
    tokens: usize,
    /// Block sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64,512")]
    block_size: Vec<usize>,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 7)]
    reps: usize,
}

#[derive(Args)]
struct RouteArgs {
    /// Fleet sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    workers: Vec<usize>,
    /// Prompt lengths in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,32768,131072")]
    prompt_tokens: Vec<usize>,
    /// Decisions timed per case.
    #[arg(long, default_value_t = 2000)]
    samples: usize,
    /// Seed of the generated fleet state, prompts and router.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(BenchCommand::Index(args)) => bench_index(args),
        Command::Bench(BenchCommand::Hash(args)) => bench_hash(args),
        Command::Bench(BenchCommand::Route(args)) => bench_route(args),
        Command::Bench(BenchCommand::Upstream(args)) => bench_upstream(args),
        Command::Bench(BenchCommand::Proxy(args)) => bench_proxy(args),
        Command::Replay(args) => kvroute::replay::run(*args),
    }
}

fn bench_index(args: IndexArgs) -> anyhow::Result<()> {
    if !args.opstream.exists() {
        bail!(
            "op-stream {} not found; pass --opstream FILE (the shared bench files live in ../shared/bench)",
            args.opstream.display()
        );
    }
    let t0 = std::time::Instant::now();
    let stream = OpStream::read(&args.opstream)?;
    eprintln!(
        "loaded {} ops from {} in {:.2}s",
        stream.ops.len(),
        args.opstream.display(),
        t0.elapsed().as_secs_f64()
    );
    let name = args
        .opstream
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let report = bench::index::run(&stream, &name, args.reps);
    for m in report.mismatch_list.iter().take(args.show_mismatches) {
        eprintln!("mismatch at op {}: got {:?} expect {:?}", m.op, m.got, m.expect);
    }
    println!(
        "{}",
        serde_json::to_string(&report).context("serializing the report")?
    );
    if report.mismatches > 0 {
        bail!("{} lookups disagreed with the stream's expect", report.mismatches);
    }
    Ok(())
}

fn bench_hash(args: HashArgs) -> anyhow::Result<()> {
    for report in bench::hash::run(args.tokens, &args.block_size, args.reps) {
        println!(
            "{}",
            serde_json::to_string(&report).context("serializing the report")?
        );
    }
    Ok(())
}

fn bench_route(args: RouteArgs) -> anyhow::Result<()> {
    for &workers in &args.workers {
        for &prompt_tokens in &args.prompt_tokens {
            let report = bench::route::run_case(workers, prompt_tokens, args.samples, args.seed)?;
            println!(
                "{}",
                serde_json::to_string(&report).context("serializing the report")?
            );
        }
    }
    Ok(())
}

fn runtime(threads: usize) -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_all()
        .build()
        .context("starting the async runtime")
}

fn bench_upstream(args: UpstreamArgs) -> anyhow::Result<()> {
    let config = bench::proxy::UpstreamConfig {
        chunks: args.chunks,
        coalesce: args.coalesce,
    };
    eprintln!(
        "fast workers on {}:{:?} (model {}); interrupt to stop",
        args.host,
        args.ports,
        bench::proxy::MODEL
    );
    runtime(args.threads)?.block_on(bench::proxy::serve_upstreams(&args.host, &args.ports, config))
}

fn bench_proxy(args: ProxyArgs) -> anyhow::Result<()> {
    let prompt = (0..args.prompt_words)
        .map(|i| format!("w{}", i % 97))
        .collect::<Vec<_>>()
        .join(" ");
    let config = |target, pid| bench::proxy::LoadConfig {
        target,
        path: args.path.clone(),
        concurrency: args.concurrency,
        warmup: std::time::Duration::from_secs_f64(args.warmup),
        measure: std::time::Duration::from_secs_f64(args.seconds),
        stream: args.stream,
        prompt: prompt.clone(),
        max_tokens: args.max_tokens,
        pid,
    };
    let rt = runtime(args.threads)?;
    let proxied = rt.block_on(bench::proxy::drive(&config(args.target, args.pid)))?;
    println!(
        "{}",
        serde_json::to_string(&proxied).context("serializing the report")?
    );
    if let Some(direct) = args.direct {
        let direct = rt.block_on(bench::proxy::drive(&config(direct, None)))?;
        println!(
            "{}",
            serde_json::to_string(&direct).context("serializing the report")?
        );
        println!(
            "{}",
            serde_json::json!({
                "added_p50_us": proxied.p50_us - direct.p50_us,
                "added_p99_us": proxied.p99_us - direct.p99_us,
            })
        );
    }
    if proxied.requests == 0 {
        bail!("no request completed through {}", args.target);
    }
    Ok(())
}
