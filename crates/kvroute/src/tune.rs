//! `kvroute tune`: searches a cost policy's options on a trace and prints the `--policy` spec
//! that `kvroute serve` takes.
//!
//! The candidates are the base policy (`--policy`, default `kv`) with every combination of the
//! `--grid` options' values (`--grid scale=2,4,8 --grid evict=0,1`), in the grammar of
//! `kvroute_core::router::spec`; `--samples N` keeps N of them, drawn with the run's seed. Each
//! candidate is a replay of the same workload by the code `kvroute replay` runs
//! (`replay::simulate`), with every replay option. A candidate's score is the sum over
//! the `--objective` metrics (report keys, lower is better; `max:KEY` for higher is better) of its
//! value over the best candidate's: 1 per metric for a candidate best on all. The lowest score
//! wins, the earlier candidate on a tie. The same options and seed give the same table and pick.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, bail, ensure};
use clap::Args;
use kvroute_core::router::Rng;
use kvroute_sim::Report;

use crate::replay::{ReplayArgs, ReplayConfig, simulate};

/// The options of `kvroute tune`.
#[derive(Args, Debug, Default)]
pub struct TuneArgs {
    /// The replay's configuration: trace, fleet, engine, noise (as `kvroute replay` takes them).
    /// `--policy` names the one base policy the grid's options are added to (default `kv`).
    #[command(flatten)]
    pub options: ReplayConfig,
    /// A TOML file of replay options; flags beat it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// An option of the base policy and the values to try, `NAME=V1,V2,...` (the policy spec's
    /// options: `scale`, `credit`, `tier`, `evict`, `fleet`, `stall`, `transfer`, `requests`, `temperature`, `spread`; `full`
    /// or `staged` as `projection=full,staged`). Repeat for several options: every combination
    /// is a candidate.
    #[arg(long = "grid", value_name = "NAME=V1,V2,...")]
    pub grid: Vec<String>,
    /// Report keys to minimize, comma-separated (`max:KEY` to maximize), each weighing alike.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "p90_ttft_ms,median_e2e_latency_ms"
    )]
    pub objective: Vec<String>,
    /// Simulate only this many candidates, drawn from the grid with the run's seed (default:
    /// every one).
    #[arg(long)]
    pub samples: Option<usize>,
}

/// One metric of the objective.
#[derive(Clone, Debug, PartialEq)]
struct Metric {
    key: String,
    maximize: bool,
}

impl Metric {
    fn parse(s: &str) -> anyhow::Result<Self> {
        let (key, maximize) = match s.strip_prefix("max:") {
            Some(key) => (key, true),
            None => (s, false),
        };
        ensure!(!key.is_empty(), "--objective: an empty metric");
        Ok(Self {
            key: key.to_owned(),
            maximize,
        })
    }
}

/// The grid's candidates: the base spec with each combination of the options' values, the
/// first option varying slowest.
fn candidates(base: &str, grid: &[String]) -> anyhow::Result<Vec<String>> {
    let mut specs = vec![base.to_owned()];
    let mut names: Vec<&str> = Vec::new();
    for option in grid {
        let Some((name, values)) = option.split_once('=') else {
            bail!("--grid {option:?}: NAME=V1,V2,...");
        };
        ensure!(!name.is_empty(), "--grid {option:?}: no option name");
        ensure!(!names.contains(&name), "--grid names {name} twice");
        names.push(name);
        let values: Vec<&str> = values.split(',').collect();
        ensure!(
            values.iter().all(|v| !v.is_empty()),
            "--grid {option:?}: an empty value"
        );
        specs = specs
            .iter()
            .flat_map(|spec| {
                values.iter().map(move |v| match name {
                    "projection" => format!("{spec}:{v}"),
                    _ => format!("{spec}:{name}={v}"),
                })
            })
            .collect();
    }
    Ok(specs)
}

/// `n` of `specs` drawn without replacement by `rng`, in the grid's order.
fn sample(specs: Vec<String>, n: usize, rng: &mut Rng) -> Vec<String> {
    if n >= specs.len() {
        return specs;
    }
    let mut order: Vec<usize> = (0..specs.len()).collect();
    for i in 0..n {
        let j = i + rng.below(order.len() - i);
        order.swap(i, j);
    }
    let mut kept = order[..n].to_vec();
    kept.sort_unstable();
    kept.into_iter().map(|i| specs[i].clone()).collect()
}

