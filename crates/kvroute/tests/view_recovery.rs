//! The proxy's cache view recovers from what real engines do to their event streams, driven by
//! scripted publishers (bare `kvroute-zmq` publishers speaking vLLM's wire and replay protocol;
//! no HTTP side, health checks off and reported by the test): an engine restarted (its sequence
//! back at 0, its cache empty), a gap its replay buffer covers, a gap beyond it, and a health
//! flap without a restart whose missed events come back through the replay.
//!
//! Every wait is on an explicit signal: the proxy's admin listing or its subscriber counters
//! reaching a state, checked after each KV-event report the proxy applies.
//!
//! The last test runs a mock worker (which follows vLLM 0.32's `kv_cache_report_mode`) behind
//! the proxy: a view lost beyond the replay buffer is rebuilt from the engine's
//! re-announcements, which the proxy asks for while the view is rebuilt.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/serve.rs"]
mod serve;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_core::ids::{DpRank, ExternalBlockHash, WorkerId, WorkerKey};
use kvroute_http::net::client;
use kvroute_proxy::views::ViewSummary;
use kvroute_proxy::worker::WorkerEvent;
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_wire::{BlockStored, WireEvent};
use kvroute_zmq::{CounterSnapshot, EventPublisher, PublisherConfig};

use kvroute_testkit::PATIENCE;
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
        cache_salt: None,
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
    proxy_capped(publisher, ServeConfig::default().routing.max_blocks_per_worker).await
}

/// [`proxy_for`], keeping at most `cap` blocks per worker.
async fn proxy_capped(publisher: &EventPublisher, cap: usize) -> ProxyHandle {
    let config = ServeConfig {
        routing: kvroute_proxy::config::RoutingConfig {
            max_blocks_per_worker: cap,
            ..Default::default()
        },
        workers: vec![WorkerConfig {
            events: Some(publisher.endpoint().to_owned()),
            replay: publisher.replay_endpoint().map(str::to_owned),
            // Nothing listens there: no request is sent in these tests.
            ..WorkerConfig::new("http://127.0.0.1:9")
        }],
        ..serve::loopback()
    };
    kvroute_proxy::start(config, None).await.unwrap()
}

const KEY: WorkerKey = WorkerKey::new(WorkerId(0), DpRank(0));

fn counters(proxy: &ProxyHandle) -> CounterSnapshot {
    proxy
        .driver
        .metrics
        .kv_subscribers
        .snapshots()
        .into_iter()
        .find(|(key, _)| *key == KEY)
        .map(|(_, c)| c)
        .unwrap_or_default()
}

fn cached(proxy: &ProxyHandle) -> u64 {
    proxy.driver.worker_statuses()[0].cached_blocks
}

fn view(proxy: &ProxyHandle) -> ViewSummary {
    proxy.driver.worker_statuses()[0].view.clone()
}

fn incidents(proxy: &ProxyHandle, kind: &str) -> u64 {
    proxy
        .driver
        .metrics
        .kv_stream_incidents
        .with_label_values(&[kind])
        .get()
}

/// Waits until `done` holds of the proxy, checked after each change it reports.
async fn until(proxy: &ProxyHandle, what: &str, done: impl Fn(&ProxyHandle) -> bool) {
    let reached = proxy.driver.wait_for_kv(PATIENCE, |_| done(proxy)).await;
    assert!(
        reached,
        "never: {what} (cached {}, view {:?}, {:?})",
        cached(proxy),
        view(proxy),
        counters(proxy)
    );
}

