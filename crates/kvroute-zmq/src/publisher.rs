//! The mock worker's side: a PUB socket that numbers and sends batches like vLLM's
//! `ZmqEventPublisher`, and a ROUTER socket that replays the ones it still buffers.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use futures::StreamExt;
use kvroute_wire::replay::{self, ReplayLayout};
use kvroute_wire::{EventBatch, EventEncoding, RawBatch, WireEvent};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use crate::error::ZmqError;
use crate::mode::{SocketMode, bind_or_defer, normalize};
use crate::subscriber::check_endpoint;

/// vLLM's default replay buffer: the last 10 000 batches.
pub const DEFAULT_BUFFER_STEPS: usize = 10_000;

/// Where and how a publisher sends.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublisherConfig {
    /// The PUB endpoint: an address to bind (`tcp://127.0.0.1:0` picks a free port, see
    /// [`EventPublisher::endpoint`]), or in connect mode the subscriber's address.
    pub endpoint: String,
    /// The replay ROUTER's endpoint, always bound; `None` for no replay.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// The topic frame of every message.
    #[serde(default)]
    pub topic: String,
    /// How many of the last batches the replay socket can send again.
    #[serde(default = "default_buffer_steps")]
    pub buffer_steps: usize,
    /// How events are encoded: maps (vLLM since mid 2026) or positional arrays (older vLLM,
    /// SGLang).
    #[serde(default, with = "EncodingDef")]
    pub encoding: EventEncoding,
    /// The layout of replay replies: `[topic, seq, payload]` (vLLM since mid 2026) or
    /// `[seq, payload]` (older vLLM, SGLang).
    #[serde(default = "default_layout", with = "LayoutDef")]
    pub replay_layout: ReplayLayout,
    /// Bind or connect the PUB socket; `None` binds (a mock worker listens, as vLLM does for
    /// `tcp://*:port`). [`publisher_mode`](crate::publisher_mode) gives vLLM's own rule.
    #[serde(default)]
    pub mode: Option<SocketMode>,
}

fn default_buffer_steps() -> usize {
    DEFAULT_BUFFER_STEPS
}

fn default_layout() -> ReplayLayout {
    ReplayLayout::TopicSeqPayload
}

/// Serde's view of [`EventEncoding`], which the sans-IO wire crate keeps free of serde.
#[derive(Serialize, Deserialize)]
#[serde(remote = "EventEncoding", rename_all = "lowercase")]
enum EncodingDef {
    Map,
    Positional,
}

/// Serde's view of [`ReplayLayout`].
#[derive(Serialize, Deserialize)]
#[serde(remote = "ReplayLayout", rename_all = "snake_case")]
enum LayoutDef {
    SeqPayload,
    TopicSeqPayload,
}

impl PublisherConfig {
    /// A config with the defaults: no replay, empty topic, map encoding, 10 000 batches
    /// buffered, the new replay layout, bind.
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: DEFAULT_BUFFER_STEPS,
            encoding: EventEncoding::Map,
            replay_layout: ReplayLayout::TopicSeqPayload,
            mode: None,
        }
    }

    /// The same config with another PUB endpoint.
    pub fn with_endpoint(self, endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            ..self
        }
    }

    /// Checks that the endpoints parse.
    pub fn validate(&self) -> Result<(), ZmqError> {
        check_endpoint("endpoint", &self.endpoint)?;
        if let Some(replay) = &self.replay_endpoint {
            check_endpoint("replay_endpoint", replay)?;
        }
        Ok(())
    }
}

/// What publishing shares with the replay task.
#[derive(Debug)]
struct State {
    /// The next batch's sequence number.
    next_seq: u64,
    /// The last `buffer_steps` batches: sequence number and payload.
    ring: VecDeque<(u64, Bytes)>,
    /// Batches still to number and buffer but not send.
    drop_remaining: u64,
    /// Set by [`EventPublisher::hold_replays`].
    gate: Option<Gate>,
}

/// Replays held: each request is announced, then waits until the gate opens.
#[derive(Clone, Debug)]
struct Gate {
    requested: mpsc::UnboundedSender<u64>,
    open: watch::Receiver<bool>,
}

/// Fault injection ([`EventPublisher::hold_replays`]): replay requests are announced here and
/// left unanswered until this is released or dropped.
#[derive(Debug)]
pub struct ReplayHold {
    requested: mpsc::UnboundedReceiver<u64>,
    open: watch::Sender<bool>,
}

impl ReplayHold {
    /// The first sequence number of the next replay request that arrives (and waits); `None`
    /// once the publisher is gone.
    pub async fn requested(&mut self) -> Option<u64> {
        self.requested.recv().await
    }

    /// Answers the requests waiting, and those to come.
    pub fn release(self) {
        self.open.send_replace(true);
    }
}

