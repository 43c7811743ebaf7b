//! Scale from zero, end to end on loopback: a proxy with no worker and `when-empty = queue`
//! holds a request in its router's queue until a worker is added through the admin API, then
//! serves it whole; with no worker ever added, the queue timeout answers; with `reject` (the
//! default) the request is turned away at once, as before.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/cluster.rs"]
mod cluster;

use cluster::*;
use kvroute_proxy::QueuedRequests;
use kvroute_testkit::eventually;

/// A proxy with no worker, `when-empty` set to `when_empty`, and `tweak` applied.
async fn empty_proxy(when_empty: &str, tweak: impl FnOnce(&mut ServeConfig)) -> Cluster {
    fronting(Vec::new(), Vec::new(), |config| {
        config.routing.when_empty = when_empty.to_owned();
        tweak(config);
    })
    .await
}

/// The text of a streamed completion's body (its `data:` chunks), and whether it ended with
/// `[DONE]`.
fn streamed_text(body: &[u8]) -> (String, bool) {
    let body = String::from_utf8_lossy(body);
    let mut text = String::new();
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        if let Some(t) = chunk["choices"][0]["text"].as_str() {
            text.push_str(t);
        }
    }
    (text, done)
}

const STREAM: &str = r#"{"model": "tiny", "prompt": "wake up, fleet", "max_tokens": 8, "stream": true}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_the_first_worker_and_is_served_whole() {
    let c = empty_proxy("queue", |config| {
        // Only reached if the test is failing.
        config.routing.queue_timeout_ms = PATIENCE.as_millis() as u64;
    })
    .await;
    let waiting = {
        let http = reqwest_lite::Http::new(c.proxy.url());
        tokio::spawn(async move {
            http.request("POST", "/v1/completions", STREAM.as_bytes().to_vec())
                .await
        })
    };
    let driver = &c.proxy.driver;
    let one = QueuedRequests {
        total: 1,
        without_worker: 1,
    };
    eventually("the request waits in the router's queue", || {
        driver.queued_requests() == one
    })
    .await;
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_router_queue_empty_fleet", ""), 1.0);
    assert_eq!(
        metric(&metrics, "dynamo_frontend_router_queue_pending_requests", ""),
        1.0
    );
    assert!(!waiting.is_finished(), "answered before any worker came");
    // The autoscaler's part, by hand: a worker comes up and is added.
    let mock = start_mocks(&MockConfig::new(1)).await.remove(0);
    let add = serde_json::to_vec(&json!({"url": mock.url()})).unwrap();
    let (status, _, out) = c.admin.request("POST", "/admin/workers", add).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&out));
    let (status, _, body) = waiting.await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (text, done) = streamed_text(&body);
    assert_eq!(text.len(), 8, "one ASCII letter per generated token: {text:?}");
    assert!(done, "the stream ends with [DONE]");
    assert_eq!(driver.queued_requests(), QueuedRequests::default());
    let counters = driver.snapshot().counters;
    assert_eq!((counters.queued_without_worker, counters.released), (1, 1));
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_router_queue_empty_fleet", ""), 0.0);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_worker_ever_the_queue_timeout_answers() {
    let c = empty_proxy("queue", |config| config.routing.queue_timeout_ms = 300).await;
    let started = std::time::Instant::now();
    let (status, retry, out) = c
        .http
        .request("POST", "/v1/completions", STREAM.as_bytes().to_vec())
        .await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&out));
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(error(&out).code_name(), Some("queue_timeout"));
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "it waited out the queue timeout"
    );
    let driver = &c.proxy.driver;
    assert_eq!(driver.queued_requests(), QueuedRequests::default());
    let counters = driver.snapshot().counters;
    assert_eq!(
        (
            counters.queued_without_worker,
            counters.cancelled_in_queue,
            counters.rejected_no_worker
        ),
        (1, 1, 0)
    );
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_router_queue_empty_fleet", ""), 0.0);
    assert_eq!(
        metric(&metrics, "kvroute_requests_outcome_total", "outcome=\"rejected\""),
        1.0
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_reject_a_request_without_a_worker_is_turned_away_at_once() {
    // A queue timeout the test would notice: the answer must not wait for it.
    let c = empty_proxy("reject", |config| {
        config.routing.queue_timeout_ms = PATIENCE.as_millis() as u64;
    })
    .await;
    assert_eq!(ServeConfig::default().routing.when_empty, "reject");
    let (status, retry, out) = c
        .http
        .request("POST", "/v1/completions", STREAM.as_bytes().to_vec())
        .await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&out));
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(error(&out).code_name(), Some("no_worker"));
    let counters = c.proxy.driver.snapshot().counters;
    assert_eq!((counters.queued, counters.rejected_no_worker), (0, 1));
    c.assert_drained().await;
}
