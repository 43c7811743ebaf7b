//! The NATS transport: one connection, a publisher task fed by a bounded queue, and one receiver
//! task that applies peers' messages in the order they arrive, answers joins, heartbeats and
//! releases the bookings of peers gone silent.
//!
//! **Routing never waits on NATS.** A change reaches the transport through
//! [`Outgoing::push`], a `try_send` into a bounded queue: when it is full the change is dropped
//! and counted (`kvroute_sync_events_dropped_total{cause="queue_full"}`). The publisher cuts
//! batches by size or by time, whichever comes first; with no connection a due batch is dropped
//! and counted (`cause="disconnected"`), since the view is rebuilt from snapshots on reconnect.
//!
//! **Join warm.** [`Sync::start`] subscribes, then asks every replica on `<prefix>.join` for its
//! snapshot (registry and in-flight bookings) and applies each before it returns, so the host
//! serves its first request with its peers' load. It waits for the replicas its peers name, or
//! [`SyncConfig::join_timeout`]; NATS's "no responders" answers at once for the first replica.
//!
//! **Heal fast.** Each replica heartbeats every [`SyncConfig::heartbeat_interval`]; a peer not
//! heard for [`SyncConfig::peer_timeout`] has its bookings released ([`SyncHost::peer_lost`]).
//! A peer heard again, or for the first time (a joiner too: one back from an outage may have
//! announced its snapshot before this replica had subscribed again), is asked for its snapshot.
//!
//! **NATS down.** The replica routes on its own view, says so once in the log (warn), in
//! `kvroute_sync_connected` and in [`Sync::link`]; peers time out and are released. When the
//! connection returns it announces its own snapshot (peers replace what they held of it; again
//! with its next `REANNOUNCES` heartbeats, for peers back a moment later) and asks for
//! everyone's, without holding its loop: it answers its peers' asks meanwhile.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::{Client, Event, Subscriber};
use bytes::Bytes;
use futures_util::StreamExt;
use kvroute_core::router::{PeerTracker, RouterId};
use kvroute_core::time::{TimeScale, Timestamp};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::connect::{NatsAuth, NatsTls};
use crate::metrics::SyncMetrics;
use crate::wire::{Body, Envelope, WIRE_VERSION, WireEvent, decode, encode, pack};

/// How many times a peer is asked for its snapshot before the asking stops (the peer's timeout
/// then releases whatever was booked for it).
const SNAPSHOT_ASKS: usize = 3;

/// How many heartbeats after a reconnection also carry this replica's snapshot to its peers
/// (peers coming back at the same moment may miss the announce made on reconnecting).
const REANNOUNCES: u32 = 3;

/// Asks every replica on `subject` for its snapshot (`request`); the answers come on the
/// returned subscription. `None` if the request could not be sent.
async fn ask_everyone(
    client: &Client,
    subject: String,
    request: Bytes,
    metrics: &SyncMetrics,
) -> Option<Subscriber> {
    let inbox = client.new_inbox();
    let answers = client.subscribe(inbox.clone()).await.ok()?;
    client.publish_with_reply(subject, inbox, request).await.ok()?;
    metrics.messages_sent.with_label_values(&["join"]).inc();
    Some(answers)
}

/// The transport's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SyncConfig {
    /// The NATS server, `nats://host:port` (`tls://host:port` requires TLS). Logged: no
    /// credentials in it (they go in [`SyncConfig::auth`]).
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
    /// How long the first event of a batch may wait for others.
    pub batch_max_delay: Duration,
    /// The outgoing queue's capacity in events; past it, events are dropped and counted.
    pub queue_capacity: usize,
    /// How long a (re)join waits for its peers' snapshots.
    pub join_timeout: Duration,
}

impl SyncConfig {
    /// The defaults, for server `url` and subjects under `prefix` (e.g. `kvroute`, or
    /// `kvroute.<cluster>`).
    pub fn new(url: impl Into<String>, prefix: &str) -> Self {
        Self {
            url: url.into(),
            auth: NatsAuth::None,
            tls: NatsTls::default(),
            subject_prefix: prefix.to_owned(),
            heartbeat_interval: Duration::from_millis(1000),
            peer_timeout: Duration::from_millis(3000),
            batch_max_events: 256,
            batch_max_bytes: 512 * 1024,
            batch_max_delay: Duration::from_millis(2),
            queue_capacity: 65_536,
            join_timeout: Duration::from_millis(2000),
        }
    }

