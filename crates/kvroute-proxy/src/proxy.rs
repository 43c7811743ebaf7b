//! `kvroute serve`: the OpenAI-compatible proxy.
//!
//! A generation request is read (bounded), parsed and tokenized, routed by the router core, and
//! sent unchanged to the chosen worker; the worker's response streams back unchanged through an
//! `Observed` body that reports the first chunk (prefill done), the gaps between chunks, and
//! the end, error, timeout or disconnect that frees the request.
//!
//! A request the router disaggregates (its decision names a prefill worker) takes two hops, in
//! vLLM's disaggregated-prefill protocol ([`kvroute_http::disagg`]): a prefill-only request to the
//! prefill worker, read whole, then the client's request with the prefill's
//! `kv_transfer_params` to the decode worker, whose response streams back as above. The
//! prefill's answer is the router's first token (the prefill worker's load is freed then, as
//! the simulator does on the prefill engine's first token); the client's time to first token
//! is measured to hop 2's first chunk. A prefill worker that cannot be reached is taken out of
//! routing and the request routed once more, as for any worker; any other failure of hop 1
//! (non-2xx, a broken response, a timeout, or a second connect failure) ends the request with
//! an OpenAI-shaped 502 (504 on timeout).
//!
//! With `disagg_protocol = "sglang"` a disaggregated request is one body with SGLang's bootstrap
//! fields, sent to the prefill and the decode worker at once (`sglang_pair`); the decode
//! worker's response streams back as above.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Frame, Incoming, SizeHint};
use kvroute_core::ids::WorkerId;
use kvroute_core::router::Router;
use serde_json::json;
use tokio::time::Sleep;

use crate::config::{ConfigError, EngineKind, ServeConfig, WorkerConfig};
use crate::events::EventFeed;
use crate::metrics::Metrics;
use crate::state::{RequestGuard, RouteError, Shared, Upstream};
use kvroute_http::disagg;
use kvroute_http::model::Model;
use kvroute_http::net::{self, HttpClient, Shutdown};
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
    client: HttpClient,
    feed: EventFeed,
    /// This proxy's instance tag (its start time), which makes the request ids of the
    /// disaggregated flow unique across restarts.
    instance: u64,
}

impl App {
    /// The `X-Request-Id` both hops of the router's request `id` carry.
    fn request_id(&self, id: kvroute_core::ids::RequestId) -> String {
        format!("kvroute-{:x}-{}", self.instance, id.0)
    }
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
    let app = Arc::new(App {
        shared: Arc::clone(&shared),
        model,
        client: client.clone(),
        feed,
        instance: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    });
    for w in workers {
        add_worker(&app, w).map_err(ServeError::Worker)?;
    }
    let shutdown = Shutdown::new();
    let mut tasks = Vec::new();
    tasks.push(tokio::spawn(ticker(Arc::clone(&shared))));
    if shared.config.health_interval_ms > 0 {
        tasks.push(tokio::spawn(health_checks(Arc::clone(&shared), client)));
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

/// Checks every worker's `/health` periodically; enough failed checks in a row take it out of
/// routing, enough passing ones bring it back ([`Shared::record_check`]).
async fn health_checks(shared: Arc<Shared>, client: HttpClient) {
    let interval = ServeConfig::ms(shared.config.health_interval_ms);
    let timeout = ServeConfig::ms(shared.config.health_timeout_ms);
    loop {
        tokio::time::sleep(interval).await;
        for (id, base) in shared.worker_urls() {
            let ok = match hyper::Request::get(format!("{base}/health")).body(Full::new(Bytes::new())) {
                Ok(req) => matches!(
                    tokio::time::timeout(timeout, client.request(req)).await,
                    Ok(Ok(resp)) if resp.status().is_success()
                ),
                Err(_) => false,
            };
            shared.record_check(id, ok);
        }
    }
}

async fn completions(State(app): State<Arc<App>>, req: Request) -> Response {
    generate(&app, Endpoint::Completions, req).await
}

async fn chat(State(app): State<Arc<App>>, req: Request) -> Response {
    generate(&app, Endpoint::Chat, req).await
}

async fn generate(app: &Arc<App>, endpoint: Endpoint, req: Request) -> Response {
    let t0 = Instant::now();
    let (result, kind) = match handle(app, endpoint, req, t0).await {
        Ok((response, stream)) => (Ok(response), stream),
        Err((e, stream)) => (Err(e), stream),
    };
    let request_type = if kind { "stream" } else { "unary" };
    let (response, status) = match result {
        Ok(r) => {
            let status = if r.status().is_success() {
                "success"
            } else {
                "error"
            };
            (r, status)
        }
        Err(e) => {
            let status = if e.status == StatusCode::SERVICE_UNAVAILABLE {
                "rejected"
            } else {
                "error"
            };
            (e.into_response(), status)
        }
    };
    app.shared
        .metrics
        .requests
        .with_label_values(&[endpoint.path(), request_type, status])
        .inc();
    response
}

async fn handle(
    app: &Arc<App>,
    endpoint: Endpoint,
    req: Request,
    t0: Instant,
) -> Result<(Response, bool), (ApiError, bool)> {
    let config = &app.shared.config;
    let body = Limited::new(req.into_body(), config.max_body_bytes)
        .collect()
        .await
        .map_err(|e| {
            let err = if e.is::<http_body_util::LengthLimitError>() {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    "body_too_large",
                    format!("the request body exceeds {} bytes", config.max_body_bytes),
                )
            } else {
                ApiError::bad_request("body", format!("reading the body: {e}"))
            };
            (err, false)
        })?
        .to_bytes();
    let parsed =
        openai::parse(endpoint, &body, &app.model, config.max_prompt_tokens).map_err(|e| (e, false))?;
    let stream = parsed.stream;
    app.shared
        .metrics
        .overhead_tokenize
        .observe(t0.elapsed().as_secs_f64() * 1e3);
    forward(app, endpoint, &parsed, body, t0)
        .await
        .map(|r| (r, stream))
        .map_err(|e| (e, stream))
}

fn route_error(e: RouteError) -> ApiError {
    let (code, message) = match e {
        RouteError::NoWorker => ("no_worker", "no worker is available"),
        RouteError::QueueFull => ("overloaded", "every worker is busy and the queue is full"),
        RouteError::QueueTimeout => ("queue_timeout", "the request waited too long for a worker"),
    };
    ApiError {
        retry_after: Some(1),
        ..ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            code,
            message,
        )
    }
}

