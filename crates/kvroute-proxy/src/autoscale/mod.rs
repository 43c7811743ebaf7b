//! The planner, live: the same [`Planner`] the simulator drives, fed from what the proxy
//! observes of its fleet, its decisions carried out by an [`Actuator`].
//!
//! At each tick the planner asks for ([`Planner::next_tick`]), or sooner when requests wait in
//! the queue and a pool has no worker (scale from zero), the autoscaler builds the planner's
//! [`Observation`]: the traffic the driver gathered since the previous tick (arrivals, first
//! tokens, completions, predicted hits: `crate::driver`'s `observe` module), every worker in
//! the router with its load from the router's books and the cached blocks only it holds, the
//! workers the actuator is still starting, and the queue. It hands the decision to the actuator
//! (adds) or retires the chosen worker itself (removals: out of routing, its requests finish
//! within the drain timeout, then it leaves the fleet and the actuator ends it). Every tick is
//! kept for `GET /admin/planner`, every decision logged with its inputs and counted.
//!
//! The formulas are the planner's; this module only moves data, as the simulator's
//! `cluster::scaling` does.

pub mod actuator;
pub mod process;
pub mod removal;

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_core::ids::WorkerId;
use kvroute_planner::{
    Action, Observation, Planner, ScalingDecision, TickRecord, WorkerObservation, WorkerPhase,
};
use prometheus::{IntCounterVec, IntGaugeVec, Opts};
use serde::Serialize;

use crate::driver::Driver;
use crate::fleet::{Fleet, RetireOutcome};

pub use actuator::Actuator;

/// How the autoscaler runs, besides the planner's own configuration.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// How long a removed worker's requests may take to finish before it is removed anyway.
    pub drain_timeout: Duration,
    /// Ticks and decisions kept for `GET /admin/planner`.
    pub history: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            drain_timeout: Duration::from_secs(300),
            history: 100,
        }
    }
}

/// What `GET /admin/planner` shows: the planner's recent ticks and decisions, the workers being
/// started and retired, and the counts wanted per pool.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// The planner's configuration.
    pub config: Option<kvroute_planner::PlannerConfig>,
    /// Workers wanted per pool, by the last decision (or as found at start).
    pub desired: BTreeMap<&'static str, u32>,
    /// Workers the actuator is starting, per pool.
    pub starting: BTreeMap<&'static str, u32>,
    /// Workers being drained before removal, by id.
    pub retiring: Vec<u64>,
    /// The latest ticks, oldest first.
    pub ticks: VecDeque<TickRecord>,
    /// The latest decisions, oldest first.
    pub decisions: VecDeque<ScalingDecision>,
}

/// The autoscaler's report, shared with the admin API.
#[derive(Debug, Default)]
pub struct Status(Mutex<Report>);

impl Status {
    /// The latest decisions, oldest first.
    pub fn decisions(&self) -> Vec<ScalingDecision> {
        self.lock().decisions.iter().cloned().collect()
    }

    /// The latest ticks, oldest first.
    pub fn ticks(&self) -> Vec<TickRecord> {
        self.lock().ticks.iter().cloned().collect()
    }

    /// The report as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(&*self.lock()).unwrap_or_default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Report> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The autoscaler's metrics.
#[derive(Clone)]
struct Metrics {
    decisions: IntCounterVec,
    workers: IntGaugeVec,
    estimate: prometheus::GaugeVec,
    correction: prometheus::GaugeVec,
    holds: IntCounterVec,
    retired: IntCounterVec,
}

impl Metrics {
    fn new(driver: &Driver) -> Self {
        let m = Self {
            decisions: IntCounterVec::new(
                Opts::new(
                    "kvroute_planner_changes_total",
                    "Pool changes the planner decided, by pool and direction (up, down)",
                ),
                &["pool", "direction"],
            )
            .expect("valid metric"),
            workers: IntGaugeVec::new(
                Opts::new(
                    "kvroute_planner_workers",
                    "Workers the planner sees, by pool and phase (ready, starting, draining)",
                ),
                &["pool", "phase"],
            )
            .expect("valid metric"),
            estimate: prometheus::GaugeVec::new(
                Opts::new(
                    "kvroute_planner_estimate_ms",
                    "The planner's mean estimate over ready engines, by pool and metric (ttft, itl)",
                ),
                &["pool", "metric"],
            )
            .expect("valid metric"),
            correction: prometheus::GaugeVec::new(
                Opts::new(
                    "kvroute_planner_latency_correction",
                    "Observed over predicted latency, smoothed, by metric (ttft, itl)",
                ),
                &["metric"],
            )
            .expect("valid metric"),
            holds: IntCounterVec::new(
                Opts::new(
                    "kvroute_planner_holds_total",
                    "Ticks whose loop ran and decided nothing, by why (in_progress, no_model)",
                ),
                &["reason"],
            )
            .expect("valid metric"),
            retired: IntCounterVec::new(
                Opts::new(
                    "kvroute_planner_retired_total",
                    "Workers the planner removed, by how their drain ended (drained, timed_out, gone)",
                ),
                &["drain"],
            )
            .expect("valid metric"),
        };
        driver.metrics.register(Box::new(m.decisions.clone()));
        driver.metrics.register(Box::new(m.workers.clone()));
        driver.metrics.register(Box::new(m.estimate.clone()));
        driver.metrics.register(Box::new(m.correction.clone()));
        driver.metrics.register(Box::new(m.holds.clone()));
        driver.metrics.register(Box::new(m.retired.clone()));
        m
    }

