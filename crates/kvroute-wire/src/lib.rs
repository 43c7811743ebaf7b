//! Codecs for the KV-event wire format of vLLM and SGLang: msgpack batches in ZMQ frames, the
//! replay protocol, sequence tracking, and the conversion into the router's index.
//!
//! This is an edge crate (it speaks a wire format) that is itself sans-IO: it owns no socket,
//! spawns nothing and reads no clock. The live server feeds it the frames its ZMQ sockets
//! receive and sends the frames it returns; tests and mock workers drive it the same way.
//!
//! # A subscriber's loop
//!
//! ```
//! use std::num::NonZeroU32;
//! use kvroute_core::ids::{DpRank, WorkerId, WorkerKey};
//! use kvroute_core::index::{IndexConfig, RunIndex};
//! use kvroute_wire::{ApplyConfig, BlockStored, EventBatch, EventEncoding, RawBatch, SeqStatus, SeqTracker, WireEvent};
//!
//! // What an engine publishes (here made by hand, as a mock worker would).
//! let published = EventBatch {
//!     topic: String::new(),
//!     seq: 0,
//!     ts: 1767225600.0,
//!     events: vec![WireEvent::BlockStored(BlockStored {
//!         block_hashes: vec![kvroute_core::ids::ExternalBlockHash(11)],
//!         parent_block_hash: None,
//!         token_ids: vec![1, 2, 3, 4],
//!         block_size: 4,
//!         lora_id: None,
//!         medium: Some("GPU".into()),
//!         lora_name: None,
//!         cache_salt: None,
//!         group_idx: None,
//!     })],
//!     dp_rank: Some(0),
//! };
//! let frames = published.encode_live(EventEncoding::Map).unwrap();
//!
//! // The subscriber: frames in, sequence check, decode, index.
//! let mut index = RunIndex::new(IndexConfig::default());
//! let mut tracker = SeqTracker::new();
//! let config = ApplyConfig { block_size: NonZeroU32::new(4).unwrap(), namespace: None, group_idx: 0 };
//! let raw = RawBatch::from_live(&frames).unwrap();
//! assert_eq!(tracker.observe_live(raw.seq), SeqStatus::InOrder);
//! let batch = raw.decode().unwrap();
//! let worker = batch.worker_key(WorkerKey::new(WorkerId(7), DpRank(0)));
//! index.add_worker(worker);
//! for event in &batch.events {
//!     let report = event.apply_to(&mut index, worker, &config).unwrap();
//!     assert_eq!(report.skipped, None);
//! }
//! assert_eq!(index.block_count(worker), 1);
//! ```
//!
//! # Layout
//!
//! * [`EventBatch`], [`WireEvent`]: the events, decoded from and encoded to payloads
//!   ([`EventEncoding`]); `From<&KvEvent>` turns a simulated engine's events into them.
//! * [`RawBatch`]: a live message's frames, split before decoding.
//! * [`replay`]: the replay protocol's frames, both reply layouts.
//! * [`SeqTracker`]: what to do with each sequence number.
//! * [`ApplyConfig`], [`WireEvent::apply_to`]: events into a
//!   [`RunIndex`](kvroute_core::index::RunIndex), and what was skipped ([`SkipReason`]).
//!
//! # Decisions
//!
//! * **Every layout in, two out.** The decoder accepts every revision seen in the wild:
//!   positional events of any length (the 2025 schema's 6-item `BlockStored` up to revisions
//!   newer than this crate), map events with the tag under `"type"`, a positional or a map
//!   batch, unknown fields (skipped) and unknown event types ([`WireEvent::Unknown`]). The
//!   encoder writes what vLLM's msgspec writes, byte for byte: map events (the default, vLLM
//!   since June 2026) or positional ones in the last positional revision's layout, in a
//!   positional batch with `data_parallel_rank` always present (nil when unset), since msgspec
//!   writes every field of an `array_like` struct, `omit_defaults` or not.
//! * **Hashes** are u64. Negative integers (SGLang hashes into i64) keep their bits; bytes (vLLM
//!   with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends 32-byte digests) become their last eight
//!   bytes big-endian, vLLM's own int form of the digest ([`hash_from_bytes`]).
//! * **Never a panic on input.** Lengths are checked before use and bound allocations, nesting is
//!   skipped without recursion, and a malformed payload is a [`PayloadError`] naming the path to
//!   the bad value. `tests/fuzz_decode.rs` runs structured mutations of real payloads.
//!
//! * **`extra_keys`**: only the first block's `cache_salt` is read (`BlockStored::cache_salt`),
//!   which salts that block's hash as the router salts a prompt's; multimodal and prompt-embedding
//!   keys are not, so such a block hashes as its tokens alone.
//!
//! Deliberately absent: sockets and threads (the server's job); multimodal extra keys; encoding
//! the 2025 schema or map batches, which no current engine expects.
#![forbid(unsafe_code)]

mod apply;
mod decode;
mod encode;
mod error;
mod event;
mod frames;
mod msgpack;
pub mod replay;
mod schema;
mod seq;

pub use apply::{Applied, ApplyConfig, ApplyReport, Conversion, SkipReason};
pub use decode::hash_from_bytes;
pub use error::{DecodeError, EncodeError, FrameError, PayloadError, Problem};
pub use event::{BlockRemoved, BlockStored, EventBatch, EventEncoding, MEDIUM_GPU, WireEvent};
pub use frames::RawBatch;
pub use seq::{ReplayStatus, SeqStatus, SeqTracker};
