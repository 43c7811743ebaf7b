//! The proxy's cache view recovers from what real engines do to their event streams, driven by
//! scripted publishers (bare `kvroute-zmq` publishers speaking vLLM's wire and replay protocol;
//! no HTTP side, health checks off and reported by the test): an engine restarted (its sequence
//! back at 0, its cache empty), a gap its replay buffer covers, a gap beyond it, and a health
//! flap without a restart whose missed events come back through the replay.
//!
//! Every wait is on an explicit signal: the proxy's admin listing or its subscriber counters
//! reaching a state, checked after each KV-event report the proxy applies.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_core::ids::{DpRank, ExternalBlockHash, WorkerId, WorkerKey};
use kvroute_http::net::client;
use kvroute_proxy::events::ViewSummary;
use kvroute_proxy::worker::WorkerEvent;
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_wire::{BlockStored, WireEvent};
use kvroute_zmq::{CounterSnapshot, EventPublisher, PublisherConfig};

/// Generous: only reached when a test is failing.
const PATIENCE: Duration = Duration::from_secs(10);
/// The proxy's default block size.
const BLOCK: u32 = 16;

/// `n` blocks stored under `parent`, named `first..first + n` by the engine, with tokens that
/// differ for every `first`.
fn stored(first: u64, n: u64, parent: Option<u64>) -> WireEvent {
    WireEvent::BlockStored(BlockStored {
        block_hashes: (first..first + n).map(ExternalBlockHash).collect(),
        parent_block_hash: parent.map(ExternalBlockHash),
        token_ids: (0..n as u32 * BLOCK).map(|t| t + first as u32 * 1000).collect(),
        block_size: BLOCK,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        group_idx: None,
    })
}

/// A publisher with a replay socket keeping `buffer` batches, on free loopback ports.
async fn engine(buffer: usize) -> EventPublisher {
    EventPublisher::start(PublisherConfig {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        buffer_steps: buffer,
        ..PublisherConfig::new("tcp://127.0.0.1:0")
    })
    .await
    .unwrap()
}

/// The same engine restarted in place: the same ports, its sequence from 0, nothing buffered.
async fn restart(old: EventPublisher, buffer: usize) -> EventPublisher {
    let (endpoint, replay) = (
        old.endpoint().to_owned(),
        old.replay_endpoint().unwrap().to_owned(),
    );
    old.shutdown().await;
    EventPublisher::start(PublisherConfig {
        replay_endpoint: Some(replay),
        buffer_steps: buffer,
        ..PublisherConfig::new(endpoint)
    })
    .await
    .unwrap()
}

/// A proxy following `publisher` as worker 0, health checks off.
async fn proxy_for(publisher: &EventPublisher) -> ProxyHandle {
    proxy_capped(publisher, ServeConfig::default().max_blocks_per_worker).await
}

/// [`proxy_for`], keeping at most `cap` blocks per worker.
async fn proxy_capped(publisher: &EventPublisher, cap: usize) -> ProxyHandle {
    let config = ServeConfig {
        max_blocks_per_worker: cap,
        listen: "127.0.0.1:0".into(),
        admin_listen: "127.0.0.1:0".into(),
        approximate_tokenizer: true,
        health_interval_ms: 0,
        workers: vec![WorkerConfig {
            events: Some(publisher.endpoint().to_owned()),
            replay: publisher.replay_endpoint().map(str::to_owned),
            // Nothing listens there: no request is sent in these tests.
            ..WorkerConfig::new("http://127.0.0.1:9")
        }],
        ..ServeConfig::default()
    };
    kvroute_proxy::start(config, None).await.unwrap()
}

const KEY: WorkerKey = WorkerKey::new(WorkerId(0), DpRank(0));

fn counters(proxy: &ProxyHandle) -> CounterSnapshot {
    proxy
        .shared
        .metrics
        .kv_subscribers
        .snapshots()
        .into_iter()
        .find(|(key, _)| *key == KEY)
        .map(|(_, c)| c)
        .unwrap_or_default()
}

fn cached(proxy: &ProxyHandle) -> u64 {
    proxy.shared.worker_statuses()[0].cached_blocks
}

fn view(proxy: &ProxyHandle) -> ViewSummary {
    proxy.shared.worker_statuses()[0].view.clone()
}

fn incidents(proxy: &ProxyHandle, kind: &str) -> u64 {
    proxy
        .shared
        .metrics
        .kv_stream_incidents
        .with_label_values(&[kind])
        .get()
}

