//! What vLLM refuses before its engine sees a request, with vLLM's messages and error shape
//! (`{"error": {"message", "type", "param", "code": <status>}}`): a model it does not serve
//! (404), `max_tokens` below 1 or above the context, a prompt that fills the context or passes
//! it ([`check_context`]), `vllm_xargs` values of the wrong type (400). A refusal of the shared
//! request parser is answered in the same shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvroute_http::openai::types::ErrorResponse;
use kvroute_http::openai::{ApiError, TRUNCATED_TO_NOTHING};
use serde_json::Value;

/// A refused request: its status and vLLM's error body.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Refusal {
    pub(crate) status: StatusCode,
    pub(crate) body: ErrorResponse,
}

impl Refusal {
    /// A refusal with `status`, saying `message` about `param`.
    pub(crate) fn new(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status,
            body: ErrorResponse::vllm(status.as_u16(), message, param),
        }
    }
}

impl Refusal {
    /// A 400 of vLLM's `VLLMValidationError` about `param`: its `str()`, which vLLM answers
    /// with, ends with the parameter and the value at fault (`vllm/exceptions.py`,
    /// `VLLMValidationError.__str__`).
    pub(crate) fn validation(message: &str, param: &str, value: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            validation_message(message, param, value),
            Some(param),
        )
    }
}

/// The `str()` of vLLM's `VLLMValidationError`: its message, then the parameter and the value
/// at fault (`vllm/exceptions.py`).
pub(crate) fn validation_message(message: &str, param: &str, value: impl std::fmt::Display) -> String {
    format!("{message} (parameter={param}, value={value})")
}

impl From<ApiError> for Refusal {
    fn from(e: ApiError) -> Self {
        // vLLM names no parameter for a prompt truncated to nothing.
        let param = e.param.filter(|_| e.message != TRUNCATED_TO_NOTHING);
        Self::new(e.status, e.message, param)
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body)).into_response()
    }
}

/// Checks what vLLM checks of the body before tokenizing: the model named (if any) is the one
/// served, and `max_tokens` (or `max_completion_tokens`), if an integer, is at least 1. What is
/// not JSON, or of the wrong type, is left to the parser.
pub(crate) fn check_body(body: &Value, served: &str) -> Result<(), Refusal> {
    if let Some(model) = body.get("model").and_then(Value::as_str)
        && model != served
    {
        return Err(Refusal::new(
            StatusCode::NOT_FOUND,
            format!("The model `{model}` does not exist."),
            Some("model"),
        ));
    }
    check_xargs(body.get("vllm_xargs"))?;
    check_priority(body)?;
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_i64);
    match max_tokens {
        Some(n) if n < 1 => Err(Refusal::validation(
            &format!("max_tokens must be at least 1, got {n}."),
            "max_tokens",
            n,
        )),
        _ => Ok(()),
    }
}

/// A non-zero `priority`, which vLLM refuses unless started with `--scheduling-policy priority`
/// (its input processor: "Got priority {p} but Priority scheduling is not enabled."); the mock
/// schedules first come, first served, as vLLM does by default.
pub(crate) fn check_priority(body: &Value) -> Result<(), Refusal> {
    match body.get("priority").and_then(Value::as_i64) {
        Some(p) if p != 0 => Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("Got priority {p} but Priority scheduling is not enabled."),
            None,
        )),
        _ => Ok(()),
    }
}

/// A chat request's own template, which vLLM 0.32 refuses unless it was started with
/// `--trust-request-chat-template` (`OnlineRenderer.validate_chat_template`): the mock stands for
/// an engine started without it. A `chat_template` in `chat_template_kwargs` counts too.
pub(crate) fn check_chat_template(body: &Value) -> Result<(), Refusal> {
    let given = |v: Option<&Value>| v.is_some_and(|t| !t.is_null());
    let kwargs = body.get("chat_template_kwargs");
    if given(body.get("chat_template")) || given(kwargs.and_then(|k| k.get("chat_template"))) {
        return Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            "Chat template is passed with request, but --trust-request-chat-template is not set. \
             Refused request with untrusted chat template.",
            None,
        ));
    }
    Ok(())
}

