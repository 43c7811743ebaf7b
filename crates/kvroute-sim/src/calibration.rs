//! Calibration against real vLLM runs: fitting the calibrated timing model
//! ([`kvroute_engine::timing::Calibrated`]) and judging it by simulating each run.
//!
//! A run ([`CalibrationRun`]) is one engine (model, GPU, tensor-parallel degree, limits) under a
//! `shared_prefix` profile, with what was measured. [`fit`] finds the coefficients in two steps:
//!
//! 1. **Step time**, by non-negative weighted least squares on relative error over two kinds of
//!    rows: traced steps ([`StepSample`], each pass's composition against the time to the next
//!    step's start), and each run's *average step*: per stage, `λ·(E2E − TTFT)` requests
//!    decoding (Little's law), each with its prompt and half its output as context, and the
//!    `λ·ITL*` requests arriving in a step prefilling what the cache does not hold, weighed by
//!    the tokens the stage generates, against the run's ITL\*. Both go through the one basis
//!    ([`Basis::terms`]) the engine runs.
//! 2. **Per-request overhead**: each run simulated with those step coefficients; seconds `a`
//!    and steps `b` (both at least 0) such that `a + b·ITL` best matches, in relative terms,
//!    what the simulated mean TTFT lacks against the measured one ([`overheads`]).
//!
//! Runs marked saturated (most requests failed upstream; [`CalibrationRun::saturated`]) take
//! no part in fitting. Everything is deterministic: the same runs give the same coefficients.

use std::time::Duration;

use kvroute_engine::timing::{Basis, CalibratedCoefficients, CalibratedConfig, PassShape, TERMS};
use kvroute_engine::{EngineConfig, GpuSpec, ModelSpec, SpecError, TimingConfig};

use crate::config::SimConfig;
use crate::error::SimError;
use crate::profile_workload::SharedPrefixProfile;
use crate::{Simulation, Workload};

/// Why a calibration could not be done.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CalibrationError {
    /// A run's model or GPU cannot be timed.
    #[error("run {run}: {source}")]
    Spec {
        /// The run.
        run: String,
        /// Why.
        source: SpecError,
    },
    /// A run's simulation failed.
    #[error("run {run}: {source}")]
    Sim {
        /// The run.
        run: String,
        /// Why.
        source: SimError,
    },
    /// Nothing to fit on.
    #[error("no unsaturated run to fit on")]
    NoRuns,
}

/// One engine as a run configured it.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSetup {
    /// The model served.
    pub model: ModelSpec,
    /// The GPU.
    pub gpu: GpuSpec,
    /// GPUs the model is split over.
    pub tensor_parallel: u32,
    /// vLLM's `max_num_seqs`.
    pub max_num_seqs: u32,
    /// vLLM's `max_num_batched_tokens`.
    pub max_num_batched_tokens: u32,
    /// vLLM's `max_model_len`.
    pub max_model_len: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// GPU KV blocks.
    pub num_blocks: u32,
}

impl EngineSetup {
    /// The step-time basis of this engine.
    pub fn basis(&self) -> Result<Basis, SpecError> {
        Basis::new(self.model.clone(), self.gpu.clone(), self.tensor_parallel)
    }

    /// The engine's configuration, timed by `coefficients`.
    pub fn engine_config(&self, coefficients: &CalibratedCoefficients) -> EngineConfig {
        let calibrated = CalibratedConfig {
            coefficients: *coefficients,
            model: None,
            gpu: None,
            tensor_parallel: None,
        }
        .for_engine(self.model.clone(), self.gpu.clone(), self.tensor_parallel);
        EngineConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            external_hash_seed: 0,
            speedup: 1.0,
            timing: TimingConfig::Calibrated(calibrated),
            step_jitter: None,
            cpu_offload: None,
        }
    }
}

