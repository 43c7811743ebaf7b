//! The HTTP handlers: OpenAI-compatible generation, models, and the shared state of a worker.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use kvroute_core::router::WorkerRole;
use kvroute_http::model::Model;
use kvroute_http::openai::types::CachedTokensReport;
use kvroute_http::openai::{self, ApiError, Endpoint};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::driver::{Job, JobUpdate};
use crate::metrics::Stats;
use crate::openai::{Ending, Shape};
use crate::parse::{KvRole, kv_role, pick_rank, transfer_params, vllm_tokens};
use crate::rooms::{BOOTSTRAP_TIMEOUT, Rooms};
use crate::start::{SEEN_KEPT, SeenKvRequest};
use crate::vllm::{self, Refusal};
use kvroute_engine::KvReportMode;

/// The shared state of one mock worker's HTTP server.
pub(crate) struct MockWorkerState {
    /// The engine id it names in `kv_transfer_params`.
    pub(crate) engine_id: String,
    /// Its role: which side of an SGLang pair it takes.
    pub(crate) role: WorkerRole,
    /// The bootstrap rooms of the workers started with it.
    pub(crate) rooms: Arc<Rooms>,
    pub(crate) addr: SocketAddr,
    pub(crate) block_size: u32,
    pub(crate) seen: Mutex<std::collections::VecDeque<SeenKvRequest>>,
    pub(crate) model: Arc<Model>,
    pub(crate) model_name: String,
    /// The LoRA adapters loaded ([`crate::lora`]).
    pub(crate) adapters: crate::lora::Loaded,
    pub(crate) max_model_len: u32,
    pub(crate) default_max_tokens: u32,
    /// Whether usage reports cached prompt tokens ([`MockConfig::cached_tokens`]).
    ///
    /// [`MockConfig::cached_tokens`]: crate::MockConfig::cached_tokens
    pub(crate) cached_tokens: CachedTokensReport,
    /// Each rank's engine task and counters.
    pub(crate) ranks: Vec<Rank>,
    /// The rank of the next request that names none.
    pub(crate) next_rank: std::sync::atomic::AtomicU64,
    pub(crate) next_id: std::sync::atomic::AtomicU64,
}

/// One data-parallel rank of a mock worker: its engine task's queue and its counters.
pub(crate) struct Rank {
    pub(crate) jobs: mpsc::UnboundedSender<Job>,
    pub(crate) stats: Arc<Mutex<Stats>>,
}

pub(crate) async fn completions(State(w): State<Arc<MockWorkerState>>, req: Request) -> Response {
    generate(&w, Endpoint::Completions, req).await
}

pub(crate) async fn chat(State(w): State<Arc<MockWorkerState>>, req: Request) -> Response {
    generate(&w, Endpoint::Chat, req).await
}

/// A request taken apart: its headers of note and its body.
struct Incoming {
    request_id: Option<String>,
    rank_header: Option<String>,
    body: Bytes,
}

