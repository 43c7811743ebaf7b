//! From a finished run to its report: the run's counts into the [`ReportBuilder`] (where every
//! report formula lives), then the planner's keys.

use kvroute_core::router::RouterCounters;
use kvroute_core::router::replica::ProtocolCounters;

use crate::RunResult;
use crate::cluster::Run;
use crate::cluster::{ReqState, Tokens};
use crate::config::{PlannerSetup, ReplicaSync, SimConfig, Topology};
use crate::planned::{PlannerRun, PlannerState, RequestSla, WorkerLife, sla_of};
use crate::report::{
    CompletedRequest, Disaggregation, EngineCounts, Outcome, Report, ReportBuilder, RequestRecord, Value,
    ms_between,
};
use crate::workload::SimRequest;

/// The run's result.
pub(crate) fn summarize(config: &SimConfig, mut run: Run<'_>) -> RunResult {
    let t = &run.totals;
    // The replicas' counters, summed (each counts its own decisions).
    let mut counters = RouterCounters::default();
    for router in &run.routers {
        let c = router.metrics().counters;
        counters.overlap_blocks += c.overlap_blocks;
        counters.prompt_blocks += c.prompt_blocks;
        counters.queued += c.queued;
        counters.expired += c.expired;
        counters.disaggregated += c.disaggregated;
    }
    let mut b = std::mem::replace(&mut run.tally.builder, ReportBuilder::new("", 0, 0, 0));
    b.arrived = Some(t.arrived);
    b.rejected = run.rejected();
    b.itl = t.itl.summary();
    b.prefix_cache_tokens = (t.hit_tokens, t.query_tokens);
    b.router_overlap_blocks = (counters.overlap_blocks, counters.prompt_blocks);
    b.kv_events_lost = t.kv_events_lost;
    b.engine = Some(EngineCounts {
        preemptions: t.preemptions,
        router_queued: counters.queued,
        router_expired: counters.expired,
        kv_events_published: t.kv_events_published,
        kv_events_refused: t.kv_events_refused,
        engine_steps: t.steps,
        busy_worker_seconds: t.busy_nanos as f64 / 1e9,
    });
    let tally = &run.tally;
    b.unfinished = Some(tally.unfinished);
    b.router_mean_kv_hit_rate = Some(if tally.hit_rate.1 == 0 {
        0.0
    } else {
        tally.hit_rate.0 / tally.hit_rate.1 as f64
    });
    // With a planner, workers are counted from provisioning (startup included) to removal.
    if run.planner.is_some() {
        let end = b.end_ns();
        b.worker_seconds = Some(
            run.workers
                .iter()
                .map(|w| {
                    let until = w.removed_at.map_or(end, |t| t.as_nanos().min(end));
                    until.saturating_sub(w.provisioned_at.as_nanos()) as f64 / 1e9
                })
                .sum(),
        );
    }
    if let Topology::Disaggregated { prefill, decode } = config.topology {
        b.disaggregation = Some(Disaggregation {
            prefill_workers: prefill as u64,
            decode_workers: decode as u64,
            prefill_busy_worker_seconds: t.prefill_busy_nanos as f64 / 1e9,
            disaggregated_requests: counters.disaggregated,
            kv_transfers: t.kv_transfers,
            kv_transfer_blocks: t.kv_transfer_blocks,
            kv_transfer_hit_blocks: t.kv_transfer_hit_blocks,
            kv_transfer_bytes: t.kv_transfer_bytes,
            kv_transfer_nanos: t.kv_transfer_nanos,
            kv_import_waits: t.kv_import_waits,
            kv_import_wait_nanos: t.kv_import_wait_nanos,
        });
    }
    let mut report = b.build();
    replica_keys(config, &run, &mut report);
    let (worker_seconds, duration_s) = (b.worker_seconds(), b.duration_s());
    let planner = config
        .planner
        .as_ref()
        .zip(run.planner.as_ref())
        .map(|(setup, state)| planner_run(setup, state, &run, &mut report, worker_seconds, duration_s));
    RunResult {
        report,
        requests: std::mem::take(&mut run.tally.records),
        series: run.series,
        ttft_ms: b.ttft_ms().to_vec(),
        e2e_ms: b.e2e_ms().to_vec(),
        itl_cdf: t.itl.cdf(800),
        planner,
    }
}

