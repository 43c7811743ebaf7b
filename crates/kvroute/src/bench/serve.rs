//! `kvroute bench serve` and `kvroute bench upstream`: the proxy's overhead on loopback.
//!
//! `bench upstream` runs trivially fast OpenAI-compatible upstreams (a fixed completion, or a
//! fixed stream of 8 chunks, answered as soon as the request is read). `bench serve` drives a
//! proxy in front of them (ours, spawned as a child process, or any proxy at `--target`, such as
//! sglang-router) with a closed-loop load generator: latency at `--latency-concurrency` (1) next
//! to the same requests sent to an upstream directly (added latency = through the proxy minus
//! direct), then requests per second at `--concurrency` (16), and the proxy process's CPU time
//! per request from `/proc/<pid>/stat`. Each load connection is one keep-alive HTTP/1.1
//! connection with TCP_NODELAY. Prompts are ~300-byte texts over 8 shared prefixes, so a
//! cache-aware policy has real matching to do.

use std::net::SocketAddr;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};

use super::percentile;

/// The options of `kvroute bench upstream`.
#[derive(Args, Debug)]
pub struct UpstreamArgs {
    /// Port of the first upstream; upstream i listens on PORT+i.
    #[arg(long, default_value_t = 9001)]
    pub port: u16,
    /// Upstreams to run.
    #[arg(long, default_value_t = 2)]
    pub count: u16,
}

/// The options of `kvroute bench serve`.
#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// A running proxy to measure (e.g. sglang-router). Default: spawn `kvroute serve` in
    /// front of in-process upstreams.
    #[arg(long)]
    pub target: Option<String>,
    /// The target's process id, for its CPU time.
    #[arg(long)]
    pub target_pid: Option<u32>,
    /// Upstreams the target routes to, comma-separated; the first is the direct baseline.
    /// Default: start 2 in-process.
    #[arg(long, value_delimiter = ',')]
    pub upstream_urls: Vec<String>,
    /// Pin a spawned proxy to this CPU (taskset).
    #[arg(long)]
    pub proxy_cpu: Option<usize>,
    /// Concurrency of the throughput runs.
    #[arg(long, default_value_t = 16, value_parser = crate::config::count)]
    pub concurrency: usize,
    /// Concurrency of the latency runs.
    #[arg(long, default_value_t = 1, value_parser = crate::config::count)]
    pub latency_concurrency: usize,
    /// Seconds per measured run (after a 1 s warm-up).
    #[arg(long, default_value_t = 5.0, value_parser = crate::config::positive)]
    pub seconds: f64,
    /// Modes: unary, stream.
    #[arg(long, value_delimiter = ',', default_value = "unary,stream")]
    pub mode: Vec<String>,
    /// Name of the measured proxy in the output.
    #[arg(long, default_value = "kvroute")]
    pub name: String,
    /// Send the prompts as token ids (the same bytes' ids under the tiny model), which a proxy
    /// that tokenizes passes as they are: isolates tokenization's share.
    #[arg(long)]
    pub token_ids: bool,
    /// Run a spawned proxy disaggregated in this protocol (vllm or sglang): the first upstream
    /// is its prefill worker, the others decode, and every request takes the prefill path.
    #[arg(long)]
    pub disagg: Option<kvroute_proxy::EngineKind>,
}

/// One case's figures.
#[derive(Debug, Serialize)]
pub struct ServeReport {
    /// The proxy measured.
    pub proxy: String,
    /// `unary` or `stream`.
    pub mode: String,
    /// Whether prompts were token ids.
    pub token_ids: bool,
    /// Throughput run's concurrency.
    pub concurrency: usize,
    /// Requests per second through the proxy at `concurrency`.
    pub rps: f64,
    /// Requests per second straight to one upstream at `concurrency`.
    pub direct_rps: f64,
    /// Latency through the proxy at the latency concurrency, p50, microseconds.
    pub p50_us: u64,
    /// ... p99.
    pub p99_us: u64,
    /// Latency straight to the upstream, p50, microseconds.
    pub direct_p50_us: u64,
    /// ... p99.
    pub direct_p99_us: u64,
    /// Added latency (proxy minus direct), p50, microseconds.
    pub added_p50_us: i64,
    /// ... p99.
    pub added_p99_us: i64,
    /// The proxy's CPU time (user + system) per request in the throughput run, microseconds;
    /// absent without a pid.
    pub cpu_us_per_request: Option<f64>,
    /// Requests that failed (non-2xx or transport) in all runs.
    pub errors: u64,
}

const UNARY: &str = r#"{"id":"cmpl-bench","object":"text_completion","created":0,"model":"tiny","choices":[{"index":0,"text":"abcdefgh","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":300,"completion_tokens":8,"total_tokens":308}}"#;

/// A response of ready frames.
struct Frames(std::collections::VecDeque<Bytes>);

impl hyper::body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

