//! `kvroute serve`: the OpenAI-compatible proxy's HTTP front.
//!
//! [`start`] binds, adds the configured workers, and starts their KV-event subscribers
//! ([`crate::events`]), discovery's sources ([`crate::discovery`]), the health prober
//! ([`crate::health`]) and the router's timers. A
//! generation request is read (bounded), parsed and tokenized here, then forwarded in its flow
//! ([`crate::flow`]); its outcome is counted by endpoint, type and cause when it ends (here if
//! the proxy answers it, by the observed body if a worker does). The rest are `/v1/models`,
//! `/health` and `/metrics`. The admin API ([`crate::admin`]) is served on a listener of its own.
//!
//! Every response carries an `x-request-id` (the client's, or one made here) that each log line
//! of the request names; every error body is OpenAI's shape. With `api-key` set, `/v1/...` needs
//! one of the keys as a bearer token (401 otherwise); `/health` and `/metrics` need none.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kvroute_core::router::Router;
use kvroute_core::router::WorkerRole;
use serde_json::json;
use tracing::Instrument;

use crate::app::{App, Stack, read_body};
use crate::config::{ConfigError, ServeConfig, TokenizerSource};
use crate::driver::Driver;
use crate::events::EventFeed;
use crate::fleet::Fleet;
use crate::flow::{Forwarder, Generation};
use crate::metrics::Metrics;
use crate::observed::{Report, Shape};
use crate::outcome::{RequestKind, RequestOutcome};
use crate::tenants::Tenants;
use kvroute_http::model::Model;

use crate::admin::{bearer, same_secret, unauthorized};
use crate::health::Checker;
use kvroute_http::net::{self, Shutdown};
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
    /// A listener could not be bound.
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
    /// Replica sync did not start.
    #[error("replica sync: {0}")]
    Sync(String),
    /// Discovery did not start (its resolver could not be made).
    #[error("discovery: {0}")]
    Discovery(String),
}

/// A running proxy.
pub struct ProxyHandle {
    /// The address the inference API listens on.
    pub addr: SocketAddr,
    /// The address the admin API listens on.
    pub admin_addr: SocketAddr,
    /// The router driver (for tests and the demo: loads, invariants).
    pub driver: Arc<Driver>,
    /// The workers' one add and remove path.
    pub fleet: Arc<Fleet>,
    /// Each model's stack, in the configuration's order (`driver`, `fleet` and `planner` are
    /// the first's; with one model, the only ones).
    pub models: Vec<ModelHandle>,
    /// The planner's report, shown on `GET /admin/planner` (empty without a planner; see
    /// [`Self::start_planner`]).
    pub planner: Arc<crate::autoscale::Status>,
    shutdown: Shutdown,
    servers: Vec<tokio::task::JoinHandle<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for ProxyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyHandle")
            .field("addr", &self.addr)
            .field("admin_addr", &self.admin_addr)
            .finish_non_exhaustive()
    }
}

/// One model of a running proxy.
#[derive(Clone, Debug)]
pub struct ModelHandle {
    /// Its name.
    pub name: String,
    /// Its router driver.
    pub driver: Arc<Driver>,
    /// Its workers' add and remove path.
    pub fleet: Arc<Fleet>,
    /// Its planner's report (empty without a planner).
    pub planner: Arc<crate::autoscale::Status>,
}

impl ProxyHandle {
    /// Runs `planner` on this proxy's fleet (with several models, the first's; see
    /// [`Self::start_planner_for`]), its decisions carried out by `actuator`, until the proxy
    /// stops.
    pub fn start_planner(
        &mut self,
        planner: kvroute_planner::Planner,
        actuator: Arc<dyn crate::autoscale::Actuator>,
        settings: crate::autoscale::Settings,
    ) {
        let (fleet, status) = (Arc::clone(&self.fleet), Arc::clone(&self.planner));
        self.run_planner(fleet, status, planner, actuator, settings);
    }

    /// [`Self::start_planner`] on the fleet of the model named `model` (its pools, its
    /// metrics, its report under `GET /admin/planner`); false if no model has that name.
    pub fn start_planner_for(
        &mut self,
        model: &str,
        planner: kvroute_planner::Planner,
        actuator: Arc<dyn crate::autoscale::Actuator>,
        settings: crate::autoscale::Settings,
    ) -> bool {
        let Some(m) = self.model(model) else {
            return false;
        };
        let (fleet, status) = (Arc::clone(&m.fleet), Arc::clone(&m.planner));
        self.run_planner(fleet, status, planner, actuator, settings);
        true
    }

