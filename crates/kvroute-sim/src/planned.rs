//! The planner in the loop: what the event loop keeps for it, and what a run reports about it.
//!
//! The loop gathers traffic (arrivals and their prompt lengths, routed requests' predicted
//! hit rate, first tokens, completions) and every engine's forward passes between ticks, hands
//! them to [`kvroute_planner::Planner::tick`] at the times it asks for, and carries out its
//! actions: an added worker gets an engine at once (it is provisioned, so it costs GPU time) and
//! joins the router after the startup delay; a removed one is marked draining in the router,
//! finishes its requests, and leaves the router when idle. The formulas are the planner's; this
//! module only moves data.

use std::time::Duration;

use kvroute_core::time::Timestamp;
use kvroute_planner::{Observation, Planner, PlannerConfig, Pool, ScalingDecision, TickRecord, Traffic};
use serde::Serialize;

/// The planner's state during a run.
#[derive(Debug)]
pub(crate) struct PlannerState {
    pub(crate) planner: Planner,
    /// Traffic since the previous tick.
    pub(crate) traffic: Traffic,
    pub(crate) last_tick: Timestamp,
    pub(crate) decisions: Vec<ScalingDecision>,
    pub(crate) ticks: Vec<TickRecord>,
    /// What the planner was handed, when kept.
    pub(crate) observations: Option<Vec<(Timestamp, Observation)>>,
    /// What the planner sees of the workers.
    pub(crate) observe: kvroute_planner::Observe,
    /// With `Observe::Router`: each worker's queue integral at the previous tick.
    pub(crate) reader: kvroute_planner::books::Reader,
    pub(crate) startup: Duration,
    /// KV events that reached the router after their worker was removed (dropped).
    pub(crate) late_kv_events: u64,
}

impl PlannerState {
    pub(crate) fn new(planner: Planner, startup: Duration, block_size: u32) -> Self {
        Self {
            planner,
            traffic: Traffic::default(),
            last_tick: Timestamp::ZERO,
            decisions: Vec::new(),
            ticks: Vec::new(),
            observations: None,
            observe: kvroute_planner::Observe::Engines,
            // The planner starts with the run.
            reader: kvroute_planner::books::Reader::starting_at(block_size, Timestamp::ZERO),
            startup,
            late_kv_events: 0,
        }
    }
}

/// One worker's life under the planner, seconds from the start.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerLife {
    /// The worker's id.
    pub id: u64,
    /// Its pool.
    pub pool: Pool,
    /// When it was provisioned (0 for the initial fleet).
    pub provisioned_s: f64,
    /// When it became routable.
    pub ready_s: Option<f64>,
    /// When it started draining.
    pub draining_s: Option<f64>,
    /// When it was removed.
    pub removed_s: Option<f64>,
}

/// SLA attainment of the requests that arrived in one window.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SlaWindow {
    /// The window's start, seconds.
    pub start_s: f64,
    /// Requests that arrived in it.
    pub arrived: u64,
    /// Of those, completed.
    pub completed: u64,
    /// Of those, turned away.
    pub rejected: u64,
    /// Mean TTFT of the completed ones, ms.
    pub mean_ttft_ms: Option<f64>,
    /// Mean inter-token latency (TPOT) of the completed ones with two tokens or more, ms.
    pub mean_itl_ms: Option<f64>,
    /// Share of the completed ones meeting both targets on their own.
    pub good_fraction: f64,
    /// Whether the window met the SLA: something completed, nothing was turned away, and both
    /// means are within the targets (the planner plans for means).
    pub met: bool,
}

/// What the planner saw and did over a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlannerRun {
    /// TTFT target, ms.
    pub ttft_sla_ms: f64,
    /// ITL target, ms.
    pub itl_sla_ms: f64,
    /// The SLA windows' length, seconds.
    pub window_s: f64,
    /// SLA attainment per window.
    pub windows: Vec<SlaWindow>,
    /// Every decision, with its reasons.
    pub decisions: Vec<ScalingDecision>,
    /// Every tick: replicas, estimates, observed and predicted load.
    pub ticks: Vec<TickRecord>,
    /// Every worker's life.
    pub workers: Vec<WorkerLife>,
    /// With [`crate::PlannerSetup::keep_observations`]: what the planner was handed at each
    /// tick, and when (for feeding another driver the same sequence).
    #[serde(skip)]
    pub observations: Vec<(Timestamp, Observation)>,
}

