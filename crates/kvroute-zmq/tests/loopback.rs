//! Publisher and subscriber over loopback TCP: order, replay, loss, restarts, garbage, modes,
//! and events reaching an index.
//!
//! Ports are never fixed: sockets bind port 0 and the tests read the real port back. PUB/SUB
//! drops what is published before the subscription reaches the publisher ("slow joiner"), so
//! each test first publishes empty warm-up batches until one arrives ([`join`]); with a replay
//! socket the subscriber then replays the ones it missed, so every test starts from a known
//! sequence number without sleeping for a guessed time.

use std::num::NonZeroU32;
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::ids::{DpRank, ExternalBlockHash, WorkerId, WorkerKey};
use kvroute_core::index::{IndexConfig, PrefixIndex};
use kvroute_wire::replay::ReplayLayout;
use kvroute_wire::{ApplyConfig, BlockRemoved, BlockStored, EventBatch, EventEncoding, WireEvent};
use kvroute_zmq::{
    CounterSnapshot, EventPublisher, PublisherConfig, SocketMode, SubscriberConfig, SubscriberEvent,
    SubscriberHandle, spawn_subscriber,
};
use tokio::sync::mpsc;
use tokio::time::timeout;
use zeromq::{Socket, SocketSend, ZmqMessage};

const WORKER: WorkerId = WorkerId(3);
/// The stream the subscribers follow: the worker's only rank.
const STREAM: WorkerKey = WorkerKey::new(WORKER, DpRank(0));
/// Generous: only reached when a test is failing.
const PATIENCE: Duration = Duration::from_secs(10);

/// The next event, or a panic after [`PATIENCE`].
async fn next(rx: &mut mpsc::Receiver<SubscriberEvent>) -> SubscriberEvent {
    match timeout(PATIENCE, rx.recv()).await {
        Ok(Some(event)) => event,
        Ok(None) => panic!("the subscriber stopped"),
        Err(_) => panic!("no event within {PATIENCE:?}"),
    }
}

/// The next event, which must be a batch.
async fn next_batch(rx: &mut mpsc::Receiver<SubscriberEvent>) -> EventBatch {
    match next(rx).await {
        SubscriberEvent::Batch { worker, batch } => {
            assert_eq!(worker, STREAM);
            batch
        }
        other => panic!("expected a batch, got {other:?}"),
    }
}

/// Publishes empty batches until the subscriber hands one on and has received one live, then
/// waits until it has handed on the last one published. Returns every event seen on the way.
///
/// A batch handed on is not enough: with a replay socket the subscriber's start-up resync hands
/// on what the publisher buffers before its subscription reaches the publisher, and what is
/// published until then is dropped by PUB unseen.
async fn join(
    publisher: &EventPublisher,
    handle: &SubscriberHandle,
    rx: &mut mpsc::Receiver<SubscriberEvent>,
) -> Vec<SubscriberEvent> {
    let mut events = Vec::new();
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let received = || handle.counters().snapshot().received;
    let before = received();
    // Until something arrives live, a warm-up batch every 20 ms.
    while events.is_empty() || received() == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the subscriber never connected"
        );
        publisher.publish(Vec::new(), None, 0.0).expect("publish");
        while let Ok(Some(event)) = timeout(Duration::from_millis(20), rx.recv()).await {
            events.push(event);
        }
    }
    let last = publisher.next_seq() - 1;
    while !events
        .iter()
        .any(|e| matches!(e, SubscriberEvent::Batch { batch, .. } if batch.seq == last))
    {
        events.push(next(rx).await);
    }
    events
}

/// The counters once `done` holds of them (they may trail the events by a moment).
async fn settled(handle: &SubscriberHandle, done: impl Fn(&CounterSnapshot) -> bool) -> CounterSnapshot {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let counters = handle.counters().snapshot();
        if done(&counters) || tokio::time::Instant::now() > deadline {
            return counters;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn stored(hashes: &[u64], parent: Option<u64>, block_size: u32) -> WireEvent {
    WireEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
        parent_block_hash: parent.map(ExternalBlockHash),
        token_ids: (0..hashes.len() as u32 * block_size).map(|t| t + 100).collect(),
        block_size,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        group_idx: None,
    })
}

