//! The transport against a real `nats-server` (where none is installed: skipped, saying so, and
//! a failure in CI): batches reach peers in order and never their sender, a joining replica gets every peer's
//! snapshot before `start` returns, a silent peer is released within the timeout, prefixes
//! keep fleets apart, a server restart ends in a resync, and a replica of the JSON format
//! version is refused by its version.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_core::router::RouterId;
use kvroute_core::router::replica::Urgency;
use kvroute_sync::server::NatsServer;
use kvroute_sync::{LinkState, NatsSyncConfig, SyncHost, SyncItem, SyncMetrics, SyncTransport};
use kvroute_testkit::{External, eventually, require};

/// What a host was told, in order.
#[derive(Clone, Debug, PartialEq)]
enum Told {
    Apply(RouterId, Vec<SyncItem>),
    Lost(RouterId),
}

#[derive(Default)]
struct Recorder {
    told: Mutex<Vec<Told>>,
    state: Mutex<Vec<SyncItem>>,
}

impl SyncHost for Recorder {
    fn apply(&self, from: RouterId, events: &[SyncItem]) {
        self.told.lock().unwrap().push(Told::Apply(from, events.to_vec()));
    }
    fn peer_lost(&self, peer: RouterId) {
        self.told.lock().unwrap().push(Told::Lost(peer));
    }
    fn snapshot(&self) -> Vec<SyncItem> {
        self.state.lock().unwrap().clone()
    }
}

impl Recorder {
    fn told(&self) -> Vec<Told> {
        self.told.lock().unwrap().clone()
    }

    /// How often `peer` was released (a join replaces a peer's view: once each).
    fn lost(&self, peer: RouterId) -> usize {
        self.told().iter().filter(|&t| *t == Told::Lost(peer)).count()
    }

    /// The events applied from `from`, flattened.
    fn applied(&self, from: RouterId) -> Vec<SyncItem> {
        self.told()
            .into_iter()
            .filter_map(|t| match t {
                Told::Apply(f, e) if f == from => Some(e),
                _ => None,
            })
            .flatten()
            .collect()
    }
}

/// A nats-server of the test's own, or `None` where none is installed (outside CI only).
fn server() -> Option<NatsServer> {
    require(External::NatsServer, NatsServer::binary().is_some())
        .then(|| NatsServer::start().expect("nats-server starts"))
}

fn config(url: &str, prefix: &str) -> NatsSyncConfig {
    let mut c = NatsSyncConfig::new(url, prefix);
    c.heartbeat_interval = Duration::from_millis(100);
    c.peer_timeout = Duration::from_millis(600);
    c.join_timeout = Duration::from_secs(5);
    c
}

async fn replica(id: u64, config: NatsSyncConfig) -> (SyncTransport, Arc<Recorder>) {
    let host = Arc::new(Recorder::default());
    let metrics = SyncMetrics::new(&prometheus::Registry::new()).unwrap();
    let sync = SyncTransport::start(RouterId(id), config, host.clone(), metrics)
        .await
        .unwrap();
    (sync, host)
}

