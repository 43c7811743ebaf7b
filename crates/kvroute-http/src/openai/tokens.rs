//! The prompt's token ids, by vLLM's tokenization rule.

use crate::model::{Model, SpecialTokens};
use crate::prefix_cache::Encoded;

use super::{ApiError, Length, Prompt, too_long};

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
            check_text_len(model, &text, max_prompt_tokens)
                .map_err(|e| too_long("messages", Length::Chars(e), max_prompt_tokens))?;
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

/// The token ids of `text` (`special` tokens added or not); text so long it could not fit in
/// `max_prompt_tokens` ([`check_text_len`]) is refused before any work, naming `param`.
pub fn encode_text(
    model: &Model,
    text: &str,
    special: SpecialTokens,
    max_prompt_tokens: usize,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    check_text_len(model, text, max_prompt_tokens)
        .map_err(|e| too_long(param, Length::Chars(e), max_prompt_tokens))?;
    model
        .encode(text, special)
        .map_err(|e| ApiError::bad_request(param, e.to_string()))
}

/// A text with more characters than `max_tokens` tokens of the model can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TextTooLong {
    /// The text's characters (Unicode scalar values, as Python's `len` counts them).
    pub chars: usize,
    /// The most characters `max_tokens` tokens can hold.
    pub max_chars: usize,
    /// The token limit.
    pub max_tokens: usize,
}

impl TextTooLong {
    /// vLLM's words for it (`TokenizeParams._text_len_check`, `vllm/renderers/params.py`,
    /// 0.32), without the " (parameter=…, value=…)" its error's `str()` appends.
    pub fn vllm_message(&self) -> String {
        let TextTooLong {
            chars,
            max_chars,
            max_tokens,
        } = *self;
        format!(
            "This model's maximum context length is {max_tokens} tokens. However, your prompt \
             contains {chars} characters (more than {max_chars} characters, which is the upper \
             bound for {max_tokens} input tokens). Please reduce the length of the input prompt."
        )
    }
}

/// vLLM's check of a text prompt before tokenizing it (`TokenizeParams._text_len_check`,
/// without truncation): a text of more than `max_tokens` times the model's longest token
/// ([`Model::max_chars_per_token`]) in characters cannot fit, and is refused unread. The
/// characters are counted only when the bytes, which are at least as many, exceed the bound.
pub fn check_text_len(model: &Model, text: &str, max_tokens: usize) -> Result<(), TextTooLong> {
    let max_chars = max_tokens.saturating_mul(model.max_chars_per_token());
    if text.len() <= max_chars {
        return Ok(());
    }
    let chars = text.chars().count();
    if chars <= max_chars {
        return Ok(());
    }
    Err(TextTooLong {
        chars,
        max_chars,
        max_tokens,
    })
}