async fn forward(
    app: &Arc<App>,
    endpoint: Endpoint,
    parsed: &openai::Parsed,
    body: Bytes,
    t0: Instant,
) -> Result<Response, ApiError> {
    let shared = &app.shared;
    let timeout = ServeConfig::ms(shared.config.request_timeout_ms);
    for attempt in 0..2 {
        let (mut guard, target, _) = shared
            .route(&parsed.tokens, parsed.cache_salt.as_deref())
            .await
            .map_err(route_error)?;
        if attempt == 0 {
            shared
                .metrics
                .overhead_total
                .observe(t0.elapsed().as_secs_f64() * 1e3);
        }
        // A worker that cannot be reached (either worker of a disaggregated request) is out of
        // routing by then, and the first attempt routes the request again; any other failure
        // ends it. The guard, dropped either way, frees its load (so does a client leaving).
        let decode = &target.decode;
        let sent = match (&target.prefill, shared.config.disagg_protocol) {
            (None, _) => send(app, decode, endpoint, body.clone(), None, timeout).await,
            (Some(prefill), EngineKind::Vllm) => {
                let request_id = app.request_id(guard.id());
                match prefill_hop(app, endpoint, prefill, &body, &request_id, timeout).await {
                    Ok(params) => {
                        guard.prefill_done();
                        let hop2 = disagg::decode_body(&body, params)
                            .map_err(|e| ApiError::bad_request("body", e))?;
                        send(
                            app,
                            decode,
                            endpoint,
                            Bytes::from(hop2),
                            Some(&request_id),
                            timeout,
                        )
                        .await
                    }
                    Err(e) => Err(e),
                }
            }
            (Some(prefill), EngineKind::Sglang) => {
                sglang_pair(app, endpoint, prefill, decode, &mut guard, &body, timeout).await
            }
        };
        match sent {
            Ok(response) => {
                let (parts, incoming) = response.into_parts();
                let body = Observed {
                    inner: incoming,
                    guard: Some(guard),
                    streaming: parsed.stream,
                    idle: Box::pin(tokio::time::sleep(timeout)),
                    timeout,
                };
                let mut out = Response::new(Body::new(body));
                *out.status_mut() = parts.status;
                if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
                    out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
                }
                return Ok(out);
            }
            Err(HopError::Connect(_)) if attempt == 0 => {
                shared.metrics.upstream_retries.inc();
                continue;
            }
            Err(HopError::Connect(e) | HopError::Failed(e)) => return Err(e),
        }
    }
    Err(route_error(RouteError::NoWorker))
}

