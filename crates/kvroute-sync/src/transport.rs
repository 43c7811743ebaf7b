//! The NATS transport: it moves the bytes of the replica-sync protocol
//! ([`kvroute_core::router::replica::ReplicaProtocol`]) and decides nothing. One task owns the
//! connection's subscriptions and the protocol: it feeds the protocol every message, link change
//! and due timeout, and carries out what the protocol returns (messages to publish, snapshots to
//! send, peers' changes to apply, bookings to release).
//!
//! **Routing never waits on NATS.** A change reaches the transport through
//! [`Outgoing::push`] with the urgency the router gave it ([`LoadChange::urgency`]; a registry
//! change is urgent): it goes straight into the core's [`Batcher`], behind a lock held for that
//! alone, and past [`NatsSyncConfig::queue_capacity`] waiting changes it is dropped and counted
//! (`kvroute_sync_events_dropped_total{cause="queue_full"}`). The task is woken only when a
//! change brings the batch's deadline forward (a booking within
//! [`NatsSyncConfig::batch_max_delay`], prefill done and freed within
//! [`NatsSyncConfig::batch_lazy_delay`] or with the next booking, a full batch at once): a change
//! that joins a batch already due sooner costs no wake-up. The task keeps one timer, at the
//! earlier of the batch's deadline and the protocol's. With no connection a due batch is dropped
//! and counted (`cause="disconnected"`), since the view is rebuilt from snapshots on reconnect.
//! A snapshot first publishes whatever waits, so that it never runs ahead of the batches.
//!
//! [`LoadChange::urgency`]: kvroute_core::router::LoadChange::urgency
//!
//! **Join warm.** [`SyncTransport::start`] subscribes, asks every replica for its snapshot (registry and
//! in-flight bookings) and returns once the protocol's join is over, so the host serves its
//! first request with its peers' load. NATS's "no responders" answers at once for the first
//! replica.
//!
//! **Subjects.** Under the prefix: `events` (batches, and snapshots announced after a
//! reconnection), `heartbeat`, `join` (snapshot requests to everyone) and `to.<id>` (what is
//! addressed to replica `<id>`: requests and snapshot answers). Requests carry the asker's
//! `to.<id>` as their reply subject, so NATS's "no responders" comes back there.
//!
//! **NATS down.** The replica routes on its own view, says so once in the log (warn), in
//! `kvroute_sync_connected` and in [`SyncTransport::link`]; peers time out and are released. The
//! protocol's rules for the link coming back (announce, re-announce, ask everyone) apply.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use async_nats::{Client, Event, Subscriber};
use bytes::Bytes;
use futures_util::StreamExt;
use kvroute_core::router::RouterId;
use kvroute_core::router::replica::{
    Action, BatchConfig, Batcher, Message, ProtocolConfig, ProtocolCounters, Release, ReplicaProtocol, To,
    Urgency,
};
use kvroute_core::time::{TimeScale, Timestamp};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;

use crate::connect::{NatsAuth, NatsTls};
use crate::metrics::SyncMetrics;
use crate::wire::{Body, DecodeError, Envelope, SyncItem, decode, encode, pack};

pub use kvroute_core::router::replica::LinkState;

/// The transport's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct NatsSyncConfig {
    /// The NATS server, `nats://host:port` (`tls://host:port` requires TLS). Logged: no
    /// credentials in it (they go in [`NatsSyncConfig::auth`]).
    pub url: String,
    /// How this replica proves itself to the server. Default: no credentials.
    pub auth: NatsAuth,
    /// TLS to the server. Default: TLS only if the server asks for it, verified by the
    /// system's CAs.
    pub tls: NatsTls,
    /// Every subject starts with this (`kvroute`): fleets with different prefixes
    /// share a server without hearing each other.
    pub subject_prefix: String,
    /// How often this replica heartbeats.
    pub heartbeat_interval: Duration,
    /// How long a peer may stay silent before its bookings are released.
    pub peer_timeout: Duration,
    /// The most events in one batch.
    pub batch_max_events: usize,
    /// The most bytes (about) in one message.
    pub batch_max_bytes: usize,
    /// How long a booking (an urgent change) may wait for others.
    pub batch_max_delay: Duration,
    /// How long a prefill-done or freed change (a lazy one: it only lowers a peer's view of load)
    /// may wait for others; the next booking takes it along sooner.
    pub batch_lazy_delay: Duration,
    /// The most changes waiting to be published; past it, changes are dropped and counted.
    pub queue_capacity: usize,
    /// How long a (re)join waits for its peers' snapshots.
    pub join_timeout: Duration,
}

