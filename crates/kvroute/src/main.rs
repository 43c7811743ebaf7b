//! `kvroute`: the command line.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use kvroute::bench;
use kvroute::config::count;
use kvroute::opstream::OpStream;
use kvroute::serve::{LogFormat, init_logging_as};

/// mimalloc, not glibc's malloc: the proxy allocates and frees small buffers on every request
/// and chunk (glibc's malloc and free were a fifth of a unary request's instructions; 10% fewer
/// instructions a request with mimalloc). With its transparent-huge-page advice: a replay on a
/// large fleet reads its engines' and index's state scattered over gigabytes, and 2 MiB pages
/// spare most of its address-translation misses (a tenth of a loaded replay's user time, half
/// its system time) for a fifth more peak memory. See BENCHMARKS.md, "The global allocator".
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Run the OpenAI-compatible proxy in front of engine workers.
    Serve(Box<kvroute::serve::ServeArgs>),
    /// Run simulated engines as OpenAI-compatible workers that publish KV events.
    Mock(Box<kvroute::serve::MockArgs>),
    /// The router and 4 mock workers in-process, the example trace driven through HTTP, and the
    /// replay's table beside the simulated run.
    Demo(kvroute::demo::DemoArgs),
    /// Fit the calibrated timing model on real vLLM runs (a folder like
    /// `../shared/data/real-vllm`) and write its model file, or cross-validate it.
    Calibrate(kvroute::calibrate::CalibrateArgs),
    /// Simulate each run of a runs file with the calibrated model and print how far TTFT, E2E
    /// and ITL are from what was measured.
    Validate(kvroute::calibrate::ValidateArgs),
    /// Search a cost policy's options on a trace (each candidate a replay) and print the best
    /// `--policy` spec for `kvroute serve`.
    Tune(Box<kvroute::tune::TuneArgs>),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Apply a kv-opstream file to the prefix index on one thread, checking every lookup.
    Index(IndexArgs),
    /// Write a kv-opstream at finer blocks: each block split into a chain of `--factor` blocks.
    SplitOpstream(SplitArgs),
    /// Block hashing throughput beside memory-copy bandwidth.
    Hash(HashArgs),
    /// Routing decision latency (hashing included) for several fleet sizes and prompt lengths.
    Route(RouteArgs),
    /// Proxy overhead on loopback: added latency and requests per second against fast upstreams.
    Serve(kvroute::bench::serve::ServeBenchArgs),
    /// Trivially fast OpenAI-compatible upstreams, for `bench serve` against any proxy.
    Upstream(kvroute::bench::serve::UpstreamArgs),
    /// Added latency over a long multi-turn conversation, the proxy's tokenizer cache on and off.
    Chat(kvroute::bench::chat::ChatBenchArgs),
    /// Replica sync's CPU and bytes a request: the binary format beside the JSON one before it;
    /// with `--live`, the whole path's CPU over a local nats-server, sync on and off.
    Sync(SyncArgs),
}

#[derive(Args)]
struct SyncArgs {
    /// Prompt blocks a booking carries, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,256,2048,8192", value_parser = count)]
    blocks: Vec<usize>,
    /// Requests timed per repetition and format.
    #[arg(long, default_value_t = 2000, value_parser = count)]
    requests: usize,
    /// Repetitions (the formats alternate); the median is reported.
    #[arg(long, default_value_t = 5, value_parser = count)]
    reps: usize,
    /// Seed of the block hashes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The whole sync path instead of the codec: three replicas over a local nats-server, the
    /// example trace's first `--requests` rows, `--reps` rounds of a synced and an unsynced
    /// pass; the process's CPU (and the server's, apart) a pass.
    #[arg(long)]
    live: bool,
    /// With `--live`: speed-up of the trace's times (the demo's 10: about 25 requests a second).
    #[arg(long, default_value_t = 10.0, value_parser = kvroute::config::positive)]
    speedup: f64,
    /// With `--live`: the lazy window, ms (`serve --nats-lazy-ms`).
    #[arg(long, default_value_t = 100)]
    lazy_ms: u64,
}

#[derive(Args)]
struct IndexArgs {
    /// The kv-opstream file (gzip'd JSON lines).
    #[arg(long, default_value = DEFAULT_OPSTREAM)]
    opstream: PathBuf,
    /// Repetitions; the median run is reported.
    #[arg(long, default_value_t = 5, value_parser = count)]
    reps: usize,
    /// Print up to this many mismatching lookups to stderr.
    #[arg(long, default_value_t = 5)]
    show_mismatches: usize,
    /// Size each worker's map of external hashes for this many blocks up front (the stream's
    /// per-worker cache, in its blocks); 0: the maps grow from empty, as the peers' do.
    #[arg(long, default_value_t = 0)]
    blocks_per_worker: usize,
    /// The index layout: `runs` (`RunIndex`, the router's) or `nodes` (`PrefixIndex`, a node a
    /// block).
    #[arg(long, value_enum, default_value_t)]
    layout: bench::index::Layout,
}

#[derive(Args)]
struct SplitArgs {
    /// The kv-opstream file to split.
    #[arg(long)]
    opstream: PathBuf,
    /// Blocks each block becomes (8 turns 512-token blocks into 64-token ones).
    #[arg(long, value_parser = block_size)]
    factor: usize,
    /// Where to write the split stream (gzip'd JSON lines).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct HashArgs {
    /// Token ids to hash per repetition.
    #[arg(long, default_value_t = 16 << 20, value_parser = count)]
    tokens: usize,
    /// Block sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64,512", value_parser = block_size)]
    block_size: Vec<usize>,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 7, value_parser = count)]
    reps: usize,
}

