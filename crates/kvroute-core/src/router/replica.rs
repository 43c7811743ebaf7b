//! The replica-sync protocol, sans-IO: what one router replica says to its peers and what it
//! does with what they say. A transport (the live NATS edge, the simulator's bus) hands it
//! messages, link changes and the time, and carries out the [`Action`]s it returns; it decides
//! nothing itself, so the simulator runs the protocol that serves.
//!
//! # Messages
//!
//! Every replica broadcasts ([`To::Everyone`]) its load changes as numbered batches
//! ([`Message::Events`]), cut by a [`Batcher`], and a [`Message::Heartbeat`] carrying the number
//! of its last batch after every [`ProtocolConfig::heartbeat_interval`] in which it broadcast
//! nothing else (a batch counts as a heartbeat: it names the sender and its number). A replica asks
//! for snapshots with [`Message::SnapshotRequest`], to everyone when it (re)joins and to one
//! peer ([`To::Peer`]) otherwise; the answer is a [`Message::Snapshot`] in parts, addressed to the
//! asker.
//!
//! # Rules
//!
//! * **Join.** [`ReplicaProtocol::start`] asks everyone. The join is over once every replica an
//!   answer names has sent its last part, when the transport reports that nobody listens
//!   ([`ReplicaProtocol::handle_nobody_listening`], the first replica), or after
//!   [`ProtocolConfig::join_timeout`]. Meanwhile the replica answers its peers as usual; a peer
//!   it hears is asked for its snapshot when the join is over, unless its answer came.
//! * **A peer heard** for the first time, again after it was lost, or for the first time since
//!   this replica's link came back, is asked for its snapshot: its bookings come from there. An
//!   unanswered ask is repeated every quarter of the join timeout, [`ProtocolConfig::snapshot_asks`]
//!   times in all.
//! * **Snapshots.** Part 0 replaces whatever was held of the sender's bookings
//!   ([`Release::Replaced`]); later parts add to it, in order. A snapshot carries the number of the
//!   sender's last batch before it: batches up to that number are in it.
//! * **Duplicates and old messages.** A batch numbered at or below the last one applied from its
//!   sender (or covered by a snapshot) is dropped; so is a snapshot older than the batches
//!   already applied, and a part that does not follow the part before it.
//! * **Gaps.** A batch, or a heartbeat, numbered past the next one expected shows lost batches:
//!   the sender is asked for its snapshot.
//! * **Batching.** A change that raises a peer's view of load (a booking: [`Urgency::Urgent`])
//!   leaves within [`BatchConfig::window`]; one that only lowers it (prefill done, freed:
//!   [`Urgency::Lazy`]) within [`BatchConfig::lazy_window`], or sooner with the next urgent
//!   batch. Every change queued goes out in each batch, in order.
//! * **Heartbeats** are skipped while batches flow: the next is due an interval after the last
//!   batch or heartbeat (not while the replica re-announces its snapshot), so a connected
//!   replica is never silent for longer than the interval.
//! * **Peer loss.** A peer silent past [`ProtocolConfig::peer_timeout`] ([`PeerTracker`]) has its
//!   bookings released ([`Release::Silent`]) and is forgotten.
//! * **Link down and back.** While the link is down nothing is sent (a batch handed over is
//!   dropped: [`ReplicaProtocol::publish`] returns `None`). When it returns, the replica announces
//!   its snapshot to everyone, again with its next [`ProtocolConfig::reannounces`] heartbeats (for
//!   peers back a moment later), asks everyone for theirs, and asks again any peer it hears
//!   before that peer's snapshot came.
//!
//! Every input is applied in full before the next, and the actions come out in a fixed order:
//! same inputs, same actions.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::sync::{PeerTracker, RouterId};
use crate::time::Timestamp;

/// The protocol's timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProtocolConfig {
    /// How often this replica heartbeats. Default 1 s.
    pub heartbeat_interval: Duration,
    /// How long a peer may stay silent before its bookings are released. Default 3 s.
    pub peer_timeout: Duration,
    /// How long a join waits for its peers' snapshots. Default 2 s.
    pub join_timeout: Duration,
    /// How many times a peer is asked for its snapshot before the asking stops (its timeout
    /// then releases whatever was booked for it). Default 3.
    pub snapshot_asks: u32,
    /// How many heartbeats after the link came back also carry this replica's snapshot.
    /// Default 3.
    pub reannounces: u32,
}

