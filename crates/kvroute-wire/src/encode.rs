//! Payload encoding, byte for byte what msgspec writes for vLLM's structs.
//!
//! msgspec writes struct fields in declaration order. A map-encoded event leaves out every field
//! that has a default and equals it (`omit_defaults`); the required nullable fields (`lora_id`,
//! `medium`, `lora_name`) are always written, as nil when unset. An array-encoded struct
//! (`array_like`) ignores `omit_defaults` and writes every field, so the batch is always
//! `[ts, events, data_parallel_rank]` with nil for no rank, and a positional `BlockStored`
//! always has its 12 items.

use crate::error::EncodeError;
use crate::event::{EventBatch, EventEncoding, WireEvent};
use crate::msgpack::Writer;
use crate::schema::{Field, FieldSpec, Kind, TAG_KEY};

/// The payload of `batch`.
pub(crate) fn payload(batch: &EventBatch, encoding: EventEncoding) -> Result<Vec<u8>, EncodeError> {
    let mut w = Writer::default();
    w.array_len(3, "the batch")?;
    w.f64(batch.ts);
    w.array_len(batch.events.len(), "events")?;
    for event in &batch.events {
        self::event(&mut w, event, encoding)?;
    }
    match batch.dp_rank {
        Some(rank) => w.uint(rank.into()),
        None => w.nil(),
    }
    Ok(w.into_bytes())
}

fn event(w: &mut Writer, event: &WireEvent, encoding: EventEncoding) -> Result<(), EncodeError> {
    let (tag, specs) = match event {
        WireEvent::BlockStored(_) => (Kind::Stored.tag(), Kind::Stored.fields()),
        WireEvent::BlockRemoved(_) => (Kind::Removed.tag(), Kind::Removed.fields()),
        WireEvent::AllBlocksCleared => (Kind::Cleared.tag(), Kind::Cleared.fields()),
        // All that is known of it: an event with its tag alone.
        WireEvent::Unknown { tag } => (tag.as_str(), Kind::Cleared.fields()),
    };
    match encoding {
        EventEncoding::Positional => {
            w.array_len(1 + specs.len(), "an event")?;
            w.str(tag, "an event tag")?;
            for spec in specs {
                value(w, event, spec.field)?;
            }
        }
        EventEncoding::Map => {
            let written = |spec: &&FieldSpec| !(spec.has_default && is_nil(event, spec.field));
            w.map_len(1 + specs.iter().filter(written).count(), "an event")?;
            w.str(TAG_KEY, "a key")?;
            w.str(tag, "an event tag")?;
            for spec in specs.iter().filter(written) {
                w.str(spec.name, "a key")?;
                value(w, event, spec.field)?;
            }
        }
    }
    Ok(())
}

/// One field's value as the wire has it, borrowed from an event.
enum Value<'a> {
    Nil,
    Uint(u64),
    Int(i64),
    Str(&'a str),
    Hashes(&'a [kvroute_core::ids::ExternalBlockHash]),
    Tokens(&'a [u32]),
    /// `extra_keys` as vLLM writes them for a store under these: the LoRA name in every
    /// block's, the salt after it in the first block's.
    ExtraKeys {
        blocks: usize,
        lora_name: Option<&'a str>,
        cache_salt: &'a str,
    },
}

fn field_value(event: &WireEvent, field: Option<Field>) -> Value<'_> {
    let opt_u32 = |v: Option<u32>| v.map_or(Value::Nil, |v| Value::Uint(v.into()));
    match (event, field) {
        (WireEvent::BlockStored(e), Some(field)) => match field {
            Field::BlockHashes => Value::Hashes(&e.block_hashes),
            Field::ParentBlockHash => e.parent_block_hash.map_or(Value::Nil, |h| Value::Uint(h.0)),
            Field::TokenIds => Value::Tokens(&e.token_ids),
            Field::BlockSize => Value::Uint(e.block_size.into()),
            Field::LoraId => e.lora_id.map_or(Value::Nil, Value::Int),
            Field::Medium => opt_str(e.medium.as_deref()),
            Field::LoraName => opt_str(e.lora_name.as_deref()),
            // Written only for a salted store: otherwise nil, as every store before read.
            Field::ExtraKeys => match e.cache_salt.as_deref() {
                Some(cache_salt) => Value::ExtraKeys {
                    blocks: e.block_hashes.len(),
                    lora_name: e.lora_name.as_deref(),
                    cache_salt,
                },
                None => Value::Nil,
            },
            Field::GroupIdx => opt_u32(e.group_idx),
        },
        (WireEvent::BlockRemoved(e), Some(Field::BlockHashes)) => Value::Hashes(&e.block_hashes),
        (WireEvent::BlockRemoved(e), Some(Field::Medium)) => opt_str(e.medium.as_deref()),
        (WireEvent::BlockRemoved(e), Some(Field::GroupIdx)) => opt_u32(e.group_idx),
        // Fields this crate does not keep (and fields of no such event, which no table lists).
        _ => Value::Nil,
    }
}

fn opt_str(v: Option<&str>) -> Value<'_> {
    v.map_or(Value::Nil, Value::Str)
}

fn is_nil(event: &WireEvent, field: Option<Field>) -> bool {
    matches!(field_value(event, field), Value::Nil)
}

fn value(w: &mut Writer, event: &WireEvent, field: Option<Field>) -> Result<(), EncodeError> {
    match field_value(event, field) {
        Value::Nil => w.nil(),
        Value::Uint(v) => w.uint(v),
        Value::Int(v) => w.int(v),
        Value::Str(s) => w.str(s, "a string field")?,
        Value::Hashes(hashes) => {
            w.array_len(hashes.len(), "block_hashes")?;
            hashes.iter().for_each(|h| w.uint(h.0));
        }
        Value::Tokens(tokens) => {
            w.array_len(tokens.len(), "token_ids")?;
            tokens.iter().for_each(|&t| w.uint(t.into()));
        }
        Value::ExtraKeys {
            blocks,
            lora_name,
            cache_salt,
        } => {
            w.array_len(blocks, "extra_keys")?;
            for block in 0..blocks {
                let salt = (block == 0).then_some(cache_salt);
                let keys: Vec<&str> = lora_name.into_iter().chain(salt).collect();
                if keys.is_empty() {
                    w.nil();
                } else {
                    w.array_len(keys.len(), "a block's extra keys")?;
                    for key in keys {
                        w.str(key, "an extra key")?;
                    }
                }
            }
        }
    }
    Ok(())
}
