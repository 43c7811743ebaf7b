//! Reader of kv-opstream v1 files (`shared/bench/OPSTREAM.md`): gzip'd JSON lines of index
//! operations, each lookup with the answer it must get.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::{Context, bail};
use flate2::read::MultiGzDecoder;
use serde::Deserialize;

/// The header line.
#[derive(Clone, Debug, Deserialize)]
pub struct Header {
    /// Must be `kv-opstream`.
    pub format: String,
    /// Must be 1.
    pub version: u32,
    /// Worker ids are `0..workers`.
    pub workers: u32,
    /// Tokens per block (informational).
    pub block_size: u32,
    /// The file the stream was made from.
    #[serde(default)]
    pub source: String,
}

/// One operation, in file order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Worker `w` now holds these blocks, continuing the chain from `parent`.
    Store {
        /// The worker.
        w: u32,
        /// The parent block's ext hash, or none for the root.
        parent: Option<u64>,
        /// Content hashes.
        local: Vec<u64>,
        /// Ext hashes, one per local hash.
        ext: Vec<u64>,
    },
    /// Worker `w` no longer holds these blocks.
    Remove {
        /// The worker.
        w: u32,
        /// Ext hashes.
        ext: Vec<u64>,
    },
    /// Worker `w` holds nothing.
    Clear {
        /// The worker.
        w: u32,
    },
    /// A lookup and its expected per-worker depths (depth 0 omitted).
    Match {
        /// The query's content hashes.
        local: Vec<u64>,
        /// Worker id (decimal string in the file) to depth.
        expect: BTreeMap<u32, u32>,
    },
}

/// A whole stream in memory.
#[derive(Clone, Debug)]
pub struct OpStream {
    /// The header.
    pub header: Header,
    /// The operations.
    pub ops: Vec<Op>,
}

impl OpStream {
    /// Reads a gzip'd (or, if not gzip'd, plain) op-stream file.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut reader = BufReader::new(file);
        let gz = reader.fill_buf()?.starts_with(&[0x1f, 0x8b]);
        let reader: Box<dyn Read> = if gz {
            Box::new(MultiGzDecoder::new(reader))
        } else {
            Box::new(reader)
        };
        Self::parse(BufReader::new(reader)).with_context(|| format!("reading {}", path.display()))
    }

    /// Parses an op-stream from uncompressed JSON lines.
    pub fn parse(reader: impl BufRead) -> anyhow::Result<Self> {
        let mut lines = reader.lines().enumerate();
        let header: Header = match lines.next() {
            Some((_, line)) => serde_json::from_str(&line?).context("line 1: header")?,
            None => bail!("empty op-stream: no header line"),
        };
        if header.format != "kv-opstream" || header.version != 1 {
            bail!(
                "line 1: expected format kv-opstream version 1, got {} {}",
                header.format,
                header.version
            );
        }
        let mut ops = Vec::new();
        for (n, line) in lines {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            let raw: RawOp = serde_json::from_str(&line).with_context(|| format!("line {}", n + 1))?;
            ops.push(raw.into_op().with_context(|| format!("line {}", n + 1))?);
        }
        Ok(Self { header, ops })
    }
}

/// An op line as written: which fields are present depends on `op`.
#[derive(Deserialize)]
struct RawOp {
    op: String,
    w: Option<u32>,
    #[serde(default)]
    parent: Option<u64>,
    local: Option<Vec<u64>>,
    ext: Option<Vec<u64>>,
    expect: Option<BTreeMap<String, u32>>,
}

impl RawOp {
    fn into_op(self) -> anyhow::Result<Op> {
        let w = || self.w.with_context(|| format!("{} needs a worker `w`", self.op));
        Ok(match self.op.as_str() {
            "store" => {
                let local = self.local.clone().context("store needs `local`")?;
                let ext = self.ext.clone().context("store needs `ext`")?;
                if local.len() != ext.len() {
                    bail!("store has {} local and {} ext hashes", local.len(), ext.len());
                }
                Op::Store {
                    w: w()?,
                    parent: self.parent,
                    local,
                    ext,
                }
            }
            "remove" => Op::Remove {
                w: w()?,
                ext: self.ext.clone().context("remove needs `ext`")?,
            },
            "clear" => Op::Clear { w: w()? },
            "match" => {
                let mut expect = BTreeMap::new();
                for (worker, depth) in self.expect.unwrap_or_default() {
                    let worker: u32 = worker
                        .parse()
                        .with_context(|| format!("expect key {worker:?} is not a worker id"))?;
                    if depth > 0 {
                        expect.insert(worker, depth);
                    }
                }
                Op::Match {
                    local: self.local.context("match needs `local`")?,
                    expect,
                }
            }
            other => bail!("unknown op {other:?}"),
        })
    }
}

