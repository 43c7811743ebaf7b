//! vLLM's event structs as tables: the one place that knows field names, their order and which
//! have defaults. The decoder reads positional events by these tables and map events by their
//! names; the encoder writes both from them.

/// The event types this crate knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Stored,
    Removed,
    Cleared,
}

/// The fields this crate keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    /// Read for the first block's `cache_salt` alone.
    ExtraKeys,
    GroupIdx,
}

/// One declared field of a vLLM event struct.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FieldSpec {
    /// The field's name: its key in map events.
    pub(crate) name: &'static str,
    /// What this crate keeps of it; `None` for a field it skips (and writes as nil).
    pub(crate) field: Option<Field>,
    /// Whether the struct gives it a default (`None`), so msgspec leaves it out of map events
    /// when it is nil. Required fields, nullable or not, are always written.
    pub(crate) has_default: bool,
}

const fn required(name: &'static str, field: Field) -> FieldSpec {
    FieldSpec {
        name,
        field: Some(field),
        has_default: false,
    }
}

const fn optional(name: &'static str, field: Option<Field>) -> FieldSpec {
    FieldSpec {
        name,
        field,
        has_default: true,
    }
}

/// `BlockStored` after its tag, as vLLM's last positional revision (before PR #42892) declares
/// it. Later revisions append `locality` and `ownership`, which have defaults: map events leave
/// them out when nil, and positional decoding skips whatever follows this table.
const BLOCK_STORED: &[FieldSpec] = &[
    required("block_hashes", Field::BlockHashes),
    required("parent_block_hash", Field::ParentBlockHash),
    required("token_ids", Field::TokenIds),
    required("block_size", Field::BlockSize),
    required("lora_id", Field::LoraId),
    required("medium", Field::Medium),
    required("lora_name", Field::LoraName),
    optional("extra_keys", Some(Field::ExtraKeys)),
    optional("group_idx", Some(Field::GroupIdx)),
    optional("kv_cache_spec_kind", None),
    optional("kv_cache_spec_sliding_window", None),
];

/// `BlockRemoved` after its tag.
const BLOCK_REMOVED: &[FieldSpec] = &[
    required("block_hashes", Field::BlockHashes),
    required("medium", Field::Medium),
    optional("group_idx", Some(Field::GroupIdx)),
];

/// The key of the tag in map events.
pub(crate) const TAG_KEY: &str = "type";

impl Kind {
    /// The kind a tag names, if this crate knows it.
    pub(crate) fn from_tag(tag: &str) -> Option<Kind> {
        match tag {
            "BlockStored" => Some(Kind::Stored),
            "BlockRemoved" => Some(Kind::Removed),
            "AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }

    /// The tag: vLLM's class name.
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Kind::Stored => "BlockStored",
            Kind::Removed => "BlockRemoved",
            Kind::Cleared => "AllBlocksCleared",
        }
    }

    /// The declared fields after the tag, in order.
    pub(crate) fn fields(self) -> &'static [FieldSpec] {
        match self {
            Kind::Stored => BLOCK_STORED,
            Kind::Removed => BLOCK_REMOVED,
            Kind::Cleared => &[],
        }
    }

    /// The field a map key names, if this crate keeps it for this kind.
    pub(crate) fn field_named(self, key: &[u8]) -> Option<FieldSpec> {
        self.fields()
            .iter()
            .find(|spec| spec.field.is_some() && spec.name.as_bytes() == key)
            .copied()
    }
}
