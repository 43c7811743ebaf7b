//! The planner's state machine: observations in, decisions out, time passed in.

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_core::time::Timestamp;

use crate::config::{EngineLimits, Mode, PlannerConfig, Pool, Sla};
use crate::decision::{
    Action, Change, Hold, Metric, PoolStatus, Reason, ScalingDecision, ThroughputRecord, TickOutput,
    TickRecord,
};
use crate::error::PlannerError;
use crate::model::{PassSample, PoolModel, clamp_hit_rate};
use crate::observation::{Observation, Traffic, WorkerPhase, removal_order};
use crate::predictor::Predictor;

/// The SLA planner. See the crate docs.
#[derive(Clone, Debug)]
pub struct Planner {
    config: PlannerConfig,
    start: Timestamp,
    last_tick: Timestamp,
    next_load: Timestamp,
    next_throughput: Timestamp,
    models: Vec<(Pool, PoolModel)>,
    passes_seen: BTreeMap<u64, u32>,
    window: Traffic,
    rate: Predictor,
    isl: Predictor,
    osl: Predictor,
    hit: Predictor,
    /// The throughput loop's floors (the minimum until it has run).
    floors: [u32; 3],
    predicted_rps: Option<f64>,
    /// Consecutive load ticks with the same verdict, per pool.
    streak: [Streak; 3],
    /// The latest observed means, kept across quiet ticks.
    recent_isl: f64,
    recent_osl: f64,
    recent_hit: f64,
    /// Replicas the last decision wanted, per pool (a lost worker is replaced up to it).
    desired: [Option<u32>; 3],
    /// The last tick that saw a request arrive, wait or run.
    last_busy: Timestamp,
    /// The mean estimates of the previous tick, per metric, set against what was observed since.
    last_estimate: [Option<f64>; 2],
    /// Observed over predicted latency, per metric, smoothed.
    correction: [f64; 2],
}

/// The latency correction stays within these factors: one odd window cannot swing the fleet.
const CORRECTION_RANGE: (f64, f64) = (0.25, 4.0);

fn secs(d: f64) -> Duration {
    Duration::from_secs_f64(d)
}

