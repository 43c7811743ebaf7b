//! The KV-event feed: one `kvroute-zmq` subscriber per worker endpoint reports into one channel,
//! and one task applies the reports to the router in arrival order (so a worker's events apply
//! in order). Gaps are filled by the subscriber through the worker's replay socket; what it
//! cannot fill arrives as `GapLost`, and the worker's cache view is cleared (never route on
//! blocks that may be gone). While a subscriber runs, its counters are exported from
//! `/metrics` ([`KvSubscriberCounters`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvroute_core::ids::WorkerId;
use tokio::sync::mpsc;

use kvroute_zmq::{SubscriberConfig, SubscriberCounters, SubscriberEvent, SubscriberHandle};

use crate::config::WorkerConfig;
use crate::metrics::KvSubscriberCounters;
use crate::state::Shared;

/// The feed: a channel into the router, and the subscribers that write to it.
pub struct EventFeed {
    tx: mpsc::Sender<SubscriberEvent>,
    subscribers: Mutex<HashMap<WorkerId, tokio::task::JoinHandle<()>>>,
    exported: KvSubscriberCounters,
}

/// A subscriber's counters exported for as long as this lives (it lives in the subscriber's
/// task, so stopping the task stops the export).
struct Exported {
    exported: KvSubscriberCounters,
    worker: WorkerId,
    counters: Arc<SubscriberCounters>,
}

impl Drop for Exported {
    fn drop(&mut self) {
        self.exported.remove(self.worker, &self.counters);
    }
}

impl std::fmt::Debug for EventFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventFeed").finish_non_exhaustive()
    }
}

impl EventFeed {
    /// Starts the task that applies reports to `shared`'s router.
    pub fn start(shared: Arc<Shared>) -> Self {
        let exported = shared.metrics.kv_subscribers.clone();
        let (tx, mut rx) = mpsc::channel::<SubscriberEvent>(4096);
        tokio::spawn(async move {
            while let Some(event) = rx.recv().await {
                shared.apply_feed(event);
            }
        });
        Self {
            tx,
            subscribers: Mutex::new(HashMap::new()),
            exported,
        }
    }

    /// Starts a subscriber for worker `id` if it has an events endpoint.
    pub fn subscribe(&self, id: WorkerId, config: &WorkerConfig) {
        let Some(endpoint) = &config.events else { return };
        let sub = SubscriberConfig {
            replay_endpoint: config.replay.clone(),
            topic: config.topic.clone(),
            ..SubscriberConfig::new(id, endpoint.clone())
        };
        let tx = self.tx.clone();
        let exported = self.exported.clone();
        // The handle lives in the task: aborting the task drops it, which stops the subscriber
        // (and ends the export of its counters).
        let task = tokio::spawn(async move {
            let handle: SubscriberHandle = match kvroute_zmq::spawn_subscriber(sub, tx).await {
                Ok(h) => h,
                Err(e) => {
                    tracing::error!(worker = id.0, error = %e, "KV-event subscriber failed to start");
                    return;
                }
            };
            let counters = Arc::clone(handle.counters());
            exported.insert(id, Arc::clone(&counters));
            let export = Exported {
                exported,
                worker: id,
                counters,
            };
            std::future::pending::<()>().await;
            drop((export, handle));
        });
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(old) = subs.insert(id, task) {
            old.abort();
        }
    }

    /// Stops worker `id`'s subscriber.
    pub fn unsubscribe(&self, id: WorkerId) {
        let mut subs = self.subscribers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(task) = subs.remove(&id) {
            task.abort();
        }
    }
}

impl Drop for EventFeed {
    fn drop(&mut self) {
        let subs = self.subscribers.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, task) in subs.drain() {
            task.abort();
        }
    }
}
