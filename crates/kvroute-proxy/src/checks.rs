//! Registration checks: is a worker configured as the proxy assumes? A worker that fails one is
//! [`crate::worker::WorkerState::Misconfigured`]: out of routing,
//! with the reason on the admin API (`misconfigured`), in `kvroute_worker_misconfigured` and in
//! one warn log line, until every check passes again.
//!
//! Each [`Check`] reports its verdict through the driver's `Driver::report_check`. The checks
//! in [`ON_REGISTRATION`] ask the worker over HTTP (run by [`crate::health::Checker`]); they run
//! when a worker is added, when it comes back from failing, and on each passing health check
//! while it is misconfigured ([`due`]). [`Check::BlockSize`] is judged on the worker's KV events
//! as they arrive ([`crate::events`]).
//!
//! This module is the checks' vocabulary and the verdicts themselves; it knows nothing of the
//! driver, so the registry, the metrics and the driver can all name a check.
//!
//! **Adding a check:** a variant of [`Check`] (its name is the metric's and the admin API's
//! label), and either an entry in [`ON_REGISTRATION`] with its arm in `Checker::run_one` (an
//! HTTP check against the worker), or a call to `Driver::report_check` where its evidence
//! arrives.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvroute_http::net::HttpClient;
use kvroute_http::openai::types::ModelList;
use serde::Serialize;

use crate::worker::WorkerState;

/// A registration check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Check {
    /// The worker's `/v1/models` lists the model the proxy serves.
    Model,
    /// The worker's KV events carry blocks of the router's block size.
    BlockSize,
    /// The worker's `/tokenize` turns a chat conversation and a completion prompt into the
    /// tokens kvroute routes on ([`crate::parity`]).
    Tokenization,
}

impl Check {
    /// Every check.
    pub const ALL: [Self; 3] = [Self::Model, Self::BlockSize, Self::Tokenization];

    /// Its name: the `check` label and the admin API's key.
    pub fn name(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::BlockSize => "block_size",
            Self::Tokenization => "tokenization",
        }
    }
}

/// The checks that ask the worker over HTTP, in the order they run.
pub const ON_REGISTRATION: &[Check] = &[Check::Model, Check::Tokenization];

/// What a check found: `Ok`, or the reason the worker is misconfigured.
pub type Verdict = Result<(), String>;

/// Whether a worker whose state went from `before` to `after` on a health check is due for
/// the registration checks: it came back from failing, or it is misconfigured and answers.
pub fn due(before: Option<WorkerState>, after: Option<WorkerState>, passed: bool) -> bool {
    match (before, after) {
        (Some(WorkerState::Unhealthy { .. }), Some(WorkerState::Ready { .. })) => true,
        (_, Some(WorkerState::Misconfigured)) => passed,
        _ => false,
    }
}

/// A worker as a check asks it: its base URL and its credential, if it has one.
#[derive(Clone, Copy, Debug)]
pub struct Worker<'a> {
    /// `http://host:port`.
    pub base: &'a str,
    /// Sent as `Authorization: Bearer` ([`with_credential`]).
    pub api_key: Option<&'a str>,
}

/// `builder` with the worker's configured credential, if it has one: every call to an engine
/// goes through here (generation, health checks, registration checks), so an engine behind
/// `--api-key` answers.
pub fn with_credential(
    builder: hyper::http::request::Builder,
    api_key: Option<&str>,
) -> hyper::http::request::Builder {
    match api_key {
        Some(key) => builder.header(hyper::header::AUTHORIZATION, format!("Bearer {key}")),
        None => builder,
    }
}

/// The largest `/v1/models` answer read.
const MAX_MODELS_RESPONSE: usize = 1 << 20;

