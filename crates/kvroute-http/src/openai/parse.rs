//! Parsing a generation request: its prompt in each form, its flags, and the fields only the
//! proxy may set.

use serde_json::{Map, Value};

use crate::chat_template::ChatOptions;
use crate::model::Model;

use super::{
    ApiError, Endpoint, KvCacheReport, Length, chat, engine_tokens_with_turn, too_long, validate_fields,
};
use crate::prefix_cache::Turn;

/// A prompt as the request gives it, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A completion's text.
    Text(String),
    /// A completion's token ids: the engine takes them as they are (no special token added).
    TokenIds(Vec<u32>),
    /// A chat conversation, each message's content flattened to a string.
    Chat {
        /// The messages (OpenAI's shape, content as a string; tool calls' arguments as objects,
        /// as vLLM gives them to the template).
        messages: Value,
        /// What else the template is given: `add_generation_prompt` (true unless the request
        /// says otherwise), `continue_final_message`, `tools`, `documents`,
        /// `chat_template_kwargs` (boxed: most prompts have none of it).
        options: Box<ChatOptions>,
    },
}

/// vLLM's `truncate_prompt_tokens` and `truncation_side` of a request: the prompt is cut to
/// its last (or first) tokens before its length is checked, so a prompt longer than the context
/// is taken. See [`truncated_tokens`](super::truncated_tokens) for vLLM's rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncation {
    /// How many tokens to keep.
    pub keep: Keep,
    /// `truncation_side`, if the request names one; otherwise the tokenizer's side (the left,
    /// for a generation model) through the tokenizer's own truncation.
    pub side: Option<Side>,
}

/// How many of a prompt's tokens [`Truncation`] keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Keep {
    /// A number of tokens (`0` keeps none, and the empty prompt is refused).
    Tokens(usize),
    /// `-1`: as many as the context holds, one less when the request reserves output tokens
    /// (vLLM's `TokenizeParams.max_truncation_tokens`).
    Context {
        /// Whether the request's `max_tokens` (or `max_completion_tokens`), as vLLM reads it,
        /// is not zero.
        reserves_output: bool,
    },
}

impl Keep {
    /// The tokens kept in a context of `context` tokens.
    pub fn tokens(self, context: usize) -> usize {
        match self {
            Keep::Tokens(n) => n,
            Keep::Context { reserves_output } => context.saturating_sub(usize::from(reserves_output)),
        }
    }
}

/// Which end of the prompt [`Truncation`] cuts off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Keep the last tokens.
    Left,
    /// Keep the first tokens.
    Right,
}

/// What the proxy and the mocks need of a generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Parsed {
    /// Whether the response streams (SSE).
    pub stream: bool,
    /// Whether a streamed response ends with a usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Whether the body has a `stream_options` field (`null` included).
    pub stream_options: bool,
    /// The prompt's token ids (chat: the rendered conversation's).
    pub tokens: Vec<u32>,
    /// The prompt as the request gave it.
    pub prompt: Prompt,
    /// The request's `add_special_tokens`, if it named one.
    pub add_special_tokens: Option<bool>,
    /// The request's truncation, if it asks for one: [`Parsed::tokens`] are already cut.
    pub truncation: Option<Truncation>,
    /// A chat prompt's place in the model's conversation cache, when its tokens went through
    /// it ([`engine_tokens_with_turn`]): the block hashes kept for the cached prefix they
    /// continue, and where to keep theirs.
    pub turn: Option<Turn>,
    /// Whether a completion asks for its prompt back (`echo`).
    pub echo: bool,
    /// `max_tokens` (or `max_completion_tokens`), if given.
    pub max_tokens: Option<u32>,
    /// The model named.
    pub model: Option<String>,
    /// vLLM's `cache_salt`, which namespaces the prefix cache.
    pub cache_salt: Option<String>,
    /// vLLM's `priority`, if the body has one (lower is served first; an engine without
    /// priority scheduling refuses a non-zero one).
    pub priority: Option<i32>,
    /// Those of [`INTERNAL_FIELDS`] the body has: the proxy strips them ([`engine_body`](super::engine_body)); an
    /// engine reads them.
    pub internal_fields: Vec<&'static str>,
    /// Those of [`INTERNAL_FIELDS`] the body's `vllm_xargs` has: vLLM copies `vllm_xargs` into a
    /// request's extra arguments, where its KV connector finds `kv_transfer_params` when the
    /// top-level field is absent, so they are stripped there too.
    pub internal_xargs: Vec<&'static str>,
    /// vLLM's KV-event report mode the request asks for (`vllm_xargs.kv_cache_report_mode`),
    /// if it names one: the proxy strips it ([`engine_body`](super::engine_body)) and sets its own; an engine
    /// follows it.
    pub kv_cache_report: Option<KvCacheReport>,
}