/// A running publisher. Dropping it stops its tasks and closes its sockets.
#[derive(Debug)]
pub struct EventPublisher {
    topic: Bytes,
    encoding: EventEncoding,
    buffer_steps: usize,
    endpoint: String,
    replay_endpoint: Option<String>,
    state: Arc<Mutex<State>>,
    live: mpsc::UnboundedSender<ZmqMessage>,
    /// Dropped to stop the tasks: each then closes its socket.
    stop: watch::Sender<()>,
    tasks: Vec<JoinHandle<()>>,
}

impl EventPublisher {
    /// Binds (or connects) the PUB socket and binds the replay socket, then returns. In
    /// connect mode the connection is made in the background; batches published before it is
    /// up are buffered for replay but not sent. Must be called within a Tokio runtime.
    pub async fn start(config: PublisherConfig) -> Result<Self, ZmqError> {
        config.validate()?;
        let endpoint = normalize(&config.endpoint);
        let mut socket = PubSocket::new();
        let mode = config.mode.unwrap_or(SocketMode::Bind);
        let (bound, connect_to) = bind_or_defer(&mut socket, mode, endpoint).await?;
        let state = Arc::new(Mutex::new(State {
            next_seq: 0,
            ring: VecDeque::new(),
            drop_remaining: 0,
            gate: None,
        }));
        let (stop, stopped) = watch::channel(());
        let mut tasks = Vec::new();
        let replay_endpoint = match &config.replay_endpoint {
            None => None,
            Some(replay_endpoint) => {
                let replay_endpoint = normalize(replay_endpoint);
                let mut router = RouterSocket::new();
                let bound = router
                    .bind(&replay_endpoint)
                    .await
                    .map_err(|e| ZmqError::socket(format!("binding {replay_endpoint}"), e))?;
                let topic = config.topic.clone();
                tasks.push(tokio::spawn(serve_replays(
                    router,
                    Arc::clone(&state),
                    topic,
                    config.replay_layout,
                    stopped.clone(),
                )));
                Some(bound.to_string())
            }
        };
        let (live, rx) = mpsc::unbounded_channel();
        tasks.push(tokio::spawn(send_live(socket, connect_to, rx, stopped)));
        Ok(Self {
            topic: Bytes::from(config.topic.into_bytes()),
            encoding: config.encoding,
            buffer_steps: config.buffer_steps,
            endpoint: bound,
            replay_endpoint,
            state,
            live,
            stop,
            tasks,
        })
    }

    /// The PUB endpoint: in bind mode the address bound (port 0 resolved to the real port), in
    /// connect mode the address connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The replay endpoint bound, if any (port 0 resolved).
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    /// The sequence number the next batch will get (the number of batches published so far).
    pub fn next_seq(&self) -> u64 {
        self.lock().next_seq
    }

    /// Publishes one batch: numbers it (0 for the first), encodes it, buffers it for replay and
    /// sends `[topic, seq, payload]`. Returns its sequence number. A PUB socket sends to the
    /// subscribers connected now and drops for the others, as vLLM's does.
    pub fn publish(&self, events: Vec<WireEvent>, dp_rank: Option<u32>, ts: f64) -> Result<u64, ZmqError> {
        let batch = EventBatch {
            topic: String::new(),
            seq: 0,
            ts,
            events,
            dp_rank,
        };
        // The payload does not contain the sequence number: encode before taking the lock.
        let payload = Bytes::from(batch.encode_payload(self.encoding)?);
        let mut state = self.lock();
        let seq = state.next_seq;
        state.next_seq = seq.saturating_add(1);
        if self.buffer_steps > 0 {
            if state.ring.len() == self.buffer_steps {
                state.ring.pop_front();
            }
            state.ring.push_back((seq, payload.clone()));
        }
        if state.drop_remaining > 0 {
            state.drop_remaining -= 1;
            return Ok(seq);
        }
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        let message = ZmqMessage::try_from(frames).map_err(|_| ZmqError::Stopped)?;
        // Sent under the lock, so that messages enter the socket in sequence order.
        self.live.send(message).map_err(|_| ZmqError::Stopped)?;
        Ok(seq)
    }

    /// Fault injection: the next `n` batches are numbered and buffered for replay but not sent
    /// live, as if the PUB socket had dropped them.
    pub fn drop_next(&self, n: u64) {
        self.lock().drop_remaining = n;
    }

    /// Fault injection: from now on, replay requests wait unanswered, each announced through
    /// the hold, until it is released (or dropped), as an engine slow to answer would.
    pub fn hold_replays(&self) -> ReplayHold {
        let (requested_tx, requested) = mpsc::unbounded_channel();
        let (open, open_rx) = watch::channel(false);
        self.lock().gate = Some(Gate {
            requested: requested_tx,
            open: open_rx,
        });
        ReplayHold { requested, open }
    }

