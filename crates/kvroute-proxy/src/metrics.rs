//! The proxy's Prometheus metrics, under the names operators know from NVIDIA Dynamo's frontend
//! and router (`dynamo_frontend_*`, `dynamo_component_router_*`, `dynamo_router_overhead_*`,
//! `dynamo_component_kv_cache_events_applied`), plus a few `kvroute_*` ones of our own.
//!
//! Per-request metrics are recorded on the request path (atomic adds); per-worker gauges are
//! refreshed from the router's snapshot when `/metrics` is scraped, and the KV-event
//! subscribers' counters ([`KvSubscriberCounters`]) are read from the subscribers when scraped,
//! so they cost nothing between scrapes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use kvroute_core::ids::WorkerKey;
use kvroute_core::router::RouterMetrics;
use kvroute_zmq::{CounterSnapshot, SubscriberCounters};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

/// Every metric the proxy exports.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint, type (`stream` / `unary`) and status.
    pub requests: IntCounterVec,
    /// Requests the router routed.
    pub router_requests: IntCounter,
    /// Time to first token (streaming requests).
    pub ttft: Histogram,
    /// Time between streamed chunks.
    pub itl: Histogram,
    /// Prompt tokens per request.
    pub input_tokens: Histogram,
    /// Predicted KV hit rate (cached prompt blocks on the chosen worker / prompt blocks).
    pub kv_hit_rate: Histogram,
    /// Router overhead: local block hashing at the edge, ms.
    pub overhead_block_hashing: Histogram,
    /// Router overhead: the router core's decision (sequence hashing, index lookup, selection
    /// and booking), ms.
    pub overhead_scheduling: Histogram,
    /// Router overhead: tokenization, hashing and the decision together, ms.
    pub overhead_total: Histogram,
    /// Tokenization (and chat rendering), ms.
    pub overhead_tokenize: Histogram,
    /// Requests waiting in the router's queue.
    pub queue_pending: IntGaugeVec,
    /// KV events applied, by type and status.
    pub kv_events: IntCounterVec,
    /// Per worker: active decode blocks the router books.
    pub worker_decode_blocks: IntGaugeVec,
    /// Per worker: active prefill tokens the router books.
    pub worker_prefill_tokens: IntGaugeVec,
    /// Per worker: requests the router books.
    pub worker_requests: IntGaugeVec,
    /// Per worker: blocks the router's index says it holds.
    pub worker_cached_blocks: IntGaugeVec,
    /// Per worker: 1 when it takes requests (healthy, not draining).
    pub worker_up: IntGaugeVec,
    /// Upstream attempts that failed to connect and were retried on another worker.
    pub upstream_retries: IntCounter,
    /// Requests routed with a prefill worker (the two-hop prefill/decode flow).
    pub disaggregated_requests: IntCounter,
    /// KV-event stream incidents by kind (`gap_lost`, `restarted`, `error`).
    pub kv_stream_incidents: IntCounterVec,
    /// Requests active in the router now.
    pub active_requests: IntGauge,
    /// Blocks the index evicted to keep a worker within `max-blocks-per-worker`.
    pub index_blocks_evicted: IntCounter,
    /// The KV-event subscribers whose counters are exported, per worker.
    pub kv_subscribers: KvSubscriberCounters,
}

/// Reads one counter of a snapshot.
type CounterField = fn(&CounterSnapshot) -> u64;

