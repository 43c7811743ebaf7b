//! The end-to-end harness the `e2e*.rs` test files share: a proxy in front of mock workers
//! (`kvroute serve` and `kvroute mock` in-process, on loopback), a held upstream stub, a raw
//! HTTP client and a third-party OpenAI client's requests. Included with `#[path]`.

#![allow(dead_code, unused_imports)]

#[path = "gauges.rs"]
pub mod gauges;
#[path = "stub.rs"]
pub mod stub;

pub use std::sync::Arc;
pub use std::time::Duration;

pub use async_openai::Client;
pub use async_openai::config::OpenAIConfig;
pub use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequest, CreateChatCompletionRequestArgs,
};
pub use async_openai::types::completions::{CreateCompletionRequest, CreateCompletionRequestArgs};
pub use futures_util::StreamExt;
pub use kvroute_http::Model;
pub use kvroute_http::openai::types::{Completion, ErrorBody, ErrorResponse, ModelList};
pub use kvroute_mock::{self as mock, MockConfig, MockWorker};
pub use kvroute_proxy::worker::StateName;
pub use kvroute_proxy::{EngineKind, ProxyHandle, ServeConfig, WorkerConfig};
pub use serde_json::{Value, json};

pub use kvroute_testkit::PATIENCE;

pub struct Cluster {
    pub proxy: ProxyHandle,
    pub mocks: Vec<MockWorker>,
    pub http: reqwest_lite::Http,
    /// The admin API, on its own listener.
    pub admin: reqwest_lite::Http,
}

/// Starts `n` mock workers (engine `speedup`) and a proxy in front of them, with `tweak` applied
/// to the proxy's configuration.
pub async fn cluster(n: usize, speedup: f64, tweak: impl FnOnce(&mut ServeConfig)) -> Cluster {
    let mut mc = MockConfig::new(n);
    mc.engine.speedup = speedup;
    cluster_of(mc, tweak).await
}

pub async fn cluster_of(mc: MockConfig, tweak: impl FnOnce(&mut ServeConfig)) -> Cluster {
    fronting(Vec::new(), start_mocks(&mc).await, tweak).await
}

/// Starts the mock workers `mc` describes, serving the tiny model.
pub async fn start_mocks(mc: &MockConfig) -> Vec<MockWorker> {
    mock::start(mc, Arc::new(Model::tiny().unwrap())).await.unwrap()
}

/// A proxy in front of `workers` (stubs), then `mocks`, with `tweak` applied to its
/// configuration.
pub async fn fronting(
    workers: Vec<WorkerConfig>,
    mocks: Vec<MockWorker>,
    tweak: impl FnOnce(&mut ServeConfig),
) -> Cluster {
    let model = Arc::new(Model::tiny().unwrap());
    let mut config = ServeConfig {
        server: kvroute_proxy::config::ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..Default::default()
        },
        upstream: kvroute_proxy::config::UpstreamConfig {
            health_interval_ms: 200,
            ..Default::default()
        },
        workers: workers
            .into_iter()
            .chain(
                mocks
                    .iter()
                    .map(|m| WorkerConfig::parse_flag(&m.worker_flag()).unwrap()),
            )
            .collect(),
        ..ServeConfig::default()
    };
    tweak(&mut config);
    // No pause for the subscribers to connect: batches they miss at first come back through
    // replay, which the tests below then exercise as well.
    let proxy = kvroute_proxy::start(config, Some(model)).await.unwrap();
    Cluster {
        http: reqwest_lite::Http::new(proxy.url()),
        admin: reqwest_lite::Http::new(proxy.admin_url()),
        proxy,
        mocks,
    }
}

impl Cluster {
    pub fn client(&self) -> Client<OpenAIConfig> {
        Client::with_config(
            OpenAIConfig::new()
                .with_api_base(format!("{}/v1", self.proxy.url()))
                .with_api_key("unused"),
        )
    }

