//! The OpenAI request side both the proxy and the mock workers read: which endpoint, whether it
//! streams, and the prompt as token ids; the OpenAI error shape for bad input; and the
//! response shapes, typed once ([`types`]).
//!
//! Bodies are read as loose JSON (unknown fields are the engine's business and pass through the
//! proxy untouched); only the fields needed here are checked, each with a message naming it.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

use crate::model::Model;

pub mod types;

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
                code: Some(self.code.to_owned()),
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

/// What the proxy and the mocks need of a generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    /// Whether the response streams (SSE).
    pub stream: bool,
    /// Whether a streamed response ends with a usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The prompt's token ids (chat: the rendered conversation's).
    pub tokens: Vec<u32>,
    /// `max_tokens` (or `max_completion_tokens`), if given.
    pub max_tokens: Option<u32>,
    /// The model named.
    pub model: Option<String>,
    /// vLLM's `cache_salt`, which namespaces the prefix cache.
    pub cache_salt: Option<String>,
}

/// Parses a request body for `endpoint`, tokenizing with `model`. Prompts longer than
/// `max_prompt_tokens` are refused.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    model: &Model,
    max_prompt_tokens: usize,
) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("body", format!("the body is not valid JSON: {e}")))?;
    let Value::Object(obj) = &value else {
        return Err(ApiError::bad_request("body", "the body must be a JSON object"));
    };
    check_sampling_fields(obj)?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad_request("stream", "`stream` must be a boolean")),
    };
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let max_tokens = match obj.get("max_completion_tokens").or_else(|| obj.get("max_tokens")) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
            ApiError::bad_request("max_tokens", "`max_tokens` must be a non-negative integer")
        })?),
    };
    if let Some(n) = obj.get("n")
        && n.as_u64() != Some(1)
    {
        return Err(ApiError::bad_request("n", "only n = 1 is supported"));
    }
    let model_name = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ApiError::bad_request("model", "`model` must be a string")),
    };
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "cache_salt",
                "`cache_salt` must be a non-empty string",
            ));
        }
    };
    let tokens = match endpoint {
        Endpoint::Completions => completion_prompt(obj.get("prompt"), model, max_prompt_tokens)?,
        Endpoint::Chat => chat_prompt(
            obj.get("messages"),
            obj.get("add_generation_prompt"),
            model,
            max_prompt_tokens,
        )?,
    };
    if tokens.is_empty() {
        return Err(ApiError::bad_request("prompt", "the prompt is empty"));
    }
    if tokens.len() > max_prompt_tokens {
        return Err(too_long(tokens.len(), max_prompt_tokens));
    }
    Ok(Parsed {
        stream,
        include_usage,
        tokens,
        max_tokens,
        model: model_name,
        cache_salt,
    })
}

/// The type and range of a sampling field, as vLLM checks them (its request models and
/// `SamplingParams._verify_args`). `null` is always accepted (OpenAI's "not given").
#[derive(Clone, Copy, Debug)]
enum FieldRule {
    /// A number within `min..=max`.
    Number { min: f64, max: f64 },
    /// A number above `min` and at most `max`.
    NumberAbove { min: f64, max: f64 },
    /// A whole number of at least `min`.
    Integer { min: i64 },
    /// `true` or `false`.
    Bool,
    /// A string.
    Text,
    /// A string or a list of strings.
    Texts,
}

/// The sampling fields checked before a request is routed, each with its rule.
const SAMPLING_FIELDS: &[(&str, FieldRule)] = &[
    (
        "temperature",
        FieldRule::Number {
            min: 0.0,
            max: f64::MAX,
        },
    ),
    ("top_p", FieldRule::NumberAbove { min: 0.0, max: 1.0 }),
    ("min_p", FieldRule::Number { min: 0.0, max: 1.0 }),
    ("top_k", FieldRule::Integer { min: -1 }),
    ("presence_penalty", FieldRule::Number { min: -2.0, max: 2.0 }),
    ("frequency_penalty", FieldRule::Number { min: -2.0, max: 2.0 }),
    (
        "repetition_penalty",
        FieldRule::NumberAbove {
            min: 0.0,
            max: f64::MAX,
        },
    ),
    ("seed", FieldRule::Integer { min: i64::MIN }),
    ("min_tokens", FieldRule::Integer { min: 0 }),
    ("top_logprobs", FieldRule::Integer { min: 0 }),
    ("stop", FieldRule::Texts),
    ("ignore_eos", FieldRule::Bool),
    ("skip_special_tokens", FieldRule::Bool),
    ("echo", FieldRule::Bool),
    ("user", FieldRule::Text),
];

