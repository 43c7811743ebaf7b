//! End to end on loopback, prefill/decode disaggregation: `kvroute serve` in front of mock
//! prefill and decode workers, in vLLM's two-hop flow and SGLang's bootstrap pairs (the harness:
//! `support/cluster.rs`).

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/cluster.rs"]
mod cluster;

use cluster::*;

/// `prefill` prefill workers and `decode` decode workers (engines at `speedup`) behind a proxy.
async fn disagg_cluster(
    prefill: usize,
    decode: usize,
    speedup: f64,
    tweak: impl FnOnce(&mut ServeConfig),
) -> Cluster {
    let mut mc = MockConfig::new(decode);
    mc.prefill_workers = prefill;
    mc.engine.speedup = speedup;
    cluster_of(mc, tweak).await
}

impl Cluster {
    /// The requests of the two-hop flow the mocks saw: (hop 1 on prefill workers, hop 2 on
    /// decode workers).
    fn kv_requests(&self) -> (Vec<mock::SeenKvRequest>, Vec<mock::SeenKvRequest>) {
        let mut hops = (Vec::new(), Vec::new());
        for m in &self.mocks {
            for seen in m.seen_kv_requests() {
                if seen.remote_decode {
                    assert_eq!(m.role.name(), "prefill", "hop 1 went to a prefill worker");
                    hops.0.push(seen);
                } else {
                    assert_eq!(m.role.name(), "decode", "hop 2 went to a decode worker");
                    hops.1.push(seen);
                }
            }
        }
        hops
    }