/// The counters of each worker's KV-event subscriber (`kvroute-zmq`'s [`CounterSnapshot`]) as
/// Prometheus counters with a `worker` label: `(name, help, field)`. Dynamo's name where Dynamo
/// exports the same count (its ZMQ ingress batches), `kvroute_kv_events_*` otherwise.
const SUBSCRIBER_COUNTERS: &[(&str, &str, CounterField)] = &[
    (
        "dynamo_component_router_kv_zmq_ingress_batches_total",
        "KV-event batches handed on to the router (live and replayed), per worker.",
        |c| c.emitted,
    ),
    (
        "kvroute_kv_events_received_total",
        "Live KV-event messages received with well-formed frames, per worker.",
        |c| c.received,
    ),
    (
        "kvroute_kv_events_replayed_total",
        "KV-event batches handed on that came through a replay, per worker.",
        |c| c.replayed,
    ),
    (
        "kvroute_kv_events_duplicates_total",
        "KV-event batches dropped as already handed on, per worker.",
        |c| c.duplicates,
    ),
    (
        "kvroute_kv_events_gaps_detected_total",
        "Gaps in a worker's KV-event sequence numbers.",
        |c| c.gaps_detected,
    ),
    (
        "kvroute_kv_events_gaps_recovered_total",
        "KV-event gaps filled entirely by a replay, per worker.",
        |c| c.gaps_recovered,
    ),
    (
        "kvroute_kv_events_gaps_lost_total",
        "KV-event gaps (or parts of them) reported lost, per worker.",
        |c| c.gaps_lost,
    ),
    (
        "kvroute_kv_events_batches_lost_total",
        "KV-event batches reported lost, per worker.",
        |c| c.batches_lost,
    ),
    (
        "kvroute_kv_events_restarts_total",
        "KV-event publisher restarts seen (sequence number went back), per worker.",
        |c| c.restarts,
    ),
    (
        "kvroute_kv_events_decode_errors_total",
        "KV-event messages that could not be decoded, per worker.",
        |c| c.decode_errors,
    ),
    (
        "kvroute_kv_events_replay_failures_total",
        "KV-event replays that failed (no connection, no answer in time), per worker.",
        |c| c.replay_failures,
    ),
    (
        "kvroute_kv_events_socket_errors_total",
        "Errors of a worker's live KV-event socket.",
        |c| c.socket_errors,
    ),
    (
        "kvroute_kv_events_reconnects_total",
        "Times a worker's KV-event socket lost its publisher and connected again.",
        |c| c.reconnects,
    ),
    (
        "kvroute_kv_events_resyncs_total",
        "Resyncs of a worker's KV events through its replay socket (after a (re)connection, \
         or when it is back from failed health checks).",
        |c| c.resyncs,
    ),
];

/// The running KV-event subscribers' counters by worker, exported from `/metrics`: each scrape
/// reads every subscriber's [`SubscriberCounters`] then, so a worker's series appear while its
/// subscriber runs and go when it stops. A subscriber restarted for the same worker starts
/// from zero again (a counter reset, as Prometheus understands it).
#[derive(Clone, Debug, Default)]
pub struct KvSubscriberCounters {
    subscribers: Arc<Mutex<BTreeMap<WorkerKey, Arc<SubscriberCounters>>>>,
}

impl KvSubscriberCounters {
    /// Exports `counters` as those of `key`'s subscriber (replacing what it had).
    pub fn insert(&self, key: WorkerKey, counters: Arc<SubscriberCounters>) {
        self.lock().insert(key, counters);
    }

    /// Stops exporting `key`'s counters if they are still `counters` (not those of a
    /// subscriber started for it since).
    pub fn remove(&self, key: WorkerKey, counters: &Arc<SubscriberCounters>) {
        let mut subscribers = self.lock();
        if subscribers
            .get(&key)
            .is_some_and(|current| Arc::ptr_eq(current, counters))
        {
            subscribers.remove(&key);
        }
    }

