//! What `metrics_truth.rs` and `misconfiguration.rs` share: the e2e harness's cluster with a
//! raw client ([`Proxy`]), raw upstream stubs that answer, break off, hang or trickle on
//! purpose ([`raw_stub`]), metric readers, and `kvroute` run as a child process. Included with
//! `#[path]`.

#![allow(dead_code, unused_imports)]
// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

pub use std::io::BufRead;
pub use std::sync::Arc;
pub use std::time::{Duration, Instant};

pub use bytes::Bytes;
pub use http_body_util::{BodyExt, Full};
pub use hyper::HeaderMap;
pub use kvroute_http::net::{HttpClient, client};
pub use kvroute_http::openai::types::{Completion, ErrorResponse, ModelCard};
pub use kvroute_mock::{MockConfig, MockWorker};
pub use kvroute_proxy::worker::StateName;
pub use kvroute_proxy::{ServeConfig, WorkerConfig};
pub use serde_json::{Value, json};
pub use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "cluster.rs"]
pub mod support;
pub use support::{Cluster, PATIENCE, fronting, metric, start_mocks};

/// A 200-token prompt for the tiny byte-level model: 12 full blocks of 16.
pub fn long_prompt(seed: char) -> String {
    std::iter::repeat_n(seed, 200).collect()
}

/// The end-to-end harness's cluster, with a raw client for heads and bodies.
pub struct Proxy {
    pub cluster: Cluster,
    pub http: HttpClient,
}

impl std::ops::Deref for Proxy {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

/// A proxy (health checks off unless `tweak` sets them) in front of `workers`, then `mocks`.
pub async fn proxy(
    workers: Vec<WorkerConfig>,
    mocks: Vec<MockWorker>,
    tweak: impl FnOnce(&mut ServeConfig),
) -> Proxy {
    let cluster = fronting(workers, mocks, |c| {
        c.upstream.health_interval_ms = 0;
        tweak(c);
    })
    .await;
    Proxy {
        cluster,
        http: client(Duration::from_secs(2)),
    }
}

impl Proxy {
    /// Sends `body` to `path` (POST, or GET when `None`) and returns the response head; the
    /// body is for the caller to read.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> hyper::Response<hyper::body::Incoming> {
        let body = body.map_or_else(Vec::new, |b| serde_json::to_vec(&b).unwrap());
        let request = hyper::Request::builder()
            .method(method)
            .uri(if path.starts_with("/admin") {
                format!("{}{path}", self.proxy.admin_url())
            } else {
                format!("{}{path}", self.proxy.url())
            })
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        self.http.request(request).await.unwrap()
    }

    /// A completion of `prompt` (model `tiny`), read whole.
    pub async fn complete(&self, prompt: &str) -> (u16, HeaderMap, String) {
        let body = json!({"model": "tiny", "prompt": prompt});
        self.call("POST", "/v1/completions", Some(body)).await
    }