impl OpStream {
    /// The same stream at `factor` times finer blocks: every block becomes a chain of `factor`
    /// blocks, as if an engine with `block_size / factor`-token blocks had cached the same
    /// prompts. A stored or removed block stores or removes its whole sub-chain, so every
    /// expected depth is `factor` times the original, exactly.
    ///
    /// Sub-block `j` of a block with local hash `l` has local hash `splitmix64(l + j·φ)` (φ the
    /// 64-bit golden ratio), and ext hashes are the router chain of OPSTREAM.md recomputed over
    /// the new local hashes, so the result keeps the producer guarantees: ext hashes are
    /// prefix-unique and a store's parent is held.
    ///
    /// Fails if a store names a parent that no earlier store placed (a stream that breaks the
    /// producer guarantee).
    pub fn split(&self, factor: u32) -> anyhow::Result<OpStream> {
        use std::collections::HashMap;

        use kvroute_core::hash::next_sequence_hash;
        use kvroute_core::ids::{LocalBlockHash, SequenceHash};

        if factor == 0 {
            bail!("a split factor must be at least 1");
        }
        let k = factor as usize;
        let sub_locals = |local: u64| {
            (0..u64::from(factor)).map(move |j| splitmix64(local.wrapping_add(j.wrapping_mul(GOLDEN))))
        };
        // Old ext → the new ext hashes of its sub-blocks (ext hashes are prefix-unique, so one
        // map serves every worker).
        let mut subs: HashMap<u64, Vec<u64>> = HashMap::new();
        let mut ops = Vec::with_capacity(self.ops.len());
        for (n, op) in self.ops.iter().enumerate() {
            ops.push(match op {
                Op::Store {
                    w,
                    parent,
                    local,
                    ext,
                } => {
                    let (new_parent, mut prev) = match parent {
                        None => (None, None),
                        Some(p) => {
                            let last = subs.get(p).and_then(|s| s.last().copied()).with_context(|| {
                                format!("op {n}: store under parent {p}, which no earlier store placed")
                            })?;
                            (Some(last), Some(SequenceHash(last)))
                        }
                    };
                    let (mut new_local, mut new_ext) = (
                        Vec::with_capacity(local.len() * k),
                        Vec::with_capacity(local.len() * k),
                    );
                    for (&l, &e) in local.iter().zip(ext) {
                        let start = new_ext.len();
                        for sub in sub_locals(l) {
                            let seq = next_sequence_hash(prev, LocalBlockHash(sub));
                            new_local.push(sub);
                            new_ext.push(seq.0);
                            prev = Some(seq);
                        }
                        subs.entry(e).or_insert_with(|| new_ext[start..].to_vec());
                    }
                    Op::Store {
                        w: *w,
                        parent: new_parent,
                        local: new_local,
                        ext: new_ext,
                    }
                }
                Op::Remove { w, ext } => Op::Remove {
                    w: *w,
                    // A block never stored has no sub-blocks that could be held; removing it is
                    // a no-op before and after the split, so it is dropped.
                    ext: ext
                        .iter()
                        .filter_map(|e| subs.get(e))
                        .flatten()
                        .copied()
                        .collect(),
                },
                Op::Clear { w } => Op::Clear { w: *w },
                Op::Match { local, expect } => Op::Match {
                    local: local.iter().flat_map(|&l| sub_locals(l)).collect(),
                    expect: expect.iter().map(|(&w, &d)| (w, d * factor)).collect(),
                },
            });
        }
        let mut header = self.header.clone();
        header.block_size = (header.block_size / factor).max(1);
        Ok(OpStream { header, ops })
    }

    /// Writes the stream as gzip'd kv-opstream v1 JSON lines.
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        use std::io::Write;

        use flate2::Compression;
        use flate2::write::GzEncoder;
        use serde_json::json;

        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut out = std::io::BufWriter::new(GzEncoder::new(file, Compression::default()));
        let h = &self.header;
        let header = json!({
            "format": h.format, "version": h.version, "workers": h.workers,
            "block_size": h.block_size, "source": h.source,
        });
        writeln!(out, "{header}")?;
        for op in &self.ops {
            let line = match op {
                Op::Store {
                    w,
                    parent,
                    local,
                    ext,
                } => json!({"op": "store", "w": w, "parent": parent, "local": local, "ext": ext}),
                Op::Remove { w, ext } => json!({"op": "remove", "w": w, "ext": ext}),
                Op::Clear { w } => json!({"op": "clear", "w": w}),
                Op::Match { local, expect } => {
                    let expect: BTreeMap<String, u32> =
                        expect.iter().map(|(w, d)| (w.to_string(), *d)).collect();
                    json!({"op": "match", "local": local, "expect": expect})
                }
            };
            writeln!(out, "{line}")?;
        }
        out.into_inner()
            .map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.error()))?
            .finish()
            .with_context(|| format!("finishing {}", path.display()))?;
        Ok(())
    }
}

/// The 64-bit golden ratio, splitmix64's increment.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finalizer (OPSTREAM.md's `local = splitmix64(hash_id)`).
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
