//! A workload made as the run goes: the same run as the workload held whole (report, records,
//! series, latencies), under sessions, the closed loop, rejections, HTTP latency, replicas and
//! a disaggregated fleet; a source that breaks its promise of order is an error, not another run.

use std::borrow::Cow;
use std::time::Duration;

mod common;

use common::shrink;
use kvroute_core::time::Timestamp;
use kvroute_sim::synthetic::{Lengths, SyntheticConfig, SyntheticStream, WorkloadPlan, generate};
use kvroute_sim::workload::{RateWarp, Reshape, Reshaped};
use kvroute_sim::{
    Arrival, ArrivalMode, Dispersion, HttpLatency, LengthSpread, RequestSource, RunResult, SimConfig,
    SimError, SimRequest, Simulation, Topology, Workload,
};

fn sessions() -> SyntheticConfig {
    SyntheticConfig {
        requests: 60,
        rate_rps: 30.0,
        isl: Lengths::Uniform { min: 16, max: 300 },
        osl: Lengths::Uniform { min: 1, max: 40 },
        prefix_groups: 3,
        shared_prefix_tokens: 100,
        turns_per_session: 3,
        think_time: Duration::from_millis(150),
        seed: 5,
        ..SyntheticConfig::default()
    }
}

/// The workload `shape` makes of `synthetic`, held whole (by the [`Workload`] methods).
fn whole(synthetic: &SyntheticConfig, shape: &Reshape) -> Workload {
    let mut w = generate(synthetic, 16)
        .multiply(shape.copies)
        .expect("not too many");
    w.spread_lengths(&shape.spread, shape.seed)
        .expect("a valid spread");
    w.speed_up(shape.speedup);
    if let Some(warp) = &shape.warp {
        for r in &mut w.requests {
            r.arrival = warp.arrival(r.arrival);
        }
    }
    w
}

/// The same, made as the run goes, `chunk` requests drawn at a time, hashed in two ranges.
fn stream<'w>(
    synthetic: &SyntheticConfig,
    shape: &Reshape,
    chunk: usize,
) -> Reshaped<'w, SyntheticStream<'static>> {
    let halves = |plan: &WorkloadPlan| {
        let all = plan.requests();
        let mid = all.start + all.len() / 2;
        vec![plan.hash(all.start..mid), plan.hash(mid..all.end)]
    };
    let s = SyntheticStream::with_hasher(synthetic, 16, chunk, Box::new(halves));
    Reshaped::new(s, shape.clone()).expect("a valid shape")
}

/// A change to the base configuration.
type Tweak = fn(SimConfig) -> SimConfig;

fn assert_same(a: &RunResult, b: &RunResult, what: &str) {
    let json = |r: &RunResult| serde_json::to_string(&r.report).expect("serializable");
    assert_eq!(json(a), json(b), "{what}");
    assert_eq!(a.requests, b.requests, "{what}");
    assert_eq!(a.series, b.series, "{what}");
    assert_eq!((&a.ttft_ms, &a.e2e_ms), (&b.ttft_ms, &b.e2e_ms), "{what}");
}

