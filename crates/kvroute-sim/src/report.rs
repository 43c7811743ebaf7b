//! What a run reports: an ordered list of named values (key names as in Dynamo's replay report
//! wherever the same quantity exists), per-request records and time series.
//!
//! The report holds only simulated quantities, never the simulator's own wall time, so the same
//! workload, configuration and seed give a byte-identical JSON.

use serde::Serialize;
use serde::ser::SerializeMap;

use crate::stats::Summary;

/// One value of a report.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A count.
    Count(u64),
    /// A measurement.
    Float(f64),
    /// A name.
    Text(String),
    /// A structured record (the planner's decisions, ticks and windows).
    Json(serde_json::Value),
}

impl Serialize for Value {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Count(v) => s.serialize_u64(*v),
            Value::Float(v) => s.serialize_f64(*v),
            Value::Text(v) => s.serialize_str(v),
            Value::Json(v) => v.serialize(s),
        }
    }
}

/// A run's summary: named values in a fixed order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    entries: Vec<(&'static str, Value)>,
}

impl Serialize for Report {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.entries.len()))?;
        for (k, v) in &self.entries {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// A latency whose summary a report carries under Dynamo's key names (`mean_ttft_ms`,
/// `median_ttft_ms`, `p99_ttft_ms`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Latency {
    /// Time to first token.
    Ttft,
    /// Inter-token latency.
    Itl,
    /// Time per output token after the first.
    Tpot,
    /// Arrival to last token.
    E2e,
}

macro_rules! latency_keys {
    ($m:literal) => {
        [
            concat!("mean_", $m, "_ms"),
            concat!("min_", $m, "_ms"),
            concat!("max_", $m, "_ms"),
            concat!("median_", $m, "_ms"),
            concat!("p75_", $m, "_ms"),
            concat!("p90_", $m, "_ms"),
            concat!("p95_", $m, "_ms"),
            concat!("p99_", $m, "_ms"),
            concat!("std_", $m, "_ms"),
        ]
    };
}

impl Latency {
    /// Its report keys: mean, min, max, median, p75, p90, p95, p99, std.
    pub fn keys(self) -> [&'static str; 9] {
        match self {
            Latency::Ttft => latency_keys!("ttft"),
            Latency::Itl => latency_keys!("itl"),
            Latency::Tpot => latency_keys!("tpot"),
            Latency::E2e => latency_keys!("e2e_latency"),
        }
    }
}

impl Report {
    /// Appends a value. Keys are the report's vocabulary (Dynamo's names): drivers other than
    /// the simulator (the live demo) fill the same keys so that [`table`] reads them alike.
    pub fn push(&mut self, key: &'static str, value: Value) {
        self.entries.push((key, value));
    }

    /// Appends a count.
    pub fn count(&mut self, key: &'static str, v: u64) {
        self.push(key, Value::Count(v));
    }

    /// Appends a measurement (not-finite values become 0).
    pub fn float(&mut self, key: &'static str, v: f64) {
        self.push(key, Value::Float(if v.is_finite() { v } else { 0.0 }));
    }

    /// Appends a latency summary (milliseconds) under its nine keys.
    pub fn latency(&mut self, latency: Latency, s: &Summary) {
        let values = [s.mean, s.min, s.max, s.p50, s.p75, s.p90, s.p95, s.p99, s.std];
        for (k, v) in latency.keys().into_iter().zip(values) {
            self.float(k, v);
        }
    }

    /// The entries, in order.
    pub fn entries(&self) -> &[(&'static str, Value)] {
        &self.entries
    }

    /// The value named `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// The value named `key` as a float (counts converted).
    pub fn number(&self, key: &str) -> Option<f64> {
        match self.get(key)? {
            Value::Count(v) => Some(*v as f64),
            Value::Float(v) => Some(*v),
            Value::Text(_) | Value::Json(_) => None,
        }
    }
}

/// One completed request: times in nanoseconds from the run's start, and its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompletedRequest {
    /// Arrival.
    pub arrival_ns: u64,
    /// First output token, if one was seen.
    pub first_token_ns: Option<u64>,
    /// Last output token, as the client receives it (with HTTP latency, with the completion).
    pub last_token_ns: u64,
    /// End of the request.
    pub finished_ns: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
}