/// What a run measured (or what a simulation predicts), milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Latencies {
    /// Mean time to first token.
    pub ttft_mean_ms: f64,
    /// 90th percentile of time to first token, if known.
    pub ttft_p90_ms: Option<f64>,
    /// Mean end-to-end latency.
    pub e2e_mean_ms: f64,
    /// 90th percentile of end-to-end latency, if known.
    pub e2e_p90_ms: Option<f64>,
    /// ITL\* = (E2E mean − TTFT mean) / (mean output tokens − 1).
    pub itl_ms: f64,
}

/// A real run: its engine, its workload and what it measured.
#[derive(Clone, Debug, PartialEq)]
pub struct CalibrationRun {
    /// The run's name.
    pub id: String,
    /// The engine.
    pub engine: EngineSetup,
    /// The workload (its prompt and output lengths as the run saw them).
    pub profile: SharedPrefixProfile,
    /// What was measured.
    pub measured: Latencies,
    /// Whether most requests failed upstream (metrics over the survivors only): such a run is
    /// not fitted on and is reported apart.
    pub saturated: bool,
}

/// One traced engine step of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepSample {
    /// Index of its run in the runs handed to [`fit`].
    pub run: usize,
    /// The pass.
    pub shape: PassShape,
    /// Seconds from this step's start to the next one's.
    pub gap_secs: f64,
}

/// How to fit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitOptions {
    /// Weight of all step rows of one run together, relative to one run summary's row.
    pub steps_weight_per_run: f64,
    /// Each stage of the simulations that fit the request overhead lasts at most this long.
    pub overhead_stage_cap: Duration,
}

impl Default for FitOptions {
    /// Each traced run's steps weigh as much as two run summaries; overhead simulations cap
    /// stages at 120 s.
    fn default() -> Self {
        Self {
            steps_weight_per_run: 2.0,
            overhead_stage_cap: Duration::from_secs(120),
        }
    }
}

/// One least-squares row: terms, target, weight.
pub type Row = ([f64; TERMS], f64, f64);

/// The run's average step per stage, and the share of generated tokens each stage has.
pub fn average_steps(run: &CalibrationRun) -> Vec<(PassShape, f64)> {
    let m = &run.measured;
    let p = &run.profile;
    let decode_secs = ((m.e2e_mean_ms - m.ttft_mean_ms) / 1e3).max(0.0);
    let itl = m.itl_ms / 1e3;
    let input = f64::from(p.system_prompt_tokens + p.question_tokens);
    let output = f64::from(p.output_tokens);
    let bs = run.engine.block_size.max(1);
    let prompt = p.system_prompt_tokens + p.question_tokens;
    // A prompt sent again finds all its full blocks cached but the last token's.
    let new = f64::from(prompt - prompt.saturating_sub(1) / bs * bs).max(1.0);
    let context = input - new;
    let total: f64 = p
        .stages
        .iter()
        .map(|s| s.rate_rps * s.duration.as_secs_f64())
        .sum();
    p.stages
        .iter()
        .map(|s| {
            let decode = (s.rate_rps * decode_secs).min(f64::from(run.engine.max_num_seqs));
            let prefill = s.rate_rps * itl;
            let shape = PassShape {
                prefill_seqs: prefill,
                prefill_tokens: prefill * new,
                prefill_context_tokens: prefill * context,
                prefill_attention_pairs: prefill * (new * context + new * (new + 1.0) / 2.0),
                decode_seqs: decode,
                decode_context_tokens: decode * (input + output / 2.0),
            };
            let share = s.rate_rps * s.duration.as_secs_f64() / total.max(f64::MIN_POSITIVE);
            (shape, share)
        })
        .collect()
}

/// The ITL\* the run's average steps ([`average_steps`]) take with `coefficients`: what the
/// step-time fit matches to the measured ITL\*.
pub fn average_step_itl_ms(
    run: &CalibrationRun,
    coefficients: &CalibratedCoefficients,
) -> Result<f64, SpecError> {
    let basis = run.engine.basis()?;
    Ok(average_steps(run)
        .iter()
        .map(|(shape, share)| share * basis.step_secs(coefficients, shape))
        .sum::<f64>()
        * 1e3)
}

