//! The `process` actuator: kvroute starts worker processes itself, from a command template
//! per pool, and ends them.
//!
//! **Starting.** [`ProcessActuator::provision`] picks free loopback ports, fills the pool's
//! command and worker line in, and starts the command (an argv array, no shell) in a process
//! group of its own, its stdout and stderr in `log_dir/worker-{index}.log` (or inherited). A
//! task of its own then supervises it: it polls the worker's `/v1/models` with a bounded
//! backoff until the model is listed, adds it to the fleet (`Fleet::add`, so the registration
//! checks run as for any worker), and waits for the fleet to report it routable. A worker that
//! is not routable within `ready_timeout_s` is killed and forgotten (logged and counted), so
//! the planner's next tick can replace it. It is [`super::actuator::Actuator::pending`] until
//! it is added; warm (its KV events reach the router: `Driver::has_kv_events`) once it has
//! cached something, which an idle engine never does, so that is not waited for.
//!
//! **Ports.** A free port is found by binding port 0 on loopback, reading the port and
//! closing it (`{events_port}` and `{replay_port}` = `{events_port}` + 1 both free, as
//! `kvroute mock --event-port` wants). Between that and the worker binding it, another process
//! may take it: the worker then fails to start, exits, is counted, and is replaced.
//!
//! **Ending.** [`ProcessActuator::release`] sends the worker's process group SIGTERM, waits
//! `stop_grace_s` for it to exit, then sends SIGKILL; the supervising task reaps it. A worker
//! that exits on its own while registered is noticed by its task, removed from the fleet
//! (`Fleet::remove`), logged with its exit status and counted in
//! `kvroute_planner_worker_exits_total{pool,cause}`. Signals are sent only by the task that
//! reaps the child, and only while it has not been reaped, so a pid is never signalled after
//! it may have been reused. When the actuator is dropped (the proxy stops), every worker still
//! running is sent SIGTERM.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvroute_core::ids::WorkerId;
use kvroute_planner::Pool;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

use super::actuator::{Actuator, ProcessConfig};
use crate::checks::{self, Worker};
use crate::config::{ServeConfig, WorkerConfig};
use crate::fleet::Fleet;

/// The template placeholders and their filling.
pub(crate) struct Placeholder;

/// The values of one worker's placeholders.
#[derive(Clone, Debug)]
pub(crate) struct Values {
    port: u16,
    events_port: u16,
    model: String,
    host: String,
    index: u64,
}

impl Placeholder {
    /// Every placeholder's name.
    const NAMES: [&'static str; 6] = ["port", "events_port", "replay_port", "model", "host", "index"];

    /// Values to check a template's form with.
    pub(crate) fn sample(host: &str) -> Values {
        Values {
            port: 8000,
            events_port: 5557,
            model: "model".to_owned(),
            host: host.to_owned(),
            index: 0,
        }
    }

    /// Whether every `{...}` of `text` is a placeholder; why not if one is not.
    pub(crate) fn check(text: &str) -> Result<(), String> {
        Self::expand(text, |_| Some(String::new())).map(|_| ())
    }

    /// `text` with its placeholders filled in from `values` (checked before).
    pub(crate) fn fill(text: &str, values: &Values) -> String {
        Self::expand(text, |name| {
            Some(match name {
                "port" => values.port.to_string(),
                "events_port" => values.events_port.to_string(),
                "replay_port" => (u32::from(values.events_port) + 1).to_string(),
                "model" => values.model.clone(),
                "host" => values.host.clone(),
                "index" => values.index.to_string(),
                _ => return None,
            })
        })
        .unwrap_or_else(|_| text.to_owned())
    }

    /// `text` with each `{name}` replaced by `value(name)`. A `{` starts a placeholder only
    /// when a name (letters, digits, `_`) follows it; any other `{` is kept as is, so a JSON
    /// argument (vLLM's `--kv-events-config '{"endpoint": "ipc:///run/ev-{index}.sock"}'`)
    /// needs no escaping and its placeholders are filled.
    fn expand(text: &str, value: impl Fn(&str) -> Option<String>) -> Result<String, String> {
        let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            let name_len = after.find(|c: char| !is_name(c)).unwrap_or(after.len());
            if name_len == 0 {
                // Not a placeholder: a literal brace.
                out.push('{');
                rest = after;
                continue;
            }
            let name = &after[..name_len];
            if !after[name_len..].starts_with('}') {
                return Err(format!("an unclosed '{{' before {name:?}"));
            }
            if !Self::NAMES.contains(&name) {
                return Err(format!("unknown placeholder {{{name}}}"));
            }
            out.push_str(&value(name).ok_or_else(|| format!("unknown placeholder {{{name}}}"))?);
            rest = &after[name_len + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }
}

/// Why a started worker process ended: the `cause` label of
/// `kvroute_planner_worker_exits_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitCause {
    /// Released, and it exited within its grace after SIGTERM.
    Released,
    /// Released, and it was killed (SIGKILL) when its grace ran out.
    Killed,
    /// It exited on its own.
    Exited,
    /// It did not become ready in time and was killed.
    NotReady,
    /// It could not be started at all.
    SpawnFailed,
    /// The proxy stopped.
    Shutdown,
}

impl ExitCause {
    /// Its label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Released => "released",
            Self::Killed => "killed",
            Self::Exited => "exited",
            Self::NotReady => "not_ready",
            Self::SpawnFailed => "spawn_failed",
            Self::Shutdown => "shutdown",
        }
    }
}

