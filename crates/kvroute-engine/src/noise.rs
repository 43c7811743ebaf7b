//! Seeded noise: a random factor of mean 1 ([`Dispersion`]) and the engine's step-time jitter
//! ([`StepJitter`]), which multiplies each forward pass's modelled duration by one draw.
//!
//! Draws are counter-based: draw `i` of a seed is taken from an [`Rng`] seeded by the seed and
//! `i` mixed, so a pass's factor depends on its index alone, and a driver that computes pass
//! ends ahead (fast-forward) gets the factors the passes get when they run. A lognormal factor's
//! standard normal is `rand_distr`'s Ziggurat sampler over that [`Rng`]: one 64-bit draw and a
//! table look-up nearly always, no logarithm or cosine.

use std::convert::Infallible;
use std::fmt;

use kvroute_core::router::Rng;
use rand_distr::{Distribution, StandardNormal};
use serde::Deserialize;

/// A random factor of mean 1: how far a quantity strays from its nominal value.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", content = "amount", rename_all = "snake_case")]
pub enum Dispersion {
    /// Uniform over `[1 - a, 1 + a]`, `a` in `[0, 1)`.
    Uniform(f64),
    /// Lognormal with `sigma` the standard deviation of its logarithm, `exp(sigma Z - sigma²/2)`
    /// (mean 1), `sigma` in `[0, 4]`.
    Lognormal(f64),
}

impl Dispersion {
    /// The names [`Dispersion::parse`] takes.
    pub const NAMES: [&'static str; 2] = ["uniform", "lognormal"];

    /// `uniform:A` or `lognormal:SIGMA`, checked.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (kind, amount) = s
            .split_once(':')
            .ok_or_else(|| format!("{s:?}: KIND:AMOUNT, KIND one of {}", Self::NAMES.join(", ")))?;
        let amount: f64 = amount
            .trim()
            .parse()
            .map_err(|e| format!("{s:?}: amount {amount:?}: {e}"))?;
        let d = match kind.trim() {
            "uniform" => Self::Uniform(amount),
            "lognormal" => Self::Lognormal(amount),
            other => {
                return Err(format!(
                    "{s:?}: {other:?} is not one of {}",
                    Self::NAMES.join(", ")
                ));
            }
        };
        d.validate()?;
        Ok(d)
    }

    /// Whether the amount is in range.
    pub fn validate(&self) -> Result<(), String> {
        match *self {
            Self::Uniform(a) if !(a.is_finite() && (0.0..1.0).contains(&a)) => {
                Err(format!("uniform spread {a}: from 0 to below 1"))
            }
            Self::Lognormal(s) if !(s.is_finite() && (0.0..=4.0).contains(&s)) => {
                Err(format!("lognormal sigma {s}: from 0 to 4"))
            }
            _ => Ok(()),
        }
    }

    /// One factor, always finite and above 0. A uniform factor takes one draw of `rng`; a
    /// lognormal one takes one for its standard normal about 99 % of the time (the Ziggurat
    /// rejects and draws again in the rest).
    pub fn draw(&self, rng: &mut Rng) -> f64 {
        match *self {
            Self::Uniform(a) => 1.0 + a * (2.0 * rng.next_f64() - 1.0),
            Self::Lognormal(s) => (s * standard_normal(rng) - s * s / 2.0).exp(),
        }
        .max(f64::MIN_POSITIVE)
    }

    /// Draw number `index` of the stream `seed`, independent of every other draw.
    pub fn draw_at(&self, seed: u64, index: u64) -> f64 {
        self.draw(&mut Rng::new(mix(seed, index)))
    }
}

impl fmt::Display for Dispersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uniform(a) => write!(f, "uniform:{a}"),
            Self::Lognormal(s) => write!(f, "lognormal:{s}"),
        }
    }
}

/// A standard normal draw: `rand_distr`'s Ziggurat sampler reading `rng`.
fn standard_normal(rng: &mut Rng) -> f64 {
    StandardNormal.sample(&mut Bits(rng))
}

/// The project's [`Rng`] as a `rand_core` generator, for `rand_distr`'s samplers.
struct Bits<'a>(&'a mut Rng);

impl rand_core::TryRng for Bits<'_> {
    type Error = Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        Ok((self.0.next_u64() >> 32) as u32)
    }

    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        Ok(self.0.next_u64())
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        rand_core::utils::fill_bytes_via_next_word(dst, || self.try_next_u64())
    }
}

/// `seed` and `index` as one generator state (a SplitMix64 finalizer over their mix).
pub fn mix(seed: u64, index: u64) -> u64 {
    Rng::new(seed ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93)).next_u64()
}

