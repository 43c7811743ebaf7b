//! Workers found, not listed, end to end: a proxy discovering mock workers through a real DNS
//! server (`dnsmasq`, started by each test on a free loopback port; its SRV answers changed by a
//! restart, its A answers by a hosts file it reads again on SIGHUP; where none is installed the
//! DNS tests skip, saying so, and fail in CI) and through a real file replaced by a rename, as a
//! ConfigMap update does.
//!
//! Each test waits on explicit conditions (the driver's change notifications, or a generous
//! deadline); none asserts after a fixed sleep.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvroute_core::ids::WorkerId;
use kvroute_http::Model;
use kvroute_http::net::HttpClient;
use kvroute_mock::{self as mock, MockConfig, MockWorker};
use kvroute_proxy::config::DiscoveryConfig;
use kvroute_proxy::worker::StateName;
use kvroute_proxy::{Driver, ProxyHandle, ServeConfig, WorkerConfig};
use kvroute_testkit::{External, PATIENCE, Scratch, eventually_or, require};
use serde_json::{Value, json};

/// How often the proxy asks its source again.
const INTERVAL_MS: u64 = 100;
/// Output tokens of the request kept in flight: long enough to outlast the drain's start by
/// far (the mock engine runs in real time).
const STREAM_TOKENS: u32 = 1_000;

/// A dnsmasq of the test's own on a loopback port, answering from the records it was last
/// started with.
struct Dnsmasq {
    binary: PathBuf,
    port: u16,
    dir: Scratch,
    child: Option<Child>,
}

impl Dnsmasq {
    fn binary() -> Option<PathBuf> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .chain(["/usr/sbin".into(), "/sbin".into()])
            .map(|dir| dir.join("dnsmasq"))
            .find(|p| p.is_file())
    }

    /// Started with `records` (dnsmasq options), or `None` where dnsmasq is absent (outside CI
    /// only). The port is free for UDP and TCP both (dnsmasq listens on both), and it is tried
    /// again on another port if dnsmasq could not listen on it anyway (taken in between by one
    /// of the other tests' connections).
    fn start(name: &str, records: &[String]) -> Option<Self> {
        let found = Self::binary();
        if !require(External::Dnsmasq, found.is_some()) {
            return None;
        }
        let dir = Scratch::new(&format!("dnsmasq-{name}"));
        let mut server = Self {
            binary: found.unwrap(),
            port: 0,
            dir,
            child: None,
        };
        for _ in 0..5 {
            server.port = free_udp_and_tcp_port();
            if server.try_serve(records).is_ok() {
                return Some(server);
            }
        }
        panic!("dnsmasq did not start on any of five free ports");
    }

    /// The server, `IP:PORT`.
    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Restarts it (on the same port) answering with `records`; returns once it answers.
    fn serve(&mut self, records: &[String]) {
        if let Err(status) = self.try_serve(records) {
            panic!("dnsmasq exited at start on port {} ({status})", self.port);
        }
    }

    /// Restarts it on its port; `Err` with its exit status if it exits before answering.
    fn try_serve(&mut self, records: &[String]) -> Result<(), std::process::ExitStatus> {
        self.stop();
        let child = Command::new(&self.binary)
            .args([
                "--no-daemon",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--listen-address=127.0.0.1",
                "--local=/test/",
                &format!("--port={}", self.port),
                &format!("--pid-file={}", self.dir.join("pid").display()),
            ])
            .args(records)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let child = self.child.insert(child);
        // Wait for its first answer (to any question: a name under `.test` it does not know
        // gets NXDOMAIN), each question waiting at most 200 ms, while it runs.
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let query = probe_query();
        let deadline = std::time::Instant::now() + PATIENCE;
        let mut reply = [0u8; 512];
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return Err(status);
            }
            socket.send_to(&query, ("127.0.0.1", self.port)).unwrap();
            if matches!(socket.recv(&mut reply), Ok(n) if n >= 2 && reply[..2] == query[..2]) {
                return Ok(());
            }
            assert!(
                std::time::Instant::now() < deadline,
                "dnsmasq never answered on port {}",
                self.port
            );
        }
    }

    /// Tells it to read its hosts files (`--addn-hosts`) again (SIGHUP).
    fn reload(&self) {
        let pid = self.child.as_ref().unwrap().id().to_string();
        let status = Command::new("kill").args(["-HUP", &pid]).status().unwrap();
        assert!(status.success(), "kill -HUP {pid}");
    }

    /// A file in its directory.
    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Stops it: every question goes unanswered.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A port free on loopback for UDP and TCP both.
