//! Reality's noise (`Noise`, `LengthSpread`): off is the run without it, zero amounts change
//! nothing, the same seed gives byte-identical reports with every noise on, fast-forward still
//! changes nothing, each noise does what it says, and the end-of-run invariants hold throughout.

use std::time::Duration;

mod common;

use common::{count, run, shrink};
use kvroute_core::router::PolicyConfig;
use kvroute_sim::synthetic::{Lengths, SyntheticConfig, generate};
use kvroute_sim::{
    ArrivalMode, Dispersion, HttpLatency, LengthSpread, Noise, RunResult, SimConfig, SimError, Simulation,
    WorkerSpeed, Workload,
};
use proptest::prelude::*;

const WORKERS: usize = 4;

fn config(policy: &str) -> SimConfig {
    let mut config = shrink(SimConfig::new(WORKERS));
    config.router.policy = PolicyConfig::from_name(policy).expect("a policy name");
    config
}

fn workload(seed: u64, requests: usize) -> Workload {
    generate(
        &SyntheticConfig {
            requests,
            rate_rps: 40.0,
            isl: Lengths::Uniform { min: 32, max: 400 },
            osl: Lengths::Uniform { min: 1, max: 40 },
            prefix_groups: 4,
            shared_prefix_tokens: 128,
            turns_per_session: 2,
            think_time: Duration::from_millis(200),
            seed,
            ..SyntheticConfig::default()
        },
        16,
    )
}

fn json(result: &RunResult) -> String {
    serde_json::to_string(&result.report).expect("serializable")
}

/// Each noise alone, and all of them together.
fn noises() -> Vec<(&'static str, LengthSpread, Noise)> {
    let http = HttpLatency {
        delay: Duration::from_millis(3),
        jitter: Some(Dispersion::Lognormal(0.5)),
    };
    let lengths = LengthSpread {
        prompt: Some(Dispersion::Lognormal(0.6)),
        output: Some(Dispersion::Uniform(0.5)),
    };
    let all = Noise {
        step_jitter: Some(Dispersion::Lognormal(0.3)),
        worker_speed: WorkerSpeed::Drawn(Dispersion::Uniform(0.4)),
        http: Some(http),
    };
    vec![
        ("lengths", lengths, Noise::default()),
        (
            "jitter",
            LengthSpread::default(),
            Noise {
                step_jitter: Some(Dispersion::Uniform(0.5)),
                ..Noise::default()
            },
        ),
        (
            "speeds",
            LengthSpread::default(),
            Noise {
                worker_speed: WorkerSpeed::Given(vec![1.0, 0.5, 2.0, 1.0]),
                ..Noise::default()
            },
        ),
        (
            "http",
            LengthSpread::default(),
            Noise {
                http: Some(http),
                ..Noise::default()
            },
        ),
        ("all", lengths, all),
    ]
}

fn spread(workload: &Workload, lengths: &LengthSpread, seed: u64) -> Workload {
    let mut w = workload.clone();
    w.spread_lengths(lengths, seed).expect("valid spread");
    w
}

#[test]
fn zero_amounts_give_the_run_without_noise_byte_for_byte() {
    let base = workload(1, 120);
    let zero = LengthSpread {
        prompt: Some(Dispersion::Lognormal(0.0)),
        output: Some(Dispersion::Uniform(0.0)),
    };
    assert_eq!(
        spread(&base, &zero, 5),
        base,
        "a spread of zero keeps the workload"
    );
    for policy in ["kv", "least-loaded", "round-robin"] {
        let off = run(config(policy), &base);
        let mut c = config(policy);
        c.noise = Noise {
            step_jitter: Some(Dispersion::Uniform(0.0)),
            worker_speed: WorkerSpeed::Given(vec![1.0]),
            http: None,
        };
        let zeroed = run(c, &base);
        assert_eq!(json(&zeroed), json(&off), "{policy}");
        assert_eq!(zeroed.requests, off.requests, "{policy}");
    }
}

#[test]
fn every_noise_keeps_the_invariants_and_the_same_seed_gives_the_same_report() {
    let base = workload(2, 120);
    for policy in ["kv", "least-loaded"] {
        let off = json(&run(config(policy), &base));
        for (name, lengths, noise) in noises() {
            let w = spread(&base, &lengths, 0);
            let mut c = config(policy);
            c.noise = noise;
            // `run` fails on a broken invariant.
            let a = run(c.clone(), &w);
            let b = run(c.clone(), &w);
            assert_eq!(count(&a, "completed_requests"), 120, "{policy} {name}");
            assert_eq!(json(&a), json(&b), "{policy} {name}");
            assert_eq!(a.requests, b.requests, "{policy} {name}");
            assert_ne!(json(&a), off, "{policy} {name}: the noise changes the run");
            if name == "speeds" {
                // Given speeds draw nothing.
                continue;
            }
            c.seed = 7;
            let w7 = spread(&base, &lengths, 7);
            assert_ne!(json(&run(c, &w7)), json(&a), "{policy} {name}: the seed matters");
        }
    }
}

#[test]
fn fast_forward_changes_nothing_with_noise_on() {
    let base = workload(3, 120);
    for (name, lengths, noise) in noises() {
        let w = spread(&base, &lengths, 0);
        let mut c = config("kv");
        c.noise = noise;
        c.arrivals = ArrivalMode::Closed { concurrency: 24 };
        let on = run(c.clone(), &w);
        c.fast_forward = false;
        let off = run(c, &w);
        assert_eq!(json(&on), json(&off), "{name}");
        assert_eq!(on.requests, off.requests, "{name}");
    }
}

