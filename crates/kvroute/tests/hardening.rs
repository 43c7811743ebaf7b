//! Safe to put on a network, checked from outside: the real `kvroute` binary (`kvroute serve`,
//! in front of `kvroute mock` or of a stub engine in the test), spoken to over raw TCP. No
//! sleep decides an outcome: each test waits for an event (a closed connection, a line, an
//! exit) with a generous deadline, and uses short configured timeouts.

// Helpers outside `#[test]` functions unwrap as the tests do (clippy.toml allows it only inside).
#![allow(clippy::unwrap_used)]

#[path = "support/gauges.rs"]
mod gauges;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use kvroute_testkit::{PATIENCE, eventually_blocking as eventually};

/// A `kvroute` process whose stderr and stdout are collected; killed when dropped.
struct Proc {
    child: Child,
    stderr: Arc<Mutex<String>>,
    stdout: Arc<Mutex<String>>,
    /// The threads that read its stderr and stdout, until each ends.
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Proc {
    /// Starts `kvroute args` (behind `prefix`, e.g. `prlimit`, if given) and waits for a
    /// stderr line containing `ready`.
    fn start(prefix: &[&str], args: &[&str], ready: &str) -> Self {
        let mut command = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(env!("CARGO_BIN_EXE_kvroute"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_kvroute")),
        };
        let mut child = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (stderr, stdout) = (
            Arc::new(Mutex::new(String::new())),
            Arc::new(Mutex::new(String::new())),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let collect =
            |pipe: Box<dyn Read + Send>, sink: &Arc<Mutex<String>>, tx: std::sync::mpsc::Sender<()>| {
                let sink = Arc::clone(sink);
                let marker = ready.to_owned();
                std::thread::spawn(move || {
                    for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                        let mut s = sink.lock().unwrap();
                        s.push_str(&line);
                        s.push('\n');
                        drop(s);
                        if line.contains(&marker) {
                            let _ = tx.send(());
                        }
                    }
                })
            };
        let readers = vec![
            collect(Box::new(child.stderr.take().unwrap()), &stderr, tx.clone()),
            collect(Box::new(child.stdout.take().unwrap()), &stdout, tx),
        ];
        let mut p = Self {
            child,
            stderr,
            stdout,
            readers,
        };
        if rx.recv_timeout(PATIENCE).is_err() {
            let _ = p.child.kill();
            panic!("kvroute {args:?} never said {ready:?}:\n{}", p.log());
        }
        p
    }

    fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Everything it wrote, stdout then stderr, once it has exited and both pipes ended.
    fn output_after_exit(&mut self) -> String {
        for reader in self.readers.drain(..) {
            reader.join().unwrap();
        }
        format!("{}{}", self.stdout.lock().unwrap(), self.log())
    }

    /// The address after `marker` (`http://ADDR`) in its log.
    fn addr_after(&self, marker: &str) -> SocketAddr {
        let log = self.log();
        let at = log
            .find(marker)
            .unwrap_or_else(|| panic!("{marker:?} not in {log}"))
            + marker.len();
        let rest = log[at..].trim_start().trim_start_matches("http://");
        let end = rest
            .find(|c: char| c == ';' || c == '"' || c.is_whitespace())
            .unwrap_or(rest.len());
        rest[..end].parse().unwrap()
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the process to exit; its exit code.
    fn wait_exit(&mut self) -> Option<i32> {
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("kvroute never exited:\n{}", self.log());
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A proxy started by `kvroute serve args` on free ports; its inference and admin addresses.
fn serve(args: &[&str]) -> (Proc, SocketAddr, SocketAddr) {
    serve_behind(&[], args)
}

fn serve_behind(prefix: &[&str], args: &[&str]) -> (Proc, SocketAddr, SocketAddr) {
    let mut all = vec![
        "serve",
        "--approximate-tokenizer",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ];
    all.extend_from_slice(args);
    let p = Proc::start(prefix, &all, "kvroute serve: listening on");
    let addr = p.addr_after("kvroute serve: listening on");
    let admin = p.addr_after("; admin API on");
    (p, addr, admin)
}

/// One mock worker (`kvroute mock`) on free ports, with its engine slowed by `speedup`; its
/// `--worker` flag as it prints it.
fn mock(speedup: &str) -> (Proc, String) {
    let p = Proc::start(
        &[],
        &[
            "mock",
            "--workers",
            "1",
            "--port",
            "0",
            "--event-port",
            "0",
            "--speedup",
            speedup,
        ],
        "route to them with",
    );
    let log = p.log();
    let flag = log
        .lines()
        .find_map(|l| l.strip_prefix("mock worker: "))
        .unwrap()
        .trim()
        .to_owned();
    (p, flag)
}

/// An HTTP/1.1 answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The OpenAI error's `code`; panics if the body is not OpenAI's error shape.
    fn error_code(&self) -> String {
        let v: Value = serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body));
        let e = &v["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{}", self.body);
        e["code"].as_str().unwrap().to_owned()
    }
}

/// Reads until the server closes the connection (within `PATIENCE`); what it sent.
fn until_closed(stream: &mut TcpStream) -> String {
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut all = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the server kept the connection open: {e}"),
        }
    }
    String::from_utf8_lossy(&all).into_owned()
}

