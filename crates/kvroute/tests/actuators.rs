//! The planner's actuators against real processes, and the admin API's drain and removal order:
//! the `process` actuator starts the built `kvroute mock` binary on free loopback ports,
//! registers it once it serves the model, ends it with SIGTERM (SIGKILL for one that ignores
//! SIGTERM), and notices one killed from outside; a drain that waits answers only after the
//! stream in flight on its worker ends; the removal order puts the worker whose cache the
//! fleet loses least first. Each test waits on an explicit signal (the driver's change
//! notification, an arrival at a stub) or polls a condition with a generous deadline.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/cluster.rs"]
mod cluster;

use std::path::PathBuf;

use cluster::*;
use kvroute_planner::Pool;
use kvroute_proxy::autoscale::actuator::{self, Actuator, ActuatorConfig, ProcessConfig, WorkerTemplate};
use kvroute_proxy::autoscale::process::{ProcessActuator, Started};
use kvroute_testkit::{Scratch, eventually, eventually_or};

/// A fresh folder for worker logs, removed when it is dropped unless the test fails.
fn log_dir(test: &str) -> Scratch {
    Scratch::new(&format!("actuators-{test}")).keep_on_failure()
}

/// `kvroute mock` at 20x as the agg pool's worker command, with its worker line.
fn mock_template(extra: &[&str]) -> WorkerTemplate {
    let mut args = vec!["--speedup", "20"];
    args.extend_from_slice(extra);
    cluster::mock_template(&args)
}

fn process_config(agg: WorkerTemplate, dir: Option<PathBuf>) -> ProcessConfig {
    ProcessConfig {
        agg: Some(agg),
        prefill: None,
        decode: None,
        ready_timeout_s: 60,
        stop_grace_s: 30,
        log_dir: dir,
        host: "127.0.0.1".to_owned(),
    }
}

/// A proxy with no worker yet.
async fn empty_proxy() -> Cluster {
    fronting(Vec::new(), Vec::new(), |_| {}).await
}

/// `kvroute_planner_worker_exits_total` of the agg pool with `cause`.
fn exits(c: &Cluster, cause: &str) -> f64 {
    metric(
        &c.proxy.driver.metrics.render(),
        "kvroute_planner_worker_exits_total",
        &format!("cause=\"{cause}\""),
    )
}

/// Waits until the actuator has no process left running.
async fn until_none_running(a: &ProcessActuator) {
    eventually_or(
        || format!("still running: {:?}", a.running()),
        || a.running().is_empty(),
    )
    .await;
}

