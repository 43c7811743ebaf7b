//! Online least squares of step time on one or two batch features, with bounded, bucketed
//! sample memory.
//!
//! * **Memory.** At most `max_samples` samples. Each sample falls in a bucket by its features'
//!   position in their known ranges (1-D: `buckets` equal slices; 2-D: a `g x g` grid with
//!   `g = floor(sqrt(buckets))`). When memory is full, the oldest sample of the fullest bucket
//!   goes (ties: the lowest bucket), so a long stretch at one load level cannot crowd out the
//!   samples of the others.
//! * **Fit.** Ordinary least squares with an intercept, on centred data. A fit whose slope
//!   coefficients are not all non-negative (or whose system is singular) is rejected and the
//!   previous accepted fit stays; so does a fit from fewer than `min_observations` samples.

/// A fitted linear model `y = intercept + coef · x`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fit<const K: usize> {
    /// The constant term.
    pub intercept: f64,
    /// One coefficient per feature, all non-negative.
    pub coef: [f64; K],
}

impl<const K: usize> Fit<K> {
    /// The model's value at `x`.
    pub fn predict(&self, x: [f64; K]) -> f64 {
        self.intercept + self.coef.iter().zip(x).map(|(c, v)| c * v).sum::<f64>()
    }
}

#[derive(Clone, Copy, Debug)]
struct Sample<const K: usize> {
    x: [f64; K],
    y: f64,
    bucket: usize,
}

/// The samples of one regression and its last accepted fit.
#[derive(Clone, Debug)]
pub struct Regression<const K: usize> {
    /// The upper end of each feature's range (for bucketing; larger values go to the last bucket).
    ranges: [f64; K],
    grid: usize,
    max_samples: usize,
    min_observations: usize,
    samples: Vec<Sample<K>>,
    fit: Option<Fit<K>>,
    rejected: u64,
    dirty: bool,
}

impl<const K: usize> Regression<K> {
    /// An empty regression; `ranges` are the features' expected maxima, `buckets` the bucket
    /// count (a `g x g` grid for two features).
    pub fn new(ranges: [f64; K], max_samples: usize, buckets: usize, min_observations: usize) -> Self {
        let grid = if K == 1 {
            buckets.max(1)
        } else {
            ((buckets as f64).sqrt().floor() as usize).max(1)
        };
        Self {
            ranges: ranges.map(|r| if r.is_finite() && r > 0.0 { r } else { 1.0 }),
            grid,
            max_samples: max_samples.max(2),
            min_observations: min_observations.max(2),
            samples: Vec::new(),
            fit: None,
            rejected: 0,
            dirty: false,
        }
    }

    fn bucket(&self, x: &[f64; K]) -> usize {
        let mut b = 0;
        for (v, r) in x.iter().zip(&self.ranges) {
            let cell = ((v / r) * self.grid as f64).floor();
            let cell = if cell.is_finite() {
                cell.clamp(0.0, (self.grid - 1) as f64)
            } else {
                0.0
            };
            b = b * self.grid + cell as usize;
        }
        b
    }

    /// Adds a sample; non-finite, negative or zero step times are ignored. Returns whether it
    /// was kept.
    pub fn add(&mut self, x: [f64; K], y: f64) -> bool {
        if !(y.is_finite() && y > 0.0) || x.iter().any(|v| !(v.is_finite() && *v >= 0.0)) {
            return false;
        }
        if self.samples.len() >= self.max_samples {
            let mut counts = vec![0usize; self.grid.pow(K as u32)];
            for s in &self.samples {
                counts[s.bucket] += 1;
            }
            let mut fullest = 0;
            for (b, &c) in counts.iter().enumerate() {
                if c > counts[fullest] {
                    fullest = b;
                }
            }
            if let Some(pos) = self.samples.iter().position(|s| s.bucket == fullest) {
                self.samples.remove(pos);
            }
        }
        let bucket = self.bucket(&x);
        self.samples.push(Sample { x, y, bucket });
        self.dirty = true;
        true
    }

