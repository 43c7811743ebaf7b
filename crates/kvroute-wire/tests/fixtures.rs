//! The decoder and encoder against payloads written by msgspec, the library vLLM encodes its
//! events with (`tests/data/*.hex`, made by `tests/data/gen_fixtures.py`), and against hand-made
//! payloads that are malformed or merely unusual.
//!
//! Each fixture's decoded batch is snapshot in `tests/data/NAME.expected`;
//! `UPDATE_EXPECT=1 cargo test -p kvroute-wire --test fixtures` rewrites the snapshots (read the
//! diff before keeping it).

mod common;

use common::{V, decoded, fixture, fixture_names, map, render, s, uints};
use expect_test::{expect, expect_file};
use kvroute_wire::{EventBatch, EventEncoding};

#[test]
fn every_fixture_decodes_to_its_snapshot() {
    for name in fixture_names() {
        let path = common::data_dir().join(format!("{name}.expected"));
        expect_file![path].assert_eq(&render(&decoded(&name)));
    }
}

/// The fixtures whose every field the encoder keeps, with the encoding they were written in.
const BYTE_EXACT: &[(&str, EventEncoding)] = &[
    ("positional_2026", EventEncoding::Positional),
    ("map_2026", EventEncoding::Map),
    ("all_cleared", EventEncoding::Positional),
    ("removed_cpu", EventEncoding::Map),
    ("bin_hashes_as_int", EventEncoding::Map),
];

#[test]
fn the_encoder_writes_what_msgspec_writes() {
    for &(name, encoding) in BYTE_EXACT {
        let bytes = decoded(name).encode_payload(encoding).unwrap();
        assert_eq!(bytes, fixture(name), "{name} re-encoded as {encoding:?}");
    }
}

#[test]
fn every_fixture_survives_a_round_trip_through_the_encoder() {
    for name in fixture_names() {
        let batch = decoded(&name);
        for encoding in [EventEncoding::Map, EventEncoding::Positional] {
            let bytes = batch.encode_payload(encoding).unwrap();
            let again = EventBatch::decode_payload("", 0, &bytes).unwrap();
            assert_eq!(again, batch, "{name} through {encoding:?}");
        }
    }
}

#[test]
fn both_event_encodings_decode_alike() {
    assert_eq!(decoded("map_2026"), decoded("positional_2026"));
    assert_eq!(decoded("map_2026_extras"), decoded("positional_2026_extras"));
}

#[test]
fn a_bin_hash_is_the_int_vllm_sends_by_default() {
    // gen_fixtures.py writes the same batch twice: digests as bin, and as vLLM's own int form
    // of them (`int.from_bytes(digest, "big") & (2**64 - 1)`).
    assert_eq!(decoded("bin_hashes"), decoded("bin_hashes_as_int"));
}

#[test]
fn negative_hashes_keep_their_bits() {
    let batch = decoded("sglang_negative_hashes");
    let kvroute_wire::WireEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    assert_eq!(stored.block_hashes[0].0, (-5i64) as u64);
    assert_eq!(stored.block_hashes[1].0, 1 << 63);
}

/// Decodes each payload and prints its batch or its error, one case a line.
fn check(cases: impl IntoIterator<Item = (String, Vec<u8>)>) -> String {
    let mut out = String::new();
    for (name, bytes) in cases {
        let result = match EventBatch::decode_payload("", 0, &bytes) {
            Ok(batch) => render(&batch).lines().collect::<Vec<_>>().join(" | "),
            Err(e) => format!("error: {e}"),
        };
        out += &format!("{name}: {result}\n");
    }
    out
}

/// Hand-made cases as `check` takes them.
fn encoded<'a>(cases: impl IntoIterator<Item = (&'a str, V)>) -> impl Iterator<Item = (String, Vec<u8>)> {
    cases.into_iter().map(|(name, v)| (name.to_owned(), v.bytes()))
}

fn batch(events: Vec<V>) -> V {
    V::A(vec![V::F(1.5), V::A(events), V::U(0)])
}

/// The fields of a valid positional `BlockStored`: one block of two tokens, on the GPU.
fn stored_fields() -> Vec<V> {
    vec![
        uints(&[1]),
        V::Nil,
        uints(&[1, 2]),
        V::U(2),
        V::Nil,
        s("GPU"),
        V::Nil,
    ]
}

fn stored(fields: Vec<V>) -> V {
    V::A([vec![s("BlockStored")], fields].concat())
}

