//! The msgpack the KV events use: a cursor that reads one value head at a time from a byte slice,
//! and a writer that picks the encodings msgspec picks.
//!
//! The reader never allocates and never trusts a length: a length is checked against the bytes
//! left before anything is taken, and skipping nested values counts pending items instead of
//! recursing, so no input can exhaust the stack.

use std::convert::Infallible;

use rmp::Marker;
use rmp::encode::{self, ByteBuf, ValueWriteError};

use crate::error::{EncodeError, Problem};

/// The head of one msgpack value: a scalar in full, or the length of an array or map whose items
/// follow it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Head<'a> {
    Nil,
    Bool,
    /// A non-negative integer, in any integer format.
    Uint(u64),
    /// A negative integer.
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    /// An extension value; nothing here reads one, so its type and data are dropped.
    Ext,
}

impl Head<'_> {
    /// What the value is, for error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool => "bool",
            Head::Uint(_) | Head::Int(_) => "int",
            Head::Float(_) => "float",
            Head::Str(_) => "str",
            Head::Bin(_) => "bin",
            Head::Array(_) => "array",
            Head::Map(_) => "map",
            Head::Ext => "ext",
        }
    }
}

/// A cursor over msgpack bytes. Copying it saves a position to read ahead from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// A capacity to reserve for `len` items: never more than the bytes left, since every item
    /// takes at least one byte. A forged length cannot make the decoder allocate.
    pub(crate) fn capacity_for(&self, len: u32) -> usize {
        (len as usize).min(self.remaining())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Problem> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or(Problem::Truncated)?;
        let taken = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(taken)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], Problem> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize, Problem> {
        Ok(usize::from(u8::from_be_bytes(self.be()?)))
    }

    fn len16(&mut self) -> Result<usize, Problem> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn len32(&mut self) -> Result<usize, Problem> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    /// Reads the head of the next value. For an array or a map, its items come next.
    pub(crate) fn head(&mut self) -> Result<Head<'a>, Problem> {
        let marker = Marker::from_u8(self.be::<1>()?[0]);
        Ok(match marker {
            Marker::Null => Head::Nil,
            Marker::True | Marker::False => Head::Bool,
            Marker::FixPos(v) => Head::Uint(v.into()),
            Marker::FixNeg(v) => Head::Int(v.into()),
            Marker::U8 => Head::Uint(u8::from_be_bytes(self.be()?).into()),
            Marker::U16 => Head::Uint(u16::from_be_bytes(self.be()?).into()),
            Marker::U32 => Head::Uint(u32::from_be_bytes(self.be()?).into()),
            Marker::U64 => Head::Uint(u64::from_be_bytes(self.be()?)),
            Marker::I8 => signed(i8::from_be_bytes(self.be()?).into()),
            Marker::I16 => signed(i16::from_be_bytes(self.be()?).into()),
            Marker::I32 => signed(i32::from_be_bytes(self.be()?).into()),
            Marker::I64 => signed(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Head::Float(f32::from_be_bytes(self.be()?).into()),
            Marker::F64 => Head::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => Head::Str(self.take(n.into())?),
            Marker::Str8 => Head::Str(self.len8().and_then(|n| self.take(n))?),
            Marker::Str16 => Head::Str(self.len16().and_then(|n| self.take(n))?),
            Marker::Str32 => Head::Str(self.len32().and_then(|n| self.take(n))?),
            Marker::Bin8 => Head::Bin(self.len8().and_then(|n| self.take(n))?),
            Marker::Bin16 => Head::Bin(self.len16().and_then(|n| self.take(n))?),
            Marker::Bin32 => Head::Bin(self.len32().and_then(|n| self.take(n))?),
            Marker::FixArray(n) => Head::Array(n.into()),
            Marker::Array16 => Head::Array(u16::from_be_bytes(self.be()?).into()),
            Marker::Array32 => Head::Array(u32::from_be_bytes(self.be()?)),
            Marker::FixMap(n) => Head::Map(n.into()),
            Marker::Map16 => Head::Map(u16::from_be_bytes(self.be()?).into()),
            Marker::Map32 => Head::Map(u32::from_be_bytes(self.be()?)),
            // Extension values: a type byte, then the data.
            Marker::FixExt1 => self.take(2).map(|_| Head::Ext)?,
            Marker::FixExt2 => self.take(3).map(|_| Head::Ext)?,
            Marker::FixExt4 => self.take(5).map(|_| Head::Ext)?,
            Marker::FixExt8 => self.take(9).map(|_| Head::Ext)?,
            Marker::FixExt16 => self.take(17).map(|_| Head::Ext)?,
            Marker::Ext8 => self.len8().and_then(|n| self.take(n + 1)).map(|_| Head::Ext)?,
            Marker::Ext16 => self.len16().and_then(|n| self.take(n + 1)).map(|_| Head::Ext)?,
            Marker::Ext32 => self.len32().and_then(|n| self.take(n + 1)).map(|_| Head::Ext)?,
            Marker::Reserved => return Err(Problem::ReservedMarker),
        })
    }

    /// Skips the next value, nested items included.
    pub(crate) fn skip(&mut self) -> Result<(), Problem> {
        let head = self.head()?;
        self.skip_items_of(head)
    }

    /// Skips the items of a value whose head was just read (nothing for a scalar).
    pub(crate) fn skip_items_of(&mut self, head: Head<'_>) -> Result<(), Problem> {
        let mut pending = items(head);
        while pending > 0 {
            pending = (pending - 1).saturating_add(items(self.head()?));
        }
        Ok(())
    }

    /// Skips `n` values.
    pub(crate) fn skip_n(&mut self, n: u64) -> Result<(), Problem> {
        (0..n).try_for_each(|_| self.skip())
    }
}