impl Planner {
    /// A planner started at `start`, or why the configuration is unusable.
    pub fn new(config: PlannerConfig, limits: EngineLimits, start: Timestamp) -> Result<Self, PlannerError> {
        config.validate()?;
        limits.validate()?;
        let models = config
            .mode
            .pools()
            .iter()
            .map(|&p| {
                let m = PoolModel::new(
                    p,
                    limits,
                    config.max_samples,
                    config.sample_buckets,
                    config.min_observations,
                );
                (p, m)
            })
            .collect();
        let p = config.predictor;
        Ok(Self {
            start,
            last_tick: start,
            next_load: start + secs(config.load_interval_s),
            next_throughput: start + secs(config.throughput_interval_s),
            models,
            passes_seen: BTreeMap::new(),
            window: Traffic::default(),
            rate: Predictor::new(p),
            isl: Predictor::new(p),
            osl: Predictor::new(p),
            hit: Predictor::new(p),
            floors: [config.min_replicas; 3],
            predicted_rps: None,
            streak: [Streak::None; 3],
            recent_isl: 0.0,
            recent_osl: 0.0,
            recent_hit: 0.0,
            desired: [None; 3],
            last_busy: start,
            last_estimate: [None; 2],
            correction: [1.0; 2],
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PlannerConfig {
        &self.config
    }

    /// When the planner wants its next tick.
    pub fn next_tick(&self) -> Timestamp {
        match (self.config.load_scaling, self.config.throughput_scaling) {
            (true, true) => self.next_load.min(self.next_throughput),
            (true, false) => self.next_load,
            _ => self.next_throughput,
        }
    }

    /// The fitted model of `pool`, if the mode scales it.
    pub fn model(&self, pool: Pool) -> Option<&PoolModel> {
        self.models.iter().find(|(p, _)| *p == pool).map(|(_, m)| m)
    }

    /// One tick at `now` with what was observed since the previous one.
    pub fn tick(&mut self, now: Timestamp, obs: &Observation) -> TickOutput {
        let at_s = now.saturating_since(self.start).as_secs_f64();
        let elapsed_s = now.saturating_since(self.last_tick).as_secs_f64();
        self.learn(obs);
        let t = &obs.traffic;
        self.window.merge(t);
        if let Some(isl) = t.isl() {
            self.recent_isl = isl;
        }
        if let Some(osl) = t.osl() {
            self.recent_osl = osl;
        }
        if t.hit_n > 0 {
            self.recent_hit = clamp_hit_rate(t.hit_rate());
        }
        let load_due = self.config.load_scaling && now >= self.next_load;
        let throughput_due = self.config.throughput_scaling && now >= self.next_throughput;
        while self.next_load <= now {
            self.next_load = self.next_load + secs(self.config.load_interval_s);
        }
        while self.next_throughput <= now {
            self.next_throughput = self.next_throughput + secs(self.config.throughput_interval_s);
        }
        self.last_tick = now;

        let counts = Counts::of(obs);
        let h = if self.config.kv_hit_discount {
            self.recent_hit
        } else {
            0.0
        };
        let mut pools = Vec::new();
        let mut estimates = Vec::new();
        for &pool in self.config.mode.pools() {
            let est = self.estimates(pool, obs, h, elapsed_s);
            let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
            let c = counts.get(pool);
            pools.push(PoolStatus {
                pool,
                ready: c[0],
                starting: c[1],
                draining: c[2],
                est_ttft_ms: est.as_ref().and_then(|e| mean(&e.ttft)),
                est_itl_ms: est.as_ref().and_then(|e| mean(&e.itl)),
            });
            estimates.push((pool, est));
        }

        self.correct(t, &pools);
        if t.requests > 0 || obs.queued_requests > 0 || obs.workers.iter().any(|w| w.in_flight > 0) {
            self.last_busy = now;
        }
        let in_force = self.predicted_rps;
        let throughput = throughput_due.then(|| self.throughput_tick());
        let mut record = TickRecord {
            at_s,
            load_tick: load_due,
            throughput_tick: throughput_due,
            observed_rps: t.rps(),
            predicted_rps: in_force,
            observed_ttft_ms: t.ttft_ms(),
            observed_itl_ms: t.itl_ms(),
            observed_hit_rate: t.hit_rate(),
            engine_hit_rate: t.engine_hit_rate(),
            pools,
            throughput: throughput.as_ref().map(|(r, _)| r.clone()),
            hold: None,
            ttft_correction: self.correction[0],
            itl_correction: self.correction[1],
        };
        // A pool at zero with requests waiting starts a worker at any tick.
        let waiting = t.requests.max(obs.queued_requests);
        let from_zero: Vec<Change> = self
            .config
            .mode
            .pools()
            .iter()
            .filter(|&&p| waiting > 0 && counts.get(p)[0] + counts.get(p)[1] == 0)
            .map(|&pool| Change {
                pool,
                from: 0,
                to: self.config.min_replicas.max(1),
                reason: Reason::FromZero { waiting },
            })
            .collect();
        if !from_zero.is_empty() {
            let decision = self.decide(at_s, from_zero, obs, &counts);
            return TickOutput { decision, record };
        }
        if !load_due && !throughput_due {
            return TickOutput {
                decision: None,
                record,
            };
        }
        if self.config.mode.pools().iter().any(|&p| {
            let c = counts.get(p);
            c[1] > 0 || c[2] > 0
        }) {
            record.hold = Some(Hold::InProgress);
            self.streak = [Streak::None; 3];
            return TickOutput {
                decision: None,
                record,
            };
        }

        // Targets per scaled pool, with the reason of each change.
        let mut changes: Vec<Change> = Vec::new();
        let min = self.config.min_replicas;
        let idle_s = now.saturating_since(self.last_busy).as_secs_f64();
        for &pool in self.config.mode.pools() {
            let ready = counts.get(pool)[0];
            let mut to = ready;
            let mut reason = None;
            if ready < min {
                (to, reason) = (min, Some(Reason::MinReplicas));
            } else if let Some(want) = self.desired[pool.index()]
                && ready < want.max(min)
            {
                let missing = want.max(min) - ready;
                (to, reason) = (ready + missing, Some(Reason::Replace { missing }));
            } else if min == 0 && ready > 0 && load_due && idle_s >= self.config.idle_to_zero_s {
                (to, reason) = (0, Some(Reason::Idle { idle_s }));
            }
            if let Some((_, needs)) = &throughput
                && let Some(&(
                    _,
                    PoolNeed {
                        replicas,
                        demand_rps,
                        capacity_rps,
                    },
                )) = needs.iter().find(|(p, _)| *p == pool)
            {
                let n = replicas.max(min);
                if self.config.load_scaling {
                    self.floors[pool.index()] = n;
                    if to < n {
                        (to, reason) = (
                            n,
                            Some(Reason::ThroughputFloor {
                                demand_rps,
                                capacity_rps,
                            }),
                        );
                    }
                } else if to != n {
                    (to, reason) = (
                        n,
                        Some(Reason::ThroughputTarget {
                            demand_rps,
                            capacity_rps,
                        }),
                    );
                }
            }
            if load_due && reason.is_none() {
                let est = estimates.iter().find(|e| e.0 == pool).and_then(|e| e.1.as_ref());
                let verdict = est.and_then(|est| self.load_decision(pool, est, ready));
                let streak = &mut self.streak[pool.index()];
                *streak = streak.then(verdict.as_ref().map(|v| v.0));
                if let Some((delta, why)) = verdict {
                    let (held, needed) = match *streak {
                        Streak::Up(n) => (n, self.config.scale_up_ticks),
                        Streak::Down(n) => (n, self.config.scale_down_ticks),
                        Streak::None => (0, u32::MAX),
                    };
                    let at_once = match why {
                        Reason::SlaBreached {
                            best_estimate_ms,
                            sla_ms,
                            ..
                        } => self
                            .config
                            .scale_up_at_once
                            .is_some_and(|f| best_estimate_ms >= f * sla_ms),
                        _ => false,
                    };
                    if held >= needed || at_once {
                        *streak = Streak::None;
                        let to_now = if delta > 0 { ready + 1 } else { ready - 1 };
                        (to, reason) = (to_now, Some(why));
                    }
                }
            }
            if let Some(max) = self.config.max_replicas
                && to > max
            {
                (to, reason) = (max, Some(Reason::MaxReplicas));
            }
            if let Some(reason) = reason {
                changes.push(Change {
                    pool,
                    from: ready,
                    to,
                    reason,
                });
            }
        }
        if changes.is_empty() {
            if load_due && estimates.iter().all(|e| e.1.is_none()) {
                record.hold = Some(Hold::NoModel);
            }
            return TickOutput {
                decision: None,
                record,
            };
        }
        let decision = self.decide(at_s, changes, obs, &counts);
        TickOutput { decision, record }
    }

    /// Carries `changes` out, and remembers what they want (a lost worker is replaced up to it).
    fn decide(
        &mut self,
        at_s: f64,
        changes: Vec<Change>,
        obs: &Observation,
        counts: &Counts,
    ) -> Option<ScalingDecision> {
        let decision = self.carry_out(at_s, changes, obs, counts)?;
        for c in &decision.changes {
            self.desired[c.pool.index()] = Some(c.to);
        }
        Some(decision)
    }

    /// The targets the estimates are held to: the SLA divided by the latency correction (an
    /// engine observed slower than the model predicts must be predicted further below it).
    fn sla(&self) -> Sla {
        let sla = self.config.sla;
        Sla {
            ttft_ms: sla.ttft_ms / self.correction[0],
            itl_ms: sla.itl_ms / self.correction[1],
        }
    }

    /// Sets what was observed since the previous tick against what that tick estimated, and
    /// smooths the ratio into the latency correction (when it is on).
    fn correct(&mut self, t: &Traffic, pools: &[PoolStatus]) {
        let mean = |v: Vec<f64>| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        let now = [
            mean(pools.iter().filter_map(|p| p.est_ttft_ms).collect()),
            mean(pools.iter().filter_map(|p| p.est_itl_ms).collect()),
        ];
        if self.config.latency_correction {
            for (i, observed) in [t.ttft_ms(), t.itl_ms()].into_iter().enumerate() {
                if let (Some(o), Some(e)) = (observed, self.last_estimate[i])
                    && o > 0.0
                    && e > 0.0
                {
                    let ratio = (o / e).clamp(CORRECTION_RANGE.0, CORRECTION_RANGE.1);
                    self.correction[i] = 0.5 * (self.correction[i] + ratio);
                }
            }
        }
        self.last_estimate = now;
    }

    /// Feeds `samples` to `pool`'s model as if they were passes of warm engines (a profile of
    /// the engine taken before serving, as Dynamo's pre-deployment profiling gives) and refits.
    pub fn seed(&mut self, pool: Pool, samples: &[PassSample]) {
        if let Some((_, model)) = self.models.iter_mut().find(|(p, _)| *p == pool) {
            for s in samples {
                model.add(s);
            }
            model.refit();
        }
    }

    /// Feeds the passes of every worker past its cold start to its pool's model.
    fn learn(&mut self, obs: &Observation) {
        for w in &obs.workers {
            let seen = self.passes_seen.entry(w.id).or_insert(0);
            let Some((_, model)) = self.models.iter_mut().find(|(p, _)| *p == w.pool) else {
                continue;
            };
            for pass in &w.passes {
                if *seen >= self.config.cold_start_passes {
                    model.add(pass);
                }
                *seen = seen.saturating_add(1);
            }
        }
        let live: std::collections::BTreeSet<u64> = obs.workers.iter().map(|w| w.id).collect();
        self.passes_seen.retain(|id, _| live.contains(id));
        for (_, m) in &mut self.models {
            m.refit();
        }
    }

    /// Every ready engine's estimated next TTFT and ITL, and its busy share since the last
    /// tick; `None` without a fitted model.
    fn estimates(&self, pool: Pool, obs: &Observation, h: f64, elapsed_s: f64) -> Option<Estimates> {
        let model = self.model(pool)?;
        model.fitted()?;
        let isl = self.recent_isl.max(1.0);
        let mut e = Estimates::default();
        for w in obs
            .workers
            .iter()
            .filter(|w| w.pool == pool && w.state == WorkerPhase::Ready)
        {
            // Resident KV and decoding requests: time-weighted means over the passes since the
            // last tick (a snapshot when there were none); the queue is as observed (the
            // engine's at the tick, or the router's books' mean since the last one).
            let span: f64 = w.passes.iter().map(|p| p.duration_s).sum();
            let (kv, seqs) = if span > 0.0 {
                let kv = w
                    .passes
                    .iter()
                    .map(|p| p.kv_tokens as f64 * p.duration_s)
                    .sum::<f64>()
                    / span;
                let seqs = w
                    .passes
                    .iter()
                    .map(|p| f64::from(p.decode_seqs) * p.duration_s)
                    .sum::<f64>()
                    / span;
                (kv, seqs)
            } else {
                (w.kv_tokens as f64, f64::from(w.decode_seqs))
            };
            let q = w.queued_prefill_tokens as f64;
            let engine = EngineLoad { queued: q, kv, seqs };
            if matches!(pool, Pool::Prefill | Pool::Agg) {
                e.ttft.push(model.ttft_ms(q, isl, h, kv)?);
            }
            if matches!(pool, Pool::Decode | Pool::Agg) {
                e.itl.push(self.itl_estimate(model, pool, &engine, 1.0, h)?);
            }
            e.engines.push(engine);
            if elapsed_s > 0.0 {
                e.busy += w.passes.iter().map(|p| p.duration_s).sum::<f64>() / elapsed_s;
            }
        }
        if !e.engines.is_empty() {
            e.busy /= e.engines.len() as f64;
        }
        Some(e)
    }

    /// An engine's ITL estimate with its load scaled by `r` (1: as it is; `N/(N-1)`: after a
    /// consolidation), one more request of the recent ISL and OSL admitted.
    fn itl_estimate(&self, model: &PoolModel, pool: Pool, e: &EngineLoad, r: f64, h: f64) -> Option<f64> {
        let (isl, osl) = (self.recent_isl.max(1.0), self.recent_osl.max(1.0));
        let seqs = e.seqs * r + 1.0;
        // Decode residency uses the raw ISL; queued prompts (agg) will become resident KV.
        let queued_kv = if pool == Pool::Agg { e.queued * r } else { 0.0 };
        let kv = e.kv * r + queued_kv + isl + osl / 2.0;
        let per_pass = if pool == Pool::Agg {
            seqs * isl * (1.0 - h) / osl
        } else {
            0.0
        };
        model.itl_ms(seqs, kv, per_pass)
    }

    /// The load loop's verdict for `pool` with `ready` engines: +1, -1 or nothing.
    fn load_decision(&self, pool: Pool, est: &Estimates, ready: u32) -> Option<(i32, Reason)> {
        let sla = self.sla();
        let min_of = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
        if !est.ttft.is_empty() && est.ttft.iter().all(|&t| t > sla.ttft_ms) {
            return Some((
                1,
                Reason::SlaBreached {
                    metric: Metric::Ttft,
                    best_estimate_ms: min_of(&est.ttft),
                    sla_ms: sla.ttft_ms,
                },
            ));
        }
        if !est.itl.is_empty() && est.itl.iter().all(|&t| t > sla.itl_ms) {
            return Some((
                1,
                Reason::SlaBreached {
                    metric: Metric::Itl,
                    best_estimate_ms: min_of(&est.itl),
                    sla_ms: sla.itl_ms,
                },
            ));
        }
        let floor = self.floors[pool.index()].max(self.config.min_replicas);
        if ready <= floor || ready < 2 || est.engines.len() != ready as usize {
            return None;
        }
        self.consolidation_share(pool, est, ready)
            .filter(|&s| s < 1.0)
            .map(|worst_share| (-1, Reason::Consolidation { worst_share }))
    }

    /// The worst share of the allowed margin any engine would use if `ready - 1` engines took
    /// the load of `ready` (`< 1` passes); `None` if a model is missing.
    pub(crate) fn consolidation_share(&self, pool: Pool, est: &Estimates, ready: u32) -> Option<f64> {
        let model = self.model(pool)?;
        let sla = self.sla();
        let sens = self.config.scale_down_sensitivity;
        let r = f64::from(ready) / f64::from(ready - 1);
        let h = if self.config.kv_hit_discount {
            self.recent_hit
        } else {
            0.0
        };
        let (isl, kv_cap) = (self.recent_isl.max(1.0), model_kv_cap(model));
        let mut worst: f64 = 0.0;
        for e in &est.engines {
            if matches!(pool, Pool::Prefill | Pool::Agg) {
                let own = model.ttft_ms(0.0, isl, h, e.kv)?;
                let post = model.ttft_ms(e.queued * r, isl, h, e.kv * r)?;
                let margin = sla.ttft_ms - own;
                if margin <= 0.0 {
                    return Some(f64::INFINITY);
                }
                worst = worst.max((post - own) / (margin * sens));
                if pool == Pool::Prefill {
                    // The work itself must fit: the busy share after consolidation.
                    worst = worst.max(est.busy * r / sens);
                }
            }
            if matches!(pool, Pool::Decode | Pool::Agg) {
                let queued_kv = if pool == Pool::Agg { e.queued } else { 0.0 };
                if (e.kv + queued_kv) * r >= kv_cap {
                    return Some(f64::INFINITY);
                }
                let itl = self.itl_estimate(model, pool, e, r, h)?;
                worst = worst.max(itl / (sla.itl_ms * sens));
            }
        }
        Some(worst)
    }

    /// Closes the throughput window: observes it, predicts the next and sizes each pool.
    fn throughput_tick(&mut self) -> (ThroughputRecord, Vec<(Pool, PoolNeed)>) {
        let w = std::mem::take(&mut self.window);
        let window_s = self.config.throughput_interval_s;
        let observed_rps = w.requests as f64 / window_s;
        self.rate.observe(observed_rps);
        if let Some(isl) = w.isl() {
            self.isl.observe(isl);
        }
        if let Some(osl) = w.osl() {
            self.osl.observe(osl);
        }
        if let Some(hit) = w.hit_rate() {
            self.hit.observe(hit);
        }
        let next_rps = self.rate.predict();
        let next_isl = if self.isl.is_empty() {
            self.recent_isl
        } else {
            self.isl.predict()
        };
        let next_osl = if self.osl.is_empty() {
            self.recent_osl
        } else {
            self.osl.predict()
        };
        // The discount never assumes more reuse than the window just observed: a trend
        // extrapolated past it under-provisions prefill, which breaks the TTFT SLA.
        let next_hit = if self.config.kv_hit_discount {
            let forecast = (!self.hit.is_empty()).then(|| self.hit.predict());
            clamp_hit_rate(forecast.map(|f| f.min(w.hit_rate().unwrap_or(0.0))))
        } else {
            0.0
        };
        let predicted_rps = self.predicted_rps.replace(next_rps);
        let mut needs = Vec::new();
        let mut replicas = Vec::new();
        for &(pool, ref model) in &self.models {
            let capacity = model
                .capacity_rps(&self.sla(), next_isl, next_osl, next_hit)
                .map(|c| c * self.config.throughput_headroom)
                .filter(|c| c.is_finite() && *c > 0.0);
            let n = capacity.map(|c| {
                let n = (next_rps / c).ceil();
                if n.is_finite() {
                    n.clamp(0.0, f64::from(u32::MAX)) as u32
                } else {
                    u32::MAX
                }
            });
            replicas.push((pool, n));
            if let (Some(n), Some(c)) = (n, capacity) {
                needs.push((
                    pool,
                    PoolNeed {
                        replicas: n,
                        demand_rps: next_rps,
                        capacity_rps: c,
                    },
                ));
            }
        }
        let record = ThroughputRecord {
            observed_rps,
            predicted_rps,
            next_rps,
            next_isl,
            next_osl,
            next_hit_rate: next_hit,
            replicas,
        };
        (record, needs)
    }

    /// Applies the budget to `changes` and turns them into actions.
    fn carry_out(
        &self,
        at_s: f64,
        mut changes: Vec<Change>,
        obs: &Observation,
        counts: &Counts,
    ) -> Option<ScalingDecision> {
        let budget = self.config.max_gpu_budget;
        let gpus = |p: Pool| self.config.gpus(p);
        // GPUs of pools this planner does not scale.
        let scaled = self.config.mode.pools();
        let fixed: u32 = obs
            .workers
            .iter()
            .filter(|w| !scaled.contains(&w.pool))
            .map(|w| gpus(w.pool))
            .sum();
        let available = budget.saturating_sub(fixed);
        // Wanted counts of every scaled pool, in pool order.
        let mut wanted: Vec<(Pool, u32)> = scaled
            .iter()
            .map(|&p| {
                (
                    p,
                    changes
                        .iter()
                        .find(|c| c.pool == p)
                        .map_or(counts.get(p)[0], |c| c.to),
                )
            })
            .collect();
        let total: u32 = wanted.iter().map(|&(p, n)| n * gpus(p)).sum();
        if total > available {
            let cut = fit_budget(&wanted, available, self.config.min_replicas, &gpus);
            for (&(pool, want), &(_, n)) in wanted.iter().zip(&cut) {
                if n != want {
                    let from = counts.get(pool)[0];
                    let reason = Reason::BudgetCut { wanted: want, budget };
                    match changes.iter_mut().find(|c| c.pool == pool) {
                        Some(c) => {
                            c.to = n;
                            c.reason = reason;
                        }
                        None => changes.push(Change {
                            pool,
                            from,
                            to: n,
                            reason,
                        }),
                    }
                }
            }
            wanted = cut;
        }
        changes.retain(|c| c.to != c.from);
        if changes.is_empty() {
            return None;
        }
        // Removals first; every provisioned worker (draining ones too) holds its GPUs until it
        // is gone, so adds are made only if they fit beside everything provisioned now.
        let mut actions = Vec::new();
        for &(pool, n) in &wanted {
            let ready = counts.get(pool)[0];
            if n < ready {
                let ready_ones = obs
                    .workers
                    .iter()
                    .filter(|w| w.pool == pool && w.state == WorkerPhase::Ready);
                for worker in removal_order(ready_ones).into_iter().take((ready - n) as usize) {
                    actions.push(Action::Remove { pool, worker });
                }
            }
        }
        let provisioned: u32 = obs.workers.iter().map(|w| gpus(w.pool)).sum();
        let mut room = budget.saturating_sub(provisioned);
        let mut deferred = false;
        for &(pool, n) in &wanted {
            let ready = counts.get(pool)[0];
            for _ in ready..n.max(ready) {
                if gpus(pool) <= room {
                    room -= gpus(pool);
                    actions.push(Action::Add { pool });
                } else {
                    deferred = true;
                }
            }
        }
        if let Some(limit) = self.config.max_changes_per_tick
            && actions.len() > limit as usize
        {
            actions.truncate(limit as usize);
            deferred = true;
        }
        if actions.is_empty() {
            return None;
        }
        let mut text = changes
            .iter()
            .map(|c| format!("{} {} -> {}: {}", c.pool.name(), c.from, c.to, c.reason))
            .collect::<Vec<_>>()
            .join("; ");
        if deferred {
            text.push_str(" (the rest waits: for draining workers' GPUs, or the limit of changes a tick)");
        }
        Some(ScalingDecision {
            at_s,
            changes,
            actions,
            text,
        })
    }
}

/// The KV capacity the model was built for.
fn model_kv_cap(model: &PoolModel) -> f64 {
    model.kv_capacity_tokens() as f64
}

/// Cuts `wanted` to fit `available` GPUs: every pool scaled by the same factor (rounded down,
/// at least `min`), the first pools first; later pools take what is left, up to their wish.
pub fn fit_budget(
    wanted: &[(Pool, u32)],
    available: u32,
    min: u32,
    gpus: &dyn Fn(Pool) -> u32,
) -> Vec<(Pool, u32)> {
    let total: u32 = wanted.iter().map(|&(p, n)| n * gpus(p)).sum();
    if total <= available {
        return wanted.to_vec();
    }
    let factor = f64::from(available) / f64::from(total.max(1));
    let mut out: Vec<(Pool, u32)> = Vec::with_capacity(wanted.len());
    let mut used = 0u32;
    for (i, &(pool, n)) in wanted.iter().enumerate() {
        // GPUs the later pools need at their minimum.
        let reserve: u32 = wanted[i + 1..].iter().map(|&(p, _)| min * gpus(p)).sum();
        let left = available.saturating_sub(used).saturating_sub(reserve);
        let last = i + 1 == wanted.len();
        let scaled = if last {
            n
        } else {
            ((f64::from(n) * factor).floor() as u32).max(min)
        };
        let fit = (left / gpus(pool)).max(min);
        let k = scaled.min(fit).min(n.max(min));
        used += k * gpus(pool);
        out.push((pool, k));
    }
    out
}

/// What the throughput loop found a pool needs.
#[derive(Clone, Copy, Debug, PartialEq)]
struct PoolNeed {
    /// Engines that serve the predicted demand.
    replicas: u32,
    /// The predicted demand, requests per second.
    demand_rps: f64,
    /// What one engine serves within the SLA, requests per second.
    capacity_rps: f64,
}

/// One engine's load as the estimates use it.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct EngineLoad {
    queued: f64,
    kv: f64,
    seqs: f64,
}

/// A pool's per-engine estimates at a tick.
#[derive(Clone, Debug, Default)]
pub(crate) struct Estimates {
    ttft: Vec<f64>,
    itl: Vec<f64>,
    engines: Vec<EngineLoad>,
    busy: f64,
}

/// Ready, starting and draining workers per pool.
struct Counts([[u32; 3]; 3]);

impl Counts {
    fn of(obs: &Observation) -> Self {
        let mut c = [[0u32; 3]; 3];
        for w in &obs.workers {
            let s = match w.state {
                WorkerPhase::Ready => 0,
                WorkerPhase::Starting => 1,
                WorkerPhase::Draining => 2,
            };
            c[w.pool.index()][s] += 1;
        }
        Self(c)
    }

    fn get(&self, pool: Pool) -> [u32; 3] {
        self.0[pool.index()]
    }
}

impl Mode {
    /// Whether `pool` is scaled in this mode.
    pub fn scales(self, pool: Pool) -> bool {
        self.pools().contains(&pool)
    }
}

/// How many load ticks in a row a pool's verdict has been the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Streak {
    None,
    Up(u32),
    Down(u32),
}

impl Streak {
    /// The streak after one more tick whose verdict is `delta` (+1, -1, or none).
    fn then(self, delta: Option<i32>) -> Streak {
        match (self, delta) {
            (Streak::Up(n), Some(d)) if d > 0 => Streak::Up(n + 1),
            (_, Some(d)) if d > 0 => Streak::Up(1),
            (Streak::Down(n), Some(_)) => Streak::Down(n + 1),
            (_, Some(_)) => Streak::Down(1),
            (_, None) => Streak::None,
        }
    }
}
