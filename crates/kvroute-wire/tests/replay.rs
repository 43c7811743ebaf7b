//! The replay protocol's frames: the request a DEALER sends, and replies in both layouts, with
//! and without the empty delimiter frame.

mod common;

use kvroute_wire::replay::{self, END_SEQ, ReplayLayout, ReplayReply};
use kvroute_wire::{FrameError, RawBatch};

const SEQ_5: [u8; 8] = [0, 0, 0, 0, 0, 0, 0, 5];

fn frames(parts: &[&[u8]]) -> Vec<Vec<u8>> {
    parts.iter().map(|p| p.to_vec()).collect()
}

#[test]
fn a_request_is_the_delimiter_then_the_start() {
    let request = replay::request(5);
    assert_eq!(request, [vec![], SEQ_5.to_vec()]);
    assert_eq!(replay::parse_request(&request), Ok(5));
    assert_eq!(
        replay::parse_request(&frames(&[b"x", &SEQ_5])),
        Err(FrameError::MissingDelimiter)
    );
    assert_eq!(
        replay::parse_request(&frames(&[b"", b"\x05"])),
        Err(FrameError::SeqLength(1))
    );
    assert_eq!(
        replay::parse_request(&frames(&[&SEQ_5])),
        Err(FrameError::FrameCount {
            expected: "2 ([\"\", start])",
            found: 1
        })
    );
}

#[test]
fn replies_in_both_layouts_with_or_without_the_delimiter() {
    let batch = |topic| {
        ReplayReply::Batch(RawBatch {
            topic,
            seq: 5,
            payload: b"P",
        })
    };
    let cases: &[(&[&[u8]], ReplayReply<'_>)] = &[
        // As a DEALER receives them.
        (&[b"", &SEQ_5, b"P"], batch("")),
        (&[b"", b"kv@pod", &SEQ_5, b"P"], batch("kv@pod")),
        (&[b"", &END_SEQ, b""], ReplayReply::End),
        (&[b"", b"", &END_SEQ, b""], ReplayReply::End),
        // Without the delimiter (a REQ socket, or a transport that strips it).
        (&[&SEQ_5, b"P"], batch("")),
        (&[b"kv@pod", &SEQ_5, b"P"], batch("kv@pod")),
        (&[&END_SEQ, b""], ReplayReply::End),
        // The new layout's end without its delimiter reads as the old one's with it.
        (&[b"", &END_SEQ, b""], ReplayReply::End),
    ];
    for (parts, expected) in cases {
        let frames = frames(parts);
        assert_eq!(replay::parse_reply(&frames).as_ref(), Ok(expected), "{parts:?}");
    }
}

#[test]
fn malformed_replies_are_errors() {
    let two_or_three = "2 or 3 after the empty delimiter ([seq, payload] or [topic, seq, payload])";
    let cases: &[(&[&[u8]], FrameError)] = &[
        (
            &[],
            FrameError::FrameCount {
                expected: two_or_three,
                found: 0,
            },
        ),
        (
            &[&SEQ_5],
            FrameError::FrameCount {
                expected: two_or_three,
                found: 1,
            },
        ),
        (
            &[b"", b"", b"", &SEQ_5, b"P"],
            FrameError::FrameCount {
                expected: two_or_three,
                found: 5,
            },
        ),
        (&[b"", b"\x05"], FrameError::SeqLength(0)),
        (&[b"", b"t", b"\x05", b"P"], FrameError::SeqLength(1)),
        (&[b"", b"\xff\xfe", &SEQ_5, b"P"], FrameError::TopicNotUtf8),
    ];
    for (parts, expected) in cases {
        assert_eq!(
            replay::parse_reply(&frames(parts)),
            Err(expected.clone()),
            "{parts:?}"
        );
    }
}

#[test]
fn what_a_publisher_sends_parses_back() {
    let payload = common::fixture("map_2026");
    let raw = RawBatch {
        topic: "kv@pod",
        seq: 5,
        payload: &payload,
    };
    let old = replay::reply(&raw, ReplayLayout::SeqPayload);
    assert_eq!(old, frames(&[b"", &SEQ_5, &payload]));
    let new = replay::reply(&raw, ReplayLayout::TopicSeqPayload);
    assert_eq!(new, frames(&[b"", b"kv@pod", &SEQ_5, &payload]));
    assert_eq!(
        replay::end(ReplayLayout::SeqPayload),
        frames(&[b"", &END_SEQ, b""])
    );
    assert_eq!(
        replay::end(ReplayLayout::TopicSeqPayload),
        frames(&[b"", b"", &END_SEQ, b""])
    );

    let ReplayReply::Batch(got) = replay::parse_reply(&new).unwrap() else {
        panic!("not a batch")
    };
    assert_eq!(got, raw);
    let mut expected = common::decoded("map_2026");
    (expected.topic, expected.seq) = ("kv@pod".into(), 5);
    assert_eq!(got.decode().unwrap(), expected);
    for layout in [ReplayLayout::SeqPayload, ReplayLayout::TopicSeqPayload] {
        assert_eq!(replay::parse_reply(&replay::end(layout)), Ok(ReplayReply::End));
    }
}

#[test]
fn live_frames_must_be_three() {
    let payload = common::fixture("all_cleared");
    let live = frames(&[b"kv", &SEQ_5, &payload]);
    let raw = RawBatch::from_live(&live).unwrap();
    assert_eq!((raw.topic, raw.seq), ("kv", 5));
    assert_eq!(raw.to_live_frames().to_vec(), live);
    assert_eq!(
        RawBatch::from_live(&live[1..]),
        Err(FrameError::FrameCount {
            expected: "3 ([topic, seq, payload])",
            found: 2
        })
    );
    assert_eq!(
        RawBatch::from_live(&frames(&[b"kv", b"\x05", &payload])),
        Err(FrameError::SeqLength(1))
    );
}