#[test]
fn a_stream_runs_as_the_workload_held_whole() {
    let noisy = |mut c: SimConfig| {
        c.noise.http = Some(HttpLatency {
            delay: Duration::from_millis(2),
            jitter: Some(Dispersion::Lognormal(0.5)),
        });
        c.noise.step_jitter = Some(Dispersion::Lognormal(0.05));
        c
    };
    let closed = |mut c: SimConfig| {
        c.arrivals = ArrivalMode::Closed { concurrency: 24 };
        c
    };
    let rejecting = |mut c: SimConfig| {
        c.engine.max_model_len = 400;
        c
    };
    let replicas = |mut c: SimConfig| {
        c.replicas.count = 3;
        c
    };
    let disagg = |mut c: SimConfig| {
        c.topology = Topology::Disaggregated {
            prefill: 2,
            decode: 2,
        };
        c
    };
    let sampled = |mut c: SimConfig| {
        c.sample_interval = Some(Duration::from_millis(250));
        c
    };
    let configs: [(&str, Tweak); 7] = [
        ("plain", |c| c),
        ("http latency and jitter", noisy),
        ("closed loop", closed),
        ("engine rejections", rejecting),
        ("three replicas", replicas),
        ("disaggregated", disagg),
        ("sampled", sampled),
    ];
    let shapes = [
        Reshape::default(),
        Reshape {
            copies: 3,
            spread: LengthSpread {
                prompt: Some(Dispersion::Lognormal(0.3)),
                output: Some(Dispersion::Uniform(0.5)),
            },
            seed: 9,
            speedup: 2.5,
            warp: RateWarp::new(&[(0.0, 1.0), (2.0, 4.0)]).unwrap(),
        },
    ];
    let single = SyntheticConfig {
        turns_per_session: 1,
        prefix_groups: 0,
        ..sessions()
    };
    for (name, make) in configs {
        let config = make(shrink(SimConfig::new(4)));
        let sim = Simulation::new(config).unwrap();
        for synthetic in [sessions(), single] {
            for shape in &shapes {
                let held = sim.run(&whole(&synthetic, shape), &mut |_| {}).unwrap();
                for chunk in [1, 7] {
                    let made = sim
                        .run_source(stream(&synthetic, shape, chunk), &mut |_| {})
                        .unwrap();
                    assert_same(&held, &made, &format!("{name}, chunk {chunk}, {shape:?}"));
                }
            }
        }
    }
}

/// Requests of `arrivals`, in order, claiming arrival order.
struct Claimed(std::vec::IntoIter<Arrival>, usize);

impl<'w> RequestSource<'w> for Claimed {
    fn block_size(&self) -> u32 {
        16
    }

    fn len(&self) -> usize {
        self.1
    }

    fn next_request(&mut self) -> Result<Option<Cow<'w, SimRequest>>, SimError> {
        Ok(self.0.next().map(|arrival| {
            Cow::Owned(SimRequest {
                arrival,
                locals: vec![].into(),
                prompt_tokens: 10,
                output_tokens: 2,
            })
        }))
    }

    fn in_arrival_order(&self) -> bool {
        true
    }
}

#[test]
fn a_source_out_of_its_promised_order_is_an_error() {
    let sim = Simulation::new(shrink(SimConfig::new(2))).unwrap();
    let at = |ms| Arrival::At(Timestamp::from_millis(ms));
    let run = |arrivals: Vec<Arrival>| {
        let n = arrivals.len();
        sim.run_source(Claimed(arrivals.into_iter(), n), &mut |_| {})
    };
    assert!(run(vec![at(0), at(5), at(10)]).is_ok());
    // A time going back.
    let e = run(vec![at(0), at(10), at(5)]).unwrap_err();
    assert!(matches!(e, SimError::Workload(_)), "{e}");
    // A follow-up made after the request it follows is over.
    let after = Arrival::After {
        request: 0,
        delay: Duration::from_millis(1),
    };
    let e = run(vec![at(0), at(60_000), at(120_000), after]).unwrap_err();
    assert!(matches!(e, SimError::Workload(_)), "{e}");
    // The same requests held whole run (a workload is taken whole).
    let w = Workload {
        block_size: 16,
        requests: [at(0), at(10), at(5), at(60_000), at(120_000), after]
            .into_iter()
            .map(|arrival| SimRequest {
                arrival,
                locals: vec![].into(),
                prompt_tokens: 10,
                output_tokens: 2,
            })
            .collect(),
    };
    assert!(sim.run(&w, &mut |_| {}).is_ok());
}

#[test]
fn a_workload_reshaped_whole_is_the_one_its_methods_make() {
    let shapes = [
        Reshape::default(),
        Reshape {
            copies: 2,
            spread: LengthSpread {
                prompt: Some(Dispersion::Uniform(0.4)),
                output: Some(Dispersion::Lognormal(0.2)),
            },
            seed: 4,
            speedup: 1.5,
            warp: RateWarp::new(&[(0.0, 2.0), (1.0, 0.5)]).unwrap(),
        },
        Reshape {
            copies: 3,
            ..Reshape::default()
        },
    ];
    for shape in shapes {
        let reshaped = generate(&sessions(), 16).reshaped(shape.clone()).unwrap();
        assert_eq!(reshaped, whole(&sessions(), &shape), "{shape:?}");
    }
}
