//! Router replicas on NATS, end to end: three `kvroute serve` proxies sharing a real
//! `nats-server` (started by each test on a free loopback port; where none is installed the tests
//! skip, saying so, and fail in CI) in front of one set of mock workers.
//!
//! Each test waits on explicit conditions, polled with a generous deadline; none asserts after a
//! fixed sleep.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvroute_core::ids::WorkerId;
use kvroute_http::Model;
use kvroute_http::net::HttpClient;
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::worker::StateName;
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_sync::server::NatsServer;
use kvroute_testkit::{External, eventually, eventually_or, require};
use serde_json::{Value, json};

/// Heartbeats and the peer timeout of the replicas under test.
const HEARTBEAT_MS: u64 = 200;
const PEER_TIMEOUT_MS: u64 = 1000;
/// An output no test waits for: the request stays in flight until its client leaves.
const FOREVER_TOKENS: u32 = 100_000;

/// A nats-server of the test's own, or `None` where none is installed (outside CI only).
fn nats() -> Option<NatsServer> {
    require(External::NatsServer, NatsServer::binary().is_some()).then(|| NatsServer::start().unwrap())
}

async fn mocks(n: usize) -> Vec<MockWorker> {
    let mut mc = MockConfig::new(n);
    // Real time: a long output takes minutes, so requests stay in flight while a test looks.
    mc.engine.speedup = 1.0;
    mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap()
}

fn workers(mocks: &[MockWorker]) -> Vec<WorkerConfig> {
    mocks
        .iter()
        .map(|m| WorkerConfig::parse_flag(&m.worker_flag()).unwrap())
        .collect()
}

/// A proxy in front of `workers`, synced through `nats` if given.
async fn replica(nats: Option<&NatsServer>, workers: &[WorkerConfig]) -> ProxyHandle {
    let config = ServeConfig {
        server: kvroute_proxy::config::ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..Default::default()
        },
        upstream: kvroute_proxy::config::UpstreamConfig {
            health_interval_ms: 200,
            ..Default::default()
        },
        replicas: kvroute_proxy::config::ReplicasConfig {
            nats: nats.map(NatsServer::url),
            nats_heartbeat_ms: HEARTBEAT_MS,
            nats_peer_timeout_ms: PEER_TIMEOUT_MS,
            ..Default::default()
        },
        workers: workers.to_vec(),
        ..ServeConfig::default()
    };
    kvroute_proxy::start(config, Some(Arc::new(Model::tiny().unwrap())))
        .await
        .unwrap()
}

/// Requests the proxy's router books now (its own and its peers').
fn active(p: &ProxyHandle) -> usize {
    p.driver.snapshot().active_now
}

fn client() -> HttpClient {
    kvroute_http::net::client(Duration::from_secs(5))
}

