//! Tenants, fair shares, priorities and rate limits, end to end: `kvroute serve` proxies in
//! front of a mock worker that takes two requests at a time (`max-requests` 2, a busy fraction of
//! 0.5), so that the rest wait in the routers' queues. The fairness and priority tests run two
//! replicas synced through one `nats-server` (started by each test on a free loopback port;
//! where none is installed they skip, saying so, and fail in CI), each request sent to them in
//! turn.
//!
//! Waiting is measured in service order, not in seconds: a request's wait is the number of
//! requests of the other class that finish after it is sent and before it finishes (that
//! overtake it). The client's clock only orders the ends; no bound is in wall time.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::net::HttpClient;
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::config::{TenantConfig, TenantsConfig};
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_sync::server::NatsServer;
use kvroute_testkit::{External, eventually, require};
use serde_json::{Value, json};

/// Output tokens of every request.
const OUTPUT: u32 = 8;

fn nats() -> Option<NatsServer> {
    require(External::NatsServer, NatsServer::binary().is_some()).then(|| NatsServer::start().unwrap())
}

async fn worker() -> (Vec<MockWorker>, WorkerConfig) {
    let mc = MockConfig::new(1);
    let mocks = mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap();
    let mut w = WorkerConfig::parse_flag(&mocks[0].worker_flag()).unwrap();
    w.max_requests = 2;
    (mocks, w)
}

fn tenant(name: &str, weight: u32) -> TenantConfig {
    TenantConfig {
        name: name.to_owned(),
        api_keys: Vec::new(),
        header_values: vec![name.to_owned()],
        weight,
        requests_per_interval: None,
        tokens_per_interval: None,
        interval_ms: 60_000,
        cache_namespace: None,
    }
}

/// A proxy in front of `worker`, synced through `nats` if given, with `tenants`.
async fn proxy(nats: Option<&NatsServer>, worker: &WorkerConfig, tenants: Vec<TenantConfig>) -> ProxyHandle {
    let mut config = ServeConfig {
        workers: vec![worker.clone()],
        tenants: TenantsConfig {
            tenant_header: Some("x-tenant".to_owned()),
            priority_header: None,
            forward_priority: false,
            tenants,
        },
        ..ServeConfig::default()
    };
    config.server.listen = "127.0.0.1:0".into();
    config.server.admin_listen = "127.0.0.1:0".into();
    config.routing.busy_requests_fraction = Some(0.5);
    config.routing.queue_timeout_ms = 600_000;
    config.replicas.nats = nats.map(NatsServer::url);
    config.replicas.nats_heartbeat_ms = 200;
    config.replicas.nats_peer_timeout_ms = 2000;
    let p = kvroute_proxy::start(config, Some(Arc::new(Model::tiny().unwrap())))
        .await
        .unwrap();
    eventually("the worker is routable", || {
        p.driver.worker_statuses().iter().any(|w| w.routable)
    })
    .await;
    p
}

fn client() -> HttpClient {
    kvroute_http::net::client(Duration::from_secs(5))
}

/// Request `n`'s prompt: 40 tokens of its own.
fn prompt(n: u32) -> Value {
    json!((0..40).map(|i| 1 + (n * 41 + i * 7) % 250).collect::<Vec<u32>>())
}

/// One finished request: its class, when it was sent and when its answer was whole.
#[derive(Clone, Copy, Debug)]
struct Done {
    class: u8,
    sent: Instant,
    finished: Instant,
}

/// Sends a completion with `headers` and `extra` body fields; the status, the body, the
/// `Retry-After` header and when the answer was whole.
async fn send(
    client: &HttpClient,
    proxy: &ProxyHandle,
    n: u32,
    headers: &[(&str, String)],
    extra: Value,
) -> (u16, Value, Option<String>) {
    let mut body = json!({"prompt": prompt(n), "max_tokens": OUTPUT});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    let mut request = hyper::Request::post(format!("{}/v1/completions", proxy.url()))
        .header("content-type", "application/json");
    for (k, v) in headers {
        request = request.header(*k, v);
    }
    let request = request
        .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let retry = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        retry,
    )
}

