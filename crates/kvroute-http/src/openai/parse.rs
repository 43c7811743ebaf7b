//! Parsing a generation request: its prompt in each form, its flags, and the fields only the
//! proxy may set.

use serde_json::{Map, Value};

use crate::chat_template::ChatOptions;
use crate::model::Model;

use super::{ApiError, Endpoint, KvCacheReport, Length, engine_tokens, too_long, validate_fields};

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
    /// Whether a completion asks for its prompt back (`echo`).
    pub echo: bool,
    /// `max_tokens` (or `max_completion_tokens`), if given.
    pub max_tokens: Option<u32>,
    /// The model named.
    pub model: Option<String>,
    /// vLLM's `cache_salt`, which namespaces the prefix cache.
    pub cache_salt: Option<String>,
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

/// Parses a request body for `endpoint`, tokenizing as the engine does ([`engine_tokens`])
/// with `model`. Prompts longer than `max_prompt_tokens` are refused.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    model: &Model,
    max_prompt_tokens: usize,
) -> Result<Parsed, ApiError> {
    parse_with(
        endpoint,
        body,
        max_prompt_tokens,
        |prompt, special, truncation| engine_tokens(model, prompt, special, truncation, max_prompt_tokens),
    )
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
    let truncation = truncation(endpoint, &obj)?;
    // Token ids past the limit are refused unread, unless they are to be truncated.
    let ids_limit = if truncation.is_some() {
        usize::MAX
    } else {
        max_prompt_tokens
    };
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(obj.get("prompt"), ids_limit)?,
        Endpoint::Chat => chat_prompt(messages, chat_options(&obj)?)?,
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
        echo: flag("echo").unwrap_or(false),
        max_tokens,
        model: model_name,
        cache_salt,
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

/// The chat prompt of a body's `messages` (taken out of it): each message's content flattened
/// to a string in place.
/// What a chat request gives its template besides its messages, as vLLM 0.32 hands it to
/// `apply_chat_template` (`ChatCompletionRequest.build_chat_params`, `online_renderer.py`):
/// `chat_template_kwargs`, overridden by the request's own `add_generation_prompt`,
/// `continue_final_message`, `documents` and `reasoning_effort` (when given); `tools` as their
/// request model writes them back (`ChatCompletionToolsParam.model_dump()`).
fn chat_options(obj: &Map<String, Value>) -> Result<ChatOptions, ApiError> {
    let flag = |name: &str| obj.get(name).and_then(Value::as_bool);
    let add_generation_prompt = flag("add_generation_prompt").unwrap_or(true);
    let continue_final_message = flag("continue_final_message").unwrap_or(false);
    if add_generation_prompt && continue_final_message {
        return Err(ApiError::bad_request(
            "continue_final_message",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    let mut kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(kwargs)) => kwargs.clone(),
        Some(_) => {
            return Err(ApiError::bad_request(
                "chat_template_kwargs",
                "`chat_template_kwargs` must be an object",
            ));
        }
    };
    // vLLM passes `reasoning_effort` to the template, and as `enable_thinking` (unless the
    // kwargs set it) for templates that wait to be asked.
    if let Some(effort) = obj.get("reasoning_effort").filter(|v| !v.is_null()) {
        if !kwargs.contains_key("enable_thinking") {
            kwargs.insert("enable_thinking".to_owned(), Value::Bool(effort != "none"));
        }
        kwargs.insert("reasoning_effort".to_owned(), effort.clone());
    }
    let documents = match obj.get("documents") {
        None | Some(Value::Null) => kwargs.remove("documents"),
        Some(docs @ Value::Array(_)) => Some(docs.clone()),
        Some(_) => {
            return Err(ApiError::bad_request("documents", "`documents` must be a list"));
        }
    };
    let tools = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(Value::Array(tools.iter().map(tool).collect::<Result<_, _>>()?)),
        Some(_) => return Err(ApiError::bad_request("tools", "`tools` must be a list")),
    };
    Ok(ChatOptions {
        add_generation_prompt,
        continue_final_message,
        tools,
        documents,
        kwargs,
    })
}

/// A tool as vLLM's request model writes it back for the template
/// (`ChatCompletionToolsParam.model_dump()`, checked on vLLM 0.32): `type`, then `function`
/// with `name`, `description` and `parameters` (`null` when left out), then `strict` and
/// `defer_loading` only when given; other keys dropped. A `defer_loading` on the tool is
/// copied into its function when the function has none, and kept on the tool.
fn tool(given: &Value) -> Result<Value, ApiError> {
    let bad = |m: &str| ApiError::bad_request("tools", m.to_owned());
    let function = given
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("each of `tools` must have a `function` object"))?;
    let name = function
        .get("name")
        .filter(|n| n.is_string())
        .ok_or_else(|| bad("each tool's function must have a `name` string"))?;
    let given_or_null = |key: &str| function.get(key).cloned().unwrap_or(Value::Null);
    let outer_defer = given.get("defer_loading").filter(|v| !v.is_null());
    let mut f = Map::new();
    f.insert("name".to_owned(), name.clone());
    f.insert("description".to_owned(), given_or_null("description"));
    f.insert("parameters".to_owned(), given_or_null("parameters"));
    if let Some(strict) = function.get("strict").filter(|v| !v.is_null()) {
        f.insert("strict".to_owned(), strict.clone());
    }
    if let Some(defer) = function
        .get("defer_loading")
        .filter(|v| !v.is_null())
        .or(outer_defer)
    {
        f.insert("defer_loading".to_owned(), defer.clone());
    }
    let mut t = Map::new();
    t.insert("type".to_owned(), Value::from("function"));
    t.insert("function".to_owned(), Value::Object(f));
    if let Some(defer) = outer_defer {
        t.insert("defer_loading".to_owned(), defer.clone());
    }
    Ok(Value::Object(t))
}