    /// Starts the planner task on `fleet`, reporting into `status`.
    fn run_planner(
        &mut self,
        fleet: Arc<Fleet>,
        status: Arc<crate::autoscale::Status>,
        planner: kvroute_planner::Planner,
        actuator: Arc<dyn crate::autoscale::Actuator>,
        settings: crate::autoscale::Settings,
    ) {
        let task = crate::autoscale::start(fleet, planner, actuator, settings, status);
        self.tasks.push(task);
    }

    /// The model named `model`.
    pub fn model(&self, model: &str) -> Option<&ModelHandle> {
        self.models.iter().find(|m| m.name == model)
    }

    /// The driver of the model named `model`.
    pub fn driver_of(&self, model: &str) -> Option<&Arc<Driver>> {
        self.model(model).map(|m| &m.driver)
    }

    /// The base URL, `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The admin API's base URL, `http://admin_addr`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin_addr)
    }

    /// Stops the proxy: the listeners, every connection and the background tasks.
    pub fn stop(&self) {
        self.shutdown.stop();
        for m in &self.models {
            m.driver.stop_sync();
            m.driver.stop_subscribers();
        }
        for t in self.tasks.iter().chain(&self.servers) {
            t.abort();
        }
    }

    /// Shuts down gracefully: stops accepting, lets every request in flight finish (streams
    /// to their end) for up to `patience`, then stops. True if everything finished in time.
    pub async fn drain(mut self, patience: Duration) -> bool {
        self.shutdown.drain();
        let servers = std::mem::take(&mut self.servers);
        let finished = tokio::time::timeout(patience, async {
            for server in servers {
                let _ = server.await;
            }
        })
        .await
        .is_ok();
        self.stop();
        finished
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
/// directory; with `[[model]]` tables each model loads its own), binds, adds the configured
/// workers and starts their event subscribers, health checks and the router's timers: one
/// stack of these per model ([`ServeConfig::stacks`]).
pub async fn start(config: ServeConfig, model: Option<Arc<Model>>) -> Result<ProxyHandle, ServeError> {
    config.validate()?;
    let several = !config.models.is_empty();
    let bind = |addr| async move {
        net::bind(addr)
            .await
            .map_err(|source| ServeError::Bind { addr, source })
    };
    let (listener, addr) = bind(config.listen_addr()?).await?;
    let (admin_listener, admin_addr) = bind(config.admin_listen_addr()?).await?;
    let timeouts = config.conn_timeouts();
    let client = net::client(ServeConfig::ms(config.upstream.connect_timeout_ms));
    let instance = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    // With several models, the tenants' metrics are no model's.
    let shared_metrics = several.then(prometheus::Registry::new);
    let ids = Arc::new(AtomicU64::new(0));
    let mut built = Vec::new();
    for stack in config.stacks()? {
        let mut router_config = stack.validate()?;
        // A fresh replica id per run: a restarted replica's request ids start over.
        router_config.router_id = kvroute_sync::fresh_router_id();
        let replica = router_config.router_id;
        let router = Router::new(router_config).map_err(ConfigError::from)?;
        let model = match (&model, several) {
            (Some(m), false) => Arc::clone(m),
            _ => Arc::new(match stack.tokenizer()? {
                TokenizerSource::Dir(dir) => Model::load(dir)?,
                TokenizerSource::BuiltIn => Model::tiny()?,
            }),
        };
        model.chat_cache().set_limit(stack.model.tokenizer_cache_bytes);
        let metrics = match several {
            true => Metrics::labelled(&stack.model.model_name),
            false => Metrics::new(),
        };
        let driver = Driver::numbering_from(router, stack, metrics, Arc::clone(&ids));
        driver.metrics.register(model.chat_cache().collector());
        let feed = EventFeed::start(Arc::clone(&driver));
        let checker = Checker {
            client: client.clone(),
            model: Arc::clone(&model),
        };
        let fleet = Arc::new(Fleet::new(Arc::clone(&driver), feed, checker));
        built.push((driver, model, fleet, replica));
    }
    let Some((driver, _, fleet, _)) = built.first() else {
        return Err(ConfigError::Invalid {
            field: "model".to_owned(),
            message: "no model to serve".to_owned(),
        }
        .into());
    };
    let (driver, fleet) = (Arc::clone(driver), Arc::clone(fleet));
    let tenants = Arc::new(match &shared_metrics {
        Some(registry) => Tenants::registered_in(&config.tenants, registry),
        None => Tenants::new(&config.tenants, &driver.metrics),
    });
    let mut stacks = Vec::new();
    let mut replicas = Vec::new();
    for (driver, model, fleet, replica) in built {
        let forwarder = Arc::new(Forwarder {
            driver: Arc::clone(&driver),
            client: client.clone(),
            tenants: Arc::clone(&tenants),
            instance,
        });
        replicas.push(replica);
        stacks.push(Stack {
            driver,
            model,
            forwarder,
            fleet,
            planner: Arc::default(),
        });
    }
    let app = Arc::new(App {
        driver: Arc::clone(&driver),
        stacks,
        tenants,
        shared_metrics,
        admin: tokio::sync::Mutex::new(()),
        request_id_prefix: format!("kvr-{instance:x}-"),
        next_request_id: AtomicU64::new(0),
    });
    for stack in &app.stacks {
        for w in stack.driver.config.workers.clone() {
            stack.fleet.add(w).map_err(ServeError::Worker)?;
        }
    }
    // Workers that name no model, with several: each joins the model its `/v1/models` lists.
    for w in config.unpinned_workers() {
        let stack = app.stack_for_worker(&w).await.map_err(ServeError::Worker)?;
        stack.fleet.add(w).map_err(ServeError::Worker)?;
    }
    // Join the replicas (with `nats`) before serving: the first request sees their load.
    for (stack, replica) in app.stacks.iter().zip(replicas) {
        crate::replicas::start(&stack.fleet, replica)
            .await
            .map_err(ServeError::Sync)?;
    }
    let shutdown = Shutdown::new();
    let mut tasks = Vec::new();
    for stack in &app.stacks {
        tasks.push(tokio::spawn(ticker(Arc::clone(&stack.driver))));
    }
    // Workers found rather than listed, once the listed ones and the peers' are in; each
    // joins its model's fleet.
    if let Some(spec) = driver.config.discovery()? {
        let fleets: Vec<Arc<Fleet>> = app.stacks.iter().map(|s| Arc::clone(&s.fleet)).collect();
        tasks.extend(crate::discovery::start(&fleets, &spec).map_err(ServeError::Discovery)?);
    }
    if driver.config.upstream.health_interval_ms > 0 {
        for stack in &app.stacks {
            tasks.push(tokio::spawn(crate::health::run(
                Arc::clone(&stack.driver),
                stack.fleet.checker().clone(),
            )));
        }
    }
    let mut inference = axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_card));
    // Without keys every request passes: no layer then (one costs a service clone and a boxed
    // future per request).
    if !app.driver.config.server.api_key.is_empty() {
        inference = inference.route_layer(middleware::from_fn_with_state(Arc::clone(&app), inference_auth));
    }
    let inference = inference
        .route("/health", get(health))
        .route("/metrics", get(metrics));
    let admin = crate::admin::routes(&app);
    let servers = vec![
        tokio::spawn(net::serve_with(
            listener,
            with_common_layers(inference, &app),
            shutdown.clone(),
            timeouts,
        )),
        tokio::spawn(net::serve_with(
            admin_listener,
            with_common_layers(admin, &app),
            shutdown.clone(),
            timeouts,
        )),
    ];
    tracing::info!(%addr, %admin_addr, "listening (admin API on its own listener)");
    let models: Vec<ModelHandle> = app
        .stacks
        .iter()
        .map(|s| ModelHandle {
            name: s.name().to_owned(),
            driver: Arc::clone(&s.driver),
            fleet: Arc::clone(&s.fleet),
            planner: Arc::clone(&s.planner),
        })
        .collect();
    let planner = Arc::clone(&app.first().planner);
    Ok(ProxyHandle {
        addr,
        admin_addr,
        driver,
        fleet,
        models,
        planner,
        shutdown,
        servers,
        tasks,
    })
}

