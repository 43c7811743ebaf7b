//! One simulated worker: its engine in an [`EngineHost`], its life under a planner and its
//! in-flight count.

use kvroute_core::ids::{DpRank, RequestId, WorkerId, WorkerKey};
use kvroute_core::router::{WorkerRole, WorkerSpec};
use kvroute_core::time::Timestamp;
use kvroute_engine::{DecodeStretch, Engine, EngineHost, EnginePrompt, EngineRequest, StepJitter};
use kvroute_planner::{PassSample, Pool};

use crate::config::{JITTER_SALT, SimConfig, WorkerSpeed};
use crate::error::SimError;

/// A worker's life under a planner (always `Ready` without one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Life {
    Starting,
    Ready,
    Draining,
    Removed,
}

/// One simulated worker.
#[derive(Debug)]
pub(crate) struct SimWorker {
    pub(super) key: WorkerKey,
    pub(crate) role: WorkerRole,
    /// Its engine, with the pass in flight and the imports (waiting, or on the link).
    pub(super) host: EngineHost,
    /// Whether a `Step` event is pending.
    pub(super) scheduled: bool,
    /// KV use after the last pass.
    pub(super) kv_use: f32,
    /// Generation of the worker's valid `Step` event; a cut stretch leaves a stale one behind.
    pub(super) generation: u32,
    /// The start of the decode-only passes being skipped, if any ...
    pub(super) stretch_start: Option<Timestamp>,
    /// ... their end times ...
    pub(super) stretch_ends: Vec<Timestamp>,
    /// ... and their plan: the passes that allocate or complete blocks.
    pub(super) stretch: DecodeStretch,
    /// Its life under a planner.
    pub(crate) life: Life,
    pub(crate) provisioned_at: Timestamp,
    pub(crate) ready_at: Option<Timestamp>,
    pub(crate) draining_at: Option<Timestamp>,
    pub(crate) removed_at: Option<Timestamp>,
    /// Passes since the planner's last tick (only with a planner).
    pub(super) passes: Vec<PassSample>,
    /// Prompt tokens of requests sent here that have no first token yet.
    pub(super) queued_prefill_tokens: u64,
    /// Requests routed here (to decode) and not finished or turned away ...
    pub(super) in_flight: u32,
    /// ... since this time ...
    pub(super) in_flight_since: Timestamp,
    /// ... and their integral over time, request-nanoseconds (the load-imbalance figure).
    pub(crate) in_flight_area: u128,
}

impl SimWorker {
    /// Worker `i` of `role` with its engine, provisioned at `now`.
    pub(super) fn new(
        config: &SimConfig,
        i: usize,
        role: WorkerRole,
        now: Timestamp,
    ) -> Result<Self, SimError> {
        let noise = &config.noise;
        let engine = Engine::new(kvroute_engine::EngineConfig {
            external_hash_seed: config.engine.external_hash_seed.wrapping_add(i as u64),
            speedup: match noise.worker_speed {
                WorkerSpeed::Same => config.engine.speedup,
                ref speed => config.engine.speedup * speed.factor(config.seed, i),
            },
            step_jitter: match noise.step_jitter {
                None => config.engine.step_jitter,
                Some(dispersion) => Some(StepJitter {
                    dispersion,
                    seed: kvroute_engine::noise::mix(config.seed ^ JITTER_SALT, i as u64),
                }),
            },
            ..config.engine.clone()
        })?;
        Ok(Self {
            key: WorkerKey::new(WorkerId(i as u64), DpRank(0)),
            role,
            host: EngineHost::new(engine, config.transfer),
            scheduled: false,
            kv_use: 0.0,
            generation: 0,
            stretch_start: None,
            stretch_ends: Vec::new(),
            stretch: DecodeStretch::default(),
            life: Life::Ready,
            provisioned_at: now,
            ready_at: Some(now),
            draining_at: None,
            removed_at: None,
            passes: Vec::new(),
            queued_prefill_tokens: 0,
            in_flight: 0,
            in_flight_since: now,
            in_flight_area: 0,
        })
    }

    /// The router's description of this worker.
    pub(super) fn spec(&self, config: &SimConfig) -> WorkerSpec {
        let mut spec = WorkerSpec::new(self.key, self.role, u64::from(config.engine.num_blocks));
        spec.max_batched_tokens = u64::from(config.engine.max_num_batched_tokens);
        spec.max_requests = u64::from(config.engine.max_num_seqs);
        spec
    }

    /// Adds `delta` (+1 or -1) to the requests in flight here at `now`.
    pub(super) fn count_in_flight(&mut self, now: Timestamp, delta: i32) {
        let span = u128::from(now.as_nanos().saturating_sub(self.in_flight_since.as_nanos()));
        self.in_flight_area += span * u128::from(self.in_flight);
        self.in_flight_since = now;
        self.in_flight = self.in_flight.saturating_add_signed(delta);
    }

    /// Closes the in-flight integral at `end`.
    pub(crate) fn close_in_flight(&mut self, end: Timestamp) {
        self.count_in_flight(end, 0);
    }

    /// The planner's pool of this worker.
    pub(crate) fn pool(&self) -> Pool {
        match self.role {
            WorkerRole::Prefill => Pool::Prefill,
            WorkerRole::Decode => Pool::Decode,
            _ => Pool::Agg,
        }
    }
}

/// The share of blocks in use, from `(active, total)`.
pub(super) fn kv_use((active, total): (u32, u32)) -> f32 {
    if total == 0 {
        0.0
    } else {
        active as f32 / total as f32
    }
}

/// Workload request `r` as engine request `id`, with its whole output.
pub(super) fn engine_request(id: RequestId, r: &crate::workload::SimRequest) -> EngineRequest {
    EngineRequest {
        id,
        prompt: EnginePrompt::Blocks {
            hashes: r.locals.to_vec(),
            len: r.prompt_tokens,
        },
        output_len: r.output_tokens,
        lora_name: None,
        cache_namespace: None,
        kv_report: kvroute_engine::KvReportMode::Incremental,
    }
}
