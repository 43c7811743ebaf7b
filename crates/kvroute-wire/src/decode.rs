//! Payload decoding: the msgpack of one batch, in every layout vLLM and SGLang have sent.
//!
//! * The batch: an array `[ts, events]` or `[ts, events, data_parallel_rank]` (items after the
//!   third are skipped), or a map with the keys `ts`, `events` and `data_parallel_rank`.
//! * Each event: an array whose first item is the tag, the fields following in declaration
//!   order ([`crate::schema`]; a short array lacks the later fields, a long one has fields added
//!   after this crate, which are skipped), or a map with the tag under `"type"` anywhere among
//!   its keys. Unknown keys and unknown tags are skipped; a missing nullable field reads as nil.
//! * Hashes: unsigned, negative (reinterpreted as the u64 of the same bits) or bin
//!   ([`hash_from_bytes`]).

use kvroute_core::ids::ExternalBlockHash;

use crate::error::{PayloadError, Problem, Segment, Within};
use crate::event::{BlockRemoved, BlockStored, WireEvent};
use crate::msgpack::{Head, Reader};
use crate::schema::{Field, FieldSpec, Kind, TAG_KEY};

/// The contents of a payload.
pub(crate) struct Decoded {
    pub(crate) ts: f64,
    pub(crate) events: Vec<WireEvent>,
    pub(crate) dp_rank: Option<u32>,
}

/// The 64-bit block hash of a hash sent as bytes: the integer the bytes spell big-endian,
/// reduced modulo 2^64, that is, the last eight bytes (fewer bytes are zero-extended).
///
/// This is vLLM's own rule: with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1` (the default) it
/// sends `int.from_bytes(digest, "big") & (2**64 - 1)` for the digest it sends whole when the
/// setting is 0. So one engine names a block the same way under both settings, and a router
/// that sees both never holds one block twice.
pub fn hash_from_bytes(bytes: &[u8]) -> ExternalBlockHash {
    let tail = &bytes[bytes.len().saturating_sub(8)..];
    ExternalBlockHash(tail.iter().fold(0, |acc, &b| (acc << 8) | u64::from(b)))
}

/// Decodes one payload; bytes after it are an error.
pub(crate) fn payload(bytes: &[u8]) -> Result<Decoded, PayloadError> {
    let mut r = Reader::new(bytes);
    let decoded = match r.head()? {
        Head::Array(n) => batch_array(&mut r, n)?,
        Head::Map(n) => batch_map(&mut r, n)?,
        other => return Err(mismatch("a batch (array or map)", other)),
    };
    match r.remaining() {
        0 => Ok(decoded),
        n => Err(Problem::TrailingBytes(n).into()),
    }
}

fn batch_array(r: &mut Reader<'_>, n: u32) -> Result<Decoded, PayloadError> {
    if n < 2 {
        return Err(Problem::Missing(if n == 0 { "ts" } else { "events" }).into());
    }
    let ts = ts(r).within(Segment::Field("ts"))?;
    let events = events(r).within(Segment::Field("events"))?;
    let dp_rank = match n {
        2 => None,
        _ => opt_u32(r).within(Segment::Field("data_parallel_rank"))?,
    };
    r.skip_n(u64::from(n.saturating_sub(3)))?;
    Ok(Decoded { ts, events, dp_rank })
}

fn batch_map(r: &mut Reader<'_>, n: u32) -> Result<Decoded, PayloadError> {
    let (mut ts_, mut events_, mut dp_rank) = (None, None, None);
    for _ in 0..n {
        match key(r)? {
            Some(b"ts") => ts_ = Some(ts(r).within(Segment::Field("ts"))?),
            Some(b"events") => events_ = Some(events(r).within(Segment::Field("events"))?),
            Some(b"data_parallel_rank") => {
                dp_rank = opt_u32(r).within(Segment::Field("data_parallel_rank"))?;
            }
            _ => r.skip()?,
        }
    }
    Ok(Decoded {
        ts: ts_.ok_or(Problem::Missing("ts"))?,
        events: events_.ok_or(Problem::Missing("events"))?,
        dp_rank,
    })
}

fn events(r: &mut Reader<'_>) -> Result<Vec<WireEvent>, PayloadError> {
    array(r, "an array of events", event)
}

fn event(r: &mut Reader<'_>) -> Result<WireEvent, PayloadError> {
    match r.head()? {
        Head::Array(n) => event_array(r, n),
        Head::Map(n) => event_map(r, n),
        other => Err(mismatch("an event (array or map)", other)),
    }
}

