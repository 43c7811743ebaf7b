//! `kvroute serve`: the OpenAI-compatible proxy's HTTP front.
//!
//! [`start`] binds, adds the configured workers, and starts their KV-event subscribers
//! ([`crate::events`]), the health prober ([`crate::health`]) and the router's timers. A
//! generation request is read (bounded), parsed and tokenized here, then forwarded in its flow
//! ([`crate::flow`]); its [`Outcome`] is counted by endpoint, type and status. The rest are
//! `/v1/models`, `/health`, `/metrics` and the admin API over the worker registry.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use kvroute_core::ids::WorkerId;
use kvroute_core::router::Router;
use serde_json::json;

use crate::config::{ConfigError, ServeConfig, WorkerConfig};
use crate::driver::Shared;
use crate::events::EventFeed;
use crate::flow::{Forwarder, Generation};
use crate::metrics::Metrics;
use kvroute_http::model::Model;
use kvroute_http::net::{self, Shutdown};
use kvroute_http::openai::types::ModelList;
use kvroute_http::openai::{self, ApiError, Endpoint};

/// Why the proxy could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The model did not load.
    #[error(transparent)]
    Model(#[from] kvroute_http::model::ModelError),
    /// The listener could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// A worker was refused.
    #[error("worker: {0}")]
    Worker(String),
}

struct App {
    shared: Arc<Shared>,
    model: Arc<Model>,
    forwarder: Arc<Forwarder>,
    feed: EventFeed,
}

/// A running proxy.
pub struct ProxyHandle {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// The router driver (for tests and the demo: loads, invariants).
    pub shared: Arc<Shared>,
    shutdown: Shutdown,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl ProxyHandle {
    /// The base URL, `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the proxy: the listener, every connection and the background tasks.
    pub fn stop(&self) {
        self.shutdown.stop();
        for t in &self.tasks {
            t.abort();
        }
    }

    /// Resolves when the proxy was stopped.
    pub async fn stopped(&self) {
        self.shutdown.stopped().await;
    }
}

impl Drop for ProxyHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts the proxy: validates `config`, loads the model (`model` overrides the config's
/// directory), binds, adds the configured workers and starts their event subscribers, health
/// checks and the router's timers.
pub async fn start(config: ServeConfig, model: Option<Arc<Model>>) -> Result<ProxyHandle, ServeError> {
    let router_config = config.validate()?;
    let router = Router::new(router_config).map_err(ConfigError::from)?;
    let model = match model {
        Some(m) => m,
        None => Arc::new(match &config.model_dir {
            Some(dir) => Model::load(dir)?,
            None => Model::tiny()?,
        }),
    };
    let addr = config.listen_addr()?;
    let (listener, addr) = net::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })?;
    let client = net::client(ServeConfig::ms(config.connect_timeout_ms));
    let workers = config.workers.clone();
    let shared = Shared::new(router, config, Metrics::new());
    let feed = EventFeed::start(Arc::clone(&shared));
    let forwarder = Arc::new(Forwarder {
        shared: Arc::clone(&shared),
        client: client.clone(),
        instance: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    });
    let app = Arc::new(App {
        shared: Arc::clone(&shared),
        model,
        forwarder,
        feed,
    });
    for w in workers {
        add_worker(&app, w).map_err(ServeError::Worker)?;
    }
    let shutdown = Shutdown::new();
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(ticker(Arc::clone(&shared))));
    if shared.config.health_interval_ms > 0 {
        tasks.push(tokio::spawn(crate::health::run(Arc::clone(&shared), client)));
    }
    let routes = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/admin/workers", get(list_workers).post(post_worker))
        .route("/admin/workers/{id}", axum::routing::delete(delete_worker))
        .route("/admin/workers/{id}/drain", post(drain_worker))
        .fallback(not_found)
        .with_state(app);
    tasks.push(tokio::spawn(net::serve(listener, routes, shutdown.clone())));
    Ok(ProxyHandle {
        addr,
        shared,
        shutdown,
        tasks,
    })
}

fn add_worker(app: &App, config: WorkerConfig) -> Result<WorkerId, String> {
    let id = app.shared.add_worker(config.clone())?;
    app.feed.subscribe(id, &config);
    // TOKENIZATION PARITY: the one call site. Today it only logs (a mismatch loudly); its
    // `Parity` result is for the worker's misconfigured state.
    tokio::spawn(crate::parity::check_and_warn(
        app.forwarder.client.clone(),
        config.url,
        app.shared.config.model_name.clone(),
        Arc::clone(&app.model),
        ServeConfig::ms(app.shared.config.connect_timeout_ms.max(1000)),
    ));
    Ok(id)
}

/// Runs the router's timers: request expiry and queue re-checks.
async fn ticker(shared: Arc<Shared>) {
    loop {
        let next = shared
            .tick()
            .unwrap_or(Duration::MAX)
            .min(Duration::from_millis(250));
        tokio::time::sleep(next.max(Duration::from_millis(1))).await;
    }
}

