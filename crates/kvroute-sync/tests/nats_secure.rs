//! The transport through a `nats-server` that requires credentials and TLS, started by each test
//! on a free loopback port with a CA and certificates the test makes: replicas sync with a token
//! or a user and password, over TLS and over mutual TLS; a wrong or missing credential, a server
//! certificate the configured CA did not sign, and a server without TLS when TLS is required are
//! each refused at start with an error that names what to check and never a credential.
//!
//! Without nats-server the tests skip, saying so; in CI (`CI=true`) they fail instead.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_core::router::RouterId;
use kvroute_core::router::replica::Urgency;
use kvroute_sync::server::{NatsServer, ServerAuth, ServerSecurity, ServerTls};
use kvroute_sync::{
    ClientCertificate, NatsAuth, NatsSyncConfig, NatsTls, Secret, SyncError, SyncHost, SyncItem, SyncMetrics,
    SyncTransport,
};
use kvroute_testkit::{External, Pki, eventually, require};

const TOKEN: &str = "tok-5f1e9a";
const USER: &str = "router";
const PASSWORD: &str = "pw-c0ffee-42";

/// The test's TLS settings made from the shared test PKI.
trait TlsFiles {
    fn server_tls(&self, mutual: bool) -> ServerTls;
    fn client_tls(&self, mutual: bool) -> NatsTls;
}

impl TlsFiles for Pki {
    fn server_tls(&self, mutual: bool) -> ServerTls {
        ServerTls {
            cert: self.path("server.pem"),
            key: self.path("server-key.pem"),
            verify_clients: mutual.then(|| self.path("ca.pem")),
        }
    }

    /// TLS verified by this CA, with the client certificate if `mutual`.
    fn client_tls(&self, mutual: bool) -> NatsTls {
        NatsTls {
            required: true,
            ca: Some(self.path("ca.pem")),
            client: mutual.then(|| ClientCertificate {
                cert: self.path("client.pem"),
                key: self.path("client-key.pem"),
            }),
        }
    }
}

/// A server demanding `security`; `None` (the test skips, saying so) without nats-server,
/// outside CI.
fn server(security: ServerSecurity) -> Option<NatsServer> {
    require(External::NatsServer, NatsServer::binary().is_some())
        .then(|| NatsServer::start_with(security).expect("nats-server starts"))
}

#[derive(Default)]
struct Recorder {
    applied: Mutex<Vec<(RouterId, SyncItem)>>,
    state: Mutex<Vec<SyncItem>>,
}

impl SyncHost for Recorder {
    fn apply(&self, from: RouterId, events: &[SyncItem]) {
        let mut applied = self.applied.lock().unwrap();
        applied.extend(events.iter().map(|e| (from, e.clone())));
    }
    fn peer_lost(&self, _: RouterId) {}
    fn snapshot(&self) -> Vec<SyncItem> {
        self.state.lock().unwrap().clone()
    }
}

impl Recorder {
    fn from(&self, peer: RouterId) -> Vec<SyncItem> {
        let applied = self.applied.lock().unwrap();
        applied
            .iter()
            .filter(|(f, _)| *f == peer)
            .map(|(_, e)| e.clone())
            .collect()
    }
}

fn config(url: &str, auth: NatsAuth, tls: NatsTls) -> NatsSyncConfig {
    let mut c = NatsSyncConfig::new(url, "secure");
    c.heartbeat_interval = Duration::from_millis(100);
    c.peer_timeout = Duration::from_millis(600);
    c.join_timeout = Duration::from_secs(5);
    c.auth = auth;
    c.tls = tls;
    c
}

async fn start(id: u64, config: NatsSyncConfig) -> Result<(SyncTransport, Arc<Recorder>), SyncError> {
    let host = Arc::new(Recorder::default());
    let metrics = SyncMetrics::new(&prometheus::Registry::new()).unwrap();
    let sync = SyncTransport::start(RouterId(id), config, host.clone(), metrics).await?;
    Ok((sync, host))
}

