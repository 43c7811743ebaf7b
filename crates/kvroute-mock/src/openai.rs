//! The OpenAI responses of one request, built from the shared types of
//! [`kvroute_http::openai::types`]: completions, chat completions, their stream chunks, the
//! usage (vLLM's rule for `prompt_tokens_details`), errors in a stream and the model list.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::{IntoResponse, Response};
use kvroute_engine::FinishReason as EngineFinish;
use kvroute_http::openai::Endpoint;
use kvroute_http::openai::types::{
    CachedTokensReport, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatMessage, ChunkChoice,
    Completion, CompletionChoice, Delta, ErrorResponse, FinishReason, Object, Role, Usage, sse_event,
};
use serde_json::Value;

use crate::handlers::MockWorkerState;

impl MockWorkerState {
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

/// How a generation ended, as the engine said.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ending {
    /// Tokens generated.
    pub(crate) completion_tokens: u32,
    /// Why the engine ended it.
    pub(crate) reason: EngineFinish,
    /// Prompt tokens found in the prefix cache.
    pub(crate) cached: u32,
}

/// The response shapes of one request.
pub(crate) struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
    report: CachedTokensReport,
}

impl Shape {
    /// The shapes of request `n` (numbering the worker's responses) to `endpoint`, reporting
    /// cached tokens under `report`.
    pub(crate) fn new(
        endpoint: Endpoint,
        n: u64,
        model: String,
        prompt_tokens: u32,
        max_tokens: Option<u32>,
        report: CachedTokensReport,
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
            report,
        }
    }

    /// The stream's end, as vLLM's OpenAI server sends it: the chunk of the last `text` with
    /// the finish reason, the usage chunk (no choices) if asked for, and `[DONE]`.
    pub(crate) fn last_chunks(&self, text: &str, end: Ending, first: bool, include_usage: bool) -> String {
        let mut out = self.chunks(text, Some(self.finish_reason(end)), first);
        if include_usage {
            out.push_str(&self.usage_chunk(end));
        }
        out.push_str("data: [DONE]\n\n");
        out
    }

    /// An error in the middle of a stream: the engine refused the request (vLLM's shape).
    pub(crate) fn error_chunk(&self, message: &str) -> String {
        sse_event(&ErrorResponse::vllm(400, message, None))
    }

    fn finish_reason(&self, end: Ending) -> FinishReason {
        // The engine ends a request at its `max_tokens` as at its natural end: OpenAI calls
        // the first `length`.
        if end.reason == EngineFinish::Length || self.max_tokens == Some(end.completion_tokens) {
            FinishReason::Length
        } else {
            FinishReason::Stop
        }
    }

    fn usage(&self, end: Ending) -> Usage {
        Usage::vllm(self.prompt_tokens, end.completion_tokens, end.cached, self.report)
    }

    fn completion(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Completion {
        Completion {
            id: self.id.clone(),
            object: Object::TextCompletion,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
            kv_transfer_params: None,
        }
    }

    fn chat_chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: Object::ChatCompletionChunk,
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    /// The SSE events of a pass's `text`, as vLLM's OpenAI server chunks them: one chunk with
    /// the text (and `finish_reason` on the last); a chat's first pass is preceded by a chunk
    /// that names the role with empty content.
    pub(crate) fn chunks(&self, text: &str, finish_reason: Option<FinishReason>, first: bool) -> String {
        match self.endpoint {
            Endpoint::Completions => sse_event(&self.completion(
                vec![CompletionChoice {
                    index: 0,
                    text: text.to_owned(),
                    logprobs: None,
                    finish_reason,
                }],
                None,
            )),
            Endpoint::Chat => {
                let choice = |delta, finish_reason| ChunkChoice {
                    index: 0,
                    delta,
                    logprobs: None,
                    finish_reason,
                };
                let mut out = String::new();
                if first {
                    let role = Delta {
                        role: Some(Role::Assistant),
                        content: Some(String::new()),
                    };
                    out.push_str(&sse_event(&self.chat_chunk(vec![choice(role, None)], None)));
                }
                let content = Delta {
                    role: None,
                    content: Some(text.to_owned()),
                };
                out.push_str(&sse_event(
                    &self.chat_chunk(vec![choice(content, finish_reason)], None),
                ));
                out
            }
        }
    }

    fn usage_chunk(&self, end: Ending) -> String {
        let usage = Some(self.usage(end));
        match self.endpoint {
            Endpoint::Completions => sse_event(&self.completion(Vec::new(), usage)),
            Endpoint::Chat => sse_event(&self.chat_chunk(Vec::new(), usage)),
        }
    }

    /// The whole answer `text`, with the decode worker's `kv_transfer_params` if any.
    pub(crate) fn full(&self, text: String, end: Ending, kv_transfer_params: Option<Value>) -> Response {
        let finish_reason = Some(self.finish_reason(end));
        let usage = Some(self.usage(end));
        match self.endpoint {
            Endpoint::Completions => axum::Json(Completion {
                kv_transfer_params,
                ..self.completion(
                    vec![CompletionChoice {
                        index: 0,
                        text,
                        logprobs: None,
                        finish_reason,
                    }],
                    usage,
                )
            })
            .into_response(),
            Endpoint::Chat => axum::Json(ChatCompletion {
                id: self.id.clone(),
                object: Object::ChatCompletion,
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChoice {
                    index: 0,
                    message: ChatMessage {
                        role: Role::Assistant,
                        content: Some(text),
                    },
                    logprobs: None,
                    finish_reason,
                }],
                usage,
                kv_transfer_params,
            })
            .into_response(),
        }
    }
}