/// Publishes empty batches until the proxy has received one live and accounted for every batch
/// published (handed on or reported lost): PUB/SUB drops what is sent before the subscription
/// arrives, and the start-up resync may hand on the buffered batches before it does.
async fn join(proxy: &ProxyHandle, publisher: &EventPublisher) {
    let t0 = Instant::now();
    loop {
        publisher.publish(Vec::new(), Some(0), 0.0).unwrap();
        let accounted = |p: &ProxyHandle| {
            let c = counters(p);
            c.received > 0 && c.emitted + c.batches_lost >= publisher.next_seq()
        };
        if proxy
            .driver
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
    // The resync that found the new run may still be reporting its replay.
    until(&proxy, "the resync over", |p| {
        !matches!(view(p), ViewSummary::Replaying { .. })
    })
    .await;
    assert_eq!(view(&proxy), ViewSummary::Live, "an empty engine's view is exact");

    // The new run's events build the view from 0.
    publish(&second, vec![stored(50, 2, None)]);
    until(&proxy, "the new run's 2 blocks", |p| cached(p) == 2).await;
    assert_eq!(counters(&proxy).gaps_lost, 0);
    proxy.driver.check_invariants().unwrap();
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
        cached(p) == 7 && !matches!(view(p), ViewSummary::Replaying { .. })
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
        incidents(p, "gap_lost") == 1 && cached(p) == 2 && !matches!(view(p), ViewSummary::Replaying { .. })
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
    let listed = listed_view(&proxy).await;
    assert_eq!(listed["state"], "rebuilt_after_gap", "{listed}");
    assert_eq!(listed["since_unix_ms"], since, "{listed}");

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
        proxy.driver.worker_event(WorkerId(0), WorkerEvent::CheckFailed);
    }
    assert!(!proxy.driver.any_routable());
    // During the outage the engine stores more, and none of it reaches the proxy.
    publisher.drop_next(2);
    publish(&publisher, vec![stored(4, 2, Some(3))]);
    publish(&publisher, vec![stored(6, 1, Some(5))]);
    // Back after two passing checks: the view it had, plus what the replay brings.
    for _ in 0..2 {
        proxy.driver.worker_event(WorkerId(0), WorkerEvent::CheckPassed);
    }
    assert!(proxy.driver.any_routable());
    until(&proxy, "the kept view and the 3 missed blocks", |p| {
        cached(p) == 6 && !matches!(view(p), ViewSummary::Replaying { .. })
    })
    .await;
    let c = counters(&proxy);
    assert_eq!((c.restarts, c.gaps_lost), (0, 0), "{c:?}");
    assert!(c.resyncs >= 2, "at startup and when back: {c:?}");
    assert_eq!(view(&proxy), ViewSummary::Live);
    proxy.driver.check_invariants().unwrap();
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
        p.driver
            .metrics
            .kv_events
            .with_label_values(&["stored", "ok"])
            .get()
            == 2
    })
    .await;
    assert_eq!(cached(&proxy), 4);
    proxy.driver.snapshot();
    assert_eq!(proxy.driver.metrics.index_blocks_evicted.get(), 2);
    let page = proxy.driver.metrics.render();
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
    until(&proxy, "the buffered 5 blocks", |p| {
        cached(p) == 5 && !matches!(view(p), ViewSummary::Replaying { .. })
    })
    .await;
    let c = counters(&proxy);
    assert_eq!((c.emitted, c.replayed, c.gaps_lost), (2, 2, 0), "{c:?}");
    assert_eq!(view(&proxy), ViewSummary::Live);
    publisher.shutdown().await;
}

/// The admin listing's `view` of worker 0.
async fn listed_view(proxy: &ProxyHandle) -> serde_json::Value {
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
    listing["workers"][0]["view"].clone()
}