async fn answer(req: Request<Incoming>) -> Result<Response<Frames>, std::convert::Infallible> {
    let post = req.method() == hyper::Method::POST;
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let mut frames = std::collections::VecDeque::new();
    let mut builder = Response::builder().header("content-type", "application/json");
    if !post {
        frames.push_back(Bytes::from_static(b"{}"));
    } else if memchr_stream(&body) {
        builder = builder.header("content-type", "text/event-stream");
        for i in 0..8 {
            frames.push_back(Bytes::from(format!(
                "data: {{\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"tiny\",\"choices\":[{{\"index\":0,\"text\":\"{}\",\"logprobs\":null,\"finish_reason\":null}}]}}\n\n",
                char::from(b'a' + i)
            )));
        }
        frames.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    } else {
        frames.push_back(Bytes::from_static(UNARY.as_bytes()));
    }
    Ok(builder
        .body(Frames(frames))
        .unwrap_or_else(|_| Response::new(Frames(Default::default()))))
}

/// Whether a JSON body asks for a stream.
fn memchr_stream(body: &[u8]) -> bool {
    let needle = b"\"stream\":true";
    body.windows(needle.len()).any(|w| w == needle)
}

/// Serves fast upstream responses on `listener` forever.
pub async fn upstream(listener: TcpListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), hyper::service::service_fn(answer))
                .await;
        });
    }
}

/// Runs `kvroute bench upstream` until stopped.
pub fn run_upstreams(args: UpstreamArgs) -> anyhow::Result<()> {
    crate::serve::runtime(1)?.block_on(async move {
        for i in 0..args.count {
            let addr = SocketAddr::from(([127, 0, 0, 1], args.port + i));
            let listener = TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            eprintln!("fast upstream: http://{addr}");
            tokio::spawn(upstream(listener));
        }
        std::future::pending::<()>().await;
        Ok(())
    })
}

fn body(i: usize, stream: bool, token_ids: bool) -> Bytes {
    let prefix = i % 8;
    let text = format!(
        "System prompt number {prefix}: you are a helpful assistant that answers briefly and well. \
         Context for group {prefix} follows, repeated so the prompt spans several blocks of tokens. \
         The user asks question {i}: what is the capital of the country with index {i}?"
    );
    let prompt = if token_ids {
        serde_json::json!(text.bytes().collect::<Vec<u8>>())
    } else {
        serde_json::json!(text)
    };
    Bytes::from(
        serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": stream}).to_string(),
    )
}

/// What every connection of a load sends: requests to `path`, streamed or not, with prompts as
/// text or as token ids ([`body`]).
#[derive(Clone, Copy)]
struct Traffic<'a> {
    path: &'a str,
    stream: bool,
    token_ids: bool,
}

/// What a load measured.
struct Measured {
    /// Per-request latencies in µs, sorted; one per request done.
    latencies_us: Vec<u64>,
    /// Requests answered with an error status.
    errors: u64,
    /// Elapsed seconds.
    secs: f64,
}

impl Measured {
    /// Requests done per second.
    fn rps(&self) -> f64 {
        self.latencies_us.len() as f64 / self.secs
    }
}

/// Closed-loop load: `concurrency` connections to `url`, each sending the next request of
/// `traffic` when the last response has been read, for `seconds`.
async fn load(url: &str, traffic: Traffic<'_>, concurrency: usize, seconds: f64) -> anyhow::Result<Measured> {
    let Traffic {
        path,
        stream,
        token_ids,
    } = traffic;
    let authority = url.trim_start_matches("http://").trim_end_matches('/').to_owned();
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for c in 0..concurrency {
        let (authority, path) = (authority.clone(), path.to_owned());
        tasks.push(tokio::spawn(async move {
            let tcp = TcpStream::connect(&authority).await?;
            tcp.set_nodelay(true)?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
            tokio::spawn(conn);
            let (mut lat, mut errors, mut i) = (Vec::new(), 0u64, c);
            while Instant::now() < deadline {
                let req = Request::post(format!("http://{authority}{path}"))
                    .header("host", &authority)
                    .header("content-type", "application/json")
                    .body(Full::new(body(i, stream, token_ids)))?;
                i += concurrency;
                let t0 = Instant::now();
                sender.ready().await?;
                let resp = sender.send_request(req).await?;
                let ok = resp.status().is_success();
                resp.into_body().collect().await?;
                lat.push(t0.elapsed().as_micros() as u64);
                if !ok {
                    errors += 1;
                }
            }
            anyhow::Ok((lat, errors))
        }));
    }
    let t0 = Instant::now();
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (lat, e) = t.await??;
        all.extend(lat);
        errors += e;
    }
    let secs = t0.elapsed().as_secs_f64();
    all.sort_unstable();
    Ok(Measured {
        latencies_us: all,
        errors,
        secs,
    })
}

/// A process's user + system CPU time in microseconds (`/proc/<pid>/stat`, 100 ticks per s).
pub(super) fn cpu_us(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) * 10_000)
}

/// A child process, killed when dropped.
pub(super) struct Spawned(Child);

