//! A data-parallel worker is one router worker per rank; each request names the rank it was
//! routed to as the worker's engine reads it: vLLM's `X-data-parallel-rank` header, or SGLang's
//! `data_parallel_rank` body field.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_server::{EngineKind, ServeConfig, WorkerConfig};
use serde_json::{Value, json};

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
                    axum::Json(json!({"id": "c", "object": "text_completion", "choices": [
                    {"index": 0, "text": "ok", "finish_reason": "stop"}]}))
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
            listen: "127.0.0.1:0".into(),
            policy: "round-robin".into(),
            health_interval_ms: 0,
            workers: vec![WorkerConfig {
                dp_size: 2,
                engine,
                ..WorkerConfig::new(url)
            }],
            ..ServeConfig::default()
        };
        let proxy = kvroute_server::start(config, None).await.unwrap();
        let client = kvroute_server::net::client(std::time::Duration::from_secs(2));
        for i in 0..4 {
            let body = json!({"prompt": format!("request {i}"), "max_tokens": 2, "data_parallel_rank": 7});
            let request = hyper::Request::post(format!("{}/v1/completions", proxy.url()))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
                .unwrap();
            let response = client.request(request).await.unwrap();
            assert_eq!(response.status(), 200, "{engine:?}");
            response.into_body().collect().await.unwrap();
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