/// A POST of `body` to `upstream`'s `endpoint`, naming its data-parallel rank as its engine
/// reads it (vLLM's header, SGLang's body field) and, for the requests of a disaggregated one,
/// their shared request id.
fn upstream_request(
    upstream: &Upstream,
    endpoint: Endpoint,
    mut body: Bytes,
    request_id: Option<&str>,
) -> Result<hyper::Request<Full<Bytes>>, ApiError> {
    let mut builder = hyper::Request::post(format!("{}{}", upstream.base, endpoint.path()))
        .header(header::CONTENT_TYPE, "application/json");
    if upstream.dp {
        match upstream.engine {
            EngineKind::Vllm => builder = builder.header("x-data-parallel-rank", upstream.dp_rank),
            EngineKind::Sglang => {
                body = disagg::with_field(&body, "data_parallel_rank", upstream.dp_rank.into())
                    .map(Bytes::from)
                    .map_err(|e| ApiError::bad_request("body", e))?;
            }
        }
    }
    if let Some(id) = request_id {
        builder = builder.header(disagg::REQUEST_ID, id);
    }
    builder.body(Full::new(body)).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "bad_worker_url",
            e.to_string(),
        )
    })
}

/// The largest prefill response read (one token, and the KV's block ids).
const MAX_PREFILL_RESPONSE: usize = 16 << 20;

/// How sending to a worker failed: before it was reached (the worker is out of routing and the
/// request may be routed again), or after.
enum HopError {
    Connect(ApiError),
    Failed(ApiError),
}

/// Sends `body` to the worker that answers the client and returns its response once its
/// headers arrive (within `timeout`). A connect failure takes the worker out of routing.
async fn send(
    app: &App,
    upstream: &Upstream,
    endpoint: Endpoint,
    body: Bytes,
    request_id: Option<&str>,
    timeout: Duration,
) -> Result<hyper::Response<Incoming>, HopError> {
    let request = upstream_request(upstream, endpoint, body, request_id).map_err(HopError::Failed)?;
    match tokio::time::timeout(timeout, app.client.request(request)).await {
        Err(_) => Err(HopError::Failed(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "timeout",
            "the worker did not answer in time",
        ))),
        Ok(Err(e)) if e.is_connect() => {
            tracing::warn!(worker = upstream.worker.0, error = %e, "worker unreachable; out of routing");
            app.shared.mark_unreachable(upstream.worker);
            Err(HopError::Connect(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "upstream_failed",
                format!("the worker {} cannot be reached: {e}", upstream.base),
            )))
        }
        Ok(Err(e)) => Err(HopError::Failed(ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_failed",
            format!("the worker failed: {e}"),
        ))),
        Ok(Ok(response)) => Ok(response),
    }
}

/// vLLM's hop 1: the prefill-only request to `prefill`; returns the `kv_transfer_params` its
/// response carries.
async fn prefill_hop(
    app: &Arc<App>,
    endpoint: Endpoint,
    prefill: &Upstream,
    body: &[u8],
    request_id: &str,
    timeout: Duration,
) -> Result<Option<serde_json::Value>, HopError> {
    let hop = disagg::prefill_body(body).map_err(|e| HopError::Failed(ApiError::bad_request("body", e)))?;
    let request =
        upstream_request(prefill, endpoint, Bytes::from(hop), Some(request_id)).map_err(HopError::Failed)?;
    let answer = prefill_exchange(Arc::clone(app), prefill.clone(), request, timeout).await?;
    Ok(disagg::kv_transfer_params(&answer))
}

