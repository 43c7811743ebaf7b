//! Opt-in: `kvroute serve` in front of two real vLLM engines (vLLM 0.32's CPU build, a tiny
//! Llama with random weights whose tokenizer adds BOS to a text prompt), as a user runs it.
//! `scripts/real-vllm/setup.sh DIR` prepares DIR; the test runs when `KVROUTE_REAL_VLLM=DIR`
//! and otherwise says it is skipped. It takes minutes (each engine starts in one to three).
//!
//! What it checks, every routed request included: the tokens kvroute predicts cached on the
//! worker it chose equal the `cached_tokens` the engine reports, for text completions, chat and
//! token-id prompts, prompts cut by `truncate_prompt_tokens`, requests under a LoRA adapter (a
//! tiny random one, `scripts/real-vllm/make_lora.py`: served by engine a from its start, and
//! loaded on engine b at run time, each adapter's requests going only to its engine) and under a
//! `cache_salt` (another salt hits nothing); a repeated prompt goes back to the same worker; after an engine restart and after a health flap (the engine stopped, then
//! continued) the same holds without any manual step. From zero: a request waits in the queue
//! while the planner's `process` actuator starts an engine, is served once it registers, its
//! repeat is predicted exactly, and the engine stops with the proxy.

#![allow(clippy::unwrap_used)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use kvroute_http::net::{HttpClient, client};
use serde_json::{Value, json};

/// How long an engine may take to start on a loaded 2-core machine.
const ENGINE_START: Duration = Duration::from_secs(600);
use kvroute_testkit::{PATIENCE, Scratch};
const BLOCK: u32 = 32;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A directory for a run's sockets and logs, removed when it is dropped unless the test fails
/// (the engines' and kvroute's logs then say why).
fn run_dir(name: &str) -> Scratch {
    Scratch::new(name).keep_on_failure()
}

/// A real vLLM engine in its own process group (its engine core is a child process).
struct Engine {
    name: &'static str,
    port: u16,
    replay_port: u16,
    events: String,
    child: Option<Child>,
}

impl Engine {
    fn new(name: &'static str, run: &Path) -> Self {
        Self {
            name,
            port: free_port(),
            replay_port: free_port(),
            events: format!("ipc://{}/{name}.sock", run.display()),
            child: None,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn worker_flag(&self) -> String {
        format!(
            "{},events={},replay=tcp://127.0.0.1:{}",
            self.url(),
            self.events,
            self.replay_port
        )
    }

    fn spawn(&mut self, dir: &Path, run: &Path) {
        use std::os::unix::process::CommandExt;
        let kv_events = json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": self.events,
            "replay_endpoint": format!("tcp://127.0.0.1:{}", self.replay_port),
            "topic": "kv-events",
        });
        let log = std::fs::File::create(run.join(format!("{}.log", self.name))).unwrap();
        let child = Command::new(dir.join("venv/bin/python"))
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(dir.join("model"))
            .args(["--served-model-name", "tiny", "--host", "127.0.0.1", "--port"])
            .arg(self.port.to_string())
            .args(["--dtype", "bfloat16", "--max-model-len", "2048", "--block-size"])
            .arg(BLOCK.to_string())
            .args([
                "--enable-prefix-caching",
                "--enable-prompt-tokens-details",
                "--enable-lora",
                "--max-lora-rank",
                "8",
                "--max-loras",
                "2",
            ])
            // Engine a serves adapter `sql` from its start; any engine may load more at run time.
            .args(
                (self.name == "a")
                    .then(|| {
                        [
                            "--lora-modules".to_owned(),
                            format!("sql={}", dir.join("lora").display()),
                        ]
                    })
                    .into_iter()
                    .flatten(),
            )
            .arg("--kv-events-config")
            .arg(kv_events.to_string())
            .envs([
                ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),
                ("HF_HUB_OFFLINE", "1"),
                ("VLLM_NO_USAGE_STATS", "1"),
                ("DO_NOT_TRACK", "1"),
                ("VLLM_HOST_IP", "127.0.0.1"),
                ("VLLM_CPU_KVCACHE_SPACE", "1"),
                ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            ])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// Sends `signal` to the engine's whole process group.
    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().unwrap().id();
        let status = Command::new("kill")
            .args([format!("-{signal}"), "--".to_owned(), format!("-{pid}")])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {}", self.name);
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Kvroute(Child);

impl Drop for Kvroute {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Http(HttpClient);

struct Reply {
    status: u16,
    headers: hyper::HeaderMap,
    body: Value,
}

impl Http {
    async fn call(&self, method: &str, url: &str, body: Option<&Value>) -> Option<Reply> {
        self.call_within(method, url, body, Duration::from_secs(120))
            .await
    }