/// While a resync or a gap fill waits on the engine's replay socket, the worker's view says
/// `replaying`, from which sequence number and endpoint; then `live` when the replay covered
/// what was missed, `rebuilt_after_gap` when it could not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_a_replay_runs_the_view_says_replaying_then_live_or_rebuilt() {
    // The engine keeps its last 2 batches.
    let publisher = engine(2).await;
    let proxy = proxy_for(&publisher).await;
    join(&proxy, &publisher).await;
    publish(&publisher, vec![stored(1, 3, None)]);
    until(&proxy, "the first 3 blocks", |p| cached(p) == 3).await;
    let last = publisher.next_seq() - 1;
    let endpoint = publisher.replay_endpoint().unwrap().to_owned();

    // A health flap: a batch missed meanwhile; when the worker is back, its resync asks the
    // replay from the last batch applied, which the engine holds back.
    for _ in 0..3 {
        proxy.driver.worker_event(WorkerId(0), WorkerEvent::CheckFailed);
    }
    publisher.drop_next(1);
    publish(&publisher, vec![stored(4, 2, Some(3))]);
    let mut hold = publisher.hold_replays();
    for _ in 0..2 {
        proxy.driver.worker_event(WorkerId(0), WorkerEvent::CheckPassed);
    }
    let asked = tokio::time::timeout(PATIENCE, hold.requested()).await.unwrap();
    assert_eq!(asked, Some(last));
    let replaying = ViewSummary::Replaying {
        from_seq: last,
        endpoint: endpoint.clone(),
        ranks: vec![0],
    };
    until(&proxy, "the resync listed as replaying", |p| view(p) == replaying).await;
    let listed = listed_view(&proxy).await;
    assert_eq!(listed["state"], "replaying", "{listed}");
    assert_eq!(listed["from_seq"], last, "{listed}");
    assert_eq!(listed["endpoint"], endpoint.as_str(), "{listed}");
    hold.release();
    until(&proxy, "live again, with the missed blocks", |p| {
        view(p) == ViewSummary::Live && cached(p) == 5
    })
    .await;

    // A gap beyond the buffer: the gap fill is listed as replaying from the first batch
    // missing, then the view is rebuilt after the gap.
    let first_missing = publisher.next_seq();
    publisher.drop_next(3);
    let mut hold = publisher.hold_replays();
    for i in 0..4 {
        publish(&publisher, vec![stored(10 + i, 1, None)]);
    }
    let asked = tokio::time::timeout(PATIENCE, hold.requested()).await.unwrap();
    assert_eq!(asked, Some(first_missing));
    until(
        &proxy,
        "the gap fill listed as replaying",
        |p| matches!(view(p), ViewSummary::Replaying { from_seq, .. } if from_seq == first_missing),
    )
    .await;
    assert_eq!(listed_view(&proxy).await["state"], "replaying");
    hold.release();
    until(&proxy, "rebuilt after the gap", |p| {
        matches!(view(p), ViewSummary::RebuiltAfterGap { lost_batches: 2, .. })
    })
    .await;
    assert_eq!(listed_view(&proxy).await["state"], "rebuilt_after_gap");
    publisher.shutdown().await;
}