/// The rows of the step-time fit.
fn rows(
    runs: &[CalibrationRun],
    steps: &[StepSample],
    options: &FitOptions,
) -> Result<Vec<Row>, CalibrationError> {
    let mut rows = Vec::new();
    let mut bases = Vec::with_capacity(runs.len());
    for run in runs {
        bases.push(run.engine.basis().map_err(|source| CalibrationError::Spec {
            run: run.id.clone(),
            source,
        })?);
    }
    for (run, basis) in runs.iter().zip(&bases) {
        if run.saturated || run.measured.itl_ms.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let mut terms = [0.0; TERMS];
        for (shape, share) in average_steps(run) {
            for (t, x) in terms.iter_mut().zip(basis.terms(&shape)) {
                *t += share * x;
            }
        }
        let target = run.measured.itl_ms / 1e3;
        rows.push((terms, target, 1.0 / target));
    }
    let mut per_run = vec![0usize; runs.len()];
    for s in steps {
        if let Some(n) = per_run.get_mut(s.run) {
            *n += 1;
        }
    }
    for s in steps {
        let (Some(run), Some(basis)) = (runs.get(s.run), bases.get(s.run)) else {
            continue;
        };
        if run.saturated || s.gap_secs.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            continue;
        }
        let share = options.steps_weight_per_run / per_run[s.run] as f64;
        rows.push((basis.terms(&s.shape), s.gap_secs, share.sqrt() / s.gap_secs));
    }
    Ok(rows)
}

/// The least value of each coefficient: the multiples of work at peak (weights, KV,
/// prefill FLOPs, all-reduces) are at least 1, as nothing runs faster than its peak; decode
/// FLOPs overlap the weights' reading (a decode step is memory-bound), so their multiple and
/// the fixed costs are at least 0.
pub const LOWER_BOUNDS: [f64; TERMS] = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0];

/// Least squares with each coefficient at least its [`LOWER_BOUNDS`]: [`nnls`] on what the
/// bounds leave of each target.
pub fn bounded_least_squares(rows: &[Row]) -> [f64; TERMS] {
    let shifted: Vec<Row> = rows
        .iter()
        .map(|(terms, target, w)| {
            let floor: f64 = terms.iter().zip(LOWER_BOUNDS).map(|(t, l)| t * l).sum();
            (*terms, target - floor, *w)
        })
        .collect();
    let x = nnls(&shifted);
    std::array::from_fn(|i| x[i] + LOWER_BOUNDS[i])
}

/// Non-negative least squares: the `x ≥ 0` minimising `Σ (w·(terms·x − target))²`, by cyclic
/// coordinate descent on the normal equations with the columns scaled to unit norm (a fixed
/// number of sweeps, so deterministic). A column of zeros gets 0.
pub fn nnls(rows: &[Row]) -> [f64; TERMS] {
    let mut scale = [0.0f64; TERMS];
    for (terms, _, w) in rows {
        for (s, t) in scale.iter_mut().zip(terms) {
            *s += (w * t) * (w * t);
        }
    }
    let scale = scale.map(|s| if s > 0.0 { s.sqrt() } else { 0.0 });
    let mut ata = [[0.0f64; TERMS]; TERMS];
    let mut atb = [0.0f64; TERMS];
    for (terms, target, w) in rows {
        let a: [f64; TERMS] = std::array::from_fn(|i| {
            if scale[i] > 0.0 {
                w * terms[i] / scale[i]
            } else {
                0.0
            }
        });
        for i in 0..TERMS {
            atb[i] += a[i] * w * target;
            for j in 0..TERMS {
                ata[i][j] += a[i] * a[j];
            }
        }
    }
    let mut x = [0.0f64; TERMS];
    for _ in 0..20_000 {
        for i in 0..TERMS {
            if ata[i][i] <= 0.0 {
                continue;
            }
            let r: f64 = atb[i]
                - (0..TERMS)
                    .filter(|&j| j != i)
                    .map(|j| ata[i][j] * x[j])
                    .sum::<f64>();
            x[i] = (r / ata[i][i]).max(0.0);
        }
    }
    std::array::from_fn(|i| if scale[i] > 0.0 { x[i] / scale[i] } else { 0.0 })
}

