//! `kvroute bench index`: an op-stream applied to the router's index, [`RunIndex`] (or, with
//! `--layout nodes`, [`PrefixIndex`]), in order on one thread.
//!
//! The output line carries the fields of `shared/bench/peerbench`'s `peer-index-bench`, so the
//! two can be read side by side, plus the index's memory per entry and the peak RSS.

use std::collections::BTreeMap;
use std::time::Instant;

use kvroute_core::ids::{DpRank, ExternalBlockHash, LocalBlockHash, WorkerId, WorkerKey};
use kvroute_core::index::{
    IndexConfig, IndexError, IndexLayout, OverlapScores, PrefixIndex, RunIndex, StoredBlock,
};
use serde::Serialize;

use super::{mean, percentile};
use crate::opstream::{Op, OpStream};

/// The name this implementation reports as `impl`.
pub const IMPL_NAME: &str = "kvroute-prefix-index";
/// [`IMPL_NAME`] of the run layout.
pub const RUNS_IMPL_NAME: &str = "kvroute-run-index";

/// Which index layout the benchmark drives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Layout {
    /// [`PrefixIndex`]: a node a block.
    Nodes,
    /// [`RunIndex`] (the router's index): a record a run of blocks with one holder set.
    #[default]
    Runs,
}

/// A layout built empty, sized for `blocks_per_worker` blocks a worker.
fn empty<I: IndexLayout>(blocks_per_worker: usize) -> I {
    I::with_config(IndexConfig {
        expected_blocks_per_worker: blocks_per_worker,
        ..IndexConfig::default()
    })
}

// The timed operations, out of line so that a profiler counts either layout's by the same four
// names (`kvroute::bench::index::timed_store` and so on).

#[inline(never)]
fn timed_store<I: IndexLayout>(
    index: &mut I,
    w: WorkerKey,
    parent: Option<ExternalBlockHash>,
    blocks: &[StoredBlock],
) -> Result<(), IndexError> {
    index.apply_stored(w, parent, blocks)
}

#[inline(never)]
fn timed_remove<I: IndexLayout>(
    index: &mut I,
    w: WorkerKey,
    exts: &[ExternalBlockHash],
) -> Result<usize, IndexError> {
    index.apply_removed(w, exts)
}

#[inline(never)]
fn timed_clear<I: IndexLayout>(index: &mut I, w: WorkerKey) -> Result<(), IndexError> {
    index.clear_worker(w)
}

#[inline(never)]
fn timed_find<I: IndexLayout>(index: &I, query: &[LocalBlockHash], out: &mut OverlapScores) {
    index.find_matches_into(query, false, out);
}

/// One lookup whose answer differed from the stream's `expect`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Position of the op in the stream (0-based, header excluded).
    pub op: usize,
    /// Depths the index returned (non-zero only).
    pub got: BTreeMap<u32, u32>,
    /// Depths the stream expects.
    pub expect: BTreeMap<u32, u32>,
}

/// The result of one benchmark run (the median of the repetitions).
///
/// Field names are `peer-index-bench`'s: `secs` is the sum of the per-operation times, percentiles
/// are in nanoseconds, `mismatches` counts lookups whose depths differ from `expect`.
#[allow(
    missing_docs,
    reason = "the fields are the peer harness's JSON names, described above"
)]
#[derive(Clone, Debug, Serialize)]
pub struct IndexBenchReport {
    #[serde(rename = "impl")]
    pub implementation: &'static str,
    pub stream: String,
    pub ops: usize,
    pub secs: f64,
    pub ops_per_s: f64,
    pub match_p50_ns: u64,
    pub match_p99_ns: u64,
    pub match_max_ns: u64,
    pub match_mean_ns: f64,
    pub event_mean_ns: f64,
    pub store_p50_ns: u64,
    pub store_p99_ns: u64,
    pub store_max_ns: u64,
    pub remove_p50_ns: u64,
    pub remove_p99_ns: u64,
    pub store_mean_ns: f64,
    pub remove_mean_ns: f64,
    pub mismatches: usize,
    pub apply_errors: usize,
    /// Heap bytes of the index per (worker, block) entry at the end of the stream.
    pub bytes_per_entry: f64,
    /// (worker, block) entries held at the end of the stream.
    pub entries: u64,
    /// Peak RSS of the whole process (stream loaded in memory included), if known.
    pub peak_rss_bytes: Option<u64>,
    pub reps: usize,
    /// The mismatching lookups of the reported run (not printed).
    #[serde(skip)]
    pub mismatch_list: Vec<Mismatch>,
}

/// An op converted to the index's own types before timing starts.
enum Prepared {
    Store(WorkerKey, Option<ExternalBlockHash>, Vec<StoredBlock>),
    Remove(WorkerKey, Vec<ExternalBlockHash>),
    Clear(WorkerKey),
    Match(Vec<LocalBlockHash>),
}

fn worker(w: u32) -> WorkerKey {
    WorkerKey::new(WorkerId(u64::from(w)), DpRank(0))
}

