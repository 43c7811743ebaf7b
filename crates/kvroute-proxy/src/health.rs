//! The health prober and the registration checks' runner. The prober checks every worker's
//! `/health` each `health_interval_ms` and reports each answer to the worker's state machine
//! ([`crate::worker`]), which decides what a streak of them means; the answer is read and
//! applied under the driver's one lock. A worker that answers has its LoRA adapters read again
//! from its `/v1/models` (loaded and unloaded at run time, [`crate::adapters`]). A worker back from failing, or misconfigured and
//! answering, gets the registration checks again ([`crate::checks`], run by [`Checker`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use kvroute_core::ids::WorkerId;
use kvroute_http::model::Model;
use kvroute_http::net::HttpClient;

use crate::checks::{self, Check, ON_REGISTRATION, Verdict, Worker, with_credential};
use crate::config::ServeConfig;
use crate::driver::Driver;
use crate::parity;
use crate::worker::WorkerEvent;

/// Probes every worker, forever.
pub async fn run(driver: Arc<Driver>, checker: Checker) {
    let interval = ServeConfig::ms(driver.config.upstream.health_interval_ms);
    loop {
        tokio::time::sleep(interval).await;
        probe_all(&driver, &checker).await;
    }
}

/// One round of the prober: every worker's `/health` asked once, each answer applied to its
/// state machine, the adapters of each that answered read again (one that then does not
/// answer keeps those it had), and the registration checks started where they are due.
pub async fn probe_all(driver: &Arc<Driver>, checker: &Checker) {
    let timeout = ServeConfig::ms(driver.config.upstream.health_timeout_ms);
    let model = &driver.config.model.model_name;
    for (id, base) in driver.worker_urls() {
        let key = driver.worker_config(id).and_then(|c| c.api_key);
        let event = probe(&checker.client, &base, key.as_deref(), timeout).await;
        if event == WorkerEvent::CheckPassed {
            let worker = Worker {
                base: &base,
                api_key: key.as_deref(),
            };
            if let Some(list) = checks::models(&checker.client, worker, timeout).await {
                driver.set_adapters(id, crate::adapters::adapters_of(&list, model));
            }
        }
        let t = driver.apply_worker_event(id, event);
        if checks::due(
            t.map(|t| t.from),
            t.map(|t| t.to),
            event == WorkerEvent::CheckPassed,
        ) {
            checker.spawn(driver, id);
        }
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

/// What the HTTP checks need besides the driver: the client that asks the workers and the
/// tokenizer kvroute routes with.
#[derive(Clone)]
pub struct Checker {
    /// The client that asks the workers.
    pub client: HttpClient,
    /// kvroute's tokenizer and chat template.
    pub model: Arc<Model>,
}

impl Checker {
    /// Runs the registration checks of worker `id` in the background.
    pub fn spawn(&self, driver: &Arc<Driver>, id: WorkerId) {
        let (driver, checker) = (Arc::clone(driver), self.clone());
        tokio::spawn(async move { checker.run(&driver, id).await });
    }

    /// Runs the registration checks of worker `id` and reports each verdict. A check that
    /// cannot tell (the worker does not answer) reports nothing: health checks deal with that.
    pub async fn run(&self, driver: &Arc<Driver>, id: WorkerId) {
        for &check in ON_REGISTRATION {
            if let Some(verdict) = self.run_one(driver, id, check).await {
                driver.report_check(id, check, verdict);
            }
        }
    }

    /// One HTTP check of worker `id`; `None` if it cannot tell.
    async fn run_one(&self, driver: &Driver, id: WorkerId, check: Check) -> Option<Verdict> {
        let base = driver.worker_urls().into_iter().find(|(w, _)| *w == id)?.1;
        let timeout = ServeConfig::ms(driver.config.upstream.health_timeout_ms);
        let model_name = &driver.config.model.model_name;
        let key = driver.worker_config(id).and_then(|c| c.api_key);
        let worker = Worker {
            base: &base,
            api_key: key.as_deref(),
        };
        match check {
            Check::Model => {
                let list = checks::models(&self.client, worker, timeout).await?;
                driver.set_adapters(id, crate::adapters::adapters_of(&list, model_name));
                Some(checks::model_verdict(&list, model_name))
            }
            // Judged on the worker's events, not asked.
            Check::BlockSize => None,
            Check::Tokenization => {
                let found =
                    parity::check_and_log(&self.client, worker, model_name, &self.model, timeout).await;
                parity::verdict(found)
            }
        }
    }
}