/// Where a started worker is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Started, not yet in the fleet (pending) or in it but not yet routable.
    Starting,
    /// In the fleet, routable when it was added.
    Running,
    /// Not ready in time: being killed.
    NotReady,
    /// Released: SIGTERM sent, SIGKILL after the grace.
    Releasing,
    /// Released and killed when its grace ran out.
    Killed,
    /// The proxy is stopping.
    Shutdown,
}

/// A started worker process.
#[derive(Debug)]
struct Proc {
    pool: Pool,
    pid: Option<u32>,
    url: String,
    phase: Phase,
    /// Its fleet id, once it is added.
    worker: Option<WorkerId>,
    /// Signals for its supervising task to send (the one that reaps it).
    signals: mpsc::UnboundedSender<Signal>,
    /// True once it has exited and been reaped.
    exited: watch::Receiver<bool>,
}

#[derive(Debug, Default)]
struct State {
    next_index: u64,
    procs: BTreeMap<u64, Proc>,
}

#[derive(Debug)]
struct Inner {
    config: ProcessConfig,
    fleet: Arc<Fleet>,
    state: Mutex<State>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count_exit(&self, pool: Pool, cause: ExitCause) {
        self.fleet
            .driver()
            .metrics
            .planner_worker_exits
            .with_label_values(&[pool.name(), cause.label()])
            .inc();
    }

    fn set_phase(&self, index: u64, phase: Phase) {
        if let Some(p) = self.state().procs.get_mut(&index) {
            p.phase = phase;
        }
    }

    /// Moves worker `index` from starting to `phase`; false if it is no longer starting
    /// (released, or the proxy stops), when it is left as it is.
    fn leave_starting(&self, index: u64, phase: Phase) -> bool {
        match self.state().procs.get_mut(&index) {
            Some(p) if p.phase == Phase::Starting => {
                p.phase = phase;
                true
            }
            _ => false,
        }
    }
}

/// A worker process the actuator started and has not reaped ([`ProcessActuator::running`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    /// Its pool.
    pub pool: Pool,
    /// Its process id (also its process group's).
    pub pid: Option<u32>,
    /// Its fleet id, once it is added.
    pub worker: Option<WorkerId>,
    /// Its base URL, from its worker line.
    pub url: String,
}

/// See the module docs.
#[derive(Debug)]
pub struct ProcessActuator {
    inner: Arc<Inner>,
}

/// A port free on loopback now (see the module docs for the race).
fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?
        .local_addr()?
        .port())
}

/// A port `p` free on loopback now with `p + 1` free too.
fn free_port_pair() -> std::io::Result<u16> {
    for _ in 0..64 {
        let first = std::net::TcpListener::bind(("127.0.0.1", 0))?;
        let p = first.local_addr()?.port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return Ok(p);
        }
    }
    Err(std::io::Error::other(
        "no two adjacent free ports found on loopback",
    ))
}

/// The standard output and error of worker `index`: a log file in `dir` (appended to), or
/// kvroute's own.
fn log_target(dir: Option<&Path>, index: u64) -> std::io::Result<(Stdio, Stdio)> {
    let Some(dir) = dir else {
        return Ok((Stdio::inherit(), Stdio::inherit()));
    };
    std::fs::create_dir_all(dir)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("worker-{index}.log")))?;
    Ok((file.try_clone()?.into(), file.into()))
}