/// Whether `worker` serves `model` by its `/v1/models`; `None` if it does not answer 2xx with
/// a model list in `timeout` (no verdict).
pub async fn served_model(
    client: &HttpClient,
    worker: Worker<'_>,
    model: &str,
    timeout: Duration,
) -> Option<Verdict> {
    let list = models(client, worker, timeout).await?;
    Some(model_verdict(&list, model))
}

/// `worker`'s `/v1/models`; `None` (said in a warn line) if it does not answer 2xx with a
/// model list in `timeout`.
pub async fn models(client: &HttpClient, worker: Worker<'_>, timeout: Duration) -> Option<ModelList> {
    let base = worker.base;
    let request = with_credential(hyper::Request::get(format!("{base}/v1/models")), worker.api_key)
        .body(Full::new(Bytes::new()))
        .ok()?;
    let exchange = async {
        let response = match client.request(request).await {
            Ok(response) => response,
            Err(e) => {
                tracing::warn!(base, error = %e, "the worker does not answer; its model is checked when it comes back");
                return None;
            }
        };
        if !response.status().is_success() {
            tracing::warn!(base, status = %response.status(), "the worker's /v1/models did not answer 2xx; its model is not checked");
            return None;
        }
        let body = Limited::new(response.into_body(), MAX_MODELS_RESPONSE)
            .collect()
            .await
            .ok()?
            .to_bytes();
        match serde_json::from_slice::<ModelList>(&body) {
            Ok(list) => Some(list),
            Err(e) => {
                tracing::warn!(base, error = %e, "the worker's /v1/models is not a model list; its model is not checked");
                None
            }
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(verdict) => verdict,
        Err(_) => {
            tracing::warn!(
                base,
                "the worker's /v1/models did not answer in time; its model is not checked"
            );
            None
        }
    }
}

/// Whether `list` has `model`.
pub fn model_verdict(list: &ModelList, model: &str) -> Verdict {
    if list.data.iter().any(|m| m.id == model) {
        return Ok(());
    }
    let served: Vec<&str> = list.data.iter().map(|m| m.id.as_str()).collect();
    Err(format!("model `{model}` not served; it serves {served:?}"))
}

/// The block-size verdict on a worker's KV events of `event` tokens per block.
pub fn block_size_verdict(event: u32, router: u32) -> Verdict {
    if event == router {
        Ok(())
    } else {
        Err(format!(
            "its KV events have blocks of {event} tokens, the router's block size is {router}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_check_names_what_the_worker_serves() {
        let list = ModelList::one("llama", "vllm");
        assert_eq!(model_verdict(&list, "llama"), Ok(()));
        assert_eq!(
            model_verdict(&list, "tiny"),
            Err("model `tiny` not served; it serves [\"llama\"]".to_owned())
        );
    }

    #[test]
    fn the_block_size_check_compares_with_the_router() {
        assert_eq!(block_size_verdict(16, 16), Ok(()));
        assert_eq!(
            block_size_verdict(32, 16),
            Err("its KV events have blocks of 32 tokens, the router's block size is 16".to_owned())
        );
    }

    #[test]
    fn checks_are_due_when_a_worker_comes_back_or_answers_while_misconfigured() {
        use WorkerState::*;
        // (before, after, health check passed, due)
        let table = [
            (Unhealthy { passed: 1 }, Ready { failed: 0 }, true, true),
            (Ready { failed: 0 }, Ready { failed: 0 }, true, false),
            (Misconfigured, Misconfigured, true, true),
            (Misconfigured, Misconfigured, false, false),
            (Ready { failed: 2 }, Unhealthy { passed: 0 }, false, false),
            (Draining { failed: 0 }, Draining { failed: 0 }, true, false),
        ];
        for (before, after, passed, want) in table {
            assert_eq!(
                due(Some(before), Some(after), passed),
                want,
                "{before:?} → {after:?}"
            );
        }
        let names: Vec<&str> = Check::ALL.iter().map(|c| c.name()).collect();
        assert_eq!(names, ["model", "block_size", "tokenization"]);
    }
}
