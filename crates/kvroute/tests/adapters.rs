//! LoRA adapters and cache salts end to end: mock workers serving different adapters (listed on
//! their `/v1/models` as vLLM lists them) behind one proxy. A request naming an adapter reaches
//! a worker that serves it, and the router's predicted cached tokens equal the engine's
//! reported ones under adapters and salts alike (the block hashes are salted as the engine's
//! are); an adapter loaded at run time becomes routable, and unloaded stops being; a salted
//! request never predicts a hit on another salt's blocks; a chat conversation under changing salts
//! is predicted as the engine reports, turn after turn.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/answers.rs"]
mod answers;
#[path = "support/cluster.rs"]
mod cluster;

use answers::{Answer, Proxy};
use cluster::*;

/// A long prompt: several full 16-token blocks of the tiny model's tokens, and a partial one.
fn prompt(topic: &str) -> String {
    format!(
        "{topic}: {}",
        "the quick brown fox jumps over the lazy dog. ".repeat(6)
    )
}

/// Mock workers 0 and 1 serve adapter `sql`, worker 1 `chat` too, worker 2 none; `tweak`
/// applied to the proxy's configuration, with the debug headers on.
async fn fleet() -> Cluster {
    let mut mocks = Vec::new();
    for adapters in [&["sql"][..], &["sql", "chat"], &[]] {
        let mut mc = MockConfig::new(1);
        mc.engine.speedup = 20.0;
        mc.lora_modules = adapters
            .iter()
            .map(|a| format!("{a}=/adapters/{a}").parse().unwrap())
            .collect();
        mocks.extend(start_mocks(&mc).await);
    }
    fronting(Vec::new(), mocks, |c| c.server.debug_headers = true).await
}

/// Whether the router's index comes to hold more than `before` blocks over the fleet in time.
async fn more_blocks_than(c: &Cluster, before: u64) -> bool {
    c.proxy
        .driver
        .wait_for_kv(PATIENCE, |_| c.cached_blocks().iter().sum::<u64>() > before)
        .await
}