/// Fits the calibrated model on `runs` (saturated ones left out) and the traced `steps`.
pub fn fit(
    runs: &[CalibrationRun],
    steps: &[StepSample],
    options: &FitOptions,
) -> Result<CalibratedCoefficients, CalibrationError> {
    let rows = rows(runs, steps, options)?;
    if rows.is_empty() {
        return Err(CalibrationError::NoRuns);
    }
    let step = CalibratedCoefficients::from_array(bounded_least_squares(&rows), 0.0);
    // Per run: what TTFT lacks against the measure, and the simulated mean inter-token time.
    let mut points = Vec::new();
    for run in runs.iter().filter(|r| !r.saturated) {
        let sim = simulate(run, &step, Some(options.overhead_stage_cap))?;
        let real = run.measured.ttft_mean_ms / 1e3;
        points.push((
            real - sim.latencies.ttft_mean_ms / 1e3,
            sim.latencies.itl_ms / 1e3,
            1.0 / real,
        ));
    }
    let (secs, steps) = overheads(&points);
    Ok(CalibratedCoefficients {
        request_overhead_secs: secs,
        request_overhead_steps: steps,
        ..step
    })
}

/// The `a, b ≥ 0` minimising `Σ |w·(a + b·x − y)|` over `(y, x, w)` points: the request
/// overhead's seconds and steps. Absolute, not squared, errors, so that a run the simulation
/// gets far wrong (one near saturation, whose queue grows without bound) does not pull the
/// overheads of all the others: iteratively reweighted least squares, a fixed number of rounds.
pub fn overheads(points: &[(f64, f64, f64)]) -> (f64, f64) {
    let (mut a, mut b) = (0.0f64, 0.0f64);
    let mut weights: Vec<f64> = points.iter().map(|p| p.2).collect();
    for _ in 0..100 {
        let w = &weights;
        let solve_b = |a: f64| {
            let (num, den) = points.iter().zip(w).fold((0.0, 0.0), |(n, d), ((y, x, _), w)| {
                (n + w * w * x * (y - a), d + w * w * x * x)
            });
            if den > 0.0 { (num / den).max(0.0) } else { 0.0 }
        };
        let solve_a = |b: f64| {
            let (num, den) = points.iter().zip(w).fold((0.0, 0.0), |(n, d), ((y, x, _), w)| {
                (n + w * w * (y - b * x), d + w * w)
            });
            if den > 0.0 { (num / den).max(0.0) } else { 0.0 }
        };
        for _ in 0..50 {
            b = solve_b(a);
            a = solve_a(b);
        }
        // Squared weight over |residual| turns squares into absolute values.
        weights = points
            .iter()
            .map(|(y, x, w)| {
                let r = (w * (a + b * x - y)).abs().max(1e-3);
                w / r.sqrt()
            })
            .collect();
    }
    (a, b)
}

/// What a simulation of a run gave.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Simulated {
    /// Latencies, the request overhead included.
    pub latencies: Latencies,
    /// Requests offered.
    pub requests: usize,
    /// Requests completed.
    pub completed: usize,
}

/// The run's workload, its stages each cut to `stage_cap` if given.
pub fn workload(run: &CalibrationRun, stage_cap: Option<Duration>) -> Workload {
    let mut profile = run.profile.clone();
    if let Some(cap) = stage_cap {
        for s in &mut profile.stages {
            s.duration = s.duration.min(cap);
        }
    }
    profile.generate(run.engine.block_size)
}