    /// Samples held.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Fits rejected so far (negative coefficient or singular system).
    pub fn rejected(&self) -> u64 {
        self.rejected
    }

    /// The current fit: refitted if samples came since the last call, else the last accepted.
    ///
    /// A fit with a negative slope is rejected (counted in [`Regression::rejected`]); with two
    /// features, the fit without the negative one (its coefficient 0) is tried next, as Dynamo
    /// clips a negative request-count coefficient. If that fails too, the previous fit stays.
    pub fn fit(&mut self) -> Option<Fit<K>> {
        if self.dirty && self.samples.len() >= self.min_observations {
            self.dirty = false;
            let all = [true; K];
            match least_squares(&self.samples, all) {
                Some(fit) if fit.coef.iter().all(|&c| c >= 0.0) => self.fit = Some(fit),
                full => {
                    self.rejected += 1;
                    let keep = full.map(|f| f.coef.map(|c| c >= 0.0));
                    if let Some(keep) = keep
                        && keep.iter().any(|&k| k)
                        && let Some(fit) = least_squares(&self.samples, keep)
                        && fit.coef.iter().all(|&c| c >= 0.0)
                    {
                        self.fit = Some(fit);
                    }
                }
            }
        }
        self.fit
    }

    /// The last accepted fit, without refitting.
    pub fn current(&self) -> Option<Fit<K>> {
        self.fit
    }
}

/// Ordinary least squares with an intercept over the features marked in `active` (the others
/// get coefficient 0); `None` when the centred system is singular or the result not finite.
fn least_squares<const K: usize>(samples: &[Sample<K>], active: [bool; K]) -> Option<Fit<K>> {
    let n = samples.len() as f64;
    let mut mx = [0.0; K];
    let mut my = 0.0;
    for s in samples {
        for (m, x) in mx.iter_mut().zip(s.x) {
            *m += x / n;
        }
        my += s.y / n;
    }
    // Centred normal equations S b = c; an inactive feature's row is the identity.
    let mut a = [[0.0; K]; K];
    let mut c = [0.0; K];
    for s in samples {
        let dy = s.y - my;
        for i in (0..K).filter(|&i| active[i]) {
            let di = s.x[i] - mx[i];
            c[i] += di * dy;
            for j in (0..K).filter(|&j| active[j]) {
                a[i][j] += di * (s.x[j] - mx[j]);
            }
        }
    }
    let scale = a.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs()));
    for i in (0..K).filter(|&i| !active[i]) {
        a[i][i] = scale.max(1.0);
    }
    let coef = solve(a, c)?;
    let intercept = my - coef.iter().zip(mx).map(|(b, m)| b * m).sum::<f64>();
    intercept.is_finite().then_some(Fit { intercept, coef })
}

