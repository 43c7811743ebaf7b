//! A generation request's way to its workers, once parsed: routed by the router core, then
//! sent in one of three flows, each its own function:
//!
//! * [`aggregated`]: one worker prefills and decodes; its response streams back.
//! * [`vllm_two_hops`]: vLLM's disaggregated prefill ([`kvroute_http::disagg`]): a
//!   prefill-only request to the prefill worker, read whole, then the client's request with the
//!   prefill's `kv_transfer_params` to the decode worker, whose response streams back. The
//!   prefill's answer is the router's first token (the prefill worker's load is freed then, as
//!   the simulator does on the prefill engine's first token); the client's time to first token
//!   is measured to hop 2's first chunk.
//! * [`sglang_pair`]: SGLang's bootstrap protocol: one body with the bootstrap fields, sent to
//!   the prefill and the decode worker at once; the decode worker's response streams back.
//!
//! A worker that cannot be reached (either worker of a disaggregated request) is taken out of
//! routing and the request routed once more; any other failure (non-2xx prefill, a broken
//! response, a timeout, or a second connect failure) ends the request with an OpenAI-shaped
//! 502 (504 on timeout). The response that streams back goes through an [`Observed`] body
//! that reports its chunks and its end to the request's guard, then through [`Coalesce`],
//! which hands the client the chunks already in as one frame.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use kvroute_http::disagg;
use kvroute_http::net::HttpClient;
use kvroute_http::openai::{self, ApiError, Endpoint, KvCacheReport};

use crate::coalesce::Coalesce;
use crate::config::{EngineKind, ServeConfig};
use crate::driver::{Driver, RequestGuard, RouteError, Target, Upstream};
use crate::observed::{self, Observed, Report};
use crate::worker::WorkerEvent;

/// What the flows need: the router driver, the pooled client, and this proxy's instance tag.
#[derive(Debug)]
pub struct Forwarder {
    /// The router driver.
    pub driver: Arc<Driver>,
    /// The pooled upstream client.
    pub client: HttpClient,
    /// The tenants, whose metrics count routed requests.
    pub tenants: Arc<crate::tenants::Tenants>,
    /// This proxy's instance tag (its start time), which makes the request ids of the
    /// disaggregated flows unique across restarts.
    pub instance: u64,
}

/// A generation request to forward: its endpoint, what parsing found, and its body.
#[derive(Debug)]
pub struct Generation<'a> {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The parsed request.
    pub parsed: &'a openai::Parsed,
    /// The client's body. Once routed, [`Forwarder::forward`] makes it the engine's
    /// ([`openai::engine_body`], for the workers chosen), which a flow adds to.
    pub body: Bytes,
    /// What the response's observed body reports under.
    pub report: Report,
    /// The client's `Authorization`, passed on to workers that have no credential of their
    /// own configured (None when it was kvroute's own API key).
    pub authorization: Option<axum::http::HeaderValue>,
    /// Its conversation, from the `session-header`.
    pub session: Option<kvroute_core::router::SessionId>,
    /// Its tenant and priority.
    pub class: crate::tenants::Class,
}

/// How sending to a worker failed: before it was reached (the worker is out of routing and the
/// request may be routed again), or after.
#[derive(Debug)]
pub enum HopError {
    /// The worker could not be reached.
    Connect(ApiError),
    /// Anything else.
    Failed(ApiError),
}

/// The largest prefill response read (one token, and the KV's block ids).
const MAX_PREFILL_RESPONSE: usize = 16 << 20;

