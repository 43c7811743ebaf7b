//! Chaos, deterministic: things break while requests are in flight, and each test asserts that
//! only the affected request fails, that nothing else is lost, and that the router's load
//! gauges (read from `/metrics`, [`support::gauges`]) and its cache view return to the truth.
//! No sleep decides an outcome: each wait is on a signal (a request arriving at a stub, a
//! worker's state, a stream's end) or polls a condition under a generous deadline.
//!
//! The rest of the suite, by case: an engine killed mid-stream
//! (`e2e.rs::killing_a_worker_mid_stream_ends_the_request_and_frees_its_load`), an engine
//! restart, gaps inside and beyond the replay buffer and a health flap for the view alone
//! (`view_recovery.rs`), descriptor exhaustion and SIGTERM in a subprocess (`hardening.rs`).

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/gauges.rs"]
mod gauges;
#[path = "support/stub.rs"]
mod stub;

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::net::{self, HttpClient, Shutdown};
use kvroute_http::openai::types::Usage;
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::views::ViewSummary;
use kvroute_proxy::worker::StateName;
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use serde_json::{Value, json};

use kvroute_testkit::PATIENCE;

/// A stub engine whose health the test sets and that holds each completion until the test
/// lets it answer, or until it is killed (its connections cut, as a dying engine's are).
struct Stub {
    url: String,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<()>,
    release: Arc<tokio::sync::Semaphore>,
    healthy: Arc<AtomicBool>,
    shutdown: Shutdown,
}

impl Stub {
    async fn start() -> Self {
        Self::start_at("127.0.0.1:0".parse().unwrap()).await
    }

