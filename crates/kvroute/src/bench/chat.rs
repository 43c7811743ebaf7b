//! `kvroute bench chat`: the proxy's added latency on a long multi-turn conversation, with its
//! tokenizer cache on and off.
//!
//! Two `kvroute serve` children (`--tokenizer-cache-bytes` default, and 0) sit in front of one
//! in-process fast upstream ([`super::serve::upstream`]). Each of `--conversations`
//! conversations (distinct texts) grows over `--turns` turns to about `--tokens` prompt tokens;
//! every turn's request (the conversation so far, as a client sends it) goes straight to the
//! upstream, then through each proxy, one at a time, interleaved. Added latency = through a
//! proxy minus direct, as percentiles over the conversations: for the first turn, for the
//! follow-up turns pooled, and for the last (longest) turn. CPU per request is each proxy
//! process's user + system time over the run.

use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use kvroute_http::Model;
use kvroute_http::model::SpecialTokens;
use serde::Serialize;
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};

use super::percentile;
use super::serve::{Spawned, cpu_us, spawn_proxy, upstream};

/// The options of `kvroute bench chat`.
#[derive(Args, Debug)]
pub struct ChatBenchArgs {
    /// Turns per conversation (user messages; each after the first follows an assistant reply).
    #[arg(long, default_value_t = 32, value_parser = crate::config::count)]
    pub turns: usize,
    /// Prompt tokens of the last turn, about.
    #[arg(long, default_value_t = 32_768, value_parser = crate::config::count)]
    pub tokens: usize,
    /// Conversations, each with its own text.
    #[arg(long, default_value_t = 20, value_parser = crate::config::count)]
    pub conversations: usize,
    /// The proxies' model directory (tokenizer.json and a chat template). Default: the built-in
    /// tiny model (one token per byte).
    #[arg(long)]
    pub model_dir: Option<std::path::PathBuf>,
    /// Pin the proxies to this CPU (taskset).
    #[arg(long)]
    pub proxy_cpu: Option<usize>,
    /// Streamed requests (the proxy then adds `stream_options` to the forwarded body).
    #[arg(long)]
    pub stream: bool,
}

/// One cache mode's figures, microseconds.
#[derive(Debug, Serialize)]
pub struct ChatReport {
    /// `on` or `off`.
    pub cache: &'static str,
    /// Turns per conversation.
    pub turns: usize,
    /// Conversations.
    pub conversations: usize,
    /// Prompt tokens of the last turn (the first conversation's, by the same tokenizer).
    pub last_turn_tokens: usize,
    /// Request body bytes of the last turn.
    pub last_turn_body_bytes: usize,
    /// Streamed requests.
    pub stream: bool,
    /// Added latency of the first turn, p50.
    pub first_added_p50_us: i64,
    /// Added latency of the follow-up turns (2..=turns, pooled), p50.
    pub followup_added_p50_us: i64,
    /// ... p99.
    pub followup_added_p99_us: i64,
    /// Added latency of the last turn, p50.
    pub last_added_p50_us: i64,
    /// ... p99.
    pub last_added_p99_us: i64,
    /// Added latency p50 per turn, first to last.
    pub added_p50_by_turn_us: Vec<i64>,
    /// The proxy's CPU time per request over the run.
    pub cpu_us_per_request: Option<f64>,
    /// Requests answered with an error status.
    pub errors: u64,
}

/// The request bodies of conversation `c`, turn by turn.
fn conversation(c: usize, turns: usize, message_bytes: usize, stream: bool) -> Vec<Bytes> {
    kvroute_http::sample::conversation(c, turns, message_bytes, stream)
        .into_iter()
        .map(Bytes::from)
        .collect()
}

/// One keep-alive connection.
struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    authority: String,
}

impl Conn {
    async fn open(url: &str) -> anyhow::Result<Self> {
        let authority = url.trim_start_matches("http://").trim_end_matches('/').to_owned();
        let tcp = TcpStream::connect(&authority).await?;
        tcp.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        Ok(Self { sender, authority })
    }

    /// Posts `body` to the chat endpoint; (µs until the whole answer was read, success).
    async fn post(&mut self, body: &Bytes) -> anyhow::Result<(u64, bool)> {
        let req = Request::post(format!("http://{}/v1/chat/completions", self.authority))
            .header("host", &self.authority)
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))?;
        let t0 = Instant::now();
        self.sender.ready().await?;
        let resp = self.sender.send_request(req).await?;
        let ok = resp.status().is_success();
        resp.into_body().collect().await?;
        Ok((t0.elapsed().as_micros() as u64, ok))
    }
}

/// Runs `kvroute bench chat`.
pub fn run(args: ChatBenchArgs) -> anyhow::Result<()> {
    crate::serve::runtime(1)?.block_on(run_async(args))
}

