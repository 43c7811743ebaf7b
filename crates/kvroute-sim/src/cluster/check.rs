//! The end-of-run invariants.

use kvroute_core::router::CacheMode;

use crate::config::ReplicaSync;
use crate::error::SimError;
use crate::report::Outcome;

use super::{Life, Run};

impl Run<'_> {
    /// Checks the end-of-run invariants.
    pub(crate) fn check(&self) -> Result<(), SimError> {
        let fail = |what: String| Err(SimError::Invariant(what));
        let unfinished = self
            .reqs
            .iter()
            .filter(|r| r.arrived.is_some() && r.outcome() == Outcome::Unfinished)
            .count() as u64;
        if self.totals.arrived != self.totals.completed + self.rejected() + unfinished {
            return fail(format!(
                "arrived {} != completed {} + rejected {} + unfinished {unfinished}",
                self.totals.arrived,
                self.totals.completed,
                self.rejected()
            ));
        }
        for (i, r) in self.reqs.iter().enumerate() {
            let (Some(arrived), Some(finished)) = (r.arrived, r.finished) else {
                continue;
            };
            let first = r.first_token.unwrap_or(arrived);
            if !(arrived <= first
                && first <= finished
                && r.routed.is_some_and(|t| arrived <= t && t <= first))
            {
                return fail(format!(
                    "request {i}: arrival, routing, first token and finish out of order"
                ));
            }
        }
        if unfinished == 0 && self.totals.kv_transfers != self.totals.kv_transfers_done {
            return fail(format!(
                "{} transfers started, {} completed",
                self.totals.kv_transfers, self.totals.kv_transfers_done
            ));
        }
        // Without lost sync events (and none still on the way), every replica holds every
        // replica's bookings, so all must be gone; with losses, a replica keeps a peer's booking
        // whose Freed was lost (until the request TTL), so only its own must be gone.
        let sync_exact = self.totals.sync_events_lost == 0 && self.sync.is_empty();
        for (r, router) in self.routers.iter().enumerate() {
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
                if sync_exact || self.config.replicas.sync == ReplicaSync::Off {
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
                    let index_blocks = router.index().block_count(w.key);
                    if engine_blocks != index_blocks {
                        return fail(format!(
                            "{}: engine caches {engine_blocks} blocks, router replica {r}'s index {index_blocks}",
                            w.key
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}