impl ProcessActuator {
    /// Starting workers as `config` says, into `fleet`.
    pub fn new(config: ProcessConfig, fleet: Arc<Fleet>) -> Self {
        Self {
            inner: Arc::new(Inner {
                config,
                fleet,
                state: Mutex::default(),
            }),
        }
    }

    /// Every started worker process not yet reaped, in start order.
    pub fn running(&self) -> Vec<Started> {
        self.inner
            .state()
            .procs
            .values()
            .map(|p| Started {
                pool: p.pool,
                pid: p.pid,
                worker: p.worker,
                url: p.url.clone(),
            })
            .collect()
    }

    /// Starts one worker of `pool`; false (logged and counted) if it could not be started.
    fn start(&self, pool: Pool) -> bool {
        let inner = &self.inner;
        let Some(template) = inner.config.template(pool) else {
            tracing::warn!(
                pool = pool.name(),
                "the planner wants a worker of a pool with no command in [actuator]; none started"
            );
            return false;
        };
        let index = {
            let mut state = inner.state();
            state.next_index += 1;
            state.next_index - 1
        };
        let fail = |what: &str, error: &dyn std::fmt::Display| {
            tracing::error!(pool = pool.name(), index, error = %error, "{what}; no worker started");
            inner.count_exit(pool, ExitCause::SpawnFailed);
            false
        };
        let ports = free_port().and_then(|port| Ok((port, free_port_pair()?)));
        let (port, events_port) = match ports {
            Ok(ports) => ports,
            Err(e) => return fail("no free port", &e),
        };
        let values = Values {
            port,
            events_port,
            model: inner.fleet.driver().config.model.model_name.clone(),
            host: inner.config.host.clone(),
            index,
        };
        let argv: Vec<String> = template
            .command
            .iter()
            .map(|a| Placeholder::fill(a, &values))
            .collect();
        let line = Placeholder::fill(&template.worker, &values);
        let worker = match WorkerConfig::parse_flag(&line) {
            Ok(w) => w,
            Err(e) => return fail("the worker line is no worker", &e),
        };
        let (stdout, stderr) = match log_target(inner.config.log_dir.as_deref(), index) {
            Ok(target) => target,
            Err(e) => return fail("the worker's log file could not be opened", &e),
        };
        let Some((program, args)) = argv.split_first() else {
            return fail("the command is empty", &"");
        };
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            // A group of its own: signals reach whatever it starts, and a Ctrl-C at kvroute's
            // terminal reaches it only through kvroute.
            .process_group(0)
            .spawn();
        let child = match child {
            Ok(c) => c,
            Err(e) => return fail(&format!("{program:?} could not be started"), &e),
        };
        let pid = child.id();
        tracing::info!(
            pool = pool.name(),
            index,
            pid,
            worker = line,
            "worker process started"
        );
        let (signals, signals_rx) = mpsc::unbounded_channel();
        let (exited_tx, exited) = watch::channel(false);
        inner.state().procs.insert(
            index,
            Proc {
                pool,
                pid,
                url: worker.url.trim_end_matches('/').to_owned(),
                phase: Phase::Starting,
                worker: None,
                signals,
                exited,
            },
        );
        tokio::spawn(supervise(
            Arc::clone(inner),
            Supervised {
                index,
                pool,
                child,
                worker,
                signals: signals_rx,
                exited: exited_tx,
            },
        ));
        true
    }
}

/// What a supervising task owns of its worker.
struct Supervised {
    index: u64,
    pool: Pool,
    child: Child,
    worker: WorkerConfig,
    signals: mpsc::UnboundedReceiver<Signal>,
    exited: watch::Sender<bool>,
}

/// Sends `signal` to `child`'s process group if it has not been reaped (see the module docs).
fn signal(child: &mut Child, signal: Signal) {
    if let (Ok(None), Some(pid)) = (child.try_wait(), child.id()) {
        let Ok(pid) = i32::try_from(pid) else { return };
        if let Err(e) = killpg(Pid::from_raw(pid), signal) {
            tracing::debug!(pid, ?signal, error = %e, "signalling a worker failed");
        }
    }
}

