//! The planner through its public API: observations in, decisions out.

use kvroute_core::time::Timestamp;
use kvroute_planner::{
    Action, EngineLimits, Mode, Observation, PassSample, Planner, PlannerConfig, Pool, Reason, Traffic,
    WorkerObservation, WorkerPhase,
};
use proptest::prelude::*;

const LIMITS: EngineLimits = EngineLimits {
    max_num_batched_tokens: 8192,
    max_num_seqs: 256,
    kv_capacity_tokens: 1 << 20,
};

/// Step seconds of the engine the tests pretend to measure.
fn prefill_s(tokens: u64) -> f64 {
    0.02 + 2e-5 * tokens as f64
}
fn decode_s(seqs: u32, kv: u64) -> f64 {
    0.005 + 1e-5 * f64::from(seqs) + 2e-8 * kv as f64
}
fn agg_s(tokens: u64, kv: u64) -> f64 {
    0.005 + 2e-5 * tokens as f64 + 2e-8 * kv as f64
}

/// Passes spanning the load range, so every model is fitted.
fn passes(pool: Pool) -> Vec<PassSample> {
    (1..=40u64)
        .map(|i| {
            let tokens = i * 200;
            let seqs = (i * 6) as u32;
            let kv = i * 20_000 + (i % 7) * 3_000;
            match pool {
                Pool::Prefill => PassSample {
                    prefill_tokens: tokens,
                    decode_seqs: 0,
                    kv_tokens: 0,
                    duration_s: prefill_s(tokens),
                },
                Pool::Decode => PassSample {
                    prefill_tokens: 0,
                    decode_seqs: seqs,
                    kv_tokens: kv,
                    duration_s: decode_s(seqs, kv),
                },
                Pool::Agg => PassSample {
                    prefill_tokens: tokens,
                    decode_seqs: seqs,
                    kv_tokens: kv,
                    duration_s: agg_s(tokens, kv),
                },
            }
        })
        .collect()
}

fn worker(id: u64, pool: Pool, queued: u64, seqs: u32, kv: u64) -> WorkerObservation {
    WorkerObservation {
        id,
        pool,
        state: WorkerPhase::Ready,
        passes: Vec::new(),
        queued_prefill_tokens: queued,
        decode_seqs: seqs,
        kv_tokens: kv,
        in_flight: 0,
        sole_blocks: 0,
    }
}

fn traffic(requests: u64, isl: f64, osl: f64, hit: Option<f64>, secs: f64) -> Traffic {
    Traffic {
        duration_s: secs,
        requests,
        isl_sum: isl * requests as f64,
        osl_sum: osl * requests as f64,
        completed: requests,
        hit_sum: hit.unwrap_or(0.0) * requests as f64,
        hit_n: if hit.is_some() { requests } else { 0 },
        ..Traffic::default()
    }
}

fn at(s: f64) -> Timestamp {
    Timestamp((s * 1e9) as u64)
}

/// A planner whose models are fitted (one tick at 1 s with warm-up passes on every worker).
fn warmed(config: PlannerConfig, workers: &[WorkerObservation]) -> Planner {
    let mut planner = Planner::new(config, LIMITS, Timestamp::ZERO).expect("valid config");
    let mut warm = workers.to_vec();
    for w in &mut warm {
        // Cold-start passes are skipped: give each worker a few extra first.
        let mut p = vec![passes(w.pool)[0]; 5];
        p.extend(passes(w.pool));
        w.passes = p;
    }
    let out = planner.tick(
        at(1.0),
        &Observation {
            traffic: Traffic::default(),
            workers: warm,
            queued_requests: 0,
        },
    );
    assert!(out.decision.is_none(), "no loop is due at 1 s");
    planner
}

fn load_only(mode: Mode) -> PlannerConfig {
    PlannerConfig {
        mode,
        throughput_scaling: false,
        max_gpu_budget: 16,
        ..PlannerConfig::default()
    }
}

#[test]
fn the_fitted_model_recovers_the_engine() {
    let planner = warmed(load_only(Mode::Decode), &[worker(0, Pool::Decode, 0, 0, 0)]);
    let model = planner.model(Pool::Decode).expect("decode model");
    // ITL of 10 requests over 100k KV tokens, no prefill in the pass.
    let itl = model.itl_ms(10.0, 100_000.0, 0.0).expect("fitted");
    assert!((itl - decode_s(10, 100_000) * 1e3).abs() < 1e-9, "{itl}");
}

