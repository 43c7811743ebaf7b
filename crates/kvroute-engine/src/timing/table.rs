//! Interpolation over a measured profile.
//!
//! A profile gives prefill time by prompt tokens computed in the pass, and decode time on a grid
//! of batch size × KV tokens read (the decoding requests' context lengths, summed). Between
//! points the time is linear (bilinear on the grid). Below the first point it stays at the first
//! value; past the last it follows the last segment's slope, never below zero, so a profile
//! that grows keeps growing. A pass with both phases costs their sum.
//!
//! The profile is TOML:
//!
//! ```toml
//! [prefill]
//! tokens = [128, 1024, 8192]
//! ms = [9.0, 30.0, 210.0]
//!
//! [decode]
//! batch_size = [1, 64]
//! kv_tokens = [1024, 262144]
//! ms = [[6.0, 9.0],    # batch 1, at each kv_tokens
//!       [8.0, 25.0]]   # batch 64
//! ```

use serde::Deserialize;

use super::{TimingModel, ms};
use crate::metrics::ForwardPass;
use crate::spec::{SpecError, check, parse_valid};

/// A measured profile: prefill and decode times.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TableProfile {
    /// Prefill time by tokens.
    pub prefill: PrefillTable,
    /// Decode time by batch size and KV tokens.
    pub decode: DecodeTable,
}

/// Prefill milliseconds at increasing token counts.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillTable {
    /// Prompt tokens computed in the pass, strictly increasing.
    pub tokens: Vec<f64>,
    /// Milliseconds at each entry of `tokens`.
    pub ms: Vec<f64>,
}

/// Decode milliseconds on a grid.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeTable {
    /// Decoding requests in the pass, strictly increasing.
    pub batch_size: Vec<f64>,
    /// KV tokens the pass reads, strictly increasing.
    pub kv_tokens: Vec<f64>,
    /// `ms[i][j]`: milliseconds at `batch_size[i]` and `kv_tokens[j]`.
    pub ms: Vec<Vec<f64>>,
}

const W: &str = "table profile";

/// Checks that `xs` is non-empty, finite, not negative and strictly increasing.
fn check_axis(xs: &[f64], field: &'static str) -> Result<(), SpecError> {
    check(!xs.is_empty(), W, field, "must have at least one point")?;
    check(
        xs.iter().all(|x| x.is_finite() && *x >= 0.0),
        W,
        field,
        "must be finite and not negative",
    )?;
    check(
        xs.windows(2).all(|w| w[0] < w[1]),
        W,
        field,
        "must be strictly increasing",
    )
}

/// Checks that `row` has `len` finite, non-negative times.
fn check_times(row: &[f64], len: usize, field: &'static str) -> Result<(), SpecError> {
    check(
        row.len() == len,
        W,
        field,
        "must have one time per point of its axis",
    )?;
    check(
        row.iter().all(|y| y.is_finite() && *y >= 0.0),
        W,
        field,
        "must be finite and not negative",
    )
}

impl TableProfile {
    /// Parses and validates a profile written in TOML (see the module docs).
    pub fn from_toml_str(text: &str) -> Result<Self, SpecError> {
        parse_valid(text, W, Self::validate)
    }

    /// Checks the axes and that every time is given.
    pub fn validate(&self) -> Result<(), SpecError> {
        check_axis(&self.prefill.tokens, "prefill.tokens")?;
        check_times(&self.prefill.ms, self.prefill.tokens.len(), "prefill.ms")?;
        let d = &self.decode;
        check_axis(&d.batch_size, "decode.batch_size")?;
        check_axis(&d.kv_tokens, "decode.kv_tokens")?;
        check(
            d.ms.len() == d.batch_size.len(),
            W,
            "decode.ms",
            "must have one row per batch size",
        )?;
        d.ms.iter()
            .try_for_each(|row| check_times(row, d.kv_tokens.len(), "decode.ms"))
    }
}

/// Where `x` falls on `xs`: the index of the segment's left point and the weight of its right
/// point. Below the first point the weight is 0; past the last it exceeds 1 (extrapolation along
/// the last segment). A one-point axis is constant.
fn locate(xs: &[f64], x: f64) -> (usize, f64) {
    if xs.len() < 2 || x <= xs[0] {
        return (0, 0.0);
    }
    let right = xs.partition_point(|&p| p < x).clamp(1, xs.len() - 1);
    let (x0, x1) = (xs[right - 1], xs[right]);
    (right - 1, (x - x0) / (x1 - x0))
}

