//! `kvroute mock`: simulated engines as OpenAI-compatible workers.
//!
//! Each mock worker is a [`kvroute_engine::Engine`] driven in real time (divided by the engine's
//! `speedup`) by one task, behind its own HTTP server: `/v1/completions` and
//! `/v1/chat/completions` (streaming or not, with `usage` and
//! `prompt_tokens_details.cached_tokens`), `/v1/models`, `/health` and a vLLM-like `/metrics`.
//! The engine's KV events go out in vLLM's wire format on a ZMQ PUB socket with a replay socket
//! ([`kvroute_zmq::EventPublisher`]). Prompts are tokenized with the same [`Model`] as the proxy,
//! so the blocks the proxy hashes are the blocks the engine caches.
//!
//! The driver loop: take requests as they arrive ([`Engine::add_request`] at the arrival time);
//! when the engine has work, run one pass ([`Engine::step`]), sleep until the pass ends (taking
//! new requests meanwhile), then deliver its tokens, first tokens and completions and publish its
//! events. The engine has no cancellation, so a request whose client left runs to its end and
//! its tokens are dropped.
//!
//! # Prefill/decode
//!
//! Any mock worker speaks both sides of vLLM's disaggregated-prefill protocol (NIXL connector),
//! whatever role it is configured under (the role only tells the proxy how to route to it):
//!
//! * a request whose `kv_transfer_params.do_remote_decode` is true is prefilled (one output
//!   token) and answered with `kv_transfer_params` naming this worker as the remote engine
//!   (`do_remote_prefill: true`, its engine id, the prompt's block indices, its host and port,
//!   the request's `X-Request-Id`);
//! * a request whose `kv_transfer_params.do_remote_prefill` is true is imported
//!   ([`Engine::import_request`]: the prompt's blocks it holds are hits, the rest are reserved;
//!   an import that finds no free blocks waits, in order, for a pass to free some), its KV lands
//!   after the transfer time of the blocks it lacks ([`KvTransfer::duration`], the simulator's
//!   link model), then [`Engine::complete_import`] caches the prompt and the request decodes
//!   from the token the prefill worker sampled. Its `cached_tokens` are the prompt blocks it
//!   already held. Imports start and land between passes, so their KV events follow the
//!   pass's in the engine's order.
//!
//! They speak SGLang's bootstrap protocol too, where the role decides the side, since both
//! workers get the same body: a request with `bootstrap_room` (and `bootstrap_host`) on a
//! `prefill` worker is prefilled (one output token) and its room marked ready when that token
//! is out; on any other worker it waits for its room to be ready (at most [`BOOTSTRAP_TIMEOUT`])
//! and is then imported as above. The rooms live in memory shared by the workers of one
//! [`start`] (standing in for the prefill worker's bootstrap server), so the prefill and decode
//! workers of a pair must be started together.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use kvroute_core::events::KvEvent;
use kvroute_core::ids::RequestId;
use kvroute_core::router::WorkerRole;
use kvroute_core::time::Timestamp;
use kvroute_engine::{
    Engine, EngineConfig, EngineRequest, FinishReason, KvTransfer, EnginePrompt, RequestError, TimingConfig,
    synthetic_output_token,
};
use kvroute_wire::{EventEncoding, WireEvent};
use kvroute_zmq::{EventPublisher, PublisherConfig, rank_endpoint};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use kvroute_http::model::Model;
use kvroute_http::net::{self, Shutdown};
use kvroute_http::openai::{self, ApiError, Endpoint};

/// How to run mock workers.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// How many decode workers (aggregated ones when `prefill_workers` is 0).
    pub workers: usize,
    /// Prefill workers, started before the others (worker `i < prefill_workers` has role
    /// `prefill`; the others then have role `decode`). Default 0: aggregated workers.
    pub prefill_workers: usize,
    /// The prefill-to-decode KV link of imports (its times are divided by the engine's
    /// `speedup`, like the engine's passes). Default [`KvTransfer::default`].
    pub transfer: KvTransfer,
    /// The address they listen on.
    pub host: IpAddr,
    /// The first worker's HTTP port; worker `i` listens on `port + i`. 0 picks free ports.
    pub port: u16,
    /// The first worker's ZMQ event port; worker `i`'s rank `r` publishes on
    /// `event_port + 2·i·dp_size + r` and replays on `dp_size` ports after (with one rank: worker
    /// `i` on `event_port + 2i`, replay on the port after). 0 picks free ports. Ignored without
    /// events.
    pub event_port: u16,
    /// Data-parallel ranks per worker: each an engine of its own behind the worker's one HTTP
    /// port, chosen by vLLM's `X-data-parallel-rank` header or SGLang's `data_parallel_rank`
    /// body field (in turn when a request names none), each publishing its own events on the
    /// rank-0 ports plus its rank (vLLM's layout). Default 1.
    pub dp_size: u32,
    /// Whether to publish KV events.
    pub events: bool,
    /// How events are encoded.
    pub encoding: EventEncoding,
    /// The engine of each worker (`speedup` divides modeled times).
    pub engine: EngineConfig,
    /// Output tokens of a request that names no `max_tokens`.
    pub default_max_tokens: u32,
    /// The model name served.
    pub model_name: String,
}