/// A positional event: `[tag, field, field, ...]`.
fn event_array(r: &mut Reader<'_>, n: u32) -> Result<WireEvent, PayloadError> {
    let Some(after_tag) = n.checked_sub(1) else {
        return Err(Problem::Missing(TAG_KEY).into());
    };
    let tag = str(r).within(Segment::Field(TAG_KEY))?;
    let Some(kind) = Kind::from_tag(tag) else {
        r.skip_n(after_tag.into())?;
        return Ok(WireEvent::Unknown { tag: tag.to_owned() });
    };
    let mut fields = Fields::default();
    for i in 0..after_tag as usize {
        match kind.fields().get(i) {
            Some(&spec) => fields.read(r, spec)?,
            // A field added after this crate.
            None => r.skip()?,
        }
    }
    fields.build(kind)
}

/// A map event: `{"type": tag, name: field, ...}`.
fn event_map(r: &mut Reader<'_>, n: u32) -> Result<WireEvent, PayloadError> {
    // Find the tag first, reading ahead on a copy: msgspec writes it first, so this is one key.
    let tag = tag_in_map(*r, n)?;
    let Some(kind) = Kind::from_tag(tag) else {
        r.skip_n(2 * u64::from(n))?;
        return Ok(WireEvent::Unknown { tag: tag.to_owned() });
    };
    let mut fields = Fields::default();
    for _ in 0..n {
        match key(r)?.and_then(|k| kind.field_named(k)) {
            Some(spec) => fields.read(r, spec)?,
            None => r.skip()?,
        }
    }
    fields.build(kind)
}

fn tag_in_map<'a>(mut r: Reader<'a>, n: u32) -> Result<&'a str, PayloadError> {
    for _ in 0..n {
        if key(&mut r)? == Some(TAG_KEY.as_bytes()) {
            return str(&mut r).within(Segment::Field(TAG_KEY));
        }
        r.skip()?;
    }
    Err(Problem::Missing(TAG_KEY).into())
}

/// The fields of one event as they are read, in either encoding.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<ExternalBlockHash>>,
    parent_block_hash: Option<Option<ExternalBlockHash>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    first_extra_keys: Vec<String>,
    group_idx: Option<u32>,
}

impl Fields {
    /// Reads the value of `spec`'s field, or skips it if this crate does not keep it.
    fn read(&mut self, r: &mut Reader<'_>, spec: FieldSpec) -> Result<(), PayloadError> {
        let Some(field) = spec.field else {
            return r.skip().within(Segment::Field(spec.name));
        };
        let read = |r: &mut Reader<'_>, fields: &mut Fields| -> Result<(), PayloadError> {
            match field {
                Field::BlockHashes => fields.block_hashes = Some(array(r, "an array of block hashes", hash)?),
                Field::ParentBlockHash => fields.parent_block_hash = Some(nullable(r, hash)?),
                Field::TokenIds => fields.token_ids = Some(array(r, "an array of token ids", u32_)?),
                Field::BlockSize => fields.block_size = Some(u32_(r)?),
                Field::LoraId => fields.lora_id = nullable(r, i64_)?,
                Field::Medium => fields.medium = nullable(r, string)?,
                Field::LoraName => fields.lora_name = nullable(r, string)?,
                Field::ExtraKeys => fields.first_extra_keys = first_extra_strings(r)?,
                Field::GroupIdx => fields.group_idx = nullable(r, u32_)?,
            }
            Ok(())
        };
        read(r, self).within(Segment::Field(spec.name))
    }

    fn build(self, kind: Kind) -> Result<WireEvent, PayloadError> {
        let missing = |name| PayloadError::from(Problem::Missing(name));
        Ok(match kind {
            Kind::Stored => WireEvent::BlockStored(BlockStored {
                cache_salt: cache_salt(self.first_extra_keys, self.lora_name.as_deref()),
                block_hashes: self.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                parent_block_hash: self
                    .parent_block_hash
                    .ok_or_else(|| missing("parent_block_hash"))?,
                token_ids: self.token_ids.ok_or_else(|| missing("token_ids"))?,
                block_size: self.block_size.ok_or_else(|| missing("block_size"))?,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                group_idx: self.group_idx,
            }),
            Kind::Removed => WireEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                medium: self.medium,
                group_idx: self.group_idx,
            }),
            Kind::Cleared => WireEvent::AllBlocksCleared,
        })
    }
}

// ---- values ----

fn mismatch(expected: &'static str, found: Head<'_>) -> PayloadError {
    Problem::Type {
        expected,
        found: found.kind(),
    }
    .into()
}

/// A map key: its bytes if it is a string; `None` (and the key skipped) otherwise.
fn key<'a>(r: &mut Reader<'a>) -> Result<Option<&'a [u8]>, PayloadError> {
    match r.head()? {
        Head::Str(bytes) => Ok(Some(bytes)),
        other => {
            r.skip_items_of(other)?;
            Ok(None)
        }
    }
}

