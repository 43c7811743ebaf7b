//! Data-driven tests of [`PrefixIndex`]: a script of index operations goes in, a text snapshot of
//! what the index answered comes out, compared with `tests/data/index/NAME.expected`.
//! `UPDATE_EXPECT=1 cargo test -p kvroute-core --test index_script` rewrites the snapshots; read
//! the diff before keeping it.
//!
//! # Script language
//!
//! One command per line; `#` starts a comment line; comments and blank lines are copied to the
//! snapshot. Blocks are named by short tokens. A token's local hash is derived from its name, so
//! the same token is the same content wherever it stands; a block's ext hash is the router chain
//! hash of its path from the root (`next_sequence_hash`), as the op-stream files have it. A block
//! is referred to by its path, tokens joined by `/`: `a/b` is block `b` under block `a` under the
//! root.
//!
//! | command | meaning |
//! | --- | --- |
//! | `worker 3`, `worker 0..70` | add worker 3, or workers 0 to 69 |
//! | `drop-worker 3` | remove worker 3 |
//! | `workers` | the workers, in the index's order (slot order) |
//! | `store 0 - a b c` | worker 0 stores the chain `a b c` from the root |
//! | `store 0 @a/b x y` | ... under its block `a/b` (the parent may also be `#N`, a raw ext) |
//! | `store 0 - a c=@a/b` | block `c`'s ext is replaced by the ext of path `a/b` |
//! | `store 0 - a=#7` | block `a`'s ext is replaced by the raw ext 7 |
//! | `remove 0 a/b #7` | worker 0 no longer holds `a/b`, nor the block with ext 7 |
//! | `clear 0` | worker 0 holds nothing |
//! | `match a b c`, `match! a b c` | lookup; `match!` uses early exit. Prints `worker:depth` for each non-zero depth |
//! | `held 0` | the blocks worker 0 holds, by path, sorted |
//! | `stats`, `footprint` | the counters; entries and nodes |
//!
//! Every command's line is copied to the snapshot followed by ` => ` and its result. After every
//! line the harness checks [`PrefixIndex::check_invariants`] and fails if it errs.

use std::collections::BTreeMap;
use std::path::Path;

use expect_test::expect_file;
use kvroute_core::hash::{BlockHasher, HashSalt, next_sequence_hash};
use kvroute_core::ids::{DpRank, ExternalBlockHash, LocalBlockHash, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::index::{IndexConfig, IndexError, PrefixIndex, StoredBlock};

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/index");

fn worker(id: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(id), DpRank(0))
}

/// The local hash of the block named `token`: its bytes hashed as token ids.
fn local_of(token: &str) -> LocalBlockHash {
    let ids: Vec<u32> = token.bytes().map(u32::from).collect();
    BlockHasher::new(ids.len(), &HashSalt::NONE).local_hash(&ids)
}

struct Harness {
    index: PrefixIndex,
    /// Display names of every ext hash seen: a chain ext by its path, a raw one as `#N`.
    names: BTreeMap<u64, String>,
}

impl Harness {
    fn new() -> Self {
        Self {
            index: PrefixIndex::new(IndexConfig::default()),
            names: BTreeMap::new(),
        }
    }

    /// The chain ext of `tokens` from the root (all must be non-empty), named by its path.
    fn chain(&mut self, tokens: &[&str]) -> u64 {
        let mut prev: Option<SequenceHash> = None;
        for (i, token) in tokens.iter().enumerate() {
            let seq = next_sequence_hash(prev, local_of(token));
            self.names.entry(seq.0).or_insert_with(|| tokens[..=i].join("/"));
            prev = Some(seq);
        }
        prev.map(|s| s.0).unwrap_or_else(|| panic!("empty path"))
    }

    /// An ext written as `a/b` (a path) or `#N` (raw).
    fn ext(&mut self, spec: &str) -> u64 {
        if let Some(raw) = spec.strip_prefix('#') {
            let n: u64 = raw.parse().unwrap_or_else(|_| panic!("bad raw ext {spec:?}"));
            self.names.entry(n).or_insert_with(|| spec.to_owned());
            n
        } else {
            let tokens: Vec<&str> = spec.split('/').collect();
            assert!(tokens.iter().all(|t| !t.is_empty()), "bad path {spec:?}");
            self.chain(&tokens)
        }
    }