/// How many values follow a head as its items.
fn items(head: Head<'_>) -> u64 {
    match head {
        Head::Array(n) => n.into(),
        Head::Map(n) => 2 * u64::from(n),
        _ => 0,
    }
}

/// A signed-format integer: non-negative values read the same as unsigned ones.
fn signed(v: i64) -> Head<'static> {
    match u64::try_from(v) {
        Ok(u) => Head::Uint(u),
        Err(_) => Head::Int(v),
    }
}

/// Writes msgpack the way msgspec does: every integer in its smallest format (unsigned formats
/// for non-negative values), floats as float64, strings as fixstr/str8/str16/str32, and
/// array and map headers as small as their length allows.
#[derive(Debug, Default)]
pub(crate) struct Writer(ByteBuf);

impl Writer {
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.0.into_vec()
    }

    pub(crate) fn nil(&mut self) {
        infallible(encode::write_nil(&mut self.0).map_err(ValueWriteError::InvalidMarkerWrite));
    }

    pub(crate) fn uint(&mut self, v: u64) {
        infallible(encode::write_uint(&mut self.0, v));
    }

    pub(crate) fn int(&mut self, v: i64) {
        match u64::try_from(v) {
            Ok(u) => self.uint(u),
            Err(_) => {
                infallible(encode::write_sint(&mut self.0, v));
            }
        }
    }

    pub(crate) fn f64(&mut self, v: f64) {
        infallible(encode::write_f64(&mut self.0, v));
    }

    pub(crate) fn str(&mut self, s: &str, what: &'static str) -> Result<(), EncodeError> {
        infallible(encode::write_str_len(&mut self.0, len32(s.len(), what)?));
        self.0.as_mut_vec().extend_from_slice(s.as_bytes());
        Ok(())
    }

    pub(crate) fn array_len(&mut self, len: usize, what: &'static str) -> Result<(), EncodeError> {
        infallible(encode::write_array_len(&mut self.0, len32(len, what)?));
        Ok(())
    }

    pub(crate) fn map_len(&mut self, len: usize, what: &'static str) -> Result<(), EncodeError> {
        infallible(encode::write_map_len(&mut self.0, len32(len, what)?));
        Ok(())
    }
}

