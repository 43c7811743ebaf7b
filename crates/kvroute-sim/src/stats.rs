//! Summary statistics: exact percentiles over per-request samples, and a log-bucket sketch for
//! the millions of inter-token gaps.

use std::time::Duration;

/// Exact summary of `values` (sorted in place): nearest-rank percentiles at index
/// `round((n - 1) · p / 100)`, as Dynamo's replay collector computes them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Summary {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// 50th percentile.
    pub p50: f64,
    /// 75th percentile.
    pub p75: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Population standard deviation.
    pub std: f64,
}

impl Summary {
    /// The summary of `values`; all zero when empty.
    pub fn exact(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        let mean = values.iter().sum::<f64>() / n as f64;
        let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let at = |p: f64| values[((n - 1) as f64 * p / 100.0).round() as usize];
        Self {
            count: n as u64,
            mean,
            min: values[0],
            max: values[n - 1],
            p50: at(50.0),
            p75: at(75.0),
            p90: at(90.0),
            p95: at(95.0),
            p99: at(99.0),
            std: var.sqrt(),
        }
    }
}

/// Log-bucket sketch of durations, reported in milliseconds, with 0.1% relative error (bucket
/// `i` holds values in `[γ^i, γ^(i+1))` ms, `γ = 1.002`, reported at the bucket's geometric
/// middle), plus an exact count, min and max, and a sum and sum of squares in integer
/// nanoseconds, so that the answer does not depend on the order values are added in (adding
/// `k` equal values at once is the same as adding them one by one). Bounded memory; same
/// inputs, same answers.
#[derive(Clone, Debug)]
pub struct Sketch {
    buckets: Vec<u64>,
    count: u64,
    sum_nanos: u128,
    sum_sq_nanos: u128,
    min: f64,
    max: f64,
    zeros: u64,
}

const GAMMA_LN: f64 = 0.001_998_002_662_673_056; // ln(1.002)
/// Values are in milliseconds: buckets cover 1e-6 ms to 1e9 ms.
const LOW_LN: f64 = -13.815_510_557_964_274; // ln(1e-6)
const BUCKETS: usize = 17_300;

/// The bucket of `v` milliseconds (above 0): `floor((ln v - LOW_LN) / GAMMA_LN)` within the
/// buckets. The floor is the cast's truncation of a value kept at 0 or above (`f64::floor` is a
/// libm call on baseline x86-64, and every jittered gap passes here).
fn bucket(v: f64) -> usize {
    (((v.ln() - LOW_LN) / GAMMA_LN).max(0.0) as usize).min(BUCKETS - 1)
}

impl Default for Sketch {
    fn default() -> Self {
        Self {
            buckets: Vec::new(),
            count: 0,
            sum_nanos: 0,
            sum_sq_nanos: 0,
            min: f64::INFINITY,
            max: 0.0,
            zeros: 0,
        }
    }
}

impl Sketch {
    /// Records `d`.
    pub fn add(&mut self, d: Duration) {
        self.add_n(d, 1);
    }

    /// Records `d` `k` times.
    pub fn add_n(&mut self, d: Duration, k: u64) {
        if k == 0 {
            return;
        }
        let nanos = d.as_nanos();
        let v = d.as_secs_f64() * 1e3;
        self.count += k;
        self.sum_nanos += nanos * u128::from(k);
        self.sum_sq_nanos += nanos * nanos * u128::from(k);
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        if v <= 0.0 {
            self.zeros += k;
            return;
        }
        if self.buckets.is_empty() {
            self.buckets = vec![0; BUCKETS];
        }
        self.buckets[bucket(v)] += k;
    }

    /// Samples recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The summary (percentiles approximate, mean, min, max and std exact).
    pub fn summary(&self) -> Summary {
        if self.count == 0 {
            return Summary::default();
        }
        let n = self.count as f64;
        let mean_nanos = self.sum_nanos as f64 / n;
        let var_nanos = (self.sum_sq_nanos as f64 / n - mean_nanos * mean_nanos).max(0.0);
        let mean = mean_nanos / 1e6;
        let at = |p: f64| self.quantile(((self.count - 1) as f64 * p / 100.0).round() as u64);
        Summary {
            count: self.count,
            mean,
            min: self.min,
            max: self.max,
            p50: at(50.0),
            p75: at(75.0),
            p90: at(90.0),
            p95: at(95.0),
            p99: at(99.0),
            std: var_nanos.sqrt() / 1e6,
        }
    }

