//! What the inference and admin listeners' handlers share ([`App`]), and reading a request's
//! body within its limits.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use axum::http::StatusCode;
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use kvroute_http::model::Model;
use kvroute_http::openai::ApiError;

use crate::config::ServeConfig;
use crate::driver::Driver;
use crate::fleet::Fleet;
use crate::flow::Forwarder;

/// One model's stack: its router driver (router, registry, metrics), tokenizer, flows and
/// fleet. A proxy of one model has one; of several (`[[model]]` tables), one each.
pub(crate) struct Stack {
    pub(crate) driver: Arc<Driver>,
    pub(crate) model: Arc<Model>,
    pub(crate) forwarder: Arc<Forwarder>,
    /// The one door for adding and removing this model's workers.
    pub(crate) fleet: Arc<Fleet>,
    /// Its planner's report (empty without a planner).
    pub(crate) planner: Arc<crate::autoscale::Status>,
}

impl Stack {
    /// The model's name.
    pub(crate) fn name(&self) -> &str {
        &self.driver.config.model.model_name
    }
}

/// The state of both listeners' handlers.
pub(crate) struct App {
    /// The first model's driver: the settings every model shares (server, limits, upstream,
    /// tenants) are read from its configuration.
    pub(crate) driver: Arc<Driver>,
    /// Each model's stack, in the configuration's order (the first serves requests that name
    /// no model).
    pub(crate) stacks: Vec<Stack>,
    /// Tenants: who a request is from, its priority, the limits.
    pub(crate) tenants: Arc<crate::tenants::Tenants>,
    /// The registry of the metrics the models share (the tenants'), with several models; else
    /// none (every metric is the one model's).
    pub(crate) shared_metrics: Option<prometheus::Registry>,
    /// One admin change at a time: the fleet check and the change it allows are one step.
    pub(crate) admin: tokio::sync::Mutex<()>,
    /// The start of the request ids made here (`kvr-{instance tag in hex}-`), and their counter.
    pub(crate) request_id_prefix: String,
    pub(crate) next_request_id: AtomicU64,
}

impl App {
    /// The stack that serves `model`: the model of that name, else the first whose workers
    /// serve an adapter of that name.
    pub(crate) fn stack_serving(&self, model: &str) -> Option<&Stack> {
        self.stacks
            .iter()
            .find(|s| s.name() == model)
            .or_else(|| self.stacks.iter().find(|s| s.driver.serves_adapter(model)))
    }

    /// The stack of the model named `model`.
    pub(crate) fn stack_named(&self, model: &str) -> Option<&Stack> {
        self.stacks.iter().find(|s| s.name() == model)
    }

    /// The stack that holds worker `id` (ids are unique across models).
    pub(crate) fn stack_of_worker(&self, id: kvroute_core::ids::WorkerId) -> Option<&Stack> {
        self.stacks.iter().find(|s| s.driver.worker_state(id).is_some())
    }

    /// The stack worker `w` joins: its pinned model's, the one model's, or (several, unpinned)
    /// the one its `/v1/models` lists.
    pub(crate) async fn stack_for_worker(&self, w: &crate::config::WorkerConfig) -> Result<&Stack, String> {
        let names: Vec<&str> = self.stacks.iter().map(Stack::name).collect();
        let timeout = ServeConfig::ms(self.driver.config.upstream.health_timeout_ms.max(1_000));
        let client = &self.first().fleet.checker().client;
        let name = crate::adapters::model_for(client, w, &names, timeout).await?;
        self.stack_named(&name).ok_or_else(|| {
            format!(
                "worker {}: model {name:?} is none of those served ({})",
                w.url,
                names.join(", ")
            )
        })
    }

    /// The first stack (a proxy has at least one).
    pub(crate) fn first(&self) -> &Stack {
        &self.stacks[0]
    }
}

/// Reads a request body whole: at most `limit` bytes, within the body read timeout; else an
/// OpenAI-shaped 413 or 408.
pub(crate) async fn read_body(
    config: &ServeConfig,
    body: axum::body::Body,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let collect = Limited::new(body, limit).collect();
    match tokio::time::timeout(ServeConfig::ms(config.server.body_read_timeout_ms), collect).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "body_too_large",
            format!("the request body exceeds {limit} bytes"),
        )),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reading a request body failed");
            Err(ApiError::bad_request(
                "body",
                "the request body could not be read",
            ))
        }
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "request_timeout",
            format!(
                "the request body did not arrive within {} ms",
                config.server.body_read_timeout_ms
            ),
        )),
    }
}