#[test]
fn scale_up_only_when_every_engine_breaks_the_sla() {
    let config = PlannerConfig {
        sla: kvroute_planner::Sla {
            ttft_ms: 500.0,
            itl_ms: 50.0,
        },
        ..load_only(Mode::Prefill)
    };
    // ISL 4000: own TTFT = 0.02 + 0.08 = 100 ms; 40k queued tokens adds ~5 passes => > 500 ms.
    let busy = worker(0, Pool::Prefill, 40_000, 0, 0);
    let idle = worker(1, Pool::Prefill, 0, 0, 0);
    let mut p = warmed(config.clone(), &[busy.clone(), idle.clone()]);
    let obs = Observation {
        traffic: traffic(20, 4000.0, 100.0, None, 4.0),
        workers: vec![busy.clone(), idle],
        queued_requests: 0,
    };
    let out = p.tick(at(5.0), &obs);
    assert!(
        out.decision.is_none(),
        "one engine still meets the SLA: {:?}",
        out.decision
    );

    let mut p = warmed(config, &[busy.clone(), worker(1, Pool::Prefill, 40_000, 0, 0)]);
    let both = Observation {
        traffic: traffic(20, 4000.0, 100.0, None, 4.0),
        workers: vec![busy, worker(1, Pool::Prefill, 40_000, 0, 0)],
        queued_requests: 0,
    };
    let d = p.tick(at(5.0), &both).decision.expect("scale up");
    assert_eq!(d.actions, vec![Action::Add { pool: Pool::Prefill }]);
    assert!(matches!(d.changes[0].reason, Reason::SlaBreached { .. }), "{d:?}");
    assert!(d.text.contains("breaks the SLA"), "{}", d.text);
}

/// Prefill engines held to a TTFT target of 500 ms, a scale-up waiting `scale_up_ticks` ticks
/// unless past `scale_up_at_once`.
fn waiting_scale_ups(scale_up_ticks: u32, scale_up_at_once: Option<f64>) -> PlannerConfig {
    PlannerConfig {
        sla: kvroute_planner::Sla {
            ttft_ms: 500.0,
            itl_ms: 50.0,
        },
        scale_up_ticks,
        scale_up_at_once,
        ..load_only(Mode::Prefill)
    }
}

/// Two prefill engines with `queued` prompt tokens each, under steady traffic.
fn queued_prefill(queued: u64) -> Observation {
    Observation {
        traffic: traffic(20, 4000.0, 100.0, None, 4.0),
        workers: vec![
            worker(0, Pool::Prefill, queued, 0, 0),
            worker(1, Pool::Prefill, queued, 0, 0),
        ],
        queued_requests: 0,
    }
}

#[test]
fn scale_up_waits_for_its_ticks_in_a_row() {
    let breached = queued_prefill(40_000);
    let one_meets = Observation {
        workers: vec![breached.workers[0].clone(), worker(1, Pool::Prefill, 0, 0, 0)],
        ..breached.clone()
    };
    let mut p = warmed(waiting_scale_ups(2, None), &breached.workers);
    let interval = p.config().load_interval_s;
    let mut tick = |k: f64, obs: &Observation| p.tick(at(interval * k), obs).decision;
    // A breach, then a tick that meets the SLA: the streak starts over.
    assert!(tick(1.0, &breached).is_none(), "one breach of two");
    assert!(tick(2.0, &one_meets).is_none(), "the SLA is met again");
    assert!(tick(3.0, &breached).is_none(), "one breach of two, again");
    let d = tick(4.0, &breached).expect("two breaches in a row");
    assert_eq!(d.actions, vec![Action::Add { pool: Pool::Prefill }]);
}