/// A started worker's task: makes it ready (or kills it), sends it the signals asked for, and
/// when it exits, reaps it, takes it out of the fleet and counts it.
async fn supervise(inner: Arc<Inner>, mut s: Supervised) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(inner.config.ready_timeout_s);
    let readiness = become_ready(&inner, s.index, s.worker.clone(), deadline);
    tokio::pin!(readiness);
    let mut readying = true;
    let status = loop {
        tokio::select! {
            status = s.child.wait() => break status,
            Some(sig) = s.signals.recv() => signal(&mut s.child, sig),
            ready = &mut readiness, if readying => {
                readying = false;
                match ready {
                    Ok(id) => {
                        inner.leave_starting(s.index, Phase::Running);
                        tracing::info!(pool = s.pool.name(), index = s.index, worker = id.0, "worker ready");
                    }
                    Err(why) if inner.leave_starting(s.index, Phase::NotReady) => {
                        tracing::warn!(
                            pool = s.pool.name(),
                            index = s.index,
                            url = s.worker.url,
                            timeout_s = inner.config.ready_timeout_s,
                            "worker not ready in time ({why}); killed"
                        );
                        signal(&mut s.child, Signal::SIGKILL);
                    }
                    // Released or stopping meanwhile: that path ends it.
                    Err(_) => {}
                }
            }
        }
    };
    // `readiness` may hold nothing past here: it is not polled again.
    let _ = s.exited.send(true);
    // Counted, then out of the fleet, then forgotten: whoever sees it gone sees it counted.
    let Some((phase, worker, url)) = inner
        .state()
        .procs
        .get(&s.index)
        .map(|p| (p.phase, p.worker, p.url.clone()))
    else {
        return;
    };
    let cause = match phase {
        Phase::Starting | Phase::Running => ExitCause::Exited,
        Phase::NotReady => ExitCause::NotReady,
        Phase::Releasing => ExitCause::Released,
        Phase::Killed => ExitCause::Killed,
        Phase::Shutdown => ExitCause::Shutdown,
    };
    inner.count_exit(s.pool, cause);
    let status = status.map_or_else(|e| format!("unknown ({e})"), |st: ExitStatus| st.to_string());
    if let Some(id) = worker
        && inner.fleet.remove(id)
        && cause == ExitCause::Exited
    {
        tracing::warn!(
            pool = s.pool.name(),
            worker = id.0,
            url,
            %status,
            "worker process exited on its own; removed from the fleet"
        );
    } else {
        tracing::info!(
            pool = s.pool.name(),
            index = s.index,
            url,
            cause = cause.label(),
            %status,
            "worker process ended"
        );
    }
    inner.state().procs.remove(&s.index);
}

