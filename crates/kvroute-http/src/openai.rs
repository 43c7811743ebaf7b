//! The OpenAI request side both the proxy and the mock workers read: which endpoint, whether it
//! streams, and the prompt as token ids; the OpenAI error shape for bad input; and the
//! response shapes, typed once ([`types`]).
//!
//! Bodies are read as loose JSON (unknown fields are the engine's business and pass through the
//! proxy untouched); only the fields needed here are checked, each with a message naming it.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};

use crate::model::{Model, SpecialTokens};
use crate::prefix_cache::Encoded;

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

/// A prompt as the request gives it, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// A completion's text.
    Text(String),
    /// A completion's token ids: the engine takes them as they are (no special token added).
    TokenIds(Vec<u32>),
    /// A chat conversation, each message's content flattened to a string.
    Chat {
        /// The messages (OpenAI's shape, content as a string).
        messages: Value,
        /// `add_generation_prompt` (true unless the request says otherwise).
        add_generation_prompt: bool,
    },
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
    /// Whether a completion asks for its prompt back (`echo`).
    pub echo: bool,
    /// `max_tokens` (or `max_completion_tokens`), if given.
    pub max_tokens: Option<u32>,
    /// The model named.
    pub model: Option<String>,
    /// vLLM's `cache_salt`, which namespaces the prefix cache.
    pub cache_salt: Option<String>,
    /// Those of [`INTERNAL_FIELDS`] the body has: the proxy strips them ([`engine_body`]); an
    /// engine reads them.
    pub internal_fields: Vec<&'static str>,
    /// Those of [`INTERNAL_FIELDS`] the body's `vllm_xargs` has: vLLM copies `vllm_xargs` into a
    /// request's extra arguments, where its KV connector finds `kv_transfer_params` when the
    /// top-level field is absent, so they are stripped there too.
    pub internal_xargs: Vec<&'static str>,
    /// vLLM's KV-event report mode the request asks for (`vllm_xargs.kv_cache_report_mode`),
    /// if it names one: the proxy strips it ([`engine_body`]) and sets its own; an engine
    /// follows it.
    pub kv_cache_report: Option<KvCacheReport>,
}

/// What vLLM's engine publishes of a request's prefix-cache hits, asked for per request in
/// `vllm_xargs` ([`KV_CACHE_REPORT_MODE`]). vLLM (0.32, `Request.kv_cache_report_mode`) reads
/// the key from the request's extra arguments, default `incremental`; any value but `full`
/// means incremental.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheReport {
    /// Only blocks newly cached are announced (`BlockStored`): vLLM's default.
    #[default]
    Incremental,
    /// The blocks a request reuses from the prefix cache are announced again, as one
    /// `BlockStored` of the whole hit from the root, each time the request's prefix is looked
    /// up (`KVCacheManager.get_computed_blocks`).
    Full,
}

impl KvCacheReport {
    /// The value vLLM reads: `full` for [`KvCacheReport::Full`].
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Incremental => "incremental",
            Self::Full => "full",
        }
    }

    /// The mode `vllm_xargs` (a request's, if it has them) asks for, as vLLM reads it: `full`
    /// is full, any other value (or none) incremental. `None` when the key is absent.
    pub fn from_xargs(xargs: Option<&Value>) -> Option<Self> {
        let value = xargs?.get(KV_CACHE_REPORT_MODE)?;
        Some(match value.as_str() {
            Some("full") => Self::Full,
            _ => Self::Incremental,
        })
    }
}

/// The `vllm_xargs` key of vLLM's per-request KV-event report mode ([`KvCacheReport`]). The
/// only `vllm_xargs` key the proxy reads or writes: the others are the client's business.
pub const KV_CACHE_REPORT_MODE: &str = "kv_cache_report_mode";

impl Parsed {
    /// Whether the client's stream asked for no usage chunk, so that the proxy asks for one
    /// ([`engine_body`]) and takes it out of the client's stream again.
    pub fn usage_requested_for_client(&self) -> bool {
        self.stream && !self.include_usage
    }
}

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
    parse_with(endpoint, body, max_prompt_tokens, |prompt, special| {
        engine_tokens(model, prompt, special, max_prompt_tokens)
    })
}

