//! The proxy's request parser and the disaggregated-flow body rewrites are decoders of outside
//! input: whatever a client sends, they answer with a value or a 400 naming the field at fault,
//! and never panic.

use axum::http::StatusCode;
use kvroute_http::Model;
use kvroute_http::disagg;
use kvroute_http::openai::{self, Endpoint, KvCacheReport};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

const MAX_PROMPT_TOKENS: usize = 64;

/// Any JSON value, a few levels deep.
fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (0u32..300).prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        "\\PC{0,12}".prop_map(Value::String),
        Just(json!("user")),
        Just(json!("text")),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(field(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// The field names the parser reads, the flows' fields, and others.
fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("prompt"),
        Just("messages"),
        Just("role"),
        Just("content"),
        Just("type"),
        Just("text"),
        Just("stream"),
        Just("stream_options"),
        Just("include_usage"),
        Just("max_tokens"),
        Just("max_completion_tokens"),
        Just("n"),
        Just("model"),
        Just("cache_salt"),
        Just("add_generation_prompt"),
        Just("kv_transfer_params"),
        Just("bootstrap_room"),
        Just("temperature"),
        Just("top_p"),
        Just("stop"),
        Just("seed"),
        Just("logprobs"),
        Just("echo"),
        Just("add_special_tokens"),
        Just("truncate_prompt_tokens"),
        Just("truncation_side"),
        Just("tools"),
        Just("tool_calls"),
        Just("function"),
        Just("arguments"),
        Just("documents"),
        Just("chat_template_kwargs"),
        Just("continue_final_message"),
        Just("reasoning"),
        Just("data_parallel_rank"),
    ]
    .prop_map(str::to_owned)
}

/// Request-shaped objects: mostly the fields a request has, with values of any shape, and now
/// and then a well-formed prompt or conversation.
fn request() -> impl Strategy<Value = Value> {
    let prompt = prop_oneof![
        1 => value(),
        3 => "[a-z ]{0,80}".prop_map(Value::String),
        2 => proptest::collection::vec(0u32..70_000, 0..80).prop_map(|ids| json!(ids)),
    ];
    let messages = prop_oneof![
        1 => value(),
        3 => proptest::collection::vec(
            ("(user|assistant|system|\\PC{0,4})", "\\PC{0,40}")
                .prop_map(|(role, content)| json!({"role": role, "content": content})),
            0..4
        )
        .prop_map(Value::Array),
    ];
    (
        proptest::collection::btree_map(field(), value(), 0..3),
        proptest::option::of(prompt),
        proptest::option::of(messages),
    )
        .prop_map(|(fields, prompt, messages)| {
            let mut obj: Map<String, Value> = fields.into_iter().collect();
            if let Some(p) = prompt {
                obj.insert("prompt".to_owned(), p);
            }
            if let Some(m) = messages {
                obj.insert("messages".to_owned(), m);
            }
            Value::Object(obj)
        })
}

fn check(model: &Model, body: &[u8]) -> Result<(), TestCaseError> {
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        match openai::parse(endpoint, body, model, MAX_PROMPT_TOKENS) {
            Ok(parsed) => {
                prop_assert!(!parsed.tokens.is_empty());
                prop_assert!(parsed.tokens.len() <= MAX_PROMPT_TOKENS);
                // What the proxy forwards: an object again, or a 400 naming the field.
                for report in [KvCacheReport::Incremental, KvCacheReport::Full] {
                    match openai::engine_body(&parsed, body, report) {
                        Ok(Some(rewritten)) => prop_assert!(matches!(
                            serde_json::from_slice::<Value>(&rewritten),
                            Ok(Value::Object(_))
                        )),
                        Ok(None) => {}
                        Err(e) => prop_assert!(e.param.is_some(), "{}", e.message),
                    }
                }
            }
            Err(e) => {
                prop_assert_eq!(e.status, StatusCode::BAD_REQUEST, "{}", e.message);
                prop_assert!(e.param.is_some(), "an error names its field: {}", e.message);
                prop_assert!(!e.message.is_empty());
            }
        }
    }
    // The flows' rewrites take exactly the JSON objects.
    let object = matches!(serde_json::from_slice::<Value>(body), Ok(Value::Object(_)));
    prop_assert_eq!(disagg::prefill_body(body).is_ok(), object);
    prop_assert_eq!(disagg::bootstrap_body(body, "h", Some(1), 7).is_ok(), object);
    prop_assert_eq!(disagg::decode_body(body, Some(json!({"a": 1}))).is_ok(), object);
    let _ = disagg::kv_transfer_params(body);
    Ok(())
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let model = Model::tiny().unwrap();
        check(&model, &bytes)?;
    }

    #[test]
    fn request_shaped_json_is_parsed_or_refused_by_name(body in request()) {
        let model = Model::tiny().unwrap();
        check(&model, &serde_json::to_vec(&body).unwrap())?;
    }
}
