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

/// The bucket of `v` milliseconds (above 0) by its definition: `floor((ln v - LOW_LN) /
/// GAMMA_LN)` within the buckets. The floor is the cast's truncation of a value kept at 0 or
/// above (`f64::floor` is a libm call on baseline x86-64). [`Bounds::bucket`] gives the same answer
/// without the logarithm.
fn bucket_by_log(v: f64) -> usize {
    (((v.ln() - LOW_LN) / GAMMA_LN).max(0.0) as usize).min(BUCKETS - 1)
}

/// `n` nanoseconds in milliseconds, as `Duration::from_nanos(n).as_secs_f64() * 1e3` (whole
/// seconds plus the fraction's nanoseconds over 1e9), without the division into seconds below
/// a second, where the whole seconds are 0 and adding them changes nothing.
fn ms_of_nanos(n: u64) -> f64 {
    if n < 1_000_000_000 {
        n as f64 / 1e9 * 1e3
    } else {
        Duration::from_nanos(n).as_secs_f64() * 1e3
    }
}

/// Bits dropped from a positive `f64` to name its cell: the cells split each power of two
/// into 512, narrower (a ratio of at most 1 + 1/512) than a bucket (1.002), so a cell holds at
/// most one bucket's lower bound.
const CELL_SHIFT: u32 = 52 - 9;

/// The buckets' lower bounds, as [`bucket_by_log`] draws them, and the first bucket of each
/// cell of `f64`s between the first and the last bound: a value's bucket is its cell's first,
/// or the next if the value reaches the next one's bound.
struct Bounds {
    /// `lower[i]`: the least `f64` whose [`bucket_by_log`] is `i` (0 for bucket 0), and
    /// infinity past the last bucket.
    lower: Vec<f64>,
    /// The cell of `lower[1]`.
    first_cell: u64,
    /// The bucket of each cell's smallest value, from `first_cell` to the cell of the last
    /// bound.
    cell_bucket: Vec<u16>,
}

