//! A self-contained HTML page of plots: inline SVG, no script, nothing fetched, so a browser
//! opens it offline.
//!
//! Plots: TTFT, ITL and E2E distributions (CDFs, every policy overlaid), a sweep's latencies
//! against its fleet sizes ([`sweep_section`]), and per policy the requests
//! and KV use of each worker over time, the engines' prefix hit rate over time and the number of
//! waiting requests; with a planner, its replicas over time, observed vs predicted load, SLA
//! attainment per window and the decision log.

use std::fmt::Write;

use crate::RunResult;

/// 32 colours, each at least 60 apart (RGB distance) from every other, so 32 workers' lines
/// stay apart: the ten of matplotlib's `tab10`, then 22 more picked greedily (each the farthest
/// from those before it, over a grid of hue, lightness and saturation).
const PALETTE: [&str; 32] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf", "#000080", "#4d00e6", "#e600e5", "#4dff6a", "#6a0080", "#ffff4d", "#800000", "#79d2c3",
    "#ff1a8c", "#1aff1a", "#205560", "#73e600", "#d2b579", "#4d88ff", "#00b277", "#4dffff", "#7f8000",
    "#e96363", "#0026e6", "#a6ff4d", "#c44dff", "#4c39ac",
];

/// The colour of line `i` (distinct for the first 32, then repeating).
pub fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}
const MAX_POINTS: usize = 800;

/// One line of a chart.
struct Line<'a> {
    name: &'a str,
    points: Vec<(f64, f64)>,
}

/// The page for `results` (name, result), one section per policy after the shared CDFs.
pub fn page(results: &[(String, RunResult)]) -> String {
    page_with(results, "")
}

/// [`page`] with `extra` (HTML, such as a [`sweep_section`]) after the table.
pub fn page_with(results: &[(String, RunResult)], extra: &str) -> String {
    let mut html = String::from(
        "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>kvroute replay</title>\
         <style>body{font-family:sans-serif;margin:2em;max-width:1100px}svg{background:#fff}\
         h2{margin-top:2em}table{border-collapse:collapse}td,th{padding:2px 8px;text-align:right}</style>\
         </head><body><h1>kvroute replay</h1>",
    );
    let reports: Vec<(String, crate::Report)> = results
        .iter()
        .map(|(n, r)| (n.clone(), r.report.clone()))
        .collect();
    let _ = write!(html, "<pre>{}</pre>", escape(&crate::report::table(&reports)));
    html.push_str(extra);
    let cdf = |pick: fn(&RunResult) -> &Vec<f64>| -> Vec<Line<'_>> {
        results
            .iter()
            .map(|(name, r)| Line {
                name,
                points: cdf_points(pick(r)),
            })
            .collect()
    };
    html.push_str(&chart(
        "TTFT distribution",
        "TTFT ms (log)",
        "fraction",
        &cdf(|r| &r.ttft_ms),
        true,
    ));
    let itl: Vec<Line<'_>> = results
        .iter()
        .map(|(name, r)| Line {
            name,
            points: r.itl_cdf.clone(),
        })
        .collect();
    html.push_str(&chart(
        "ITL distribution (every gap between tokens)",
        "ITL ms (log)",
        "fraction",
        &itl,
        true,
    ));
    html.push_str(&chart(
        "E2E latency distribution",
        "E2E ms (log)",
        "fraction",
        &cdf(|r| &r.e2e_ms),
        true,
    ));
    for (name, result) in results {
        if let Some(p) = &result.planner {
            html.push_str(&planner_section(name, p));
        }
    }
    for (name, result) in results {
        let Some(s) = &result.series else { continue };
        let _ = write!(html, "<h2>{}</h2>", escape(name));
        let names: Vec<String> = (0..s.worker_requests.len()).map(|w| format!("w{w}")).collect();
        let per_worker = |values: &dyn Fn(usize, usize) -> f64| -> Vec<Line<'_>> {
            names
                .iter()
                .enumerate()
                .map(|(w, n)| Line {
                    name: n,
                    points: (0..s.time_s.len()).map(|i| (s.time_s[i], values(w, i))).collect(),
                })
                .collect()
        };
        html.push_str(&chart(
            "Requests per worker (running + waiting)",
            "time s",
            "requests",
            &per_worker(&|w, i| f64::from(s.worker_requests[w][i])),
            false,
        ));
        html.push_str(&chart(
            "KV use per worker",
            "time s",
            "share of blocks in use",
            &per_worker(&|w, i| f64::from(s.worker_kv_use[w][i])),
            false,
        ));
        let single = |label: &'static str, v: Vec<(f64, f64)>| {
            vec![Line {
                name: label,
                points: v,
            }]
        };
        let hit: Vec<(f64, f64)> = s.time_s.iter().copied().zip(s.hit_rate.iter().copied()).collect();
        html.push_str(&chart(
            "Engine prefix hit rate (admissions in each interval)",
            "time s",
            "hit rate",
            &single("hit rate", hit),
            false,
        ));
        let queued: Vec<(f64, f64)> = s
            .time_s
            .iter()
            .copied()
            .zip(s.queued.iter().map(|&q| f64::from(q)))
            .collect();
        html.push_str(&chart(
            "Waiting requests (router queue + engine queues)",
            "time s",
            "requests",
            &single("waiting", queued),
            false,
        ));
    }
    html.push_str("</body></html>\n");
    html
}

