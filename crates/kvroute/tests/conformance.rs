//! Conformance of the prefix index with kv-opstream files (`shared/bench/OPSTREAM.md`): every
//! lookup of a stream must return exactly the depths in its `expect`, and every operation must
//! apply without error. Both layouts run (`bench index --layout`).
//!
//! Two sources of streams:
//!
//! * `tests/data/mini.jsonl`, in this repository, always runs. It is a small hand-built stream
//!   (plain JSON lines): holes, heals, a hole at position 0, duplicate stores, removals of blocks
//!   not held, branches, a store under a mid-chain parent, a store behind a hole, clears, then
//!   seeded random operations over a five-letter alphabet. Its `expect` values come from a
//!   literal reference and agree with `shared/bench/check_opstream.py`
//!   (`python3 ../shared/bench/check_opstream.py crates/kvroute/tests/data/mini.jsonl` reports
//!   `"expect_mismatches": 0`). Its local hashes are `splitmix64(1 + letter index)` and its ext
//!   hashes are the router chain of the locals (producer guarantee 1), which a test below checks.
//! * Every `*.jsonl.gz` in `../shared/bench`, the folder beside the workspace, when it exists. A
//!   fresh clone without it skips them and says so on stderr.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kvroute::bench::index::{Layout, run};
use kvroute::opstream::{Op, OpStream};
use kvroute_core::hash::next_sequence_hash;
use kvroute_core::ids::{LocalBlockHash, SequenceHash};

fn mini_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/mini.jsonl")
}

fn shared_bench_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/bench")
}

/// Runs `stream` through the index benchmark once and returns a description of what went wrong,
/// if anything.
fn check(stream: &OpStream, name: &str) -> Option<String> {
    check_sized(stream, name, 0)
}

/// [`check`] with each worker's map sized ahead for `blocks_per_worker` blocks.
fn check_sized(stream: &OpStream, name: &str, blocks_per_worker: usize) -> Option<String> {
    assert!(!stream.ops.is_empty(), "{name}: no operations");
    let mut failures = Vec::new();
    for layout in [Layout::Nodes, Layout::Runs] {
        let report = run(stream, name, 1, blocks_per_worker, layout).expect("the benchmark runs");
        if report.mismatches == 0 && report.apply_errors == 0 {
            continue;
        }
        let mut text = format!(
            "{name} ({} ops, {layout:?}): {} mismatching lookups, {} apply errors",
            report.ops, report.mismatches, report.apply_errors
        );
        for m in report.mismatch_list.iter().take(5) {
            text.push_str(&format!(
                "\n  op {}: got {:?}, expect {:?}",
                m.op, m.got, m.expect
            ));
        }
        failures.push(text);
    }
    (!failures.is_empty()).then(|| failures.join("\n"))
}

#[test]
fn mini_fixture_conforms() {
    let stream = OpStream::read(&mini_path()).unwrap();
    assert_eq!(stream.header.workers, 4);
    let matches = stream
        .ops
        .iter()
        .filter(|op| matches!(op, Op::Match { .. }))
        .count();
    assert!(matches >= 50, "the fixture has only {matches} lookups");
    if let Some(failure) = check(&stream, "mini") {
        panic!("{failure}");
    }
    // Maps sized ahead, below and above what a worker holds, answer the same.
    for blocks_per_worker in [3, 1000] {
        if let Some(failure) = check_sized(&stream, "mini, sized maps", blocks_per_worker) {
            panic!("{failure}");
        }
    }
}

#[test]
fn mini_fixture_exercises_the_cases_it_claims() {
    let stream = OpStream::read(&mini_path()).unwrap();
    let count = |f: &dyn Fn(&Op) -> bool| stream.ops.iter().filter(|op| f(op)).count();
    assert!(count(&|op| matches!(op, Op::Clear { .. })) >= 3, "clears");
    assert!(count(&|op| matches!(op, Op::Remove { .. })) >= 10, "removes");
    assert!(
        count(&|op| matches!(op, Op::Store { parent: Some(_), .. })) >= 10,
        "stores under a parent"
    );
    // Lookups where several workers match, at different depths, and deep ones.
    let expects: Vec<&BTreeMap<u32, u32>> = stream
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::Match { expect, .. } => Some(expect),
            _ => None,
        })
        .collect();
    assert!(
        expects.iter().any(|e| e.len() >= 4),
        "a lookup matching every worker"
    );
    assert!(
        expects.iter().any(|e| e.values().any(|&d| d >= 8)),
        "a deep lookup"
    );
    assert!(
        expects.iter().filter(|e| e.is_empty()).count() >= 3,
        "lookups nobody matches"
    );
}

#[test]
fn mini_fixture_keeps_the_producer_guarantees() {
    // Guarantee 1: ext hashes are the router chain of the locals. Guarantee 2 (a store's parent
    // is held) is what `apply_errors == 0` checks in `mini_fixture_conforms`.
    assert_producer_guarantees(&OpStream::read(&mini_path()).unwrap());
}

