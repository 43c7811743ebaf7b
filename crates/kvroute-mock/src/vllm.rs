//! What vLLM refuses before its engine sees a request, with vLLM's messages and error shape
//! (`{"error": {"message", "type", "param", "code": <status>}}`): a model it does not serve
//! (404), `max_tokens` below 1 or beyond the context left after the prompt, `vllm_xargs` values
//! of the wrong type (400). A refusal of
//! the shared request parser is answered in the same shape.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvroute_http::openai::ApiError;
use kvroute_http::openai::types::ErrorResponse;
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

impl From<ApiError> for Refusal {
    fn from(e: ApiError) -> Self {
        Self::new(e.status, e.message, e.param)
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
    let max_tokens = body
        .get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_i64);
    match max_tokens {
        Some(n) if n < 1 => Err(Refusal::new(
            StatusCode::BAD_REQUEST,
            format!("max_tokens must be at least 1, got {n}."),
            Some("max_tokens"),
        )),
        _ => Ok(()),
    }
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

/// Checks that `max_tokens` output tokens fit in the context after `prompt_tokens`.
pub(crate) fn check_length(
    max_tokens: Option<u32>,
    prompt_tokens: usize,
    max_model_len: u32,
) -> Result<(), Refusal> {
    let Some(max_tokens) = max_tokens else {
        return Ok(());
    };
    if prompt_tokens as u64 + u64::from(max_tokens) <= u64::from(max_model_len) {
        return Ok(());
    }
    Err(Refusal::new(
        StatusCode::BAD_REQUEST,
        format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's \
             maximum context length is {max_model_len} tokens and your request has \
             {prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})."
        ),
        Some("max_tokens"),
    ))
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
    fn max_tokens_below_one_or_past_the_context_is_vllms_400() {
        for (body, n) in [
            (json!({"max_tokens": 0}), 0),
            (json!({"max_tokens": -3}), -3),
            (json!({"max_completion_tokens": 0, "max_tokens": 5}), 0),
        ] {
            let r = check_body(&body, "tiny").unwrap_err();
            assert_eq!(r.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(
                answer(&r),
                json!({"error": {"message": format!("max_tokens must be at least 1, got {n}."), "type": "BadRequestError", "param": "max_tokens", "code": 400}})
            );
        }
        assert_eq!(check_body(&json!({"max_tokens": 1}), "tiny"), Ok(()));
        assert_eq!(check_length(Some(24), 100, 124), Ok(()));
        assert_eq!(check_length(None, 124, 124), Ok(()));
        let r = check_length(Some(25), 100, 124).unwrap_err();
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            r.body.error.message,
            "'max_tokens' or 'max_completion_tokens' is too large: 25. This model's maximum \
             context length is 124 tokens and your request has 100 input tokens (25 > 124 - 100)."
        );
        assert!(check_length(Some(u32::MAX), usize::MAX / 2, u32::MAX).is_err());
    }
}
