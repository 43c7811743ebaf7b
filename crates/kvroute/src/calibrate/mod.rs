//! `kvroute calibrate DIR` (fit the calibrated timing model on real vLLM runs) and
//! `kvroute validate RUNS.csv` (simulate each run with it and print how far the simulator is
//! from what was measured). The fitting and the simulation are the simulator's
//! ([`kvroute_sim::calibration`]); this module reads the files and prints.

pub mod csv;
pub mod runs;

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use kvroute_engine::timing::{CALIBRATED_MODEL_FILE, CalibratedCoefficients, CalibratedConfig, TERM_NAMES};
use kvroute_sim::calibration::{
    self, CalibrationError, CalibrationRun, FitOptions, Latencies, Simulated, StepSample, median,
};
use serde_json::{Value, json};

use runs::{RowInfo, RunsFile};

/// `kvroute calibrate`.
#[derive(Args, Debug)]
pub struct CalibrateArgs {
    /// Folder with `calibration_runs.csv`, `models.csv`, `workload_profiles.csv` and, if there,
    /// `steps_calibration.csv.gz`.
    pub dir: PathBuf,
    /// Where to write the model file (TOML); without it, the file goes to stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Instead of writing a model file: leave each model out in turn, fit on the rest and
    /// print the held-out runs' fidelity table (`--by run`: each run in turn).
    #[arg(long)]
    pub cross_validate: bool,
    /// What cross-validation leaves out together.
    #[arg(long, value_enum, default_value_t = Fold::Model)]
    pub by: Fold,
    /// With `--cross-validate`: JSON lines, as `validate --json` prints them.
    #[arg(long)]
    pub json: bool,
}

/// What cross-validation holds out together.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fold {
    /// Every run of one model.
    Model,
    /// One run.
    Run,
}

/// `kvroute validate`.
#[derive(Args, Debug)]
pub struct ValidateArgs {
    /// A runs file in the format of `calibration_runs.csv`, with `models.csv` and
    /// `workload_profiles.csv` in its folder.
    pub runs: PathBuf,
    /// A calibrated model file (`kvroute calibrate --out`); the shipped fit without it.
    #[arg(long)]
    pub model_file: Option<PathBuf>,
    /// One JSON object per run, then a summary object, instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Cut every stage of every run to at most this many seconds: a quick look, not the
    /// runs as measured.
    #[arg(long)]
    pub max_stage_secs: Option<f64>,
}

/// The runs file, models and profiles of a folder.
fn load(runs_path: &Path) -> anyhow::Result<RunsFile> {
    let dir = runs_path.parent().unwrap_or(Path::new("."));
    let models = runs::read_models(&runs::read_table(&dir.join("models.csv"))?)?;
    let profiles = runs::read_profiles(&runs::read_table(&dir.join("workload_profiles.csv"))?)?;
    runs::read_runs(&runs::read_table(runs_path)?, &models, &profiles)
}

/// The runs that can be simulated, and the steps of those in the folder's step trace.
fn training_set(dir: &Path, file: &RunsFile) -> anyhow::Result<(Vec<CalibrationRun>, Vec<StepSample>)> {
    let runs: Vec<CalibrationRun> = file
        .runs
        .iter()
        .filter_map(|(_, _, r)| r.as_ref().ok().cloned())
        .collect();
    let steps_path = dir.join("steps_calibration.csv.gz");
    let steps = if steps_path.exists() {
        runs::read_steps(&runs::read_table(&steps_path)?, &runs)?
    } else {
        Vec::new()
    };
    Ok((runs, steps))
}

