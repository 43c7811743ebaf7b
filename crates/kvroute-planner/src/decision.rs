//! What a tick produces: a scaling decision with each pool's change and its reason, and the
//! record of what the tick saw and estimated.

use std::fmt;

use serde::Serialize;

use crate::config::Pool;

/// Which latency an estimate is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// Time to first token.
    Ttft,
    /// Inter-token latency.
    Itl,
}

/// Why a pool's replica count changes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// Load loop: every engine's estimate breaks the SLA; add one.
    SlaBreached {
        /// The latency.
        metric: Metric,
        /// The best (lowest) engine estimate, ms.
        best_estimate_ms: f64,
        /// The target, ms.
        sla_ms: f64,
    },
    /// Load loop: the engines left after removing one, absorbing its load, stay within the
    /// SLA times the sensitivity; remove one.
    Consolidation {
        /// The worst estimate after consolidation, as a share of the allowed margin (< 1).
        worst_share: f64,
    },
    /// Throughput loop (with the load loop on): the replicas the predicted demand needs are a
    /// floor; raise to it.
    ThroughputFloor {
        /// Predicted requests per second.
        demand_rps: f64,
        /// Requests per second one engine sustains under the SLA (after headroom).
        capacity_rps: f64,
    },
    /// Throughput loop alone: set the pool to what the predicted demand needs.
    ThroughputTarget {
        /// Predicted requests per second.
        demand_rps: f64,
        /// Requests per second one engine sustains under the SLA (after headroom).
        capacity_rps: f64,
    },
    /// Fewer replicas than the minimum.
    MinReplicas,
    /// More replicas than the maximum.
    MaxReplicas,
    /// A pool at zero has requests waiting: start one.
    FromZero {
        /// Requests that arrived since the previous tick or wait in the queue.
        waiting: u64,
    },
    /// Fewer workers than the last decision wanted (one was lost): replace them.
    Replace {
        /// Workers missing.
        missing: u32,
    },
    /// A pool whose minimum is 0 saw no request for `idle_s`: stop its workers.
    Idle {
        /// Seconds without a request.
        idle_s: f64,
    },
    /// The wanted counts exceed the GPU budget: cut proportionally.
    BudgetCut {
        /// Replicas wanted before the cut.
        wanted: u32,
        /// The budget, GPUs.
        budget: u32,
    },
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Reason::SlaBreached {
                metric,
                best_estimate_ms,
                sla_ms,
            } => write!(
                f,
                "every engine's estimated {} breaks the SLA (best {best_estimate_ms:.1} ms > {sla_ms:.1} ms)",
                match metric {
                    Metric::Ttft => "TTFT",
                    Metric::Itl => "ITL",
                }
            ),
            Reason::Consolidation { worst_share } => write!(
                f,
                "the remaining engines absorb the load within the margin (worst at {:.0}% of it)",
                worst_share * 100.0
            ),
            Reason::ThroughputFloor {
                demand_rps,
                capacity_rps,
            } => write!(
                f,
                "predicted demand {demand_rps:.2} req/s at {capacity_rps:.2} req/s per engine sets a floor"
            ),
            Reason::ThroughputTarget {
                demand_rps,
                capacity_rps,
            } => write!(
                f,
                "predicted demand {demand_rps:.2} req/s at {capacity_rps:.2} req/s per engine"
            ),
            Reason::MinReplicas => write!(f, "below the minimum replicas"),
            Reason::MaxReplicas => write!(f, "above the maximum replicas"),
            Reason::FromZero { waiting } => {
                write!(f, "no worker, and {waiting} requests arrived or wait")
            }
            Reason::Replace { missing } => {
                write!(f, "{missing} fewer workers than decided (lost): replace")
            }
            Reason::Idle { idle_s } => write!(f, "no request for {idle_s:.0} s"),
            Reason::BudgetCut { wanted, budget } => {
                write!(f, "{wanted} wanted, cut to fit the budget of {budget} GPUs")
            }
        }
    }
}