impl Default for ProtocolConfig {
    fn default() -> Self {
        Self {
            heartbeat_interval: Duration::from_millis(1000),
            peer_timeout: Duration::from_millis(3000),
            join_timeout: Duration::from_millis(2000),
            snapshot_asks: 3,
            reannounces: 3,
        }
    }
}

/// How soon a change must reach the peers ([`Batcher`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Urgency {
    /// It raises a peer's view of load (a booking) or changes what a peer may route to (a
    /// session, the registry): within [`BatchConfig::window`].
    Urgent,
    /// It only lowers a peer's view of load (prefill done, freed): a peer that hears it late
    /// routes around load that is gone, never onto load it does not know. Within
    /// [`BatchConfig::lazy_window`], or with the next urgent batch.
    Lazy,
}

/// How a replica's changes are cut into batches ([`Batcher`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// How long an urgent change may wait for others. Default 2 ms.
    pub window: Duration,
    /// How long a lazy change may wait for others (an urgent one takes it along sooner).
    /// Default 100 ms; equal to `window`, every change is urgent.
    pub lazy_window: Duration,
    /// The most changes in one batch: a full batch is due at once. Default 256.
    pub max_events: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_millis(2),
            lazy_window: Duration::from_millis(100),
            max_events: 256,
        }
    }
}

/// A replica's changes waiting to be published, and when they are due: the earliest of each
/// change's deadline (its arrival plus its [`Urgency`]'s window), or at once when
/// [`BatchConfig::max_events`] are waiting. Sans-IO: the driver pushes changes, asks
/// [`Batcher::poll_timeout`] and takes the batch with [`Batcher::take_due`], then hands it to
/// [`ReplicaProtocol::publish`].
#[derive(Clone, Debug)]
pub struct Batcher<E> {
    config: BatchConfig,
    events: Vec<E>,
    due: Option<Timestamp>,
}

impl<E> Batcher<E> {
    /// An empty batcher.
    pub fn new(config: BatchConfig) -> Self {
        Self {
            config,
            events: Vec::new(),
            due: None,
        }
    }

    /// Its settings.
    pub fn config(&self) -> BatchConfig {
        self.config
    }

    /// Queues `event`, a change of `urgency` made at `now`.
    pub fn push(&mut self, now: Timestamp, event: E, urgency: Urgency) {
        let wait = match urgency {
            Urgency::Urgent => self.config.window,
            Urgency::Lazy => self.config.lazy_window,
        };
        let mut at = now + wait;
        self.events.push(event);
        if self.events.len() >= self.config.max_events.max(1) {
            at = now;
        }
        self.due = Some(self.due.map_or(at, |d| d.min(at)));
    }

    /// When the waiting changes are due, if any wait.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        self.due
    }

    /// Every waiting change, in order, if they are due at `now`.
    pub fn take_due(&mut self, now: Timestamp) -> Option<Vec<E>> {
        if self.due.is_some_and(|d| d <= now) {
            Some(self.take_all())
        } else {
            None
        }
    }

    /// Every waiting change, in order, due or not (before a snapshot, which must not run ahead
    /// of the batches).
    pub fn take_all(&mut self) -> Vec<E> {
        self.due = None;
        std::mem::take(&mut self.events)
    }

    /// How many changes wait.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

/// Where a message goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum To {
    /// Every replica (the sender's own copy, if it comes back, is ignored).
    Everyone,
    /// One peer.
    Peer(RouterId),
}

/// A batch number: a replica numbers its batches 1, 2, … (0: none sent yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BatchSeq(pub u64);