#[test]
fn http_latency_is_in_every_ttft_twice() {
    let w = workload(4, 120);
    let delay = Duration::from_millis(7);
    for closed in [false, true] {
        let mut c = config("kv");
        if closed {
            c.arrivals = ArrivalMode::Closed { concurrency: 16 };
        }
        c.noise.http = Some(HttpLatency { delay, jitter: None });
        let result = run(c, &w);
        assert_eq!(result.requests.len(), 120);
        for r in &result.requests {
            let (routed, ttft, e2e) = (
                r.routed_ms.unwrap(),
                r.ttft_ms.unwrap(),
                r.e2e_latency_ms.unwrap(),
            );
            let wait = routed - r.arrival_ms;
            assert!(
                ttft >= wait + 14.0 - 1e-6,
                "request {}: TTFT {ttft} ms, wait {wait}",
                r.id
            );
            assert!(e2e >= ttft, "request {}", r.id);
        }
    }
}

#[test]
fn tpot_is_measured_on_the_clients_clock_under_http_jitter() {
    // Short outputs and a wide HTTP jitter: a request's last token often leaves its engine
    // before its first token reaches the client. TPOT runs from the first token received to the
    // last received (with the completion), so it stays within the request's E2E.
    let w = workload(6, 200);
    let mut c = config("kv");
    c.noise.http = Some(HttpLatency {
        delay: Duration::from_millis(20),
        jitter: Some(Dispersion::Lognormal(1.5)),
    });
    let result = run(c, &w);
    let number = |key: &str| {
        result
            .report
            .number(key)
            .unwrap_or_else(|| panic!("{key} in the report"))
    };
    let (max_tpot, max_e2e) = (number("max_tpot_ms"), number("max_e2e_latency_ms"));
    assert!(
        max_tpot.is_finite() && max_tpot > 0.0 && max_tpot <= max_e2e,
        "TPOT max {max_tpot} ms against E2E max {max_e2e} ms"
    );
}

#[test]
fn a_slower_worker_takes_longer_over_the_same_requests() {
    // Round-robin gives each worker the same share; worker 1 runs at half speed.
    let w = workload(5, 120);
    let mut c = config("round-robin");
    c.noise.worker_speed = WorkerSpeed::Given(vec![1.0, 0.5, 1.0, 1.0]);
    let slow = run(c, &w);
    let mean = |worker: u64| {
        let e2e: Vec<f64> = slow
            .requests
            .iter()
            .filter(|r| r.worker == Some(worker))
            .map(|r| r.e2e_latency_ms.unwrap() / f64::from(r.output_tokens.max(1)))
            .collect();
        e2e.iter().sum::<f64>() / e2e.len() as f64
    };
    assert!(mean(1) > 1.5 * mean(0), "slow {} vs {}", mean(1), mean(0));
}

#[test]
fn bad_noise_is_refused_by_name() {
    for (noise, word) in [
        (
            Noise {
                step_jitter: Some(Dispersion::Uniform(1.5)),
                ..Noise::default()
            },
            "step jitter",
        ),
        (
            Noise {
                worker_speed: WorkerSpeed::Given(vec![1.0, 0.0]),
                ..Noise::default()
            },
            "worker speed",
        ),
        (
            Noise {
                worker_speed: WorkerSpeed::Given(Vec::new()),
                ..Noise::default()
            },
            "worker speed",
        ),
        (
            Noise {
                http: Some(HttpLatency {
                    delay: Duration::from_millis(1),
                    jitter: Some(Dispersion::Lognormal(f64::NAN)),
                }),
                ..Noise::default()
            },
            "HTTP jitter",
        ),
    ] {
        let mut c = config("kv");
        c.noise = noise;
        match Simulation::new(c) {
            Err(SimError::Config(e)) => assert!(e.contains(word), "{e}"),
            other => panic!("{word}: {other:?}"),
        }
    }
    let bad = LengthSpread {
        prompt: Some(Dispersion::Lognormal(-1.0)),
        output: None,
    };
    let e = workload(0, 4).spread_lengths(&bad, 0).unwrap_err();
    assert!(e.contains("prompt length spread"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A spread prompt keeps every block before its own tail and the first blocks of its tail,
    /// its length stays consistent with its blocks, and its tail is scaled by at most the
    /// spread (rounding aside).
    #[test]
    fn a_spread_prompt_keeps_what_it_shares(seed in any::<u64>(), a in 0.0f64..0.95, lognormal in any::<bool>()) {
        let base = workload(seed % 16, 40);
        let d = if lognormal { Dispersion::Lognormal(a) } else { Dispersion::Uniform(a) };
        let spread = spread(&base, &LengthSpread { prompt: Some(d), output: Some(d) }, seed);
        let bs = base.block_size;
        for (before, after) in base.requests.iter().zip(&spread.requests) {
            prop_assert_eq!(after.locals.len() as u32, after.prompt_tokens / bs);
            prop_assert!(after.prompt_tokens >= 1 && after.output_tokens >= 1);
            let (old, new) = (before.locals.to_vec(), after.locals.to_vec());
            let common = old.len().min(new.len());
            prop_assert_eq!(&old[..common], &new[..common]);
            prop_assert_eq!(after.arrival, before.arrival);
            if !lognormal {
                let (o, n) = (f64::from(before.output_tokens), f64::from(after.output_tokens));
                prop_assert!(n <= (o * (1.0 + a)).round().max(1.0) && n >= (o * (1.0 - a)).round().max(1.0));
                // The tail is what follows the shared blocks; the whole prompt stays within
                // the same bounds around its tail.
                let (o, n) = (f64::from(before.prompt_tokens), f64::from(after.prompt_tokens));
                prop_assert!(n <= o * (1.0 + a) + 1.0);
            }
        }
    }
}
