//! Service-level objectives on a run's latency summary: `ttft-p90=500ms,itl-p99=50ms`, judged
//! against a [`Report`]'s keys, and the smallest fleet of a sweep that meets them.
//!
//! A run meets its SLO when every target holds and no request was turned away or left
//! unfinished: a fleet that sheds load is not fast, it is too small.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::report::{Latency, Report, Value};

/// Which summary of a latency a target bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stat {
    /// The mean.
    Mean,
    /// The median.
    P50,
    /// The 90th percentile.
    P90,
    /// The 95th percentile.
    P95,
    /// The 99th percentile.
    P99,
}

/// One bound: a latency's statistic at most `limit_ms`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SloTarget {
    /// The latency.
    pub latency: Latency,
    /// Its statistic.
    pub stat: Stat,
    /// The bound, milliseconds.
    pub limit_ms: f64,
}

/// Targets that must all hold.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Slo {
    /// The targets, in the order given.
    pub targets: Vec<SloTarget>,
}

/// One target judged.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SloCheck {
    /// The target as written, e.g. `ttft-p90`.
    pub target: String,
    /// Its bound, ms.
    pub limit_ms: f64,
    /// The run's value, ms.
    pub actual_ms: f64,
    /// Whether it holds.
    pub met: bool,
}

/// Why an SLO was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: {1}")]
pub struct SloError(String, &'static str);

const SHAPE: &str = "METRIC-STAT=LIMIT, comma-separated: METRIC ttft, itl, tpot or e2e; STAT mean, \
                     p50, p90, p95 or p99; LIMIT in ms or s (e.g. ttft-p90=500ms,itl-p99=50ms)";

impl FromStr for Slo {
    type Err = SloError;

    fn from_str(s: &str) -> Result<Self, SloError> {
        let mut targets = Vec::new();
        for part in s.split(',').map(str::trim) {
            let err = |why| SloError(part.to_owned(), why);
            let (name, limit) = part.split_once('=').ok_or_else(|| err(SHAPE))?;
            let (metric, stat) = name.trim().split_once('-').ok_or_else(|| err(SHAPE))?;
            let latency = match metric {
                "ttft" => Latency::Ttft,
                "itl" => Latency::Itl,
                "tpot" => Latency::Tpot,
                "e2e" => Latency::E2e,
                _ => return Err(err("the metric is ttft, itl, tpot or e2e")),
            };
            let stat = match stat {
                "mean" => Stat::Mean,
                "p50" | "median" => Stat::P50,
                "p90" => Stat::P90,
                "p95" => Stat::P95,
                "p99" => Stat::P99,
                _ => return Err(err("the statistic is mean, p50, p90, p95 or p99")),
            };
            let limit = limit.trim();
            let (number, scale) = if let Some(ms) = limit.strip_suffix("ms") {
                (ms, 1.0)
            } else if let Some(sec) = limit.strip_suffix('s') {
                (sec, 1e3)
            } else {
                (limit, 1.0)
            };
            let limit_ms = match number.trim().parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => v * scale,
                _ => return Err(err("the limit is a number above 0, in ms or s")),
            };
            if targets
                .iter()
                .any(|t: &SloTarget| t.latency == latency && t.stat == stat)
            {
                return Err(err("is given twice"));
            }
            targets.push(SloTarget {
                latency,
                stat,
                limit_ms,
            });
        }
        Ok(Self { targets })
    }
}

impl fmt::Display for SloTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let metric = match self.latency {
            Latency::Ttft => "ttft",
            Latency::Itl => "itl",
            Latency::Tpot => "tpot",
            Latency::E2e => "e2e",
        };
        let stat = match self.stat {
            Stat::Mean => "mean",
            Stat::P50 => "p50",
            Stat::P90 => "p90",
            Stat::P95 => "p95",
            Stat::P99 => "p99",
        };
        write!(f, "{metric}-{stat}")
    }
}

