//! Router replicas: which replica an arrival goes to, and the sync channel between them.

use std::cmp::Reverse;

use kvroute_core::router::{RouterConfig, RouterError, RouterId, SyncEvent, SyncMode};
use kvroute_core::time::Timestamp;

use crate::config::{ReplicaSync, SimConfig, Spread};
use crate::error::SimError;

use super::Run;

/// A replica-sync event on its way: delivery time, exporting replica, export sequence.
#[derive(Debug)]
pub(super) struct InTransit {
    pub(super) key: (Timestamp, u32, u64),
    pub(super) event: SyncEvent,
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
    /// The replica the next arrival goes to.
    pub(super) fn pick_replica(&mut self) -> usize {
        let n = self.routers.len();
        if n == 1 {
            return 0;
        }
        match self.config.replicas.spread {
            Spread::RoundRobin => {
                let r = self.next_replica;
                self.next_replica = (r + 1) % n;
                r
            }
            Spread::Random => self.spread_rng.below(n),
        }
    }

    /// Puts replica `r`'s exported sync events on the channel, or loses them.
    pub(super) fn export_sync(&mut self, r: usize) {
        let ReplicaSync::On { delay, loss } = self.config.replicas.sync else {
            return;
        };
        while let Some(event) = self.routers[r].poll_sync_event() {
            self.totals.sync_events_published += 1;
            if loss > 0.0 && self.sync_rng.next_f64() < loss {
                self.totals.sync_events_lost += 1;
                continue;
            }
            let key = (self.now + delay, r as u32, self.sync_seq);
            self.sync_seq += 1;
            self.sync.push(Reverse(InTransit { key, event }));
        }
    }

    /// Delivers the next sync event to every replica but its sender (each ignores its own
    /// anyway), in replica order. A booking on a worker a replica no longer has is refused and
    /// counted.
    pub(super) fn deliver_sync(&mut self) -> Result<(), SimError> {
        let Some(Reverse(InTransit { key, event })) = self.sync.pop() else {
            return Ok(());
        };
        for r in 0..self.routers.len() {
            if r == key.1 as usize {
                continue;
            }
            match self.routers[r].handle_sync_event(self.now, &event) {
                Ok(outputs) => self.route_outputs(outputs)?,
                Err(RouterError::UnknownWorker(_)) => self.totals.sync_events_refused += 1,
                Err(e) => return Err(e.into()),
            }
            self.export_sync(r);
        }
        Ok(())
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