/// A 400 in OpenAI's shape naming the first sampling field of the wrong type or range.
fn check_sampling_fields(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    for &(field, rule) in SAMPLING_FIELDS {
        let Some(value) = obj.get(field).filter(|v| !v.is_null()) else {
            continue;
        };
        let number = value.as_f64();
        let (ok, expected) = match rule {
            FieldRule::Number { min, max } => (
                number.is_some_and(|n| (min..=max).contains(&n)),
                match max {
                    f64::MAX => format!("a number of at least {min}"),
                    _ => format!("a number from {min} to {max}"),
                },
            ),
            FieldRule::NumberAbove { min, max } => (
                number.is_some_and(|n| n > min && n <= max),
                match max {
                    f64::MAX => format!("a number above {min}"),
                    _ => format!("a number above {min} and at most {max}"),
                },
            ),
            FieldRule::Integer { min } => (
                value.as_i64().is_some_and(|n| n >= min),
                if min == i64::MIN {
                    "an integer".to_owned()
                } else {
                    format!("an integer of at least {min}")
                },
            ),
            FieldRule::Bool => (value.is_boolean(), "a boolean".to_owned()),
            FieldRule::Text => (value.is_string(), "a string".to_owned()),
            FieldRule::Texts => (
                value.is_string() || value.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
                "a string or a list of strings".to_owned(),
            ),
        };
        if !ok {
            return Err(ApiError::bad_request(
                field,
                format!("`{field}` must be {expected}, not {value}"),
            ));
        }
    }
    Ok(())
}

fn too_long(tokens: usize, max: usize) -> ApiError {
    ApiError {
        code: "context_length_exceeded",
        ..ApiError::bad_request(
            "prompt",
            format!("the prompt has {tokens} tokens; at most {max} are accepted"),
        )
    }
}

fn encode(
    model: &Model,
    text: &str,
    max_prompt_tokens: usize,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    // A byte can never be more than one token's worth of text... but a token can be less than a
    // byte's; refuse text so long that tokenizing it would be wasted work first.
    if text.len() > max_prompt_tokens.saturating_mul(64) {
        return Err(too_long(text.len(), max_prompt_tokens));
    }
    model
        .encode(text)
        .map_err(|e| ApiError::bad_request(param, e.to_string()))
}

fn completion_prompt(prompt: Option<&Value>, model: &Model, max: usize) -> Result<Vec<u32>, ApiError> {
    let bad = |m: &str| ApiError::bad_request("prompt", m.to_owned());
    match prompt {
        None | Some(Value::Null) => Err(bad("`prompt` is required")),
        Some(Value::String(s)) => encode(model, s, max, "prompt"),
        Some(Value::Array(items)) => match items.first() {
            None => Err(bad("`prompt` is empty")),
            Some(Value::Number(_)) => token_ids(items, max),
            Some(first) if items.len() == 1 => match first {
                Value::String(s) => encode(model, s, max, "prompt"),
                Value::Array(ids) => token_ids(ids, max),
                _ => Err(bad(
                    "`prompt` must be a string, a list of token ids, or a list of one of those",
                )),
            },
            Some(_) => Err(bad("batched prompts (several in one request) are not supported")),
        },
        Some(_) => Err(bad("`prompt` must be a string or a list of token ids")),
    }
}

fn token_ids(items: &[Value], max: usize) -> Result<Vec<u32>, ApiError> {
    if items.len() > max {
        return Err(too_long(items.len(), max));
    }
    items
        .iter()
        .map(|v| {
            v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
                ApiError::bad_request(
                    "prompt",
                    format!("token id {v} is not an integer from 0 to 2^32-1"),
                )
            })
        })
        .collect()
}