/// What both listeners share: OpenAI-shaped 404 and 405, and the request id.
fn with_common_layers(routes: axum::Router<Arc<App>>, app: &Arc<App>) -> axum::Router {
    routes
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(Arc::clone(app), request_id))
        .with_state(Arc::clone(app))
}

/// The header that names a request, in and out.
const REQUEST_ID: &str = "x-request-id";

/// Names the request (the client's `x-request-id` if it is a sane one, else one made here),
/// runs it in a span carrying that id, so every log line of it names it, and sends the id back.
async fn request_id(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned);
    let id = given.unwrap_or_else(|| {
        let n = app.next_request_id.fetch_add(1, Ordering::Relaxed);
        made_request_id(&app.request_id_prefix, n)
    });
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %request.method(),
        path = %request.uri().path()
    );
    let mut response = next.run(request).instrument(span).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert(REQUEST_ID, value);
    }
    response
}

/// The id made for the `n`th request without one: `prefix` (`kvr-{instance tag in hex}-`,
/// written once) and `n`.
fn made_request_id(prefix: &str, n: u64) -> String {
    let mut id = String::with_capacity(prefix.len() + 20);
    id.push_str(prefix);
    let _ = write!(id, "{n}");
    id
}

/// The inference API's keys: with `api-key` set, a request needs one of them or a tenant's
/// (the layer is only added then).
async fn inference_auth(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    let keys = &app.driver.config.server.api_key;
    let token = bearer(request.headers());
    if keys.is_empty()
        || token.is_some_and(|t| keys.iter().any(|k| same_secret(k, t)) || app.tenants.is_key(t))
    {
        next.run(request).await
    } else {
        unauthorized("a valid API key is required (Authorization: Bearer KEY)")
    }
}