/// The 503 of a request the router could not take.
pub fn route_error(e: RouteError) -> ApiError {
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

impl Forwarder {
    /// The `X-Request-Id` both sides of the router's request `id` carry.
    fn request_id(&self, id: kvroute_core::ids::RequestId) -> String {
        format!("kvroute-{:x}-{}", self.instance, id.0)
    }

    /// Routes `request` and sends it in its flow; the response streams back observed. A
    /// connect failure on the first attempt routes it once more (the guard, dropped either
    /// way, frees its load; so does a client leaving).
    pub async fn forward(
        self: &Arc<Self>,
        request: &Generation<'_>,
        t0: Instant,
    ) -> Result<Response, ApiError> {
        let driver = &self.driver;
        let timeout = ServeConfig::ms(driver.config.upstream.request_timeout_ms);
        // A model other than the base one is an adapter some worker serves (checked on
        // admission).
        let lora_name = (request.parsed.model.as_deref()).filter(|m| *m != driver.config.model.model_name);
        for attempt in 0..2 {
            let class = request.class;
            let (mut guard, target, decision) = driver
                .route_as(
                    &request.parsed.tokens,
                    request.parsed.cache_salt.as_deref(),
                    crate::driver::Routing {
                        lora_name,
                        tenant: class.tenant,
                        priority: class.router_priority(),
                        session: request.session,
                        turn: request.parsed.turn.as_ref(),
                    },
                )
                .await
                .map_err(route_error)?;
            self.tenants
                .routed(&class, request.parsed.tokens.len() as u64, decision.waited);
            if attempt == 0 {
                driver
                    .metrics
                    .overhead_total
                    .observe(t0.elapsed().as_secs_f64() * 1e3);
            }
            let routed = self.engine_request(request, &target)?;
            match self.send_in_flow(&routed, &target, &mut guard, timeout).await {
                Ok(response) => return Ok(observe(response, guard, request.report, timeout)),
                Err(HopError::Connect(_)) if attempt == 0 => driver.metrics.upstream_retries.inc(),
                Err(HopError::Connect(e) | HopError::Failed(e)) => return Err(e),
            }
        }
        Err(route_error(RouteError::NoWorker))
    }

    /// `request` as the engines of `target` get it: internal fields stripped, a text
    /// completion as its token ids, and vLLM's KV-event report mode set to `full` while a
    /// chosen worker's cache view is being rebuilt ([`crate::events`]).
    fn engine_request<'a>(
        &self,
        request: &Generation<'a>,
        target: &Target,
    ) -> Result<Generation<'a>, ApiError> {
        let full = std::iter::once(&target.decode)
            .chain(&target.prefill)
            .any(|upstream| upstream.kv_cache_report == KvCacheReport::Full);
        let report = if full {
            KvCacheReport::Full
        } else {
            KvCacheReport::Incremental
        };
        let body = openai::engine_body(request.parsed, &request.body, report)?
            .map_or_else(|| request.body.clone(), Bytes::from);
        Ok(Generation {
            endpoint: request.endpoint,
            parsed: request.parsed,
            body,
            report: request.report,
            authorization: request.authorization.clone(),
            session: request.session,
            class: request.class,
        })
    }

    /// Sends a routed request in the flow its target and the fleet's protocol call for.
    async fn send_in_flow(
        self: &Arc<Self>,
        request: &Generation<'_>,
        target: &Target,
        guard: &mut RequestGuard,
        timeout: Duration,
    ) -> Result<hyper::Response<Incoming>, HopError> {
        match (&target.prefill, self.driver.config.routing.disagg_protocol) {
            (None, _) => aggregated(self, request, &target.decode, timeout).await,
            (Some(prefill), EngineKind::Vllm) => {
                vllm_two_hops(self, request, prefill, &target.decode, guard, timeout).await
            }
            (Some(prefill), EngineKind::Sglang) => {
                sglang_pair(self, request, prefill, &target.decode, guard, timeout).await
            }
        }
    }
}

/// The worker's response, passed back with its status and content type (and the debug
/// headers, if configured), its body observed.
fn observe(
    response: hyper::Response<Incoming>,
    guard: RequestGuard,
    report: Report,
    timeout: Duration,
) -> Response {
    let (parts, incoming) = response.into_parts();
    let mut headers = axum::http::HeaderMap::new();
    observed::debug_headers(&report, &guard, &mut headers);
    let body = Observed::new(incoming, guard, report, parts.status, timeout);
    let mut out = Response::new(Body::new(Coalesce::new(body)));
    *out.status_mut() = parts.status;
    out.headers_mut().extend(headers);
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
    }
    out
}

/// The aggregated flow: the client's body to the one worker.
pub async fn aggregated(
    fwd: &Forwarder,
    request: &Generation<'_>,
    worker: &Upstream,
    timeout: Duration,
) -> Result<hyper::Response<Incoming>, HopError> {
    send(fwd, worker, request, request.body.clone(), None, timeout).await
}

/// vLLM's two hops: the prefill-only request to `prefill`, then the client's request with the
/// `kv_transfer_params` of its answer to `decode`.
pub async fn vllm_two_hops(
    fwd: &Arc<Forwarder>,
    request: &Generation<'_>,
    prefill: &Upstream,
    decode: &Upstream,
    guard: &mut RequestGuard,
    timeout: Duration,
) -> Result<hyper::Response<Incoming>, HopError> {
    let request_id = fwd.request_id(guard.id());
    let bad_body = |e| HopError::Failed(ApiError::bad_request("body", e));
    let hop1 = disagg::prefill_body(&request.body).map_err(bad_body)?;
    let hop1 =
        upstream_request(prefill, request, Bytes::from(hop1), Some(&request_id)).map_err(HopError::Failed)?;
    let answer = prefill_exchange(Arc::clone(fwd), prefill.clone(), hop1, timeout).await?;
    guard.prefill_done();
    let hop2 = disagg::decode_body(&request.body, disagg::kv_transfer_params(&answer)).map_err(bad_body)?;
    send(
        fwd,
        decode,
        request,
        Bytes::from(hop2),
        Some(&request_id),
        timeout,
    )
    .await
}