/// Waits until the worker lists the served model, adds it to the fleet, and waits until the
/// fleet reports it routable, all by `deadline`; its fleet id, or why not.
async fn become_ready(
    inner: &Inner,
    index: u64,
    worker: WorkerConfig,
    deadline: tokio::time::Instant,
) -> Result<WorkerId, String> {
    let driver = inner.fleet.driver();
    let model = &driver.config.model.model_name;
    let timeout = ServeConfig::ms(driver.config.upstream.health_timeout_ms);
    let client = &inner.fleet.checker().client;
    let base = worker.url.trim_end_matches('/').to_owned();
    let mut backoff = Duration::from_millis(50);
    let mut last = "it never answered /v1/models".to_owned();
    loop {
        let asked = Worker {
            base: &base,
            api_key: worker.api_key.as_deref(),
        };
        match checks::served_model(client, asked, model, timeout).await {
            Some(Ok(())) => break,
            Some(Err(reason)) => last = reason,
            None => {}
        }
        if tokio::time::Instant::now() + backoff >= deadline {
            return Err(last);
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    let id = {
        // Its fleet id is known as soon as it is in the fleet: never both pending and there.
        let mut state = inner.state();
        let id = inner
            .fleet
            .add(worker)
            .map_err(|e| format!("the fleet refused it: {e}"))?;
        if let Some(p) = state.procs.get_mut(&index) {
            p.worker = Some(id);
        }
        id
    };
    let patience = deadline.saturating_duration_since(tokio::time::Instant::now());
    let routable = driver
        .wait_until(patience, |d| d.worker_state(id).is_some_and(|s| s.routable()))
        .await;
    if routable {
        Ok(id)
    } else {
        let problems = driver
            .worker_statuses()
            .into_iter()
            .find(|w| w.id == id.0)
            .map(|w| format!("{:?} {:?}", w.state, w.misconfigured))
            .unwrap_or_default();
        Err(format!("it never became routable: {problems}"))
    }
}

impl Actuator for ProcessActuator {
    fn set_desired(&self, pool: Pool, n: u32) {
        self.inner
            .fleet
            .driver()
            .metrics
            .planner_desired_workers
            .with_label_values(&[pool.name()])
            .set(i64::from(n));
    }

    fn provision(&self, pool: Pool) {
        self.start(pool);
    }

    fn release(&self, id: WorkerId, url: &str) {
        let grace = Duration::from_secs(self.inner.config.stop_grace_s);
        let found = {
            let mut state = self.inner.state();
            let base = url.trim_end_matches('/');
            state
                .procs
                .iter_mut()
                .find(|(_, p)| p.worker == Some(id) || p.url == base)
                .map(|(&index, p)| {
                    p.phase = Phase::Releasing;
                    (index, p.signals.clone(), p.exited.clone())
                })
        };
        let Some((index, signals, mut exited)) = found else {
            tracing::info!(
                worker = id.0,
                url,
                "released worker is not one this actuator started"
            );
            return;
        };
        let inner = Arc::clone(&self.inner);
        tracing::info!(worker = id.0, url, "stopping the worker process (SIGTERM)");
        let _ = signals.send(Signal::SIGTERM);
        tokio::spawn(async move {
            let exited_in_grace = tokio::time::timeout(grace, exited.wait_for(|&e| e)).await;
            if exited_in_grace.is_err() {
                tracing::warn!(
                    worker = id.0,
                    grace_s = grace.as_secs(),
                    "worker process still running after its grace; SIGKILL"
                );
                inner.set_phase(index, Phase::Killed);
                let _ = signals.send(Signal::SIGKILL);
            }
        });
    }

    fn pending(&self) -> Vec<Pool> {
        self.inner
            .state()
            .procs
            .values()
            .filter(|p| p.worker.is_none() && p.phase == Phase::Starting)
            .map(|p| p.pool)
            .collect()
    }
}

impl Drop for ProcessActuator {
    /// SIGTERM to every worker still running (the proxy stops). Sent from here, not by the
    /// supervising tasks, which may no longer run; a worker that exited and was reaped is
    /// skipped.
    fn drop(&mut self) {
        let mut state = self.inner.state();
        for p in state.procs.values_mut() {
            p.phase = Phase::Shutdown;
            if *p.exited.borrow() {
                continue;
            }
            if let Some(pid) = p.pid.and_then(|pid| i32::try_from(pid).ok()) {
                let _ = killpg(Pid::from_raw(pid), Signal::SIGTERM);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_fill_and_unknown_ones_are_refused() {
        let v = Values {
            port: 9000,
            events_port: 6000,
            model: "m".to_owned(),
            host: "127.0.0.1".to_owned(),
            index: 3,
        };
        // (template, filled)
        let cases = [
            ("--port={port}", "--port=9000"),
            ("{host}:{events_port}/{replay_port}", "127.0.0.1:6000/6001"),
            ("{model}-{index}", "m-3"),
            ("no placeholder }", "no placeholder }"),
            // Braces not followed by a name are kept: JSON arguments need no escaping.
            ("{}", "{}"),
            ("{ {{port}} }", "{ {9000} }"),
            (
                r#"{"endpoint":"ipc:///run/ev-{index}.sock","replay_endpoint":"tcp://{host}:{replay_port}","topic":"kv-events"}"#,
                r#"{"endpoint":"ipc:///run/ev-3.sock","replay_endpoint":"tcp://127.0.0.1:6001","topic":"kv-events"}"#,
            ),
        ];
        for (text, want) in cases {
            assert_eq!(Placeholder::check(text), Ok(()), "{text}");
            assert_eq!(Placeholder::fill(text, &v), want, "{text}");
        }
        assert!(Placeholder::check("{nope}").unwrap_err().contains("{nope}"));
        assert!(Placeholder::check("{port").unwrap_err().contains("unclosed"));
        assert!(Placeholder::check("{port x}").unwrap_err().contains("unclosed"));
        assert!(
            Placeholder::check(r#"{"a": {nope}}"#)
                .unwrap_err()
                .contains("{nope}")
        );
    }

    #[test]
    fn adjacent_free_ports() {
        let p = free_port_pair().unwrap();
        assert!(p < u16::MAX);
        assert_ne!(free_port().unwrap(), 0);
    }
}
