//! The sync decoder never panics on hostile bytes, whatever it accepts re-encodes to bytes
//! that decode to the same message, it accepts no worker configuration that carries a
//! credential, and the JSON format before it is refused by its version. The JSON codec kept for
//! measurement is held to the same.

use kvroute_sync::wire::{
    Body, DecodeError, Envelope, Format, SyncItem, WorkerChange, WorkerRef, decode, encode, json, pack,
};
use proptest::prelude::*;

fn worker() -> impl Strategy<Value = WorkerRef> {
    ("[a-z:/0-9.]{0,24}", 0u32..4).prop_map(|(url, rank)| WorkerRef { url, rank })
}

fn event() -> impl Strategy<Value = SyncItem> {
    prop_oneof![
        (
            any::<u64>(),
            worker(),
            proptest::option::of(worker()),
            any::<u32>(),
            any::<u64>(),
            proptest::collection::vec(any::<u64>(), 0..20),
            any::<u64>(),
            proptest::option::of(any::<u64>()),
            proptest::option::of(any::<u32>()),
            proptest::option::of(any::<u64>()),
            any::<u32>(),
        )
            .prop_map(|(r, w, pw, o, pt, c, ht, hd, eo, s, tn)| SyncItem::Added {
                r,
                w,
                pw,
                o,
                pt,
                c,
                ht,
                hd,
                eo,
                s,
                tn
            }),
        (any::<u64>(), worker()).prop_map(|(s, w)| SyncItem::Session { s, w }),
        any::<u64>().prop_map(|r| SyncItem::PrefillDone { r }),
        any::<u64>().prop_map(|r| SyncItem::Freed { r }),
        "[a-z:/0-9.]{0,24}".prop_map(|url| SyncItem::Worker(WorkerChange::Draining { url })),
        "[a-z:/0-9.]{0,24}".prop_map(|url| SyncItem::Worker(WorkerChange::Removed { url })),
        ("[a-z:/0-9.]{0,24}", any::<bool>()).prop_map(|(url, credential)| SyncItem::Worker(
            WorkerChange::Added {
                config: serde_json::json!({ "url": url, "dp": 2 }),
                credential,
            }
        )),
    ]
}

