//! The router's side: one SUB socket per worker endpoint, gaps filled through the publisher's
//! replay socket, batches handed on in sequence order.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_wire::replay::{self, ReplayReply};
use kvroute_wire::{EventBatch, RawBatch, ReplayStatus, SeqStatus, SeqTracker};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use crate::error::ZmqError;
use crate::mode::{SocketMode, bind_or_defer, normalize, subscriber_mode};

/// How long a replay may go without progress by default (see
/// [`SubscriberConfig::replay_timeout_ms`]).
pub const DEFAULT_REPLAY_TIMEOUT_MS: u64 = 1_000;

/// After a socket error (a peer gone) the receive loop pauses this long before reading again,
/// so that a burst of errors cannot spin a core.
const ERROR_PAUSE: Duration = Duration::from_millis(10);

/// After a connect that failed for good (not "refused", which the socket retries itself), the
/// subscriber tries again after this long.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// The longest one connect attempt of the SUB socket may take (connect mode). The `zeromq`
/// crate retries a refused connect with a back-off that doubles up to 30 s, and reconnects a
/// lost peer the same way; a restarted engine would then be heard from up to 30 s late (seen
/// with real vLLM: 4 to 15 s). Each attempt is cut off after this long and a fresh one started,
/// and a lost peer is reconnected by a fresh socket, so attempts are never more than about this
/// far apart (libzmq's `ZMQ_RECONNECT_IVL_MAX`, capped at 1 s).
pub const RECONNECT_CAP: Duration = Duration::from_secs(1);

/// One event stream (a worker's, or one data-parallel rank's of a worker whose ranks publish
/// apart): where to listen and how to recover.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubscriberConfig {
    /// The worker whose events these are; every [`SubscriberEvent`] carries it.
    #[serde(with = "worker_id")]
    pub worker: WorkerId,
    /// The data-parallel rank whose endpoints these are (0 for an engine of one rank); every
    /// [`SubscriberEvent`] carries it with the worker, and a batch naming no rank is this
    /// rank's.
    #[serde(default, with = "dp_rank")]
    pub rank: DpRank,
    /// The engine's PUB endpoint (`tcp://host:port` or `ipc://path`), or the address to listen
    /// on when the engine connects out (`tcp://*:port`).
    pub endpoint: String,
    /// The engine's replay (ROUTER) endpoint; `None` when it has none: gaps are then reported
    /// as lost at once.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// The topic prefix to subscribe to; `""` takes every message.
    #[serde(default)]
    pub topic: String,
    /// Bind or connect; `None` decides from the endpoint ([`subscriber_mode`]).
    #[serde(default)]
    pub mode: Option<SocketMode>,
    /// How long a replay may go without progress, in milliseconds: the limit on connecting to
    /// the replay socket, and then on each wait for the next reply. When it passes, the rest of
    /// the gap is reported lost ([`SubscriberEvent::GapLost`]) and the stream goes on.
    #[serde(default = "default_replay_timeout_ms")]
    pub replay_timeout_ms: u64,
    /// Whether a resync or gap fill through the replay socket is reported while it runs
    /// ([`SubscriberEvent::Replaying`], then [`SubscriberEvent::Replayed`]). Default: not.
    #[serde(default)]
    pub replay_reports: ReplayReports,
}

/// Whether a subscriber reports its replays ([`SubscriberConfig::replay_reports`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayReports {
    /// Only their batches, losses and restarts are reported.
    #[default]
    Off,
    /// Each replay is bracketed by [`SubscriberEvent::Replaying`] and
    /// [`SubscriberEvent::Replayed`].
    On,
}

fn default_replay_timeout_ms() -> u64 {
    DEFAULT_REPLAY_TIMEOUT_MS
}

impl SubscriberConfig {
    /// A config with the defaults: no replay, every topic, mode from the endpoint, 1 s replay
    /// timeout.
    pub fn new(worker: WorkerId, endpoint: impl Into<String>) -> Self {
        Self {
            worker,
            rank: DpRank(0),
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            mode: None,
            replay_timeout_ms: DEFAULT_REPLAY_TIMEOUT_MS,
            replay_reports: ReplayReports::Off,
        }
    }

