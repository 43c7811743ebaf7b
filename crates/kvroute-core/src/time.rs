//! Time as the core sees it: a value passed in, never read from a clock.
//!
//! The live server maps a monotonic clock onto [`Timestamp`]; the simulator passes virtual time.
//! Spans are [`std::time::Duration`], which is plain data.

use std::ops::{Add, Sub};
use std::time::Duration;

/// A point in time: nanoseconds since an epoch the driver chooses (process start, or the start of
/// a simulation). Only differences between timestamps of one driver mean anything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// The epoch.
    pub const ZERO: Timestamp = Timestamp(0);

    /// `ms` milliseconds after the epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms.saturating_mul(1_000_000))
    }

    /// Nanoseconds since the epoch.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// `us` microseconds after the epoch.
    pub const fn from_micros(us: u64) -> Self {
        Self(us.saturating_mul(1_000))
    }

    /// Seconds since the epoch, as a float (for reports).
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// The time elapsed from `earlier` to `self`, or zero if `earlier` is later.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

/// `secs` seconds as a [`Duration`], rounded to the nearest nanosecond. Negative and NaN values
/// give zero and values too large saturate, where [`Duration::from_secs_f64`] would panic: timing
/// models compute in `f64`, and their output is rounded here, once.
pub fn duration_from_secs_f64(secs: f64) -> Duration {
    Duration::from_nanos(nanos_from_secs_f64(secs))
}

/// [`duration_from_secs_f64`] in nanoseconds, without the [`Duration`] (a division to build, a
/// multiplication to read back).
pub fn nanos_from_secs_f64(secs: f64) -> u64 {
    // `f64::round` without its libm call (a call on baseline x86-64, where every jittered step
    // time passes): `as` truncates, saturates and maps NaN to 0, and below 2^53 the fraction
    // `x - n` is exact (at and above, `x` is whole), so a half rounds up, as `round`'s does.
    let x = secs * 1e9;
    // Below 2^52 nanoseconds (52 days, every step time) the signed conversions give the same,
    // in a few instructions where unsigned ones take a dozen on baseline x86-64.
    if (0.0..4_503_599_627_370_496.0).contains(&x) {
        let n = x as i64;
        return (n + i64::from(x - n as f64 >= 0.5)) as u64;
    }
    let n = x as u64;
    n.saturating_add(u64::from(x - n as f64 >= 0.5))
}

