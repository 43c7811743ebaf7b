//! How to run mock workers, and why they may not start.

use std::net::{IpAddr, SocketAddr};

use kvroute_core::router::WorkerRole;
use kvroute_engine::{EngineConfig, KvTransfer};
use kvroute_http::openai::types::CachedTokensReport;
use kvroute_wire::EventEncoding;

/// How to run mock workers.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// How many decode workers (aggregated ones when `prefill_workers` is 0).
    pub workers: usize,
    /// Prefill workers, started before the others (worker `i < prefill_workers` has role
    /// `prefill`; the others then have role `decode`). Default 0: aggregated workers.
    pub prefill_workers: usize,
    /// The prefill-to-decode KV link of imports (its times are divided by the engine's
    /// `speedup`, like the engine's passes). Default [`KvTransfer::default`].
    pub transfer: KvTransfer,
    /// The address they listen on.
    pub host: IpAddr,
    /// The first worker's HTTP port; worker `i` listens on `port + i`. 0 picks free ports.
    pub port: u16,
    /// The first worker's ZMQ event port; worker `i`'s rank `r` publishes on
    /// `event_port + 2·i·dp_size + r` and replays on `dp_size` ports after (with one rank: worker
    /// `i` on `event_port + 2i`, replay on the port after). 0 picks free ports. Ignored without
    /// events.
    pub event_port: u16,
    /// Data-parallel ranks per worker: each an engine of its own behind the worker's one HTTP
    /// port, chosen by vLLM's `X-data-parallel-rank` header or SGLang's `data_parallel_rank`
    /// body field (in turn when a request names none), each publishing its own events on the
    /// rank-0 ports plus its rank (vLLM's layout). Default 1.
    pub dp_size: u32,
    /// Whether to publish KV events.
    pub events: bool,
    /// How events are encoded.
    pub encoding: EventEncoding,
    /// Batches each rank's replay socket can send again (vLLM's `buffer_steps`; asked for an
    /// older one, it starts at the oldest it has, as vLLM does). Default 10,000.
    pub replay_buffer_steps: usize,
    /// The engine of each worker (`speedup` divides modeled times).
    pub engine: EngineConfig,
    /// Output tokens of a request that names no `max_tokens`.
    pub default_max_tokens: u32,
    /// The model name served.
    pub model_name: String,
    /// LoRA adapters loaded at start (vLLM's `--lora-modules`); more can be loaded at run
    /// time. Default none.
    pub lora_modules: Vec<crate::LoraModule>,
    /// Whether usage reports cached prompt tokens (vLLM's `--enable-prompt-tokens-details`).
    /// Default [`CachedTokensReport::Reported`], as a vLLM started with that flag: routing
    /// by cache is what kvroute tests, and this is how an engine says what it found cached.
    pub cached_tokens: CachedTokensReport,
}

impl MockConfig {
    /// `workers` mock workers on free loopback ports, with events (map encoding), a vLLM-like
    /// engine of 16-token blocks and the polynomial timing model.
    pub fn new(workers: usize) -> Self {
        Self {
            workers,
            prefill_workers: 0,
            transfer: KvTransfer::default(),
            host: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            event_port: 0,
            dp_size: 1,
            events: true,
            encoding: EventEncoding::Map,
            replay_buffer_steps: kvroute_zmq::DEFAULT_BUFFER_STEPS,
            engine: Self::default_engine(),
            default_max_tokens: 16,
            model_name: "tiny".to_owned(),
            lora_modules: Vec::new(),
            cached_tokens: CachedTokensReport::Reported,
        }
    }

    /// The role of worker `i` (prefill workers first).
    pub fn role(&self, i: usize) -> WorkerRole {
        match (i < self.prefill_workers, self.prefill_workers > 0) {
            (true, _) => WorkerRole::Prefill,
            (false, true) => WorkerRole::Decode,
            (false, false) => WorkerRole::Aggregated,
        }
    }

    /// Every worker: the prefill workers and the others.
    pub fn total(&self) -> usize {
        self.prefill_workers + self.workers
    }

    /// The default engine: 16-token blocks, 16,384 blocks, 256 sequences, 8,192 tokens per
    /// pass, chunked prefill and prefix caching on, real time.
    pub fn default_engine() -> EngineConfig {
        EngineConfig::default()
    }
}

/// Why mock workers could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MockError {
    /// The engine configuration was refused.
    #[error("engine: {0}")]
    Engine(#[from] kvroute_engine::ConfigError),
    /// A port could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// The event publisher did not start.
    #[error("KV-event publisher: {0}")]
    Events(#[from] kvroute_zmq::ZmqError),
}