fn header(req: &Request, name: &str) -> Option<String> {
    req.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

async fn read(req: Request) -> Result<Incoming, Refusal> {
    let request_id = header(&req, kvroute_http::disagg::REQUEST_ID);
    let rank_header = header(&req, "x-data-parallel-rank");
    let body = http_body_util::Limited::new(req.into_body(), 64 << 20)
        .collect()
        .await
        .map_err(|e| ApiError::bad_request("body", format!("reading the body: {e}")))?
        .to_bytes();
    Ok(Incoming {
        request_id,
        rank_header,
        body,
    })
}

/// The engine stopped: the worker is being killed.
fn stopped() -> Refusal {
    Refusal::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped", None)
}

async fn generate(w: &Arc<MockWorkerState>, endpoint: Endpoint, req: Request) -> Response {
    match submit(w, endpoint, req).await {
        Ok(s) if s.stream => stream(w, s),
        Ok(s) => respond(w, s).await,
        Err(e) => e.into_response(),
    }
}

/// A request sent to its rank's engine: what answering it needs.
struct Submitted {
    rx: mpsc::UnboundedReceiver<JobUpdate>,
    shape: Shape,
    stream: bool,
    include_usage: bool,
    transfer_params: Option<Value>,
}

/// Parses a request, takes its side of a disaggregated flow and sends it to its rank's engine.
async fn submit(w: &Arc<MockWorkerState>, endpoint: Endpoint, req: Request) -> Result<Submitted, Refusal> {
    let incoming = read(req).await?;
    // Not JSON (null): `parse` says why.
    let value: Value = serde_json::from_slice(&incoming.body).unwrap_or_default();
    let adapter = crate::lora::requested(&value, &w.model_name, &w.adapters)?;
    vllm::check_body(&value, adapter.as_deref().unwrap_or(&w.model_name))?;
    if endpoint == Endpoint::Chat {
        vllm::check_chat_template(&value)?;
    }
    vllm::check_truncation(&value, w.max_model_len)?;
    let parsed = w.parse(endpoint, &incoming.body, Some(w.max_model_len as usize))?;
    let form = match parsed.prompt {
        openai::Prompt::TokenIds(_) => vllm::PromptForm::TokenIds,
        openai::Prompt::Text(_) | openai::Prompt::Chat { .. } => vllm::PromptForm::Text,
    };
    // vLLM names a chat's `max_completion_tokens` when the request gives it.
    let max_tokens_param = match value.get("max_completion_tokens") {
        Some(v) if !v.is_null() => "max_completion_tokens",
        _ => "max_tokens",
    };
    vllm::check_context(
        form,
        parsed.tokens.len(),
        parsed.max_tokens,
        max_tokens_param,
        w.max_model_len,
    )?;
    let role = kv_role(&value, w.role)?;
    let rank = &w.ranks[pick_rank(w, incoming.rank_header.as_deref(), &value)?];
    let prompt_tokens = parsed.tokens.len() as u32;
    let job = engine_job(&parsed, role, w.default_max_tokens, adapter);
    rank.count(prompt_tokens, role);
    if role != KvRole::Local {
        w.record_seen(value, role, incoming.request_id.clone());
    }
    // SGLang's decode side starts when its room's KV is ready.
    if let KvRole::BootstrapDecode(room) = role
        && !w.rooms.wait(room, BOOTSTRAP_TIMEOUT).await
    {
        return Err(Refusal::new(
            StatusCode::GATEWAY_TIMEOUT,
            format!("no prefilled KV arrived for bootstrap_room {room}"),
            Some("bootstrap_room"),
        ));
    }
    let (tx, mut rx) = mpsc::unbounded_channel();
    // SGLang's prefill side marks its room when the engine is done with it, whether or not
    // anyone still reads the answer.
    if let Some(room) = role.prefilled_room() {
        rx = w.rooms.watch(room, rx);
    }
    let transfer_params = (role == KvRole::RemoteDecode)
        .then(|| transfer_params(w, prompt_tokens, incoming.request_id.as_deref()));
    rank.jobs.send(job(tx)).map_err(|_| stopped())?;
    let n = w.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let shape = Shape::new(
        endpoint,
        n,
        parsed.model.unwrap_or_else(|| w.model_name.clone()),
        prompt_tokens,
        parsed.max_tokens,
        w.cached_tokens,
    );
    Ok(Submitted {
        rx,
        shape,
        stream: parsed.stream,
        include_usage: parsed.include_usage,
        transfer_params,
    })
}

/// The job of a parsed request, once given its channel.
fn engine_job(
    parsed: &openai::Parsed,
    role: KvRole,
    default_max_tokens: u32,
    lora_name: Option<String>,
) -> impl FnOnce(mpsc::UnboundedSender<JobUpdate>) -> Job {
    let mut output_len = parsed.max_tokens.unwrap_or(default_max_tokens);
    if role.prefills() {
        // A prefill for a remote decode samples the first token only.
        output_len = output_len.min(1);
    }
    // The engine imports only what leaves something to decode; a request of one token decodes
    // (recomputes) here.
    let import = role.imports() && output_len >= 2;
    let (prompt, cache_salt) = (parsed.tokens.clone(), parsed.cache_salt.clone());
    // vLLM reads `kv_cache_report_mode` from `vllm_xargs`; `full` re-announces the request's
    // prefix-cache hits, anything else is its default.
    let kv_report = match parsed.kv_cache_report {
        Some(openai::KvCacheReport::Full) => KvReportMode::Full,
        Some(openai::KvCacheReport::Incremental) | None => KvReportMode::Incremental,
    };
    move |tx| Job {
        prompt,
        output_len,
        cache_salt,
        lora_name,
        import,
        kv_report,
        tx,
    }
}

impl Rank {
    /// Counts a request's prompt, and whether it is prefilled for a remote decode.
    fn count(&self, prompt_tokens: u32, role: KvRole) {
        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        s.prompt_tokens += u64::from(prompt_tokens);
        if role.prefills() {
            s.remote_decode_requests += 1;
        }
    }
}

impl MockWorkerState {
    /// Parses a request to `endpoint` and tokenizes its prompt as vLLM does. The prompt's
    /// length in tokens is left to [`vllm::check_context`], in vLLM's words; only text of more
    /// characters than a context of `max_model_len` tokens can hold is refused here, before it
    /// is tokenized, as vLLM's `_text_len_check` refuses it (`/tokenize`: `None`, no limit, as
    /// vLLM's).
    fn parse(
        &self,
        endpoint: Endpoint,
        body: &[u8],
        max_model_len: Option<usize>,
    ) -> Result<openai::Parsed, ApiError> {
        const UNCOUNTED: usize = usize::MAX >> 8;
        openai::parse_with(endpoint, body, UNCOUNTED, |prompt, special, truncation| {
            // vLLM's /tokenize ignores `truncate_prompt_tokens` (seen on vLLM 0.32).
            let truncation = max_model_len.and(truncation);
            vllm_tokens(
                &self.model,
                prompt,
                special,
                truncation,
                max_model_len.unwrap_or(UNCOUNTED),
            )
        })
    }

    /// Keeps a request of the disaggregated flow, without its prompt, for [`SeenKvRequest`].
    fn record_seen(&self, mut body: Value, role: KvRole, request_id: Option<String>) {
        if let Value::Object(obj) = &mut body {
            obj.remove("prompt");
            obj.remove("messages");
        }
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() == SEEN_KEPT {
            seen.pop_front();
        }
        seen.push_back(SeenKvRequest {
            request_id,
            remote_decode: role.prefills(),
            body,
        });
    }
}

/// A streamed answer: SSE chunks as the engine reports.
fn stream(w: &Arc<MockWorkerState>, s: Submitted) -> Response {
    let worker = Arc::clone(w);
    let (frames_tx, frames_rx) = mpsc::channel::<Bytes>(64);
    let Submitted {
        mut rx,
        shape,
        include_usage,
        ..
    } = s;
    tokio::spawn(async move {
        let mut cached = 0;
        let mut first = true;
        loop {
            // A client that disconnects drops the body: stop reading the engine, whose task
            // then aborts the request.
            let p = tokio::select! {
                p = rx.recv() => p,
                () = frames_tx.closed() => return,
            };
            let Some(p) = p else { return };
            let chunk = match p {
                JobUpdate::Cached(c) => {
                    cached = c;
                    continue;
                }
                JobUpdate::Tokens(tokens) => {
                    let c = shape.chunks(&worker.text(&tokens), None, first);
                    first = false;
                    c
                }
                JobUpdate::Done {
                    completion_tokens,
                    reason,
                    last,
                } => {
                    let end = Ending {
                        completion_tokens,
                        reason,
                        cached,
                    };
                    let last = shape.last_chunks(&worker.text(&last), end, first, include_usage);
                    let _ = frames_tx.send(Bytes::from(last)).await;
                    return;
                }
                JobUpdate::Refused(message) => shape.error_chunk(&message),
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
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::new(body))
        .unwrap_or_default()
}

/// A whole answer, when the engine is done.
async fn respond(w: &Arc<MockWorkerState>, mut s: Submitted) -> Response {
    let mut cached = 0;
    let mut tokens = Vec::new();
    while let Some(p) = s.rx.recv().await {
        match p {
            JobUpdate::Cached(c) => cached = c,
            JobUpdate::Tokens(t) => tokens.extend(t),
            JobUpdate::Done {
                completion_tokens,
                reason,
                last,
            } => {
                tokens.extend(last);
                let end = Ending {
                    completion_tokens,
                    reason,
                    cached,
                };
                return s.shape.full(w.text(&tokens), end, s.transfer_params);
            }
            JobUpdate::Refused(message) => {
                return Refusal::new(StatusCode::BAD_REQUEST, message, Some("prompt")).into_response();
            }
        }
    }
    stopped().into_response()
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

/// vLLM's `POST /tokenize`: a completion's `prompt` (a string) or a chat's `messages`
/// (`TokenizeCompletionRequest`, `TokenizeChatRequest`), tokenized as a generation request of
/// that kind would be; answers `{"count", "max_model_len", "tokens", "token_strs": null}`.
pub(crate) async fn tokenize(State(w): State<Arc<MockWorkerState>>, body: Bytes) -> Response {
    let refuse = |param, message| Refusal::from(ApiError::bad_request(param, message)).into_response();
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v @ Value::Object(_)) => v,
        _ => return refuse("body", "the body must be a JSON object"),
    };
    let endpoint = if value.get("messages").is_some() {
        Endpoint::Chat
    } else {
        if !value.get("prompt").is_some_and(Value::is_string) {
            return refuse("prompt", "`prompt` must be a string");
        }
        Endpoint::Completions
    };
    // vLLM 0.32's chat /tokenize gives the template neither `documents` nor `reasoning_effort`
    // (seen on the engine: `kvroute-http/tests/data/chat-templates/vllm_tokenize.py`).
    let mut value = value;
    let body = match value.as_object_mut() {
        Some(obj) if obj.contains_key("documents") || obj.contains_key("reasoning_effort") => {
            obj.remove("documents");
            obj.remove("reasoning_effort");
            Bytes::from(serde_json::to_vec(&value).unwrap_or_default())
        }
        _ => body,
    };
    // vLLM's /tokenize counts a prompt of any length (the body limit bounds it).
    match w.parse(endpoint, &body, None) {
        Ok(parsed) => axum::Json(kvroute_http::openai::types::Tokenized {
            count: parsed.tokens.len(),
            max_model_len: w.max_model_len,
            tokens: parsed.tokens,
            token_strs: None,
        })
        .into_response(),
        Err(e) => Refusal::from(e).into_response(),
    }
}

pub(crate) async fn models(State(w): State<Arc<MockWorkerState>>) -> Response {
    axum::Json(w.adapters.model_list(&w.model_name)).into_response()
}
