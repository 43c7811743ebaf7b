//! A request's part in the engine: its prompt's tokens, its side of a disaggregated flow and its
//! rank.

use kvroute_core::router::WorkerRole;
use kvroute_http::model::{Model, SpecialTokens};
use kvroute_http::openai::{ApiError, Prompt, check_text_len};
use serde_json::{Value, json};

use crate::handlers::Server;
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
    max_model_len: usize,
) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::TokenIds(ids) => Ok(ids.clone()),
        Prompt::Text(text) => {
            let add = add_special_tokens.unwrap_or(true);
            encode(
                model,
                text,
                SpecialTokens::from_flag(add),
                max_model_len,
                "prompt",
            )
        }
        Prompt::Chat {
            messages,
            add_generation_prompt,
        } => {
            let rendered = model
                .render_chat(messages, *add_generation_prompt)
                .map_err(|e| ApiError::bad_request("messages", e.to_string()))?;
            let add = add_special_tokens.unwrap_or(false);
            encode(
                model,
                &rendered,
                SpecialTokens::from_flag(add),
                max_model_len,
                "messages",
            )
        }
    }
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
pub(crate) fn pick_rank(w: &Server, header: Option<&str>, body: &Value) -> Result<usize, ApiError> {
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
pub(crate) fn transfer_params(w: &Server, prompt_tokens: u32, request_id: Option<&str>) -> Value {
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