async fn run_async(args: ChatBenchArgs) -> anyhow::Result<()> {
    let model = match &args.model_dir {
        Some(dir) => Model::load(dir).with_context(|| format!("loading {}", dir.display()))?,
        None => Model::tiny()?,
    };
    // Size the messages so that the last turn has about `--tokens` tokens.
    let probe = conversation(0, 1, 4096, false);
    let probe_tokens = prompt_tokens(&model, &probe[0])?;
    let bytes_per_token = 4096.0 / probe_tokens.max(1) as f64;
    let message_bytes = ((args.tokens as f64 * bytes_per_token) / (2 * args.turns) as f64).max(16.0) as usize;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let direct = format!("http://{}", listener.local_addr()?);
    tokio::spawn(upstream(listener));
    let mut tokenizer = match &args.model_dir {
        Some(dir) => vec!["--model-dir".to_owned(), dir.display().to_string()],
        None => vec!["--approximate-tokenizer".to_owned()],
    };
    tokenizer.extend(["--max-prompt-tokens".to_owned(), (args.tokens * 4).to_string()]);
    let mut proxies: Vec<(&'static str, String, Spawned)> = Vec::new();
    for (cache, bytes) in [("on", None), ("off", Some("0"))] {
        let mut extra = tokenizer.clone();
        if let Some(bytes) = bytes {
            extra.extend(["--tokenizer-cache-bytes".to_owned(), bytes.to_owned()]);
        }
        let (url, child) = spawn_proxy(args.proxy_cpu, std::slice::from_ref(&direct), &extra).await?;
        proxies.push((cache, url, child));
    }
    let mut direct_conn = Conn::open(&direct).await?;
    let mut conns = Vec::new();
    for (_, url, _) in &proxies {
        conns.push(Conn::open(url).await?);
    }
    // Warm-up: a conversation the measured ones share nothing with.
    for body in conversation(usize::MAX / 2, 2, 256, args.stream) {
        direct_conn.post(&body).await?;
        for conn in &mut conns {
            let (_, ok) = conn.post(&body).await?;
            if !ok {
                bail!("the proxy refused the warm-up request");
            }
        }
    }
    let turns = args.turns;
    // latencies[target][turn]: target 0 is direct, then the proxies.
    let mut latencies = vec![vec![Vec::with_capacity(args.conversations); turns]; 1 + conns.len()];
    let mut errors = vec![0u64; conns.len()];
    let cpu0: Vec<Option<u64>> = proxies.iter().map(|(_, _, c)| cpu_us(c.id())).collect();
    let mut last_body = Bytes::new();
    for c in 0..args.conversations {
        for (t, body) in conversation(c, turns, message_bytes, args.stream)
            .into_iter()
            .enumerate()
        {
            latencies[0][t].push(direct_conn.post(&body).await?.0);
            for (i, conn) in conns.iter_mut().enumerate() {
                let (us, ok) = conn.post(&body).await?;
                latencies[1 + i][t].push(us);
                errors[i] += u64::from(!ok);
            }
            if c == 0 && t + 1 == turns {
                last_body = body;
            }
        }
    }
    let requests = (args.conversations * turns) as f64;
    let last_turn_tokens = prompt_tokens(&model, &last_body)?;
    for (i, (cache, _, child)) in proxies.iter().enumerate() {
        let added = |turns: std::ops::Range<usize>, p: f64| {
            let pool = |target: usize| {
                let mut all: Vec<u64> = turns.clone().flat_map(|t| latencies[target][t].clone()).collect();
                all.sort_unstable();
                percentile(&all, p)
            };
            pool(1 + i) as i64 - pool(0) as i64
        };
        let report = ChatReport {
            cache,
            turns,
            conversations: args.conversations,
            last_turn_tokens,
            last_turn_body_bytes: last_body.len(),
            stream: args.stream,
            first_added_p50_us: added(0..1, 50.0),
            followup_added_p50_us: added(1..turns, 50.0),
            followup_added_p99_us: added(1..turns, 99.0),
            last_added_p50_us: added(turns - 1..turns, 50.0),
            last_added_p99_us: added(turns - 1..turns, 99.0),
            added_p50_by_turn_us: (0..turns).map(|t| added(t..t + 1, 50.0)).collect(),
            cpu_us_per_request: match (cpu0[i], cpu_us(child.id())) {
                (Some(a), Some(b)) => Some((b - a) as f64 / requests),
                _ => None,
            },
            errors: errors[i],
        };
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(())
}

/// The prompt tokens of a chat body, by `model`.
fn prompt_tokens(model: &Model, body: &[u8]) -> anyhow::Result<usize> {
    let value: Value = serde_json::from_slice(body)?;
    let text = model
        .render_chat(&value["messages"], true)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(model
        .encode(&text, SpecialTokens::Omit)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .len())
}

/// Waits until `url` accepts connections.
pub(super) async fn wait_up(url: &str) -> anyhow::Result<()> {
    let t0 = Instant::now();
    while TcpStream::connect(url.trim_start_matches("http://"))
        .await
        .is_err()
    {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("{url} did not come up");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}