fn free_udp_and_tcp_port() -> u16 {
    loop {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A DNS question (id 0x6b76, recursion desired) for the A record of `probe.test`.
fn probe_query() -> Vec<u8> {
    let mut q = vec![0x6b, 0x76, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
    for label in ["probe", "test"] {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        // Stopped first: its directory goes after, with the fields.
        self.stop();
    }
}

/// SRV records of `_http._tcp.workers.test` for `mocks`: target `wN.test` (127.0.0.1) at each
/// mock's port.
fn srv_records(mocks: &[&MockWorker]) -> Vec<String> {
    mocks
        .iter()
        .enumerate()
        .flat_map(|(i, m)| {
            [
                format!("--srv-host=_http._tcp.workers.test,w{i}.test,{}", m.addr.port()),
                format!("--host-record=w{i}.test,127.0.0.1"),
            ]
        })
        .collect()
}

async fn mocks(n: usize) -> Vec<MockWorker> {
    mocks_on(n, "127.0.0.1".parse().unwrap(), 0).await
}

/// `n` mock workers on `host`, from `port` on (0: free ports).
async fn mocks_on(n: usize, host: std::net::IpAddr, port: u16) -> Vec<MockWorker> {
    let mut mc = MockConfig::new(n);
    mc.host = host;
    mc.port = port;
    // Real time: a long output takes a while, so a request stays in flight while a test looks.
    mc.engine.speedup = 1.0;
    mc.events = false;
    mock::start(&mc, Arc::new(Model::tiny().unwrap())).await.unwrap()
}

/// A proxy with `discovery` and `workers` listed by flag.
async fn proxy(discovery: DiscoveryConfig, workers: Vec<WorkerConfig>) -> ProxyHandle {
    let config = ServeConfig {
        server: kvroute_proxy::config::ServerConfig {
            listen: "127.0.0.1:0".into(),
            admin_listen: "127.0.0.1:0".into(),
            ..Default::default()
        },
        upstream: kvroute_proxy::config::UpstreamConfig {
            health_interval_ms: 200,
            ..Default::default()
        },
        discovery: DiscoveryConfig {
            discover_interval_ms: INTERVAL_MS,
            // Only the request's end lets a worker go in these tests.
            discover_drain_timeout_ms: 600_000,
            ..discovery
        },
        workers,
        ..ServeConfig::default()
    };
    kvroute_proxy::start(config, Some(Arc::new(Model::tiny().unwrap())))
        .await
        .unwrap()
}

/// Worker `url`'s id and state, if the proxy has it.
fn worker(driver: &Driver, url: &str) -> Option<(WorkerId, StateName)> {
    driver
        .worker_statuses()
        .into_iter()
        .find(|w| w.config.url.trim_end_matches('/') == url)
        .map(|w| (WorkerId(w.id), w.state))
}

/// The workers' URLs, sorted.
fn urls(driver: &Driver) -> Vec<String> {
    let mut urls: Vec<String> = driver.worker_urls().into_iter().map(|(_, u)| u).collect();
    urls.sort();
    urls
}

/// Waits until the proxy's workers are exactly `want` (URLs), each ready (routable).
async fn until_fleet_is(driver: &Driver, want: &[String]) {
    let mut want = want.to_vec();
    want.sort();
    let ready = |d: &Driver| {
        urls(d) == want
            && want
                .iter()
                .all(|u| worker(d, u).is_some_and(|(_, s)| s == StateName::Ready))
    };
    let reached = driver.wait_until(PATIENCE, ready).await;
    assert!(
        reached,
        "the fleet never became {want:?}: {:?}",
        driver.worker_statuses()
    );
}

fn client() -> HttpClient {
    kvroute_http::net::client(Duration::from_secs(5))
}

async fn post(client: &HttpClient, proxy: &ProxyHandle, body: &Value) -> hyper::Response<Incoming> {
    let request = hyper::Request::post(format!("{}/v1/completions", proxy.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(serde_json::to_vec(body).unwrap())))
        .unwrap();
    client.request(request).await.unwrap()
}

/// A short completion that must succeed.
async fn complete(client: &HttpClient, proxy: &ProxyHandle) {
    let response = post(client, proxy, &json!({"prompt": "hello", "max_tokens": 2})).await;
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
}

/// A long streamed completion, returned once its first chunk came (routed and booked), with
/// the URL of the worker it runs on.
async fn in_flight(client: &HttpClient, proxy: &ProxyHandle) -> (Incoming, String) {
    let body = json!({"prompt": "a long story", "max_tokens": STREAM_TOKENS, "stream": true});
    let response = post(client, proxy, &body).await;
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    let busy: Vec<String> = proxy
        .driver
        .worker_statuses()
        .into_iter()
        .filter(|w| w.active_requests == 1)
        .map(|w| w.config.url.trim_end_matches('/').to_owned())
        .collect();
    assert_eq!(busy.len(), 1, "{:?}", proxy.driver.worker_statuses());
    (body, busy[0].clone())
}

/// Lets worker `url` go while `stream` runs on it: `drop_it` takes it out of the source's
/// answer; the worker must drain (out of routing, its stream still flowing), stay until the
/// stream ends, then leave.
async fn let_go_while_streaming(
    proxy: &ProxyHandle,
    mut stream: Incoming,
    url: &str,
    drop_it: impl FnOnce(),
) {
    let driver = &proxy.driver;
    let (id, _) = worker(driver, url).unwrap();
    drop_it();
    let draining = |d: &Driver| worker(d, url).is_some_and(|(_, s)| s == StateName::Draining);
    assert!(
        driver.wait_until(PATIENCE, draining).await,
        "never drained: {:?}",
        driver.worker_statuses()
    );
    // Still flowing, still booked, not removed.
    for _ in 0..5 {
        assert!(stream.frame().await.unwrap().unwrap().is_data());
    }
    assert_eq!(worker(driver, url), Some((id, StateName::Draining)));
    assert_eq!(driver.in_flight(id), Some(1));
    // The stream runs to its end, whole; then the worker leaves.
    let rest = stream.collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let gone = |d: &Driver| worker(d, url).is_none();
    assert!(
        driver.wait_until(PATIENCE, gone).await,
        "never removed: {:?}",
        driver.worker_statuses()
    );
}

fn errors(proxy: &ProxyHandle, source: &str) -> u64 {
    proxy
        .driver
        .metrics
        .discovery_errors
        .with_label_values(&[source])
        .get()
}

fn discovered(proxy: &ProxyHandle, source: &str) -> i64 {
    proxy
        .driver
        .metrics
        .discovery_workers
        .with_label_values(&[source])
        .get()
}

/// Waits until `kvroute_discovery_workers{source}` is `n` (set once a round's changes are made).
async fn until_discovered(proxy: &ProxyHandle, source: &str, n: i64) {
    eventually_or(
        || format!("{source} discovered {}, not {n}", discovered(proxy, source)),
        || discovered(proxy, source) == n,
    )
    .await;
}

/// Waits until the source has failed `n` more times than `since`; the fleet is then checked.
async fn until_errors(proxy: &ProxyHandle, source: &str, since: u64, n: u64) {
    eventually_or(
        || format!("{source} errors stayed at {}", errors(proxy, source)),
        || errors(proxy, source) >= since + n,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_follow_the_dns_answer_and_a_failed_resolution_removes_nothing() {
    let mocks = mocks(3).await;
    let [a, b, listed] = [&mocks[0], &mocks[1], &mocks[2]];
    let Some(mut dns) = Dnsmasq::start("srv", &srv_records(&[a])) else {
        return;
    };
    // `listed` comes by flag: discovery never removes it, even when its answer names it and
    // then stops naming it.
    let proxy = proxy(
        DiscoveryConfig {
            discover_dns: Some("srv:_http._tcp.workers.test".into()),
            discover_dns_server: Some(dns.addr()),
            ..Default::default()
        },
        vec![WorkerConfig::parse_flag(&listed.url()).unwrap()],
    )
    .await;
    let client = client();
    until_fleet_is(&proxy.driver, &[a.url(), listed.url()]).await;
    complete(&client, &proxy).await;
    until_discovered(&proxy, "dns", 1).await;

    // The answer gains a worker (and names the flag's): it is registered and routable.
    dns.serve(&srv_records(&[a, b, listed]));
    until_fleet_is(&proxy.driver, &[a.url(), b.url(), listed.url()]).await;
    until_discovered(&proxy, "dns", 2).await;
    for _ in 0..4 {
        complete(&client, &proxy).await;
    }

    // The answer loses the worker a stream runs on: drained, the stream completes, removed.
    // (The flag's worker is kept out of the way of the stream.)
    assert!(proxy.fleet.drain(worker(&proxy.driver, &listed.url()).unwrap().0));
    let (stream, busy) = in_flight(&client, &proxy).await;
    let keep = if busy == a.url() { b } else { a };
    let_go_while_streaming(&proxy, stream, &busy, || dns.serve(&srv_records(&[keep]))).await;
    assert_eq!(urls(&proxy.driver), {
        let mut u = vec![keep.url(), listed.url()];
        u.sort();
        u
    });
    assert_eq!(
        worker(&proxy.driver, &listed.url()).unwrap().1,
        StateName::Drained,
        "the flag's worker is left as the operator left it"
    );

    // The DNS server stops: nothing is removed, however often resolution fails.
    let since = errors(&proxy, "dns");
    dns.stop();
    until_errors(&proxy, "dns", since, 3).await;
    assert_eq!(worker(&proxy.driver, &keep.url()).unwrap().1, StateName::Ready);
    assert_eq!(urls(&proxy.driver).len(), 2);
    complete(&client, &proxy).await;
    proxy.driver.check_invariants().unwrap();
}

/// Writes `text` as the file at `path` the way a ConfigMap update does: a new file, renamed
/// over the old one.
fn replace(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_follow_a_file_replaced_by_rename_and_a_bad_or_missing_file_removes_nothing() {
    let mocks = mocks(2).await;
    let [a, b] = [&mocks[0], &mocks[1]];
    let dir = Scratch::new("discovery-file");
    let path = dir.join("workers");
    replace(&path, &format!("# the vLLM pods\n\n{}\n", a.url()));
    let proxy = proxy(
        DiscoveryConfig {
            discover_file: Some(path.clone()),
            ..Default::default()
        },
        Vec::new(),
    )
    .await;
    let client = client();
    until_fleet_is(&proxy.driver, &[a.url()]).await;
    complete(&client, &proxy).await;

    // A new file renamed over the old: the new worker joins.
    replace(&path, &format!("{}\n# added\n{}\n", a.url(), b.url()));
    until_fleet_is(&proxy.driver, &[a.url(), b.url()]).await;
    until_discovered(&proxy, "file", 2).await;

    // The worker a stream runs on is dropped from the file: drained, completes, removed.
    let (stream, busy) = in_flight(&client, &proxy).await;
    let keep = if busy == a.url() { b } else { a };
    let_go_while_streaming(&proxy, stream, &busy, || {
        replace(&path, &format!("{}\n", keep.url()));
    })
    .await;
    assert_eq!(urls(&proxy.driver), [keep.url()]);

    // A bad line, an empty file, no file: each refused, nothing removed.
    let bad_line = format!("{}\nhttp://127.0.0.1:1,dp=0\n", keep.url());
    for broken in [Some(bad_line.as_str()), Some("# nobody\n"), None] {
        let since = errors(&proxy, "file");
        match broken {
            Some(text) => replace(&path, text),
            None => std::fs::remove_file(&path).unwrap(),
        }
        until_errors(&proxy, "file", since, 2).await;
        assert_eq!(urls(&proxy.driver), [keep.url()], "{broken:?}");
        assert_eq!(worker(&proxy.driver, &keep.url()).unwrap().1, StateName::Ready);
    }
    complete(&client, &proxy).await;
    proxy.driver.check_invariants().unwrap();
}

/// A records: one worker per address, all at `discover-port`. The mocks listen on 127.0.0.2 and
/// 127.0.0.3 (loopback addresses Linux answers on) at one port; the answer comes from a hosts
/// file dnsmasq reads again on SIGHUP.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_follow_a_names_a_records_at_the_discovery_port() {
    let hosts = |ips: &[&str]| -> String { ips.iter().map(|ip| format!("{ip} workers.test\n")).collect() };
    let Some(mut dns) = Dnsmasq::start("a", &[]) else {
        return;
    };
    let addn_hosts = dns.file("hosts");
    std::fs::write(&addn_hosts, hosts(&["127.0.0.2"])).unwrap();
    dns.serve(&[format!("--addn-hosts={}", addn_hosts.display())]);
    // A port free on both addresses.
    let port = std::net::TcpListener::bind("127.0.0.2:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let first = mocks_on(1, "127.0.0.2".parse().unwrap(), port).await;
    let second = mocks_on(1, "127.0.0.3".parse().unwrap(), port).await;
    let (a, b) = (first[0].url(), second[0].url());
    let proxy = proxy(
        DiscoveryConfig {
            discover_dns: Some("workers.test".into()),
            discover_dns_server: Some(dns.addr()),
            discover_port: Some(port),
            ..Default::default()
        },
        Vec::new(),
    )
    .await;
    let client = client();
    until_fleet_is(&proxy.driver, std::slice::from_ref(&a)).await;
    complete(&client, &proxy).await;

    std::fs::write(&addn_hosts, hosts(&["127.0.0.2", "127.0.0.3"])).unwrap();
    dns.reload();
    until_fleet_is(&proxy.driver, &[a.clone(), b.clone()]).await;
    until_discovered(&proxy, "dns", 2).await;

    // An idle worker no longer answered is drained at once and removed.
    std::fs::write(&addn_hosts, hosts(&["127.0.0.3"])).unwrap();
    dns.reload();
    until_fleet_is(&proxy.driver, std::slice::from_ref(&b)).await;
    until_discovered(&proxy, "dns", 1).await;
    complete(&client, &proxy).await;
    proxy.driver.check_invariants().unwrap();
}