#[test]
fn malformed_payloads_are_errors_that_say_where() {
    let with = |i: usize, v: V| {
        let mut fields = stored_fields();
        fields[i] = v;
        batch(vec![stored(fields)])
    };
    let mut truncated = fixture("map_2026");
    truncated.truncate(60);
    let mut trailing = batch(vec![]).bytes();
    trailing.push(0xc0);
    let mut cases: Vec<(String, Vec<u8>)> = encoded([
        ("not a batch", s("x")),
        ("batch of one item", V::A(vec![V::F(1.0)])),
        ("ts a string", V::A(vec![s("now"), V::A(vec![])])),
        ("negative dp rank", V::A(vec![V::F(1.0), V::A(vec![]), V::I(-1)])),
        ("map batch without events", map(vec![("ts", V::F(1.0))])),
        ("event an int", batch(vec![V::U(3)])),
        ("empty event array", batch(vec![V::A(vec![])])),
        ("tag an int", batch(vec![V::A(vec![V::U(1)])])),
        (
            "tag not UTF-8",
            batch(vec![V::A(vec![V::RawStr(vec![0xff, 0xfe])])]),
        ),
        ("hash a string", with(0, V::A(vec![s("h")]))),
        ("hash a float", with(1, V::F(2.0))),
        ("token beyond u32", with(2, uints(&[1, 1 << 32]))),
        ("negative token", with(2, V::A(vec![V::U(1), V::I(-7)]))),
        ("negative block size", with(3, V::I(-4))),
        ("lora_id beyond i64", with(4, V::U(u64::MAX))),
        ("medium an int", with(5, V::U(1))),
        (
            "stored without block_size",
            batch(vec![stored(stored_fields()[..3].to_vec())]),
        ),
        (
            "map event without type",
            batch(vec![map(vec![("block_hashes", uints(&[1]))])]),
        ),
        (
            "map event without token_ids",
            batch(vec![map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", uints(&[1])),
                ("parent_block_hash", V::Nil),
                ("block_size", V::U(4)),
            ])]),
        ),
        (
            "removed without hashes",
            batch(vec![V::A(vec![s("BlockRemoved")])]),
        ),
    ])
    .collect();
    cases.push(("map_2026 cut at 60 bytes".into(), truncated));
    cases.push(("a byte after the batch".into(), trailing));
    cases.push(("reserved byte 0xc1".into(), vec![0x92, 0xc1, 0x90]));
    cases.push(("no bytes".into(), vec![]));
    expect![[r#"
        not a batch: error: batch: expected a batch (array or map), found str
        batch of one item: error: batch: missing field `events`
        ts a string: error: ts: expected a timestamp (float), found str
        negative dp rank: error: data_parallel_rank: expected an integer in 0..=4294967295, found -1
        map batch without events: error: batch: missing field `events`
        event an int: error: events[0]: expected an event (array or map), found int
        empty event array: error: events[0]: missing field `type`
        tag an int: error: events[0].type: expected a string, found int
        tag not UTF-8: error: events[0].type: a string that is not UTF-8
        hash a string: error: events[0].block_hashes[0]: expected a block hash (int or bin), found str
        hash a float: error: events[0].parent_block_hash: expected a block hash (int or bin), found float
        token beyond u32: error: events[0].token_ids[1]: expected an integer in 0..=4294967295, found 4294967296
        negative token: error: events[0].token_ids[1]: expected an integer in 0..=4294967295, found -7
        negative block size: error: events[0].block_size: expected an integer in 0..=4294967295, found -4
        lora_id beyond i64: error: events[0].lora_id: expected a 64-bit signed integer, found 18446744073709551615
        medium an int: error: events[0].medium: expected a string, found int
        stored without block_size: error: events[0]: missing field `block_size`
        map event without type: error: events[0]: missing field `type`
        map event without token_ids: error: events[0]: missing field `token_ids`
        removed without hashes: error: events[0]: missing field `block_hashes`
        map_2026 cut at 60 bytes: error: events[0].block_hashes[4]: the payload ends inside a value
        a byte after the batch: error: batch: 1 bytes after the end of the batch
        reserved byte 0xc1: error: ts: byte 0xc1, which msgpack reserves
        no bytes: error: batch: the payload ends inside a value
    "#]]
    .assert_eq(&check(cases));
}

#[test]
fn unusual_but_valid_payloads_decode() {
    let stored_map = |extra: Vec<(V, V)>| {
        let mut pairs = vec![
            (s("block_hashes"), uints(&[9])),
            (s("parent_block_hash"), V::Nil),
            (s("token_ids"), uints(&[1, 2])),
            (s("block_size"), V::U(2)),
        ];
        pairs.extend(extra);
        V::M(pairs)
    };
    let cases = [
        (
            "2025 positional, 6 items",
            batch(vec![stored(vec![
                uints(&[1]),
                V::U(7),
                uints(&[1, 2]),
                V::U(2),
                V::U(3),
            ])]),
        ),
        (
            "positional without lora_id",
            batch(vec![stored(vec![uints(&[1]), V::Nil, uints(&[1, 2]), V::U(2)])]),
        ),
        (
            "positional with 3 future fields",
            batch(vec![stored(
                [
                    stored_fields(),
                    vec![
                        V::A(vec![V::A(vec![s("l")])]),
                        V::U(5),
                        s("full_attention"),
                        V::Nil,
                        map(vec![("new", V::A(vec![V::Ext(3, vec![1, 2])]))]),
                        V::Bool(true),
                        V::F(0.5),
                    ],
                ]
                .concat(),
            )]),
        ),
        (
            "map with the tag last",
            batch(vec![stored_map(vec![(s("type"), s("BlockStored"))])]),
        ),
        (
            "map with odd keys",
            batch(vec![stored_map(vec![
                (V::U(1), V::A(vec![V::Nil])),
                (s("type"), s("BlockStored")),
                (s("medium"), s("CPU")),
                (s("locality"), s("REMOTE")),
            ])]),
        ),
        (
            "unknown map event",
            batch(vec![map(vec![
                ("type", s("Heartbeat")),
                ("token_ids", s("not ints")),
            ])]),
        ),
        (
            "unknown positional event",
            batch(vec![V::A(vec![s("Heartbeat"), V::B(vec![1]), V::Nil])]),
        ),
        (
            "SGLang BlockRemoved",
            batch(vec![V::A(vec![s("BlockRemoved"), V::A(vec![V::I(-1)])])]),
        ),
        (
            "short bin hash",
            batch(vec![V::A(vec![
                s("BlockRemoved"),
                V::A(vec![V::B(vec![1, 2]), V::B(vec![])]),
            ])]),
        ),
        (
            "integer ts, 2-item batch",
            V::A(vec![V::U(7), V::A(vec![V::A(vec![s("AllBlocksCleared")])])]),
        ),
        (
            "extra batch items",
            V::A(vec![V::F(0.25), V::A(vec![]), V::Nil, s("later"), V::U(1)]),
        ),
        (
            "map batch, unknown key",
            map(vec![("events", V::A(vec![])), ("v", V::U(2)), ("ts", V::I(-1))]),
        ),
    ];
    expect![[r#"
        2025 positional, 6 items: topic="" seq=0 ts=1.5 dp_rank=Some(0) | BlockStored hashes=[1] parent=Some(7) tokens=[1, 2] block_size=2 lora_id=Some(3) medium=None lora_name=None group_idx=None
        positional without lora_id: topic="" seq=0 ts=1.5 dp_rank=Some(0) | BlockStored hashes=[1] parent=None tokens=[1, 2] block_size=2 lora_id=None medium=None lora_name=None group_idx=None
        positional with 3 future fields: topic="" seq=0 ts=1.5 dp_rank=Some(0) | BlockStored hashes=[1] parent=None tokens=[1, 2] block_size=2 lora_id=None medium=Some("GPU") lora_name=None group_idx=Some(5)
        map with the tag last: topic="" seq=0 ts=1.5 dp_rank=Some(0) | BlockStored hashes=[9] parent=None tokens=[1, 2] block_size=2 lora_id=None medium=None lora_name=None group_idx=None
        map with odd keys: topic="" seq=0 ts=1.5 dp_rank=Some(0) | BlockStored hashes=[9] parent=None tokens=[1, 2] block_size=2 lora_id=None medium=Some("CPU") lora_name=None group_idx=None
        unknown map event: topic="" seq=0 ts=1.5 dp_rank=Some(0) | Unknown tag="Heartbeat"
        unknown positional event: topic="" seq=0 ts=1.5 dp_rank=Some(0) | Unknown tag="Heartbeat"
        SGLang BlockRemoved: topic="" seq=0 ts=1.5 dp_rank=Some(0) | BlockRemoved hashes=[18446744073709551615] medium=None group_idx=None
        short bin hash: topic="" seq=0 ts=1.5 dp_rank=Some(0) | BlockRemoved hashes=[258, 0] medium=None group_idx=None
        integer ts, 2-item batch: topic="" seq=0 ts=7 dp_rank=None | AllBlocksCleared
        extra batch items: topic="" seq=0 ts=0.25 dp_rank=None
        map batch, unknown key: topic="" seq=0 ts=-1 dp_rank=None
    "#]]
    .assert_eq(&check(encoded(cases)));
}