    /// [`Self::call`] that waits at most `patience` for the answer.
    async fn call_within(
        &self,
        method: &str,
        url: &str,
        body: Option<&Value>,
        patience: Duration,
    ) -> Option<Reply> {
        let req = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                body.map(Value::to_string).unwrap_or_default(),
            )))
            .unwrap();
        let resp = tokio::time::timeout(patience, self.0.request(req))
            .await
            .ok()?
            .ok()?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.ok()?.to_bytes();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Some(Reply {
            status,
            headers,
            body,
        })
    }

    async fn wait_until(&self, what: &str, deadline: Duration, mut ok: impl AsyncFnMut(&Self) -> bool) {
        let start = Instant::now();
        while !ok(self).await {
            assert!(start.elapsed() < deadline, "waited {deadline:?} for {what}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// A worker's entry in the admin listing.
async fn worker_entry(http: &Http, admin: &str, url: &str) -> Option<Value> {
    let reply = http.call("GET", &format!("{admin}/admin/workers"), None).await?;
    let workers = reply.body["workers"].as_array()?;
    workers.iter().find(|w| w["url"] == url).cloned()
}

/// Waits until kvroute's admin listing shows the worker at `url` in `state`.
async fn wait_state(http: &Http, admin: &str, url: &str, state: &str) {
    http.wait_until(&format!("worker {url} {state}"), PATIENCE, async |h| {
        worker_entry(h, admin, url)
            .await
            .is_some_and(|w| w["state"] == state)
    })
    .await;
}

/// What one routed request showed: the worker kvroute chose, the tokens it predicted cached
/// there, and the tokens the engine reported cached.
#[derive(Debug)]
struct Seen {
    worker: String,
    predicted: u64,
    reported: u64,
}

async fn send(http: &Http, base: &str, path: &str, body: &Value) -> Seen {
    send_within(http, base, path, body, Duration::from_secs(120)).await
}

/// [`send`] that waits at most `patience` for the answer (one held in the router's queue).
async fn send_within(http: &Http, base: &str, path: &str, body: &Value, patience: Duration) -> Seen {
    let reply = http
        .call_within("POST", &format!("{base}{path}"), Some(body), patience)
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    let header = |name: &str| reply.headers.get(name).unwrap().to_str().unwrap().to_owned();
    let seen = Seen {
        worker: header("x-kvroute-worker"),
        predicted: header("x-kvroute-predicted-cached-tokens").parse().unwrap(),
        // vLLM 0.32 with --enable-prompt-tokens-details writes it, zero included.
        reported: reply.body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    };
    eprintln!("{path}: {seen:?}");
    assert_eq!(
        seen.predicted, seen.reported,
        "{path}: predicted cached tokens differ from the engine's: {seen:?}"
    );
    seen
}

/// Sends `body` until the second of two sends in a row hits: the first warms a worker, the
/// second must go back to it with its cached prefix predicted exactly. KV events reach kvroute
/// a moment after the engine answers, so a second send that finds nothing predicted and nothing
/// reported (the router had not heard yet, and load sent it elsewhere) is tried again.
async fn affinity(http: &Http, base: &str, path: &str, body: &Value) -> Seen {
    let first = send(http, base, path, body).await;
    again(http, base, path, body, &first).await
}

/// Sends `body`, which `first` warmed, until the engine reports a cache hit (see [`affinity`]);
/// the hit, on `first`'s worker and predicted exactly.
async fn again(http: &Http, base: &str, path: &str, body: &Value, first: &Seen) -> Seen {
    let start = Instant::now();
    loop {
        let seen = send(http, base, path, body).await;
        if seen.reported > 0 {
            assert_eq!(
                seen.worker, first.worker,
                "{path}: a repeated prompt changed worker"
            );
            return seen;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "{path}: no cache hit on a repeated prompt"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn text(tag: &str) -> String {
    format!("{tag}: the quick brown fox jumps over the lazy dog, again and again. ").repeat(4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvroute_predicts_what_real_vllm_caches_across_restarts_and_flaps() {
    let Some(dir) = std::env::var_os("KVROUTE_REAL_VLLM").map(PathBuf::from) else {
        eprintln!(
            "skipped: KVROUTE_REAL_VLLM is not set (run scripts/real-vllm/setup.sh DIR, then set it to DIR)"
        );
        return;
    };
    let run = run_dir("real-vllm");
    let http = Http(client(Duration::from_secs(5)));
    let mut engines = [Engine::new("a", run.path()), Engine::new("b", run.path())];
    for e in &mut engines {
        e.spawn(&dir, run.path());
    }
    for e in &engines {
        let url = format!("{}/health", e.url());
        http.wait_until(&format!("engine {} to start", e.name), ENGINE_START, async |h| {
            h.call("GET", &url, None).await.is_some_and(|r| r.status == 200)
        })
        .await;
    }

    let (port, admin_port) = (free_port(), free_port());
    let mut serve = Command::new(env!("CARGO_BIN_EXE_kvroute"));
    serve
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin_port}")])
        .arg("--model-dir")
        .arg(dir.join("model"))
        .args([
            "--block-size",
            &BLOCK.to_string(),
            "--debug-headers",
            "--health-interval-ms",
            "500",
        ]);
    for e in &engines {
        serve.args(["--worker", &e.worker_flag()]);
    }
    let _kvroute = Kvroute(
        serve
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(run.join("kvroute.log")).unwrap())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    let admin = format!("http://127.0.0.1:{admin_port}");
    for e in &engines {
        let url = e.url();
        wait_state(&http, &admin, &url, "ready").await;
    }

    // Text completions (the tokenizer adds BOS), chat (the template brings it), token ids.
    let completion = |tag: &str| json!({"model": "tiny", "prompt": text(tag), "max_tokens": 2});
    let chat = |tag: &str| json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": text(tag)}]});
    let ids: Vec<u32> = (0..200).map(|i| 3 + (i * 7) % 250).collect();
    let token_ids = json!({"model": "tiny", "prompt": ids, "max_tokens": 2});
    let hit = affinity(&http, &base, "/v1/completions", &completion("text")).await;
    assert!(hit.reported >= u64::from(BLOCK));
    affinity(&http, &base, "/v1/chat/completions", &chat("chat")).await;
    affinity(&http, &base, "/v1/completions", &token_ids).await;
    // Prompts cut by `truncate_prompt_tokens` (a text keeps its BOS and last N-1 tokens; with
    // `truncation_side` the ids are sliced; a chat and token ids keep their last N).
    let cut = |mut body: Value, extra: Value| {
        body["truncate_prompt_tokens"] = json!(45);
        if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
            b.extend(e);
        }
        body
    };
    for (path, body) in [
        ("/v1/completions", cut(completion("cut"), json!({}))),
        (
            "/v1/completions",
            cut(completion("cut left"), json!({"truncation_side": "left"})),
        ),
        (
            "/v1/completions",
            cut(completion("cut right"), json!({"truncation_side": "right"})),
        ),
        ("/v1/chat/completions", cut(chat("cut chat"), json!({}))),
        (
            "/v1/completions",
            cut(
                json!({"model": "tiny", "prompt": ids.clone(), "max_tokens": 2}),
                json!({}),
            ),
        ),
    ] {
        let hit = affinity(&http, &base, path, &body).await;
        assert_eq!(
            hit.reported,
            u64::from(BLOCK),
            "{path} {body}: one full block of 45 tokens"
        );
    }

    eprintln!("-- LoRA adapters and cache salts");
    lora_and_salts(&http, &base, &admin, &dir, &engines).await;

    eprintln!("-- an engine of each holds a prompt");
    // A prompt cached on each engine, to find again after the restart and the flap.
    let mut on = std::collections::BTreeMap::new();
    for i in 0..16 {
        if on.len() == engines.len() {
            break;
        }
        let body = completion(&format!("probe {i}"));
        let seen = affinity(&http, &base, "/v1/completions", &body).await;
        on.entry(seen.worker).or_insert(body);
    }
    assert_eq!(on.len(), 2, "the router never used one of the engines");

    eprintln!("-- engine a restarts");
    // Engine a restarts: its cache is gone and its sequence starts again; kvroute must forget
    // its view (or every prediction above would now be wrong) and learn the new one.
    let a_url = engines[0].url();
    engines[0].kill();
    engines[0].spawn(&dir, run.path());
    http.wait_until("engine a to restart", ENGINE_START, async |h| {
        h.call("GET", &format!("{a_url}/health"), None)
            .await
            .is_some_and(|r| r.status == 200)
    })
    .await;
    wait_state(&http, &admin, &a_url, "ready").await;
    for body in on.values() {
        send(&http, &base, "/v1/completions", body).await;
    }
    affinity(&http, &base, "/v1/completions", &completion("after restart")).await;

    eprintln!("-- engine b flaps");
    // Engine b stops long enough to fail its health checks, then goes on with its cache intact:
    // kvroute must bring it back with its view, not an empty one.
    let b_url = engines[1].url();
    let b_id = worker_entry(&http, &admin, &b_url).await.unwrap()["id"].to_string();
    engines[1].signal("STOP");
    wait_state(&http, &admin, &b_url, "unhealthy").await;
    engines[1].signal("CONT");
    wait_state(&http, &admin, &b_url, "ready").await;
    let b_prompt = on
        .iter()
        .find(|(worker, _)| **worker == b_id.trim_matches('"'))
        .map(|(_, body)| body.clone());
    if let Some(body) = b_prompt {
        let seen = send(&http, &base, "/v1/completions", &body).await;
        assert!(
            seen.reported > 0,
            "after the flap, b's cached prompt went elsewhere: {seen:?}"
        );
    }
    affinity(&http, &base, "/v1/completions", &completion("after flap")).await;
}

/// Adapter `sql` (engine a's from its start) is listed by kvroute with its parent, and its
/// requests go to engine a, predicted as the engine reports (blocks salted with the adapter on
/// both sides); adapter `late`, loaded on engine b at run time, becomes routable there. A
/// `cache_salt` is predicted as the engine reports, and the same text under another salt hits
/// nothing on either side.
async fn lora_and_salts(http: &Http, base: &str, admin: &str, dir: &Path, engines: &[Engine]) {
    let id = async |e: &Engine| {
        let entry = worker_entry(http, admin, &e.url()).await.unwrap();
        entry["id"].to_string()
    };
    let listed = async |h: &Http, name: &str| {
        h.call("GET", &format!("{base}/v1/models"), None)
            .await
            .is_some_and(|r| {
                r.body["data"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|m| m["id"] == name && m["parent"] == "tiny"))
            })
    };
    http.wait_until("adapter sql listed", PATIENCE, async |h| listed(h, "sql").await)
        .await;
    let lora = |model: &str, tag: &str| json!({"model": model, "prompt": text(tag), "max_tokens": 2});
    let hit = affinity(http, base, "/v1/completions", &lora("sql", "lora")).await;
    assert_eq!(hit.worker, id(&engines[0]).await, "only engine a serves `sql`");
    // The same text under the base model is another prefix for the engine and for kvroute.
    let plain = send(http, base, "/v1/completions", &lora("tiny", "lora")).await;
    assert_eq!(plain.reported, 0, "the adapter's blocks are not the base model's");

    let b = &engines[1];
    let load = json!({"lora_name": "late", "lora_path": dir.join("lora")});
    let reply = http
        .call("POST", &format!("{}/v1/load_lora_adapter", b.url()), Some(&load))
        .await
        .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    http.wait_until("adapter late listed", PATIENCE, async |h| listed(h, "late").await)
        .await;
    let hit = affinity(http, base, "/v1/completions", &lora("late", "late")).await;
    assert_eq!(hit.worker, id(b).await, "only engine b serves `late`");

    let salted =
        |salt: &str| json!({"model": "tiny", "prompt": text("salted"), "max_tokens": 2, "cache_salt": salt});
    affinity(http, base, "/v1/completions", &salted("tenant-a")).await;
    let other = send(http, base, "/v1/completions", &salted("tenant-b")).await;
    assert_eq!(other.reported, 0, "another salt shares no block");
}

/// The planner's file of the scale-from-zero check: one agg pool from 0 to 1 worker, started
/// by the `process` actuator as a real vLLM engine of `dir` whose events and logs go in `run`.
fn plan_from_zero(dir: &Path, run: &Path) -> String {
    let kv_events = json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": format!("ipc://{}/ev-{{index}}.sock", run.display()),
        "replay_endpoint": "tcp://127.0.0.1:{replay_port}",
        "topic": "kv-events",
    });
    let mut command: Vec<String> = [
        "env",
        "HF_HUB_OFFLINE=1",
        "VLLM_NO_USAGE_STATS=1",
        "DO_NOT_TRACK=1",
        "VLLM_HOST_IP=127.0.0.1",
        "VLLM_CPU_KVCACHE_SPACE=1",
        "VLLM_CPU_OMP_THREADS_BIND=nobind",
    ]
    .map(str::to_owned)
    .to_vec();
    command.push(dir.join("venv/bin/python").display().to_string());
    command.extend(["-m", "vllm.entrypoints.openai.api_server", "--model"].map(str::to_owned));
    command.push(dir.join("model").display().to_string());
    command.extend(
        [
            "--served-model-name",
            "{model}",
            "--host",
            "{host}",
            "--port",
            "{port}",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "2048",
            "--block-size",
            &BLOCK.to_string(),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            &kv_events.to_string(),
        ]
        .map(str::to_owned),
    );
    let worker = format!(
        "http://{{host}}:{{port}},events=ipc://{}/ev-{{index}}.sock,replay=tcp://127.0.0.1:{{replay_port}},block-size={BLOCK}",
        run.display()
    );
    // The planner's part as a user writes it; the argv and paths inserted as TOML values.
    let mut plan: toml::Table = format!(
        r#"
        [planner]
        mode = "agg"
        min_replicas = 0
        max_replicas = 1
        max_gpu_budget = 1
        throughput_scaling = false
        idle_to_zero_s = 3600.0

        [engine]
        block_size = {BLOCK}

        [actuator]
        kind = "process"
        ready_timeout_s = 600
        stop_grace_s = 30
        "#
    )
    .parse()
    .unwrap();
    let actuator = plan["actuator"].as_table_mut().unwrap();
    actuator.insert("log_dir".to_owned(), run.display().to_string().into());
    let mut agg = toml::Table::new();
    agg.insert("command".to_owned(), command.into());
    agg.insert("worker".to_owned(), worker.into());
    actuator.insert("agg".to_owned(), agg.into());
    plan.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_planner_starts_a_real_vllm_for_a_request_waiting_at_zero_and_stops_it() {
    use kvroute_proxy::autoscale::actuator::{Actuator, ActuatorConfig};
    use kvroute_proxy::autoscale::process::{ProcessActuator, Started};
    use std::sync::Arc;

    let Some(dir) = std::env::var_os("KVROUTE_REAL_VLLM").map(PathBuf::from) else {
        eprintln!(
            "skipped: KVROUTE_REAL_VLLM is not set (run scripts/real-vllm/setup.sh DIR, then set it to DIR)"
        );
        return;
    };
    let run = run_dir("real-vllm-zero");

    // A proxy with no worker whose requests wait in the queue for one.
    let mut config = kvroute_proxy::ServeConfig::default();
    config.server.listen = "127.0.0.1:0".to_owned();
    config.server.admin_listen = "127.0.0.1:0".to_owned();
    config.server.debug_headers = true;
    config.model.model_dir = Some(dir.join("model"));
    config.routing.block_size = BLOCK;
    config.routing.when_empty = "queue".to_owned();
    config.routing.queue_timeout_ms = ENGINE_START.as_millis() as u64;
    config.upstream.health_interval_ms = 500;
    let mut proxy = kvroute_proxy::start(config, None).await.unwrap();

    // The planner and its actuator, as the planner's file describes them.
    let plan = kvroute::plan::PlanFile::parse(&plan_from_zero(&dir, run.path())).unwrap();
    let Some(ActuatorConfig::Process(process)) = plan.actuator.clone() else {
        panic!("a process actuator")
    };
    let actuator = Arc::new(ProcessActuator::new(*process, Arc::clone(&proxy.fleet)));
    let planner = plan.live_planner(proxy.driver.timestamp()).unwrap();
    proxy.start_planner(
        planner,
        Arc::clone(&actuator) as Arc<dyn Actuator>,
        kvroute_proxy::autoscale::Settings::default(),
    );

    // The first request arrives with no worker: it waits while the planner starts one.
    let http = Arc::new(Http(client(Duration::from_secs(5))));
    let base = proxy.url();
    let body = json!({"model": "tiny", "prompt": text("from zero"), "max_tokens": 2});
    let started = Instant::now();
    let first = {
        let (http, base, body) = (Arc::clone(&http), base.clone(), body.clone());
        tokio::spawn(async move { send_within(&http, &base, "/v1/completions", &body, ENGINE_START).await })
    };
    let (mut spawned, mut registered) = (None, None);
    while !first.is_finished() {
        let procs = actuator.running();
        if spawned.is_none() && !procs.is_empty() {
            spawned = Some(started.elapsed());
            eprintln!("engine process started after {:?}: {procs:?}", started.elapsed());
        }
        if registered.is_none() && procs.iter().any(|p| p.worker.is_some()) {
            registered = Some(started.elapsed());
            eprintln!("engine registered after {:?}", started.elapsed());
        }
        assert!(
            started.elapsed() < ENGINE_START,
            "no answer after {ENGINE_START:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let first = first.await.unwrap();
    eprintln!("the waiting request was served after {:?}", started.elapsed());
    assert!(spawned.is_some(), "answered with no engine started");
    let decisions = proxy.planner.decisions();
    assert!(
        decisions
            .iter()
            .any(|d| d.changes.iter().any(|c| c.pool == kvroute_planner::Pool::Agg
                && (c.from, c.to) == (0, 1)
                && matches!(c.reason, kvroute_planner::Reason::FromZero { .. }))),
        "no scale-from-zero decision: {decisions:?}"
    );
    let [
        Started {
            pid: Some(pid),
            worker: Some(worker),
            ..
        },
    ] = actuator.running()[..]
    else {
        panic!("one engine, registered: {:?}", actuator.running());
    };
    assert_eq!(first.worker, worker.0.to_string());
    assert_eq!(first.reported, 0, "a cold engine");

    // The same prompt again: routed with the cached prefix predicted as the engine reports.
    let hit = again(&http, &base, "/v1/completions", &body, &first).await;
    assert!(hit.reported >= u64::from(BLOCK), "{hit:?}");

    // The proxy stops: the planner and its actuator go, and the engine is told to stop.
    let engine_url = actuator.running()[0].url.clone();
    drop(proxy);
    drop(actuator);
    let stopping = Instant::now();
    while kvroute_testkit::process_group_alive(pid) {
        assert!(
            stopping.elapsed() < PATIENCE,
            "the engine (process group {pid}) still runs {PATIENCE:?} after the proxy stopped"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("engine gone {:?} after the proxy stopped", stopping.elapsed());
    assert!(
        http.call("GET", &format!("{engine_url}/health"), None)
            .await
            .is_none(),
        "the engine's port still answers"
    );
}