/// One pool's change within a decision.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Change {
    /// The pool.
    pub pool: Pool,
    /// Ready replicas before.
    pub from: u32,
    /// Replicas wanted.
    pub to: u32,
    /// Why.
    pub reason: Reason,
}

/// What the fleet must do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// Provision a new worker in `pool` (it becomes routable after the startup delay).
    Add {
        /// The pool.
        pool: Pool,
    },
    /// Drain worker `worker` of `pool` and remove it when it is idle.
    Remove {
        /// The pool.
        pool: Pool,
        /// The worker's id.
        worker: u64,
    },
}

/// A scaling decision: changes with their reasons, and the actions that carry them out.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScalingDecision {
    /// When, seconds since the start.
    pub at_s: f64,
    /// Per pool, with the reason.
    pub changes: Vec<Change>,
    /// The actions, removals first.
    pub actions: Vec<Action>,
    /// The reasons as text.
    pub text: String,
}

/// Why a tick made no decision although a loop ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Hold {
    /// A previous decision is still taking effect (a worker is starting or draining).
    InProgress,
    /// No performance model is fitted yet.
    NoModel,
}

/// One pool at a tick.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PoolStatus {
    /// The pool.
    pub pool: Pool,
    /// Ready replicas.
    pub ready: u32,
    /// Starting replicas.
    pub starting: u32,
    /// Draining replicas.
    pub draining: u32,
    /// Mean over ready engines of the estimated next TTFT, ms (prefill and agg pools).
    pub est_ttft_ms: Option<f64>,
    /// Mean over ready engines of the estimated next ITL, ms (decode and agg pools).
    pub est_itl_ms: Option<f64>,
}

/// The throughput loop's view at one of its ticks.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ThroughputRecord {
    /// Observed requests per second over the window that just ended.
    pub observed_rps: f64,
    /// What was predicted for that window one tick ago.
    pub predicted_rps: Option<f64>,
    /// Predicted requests per second for the next window.
    pub next_rps: f64,
    /// Predicted mean prompt length.
    pub next_isl: f64,
    /// Predicted mean output length.
    pub next_osl: f64,
    /// Predicted hit rate (clamped; 0 when the discount is off).
    pub next_hit_rate: f64,
    /// Replicas the demand needs, per pool (None without a fitted model).
    pub replicas: Vec<(Pool, Option<u32>)>,
}

/// What one tick produced.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TickRecord {
    /// Seconds since the start.
    pub at_s: f64,
    /// Whether the load loop ran.
    pub load_tick: bool,
    /// Whether the throughput loop ran.
    pub throughput_tick: bool,
    /// Observed requests per second since the previous tick.
    pub observed_rps: f64,
    /// The throughput loop's forecast in force over the same interval (None before its first
    /// tick), to set against `observed_rps`.
    pub predicted_rps: Option<f64>,
    /// Observed mean TTFT, ms.
    pub observed_ttft_ms: Option<f64>,
    /// Observed mean ITL, ms.
    pub observed_itl_ms: Option<f64>,
    /// Observed router-predicted hit rate (raw).
    pub observed_hit_rate: Option<f64>,
    /// The engines' own hit rate over the same interval (cached over prompt tokens of the
    /// completed requests whose usage reported it), beside the prediction.
    pub engine_hit_rate: Option<f64>,
    /// The pools.
    pub pools: Vec<PoolStatus>,
    /// The throughput loop's record, at its ticks.
    pub throughput: Option<ThroughputRecord>,
    /// Why nothing was decided, if a loop ran and nothing was.
    pub hold: Option<Hold>,
    /// Observed over predicted TTFT, smoothed (1 without latency correction or a sample).
    pub ttft_correction: f64,
    /// Observed over predicted ITL, smoothed (1 without latency correction or a sample).
    pub itl_correction: f64,
}

/// A tick's result.
#[derive(Clone, Debug, PartialEq)]
pub struct TickOutput {
    /// The decision, if any.
    pub decision: Option<ScalingDecision>,
    /// What the tick saw and estimated.
    pub record: TickRecord,
}
