//! The engine task of one rank: an [`EngineHost`] driven in real time.
//!
//! Take requests as they arrive ([`EngineHost::add`], or [`EngineHost::import`] for the decode
//! side of a pair, at the arrival time); when the engine has work, run one pass, sleep until it
//! ends (taking new requests meanwhile), then deliver its tokens, first tokens and completions
//! and publish its events. Between passes, transfers due land and waiting imports start. The
//! host owns every rule (import admission, the order of KV events); this task owns the clock,
//! through [`TimeScale`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_core::events::KvEvent;
use kvroute_core::ids::RequestId;
use kvroute_core::time::{TimeScale, Timestamp};
use kvroute_engine::{
    EngineHost, EnginePrompt, EngineRequest, FinishReason, ImportAdmission, ImportStart, KvReportMode,
    StartedImport, StepOutput, synthetic_output_token,
};
use kvroute_wire::WireEvent;
use kvroute_zmq::EventPublisher;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::metrics::Stats;

/// What the engine task tells a request's handler.
#[derive(Debug)]
pub(crate) enum JobUpdate {
    /// The request was admitted, with this many prompt tokens found cached.
    Cached(u32),
    /// Output tokens.
    Tokens(Vec<u32>),
    /// It finished, with the output tokens of its last pass (not sent as `Tokens` before:
    /// vLLM's stream carries the finish reason in the chunk of the last tokens).
    Done {
        completion_tokens: u32,
        reason: FinishReason,
        last: Vec<u32>,
    },
    /// The engine refused it.
    Refused(String),
}

/// A request for a rank's engine.
pub(crate) struct Job {
    pub(crate) prompt: Vec<u32>,
    pub(crate) output_len: u32,
    pub(crate) cache_salt: Option<String>,
    /// The LoRA adapter it runs under.
    pub(crate) lora_name: Option<String>,
    /// Its KV comes from a prefill worker ([`EngineHost::import`]).
    pub(crate) import: bool,
    /// What the engine's KV events report of its prefix-cache hits (`vllm_xargs`).
    pub(crate) kv_report: KvReportMode,
    pub(crate) tx: mpsc::UnboundedSender<JobUpdate>,
}

/// Where a rank's engine publishes its KV events, under its rank.
pub(crate) struct Outbox {
    pub(crate) publisher: Option<Arc<EventPublisher>>,
    pub(crate) rank: u32,
    /// A copy of every batch published (tests).
    pub(crate) tap: Option<mpsc::UnboundedSender<Vec<KvEvent>>>,
}

/// The timer's resolution: the driver runs ahead of the wall clock by up to this much.
const TICK: Duration = Duration::from_millis(1);
/// How far behind the wall clock the driver may run before its engine's time slips.
const CATCH_UP: Duration = Duration::from_millis(20);

/// A request in the engine: its handler's channel and the tokens sent so far.
struct Live {
    tx: mpsc::UnboundedSender<JobUpdate>,
    outputs: u32,
}

/// The engine task's state.
struct Driver {
    epoch: Instant,
    scale: TimeScale,
    host: EngineHost,
    live: HashMap<RequestId, Live>,
    /// Imports waiting in the host, by request.
    waiting: HashMap<RequestId, Job>,
    next_id: u64,
    stats: Arc<Mutex<Stats>>,
    out: Outbox,
}

impl Driver {
    fn now(&self) -> Timestamp {
        self.scale.timestamp(self.epoch.elapsed())
    }