fn parse(raw: &str) -> Answer {
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no answer: {raw:?}"));
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// One request on its own connection (`Connection: close`), with `headers` added.
fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut stream = TcpStream::connect(addr).unwrap();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        request.push_str(&format!("{n}: {v}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes()).unwrap();
    parse(&until_closed(&mut stream))
}

#[test]
fn nothing_under_admin_answers_on_the_inference_port() {
    let (_mock, worker) = mock("20");
    let (_p, addr, admin) = serve(&["--worker", &worker]);
    for (method, path) in [
        ("GET", "/admin/workers"),
        ("POST", "/admin/workers"),
        ("DELETE", "/admin/workers/0"),
        ("POST", "/admin/workers/0/drain"),
    ] {
        let a = http(addr, method, path, &[], "");
        assert_eq!(a.status, 404, "{method} {path}: {}", a.body);
        assert_eq!(a.error_code(), "not_found");
    }
    let a = http(admin, "GET", "/admin/workers", &[], "");
    assert_eq!(a.status, 200, "{}", a.body);
    let workers: Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(workers["workers"][0]["state"], "ready");
    // And the inference API is not on the admin port.
    assert_eq!(http(admin, "GET", "/v1/models", &[], "").status, 404);
    // Draining the only worker would leave nothing to serve: 409 with the reason.
    let a = http(admin, "POST", "/admin/workers/0/drain", &[], "");
    assert_eq!(a.status, 409, "{}", a.body);
    assert_eq!(a.error_code(), "fleet_unservable");
    // Errors are OpenAI-shaped, whatever the router's layer answered them.
    let a = http(addr, "GET", "/v1/completions", &[], "");
    assert_eq!(a.status, 405, "{}", a.body);
    assert_eq!(a.error_code(), "method_not_allowed");
    let a = http(addr, "POST", "/v1/completions", &[], "{not json");
    assert_eq!(a.status, 400, "{}", a.body);
    a.error_code();
    // Every answer names its request: the client's id, or one made for it.
    let a = http(addr, "GET", "/v1/models", &[("x-request-id", "abc-123")], "");
    assert_eq!(a.header("x-request-id"), Some("abc-123"));
    let a = http(addr, "GET", "/v1/models", &[], "");
    assert!(a.header("x-request-id").is_some_and(|id| !id.is_empty()));
}

#[test]
fn an_admin_api_beyond_loopback_needs_a_token() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--listen", "127.0.0.1:0", "--admin-listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("--admin-token"), "{stderr}");
    let (_p, _addr, admin) = serve(&["--admin-token", "t0ken"]);
    let a = http(admin, "GET", "/admin/workers", &[], "");
    assert_eq!(a.status, 401, "{}", a.body);
    assert_eq!(a.error_code(), "invalid_api_key");
    let a = http(
        admin,
        "GET",
        "/admin/workers",
        &[("Authorization", "Bearer wrong")],
        "",
    );
    assert_eq!(a.status, 401);
    let a = http(
        admin,
        "GET",
        "/admin/workers",
        &[("Authorization", "Bearer t0ken")],
        "",
    );
    assert_eq!(a.status, 200, "{}", a.body);
}

#[test]
fn a_client_that_never_finishes_its_headers_is_cut_off() {
    let (_p, addr, _) = serve(&["--header-read-timeout-ms", "300"]);
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        .unwrap();
    let t0 = Instant::now();
    assert_eq!(until_closed(&mut stream), "", "cut off without an answer");
    // Well before the patience: the header timeout did it.
    assert!(t0.elapsed() < PATIENCE / 2, "{:?}", t0.elapsed());
}