impl Parsed {
    /// Whether the client's stream asked for no usage chunk, so that the proxy asks for one
    /// ([`engine_body`](super::engine_body)) and takes it out of the client's stream again.
    pub fn usage_requested_for_client(&self) -> bool {
        self.stream && !self.include_usage
    }
}

/// The refusal of a prompt truncated to no token (`truncate_prompt_tokens` 0), in vLLM 0.32's
/// words; vLLM names no parameter, the parser names `truncate_prompt_tokens`.
pub const TRUNCATED_TO_NOTHING: &str = "The decoder prompt cannot be empty";

/// Fields of a request body that only kvroute's proxy may set, in the flows it runs: vLLM's
/// `kv_transfer_params` (a client's could make an engine import KV from a host it names) and
/// SGLang's bootstrap fields (a client's could make an SGLang engine pull KV from a host it
/// names). Not SGLang's `data_parallel_rank`: vLLM reads no such field (it passes untouched, as
/// `tests/dp_ranks.rs` checks), and the flow to an SGLang worker of several ranks replaces a
/// client's with the router's.
pub const INTERNAL_FIELDS: &[&str] = &[
    "kv_transfer_params",
    "ec_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
];

/// Parses a request body for `endpoint`, tokenizing as the engine does
/// ([`engine_tokens_with_turn`]) with `model`. Prompts longer than `max_prompt_tokens` are
/// refused.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    model: &Model,
    max_prompt_tokens: usize,
) -> Result<Parsed, ApiError> {
    let mut turn = None;
    let parsed = parse_with(
        endpoint,
        body,
        max_prompt_tokens,
        |prompt, special, truncation| {
            let (tokens, found) =
                engine_tokens_with_turn(model, prompt, special, truncation, max_prompt_tokens)?;
            turn = found;
            Ok(tokens)
        },
    )?;
    Ok(Parsed { turn, ..parsed })
}

/// Parses a request body for `endpoint` and tokenizes its prompt with `tokenize` (given the
/// prompt, the request's `add_special_tokens` and its truncation, which `tokenize` applies).
/// Every field is checked first ([`validate_fields`]); prompts longer than `max_prompt_tokens`
/// (after truncation) are refused.
pub fn parse_with(
    endpoint: Endpoint,
    body: &[u8],
    max_prompt_tokens: usize,
    tokenize: impl FnOnce(&Prompt, Option<bool>, Option<Truncation>) -> Result<Vec<u32>, ApiError>,
) -> Result<Parsed, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request("body", format!("the body is not valid JSON: {e}")))?;
    let Value::Object(mut obj) = value else {
        return Err(ApiError::bad_request("body", "the body must be a JSON object"));
    };
    validate_fields(endpoint, &obj)?;
    // A chat's messages are taken out of the body (and flattened in place, not copied).
    let messages = match endpoint {
        Endpoint::Chat => obj.remove("messages"),
        Endpoint::Completions => None,
    };
    let obj = obj;
    let flag = |name: &str| obj.get(name).and_then(Value::as_bool);
    let stream = flag("stream").unwrap_or(false);
    let stream_options = obj.contains_key("stream_options");
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // vLLM 0.32 (`chat_completion/serving.py`): `max_completion_tokens` if it is not null, else
    // `max_tokens`.
    let max_tokens = match obj
        .get("max_completion_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| obj.get("max_tokens"))
    {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
            ApiError::bad_request("max_tokens", "`max_tokens` must be a non-negative integer")
        })?),
    };
    if let Some(n) = obj.get("n").filter(|n| !n.is_null())
        && n.as_u64() != Some(1)
    {
        return Err(ApiError::bad_request("n", "only n = 1 is supported"));
    }
    let model_name = obj.get("model").and_then(Value::as_str).map(str::to_owned);
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
    let priority = match obj.get("priority") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_i64().and_then(|p| i32::try_from(p).ok()).ok_or_else(|| {
            ApiError::bad_request("priority", "`priority` must be an integer (a 32-bit one)")
        })?),
    };
    let truncation = truncation(endpoint, &obj)?;
    // Token ids past the limit are refused unread, unless they are to be truncated.
    let ids_limit = if truncation.is_some() {
        usize::MAX
    } else {
        max_prompt_tokens
    };
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(obj.get("prompt"), ids_limit)?,
        Endpoint::Chat => chat::chat_prompt(messages, chat::chat_options(&obj)?)?,
    };
    let add_special_tokens = flag("add_special_tokens");
    let tokens = tokenize(&prompt, add_special_tokens, truncation)?;
    if tokens.is_empty() {
        if truncation.is_some() {
            // Truncated to nothing (`truncate_prompt_tokens` 0): vLLM 0.32's words.
            return Err(ApiError::bad_request(
                "truncate_prompt_tokens",
                TRUNCATED_TO_NOTHING,
            ));
        }
        return Err(ApiError::bad_request("prompt", "the prompt is empty"));
    }
    if tokens.len() > max_prompt_tokens {
        let param = match endpoint {
            Endpoint::Completions => "prompt",
            Endpoint::Chat => "messages",
        };
        return Err(too_long(param, Length::Tokens(tokens.len()), max_prompt_tokens));
    }
    let internal_fields = INTERNAL_FIELDS
        .iter()
        .copied()
        .filter(|f| obj.contains_key(*f))
        .collect();
    let internal_xargs = match obj.get("vllm_xargs") {
        Some(Value::Object(xargs)) => INTERNAL_FIELDS
            .iter()
            .copied()
            .filter(|f| xargs.contains_key(*f))
            .collect(),
        _ => Vec::new(),
    };
    let kv_cache_report = KvCacheReport::from_xargs(obj.get("vllm_xargs"));
    Ok(Parsed {
        stream,
        include_usage,
        stream_options,
        tokens,
        prompt,
        add_special_tokens,
        truncation,
        turn: None,
        echo: flag("echo").unwrap_or(false),
        max_tokens,
        model: model_name,
        cache_salt,
        priority,
        internal_fields,
        internal_xargs,
        kv_cache_report,
    })
}

