//! A chunk of a stream read as far as the proxy needs it: its `error`, `usage` and `choices`,
//! with everything else read through (as a [`Value`] parse would accept it) and dropped.

use kvroute_http::openai::types::Usage;
use serde_json::Value;

/// What the stream scan reads of a chunk (a JSON object): what a parse into a [`Value`] would
/// show of its `error`, `usage` and `choices` (the last of a repeated key counting), the same
/// texts accepted, but only `usage` built: the rest is read through and dropped.
#[derive(Default)]
pub(super) struct ChunkView {
    /// `error` is there and not null.
    pub(super) error: bool,
    /// `usage`, whatever it is.
    pub(super) usage: Option<Value>,
    /// `choices` is a list of at least one.
    pub(super) choices: bool,
}

impl ChunkView {
    /// The usage, if `usage` is an object that reads as one.
    pub(super) fn usage(&self) -> Option<Usage> {
        match &self.usage {
            Some(u) if u.is_object() => serde_json::from_value(u.clone()).ok(),
            _ => None,
        }
    }
}

impl<'de> serde::Deserialize<'de> for ChunkView {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = ChunkView;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<ChunkView, A::Error> {
                let mut chunk = ChunkView::default();
                while let Some(key) = map.next_key::<ChunkKey>()? {
                    match key {
                        ChunkKey::Error => chunk.error = !map.next_value::<Skim>()?.null,
                        ChunkKey::Usage => chunk.usage = Some(map.next_value()?),
                        ChunkKey::Choices => chunk.choices = map.next_value::<Skim>()?.nonempty_list,
                        ChunkKey::Other => {
                            map.next_value::<Skim>()?;
                        }
                    }
                }
                Ok(chunk)
            }
        }
        d.deserialize_map(Fields)
    }
}

/// A key of a chunk, as far as [`ChunkView`] tells them apart.
enum ChunkKey {
    Error,
    Usage,
    Choices,
    Other,
}

impl<'de> serde::Deserialize<'de> for ChunkKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl serde::de::Visitor<'_> for Key {
            type Value = ChunkKey;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<ChunkKey, E> {
                Ok(match key {
                    "error" => ChunkKey::Error,
                    "usage" => ChunkKey::Usage,
                    "choices" => ChunkKey::Choices,
                    _ => ChunkKey::Other,
                })
            }
        }
        d.deserialize_str(Key)
    }
}

/// Any JSON value, read as a [`Value`] parse reads it (numbers in range, strings' escapes
/// valid, the same depth limit) but not built: whether it was `null`, and whether it was a
/// list of at least one.
#[derive(Clone, Copy, Default)]
struct Skim {
    null: bool,
    nonempty_list: bool,
}

impl<'de> serde::Deserialize<'de> for Skim {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SkimVisitor)
    }
}

struct SkimVisitor;

impl<'de> serde::de::Visitor<'de> for SkimVisitor {
    type Value = Skim;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Skim, E> {
        Ok(Skim {
            null: true,
            nonempty_list: false,
        })
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Skim, E> {
        self.visit_unit()
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Skim, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Skim, A::Error> {
        let mut len = 0usize;
        while seq.next_element::<Skim>()?.is_some() {
            len += 1;
        }
        Ok(Skim {
            null: false,
            nonempty_list: len > 0,
        })
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Skim, A::Error> {
        while map.next_key::<Skim>()?.is_some() {
            map.next_value::<Skim>()?;
        }
        Ok(Skim::default())
    }
}