#[test]
fn a_breach_past_scale_up_at_once_does_not_wait() {
    // The first tick of a planner waiting three ticks, with engines of `queued` tokens each.
    let first_tick = |at_once, queued| {
        let observed = queued_prefill(queued);
        let mut p = warmed(waiting_scale_ups(3, at_once), &observed.workers);
        let at_s = p.config().load_interval_s;
        p.tick(at(at_s), &observed)
    };
    // The breach's size, from the planner's own estimate: the best engine over the target.
    let severity = |queued| {
        let record = first_tick(None, queued).record;
        record.pools[0].est_ttft_ms.expect("an estimate") / 500.0
    };
    let (mild, severe) = (severity(20_000), severity(80_000));
    assert!(mild > 1.0 && mild < 2.0, "a mild breach: {mild}");
    assert!(severe > 2.0, "a severe breach: {severe}");
    assert!(
        first_tick(None, 80_000).decision.is_none(),
        "without the factor, every scale-up waits"
    );
    assert!(
        first_tick(Some(2.0), 20_000).decision.is_none(),
        "a mild breach waits its ticks"
    );
    let d = first_tick(Some(2.0), 80_000)
        .decision
        .expect("a severe breach scales up at once");
    assert_eq!(d.actions, vec![Action::Add { pool: Pool::Prefill }]);
}

#[test]
fn consolidation_refuses_a_scale_down_that_would_break_the_sla() {
    let config = PlannerConfig {
        sla: kvroute_planner::Sla {
            ttft_ms: 500.0,
            itl_ms: 20.0,
        },
        scale_down_ticks: 1,
        ..load_only(Mode::Decode)
    };
    // ITL now: 0.005 + 1e-5*101 + 2e-8*(300k + 4000 + 50) ~ 12.1 ms, within 20 ms. After 2 -> 1,
    // each engine holds 600k KV tokens: ~18.2 ms, under the SLA but over 0.8 * 20 = 16 ms.
    let heavy = |id| worker(id, Pool::Decode, 0, 100, 300_000);
    let mut p = warmed(config.clone(), &[heavy(0), heavy(1)]);
    let obs = Observation {
        traffic: traffic(10, 4000.0, 100.0, None, 4.0),
        workers: vec![heavy(0), heavy(1)],
        queued_requests: 0,
    };
    let out = p.tick(at(5.0), &obs);
    assert!(out.decision.is_none(), "{:?}", out.decision);
    let itl = out.record.pools[0].est_itl_ms.expect("estimated");
    assert!(itl < 20.0, "the SLA holds now ({itl} ms)");

    // Light load: the same check lets one go, and says why.
    let light = |id| worker(id, Pool::Decode, 0, 10, 50_000);
    let mut p = warmed(config, &[light(0), light(1)]);
    let obs = Observation {
        traffic: traffic(10, 4000.0, 100.0, None, 4.0),
        workers: vec![light(0), light(1)],
        queued_requests: 0,
    };
    let d = p.tick(at(5.0), &obs).decision.expect("scale down");
    assert_eq!(
        d.actions,
        vec![Action::Remove {
            pool: Pool::Decode,
            worker: 1
        }]
    );
    assert!(matches!(d.changes[0].reason, Reason::Consolidation { worst_share } if worst_share < 1.0));

    // 2 -> 1, and the one left does not ask for a second: the load it took is within the SLA.
    let mut one = light(0);
    one.decode_seqs *= 2;
    one.kv_tokens *= 2;
    let out = p.tick(
        at(10.0),
        &Observation {
            traffic: traffic(10, 4000.0, 100.0, None, 5.0),
            workers: vec![one],
            queued_requests: 0,
        },
    );
    assert!(out.decision.is_none(), "{:?}", out.decision);
}

#[test]
fn no_decision_while_a_worker_is_starting_or_draining() {
    let config = load_only(Mode::Prefill);
    let busy = |id| worker(id, Pool::Prefill, 80_000, 0, 0);
    let mut p = warmed(config, &[busy(0)]);
    let mut starting = busy(1);
    starting.state = WorkerPhase::Starting;
    let out = p.tick(
        at(5.0),
        &Observation {
            traffic: traffic(10, 4000.0, 1.0, None, 4.0),
            workers: vec![busy(0), starting],
            queued_requests: 0,
        },
    );
    assert!(out.decision.is_none());
    assert_eq!(out.record.hold, Some(kvroute_planner::Hold::InProgress));
}