/// `kvroute calibrate`.
pub fn calibrate(args: CalibrateArgs) -> anyhow::Result<()> {
    let file = load(&args.dir.join("calibration_runs.csv"))?;
    for (id, _, r) in &file.runs {
        if let Err(reason) = r {
            eprintln!("calibrate: run {id} left out: {reason}");
        }
    }
    let (train, steps) = training_set(&args.dir, &file)?;
    let options = FitOptions::default();
    if args.cross_validate {
        let by = args.by;
        let group = move |r: &CalibrationRun| match by {
            Fold::Model => r.engine.model.name.clone(),
            Fold::Run => r.id.clone(),
        };
        let results = folds(&train, &steps, &options, &group);
        let mut results = results.into_iter();
        let rows: Vec<RowResult> = file
            .runs
            .iter()
            .map(|(id, info, r)| RowResult {
                id: id.clone(),
                info: info.clone(),
                outcome: match r {
                    Ok(run) => match results.next() {
                        Some(Ok(sim)) => Outcome::Simulated(Box::new(run.clone()), sim),
                        Some(Err(e)) => Outcome::Failed(e.to_string()),
                        None => Outcome::Failed("no result".to_owned()),
                    },
                    Err(reason) => Outcome::Failed(reason.clone()),
                },
            })
            .collect();
        let title = match by {
            Fold::Model => "leave-one-model-out cross-validation",
            Fold::Run => "leave-one-run-out cross-validation",
        };
        print_fidelity(&rows, args.json, title);
        return Ok(());
    }
    let coefficients = calibration::fit(&train, &steps, &options)?;
    let mut text = String::from(
        "# kvroute calibrated timing model: `kvroute calibrate` over the real vLLM calibration runs.\n",
    );
    text.push_str(&format!(
        "# Fitted on {} runs (saturated ones left out) and {} traced steps.\n",
        train.iter().filter(|r| !r.saturated).count(),
        steps.len()
    ));
    text.push_str(&coefficients.to_model_file());
    match &args.out {
        Some(path) => {
            std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("calibrate: wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    for (name, c) in TERM_NAMES.iter().zip(coefficients.as_array()) {
        eprintln!("  {name:>16} = {c:.6e}");
    }
    eprintln!(
        "  request_overhead_secs = {:.6e}",
        coefficients.request_overhead_secs
    );
    eprintln!(
        "  request_overhead_steps = {:.4}",
        coefficients.request_overhead_steps
    );
    eprintln!("ITL* of each run's average step (the step-time fit) against the measured:");
    for run in &train {
        let fitted = calibration::average_step_itl_ms(run, &coefficients)?;
        eprintln!(
            "  {:<52} {:>8.2} ms {:>8.2} ms {:>+6.1} %{}",
            run.id,
            fitted,
            run.measured.itl_ms,
            (fitted / run.measured.itl_ms - 1.0) * 100.0,
            if run.saturated {
                "  (saturated: not fitted)"
            } else {
                ""
            }
        );
    }
    Ok(())
}

/// Cross-validation over `group`'s folds.
fn folds(
    runs: &[CalibrationRun],
    steps: &[StepSample],
    options: &FitOptions,
    group: &(dyn Fn(&CalibrationRun) -> String + Sync),
) -> Vec<Result<Simulated, CalibrationError>> {
    calibration::cross_validate(runs, steps, options, &|r| group(r))
}

/// `kvroute validate`.
pub fn validate(args: ValidateArgs) -> anyhow::Result<()> {
    let coefficients = match &args.model_file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            CalibratedConfig::from_model_file(&text)
                .with_context(|| format!("model file {}", path.display()))?
                .coefficients
        }
        None => shipped_coefficients()?,
    };
    if !args.runs.exists() {
        bail!("runs file {} does not exist", args.runs.display());
    }
    let cap = match args.max_stage_secs {
        None => None,
        Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Some(std::time::Duration::from_secs_f64(s)),
        Some(s) => bail!("--max-stage-secs {s}: must be above zero"),
    };
    let file = load(&args.runs)?;
    let rows = simulate_all(&file, &coefficients, cap);
    let title = match cap {
        Some(c) => format!("validation, stages cut to {} s", c.as_secs_f64()),
        None => "validation".to_owned(),
    };
    print_fidelity(&rows, args.json, &title);
    Ok(())
}

/// The compiled-in model's coefficients.
pub fn shipped_coefficients() -> anyhow::Result<CalibratedCoefficients> {
    Ok(CalibratedConfig::from_model_file(CALIBRATED_MODEL_FILE)
        .context("the shipped calibrated model")?
        .coefficients)
}

/// A row's result.
enum Outcome {
    Simulated(Box<CalibrationRun>, Simulated),
    Failed(String),
}

struct RowResult {
    id: String,
    info: RowInfo,
    outcome: Outcome,
}