    /// Stops the tasks and waits until the sockets are closed, so that the ports are free to
    /// bind again (dropping the publisher closes them too, without waiting).
    pub async fn shutdown(self) {
        let Self { stop, tasks, .. } = self;
        drop(stop);
        for task in tasks {
            // A task that panicked has stopped too.
            let _ = task.await;
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated in a way that
        // matters here (every update is one assignment or one push), so a poisoned lock is used.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Sends live messages in the order published. In connect mode, connects first (messages
/// queue meanwhile).
async fn send_live(
    mut socket: PubSocket,
    connect_to: Option<String>,
    rx: mpsc::UnboundedReceiver<ZmqMessage>,
    mut stop: watch::Receiver<()>,
) {
    tokio::select! {
        _ = stop.changed() => {}
        () = live_loop(&mut socket, connect_to, rx) => {}
    }
    close(socket).await;
}

/// How long closing a socket may take before it is left to finish on its own.
const CLOSE_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Closes `socket`, waiting (up to [`CLOSE_LIMIT`]) until its listeners are gone.
pub(crate) async fn close(socket: impl Socket) {
    // Errors here are about listeners already gone; there is no one to tell.
    let _ = tokio::time::timeout(CLOSE_LIMIT, socket.close()).await;
}

/// How long a connecting publisher waits between attempts that failed for good.
const RECONNECT_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

async fn live_loop(
    socket: &mut PubSocket,
    connect_to: Option<String>,
    mut rx: mpsc::UnboundedReceiver<ZmqMessage>,
) {
    let Some(endpoint) = connect_to else {
        while let Some(message) = rx.recv().await {
            // A PUB socket's send only fails when the socket is gone; there is no one to tell.
            let _ = socket.send(message).await;
        }
        return;
    };
    // The `zeromq` crate's PUB does not reconnect by itself (its SUB does): watch for the
    // subscriber going away and connect again, as libzmq would.
    let mut events = socket.monitor();
    loop {
        {
            // Until connected, what is published is dropped, as a PUB without subscribers
            // drops it; it stays in the replay ring.
            let connect = async {
                while socket.connect(&endpoint).await.is_err() {
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                }
            };
            tokio::pin!(connect);
            loop {
                tokio::select! {
                    () = &mut connect => break,
                    message = rx.recv() => if message.is_none() { return },
                }
            }
        }
        loop {
            tokio::select! {
                message = rx.recv() => match message {
                    Some(message) => {
                        let _ = socket.send(message).await;
                    }
                    None => return,
                },
                event = events.next() => match event {
                    Some(SocketEvent::Disconnected(_)) => break,
                    Some(_) => {}
                    // The socket is closing.
                    None => return,
                },
            }
        }
    }
}

/// Answers replay requests: `[identity, "", start]` gets every buffered batch from `start` on,
/// then the end marker. Malformed requests are ignored, as vLLM does. Closes the socket when
/// `stop` fires.
async fn serve_replays(
    mut router: RouterSocket,
    state: Arc<Mutex<State>>,
    topic: String,
    layout: ReplayLayout,
    mut stop: watch::Receiver<()>,
) {
    tokio::select! {
        _ = stop.changed() => {}
        () = replay_loop(&mut router, &state, &topic, layout) => {}
    }
    close(router).await;
}

async fn replay_loop(router: &mut RouterSocket, state: &Mutex<State>, topic: &str, layout: ReplayLayout) {
    loop {
        let Ok(message) = router.recv().await else {
            // A client went away mid-message; pause so that a burst of errors cannot spin.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let frames = message.into_vec();
        let Some((identity, request)) = frames.split_first() else {
            continue;
        };
        let Ok(start) = replay::parse_request(request) else {
            continue;
        };
        let gate = state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .gate
            .clone();
        if let Some(Gate { requested, mut open }) = gate {
            // Nobody listening, or the hold gone: answered at once.
            let _ = requested.send(start);
            let _ = open.wait_for(|open| *open).await;
        }
        let batches: Vec<(u64, Bytes)> = {
            let state = state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            state
                .ring
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .cloned()
                .collect()
        };
        let replies = batches
            .iter()
            .map(|(seq, payload)| {
                replay::reply(
                    &RawBatch {
                        topic,
                        seq: *seq,
                        payload,
                    },
                    layout,
                )
            })
            .chain(std::iter::once(replay::end(layout)));
        for reply in replies {
            let frames: Vec<Bytes> = std::iter::once(identity.clone())
                .chain(reply.into_iter().map(Bytes::from))
                .collect();
            let Ok(message) = ZmqMessage::try_from(frames) else {
                break;
            };
            if router.send(message).await.is_err() {
                // The client is gone; the rest of its replay has no one to go to.
                break;
            }
        }
    }
}
