//! The JSON of OpenAI responses, all of it: completions, chat completions, their stream
//! chunks, errors in a stream and the model list.

use std::time::{SystemTime, UNIX_EPOCH};

use kvroute_http::openai::Endpoint;
use serde_json::{Value, json};

use crate::handlers::Server;

/// The model list of `/v1/models`.
pub(crate) fn model_list(model_name: &str) -> Value {
    json!({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvroute-mock"}]})
}

impl Server {
    pub(crate) fn text(&self, tokens: &[u32]) -> String {
        let vocab = self.model.vocab_size().max(1);
        let ids: Vec<u32> = tokens
            .iter()
            .map(|&t| {
                if vocab <= 512 {
                    u32::from(b'a') + t % 26
                } else {
                    t % vocab
                }
            })
            .collect();
        self.model.decode(&ids)
    }
}

/// The response shapes of one request.
pub(crate) struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
}

impl Shape {
    /// The shapes of request `n` (numbering the worker's responses) to `endpoint`.
    pub(crate) fn new(
        endpoint: Endpoint,
        n: u64,
        model: String,
        prompt_tokens: u32,
        max_tokens: Option<u32>,
    ) -> Self {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let id = match endpoint {
            Endpoint::Completions => format!("cmpl-mock-{n}"),
            Endpoint::Chat => format!("chatcmpl-mock-{n}"),
        };
        Self {
            endpoint,
            id,
            created,
            model,
            prompt_tokens,
            max_tokens,
        }
    }

    /// The stream's end: the finishing chunk, the usage chunk if asked for, and `[DONE]`.
    pub(crate) fn last_chunks(
        &self,
        completion_tokens: u32,
        length: bool,
        cached: u32,
        first: bool,
        include_usage: bool,
    ) -> String {
        let finish = self.finish_reason(completion_tokens, length);
        let mut out = self.chunk("", Some(finish), first);
        if include_usage {
            out.push_str(&self.usage_chunk(completion_tokens, cached));
        }
        out.push_str("data: [DONE]\n\n");
        out
    }

    /// An error in the middle of a stream: the engine refused the request.
    pub(crate) fn error_chunk(&self, message: &str) -> String {
        let err = json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": "refused"}});
        format!("data: {err}\n\n")
    }

    fn finish_reason(&self, completion_tokens: u32, length: bool) -> &'static str {
        if length || self.max_tokens == Some(completion_tokens) {
            "length"
        } else {
            "stop"
        }
    }

    fn usage(&self, completion_tokens: u32, cached: u32) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    /// One SSE event with `text`.
    pub(crate) fn chunk(&self, text: &str, finish: Option<&str>, first: bool) -> String {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) => json!({}),
                    (false, None) => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        format!("data: {v}\n\n")
    }

    fn usage_chunk(&self, completion_tokens: u32, cached: u32) -> String {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": self.usage(completion_tokens, cached)});
        format!("data: {v}\n\n")
    }

    pub(crate) fn full(&self, text: &str, completion_tokens: u32, length: bool, cached: u32) -> Value {
        let finish = self.finish_reason(completion_tokens, length);
        let (object, choice) = match self.endpoint {
            Endpoint::Completions => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            ),
            Endpoint::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}),
            ),
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice], "usage": self.usage(completion_tokens, cached)})
    }
}