impl NatsSyncConfig {
    /// The defaults, for server `url` and subjects under `prefix` (e.g. `kvroute`, or
    /// `kvroute.<cluster>`).
    pub fn new(url: impl Into<String>, prefix: &str) -> Self {
        let protocol = ProtocolConfig::default();
        let batching = BatchConfig::default();
        Self {
            url: url.into(),
            auth: NatsAuth::None,
            tls: NatsTls::default(),
            subject_prefix: prefix.to_owned(),
            heartbeat_interval: protocol.heartbeat_interval,
            peer_timeout: protocol.peer_timeout,
            batch_max_events: batching.max_events,
            batch_max_bytes: 512 * 1024,
            batch_max_delay: batching.window,
            batch_lazy_delay: batching.lazy_window,
            queue_capacity: 65_536,
            join_timeout: protocol.join_timeout,
        }
    }

    fn subject(&self, leaf: &str) -> String {
        format!("{}.{leaf}", self.subject_prefix)
    }

    /// The subject of what is addressed to replica `id`.
    fn direct(&self, id: RouterId) -> String {
        self.subject(&format!("to.{:016x}", id.0))
    }

    /// How changes are cut into batches.
    pub fn batching(&self) -> BatchConfig {
        BatchConfig {
            window: self.batch_max_delay,
            lazy_window: self.batch_lazy_delay,
            max_events: self.batch_max_events,
        }
    }

    /// The protocol's timing.
    pub fn protocol(&self) -> ProtocolConfig {
        ProtocolConfig {
            heartbeat_interval: self.heartbeat_interval,
            peer_timeout: self.peer_timeout,
            join_timeout: self.join_timeout,
            ..ProtocolConfig::default()
        }
    }
}

/// Why the transport did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SyncError {
    /// The NATS URL or options were refused.
    #[error("NATS {url}: {message}")]
    Connect {
        /// The server.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The server refused this replica: credentials it did not accept, or TLS that failed.
    #[error("NATS {url} refused this replica: {reason}")]
    Refused {
        /// The server.
        url: String,
        /// What was refused and what to check (never a credential's value).
        reason: String,
    },
    /// A subscription failed.
    #[error("NATS subscribe {subject}: {message}")]
    Subscribe {
        /// The subject.
        subject: String,
        /// What went wrong.
        message: String,
    },
}

/// What the transport needs of the replica it serves: apply peers' changes, and tell its own
/// state. Calls come from one task, in arrival order.
pub trait SyncHost: Send + std::marker::Sync + 'static {
    /// Applies peer `from`'s changes, in order.
    fn apply(&self, from: RouterId, events: &[SyncItem]);
    /// Releases every booking of peer `peer` (it went silent, or a snapshot of it follows).
    fn peer_lost(&self, peer: RouterId);
    /// This replica's registry (as [`SyncItem::Worker`] changes) and in-flight bookings.
    fn snapshot(&self) -> Vec<SyncItem>;
}

/// Where the host puts its changes for the peers. Never waits.
#[derive(Clone, Debug)]
pub struct Outgoing {
    shared: Arc<Shared>,
    metrics: SyncMetrics,
}