    /// The mode the subscriber will use: the override, or [`subscriber_mode`].
    pub fn effective_mode(&self) -> SocketMode {
        self.mode.unwrap_or_else(|| subscriber_mode(&self.endpoint))
    }

    /// Checks the endpoints parse and the timeout is positive.
    pub fn validate(&self) -> Result<(), ZmqError> {
        check_endpoint("endpoint", &self.endpoint)?;
        if let Some(replay) = &self.replay_endpoint {
            check_endpoint("replay_endpoint", replay)?;
        }
        if self.replay_timeout_ms == 0 {
            return Err(ZmqError::Config("replay_timeout_ms must be positive".into()));
        }
        Ok(())
    }
}

/// Checks that `endpoint` (the config field `field`) is one the socket library accepts.
pub(crate) fn check_endpoint(field: &str, endpoint: &str) -> Result<(), ZmqError> {
    normalize(endpoint)
        .parse::<zeromq::Endpoint>()
        .map(|_| ())
        .map_err(|e| ZmqError::Config(format!("{field} {endpoint:?}: {e}")))
}

/// `WorkerId` as its integer in configs.
mod worker_id {
    use kvroute_core::ids::WorkerId;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(id: &WorkerId, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(id.0)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<WorkerId, D::Error> {
        u64::deserialize(d).map(WorkerId)
    }
}

/// `DpRank` as its integer in configs.
mod dp_rank {
    use kvroute_core::ids::DpRank;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(rank: &DpRank, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u32(rank.0)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DpRank, D::Error> {
        u32::deserialize(d).map(DpRank)
    }
}

/// What a subscriber hands on, in order, for its stream: each event names the worker and the
/// rank whose endpoints the subscriber follows (`SubscriberConfig::worker` and `rank`).
#[derive(Clone, Debug, PartialEq)]
pub enum SubscriberEvent {
    /// The next batch, in sequence order (live or replayed): apply its events to
    /// `batch.worker_key(worker)`.
    Batch {
        /// The worker and the stream's rank.
        worker: WorkerKey,
        /// The decoded batch.
        batch: EventBatch,
    },
    /// The publisher restarted (its sequence number went back): its cache is new, so clear
    /// the stream's rank. Batches of the new run follow.
    Restarted {
        /// The worker and the stream's rank.
        worker: WorkerKey,
    },
    /// These batches are gone (no replay endpoint, the replay timed out, or the publisher no
    /// longer buffers them); the stream continues after them. What the worker's state is now is
    /// unknown: the consumer decides (keep it, or clear it to never route on evicted blocks).
    GapLost {
        /// The worker and the stream's rank.
        worker: WorkerKey,
        /// The sequence numbers lost.
        missing: Range<u64>,
    },
    /// With [`ReplayReports::On`]: the subscriber is catching up through the replay socket, from
    /// sequence number `from` (after a (re)connection or on request, or to fill a gap). What
    /// the replay brings follows (batches, a restart, losses), then [`SubscriberEvent::Replayed`].
    Replaying {
        /// The worker and the stream's rank.
        worker: WorkerKey,
        /// The first sequence number asked for.
        from: u64,
        /// The replay endpoint asked.
        endpoint: String,
    },
    /// With [`ReplayReports::On`]: the replay announced by [`SubscriberEvent::Replaying`] is
    /// over, and everything it brought (or lost) was handed on.
    Replayed {
        /// The worker and the stream's rank.
        worker: WorkerKey,
    },
    /// A message that could not be decoded (bad frames or payload), skipped; or, in connect
    /// mode, a connect that failed for a reason retrying at once would not fix (it is retried
    /// after a second). Never fatal.
    Error {
        /// The worker and the stream's rank.
        worker: WorkerKey,
        /// What was wrong, naming the sequence number when it was readable.
        error: String,
    },
}

/// A subscriber's counters, shared with its task; read them for metrics.
#[derive(Debug, Default)]
pub struct SubscriberCounters {
    received: AtomicU64,
    emitted: AtomicU64,
    replayed: AtomicU64,
    duplicates: AtomicU64,
    gaps_detected: AtomicU64,
    gaps_recovered: AtomicU64,
    gaps_lost: AtomicU64,
    batches_lost: AtomicU64,
    restarts: AtomicU64,
    decode_errors: AtomicU64,
    replay_failures: AtomicU64,
    socket_errors: AtomicU64,
    reconnects: AtomicU64,
    resyncs: AtomicU64,
}

/// A copy of [`SubscriberCounters`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Live messages received with well-formed frames.
    pub received: u64,
    /// [`SubscriberEvent::Batch`]es handed on (live and replayed).
    pub emitted: u64,
    /// Of those, batches that came through a replay.
    pub replayed: u64,
    /// Batches dropped as already handed on (live after a replay, or replayed twice).
    pub duplicates: u64,
    /// Gaps in the live sequence numbers (a restart that skipped its first batches counts too).
    pub gaps_detected: u64,
    /// Gaps filled entirely by a replay.
    pub gaps_recovered: u64,
    /// [`SubscriberEvent::GapLost`]s sent.
    pub gaps_lost: u64,
    /// Batches reported lost, summed over those events.
    pub batches_lost: u64,
    /// Publisher restarts seen ([`SubscriberEvent::Restarted`]s sent).
    pub restarts: u64,
    /// Messages that could not be decoded ([`SubscriberEvent::Error`]s sent).
    pub decode_errors: u64,
    /// Replays that failed (no connection, no answer in time, a socket error).
    pub replay_failures: u64,
    /// Errors of the live socket (a publisher disconnecting, a failed connect).
    pub socket_errors: u64,
    /// Times the live socket lost its publisher and connected again (connect mode).
    pub reconnects: u64,
    /// Resyncs through the replay socket: after each (re)connection, and on request
    /// ([`ResyncTrigger`]).
    pub resyncs: u64,
}

impl SubscriberCounters {
    /// The counters now. Each is read on its own (relaxed), so a snapshot taken while batches
    /// flow may be a few increments apart between fields.
    pub fn snapshot(&self) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            received: get(&self.received),
            emitted: get(&self.emitted),
            replayed: get(&self.replayed),
            duplicates: get(&self.duplicates),
            gaps_detected: get(&self.gaps_detected),
            gaps_recovered: get(&self.gaps_recovered),
            gaps_lost: get(&self.gaps_lost),
            batches_lost: get(&self.batches_lost),
            restarts: get(&self.restarts),
            decode_errors: get(&self.decode_errors),
            replay_failures: get(&self.replay_failures),
            socket_errors: get(&self.socket_errors),
            reconnects: get(&self.reconnects),
            resyncs: get(&self.resyncs),
        }
    }
}

