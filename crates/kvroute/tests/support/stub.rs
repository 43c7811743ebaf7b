//! The one-choice completion the test files' upstream stubs answer with, in vLLM's shape (the
//! shared OpenAI types). Included with `#[path]`.

use kvroute_http::openai::types::{Completion, CompletionChoice, FinishReason, Object, Usage};

/// A finished completion of the text "ok" from model `tiny`, with `id` and `usage`.
pub fn completion(id: &str, usage: Option<Usage>) -> Completion {
    Completion {
        id: id.into(),
        object: Object::TextCompletion,
        created: 0,
        model: "tiny".into(),
        choices: vec![CompletionChoice {
            index: 0,
            text: "ok".into(),
            logprobs: None,
            finish_reason: Some(FinishReason::Stop),
        }],
        usage,
        kv_transfer_params: None,
    }
}
