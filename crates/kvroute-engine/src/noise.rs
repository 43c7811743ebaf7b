//! Seeded noise: a random factor of mean 1 ([`Dispersion`]) and the engine's step-time jitter
//! ([`StepJitter`]), which multiplies each forward pass's modelled duration by one draw.
//!
//! Draws are counter-based: draw `i` of a seed is the first output of a
//! [`Rng`] seeded by the seed and `i` mixed, so a pass's factor depends on its
//! index alone, and a driver that computes pass ends ahead (fast-forward) gets the factors the
//! passes get when they run.

use std::fmt;

use kvroute_core::router::Rng;
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

    /// One factor, from two draws of `rng` at most; always finite and above 0.
    pub fn draw(&self, rng: &mut Rng) -> f64 {
        match *self {
            Self::Uniform(a) => 1.0 + a * (2.0 * rng.next_f64() - 1.0),
            Self::Lognormal(s) => {
                // Box-Muller; 1 - u is in (0, 1].
                let (u1, u2) = (1.0 - rng.next_f64(), rng.next_f64());
                let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
                (s * z - s * s / 2.0).exp()
            }
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