    fn record(&self, record: &TickRecord) {
        for p in &record.pools {
            let pool = p.pool.name();
            for (phase, n) in [
                ("ready", p.ready),
                ("starting", p.starting),
                ("draining", p.draining),
            ] {
                self.workers.with_label_values(&[pool, phase]).set(i64::from(n));
            }
            for (metric, v) in [("ttft", p.est_ttft_ms), ("itl", p.est_itl_ms)] {
                if let Some(v) = v {
                    self.estimate.with_label_values(&[pool, metric]).set(v);
                }
            }
        }
        self.correction
            .with_label_values(&["ttft"])
            .set(record.ttft_correction);
        self.correction
            .with_label_values(&["itl"])
            .set(record.itl_correction);
        if let Some(hold) = record.hold {
            let reason = match hold {
                kvroute_planner::Hold::InProgress => "in_progress",
                kvroute_planner::Hold::NoModel => "no_model",
            };
            self.holds.with_label_values(&[reason]).inc();
        }
    }
}

/// Ids the planner gives workers the actuator is still starting (they have no registry id
/// yet): counted down from the top, so they never meet a registry id.
const PENDING_IDS: u64 = u64::MAX;

/// Starts the autoscaler: `planner` ticks on what `fleet`'s driver observes, `actuator` carries
/// out its decisions, `status` keeps its report. Runs until the returned task is aborted.
pub fn start(
    fleet: Arc<Fleet>,
    planner: Planner,
    actuator: Arc<dyn Actuator>,
    settings: Settings,
    status: Arc<Status>,
) -> tokio::task::JoinHandle<()> {
    let driver = Arc::clone(fleet.driver());
    driver.observe_traffic(Duration::from_secs_f64(planner.config().warmup_s));
    let metrics = Metrics::new(&driver);
    {
        let mut report = status.lock();
        report.config = Some(planner.config().clone());
        let workers = driver.planner_workers();
        for &pool in planner.config().mode.pools() {
            let ready = workers
                .iter()
                .filter(|w| w.pool == pool && w.state == WorkerPhase::Ready)
                .count() as u32;
            report.desired.insert(pool.name(), ready);
            actuator.set_desired(pool, ready);
        }
    }
    let reader = driver.planner_reader();
    let autoscaler = Autoscaler {
        fleet,
        driver,
        planner,
        actuator,
        settings,
        status,
        metrics,
        retiring: Arc::new(Mutex::new(Vec::new())),
        reader,
    };
    tokio::spawn(autoscaler.run())
}

struct Autoscaler {
    fleet: Arc<Fleet>,
    driver: Arc<Driver>,
    planner: Planner,
    actuator: Arc<dyn Actuator>,
    settings: Settings,
    status: Arc<Status>,
    metrics: Metrics,
    /// Workers being drained for removal.
    retiring: Arc<Mutex<Vec<WorkerId>>>,
    /// Each worker's queue integral at the previous tick.
    reader: kvroute_planner::books::Reader,
}

impl Autoscaler {
    async fn run(mut self) {
        let mut last = self.driver.timestamp();
        loop {
            self.wait_for_tick().await;
            let now = self.driver.timestamp();
            let mut traffic = self.driver.take_traffic();
            traffic.duration_s = now.saturating_since(last).as_secs_f64();
            last = now;
            let obs = self.observe(traffic);
            let out = self.planner.tick(now, &obs);
            self.metrics.record(&out.record);
            if let Some(decision) = &out.decision {
                tracing::info!(
                    at_s = decision.at_s,
                    decision = %decision.text,
                    actions = ?decision.actions,
                    observed_rps = out.record.observed_rps,
                    observed_ttft_ms = ?out.record.observed_ttft_ms,
                    observed_itl_ms = ?out.record.observed_itl_ms,
                    observed_hit_rate = ?out.record.observed_hit_rate,
                    queued = obs.queued_requests,
                    pools = ?out.record.pools,
                    "planner decision"
                );
                self.carry_out(decision);
            }
            self.keep(out.record, out.decision);
        }
    }