/// Sends `body` once to store its blocks, waits until the router's index holds them, and sends
/// it again; the second answer.
async fn twice(c: &Cluster, p: &Proxy, body: Value) -> (Answer, Answer) {
    let before: u64 = c.cached_blocks().iter().sum();
    let first = p.complete(body.clone(), &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(
        more_blocks_than(c, before).await,
        "the first request's blocks never reached the index"
    );
    let again = p.complete(body, &[]).await;
    assert_eq!(again.status, 200, "{}", again.body);
    (first, again)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_adapter_request_reaches_a_worker_that_serves_it_predicted_as_the_engine_reports() {
    let c = fleet().await;
    let p = Proxy::new(&c.proxy);
    p.until_listed("sql", true).await;
    p.until_listed("chat", true).await;
    assert_eq!(
        p.models().await,
        [
            ("tiny".to_owned(), None),
            ("chat".to_owned(), Some("tiny".to_owned())),
            ("sql".to_owned(), Some("tiny".to_owned())),
        ]
    );
    let (status, card) = p.get("/v1/models/sql").await;
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_eq!((status, card["parent"].as_str()), (200, Some("tiny")));
    assert_eq!(card["root"].as_str(), Some("/adapters/sql"));

    let serving = |adapter: &str| -> &[u64] {
        match adapter {
            "sql" => &[0, 1],
            "chat" => &[1],
            _ => &[0, 1, 2],
        }
    };
    for model in ["sql", "chat", "tiny"] {
        for round in 0..3 {
            let text = prompt(&format!("{model} round {round}"));
            let (first, again) =
                twice(&c, &p, json!({"model": model, "prompt": text, "max_tokens": 2})).await;
            for a in [&first, &again] {
                let worker = a.worker.unwrap();
                assert!(
                    serving(model).contains(&worker),
                    "{model} went to worker {worker}"
                );
            }
            assert_eq!(again.worker, first.worker, "{model}: the cached prefix decides");
            assert!(again.reported > 0, "{model}: the engine hit its cache");
            assert_eq!(again.predicted, Some(again.reported), "{model}: {again:?}");
        }
    }
    // The same text under another adapter or the base model is another prefix, for the
    // router as for the engine: whichever worker takes it, the prediction is what it reports.
    let text = prompt("shared");
    let (_, again) = twice(&c, &p, json!({"model": "sql", "prompt": text, "max_tokens": 2})).await;
    assert!(again.reported > 0);
    for model in ["chat", "tiny"] {
        let a = p
            .complete(json!({"model": model, "prompt": text, "max_tokens": 2}), &[])
            .await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.predicted, Some(a.reported), "{model}: {a:?}");
        assert_eq!(a.reported, 0, "{model} shares no block with sql");
    }

    // A model nobody serves is OpenAI's 404, as before.
    let a = p
        .complete(json!({"model": "nope", "prompt": "hi", "max_tokens": 2}), &[])
        .await;
    assert_eq!(a.status, 404, "{}", a.body);
    assert_eq!(p.get("/v1/models/nope").await.0, 404);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_loaded_at_run_time_becomes_routable_and_unloaded_stops_being() {
    let c = fleet().await;
    let p = Proxy::new(&c.proxy);
    p.until_listed("sql", true).await;
    let late = json!({"model": "late", "prompt": prompt("late"), "max_tokens": 2});
    assert_eq!(p.complete(late.clone(), &[]).await.status, 404);

    // Worker 2 loads it, as vLLM does at run time.
    let mock = reqwest_lite::Http::new(c.mocks[2].url());
    let load =
        |name: &str| serde_json::to_vec(&json!({"lora_name": name, "lora_path": "/adapters/late"})).unwrap();
    let (status, _, body) = mock.request("POST", "/v1/load_lora_adapter", load("late")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let (status, _, body) = mock.request("POST", "/v1/load_lora_adapter", load("late")).await;
    assert_eq!(status, 400, "loaded twice: {}", String::from_utf8_lossy(&body));
    p.until_listed("late", true).await;
    for _ in 0..4 {
        let a = p.complete(late.clone(), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.worker, Some(2), "only worker 2 serves it");
        assert_eq!(a.predicted, Some(a.reported));
    }

    let unload = serde_json::to_vec(&json!({"lora_name": "late"})).unwrap();
    let (status, _, _) = mock
        .request("POST", "/v1/unload_lora_adapter", unload.clone())
        .await;
    assert_eq!(status, 200);
    let (status, _, body) = mock.request("POST", "/v1/unload_lora_adapter", unload).await;
    assert_eq!(status, 404, "unloaded twice: {}", String::from_utf8_lossy(&body));
    p.until_listed("late", false).await;
    assert_eq!(p.complete(late, &[]).await.status, 404);
    c.assert_drained().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_request_never_predicts_a_hit_on_another_salts_blocks() {
    // One worker: every request meets every block the engine holds.
    let c = cluster(1, 20.0, |c| c.server.debug_headers = true).await;
    let p = Proxy::new(&c.proxy);
    let text = prompt("salted");
    let body = |salt: Option<&str>| {
        let mut b = json!({"prompt": text, "max_tokens": 2});
        if let Some(salt) = salt {
            b["cache_salt"] = json!(salt);
        }
        b
    };
    let (first, again) = twice(&c, &p, body(Some("a"))).await;
    assert_eq!((first.predicted, first.reported), (Some(0), 0));
    assert!(again.reported > 0, "the same salt hits");
    assert_eq!(again.predicted, Some(again.reported));
    for salt in [Some("b"), None, Some("a-"), Some("A")] {
        let before: u64 = c.cached_blocks().iter().sum();
        let a = p.complete(body(salt), &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(
            (a.predicted, a.reported),
            (Some(0), 0),
            "salt {salt:?} shares no block with salt a"
        );
        // Its blocks (a prefix of their own) reach the index before the next request.
        let stored = c
            .proxy
            .driver
            .wait_for_kv(PATIENCE, |_| c.cached_blocks().iter().sum::<u64>() > before)
            .await;
        assert!(stored, "salt {salt:?}: its blocks never reached the index");
    }
    // Salt a's blocks are still there, and still predicted as the engine finds them.
    let a = p.complete(body(Some("a")), &[]).await;
    assert!(a.reported > 0);
    assert_eq!(a.predicted, Some(a.reported));
    // Unsalted, the prefix stored above is found again.
    let a = p.complete(body(None), &[]).await;
    assert!(a.reported > 0);
    assert_eq!(a.predicted, Some(a.reported));
    c.assert_drained().await;
}

/// A chat conversation through the proxy, turn after turn, under one salt, another, none and
/// the first again (its follow-ups hashed after the block hashes the conversation cache kept
/// for its previous turn): every turn's predicted cached tokens equal the engine's, and a
/// follow-up under its previous turn's salt hits that turn's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_salted_conversation_is_predicted_as_the_engine_reports_turn_after_turn() {
    // One worker: every request meets every block the engine holds.
    let c = cluster(1, 20.0, |c| c.server.debug_headers = true).await;
    let p = Proxy::new(&c.proxy);
    let mut messages = vec![json!({"role": "system", "content": prompt("system")})];
    let mut previous = None;
    for (turn, salt) in [Some("a"), Some("a"), Some("b"), None, None, Some("a")]
        .into_iter()
        .enumerate()
    {
        messages.push(json!({"role": "user", "content": prompt(&format!("question {turn}"))}));
        let mut body = json!({"messages": messages, "max_tokens": 2});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let before: u64 = c.cached_blocks().iter().sum();
        let a = p.generate("/v1/chat/completions", body, &[]).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.predicted, Some(a.reported), "turn {turn} under salt {salt:?}");
        if turn > 0 && previous == Some(salt) {
            assert!(a.reported > 0, "turn {turn} hits its previous turn's blocks");
        }
        previous = Some(salt);
        assert!(
            more_blocks_than(&c, before).await,
            "turn {turn}: its blocks never reached the index"
        );
        let answer: Value = serde_json::from_str(&a.body).unwrap();
        messages.push(json!({"role": "assistant", "content": answer["choices"][0]["message"]["content"]}));
    }
    c.assert_drained().await;
}