/// The simulated engines' and router's counts, which a live run does not see.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineCounts {
    /// Requests preempted by their engine.
    pub preemptions: u64,
    /// Requests that waited in the router's queue.
    pub router_queued: u64,
    /// Requests whose wait in the router's queue expired.
    pub router_expired: u64,
    /// KV events the engines published.
    pub kv_events_published: u64,
    /// KV events the router's index refused.
    pub kv_events_refused: u64,
    /// Engine forward passes.
    pub engine_steps: u64,
    /// Worker-seconds the engines spent computing.
    pub busy_worker_seconds: f64,
}

/// A disaggregated fleet's pools and KV transfers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Disaggregation {
    /// Prefill workers.
    pub prefill_workers: u64,
    /// Decode workers.
    pub decode_workers: u64,
    /// Worker-seconds the prefill workers spent computing.
    pub prefill_busy_worker_seconds: f64,
    /// Requests the router split into a prefill and a decode.
    pub disaggregated_requests: u64,
    /// KV transfers.
    pub kv_transfers: u64,
    /// Blocks they covered.
    pub kv_transfer_blocks: u64,
    /// Of those, blocks the decode worker already held.
    pub kv_transfer_hit_blocks: u64,
    /// Bytes moved.
    pub kv_transfer_bytes: u64,
    /// Time on the link, summed.
    pub kv_transfer_nanos: u64,
    /// Imports that waited for free blocks.
    pub kv_import_waits: u64,
    /// Their waits, summed.
    pub kv_import_wait_nanos: u64,
}

/// Every report formula in one place. A driver (the simulator, the live demo) sets what it
/// counted and adds each completed request; [`ReportBuilder::build`] writes the report's keys in
/// their order, leaving out the figures the driver does not have.
#[derive(Clone, Debug, Default)]
pub struct ReportBuilder {
    /// The policy's name.
    pub policy: String,
    /// Workers in the fleet (both pools).
    pub num_workers: u64,
    /// GPUs per worker, for GPU-hours.
    pub gpus_per_worker: u32,
    /// Requests of the workload.
    pub num_requests: u64,
    /// Requests that arrived (the simulator's; a live run sends them all).
    pub arrived: Option<u64>,
    /// Requests turned away.
    pub rejected: u64,
    /// Requests the run ended before (the simulator's).
    pub unfinished: Option<u64>,
    /// Inter-token latency, ms.
    pub itl: Summary,
    /// Prompt tokens the engines found cached, and prompt tokens they looked up.
    pub prefix_cache_tokens: (u64, u64),
    /// Prompt blocks the router believed cached on its choice, and prompt blocks routed.
    pub router_overlap_blocks: (u64, u64),
    /// Mean over routed requests of the router's predicted hit rate (the simulator's).
    pub router_mean_kv_hit_rate: Option<f64>,
    /// The simulated engines' counts.
    pub engine: Option<EngineCounts>,
    /// KV events lost on their way to the router.
    pub kv_events_lost: u64,
    /// Worker-seconds when workers came and went (a planner's run); else workers × duration.
    pub worker_seconds: Option<f64>,
    /// The pools, in a disaggregated fleet.
    pub disaggregation: Option<Disaggregation>,
    completed: u64,
    input_tokens: u64,
    output_tokens: u64,
    end_ns: u64,
    ttft_ms: Vec<f64>,
    e2e_ms: Vec<f64>,
    tpot_ms: Vec<f64>,
}

/// Milliseconds from `from` to `to`, nanoseconds.
pub fn ms_between(from: u64, to: u64) -> f64 {
    (to - from) as f64 / 1e6
}