impl Spawned {
    /// Its process id.
    pub(super) fn id(&self) -> u32 {
        self.0.id()
    }
}

/// Spawns `kvroute serve` (this executable; pinned to `cpu` if given) on a free port in front
/// of `workers` (`--worker` values), with `extra` flags, and waits until it accepts
/// connections: its URL and the child.
pub(super) async fn spawn_proxy(
    cpu: Option<usize>,
    workers: &[String],
    extra: &[String],
) -> anyhow::Result<(String, Spawned)> {
    let port = TcpListener::bind("127.0.0.1:0").await?.local_addr()?.port();
    let exe = std::env::current_exe()?;
    let mut cmd = match cpu {
        Some(cpu) => {
            let mut c = Command::new("taskset");
            c.arg("-c").arg(cpu.to_string()).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args([
        "serve",
        "--threads",
        "1",
        "--health-interval-ms",
        "0",
        "--admin-listen",
        "127.0.0.1:0",
        "--listen",
    ])
    .arg(format!("127.0.0.1:{port}"));
    for w in workers {
        cmd.arg("--worker").arg(w);
    }
    cmd.args(extra);
    cmd.env("RUST_LOG", "warn").stdout(Stdio::null());
    let child = Spawned(cmd.spawn().context("spawning kvroute serve")?);
    let url = format!("http://127.0.0.1:{port}");
    super::chat::wait_up(&url).await?;
    Ok((url, child))
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `kvroute bench serve`.
pub fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    crate::serve::runtime(0)?.block_on(run_async(args))
}

async fn run_async(args: ServeBenchArgs) -> anyhow::Result<()> {
    let mut upstreams = args.upstream_urls.clone();
    if upstreams.is_empty() {
        for _ in 0..2 {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            upstreams.push(format!("http://{}", listener.local_addr()?));
            tokio::spawn(upstream(listener));
        }
    }
    let mut _child = None;
    let (target, pid) = match &args.target {
        Some(t) => (t.trim_end_matches('/').to_owned(), args.target_pid),
        None => {
            let workers: Vec<String> = upstreams
                .iter()
                .enumerate()
                .map(|(i, u)| {
                    let role = match (args.disagg, i) {
                        (None, _) => "",
                        (Some(_), 0) => ",role=prefill",
                        (Some(_), _) => ",role=decode",
                    };
                    format!("{u}{role}")
                })
                .collect();
            let mut extra = vec!["--approximate-tokenizer".to_owned()];
            if let Some(protocol) = args.disagg {
                extra
                    .extend(["--decider", "always", "--disagg-protocol", protocol.name()].map(str::to_owned));
            }
            let (url, child) = spawn_proxy(args.proxy_cpu, &workers, &extra).await?;
            let pid = child.id();
            _child = Some(child);
            (url, Some(pid))
        }
    };
    // Wait until the target answers.
    let t0 = Instant::now();
    while TcpStream::connect(target.trim_start_matches("http://"))
        .await
        .is_err()
    {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("{target} did not come up");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for mode in &args.mode {
        let stream = match mode.as_str() {
            "unary" => false,
            "stream" => true,
            other => bail!("--mode {other:?}: unary or stream"),
        };
        let traffic = Traffic {
            path: "/v1/completions",
            stream,
            token_ids: args.token_ids,
        };
        // Warm-up (connection pools, routing trees), then the runs.
        load(&target, traffic, args.concurrency, 1.0).await?;
        let direct = load(&upstreams[0], traffic, args.latency_concurrency, args.seconds).await?;
        let proxied = load(&target, traffic, args.latency_concurrency, args.seconds).await?;
        let direct_tp = load(&upstreams[0], traffic, args.concurrency, args.seconds).await?;
        let cpu0 = pid.and_then(cpu_us);
        let tp = load(&target, traffic, args.concurrency, args.seconds).await?;
        let cpu1 = pid.and_then(cpu_us);
        let p = |m: &Measured, q: f64| percentile(&m.latencies_us, q);
        let done = tp.latencies_us.len();
        let report = ServeReport {
            proxy: args.name.clone(),
            mode: mode.clone(),
            token_ids: args.token_ids,
            concurrency: args.concurrency,
            rps: tp.rps(),
            direct_rps: direct_tp.rps(),
            p50_us: p(&proxied, 50.0),
            p99_us: p(&proxied, 99.0),
            direct_p50_us: p(&direct, 50.0),
            direct_p99_us: p(&direct, 99.0),
            added_p50_us: p(&proxied, 50.0) as i64 - p(&direct, 50.0) as i64,
            added_p99_us: p(&proxied, 99.0) as i64 - p(&direct, 99.0) as i64,
            cpu_us_per_request: match (cpu0, cpu1) {
                (Some(a), Some(b)) if done > 0 => Some((b - a) as f64 / done as f64),
                _ => None,
            },
            errors: direct.errors + proxied.errors + direct_tp.errors + tp.errors,
        };
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}
