//! A simulated inference engine: a vLLM-like worker with a paged KV cache that emits real KV
//! events.
//!
//! The cluster simulator and the live mock workers both drive this one engine. Like the rest of
//! kvroute's core it is sans-IO: time is passed in (instants as
//! [`Timestamp`](kvroute_core::time::Timestamp), spans as [`Duration`](std::time::Duration)),
//! nothing is spawned, and no clock, file, environment or entropy source is read. The same inputs
//! give the same outputs and events, bit for bit.
//!
//! # Driving it
//!
//! [`Engine::add_request`] queues a request (or rejects it at once, with a reason).
//! [`Engine::step`]`(now)` runs one forward pass and returns a [`StepOutput`]: when the pass
//! ends, the tokens each request produced, first tokens, completions, preemptions, the KV events
//! of the step and its metrics. [`Engine::next_wakeup`] says when to step again. A driver loops:
//!
//! ```
//! use kvroute_core::ids::RequestId;
//! use kvroute_core::time::Timestamp;
//! use kvroute_engine::{Engine, EngineConfig, EngineRequest, EnginePrompt, TimingConfig};
//!
//! let config = EngineConfig {
//!     block_size: 4,
//!     num_blocks: 64,
//!     max_num_seqs: 8,
//!     max_num_batched_tokens: 32,
//!     max_model_len: 128,
//!     enable_chunked_prefill: true,
//!     enable_prefix_caching: true,
//!     external_hash_seed: 7,
//!     speedup: 1.0,
//!     timing: TimingConfig::Polynomial,
//!     step_jitter: None,
//!     cpu_offload: None,
//! };
//! let mut engine = Engine::new(config).unwrap();
//! let request = EngineRequest {
//!     id: RequestId(1),
//!     prompt: EnginePrompt::Tokens((0..10).collect()),
//!     output_len: 3,
//!     lora_name: None,
//!     cache_namespace: None,
//!     kv_report: kvroute_engine::KvReportMode::Incremental,
//! };
//! engine.add_request(Timestamp::ZERO, request).unwrap();
//! let mut tokens = 0;
//! while let Some(at) = engine.next_wakeup() {
//!     let out = engine.step(at).unwrap();
//!     tokens += out.emitted.len();
//!     // A driver would publish `out.events` and deliver tokens at `out.end`.
//! }
//! assert_eq!(tokens, 3);
//! // The prompt's two full blocks and one filled by output stay cached after it finished.
//! assert_eq!(engine.cached_blocks().count(), 3);
//! ```
//!
//! # Layout
//!
//! * [`config`]: [`EngineConfig`], validated once.
//! * [`host`]: [`EngineHost`], the engine with its pass in flight and its imports, as every
//!   driver runs it.
//! * [`request`]: requests in, per-request results out.
//! * `sequence`: one request's state and the engine's external block hashes.
//! * `kv_pool`: blocks, reference counts, the free list (eviction order) and the prefix cache.
//! * [`cpu_tier`]: the host-memory tier blocks are offloaded to and loaded back from.
//! * `scheduler`: vLLM v1's scheduling loop.
//! * [`timing`]: the [`TimingModel`] trait and the polynomial, roofline and table models.
//! * [`spec`]: model and GPU descriptions for the roofline model.
//! * [`capacity`]: the KV blocks that fit on a worker's GPUs.
//! * KV events are `kvroute_core::events::KvEvent`, as vLLM emits them.
//! * [`metrics`]: forward-pass composition and per-step load.
//!
//! **Architecture invariant:** after every step, applying the step's events to a router's
//! `RunIndex` leaves it holding exactly [`Engine::cached_blocks`] on the GPU and
//! [`Engine::cpu_blocks`] on the CPU tier. Tests check this after
//! every step of random workloads.
#![forbid(unsafe_code)]

pub mod capacity;
pub mod config;
pub mod cpu_tier;
mod engine;
pub mod host;
mod kv_pool;
mod live;
pub mod metrics;
pub mod noise;
pub mod request;
mod scheduler;
mod sequence;
pub mod spec;
pub mod timing;
pub mod transfer;

pub use config::{ConfigError, EngineConfig};
pub use cpu_tier::CpuOffload;
pub use engine::{DecodeStretch, Engine, Import, ResetError, StepOutput, StretchEnd};
pub use host::{EngineHost, ImportAdmission, ImportStart, StartedImport};
pub use metrics::{ForwardPass, StepMetrics};
pub use noise::{Dispersion, StepJitter};
pub use request::{
    EnginePrompt, EngineRequest, FinishReason, Finished, KvReportMode, RequestError, TokenEmission,
    synthetic_output_token,
};
pub use sequence::{EXTERNAL_ROOT, external_hash};
pub use spec::{GpuSpec, ModelSpec, MoeSpec, SpecError};
pub use timing::{TimingConfig, TimingModel};
pub use transfer::KvTransfer;
