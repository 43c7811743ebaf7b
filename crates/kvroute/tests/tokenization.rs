//! Tokenization as the engine does it, end to end: a proxy and mock workers that load a model
//! whose tokenizer's post-processor adds BOS (`kvroute-http/tests/data/bos-model`, shaped like
//! the one real vLLM runs were made with). The mock follows vLLM's rule (a text completion gets
//! BOS, a chat gets the template's one); the proxy must predict the cached tokens the engine
//! then reports, for text completions, chat and token ids.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::Model;
use kvroute_http::model::SpecialTokens;
use kvroute_http::net::{HttpClient, client};
use kvroute_http::openai::Endpoint;
use kvroute_http::openai::types::{ChatCompletion, Completion, ErrorResponse, Usage};
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::parity::{self, Parity};
use kvroute_proxy::{ProxyHandle, ServeConfig, WorkerConfig};
use serde_json::{Value, json};

use kvroute_testkit::PATIENCE;
/// The mock engine's and the proxy's block size.
const BLOCK: u32 = 16;
const BOS: u32 = 256;

const BOS_TOKENIZER: &str = include_str!("../../kvroute-http/tests/data/bos-model/tokenizer.json");
const BOS_CONFIG: &str = include_str!("../../kvroute-http/tests/data/bos-model/tokenizer_config.json");

fn bos_model() -> Arc<Model> {
    Arc::new(Model::from_json(BOS_TOKENIZER, Some(BOS_CONFIG)).unwrap())
}

/// The BOS model with the chat template `name` of `kvroute-http/tests/data/chat-templates`.
fn bos_model_with_template(name: &str) -> Arc<Model> {
    let templates: Value = serde_json::from_str(include_str!(
        "../../kvroute-http/tests/data/chat-templates/templates.json"
    ))
    .unwrap();
    let mut config: Value = serde_json::from_str(BOS_CONFIG).unwrap();
    config["chat_template"] = templates[name].clone();
    Arc::new(Model::from_json(BOS_TOKENIZER, Some(&config.to_string())).unwrap())
}

/// The BOS model with no post-processor: the same chat template, but a text completion gets
/// no BOS (an engine that follows `"add_bos_token": false`).
fn bos_model_without_post_processor() -> Arc<Model> {
    let mut json: Value = serde_json::from_str(BOS_TOKENIZER).unwrap();
    json["post_processor"] = Value::Null;
    Arc::new(Model::from_json(&json.to_string(), Some(BOS_CONFIG)).unwrap())
}

struct Cluster {
    proxy: ProxyHandle,
    mocks: Vec<MockWorker>,
    http: HttpClient,
}

/// `n` mock workers loading `engine_model`, and a proxy in front of them loading `our_model`.
async fn cluster(n: usize, engine_model: Arc<Model>, our_model: Arc<Model>) -> Cluster {
    cluster_of_context(n, engine_model, our_model, None).await
}

/// [`cluster`], with the engines' context and the proxy's prompt limit `context` if given.
async fn cluster_of_context(
    n: usize,
    engine_model: Arc<Model>,
    our_model: Arc<Model>,
    context: Option<u32>,
) -> Cluster {
    let mut mc = MockConfig::new(n);
    mc.engine.speedup = 20.0;
    if let Some(context) = context {
        mc.engine.max_model_len = context;
    }
    let mocks = mock::start(&mc, engine_model).await.unwrap();
    let defaults = ServeConfig::default();
    let config = ServeConfig {
        server: kvroute_proxy::config::ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..Default::default()
        },
        limits: kvroute_proxy::config::LimitsConfig {
            max_prompt_tokens: context.map_or(defaults.limits.max_prompt_tokens, |c| c as usize),
            ..Default::default()
        },
        upstream: kvroute_proxy::config::UpstreamConfig {
            health_interval_ms: 200,
            ..Default::default()
        },
        workers: mocks
            .iter()
            .map(|m| WorkerConfig::parse_flag(&m.worker_flag()).unwrap())
            .collect(),
        ..ServeConfig::default()
    };
    let proxy = kvroute_proxy::start(config, Some(our_model)).await.unwrap();
    Cluster {
        proxy,
        mocks,
        http: client(Duration::from_secs(2)),
    }
}

