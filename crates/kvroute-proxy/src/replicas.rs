//! Router replicas: the proxy's side of replica sync ([`kvroute_sync`]). The transport hands
//! peers' messages here; load changes go to the router driver ([`crate::driver`]), registry
//! changes to the same paths an operator's change takes (an added worker gets its KV-event
//! subscriber and registration checks, as one added through the admin API does).

use std::sync::Arc;

use kvroute_core::router::RouterId;
use kvroute_sync::{Sync, SyncHost, SyncMetrics, WireEvent, WorkerChange};

use crate::config::WorkerConfig;
use crate::driver::Shared;

/// How a peer's added worker is started here (the proxy's own add path).
pub type AddWorker = Box<dyn Fn(WorkerConfig) -> Result<(), String> + Send + std::marker::Sync>;

struct Host {
    shared: Arc<Shared>,
    add: AddWorker,
}

impl SyncHost for Host {
    fn apply(&self, from: RouterId, events: &[WireEvent]) {
        // Load changes in runs, registry changes one by one, all in order.
        let mut run = 0;
        for (i, event) in events.iter().enumerate() {
            if let WireEvent::Worker(change) = event {
                self.shared.apply_peer_events(from, &events[run..i]);
                self.worker_change(change);
                run = i + 1;
            }
        }
        if run < events.len() {
            self.shared.apply_peer_events(from, &events[run..]);
        }
    }

    fn peer_lost(&self, peer: RouterId) {
        self.shared.release_peer(peer);
    }

    fn snapshot(&self) -> Vec<WireEvent> {
        self.shared.sync_snapshot()
    }
}

impl Host {
    fn worker_change(&self, change: &WorkerChange) {
        let WorkerChange::Added { config } = change else {
            self.shared.apply_peer_worker_change(change);
            return;
        };
        let config = match serde_json::from_value::<WorkerConfig>(config.clone()) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "a peer's worker configuration was refused");
                return;
            }
        };
        if self
            .shared
            .find_worker(config.url.trim_end_matches('/'))
            .is_some()
        {
            return;
        }
        let url = config.url.clone();
        match (self.add)(config) {
            Ok(()) => tracing::info!(url, "worker added by a peer replica"),
            Err(e) => tracing::warn!(url, error = e, "a peer's worker was refused"),
        }
    }
}

/// Starts replica sync when `nats` is configured: connects, joins (this replica takes its
/// peers' registry and in-flight load before it serves), and attaches the transport to the
/// driver. Nothing without `nats`.
pub async fn start(shared: &Arc<Shared>, id: RouterId, add: AddWorker) -> Result<(), String> {
    let Some(config) = shared.config.sync_config() else {
        return Ok(());
    };
    let metrics = SyncMetrics::new(shared.metrics.registry()).map_err(|e| e.to_string())?;
    let host = Arc::new(Host {
        shared: Arc::clone(shared),
        add,
    });
    let sync = Sync::start(id, config, host, metrics)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(replica = format!("{:016x}", id.0), "replica sync on NATS");
    shared.attach_sync(sync);
    Ok(())
}
