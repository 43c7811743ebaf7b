//! Router replicas: which replica an arrival goes to, when a replica starts and dies, and the
//! simulated bus over which they run the replica-sync protocol
//! ([`ReplicaProtocol`], the one the live NATS transport runs).

use std::cmp::Reverse;

use kvroute_core::router::replica::{Action, Batcher, Message, ProtocolConfig, ReplicaProtocol, To};
use kvroute_core::router::{RouterConfig, RouterError, RouterId, SyncEvent, SyncMode};
use kvroute_core::time::Timestamp;

use crate::config::{ReplicaSync, SimConfig, Spread};
use crate::error::SimError;

use super::Run;

/// Where a replica is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReplicaLife {
    /// Not started yet ([`crate::Replicas::join_at`]).
    Waiting,
    /// Routing, and (with sync) speaking the protocol.
    Up,
    /// Dead ([`crate::Replicas::fail_at`]).
    Dead,
}

/// A protocol message on the bus: delivery time, sending replica, send sequence.
#[derive(Debug)]
pub(super) struct InTransit {
    pub(super) key: (Timestamp, u32, u64),
    pub(super) to: To,
    pub(super) message: Message<SyncEvent>,
}

impl PartialEq for InTransit {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for InTransit {}

impl PartialOrd for InTransit {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for InTransit {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}

impl Run<'_> {
    /// Whether replica `r` is up.
    pub(super) fn up(&self, r: usize) -> bool {
        self.replica_life[r] == ReplicaLife::Up
    }

    /// The replica the next arrival goes to (an up one).
    pub(super) fn pick_replica(&mut self) -> usize {
        let n = self.routers.len();
        if n == 1 {
            return 0;
        }
        match self.config.replicas.spread {
            Spread::RoundRobin => {
                for _ in 0..n {
                    let r = self.next_replica;
                    self.next_replica = (r + 1) % n;
                    if self.up(r) {
                        return r;
                    }
                }
                0
            }
            Spread::Random => {
                let up: Vec<usize> = (0..n).filter(|&r| self.up(r)).collect();
                up[self.spread_rng.below(up.len())]
            }
        }
    }

    /// Replica `r` starts: with sync, it joins its peers.
    pub(super) fn replica_join(&mut self, r: usize) -> Result<(), SimError> {
        self.replica_life[r] = ReplicaLife::Up;
        if let Some(p) = self.protocols.get_mut(r) {
            let actions = p.start(self.now);
            self.carry_out(r, actions)?;
        }
        Ok(())
    }

    /// Replica `r` dies: it routes nothing and says nothing from now on.
    pub(super) fn replica_fail(&mut self, r: usize) {
        self.replica_life[r] = ReplicaLife::Dead;
        while self.routers[r].poll_sync_event().is_some() {}
        if let Some(b) = self.batchers.get_mut(r) {
            b.take_all();
        }
    }

    /// Replica `r`'s router id.
    fn router_id(&self, r: usize) -> RouterId {
        RouterId(self.config.router.router_id.0.wrapping_add(r as u64))
    }

    /// Whether `id` is one of the run's replicas.
    pub(super) fn replica_known(&self, id: RouterId) -> bool {
        self.replica_of(id).is_some()
    }

    /// The replica of router id `id`, if any.
    fn replica_of(&self, id: RouterId) -> Option<usize> {
        let r = id.0.wrapping_sub(self.config.router.router_id.0);
        (r < self.routers.len() as u64).then_some(r as usize)
    }

    /// Queues replica `r`'s exported changes for its batch (dropped if it is not up), and
    /// publishes the batch if it is due.
    pub(super) fn export_sync(&mut self, r: usize) -> Result<(), SimError> {
        if self.protocols.is_empty() {
            return Ok(());
        }
        let up = self.up(r);
        while let Some(event) = self.routers[r].poll_sync_event() {
            if up {
                let urgency = event.change.urgency();
                self.batchers[r].push(self.now, event, urgency);
            }
        }
        self.publish_due(r)
    }

    /// Publishes replica `r`'s waiting changes as one batch, if due.
    fn publish_due(&mut self, r: usize) -> Result<(), SimError> {
        let Some(batch) = self.batchers[r].take_due(self.now) else {
            return Ok(());
        };
        self.totals.sync_events_published += batch.len() as u64;
        if let Some(message) = self.protocols[r].publish(self.now, batch) {
            self.send(r, To::Everyone, message)?;
        }
        Ok(())
    }

    /// Puts `message` from replica `r` on the bus, or loses it. A request nobody up can hear is
    /// answered at once with "nobody listening", as NATS's "no responders".
    fn send(&mut self, r: usize, to: To, message: Message<SyncEvent>) -> Result<(), SimError> {
        let ReplicaSync::On { delay, loss } = self.config.replicas.sync else {
            return Ok(());
        };
        let heard = match to {
            To::Everyone => (0..self.routers.len()).any(|p| p != r && self.up(p)),
            To::Peer(id) => self.replica_of(id).is_some_and(|p| self.up(p)),
        };
        if !heard {
            if matches!(message, Message::SnapshotRequest) {
                let actions = self.protocols[r].handle_nobody_listening(self.now);
                self.carry_out(r, actions)?;
            }
            return Ok(());
        }
        if loss > 0.0 && self.sync_rng.next_f64() < loss {
            self.totals.sync_messages_lost += 1;
            if let Message::Events { events, .. } = &message {
                self.totals.sync_events_lost += events.len() as u64;
            }
            return Ok(());
        }
        let key = (self.now + delay, r as u32, self.sync_seq);
        self.sync_seq += 1;
        self.sync.push(Reverse(InTransit { key, to, message }));
        Ok(())
    }

