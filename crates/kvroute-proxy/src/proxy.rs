//! `kvroute serve`: the OpenAI-compatible proxy's HTTP front.
//!
//! [`start`] binds, adds the configured workers, and starts their KV-event subscribers
//! ([`crate::events`]), the health prober ([`crate::health`]) and the router's timers. A
//! generation request is read (bounded), parsed and tokenized here, then forwarded in its flow
//! ([`crate::flow`]); its outcome is counted by endpoint, type and cause when it ends (here if
//! the proxy answers it, by the observed body if a worker does). The rest are
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

use crate::config::{ConfigError, ServeConfig, TokenizerSource, WorkerConfig};
use crate::driver::Shared;
use crate::events::EventFeed;
use crate::flow::{Forwarder, Generation};
use crate::metrics::{Metrics, RequestKind, RequestOutcome};
use crate::observed::{Report, Shape};
use kvroute_http::model::Model;

use crate::checks::Checker;
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
    checker: Checker,
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
        None => Arc::new(match config.tokenizer()? {
            TokenizerSource::Dir(dir) => Model::load(dir)?,
            TokenizerSource::BuiltIn => Model::tiny()?,
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
        checker: Checker {
            client: client.clone(),
            model: Arc::clone(&model),
        },
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
        tasks.push(tokio::spawn(crate::health::run(Arc::clone(&shared), app.checker.clone())));
    }
    let routes = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_card))
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
    app.checker.spawn(&app.shared, id);
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

/// How a generation request ended, as far as the handler sees it.
#[derive(Debug)]
enum Outcome {
    /// A worker answered (any status): its response streams back, and its observed body
    /// counts the request's outcome when it ends ([`crate::observed`]).
    Answered(Response),
    /// The proxy answered with an error: bad input, no worker, or a failed upstream.
    Failed(RequestKind, ApiError),
}

/// The outcome of a request the proxy answered with `error`.
fn failed_outcome(error: &ApiError) -> RequestOutcome {
    match error.status {
        StatusCode::SERVICE_UNAVAILABLE => RequestOutcome::Rejected,
        StatusCode::GATEWAY_TIMEOUT => RequestOutcome::Timeout,
        s if s.is_client_error() => RequestOutcome::BadRequest,
        _ => RequestOutcome::UpstreamError,
    }
}

/// A request not yet answered: counted as `client_cancelled` if its handler is dropped (the
/// client left) before it is.
struct Unanswered<'a> {
    metrics: &'a Metrics,
    endpoint: Endpoint,
    kind: RequestKind,
    answered: bool,
}

impl Unanswered<'_> {
    fn record(&mut self, outcome: RequestOutcome) {
        self.answered = true;
        self.metrics
            .record_outcome(self.endpoint.path(), self.kind, outcome);
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.record(RequestOutcome::ClientCancelled);
        }
    }
}

async fn generate(app: &Arc<App>, endpoint: Endpoint, req: Request) -> Response {
    let mut unanswered = Unanswered {
        metrics: &app.shared.metrics,
        endpoint,
        kind: RequestKind::Unary,
        answered: false,
    };
    match handle(app, endpoint, req, &mut unanswered.kind).await {
        Outcome::Answered(response) => {
            unanswered.answered = true;
            response
        }
        Outcome::Failed(kind, error) => {
            unanswered.kind = kind;
            unanswered.record(failed_outcome(&error));
            error.into_response()
        }
    }
}

/// The body to forward: the client's, but a stream whose client did not ask for usage asks
/// for it (`stream_options.include_usage`), so that the engine's final usage chunk reports
/// its cached tokens for every streamed request; the proxy takes that chunk out again
/// ([`Shape::Stream`]). Without it, streamed requests (most traffic) would never report
/// cached tokens. `None` if the body is forwarded as it is.
fn with_usage_requested(body: &[u8]) -> Option<Bytes> {
    let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let obj = value.as_object_mut()?;
    let options = obj.entry("stream_options").or_insert_with(|| json!({}));
    if options.is_null() {
        *options = json!({});
    }
    options
        .as_object_mut()?
        .insert("include_usage".to_owned(), serde_json::Value::Bool(true));
    serde_json::to_vec(&value).ok().map(Bytes::from)
}

async fn handle(app: &Arc<App>, endpoint: Endpoint, req: Request, kind_seen: &mut RequestKind) -> Outcome {
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
    *kind_seen = kind;
    if let Some(model) = &parsed.model
        && *model != config.model_name
    {
        return Outcome::Failed(kind, model_not_found(model));
    }
    app.shared
        .metrics
        .overhead_tokenize
        .observe(t0.elapsed().as_secs_f64() * 1e3);
    // Internal fields stripped; a text completion sent as the token ids it is routed on.
    let body = match openai::engine_body(&parsed, &body) {
        Ok(rewritten) => rewritten.map_or(body, Bytes::from),
        Err(e) => return Outcome::Failed(kind, e),
    };
    let (shape, body) = match (parsed.stream, parsed.include_usage) {
        (false, _) => (Shape::Unary, body),
        (true, true) => (Shape::Stream { strip_usage: false }, body),
        (true, false) => match with_usage_requested(&body) {
            Some(asked) => (Shape::Stream { strip_usage: true }, asked),
            None => (Shape::Stream { strip_usage: false }, body),
        },
    };
    let generation = Generation {
        endpoint,
        parsed: &parsed,
        body,
        report: Report {
            endpoint,
            shape,
            debug_headers: config.debug_headers,
        },
    };
    match app.forwarder.forward(&generation, t0).await {
        Ok(response) => Outcome::Answered(response),
        Err(e) => Outcome::Failed(kind, e),
    }
}

/// OpenAI's 404 for a model it does not serve.
fn model_not_found(model: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "model_not_found",
        format!("The model `{model}` does not exist or you do not have access to it."),
    )
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(ModelList::one(app.shared.config.model_name.clone(), "kvroute")).into_response()
}

/// `GET /v1/models/{id}`: the model object, or OpenAI's 404.
async fn model_card(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let name = &app.shared.config.model_name;
    if id != *name {
        return model_not_found(&id).into_response();
    }
    let mut list = ModelList::one(name.clone(), "kvroute");
    match list.data.pop() {
        Some(card) => axum::Json(card).into_response(),
        None => model_not_found(&id).into_response(),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_asks_for_usage_keeping_the_clients_other_stream_options() {
        // (client body, forwarded body)
        let table = [
            (
                json!({"stream": true}),
                json!({"stream": true, "stream_options": {"include_usage": true}}),
            ),
            (
                json!({"stream": true, "stream_options": null}),
                json!({"stream": true, "stream_options": {"include_usage": true}}),
            ),
            (
                json!({"stream": true, "stream_options": {"continuous_usage_stats": false}}),
                json!({"stream": true, "stream_options": {"continuous_usage_stats": false, "include_usage": true}}),
            ),
        ];
        for (body, want) in table {
            let out = with_usage_requested(&serde_json::to_vec(&body).unwrap()).unwrap();
            assert_eq!(
                serde_json::from_slice::<serde_json::Value>(&out).unwrap(),
                want,
                "{body}"
            );
        }
        assert!(with_usage_requested(b"[1]").is_none());
        assert!(with_usage_requested(br#"{"stream_options": 3}"#).is_none());
    }
}
