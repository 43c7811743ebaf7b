//! [`RequestGuard`]: owns one request's load (see the module docs of [`super`]).

use std::sync::Arc;
use std::time::Instant;

use kvroute_core::ids::{RequestId, WorkerKey};

use super::Driver;

/// Owns one routed (or queued) request's load; see the module docs.
pub struct RequestGuard {
    driver: Arc<Driver>,
    id: RequestId,
    /// The worker rank it was routed to, and the prompt tokens predicted cached there (`None`
    /// while it waits in the queue).
    pub(super) routed: Option<(WorkerKey, u64)>,
    started: Instant,
    first_token: bool,
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
            if streaming {
                self.driver
                    .metrics
                    .ttft
                    .observe((now - self.started).as_secs_f64());
            }
            self.prefill_done();
        } else if streaming && let Some(last) = self.last_chunk {
            self.driver.metrics.itl.observe((now - last).as_secs_f64());
        }
        self.last_chunk = Some(now);
    }

    /// The response ended: the request is finished.
    pub fn finish(mut self) {
        self.done = true;
        let id = self.id;
        self.driver.lifecycle(|r, t| r.handle_finished(t, id));
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