/// The candidates' values of each metric and their scores (see the module docs).
fn score(reports: &[(String, Report)], metrics: &[Metric]) -> anyhow::Result<Vec<(Vec<f64>, f64)>> {
    let values: Vec<Vec<f64>> = reports
        .iter()
        .map(|(spec, r)| {
            metrics
                .iter()
                .map(|m| {
                    r.number(&m.key).with_context(|| {
                        format!("--objective: the report of {spec} has no number {:?}", m.key)
                    })
                })
                .collect()
        })
        .collect::<anyhow::Result<_>>()?;
    let best: Vec<f64> = (0..metrics.len())
        .map(|i| {
            let column = values.iter().map(|v| v[i]);
            if metrics[i].maximize {
                column.fold(f64::NEG_INFINITY, f64::max)
            } else {
                column.fold(f64::INFINITY, f64::min)
            }
        })
        .collect();
    Ok(values
        .into_iter()
        .map(|v| {
            let score = v
                .iter()
                .zip(&best)
                .zip(metrics)
                .map(|((&x, &b), m)| {
                    let (num, den) = if m.maximize { (b, x) } else { (x, b) };
                    if num == den {
                        1.0
                    } else if den > 0.0 {
                        num / den
                    } else {
                        f64::INFINITY
                    }
                })
                .sum();
            (v, score)
        })
        .collect())
}

/// The ranked table and the pick, as printed.
fn render(reports: &[(String, Report)], metrics: &[Metric], scored: &[(Vec<f64>, f64)]) -> (String, usize) {
    let mut order: Vec<usize> = (0..scored.len()).collect();
    order.sort_by(|&a, &b| scored[a].1.total_cmp(&scored[b].1).then(a.cmp(&b)));
    let width = reports.iter().map(|(s, _)| s.len()).max().unwrap_or(0).max(6);
    let labels: Vec<String> = metrics
        .iter()
        .map(|m| {
            if m.maximize {
                format!("max:{}", m.key)
            } else {
                m.key.clone()
            }
        })
        .collect();
    let mut out = format!("{:>4}  {:width$}", "rank", "policy");
    for label in &labels {
        let _ = write!(out, "  {label:>12}");
    }
    out.push_str("         score\n");
    for (rank, &i) in order.iter().enumerate() {
        let _ = write!(out, "{:>4}  {:width$}", rank + 1, reports[i].0);
        for (v, label) in scored[i].0.iter().zip(&labels) {
            let w = label.len().max(12);
            let _ = write!(out, "  {v:>w$.3}");
        }
        let _ = writeln!(out, "  {:>12.4}", scored[i].1);
    }
    (out, order[0])
}

/// Runs `kvroute tune`: prints the ranked candidates, then the best one's spec.
pub fn run(args: TuneArgs) -> anyhow::Result<()> {
    let (table, best) = tune(&args)?;
    print!("{table}");
    println!("best: {best}");
    println!("serve with: kvroute serve --policy {best}");
    Ok(())
}

/// The ranked table and the best candidate's canonical spec.
pub fn tune(args: &TuneArgs) -> anyhow::Result<(String, String)> {
    let base = match args.options.policy.as_deref() {
        None => "kv".to_owned(),
        Some([one]) => one.clone(),
        Some(_) => bail!("--policy: tune searches one base policy; give one spec"),
    };
    ensure!(
        !args.grid.is_empty(),
        "--grid: name at least one option to search"
    );
    let metrics: Vec<Metric> = args
        .objective
        .iter()
        .map(|m| Metric::parse(m))
        .collect::<anyhow::Result<_>>()?;
    ensure!(!metrics.is_empty(), "--objective names no metric");
    let mut specs = candidates(&base, &args.grid)?;
    if let Some(n) = args.samples {
        ensure!(n > 0, "--samples must be at least 1");
        let mut rng = Rng::new(args.options.seed.unwrap_or_default());
        specs = sample(specs, n, &mut rng);
    }
    eprintln!("tune: {} candidates", specs.len());
    let replay = ReplayArgs {
        options: ReplayConfig {
            policy: Some(specs),
            ..args.options.clone()
        },
        config: args.config.clone(),
        ..ReplayArgs::default()
    };
    let reports = simulate(&replay)?;
    let scored = score(&reports, &metrics)?;
    let (table, best) = render(&reports, &metrics, &scored);
    Ok((table, reports[best].0.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_grid_is_every_combination_in_order() {
        let specs = candidates(
            "kv",
            &["scale=2,8".to_owned(), "projection=full,staged".to_owned()],
        )
        .unwrap();
        assert_eq!(
            specs,
            [
                "kv:scale=2:full",
                "kv:scale=2:staged",
                "kv:scale=8:full",
                "kv:scale=8:staged"
            ]
        );
        assert!(candidates("kv", &["scale".to_owned()]).is_err());
        assert!(candidates("kv", &["scale=1,".to_owned()]).is_err());
        assert!(candidates("kv", &["scale=1".to_owned(), "scale=2".to_owned()]).is_err());
    }

    #[test]
    fn a_sample_keeps_distinct_candidates_in_grid_order_and_the_seed_decides() {
        let specs: Vec<String> = (0..20).map(|i| format!("kv:scale={i}")).collect();
        let a = sample(specs.clone(), 5, &mut Rng::new(3));
        assert_eq!(a, sample(specs.clone(), 5, &mut Rng::new(3)));
        assert_eq!(a.len(), 5);
        let positions: Vec<usize> = a
            .iter()
            .map(|s| specs.iter().position(|x| x == s).unwrap())
            .collect();
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
        assert_eq!(sample(specs.clone(), 50, &mut Rng::new(3)), specs);
    }
}