/// A batch's worth of varied events, different for each `i`.
fn events(i: u64) -> Vec<WireEvent> {
    vec![
        stored(&[i * 10 + 1, i * 10 + 2], Some(i), 4),
        WireEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![ExternalBlockHash(i)],
            medium: Some("GPU".into()),
            group_idx: None,
        }),
        WireEvent::AllBlocksCleared,
    ]
}

/// A publisher on a free loopback port with topic `kv@test`, map encoding, the new replay
/// layout, and a replay socket if `replay`.
fn loopback(replay: bool) -> PublisherConfig {
    PublisherConfig {
        replay_endpoint: replay.then(|| "tcp://127.0.0.1:0".to_owned()),
        topic: "kv@test".into(),
        ..PublisherConfig::new("tcp://127.0.0.1:0")
    }
}

/// Starts a subscriber with `config`, its events on a channel of `capacity`.
async fn spawn(
    config: SubscriberConfig,
    capacity: usize,
) -> (SubscriberHandle, mpsc::Receiver<SubscriberEvent>) {
    let (tx, rx) = mpsc::channel(capacity);
    let handle = spawn_subscriber(config, tx).await.expect("spawn_subscriber");
    (handle, rx)
}

/// A subscriber connected to `publisher` (and to its replay socket, if it has one), topic
/// `kv@`, as `configure` leaves it.
async fn subscribe(
    publisher: &EventPublisher,
    capacity: usize,
    configure: impl FnOnce(&mut SubscriberConfig),
) -> (SubscriberHandle, mpsc::Receiver<SubscriberEvent>) {
    let mut config = SubscriberConfig::new(WORKER, publisher.endpoint());
    config.replay_endpoint = publisher.replay_endpoint().map(str::to_owned);
    config.topic = "kv@".into();
    configure(&mut config);
    spawn(config, capacity).await
}

/// A started publisher and a subscriber that has joined it ([`join`]).
struct Joined {
    publisher: EventPublisher,
    handle: SubscriberHandle,
    rx: mpsc::Receiver<SubscriberEvent>,
    /// The subscriber's counters once joined.
    before: CounterSnapshot,
}

/// Starts a publisher with `config` and joins a subscriber ([`subscribe`], as `configure`
/// leaves it) to it.
async fn joined(config: PublisherConfig, configure: impl FnOnce(&mut SubscriberConfig)) -> Joined {
    let publisher = EventPublisher::start(config).await.expect("start");
    let (handle, mut rx) = subscribe(&publisher, 1024, configure).await;
    join(&publisher, &handle, &mut rx).await;
    let before = handle.counters().snapshot();
    Joined {
        publisher,
        handle,
        rx,
        before,
    }
}

/// Drops the next `dropped` batches live, then publishes `events(i)` for `i` in `0..count`
/// (at time `i`). Returns the first one's sequence number.
fn publish_dropping(publisher: &EventPublisher, dropped: u64, count: u64) -> u64 {
    let first = publisher.next_seq();
    publisher.drop_next(dropped);
    for i in 0..count {
        publisher.publish(events(i), None, i as f64).expect("publish");
    }
    first
}

/// Publishes `count` empty batches and waits until the last one arrives.
async fn publish_empty(publisher: &EventPublisher, rx: &mut mpsc::Receiver<SubscriberEvent>, count: usize) {
    for _ in 0..count {
        publisher.publish(Vec::new(), None, 0.0).expect("publish");
    }
    let last = publisher.next_seq() - 1;
    while next_batch(rx).await.seq != last {}
}

/// The event of the batches `missing` being lost.
fn gap_lost(missing: std::ops::Range<u64>) -> SubscriberEvent {
    SubscriberEvent::GapLost {
        worker: STREAM,
        missing,
    }
}

