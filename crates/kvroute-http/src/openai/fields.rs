//! The standard request fields, checked by type and range with vLLM's bounds.

use serde_json::{Map, Value};

use super::{ApiError, Endpoint};

/// How a standard sampling field may be given ([`FIELD_RULES`]). `null` is always accepted,
/// as leaving the field out.
#[derive(Clone, Copy, Debug)]
enum Rule {
    Bool,
    String,
    Object,
    /// A string or a list of strings.
    Stop,
    /// A number in `min..=max` (`min` excluded when `open_min`).
    Number {
        min: f64,
        max: f64,
        open_min: bool,
    },
    /// An integer in `min..=max`.
    Integer {
        min: i64,
        max: i64,
    },
}

/// The standard request fields checked by type and range, with vLLM's bounds where it has
/// them (so nothing an engine accepts is refused): `(name, rule, endpoint or None for both)`.
const FIELD_RULES: &[(&str, Rule, Option<Endpoint>)] = &[
    ("stream", Rule::Bool, None),
    ("stream_options", Rule::Object, None),
    // vLLM's extra arguments: an object (its values are the engine's to check).
    ("vllm_xargs", Rule::Object, None),
    ("model", Rule::String, None),
    (
        "temperature",
        Rule::Number {
            min: 0.0,
            max: f64::MAX,
            open_min: false,
        },
        None,
    ),
    (
        "top_p",
        Rule::Number {
            min: 0.0,
            max: 1.0,
            open_min: true,
        },
        None,
    ),
    (
        "min_p",
        Rule::Number {
            min: 0.0,
            max: 1.0,
            open_min: false,
        },
        None,
    ),
    (
        "top_k",
        Rule::Integer {
            min: -1,
            max: i64::MAX,
        },
        None,
    ),
    (
        "presence_penalty",
        Rule::Number {
            min: -2.0,
            max: 2.0,
            open_min: false,
        },
        None,
    ),
    (
        "frequency_penalty",
        Rule::Number {
            min: -2.0,
            max: 2.0,
            open_min: false,
        },
        None,
    ),
    (
        "repetition_penalty",
        Rule::Number {
            min: 0.0,
            max: f64::MAX,
            open_min: true,
        },
        None,
    ),
    (
        "max_tokens",
        Rule::Integer {
            min: 0,
            max: u32::MAX as i64,
        },
        None,
    ),
    (
        "max_completion_tokens",
        Rule::Integer {
            min: 0,
            max: u32::MAX as i64,
        },
        None,
    ),
    (
        "min_tokens",
        Rule::Integer {
            min: 0,
            max: u32::MAX as i64,
        },
        None,
    ),
    (
        "n",
        Rule::Integer {
            min: 1,
            max: i64::MAX,
        },
        None,
    ),
    (
        "best_of",
        Rule::Integer {
            min: 1,
            max: i64::MAX,
        },
        None,
    ),
    (
        "seed",
        Rule::Integer {
            min: i64::MIN,
            max: i64::MAX,
        },
        None,
    ),
    ("stop", Rule::Stop, None),
    ("logit_bias", Rule::Object, None),
    ("user", Rule::String, None),
    ("ignore_eos", Rule::Bool, None),
    ("skip_special_tokens", Rule::Bool, None),
    ("add_special_tokens", Rule::Bool, None),
    ("echo", Rule::Bool, Some(Endpoint::Completions)),
    ("suffix", Rule::String, Some(Endpoint::Completions)),
    (
        "logprobs",
        Rule::Integer {
            min: 0,
            max: i64::MAX,
        },
        Some(Endpoint::Completions),
    ),
    ("logprobs", Rule::Bool, Some(Endpoint::Chat)),
    (
        "top_logprobs",
        Rule::Integer { min: 0, max: 20 },
        Some(Endpoint::Chat),
    ),
    ("add_generation_prompt", Rule::Bool, Some(Endpoint::Chat)),
    ("continue_final_message", Rule::Bool, Some(Endpoint::Chat)),
];

/// Checks the standard fields of a request to `endpoint` by type and range: a 400 in OpenAI's
/// shape naming the first field at fault. Fields not listed are the engine's business.
pub fn validate_fields(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<(), ApiError> {
    for &(name, rule, only) in FIELD_RULES {
        if only.is_some_and(|e| e != endpoint) {
            continue;
        }
        let Some(value) = obj.get(name).filter(|v| !v.is_null()) else {
            continue;
        };
        let problem = match rule {
            Rule::Bool => (!value.is_boolean()).then(|| "must be a boolean".to_owned()),
            Rule::String => (!value.is_string()).then(|| "must be a string".to_owned()),
            Rule::Object => (!value.is_object()).then(|| "must be an object".to_owned()),
            Rule::Stop => match value {
                Value::String(_) => None,
                Value::Array(items) if items.iter().all(Value::is_string) => None,
                _ => Some("must be a string or a list of strings".to_owned()),
            },
            Rule::Number { min, max, open_min } => match value.as_f64() {
                None => Some("must be a number".to_owned()),
                Some(x) if x < min || (open_min && x == min) || x > max => {
                    let low = if open_min { "greater than" } else { "at least" };
                    Some(if max == f64::MAX {
                        format!("must be {low} {min}, not {x}")
                    } else {
                        format!("must be {low} {min} and at most {max}, not {x}")
                    })
                }
                Some(_) => None,
            },
            Rule::Integer { min, max } => match value.as_i64() {
                Some(x) if (min..=max).contains(&x) => None,
                _ if value.as_u64().is_some() && max == i64::MAX => None,
                _ if value.is_i64() || value.is_u64() => {
                    Some(format!("must be an integer from {min} to {max}, not {value}"))
                }
                _ => Some("must be an integer".to_owned()),
            },
        };
        if let Some(problem) = problem {
            return Err(ApiError::bad_request(name, format!("`{name}` {problem}")));
        }
    }
    Ok(())
}
