//! A data-parallel worker is one router worker per rank; each request names the rank it was
//! routed to as the worker's engine reads it: vLLM's `X-data-parallel-rank` header, or SGLang's
//! `data_parallel_rank` body field. Against a recording upstream (what is sent), and against a
//! two-rank mock worker (each rank an engine publishing its own events on its own port).

#![allow(clippy::unwrap_used)]

#[path = "support/serve.rs"]
mod serve;
#[path = "support/stub.rs"]
mod stub;

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::net::HttpClient;
use kvroute_http::openai::types::Completion;
use kvroute_mock::{self as mock, MockConfig};
use kvroute_proxy::{EngineKind, ServeConfig, WorkerConfig};
use serde_json::{Value, json};

use kvroute_testkit::PATIENCE;
/// How long to wait for the subscribers to report before publishing again while they join.
const RETRY_PACE: std::time::Duration = std::time::Duration::from_millis(200);

/// What the upstream saw of each request: its rank header and its body.
type Seen = Arc<Mutex<Vec<(Option<String>, Value)>>>;

/// An upstream that records requests and answers each with a fixed completion.
async fn recording_upstream() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let routes = axum::Router::new()
        .route(
            "/v1/completions",
            post(
                |State(seen): State<Seen>, headers: HeaderMap, body: Bytes| async move {
                    let rank = headers
                        .get("x-data-parallel-rank")
                        .map(|v| v.to_str().unwrap().to_owned());
                    seen.lock()
                        .unwrap()
                        .push((rank, serde_json::from_slice(&body).unwrap()));
                    axum::Json(stub::completion("c", None))
                },
            ),
        )
        .with_state(Arc::clone(&seen));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
    (url, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_names_its_rank_as_the_engine_reads_it() {
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        let (url, seen) = recording_upstream().await;
        let config = ServeConfig {
            routing: kvroute_proxy::config::RoutingConfig {
                policy: "round-robin".into(),
                ..Default::default()
            },
            workers: vec![WorkerConfig {
                dp_size: 2,
                engine,
                ..WorkerConfig::new(url)
            }],
            ..serve::loopback()
        };
        let proxy = kvroute_proxy::start(config, None).await.unwrap();
        let client = kvroute_http::net::client(std::time::Duration::from_secs(2));
        let url = format!("{}/v1/completions", proxy.url());
        for i in 0..4 {
            let body = json!({"prompt": format!("request {i}"), "max_tokens": 2, "data_parallel_rank": 7});
            post_json(&client, &url, &body, None).await;
        }
        let seen = seen.lock().unwrap().clone();
        let ranks: Vec<u64> = seen
            .iter()
            .map(|(header, body)| match engine {
                EngineKind::Vllm => {
                    // The client's own field passes through untouched; the header names the rank.
                    assert_eq!(body["data_parallel_rank"], 7, "{body}");
                    header.as_deref().unwrap().parse().unwrap()
                }
                EngineKind::Sglang => {
                    assert_eq!(*header, None, "SGLang reads no rank header");
                    body["data_parallel_rank"].as_u64().unwrap()
                }
            })
            .collect();
        assert_eq!(ranks, [0, 1, 0, 1], "{engine:?}: round-robin over the two ranks");
        assert!(seen.iter().all(|(_, body)| body["max_tokens"] == 2));
    }
}