/// The sequence numbers of `events`, which must all be batches.
fn batch_seqs(events: &[SubscriberEvent]) -> Vec<u64> {
    events
        .iter()
        .map(|e| match e {
            SubscriberEvent::Batch { batch, .. } => batch.seq,
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

/// A loopback port that was free a moment ago.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_arrive_in_order_and_decode_as_published() {
    for encoding in [EventEncoding::Map, EventEncoding::Positional] {
        let publisher = EventPublisher::start(PublisherConfig {
            encoding,
            ..loopback(true)
        })
        .await
        .expect("start");
        let (handle, mut rx) = subscribe(&publisher, 1024, |_| {}).await;
        let warmup = join(&publisher, &handle, &mut rx).await;
        // Every warm-up batch arrives, in order: the ones sent before the subscription
        // reached the publisher come through the replay.
        assert_eq!(
            batch_seqs(&warmup),
            (0..publisher.next_seq()).collect::<Vec<_>>(),
            "{encoding:?}"
        );

        let first = publisher.next_seq();
        for i in 0..20 {
            let seq = publisher
                .publish(events(i), Some(i as u32 % 2), 1_767_225_600.0 + i as f64)
                .expect("publish");
            assert_eq!(seq, first + i);
        }
        for i in 0..20 {
            let batch = next_batch(&mut rx).await;
            let expected = EventBatch {
                topic: "kv@test".into(),
                seq: first + i,
                ts: 1_767_225_600.0 + i as f64,
                events: events(i),
                dp_rank: Some(i as u32 % 2),
            };
            assert_eq!(batch, expected, "{encoding:?}");
        }
        let counters = handle.counters().snapshot();
        assert_eq!(counters.emitted, first + 20, "{encoding:?}: {counters:?}");
        assert_eq!(
            (counters.gaps_lost, counters.decode_errors, counters.restarts),
            (0, 0, 0)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_is_recovered_through_replay() {
    for replay_layout in [ReplayLayout::TopicSeqPayload, ReplayLayout::SeqPayload] {
        let config = PublisherConfig {
            replay_layout,
            ..loopback(true)
        };
        let mut link = joined(config, |_| {}).await;

        let first = publish_dropping(&link.publisher, 2, 5);
        for i in 0..5 {
            let batch = next_batch(&mut link.rx).await;
            assert_eq!(
                (batch.seq, &batch.events),
                (first + i, &events(i)),
                "{replay_layout:?}"
            );
        }
        // A gap counts as recovered once its replay has ended, which may be just after its last
        // batch was handed on.
        let after = settled(&link.handle, |c| c.gaps_recovered > link.before.gaps_recovered).await;
        assert_eq!(
            after.gaps_detected - link.before.gaps_detected,
            1,
            "{replay_layout:?}: {after:?}"
        );
        assert_eq!(
            after.gaps_recovered - link.before.gaps_recovered,
            1,
            "{replay_layout:?}: {after:?}"
        );
        // The two dropped batches and the one that showed the gap, at least.
        assert!(
            after.replayed - link.before.replayed >= 3,
            "{replay_layout:?}: {after:?}"
        );
        assert_eq!(
            after.gaps_lost, link.before.gaps_lost,
            "{replay_layout:?}: {after:?}"
        );
        assert_eq!(
            after.emitted - link.before.emitted,
            5,
            "{replay_layout:?}: {after:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_endpoint_a_gap_is_lost_and_the_stream_goes_on() {
    let mut link = joined(loopback(false), |_| {}).await;

    let first = publish_dropping(&link.publisher, 1, 3);
    assert_eq!(next(&mut link.rx).await, gap_lost(first..first + 1));
    assert_eq!(next_batch(&mut link.rx).await.seq, first + 1);
    assert_eq!(next_batch(&mut link.rx).await.seq, first + 2);
    let after = link.handle.counters().snapshot();
    assert_eq!(after.gaps_detected - link.before.gaps_detected, 1);
    assert_eq!(after.gaps_lost - link.before.gaps_lost, 1);
    assert_eq!(after.batches_lost - link.before.batches_lost, 1);
    assert_eq!(after.gaps_recovered, link.before.gaps_recovered);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_replay_endpoint_times_out_into_a_lost_gap() {
    // Nothing listens on a port that was free a moment ago.
    let unused = free_port();
    let mut link = joined(loopback(false), |c| {
        c.replay_endpoint = Some(format!("tcp://127.0.0.1:{unused}"));
        c.replay_timeout_ms = 200;
    })
    .await;

    let first = publish_dropping(&link.publisher, 1, 2);
    assert_eq!(next(&mut link.rx).await, gap_lost(first..first + 1));
    assert_eq!(next_batch(&mut link.rx).await.seq, first + 1);
    let after = link.handle.counters().snapshot();
    assert_eq!(
        after.replay_failures - link.before.replay_failures,
        1,
        "{after:?}"
    );
    assert_eq!(after.gaps_lost - link.before.gaps_lost, 1, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_publisher_is_reported_and_its_new_run_follows() {
    // The subscriber binds and the publishers connect out to it (llm-d's centralized mode),
    // so the second publisher reaches the same subscriber without reusing a port.
    let mut config = SubscriberConfig::new(WORKER, "tcp://*:0");
    assert_eq!(config.effective_mode(), SocketMode::Bind);
    config.topic = "kv@".into();
    let (handle, mut rx) = spawn(config, 1024).await;
    let port = handle.endpoint().rsplit(':').next().expect("a port").to_owned();
    // Neither publisher has a replay socket.
    let start = || {
        EventPublisher::start(PublisherConfig {
            mode: Some(SocketMode::Connect),
            ..loopback(false).with_endpoint(format!("tcp://127.0.0.1:{port}"))
        })
    };

    let first = start().await.expect("first publisher");
    join(&first, &handle, &mut rx).await;
    // Far more batches than the second publisher's warm-up will number, so that its batches
    // are recognisably a new run (the wire has no run id: only a sequence number that goes
    // back shows a restart).
    publish_empty(&first, &mut rx, 300).await;
    first.shutdown().await;

    // The subscriber has no replay endpoint configured for the new run either: the new
    // publisher's warm-up batches it missed are reported lost, then the run goes on.
    let second = start().await.expect("second publisher");
    let events = join(&second, &handle, &mut rx).await;
    assert!(
        matches!(events[0], SubscriberEvent::Restarted { worker: STREAM }),
        "{events:?}"
    );
    let counters = handle.counters().snapshot();
    assert_eq!(counters.restarts, 1, "{counters:?}");
    let seq = second.publish(events_for_restart(), None, 0.0).expect("publish");
    let batch = next_batch(&mut rx).await;
    assert_eq!((batch.seq, batch.events), (seq, events_for_restart()));
}

fn events_for_restart() -> Vec<WireEvent> {
    vec![stored(&[7], None, 4)]
}

/// A subscriber that binds `endpoint`, every topic.
async fn bound(endpoint: impl Into<String>) -> (SubscriberHandle, mpsc::Receiver<SubscriberEvent>) {
    let config = SubscriberConfig {
        mode: Some(SocketMode::Bind),
        ..SubscriberConfig::new(WORKER, endpoint)
    };
    spawn(config, 1024).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_is_reported_and_the_subscriber_goes_on() {
    let (handle, mut rx) = bound("tcp://127.0.0.1:0").await;
    let mut raw = zeromq::PubSocket::new();
    raw.connect(handle.endpoint()).await.expect("connect");
    let message = |frames: Vec<&[u8]>| {
        ZmqMessage::try_from(frames.into_iter().map(Bytes::copy_from_slice).collect::<Vec<_>>())
            .expect("frames")
    };

    // One frame, until the subscription has reached the publisher.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        assert!(tokio::time::Instant::now() < deadline, "never connected");
        raw.send(message(vec![b"one frame"])).await.expect("send");
        if let Ok(Some(event)) = timeout(Duration::from_millis(20), rx.recv()).await {
            assert!(matches!(event, SubscriberEvent::Error { .. }), "{event:?}");
            break;
        }
    }
    let payload = EventBatch {
        topic: String::new(),
        seq: 1,
        ts: 0.0,
        events: vec![stored(&[1], None, 4)],
        dp_rank: None,
    }
    .encode_payload(EventEncoding::Map)
    .expect("encode");
    let (seq0, seq1) = (0_u64.to_be_bytes(), 1_u64.to_be_bytes());
    let garbage: [Vec<&[u8]>; 4] = [
        vec![b"", b"short"],
        vec![b"", &seq0[..3], b"x"],
        vec![b"", &seq0, b"\xc1"],
        vec![b"", &seq1, &payload],
    ];
    for frames in garbage {
        raw.send(message(frames)).await.expect("send");
    }

    let mut errors = Vec::new();
    let batch = loop {
        match next(&mut rx).await {
            SubscriberEvent::Error { worker, error } => {
                assert_eq!(worker, STREAM);
                errors.push(error);
            }
            SubscriberEvent::Batch { batch, .. } => break batch,
            other => panic!("unexpected {other:?}"),
        }
    };
    // Batch 0 was undecodable but numbered, so batch 1 follows it in order.
    assert_eq!((batch.seq, batch.events.len()), (1, 1));
    let tail: Vec<&str> = errors.iter().rev().take(3).rev().map(String::as_str).collect();
    assert!(tail[0].contains("2 frames"), "{tail:?}");
    assert!(tail[1].contains("sequence number frame of 3 bytes"), "{tail:?}");
    assert!(tail[2].starts_with("batch 0:"), "{tail:?}");
    let counters = handle.counters().snapshot();
    assert_eq!(counters.decode_errors as usize, errors.len() + 1, "{counters:?}");
    assert_eq!(counters.gaps_detected, 0, "{counters:?}");
    assert!(!handle.is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn received_batches_build_the_index() {
    let publisher = EventPublisher::start(PublisherConfig {
        encoding: EventEncoding::Positional,
        replay_layout: ReplayLayout::SeqPayload,
        ..loopback(true)
    })
    .await
    .expect("start");
    let (handle, mut rx) = subscribe(&publisher, 1024, |_| {}).await;
    let mut index = PrefixIndex::new(IndexConfig::default());
    let config = ApplyConfig {
        block_size: NonZeroU32::new(4).expect("non-zero"),
        namespace: None,
        group_idx: 0,
    };
    let apply = |event: SubscriberEvent, index: &mut PrefixIndex| match event {
        SubscriberEvent::Batch { worker, batch } => {
            let key = batch.worker_key(worker);
            index.add_worker(key);
            for event in &batch.events {
                event.apply_to(index, key, &config).expect("apply");
            }
            Some(batch.seq)
        }
        other => panic!("unexpected {other:?}"),
    };
    for event in join(&publisher, &handle, &mut rx).await {
        apply(event, &mut index);
    }
    publisher
        .publish(vec![stored(&[11, 12, 13], None, 4)], Some(1), 0.0)
        .expect("publish");
    publisher
        .publish(vec![stored(&[14], Some(13), 4)], Some(1), 0.0)
        .expect("publish");
    let removed = WireEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![ExternalBlockHash(14)],
        medium: Some("GPU".into()),
        group_idx: None,
    });
    let last = publisher.publish(vec![removed], Some(1), 0.0).expect("publish");
    while apply(next(&mut rx).await, &mut index) != Some(last) {}
    let key = kvroute_core::ids::WorkerKey::new(WORKER, kvroute_core::ids::DpRank(1));
    assert_eq!(index.block_count(key), 3);
    index.check_invariants().expect("invariants");
}

#[test]
fn configs_reject_unknown_keys_and_fill_defaults() {
    let config: SubscriberConfig = toml::from_str(
        r#"
        worker = 4
        endpoint = "tcp://10.0.0.1:5557"
        replay_endpoint = "tcp://10.0.0.1:5558"
        "#,
    )
    .expect("parse");
    assert_eq!(
        config,
        SubscriberConfig {
            replay_endpoint: Some("tcp://10.0.0.1:5558".into()),
            ..SubscriberConfig::new(WorkerId(4), "tcp://10.0.0.1:5557")
        }
    );
    assert_eq!(config.effective_mode(), SocketMode::Connect);
    assert!(toml::from_str::<SubscriberConfig>("worker = 1\nendpoint = \"tcp://*:1\"\nhwm = 5").is_err());
    let with_mode: SubscriberConfig =
        toml::from_str("worker = 1\nendpoint = \"tcp://127.0.0.1:1\"\nmode = \"bind\"").expect("parse");
    assert_eq!(with_mode.effective_mode(), SocketMode::Bind);

    let publisher: PublisherConfig = toml::from_str(
        r#"
        endpoint = "tcp://*:5557"
        encoding = "positional"
        replay_layout = "seq_payload"
        "#,
    )
    .expect("parse");
    assert_eq!(
        publisher,
        PublisherConfig {
            encoding: EventEncoding::Positional,
            replay_layout: ReplayLayout::SeqPayload,
            ..PublisherConfig::new("tcp://*:5557")
        }
    );
    assert!(toml::from_str::<PublisherConfig>("endpoint = \"tcp://*:1\"\nbuffer = 5").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configs_are_refused_before_any_socket() {
    let (tx, _rx) = mpsc::channel(1);
    let mut config = SubscriberConfig::new(WORKER, "nonsense");
    assert!(spawn_subscriber(config.clone(), tx.clone()).await.is_err());
    config.endpoint = "tcp://127.0.0.1:1".into();
    config.replay_timeout_ms = 0;
    assert!(spawn_subscriber(config, tx).await.is_err());
    assert!(
        EventPublisher::start(PublisherConfig::new("udp://x"))
            .await
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_older_than_the_replay_buffer_are_lost_and_the_rest_replayed() {
    let config = PublisherConfig {
        buffer_steps: 3,
        ..loopback(true)
    };
    let mut link = joined(config, |_| {}).await;

    let first = publish_dropping(&link.publisher, 5, 6);
    // The ring holds the last three (first + 3 ..= first + 5): the two before are gone.
    assert_eq!(next(&mut link.rx).await, gap_lost(first..first + 3));
    for i in 3..6 {
        let batch = next_batch(&mut link.rx).await;
        assert_eq!((batch.seq, batch.events), (first + i, events(i)));
    }
    let after = link.handle.counters().snapshot();
    assert_eq!(after.batches_lost - link.before.batches_lost, 3, "{after:?}");
    assert_eq!(after.replayed - link.before.replayed, 3, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_drops_are_all_recovered_in_order() {
    let config = PublisherConfig {
        encoding: EventEncoding::Positional,
        ..loopback(true)
    };
    let mut link = joined(config, |_| {}).await;

    // A fixed pattern of drops (1 to 4 batches, every few batches), 1 000 batches in all.
    let first = link.publisher.next_seq();
    let mut state = 0x9E37_79B9_7F4A_7C15_u64;
    let mut drops = 0;
    for i in 0..1_000 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        if state.is_multiple_of(16) {
            link.publisher.drop_next(1 + state / 16 % 4);
            drops += 1;
        }
        link.publisher
            .publish(events(i), None, i as f64)
            .expect("publish");
    }
    // A drop at the end would swallow the last batches, which no later batch would reveal.
    link.publisher.drop_next(0);
    let last = link.publisher.publish(Vec::new(), None, 0.0).expect("publish");
    for i in 0..1_000 {
        let batch = next_batch(&mut link.rx).await;
        assert_eq!((batch.seq, batch.events), (first + i, events(i)));
    }
    assert_eq!(next_batch(&mut link.rx).await.seq, last);
    let after = link.handle.counters().snapshot();
    assert!(drops > 10, "the pattern drops too rarely: {drops}");
    assert_eq!(after.gaps_lost, link.before.gaps_lost, "{after:?}");
    assert!(after.gaps_detected - link.before.gaps_detected >= 1, "{after:?}");
}

/// Stops `first` and starts a new publisher on its live and replay ports, as an engine restarted
/// in place: its sequence starts again at 0.
async fn restart_in_place(first: EventPublisher) -> EventPublisher {
    let (endpoint, replay) = (
        first.endpoint().to_owned(),
        first.replay_endpoint().expect("replay").to_owned(),
    );
    first.shutdown().await;
    EventPublisher::start(PublisherConfig {
        replay_endpoint: Some(replay),
        ..loopback(true).with_endpoint(endpoint)
    })
    .await
    .expect("restart on the same ports")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_restarted_on_the_same_ports_is_followed_with_replay() {
    let Joined {
        publisher: first,
        handle,
        mut rx,
        ..
    } = joined(loopback(true), |_| {}).await;
    publish_empty(&first, &mut rx, 300).await;
    // The same ports, as an engine restarted in place would have. The subscriber reconnects by
    // itself; what the new run published before it did comes back through the replay socket.
    let second = restart_in_place(first).await;
    let events = join(&second, &handle, &mut rx).await;
    assert!(
        matches!(events[0], SubscriberEvent::Restarted { worker: STREAM }),
        "{events:?}"
    );
    assert_eq!(
        batch_seqs(&events[1..]),
        (0..second.next_seq()).collect::<Vec<_>>()
    );
    assert_eq!(handle.counters().snapshot().restarts, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_started_first_waits_for_its_publisher() {
    let endpoint = format!("tcp://127.0.0.1:{}", free_port());
    let (handle, mut rx) = spawn(SubscriberConfig::new(WORKER, endpoint.clone()), 16).await;
    assert_eq!(handle.mode(), SocketMode::Connect);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let publisher = EventPublisher::start(PublisherConfig::new(endpoint))
        .await
        .expect("start");
    let events = join(&publisher, &handle, &mut rx).await;
    assert!(
        events
            .iter()
            .all(|e| matches!(e, SubscriberEvent::Batch { .. } | SubscriberEvent::GapLost { .. })),
        "{events:?}"
    );
    // Dropping the handle stops the task, which closes the channel.
    drop(handle);
    while let Some(_event) = timeout(PATIENCE, rx.recv()).await.expect("the channel closes") {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_consumer_loses_nothing() {
    let publisher = EventPublisher::start(loopback(true)).await.expect("start");
    // Room for one event: the subscriber waits on the consumer after every batch.
    let (handle, mut rx) = subscribe(&publisher, 1, |_| {}).await;
    join(&publisher, &handle, &mut rx).await;

    let first = publish_dropping(&publisher, 0, 300);
    for i in 0..300 {
        if i % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(next_batch(&mut rx).await.seq, first + i);
    }
    assert_eq!(handle.counters().snapshot().gaps_lost, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipc_endpoints_work_with_the_default_modes() {
    let dir = std::env::temp_dir().join(format!("kvroute-zmq-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let path = |name: &str| format!("ipc://{}", dir.join(name).display());
    let publisher = EventPublisher::start(PublisherConfig {
        replay_endpoint: Some(path("replay.sock")),
        ..PublisherConfig::new(path("events.sock"))
    })
    .await
    .expect("start");
    // vLLM binds ipc endpoints, so a subscriber connects to them by default.
    let (handle, mut rx) = subscribe(&publisher, 1024, |c| c.topic.clear()).await;
    assert_eq!(handle.mode(), SocketMode::Connect);
    let events = join(&publisher, &handle, &mut rx).await;
    assert!(
        matches!(&events[0], SubscriberEvent::Batch { batch, .. } if batch.seq == 0),
        "{events:?}"
    );
    drop(handle);
    publisher.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connecting_publisher_reaches_a_restarted_subscriber() {
    let (first, mut rx) = bound("tcp://127.0.0.1:0").await;
    let endpoint = first.endpoint().to_owned();
    let publisher = EventPublisher::start(PublisherConfig {
        mode: Some(SocketMode::Connect),
        ..PublisherConfig::new(endpoint.clone())
    })
    .await
    .expect("start");
    join(&publisher, &first, &mut rx).await;
    first.shutdown().await;

    // A new subscriber on the same port (the router restarted): the publisher connects again.
    let (second, mut rx) = bound(endpoint).await;
    let events = join(&publisher, &second, &mut rx).await;
    // It joined a run already under way and has no replay endpoint: what came before is lost.
    assert!(
        matches!(events[0], SubscriberEvent::GapLost { ref missing, .. } if missing.start == 0),
        "{events:?}"
    );
    assert!(!second.is_finished());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_is_seen_before_the_new_run_publishes_anything() {
    // An engine restarted in place on the same ports, idle since: the subscriber reconnects by
    // itself and its resync finds that the publisher no longer has the last batch it received,
    // so the view is cleared at once instead of at the new run's first batch.
    let Joined {
        publisher: first,
        handle,
        mut rx,
        ..
    } = joined(loopback(true), |_| {}).await;
    publish_empty(&first, &mut rx, 5).await;
    let second = restart_in_place(first).await;
    assert!(
        matches!(next(&mut rx).await, SubscriberEvent::Restarted { worker: STREAM }),
        "the restart is reported with nothing published"
    );
    assert_eq!(second.next_seq(), 0);
    let counters = handle.counters().snapshot();
    assert_eq!((counters.restarts, counters.reconnects), (1, 1), "{counters:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_fetches_batches_missed_while_nothing_new_is_published() {
    // A worker back from an outage: the batches it published meanwhile never reached the
    // subscriber, and it publishes nothing after. A requested resync brings them.
    let Joined {
        publisher,
        handle,
        mut rx,
        ..
    } = joined(loopback(true), |_| {}).await;
    let first = publish_dropping(&publisher, 3, 3);
    handle.resync_trigger().request();
    for i in 0..3 {
        let batch = next_batch(&mut rx).await;
        assert_eq!((batch.seq, batch.events), (first + i, events(i)));
    }
    let counters = handle.counters().snapshot();
    assert_eq!((counters.restarts, counters.gaps_lost), (0, 0), "{counters:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_of_a_publisher_past_its_buffer_reports_the_loss() {
    // More batches went by unseen than the publisher buffers: the last one received is gone
    // from its buffer, so the stream is taken up again from what it has, the rest lost.
    let Joined {
        publisher,
        handle,
        mut rx,
        ..
    } = joined(
        PublisherConfig {
            buffer_steps: 4,
            ..loopback(true)
        },
        |_| {},
    )
    .await;
    let first = publish_dropping(&publisher, 10, 10);
    handle.resync_trigger().request();
    assert!(matches!(next(&mut rx).await, SubscriberEvent::Restarted { .. }));
    match next(&mut rx).await {
        SubscriberEvent::GapLost { missing, .. } => assert_eq!(missing, 0..first + 6),
        other => panic!("expected the loss, got {other:?}"),
    }
    for i in 6..10 {
        assert_eq!(next_batch(&mut rx).await.seq, first + i);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_back_after_a_long_outage_is_heard_from_within_the_reconnect_cap() {
    // The `zeromq` crate's own reconnection doubles its delay (0.1, 0.3, 0.7, 1.5, 3.1, 6.3,
    // 12.7 s after the loss): a publisher back after 7 s would be reached 5.7 s late. With the
    // cap, attempts are at most about a second apart.
    let port = free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let start = || EventPublisher::start(PublisherConfig::new(endpoint.clone()));
    let first = start().await.expect("first");
    let (handle, mut rx) = spawn(SubscriberConfig::new(WORKER, endpoint.clone()), 1024).await;
    join(&first, &handle, &mut rx).await;
    first.shutdown().await;
    // The outage: a fixed wait is what is being tested here, not a race.
    tokio::time::sleep(Duration::from_secs(7)).await;
    let second = start().await.expect("second");
    let back = tokio::time::Instant::now();
    // Publish until the subscriber hears the new run (PUB drops what it sends unconnected).
    let heard = loop {
        second.publish(Vec::new(), None, 1.0).expect("publish");
        if let Ok(Some(event)) = timeout(Duration::from_millis(20), rx.recv()).await {
            break event;
        }
        assert!(back.elapsed() < PATIENCE, "never reconnected");
    };
    let late = back.elapsed();
    assert!(
        matches!(
            heard,
            SubscriberEvent::Restarted { .. }
                | SubscriberEvent::Batch { .. }
                | SubscriberEvent::GapLost { .. }
        ),
        "{heard:?}"
    );
    assert!(
        late < Duration::from_millis(3_000),
        "heard {late:?} after the publisher was back"
    );
    assert!(handle.counters().snapshot().reconnects >= 1);
}
