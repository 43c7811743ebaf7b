//! The planner in the loop: its ticks, and the workers it adds and drains.

use std::time::Duration;

use kvroute_core::router::WorkerRole;
use kvroute_planner::{Action, Observation, Observe, Pool, WorkerObservation, WorkerPhase, books};

use crate::error::SimError;

use super::{Event, Life, Run, SimWorker};

impl Run<'_> {
    /// Whether worker `w` (if any) is past the planner's warm-up, so its latencies are observed.
    pub(super) fn warm(&self, w: Option<u32>) -> bool {
        let (Some(p), Some(w)) = (&self.planner, w) else {
            return true;
        };
        self.workers[w as usize].ready_at.is_some_and(|at| {
            p.planner
                .config()
                .warm(self.now.saturating_since(at).as_secs_f64())
        })
    }

    /// The planner's tick: observe, decide, act; then schedule the next while work remains.
    pub(super) fn planner_tick(&mut self) -> Result<(), SimError> {
        let now = self.now;
        let Some(p) = &mut self.planner else {
            return Ok(());
        };
        let mut traffic = std::mem::take(&mut p.traffic);
        traffic.duration_s = now.saturating_since(p.last_tick).as_secs_f64();
        p.last_tick = now;
        let bs = u64::from(self.config.engine.block_size);
        let view = p.observe;
        let router = self.routers.first();
        let workers = self
            .workers
            .iter_mut()
            .enumerate()
            .filter(|(_, w)| w.life != Life::Removed)
            .map(|(i, w)| {
                let state = match w.life {
                    Life::Starting => WorkerPhase::Starting,
                    Life::Draining | Life::Removed => WorkerPhase::Draining,
                    Life::Ready => WorkerPhase::Ready,
                };
                let passes = std::mem::take(&mut w.passes);
                match (view, router) {
                    (Observe::Router, Some(router)) => {
                        p.reader.observe(router, now, i as u64, w.pool(), state, &[w.key])
                    }
                    _ => WorkerObservation {
                        id: i as u64,
                        pool: w.pool(),
                        state,
                        passes,
                        queued_prefill_tokens: w.queued_prefill_tokens,
                        decode_seqs: w.host.engine().num_running() as u32,
                        kv_tokens: u64::from(w.host.engine().kv_blocks().0) * bs,
                        in_flight: w.in_flight,
                        sole_blocks: router.map_or(0, |r| books::sole_blocks(r, [w.key])),
                    },
                }
            })
            .collect();
        p.reader.end_tick(now);
        let queued_requests = self.routers.first().map_or(0, |r| r.queued_now() as u64);
        let obs = Observation {
            traffic,
            workers,
            queued_requests,
        };
        let out = p.planner.tick(now, &obs);
        if let Some(kept) = &mut p.observations {
            kept.push((now, obs));
        }
        p.ticks.push(out.record);
        if let Some(decision) = out.decision {
            let actions = decision.actions.clone();
            p.decisions.push(decision);
            for action in actions {
                match action {
                    Action::Add { pool } => self.add_worker(pool)?,
                    Action::Remove { worker, .. } => self.drain_worker(worker as usize)?,
                }
            }
        }
        if self.more_work()
            && let Some(p) = &self.planner
        {
            let at = p.planner.next_tick();
            self.push(at, Event::PlannerTick);
        }
        Ok(())
    }

    /// Provisions a worker of `pool`: its engine exists now, the router learns of it after the
    /// startup delay.
    pub(super) fn add_worker(&mut self, pool: Pool) -> Result<(), SimError> {
        let role = match pool {
            Pool::Agg => WorkerRole::Aggregated,
            Pool::Prefill => WorkerRole::Prefill,
            Pool::Decode => WorkerRole::Decode,
        };
        let i = self.workers.len();
        let mut worker = SimWorker::new(self.config, i, role, self.now)?;
        worker.life = Life::Starting;
        worker.ready_at = None;
        self.workers.push(worker);
        if let Some(series) = &mut self.series {
            let n = series.time_s.len();
            series.worker_requests.push(vec![0; n]);
            series.worker_kv_use.push(vec![0.0; n]);
        }
        let delay = self.planner.as_ref().map_or(Duration::ZERO, |p| p.startup);
        self.push(self.now + delay, Event::WorkerReady(i as u32));
        Ok(())
    }

    /// Worker `w` finished starting: the router may route to it.
    pub(super) fn worker_ready(&mut self, w: usize) -> Result<(), SimError> {
        let spec = self.workers[w].spec(self.config);
        self.workers[w].life = Life::Ready;
        self.workers[w].ready_at = Some(self.now);
        for r in 0..self.routers.len() {
            let outputs = self.routers[r].handle_worker_added(self.now, spec)?;
            self.route_outputs(outputs)?;
            self.export_sync(r)?;
        }
        Ok(())
    }

    /// Worker `w` takes no new requests and leaves when idle.
    pub(super) fn drain_worker(&mut self, w: usize) -> Result<(), SimError> {
        if self.workers.get(w).is_none_or(|x| x.life != Life::Ready) {
            return Err(SimError::Invariant(format!(
                "the planner removed worker {w}, which is not ready"
            )));
        }
        for router in &mut self.routers {
            router.handle_worker_draining(self.now, self.workers[w].key)?;
        }
        self.workers[w].life = Life::Draining;
        self.workers[w].draining_at = Some(self.now);
        self.try_retire(w)
    }

    /// Removes draining worker `w` from the router if nothing runs or is headed there.
    pub(super) fn try_retire(&mut self, w: usize) -> Result<(), SimError> {
        let worker = &self.workers[w];
        if !worker.host.is_idle() || worker.stretch_start.is_some() {
            return Ok(());
        }
        // A disaggregated request still prefilling elsewhere will import here.
        if worker.role == WorkerRole::Decode
            && self
                .reqs
                .iter()
                .any(|r| r.in_prefill && r.worker == Some(w as u32) && !r.rejected)
        {
            return Ok(());
        }
        // With HTTP latency: a request on its way to it, or a finish on its way from it.
        if self.config.noise.http.is_some()
            && self
                .reqs
                .iter()
                .any(|r| r.in_transit && (r.worker == Some(w as u32) || r.prefill_worker == Some(w as u32)))
        {
            return Ok(());
        }
        self.workers[w].life = Life::Removed;
        self.workers[w].removed_at = Some(self.now);
        for r in 0..self.routers.len() {
            let outputs = self.routers[r].handle_worker_removed(self.now, self.workers[w].key)?;
            self.route_outputs(outputs)?;
            self.export_sync(r)?;
        }
        Ok(())
    }
}