/// Step-time jitter: pass `i` of the engine takes its modelled time times
/// `dispersion.draw_at(seed, i)`.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepJitter {
    /// The factor's distribution.
    pub dispersion: Dispersion,
    /// The stream's seed (a driver gives each engine its own).
    pub seed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn factors_have_mean_one_and_stay_in_range() {
        for d in [Dispersion::Uniform(0.5), Dispersion::Lognormal(0.5)] {
            let n = 20_000;
            let draws: Vec<f64> = (0..n).map(|i| d.draw_at(7, i)).collect();
            let mean = draws.iter().sum::<f64>() / n as f64;
            assert!((mean - 1.0).abs() < 0.02, "{d}: mean {mean}");
            assert!(draws.iter().all(|&x| x.is_finite() && x > 0.0), "{d}");
            if let Dispersion::Uniform(a) = d {
                assert!(draws.iter().all(|&x| (1.0 - a..=1.0 + a).contains(&x)), "{d}");
            }
        }
    }

    /// The standard normal CDF by Simpson's rule over the density (the tests' reference).
    fn normal_cdf(x: f64) -> f64 {
        let steps = 2_000;
        let h = x / f64::from(steps);
        let pdf = |t: f64| (-t * t / 2.0).exp() / std::f64::consts::TAU.sqrt();
        let inner: f64 = (1..steps)
            .map(|k| pdf(f64::from(k) * h) * if k % 2 == 1 { 4.0 } else { 2.0 })
            .sum();
        0.5 + h / 3.0 * (pdf(0.0) + inner + pdf(x))
    }

    #[test]
    fn standard_normal_draws_follow_the_normal_law() {
        let n = 400_000_u64;
        let nf = n as f64;
        let mut z: Vec<f64> = (0..n)
            .map(|i| standard_normal(&mut Rng::new(mix(11, i))))
            .collect();
        z.sort_by(f64::total_cmp);
        // Kolmogorov-Smirnov distance over a grid of -4..=4 (a subset of the sup), against the
        // statistic's 0.1 % critical value.
        let ks = (-40..=40)
            .map(|k| {
                let x = f64::from(k) / 10.0;
                (z.partition_point(|&v| v < x) as f64 / nf - normal_cdf(x)).abs()
            })
            .fold(0.0, f64::max);
        assert!(ks < 1.95 / nf.sqrt(), "KS distance {ks}");
        // Moments, each within about 5 standard errors.
        let mean = z.iter().sum::<f64>() / nf;
        let moment = |p: i32| z.iter().map(|v| (v - mean).powi(p)).sum::<f64>() / nf;
        let var = moment(2);
        let (skew, kurt) = (moment(3) / var.powf(1.5), moment(4) / (var * var));
        assert!(mean.abs() < 5.0 / nf.sqrt(), "mean {mean}");
        assert!((var - 1.0).abs() < 5.0 * (2.0 / nf).sqrt(), "variance {var}");
        assert!(skew.abs() < 5.0 * (6.0 / nf).sqrt(), "skewness {skew}");
        assert!((kurt - 3.0).abs() < 5.0 * (24.0 / nf).sqrt(), "kurtosis {kurt}");
        // The tails past 3.5 (the Ziggurat's tail sampler starts at 3.65): a Poisson count
        // within 5 standard deviations.
        let expected = 2.0 * (1.0 - normal_cdf(3.5)) * nf;
        let tails = z.iter().filter(|v| v.abs() > 3.5).count() as f64;
        assert!(
            (tails - expected).abs() < 5.0 * expected.sqrt(),
            "{tails} past 3.5, {expected} expected"
        );
    }

    #[test]
    fn lognormal_factors_have_the_sigma_of_their_logarithm() {
        for sigma in [0.05, 0.5, 2.0] {
            let n = 100_000;
            let logs: Vec<f64> = (0..n)
                .map(|i| Dispersion::Lognormal(sigma).draw_at(5, i).ln())
                .collect();
            let mean = logs.iter().sum::<f64>() / n as f64;
            let sd = (logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
            let se = sigma / (n as f64).sqrt();
            assert!(
                (mean + sigma * sigma / 2.0).abs() < 5.0 * se,
                "sigma {sigma}: mean of logs {mean}"
            );
            assert!(
                (sd / sigma - 1.0).abs() < 5.0 * (0.5 / n as f64).sqrt(),
                "sigma {sigma}: sd of logs {sd}"
            );
        }
    }

    #[test]
    fn zero_amounts_give_exactly_one() {
        for d in [Dispersion::Uniform(0.0), Dispersion::Lognormal(0.0)] {
            assert!((0..100).all(|i| d.draw_at(3, i) == 1.0), "{d}");
        }
    }

    #[test]
    fn parse_takes_what_display_writes_and_refuses_the_rest() {
        for d in [Dispersion::Uniform(0.25), Dispersion::Lognormal(1.5)] {
            assert_eq!(Dispersion::parse(&d.to_string()), Ok(d));
        }
        for bad in [
            "uniform",
            "uniform:1",
            "uniform:-0.1",
            "lognormal:nan",
            "normal:0.1",
            "lognormal:5",
        ] {
            assert!(Dispersion::parse(bad).is_err(), "{bad}");
        }
    }
}
