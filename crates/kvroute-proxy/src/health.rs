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
            let event = probe(client, &base, timeout).await;
            let before = shared.worker_state(id);
            let after = shared.worker_event(id, event);
            if crate::checks::due(before, after, event == WorkerEvent::CheckPassed) {
                checker.spawn(&shared, id);
            }
        }
    }
}

/// One check of the worker at `base`: passed if it answers 2xx within `timeout`.
pub async fn probe(client: &HttpClient, base: &str, timeout: Duration) -> WorkerEvent {
    let Ok(request) = hyper::Request::get(format!("{base}/health")).body(Full::new(Bytes::new())) else {
        return WorkerEvent::CheckFailed;
    };
    match tokio::time::timeout(timeout, client.request(request)).await {
        Ok(Ok(response)) if response.status().is_success() => WorkerEvent::CheckPassed,
        _ => WorkerEvent::CheckFailed,
    }
}
