//! The proxy's Prometheus metrics, under the names operators know from NVIDIA Dynamo's frontend
//! and router (`dynamo_frontend_*`, `dynamo_component_router_*`, `dynamo_router_overhead_*`,
//! `dynamo_component_kv_cache_events_applied`), plus a few `kvroute_*` ones of our own.
//!
//! Per-request metrics are recorded on the request path (atomic adds); per-worker gauges are
//! refreshed from the router's snapshot when `/metrics` is scraped, and the KV-event
//! subscribers' counters ([`KvSubscriberCounters`]) are read from the subscribers when scraped,
//! so they cost nothing between scrapes.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
use kvroute_core::router::RouterMetrics;
use kvroute_http::openai::Endpoint;
use kvroute_zmq::{CounterSnapshot, SubscriberCounters};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

pub use crate::outcome::{CachedReport, RequestKind, RequestOutcome};

/// Every metric the proxy exports.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint, type (`stream` / `unary`) and status (`success`, `error`,
    /// `rejected`), counted when the request ends: a stream that breaks off is an error.
    pub requests: IntCounterVec,
    /// Requests by endpoint, type and [`RequestOutcome`], counted when the request ends.
    pub outcomes: IntCounterVec,
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
    /// `kvroute_router_queue_empty_fleet`: of those, requests waiting for want of any worker
    /// (`when-empty = queue` with no worker in routing).
    pub queue_empty_fleet: IntGauge,
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
    /// Per worker: 1 when it takes requests (healthy, not draining, not misconfigured).
    pub worker_up: IntGaugeVec,
    /// Per worker and check: 1 while that registration check finds it misconfigured.
    pub worker_misconfigured: IntGaugeVec,
    /// Per worker rank: prompt tokens predicted cached at routing (the router's overlap on
    /// the chosen worker, in tokens, within the engine's hit ceiling).
    pub predicted_cached_tokens: IntCounterVec,
    /// Per worker rank: prompt tokens the engine reported cached
    /// (`usage.prompt_tokens_details.cached_tokens`).
    pub reported_cached_tokens: IntCounterVec,
    /// Per worker rank: completed responses by what their usage said of cached tokens
    /// ([`CachedReport`]).
    pub cached_token_reports: IntCounterVec,
    /// Upstream attempts that failed to connect and were retried on another worker.
    pub upstream_retries: IntCounter,
    /// Requests routed with a prefill worker (the two-hop prefill/decode flow).
    pub disaggregated_requests: IntCounter,
    /// KV-event stream incidents by kind (`gap_lost`, `restarted`, `error`).
    pub kv_stream_incidents: IntCounterVec,
    /// Requests active in the router now.
    pub active_requests: IntGauge,
    /// `kvroute_router_session_requests_total`: this replica's requests of a session, by
    /// outcome (`new`: it bound the session, `hit`: it stayed on the session's worker, `moved`:
    /// it moved the session, its worker overloaded or out of routing).
    pub session_requests: IntCounterVec,
    /// `kvroute_router_sessions_released_total`: sessions forgotten, by cause (`worker`: their
    /// worker removed or out of routing, `idle`, `evicted` past `max-sessions`).
    pub sessions_released: IntCounterVec,
    /// `kvroute_router_sessions`: sessions bound now.
    pub sessions: IntGauge,
    /// Blocks the index evicted to keep a worker within `max-blocks-per-worker`.
    pub index_blocks_evicted: IntCounter,
    /// `kvroute_index_blocks_stored_total`: blocks newly held by the router's view (a store of
    /// a block already held, as an engine's re-announcement of its reused blocks, adds none).
    pub index_blocks_stored: IntCounter,
    /// Per discovery source (`dns`, `file`): the workers it added that are in the fleet.
    pub discovery_workers: IntGaugeVec,
    /// Per discovery source: answers refused (a failed resolution or read, an empty or bad
    /// answer) and workers it found that were refused.
    pub discovery_errors: IntCounterVec,
    /// The KV-event subscribers whose counters are exported, per worker.
    pub kv_subscribers: KvSubscriberCounters,
    /// `kvroute_planner_desired_workers{pool}`: the workers the planner wants per pool (what
    /// an outside autoscaler, KEDA or an HPA, scales on).
    pub planner_desired_workers: IntGaugeVec,
    /// `kvroute_planner_worker_exits_total{pool,cause}`: worker processes the process actuator
    /// started that ended, by cause (`released`, `exited`, `not_ready`).
    pub planner_worker_exits: IntCounterVec,
    /// `kvroute_worker_removal_rank{worker}`: the worker's place in the removal order (0:
    /// removed first), refreshed when `/metrics` is scraped.
    pub worker_removal_rank: IntGaugeVec,
    /// `kvroute_worker_removal_cost{worker}`: the order as a deletion cost, for Kubernetes'
    /// `controller.kubernetes.io/pod-deletion-cost` (a lower cost is removed first, so it
    /// equals the rank).
    pub worker_removal_cost: IntGaugeVec,
    /// The request path's counters, found once rather than by label on every request.
    handles: Handles,
}

