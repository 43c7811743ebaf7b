//! The end-of-run invariants.

use kvroute_core::index::Tier;
use kvroute_core::router::CacheMode;

use crate::config::ReplicaSync;
use crate::error::SimError;

use super::{Life, ReplicaLife, Run};

impl Run<'_> {
    /// Checks the end-of-run invariants.
    pub(crate) fn check(&self) -> Result<(), SimError> {
        let fail = |what: String| Err(SimError::Invariant(what));
        let unfinished = self.tally.unfinished;
        if self.totals.arrived != self.totals.completed + self.rejected() + unfinished {
            return fail(format!(
                "arrived {} != completed {} + rejected {} + unfinished {unfinished}",
                self.totals.arrived,
                self.totals.completed,
                self.rejected()
            ));
        }
        if let Some(i) = self.tally.out_of_order {
            return fail(format!(
                "request {i}: arrival, routing, first token and finish out of order"
            ));
        }
        if let Some(i) = self.reqs.stray() {
            return fail(format!("request {i} was looked at outside the requests held"));
        }
        if unfinished == 0 && self.totals.kv_transfers != self.totals.kv_transfers_done {
            return fail(format!(
                "{} transfers started, {} completed",
                self.totals.kv_transfers, self.totals.kv_transfers_done
            ));
        }
        // Without lost sync messages (and none still on the way), every replica holds every
        // replica's bookings, so all must be gone; with losses, a replica keeps a peer's booking
        // whose Freed was lost (until a snapshot or the request TTL), so only its own must be
        // gone. A dead replica's bookings are gone from a peer once the peer has lost it (unless
        // the run ended first); the dead replica's own books are left as they were.
        let sync_exact = self.totals.sync_messages_lost == 0 && self.sync.is_empty();
        let dead: Vec<_> = (0..self.routers.len())
            .filter(|&r| self.replica_life[r] == ReplicaLife::Dead)
            .map(|r| self.routers[r].config().router_id)
            .collect();
        for (r, router) in self.routers.iter().enumerate() {
            if self.replica_life[r] == ReplicaLife::Dead {
                router.check_invariants().map_err(SimError::Invariant)?;
                continue;
            }
            if let Some(p) = self.protocols.get(r)
                && let Some(peer) = p
                    .peers()
                    .find(|peer| !dead.contains(peer) && !self.replica_known(*peer))
            {
                return fail(format!(
                    "router replica {r} hears a replica {} that never ran",
                    peer.0
                ));
            }
            let dead_heard = self
                .protocols
                .get(r)
                .is_some_and(|p| p.peers().any(|peer| dead.contains(&peer)));
            let metrics = router.metrics();
            if metrics.counters.clock_went_back > 0 {
                return fail(format!(
                    "router replica {r} saw time go back {} times",
                    metrics.counters.clock_went_back
                ));
            }
            if unfinished == 0 {
                let own = router.sync_snapshot().len();
                if own != 0 || metrics.queued_now != 0 {
                    return fail(format!(
                        "router replica {r}: own load not drained: {own} events of bookings, {} queued",
                        metrics.queued_now
                    ));
                }
                if (sync_exact && !dead_heard) || self.config.replicas.sync == ReplicaSync::Off {
                    if metrics.active_now != 0 {
                        return fail(format!(
                            "router replica {r}: load not drained: {} active",
                            metrics.active_now
                        ));
                    }
                    if let Some(w) = metrics.workers.iter().find(|w| !w.load.is_idle()) {
                        return fail(format!(
                            "router replica {r}: worker {} still has load booked: {:?}",
                            w.spec.key, w.load
                        ));
                    }
                }
            }
            router.check_invariants().map_err(SimError::Invariant)?;
        }
        for w in &self.workers {
            w.host
                .engine()
                .check_invariants()
                .map_err(|e| SimError::Invariant(format!("{}: {e}", w.key)))?;
            if w.life == Life::Removed {
                continue;
            }
            // An approximate view refuses KV events, so its index stays empty.
            let indexes_events = !matches!(self.config.router.cache, CacheMode::Approximate(_));
            if indexes_events && self.config.events.loss == 0.0 && self.channel.is_empty() {
                // The engine's count of cached blocks: its invariants (checked above) say it is
                // the number of blocks carrying a hash.
                let engine_blocks = w.host.engine().num_cached_blocks();
                for (r, router) in self.routers.iter().enumerate() {
                    // A dead replica stopped hearing KV events; a late one started hearing them
                    // late, with the engines' earlier blocks unknown to it.
                    let late = r + 1 == self.routers.len() && self.config.replicas.join_at.is_some();
                    if self.replica_life[r] != ReplicaLife::Up || late {
                        continue;
                    }
                    let index_blocks = router.index().block_count(w.key);
                    if engine_blocks != index_blocks {
                        return fail(format!(
                            "{}: engine caches {engine_blocks} blocks, router replica {r}'s index {index_blocks}",
                            w.key
                        ));
                    }
                    let (engine_cpu, index_cpu) = (
                        w.host.engine().cpu_blocks().len(),
                        router.index().tier_block_count(w.key, Tier::Cpu),
                    );
                    if engine_cpu != index_cpu {
                        return fail(format!(
                            "{}: engine's CPU tier holds {engine_cpu} blocks, router replica {r}'s index {index_cpu}",
                            w.key
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}