/// Throughput-only planner over a disaggregated fleet after one window of traffic at hit rate `hit`.
fn throughput_replicas(discount: bool, hit: f64) -> (u32, u32) {
    let config = PlannerConfig {
        mode: Mode::Disagg,
        load_scaling: false,
        throughput_interval_s: 60.0,
        kv_hit_discount: discount,
        max_gpu_budget: 1000,
        sla: kvroute_planner::Sla {
            ttft_ms: 2000.0,
            itl_ms: 30.0,
        },
        ..PlannerConfig::default()
    };
    let workers = [
        worker(0, Pool::Prefill, 0, 0, 0),
        worker(1, Pool::Decode, 0, 0, 0),
    ];
    let mut p = warmed(config, &workers);
    let obs = Observation {
        traffic: traffic(1200, 6000.0, 200.0, Some(hit), 59.0),
        workers: workers.to_vec(),
        queued_requests: 0,
    };
    let out = p.tick(at(60.0), &obs);
    let rec = out.record.throughput.expect("throughput tick");
    let get = |pool| {
        rec.replicas
            .iter()
            .find(|r| r.0 == pool)
            .and_then(|r| r.1)
            .expect("sized")
    };
    (get(Pool::Prefill), get(Pool::Decode))
}

#[test]
fn hit_rate_discount_lowers_prefill_replicas_not_decode_replicas() {
    let (p_off, d_off) = throughput_replicas(false, 0.8);
    let (p_on, d_on) = throughput_replicas(true, 0.8);
    let (p_none, d_none) = throughput_replicas(true, 0.0);
    assert!(
        p_on < p_off,
        "prefill {p_on} with the discount vs {p_off} without"
    );
    assert_eq!(d_on, d_off, "decode residency uses the raw ISL");
    assert_eq!(
        (p_none, d_none),
        (p_off, d_off),
        "a zero hit rate discounts nothing"
    );
    // A NaN hit rate is no hit rate.
    let (p_nan, _) = throughput_replicas(true, f64::NAN);
    assert_eq!(p_nan, p_off);
}

#[test]
fn throughput_floor_raises_a_load_planner() {
    let config = PlannerConfig {
        mode: Mode::Agg,
        throughput_interval_s: 60.0,
        max_gpu_budget: 64,
        ..PlannerConfig::default()
    };
    let workers = [worker(0, Pool::Agg, 0, 0, 0)];
    let mut p = warmed(config, &workers);
    let obs = Observation {
        traffic: traffic(3000, 3000.0, 200.0, None, 59.0),
        workers: workers.to_vec(),
        queued_requests: 0,
    };
    let d = p.tick(at(60.0), &obs).decision.expect("floor");
    assert!(
        matches!(d.changes[0].reason, Reason::ThroughputFloor { .. }),
        "{d:?}"
    );
    assert!(d.actions.len() > 1, "{d:?}");
}

#[test]
fn bad_configs_are_refused() {
    let cases = [
        PlannerConfig {
            min_replicas: 3,
            max_replicas: Some(2),
            ..PlannerConfig::default()
        },
        PlannerConfig {
            max_changes_per_tick: Some(0),
            ..PlannerConfig::default()
        },
        PlannerConfig {
            warmup_s: -1.0,
            ..PlannerConfig::default()
        },
        PlannerConfig {
            load_scaling: false,
            throughput_scaling: false,
            ..PlannerConfig::default()
        },
        PlannerConfig {
            max_gpu_budget: 1,
            mode: Mode::Disagg,
            ..PlannerConfig::default()
        },
        PlannerConfig {
            load_interval_s: 200.0,
            ..PlannerConfig::default()
        },
        PlannerConfig {
            scale_down_sensitivity: 0.0,
            ..PlannerConfig::default()
        },
    ];
    for c in cases {
        assert!(Planner::new(c.clone(), LIMITS, Timestamp::ZERO).is_err(), "{c:?}");
    }
    let parsed: PlannerConfig = toml::from_str(
        "mode = \"disagg\"\nmax_gpu_budget = 12\n[sla]\nttft_ms = 800\nitl_ms = 25\n[predictor]\nkind = \"holt\"\nalpha = 0.5\nbeta = 0.3\n",
    )
    .expect("parses");
    assert_eq!(parsed.mode, Mode::Disagg);
    assert!(toml::from_str::<PlannerConfig>("bogus = 1").is_err());
}

