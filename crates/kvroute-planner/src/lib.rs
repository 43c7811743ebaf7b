//! The SLA planner: decides how many workers each pool needs, from traffic and forward-pass
//! metrics, aware of KV reuse.
//!
//! Sans-IO like the core: [`Planner::tick`] takes the time and an [`Observation`] (traffic
//! since the previous tick, every provisioned worker with its forward passes and load) and
//! returns a [`TickOutput`]: an optional [`ScalingDecision`] (actions, each pool's change with its
//! typed [`Reason`] and a human text) and a [`TickRecord`] of what the tick saw and estimated.
//! The caller runs the actions: the simulator today, a live fleet later. Nothing here reads a
//! clock, a file or entropy; the same observations give the same decisions.
//!
//! # Loops
//!
//! * **Load** (every `load_interval_s`, default 5 s): step time is regressed on batch features
//!   ([`model`], [`regression`]); each ready engine's next TTFT and ITL are estimated from its
//!   queue and KV; +1 when every engine breaks the SLA, -1 when the engines left, absorbing the
//!   removed one's load, stay within `scale_down_sensitivity` of it (so 2 -> 1 -> 2 does not
//!   happen).
//! * **Throughput** (every `throughput_interval_s`, default 180 s): the next window's request
//!   rate, ISL, OSL and hit rate are predicted ([`predictor`]); one engine's capacity is searched
//!   under the SLA on the fitted model; replicas = ceil(demand / capacity). With the load loop on,
//!   this is a floor for it.
//!
//! # Guards
//!
//! No decision while a worker is starting or draining (a previous decision is taking effect);
//! at least `min_replicas` per scaled pool; the GPU budget is never exceeded: counts over it are
//! cut proportionally ([`fit_budget`]), draining workers keep their GPUs until removed, and adds
//! that would not fit beside them wait for a later tick.
#![forbid(unsafe_code)]

pub mod books;
pub mod config;
mod decision;
mod error;
pub mod model;
pub mod observation;
mod planner;
pub mod predictor;
pub mod regression;

pub use config::{EngineLimits, Mode, ModelSeed, Observe, PlannerConfig, Pool, PredictorConfig, Sla};
pub use decision::{
    Action, Change, Hold, Metric, PoolStatus, Reason, ScalingDecision, ThroughputRecord, TickOutput,
    TickRecord,
};
pub use error::PlannerError;
pub use model::{PassSample, PoolModel, clamp_hit_rate, prefill_work};
pub use observation::{Observation, Traffic, WorkerObservation, WorkerPhase, removal_order, removal_rank};
pub use planner::{Planner, fit_budget};
