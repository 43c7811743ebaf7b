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