fn chat_prompt(
    messages: Option<&Value>,
    add_generation_prompt: Option<&Value>,
    model: &Model,
    max: usize,
) -> Result<Vec<u32>, ApiError> {
    let bad = |m: String| ApiError::bad_request("messages", m);
    let Some(Value::Array(messages)) = messages else {
        return Err(bad("`messages` must be a list of messages".to_owned()));
    };
    if messages.is_empty() {
        return Err(bad("`messages` is empty".to_owned()));
    }
    let mut flat = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(obj) = m else {
            return Err(bad(format!("messages[{i}] is not an object")));
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(bad(format!("messages[{i}].role must be a string")));
        }
        let content = match obj.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (
                        part.get("type").and_then(Value::as_str),
                        part.get("text").and_then(Value::as_str),
                    ) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(bad(format!(
                                "messages[{i}].content[{j}]: only text parts are supported"
                            )));
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )));
            }
        };
        let mut obj = obj.clone();
        obj.insert("content".to_owned(), Value::String(content));
        flat.push(Value::Object(obj));
    }
    let add = add_generation_prompt.and_then(Value::as_bool).unwrap_or(true);
    let text = model
        .render_chat(&Value::Array(flat), add)
        .map_err(|e| bad(e.to_string()))?;
    encode(model, &text, max, "messages")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_fields_of_the_wrong_type_or_range_are_refused_by_name() {
        use serde_json::json;
        let model = Model::tiny().unwrap();
        // (field, value, accepted)
        let table = [
            ("temperature", json!("hot"), false),
            ("temperature", json!(-0.5), false),
            ("temperature", json!(0.7), true),
            ("temperature", json!(null), true),
            ("top_p", json!(0), false),
            ("top_p", json!(1), true),
            ("top_p", json!(1.5), false),
            ("top_k", json!(-1), true),
            ("top_k", json!(2.5), false),
            ("presence_penalty", json!(2.5), false),
            ("frequency_penalty", json!(-2), true),
            ("repetition_penalty", json!(0), false),
            ("seed", json!(-7), true),
            ("seed", json!("7"), false),
            ("min_tokens", json!(-1), false),
            ("stop", json!(["a", "b"]), true),
            ("stop", json!(["a", 1]), false),
            ("stop", json!("."), true),
            ("echo", json!(1), false),
            ("user", json!(3), false),
        ];
        for (field, value, accepted) in table {
            let body = json!({"prompt": "hi", field: value});
            let got = parse(
                Endpoint::Completions,
                &serde_json::to_vec(&body).unwrap(),
                &model,
                100,
            );
            match got {
                Ok(_) => assert!(accepted, "{field} = {value} was accepted"),
                Err(e) => {
                    assert!(!accepted, "{field} = {value}: {}", e.message);
                    assert_eq!((e.status, e.param), (StatusCode::BAD_REQUEST, Some(field)));
                    assert!(e.message.contains(field), "{}", e.message);
                }
            }
        }
    }

    #[test]
    fn prompts_in_every_form_and_bad_input_named() {
        let model = Model::tiny().unwrap();
        let ok = |e, body: &str| parse(e, body.as_bytes(), &model, 100).unwrap();
        assert_eq!(
            ok(Endpoint::Completions, r#"{"prompt":"ab"}"#).tokens,
            vec![97, 98]
        );
        assert_eq!(
            ok(Endpoint::Completions, r#"{"prompt":["ab"]}"#).tokens,
            vec![97, 98]
        );
        assert_eq!(
            ok(Endpoint::Completions, r#"{"prompt":[5,6]}"#).tokens,
            vec![5, 6]
        );
        assert_eq!(ok(Endpoint::Completions, r#"{"prompt":[[7]]}"#).tokens, vec![7]);
        let chat = ok(
            Endpoint::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true}"#,
        );
        assert!(chat.stream);
        assert_eq!(chat.tokens[0], 257);
        let cases: &[(Endpoint, &str, &str)] = &[
            (Endpoint::Completions, "{", "body"),
            (Endpoint::Completions, "[1]", "body"),
            (Endpoint::Completions, "{}", "prompt"),
            (Endpoint::Completions, r#"{"prompt":""}"#, "prompt"),
            (Endpoint::Completions, r#"{"prompt":[-1]}"#, "prompt"),
            (Endpoint::Completions, r#"{"prompt":["a","b"]}"#, "prompt"),
            (
                Endpoint::Completions,
                r#"{"prompt":"a","stream":"yes"}"#,
                "stream",
            ),
            (
                Endpoint::Completions,
                r#"{"prompt":"a","max_tokens":-3}"#,
                "max_tokens",
            ),
            (Endpoint::Completions, r#"{"prompt":"a","n":2}"#, "n"),
            (Endpoint::Chat, r#"{"messages":[]}"#, "messages"),
            (Endpoint::Chat, r#"{"messages":[{"content":"x"}]}"#, "messages"),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "messages",
            ),
        ];
        for (e, body, param) in cases {
            let err = parse(*e, body.as_bytes(), &model, 100).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(err.param, Some(*param), "{body}: {}", err.message);
        }
        let long = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(101));
        let err = parse(Endpoint::Completions, long.as_bytes(), &model, 100).unwrap_err();
        assert_eq!(err.code, "context_length_exceeded");
    }
}
