//! [`RequestGuard`]: owns one request's load (see the module docs of [`super`]).

use std::sync::Arc;
use std::time::Instant;

use kvroute_core::ids::{RequestId, WorkerKey};
use kvroute_http::openai::types::Usage;

use super::{Driver, DriverState};

/// Owns one routed (or queued) request's load; see the module docs.
pub struct RequestGuard {
    driver: Arc<Driver>,
    id: RequestId,
    /// The worker rank it was routed to, and the prompt tokens predicted cached there (`None`
    /// while it waits in the queue).
    pub(super) routed: Option<(WorkerKey, u64)>,
    started: Instant,
    first_token: bool,
    first_chunk: Option<Instant>,
    prefill_reported: bool,
    last_chunk: Option<Instant>,
    done: bool,
}

impl std::fmt::Debug for RequestGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestGuard")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl RequestGuard {
    pub(super) fn new(driver: &Arc<Driver>, id: RequestId, started: Instant) -> Self {
        Self {
            driver: Arc::clone(driver),
            id,
            routed: None,
            started,
            first_token: false,
            first_chunk: None,
            prefill_reported: false,
            last_chunk: None,
            done: false,
        }
    }

    /// The router's id of the request.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The worker rank the request was routed to (its decode worker), and the prompt tokens
    /// predicted cached there; `None` before it is routed.
    pub fn routed(&self) -> Option<(WorkerKey, u64)> {
        self.routed
    }

    /// The driver the request belongs to.
    pub fn driver(&self) -> &Arc<Driver> {
        &self.driver
    }

    /// A disaggregated request's prefill worker answered (its first token is out, the prompt's
    /// KV is ready to move): the router frees the prefill worker's share, as it does on the
    /// first token. The client's time to first token is still measured to [`Self::chunk`].
    pub fn prefill_done(&mut self) {
        if !self.prefill_reported {
            self.prefill_reported = true;
            let id = self.id;
            self.driver.lifecycle(|r, t| r.handle_first_token(t, id));
        }
    }

    /// A chunk of the response arrived: the first marks prefill done (unless
    /// [`Self::prefill_done`] did) and the time to first token; `streaming` chunks after it are
    /// inter-token latencies.
    pub fn chunk(&mut self, streaming: bool) {
        let now = Instant::now();
        if !self.first_token {
            self.first_token = true;
            self.first_chunk = Some(now);
            let ttft = now - self.started;
            if streaming {
                self.driver.metrics.ttft.observe(ttft.as_secs_f64());
            }
            // A unary answer's first byte is its last: its TTFT is not known.
            let worker = self.routed.map(|(key, _)| key.worker);
            let observe = move |s: &mut DriverState| {
                if let (true, Some(w)) = (streaming, worker) {
                    s.observe_first_token(w, ttft);
                }
            };
            if self.prefill_reported {
                observe(&mut self.driver.lock());
            } else {
                self.prefill_reported = true;
                let id = self.id;
                self.driver
                    .lifecycle_observed(|r, t| r.handle_first_token(t, id), observe);
            }
        } else if streaming && let Some(last) = self.last_chunk {
            self.driver.metrics.itl.observe((now - last).as_secs_f64());
        }
        self.last_chunk = Some(now);
    }

    /// The response ended: the request is finished. `usage`: the engine's (if it sent one);
    /// `streamed`: whether its tokens came as chunks, so that the span from the first to the
    /// last is its decode time.
    pub fn finish(mut self, usage: Option<&Usage>, streamed: bool) {
        self.done = true;
        let id = self.id;
        let worker = self.routed.map(|(key, _)| key.worker);
        let decode = match (streamed, self.first_chunk, self.last_chunk) {
            (true, Some(first), Some(last)) => Some(last - first),
            _ => None,
        };
        self.driver.lifecycle_observed(
            |r, t| r.handle_finished(t, id),
            |s| {
                if let (Some(u), Some(w)) = (usage, worker) {
                    s.observe_completed(w, u, decode);
                }
            },
        );
    }

    /// The request is given up (before it reached a worker); the same as dropping the guard.
    pub fn cancel(self) {}
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let id = self.id;
        self.driver.lock().waiters.remove(&id);
        self.driver.lifecycle(|r, t| r.handle_cancelled(t, id));
    }
}