/// POSTs `body` to `url` + `path`: the status and the body.
async fn post(http: &HttpClient, url: &str, path: &str, body: &Value) -> (u16, Vec<u8>) {
    let req = hyper::Request::post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    let status = resp.status().as_u16();
    (
        status,
        resp.into_body().collect().await.unwrap().to_bytes().to_vec(),
    )
}

/// A metric's value from a Prometheus text exposition (the sum over matching lines).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.split([' ', '{']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

impl Cluster {
    /// A request through the proxy that must succeed: its usage.
    async fn usage(&self, endpoint: Endpoint, body: &Value) -> Usage {
        let (status, out) = post(&self.http, &self.proxy.url(), endpoint.path(), body).await;
        let text = String::from_utf8_lossy(&out);
        assert_eq!(status, 200, "{text}");
        match endpoint {
            Endpoint::Completions => {
                let c: Completion = serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}: {text}"));
                assert!(!c.choices[0].text.is_empty(), "the client gets text: {text}");
                c.usage.unwrap()
            }
            Endpoint::Chat => {
                let c: ChatCompletion =
                    serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}: {text}"));
                c.usage.unwrap()
            }
        }
    }

    /// The sum of the router's predicted hit rates (overlap blocks / prompt blocks, one
    /// observation per routed request).
    async fn hit_rate_sum(&self) -> f64 {
        let req = hyper::Request::get(format!("{}/metrics", self.proxy.url()))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let body = self
            .http
            .request(req)
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap();
        let text = String::from_utf8(body.to_bytes().to_vec()).unwrap();
        metric(&text, "dynamo_component_router_kv_hit_rate_sum")
    }

    /// Blocks the router's index holds, over all workers.
    fn indexed_blocks(&self) -> u64 {
        self.proxy
            .driver
            .snapshot()
            .workers
            .iter()
            .map(|w| w.cached_blocks)
            .sum()
    }

    /// Sends `body` twice: the second time the router must predict, in tokens, the cached
    /// prefix the engine reports. Returns (prompt tokens, cached tokens reported).
    async fn predicted_equals_reported(&self, endpoint: Endpoint, body: &Value) -> (u32, u32) {
        let before = self.indexed_blocks();
        let first = self.usage(endpoint, body).await;
        assert_eq!(first.cached_tokens(), 0, "a new prompt: {body}");
        assert_ne!(
            first.prompt_tokens % BLOCK,
            0,
            "the test wants a partial last block"
        );
        let full_blocks = first.prompt_tokens / BLOCK;
        // The first request's stored blocks reached the router.
        let stored = self
            .proxy
            .driver
            .wait_for_kv(PATIENCE, |_| {
                self.indexed_blocks() >= before + u64::from(full_blocks)
            })
            .await;
        assert!(stored, "the stored events never arrived");
        let rates = self.hit_rate_sum().await;
        let again = self.usage(endpoint, body).await;
        assert_eq!(again.prompt_tokens, first.prompt_tokens);
        let rate = self.hit_rate_sum().await - rates;
        let predicted = (rate * f64::from(full_blocks)).round() as u32 * BLOCK;
        let reported = again.cached_tokens();
        assert_eq!(
            predicted, reported,
            "predicted cached tokens vs the engine's usage.prompt_tokens_details.cached_tokens: {body}"
        );
        assert_eq!(
            reported,
            full_blocks * BLOCK,
            "every full block was a hit: {body}"
        );
        (first.prompt_tokens, reported)
    }
}

/// The failure ended: a text completion on a tokenizer that adds BOS hit no cache, because the
/// engine tokenized with BOS and kvroute without. Now the engine's reported cached tokens equal
/// the proxy's prediction for text completions (sent to the engine as kvroute's token ids),
/// chat (rendered alike) and token ids (taken as they are).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_cached_tokens_equal_the_engines_for_completions_chat_and_token_ids() {
    let c = cluster(2, bos_model(), bos_model()).await;
    let text: String = (0..200).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let (prompt_tokens, _) = c
        .predicted_equals_reported(
            Endpoint::Completions,
            &json!({"model": "tiny", "prompt": text, "max_tokens": 2}),
        )
        .await;
    assert_eq!(prompt_tokens, 201, "the engine's BOS and one token per byte");

    let chat = json!({"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "Tell me about the quick brown fox and the lazy dog, at length."},
        {"role": "assistant", "content": "The fox is quick and brown; the dog is lazy."},
        {"role": "user", "content": "And then?"},
    ]});
    c.predicted_equals_reported(Endpoint::Chat, &chat).await;

    let ids: Vec<u32> = (0..203).map(|i| 1 + (i * 13 % 250)).collect();
    let (prompt_tokens, _) = c
        .predicted_equals_reported(
            Endpoint::Completions,
            &json!({"model": "tiny", "prompt": ids, "max_tokens": 2}),
        )
        .await;
    assert_eq!(prompt_tokens, 203, "nothing is added to token ids");

    // A completion asking for no special tokens: no BOS, predicted alike.
    let text: String = (0..150).map(|i| char::from(b'a' + (i * 11 % 26) as u8)).collect();
    let (prompt_tokens, _) = c
        .predicted_equals_reported(
            Endpoint::Completions,
            &json!({"model": "tiny", "prompt": text, "max_tokens": 2, "add_special_tokens": false}),
        )
        .await;
    assert_eq!(prompt_tokens, 150);
}