impl Bounds {
    /// Built once for the process (a few million instructions).
    fn get() -> &'static Self {
        static BOUNDS: std::sync::OnceLock<Bounds> = std::sync::OnceLock::new();
        BOUNDS.get_or_init(Self::new)
    }

    fn new() -> Self {
        let mut lower = vec![0.0; BUCKETS + 1];
        for (i, bound) in lower.iter_mut().enumerate().take(BUCKETS).skip(1) {
            // Near `exp(LOW_LN + i GAMMA_LN)`; then the exact least value of the formula's
            // bucket `i`, ULP by ULP (the formula is monotone in `v`).
            let mut v = (LOW_LN + i as f64 * GAMMA_LN).exp();
            while bucket_by_log(v) >= i {
                v = f64::from_bits(v.to_bits() - 1);
            }
            while bucket_by_log(v) < i {
                v = f64::from_bits(v.to_bits() + 1);
            }
            *bound = v;
        }
        lower[BUCKETS] = f64::INFINITY;
        let first_cell = lower[1].to_bits() >> CELL_SHIFT;
        let last_cell = lower[BUCKETS - 1].to_bits() >> CELL_SHIFT;
        let mut b = 0;
        let cell_bucket = (first_cell..=last_cell)
            .map(|cell| {
                let smallest = f64::from_bits(cell << CELL_SHIFT);
                while lower[b + 1] <= smallest {
                    b += 1;
                }
                b as u16
            })
            .collect();
        Self {
            lower,
            first_cell,
            cell_bucket,
        }
    }

    /// The bucket of `v` milliseconds (above 0), the same as [`bucket_by_log`] (every jittered
    /// gap passes here): a look-up instead of a logarithm.
    #[inline(always)]
    fn bucket(&self, v: f64) -> usize {
        let Some(&b) = (v.to_bits() >> CELL_SHIFT)
            .checked_sub(self.first_cell)
            .and_then(|c| self.cell_bucket.get(c as usize))
        else {
            // Outside the cells: below the first bound, or at or past the last one's cell.
            return if v < self.lower[1] { 0 } else { BUCKETS - 1 };
        };
        let mut b = usize::from(b);
        while v >= self.lower[b + 1] {
            b += 1;
        }
        b
    }
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
        let v = d.as_secs_f64() * 1e3;
        let nanos = d.as_nanos();
        // Every span below 584 years squares as a 64-bit by 64-bit product.
        let square = match u64::try_from(nanos) {
            Ok(n) => u128::from(n) * u128::from(n),
            Err(_) => nanos * nanos,
        };
        self.count += k;
        self.sum_nanos += nanos * u128::from(k);
        self.sum_sq_nanos += square * u128::from(k);
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        self.add_to_bucket(v, k);
    }

    /// Records each of `spans` (in nanoseconds) `k` times: the same as [`Sketch::add_n`] on
    /// each, with the count, sums, least and greatest kept in locals until the end, and a run
    /// of equal spans given its bucket once (a run of skipped passes' inter-token gaps: all
    /// equal when the timing model ignores the context, each its own under jitter).
    pub fn add_nanos_each(&mut self, spans: impl IntoIterator<Item = u64>, k: u64) {
        if k == 0 {
            return;
        }
        let (mut count, mut sum, mut sum_sq) = (0_u64, 0_u128, 0_u128);
        let (mut least, mut greatest) = (u64::MAX, 0_u64);
        let bounds = Bounds::get();
        let mut spans = spans.into_iter();
        let Some(first) = spans.next() else {
            return;
        };
        // The current run of equal spans: its span and length.
        let (mut span, mut run) = (first, 1_u64);
        loop {
            let next = spans.next();
            if next == Some(span) {
                run += 1;
                continue;
            }
            count += run;
            sum += u128::from(span) * u128::from(run);
            sum_sq += u128::from(span) * u128::from(span) * u128::from(run);
            least = least.min(span);
            greatest = greatest.max(span);
            self.add_to_bucket_of(bounds, ms_of_nanos(span), run * k);
            match next {
                Some(n) => (span, run) = (n, 1),
                None => break,
            }
        }
        let k128 = u128::from(k);
        self.count += count * k;
        self.sum_nanos += sum * k128;
        self.sum_sq_nanos += sum_sq * k128;
        // Milliseconds rise with nanoseconds, so the extremes are those of the spans.
        self.min = self.min.min(ms_of_nanos(least));
        self.max = self.max.max(ms_of_nanos(greatest));
    }

    /// Puts `times` samples of `v` milliseconds in their bucket (or with the zeros), and
    /// nothing else.
    fn add_to_bucket(&mut self, v: f64, times: u64) {
        self.add_to_bucket_of(Bounds::get(), v, times);
    }

    /// [`Sketch::add_to_bucket`] with the bounds at hand (inlined where every jittered gap
    /// passes).
    #[inline(always)]
    fn add_to_bucket_of(&mut self, bounds: &Bounds, v: f64, times: u64) {
        if v <= 0.0 {
            self.zeros += times;
            return;
        }
        if self.buckets.is_empty() {
            self.buckets = vec![0; BUCKETS];
        }
        self.buckets[bounds.bucket(v)] += times;
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
            proptest::prop_assert_eq!(Bounds::get().bucket(v), reference);
        }

        #[test]
        fn bucket_matches_the_floor_over_the_buckets_range(ms in 1e-7..1e10_f64) {
            let reference = ((ms.ln() - LOW_LN) / GAMMA_LN).floor().clamp(0.0, (BUCKETS - 1) as f64) as usize;
            proptest::prop_assert_eq!(Bounds::get().bucket(ms), reference);
        }
    }

    proptest::proptest! {
        #[test]
        fn ms_of_nanos_is_the_durations_milliseconds(n in proptest::prop_oneof![0u64..2_000_000_000, proptest::num::u64::ANY]) {
            proptest::prop_assert_eq!(ms_of_nanos(n).to_bits(), (Duration::from_nanos(n).as_secs_f64() * 1e3).to_bits());
        }

        #[test]
        fn adding_spans_at_once_is_adding_them_one_by_one(
            before in proptest::collection::vec(0u64..5_000_000_000, 0..4),
            spans in proptest::collection::vec(proptest::prop_oneof![0u64..3, 1_000u64..100_000_000, 0u64..1 << 50], 0..40),
            k in 0u64..5,
        ) {
            let (mut at_once, mut one_by_one) = (Sketch::default(), Sketch::default());
            for &n in &before {
                at_once.add(Duration::from_nanos(n));
                one_by_one.add(Duration::from_nanos(n));
            }
            at_once.add_nanos_each(spans.iter().copied(), k);
            for &n in &spans {
                one_by_one.add_n(Duration::from_nanos(n), k);
            }
            let state = |s: &Sketch| {
                (s.buckets.clone(), s.count, s.sum_nanos, s.sum_sq_nanos, s.min.to_bits(), s.max.to_bits(), s.zeros)
            };
            proptest::prop_assert_eq!(state(&at_once), state(&one_by_one));
        }
    }

    #[test]
    fn bucket_matches_the_formula_at_every_bound_and_cell_edge() {
        // Each bucket's lower bound, the values a few ULPs either side of it, and the smallest
        // and largest value of every cell: where a look-up could go wrong.
        let bounds = Bounds::get();
        let near = |v: f64| (0..=8u64).map(move |d| f64::from_bits(v.to_bits() + d - 4));
        let edges = (0..=bounds.cell_bucket.len() as u64 + 1).flat_map(|c| {
            let cell = bounds.first_cell + c;
            [cell << CELL_SHIFT, ((cell + 1) << CELL_SHIFT) - 1].map(f64::from_bits)
        });
        let values = bounds.lower[1..BUCKETS]
            .iter()
            .flat_map(|&v| near(v))
            .chain(edges);
        let mut checked = 0;
        for v in values {
            assert_eq!(Bounds::get().bucket(v), bucket_by_log(v), "{v:e} ms");
            checked += 1;
        }
        assert!(checked > 9 * (BUCKETS - 1), "{checked} values");
        // Bounds rise by about a bucket's ratio.
        for w in bounds.lower[1..BUCKETS].windows(2) {
            assert!((w[1] / w[0] - 1.002).abs() < 1e-9, "{} then {}", w[0], w[1]);
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
