//! End to end on loopback: a real third-party OpenAI client (`async-openai`) against `kvroute
//! serve` in front of mock workers that run the simulated engine and publish KV events over ZMQ:
//! serving, routing, overload, bad input, a worker killed mid-stream and event recovery. The
//! disaggregated flows are in `e2e_disagg.rs`; both share `support/cluster.rs`.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/cluster.rs"]
mod cluster;

use cluster::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completions_streaming_and_not() {
    let c = cluster(2, 20.0, |_| {}).await;
    let client = c.client();

    let chat = chat_request("Hello there, router.", 8);
    let response = client.chat().create(chat.clone()).await.unwrap();
    let text = response.choices[0].message.content.clone().unwrap();
    assert_eq!(text.len(), 8, "one ASCII letter per generated token: {text:?}");
    let usage = response.usage.unwrap();
    assert_eq!(usage.completion_tokens, 8);
    assert!(usage.prompt_tokens > 20);
    let (streamed, chunks) = stream_chat(&client, chat).await;
    assert_eq!(streamed.len(), 8);
    assert!(chunks >= 8, "tokens arrive as separate chunks ({chunks})");

    let completion = completion_request("Once upon a time", 5);
    let response = client.completions().create(completion.clone()).await.unwrap();
    assert_eq!(response.choices[0].text.len(), 5);
    let usage = response.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (16, 5));
    assert_eq!(stream_completion(&client, completion).await.len(), 5);

    let models: ModelList = serde_json::from_str(&c.http.get("/v1/models").await).unwrap();
    assert_eq!(models, ModelList::one("tiny", "kvroute"));

    let metrics = c.http.get("/metrics").await;
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        4.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_router_time_to_first_token_seconds_count",
            ""
        ) >= 2.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_router_inter_token_latency_seconds_count",
            ""
        ) >= 7.0
    );
    assert!(metric(&metrics, "dynamo_router_overhead_total_ms_count", "") >= 4.0);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_long_prompt_lands_on_the_worker_that_cached_it() {
    let c = cluster(3, 20.0, |_| {}).await;
    let client = c.client();
    // 1,600 bytes: 100 full blocks of 16 tokens with the byte-level tiny tokenizer.
    let prompt: String = (0..1600).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let request = completion_request(&prompt, 2);
    let first = client.completions().create(request.clone()).await.unwrap();
    let cached_first = first
        .usage
        .unwrap()
        .prompt_tokens_details
        .and_then(|d| d.cached_tokens);
    assert_eq!(cached_first.unwrap_or(0), 0);
    // Wait until the stored events reached the router.
    let holder = c.wait_for_cached_blocks(None, 100).await;
    for _ in 0..3 {
        let again = client.completions().create(request.clone()).await.unwrap();
        let cached = again
            .usage
            .unwrap()
            .prompt_tokens_details
            .unwrap()
            .cached_tokens
            .unwrap();
        assert_eq!(
            cached, 1584,
            "every full block but the last (vLLM always computes the last token) came from the cache"
        );
    }
    let blocks = c.cached_blocks();
    assert!(
        blocks.iter().enumerate().all(|(i, &b)| i == holder || b < 100),
        "only the first worker holds the prompt: {blocks:?}"
    );
    let metrics = c.http.get("/metrics").await;
    // The first request was predicted a miss, the next three full hits.
    assert_eq!(
        metric(&metrics, "dynamo_component_router_kv_hit_rate_count", ""),
        4.0
    );
    assert_eq!(
        metric(&metrics, "dynamo_component_router_kv_hit_rate_sum", ""),
        3.0
    );
    assert_eq!(
        metric(
            &metrics,
            "dynamo_component_router_kv_hit_rate_bucket",
            "le=\"0.95\""
        ),
        1.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_kv_cache_events_applied",
            "status=\"ok\""
        ) >= 1.0
    );
    assert_eq!(
        metric(
            &metrics,
            "dynamo_component_kv_cache_events_applied",
            "status=\"parent_block_not_found\""
        ),
        0.0
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_mid_stream_ends_the_request_and_frees_its_load() {
    // Real time: a 2,000-token output takes seconds, time enough to kill the worker.
    let c = cluster(2, 1.0, |_| {}).await;
    let client = c.client();
    let request = completion_request("stream me a long story", 2000);
    let mut stream = client.completions().create_stream(request).await.unwrap();
    // Wait for a few tokens, then find the worker serving it and kill it.
    for _ in 0..3 {
        stream.next().await.unwrap().unwrap();
    }
    let m = c.proxy.driver.snapshot();
    let busy = m.workers.iter().position(|w| w.load.requests == 1).unwrap();
    let other = 1 - busy;
    // A second stream, on the other worker, in flight when the first one's worker dies.
    let mut bystander = client
        .completions()
        .create_stream(completion_request("a bystander's story", 300))
        .await
        .unwrap();
    let mut bystander_text = String::new();
    for choice in bystander.next().await.unwrap().unwrap().choices {
        bystander_text.push_str(&choice.text);
    }
    c.until_gauges_are(&[(busy as u64, 1), (other as u64, 1)]).await;
    c.mocks[busy].kill();
    let mut ended_with_error = false;
    while let Some(chunk) = stream.next().await {
        if chunk.is_err() {
            ended_with_error = true;
            break;
        }
    }
    assert!(ended_with_error, "the stream broke off with an error");
    // Only that request is gone from the books; the bystander is still booked where it runs.
    c.until_gauges_are(&[(other as u64, 1)]).await;
    while let Some(chunk) = bystander.next().await {
        for choice in chunk.expect("the bystander's stream is unharmed").choices {
            bystander_text.push_str(&choice.text);
        }
    }
    assert!(!bystander_text.is_empty());
    c.assert_drained().await;
    // Connect failures retry on the other worker, and the health check takes the dead one out.
    for i in 0..4 {
        let (status, _, body) = c
            .http
            .request(
                "POST",
                "/v1/completions",
                serde_json::to_vec(&json!({"prompt": format!("after {i}"), "max_tokens": 2})).unwrap(),
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    // Out of routing by a failed connect or by failed health checks, whichever comes first.
    c.wait_for_state(busy, StateName::Unhealthy).await;
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    assert_eq!(workers["workers"][busy]["routable"], false);
    assert_eq!(workers["workers"][busy]["state"], "unhealthy");
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_event_batch_is_recovered_through_replay() {
    let c = cluster(1, 20.0, |_| {}).await;
    // The next batch (the prompt's blocks, stored by the prefill pass) is buffered but not sent.
    c.mocks[0].drop_next_event_batches(1);
    let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 5 % 26) as u8)).collect();
    let body = |p: &str| serde_json::to_vec(&json!({"prompt": p, "max_tokens": 40})).unwrap();
    let (status, _, _) = c.http.request("POST", "/v1/completions", body(&prompt)).await;
    assert_eq!(status, 200);
    // Later batches (output blocks filling, the next request) show the gap; the subscriber
    // replays it from the worker's replay socket.
    let (status, _, _) = c
        .http
        .request("POST", "/v1/completions", body("another prompt entirely"))
        .await;
    assert_eq!(status, 200);
    c.wait_for_cached_blocks(Some(0), 20).await;
    let metrics = c.http.get("/metrics").await;
    assert_eq!(
        metric(&metrics, "kvroute_kv_event_stream_incidents_total", "gap_lost"),
        0.0
    );
    assert_eq!(
        metric(
            &metrics,
            "dynamo_component_kv_cache_events_applied",
            "status=\"parent_block_not_found\""
        ),
        0.0,
        "every store found its parent: nothing was missed"
    );
    // And the prompt now routes as a full hit.
    let (_, _, out) = c.http.request("POST", "/v1/completions", body(&prompt)).await;
    assert_eq!(
        completion(&out).usage.unwrap().cached_tokens(),
        304,
        "19 of 20 blocks: the last token is always computed"
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_returns_503_and_nothing_leaks() {
    // One worker that counts as busy past 2 requests, and no queue. It holds its requests until
    // the test releases them, so that the fourth request meets three in flight.
    let mut held = Held::start().await;
    let worker = WorkerConfig {
        max_requests: 2,
        ..WorkerConfig::new(held.url.clone())
    };
    let c = fronting(vec![worker], Vec::new(), |config| {
        config.routing.busy_requests_fraction = Some(1.0);
        config.routing.queue_capacity = 0;
        // Only reached if the test is failing.
        config.upstream.request_timeout_ms = PATIENCE.as_millis() as u64;
    })
    .await;
    let body = serde_json::to_vec(&json!({"prompt": "slow", "max_tokens": 30})).unwrap();
    let mut in_flight = Vec::new();
    for _ in 0..3 {
        let http = reqwest_lite::Http::new(c.proxy.url());
        let body = body.clone();
        in_flight.push(tokio::spawn(async move {
            http.request("POST", "/v1/completions", body).await
        }));
        held.arrived().await;
    }
    let (status, retry, out) = c.http.request("POST", "/v1/completions", body.clone()).await;
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&out));
    assert_eq!(retry.as_deref(), Some("1"));
    assert_eq!(error(&out).code_name(), Some("overloaded"));
    held.release(3);
    for t in in_flight {
        let (status, _, out) = t.await.unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    }
    c.assert_drained().await;
    // Capacity is back.
    held.release(1);
    let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    let metrics = c.http.get("/metrics").await;
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"rejected\""),
        1.0
    );
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        4.0
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_json_errors_naming_the_problem() {
    let c = cluster(1, 20.0, |config| {
        config.limits.max_body_bytes = 1000;
        config.limits.max_prompt_tokens = 50;
    })
    .await;
    let cases: &[(&str, &[u8], u16, &str)] = &[
        ("/v1/completions", b"{not json", 400, "body"),
        ("/v1/completions", b"{}", 400, "prompt"),
        ("/v1/completions", br#"{"prompt": [1, -2]}"#, 400, "prompt"),
        (
            "/v1/completions",
            br#"{"prompt": "x", "stream": 3}"#,
            400,
            "stream",
        ),
        ("/v1/chat/completions", br#"{"messages": "hi"}"#, 400, "messages"),
        (
            "/v1/chat/completions",
            br#"{"messages": [{"role": "user", "content": 5}]}"#,
            400,
            "messages",
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, _, out) = c.http.request("POST", path, body.to_vec()).await;
        assert_eq!(got, *status, "{}", String::from_utf8_lossy(body));
        let err = error(&out);
        assert_eq!(err.param.as_deref(), Some(*param), "{err:?}");
        assert!(err.message.len() > 5);
    }
    let long = serde_json::to_vec(&json!({"prompt": "y".repeat(60)})).unwrap();
    let (got, _, out) = c.http.request("POST", "/v1/completions", long).await;
    assert_eq!(got, 400);
    assert_eq!(error(&out).code_name(), Some("context_length_exceeded"));
    let huge = serde_json::to_vec(&json!({"prompt": "z".repeat(2000)})).unwrap();
    let (got, _, out) = c.http.request("POST", "/v1/completions", huge).await;
    assert_eq!(got, 413);
    assert_eq!(error(&out).code_name(), Some("body_too_large"));
    let (got, _, _) = c.http.request("GET", "/v1/nothing", Vec::new()).await;
    assert_eq!(got, 404);
    // The admin API is not on the inference port.
    for (method, path) in [("GET", "/admin/workers"), ("POST", "/admin/workers/0/drain")] {
        let (got, _, out) = c.http.request(method, path, Vec::new()).await;
        assert_eq!(got, 404, "{method} {path} on the inference port");
        assert_eq!(error(&out).code_name(), Some("not_found"));
    }
    // Admin: draining the only worker would leave nothing to serve: refused (409, with the
    // reason) unless forced.
    let (got, _, out) = c
        .admin
        .request("POST", "/admin/workers/0/drain", Vec::new())
        .await;
    assert_eq!(got, 409, "{}", String::from_utf8_lossy(&out));
    let err = error(&out);
    assert_eq!(err.code_name(), Some("fleet_unservable"), "{err:?}");
    assert!(err.message.contains("no worker"), "{}", err.message);
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    assert_eq!(
        workers["workers"][0]["state"], "ready",
        "refused means not applied"
    );
    // Forced: requests then find no worker (503), and removal works.
    let (got, _, _) = c
        .admin
        .request("POST", "/admin/workers/0/drain?force=true", Vec::new())
        .await;
    assert_eq!(got, 200);
    // Nothing in flight: the drain is complete at once.
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    assert_eq!(workers["workers"][0]["state"], "drained", "{workers}");
    let (got, _, out) = c
        .http
        .request("POST", "/v1/completions", br#"{"prompt": "x"}"#.to_vec())
        .await;
    assert_eq!(got, 503, "{}", String::from_utf8_lossy(&out));
    let (got, _, _) = c.http.request("GET", "/health", Vec::new()).await;
    assert_eq!(got, 503);
    let (got, _, _) = c.admin.request("DELETE", "/admin/workers/0", Vec::new()).await;
    assert_eq!(got, 200);
    let (got, _, _) = c.admin.request("DELETE", "/admin/workers/0", Vec::new()).await;
    assert_eq!(got, 404);
    let add = serde_json::to_vec(&json!({"url": c.mocks[0].url()})).unwrap();
    let (got, _, out) = c.admin.request("POST", "/admin/workers", add).await;
    assert_eq!(got, 201, "{}", String::from_utf8_lossy(&out));
    // A prefill worker without decode workers would make every request fail: refused.
    let prefill = serde_json::to_vec(&json!({"url": "http://127.0.0.1:1", "role": "prefill"})).unwrap();
    let (got, _, out) = c.admin.request("POST", "/admin/workers", prefill).await;
    assert_eq!(got, 409, "{}", String::from_utf8_lossy(&out));
    assert_eq!(error(&out).code_name(), Some("fleet_unservable"));
    let (got, _, _) = c
        .http
        .request(
            "POST",
            "/v1/completions",
            br#"{"prompt": "x", "max_tokens": 1}"#.to_vec(),
        )
        .await;
    assert_eq!(got, 200);
    let bad_worker = serde_json::to_vec(&json!({"url": "http://127.0.0.1:1", "colour": "red"})).unwrap();
    let (got, _, _) = c.admin.request("POST", "/admin/workers", bad_worker).await;
    assert_eq!(got, 400);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positional_events_from_older_engines_feed_the_router_too() {
    let mut mc = MockConfig::new(2);
    mc.engine.speedup = 20.0;
    mc.encoding = kvroute_wire::EventEncoding::Positional;
    let c = cluster_of(mc, |_| {}).await;
    let prompt: String = (0..480).map(|i| char::from(b'a' + (i * 11 % 26) as u8)).collect();
    let body = serde_json::to_vec(&json!({"prompt": prompt, "max_tokens": 1})).unwrap();
    let (status, _, _) = c.http.request("POST", "/v1/completions", body.clone()).await;
    assert_eq!(status, 200);
    c.wait_for_cached_blocks(None, 30).await;
    let (_, _, out) = c.http.request("POST", "/v1/completions", body).await;
    assert_eq!(completion(&out).usage.unwrap().cached_tokens(), 464);
    c.assert_drained().await;
}

/// `kvroute serve --policy kv:staged:scale=2 --cache approximate` serves, routing on its own
/// decisions alone (the mocks' KV events are refused); `kvroute replay` with the same flags
/// simulates the same router, and the serve flags its report names run that router again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_spec_with_the_approximate_view_serves_as_replay_simulates_it() {
    use clap::Parser;
    use kvroute_core::router::{RouterConfig, RouterSpec};

    #[derive(Parser)]
    struct Serve {
        #[command(flatten)]
        serve: kvroute::serve::ServeArgs,
    }
    #[derive(Parser)]
    struct Replay {
        #[command(flatten)]
        replay: kvroute::replay::ReplayArgs,
    }
    let router = [
        "--policy",
        "kv:staged:scale=2",
        "--cache",
        "approximate",
        "--block-size",
        "16",
    ];
    let mocks = start_mocks(&MockConfig::new(2)).await;
    let worker_flags: Vec<String> = mocks.iter().map(|m| m.worker_flag()).collect();
    let mut argv = vec![
        "serve",
        "--approximate-tokenizer",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ];
    argv.extend(router);
    for w in &worker_flags {
        argv.extend(["--worker", w.as_str()]);
    }
    let config = Serve::parse_from(argv).serve.to_config().unwrap();
    let served = config.validate().unwrap();
    let c = fronting(Vec::new(), mocks, move |c| *c = config).await;

    let prompt = "A prompt long enough to fill several blocks of sixteen tokens each, twice over. ";
    for _ in 0..3 {
        let done = c
            .complete(json!({"model": "tiny", "prompt": prompt, "max_tokens": 4}))
            .await;
        assert_eq!(done.usage.unwrap().completion_tokens, 4);
    }
    let metrics = c.http.get("/metrics").await;
    assert!(
        metric(&metrics, "kvroute_worker_predicted_cached_tokens_total", "") >= 32.0,
        "the repeated prompt was predicted cached from the router's own decisions:\n{metrics}"
    );
    assert_eq!(
        c.cached_blocks().iter().sum::<u64>(),
        0,
        "an approximate view keeps no index of KV events"
    );
    c.assert_drained().await;

    // The replay of the same flags: the same router (but for the live index's memory bound),
    // simulated, and its report's serve flags make that router again.
    let dir = kvroute_testkit::Scratch::new("e2e-spec");
    let report = dir.join("report.json");
    let mut argv = vec!["replay", "--workers", "2", "--limit", "40"];
    argv.extend(router);
    let report_flag = report.to_str().unwrap().to_owned();
    argv.extend(["--report-json", &report_flag]);
    let replay = Replay::parse_from(argv).replay;
    let simulated = kvroute::replay::router_configs(&replay).unwrap();
    let expected = RouterConfig {
        max_blocks_per_worker: None,
        ..served.clone()
    };
    assert_eq!(
        simulated,
        vec![("kv:staged:scale=2".to_owned(), expected.clone())]
    );
    tokio::task::spawn_blocking(move || kvroute::replay::run(replay))
        .await
        .unwrap()
        .unwrap();
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(json["num_requests"].as_u64(), Some(40), "{json}");
    let flags = json["provenance"]["serve_flags"]["kv:staged:scale=2"]
        .as_str()
        .unwrap();
    assert_eq!(flags, RouterSpec::from_config(&expected).unwrap().to_string());
    let mut argv = vec!["serve", "--approximate-tokenizer"];
    argv.extend(flags.split(' '));
    let again = Serve::parse_from(argv)
        .serve
        .to_config()
        .unwrap()
        .validate()
        .unwrap();
    assert_eq!(again, served);
}
