//! The KV-event channel: engines' events to every replica's index, with lag and seeded loss.

use kvroute_core::events::KvEvent;
use kvroute_core::index::IndexEvent;
use kvroute_core::router::RouterError;

use crate::error::SimError;

use super::{Life, ReplicaLife, Run};

impl Run<'_> {
    /// Puts a pass's KV events on the channel (or applies them at once without lag), dropping
    /// each with the configured probability.
    ///
    /// Without lag, a run of removals (an engine evicts one block per event, as vLLM does) goes
    /// to the index as one event: nothing can observe the index between them, the state after is
    /// the same, and a batch lets the index overlap its cache misses.
    pub(super) fn publish(&mut self, w: usize, events: Vec<KvEvent>) -> Result<(), SimError> {
        let channel = self.config.events;
        for event in events {
            self.totals.kv_events_published += 1;
            if channel.loss > 0.0 && self.rng.next_f64() < channel.loss {
                self.totals.kv_events_lost += 1;
                continue;
            }
            if !channel.lag.is_zero() {
                self.channel.push_back((self.now + channel.lag, w as u32, event));
            } else if let KvEvent::Removed(removed) = &event {
                self.removed_batch.extend_from_slice(&removed.block_hashes);
            } else {
                self.flush_removed(w)?;
                self.apply_kv(w, event.as_index_event())?;
            }
        }
        self.flush_removed(w)
    }

    /// Applies the removals gathered by [`Self::publish`], if any.
    pub(super) fn flush_removed(&mut self, w: usize) -> Result<(), SimError> {
        if self.removed_batch.is_empty() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.removed_batch);
        let result = self.apply_kv(w, IndexEvent::Removed { blocks: &batch });
        self.removed_batch = batch;
        self.removed_batch.clear();
        result
    }

    pub(super) fn deliver_kv(&mut self) -> Result<(), SimError> {
        if let Some((_, w, event)) = self.channel.pop_front() {
            self.apply_kv(w as usize, event.as_index_event())?;
        }
        Ok(())
    }

    /// Applies one KV event to every replica's index. Refusals (an event whose parent was lost)
    /// are counted, per replica: they are what a lossy channel does. A router whose cache view
    /// is approximate refuses every KV event, as the live proxy's does: the engines publish
    /// them, and nothing of the router's view changes.
    pub(super) fn apply_kv(&mut self, w: usize, event: IndexEvent<'_>) -> Result<(), SimError> {
        if self.workers[w].life == Life::Removed {
            if let Some(p) = &mut self.planner {
                p.late_kv_events += 1;
            }
            return Ok(());
        }
        let key = self.workers[w].key;
        for (router, life) in self.routers.iter_mut().zip(&self.replica_life) {
            // A replica not started, or dead, hears no KV events.
            if *life != ReplicaLife::Up {
                continue;
            }
            match router.handle_kv_event(self.now, key, event) {
                Ok(()) => {}
                Err(RouterError::Index(_)) => self.totals.kv_events_refused += 1,
                Err(RouterError::KvEventsDisabled) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
