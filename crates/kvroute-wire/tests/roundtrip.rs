//! Encoding then decoding gives back the batch, in both event encodings, through live frames
//! and through replay replies of both layouts.

mod common;

use kvroute_core::ids::ExternalBlockHash;
use kvroute_wire::replay::{self, ReplayLayout, ReplayReply};
use kvroute_wire::{BlockStored, EventBatch, EventEncoding, RawBatch, WireEvent};
use proptest::prelude::*;

const ENCODINGS: [EventEncoding; 2] = [EventEncoding::Map, EventEncoding::Positional];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn live_frames_round_trip(batch in common::arb::batch()) {
        for encoding in ENCODINGS {
            let frames = batch.encode_live(encoding).unwrap();
            prop_assert_eq!(&EventBatch::decode_live(&frames).unwrap(), &batch);
        }
    }

    #[test]
    fn replay_replies_round_trip(batch in common::arb::batch()) {
        let payload = batch.encode_payload(EventEncoding::Map).unwrap();
        let raw = RawBatch { topic: &batch.topic, seq: batch.seq, payload: &payload };
        for layout in [ReplayLayout::SeqPayload, ReplayLayout::TopicSeqPayload] {
            let frames = replay::reply(&raw, layout);
            let ReplayReply::Batch(got) = replay::parse_reply(&frames).unwrap() else {
                // Only a batch numbered like the end marker reads as one.
                prop_assert_eq!(batch.seq, u64::MAX);
                continue;
            };
            let topic = match layout {
                ReplayLayout::SeqPayload => "",
                ReplayLayout::TopicSeqPayload => batch.topic.as_str(),
            };
            prop_assert_eq!(got, RawBatch { topic, ..raw });
            let decoded = got.decode().unwrap();
            prop_assert_eq!(&decoded.events, &batch.events);
        }
    }

    #[test]
    fn nan_timestamps_keep_their_bits(bits in any::<u64>()) {
        let batch = EventBatch { topic: String::new(), seq: 0, ts: f64::from_bits(bits), events: vec![], dp_rank: None };
        let bytes = batch.encode_payload(EventEncoding::Map).unwrap();
        let ts = EventBatch::decode_payload("", 0, &bytes).unwrap().ts;
        prop_assert_eq!(ts.to_bits(), bits);
    }
}

#[test]
fn long_arrays_and_strings_use_their_wide_formats() {
    // 70 000 hashes and tokens (array32), a 300-byte LoRA name (str16), an int32 lora_id and a
    // uint32 rank.
    let batch = EventBatch {
        topic: "kv@10.0.0.1:5557@model".into(),
        seq: 7,
        ts: 0.0,
        events: vec![WireEvent::BlockStored(BlockStored {
            block_hashes: (0..70_000).map(ExternalBlockHash).collect(),
            parent_block_hash: None,
            token_ids: (0..70_000).collect(),
            block_size: 1,
            lora_id: Some(-40_000),
            medium: Some("GPU".into()),
            lora_name: Some("l".repeat(300)),
            cache_salt: None,
            group_idx: None,
        })],
        dp_rank: Some(70_000),
    };
    for encoding in ENCODINGS {
        let bytes = batch.encode_payload(encoding).unwrap();
        assert_eq!(
            EventBatch::decode_payload(&batch.topic, 7, &bytes).unwrap(),
            batch
        );
    }
}