/// SGLang's pair: one body with the bootstrap fields to `prefill` and `decode` at once. The
/// decode worker's response is the client's. Whichever comes first decides: the prefill
/// worker's answer (it prefilled; the router frees its share, and the decode worker's headers
/// are awaited), a failed prefill (the decode request is dropped, which cancels it), or the
/// decode worker's headers (a streaming decode answers before its KV arrives; the prefill
/// worker's answer is then read and dropped in the background, and its failure only logged:
/// the decode stream fails or times out on its own), or a failed decode request (the prefill
/// request is dropped with it).
async fn sglang_pair(
    app: &Arc<App>,
    endpoint: Endpoint,
    prefill: &Upstream,
    decode: &Upstream,
    guard: &mut RequestGuard,
    body: &[u8],
    timeout: Duration,
) -> Result<hyper::Response<Incoming>, HopError> {
    let request_id = app.request_id(guard.id());
    let room = disagg::bootstrap_room(app.instance, guard.id().0);
    let host = disagg::host_of(&prefill.base);
    let both = disagg::bootstrap_body(body, &host, prefill.bootstrap_port, room)
        .map_err(|e| HopError::Failed(ApiError::bad_request("body", e)))?;
    let both = Bytes::from(both);
    let request =
        upstream_request(prefill, endpoint, both.clone(), Some(&request_id)).map_err(HopError::Failed)?;
    let mut prefill_side = Box::pin(prefill_exchange(
        Arc::clone(app),
        prefill.clone(),
        request,
        timeout,
    ));
    let decode_side = send(app, decode, endpoint, both, Some(&request_id), timeout);
    tokio::pin!(decode_side);
    tokio::select! {
        answer = &mut prefill_side => {
            answer?;
            guard.prefill_done();
            decode_side.await
        }
        response = &mut decode_side => {
            // A failed decode side drops the prefill side too (its KV would wait for nobody).
            if response.is_ok() {
                let worker = prefill.worker;
                tokio::spawn(async move {
                    if let Err(HopError::Connect(e) | HopError::Failed(e)) = prefill_side.await {
                        tracing::warn!(worker = worker.0, error = %e.message, "the prefill side of an SGLang pair failed");
                    }
                });
            }
            response
        }
    }
}

/// Sends a prefill request and reads its answer whole within `timeout`; a non-2xx answer is an
/// error naming the worker. A connect failure also takes the worker out of routing (health
/// checks bring it back). Owns what it uses, so it can finish in the background.
async fn prefill_exchange(
    app: Arc<App>,
    prefill: Upstream,
    request: hyper::Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<Bytes, HopError> {
    let failed = |message: String| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "prefill_failed",
            format!("the prefill worker {}: {message}", prefill.base),
        )
    };
    let exchange = async {
        let response = app.client.request(request).await.map_err(|e| {
            let error = failed(format!("request failed: {e}"));
            if e.is_connect() {
                tracing::warn!(worker = prefill.worker.0, error = %e, "prefill worker unreachable; out of routing");
                app.shared.mark_unreachable(prefill.worker);
                HopError::Connect(error)
            } else {
                HopError::Failed(error)
            }
        })?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_PREFILL_RESPONSE)
            .collect()
            .await
            .map_err(|e| HopError::Failed(failed(format!("reading the response: {e}"))))?
            .to_bytes();
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes);
            let text: String = text.chars().take(300).collect();
            return Err(HopError::Failed(failed(format!("answered {status}: {text}"))));
        }
        Ok(bytes)
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err(HopError::Failed(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "prefill_timeout",
            format!("the prefill worker {} did not answer in time", prefill.base),
        ))),
    }
}

/// The worker's response body, passed through unchanged while it reports to the request's guard.
struct Observed {
    inner: Incoming,
    guard: Option<RequestGuard>,
    streaming: bool,
    idle: Pin<Box<Sleep>>,
    timeout: Duration,
}

/// The error a client sees when the worker's response breaks off.
#[derive(Debug, thiserror::Error)]
enum StreamError {
    #[error("the worker's response failed: {0}")]
    Upstream(#[from] hyper::Error),
    #[error("the worker went silent for longer than the request timeout")]
    Timeout,
}

impl hyper::body::Body for Observed {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data()
                    && let Some(guard) = &mut this.guard
                {
                    guard.chunk(this.streaming);
                    if this.streaming {
                        let deadline = tokio::time::Instant::now() + this.timeout;
                        this.idle.as_mut().reset(deadline);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.guard.take();
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                if let Some(guard) = this.guard.take() {
                    guard.finish();
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.guard.is_some() && this.idle.as_mut().poll(cx).is_ready() {
                    this.guard.take();
                    return Poll::Ready(Some(Err(StreamError::Timeout)));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.guard.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{"id": app.shared.config.model_name, "object": "model", "created": 0, "owned_by": "kvroute"}],
    }))
    .into_response()
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
        Some(w) if app.shared.remove_worker(w).is_some() => {
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