/// `truncate_prompt_tokens` through the proxy: the proxy cuts the prompt as the engine does
/// (a text keeps its BOS and last N-1 tokens; without special tokens, token ids and a chat
/// keep their last N; `truncation_side` slices), routes on the blocks of what is kept and sends
/// those ids, so the cached tokens it predicts equal the engine's. With `-1` a prompt longer
/// than the context is taken, cut to the context less the output token; without truncation
/// the same prompt is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_prompts_are_routed_as_the_engine_truncates_them() {
    let context = 256;
    let c = cluster_of_context(2, bos_model(), bos_model(), Some(context)).await;
    let text = |salt: usize, n: usize| -> String {
        (0..n)
            .map(|i| char::from(b'a' + ((i * 7 + salt) % 26) as u8))
            .collect()
    };
    let ids: Vec<u32> = (0..300).map(|i| 1 + (i * 13 % 250)).collect();
    let chat = json!({"model": "tiny", "max_tokens": 2, "truncate_prompt_tokens": 100, "messages": [
        {"role": "user", "content": text(3, 200)},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "And then?"},
    ]});
    // (endpoint, body, prompt tokens the engine runs)
    let cases = [
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": text(0, 300), "max_tokens": 2, "truncate_prompt_tokens": 100}),
            100,
        ),
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": text(1, 300), "max_tokens": 2, "truncate_prompt_tokens": 100,
                "add_special_tokens": false}),
            100,
        ),
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 100}),
            100,
        ),
        (Endpoint::Chat, chat, 100),
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": text(2, 300), "max_tokens": 2, "truncate_prompt_tokens": 100,
                "truncation_side": "left"}),
            100,
        ),
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": text(4, 300), "max_tokens": 2, "truncate_prompt_tokens": 100,
                "truncation_side": "right"}),
            100,
        ),
        (
            Endpoint::Completions,
            json!({"model": "tiny", "prompt": text(5, 600), "max_tokens": 2, "truncate_prompt_tokens": -1}),
            context - 1,
        ),
    ];
    for (endpoint, body, prompt_tokens) in cases {
        let (ran, _) = c.predicted_equals_reported(endpoint, &body).await;
        assert_eq!(ran, prompt_tokens, "{body}");
    }
    let (status, out) = post(
        &c.http,
        &c.proxy.url(),
        Endpoint::Completions.path(),
        &json!({"model": "tiny", "prompt": text(5, 600), "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&out));
    let e: ErrorResponse = serde_json::from_slice(&out).unwrap();
    assert_eq!(e.error.code_name(), Some("context_length_exceeded"));
}

/// A tool-using conversation through the proxy, on a template that writes the tools with
/// `tojson(indent=4)` on lines of their own: the proxy renders the request's tools, and its
/// tool calls' arguments (sent as JSON strings) as objects, as the engine does, so the cached
/// tokens it predicts equal the engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_conversations_are_rendered_as_the_engine_renders_them() {
    let model = bos_model_with_template("multiline_tools");
    let c = cluster(2, Arc::clone(&model), model).await;
    let weather = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let body = json!({"model": "tiny", "max_tokens": 2, "tools": [weather], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        {"role": "user", "content": "And in Rome, a little longer please?"},
    ]});
    let (prompt_tokens, cached) = c.predicted_equals_reported(Endpoint::Chat, &body).await;
    assert!(
        prompt_tokens > 300,
        "the tools are in the prompt: {prompt_tokens}"
    );
    assert!(cached > 0);
}