    /// Waits until the router books no request, then checks its invariants. Woken by each
    /// change the proxy reports (a request ending among them), not by a timer.
    pub async fn assert_drained(&self) {
        let idle = |s: &kvroute_proxy::Driver| {
            let m = s.snapshot();
            let booked: u64 = m.workers.iter().map(|w| u64::from(w.load.requests)).sum();
            m.active_now == 0 && m.queued_now == 0 && booked == 0
        };
        let drained = self.proxy.driver.wait_until(PATIENCE, idle).await;
        let m = self.proxy.driver.snapshot();
        assert!(
            drained,
            "load leaked: {} active, {} queued",
            m.active_now, m.queued_now
        );
        self.proxy.driver.check_invariants().unwrap();
        // And what an operator reads says so: every worker's booked requests, blocks and
        // prefill tokens at zero.
        let metrics = self.http.get("/metrics").await;
        assert_eq!(gauges::idle_mismatch(&metrics), None);
    }

    /// Waits until the gauges of `/metrics` equal `in_flight` (worker id → requests in flight
    /// there; [`gauges::mismatch`]), polled under a generous deadline.
    pub async fn until_gauges_are(&self, in_flight: &[(u64, u64)]) {
        let deadline = std::time::Instant::now() + PATIENCE;
        loop {
            let Some(wrong) = gauges::mismatch(&self.http.get("/metrics").await, in_flight) else {
                return;
            };
            assert!(
                std::time::Instant::now() < deadline,
                "the gauges never became {in_flight:?}: {wrong}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until worker `id` is in `state`, as the proxy's registry reports it.
    pub async fn wait_for_state(&self, id: usize, state: StateName) {
        let reached =
            |s: &kvroute_proxy::Driver| s.worker_statuses().get(id).is_some_and(|w| w.state == state);
        let arrived = self.proxy.driver.wait_until(PATIENCE, reached).await;
        assert!(
            arrived,
            "worker {id} never became {state:?}: {:?}",
            self.proxy.driver.worker_statuses()
        );
    }

    /// A raw `/v1/completions` request that must succeed; its answer.
    pub async fn complete(&self, body: Value) -> Completion {
        let (status, _, out) = self
            .http
            .request("POST", "/v1/completions", serde_json::to_vec(&body).unwrap())
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        completion(&out)
    }

    /// Waits until the router's index holds at least `blocks` blocks of worker `only` (or of
    /// any worker), and returns that worker's index. Woken by each KV-event report the proxy
    /// applies, not by a timer.
    pub async fn wait_for_cached_blocks(&self, only: Option<usize>, blocks: u64) -> usize {
        let held =
            |cached: &[u64]| (0..cached.len()).find(|&i| only.is_none_or(|o| o == i) && cached[i] >= blocks);
        let arrived = self
            .proxy
            .driver
            .wait_for_kv(PATIENCE, |_| held(&self.cached_blocks()).is_some())
            .await;
        let cached = self.cached_blocks();
        assert!(arrived, "the events never arrived: {cached:?}");
        held(&cached).unwrap()
    }

    /// Blocks the router's index holds for each worker, by worker id.
    pub fn cached_blocks(&self) -> Vec<u64> {
        self.proxy
            .driver
            .snapshot()
            .workers
            .iter()
            .map(|w| w.cached_blocks)
            .collect()
    }
}

/// A tiny HTTP/1.1 client over the crate's own pooled client, for raw requests and metrics.
pub mod reqwest_lite {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use kvroute_http::net::{HttpClient, client};

    pub struct Http {
        base: String,
        client: HttpClient,
    }

    impl Http {
        pub fn new(base: String) -> Self {
            Self {
                base,
                client: client(std::time::Duration::from_secs(2)),
            }
        }

        pub async fn request(
            &self,
            method: &str,
            path: &str,
            body: Vec<u8>,
        ) -> (u16, Option<String>, Vec<u8>) {
            let req = hyper::Request::builder()
                .method(method)
                .uri(format!("{}{path}", self.base))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .unwrap();
            let resp = self.client.request(req).await.unwrap();
            let status = resp.status().as_u16();
            let retry = resp
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_owned());
            let body = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
            (status, retry, body)
        }

        pub async fn get(&self, path: &str) -> String {
            String::from_utf8(self.request("GET", path, Vec::new()).await.2).unwrap()
        }
    }
}

/// An upstream stub that holds each generation request until the test lets it answer: the
/// test learns of each arrival (its body), and each permit it releases lets one request
/// answer, with a short completion. Its `/health` passes.
pub struct Held {
    pub url: String,
    pub arrivals: tokio::sync::mpsc::UnboundedReceiver<Value>,
    pub release: Arc<tokio::sync::Semaphore>,
}

impl Held {
    pub async fn start() -> Self {
        use axum::routing::{get, post};
        use kvroute_http::openai::types::{CompletionChoice, FinishReason, Object, Usage};
        let (tx, arrivals) = tokio::sync::mpsc::unbounded_channel();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let gate = Arc::clone(&release);
        let answer = move |body: bytes::Bytes| async move {
            tx.send(serde_json::from_slice(&body).unwrap()).unwrap();
            gate.acquire().await.unwrap().forget();
            axum::Json(stub::completion("cmpl-held", Some(Usage::new(1, 1, 0))))
        };
        let routes = axum::Router::new()
            .route("/v1/completions", post(answer))
            .route("/health", get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
        Self {
            url,
            arrivals,
            release,
        }
    }

    /// The body of the next request to arrive.
    pub async fn arrived(&mut self) -> Value {
        tokio::time::timeout(PATIENCE, self.arrivals.recv())
            .await
            .expect("no request arrived")
            .unwrap()
    }

    /// Lets `n` held (or future) requests answer.
    pub fn release(&self, n: usize) {
        self.release.add_permits(n);
    }
}

/// A completion response body.
pub fn completion(body: &[u8]) -> Completion {
    serde_json::from_slice(body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
}

/// The completion tokens of a completion response body.
pub fn completion_tokens(body: &[u8]) -> u32 {
    completion(body).usage.unwrap().completion_tokens
}

/// An OpenAI error response body's error.
pub fn error(body: &[u8]) -> ErrorBody {
    serde_json::from_slice::<ErrorResponse>(body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
        .error
}

/// A metric's value from a Prometheus text exposition (the sum over matching lines).
pub fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next() == Some(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A chat request for the tiny model: one user message, `max_tokens` tokens.
pub fn chat_request(content: &str, max_tokens: u32) -> CreateChatCompletionRequest {
    CreateChatCompletionRequestArgs::default()
        .model("tiny")
        .max_tokens(max_tokens)
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content(content)
            .build()
            .unwrap()
            .into()])
        .build()
        .unwrap()
}

/// A completion request for the tiny model.
pub fn completion_request(prompt: &str, max_tokens: u32) -> CreateCompletionRequest {
    CreateCompletionRequestArgs::default()
        .model("tiny")
        .prompt(prompt)
        .max_tokens(max_tokens)
        .build()
        .unwrap()
}

/// Streams `chat` and returns the text and the number of chunks.
pub async fn stream_chat(
    client: &Client<OpenAIConfig>,
    chat: CreateChatCompletionRequest,
) -> (String, usize) {
    let mut stream = client.chat().create_stream(chat).await.unwrap();
    let (mut text, mut chunks) = (String::new(), 0);
    while let Some(chunk) = stream.next().await {
        for choice in chunk.unwrap().choices {
            text.push_str(choice.delta.content.as_deref().unwrap_or(""));
        }
        chunks += 1;
    }
    (text, chunks)
}

/// Streams `completion` and returns the text.
pub async fn stream_completion(client: &Client<OpenAIConfig>, completion: CreateCompletionRequest) -> String {
    let mut stream = client.completions().create_stream(completion).await.unwrap();
    let mut text = String::new();
    while let Some(chunk) = stream.next().await {
        for choice in chunk.unwrap().choices {
            text.push_str(&choice.text);
        }
    }
    text
}

/// `kvroute mock` (the built binary) as a `process` actuator's worker: its command, with `extra`
/// arguments, and its worker line.
pub fn mock_template(extra: &[&str]) -> kvroute_proxy::autoscale::actuator::WorkerTemplate {
    let mut command: Vec<String> = [
        env!("CARGO_BIN_EXE_kvroute"),
        "mock",
        "--workers",
        "1",
        "--port",
        "{port}",
        "--event-port",
        "{events_port}",
        "--model-name",
        "{model}",
    ]
    .map(str::to_owned)
    .to_vec();
    command.extend(extra.iter().map(|&a| a.to_owned()));
    kvroute_proxy::autoscale::actuator::WorkerTemplate {
        command,
        worker: "http://127.0.0.1:{port},events=tcp://127.0.0.1:{events_port},replay=tcp://127.0.0.1:{replay_port}"
            .to_owned(),
    }
}