/// Parses a request body for `endpoint` and tokenizes its prompt with `tokenize` (given the
/// prompt and the request's `add_special_tokens`). Every field is checked first
/// ([`validate_fields`]); prompts longer than `max_prompt_tokens` are refused.
pub fn parse_with(
    endpoint: Endpoint,
    body: &[u8],
    max_prompt_tokens: usize,
    tokenize: impl FnOnce(&Prompt, Option<bool>) -> Result<Vec<u32>, ApiError>,
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
    let max_tokens = match obj.get("max_completion_tokens").or_else(|| obj.get("max_tokens")) {
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
    let prompt = match endpoint {
        Endpoint::Completions => completion_prompt(obj.get("prompt"), max_prompt_tokens)?,
        Endpoint::Chat => chat_prompt(messages, flag("add_generation_prompt"))?,
    };
    let add_special_tokens = flag("add_special_tokens");
    let tokens = tokenize(&prompt, add_special_tokens)?;
    if tokens.is_empty() {
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
        echo: flag("echo").unwrap_or(false),
        max_tokens,
        model: model_name,
        cache_salt,
        internal_fields,
        internal_xargs,
        kv_cache_report,
    })
}

/// The token ids an engine serving `model` runs for `prompt`, by vLLM's rule: a completion's
/// text is tokenized with the tokenizer's special tokens (a BOS) unless the request's
/// `add_special_tokens` is false; a chat's rendered conversation without them (the template
/// brings its own) unless it is true; token ids are taken as they are.
pub fn engine_tokens(
    model: &Model,
    prompt: &Prompt,
    add_special_tokens: Option<bool>,
    max_prompt_tokens: usize,
) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Text(text) => {
            let special = SpecialTokens::from_flag(add_special_tokens.unwrap_or(true));
            encode_text(model, text, special, max_prompt_tokens, "prompt")
        }
        Prompt::TokenIds(ids) => Ok(ids.clone()),
        Prompt::Chat {
            messages,
            add_generation_prompt,
        } => {
            let text = model
                .render_chat(messages, *add_generation_prompt)
                .map_err(|e| ApiError::bad_request("messages", e.to_string()))?;
            let special = SpecialTokens::from_flag(add_special_tokens.unwrap_or(false));
            if text.len() > max_prompt_tokens.saturating_mul(64) {
                return Err(too_long("messages", Length::Bytes(text.len()), max_prompt_tokens));
            }
            // Through the conversation cache: a follow-up turn tokenizes only its new text.
            match model.encode_chat(&text, special, max_prompt_tokens) {
                Ok((Encoded::Tokens(tokens), _)) => Ok(tokens),
                Ok((Encoded::TooLong(at_least), _)) => {
                    Err(too_long("messages", Length::AtLeast(at_least), max_prompt_tokens))
                }
                Err(e) => Err(ApiError::bad_request("messages", e.to_string())),
            }
        }
    }
}

/// The body the proxy sends the engine for a client's `body` (parsed as `parsed`), or `None`
/// when it is the client's as it came:
///
/// * [`INTERNAL_FIELDS`] are stripped. Stripped rather than refused: they mean nothing to the
///   client's request (text comes back either way), only to the flows kvroute runs, which set
///   their own (as they already replace a client's bootstrap fields and rank); a client built
///   for another gateway keeps working, and a hostile one steers nothing. Each strip is logged.
/// * a completion's text prompt is replaced by the token ids the router routed on (Dynamo's
///   design): the engine adds nothing to token ids, so routing and engine cannot disagree on
///   the prompt's blocks. The answer is the same text. Not with `echo`, whose answer would show
///   the decoded ids instead of the client's text: that request keeps its text.
/// * a stream whose client did not ask for usage asks for it (`stream_options.include_usage`,
///   the client's other stream options kept): vLLM reports a stream's cached tokens only in its
///   final usage chunk, which the proxy then takes out of the client's stream
///   ([`Parsed::usage_requested_for_client`]).
///
/// * `report` is vLLM's KV-event report mode the proxy wants from the worker(s) it routed to
///   (`Full` while their cache view is rebuilt): set as `vllm_xargs.kv_cache_report_mode`,
///   merged into the client's `vllm_xargs`, whose other keys are kept. A client's own
///   `kv_cache_report_mode` is the proxy's to set: stripped (and the `vllm_xargs` it leaves
///   empty with it) when `report` is incremental.
///
/// One parse and one serialization, whatever of these applies; none when only a stream's
/// `stream_options` is to be added to a body that has none (spliced in).
pub fn engine_body(parsed: &Parsed, body: &[u8], report: KvCacheReport) -> Result<Option<Vec<u8>>, ApiError> {
    let replace_prompt = matches!(parsed.prompt, Prompt::Text(_)) && !parsed.echo;
    let ask_usage = parsed.usage_requested_for_client();
    let set_report = report == KvCacheReport::Full || parsed.kv_cache_report.is_some();
    let strip = !parsed.internal_fields.is_empty() || !parsed.internal_xargs.is_empty();
    if !strip && !replace_prompt && !ask_usage && !set_report {
        return Ok(None);
    }
    if !strip && !replace_prompt && !set_report && !parsed.stream_options {
        // Only `stream_options` to add, and the body has none: spliced in after the opening
        // brace (the body is an object with at least `stream`), so a big body is neither
        // parsed again nor serialized.
        if let Some(open) = body.iter().position(|b| !b.is_ascii_whitespace())
            && body[open] == b'{'
        {
            const USAGE: &[u8] = br#""stream_options":{"include_usage":true},"#;
            let mut out = Vec::with_capacity(body.len() + USAGE.len());
            out.extend_from_slice(&body[..=open]);
            out.extend_from_slice(USAGE);
            out.extend_from_slice(&body[open + 1..]);
            return Ok(Some(out));
        }
    }
    let mut obj = match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => obj,
        _ => return Err(ApiError::bad_request("body", "the body must be a JSON object")),
    };
    if !parsed.internal_fields.is_empty() {
        tracing::info!(fields = ?parsed.internal_fields, "stripped internal fields from a client's request");
        for field in &parsed.internal_fields {
            obj.remove(*field);
        }
    }
    if !parsed.internal_xargs.is_empty() {
        tracing::info!(fields = ?parsed.internal_xargs, "stripped internal fields from a client's vllm_xargs");
        if let Some(Value::Object(xargs)) = obj.get_mut("vllm_xargs") {
            for field in &parsed.internal_xargs {
                xargs.remove(*field);
            }
            if xargs.is_empty() {
                obj.remove("vllm_xargs");
            }
        }
    }
    if replace_prompt {
        obj.insert("prompt".to_owned(), Value::from(parsed.tokens.clone()));
    }
    if set_report {
        set_kv_cache_report(&mut obj, report);
    }
    if ask_usage {
        let options = obj
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if !options.is_object() {
            // `null`: the field rules let nothing else through.
            *options = Value::Object(Map::new());
        }
        if let Value::Object(options) = options {
            options.insert("include_usage".to_owned(), Value::Bool(true));
        }
    }
    serde_json::to_vec(&obj)
        .map(Some)
        .map_err(|e| ApiError::bad_request("body", e.to_string()))
}