/// Guarantee 1 of OPSTREAM.md: every ext hash is the router chain of its place's locals, and
/// one ext never names two prefixes.
fn assert_producer_guarantees(stream: &OpStream) {
    let mut path_of: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for (i, op) in stream.ops.iter().enumerate() {
        let Op::Store {
            parent, local, ext, ..
        } = op
        else {
            continue;
        };
        assert!(!local.is_empty(), "op {i}: empty store");
        let mut prev = parent.map(SequenceHash);
        let mut path = match parent {
            Some(p) => path_of
                .get(p)
                .cloned()
                .unwrap_or_else(|| panic!("op {i}: parent was never stored")),
            None => Vec::new(),
        };
        for (&l, &e) in local.iter().zip(ext) {
            let seq = next_sequence_hash(prev, LocalBlockHash(l));
            assert_eq!(seq.0, e, "op {i}: ext is not the chain hash of its place");
            path.push(l);
            if let Some(old) = path_of.insert(e, path.clone()) {
                assert_eq!(old, path, "op {i}: one ext for two prefixes");
            }
            prev = Some(seq);
        }
    }
}

#[test]
fn split_streams_conform_and_keep_the_guarantees() {
    // Splitting every block into a chain of `factor` blocks multiplies every expected depth by
    // `factor`: the split stream must conform exactly, keep the producer guarantees, and survive
    // a write and a read. The shared holes stream (middle removals, clears) too when present.
    let mut sources = vec![("mini".to_owned(), OpStream::read(&mini_path()).unwrap())];
    let holes = shared_bench_dir().join("conv_small_w4_c2048_holes.jsonl.gz");
    if holes.is_file() {
        sources.push(("holes".to_owned(), OpStream::read(&holes).unwrap()));
    }
    let dir = kvroute_testkit::Scratch::new("split");
    for (name, stream) in &sources {
        for factor in [1u32, 3, 8] {
            let split = stream.split(factor).unwrap();
            let label = format!("{name} split {factor}");
            assert_eq!(split.ops.len(), stream.ops.len(), "{label}");
            assert_eq!(
                split.header.block_size,
                (stream.header.block_size / factor).max(1)
            );
            for (a, b) in stream.ops.iter().zip(&split.ops) {
                if let (
                    Op::Match {
                        local: la,
                        expect: ea,
                    },
                    Op::Match {
                        local: lb,
                        expect: eb,
                    },
                ) = (a, b)
                {
                    assert_eq!(lb.len(), la.len() * factor as usize, "{label}");
                    let scaled: BTreeMap<u32, u32> = ea.iter().map(|(&w, &d)| (w, d * factor)).collect();
                    assert_eq!(eb, &scaled, "{label}");
                }
            }
            if let Some(failure) = check(&split, &label) {
                panic!("{failure}");
            }
            assert_producer_guarantees(&split);
            let path = dir.join(format!("{name}_{factor}.jsonl.gz"));
            split.write(&path).unwrap();
            let back = OpStream::read(&path).unwrap();
            assert_eq!(back.ops, split.ops, "{label}: write and read back");
            assert_eq!(back.header.workers, split.header.workers);
        }
    }
}

#[test]
fn a_wrong_expect_is_reported() {
    // Negative control: the check really compares. Raise one lookup's expected depth and drop
    // a worker from another; both must show up as mismatches.
    let mut stream = OpStream::read(&mini_path()).unwrap();
    let mut edited = Vec::new();
    for (i, op) in stream.ops.iter_mut().enumerate() {
        if let Op::Match { expect, .. } = op
            && let Some((&w, &d)) = expect.iter().next()
        {
            if edited.is_empty() {
                expect.insert(w, d + 1);
            } else {
                expect.remove(&w);
            }
            edited.push(i);
            if edited.len() == 2 {
                break;
            }
        }
    }
    assert_eq!(edited.len(), 2);
    for layout in [Layout::Nodes, Layout::Runs] {
        let report = run(&stream, "mini-edited", 1, 0, layout).unwrap();
        assert_eq!(report.mismatches, 2, "{layout:?}");
        assert_eq!(
            report.mismatch_list.iter().map(|m| m.op).collect::<Vec<_>>(),
            edited
        );
        assert_eq!(report.apply_errors, 0);
    }
}

#[test]
fn shared_opstreams_conform() {
    let dir = shared_bench_dir();
    if !dir.is_dir() {
        eprintln!("skipped: ../shared/bench not found (fresh clone); the in-repo fixtures still ran");
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(".jsonl.gz"))
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} holds no *.jsonl.gz", dir.display());
    let mut failures = Vec::new();
    for path in &files {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let t0 = Instant::now();
        let stream = match OpStream::read(path) {
            Ok(stream) => stream,
            Err(e) => {
                failures.push(format!("{name}: cannot read: {e:#}"));
                continue;
            }
        };
        let read = t0.elapsed();
        if let Some(failure) = check(&stream, &name) {
            failures.push(failure);
        }
        eprintln!(
            "{name}: {} ops, read {:.1} s, checked {:.1} s",
            stream.ops.len(),
            read.as_secs_f64(),
            (t0.elapsed() - read).as_secs_f64()
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
