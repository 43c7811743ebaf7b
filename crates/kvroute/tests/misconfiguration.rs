//! Misconfiguration that is loud, end to end: a worker serving another
//! model or another block size, one nobody serves, an unknown model, a missing tokenizer, logs
//! and the command `mock` prints, each said and kept out of routing until its checks pass.
//! Shares `support/truth.rs` with `metrics_truth.rs`; each test waits on an explicit signal or
//! polls a condition with a generous deadline.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/truth.rs"]
mod truth;
use truth::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serving_another_model_is_misconfigured_and_out_of_routing() {
    let mut mc = MockConfig::new(1);
    mc.model_name = "llama".into();
    let p = proxy(Vec::new(), start_mocks(&mc).await, |_| {}).await;
    p.wait_for_state(0, StateName::Misconfigured).await;
    let (_, _, listing) = p.call("GET", "/admin/workers", None).await;
    let listing: Value = serde_json::from_str(&listing).unwrap();
    assert_eq!(
        listing["workers"][0]["misconfigured"]["model"],
        "model `tiny` not served; it serves [\"llama\"]"
    );
    assert_eq!(listing["workers"][0]["routable"], false);
    let text = p.metrics().await;
    assert_eq!(
        metric(
            &text,
            "kvroute_worker_misconfigured",
            "check=\"model\",worker_id=\"0\""
        ),
        1.0
    );
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 503, "no worker serves the model");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_events_have_another_block_size_is_misconfigured() {
    let mut mc = MockConfig::new(1);
    mc.engine.block_size = 32;
    let p = proxy(Vec::new(), start_mocks(&mc).await, |_| {}).await;
    assert_eq!(p.block_size(), 16);
    // Routable until its first events say otherwise.
    let (status, _, _) = p
        .call(
            "POST",
            "/v1/completions",
            Some(json!({"model": "tiny", "prompt": long_prompt('b'), "max_tokens": 2})),
        )
        .await;
    assert_eq!(status, 200);
    p.wait_for_state(0, StateName::Misconfigured).await;
    let status = &p.proxy.driver.worker_statuses()[0];
    assert_eq!(
        status.misconfigured.values().next().map(String::as_str),
        Some("its KV events have blocks of 32 tokens, the router's block size is 16")
    );
    let text = p.metrics().await;
    assert_eq!(
        metric(&text, "kvroute_worker_misconfigured", "check=\"block_size\""),
        1.0
    );
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_model_is_openais_404_and_models_have_their_own_route() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |_| {}).await;
    let expected = json!({"error": {
        "message": "The model `gpt-9` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": null, "code": "model_not_found"}});
    for (method, path, body) in [
        (
            "POST",
            "/v1/completions",
            Some(json!({"model": "gpt-9", "prompt": "hi"})),
        ),
        (
            "POST",
            "/v1/chat/completions",
            Some(json!({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}], "stream": true})),
        ),
        ("GET", "/v1/models/gpt-9", None),
    ] {
        let (status, _, body) = p.call(method, path, body).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(serde_json::from_str::<Value>(&body).unwrap(), expected, "{path}");
        serde_json::from_str::<ErrorResponse>(&body).unwrap();
    }
    let (status, _, body) = p.call("GET", "/v1/models/tiny", None).await;
    assert_eq!(status, 200);
    let card: ModelCard = serde_json::from_str(&body).unwrap();
    assert_eq!(card.id, "tiny");
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "bad_request"), 2.0);
}

