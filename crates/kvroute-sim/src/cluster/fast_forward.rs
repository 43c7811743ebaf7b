//! Fast-forward (see the module docs of [`super`]): skipping an engine's decode-only passes
//! and applying them when their event comes or something touches the engine.
use kvroute_core::router::WorkerRole;
use kvroute_core::time::Timestamp;
use kvroute_engine::StretchEnd;

use crate::config::Topology;
use crate::error::SimError;

use super::{Event, Run, kv_use};

impl Run<'_> {
    /// Skips engine `w`'s next passes if they only decode (see the module docs): pushes the
    /// event of the first of them that allocates or completes a block, or of the last. False
    /// if there are fewer than two.
    pub(super) fn begin_stretch(&mut self, w: usize) -> bool {
        let now = self.now;
        let worker = &mut self.workers[w];
        if worker.host.num_waiting_imports() > 0 {
            return false;
        }
        let passes = worker.host.engine().plan_decode_stretch(&mut worker.stretch);
        if passes < 2 {
            return false;
        }
        // The KV use the passes report starts from the current one; a value not yet shown
        // (blocks imported since the last pass) waits for a real pass.
        if kv_use(worker.host.engine().kv_blocks()).to_bits() != worker.kv_use.to_bits() {
            return false;
        }
        let ends = &mut worker.stretch_ends;
        ends.clear();
        worker
            .host
            .engine()
            .decode_stretch_ends(now, &worker.stretch, ends);
        worker.stretch_start = Some(now);
        self.push_stretch_event(w, now);
        true
    }

    /// Pushes the event of engine `w`'s stretch (from `start`): its next pass that grows a
    /// request, or its last, keyed as that pass's step would be.
    fn push_stretch_event(&mut self, w: usize, start: Timestamp) {
        let worker = &self.workers[w];
        let ends = &worker.stretch_ends;
        let p = worker
            .stretch
            .next_grow()
            .map_or(ends.len(), |p| (p as usize).min(ends.len()));
        let pushed = if p >= 2 { ends[p - 2] } else { start };
        let generation = worker.generation;
        self.push_from(ends[p - 1], pushed, Event::Step(w as u32, generation));
    }

    /// Engine `w`'s stretch (from `start`) reached its event: a pass that grows a request
    /// before the last, whose KV events are published now; or the last, which ends the
    /// stretch. True in the first case.
    pub(super) fn stretch_event(&mut self, w: usize, start: Timestamp) -> Result<bool, SimError> {
        let worker = &mut self.workers[w];
        let passes = worker.stretch_ends.len();
        let Some(p) = worker.stretch.next_grow().filter(|&p| (p as usize) < passes) else {
            worker.stretch_start = None;
            let end = self.apply_stretch(w, start, passes);
            self.publish(w, end.events)?;
            self.deliver_finished(&end.finished)?;
            return Ok(false);
        };
        let events = worker
            .host
            .engine_mut()
            .run_decode_stretch(&mut worker.stretch, p);
        worker.kv_use = kv_use(worker.host.engine().kv_blocks());
        self.publish(w, events)?;
        self.push_stretch_event(w, start);
        Ok(true)
    }

    /// A request is sent to engine `w` while the current event is handled: a stretch of it
    /// ends with the pass in flight (the request waits for the next pass, as behind a step), and
    /// its event is that pass's, unless a grow before it comes first. In a disaggregated fleet
    /// an import may touch the engine later in that pass, and [`Self::materialize`] then starts
    /// the pass in flight as a step, which must not take the request: there the stretch is
    /// materialized now, as for any touch.
    pub(super) fn cut_stretch(&mut self, w: usize) -> Result<(), SimError> {
        let Some(start) = self.workers[w].stretch_start else {
            return Ok(());
        };
        if matches!(self.config.topology, Topology::Disaggregated { .. }) {
            return self.materialize(w);
        }
        let (done, _) = self.passes_ended(w, start);
        let worker = &mut self.workers[w];
        if done == worker.stretch_ends.len() {
            return Err(SimError::Invariant(format!(
                "worker {w}: a skipped pass ended before the request sent to it"
            )));
        }
        if done + 1 < worker.stretch_ends.len() {
            worker.stretch.truncate(done as u32 + 1);
            worker.stretch_ends.truncate(done + 1);
            worker.generation += 1;
            self.push_stretch_event(w, start);
        }
        Ok(())
    }

    /// Engine `w` is touched while the current event is handled: applies the skipped passes
    /// that end before it (their events' keys are smaller), starts the pass in flight as it was
    /// started, and replaces the stretch's event with that pass's.
    pub(super) fn materialize(&mut self, w: usize) -> Result<(), SimError> {
        let Some(start) = self.workers[w].stretch_start.take() else {
            return Ok(());
        };
        let (done, last) = self.passes_ended(w, start);
        let ends = &self.workers[w].stretch_ends;
        if done == ends.len() {
            return Err(SimError::Invariant(format!(
                "worker {w}: a skipped pass ended before the event touching it"
            )));
        }
        let next_end = ends[done];
        // The grows of the passes applied were run at their own events, before this one, and
        // only a stretch's last pass finishes requests.
        let end = self.apply_stretch(w, start, done);
        if !end.events.is_empty() || !end.finished.is_empty() {
            return Err(SimError::Invariant(format!(
                "worker {w}: a skipped pass's KV events or finished requests were not delivered when it ended"
            )));
        }
        let worker = &mut self.workers[w];
        worker
            .host
            .step(last)
            .filter(|&end| end == next_end)
            .ok_or_else(|| SimError::Invariant(format!("worker {w}: a skipped pass changed")))?;
        worker.generation += 1;
        let generation = worker.generation;
        self.push_from(next_end, last, Event::Step(w as u32, generation));
        Ok(())
    }

    /// The passes of engine `w`'s stretch (from `start`) whose step events come before the
    /// event being handled, and when the last of them ended (`start` if none).
    fn passes_ended(&self, w: usize, start: Timestamp) -> (usize, Timestamp) {
        let ends = &self.workers[w].stretch_ends;
        let (mut done, mut last) = (0, start);
        while done < ends.len() && (ends[done], last, 1, w as u64) < self.current {
            last = ends[done];
            done += 1;
        }
        (done, last)
    }

    /// Requests engine `w` runs as a step-by-step run would show them now: inside a stretch's
    /// last pass, without those it finishes (a step retires them when the pass starts).
    pub(super) fn running_now(&self, w: usize) -> usize {
        let worker = &self.workers[w];
        let running = worker.host.engine().num_running();
        match worker.stretch_start {
            Some(start) if self.passes_ended(w, start).0 + 1 >= worker.stretch_ends.len() => {
                running - worker.stretch.finishing() as usize
            }
            _ => running,
        }
    }

    /// Applies the first `passes` skipped passes of engine `w`'s stretch from `start`: the
    /// engine's progress, and what delivering each would have done (one token per running
    /// request and pass; no first token). Returns the KV events of its grows not yet run, to
    /// publish now, and the requests the last pass finished, to deliver after them.
    pub(super) fn apply_stretch(&mut self, w: usize, start: Timestamp, passes: usize) -> StretchEnd {
        let Self {
            workers,
            reqs,
            totals,
            ..
        } = self;
        let worker = &mut workers[w];
        if passes == 0 {
            return worker
                .host
                .engine_mut()
                .finish_decode_stretch(&mut worker.stretch, 0, start, start);
        }
        let ends = &worker.stretch_ends[..passes];
        let end = ends[passes - 1];
        let last_start = if passes >= 2 { ends[passes - 2] } else { start };
        let stretch_end = worker.host.engine_mut().finish_decode_stretch(
            &mut worker.stretch,
            passes as u32,
            last_start,
            end,
        );
        debug_assert_eq!(worker.host.engine().check_invariants(), Ok(()));
        worker.kv_use = kv_use(worker.host.engine().kv_blocks());
        totals.steps += passes as u64;
        let busy = end.as_nanos() - start.as_nanos();
        totals.busy_nanos += busy;
        if worker.role == WorkerRole::Prefill {
            totals.prefill_busy_nanos += busy;
        }
        let mut with_first_token = 0;
        let finished = stretch_end.finished.iter().map(|f| &f.request);
        for id in worker.host.engine().running_requests().iter().chain(finished) {
            let s = reqs.tokens_mut(id.0 as usize);
            if s.emitted_first {
                totals.itl.add(ends[0].saturating_since(s.last_token));
                with_first_token += 1;
            }
            s.last_token = end;
            s.output_tokens += passes as u32;
        }
        // The gaps between the passes, for every request with its first token.
        let gaps = ends.windows(2).map(|p| p[1].0.saturating_sub(p[0].0));
        totals.itl.add_nanos_each(gaps, with_first_token);
        stretch_end
    }
}
