//! The router's random numbers: a small seeded generator, so that a seed and a trace give the
//! same decisions every time, in production as in simulation.
//!
//! SplitMix64 (Steele, Lea and Flood, 2014): one 64-bit word of state, a Weyl increment and a
//! 64-bit finalizer. It passes BigCrush, is a few instructions per draw, and is more than good
//! enough for tie-breaks and sampling. It reads no entropy source: the seed is configuration.

/// A seeded SplitMix64 generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator whose draws depend only on `seed`.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform float in `[0, 1)`, from the top 53 bits of a draw.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A uniform integer in `0..n`; `n` must be at least 1 (0 gives 0).
    ///
    /// Lemire's multiply-and-reject, so every value is exactly equally likely. The rejection
    /// threshold (`2^64 mod n`, a division) is below `n`, so it is computed only when the low
    /// word is below `n` (Lemire's "nearly divisionless" form; the same draws).
    pub fn below(&mut self, n: usize) -> usize {
        let n = n as u64;
        if n <= 1 {
            return 0;
        }
        let mut wide = u128::from(self.next_u64()) * u128::from(n);
        if (wide as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (wide as u64) < threshold {
                wide = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (wide >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn same_seed_same_draws() {
        let mut a = Rng::new(42);
        let mut b = Rng::new(42);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
    }

    #[test]
    fn splitmix64_reference_values() {
        // Reference outputs of SplitMix64 seeded with 1234567 (from the published C code).
        let mut r = Rng::new(1_234_567);
        assert_eq!(r.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(r.next_u64(), 3_203_168_211_198_807_973);
    }

    #[test]
    fn below_draws_as_the_plain_multiply_and_reject() {
        let plain = |r: &mut Rng, n: u64| {
            let threshold = n.wrapping_neg() % n;
            loop {
                let wide = u128::from(r.next_u64()) * u128::from(n);
                if (wide as u64) >= threshold {
                    return (wide >> 64) as usize;
                }
            }
        };
        let (mut a, mut b) = (Rng::new(11), Rng::new(11));
        // Small fleets, and bounds just past powers of two where rejection is likeliest.
        let bounds = (2..300u64).chain([(1 << 63) + 1, (1 << 62) + 3, u64::MAX, 3 << 62]);
        for n in bounds {
            for _ in 0..50 {
                assert_eq!(a.below(n as usize), plain(&mut b, n), "n = {n}");
            }
        }
        assert_eq!(a, b);
    }

    #[test]
    fn below_is_in_range_and_covers_it() {
        let mut r = Rng::new(7);
        let mut seen = [0u32; 5];
        for _ in 0..1000 {
            seen[r.below(5)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 150), "{seen:?}");
        assert_eq!(r.below(1), 0);
        assert!((0..1000).all(|_| (0.0..1.0).contains(&r.next_f64())));
    }
}