/// A request's time per output token after the first, ms: from its first token to its last (as
/// its client receives them, nanoseconds), over the tokens after the first. `None` with fewer
/// than two tokens.
pub fn tpot_ms(first_ns: u64, last_ns: u64, output_tokens: u64) -> Option<f64> {
    (output_tokens > 1).then(|| ms_between(first_ns, last_ns) / (output_tokens - 1) as f64)
}

impl ReportBuilder {
    /// A builder for a run of `policy` on `num_workers` workers of `gpus_per_worker` GPUs, with
    /// `num_requests` requests; nothing counted yet.
    pub fn new(policy: &str, num_workers: u64, gpus_per_worker: u32, num_requests: u64) -> Self {
        Self {
            policy: policy.to_owned(),
            num_workers,
            gpus_per_worker,
            num_requests,
            ..Self::default()
        }
    }

    /// Adds a completed request.
    pub fn complete(&mut self, c: &CompletedRequest) {
        self.completed += 1;
        self.input_tokens += c.input_tokens;
        self.output_tokens += c.output_tokens;
        self.end_ns = self.end_ns.max(c.finished_ns);
        self.e2e_ms.push(ms_between(c.arrival_ns, c.finished_ns));
        if let Some(first) = c.first_token_ns {
            self.ttft_ms.push(ms_between(c.arrival_ns, first));
            if let Some(tpot) = tpot_ms(first, c.last_token_ns, c.output_tokens) {
                self.tpot_ms.push(tpot);
            }
        }
    }

    /// The last completion, nanoseconds from the start.
    pub fn end_ns(&self) -> u64 {
        self.end_ns
    }

    /// Seconds from the start to the last completion.
    pub fn duration_s(&self) -> f64 {
        self.end_ns as f64 / 1e9
    }

    /// Worker-seconds: as set, or every worker for the whole duration.
    pub fn worker_seconds(&self) -> f64 {
        self.worker_seconds
            .unwrap_or(self.num_workers as f64 * self.duration_s())
    }

    /// TTFT of each completed request, ms, in the order added.
    pub fn ttft_ms(&self) -> &[f64] {
        &self.ttft_ms
    }

    /// E2E latency of each completed request, ms, in the order added.
    pub fn e2e_ms(&self) -> &[f64] {
        &self.e2e_ms
    }