/// Two replicas sync through `url` with `auth` and `tls`: B's join takes A's snapshot, and A's
/// changes reach B in order.
async fn two_replicas_sync(url: &str, auth: NatsAuth, tls: NatsTls) {
    let (a, host_a) = start(1, config(url, auth.clone(), tls.clone())).await.unwrap();
    *host_a.state.lock().unwrap() = vec![SyncItem::Freed { r: 7 }];
    let (_b, host_b) = start(2, config(url, auth, tls)).await.unwrap();
    assert_eq!(
        host_b.from(RouterId(1)),
        [SyncItem::Freed { r: 7 }],
        "B joined with A's snapshot"
    );
    let sent: Vec<SyncItem> = (0..100).map(|r| SyncItem::Freed { r }).collect();
    for e in &sent {
        a.outgoing().push(e.clone(), Urgency::Lazy);
    }
    eventually("B applied every batch A sent", || {
        host_b.from(RouterId(1)).len() > sent.len()
    })
    .await;
    assert_eq!(host_b.from(RouterId(1))[1..], sent[..], "in order, once each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sync_with_a_token_over_tls() {
    let pki = Pki::new();
    let Some(nats) = server(ServerSecurity {
        auth: Some(ServerAuth::Token(TOKEN.into())),
        tls: Some(pki.server_tls(false)),
    }) else {
        return;
    };
    assert!(nats.url().starts_with("tls://"), "{}", nats.url());
    two_replicas_sync(
        &nats.url(),
        NatsAuth::Token(Secret::new(TOKEN)),
        pki.client_tls(false),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_sync_with_a_user_and_password_over_mutual_tls() {
    let pki = Pki::new();
    let Some(nats) = server(ServerSecurity {
        auth: Some(ServerAuth::UserPassword {
            user: USER.into(),
            password: PASSWORD.into(),
        }),
        tls: Some(pki.server_tls(true)),
    }) else {
        return;
    };
    let auth = NatsAuth::UserPassword {
        user: USER.into(),
        password: Secret::new(PASSWORD),
    };
    two_replicas_sync(&nats.url(), auth, pki.client_tls(true)).await;
}

/// `SyncTransport::start`'s refusal, as text.
async fn refusal(config: NatsSyncConfig) -> String {
    match start(9, config).await {
        Err(e @ SyncError::Refused { .. }) => {
            eprintln!("refused, as it should be: {e}");
            e.to_string()
        }
        Err(other) => panic!("not a refusal: {other}"),
        Ok(_) => panic!("started"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_credentials_are_refused_naming_the_keys_not_the_values() {
    let pki = Pki::new();
    let Some(nats) = server(ServerSecurity {
        auth: Some(ServerAuth::UserPassword {
            user: USER.into(),
            password: PASSWORD.into(),
        }),
        tls: Some(pki.server_tls(false)),
    }) else {
        return;
    };
    let wrong = NatsAuth::UserPassword {
        user: USER.into(),
        password: Secret::new("not-the-password"),
    };
    let err = refusal(config(&nats.url(), wrong, pki.client_tls(false))).await;
    assert!(
        err.contains("authorization violation") && err.contains("nats-user and nats-password"),
        "{err}"
    );
    assert!(
        !err.contains("not-the-password") && !err.contains(PASSWORD),
        "{err}"
    );
    let err = refusal(config(&nats.url(), NatsAuth::None, pki.client_tls(false))).await;
    assert!(err.contains("requires credentials"), "{err}");
    let err = refusal(config(
        &nats.url(),
        NatsAuth::Token(Secret::new(TOKEN)),
        pki.client_tls(false),
    ))
    .await;
    assert!(
        err.contains("did not accept nats-token") && !err.contains(TOKEN),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_certificate_the_configured_ca_did_not_sign_is_refused() {
    let (pki, other) = (Pki::new(), Pki::new());
    let Some(nats) = server(ServerSecurity {
        auth: Some(ServerAuth::Token(TOKEN.into())),
        tls: Some(pki.server_tls(false)),
    }) else {
        return;
    };
    let token = || NatsAuth::Token(Secret::new(TOKEN));
    // No CA: the system's do not know the test CA.
    let no_ca = NatsTls {
        required: true,
        ..NatsTls::default()
    };
    let err = refusal(config(&nats.url(), token(), no_ca)).await;
    assert!(err.contains("TLS") && err.contains("set nats-tls-ca"), "{err}");
    // Another CA.
    let err = refusal(config(&nats.url(), token(), other.client_tls(false))).await;
    assert!(
        err.contains("UnknownIssuer") || err.contains("BadSignature"),
        "{err}"
    );
    assert!(err.contains(&other.path("ca.pem").display().to_string()), "{err}");
    assert!(!err.contains(TOKEN), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_without_a_client_certificate_is_refused() {
    let pki = Pki::new();
    let Some(nats) = server(ServerSecurity {
        auth: None,
        tls: Some(pki.server_tls(true)),
    }) else {
        return;
    };
    let err = refusal(config(&nats.url(), NatsAuth::None, pki.client_tls(false))).await;
    assert!(err.contains("set nats-tls-cert and nats-tls-key"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_tls_is_refused_when_tls_is_required() {
    let pki = Pki::new();
    let Some(nats) = server(ServerSecurity::default()) else {
        return;
    };
    let err = refusal(config(&nats.url(), NatsAuth::None, pki.client_tls(false))).await;
    assert!(err.contains("does the server speak TLS?"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_not_reachable_yet_is_not_a_refusal() {
    // A free port nobody listens on: the replica starts on its own view, as without credentials.
    let port = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let pki = Pki::new();
    let mut c = config(
        &format!("tls://127.0.0.1:{port}"),
        NatsAuth::Token(Secret::new(TOKEN)),
        pki.client_tls(false),
    );
    c.join_timeout = Duration::from_millis(300);
    let (sync, _) = start(3, c).await.unwrap();
    assert_eq!(sync.link(), kvroute_sync::LinkState::Disconnected);
}
