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
    }
}
