//! `kvroute bench sync --live`: the CPU replica sync costs a request over a real `nats-server`,
//! sync on and off in the same run, interleaved, on the same requests.
//!
//! Three replicas (each a [`Router`] behind a lock, as the proxy's driver keeps it, and with sync
//! on a [`SyncTransport`] over the local `nats-server`) share four workers. The requests are the
//! example trace's first `--requests` rows, sent in turn to the replicas at their arrival times
//! over `--speedup` (the demo's rate at 10). Each request books at its arrival, finishes prefill
//! at its first token and is freed at its end, times from the simulator's run of the same rows
//! (the demo's simulated column), so each replica exports booked, prefill done and freed in the
//! order and at the spacing the live demo sees, through the same path as `serve`: the router's
//! exported changes ([`SyncItem::from_sync`], workers named by URL) into [`Outgoing::push`], the
//! transport's batching, encoding and publishing, and at each peer the decoding and
//! `Router::handle_sync_event` under the replica's lock. Left out: HTTP, the engines, and the
//! proxy driver's dispatch after an apply (work both modes do alike in `serve`).
//!
//! A round runs the requests twice, synced and unsynced (fresh routers each time; the order
//! alternates between rounds), and takes the process's CPU (user + system, `/proc/self/stat`)
//! and the `nats-server` child's (`/proc/<pid>/stat`) over each pass: from the first request's
//! arrival to the moment every change has had time to reach the peers (the lazy window and 300 ms
//! after the last end). Transports are started (joined) before and stopped after the measured
//! span. Sync's CPU a request is (synced - unsynced) / requests within a round; the server's is
//! reported beside it and not folded in. After a synced pass every replica's books must empty
//! (its peers' bookings all freed) within 10 s, else the bench fails.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use kvroute_core::ids::{RequestId, WorkerId};
use kvroute_core::router::{
    Prompt, RouteOutcome, RouteRequest, Router, RouterConfig, RouterId, SyncConfig, SyncMode,
};
use kvroute_core::time::{TimeScale, Timestamp};
use kvroute_sync::{NatsSyncConfig, Outgoing, SyncHost, SyncItem, SyncMetrics, SyncTransport};
use serde::Serialize;

use super::sync::{WORKERS, fleet_router};

/// Replicas sharing the workers.
const REPLICAS: usize = 3;
/// Clock ticks a second of `/proc/*/stat` (Linux's `USER_HZ`).
const TICKS_PER_SECOND: f64 = 100.0;

/// The settings of one live run.
#[derive(Clone, Debug)]
pub struct LiveConfig {
    /// Requests a pass (the example trace's first rows).
    pub requests: usize,
    /// Rounds (each a synced and an unsynced pass).
    pub rounds: usize,
    /// Speed-up of the trace's times.
    pub speedup: f64,
    /// The lazy window (`serve --nats-lazy-ms`).
    pub lazy: Duration,
}

/// One pass's figures.
#[derive(Clone, Debug, Serialize)]
pub struct PassReport {
    /// Always `sync_live`.
    pub bench: &'static str,
    /// The round, from 1.
    pub round: usize,
    /// Whether the replicas synced.
    pub synced: bool,
    /// Requests routed.
    pub requests: usize,
    /// The process's CPU over the pass, ms.
    pub cpu_ms: f64,
    /// The `nats-server`'s CPU over the pass, ms.
    pub nats_cpu_ms: f64,
    /// The pass's wall time, ms.
    pub wall_ms: f64,
    /// Sync messages the replicas sent (every kind).
    pub messages: u64,
    /// Changes they sent.
    pub events: u64,
    /// Bytes they sent.
    pub bytes: u64,
}