/// The counters a request adds to, found once: looking a series up by its labels (formatting
/// a worker's id and rank, hashing the labels, a lock) cost about 1,400 instructions a request
/// (BENCHMARKS.md, "Proxy: CPU per request in instructions"). The counts and the series exported are
/// the same as by label.
#[derive(Clone, Debug)]
struct Handles {
    /// `[outcomes, requests]` by endpoint, kind and outcome ([`outcome_slot`]), each found when
    /// first counted: a series still appears only once something is counted in it.
    outcomes: Arc<[OnceLock<[IntCounter; 2]>; OUTCOME_SLOTS]>,
    /// Each added worker rank's series, found when [`Metrics::add_worker`] makes them and
    /// forgotten when [`Metrics::remove_worker`] removes them (under this lock, so no count
    /// falls between the two). A rank not here (a response that ends after its worker was
    /// removed) counts by label, as before.
    ranks: Arc<Mutex<HashMap<WorkerKey, RankSeries>>>,
}

/// One worker rank's per-request series.
#[derive(Clone, Debug)]
struct RankSeries {
    predicted: IntCounter,
    reported: IntCounter,
    /// `cached_token_reports` by [`CachedReport::slot`].
    reports: [IntCounter; 3],
}

/// Endpoints × request kinds × outcomes.
const OUTCOME_SLOTS: usize = 2 * 2 * RequestOutcome::ALL.len();

/// Where [`Handles::outcomes`] keeps the counters of `(endpoint, kind, outcome)`.
fn outcome_slot(endpoint: Endpoint, kind: RequestKind, outcome: RequestOutcome) -> usize {
    let endpoint = match endpoint {
        Endpoint::Completions => 0,
        Endpoint::Chat => 1,
    };
    let kind = match kind {
        RequestKind::Unary => 0,
        RequestKind::Stream => 1,
    };
    let outcome = RequestOutcome::ALL
        .iter()
        .position(|o| *o == outcome)
        .unwrap_or(0);
    (endpoint * 2 + kind) * RequestOutcome::ALL.len() + outcome
}

impl Handles {
    fn new() -> Self {
        Self {
            outcomes: Arc::new(std::array::from_fn(|_| OnceLock::new())),
            ranks: Arc::default(),
        }
    }

