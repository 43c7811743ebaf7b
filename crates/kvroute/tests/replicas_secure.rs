//! Router replicas through a `nats-server` that requires a user and password and TLS (started
//! by each test on a free loopback port, with a CA and a server certificate the test makes):
//! `kvroute serve` replicas sync their registry and load through it; a worker's `api-key` never
//! travels (a peer calls the worker with its own configuration's credential, or refuses it); no
//! message on the server, no health answer and no start-up error carries a secret.
//!
//! Without nats-server the tests skip, saying so; in CI (`CI=true`) they fail instead.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::net::HttpClient;
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::worker::StateName;
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_sync::server::{NatsServer, ServerAuth, ServerSecurity, ServerTls};
use kvroute_testkit::{External, Pki, eventually, require};
use serde_json::{Value, json};

const USER: &str = "kvroute";
const PASSWORD: &str = "nats-pw-7c1d2e9f4a0b";
/// The credential the operator gives the worker added on replica A.
const WORKER_KEY: &str = "sk-worker-3b8e1f0c9d2a7e64";
/// Replica B's own credential for workers its peers add.
const PEER_KEY: &str = "sk-peer-5a9c0e7d1b3f8264";

/// The test PKI, with the password files beside it.
fn files() -> Pki {
    let pki = Pki::new();
    pki.write("password", &format!("{PASSWORD}\n"));
    pki.write("peer-key", &format!("{PEER_KEY}\n"));
    pki.write("wrong-password", "not-the-password\n");
    pki
}

/// A server requiring `USER`/`PASSWORD` over TLS; `None` (the test skips, saying so) without
/// nats-server, outside CI.
fn nats(files: &Pki) -> Option<NatsServer> {
    if !require(External::NatsServer, NatsServer::binary().is_some()) {
        return None;
    }
    let security = ServerSecurity {
        auth: Some(ServerAuth::UserPassword {
            user: USER.into(),
            password: PASSWORD.into(),
        }),
        tls: Some(ServerTls {
            cert: files.path("server.pem"),
            key: files.path("server-key.pem"),
            verify_clients: None,
        }),
    };
    Some(NatsServer::start_with(security).unwrap())
}

/// Every message the server carries, as text, from a client of its own subscribed to all.
async fn spy(nats: &NatsServer, files: &Pki) -> Arc<Mutex<Vec<String>>> {
    let client = async_nats::ConnectOptions::with_user_and_password(USER.into(), PASSWORD.into())
        .add_root_certificates(files.path("ca.pem"))
        .require_tls(true)
        .connect(nats.url())
        .await
        .unwrap();
    let mut all = client.subscribe(">").await.unwrap();
    client.flush().await.unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    tokio::spawn(async move {
        let _client = client;
        while let Some(m) = all.next().await {
            // The raw bytes (a secret in them would show), and the message read back as JSON.
            let read = kvroute_sync::decode(&m.payload)
                .map(|e| serde_json::to_string(&e.body).unwrap())
                .unwrap_or_default();
            let text = format!("{} {} {read}", m.subject, String::from_utf8_lossy(&m.payload));
            sink.lock().unwrap().push(text);
        }
    });
    seen
}

async fn mocks(n: usize) -> Vec<MockWorker> {
    mock::start(&MockConfig::new(n), Arc::new(Model::tiny().unwrap()))
        .await
        .unwrap()
}

/// A `kvroute serve` configuration synced through `nats` as `USER`, its password from
/// `password_file`, TLS verified by the test's CA.
fn config(nats: &NatsServer, files: &Pki, password_file: &str, workers: &[WorkerConfig]) -> ServeConfig {
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin-listen = \"127.0.0.1:0\"\nhealth-interval-ms = 200\n\
         nats = \"{}\"\nnats-heartbeat-ms = 200\nnats-peer-timeout-ms = 1000\n\
         nats-user = \"{USER}\"\nnats-password-file = \"{}\"\nnats-tls-ca = \"{}\"\n",
        nats.url(),
        files.path(password_file).display(),
        files.path("ca.pem").display(),
    );
    let mut config = ServeConfig::from_toml_str(&text).unwrap();
    config.workers = workers.to_vec();
    config.validate().unwrap();
    config
}

async fn start(config: ServeConfig) -> Result<ProxyHandle, String> {
    kvroute_proxy::start(config, Some(Arc::new(Model::tiny().unwrap())))
        .await
        .map_err(|e| e.to_string())
}