impl SloTarget {
    /// The report key holding the value this target bounds.
    pub fn key(&self) -> &'static str {
        let keys = self.latency.keys();
        match self.stat {
            Stat::Mean => keys[0],
            Stat::P50 => keys[3],
            Stat::P90 => keys[5],
            Stat::P95 => keys[6],
            Stat::P99 => keys[7],
        }
    }
}

impl Slo {
    /// Each target against `report`, in order.
    pub fn checks(&self, report: &Report) -> Vec<SloCheck> {
        self.targets
            .iter()
            .map(|t| {
                let actual_ms = report.number(t.key()).unwrap_or(f64::INFINITY);
                SloCheck {
                    target: t.to_string(),
                    limit_ms: t.limit_ms,
                    actual_ms,
                    met: actual_ms <= t.limit_ms,
                }
            })
            .collect()
    }

    /// Whether `report` meets the SLO: every target holds, nothing was turned away or left
    /// unfinished, and something completed.
    pub fn met(&self, report: &Report) -> bool {
        let zero = |key| report.number(key).unwrap_or(0.0) == 0.0;
        self.checks(report).iter().all(|c| c.met)
            && zero("rejected_requests")
            && zero("unfinished_requests")
            && report.number("completed_requests").unwrap_or(0.0) > 0.0
    }

    /// Appends the verdict to `report`: `slo` (each check) and `slo_met` (`yes` or `no`).
    pub fn judge(&self, report: &mut Report) {
        let checks = self.checks(report);
        let met = self.met(report);
        report.push(
            "slo",
            Value::Json(serde_json::to_value(&checks).unwrap_or(serde_json::Value::Null)),
        );
        report.push("slo_met", Value::Text(if met { "yes" } else { "no" }.to_owned()));
    }
}

/// The first of `runs` (fleet sizes in ascending order, with their reports) whose report meets
/// `slo`.
pub fn smallest_meeting<'a, T>(slo: &Slo, runs: &'a [(T, Report)]) -> Option<&'a (T, Report)> {
    runs.iter().find(|(_, r)| slo.met(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_with_units_and_name_their_keys() {
        let slo: Slo = "ttft-p90=500ms, itl-p99=50, e2e-mean=2s,tpot-median=0.5ms"
            .parse()
            .unwrap();
        let keys: Vec<_> = slo.targets.iter().map(|t| (t.key(), t.limit_ms)).collect();
        assert_eq!(
            keys,
            [
                ("p90_ttft_ms", 500.0),
                ("p99_itl_ms", 50.0),
                ("mean_e2e_latency_ms", 2000.0),
                ("median_tpot_ms", 0.5)
            ]
        );
        assert_eq!(slo.targets[3].to_string(), "tpot-p50");
        for bad in [
            "ttft=5",
            "ttft-p42=5",
            "queue-p90=5",
            "ttft-p90=0",
            "ttft-p90=fast",
            "",
            "ttft-p90=1,ttft-p90=2",
        ] {
            assert!(bad.parse::<Slo>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_run_meets_its_slo_only_with_every_target_and_nothing_shed() {
        let slo: Slo = "ttft-p90=100ms,itl-mean=10ms".parse().unwrap();
        let report = |p90: f64, itl: f64, rejected: u64| {
            let mut r = Report::default();
            r.count("completed_requests", 10);
            r.count("rejected_requests", rejected);
            r.float("p90_ttft_ms", p90);
            r.float("mean_itl_ms", itl);
            r
        };
        assert!(slo.met(&report(100.0, 10.0, 0)));
        assert!(!slo.met(&report(100.1, 10.0, 0)));
        assert!(!slo.met(&report(50.0, 11.0, 0)));
        assert!(!slo.met(&report(50.0, 5.0, 1)));
        let runs = [
            (1, report(300.0, 5.0, 0)),
            (2, report(90.0, 5.0, 0)),
            (3, report(80.0, 5.0, 0)),
        ];
        assert_eq!(smallest_meeting(&slo, &runs).map(|(n, _)| *n), Some(2));
        let mut judged = report(90.0, 5.0, 0);
        slo.judge(&mut judged);
        assert_eq!(judged.get("slo_met"), Some(&Value::Text("yes".to_owned())));
    }
}