    fn name(&self, ext: ExternalBlockHash) -> String {
        self.names
            .get(&ext.0)
            .cloned()
            .unwrap_or_else(|| format!("#{}", ext.0))
    }

    fn error(&self, e: &IndexError) -> String {
        match e {
            IndexError::UnknownWorker(w) => format!("error: unknown worker {}", w.worker.0),
            IndexError::UnknownParent { parent, .. } => {
                format!("error: unknown parent {}", self.name(*parent))
            }
            IndexError::ConflictingBlock {
                external, applied, ..
            } => {
                format!(
                    "error: conflicting block, {} is held at another place ({applied} applied)",
                    self.name(*external)
                )
            }
            IndexError::DuplicatePrefix {
                external, applied, ..
            } => {
                format!(
                    "error: duplicate prefix, held under another ext than {} ({applied} applied)",
                    self.name(*external)
                )
            }
            other => format!("error: {other}"),
        }
    }

    fn unit(&self, result: Result<(), IndexError>) -> String {
        match result {
            Ok(()) => "ok".to_owned(),
            Err(e) => self.error(&e),
        }
    }

    /// Runs one command and returns its result text.
    fn run(&mut self, line: &str) -> String {
        let mut words = line.split_whitespace();
        let command = words.next().unwrap_or_default();
        let args: Vec<&str> = words.collect();
        let worker_arg = |i: usize| -> u64 {
            let arg = args.get(i).unwrap_or_else(|| panic!("{command} needs a worker"));
            arg.parse().unwrap_or_else(|_| panic!("bad worker {arg:?}"))
        };
        match command {
            "worker" => {
                let spec = args.first().unwrap_or_else(|| panic!("worker needs an id"));
                let ids = match spec.split_once("..") {
                    Some((lo, hi)) => {
                        lo.parse::<u64>().expect("worker range start")
                            ..hi.parse::<u64>().expect("worker range end")
                    }
                    None => {
                        let id = worker_arg(0);
                        id..id + 1
                    }
                };
                for id in ids {
                    self.index.add_worker(worker(id));
                }
                format!("{} workers", self.index.workers().count())
            }
            "workers" => {
                let ids: Vec<String> = self.index.workers().map(|w| w.worker.0.to_string()).collect();
                if ids.is_empty() {
                    "-".to_owned()
                } else {
                    ids.join(" ")
                }
            }
            "drop-worker" => {
                let result = self.index.remove_worker(worker(worker_arg(0)));
                self.unit(result)
            }
            "clear" => {
                let result = self.index.clear_worker(worker(worker_arg(0)));
                self.unit(result)
            }
            "store" => self.store(worker_arg(0), &args[1..]),
            "remove" => {
                let exts: Vec<ExternalBlockHash> =
                    args[1..].iter().map(|s| ExternalBlockHash(self.ext(s))).collect();
                match self.index.apply_removed(worker(worker_arg(0)), &exts) {
                    Ok(n) => format!("{n} dropped"),
                    Err(e) => self.error(&e),
                }
            }
            "match" | "match!" => {
                let locals: Vec<LocalBlockHash> = args.iter().map(|t| local_of(t)).collect();
                let scores = self.index.find_matches(&locals, command == "match!");
                let mut depths: Vec<(u64, u32)> = scores
                    .iter()
                    .filter(|&(_, d)| d > 0)
                    .map(|(w, d)| (w.worker.0, d))
                    .collect();
                depths.sort_unstable();
                if depths.is_empty() {
                    "-".to_owned()
                } else {
                    depths
                        .iter()
                        .map(|(w, d)| format!("{w}:{d}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                }
            }
            "held" => {
                let w = worker(worker_arg(0));
                let mut held: Vec<String> = self.index.held_blocks(w).map(|e| self.name(e)).collect();
                held.sort();
                assert_eq!(
                    held.len(),
                    self.index.block_count(w),
                    "held_blocks and block_count disagree"
                );
                for e in self.index.held_blocks(w) {
                    assert!(
                        self.index.holds(w, e),
                        "held_blocks lists {} but holds() denies it",
                        self.name(e)
                    );
                }
                format!(
                    "{} ({})",
                    if held.is_empty() {
                        "-".to_owned()
                    } else {
                        held.join(" ")
                    },
                    held.len()
                )
            }
            "stats" => {
                let s = self.index.stats();
                format!(
                    "stored {}, removed {}, removed_not_held {}, clears {}, unknown_worker {}, \
                     unknown_parent {}, conflicting_block {}, duplicate_prefix {}",
                    s.blocks_stored,
                    s.blocks_removed,
                    s.removed_not_held,
                    s.clears,
                    s.unknown_worker,
                    s.unknown_parent,
                    s.conflicting_block,
                    s.duplicate_prefix
                )
            }
            "footprint" => {
                let f = self.index.footprint();
                format!("entries {}, nodes {}", f.entries, f.nodes)
            }
            other => panic!("unknown command {other:?}"),
        }
    }

    /// `store W PARENT BLOCK...`, where PARENT is `-`, `@path` or `#N`, and BLOCK is `token`,
    /// `token=@path` or `token=#N`.
    fn store(&mut self, w: u64, args: &[&str]) -> String {
        let (parent_spec, blocks_spec) = args
            .split_first()
            .unwrap_or_else(|| panic!("store needs a parent"));
        let (parent, mut path): (Option<u64>, Vec<&str>) = match *parent_spec {
            "-" => (None, Vec::new()),
            p if p.starts_with('#') => (Some(self.ext(p)), Vec::new()),
            p => {
                let p = p.strip_prefix('@').unwrap_or_else(|| panic!("bad parent {p:?}"));
                (Some(self.ext(p)), p.split('/').collect())
            }
        };
        let raw_parent = parent.is_some() && path.is_empty();
        let mut prev = parent.map(SequenceHash);
        let mut blocks = Vec::new();
        for spec in blocks_spec {
            let (token, ext_override) = match spec.split_once('=') {
                Some((token, ext)) => (token, Some(ext.strip_prefix('@').unwrap_or(ext))),
                None => (*spec, None),
            };
            let local = local_of(token);
            let seq = next_sequence_hash(prev, local);
            if !raw_parent {
                path.push(token);
                self.names.entry(seq.0).or_insert_with(|| path.join("/"));
            }
            prev = Some(seq);
            let external = match ext_override {
                Some(ext) => self.ext(ext),
                None => seq.0,
            };
            blocks.push(StoredBlock {
                local,
                external: ExternalBlockHash(external),
            });
        }
        let before = self.index.stats().blocks_stored;
        let result = self
            .index
            .apply_stored(worker(w), parent.map(ExternalBlockHash), &blocks);
        let new = self.index.stats().blocks_stored - before;
        format!("{}, {new} new", self.unit(result))
    }
}

/// Runs the script `NAME.txt` and returns the snapshot text.
fn run_script(name: &str) -> String {
    let path = Path::new(DATA).join(format!("{name}.txt"));
    let script = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut harness = Harness::new();
    let mut out = String::new();
    for (n, line) in script.lines().enumerate() {
        let line = line.trim_end();
        if line.trim_start().is_empty() || line.trim_start().starts_with('#') {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        let result = harness.run(line);
        out.push_str(&format!("{line} => {result}\n"));
        if let Err(e) = harness.index.check_invariants() {
            panic!("{name}.txt line {}: `{line}` broke an invariant: {e}", n + 1);
        }
    }
    out
}

macro_rules! scripts {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                let name = stringify!($name);
                let actual = run_script(name);
                expect_file![Path::new(DATA).join(format!("{name}.expected"))].assert_eq(&actual);
            }
        )*

        const SCRIPTS: &[&str] = &[$(stringify!($name)),*];
    };
}

scripts! {
    holes_and_heals,
    hole_at_position_0,
    duplicate_store,
    remove_unknown_blocks,
    branches,
    mid_chain_parent,
    clear,
    remove_worker,
    unknown_parent,
    unknown_worker,
    conflicting_block,
    duplicate_prefix,
    early_exit,
    readded_worker_starts_empty,
    shared_prefixes,
    slots_beyond_64,
}

#[test]
fn every_script_is_run() {
    let mut on_disk: Vec<String> = std::fs::read_dir(DATA)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|f| f.strip_suffix(".txt").map(str::to_owned))
        .collect();
    on_disk.sort();
    let mut listed: Vec<&str> = SCRIPTS.to_vec();
    listed.sort_unstable();
    assert_eq!(
        on_disk, listed,
        "every tests/data/index/*.txt must be listed in `scripts!`"
    );
}