/// As vLLM 0.32 answered on a template that writes `<think></think>` when thinking is off:
/// a chat completion with `reasoning_effort` "none" runs 45 prompt tokens, its `/tokenize` 30
/// (it does not pass `reasoning_effort` on); with `enable_thinking` in the kwargs, both 45.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_passes_reasoning_effort_to_chat_but_not_to_tokenize() {
    let model = bos_model_with_template("python_methods");
    let mocks = mock::start(&MockConfig::new(1), model).await.unwrap();
    let url = mocks[0].url();
    let http = client(Duration::from_secs(2));
    let messages = json!([{"role": "user", "content": "Think?"}]);
    // (body, prompt tokens of the chat completion, of /tokenize)
    let cases = [
        (json!({"messages": messages}), 30, 30),
        (json!({"messages": messages, "reasoning_effort": "none"}), 45, 30),
        (
            json!({"messages": messages, "reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": false}}),
            45,
            45,
        ),
    ];
    for (mut body, chat, tokenize) in cases {
        body["model"] = json!("tiny");
        let (status, out) = post(&http, &url, "/tokenize", &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        let answer: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(answer["count"], tokenize, "/tokenize {body}");
        body["max_tokens"] = json!(1);
        let (status, out) = post(&http, &url, "/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        let answer: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(answer["usage"]["prompt_tokens"], chat, "chat {body}");
    }
}

/// The mock tokenizes as vLLM 0.32 did on this tokenizer (`vllm-cpu/README.md`): a text
/// completion gets BOS, a chat the template's one BOS and no second; `add_special_tokens`
/// turns either way; `/tokenize` answers vLLM's shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_tokenizes_as_vllm_does() {
    let model = bos_model();
    let mocks = mock::start(&MockConfig::new(1), Arc::clone(&model))
        .await
        .unwrap();
    let url = mocks[0].url();
    let http = client(Duration::from_secs(2));
    let messages = json!([{"role": "user", "content": "hi"}]);
    let rendered = model.render_chat(&messages, true).unwrap();
    let chat_ids = model.encode(&rendered, SpecialTokens::Omit).unwrap();
    assert_eq!(&chat_ids[..2], &[BOS, 258]);
    // (path, body, the prompt's tokens)
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "hello"}),
            vec![BOS, 104, 101, 108, 108, 111],
        ),
        (
            "/v1/completions",
            json!({"prompt": "hello", "add_special_tokens": false}),
            vec![104, 101, 108, 108, 111],
        ),
        ("/v1/completions", json!({"prompt": [104, 105]}), vec![104, 105]),
        (
            "/v1/chat/completions",
            json!({"messages": messages}),
            chat_ids.clone(),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "add_special_tokens": true}),
            [vec![BOS], chat_ids.clone()].concat(),
        ),
        (
            "/tokenize",
            json!({"model": "tiny", "prompt": "hello"}),
            vec![BOS, 104, 101, 108, 108, 111],
        ),
        (
            "/tokenize",
            json!({"model": "tiny", "messages": messages}),
            chat_ids.clone(),
        ),
        (
            "/tokenize",
            json!({"model": "tiny", "messages": messages, "add_generation_prompt": false}),
            model
                .encode(&model.render_chat(&messages, false).unwrap(), SpecialTokens::Omit)
                .unwrap(),
        ),
    ];
    for (path, mut body, tokens) in cases {
        if path != "/tokenize" {
            body["max_tokens"] = json!(1);
        }
        let (status, out) = post(&http, &url, path, &body).await;
        assert_eq!(status, 200, "{path} {body}: {}", String::from_utf8_lossy(&out));
        let answer: Value = serde_json::from_slice(&out).unwrap();
        if path == "/tokenize" {
            assert_eq!(answer["tokens"], json!(tokens), "{body}");
            assert_eq!(answer["count"], json!(tokens.len()), "{body}");
            assert_eq!(
                answer["max_model_len"],
                json!(MockConfig::default_engine().max_model_len)
            );
        } else {
            assert_eq!(
                answer["usage"]["prompt_tokens"],
                json!(tokens.len()),
                "{path} {body}"
            );
        }
    }
}

