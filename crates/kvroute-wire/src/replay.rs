//! The replay protocol: asking a publisher's ROUTER socket for the batches it still buffers.
//!
//! # Frames
//!
//! A subscriber connects a **DEALER** socket (a REQ socket would read only the first of the many
//! replies) and sends [`request`]`(start)`: `["", start]`, an empty delimiter frame and the first
//! wanted sequence number as 8 bytes big-endian. The ROUTER sees `[identity, "", start]`, the only
//! shape vLLM and SGLang accept.
//!
//! The publisher answers with one message per buffered batch whose `seq >= start`, then an end
//! marker whose sequence number is [`END_SEQ`] (eight `0xFF` bytes). It prefixes each with the
//! identity, which the DEALER strips, and the empty delimiter, which it keeps. So the DEALER
//! receives, in the two layouts in use:
//!
//! | layout | a batch | the end |
//! | --- | --- | --- |
//! | [`ReplayLayout::SeqPayload`]: vLLM before PR #45177 (June 2026), SGLang | `["", seq, payload]` | `["", END_SEQ, ""]` |
//! | [`ReplayLayout::TopicSeqPayload`]: vLLM since PR #45177 | `["", topic, seq, payload]` | `["", "", END_SEQ, ""]` |
//!
//! [`parse_reply`] takes these frames, or the same without the leading delimiter (as a REQ
//! socket, or a transport that strips it, delivers them): after an empty first frame is dropped,
//! two frames are `[seq, payload]` and three are `[topic, seq, payload]`. Three frames starting
//! with an empty one read the same either way: a delimiter then `[seq, payload]`, or an empty
//! topic then `[seq, payload]`.
//!
//! The publisher side ([`parse_request`], [`reply`], [`end`]) serves mock workers.

use crate::error::FrameError;
use crate::frames::{RawBatch, seq_of};

/// The sequence number that marks the end of a replay: `(-1).to_bytes(8, "big", signed=True)`.
pub const END_SEQ: [u8; 8] = [0xFF; 8];

/// The two reply layouts publishers send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayLayout {
    /// `[seq, payload]`, ending `[END_SEQ, ""]`: vLLM before PR #45177, and SGLang.
    SeqPayload,
    /// `[topic, seq, payload]` like a live message, ending `["", END_SEQ, ""]`: vLLM since PR
    /// #45177.
    TopicSeqPayload,
}

/// One reply to a replay request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch (its topic empty in the old layout).
    Batch(RawBatch<'a>),
    /// The end of the replay: no more replies to this request.
    End,
}

/// The frames a DEALER sends to ask for every buffered batch from `start` on: `["", start]`.
pub fn request(start: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start.to_be_bytes().to_vec()]
}

/// The start of a replay request, from the frames a ROUTER receives after the identity:
/// `["", start]`.
pub fn parse_request<F: AsRef<[u8]>>(frames: &[F]) -> Result<u64, FrameError> {
    match frames {
        [delimiter, start] if delimiter.as_ref().is_empty() => seq_of(start.as_ref()),
        [_, _] => Err(FrameError::MissingDelimiter),
        _ => Err(FrameError::FrameCount {
            expected: "2 ([\"\", start])",
            found: frames.len(),
        }),
    }
}

/// Parses one reply, as the DEALER receives it (see the module docs for the frames accepted).
pub fn parse_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply<'_>, FrameError> {
    let body = match frames {
        [delimiter, rest @ ..] if delimiter.as_ref().is_empty() && matches!(rest.len(), 2 | 3) => rest,
        _ => frames,
    };
    let (topic, seq, payload) = match body {
        [seq, payload] => (&[][..], seq.as_ref(), payload.as_ref()),
        [topic, seq, payload] => (topic.as_ref(), seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(FrameError::FrameCount {
                expected: "2 or 3 after the empty delimiter ([seq, payload] or [topic, seq, payload])",
                found: frames.len(),
            });
        }
    };
    if seq == END_SEQ {
        return Ok(ReplayReply::End);
    }
    RawBatch::from_parts(topic, seq, payload).map(ReplayReply::Batch)
}

/// The frames a ROUTER sends after the client's identity to replay `batch`.
pub fn reply(batch: &RawBatch<'_>, layout: ReplayLayout) -> Vec<Vec<u8>> {
    let seq = batch.seq.to_be_bytes().to_vec();
    match layout {
        ReplayLayout::SeqPayload => vec![Vec::new(), seq, batch.payload.to_vec()],
        ReplayLayout::TopicSeqPayload => {
            vec![
                Vec::new(),
                batch.topic.as_bytes().to_vec(),
                seq,
                batch.payload.to_vec(),
            ]
        }
    }
}

/// The frames a ROUTER sends after the client's identity to end a replay.
pub fn end(layout: ReplayLayout) -> Vec<Vec<u8>> {
    match layout {
        ReplayLayout::SeqPayload => vec![Vec::new(), END_SEQ.to_vec(), Vec::new()],
        ReplayLayout::TopicSeqPayload => vec![Vec::new(), Vec::new(), END_SEQ.to_vec(), Vec::new()],
    }
}