    fn subject(&self, leaf: &str) -> String {
        format!("{}.{leaf}", self.subject_prefix)
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
    fn apply(&self, from: RouterId, events: &[WireEvent]);
    /// Releases every booking of peer `peer` (it went silent, or a snapshot of it follows).
    fn peer_lost(&self, peer: RouterId);
    /// This replica's registry (as [`WireEvent::Worker`] changes) and in-flight bookings.
    fn snapshot(&self) -> Vec<WireEvent>;
}

/// Whether the replica is connected to NATS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkState {
    /// Connected: changes flow both ways.
    Connected,
    /// Not connected: routing on this replica's own view.
    Disconnected,
}

impl LinkState {
    /// Its name, for health details.
    pub fn name(self) -> &'static str {
        match self {
            Self::Connected => "connected",
            Self::Disconnected => "disconnected",
        }
    }
}

/// Where the host puts its changes for the peers. Never waits.
#[derive(Clone, Debug)]
pub struct Outgoing {
    tx: mpsc::Sender<WireEvent>,
    metrics: SyncMetrics,
}

impl Outgoing {
    /// Queues `event` for the next batch, or drops and counts it if the queue is full.
    pub fn push(&self, event: WireEvent) {
        if self.tx.try_send(event).is_err() {
            self.metrics
                .events_dropped
                .with_label_values(&["queue_full"])
                .inc();
        }
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

/// A running transport. Dropping it stops its tasks.
#[derive(Debug)]
pub struct Sync {
    id: RouterId,
    outgoing: Outgoing,
    link: watch::Receiver<LinkState>,
    tasks: Vec<JoinHandle<()>>,
    client: Client,
}

/// What the receiver task owns.
struct Receiver {
    id: RouterId,
    config: SyncConfig,
    client: Client,
    host: Arc<dyn SyncHost>,
    metrics: SyncMetrics,
    /// The core's rule for a peer gone silent.
    peers: PeerTracker,
    /// The peers whose snapshot came (or was asked for) since this replica's last connection:
    /// any other peer heard is asked for it. After an outage every peer's snapshot is needed,
    /// and the one a peer announced, or gave to the rejoin, may have gone out while this
    /// replica, or that peer, was not back yet; a peer heard is back.
    synced: BTreeSet<RouterId>,
    epoch: Instant,
}

impl Sync {
    /// Connects to `config.url` as replica `id`, joins (applies every peer's snapshot through
    /// `host`) and starts the tasks. If the server cannot be reached within the join timeout,
    /// starts anyway on this replica's own view and joins when the connection comes; if it
    /// refuses this replica (credentials, TLS), fails with [`SyncError::Refused`].
    pub async fn start(
        id: RouterId,
        config: SyncConfig,
        host: Arc<dyn SyncHost>,
        metrics: SyncMetrics,
    ) -> Result<Self, SyncError> {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
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
        let events = subscribe(config.subject("events")).await?;
        let heartbeats = subscribe(config.subject("heartbeat")).await?;
        let joins = subscribe(config.subject("join")).await?;
        let direct = subscribe(config.subject(&format!("join.{:016x}", id.0))).await?;
        let (link_tx, link) = watch::channel(LinkState::Disconnected);
        let mut receiver = Receiver {
            id,
            peers: PeerTracker::new(config.peer_timeout),
            synced: BTreeSet::new(),
            config: config.clone(),
            client: client.clone(),
            host,
            metrics: metrics.clone(),
            epoch: Instant::now(),
        };
        // Join before serving: wait for the connection (bounded), then for the peers' snapshots.
        let connected = tokio::time::timeout(config.join_timeout, async {
            while client.connection_state() != async_nats::connection::State::Connected {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .is_ok();
        if connected {
            link_tx.send_replace(LinkState::Connected);
            metrics.connected.set(1);
            receiver.join().await;
        } else {
            tracing::warn!(
                url = config.url,
                "NATS unreachable; routing on this replica's own view until it is"
            );
        }
        let (tx, rx) = mpsc::channel(config.queue_capacity.max(1));
        let outgoing = Outgoing {
            tx,
            metrics: metrics.clone(),
        };
        let publisher = tokio::spawn(publish(id, config.clone(), client.clone(), rx, metrics.clone()));
        let run = tokio::spawn(receiver.run(
            Subscriptions {
                events,
                heartbeats,
                joins,
                direct,
            },
            events_rx,
            link_tx,
            connected,
        ));
        Ok(Self {
            id,
            outgoing,
            link,
            tasks: vec![publisher, run],
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

    /// Stops the tasks and closes the connection.
    pub fn stop(&self) {
        for t in &self.tasks {
            t.abort();
        }
        let client = self.client.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = client.drain().await;
            });
        }
    }
}

impl Drop for Sync {
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

/// The publisher: batches by size or time, whichever first.
async fn publish(
    id: RouterId,
    config: SyncConfig,
    client: Client,
    mut rx: mpsc::Receiver<WireEvent>,
    metrics: SyncMetrics,
) {
    let subject = config.subject("events");
    let mut batch = Vec::with_capacity(config.batch_max_events);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        let due = tokio::time::Instant::now() + config.batch_max_delay;
        while batch.len() < config.batch_max_events {
            match tokio::time::timeout_at(due, rx.recv()).await {
                Ok(Some(e)) => batch.push(e),
                Ok(None) | Err(_) => break,
            }
        }
        let events = std::mem::take(&mut batch);
        if client.connection_state() != async_nats::connection::State::Connected {
            metrics
                .events_dropped
                .with_label_values(&["disconnected"])
                .inc_by(events.len() as u64);
            continue;
        }
        for events in pack(events, config.batch_max_events, config.batch_max_bytes) {
            let n = events.len() as u64;
            let body = Body::Events { events };
            if send(&client, &subject, id, body, "events", &metrics).await {
                metrics.events_sent.inc_by(n);
            }
        }
    }
}

/// Publishes one message; whether it was handed to the connection.
async fn send(
    client: &Client,
    subject: &str,
    id: RouterId,
    body: Body,
    kind: &str,
    metrics: &SyncMetrics,
) -> bool {
    let bytes = encode(&Envelope {
        v: WIRE_VERSION,
        from: id.0,
        body,
    });
    let len = bytes.len() as u64;
    match client.publish(subject.to_owned(), Bytes::from(bytes)).await {
        Ok(()) => {
            metrics.messages_sent.with_label_values(&[kind]).inc();
            metrics.bytes_sent.inc_by(len);
            true
        }
        Err(e) => {
            tracing::debug!(error = %e, "sync publish failed");
            false
        }
    }
}

impl Receiver {
    fn now(&self) -> Timestamp {
        TimeScale::REAL.timestamp(self.epoch.elapsed())
    }

    fn count_peers(&self) {
        self.metrics.peers.set(self.peers.peers().count() as i64);
    }

    /// The receiver loop.
    async fn run(
        mut self,
        mut subs: Subscriptions,
        mut link_events: mpsc::UnboundedReceiver<Event>,
        link: watch::Sender<LinkState>,
        mut connected: bool,
    ) {
        let mut heartbeat = tokio::time::interval(self.config.heartbeat_interval);
        // Announces still due with the next heartbeats after a reconnection.
        let mut reannounce = 0;
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let check = (self.config.peer_timeout / 4).max(Duration::from_millis(10));
        let mut expiry = tokio::time::interval(check);
        expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let (replies_tx, mut replies) = mpsc::unbounded_channel::<async_nats::Message>();
        loop {
            tokio::select! {
                Some(m) = subs.joins.next() => self.answer_join(m, &replies_tx).await,
                Some(m) = subs.direct.next() => self.answer_join(m, &replies_tx).await,
                Some(m) = subs.events.next() => self.receive(m, &replies_tx),
                Some(m) = subs.heartbeats.next() => self.receive(m, &replies_tx),
                Some(m) = replies.recv() => self.receive(m, &replies_tx),
                _ = heartbeat.tick() => {
                    if connected {
                        send(&self.client, &self.config.subject("heartbeat"), self.id, Body::Heartbeat, "heartbeat", &self.metrics).await;
                        if reannounce > 0 {
                            reannounce -= 1;
                            self.announce().await;
                        }
                    }
                }
                _ = expiry.tick() => self.expire(),
                Some(event) = link_events.recv() => match event {
                    Event::Disconnected if connected => {
                        connected = false;
                        link.send_replace(LinkState::Disconnected);
                        self.metrics.connected.set(0);
                        tracing::warn!(url = self.config.url, "NATS connection lost; routing on this replica's own view until it returns");
                    }
                    Event::Connected if !connected => {
                        connected = true;
                        link.send_replace(LinkState::Connected);
                        self.metrics.connected.set(1);
                        tracing::info!(url = self.config.url, "NATS connection back; resyncing with the peers");
                        self.synced.clear();
                        reannounce = REANNOUNCES;
                        self.announce().await;
                        self.rejoin(&replies_tx);
                    }
                    _ => {}
                },
                else => break,
            }
        }
    }

    /// A message from the events or heartbeat subject (or a peer's snapshot reply).
    fn receive(&mut self, m: async_nats::Message, replies: &mpsc::UnboundedSender<async_nats::Message>) {
        let Some(envelope) = self.open(&m) else { return };
        let from = RouterId(envelope.from);
        match envelope.body {
            Body::Snapshot { events, part, .. } => self.apply_snapshot(from, part, &events),
            Body::Events { events } => {
                self.heard(from, replies);
                self.host.apply(from, &events);
            }
            Body::Heartbeat | Body::SnapshotRequest => self.heard(from, replies),
        }
        self.count_peers();
    }

    /// `peer` was heard from (anything but its snapshot). New here (or back after it was
    /// released), or not synced since this replica connected, it is asked for its snapshot:
    /// its bookings come from there.
    fn heard(&mut self, peer: RouterId, replies: &mpsc::UnboundedSender<async_nats::Message>) {
        let new = self.peers.heard(self.now(), peer);
        let unsynced = self.synced.insert(peer);
        if new || unsynced {
            self.ask_snapshot(peer, replies);
        }
    }

    /// Part `part` of `peer`'s snapshot: the first part replaces whatever was held of it.
    fn apply_snapshot(&mut self, peer: RouterId, part: u32, events: &[WireEvent]) {
        self.peers.heard(self.now(), peer);
        self.synced.insert(peer);
        if part == 0 {
            self.host.peer_lost(peer);
        }
        self.host.apply(peer, events);
    }

    /// Asks `peer` for its snapshot off this loop; the reply comes back through `replies`. A
    /// peer busy in its own (re)join answers only when that is over, and one just back may not
    /// have subscribed yet, so an unanswered request is made again, [`SNAPSHOT_ASKS`] times in
    /// all (the peer is known and synced from now on: nothing else asks until a reconnection).
    fn ask_snapshot(&self, peer: RouterId, replies: &mpsc::UnboundedSender<async_nats::Message>) {
        let client = self.client.clone();
        let subject = self.config.subject(&format!("join.{:016x}", peer.0));
        let request = self.request_bytes();
        let replies = replies.clone();
        let patience = self.config.join_timeout;
        tokio::spawn(async move {
            for _ in 0..SNAPSHOT_ASKS {
                match tokio::time::timeout(patience, client.request(subject.clone(), request.clone())).await {
                    Ok(Ok(reply)) => {
                        let _ = replies.send(reply);
                        return;
                    }
                    // No responders (not subscribed yet) or the connection failing: a pause.
                    Ok(Err(_)) => tokio::time::sleep(patience / 4).await,
                    // No answer in time: ask again at once.
                    Err(_) => {}
                }
            }
        });
    }

    fn request_bytes(&self) -> Bytes {
        Bytes::from(encode(&Envelope {
            v: WIRE_VERSION,
            from: self.id.0,
            body: Body::SnapshotRequest,
        }))
    }

    /// Decodes a peer's message; `None` for this replica's own, a status message, or garbage
    /// (counted).
    fn open(&self, m: &async_nats::Message) -> Option<Envelope> {
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
            Err(e) => {
                self.metrics.decode_errors.inc();
                tracing::debug!(error = %e, subject = %m.subject, "not a sync message");
                None
            }
        }
    }

    /// Answers a joining replica with this replica's snapshot, in parts.
    async fn answer_join(
        &mut self,
        m: async_nats::Message,
        replies: &mpsc::UnboundedSender<async_nats::Message>,
    ) {
        let Some(reply) = m.reply.clone() else { return };
        let Some(envelope) = self.open(&m) else { return };
        if !matches!(envelope.body, Body::SnapshotRequest) {
            return;
        }
        // The joiner is known from now on, and asked for its snapshot as any peer heard: a
        // starting replica's is empty, but one back from an outage has bookings, and the
        // snapshot it announced on reconnecting may have gone out before this replica had
        // subscribed again.
        self.heard(RouterId(envelope.from), replies);
        self.count_peers();
        for body in self.snapshot_bodies() {
            send(
                &self.client,
                reply.as_str(),
                self.id,
                body,
                "snapshot",
                &self.metrics,
            )
            .await;
        }
    }

    fn snapshot_bodies(&self) -> Vec<Body> {
        let peers: Vec<u64> = self.peers.peers().map(|p| p.0).collect();
        let mut parts = pack(
            self.host.snapshot(),
            self.config.batch_max_events.max(1024),
            self.config.batch_max_bytes,
        );
        if parts.is_empty() {
            parts.push(Vec::new());
        }
        let n = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(i, events)| Body::Snapshot {
                peers: peers.clone(),
                part: i as u32,
                last: i + 1 == n,
                events,
            })
            .collect()
    }

    /// After a reconnection: tells every peer this replica's state, which replaces theirs of it.
    async fn announce(&mut self) {
        let subject = self.config.subject("events");
        for body in self.snapshot_bodies() {
            send(&self.client, &subject, self.id, body, "snapshot", &self.metrics).await;
        }
    }

    /// After a reconnection: asks every replica for its snapshot off this loop, which goes on
    /// answering its peers meanwhile (replicas back at the same moment would each wait on the
    /// others' answers, and a rejoin holding the loop answered none of them in time). The
    /// answers come back through `replies`, for the join timeout, and are applied as they come.
    fn rejoin(&self, replies: &mpsc::UnboundedSender<async_nats::Message>) {
        self.metrics.resyncs.inc();
        let client = self.client.clone();
        let subject = self.config.subject("join");
        let request = self.request_bytes();
        let replies = replies.clone();
        let patience = self.config.join_timeout;
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let Some(mut answers) = ask_everyone(&client, subject, request, &metrics).await else {
                return;
            };
            let deadline = tokio::time::Instant::now() + patience;
            while let Ok(Some(m)) = tokio::time::timeout_at(deadline, answers.next()).await {
                if replies.send(m).is_err() {
                    break;
                }
            }
            let _ = answers.unsubscribe().await;
        });
    }

    /// At start, before serving: asks every replica for its snapshot and applies each, until
    /// every replica the answers name has answered, or the join timeout.
    async fn join(&mut self) {
        self.metrics.resyncs.inc();
        let subject = self.config.subject("join");
        let Some(mut replies) =
            ask_everyone(&self.client, subject, self.request_bytes(), &self.metrics).await
        else {
            return;
        };
        let deadline = tokio::time::Instant::now() + self.config.join_timeout;
        let (mut expected, mut done) = (BTreeSet::new(), BTreeSet::new());
        loop {
            let Ok(Some(m)) = tokio::time::timeout_at(deadline, replies.next()).await else {
                tracing::warn!(
                    answered = done.len(),
                    expected = expected.len(),
                    "join: not every peer answered in time"
                );
                break;
            };
            if m.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                break; // The first replica: nobody to ask.
            }
            let Some(envelope) = self.open(&m) else { continue };
            let Body::Snapshot {
                peers,
                part,
                last,
                events,
            } = envelope.body
            else {
                continue;
            };
            let from = RouterId(envelope.from);
            self.apply_snapshot(from, part, &events);
            expected.insert(from.0);
            expected.extend(peers.into_iter().filter(|&p| p != self.id.0));
            if last {
                done.insert(from.0);
            }
            if expected.is_subset(&done) {
                break;
            }
        }
        let _ = replies.unsubscribe().await;
        self.count_peers();
        tracing::info!(peers = done.len(), "joined the replicas' view");
    }

    /// Releases the bookings of peers silent past the timeout.
    fn expire(&mut self) {
        for peer in self.peers.expired(self.now()) {
            tracing::warn!(
                peer = format!("{:016x}", peer.0),
                "replica silent past the peer timeout; its bookings released"
            );
            self.host.peer_lost(peer);
            self.metrics.peers_lost.inc();
        }
        self.count_peers();
    }
}