/// What the report keeps of each request, taken as the run releases it (in id order).
pub(crate) struct Tally {
    pub(crate) builder: ReportBuilder,
    /// Sum over routed requests with a full block of the router's predicted hit rate, and
    /// their count.
    hit_rate: (f64, u64),
    /// One record per request, with [`SimConfig::keep_requests`].
    records: Vec<RequestRecord>,
    keep_requests: bool,
    /// Each arrived request as SLA attainment counts it, with a planner.
    slas: Option<Vec<RequestSla>>,
    /// Arrived requests neither completed nor turned away.
    pub(crate) unfinished: u64,
    /// The first completed request whose arrival, routing, first token and finish are out of
    /// order.
    pub(crate) out_of_order: Option<usize>,
    block_size: u32,
}

impl Tally {
    /// An empty tally of a run of `requests` requests under `config`.
    pub(crate) fn new(config: &SimConfig, requests: usize) -> Self {
        Self {
            builder: ReportBuilder::new(
                config.router.policy.name(),
                config.workers() as u64,
                config.gpus_per_worker,
                requests as u64,
            ),
            hit_rate: (0.0, 0),
            records: Vec::new(),
            keep_requests: config.keep_requests,
            slas: config.planner.as_ref().map(|_| Vec::new()),
            unfinished: 0,
            out_of_order: None,
            block_size: config.engine.block_size.max(1),
        }
    }

    /// Request `i`, at its end (or the run's).
    pub(crate) fn add(&mut self, i: usize, s: &ReqState, tokens: &Tokens, r: &SimRequest) {
        let Some(arrived_at) = s.arrived else { return };
        if s.outcome() == Outcome::Unfinished {
            self.unfinished += 1;
        }
        if let Some(slas) = &mut self.slas {
            slas.push(RequestSla {
                arrived: arrived_at,
                outcome: s.outcome(),
                first_token: s.first_token,
                last_token: s.finished.unwrap_or(tokens.last_token),
                output_tokens: tokens.output_tokens,
            });
        }
        if let Some(finished) = s.finished {
            let first = s.first_token.unwrap_or(arrived_at);
            if self.out_of_order.is_none()
                && !(arrived_at <= first
                    && first <= finished
                    && s.routed.is_some_and(|t| arrived_at <= t && t <= first))
            {
                self.out_of_order = Some(i);
            }
        }
        let arrived = arrived_at.as_nanos();
        let prompt_blocks = r.prompt_tokens / self.block_size;
        if s.routed.is_some() && prompt_blocks > 0 {
            self.hit_rate.0 += f64::from(s.overlap_blocks) / f64::from(prompt_blocks);
            self.hit_rate.1 += 1;
        }
        if let Some(finished) = s.finished {
            self.builder.complete(&CompletedRequest {
                arrival_ns: arrived,
                first_token_ns: s.first_token.map(|t| t.as_nanos()),
                // The client receives the last token with the completion: behind the same
                // HTTP latency as the first (the engine's own time may come before the first's).
                last_token_ns: finished.as_nanos(),
                finished_ns: finished.as_nanos(),
                input_tokens: u64::from(r.prompt_tokens),
                output_tokens: u64::from(tokens.output_tokens),
            });
        }
        if self.keep_requests {
            self.records.push(RequestRecord {
                id: i as u64,
                outcome: s.outcome(),
                arrival_ms: ms_between(0, arrived),
                routed_ms: s.routed.map(|t| ms_between(0, t.as_nanos())),
                worker: s.worker.map(u64::from),
                input_tokens: r.prompt_tokens,
                output_tokens: tokens.output_tokens,
                prompt_blocks,
                predicted_overlap_blocks: s.overlap_blocks,
                ttft_ms: s.first_token.map(|t| ms_between(arrived, t.as_nanos())),
                e2e_latency_ms: s.finished.map(|t| ms_between(arrived, t.as_nanos())),
                cached_tokens: s.cached_tokens,
                router_queue_ms: s.routed.map(|t| ms_between(arrived, t.as_nanos())),
                engine_queue_ms: s
                    .routed
                    .zip(s.admitted)
                    .map(|(r, a)| ms_between(r.as_nanos(), a.as_nanos().max(r.as_nanos()))),
                queue_ms: s.admitted.map(|a| ms_between(arrived, a.as_nanos().max(arrived))),
            });
        }
    }
}

