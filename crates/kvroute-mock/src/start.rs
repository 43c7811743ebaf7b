//! Starting mock workers: each rank's engine task, the HTTP server, the event publishers.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::routing::{get, post};
use kvroute_core::router::WorkerRole;
use kvroute_engine::{Engine, EngineConfig, EngineHost};
use kvroute_http::model::Model;
use kvroute_http::net::{self, Shutdown};
use kvroute_zmq::{EventPublisher, PublisherConfig, rank_endpoint};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::config::{MockConfig, MockError};
use crate::driver::{Outbox, drive};
use crate::handlers::{MockWorkerState, Rank, chat, completions, models, tokenize};
use crate::metrics::{Stats, metrics};
use crate::rooms::Rooms;

/// One running mock worker.
pub struct MockWorker {
    /// Its HTTP address.
    pub addr: SocketAddr,
    /// Its KV-event PUB endpoint, if it publishes.
    pub events_endpoint: Option<String>,
    /// Its replay endpoint.
    pub replay_endpoint: Option<String>,
    /// The role the proxy is to route to it under.
    pub role: WorkerRole,
    /// Its data-parallel ranks.
    pub dp_size: u32,
    state: Arc<MockWorkerState>,
    publishers: Vec<Arc<EventPublisher>>,
    shutdown: Shutdown,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for MockWorker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockWorker")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl MockWorker {
    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// This worker as a router's `--worker` flag names it: its URL, event endpoints, role and
    /// data-parallel ranks. The proxy and the mock meet only through such wire formats.
    pub fn worker_flag(&self) -> String {
        let mut flag = self.url();
        if let (Some(events), Some(replay)) = (&self.events_endpoint, &self.replay_endpoint) {
            flag.push_str(&format!(",events={events},replay={replay}"));
        }
        if self.dp_size > 1 {
            flag.push_str(&format!(",dp={}", self.dp_size));
        }
        if self.role != WorkerRole::Aggregated {
            flag.push_str(&format!(",role={}", self.role.name()));
        }
        flag
    }

    /// The requests of the disaggregated flow it received, oldest first (the last
    /// [`SEEN_KEPT`]): their `X-Request-Id`, which side of the flow they were, and their bodies.
    pub fn seen_kv_requests(&self) -> Vec<SeenKvRequest> {
        self.state
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }

    /// Fault injection: the next `n` event batches of every rank are buffered for replay but
    /// not sent live.
    pub fn drop_next_event_batches(&self, n: u64) {
        for p in &self.publishers {
            p.drop_next(n);
        }
    }

