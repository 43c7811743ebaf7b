//! The prompt's token ids, by vLLM's tokenization rule.

use std::borrow::Cow;

use crate::model::{Model, SpecialTokens};
use crate::prefix_cache::{Encoded, Turn};

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
    engine_tokens_with_turn(model, prompt, add_special_tokens, truncation, max_prompt_tokens)
        .map(|(tokens, _)| tokens)
}

/// [`engine_tokens`], with the prompt's place in the conversation cache when they are a chat's
/// tokens taken through it whole (not truncated): its [`Turn`], where the prompt's block hashes
/// may be kept for the next turn.
pub fn engine_tokens_with_turn(
    model: &Model,
    prompt: &Prompt,
    add_special_tokens: Option<bool>,
    truncation: Option<Truncation>,
    max_prompt_tokens: usize,
) -> Result<(Vec<u32>, Option<Turn>), ApiError> {
    if let Some(truncation) = truncation {
        let tokens = truncated_tokens(model, prompt, add_special_tokens, truncation, max_prompt_tokens)?;
        return Ok((tokens, None));
    }
    let text = match PromptText::of(model, prompt, add_special_tokens)? {
        Err(ids) => return Ok((ids.to_vec(), None)),
        Ok(text) if !text.chat => {
            let tokens = encode_text(model, &text.text, text.special, max_prompt_tokens, text.param)?;
            return Ok((tokens, None));
        }
        Ok(text) => text,
    };
    check_text_len(model, &text.text, max_prompt_tokens)
        .map_err(|e| too_long("messages", Length::Chars(e), max_prompt_tokens))?;
    // Through the conversation cache: a follow-up turn tokenizes only its new text.
    match model.encode_chat_turn(&text.text, text.special, max_prompt_tokens) {
        Ok((Encoded::Tokens(tokens), _, turn)) => Ok((tokens, turn)),
        Ok((Encoded::TooLong(at_least), _, _)) => {
            Err(too_long("messages", Length::AtLeast(at_least), max_prompt_tokens))
        }
        Err(e) => Err(ApiError::bad_request("messages", e.to_string())),
    }
}

/// The text an engine tokenizes for a prompt: a completion's, or a chat's conversation
/// rendered; with vLLM's special-token rule (added to a completion's text, not to a rendered
/// chat, unless `add_special_tokens` says otherwise) and the field an error names.
struct PromptText<'a> {
    text: Cow<'a, str>,
    special: SpecialTokens,
    param: &'static str,
    chat: bool,
}

impl<'a> PromptText<'a> {
    /// `prompt`'s text, or its token ids when it is given as such.
    fn of(
        model: &Model,
        prompt: &'a Prompt,
        add_special_tokens: Option<bool>,
    ) -> Result<Result<Self, &'a [u32]>, ApiError> {
        Ok(Ok(match prompt {
            Prompt::TokenIds(ids) => return Ok(Err(ids)),
            Prompt::Text(text) => PromptText {
                text: Cow::Borrowed(text),
                special: SpecialTokens::from_flag(add_special_tokens.unwrap_or(true)),
                param: "prompt",
                chat: false,
            },
            Prompt::Chat { messages, options } => PromptText {
                text: Cow::Owned(
                    model
                        .render_chat_with(messages, options)
                        .map_err(|e| ApiError::bad_request("messages", e.to_string()))?,
                ),
                special: SpecialTokens::from_flag(add_special_tokens.unwrap_or(false)),
                param: "messages",
                chat: true,
            },
        }))
    }

    /// The token ids of `text` (this prompt's, or a cut of it), whole: a chat's through the
    /// conversation cache.
    fn encode_whole(&self, model: &Model, text: &str) -> Result<Vec<u32>, ApiError> {
        let failed = |e: crate::model::PromptError| ApiError::bad_request(self.param, e.to_string());
        if !self.chat {
            return model.encode(text, self.special).map_err(failed);
        }
        match model
            .encode_chat(text, self.special, usize::MAX)
            .map_err(failed)?
        {
            (Encoded::Tokens(tokens), _) => Ok(tokens),
            // No limit: not reached.
            (Encoded::TooLong(_), _) => model.encode(text, self.special).map_err(failed),
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
    let prompt = match PromptText::of(model, prompt, add_special_tokens)? {
        Err(ids) => return Ok(cut(ids.to_vec(), keep, side)),
        Ok(text) => text,
    };
    if keep == 0 {
        return Ok(Vec::new());
    }
    let tokens = match (truncation.side, prompt.special) {
        // The tokenizer's own cut; without special tokens that is the text's last tokens, so a
        // chat goes through the conversation cache whole.
        (None, SpecialTokens::Add) => model
            .encode_truncated(&prompt.text, prompt.special, keep)
            .map_err(|e| ApiError::bad_request(prompt.param, e.to_string()))?,
        (None, SpecialTokens::Omit) => prompt.encode_whole(model, &prompt.text)?,
        (Some(side), _) => {
            let text = match check_text_len(model, &prompt.text, context) {
                Ok(()) => &prompt.text,
                Err(e) => cut_text(&prompt.text, e.max_chars, side),
            };
            prompt.encode_whole(model, text)?
        }
    };
    Ok(cut(tokens, keep, side))
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