    /// A request read whole: status, headers, body.
    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, HeaderMap, String) {
        let response = self.send(method, path, body).await;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (
            parts.status.as_u16(),
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    pub async fn metrics(&self) -> String {
        self.call("GET", "/metrics", None).await.2
    }

    /// Waits until `name{..label..}` (summed) equals `want` in `/metrics`.
    pub async fn wait_for_metric(&self, name: &str, label: &str, want: f64) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let text = self.metrics().await;
            let got = metric(&text, name, label);
            if got == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{name}{{{label}}} is {got}, not {want}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Whether a series of `name` with `label` is exported at all.
pub fn has_series(text: &str, name: &str, label: &str) -> bool {
    text.lines()
        .any(|l| !l.starts_with('#') && l.split([' ', '{']).next() == Some(name) && l.contains(label))
}

/// What a raw stub does once it has sent its head and chunks.
#[derive(Clone, Copy)]
pub enum Then {
    /// Closes the connection mid-body.
    Reset,
    /// Keeps the connection open, silent.
    Hang,
    /// Sends another chunk every few milliseconds until the connection fails.
    Trickle,
    /// Ends the body properly.
    End,
}

/// An upstream stub speaking raw HTTP/1.1: to every request, `status` with a chunked
/// `content_type` body of `chunks`, then what `then` says. Returns its URL.
pub async fn raw_stub(
    status: u16,
    content_type: &'static str,
    chunks: &'static [&'static str],
    then: Then,
) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                if read_request(&mut socket).await.is_none() {
                    return;
                }
                // One response per connection, said so: a client that pooled the connection
                // could send its next request into the close below.
                let mut out = format!(
                    "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
                );
                for c in chunks {
                    out.push_str(&format!("{:x}\r\n{c}\r\n", c.len()));
                }
                if socket.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
                match then {
                    Then::Reset => drop(socket),
                    Then::Hang => {
                        let mut buf = [0u8; 64];
                        while matches!(socket.read(&mut buf).await, Ok(n) if n > 0) {}
                    }
                    Then::Trickle => loop {
                        let chunk = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
                        let frame = format!("{:x}\r\n{chunk}\r\n", chunk.len());
                        if socket.write_all(frame.as_bytes()).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    },
                    Then::End => {
                        let _ = socket.write_all(b"0\r\n\r\n").await;
                    }
                }
            });
        }
    });
    url
}

/// Reads one request (head and a `content-length` body) off `socket`.
pub async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<()> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if socket.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    socket.read_exact(&mut body).await.ok()?;
    Some(())
}

pub fn stream_request(prompt: &str) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": true})
}

/// `kvroute_requests_outcome_total` with `outcome`.
pub fn outcome(text: &str, outcome: &str) -> f64 {
    metric(
        text,
        "kvroute_requests_outcome_total",
        &format!("outcome=\"{outcome}\""),
    )
}

/// `kvroute_worker_cached_token_reports_total{report="..."}`: how many answers' cached-token
/// counts were of the kind `report` (`reported`, `absent`, `no_usage`).
pub fn cache_reports(text: &str, report: &str) -> f64 {
    metric(
        text,
        "kvroute_worker_cached_token_reports_total",
        &format!("report=\"{report}\""),
    )
}

impl Proxy {
    pub fn block_size(&self) -> u32 {
        self.proxy.driver.config.routing.block_size
    }
}

/// A child process of ours, killed when dropped, whose stderr lines arrive on a channel.
pub struct Child {
    pub child: std::process::Child,
    pub lines: std::sync::mpsc::Receiver<String>,
}

impl Child {
    pub fn spawn(args: &[&str]) -> Self {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self { child, lines }
    }

    /// The first stderr line that `pick` accepts, as it maps it.
    pub fn wait_for<T>(&self, mut pick: impl FnMut(&str) -> Option<T>) -> T {
        let deadline = Instant::now() + PATIENCE;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(t) = pick(&line) {
                        return t;
                    }
                    seen.push(line);
                }
                Err(e) => panic!("{e}; stderr so far:\n{}", seen.join("\n")),
            }
        }
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A proxy in another process.
pub struct Remote {
    pub url: String,
    pub http: HttpClient,
}

impl Remote {
    pub async fn post(&self, path: &str, body: &Value) -> (u16, String) {
        let request = hyper::Request::post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
            .unwrap();
        let response = self.http.request(request).await.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    pub async fn get(&self, path: &str) -> String {
        let request = hyper::Request::get(format!("{}{path}", self.url))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = self.http.request(request).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&body).into_owned()
    }
}

/// `kvroute serve` (stderr on a pipe) with one worker at a port nobody listens on (bound, then
/// closed), and that worker's URL.
pub fn serve_a_worker_nobody_serves() -> (Child, String) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let worker = format!("http://127.0.0.1:{port}");
    let serve = Child::spawn(&[
        "serve",
        "--approximate-tokenizer",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--worker",
        &worker,
    ]);
    (serve, worker)
}

/// The `data:` events of an SSE body, each as JSON (`[DONE]` as the string "[DONE]").
pub fn sse_events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_owned())))
        .collect()
}