/// Sets `obj`'s `vllm_xargs.kv_cache_report_mode` to `report` (`Full`), or takes it out
/// (`Incremental`, vLLM's default), keeping the client's other `vllm_xargs`.
fn set_kv_cache_report(obj: &mut Map<String, Value>, report: KvCacheReport) {
    match report {
        KvCacheReport::Full => {
            let xargs = obj
                .entry("vllm_xargs")
                .or_insert_with(|| Value::Object(Map::new()));
            if !xargs.is_object() {
                // `null`: the field rules let nothing else through.
                *xargs = Value::Object(Map::new());
            }
            if let Value::Object(xargs) = xargs {
                xargs.insert(KV_CACHE_REPORT_MODE.to_owned(), Value::from(report.as_str()));
            }
        }
        KvCacheReport::Incremental => {
            if let Some(Value::Object(xargs)) = obj.get_mut("vllm_xargs") {
                xargs.remove(KV_CACHE_REPORT_MODE);
                if xargs.is_empty() {
                    obj.remove("vllm_xargs");
                }
            }
        }
    }
}

/// How a standard sampling field may be given ([`FIELD_RULES`]). `null` is always accepted,
/// as leaving the field out.
#[derive(Clone, Copy, Debug)]
enum Rule {
    Bool,
    String,
    Object,
    /// A string or a list of strings.
    Stop,
    /// A number in `min..=max` (`min` excluded when `open_min`).
    Number {
        min: f64,
        max: f64,
        open_min: bool,
    },
    /// An integer in `min..=max`.
    Integer {
        min: i64,
        max: i64,
    },
}