/// The replicas' keys: how many, the load imbalance, and (with several) the sync traffic.
///
/// `load_imbalance` is max / mean over the workers that decode of each worker's time-averaged
/// requests in flight (routed to it and not yet finished), over the whole run: 1 is an even
/// spread, 2 means the busiest worker carried twice the average.
fn replica_keys(config: &SimConfig, run: &Run<'_>, report: &mut Report) {
    report.count("router_replicas", run.routers.len() as u64);
    let areas: Vec<f64> = run
        .workers
        .iter()
        .filter(|w| w.role.tracks_decode())
        .map(|w| w.in_flight_area as f64)
        .collect();
    let mean = areas.iter().sum::<f64>() / areas.len().max(1) as f64;
    let max = areas.iter().copied().fold(0.0, f64::max);
    report.float("load_imbalance", if mean > 0.0 { max / mean } else { 1.0 });
    if run.routers.len() > 1 || config.replicas.sync != ReplicaSync::Off {
        let t = &run.totals;
        report.count("sync_events_published", t.sync_events_published);
        report.count("sync_events_lost", t.sync_events_lost);
        report.count("sync_events_refused", t.sync_events_refused);
        let stale: u64 = run
            .routers
            .iter()
            .map(|r| r.metrics().counters.sync_stale_added)
            .sum();
        report.count("sync_stale_added", stale);
        if !run.protocols.is_empty() {
            let sum = |f: fn(&ProtocolCounters) -> u64| -> u64 {
                run.protocols.iter().map(|p| f(&p.counters())).sum()
            };
            report.count("sync_messages_lost", t.sync_messages_lost);
            report.count("sync_gaps", sum(|c| c.gaps));
            report.count("sync_snapshots_sent", sum(|c| c.snapshots_sent));
            report.count("sync_peers_lost", sum(|c| c.peers_lost));
        }
    }
}

/// The planner's part of the report: new keys (only in runs with a planner) and its record.
fn planner_run(
    setup: &PlannerSetup,
    state: &PlannerState,
    run: &Run<'_>,
    report: &mut Report,
    worker_seconds: f64,
    duration_s: f64,
) -> PlannerRun {
    let (ttft_sla, itl_sla) = sla_of(&setup.config);
    let requests = run.tally.slas.iter().flatten().copied();
    let windows = crate::planned::sla_windows(requests, setup.sla_window, &setup.config.sla);
    let workers: Vec<WorkerLife> = run
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| WorkerLife {
            id: i as u64,
            pool: w.pool(),
            provisioned_s: w.provisioned_at.as_secs_f64(),
            ready_s: w.ready_at.map(|t| t.as_secs_f64()),
            draining_s: w.draining_at.map(|t| t.as_secs_f64()),
            removed_s: w.removed_at.map(|t| t.as_secs_f64()),
        })
        .collect();
    let result = PlannerRun {
        ttft_sla_ms: ttft_sla,
        itl_sla_ms: itl_sla,
        window_s: setup.sla_window.as_secs_f64(),
        windows,
        decisions: state.decisions.clone(),
        ticks: state.ticks.clone(),
        workers,
        observations: state.observations.clone().unwrap_or_default(),
    };
    let (met, counted) = result.attainment();
    let actions = |add: bool| {
        result
            .decisions
            .iter()
            .flat_map(|d| &d.actions)
            .filter(|a| matches!(a, kvroute_planner::Action::Add { .. }) == add)
            .count() as u64
    };
    report.count("planner_decisions", result.decisions.len() as u64);
    report.count("planner_workers_added", actions(true));
    report.count("planner_workers_removed", actions(false));
    report.count("planner_workers_provisioned", result.workers.len() as u64);
    report.float(
        "planner_mean_workers",
        if duration_s > 0.0 {
            worker_seconds / duration_s
        } else {
            0.0
        },
    );
    report.count("planner_late_kv_events", state.late_kv_events);
    report.count("sla_windows", counted);
    report.count("sla_windows_met", met);
    report.float(
        "sla_attainment",
        if counted == 0 {
            0.0
        } else {
            met as f64 / counted as f64
        },
    );
    let completed: u64 = result.windows.iter().map(|w| w.completed).sum();
    let good: f64 = result
        .windows
        .iter()
        .map(|w| w.good_fraction * w.completed as f64)
        .sum();
    report.float(
        "goodput_fraction",
        if completed == 0 {
            0.0
        } else {
            good / completed as f64
        },
    );
    report.push(
        "planner",
        Value::Json(serde_json::to_value(&result).unwrap_or(serde_json::Value::Null)),
    );
    result
}