impl MockConfig {
    /// `workers` mock workers on free loopback ports, with events (map encoding), a vLLM-like
    /// engine of 16-token blocks and the polynomial timing model.
    pub fn new(workers: usize) -> Self {
        Self {
            workers,
            prefill_workers: 0,
            transfer: KvTransfer::default(),
            host: IpAddr::from([127, 0, 0, 1]),
            port: 0,
            event_port: 0,
            dp_size: 1,
            events: true,
            encoding: EventEncoding::Map,
            engine: Self::default_engine(),
            default_max_tokens: 16,
            model_name: "tiny".to_owned(),
        }
    }

    /// The role of worker `i` (prefill workers first).
    pub fn role(&self, i: usize) -> WorkerRole {
        match (i < self.prefill_workers, self.prefill_workers > 0) {
            (true, _) => WorkerRole::Prefill,
            (false, true) => WorkerRole::Decode,
            (false, false) => WorkerRole::Aggregated,
        }
    }

    /// Every worker: the prefill workers and the others.
    pub fn total(&self) -> usize {
        self.prefill_workers + self.workers
    }

    /// The default engine: 16-token blocks, 16,384 blocks, 256 sequences, 8,192 tokens per
    /// pass, chunked prefill and prefix caching on, real time.
    pub fn default_engine() -> EngineConfig {
        EngineConfig {
            block_size: 16,
            num_blocks: 16_384,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 131_072,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            external_hash_seed: 0,
            speedup: 1.0,
            timing: TimingConfig::Polynomial,
        }
    }
}

/// Why mock workers could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MockError {
    /// The engine configuration was refused.
    #[error("engine: {0}")]
    Engine(#[from] kvroute_engine::ConfigError),
    /// A port could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// The event publisher did not start.
    #[error("KV-event publisher: {0}")]
    Events(#[from] kvroute_zmq::ZmqError),
}

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
    state: Arc<Worker>,
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

/// What the engine task tells a request's handler.
#[derive(Debug)]
enum Progress {
    /// The request was admitted, with this many prompt tokens found cached.
    Cached(u32),
    /// Output tokens.
    Tokens(Vec<u32>),
    /// It finished.
    Done { completion_tokens: u32, length: bool },
    /// The engine refused it.
    Refused(String),
}

struct Job {
    prompt: Vec<u32>,
    output_len: u32,
    cache_salt: Option<String>,
    /// Its KV comes from a prefill worker ([`Engine::import_request`]).
    import: bool,
    tx: mpsc::UnboundedSender<Progress>,
}

/// Engine counters for `/metrics`, updated after every pass.
#[derive(Debug, Default, Clone, Copy)]
struct Stats {
    running: u64,
    waiting: u64,
    kv_usage: f64,
    hit_tokens: u64,
    query_tokens: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
    finished: u64,
    /// Requests prefilled for a remote decode (vLLM's hop 1, SGLang's prefill side).
    remote_decode_requests: u64,
    /// Imports whose KV landed (vLLM's hop 2, SGLang's decode side).
    imports: u64,
    /// Prompt blocks imports found cached here.
    import_hit_blocks: u64,
    /// Prompt blocks imports moved over the link.
    import_transfer_blocks: u64,
    /// Imports that found too few free blocks and waited.
    import_waits: u64,
}

struct Worker {
    /// The engine id it names in `kv_transfer_params`.
    engine_id: String,
    /// Its role: which side of an SGLang pair it takes.
    role: WorkerRole,
    /// The bootstrap rooms of the workers started with it.
    rooms: Arc<Rooms>,
    addr: SocketAddr,
    block_size: u32,
    seen: Mutex<std::collections::VecDeque<SeenKvRequest>>,
    model: Arc<Model>,
    model_name: String,
    max_model_len: u32,
    default_max_tokens: u32,
    /// Each rank's engine task and counters.
    ranks: Vec<Rank>,
    /// The rank of the next request that names none.
    next_rank: std::sync::atomic::AtomicU64,
    next_id: std::sync::atomic::AtomicU64,
}

/// One data-parallel rank of a mock worker: its engine task's queue and its counters.
struct Rank {
    jobs: mpsc::UnboundedSender<Job>,
    stats: Arc<Mutex<Stats>>,
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

/// How long the decode side of an SGLang pair waits for its room's prefill.
pub const BOOTSTRAP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// SGLang's bootstrap rooms, by number: a prefill that finished before its decode side asked,
/// or a decode side waiting for its prefill.
#[derive(Default)]
struct Rooms {
    slots: Mutex<HashMap<u64, Slot>>,
}

enum Slot {
    /// The prefill ended (true: its KV is ready; false: it was refused) at this time.
    Done(bool, Instant),
    /// A decode side waits.
    Waiting(oneshot::Sender<bool>),
}

impl Rooms {
    /// The prefill of `room` ended: `ok` if its KV is ready.
    fn prefilled(&self, room: u64, ok: bool) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(Slot::Waiting(tx)) = slots.remove(&room) {
            let _ = tx.send(ok);
            return;
        }
        // Rooms no decode side claimed within the timeout are forgotten.
        if slots.len() >= 1024 {
            slots.retain(|_, slot| !matches!(slot, Slot::Done(_, at) if at.elapsed() > BOOTSTRAP_TIMEOUT));
        }
        slots.insert(room, Slot::Done(ok, Instant::now()));
    }

    /// Passes `progress` on, and marks `room` prefilled when it ends (refused: not ready).
    fn watch(
        self: &Arc<Self>,
        room: u64,
        mut progress: mpsc::UnboundedReceiver<Progress>,
    ) -> mpsc::UnboundedReceiver<Progress> {
        let (tx, rx) = mpsc::unbounded_channel();
        let rooms = Arc::clone(self);
        tokio::spawn(async move {
            let mut ok = false;
            while let Some(p) = progress.recv().await {
                let end = match &p {
                    Progress::Done { .. } => Some(true),
                    Progress::Refused(_) => Some(false),
                    _ => None,
                };
                let _ = tx.send(p);
                if let Some(end) = end {
                    ok = end;
                    break;
                }
            }
            rooms.prefilled(room, ok);
        });
        rx
    }

    /// Waits (at most `timeout`) for the prefill of `room`; true if its KV is ready.
    async fn wait(&self, room: u64, timeout: std::time::Duration) -> bool {
        let rx = {
            let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(Slot::Done(ok, _)) = slots.get(&room) {
                let ok = *ok;
                slots.remove(&room);
                return ok;
            }
            let (tx, rx) = oneshot::channel();
            slots.insert(room, Slot::Waiting(tx));
            rx
        };
        let forget = Forget { rooms: self, room };
        let ok = matches!(tokio::time::timeout(timeout, rx).await, Ok(Ok(true)));
        drop(forget);
        ok
    }
}

/// Removes a waiting decode side's slot when it stops waiting (answered, timed out or its
/// client left).
struct Forget<'a> {
    rooms: &'a Rooms,
    room: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        let mut slots = self.rooms.slots.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(slots.get(&self.room), Some(Slot::Waiting(_))) {
            slots.remove(&self.room);
        }
    }
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
        let out = Outbox { publisher, rank: r };
        tasks.push(tokio::spawn(drive(
            engine,
            rx,
            Arc::clone(&stats),
            out,
            config.transfer,
        )));
        ranks.push(Rank { jobs, stats });
    }
    let shutdown = Shutdown::new();
    let worker = Arc::new(Worker {
        engine_id: format!("kvroute-mock-{addr}"),
        role: config.role(i),
        rooms,
        addr,
        block_size: config.engine.block_size,
        seen: Mutex::new(std::collections::VecDeque::new()),
        model,
        model_name: config.model_name.clone(),
        max_model_len: config.engine.max_model_len,
        default_max_tokens: config.default_max_tokens,
        ranks,
        next_rank: std::sync::atomic::AtomicU64::new(0),
        next_id: std::sync::atomic::AtomicU64::new(0),
    });
    let routes = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
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