fn array<T>(
    r: &mut Reader<'_>,
    expected: &'static str,
    item: impl Fn(&mut Reader<'_>) -> Result<T, PayloadError>,
) -> Result<Vec<T>, PayloadError> {
    let n = match r.head()? {
        Head::Array(n) => n,
        other => return Err(mismatch(expected, other)),
    };
    let mut out = Vec::with_capacity(r.capacity_for(n));
    for i in 0..n as usize {
        out.push(item(r).within(Segment::Index(i))?);
    }
    Ok(out)
}

/// `None` for nil, else what `value` reads.
fn nullable<T>(
    r: &mut Reader<'_>,
    value: impl Fn(&mut Reader<'_>) -> Result<T, PayloadError>,
) -> Result<Option<T>, PayloadError> {
    let mut ahead = *r;
    if ahead.head()? == Head::Nil {
        *r = ahead;
        return Ok(None);
    }
    value(r).map(Some)
}

/// The strings among the first block's extra keys (`extra_keys[0]`, a tuple or nil; the
/// field itself may be nil), other values skipped; the other blocks' keys are skipped. Keys of
/// a shape vLLM does not send are skipped too: they name no salt, and the blocks still apply.
fn first_extra_strings(r: &mut Reader<'_>) -> Result<Vec<String>, PayloadError> {
    let blocks = match r.head()? {
        Head::Array(n) => n,
        other => {
            r.skip_items_of(other)?;
            return Ok(Vec::new());
        }
    };
    let mut out = Vec::new();
    if blocks > 0 {
        match r.head().within(Segment::Index(0))? {
            Head::Array(keys) => {
                for i in 0..keys as usize {
                    match r.head().within(Segment::Index(i))? {
                        Head::Str(bytes) => out.extend(std::str::from_utf8(bytes).ok().map(str::to_owned)),
                        other => r.skip_items_of(other)?,
                    }
                }
            }
            other => r.skip_items_of(other)?,
        }
        r.skip_n(u64::from(blocks) - 1)?;
    }
    Ok(out)
}

/// The `cache_salt` among a first block's string extra keys: vLLM writes the LoRA name first
/// (when there is one), then multimodal identifiers, then the salt, so the salt is the last
/// string after the LoRA name. Multimodal requests are not told apart from salted ones.
fn cache_salt(mut keys: Vec<String>, lora_name: Option<&str>) -> Option<String> {
    if lora_name.is_some() && keys.first().map(String::as_str) == lora_name {
        keys.remove(0);
    }
    keys.pop().filter(|s| !s.is_empty())
}

fn hash(r: &mut Reader<'_>) -> Result<ExternalBlockHash, PayloadError> {
    match r.head()? {
        Head::Uint(u) => Ok(ExternalBlockHash(u)),
        // Engines that hash into i64 (SGLang) send the same 64 bits as a signed integer.
        Head::Int(i) => Ok(ExternalBlockHash(i as u64)),
        Head::Bin(bytes) => Ok(hash_from_bytes(bytes)),
        other => Err(mismatch("a block hash (int or bin)", other)),
    }
}

fn u32_(r: &mut Reader<'_>) -> Result<u32, PayloadError> {
    let out_of_range = |value: i128| Problem::OutOfRange {
        expected: "an integer in 0..=4294967295",
        value,
    };
    match r.head()? {
        Head::Uint(u) => u32::try_from(u).map_err(|_| out_of_range(u.into()).into()),
        Head::Int(i) => Err(out_of_range(i.into()).into()),
        other => Err(mismatch("an integer", other)),
    }
}

fn i64_(r: &mut Reader<'_>) -> Result<i64, PayloadError> {
    match r.head()? {
        Head::Uint(u) => i64::try_from(u).map_err(|_| {
            Problem::OutOfRange {
                expected: "a 64-bit signed integer",
                value: u.into(),
            }
            .into()
        }),
        Head::Int(i) => Ok(i),
        other => Err(mismatch("an integer", other)),
    }
}

fn opt_u32(r: &mut Reader<'_>) -> Result<Option<u32>, PayloadError> {
    nullable(r, u32_)
}

fn ts(r: &mut Reader<'_>) -> Result<f64, PayloadError> {
    match r.head()? {
        Head::Float(f) => Ok(f),
        // msgspec accepts integers for float fields; so does this decoder.
        Head::Uint(u) => Ok(u as f64),
        Head::Int(i) => Ok(i as f64),
        other => Err(mismatch("a timestamp (float)", other)),
    }
}

fn str<'a>(r: &mut Reader<'a>) -> Result<&'a str, PayloadError> {
    match r.head()? {
        Head::Str(bytes) => std::str::from_utf8(bytes).map_err(|_| Problem::NotUtf8.into()),
        other => Err(mismatch("a string", other)),
    }
}

fn string(r: &mut Reader<'_>) -> Result<String, PayloadError> {
    str(r).map(str::to_owned)
}
