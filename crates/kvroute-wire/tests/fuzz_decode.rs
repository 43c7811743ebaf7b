//! `fuzz_decode`: the decoder's fuzz target. No nightly toolchain (so no cargo-fuzz) is at hand,
//! so this is proptest with many cases of structured input: real msgspec payloads mutated
//! byte-wise, msgpack trees shaped like the schema with values of the wrong types, arbitrary
//! bytes, and arbitrary frames. Every input must decode or fail with an error, never panic; and
//! whatever decodes must re-encode to bytes that decode to the same batch (checked on the bytes,
//! so that a NaN timestamp compares equal to itself).
//!
//! A failing case is saved in `fuzz_decode.proptest-regressions` and replayed first from then on.

mod common;

use std::sync::OnceLock;

use common::{V, fixture, fixture_names, s};
use kvroute_wire::replay;
use kvroute_wire::{EventBatch, EventEncoding, RawBatch};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{Index, select};

fn fixtures() -> &'static [Vec<u8>] {
    static FIXTURES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    FIXTURES.get_or_init(|| fixture_names().iter().map(|name| fixture(name)).collect())
}

/// Decodes `bytes`; if they decode, checks that the batch re-encodes stably in both encodings.
fn decode_checked(bytes: &[u8]) -> Result<(), TestCaseError> {
    let Ok(batch) = EventBatch::decode_payload("t", 1, bytes) else {
        return Ok(());
    };
    for encoding in [EventEncoding::Map, EventEncoding::Positional] {
        let once = batch.encode_payload(encoding).expect("a decoded batch encodes");
        let again = EventBatch::decode_payload("t", 1, &once).expect("an encoded batch decodes");
        prop_assert_eq!(
            &again.encode_payload(encoding).expect("a decoded batch encodes"),
            &once
        );
        prop_assert_eq!(again.events.len(), batch.events.len());
    }
    Ok(())
}

/// Bytes that mean something to msgpack: markers of every family, and edges of lengths.
const INTERESTING: &[u8] = &[
    0x00, 0x01, 0x0f, 0x10, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xc4, 0xc5, 0xc6,
    0xc7, 0xca, 0xcb, 0xcc, 0xcf, 0xd0, 0xd3, 0xd4, 0xd8, 0xd9, 0xda, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xe0,
    0xff,
];

fn byte() -> impl Strategy<Value = u8> {
    prop_oneof![select(INTERESTING), any::<u8>()]
}

/// One edit of a payload. Positions are fractions of its length at the time of the edit.
#[derive(Clone, Debug)]
enum Mutation {
    FlipBit(Index, u8),
    Set(Index, u8),
    Insert(Index, u8),
    Delete(Index),
    Truncate(Index),
    /// Copies `len` bytes from one place to another, as if a value were repeated.
    Duplicate(Index, Index, usize),
    /// Overwrites from one place with bytes of another fixture.
    Splice(Index, Index, Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit(at, bit)),
        (any::<Index>(), byte()).prop_map(|(at, b)| Mutation::Set(at, b)),
        (any::<Index>(), byte()).prop_map(|(at, b)| Mutation::Insert(at, b)),
        any::<Index>().prop_map(Mutation::Delete),
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), any::<Index>(), 1usize..24)
            .prop_map(|(from, to, len)| Mutation::Duplicate(from, to, len)),
        (any::<Index>(), any::<Index>(), any::<Index>(), 1usize..32)
            .prop_map(|(which, from, to, len)| Mutation::Splice(which, from, to, len)),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let at = |i: &Index, len: usize| if len == 0 { 0 } else { i.index(len) };
    let n = bytes.len();
    match mutation {
        Mutation::FlipBit(i, bit) if n > 0 => bytes[at(i, n)] ^= 1 << bit,
        Mutation::Set(i, b) if n > 0 => bytes[at(i, n)] = *b,
        Mutation::Insert(i, b) => bytes.insert(at(i, n + 1), *b),
        Mutation::Delete(i) if n > 0 => drop(bytes.remove(at(i, n))),
        Mutation::Truncate(i) => bytes.truncate(at(i, n + 1)),
        Mutation::Duplicate(from, to, len) if n > 0 => {
            let from = at(from, n);
            let chunk = bytes[from..(from + len).min(n)].to_vec();
            let to = at(to, n + 1);
            bytes.splice(to..to, chunk);
        }
        Mutation::Splice(which, from, to, len) => {
            let other = &fixtures()[which.index(fixtures().len())];
            let from = at(from, other.len());
            let chunk = &other[from..(from + len).min(other.len())];
            let to = at(to, n + 1);
            let end = (to + chunk.len()).min(n);
            bytes.splice(to..end, chunk.iter().copied());
        }
        _ => {}
    }
}