/// POSTs `body` to the proxy's `/v1/completions`: the predicted cached tokens of its debug
/// header and the engine's reported `cached_tokens`.
async fn predicted_and_reported(
    http: &kvroute_http::net::HttpClient,
    proxy: &ProxyHandle,
    body: &serde_json::Value,
) -> (u64, u64) {
    let req = hyper::Request::post(format!("{}/v1/completions", proxy.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let predicted: u64 = resp.headers()["x-kvroute-predicted-cached-tokens"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let completion: kvroute_http::openai::types::Completion = serde_json::from_slice(&bytes).unwrap();
    (predicted, u64::from(completion.usage.unwrap().cached_tokens()))
}

fn stored_ok(proxy: &ProxyHandle) -> u64 {
    proxy
        .driver
        .metrics
        .kv_events
        .with_label_values(&["stored", "ok"])
        .get()
}

fn newly_held(proxy: &ProxyHandle) -> u64 {
    proxy.driver.snapshot();
    proxy.driver.metrics.index_blocks_stored.get()
}

/// vLLM re-announces nothing it holds, so a view cleared after events were lost for good
/// would stay blind to the engine's cached prefixes. While the view is rebuilt, the proxy
/// asks the engine (`"vllm_xargs": {"kv_cache_report_mode": "full"}`) to re-announce the blocks
/// each request reuses: one request per prefix brings it back, and a repeat's predicted cached
/// tokens equal the engine's reported ones. A re-announcement of blocks the view holds changes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_view_lost_beyond_the_replay_buffer_is_rebuilt_from_the_engines_reannouncements() {
    let model = std::sync::Arc::new(kvroute_http::Model::tiny().unwrap());
    let mut mc = kvroute_mock::MockConfig::new(1);
    mc.engine.speedup = 20.0;
    // The engine keeps only its last 2 batches for replay (each request of a new prompt
    // publishes one; a repeat, none).
    mc.replay_buffer_steps = 2;
    let mocks = kvroute_mock::start(&mc, std::sync::Arc::clone(&model))
        .await
        .unwrap();
    let config = ServeConfig {
        server: kvroute_proxy::config::ServerConfig {
            debug_headers: true,
            ..serve::loopback().server
        },
        workers: vec![WorkerConfig::parse_flag(&mocks[0].worker_flag()).unwrap()],
        ..serve::loopback()
    };
    let proxy = kvroute_proxy::start(config, Some(model)).await.unwrap();
    let http = client(Duration::from_secs(5));
    // PUB/SUB drops what is sent before the subscription arrives: warm up with new prompts
    // (one batch each) until the proxy hears one.
    let prompt = |base: u32| -> Vec<u32> { (0..100).map(|i| 1 + (base + i * 7) % 250).collect() };
    let request = |p: &[u32]| serde_json::json!({"prompt": p, "max_tokens": 2});
    for warm in 200.. {
        predicted_and_reported(&http, &proxy, &request(&prompt(warm))).await;
        if proxy
            .driver
            .wait_for_kv(Duration::from_millis(500), |_| counters(&proxy).emitted > 0)
            .await
        {
            break;
        }
        assert!(
            warm < 220,
            "the proxy never heard the engine: {:?}",
            counters(&proxy)
        );
    }
    let gaps_lost = incidents(&proxy, "gap_lost");
    // Two prefixes of 100 token ids: 6 full blocks each, all 6 a hit on a repeat (96 tokens).
    let prefixes = [prompt(0), prompt(3)];
    for p in &prefixes {
        let blocks = cached(&proxy);
        assert_eq!(predicted_and_reported(&http, &proxy, &request(p)).await, (0, 0));
        until(&proxy, "the prefix's 6 blocks stored", |x| {
            cached(x) == blocks + 6
        })
        .await;
    }
    for p in &prefixes {
        assert_eq!(predicted_and_reported(&http, &proxy, &request(p)).await, (96, 96));
    }

    // Three batches lost; the engine buffers only the last of them and the one that shows the
    // gap: the view is cleared, and rebuilt from what follows.
    mocks[0].drop_next_event_batches(3);
    for base in [100, 101, 102, 103] {
        predicted_and_reported(&http, &proxy, &request(&prompt(base))).await;
    }
    until(&proxy, "the gap lost and the view cleared", |p| {
        incidents(p, "gap_lost") == gaps_lost + 1
    })
    .await;
    assert!(matches!(view(&proxy), ViewSummary::RebuiltAfterGap { .. }));

    for p in &prefixes {
        // The view lost it; the engine still holds it, and re-announces it.
        let blocks = cached(&proxy);
        assert_eq!(predicted_and_reported(&http, &proxy, &request(p)).await, (0, 96));
        until(&proxy, "the prefix's 6 blocks re-announced", |x| {
            cached(x) == blocks + 6
        })
        .await;
        // A repeat: predicted as the engine reports. Still rebuilding, it re-announces the
        // same blocks again, which the view holds: it changes nothing, and the counters say so.
        let (stored, held) = (stored_ok(&proxy), newly_held(&proxy));
        assert_eq!(predicted_and_reported(&http, &proxy, &request(p)).await, (96, 96));
        until(&proxy, "the second re-announcement applied", |x| {
            stored_ok(x) > stored
        })
        .await;
        assert_eq!(cached(&proxy), blocks + 6);
        assert_eq!(newly_held(&proxy), held, "no block newly held");
    }
    proxy.driver.check_invariants().unwrap();
}