#[test]
fn a_client_that_never_finishes_its_body_gets_a_408() {
    let (_mock, worker) = mock("20");
    let (_p, addr, _) = serve(&["--worker", &worker, "--body-read-timeout-ms", "300"]);
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        .unwrap();
    let a = parse(&until_closed(&mut stream));
    assert_eq!(a.status, 408, "{}", a.body);
    assert_eq!(a.error_code(), "request_timeout");
}

#[test]
fn inference_api_keys_are_checked_and_health_is_exempt() {
    let (_mock, worker) = mock("20");
    let (_p, addr, _) = serve(&["--worker", &worker, "--api-key", "k1", "--api-key", "k2"]);
    let body = r#"{"prompt": "hello", "max_tokens": 2}"#;
    let a = http(addr, "POST", "/v1/completions", &[], body);
    assert_eq!(a.status, 401, "{}", a.body);
    assert_eq!(a.error_code(), "invalid_api_key");
    assert_eq!(a.header("www-authenticate"), Some("Bearer"));
    let a = http(addr, "GET", "/v1/models", &[("Authorization", "Bearer k3")], "");
    assert_eq!(a.status, 401);
    for key in ["Bearer k1", "Bearer k2"] {
        let a = http(addr, "POST", "/v1/completions", &[("Authorization", key)], body);
        assert_eq!(a.status, 200, "{key}: {}", a.body);
    }
    assert_eq!(http(addr, "GET", "/health", &[], "").status, 200);
    assert_eq!(http(addr, "GET", "/metrics", &[], "").status, 200);
}

/// A stub engine: answers `/health` and a completion, or (with `answer` false) accepts and
/// never answers a completion; it records each request's path and `Authorization`.
/// What a stub engine was sent: each request's path and `Authorization`.
type Calls = Arc<Mutex<Vec<(String, Option<String>)>>>;

fn stub_engine(answer: bool) -> (String, Calls) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let log = Arc::clone(&log);
            std::thread::spawn(move || stub_connection(stream, answer, &log));
        }
    });
    (url, seen)
}

fn stub_connection(stream: TcpStream, answer: bool, log: &Mutex<Vec<(String, Option<String>)>>) {
    let mut writer = stream.try_clone().unwrap();
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split(' ').nth(1).unwrap_or_default().to_owned();
        let (mut auth, mut length) = (None, 0usize);
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (n, v) = h.split_once(':').unwrap();
            match n.to_ascii_lowercase().as_str() {
                "authorization" => auth = Some(v.trim().to_owned()),
                "content-length" => length = v.trim().parse().unwrap(),
                _ => {}
            }
        }
        let mut body = vec![0u8; length];
        reader.read_exact(&mut body).unwrap();
        log.lock().unwrap().push((path.clone(), auth));
        let out = if path == "/health" {
            String::new()
        } else if answer {
            r#"{"id":"c","object":"text_completion","created":0,"model":"tiny","choices":[{"index":0,"text":"hi","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#.to_owned()
        } else {
            // Accepted, never answered: hold the connection until the client goes.
            let _ = reader.read(&mut [0u8; 1]);
            return;
        };
        let response = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{out}",
            out.len()
        );
        if writer.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

