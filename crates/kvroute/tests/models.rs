//! Several models behind one proxy, end to end: two models (`[[model]]` tables, block sizes 16
//! and 32), two mock workers each (each started with its model's `--model-name`), an adapter on
//! one worker of each. Each request reaches a worker serving its model or adapter, predicted
//! cached tokens equal the engine's, `/v1/models` lists both models and their adapters, an
//! unknown model is a 404, and the metrics carry a `model` label. And a tenant's cache
//! namespace: its warm prefix predicts (and is) no hit for another tenant. And replicas: a worker
//! added on one joins its model on every one; workers found by discovery join their models.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/answers.rs"]
mod answers;
#[path = "support/cluster.rs"]
mod cluster;

use std::collections::BTreeMap;

use answers::{Answer, Proxy};
use cluster::*;

/// A prompt of several full blocks of either block size, and a partial one.
fn prompt(topic: &str) -> String {
    format!(
        "{topic}: {}",
        "the quick brown fox jumps over the lazy dog. ".repeat(8)
    )
}

/// Blocks the router of `driver` holds, summed over its workers.
fn cached(driver: &kvroute_proxy::Driver) -> u64 {
    driver.snapshot().workers.iter().map(|w| w.cached_blocks).sum()
}

/// Sends `body` once to store its blocks, waits until `driver`'s index holds them, and sends
/// it again; both answers.
async fn twice(
    p: &Proxy,
    driver: &kvroute_proxy::Driver,
    body: Value,
    headers: &[(&str, &str)],
) -> (Answer, Answer) {
    twice_to(p, "/v1/completions", driver, body, headers).await
}

/// [`twice`], to `path`.
async fn twice_to(
    p: &Proxy,
    path: &str,
    driver: &kvroute_proxy::Driver,
    body: Value,
    headers: &[(&str, &str)],
) -> (Answer, Answer) {
    let before = cached(driver);
    let first = p.generate(path, body.clone(), headers).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let stored = driver.wait_for_kv(PATIENCE, |d| cached(d) > before).await;
    assert!(stored, "the first request's blocks never reached the index");
    let again = p.generate(path, body, headers).await;
    assert_eq!(again.status, 200, "{}", again.body);
    (first, again)
}

/// The directory of a tokenizer that adds BOS, with a chat template (beta's, in the test that
/// gives each model its own).
fn bos_model_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../kvroute-http/tests/data/bos-model")
}

/// Mock workers serving `model` with `block_size`-token blocks, the first with `adapter`,
/// tokenizing with the tiny model.
async fn mocks_of(model: &str, block_size: u32, adapter: &str) -> Vec<MockWorker> {
    mocks_loading(model, block_size, adapter, Arc::new(Model::tiny().unwrap())).await
}