/// Waits until `done` holds of the proxy, checked after each change it reports.
async fn until(proxy: &ProxyHandle, what: &str, done: impl Fn(&ProxyHandle) -> bool) {
    let reached = proxy.shared.wait_for_kv(PATIENCE, |_| done(proxy)).await;
    assert!(
        reached,
        "never: {what} (cached {}, view {:?}, {:?})",
        cached(proxy),
        view(proxy),
        counters(proxy)
    );
}

/// Publishes empty batches until the proxy has accounted for every batch published (handed on
/// or reported lost): PUB/SUB drops what is sent before the subscription arrives.
async fn join(proxy: &ProxyHandle, publisher: &EventPublisher) {
    let t0 = Instant::now();
    loop {
        publisher.publish(Vec::new(), Some(0), 0.0).unwrap();
        let accounted = |p: &ProxyHandle| {
            let c = counters(p);
            c.emitted > 0 && c.emitted + c.batches_lost >= publisher.next_seq()
        };
        if proxy
            .shared
            .wait_for_kv(Duration::from_millis(50), |_| accounted(proxy))
            .await
        {
            return;
        }
        assert!(
            t0.elapsed() < PATIENCE,
            "the proxy never joined: {:?}",
            counters(proxy)
        );
    }
}

fn publish(publisher: &EventPublisher, events: Vec<WireEvent>) {
    publisher.publish(events, Some(0), 1.0).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_clears_the_view_before_the_new_run_publishes() {
    let first = engine(10_000).await;
    let proxy = proxy_for(&first).await;
    join(&proxy, &first).await;
    publish(&first, vec![stored(1, 3, None)]);
    until(&proxy, "the first run's 3 blocks", |p| cached(p) == 3).await;

    // Restarted in place: a new process, its sequence from 0, its cache empty, silent. The
    // subscriber reconnects within a second and its resync finds another run.
    let second = restart(first, 10_000).await;
    until(&proxy, "the restart seen and the view cleared", |p| {
        cached(p) == 0 && counters(p).restarts == 1
    })
    .await;
    assert_eq!(incidents(&proxy, "restarted"), 1);
    assert_eq!(view(&proxy), ViewSummary::Live, "an empty engine's view is exact");

    // The new run's events build the view from 0.
    publish(&second, vec![stored(50, 2, None)]);
    until(&proxy, "the new run's 2 blocks", |p| cached(p) == 2).await;
    assert_eq!(counters(&proxy).gaps_lost, 0);
    proxy.shared.check_invariants().unwrap();
    second.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_inside_the_replay_buffer_is_replayed_and_the_view_is_complete() {
    let publisher = engine(10_000).await;
    let proxy = proxy_for(&publisher).await;
    join(&proxy, &publisher).await;
    publish(&publisher, vec![stored(1, 3, None)]);
    // Two batches lost on the way; the third shows the gap.
    publisher.drop_next(2);
    publish(&publisher, vec![stored(4, 2, Some(3))]);
    publish(&publisher, vec![stored(6, 1, Some(5))]);
    publish(&publisher, vec![stored(7, 1, Some(6))]);
    until(&proxy, "all 7 blocks, the 3 lost ones replayed", |p| {
        cached(p) == 7
    })
    .await;
    let c = counters(&proxy);
    assert_eq!(
        (c.gaps_detected, c.gaps_recovered, c.gaps_lost),
        (1, 1, 0),
        "{c:?}"
    );
    assert_eq!(view(&proxy), ViewSummary::Live);
    assert_eq!(incidents(&proxy, "gap_lost"), 0);
    publisher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_beyond_the_replay_buffer_clears_the_view_says_so_and_new_events_rebuild_it() {
    // The engine keeps only its last 2 batches.
    let publisher = engine(2).await;
    let proxy = proxy_for(&publisher).await;
    join(&proxy, &publisher).await;
    publish(&publisher, vec![stored(1, 3, None)]);
    until(&proxy, "the first 3 blocks", |p| cached(p) == 3).await;

    // Five batches lost; the engine buffers only the last of them and the one that shows it.
    publisher.drop_next(5);
    for i in 0..5 {
        publish(
            &publisher,
            vec![stored(10 + i, 1, Some(if i == 0 { 3 } else { 9 + i }))],
        );
    }
    publish(&publisher, vec![stored(100, 2, None)]);
    until(&proxy, "the view cleared and rebuilt from what followed", |p| {
        incidents(p, "gap_lost") == 1 && cached(p) == 2
    })
    .await;
    let since = match view(&proxy) {
        ViewSummary::RebuiltAfterGap {
            since_unix_ms,
            lost_batches,
            ranks,
        } => {
            assert_eq!((lost_batches, ranks), (4, vec![0]));
            since_unix_ms
        }
        other => panic!("expected rebuilt_after_gap, got {other:?}"),
    };
    assert!(since > 0);
    // The admin API says so too.
    let http = client(Duration::from_secs(2));
    let req = hyper::Request::builder()
        .uri(format!("{}/admin/workers", proxy.admin_url()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let body = http
        .request(req)
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes();
    let listing: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        listing["workers"][0]["view"]["state"], "rebuilt_after_gap",
        "{listing}"
    );
    assert_eq!(listing["workers"][0]["view"]["since_unix_ms"], since, "{listing}");

    // New events keep rebuilding it.
    publish(&publisher, vec![stored(102, 3, Some(101))]);
    until(&proxy, "the rebuilt view growing", |p| cached(p) == 5).await;
    // A cache reset makes the view exact again.
    publish(&publisher, vec![WireEvent::AllBlocksCleared]);
    until(&proxy, "the view live again", |p| {
        view(p) == ViewSummary::Live && cached(p) == 0
    })
    .await;
    publisher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_health_flap_without_restart_keeps_the_view_and_replays_what_was_missed() {
    let publisher = engine(10_000).await;
    let proxy = proxy_for(&publisher).await;
    join(&proxy, &publisher).await;
    publish(&publisher, vec![stored(1, 3, None)]);
    until(&proxy, "the first 3 blocks", |p| cached(p) == 3).await;

    // Out after three failed checks.
    for _ in 0..3 {
        proxy.shared.worker_event(WorkerId(0), WorkerEvent::CheckFailed);
    }
    assert!(!proxy.shared.any_routable());
    // During the outage the engine stores more, and none of it reaches the proxy.
    publisher.drop_next(2);
    publish(&publisher, vec![stored(4, 2, Some(3))]);
    publish(&publisher, vec![stored(6, 1, Some(5))]);
    // Back after two passing checks: the view it had, plus what the replay brings.
    for _ in 0..2 {
        proxy.shared.worker_event(WorkerId(0), WorkerEvent::CheckPassed);
    }
    assert!(proxy.shared.any_routable());
    until(&proxy, "the kept view and the 3 missed blocks", |p| {
        cached(p) == 6
    })
    .await;
    let c = counters(&proxy);
    assert_eq!((c.restarts, c.gaps_lost), (0, 0), "{c:?}");
    assert!(c.resyncs >= 2, "at startup and when back: {c:?}");
    assert_eq!(view(&proxy), ViewSummary::Live);
    proxy.shared.check_invariants().unwrap();
    publisher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_is_bounded_per_worker_and_evictions_are_counted() {
    // An engine whose removals never arrive: the view stays within the cap, oldest out first.
    let publisher = engine(10_000).await;
    let proxy = proxy_capped(&publisher, 4).await;
    join(&proxy, &publisher).await;
    publish(&publisher, vec![stored(1, 3, None)]);
    publish(&publisher, vec![stored(10, 3, None)]);
    until(&proxy, "both chains applied", |p| {
        p.shared
            .metrics
            .kv_events
            .with_label_values(&["stored", "ok"])
            .get()
            == 2
    })
    .await;
    assert_eq!(cached(&proxy), 4);
    proxy.shared.snapshot();
    assert_eq!(proxy.shared.metrics.index_blocks_evicted.get(), 2);
    let page = proxy.shared.metrics.render();
    assert!(page.contains("kvroute_index_blocks_evicted_total 2"), "{page}");
    publisher.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_startup_the_view_takes_what_the_engine_still_buffers_without_waiting() {
    // The engine ran before the proxy came and publishes nothing after: its replay buffer is
    // all the proxy can learn from, and it learns it at once.
    let publisher = engine(10_000).await;
    publish(&publisher, vec![stored(1, 3, None)]);
    publish(&publisher, vec![stored(4, 2, Some(3))]);
    let proxy = proxy_for(&publisher).await;
    until(&proxy, "the buffered 5 blocks", |p| cached(p) == 5).await;
    let c = counters(&proxy);
    assert_eq!((c.emitted, c.replayed, c.gaps_lost), (2, 2, 0), "{c:?}");
    assert_eq!(view(&proxy), ViewSummary::Live);
    publisher.shutdown().await;
}
