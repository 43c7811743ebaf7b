//! `kvroute bench upstream` and `kvroute bench proxy`: what a proxy in front of OpenAI-compatible
//! workers costs, in added latency, requests per second and CPU per request.
//!
//! * [`serve_upstreams`] runs trivially fast workers, one per port: every completion is the same
//!   few tokens, in one JSON body or streamed as server-sent events, each event its own write (so a
//!   proxy forwards them one by one, as it would a real engine's). The proxy under test, not the
//!   workers, is the bottleneck.
//! * [`drive`] is a closed loop of `concurrency` clients, each with its own keep-alive HTTP/1.1
//!   connection (`TCP_NODELAY` set), sending one request after the other for a warm-up and then a
//!   measured window. A request's latency runs from sending it to the last byte of its response.
//!   Run once against the proxy and once against one worker directly (`--direct`), the difference
//!   of the two is the latency the proxy adds. With `--pid`, the CPU time the proxy's process
//!   spent in the window (user + system, from `/proc/PID/stat`) is divided by the requests served.
//!
//! The same load generator measures any proxy (kvroute's, `sglang-router`, ...) in front of the
//! same workers, which is what a side-by-side comparison needs.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};

use super::{mean, percentile};

/// The model name the fast workers answer to.
pub const MODEL: &str = "kvroute-bench";

/// What a fast worker sends back.
#[derive(Clone, Copy, Debug)]
pub struct UpstreamConfig {
    /// Events of a streamed completion before `[DONE]`.
    pub chunks: usize,
    /// Hand a streamed completion's events to the server all at once, so it may write them
    /// together, instead of one write each.
    pub coalesce: bool,
}

/// Serves fast workers on `ports` of `host` until the process ends.
pub async fn serve_upstreams(host: &str, ports: &[u16], config: UpstreamConfig) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    for &port in ports {
        let listener = TcpListener::bind((host, port))
            .await
            .with_context(|| format!("binding {host}:{port}"))?;
        tasks.push(tokio::spawn(accept_loop(listener, config)));
    }
    for task in tasks {
        task.await.context("an upstream task failed")??;
    }
    Ok(())
}

async fn accept_loop(listener: TcpListener, config: UpstreamConfig) -> anyhow::Result<()> {
    loop {
        let (stream, _) = listener.accept().await.context("accepting a connection")?;
        stream.set_nodelay(true).context("setting TCP_NODELAY")?;
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| answer(req, config));
            // A client that goes away mid-request is not the benchmark's concern.
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The body of a fast worker's response.
enum UpstreamBody {
    Full(Option<Bytes>),
    Events(SseEvents),
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            UpstreamBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            UpstreamBody::Events(events) => events.poll_next(cx),
        }
    }
}

/// A streamed completion: `chunks` events then `[DONE]`, each returned after one `Pending`, so the
/// server writes (and flushes) each event on its own; with `coalesce`, all at once.
struct SseEvents {
    chat: bool,
    coalesce: bool,
    sent: usize,
    chunks: usize,
    due: bool,
}

impl SseEvents {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.sent > self.chunks {
            return Poll::Ready(None);
        }
        if !self.due && !self.coalesce {
            self.due = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.due = false;
        let event = if self.sent == self.chunks {
            Bytes::from_static(b"data: [DONE]\n\n")
        } else if self.chat {
            Bytes::from(format!(
                "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" t{}\"}},\"finish_reason\":{}}}]}}\n\n",
                self.sent,
                finish(self.sent + 1 == self.chunks)
            ))
        } else {
            Bytes::from(format!(
                "data: {{\"id\":\"cmpl-bench\",\"object\":\"text_completion\",\"created\":0,\"model\":\"{MODEL}\",\"choices\":[{{\"index\":0,\"text\":\" t{}\",\"finish_reason\":{}}}]}}\n\n",
                self.sent,
                finish(self.sent + 1 == self.chunks)
            ))
        };
        self.sent += 1;
        Poll::Ready(Some(Ok(Frame::data(event))))
    }
}

