//! What a run reports: an ordered list of named values (key names as in Dynamo's replay report
//! wherever the same quantity exists), per-request records and time series.
//!
//! The report holds only simulated quantities, never the simulator's own wall time, so the same
//! workload, configuration and seed give a byte-identical JSON.

use serde::Serialize;
use serde::ser::SerializeMap;

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
    fn keys(self) -> [&'static str; 9] {
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
    pub fn latency(&mut self, latency: Latency, s: &crate::stats::Summary) {
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
    ("preemptions", "preemptions"),
    ("kv_events_lost", "KV events lost"),
    ("kv_transfers", "KV transfers"),
    ("mean_kv_transfer_ms", "KV transfer mean ms"),
    ("gpu_hours", "GPU-hours"),
    ("planner_mean_workers", "workers mean (planner)"),
    ("planner_decisions", "planner decisions"),
    ("sla_attainment", "SLA windows met"),
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
        // The planner's rows appear only in runs with a planner.
        let planner_row = key.starts_with("planner_") || key.starts_with("sla_");
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
