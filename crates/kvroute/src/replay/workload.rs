//! Where `kvroute replay`'s requests come from: a trace file (or the built-in example) read
//! whole, or the synthetic generator's, made as a lone run goes or once for several runs, its
//! blocks hashed on every core (the simulator's crate starts no thread).

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use flate2::read::GzDecoder;
use kvroute_sim::synthetic::{
    ArrivalProcess, Lengths, OwnBlocks, SyntheticConfig, SyntheticStream, WorkloadPlan,
};
use kvroute_sim::workload::{RateWarp, Reshape, Reshaped};
use kvroute_sim::{RunResult, Simulation, Workload};

use super::ReplayConfig;
use super::plan::{Format, Plan};

/// The trace's bytes (a file's, or the built-in example's) and the file, if one was named.
pub(super) struct Trace {
    pub(super) bytes: Option<Vec<u8>>,
    pub(super) file: Option<crate::provenance::TraceFile>,
}

impl Plan<'_> {
    /// The trace's bytes (none for a synthetic workload), read whole so that they can be hashed.
    pub(super) fn trace(&self) -> anyhow::Result<Trace> {
        if self.format == Format::Synthetic {
            return Ok(Trace {
                bytes: None,
                file: None,
            });
        }
        let Some(path) = &self.options.trace else {
            return Ok(Trace {
                bytes: Some(kvroute_sim::EXAMPLE_MOONCAKE_GZ.to_vec()),
                file: Some(crate::provenance::TraceFile::builtin()),
            });
        };
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let file = crate::provenance::TraceFile::new(path, &bytes);
        Ok(Trace {
            bytes: Some(bytes),
            file: Some(file),
        })
    }

    /// The workload and a description of where it came from: a trace's, read whole; the
    /// synthetic generator's made as the run goes when one run takes it, else made once, whole,
    /// for every run (each run making its own would draw and hash it once a run).
    pub(super) fn workload(&self, trace: &Trace) -> anyhow::Result<(Requests, String)> {
        let o = self.options;
        // One shape for both: copies, then the length spread, the speed-up and the rate profile.
        let copies = o.multiply.filter(|&c| c > 1).unwrap_or(1);
        let mut shaped = String::new();
        if copies > 1 {
            shaped.push_str(&format!(", {copies} copies"));
        }
        self.lengths.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut warp = None;
        if let (Some(points), Some(profile)) = (&self.profile, &o.rate_profile) {
            warp = RateWarp::new(points).map_err(|e| anyhow::anyhow!("--rate-profile {profile}: {e}"))?;
            shaped.push_str(&format!(", rate profile {profile}"));
        }
        let shape = Reshape {
            copies,
            spread: self.lengths,
            seed: self.seed,
            speedup: o.arrival_speedup.unwrap_or(1.0),
            warp,
        };
        let copied = |n: usize| {
            kvroute_sim::workload::multiplied_len(n, copies)
                .map_err(|e| anyhow::anyhow!("--multiply {copies}: {e}"))
        };
        let one_run = self.runs.len() == 1 && self.sweep.is_none();
        if let Some(config) = self.synthetic.as_ref().filter(|_| one_run) {
            copied(config.requests)?;
            let requests = Requests::Synthetic {
                config: *config,
                block_size: self.block_size,
                shape,
            };
            return Ok((requests, format!("the synthetic generator ({config:?}){shaped}")));
        }
        let (workload, source) = match (&self.synthetic, &trace.bytes) {
            (Some(config), _) => {
                let plan = WorkloadPlan::new(config, self.block_size);
                let w = plan
                    .assemble(hash_on_threads(&plan, hashing_threads()))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                (w, format!("the synthetic generator ({config:?})"))
            }
            (None, Some(bytes)) => {
                let (reader, source) = open_trace(o.trace.as_deref(), bytes);
                let w = match self.format {
                    Format::Azure => kvroute_sim::trace::read_azure(reader, self.block_size, o.limit),
                    _ => {
                        let tbs = o.trace_block_size.unwrap_or(512);
                        kvroute_sim::trace::read_mooncake(reader, tbs, self.block_size, o.limit)
                    }
                }
                .with_context(|| format!("reading {source}"))?;
                (w, source)
            }
            (None, None) => bail!("no trace and no synthetic workload"),
        };
        copied(workload.requests.len())?;
        let workload = workload.reshaped(shape).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok((Requests::Whole(workload), source + &shaped))
    }
}

/// `T:M,T:M,...` as (seconds, multiplier) points, checked as [`Workload::warp_rate`] checks them.
pub(super) fn parse_profile(s: &str) -> anyhow::Result<Vec<(f64, f64)>> {
    let points = s
        .split(',')
        .map(|p| {
            let (t, m) = p.split_once(':')?;
            Some((t.trim().parse().ok()?, m.trim().parse().ok()?))
        })
        .collect::<Option<Vec<(f64, f64)>>>()
        .with_context(|| format!("--rate-profile {s:?}: T:M,T:M,... (seconds, multiplier)"))?;
    Workload::new(1)
        .warp_rate(&points)
        .map_err(|e| anyhow::anyhow!("--rate-profile {s:?}: {e}"))?;
    Ok(points)
}

