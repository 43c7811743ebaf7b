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