// ---- the engine driver ----

/// The timer's resolution: the driver runs ahead of the wall clock by up to this much.
const TICK: std::time::Duration = std::time::Duration::from_millis(1);
/// How far behind the wall clock the driver may run before its engine's time slips.
const CATCH_UP: std::time::Duration = std::time::Duration::from_millis(20);

struct Live {
    tx: mpsc::UnboundedSender<Progress>,
    outputs: u32,
}

/// The engine task's state besides the engine.
struct Driver {
    epoch: Instant,
    live: HashMap<RequestId, Live>,
    next_id: u64,
    /// Imports waiting to start (for a pass to end, or for free blocks), in arrival order.
    pending_imports: std::collections::VecDeque<(RequestId, Job)>,
    /// The waiting import last counted in `import_waits`.
    counted_wait: Option<RequestId>,
    /// Imports whose KV is on the link: when it lands, and the request.
    transfers: std::collections::BTreeSet<(Timestamp, RequestId)>,
    transfer: KvTransfer,
    stats: Arc<Mutex<Stats>>,
    out: Outbox,
}

/// Where a rank's engine publishes its KV events, under its rank.
struct Outbox {
    publisher: Option<Arc<EventPublisher>>,
    rank: u32,
}

impl Driver {
    fn now(&self) -> Timestamp {
        Timestamp(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    fn at(&self, t: Timestamp) -> tokio::time::Instant {
        tokio::time::Instant::from_std(self.epoch + std::time::Duration::from_nanos(t.0))
    }

    fn request(id: RequestId, job: &Job) -> EngineRequest {
        EngineRequest {
            id,
            prompt: EnginePrompt::Tokens(job.prompt.clone()),
            output_len: job.output_len,
            lora_name: None,
            cache_namespace: job.cache_salt.clone(),
        }
    }

    /// Takes a request: a local one joins the engine's queue now; an import waits for
    /// [`Self::start_imports`], which runs between passes.
    fn add(&mut self, engine: &mut Engine, job: Job, t: Timestamp) {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        if job.import {
            self.pending_imports.push_back((id, job));
            return;
        }
        let request = Self::request(id, &job);
        match engine.add_request(t, request) {
            Ok(()) => {
                self.live.insert(
                    id,
                    Live {
                        tx: job.tx,
                        outputs: 0,
                    },
                );
            }
            Err(e) => {
                let _ = job.tx.send(Progress::Refused(e.to_string()));
            }
        }
    }

    /// Starts the waiting imports that fit, in order: blocks reserved, the transfer of those it
    /// lacks on the link. Called only between passes.
    fn start_imports(&mut self, engine: &mut Engine, t: Timestamp) {
        while let Some((id, job)) = self.pending_imports.front() {
            let id = *id;
            match engine.import_request(t, Self::request(id, job)) {
                Ok(import) => {
                    let Some((_, job)) = self.pending_imports.pop_front() else {
                        break;
                    };
                    let bs = engine.config().block_size;
                    let cached = (import.hit_blocks * bs).min(job.prompt.len() as u32);
                    let _ = job.tx.send(Progress::Cached(cached));
                    self.live.insert(
                        id,
                        Live {
                            tx: job.tx,
                            outputs: 0,
                        },
                    );
                    self.publish(&import.events);
                    // A modeled time, sped up like the engine's passes.
                    let took = self.transfer.duration(import.transfer_blocks, bs);
                    let took = took.div_f64(engine.config().speedup);
                    let lands = t + took;
                    self.transfers.insert((lands, id));
                    let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
                    s.import_hit_blocks += u64::from(import.hit_blocks);
                    s.import_transfer_blocks += u64::from(import.transfer_blocks);
                }
                // Retried after the next pass frees blocks, unless it can never fit.
                Err(RequestError::NoBlocksForImport { blocks_needed, .. })
                    if blocks_needed <= engine.kv_blocks().1 =>
                {
                    if self.counted_wait != Some(id) {
                        self.counted_wait = Some(id);
                        self.stats.lock().unwrap_or_else(|p| p.into_inner()).import_waits += 1;
                    }
                    break;
                }
                Err(e) => {
                    if let Some((_, job)) = self.pending_imports.pop_front() {
                        let _ = job.tx.send(Progress::Refused(e.to_string()));
                    }
                }
            }
        }
    }

    /// Lands the transfers due by `until`: the engine takes the KV, and the token the prefill
    /// worker sampled is the request's first. Called only between passes.
    fn land_transfers(&mut self, engine: &mut Engine, until: Timestamp) {
        while let Some(&(t, id)) = self.transfers.first() {
            if t > until {
                break;
            }
            self.transfers.pop_first();
            match engine.complete_import(t, id) {
                Ok(events) => self.publish(&events),
                Err(e) => {
                    tracing::warn!(error = %e, "completing an import failed");
                    continue;
                }
            }
            self.stats.lock().unwrap_or_else(|p| p.into_inner()).imports += 1;
            if let Some(l) = self.live.get_mut(&id) {
                l.outputs = 1;
                let _ = l.tx.send(Progress::Tokens(vec![synthetic_output_token(id, 0)]));
            }
        }
    }

    fn publish(&self, events: &[KvEvent]) {
        let Some(p) = &self.out.publisher else { return };
        if events.is_empty() {
            return;
        }
        let events: Vec<WireEvent> = events.iter().map(WireEvent::from).collect();
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        if let Err(e) = p.publish(events, Some(self.out.rank), ts) {
            tracing::warn!(error = %e, "publishing KV events failed");
        }
    }
}

async fn drive(
    mut engine: Engine,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    stats: Arc<Mutex<Stats>>,
    out: Outbox,
    transfer: KvTransfer,
) {
    let mut d = Driver {
        epoch: Instant::now(),
        live: HashMap::new(),
        next_id: 0,
        pending_imports: std::collections::VecDeque::new(),
        counted_wait: None,
        transfers: std::collections::BTreeSet::new(),
        transfer,
        stats,
        out,
    };
    loop {
        // Between passes: transfers land, waiting imports start.
        d.land_transfers(&mut engine, d.now() + TICK);
        d.start_imports(&mut engine, d.now());
        let landing = d.transfers.first().map(|&(t, _)| t);
        let wake = engine.next_wakeup();
        let Some(next) = wake.into_iter().chain(landing).min() else {
            match jobs.recv().await {
                Some(job) => d.add(&mut engine, job, d.now()),
                None => return,
            }
            continue;
        };
        // Sleep only when ahead of the wall clock by more than the timer's resolution: a
        // sped-up engine's passes are shorter than a millisecond, and rounding each sleep up to
        // the timer's tick would slow it down several times. Virtual time stays exact; tokens
        // are delivered at most a tick early.
        if next > d.now() + TICK {
            tokio::select! {
                () = tokio::time::sleep_until(d.at(next)) => {}
                job = jobs.recv() => match job {
                    Some(job) => d.add(&mut engine, job, d.now()),
                    None => return,
                },
            }
            continue;
        }
        // Only a transfer was due: it lands at the top of the loop.
        let Some(wake) = wake.filter(|&w| w <= d.now() + TICK) else {
            continue;
        };
        // A pass starts when the last one ended, even if the timer woke the driver late (it
        // catches up by running the next passes without sleeping), unless it fell behind by
        // more than `CATCH_UP` (the machine is overloaded): then the engine slips to now.
        let start = wake.max(d.now() - CATCH_UP);
        let Some(out) = engine.step(start) else { continue };
        // The pass's effects happen when it ends; requests arriving meanwhile join the queue.
        let end = d.at(out.end);
        while out.end > d.now() + TICK {
            tokio::select! {
                () = tokio::time::sleep_until(end) => break,
                job = jobs.recv() => match job {
                    Some(job) => d.add(&mut engine, job, d.now()),
                    None => return,
                },
            }
        }
        for &(id, cached) in &out.prefix_hits {
            if let Some(l) = d.live.get(&id) {
                let _ = l.tx.send(Progress::Cached(cached));
            }
        }
        for e in &out.emitted {
            if let Some(l) = d.live.get_mut(&e.request) {
                let tokens = (0..e.tokens)
                    .map(|k| synthetic_output_token(e.request, l.outputs + k))
                    .collect();
                l.outputs += e.tokens;
                let _ = l.tx.send(Progress::Tokens(tokens));
            }
        }
        for f in &out.finished {
            if let Some(l) = d.live.remove(&f.request) {
                let _ = l.tx.send(Progress::Done {
                    completion_tokens: f.output_tokens,
                    length: f.reason == FinishReason::Length,
                });
            }
        }
        d.publish(&out.events);
        let (active, total) = engine.kv_blocks();
        let mut s = d.stats.lock().unwrap_or_else(|p| p.into_inner());
        s.running = engine.num_running() as u64;
        s.waiting = engine.num_waiting() as u64;
        s.kv_usage = if total == 0 {
            0.0
        } else {
            f64::from(active) / f64::from(total)
        };
        s.hit_tokens += out.metrics.prefix_cache_hit_tokens;
        s.query_tokens += out.metrics.prefix_cache_query_tokens;
        s.generation_tokens += out.emitted.iter().map(|e| u64::from(e.tokens)).sum::<u64>();
        s.finished += out.finished.len() as u64;
    }
}

// ---- HTTP ----

async fn completions(State(w): State<Arc<Worker>>, req: Request) -> Response {
    generate(&w, Endpoint::Completions, req).await
}

async fn chat(State(w): State<Arc<Worker>>, req: Request) -> Response {
    generate(&w, Endpoint::Chat, req).await
}

/// What a request asks of the disaggregated flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KvRole {
    /// An ordinary request.
    Local,
    /// Hop 1: prefill it and keep its KV for a remote decode.
    RemoteDecode,
    /// Hop 2: its KV was prefilled elsewhere; import it and decode.
    RemotePrefill,
    /// SGLang, on a prefill worker: prefill it, then mark its room ready.
    BootstrapPrefill(u64),
    /// SGLang, on another worker: wait for its room, then import it and decode.
    BootstrapDecode(u64),
}

impl KvRole {
    /// The prefill side of a pair (it samples one token).
    fn prefills(self) -> bool {
        matches!(self, Self::RemoteDecode | Self::BootstrapPrefill(_))
    }

