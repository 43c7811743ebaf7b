//! The OpenAI response shapes kvroute produces and reads, written once: a server (the mock
//! engine) serializes them, a client (the proxy, the tests) deserializes them. Fields OpenAI
//! omits when empty are skipped when `None`; fields it sends as `null` (`finish_reason`
//! mid-stream, `logprobs`, an error's `param`) are sent as `null`.
//!
//! A streamed response is a sequence of SSE events `data: <chunk>\n\n` ending in
//! `data: [DONE]\n\n` ([`sse_event`], [`sse_data`]): completions stream [`Completion`]s,
//! chats stream [`ChatCompletionChunk`]s; with `stream_options.include_usage` the last chunk
//! before `[DONE]` has no choices and the [`Usage`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What an object is (OpenAI's `object` field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Object {
    /// A completion, whole or streamed.
    #[serde(rename = "text_completion")]
    TextCompletion,
    /// A whole chat completion.
    #[serde(rename = "chat.completion")]
    ChatCompletion,
    /// A streamed chat completion chunk.
    #[serde(rename = "chat.completion.chunk")]
    ChatCompletionChunk,
    /// A list (`/v1/models`).
    #[serde(rename = "list")]
    List,
    /// A model.
    #[serde(rename = "model")]
    Model,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop condition (end of sequence, a stop string).
    Stop,
    /// `max_tokens` (or the context) was reached.
    Length,
}

/// Token counts of a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Both.
    pub total_tokens: u32,
    /// How the prompt was served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    /// The usage of `prompt_tokens` prompt tokens, `cached_tokens` of them from the prefix
    /// cache, and `completion_tokens` generated ones.
    pub fn new(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: Some(cached_tokens),
            }),
        }
    }

    /// Prompt tokens served from the prefix cache (0 if not said).
    pub fn cached_tokens(&self) -> u32 {
        self.prompt_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
    }
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_tokens: Option<u32>,
}

/// A `/v1/completions` response, or one chunk of a streamed one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Its id.
    pub id: String,
    /// [`Object::TextCompletion`].
    pub object: Object,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// The choices (one; none in a usage chunk).
    pub choices: Vec<CompletionChoice>,
    /// The token counts (a whole response; a stream's usage chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// vLLM's disaggregated prefill: what the decode worker needs to pull the prompt's KV
    /// (a prefill worker's answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Value>,
}

/// One choice of a [`Completion`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Its index.
    pub index: u32,
    /// The text (of this chunk, when streamed).
    pub text: String,
    /// Log probabilities (always `null` here).
    pub logprobs: Option<Value>,
    /// Why it ended; `null` until the last chunk.
    pub finish_reason: Option<FinishReason>,
}

/// Who wrote a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The system prompt.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// A tool's answer.
    Tool,
}

/// A whole `/v1/chat/completions` response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion {
    /// Its id.
    pub id: String,
    /// [`Object::ChatCompletion`].
    pub object: Object,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// The choices (one).
    pub choices: Vec<ChatChoice>,
    /// The token counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// As [`Completion::kv_transfer_params`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Value>,
}

/// One choice of a [`ChatCompletion`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Its index.
    pub index: u32,
    /// The answer.
    pub message: ChatMessage,
    /// Log probabilities (always `null` here).
    pub logprobs: Option<Value>,
    /// Why it ended.
    pub finish_reason: Option<FinishReason>,
}

/// A chat message of a response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Its author.
    pub role: Role,
    /// Its text.
    pub content: Option<String>,
}

/// One chunk of a streamed `/v1/chat/completions` response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    /// The response's id.
    pub id: String,
    /// [`Object::ChatCompletionChunk`].
    pub object: Object,
    /// Unix seconds.
    pub created: u64,
    /// The model.
    pub model: String,
    /// The choices (one; none in a usage chunk).
    pub choices: Vec<ChunkChoice>,
    /// The token counts (the usage chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One choice of a [`ChatCompletionChunk`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChunkChoice {
    /// Its index.
    pub index: u32,
    /// What this chunk adds.
    pub delta: Delta,
    /// Log probabilities (always `null` here).
    pub logprobs: Option<Value>,
    /// Why it ended; `null` until the last chunk.
    pub finish_reason: Option<FinishReason>,
}

/// What a chat chunk adds: the role (first chunk) and text; the last chunk may add nothing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    /// The author, in the first chunk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    /// Text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// `/v1/models`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    /// [`Object::List`].
    pub object: Object,
    /// The models.
    pub data: Vec<ModelCard>,
}