/// POSTs `body` as JSON to `url` (naming data-parallel `rank` in vLLM's header, if given) and
/// returns the JSON answer, which must be a 200.
async fn post_json(client: &HttpClient, url: &str, body: &Value, rank: Option<u32>) -> Value {
    let mut request = hyper::Request::post(url).header("content-type", "application/json");
    if let Some(rank) = rank {
        request = request.header("x-data-parallel-rank", rank);
    }
    let request = request
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    serde_json::from_slice(&bytes).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_returns_to_the_rank_that_cached_it() {
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        let model = Arc::new(Model::tiny().unwrap());
        let mut mc = MockConfig::new(1);
        mc.dp_size = 2;
        mc.engine.speedup = 20.0;
        let mocks = mock::start(&mc, Arc::clone(&model)).await.unwrap();
        let config = ServeConfig {
            workers: vec![WorkerConfig {
                engine,
                ..WorkerConfig::parse_flag(&mocks[0].worker_flag()).unwrap()
            }],
            ..serve::loopback()
        };
        assert_eq!(config.workers[0].dp_size, 2);
        let proxy = kvroute_proxy::start(config, Some(model)).await.unwrap();
        let client = kvroute_http::net::client(std::time::Duration::from_secs(2));
        let url = format!("{}/v1/completions", proxy.url());
        // Until both ranks' subscribers have joined (PUB/SUB drops what comes before, and a
        // gap shows only with a later batch), run a new one-block request on each rank directly
        // and wait for the proxy to apply reports from both. The short wait only paces the
        // retries; what is checked is the proxy's state.
        let mock_url = format!("{}/v1/completions", mocks[0].url());
        let joined = |shared: &kvroute_proxy::Driver| {
            let subscribers = shared.metrics.kv_subscribers.snapshots();
            (0..2).all(|r| {
                subscribers
                    .iter()
                    .any(|(key, counters)| key.dp_rank.0 == r && counters.emitted > 0)
            })
        };
        for attempt in 0.. {
            assert!(attempt < 100, "{engine:?}: the subscribers never joined");
            for rank in 0..2 {
                // A new first block each time (a cached one publishes nothing).
                let warm =
                    json!({"prompt": format!("{attempt:06}: warming up rank {rank}"), "max_tokens": 1});
                post_json(&client, &mock_url, &warm, Some(rank)).await;
            }
            if proxy.driver.wait_for_kv(RETRY_PACE, joined).await {
                break;
            }
        }
        let prompt_tokens = |metrics: &str, rank: u32| -> f64 {
            let series = format!("vllm:prompt_tokens_total{{engine=\"{rank}\",model_name=\"tiny\"}} ");
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(&series))
                .unwrap()
                .parse()
                .unwrap()
        };
        let before = get_text(&client, &format!("{}/metrics", mocks[0].url())).await;
        // 320 bytes: 20 full blocks of the byte-level tiny tokenizer.
        let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 5 % 26) as u8)).collect();
        let body = json!({"prompt": prompt, "max_tokens": 3});
        let first = completion(post_json(&client, &url, &body, None).await);
        assert_eq!(first.usage.as_ref().unwrap().cached_tokens(), 0, "{first:?}");
        // The rank that ran it publishes its blocks on its own port; the router books them
        // under that rank.
        let holds = |shared: &kvroute_proxy::Driver| {
            shared
                .snapshot()
                .workers
                .iter()
                .find(|w| w.cached_blocks >= 20)
                .map(|w| w.spec.key.dp_rank.0)
        };
        assert!(
            proxy.driver.wait_for_kv(PATIENCE, |s| holds(s).is_some()).await,
            "{engine:?}: no rank's events arrived"
        );
        let holder = holds(&proxy.driver).unwrap();
        let again = completion(post_json(&client, &url, &body, None).await);
        // All 20 blocks but the last, which the engine computes again for the first token.
        assert_eq!(
            again.usage.as_ref().unwrap().cached_tokens(),
            304,
            "{engine:?}: the repeat went back to rank {holder}: {again:?}"
        );
        // The mock's per-rank counters agree: both requests ran on the holding rank.
        let after = get_text(&client, &format!("{}/metrics", mocks[0].url())).await;
        let ran = |rank: u32| prompt_tokens(&after, rank) - prompt_tokens(&before, rank);
        assert_eq!(ran(holder), 640.0, "{engine:?}: {after}");
        assert_eq!(ran(1 - holder), 0.0, "{engine:?}: {after}");
        proxy.stop();
    }
}

/// `value` as a completion.
fn completion(value: Value) -> Completion {
    serde_json::from_value(value).unwrap()
}

/// GETs `url`'s body as text.
async fn get_text(client: &HttpClient, url: &str) -> String {
    let request = hyper::Request::get(url).body(Full::new(Bytes::new())).unwrap();
    let response = client.request(request).await.unwrap();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}
