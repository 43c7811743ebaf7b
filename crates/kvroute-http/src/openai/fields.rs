//! The standard request fields, checked by type and range with vLLM's bounds.

use std::sync::LazyLock;

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
    (
        "truncate_prompt_tokens",
        Rule::Integer {
            min: -1,
            max: i64::MAX,
        },
        None,
    ),
    ("truncation_side", Rule::String, None),
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

/// [`FIELD_RULES`]' fields in name order, each with its rule's place in the table.
static RULES_BY_NAME: LazyLock<Vec<(&'static str, usize)>> = LazyLock::new(|| {
    let mut by_name: Vec<(&'static str, usize)> = FIELD_RULES
        .iter()
        .enumerate()
        .map(|(at, rule)| (rule.0, at))
        .collect();
    by_name.sort_unstable();
    by_name
});

/// Checks the standard fields of a request to `endpoint` by type and range: a 400 in OpenAI's
/// shape naming the first field at fault (in the order of the rule table). Fields not listed are the
/// engine's business.
pub fn validate_fields(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<(), ApiError> {
    let applies = |only: Option<Endpoint>| only.is_none_or(|e| e == endpoint);
    // The first rule at fault: (its place in the table, its field, the problem). Most bodies
    // have fewer fields than there are rules: then each field looks up its rules, else each
    // rule its field; either way the rule that comes first in the table is named.
    let mut fault: Option<(usize, &str, String)> = None;
    if obj.len() < FIELD_RULES.len() {
        for (key, value) in obj {
            if value.is_null() {
                continue;
            }
            let by_name = &*RULES_BY_NAME;
            let first = by_name.partition_point(|&(name, _)| name < key.as_str());
            for &(name, at) in by_name[first..].iter().take_while(|&&(name, _)| name == key) {
                let (_, rule, only) = FIELD_RULES[at];
                if !applies(only) || fault.as_ref().is_some_and(|f| f.0 < at) {
                    continue;
                }
                if let Some(problem) = problem(rule, value) {
                    fault = Some((at, name, problem));
                }
            }
        }
    } else {
        for (at, &(name, rule, only)) in FIELD_RULES.iter().enumerate() {
            let Some(value) = obj.get(name).filter(|v| !v.is_null() && applies(only)) else {
                continue;
            };
            if let Some(problem) = problem(rule, value) {
                fault = Some((at, name, problem));
                break;
            }
        }
    }
    match fault {
        Some((_, name, problem)) => Err(ApiError::bad_request(name, format!("`{name}` {problem}"))),
        None => Ok(()),
    }
}

/// What is wrong with `value` (not null) by `rule`, if anything.
fn problem(rule: Rule, value: &Value) -> Option<String> {
    match rule {
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The check as it was: each rule in the table's order looks up its field.
    fn rule_by_rule(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<(), ApiError> {
        for &(name, rule, only) in FIELD_RULES {
            if only.is_some_and(|e| e != endpoint) {
                continue;
            }
            let Some(value) = obj.get(name).filter(|v| !v.is_null()) else {
                continue;
            };
            if let Some(problem) = problem(rule, value) {
                return Err(ApiError::bad_request(name, format!("`{name}` {problem}")));
            }
        }
        Ok(())
    }

    fn field_value() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            (-3i64..30).prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-3.0f64..3.0).prop_map(Value::from),
            "[a-z]{0,3}".prop_map(Value::from),
            Just(serde_json::json!(["a", "b"])),
            Just(serde_json::json!(["a", 1])),
            Just(serde_json::json!({"include_usage": true})),
        ]
    }

    fn field_name() -> impl Strategy<Value = String> {
        let names: Vec<String> = FIELD_RULES.iter().map(|r| r.0.to_owned()).collect();
        prop_oneof![
            3 => proptest::sample::select(names),
            1 => "[a-z_]{1,8}",
        ]
    }

    proptest! {
        /// The field named is the one the rule-by-rule check names, whether the body has fewer
        /// fields than there are rules or more.
        #[test]
        fn the_first_field_at_fault_is_named_whatever_the_body_holds(
            fields in proptest::collection::vec((field_name(), field_value()), 0..48),
            chat in any::<bool>(),
        ) {
            let endpoint = if chat { Endpoint::Chat } else { Endpoint::Completions };
            let obj: Map<String, Value> = fields.into_iter().collect();
            let got = validate_fields(endpoint, &obj).map_err(|e| (e.param, e.message));
            let want = rule_by_rule(endpoint, &obj).map_err(|e| (e.param, e.message));
            prop_assert_eq!(got, want);
        }
    }
}
