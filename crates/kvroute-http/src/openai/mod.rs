//! The OpenAI request side both the proxy and the mock workers read: which endpoint, whether it
//! streams, and the prompt as token ids; the OpenAI error shape for bad input; and the
//! response shapes, typed once ([`types`]).
//!
//! Bodies are read as loose JSON (unknown fields are the engine's business and pass through the
//! proxy untouched); only the fields needed here are checked, each with a message naming it.

mod body;
mod chat;
mod error;
mod fields;
mod parse;
#[cfg(test)]
mod tests;
mod tokens;
pub mod types;

pub use body::{KV_CACHE_REPORT_MODE, KvCacheReport, engine_body};
pub use error::ApiError;
use error::{Length, too_long};
pub use fields::validate_fields;
pub use parse::{
    INTERNAL_FIELDS, Keep, Parsed, Prompt, Side, TRUNCATED_TO_NOTHING, Truncation, parse, parse_with,
};
pub use tokens::{
    TextTooLong, check_text_len, encode_text, engine_tokens, engine_tokens_with_turn, truncated_tokens,
};

/// The two generation endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

impl Endpoint {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}