/// vLLM's bound on `truncate_prompt_tokens` (`TokenizeParams.__post_init__`,
/// `vllm/renderers/params.py`): at most the context, `max_model_len`, whatever the prompt or
/// `max_tokens`. A `max_tokens` past the context is refused before it there, so that is left
/// to [`check_context`]. (Seen on vLLM 0.32: `tests/truncate.rs`.)
pub(crate) fn check_truncation(body: &Value, max_model_len: u32) -> Result<(), Refusal> {
    let Some(count) = body
        .get("truncate_prompt_tokens")
        .and_then(|v| v.as_i64().or_else(|| v.as_u64().map(|_| i64::MAX)))
    else {
        return Ok(());
    };
    let max_tokens = body
        .get("max_completion_tokens")
        .filter(|v| !v.is_null())
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64);
    if max_tokens.is_some_and(|n| n > u64::from(max_model_len)) || count <= i64::from(max_model_len) {
        return Ok(());
    }
    Err(Refusal::validation(
        &format!(
            "truncate_prompt_tokens={count} cannot be greater than max_model_len = {max_model_len}. \
             Please request a smaller truncation size."
        ),
        "truncate_prompt_tokens",
        count,
    ))
}

/// Checks `vllm_xargs` as vLLM's request model types it (`dict[str, str | int | float |
/// list[str | int | float]] | None`; a boolean passes as an integer): any key is accepted and
/// kept in the request's extra arguments, which the engine reads by name (the mock reads
/// `kv_cache_report_mode`), so an unknown key is ignored; a value of another type is a 400.
/// (Not an object at all is left to the parser, which refuses it.)
fn check_xargs(xargs: Option<&Value>) -> Result<(), Refusal> {
    let Some(Value::Object(xargs)) = xargs else {
        return Ok(());
    };
    let scalar = |v: &Value| matches!(v, Value::String(_) | Value::Number(_) | Value::Bool(_));
    for (key, value) in xargs {
        let ok = match value {
            Value::Array(items) => items.iter().all(scalar),
            other => scalar(other),
        };
        if !ok {
            return Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                format!(
                    "vllm_xargs.{key}: Input should be a valid string, number or list of them, got {value}"
                ),
                Some("vllm_xargs"),
            ));
        }
    }
    Ok(())
}

/// How a prompt reached vLLM's length check: text (a completion's or a rendered chat), which
/// vLLM tokenizes only up to one token past the context, or token ids, counted whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PromptForm {
    Text,
    TokenIds,
}