impl Outgoing {
    /// Queues `event`, a change of `urgency` (the router's [`LoadChange::urgency`] of it;
    /// [`Urgency::Urgent`] for a registry change), for its batch, or drops and counts it if
    /// [`NatsSyncConfig::queue_capacity`] changes wait already. Wakes the transport's task only
    /// if the change brings the batch's deadline forward.
    ///
    /// [`LoadChange::urgency`]: kvroute_core::router::LoadChange::urgency
    pub fn push(&self, event: SyncItem, urgency: Urgency) {
        let now = self.shared.now();
        let wake = {
            let mut pending = self.shared.lock();
            if pending.batcher.len() >= self.shared.capacity {
                drop(pending);
                self.metrics
                    .events_dropped
                    .with_label_values(&["queue_full"])
                    .inc();
                return;
            }
            pending.push(now, event, urgency, unix_micros())
        };
        if wake {
            self.shared.wake.notify_one();
        }
    }
}

/// What the pushers and the task share: the waiting changes and the task's wake-up.
#[derive(Debug)]
struct Shared {
    pending: Mutex<Pending>,
    /// Told when a change brought the batch's deadline forward.
    wake: Notify,
    /// The protocol's time 0.
    epoch: Instant,
    /// The most changes waiting.
    capacity: usize,
}