/// A toy fleet: adds start after `startup` ticks, removals drain for `drain` ticks.
#[derive(Debug)]
struct Fleet {
    workers: Vec<(u64, Pool, WorkerPhase, u32)>,
    next_id: u64,
}

fn gpus_of(config: &PlannerConfig, fleet: &Fleet) -> u32 {
    fleet.workers.iter().map(|w| config.gpus(w.1)).sum()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_gpu_budget_is_never_exceeded(
        demands in prop::collection::vec((0u64..4000, 0u64..200_000, 0u32..200, 0u64..900_000), 10..80),
        budget in 2u32..14,
        prefill_gpus in 1u32..3,
        decode_gpus in 1u32..3,
        startup in 0u32..4,
        drain in 0u32..4,
        with_throughput in any::<bool>(),
    ) {
        let config = PlannerConfig {
            mode: Mode::Disagg,
            throughput_scaling: with_throughput,
            throughput_interval_s: 30.0,
            max_gpu_budget: budget.max(prefill_gpus + decode_gpus),
            prefill_gpus,
            decode_gpus,
            sla: kvroute_planner::Sla { ttft_ms: 300.0, itl_ms: 12.0 },
            ..PlannerConfig::default()
        };
        let mut fleet = Fleet {
            workers: vec![(0, Pool::Prefill, WorkerPhase::Ready, 0), (1, Pool::Decode, WorkerPhase::Ready, 0)],
            next_id: 2,
        };
        let mut planner = Planner::new(config.clone(), LIMITS, Timestamp::ZERO).expect("valid");
        for (i, &(requests, queued, seqs, kv)) in demands.iter().enumerate() {
            let now = at(5.0 * (i + 1) as f64);
            let workers: Vec<WorkerObservation> = fleet
                .workers
                .iter()
                .map(|&(id, pool, state, _)| WorkerObservation {
                    state,
                    passes: if i == 0 { passes(pool) } else { passes(pool)[..3].to_vec() },
                    ..worker(id, pool, queued, seqs, kv)
                })
                .collect();
            let obs = Observation { traffic: traffic(requests, 3000.0, 150.0, Some(0.3), 5.0), workers, queued_requests: 0 };
            let out = planner.tick(now, &obs);
            // The fleet moves on: starting workers come up, drained ones go.
            for w in &mut fleet.workers {
                w.3 += 1;
                if w.2 == WorkerPhase::Starting && w.3 > startup {
                    w.2 = WorkerPhase::Ready;
                }
            }
            fleet.workers.retain(|w| !(w.2 == WorkerPhase::Draining && w.3 > drain));
            if let Some(d) = out.decision {
                for a in d.actions {
                    match a {
                        Action::Add { pool } => {
                            fleet.workers.push((fleet.next_id, pool, WorkerPhase::Starting, 0));
                            fleet.next_id += 1;
                        }
                        Action::Remove { worker, .. } => {
                            let w = fleet.workers.iter_mut().find(|w| w.0 == worker).expect("a known worker");
                            prop_assert_eq!(w.2, WorkerPhase::Ready);
                            w.2 = WorkerPhase::Draining;
                            w.3 = 0;
                        }
                    }
                }
            }
            prop_assert!(gpus_of(&config, &fleet) <= config.max_gpu_budget, "{:?}", fleet);
            for pool in [Pool::Prefill, Pool::Decode] {
                let live = fleet.workers.iter().filter(|w| w.1 == pool && w.2 != WorkerPhase::Draining).count();
                prop_assert!(live >= 1, "{:?} lost its last worker", pool);
            }
        }
    }
}

/// Two light decode engines where one consolidation is due; `scale_down_ticks = 1`.
fn consolidating() -> PlannerConfig {
    PlannerConfig {
        sla: kvroute_planner::Sla {
            ttft_ms: 500.0,
            itl_ms: 20.0,
        },
        scale_down_ticks: 1,
        ..load_only(Mode::Decode)
    }
}