impl ModelList {
    /// The list of one model, `id`, owned by `owned_by`.
    pub fn one(id: impl Into<String>, owned_by: impl Into<String>) -> Self {
        Self {
            object: Object::List,
            data: vec![ModelCard {
                id: id.into(),
                object: Object::Model,
                created: 0,
                owned_by: owned_by.into(),
                root: None,
                parent: None,
            }],
        }
    }
}

/// A model of [`ModelList`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCard {
    /// Its name.
    pub id: String,
    /// [`Object::Model`].
    pub object: Object,
    /// Unix seconds.
    pub created: u64,
    /// Its owner.
    pub owned_by: String,
    /// vLLM's `root`: a base model's path, a LoRA adapter's path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<String>,
    /// vLLM's `parent`: a LoRA adapter's base model (`None` for a base model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// An error response: `{"error": {...}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorResponse {
    /// The error.
    pub error: ErrorBody,
}

/// What went wrong.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What is wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `service_unavailable`, ...).
    #[serde(rename = "type")]
    pub kind: String,
    /// The field at fault, if one is.
    pub param: Option<String>,
    /// A short machine-readable code: a name (OpenAI, the proxy) or vLLM's HTTP status.
    pub code: Option<ErrorCode>,
}

impl ErrorBody {
    /// The code when it is a name (OpenAI's, the proxy's), not a number.
    pub fn code_name(&self) -> Option<&str> {
        match &self.code {
            Some(ErrorCode::Name(name)) => Some(name),
            Some(ErrorCode::Status(_)) | None => None,
        }
    }
}

/// [`ErrorBody::code`]: OpenAI and the proxy send a name (`"overloaded"`), vLLM the response's
/// HTTP status as a number (`404`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ErrorCode {
    /// vLLM's: the HTTP status.
    Status(u16),
    /// OpenAI's: a name.
    Name(String),
}

// ---- What vLLM sends: its usage rule and its error shape ----

/// Whether a server reports cached prompt tokens in `usage`: vLLM does only when started with
/// `--enable-prompt-tokens-details` (off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CachedTokensReport {
    /// vLLM's default: no `prompt_tokens_details`.
    #[default]
    Omitted,
    /// `--enable-prompt-tokens-details`: `prompt_tokens_details.cached_tokens` on every
    /// response, zero included (vLLM 0.32 writes it whenever the engine counted cached tokens,
    /// which it always does; seen on a real engine: `"cached_tokens": 0` on a miss).
    Reported,
}

impl Usage {
    /// The usage vLLM reports under `report`: as [`Usage::new`], with `prompt_tokens_details`
    /// when `report` asks for it.
    pub fn vllm(
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_tokens: u32,
        report: CachedTokensReport,
    ) -> Self {
        let reported = report == CachedTokensReport::Reported;
        Self {
            prompt_tokens_details: reported.then_some(PromptTokensDetails {
                cached_tokens: Some(cached_tokens),
            }),
            ..Self::new(prompt_tokens, completion_tokens, cached_tokens)
        }
    }
}

impl ErrorResponse {
    /// vLLM's error for HTTP `status`: `type` names the status's error class
    /// (`BadRequestError`, `NotFoundError`, ...), `code` is the status itself.
    pub fn vllm(status: u16, message: impl Into<String>, param: Option<&str>) -> Self {
        let kind = match status {
            400 => "BadRequestError",
            404 => "NotFoundError",
            501 => "NotImplementedError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        };
        Self {
            error: ErrorBody {
                message: message.into(),
                kind: kind.to_owned(),
                param: param.map(str::to_owned),
                code: Some(ErrorCode::Status(status)),
            },
        }
    }
}

/// The SSE event that carries `chunk`.
pub fn sse_event(chunk: &impl Serialize) -> String {
    // Serializing these types cannot fail (string keys, no maps of other keys).
    format!("data: {}\n\n", serde_json::to_string(chunk).unwrap_or_default())
}

/// The data of each event of an SSE stream `text`, without the final `[DONE]`.
pub fn sse_data(text: &str) -> impl Iterator<Item = &str> {
    text.split("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data:"))
        .map(str::trim)
        .filter(|data| *data != "[DONE]")
}