/// Waits until process group `pgid` has no live member.
async fn until_group_gone(pgid: u32) {
    eventually(format!("process group {pgid} gone"), || {
        !kvroute_testkit::process_group_alive(pgid)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_started_worker_joins_when_it_serves_the_model_warms_and_leaves_on_sigterm() {
    let c = empty_proxy().await;
    let dir = log_dir("lifecycle");
    let config = ActuatorConfig::Process(Box::new(process_config(
        mock_template(&[]),
        Some(dir.path().to_owned()),
    )));
    // The constructor the planner's loop uses, and the same actuator typed, to see its processes.
    let _built: Arc<dyn Actuator> = actuator::build(&config, Arc::clone(&c.proxy.fleet)).unwrap();
    let ActuatorConfig::Process(p) = config else {
        unreachable!()
    };
    let a = ProcessActuator::new(*p, Arc::clone(&c.proxy.fleet));

    a.provision(Pool::Agg);
    // Started, not yet in the fleet: pending.
    assert_eq!(a.pending(), [Pool::Agg]);
    let driver = &c.proxy.driver;
    let routable = driver.wait_until(PATIENCE, |d| d.any_routable()).await;
    assert!(routable, "never routable: {:?}", driver.worker_statuses());
    assert_eq!(a.pending(), [], "in the fleet: no longer pending");
    let workers = driver.worker_statuses();
    assert_eq!(workers.len(), 1);
    let (id, url) = (
        kvroute_core::ids::WorkerId(workers[0].id),
        workers[0].config.url.clone(),
    );
    let [
        Started {
            pool: Pool::Agg,
            pid: Some(pid),
            worker: Some(in_fleet),
            ..
        },
    ] = a.running()[..]
    else {
        panic!("{:?}", a.running());
    };
    assert_eq!(in_fleet, id);
    assert!(kvroute_testkit::process_group_alive(pid));

    // Its KV events reach the router once it caches something.
    c.complete(json!({"prompt": "The actuator's first worker serves this prompt.", "max_tokens": 4}))
        .await;
    let warm = driver.wait_for_kv(PATIENCE, |d| d.has_kv_events(id)).await;
    assert!(warm, "its KV events never arrived");

    // The autoscaler drains and removes it, then releases it: SIGTERM, and it exits cleanly.
    assert!(c.proxy.fleet.drain(id));
    assert!(c.proxy.fleet.remove(id));
    a.release(id, &url);
    until_none_running(&a).await;
    assert_eq!(exits(&c, "released"), 1.0);
    assert_eq!(exits(&c, "killed"), 0.0);
    until_group_gone(pid).await;
    // Its output went to its log file, not to a pipe.
    let log = std::fs::read_to_string(dir.join("worker-0.log")).unwrap();
    assert!(log.contains("mock worker: http://127.0.0.1:"), "{log}");
    assert!(log.contains("SIGTERM; exiting"), "{log}");
    assert!(driver.worker_statuses().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_ignores_sigterm_is_killed_when_its_grace_runs_out() {
    let c = empty_proxy().await;
    // It never serves the model (it is no server), so it stays pending until released. It says
    // when it ignores SIGTERM (a file), so the release cannot come before the trap.
    let dir = Scratch::new("actuators-stubborn");
    let trapped = dir.join("trapped");
    let stubborn = WorkerTemplate {
        command: [
            "sh".to_owned(),
            "-c".to_owned(),
            format!("trap '' TERM; touch {}; sleep 1000", trapped.display()),
        ]
        .to_vec(),
        worker: "http://127.0.0.1:{port}".to_owned(),
    };
    let mut config = process_config(stubborn, None);
    config.stop_grace_s = 1;
    let a = ProcessActuator::new(config, Arc::clone(&c.proxy.fleet));
    a.provision(Pool::Agg);
    assert_eq!(a.pending(), [Pool::Agg]);
    let [
        Started {
            pid: Some(pid),
            worker: None,
            ref url,
            ..
        },
    ] = a.running()[..]
    else {
        panic!("{:?}", a.running());
    };
    assert!(kvroute_testkit::process_group_alive(pid));
    eventually("the worker ignores SIGTERM", || trapped.exists()).await;
    // Released by its URL (it has no fleet id).
    a.release(kvroute_core::ids::WorkerId(u64::MAX), &url.clone());
    assert_eq!(a.pending(), [], "a released worker is not pending");
    until_none_running(&a).await;
    assert_eq!(exits(&c, "killed"), 1.0);
    // The whole group is gone, its sleep too.
    until_group_gone(pid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_from_outside_leaves_the_fleet_and_is_counted() {
    let c = empty_proxy().await;
    let a = ProcessActuator::new(
        process_config(mock_template(&[]), None),
        Arc::clone(&c.proxy.fleet),
    );
    a.provision(Pool::Agg);
    let driver = &c.proxy.driver;
    assert!(driver.wait_until(PATIENCE, |d| d.any_routable()).await);
    let [
        Started {
            pid: Some(pid),
            worker: Some(_),
            ..
        },
    ] = a.running()[..]
    else {
        panic!("{:?}", a.running());
    };
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let gone = driver
        .wait_until(PATIENCE, |d| d.worker_statuses().is_empty())
        .await;
    assert!(gone, "still registered: {:?}", driver.worker_statuses());
    until_none_running(&a).await;
    assert_eq!(exits(&c, "exited"), 1.0);
    assert_eq!(a.pending(), [], "gone, not pending: the planner replaces it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_not_ready_in_time_is_killed_and_never_joins() {
    let c = empty_proxy().await;
    // It serves another model than the proxy's: never ready.
    let mut template = mock_template(&[]);
    let at = template.command.iter().position(|a| a == "{model}").unwrap();
    template.command[at] = "another-model".to_owned();
    let mut config = process_config(template, None);
    config.ready_timeout_s = 1;
    let a = ProcessActuator::new(config, Arc::clone(&c.proxy.fleet));
    a.provision(Pool::Agg);
    until_none_running(&a).await;
    assert_eq!(exits(&c, "not_ready"), 1.0);
    assert!(c.proxy.driver.worker_statuses().is_empty(), "it never joined");
    assert_eq!(a.pending(), []);
}

/// An upstream stub that streams one chunk of each completion at once and the rest (with
/// `[DONE]`) when the test lets it; the test learns of each arrival.
struct HeldStream {
    url: String,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<()>,
    release: Arc<tokio::sync::Semaphore>,
}

impl HeldStream {
    async fn start() -> Self {
        use axum::routing::{get, post};
        const CHUNK: &str = "data: {\"id\":\"c\",\"object\":\"text_completion\",\"created\":0,\"model\":\"tiny\",\"choices\":[{\"index\":0,\"text\":\"a\",\"finish_reason\":null}]}\n\n";
        const LAST: &str = "data: {\"id\":\"c\",\"object\":\"text_completion\",\"created\":0,\"model\":\"tiny\",\"choices\":[{\"index\":0,\"text\":\"b\",\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
        let (tx, arrivals) = tokio::sync::mpsc::unbounded_channel();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let gate = Arc::clone(&release);
        let answer = move || {
            let (tx, gate) = (tx.clone(), Arc::clone(&gate));
            async move {
                tx.send(()).unwrap();
                let rest = async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, std::convert::Infallible>(bytes::Bytes::from_static(LAST.as_bytes()))
                };
                let body = futures_util::stream::once(async {
                    Ok::<_, std::convert::Infallible>(bytes::Bytes::from_static(CHUNK.as_bytes()))
                })
                .chain(futures_util::stream::once(rest));
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(axum::body::Body::from_stream(body))
                    .unwrap()
            }
        };
        let routes = axum::Router::new()
            .route("/v1/completions", post(answer))
            .route("/health", get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, routes).await.unwrap() });
        Self {
            url,
            arrivals,
            release,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_waits_answers_only_after_the_stream_in_flight_ends() {
    let mut held = HeldStream::start().await;
    let other = HeldStream::start().await;
    let c = fronting(vec![WorkerConfig::new(held.url.clone())], Vec::new(), |config| {
        config.upstream.request_timeout_ms = PATIENCE.as_millis() as u64;
    })
    .await;
    let driver = &c.proxy.driver;
    let held_id = driver.find_worker(&held.url).unwrap();
    let http = reqwest_lite::Http::new(c.proxy.url());
    let body = serde_json::to_vec(&json!({"prompt": "hold me", "max_tokens": 2, "stream": true})).unwrap();
    let stream = tokio::spawn(async move { http.request("POST", "/v1/completions", body).await });
    tokio::time::timeout(PATIENCE, held.arrivals.recv())
        .await
        .unwrap()
        .unwrap();
    // A second worker, so that draining the first leaves the fleet able to serve.
    let (status, _, out) = c
        .admin
        .request(
            "POST",
            "/admin/workers",
            serde_json::to_vec(&json!({"url": other.url})).unwrap(),
        )
        .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&out));

    // A drain whose patience runs out while the stream is held: 504, still draining.
    let path = format!("/admin/drain?url={}&wait=true&timeout_ms=100", held.url);
    let (status, _, out) = c.admin.request("POST", &path, Vec::new()).await;
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&out));
    assert_eq!(error(&out).code_name(), Some("drain_timeout"));
    assert_eq!(driver.worker_state(held_id).unwrap().name(), StateName::Draining);

    // A drain that waits (by id): still waiting while the stream is held.
    let admin = reqwest_lite::Http::new(c.proxy.admin_url());
    let path = format!("/admin/workers/{}/drain?wait=true", held_id.0);
    let drain = tokio::spawn(async move { admin.request("POST", &path, Vec::new()).await });
    let draining = driver
        .wait_until(PATIENCE, |d| {
            d.worker_state(held_id)
                .is_some_and(|s| s.name() == StateName::Draining)
        })
        .await;
    assert!(draining);
    assert!(!drain.is_finished(), "answered while a stream is in flight");
    assert!(!stream.is_finished());

    held.release.add_permits(1);
    let (status, _, out) = stream.await.unwrap();
    assert_eq!(status, 200);
    assert!(String::from_utf8_lossy(&out).contains("[DONE]"));
    let (status, _, out) = drain.await.unwrap();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&out));
    let answer: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(answer["drained"], true);
    assert_eq!(driver.worker_state(held_id).unwrap().name(), StateName::Drained);

    // Unknown workers and bad figures are named.
    let (status, _, _) = c
        .admin
        .request(
            "POST",
            "/admin/drain?url=http://127.0.0.1:1&wait=true",
            Vec::new(),
        )
        .await;
    assert_eq!(status, 404);
    let (status, _, out) = c
        .admin
        .request(
            "POST",
            "/admin/workers/0/drain?wait=true&timeout_ms=soon",
            Vec::new(),
        )
        .await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_removal_order_puts_the_cheapest_worker_first_and_exports_it() {
    let c = cluster(2, 20.0, |_| {}).await;
    // Worker 1 out of routing (drained) while worker 0 caches a long prompt.
    let prompt = "a prompt long enough to fill several blocks of the mock's cache ".repeat(8);
    assert!(c.proxy.fleet.drain(kvroute_core::ids::WorkerId(1)));
    c.complete(json!({"prompt": prompt, "max_tokens": 2})).await;
    let holder = c.wait_for_cached_blocks(Some(0), 4).await;
    assert_eq!(holder, 0);
    let (status, _, out) = c
        .admin
        .request("GET", "/admin/planner/removal-order", Vec::new())
        .await;
    assert_eq!(status, 200);
    let order: Value = serde_json::from_slice(&out).unwrap();
    let workers = order["workers"].as_array().unwrap();
    let ids: Vec<u64> = workers.iter().map(|w| w["id"].as_u64().unwrap()).collect();
    assert_eq!(ids, [1, 0], "the worker without unique cache goes first: {order}");
    assert_eq!(workers[1]["rank"], 1);
    assert!(
        workers[1]["cached_unique_blocks"].as_u64().unwrap() >= 4,
        "{order}"
    );
    assert_eq!(workers[0]["cached_unique_blocks"], 0);
    assert_eq!(workers[0]["in_flight"], 0);
    let metrics = c.http.get("/metrics").await;
    assert!(
        metrics.contains("kvroute_worker_removal_rank{worker=\"1\"} 0"),
        "{metrics}"
    );
    assert_eq!(
        metric(&metrics, "kvroute_worker_removal_rank", "worker=\"1\""),
        0.0
    );
    assert_eq!(
        metric(&metrics, "kvroute_worker_removal_rank", "worker=\"0\""),
        1.0
    );
    assert_eq!(
        metric(&metrics, "kvroute_worker_removal_cost", "worker=\"0\""),
        1.0
    );
    assert_eq!(
        metric(&metrics, "kvroute_worker_removal_cost", "worker=\"1\""),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_actuator_sigterms_its_workers() {
    let c = empty_proxy().await;
    let dir = log_dir("shutdown");
    let a = ProcessActuator::new(
        process_config(mock_template(&[]), Some(dir.path().to_owned())),
        Arc::clone(&c.proxy.fleet),
    );
    a.provision(Pool::Agg);
    assert!(c.proxy.driver.wait_until(PATIENCE, |d| d.any_routable()).await);
    let [Started { pid: Some(pid), .. }] = a.running()[..] else {
        panic!("{:?}", a.running());
    };
    // The proxy stops: its actuator goes, and its workers are told to stop.
    drop(a);
    until_group_gone(pid).await;
    let log = std::fs::read_to_string(dir.join("worker-0.log")).unwrap();
    assert!(log.contains("SIGTERM; exiting"), "{log}");
}