impl Shared {
    fn now(&self) -> Timestamp {
        TimeScale::REAL.timestamp(self.epoch.elapsed())
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// This replica's changes waiting to be published.
#[derive(Debug)]
struct Pending {
    batcher: Batcher<SyncItem>,
    /// When (Unix microseconds) the waiting batch's first booking, else its first change, was
    /// pushed: the batch's stamp, for the booking-age metric.
    batch_at: Option<(Urgency, u64)>,
    /// The batch deadline the task last saw (its timer is set to it, or to the protocol's
    /// sooner one); `None`: none.
    seen: Option<Timestamp>,
}

impl Pending {
    fn new(config: BatchConfig) -> Self {
        Self {
            batcher: Batcher::new(config),
            batch_at: None,
            seen: None,
        }
    }

    /// Queues `event` (of `urgency`, pushed at `now`, `at_us` on the wall clock); whether the
    /// task must wake: the batch is due sooner than the task knows.
    fn push(&mut self, now: Timestamp, event: SyncItem, urgency: Urgency, at_us: u64) -> bool {
        if self.batch_at.is_none_or(|(u, _)| u > urgency) {
            self.batch_at = Some((urgency, at_us));
        }
        self.batcher.push(now, event, urgency);
        let due = self.batcher.poll_timeout();
        let wake = match (due, self.seen) {
            (Some(due), Some(seen)) => due < seen,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if wake {
            self.seen = due;
        }
        wake
    }

    /// The waiting batch and its stamp, if due at `now` (every waiting change if `all`); the
    /// deadline of what is left becomes the one the task knows.
    fn take(&mut self, now: Timestamp, all: bool) -> Option<(Vec<SyncItem>, Option<u64>)> {
        let batch = if all {
            Some(self.batcher.take_all()).filter(|b| !b.is_empty())
        } else {
            self.batcher.take_due(now)
        };
        let taken = batch.map(|b| (b, self.batch_at.take().map(|(_, t)| t)));
        self.seen = self.batcher.poll_timeout();
        taken
    }
}

/// A fresh replica id: the clock, the process and a counter, mixed (SplitMix64's finalizer), so
/// that replicas started at once, in one process or not, differ.
pub fn fresh_router_id() -> RouterId {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = nanos
        ^ (u64::from(std::process::id()) << 32)
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    RouterId(z ^ (z >> 31))
}

/// A running transport. Dropping it stops its task.
#[derive(Debug)]
pub struct SyncTransport {
    id: RouterId,
    outgoing: Outgoing,
    link: watch::Receiver<LinkState>,
    task: JoinHandle<()>,
    client: Client,
}

impl SyncTransport {
    /// Connects to `config.url` as replica `id`, joins (applies every peer's snapshot through
    /// `host`) and starts the task. If the server cannot be reached within the join timeout,
    /// starts anyway on this replica's own view and joins when the connection comes; if it
    /// refuses this replica (credentials, TLS), fails with [`SyncError::Refused`].
    pub async fn start(
        id: RouterId,
        config: NatsSyncConfig,
        host: Arc<dyn SyncHost>,
        metrics: SyncMetrics,
    ) -> Result<Self, SyncError> {
        let (events_tx, link_events) = mpsc::unbounded_channel();
        let client = crate::connect::connect(id, &config, &events_tx).await?;
        let subscribe = |subject: String| {
            let client = client.clone();
            async move {
                client
                    .subscribe(subject.clone())
                    .await
                    .map_err(|e| SyncError::Subscribe {
                        subject,
                        message: e.to_string(),
                    })
            }
        };
        let subs = Subscriptions {
            events: subscribe(config.subject("events")).await?,
            heartbeats: subscribe(config.subject("heartbeat")).await?,
            joins: subscribe(config.subject("join")).await?,
            direct: subscribe(config.direct(id)).await?,
        };
        let (link_tx, link) = watch::channel(LinkState::Disconnected);
        let (joined_tx, mut joined) = watch::channel(false);
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending::new(config.batching())),
            wake: Notify::new(),
            epoch: Instant::now(),
            capacity: config.queue_capacity.max(1),
        });
        let outgoing = Outgoing {
            shared: Arc::clone(&shared),
            metrics: metrics.clone(),
        };
        let mut node = Node {
            id,
            protocol: ReplicaProtocol::new(id, config.protocol()),
            shared,
            config: config.clone(),
            client: client.clone(),
            host,
            metrics: metrics.clone(),
            link: link_tx,
            joined: joined_tx,
            counted: ProtocolCounters::default(),
            versions_logged: Vec::new(),
        };
        // Join before serving: wait for the connection (bounded), then for the protocol's join.
        let connected = tokio::time::timeout(config.join_timeout, async {
            while client.connection_state() != async_nats::connection::State::Connected {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .is_ok();
        if connected {
            let now = node.now();
            let actions = node.protocol.start(now);
            node.link_changed(LinkState::Connected);
            node.carry_out(actions).await;
        } else {
            tracing::warn!(
                url = config.url,
                "NATS unreachable; routing on this replica's own view until it is"
            );
        }
        let task = tokio::spawn(node.run(subs, link_events));
        if connected {
            // The protocol ends the join itself (at the latest at the join timeout).
            let _ = joined.wait_for(|&j| j).await;
        }
        Ok(Self {
            id,
            outgoing,
            link,
            task,
            client,
        })
    }

    /// This replica's id.
    pub fn id(&self) -> RouterId {
        self.id
    }

    /// Where the host puts its changes.
    pub fn outgoing(&self) -> &Outgoing {
        &self.outgoing
    }

    /// Whether it is connected now.
    pub fn link(&self) -> LinkState {
        *self.link.borrow()
    }

    /// Stops the task and closes the connection.
    pub fn stop(&self) {
        self.task.abort();
        let client = self.client.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = client.drain().await;
            });
        }
    }
}

impl Drop for SyncTransport {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Subscriptions {
    events: Subscriber,
    heartbeats: Subscriber,
    joins: Subscriber,
    direct: Subscriber,
}

/// What the task owns: the protocol, and the connection it speaks through.
struct Node {
    id: RouterId,
    protocol: ReplicaProtocol,
    /// This replica's changes waiting to be published, shared with its [`Outgoing`].
    shared: Arc<Shared>,
    config: NatsSyncConfig,
    client: Client,
    host: Arc<dyn SyncHost>,
    metrics: SyncMetrics,
    link: watch::Sender<LinkState>,
    joined: watch::Sender<bool>,
    /// The protocol's counters as last reflected in the metrics.
    counted: ProtocolCounters,
    /// The (format, version, sender) of other versions' messages said in the log already
    /// (at most [`MAX_VERSIONS_LOGGED`]).
    versions_logged: Vec<(&'static str, u32, Option<u64>)>,
}

/// The most distinct senders of another format version that are each logged once.
const MAX_VERSIONS_LOGGED: usize = 64;

impl Node {
    fn now(&self) -> Timestamp {
        self.shared.now()
    }

