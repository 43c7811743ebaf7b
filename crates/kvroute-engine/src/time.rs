//! Simulated time: integer nanoseconds.
//!
//! The engine reads no clock. Every call that needs the time takes a [`Nanos`], and every time it
//! returns is a [`Nanos`] on the same line. The simulator passes virtual time; a live driver maps
//! a monotonic clock onto it (for example, nanoseconds since the driver started). Time is an
//! integer so that the same inputs always give the same outputs, bit for bit; the timing models
//! compute in `f64` and round once, in [`Nanos::from_secs_f64`].
//!
//! One type serves for instants and for spans, as `u64` would: an instant is a span since the
//! caller's epoch.

use std::fmt;
use std::ops::{Add, Sub};

/// A point on the engine's timeline, or a span of time, in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nanos(pub u64);

impl Nanos {
    /// Time zero.
    pub const ZERO: Nanos = Nanos(0);

    /// `us` microseconds.
    pub const fn from_micros(us: u64) -> Self {
        Self(us.saturating_mul(1_000))
    }

    /// `ms` milliseconds.
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms.saturating_mul(1_000_000))
    }

    /// `secs` seconds, rounded to the nearest nanosecond. Negative and NaN values give zero;
    /// values past `u64::MAX` nanoseconds saturate.
    pub fn from_secs_f64(secs: f64) -> Self {
        // `as` saturates and maps NaN to 0.
        Self((secs * 1e9).round() as u64)
    }

    /// This span in seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// This span in milliseconds.
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// `self + rhs`, saturating at the end of time.
    pub const fn saturating_add(self, rhs: Nanos) -> Nanos {
        Nanos(self.0.saturating_add(rhs.0))
    }

    /// `self - rhs`, or zero when `rhs` is later.
    pub const fn saturating_sub(self, rhs: Nanos) -> Nanos {
        Nanos(self.0.saturating_sub(rhs.0))
    }
}

impl Add for Nanos {
    type Output = Nanos;

    /// Saturating: simulated time never wraps.
    fn add(self, rhs: Nanos) -> Nanos {
        self.saturating_add(rhs)
    }
}

impl Sub for Nanos {
    type Output = Nanos;

    /// Saturating at zero.
    fn sub(self, rhs: Nanos) -> Nanos {
        self.saturating_sub(rhs)
    }
}

impl fmt::Display for Nanos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.3}ms", self.as_millis_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_and_saturate() {
        assert_eq!(Nanos::from_secs_f64(0.0015), Nanos(1_500_000));
        assert_eq!(Nanos::from_secs_f64(1.4e-9), Nanos(1));
        assert_eq!(Nanos::from_secs_f64(-1.0), Nanos::ZERO);
        assert_eq!(Nanos::from_secs_f64(f64::NAN), Nanos::ZERO);
        assert_eq!(Nanos::from_secs_f64(f64::INFINITY), Nanos(u64::MAX));
        assert_eq!(Nanos::from_millis(3) + Nanos::from_micros(2), Nanos(3_002_000));
        assert_eq!(Nanos(5) - Nanos(7), Nanos::ZERO);
        assert_eq!(Nanos(u64::MAX) + Nanos(1), Nanos(u64::MAX));
        assert_eq!(Nanos::from_millis(2).to_string(), "2.000ms");
    }
}