/// Worker `url` in `proxy`'s registry: its state and the credential it is called with.
fn worker(proxy: &ProxyHandle, url: &str) -> Option<(StateName, Option<String>)> {
    proxy
        .driver
        .worker_statuses()
        .into_iter()
        .find(|w| w.config.url.trim_end_matches('/') == url.trim_end_matches('/'))
        .map(|w| (w.state, w.config.api_key))
}

async fn call(client: &HttpClient, method: &str, url: String, body: &Value) -> (u16, String) {
    let request = hyper::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_sync_through_nats_with_a_password_and_tls_and_no_message_carries_a_secret() {
    let files = files();
    let Some(nats) = nats(&files) else { return };
    let seen = spy(&nats, &files).await;
    let mut mocks = mocks(3).await;
    let extra = mocks.pop().unwrap();
    let w: Vec<WorkerConfig> = mocks
        .iter()
        .map(|m| WorkerConfig::parse_flag(&m.worker_flag()).unwrap())
        .collect();
    let a = start(config(&nats, &files, "password", &w)).await.unwrap();
    let mut with_peer_key = config(&nats, &files, "password", &w);
    with_peer_key.replicas.peer_worker_api_key_file = Some(files.path("peer-key"));
    let b = start(with_peer_key).await.unwrap();
    assert_eq!(a.driver.sync_link().map(|l| l.name()), Some("connected"));
    let client = kvroute_http::net::client(Duration::from_secs(5));
    // An operator adds a worker with its engine's credential on A.
    let mut added = WorkerConfig::parse_flag(&extra.worker_flag()).unwrap();
    added.api_key = Some(WORKER_KEY.into());
    let url = added.url.clone();
    let body = serde_json::to_value(&added).unwrap();
    let (status, answer) = call(&client, "POST", format!("{}/admin/workers", a.admin_url()), &body).await;
    assert_eq!(status, 201, "{answer}");
    // B adds it, called with B's own credential for its peers' workers.
    eventually("B has A's worker, ready", || {
        worker(&b, &url).is_some_and(|(s, _)| s == StateName::Ready)
    })
    .await;
    assert_eq!(worker(&b, &url).unwrap().1.as_deref(), Some(PEER_KEY));
    assert_eq!(worker(&a, &url).unwrap().1.as_deref(), Some(WORKER_KEY));
    // C has no credential for it: it joins with the rest of the registry and refuses that one.
    let c = start(config(&nats, &files, "password", &w)).await.unwrap();
    assert!(worker(&c, &mocks[0].url()).is_some(), "C has its own workers");
    assert!(
        worker(&c, &url).is_none(),
        "C refused a worker it has no credential for"
    );
    // Load flows too: a request through A is booked, and its booking told to the peers.
    let (status, answer) = call(
        &client,
        "POST",
        format!("{}/v1/completions", a.url()),
        &json!({"prompt": "hello there", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let saw = |what: &str| seen.lock().unwrap().iter().any(|m| m.contains(what));
    eventually("the spy saw the worker's announcement", || {
        saw(&format!("\"op\":\"added\",\"config\":{{\"url\":\"{url}\""))
    })
    .await;
    eventually("the spy saw a booking", || saw("\"t\":\"added\"")).await;
    let messages = seen.lock().unwrap().clone();
    let mut health = Vec::new();
    for p in [&a, &b, &c] {
        health.push(
            call(&client, "GET", format!("{}/health", p.url()), &json!({}))
                .await
                .1,
        );
    }
    for secret in [WORKER_KEY, PEER_KEY, PASSWORD] {
        for m in &messages {
            assert!(!m.contains(secret), "a sync message carries a secret: {m}");
        }
        for h in &health {
            assert!(!h.contains(secret), "a health answer shows a secret: {h}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_an_unknown_ca_stops_a_replica_at_start_naming_the_keys() {
    let files = files();
    let Some(nats) = nats(&files) else { return };
    let err = start(config(&nats, &files, "wrong-password", &[]))
        .await
        .unwrap_err();
    assert!(
        err.contains("authorization violation") && err.contains("nats-user and nats-password"),
        "{err}"
    );
    assert!(
        !err.contains("not-the-password") && !err.contains(PASSWORD),
        "{err}"
    );
    let mut no_ca = config(&nats, &files, "password", &[]);
    no_ca.replicas.nats_tls_ca = None;
    let err = start(no_ca).await.unwrap_err();
    assert!(
        err.contains("TLS handshake failed") && err.contains("nats-tls-ca"),
        "{err}"
    );
    assert!(!err.contains(PASSWORD), "{err}");
}
