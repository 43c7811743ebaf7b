//! Session affinity end to end: two `kvroute serve` proxies with `session-header` sharing a real
//! `nats-server` (started by the test on a free loopback port; where none is installed the test
//! skips, saying so, and fails in CI) in front of three mock workers. A conversation's requests,
//! sent alternately to both replicas, all reach one worker; a replica started later learns the
//! bindings from its peers' snapshot.
//!
//! Each wait is on an explicit condition, polled with a generous deadline; none asserts after a
//! fixed sleep.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::net::HttpClient;
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::observed::WORKER_HEADER;
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_sync::server::NatsServer;
use kvroute_testkit::{External, eventually, require};
use serde_json::json;

const SESSION_HEADER: &str = "x-session-id";

fn nats() -> Option<NatsServer> {
    require(External::NatsServer, NatsServer::binary().is_some()).then(|| NatsServer::start().unwrap())
}

async fn mocks(n: usize) -> Vec<MockWorker> {
    mock::start(&MockConfig::new(n), Arc::new(Model::tiny().unwrap()))
        .await
        .unwrap()
}

fn workers(mocks: &[MockWorker]) -> Vec<WorkerConfig> {
    mocks
        .iter()
        .map(|m| WorkerConfig::parse_flag(&m.worker_flag()).unwrap())
        .collect()
}

/// A proxy in front of `workers`, synced through `nats`, keeping sessions by [`SESSION_HEADER`]
/// and naming the worker of each answer.
async fn replica(nats: &NatsServer, workers: &[WorkerConfig]) -> ProxyHandle {
    let config = ServeConfig {
        server: kvroute_proxy::config::ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            debug_headers: true,
            ..Default::default()
        },
        routing: kvroute_proxy::config::RoutingConfig {
            session_header: Some(SESSION_HEADER.into()),
            ..Default::default()
        },
        replicas: kvroute_proxy::config::ReplicasConfig {
            nats: Some(nats.url()),
            nats_heartbeat_ms: 200,
            nats_peer_timeout_ms: 1000,
            ..Default::default()
        },
        workers: workers.to_vec(),
        ..ServeConfig::default()
    };
    kvroute_proxy::start(config, Some(Arc::new(Model::tiny().unwrap())))
        .await
        .unwrap()
}

/// Sessions `proxy`'s router holds now.
fn sessions(proxy: &ProxyHandle) -> usize {
    proxy.driver.snapshot().sessions_now
}

/// A prompt sharing no full block with any other (its first token differs): where the policy
/// alone sends it is a draw among idle workers.
fn prompt(session: u32, turn: u32) -> serde_json::Value {
    let tokens: Vec<u32> = (0..48)
        .map(|i| 1 + (session * 61 + turn * 13 + i * 7) % 250)
        .collect();
    json!(tokens)
}

/// A short completion of `session` on `proxy`, which must succeed: the base URL of the worker
/// that served it.
async fn complete(
    client: &HttpClient,
    proxy: &ProxyHandle,
    mocks: &[MockWorker],
    session: &str,
    prompt: serde_json::Value,
) -> String {
    let body = json!({"prompt": prompt, "max_tokens": 2});
    let request = hyper::Request::post(format!("{}/v1/completions", proxy.url()))
        .header("content-type", "application/json")
        .header(SESSION_HEADER, session)
        .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status();
    let worker: u64 = response.headers()[WORKER_HEADER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    // The proxy's worker id, by the URL it registered.
    let urls: Vec<String> = mocks.iter().map(|m| m.url()).collect();
    urls.into_iter()
        .find(|url| proxy.driver.find_worker(url).is_some_and(|id| id.0 == worker))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sessions_requests_sent_alternately_to_two_replicas_stay_on_one_worker() {
    let Some(nats) = nats() else { return };
    let mocks = mocks(3).await;
    let w = workers(&mocks);
    let (a, b) = (replica(&nats, &w).await, replica(&nats, &w).await);
    let client = kvroute_http::net::client(std::time::Duration::from_secs(5));
    const SESSIONS: u32 = 4;
    const TURNS: u32 = 6;
    let mut homes = Vec::new();
    for s in 0..SESSIONS {
        let name = format!("conversation-{s}");
        let mut served = Vec::new();
        for turn in 0..TURNS {
            let proxy = if turn % 2 == 0 { &a } else { &b };
            served.push(complete(&client, proxy, &mocks, &name, prompt(s, turn)).await);
            // The booking reaches the other replica before its next turn is sent there.
            for p in [&a, &b] {
                eventually("both replicas hold the session", || sessions(p) == s as usize + 1).await;
            }
        }
        assert!(
            served.iter().all(|url| *url == served[0]),
            "session {s} was served by {served:?}"
        );
        homes.push(served[0].clone());
    }
    // Every turn but a session's first was a hit, half of them on each replica.
    for p in [&a, &b] {
        let scrape = {
            p.driver.snapshot();
            p.driver.metrics.render()
        };
        let hits = format!(
            "kvroute_router_session_requests_total{{outcome=\"hit\"}} {}",
            SESSIONS * (TURNS / 2 - 1) + if std::ptr::eq(p, &b) { SESSIONS } else { 0 }
        );
        assert!(scrape.contains(&hits), "{hits} not in\n{scrape}");
        assert!(
            scrape.contains("kvroute_router_session_requests_total{outcome=\"moved\"} 0"),
            "{scrape}"
        );
    }
    // A replica started now learns every binding from its peers' snapshots.
    let c = replica(&nats, &w).await;
    assert_eq!(sessions(&c), SESSIONS as usize);
    for (s, home) in homes.iter().enumerate() {
        let name = format!("conversation-{s}");
        let url = complete(&client, &c, &mocks, &name, prompt(s as u32, 99)).await;
        assert_eq!(url, *home, "session {s} on the replica that joined late");
    }
    for p in [&a, &b, &c] {
        eventually("every view drains", || p.driver.snapshot().active_now == 0).await;
        p.driver.check_invariants().unwrap();
    }
}
