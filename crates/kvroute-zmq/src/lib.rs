//! The ZMQ transport of KV events: a subscriber per worker for the router, and a publisher for
//! mock workers, both speaking vLLM's wire protocol over a pure-Rust ZeroMQ (the `zeromq` crate,
//! zmq.rs: no libzmq, no C toolchain). The codecs, the replay frames and the sequence rules are
//! `kvroute-wire`'s; this crate owns the sockets, the tasks and the timeouts around them.
//!
//! # API
//!
//! ```text
//! // Router side: one per worker endpoint.
//! SubscriberConfig { worker: WorkerId, endpoint: String, replay_endpoint: Option<String>,
//!                    topic: String, mode: Option<SocketMode>, replay_timeout_ms: u64 }
//!     SubscriberConfig::new(worker, endpoint) -> SubscriberConfig      // the defaults
//!     .effective_mode() -> SocketMode, .validate() -> Result<(), ZmqError>
//!     // serde, unknown keys rejected; defaults: no replay, topic "", mode from the endpoint,
//!     // replay_timeout_ms 1000. `worker` is the integer id.
//! async fn spawn_subscriber(SubscriberConfig, mpsc::Sender<SubscriberEvent>)
//!     -> Result<SubscriberHandle, ZmqError>
//! SubscriberHandle: worker(), mode(), endpoint() (bound, port resolved), counters()
//!     -> &Arc<SubscriberCounters> (.snapshot() -> CounterSnapshot), is_finished(),
//!     resync_trigger() -> ResyncTrigger (.request(): catch up through the replay socket now),
//!     async shutdown(self) (waits until the socket is closed); dropping it stops the task.
//! CounterSnapshot { received, emitted, replayed, duplicates, gaps_detected, gaps_recovered,
//!                   gaps_lost, batches_lost, restarts, decode_errors, replay_failures,
//!                   socket_errors, reconnects, resyncs }
//! enum SubscriberEvent {
//!     Batch { worker, batch: EventBatch },    // in sequence order, replayed ones included
//!     Restarted { worker },                   // seq went back: clear the worker
//!     GapLost { worker, missing: Range<u64> },// gone for good; the stream goes on
//!     Error { worker, error: String },        // undecodable message, skipped
//! }
//!
//! // Mock-worker side.
//! PublisherConfig { endpoint: String, replay_endpoint: Option<String>, topic: String,
//!                   buffer_steps: usize, encoding: EventEncoding, replay_layout: ReplayLayout,
//!                   mode: Option<SocketMode> }
//!     PublisherConfig::new(endpoint) -> PublisherConfig                 // the defaults
//!     .with_endpoint(endpoint) -> PublisherConfig, .validate() -> Result<(), ZmqError>
//!     // serde, unknown keys rejected; defaults: no replay, topic "", buffer_steps 10 000,
//!     // encoding "map" ("positional"), replay_layout "topic_seq_payload" ("seq_payload"),
//!     // mode None = bind (vLLM's own rule is `publisher_mode`).
//! EventPublisher::start(PublisherConfig).await -> Result<EventPublisher, ZmqError>
//! EventPublisher: publish(&self, Vec<WireEvent>, dp_rank: Option<u32>, ts: f64)
//!     -> Result<u64, ZmqError> (the seq), drop_next(&self, n), endpoint(), replay_endpoint(),
//!     next_seq(), async shutdown(self); dropping it stops its tasks.
//!
//! // Modes.
//! enum SocketMode { Bind, Connect }
//! fn subscriber_mode(&str) -> SocketMode   // bind only for wildcard tcp hosts
//! fn publisher_mode(&str) -> SocketMode    // vLLM's own rule
//! fn rank_endpoint(&str, rank: u32) -> Result<String, ZmqError>  // vLLM's per-rank endpoint
//! ```
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use kvroute_core::ids::WorkerId;
//! use kvroute_wire::WireEvent;
//! use kvroute_zmq::{EventPublisher, PublisherConfig, SubscriberConfig, SubscriberEvent, spawn_subscriber};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! // A mock worker on free loopback ports, with a replay socket.
//! let publisher = EventPublisher::start(PublisherConfig {
//!     replay_endpoint: Some("tcp://127.0.0.1:0".into()),
//!     ..PublisherConfig::new("tcp://127.0.0.1:0")
//! })
//! .await?;
//!
//! // The router's subscriber for it.
//! let mut config = SubscriberConfig::new(WorkerId(1), publisher.endpoint());
//! config.replay_endpoint = publisher.replay_endpoint().map(str::to_owned);
//! let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
//! let subscriber = spawn_subscriber(config, tx).await?;
//!
//! // PUB/SUB drops what is sent before the subscription arrives: publish until something does.
//! let first = loop {
//!     publisher.publish(vec![WireEvent::AllBlocksCleared], Some(0), 0.0)?;
//!     if let Ok(Some(event)) = tokio::time::timeout(Duration::from_millis(20), rx.recv()).await {
//!         break event;
//!     }
//! };
//! // Whichever batch arrived first, the replay brought the ones before it: the stream starts at 0.
//! assert!(matches!(first, SubscriberEvent::Batch { ref batch, .. } if batch.seq == 0));
//! subscriber.shutdown().await;
//! publisher.shutdown().await;
//! # Ok(())
//! # }
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(example())
//! # .map_err(|e| e.to_string())?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # How the subscriber works
//!
//! One task per worker reads the SUB socket. Each message is split with
//! [`RawBatch::from_live`](kvroute_wire::RawBatch::from_live), its sequence number classified by
//! a [`SeqTracker`](kvroute_wire::SeqTracker), then decoded and sent on. On a gap the task
//! stops reading live messages (they wait in the socket's queue), sends `["", start]` on a
//! DEALER to the replay endpoint, hands on the replies the tracker takes until the end marker,
//! then reads live again; live batches the replay already brought are dropped as duplicates.
//! Whatever a replay cannot bring (no replay endpoint, no progress within
//! [`SubscriberConfig::replay_timeout_ms`], or batches older than the publisher's buffer) is
//! one [`SubscriberEvent::GapLost`], and the batch that showed the gap is handed on after it.
//! A sequence number that goes back is a restart: [`SubscriberEvent::Restarted`], then the new
//! run (replayed from 0 if its first batches were missed).
//!
//! A subscriber that joins a publisher already running sees a gap from 0 to the first batch it
//! receives: it asks for a replay from 0, and what the publisher no longer buffers is reported
//! lost. That is also what makes a start race-free (PUB/SUB's "slow joiner": batches sent
//! before the subscription reached the publisher come back through the replay).
//!
//! **Resync.** After each (re)connection (connect mode: once connected; bind mode: when a
//! publisher connects) and on request ([`ResyncTrigger`], for a worker back from failed health
//! checks), the subscriber replays without waiting for a live batch: from 0 if it has handed
//! nothing on, else from the last batch it handed on, which must come back byte for byte. If it
//! does not, the publisher is another run (restarted, with a new cache): `Restarted`, then the
//! new run from 0. So a restarted engine's view is cleared and rebuilt before it publishes
//! anything new, and batches sent while the link was down arrive without waiting for the next.
//! A lost publisher is reconnected by a fresh socket, attempts at most [`RECONNECT_CAP`] (1 s)
//! apart: the `zeromq` crate's own reconnection backs off to 30 s.
//!
//! # Decisions
//!
//! * **Pure-Rust ZeroMQ.** `zeromq` 0.7 (zmq.rs) has SUB (bind and connect, with reconnection
//!   on connect), PUB (bind and connect), DEALER and ROUTER with multipart messages, over TCP
//!   and IPC. It has no `inproc://` transport, and its PUB does not reconnect by itself, so a
//!   connecting publisher watches the socket's events and connects again when its subscriber
//!   goes away (as libzmq would). The build needs nothing but cargo.
//!   `tests/libzmq.rs` checks it against libzmq 4.3 (pyzmq) in both directions: our subscriber
//!   and DEALER against a vLLM-like libzmq PUB and ROUTER, a libzmq SUB and DEALER against our
//!   publisher.
//! * **Ordering over throughput.** A replay holds the live stream back instead of interleaving
//!   it, so the receiver sees one worker's batches strictly in sequence order and never has to
//!   reorder. A long replay delays live batches; it never loses them (the socket queues them,
//!   and if it overflows the resulting gap is replayed too).
//! * **A bad message is an event, not an error.** Undecodable frames or payloads become
//!   [`SubscriberEvent::Error`] and a counter; the task never stops on input.
//! * **The subscriber's mode mirrors the publisher's.** [`subscriber_mode`] binds only for
//!   wildcard addresses, which only a listener can use; vLLM binds `ipc://` paths, so a
//!   subscriber connects to them (applying vLLM's rule itself would bind the same path twice).
//!   The config's `mode` overrides the default either way.
//! * **Backpressure is loss, and loss is recovered.** The event channel is bounded; a slow
//!   consumer stalls the task, the publisher's PUB drops, and the gap is replayed.
//! * **The publisher's tasks.** Live sends go through one task in publish order; replays are
//!   served by another from a copy of the buffer taken under a short lock, so a slow replay
//!   client never stalls live publishing (unlike vLLM, whose one thread does both).
//!
//! # Deliberately absent
//!
//! * Applying events to an index, clearing a worker, metrics export: the consumer's job (the
//!   server), using [`WireEvent::apply_to`](kvroute_wire::WireEvent::apply_to) and the counters.
//! * One socket for several data-parallel ranks: vLLM gives each rank its own port
//!   ([`rank_endpoint`]); run one subscriber per rank (`SubscriberConfig::rank`). Every event
//!   names the worker and the stream's rank, a batch naming no rank is the stream's
//!   ([`EventBatch::worker_key`](kvroute_wire::EventBatch::worker_key)), and sequence numbers
//!   are tracked per subscriber.
//! * Several engines on one bound subscriber (llm-d's centralized mode tells them apart by
//!   topic): sequence numbers are per publisher, so a subscriber follows one engine. In bind
//!   mode, give each worker its own port.
//! * Snapshots of a worker's whole cache (a proposal upstream, not a protocol yet), CURVE
//!   security, and a high-water-mark setting or message-size limit (the `zeromq` crate has
//!   neither: it reserves the length a frame claims, so a bound SUB must listen only where
//!   its engines are; `tests/zmtp_fuzz.rs`).
#![forbid(unsafe_code)]

mod error;
mod mode;
mod publisher;
mod subscriber;

pub use error::ZmqError;
pub use mode::{SocketMode, publisher_mode, rank_endpoint, subscriber_mode};
pub use publisher::{DEFAULT_BUFFER_STEPS, EventPublisher, PublisherConfig, ReplayHold};
pub use subscriber::{
    CounterSnapshot, DEFAULT_REPLAY_TIMEOUT_MS, RECONNECT_CAP, ReplayReports, ResyncTrigger,
    SubscriberConfig, SubscriberCounters, SubscriberEvent, SubscriberHandle, spawn_subscriber,
};