    fn ranks(&self) -> MutexGuard<'_, HashMap<WorkerKey, RankSeries>> {
        self.ranks.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The labels of a per-rank series: worker id and data-parallel rank.
fn rank_labels(key: WorkerKey) -> [String; 2] {
    [key.worker.0.to_string(), key.dp_rank.0.to_string()]
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

/// Makes each metric and registers it at once, so that none is made and left out.
struct Registrar(Registry);

impl Registrar {
    fn add<C: Collector + Clone + 'static>(&self, collector: C) -> C {
        self.0
            .register(Box::new(collector.clone()))
            .expect("metric names are unique");
        collector
    }

    fn add_boxed(&self, collector: impl Collector + 'static) {
        self.0
            .register(Box::new(collector))
            .expect("metric names are unique");
    }

    fn counter(&self, name: &str, help: &str) -> IntCounter {
        self.add(IntCounter::new(name, help).expect("static metric options are valid"))
    }

    fn counters(&self, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
        self.add(IntCounterVec::new(Opts::new(name, help), labels).expect("static metric options are valid"))
    }

    fn gauge(&self, name: &str, help: &str) -> IntGauge {
        self.add(IntGauge::new(name, help).expect("static metric options are valid"))
    }

    fn gauges(&self, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels).expect("static metric options are valid"))
    }

    fn hist(&self, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
        self.add(
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
                .expect("static metric options are valid"),
        )
    }
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

/// The labels of the router's per-worker gauges.
const WORKER_LABELS: &[&str] = &["worker_id", "dp_rank", "worker_type"];
/// The labels of the per-rank counters.
const RANK_LABELS: &[&str] = &["worker_id", "dp_rank"];

/// The request path's metrics: counts by outcome, latencies, prompt sizes.
struct RequestMetrics {
    requests: IntCounterVec,
    outcomes: IntCounterVec,
    router_requests: IntCounter,
    ttft: Histogram,
    itl: Histogram,
    input_tokens: Histogram,
    kv_hit_rate: Histogram,
    upstream_retries: IntCounter,
    disaggregated_requests: IntCounter,
}

impl RequestMetrics {
    fn new(r: &Registrar) -> Self {
        Self {
            requests: r.counters(
                "dynamo_frontend_requests_total",
                "Requests by endpoint, type and status, counted when they end.",
                &["endpoint", "request_type", "status"],
            ),
            outcomes: r.counters(
                "kvroute_requests_outcome_total",
                "Requests by endpoint, type and outcome (ok, client_cancelled, upstream_error, \
                 upstream_reset, timeout, rejected, bad_request), counted when they end.",
                &["endpoint", "request_type", "outcome"],
            ),
            router_requests: r.counter(
                "dynamo_component_router_requests_total",
                "Requests the router routed.",
            ),
            ttft: r.hist(
                "dynamo_component_router_time_to_first_token_seconds",
                "Time to first streamed token, seconds.",
                s_buckets(),
            ),
            itl: r.hist(
                "dynamo_component_router_inter_token_latency_seconds",
                "Time between streamed chunks, seconds.",
                s_buckets(),
            ),
            input_tokens: r.hist(
                "dynamo_component_router_input_sequence_tokens",
                "Prompt tokens per request.",
                prometheus::exponential_buckets(16.0, 2.0, 14).expect("static buckets are valid"),
            ),
            kv_hit_rate: r.hist(
                "dynamo_component_router_kv_hit_rate",
                "Predicted KV hit rate: prompt blocks cached on the chosen worker over prompt blocks.",
                (0..=20).map(|i| f64::from(i) / 20.0).collect(),
            ),
            upstream_retries: r.counter(
                "kvroute_upstream_retries_total",
                "Upstream connect failures retried on another worker.",
            ),
            disaggregated_requests: r.counter(
                "kvroute_disaggregated_requests_total",
                "Requests routed with a prefill worker: prefilled there, then decoded on a decode worker.",
            ),
        }
    }
}

/// The router's own overheads, ms.
struct Overheads {
    block_hashing: Histogram,
    scheduling: Histogram,
    total: Histogram,
    tokenize: Histogram,
}

impl Overheads {
    fn new(r: &Registrar) -> Self {
        Self {
            block_hashing: r.hist(
                "dynamo_router_overhead_block_hashing_ms",
                "Local block hashing of the prompt, ms.",
                ms_buckets(),
            ),
            scheduling: r.hist(
                "dynamo_router_overhead_scheduling_ms",
                "The router core's decision: sequence hashing, index lookup, selection, booking; ms.",
                ms_buckets(),
            ),
            total: r.hist(
                "dynamo_router_overhead_total_ms",
                "Tokenization, hashing and the decision, ms.",
                ms_buckets(),
            ),
            tokenize: r.hist(
                "kvroute_router_overhead_tokenize_ms",
                "Chat rendering and tokenization, ms.",
                ms_buckets(),
            ),
        }
    }
}