/// One message between replicas, carrying load changes of type `E` (the router's
/// [`super::SyncEvent`] in the simulator, a wire form live).
#[derive(Clone, Debug, PartialEq)]
pub enum Message<E> {
    /// A batch of the sender's changes, in the order it made them.
    Events {
        /// The batch's number.
        seq: BatchSeq,
        /// The changes.
        events: Vec<E>,
    },
    /// The sender is alive; `last` is the number of its last batch.
    Heartbeat {
        /// Its last batch.
        last: BatchSeq,
    },
    /// Asks for the receiver's snapshot.
    SnapshotRequest,
    /// A part of the sender's snapshot.
    Snapshot(SnapshotPart<E>),
}

/// One part of a replica's snapshot: its registry and in-flight bookings.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotPart<E> {
    /// Every replica the sender hears (itself excluded), so a joiner knows whose answers to wait
    /// for.
    pub peers: Vec<RouterId>,
    /// The sender's last batch before the snapshot: batches up to it are in it.
    pub last: BatchSeq,
    /// The part's number, from 0.
    pub part: u32,
    /// Whether it is the last part.
    pub is_last: bool,
    /// The changes that rebuild the sender's state.
    pub events: Vec<E>,
}

/// Why a peer's bookings are released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// It was silent past the peer timeout: it is gone.
    Silent,
    /// Its snapshot follows and replaces them.
    Replaced,
}

/// What the transport does, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Action<E> {
    /// Send `message` to `to`.
    Send {
        /// Where.
        to: To,
        /// What.
        message: Message<E>,
    },
    /// Send this replica's snapshot to `to`: take the host's state, cut it into parts and send
    /// [`ReplicaProtocol::snapshot_messages`] of them.
    SendSnapshot {
        /// Where.
        to: To,
    },
    /// Apply peer `from`'s changes, in order.
    Apply {
        /// The peer.
        from: RouterId,
        /// Its changes.
        events: Vec<E>,
    },
    /// Release every booking of `peer`.
    Release {
        /// The peer.
        peer: RouterId,
        /// Why.
        cause: Release,
    },
}

/// Whether the replica is connected to its peers.
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

/// What the protocol counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProtocolCounters {
    /// Batches, snapshots or parts dropped as duplicates or older than what was applied.
    pub stale_dropped: u64,
    /// Gaps in a peer's batch numbers (lost batches), each answered by a snapshot ask.
    pub gaps: u64,
    /// Snapshot requests sent (to everyone or to one peer).
    pub snapshot_asks: u64,
    /// Snapshots answered or announced.
    pub snapshots_sent: u64,
    /// Peers lost to silence.
    pub peers_lost: u64,
    /// Joins and rejoins.
    pub resyncs: u64,
    /// Joins that ended at the join timeout with answers missing.
    pub joins_incomplete: u64,
}

/// Where a join stands.
#[derive(Clone, Debug)]
enum Join {
    /// Waiting for answers until `deadline`.
    Waiting {
        deadline: Timestamp,
        /// Replicas named by the answers so far.
        expected: BTreeSet<RouterId>,
        /// Replicas whose last part came.
        done: BTreeSet<RouterId>,
        /// Peers heard meanwhile: asked at the end unless their answer came.
        heard: BTreeSet<RouterId>,
    },
    /// Over (or never started).
    Over,
}

/// What this replica knows of one peer's message stream.
#[derive(Clone, Copy, Debug, Default)]
struct Stream {
    /// The last batch applied (or covered by a snapshot, or named by a heartbeat); `None`
    /// before anything was heard.
    last: Option<BatchSeq>,
    /// The snapshot being received: its `last` and the next part expected.
    receiving: Option<(BatchSeq, u32)>,
}

/// An unanswered snapshot ask.
#[derive(Clone, Copy, Debug)]
struct Ask {
    /// When to ask again.
    again_at: Timestamp,
    /// Asks left after the next.
    left: u32,
}

/// One replica's side of the protocol. See the module docs.
#[derive(Clone, Debug)]
pub struct ReplicaProtocol {
    id: RouterId,
    config: ProtocolConfig,
    link: LinkState,
    peers: PeerTracker,
    /// Peers whose snapshot came (or was asked for) since the link last came back.
    synced: BTreeSet<RouterId>,
    streams: BTreeMap<RouterId, Stream>,
    asks: BTreeMap<RouterId, Ask>,
    join: Join,
    next_heartbeat: Option<Timestamp>,
    reannounce: u32,
    sent: BatchSeq,
    counters: ProtocolCounters,
}

