//! The noise options of `kvroute replay` (`--isl-spread`, `--osl-spread`, `--step-jitter`,
//! `--worker-speed`, `--http-latency-ms`, `--http-jitter`), parsed and checked once into the
//! workload's [`LengthSpread`] and the simulator's [`Noise`]. Every one is off unless given, so a
//! run without them is the run without noise, byte for byte.

use std::time::Duration;

use anyhow::{Context, ensure};
use kvroute_sim::{Dispersion, HttpLatency, LengthSpread, Noise, WorkerSpeed};

use super::ReplayConfig;

/// The length spread and the simulator's noise the options describe.
pub(super) fn noise(o: &ReplayConfig) -> anyhow::Result<(LengthSpread, Noise)> {
    let dispersion = |flag: &str, s: &Option<String>| -> anyhow::Result<Option<Dispersion>> {
        s.as_deref()
            .map(|s| Dispersion::parse(s).map_err(|e| anyhow::anyhow!("--{flag} {e}")))
            .transpose()
    };
    let lengths = LengthSpread {
        prompt: dispersion("isl-spread", &o.isl_spread)?,
        output: dispersion("osl-spread", &o.osl_spread)?,
    };
    let worker_speed = match o.worker_speed.as_deref() {
        None => WorkerSpeed::Same,
        Some(s) if s.contains(':') => {
            WorkerSpeed::Drawn(Dispersion::parse(s).map_err(|e| anyhow::anyhow!("--worker-speed {e}"))?)
        }
        Some(s) => WorkerSpeed::Given(
            s.split(',')
                .map(|f| match f.trim().parse::<f64>() {
                    Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
                    _ => anyhow::bail!(
                        "--worker-speed {s:?}: KIND:AMOUNT (uniform, lognormal) or factors F,F,... above 0"
                    ),
                })
                .collect::<anyhow::Result<_>>()?,
        ),
    };
    let http_jitter = dispersion("http-jitter", &o.http_jitter)?;
    ensure!(
        http_jitter.is_none() || o.http_latency_ms.is_some(),
        "--http-jitter applies only with --http-latency-ms"
    );
    let http = match o.http_latency_ms {
        None => None,
        Some(ms) => {
            ensure!(
                ms.is_finite() && ms > 0.0,
                "--http-latency-ms must be a number above 0, not {ms}"
            );
            Some(HttpLatency {
                delay: Duration::try_from_secs_f64(ms / 1e3).context("--http-latency-ms")?,
                jitter: http_jitter,
            })
        }
    };
    let noise = Noise {
        step_jitter: dispersion("step-jitter", &o.step_jitter)?,
        worker_speed,
        http,
    };
    noise.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok((lengths, noise))
}