#[test]
fn scale_down_keeps_the_worker_whose_cache_only_it_holds() {
    let light = |id, sole| WorkerObservation {
        sole_blocks: sole,
        ..worker(id, Pool::Decode, 0, 10, 50_000)
    };
    // Worker 1 is the newest, which alone would make it the one to go; it holds 900 blocks no one
    // else does, worker 0 holds 3: worker 0 goes.
    let fleet = vec![light(0, 3), light(1, 900)];
    let mut p = warmed(consolidating(), &fleet);
    let obs = Observation {
        traffic: traffic(10, 4000.0, 100.0, None, 4.0),
        workers: fleet,
        queued_requests: 0,
    };
    let d = p.tick(at(5.0), &obs).decision.expect("scale down");
    assert_eq!(
        d.actions,
        vec![Action::Remove {
            pool: Pool::Decode,
            worker: 0
        }]
    );
    // The order rule itself: sole blocks, then requests in flight, then the newest first.
    let w = |id, sole, in_flight| WorkerObservation {
        sole_blocks: sole,
        in_flight,
        ..worker(id, Pool::Decode, 0, 0, 0)
    };
    let ws = [w(0, 5, 0), w(1, 5, 2), w(2, 0, 9), w(3, 5, 0)];
    assert_eq!(kvroute_planner::removal_order(&ws), vec![2, 3, 0, 1]);
}

#[test]
fn an_empty_pool_starts_a_worker_when_requests_wait_and_stops_when_idle() {
    let config = PlannerConfig {
        min_replicas: 0,
        idle_to_zero_s: 30.0,
        ..load_only(Mode::Agg)
    };
    let mut p = Planner::new(config, LIMITS, Timestamp::ZERO).expect("min 0 is valid");
    // Nothing provisioned, nothing waiting: nothing to do.
    let empty = Observation::default();
    assert!(p.tick(at(5.0), &empty).decision.is_none());
    // A request waits in the queue: one worker, at once (not only at a load tick).
    let waiting = Observation {
        queued_requests: 1,
        ..Observation::default()
    };
    let d = p.tick(at(6.0), &waiting).decision.expect("from zero");
    assert_eq!(d.actions, vec![Action::Add { pool: Pool::Agg }]);
    assert!(matches!(d.changes[0].reason, Reason::FromZero { waiting: 1 }));
    // While it starts, no second one.
    let starting = Observation {
        queued_requests: 1,
        workers: vec![WorkerObservation {
            state: WorkerPhase::Starting,
            ..worker(0, Pool::Agg, 0, 0, 0)
        }],
        ..Observation::default()
    };
    assert!(p.tick(at(7.0), &starting).decision.is_none());
    // Ready and busy until 20 s, then idle: stopped once 30 s pass without a request.
    let busy = Observation {
        traffic: traffic(3, 100.0, 10.0, None, 5.0),
        workers: vec![worker(0, Pool::Agg, 0, 1, 100)],
        ..Observation::default()
    };
    assert!(p.tick(at(20.0), &busy).decision.is_none());
    let idle = Observation {
        workers: vec![worker(0, Pool::Agg, 0, 0, 0)],
        ..Observation::default()
    };
    assert!(p.tick(at(45.0), &idle).decision.is_none(), "idle 25 s only");
    let d = p.tick(at(50.0), &idle).decision.expect("idle to zero");
    assert_eq!(
        d.actions,
        vec![Action::Remove {
            pool: Pool::Agg,
            worker: 0
        }]
    );
    assert!(matches!(d.changes[0].reason, Reason::Idle { .. }));
}

#[test]
fn a_lost_worker_is_replaced_up_to_the_last_decision_within_the_limits() {
    let config = PlannerConfig {
        min_replicas: 3,
        max_changes_per_tick: Some(2),
        ..load_only(Mode::Agg)
    };
    let mut p = Planner::new(config, LIMITS, Timestamp::ZERO).expect("valid");
    // Below the minimum by three: two adds now (the limit), the third later.
    let d = p.tick(at(5.0), &Observation::default()).decision.expect("min");
    assert_eq!(d.actions.len(), 2, "{d:?}");
    let two = Observation {
        workers: vec![worker(0, Pool::Agg, 0, 0, 0), worker(1, Pool::Agg, 0, 0, 0)],
        ..Observation::default()
    };
    let d = p.tick(at(10.0), &two).decision.expect("the rest of the minimum");
    assert_eq!(d.actions, vec![Action::Add { pool: Pool::Agg }]);
    // A decision wanted 5 (max 5); one of them dies: it is replaced.
    let mut p = Planner::new(
        PlannerConfig {
            min_replicas: 5,
            max_replicas: Some(5),
            ..load_only(Mode::Agg)
        },
        LIMITS,
        Timestamp::ZERO,
    )
    .expect("valid");
    let d = p.tick(at(5.0), &Observation::default()).decision.expect("min");
    assert_eq!(d.actions.len(), 5);
    let four = Observation {
        workers: (0..4).map(|i| worker(i, Pool::Agg, 0, 0, 0)).collect(),
        ..Observation::default()
    };
    let d = p.tick(at(10.0), &four).decision.expect("replace");
    assert_eq!(d.actions, vec![Action::Add { pool: Pool::Agg }]);
}

