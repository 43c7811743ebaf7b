//! Driving the engines: a routed request sent to its engine, a pass's effects delivered to
//! the routers, and a disaggregated request's import into its decode engine.

use std::time::Duration;

use kvroute_core::ids::RequestId;
use kvroute_core::router::{Decision, Output, RouterError, WorkerRole};
use kvroute_core::time::Timestamp;
use kvroute_engine::{Finished, ImportAdmission, ImportStart, StartedImport, StepOutput};
use kvroute_planner::PassSample;

use crate::error::SimError;

use super::{Event, Life, Run, engine_request, kv_use};

impl Run<'_> {
    /// Sends a routed request to its engine.
    pub(super) fn start(&mut self, decision: Decision) -> Result<(), SimError> {
        let i = decision.request.0 as usize;
        let w = decision.worker.worker.0 as usize;
        let (prompt_tokens, output_tokens) = {
            let r = self.reqs.request(i)?;
            (r.prompt_tokens, r.output_tokens)
        };
        let state = &mut self.reqs[i];
        state.routed = Some(self.now);
        state.worker = Some(w as u32);
        state.overlap_blocks = decision.overlap_blocks;
        state.counted = true;
        self.workers[w].count_in_flight(self.now, 1);
        let state = &mut self.reqs[i];
        if let Some(p) = &mut self.planner {
            p.traffic
                .routed(&decision, prompt_tokens / self.config.engine.block_size);
        }
        // A prefill-only instance samples the first token; a request of at most one token is
        // then complete there.
        if let Some(p) = decision.prefill {
            state.prefill_worker = Some(p.worker.worker.0 as u32);
            state.in_prefill = output_tokens >= 2;
        }
        match self.config.noise.http {
            Some(http) => {
                self.reqs[i].in_transit = true;
                let at = self.http_arrival(i, 0, &http);
                self.push(at, Event::Deliver(i as u32));
                Ok(())
            }
            None => self.hand_to_engine(i),
        }
    }

    /// When message `k` of request `i` (see [`crate::HttpLatency::delay_of`]), sent now,
    /// arrives: not before its earlier messages.
    pub(super) fn http_arrival(&mut self, i: usize, k: u64, http: &crate::HttpLatency) -> Timestamp {
        let at = (self.now + http.delay_of(self.config.seed, i, k)).max(self.reqs[i].http_last);
        self.reqs[i].http_last = at;
        at
    }

    /// Routed request `i` reaches its engine (its prefill worker's, if it has one).
    pub(super) fn hand_to_engine(&mut self, i: usize) -> Result<(), SimError> {
        self.reqs[i].in_transit = false;
        let mut request = engine_request(RequestId(i as u64), self.reqs.request(i)?);
        let w = match self.reqs[i].prefill_worker {
            Some(p) => {
                request.output_len = request.output_len.min(1);
                p as usize
            }
            None => self.reqs[i].worker.expect("a routed request has a worker") as usize,
        };
        self.cut_stretch(w)?;
        self.reqs[i].queued_on = Some(w as u32);
        self.workers[w].queued_prefill_tokens += u64::from(self.reqs.request(i)?.prompt_tokens);
        let worker = &mut self.workers[w];
        if worker.host.add(self.now, request).is_err() {
            return self.reject_in_engine(i);
        }
        self.wake(w);
        Ok(())
    }

    /// Request `i` was refused by an engine: turned away, and cancelled at the router.
    pub(super) fn reject_in_engine(&mut self, i: usize) -> Result<(), SimError> {
        self.totals.rejected_by_engine += 1;
        self.unqueue(i)?;
        self.reqs[i].rejected = true;
        self.reqs[i].in_prefill = false;
        self.uncount(i);
        let r = self.reqs[i].replica as usize;
        let outputs = if self.up(r) {
            self.routers[r].handle_cancelled(self.now, RequestId(i as u64))?
        } else {
            Vec::new()
        };
        self.export_sync(r)?;
        self.done(i)?;
        self.route_outputs(outputs)
    }

    /// Request `i` no longer counts in its decode worker's in-flight requests.
    pub(super) fn uncount(&mut self, i: usize) {
        if std::mem::take(&mut self.reqs[i].counted)
            && let Some(w) = self.reqs[i].worker
        {
            self.workers[w as usize].count_in_flight(self.now, -1);
        }
    }

    /// Schedules a pass of engine `w` now unless one is pending.
    pub(super) fn wake(&mut self, w: usize) {
        if !self.workers[w].scheduled {
            self.workers[w].scheduled = true;
            let generation = self.workers[w].generation;
            self.push(self.now, Event::Step(w as u32, generation));
        }
    }

    /// Disaggregated request `i` finished its prefill: its decode engine admits the import
    /// ([`EngineHost::import`](kvroute_engine::EngineHost::import)): the transfer starts, or it waits for blocks behind earlier
    /// imports, or it is turned away if it can never fit.
    pub(super) fn begin_import(&mut self, i: usize) -> Result<(), SimError> {
        self.reqs[i].in_prefill = false;
        let w = self.reqs[i].worker.expect("a routed request has a worker") as usize;
        if self.workers[w].host.num_waiting_imports() == 0 {
            self.materialize(w)?;
        }
        let request = engine_request(RequestId(i as u64), self.reqs.request(i)?);
        match self.workers[w].host.import(self.now, request) {
            Ok(ImportAdmission::Started(import)) => self.import_started(w, import),
            Ok(ImportAdmission::Waiting) => {
                self.totals.kv_import_waits += 1;
                Ok(())
            }
            Err(_) => self.reject_in_engine(i),
        }
    }

    /// An import to engine `w` started: its KV lands after the transfer.
    pub(super) fn import_started(&mut self, w: usize, import: StartedImport) -> Result<(), SimError> {
        let bs = self.config.engine.block_size;
        let t = &mut self.totals;
        t.kv_transfers += 1;
        t.kv_transfer_blocks += u64::from(import.transfer_blocks);
        t.kv_transfer_hit_blocks += u64::from(import.hit_blocks);
        t.kv_transfer_bytes += self.config.transfer.bytes(import.transfer_blocks, bs);
        t.kv_transfer_nanos += import.transfer_time.as_nanos() as u64;
        self.publish(w, import.events)?;
        self.push(import.lands, Event::TransferDone(import.id.0 as u32));
        Ok(())
    }

    /// Starts the waiting imports of engine `w` that fit now, in order.
    pub(super) fn retry_imports(&mut self, w: usize) -> Result<(), SimError> {
        for start in self.workers[w].host.start_waiting_imports(self.now) {
            match start {
                ImportStart::Started(import) => {
                    let i = import.id.0 as usize;
                    self.import_started(w, import)?;
                    // The prefill's first token was the request's last event before the wait.
                    let since = self.reqs.tokens(i).last_token;
                    self.totals.kv_import_wait_nanos += self.now.saturating_since(since).as_nanos() as u64;
                }
                ImportStart::Refused(id, _) => self.reject_in_engine(id.0 as usize)?,
            }
        }
        Ok(())
    }

    /// Request `i`'s KV reached its decode engine.
    pub(super) fn transfer_done(&mut self, i: usize) -> Result<(), SimError> {
        let w = self.reqs[i].worker.expect("a transferred request has a worker") as usize;
        self.materialize(w)?;
        let events = self.workers[w]
            .host
            .land(self.now, RequestId(i as u64))
            .map_err(|e| SimError::Invariant(format!("completing the transfer of {i}: {e}")))?;
        self.totals.kv_transfers_done += 1;
        self.publish(w, events)?;
        self.wake(w);
        Ok(())
    }

    /// Engine `w`'s pass ended (or it was idle and got work): deliver, then start the next pass.
    pub(super) fn step(&mut self, w: usize) -> Result<(), SimError> {
        if let Some(start) = self.workers[w].stretch_start {
            if self.stretch_event(w, start)? {
                return Ok(());
            }
        } else if let Some(out) = self.workers[w].host.finish_pass() {
            self.deliver_step(w, out)?;
        }
        self.retry_imports(w)?;
        if self.fast_forward && self.begin_stretch(w) {
            return Ok(());
        }
        let worker = &mut self.workers[w];
        match worker.host.step(self.now) {
            Some(end) => {
                let generation = worker.generation;
                self.push(end, Event::Step(w as u32, generation));
            }
            None => worker.scheduled = false,
        }
        if self.workers[w].life == Life::Draining {
            self.try_retire(w)?;
        }
        Ok(())
    }

    /// A pass's effects, at its end.
    pub(super) fn deliver_step(&mut self, w: usize, out: StepOutput) -> Result<(), SimError> {
        let now = self.now;
        let m = out.metrics;
        let t = &mut self.totals;
        t.steps += 1;
        t.busy_nanos += out.end.as_nanos() - out.start.as_nanos();
        if self.workers[w].role == WorkerRole::Prefill {
            t.prefill_busy_nanos += out.end.as_nanos() - out.start.as_nanos();
        }
        t.preemptions += u64::from(m.preemptions);
        t.hit_tokens += m.prefix_cache_hit_tokens;
        t.query_tokens += m.prefix_cache_query_tokens;
        self.window_hits.0 += m.prefix_cache_hit_tokens;
        self.window_hits.1 += m.prefix_cache_query_tokens;
        self.workers[w].kv_use = kv_use((m.active_blocks, m.total_blocks));
        if self.planner.is_some() {
            self.workers[w].passes.push(PassSample {
                prefill_tokens: m.pass.prefill_tokens,
                decode_seqs: m.pass.decode_seqs,
                kv_tokens: u64::from(m.pass.kv_active_blocks) * u64::from(self.config.engine.block_size),
                duration_s: m.duration.as_secs_f64(),
            });
        }
        self.publish(w, out.events)?;
        for &(id, cached) in &out.prefix_hits {
            let s = &mut self.reqs[id.0 as usize];
            if s.admitted.is_none() {
                s.admitted = Some(out.start);
                s.cached_tokens = Some(cached);
            }
        }
        // The requests of a pass mostly had their last token at the same pass before: equal
        // gaps in a row go to the sketch at once (its state is the same).
        let mut gaps: Option<(Duration, u64)> = None;
        for e in &out.emitted {
            let s = self.reqs.tokens_mut(e.request.0 as usize);
            if s.emitted_first {
                let gap = now.saturating_since(s.last_token);
                match &mut gaps {
                    Some((d, k)) if *d == gap => *k += 1,
                    _ => {
                        if let Some((d, k)) = gaps.replace((gap, 1)) {
                            self.totals.itl.add_n(d, k);
                        }
                    }
                }
            }
            s.last_token = now;
            s.output_tokens += e.tokens;
        }
        if let Some((d, k)) = gaps {
            self.totals.itl.add_n(d, k);
        }
        for &id in &out.first_token {
            let i = id.0 as usize;
            self.reqs.tokens_mut(i).emitted_first = true;
            self.unqueue(i)?;
            match self.config.noise.http {
                Some(http) => {
                    let at = self.http_arrival(i, 1, &http);
                    self.push(at, Event::FirstTokenSeen(i as u32));
                }
                None => self.first_token_seen(i)?,
            }
        }
        self.deliver_finished(&out.finished)
    }

    /// Requests that finished in a pass, at its end, in scheduling order.
    pub(super) fn deliver_finished(&mut self, finished: &[Finished]) -> Result<(), SimError> {
        for f in finished {
            let i = f.request.0 as usize;
            if self.reqs[i].in_prefill {
                self.begin_import(i)?;
                continue;
            }
            match self.config.noise.http {
                Some(http) => {
                    self.reqs[i].in_transit = true;
                    let at = self.http_arrival(i, 2, &http);
                    self.push(at, Event::FinishSeen(i as u32));
                }
                None => self.finish_seen(i)?,
            }
        }
        Ok(())
    }

    /// Request `i`'s first token reaches its client and its router.
    pub(super) fn first_token_seen(&mut self, i: usize) -> Result<(), SimError> {
        let now = self.now;
        let id = RequestId(i as u64);
        self.reqs[i].first_token = Some(now);
        if let Some(arrived) = self.reqs[i].arrived
            && self.warm(self.reqs[i].worker)
            && let Some(p) = &mut self.planner
        {
            p.traffic
                .first_token(now.saturating_since(arrived).as_secs_f64() * 1e3);
        }
        let r = self.reqs[i].replica as usize;
        if !self.up(r) {
            // Its router is dead.
            return Ok(());
        }
        let result = self.routers[r].handle_first_token(now, id);
        self.export_sync(r)?;
        let outputs = self.lifecycle(result)?;
        self.route_outputs(outputs)
    }

    /// Request `i`'s completion reaches its client and its router.
    pub(super) fn finish_seen(&mut self, i: usize) -> Result<(), SimError> {
        let now = self.now;
        self.reqs[i].in_transit = false;
        self.reqs[i].finished = Some(now);
        self.totals.completed += 1;
        let warm = self.warm(self.reqs[i].worker);
        if let Some(p) = &mut self.planner {
            let s = &self.reqs[i];
            let decode_ms = s
                .first_token
                .filter(|_| warm)
                .map(|first| now.saturating_since(first).as_secs_f64() * 1e3);
            p.traffic.completed(self.reqs.tokens(i).output_tokens, decode_ms);
        }
        self.uncount(i);
        let r = self.reqs[i].replica as usize;
        if !self.up(r) {
            // Its router is dead.
            self.done(i)?;
            return Ok(());
        }
        let result = self.routers[r].handle_finished(now, RequestId(i as u64));
        self.export_sync(r)?;
        let outputs = self.lifecycle(result)?;
        self.done(i)?;
        self.route_outputs(outputs)?;
        if self.config.noise.http.is_some()
            && let Some(w) = self.reqs[i].worker
            && self.workers[w as usize].life == Life::Draining
        {
            self.try_retire(w as usize)?;
        }
        Ok(())
    }

    /// A lifecycle call's outputs; a request the router already dropped (TTL) is counted, not
    /// an error.
    pub(super) fn lifecycle(
        &mut self,
        result: Result<Vec<Output>, RouterError>,
    ) -> Result<Vec<Output>, SimError> {
        match result {
            Ok(outputs) => Ok(outputs),
            Err(RouterError::UnknownRequest(_)) => {
                self.totals.stale_lifecycle_events += 1;
                Ok(Vec::new())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Request `i` no longer waits for its first token on the worker computing its prompt.
    pub(super) fn unqueue(&mut self, i: usize) -> Result<(), SimError> {
        if let Some(w) = self.reqs[i].queued_on.take() {
            let tokens = u64::from(self.reqs.request(i)?.prompt_tokens);
            let q = &mut self.workers[w as usize].queued_prefill_tokens;
            *q = q.saturating_sub(tokens);
        }
        Ok(())
    }
}