    /// The decode side of a pair (its KV comes from a prefill worker).
    fn imports(self) -> bool {
        matches!(self, Self::RemotePrefill | Self::BootstrapDecode(_))
    }

    /// The room whose prefill this request is.
    fn prefilled_room(self) -> Option<u64> {
        match self {
            Self::BootstrapPrefill(room) => Some(room),
            _ => None,
        }
    }
}

/// The request's part in a disaggregated flow, from its `kv_transfer_params` (vLLM: hop 2's
/// must name where the KV is) or its bootstrap fields (SGLang: the worker's `role` picks the
/// side).
fn kv_role(body: &Value, role: WorkerRole) -> Result<KvRole, ApiError> {
    let params = body.get("kv_transfer_params").filter(|p| !p.is_null());
    if let Some(room) = body.get("bootstrap_room").filter(|r| !r.is_null()) {
        if params.is_some() {
            return Err(ApiError::bad_request(
                "bootstrap_room",
                "a request speaks one protocol: bootstrap_room or kv_transfer_params",
            ));
        }
        let Some(room) = room.as_u64().filter(|&r| r < 1 << 63) else {
            return Err(ApiError::bad_request(
                "bootstrap_room",
                "must be an integer from 0 to 2^63 - 1",
            ));
        };
        if !body.get("bootstrap_host").is_some_and(Value::is_string) {
            return Err(ApiError::bad_request(
                "bootstrap_host",
                "a bootstrap room needs its host",
            ));
        }
        return Ok(if role == WorkerRole::Prefill {
            KvRole::BootstrapPrefill(room)
        } else {
            KvRole::BootstrapDecode(room)
        });
    }
    let Some(params) = params else {
        return Ok(KvRole::Local);
    };
    let flag = |name: &str| params.get(name).and_then(Value::as_bool) == Some(true);
    match (flag("do_remote_decode"), flag("do_remote_prefill")) {
        (true, true) => Err(ApiError::bad_request(
            "kv_transfer_params",
            "do_remote_decode and do_remote_prefill are both true",
        )),
        (true, false) => Ok(KvRole::RemoteDecode),
        (false, true) => {
            if !params.get("remote_engine_id").is_some_and(Value::is_string)
                || !params.get("remote_block_ids").is_some_and(Value::is_array)
            {
                return Err(ApiError::bad_request(
                    "kv_transfer_params",
                    "a remote prefill needs remote_engine_id and remote_block_ids",
                ));
            }
            Ok(KvRole::RemotePrefill)
        }
        (false, false) => Ok(KvRole::Local),
    }
}

/// The rank a request names: vLLM's `X-data-parallel-rank` header, else SGLang's
/// `data_parallel_rank` body field, else the next rank in turn.
fn pick_rank(w: &Worker, header: Option<&str>, body: &Value) -> Result<usize, ApiError> {
    let named = match (header, body.get("data_parallel_rank").filter(|v| !v.is_null())) {
        (Some(h), _) => Some(h.trim().parse::<u64>().ok()),
        (None, Some(v)) => Some(v.as_u64()),
        (None, None) => None,
    };
    let ranks = w.ranks.len();
    match named {
        None => {
            let turn = w.next_rank.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok((turn % ranks as u64) as usize)
        }
        Some(Some(r)) if (r as usize) < ranks => Ok(r as usize),
        Some(_) => Err(ApiError::bad_request(
            "data_parallel_rank",
            format!("the data-parallel rank must be an integer below {ranks}"),
        )),
    }
}

async fn generate(w: &Arc<Worker>, endpoint: Endpoint, req: Request) -> Response {
    let (request_id, rank_header) = {
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        (
            header(kvroute_http::disagg::REQUEST_ID),
            header("x-data-parallel-rank"),
        )
    };
    let body = match http_body_util::Limited::new(req.into_body(), 64 << 20)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => return ApiError::bad_request("body", format!("reading the body: {e}")).into_response(),
    };
    let parsed = match openai::parse(endpoint, &body, &w.model, w.max_model_len as usize) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // `parse` accepted it: a JSON object.
    let value: Value = serde_json::from_slice(&body).unwrap_or_default();
    let role = match kv_role(&value, w.role) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let rank = match pick_rank(w, rank_header.as_deref(), &value) {
        Ok(r) => &w.ranks[r],
        Err(e) => return e.into_response(),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let prompt_tokens = parsed.tokens.len() as u32;
    let max_tokens = parsed.max_tokens;
    let mut output_len = max_tokens.unwrap_or(w.default_max_tokens);
    if role.prefills() {
        // A prefill for a remote decode samples the first token only.
        output_len = output_len.min(1);
    }
    {
        let mut s = rank.stats.lock().unwrap_or_else(|p| p.into_inner());
        s.prompt_tokens += u64::from(prompt_tokens);
        if role.prefills() {
            s.remote_decode_requests += 1;
        }
    }
    if role != KvRole::Local {
        let mut body = value;
        if let Value::Object(obj) = &mut body {
            obj.remove("prompt");
            obj.remove("messages");
        }
        let mut seen = w.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() == SEEN_KEPT {
            seen.pop_front();
        }
        seen.push_back(SeenKvRequest {
            request_id: request_id.clone(),
            remote_decode: role.prefills(),
            body,
        });
    }
    // The engine imports only what leaves something to decode; a request of one token decodes
    // (recomputes) here.
    let import = role.imports() && output_len >= 2;
    // SGLang's decode side starts when its room's KV is ready.
    if let KvRole::BootstrapDecode(room) = role
        && !w.rooms.wait(room, BOOTSTRAP_TIMEOUT).await
    {
        return ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "kv_transfer_failed",
            format!("no prefilled KV arrived for bootstrap_room {room}"),
        )
        .into_response();
    }
    // SGLang's prefill side marks its room when the engine is done with it, whether or not
    // anyone still reads the answer.
    if let Some(room) = role.prefilled_room() {
        rx = w.rooms.watch(room, rx);
    }
    let transfer_params = (role == KvRole::RemoteDecode).then(|| {
        let blocks = prompt_tokens.div_ceil(w.block_size.max(1));
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": w.engine_id,
            "remote_block_ids": (0..blocks).collect::<Vec<u32>>(),
            "remote_host": w.addr.ip().to_string(),
            "remote_port": w.addr.port(),
            "remote_request_id": request_id,
            "tp_size": 1,
        })
    });
    let job = Job {
        prompt: parsed.tokens,
        output_len,
        cache_salt: parsed.cache_salt,
        import,
        tx,
    };
    if rank.jobs.send(job).is_err() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "stopped",
            "the engine stopped",
        )
        .into_response();
    }
    let n = w.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let shape = Shape {
        endpoint,
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-mock-{n}"),
            Endpoint::Chat => format!("chatcmpl-mock-{n}"),
        },
        created,
        model: parsed.model.unwrap_or_else(|| w.model_name.clone()),
        prompt_tokens,
        max_tokens,
    };
    if parsed.stream {
        let include_usage = parsed.include_usage;
        let worker = Arc::clone(w);
        let (frames_tx, frames_rx) = mpsc::channel::<Bytes>(64);
        tokio::spawn(async move {
            let mut cached = 0;
            let mut first = true;
            while let Some(p) = rx.recv().await {
                let chunk = match p {
                    Progress::Cached(c) => {
                        cached = c;
                        continue;
                    }
                    Progress::Tokens(tokens) => {
                        let text = worker.text(&tokens);
                        let c = shape.chunk(&text, None, first);
                        first = false;
                        c
                    }
                    Progress::Done {
                        completion_tokens,
                        length,
                    } => {
                        let mut out =
                            shape.chunk("", Some(shape.finish_reason(completion_tokens, length)), first);
                        if include_usage {
                            out.push_str(&shape.usage_chunk(completion_tokens, cached));
                        }
                        out.push_str("data: [DONE]\n\n");
                        let _ = frames_tx.send(Bytes::from(out)).await;
                        return;
                    }
                    Progress::Refused(message) => {
                        let err = json!({"error": {"message": message, "type": "invalid_request_error", "param": null, "code": "refused"}});
                        format!("data: {err}\n\n")
                    }
                };
                if frames_tx.send(Bytes::from(chunk)).await.is_err() {
                    return;
                }
            }
        });
        let body = ChannelBody {
            rx: frames_rx,
            complete: false,
        };
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(Body::new(body))
            .unwrap_or_default();
    }
    let mut cached = 0;
    let mut tokens = Vec::new();
    while let Some(p) = rx.recv().await {
        match p {
            Progress::Cached(c) => cached = c,
            Progress::Tokens(t) => tokens.extend(t),
            Progress::Done {
                completion_tokens,
                length,
            } => {
                let text = w.text(&tokens);
                let mut full = shape.full(&text, completion_tokens, length, cached);
                if let Some(params) = transfer_params {
                    full["kv_transfer_params"] = params;
                }
                return axum::Json(full).into_response();
            }
            Progress::Refused(message) => return ApiError::bad_request("prompt", message).into_response(),
        }
    }
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "stopped",
        "the engine stopped",
    )
    .into_response()
}