/// The parity check: a worker that tokenizes as kvroute does matches; one with another
/// tokenizer mismatches at the chat probe's first token; one that adds no BOS to a text (but
/// renders chat alike) mismatches at the completion probe; a worker without `/tokenize` is
/// unsupported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parity_check_tells_a_worker_that_tokenizes_otherwise() {
    let ours = bos_model();
    let http = client(Duration::from_secs(2));
    let timeout = Duration::from_secs(5);
    let check = |url: String| {
        let (http, ours) = (http.clone(), Arc::clone(&ours));
        async move {
            parity::check(
                &http,
                kvroute_proxy::checks::Worker {
                    base: &url,
                    api_key: None,
                },
                "tiny",
                &ours,
                timeout,
            )
            .await
            .unwrap()
        }
    };
    let alike = mock::start(&MockConfig::new(1), bos_model()).await.unwrap();
    assert_eq!(check(alike[0].url()).await, Parity::Match);

    let other = mock::start(&MockConfig::new(1), Arc::new(Model::tiny().unwrap()))
        .await
        .unwrap();
    match check(other[0].url()).await {
        Parity::Mismatch {
            endpoint: Endpoint::Chat,
            position: 0,
            ..
        } => {}
        other => panic!("another tokenizer and template: {other:?}"),
    }

    let no_bos = mock::start(&MockConfig::new(1), bos_model_without_post_processor())
        .await
        .unwrap();
    let probe = "The quick brown fox jumps over the lazy dog.".len();
    assert_eq!(
        check(no_bos[0].url()).await,
        Parity::Mismatch {
            endpoint: Endpoint::Completions,
            position: 0,
            ours: probe + 1,
            theirs: probe,
        }
    );

    // A stub that serves generation but no /tokenize.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let routes = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
    tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
    assert_eq!(check(url).await, Parity::Unsupported);
}

/// Internal fields from a client never reach an engine: a client's `kv_transfer_params` (which
/// could make an engine import KV from a host it names) and the other fields the proxy writes
/// are stripped, and the request served as an ordinary one; a sampling field of the wrong type
/// is refused with a 400 in OpenAI's shape naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_fields_are_stripped_and_ill_typed_fields_refused() {
    let c = cluster(1, bos_model(), bos_model()).await;
    let hostile = json!({
        "do_remote_prefill": true, "remote_engine_id": "evil", "remote_block_ids": [0],
        "remote_host": "10.6.6.6", "remote_port": 5600,
    });
    let chat = json!([{"role": "user", "content": "hi"}]);
    // Each would reach the mock as a remote prefill or a bootstrap decode waiting for its room,
    // were it not stripped.
    let stripped = [
        (
            Endpoint::Completions,
            json!({"prompt": "hi", "kv_transfer_params": hostile}),
        ),
        (
            Endpoint::Chat,
            json!({"messages": chat, "kv_transfer_params": hostile}),
        ),
        (
            Endpoint::Completions,
            json!({"prompt": [1, 2], "bootstrap_host": "10.6.6.6", "bootstrap_port": 1, "bootstrap_room": 7}),
        ),
        (
            Endpoint::Completions,
            json!({"prompt": "hi", "kv_transfer_params": null}),
        ),
    ];
    for (endpoint, mut body) in stripped {
        body["max_tokens"] = json!(1);
        let usage = c.usage(endpoint, &body).await;
        assert!(usage.prompt_tokens > 0);
    }
    assert!(
        c.mocks[0].seen_kv_requests().is_empty(),
        "no engine saw a disaggregated request"
    );
    // (endpoint, body, the field named)
    let refused = [
        (
            Endpoint::Completions,
            json!({"prompt": "hi", "temperature": "hot"}),
            "temperature",
        ),
        (Endpoint::Chat, json!({"messages": chat, "top_p": 7}), "top_p"),
        (
            Endpoint::Completions,
            json!({"prompt": "hi", "stop": [1]}),
            "stop",
        ),
    ];
    for (endpoint, body, field) in refused {
        let (status, out) = post(&c.http, &c.proxy.url(), endpoint.path(), &body).await;
        assert_eq!(status, 400, "{body}");
        let error: ErrorResponse =
            serde_json::from_slice(&out).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out)));
        assert_eq!(error.error.param.as_deref(), Some(field), "{body}");
        assert_eq!(error.error.kind, "invalid_request_error");
        assert!(error.error.message.contains(field), "{}", error.error.message);
    }
}