/// [`mocks_of`], tokenizing with `tokenizer`.
async fn mocks_loading(
    model: &str,
    block_size: u32,
    adapter: &str,
    tokenizer: Arc<Model>,
) -> Vec<MockWorker> {
    let mut out = Vec::new();
    for adapters in [&[adapter][..], &[]] {
        let mut mc = MockConfig::new(1);
        mc.engine.speedup = 20.0;
        mc.engine.block_size = block_size;
        mc.model_name = model.to_owned();
        mc.lora_modules = adapters
            .iter()
            .map(|a| format!("{a}=/adapters/{a}").parse().unwrap())
            .collect();
        out.extend(mock::start(&mc, Arc::clone(&tokenizer)).await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_and_their_adapters_behind_one_proxy_each_request_served_as_its_engine_reports() {
    let alpha = mocks_of("alpha", 16, "sql").await;
    // Beta's engines tokenize with a tokenizer of their own (BOS, a chat template): so does
    // the proxy for beta.
    let beta_tokenizer = Arc::new(Model::load(&bos_model_dir()).unwrap());
    let beta = mocks_loading("beta", 32, "chat", beta_tokenizer).await;
    // alpha's workers in its table, beta's first pinned by `model`, its second found by its
    // `/v1/models`.
    let text = format!(
        r#"
        listen = "127.0.0.1:0"
        admin-listen = "127.0.0.1:0"
        debug-headers = true
        health-interval-ms = 200

        [[model]]
        name = "alpha"
        approximate-tokenizer = true
        block-size = 16
        [[model.worker]]
        {}
        [[model.worker]]
        {}

        [[model]]
        name = "beta"
        model-dir = "{}"
        block-size = 32
        policy = "kv"

        [[worker]]
        {}
        model = "beta"
        [[worker]]
        {}
        "#,
        table(&alpha[0]),
        table(&alpha[1]),
        bos_model_dir().display(),
        table(&beta[0]),
        table(&beta[1]),
    );
    let config = ServeConfig::from_toml_str(&text).unwrap();
    config.validate().unwrap();
    let proxy = kvroute_proxy::start(config, None).await.unwrap();
    let p = Proxy::new(&proxy);
    let admin = reqwest_lite::Http::new(proxy.admin_url());

    // Every worker is listed with its model; the unpinned one took beta, its `/v1/models`'.
    let listed: Value = serde_json::from_str(&admin.get("/admin/workers").await).unwrap();
    let by_id: BTreeMap<u64, (String, String)> = listed["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["id"].as_u64().unwrap(),
                (
                    w["url"].as_str().unwrap().to_owned(),
                    w["model"].as_str().unwrap().to_owned(),
                ),
            )
        })
        .collect();
    assert_eq!(by_id.len(), 4, "{listed}");
    let url_of = |m: &MockWorker| m.url();
    for (mocks, model) in [(&alpha, "alpha"), (&beta, "beta")] {
        for m in mocks.iter() {
            assert!(
                by_id.values().any(|(u, mm)| *u == url_of(m) && mm == model),
                "{} should be listed as {model}: {listed}",
                m.url()
            );
        }
    }
    // The ids of the workers at `urls`.
    let ids = |urls: &[String]| -> Vec<u64> {
        by_id
            .iter()
            .filter(|(_, (u, _))| urls.contains(u))
            .map(|(&id, _)| id)
            .collect()
    };

    // Both models, then each one's adapter, once their workers' lists are read.
    let want = [
        ("alpha".to_owned(), None),
        ("sql".to_owned(), Some("alpha".to_owned())),
        ("beta".to_owned(), None),
        ("chat".to_owned(), Some("beta".to_owned())),
    ];
    p.until_models("both models and their adapters", |models| models == want)
        .await;
    let (status, card) = p.get("/v1/models/chat").await;
    assert_eq!(status, 200);
    let card: Value = serde_json::from_str(&card).unwrap();
    assert_eq!(card["parent"], json!("beta"));
    assert_eq!(p.get("/v1/models/beta").await.0, 200);

    // (requested model, its driver, the workers that may serve it)
    let cases = [
        ("alpha", "alpha", ids(&[alpha[0].url(), alpha[1].url()])),
        ("sql", "alpha", ids(&[alpha[0].url()])),
        ("beta", "beta", ids(&[beta[0].url(), beta[1].url()])),
        ("chat", "beta", ids(&[beta[0].url()])),
    ];
    for (model, parent, serving) in &cases {
        let driver = proxy.driver_of(parent).unwrap();
        for round in 0..2 {
            let body =
                json!({"model": model, "prompt": prompt(&format!("{model} {round}")), "max_tokens": 2});
            let (first, again) = twice(&p, driver, body, &[]).await;
            for a in [&first, &again] {
                let w = a.worker.unwrap();
                assert!(
                    serving.contains(&w),
                    "{model} went to worker {w}, not one of {serving:?}"
                );
            }
            assert!(again.reported > 0, "{model}: the engine hit its cache");
            assert_eq!(again.predicted, Some(again.reported), "{model}: {again:?}");
        }
        // A chat, rendered by the model's own template and tokenizer as its engines do.
        let chat = json!({
            "model": model,
            "messages": [{"role": "user", "content": prompt(&format!("{model} chat"))}],
            "max_tokens": 2
        });
        let (first, again) = twice_to(&p, "/v1/chat/completions", driver, chat, &[]).await;
        for a in [&first, &again] {
            assert!(serving.contains(&a.worker.unwrap()), "{model} chat: {a:?}");
        }
        assert!(again.reported > 0, "{model} chat: the engine hit its cache");
        assert_eq!(again.predicted, Some(again.reported), "{model} chat: {again:?}");
    }
    // Beta's blocks are 32 tokens: a hit is whole 32-token blocks.
    let beta_driver = proxy.driver_of("beta").unwrap();
    let (_, again) = twice(
        &p,
        beta_driver,
        json!({"model": "beta", "prompt": prompt("blocks"), "max_tokens": 2}),
        &[],
    )
    .await;
    assert_eq!(again.reported % 32, 0, "{again:?}");

    // A model nobody serves: the 404 of a model not found, by either route.
    let a = p
        .complete(json!({"model": "gamma", "prompt": "hi", "max_tokens": 2}), &[])
        .await;
    assert_eq!(a.status, 404, "{}", a.body);
    let e = error(a.body.as_bytes());
    assert_eq!(e.code_name(), Some("model_not_found"), "{}", a.body);
    assert!(e.message.contains("gamma"), "{}", a.body);
    assert_eq!(p.get("/v1/models/gamma").await.0, 404);

    // Per-model metrics carry the model; each family is exposed once.
    let metrics = p.get("/metrics").await.1;
    for model in ["alpha", "beta"] {
        let label = format!("model=\"{model}\"");
        let ok = metrics.lines().any(|l| {
            l.starts_with("kvroute_requests_outcome_total{")
                && l.contains("outcome=\"ok\"")
                && l.contains(&label)
        });
        assert!(ok, "no ok request of {model} in\n{metrics}");
    }
    let mut types = BTreeMap::new();
    for l in metrics.lines().filter(|l| l.starts_with("# TYPE ")) {
        *types.entry(l.to_owned()).or_insert(0) += 1;
    }
    assert!(types.values().all(|&n| n == 1), "{types:?}");

    for driver in proxy.models.iter().map(|m| &m.driver) {
        let idle = |d: &kvroute_proxy::Driver| {
            let m = d.snapshot();
            m.active_now == 0 && m.queued_now == 0
        };
        assert!(driver.wait_until(PATIENCE, idle).await, "load leaked");
        driver.check_invariants().unwrap();
    }
}

/// A mock worker's `[[worker]]` keys: its URL and event endpoints.
fn table(m: &MockWorker) -> String {
    let w = WorkerConfig::parse_flag(&m.worker_flag()).unwrap();
    format!(
        "url = \"{}\"\nevents = \"{}\"\nreplay = \"{}\"",
        w.url,
        w.events.unwrap(),
        w.replay.unwrap()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_namespace_keeps_its_prefix_from_other_tenants() {
    // One worker: every request meets every block the engine holds.
    let c = cluster(1, 20.0, |c| {
        c.server.debug_headers = true;
        c.tenants = kvroute_proxy::config::TenantsConfig {
            tenant_header: Some("x-tenant".to_owned()),
            tenants: ["a", "b"]
                .iter()
                .map(|name| kvroute_proxy::config::TenantConfig {
                    name: (*name).to_owned(),
                    api_keys: Vec::new(),
                    header_values: vec![(*name).to_owned()],
                    weight: 1,
                    requests_per_interval: None,
                    tokens_per_interval: None,
                    interval_ms: 60_000,
                    cache_namespace: (*name == "a").then(|| "acme".to_owned()),
                })
                .collect(),
            ..Default::default()
        };
    })
    .await;
    let p = Proxy::new(&c.proxy);
    let driver = &c.proxy.driver;
    let body = |salt: Option<&str>| {
        let mut b = json!({"prompt": prompt("private"), "max_tokens": 2});
        if let Some(salt) = salt {
            b["cache_salt"] = json!(salt);
        }
        b
    };
    let (a, b) = ([("x-tenant", "a")], [("x-tenant", "b")]);
    // Tenant a warms its prefix: its second request hits, as predicted.
    let (first, again) = twice(&p, driver, body(None), &a).await;
    assert_eq!((first.predicted, first.reported), (Some(0), 0));
    assert!(again.reported > 0);
    assert_eq!(again.predicted, Some(again.reported));
    // Tenant b, and tenant b or none with a's namespace in its own salt (each a prefix of its
    // own): no hit predicted, none found.
    for (headers, salt) in [(&b[..], None), (&b[..], Some("acme")), (&[][..], Some("acme:x"))] {
        let before = cached(driver);
        let other = p.complete(body(salt), headers).await;
        assert_eq!(other.status, 200, "{}", other.body);
        assert_eq!(
            (other.predicted, other.reported),
            (Some(0), 0),
            "{headers:?} {salt:?} shares no block with tenant a"
        );
        let stored = driver.wait_for_kv(PATIENCE, |d| cached(d) > before).await;
        assert!(stored, "{headers:?} {salt:?}: its blocks never reached the index");
    }
    // Tenant a still finds its own, with and without a salt of its own on top.
    let mine = p.complete(body(None), &a).await;
    assert!(mine.reported > 0);
    assert_eq!(mine.predicted, Some(mine.reported));
    let (_, salted) = twice(&p, driver, body(Some("u1")), &a).await;
    assert!(salted.reported > 0);
    assert_eq!(salted.predicted, Some(salted.reported));
    c.assert_drained().await;
}

#[test]
fn the_readmes_two_model_configuration_is_read_as_written() {
    let readme = include_str!("../../../README.md");
    let section = &readme[readme.find("### Several models").expect("the section")..];
    let start = section.find("```toml\n").expect("a TOML block") + "```toml\n".len();
    let text = &section[start..start + section[start..].find("```").expect("its end")];
    let config = ServeConfig::from_toml_str(text).expect("the README's configuration parses");
    let stacks = config.stacks().expect("its models are valid");
    let names: Vec<&str> = stacks.iter().map(|s| s.model.model_name.as_str()).collect();
    assert_eq!(names, ["llama", "qwen"]);
    assert_ne!(stacks[0].routing.block_size, stacks[1].routing.block_size);
    assert!(stacks.iter().all(|s| !s.workers.is_empty()));
    config.validate().expect("the README's configuration is valid");
}

/// A proxy of models alpha (`alpha_workers`) and beta (none listed), synced through `nats`.
async fn two_model_replica(nats: &kvroute_sync::server::NatsServer, alpha_workers: &str) -> ProxyHandle {
    let text = format!(
        r#"
        listen = "127.0.0.1:0"
        admin-listen = "127.0.0.1:0"
        health-interval-ms = 200
        nats = "{}"
        nats-heartbeat-ms = 200
        nats-peer-timeout-ms = 1000
        [[model]]
        name = "alpha"
        approximate-tokenizer = true
        {alpha_workers}
        [[model]]
        name = "beta"
        approximate-tokenizer = true
        block-size = 32
        "#,
        nats.url()
    );
    kvroute_proxy::start(ServeConfig::from_toml_str(&text).unwrap(), None)
        .await
        .unwrap()
}

/// Whether `proxy`'s `model` has a worker at `url`.
fn has(proxy: &ProxyHandle, model: &str, url: &str) -> bool {
    proxy
        .driver_of(model)
        .unwrap()
        .worker_statuses()
        .iter()
        .any(|w| w.config.url.trim_end_matches('/') == url && w.state == StateName::Ready)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_added_to_one_replica_joins_its_model_on_every_replica() {
    use kvroute_testkit::{External, eventually, require};
    let Some(nats) = require(
        External::NatsServer,
        kvroute_sync::server::NatsServer::binary().is_some(),
    )
    .then(|| kvroute_sync::server::NatsServer::start().unwrap()) else {
        return;
    };
    let alpha = mocks_of("alpha", 16, "sql").await;
    let beta = mocks_of("beta", 32, "chat").await;
    let listed = format!("[[model.worker]]\n{}\n", table(&alpha[0]));
    let (a, b) = (
        two_model_replica(&nats, &listed).await,
        two_model_replica(&nats, &listed).await,
    );
    let admin = reqwest_lite::Http::new(a.admin_url());
    let add = |w: WorkerConfig| serde_json::to_vec(&w).unwrap();
    // Unpinned: its `/v1/models` says beta, on A and, through beta's sync subjects, on B.
    let extra = WorkerConfig::parse_flag(&beta[0].worker_flag()).unwrap();
    let (status, _, body) = admin.request("POST", "/admin/workers", add(extra)).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let url = beta[0].url();
    for p in [&a, &b] {
        eventually("the worker joins beta on every replica", || has(p, "beta", &url)).await;
        assert!(!has(p, "alpha", &url));
    }
    // `/health` names each model's sync link: both subjects are heard.
    let linked = |model| b.driver_of(model).unwrap().sync_link() == Some(kvroute_sync::LinkState::Connected);
    eventually("both models' sync links are up", || {
        linked("alpha") && linked("beta")
    })
    .await;
    let (status, health) = Proxy::new(&b).get("/health").await;
    assert_eq!(status, 200, "{health}");
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["sync"], "connected", "{health}");
    assert_eq!(
        health["sync_models"],
        json!({"alpha": "connected", "beta": "connected"}),
        "{health}"
    );
    // Pinned to a model not served: refused, naming it.
    let mut wrong = WorkerConfig::parse_flag(&beta[1].worker_flag()).unwrap();
    wrong.model = Some("gamma".to_owned());
    let (status, _, body) = admin.request("POST", "/admin/workers", add(wrong)).await;
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("gamma"), "{body}");
    // A request for beta on B reaches the worker A added, and one for alpha its own.
    let p = Proxy::new(&b);
    for (model, url) in [("beta", &beta[0]), ("alpha", &alpha[0])] {
        let a = p
            .complete(
                json!({"model": model, "prompt": prompt(model), "max_tokens": 2}),
                &[],
            )
            .await;
        assert_eq!(a.status, 200, "{model}: {}", a.body);
        assert!(has(&b, model, &url.url()));
    }
    // A drain by URL finds the worker in its model, whose fleet it would leave empty (alpha's
    // has its own worker): refused unless forced.
    let (status, _, body) = admin
        .request("POST", &format!("/admin/drain?url={url}"), Vec::new())
        .await;
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
    let (status, _, body) = admin
        .request("POST", &format!("/admin/drain?url={url}&force=true"), Vec::new())
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    for p in [&a, &b] {
        eventually("the drain holds on every replica", || !has(p, "beta", &url)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_found_in_a_file_join_their_models_and_leave_them() {
    let alpha = mocks_of("alpha", 16, "sql").await;
    let beta = mocks_of("beta", 32, "chat").await;
    let dir = kvroute_testkit::Scratch::new("models-discovery");
    let file = dir.join("workers");
    // alpha's worker pinned, beta's found by its `/v1/models`.
    let both = format!(
        "{},model=alpha\n{}\n",
        alpha[0].worker_flag(),
        beta[0].worker_flag()
    );
    std::fs::write(&file, &both).unwrap();
    let text = format!(
        r#"
        listen = "127.0.0.1:0"
        admin-listen = "127.0.0.1:0"
        health-interval-ms = 200
        discover-file = "{}"
        discover-interval-ms = 100
        discover-drain-timeout-ms = 1000
        [[model]]
        name = "alpha"
        approximate-tokenizer = true
        [[model]]
        name = "beta"
        approximate-tokenizer = true
        block-size = 32
        "#,
        file.display()
    );
    let proxy = kvroute_proxy::start(ServeConfig::from_toml_str(&text).unwrap(), None)
        .await
        .unwrap();
    let (a, b) = (alpha[0].url(), beta[0].url());
    kvroute_testkit::eventually("each worker found joins its model", || {
        has(&proxy, "alpha", &a) && has(&proxy, "beta", &b)
    })
    .await;
    assert!(!has(&proxy, "alpha", &b) && !has(&proxy, "beta", &a));
    let p = Proxy::new(&proxy);
    for model in ["alpha", "beta"] {
        let answer = p
            .complete(
                json!({"model": model, "prompt": prompt(model), "max_tokens": 2}),
                &[],
            )
            .await;
        assert_eq!(answer.status, 200, "{model}: {}", answer.body);
    }
    // Beta's worker is no longer listed: it leaves beta (replaced by rename, as a mounted
    // ConfigMap is).
    let next = dir.join("workers.next");
    std::fs::write(&next, format!("{},model=alpha\n", alpha[0].worker_flag())).unwrap();
    std::fs::rename(&next, &file).unwrap();
    let gone = |d: &kvroute_proxy::Driver| d.worker_urls().is_empty();
    let beta_driver = proxy.driver_of("beta").unwrap();
    assert!(
        beta_driver.wait_until(PATIENCE, gone).await,
        "beta's worker stayed"
    );
    assert!(has(&proxy, "alpha", &a));
}

/// A planner file with the `dry-run` actuator, for the `block_size`-token blocks of a model.
fn dry_run_plan(block_size: u32) -> kvroute::plan::PlanFile {
    kvroute::plan::PlanFile::parse(&format!(
        r#"
        [planner]
        mode = "agg"
        min_replicas = 1
        max_replicas = 3
        max_gpu_budget = 3
        model_seed = "profile"
        load_interval_s = 0.25
        throughput_scaling = false

        [planner.sla]
        ttft_ms = 5000
        itl_ms = 50

        [engine]
        block_size = {block_size}
        num_blocks = 2048

        [actuator]
        kind = "dry-run"
        "#
    ))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_model_is_planned_on_its_own_fleet() {
    let alpha = mocks_of("alpha", 16, "sql").await;
    let beta = mocks_of("beta", 32, "chat").await;
    let text = format!(
        r#"
        listen = "127.0.0.1:0"
        admin-listen = "127.0.0.1:0"
        health-interval-ms = 200
        [[model]]
        name = "alpha"
        approximate-tokenizer = true
        [[model.worker]]
        {}
        [[model]]
        name = "beta"
        approximate-tokenizer = true
        block-size = 32
        [[model.worker]]
        {}
        [[model.worker]]
        {}
        "#,
        table(&alpha[0]),
        table(&beta[0]),
        table(&beta[1]),
    );
    let mut proxy = kvroute_proxy::start(ServeConfig::from_toml_str(&text).unwrap(), None)
        .await
        .unwrap();
    let admin = reqwest_lite::Http::new(proxy.admin_url());
    let (status, _, _) = admin.request("GET", "/admin/planner", Vec::new()).await;
    assert_eq!(status, 404, "no planner yet");
    for (model, block_size) in [("alpha", 16), ("beta", 32)] {
        let plan = dry_run_plan(block_size);
        let m = proxy.model(model).unwrap();
        let actuator =
            kvroute_proxy::autoscale::actuator::build(plan.actuator.as_ref().unwrap(), Arc::clone(&m.fleet))
                .unwrap();
        let planner = plan.live_planner(m.driver.timestamp()).unwrap();
        assert!(proxy.start_planner_for(model, planner, actuator, Default::default()));
    }
    // Each model's report, and each model's desired workers: its own fleet's, as found.
    let report: Value = serde_json::from_str(&admin.get("/admin/planner").await).unwrap();
    for (model, workers) in [("alpha", 1), ("beta", 2)] {
        assert_eq!(
            report["models"][model]["desired"]["agg"],
            json!(workers),
            "{model}: {report}"
        );
    }
    let metrics = Proxy::new(&proxy).get("/metrics").await.1;
    for (model, workers) in [("alpha", 1), ("beta", 2)] {
        let series = format!("kvroute_planner_desired_workers{{pool=\"agg\",model=\"{model}\"}} {workers}");
        assert!(metrics.lines().any(|l| l == series), "no {series} in\n{metrics}");
    }
}