#[test]
fn the_engines_credential_goes_on_every_call_to_it() {
    let (url, seen) = stub_engine(true);
    let worker = format!("{url},api-key=sek");
    let (_p, addr, admin) = serve(&["--worker", &worker, "--health-interval-ms", "50"]);
    let body = r#"{"prompt": "hello", "max_tokens": 1}"#;
    let a = http(
        addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer client")],
        body,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    eventually("a health check", || {
        seen.lock().unwrap().iter().any(|(p, _)| p == "/health")
    });
    let calls = seen.lock().unwrap().clone();
    for path in ["/health", "/v1/completions"] {
        assert!(calls.iter().any(|(p, _)| p == path), "{path}: {calls:?}");
    }
    for (path, auth) in &calls {
        assert_eq!(auth.as_deref(), Some("Bearer sek"), "{path}");
    }
    // The credential is never listed.
    let listed = http(admin, "GET", "/admin/workers", &[], "").body;
    assert!(!listed.contains("sek"), "{listed}");

    // Without a configured credential, the client's own goes on with its request.
    let (url, seen) = stub_engine(true);
    let (_p, addr, _) = serve(&["--worker", &url, "--health-interval-ms", "0"]);
    let a = http(
        addr,
        "POST",
        "/v1/completions",
        &[("Authorization", "Bearer client")],
        body,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    // The generation call carries the client's credential; the proxy's own calls (the
    // registration checks: /v1/models, /tokenize) carry none, never a client's.
    let calls = seen.lock().unwrap().clone();
    let generation: Vec<_> = calls.iter().filter(|(p, _)| p == "/v1/completions").collect();
    assert_eq!(
        generation,
        [&("/v1/completions".to_owned(), Some("Bearer client".to_owned()))]
    );
    for (path, auth) in calls.iter().filter(|(p, _)| p != "/v1/completions") {
        assert_eq!(auth, &None, "{path}");
    }
}

#[test]
fn an_engine_that_accepts_and_never_answers_gets_a_504_and_its_load_is_freed() {
    let (url, _) = stub_engine(false);
    let (_p, addr, admin) = serve(&[
        "--worker",
        &url,
        "--health-interval-ms",
        "0",
        "--request-timeout-ms",
        "300",
    ]);
    let a = http(addr, "POST", "/v1/completions", &[], r#"{"prompt": "hello"}"#);
    assert_eq!(a.status, 504, "{}", a.body);
    assert_eq!(a.error_code(), "timeout");
    let workers: Value = serde_json::from_str(&http(admin, "GET", "/admin/workers", &[], "").body).unwrap();
    assert_eq!(workers["workers"][0]["active_requests"], 0, "{workers}");
}

/// Polls `/metrics` at `addr` until its load gauges equal `in_flight` ([`gauges::mismatch`]).
fn until_gauges_are(addr: SocketAddr, in_flight: &[(u64, u64)]) {
    let mut wrong = None;
    eventually("the gauges equal the requests in flight", || {
        wrong = gauges::mismatch(&http(addr, "GET", "/metrics", &[], "").body, in_flight);
        wrong.is_none()
    });
}

/// Starts a streamed completion of `max_tokens` on its own connection and reads up to its first
/// token; the connection and what it read.
fn stream_started(addr: SocketAddr, prompt: &str, max_tokens: u32) -> (TcpStream, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).unwrap();
    let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": {max_tokens}, "stream": true}}"#);
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the first token");
        seen.extend_from_slice(&buf[..n]);
    }
    (stream, seen)
}

#[test]
fn sigterm_lets_a_stream_in_flight_finish_then_the_process_exits() {
    // A slow engine: the streams are in flight for seconds.
    let (_mock, worker) = mock("0.2");
    let (mut p, addr, _) = serve(&["--worker", &worker]);
    let streams = [
        stream_started(addr, "a stream in flight", 40),
        stream_started(addr, "another stream in flight", 30),
    ];
    // Both booked on the one worker, as the gauges say.
    until_gauges_are(addr, &[(0, 2)]);
    let status = Command::new("kill")
        .args(["-TERM", &p.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // Each stream goes on to its end.
    for (mut stream, mut seen) in streams {
        let rest = until_closed(&mut stream);
        seen.extend_from_slice(rest.as_bytes());
        let text = String::from_utf8_lossy(&seen);
        assert!(text.contains("data: [DONE]"), "a stream was cut: {text}");
    }
    assert_eq!(p.wait_exit(), Some(0), "{}", p.log());
    assert!(p.log().contains("SIGTERM"), "{}", p.log());
}

/// utime + stime of process `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which is in parentheses): state is field 3; utime 14, stime 15.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

fn open_descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn at_descriptor_exhaustion_the_accept_loop_backs_off_and_recovers() {
    if !std::path::Path::new("/proc/self/stat").exists()
        || Command::new("prlimit").arg("--version").output().is_err()
    {
        eprintln!("skipped: needs Linux's /proc and prlimit");
        return;
    }
    const LIMIT: usize = 48;
    let limit = format!("--nofile={LIMIT}:{LIMIT}");
    let (p, addr, _) = serve_behind(
        &["prlimit", &limit],
        &[
            "--health-interval-ms",
            "0",
            "--header-read-timeout-ms",
            "600000",
            "--threads",
            "1",
        ],
    );
    let pid = p.pid();
    // Hold more connections than the process has descriptors: the rest wait in the backlog.
    let held: Vec<TcpStream> = (0..LIMIT + 16)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    eventually("descriptors exhausted", || open_descriptors(pid) >= LIMIT);
    // Over a window, the accept loop, failing, must not spin.
    let window = Duration::from_secs(2);
    let (t0, c0) = (Instant::now(), cpu_ticks(pid));
    std::thread::sleep(window);
    let (wall, cpu) = (t0.elapsed(), cpu_ticks(pid) - c0);
    let ticks_per_s = 100.0; // Linux's USER_HZ.
    let share = cpu as f64 / ticks_per_s / wall.as_secs_f64();
    eprintln!("CPU at descriptor exhaustion: {:.1} % of one core", share * 100.0);
    assert!(share < 0.25, "the accept loop spins: {:.0} % CPU", share * 100.0);
    // Descriptors free: it answers again.
    drop(held);
    let deadline = Instant::now() + PATIENCE;
    loop {
        assert!(Instant::now() < deadline, "never answered again:\n{}", p.log());
        if let Ok(mut s) = TcpStream::connect(addr) {
            let _ = s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.starts_with("HTTP/1.1 ") {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(p.log().contains("accept failed"), "{}", p.log());
    // Nothing was booked by the connections it could not take.
    until_gauges_are(addr, &[]);
}

#[test]
fn json_logs_name_the_request_in_each_of_its_lines() {
    // Nothing listens on port 1: the request's connect fails, which it logs (twice: it is
    // routed once more, to the same worker, out of routing by then).
    let (p, addr, _) = serve(&[
        "--log-format",
        "json",
        "--worker",
        "http://127.0.0.1:1",
        "--health-interval-ms",
        "0",
    ]);
    let a = http(
        addr,
        "POST",
        "/v1/completions",
        &[("x-request-id", "rid-42")],
        r#"{"prompt": "x"}"#,
    );
    assert_eq!(a.header("x-request-id"), Some("rid-42"));
    assert!(a.status >= 500, "{}", a.body);
    eventually("the request's log line", || p.log().contains("rid-42"));
    let log = p.log();
    let lines: Vec<Value> = log
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let unreachable: Vec<&Value> = lines
        .iter()
        .filter(|v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("unreachable"))
        })
        .collect();
    assert!(!unreachable.is_empty(), "{log}");
    for line in unreachable {
        assert_eq!(line["span"]["request_id"], "rid-42", "{line}");
    }
}

#[test]
fn a_stream_longer_than_the_drain_timeout_is_cut_and_the_process_still_exits() {
    // A very slow engine: the stream would take minutes.
    let (_mock, worker) = mock("0.01");
    let (mut p, addr, _) = serve(&["--worker", &worker, "--drain-timeout-ms", "200"]);
    let mut stream = TcpStream::connect(addr).unwrap();
    let body = r#"{"prompt": "a long stream", "max_tokens": 4000, "stream": true}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    stream.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200", "the stream started");
    let status = Command::new("kill")
        .args(["-TERM", &p.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(p.wait_exit(), Some(0), "{}", p.log());
    assert!(
        !until_closed(&mut stream).contains("[DONE]"),
        "cut at the drain timeout"
    );
    assert!(p.log().contains("drain timeout passed"), "{}", p.log());
}

#[test]
fn an_engine_that_hangs_up_gets_a_502_that_shows_no_internals() {
    // An engine that reads the request and closes the connection without an answer.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            // Until the blank line that ends the request head, then hang up.
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                line.clear();
            }
        }
    });
    let (_p, addr, _) = serve(&["--worker", &url, "--health-interval-ms", "0"]);
    let a = http(addr, "POST", "/v1/completions", &[], r#"{"prompt": "hello"}"#);
    assert_eq!(a.status, 502, "{}", a.body);
    assert_eq!(a.error_code(), "upstream_failed");
    let body = a.body.to_lowercase();
    for internal in [
        "hyper",
        "client error",
        "sendrequest",
        "connection closed",
        url.as_str(),
    ] {
        assert!(!body.contains(internal), "{internal} in {}", a.body);
    }
}

/// Each line of `text` as a JSON object; panics naming the first line that is not one.
#[track_caller]
fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| match serde_json::from_str::<Value>(l) {
            Ok(v) if v.is_object() => v,
            _ => panic!("not a JSON line: {l:?}\nin:\n{text}"),
        })
        .collect()
}

#[test]
fn under_json_logs_every_line_of_mock_and_serve_is_json_and_the_command_still_works() {
    let mock = Proc::start(
        &[],
        &[
            "mock",
            "--log-format",
            "json",
            "--workers",
            "1",
            "--port",
            "0",
            "--event-port",
            "0",
            "--speedup",
            "20",
        ],
        "route to them with",
    );
    // The command to copy is one field of one line: whole, as `kvroute serve ...`.
    let lines = json_lines(&mock.log());
    let command = lines
        .iter()
        .find_map(|v| v["fields"]["command"].as_str())
        .unwrap_or_else(|| panic!("no command in {lines:?}"))
        .to_owned();
    let worker = lines.iter().find_map(|v| v["fields"]["worker"].as_str()).unwrap();
    assert!(command.contains(worker), "{command} / {worker}");
    let words: Vec<&str> = command.split_whitespace().collect();
    assert_eq!(words[..2], ["kvroute", "serve"], "{command}");
    let mut args = words[1..].to_vec();
    args.extend([
        "--log-format",
        "json",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ]);
    let mut serve = Proc::start(&[], &args, "kvroute serve: listening on");
    let started = json_lines(&serve.log());
    let listening = started
        .iter()
        .find(|v| v["fields"]["url"].is_string())
        .unwrap_or_else(|| panic!("no url in {started:?}"));
    let addr: SocketAddr = listening["fields"]["url"]
        .as_str()
        .unwrap()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    assert!(listening["fields"]["admin_url"].is_string(), "{listening}");
    let a = http(
        addr,
        "POST",
        "/v1/completions",
        &[],
        r#"{"prompt": "hello", "max_tokens": 2}"#,
    );
    assert_eq!(a.status, 200, "{}", a.body);
    // The issue's "done when", from outside against the command mock printed: no admin API on
    // the inference port, OpenAI's 404 for an unknown model, a model's own route, a 400 in
    // OpenAI's shape for a field of the wrong type.
    let a = http(addr, "GET", "/admin/workers", &[], "");
    assert_eq!(
        (a.status, a.error_code().as_str()),
        (404, "not_found"),
        "{}",
        a.body
    );
    let a = http(
        addr,
        "POST",
        "/v1/completions",
        &[],
        r#"{"model": "nope", "prompt": "hi"}"#,
    );
    assert_eq!(
        (a.status, a.error_code().as_str()),
        (404, "model_not_found"),
        "{}",
        a.body
    );
    let a = http(addr, "GET", "/v1/models/tiny", &[], "");
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(serde_json::from_str::<Value>(&a.body).unwrap()["id"], "tiny");
    assert_eq!(http(addr, "GET", "/v1/models/nope", &[], "").status, 404);
    let a = http(
        addr,
        "POST",
        "/v1/completions",
        &[],
        r#"{"prompt": "hi", "temperature": "hot"}"#,
    );
    assert_eq!(a.status, 400, "{}", a.body);
    a.error_code();
    let status = Command::new("kill")
        .args(["-TERM", &serve.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert_eq!(serve.wait_exit(), Some(0), "{}", serve.log());
    // Start-up, requests, the drain and the exit: every line, on either stream, is JSON.
    let all = json_lines(&serve.output_after_exit());
    assert!(
        all.iter().any(|v| v["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("drained"))),
        "{all:?}"
    );
    json_lines(&format!("{}{}", mock.stdout.lock().unwrap(), mock.log()));
    // A refusal at start-up is a JSON line too.
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["serve", "--log-format", "json", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let refused = json_lines(&String::from_utf8_lossy(&out.stderr));
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["level"], "ERROR", "{refused:?}");
    assert!(out.stdout.is_empty());
}

#[test]
fn under_json_logs_every_line_of_demo_is_json_its_table_included() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(["demo", "--limit", "3", "--speedup", "50", "--log-format", "json"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(out.stdout.is_empty(), "the table is a log line too");
    let lines = json_lines(&stderr);
    let table = lines
        .iter()
        .find_map(|v| v["fields"]["table"].as_str())
        .unwrap_or_else(|| panic!("no table in {lines:?}"));
    assert!(table.contains("(live HTTP)"), "{table}");
}
