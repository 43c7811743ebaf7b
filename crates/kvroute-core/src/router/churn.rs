//! Eviction pressure: how fast a worker's cache turns over, from the `Removed` events the
//! router already gets.
//!
//! An engine evicts a cached block only to make room for another, so a worker whose events
//! remove many blocks is full and churning: a block it caches now will soon be gone, and every
//! block a new prompt adds there pushes out a prefix some later request could have reused. The
//! router keeps, per worker, the blocks it removed, decayed exponentially with time constant
//! `Churn::HALF_LIFE_NS` / ln 2, and reads them as a fraction of the worker's capacity
//! ([`Churn::pressure`], at most 1). The cost charges a prompt's uncached blocks on a worker by
//! that fraction (`evict` in [`super::cost`]), so new prompts go to workers with room and a
//! conversation whose prefix is cached stays where it is.

use crate::time::Timestamp;

/// A worker's recent evictions, decayed with time; see the module docs.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Churn {
    /// Removed blocks, decayed to `at`.
    blocks: f64,
    /// When `blocks` was last brought up to date.
    at: Timestamp,
}

impl Churn {
    /// The time it takes the count of removed blocks to halve: long enough to span a few
    /// turns of a conversation (seconds), short enough to forget a burst once it is over.
    pub(crate) const HALF_LIFE_NS: u64 = 30_000_000_000;

    /// `blocks` were removed at `now`.
    pub(crate) fn record(&mut self, now: Timestamp, blocks: usize) {
        self.blocks = self.decayed(now) + blocks as f64;
        self.at = self.at.max(now);
    }

    /// The removed blocks decayed to `now` (an earlier `now` reads the last value).
    fn decayed(&self, now: Timestamp) -> f64 {
        let dt = now.as_nanos().saturating_sub(self.at.as_nanos());
        if dt == 0 || self.blocks == 0.0 {
            return self.blocks;
        }
        self.blocks * (-(dt as f64) / Self::HALF_LIFE_NS as f64 * std::f64::consts::LN_2).exp()
    }

    /// The removed blocks at `now` as a fraction of `capacity_blocks`, in `[0, 1]`.
    pub(crate) fn pressure(&self, now: Timestamp, capacity_blocks: u64) -> f64 {
        (self.decayed(now) / capacity_blocks.max(1) as f64).min(1.0)
    }

    /// The decay's rate, per nanosecond.
    const RATE: f64 = std::f64::consts::LN_2 / Self::HALF_LIFE_NS as f64;

    /// The pressure as a number that decay leaves alone: `ln(blocks / capacity_blocks)` moved
    /// to time 0 (`-inf` before any removal). Every worker decays at the same rate, so the
    /// lowest key of a set of workers names their lowest pressure at any later time
    /// ([`Churn::pressure_floor`]), and a worker's key only grows ([`Churn::record`] adds blocks
    /// and moves forward).
    pub(crate) fn key(&self, capacity_blocks: u64) -> f64 {
        (self.blocks / capacity_blocks.max(1) as f64).ln() + self.at.as_nanos() as f64 * Self::RATE
    }

    /// The pressure at `now` of a worker whose key is `key`, if nothing was recorded after
    /// `latest`; a lower bound on the pressure of every worker whose key is at least `key` (up
    /// to rounding, some 1e-12 of it).
    pub(crate) fn pressure_floor(key: f64, latest: Timestamp, now: Timestamp) -> f64 {
        // Up to `latest` a worker's pressure may not have decayed yet (an earlier `now` reads
        // its last value): decay from there at the earliest.
        let t = now.max(latest).as_nanos() as f64;
        (key - t * Self::RATE).exp().min(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(ns: u64) -> Timestamp {
        Timestamp(ns)
    }

    #[test]
    fn pressure_halves_every_half_life_and_saturates_at_one() {
        let mut c = Churn::default();
        c.record(at(0), 500);
        assert_eq!(c.pressure(at(0), 1000), 0.5);
        let half = c.pressure(at(Churn::HALF_LIFE_NS), 1000);
        assert!((half - 0.25).abs() < 1e-12, "{half}");
        c.record(at(0), 5000);
        assert_eq!(c.pressure(at(0), 1000), 1.0);
    }

    proptest! {
        /// Never negative, never above 1, never growing without a removal.
        #[test]
        fn pressure_is_a_fraction_that_only_removals_raise(
            events in prop::collection::vec((0u64..100_000_000_000, 0usize..10_000), 0..20),
            capacity in 1u64..100_000,
            later in 0u64..100_000_000_000,
        ) {
            let mut c = Churn::default();
            let mut now = 0;
            for (dt, blocks) in events {
                now += dt;
                let before = c.pressure(at(now), capacity);
                c.record(at(now), blocks);
                let after = c.pressure(at(now), capacity);
                prop_assert!((0.0..=1.0).contains(&after));
                prop_assert!(after >= before);
            }
            let p = c.pressure(at(now), capacity);
            prop_assert!(c.pressure(at(now + later), capacity) <= p);
        }

        /// The key names the pressure at every later time, and only grows: the lowest key of
        /// several workers bounds each one's pressure from below.
        #[test]
        fn the_key_bounds_the_pressure_from_below_at_any_time(
            events in prop::collection::vec((0u64..100_000_000_000, 0usize..10_000), 1..20),
            capacity in 1u64..100_000,
            queries in prop::collection::vec(0u64..400_000_000_000, 1..8),
        ) {
            let mut c = Churn::default();
            let mut now = 0;
            let mut key = c.key(capacity);
            for (dt, blocks) in events {
                now += dt;
                c.record(at(now), blocks);
                let next = c.key(capacity);
                prop_assert!(next >= key - 1e-9, "key went from {key} to {next}");
                key = next;
            }
            let latest = at(now);
            for q in queries {
                let t = at(q);
                let p = c.pressure(t, capacity);
                let floor = Churn::pressure_floor(key, latest, t);
                prop_assert!(floor <= p * (1.0 + 1e-12), "floor {floor} above pressure {p} at {q}");
                if q >= now {
                    prop_assert!((floor - p).abs() <= p * 1e-9, "floor {floor} against {p} at {q}");
                }
            }
        }
    }
}
