//! `kvroute replay`'s outputs: the report, per-request and HTML files, and the progress bar.

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute_sim::{Progress, Report, RunResult};

use super::ReplayArgs;

/// Writes the files `args` names: the report (with `provenance`), one JSON line per request,
/// the HTML page (with `extra_html` after its table).
pub(super) fn write_outputs(
    args: &ReplayArgs,
    results: &[(String, RunResult)],
    provenance: &crate::provenance::Provenance,
    extra_html: &str,
) -> anyhow::Result<()> {
    if let Some(path) = &args.report_json {
        let reports: Vec<(&str, &Report)> = results.iter().map(|(n, r)| (n.as_str(), &r.report)).collect();
        let text = serde_json::to_string_pretty(&crate::provenance::ReportFile {
            reports: &reports,
            provenance,
        })?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.per_request_jsonl {
        let mut out = std::io::BufWriter::new(
            File::create(path).with_context(|| format!("creating {}", path.display()))?,
        );
        for (name, result) in results {
            for record in &result.requests {
                let mut value = serde_json::to_value(record)?;
                if results.len() > 1
                    && let Some(obj) = value.as_object_mut()
                {
                    obj.insert("policy".to_owned(), serde_json::Value::String(name.clone()));
                }
                writeln!(out, "{value}")?;
            }
        }
        out.flush()?;
    }
    if let Some(path) = &args.html {
        let page = kvroute_sim::html::page_with(results, extra_html);
        std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A one-line progress bar on stderr, drawn only on a terminal and only after a second.
pub(super) struct ProgressBar<'a> {
    name: &'a str,
    started: Instant,
    drawn: bool,
    tty: bool,
}

impl<'a> ProgressBar<'a> {
    pub(super) fn new(name: &'a str, started: Instant) -> Self {
        Self {
            name,
            started,
            drawn: false,
            tty: std::io::stderr().is_terminal(),
        }
    }

    pub(super) fn update(&mut self, p: Progress) {
        if !self.tty || self.started.elapsed() < Duration::from_secs(1) || p.total == 0 {
            return;
        }
        let frac = p.done as f64 / p.total as f64;
        let filled = (frac * 30.0) as usize;
        eprint!(
            "\r{} [{}{}] {:>3.0}%  {}/{} requests, {:.0} s simulated",
            self.name,
            "#".repeat(filled),
            " ".repeat(30 - filled.min(30)),
            frac * 100.0,
            p.done,
            p.total,
            p.now.as_secs_f64()
        );
        self.drawn = true;
    }

    pub(super) fn finish(&self) {
        if self.drawn {
            eprintln!();
        }
    }
}