/// vLLM's answer to `POST /tokenize` (`TokenizeResponse`): the prompt's token ids as a
/// generation request of that kind would have them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokenized {
    /// How many tokens.
    pub count: usize,
    /// The engine's context length.
    pub max_model_len: u32,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Their strings, when asked for (`return_token_strs`); `null` otherwise.
    pub token_strs: Option<Vec<String>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `json` (what the mock and the proxy send today) reads as `T` and writes back the same.
    fn round_trip<T: Serialize + serde::de::DeserializeOwned>(json: &str) -> T {
        let parsed: T = serde_json::from_str(json).unwrap();
        let back: Value = serde_json::to_value(&parsed).unwrap();
        assert_eq!(back, serde_json::from_str::<Value>(json).unwrap(), "{json}");
        parsed
    }

    #[test]
    fn the_wire_shapes_read_and_write_back_unchanged() {
        let usage = r#"{"prompt_tokens":16,"completion_tokens":5,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":0}}"#;
        let completion: Completion = round_trip(&format!(
            r#"{{"id":"cmpl-mock-0","object":"text_completion","created":1,"model":"tiny","choices":[{{"index":0,"text":"abcde","logprobs":null,"finish_reason":"length"}}],"usage":{usage},"kv_transfer_params":{{"do_remote_prefill":true}}}}"#
        ));
        assert_eq!(completion.usage.unwrap(), Usage::new(16, 5, 0));
        round_trip::<Completion>(
            r#"{"id":"c","object":"text_completion","created":1,"model":"tiny","choices":[{"index":0,"text":"a","logprobs":null,"finish_reason":null}]}"#,
        );
        round_trip::<Completion>(&format!(
            r#"{{"id":"c","object":"text_completion","created":1,"model":"tiny","choices":[],"usage":{usage}}}"#
        ));
        round_trip::<ChatCompletion>(&format!(
            r#"{{"id":"chatcmpl-mock-1","object":"chat.completion","created":1,"model":"tiny","choices":[{{"index":0,"message":{{"role":"assistant","content":"hi"}},"logprobs":null,"finish_reason":"stop"}}],"usage":{usage}}}"#
        ));
        for delta in [
            r#"{"role":"assistant","content":"a"}"#,
            r#"{"content":"b"}"#,
            "{}",
        ] {
            round_trip::<ChatCompletionChunk>(&format!(
                r#"{{"id":"x","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":null}}]}}"#
            ));
        }
        let models: ModelList = round_trip(
            r#"{"object":"list","data":[{"id":"tiny","object":"model","created":0,"owned_by":"kvroute"}]}"#,
        );
        assert_eq!(models, ModelList::one("tiny", "kvroute"));
        round_trip::<ErrorResponse>(
            r#"{"error":{"message":"no","type":"invalid_request_error","param":null,"code":"refused"}}"#,
        );
    }

    #[test]
    fn vllm_usage_reports_cached_tokens_when_enabled_zero_included() {
        let json = |u: &Usage| serde_json::to_string(u).unwrap();
        let bare = r#"{"prompt_tokens":16,"completion_tokens":5,"total_tokens":21}"#;
        assert_eq!(json(&Usage::vllm(16, 5, 0, CachedTokensReport::Omitted)), bare);
        assert_eq!(json(&Usage::vllm(16, 5, 8, CachedTokensReport::Omitted)), bare);
        assert_eq!(
            json(&Usage::vllm(16, 5, 0, CachedTokensReport::Reported)),
            r#"{"prompt_tokens":16,"completion_tokens":5,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":0}}"#
        );
        let cached = Usage::vllm(16, 5, 8, CachedTokensReport::Reported);
        assert_eq!(
            json(&cached),
            r#"{"prompt_tokens":16,"completion_tokens":5,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":8}}"#
        );
        assert_eq!(cached.cached_tokens(), 8);
    }

    #[test]
    fn vllm_errors_carry_the_status_as_code() {
        // vLLM's answer to an unknown model, byte for byte.
        let vllm = r#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":"model","code":404}}"#;
        let parsed: ErrorResponse = round_trip(vllm);
        assert_eq!(
            parsed,
            ErrorResponse::vllm(404, "The model `x` does not exist.", Some("model"))
        );
        assert_eq!(parsed.error.code_name(), None);
        let named: ErrorResponse = round_trip(
            r#"{"error":{"message":"busy","type":"service_unavailable","param":null,"code":"overloaded"}}"#,
        );
        assert_eq!(named.error.code_name(), Some("overloaded"));
        assert_eq!(ErrorResponse::vllm(400, "m", None).error.kind, "BadRequestError");
    }

    #[test]
    fn sse_events_split_and_end_at_done() {
        let chunk = ModelList::one("m", "o");
        let text = format!("{}{}data: [DONE]\n\n", sse_event(&chunk), sse_event(&chunk));
        let data: Vec<&str> = sse_data(&text).collect();
        assert_eq!(data.len(), 2);
        assert_eq!(serde_json::from_str::<ModelList>(data[1]).unwrap(), chunk);
    }
}