    /// A stub on `addr`: bound again once the address is free (after a stub there was killed,
    /// its listener goes when its task sees the stop), within the patience.
    async fn start_at(addr: std::net::SocketAddr) -> Self {
        use axum::http::StatusCode;
        use axum::routing::{get, post};
        let (tx, arrivals) = tokio::sync::mpsc::unbounded_channel();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let healthy = Arc::new(AtomicBool::new(true));
        let (gate, health) = (Arc::clone(&release), Arc::clone(&healthy));
        let answer = move || async move {
            tx.send(()).unwrap();
            gate.acquire().await.unwrap().forget();
            axum::Json(stub::completion("cmpl-stub", Some(Usage::new(1, 1, 0))))
        };
        let routes = axum::Router::new().route("/v1/completions", post(answer)).route(
            "/health",
            get(move || async move {
                if health.load(Ordering::SeqCst) {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        );
        let deadline = Instant::now() + PATIENCE;
        let (listener, addr) = loop {
            match net::bind(addr).await {
                Ok(bound) => break bound,
                Err(e) => assert!(Instant::now() < deadline, "{addr}: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let shutdown = Shutdown::new();
        tokio::spawn(net::serve(listener, routes, shutdown.clone()));
        Self {
            url: format!("http://{addr}"),
            arrivals,
            release,
            healthy,
            shutdown,
        }
    }

    /// Waits for the next request to arrive.
    async fn arrived(&mut self) {
        tokio::time::timeout(PATIENCE, self.arrivals.recv())
            .await
            .expect("no request arrived")
            .unwrap();
    }
}

/// A proxy in front of `workers`, health checked every 50 ms, with `tweak` applied.
async fn proxy(workers: Vec<WorkerConfig>, tweak: impl FnOnce(&mut ServeConfig)) -> ProxyHandle {
    let mut config = ServeConfig {
        server: kvroute_proxy::config::ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..Default::default()
        },
        upstream: kvroute_proxy::config::UpstreamConfig {
            health_interval_ms: 50,
            request_timeout_ms: PATIENCE.as_millis() as u64,
            ..Default::default()
        },
        workers,
        ..ServeConfig::default()
    };
    tweak(&mut config);
    kvroute_proxy::start(config, Some(Arc::new(Model::tiny().unwrap())))
        .await
        .unwrap()
}

async fn mocks(n: usize, tweak: impl FnOnce(&mut MockConfig)) -> Vec<MockWorker> {
    let mut mc = MockConfig::new(n);
    mc.engine.speedup = 20.0;
    tweak(&mut mc);
    mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap()
}

fn flags(mocks: &[MockWorker]) -> Vec<WorkerConfig> {
    mocks
        .iter()
        .map(|m| WorkerConfig::parse_flag(&m.worker_flag()).unwrap())
        .collect()
}

/// POSTs `body` to `url` + `path`; the status and the whole body.
async fn post(http: &HttpClient, url: &str, path: &str, body: &Value) -> (u16, String) {
    let request = hyper::Request::post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let response = http.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

async fn get(http: &HttpClient, url: &str) -> String {
    let request = hyper::Request::get(url).body(Full::new(Bytes::new())).unwrap();
    let response = http.request(request).await.unwrap();
    String::from_utf8_lossy(&response.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// Waits until the proxy's gauges equal `in_flight` (worker id → requests in flight there),
/// read from `/metrics` until they do; then the router's invariants hold.
async fn until_gauges_are(proxy: &ProxyHandle, in_flight: &[(u64, u64)]) {
    let http = net::client(Duration::from_secs(5));
    let deadline = Instant::now() + PATIENCE;
    loop {
        let text = get(&http, &format!("{}/metrics", proxy.url())).await;
        match gauges::mismatch(&text, in_flight) {
            None => break,
            Some(wrong) => assert!(
                Instant::now() < deadline,
                "the gauges never returned to the truth {in_flight:?}: {wrong}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proxy.driver.check_invariants().unwrap();
}

async fn until_state(proxy: &ProxyHandle, id: usize, state: StateName) {
    let reached = proxy
        .driver
        .wait_until(PATIENCE, |s| s.worker_statuses()[id].state == state)
        .await;
    assert!(reached, "worker {id} never became {state:?}");
}

/// Sends a one-token completion that the stub (worker 0) holds, then adds the other worker
/// (`others[0]`) once it is booked there: the in-flight request every chaos case starts from.
async fn held_on_stub(
    p: &ProxyHandle,
    stub: &mut Stub,
    others: &[MockWorker],
    prompt: &str,
) -> tokio::task::JoinHandle<(u16, String)> {
    let (url, body) = (p.url(), json!({"prompt": prompt, "max_tokens": 1}));
    let held = tokio::spawn(async move {
        let http = net::client(Duration::from_secs(5));
        post(&http, &url, "/v1/completions", &body).await
    });
    stub.arrived().await;
    p.fleet.add(flags(others).remove(0)).unwrap();
    until_gauges_are(p, &[(0, 1)]).await;
    held
}

/// Sends `n` short completions one after another (prompts `"{prefix} {i}"`); each must succeed.
async fn all_served(url: &str, n: usize, prefix: &str) {
    let http = net::client(Duration::from_secs(5));
    for i in 0..n {
        let body = json!({"prompt": format!("{prefix} {i}"), "max_tokens": 2});
        let (status, out) = post(&http, url, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{out}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_flap_with_a_request_in_flight_loses_nothing_and_the_gauges_return() {
    let mut stub = Stub::start().await;
    let others = mocks(1, |_| {}).await;
    let p = proxy(vec![WorkerConfig::new(stub.url.clone())], |_| {}).await;
    let url = p.url();
    // A request held by the stub (worker 0): in flight, booked there.
    let held = held_on_stub(&p, &mut stub, &others, "held").await;
    // The stub's health fails, then passes again; the request is still in flight.
    stub.healthy.store(false, Ordering::SeqCst);
    until_state(&p, 0, StateName::Unhealthy).await;
    // Out of routing, the request it holds is still booked on it.
    let booked = |p: &ProxyHandle| p.driver.worker_statuses()[0].active_requests;
    assert_eq!(booked(&p), 1);
    // Meanwhile requests go to the other worker and succeed.
    all_served(&url, 3, "during").await;
    stub.healthy.store(true, Ordering::SeqCst);
    until_state(&p, 0, StateName::Ready).await;
    // Back with it still booked: not taken for idle.
    assert_eq!(booked(&p), 1);
    // The held request finishes, unharmed by the flap.
    stub.release.add_permits(1);
    let (status, out) = held.await.unwrap();
    assert_eq!(status, 200, "{out}");
    until_gauges_are(&p, &[]).await;
    // And the flapped worker serves again: the next request on it is booked and freed.
    stub.release.add_permits(2);
    all_served(&url, 2, "after").await;
    until_gauges_are(&p, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_killed_with_a_request_in_flight_fails_only_that_request() {
    let mut stub = Stub::start().await;
    let others = mocks(1, |_| {}).await;
    let p = proxy(vec![WorkerConfig::new(stub.url.clone())], |_| {}).await;
    let url = p.url();
    let doomed = held_on_stub(&p, &mut stub, &others, "doomed").await;
    // The engine dies: its connections are cut.
    stub.shutdown.stop();
    let (status, out) = doomed.await.unwrap();
    assert!(status >= 500, "{status}: {out}");
    until_gauges_are(&p, &[]).await;
    // Nothing else is lost: every later request is served (by the other worker).
    all_served(&url, 4, "after").await;
    until_state(&p, 0, StateName::Unhealthy).await;
    until_gauges_are(&p, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_is_cut_off_alone_and_books_nothing() {
    let workers = mocks(1, |_| {}).await;
    let p = proxy(flags(&workers), |c| c.server.header_read_timeout_ms = 300).await;
    // A client that never finishes its headers, on a thread of its own (blocking I/O).
    let addr = p.addr;
    let slow = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            .unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut rest = Vec::new();
        // Ends when the server closes the connection.
        let _ = s.read_to_end(&mut rest);
        rest
    });
    // Meanwhile others are served.
    let http = net::client(Duration::from_secs(5));
    for i in 0..3 {
        let body = json!({"prompt": format!("prompt {i}"), "max_tokens": 2, "stream": i % 2 == 1});
        let (status, out) = post(&http, &p.url(), "/v1/completions", &body).await;
        assert_eq!(status, 200, "{out}");
    }
    let answer = tokio::task::spawn_blocking(move || slow.join().unwrap())
        .await
        .unwrap();
    assert!(answer.is_empty(), "cut off without an answer: {answer:?}");
    until_gauges_are(&p, &[]).await;
}

/// Reads an SSE response to its end; the whole text.
async fn stream_text(http: &HttpClient, url: &str, prompt: &str, max_tokens: u32) -> String {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "stream": true});
    post(http, url, "/v1/completions", &body).await.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_with_streams_in_flight_finishes_every_one_and_frees_their_load() {
    // Slow engines: the streams are in flight for a while.
    let workers = mocks(2, |mc| mc.engine.speedup = 2.0).await;
    let p = proxy(flags(&workers), |_| {}).await;
    let url = p.url();
    let streams: Vec<_> = (0..2)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move {
                let http = net::client(Duration::from_secs(5));
                stream_text(&http, &url, &format!("stream {i} in flight"), 60).await
            })
        })
        .collect();
    let shared = Arc::clone(&p.driver);
    let both = shared
        .wait_until(PATIENCE, |s| s.snapshot().active_now == 2)
        .await;
    assert!(both, "the two streams never started");
    // The drain (what SIGTERM starts): no new connection, every stream to its end.
    assert!(p.drain(PATIENCE).await, "the streams did not finish in time");
    for s in streams {
        let text = s.await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "a stream was cut: {text}");
    }
    let m = shared.snapshot();
    assert_eq!(m.active_now, 0);
    assert!(m.workers.iter().all(|w| w.load.is_idle()), "{:?}", m.workers);
    shared.check_invariants().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_beyond_the_replay_buffer_fails_no_request_and_the_view_rebuilds() {
    // A replay buffer of one batch: three batches dropped cannot be replayed.
    let workers = mocks(1, |mc| mc.replay_buffer_steps = 1).await;
    let p = proxy(flags(&workers), |_| {}).await;
    let http = net::client(Duration::from_secs(5));
    let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let body = json!({"prompt": prompt, "max_tokens": 20});
    workers[0].drop_next_event_batches(3);
    for i in 0..3 {
        let (status, out) = post(&http, &p.url(), "/v1/completions", &body).await;
        assert_eq!(status, 200, "request {i}: {out}");
    }
    // The loss is found and said (the view cleared, then marked), and the view is rebuilt
    // from what follows.
    let lost = |s: &kvroute_proxy::Driver| {
        matches!(s.worker_statuses()[0].view, ViewSummary::RebuiltAfterGap { .. })
    };
    let mut i = 0;
    while !p.driver.wait_for_kv(Duration::from_millis(200), lost).await {
        // The gap shows only with a later batch: send more traffic until it does.
        i += 1;
        assert!(i < 150, "the lost gap was never reported");
        let other = json!({"prompt": format!("more {i}"), "max_tokens": 2});
        let (status, out) = post(&http, &p.url(), "/v1/completions", &other).await;
        assert_eq!(status, 200, "{out}");
    }
    let incidents = p
        .driver
        .metrics
        .kv_stream_incidents
        .with_label_values(&["gap_lost"])
        .get();
    assert!(incidents >= 1);
    // A new prompt's blocks reach the cleared view through the engine's new events.
    let fresh: String = (0..320).map(|i| char::from(b'a' + (i * 11 % 26) as u8)).collect();
    let (status, out) = post(
        &http,
        &p.url(),
        "/v1/completions",
        &json!({"prompt": fresh, "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{out}");
    let rebuilt = p
        .driver
        .wait_for_kv(PATIENCE, |s| s.worker_statuses()[0].cached_blocks >= 20)
        .await;
    assert!(
        rebuilt,
        "the view was not rebuilt: {:?}",
        p.driver.worker_statuses()[0]
    );
    until_gauges_are(&p, &[]).await;
}

/// `n` blocks stored under `parent`, named `first..first + n` by the engine.
fn stored(first: u64, n: u64, parent: Option<u64>) -> kvroute_wire::WireEvent {
    use kvroute_core::ids::ExternalBlockHash;
    kvroute_wire::WireEvent::BlockStored(kvroute_wire::BlockStored {
        block_hashes: (first..first + n).map(ExternalBlockHash).collect(),
        parent_block_hash: parent.map(ExternalBlockHash),
        token_ids: (0..n as u32 * 16).map(|t| t + first as u32 * 1000).collect(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        cache_salt: None,
        group_idx: None,
    })
}

/// An engine's event publisher with a replay socket, on `endpoints` (free ports if `None`).
async fn publisher(endpoints: Option<(String, String)>) -> kvroute_zmq::EventPublisher {
    let (events, replay) = endpoints.unwrap_or(("tcp://127.0.0.1:0".into(), "tcp://127.0.0.1:0".into()));
    kvroute_zmq::EventPublisher::start(kvroute_zmq::PublisherConfig {
        replay_endpoint: Some(replay),
        buffer_steps: 1000,
        ..kvroute_zmq::PublisherConfig::new(events)
    })
    .await
    .unwrap()
}

/// Publishes `events` (then empty batches, which PUB/SUB may drop before the subscription
/// arrives) until worker 0's view holds `blocks` blocks.
async fn until_view_holds(
    proxy: &ProxyHandle,
    publisher: &kvroute_zmq::EventPublisher,
    events: Vec<kvroute_wire::WireEvent>,
    blocks: u64,
) {
    publisher.publish(events, Some(0), 1.0).unwrap();
    let deadline = Instant::now() + PATIENCE;
    let holds = |s: &kvroute_proxy::Driver| s.worker_statuses()[0].cached_blocks == blocks;
    while !proxy.driver.wait_for_kv(Duration::from_millis(50), holds).await {
        assert!(
            Instant::now() < deadline,
            "the view never held {blocks} blocks: {:?}",
            proxy.driver.worker_statuses()[0]
        );
        // A later batch shows the subscriber what it missed, which it replays.
        publisher.publish(Vec::new(), Some(0), 1.0).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restarted_with_a_request_in_flight_fails_only_that_request_and_its_view_starts_over() {
    let mut stub = Stub::start().await;
    let events = publisher(None).await;
    let others = mocks(1, |_| {}).await;
    let engine = WorkerConfig {
        events: Some(events.endpoint().to_owned()),
        replay: events.replay_endpoint().map(str::to_owned),
        ..WorkerConfig::new(stub.url.clone())
    };
    // Health checks slower than the restart: the proxy learns of it from the event stream.
    let p = proxy(vec![engine], |c| {
        c.upstream.health_interval_ms = 0;
        c.model.approximate_tokenizer = true;
    })
    .await;
    until_view_holds(&p, &events, vec![stored(1, 4, None)], 4).await;
    let url = p.url();
    let doomed = held_on_stub(&p, &mut stub, &others, "doomed").await;
    // The engine restarts in place: its connections cut, its sequence from 0, its cache empty.
    let addr: std::net::SocketAddr = stub.url.trim_start_matches("http://").parse().unwrap();
    let endpoints = (
        events.endpoint().to_owned(),
        events.replay_endpoint().unwrap().to_owned(),
    );
    stub.shutdown.stop();
    events.shutdown().await;
    let (status, out) = doomed.await.unwrap();
    assert!(status >= 500, "{status}: {out}");
    let stub = Stub::start_at(addr).await;
    let events = publisher(Some(endpoints)).await;
    // Its new run's first blocks replace the old view, which is gone.
    until_view_holds(&p, &events, vec![stored(100, 2, None)], 2).await;
    let restarts = p
        .driver
        .metrics
        .kv_stream_incidents
        .with_label_values(&["restarted"])
        .get();
    assert!(restarts >= 1, "the restart was not seen");
    until_gauges_are(&p, &[]).await;
    // Nothing else is lost: later requests are served, on either worker.
    stub.release.add_permits(4);
    all_served(&url, 4, "after").await;
    until_gauges_are(&p, &[]).await;
}