/// The planner's plots and decision log for one run.
fn planner_section(name: &str, p: &crate::PlannerRun) -> String {
    let mut html = format!("<h2>{}: planner</h2>", escape(name));
    let (met, counted) = p.attainment();
    let _ = write!(
        html,
        "<p>SLA: TTFT {} ms, ITL {} ms (means per {} s window of arrivals): {met} of {counted} windows met.</p>",
        p.ttft_sla_ms, p.itl_sla_ms, p.window_s
    );
    let pools: Vec<kvroute_planner::Pool> = p
        .ticks
        .first()
        .map(|t| t.pools.iter().map(|s| s.pool).collect())
        .unwrap_or_default();
    let mut names: Vec<String> = Vec::new();
    for pool in &pools {
        names.push(format!("{} ready", pool.name()));
        names.push(format!("{} provisioned", pool.name()));
    }
    let mut lines: Vec<Line<'_>> = Vec::new();
    for (i, pool) in pools.iter().enumerate() {
        let status = |t: &kvroute_planner::TickRecord| t.pools.iter().find(|s| s.pool == *pool).copied();
        let ready = p
            .ticks
            .iter()
            .filter_map(|t| status(t).map(|s| (t.at_s, f64::from(s.ready))))
            .collect();
        let provisioned = p
            .ticks
            .iter()
            .filter_map(|t| status(t).map(|s| (t.at_s, f64::from(s.ready + s.starting + s.draining))))
            .collect();
        lines.push(Line {
            name: &names[2 * i],
            points: ready,
        });
        lines.push(Line {
            name: &names[2 * i + 1],
            points: provisioned,
        });
    }
    html.push_str(&chart("Replicas over time", "time s", "workers", &lines, false));
    let observed: Vec<(f64, f64)> = p.ticks.iter().map(|t| (t.at_s, t.observed_rps)).collect();
    let predicted: Vec<(f64, f64)> = p
        .ticks
        .iter()
        .filter_map(|t| t.predicted_rps.map(|v| (t.at_s, v)))
        .collect();
    let window_observed: Vec<(f64, f64)> = p
        .ticks
        .iter()
        .filter_map(|t| t.throughput.as_ref().map(|r| (t.at_s, r.observed_rps)))
        .collect();
    html.push_str(&chart(
        "Load: observed per tick and per throughput window, and the forecast in force",
        "time s",
        "requests/s",
        &[
            Line {
                name: "observed (tick)",
                points: observed,
            },
            Line {
                name: "observed (window)",
                points: window_observed,
            },
            Line {
                name: "predicted",
                points: predicted,
            },
        ],
        false,
    ));
    let attain: Vec<(f64, f64)> = p.windows.iter().map(|w| (w.start_s, w.good_fraction)).collect();
    let met_line: Vec<(f64, f64)> = p
        .windows
        .iter()
        .map(|w| (w.start_s, if w.met { 1.0 } else { 0.0 }))
        .collect();
    html.push_str(&chart(
        "SLA attainment per window",
        "window start s",
        "share",
        &[
            Line {
                name: "requests meeting both",
                points: attain,
            },
            Line {
                name: "window met (1/0)",
                points: met_line,
            },
        ],
        false,
    ));
    html.push_str("<h3>Decisions</h3><table><tr><th>time s</th><th>actions</th><th>reason</th></tr>");
    for d in &p.decisions {
        let actions: Vec<String> = d
            .actions
            .iter()
            .map(|a| match a {
                kvroute_planner::Action::Add { pool } => format!("+1 {}", pool.name()),
                kvroute_planner::Action::Remove { pool, worker } => format!("-1 {} (w{worker})", pool.name()),
            })
            .collect();
        let _ = write!(
            html,
            "<tr><td>{:.1}</td><td>{}</td><td style=\"text-align:left\">{}</td></tr>",
            d.at_s,
            escape(&actions.join(", ")),
            escape(&d.text)
        );
    }
    html.push_str("</table>");
    html
}