fn prepare(stream: &OpStream) -> Vec<Prepared> {
    stream
        .ops
        .iter()
        .map(|op| match op {
            Op::Store {
                w,
                parent,
                local,
                ext,
            } => Prepared::Store(
                worker(*w),
                parent.map(ExternalBlockHash),
                local
                    .iter()
                    .zip(ext)
                    .map(|(&l, &e)| StoredBlock {
                        local: LocalBlockHash(l),
                        external: ExternalBlockHash(e),
                    })
                    .collect(),
            ),
            Op::Remove { w, ext } => {
                Prepared::Remove(worker(*w), ext.iter().map(|&e| ExternalBlockHash(e)).collect())
            }
            Op::Clear { w } => Prepared::Clear(worker(*w)),
            Op::Match { local, .. } => Prepared::Match(local.iter().map(|&l| LocalBlockHash(l)).collect()),
        })
        .collect()
}

#[derive(Default)]
struct Run {
    total_ns: u64,
    matches: Vec<u64>,
    stores: Vec<u64>,
    removes: Vec<u64>,
    clears: Vec<u64>,
    apply_errors: usize,
    mismatches: Vec<Mismatch>,
    bytes_per_entry: f64,
    entries: u64,
}

fn run_once<I: IndexLayout>(stream: &OpStream, prepared: &[Prepared], blocks_per_worker: usize) -> Run {
    let mut index: I = empty(blocks_per_worker);
    for w in 0..stream.header.workers {
        index.add_worker(worker(w));
    }
    let mut run = Run::default();
    let mut scores = OverlapScores::default();
    for (i, op) in prepared.iter().enumerate() {
        let (ns, ok) = match op {
            Prepared::Store(w, parent, blocks) => {
                let t0 = Instant::now();
                let ok = timed_store(&mut index, *w, *parent, blocks).is_ok();
                let ns = t0.elapsed().as_nanos() as u64;
                run.stores.push(ns);
                (ns, ok)
            }
            Prepared::Remove(w, exts) => {
                let t0 = Instant::now();
                let ok = timed_remove(&mut index, *w, exts).is_ok();
                let ns = t0.elapsed().as_nanos() as u64;
                run.removes.push(ns);
                (ns, ok)
            }
            Prepared::Clear(w) => {
                let t0 = Instant::now();
                let ok = timed_clear(&mut index, *w).is_ok();
                let ns = t0.elapsed().as_nanos() as u64;
                run.clears.push(ns);
                (ns, ok)
            }
            Prepared::Match(query) => {
                let t0 = Instant::now();
                timed_find(&index, query, &mut scores);
                let ns = t0.elapsed().as_nanos() as u64;
                run.matches.push(ns);
                if let Op::Match { expect, .. } = &stream.ops[i] {
                    let got: BTreeMap<u32, u32> = scores
                        .iter()
                        .filter(|&(_, d)| d > 0)
                        .map(|(w, d)| (w.worker.0 as u32, d))
                        .collect();
                    if &got != expect {
                        run.mismatches.push(Mismatch {
                            op: i,
                            got,
                            expect: expect.clone(),
                        });
                    }
                }
                (ns, true)
            }
        };
        run.total_ns += ns;
        run.apply_errors += usize::from(!ok);
    }
    let footprint = index.footprint();
    run.bytes_per_entry = footprint.bytes_per_entry();
    run.entries = footprint.entries;
    run
}

/// Applies `stream` `reps` times (each on a fresh index) and reports the median run.
pub fn run(
    stream: &OpStream,
    stream_name: &str,
    reps: usize,
    blocks_per_worker: usize,
    layout: Layout,
) -> anyhow::Result<IndexBenchReport> {
    let prepared = prepare(stream);
    let once = match layout {
        Layout::Nodes => run_once::<PrefixIndex>,
        Layout::Runs => run_once::<RunIndex>,
    };
    let mut runs: Vec<Run> = (0..reps.max(1))
        .map(|_| once(stream, &prepared, blocks_per_worker))
        .collect();
    runs.sort_by_key(|r| r.total_ns);
    let mid = runs.len() / 2;
    let mut r = runs.swap_remove(mid);
    for lat in [&mut r.matches, &mut r.stores, &mut r.removes, &mut r.clears] {
        lat.sort_unstable();
    }
    let events: Vec<u64> = r
        .stores
        .iter()
        .chain(&r.removes)
        .chain(&r.clears)
        .copied()
        .collect();
    let ops = prepared.len();
    let secs = r.total_ns as f64 / 1e9;
    Ok(IndexBenchReport {
        implementation: match layout {
            Layout::Nodes => IMPL_NAME,
            Layout::Runs => RUNS_IMPL_NAME,
        },
        stream: stream_name.to_owned(),
        ops,
        secs,
        ops_per_s: if secs > 0.0 { ops as f64 / secs } else { 0.0 },
        match_p50_ns: percentile(&r.matches, 50.0),
        match_p99_ns: percentile(&r.matches, 99.0),
        match_max_ns: r.matches.last().copied().unwrap_or(0),
        match_mean_ns: mean(&r.matches),
        event_mean_ns: mean(&events),
        store_p50_ns: percentile(&r.stores, 50.0),
        store_p99_ns: percentile(&r.stores, 99.0),
        store_max_ns: r.stores.last().copied().unwrap_or(0),
        remove_p50_ns: percentile(&r.removes, 50.0),
        remove_p99_ns: percentile(&r.removes, 99.0),
        store_mean_ns: mean(&r.stores),
        remove_mean_ns: mean(&r.removes),
        mismatches: r.mismatches.len(),
        apply_errors: r.apply_errors,
        bytes_per_entry: r.bytes_per_entry,
        entries: r.entries,
        peak_rss_bytes: super::peak_rss_bytes(),
        reps: reps.max(1),
        mismatch_list: r.mismatches,
    })
}