/// SGLang's pair: one body with the bootstrap fields to `prefill` and `decode` at once. The
/// decode worker's response is the client's. Whichever comes first decides: the prefill
/// worker's answer (it prefilled; the router frees its share, and the decode worker's headers
/// are awaited), a failed prefill (the decode request is dropped, which cancels it), or the
/// decode worker's headers (a streaming decode answers before its KV arrives; the prefill
/// worker's answer is then read and dropped in the background, and its failure only logged:
/// the decode stream fails or times out on its own), or a failed decode request (the prefill
/// request is dropped with it).
pub async fn sglang_pair(
    fwd: &Arc<Forwarder>,
    request: &Generation<'_>,
    prefill: &Upstream,
    decode: &Upstream,
    guard: &mut RequestGuard,
    timeout: Duration,
) -> Result<hyper::Response<Incoming>, HopError> {
    let request_id = fwd.request_id(guard.id());
    let room = disagg::bootstrap_room(fwd.instance, guard.id().0);
    let host = disagg::host_of(&prefill.urls.base);
    let both = disagg::bootstrap_body(&request.body, &host, prefill.bootstrap_port, room)
        .map_err(|e| HopError::Failed(ApiError::bad_request("body", e)))?;
    let both = Bytes::from(both);
    let to_prefill =
        upstream_request(prefill, request, both.clone(), Some(&request_id)).map_err(HopError::Failed)?;
    let mut prefill_side = Box::pin(prefill_exchange(
        Arc::clone(fwd),
        prefill.clone(),
        to_prefill,
        timeout,
    ));
    let decode_side = send(fwd, decode, request, both, Some(&request_id), timeout);
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

/// A POST of `body` to `upstream`'s `endpoint`, naming its data-parallel rank as its engine
/// reads it (vLLM's header, SGLang's body field), with the worker's credential (configured, or
/// the client's) and, for the requests of a disaggregated one, their shared request id.
fn upstream_request(
    upstream: &Upstream,
    request: &Generation<'_>,
    mut body: Bytes,
    request_id: Option<&str>,
) -> Result<hyper::Request<Full<Bytes>>, ApiError> {
    let builder = match upstream.urls.endpoint(request.endpoint) {
        Some(uri) => hyper::Request::post(uri.clone()),
        None => hyper::Request::post(format!("{}{}", upstream.urls.base, request.endpoint.path())),
    };
    let mut builder = builder.header(header::CONTENT_TYPE, "application/json");
    builder = match (&upstream.api_key, &request.authorization) {
        (Some(key), _) => crate::checks::with_credential(builder, Some(key)),
        (None, Some(client)) => builder.header(header::AUTHORIZATION, client.clone()),
        (None, None) => builder,
    };
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

/// Sends `body` to the worker that answers the client and returns its response once its
/// headers arrive (within `timeout`). A connect failure takes the worker out of routing.
async fn send(
    fwd: &Forwarder,
    upstream: &Upstream,
    generation: &Generation<'_>,
    body: Bytes,
    request_id: Option<&str>,
    timeout: Duration,
) -> Result<hyper::Response<Incoming>, HopError> {
    let request = upstream_request(upstream, generation, body, request_id).map_err(HopError::Failed)?;
    match tokio::time::timeout(timeout, fwd.client.request(request)).await {
        Err(_) => Err(HopError::Failed(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "timeout",
            "the worker did not answer in time",
        ))),
        Ok(Err(e)) if e.is_connect() => {
            tracing::warn!(worker = upstream.worker.0, error = %e, "worker unreachable; out of routing");
            fwd.driver.worker_event(upstream.worker, WorkerEvent::Unreachable);
            Err(HopError::Connect(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "upstream_failed",
                "the worker cannot be reached",
            )))
        }
        Ok(Err(e)) => {
            // The client learns that the worker failed; the log says how (hyper's words and the
            // worker's address stay out of answers).
            tracing::warn!(worker = upstream.worker.0, error = %e, "worker failed");
            Err(HopError::Failed(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_error",
                "upstream_failed",
                "the worker failed",
            )))
        }
        Ok(Ok(response)) => Ok(response),
    }
}

/// Sends a prefill request and reads its answer whole within `timeout`; a non-2xx answer is an
/// error naming the worker. A connect failure also takes the worker out of routing (health
/// checks bring it back). Owns what it uses, so it can finish in the background.
async fn prefill_exchange(
    fwd: Arc<Forwarder>,
    prefill: Upstream,
    request: hyper::Request<Full<Bytes>>,
    timeout: Duration,
) -> Result<Bytes, HopError> {
    let failed = |message: String| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "prefill_failed",
            format!("the prefill worker: {message}"),
        )
    };
    let exchange = async {
        let response = fwd.client.request(request).await.map_err(|e| {
            tracing::warn!(worker = prefill.worker.0, error = %e, "prefill request failed");
            let error = failed("request failed".to_owned());
            if e.is_connect() {
                tracing::warn!(worker = prefill.worker.0, error = %e, "prefill worker unreachable; out of routing");
                fwd.driver.worker_event(prefill.worker, WorkerEvent::Unreachable);
                HopError::Connect(error)
            } else {
                HopError::Failed(error)
            }
        })?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_PREFILL_RESPONSE)
            .collect()
            .await
            .map_err(|e| {
                tracing::warn!(worker = prefill.worker.0, error = %e, "reading a prefill answer failed");
                HopError::Failed(failed("reading its answer failed".to_owned()))
            })?
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
            format!("the prefill worker {} did not answer in time", prefill.urls.base),
        ))),
    }
}
