//! What the integration tests share: the msgspec fixtures of `tests/data/` and a compact text
//! form of decoded batches for snapshots.

#![allow(dead_code)] // Each test file uses a different part.

use std::fmt::Write;
use std::path::PathBuf;

use kvroute_wire::{EventBatch, WireEvent};

/// The folder of the fixtures and their snapshots.
pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

/// The names of every `.hex` fixture, sorted.
pub fn fixture_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(data_dir())
        .expect("tests/data is readable")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "hex"))
        .filter_map(|path| Some(path.file_stem()?.to_str()?.to_owned()))
        .collect();
    names.sort();
    assert!(
        names.len() >= 10,
        "fixtures missing from {:?}: {names:?}",
        data_dir()
    );
    names
}

/// The payload bytes of fixture `name` (`tests/data/NAME.hex`: `#` comment lines, then hex).
pub fn fixture(name: &str) -> Vec<u8> {
    let path = data_dir().join(format!("{name}.hex"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let hex: String = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .flat_map(|line| line.trim().chars())
        .collect();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap_or_else(|e| panic!("{path:?}: {e}")))
        .collect()
}

/// Fixture `name` decoded as batch 0 on the empty topic.
pub fn decoded(name: &str) -> EventBatch {
    EventBatch::decode_payload("", 0, &fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// A batch as text: one line for the batch, one per event.
pub fn render(batch: &EventBatch) -> String {
    let mut out = format!(
        "topic={:?} seq={} ts={} dp_rank={:?}\n",
        batch.topic, batch.seq, batch.ts, batch.dp_rank
    );
    for event in &batch.events {
        match event {
            WireEvent::BlockStored(e) => writeln!(
                out,
                "BlockStored hashes={:?} parent={:?} tokens={:?} block_size={} lora_id={:?} medium={:?} lora_name={:?} group_idx={:?}",
                e.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
                e.parent_block_hash.map(|h| h.0),
                e.token_ids,
                e.block_size,
                e.lora_id,
                e.medium,
                e.lora_name,
                e.group_idx,
            ),
            WireEvent::BlockRemoved(e) => writeln!(
                out,
                "BlockRemoved hashes={:?} medium={:?} group_idx={:?}",
                e.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
                e.medium,
                e.group_idx,
            ),
            WireEvent::AllBlocksCleared => writeln!(out, "AllBlocksCleared"),
            WireEvent::Unknown { tag } => writeln!(out, "Unknown tag={tag:?}"),
        }
        .expect("writing to a String");
    }
    out
}

/// A msgpack value to build test payloads from, written with `rmp` (not the crate's writer).
#[derive(Clone, Debug)]
pub enum V {
    Nil,
    Bool(bool),
    U(u64),
    I(i64),
    F(f64),
    S(String),
    /// A string whose bytes may not be UTF-8.
    RawStr(Vec<u8>),
    B(Vec<u8>),
    A(Vec<V>),
    M(Vec<(V, V)>),
    Ext(i8, Vec<u8>),
}

/// A string value.
pub fn s(text: &str) -> V {
    V::S(text.to_owned())
}

/// A map value from `(key, value)` pairs with string keys.
pub fn map(pairs: Vec<(&str, V)>) -> V {
    V::M(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

/// An array of unsigned integers.
pub fn uints(values: &[u64]) -> V {
    V::A(values.iter().map(|&v| V::U(v)).collect())
}

impl V {
    /// The msgpack bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        use rmp::encode::*;
        const MEMORY: &str = "writing to memory";
        let len = |n: usize| u32::try_from(n).expect("a test value of msgpack size");
        match self {
            V::Nil => write_nil(out).expect(MEMORY),
            V::Bool(b) => write_bool(out, *b).expect(MEMORY),
            V::U(v) => drop(write_uint(out, *v).expect(MEMORY)),
            V::I(v) => drop(write_sint(out, *v).expect(MEMORY)),
            V::F(v) => write_f64(out, *v).expect(MEMORY),
            V::S(text) => write_str(out, text).expect(MEMORY),
            V::RawStr(bytes) => {
                write_str_len(out, len(bytes.len())).expect(MEMORY);
                out.extend_from_slice(bytes);
            }
            V::B(bytes) => write_bin(out, bytes).expect(MEMORY),
            V::A(items) => {
                write_array_len(out, len(items.len())).expect(MEMORY);
                items.iter().for_each(|item| item.write(out));
            }
            V::M(pairs) => {
                write_map_len(out, len(pairs.len())).expect(MEMORY);
                for (k, v) in pairs {
                    k.write(out);
                    v.write(out);
                }
            }
            V::Ext(ty, data) => {
                write_ext_meta(out, len(data.len()), *ty).expect(MEMORY);
                out.extend_from_slice(data);
            }
        }
    }
}

/// Strategies for arbitrary batches, every field the encoder keeps across its whole range.
pub mod arb {
    use kvroute_core::ids::ExternalBlockHash;
    use kvroute_wire::{BlockRemoved, BlockStored, EventBatch, WireEvent};
    use proptest::collection::vec;
    use proptest::option::of;
    use proptest::prelude::*;

    /// Strings of every msgpack length class: fixstr, str8, str16 (rarely).
    pub fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => "[a-zA-Z0-9_@:.-]{0,40}",
            1 => "\\PC{0,300}",
        ]
    }

    fn hashes() -> impl Strategy<Value = Vec<ExternalBlockHash>> {
        vec(any::<u64>().prop_map(ExternalBlockHash), 0..20)
    }

    pub fn event() -> impl Strategy<Value = WireEvent> {
        let stored = (
            hashes(),
            of(any::<u64>().prop_map(ExternalBlockHash)),
            vec(any::<u32>(), 0..70),
            any::<u32>(),
            of(any::<i64>()),
            of(text()),
            of(text()),
            of(any::<u32>()),
            of(text().prop_filter("a salt is not empty", |s| !s.is_empty())),
        )
            .prop_map(|t| {
                // Sent in the first block's extra keys: a store of no blocks has none.
                let cache_salt = t.8.filter(|_| !t.0.is_empty());
                WireEvent::BlockStored(BlockStored {
                    block_hashes: t.0,
                    parent_block_hash: t.1,
                    token_ids: t.2,
                    block_size: t.3,
                    lora_id: t.4,
                    medium: t.5,
                    lora_name: t.6,
                    cache_salt,
                    group_idx: t.7,
                })
            });
        let removed =
            (hashes(), of(text()), of(any::<u32>())).prop_map(|(block_hashes, medium, group_idx)| {
                WireEvent::BlockRemoved(BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                })
            });
        prop_oneof![
            4 => stored,
            3 => removed,
            1 => Just(WireEvent::AllBlocksCleared),
            1 => "[A-Z][a-zA-Z]{0,20}"
                .prop_filter("a known tag", |tag| !["BlockStored", "BlockRemoved", "AllBlocksCleared"].contains(&tag.as_str()))
                .prop_map(|tag| WireEvent::Unknown { tag }),
        ]
    }

    /// Batches with finite timestamps (NaN never equals itself).
    pub fn batch() -> impl Strategy<Value = EventBatch> {
        (
            text(),
            any::<u64>(),
            prop_oneof![
                any::<f64>().prop_filter("finite", |t| t.is_finite()),
                Just(1767225600.123456)
            ],
            vec(event(), 0..6),
            of(any::<u32>()),
        )
            .prop_map(|(topic, seq, ts, events, dp_rank)| EventBatch {
                topic,
                seq,
                ts,
                events,
                dp_rank,
            })
    }
}