async fn completions(State(app): State<Arc<App>>, req: Request) -> Response {
    generate(&app, Endpoint::Completions, req).await
}

async fn chat(State(app): State<Arc<App>>, req: Request) -> Response {
    generate(&app, Endpoint::Chat, req).await
}

/// Whether a request streams, as the metrics label it (`unary` until it is parsed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RequestKind {
    Unary,
    Stream,
}

/// How a generation request ended.
#[derive(Debug)]
enum Outcome {
    /// A worker answered (any status): its response streams back.
    Answered(RequestKind, Response),
    /// The proxy answered with an error: bad input, no worker, or a failed upstream.
    Failed(RequestKind, ApiError),
}

impl Outcome {
    /// The metrics' `request_type` and `status` labels.
    fn labels(&self) -> (&'static str, &'static str) {
        let kind = |k: &RequestKind| match k {
            RequestKind::Unary => "unary",
            RequestKind::Stream => "stream",
        };
        match self {
            Self::Answered(k, r) if r.status().is_success() => (kind(k), "success"),
            Self::Answered(k, _) => (kind(k), "error"),
            Self::Failed(k, e) if e.status == StatusCode::SERVICE_UNAVAILABLE => (kind(k), "rejected"),
            Self::Failed(k, _) => (kind(k), "error"),
        }
    }

    fn into_response(self) -> Response {
        match self {
            Self::Answered(_, r) => r,
            Self::Failed(_, e) => e.into_response(),
        }
    }
}

async fn generate(app: &Arc<App>, endpoint: Endpoint, req: Request) -> Response {
    let outcome = handle(app, endpoint, req).await;
    let (request_type, status) = outcome.labels();
    app.shared
        .metrics
        .requests
        .with_label_values(&[endpoint.path(), request_type, status])
        .inc();
    outcome.into_response()
}

async fn handle(app: &Arc<App>, endpoint: Endpoint, req: Request) -> Outcome {
    let t0 = Instant::now();
    let config = &app.shared.config;
    let body = match Limited::new(req.into_body(), config.max_body_bytes)
        .collect()
        .await
    {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            let error = ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "body_too_large",
                format!("the request body exceeds {} bytes", config.max_body_bytes),
            );
            return Outcome::Failed(RequestKind::Unary, error);
        }
        Err(e) => {
            let error = ApiError::bad_request("body", format!("reading the body: {e}"));
            return Outcome::Failed(RequestKind::Unary, error);
        }
    };
    let parsed = match openai::parse(endpoint, &body, &app.model, config.max_prompt_tokens) {
        Ok(parsed) => parsed,
        Err(e) => return Outcome::Failed(RequestKind::Unary, e),
    };
    let kind = if parsed.stream {
        RequestKind::Stream
    } else {
        RequestKind::Unary
    };
    app.shared
        .metrics
        .overhead_tokenize
        .observe(t0.elapsed().as_secs_f64() * 1e3);
    // Internal fields stripped; a text completion sent as the token ids it is routed on.
    let body = match openai::engine_body(&parsed, &body) {
        Ok(rewritten) => rewritten.map_or(body, Bytes::from),
        Err(e) => return Outcome::Failed(kind, e),
    };
    let generation = Generation {
        endpoint,
        parsed: &parsed,
        body,
    };
    match app.forwarder.forward(&generation, t0).await {
        Ok(response) => Outcome::Answered(kind, response),
        Err(e) => Outcome::Failed(kind, e),
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(ModelList::one(app.shared.config.model_name.clone(), "kvroute")).into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.shared.any_routable() {
        (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "no_worker",
            "no worker is available",
        )
        .into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    app.shared.snapshot();
    let mut response = app.shared.metrics.render().into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

async fn list_workers(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({"workers": app.shared.worker_statuses()})).into_response()
}

async fn post_worker(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let config: WorkerConfig = match serde_json::from_slice(&body) {
        Ok(c) => c,
        Err(e) => return ApiError::bad_request("body", format!("not a worker: {e}")).into_response(),
    };
    match add_worker(&app, config) {
        Ok(id) => (StatusCode::CREATED, axum::Json(json!({"id": id.0}))).into_response(),
        Err(e) => ApiError::bad_request("body", e).into_response(),
    }
}

fn unknown_worker(id: &str) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "unknown_worker",
        format!("no worker {id}"),
    )
    .into_response()
}

async fn drain_worker(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match id.parse().ok().map(WorkerId) {
        Some(w) if app.shared.drain_worker(w) => {
            axum::Json(json!({"id": w.0, "draining": true})).into_response()
        }
        _ => unknown_worker(&id),
    }
}

async fn delete_worker(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    match id.parse().ok().map(WorkerId) {
        Some(w) if app.shared.remove_worker(w) => {
            app.feed.unsubscribe(w);
            axum::Json(json!({"id": w.0, "removed": true})).into_response()
        }
        _ => unknown_worker(&id),
    }
}

async fn not_found() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "not_found",
        "no such endpoint",
    )
    .into_response()
}