fn cdf_points(values: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| *x > 0.0).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let step = n.div_ceil(MAX_POINTS).max(1);
    (0..n)
        .step_by(step)
        .chain((n > 0).then_some(n - 1))
        .map(|i| (v[i], (i + 1) as f64 / n as f64))
        .collect()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// An SVG line chart with axes, ticks and a legend.
fn chart(title: &str, x_label: &str, y_label: &str, lines: &[Line<'_>], log_x: bool) -> String {
    let (w, h, left, right, top, bottom) = (1000.0, 360.0, 70.0, 140.0, 30.0, 45.0);
    let fx = |x: f64| if log_x { x.max(1e-9).log10() } else { x };
    let all = lines.iter().flat_map(|l| l.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, 0.0_f64);
    for &(x, y) in all {
        x0 = x0.min(fx(x));
        x1 = x1.max(fx(x));
        y1 = y1.max(y);
    }
    let mut svg = format!("<h3>{}</h3>", escape(title));
    if !x0.is_finite() {
        svg.push_str("<p>(no data)</p>");
        return svg;
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= 0.0 {
        y1 = 1.0;
    }
    let px = |x: f64| left + (fx(x) - x0) / (x1 - x0) * (w - left - right);
    let py = |y: f64| top + (1.0 - y / y1) * (h - top - bottom);
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-size=\"11\">\
         <rect x=\"{left}\" y=\"{top}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#999\"/>",
        w - left - right,
        h - top - bottom
    );
    for k in 0..=4 {
        let fy = y1 * f64::from(k) / 4.0;
        let xv = x0 + (x1 - x0) * f64::from(k) / 4.0;
        let xt = if log_x { 10f64.powf(xv) } else { xv };
        let _ = write!(
            svg,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\
             <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            left - 4.0,
            py(fy) + 4.0,
            tick(fy),
            left + (w - left - right) * f64::from(k) / 4.0,
            h - bottom + 15.0,
            tick(xt)
        );
    }
    let _ = write!(
        svg,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\
         <text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">{}</text>",
        left + (w - left - right) / 2.0,
        h - 8.0,
        escape(x_label),
        top + (h - top - bottom) / 2.0,
        top + (h - top - bottom) / 2.0,
        escape(y_label)
    );
    for (i, line) in lines.iter().enumerate() {
        let color = color(i);
        let step = line.points.len().div_ceil(MAX_POINTS).max(1);
        let mut path = String::new();
        for (j, &(x, y)) in line.points.iter().step_by(step).enumerate() {
            let _ = write!(
                path,
                "{}{:.1},{:.1}",
                if j == 0 { "M" } else { "L" },
                px(x),
                py(y)
            );
        }
        let _ = write!(
            svg,
            "<path d=\"{path}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"1.3\"/>\
             <text x=\"{}\" y=\"{}\" fill=\"{color}\">{}</text>",
            // Legend columns of 24 names.
            w - right + 8.0 + 64.0 * (i / 24) as f64,
            top + 12.0 + 13.0 * (i % 24) as f64,
            escape(line.name)
        );
    }
    svg.push_str("</svg>");
    svg
}

/// One point of a sweep: its name, workers, GPUs and report.
pub struct SweepPoint<'a> {
    /// Workers in the fleet.
    pub workers: usize,
    /// GPUs in the fleet.
    pub gpus: u64,
    /// The run's report.
    pub report: &'a crate::Report,
}

