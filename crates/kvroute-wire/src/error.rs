//! What can go wrong, each error naming the frame, field or value at fault.
//!
//! Decoding fails with a [`FrameError`] (the ZMQ frames around a payload) or a [`PayloadError`]
//! (the msgpack inside, with the path to the bad value, such as
//! `events[2].block_hashes[0]: expected a block hash (int or bin), found str`);
//! [`DecodeError`] is either. Unknown fields and unknown event types are not errors.

use std::fmt;

/// What is wrong with a msgpack value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Problem {
    /// The bytes end inside a value.
    #[error("the payload ends inside a value")]
    Truncated,
    /// Byte `0xc1`, which msgpack never uses.
    #[error("byte 0xc1, which msgpack reserves")]
    ReservedMarker,
    /// A value of the wrong type.
    #[error("expected {expected}, found {found}")]
    Type {
        /// What the schema wants there.
        expected: &'static str,
        /// What the payload has.
        found: &'static str,
    },
    /// An integer outside the range of its field.
    #[error("expected {expected}, found {value}")]
    OutOfRange {
        /// The field's range, in words.
        expected: &'static str,
        /// The integer found.
        value: i128,
    },
    /// A string that is not UTF-8.
    #[error("a string that is not UTF-8")]
    NotUtf8,
    /// A required field is absent.
    #[error("missing field `{0}`")]
    Missing(&'static str),
    /// Bytes follow the end of the batch.
    #[error("{0} bytes after the end of the batch")]
    TrailingBytes(usize),
}

/// One step on the way from the batch to a value: a field or an array index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Segment {
    Field(&'static str),
    Index(usize),
}

/// A payload that is not a KV event batch, with where and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {problem}", Path(.path))]
pub struct PayloadError {
    problem: Problem,
    /// From the bad value up to the batch: innermost first.
    path: Vec<Segment>,
}

impl PayloadError {
    /// What is wrong.
    pub fn problem(&self) -> &Problem {
        &self.problem
    }

    /// Where the problem is, such as `events[2].block_hashes[0]`; `batch` for the batch itself.
    pub fn path(&self) -> String {
        Path(&self.path).to_string()
    }

    /// The same error, one level further out: the value was found at `segment`.
    pub(crate) fn within(mut self, segment: Segment) -> Self {
        self.path.push(segment);
        self
    }
}

impl From<Problem> for PayloadError {
    fn from(problem: Problem) -> Self {
        Self {
            problem,
            path: Vec::new(),
        }
    }
}

/// Displays a path stored innermost first, outermost first.
struct Path<'a>(&'a [Segment]);

impl fmt::Display for Path<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("batch");
        }
        for (i, segment) in self.0.iter().rev().enumerate() {
            match segment {
                Segment::Field(name) if i == 0 => f.write_str(name)?,
                Segment::Field(name) => write!(f, ".{name}")?,
                Segment::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// Adds a path segment to the error of a result.
pub(crate) trait Within<T> {
    /// The result, with `segment` added to the path of its error.
    fn within(self, segment: Segment) -> Result<T, PayloadError>;
}

impl<T, E: Into<PayloadError>> Within<T> for Result<T, E> {
    fn within(self, segment: Segment) -> Result<T, PayloadError> {
        self.map_err(|e| e.into().within(segment))
    }
}

/// ZMQ frames that do not have the shape of a live message, a replay request or a replay reply.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The wrong number of frames.
    #[error("{found} frames, expected {expected}")]
    FrameCount {
        /// The shapes accepted, in words.
        expected: &'static str,
        /// Frames received.
        found: usize,
    },
    /// A sequence-number frame that is not 8 bytes.
    #[error("a sequence number frame of {0} bytes, expected 8")]
    SeqLength(usize),
    /// A topic frame that is not UTF-8.
    #[error("a topic that is not UTF-8")]
    TopicNotUtf8,
    /// A replay request whose first frame is not the empty delimiter.
    #[error("a replay request must start with an empty delimiter frame")]
    MissingDelimiter,
}

/// A message that could not be decoded: bad frames or a bad payload.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frames around the payload.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The msgpack payload.
    #[error(transparent)]
    Payload(#[from] PayloadError),
}

/// A batch that msgpack cannot carry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// A string, array or map longer than msgpack's limit of `u32::MAX`.
    #[error("{what} has length {len}, more than msgpack allows")]
    TooLong {
        /// Which value.
        what: &'static str,
        /// Its length.
        len: usize,
    },
}
