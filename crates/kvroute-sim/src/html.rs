//! A self-contained HTML page of plots: inline SVG, no script, nothing fetched, so a browser
//! opens it offline.
//!
//! Plots: TTFT and E2E distributions (CDFs, every policy overlaid), and per policy the requests
//! and KV use of each worker over time, the engines' prefix hit rate over time and the number of
//! waiting requests; with a planner, its replicas over time, observed vs predicted load, SLA
//! attainment per window and the decision log.

use std::fmt::Write;

use crate::RunResult;

const PALETTE: &[&str] = &[
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf",
];
const MAX_POINTS: usize = 800;

/// One line of a chart.
struct Line<'a> {
    name: &'a str,
    points: Vec<(f64, f64)>,
}

/// The page for `results` (name, result), one section per policy after the shared CDFs.
pub fn page(results: &[(String, RunResult)]) -> String {
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
        let color = PALETTE[i % PALETTE.len()];
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
            w - right + 8.0,
            top + 12.0 + 13.0 * i as f64,
            escape(line.name)
        );
    }
    svg.push_str("</svg>");
    svg
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
