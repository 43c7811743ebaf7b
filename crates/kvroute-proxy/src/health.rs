//! The health prober: checks every worker's `/health` each `health_interval_ms` and reports
//! each answer to the worker's state machine ([`crate::worker`]), which decides what a streak
//! of them means. A worker back from failing, or misconfigured and answering, gets the
//! registration checks again ([`crate::checks`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use kvroute_http::net::HttpClient;

use crate::checks::Checker;
use crate::config::ServeConfig;
use crate::driver::Shared;
use crate::worker::WorkerEvent;

/// Probes every worker, forever.
pub async fn run(shared: Arc<Shared>, checker: Checker) {
    let client = &checker.client;
    let interval = ServeConfig::ms(shared.config.health_interval_ms);
    let timeout = ServeConfig::ms(shared.config.health_timeout_ms);
    loop {
        tokio::time::sleep(interval).await;
        for (id, base) in shared.worker_urls() {
            let key = shared.worker_config(id).and_then(|c| c.api_key);
            let event = probe(client, &base, key.as_deref(), timeout).await;
            let before = shared.worker_state(id);
            let after = shared.worker_event(id, event);
            if crate::checks::due(before, after, event == WorkerEvent::CheckPassed) {
                checker.spawn(&shared, id);
            }
        }
    }
}

/// `builder` with the worker's configured credential, if it has one: every call to an engine
/// goes through here (generation, health checks), so an engine behind `--api-key` answers.
pub fn with_credential(
    builder: hyper::http::request::Builder,
    api_key: Option<&str>,
) -> hyper::http::request::Builder {
    match api_key {
        Some(key) => builder.header(hyper::header::AUTHORIZATION, format!("Bearer {key}")),
        None => builder,
    }
}

/// One check of the worker at `base` (with its credential, if it has one): passed if it
/// answers 2xx within `timeout`.
pub async fn probe(client: &HttpClient, base: &str, api_key: Option<&str>, timeout: Duration) -> WorkerEvent {
    let request = with_credential(hyper::Request::get(format!("{base}/health")), api_key);
    let Ok(request) = request.body(Full::new(Bytes::new())) else {
        return WorkerEvent::CheckFailed;
    };
    match tokio::time::timeout(timeout, client.request(request)).await {
        Ok(Ok(response)) if response.status().is_success() => WorkerEvent::CheckPassed,
        _ => WorkerEvent::CheckFailed,
    }
}