/// A sweep's section: TTFT and ITL percentiles against the fleet size, the SLO's targets as
/// flat lines, and the smallest fleet meeting it.
pub fn sweep_section(points: &[SweepPoint<'_>], slo: Option<&crate::slo::Slo>) -> String {
    let mut html = String::from("<h2>Sweep</h2>");
    let series = |key: &str| -> Vec<(f64, f64)> {
        points
            .iter()
            .filter_map(|p| Some((p.workers as f64, p.report.number(key)?)))
            .collect()
    };
    for (title, keys) in [
        (
            "TTFT against fleet size",
            ["median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms"],
        ),
        (
            "ITL against fleet size",
            ["median_itl_ms", "p90_itl_ms", "p99_itl_ms"],
        ),
    ] {
        let mut lines: Vec<Line<'_>> = keys
            .iter()
            .map(|k| Line {
                name: k,
                points: series(k),
            })
            .collect();
        let prefix = if title.starts_with("TTFT") { "ttft" } else { "itl" };
        let targets: Vec<(String, f64)> = slo
            .map(|s| {
                s.targets
                    .iter()
                    .filter(|t| t.to_string().starts_with(prefix))
                    .map(|t| (format!("SLO {t}"), t.limit_ms))
                    .collect()
            })
            .unwrap_or_default();
        let (lo, hi) = points.iter().fold((f64::INFINITY, 0.0_f64), |(lo, hi), p| {
            (lo.min(p.workers as f64), hi.max(p.workers as f64))
        });
        for (name, limit) in &targets {
            lines.push(Line {
                name,
                points: vec![(lo, *limit), (hi, *limit)],
            });
        }
        html.push_str(&chart(title, "workers", "ms", &lines, false));
    }
    if let Some(slo) = slo {
        let first = points.iter().find(|p| slo.met(p.report));
        let _ = write!(
            html,
            "<p>{}</p>",
            escape(&match first {
                Some(p) => format!(
                    "smallest fleet meeting the SLO: {} workers ({} GPUs)",
                    p.workers, p.gpus
                ),
                None => "no fleet size tried meets the SLO".to_owned(),
            })
        );
    }
    html
}

fn tick(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rgb(hex: &str) -> [f64; 3] {
        let v = u32::from_str_radix(&hex[1..], 16).expect("hex");
        [v >> 16, (v >> 8) & 0xff, v & 0xff].map(f64::from)
    }

    #[test]
    fn thirty_two_workers_get_thirty_two_distinct_colours() {
        let colours: Vec<[f64; 3]> = (0..32).map(|i| rgb(color(i))).collect();
        for (i, a) in colours.iter().enumerate() {
            for (j, b) in colours.iter().enumerate().skip(i + 1) {
                let d = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt();
                assert!(d >= 60.0, "colours {i} and {j} are {d:.1} apart");
            }
        }
    }
}