#[test]
fn serve_refuses_to_start_without_a_tokenizer() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--worker", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--model-dir"), "{stderr}");
    assert!(stderr.contains("--approximate-tokenizer"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serve_command_mock_prints_works_as_printed() {
    let mock = Child::spawn(&["mock", "--workers", "2", "--port", "0", "--event-port", "0"]);
    let command = mock.wait_for(|l| {
        l.trim_start()
            .starts_with("kvroute serve")
            .then(|| l.trim().to_owned())
    });
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(words[..2], ["kvroute", "serve"]);
    // The printed command, on free ports.
    let mut args = words[1..].to_vec();
    args.extend(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]);
    let serve = Child::spawn(&args);
    // "kvroute serve: listening on URL; admin API on URL"
    let url = serve.wait_for(|l| {
        let rest = l.split("listening on ").nth(1)?;
        Some(rest.split(';').next().unwrap_or(rest).trim().to_owned())
    });
    let p = Remote {
        url,
        http: client(Duration::from_secs(5)),
    };
    let body = json!({"model": "tiny", "prompt": long_prompt('m'), "max_tokens": 2});
    let (status, first) = p.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{first}");
    // The prompt's blocks reach the router through the mock's events.
    let deadline = Instant::now() + PATIENCE;
    while metric(&p.get("/metrics").await, "kvroute_worker_cached_blocks", "") < 12.0 {
        assert!(
            Instant::now() < deadline,
            "the mock's events never reached the router"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, again) = p.post("/v1/completions", &body).await;
    let again: Completion = serde_json::from_str(&again).unwrap();
    assert_eq!(
        again.usage.unwrap().cached_tokens(),
        192,
        "the repeated prompt hits the cache"
    );
    let text = p.get("/metrics").await;
    assert_eq!(
        metric(&text, "kvroute_worker_predicted_cached_tokens_total", ""),
        192.0
    );
    let (status, _) = p
        .post("/v1/completions", &json!({"model": "nope", "prompt": "hi"}))
        .await;
    assert_eq!(status, 404);
}

#[test]
fn a_worker_nobody_serves_is_said_in_the_log() {
    let (serve, worker) = serve_a_worker_nobody_serves();
    let line = serve.wait_for(|l| l.contains("does not answer").then(|| l.to_owned()));
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains(&worker), "the line names the worker: {line}");
}

/// A text log written to a pipe (or a file) carries no ANSI colour codes: its lines read as
/// plain text, the level a word.
#[test]
fn a_text_log_to_a_pipe_has_no_colour_codes() {
    let (serve, _) = serve_a_worker_nobody_serves();
    // Every line up to a warning through the log (the worker nobody serves).
    let mut lines = Vec::new();
    serve.wait_for(|l| {
        lines.push(l.to_owned());
        l.contains("does not answer").then_some(())
    });
    let warning = lines.last().unwrap();
    assert!(
        warning.contains(" WARN "),
        "the level is a plain word: {warning:?}"
    );
    for line in &lines {
        assert!(!line.contains('\x1b'), "an escape code in {line:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sampling_field_of_the_wrong_type_is_a_400_in_openais_shape() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |_| {}).await;
    for (field, value) in [("temperature", json!("hot")), ("top_p", json!(3))] {
        let mut body = json!({"model": "tiny", "prompt": "hi"});
        body[field] = value;
        let (status, _, body) = p.call("POST", "/v1/completions", Some(body)).await;
        assert_eq!(status, 400, "{body}");
        let error = serde_json::from_str::<ErrorResponse>(&body).unwrap().error;
        assert_eq!(error.param.as_deref(), Some(field), "{body}");
        assert_eq!(error.kind, "invalid_request_error");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misconfigured_worker_returns_once_its_checks_pass() {
    use axum::routing::get;
    use std::sync::atomic::{AtomicBool, Ordering};
    // A worker whose served model the test switches; its /health passes.
    let serves_tiny = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&serves_tiny);
    let routes = axum::Router::new()
        .route(
            "/v1/models",
            get(move || {
                let name = if flag.load(Ordering::SeqCst) {
                    "tiny"
                } else {
                    "other"
                };
                async move { axum::Json(kvroute_http::openai::types::ModelList::one(name, "stub")) }
            }),
        )
        .route("/health", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
    let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |c| {
        c.upstream.health_interval_ms = 50
    })
    .await;
    p.wait_for_state(0, StateName::Misconfigured).await;
    serves_tiny.store(true, Ordering::SeqCst);
    // Its next passing health check runs the checks again.
    p.wait_for_state(0, StateName::Ready).await;
    assert!(p.proxy.driver.worker_statuses()[0].misconfigured.is_empty());
    let text = p.metrics().await;
    assert_eq!(
        metric(&text, "kvroute_worker_misconfigured", "check=\"model\""),
        0.0
    );
}