/// Simulates every run that can be, on up to two threads, keeping file order.
fn simulate_all(
    file: &RunsFile,
    coefficients: &CalibratedCoefficients,
    cap: Option<std::time::Duration>,
) -> Vec<RowResult> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(2));
    let jobs: Vec<&(String, RowInfo, Result<CalibrationRun, String>)> = file.runs.iter().collect();
    let mut results: Vec<Option<Outcome>> = jobs.iter().map(|_| None).collect();
    std::thread::scope(|scope| {
        let chunks: Vec<Vec<usize>> = (0..threads)
            .map(|t| (t..jobs.len()).step_by(threads).collect())
            .collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|idx| {
                let jobs = &jobs;
                scope.spawn(move || {
                    idx.into_iter()
                        .map(|i| {
                            let outcome = match &jobs[i].2 {
                                Ok(run) => match calibration::simulate(run, coefficients, cap) {
                                    Ok(sim) => Outcome::Simulated(Box::new(run.clone()), sim),
                                    Err(e) => Outcome::Failed(e.to_string()),
                                },
                                Err(reason) => Outcome::Failed(reason.clone()),
                            };
                            (i, outcome)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for h in handles {
            if let Ok(done) = h.join() {
                for (i, o) in done {
                    results[i] = Some(o);
                }
            }
        }
    });
    jobs.iter()
        .zip(results)
        .map(|((id, info, _), o)| RowResult {
            id: id.clone(),
            info: info.clone(),
            outcome: o.unwrap_or_else(|| Outcome::Failed("the simulation panicked".to_owned())),
        })
        .collect()
}

/// Absolute percentage error of `sim` against `real`.
fn ape(sim: f64, real: f64) -> f64 {
    (sim - real).abs() / real.abs() * 100.0
}

/// The five errors of a run: TTFT mean, TTFT p90, E2E mean, E2E p90, ITL.
fn errors(real: &Latencies, sim: &Latencies) -> [Option<f64>; 5] {
    let p = |s: Option<f64>, r: Option<f64>| Some(ape(s?, r?));
    [
        Some(ape(sim.ttft_mean_ms, real.ttft_mean_ms)),
        p(sim.ttft_p90_ms, real.ttft_p90_ms),
        Some(ape(sim.e2e_mean_ms, real.e2e_mean_ms)),
        p(sim.e2e_p90_ms, real.e2e_p90_ms),
        (real.itl_ms > 0.0).then(|| ape(sim.itl_ms, real.itl_ms)),
    ]
}

const METRICS: [&str; 5] = ["ttft_mean", "ttft_p90", "e2e_mean", "e2e_p90", "itl"];

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Prints the fidelity table (or JSON lines) and its summary.
fn print_fidelity(rows: &[RowResult], json: bool, title: &str) {
    // Per metric: headline errors (unsaturated runs), saturated runs' errors.
    let mut headline: [Vec<f64>; 5] = Default::default();
    let mut saturated: [Vec<f64>; 5] = Default::default();
    let (mut simulated, mut failed, mut n_saturated) = (0usize, 0usize, 0usize);
    if !json {
        println!("kvroute {title}: absolute % error of the simulated run against the measured one");
        println!(
            "{:<52} {:>5} {:>10} {:>3} {:>9} {:>9} {:>9} {:>9} {:>9}  note",
            "run", "group", "gpu", "tp", "TTFT mean", "TTFT p90", "E2E mean", "E2E p90", "ITL*"
        );
    }
    for row in rows {
        match &row.outcome {
            Outcome::Simulated(run, sim) => {
                simulated += 1;
                let e = errors(&run.measured, &sim.latencies);
                let bucket = if run.saturated {
                    n_saturated += 1;
                    &mut saturated
                } else {
                    &mut headline
                };
                for (b, x) in bucket.iter_mut().zip(e) {
                    if let Some(x) = x {
                        b.push(x);
                    }
                }
                let mut notes = row.info.assumptions.clone();
                if run.saturated {
                    notes.insert(0, "saturated upstream: left out of the medians".to_owned());
                }
                if sim.completed < sim.requests {
                    notes.push(format!(
                        "{} of {} requests unfinished",
                        sim.requests - sim.completed,
                        sim.requests
                    ));
                }
                if json {
                    let mut obj = json!({
                        "run_id": row.id,
                        "source_group": row.info.group,
                        "model": row.info.model,
                        "gpu": row.info.gpu,
                        "tp": row.info.tp,
                        "status": if run.saturated { "saturated" } else { "simulated" },
                        "measured": latencies_json(&run.measured),
                        "simulated": latencies_json(&sim.latencies),
                        "requests": sim.requests,
                        "completed": sim.completed,
                        "notes": notes,
                    });
                    for (m, x) in METRICS.iter().zip(e) {
                        obj[format!("{m}_ape")] = x.map_or(Value::Null, |x| json!(round2(x)));
                    }
                    println!("{obj}");
                } else {
                    let cell = |x: Option<f64>| x.map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"));
                    println!(
                        "{:<52} {:>5} {:>10} {:>3} {:>9} {:>9} {:>9} {:>9} {:>9}  {}",
                        row.id,
                        row.info.group,
                        row.info.gpu,
                        row.info.tp,
                        cell(e[0]),
                        cell(e[1]),
                        cell(e[2]),
                        cell(e[3]),
                        cell(e[4]),
                        notes.join("; ")
                    );
                }
            }
            Outcome::Failed(reason) => {
                failed += 1;
                if json {
                    println!(
                        "{}",
                        json!({
                            "run_id": row.id,
                            "source_group": row.info.group,
                            "model": row.info.model,
                            "gpu": row.info.gpu,
                            "status": "not_simulated",
                            "reason": reason,
                        })
                    );
                } else {
                    println!(
                        "{:<52} {:>5} {:>10} {:>3}  not simulated: {reason}",
                        row.id, row.info.group, row.info.gpu, row.info.tp
                    );
                }
            }
        }
    }
    let med = |xs: &[f64]| {
        let mut v = xs.to_vec();
        median(&mut v).map(round2)
    };
    let mape = |xs: &[f64]| (!xs.is_empty()).then(|| round2(xs.iter().sum::<f64>() / xs.len() as f64));
    let mut summary = json!({
        "summary": true,
        "title": title,
        "runs": rows.len(),
        "runs_simulated": simulated,
        "runs_not_simulated": failed,
        "runs_saturated_excluded": n_saturated,
        "headline_runs": simulated - n_saturated,
        "saturated_handling": "runs with more than 10% failed requests upstream are simulated but left out of the medians (their metrics cover survivors only); their errors are under saturated_*",
    });
    for (i, m) in METRICS.iter().enumerate() {
        summary[format!("median_{m}_ape")] = med(&headline[i]).map_or(Value::Null, |x| json!(x));
        summary[format!("mape_{m}")] = mape(&headline[i]).map_or(Value::Null, |x| json!(x));
        summary[format!("saturated_median_{m}_ape")] = med(&saturated[i]).map_or(Value::Null, |x| json!(x));
    }
    if json {
        println!("{summary}");
    } else {
        println!();
        println!(
            "{} runs: {} simulated ({} saturated, left out of the medians), {} not simulated",
            rows.len(),
            simulated,
            n_saturated,
            failed
        );
        let show = |x: &Value| x.as_f64().map_or_else(|| "-".to_owned(), |x| format!("{x:.1}"));
        println!(
            "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "", "TTFT mean", "TTFT p90", "E2E mean", "E2E p90", "ITL*"
        );
        for (label, prefix) in [
            ("median APE %", "median_"),
            ("mean APE %", "mape_"),
            ("saturated median %", "saturated_median_"),
        ] {
            let cells: Vec<String> = METRICS
                .iter()
                .map(|m| {
                    let key = if prefix == "mape_" {
                        format!("mape_{m}")
                    } else {
                        format!("{prefix}{m}_ape")
                    };
                    show(&summary[key])
                })
                .collect();
            println!(
                "{label:<22} {:>9} {:>9} {:>9} {:>9} {:>9}",
                cells[0], cells[1], cells[2], cells[3], cells[4]
            );
        }
    }
}

fn latencies_json(l: &Latencies) -> Value {
    json!({
        "ttft_mean_ms": round2(l.ttft_mean_ms),
        "ttft_p90_ms": l.ttft_p90_ms.map(round2),
        "e2e_mean_ms": round2(l.e2e_mean_ms),
        "e2e_p90_ms": l.e2e_p90_ms.map(round2),
        "itl_ms": round2(l.itl_ms),
    })
}
