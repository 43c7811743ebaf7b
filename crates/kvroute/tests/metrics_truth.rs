//! Metrics that tell the truth, end to end: `kvroute serve` in front of
//! mock workers and of raw upstream stubs that answer, break off, hang or trickle on purpose:
//! outcomes, cached tokens predicted and reported, both stream shapes. Misconfiguration that is
//! loud is in `misconfiguration.rs`; both share `support/truth.rs`. Each test waits
//! on an explicit signal (a response, a worker state, the router's index), or polls a
//! condition with a generous deadline.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/truth.rs"]
mod truth;
use truth::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_breaks_off_is_an_upstream_reset_not_a_success() {
    const CHUNK: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
    let url = raw_stub(200, "text/event-stream", &[CHUNK], Then::Reset).await;
    let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
    let response = p
        .send("POST", "/v1/completions", Some(stream_request("hi")))
        .await;
    assert_eq!(response.status(), 200);
    let read = response.into_body().collect().await;
    assert!(read.is_err(), "the client sees the stream break off");
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "upstream_reset"), 1.0, "{text}");
    assert_eq!(outcome(&text, "ok"), 0.0);
    assert_eq!(
        metric(&text, "dynamo_frontend_requests_total", "status=\"success\""),
        0.0,
        "a broken stream is not a success"
    );
    assert_eq!(
        metric(&text, "dynamo_frontend_requests_total", "status=\"error\""),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_stream_is_a_timeout_and_an_error_answer_an_upstream_error() {
    const CHUNK: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
    let silent = raw_stub(200, "text/event-stream", &[CHUNK], Then::Hang).await;
    let p = proxy(vec![WorkerConfig::new(silent)], Vec::new(), |c| {
        c.upstream.request_timeout_ms = 300
    })
    .await;
    let response = p
        .send("POST", "/v1/completions", Some(stream_request("hi")))
        .await;
    assert!(response.into_body().collect().await.is_err());
    assert_eq!(outcome(&p.metrics().await, "timeout"), 1.0);

    let failing = raw_stub(
        500,
        "application/json",
        &["{\"error\":{\"message\":\"boom\"}}"],
        Then::End,
    )
    .await;
    let p = proxy(vec![WorkerConfig::new(failing)], Vec::new(), |_| {}).await;
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 500);
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "upstream_error"), 1.0, "{text}");
    assert_eq!(
        metric(&text, "dynamo_frontend_requests_total", "status=\"success\""),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_is_counted_as_cancelled() {
    const CHUNK: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
    let url = raw_stub(200, "text/event-stream", &[CHUNK], Then::Trickle).await;
    let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
    let response = p
        .send("POST", "/v1/completions", Some(stream_request("hi")))
        .await;
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    drop(body);
    // The proxy learns the client left when its next write fails.
    p.wait_for_metric(
        "kvroute_requests_outcome_total",
        "outcome=\"client_cancelled\"",
        1.0,
    )
    .await;
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "ok"), 0.0);
    let idle = |s: &kvroute_proxy::Driver| s.snapshot().active_now == 0;
    assert!(
        p.proxy.driver.wait_until(PATIENCE, idle).await,
        "the request's load was freed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_after_done_is_a_success_counted_before_it_has_done() {
    // OpenAI's clients (async-openai, the e2e tests' client) stop reading at `data: [DONE]`
    // and close the connection, often before the worker's body ends. The answer was whole: it
    // is a success, and it is counted before the client can read `[DONE]`, so that a client
    // reading `/metrics` after its answer sees it (a race the e2e tests once lost).
    const CHUNK: &str = "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n";
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1,\"total_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";
    // The worker sends `[DONE]` and then never ends its body.
    let url = raw_stub(200, "text/event-stream", &[CHUNK, USAGE, DONE], Then::Hang).await;
    let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
    let response = p
        .send("POST", "/v1/completions", Some(stream_request("hi")))
        .await;
    let mut body = response.into_body();
    let mut read = Vec::new();
    while !String::from_utf8_lossy(&read).contains("[DONE]") {
        let frame = body.frame().await.unwrap().unwrap();
        read.extend_from_slice(frame.data_ref().unwrap());
    }
    let text = p.metrics().await;
    assert_eq!(outcome(&text, "ok"), 1.0, "{text}");
    assert_eq!(
        metric(&text, "dynamo_frontend_requests_total", "status=\"success\""),
        1.0
    );
    assert_eq!(cache_reports(&text, "reported"), 1.0, "{text}");
    assert_eq!(
        p.proxy.driver.snapshot().active_now,
        0,
        "the request's load was freed"
    );
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_without_cached_tokens_and_no_usage_are_kept_apart_from_reported_counts() {
    // (the worker's unary body, the report it counts as)
    let cases: [(&'static [&'static str], &str); 2] = [
        (
            &["{\"choices\":[],\"usage\":{\"prompt_tokens\":2,\"completion_tokens\":1,\"total_tokens\":3}}"],
            "absent",
        ),
        (&["{\"choices\":[]}"], "no_usage"),
    ];
    for (body, report) in cases {
        let url = raw_stub(200, "application/json", body, Then::End).await;
        let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
        let (status, _, _) = p
            .call(
                "POST",
                "/v1/completions",
                Some(json!({"model": "tiny", "prompt": "hi"})),
            )
            .await;
        assert_eq!(status, 200);
        p.wait_for_metric(
            "kvroute_worker_cached_token_reports_total",
            &format!("report=\"{report}\""),
            1.0,
        )
        .await;
        let text = p.metrics().await;
        assert_eq!(outcome(&text, "ok"), 1.0);
        assert_eq!(cache_reports(&text, "reported"), 0.0);
        assert_eq!(
            metric(&text, "kvroute_worker_reported_cached_tokens_total", ""),
            0.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn predicted_and_reported_cached_tokens_agree_on_a_repeated_prompt() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |c| {
        c.server.debug_headers = true
    })
    .await;
    let prompt = long_prompt('k');
    // First: nothing cached. A stream whose client did not ask for usage gets none.
    let (status, headers, body) = p
        .call("POST", "/v1/completions", Some(stream_request(&prompt)))
        .await;
    assert_eq!(status, 200);
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert!(
        !body.contains("\"usage\""),
        "the usage chunk the proxy asked for is taken out: {body}"
    );
    assert_eq!(headers["x-kvroute-worker"], "0");
    assert_eq!(headers["x-kvroute-predicted-cached-tokens"], "0");
    p.wait_for_cached_blocks(Some(0), 12).await;
    // Again, asking for usage: the router predicts the engine's hits, and the engine says so.
    let mut again = stream_request(&prompt);
    again["stream_options"] = json!({"include_usage": true});
    let (_, headers, body) = p.call("POST", "/v1/completions", Some(again)).await;
    // 12 blocks of 16, within the engine's ceiling of 199 tokens.
    assert_eq!(headers["x-kvroute-predicted-cached-tokens"], "192");
    let usage: Completion = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|l| serde_json::from_str::<Completion>(l).ok())
        .find(|c| c.usage.is_some())
        .expect("the client asked for usage and got it");
    assert_eq!(usage.usage.unwrap().cached_tokens(), 192);
    // Unary, a third time.
    let (_, headers, _) = p
        .call(
            "POST",
            "/v1/completions",
            Some(json!({"model": "tiny", "prompt": prompt, "max_tokens": 2})),
        )
        .await;
    assert_eq!(headers["x-kvroute-predicted-cached-tokens"], "192");
    p.wait_for_metric(
        "kvroute_worker_cached_token_reports_total",
        "report=\"reported\"",
        3.0,
    )
    .await;
    let text = p.metrics().await;
    let labels = "dp_rank=\"0\",worker_id=\"0\"";
    assert_eq!(
        metric(&text, "kvroute_worker_predicted_cached_tokens_total", labels),
        384.0
    );
    assert_eq!(
        metric(&text, "kvroute_worker_reported_cached_tokens_total", labels),
        384.0
    );
    assert_eq!(outcome(&text, "ok"), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_headers_are_off_by_default() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(1)).await, |_| {}).await;
    let (status, headers, _) = p.complete("hi").await;
    assert_eq!(status, 200);
    assert!(headers.get("x-kvroute-worker").is_none());
    assert!(headers.get("x-kvroute-predicted-cached-tokens").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mock_streams_chunk_for_chunk_as_vllm_does() {
    let mut mc = MockConfig::new(1);
    mc.engine.speedup = 20.0;
    let workers = start_mocks(&mc).await;
    let http = client(Duration::from_secs(5));
    let post = |path: &'static str, body: Value| {
        let request = hyper::Request::post(format!("{}{path}", workers[0].url()))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
            .unwrap();
        let http = http.clone();
        async move {
            let response = http.request(request).await.unwrap();
            assert_eq!(response.status(), 200);
            let body = response.into_body().collect().await.unwrap().to_bytes();
            sse_events(&String::from_utf8_lossy(&body))
        }
    };
    let usage = json!({"include_usage": true});
    // Completions: one chunk per token, the finish reason in the last one's choice, then the
    // usage chunk (no choices), then [DONE] (vLLM 0.32's serving_completion.py).
    let events = post(
        "/v1/completions",
        json!({"prompt": "once upon", "max_tokens": 3, "stream": true, "stream_options": usage}),
    )
    .await;
    assert_eq!(events.len(), 5, "{events:?}");
    for (i, e) in events[..3].iter().enumerate() {
        let choice = &e["choices"][0];
        assert_eq!(choice["text"].as_str().unwrap().len(), 1, "{e}");
        let finish = if i == 2 { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], finish, "{e}");
        assert!(e["usage"].is_null(), "{e}");
    }
    assert_eq!(events[3]["choices"], json!([]), "{:?}", events[3]);
    assert_eq!(events[3]["usage"]["completion_tokens"], 3);
    assert_eq!(events[4], "[DONE]");
    // Chat: first the role with empty content, then one chunk per token, the finish reason in
    // the last, then usage and [DONE] (serving_chat.py); without include_usage, no usage.
    let messages = json!([{"role": "user", "content": "hi"}]);
    let events = post(
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 3, "stream": true, "stream_options": usage}),
    )
    .await;
    assert_eq!(events.len(), 6, "{events:?}");
    assert_eq!(
        events[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert!(events[0]["choices"][0]["finish_reason"].is_null());
    for (i, e) in events[1..4].iter().enumerate() {
        let choice = &e["choices"][0];
        assert_eq!(choice["delta"]["content"].as_str().unwrap().len(), 1, "{e}");
        assert!(choice["delta"]["role"].is_null(), "{e}");
        let finish = if i == 2 { json!("length") } else { Value::Null };
        assert_eq!(choice["finish_reason"], finish, "{e}");
    }
    assert_eq!(events[4]["choices"], json!([]));
    assert_eq!(events[4]["usage"]["completion_tokens"], 3);
    assert_eq!(events[5], "[DONE]");
    let events = post(
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 2, "stream": true}),
    )
    .await;
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(events.iter().all(|e| e.get("usage").is_none_or(Value::is_null)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_stream_shapes_count_as_ok_and_their_cached_tokens_are_read() {
    const USAGE: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"total_tokens\":42,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";
    // (endpoint, the engine's chunks): vLLM 0.32's shape (the finish reason in the last content
    // chunk; a chat's role first, with empty content) and the older one (a separate empty
    // finishing chunk).
    let cases: [(&str, &'static [&'static str]); 4] = [
        (
            "/v1/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
        (
            "/v1/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
        (
            "/v1/chat/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"},\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
        (
            "/v1/chat/completions",
            &[
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"a\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"b\"},\"finish_reason\":null}]}\n\n",
                "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n",
                USAGE,
                DONE,
            ],
        ),
    ];
    for (path, chunks) in cases {
        let url = raw_stub(200, "text/event-stream", chunks, Then::End).await;
        let p = proxy(vec![WorkerConfig::new(url)], Vec::new(), |_| {}).await;
        let body = if path == "/v1/completions" {
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": true})
        } else {
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true})
        };
        let (status, _, out) = p.call("POST", path, Some(body)).await;
        assert_eq!(status, 200, "{path}: {out}");
        let events = sse_events(&out);
        assert_eq!(events.last(), Some(&json!("[DONE]")), "{path}: {out}");
        // The client did not ask for usage: the chunk the proxy asked for is taken out.
        assert!(!out.contains("\"usage\""), "{path}: {out}");
        assert_eq!(events.len(), chunks.len() - 1, "{path}: {out}");
        p.wait_for_metric("kvroute_worker_reported_cached_tokens_total", "", 32.0)
            .await;
        let text = p.metrics().await;
        assert_eq!(outcome(&text, "ok"), 1.0, "{path}: {text}");
        assert_eq!(cache_reports(&text, "reported"), 1.0, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_series_stay_at_zero_out_of_routing_and_go_when_it_is_removed() {
    let p = proxy(Vec::new(), start_mocks(&MockConfig::new(2)).await, |_| {}).await;
    let (status, _, _) = p.complete("hi").await;
    assert_eq!(status, 200);
    let (status, _, _) = p.call("POST", "/admin/workers/1/drain", None).await;
    assert_eq!(status, 200);
    p.wait_for_state(1, StateName::Drained).await;
    let text = p.metrics().await;
    let worker = "worker_id=\"1\"";
    for name in [
        "kvroute_worker_active_requests",
        "kvroute_worker_cached_blocks",
        "dynamo_frontend_worker_active_decode_blocks",
        "kvroute_worker_predicted_cached_tokens_total",
        "kvroute_worker_reported_cached_tokens_total",
        "kvroute_worker_up",
    ] {
        assert!(
            has_series(&text, name, worker),
            "{name} of a drained worker is gone:\n{text}"
        );
    }
    assert_eq!(metric(&text, "kvroute_worker_active_requests", worker), 0.0);
    assert_eq!(metric(&text, "kvroute_worker_up", worker), 0.0);
    let (status, _, _) = p.call("DELETE", "/admin/workers/1", None).await;
    assert_eq!(status, 200);
    let text = p.metrics().await;
    assert!(
        !text.contains(worker),
        "a removed worker's series are gone:\n{text}"
    );
    assert!(has_series(
        &text,
        "kvroute_worker_active_requests",
        "worker_id=\"0\""
    ));
}
