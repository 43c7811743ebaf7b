//! The KV-event subscribers' counters as `/metrics` exports them, per worker and rank: a worker
//! with a replay socket recovers dropped batches (gap detected, recovered, batches replayed), one
//! without reports them lost, and a removed worker's series go away. A data-parallel worker has a
//! subscriber per rank, on the rank's own port, whose lost batches clear that rank alone.
//!
//! The workers are bare `kvroute-zmq` publishers (no HTTP side): only their event streams
//! matter here, and the test decides exactly which batches are dropped.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/serve.rs"]
mod serve;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_core::ids::ExternalBlockHash;
use kvroute_http::net::{HttpClient, client};
use kvroute_proxy::Driver;
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_wire::{BlockStored, WireEvent};
use kvroute_zmq::{EventPublisher, PublisherConfig};

use kvroute_testkit::PATIENCE;

/// `method path` on the proxy: the status and the body.
async fn request(http: &HttpClient, proxy: &ProxyHandle, method: &str, path: &str) -> (u16, String) {
    // The admin API has its own listener.
    let base = if path.starts_with("/admin") {
        proxy.admin_url()
    } else {
        proxy.url()
    };
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("{base}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// One scrape's per-worker subscriber counters.
struct Scrape(String);

impl Scrape {
    async fn take(http: &HttpClient, proxy: &ProxyHandle) -> Self {
        let (status, text) = request(http, proxy, "GET", "/metrics").await;
        assert_eq!(status, 200);
        Self(text)
    }

    /// `name{worker="worker"}` of rank 0, or `None` when the scrape has no such series.
    fn get(&self, name: &str, worker: u64) -> Option<u64> {
        self.get_rank(name, worker, 0)
    }

    /// `name{dp_rank="rank",worker="worker"}`, or `None` when the scrape has no such series.
    fn get_rank(&self, name: &str, worker: u64, rank: u32) -> Option<u64> {
        let series = format!("{name}{{dp_rank=\"{rank}\",worker=\"{worker}\"}} ");
        self.0
            .lines()
            .find_map(|line| line.strip_prefix(&series))
            .map(|value| value.parse().unwrap())
    }

    /// `kvroute_kv_events_{counter}_total` of `worker`, which must be exported.
    fn kv(&self, counter: &str, worker: u64) -> u64 {
        let name = format!("kvroute_kv_events_{counter}_total");
        self.get(&name, worker)
            .unwrap_or_else(|| panic!("no {name} for worker {worker}:\n{}", self.0))
    }

    /// Batches handed on to the router for `worker` (Dynamo's name).
    fn batches(&self, worker: u64) -> u64 {
        self.get("dynamo_component_router_kv_zmq_ingress_batches_total", worker)
            .unwrap_or_else(|| panic!("no batches for worker {worker}:\n{}", self.0))
    }
}

/// At most this long between two scrapes of [`scrape_until`]: some counters (`gaps_recovered`)
/// move just after the report they follow, and a removed worker's series go when its
/// subscriber's task ends; neither wakes [`Driver::wait_until`]. A poll, not a guess: the
/// condition is checked again until [`PATIENCE`].
const POLL: Duration = Duration::from_millis(50);

/// Waits for the proxy's next change (a report applied, a worker added or removed), or at most
/// `pace`.
async fn next_change(shared: &Driver, pace: Duration) {
    let mut first = true;
    // The first check is the state now, not a change: wait for the next one.
    shared
        .wait_until(pace, |_| !std::mem::replace(&mut first, false))
        .await;
}

/// Scrapes until `done` holds of a scrape (deadline [`PATIENCE`]), again after each change the
/// proxy reports, or after [`POLL`] at the latest. With `nudge` publishers, an empty batch is
/// published on each before every scrape: PUB/SUB loses what is sent before the subscription
/// arrives, and only a later batch shows a subscriber that it joined.
async fn scrape_until(
    http: &HttpClient,
    proxy: &ProxyHandle,
    nudge: &[&EventPublisher],
    what: &str,
    done: impl Fn(&Scrape) -> bool,
) -> Scrape {
    let t0 = Instant::now();
    loop {
        for publisher in nudge {
            publisher.publish(Vec::new(), None, 0.0).unwrap();
        }
        let scrape = Scrape::take(http, proxy).await;
        if done(&scrape) {
            return scrape;
        }
        assert!(t0.elapsed() < PATIENCE, "never: {what}\n{}", scrape.0);
        next_change(&proxy.driver, POLL).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriber_counters_are_exported_per_worker() {
    // `replayed` has a replay socket, `lossy` has none.
    let replayed = EventPublisher::start(PublisherConfig {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..PublisherConfig::new("tcp://127.0.0.1:0")
    })
    .await
    .unwrap();
    let lossy = EventPublisher::start(PublisherConfig::new("tcp://127.0.0.1:0"))
        .await
        .unwrap();
    let worker = |publisher: &EventPublisher| WorkerConfig {
        events: Some(publisher.endpoint().to_owned()),
        replay: publisher.replay_endpoint().map(str::to_owned),
        // Nothing listens there: no request is sent in this test.
        ..WorkerConfig::new("http://127.0.0.1:9")
    };
    let config = ServeConfig {
        workers: vec![worker(&replayed), worker(&lossy)],
        ..serve::loopback()
    };
    let proxy = kvroute_proxy::start(config, None).await.unwrap();
    let id = |publisher: &EventPublisher| {
        proxy
            .driver
            .worker_statuses()
            .iter()
            .find(|w| w.config.events.as_deref() == Some(publisher.endpoint()))
            .unwrap()
            .id
    };
    let (r, l) = (id(&replayed), id(&lossy));
    let http = client(Duration::from_secs(2));

    // Joined: a batch was received live, so the subscription has reached the publisher (the
    // start-up resync may hand on buffered batches before it does). Publishing until then; a
    // condition that stays true.
    let joined = |s: &Scrape, w: u64| {
        s.get("kvroute_kv_events_received_total", w)
            .is_some_and(|live| live > 0)
    };
    scrape_until(&http, &proxy, &[&replayed, &lossy], "both joined", |s| {
        joined(s, r) && joined(s, l)
    })
    .await;
    // Settled, with nothing more published: every batch was handed on or reported lost.
    let accounted = |s: &Scrape, w: u64, p: &EventPublisher| {
        s.get("kvroute_kv_events_batches_lost_total", w)
            .zip(s.get("dynamo_component_router_kv_zmq_ingress_batches_total", w))
            .is_some_and(|(lost, handed)| lost + handed == p.next_seq())
    };
    let before = scrape_until(&http, &proxy, &[], "every batch accounted for", |s| {
        accounted(s, r, &replayed) && accounted(s, l, &lossy)
    })
    .await;
    // With a replay socket nothing is lost, not even what came before the subscription.
    assert_eq!(before.kv("batches_lost", r), 0);
    assert_eq!(before.batches(r), replayed.next_seq());

    // Two batches dropped on each: recovered through replay on one, lost on the other.
    for publisher in [&replayed, &lossy] {
        publisher.drop_next(2);
        for _ in 0..5 {
            publisher.publish(Vec::new(), None, 0.0).unwrap();
        }
    }
    let after = scrape_until(&http, &proxy, &[], "the drops accounted for", |s| {
        s.batches(r) == before.batches(r) + 5
            && s.kv("gaps_recovered", r) > before.kv("gaps_recovered", r)
            && s.batches(l) == before.batches(l) + 3
    })
    .await;
    let delta = |counter: &str, w: u64| after.kv(counter, w) - before.kv(counter, w);
    // The worker with replay: one gap, recovered; the two dropped batches and the one that
    // showed the gap came through the replay, at least.
    assert_eq!(delta("gaps_detected", r), 1, "{}", after.0);
    assert_eq!(delta("gaps_recovered", r), 1, "{}", after.0);
    assert!(delta("replayed", r) >= 3, "{}", after.0);
    assert_eq!(delta("gaps_lost", r), 0, "{}", after.0);
    assert_eq!(delta("batches_lost", r), 0, "{}", after.0);
    // The worker without: one gap, two batches lost, nothing replayed ever.
    assert_eq!(delta("gaps_detected", l), 1, "{}", after.0);
    assert_eq!(delta("gaps_recovered", l), 0, "{}", after.0);
    assert_eq!(delta("gaps_lost", l), 1, "{}", after.0);
    assert_eq!(delta("batches_lost", l), 2, "{}", after.0);
    assert_eq!(after.kv("replayed", l), 0, "{}", after.0);
    // Live messages received: all but the dropped ones since the first scrape.
    assert_eq!(delta("received", l), 3, "{}", after.0);
    for w in [r, l] {
        for counter in ["restarts", "decode_errors"] {
            assert_eq!(after.kv(counter, w), 0, "{counter} of {w}: {}", after.0);
        }
    }
    // Live batches a replay already brought are dropped as duplicates; without replay, none.
    assert_eq!(after.kv("duplicates", l), 0, "{}", after.0);

    // A removed worker's subscriber stops, and its series go with it.
    let (status, _) = request(&http, &proxy, "DELETE", &format!("/admin/workers/{l}")).await;
    assert_eq!(status, 200);
    let gone = scrape_until(&http, &proxy, &[], "the removed worker's series gone", |s| {
        s.get("kvroute_kv_events_gaps_lost_total", l).is_none()
    })
    .await;
    assert!(!gone.0.contains(&format!("worker=\"{l}\"")), "{}", gone.0);
    assert_eq!(gone.batches(r), after.batches(r));
    proxy.stop();
}

/// Publishers for ranks 0 and 1 of one engine: on a port and the next, vLLM's layout.
async fn rank_publishers() -> (EventPublisher, EventPublisher) {
    for _ in 0..50 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let Some(next) = port.checked_add(1) else { continue };
        let start =
            |port: u16| EventPublisher::start(PublisherConfig::new(format!("tcp://127.0.0.1:{port}")));
        if let (Ok(zero), Ok(one)) = (start(port).await, start(next).await) {
            return (zero, one);
        }
    }
    panic!("no two free consecutive ports");
}

/// One stored block of 16 tokens, named `hash` by the engine.
fn stored(hash: u64) -> Vec<WireEvent> {
    vec![WireEvent::BlockStored(BlockStored {
        block_hashes: vec![ExternalBlockHash(hash)],
        parent_block_hash: None,
        token_ids: (0..16).map(|t| t + 100 * hash as u32).collect(),
        block_size: 16,
        lora_id: None,
        medium: None,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
    })]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_worker_has_a_subscriber_per_rank() {
    let (zero, one) = rank_publishers().await;
    let config = ServeConfig {
        workers: vec![WorkerConfig {
            // Rank 0's endpoint; rank 1 publishes on the next port.
            events: Some(zero.endpoint().to_owned()),
            dp_size: 2,
            ..WorkerConfig::new("http://127.0.0.1:9")
        }],
        ..serve::loopback()
    };
    let proxy = kvroute_proxy::start(config, None).await.unwrap();
    let http = client(Duration::from_secs(2));
    let cached = |shared: &Driver, rank: u32| {
        shared
            .snapshot()
            .workers
            .iter()
            .find(|w| w.spec.key.dp_rank.0 == rank)
            .unwrap()
            .cached_blocks
    };
    // A rank's subscriber counters, read straight from the proxy (as `/metrics` reads them).
    let counters = |shared: &Driver, rank: u32| {
        shared
            .metrics
            .kv_subscribers
            .snapshots()
            .into_iter()
            .find(|(key, _)| key.dp_rank.0 == rank)
            .map(|(_, c)| c)
    };
    let joined = |s: &Driver| (0..2).all(|r| counters(s, r).is_some_and(|c| c.emitted > 0));
    // Publish until both ranks' subscribers have joined (PUB/SUB drops what comes before);
    // the short wait only paces the nudges.
    for attempt in 0.. {
        assert!(attempt < 100, "the ranks' subscribers never joined");
        for publisher in [&zero, &one] {
            publisher.publish(Vec::new(), None, 0.0).unwrap();
        }
        if proxy.driver.wait_for_kv(Duration::from_millis(200), joined).await {
            break;
        }
    }
    // Rank 1's stream feeds rank 1, whether its batches name the rank or not; rank 0's, rank 0.
    one.publish(stored(1), Some(1), 0.0).unwrap();
    one.publish(stored(2), None, 0.0).unwrap();
    zero.publish(stored(3), Some(0), 0.0).unwrap();
    let held = proxy
        .driver
        .wait_for_kv(PATIENCE, |s| (cached(s, 0), cached(s, 1)) == (1, 2))
        .await;
    let shared = &proxy.driver;
    assert!(
        held,
        "ranks hold {} and {} blocks",
        cached(shared, 0),
        cached(shared, 1)
    );
    // Batches lost on rank 1's stream (it has no replay socket) clear rank 1 alone. (Joining
    // lost what was published before each subscription: count from here.)
    let gaps = |s: &Driver, rank: u32| counters(s, rank).map(|c| c.gaps_lost);
    let before = (gaps(shared, 0), gaps(shared, 1));
    one.drop_next(1);
    one.publish(Vec::new(), Some(1), 0.0).unwrap();
    one.publish(Vec::new(), Some(1), 0.0).unwrap();
    let cleared = shared
        .wait_for_kv(PATIENCE, |s| {
            gaps(s, 1) == before.1.map(|n| n + 1) && cached(s, 1) == 0
        })
        .await;
    assert!(
        cleared,
        "rank 1: gaps lost {:?}, {} blocks",
        gaps(shared, 1),
        cached(shared, 1)
    );
    assert_eq!(gaps(shared, 0), before.0, "rank 0 lost nothing");
    assert_eq!(cached(shared, 0), 1, "rank 0 keeps its view");
    // `/metrics` shows each rank's series.
    let scrape = Scrape::take(&http, &proxy).await;
    for (rank, lost) in [(0, before.0), (1, before.1.map(|n| n + 1))] {
        assert_eq!(
            scrape.get_rank("kvroute_kv_events_gaps_lost_total", 0, rank),
            lost,
            "{}",
            scrape.0
        );
    }
    proxy.stop();
}