fn finish(last: bool) -> &'static str {
    if last { "\"length\"" } else { "null" }
}

#[derive(serde::Deserialize)]
struct StreamFlag {
    #[serde(default)]
    stream: bool,
}

async fn answer(
    req: Request<Incoming>,
    config: UpstreamConfig,
) -> Result<Response<UpstreamBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    let json = |status: StatusCode, body: String| {
        Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(UpstreamBody::Full(Some(Bytes::from(body))))
            .unwrap_or_else(|_| Response::new(UpstreamBody::Full(None)))
    };
    let response = match (method, path.as_str()) {
        (Method::GET, "/health" | "/health_generate" | "/metrics") => json(StatusCode::OK, String::new()),
        (Method::GET, "/v1/models") => json(
            StatusCode::OK,
            format!(
                r#"{{"object":"list","data":[{{"id":"{MODEL}","object":"model","owned_by":"kvroute"}}]}}"#
            ),
        ),
        (Method::GET, "/get_model_info" | "/model_info") => json(
            StatusCode::OK,
            format!(r#"{{"model_path":"{MODEL}","tokenizer_path":null,"is_generation":true}}"#),
        ),
        (Method::GET, "/get_server_info") => json(
            StatusCode::OK,
            format!(r#"{{"model_path":"{MODEL}","dp_size":1,"tp_size":1}}"#),
        ),
        (Method::POST, "/v1/completions" | "/v1/chat/completions" | "/generate") => {
            let chat = path == "/v1/chat/completions";
            let Ok(body) = req.into_body().collect().await else {
                return Ok(json(StatusCode::BAD_REQUEST, String::new()));
            };
            let stream = serde_json::from_slice::<StreamFlag>(&body.to_bytes())
                .map(|f| f.stream)
                .unwrap_or(false);
            if stream {
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(UpstreamBody::Events(SseEvents {
                        chat,
                        coalesce: config.coalesce,
                        sent: 0,
                        chunks: config.chunks,
                        due: false,
                    }))
                    .unwrap_or_else(|_| Response::new(UpstreamBody::Full(None)))
            } else if chat {
                json(
                    StatusCode::OK,
                    format!(
                        r#"{{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"{MODEL}","choices":[{{"index":0,"message":{{"role":"assistant","content":" ok"}},"finish_reason":"length"}}],"usage":{{"prompt_tokens":16,"completion_tokens":{n},"total_tokens":{t}}}}}"#,
                        n = config.chunks,
                        t = 16 + config.chunks
                    ),
                )
            } else {
                json(
                    StatusCode::OK,
                    format!(
                        r#"{{"id":"cmpl-bench","object":"text_completion","created":0,"model":"{MODEL}","choices":[{{"index":0,"text":" ok","finish_reason":"length"}}],"usage":{{"prompt_tokens":16,"completion_tokens":{n},"total_tokens":{t}}}}}"#,
                        n = config.chunks,
                        t = 16 + config.chunks
                    ),
                )
            }
        }
        _ => json(StatusCode::NOT_FOUND, String::new()),
    };
    Ok(response)
}

/// One run of the load generator.
#[derive(Clone, Debug)]
pub struct LoadConfig {
    /// Where requests go: `host:port`.
    pub target: SocketAddr,
    /// The request path, e.g. `/v1/completions`.
    pub path: String,
    /// Clients, each with one connection and one request in flight.
    pub concurrency: usize,
    /// Unmeasured time first.
    pub warmup: Duration,
    /// The measured window.
    pub measure: Duration,
    /// Ask for a streamed response.
    pub stream: bool,
    /// The prompt sent with every request.
    pub prompt: String,
    /// `max_tokens` of every request.
    pub max_tokens: u32,
    /// The process whose CPU time is divided by the requests served, if any.
    pub pid: Option<u32>,
}

/// What one run measured.
#[derive(Clone, Debug, Serialize)]
pub struct LoadReport {
    /// The address driven.
    pub target: String,
    /// Whether responses were streamed.
    pub stream: bool,
    /// Clients.
    pub concurrency: usize,
    /// The measured window, seconds.
    pub seconds: f64,
    /// Requests completed with status 200 inside the window.
    pub requests: u64,
    /// Requests that failed or got another status inside the window.
    pub errors: u64,
    /// `requests / seconds`.
    pub rps: f64,
    /// Latency from sending to the last byte, microseconds.
    pub p50_us: f64,
    /// 90th percentile latency, microseconds.
    pub p90_us: f64,
    /// 99th percentile latency, microseconds.
    pub p99_us: f64,
    /// Mean latency, microseconds.
    pub mean_us: f64,
    /// CPU time of `pid` in the window per request, microseconds (user + system).
    pub cpu_us_per_request: Option<f64>,
}

/// Drives `config.target` with a closed loop and reports what it measured.
pub async fn drive(config: &LoadConfig) -> anyhow::Result<LoadReport> {
    let body = Bytes::from(serde_json::to_vec(&if config.path.contains("chat") {
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": config.prompt}],
            "max_tokens": config.max_tokens,
            "stream": config.stream,
        })
    } else {
        serde_json::json!({
            "model": MODEL,
            "prompt": config.prompt,
            "max_tokens": config.max_tokens,
            "stream": config.stream,
        })
    })?);
    let start = Instant::now();
    let window_start = start + config.warmup;
    let window_end = window_start + config.measure;
    let shared = Arc::new((config.clone(), body));
    let mut clients = Vec::new();
    for _ in 0..config.concurrency {
        let shared = Arc::clone(&shared);
        clients.push(tokio::spawn(async move {
            let (config, body) = &*shared;
            client_loop(config, body, window_start, window_end).await
        }));
    }
    let cpu_start = match config.pid {
        Some(pid) => {
            tokio::time::sleep_until(window_start.into()).await;
            Some(cpu_ticks(pid)?)
        }
        None => None,
    };
    let cpu_end = match config.pid {
        Some(pid) => {
            tokio::time::sleep_until(window_end.into()).await;
            Some(cpu_ticks(pid)?)
        }
        None => None,
    };
    let mut latencies = Vec::new();
    let mut errors = 0;
    for client in clients {
        let (lat, err) = client.await.context("a client task panicked")??;
        latencies.extend(lat);
        errors += err;
    }
    latencies.sort_unstable();
    let seconds = config.measure.as_secs_f64();
    let requests = latencies.len() as u64;
    let us = |ns: u64| ns as f64 / 1e3;
    Ok(LoadReport {
        target: config.target.to_string(),
        stream: config.stream,
        concurrency: config.concurrency,
        seconds,
        requests,
        errors,
        rps: requests as f64 / seconds,
        p50_us: us(percentile(&latencies, 50.0)),
        p90_us: us(percentile(&latencies, 90.0)),
        p99_us: us(percentile(&latencies, 99.0)),
        mean_us: mean(&latencies) / 1e3,
        cpu_us_per_request: match (cpu_start, cpu_end) {
            (Some(a), Some(b)) if requests > 0 => {
                Some((b.saturating_sub(a)) as f64 / USER_HZ as f64 * 1e6 / requests as f64)
            }
            _ => None,
        },
    })
}