/// A response body fed by a channel of SSE chunks. If the channel closes before the final
/// chunk (the engine stopped: the worker was killed), the body fails, so the connection breaks
/// off instead of ending like a complete response.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
    complete: bool,
}

/// The engine stopped in the middle of a response.
#[derive(Debug, thiserror::Error)]
#[error("the engine stopped mid-response")]
struct EngineStopped;

const DONE: &[u8] = b"data: [DONE]\n\n";

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = EngineStopped;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        self.rx.poll_recv(cx).map(|chunk| match chunk {
            Some(b) => {
                if b.ends_with(DONE) {
                    self.complete = true;
                }
                Some(Ok(Frame::data(b)))
            }
            None if self.complete => None,
            None => Some(Err(EngineStopped)),
        })
    }
}

impl Worker {
    fn text(&self, tokens: &[u32]) -> String {
        let vocab = self.model.vocab_size().max(1);
        let ids: Vec<u32> = tokens
            .iter()
            .map(|&t| {
                if vocab <= 512 {
                    u32::from(b'a') + t % 26
                } else {
                    t % vocab
                }
            })
            .collect();
        self.model.decode(&ids)
    }
}

/// The response shapes of one request.
struct Shape {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
}

impl Shape {
    fn finish_reason(&self, completion_tokens: u32, length: bool) -> &'static str {
        if length || self.max_tokens == Some(completion_tokens) {
            "length"
        } else {
            "stop"
        }
    }

    fn usage(&self, completion_tokens: u32, cached: u32) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    /// One SSE event with `text`.
    fn chunk(&self, text: &str, finish: Option<&str>, first: bool) -> String {
        let choice = match self.endpoint {
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) => json!({}),
                    (false, None) => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        format!("data: {v}\n\n")
    }

    fn usage_chunk(&self, completion_tokens: u32, cached: u32) -> String {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        let v = json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [], "usage": self.usage(completion_tokens, cached)});
        format!("data: {v}\n\n")
    }

    fn full(&self, text: &str, completion_tokens: u32, length: bool, cached: u32) -> Value {
        let finish = self.finish_reason(completion_tokens, length);
        let (object, choice) = match self.endpoint {
            Endpoint::Completions => (
                "text_completion",
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            ),
            Endpoint::Chat => (
                "chat.completion",
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish}),
            ),
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
            "choices": [choice], "usage": self.usage(completion_tokens, cached)})
    }
}