fn freed(r: u64) -> SyncItem {
    SyncItem::Freed { r }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_reach_peers_in_order_and_never_their_sender() {
    let Some(nats) = server() else { return };
    let (a, host_a) = replica(1, config(&nats.url(), "t1")).await;
    let (_b, host_b) = replica(2, config(&nats.url(), "t1")).await;
    let (_other, host_other) = replica(3, config(&nats.url(), "elsewhere")).await;
    // B joined after A: A knows B from B's join request, so A's events reach B.
    let sent: Vec<SyncItem> = (0..1000).map(freed).collect();
    for e in &sent {
        a.outgoing().push(e.clone(), Urgency::Lazy);
    }
    eventually("B applied every batch A sent", || {
        host_b.applied(RouterId(1)).len() >= sent.len()
    })
    .await;
    assert_eq!(host_b.applied(RouterId(1)), sent, "in order, once each");
    assert!(
        host_a.applied(RouterId(1)).is_empty(),
        "a replica never applies its own"
    );
    assert!(
        host_other.applied(RouterId(1)).is_empty(),
        "another prefix is another fleet"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_replica_has_every_peers_snapshot_before_start_returns() {
    let Some(nats) = server() else { return };
    let (_a, host_a) = replica(1, config(&nats.url(), "t2")).await;
    *host_a.state.lock().unwrap() = vec![freed(10), freed(11)];
    let (_b, host_b) = replica(2, config(&nats.url(), "t2")).await;
    *host_b.state.lock().unwrap() = vec![freed(20)];
    // C must hear of B from A's answer (or B's own) and wait for both.
    let (_c, host_c) = replica(3, config(&nats.url(), "t2")).await;
    let told = host_c.told();
    assert!(
        told.contains(&Told::Lost(RouterId(1))),
        "A's view is replaced: {told:?}"
    );
    assert_eq!(host_c.applied(RouterId(1)), vec![freed(10), freed(11)]);
    assert_eq!(host_c.applied(RouterId(2)), vec![freed(20)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_released_within_the_timeout() {
    let Some(nats) = server() else { return };
    let (a, _) = replica(1, config(&nats.url(), "t3")).await;
    let (_b, host_b) = replica(2, config(&nats.url(), "t3")).await;
    let joined = host_b.lost(RouterId(1));
    a.stop();
    let stopped = tokio::time::Instant::now();
    eventually("B lost A", || host_b.lost(RouterId(1)) > joined).await;
    // Timeout 600 ms, checked every 150 ms; a loaded machine gets slack, but not an hour.
    let after = stopped.elapsed();
    assert!(
        after >= Duration::from_millis(400),
        "released after {after:?}: too early"
    );
    assert!(after < Duration::from_secs(10), "released after {after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_ends_in_a_resync() {
    let Some(mut nats) = server() else { return };
    let (a, host_a) = replica(1, config(&nats.url(), "t4")).await;
    let (b, host_b) = replica(2, config(&nats.url(), "t4")).await;
    *host_a.state.lock().unwrap() = vec![freed(7)];
    let joined = host_b.lost(RouterId(1));
    nats.stop();
    eventually("both links down", || {
        a.link() == LinkState::Disconnected && b.link() == LinkState::Disconnected
    })
    .await;
    // Changes made while down are dropped (and counted), not queued without bound.
    a.outgoing().push(freed(8), Urgency::Lazy);
    eventually("B routes alone", || host_b.lost(RouterId(1)) > joined).await;
    nats.restart().unwrap();
    eventually("both links up again", || {
        a.link() == LinkState::Connected && b.link() == LinkState::Connected
    })
    .await;
    // A's state reaches B again: announced by A, or answered to B's rejoin.
    eventually("A's state reached B again", || {
        host_b.applied(RouterId(1)).contains(&freed(7))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_of_the_json_version_is_refused_by_its_version_and_counted() {
    let Some(nats) = server() else { return };
    let host = Arc::new(Recorder::default());
    let metrics = SyncMetrics::new(&prometheus::Registry::new()).unwrap();
    let _a = SyncTransport::start(
        RouterId(1),
        config(&nats.url(), "t5"),
        host.clone(),
        metrics.clone(),
    )
    .await
    .unwrap();
    // A version 3 replica's heartbeat and batch, as it wrote them, and bytes of no version.
    let old = async_nats::connect(nats.url()).await.unwrap();
    let heartbeat = br#"{"v":3,"from":9,"body":{"kind":"heartbeat","seq":1}}"#;
    let batch = br#"{"v":3,"from":9,"body":{"kind":"events","seq":2,"events":[{"t":"freed","r":5}]}}"#;
    old.publish("t5.heartbeat", heartbeat.as_slice().into())
        .await
        .unwrap();
    old.publish("t5.events", batch.as_slice().into()).await.unwrap();
    old.publish("t5.events", "garbage".into()).await.unwrap();
    old.flush().await.unwrap();
    let refused = || metrics.versions_refused.with_label_values(&["json"]).get();
    eventually("both JSON messages refused by version", || {
        refused() == 2 && metrics.decode_errors.get() == 1
    })
    .await;
    assert_eq!(metrics.versions_refused.with_label_values(&["binary"]).get(), 0);
    assert!(
        host.applied(RouterId(9)).is_empty(),
        "nothing of the old version applied"
    );
    assert_eq!(metrics.peers.get(), 0, "the old version's replica is no peer");
    assert_eq!(metrics.messages_received.get(), 0);
}
