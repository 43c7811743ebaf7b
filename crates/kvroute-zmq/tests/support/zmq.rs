//! What the loopback tests of `loopback.rs`, `recovery.rs` and `restarts.rs` share: the
//! stream under test, its events, publishers and subscribers on free ports, and waits with a
//! deadline. Included with `#[path]`.
//!
//! Ports are never fixed: sockets bind port 0 and the tests read the real port back. PUB/SUB
//! drops what is published before the subscription reaches the publisher ("slow joiner"), so
//! each test first publishes empty warm-up batches until one arrives ([`join`]); with a replay
//! socket the subscriber then replays the ones it missed, so every test starts from a known
//! sequence number without sleeping for a guessed time.

#![allow(dead_code, unused_imports)]

pub use std::num::NonZeroU32;
pub use std::time::Duration;

pub use bytes::Bytes;
pub use kvroute_core::ids::{DpRank, ExternalBlockHash, WorkerId, WorkerKey};
pub use kvroute_core::index::{IndexConfig, RunIndex};
pub use kvroute_wire::replay::ReplayLayout;
pub use kvroute_wire::{ApplyConfig, BlockRemoved, BlockStored, EventBatch, EventEncoding, WireEvent};
pub use kvroute_zmq::{
    CounterSnapshot, EventPublisher, PublisherConfig, SocketMode, SubscriberConfig, SubscriberEvent,
    SubscriberHandle, spawn_subscriber,
};
pub use tokio::sync::mpsc;
pub use tokio::time::timeout;
pub use zeromq::{Socket, SocketSend, ZmqMessage};

pub const WORKER: WorkerId = WorkerId(3);
/// The stream the subscribers follow: the worker's only rank.
pub const STREAM: WorkerKey = WorkerKey::new(WORKER, DpRank(0));
pub use kvroute_testkit::PATIENCE;

/// The next event, or a panic after [`PATIENCE`].
pub async fn next(rx: &mut mpsc::Receiver<SubscriberEvent>) -> SubscriberEvent {
    match timeout(PATIENCE, rx.recv()).await {
        Ok(Some(event)) => event,
        Ok(None) => panic!("the subscriber stopped"),
        Err(_) => panic!("no event within {PATIENCE:?}"),
    }
}

/// The next event, which must be a batch.
pub async fn next_batch(rx: &mut mpsc::Receiver<SubscriberEvent>) -> EventBatch {
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
pub async fn join(
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
pub async fn settled(handle: &SubscriberHandle, done: impl Fn(&CounterSnapshot) -> bool) -> CounterSnapshot {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let counters = handle.counters().snapshot();
        if done(&counters) || tokio::time::Instant::now() > deadline {
            return counters;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn stored(hashes: &[u64], parent: Option<u64>, block_size: u32) -> WireEvent {
    WireEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
        parent_block_hash: parent.map(ExternalBlockHash),
        token_ids: (0..hashes.len() as u32 * block_size).map(|t| t + 100).collect(),
        block_size,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        cache_salt: None,
        group_idx: None,
    })
}

/// A batch's worth of varied events, different for each `i`.
pub fn events(i: u64) -> Vec<WireEvent> {
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
pub fn loopback(replay: bool) -> PublisherConfig {
    PublisherConfig {
        replay_endpoint: replay.then(|| "tcp://127.0.0.1:0".to_owned()),
        topic: "kv@test".into(),
        ..PublisherConfig::new("tcp://127.0.0.1:0")
    }
}

/// Starts a subscriber with `config`, its events on a channel of `capacity`.
pub async fn spawn(
    config: SubscriberConfig,
    capacity: usize,
) -> (SubscriberHandle, mpsc::Receiver<SubscriberEvent>) {
    let (tx, rx) = mpsc::channel(capacity);
    let handle = spawn_subscriber(config, tx).await.expect("spawn_subscriber");
    (handle, rx)
}

/// A subscriber connected to `publisher` (and to its replay socket, if it has one), topic
/// `kv@`, as `configure` leaves it.
pub async fn subscribe(
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
pub struct Joined {
    pub publisher: EventPublisher,
    pub handle: SubscriberHandle,
    pub rx: mpsc::Receiver<SubscriberEvent>,
    /// The subscriber's counters once joined.
    pub before: CounterSnapshot,
}

/// Starts a publisher with `config` and joins a subscriber ([`subscribe`], as `configure`
/// leaves it) to it.
pub async fn joined(config: PublisherConfig, configure: impl FnOnce(&mut SubscriberConfig)) -> Joined {
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
pub fn publish_dropping(publisher: &EventPublisher, dropped: u64, count: u64) -> u64 {
    let first = publisher.next_seq();
    publisher.drop_next(dropped);
    for i in 0..count {
        publisher.publish(events(i), None, i as f64).expect("publish");
    }
    first
}

/// Publishes `count` empty batches and waits until the last one arrives.
pub async fn publish_empty(
    publisher: &EventPublisher,
    rx: &mut mpsc::Receiver<SubscriberEvent>,
    count: usize,
) {
    for _ in 0..count {
        publisher.publish(Vec::new(), None, 0.0).expect("publish");
    }
    let last = publisher.next_seq() - 1;
    while next_batch(rx).await.seq != last {}
}

/// The event of the batches `missing` being lost.
pub fn gap_lost(missing: std::ops::Range<u64>) -> SubscriberEvent {
    SubscriberEvent::GapLost {
        worker: STREAM,
        missing,
    }
}

/// The sequence numbers of `events`, which must all be batches.
pub fn batch_seqs(events: &[SubscriberEvent]) -> Vec<u64> {
    events
        .iter()
        .map(|e| match e {
            SubscriberEvent::Batch { batch, .. } => batch.seq,
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A subscriber that binds `endpoint`, every topic.
pub async fn bound(endpoint: impl Into<String>) -> (SubscriberHandle, mpsc::Receiver<SubscriberEvent>) {
    let config = SubscriberConfig {
        mode: Some(SocketMode::Bind),
        ..SubscriberConfig::new(WORKER, endpoint)
    };
    spawn(config, 1024).await
}