#[test]
fn latency_correction_pulls_the_estimates_to_what_is_observed() {
    // Engines observed twice as slow as the model: with the correction, a load the model alone
    // finds within the SLA breaches it.
    let config = PlannerConfig {
        latency_correction: true,
        sla: kvroute_planner::Sla {
            ttft_ms: 500.0,
            itl_ms: 20.0,
        },
        ..load_only(Mode::Decode)
    };
    let heavy = |id| worker(id, Pool::Decode, 0, 100, 300_000);
    let mut p = warmed(config.clone(), &[heavy(0), heavy(1)]);
    let mut corrected = None;
    for tick in 1..=4 {
        let est = 12.1;
        let obs = Observation {
            traffic: Traffic {
                itl_sum_ms: 2.0 * est * 10.0,
                itl_n: 10,
                ..traffic(10, 4000.0, 100.0, None, 5.0)
            },
            workers: vec![heavy(0), heavy(1)],
            ..Observation::default()
        };
        let out = p.tick(at(5.0 * f64::from(tick)), &obs);
        if let Some(d) = out.decision {
            corrected = Some((out.record.itl_correction, d));
            break;
        }
    }
    let (factor, d) = corrected.expect("the corrected ITL breaches the SLA");
    assert!(factor > 1.4, "{factor}");
    assert!(matches!(d.changes[0].reason, Reason::SlaBreached { .. }), "{d:?}");
    // Without it, the same observations change nothing.
    let mut p = warmed(
        PlannerConfig {
            latency_correction: false,
            ..config
        },
        &[heavy(0), heavy(1)],
    );
    for tick in 1..=4 {
        let obs = Observation {
            traffic: Traffic {
                itl_sum_ms: 2.0 * 12.1 * 10.0,
                itl_n: 10,
                ..traffic(10, 4000.0, 100.0, None, 5.0)
            },
            workers: vec![heavy(0), heavy(1)],
            ..Observation::default()
        };
        let out = p.tick(at(5.0 * f64::from(tick)), &obs);
        assert!(out.decision.is_none(), "{:?}", out.decision);
        assert_eq!(out.record.itl_correction, 1.0);
    }
}

proptest::proptest! {
    /// The removal order against a reference: a permutation of the ids, each worker no later
    /// than any other it beats on the rule compared field by field.
    #[test]
    fn the_removal_order_is_the_rule(raw in proptest::collection::btree_map(0u64..50, (0u64..4, 0u32..3), 0..12)) {
        let workers: Vec<WorkerObservation> = raw
            .iter()
            .map(|(&id, &(sole, in_flight))| WorkerObservation {
                sole_blocks: sole,
                in_flight,
                ..worker(id, Pool::Agg, 0, 0, 0)
            })
            .collect();
        let order = kvroute_planner::removal_order(&workers);
        let mut ids: Vec<u64> = workers.iter().map(|w| w.id).collect();
        let mut got = order.clone();
        ids.sort_unstable();
        got.sort_unstable();
        proptest::prop_assert_eq!(got, ids);
        let beats = |a: &WorkerObservation, b: &WorkerObservation| {
            a.sole_blocks < b.sole_blocks
                || (a.sole_blocks == b.sole_blocks
                    && (a.in_flight < b.in_flight || (a.in_flight == b.in_flight && a.id > b.id)))
        };
        let at = |id: u64| order.iter().position(|&x| x == id).unwrap_or(usize::MAX);
        for a in &workers {
            for b in &workers {
                if beats(a, b) {
                    proptest::prop_assert!(at(a.id) < at(b.id), "{:?} before {:?}: {:?}", a, b, order);
                }
            }
        }
    }
}
