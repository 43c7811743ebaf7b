//! End to end on loopback: a real third-party OpenAI client (`async-openai`) against `kvroute
//! serve` in front of mock workers that run the simulated engine and publish KV events over ZMQ.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/gauges.rs"]
mod gauges;

use std::sync::Arc;
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequest, CreateChatCompletionRequestArgs,
};
use async_openai::types::completions::{CreateCompletionRequest, CreateCompletionRequestArgs};
use futures_util::StreamExt;
use kvroute_http::Model;
use kvroute_http::openai::types::{Completion, ErrorBody, ErrorResponse, ModelList};
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::worker::StateName;
use kvroute_proxy::{EngineKind, ProxyHandle, ServeConfig, WorkerConfig};
use serde_json::{Value, json};

/// Generous: only reached when a test is failing.
const PATIENCE: Duration = Duration::from_secs(30);

struct Cluster {
    proxy: ProxyHandle,
    mocks: Vec<MockWorker>,
    http: reqwest_lite::Http,
    /// The admin API, on its own listener.
    admin: reqwest_lite::Http,
}

/// Starts `n` mock workers (engine `speedup`) and a proxy in front of them, with `tweak` applied
/// to the proxy's configuration.
async fn cluster(n: usize, speedup: f64, tweak: impl FnOnce(&mut ServeConfig)) -> Cluster {
    let mut mc = MockConfig::new(n);
    mc.engine.speedup = speedup;
    cluster_of(mc, tweak).await
}

async fn cluster_of(mc: MockConfig, tweak: impl FnOnce(&mut ServeConfig)) -> Cluster {
    let mocks = mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap();
    fronting(Vec::new(), mocks, tweak).await
}