fn bump(counter: &AtomicU64) {
    add(counter, 1);
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// A running subscriber. Dropping it stops its task, which then closes its sockets;
/// [`SubscriberHandle::shutdown`] also waits until they are closed.
#[derive(Debug)]
pub struct SubscriberHandle {
    worker: WorkerId,
    mode: SocketMode,
    endpoint: String,
    counters: Arc<SubscriberCounters>,
    resync: ResyncTrigger,
    /// Dropped to stop the task.
    stop: watch::Sender<()>,
    task: JoinHandle<()>,
}

/// Asks a running subscriber to catch up with its publisher now (see
/// [`SubscriberHandle::resync_trigger`]). Cheap to clone; requests made while one is pending
/// are merged.
#[derive(Clone, Debug, Default)]
pub struct ResyncTrigger(Arc<Notify>);

impl ResyncTrigger {
    /// Asks for a resync; returns at once.
    pub fn request(&self) {
        self.0.notify_one();
    }
}

impl SubscriberHandle {
    /// A trigger that makes the subscriber check, through the replay socket, that its stream is
    /// still the publisher's current run and fetch what it missed: for a worker back from an
    /// outage (failed health checks) whose publisher may have restarted, or sent batches nobody
    /// received, without publishing anything since. The subscriber does the same by itself
    /// after every (re)connection. Without a replay endpoint it does nothing.
    pub fn resync_trigger(&self) -> ResyncTrigger {
        self.resync.clone()
    }

    /// The worker.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// Whether the SUB socket binds or connects.
    pub fn mode(&self) -> SocketMode {
        self.mode
    }

    /// In bind mode the endpoint actually bound (port 0 resolved to the real port); in connect
    /// mode the endpoint connected to.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The shared counters.
    pub fn counters(&self) -> &Arc<SubscriberCounters> {
        &self.counters
    }

    /// Whether the task has ended (its receiver was dropped, or it was stopped).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Stops the task and waits until its sockets are closed (in bind mode, until the port is
    /// free to bind again).
    pub async fn shutdown(self) {
        let Self { stop, task, .. } = self;
        drop(stop);
        // A task that panicked has stopped too.
        let _ = task.await;
    }
}

/// Starts a subscriber for `config.worker`: binds its SUB socket now (in bind mode, so that
/// [`SubscriberHandle::endpoint`] is the real address) or connects in the background, retrying
/// until the publisher is up (in connect mode), then sends every [`SubscriberEvent`] of the
/// worker to `tx`, in order. The task ends when the handle is dropped or `tx`'s receiver is.
///
/// A slow receiver slows the subscriber down: the socket's queue and then the publisher's fill,
/// the publisher drops batches, and the subscriber recovers them through replay or reports them
/// lost. Must be called within a Tokio runtime.
pub async fn spawn_subscriber(
    config: SubscriberConfig,
    tx: mpsc::Sender<SubscriberEvent>,
) -> Result<SubscriberHandle, ZmqError> {
    config.validate()?;
    let mode = config.effective_mode();
    let endpoint = normalize(&config.endpoint);
    let mut socket = sub_socket(&config.topic).await?;
    let (endpoint, connect_to) = bind_or_defer(&mut socket, mode, endpoint).await?;
    let counters = Arc::new(SubscriberCounters::default());
    let resync = ResyncTrigger::default();
    let session = Session {
        worker: WorkerKey::new(config.worker, config.rank),
        topic: config.topic,
        replay_endpoint: config.replay_endpoint.as_deref().map(normalize),
        replay_timeout: Duration::from_millis(config.replay_timeout_ms),
        tx,
        counters: Arc::clone(&counters),
        tracker: SeqTracker::new(),
        last_applied: None,
        resync: Arc::clone(&resync.0),
        dealer: None,
        replay_reports: config.replay_reports,
    };
    let (stop, stopped) = watch::channel(());
    let task = tokio::spawn(session.run(socket, connect_to, stopped));
    Ok(SubscriberHandle {
        worker: config.worker,
        mode,
        endpoint,
        counters,
        resync,
        stop,
        task,
    })
}

/// A SUB socket subscribed to `topic`, whose connect attempts give up after [`RECONNECT_CAP`].
async fn sub_socket(topic: &str) -> Result<SubSocket, ZmqError> {
    let mut options = SocketOptions::default();
    options.connect_timeout(RECONNECT_CAP);
    let mut socket = SubSocket::with_options(options);
    socket
        .subscribe(topic)
        .await
        .map_err(|e| ZmqError::socket(format!("subscribing to {topic:?}"), e))?;
    Ok(socket)
}

/// The next event of the socket's monitor; never, once the monitor has ended.
async fn next_event(
    monitor: &mut Option<futures::channel::mpsc::Receiver<SocketEvent>>,
) -> Option<SocketEvent> {
    match monitor {
        Some(events) => events.next().await,
        None => std::future::pending().await,
    }
}

/// A fingerprint of a batch's payload, to recognise it when it is replayed (a publisher
/// replays the bytes it sent).
fn fingerprint(payload: &[u8]) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

/// The receiver of the events is gone: the task ends.
struct Closed;

/// How a replay ended.
enum ReplayEnd {
    /// The end marker arrived.
    Done,
    /// It failed; the rest of the gap is lost.
    Failed,
    /// The publisher does not have the batch it was checked against (a resync): it restarted
    /// (or moved past its buffer since).
    OtherRun,
}

/// What arrived while the subscriber waits.
enum Input {
    Message(Result<ZmqMessage, zeromq::ZmqError>),
    Socket(Option<SocketEvent>),
    Resync,
}

/// The task's state.
struct Session {
    worker: WorkerKey,
    topic: String,
    replay_endpoint: Option<String>,
    replay_timeout: Duration,
    tx: mpsc::Sender<SubscriberEvent>,
    counters: Arc<SubscriberCounters>,
    tracker: SeqTracker,
    /// The sequence number and payload fingerprint of the last batch handed on (or found
    /// undecodable) since the publisher (re)started.
    last_applied: Option<(u64, u64)>,
    /// Set by [`ResyncTrigger::request`].
    resync: Arc<Notify>,
    /// The replay connection, kept between replays; dropped after any failure so that no late
    /// reply of an abandoned replay can be read as part of the next one.
    dealer: Option<DealerSocket>,
    replay_reports: ReplayReports,
}

impl Session {
    /// Serves until `stop` fires or the receiver is gone, then closes the socket.
    async fn run(mut self, mut socket: SubSocket, connect_to: Option<String>, mut stop: watch::Receiver<()>) {
        tokio::select! {
            _ = stop.changed() => {}
            () = self.serve(&mut socket, connect_to) => {}
        }
        crate::publisher::close(socket).await;
    }

    async fn serve(&mut self, socket: &mut SubSocket, connect_to: Option<String>) {
        let mut monitor = Some(socket.monitor());
        if let Some(endpoint) = &connect_to
            && self.connect(socket, endpoint).await.is_err()
        {
            return;
        }
        // In connect mode the publisher is there now: fetch what it buffers (at startup, what
        // it published before this subscriber came). In bind mode that happens when a
        // publisher connects.
        if connect_to.is_some() && self.resync().await.is_err() {
            return;
        }
        loop {
            let input = tokio::select! {
                _ = self.tx.closed() => return,
                received = socket.recv() => Input::Message(received),
                event = next_event(&mut monitor) => Input::Socket(event),
                () = self.resync.notified() => Input::Resync,
            };
            let step = match input {
                Input::Message(Ok(message)) => self.live(message.into_vec()).await,
                Input::Message(Err(_)) => {
                    // A publisher disconnected; it is reconnected below (connect mode) or
                    // accepted again (bind mode).
                    bump(&self.counters.socket_errors);
                    tokio::time::sleep(ERROR_PAUSE).await;
                    Ok(())
                }
                Input::Socket(Some(SocketEvent::Disconnected(_))) => match &connect_to {
                    Some(endpoint) => self.reconnect(socket, &mut monitor, endpoint).await,
                    None => Ok(()),
                },
                // A publisher connected to this bound socket: a new one, or one restarted.
                Input::Socket(Some(SocketEvent::Accepted(..))) | Input::Resync => self.resync().await,
                Input::Socket(Some(_)) => Ok(()),
                Input::Socket(None) => {
                    monitor = None;
                    Ok(())
                }
            };
            if step.is_err() {
                return;
            }
        }
    }

    /// Connects `socket` to `endpoint`, retrying until it succeeds: attempts that time out
    /// (nobody listening yet) at once, others after [`RECONNECT_PAUSE`], reported as errors.
    async fn connect(&mut self, socket: &mut SubSocket, endpoint: &str) -> Result<(), Closed> {
        loop {
            match socket.connect(endpoint).await {
                Ok(()) => return Ok(()),
                Err(zeromq::ZmqError::ConnectTimeout(_)) => {}
                Err(e) => {
                    bump(&self.counters.socket_errors);
                    let error = format!("connecting to {endpoint}: {e}");
                    self.send(SubscriberEvent::Error {
                        worker: self.worker,
                        error,
                    })
                    .await?;
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                }
            }
        }
    }

    /// The publisher went away (connect mode): a fresh socket connects again within about
    /// [`RECONNECT_CAP`] of it being back (the old socket's own reconnection backs off to
    /// 30 s), then catches up through the replay socket.
    async fn reconnect(
        &mut self,
        socket: &mut SubSocket,
        monitor: &mut Option<futures::channel::mpsc::Receiver<SocketEvent>>,
        endpoint: &str,
    ) -> Result<(), Closed> {
        bump(&self.counters.reconnects);
        let fresh = loop {
            match sub_socket(&self.topic).await {
                Ok(fresh) => break fresh,
                Err(e) => {
                    self.error(e.to_string()).await?;
                    tokio::time::sleep(RECONNECT_PAUSE).await;
                }
            }
        };
        let old = std::mem::replace(socket, fresh);
        crate::publisher::close(old).await;
        *monitor = Some(socket.monitor());
        self.connect(socket, endpoint).await?;
        self.resync().await
    }

    /// Catches up with the publisher through its replay socket, after a (re)connection or on
    /// request. If batches were handed on, the replay starts at the last one, which must come
    /// back byte for byte: otherwise the publisher is not the run those came from (it
    /// restarted, or its buffer has moved past it), which is reported as a restart, and the new
    /// run is replayed from 0. Batches it no longer buffers are reported lost. Does nothing
    /// without a replay endpoint (the next live batch shows a gap or a restart).
    async fn resync(&mut self) -> Result<(), Closed> {
        let Some(endpoint) = self.replay_endpoint.clone() else {
            return Ok(());
        };
        bump(&self.counters.resyncs);
        // A resync follows an outage: a kept replay connection may lead to a process that is gone.
        self.dealer = None;
        let mut lost = false;
        let check = self.last_applied;
        let start = check.map_or(self.tracker.next_expected(), |(seq, _)| seq);
        self.replaying(start, &endpoint).await?;
        match self.replay(&endpoint, start, &mut lost, check).await? {
            ReplayEnd::Done => {}
            ReplayEnd::Failed => bump(&self.counters.replay_failures),
            ReplayEnd::OtherRun => {
                bump(&self.counters.restarts);
                self.tracker = SeqTracker::new();
                self.last_applied = None;
                self.send(SubscriberEvent::Restarted { worker: self.worker })
                    .await?;
                if let ReplayEnd::Failed = self.replay(&endpoint, 0, &mut lost, None).await? {
                    bump(&self.counters.replay_failures);
                }
            }
        }
        self.replayed().await
    }

    /// Reports that a replay from `from` starts (with [`ReplayReports::On`]).
    async fn replaying(&self, from: u64, endpoint: &str) -> Result<(), Closed> {
        if self.replay_reports == ReplayReports::Off {
            return Ok(());
        }
        self.send(SubscriberEvent::Replaying {
            worker: self.worker,
            from,
            endpoint: endpoint.to_owned(),
        })
        .await
    }

    /// Reports that the replay is over (with [`ReplayReports::On`]).
    async fn replayed(&self) -> Result<(), Closed> {
        if self.replay_reports == ReplayReports::Off {
            return Ok(());
        }
        self.send(SubscriberEvent::Replayed { worker: self.worker }).await
    }

    /// One live message.
    async fn live(&mut self, frames: Vec<Bytes>) -> Result<(), Closed> {
        let raw = match RawBatch::from_live(&frames) {
            Ok(raw) => raw,
            Err(e) => return self.error(format!("live message: {e}")).await,
        };
        bump(&self.counters.received);
        match self.tracker.observe_live(raw.seq) {
            SeqStatus::InOrder => self.emit(&raw, false).await,
            SeqStatus::Duplicate => {
                bump(&self.counters.duplicates);
                Ok(())
            }
            SeqStatus::Gap { missing } => self.fill_gap(missing, &raw).await,
            SeqStatus::Restart { missing } => {
                bump(&self.counters.restarts);
                self.last_applied = None;
                // The replay connection went to the old process.
                self.dealer = None;
                self.send(SubscriberEvent::Restarted { worker: self.worker })
                    .await?;
                if missing.is_empty() {
                    self.emit(&raw, false).await
                } else {
                    self.fill_gap(missing, &raw).await
                }
            }
        }
    }

    /// `missing` never arrived; `held` is the live batch that showed it. Replays from
    /// `missing.start` if there is a replay endpoint, reports whatever stays missing as lost,
    /// and hands on `held` if the replay did not.
    ///
    /// The live socket is not read meanwhile: its messages wait in its queue, and those a
    /// replay already brought are dropped as duplicates afterwards.
    async fn fill_gap(&mut self, missing: Range<u64>, held: &RawBatch<'_>) -> Result<(), Closed> {
        bump(&self.counters.gaps_detected);
        let mut lost = false;
        let endpoint = self.replay_endpoint.clone();
        if let Some(endpoint) = &endpoint {
            self.replaying(missing.start, endpoint).await?;
            if let ReplayEnd::Failed = self.replay(endpoint, missing.start, &mut lost, None).await? {
                bump(&self.counters.replay_failures);
            }
        }
        if self.tracker.next_expected() <= held.seq {
            // The replay did not reach `held`: what it did not bring is lost, `held` goes on.
            if let Some(skipped) = self.tracker.skip_gap()
                && !skipped.is_empty()
            {
                lost = true;
                self.lost(skipped).await?;
            }
            self.emit(held, false).await?;
        }
        if !lost {
            bump(&self.counters.gaps_recovered);
        }
        if endpoint.is_some() {
            self.replayed().await?;
        }
        Ok(())
    }

    /// Asks for every buffered batch from `start` and hands on those the tracker takes. Sets
    /// `lost` if the publisher no longer had some. With `check` (a sequence number and payload
    /// fingerprint), the first reply must be that batch, else nothing is handed on and the
    /// replay ends as [`ReplayEnd::OtherRun`].
    async fn replay(
        &mut self,
        endpoint: &str,
        start: u64,
        lost: &mut bool,
        mut check: Option<(u64, u64)>,
    ) -> Result<ReplayEnd, Closed> {
        let limit = self.replay_timeout;
        let mut dealer = match self.dealer.take() {
            Some(dealer) => dealer,
            None => {
                let mut options = SocketOptions::default();
                options.connect_timeout(limit);
                let mut dealer = DealerSocket::with_options(options);
                match tokio::time::timeout(limit, dealer.connect(endpoint)).await {
                    Ok(Ok(())) => dealer,
                    _ => return Ok(ReplayEnd::Failed),
                }
            }
        };
        let request = replay::request(start).map(Bytes::from).to_vec();
        let Ok(request) = ZmqMessage::try_from(request) else {
            return Ok(ReplayEnd::Failed);
        };
        if !matches!(
            tokio::time::timeout(limit, dealer.send(request)).await,
            Ok(Ok(()))
        ) {
            return Ok(ReplayEnd::Failed);
        }
        loop {
            let frames = match tokio::time::timeout(limit, dealer.recv()).await {
                Ok(Ok(message)) => message.into_vec(),
                _ => return Ok(ReplayEnd::Failed),
            };
            if let Some((seq, print)) = check.take() {
                let same = matches!(replay::parse_reply(&frames),
                    Ok(ReplayReply::Batch(raw)) if raw.seq == seq && fingerprint(raw.payload) == print);
                if !same {
                    // The rest of this replay's replies are not wanted: a fresh connection
                    // never reads them.
                    return Ok(ReplayEnd::OtherRun);
                }
            }
            match replay::parse_reply(&frames) {
                Ok(ReplayReply::End) => {
                    self.dealer = Some(dealer);
                    return Ok(ReplayEnd::Done);
                }
                Ok(ReplayReply::Batch(raw)) => match self.tracker.observe_replayed(raw.seq) {
                    ReplayStatus::InOrder => self.emit(&raw, true).await?,
                    ReplayStatus::Duplicate => bump(&self.counters.duplicates),
                    ReplayStatus::Lost { missing } => {
                        *lost = true;
                        self.lost(missing).await?;
                        self.emit(&raw, true).await?;
                    }
                },
                Err(e) => self.error(format!("replay reply: {e}")).await?,
            }
        }
    }

    /// Decodes `raw` and hands it on (or reports it undecodable).
    async fn emit(&mut self, raw: &RawBatch<'_>, replayed: bool) -> Result<(), Closed> {
        self.last_applied = Some((raw.seq, fingerprint(raw.payload)));
        match raw.decode() {
            Ok(batch) => {
                bump(&self.counters.emitted);
                if replayed {
                    bump(&self.counters.replayed);
                }
                self.send(SubscriberEvent::Batch {
                    worker: self.worker,
                    batch,
                })
                .await
            }
            Err(e) => self.error(format!("batch {}: {e}", raw.seq)).await,
        }
    }

    async fn lost(&mut self, missing: Range<u64>) -> Result<(), Closed> {
        bump(&self.counters.gaps_lost);
        add(
            &self.counters.batches_lost,
            missing.end.saturating_sub(missing.start),
        );
        self.send(SubscriberEvent::GapLost {
            worker: self.worker,
            missing,
        })
        .await
    }

    async fn error(&mut self, error: String) -> Result<(), Closed> {
        bump(&self.counters.decode_errors);
        self.send(SubscriberEvent::Error {
            worker: self.worker,
            error,
        })
        .await
    }

    async fn send(&self, event: SubscriberEvent) -> Result<(), Closed> {
        self.tx.send(event).await.map_err(|_| Closed)
    }
}