pub(super) fn synthetic_config(args: &ReplayConfig) -> anyhow::Result<SyntheticConfig> {
    let d = SyntheticConfig::default();
    Ok(SyntheticConfig {
        requests: args.requests.unwrap_or(d.requests),
        rate_rps: args.rate.unwrap_or(d.rate_rps),
        arrival: match args.arrival_cv {
            Some(cv) if cv != 1.0 => ArrivalProcess::Gamma { cv },
            _ => ArrivalProcess::Poisson,
        },
        isl: args
            .isl
            .as_deref()
            .map(|s| parse_lengths("--isl", s))
            .transpose()?
            .unwrap_or(d.isl),
        osl: args
            .osl
            .as_deref()
            .map(|s| parse_lengths("--osl", s))
            .transpose()?
            .unwrap_or(d.osl),
        prefix_groups: args.prefix_groups.unwrap_or(d.prefix_groups),
        shared_prefix_tokens: args.prefix_tokens.unwrap_or(d.shared_prefix_tokens),
        turns_per_session: args.turns.unwrap_or(d.turns_per_session),
        think_time: args.think_ms.map_or(d.think_time, Duration::from_millis),
        // `--seed N` draws the generator's seed 1 + N (its default seed is 1), so that no flag
        // and `--seed 0` make one workload, as they make one router and simulator.
        seed: d.seed.wrapping_add(args.seed.unwrap_or(0)),
    })
}

/// The requests of every run: a trace's workload, held whole, or the synthetic generator's,
/// made anew by each run as it needs them (the same requests: a run's memory then follows what
/// is in flight, not the workload's length).
pub(super) enum Requests {
    Whole(Workload),
    Synthetic {
        config: SyntheticConfig,
        block_size: u32,
        shape: Reshape,
    },
}

impl Requests {
    /// Requests in all.
    pub(super) fn len(&self) -> usize {
        match self {
            Self::Whole(w) => w.requests.len(),
            Self::Synthetic { config, shape, .. } => config.requests.saturating_mul(shape.copies.max(1)),
        }
    }

    /// How they were had.
    pub(super) fn how(&self) -> &'static str {
        match self {
            Self::Whole(_) => "loaded",
            Self::Synthetic { .. } => "planned, made as each run goes,",
        }
    }

    /// `sim` run on the requests, a synthetic workload's blocks hashed on `threads` threads.
    pub(super) fn run(
        &self,
        sim: &Simulation,
        threads: usize,
        progress: &mut dyn FnMut(kvroute_sim::Progress),
    ) -> anyhow::Result<RunResult> {
        Ok(match self {
            Self::Whole(w) => sim.run(w, progress)?,
            Self::Synthetic {
                config,
                block_size,
                shape,
            } => {
                let chunk = SyntheticStream::CHUNK * threads.max(1);
                let stream = SyntheticStream::with_hasher(
                    config,
                    *block_size,
                    chunk,
                    Box::new(move |plan: &WorkloadPlan| hash_on_threads(plan, threads)),
                );
                let source = Reshaped::new(stream, shape.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
                sim.run_source(source, progress)?
            }
        })
    }
}

/// Threads to hash a synthetic workload on when one run goes at a time: every core.
pub(super) fn hashing_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The own blocks of `plan`'s requests, hashed on `threads` threads, one range each: the
/// simulator's crate starts no thread, so its generator's hashing step
/// ([`kvroute_sim::synthetic::WorkloadPlan::hash`]) runs here.
fn hash_on_threads(plan: &WorkloadPlan, threads: usize) -> Vec<OwnBlocks> {
    let all = plan.requests();
    let chunk = all.len().div_ceil(threads.max(1)).max(1);
    if threads <= 1 || all.len() <= chunk {
        return vec![plan.hash(all)];
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = all
            .clone()
            .step_by(chunk)
            .map(|first| scope.spawn(move || plan.hash(first..first + chunk)))
            .collect();
        // A thread that panicked hashes nothing: its range is missing, which the stream
        // reports as an error.
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    })
}

/// `N` or `MIN-MAX` tokens, at least 1.
fn parse_lengths(flag: &str, s: &str) -> anyhow::Result<Lengths> {
    let num = |x: &str| match x.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => bail!("{flag} {s:?}: N or MIN-MAX, whole numbers from 1 to {}", u32::MAX),
    };
    Ok(match s.split_once('-') {
        Some((a, b)) => {
            let (min, max) = (num(a)?, num(b)?);
            ensure!(min <= max, "{flag} {s:?}: MIN is above MAX");
            Lengths::Uniform { min, max }
        }
        None => Lengths::Fixed(num(s)?),
    })
}

/// A reader over the trace's bytes (gunzipped if the file ends in `.gz`; the built-in example is
/// gzip'd), and its description.
fn open_trace<'b>(path: Option<&Path>, bytes: &'b [u8]) -> (Box<dyn BufRead + 'b>, String) {
    let Some(path) = path else {
        return (
            Box::new(BufReader::new(GzDecoder::new(bytes))),
            "the built-in example (first 2,000 rows of the Mooncake conversation trace)".to_owned(),
        );
    };
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(GzDecoder::new(bytes))
    } else {
        Box::new(bytes)
    };
    (
        Box::new(BufReader::with_capacity(1 << 20, reader)),
        path.display().to_string(),
    )
}