/// An assistant message's tool calls as vLLM gives them to the template: each with its keys in
/// the order of OpenAI's request model (`id`, `function`, `type`, then any others, as pydantic
/// validates them), the function's `arguments` before its `name` and parsed from the JSON
/// string OpenAI's clients send (`_postprocess_messages`: not JSON, or not an object, is `{}`).
fn tool_calls(calls: Vec<Value>) -> Result<Value, ApiError> {
    let bad = || {
        ApiError::bad_request(
            "messages",
            "chat completions only support assistant tool_calls of type 'function'.",
        )
    };
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let Value::Object(mut call) = call else {
            return Err(bad());
        };
        if call.get("type").is_some_and(|t| t != "function") {
            return Err(bad());
        }
        let Some(Value::Object(mut function)) = call.remove("function") else {
            return Err(bad());
        };
        let arguments = match function.remove("arguments") {
            Some(Value::Object(a)) => Value::Object(a),
            Some(Value::String(s)) => match serde_json::from_str(&s) {
                Ok(Value::Object(a)) => Value::Object(a),
                _ => Value::Object(Map::new()),
            },
            _ => Value::Object(Map::new()),
        };
        let mut f = Map::new();
        f.insert("arguments".to_owned(), arguments);
        f.extend(function.remove("name").map(|n| ("name".to_owned(), n)));
        f.extend(function);
        let mut c = Map::new();
        c.extend(call.remove("id").map(|id| ("id".to_owned(), id)));
        c.insert("function".to_owned(), Value::Object(f));
        c.extend(call.remove("type").map(|t| ("type".to_owned(), t)));
        c.extend(call);
        out.push(Value::Object(c));
    }
    Ok(Value::Array(out))
}

/// The conversation as vLLM 0.32 gives it to the template (`renderers/chat_utils.py`,
/// `_parse_chat_message_content`; seen through its `/tokenize`): each message rebuilt as `role`,
/// `content` (`null` as `""`, text parts joined by newlines), then an assistant's `tool_calls`
/// ([`tool_calls`]) and `reasoning` (twice, as `reasoning` and `reasoning_content`), a tool's
/// `tool_call_id`, and a string `name` and `task`; other keys are dropped. Values are moved,
/// not copied.
fn chat_prompt(messages: Option<Value>, options: ChatOptions) -> Result<Prompt, ApiError> {
    let bad = |m: String| ApiError::bad_request("messages", m);
    let Some(Value::Array(mut messages)) = messages else {
        return Err(bad("`messages` must be a list of messages".to_owned()));
    };
    if messages.is_empty() {
        return Err(bad("`messages` is empty".to_owned()));
    }
    for (i, m) in messages.iter_mut().enumerate() {
        let Value::Object(given) = m else {
            return Err(bad(format!("messages[{i}] is not an object")));
        };
        let mut given = std::mem::take(given);
        let Some(Value::String(role)) = given.remove("role") else {
            return Err(bad(format!("messages[{i}].role must be a string")));
        };
        let content = match given.remove("content") {
            Some(Value::String(text)) => text,
            None | Some(Value::Null) => String::new(),
            Some(Value::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, part) in parts.into_iter().enumerate() {
                    match part {
                        Value::Object(mut p) if p.get("type").and_then(Value::as_str) == Some("text") => {
                            match p.remove("text") {
                                Some(Value::String(t)) => texts.push(t),
                                _ => return Err(bad(format!("messages[{i}].content[{j}] has no text"))),
                            }
                        }
                        _ => {
                            return Err(bad(format!(
                                "messages[{i}].content[{j}]: only text parts are supported"
                            )));
                        }
                    }
                }
                texts.join("\n")
            }
            Some(_) => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )));
            }
        };
        let mut out = Map::new();
        let role_is = |r: &str| role == r;
        let (assistant, tool) = (role_is("assistant"), role_is("tool"));
        out.insert("role".to_owned(), Value::String(role));
        out.insert("content".to_owned(), Value::String(content));
        if assistant {
            match given.remove("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) if calls.is_empty() => {}
                Some(Value::Array(calls)) => {
                    out.insert("tool_calls".to_owned(), tool_calls(calls)?);
                }
                Some(_) => return Err(bad(format!("messages[{i}].tool_calls must be a list"))),
            }
            if let Some(reasoning) = given.remove("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning".to_owned(), reasoning.clone());
                out.insert("reasoning_content".to_owned(), reasoning);
            }
        }
        if tool && let Some(id) = given.remove("tool_call_id") {
            out.insert("tool_call_id".to_owned(), id);
        }
        for key in ["name", "task"] {
            if let Some(v @ Value::String(_)) = given.remove(key) {
                out.insert(key.to_owned(), v);
            }
        }
        *m = Value::Object(out);
    }
    Ok(Prompt::Chat {
        messages: Value::Array(messages),
        options: Box::new(options),
    })
}