async fn models(State(w): State<Arc<Worker>>) -> Response {
    axum::Json(json!({"object": "list", "data": [{"id": w.model_name, "object": "model", "created": 0, "owned_by": "kvroute-mock"}]}))
        .into_response()
}

/// vLLM-like metrics, by vLLM's names: a series per data-parallel rank (label `engine`, as
/// vLLM labels its engines).
async fn metrics(State(w): State<Arc<Worker>>) -> Response {
    let stats: Vec<Stats> = w
        .ranks
        .iter()
        .map(|r| *r.stats.lock().unwrap_or_else(|p| p.into_inner()))
        .collect();
    let m = &w.model_name;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: fn(&Stats) -> String| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (rank, s) in stats.iter().enumerate() {
            out.push_str(&format!(
                "{name}{{engine=\"{rank}\",model_name=\"{m}\"}} {}\n",
                value(s)
            ));
        }
    };
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Requests running on the engine.",
        |s| s.running.to_string(),
    );
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled.",
        |s| s.waiting.to_string(),
    );
    metric(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "KV-cache usage, 1 = full (deprecated name).",
        |s| format!("{}", s.kv_usage),
    );
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage, 1 = full.",
        |s| format!("{}", s.kv_usage),
    );
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        |s| s.query_tokens.to_string(),
    );
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in the prefix cache.",
        |s| s.hit_tokens.to_string(),
    );
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Prompt tokens received.",
        |s| s.prompt_tokens.to_string(),
    );
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Tokens generated.",
        |s| s.generation_tokens.to_string(),
    );
    metric(
        "vllm:request_success_total",
        "counter",
        "Requests finished.",
        |s| s.finished.to_string(),
    );
    metric(
        "kvroute_mock_remote_decode_requests_total",
        "counter",
        "Requests prefilled for a remote decode (kv_transfer_params.do_remote_decode, or an SGLang bootstrap room on a prefill worker).",
        |s| s.remote_decode_requests.to_string(),
    );
    metric(
        "kvroute_mock_kv_imports_total",
        "counter",
        "Remote prefills imported: KV landed (kv_transfer_params.do_remote_prefill, or an SGLang bootstrap room).",
        |s| s.imports.to_string(),
    );
    metric(
        "kvroute_mock_kv_import_hit_blocks_total",
        "counter",
        "Prompt blocks imports found cached locally.",
        |s| s.import_hit_blocks.to_string(),
    );
    metric(
        "kvroute_mock_kv_import_transfer_blocks_total",
        "counter",
        "Prompt blocks imports moved over the link.",
        |s| s.import_transfer_blocks.to_string(),
    );
    metric(
        "kvroute_mock_kv_import_waits_total",
        "counter",
        "Imports that waited for free KV blocks.",
        |s| s.import_waits.to_string(),
    );
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        out,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_take_their_side_of_either_protocol() {
        let prefill = WorkerRole::Prefill;
        let decode = WorkerRole::Decode;
        let room = json!({"prompt": "p", "bootstrap_host": "10.0.0.1", "bootstrap_port": null,
            "bootstrap_room": 42});
        assert_eq!(kv_role(&room, prefill).unwrap(), KvRole::BootstrapPrefill(42));
        assert_eq!(kv_role(&room, decode).unwrap(), KvRole::BootstrapDecode(42));
        assert_eq!(
            kv_role(&room, WorkerRole::Aggregated).unwrap(),
            KvRole::BootstrapDecode(42)
        );
        assert_eq!(
            kv_role(&json!({"prompt": "p", "bootstrap_room": null}), decode).unwrap(),
            KvRole::Local
        );
        let vllm = json!({"kv_transfer_params": {"do_remote_decode": true}});
        assert_eq!(kv_role(&vllm, decode).unwrap(), KvRole::RemoteDecode);
        // (body, the field the error names)
        let bad = [
            (json!({"bootstrap_room": 1}), "bootstrap_host"),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": -1}),
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": 1u64 << 63}),
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": "7"}),
                "bootstrap_room",
            ),
            (
                json!({"bootstrap_host": "h", "bootstrap_room": 7,
                       "kv_transfer_params": {"do_remote_decode": true}}),
                "bootstrap_room",
            ),
        ];
        for (body, field) in bad {
            let err = kv_role(&body, decode).unwrap_err();
            assert_eq!(err.param, Some(field), "{body}");
        }
    }

    // Paused time: a wait that times out does so at once, at the virtual deadline.
    #[tokio::test(start_paused = true)]
    async fn a_room_is_met_whichever_side_comes_first() {
        let rooms = Arc::new(Rooms::default());
        let short = std::time::Duration::from_millis(20);
        // The prefill ends first; the decode side then finds it at once.
        rooms.prefilled(1, true);
        assert!(rooms.wait(1, short).await);
        // The decode side waits, then the prefill ends.
        let waiter = tokio::spawn({
            let rooms = Arc::clone(&rooms);
            async move { rooms.wait(2, std::time::Duration::from_secs(5)).await }
        });
        while !rooms.slots.lock().unwrap().contains_key(&2) {
            tokio::task::yield_now().await;
        }
        rooms.prefilled(2, true);
        assert!(waiter.await.unwrap());
        // A refused prefill, and one that never comes.
        rooms.prefilled(3, false);
        assert!(!rooms.wait(3, short).await);
        let t0 = tokio::time::Instant::now();
        assert!(!rooms.wait(4, short).await);
        assert_eq!(t0.elapsed(), short, "the decode side gave up at its deadline");
        assert!(rooms.slots.lock().unwrap().is_empty(), "every room was forgotten");

        // `watch` passes progress on and marks the room when the engine is done, even when
        // nobody reads the answer.
        let (tx, rx) = mpsc::unbounded_channel();
        drop(rooms.watch(5, rx));
        tx.send(Progress::Tokens(vec![1])).unwrap();
        tx.send(Progress::Done {
            completion_tokens: 1,
            length: true,
        })
        .unwrap();
        assert!(rooms.wait(5, std::time::Duration::from_secs(5)).await);
    }
}