impl ReplicaProtocol {
    /// Replica `id`'s protocol, not started, link down.
    pub fn new(id: RouterId, config: ProtocolConfig) -> Self {
        Self {
            id,
            config,
            link: LinkState::Disconnected,
            peers: PeerTracker::new(config.peer_timeout),
            synced: BTreeSet::new(),
            streams: BTreeMap::new(),
            asks: BTreeMap::new(),
            join: Join::Over,
            next_heartbeat: None,
            reannounce: 0,
            sent: BatchSeq(0),
            counters: ProtocolCounters::default(),
        }
    }

    /// This replica's id.
    pub fn id(&self) -> RouterId {
        self.id
    }

    /// The link as last reported.
    pub fn link(&self) -> LinkState {
        self.link
    }

    /// Whether the join is over (the host may serve with its peers' load).
    pub fn is_joined(&self) -> bool {
        matches!(self.join, Join::Over)
    }

    /// The peers heard and not lost, in [`RouterId`] order.
    pub fn peers(&self) -> impl Iterator<Item = RouterId> + '_ {
        self.peers.peers()
    }

    /// What it counted.
    pub fn counters(&self) -> ProtocolCounters {
        self.counters
    }

    /// The link is up for the first time: join (ask everyone for their snapshot) and start
    /// heartbeating.
    pub fn start<E>(&mut self, now: Timestamp) -> Vec<Action<E>> {
        self.link = LinkState::Connected;
        self.next_heartbeat = Some(now + self.config.heartbeat_interval);
        self.counters.resyncs += 1;
        self.counters.snapshot_asks += 1;
        self.join = Join::Waiting {
            deadline: now + self.config.join_timeout,
            expected: BTreeSet::new(),
            done: BTreeSet::new(),
            heard: BTreeSet::new(),
        };
        vec![Action::Send {
            to: To::Everyone,
            message: Message::SnapshotRequest,
        }]
    }

    /// The link changed. Back up: announce this replica's snapshot, ask everyone for theirs,
    /// and treat every peer as not synced. Down: send nothing until it is back.
    pub fn handle_link<E>(&mut self, now: Timestamp, link: LinkState) -> Vec<Action<E>> {
        if link == self.link {
            return Vec::new();
        }
        self.link = link;
        match link {
            LinkState::Disconnected => Vec::new(),
            LinkState::Connected if self.next_heartbeat.is_none() => self.start(now),
            LinkState::Connected => {
                self.synced.clear();
                self.asks.clear();
                self.reannounce = self.config.reannounces;
                self.counters.resyncs += 1;
                self.counters.snapshot_asks += 1;
                self.counters.snapshots_sent += 1;
                vec![
                    Action::SendSnapshot { to: To::Everyone },
                    Action::Send {
                        to: To::Everyone,
                        message: Message::SnapshotRequest,
                    },
                ]
            }
        }
    }

    /// The transport learned that nobody listens to a request this replica sent (NATS's "no
    /// responders"): a join with no answer yet is over, since there is nobody to wait for.
    pub fn handle_nobody_listening<E>(&mut self, now: Timestamp) -> Vec<Action<E>> {
        let mut out = Vec::new();
        if let Join::Waiting { expected, .. } = &self.join
            && expected.is_empty()
        {
            self.end_join(now, &mut out);
        }
        out
    }

    /// Ends the join: peers heard meanwhile whose answer did not come are asked now.
    fn end_join<E>(&mut self, now: Timestamp, out: &mut Vec<Action<E>>) {
        if let Join::Waiting { done, heard, .. } = std::mem::replace(&mut self.join, Join::Over) {
            for peer in heard.difference(&done) {
                self.ask(now, *peer, out);
            }
        }
    }

    /// This replica's own batch of changes at `now`, numbered for its peers: the message to send
    /// to [`To::Everyone`], or `None` if the link is down (the batch is lost; peers resync when
    /// it returns). An empty batch is no message. The batch stands for a heartbeat: the next is
    /// due an interval from now (unless the snapshot is being re-announced on heartbeats).
    pub fn publish<E>(&mut self, now: Timestamp, events: Vec<E>) -> Option<Message<E>> {
        if self.link == LinkState::Disconnected || events.is_empty() {
            return None;
        }
        if self.reannounce == 0 && self.next_heartbeat.is_some() {
            self.next_heartbeat = Some(now + self.config.heartbeat_interval);
        }
        self.sent.0 += 1;
        Some(Message::Events {
            seq: self.sent,
            events,
        })
    }

    /// The messages that carry this replica's snapshot, cut by the transport into `parts` (an
    /// empty state is one empty part).
    pub fn snapshot_messages<E>(&self, parts: Vec<Vec<E>>) -> Vec<Message<E>> {
        let peers: Vec<RouterId> = self.peers.peers().collect();
        let mut parts = parts;
        if parts.is_empty() {
            parts.push(Vec::new());
        }
        let n = parts.len();
        parts
            .into_iter()
            .enumerate()
            .map(|(i, events)| {
                Message::Snapshot(SnapshotPart {
                    peers: peers.clone(),
                    last: self.sent,
                    part: i as u32,
                    is_last: i + 1 == n,
                    events,
                })
            })
            .collect()
    }

    /// A message from `from`. This replica's own messages are ignored.
    pub fn handle<E>(&mut self, now: Timestamp, from: RouterId, message: Message<E>) -> Vec<Action<E>> {
        let mut out = Vec::new();
        if from == self.id {
            return out;
        }
        match message {
            Message::Events { seq, events } => {
                self.heard(now, from, &mut out);
                let stream = self.streams.entry(from).or_default();
                if stream.last.is_some_and(|last| seq <= last) {
                    self.counters.stale_dropped += 1;
                    return out;
                }
                let gap = stream.last.is_some_and(|last| seq.0 > last.0 + 1);
                stream.last = Some(seq);
                out.push(Action::Apply { from, events });
                if gap {
                    self.counters.gaps += 1;
                    self.ask(now, from, &mut out);
                }
            }
            Message::Heartbeat { last } => {
                self.heard(now, from, &mut out);
                let stream = self.streams.entry(from).or_default();
                match stream.last {
                    Some(applied) if last > applied => {
                        stream.last = Some(last);
                        self.counters.gaps += 1;
                        self.ask(now, from, &mut out);
                    }
                    Some(_) => {}
                    None => stream.last = Some(last),
                }
            }
            Message::SnapshotRequest => {
                // The asker is known from now on, and asked for its snapshot as any peer heard:
                // a starting replica's is empty, but one back from an outage has bookings.
                self.heard(now, from, &mut out);
                if self.link == LinkState::Connected {
                    self.counters.snapshots_sent += 1;
                    out.push(Action::SendSnapshot { to: To::Peer(from) });
                }
            }
            Message::Snapshot(part) => self.snapshot_part(now, from, part, &mut out),
        }
        out
    }

    /// When [`ReplicaProtocol::handle_timeout`] has something to do next, if ever.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        let lost = self.peers.next_deadline().map(|t| t + Duration::from_nanos(1));
        let join = match &self.join {
            Join::Waiting { deadline, .. } => Some(*deadline),
            Join::Over => None,
        };
        let heartbeat = self.next_heartbeat.filter(|_| self.link == LinkState::Connected);
        let ask = self.asks.values().map(|a| a.again_at).min();
        [lost, join, heartbeat, ask].into_iter().flatten().min()
    }

    /// Does what is due at `now`: heartbeats (with a re-announcement while due), the end of a
    /// join, repeated asks, and the release of peers silent past the timeout.
    pub fn handle_timeout<E>(&mut self, now: Timestamp) -> Vec<Action<E>> {
        let mut out = Vec::new();
        if let Join::Waiting { deadline, .. } = &self.join
            && *deadline <= now
        {
            self.counters.joins_incomplete += 1;
            self.end_join(now, &mut out);
        }
        if let Some(at) = self.next_heartbeat
            && at <= now
        {
            // Skipped beats are not made up for.
            let mut next = at + self.config.heartbeat_interval;
            while next <= now {
                next = next + self.config.heartbeat_interval;
            }
            self.next_heartbeat = Some(next);
            if self.link == LinkState::Connected {
                out.push(Action::Send {
                    to: To::Everyone,
                    message: Message::Heartbeat { last: self.sent },
                });
                if self.reannounce > 0 {
                    self.reannounce -= 1;
                    self.counters.snapshots_sent += 1;
                    out.push(Action::SendSnapshot { to: To::Everyone });
                }
            }
        }
        let due: Vec<RouterId> = self
            .asks
            .iter()
            .filter(|(_, a)| a.again_at <= now)
            .map(|(&p, _)| p)
            .collect();
        for peer in due {
            let left = self.asks[&peer].left;
            if left == 0 || self.link == LinkState::Disconnected {
                self.asks.remove(&peer);
                continue;
            }
            self.asks.insert(
                peer,
                Ask {
                    again_at: now + self.ask_patience(),
                    left: left - 1,
                },
            );
            self.counters.snapshot_asks += 1;
            out.push(Action::Send {
                to: To::Peer(peer),
                message: Message::SnapshotRequest,
            });
        }
        for peer in self.peers.expired(now) {
            self.counters.peers_lost += 1;
            self.streams.remove(&peer);
            self.asks.remove(&peer);
            out.push(Action::Release {
                peer,
                cause: Release::Silent,
            });
        }
        out
    }

    /// How long an ask waits for its answer before it is made again.
    fn ask_patience(&self) -> Duration {
        (self.config.join_timeout / 4).max(Duration::from_millis(1))
    }

    /// `peer` was heard from (anything but its snapshot). New here, back after it was lost, or
    /// not synced since the link came back, it is asked for its snapshot; during a join, at its
    /// end, unless its answer to the join came.
    fn heard<E>(&mut self, now: Timestamp, peer: RouterId, out: &mut Vec<Action<E>>) {
        let new = self.peers.heard(now, peer);
        let unsynced = self.synced.insert(peer);
        if new || unsynced {
            match &mut self.join {
                Join::Waiting { heard, .. } => {
                    heard.insert(peer);
                }
                Join::Over => self.ask(now, peer, out),
            }
        }
    }

    /// Asks `peer` for its snapshot, unless an ask is already out.
    fn ask<E>(&mut self, now: Timestamp, peer: RouterId, out: &mut Vec<Action<E>>) {
        if self.link == LinkState::Disconnected || self.asks.contains_key(&peer) {
            return;
        }
        self.asks.insert(
            peer,
            Ask {
                again_at: now + self.ask_patience(),
                left: self.config.snapshot_asks.saturating_sub(1),
            },
        );
        self.counters.snapshot_asks += 1;
        out.push(Action::Send {
            to: To::Peer(peer),
            message: Message::SnapshotRequest,
        });
    }

    fn snapshot_part<E>(
        &mut self,
        now: Timestamp,
        from: RouterId,
        part: SnapshotPart<E>,
        out: &mut Vec<Action<E>>,
    ) {
        self.peers.heard(now, from);
        self.synced.insert(from);
        let stream = self.streams.entry(from).or_default();
        let fresh = if part.part == 0 {
            // A snapshot older than the batches already applied would undo them.
            stream.last.is_none_or(|applied| part.last >= applied)
        } else {
            stream.receiving == Some((part.last, part.part))
        };
        if fresh {
            stream.last = Some(part.last);
            stream.receiving = (!part.is_last).then_some((part.last, part.part + 1));
            if part.part == 0 {
                out.push(Action::Release {
                    peer: from,
                    cause: Release::Replaced,
                });
            }
            out.push(Action::Apply {
                from,
                events: part.events,
            });
            if part.is_last {
                self.asks.remove(&from);
            }
        } else {
            self.counters.stale_dropped += 1;
        }
        if let Join::Waiting { expected, done, .. } = &mut self.join {
            expected.insert(from);
            expected.extend(part.peers.iter().copied().filter(|&p| p != self.id));
            if part.is_last {
                done.insert(from);
            }
            if expected.is_subset(done) {
                self.end_join(now, out);
            }
        }
    }
}