/// Simulates `run` on one engine timed by `coefficients` (stages cut to `stage_cap` if given),
/// the request overhead added to every request's TTFT and E2E.
pub fn simulate(
    run: &CalibrationRun,
    coefficients: &CalibratedCoefficients,
    stage_cap: Option<Duration>,
) -> Result<Simulated, CalibrationError> {
    let err = |source| CalibrationError::Sim {
        run: run.id.clone(),
        source,
    };
    let mut config = SimConfig::new(1);
    config.engine = run.engine.engine_config(coefficients);
    config.router.block_size = run.engine.block_size;
    config.sample_interval = None;
    config.gpus_per_worker = run.engine.tensor_parallel;
    let workload = workload(run, stage_cap);
    let result = Simulation::new(config)
        .map_err(err)?
        .run(&workload, &mut |_| {})
        .map_err(err)?;
    let out = f64::from(run.profile.output_tokens);
    let (secs, steps) = (
        coefficients.request_overhead_secs * 1e3,
        coefficients.request_overhead_steps,
    );
    // Each request's overhead: seconds, and steps as long as its own mean inter-token time.
    let overhead: Vec<f64> = result
        .ttft_ms
        .iter()
        .zip(&result.e2e_ms)
        .map(|(t, e)| {
            secs + if out > 1.0 {
                steps * (e - t) / (out - 1.0)
            } else {
                0.0
            }
        })
        .collect();
    let mut ttft: Vec<f64> = result.ttft_ms.iter().zip(&overhead).map(|(t, o)| t + o).collect();
    let mut e2e: Vec<f64> = result.e2e_ms.iter().zip(&overhead).map(|(t, o)| t + o).collect();
    let ttft_mean = mean(&ttft);
    let e2e_mean = mean(&e2e);
    let itl = if out > 1.0 {
        (e2e_mean - ttft_mean) / (out - 1.0)
    } else {
        0.0
    };
    Ok(Simulated {
        latencies: Latencies {
            ttft_mean_ms: ttft_mean,
            ttft_p90_ms: percentile(&mut ttft, 0.9),
            e2e_mean_ms: e2e_mean,
            e2e_p90_ms: percentile(&mut e2e, 0.9),
            itl_ms: itl,
        },
        requests: workload.requests.len(),
        completed: result.e2e_ms.len(),
    })
}

/// Leave-one-group-out cross-validation: for each distinct `group(run)` (in order of first
/// appearance), fits on the other groups' runs and steps and simulates the group's runs.
/// Returns, per run, the group's fit and the simulation (or why it failed).
pub fn cross_validate(
    runs: &[CalibrationRun],
    steps: &[StepSample],
    options: &FitOptions,
    group: &dyn Fn(&CalibrationRun) -> String,
) -> Vec<Result<Simulated, CalibrationError>> {
    let mut groups: Vec<String> = Vec::new();
    for r in runs {
        let g = group(r);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let mut out: Vec<Option<Result<Simulated, CalibrationError>>> = runs.iter().map(|_| None).collect();
    for g in &groups {
        let train: Vec<usize> = (0..runs.len()).filter(|&i| group(&runs[i]) != *g).collect();
        let train_runs: Vec<CalibrationRun> = train.iter().map(|&i| runs[i].clone()).collect();
        let train_steps: Vec<StepSample> = steps
            .iter()
            .filter_map(|s| {
                let at = train.iter().position(|&i| i == s.run)?;
                Some(StepSample { run: at, ..*s })
            })
            .collect();
        let fitted = fit(&train_runs, &train_steps, options);
        for (i, run) in runs.iter().enumerate().filter(|(_, r)| group(r) == *g) {
            out[i] = Some(match &fitted {
                Ok(c) => simulate(run, c, None),
                Err(_) => Err(CalibrationError::NoRuns),
            });
        }
    }
    out.into_iter()
        .map(|r| r.unwrap_or(Err(CalibrationError::NoRuns)))
        .collect()
}

/// The mean, 0 for none.
fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// The `q` quantile by nearest rank, `None` for none.
pub fn percentile(xs: &mut [f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let rank = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len());
    Some(xs[rank - 1])
}

/// The median (mean of the middle two for an even count), `None` for none.
pub fn median(xs: &mut [f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    Some(if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    })
}