impl PlannerRun {
    /// Windows that met the SLA, and windows with arrivals.
    pub fn attainment(&self) -> (u64, u64) {
        let counted = self.windows.iter().filter(|w| w.arrived > 0).count() as u64;
        let met = self.windows.iter().filter(|w| w.met).count() as u64;
        (met, counted)
    }
}

/// The planner's configuration echo for the report.
pub(crate) fn sla_of(config: &PlannerConfig) -> (f64, f64) {
    (config.sla.ttft_ms, config.sla.itl_ms)
}

/// One request as SLA attainment counts it.
#[derive(Clone, Copy, Debug)]
pub struct RequestSla {
    /// When it arrived.
    pub arrived: Timestamp,
    /// How it ended.
    pub outcome: crate::report::Outcome,
    /// Its first token, if any.
    pub first_token: Option<Timestamp>,
    /// Its last token, as its client received it.
    pub last_token: Timestamp,
    /// Its output tokens.
    pub output_tokens: u32,
}

/// SLA attainment per `window` of arrivals: a window meets `sla` when something in it completed,
/// nothing was turned away, and the mean TTFT and mean inter-token latency of its completed
/// requests are within the targets (the planner plans for means). For the simulator's requests
/// and, the same way, for a live run's (`kvroute demo --planner`).
pub fn sla_windows(
    requests: impl IntoIterator<Item = RequestSla>,
    window: Duration,
    sla: &kvroute_planner::Sla,
) -> Vec<SlaWindow> {
    let (ttft_sla, itl_sla) = (sla.ttft_ms, sla.itl_ms);
    let window = window.as_nanos().max(1) as u64;
    let ms = |a: Timestamp, b: Timestamp| crate::report::ms_between(a.as_nanos(), b.as_nanos());
    let mut windows: Vec<SlaWindow> = Vec::new();
    let mut sums: Vec<(f64, u64, f64, u64, u64)> = Vec::new();
    for s in requests {
        let k = (s.arrived.as_nanos() / window) as usize;
        while windows.len() <= k {
            windows.push(SlaWindow {
                start_s: (windows.len() as u64 * window) as f64 / 1e9,
                arrived: 0,
                completed: 0,
                rejected: 0,
                mean_ttft_ms: None,
                mean_itl_ms: None,
                good_fraction: 0.0,
                met: false,
            });
            sums.push((0.0, 0, 0.0, 0, 0));
        }
        let w = &mut windows[k];
        let sum = &mut sums[k];
        w.arrived += 1;
        match s.outcome {
            crate::report::Outcome::Rejected => w.rejected += 1,
            crate::report::Outcome::Unfinished => {}
            crate::report::Outcome::Completed => {
                w.completed += 1;
                let ttft = s.first_token.map_or(0.0, |t| ms(s.arrived, t));
                sum.0 += ttft;
                sum.1 += 1;
                let mut itl_ok = true;
                if let Some(first) = s.first_token
                    && let Some(itl) = crate::report::tpot_ms(
                        first.as_nanos(),
                        s.last_token.as_nanos(),
                        u64::from(s.output_tokens),
                    )
                {
                    sum.2 += itl;
                    sum.3 += 1;
                    itl_ok = itl <= itl_sla;
                }
                if ttft <= ttft_sla && itl_ok {
                    sum.4 += 1;
                }
            }
        }
    }
    for (w, sum) in windows.iter_mut().zip(&sums) {
        w.mean_ttft_ms = (sum.1 > 0).then(|| sum.0 / sum.1 as f64);
        w.mean_itl_ms = (sum.3 > 0).then(|| sum.2 / sum.3 as f64);
        w.good_fraction = if w.completed == 0 {
            0.0
        } else {
            sum.4 as f64 / w.completed as f64
        };
        w.met = w.completed > 0
            && w.rejected == 0
            && w.mean_ttft_ms.is_none_or(|t| t <= ttft_sla)
            && w.mean_itl_ms.is_none_or(|t| t <= itl_sla);
    }
    windows
}