/// A proxy in front of `workers` (stubs), then `mocks`, with `tweak` applied to its
/// configuration.
async fn fronting(
    workers: Vec<WorkerConfig>,
    mocks: Vec<MockWorker>,
    tweak: impl FnOnce(&mut ServeConfig),
) -> Cluster {
    let model = Arc::new(Model::tiny().unwrap());
    let mut config = ServeConfig {
        listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        health_interval_ms: 200,
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
    fn client(&self) -> Client<OpenAIConfig> {
        Client::with_config(
            OpenAIConfig::new()
                .with_api_base(format!("{}/v1", self.proxy.url()))
                .with_api_key("unused"),
        )
    }

    /// Waits until the router books no request, then checks its invariants. Woken by each
    /// change the proxy reports (a request ending among them), not by a timer.
    async fn assert_drained(&self) {
        let idle = |s: &kvroute_proxy::Shared| {
            let m = s.snapshot();
            let booked: u64 = m.workers.iter().map(|w| u64::from(w.load.requests)).sum();
            m.active_now == 0 && m.queued_now == 0 && booked == 0
        };
        let drained = self.proxy.shared.wait_until(PATIENCE, idle).await;
        let m = self.proxy.shared.snapshot();
        assert!(
            drained,
            "load leaked: {} active, {} queued",
            m.active_now, m.queued_now
        );
        self.proxy.shared.check_invariants().unwrap();
        // And what an operator reads says so: every worker's booked requests, blocks and
        // prefill tokens at zero.
        let metrics = self.http.get("/metrics").await;
        assert_eq!(gauges::idle_mismatch(&metrics), None);
    }

    /// Waits until the gauges of `/metrics` equal `in_flight` (worker id → requests in flight
    /// there; [`gauges::mismatch`]), polled under a generous deadline.
    async fn until_gauges_are(&self, in_flight: &[(u64, u64)]) {
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
    async fn wait_for_state(&self, id: usize, state: StateName) {
        let reached = |s: &kvroute_proxy::Shared| s.worker_statuses()[id].state == state;
        let arrived = self.proxy.shared.wait_until(PATIENCE, reached).await;
        assert!(arrived, "worker {id} never became {state:?}");
    }

    /// A raw `/v1/completions` request that must succeed; its answer.
    async fn complete(&self, body: Value) -> Completion {
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
    async fn wait_for_cached_blocks(&self, only: Option<usize>, blocks: u64) -> usize {
        let held =
            |cached: &[u64]| (0..cached.len()).find(|&i| only.is_none_or(|o| o == i) && cached[i] >= blocks);
        let arrived = self
            .proxy
            .shared
            .wait_for_kv(PATIENCE, |_| held(&self.cached_blocks()).is_some())
            .await;
        let cached = self.cached_blocks();
        assert!(arrived, "the events never arrived: {cached:?}");
        held(&cached).unwrap()
    }

    /// Blocks the router's index holds for each worker, by worker id.
    fn cached_blocks(&self) -> Vec<u64> {
        self.proxy
            .shared
            .snapshot()
            .workers
            .iter()
            .map(|w| w.cached_blocks)
            .collect()
    }
}

/// A tiny HTTP/1.1 client over the crate's own pooled client, for raw requests and metrics.
mod reqwest_lite {
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
struct Held {
    url: String,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<Value>,
    release: Arc<tokio::sync::Semaphore>,
}

impl Held {
    async fn start() -> Self {
        use axum::routing::{get, post};
        use kvroute_http::openai::types::{CompletionChoice, FinishReason, Object, Usage};
        let (tx, arrivals) = tokio::sync::mpsc::unbounded_channel();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let gate = Arc::clone(&release);
        let answer = move |body: bytes::Bytes| async move {
            tx.send(serde_json::from_slice(&body).unwrap()).unwrap();
            gate.acquire().await.unwrap().forget();
            axum::Json(Completion {
                id: "cmpl-held".into(),
                object: Object::TextCompletion,
                created: 0,
                model: "tiny".into(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text: "ok".into(),
                    logprobs: None,
                    finish_reason: Some(FinishReason::Stop),
                }],
                usage: Some(Usage::new(1, 1, 0)),
                kv_transfer_params: None,
            })
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
    async fn arrived(&mut self) -> Value {
        tokio::time::timeout(PATIENCE, self.arrivals.recv())
            .await
            .expect("no request arrived")
            .unwrap()
    }

    /// Lets `n` held (or future) requests answer.
    fn release(&self, n: usize) {
        self.release.add_permits(n);
    }
}

/// A completion response body.
fn completion(body: &[u8]) -> Completion {
    serde_json::from_slice(body).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
}

/// The completion tokens of a completion response body.
fn completion_tokens(body: &[u8]) -> u32 {
    completion(body).usage.unwrap().completion_tokens
}

/// An OpenAI error response body's error.
fn error(body: &[u8]) -> ErrorBody {
    serde_json::from_slice::<ErrorResponse>(body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
        .error
}

/// A metric's value from a Prometheus text exposition (the sum over matching lines).
fn metric(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next() == Some(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A chat request for the tiny model: one user message, `max_tokens` tokens.
fn chat_request(content: &str, max_tokens: u32) -> CreateChatCompletionRequest {
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
fn completion_request(prompt: &str, max_tokens: u32) -> CreateCompletionRequest {
    CreateCompletionRequestArgs::default()
        .model("tiny")
        .prompt(prompt)
        .max_tokens(max_tokens)
        .build()
        .unwrap()
}

/// Streams `chat` and returns the text and the number of chunks.
async fn stream_chat(client: &Client<OpenAIConfig>, chat: CreateChatCompletionRequest) -> (String, usize) {
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
async fn stream_completion(client: &Client<OpenAIConfig>, completion: CreateCompletionRequest) -> String {
    let mut stream = client.completions().create_stream(completion).await.unwrap();
    let mut text = String::new();
    while let Some(chunk) = stream.next().await {
        for choice in chunk.unwrap().choices {
            text.push_str(&choice.text);
        }
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_streaming_and_not() {
    let c = cluster(2, 20.0, |_| {}).await;
    let client = c.client();

    let chat = chat_request("Hello there, router.", 8);
    let response = client.chat().create(chat.clone()).await.unwrap();
    let text = response.choices[0].message.content.clone().unwrap();
    assert_eq!(text.len(), 8, "one ASCII letter per generated token: {text:?}");
    let usage = response.usage.unwrap();
    assert_eq!(usage.completion_tokens, 8);
    assert!(usage.prompt_tokens > 20);
    let (streamed, chunks) = stream_chat(&client, chat).await;
    assert_eq!(streamed.len(), 8);
    assert!(chunks >= 8, "tokens arrive as separate chunks ({chunks})");

    let completion = completion_request("Once upon a time", 5);
    let response = client.completions().create(completion.clone()).await.unwrap();
    assert_eq!(response.choices[0].text.len(), 5);
    let usage = response.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (16, 5));
    assert_eq!(stream_completion(&client, completion).await.len(), 5);

    let models: ModelList = serde_json::from_str(&c.http.get("/v1/models").await).unwrap();
    assert_eq!(models, ModelList::one("tiny", "kvroute"));

    let metrics = c.http.get("/metrics").await;
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        4.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_router_time_to_first_token_seconds_count",
            ""
        ) >= 2.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_router_inter_token_latency_seconds_count",
            ""
        ) >= 7.0
    );
    assert!(metric(&metrics, "dynamo_router_overhead_total_ms_count", "") >= 4.0);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_long_prompt_lands_on_the_worker_that_cached_it() {
    let c = cluster(3, 20.0, |_| {}).await;
    let client = c.client();
    // 1,600 bytes: 100 full blocks of 16 tokens with the byte-level tiny tokenizer.
    let prompt: String = (0..1600).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let request = completion_request(&prompt, 2);
    let first = client.completions().create(request.clone()).await.unwrap();
    let cached_first = first
        .usage
        .unwrap()
        .prompt_tokens_details
        .and_then(|d| d.cached_tokens);
    assert_eq!(cached_first.unwrap_or(0), 0);
    // Wait until the stored events reached the router.
    let holder = c.wait_for_cached_blocks(None, 100).await;
    for _ in 0..3 {
        let again = client.completions().create(request.clone()).await.unwrap();
        let cached = again
            .usage
            .unwrap()
            .prompt_tokens_details
            .unwrap()
            .cached_tokens
            .unwrap();
        assert_eq!(
            cached, 1584,
            "every full block but the last (vLLM always computes the last token) came from the cache"
        );
    }
    let blocks = c.cached_blocks();
    assert!(
        blocks.iter().enumerate().all(|(i, &b)| i == holder || b < 100),
        "only the first worker holds the prompt: {blocks:?}"
    );
    let metrics = c.http.get("/metrics").await;
    // The first request was predicted a miss, the next three full hits.
    assert_eq!(
        metric(&metrics, "dynamo_component_router_kv_hit_rate_count", ""),
        4.0
    );
    assert_eq!(
        metric(&metrics, "dynamo_component_router_kv_hit_rate_sum", ""),
        3.0
    );
    assert_eq!(
        metric(
            &metrics,
            "dynamo_component_router_kv_hit_rate_bucket",
            "le=\"0.95\""
        ),
        1.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_kv_cache_events_applied",
            "status=\"ok\""
        ) >= 1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "dynamo_component_kv_cache_events_applied",
            "status=\"parent_block_not_found\""
        ),
        0.0
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_mid_stream_ends_the_request_and_frees_its_load() {
    // Real time: a 2,000-token output takes seconds, time enough to kill the worker.
    let c = cluster(2, 1.0, |_| {}).await;
    let client = c.client();
    let request = completion_request("stream me a long story", 2000);
    let mut stream = client.completions().create_stream(request).await.unwrap();
    // Wait for a few tokens, then find the worker serving it and kill it.
    for _ in 0..3 {
        stream.next().await.unwrap().unwrap();
    }
    let m = c.proxy.shared.snapshot();
    let busy = m.workers.iter().position(|w| w.load.requests == 1).unwrap();
    let other = 1 - busy;
    // A second stream, on the other worker, in flight when the first one's worker dies.
    let mut bystander = client
        .completions()
        .create_stream(completion_request("a bystander's story", 300))
        .await
        .unwrap();
    let mut bystander_text = String::new();
    for choice in bystander.next().await.unwrap().unwrap().choices {
        bystander_text.push_str(&choice.text);
    }
    c.until_gauges_are(&[(busy as u64, 1), (other as u64, 1)]).await;
    c.mocks[busy].kill();
    let mut ended_with_error = false;
    while let Some(chunk) = stream.next().await {
        if chunk.is_err() {
            ended_with_error = true;
            break;
        }
    }
    assert!(ended_with_error, "the stream broke off with an error");
    // Only that request is gone from the books; the bystander is still booked where it runs.
    c.until_gauges_are(&[(other as u64, 1)]).await;
    while let Some(chunk) = bystander.next().await {
        for choice in chunk.expect("the bystander's stream is unharmed").choices {
            bystander_text.push_str(&choice.text);
        }
    }
    assert!(!bystander_text.is_empty());
    c.assert_drained().await;
    // Connect failures retry on the other worker, and the health check takes the dead one out.
    for i in 0..4 {
        let (status, _, body) = c
            .http
            .request(
                "POST",
                "/v1/completions",
                serde_json::to_vec(&json!({"prompt": format!("after {i}"), "max_tokens": 2})).unwrap(),
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    // Out of routing by a failed connect or by failed health checks, whichever comes first.
    c.wait_for_state(busy, StateName::Unhealthy).await;
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    assert_eq!(workers["workers"][busy]["routable"], false);
    assert_eq!(workers["workers"][busy]["state"], "unhealthy");
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_event_batch_is_recovered_through_replay() {
    let c = cluster(1, 20.0, |_| {}).await;
    // The next batch (the prompt's blocks, stored by the prefill pass) is buffered but not sent.
    c.mocks[0].drop_next_event_batches(1);
    let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 5 % 26) as u8)).collect();
    let body = |p: &str| serde_json::to_vec(&json!({"prompt": p, "max_tokens": 40})).unwrap();
    let (status, _, _) = c.http.request("POST", "/v1/completions", body(&prompt)).await;
    assert_eq!(status, 200);
    // Later batches (output blocks filling, the next request) show the gap; the subscriber
    // replays it from the worker's replay socket.
    let (status, _, _) = c
        .http
        .request("POST", "/v1/completions", body("another prompt entirely"))
        .await;
    assert_eq!(status, 200);
    c.wait_for_cached_blocks(Some(0), 20).await;
    let metrics = c.http.get("/metrics").await;
    assert_eq!(
        metric(&metrics, "kvroute_kv_event_stream_incidents_total", "gap_lost"),
        0.0
    );
    assert_eq!(
        metric(
            &metrics,
            "dynamo_component_kv_cache_events_applied",
            "status=\"parent_block_not_found\""
        ),
        0.0,
        "every store found its parent: nothing was missed"
    );
    // And the prompt now routes as a full hit.
    let (_, _, out) = c.http.request("POST", "/v1/completions", body(&prompt)).await;
    assert_eq!(
        completion(&out).usage.unwrap().cached_tokens(),
        304,
        "19 of 20 blocks: the last token is always computed"
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_returns_503_and_nothing_leaks() {
    // One worker that counts as busy past 2 requests, and no queue. It holds its requests until
    // the test releases them, so that the fourth request meets three in flight.
    let mut held = Held::start().await;
    let worker = WorkerConfig {
        max_requests: 2,
        ..WorkerConfig::new(held.url.clone())
    };
    let c = fronting(vec![worker], Vec::new(), |config| {
        config.busy_requests_fraction = Some(1.0);
        config.queue_capacity = 0;
        // Only reached if the test is failing.
        config.request_timeout_ms = PATIENCE.as_millis() as u64;
    })
    .await;
    let body = serde_json::to_vec(&json!({"prompt": "slow", "max_tokens": 30})).unwrap();
    let mut in_flight = Vec::new();
    for _ in 0..3 {
        let http = reqwest_lite::Http::new(c.proxy.url());
        let body = body.clone();
        in_flight.push(tokio::spawn(async move {
            http.request("POST", "/v1/completions", body).await
        }));
        held.arrived().await;
    }
    let (status, retry, out) = c.http.request("POST", "/v1/completions", body.clone()).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&out));
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(error(&out).code_name(), Some("overloaded"));
    held.release(3);
    for t in in_flight {
        let (status, _, out) = t.await.unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    }
    c.assert_drained().await;
    // Capacity is back.
    held.release(1);
    let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    let metrics = c.http.get("/metrics").await;
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"rejected\""),
        1.0
    );
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        4.0
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_json_errors_naming_the_problem() {
    let c = cluster(1, 20.0, |config| {
        config.max_body_bytes = 1000;
        config.max_prompt_tokens = 50;
    })
    .await;
    let cases: &[(&str, &[u8], u16, &str)] = &[
        ("/v1/completions", b"{not json", 400, "body"),
        ("/v1/completions", b"{}", 400, "prompt"),
        ("/v1/completions", br#"{"prompt": [1, -2]}"#, 400, "prompt"),
        (
            "/v1/completions",
            br#"{"prompt": "x", "stream": 3}"#,
            400,
            "stream",
        ),
        ("/v1/chat/completions", br#"{"messages": "hi"}"#, 400, "messages"),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": 5}]}"#,
            400,
            "messages",
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, _, out) = c.http.request("POST", path, body.to_vec()).await;
        assert_eq!(got, *status, "{}", String::from_utf8_lossy(body));
        let err = error(&out);
        assert_eq!(err.param.as_deref(), Some(*param), "{err:?}");
        assert!(err.message.len() > 5);
    }
    let long = serde_json::to_vec(&json!({"prompt": "y".repeat(60)})).unwrap();
    let (got, _, out) = c.http.request("POST", "/v1/completions", long).await;
    assert_eq!(got, 400);
    assert_eq!(error(&out).code_name(), Some("context_length_exceeded"));
    let huge = serde_json::to_vec(&json!({"prompt": "z".repeat(2000)})).unwrap();
    let (got, _, out) = c.http.request("POST", "/v1/completions", huge).await;
    assert_eq!(got, 413);
    assert_eq!(error(&out).code_name(), Some("body_too_large"));
    let (got, _, _) = c.http.request("GET", "/v1/nothing", Vec::new()).await;
    assert_eq!(got, 404);
    // The admin API is not on the inference port.
    for (method, path) in [("GET", "/admin/workers"), ("POST", "/admin/workers/0/drain")] {
        let (got, _, out) = c.http.request(method, path, Vec::new()).await;
        assert_eq!(got, 404, "{method} {path} on the inference port");
        assert_eq!(error(&out).code_name(), Some("not_found"));
    }
    // Admin: draining the only worker would leave nothing to serve: refused (409, with the
    // reason) unless forced.
    let (got, _, out) = c
        .admin
        .request("POST", "/admin/workers/0/drain", Vec::new())
        .await;
    assert_eq!(got, 409, "{}", String::from_utf8_lossy(&out));
    let err = error(&out);
    assert_eq!(err.code_name(), Some("fleet_unservable"), "{err:?}");
    assert!(err.message.contains("no worker"), "{}", err.message);
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    assert_eq!(
        workers["workers"][0]["state"], "ready",
        "refused means not applied"
    );
    // Forced: requests then find no worker (503), and removal works.
    let (got, _, _) = c
        .admin
        .request("POST", "/admin/workers/0/drain?force=true", Vec::new())
        .await;
    assert_eq!(got, 200);
    // Nothing in flight: the drain is complete at once.
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    assert_eq!(workers["workers"][0]["state"], "drained", "{workers}");
    let (got, _, out) = c
        .http
        .request("POST", "/v1/completions", br#"{"prompt": "x"}"#.to_vec())
        .await;
    assert_eq!(got, 503, "{}", String::from_utf8_lossy(&out));
    let (got, _, _) = c.http.request("GET", "/health", Vec::new()).await;
    assert_eq!(got, 503);
    let (got, _, _) = c.admin.request("DELETE", "/admin/workers/0", Vec::new()).await;
    assert_eq!(got, 200);
    let (got, _, _) = c.admin.request("DELETE", "/admin/workers/0", Vec::new()).await;
    assert_eq!(got, 404);
    let add = serde_json::to_vec(&json!({"url": c.mocks[0].url()})).unwrap();
    let (got, _, out) = c.admin.request("POST", "/admin/workers", add).await;
    assert_eq!(got, 201, "{}", String::from_utf8_lossy(&out));
    // A prefill worker without decode workers would make every request fail: refused.
    let prefill = serde_json::to_vec(&json!({"url": "http://127.0.0.1:1", "role": "prefill"})).unwrap();
    let (got, _, out) = c.admin.request("POST", "/admin/workers", prefill).await;
    assert_eq!(got, 409, "{}", String::from_utf8_lossy(&out));
    assert_eq!(error(&out).code_name(), Some("fleet_unservable"));
    let (got, _, _) = c
        .http
        .request(
            "POST",
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": 1}"#.to_vec(),
        )
        .await;
    assert_eq!(got, 200);
    let bad_worker = serde_json::to_vec(&json!({"url": "http://127.0.0.1:1", "colour": "red"})).unwrap();
    let (got, _, _) = c.admin.request("POST", "/admin/workers", bad_worker).await;
    assert_eq!(got, 400);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positional_events_from_older_engines_feed_the_router_too() {
    let mut mc = MockConfig::new(2);
    mc.engine.speedup = 20.0;
    mc.encoding = kvroute_wire::EventEncoding::Positional;
    let c = cluster_of(mc, |_| {}).await;
    let prompt: String = (0..480).map(|i| char::from(b'a' + (i * 11 % 26) as u8)).collect();
    let body = serde_json::to_vec(&json!({"prompt": prompt, "max_tokens": 1})).unwrap();
    let (status, _, _) = c.http.request("POST", "/v1/completions", body.clone()).await;
    assert_eq!(status, 200);
    c.wait_for_cached_blocks(None, 30).await;
    let (_, _, out) = c.http.request("POST", "/v1/completions", body).await;
    assert_eq!(completion(&out).usage.unwrap().cached_tokens(), 464);
    c.assert_drained().await;
}

// ---- prefill/decode disaggregation ----

/// `prefill` prefill workers and `decode` decode workers (engines at `speedup`) behind a proxy.
async fn disagg_cluster(
    prefill: usize,
    decode: usize,
    speedup: f64,
    tweak: impl FnOnce(&mut ServeConfig),
) -> Cluster {
    let mut mc = MockConfig::new(decode);
    mc.prefill_workers = prefill;
    mc.engine.speedup = speedup;
    cluster_of(mc, tweak).await
}

impl Cluster {
    /// The requests of the two-hop flow the mocks saw: (hop 1 on prefill workers, hop 2 on
    /// decode workers).
    fn kv_requests(&self) -> (Vec<mock::SeenKvRequest>, Vec<mock::SeenKvRequest>) {
        let mut hops = (Vec::new(), Vec::new());
        for m in &self.mocks {
            for seen in m.seen_kv_requests() {
                if seen.remote_decode {
                    assert_eq!(m.role.name(), "prefill", "hop 1 went to a prefill worker");
                    hops.0.push(seen);
                } else {
                    assert_eq!(m.role.name(), "decode", "hop 2 went to a decode worker");
                    hops.1.push(seen);
                }
            }
        }
        hops
    }

    /// A metric summed over every mock worker's `/metrics`.
    async fn mock_metric(&self, name: &str) -> f64 {
        let mut sum = 0.0;
        for m in &self.mocks {
            let text = reqwest_lite::Http::new(m.url()).get("/metrics").await;
            sum += metric(&text, name, "");
        }
        sum
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_fleet_serves_chat_and_completions_through_two_hops() {
    // One decode worker, so a repeated prompt finds its blocks there whatever the policy's
    // tie-break (decode workers are chosen by load alone, as in Dynamo's decode pool).
    let c = disagg_cluster(2, 1, 20.0, |_| {}).await;
    let client = c.client();
    let chat = chat_request("Hello there, disaggregated router.", 8);
    let response = client.chat().create(chat.clone()).await.unwrap();
    assert_eq!(response.choices[0].message.content.as_deref().unwrap().len(), 8);
    assert_eq!(response.usage.unwrap().completion_tokens, 8);
    let (streamed, _) = stream_chat(&client, chat).await;
    assert_eq!(streamed.len(), 8, "{streamed:?}");

    // 320 bytes: 20 full blocks of the byte-level tiny tokenizer.
    let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 3 % 26) as u8)).collect();
    let completion = completion_request(&prompt, 5);
    let response = client.completions().create(completion.clone()).await.unwrap();
    assert_eq!(response.choices[0].text.len(), 5);
    let usage = response.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (320, 5));
    let cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
    assert_eq!(
        cached.unwrap_or(0),
        0,
        "nothing was cached on the decode worker yet"
    );
    // The decode worker's import stored the prompt's blocks; a repeat's import finds every
    // block there.
    c.wait_for_cached_blocks(Some(2), 20).await;
    assert_eq!(stream_completion(&client, completion).await.len(), 5);
    // The cached tokens of an import, through the raw API (usage in the stream).
    let out = c
        .complete(json!({"prompt": prompt, "max_tokens": 3, "min_tokens": 3}))
        .await;
    assert_eq!(
        out.usage.unwrap().cached_tokens(),
        320,
        "the decode worker held all 20 blocks: nothing crossed the link"
    );
    assert!(out.kv_transfer_params.is_none());

    // What the workers saw: 5 requests, each hop 1 then hop 2 under one request id.
    let (hop1, hop2) = c.kv_requests();
    assert_eq!((hop1.len(), hop2.len()), (5, 5));
    let ids = |hops: &[mock::SeenKvRequest]| {
        let mut ids: Vec<String> = hops.iter().map(|h| h.request_id.clone().unwrap()).collect();
        ids.sort();
        ids
    };
    assert_eq!(ids(&hop1), ids(&hop2));
    let remote_decode = kvroute_http::disagg::remote_decode_params();
    for h in &hop1 {
        assert_eq!(h.body["max_tokens"], 1, "{}", h.body);
        assert_eq!(h.body["stream"], false, "{}", h.body);
        assert!(h.body.get("stream_options").is_none(), "{}", h.body);
        assert!(h.body.get("min_tokens").is_none(), "{}", h.body);
        assert_eq!(h.body["kv_transfer_params"], remote_decode);
    }
    let prefill_engines: Vec<String> = c
        .mocks
        .iter()
        .filter(|m| m.role.name() == "prefill")
        .map(|m| format!("kvroute-mock-{}", m.addr))
        .collect();
    for h in &hop2 {
        let params = &h.body["kv_transfer_params"];
        assert_eq!(params["do_remote_prefill"], true, "{}", h.body);
        assert_eq!(params["do_remote_decode"], false);
        assert!(
            prefill_engines.iter().any(|e| params["remote_engine_id"] == *e),
            "{params}"
        );
        assert_eq!(params["remote_request_id"].as_str(), h.request_id.as_deref());
        assert!(
            h.body["max_tokens"].as_u64().unwrap() > 1,
            "the client's own max_tokens"
        );
    }
    let last = hop2.iter().find(|h| h.body["max_tokens"] == 3).unwrap();
    assert_eq!(last.body["min_tokens"], 3, "hop 2 keeps min_tokens");
    assert_eq!(
        last.body["kv_transfer_params"]["remote_block_ids"],
        json!((0..20).collect::<Vec<u32>>())
    );

    assert_eq!(
        c.mock_metric("kvroute_mock_remote_decode_requests_total").await,
        5.0
    );
    assert_eq!(c.mock_metric("kvroute_mock_kv_imports_total").await, 5.0);
    assert!(c.mock_metric("kvroute_mock_kv_import_hit_blocks_total").await >= 20.0);
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_disaggregated_requests_total", ""), 5.0);
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        5.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_router_time_to_first_token_seconds_count",
            ""
        ) >= 2.0,
        "streamed requests measure TTFT at hop 2's first chunk"
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_worker_is_retried_around_and_taken_out_of_routing() {
    for protocol in [EngineKind::Vllm, EngineKind::Sglang] {
        // No health checks: the dead worker leaves routing by the failed connect, not by a
        // prober that may or may not have run before the request.
        let c = disagg_cluster(1, 1, 20.0, |config| {
            config.disagg_protocol = protocol;
            config.health_interval_ms = 0;
        })
        .await;
        c.mocks[0].kill();
        let body =
            serde_json::to_vec(&json!({"prompt": "to a dead prefill worker", "max_tokens": 4})).unwrap();
        // vLLM's hop 1, or the prefill side of SGLang's pair (whose decode side is dropped with
        // it), cannot connect: the prefill worker leaves routing and the request is routed once
        // more, to the decode worker alone, which prefills itself.
        let (status, _, out) = c.http.request("POST", "/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{protocol:?}: {}", String::from_utf8_lossy(&out));
        assert_eq!(completion_tokens(&out), 4, "{protocol:?}");
        c.assert_drained().await;
        let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
        assert_eq!(status, 200, "{protocol:?}: {}", String::from_utf8_lossy(&out));
        let metrics = c.http.get("/metrics").await;
        assert_eq!(
            metric(&metrics, "kvroute_disaggregated_requests_total", ""),
            1.0,
            "{protocol:?}: only the first routing chose the prefill worker"
        );
        assert_eq!(metric(&metrics, "kvroute_upstream_retries_total", ""), 1.0);
        assert_eq!(
            metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
            2.0
        );
        let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
        assert_eq!(
            workers["workers"][0]["routable"], false,
            "{protocol:?}: {workers}"
        );
        if protocol == EngineKind::Vllm {
            assert_eq!(c.kv_requests().1.len(), 0, "no hop 2 without a hop 1");
        }
        c.assert_drained().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decode_worker_of_an_sglang_pair_is_routed_around() {
    // One prefill and two decode workers, one of them dead: whichever decode worker a request
    // is first paired with, it is answered, and a pair sent to the dead one is re-routed once.
    // No health checks: whether the dead worker is routed to depends on the policy alone, not
    // on whether a prober ran first.
    let c = disagg_cluster(1, 2, 20.0, |config| {
        config.disagg_protocol = EngineKind::Sglang;
        config.health_interval_ms = 0;
    })
    .await;
    c.mocks[2].kill();
    for i in 0..4 {
        let out = c
            .complete(json!({"prompt": format!("request {i} of a pair"), "max_tokens": 3}))
            .await;
        assert_eq!(out.usage.unwrap().completion_tokens, 3);
    }
    let metrics = c.http.get("/metrics").await;
    let retries = metric(&metrics, "kvroute_upstream_retries_total", "");
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    let dead_routable = workers["workers"][2]["routable"].as_bool().unwrap();
    assert!(
        (retries == 1.0 && !dead_routable) || (retries == 0.0 && dead_routable),
        "retries {retries}, the dead worker routable: {dead_routable}"
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_unreachable_prefill_worker_fails_the_request_cleanly() {
    // Two prefill workers, both dead, and a decider that always disaggregates: the retry meets
    // the second dead worker, and the request ends with a 502 naming it.
    // No health checks: a prober that ran first would take both out before the request.
    let c = disagg_cluster(2, 1, 20.0, |config| {
        config.decider = "always".to_owned();
        config.health_interval_ms = 0;
    })
    .await;
    c.mocks[0].kill();
    c.mocks[1].kill();
    let body =
        serde_json::to_vec(&json!({"prompt": "to two dead prefill workers", "max_tokens": 4})).unwrap();
    let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&out));
    let err = error(&out);
    assert_eq!(err.code_name(), Some("prefill_failed"), "{err:?}");
    assert_eq!(err.kind, "upstream_error");
    assert!(err.message.contains("prefill worker"), "{err:?}");
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_disaggregated_requests_total", ""), 2.0);
    assert_eq!(metric(&metrics, "kvroute_upstream_retries_total", ""), 1.0);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_the_prefill_hop_frees_its_load() {
    // The prefill worker is a stub that holds hop 1 until the test is done: the client leaves
    // while it is held.
    let mut held = Held::start().await;
    let prefill = WorkerConfig {
        role: "prefill".to_owned(),
        ..WorkerConfig::new(held.url.clone())
    };
    let mut mc = MockConfig::new(1);
    mc.engine.speedup = 20.0;
    let mocks = mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap();
    let c = fronting(vec![prefill], mocks, |config| {
        config.decider = "always".to_owned();
        config.workers[1].role = "decode".to_owned();
        config.request_timeout_ms = PATIENCE.as_millis() as u64;
    })
    .await;
    let body = serde_json::to_vec(&json!({"prompt": "leave me", "max_tokens": 4, "stream": true})).unwrap();
    let http = reqwest_lite::Http::new(c.proxy.url());
    let task = tokio::spawn(async move { http.request("POST", "/v1/completions", body).await });
    let hop1 = held.arrived().await;
    assert_eq!(hop1["kv_transfer_params"]["do_remote_decode"], true, "{hop1}");
    assert_eq!(c.proxy.shared.snapshot().active_now, 1);
    task.abort();
    c.assert_drained().await;
    assert!(c.kv_requests().1.is_empty(), "the client left before hop 2");
    held.release(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deciders_choose_which_requests_take_the_prefill_hop() {
    let short = "a short prompt"; // 14 tokens
    let long: String = (0..200).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    // (decider, prompts, disaggregated)
    let cases: &[(&str, &[&str], f64)] = &[
        ("never", &[short, long.as_str(), short], 0.0),
        ("64", &[short, long.as_str()], 1.0),
        ("always", &[short], 1.0),
    ];
    for &(decider, prompts, want) in cases {
        let c = disagg_cluster(1, 1, 20.0, |config| config.decider = decider.to_owned()).await;
        for p in prompts {
            let body = serde_json::to_vec(&json!({"prompt": p, "max_tokens": 3})).unwrap();
            let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
            assert_eq!(status, 200, "{decider}: {}", String::from_utf8_lossy(&out));
            assert_eq!(completion_tokens(&out), 3);
        }
        let metrics = c.http.get("/metrics").await;
        assert_eq!(
            metric(&metrics, "kvroute_disaggregated_requests_total", ""),
            want,
            "{decider}"
        );
        let (hop1, hop2) = c.kv_requests();
        assert_eq!((hop1.len() as f64, hop2.len() as f64), (want, want), "{decider}");
        assert_eq!(
            c.mock_metric("kvroute_mock_remote_decode_requests_total").await,
            want,
            "{decider}: nothing else reached the prefill worker"
        );
        assert_eq!(
            c.mock_metric("vllm:request_success_total").await,
            prompts.len() as f64 + want,
            "{decider}: every request ran once on the decode worker, plus its prefills"
        );
        c.assert_drained().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_hop_ends_the_request_and_frees_its_load() {
    let long: String = (0..1500)
        .map(|i| char::from(b'a' + (i * 11 % 26) as u8))
        .collect();
    /// The prefill worker of a case.
    enum Prefill {
        /// A mock whose context (1,000 tokens) the prompt exceeds: it answers 400.
        Refusing,
        /// A stub that holds hop 1 until the case is over: the request times out, whatever
        /// the machine's speed.
        Held,
    }
    // (prefill worker, proxy request timeout ms, status, error code, in the message)
    let cases = [
        (
            Prefill::Refusing,
            600_000,
            502,
            "prefill_failed",
            "answered 400 Bad Request",
        ),
        (
            Prefill::Held,
            100,
            504,
            "prefill_timeout",
            "did not answer in time",
        ),
    ];
    for (prefill, timeout_ms, status, code, says) in cases {
        let mut held = None;
        let c = match prefill {
            Prefill::Refusing => {
                let mut mc = MockConfig::new(1);
                mc.prefill_workers = 1;
                mc.engine.speedup = 20.0;
                mc.engine.max_model_len = 1000;
                cluster_of(mc, |config| config.request_timeout_ms = timeout_ms).await
            }
            Prefill::Held => {
                let stub = Held::start().await;
                let prefill = WorkerConfig {
                    role: "prefill".to_owned(),
                    ..WorkerConfig::new(stub.url.clone())
                };
                held = Some(stub);
                let mut mc = MockConfig::new(1);
                mc.engine.speedup = 20.0;
                let mocks = mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap();
                fronting(vec![prefill], mocks, |config| {
                    config.decider = "always".to_owned();
                    config.workers[1].role = "decode".to_owned();
                    config.request_timeout_ms = timeout_ms;
                })
                .await
            }
        };
        let body = serde_json::to_vec(&json!({"prompt": long, "max_tokens": 4, "stream": true})).unwrap();
        let (got, _, out) = c.http.request("POST", "/v1/completions", body).await;
        assert_eq!(got, status, "{code}: {}", String::from_utf8_lossy(&out));
        let err = error(&out);
        assert_eq!(err.code_name(), Some(code), "{err:?}");
        assert!(
            err.message.contains("prefill worker") && err.message.contains(says),
            "{}",
            err.message
        );
        assert!(c.kv_requests().1.is_empty(), "{code}: no hop 2");
        c.assert_drained().await;
        let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
        assert_eq!(
            workers["workers"][0]["routable"], true,
            "{code}: a prefill worker that answered stays in routing"
        );
        if let Some(mut held) = held {
            let hop1 = held.arrived().await;
            assert_eq!(hop1["kv_transfer_params"]["do_remote_decode"], true, "{hop1}");
            held.release(1);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_waits_for_free_blocks_on_a_full_decode_worker() {
    // 30 blocks per engine: one 320-token prompt (20 blocks) decoding 40 tokens holds 20 to
    // 23, so the second import (20 more) waits until the first request frees its blocks. The
    // prefill worker, as small, prefills them one after the other.
    let mut mc = MockConfig::new(1);
    mc.prefill_workers = 1;
    mc.engine.speedup = 20.0;
    mc.engine.num_blocks = 30;
    mc.engine.max_model_len = 480;
    let c = cluster_of(mc, |_| {}).await;
    let mut tasks = Vec::new();
    for k in 0..2u8 {
        let prompt: String = (0..320)
            .map(|i| char::from(b'a' + ((i * 7 + usize::from(k)) % 26) as u8))
            .collect();
        let body = serde_json::to_vec(&json!({"prompt": prompt, "max_tokens": 40})).unwrap();
        let http = reqwest_lite::Http::new(c.proxy.url());
        tasks.push(tokio::spawn(async move {
            http.request("POST", "/v1/completions", body).await
        }));
    }
    for t in tasks {
        let (status, _, out) = t.await.unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        assert_eq!(completion_tokens(&out), 40);
    }
    assert_eq!(c.mock_metric("kvroute_mock_kv_imports_total").await, 2.0);
    assert_eq!(
        c.mock_metric("kvroute_mock_kv_import_transfer_blocks_total")
            .await,
        40.0,
        "20 blocks each, none cached"
    );
    assert_eq!(c.mock_metric("kvroute_mock_kv_import_waits_total").await, 1.0);
    c.assert_drained().await;
}

// ---- SGLang's bootstrap protocol ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pairs_send_one_bootstrap_room_to_both_workers() {
    // One decode worker, so a repeated prompt finds its blocks there whatever the policy's
    // tie-break (decode workers are chosen by load alone).
    let c = disagg_cluster(2, 1, 20.0, |config| {
        config.disagg_protocol = EngineKind::Sglang;
        // One prefill worker names its bootstrap port, the other leaves it to the engine.
        config.workers[0].bootstrap_port = Some(8998);
    })
    .await;
    let client = c.client();
    let chat = chat_request("Hello there, SGLang pair.", 8);
    let response = client.chat().create(chat.clone()).await.unwrap();
    assert_eq!(response.choices[0].message.content.as_deref().unwrap().len(), 8);
    let (streamed, _) = stream_chat(&client, chat).await;
    assert_eq!(streamed.len(), 8, "{streamed:?}");
    // 320 bytes: 20 full blocks of the byte-level tiny tokenizer.
    let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let completion = completion_request(&prompt, 5);
    assert_eq!(stream_completion(&client, completion).await.len(), 5);
    // The decode worker's import stored the prompt; a repeat's import finds every block there.
    c.wait_for_cached_blocks(Some(2), 20).await;
    let usage = c
        .complete(json!({"prompt": prompt, "max_tokens": 3}))
        .await
        .usage
        .unwrap();
    assert_eq!((usage.completion_tokens, usage.cached_tokens()), (3, 320));

    // Each request went to one prefill and one decode worker with the same body: the same
    // room (below 2^63), the prefill worker's host and its bootstrap port (or null), the
    // same request id, and the client's own fields (stream, max_tokens).
    let (prefills, decodes) = c.kv_requests();
    assert_eq!((prefills.len(), decodes.len()), (4, 4));
    let mut rooms = std::collections::HashSet::new();
    for d in &decodes {
        let room = d.body["bootstrap_room"].as_u64().unwrap();
        assert!(room < 1 << 63);
        assert!(rooms.insert(room), "one room per request");
        let p = prefills
            .iter()
            .find(|p| p.body["bootstrap_room"] == room)
            .expect("the prefill worker got the same room");
        assert_eq!(p.body, d.body, "both workers get one body");
        assert_eq!(p.request_id, d.request_id);
        assert_eq!(d.body["bootstrap_host"], "127.0.0.1");
        assert!(d.body.get("kv_transfer_params").is_none());
    }
    let ports = |i: usize| -> Vec<Value> {
        c.mocks[i]
            .seen_kv_requests()
            .iter()
            .map(|s| s.body["bootstrap_port"].clone())
            .collect()
    };
    assert!(ports(0).iter().all(|p| *p == 8998), "{:?}", ports(0));
    assert!(ports(1).iter().all(Value::is_null), "{:?}", ports(1));
    assert!(
        decodes
            .iter()
            .any(|d| d.body["stream"] == true && d.body["max_tokens"] == 8)
    );
    assert!(decodes.iter().any(|d| d.body["max_tokens"] == 3));

    assert_eq!(
        c.mock_metric("kvroute_mock_remote_decode_requests_total").await,
        4.0
    );
    assert_eq!(c.mock_metric("kvroute_mock_kv_imports_total").await, 4.0);
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_disaggregated_requests_total", ""), 4.0);
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        4.0
    );
    c.assert_drained().await;
}