    /// The task's loop: messages, link changes, and one timer at the earlier of the batch's
    /// deadline and the protocol's, one at a time. A pusher wakes it when the batch's deadline
    /// comes forward.
    async fn run(mut self, mut subs: Subscriptions, mut link_events: mpsc::UnboundedReceiver<Event>) {
        let timer = tokio::time::sleep_until(self.instant(Timestamp::ZERO));
        tokio::pin!(timer);
        // What the timer is set to.
        let mut set: Option<Timestamp> = None;
        loop {
            let batch_due = self.shared.lock().seen;
            let next = match (batch_due, self.protocol.poll_timeout()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if next != set {
                if let Some(t) = next {
                    timer.as_mut().reset(self.instant(t));
                }
                set = next;
            }
            tokio::select! {
                Some(m) = subs.joins.next() => self.receive(m).await,
                Some(m) = subs.direct.next() => self.receive(m).await,
                Some(m) = subs.events.next() => self.receive(m).await,
                Some(m) = subs.heartbeats.next() => self.receive(m).await,
                () = self.shared.wake.notified() => self.flush_due(false).await,
                () = &mut timer, if set.is_some() => {
                    set = None;
                    self.flush_due(false).await;
                    let now = self.now();
                    if self.protocol.poll_timeout().is_some_and(|t| t <= now) {
                        let actions = self.protocol.handle_timeout(now);
                        self.carry_out(actions).await;
                    }
                }
                Some(event) = link_events.recv() => {
                    let link = match event {
                        Event::Connected => LinkState::Connected,
                        Event::Disconnected => LinkState::Disconnected,
                        _ => continue,
                    };
                    if link != self.protocol.link() {
                        let now = self.now();
                        let actions = self.protocol.handle_link(now, link);
                        self.link_changed(link);
                        self.carry_out(actions).await;
                    }
                }
                else => break,
            }
        }
    }

    /// Publishes the waiting batch if it is due (every waiting change if `all`).
    async fn flush_due(&mut self, all: bool) {
        let now = self.now();
        let taken = self.shared.lock().take(now, all);
        if let Some((events, at_us)) = taken {
            self.flush(events, at_us).await;
        }
    }

    /// The wall-clock instant of protocol time `t`.
    fn instant(&self, t: Timestamp) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.shared.epoch) + Duration::from_nanos(t.as_nanos())
    }

    fn link_changed(&self, link: LinkState) {
        self.link.send_replace(link);
        match link {
            LinkState::Connected => {
                self.metrics.connected.set(1);
                if self.protocol.counters().resyncs > 1 {
                    tracing::info!(
                        url = self.config.url,
                        "NATS connection back; resyncing with the peers"
                    );
                }
            }
            LinkState::Disconnected => {
                self.metrics.connected.set(0);
                tracing::warn!(
                    url = self.config.url,
                    "NATS connection lost; routing on this replica's own view until it returns"
                );
            }
        }
    }

    /// Publishes this replica's changes, in messages under the size limits, stamped with the
    /// time the batch's first booking (else its first change) was pushed (`at_us`).
    async fn flush(&mut self, events: Vec<SyncItem>, at_us: Option<u64>) {
        let at_us = at_us.unwrap_or_else(unix_micros);
        if self.protocol.link() == LinkState::Disconnected {
            self.metrics
                .events_dropped
                .with_label_values(&["disconnected"])
                .inc_by(events.len() as u64);
            return;
        }
        for events in pack(events, self.config.batch_max_events, self.config.batch_max_bytes) {
            let n = events.len() as u64;
            let now = self.now();
            if let Some(message) = self.protocol.publish(now, events)
                && self.send(To::Everyone, message, Some(at_us)).await
            {
                self.metrics.events_sent.inc_by(n);
            }
        }
    }