/// One client: a connection, then requests one after the other until `end`. Returns the
/// latencies (ns) of the requests that completed inside `[begin, end)` and the failures there.
async fn client_loop(
    config: &LoadConfig,
    body: &Bytes,
    begin: Instant,
    end: Instant,
) -> anyhow::Result<(Vec<u64>, u64)> {
    let mut sender = connect(config.target).await?;
    let mut latencies = Vec::new();
    let mut errors = 0;
    let authority = config.target.to_string();
    loop {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        let request = Request::builder()
            .method(Method::POST)
            .uri(config.path.as_str())
            .header("host", authority.as_str())
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))
            .context("building a request")?;
        let ok = match sender.send_request(request).await {
            Ok(response) => {
                let status = response.status();
                let read = response.into_body().collect().await.is_ok();
                status == StatusCode::OK && read
            }
            Err(_) => false,
        };
        let done = Instant::now();
        if sent >= begin && done < end {
            if ok {
                latencies.push(done.duration_since(sent).as_nanos() as u64);
            } else {
                errors += 1;
            }
        }
        if !ok && !sender.is_ready() {
            // The connection broke: open another.
            sender = connect(config.target).await?;
        }
    }
    Ok((latencies, errors))
}

async fn connect(target: SocketAddr) -> anyhow::Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let stream = TcpStream::connect(target)
        .await
        .with_context(|| format!("connecting to {target}"))?;
    stream.set_nodelay(true).context("setting TCP_NODELAY")?;
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("HTTP handshake")?;
    tokio::spawn(async move {
        // Ends when the client drops its sender or the peer closes.
        let _ = connection.await;
    });
    Ok(sender)
}