async fn post(client: &HttpClient, proxy: &ProxyHandle, body: &Value) -> hyper::Response<Incoming> {
    let request = hyper::Request::post(format!("{}/v1/completions", proxy.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    client.request(request).await.unwrap()
}

/// A short completion that must succeed: its usage.
async fn complete(client: &HttpClient, proxy: &ProxyHandle, prompt: Value) -> Value {
    let response = post(client, proxy, &json!({"prompt": prompt, "max_tokens": 2})).await;
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice::<Value>(&body).unwrap()["usage"].clone()
}

/// A streamed completion that runs until its body is dropped: returned once its first chunk
/// came (it is routed and booked).
async fn in_flight(client: &HttpClient, proxy: &ProxyHandle, prompt: &str) -> Incoming {
    let body = json!({"prompt": prompt, "max_tokens": FOREVER_TOKENS, "stream": true});
    let response = post(client, proxy, &body).await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    body
}

/// Group `g`'s prompt for round `r`: a 128-token prefix shared by the group (8 full blocks) and
/// an 8-token tail of its own (no full block), so that the workers' caches hold only prefixes.
fn prompt(g: u32, r: u32) -> Value {
    let mut tokens: Vec<u32> = (0..128).map(|i| 1 + (g * 131 + i * 7) % 250).collect();
    tokens.extend((0..8).map(|i| 1 + (r * 17 + g * 3 + i) % 250));
    json!(tokens)
}

/// Runs `rounds` rounds of one request per group, each round's requests at once, spread over
/// `proxies` in turn; between rounds waits until every proxy's view holds each group's prefix
/// and books nothing.
/// The engines' cached share of prompt tokens.
async fn cached_share(proxies: &[&ProxyHandle], groups: u32, rounds: u32) -> f64 {
    let client = client();
    let (mut cached, mut prompt_tokens) = (0, 0);
    let mut turn = 0;
    for r in 0..rounds {
        let mut tasks = Vec::new();
        for g in 0..groups {
            let proxy = proxies[turn % proxies.len()];
            turn += 1;
            tasks.push(complete(&client, proxy, prompt(g, r)));
        }
        for usage in futures_util::future::join_all(tasks).await {
            cached += usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            prompt_tokens += usage["prompt_tokens"].as_u64().unwrap();
        }
        // Between rounds, every view settles: each group's 8 prefix blocks, stored on at least
        // one worker, are in it, and the round's requests are freed in it (a peer's free comes
        // a batch later than the answer).
        let want = u64::from(groups) * 8;
        for p in proxies {
            let held = |p: &ProxyHandle| {
                p.driver
                    .snapshot()
                    .workers
                    .iter()
                    .map(|w| w.cached_blocks)
                    .sum::<u64>()
            };
            eventually("the prefixes reach every view", || held(p) >= want).await;
            eventually("the round is freed in every view", || active(p) == 0).await;
        }
    }
    cached as f64 / prompt_tokens as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_synced_replicas_cache_as_well_as_one_router() {
    let Some(nats) = nats() else { return };
    let (groups, rounds) = (8, 5);
    // One router.
    let one = {
        let mocks = mocks(4).await;
        let proxy = replica(None, &workers(&mocks)).await;
        cached_share(&[&proxy], groups, rounds).await
    };
    // Three replicas on fresh workers (cold caches), the same workload spread over them.
    let mocks = mocks(4).await;
    let w = workers(&mocks);
    let (a, b, c) = (
        replica(Some(&nats), &w).await,
        replica(Some(&nats), &w).await,
        replica(Some(&nats), &w).await,
    );
    let three = cached_share(&[&a, &b, &c], groups, rounds).await;
    eprintln!("cached share: one router {one:.4}, three synced replicas {three:.4}");
    // Sync traffic per request (BENCHMARKS.md), from the replicas' own counters.
    let sum = |name: &str| -> f64 {
        [&a, &b, &c]
            .iter()
            .flat_map(|p| {
                let text = p.driver.metrics.render();
                text.lines()
                    .filter(|l| l.starts_with(name))
                    .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .collect::<Vec<_>>()
            })
            .sum()
    };
    let n = f64::from(groups * rounds);
    eprintln!(
        "sync traffic per request: {:.2} messages ({:.2} event batches), {:.0} bytes, {:.2} events sent; {:.2} messages received",
        sum("kvroute_sync_messages_sent_total") / n,
        sum("kvroute_sync_messages_sent_total{kind=\"events\"}") / n,
        sum("kvroute_sync_bytes_sent_total") / n,
        sum("kvroute_sync_events_sent_total") / n,
        sum("kvroute_sync_messages_received_total") / n,
    );
    assert!(one > 0.5, "the workload reuses prefixes: {one}");
    assert!(
        (three - one).abs() <= 0.02 * one,
        "three replicas {three:.4} vs one router {one:.4}"
    );
    for p in [&a, &b, &c] {
        eventually("every request freed in every view", || active(p) == 0).await;
        p.driver.check_invariants().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_replicas_load_is_released_by_its_peers_and_no_other_request_fails() {
    let Some(nats) = nats() else { return };
    let mocks = mocks(3).await;
    let w = workers(&mocks);
    let (a, b) = (replica(Some(&nats), &w).await, replica(Some(&nats), &w).await);
    let c = replica(Some(&nats), &w).await;
    let client = client();
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(in_flight(&client, &c, &format!("story {i}")).await);
    }
    for p in [&a, &b] {
        eventually("the peers see C's three requests", || active(p) == 3).await;
    }
    // Requests on A and B go on throughout.
    let traffic = {
        let (client, a, b) = (client.clone(), a.url(), b.url());
        tokio::spawn(async move {
            let mut n = 0;
            loop {
                for url in [&a, &b] {
                    let request = hyper::Request::post(format!("{url}/v1/completions"))
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(
                            serde_json::to_vec(&json!({"prompt": format!("side {n}"), "max_tokens": 2}))
                                .unwrap(),
                        )))
                        .unwrap();
                    let response = client.request(request).await.unwrap();
                    let status = response.status();
                    let body = response.into_body().collect().await.unwrap().to_bytes();
                    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
                    n += 1;
                }
                tokio::task::yield_now().await;
            }
        })
    };
    // Killed: silent at once (no goodbye, no frees), then gone.
    c.driver.stop_sync();
    let killed = Instant::now();
    drop(c);
    drop(held);
    for p in [&a, &b] {
        // The side traffic has at most one request in flight (A's or B's, seen by both).
        eventually("C's load released", || active(p) <= 1).await;
    }
    let released = killed.elapsed();
    eprintln!("C's load released {released:?} after it died (peer timeout {PEER_TIMEOUT_MS} ms)");
    assert!(
        released < Duration::from_millis(PEER_TIMEOUT_MS) + Duration::from_secs(10),
        "released after {released:?}, not within the timeout"
    );
    assert!(
        !traffic.is_finished(),
        "a side request failed: {:?}",
        traffic.await
    );
    traffic.abort();
    for p in [&a, &b] {
        eventually("A and B drain", || active(p) == 0).await;
        p.driver.check_invariants().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn routing_goes_on_without_nats_and_the_view_converges_when_it_returns() {
    let Some(mut nats) = nats() else { return };
    let mocks = mocks(3).await;
    let w = workers(&mocks);
    let proxies = [
        replica(Some(&nats), &w).await,
        replica(Some(&nats), &w).await,
        replica(Some(&nats), &w).await,
    ];
    let client = client();
    let health = |p: &ProxyHandle| p.driver.sync_link().map(kvroute_sync::LinkState::name);
    nats.stop();
    for p in &proxies {
        eventually("each replica says sync is down", || {
            health(p) == Some("disconnected")
        })
        .await;
    }
    // Routing goes on, each replica on its own view.
    for (i, p) in proxies.iter().enumerate() {
        complete(&client, p, json!(format!("alone {i}"))).await;
    }
    let mut held = Vec::new();
    for i in 0..2 {
        held.push(in_flight(&client, &proxies[1], &format!("during the outage {i}")).await);
    }
    held.push(in_flight(&client, &proxies[2], "one more").await);
    // Each replica books only its own: its peers' requests never reached it, and none of its
    // peers' bookings from before the outage outlive the peer timeout.
    for (p, own) in proxies.iter().zip([0, 2, 1]) {
        eventually("each view is its own", || active(p) == own).await;
    }
    nats.restart().unwrap();
    for p in &proxies {
        eventually("each replica reconnects", || health(p) == Some("connected")).await;
    }
    // The view converges: every replica books all three requests in flight.
    for p in &proxies {
        eventually_or(
            || {
                format!(
                    "the views converge: {:?}",
                    proxies.iter().map(active).collect::<Vec<_>>()
                )
            },
            || active(p) == 3,
        )
        .await;
    }
    drop(held);
    for p in &proxies {
        eventually("every view drains", || active(p) == 0).await;
        p.driver.check_invariants().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_started_mid_run_routes_with_its_peers_load_from_its_first_request() {
    let Some(nats) = nats() else { return };
    let mocks = mocks(2).await;
    let w = workers(&mocks);
    let (a, b) = (replica(Some(&nats), &w).await, replica(Some(&nats), &w).await);
    let client = client();
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(in_flight(&client, &a, &format!("a {i}")).await);
        held.push(in_flight(&client, &b, &format!("b {i}")).await);
    }
    for p in [&a, &b] {
        eventually("A and B see all six", || active(p) == 6).await;
    }
    let per_worker = |p: &ProxyHandle| {
        let m = p.driver.snapshot();
        m.workers.iter().map(|w| w.load.requests).collect::<Vec<_>>()
    };
    let c = replica(Some(&nats), &w).await;
    // No waiting: the join happened before `start` returned.
    assert_eq!(active(&c), 6, "C starts with its peers' in-flight requests");
    assert_eq!(per_worker(&c), per_worker(&a), "on the same workers");
    complete(&client, &c, json!("C's first request")).await;
    drop(held);
    for p in [&a, &b, &c] {
        eventually("every view drains", || active(p) == 0).await;
        p.driver.check_invariants().unwrap();
    }
}

/// An admin API call on `proxy`: (status, body).
async fn admin(
    client: &HttpClient,
    proxy: &ProxyHandle,
    method: &str,
    path: &str,
    body: Value,
) -> (u16, Value) {
    let request = hyper::Request::builder()
        .method(method)
        .uri(format!("{}{path}", proxy.admin_url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// Worker `url`'s entry in `proxy`'s registry (`None`: not there).
fn status_of(proxy: &ProxyHandle, url: &str) -> Option<kvroute_proxy::registry::WorkerStatus> {
    let url = url.trim_end_matches('/');
    proxy
        .driver
        .worker_statuses()
        .into_iter()
        .find(|w| w.config.url.trim_end_matches('/') == url)
}

/// Worker `url`'s state in `proxy`'s registry (`None`: not there).
fn state_of(proxy: &ProxyHandle, url: &str) -> Option<StateName> {
    status_of(proxy, url).map(|w| w.state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_operators_add_drain_and_remove_on_one_replica_hold_on_all() {
    let Some(nats) = nats() else { return };
    let mut mocks = mocks(3).await;
    let extra = mocks.pop().unwrap();
    let w = workers(&mocks);
    let (a, b) = (replica(Some(&nats), &w).await, replica(Some(&nats), &w).await);
    let client = client();
    let url = extra.url();
    let config = serde_json::to_value(WorkerConfig::parse_flag(&extra.worker_flag()).unwrap()).unwrap();
    let (status, body) = admin(&client, &a, "POST", "/admin/workers", config).await;
    assert_eq!(status, 201, "{body}");
    eventually("B has the worker A added, and routes to it", || {
        state_of(&b, &url) == Some(StateName::Ready)
    })
    .await;
    // A replica started now learns of it from its peers.
    let c = replica(Some(&nats), &w).await;
    assert!(state_of(&c, &url).is_some(), "C joined with the registry");
    let id = body["id"].as_u64().unwrap();
    let (status, body) = admin(
        &client,
        &a,
        "POST",
        &format!("/admin/workers/{id}/drain"),
        json!({}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for p in [&b, &c] {
        eventually("the drain holds on every replica", || {
            matches!(state_of(p, &url), Some(StateName::Draining | StateName::Drained))
        })
        .await;
    }
    let (status, body) = admin(&client, &a, "DELETE", &format!("/admin/workers/{id}"), json!({})).await;
    assert!((200..300).contains(&status), "{status} {body}");
    for p in [&b, &c] {
        eventually("the removal holds on every replica", || {
            state_of(p, &url).is_none()
        })
        .await;
    }
}

/// Worker `url`'s id in `proxy`'s registry (`None`: not there).
fn id_of(proxy: &ProxyHandle, url: &str) -> Option<u64> {
    status_of(proxy, url).map(|w| w.id)
}

/// `proxy`'s `/metrics` as a scrape sees it (the gauges refreshed first, as the handler does).
fn scrape(proxy: &ProxyHandle) -> String {
    proxy.driver.snapshot();
    proxy.driver.metrics.render()
}

/// The series of `scrape` that name worker `id` (by either id label: `worker_id`, or the KV
/// subscribers' `worker`) or `url`.
fn series_of(scrape: &str, id: u64, url: &str) -> Vec<String> {
    let labels = [format!("worker_id=\"{id}\""), format!("worker=\"{id}\"")];
    scrape
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| labels.iter().any(|label| l.contains(label.as_str())) || l.contains(url))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_removed_on_one_replica_is_gone_on_every_replica_with_its_subscribers_and_series() {
    let Some(nats) = nats() else { return };
    let mocks = mocks(3).await;
    let w = workers(&mocks);
    let proxies = [
        replica(Some(&nats), &w).await,
        replica(Some(&nats), &w).await,
        replica(Some(&nats), &w).await,
    ];
    let client = client();
    let url = mocks[2].url();
    let url = url.trim_end_matches('/');
    let ids: Vec<u64> = proxies.iter().map(|p| id_of(p, url).unwrap()).collect();
    // Before: on every replica the worker has its KV-event subscriber running, its counters
    // exported (only while the subscriber's task runs) and its per-worker series.
    for (p, &id) in proxies.iter().zip(&ids) {
        assert_eq!(p.driver.subscriber_count(WorkerId(id)), Some(1));
        let subscribed = format!("kvroute_kv_events_received_total{{dp_rank=\"0\",worker=\"{id}\"}}");
        eventually("the worker's subscriber is exported on every replica", || {
            scrape(p).contains(&subscribed)
        })
        .await;
        let series = series_of(&scrape(p), id, url);
        assert!(
            series.iter().any(|l| l.starts_with("kvroute_worker_up{")),
            "{series:#?}"
        );
    }
    // An operator removes it on the first replica.
    let (status, body) = admin(
        &client,
        &proxies[0],
        "DELETE",
        &format!("/admin/workers/{}", ids[0]),
        json!({}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // Gone on every replica: from the registry, with its subscribers stopped (their counters
    // are exported by their tasks alone) and every series naming it.
    for (p, &id) in proxies.iter().zip(&ids) {
        eventually("the removal holds on every replica", || {
            state_of(p, url).is_none()
        })
        .await;
        eventually_or(
            || format!("its series are gone: {:#?}", series_of(&scrape(p), id, url)),
            || series_of(&scrape(p), id, url).is_empty(),
        )
        .await;
        assert_eq!(p.driver.subscriber_count(WorkerId(id)), None);
    }
    // The others serve on, and their subscribers and series stay.
    for p in &proxies {
        complete(&client, p, json!("after the removal")).await;
        for other in &mocks[..2] {
            let id = id_of(p, &other.url()).unwrap();
            assert_eq!(p.driver.subscriber_count(WorkerId(id)), Some(1));
            assert!(!series_of(&scrape(p), id, other.url().trim_end_matches('/')).is_empty());
        }
        eventually("every view drains", || active(p) == 0).await;
        p.driver.check_invariants().unwrap();
    }
}