    /// A metric summed over every mock worker's `/metrics`.
    async fn mock_metric(&self, name: &str) -> f64 {
        let mut sum = 0.0;
        for m in &self.mocks {
            let text = reqwest_lite::Http::new(m.url()).get("/metrics").await;
            sum += metric(&text, name, "");
        }
        sum
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_fleet_serves_chat_and_completions_through_two_hops() {
    // One decode worker, so a repeated prompt finds its blocks there whatever the policy's
    // tie-break (decode workers are chosen by load alone, as in Dynamo's decode pool).
    let c = disagg_cluster(2, 1, 20.0, |_| {}).await;
    let client = c.client();
    let chat = chat_request("Hello there, disaggregated router.", 8);
    let response = client.chat().create(chat.clone()).await.unwrap();
    assert_eq!(response.choices[0].message.content.as_deref().unwrap().len(), 8);
    assert_eq!(response.usage.unwrap().completion_tokens, 8);
    let (streamed, _) = stream_chat(&client, chat).await;
    assert_eq!(streamed.len(), 8, "{streamed:?}");

    // 320 bytes: 20 full blocks of the byte-level tiny tokenizer.
    let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 3 % 26) as u8)).collect();
    let completion = completion_request(&prompt, 5);
    let response = client.completions().create(completion.clone()).await.unwrap();
    assert_eq!(response.choices[0].text.len(), 5);
    let usage = response.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (320, 5));
    let cached = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
    assert_eq!(
        cached.unwrap_or(0),
        0,
        "nothing was cached on the decode worker yet"
    );
    // The decode worker's import stored the prompt's blocks; a repeat's import finds every
    // block there.
    c.wait_for_cached_blocks(Some(2), 20).await;
    assert_eq!(stream_completion(&client, completion).await.len(), 5);
    // The cached tokens of an import, through the raw API (usage in the stream).
    let out = c
        .complete(json!({"prompt": prompt, "max_tokens": 3, "min_tokens": 3}))
        .await;
    assert_eq!(
        out.usage.unwrap().cached_tokens(),
        320,
        "the decode worker held all 20 blocks: nothing crossed the link"
    );
    assert!(out.kv_transfer_params.is_none());

    // What the workers saw: 5 requests, each hop 1 then hop 2 under one request id.
    let (hop1, hop2) = c.kv_requests();
    assert_eq!((hop1.len(), hop2.len()), (5, 5));
    let ids = |hops: &[mock::SeenKvRequest]| {
        let mut ids: Vec<String> = hops.iter().map(|h| h.request_id.clone().unwrap()).collect();
        ids.sort();
        ids
    };
    assert_eq!(ids(&hop1), ids(&hop2));
    let remote_decode = kvroute_http::disagg::remote_decode_params();
    for h in &hop1 {
        assert_eq!(h.body["max_tokens"], 1, "{}", h.body);
        assert_eq!(h.body["stream"], false, "{}", h.body);
        assert!(h.body.get("stream_options").is_none(), "{}", h.body);
        assert!(h.body.get("min_tokens").is_none(), "{}", h.body);
        assert_eq!(h.body["kv_transfer_params"], remote_decode);
    }
    let prefill_engines: Vec<String> = c
        .mocks
        .iter()
        .filter(|m| m.role.name() == "prefill")
        .map(|m| format!("kvroute-mock-{}", m.addr))
        .collect();
    for h in &hop2 {
        let params = &h.body["kv_transfer_params"];
        assert_eq!(params["do_remote_prefill"], true, "{}", h.body);
        assert_eq!(params["do_remote_decode"], false);
        assert!(
            prefill_engines.iter().any(|e| params["remote_engine_id"] == *e),
            "{params}"
        );
        assert_eq!(params["remote_request_id"].as_str(), h.request_id.as_deref());
        assert!(
            h.body["max_tokens"].as_u64().unwrap() > 1,
            "the client's own max_tokens"
        );
    }
    let last = hop2.iter().find(|h| h.body["max_tokens"] == 3).unwrap();
    assert_eq!(last.body["min_tokens"], 3, "hop 2 keeps min_tokens");
    assert_eq!(
        last.body["kv_transfer_params"]["remote_block_ids"],
        json!((0..20).collect::<Vec<u32>>())
    );

    assert_eq!(
        c.mock_metric("kvroute_mock_remote_decode_requests_total").await,
        5.0
    );
    assert_eq!(c.mock_metric("kvroute_mock_kv_imports_total").await, 5.0);
    assert!(c.mock_metric("kvroute_mock_kv_import_hit_blocks_total").await >= 20.0);
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_disaggregated_requests_total", ""), 5.0);
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        5.0
    );
    assert!(
        metric(
            &metrics,
            "dynamo_component_router_time_to_first_token_seconds_count",
            ""
        ) >= 2.0,
        "streamed requests measure TTFT at hop 2's first chunk"
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_prefill_worker_is_retried_around_and_taken_out_of_routing() {
    for protocol in [EngineKind::Vllm, EngineKind::Sglang] {
        // No health checks: the dead worker leaves routing by the failed connect, not by a
        // prober that may or may not have run before the request.
        let c = disagg_cluster(1, 1, 20.0, |config| {
            config.routing.disagg_protocol = protocol;
            config.upstream.health_interval_ms = 0;
        })
        .await;
        c.mocks[0].kill();
        let body =
            serde_json::to_vec(&json!({"prompt": "to a dead prefill worker", "max_tokens": 4})).unwrap();
        // vLLM's hop 1, or the prefill side of SGLang's pair (whose decode side is dropped with
        // it), cannot connect: the prefill worker leaves routing and the request is routed once
        // more, to the decode worker alone, which prefills itself.
        let (status, _, out) = c.http.request("POST", "/v1/completions", body.clone()).await;
        assert_eq!(status, 200, "{protocol:?}: {}", String::from_utf8_lossy(&out));
        assert_eq!(completion_tokens(&out), 4, "{protocol:?}");
        c.assert_drained().await;
        let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
        assert_eq!(status, 200, "{protocol:?}: {}", String::from_utf8_lossy(&out));
        let metrics = c.http.get("/metrics").await;
        assert_eq!(
            metric(&metrics, "kvroute_disaggregated_requests_total", ""),
            1.0,
            "{protocol:?}: only the first routing chose the prefill worker"
        );
        assert_eq!(metric(&metrics, "kvroute_upstream_retries_total", ""), 1.0);
        assert_eq!(
            metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
            2.0
        );
        let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
        assert_eq!(
            workers["workers"][0]["routable"], false,
            "{protocol:?}: {workers}"
        );
        if protocol == EngineKind::Vllm {
            assert_eq!(c.kv_requests().1.len(), 0, "no hop 2 without a hop 1");
        }
        c.assert_drained().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_decode_worker_of_an_sglang_pair_is_routed_around() {
    // One prefill and two decode workers, one of them dead: whichever decode worker a request
    // is first paired with, it is answered, and a pair sent to the dead one is re-routed once.
    // No health checks: whether the dead worker is routed to depends on the policy alone, not
    // on whether a prober ran first.
    let c = disagg_cluster(1, 2, 20.0, |config| {
        config.routing.disagg_protocol = EngineKind::Sglang;
        config.upstream.health_interval_ms = 0;
    })
    .await;
    c.mocks[2].kill();
    for i in 0..4 {
        let out = c
            .complete(json!({"prompt": format!("request {i} of a pair"), "max_tokens": 3}))
            .await;
        assert_eq!(out.usage.unwrap().completion_tokens, 3);
    }
    let metrics = c.http.get("/metrics").await;
    let retries = metric(&metrics, "kvroute_upstream_retries_total", "");
    let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
    let dead_routable = workers["workers"][2]["routable"].as_bool().unwrap();
    assert!(
        (retries == 1.0 && !dead_routable) || (retries == 0.0 && dead_routable),
        "retries {retries}, the dead worker routable: {dead_routable}"
    );
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_unreachable_prefill_worker_fails_the_request_cleanly() {
    // Two prefill workers, both dead, and a decider that always disaggregates: the retry meets
    // the second dead worker, and the request ends with a 502 naming it.
    // No health checks: a prober that ran first would take both out before the request.
    let c = disagg_cluster(2, 1, 20.0, |config| {
        config.routing.decider = "always".to_owned();
        config.upstream.health_interval_ms = 0;
    })
    .await;
    c.mocks[0].kill();
    c.mocks[1].kill();
    let body =
        serde_json::to_vec(&json!({"prompt": "to two dead prefill workers", "max_tokens": 4})).unwrap();
    let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&out));
    let err = error(&out);
    assert_eq!(err.code_name(), Some("prefill_failed"), "{err:?}");
    assert_eq!(err.kind, "upstream_error");
    assert!(err.message.contains("prefill worker"), "{err:?}");
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_disaggregated_requests_total", ""), 2.0);
    assert_eq!(metric(&metrics, "kvroute_upstream_retries_total", ""), 1.0);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_the_prefill_hop_frees_its_load() {
    // The prefill worker is a stub that holds hop 1 until the test is done: the client leaves
    // while it is held.
    let mut held = Held::start().await;
    let prefill = WorkerConfig {
        role: "prefill".to_owned(),
        ..WorkerConfig::new(held.url.clone())
    };
    let mut mc = MockConfig::new(1);
    mc.engine.speedup = 20.0;
    let mocks = mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap();
    let c = fronting(vec![prefill], mocks, |config| {
        config.routing.decider = "always".to_owned();
        config.workers[1].role = "decode".to_owned();
        config.upstream.request_timeout_ms = PATIENCE.as_millis() as u64;
    })
    .await;
    let body = serde_json::to_vec(&json!({"prompt": "leave me", "max_tokens": 4, "stream": true})).unwrap();
    let http = reqwest_lite::Http::new(c.proxy.url());
    let task = tokio::spawn(async move { http.request("POST", "/v1/completions", body).await });
    let hop1 = held.arrived().await;
    assert_eq!(hop1["kv_transfer_params"]["do_remote_decode"], true, "{hop1}");
    assert_eq!(c.proxy.driver.snapshot().active_now, 1);
    task.abort();
    c.assert_drained().await;
    assert!(c.kv_requests().1.is_empty(), "the client left before hop 2");
    held.release(1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deciders_choose_which_requests_take_the_prefill_hop() {
    let short = "a short prompt"; // 14 tokens
    let long: String = (0..200).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    // (decider, prompts, disaggregated)
    let cases: &[(&str, &[&str], f64)] = &[
        ("never", &[short, long.as_str(), short], 0.0),
        ("64", &[short, long.as_str()], 1.0),
        ("always", &[short], 1.0),
    ];
    for &(decider, prompts, want) in cases {
        let c = disagg_cluster(1, 1, 20.0, |config| config.routing.decider = decider.to_owned()).await;
        for p in prompts {
            let body = serde_json::to_vec(&json!({"prompt": p, "max_tokens": 3})).unwrap();
            let (status, _, out) = c.http.request("POST", "/v1/completions", body).await;
            assert_eq!(status, 200, "{decider}: {}", String::from_utf8_lossy(&out));
            assert_eq!(completion_tokens(&out), 3);
        }
        let metrics = c.http.get("/metrics").await;
        assert_eq!(
            metric(&metrics, "kvroute_disaggregated_requests_total", ""),
            want,
            "{decider}"
        );
        let (hop1, hop2) = c.kv_requests();
        assert_eq!((hop1.len() as f64, hop2.len() as f64), (want, want), "{decider}");
        assert_eq!(
            c.mock_metric("kvroute_mock_remote_decode_requests_total").await,
            want,
            "{decider}: nothing else reached the prefill worker"
        );
        assert_eq!(
            c.mock_metric("vllm:request_success_total").await,
            prompts.len() as f64 + want,
            "{decider}: every request ran once on the decode worker, plus its prefills"
        );
        c.assert_drained().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_prefill_hop_ends_the_request_and_frees_its_load() {
    let long: String = (0..1500)
        .map(|i| char::from(b'a' + (i * 11 % 26) as u8))
        .collect();
    /// The prefill worker of a case.
    enum Prefill {
        /// A mock whose context (1,000 tokens) the prompt exceeds: it answers 400.
        Refusing,
        /// A stub that holds hop 1 until the case is over: the request times out, whatever
        /// the machine's speed.
        Held,
    }
    // (prefill worker, proxy request timeout ms, status, error code, in the message)
    let cases = [
        (
            Prefill::Refusing,
            600_000,
            502,
            "prefill_failed",
            "answered 400 Bad Request",
        ),
        (
            Prefill::Held,
            100,
            504,
            "prefill_timeout",
            "did not answer in time",
        ),
    ];
    for (prefill, timeout_ms, status, code, says) in cases {
        let mut held = None;
        let c = match prefill {
            Prefill::Refusing => {
                let mut mc = MockConfig::new(1);
                mc.prefill_workers = 1;
                mc.engine.speedup = 20.0;
                mc.engine.max_model_len = 1000;
                cluster_of(mc, |config| config.upstream.request_timeout_ms = timeout_ms).await
            }
            Prefill::Held => {
                let stub = Held::start().await;
                let prefill = WorkerConfig {
                    role: "prefill".to_owned(),
                    ..WorkerConfig::new(stub.url.clone())
                };
                held = Some(stub);
                let mut mc = MockConfig::new(1);
                mc.engine.speedup = 20.0;
                let mocks = mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap();
                fronting(vec![prefill], mocks, |config| {
                    config.routing.decider = "always".to_owned();
                    config.workers[1].role = "decode".to_owned();
                    config.upstream.request_timeout_ms = timeout_ms;
                })
                .await
            }
        };
        let body = serde_json::to_vec(&json!({"prompt": long, "max_tokens": 4, "stream": true})).unwrap();
        let (got, _, out) = c.http.request("POST", "/v1/completions", body).await;
        assert_eq!(got, status, "{code}: {}", String::from_utf8_lossy(&out));
        let err = error(&out);
        assert_eq!(err.code_name(), Some(code), "{err:?}");
        assert!(
            err.message.contains("prefill worker") && err.message.contains(says),
            "{}",
            err.message
        );
        assert!(c.kv_requests().1.is_empty(), "{code}: no hop 2");
        c.assert_drained().await;
        let workers: Value = serde_json::from_str(&c.admin.get("/admin/workers").await).unwrap();
        assert_eq!(
            workers["workers"][0]["routable"], true,
            "{code}: a prefill worker that answered stays in routing"
        );
        if let Some(mut held) = held {
            let hop1 = held.arrived().await;
            assert_eq!(hop1["kv_transfer_params"]["do_remote_decode"], true, "{hop1}");
            held.release(1);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_waits_for_free_blocks_on_a_full_decode_worker() {
    // 30 blocks per engine: one 320-token prompt (20 blocks) decoding 40 tokens holds 20 to
    // 23, so the second import (20 more) waits until the first request frees its blocks. The
    // prefill worker, as small, prefills them one after the other.
    let mut mc = MockConfig::new(1);
    mc.prefill_workers = 1;
    mc.engine.speedup = 20.0;
    mc.engine.num_blocks = 30;
    mc.engine.max_model_len = 480;
    let c = cluster_of(mc, |_| {}).await;
    let mut tasks = Vec::new();
    for k in 0..2u8 {
        let prompt: String = (0..320)
            .map(|i| char::from(b'a' + ((i * 7 + usize::from(k)) % 26) as u8))
            .collect();
        let body = serde_json::to_vec(&json!({"prompt": prompt, "max_tokens": 40})).unwrap();
        let http = reqwest_lite::Http::new(c.proxy.url());
        tasks.push(tokio::spawn(async move {
            http.request("POST", "/v1/completions", body).await
        }));
    }
    for t in tasks {
        let (status, _, out) = t.await.unwrap();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
        assert_eq!(completion_tokens(&out), 40);
    }
    assert_eq!(c.mock_metric("kvroute_mock_kv_imports_total").await, 2.0);
    assert_eq!(
        c.mock_metric("kvroute_mock_kv_import_transfer_blocks_total")
            .await,
        40.0,
        "20 blocks each, none cached"
    );
    assert_eq!(c.mock_metric("kvroute_mock_kv_import_waits_total").await, 1.0);
    c.assert_drained().await;
}

// ---- SGLang's bootstrap protocol ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_pairs_send_one_bootstrap_room_to_both_workers() {
    // One decode worker, so a repeated prompt finds its blocks there whatever the policy's
    // tie-break (decode workers are chosen by load alone).
    let c = disagg_cluster(2, 1, 20.0, |config| {
        config.routing.disagg_protocol = EngineKind::Sglang;
        // One prefill worker names its bootstrap port, the other leaves it to the engine.
        config.workers[0].bootstrap_port = Some(8998);
    })
    .await;
    let client = c.client();
    let chat = chat_request("Hello there, SGLang pair.", 8);
    let response = client.chat().create(chat.clone()).await.unwrap();
    assert_eq!(response.choices[0].message.content.as_deref().unwrap().len(), 8);
    let (streamed, _) = stream_chat(&client, chat).await;
    assert_eq!(streamed.len(), 8, "{streamed:?}");
    // 320 bytes: 20 full blocks of the byte-level tiny tokenizer.
    let prompt: String = (0..320).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect();
    let completion = completion_request(&prompt, 5);
    assert_eq!(stream_completion(&client, completion).await.len(), 5);
    // The decode worker's import stored the prompt; a repeat's import finds every block there.
    c.wait_for_cached_blocks(Some(2), 20).await;
    let usage = c
        .complete(json!({"prompt": prompt, "max_tokens": 3}))
        .await
        .usage
        .unwrap();
    assert_eq!((usage.completion_tokens, usage.cached_tokens()), (3, 320));

    // Each request went to one prefill and one decode worker with the same body: the same
    // room (below 2^63), the prefill worker's host and its bootstrap port (or null), the
    // same request id, and the client's own fields (stream, max_tokens).
    let (prefills, decodes) = c.kv_requests();
    assert_eq!((prefills.len(), decodes.len()), (4, 4));
    let mut rooms = std::collections::HashSet::new();
    for d in &decodes {
        let room = d.body["bootstrap_room"].as_u64().unwrap();
        assert!(room < 1 << 63);
        assert!(rooms.insert(room), "one room per request");
        let p = prefills
            .iter()
            .find(|p| p.body["bootstrap_room"] == room)
            .expect("the prefill worker got the same room");
        assert_eq!(p.body, d.body, "both workers get one body");
        assert_eq!(p.request_id, d.request_id);
        assert_eq!(d.body["bootstrap_host"], "127.0.0.1");
        assert!(d.body.get("kv_transfer_params").is_none());
    }
    let ports = |i: usize| -> Vec<Value> {
        c.mocks[i]
            .seen_kv_requests()
            .iter()
            .map(|s| s.body["bootstrap_port"].clone())
            .collect()
    };
    assert!(ports(0).iter().all(|p| *p == 8998), "{:?}", ports(0));
    assert!(ports(1).iter().all(Value::is_null), "{:?}", ports(1));
    assert!(
        decodes
            .iter()
            .any(|d| d.body["stream"] == true && d.body["max_tokens"] == 8)
    );
    assert!(decodes.iter().any(|d| d.body["max_tokens"] == 3));

    assert_eq!(
        c.mock_metric("kvroute_mock_remote_decode_requests_total").await,
        4.0
    );
    assert_eq!(c.mock_metric("kvroute_mock_kv_imports_total").await, 4.0);
    let metrics = c.http.get("/metrics").await;
    assert_eq!(metric(&metrics, "kvroute_disaggregated_requests_total", ""), 4.0);
    assert_eq!(
        metric(&metrics, "dynamo_frontend_requests_total", "status=\"success\""),
        4.0
    );
    c.assert_drained().await;
}