/// Clock ticks per second of `/proc/PID/stat`'s times: `USER_HZ`, which Linux fixes at 100 for
/// user space on every architecture it exposes it to.
const USER_HZ: u64 = 100;

/// User + system clock ticks `pid` has used so far.
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat (is the process running?)"))?;
    // The command name (field 2) may hold spaces; fields are counted after its closing paren.
    let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        bail!("/proc/{pid}/stat has no command field");
    };
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let field = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .with_context(|| format!("/proc/{pid}/stat field {} unreadable", i + 3))
    };
    Ok(field(11)? + field(12)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast workers answer both APIs in both modes, and the load generator counts what it gets.
    #[test]
    fn the_load_generator_measures_a_fast_worker() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(accept_loop(
                listener,
                UpstreamConfig {
                    chunks: 4,
                    coalesce: false,
                },
            ));
            for (path, stream) in [
                ("/v1/completions", false),
                ("/v1/completions", true),
                ("/v1/chat/completions", false),
                ("/v1/chat/completions", true),
            ] {
                let report = drive(&LoadConfig {
                    target: addr,
                    path: path.into(),
                    concurrency: 2,
                    warmup: Duration::from_millis(20),
                    measure: Duration::from_millis(200),
                    stream,
                    prompt: "hello".into(),
                    max_tokens: 4,
                    pid: Some(std::process::id()),
                })
                .await
                .unwrap();
                assert!(report.requests > 0, "{path} stream={stream}: {report:?}");
                assert_eq!(report.errors, 0, "{path} stream={stream}: {report:?}");
                assert!(report.p50_us > 0.0 && report.p50_us <= report.p99_us);
                assert!(report.cpu_us_per_request.is_some());
            }
        });
    }

    /// A streamed completion arrives as separate events ending in `[DONE]`.
    #[test]
    fn a_streamed_completion_is_sse_events_then_done() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            tokio::spawn(accept_loop(
                listener,
                UpstreamConfig {
                    chunks: 3,
                    coalesce: false,
                },
            ));
            let mut sender = connect(addr).await.unwrap();
            let request = Request::post("/v1/completions")
                .header("host", addr.to_string())
                .body(Full::new(Bytes::from_static(br#"{"prompt":"x","stream":true}"#)))
                .unwrap();
            let response = sender.send_request(request).await.unwrap();
            assert_eq!(response.headers()["content-type"], "text/event-stream");
            let text =
                String::from_utf8(response.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
            let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
            assert_eq!(events.len(), 4, "{text}");
            assert_eq!(events[3], "data: [DONE]");
            for event in &events[..3] {
                let json: serde_json::Value =
                    serde_json::from_str(event.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(json["object"], "text_completion");
            }
        });
    }
}