    fn at(&self, t: Timestamp) -> Instant {
        self.epoch + self.scale.elapsed(t)
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn request(id: RequestId, job: &Job) -> EngineRequest {
        EngineRequest {
            id,
            prompt: EnginePrompt::Tokens(job.prompt.clone()),
            output_len: job.output_len,
            lora_name: job.lora_name.clone(),
            cache_namespace: job.cache_salt.clone(),
            kv_report: job.kv_report,
        }
    }

    /// Takes a request at `now`: a local one joins the engine's queue; an import is admitted by
    /// the host's rule (started, waiting, or refused).
    fn add(&mut self, job: Job) {
        let now = self.now();
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let request = Self::request(id, &job);
        if !job.import {
            match self.host.add(now, request) {
                Ok(()) => self.go_live(id, job.tx),
                Err(e) => {
                    let _ = job.tx.send(JobUpdate::Refused(e.to_string()));
                }
            }
            return;
        }
        match self.host.import(now, request) {
            Ok(ImportAdmission::Started(import)) => self.started(import, job),
            Ok(ImportAdmission::Waiting) => {
                self.stats().import_waits += 1;
                self.waiting.insert(id, job);
            }
            Err(e) => {
                let _ = job.tx.send(JobUpdate::Refused(e.to_string()));
            }
        }
    }

    fn go_live(&mut self, id: RequestId, tx: mpsc::UnboundedSender<JobUpdate>) {
        self.live.insert(id, Live { tx, outputs: 0 });
    }

    /// An import started: its cached tokens are known, its KV is on the link.
    fn started(&mut self, import: StartedImport, job: Job) {
        let bs = self.host.engine().config().block_size;
        let cached = (import.hit_blocks * bs).min(job.prompt.len() as u32);
        let _ = job.tx.send(JobUpdate::Cached(cached));
        self.go_live(import.id, job.tx);
        self.publish(&import.events);
        let mut s = self.stats();
        s.import_hit_blocks += u64::from(import.hit_blocks);
        s.import_transfer_blocks += u64::from(import.transfer_blocks);
    }

    /// Between passes: the transfers due by `until` land (the token the prefill worker sampled
    /// is the request's first), then waiting imports start if their blocks are free.
    fn between_passes(&mut self, until: Timestamp) {
        while let Some((t, id)) = self.host.next_landing().filter(|&(t, _)| t <= until) {
            match self.host.land(t, id) {
                Ok(events) => self.publish(&events),
                Err(e) => {
                    // The transfer is consumed; a client still waiting on it hears why.
                    tracing::warn!(error = %e, "completing an import failed");
                    if let Some(l) = self.live.remove(&id) {
                        let _ = l.tx.send(JobUpdate::Refused(e.to_string()));
                    }
                    continue;
                }
            }
            self.stats().imports += 1;
            if let Some(l) = self.live.get_mut(&id) {
                l.outputs = 1;
                let _ = l.tx.send(JobUpdate::Tokens(vec![synthetic_output_token(id, 0)]));
            }
        }
        for start in self.host.start_waiting_imports(self.now()) {
            match start {
                ImportStart::Started(import) => {
                    if let Some(job) = self.waiting.remove(&import.id) {
                        self.started(import, job);
                    }
                }
                ImportStart::Refused(id, e) => {
                    if let Some(job) = self.waiting.remove(&id) {
                        let _ = job.tx.send(JobUpdate::Refused(e.to_string()));
                    }
                }
            }
        }
    }

    /// Aborts the requests whose handler is gone (its client disconnected), as vLLM aborts a
    /// request whose client left: they leave the engine and free their blocks.
    fn abort_abandoned(&mut self) {
        let abandoned: Vec<RequestId> = self
            .live
            .iter()
            .filter(|(_, l)| l.tx.is_closed())
            .map(|(&id, _)| id)
            .chain(
                self.waiting
                    .iter()
                    .filter(|(_, job)| job.tx.is_closed())
                    .map(|(&id, _)| id),
            )
            .collect();
        if abandoned.is_empty() {
            return;
        }
        for &id in &abandoned {
            self.live.remove(&id);
            self.waiting.remove(&id);
            self.host.abort(id);
        }
        // Gauges first: a reader that sees the count sees the engine without them.
        self.update_gauges();
        self.stats().aborted += abandoned.len() as u64;
    }

    /// The engine's occupancy, for `/metrics`.
    fn update_gauges(&self) {
        let engine = self.host.engine();
        let (active, total) = engine.kv_blocks();
        let (running, waiting) = (engine.num_running() as u64, engine.num_waiting() as u64);
        let mut s = self.stats();
        s.running = running;
        s.waiting = waiting;
        s.kv_usage = if total == 0 {
            0.0
        } else {
            f64::from(active) / f64::from(total)
        };
    }

    /// A pass's effects, at its end.
    fn deliver(&mut self, out: &StepOutput) {
        for &(id, cached) in &out.prefix_hits {
            if let Some(l) = self.live.get(&id) {
                let _ = l.tx.send(JobUpdate::Cached(cached));
            }
        }
        let mut last = Vec::new();
        for e in &out.emitted {
            if let Some(l) = self.live.get_mut(&e.request) {
                let tokens = (0..e.tokens)
                    .map(|k| synthetic_output_token(e.request, l.outputs + k))
                    .collect();
                l.outputs += e.tokens;
                if out.finished.iter().any(|f| f.request == e.request) {
                    last.push((e.request, tokens));
                } else {
                    let _ = l.tx.send(JobUpdate::Tokens(tokens));
                }
            }
        }
        for f in &out.finished {
            if let Some(l) = self.live.remove(&f.request) {
                let tokens = last
                    .iter()
                    .position(|(id, _)| *id == f.request)
                    .map(|i| last.swap_remove(i).1)
                    .unwrap_or_default();
                let _ = l.tx.send(JobUpdate::Done {
                    completion_tokens: f.output_tokens,
                    reason: f.reason,
                    last: tokens,
                });
            }
        }
        self.publish(&out.events);
        self.update_gauges();
        let mut s = self.stats();
        s.hit_tokens += out.metrics.prefix_cache_hit_tokens;
        s.query_tokens += out.metrics.prefix_cache_query_tokens;
        s.generation_tokens += out.emitted.iter().map(|e| u64::from(e.tokens)).sum::<u64>();
        s.finished += out.finished.len() as u64;
    }

    fn publish(&self, events: &[KvEvent]) {
        if events.is_empty() {
            return;
        }
        if let Some(tap) = &self.out.tap {
            let _ = tap.send(events.to_vec());
        }
        let Some(p) = &self.out.publisher else { return };
        let events: Vec<WireEvent> = events.iter().map(WireEvent::from).collect();
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if let Err(e) = p.publish(events, Some(self.out.rank), ts) {
            tracing::warn!(error = %e, "publishing KV events failed");
        }
    }

    /// When something is next due: a pass, or a transfer landing.
    fn next_due(&self) -> Option<Timestamp> {
        let landing = self.host.next_landing().map(|(t, _)| t);
        self.host.engine().next_wakeup().into_iter().chain(landing).min()
    }
}

/// Runs `host` until the job channel closes.
pub(crate) async fn drive(
    host: EngineHost,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    stats: Arc<Mutex<Stats>>,
    out: Outbox,
) {
    let scale = host.engine().config().time_scale().unwrap_or(TimeScale::REAL);
    let mut d = Driver {
        epoch: Instant::now(),
        scale,
        host,
        live: HashMap::new(),
        waiting: HashMap::new(),
        next_id: 0,
        stats,
        out,
    };
    loop {
        d.abort_abandoned();
        d.between_passes(d.now() + TICK);
        let Some(next) = d.next_due() else {
            match jobs.recv().await {
                Some(job) => d.add(job),
                None => return,
            }
            continue;
        };
        // Sleep only when ahead of the wall clock by more than the timer's resolution: a
        // sped-up engine's passes are shorter than a millisecond, and rounding each sleep up to
        // the timer's tick would slow it down several times. Virtual time stays exact; tokens
        // are delivered at most a tick early.
        if next > d.now() + TICK {
            tokio::select! {
                () = tokio::time::sleep_until(d.at(next)) => {}
                job = jobs.recv() => match job {
                    Some(job) => d.add(job),
                    None => return,
                },
            }
            continue;
        }
        // Only a transfer was due: it lands at the top of the loop.
        let Some(wake) = d.host.engine().next_wakeup().filter(|&w| w <= d.now() + TICK) else {
            continue;
        };
        // A pass starts when the last one ended, even if the timer woke the driver late (it
        // catches up by running the next passes without sleeping), unless it fell behind by
        // more than `CATCH_UP` (the machine is overloaded): then the engine slips to now.
        let start = wake.max(d.now() - CATCH_UP);
        let Some(end) = d.host.step(start) else { continue };
        // The pass's effects happen when it ends; requests arriving meanwhile join the queue.
        while end > d.now() + TICK {
            tokio::select! {
                () = tokio::time::sleep_until(d.at(end)) => break,
                job = jobs.recv() => match job {
                    Some(job) => d.add(job),
                    None => return,
                },
            }
        }
        if let Some(out) = d.host.finish_pass() {
            d.deliver(&out);
        }
    }
}

#[cfg(test)]
mod script;