/// The standard request fields checked by type and range, with vLLM's bounds where it has
/// them (so nothing an engine accepts is refused): `(name, rule, endpoint or None for both)`.
const FIELD_RULES: &[(&str, Rule, Option<Endpoint>)] = &[
    ("stream", Rule::Bool, None),
    ("stream_options", Rule::Object, None),
    // vLLM's extra arguments: an object (its values are the engine's to check).
    ("vllm_xargs", Rule::Object, None),
    ("model", Rule::String, None),
    (
        "temperature",
        Rule::Number {
            min: 0.0,
            max: f64::MAX,
            open_min: false,
        },
        None,
    ),
    (
        "top_p",
        Rule::Number {
            min: 0.0,
            max: 1.0,
            open_min: true,
        },
        None,
    ),
    (
        "min_p",
        Rule::Number {
            min: 0.0,
            max: 1.0,
            open_min: false,
        },
        None,
    ),
    (
        "top_k",
        Rule::Integer {
            min: -1,
            max: i64::MAX,
        },
        None,
    ),
    (
        "presence_penalty",
        Rule::Number {
            min: -2.0,
            max: 2.0,
            open_min: false,
        },
        None,
    ),
    (
        "frequency_penalty",
        Rule::Number {
            min: -2.0,
            max: 2.0,
            open_min: false,
        },
        None,
    ),
    (
        "repetition_penalty",
        Rule::Number {
            min: 0.0,
            max: f64::MAX,
            open_min: true,
        },
        None,
    ),
    (
        "max_tokens",
        Rule::Integer {
            min: 0,
            max: u32::MAX as i64,
        },
        None,
    ),
    (
        "max_completion_tokens",
        Rule::Integer {
            min: 0,
            max: u32::MAX as i64,
        },
        None,
    ),
    (
        "min_tokens",
        Rule::Integer {
            min: 0,
            max: u32::MAX as i64,
        },
        None,
    ),
    (
        "n",
        Rule::Integer {
            min: 1,
            max: i64::MAX,
        },
        None,
    ),
    (
        "best_of",
        Rule::Integer {
            min: 1,
            max: i64::MAX,
        },
        None,
    ),
    (
        "seed",
        Rule::Integer {
            min: i64::MIN,
            max: i64::MAX,
        },
        None,
    ),
    ("stop", Rule::Stop, None),
    ("logit_bias", Rule::Object, None),
    ("user", Rule::String, None),
    ("ignore_eos", Rule::Bool, None),
    ("skip_special_tokens", Rule::Bool, None),
    ("add_special_tokens", Rule::Bool, None),
    ("echo", Rule::Bool, Some(Endpoint::Completions)),
    ("suffix", Rule::String, Some(Endpoint::Completions)),
    (
        "logprobs",
        Rule::Integer {
            min: 0,
            max: i64::MAX,
        },
        Some(Endpoint::Completions),
    ),
    ("logprobs", Rule::Bool, Some(Endpoint::Chat)),
    (
        "top_logprobs",
        Rule::Integer { min: 0, max: 20 },
        Some(Endpoint::Chat),
    ),
    ("add_generation_prompt", Rule::Bool, Some(Endpoint::Chat)),
    ("continue_final_message", Rule::Bool, Some(Endpoint::Chat)),
];