    /// Every exported subscriber's counters now, in worker and rank order.
    pub fn snapshots(&self) -> Vec<(WorkerKey, CounterSnapshot)> {
        self.lock()
            .iter()
            .map(|(worker, counters)| (*worker, counters.snapshot()))
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<WorkerKey, Arc<SubscriberCounters>>> {
        // Every update is one insert or remove: a poisoned map is still whole.
        self.subscribers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The collector of [`SUBSCRIBER_COUNTERS`]: fills one counter family per field from the
/// subscribers when gathered.
#[derive(Debug)]
struct SubscriberCollector {
    subscribers: KvSubscriberCounters,
    /// One per [`SUBSCRIBER_COUNTERS`] entry, in its order; refilled under the lock on each
    /// gather, so that two scrapes at once cannot interleave their resets and adds.
    families: Mutex<Vec<IntCounterVec>>,
    descs: Vec<Desc>,
}

impl SubscriberCollector {
    fn new(subscribers: KvSubscriberCounters) -> Self {
        let families: Vec<IntCounterVec> = SUBSCRIBER_COUNTERS
            .iter()
            .map(|(name, help, _)| {
                IntCounterVec::new(Opts::new(*name, *help), &["worker", "dp_rank"])
                    .expect("static metric options are valid")
            })
            .collect();
        let descs = families
            .iter()
            .flat_map(|family| family.desc().into_iter().cloned())
            .collect();
        Self {
            subscribers,
            families: Mutex::new(families),
            descs,
        }
    }
}

impl Collector for SubscriberCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let snapshots = self.subscribers.snapshots();
        let families = self.families.lock().unwrap_or_else(|p| p.into_inner());
        for (family, &(_, _, field)) in families.iter().zip(SUBSCRIBER_COUNTERS) {
            family.reset();
            for (key, snapshot) in &snapshots {
                family
                    .with_label_values(&[
                        key.worker.0.to_string().as_str(),
                        key.dp_rank.0.to_string().as_str(),
                    ])
                    .inc_by(field(snapshot));
            }
        }
        families.iter().flat_map(Collector::collect).collect()
    }
}

fn hist(name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("static metric options are valid")
}

fn ms_buckets() -> Vec<f64> {
    vec![
        0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0,
    ]
}

fn s_buckets() -> Vec<f64> {
    vec![
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ]
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let registry = Registry::new();
        let worker_labels = &["worker_id", "dp_rank", "worker_type"];
        let gauge = |name: &str, help: &str| {
            IntGaugeVec::new(Opts::new(name, help), worker_labels).expect("static metric options are valid")
        };
        let m = Self {
            requests: IntCounterVec::new(
                Opts::new("dynamo_frontend_requests_total", "Requests by endpoint, type and status."),
                &["endpoint", "request_type", "status"],
            )
            .expect("static metric options are valid"),
            router_requests: IntCounter::new(
                "dynamo_component_router_requests_total",
                "Requests the router routed.",
            )
            .expect("static metric options are valid"),
            ttft: hist(
                "dynamo_component_router_time_to_first_token_seconds",
                "Time to first streamed token, seconds.",
                s_buckets(),
            ),
            itl: hist(
                "dynamo_component_router_inter_token_latency_seconds",
                "Time between streamed chunks, seconds.",
                s_buckets(),
            ),
            input_tokens: hist(
                "dynamo_component_router_input_sequence_tokens",
                "Prompt tokens per request.",
                prometheus::exponential_buckets(16.0, 2.0, 14).expect("static buckets are valid"),
            ),
            kv_hit_rate: hist(
                "dynamo_component_router_kv_hit_rate",
                "Predicted KV hit rate: prompt blocks cached on the chosen worker over prompt blocks.",
                (0..=20).map(|i| f64::from(i) / 20.0).collect(),
            ),
            overhead_block_hashing: hist(
                "dynamo_router_overhead_block_hashing_ms",
                "Local block hashing of the prompt, ms.",
                ms_buckets(),
            ),
            overhead_scheduling: hist(
                "dynamo_router_overhead_scheduling_ms",
                "The router core's decision: sequence hashing, index lookup, selection, booking; ms.",
                ms_buckets(),
            ),
            overhead_total: hist(
                "dynamo_router_overhead_total_ms",
                "Tokenization, hashing and the decision, ms.",
                ms_buckets(),
            ),
            overhead_tokenize: hist(
                "kvroute_router_overhead_tokenize_ms",
                "Chat rendering and tokenization, ms.",
                ms_buckets(),
            ),
            queue_pending: IntGaugeVec::new(
                Opts::new(
                    "dynamo_frontend_router_queue_pending_requests",
                    "Requests waiting in the router's queue.",
                ),
                &["worker_type"],
            )
            .expect("static metric options are valid"),
            kv_events: IntCounterVec::new(
                Opts::new(
                    "dynamo_component_kv_cache_events_applied",
                    "KV events by type and status (ok, parent_block_not_found, block_not_found, invalid_block, skipped).",
                ),
                &["event_type", "status"],
            )
            .expect("static metric options are valid"),
            worker_decode_blocks: gauge(
                "dynamo_frontend_worker_active_decode_blocks",
                "Active decode blocks the router books per worker.",
            ),
            worker_prefill_tokens: gauge(
                "dynamo_frontend_worker_active_prefill_tokens",
                "Active prefill tokens the router books per worker.",
            ),
            worker_requests: gauge("kvroute_worker_active_requests", "Requests the router books per worker."),
            worker_cached_blocks: gauge(
                "kvroute_worker_cached_blocks",
                "Blocks the router's KV index says each worker holds.",
            ),
            worker_up: IntGaugeVec::new(
                Opts::new("kvroute_worker_up", "1 when the worker takes requests (healthy, not draining)."),
                &["worker_id", "url"],
            )
            .expect("static metric options are valid"),
            upstream_retries: IntCounter::new(
                "kvroute_upstream_retries_total",
                "Upstream connect failures retried on another worker.",
            )
            .expect("static metric options are valid"),
            disaggregated_requests: IntCounter::new(
                "kvroute_disaggregated_requests_total",
                "Requests routed with a prefill worker: prefilled there, then decoded on a decode worker.",
            )
            .expect("static metric options are valid"),
            kv_stream_incidents: IntCounterVec::new(
                Opts::new(
                    "kvroute_kv_event_stream_incidents_total",
                    "KV-event stream incidents by kind (gap_recovered, gap_lost, restarted, error).",
                ),
                &["kind"],
            )
            .expect("static metric options are valid"),
            active_requests: IntGauge::new("kvroute_router_active_requests", "Requests booked in the router.")
                .expect("static metric options are valid"),
            index_blocks_evicted: IntCounter::new(
                "kvroute_index_blocks_evicted_total",
                "KV blocks the router's view evicted to keep a worker within max-blocks-per-worker.",
            )
            .expect("static metric options are valid"),
            kv_subscribers: KvSubscriberCounters::default(),
            registry,
        };
        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(m.requests.clone()),
            Box::new(m.router_requests.clone()),
            Box::new(m.ttft.clone()),
            Box::new(m.itl.clone()),
            Box::new(m.input_tokens.clone()),
            Box::new(m.kv_hit_rate.clone()),
            Box::new(m.overhead_block_hashing.clone()),
            Box::new(m.overhead_scheduling.clone()),
            Box::new(m.overhead_total.clone()),
            Box::new(m.overhead_tokenize.clone()),
            Box::new(m.queue_pending.clone()),
            Box::new(m.kv_events.clone()),
            Box::new(m.worker_decode_blocks.clone()),
            Box::new(m.worker_prefill_tokens.clone()),
            Box::new(m.worker_requests.clone()),
            Box::new(m.worker_cached_blocks.clone()),
            Box::new(m.worker_up.clone()),
            Box::new(m.upstream_retries.clone()),
            Box::new(m.disaggregated_requests.clone()),
            Box::new(m.kv_stream_incidents.clone()),
            Box::new(m.active_requests.clone()),
            Box::new(m.index_blocks_evicted.clone()),
            Box::new(SubscriberCollector::new(m.kv_subscribers.clone())),
        ];
        for c in collectors {
            m.registry.register(c).expect("metric names are unique");
        }
        m
    }

    /// Refreshes the gauges from a router snapshot.
    pub fn refresh(&self, snapshot: &RouterMetrics) {
        self.queue_pending
            .with_label_values(&["decode"])
            .set(snapshot.queued_now as i64);
        self.active_requests.set(snapshot.active_now as i64);
        let evicted = snapshot.index.blocks_evicted;
        if evicted > self.index_blocks_evicted.get() {
            self.index_blocks_evicted
                .inc_by(evicted - self.index_blocks_evicted.get());
        }
        for gauge in [
            &self.worker_decode_blocks,
            &self.worker_prefill_tokens,
            &self.worker_requests,
            &self.worker_cached_blocks,
        ] {
            gauge.reset();
        }
        for w in &snapshot.workers {
            let id = w.spec.key.worker.0.to_string();
            let rank = w.spec.key.dp_rank.0.to_string();
            let labels = [id.as_str(), rank.as_str(), w.spec.role.name()];
            let set = |g: &IntGaugeVec, v: u64| {
                g.with_label_values(&labels)
                    .set(i64::try_from(v).unwrap_or(i64::MAX))
            };
            set(&self.worker_decode_blocks, w.load.decode_blocks);
            set(&self.worker_prefill_tokens, w.load.prefill_tokens);
            set(&self.worker_requests, u64::from(w.load.requests));
            set(&self.worker_cached_blocks, w.cached_blocks);
        }
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for well-formed metrics.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_subscriber_counter_is_exported_once() {
        let snapshot = CounterSnapshot {
            received: 1,
            emitted: 2,
            replayed: 3,
            duplicates: 4,
            gaps_detected: 5,
            gaps_recovered: 6,
            gaps_lost: 7,
            batches_lost: 8,
            restarts: 9,
            decode_errors: 10,
            replay_failures: 11,
            socket_errors: 12,
            reconnects: 13,
            resyncs: 14,
        };
        let mut read: Vec<u64> = SUBSCRIBER_COUNTERS
            .iter()
            .map(|(_, _, field)| field(&snapshot))
            .collect();
        read.sort_unstable();
        assert_eq!(read, (1..=14).collect::<Vec<_>>());
    }
}
