//! The prompt's token ids, by vLLM's tokenization rule.

use crate::model::{Model, SpecialTokens};
use crate::prefix_cache::Encoded;

use super::parse::{Side, Truncation};
use super::{ApiError, Length, Prompt, too_long};

/// The token ids an engine serving `model` runs for `prompt`, by vLLM's rule: a completion's
/// text is tokenized with the tokenizer's special tokens (a BOS) unless the request's
/// `add_special_tokens` is false; a chat's rendered conversation without them (the template
/// brings its own) unless it is true; token ids are taken as they are.
///
/// With a `truncation`, the prompt is cut as vLLM cuts it ([`truncated_tokens`]) in a context
/// of `max_prompt_tokens`.
pub fn engine_tokens(
    model: &Model,
    prompt: &Prompt,
    add_special_tokens: Option<bool>,
    truncation: Option<Truncation>,
    max_prompt_tokens: usize,
) -> Result<Vec<u32>, ApiError> {
    if let Some(truncation) = truncation {
        return truncated_tokens(model, prompt, add_special_tokens, truncation, max_prompt_tokens);
    }
    match prompt {
        Prompt::Text(text) => {
            let special = SpecialTokens::from_flag(add_special_tokens.unwrap_or(true));
            encode_text(model, text, special, max_prompt_tokens, "prompt")
        }
        Prompt::TokenIds(ids) => Ok(ids.clone()),
        Prompt::Chat { messages, options } => {
            let text = model
                .render_chat_with(messages, options)
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

/// A prompt's token ids cut by its `truncation` (vLLM's `truncate_prompt_tokens` and
/// `truncation_side`) as vLLM 0.32 cuts them in a context of `context` tokens
/// (`vllm/renderers/params.py`, `TokenizeParams`):
///
/// * `-1` keeps what the context holds, less one token when the request reserves output
///   ([`Keep::tokens`](super::Keep::tokens)); `0` keeps nothing.
/// * With no `truncation_side`, text (a completion's, or a rendered chat) is tokenized with the
///   tokenizer's own truncation (`get_encode_kwargs`), to the left: vLLM loads a generation
///   model's tokenizer with `truncation_side="left"`. The text's tokens are cut and then the
///   post-processor's added, so a completion keeps its BOS first ([`Model::encode_truncated`]).
///   Nothing is refused for the text's length in characters (`_text_len_check` skips it).
/// * With a `truncation_side`, text of more characters than the context's bound
///   ([`check_text_len`]) is first cut to that many characters from that side
///   (`_text_len_check`), then tokenized whole, special tokens included, and its tokens cut
///   from that side.
/// * Token ids keep their last tokens, or their first with `truncation_side` `"right"`; and
///   whatever is still longer than kept after the tokenizer's cut is cut so
///   (`_token_truncation`).
///
/// The length check against the context comes after, on the tokens kept.
pub fn truncated_tokens(
    model: &Model,
    prompt: &Prompt,
    add_special_tokens: Option<bool>,
    truncation: Truncation,
    context: usize,
) -> Result<Vec<u32>, ApiError> {
    let keep = truncation.keep.tokens(context);
    let side = truncation.side.unwrap_or(Side::Left);
    let rendered;
    let (text, special, param) = match prompt {
        Prompt::TokenIds(ids) => return Ok(cut(ids.clone(), keep, side)),
        Prompt::Text(text) => (
            text.as_str(),
            SpecialTokens::from_flag(add_special_tokens.unwrap_or(true)),
            "prompt",
        ),
        Prompt::Chat { messages, options } => {
            rendered = model
                .render_chat_with(messages, options)
                .map_err(|e| ApiError::bad_request("messages", e.to_string()))?;
            (
                rendered.as_str(),
                SpecialTokens::from_flag(add_special_tokens.unwrap_or(false)),
                "messages",
            )
        }
    };
    let failed = |e: crate::model::PromptError| ApiError::bad_request(param, e.to_string());
    if keep == 0 {
        return Ok(Vec::new());
    }
    let tokens = match (truncation.side, special) {
        // The tokenizer's own cut; without special tokens that is the text's last tokens, so a
        // chat goes through the conversation cache whole.
        (None, SpecialTokens::Add) => model.encode_truncated(text, special, keep).map_err(failed)?,
        (None, SpecialTokens::Omit) => whole(model, prompt, text, special).map_err(failed)?,
        (Some(side), _) => {
            let text = match check_text_len(model, text, context) {
                Ok(()) => text,
                Err(e) => cut_text(text, e.max_chars, side),
            };
            whole(model, prompt, text, special).map_err(failed)?
        }
    };
    Ok(cut(tokens, keep, side))
}

/// `text`'s token ids, whole: a chat's through the conversation cache.
fn whole(
    model: &Model,
    prompt: &Prompt,
    text: &str,
    special: SpecialTokens,
) -> Result<Vec<u32>, crate::model::PromptError> {
    if !matches!(prompt, Prompt::Chat { .. }) {
        return model.encode(text, special);
    }
    match model.encode_chat(text, special, usize::MAX)? {
        (Encoded::Tokens(tokens), _) => Ok(tokens),
        // No limit: not reached.
        (Encoded::TooLong(_), _) => model.encode(text, special),
    }
}

/// `tokens` cut to `keep` from `side`.
fn cut(mut tokens: Vec<u32>, keep: usize, side: Side) -> Vec<u32> {
    if tokens.len() > keep {
        match side {
            Side::Left => {
                tokens.drain(..tokens.len() - keep);
            }
            Side::Right => tokens.truncate(keep),
        }
    }
    tokens
}

/// `text` cut to its last (left) or first (right) `max_chars` characters.
fn cut_text(text: &str, max_chars: usize, side: Side) -> &str {
    match side {
        Side::Left => {
            let skip = text.chars().count().saturating_sub(max_chars);
            text.char_indices().nth(skip).map_or("", |(at, _)| &text[at..])
        }
        Side::Right => text
            .char_indices()
            .nth(max_chars)
            .map_or(text, |(at, _)| &text[..at]),
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