    /// The report.
    pub fn build(&self) -> Report {
        let duration_s = self.duration_s();
        let per_s = |x: f64| if duration_s > 0.0 { x / duration_s } else { 0.0 };
        let ratio = |(a, b): (u64, u64)| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let (input, output) = (self.input_tokens, self.output_tokens);
        let mut r = Report::default();
        r.push("policy", Value::Text(self.policy.clone()));
        r.count("num_workers", self.num_workers);
        r.count("num_requests", self.num_requests);
        if let Some(arrived) = self.arrived {
            r.count("arrived_requests", arrived);
        }
        r.count("completed_requests", self.completed);
        r.count("rejected_requests", self.rejected);
        if let Some(unfinished) = self.unfinished {
            r.count("unfinished_requests", unfinished);
        }
        r.count("total_input_tokens", input);
        r.count("total_output_tokens", output);
        r.float("duration_ms", self.end_ns as f64 / 1e6);
        r.float("request_throughput_rps", per_s(self.completed as f64));
        r.float("input_throughput_tok_s", per_s(input as f64));
        r.float("output_throughput_tok_s", per_s(output as f64));
        r.float("total_throughput_tok_s", per_s((input + output) as f64));
        r.latency(Latency::Ttft, &Summary::exact(&mut self.ttft_ms.clone()));
        r.latency(Latency::Itl, &self.itl);
        r.latency(Latency::Tpot, &Summary::exact(&mut self.tpot_ms.clone()));
        r.latency(Latency::E2e, &Summary::exact(&mut self.e2e_ms.clone()));
        r.float("prefix_cache_reused_ratio", ratio(self.prefix_cache_tokens));
        r.float(
            "router_predicted_overlap_ratio",
            ratio(self.router_overlap_blocks),
        );
        if let Some(rate) = self.router_mean_kv_hit_rate {
            r.float("router_mean_kv_hit_rate", rate);
        }
        let worker_seconds = self.worker_seconds();
        if let Some(e) = &self.engine {
            r.count("preemptions", e.preemptions);
            r.count("router_queued_requests", e.router_queued);
            r.count("router_expired_requests", e.router_expired);
            r.count("kv_events_published", e.kv_events_published);
            r.count("kv_events_lost", self.kv_events_lost);
            r.count("kv_events_refused", e.kv_events_refused);
            r.count("engine_steps", e.engine_steps);
            r.float("worker_seconds", worker_seconds);
            r.float("busy_worker_seconds", e.busy_worker_seconds);
        } else {
            r.count("kv_events_lost", self.kv_events_lost);
            r.float("worker_seconds", worker_seconds);
        }
        if let Some(d) = &self.disaggregation {
            let busy = self.engine.map_or(0.0, |e| e.busy_worker_seconds);
            r.count("num_prefill_workers", d.prefill_workers);
            r.count("num_decode_workers", d.decode_workers);
            r.float("prefill_worker_seconds", d.prefill_workers as f64 * duration_s);
            r.float("decode_worker_seconds", d.decode_workers as f64 * duration_s);
            r.float("prefill_busy_worker_seconds", d.prefill_busy_worker_seconds);
            r.float("decode_busy_worker_seconds", busy - d.prefill_busy_worker_seconds);
            r.count("disaggregated_requests", d.disaggregated_requests);
            r.count("kv_transfers", d.kv_transfers);
            r.count("kv_transfer_blocks", d.kv_transfer_blocks);
            r.count("kv_transfer_hit_blocks", d.kv_transfer_hit_blocks);
            r.count("kv_transfer_bytes", d.kv_transfer_bytes);
            r.float("kv_transfer_seconds", d.kv_transfer_nanos as f64 / 1e9);
            r.float(
                "mean_kv_transfer_ms",
                ratio((d.kv_transfer_nanos, d.kv_transfers)) / 1e6,
            );
            r.count("kv_import_waits", d.kv_import_waits);
            r.float("kv_import_wait_seconds", d.kv_import_wait_nanos as f64 / 1e9);
        }
        r.float(
            "gpu_hours",
            worker_seconds * f64::from(self.gpus_per_worker) / 3600.0,
        );
        r
    }
}