    /// Kills the worker at once: its listener and connections close (streams in flight break
    /// off), its engine and publisher stop.
    pub fn kill(&self) {
        self.shutdown.stop();
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Drop for MockWorker {
    fn drop(&mut self) {
        self.kill();
    }
}

/// How many [`SeenKvRequest`]s a worker keeps.
pub const SEEN_KEPT: usize = 64;

/// A request of the disaggregated flow as a mock worker received it.
#[derive(Clone, Debug, PartialEq)]
pub struct SeenKvRequest {
    /// Its `X-Request-Id` header.
    pub request_id: Option<String>,
    /// True on the prefill side (vLLM's hop 1, `do_remote_decode`, or an SGLang body on a
    /// prefill worker), false on the decode side (hop 2, or an SGLang body elsewhere).
    pub remote_decode: bool,
    /// Its body, without the prompt (`prompt`, `messages`).
    pub body: Value,
}

/// Starts the mock workers: `config.prefill_workers` prefill workers, then `config.workers`
/// others.
pub async fn start(config: &MockConfig, model: Arc<Model>) -> Result<Vec<MockWorker>, MockError> {
    let mut workers = Vec::with_capacity(config.total());
    let rooms = Arc::new(Rooms::default());
    for i in 0..config.total() {
        workers.push(start_one(config, i, Arc::clone(&model), Arc::clone(&rooms)).await?);
    }
    Ok(workers)
}

fn port(base: u16, offset: usize) -> u16 {
    if base == 0 {
        0
    } else {
        base.saturating_add(u16::try_from(offset).unwrap_or(u16::MAX))
    }
}

async fn start_one(
    config: &MockConfig,
    i: usize,
    model: Arc<Model>,
    rooms: Arc<Rooms>,
) -> Result<MockWorker, MockError> {
    let addr = SocketAddr::new(config.host, port(config.port, i));
    let (listener, addr) = net::bind(addr)
        .await
        .map_err(|source| MockError::Bind { addr, source })?;
    let dp = config.dp_size.max(1);
    let publishers = if config.events {
        start_publishers(config, i, dp).await?
    } else {
        Vec::new()
    };
    let mut ranks = Vec::with_capacity(dp as usize);
    let mut tasks = Vec::with_capacity(dp as usize + 1);
    for r in 0..dp {
        let engine = Engine::new(EngineConfig {
            external_hash_seed: config
                .engine
                .external_hash_seed
                .wrapping_add(i as u64 * u64::from(dp) + u64::from(r)),
            ..config.engine.clone()
        })?;
        let (jobs, rx) = mpsc::unbounded_channel();
        let stats = Arc::new(Mutex::new(Stats::default()));
        let publisher = publishers.get(r as usize).cloned();
        let out = Outbox {
            publisher,
            rank: r,
            tap: None,
        };
        let host = EngineHost::new(engine, config.transfer);
        tasks.push(tokio::spawn(drive(host, rx, Arc::clone(&stats), out)));
        ranks.push(Rank { jobs, stats });
    }
    let shutdown = Shutdown::new();
    let worker = Arc::new(MockWorkerState {
        engine_id: format!("kvroute-mock-{addr}"),
        role: config.role(i),
        rooms,
        addr,
        block_size: config.engine.block_size,
        seen: Mutex::new(std::collections::VecDeque::new()),
        model,
        model_name: config.model_name.clone(),
        adapters: crate::lora::Loaded::new(&config.lora_modules),
        max_model_len: config.engine.max_model_len,
        default_max_tokens: config.default_max_tokens,
        cached_tokens: config.cached_tokens,
        ranks,
        next_rank: std::sync::atomic::AtomicU64::new(0),
        next_id: std::sync::atomic::AtomicU64::new(0),
    });
    let routes = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(crate::lora::load))
        .route("/v1/unload_lora_adapter", post(crate::lora::unload))
        .route("/tokenize", post(tokenize))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .with_state(Arc::clone(&worker));
    tasks.push(tokio::spawn(net::serve(listener, routes, shutdown.clone())));
    Ok(MockWorker {
        addr,
        events_endpoint: publishers.first().map(|p| p.endpoint().to_owned()),
        replay_endpoint: publishers
            .first()
            .and_then(|p| p.replay_endpoint().map(str::to_owned)),
        role: config.role(i),
        dp_size: dp,
        state: worker,
        publishers,
        shutdown,
        tasks,
    })
}

/// Worker `i`'s publishers, one per rank: rank `r` on the rank-0 ports plus `r` (see
/// [`MockConfig::event_port`]). With free ports and several ranks, a free run of ports is
/// looked for first, since the ranks' ports must follow each other.
async fn start_publishers(
    config: &MockConfig,
    i: usize,
    dp: u32,
) -> Result<Vec<Arc<EventPublisher>>, MockError> {
    let host = config.host;
    let width = 2 * dp as usize;
    let tcp = |port: u16| format!("tcp://{host}:{port}");
    let mut tries = 0;
    loop {
        // Rank 0's endpoints; rank r's follow by the rule the proxy reads them with.
        let (events, replay) = match (config.event_port, dp) {
            (0, 1) => (tcp(0), tcp(0)),
            (0, _) => {
                let base = free_run(host, width)?;
                (tcp(base), tcp(base.saturating_add(dp as u16)))
            }
            (p, _) => {
                let base = port(p, width * i);
                (tcp(base), tcp(base.saturating_add(dp as u16)))
            }
        };
        let mut publishers = Vec::with_capacity(dp as usize);
        let mut failed = None;
        for r in 0..dp {
            let started = match (rank_endpoint(&events, r), rank_endpoint(&replay, r)) {
                (Ok(events), Ok(replay)) => {
                    EventPublisher::start(PublisherConfig {
                        replay_endpoint: Some(replay),
                        encoding: config.encoding,
                        buffer_steps: config.replay_buffer_steps,
                        ..PublisherConfig::new(events)
                    })
                    .await
                }
                (Err(e), _) | (_, Err(e)) => Err(e),
            };
            match started {
                Ok(p) => publishers.push(Arc::new(p)),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        match failed {
            None => return Ok(publishers),
            // Another process took a port of the free run meanwhile: look again.
            Some(_) if config.event_port == 0 && tries < 10 => tries += 1,
            Some(e) => return Err(e.into()),
        }
    }
}

/// The first of `width` consecutive free TCP ports on `host`.
fn free_run(host: IpAddr, width: usize) -> Result<u16, MockError> {
    let bind = |port: u16| std::net::TcpListener::bind(SocketAddr::new(host, port));
    let mut last = None;
    for _ in 0..50 {
        let first = bind(0)
            .and_then(|l| l.local_addr())
            .map_err(|source| MockError::Bind {
                addr: SocketAddr::new(host, 0),
                source,
            })?
            .port();
        let taken: Vec<_> = (0..width)
            .map(|k| first.checked_add(k as u16).map(bind))
            .collect();
        if taken.iter().all(|t| matches!(t, Some(Ok(_)))) {
            return Ok(first);
        }
        last = Some(first);
    }
    Err(MockError::Bind {
        addr: SocketAddr::new(host, last.unwrap_or(0)),
        source: std::io::Error::new(std::io::ErrorKind::AddrInUse, "no run of free ports"),
    })
}
