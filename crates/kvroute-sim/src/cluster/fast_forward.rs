//! Fast-forward (see the module docs of [`super`]): skipping an engine's pure-decode passes
//! and applying them when their event comes or something touches the engine.
use kvroute_core::router::WorkerRole;
use kvroute_core::time::Timestamp;

use crate::error::SimError;

use super::{Event, Run, kv_use};

impl Run<'_> {
    /// Skips engine `w`'s next passes if they are pure decode (see the module docs): pushes
    /// the event of the last of them. False if there are fewer than two.
    pub(super) fn begin_stretch(&mut self, w: usize) -> bool {
        let now = self.now;
        let worker = &mut self.workers[w];
        if worker.host.num_waiting_imports() > 0 {
            return false;
        }
        let passes = worker.host.engine().decode_horizon();
        if passes < 2 {
            return false;
        }
        // The passes change no block, so the KV use they report is the current one; a value
        // not yet shown (blocks imported since the last pass) waits for a real pass.
        if kv_use(worker.host.engine().kv_blocks()).to_bits() != worker.kv_use.to_bits() {
            return false;
        }
        let ends = &mut worker.stretch_ends;
        ends.clear();
        worker.host.engine().decode_pass_ends(now, passes, ends);
        let (end, pushed) = (ends[ends.len() - 1], ends[ends.len() - 2]);
        worker.stretch_start = Some(now);
        let generation = worker.generation;
        self.push_from(end, pushed, Event::Step(w as u32, generation));
        true
    }

    /// Engine `w` is touched while the current event is handled: applies the skipped passes
    /// that end before it (their events' keys are smaller), starts the pass in flight as it was
    /// started, and replaces the stretch's event with that pass's.
    pub(super) fn materialize(&mut self, w: usize) -> Result<(), SimError> {
        let Some(start) = self.workers[w].stretch_start.take() else {
            return Ok(());
        };
        let current = self.current;
        let ends = &self.workers[w].stretch_ends;
        let (mut done, mut last) = (0, start);
        while done < ends.len() && (ends[done], last, 1, w as u64) < current {
            last = ends[done];
            done += 1;
        }
        if done == ends.len() {
            return Err(SimError::Invariant(format!(
                "worker {w}: a skipped pass ended before the event touching it"
            )));
        }
        let next_end = ends[done];
        self.apply_stretch(w, start, done);
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

    /// Applies the first `passes` skipped passes of engine `w`'s stretch from `start`: the
    /// engine's progress, and what delivering each would have done (one token per running
    /// request and pass; no block, event, first token or completion).
    pub(super) fn apply_stretch(&mut self, w: usize, start: Timestamp, passes: usize) {
        if passes == 0 {
            return;
        }
        let Self {
            workers,
            reqs,
            totals,
            ..
        } = self;
        let worker = &mut workers[w];
        let ends = &worker.stretch_ends[..passes];
        let end = ends[passes - 1];
        let last_start = if passes >= 2 { ends[passes - 2] } else { start };
        worker
            .host
            .engine_mut()
            .skip_decode_passes(passes as u32, last_start, end);
        debug_assert_eq!(worker.host.engine().check_invariants(), Ok(()));
        totals.steps += passes as u64;
        let busy = end.as_nanos() - start.as_nanos();
        totals.busy_nanos += busy;
        if worker.role == WorkerRole::Prefill {
            totals.prefill_busy_nanos += busy;
        }
        let mut with_first_token = 0;
        for id in worker.host.engine().running_requests() {
            let s = &mut reqs[id.0 as usize];
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
    }
}
