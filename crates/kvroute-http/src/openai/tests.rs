use axum::http::StatusCode;
use serde_json::Value;

use crate::model::{Model, SpecialTokens};

use super::*;

#[test]
fn the_output_limit_is_max_completion_tokens_unless_null_then_max_tokens() {
    let model = Model::tiny().unwrap();
    let cases: &[(&str, Option<u32>)] = &[
        (r#""max_tokens": 7"#, Some(7)),
        (r#""max_completion_tokens": 5"#, Some(5)),
        (r#""max_completion_tokens": 5, "max_tokens": 7"#, Some(5)),
        // As vLLM 0.32's chat serving: a null `max_completion_tokens` falls back.
        (r#""max_completion_tokens": null, "max_tokens": 7"#, Some(7)),
        (r#""max_completion_tokens": 0, "max_tokens": 7"#, Some(0)),
        (r#""max_completion_tokens": null"#, None),
        (r#""max_tokens": null"#, None),
        ("", None),
    ];
    for (fields, expected) in cases {
        let sep = if fields.is_empty() { "" } else { ", " };
        let body = format!(r#"{{"messages":[{{"role":"user","content":"hi"}}]{sep}{fields}}}"#);
        let parsed = parse(Endpoint::Chat, body.as_bytes(), &model, 100).unwrap();
        assert_eq!(parsed.max_tokens, *expected, "{body}");
    }
}

#[test]
fn prompts_in_every_form_and_bad_input_named() {
    let model = Model::tiny().unwrap();
    let ok = |e, body: &str| parse(e, body.as_bytes(), &model, 100).unwrap();
    assert_eq!(
        ok(Endpoint::Completions, r#"{"prompt":"ab"}"#).tokens,
        vec![97, 98]
    );
    assert_eq!(
        ok(Endpoint::Completions, r#"{"prompt":["ab"]}"#).tokens,
        vec![97, 98]
    );
    assert_eq!(
        ok(Endpoint::Completions, r#"{"prompt":[5,6]}"#).tokens,
        vec![5, 6]
    );
    assert_eq!(ok(Endpoint::Completions, r#"{"prompt":[[7]]}"#).tokens, vec![7]);
    let chat = ok(
        Endpoint::Chat,
        r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true}"#,
    );
    assert!(chat.stream);
    assert_eq!(chat.tokens[0], 257);
    let cases: &[(Endpoint, &str, &str)] = &[
        (Endpoint::Completions, "{", "body"),
        (Endpoint::Completions, "[1]", "body"),
        (Endpoint::Completions, "{}", "prompt"),
        (Endpoint::Completions, r#"{"prompt":""}"#, "prompt"),
        (Endpoint::Completions, r#"{"prompt":[-1]}"#, "prompt"),
        (Endpoint::Completions, r#"{"prompt":["a","b"]}"#, "prompt"),
        (
            Endpoint::Completions,
            r#"{"prompt":"a","stream":"yes"}"#,
            "stream",
        ),
        (
            Endpoint::Completions,
            r#"{"prompt":"a","max_tokens":-3}"#,
            "max_tokens",
        ),
        (Endpoint::Completions, r#"{"prompt":"a","n":2}"#, "n"),
        (Endpoint::Chat, r#"{"messages":[]}"#, "messages"),
        (Endpoint::Chat, r#"{"messages":[{"content":"x"}]}"#, "messages"),
        (
            Endpoint::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
            "messages",
        ),
    ];
    for (e, body, param) in cases {
        let err = parse(*e, body.as_bytes(), &model, 100).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(err.param, Some(*param), "{body}: {}", err.message);
    }
    let long = format!(r#"{{"prompt":"{}"}}"#, "x".repeat(101));
    let err = parse(Endpoint::Completions, long.as_bytes(), &model, 100).unwrap_err();
    assert_eq!(err.code, "context_length_exceeded");
}

/// A prompt over the limit is refused in OpenAI's shape (400, `invalid_request_error`,
/// `context_length_exceeded`, the field named) with vLLM's words, which clients read to
/// shorten a conversation; a chat of one long message is refused before all of it is
/// tokenized (at least the limit's tokens); text of more characters than the limit's tokens
/// can hold (13 a token for this tokenizer) is refused untokenized, in vLLM's words.
#[test]
fn an_over_long_prompt_is_refused_as_vllm_and_openai_do() {
    let model = Model::tiny().unwrap();
    let long_chat = serde_json::to_vec(&serde_json::json!({
        "messages": [{"role": "user", "content": "word ".repeat(20_000)}]
    }))
    .unwrap();
    let cases: &[(Endpoint, Vec<u8>, &str, &str)] = &[
        (
            Endpoint::Completions,
            format!(r#"{{"prompt":"{}"}}"#, "x".repeat(101)).into_bytes(),
            "prompt",
            "However, your request has 101 input tokens. Please reduce the length of the input prompt.",
        ),
        (
            Endpoint::Completions,
            serde_json::to_vec(&serde_json::json!({"prompt": vec![1; 101]})).unwrap(),
            "prompt",
            "However, your request has 101 input tokens.",
        ),
        (
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            "messages",
            "However, your request has at least",
        ),
        (
            Endpoint::Chat,
            long_chat,
            "messages",
            "However, your request has at least",
        ),
        (
            Endpoint::Completions,
            format!(r#"{{"prompt":"{}"}}"#, "é".repeat(131)).into_bytes(),
            "prompt",
            "However, your prompt contains 131 characters (more than 130 characters, which is the \
             upper bound for 10 input tokens). Please reduce the length of the input prompt.",
        ),
    ];
    for (endpoint, body, param, says) in cases {
        let limit = if body.len() > 1000 { 8000 } else { 10 };
        let err = parse(*endpoint, body, &model, limit).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
        assert_eq!(err.kind, "invalid_request_error");
        assert_eq!(err.code, "context_length_exceeded");
        assert_eq!(err.param, Some(*param));
        let head = format!("This model's maximum context length is {limit} tokens. ");
        assert!(err.message.starts_with(&head), "{}", err.message);
        assert!(err.message.contains(says), "{}", err.message);
        let json = serde_json::to_value(err.body()).unwrap();
        assert_eq!(json["error"]["code"], "context_length_exceeded");
        assert_eq!(json["error"]["type"], "invalid_request_error");
    }
    // Stopped early: the limit's tokens and one slice more at most, not the whole text's.
    let err = parse(Endpoint::Chat, &cases[3].1, &model, 8000).unwrap_err();
    let at_least: usize = err
        .message
        .split("at least ")
        .nth(1)
        .unwrap()
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let whole = model
        .encode(&"word ".repeat(20_000), SpecialTokens::Omit)
        .unwrap()
        .len();
    assert!(
        (8001..whole).contains(&at_least),
        "{} (whole: {whole})",
        err.message
    );
}

/// The standard fields by type and range: `(endpoint, extra fields, the param refused or
/// None for accepted)`.
#[test]
fn sampling_fields_are_checked_by_type_and_range() {
    use Endpoint::{Chat, Completions};
    let model = Model::tiny().unwrap();
    let cases: &[(Endpoint, &str, Option<&str>)] = &[
        (Completions, r#""temperature": "hot""#, Some("temperature")),
        (Completions, r#""temperature": -0.5"#, Some("temperature")),
        (Completions, r#""temperature": 0"#, None),
        (Completions, r#""temperature": 1.7"#, None),
        (Completions, r#""temperature": null"#, None),
        (Completions, r#""top_p": 0"#, Some("top_p")),
        (Completions, r#""top_p": 1.5"#, Some("top_p")),
        (Completions, r#""top_p": 0.9"#, None),
        (Completions, r#""top_k": -2"#, Some("top_k")),
        (Completions, r#""top_k": 40"#, None),
        (Completions, r#""top_k": 2.5"#, Some("top_k")),
        (Completions, r#""min_tokens": -1"#, Some("min_tokens")),
        (
            Completions,
            r#""skip_special_tokens": 1"#,
            Some("skip_special_tokens"),
        ),
        (Completions, r#""min_p": 2"#, Some("min_p")),
        (Completions, r#""max_tokens": "10""#, Some("max_tokens")),
        (Completions, r#""max_tokens": 1.5"#, Some("max_tokens")),
        (Completions, r#""max_tokens": 10"#, None),
        (
            Chat,
            r#""max_completion_tokens": -1"#,
            Some("max_completion_tokens"),
        ),
        (Completions, r#""n": 0"#, Some("n")),
        (Completions, r#""n": "1""#, Some("n")),
        (Completions, r#""stream": 1"#, Some("stream")),
        (Completions, r#""stream_options": true"#, Some("stream_options")),
        (Completions, r#""stop": 5"#, Some("stop")),
        (Completions, r#""stop": ["a", 5]"#, Some("stop")),
        (Completions, r#""stop": ["a", "b"]"#, None),
        (Completions, r#""stop": "\n""#, None),
        (Completions, r#""seed": "x""#, Some("seed")),
        (Completions, r#""seed": -7"#, None),
        (Completions, r#""presence_penalty": 3"#, Some("presence_penalty")),
        (
            Completions,
            r#""frequency_penalty": -2.5"#,
            Some("frequency_penalty"),
        ),
        (Completions, r#""frequency_penalty": -2"#, None),
        (
            Completions,
            r#""repetition_penalty": 0"#,
            Some("repetition_penalty"),
        ),
        (Completions, r#""logprobs": true"#, Some("logprobs")),
        (Completions, r#""logprobs": 5"#, None),
        (Chat, r#""logprobs": 5"#, Some("logprobs")),
        (
            Chat,
            r#""logprobs": true, "top_logprobs": 21"#,
            Some("top_logprobs"),
        ),
        (Chat, r#""logprobs": true, "top_logprobs": 3"#, None),
        (Completions, r#""echo": "yes""#, Some("echo")),
        (Completions, r#""logit_bias": [1]"#, Some("logit_bias")),
        (Completions, r#""user": 7"#, Some("user")),
        (
            Completions,
            r#""add_special_tokens": "no""#,
            Some("add_special_tokens"),
        ),
        (
            Chat,
            r#""add_generation_prompt": 1"#,
            Some("add_generation_prompt"),
        ),
        (Completions, r#""model": 5"#, Some("model")),
        (Completions, r#""some_engine_field": "anything""#, None),
    ];
    for (endpoint, fields, refused) in cases {
        let prompt = match endpoint {
            Completions => r#""prompt": "hi""#,
            Chat => r#""messages": [{"role": "user", "content": "hi"}]"#,
        };
        let body = format!("{{{prompt}, {fields}}}");
        match (parse(*endpoint, body.as_bytes(), &model, 100), refused) {
            (Ok(_), None) => {}
            (Err(e), Some(param)) => {
                assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
                assert_eq!(e.kind, "invalid_request_error", "{body}");
                assert_eq!(e.param, Some(*param), "{body}: {}", e.message);
                assert!(e.message.contains(param), "{body}: {}", e.message);
            }
            (Ok(_), Some(param)) => panic!("{body}: accepted, {param} should be refused"),
            (Err(e), None) => panic!("{body}: refused: {}", e.message),
        }
    }
}

fn bos_model() -> Model {
    Model::from_json(
        include_str!("../../tests/data/bos-model/tokenizer.json"),
        Some(include_str!("../../tests/data/bos-model/tokenizer_config.json")),
    )
    .unwrap()
}

/// vLLM's rule on a tokenizer whose post-processor adds BOS (256): a completion's text gets
/// it unless `add_special_tokens` is false; a chat gets the template's one BOS unless
/// `add_special_tokens` is true (then two); token ids are taken as they are.
#[test]
fn tokens_follow_the_engines_rule_per_endpoint() {
    use Endpoint::{Chat, Completions};
    let model = bos_model();
    let chat = r#""messages": [{"role": "user", "content": "hi"}]"#;
    // (endpoint, body fields, the first tokens expected)
    let cases: &[(Endpoint, String, &[u32])] = &[
        (Completions, r#""prompt": "hi""#.into(), &[256, 104, 105]),
        (Completions, r#""prompt": ["hi"]"#.into(), &[256, 104, 105]),
        (
            Completions,
            r#""prompt": "hi", "add_special_tokens": false"#.into(),
            &[104, 105],
        ),
        (
            Completions,
            r#""prompt": "hi", "add_special_tokens": true"#.into(),
            &[256, 104, 105],
        ),
        (Completions, r#""prompt": [104, 105]"#.into(), &[104, 105]),
        (
            Completions,
            r#""prompt": [104, 105], "add_special_tokens": true"#.into(),
            &[104, 105],
        ),
        (Chat, chat.into(), &[256, 258]),
        (
            Chat,
            format!(r#"{chat}, "add_special_tokens": false"#),
            &[256, 258],
        ),
        (
            Chat,
            format!(r#"{chat}, "add_special_tokens": true"#),
            &[256, 256, 258],
        ),
    ];
    for (endpoint, fields, first) in cases {
        let body = format!("{{{fields}}}");
        let parsed = parse(*endpoint, body.as_bytes(), &model, 1000).unwrap();
        assert_eq!(&parsed.tokens[..first.len()], *first, "{body}");
        if *endpoint == Completions {
            assert_eq!(parsed.tokens.len(), first.len(), "{body}");
        }
    }
}

/// What the proxy forwards: a text completion as its token ids (with its BOS), anything
/// else as it came; a client's internal fields stripped.
#[test]
fn the_engine_gets_kvroutes_tokens_and_no_clients_internal_fields() {
    use Endpoint::{Chat, Completions};
    let model = bos_model();
    let body_for = |endpoint, body: &str| {
        let parsed = parse(endpoint, body.as_bytes(), &model, 1000).unwrap();
        engine_body(&parsed, body.as_bytes(), KvCacheReport::Incremental)
            .map(|b| b.map(|b| serde_json::from_slice::<Value>(&b).unwrap()))
    };
    let text = r#"{"prompt": "hi", "max_tokens": 3, "temperature": 0}"#;
    let sent = body_for(Completions, text).unwrap().unwrap();
    assert_eq!(
        sent,
        serde_json::json!({"prompt": [256, 104, 105], "max_tokens": 3, "temperature": 0})
    );
    // As they came: token ids, chat, echo (its answer shows the client's text).
    for (endpoint, body) in [
        (Completions, r#"{"prompt": [1, 2]}"#),
        (Chat, r#"{"messages": [{"role": "user", "content": "hi"}]}"#),
        (Completions, r#"{"prompt": "hi", "echo": true}"#),
    ] {
        assert_eq!(body_for(endpoint, body).unwrap(), None, "{body}");
    }
    for field in INTERNAL_FIELDS {
        for endpoint in [Completions, Chat] {
            let body = format!(
                r#"{{"prompt": [1], "messages": [{{"role": "user", "content": "hi"}}], "{field}": {{"remote_host": "10.6.6.6"}}, "seed": 1}}"#
            );
            let sent = body_for(endpoint, &body).unwrap().unwrap();
            assert_eq!(sent.get(*field), None, "{body}");
            assert_eq!(sent["seed"], 1, "the rest is kept: {body}");
        }
    }
    let sent = body_for(Completions, r#"{"prompt": "hi", "kv_transfer_params": null}"#);
    assert_eq!(
        sent.unwrap().unwrap(),
        serde_json::json!({"prompt": [256, 104, 105]})
    );
}

/// A stream whose client asked for no usage asks for it, keeping the client's other stream
/// options; one that asked, and a unary request, go as they came.
#[test]
fn a_stream_asks_for_usage_keeping_the_clients_other_stream_options() {
    use serde_json::json;
    let model = Model::tiny().unwrap();
    let forwarded = |body: &Value| {
        let bytes = serde_json::to_vec(body).unwrap();
        let parsed = parse(Endpoint::Completions, &bytes, &model, 100).unwrap();
        engine_body(&parsed, &bytes, KvCacheReport::Incremental)
            .unwrap()
            .map(|b| serde_json::from_slice::<Value>(&b).unwrap())
    };
    // (client body, forwarded body)
    let table = [
        (
            json!({"prompt": [1], "stream": true}),
            Some(json!({"prompt": [1], "stream": true, "stream_options": {"include_usage": true}})),
        ),
        (
            json!({"prompt": [1], "stream": true, "stream_options": null}),
            Some(json!({"prompt": [1], "stream": true, "stream_options": {"include_usage": true}})),
        ),
        (
            json!({"prompt": [1], "stream": true, "stream_options": {"continuous_usage_stats": false}}),
            Some(
                json!({"prompt": [1], "stream": true, "stream_options": {"continuous_usage_stats": false, "include_usage": true}}),
            ),
        ),
        (
            json!({"prompt": [1], "stream": true, "stream_options": {"include_usage": true}}),
            None,
        ),
        (json!({"prompt": [1], "stream": false}), None),
    ];
    for (body, want) in table {
        assert_eq!(forwarded(&body), want, "{body}");
    }
}

/// While the proxy wants the engine to re-announce, `vllm_xargs.kv_cache_report_mode` is
/// `full`, merged into the client's own `vllm_xargs`; otherwise a client's own mode is
/// stripped and its other keys go as they came.
#[test]
fn the_report_mode_is_the_proxys_and_the_clients_other_xargs_are_kept() {
    use KvCacheReport::{Full, Incremental};
    use serde_json::json;
    let model = Model::tiny().unwrap();
    let forwarded = |body: &Value, report| {
        let bytes = serde_json::to_vec(body).unwrap();
        let parsed = parse(Endpoint::Completions, &bytes, &model, 100).unwrap();
        engine_body(&parsed, &bytes, report)
            .unwrap()
            .map(|b| serde_json::from_slice::<Value>(&b).unwrap())
    };
    // (client body, report, forwarded body)
    let table = [
        (json!({"prompt": [1]}), Incremental, None),
        (
            json!({"prompt": [1]}),
            Full,
            Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
        ),
        (
            json!({"prompt": [1], "vllm_xargs": null}),
            Full,
            Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
        ),
        (
            json!({"prompt": [1], "vllm_xargs": {"session_id": "s", "n": 2}}),
            Full,
            Some(
                json!({"prompt": [1], "vllm_xargs": {"session_id": "s", "n": 2, "kv_cache_report_mode": "full"}}),
            ),
        ),
        (
            json!({"prompt": [1], "vllm_xargs": {"session_id": "s"}}),
            Incremental,
            None,
        ),
        // A client's own mode is the proxy's to set.
        (
            json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full", "session_id": "s"}}),
            Incremental,
            Some(json!({"prompt": [1], "vllm_xargs": {"session_id": "s"}})),
        ),
        (
            json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}}),
            Incremental,
            Some(json!({"prompt": [1]})),
        ),
        (
            json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "incremental"}}),
            Full,
            Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
        ), // vLLM reads `kv_transfer_params` from `vllm_xargs` too: stripped there as well.
        (
            json!({"prompt": [1], "vllm_xargs": {"kv_transfer_params": {"remote_host": "10.6.6.6"}, "session_id": "s"}}),
            Incremental,
            Some(json!({"prompt": [1], "vllm_xargs": {"session_id": "s"}})),
        ),
        (
            json!({"prompt": [1], "vllm_xargs": {"kv_transfer_params": "x", "ec_transfer_params": "y"}}),
            Full,
            Some(json!({"prompt": [1], "vllm_xargs": {"kv_cache_report_mode": "full"}})),
        ),
        (
            json!({"prompt": [1], "vllm_xargs": {"ec_transfer_params": ["h"]}}),
            Incremental,
            Some(json!({"prompt": [1]})),
        ),
    ];
    for (body, report, want) in table {
        assert_eq!(forwarded(&body, report), want, "{body} {report:?}");
    }
    // vLLM refuses `vllm_xargs` that is not an object; so does the parser, naming it.
    let err = parse(
        Endpoint::Completions,
        br#"{"prompt": [1], "vllm_xargs": "full"}"#,
        &model,
        100,
    )
    .unwrap_err();
    assert_eq!(err.param, Some("vllm_xargs"));
}
