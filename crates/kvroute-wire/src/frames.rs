//! The ZMQ frames around a payload, for live messages.
//!
//! A publisher's PUB socket sends each batch as three frames: `[topic, seq, payload]`, where
//! `topic` is UTF-8 (empty by default), `seq` is the batch's sequence number as 8 bytes
//! big-endian, and `payload` is the msgpack batch. A SUB socket receives exactly these frames.

use crate::error::{FrameError, PayloadError};
use crate::event::EventBatch;

/// One batch as it travels, its payload not yet decoded. Splitting first lets a subscriber check
/// the sequence number (with [`SeqTracker`](crate::SeqTracker)) before paying for the decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawBatch<'a> {
    /// The topic; empty in old-layout replay replies, which carry none.
    pub topic: &'a str,
    /// The sequence number.
    pub seq: u64,
    /// The msgpack payload.
    pub payload: &'a [u8],
}

impl<'a> RawBatch<'a> {
    /// Splits a live message, `[topic, seq, payload]`.
    pub fn from_live<F: AsRef<[u8]>>(frames: &'a [F]) -> Result<Self, FrameError> {
        match frames {
            [topic, seq, payload] => Self::from_parts(topic.as_ref(), seq.as_ref(), payload.as_ref()),
            _ => Err(FrameError::FrameCount {
                expected: "3 ([topic, seq, payload])",
                found: frames.len(),
            }),
        }
    }

    /// A batch from its three frames, checked.
    pub(crate) fn from_parts(topic: &'a [u8], seq: &[u8], payload: &'a [u8]) -> Result<Self, FrameError> {
        Ok(Self {
            topic: std::str::from_utf8(topic).map_err(|_| FrameError::TopicNotUtf8)?,
            seq: seq_of(seq)?,
            payload,
        })
    }

    /// Decodes the payload.
    pub fn decode(&self) -> Result<EventBatch, PayloadError> {
        EventBatch::decode_payload(self.topic, self.seq, self.payload)
    }

    /// The live message: `[topic, seq as 8 bytes big-endian, payload]`.
    pub fn to_live_frames(&self) -> [Vec<u8>; 3] {
        [
            self.topic.as_bytes().to_vec(),
            self.seq.to_be_bytes().to_vec(),
            self.payload.to_vec(),
        ]
    }
}

/// A sequence number frame: 8 bytes, big-endian.
pub(crate) fn seq_of(frame: &[u8]) -> Result<u64, FrameError> {
    <[u8; 8]>::try_from(frame)
        .map(u64::from_be_bytes)
        .map_err(|_| FrameError::SeqLength(frame.len()))
}