    /// Waits until the planner's next tick, or until requests start waiting in the queue for
    /// want of any worker while none is starting (a pool at zero starts one at once). Woken by
    /// the driver's changes (a request queued, a worker's change of state), not by polling;
    /// while such requests already wait, only the tick's time ends the wait.
    async fn wait_for_tick(&self) {
        let left = self.planner.next_tick().saturating_since(self.driver.timestamp());
        let stranded =
            |d: &Driver| d.queued_requests().without_worker > 0 && self.actuator.pending().is_empty();
        if stranded(&self.driver) {
            tokio::time::sleep(left).await;
        } else {
            self.driver.wait_until(left, stranded).await;
        }
    }

    /// What the planner sees now, with `traffic` since the previous tick.
    fn observe(&mut self, traffic: kvroute_planner::Traffic) -> Observation {
        let mut workers = self.driver.planner_observe(&mut self.reader);
        let retiring = self.retiring.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // A worker being retired is draining, whatever its state says.
        for w in &mut workers {
            if retiring.contains(&WorkerId(w.id)) {
                w.state = WorkerPhase::Draining;
            }
        }
        for (i, pool) in self.actuator.pending().into_iter().enumerate() {
            workers.push(WorkerObservation {
                id: PENDING_IDS - i as u64,
                pool,
                state: WorkerPhase::Starting,
                passes: Vec::new(),
                queued_prefill_tokens: 0,
                decode_seqs: 0,
                kv_tokens: 0,
                in_flight: 0,
                sole_blocks: 0,
            });
        }
        Observation {
            traffic,
            workers,
            queued_requests: self.driver.queued_requests().total as u64,
        }
    }

    fn carry_out(&self, decision: &ScalingDecision) {
        for c in &decision.changes {
            self.actuator.set_desired(c.pool, c.to);
            let direction = if c.to > c.from { "up" } else { "down" };
            self.metrics
                .decisions
                .with_label_values(&[c.pool.name(), direction])
                .inc();
        }
        for &action in &decision.actions {
            match action {
                Action::Add { pool } => self.actuator.provision(pool),
                Action::Remove { worker, .. } => self.retire(WorkerId(worker)),
            }
        }
    }

    /// Retires worker `id` by the fleet's one drain-then-remove path ([`Fleet::retire`]) and
    /// has the actuator end it.
    fn retire(&self, id: WorkerId) {
        let Some(url) = self.driver.worker_config(id).map(|c| c.url) else {
            return;
        };
        self.retiring.lock().unwrap_or_else(|p| p.into_inner()).push(id);
        let fleet = Arc::clone(&self.fleet);
        let actuator = Arc::clone(&self.actuator);
        let retiring = Arc::clone(&self.retiring);
        let retired = self.metrics.retired.clone();
        let timeout = self.settings.drain_timeout;
        tokio::spawn(async move {
            let drain = match fleet.retire(id, timeout).await {
                RetireOutcome::Drained => "drained",
                RetireOutcome::TimedOut { in_flight } => {
                    tracing::warn!(
                        worker = id.0,
                        url,
                        in_flight,
                        "drain timed out; the worker was removed with requests in flight"
                    );
                    "timed_out"
                }
                RetireOutcome::Gone => "gone",
            };
            actuator.release(id, &url);
            retired.with_label_values(&[drain]).inc();
            retiring
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|&w| w != id);
            tracing::info!(worker = id.0, url, drain, "worker retired by the planner");
        });
    }

    /// Keeps a tick (and its decision) for the admin API.
    fn keep(&self, record: TickRecord, decision: Option<ScalingDecision>) {
        let mut report = self.status.lock();
        let cap = self.settings.history.max(1);
        if let Some(d) = decision {
            for c in &d.changes {
                report.desired.insert(c.pool.name(), c.to);
            }
            if report.decisions.len() == cap {
                report.decisions.pop_front();
            }
            report.decisions.push_back(d);
        }
        if report.ticks.len() == cap {
            report.ticks.pop_front();
        }
        report.ticks.push_back(record);
        let mut starting: BTreeMap<&'static str, u32> = BTreeMap::new();
        for pool in self.actuator.pending() {
            *starting.entry(pool.name()).or_default() += 1;
        }
        report.starting = starting;
        report.retiring = self
            .retiring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|w| w.0)
            .collect();
    }
}