impl Add<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturates at the largest timestamp instead of overflowing.
    fn add(self, d: Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

impl Sub<Duration> for Timestamp {
    type Output = Timestamp;

    /// Saturates at the epoch.
    fn sub(self, d: Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_sub(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_and_saturate() {
        assert_eq!(duration_from_secs_f64(0.0015), Duration::from_nanos(1_500_000));
        assert_eq!(duration_from_secs_f64(1.4e-9), Duration::from_nanos(1));
        assert_eq!(duration_from_secs_f64(-1.0), Duration::ZERO);
        assert_eq!(duration_from_secs_f64(f64::NAN), Duration::ZERO);
        assert_eq!(
            duration_from_secs_f64(f64::INFINITY),
            Duration::from_nanos(u64::MAX)
        );
        assert_eq!(
            Timestamp::from_millis(3) + Duration::from_micros(2),
            Timestamp(3_002_000)
        );
        assert_eq!(Timestamp(5) - Duration::from_nanos(7), Timestamp::ZERO);
        assert_eq!(Timestamp(u64::MAX) + Duration::from_nanos(1), Timestamp(u64::MAX));
        assert_eq!(Timestamp(7).saturating_since(Timestamp(9)), Duration::ZERO);
    }
}

/// The one mapping between a live driver's wall clock and engine time, and the speedup that
/// shortens modeled spans.
///
/// Engine time runs with the wall clock: a [`Timestamp`] is the wall time elapsed since the
/// driver's epoch, in nanoseconds (saturating). The speedup divides modeled spans (a forward
/// pass, a KV transfer), so a sped-up engine does a modeled second's work in `1 / speedup` wall
/// seconds. Sans-IO like the rest of the core: it converts the spans a driver measured, it reads
/// no clock. The simulator uses it too, for the modeled spans only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimeScale {
    speedup: f64,
}

impl TimeScale {
    /// No speedup: modeled spans are wall spans.
    pub const REAL: TimeScale = TimeScale { speedup: 1.0 };

    /// Modeled spans divided by `speedup`, or `None` unless it is finite and above zero.
    pub fn new(speedup: f64) -> Option<Self> {
        (speedup.is_finite() && speedup > 0.0).then_some(Self { speedup })
    }

    /// The speedup factor.
    pub fn speedup(self) -> f64 {
        self.speedup
    }

    /// The engine time at `elapsed` wall time after the driver's epoch.
    pub fn timestamp(self, elapsed: Duration) -> Timestamp {
        Timestamp(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
    }

    /// The wall time after the driver's epoch at which engine time reaches `t`.
    pub fn elapsed(self, t: Timestamp) -> Duration {
        Duration::from_nanos(t.0)
    }

    /// A span the model puts at `secs` seconds, sped up and rounded to the nanosecond (see
    /// [`duration_from_secs_f64`]).
    pub fn modeled_secs(self, secs: f64) -> Duration {
        duration_from_secs_f64(secs / self.speedup)
    }

    /// [`TimeScale::modeled_secs`] in nanoseconds.
    pub fn modeled_nanos(self, secs: f64) -> u64 {
        nanos_from_secs_f64(secs / self.speedup)
    }

    /// A modeled span, sped up (unchanged without speedup).
    pub fn modeled(self, span: Duration) -> Duration {
        if self.speedup == 1.0 {
            span
        } else {
            self.modeled_secs(span.as_secs_f64())
        }
    }
}

#[cfg(test)]
mod scale_tests {
    use super::*;

    #[test]
    fn a_time_scale_maps_wall_time_and_shortens_modeled_spans() {
        assert_eq!(TimeScale::new(0.0), None);
        assert_eq!(TimeScale::new(f64::NAN), None);
        let s = TimeScale::new(4.0).unwrap();
        let t = s.timestamp(Duration::from_millis(3));
        assert_eq!(t, Timestamp::from_millis(3));
        assert_eq!(s.elapsed(t), Duration::from_millis(3));
        assert_eq!(s.modeled(Duration::from_millis(8)), Duration::from_millis(2));
        assert_eq!(s.modeled_secs(1.0), Duration::from_millis(250));
        let d = Duration::from_nanos(123_456_789);
        assert_eq!(TimeScale::REAL.modeled(d), d);
        assert_eq!(TimeScale::REAL.timestamp(Duration::MAX), Timestamp(u64::MAX));
    }

    /// The reference: `f64::round`, then `as` (saturating, NaN to 0).
    fn rounded_nanos(secs: f64) -> Duration {
        Duration::from_nanos((secs * 1e9).round() as u64)
    }

    #[test]
    fn seconds_round_to_nanoseconds_as_f64_round_does_at_the_edges() {
        let halves = (0..64).map(|k| (k as f64 + 0.5) / 1e9);
        let edges = [
            0.0,
            -0.0,
            -1e-9,
            0.49e-9,
            0.5e-9,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        let large = [
            2f64.powi(52) / 1e9,
            (2f64.powi(52) - 0.5) / 1e9,
            (2f64.powi(52) - 1.5) / 1e9,
            2f64.powi(51) / 1e9 + 0.25e-9,
            2f64.powi(53) / 1e9,
            1.8446744073709552e10,
            1e300,
        ];
        for secs in halves.chain(edges).chain(large) {
            assert_eq!(duration_from_secs_f64(secs), rounded_nanos(secs), "{secs:e}");
        }
    }

    proptest::proptest! {
        #[test]
        fn seconds_round_to_nanoseconds_as_f64_round_does(bits: u64, secs in 0.0..1e3_f64) {
            let any = f64::from_bits(bits);
            proptest::prop_assert_eq!(duration_from_secs_f64(any), rounded_nanos(any));
            proptest::prop_assert_eq!(duration_from_secs_f64(secs), rounded_nanos(secs));
        }
    }
}