/// The rows of the text table: report key and label.
const TABLE_ROWS: &[(&str, &str)] = &[
    ("completed_requests", "completed"),
    ("rejected_requests", "rejected"),
    ("duration_ms", "duration s"),
    ("request_throughput_rps", "requests/s"),
    ("output_throughput_tok_s", "output tok/s"),
    ("mean_ttft_ms", "TTFT mean ms"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p90_ttft_ms", "TTFT p90 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("mean_itl_ms", "ITL mean ms"),
    ("p99_itl_ms", "ITL p99 ms"),
    ("mean_tpot_ms", "TPOT mean ms"),
    ("median_e2e_latency_ms", "E2E p50 ms"),
    ("p99_e2e_latency_ms", "E2E p99 ms"),
    ("prefix_cache_reused_ratio", "prefix reuse (engine)"),
    ("router_predicted_overlap_ratio", "predicted overlap (router)"),
    ("load_imbalance", "load imbalance (max/mean)"),
    ("router_replicas", "router replicas"),
    ("sync_events_lost", "sync events lost"),
    ("preemptions", "preemptions"),
    ("kv_events_lost", "KV events lost"),
    ("kv_transfers", "KV transfers"),
    ("mean_kv_transfer_ms", "KV transfer mean ms"),
    ("gpu_hours", "GPU-hours"),
    ("planner_mean_workers", "workers mean (planner)"),
    ("planner_decisions", "planner decisions"),
    ("sla_attainment", "SLA windows met"),
    ("slo_met", "SLO met"),
];

/// A text table with one column per named report, side by side.
pub fn table(reports: &[(String, Report)]) -> String {
    let label_width = TABLE_ROWS.iter().map(|(_, l)| l.len()).max().unwrap_or(0);
    let widths: Vec<usize> = reports.iter().map(|(n, _)| n.len().max(12)).collect();
    let mut out = format!("{:label_width$}", "");
    for ((name, _), w) in reports.iter().zip(&widths) {
        out.push_str(&format!("  {name:>w$}"));
    }
    out.push('\n');
    for (key, label) in TABLE_ROWS {
        // The planner's and the sync rows appear only in runs that have them.
        let planner_row = key.starts_with("planner_")
            || key.starts_with("sla_")
            || key.starts_with("slo_")
            || key.starts_with("sync_");
        if planner_row && reports.iter().all(|(_, r)| r.get(key).is_none()) {
            continue;
        }
        out.push_str(&format!("{label:label_width$}"));
        for ((_, report), w) in reports.iter().zip(&widths) {
            let cell = match (report.get(key), *key) {
                (Some(Value::Float(v)), "duration_ms") => format!("{:.1}", v / 1000.0),
                (Some(Value::Float(v)), _) if v.abs() < 10.0 => format!("{v:.3}"),
                (Some(Value::Float(v)), _) => format!("{v:.1}"),
                (Some(Value::Count(v)), _) => v.to_string(),
                (Some(Value::Text(t)), _) => t.clone(),
                (Some(Value::Json(_)), _) => "...".to_owned(),
                (None, _) => "-".to_owned(),
            };
            out.push_str(&format!("  {cell:>w$}"));
        }
        out.push('\n');
    }
    out
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It produced its whole output.
    Completed,
    /// The router or its engine turned it away.
    Rejected,
    /// The run ended first.
    Unfinished,
}

/// One request's record (`--per-request-jsonl`), times in milliseconds from the run's start.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestRecord {
    /// Index in the workload.
    pub id: u64,
    /// What happened.
    pub outcome: Outcome,
    /// Arrival.
    pub arrival_ms: f64,
    /// When the router routed it (after any wait in its queue).
    pub routed_ms: Option<f64>,
    /// The worker it ran on.
    pub worker: Option<u64>,
    /// Prompt tokens.
    pub input_tokens: u32,
    /// Output tokens produced.
    pub output_tokens: u32,
    /// Full prompt blocks.
    pub prompt_blocks: u32,
    /// Blocks the router believed cached on the chosen worker.
    pub predicted_overlap_blocks: u32,
    /// Time to first token.
    pub ttft_ms: Option<f64>,
    /// Arrival to last token.
    pub e2e_latency_ms: Option<f64>,
    /// Prompt tokens its engine found cached when it first scheduled it (vLLM's
    /// `cached_tokens`).
    pub cached_tokens: Option<u32>,
    /// Waiting in the router's queue: arrival to routing.
    pub router_queue_ms: Option<f64>,
    /// Waiting in its engine: routing to the start of the pass that first scheduled it.
    pub engine_queue_ms: Option<f64>,
    /// Both waits: arrival to first scheduling.
    pub queue_ms: Option<f64>,
}

/// Samples at a fixed interval of simulated time, for plots.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TimeSeries {
    /// Sample times.
    pub time_s: Vec<f64>,
    /// Per worker: requests in the engine (running and waiting).
    pub worker_requests: Vec<Vec<u32>>,
    /// Per worker: share of KV blocks in use.
    pub worker_kv_use: Vec<Vec<f32>>,
    /// Engine prefix-cache hit rate of the admissions since the previous sample (tokens).
    pub hit_rate: Vec<f64>,
    /// Requests waiting: in the router's queue plus in the engines' waiting queues.
    pub queued: Vec<u32>,
}