/// The request's `truncate_prompt_tokens` and `truncation_side` (their types are checked by
/// [`validate_fields`]), as vLLM 0.32 reads them (`completion/protocol.py` and
/// `chat_completion/protocol.py`, `build_tok_params`): `-1` keeps what the context holds, less
/// one token when the request's output budget is not zero: a completion's `max_tokens`
/// (16 when left out, none when `null`), a chat's `max_completion_tokens` or else `max_tokens`
/// (none when left out).
fn truncation(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<Option<Truncation>, ApiError> {
    let side = match obj.get("truncation_side") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "left" => Some(Side::Left),
        Some(Value::String(s)) if s == "right" => Some(Side::Right),
        Some(_) => {
            return Err(ApiError::bad_request(
                "truncation_side",
                "`truncation_side` must be 'left' or 'right'",
            ));
        }
    };
    // Past `i64::MAX` (which the field's rule lets through as an integer): more than any prompt.
    let count = obj
        .get("truncate_prompt_tokens")
        .and_then(|v| v.as_i64().or_else(|| v.as_u64().map(|_| i64::MAX)));
    let keep = match count {
        None => return Ok(None),
        Some(-1) => {
            // A field given (`null` is none: 0); left out, the request model's default.
            let given = |name: &str| obj.get(name).map(|v| v.as_u64().unwrap_or(0));
            let output = match endpoint {
                Endpoint::Completions => given("max_tokens").unwrap_or(16),
                Endpoint::Chat => match obj.get("max_completion_tokens") {
                    Some(v) if !v.is_null() => v.as_u64().unwrap_or(0),
                    _ => given("max_tokens").unwrap_or(0),
                },
            };
            Keep::Context {
                reserves_output: output != 0,
            }
        }
        // A huge count keeps everything, as a count past the prompt's length does.
        Some(n) => Keep::Tokens(usize::try_from(n).unwrap_or(usize::MAX)),
    };
    Ok(Some(Truncation { keep, side }))
}

fn completion_prompt(prompt: Option<&Value>, max: usize) -> Result<Prompt, ApiError> {
    let bad = |m: &str| ApiError::bad_request("prompt", m.to_owned());
    match prompt {
        None | Some(Value::Null) => Err(bad("`prompt` is required")),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.first() {
            None => Err(bad("`prompt` is empty")),
            Some(Value::Number(_)) => token_ids(items, max).map(Prompt::TokenIds),
            Some(first) if items.len() == 1 => match first {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                Value::Array(ids) => token_ids(ids, max).map(Prompt::TokenIds),
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
        return Err(too_long("prompt", Length::Tokens(items.len()), max));
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
