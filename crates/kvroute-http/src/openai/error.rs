//! OpenAI's error shape, and the refusal of an over-long prompt in vLLM's words.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::types;

/// An error response in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// A short machine-readable code.
    pub code: &'static str,
    /// The field at fault, if one is.
    pub param: Option<&'static str>,
    /// What is wrong.
    pub message: String,
    /// Seconds for `Retry-After`.
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// A 400 about `param`.
    pub fn bad_request(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code: "invalid_value",
            param: Some(param),
            message: message.into(),
            retry_after: None,
        }
    }

    /// Any status.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            code,
            param: None,
            message: message.into(),
            retry_after: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> types::ErrorResponse {
        types::ErrorResponse {
            error: types::ErrorBody {
                message: self.message.clone(),
                kind: self.kind.to_owned(),
                param: self.param.map(str::to_owned),
                code: Some(types::ErrorCode::Name(self.code.to_owned())),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

/// What an over-long prompt was found to measure.
#[derive(Clone, Copy, Debug)]
pub(super) enum Length {
    /// Its tokens.
    Tokens(usize),
    /// At least this many tokens (tokenizing stopped past the limit).
    AtLeast(usize),
    /// Its text's characters, more than the limit's tokens can hold (not tokenized).
    Chars(super::TextTooLong),
}

/// The refusal of a prompt over `max` tokens: OpenAI's shape and code
/// (`context_length_exceeded`, naming `param`), in vLLM's words ("This model's maximum context
/// length is N tokens. However, your request has M input tokens.", the pattern clients read to
/// shorten a conversation).
pub(super) fn too_long(param: &'static str, length: Length, max: usize) -> ApiError {
    let what = match param {
        "messages" => "messages",
        _ => "prompt",
    };
    let has = match length {
        Length::Tokens(n) => format!("your request has {n} input tokens"),
        Length::AtLeast(n) => format!("your request has at least {n} input tokens"),
        Length::Chars(t) => format!(
            "your prompt contains {} characters (more than {} characters, which is the upper bound for {max} input tokens)",
            t.chars, t.max_chars
        ),
    };
    ApiError {
        code: "context_length_exceeded",
        ..ApiError::bad_request(
            param,
            format!(
                "This model's maximum context length is {max} tokens. However, {has}. Please reduce the length of the input {what}."
            ),
        )
    }
}
