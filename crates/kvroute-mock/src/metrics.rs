//! `/metrics`: each rank's engine counters, by vLLM's names, encoded by the `prometheus` crate.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use prometheus::{Encoder, GaugeVec, IntCounterVec, Opts, Registry, TextEncoder};

use crate::handlers::MockWorkerState;

/// Engine counters for `/metrics`, updated after every pass.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) running: u64,
    pub(crate) waiting: u64,
    pub(crate) kv_usage: f64,
    pub(crate) hit_tokens: u64,
    pub(crate) query_tokens: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) generation_tokens: u64,
    pub(crate) finished: u64,
    /// Requests aborted because their client left.
    pub(crate) aborted: u64,
    /// Requests prefilled for a remote decode (vLLM's hop 1, SGLang's prefill side).
    pub(crate) remote_decode_requests: u64,
    /// Imports whose KV landed (vLLM's hop 2, SGLang's decode side).
    pub(crate) imports: u64,
    /// Prompt blocks imports found cached here.
    pub(crate) import_hit_blocks: u64,
    /// Prompt blocks imports moved over the link.
    pub(crate) import_transfer_blocks: u64,
    /// Imports that found too few free blocks and waited.
    pub(crate) import_waits: u64,
}

/// A gauge or a counter of [`Stats`].
enum Value {
    Gauge(fn(&Stats) -> f64),
    Counter(fn(&Stats) -> u64),
}

/// The metrics: name, help, value. vLLM's names where vLLM has the metric.
const METRICS: &[(&str, &str, Value)] = &[
    (
        "vllm:num_requests_running",
        "Requests running on the engine.",
        Value::Gauge(|s| s.running as f64),
    ),
    (
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled.",
        Value::Gauge(|s| s.waiting as f64),
    ),
    (
        "vllm:gpu_cache_usage_perc",
        "KV-cache usage, 1 = full (deprecated name).",
        Value::Gauge(|s| s.kv_usage),
    ),
    (
        "vllm:kv_cache_usage_perc",
        "KV-cache usage, 1 = full.",
        Value::Gauge(|s| s.kv_usage),
    ),
    (
        "vllm:prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        Value::Counter(|s| s.query_tokens),
    ),
    (
        "vllm:prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        Value::Counter(|s| s.hit_tokens),
    ),
    (
        "vllm:prompt_tokens_total",
        "Prompt tokens received.",
        Value::Counter(|s| s.prompt_tokens),
    ),
    (
        "vllm:generation_tokens_total",
        "Tokens generated.",
        Value::Counter(|s| s.generation_tokens),
    ),
    (
        "vllm:request_success_total",
        "Requests finished.",
        Value::Counter(|s| s.finished),
    ),
    (
        "kvroute_mock_requests_aborted_total",
        "Requests aborted because their client disconnected.",
        Value::Counter(|s| s.aborted),
    ),
    (
        "kvroute_mock_remote_decode_requests_total",
        "Requests prefilled for a remote decode (kv_transfer_params.do_remote_decode, or an SGLang bootstrap room on a prefill worker).",
        Value::Counter(|s| s.remote_decode_requests),
    ),
    (
        "kvroute_mock_kv_imports_total",
        "Remote prefills imported: KV landed (kv_transfer_params.do_remote_prefill, or an SGLang bootstrap room).",
        Value::Counter(|s| s.imports),
    ),
    (
        "kvroute_mock_kv_import_hit_blocks_total",
        "Prompt blocks imports found cached locally.",
        Value::Counter(|s| s.import_hit_blocks),
    ),
    (
        "kvroute_mock_kv_import_transfer_blocks_total",
        "Prompt blocks imports moved over the link.",
        Value::Counter(|s| s.import_transfer_blocks),
    ),
    (
        "kvroute_mock_kv_import_waits_total",
        "Imports that waited for free KV blocks.",
        Value::Counter(|s| s.import_waits),
    ),
];

/// The labels of every series: the data-parallel rank (`engine`, as vLLM labels its engines)
/// and the model.
const LABELS: &[&str] = &["engine", "model_name"];

/// A registry holding the ranks' current values.
fn registry(stats: &[Stats], model: &str) -> prometheus::Result<Registry> {
    let registry = Registry::new();
    for (name, help, value) in METRICS {
        let opts = Opts::new(*name, *help);
        match value {
            Value::Gauge(get) => {
                let vec = GaugeVec::new(opts, LABELS)?;
                for (rank, s) in stats.iter().enumerate() {
                    vec.with_label_values(&[&rank.to_string(), model]).set(get(s));
                }
                registry.register(Box::new(vec))?;
            }
            Value::Counter(get) => {
                let vec = IntCounterVec::new(opts, LABELS)?;
                for (rank, s) in stats.iter().enumerate() {
                    vec.with_label_values(&[&rank.to_string(), model]).inc_by(get(s));
                }
                registry.register(Box::new(vec))?;
            }
        }
    }
    Ok(registry)
}

/// `/metrics`: a series per data-parallel rank.
pub(crate) async fn metrics(State(w): State<Arc<MockWorkerState>>) -> Response {
    let stats: Vec<Stats> = w
        .ranks
        .iter()
        .map(|r| *r.stats.lock().unwrap_or_else(|p| p.into_inner()))
        .collect();
    let mut out = Vec::new();
    let encoded =
        registry(&stats, &w.model_name).and_then(|r| TextEncoder::new().encode(&r.gather(), &mut out));
    match encoded {
        Ok(()) => (
            [(header::CONTENT_TYPE, TextEncoder::new().format_type().to_owned())],
            out,
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}
