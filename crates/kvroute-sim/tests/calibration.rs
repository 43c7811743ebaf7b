//! The calibration's fit: from step times made by known coefficients over engines of several
//! models, GPUs and tensor-parallel degrees, it recovers those coefficients; a simulation of a
//! run is deterministic and its latencies are consistent.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvroute_engine::timing::{Basis, CalibratedCoefficients, PassShape, TERMS};
use kvroute_engine::{GpuSpec, ModelSpec};
use kvroute_sim::calibration::{CalibrationRun, EngineSetup, Latencies, nnls, simulate};
use kvroute_sim::profile_workload::{SharedPrefixProfile, parse_rate_stages};
use proptest::prelude::*;

fn engines() -> Vec<Basis> {
    let mut out = Vec::new();
    for (model, gpu, tp) in [
        ("llama-3.1-8b", "h100-sxm", 1),
        ("llama-3.1-70b", "h100-sxm", 4),
        ("mixtral-8x7b", "a100-sxm-80gb", 2),
        ("qwen2.5-7b", "l40s", 1),
        ("llama-3.1-8b", "h200-sxm", 2),
    ] {
        out.push(
            Basis::new(
                ModelSpec::builtin(model).unwrap(),
                GpuSpec::builtin(gpu).unwrap(),
                tp,
            )
            .unwrap(),
        );
    }
    out
}

fn shape(decode: f64, prefill_tokens: f64, context: f64) -> PassShape {
    let prefill_seqs = if prefill_tokens > 0.0 { 1.0 } else { 0.0 };
    PassShape {
        prefill_seqs,
        prefill_tokens,
        prefill_context_tokens: prefill_seqs * context,
        prefill_attention_pairs: prefill_tokens * context + prefill_tokens * (prefill_tokens + 1.0) / 2.0,
        decode_seqs: decode,
        decode_context_tokens: decode * context,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Exact step times of known, non-negative coefficients are fitted back to within 1% of
    /// each predicted step.
    #[test]
    fn the_fit_recovers_known_coefficients(
        truth in prop::array::uniform10(0.0f64..3.0),
        zeroed in prop::array::uniform10(any::<bool>()),
        passes in prop::collection::vec((1.0f64..256.0, 0.0f64..2048.0, 16.0f64..4096.0), 40..80),
    ) {
        // Fixed costs in seconds near real ones: ms per step, µs per layer, sequence, token.
        let scales = [1e-3, 1e-5, 1e-5, 1e-5, 1e-6, 1.0, 1.0, 1.0, 1.0, 1.0];
        let coefficients: [f64; TERMS] =
            std::array::from_fn(|i| if zeroed[i] { 0.0 } else { truth[i] * scales[i] });
        let c = CalibratedCoefficients::from_array(coefficients, 0.0);
        let engines = engines();
        let mut rows = Vec::new();
        for (i, &(d, p, ctx)) in passes.iter().enumerate() {
            let basis = &engines[i % engines.len()];
            let s = shape(d.round(), p.round(), ctx.round());
            let y = basis.step_secs(&c, &s);
            prop_assume!(y > 0.0);
            rows.push((basis.terms(&s), y, 1.0 / y));
        }
        let fitted = CalibratedCoefficients::from_array(nnls(&rows), 0.0);
        for (terms, y, _) in &rows {
            let got: f64 = terms.iter().zip(fitted.as_array()).map(|(t, c)| t * c).sum();
            prop_assert!((got - y).abs() <= 0.01 * y, "{got} vs {y}");
        }
        prop_assert!(fitted.as_array().iter().all(|x| *x >= 0.0));
    }
}

/// With well-spread passes the coefficients themselves come back.
#[test]
fn the_fit_recovers_the_coefficients_themselves() {
    let c = CalibratedCoefficients::from_array([3e-3, 2e-5, 1e-5, 4e-5, 2e-7, 1.3, 1.6, 1.9, 2.5, 1.2], 0.0);
    let engines = engines();
    let mut rows = Vec::new();
    for (i, basis) in engines.iter().enumerate() {
        for d in [1.0, 8.0, 32.0, 128.0] {
            for p in [0.0, 64.0, 512.0, 2048.0] {
                for ctx in [128.0, 1024.0, 4096.0 + 100.0 * i as f64] {
                    let s = shape(d, p, ctx);
                    let y = basis.step_secs(&c, &s);
                    rows.push((basis.terms(&s), y, 1.0 / y));
                }
            }
        }
    }
    let got = nnls(&rows);
    for (g, t) in got.iter().zip(c.as_array()) {
        assert!((g - t).abs() <= 0.02 * t, "{got:?} vs {:?}", c.as_array());
    }
}

fn run() -> CalibrationRun {
    CalibrationRun {
        id: "small".to_owned(),
        engine: EngineSetup {
            model: ModelSpec::builtin("llama-3.1-8b").unwrap(),
            gpu: GpuSpec::builtin("h100-sxm").unwrap(),
            tensor_parallel: 1,
            max_num_seqs: 128,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            block_size: 16,
            num_blocks: 4096,
        },
        profile: SharedPrefixProfile {
            prefix_groups: 3,
            users_per_group: 2,
            system_prompt_tokens: 100,
            question_tokens: 300,
            output_tokens: 50,
            stages: parse_rate_stages("4x20;8x10").unwrap(),
            seed: 1,
        },
        measured: Latencies::default(),
        saturated: false,
    }
}

#[test]
fn a_simulated_run_is_deterministic_and_its_latencies_consistent() {
    let c = CalibratedCoefficients::from_array([5e-3, 0.0, 0.0, 5e-5, 0.0, 1.5, 1.5, 2.0, 2.0, 1.0], 0.02);
    let a = simulate(&run(), &c, None).unwrap();
    assert_eq!(a, simulate(&run(), &c, None).unwrap());
    assert_eq!(a.completed, a.requests);
    let l = a.latencies;
    assert!(l.ttft_mean_ms >= 20.0, "the request overhead is in TTFT: {l:?}");
    assert!(l.e2e_mean_ms > l.ttft_mean_ms && l.e2e_p90_ms.unwrap() >= l.ttft_p90_ms.unwrap());
    // Every step costs at least 5 ms, so each of the 49 tokens after the first does.
    assert!(l.itl_ms >= 5.0, "{l:?}");
    let capped = simulate(&run(), &c, Some(Duration::from_secs(5))).unwrap();
    assert!(capped.requests < a.requests);
}