/// What vLLM (0.32) refuses of a generation request's length, in its order and words, for a
/// prompt of `prompt_tokens` and `max_tokens` (given in the field `max_tokens_param`) on a
/// model of `max_model_len` tokens. Nothing else is refused: a prompt and `max_tokens` that
/// together pass the context are taken, the output cut where the context ends.
///
/// vLLM's rules, in the order it applies them:
/// 1. `max_tokens` above the context: `TokenizeParams.__post_init__`
///    (`vllm/renderers/params.py`, the check on `max_output_tokens > max_total_tokens`), built
///    from the request by `build_tok_params` (`entrypoints/openai/completion/protocol.py`,
///    `chat_completion/protocol.py`: `max_completion_tokens` first, named as given).
/// 2. a prompt longer than the context: `TokenizeParams._token_len_check` (`params.py`;
///    parameter `input_tokens`). Text is tokenized with `max_length = max_input_tokens + 1`
///    (`get_encode_kwargs`), so an over-long text counts one past the context, "at least";
///    token ids count whole, and "at least" only when exactly one past it.
/// 3. a prompt of exactly the context: no token is left to generate. `get_max_tokens`
///    (`entrypoints/serve/utils/api_utils.py`) makes `max_tokens` `max_model_len - prompt`,
///    0, which `SamplingParams._verify_args` (`vllm/sampling_params.py`) refuses. (The engine's
///    own `_validate_prompt_len`, `vllm/v1/engine/input_processor.py`, refuses it too, but the
///    server never gets that far.)
/// 4. otherwise `max_tokens` becomes `min(max_tokens, max_model_len - prompt)`
///    (`get_max_tokens`): the engine stops at the context's end.
///
/// Each refusal is a `VLLMValidationError` ([`Refusal::validation`]). Checked against vLLM 0.32
/// itself (`tests/context.rs` lists the requests and answers).
pub(crate) fn check_context(
    form: PromptForm,
    prompt_tokens: usize,
    max_tokens: Option<u32>,
    max_tokens_param: &str,
    max_model_len: u32,
) -> Result<(), Refusal> {
    let limit = max_model_len as usize;
    if let Some(max_tokens) = max_tokens
        && max_tokens > max_model_len
    {
        return Err(Refusal::validation(
            &format!(
                "{max_tokens_param}={max_tokens} cannot be greater than max_model_len={max_model_len}. \
                 Please request fewer output tokens."
            ),
            max_tokens_param,
            max_tokens,
        ));
    }
    if prompt_tokens > limit {
        let counted = match form {
            PromptForm::Text => prompt_tokens.min(limit + 1),
            PromptForm::TokenIds => prompt_tokens,
        };
        let qualifier = if counted == limit + 1 { "at least " } else { "" };
        return Err(Refusal::validation(
            &format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 prompt contains {qualifier}{counted} input tokens, which exceeds this limit even \
                 without any output tokens. Please reduce the length of the input prompt."
            ),
            "input_tokens",
            counted,
        ));
    }
    if prompt_tokens == limit {
        return Err(Refusal::validation(
            "max_tokens must be at least 1, got 0.",
            "max_tokens",
            0,
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// The JSON a refusal answers with.
    fn answer(r: &Refusal) -> Value {
        serde_json::to_value(&r.body).unwrap()
    }

    #[test]
    fn an_unknown_model_is_vllms_404() {
        assert_eq!(
            check_body(&json!({"model": "tiny", "prompt": "a"}), "tiny"),
            Ok(())
        );
        assert_eq!(check_body(&json!({"prompt": "a"}), "tiny"), Ok(()));
        let r = check_body(&json!({"model": "gpt-9", "prompt": "a"}), "tiny").unwrap_err();
        assert_eq!(r.status, StatusCode::NOT_FOUND);
        assert_eq!(
            answer(&r),
            json!({"error": {"message": "The model `gpt-9` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}})
        );
    }

    /// Without priority scheduling (vLLM's default, and the mock's way), a priority of 0 is
    /// taken and any other refused in vLLM's words.
    #[test]
    fn a_non_zero_priority_is_refused_as_vllm_without_priority_scheduling_refuses_it() {
        for ok in [json!({"prompt": "a"}), json!({"prompt": "a", "priority": 0})] {
            assert_eq!(check_body(&ok, "tiny"), Ok(()));
        }
        for p in [-2, 1, 7] {
            let r = check_body(&json!({"prompt": "a", "priority": p}), "tiny").unwrap_err();
            assert_eq!(
                answer(&r),
                json!({"error": {"message": format!("Got priority {p} but Priority scheduling is not enabled."), "type": "BadRequestError", "param": null, "code": 400}})
            );
        }
    }

    /// vLLM keeps any `vllm_xargs` key of a scalar or list value (an unknown one is ignored)
    /// and refuses other values.
    #[test]
    fn vllm_xargs_take_any_key_of_a_scalar_or_list_value() {
        for xargs in [
            json!({"kv_cache_report_mode": "full"}),
            json!({"some_extension": 3, "flag": true, "weights": [1, 2.5, "x"]}),
            json!({}),
            Value::Null,
        ] {
            assert_eq!(
                check_body(&json!({"vllm_xargs": xargs}), "tiny"),
                Ok(()),
                "{xargs}"
            );
        }
        for xargs in [
            json!({"nested": {"a": 1}}),
            json!({"n": null}),
            json!({"l": [[1]]}),
        ] {
            let r = check_body(&json!({"vllm_xargs": xargs}), "tiny").unwrap_err();
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{xargs}");
            assert_eq!(r.body.error.param.as_deref(), Some("vllm_xargs"), "{xargs}");
        }
    }

    #[test]
    fn max_tokens_below_one_is_vllms_400() {
        for (body, n) in [
            (json!({"max_tokens": 0}), 0),
            (json!({"max_tokens": -3}), -3),
            (json!({"max_completion_tokens": 0, "max_tokens": 5}), 0),
        ] {
            let r = check_body(&body, "tiny").unwrap_err();
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(
                answer(&r),
                json!({"error": {"message": format!("max_tokens must be at least 1, got {n}. (parameter=max_tokens, value={n})"), "type": "BadRequestError", "param": "max_tokens", "code": 400}})
            );
        }
        assert_eq!(check_body(&json!({"max_tokens": 1}), "tiny"), Ok(()));
    }

    /// vLLM 0.32's length rules at the context's edge (see [`check_context`] for the source
    /// lines): a context of 10 tokens; prompts of 9, 10 and 11 tokens (and far past it), with
    /// and without `max_tokens`.
    #[test]
    fn the_context_edge_is_refused_as_vllm_refuses_it() {
        const N: u32 = 10;
        let fits = Ok(());
        let no_room = "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)";
        let too_many = || {
            let message = "max_tokens=11 cannot be greater than max_model_len=10. Please request \
                           fewer output tokens. (parameter=max_tokens, value=11)";
            Some(("max_tokens", message.to_owned()))
        };
        let over = |qualifier: &str, n: usize| {
            format!(
                "This model's maximum context length is 10 tokens. However, your prompt contains \
                 {qualifier}{n} input tokens, which exceeds this limit even without any output \
                 tokens. Please reduce the length of the input prompt. (parameter=input_tokens, \
                 value={n})"
            )
        };
        use PromptForm::{Text, TokenIds};
        /// A refusal's parameter and message; `None` when the request is taken.
        type Want = Option<(&'static str, String)>;
        // (prompt form, prompt tokens, max_tokens, refusal)
        let cases: Vec<(PromptForm, usize, Option<u32>, Want)> = vec![
            (Text, 9, None, None),
            (Text, 9, Some(1), None),
            // Past the context together: taken, the output cut at its end.
            (Text, 9, Some(5), None),
            (Text, 5, Some(N), None),
            (Text, 10, None, Some(("max_tokens", no_room.to_owned()))),
            (Text, 10, Some(1), Some(("max_tokens", no_room.to_owned()))),
            (TokenIds, 10, Some(1), Some(("max_tokens", no_room.to_owned()))),
            (Text, 11, None, Some(("input_tokens", over("at least ", 11)))),
            (Text, 11, Some(1), Some(("input_tokens", over("at least ", 11)))),
            (Text, 500, None, Some(("input_tokens", over("at least ", 11)))),
            (TokenIds, 11, None, Some(("input_tokens", over("at least ", 11)))),
            (TokenIds, 12, Some(1), Some(("input_tokens", over("", 12)))),
            (Text, 5, Some(N + 1), too_many()),
            // The output limit is checked first, as vLLM builds it before tokenizing.
            (Text, 11, Some(N + 1), too_many()),
        ];
        for (form, prompt, max_tokens, want) in cases {
            let got = check_context(form, prompt, max_tokens, "max_tokens", N);
            let case = format!("{form:?} prompt {prompt}, max_tokens {max_tokens:?}");
            match want {
                None => assert_eq!(got, fits, "{case}"),
                Some((param, message)) => {
                    let r = got.expect_err(&case);
                    assert_eq!(
                        answer(&r),
                        json!({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}),
                        "{case}"
                    );
                }
            }
        }
        // A chat's `max_completion_tokens` is named as given.
        let r = check_context(Text, 5, Some(11), "max_completion_tokens", N).unwrap_err();
        assert_eq!(r.body.error.param.as_deref(), Some("max_completion_tokens"));
        // Far past any limit: no overflow.
        assert!(check_context(TokenIds, usize::MAX / 2, Some(u32::MAX), "max_tokens", u32::MAX).is_err());
    }
}