/// A length as msgpack stores it.
fn len32(len: usize, what: &'static str) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })
}

/// The value of a write into memory, which cannot fail.
fn infallible<T>(result: Result<T, ValueWriteError<Infallible>>) -> T {
    match result {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(never) | ValueWriteError::InvalidDataWrite(never)) => {
            match never {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heads(bytes: &[u8]) -> Vec<Result<Head<'_>, Problem>> {
        let mut r = Reader::new(bytes);
        let mut out = Vec::new();
        while r.remaining() > 0 {
            let head = r.head();
            let stop = head.is_err();
            out.push(head);
            if stop {
                break;
            }
        }
        out
    }

    #[test]
    fn integers_normalise_to_uint_when_non_negative() {
        // i8 5, i64 -2, u16 300, fixneg -1
        let bytes = [
            0xd0, 0x05, 0xd3, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0xcd, 0x01, 0x2c, 0xff,
        ];
        assert_eq!(
            heads(&bytes),
            [
                Ok(Head::Uint(5)),
                Ok(Head::Int(-2)),
                Ok(Head::Uint(300)),
                Ok(Head::Int(-1))
            ]
        );
    }

    #[test]
    fn lengths_are_checked_before_taking() {
        // str32 claiming 4 GiB, bin8 claiming 3 bytes with 1 left, ext8 with its type byte missing.
        assert_eq!(
            heads(&[0xdb, 0xff, 0xff, 0xff, 0xff, b'a']),
            [Err(Problem::Truncated)]
        );
        assert_eq!(heads(&[0xc4, 0x03, 0x00]), [Err(Problem::Truncated)]);
        assert_eq!(heads(&[0xc7, 0x00]), [Err(Problem::Truncated)]);
        assert_eq!(heads(&[0xc1]), [Err(Problem::ReservedMarker)]);
        assert_eq!(
            Reader::new(&[0xdd, 0xff, 0xff, 0xff, 0xff]).capacity_for(u32::MAX),
            5
        );
    }

    #[test]
    fn skip_walks_nested_values_without_recursion() {
        // 100 000 nested one-element arrays around a nil, then 7.
        let mut bytes = vec![0x91; 100_000];
        bytes.extend([0xc0, 0x07]);
        let mut r = Reader::new(&bytes);
        r.skip().unwrap();
        assert_eq!(r.head(), Ok(Head::Uint(7)));
        // A map of one pair whose value is an ext.
        let mut r = Reader::new(&[0x81, 0xa1, b'k', 0xd4, 0x01, 0x02, 0x09]);
        r.skip().unwrap();
        assert_eq!(r.head(), Ok(Head::Uint(9)));
    }

    #[test]
    fn writer_uses_the_smallest_formats() {
        let mut w = Writer::default();
        for v in [
            0u64,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            w.uint(v);
        }
        w.int(-1);
        w.int(-33);
        w.int(7);
        w.str(&"x".repeat(31), "s").unwrap();
        w.str(&"y".repeat(32), "s").unwrap();
        w.array_len(15, "a").unwrap();
        w.array_len(16, "a").unwrap();
        w.map_len(3, "m").unwrap();
        w.f64(0.5);
        w.nil();
        let bytes = w.into_bytes();
        let mut expected = vec![
            0x00, 0x7f, 0xcc, 0x80, 0xcc, 0xff, 0xcd, 0x01, 0x00, 0xcd, 0xff, 0xff, 0xce, 0x00, 0x01, 0x00,
            0x00, 0xce, 0xff, 0xff, 0xff, 0xff, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0xd0, 0xdf, 0x07, 0xbf,
        ];
        expected.extend([b'x'; 31]);
        expected.extend([0xd9, 32]);
        expected.extend([b'y'; 32]);
        expected.extend([
            0x9f, 0xdc, 0x00, 0x10, 0x83, 0xcb, 0x3f, 0xe0, 0, 0, 0, 0, 0, 0, 0xc0,
        ]);
        assert_eq!(bytes, expected);
    }
}