fn envelope() -> impl Strategy<Value = Envelope> {
    let body = prop_oneof![
        proptest::collection::vec(event(), 0..8).prop_map(|events| Body::Events {
            seq: 1,
            at_us: Some(7),
            events
        }),
        Just(Body::Heartbeat { seq: 2 }),
        Just(Body::SnapshotRequest),
        (
            proptest::collection::vec(any::<u64>(), 0..4),
            any::<u32>(),
            any::<bool>(),
            proptest::collection::vec(event(), 0..8)
        )
            .prop_map(|(peers, part, last, events)| Body::Snapshot {
                peers,
                part,
                last,
                seq: 5,
                events
            }),
    ];
    (any::<u64>(), body).prop_map(|(from, body)| Envelope { from, body })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn messages_round_trip(e in envelope()) {
        prop_assert_eq!(decode(&encode(&e)).unwrap(), e.clone());
        prop_assert_eq!(json::decode(&json::encode(&e)).unwrap(), e);
    }

    #[test]
    fn a_json_message_is_refused_by_its_version(e in envelope()) {
        let err = decode(&json::encode(&e)).unwrap_err();
        prop_assert!(
            matches!(err, DecodeError::Version { format: Format::Json, version: 3, from: Some(f) } if f == e.from),
            "{}", err
        );
    }

    #[test]
    fn a_block_takes_8_bytes(e in envelope(), extra in proptest::collection::vec(any::<u64>(), 1..64)) {
        // One more block in a booking costs 8 bytes, whatever the rest of the message.
        let mut longer = e.clone();
        let events = match &mut longer.body {
            Body::Events { events, .. } | Body::Snapshot { events, .. } => events,
            Body::Heartbeat { .. } | Body::SnapshotRequest => return Ok(()),
        };
        let Some(SyncItem::Added { c, .. }) = events.iter_mut().find(|e| matches!(e, SyncItem::Added { .. })) else {
            return Ok(());
        };
        let before = c.len();
        c.extend(&extra);
        let after = c.len();
        let grown = encode(&longer).len() - encode(&e).len();
        // The block count's varint grows by a byte at 128 and 16,384 blocks.
        let count_bytes = |n: usize| if n < 128 { 1 } else if n < 16_384 { 2 } else { 3 };
        prop_assert_eq!(grown, 8 * extra.len() + count_bytes(after) - count_bytes(before));
    }

    #[test]
    fn arbitrary_json_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(e) = json::decode(&bytes) {
            prop_assert_eq!(json::decode(&json::encode(&e)).unwrap(), e);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(e) = decode(&bytes) {
            prop_assert_eq!(decode(&encode(&e)).unwrap(), e);
        }
    }

    #[test]
    fn arbitrary_bytes_after_the_version_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        // Most random bytes stop at the first byte; these start as a message of this version.
        let mut message = vec![4];
        message.extend(bytes);
        if let Ok(e) = decode(&message) {
            prop_assert_eq!(decode(&encode(&e)).unwrap(), e);
        }
    }

    #[test]
    fn mutated_messages_never_panic(
        e in envelope(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = encode(&e);
        for (at, b) in edits {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        if let Ok(e) = decode(&bytes) {
            prop_assert_eq!(decode(&encode(&e)).unwrap(), e);
        }
    }

    #[test]
    fn mutated_json_messages_never_panic(
        e in envelope(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = json::encode(&e);
        for (at, b) in edits {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let _ = decode(&bytes);
        if let Ok(e) = json::decode(&bytes) {
            prop_assert_eq!(json::decode(&json::encode(&e)).unwrap(), e);
        }
    }

    #[test]
    fn a_worker_configuration_with_a_credential_is_refused(
        e in envelope(),
        key in "[ -~]{1,32}",
        at in any::<prop::sample::Index>(),
    ) {
        // Put a credential into one worker configuration of an otherwise valid message.
        let mut e = e;
        let events = match &mut e.body {
            Body::Events { events, .. } | Body::Snapshot { events, .. } => events,
            Body::Heartbeat { .. } | Body::SnapshotRequest => return Ok(()),
        };
        events.push(SyncItem::Worker(WorkerChange::Added {
            config: serde_json::json!({ "url": "http://h:1" }),
            credential: true,
        }));
        let i = at.index(events.len());
        let n = events.len() - 1;
        events.swap(i, n);
        for event in events.iter_mut() {
            if let SyncItem::Worker(WorkerChange::Added { config, .. }) = event {
                config["api-key"] = serde_json::Value::String(key.clone());
                break;
            }
        }
        // The error names the key, never the value.
        for err in [decode(&encode(&e)), json::decode(&json::encode(&e))] {
            prop_assert_eq!(
                err.unwrap_err().to_string(),
                "a worker's configuration carries \"api-key\": sync messages never carry credentials"
            );
        }
    }

    #[test]
    fn packing_keeps_order_and_limits(
        events in proptest::collection::vec(event(), 0..64),
        max_events in 1usize..10,
        max_bytes in 1usize..2000,
    ) {
        let runs = pack(events.clone(), max_events, max_bytes);
        prop_assert!(runs.iter().all(|r| !r.is_empty() && r.len() <= max_events));
        prop_assert_eq!(runs.into_iter().flatten().collect::<Vec<_>>(), events);
    }
}

#[test]
fn deeply_nested_json_is_refused_not_a_stack_overflow() {
    let mut bytes =
        br#"{"v":3,"from":1,"body":{"kind":"events","events":[{"t":"worker","op":"added","config":"#.to_vec();
    bytes.extend(std::iter::repeat_n(b'[', 100_000));
    assert!(decode(&bytes).is_err());
    assert!(json::decode(&bytes).is_err());
    // A worker's configuration in a binary message is JSON too.
    let config = vec![b'['; 100_000];
    let mut bytes = vec![4, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 4, 1];
    let mut n = config.len();
    while n >= 0x80 {
        bytes.push((n as u8) | 0x80);
        n >>= 7;
    }
    bytes.push(n as u8);
    bytes.extend(config);
    let err = decode(&bytes).unwrap_err().to_string();
    assert!(err.contains("a worker's configuration"), "{err}");
}