/// A msgpack value shaped like the schema: known tags and keys, values of any type.
fn value() -> impl Strategy<Value = V> {
    const WORDS: &[&str] = &[
        "type",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "ts",
        "events",
        "data_parallel_rank",
        "GPU",
        "CPU",
    ];
    const TAGS: &[&str] = &["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"];
    let leaf = prop_oneof![
        Just(V::Nil),
        any::<bool>().prop_map(V::Bool),
        prop_oneof![0u64..300, any::<u64>()].prop_map(V::U),
        any::<i64>().prop_map(V::I),
        any::<f64>().prop_map(V::F),
        select(WORDS).prop_map(s),
        vec(any::<u8>(), 0..40).prop_map(V::B),
        vec(any::<u8>(), 0..4).prop_map(V::RawStr),
        (any::<i8>(), vec(any::<u8>(), 0..5)).prop_map(|(ty, data)| V::Ext(ty, data)),
    ];
    leaf.prop_recursive(4, 96, 12, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..12).prop_map(V::A),
            (select(TAGS), vec(inner.clone(), 0..14))
                .prop_map(|(tag, rest)| V::A([vec![s(tag)], rest].concat())),
            vec((select(WORDS).prop_map(s), inner.clone()), 0..12).prop_map(V::M),
            (select(TAGS), vec((select(WORDS).prop_map(s), inner), 0..10))
                .prop_map(|(tag, rest)| V::M([vec![(s("type"), s(tag))], rest].concat())),
        ]
    })
}

/// A batch whose parts are [`value`]s, positional or keyed.
fn batch_shaped() -> impl Strategy<Value = V> {
    prop_oneof![
        vec(value(), 0..5).prop_map(|events| V::A(vec![V::F(1.0), V::A(events), V::U(0)])),
        (value(), vec(value(), 0..5), value()).prop_map(|(ts, events, rank)| V::A(vec![
            ts,
            V::A(events),
            rank
        ])),
        vec(value(), 0..5).prop_map(|events| common::map(vec![("ts", V::F(1.0)), ("events", V::A(events))])),
        value(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(50_000))]

    #[test]
    fn fuzz_decode_mutated_fixtures(which in any::<Index>(), mutations in vec(mutation(), 1..8)) {
        let mut bytes = fixtures()[which.index(fixtures().len())].clone();
        for mutation in &mutations {
            apply(&mut bytes, mutation);
        }
        decode_checked(&bytes)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(10_000))]

    #[test]
    fn fuzz_decode_schema_shaped_values(value in batch_shaped()) {
        decode_checked(&value.bytes())?;
    }

    #[test]
    fn fuzz_decode_arbitrary_bytes(bytes in vec(byte(), 0..300)) {
        decode_checked(&bytes)?;
    }

    #[test]
    fn fuzz_decode_frames(frames in vec(prop_oneof![vec(byte(), 0..12), select(fixtures().to_vec())], 0..6)) {
        // Live messages, replay replies and replay requests: errors or values, never panics.
        if let Ok(raw) = RawBatch::from_live(&frames) {
            decode_checked(raw.payload)?;
        }
        let _ = EventBatch::decode_live(&frames);
        if let Ok(replay::ReplayReply::Batch(raw)) = replay::parse_reply(&frames) {
            decode_checked(raw.payload)?;
        }
        let _ = replay::parse_request(&frames);
    }
}