/// Checks the standard fields of a request to `endpoint` by type and range: a 400 in OpenAI's
/// shape naming the first field at fault. Fields not listed are the engine's business.
pub fn validate_fields(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<(), ApiError> {
    for &(name, rule, only) in FIELD_RULES {
        if only.is_some_and(|e| e != endpoint) {
            continue;
        }
        let Some(value) = obj.get(name).filter(|v| !v.is_null()) else {
            continue;
        };
        let problem = match rule {
            Rule::Bool => (!value.is_boolean()).then(|| "must be a boolean".to_owned()),
            Rule::String => (!value.is_string()).then(|| "must be a string".to_owned()),
            Rule::Object => (!value.is_object()).then(|| "must be an object".to_owned()),
            Rule::Stop => match value {
                Value::String(_) => None,
                Value::Array(items) if items.iter().all(Value::is_string) => None,
                _ => Some("must be a string or a list of strings".to_owned()),
            },
            Rule::Number { min, max, open_min } => match value.as_f64() {
                None => Some("must be a number".to_owned()),
                Some(x) if x < min || (open_min && x == min) || x > max => {
                    let low = if open_min { "greater than" } else { "at least" };
                    Some(if max == f64::MAX {
                        format!("must be {low} {min}, not {x}")
                    } else {
                        format!("must be {low} {min} and at most {max}, not {x}")
                    })
                }
                Some(_) => None,
            },
            Rule::Integer { min, max } => match value.as_i64() {
                Some(x) if (min..=max).contains(&x) => None,
                _ if value.as_u64().is_some() && max == i64::MAX => None,
                _ if value.is_i64() || value.is_u64() => {
                    Some(format!("must be an integer from {min} to {max}, not {value}"))
                }
                _ => Some("must be an integer".to_owned()),
            },
        };
        if let Some(problem) = problem {
            return Err(ApiError::bad_request(name, format!("`{name}` {problem}")));
        }
    }
    Ok(())
}

/// What an over-long prompt was found to measure.
#[derive(Clone, Copy, Debug)]
enum Length {
    /// Its tokens.
    Tokens(usize),
    /// At least this many tokens (tokenizing stopped past the limit).
    AtLeast(usize),
    /// Its text's bytes, too many to tokenize.
    Bytes(usize),
}

/// The refusal of a prompt over `max` tokens: OpenAI's shape and code
/// (`context_length_exceeded`, naming `param`), in vLLM's words ("This model's maximum context
/// length is N tokens. However, your request has M input tokens.", the pattern clients read to
/// shorten a conversation).
fn too_long(param: &'static str, length: Length, max: usize) -> ApiError {
    let what = match param {
        "messages" => "messages",
        _ => "prompt",
    };
    let has = match length {
        Length::Tokens(n) => format!("your request has {n} input tokens"),
        Length::AtLeast(n) => format!("your request has at least {n} input tokens"),
        Length::Bytes(n) => format!(
            "your prompt has {n} bytes of text, more than the {} bytes that {max} input tokens can hold",
            max.saturating_mul(64)
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

/// The token ids of `text` (`special` tokens added or not); text so long it could not fit in
/// `max_prompt_tokens` is refused before any work, naming `param`.
pub fn encode_text(
    model: &Model,
    text: &str,
    special: SpecialTokens,
    max_prompt_tokens: usize,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    // A byte can never be more than one token's worth of text... but a token can be less than a
    // byte's; refuse text so long that tokenizing it would be wasted work first.
    if text.len() > max_prompt_tokens.saturating_mul(64) {
        return Err(too_long(param, Length::Bytes(text.len()), max_prompt_tokens));
    }
    model
        .encode(text, special)
        .map_err(|e| ApiError::bad_request(param, e.to_string()))
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
fn chat_prompt(messages: Option<Value>, add_generation_prompt: Option<bool>) -> Result<Prompt, ApiError> {
    let bad = |m: String| ApiError::bad_request("messages", m);
    let Some(Value::Array(mut messages)) = messages else {
        return Err(bad("`messages` must be a list of messages".to_owned()));
    };
    if messages.is_empty() {
        return Err(bad("`messages` is empty".to_owned()));
    }
    for (i, m) in messages.iter_mut().enumerate() {
        let Value::Object(obj) = m else {
            return Err(bad(format!("messages[{i}] is not an object")));
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(bad(format!("messages[{i}].role must be a string")));
        }
        let content = match obj.get("content") {
            Some(Value::String(_)) => continue,
            None | Some(Value::Null) => String::new(),
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
        obj.insert("content".to_owned(), Value::String(content));
    }
    Ok(Prompt::Chat {
        messages: Value::Array(messages),
        add_generation_prompt: add_generation_prompt.unwrap_or(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// A prompt over the limit is refused in OpenAI's shape (400, `invalid_request_error`,
    /// `context_length_exceeded`, the field named) with vLLM's words, which clients read to
    /// shorten a conversation; a chat of one long message is refused before all of it is
    /// tokenized (at least the limit's tokens).
    #[test]
    fn an_over_long_prompt_is_refused_as_vllm_and_openai_do() {
        let model = Model::tiny().unwrap();
        let long_chat = serde_json::to_vec(&serde_json::json!({
            "messages": [{"role": "user", "content": "word ".repeat(40_000)}]
        }))
        .unwrap();
        let cases: &[(Endpoint, Vec<u8>, &str, &str)] = &[
            (
                Endpoint::Completions,
                format!(r#"{{"prompt":"{}"}}"#, "x".repeat(101)).into_bytes(),
                "prompt",
                "However, your request has 101 input tokens. Please reduce the length of the input prompt.",
            ),
            (
                Endpoint::Completions,
                serde_json::to_vec(&serde_json::json!({"prompt": vec![1; 101]})).unwrap(),
                "prompt",
                "However, your request has 101 input tokens.",
            ),
            (
                Endpoint::Chat,
                br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
                "messages",
                "However, your request has at least",
            ),
            (
                Endpoint::Chat,
                long_chat,
                "messages",
                "However, your request has at least",
            ),
        ];
        for (endpoint, body, param, says) in cases {
            let limit = if body.len() > 1000 { 4000 } else { 10 };
            let err = parse(*endpoint, body, &model, limit).unwrap_err();
            assert_eq!(err.status, StatusCode::BAD_REQUEST);
            assert_eq!(err.kind, "invalid_request_error");
            assert_eq!(err.code, "context_length_exceeded");
            assert_eq!(err.param, Some(*param));
            let head = format!("This model's maximum context length is {limit} tokens. ");
            assert!(err.message.starts_with(&head), "{}", err.message);
            assert!(err.message.contains(says), "{}", err.message);
            let json = serde_json::to_value(err.body()).unwrap();
            assert_eq!(json["error"]["code"], "context_length_exceeded");
            assert_eq!(json["error"]["type"], "invalid_request_error");
        }
        // Stopped early: the limit's tokens and one slice more at most, not 200,000.
        let err = parse(Endpoint::Chat, &cases[3].1, &model, 4000).unwrap_err();
        let at_least: usize = err
            .message
            .split("at least ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!((4001..100_000).contains(&at_least), "{}", err.message);
    }

    /// The standard fields by type and range: `(endpoint, extra fields, the param refused or
    /// None for accepted)`.
    #[test]
    fn sampling_fields_are_checked_by_type_and_range() {
        use Endpoint::{Chat, Completions};
        let model = Model::tiny().unwrap();
        let cases: &[(Endpoint, &str, Option<&str>)] = &[
            (Completions, r#""temperature": "hot""#, Some("temperature")),
            (Completions, r#""temperature": -0.5"#, Some("temperature")),
            (Completions, r#""temperature": 0"#, None),
            (Completions, r#""temperature": 1.7"#, None),
            (Completions, r#""temperature": null"#, None),
            (Completions, r#""top_p": 0"#, Some("top_p")),
            (Completions, r#""top_p": 1.5"#, Some("top_p")),
            (Completions, r#""top_p": 0.9"#, None),
            (Completions, r#""top_k": -2"#, Some("top_k")),
            (Completions, r#""top_k": 40"#, None),
            (Completions, r#""top_k": 2.5"#, Some("top_k")),
            (Completions, r#""min_tokens": -1"#, Some("min_tokens")),
            (
                Completions,
                r#""skip_special_tokens": 1"#,
                Some("skip_special_tokens"),
            ),
            (Completions, r#""min_p": 2"#, Some("min_p")),
            (Completions, r#""max_tokens": "10""#, Some("max_tokens")),
            (Completions, r#""max_tokens": 1.5"#, Some("max_tokens")),
            (Completions, r#""max_tokens": 10"#, None),
            (
                Chat,
                r#""max_completion_tokens": -1"#,
                Some("max_completion_tokens"),
            ),
            (Completions, r#""n": 0"#, Some("n")),
            (Completions, r#""n": "1""#, Some("n")),
            (Completions, r#""stream": 1"#, Some("stream")),
            (Completions, r#""stream_options": true"#, Some("stream_options")),
            (Completions, r#""stop": 5"#, Some("stop")),
            (Completions, r#""stop": ["a", 5]"#, Some("stop")),
            (Completions, r#""stop": ["a", "b"]"#, None),
            (Completions, r#""stop": "\n""#, None),
            (Completions, r#""seed": "x""#, Some("seed")),
            (Completions, r#""seed": -7"#, None),
            (Completions, r#""presence_penalty": 3"#, Some("presence_penalty")),
            (
                Completions,
                r#""frequency_penalty": -2.5"#,
                Some("frequency_penalty"),
            ),
            (Completions, r#""frequency_penalty": -2"#, None),
            (
                Completions,
                r#""repetition_penalty": 0"#,
                Some("repetition_penalty"),
            ),
            (Completions, r#""logprobs": true"#, Some("logprobs")),
            (Completions, r#""logprobs": 5"#, None),
            (Chat, r#""logprobs": 5"#, Some("logprobs")),
            (
                Chat,
                r#""logprobs": true, "top_logprobs": 21"#,
                Some("top_logprobs"),
            ),
            (Chat, r#""logprobs": true, "top_logprobs": 3"#, None),
            (Completions, r#""echo": "yes""#, Some("echo")),
            (Completions, r#""logit_bias": [1]"#, Some("logit_bias")),
            (Completions, r#""user": 7"#, Some("user")),
            (
                Completions,
                r#""add_special_tokens": "no""#,
                Some("add_special_tokens"),
            ),
            (
                Chat,
                r#""add_generation_prompt": 1"#,
                Some("add_generation_prompt"),
            ),
            (Completions, r#""model": 5"#, Some("model")),
            (Completions, r#""some_engine_field": "anything""#, None),
        ];
        for (endpoint, fields, refused) in cases {
            let prompt = match endpoint {
                Completions => r#""prompt": "hi""#,
                Chat => r#""messages": [{"role": "user", "content": "hi"}]"#,
            };
            let body = format!("{{{prompt}, {fields}}}");
            match (parse(*endpoint, body.as_bytes(), &model, 100), refused) {
                (Ok(_), None) => {}
                (Err(e), Some(param)) => {
                    assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
                    assert_eq!(e.kind, "invalid_request_error", "{body}");
                    assert_eq!(e.param, Some(*param), "{body}: {}", e.message);
                    assert!(e.message.contains(param), "{body}: {}", e.message);
                }
                (Ok(_), Some(param)) => panic!("{body}: accepted, {param} should be refused"),
                (Err(e), None) => panic!("{body}: refused: {}", e.message),
            }
        }
    }

    fn bos_model() -> Model {
        Model::from_json(
            include_str!("../tests/data/bos-model/tokenizer.json"),
            Some(include_str!("../tests/data/bos-model/tokenizer_config.json")),
        )
        .unwrap()
    }

    /// vLLM's rule on a tokenizer whose post-processor adds BOS (256): a completion's text gets
    /// it unless `add_special_tokens` is false; a chat gets the template's one BOS unless
    /// `add_special_tokens` is true (then two); token ids are taken as they are.
    #[test]
    fn tokens_follow_the_engines_rule_per_endpoint() {
        use Endpoint::{Chat, Completions};
        let model = bos_model();
        let chat = r#""messages": [{"role": "user", "content": "hi"}]"#;
        // (endpoint, body fields, the first tokens expected)
        let cases: &[(Endpoint, String, &[u32])] = &[
            (Completions, r#""prompt": "hi""#.into(), &[256, 104, 105]),
            (Completions, r#""prompt": ["hi"]"#.into(), &[256, 104, 105]),
            (
                Completions,
                r#""prompt": "hi", "add_special_tokens": false"#.into(),
                &[104, 105],
            ),
            (
                Completions,
                r#""prompt": "hi", "add_special_tokens": true"#.into(),
                &[256, 104, 105],
            ),
            (Completions, r#""prompt": [104, 105]"#.into(), &[104, 105]),
            (
                Completions,
                r#""prompt": [104, 105], "add_special_tokens": true"#.into(),
                &[104, 105],
            ),
            (Chat, chat.into(), &[256, 258]),
            (
                Chat,
                format!(r#"{chat}, "add_special_tokens": false"#),
                &[256, 258],
            ),
            (
                Chat,
                format!(r#"{chat}, "add_special_tokens": true"#),
                &[256, 256, 258],
            ),
        ];
        for (endpoint, fields, first) in cases {
            let body = format!("{{{fields}}}");
            let parsed = parse(*endpoint, body.as_bytes(), &model, 1000).unwrap();
            assert_eq!(&parsed.tokens[..first.len()], *first, "{body}");
            if *endpoint == Completions {
                assert_eq!(parsed.tokens.len(), first.len(), "{body}");
            }
        }
    }

    /// What the proxy forwards: a text completion as its token ids (with its BOS), anything
    /// else as it came; a client's internal fields stripped.
    #[test]
    fn the_engine_gets_kvroutes_tokens_and_no_clients_internal_fields() {
        use Endpoint::{Chat, Completions};
        let model = bos_model();
        let body_for = |endpoint, body: &str| {
            let parsed = parse(endpoint, body.as_bytes(), &model, 1000).unwrap();
            engine_body(&parsed, body.as_bytes(), KvCacheReport::Incremental)
                .map(|b| b.map(|b| serde_json::from_slice::<Value>(&b).unwrap()))
        };
        let text = r#"{"prompt": "hi", "max_tokens": 3, "temperature": 0}"#;
        let sent = body_for(Completions, text).unwrap().unwrap();
        assert_eq!(
            sent,
            serde_json::json!({"prompt": [256, 104, 105], "max_tokens": 3, "temperature": 0})
        );
        // As they came: token ids, chat, echo (its answer shows the client's text).
        for (endpoint, body) in [
            (Completions, r#"{"prompt": [1, 2]}"#),
            (Chat, r#"{"messages": [{"role": "user", "content": "hi"}]}"#),
            (Completions, r#"{"prompt": "hi", "echo": true}"#),
        ] {
            assert_eq!(body_for(endpoint, body).unwrap(), None, "{body}");
        }
        for field in INTERNAL_FIELDS {
            for endpoint in [Completions, Chat] {
                let body = format!(
                    r#"{{"prompt": [1], "messages": [{{"role": "user", "content": "hi"}}], "{field}": {{"remote_host": "10.6.6.6"}}, "seed": 1}}"#
                );
                let sent = body_for(endpoint, &body).unwrap().unwrap();
                assert_eq!(sent.get(*field), None, "{body}");
                assert_eq!(sent["seed"], 1, "the rest is kept: {body}");
            }
        }
        let sent = body_for(Completions, r#"{"prompt": "hi", "kv_transfer_params": null}"#);
        assert_eq!(
            sent.unwrap().unwrap(),
            serde_json::json!({"prompt": [256, 104, 105]})
        );
    }

    /// A stream whose client asked for no usage asks for it, keeping the client's other stream
    /// options; one that asked, and a unary request, go as they came.
    #[test]
    fn a_stream_asks_for_usage_keeping_the_clients_other_stream_options() {
        use serde_json::json;
        let model = Model::tiny().unwrap();
        let forwarded = |body: &Value| {
            let bytes = serde_json::to_vec(body).unwrap();
            let parsed = parse(Endpoint::Completions, &bytes, &model, 100).unwrap();
            engine_body(&parsed, &bytes, KvCacheReport::Incremental)
                .unwrap()
                .map(|b| serde_json::from_slice::<Value>(&b).unwrap())
        };
        // (client body, forwarded body)
        let table = [
            (
                json!({"prompt": [1], "stream": true}),
                Some(json!({"prompt": [1], "stream": true, "stream_options": {"include_usage": true}})),
            ),
            (
                json!({"prompt": [1], "stream": true, "stream_options": null}),
                Some(json!({"prompt": [1], "stream": true, "stream_options": {"include_usage": true}})),
            ),
            (
                json!({"prompt": [1], "stream": true, "stream_options": {"continuous_usage_stats": false}}),
                Some(
                    json!({"prompt": [1], "stream": true, "stream_options": {"continuous_usage_stats": false, "include_usage": true}}),
                ),
            ),
            (
                json!({"prompt": [1], "stream": true, "stream_options": {"include_usage": true}}),
                None,
            ),
            (json!({"prompt": [1], "stream": false}), None),
        ];
        for (body, want) in table {
            assert_eq!(forwarded(&body), want, "{body}");
        }
    }

    /// While the proxy wants the engine to re-announce, `vllm_xargs.kv_cache_report_mode` is
    /// `full`, merged into the client's own `vllm_xargs`; otherwise a client's own mode is
    /// stripped and its other keys go as they came.
    #[test]
    fn the_report_mode_is_the_proxys_and_the_clients_other_xargs_are_kept() {
        use KvCacheReport::{Full, Incremental};
        use serde_json::json;
        let model = Model::tiny().unwrap();
        let forwarded = |body: &Value, report| {
            let bytes = serde_json::to_vec(body).unwrap();
            let parsed = parse(Endpoint::Completions, &bytes, &model, 100).unwrap();
            engine_body(&parsed, &bytes, report)
                .unwrap()
                .map(|b| serde_json::from_slice::<Value>(&b).unwrap())
        };
        // (client body, report, forwarded body)
        let table = [
            (json!({"prompt": [1]}), Incremental, None),
            (
                json!({"prompt": [1]}),
                Full,
                Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
            ),
            (
                json!({"prompt": [1], "vllm_xargs": null}),
                Full,
                Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
            ),
            (
                json!({"prompt": [1], "vllm_xargs": {"session_id": "s", "n": 2}}),
                Full,
                Some(
                    json!({"prompt": [1], "vllm_xargs": {"session_id": "s", "n": 2, "kv_cache_report_mode": "full"}}),
                ),
            ),
            (
                json!({"prompt": [1], "vllm_xargs": {"session_id": "s"}}),
                Incremental,
                None,
            ),
            // A client's own mode is the proxy's to set.
            (
                json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full", "session_id": "s"}}),
                Incremental,
                Some(json!({"prompt": [1], "vllm_xargs": {"session_id": "s"}})),
            ),
            (
                json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}}),
                Incremental,
                Some(json!({"prompt": [1]})),
            ),
            (
                json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "incremental"}}),
                Full,
                Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
            ), // vLLM reads `kv_transfer_params` from `vllm_xargs` too: stripped there as well.
            (
                json!({"prompt": [1], "vllm_xargs": {"kv_transfer_params": {"remote_host": "10.6.6.6"}, "session_id": "s"}}),
                Incremental,
                Some(json!({"prompt": [1], "vllm_xargs": {"session_id": "s"}})),
            ),
            (
                json!({"prompt": [1], "vllm_xargs": {"kv_transfer_params": "x", "ec_transfer_params": "y"}}),
                Full,
                Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
            ),
            (
                json!({"prompt": [1], "vllm_xargs": {"ec_transfer_params": ["h"]}}),
                Incremental,
                Some(json!({"prompt": [1]})),
            ),
        ];
        for (body, report, want) in table {
            assert_eq!(forwarded(&body, report), want, "{body} {report:?}");
        }
        // vLLM refuses `vllm_xargs` that is not an object; so does the parser, naming it.
        let err = parse(
            Endpoint::Completions,
            br#"{"prompt": [1], "vllm_xargs": "full"}"#,
            &model,
            100,
        )
        .unwrap_err();
        assert_eq!(err.param, Some("vllm_xargs"));
    }
}
