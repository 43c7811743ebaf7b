//! One-step-ahead forecasts of a per-window series (request count, ISL, OSL, hit rate).
//!
//! Rules common to every predictor: a non-finite observation counts as 0; leading zeros (before
//! traffic starts) are skipped, zeros later are kept; a forecast is never negative; with no
//! observation the forecast is 0.

use crate::config::PredictorConfig;

/// A forecaster of one series.
#[derive(Clone, Debug)]
pub struct Predictor {
    config: PredictorConfig,
    history: Vec<f64>,
    /// Holt: level and trend.
    holt: Option<(f64, f64)>,
    /// Kalman: state (level, trend) and covariance.
    kalman: Option<([f64; 2], [[f64; 2]; 2])>,
}

impl Predictor {
    /// A predictor with no history.
    pub fn new(config: PredictorConfig) -> Self {
        Self {
            config,
            history: Vec::new(),
            holt: None,
            kalman: None,
        }
    }

    /// Observations taken (leading zeros excluded).
    pub fn len(&self) -> usize {
        self.history.len()
    }

    /// Whether nothing was observed yet.
    pub fn is_empty(&self) -> bool {
        self.history.is_empty()
    }

    /// Takes the value of the window that just ended.
    pub fn observe(&mut self, value: f64) {
        let y = if value.is_finite() { value } else { 0.0 };
        if self.history.is_empty() && y == 0.0 {
            return;
        }
        self.history.push(y);
        if self.history.len() > 1024 {
            self.history.remove(0);
        }
        match self.config {
            PredictorConfig::Holt { alpha, beta } => {
                self.holt = Some(match self.holt {
                    None => (y, 0.0),
                    Some((level, trend)) => {
                        let l = alpha * y + (1.0 - alpha) * (level + trend);
                        (l, beta * (l - level) + (1.0 - beta) * trend)
                    }
                });
            }
            PredictorConfig::Kalman {
                q_level, q_trend, r, ..
            } => {
                self.kalman = Some(match self.kalman {
                    None => ([y, 0.0], [[r, 0.0], [0.0, r]]),
                    Some((x, p)) => {
                        // Predict: x = F x, P = F P F' + Q with F = [[1, 1], [0, 1]].
                        let xp = [x[0] + x[1], x[1]];
                        let p00 = p[0][0] + p[0][1] + p[1][0] + p[1][1] + q_level;
                        let p01 = p[0][1] + p[1][1];
                        let p10 = p[1][0] + p[1][1];
                        let p11 = p[1][1] + q_trend;
                        // Update with H = [1, 0].
                        let s = p00 + r;
                        let (k0, k1) = (p00 / s, p10 / s);
                        let innovation = y - xp[0];
                        (
                            [xp[0] + k0 * innovation, xp[1] + k1 * innovation],
                            [
                                [(1.0 - k0) * p00, (1.0 - k0) * p01],
                                [p10 - k1 * p00, p11 - k1 * p01],
                            ],
                        )
                    }
                });
            }
            PredictorConfig::Constant | PredictorConfig::MovingAverage { .. } => {}
        }
    }

    /// The forecast of the next window.
    pub fn predict(&self) -> f64 {
        let Some(&last) = self.history.last() else {
            return 0.0;
        };
        let forecast = match self.config {
            PredictorConfig::Constant => last,
            PredictorConfig::MovingAverage { window } => {
                let tail = &self.history[self.history.len().saturating_sub(window)..];
                tail.iter().sum::<f64>() / tail.len() as f64
            }
            PredictorConfig::Holt { .. } => self.holt.map_or(last, |(l, t)| l + t),
            PredictorConfig::Kalman { min_points, .. } => match self.kalman {
                Some((x, _)) if self.history.len() >= min_points => x[0] + x[1],
                _ => last,
            },
        };
        if forecast.is_finite() {
            forecast.max(0.0)
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(config: PredictorConfig, values: &[f64]) -> f64 {
        let mut p = Predictor::new(config);
        for &v in values {
            p.observe(v);
        }
        p.predict()
    }

    #[test]
    fn constant_and_moving_average() {
        assert_eq!(run(PredictorConfig::Constant, &[1.0, 5.0, 3.0]), 3.0);
        assert_eq!(
            run(PredictorConfig::MovingAverage { window: 2 }, &[1.0, 5.0, 3.0]),
            4.0
        );
        assert_eq!(run(PredictorConfig::Constant, &[]), 0.0);
    }

    #[test]
    fn leading_zeros_skipped_later_zeros_kept_nan_is_zero() {
        let mut p = Predictor::new(PredictorConfig::MovingAverage { window: 10 });
        for v in [0.0, 0.0, 4.0, 0.0, f64::NAN] {
            p.observe(v);
        }
        assert_eq!(p.len(), 3);
        assert!((p.predict() - 4.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn trend_followers_extrapolate_a_ramp() {
        let ramp: Vec<f64> = (1..=20).map(|i| 10.0 * f64::from(i)).collect();
        let holt = run(
            PredictorConfig::Holt {
                alpha: 0.5,
                beta: 0.5,
            },
            &ramp,
        );
        assert!((holt - 210.0).abs() < 1.0, "{holt}");
        let kalman = run(PredictorConfig::default(), &ramp);
        assert!((kalman - 210.0).abs() < 5.0, "{kalman}");
        assert!(
            run(
                PredictorConfig::Holt {
                    alpha: 0.5,
                    beta: 0.5
                },
                &[10.0, 0.0, 0.0, 0.0]
            ) >= 0.0
        );
    }
}