/// Per-worker series: the router's books, membership, checks, and predicted against
/// reported cached tokens.
struct WorkerMetrics {
    decode_blocks: IntGaugeVec,
    prefill_tokens: IntGaugeVec,
    requests: IntGaugeVec,
    cached_blocks: IntGaugeVec,
    up: IntGaugeVec,
    misconfigured: IntGaugeVec,
    predicted_cached_tokens: IntCounterVec,
    reported_cached_tokens: IntCounterVec,
    cached_token_reports: IntCounterVec,
}

impl WorkerMetrics {
    fn new(r: &Registrar) -> Self {
        Self {
            decode_blocks: r.gauges(
                "dynamo_frontend_worker_active_decode_blocks",
                "Active decode blocks the router books per worker.",
                WORKER_LABELS,
            ),
            prefill_tokens: r.gauges(
                "dynamo_frontend_worker_active_prefill_tokens",
                "Active prefill tokens the router books per worker.",
                WORKER_LABELS,
            ),
            requests: r.gauges(
                "kvroute_worker_active_requests",
                "Requests the router books per worker.",
                WORKER_LABELS,
            ),
            cached_blocks: r.gauges(
                "kvroute_worker_cached_blocks",
                "Blocks the router's KV index says each worker holds.",
                WORKER_LABELS,
            ),
            up: r.gauges(
                "kvroute_worker_up",
                "1 when the worker takes requests (healthy, not draining, not misconfigured).",
                &["worker_id", "url"],
            ),
            misconfigured: r.gauges(
                "kvroute_worker_misconfigured",
                "1 while a registration check (model, block_size) finds the worker misconfigured.",
                &["worker_id", "check"],
            ),
            predicted_cached_tokens: r.counters(
                "kvroute_worker_predicted_cached_tokens_total",
                "Prompt tokens predicted cached on the chosen worker at routing.",
                RANK_LABELS,
            ),
            reported_cached_tokens: r.counters(
                "kvroute_worker_reported_cached_tokens_total",
                "Prompt tokens the worker reported cached (usage.prompt_tokens_details.cached_tokens).",
                RANK_LABELS,
            ),
            cached_token_reports: r.counters(
                "kvroute_worker_cached_token_reports_total",
                "Completed responses by what their usage said of cached tokens: reported, \
                 absent (0, or not reported by the engine), no_usage.",
                &["worker_id", "dp_rank", "report"],
            ),
        }
    }
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        Self::in_registry(Registry::new())
    }

    /// [`Self::new`], every series labelled `model="NAME"` (one model of several: their
    /// registries are rendered together by [`render_together`]).
    pub fn labelled(model: &str) -> Self {
        let labels = std::collections::HashMap::from([("model".to_owned(), model.to_owned())]);
        match Registry::new_custom(None, Some(labels)) {
            Ok(registry) => Self::in_registry(registry),
            // Only an empty prefix is refused, and none is given.
            Err(_) => Self::new(),
        }
    }

    fn in_registry(registry: Registry) -> Self {
        let r = Registrar(registry);
        let request = RequestMetrics::new(&r);
        let overhead = Overheads::new(&r);
        let worker = WorkerMetrics::new(&r);
        let kv_subscribers = KvSubscriberCounters::default();
        r.add_boxed(SubscriberCollector::new(kv_subscribers.clone()));
        Self {
            requests: request.requests,
            outcomes: request.outcomes,
            router_requests: request.router_requests,
            ttft: request.ttft,
            itl: request.itl,
            input_tokens: request.input_tokens,
            kv_hit_rate: request.kv_hit_rate,
            upstream_retries: request.upstream_retries,
            disaggregated_requests: request.disaggregated_requests,
            overhead_block_hashing: overhead.block_hashing,
            overhead_scheduling: overhead.scheduling,
            overhead_total: overhead.total,
            overhead_tokenize: overhead.tokenize,
            worker_decode_blocks: worker.decode_blocks,
            worker_prefill_tokens: worker.prefill_tokens,
            worker_requests: worker.requests,
            worker_cached_blocks: worker.cached_blocks,
            worker_up: worker.up,
            worker_misconfigured: worker.misconfigured,
            predicted_cached_tokens: worker.predicted_cached_tokens,
            reported_cached_tokens: worker.reported_cached_tokens,
            cached_token_reports: worker.cached_token_reports,
            queue_pending: r.gauges(
                "dynamo_frontend_router_queue_pending_requests",
                "Requests waiting in the router's queue.",
                &["worker_type"],
            ),
            queue_empty_fleet: r.gauge(
                "kvroute_router_queue_empty_fleet",
                "Requests waiting in the router's queue for want of any worker (when-empty = queue).",
            ),
            kv_events: r.counters(
                "dynamo_component_kv_cache_events_applied",
                "KV events by type and status (ok, parent_block_not_found, block_not_found, invalid_block, skipped).",
                &["event_type", "status"],
            ),
            kv_stream_incidents: r.counters(
                "kvroute_kv_event_stream_incidents_total",
                "KV-event stream incidents by kind (gap_recovered, gap_lost, restarted, error).",
                &["kind"],
            ),
            active_requests: r.gauge("kvroute_router_active_requests", "Requests booked in the router."),
            session_requests: r.counters(
                "kvroute_router_session_requests_total",
                "Requests of a session by outcome (new, hit: stayed on its worker, moved: its worker was overloaded or out of routing).",
                &["outcome"],
            ),
            sessions_released: r.counters(
                "kvroute_router_sessions_released_total",
                "Sessions forgotten by cause (worker: removed or out of routing, idle, evicted past max-sessions).",
                &["cause"],
            ),
            sessions: r.gauge("kvroute_router_sessions", "Sessions bound to a worker now."),
            index_blocks_evicted: r.counter(
                "kvroute_index_blocks_evicted_total",
                "KV blocks the router's view evicted to keep a worker within max-blocks-per-worker.",
            ),
            index_blocks_stored: r.counter(
                "kvroute_index_blocks_stored_total",
                "KV blocks newly held by the router's view (a stored event of blocks already held, as an engine's re-announcement, adds none).",
            ),
            discovery_workers: r.gauges(
                "kvroute_discovery_workers",
                "Workers a discovery source (dns, file) added that are in the fleet.",
                &["source"],
            ),
            discovery_errors: r.counters(
                "kvroute_discovery_errors_total",
                "Discovery answers refused (failed resolution or read, empty or bad answer) and discovered workers refused, by source.",
                &["source"],
            ),
            kv_subscribers,
            planner_desired_workers: r.gauges(
                "kvroute_planner_desired_workers",
                "Workers the planner wants, per pool (agg, prefill, decode).",
                &["pool"],
            ),
            planner_worker_exits: r.counters(
                "kvroute_planner_worker_exits_total",
                "Worker processes the process actuator started that ended, by pool and cause \
                 (released, exited, not_ready).",
                &["pool", "cause"],
            ),
            worker_removal_rank: r.gauges(
                "kvroute_worker_removal_rank",
                "The worker's place in the removal order (0: removed first): fewest cached blocks \
                 no other worker holds, then fewest requests in flight, then newest.",
                &["worker"],
            ),
            worker_removal_cost: r.gauges(
                "kvroute_worker_removal_cost",
                "The removal order as a pod-deletion-cost (a lower cost is removed first, a \
                 higher one later): equal to kvroute_worker_removal_rank.",
                &["worker"],
            ),
            registry: r.0,
            handles: Handles::new(),
        }
    }

    /// Counts a generation request to `endpoint` that ended with `outcome`.
    pub fn record_outcome(&self, endpoint: Endpoint, kind: RequestKind, outcome: RequestOutcome) {
        let [outcomes, requests] =
            self.handles.outcomes[outcome_slot(endpoint, kind, outcome)].get_or_init(|| {
                let path = endpoint.path();
                [
                    self.outcomes
                        .with_label_values(&[path, kind.label(), outcome.label()]),
                    self.requests
                        .with_label_values(&[path, kind.label(), outcome.status()]),
                ]
            });
        outcomes.inc();
        requests.inc();
    }

    /// Counts `tokens` predicted cached on `key` for a request routed there.
    pub fn record_prediction(&self, key: WorkerKey, tokens: u64) {
        if let Some(series) = self.handles.ranks().get(&key) {
            series.predicted.inc_by(tokens);
            return;
        }
        let labels = rank_labels(key);
        self.predicted_cached_tokens
            .with_label_values(&[labels[0].as_str(), labels[1].as_str()])
            .inc_by(tokens);
    }

    /// Counts what a completed response from `key` reported of its cached tokens.
    pub fn record_cached_report(&self, key: WorkerKey, report: CachedReport) {
        if let Some(series) = self.handles.ranks().get(&key) {
            series.reports[report.slot()].inc();
            if let CachedReport::Reported(tokens) = report {
                series.reported.inc_by(tokens);
            }
            return;
        }
        let [id, rank] = rank_labels(key);
        self.cached_token_reports
            .with_label_values(&[id.as_str(), rank.as_str(), report.label()])
            .inc();
        if let CachedReport::Reported(tokens) = report {
            self.reported_cached_tokens
                .with_label_values(&[id.as_str(), rank.as_str()])
                .inc_by(tokens);
        }
    }

    /// Sets worker `id`'s misconfiguration gauge for `check`.
    pub fn set_misconfigured(&self, id: WorkerId, check: &str, misconfigured: bool) {
        self.worker_misconfigured
            .with_label_values(&[id.0.to_string().as_str(), check])
            .set(i64::from(misconfigured));
    }

    /// Creates worker `id`'s series at zero, so that they exist from the start and stay (at
    /// their last count) while the worker is out of routing.
    pub fn add_worker(&self, id: WorkerId, ranks: u32, base: &str) {
        let mut handles = self.handles.ranks();
        for rank in 0..ranks {
            let key = WorkerKey::new(id, DpRank(rank));
            let [id, rank] = rank_labels(key);
            let labels = [id.as_str(), rank.as_str()];
            let series = RankSeries {
                predicted: self.predicted_cached_tokens.with_label_values(&labels),
                reported: self.reported_cached_tokens.with_label_values(&labels),
                reports: CachedReport::ALL.map(|report| {
                    self.cached_token_reports
                        .with_label_values(&[labels[0], labels[1], report.label()])
                }),
            };
            handles.insert(key, series);
        }
        drop(handles);
        let worker = id.0.to_string();
        self.worker_up.with_label_values(&[worker.as_str(), base]).set(0);
        for check in crate::checks::Check::ALL {
            self.worker_misconfigured
                .with_label_values(&[worker.as_str(), check.name()])
                .set(0);
        }
    }

    /// Removes every series of worker `id` (removed by an operator): it is gone, not idle.
    pub fn remove_worker(&self, id: WorkerId, ranks: u32, base: &str, role: &str) {
        let mut handles = self.handles.ranks();
        let worker = id.0.to_string();
        let _ = self.worker_up.remove_label_values(&[worker.as_str(), base]);
        for check in crate::checks::Check::ALL {
            let _ = self
                .worker_misconfigured
                .remove_label_values(&[worker.as_str(), check.name()]);
        }
        for rank in 0..ranks {
            handles.remove(&WorkerKey::new(id, DpRank(rank)));
            let rank = rank.to_string();
            let labels = [worker.as_str(), rank.as_str()];
            let _ = self.predicted_cached_tokens.remove_label_values(&labels);
            let _ = self.reported_cached_tokens.remove_label_values(&labels);
            for report in CachedReport::ALL {
                let _ =
                    self.cached_token_reports
                        .remove_label_values(&[labels[0], labels[1], report.label()]);
            }
            for gauge in self.router_gauges() {
                let _ = gauge.remove_label_values(&[labels[0], labels[1], role]);
            }
        }
    }

    /// The per-worker gauges refreshed from the router's snapshot.
    fn router_gauges(&self) -> [&IntGaugeVec; 4] {
        [
            &self.worker_decode_blocks,
            &self.worker_prefill_tokens,
            &self.worker_requests,
            &self.worker_cached_blocks,
        ]
    }

    /// Refreshes the gauges from a router snapshot. Every rank of `registered` (its key and
    /// role name) has a series: at the router's numbers while it is in the router (an
    /// unhealthy worker too, with the requests still booked on it), at zero while it is out
    /// (drained, misconfigured), so that a worker's series end only when it is removed.
    pub fn refresh(&self, snapshot: &RouterMetrics, registered: &[(WorkerKey, &'static str)]) {
        self.queue_pending
            .with_label_values(&["decode"])
            .set(snapshot.queued_now as i64);
        self.queue_empty_fleet
            .set(snapshot.queued_without_worker_now as i64);
        self.active_requests.set(snapshot.active_now as i64);
        let evicted = snapshot.index.blocks_evicted;
        if evicted > self.index_blocks_evicted.get() {
            self.index_blocks_evicted
                .inc_by(evicted - self.index_blocks_evicted.get());
        }
        let stored = snapshot.index.blocks_stored;
        if stored > self.index_blocks_stored.get() {
            self.index_blocks_stored
                .inc_by(stored - self.index_blocks_stored.get());
        }
        let c = &snapshot.counters;
        let catch_up = |vec: &IntCounterVec, label: &str, total: u64| {
            let counter = vec.with_label_values(&[label]);
            counter.inc_by(total.saturating_sub(counter.get()));
        };
        catch_up(&self.session_requests, "new", c.session_new);
        catch_up(&self.session_requests, "hit", c.session_hits);
        catch_up(&self.session_requests, "moved", c.session_moves);
        catch_up(&self.sessions_released, "worker", c.sessions_released);
        catch_up(&self.sessions_released, "idle", c.sessions_expired);
        catch_up(&self.sessions_released, "evicted", c.sessions_evicted);
        self.sessions
            .set(i64::try_from(snapshot.sessions_now).unwrap_or(i64::MAX));
        for gauge in self.router_gauges() {
            gauge.reset();
        }
        for &(key, role) in registered {
            let [id, rank] = rank_labels(key);
            for gauge in self.router_gauges() {
                gauge
                    .with_label_values(&[id.as_str(), rank.as_str(), role])
                    .set(0);
            }
        }
        for w in &snapshot.workers {
            let [id, rank] = rank_labels(w.spec.key);
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

    /// Exports `collector`'s metrics too (the tokenizer cache's); a name taken is logged.
    pub fn register(&self, collector: Box<dyn Collector>) {
        if let Err(e) = self.registry.register(collector) {
            tracing::warn!(error = %e, "a metric collector was not registered");
        }
    }

    /// The registry every metric is in (for other parts' metrics, e.g. replica sync's).
    pub fn registry(&self) -> &Registry {
        &self.registry
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

/// The text exposition of several registries' metrics (each model's, labelled by model, and
/// the ones they share): families of one name, gathered from several registries, merged into
/// one (one `# HELP` and `# TYPE` each), in name order.
pub fn render_together(registries: &[&Registry]) -> String {
    let mut families: std::collections::BTreeMap<String, prometheus::proto::MetricFamily> =
        std::collections::BTreeMap::new();
    for registry in registries {
        for mut family in registry.gather() {
            match families.get_mut(family.name()) {
                Some(merged) => merged.mut_metric().extend(family.take_metric()),
                None => {
                    families.insert(family.name().to_owned(), family);
                }
            }
        }
    }
    let families: Vec<_> = families.into_values().collect();
    let mut buf = Vec::new();
    // Encoding into a Vec cannot fail for well-formed metrics.
    let _ = TextEncoder::new().encode(&families, &mut buf);
    String::from_utf8(buf).unwrap_or_default()
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

    /// The lines of `name`'s series in the text exposition.
    fn series(metrics: &Metrics, name: &str) -> Vec<String> {
        let prefix = format!("{name}{{");
        metrics
            .render()
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn outcomes_count_as_by_label_and_appear_when_first_counted() {
        let found = Metrics::new();
        let by_label = Metrics::new();
        let mut n = 0;
        for endpoint in [Endpoint::Chat, Endpoint::Completions] {
            for kind in [RequestKind::Stream, RequestKind::Unary] {
                for outcome in RequestOutcome::ALL.into_iter().rev().step_by(2) {
                    n += 1;
                    for _ in 0..n {
                        found.record_outcome(endpoint, kind, outcome);
                        let labels = [endpoint.path(), kind.label()];
                        by_label
                            .outcomes
                            .with_label_values(&[labels[0], labels[1], outcome.label()])
                            .inc();
                        by_label
                            .requests
                            .with_label_values(&[labels[0], labels[1], outcome.status()])
                            .inc();
                    }
                    for name in ["kvroute_requests_outcome_total", "dynamo_frontend_requests_total"] {
                        assert_eq!(series(&found, name), series(&by_label, name), "{name}");
                    }
                }
            }
        }
        assert!(series(&found, "kvroute_requests_outcome_total").len() < OUTCOME_SLOTS);
        let mut slots: Vec<usize> = [Endpoint::Chat, Endpoint::Completions]
            .into_iter()
            .flat_map(|e| [RequestKind::Stream, RequestKind::Unary].map(|k| (e, k)))
            .flat_map(|(e, k)| RequestOutcome::ALL.map(|o| outcome_slot(e, k, o)))
            .collect();
        slots.sort_unstable();
        assert_eq!(slots, (0..OUTCOME_SLOTS).collect::<Vec<_>>());
    }

    #[test]
    fn a_rank_counts_as_by_label_while_added_and_after_removal() {
        let names = [
            "kvroute_worker_predicted_cached_tokens_total",
            "kvroute_worker_reported_cached_tokens_total",
            "kvroute_worker_cached_token_reports_total",
        ];
        let found = Metrics::new();
        let by_label = Metrics::new();
        let (id, ranks) = (WorkerId(7), 2);
        for m in [&found, &by_label] {
            m.add_worker(id, ranks, "http://w");
        }
        // `by_label` counts the old way: its ranks are forgotten, its series kept.
        by_label.handles.ranks().clear();
        let reports = [
            CachedReport::Reported(5),
            CachedReport::Absent,
            CachedReport::NoUsage,
            CachedReport::Reported(0),
        ];
        let count = |key: WorkerKey, i: u64| {
            for m in [&found, &by_label] {
                m.record_prediction(key, 3 * i);
                m.record_cached_report(key, reports[i as usize % reports.len()]);
            }
        };
        let same = || {
            for name in names {
                assert_eq!(series(&found, name), series(&by_label, name), "{name}");
            }
        };
        for i in 0..9 {
            count(WorkerKey::new(id, DpRank(i as u32 % ranks)), i);
            // A rank never added counts by label in both.
            count(WorkerKey::new(WorkerId(9), DpRank(0)), i);
            same();
        }
        assert!(!series(&found, names[0]).is_empty());
        for m in [&found, &by_label] {
            m.remove_worker(id, ranks, "http://w", "decode");
        }
        assert!(
            !series(&found, names[0])
                .iter()
                .any(|l| l.contains("worker_id=\"7\""))
        );
        // A response that ends after its worker was removed counts by label, as before.
        count(WorkerKey::new(id, DpRank(1)), 4);
        same();
        assert!(
            series(&found, names[0])
                .iter()
                .any(|l| l.contains("worker_id=\"7\""))
        );
    }
}