    /// The distribution as (value ms, fraction of samples at or below it), one point per
    /// non-empty bucket (at its upper edge, clamped to `[min, max]`), at most `max_points`
    /// points (the last always kept).
    pub fn cdf(&self, max_points: usize) -> Vec<(f64, f64)> {
        if self.count == 0 {
            return Vec::new();
        }
        let n = self.count as f64;
        let mut points = Vec::new();
        if self.zeros > 0 {
            points.push((0.0, self.zeros as f64 / n));
        }
        let mut seen = self.zeros;
        for (i, &c) in self.buckets.iter().enumerate() {
            if c == 0 {
                continue;
            }
            seen += c;
            let upper = (LOW_LN + (i as f64 + 1.0) * GAMMA_LN).exp();
            points.push((upper.clamp(self.min, self.max), seen as f64 / n));
        }
        let step = points.len().div_ceil(max_points.max(1)).max(1);
        let last = points.len() - 1;
        points
            .iter()
            .enumerate()
            .filter(|(i, _)| i % step == 0 || *i == last)
            .map(|(_, p)| *p)
            .collect()
    }

    /// The value of rank `rank` (0-based), at its bucket's middle, clamped to `[min, max]`.
    fn quantile(&self, rank: u64) -> f64 {
        if rank < self.zeros {
            return 0.0;
        }
        let mut seen = self.zeros;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen > rank {
                let mid = (LOW_LN + (i as f64 + 0.5) * GAMMA_LN).exp();
                return mid.clamp(self.min, self.max);
            }
        }
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn bucket_is_the_clamped_floor_of_the_log_index(bits in 1u64..0x7FF0_0000_0000_0000) {
            // Every positive finite `v`, subnormals to the largest.
            let v = f64::from_bits(bits);
            let reference = ((v.ln() - LOW_LN) / GAMMA_LN).floor().clamp(0.0, (BUCKETS - 1) as f64) as usize;
            proptest::prop_assert_eq!(bucket(v), reference);
        }

        #[test]
        fn bucket_matches_the_floor_over_the_buckets_range(ms in 1e-7..1e10_f64) {
            let reference = ((ms.ln() - LOW_LN) / GAMMA_LN).floor().clamp(0.0, (BUCKETS - 1) as f64) as usize;
            proptest::prop_assert_eq!(bucket(ms), reference);
        }
    }

    #[test]
    fn exact_uses_nearest_rank() {
        let mut v: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = Summary::exact(&mut v);
        // round(9 · 0.5) = 5 (round half away from zero) -> 6.
        assert_eq!((s.p50, s.p90, s.p99, s.min, s.max), (6.0, 9.0, 10.0, 1.0, 10.0));
        assert_eq!(s.mean, 5.5);
    }

    #[test]
    fn sketch_is_within_its_relative_error() {
        let mut sketch = Sketch::default();
        let mut exact = Vec::new();
        for i in 1..=10_000u64 {
            let nanos = i * 370_000;
            sketch.add(Duration::from_nanos(nanos));
            exact.push(nanos as f64 / 1e6);
        }
        let (a, b) = (sketch.summary(), Summary::exact(&mut exact));
        for (x, y) in [(a.p50, b.p50), (a.p90, b.p90), (a.p99, b.p99)] {
            assert!((x - y).abs() / y < 0.002, "{x} vs {y}");
        }
        assert!((a.mean - b.mean).abs() < 1e-9);
        // The CDF rises to 1 and agrees with the exact fractions within a bucket.
        let cdf = sketch.cdf(200);
        assert!(cdf.len() <= 201 && cdf.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        assert_eq!(cdf.last().map(|p| p.1), Some(1.0));
        for &(x, f) in &cdf {
            let below = exact.iter().filter(|&&v| v <= x * 1.002).count() as f64 / exact.len() as f64;
            assert!((below - f).abs() < 0.002, "{x}: {f} vs {below}");
        }
    }
}
