//! `kvroute bench ...`: benchmarks that print one JSON line per case.
//!
//! Timing rules shared by every benchmark here: inputs are built before the clock starts, each
//! measured operation is timed on its own with [`std::time::Instant`], percentiles are
//! nearest-rank, and with several repetitions the run with the median total time is reported.

pub mod chat;
pub mod hash;
pub mod index;
pub mod route;
pub mod serve;
pub mod sync;
pub mod sync_live;

/// The nearest-rank `p`-th percentile of `sorted` (ascending); 0 when empty.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The mean of `values`; 0 when empty.
pub fn mean(values: &[u64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<u64>() as f64 / values.len() as f64
    }
}

/// The process's peak resident set size in bytes (`VmHWM`), where the OS tells it (Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