    /// A message from a subscription.
    async fn receive(&mut self, m: async_nats::Message) {
        if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            let now = self.now();
            let actions = self.protocol.handle_nobody_listening(now);
            self.carry_out(actions).await;
            return;
        }
        let Some(envelope) = self.open(&m) else { return };
        let sent_at = match &envelope.body {
            Body::Events { at_us, events, .. } => {
                let bookings = events
                    .iter()
                    .filter(|e| matches!(e, SyncItem::Added { .. }))
                    .count();
                at_us.map(|t| (t, bookings))
            }
            _ => None,
        };
        let now = self.now();
        let actions = self
            .protocol
            .handle(now, RouterId(envelope.from), envelope.body.into_message());
        let applied = actions.iter().any(|a| matches!(a, Action::Apply { .. }));
        self.carry_out(actions).await;
        if let Some((at_us, n)) = sent_at
            && applied
        {
            let age = unix_micros().saturating_sub(at_us) as f64 / 1e6;
            for _ in 0..n {
                self.metrics.booking_age.observe(age);
            }
        }
    }

    /// Decodes a peer's message; `None` for this replica's own, a status message, garbage
    /// (counted) or another format version's message (counted, and said once a sender in the
    /// log).
    fn open(&mut self, m: &async_nats::Message) -> Option<Envelope> {
        if m.status.is_some() {
            return None;
        }
        match decode(&m.payload) {
            Ok(e) if e.from == self.id.0 => None,
            Ok(e) => {
                self.metrics.messages_received.inc();
                self.metrics.bytes_received.inc_by(m.payload.len() as u64);
                Some(e)
            }
            Err(
                e @ DecodeError::Version {
                    format,
                    version,
                    from,
                },
            ) => {
                self.metrics
                    .versions_refused
                    .with_label_values(&[format.name()])
                    .inc();
                let key = (format.name(), version, from);
                if !self.versions_logged.contains(&key) && self.versions_logged.len() < MAX_VERSIONS_LOGGED {
                    self.versions_logged.push(key);
                    tracing::warn!(subject = %m.subject, "{e}");
                }
                None
            }
            Err(e) => {
                self.metrics.decode_errors.inc();
                tracing::debug!(error = %e, subject = %m.subject, "not a sync message");
                None
            }
        }
    }

    /// Carries out the protocol's actions, in order.
    async fn carry_out(&mut self, actions: Vec<Action<SyncItem>>) {
        for action in actions {
            match action {
                Action::Send { to, message } => {
                    self.send(to, message, None).await;
                }
                Action::SendSnapshot { to } => {
                    self.flush_due(true).await;
                    let parts = pack(
                        self.host.snapshot(),
                        self.config.batch_max_events.max(1024),
                        self.config.batch_max_bytes,
                    );
                    for message in self.protocol.snapshot_messages(parts) {
                        self.send(to, message, None).await;
                    }
                }
                Action::Apply { from, events } => self.host.apply(from, &events),
                Action::Release { peer, cause } => {
                    if cause == Release::Silent {
                        tracing::warn!(
                            peer = format!("{:016x}", peer.0),
                            "replica silent past the peer timeout; its bookings released"
                        );
                    }
                    self.host.peer_lost(peer);
                }
            }
        }
        let counters = self.protocol.counters();
        self.metrics
            .peers_lost
            .inc_by(counters.peers_lost - self.counted.peers_lost);
        self.metrics
            .resyncs
            .inc_by(counters.resyncs - self.counted.resyncs);
        self.counted = counters;
        self.metrics.peers.set(self.protocol.peers().count() as i64);
        self.joined.send_replace(self.protocol.is_joined());
    }