/// The run's figures: each round's sync CPU a request, and their median and range.
#[derive(Clone, Debug, Serialize)]
pub struct LiveSummary {
    /// Always `sync_live_summary`.
    pub bench: &'static str,
    /// Requests a pass.
    pub requests: usize,
    /// The process's CPU sync added a request in each round, ms ((synced - unsynced) / requests).
    pub sync_cpu_ms_per_request: Vec<f64>,
    /// Their median.
    pub median_ms: f64,
    /// Their least.
    pub min_ms: f64,
    /// Their most.
    pub max_ms: f64,
    /// The `nats-server`'s CPU a request in each synced pass, ms (not in the figures above).
    pub nats_cpu_ms_per_request: Vec<f64>,
    /// Sync messages a request in each synced pass.
    pub messages_per_request: Vec<f64>,
}

/// A request as the bench replays it: its prompt and when its three changes happen, from the
/// first arrival.
struct Planned {
    tokens: Vec<u32>,
    arrival: Duration,
    first_token: Duration,
    end: Duration,
}

/// The example trace's first `n` rows with the simulator's first-token and end times, over
/// `speedup`.
fn plan(n: usize, speedup: f64) -> anyhow::Result<Vec<Planned>> {
    let trace = || std::io::BufReader::new(flate2::read::GzDecoder::new(kvroute_sim::EXAMPLE_MOONCAKE_GZ));
    let mut sim = kvroute_sim::SimConfig::new(WORKERS);
    sim.sample_interval = None;
    sim.keep_requests = true;
    let workload = kvroute_sim::trace::read_mooncake(trace(), 512, sim.engine.block_size, Some(n))?;
    let requests = kvroute_sim::trace::read_mooncake_tokens(trace(), 512, Some(n))?;
    let run = kvroute_sim::Simulation::new(sim)?.run(&workload, &mut |_| {})?;
    let mut times = vec![None; requests.len()];
    for r in &run.requests {
        if let (Some(ttft), Some(e2e)) = (r.ttft_ms, r.e2e_latency_ms)
            && let Some(t) = times.get_mut(r.id as usize)
        {
            *t = Some((r.arrival_ms, ttft, e2e));
        }
    }
    let at = |ms: f64| Duration::from_secs_f64(ms.max(0.0) / 1e3 / speedup);
    Ok(requests
        .into_iter()
        .zip(times)
        .filter_map(|(r, t)| {
            let (arrival, ttft, e2e) = t?;
            Some(Planned {
                tokens: r.tokens,
                arrival: at(arrival),
                first_token: at(arrival + ttft),
                end: at(arrival + e2e.max(ttft)),
            })
        })
        .collect())
}

fn url(w: usize) -> String {
    format!("http://127.0.0.1:{}", 8001 + w)
}

/// One replica: its router and worker names behind a lock, and where its changes go.
struct Replica {
    state: Mutex<State>,
    epoch: Instant,
}

struct State {
    router: Router,
    urls: Vec<String>,
    out: Option<Outgoing>,
}

impl Replica {
    fn new(id: RouterId, mode: SyncMode, epoch: Instant) -> anyhow::Result<Self> {
        let router = fleet_router(RouterConfig {
            router_id: id,
            sync: SyncConfig {
                mode,
                ..SyncConfig::default()
            },
            ..RouterConfig::default()
        })?;
        Ok(Self {
            state: Mutex::new(State {
                router,
                urls: (0..WORKERS).map(url).collect(),
                out: None,
            }),
            epoch,
        })
    }

    fn now(&self) -> Timestamp {
        TimeScale::REAL.timestamp(self.epoch.elapsed())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on the router, then hands its exported changes to the transport, as the proxy's
    /// driver does when it releases its lock.
    fn with_router<T>(&self, f: impl FnOnce(&mut Router, Timestamp) -> T) -> T {
        let now = self.now();
        let mut state = self.lock();
        let value = f(&mut state.router, now);
        let State { router, urls, out } = &mut *state;
        while let Some(event) = router.poll_sync_event() {
            if let Some(out) = out
                && let Some(wire) = SyncItem::from_sync(&event, |w| urls.get(w.0 as usize).cloned())
            {
                out.push(wire, event.change.urgency());
            }
        }
        value
    }
}

impl SyncHost for Replica {
    fn apply(&self, from: RouterId, events: &[SyncItem]) {
        let now = self.now();
        let mut state = self.lock();
        let State { router, urls, .. } = &mut *state;
        for wire in events {
            let find = |u: &str| urls.iter().position(|x| x == u).map(|w| WorkerId(w as u64));
            if let Some(event) = wire.to_sync(from, find) {
                let _ = router.handle_sync_event(now, &event);
            }
        }
    }