    /// Delivers the next message on the bus to its receivers that are up, in replica order.
    pub(super) fn deliver_sync(&mut self) -> Result<(), SimError> {
        let Some(Reverse(InTransit { key, to, message })) = self.sync.pop() else {
            return Ok(());
        };
        let sender = key.1 as usize;
        let from = self.router_id(sender);
        let receivers: Vec<usize> = match to {
            To::Everyone => (0..self.routers.len()).filter(|&r| r != sender).collect(),
            To::Peer(id) => self.replica_of(id).into_iter().collect(),
        };
        for r in receivers {
            if !self.up(r) {
                continue;
            }
            let actions = self.protocols[r].handle(self.now, from, message.clone());
            self.carry_out(r, actions)?;
        }
        Ok(())
    }

    /// Replica `r`'s protocol timeouts and batch due now.
    pub(super) fn protocol_timeout(&mut self, r: usize) -> Result<(), SimError> {
        self.publish_due(r)?;
        if self.protocols[r].poll_timeout().is_some_and(|t| t <= self.now) {
            let actions = self.protocols[r].handle_timeout(self.now);
            self.carry_out(r, actions)?;
        }
        Ok(())
    }

    /// Carries out replica `r`'s protocol actions, in order.
    fn carry_out(&mut self, r: usize, actions: Vec<Action<SyncEvent>>) -> Result<(), SimError> {
        for action in actions {
            match action {
                Action::Send { to, message } => self.send(r, to, message)?,
                Action::SendSnapshot { to } => {
                    // What waits goes first: a snapshot never runs ahead of the batches.
                    let waiting = self.batchers[r].take_all();
                    if !waiting.is_empty() {
                        self.totals.sync_events_published += waiting.len() as u64;
                        if let Some(message) = self.protocols[r].publish(self.now, waiting) {
                            self.send(r, To::Everyone, message)?;
                        }
                    }
                    let mut state = self.routers[r].sync_snapshot();
                    state.extend(self.routers[r].session_snapshot());
                    for message in self.protocols[r].snapshot_messages(vec![state]) {
                        self.send(r, to, message)?;
                    }
                }
                Action::Apply { events, .. } => {
                    for event in &events {
                        match self.routers[r].handle_sync_event(self.now, event) {
                            Ok(outputs) => self.route_outputs(outputs)?,
                            Err(RouterError::UnknownWorker(_)) => self.totals.sync_events_refused += 1,
                            Err(e) => return Err(e.into()),
                        }
                    }
                    self.export_sync(r)?;
                }
                Action::Release { peer, .. } => {
                    let outputs = self.routers[r].handle_peer_lost(self.now, peer);
                    self.route_outputs(outputs)?;
                    self.export_sync(r)?;
                }
            }
        }
        Ok(())
    }

    /// The earliest protocol timeout among the replicas that are up, and whose.
    pub(super) fn next_protocol_timeout(&self) -> Option<(Timestamp, usize)> {
        self.protocols
            .iter()
            .enumerate()
            .filter(|&(r, _)| self.up(r))
            .filter_map(|(r, p)| {
                let due = [p.poll_timeout(), self.batchers[r].poll_timeout()];
                due.into_iter().flatten().min().map(|t| (t.max(self.now), r))
            })
            .min()
    }

    /// The earliest batch due among the replicas that are up, and whose.
    pub(super) fn next_batch_due(&self) -> Option<(Timestamp, usize)> {
        self.batchers
            .iter()
            .enumerate()
            .filter(|&(r, _)| self.up(r))
            .filter_map(|(r, b)| b.poll_timeout().map(|t| (t.max(self.now), r)))
            .min()
    }
}

/// Replica `r`'s router configuration: the base one with router id `router_id + r`, seed
/// `seed + r`, replica rank `replica_rank + r`, and export on when replicas sync.
pub(super) fn replica_config(config: &SimConfig, r: usize) -> RouterConfig {
    let base = &config.router;
    let mut c = base.clone();
    c.router_id = RouterId(base.router_id.0.wrapping_add(r as u64));
    c.seed = base.seed.wrapping_add(r as u64);
    c.replica_rank = base.replica_rank.wrapping_add(r as u32);
    if config.replicas.sync != ReplicaSync::Off {
        c.sync.mode = SyncMode::Export;
    }
    c
}

/// The replicas' batchers: one per replica with sync on, none without.
pub(super) fn replica_batchers(config: &SimConfig) -> Vec<Batcher<SyncEvent>> {
    if config.replicas.sync == ReplicaSync::Off {
        return Vec::new();
    }
    (0..config.replicas.count)
        .map(|_| Batcher::new(config.replicas.batching))
        .collect()
}

/// The replicas' protocols: one per replica with sync on, none without.
pub(super) fn replica_protocols(config: &SimConfig) -> Vec<ReplicaProtocol> {
    if config.replicas.sync == ReplicaSync::Off {
        return Vec::new();
    }
    (0..config.replicas.count)
        .map(|r| {
            let id = RouterId(config.router.router_id.0.wrapping_add(r as u64));
            ReplicaProtocol::new(id, ProtocolConfig::default())
        })
        .collect()
}