    /// Publishes one message to `to` (a batch stamped with `at_us`); whether it was handed to
    /// the connection.
    async fn send(&self, to: To, message: Message<SyncItem>, at_us: Option<u64>) -> bool {
        let (kind, subject) = match (&message, to) {
            (Message::Events { .. }, To::Everyone) => ("events", self.config.subject("events")),
            (Message::Heartbeat { .. }, To::Everyone) => ("heartbeat", self.config.subject("heartbeat")),
            (Message::SnapshotRequest, To::Everyone) => ("join", self.config.subject("join")),
            (Message::Snapshot(_), To::Everyone) => ("snapshot", self.config.subject("events")),
            (Message::SnapshotRequest, To::Peer(p)) => ("join", self.config.direct(p)),
            (Message::Snapshot(_), To::Peer(p)) => ("snapshot", self.config.direct(p)),
            (Message::Events { .. }, To::Peer(p)) => ("events", self.config.direct(p)),
            (Message::Heartbeat { .. }, To::Peer(p)) => ("heartbeat", self.config.direct(p)),
        };
        let asks = matches!(message, Message::SnapshotRequest);
        let mut body = Body::from_message(message);
        if let Body::Events { at_us: stamp, .. } = &mut body {
            *stamp = at_us;
        }
        let bytes = Bytes::from(encode(&Envelope {
            from: self.id.0,
            body,
        }));
        let len = bytes.len() as u64;
        let sent = if asks {
            // The answer, or NATS's "no responders", comes back to this replica's own subject.
            self.client
                .publish_with_reply(subject, self.config.direct(self.id), bytes)
                .await
        } else {
            self.client.publish(subject, bytes).await
        };
        match sent {
            Ok(()) => {
                self.metrics.messages_sent.with_label_values(&[kind]).inc();
                self.metrics.bytes_sent.inc_by(len);
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "sync publish failed");
                false
            }
        }
    }
}

/// The wall clock, microseconds since the Unix epoch.
fn unix_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Timestamp {
        Timestamp::ZERO + Duration::from_millis(ms)
    }

    fn item(r: u64) -> SyncItem {
        SyncItem::Freed { r }
    }

    /// The task is woken exactly when a change brings the batch's deadline forward, and sees
    /// every change by its deadline.
    #[test]
    fn a_change_wakes_the_task_only_when_it_brings_the_deadline_forward() {
        let config = BatchConfig {
            window: Duration::from_millis(2),
            lazy_window: Duration::from_millis(100),
            max_events: 4,
        };
        let mut p = Pending::new(config);
        // A lazy change into an empty batch: the task must set its timer.
        assert!(p.push(at(0), item(1), Urgency::Lazy, 1));
        assert_eq!(p.seen, Some(at(100)));
        // Another lazy one rides along: its own deadline is later.
        assert!(!p.push(at(10), item(2), Urgency::Lazy, 2));
        // A booking brings the deadline forward to its window.
        assert!(p.push(at(20), item(3), Urgency::Urgent, 3));
        assert_eq!(p.seen, Some(at(22)));
        assert!(p.take(at(21), false).is_none(), "not due before its deadline");
        let (batch, stamp) = p.take(at(22), false).unwrap();
        assert_eq!(batch, vec![item(1), item(2), item(3)]);
        assert_eq!(stamp, Some(3), "stamped by the booking");
        assert_eq!(p.seen, None);
        // A full batch is due at once.
        for r in 0..3 {
            p.push(at(30), item(r), Urgency::Lazy, 4);
        }
        assert!(
            p.push(at(30), item(3), Urgency::Lazy, 4),
            "the fourth fills the batch"
        );
        assert_eq!(p.seen, Some(at(30)));
        // All, due or not, before a snapshot.
        assert_eq!(p.take(at(0), true).map(|(b, _)| b.len()), Some(4));
        assert!(p.take(at(0), true).is_none());
    }
}