#[derive(Args)]
struct RouteArgs {
    /// Fleet sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,64,256", value_parser = count)]
    workers: Vec<usize>,
    /// Prompt lengths in tokens, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,32768,131072", value_parser = count)]
    prompt_tokens: Vec<usize>,
    /// Decisions timed per case.
    #[arg(long, default_value_t = 2000, value_parser = count)]
    samples: usize,
    /// Seed of the generated fleet state, prompts and router.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where a timed prompt's token ids are: `warm` (just generated, as after tokenizing) or
    /// `cold` (generated 64 MiB of prompts earlier, read from memory).
    #[arg(long, value_enum, default_value_t = bench::route::PromptCache::Warm)]
    prompt_cache: bench::route::PromptCache,
    /// A follow-up turn's earlier blocks: `kept` (its previous turn's hashes, kept by the
    /// driver: only new blocks are hashed) or `rehashed` (hashed whole, as the proxy does).
    #[arg(long, value_enum, default_value_t = bench::route::EarlierHashes::Kept)]
    earlier_hashes: bench::route::EarlierHashes,
}

/// A block size: a whole number from 1 to `u32::MAX`.
fn block_size(s: &str) -> Result<usize, String> {
    let n = count(s)?;
    u32::try_from(n).map_err(|_| format!("{n} is past the largest block size, {}", u32::MAX))?;
    Ok(n)
}

/// Runs the command; an error is printed as one line (its causes after colons), exit status 1.
fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // Help and version as clap prints them; a bad flag as one line, like every error.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let text = e.to_string();
            eprintln!("{}", text.lines().next().unwrap_or_default());
            return std::process::ExitCode::from(2);
        }
    };
    let format = cli.command.log_format();
    if let Some(format) = format {
        init_logging_as(format);
    }
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Under JSON logs the error is a log line too.
            let line = one_line(&e);
            match format {
                Some(LogFormat::Json) => tracing::error!("error: {line}"),
                _ => eprintln!("error: {line}"),
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, after colons; a cause whose text its parent's message
/// already ends with (a library error that both shows and returns its source) is said once.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

impl Command {
    /// How the services log (`serve`, `mock`; `demo` only with `--log-format json`, its text
    /// mode printing nothing but its own lines), if this command is one of them.
    fn log_format(&self) -> Option<LogFormat> {
        match self {
            Self::Serve(args) => Some(args.log_format),
            Self::Mock(args) => Some(args.log_format),
            Self::Demo(args) => (args.log_format == LogFormat::Json).then_some(LogFormat::Json),
            Self::Bench(_) | Self::Replay(_) | Self::Calibrate(_) | Self::Validate(_) | Self::Tune(_) => None,
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Bench(BenchCommand::Index(args)) => bench_index(args),
        Command::Bench(BenchCommand::SplitOpstream(args)) => split_opstream(args),
        Command::Bench(BenchCommand::Hash(args)) => bench_hash(args),
        Command::Bench(BenchCommand::Route(args)) => bench_route(args),
        Command::Bench(BenchCommand::Serve(args)) => kvroute::bench::serve::run(args),
        Command::Bench(BenchCommand::Upstream(args)) => kvroute::bench::serve::run_upstreams(args),
        Command::Bench(BenchCommand::Chat(args)) => kvroute::bench::chat::run(args),
        Command::Bench(BenchCommand::Sync(args)) => bench_sync(args),
        Command::Replay(args) => kvroute::replay::run(*args),
        Command::Calibrate(args) => kvroute::calibrate::calibrate(args),
        Command::Validate(args) => kvroute::calibrate::validate(args),
        Command::Tune(args) => kvroute::tune::run(*args),
        Command::Serve(args) => kvroute::serve::serve(*args),
        Command::Mock(args) => kvroute::serve::mock(*args),
        Command::Demo(args) => kvroute::demo::run(args),
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
    let report = bench::index::run(&stream, &name, args.reps, args.blocks_per_worker, args.layout)?;
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

fn split_opstream(args: SplitArgs) -> anyhow::Result<()> {
    let factor = u32::try_from(args.factor).context("split factor")?;
    let split = OpStream::read(&args.opstream)?.split(factor)?;
    split.write(&args.out)?;
    eprintln!(
        "wrote {} ops at {}-token blocks to {}",
        split.ops.len(),
        split.header.block_size,
        args.out.display()
    );
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

fn bench_sync(args: SyncArgs) -> anyhow::Result<()> {
    if args.live {
        let config = bench::sync_live::LiveConfig {
            requests: args.requests,
            rounds: args.reps,
            speedup: args.speedup,
            lazy: std::time::Duration::from_millis(args.lazy_ms),
        };
        let mut print = |line: &bench::sync_live::PassReport| match serde_json::to_string(line) {
            Ok(text) => println!("{text}"),
            Err(e) => eprintln!("serializing a pass: {e}"),
        };
        let summary = bench::sync_live::run(&config, &mut print)?;
        println!(
            "{}",
            serde_json::to_string(&summary).context("serializing the summary")?
        );
        return Ok(());
    }
    for report in bench::sync::run(&args.blocks, args.requests, args.reps, args.seed)? {
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
            let report = bench::route::run_case(
                workers,
                prompt_tokens,
                args.samples,
                args.seed,
                args.prompt_cache,
                args.earlier_hashes,
            )?;
            println!(
                "{}",
                serde_json::to_string(&report).context("serializing the report")?
            );
        }
    }
    Ok(())
}
