//! Metrics that tell the truth, and misconfiguration that is loud (issue 16, parts 3 and 4),
//! end to end: `kvroute serve` in front of mock workers and of raw upstream stubs that answer,
//! break off, hang or trickle on purpose. Each test waits on an explicit signal (a response, a
//! worker state, the router's index), or polls a condition with a generous deadline.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::io::BufRead;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::HeaderMap;
use kvroute_http::net::{HttpClient, client};
use kvroute_http::openai::types::{Completion, ErrorResponse, ModelCard};
use kvroute_mock::{MockConfig, MockWorker};
use kvroute_proxy::worker::StateName;
use kvroute_proxy::{ServeConfig, WorkerConfig};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "support/cluster.rs"]
mod support;
use support::{Cluster, PATIENCE, fronting, start_mocks};

/// A 200-token prompt for the tiny byte-level model: 12 full blocks of 16.
fn long_prompt(seed: char) -> String {
    std::iter::repeat_n(seed, 200).collect()
}

/// The end-to-end harness's cluster, with a raw client for heads and bodies.
struct Proxy {
    cluster: Cluster,
    http: HttpClient,
}

impl std::ops::Deref for Proxy {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

/// A proxy (health checks off unless `tweak` sets them) in front of `workers`, then `mocks`.
async fn proxy(
    workers: Vec<WorkerConfig>,
    mocks: Vec<MockWorker>,
    tweak: impl FnOnce(&mut ServeConfig),
) -> Proxy {
    let cluster = fronting(workers, mocks, |c| {
        c.health_interval_ms = 0;
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
    async fn send(
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
    async fn complete(&self, prompt: &str) -> (u16, HeaderMap, String) {
        let body = json!({"model": "tiny", "prompt": prompt});
        self.call("POST", "/v1/completions", Some(body)).await
    }

    /// A request read whole: status, headers, body.
    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, HeaderMap, String) {
        let response = self.send(method, path, body).await;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.unwrap().to_bytes();
        (
            parts.status.as_u16(),
            parts.headers,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    async fn metrics(&self) -> String {
        self.call("GET", "/metrics", None).await.2
    }

    /// Waits until `name{..label..}` (summed) equals `want` in `/metrics`.
    async fn wait_for_metric(&self, name: &str, label: &str, want: f64) {
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

/// A metric's value from a Prometheus text exposition (the sum over matching lines).
fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next() == Some(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Whether a series of `name` with `label` is exported at all.
fn has_series(text: &str, name: &str, label: &str) -> bool {
    text.lines()
        .any(|l| !l.starts_with('#') && l.split([' ', '{']).next() == Some(name) && l.contains(label))
}

/// What a raw stub does once it has sent its head and chunks.
#[derive(Clone, Copy)]
enum Then {
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
async fn raw_stub(
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
async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<()> {
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

fn stream_request(prompt: &str) -> Value {
    json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": true})
}

/// `kvroute_requests_outcome_total` with `outcome`.
fn outcome(text: &str, outcome: &str) -> f64 {
    metric(
        text,
        "kvroute_requests_outcome_total",
        &format!("outcome=\"{outcome}\""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_breaks_off_is_an_upstream_reset_not_a_success() {
    const CHUNK: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
    let url = raw_stub(200, "text/event-stream", &[CHUNK], Then::Reset).await;
    let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
    let response = p
        .send("POST", "/v1/completions", Some(stream_request("hi")))
        .await;
    assert_eq!(response.status(), 200);
    let read = response.into_body().collect().await;
    assert!(read.is_err(), "the client sees the stream break off");
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "upstream_reset"), 1.0, "{text}");
    assert_eq!(outcome(&text, "ok"), 0.0);
    assert_eq!(
        metric(&text, "dynamo_frontend_requests_total", "status=\"success\""),
        0.0,
        "a broken stream is not a success"
    );
    assert_eq!(
        metric(&text, "dynamo_frontend_requests_total", "status=\"error\""),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_is_a_timeout_and_an_error_answer_an_upstream_error() {
    const CHUNK: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
    let silent = raw_stub(200, "text/event-stream", &[CHUNK], Then::Hang).await;
    let p = proxy(vec![WorkerConfig::new(silent)], Vec::new(), |c| {
        c.request_timeout_ms = 300
    })
    .await;
    let response = p
        .send("POST", "/v1/completions", Some(stream_request("hi")))
        .await;
    assert!(response.into_body().collect().await.is_err());
    assert_eq!(outcome(&p.metrics().await, "timeout"), 1.0);

    let failing = raw_stub(
        500,
        "application/json",
        &["{\"error\":{\"message\":\"boom\"}}"],
        Then::End,
    )
    .await;
    let p = proxy(vec![WorkerConfig::new(failing)], Vec::new(), |_| {}).await;
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 500);
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "upstream_error"), 1.0, "{text}");
    assert_eq!(
        metric(&text, "dynamo_frontend_requests_total", "status=\"success\""),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_is_counted_as_cancelled() {
    const CHUNK: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
    let url = raw_stub(200, "text/event-stream", &[CHUNK], Then::Trickle).await;
    let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
    let response = p
        .send("POST", "/v1/completions", Some(stream_request("hi")))
        .await;
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    drop(body);
    // The proxy learns the client left when its next write fails.
    p.wait_for_metric(
        "kvroute_requests_outcome_total",
        "outcome=\"client_cancelled\"",
        1.0,
    )
    .await;
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "ok"), 0.0);
    let idle = |s: &kvroute_proxy::Shared| s.snapshot().active_now == 0;
    assert!(
        p.proxy.shared.wait_until(PATIENCE, idle).await,
        "the request's load was freed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_without_cached_tokens_and_no_usage_are_kept_apart_from_reported_counts() {
    // (the worker's unary body, the report it counts as)
    let cases: [(&'static [&'static str], &str); 2] = [
        (
            &["{\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1,\"total_tokens\":3}}"],
            "absent",
        ),
        (&["{\"choices\":[]}"], "no_usage"),
    ];
    for (body, report) in cases {
        let url = raw_stub(200, "application/json", body, Then::End).await;
        let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
        let (status, _, _) = p
            .call(
                "POST",
                "/v1/completions",
                Some(json!({"model": "tiny", "prompt": "hi"})),
            )
            .await;
        assert_eq!(status, 200);
        p.wait_for_metric(
            "kvroute_worker_cached_token_reports_total",
            &format!("report=\"{report}\""),
            1.0,
        )
        .await;
        let text = p.metrics().await;
        assert_eq!(outcome(&text, "ok"), 1.0);
        assert_eq!(
            metric(
                &text,
                "kvroute_worker_cached_token_reports_total",
                "report=\"reported\""
            ),
            0.0
        );
        assert_eq!(
            metric(&text, "kvroute_worker_reported_cached_tokens_total", ""),
            0.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_and_reported_cached_tokens_agree_on_a_repeated_prompt() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |c| {
        c.debug_headers = true
    })
    .await;
    let prompt = long_prompt('k');
    // First: nothing cached. A stream whose client did not ask for usage gets none.
    let (status, headers, body) = p
        .call("POST", "/v1/completions", Some(stream_request(&prompt)))
        .await;
    assert_eq!(status, 200);
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(
        !body.contains("\"usage\""),
        "the usage chunk the proxy asked for is taken out: {body}"
    );
    assert_eq!(headers["x-kvroute-worker"], "0");
    assert_eq!(headers["x-kvroute-predicted-cached-tokens"], "0");
    p.wait_for_cached_blocks(Some(0), 12).await;
    // Again, asking for usage: the router predicts the engine's hits, and the engine says so.
    let mut again = stream_request(&prompt);
    again["stream_options"] = json!({"include_usage": true});
    let (_, headers, body) = p.call("POST", "/v1/completions", Some(again)).await;
    // 12 blocks of 16, within the engine's ceiling of 199 tokens.
    assert_eq!(headers["x-kvroute-predicted-cached-tokens"], "192");
    let usage: Completion = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Completion>(l).ok())
        .find(|c| c.usage.is_some())
        .expect("the client asked for usage and got it");
    assert_eq!(usage.usage.unwrap().cached_tokens(), 192);
    // Unary, a third time.
    let (_, headers, _) = p
        .call(
            "POST",
            "/v1/completions",
            Some(json!({"model": "tiny", "prompt": prompt, "max_tokens": 2})),
        )
        .await;
    assert_eq!(headers["x-kvroute-predicted-cached-tokens"], "192");
    p.wait_for_metric(
        "kvroute_worker_cached_token_reports_total",
        "report=\"reported\"",
        3.0,
    )
    .await;
    let text = p.metrics().await;
    let labels = "dp_rank=\"0\",worker_id=\"0\"";
    assert_eq!(
        metric(&text, "kvroute_worker_predicted_cached_tokens_total", labels),
        384.0
    );
    assert_eq!(
        metric(&text, "kvroute_worker_reported_cached_tokens_total", labels),
        384.0
    );
    assert_eq!(outcome(&text, "ok"), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_headers_are_off_by_default() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |_| {}).await;
    let (status, headers, _) = p.complete("hi").await;
    assert_eq!(status, 200);
    assert!(headers.get("x-kvroute-worker").is_none());
    assert!(headers.get("x-kvroute-predicted-cached-tokens").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_series_stay_at_zero_out_of_routing_and_go_when_it_is_removed() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(2)).await, |_| {}).await;
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 200);
    let (status, _, _) = p.call("POST", "/admin/workers/1/drain", None).await;
    assert_eq!(status, 200);
    p.wait_for_state(1, StateName::Drained).await;
    let text = p.metrics().await;
    let worker = "worker_id=\"1\"";
    for name in [
        "kvroute_worker_active_requests",
        "kvroute_worker_cached_blocks",
        "dynamo_frontend_worker_active_decode_blocks",
        "kvroute_worker_predicted_cached_tokens_total",
        "kvroute_worker_reported_cached_tokens_total",
        "kvroute_worker_up",
    ] {
        assert!(
            has_series(&text, name, worker),
            "{name} of a drained worker is gone:\n{text}"
        );
    }
    assert_eq!(metric(&text, "kvroute_worker_active_requests", worker), 0.0);
    assert_eq!(metric(&text, "kvroute_worker_up", worker), 0.0);
    let (status, _, _) = p.call("DELETE", "/admin/workers/1", None).await;
    assert_eq!(status, 200);
    let text = p.metrics().await;
    assert!(
        !text.contains(worker),
        "a removed worker's series are gone:\n{text}"
    );
    assert!(has_series(
        &text,
        "kvroute_worker_active_requests",
        "worker_id=\"0\""
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serving_another_model_is_misconfigured_and_out_of_routing() {
    let mut mc = MockConfig::new(1);
    mc.model_name = "llama".into();
    let p = proxy(Vec::new(), start_mocks(&mc).await, |_| {}).await;
    p.wait_for_state(0, StateName::Misconfigured).await;
    let (_, _, listing) = p.call("GET", "/admin/workers", None).await;
    let listing: Value = serde_json::from_str(&listing).unwrap();
    assert_eq!(
        listing["workers"][0]["misconfigured"]["model"],
        "model `tiny` not served; it serves [\"llama\"]"
    );
    assert_eq!(listing["workers"][0]["routable"], false);
    let text = p.metrics().await;
    assert_eq!(
        metric(
            &text,
            "kvroute_worker_misconfigured",
            "check=\"model\",worker_id=\"0\""
        ),
        1.0
    );
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 503, "no worker serves the model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_events_have_another_block_size_is_misconfigured() {
    let mut mc = MockConfig::new(1);
    mc.engine.block_size = 32;
    let p = proxy(Vec::new(), start_mocks(&mc).await, |_| {}).await;
    assert_eq!(p.block_size(), 16);
    // Routable until its first events say otherwise.
    let (status, _, _) = p
        .call(
            "POST",
            "/v1/completions",
            Some(json!({"model": "tiny", "prompt": long_prompt('b'), "max_tokens": 2})),
        )
        .await;
    assert_eq!(status, 200);
    p.wait_for_state(0, StateName::Misconfigured).await;
    let status = &p.proxy.shared.worker_statuses()[0];
    assert_eq!(
        status.misconfigured.values().next().map(String::as_str),
        Some("its KV events have blocks of 32 tokens, the router's block size is 16")
    );
    let text = p.metrics().await;
    assert_eq!(
        metric(&text, "kvroute_worker_misconfigured", "check=\"block_size\""),
        1.0
    );
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 503);
}

impl Proxy {
    fn block_size(&self) -> u32 {
        self.proxy.shared.config.block_size
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_openais_404_and_models_have_their_own_route() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |_| {}).await;
    let expected = json!({"error": {
        "message": "The model `gpt-9` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": null, "code": "model_not_found"}});
    for (method, path, body) in [
        (
            "POST",
            "/v1/completions",
            Some(json!({"model": "gpt-9", "prompt": "hi"})),
        ),
        (
            "POST",
            "/v1/chat/completions",
            Some(json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}], "stream": true})),
        ),
        ("GET", "/v1/models/gpt-9", None),
    ] {
        let (status, _, body) = p.call(method, path, body).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), expected, "{path}");
        serde_json::from_str::<ErrorResponse>(&body).unwrap();
    }
    let (status, _, body) = p.call("GET", "/v1/models/tiny", None).await;
    assert_eq!(status, 200);
    let card: ModelCard = serde_json::from_str(&body).unwrap();
    assert_eq!(card.id, "tiny");
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "bad_request"), 2.0);
}

/// A child process of ours, killed when dropped, whose stderr lines arrive on a channel.
struct Child {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Child {
    fn spawn(args: &[&str]) -> Self {
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
    fn wait_for<T>(&self, mut pick: impl FnMut(&str) -> Option<T>) -> T {
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

#[test]
fn serve_refuses_to_start_without_a_tokenizer() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--worker", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--model-dir"), "{stderr}");
    assert!(stderr.contains("--approximate-tokenizer"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serve_command_mock_prints_works_as_printed() {
    let mock = Child::spawn(&["mock", "--workers", "2", "--port", "0", "--event-port", "0"]);
    let command = mock.wait_for(|l| {
        l.trim_start()
            .starts_with("kvroute serve")
            .then(|| l.trim().to_owned())
    });
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(words[..2], ["kvroute", "serve"]);
    // The printed command, on free ports.
    let mut args = words[1..].to_vec();
    args.extend(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]);
    let serve = Child::spawn(&args);
    // "kvroute serve: listening on URL; admin API on URL"
    let url = serve.wait_for(|l| {
        let rest = l.split("listening on ").nth(1)?;
        Some(rest.split(';').next().unwrap_or(rest).trim().to_owned())
    });
    let p = Remote {
        url,
        http: client(Duration::from_secs(5)),
    };
    let body = json!({"model": "tiny", "prompt": long_prompt('m'), "max_tokens": 2});
    let (status, first) = p.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{first}");
    // The prompt's blocks reach the router through the mock's events.
    let deadline = Instant::now() + PATIENCE;
    while metric(&p.get("/metrics").await, "kvroute_worker_cached_blocks", "") < 12.0 {
        assert!(
            Instant::now() < deadline,
            "the mock's events never reached the router"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, again) = p.post("/v1/completions", &body).await;
    let again: Completion = serde_json::from_str(&again).unwrap();
    assert_eq!(
        again.usage.unwrap().cached_tokens(),
        192,
        "the repeated prompt hits the cache"
    );
    let text = p.get("/metrics").await;
    assert_eq!(
        metric(&text, "kvroute_worker_predicted_cached_tokens_total", ""),
        192.0
    );
    let (status, _) = p
        .post("/v1/completions", &json!({"model": "nope", "prompt": "hi"}))
        .await;
    assert_eq!(status, 404);
}

/// A proxy in another process.
struct Remote {
    url: String,
    http: HttpClient,
}

impl Remote {
    async fn post(&self, path: &str, body: &Value) -> (u16, String) {
        let request = hyper::Request::post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
            .unwrap();
        let response = self.http.request(request).await.unwrap();
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    async fn get(&self, path: &str) -> String {
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
fn serve_a_worker_nobody_serves() -> (Child, String) {
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

#[test]
fn a_worker_nobody_serves_is_said_in_the_log() {
    let (serve, worker) = serve_a_worker_nobody_serves();
    let line = serve.wait_for(|l| l.contains("does not answer").then(|| l.to_owned()));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains(&worker), "the line names the worker: {line}");
}

/// A text log written to a pipe (or a file) carries no ANSI colour codes: its lines read as
/// plain text, the level a word.
#[test]
fn a_text_log_to_a_pipe_has_no_colour_codes() {
    let (serve, _) = serve_a_worker_nobody_serves();
    // Every line up to a warning through the log (the worker nobody serves).
    let mut lines = Vec::new();
    serve.wait_for(|l| {
        lines.push(l.to_owned());
        l.contains("does not answer").then_some(())
    });
    let warning = lines.last().unwrap();
    assert!(
        warning.contains(" WARN "),
        "the level is a plain word: {warning:?}"
    );
    for line in &lines {
        assert!(!line.contains('\x1b'), "an escape code in {line:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampling_field_of_the_wrong_type_is_a_400_in_openais_shape() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |_| {}).await;
    for (field, value) in [("temperature", json!("hot")), ("top_p", json!(3))] {
        let mut body = json!({"model": "tiny", "prompt": "hi"});
        body[field] = value;
        let (status, _, body) = p.call("POST", "/v1/completions", Some(body)).await;
        assert_eq!(status, 400, "{body}");
        let error = serde_json::from_str::<ErrorResponse>(&body).unwrap().error;
        assert_eq!(error.param.as_deref(), Some(field), "{body}");
        assert_eq!(error.kind, "invalid_request_error");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misconfigured_worker_returns_once_its_checks_pass() {
    use axum::routing::get;
    use std::sync::atomic::{AtomicBool, Ordering};
    // A worker whose served model the test switches; its /health passes.
    let serves_tiny = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&serves_tiny);
    let routes = axum::Router::new()
        .route(
            "/v1/models",
            get(move || {
                let name = if flag.load(Ordering::SeqCst) {
                    "tiny"
                } else {
                    "other"
                };
                async move { axum::Json(kvroute_http::openai::types::ModelList::one(name, "stub")) }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
    let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |c| {
        c.health_interval_ms = 50
    })
    .await;
    p.wait_for_state(0, StateName::Misconfigured).await;
    serves_tiny.store(true, Ordering::SeqCst);
    // Its next passing health check runs the checks again.
    p.wait_for_state(0, StateName::Ready).await;
    assert!(p.proxy.shared.worker_statuses()[0].misconfigured.is_empty());
    let text = p.metrics().await;
    assert_eq!(
        metric(&text, "kvroute_worker_misconfigured", "check=\"model\""),
        0.0
    );
}

/// The `data:` events of an SSE body, each as JSON (`[DONE]` as the string "[DONE]").
fn sse_events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap_or_else(|_| Value::String(d.to_owned())))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_streams_chunk_for_chunk_as_vllm_does() {
    let mut mc = MockConfig::new(1);
    mc.engine.speedup = 20.0;
    let workers = start_mocks(&mc).await;
    let http = client(Duration::from_secs(5));
    let post = |path: &'static str, body: Value| {
        let request = hyper::Request::post(format!("{}{path}", workers[0].url()))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
            .unwrap();
        let http = http.clone();
        async move {
            let response = http.request(request).await.unwrap();
            assert_eq!(response.status(), 200);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            sse_events(&String::from_utf8_lossy(&body))
        }
    };
    let usage = json!({"include_usage": true});
    // Completions: one chunk per token, the finish reason in the last one's choice, then the
    // usage chunk (no choices), then [DONE] (vLLM 0.32's serving_completion.py).
    let events = post(
        "/v1/completions",
        json!({"prompt": "once upon", "max_tokens": 3, "stream": true, "stream_options": usage}),
    )
    .await;
    assert_eq!(events.len(), 5, "{events:?}");
    for (i, e) in events[..3].iter().enumerate() {
        let choice = &e["choices"][0];
        assert_eq!(choice["text"].as_str().unwrap().len(), 1, "{e}");
        let finish = if i == 2 { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], finish, "{e}");
        assert!(e["usage"].is_null(), "{e}");
    }
    assert_eq!(events[3]["choices"], json!([]), "{:?}", events[3]);
    assert_eq!(events[3]["usage"]["completion_tokens"], 3);
    assert_eq!(events[4], "[DONE]");
    // Chat: first the role with empty content, then one chunk per token, the finish reason in
    // the last, then usage and [DONE] (serving_chat.py); without include_usage, no usage.
    let messages = json!([{"role": "user", "content": "hi"}]);
    let events = post(
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 3, "stream": true, "stream_options": usage}),
    )
    .await;
    assert_eq!(events.len(), 6, "{events:?}");
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(events[0]["choices"][0]["finish_reason"].is_null());
    for (i, e) in events[1..4].iter().enumerate() {
        let choice = &e["choices"][0];
        assert_eq!(choice["delta"]["content"].as_str().unwrap().len(), 1, "{e}");
        assert!(choice["delta"]["role"].is_null(), "{e}");
        let finish = if i == 2 { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], finish, "{e}");
    }
    assert_eq!(events[4]["choices"], json!([]));
    assert_eq!(events[4]["usage"]["completion_tokens"], 3);
    assert_eq!(events[5], "[DONE]");
    let events = post(
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(events.iter().all(|e| e.get("usage").is_none_or(Value::is_null)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_stream_shapes_count_as_ok_and_their_cached_tokens_are_read() {
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"total_tokens\":42,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";
    // (endpoint, the engine's chunks): vLLM 0.32's shape (the finish reason in the last content
    // chunk; a chat's role first, with empty content) and the older one (a separate empty
    // finishing chunk).
    let cases: [(&str, &'static [&'static str]); 4] = [
        (
            "/v1/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
        (
            "/v1/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
        (
            "/v1/chat/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"},\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
        (
            "/v1/chat/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"a\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
    ];
    for (path, chunks) in cases {
        let url = raw_stub(200, "text/event-stream", chunks, Then::End).await;
        let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
        let body = if path == "/v1/completions" {
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": true})
        } else {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true})
        };
        let (status, _, out) = p.call("POST", path, Some(body)).await;
        assert_eq!(status, 200, "{path}: {out}");
        let events = sse_events(&out);
        assert_eq!(events.last(), Some(&json!("[DONE]")), "{path}: {out}");
        // The client did not ask for usage: the chunk the proxy asked for is taken out.
        assert!(!out.contains("\"usage\""), "{path}: {out}");
        assert_eq!(events.len(), chunks.len() - 1, "{path}: {out}");
        p.wait_for_metric("kvroute_worker_reported_cached_tokens_total", "", 32.0)
            .await;
        let text = p.metrics().await;
        assert_eq!(outcome(&text, "ok"), 1.0, "{path}: {text}");
        assert_eq!(
            metric(
                &text,
                "kvroute_worker_cached_token_reports_total",
                "report=\"reported\""
            ),
            1.0,
            "{path}"
        );
    }
}