/// Sends a request of `class` that must succeed, and records it.
async fn timed(
    client: HttpClient,
    proxy: &ProxyHandle,
    n: u32,
    class: u8,
    headers: Vec<(&str, String)>,
    extra: Value,
) -> Done {
    let sent = Instant::now();
    let (status, body, _) = send(&client, proxy, n, &headers, extra).await;
    assert_eq!(status, 200, "{body}");
    Done {
        class,
        sent,
        finished: Instant::now(),
    }
}

/// For each request of class `of`: how many requests of another class finished after it was
/// sent and before it finished.
fn overtaken(done: &[Done], of: u8) -> Vec<usize> {
    done.iter()
        .filter(|d| d.class == of)
        .map(|d| {
            done.iter()
                .filter(|o| o.class != of && o.finished > d.sent && o.finished < d.finished)
                .count()
        })
        .collect()
}

/// How long one request takes alone, to pace the steady sender at a fraction of its share.
async fn service_time(client: &HttpClient, proxy: &ProxyHandle) -> Duration {
    let t = Instant::now();
    for n in 0..3 {
        let (status, body, _) = send(client, proxy, 100_000 + n, &[], json!({})).await;
        assert_eq!(status, 200, "{body}");
    }
    t.elapsed() / 3
}

/// The most requests of the other class a waiting request may see finish first: those in
/// the worker when it arrives (two per replica's view, and each replica may book before its
/// peer's booking reaches it: four), one per replica that wins a tie (two), and as many again
/// for the views of the two replicas to settle under load. First come, first served, it would
/// wait behind the part of the burst queued ahead of it on its replica (sixty here).
const WAIT_BOUND: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tenant_bursting_at_ten_times_its_share_does_not_starve_a_steady_one_across_two_replicas() {
    let Some(nats) = nats() else { return };
    let (_mocks, w) = worker().await;
    let tenants = || vec![tenant("a", 1), tenant("b", 1)];
    let replicas = [
        proxy(Some(&nats), &w, tenants()).await,
        proxy(Some(&nats), &w, tenants()).await,
    ];
    let replicas = Arc::new(replicas);
    let client = client();
    let t = service_time(&client, &replicas[0]).await;
    // B sends one request per service time: half of B's fair share (the two weigh the same)
    // of a worker that serves two at a time, less with batching. A sends ten times as many at
    // once, and its burst outlasts B's run.
    let steady = 12u32;
    let burst = 10 * steady;
    let mut tasks = Vec::new();
    for n in 0..burst {
        let (client, replicas) = (client.clone(), Arc::clone(&replicas));
        tasks.push(tokio::spawn(async move {
            let p = &replicas[n as usize % 2];
            timed(client, p, n, 0, vec![("x-tenant", "a".to_owned())], json!({})).await
        }));
    }
    // Let the burst fill the queues first.
    eventually("A's burst waits in the queues", || {
        replicas
            .iter()
            .map(|p| p.driver.snapshot().queued_now)
            .sum::<usize>() as u32
            >= burst / 2
    })
    .await;
    for n in 0..steady {
        let (client, replicas) = (client.clone(), Arc::clone(&replicas));
        tasks.push(tokio::spawn(async move {
            let p = &replicas[n as usize % 2];
            timed(
                client,
                p,
                1000 + n,
                1,
                vec![("x-tenant", "b".to_owned())],
                json!({}),
            )
            .await
        }));
        tokio::time::sleep(4 * t).await;
    }
    let mut done = Vec::new();
    for task in tasks {
        done.push(task.await.unwrap());
    }
    let waits = overtaken(&done, 1);
    let last_a = done
        .iter()
        .filter(|d| d.class == 0)
        .map(|d| d.finished)
        .max()
        .unwrap();
    let contended = done.iter().filter(|d| d.class == 1 && d.sent < last_a).count();
    eprintln!("service time {t:?}; A requests finishing ahead of each B request: {waits:?}");
    // TTFT (here: the whole answer) of B's requests within WAIT_BOUND of A's services.
    assert!(waits.iter().all(|&n| n <= WAIT_BOUND), "{waits:?}");
    // The bound held under contention: B's requests were sent while A's burst still waited.
    // B's throughput keeps up with what it sends (half its share), as each of its requests
    // is served within the bound of its arrival.
    assert!(
        contended >= 3 * steady as usize / 4,
        "only {contended} B requests met the burst"
    );
    // Each replica's fair share counted the other's services.
    for p in replicas.iter() {
        let counters = p.driver.fair_counters();
        let a = counters.iter().find(|(t, _)| t.0 == 1).map(|&(_, c)| c).unwrap();
        // B's counter is there too (its lifts make it no measure of B's own services).
        assert!(counters.iter().any(|(t, _)| t.0 == 2));
        // A was served ten times B's tokens across the two replicas; neither replica served
        // more than about half of A's alone, so a view with A's counter past 0.6 of the total
        // counted its peer's services.
        let a_total = f64::from(burst) * f64::from(40 + OUTPUT);
        assert!(
            a >= 0.6 * a_total,
            "A's counter {a} of {a_total}: the peer's services are missing"
        );
        p.driver.check_invariants().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_a_priority_mix_high_priority_waits_little_and_low_priority_completes() {
    let Some(nats) = nats() else { return };
    let (_mocks, w) = worker().await;
    let replicas = Arc::new([
        proxy(Some(&nats), &w, Vec::new()).await,
        proxy(Some(&nats), &w, Vec::new()).await,
    ]);
    let client = client();
    let t = service_time(&client, &replicas[0]).await;
    let (low, high) = (80u32, 10u32);
    let mut tasks = Vec::new();
    // vLLM's convention: lower is served first. The mock, as vLLM without priority scheduling,
    // refuses a non-zero priority: every request succeeding shows the proxy took it out.
    for n in 0..low {
        let (client, replicas) = (client.clone(), Arc::clone(&replicas));
        tasks.push(tokio::spawn(async move {
            let p = &replicas[n as usize % 2];
            timed(client, p, n, 0, Vec::new(), json!({"priority": 5})).await
        }));
    }
    eventually("the low-priority requests wait in the queues", || {
        replicas
            .iter()
            .map(|p| p.driver.snapshot().queued_now)
            .sum::<usize>() as u32
            >= low / 2
    })
    .await;
    for n in 0..high {
        let (client, replicas) = (client.clone(), Arc::clone(&replicas));
        tasks.push(tokio::spawn(async move {
            let p = &replicas[n as usize % 2];
            timed(client, p, 1000 + n, 1, Vec::new(), json!({"priority": -1})).await
        }));
        tokio::time::sleep(2 * t).await;
    }
    let mut done = Vec::new();
    for task in tasks {
        done.push(task.await.unwrap());
    }
    let mut waits = overtaken(&done, 1);
    waits.sort_unstable();
    eprintln!("service time {t:?}; low-priority requests finishing ahead of each high one: {waits:?}");
    // p99 of ten is the largest.
    assert!(*waits.last().unwrap() <= WAIT_BOUND, "{waits:?}");
    // Every low-priority request completed (`timed` asserts each one's 200).
    assert_eq!(done.iter().filter(|d| d.class == 0).count() as u32, low);
    for p in replicas.iter() {
        let text = p.driver.metrics.render();
        assert!(
            text.contains("kvroute_tenant_requests_total{priority=\"-1\",tenant=\"other\"}"),
            "per-priority metrics"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_limit_gets_429_with_retry_after_and_others_pass() {
    let (_mocks, w) = worker().await;
    let mut limited = tenant("a", 1);
    limited.requests_per_interval = Some(2);
    limited.api_keys = vec!["sk-tenant-a".to_owned()];
    let p = proxy(None, &w, vec![limited, tenant("b", 1)]).await;
    let client = client();
    let key = || vec![("authorization", "Bearer sk-tenant-a".to_owned())];
    for n in 0..2 {
        let (status, body, _) = send(&client, &p, n, &key(), json!({})).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body, retry) = send(&client, &p, 2, &key(), json!({})).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
    assert_eq!(body["error"]["type"], "requests", "{body}");
    // Two per minute: the next one fits in about 30 s.
    let retry: u64 = retry.expect("a Retry-After header").parse().unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
    // Another tenant, and requests of none, are not limited by A's bucket.
    let (status, body, _) = send(&client, &p, 3, &[("x-tenant", "b".to_owned())], json!({})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body, _) = send(&client, &p, 4, &[], json!({})).await;
    assert_eq!(status, 200, "{body}");
    let text = p.driver.metrics.render();
    assert!(
        text.contains("kvroute_tenant_rate_limited_total{limit=\"requests\",tenant=\"a\"} 1"),
        "{text}"
    );
}
