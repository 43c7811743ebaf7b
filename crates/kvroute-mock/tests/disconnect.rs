//! A client that disconnects mid-stream: the mock aborts its request in the engine, as vLLM
//! does, instead of generating for nobody.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::net::{HttpClient, client};
use kvroute_mock::{MockConfig, MockWorker};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use kvroute_testkit::PATIENCE;

/// `name`'s value for rank 0 in `worker`'s `/metrics`.
async fn metric(http: &HttpClient, worker: &MockWorker, name: &str) -> f64 {
    let request = hyper::Request::get(format!("{}/metrics", worker.url()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let body = http
        .request(request)
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap();
    let text = String::from_utf8(body.to_bytes().to_vec()).unwrap();
    let series = format!("{name}{{engine=\"0\",model_name=\"tiny\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_aborts_its_request() {
    // Real time: 100,000 tokens would take minutes to generate.
    let workers = kvroute_mock::start(&MockConfig::new(1), Arc::new(Model::tiny().unwrap()))
        .await
        .unwrap();
    let worker = &workers[0];
    let http = client(Duration::from_secs(2));
    // A raw connection, so that leaving is closing the socket.
    let mut tcp = TcpStream::connect(worker.addr).await.unwrap();
    let body = r#"{"prompt": "tell me everything", "max_tokens": 100000, "stream": true}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: mock\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(format!("{head}{body}").as_bytes()).await.unwrap();
    // The first chunk: the request runs.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = tokio::time::timeout(PATIENCE, tcp.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(n > 0, "the stream ended: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));
    drop(tcp);
    // The engine lets it go: nothing runs, and it counts as aborted, not finished.
    let t0 = Instant::now();
    while metric(&http, worker, "kvroute_mock_requests_aborted_total").await < 1.0 {
        assert!(t0.elapsed() < PATIENCE, "the request was never aborted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(metric(&http, worker, "vllm:num_requests_running").await, 0.0);
    assert_eq!(metric(&http, worker, "vllm:num_requests_waiting").await, 0.0);
    assert_eq!(metric(&http, worker, "vllm:kv_cache_usage_perc").await, 0.0);
    assert_eq!(metric(&http, worker, "vllm:request_success_total").await, 0.0);
    assert!(metric(&http, worker, "vllm:generation_tokens_total").await < 100_000.0);
}
