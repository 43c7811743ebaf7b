//! Dynamo mocker's default timing model.
//!
//! Dynamo documents it as an "uncalibrated synthetic baseline": a quadratic in the uncached
//! prompt tokens for prefill and a quadratic in KV-cache utilisation for decode, which therefore
//! ignores decode batch size. It is here so that results can be set beside Dynamo's replay, not
//! as a prediction of any hardware.

use super::{TimingModel, ms};
use crate::metrics::ForwardPass;

/// Dynamo's default polynomial.
///
/// * Prefill: `4.209989e-7·T² + 1.518344e-2·T + 16.50142` ms, with `T` the prompt tokens
///   computed in the pass; 0 when `T = 0`.
/// * Decode: `max(1, −25.74·u² + 54.01·u + 5.74)` ms, with `u` the share of KV blocks in use
///   (at most 1); 0 when no request decodes.
/// * A pass with both costs their sum, as in Dynamo.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Polynomial;

impl Polynomial {
    /// Prefill milliseconds for `tokens` computed prompt tokens.
    pub fn prefill_ms(tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142
    }

    /// Decode milliseconds at KV utilisation `u` (clamped to `[0, 1]`).
    pub fn decode_ms(u: f64) -> f64 {
        let u = u.clamp(0.0, 1.0);
        (-25.74 * u * u + 54.01 * u + 5.74).max(1.0)
    }
}

impl TimingModel for Polynomial {
    fn pass_secs(&self, pass: &ForwardPass) -> f64 {
        let decode = if pass.decode_seqs > 0 {
            Self::decode_ms(pass.kv_utilisation())
        } else {
            0.0
        };
        ms(Self::prefill_ms(pass.prefill_tokens) + decode)
    }

    fn reads_decode_context(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_checked_values() {
        // T = 1000: 4.209989e-7·1e6 + 1.518344e-2·1000 + 16.50142 = 0.4209989 + 15.18344 + 16.50142.
        assert!((Polynomial::prefill_ms(1000) - 32.1058589).abs() < 1e-9);
        assert_eq!(Polynomial::prefill_ms(0), 0.0);
        // u = 0.5: −25.74·0.25 + 54.01·0.5 + 5.74 = −6.435 + 27.005 + 5.74 = 26.31.
        assert!((Polynomial::decode_ms(0.5) - 26.31).abs() < 1e-9);
        // u = 0: 5.74; u = 1: −25.74 + 54.01 + 5.74 = 34.01. The floor of 1 ms never binds on [0, 1].
        assert!((Polynomial::decode_ms(0.0) - 5.74).abs() < 1e-12);
        assert!((Polynomial::decode_ms(2.0) - 34.01).abs() < 1e-9);
    }

    #[test]
    fn a_mixed_pass_costs_the_sum() {
        let pass = ForwardPass {
            prefill_seqs: 1,
            prefill_tokens: 1000,
            decode_seqs: 3,
            kv_active_blocks: 50,
            kv_total_blocks: 100,
            ..ForwardPass::default()
        };
        assert!((Polynomial.pass_secs(&pass) - (32.1058589 + 26.31) / 1e3).abs() < 1e-12);
    }
}