/// The value at `(i, t)` (see [`locate`]) on a curve sampled at `ys`.
fn blend(ys: &[f64], (i, t): (usize, f64)) -> f64 {
    match ys.get(i + 1) {
        Some(&y1) => ys[i] + t * (y1 - ys[i]),
        None => ys[i],
    }
}

/// The table timing model.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    profile: TableProfile,
}

impl Table {
    /// The model over `profile`.
    pub fn new(profile: TableProfile) -> Result<Self, SpecError> {
        profile.validate()?;
        Ok(Self { profile })
    }

    /// Prefill milliseconds for `tokens` prompt tokens; 0 for none.
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let p = &self.profile.prefill;
        blend(&p.ms, locate(&p.tokens, tokens as f64)).max(0.0)
    }

    /// Decode milliseconds for `batch` requests reading `kv_tokens`; 0 for no request.
    pub fn decode_ms(&self, batch: u32, kv_tokens: u64) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let d = &self.profile.decode;
        let at_kv = locate(&d.kv_tokens, kv_tokens as f64);
        let (row, t) = locate(&d.batch_size, f64::from(batch));
        let lower = blend(&d.ms[row], at_kv);
        let value = match d.ms.get(row + 1) {
            Some(next) => lower + t * (blend(next, at_kv) - lower),
            None => lower,
        };
        value.max(0.0)
    }
}

impl TimingModel for Table {
    fn pass_secs(&self, pass: &ForwardPass) -> f64 {
        ms(self.prefill_ms(pass.prefill_tokens)
            + self.decode_ms(pass.decode_seqs, pass.decode_context_tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROFILE: &str = "
        [prefill]
        tokens = [100, 200, 400]
        ms = [10.0, 20.0, 30.0]

        [decode]
        batch_size = [1, 3]
        kv_tokens = [100, 300]
        ms = [[5.0, 7.0], [9.0, 15.0]]
    ";

    fn table() -> Table {
        Table::new(TableProfile::from_toml_str(PROFILE).unwrap()).unwrap()
    }

    #[test]
    fn prefill_interpolates_clamps_below_and_extrapolates_above() {
        let t = table();
        assert_eq!(t.prefill_ms(0), 0.0);
        assert_eq!(t.prefill_ms(50), 10.0);
        assert_eq!(t.prefill_ms(150), 15.0);
        assert_eq!(t.prefill_ms(300), 25.0);
        // Past 400, the last segment's slope (10 ms per 200 tokens) continues.
        assert_eq!(t.prefill_ms(600), 40.0);
    }

    #[test]
    fn decode_is_bilinear_on_the_grid() {
        let t = table();
        assert_eq!(t.decode_ms(0, 100), 0.0);
        assert_eq!(t.decode_ms(1, 100), 5.0);
        assert_eq!(t.decode_ms(3, 300), 15.0);
        // Batch 2 at 200 KV tokens: the middle of the cell, the mean of its corners (5+7+9+15)/4.
        assert_eq!(t.decode_ms(2, 200), 9.0);
        // Past the grid: batch 5 at 300 KV tokens continues the batch slope (15 − 7)/2 per request.
        assert_eq!(t.decode_ms(5, 300), 23.0);
        // Below the grid: clamped.
        assert_eq!(t.decode_ms(1, 10), 5.0);
    }

    #[test]
    fn bad_profiles_are_refused() {
        let bad = PROFILE.replace("[100, 200, 400]", "[100, 400, 200]");
        assert!(matches!(
            TableProfile::from_toml_str(&bad),
            Err(SpecError::Invalid {
                field: "prefill.tokens",
                ..
            })
        ));
        let bad = PROFILE.replace("[9.0, 15.0]", "[9.0]");
        assert!(matches!(
            TableProfile::from_toml_str(&bad),
            Err(SpecError::Invalid {
                field: "decode.ms",
                ..
            })
        ));
        let bad = PROFILE.replace("kv_tokens", "kv");
        assert!(matches!(
            TableProfile::from_toml_str(&bad),
            Err(SpecError::Parse { .. })
        ));
    }
}