/// Gaussian elimination with partial pivoting; `None` for a (near-)singular matrix.
fn solve<const K: usize>(mut a: [[f64; K]; K], mut b: [f64; K]) -> Option<[f64; K]> {
    let scale = a.iter().flatten().fold(0.0f64, |m, v| m.max(v.abs()));
    if scale == 0.0 {
        return None;
    }
    for col in 0..K {
        let pivot = (col..K).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= scale * 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..K {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (v, p) in a[row].iter_mut().zip(pivot_row).skip(col) {
                *v -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; K];
    for row in (0..K).rev() {
        let mut v = b[row];
        for k in row + 1..K {
            v -= a[row][k] * x[k];
        }
        x[row] = v / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A two-feature regression (batch size up to 256, KV tokens up to 10^6) fed the step time
    /// `time(s, kv)` at each of `points`.
    fn fed_plane(points: &[(f64, f64)], time: impl Fn(f64, f64) -> f64) -> Regression<2> {
        let mut r = Regression::<2>::new([256.0, 1e6], 64, 16, 5);
        for &(s, kv) in points {
            r.add([s, kv], time(s, kv));
        }
        r
    }

    #[test]
    fn one_feature_fits_known_line_exactly() {
        let mut r = Regression::<1>::new([8192.0], 64, 16, 5);
        for x in [100.0, 900.0, 2000.0, 4096.0, 8000.0, 300.0] {
            r.add([x], 0.0165 + 1.5e-5 * x);
        }
        let fit = r.fit().expect("fitted");
        assert!((fit.intercept - 0.0165).abs() < 1e-12, "{fit:?}");
        assert!((fit.coef[0] - 1.5e-5).abs() < 1e-15, "{fit:?}");
    }

    #[test]
    fn two_features_fit_known_plane_exactly() {
        let points = [
            (1.0, 1000.0),
            (10.0, 5000.0),
            (50.0, 200_000.0),
            (100.0, 90_000.0),
            (200.0, 800_000.0),
            (3.0, 700_000.0),
        ];
        let mut r = fed_plane(&points, |s, kv| 0.005 + 2e-5 * s + 3e-8 * kv);
        let fit = r.fit().expect("fitted");
        assert!((fit.intercept - 0.005).abs() < 1e-12, "{fit:?}");
        assert!((fit.coef[0] - 2e-5).abs() < 1e-13, "{fit:?}");
        assert!((fit.coef[1] - 3e-8).abs() < 1e-16, "{fit:?}");
        assert!((fit.predict([20.0, 10_000.0]) - (0.005 + 4e-4 + 3e-4)).abs() < 1e-12);
    }

    #[test]
    fn too_few_samples_give_no_fit() {
        let mut r = Regression::<1>::new([100.0], 64, 16, 5);
        for x in 0..4 {
            r.add([f64::from(x)], 1.0 + f64::from(x));
        }
        assert_eq!(r.fit(), None);
    }

    #[test]
    fn negative_slope_is_rejected_and_the_previous_fit_stays() {
        let mut r = Regression::<1>::new([100.0], 8, 1, 5);
        for x in 1..=5 {
            r.add([f64::from(x)], 1.0 + f64::from(x));
        }
        let good = r.fit().expect("fitted");
        // Memory of 8 in one bucket: these push the rising samples out and slope down.
        for x in 1..=8 {
            r.add([f64::from(x) * 10.0], 100.0 - f64::from(x));
        }
        assert_eq!(r.fit(), Some(good));
        assert_eq!(r.rejected(), 1);
    }

    #[test]
    fn a_negative_coefficient_of_two_is_dropped_and_the_rest_refitted() {
        // Step time falls with the first feature: the full fit is rejected, the fit on the
        // second feature alone is kept with the first coefficient at 0.
        let points = [
            (1.0, 1000.0),
            (50.0, 5000.0),
            (10.0, 200_000.0),
            (100.0, 90_000.0),
            (30.0, 800_000.0),
        ];
        let mut r = fed_plane(&points, |s, kv| 0.01 - 1e-5 * s + 3e-8 * kv);
        let fit = r.fit().expect("the reduced fit");
        assert_eq!(r.rejected(), 1);
        assert_eq!(fit.coef[0], 0.0);
        assert!(fit.coef[1] > 0.0, "{fit:?}");
    }

    #[test]
    fn zero_and_non_finite_times_are_skipped() {
        let mut r = Regression::<1>::new([100.0], 8, 4, 2);
        assert!(!r.add([1.0], 0.0));
        assert!(!r.add([1.0], f64::NAN));
        assert!(!r.add([f64::INFINITY], 1.0));
        assert!(r.is_empty());
    }

    #[test]
    fn buckets_keep_rare_load_levels() {
        // 16 buckets over [0, 1600): one sample at a high level, then many at a low level.
        let mut r = Regression::<1>::new([1600.0], 16, 16, 2);
        r.add([1500.0], 2.5);
        for i in 0..100 {
            r.add([f64::from(i % 50)], 1.0 + f64::from(i % 50) / 1000.0);
        }
        assert_eq!(r.len(), 16);
        assert!(
            r.samples.iter().any(|s| s.x[0] == 1500.0),
            "the rare level survived"
        );
    }
}