    fn peer_lost(&self, peer: RouterId) {
        let now = self.now();
        self.lock().router.handle_peer_lost(now, peer);
    }

    fn snapshot(&self) -> Vec<SyncItem> {
        let state = self.lock();
        state
            .router
            .sync_snapshot()
            .iter()
            .filter_map(|e| SyncItem::from_sync(e, |w| state.urls.get(w.0 as usize).cloned()))
            .collect()
    }
}

/// CPU time of process `pid` (`self` for this one), user + system, from `/proc/<pid>/stat`.
fn cpu(pid: &str) -> anyhow::Result<Duration> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    // Fields after the command (in parentheses, which may hold spaces): state is field 3,
    // utime 14, stime 15.
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .with_context(|| format!("{path}: no command field"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> anyhow::Result<u64> {
        fields
            .get(i)
            .with_context(|| format!("{path}: field {} missing", i + 3))?
            .parse::<u64>()
            .with_context(|| format!("{path}: field {} is not a number", i + 3))
    };
    let total = ticks(11)? + ticks(12)?;
    Ok(Duration::from_secs_f64(total as f64 / TICKS_PER_SECOND))
}

/// One pass: the requests through three fresh replicas, synced over `nats` or not.
async fn pass(
    config: &LiveConfig,
    requests: &Arc<Vec<Planned>>,
    nats: Option<(&str, &str)>,
    round: usize,
) -> anyhow::Result<PassReport> {
    let epoch = Instant::now();
    let mode = if nats.is_some() {
        SyncMode::Export
    } else {
        SyncMode::Off
    };
    let ids: Vec<RouterId> = (0..REPLICAS).map(|_| kvroute_sync::fresh_router_id()).collect();
    let replicas: Vec<Arc<Replica>> = ids
        .iter()
        .map(|&id| Replica::new(id, mode, epoch).map(Arc::new))
        .collect::<anyhow::Result<_>>()?;
    let mut transports = Vec::new();
    if let Some((url, _)) = nats {
        // One prefix a pass: an earlier pass's replicas are not heard.
        let prefix = format!("kvroute.bench{round}");
        let mut sync = NatsSyncConfig::new(url, &prefix);
        sync.batch_lazy_delay = config.lazy;
        for (replica, &id) in replicas.iter().zip(&ids) {
            let metrics = SyncMetrics::new(&prometheus::Registry::new())?;
            let host: Arc<dyn SyncHost> = replica.clone();
            let transport = SyncTransport::start(id, sync.clone(), host, metrics.clone())
                .await
                .context("starting a replica's sync")?;
            replica.lock().out = Some(transport.outgoing().clone());
            transports.push((transport, metrics));
        }
    }
    let nats_pid = nats.map(|(_, pid)| pid);
    let (cpu0, nats0) = (cpu("self")?, nats_pid.map(cpu).transpose()?);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for i in 0..requests.len() {
        let replica = Arc::clone(&replicas[i % REPLICAS]);
        let requests = Arc::clone(requests);
        tasks.push(tokio::spawn(async move {
            let r = &requests[i];
            let id = RequestId(i as u64);
            tokio::time::sleep_until(start + r.arrival).await;
            let routed = replica.with_router(|router, now| {
                let request = RouteRequest::new(id, Prompt::Tokens(&r.tokens));
                matches!(router.handle_request(now, &request), Ok(RouteOutcome::Routed(_)))
            });
            if !routed {
                return false;
            }
            tokio::time::sleep_until(start + r.first_token).await;
            replica.with_router(|router, now| router.handle_first_token(now, id).is_ok());
            tokio::time::sleep_until(start + r.end).await;
            replica.with_router(|router, now| router.handle_finished(now, id).is_ok());
            true
        }));
    }
    let mut routed = 0;
    for t in tasks {
        routed += usize::from(t.await.context("a request task failed")?);
    }
    tokio::time::sleep(config.lazy + Duration::from_millis(300)).await;
    let (cpu1, nats1) = (cpu("self")?, nats_pid.map(cpu).transpose()?);
    let wall = start.elapsed();
    anyhow::ensure!(
        routed == requests.len(),
        "{} of {} requests were not routed at once",
        requests.len() - routed,
        requests.len()
    );
    if nats.is_some() {
        // Every peer's booking freed (within a bound, for a slow machine; after the measurement).
        let booked = || -> usize {
            replicas
                .iter()
                .map(|r| r.lock().router.metrics().active_now)
                .sum()
        };
        let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
        while booked() > 0 && tokio::time::Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let active = booked();
        anyhow::ensure!(
            active == 0,
            "the replicas still book {active} requests 10 s after the pass: sync lost changes"
        );
    }
    let (mut messages, mut events, mut bytes) = (0, 0, 0);
    for (_, m) in &transports {
        messages += ["events", "heartbeat", "snapshot", "join"]
            .iter()
            .map(|kind| m.messages_sent.with_label_values(&[*kind]).get())
            .sum::<u64>();
        events += m.events_sent.get();
        bytes += m.bytes_sent.get();
    }
    drop(transports);
    Ok(PassReport {
        bench: "sync_live",
        round,
        synced: nats.is_some(),
        requests: routed,
        cpu_ms: (cpu1 - cpu0).as_secs_f64() * 1e3,
        nats_cpu_ms: match (nats0, nats1) {
            (Some(a), Some(b)) => (b - a).as_secs_f64() * 1e3,
            _ => 0.0,
        },
        wall_ms: wall.as_secs_f64() * 1e3,
        messages,
        events,
        bytes,
    })
}

/// Runs `config.rounds` rounds, printing each pass's report as it ends; returns the summary.
pub fn run(config: &LiveConfig, print: &mut dyn FnMut(&PassReport)) -> anyhow::Result<LiveSummary> {
    let requests = Arc::new(plan(config.requests, config.speedup)?);
    anyhow::ensure!(
        !requests.is_empty(),
        "no request of the trace completed in the simulator"
    );
    let server = kvroute_sync::server::NatsServer::start().context("starting nats-server")?;
    let pid = server
        .pid()
        .context("the nats-server child has no process id")?
        .to_string();
    let url = server.url();
    let runtime = crate::serve::runtime(0)?;
    let (mut deltas, mut nats, mut messages) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=config.rounds.max(1) {
        // Alternate which pass goes first, so that neither always follows the other.
        let order = if round % 2 == 1 {
            [true, false]
        } else {
            [false, true]
        };
        let mut on = None;
        let mut off = None;
        for synced in order {
            let nats = synced.then_some((url.as_str(), pid.as_str()));
            let report = runtime.block_on(pass(config, &requests, nats, round))?;
            print(&report);
            if synced {
                on = Some(report);
            } else {
                off = Some(report);
            }
        }
        let (Some(on), Some(off)) = (on, off) else {
            anyhow::bail!("round {round} missed a pass");
        };
        let n = on.requests.max(1) as f64;
        deltas.push((on.cpu_ms - off.cpu_ms) / n);
        nats.push(on.nats_cpu_ms / n);
        messages.push(on.messages as f64 / n);
    }
    let mut sorted = deltas.clone();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.len() % 2 == 1 {
        sorted[sorted.len() / 2]
    } else {
        (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
    };
    Ok(LiveSummary {
        bench: "sync_live_summary",
        requests: requests.len(),
        median_ms: median,
        min_ms: sorted[0],
        max_ms: sorted[sorted.len() - 1],
        sync_cpu_ms_per_request: deltas,
        nats_cpu_ms_per_request: nats,
        messages_per_request: messages,
    })
}