/// Runs the router's timers: request expiry and queue re-checks.
async fn ticker(driver: Arc<Driver>) {
    loop {
        let next = driver
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
        self.metrics.record_outcome(self.endpoint, self.kind, outcome);
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
        metrics: &app.driver.metrics,
        endpoint,
        kind: RequestKind::Unary,
        answered: false,
    };
    let mut response = match handle(app, endpoint, req, &mut unanswered).await {
        Outcome::Answered(response) => {
            unanswered.answered = true;
            response
        }
        Outcome::Failed(kind, error) => {
            unanswered.kind = kind;
            unanswered.record(failed_outcome(&error));
            error.into_response()
        }
    };
    if response.status() == StatusCode::REQUEST_TIMEOUT {
        // The rest of the body may never come: do not wait for it on this connection.
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// The model a body names, read without parsing the rest (`None` for a body that is no JSON
/// object or names none: the parse that follows says what is wrong).
fn named_model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
}

async fn handle<'a>(
    app: &'a Arc<App>,
    endpoint: Endpoint,
    req: Request,
    unanswered: &mut Unanswered<'a>,
) -> Outcome {
    let t0 = Instant::now();
    let config = &app.driver.config;
    let authorization = req.headers().get(header::AUTHORIZATION).cloned();
    let headers = req.headers().clone();
    let session = config
        .routing
        .session_header
        .as_deref()
        .and_then(|name| headers.get(name))
        .filter(|v| !v.is_empty())
        .map(|v| kvroute_core::router::SessionId::from_header(v.as_bytes()));
    let body = match read_body(config, req.into_body(), config.limits.max_body_bytes).await {
        Ok(body) => body,
        Err(e) => return Outcome::Failed(RequestKind::Unary, e),
    };
    // With several models, the one the body names (or its adapter's) serves it, tokenizes it
    // and counts it; none named, the first.
    let stack = match &app.stacks[..] {
        [only] => only,
        stacks => match named_model(&body) {
            None => &stacks[0],
            Some(name) => match app.stack_serving(&name) {
                Some(stack) => stack,
                None => return Outcome::Failed(RequestKind::Unary, model_not_found(&name)),
            },
        },
    };
    unanswered.metrics = &stack.driver.metrics;
    let mut parsed = match openai::parse(endpoint, &body, &stack.model, config.limits.max_prompt_tokens) {
        Ok(parsed) => parsed,
        Err(e) => return Outcome::Failed(RequestKind::Unary, e),
    };
    let kind = if parsed.stream {
        RequestKind::Stream
    } else {
        RequestKind::Unary
    };
    unanswered.kind = kind;
    if let Some(model) = &parsed.model
        && *model != stack.name()
        && !stack.driver.serves_adapter(model)
    {
        return Outcome::Failed(kind, model_not_found(model));
    }
    stack
        .driver
        .metrics
        .overhead_tokenize
        .observe(t0.elapsed().as_secs_f64() * 1e3);
    let class = match app.tenants.classify(&headers, bearer(&headers), &parsed) {
        Ok(class) => class,
        Err(e) => return Outcome::Failed(kind, e),
    };
    let asked = parsed.tokens.len() as u64 + u64::from(parsed.max_tokens.unwrap_or(0));
    if let Err(e) = app.tenants.admit(&class, asked) {
        return Outcome::Failed(kind, e);
    }
    // The salt the engine hashes by, which the router hashes by too: the tenant's namespace
    // joined to the client's.
    let salt = app.tenants.cache_salt(&class, parsed.cache_salt.as_deref());
    let body = match app.tenants.engine_body(&class, &parsed, salt.as_deref(), body) {
        Ok(body) => body,
        Err(e) => return Outcome::Failed(kind, e),
    };
    parsed.cache_salt = salt;
    let shape = match parsed.stream {
        false => Shape::Unary,
        true => Shape::Stream {
            strip_usage: parsed.usage_requested_for_client(),
        },
    };
    // The client's credential goes on to the engine, unless it was kvroute's own API key or a
    // tenant's.
    let tenant_key = bearer(&headers).is_some_and(|t| app.tenants.is_key(t));
    let authorization = authorization.filter(|_| config.server.api_key.is_empty() && !tenant_key);
    // The client's body: made the engine's once routed (`Forwarder::forward`).
    let generation = Generation {
        endpoint,
        parsed: &parsed,
        body,
        report: Report {
            endpoint,
            shape,
            debug_headers: config.server.debug_headers,
        },
        authorization,
        session,
        class,
    };
    match stack.forwarder.forward(&generation, t0).await {
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

/// Every model's list, one after another: each model, then its adapters.
fn model_list(app: &App) -> kvroute_http::openai::types::ModelList {
    let mut stacks = app.stacks.iter();
    let mut list = crate::adapters::model_list(&app.first().driver);
    stacks.next();
    for stack in stacks {
        list.data.extend(crate::adapters::model_list(&stack.driver).data);
    }
    list
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(model_list(&app)).into_response()
}

/// `GET /v1/models/{id}`: the model object, or OpenAI's 404.
async fn model_card(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let list = model_list(&app);
    match list.data.into_iter().find(|card| card.id == id) {
        Some(card) => axum::Json(card).into_response(),
        None => model_not_found(&id).into_response(),
    }
}

async fn health(State(app): State<Arc<App>>) -> Response {
    // Healthy when a request can be served: some worker in routing decodes (of any model).
    let serving = app.stacks.iter().any(|s| {
        s.driver
            .worker_statuses()
            .iter()
            .any(|w| w.routable && w.config.role() != WorkerRole::Prefill)
    });
    // With replica sync, whether the peers are heard (routing goes on either way): each model
    // syncs on its own subject, so the link reported is the worst, and each model's beside it
    // when there are several.
    let links: Vec<(&str, kvroute_sync::LinkState)> = app
        .stacks
        .iter()
        .filter_map(|s| Some((s.name(), s.driver.sync_link()?)))
        .collect();
    let sync = links
        .iter()
        .map(|&(_, link)| link)
        .max_by_key(|&link| link == kvroute_sync::LinkState::Disconnected)
        .map(kvroute_sync::LinkState::name);
    // With `when-empty = queue` requests wait for a worker (a fleet scaled to zero starts one):
    // the proxy takes them, so it is ready.
    let waits = !serving && app.driver.queues_when_empty();
    if serving || waits {
        let mut body = json!({"status": "ok"});
        if let Some(sync) = sync {
            body["sync"] = json!(sync);
        }
        if app.stacks.len() > 1 && !links.is_empty() {
            let per_model: serde_json::Map<String, serde_json::Value> = links
                .iter()
                .map(|&(name, link)| (name.to_owned(), json!(link.name())))
                .collect();
            body["sync_models"] = serde_json::Value::Object(per_model);
        }
        if waits {
            body["workers"] = json!("none routable: requests wait in the queue");
        }
        (StatusCode::OK, axum::Json(body)).into_response()
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
    let mut queued = std::collections::BTreeMap::new();
    let mut counters = std::collections::BTreeMap::new();
    for stack in &app.stacks {
        stack.driver.snapshot();
        crate::autoscale::removal::refresh_gauges(&stack.driver);
        for (t, n) in stack.driver.queued_per_tenant() {
            *queued.entry(t).or_insert(0) += n;
        }
        for (t, c) in stack.driver.fair_counters() {
            *counters.entry(t).or_insert(0.0) += c;
        }
    }
    let queued: Vec<_> = queued.into_iter().collect();
    let counters: Vec<_> = counters.into_iter().collect();
    app.tenants.refresh(&queued, &counters);
    let text = match &app.shared_metrics {
        None => app.driver.metrics.render(),
        Some(shared) => {
            let registries: Vec<&prometheus::Registry> = std::iter::once(shared)
                .chain(app.stacks.iter().map(|s| s.driver.metrics.registry()))
                .collect();
            crate::metrics::render_together(&registries)
        }
    };
    let mut response = text.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

async fn method_not_allowed() -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method_not_allowed",
        "this endpoint does not take that method",
    )
    .into_response()
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
    fn a_made_request_id_is_the_instance_tag_in_hex_and_the_count() {
        for (instance, n) in [(0u64, 0u64), (0x1a2b, 7), (u64::MAX, u64::MAX), (1 << 60, 12345)] {
            assert_eq!(
                made_request_id(&format!("kvr-{instance:x}-"), n),
                format!("kvr-{instance:x}-{n}")
            );
        }
    }
}
